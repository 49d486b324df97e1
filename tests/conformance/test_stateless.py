"""Renew and release from the key and the token alone, from any client (story 5).

A web handler receiving a heartbeat keeps nothing in memory: it opens a client on
the store's URL and calls ``renew(key, token)`` or ``release(key, token)``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import secrets
import time
from collections.abc import Callable
from typing import Any

import pytest

import keymutex

from ._support import (
    PATIENCE,
    assert_is_holder_of,
    await_out,
    await_until,
    wait_out,
    wait_until,
)

SHORT_TTL = 1.0  # the heartbeat comes from a client made after the grant: room for that


def test_heartbeat_from_another_client_keeps_the_lease(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    page = make_locks(owner="alice")
    lease = page.acquire("article:7", ttl=SHORT_TTL, info={"window": 1})
    key, token = lease.key, lease.token

    heartbeat = make_locks().renew(key, token, ttl=60)
    assert heartbeat.key == key
    assert heartbeat.token == token
    assert heartbeat.fence == lease.fence
    assert heartbeat.owner == "alice"
    assert heartbeat.info == {"window": 1}
    assert 0 < heartbeat.remaining <= 60
    seen = page.holder(key)
    assert seen is not None
    assert seen.expires_at >= time.time() + 30

    # Past the original TTL, the key is still held: the heartbeat extended it.
    wait_out(lease)
    with pytest.raises(keymutex.Locked) as refused:
        make_locks().acquire(key, timeout=0)
    assert refused.value.holder.fence == lease.fence  # type: ignore[union-attr]

    # Closing the page: release by key and token from yet another client.
    make_locks().release(key, token)
    assert page.holder(key) is None
    make_locks().acquire(key, timeout=0).release()


@pytest.mark.asyncio
async def test_heartbeat_from_another_client_keeps_the_lease_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    page = make_alocks(owner="alice")
    lease = await page.acquire("article:7", ttl=SHORT_TTL, info={"window": 1})
    key, token = lease.key, lease.token

    heartbeat = await make_alocks().renew(key, token, ttl=60)
    assert heartbeat.key == key
    assert heartbeat.token == token
    assert heartbeat.fence == lease.fence
    assert heartbeat.owner == "alice"
    assert heartbeat.info == {"window": 1}
    assert 0 < heartbeat.remaining <= 60
    seen = await page.holder(key)
    assert seen is not None
    assert seen.expires_at >= time.time() + 30

    await await_out(lease)
    with pytest.raises(keymutex.Locked) as refused:
        await make_alocks().acquire(key, timeout=0)
    assert refused.value.holder.fence == lease.fence  # type: ignore[union-attr]

    await make_alocks().release(key, token)
    assert await page.holder(key) is None
    await (await make_alocks().acquire(key, timeout=0)).release()


@pytest.mark.asyncio
async def test_stateless_calls_work_across_sync_and_async_clients(
    make_locks: Callable[..., keymutex.Locks], make_alocks: Callable[..., keymutex.AsyncLocks]
) -> None:
    lease = make_locks().acquire("article:7")
    renewed = await make_alocks().renew("article:7", lease.token)
    assert renewed.fence == lease.fence
    await make_alocks().release("article:7", lease.token)
    assert make_locks().holder("article:7") is None

    alease = await make_alocks().acquire("article:7")
    make_locks().renew("article:7", alease.token)
    make_locks().release("article:7", alease.token)
    assert await make_alocks().holder("article:7") is None


def test_stateless_renew_defaults_to_the_clients_ttl(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    renewer = make_locks(ttl=40.0)
    renewer.holder("doc")  # connected first: the short lease is not spent on that
    lease = make_locks().acquire("doc", ttl=SHORT_TTL)
    renewed = renewer.renew("doc", lease.token)
    assert 30 < renewed.remaining <= 40
    seen = make_locks().holder("doc")
    assert seen is not None
    assert abs(seen.expires_at - (time.time() + 40)) < 5
    renewed.release()


@pytest.mark.asyncio
async def test_stateless_renew_defaults_to_the_clients_ttl_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    renewer = make_alocks(ttl=40.0)
    await renewer.holder("doc")  # connected first: the short lease is not spent on that
    lease = await make_alocks().acquire("doc", ttl=SHORT_TTL)
    renewed = await renewer.renew("doc", lease.token)
    assert 30 < renewed.remaining <= 40
    seen = await make_alocks().holder("doc")
    assert seen is not None
    assert abs(seen.expires_at - (time.time() + 40)) < 5
    await renewed.release()


def test_renewed_lease_object_can_release(make_locks: Callable[..., keymutex.Locks]) -> None:
    lease = make_locks().acquire("doc")
    renewed = make_locks().renew("doc", lease.token)
    renewed.release()
    assert make_locks().holder("doc") is None
    with pytest.raises(keymutex.LockLost):
        lease.release()


def test_wrong_token_is_refused_and_changes_nothing(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    lease = make_locks().acquire("doc")
    stranger = make_locks()
    forged = secrets.token_urlsafe(18)
    with pytest.raises(keymutex.LockLost) as lost:
        stranger.renew("doc", forged)
    assert lost.value.key == "doc"
    assert_is_holder_of(lost.value.holder, lease)
    with pytest.raises(keymutex.LockLost) as lost:
        stranger.release("doc", forged)
    assert_is_holder_of(lost.value.holder, lease)
    # The token of another key does not work on this one either.
    other = make_locks().acquire("other")
    with pytest.raises(keymutex.LockLost):
        stranger.release("doc", other.token)
    assert_is_holder_of(stranger.holder("doc"), lease)
    # A token for a key nobody holds: LockLost with no holder.
    with pytest.raises(keymutex.LockLost) as lost:
        stranger.renew("free", lease.token)
    assert lost.value.key == "free"
    assert lost.value.holder is None
    assert stranger.holder("free") is None
    lease.release()
    other.release()


@pytest.mark.asyncio
async def test_wrong_token_is_refused_and_changes_nothing_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    lease = await make_alocks().acquire("doc")
    stranger = make_alocks()
    forged = secrets.token_urlsafe(18)
    with pytest.raises(keymutex.LockLost) as lost:
        await stranger.renew("doc", forged)
    assert lost.value.key == "doc"
    assert_is_holder_of(lost.value.holder, lease)
    with pytest.raises(keymutex.LockLost) as lost:
        await stranger.release("doc", forged)
    assert_is_holder_of(lost.value.holder, lease)
    other = await make_alocks().acquire("other")
    with pytest.raises(keymutex.LockLost):
        await stranger.release("doc", other.token)
    assert_is_holder_of(await stranger.holder("doc"), lease)
    with pytest.raises(keymutex.LockLost) as lost:
        await stranger.renew("free", lease.token)
    assert lost.value.key == "free"
    assert lost.value.holder is None
    assert await stranger.holder("free") is None
    await lease.release()
    await other.release()


def test_old_token_is_refused_after_the_key_changed_hands(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    # The displaced window's next heartbeat learns that the lock is held by someone else.
    alice = make_locks(owner="alice")
    first = alice.acquire("doc", ttl=SHORT_TTL)
    second = make_locks(owner="bob").acquire("doc", timeout=PATIENCE)  # after expiry
    heartbeat = make_locks()
    with pytest.raises(keymutex.LockLost) as lost:
        heartbeat.renew("doc", first.token)
    assert_is_holder_of(lost.value.holder, second)
    assert lost.value.holder.owner == "bob"  # type: ignore[union-attr]
    with pytest.raises(keymutex.LockLost) as lost:
        heartbeat.release("doc", first.token)
    assert_is_holder_of(lost.value.holder, second)
    assert_is_holder_of(heartbeat.holder("doc"), second)
    second.release()


@pytest.mark.asyncio
async def test_old_token_is_refused_after_the_key_changed_hands_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    first = await make_alocks(owner="alice").acquire("doc", ttl=SHORT_TTL)
    second = await make_alocks(owner="bob").acquire("doc", timeout=PATIENCE)
    heartbeat = make_alocks()
    with pytest.raises(keymutex.LockLost) as lost:
        await heartbeat.renew("doc", first.token)
    assert_is_holder_of(lost.value.holder, second)
    with pytest.raises(keymutex.LockLost) as lost:
        await heartbeat.release("doc", first.token)
    assert_is_holder_of(lost.value.holder, second)
    assert_is_holder_of(await heartbeat.holder("doc"), second)
    await second.release()


def test_release_twice_raises_lock_lost(make_locks: Callable[..., keymutex.Locks]) -> None:
    locks = make_locks()
    lease = locks.acquire("doc")
    lease.release()
    with pytest.raises(keymutex.LockLost) as lost:
        lease.release()
    assert lost.value.key == "doc"
    assert lost.value.holder is None
    with pytest.raises(keymutex.LockLost):
        locks.release("doc", lease.token)
    with pytest.raises(keymutex.LockLost):
        make_locks().release("doc", lease.token)
    with pytest.raises(keymutex.LockLost):
        lease.renew()
    assert locks.holder("doc") is None


@pytest.mark.asyncio
async def test_release_twice_raises_lock_lost_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    alocks = make_alocks()
    lease = await alocks.acquire("doc")
    await lease.release()
    with pytest.raises(keymutex.LockLost) as lost:
        await lease.release()
    assert lost.value.key == "doc"
    assert lost.value.holder is None
    with pytest.raises(keymutex.LockLost):
        await alocks.release("doc", lease.token)
    with pytest.raises(keymutex.LockLost):
        await make_alocks().release("doc", lease.token)
    with pytest.raises(keymutex.LockLost):
        await lease.renew()
    assert await alocks.holder("doc") is None


def test_released_token_cannot_touch_the_next_holder(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    # "delete can remove somebody else's lock" (story 4) must be impossible.
    locks = make_locks()
    first = locks.acquire("doc")
    first.release()
    second = make_locks().acquire("doc")
    with pytest.raises(keymutex.LockLost) as lost:
        first.release()
    assert_is_holder_of(lost.value.holder, second)
    with pytest.raises(keymutex.LockLost):
        locks.release("doc", first.token)
    assert_is_holder_of(locks.holder("doc"), second)
    second.release()


@pytest.mark.asyncio
async def test_released_token_cannot_touch_the_next_holder_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    alocks = make_alocks()
    first = await alocks.acquire("doc")
    await first.release()
    second = await make_alocks().acquire("doc")
    with pytest.raises(keymutex.LockLost) as lost:
        await first.release()
    assert_is_holder_of(lost.value.holder, second)
    with pytest.raises(keymutex.LockLost):
        await alocks.release("doc", first.token)
    assert_is_holder_of(await alocks.holder("doc"), second)
    await second.release()


def test_lease_renew_extends_with_new_ttl(locks: keymutex.Locks) -> None:
    lease = locks.acquire("doc", ttl=SHORT_TTL)
    lease.renew(ttl=60)
    assert 30 < lease.remaining <= 60
    assert lease.expires_at >= time.time() + 30
    assert lease.lost is False
    seen = locks.holder("doc")
    assert seen is not None
    assert seen.expires_at >= time.time() + 30
    lease.release()


@pytest.mark.asyncio
async def test_lease_renew_extends_with_new_ttl_async(alocks: keymutex.AsyncLocks) -> None:
    lease = await alocks.acquire("doc", ttl=SHORT_TTL)
    await lease.renew(ttl=60)
    assert 30 < lease.remaining <= 60
    assert lease.expires_at >= time.time() + 30
    assert lease.lost is False
    seen = await alocks.holder("doc")
    assert seen is not None
    assert seen.expires_at >= time.time() + 30
    await lease.release()


# -- a store step the lock server relies on ------------------------------------------


def test_an_acquire_with_the_token_that_holds_the_key_is_answered_that_lease(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    """The lock server answers a retried acquire (its first reply lost) with the lease
    its token already holds: same fence, owner and info. Its expiry is never shortened;
    Redis extends it to the ttl asked, the other stores leave it as it stands.
    """
    locks = make_locks(owner="alice")
    lease = locks.acquire("retried", ttl=60, info={"try": 1})
    before = locks.holder("retried")
    again = locks._store.try_acquire(
        "retried",
        token=lease.token,
        ttl=120,
        owner="bob",
        info={"try": 2},
        steal=False,
        waiter=None,
    )
    assert again.ok, f"refused by its own lease: {again}"
    assert again.holder is not None
    assert_is_holder_of(again.holder, lease)
    assert again.holder.info == {"try": 1}
    seen = locks.holder("retried")
    assert seen is not None
    assert before is not None
    assert (seen.fence, seen.owner, seen.info) == (before.fence, "alice", {"try": 1})
    moved = seen.expires_at - before.expires_at
    assert -0.5 < moved < 60.5, f"the retry moved the lease's expiry by {moved:.3f} s"
    lease.release()
    assert locks.holder("retried") is None


def test_a_waiting_acquire_with_the_token_that_holds_the_key_is_answered_that_lease(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    """The lock server's retry of a waiting acquire (its first reply lost) goes through
    ``Locks``: it is answered with the lease its token holds, at once, not after that
    lease's TTL; and when that lease is released the key is free (the retry left no
    place in the queue behind it)."""
    locks = make_locks(owner="alice")
    lease = locks.acquire("retried", ttl=60, info={"try": 1})
    before = locks.holder("retried")
    retry = dataclasses.replace(
        locks._config.request("retried", 120, 5.0, False, {"try": 2}, False, None),
        token=lease.token,
    )
    try:
        again = locks._acquire(retry)
    except keymutex.Locked as exc:
        pytest.fail(f"refused by its own lease: {exc}")
    assert again.fence == lease.fence
    seen = locks.holder("retried")
    assert seen is not None
    assert before is not None
    assert (seen.fence, seen.owner, seen.info) == (before.fence, "alice", {"try": 1})
    lease.release()
    assert locks.holder("retried") is None
    other = make_locks(owner="bob").acquire("retried", timeout=0)
    assert other.fence > lease.fence
    other.release()


# A mutation audit found no test of the store's own expiry check in renew and release:
# a renew by token could revive an expired lease (SQLite, PostgreSQL), and a release of
# one be told it released (memcached and ZooKeeper, by the client that granted it).
# ``Lease.renew()`` checks its own deadline first; the stateless calls of a web
# heartbeat rely on the store alone.
#
# The store is asked again at once (no pause between reads), and the renewal follows
# the first read that shows the key free without a pause either: a store whose
# ``holder()`` calls a lease gone while its renew still finds it is caught in that
# instant. (Redis did so for the millisecond in which PTTL is 0: 47 times in 60.)
# Three leases, a third of a TTL apart, are three tries at that instant.
EXPIRY_TRIES = 3


def _releasers(lease: Any, granter: Any) -> list[Any]:
    """Who releases first, before the other client's renewal (which may clear the
    expired lease away): for the first lease, the client that granted it, whose store
    knows the lease (memcached and ZooKeeper take another path there); for the others,
    nobody, so that the renewal comes right after the read that saw the key free."""
    return [granter] if lease.key.endswith(":0") else []


def _free(locks: keymutex.Locks, key: str) -> bool:
    return locks.holder(key) is None


async def _afree(locks: keymutex.AsyncLocks, key: str) -> bool:
    return await locks.holder(key) is None


def test_a_token_whose_lease_expired_is_refused_by_renew_and_release(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    locks, heartbeat = make_locks(), make_locks()
    leases: list[keymutex.Lease] = []
    for number in range(EXPIRY_TRIES):
        leases.append(locks.acquire(f"expired:{number}", ttl=SHORT_TTL))
        time.sleep(SHORT_TTL / EXPIRY_TRIES)
    for lease in leases:
        key = lease.key
        wait_out(lease)
        wait_until(functools.partial(_free, heartbeat, key), f"{key!r} is seen free", every=0)
        for client in _releasers(lease, locks):
            with pytest.raises(keymutex.LockLost):
                client.release(key, lease.token)
        with pytest.raises(keymutex.LockLost):
            heartbeat.renew(key, lease.token, ttl=60)
        assert heartbeat.holder(key) is None, "the renewal revived an expired lease"
        with pytest.raises(keymutex.LockLost):
            heartbeat.release(key, lease.token)
        make_locks().acquire(key, timeout=0).release()


@pytest.mark.asyncio
async def test_a_token_whose_lease_expired_is_refused_by_renew_and_release_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    locks, heartbeat = make_alocks(), make_alocks()
    leases: list[keymutex.AsyncLease] = []
    for number in range(EXPIRY_TRIES):
        leases.append(await locks.acquire(f"expired:{number}", ttl=SHORT_TTL))
        await asyncio.sleep(SHORT_TTL / EXPIRY_TRIES)
    for lease in leases:
        key = lease.key
        await await_out(lease)
        free = functools.partial(_afree, heartbeat, key)
        await await_until(free, f"{key!r} is seen free", every=0)
        for client in _releasers(lease, locks):
            with pytest.raises(keymutex.LockLost):
                await client.release(key, lease.token)
        with pytest.raises(keymutex.LockLost):
            await heartbeat.renew(key, lease.token, ttl=60)
        assert await heartbeat.holder(key) is None, "the renewal revived an expired lease"
        with pytest.raises(keymutex.LockLost):
            await heartbeat.release(key, lease.token)
        await (await make_alocks().acquire(key, timeout=0)).release()

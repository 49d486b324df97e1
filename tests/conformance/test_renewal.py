"""Background renewal keeps a lease alive; when it fails, ``on_lost`` fires once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import keymutex
from keymutex._store import RenewRequest

from ._support import PATIENCE, assert_is_holder_of, wait_until

# A renewal reply that comes after the lease's local deadline no longer saves it (the
# holder was told at the deadline): a TTL that leaves a busy host (or a lock server on
# one) room for each renewal's round trip.
SHORT_TTL = 1.5  # 1.0 lost a ZooKeeper lease once with both cores saturated
HOLD_FOR = 4.6  # more than three TTLs
# Twenty leases renewed together: a batch per tick that a busy host (or a lock server
# on one) may take a while to answer, so a TTL that leaves it room.
# 1.0 lost one of twenty PostgreSQL leases with both cores saturated; 1.5 lost five of
# twenty (one batch: its renewal answered over a second late) on the lock server on Redis,
# and on etcd over TLS, in clean-clone CI runs (-n 4, every server on two cores).
MANY_TTL = 3.0
MANY_HOLD_FOR = 6.5  # over two TTLs: six renewals each


def test_lock_renews_past_several_ttls(make_locks: Callable[..., keymutex.Locks]) -> None:
    other = make_locks()
    with make_locks().lock("job", ttl=SHORT_TTL) as lease:
        time.sleep(HOLD_FOR)  # holding the lock is the scenario; nothing is timed
        assert lease.lost is False
        assert 0 < lease.remaining <= SHORT_TTL
        assert_is_holder_of(other.holder("job"), lease)
        with pytest.raises(keymutex.Locked):
            other.acquire("job", timeout=0)
    assert other.holder("job") is None


@pytest.mark.asyncio
async def test_lock_renews_past_several_ttls_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    other = make_alocks()
    async with make_alocks().lock("job", ttl=SHORT_TTL) as lease:
        await asyncio.sleep(HOLD_FOR)
        assert lease.lost is False
        assert 0 < lease.remaining <= SHORT_TTL
        assert_is_holder_of(await other.holder("job"), lease)
        with pytest.raises(keymutex.Locked):
            await other.acquire("job", timeout=0)
    assert await other.holder("job") is None


def test_lock_renews_with_the_clients_default_ttl(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    other = make_locks()
    with make_locks(ttl=SHORT_TTL).lock("job") as lease:
        time.sleep(HOLD_FOR)
        assert lease.lost is False
        assert 0 < lease.remaining <= SHORT_TTL
        assert_is_holder_of(other.holder("job"), lease)
    assert other.holder("job") is None


def test_acquire_with_renew_true_renews_until_released(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    other = make_locks()
    lease = make_locks().acquire("job", ttl=SHORT_TTL, renew=True)
    time.sleep(HOLD_FOR)
    assert lease.lost is False
    assert_is_holder_of(other.holder("job"), lease)
    lease.release()
    assert other.holder("job") is None


@pytest.mark.asyncio
async def test_acquire_with_renew_true_renews_until_released_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    other = make_alocks()
    lease = await make_alocks().acquire("job", ttl=SHORT_TTL, renew=True)
    await asyncio.sleep(HOLD_FOR)
    assert lease.lost is False
    assert_is_holder_of(await other.holder("job"), lease)
    await lease.release()
    assert await other.holder("job") is None


def test_many_renewing_leases_in_one_client(make_locks: Callable[..., keymutex.Locks]) -> None:
    locks, other = make_locks(), make_locks()
    keys = [f"job:{i}" for i in range(20)]
    leases = [locks.acquire(key, ttl=MANY_TTL, renew=True) for key in keys]
    time.sleep(MANY_HOLD_FOR)
    assert [lease.lost for lease in leases] == [False] * len(keys)
    assert sorted(h.key for h in other.holders("job:")) == sorted(keys)
    for lease in leases:
        lease.release()
    assert list(other.holders("job:")) == []


@pytest.mark.asyncio
async def test_many_renewing_leases_in_one_client_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    alocks, other = make_alocks(), make_alocks()
    keys = [f"job:{i}" for i in range(20)]
    leases = [await alocks.acquire(key, ttl=MANY_TTL, renew=True) for key in keys]
    await asyncio.sleep(MANY_HOLD_FOR)
    assert [lease.lost for lease in leases] == [False] * len(keys)
    assert sorted(h.key for h in await other.holders("job:")) == sorted(keys)
    for lease in leases:
        await lease.release()
    assert list(await other.holders("job:")) == []


def test_on_lost_fires_once_when_a_renewing_lease_is_stolen(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    calls: list[Any] = []
    fired = threading.Event()

    def on_lost(lease: Any) -> None:
        calls.append(lease)
        fired.set()

    thief = make_locks(owner="thief")
    with (  # noqa: PT012 - the block is the subject
        pytest.raises(keymutex.LockLost) as lost,
        make_locks().lock("job", ttl=SHORT_TTL, on_lost=on_lost) as lease,
    ):
        stolen = thief.acquire("job", steal=True, timeout=0)
        assert fired.wait(PATIENCE), "on_lost was not called"
        assert lease.lost is True
        time.sleep(SHORT_TTL)  # more renewal rounds: none may call on_lost again
    assert calls == [lease]
    assert_is_holder_of(lost.value.holder, stolen)
    assert lease.lost is True
    assert_is_holder_of(thief.holder("job"), stolen)
    stolen.release()


def test_a_batch_renewal_refuses_stale_tokens_and_leaves_the_new_holders_alone(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    """The renewer sends the leases due together in one batch (the store's
    ``renew_many``). Found by a mutation audit: nothing checked that a batch refuses a
    token whose lease was stolen or has expired (PostgreSQL's would have renewed the
    thief's lease to the old holder's TTL, and told the old holder it still held it)."""
    holder, thief = make_locks(), make_locks(owner="thief")
    kept = holder.acquire("kept", ttl=60)
    taken = holder.acquire("taken", ttl=60)
    ended = holder.acquire("ended", ttl=SHORT_TTL)
    stolen = thief.acquire("taken", ttl=60, steal=True, timeout=0)
    wait_until(lambda: thief.holder("ended") is None, "the store sees the lease expired")
    outcomes = holder._store.renew_many(
        [
            RenewRequest("kept", kept.token, 30.0),
            RenewRequest("taken", taken.token, 2.0),
            RenewRequest("ended", ended.token, 30.0),
        ]
    )
    assert [outcome.ok for outcome in outcomes] == [True, False, False]
    seen = thief.holder("taken")
    assert_is_holder_of(seen, stolen)
    assert seen is not None
    assert seen.expires_at - time.time() > 30, "a stale token renewed the thief's lease"
    assert thief.holder("ended") is None, "a batch revived an expired lease"
    kept.release()
    stolen.release()


def test_on_lost_fires_once_for_a_renewing_acquire(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    calls: list[Any] = []
    fired = threading.Event()

    def on_lost(lease: Any) -> None:
        calls.append(lease)
        fired.set()

    lease = make_locks().acquire("job", ttl=SHORT_TTL, renew=True, on_lost=on_lost)
    stolen = make_locks().acquire("job", steal=True, timeout=0)
    assert fired.wait(PATIENCE), "on_lost was not called"
    assert lease.lost is True
    with pytest.raises(keymutex.LockLost) as lost:
        lease.release()
    assert_is_holder_of(lost.value.holder, stolen)
    assert calls == [lease]
    stolen.release()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["function", "coroutine function"])
async def test_on_lost_fires_once_when_a_renewing_lease_is_stolen_async(
    make_alocks: Callable[..., keymutex.AsyncLocks], kind: str
) -> None:
    calls: list[Any] = []
    fired = asyncio.Event()

    def plain(lease: Any) -> None:
        calls.append(lease)
        fired.set()

    async def coroutine(lease: Any) -> None:
        await asyncio.sleep(0)
        plain(lease)

    on_lost = plain if kind == "function" else coroutine
    thief = make_alocks(owner="thief")
    with pytest.raises(keymutex.LockLost) as lost:  # noqa: PT012 - the block is the subject
        async with make_alocks().lock("job", ttl=SHORT_TTL, on_lost=on_lost) as lease:
            stolen = await thief.acquire("job", steal=True, timeout=0)
            async with asyncio.timeout(PATIENCE):
                await fired.wait()
            assert lease.lost is True
            await asyncio.sleep(SHORT_TTL)
    assert calls == [lease]
    assert_is_holder_of(lost.value.holder, stolen)
    assert lease.lost is True
    assert_is_holder_of(await thief.holder("job"), stolen)
    await stolen.release()


def test_on_lost_is_not_called_for_a_normal_release(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    calls: list[Any] = []
    with make_locks().lock("job", ttl=SHORT_TTL, on_lost=calls.append) as lease:
        time.sleep(SHORT_TTL)
    lease_after = make_locks().acquire("job", timeout=0)
    time.sleep(SHORT_TTL)  # the old renewer, were it still running, would fail now
    assert calls == []
    assert lease.lost is False
    lease_after.release()


@pytest.mark.asyncio
async def test_on_lost_is_not_called_for_a_normal_release_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    calls: list[Any] = []
    async with make_alocks().lock("job", ttl=SHORT_TTL, on_lost=calls.append) as lease:
        await asyncio.sleep(SHORT_TTL)
    lease_after = await make_alocks().acquire("job", timeout=0)
    await asyncio.sleep(SHORT_TTL)
    assert calls == []
    assert lease.lost is False
    await lease_after.release()

"""Leases expire, can be taken over, and their old holder finds out (``LockLost``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

import keymutex
from keymutex._lease import Outcome

from ._support import PATIENCE, assert_is_holder_of, await_out, wait_out

SHORT_TTL = 0.3


# --- expiry ---------------------------------------------------------------------


def test_expired_lease_can_be_acquired_by_another(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    first, second = make_locks(), make_locks()
    old = first.acquire("job", ttl=SHORT_TTL, renew=False)
    # A waiter with a generous timeout gets the key once the old lease expires.
    new = second.acquire("job", timeout=PATIENCE)
    assert new.fence > old.fence
    assert_is_holder_of(first.holder("job"), new)
    assert old.lost is True

    with pytest.raises(keymutex.LockLost) as lost:
        old.release()
    assert lost.value.key == "job"
    assert_is_holder_of(lost.value.holder, new)

    with pytest.raises(keymutex.LockLost) as lost:
        old.renew()
    assert lost.value.key == "job"
    assert_is_holder_of(lost.value.holder, new)

    # The failed calls changed nothing: the new lease still holds and works.
    assert_is_holder_of(second.holder("job"), new)
    new.renew()
    new.release()
    assert second.holder("job") is None


@pytest.mark.asyncio
async def test_expired_lease_can_be_acquired_by_another_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    first, second = make_alocks(), make_alocks()
    old = await first.acquire("job", ttl=SHORT_TTL, renew=False)
    new = await second.acquire("job", timeout=PATIENCE)
    assert new.fence > old.fence
    assert_is_holder_of(await first.holder("job"), new)
    assert old.lost is True

    with pytest.raises(keymutex.LockLost) as lost:
        await old.release()
    assert lost.value.key == "job"
    assert_is_holder_of(lost.value.holder, new)

    with pytest.raises(keymutex.LockLost) as lost:
        await old.renew()
    assert lost.value.key == "job"
    assert_is_holder_of(lost.value.holder, new)

    assert_is_holder_of(await second.holder("job"), new)
    await new.renew()
    await new.release()
    assert await second.holder("job") is None


def test_expired_lease_nobody_took_is_lost(locks: keymutex.Locks) -> None:
    lease = locks.acquire("job", ttl=SHORT_TTL, renew=False)
    wait_out(lease)
    assert lease.lost is True
    with pytest.raises(keymutex.LockLost) as lost:
        lease.renew()
    assert lost.value.key == "job"
    assert lost.value.holder is None
    with pytest.raises(keymutex.LockLost) as lost:
        lease.release()
    assert lost.value.holder is None
    assert locks.holder("job") is None
    # ... and the key is free for anyone, at once.
    locks.acquire("job", timeout=0).release()


@pytest.mark.asyncio
async def test_expired_lease_nobody_took_is_lost_async(alocks: keymutex.AsyncLocks) -> None:
    lease = await alocks.acquire("job", ttl=SHORT_TTL, renew=False)
    await await_out(lease)
    assert lease.lost is True
    with pytest.raises(keymutex.LockLost) as lost:
        await lease.renew()
    assert lost.value.key == "job"
    assert lost.value.holder is None
    with pytest.raises(keymutex.LockLost) as lost:
        await lease.release()
    assert lost.value.holder is None
    assert await alocks.holder("job") is None
    await (await alocks.acquire("job", timeout=0)).release()


def test_acquire_does_not_renew_by_default(make_locks: Callable[..., keymutex.Locks]) -> None:
    # acquire() defaults to renew=False: the lease expires unless its owner renews it.
    first, second = make_locks(), make_locks()
    old = first.acquire("session", ttl=SHORT_TTL)
    new = second.acquire("session", timeout=PATIENCE)
    assert new.fence > old.fence
    new.release()


@pytest.mark.asyncio
async def test_acquire_does_not_renew_by_default_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    first, second = make_alocks(), make_alocks()
    old = await first.acquire("session", ttl=SHORT_TTL)
    new = await second.acquire("session", timeout=PATIENCE)
    assert new.fence > old.fence
    await new.release()


def test_locks_default_ttl_applies(make_locks: Callable[..., keymutex.Locks]) -> None:
    first = make_locks(ttl=SHORT_TTL)
    lease = first.acquire("job")
    assert lease.remaining <= SHORT_TTL  # not 30 s, the default (0 or less: a slow grant)
    new = make_locks().acquire("job", timeout=PATIENCE)
    assert new.fence > lease.fence
    new.release()


@pytest.mark.asyncio
async def test_locks_default_ttl_applies_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    first = make_alocks(ttl=SHORT_TTL)
    lease = await first.acquire("job")
    assert lease.remaining <= SHORT_TTL  # not 30 s, the default (0 or less: a slow grant)
    new = await make_alocks().acquire("job", timeout=PATIENCE)
    assert new.fence > lease.fence
    await new.release()


# --- steal ------------------------------------------------------------------------


def test_steal_takes_a_held_key_and_the_old_token_stops_working(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    alice = make_locks(owner="alice")
    bob = make_locks(owner="bob")
    old = alice.acquire("doc", info={"name": "Alice"})
    new = bob.acquire("doc", steal=True, timeout=0, info={"name": "Bob"})
    assert new.fence > old.fence
    assert new.owner == "bob"
    assert_is_holder_of(alice.holder("doc"), new)

    with pytest.raises(keymutex.LockLost) as lost:
        old.renew()
    assert lost.value.key == "doc"
    assert_is_holder_of(lost.value.holder, new)
    assert old.lost is True
    with pytest.raises(keymutex.LockLost) as lost:
        alice.release("doc", old.token)
    assert_is_holder_of(lost.value.holder, new)
    with pytest.raises(keymutex.LockLost):
        old.release()
    # Bob's lease is untouched by Alice's failed attempts.
    assert_is_holder_of(alice.holder("doc"), new)
    new.release()


@pytest.mark.asyncio
async def test_steal_takes_a_held_key_and_the_old_token_stops_working_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    alice = make_alocks(owner="alice")
    bob = make_alocks(owner="bob")
    old = await alice.acquire("doc", info={"name": "Alice"})
    new = await bob.acquire("doc", steal=True, timeout=0, info={"name": "Bob"})
    assert new.fence > old.fence
    assert new.owner == "bob"
    assert_is_holder_of(await alice.holder("doc"), new)

    with pytest.raises(keymutex.LockLost) as lost:
        await old.renew()
    assert lost.value.key == "doc"
    assert_is_holder_of(lost.value.holder, new)
    assert old.lost is True
    with pytest.raises(keymutex.LockLost) as lost:
        await alice.release("doc", old.token)
    assert_is_holder_of(lost.value.holder, new)
    with pytest.raises(keymutex.LockLost):
        await old.release()
    assert_is_holder_of(await alice.holder("doc"), new)
    await new.release()


def test_steal_of_a_free_key_is_a_plain_acquire(locks: keymutex.Locks) -> None:
    lease = locks.acquire("doc", steal=True, timeout=0)
    assert_is_holder_of(locks.holder("doc"), lease)
    lease.release()
    assert locks.holder("doc") is None


@pytest.mark.asyncio
async def test_steal_of_a_free_key_is_a_plain_acquire_async(alocks: keymutex.AsyncLocks) -> None:
    lease = await alocks.acquire("doc", steal=True, timeout=0)
    assert_is_holder_of(await alocks.holder("doc"), lease)
    await lease.release()
    assert await alocks.holder("doc") is None


# --- leaving a block whose lease was lost ---------------------------------------------


@pytest.mark.parametrize("renew", [True, False])
def test_leaving_block_after_steal_raises_lock_lost(
    make_locks: Callable[..., keymutex.Locks], renew: bool
) -> None:
    thief = make_locks(owner="thief")
    with pytest.raises(keymutex.LockLost) as lost, make_locks().lock("doc", renew=renew) as lease:
        stolen = thief.acquire("doc", steal=True, timeout=0)
    assert lost.value.key == "doc"
    assert_is_holder_of(lost.value.holder, stolen)
    assert lease.lost is True
    # The thief's lease survived the old holder's exit.
    assert_is_holder_of(thief.holder("doc"), stolen)
    stolen.release()


@pytest.mark.asyncio
@pytest.mark.parametrize("renew", [True, False])
async def test_leaving_block_after_steal_raises_lock_lost_async(
    make_alocks: Callable[..., keymutex.AsyncLocks], renew: bool
) -> None:
    thief = make_alocks(owner="thief")
    with pytest.raises(keymutex.LockLost) as lost:
        async with make_alocks().lock("doc", renew=renew) as lease:
            stolen = await thief.acquire("doc", steal=True, timeout=0)
    assert lost.value.key == "doc"
    assert_is_holder_of(lost.value.holder, stolen)
    assert lease.lost is True
    assert_is_holder_of(await thief.holder("doc"), stolen)
    await stolen.release()


def test_leaving_block_after_expiry_raises_lock_lost(locks: keymutex.Locks) -> None:
    with (
        pytest.raises(keymutex.LockLost) as lost,
        locks.lock("doc", ttl=SHORT_TTL, renew=False) as lease,
    ):
        wait_out(lease)
    assert lost.value.key == "doc"
    assert lease.lost is True


@pytest.mark.asyncio
async def test_leaving_block_after_expiry_raises_lock_lost_async(
    alocks: keymutex.AsyncLocks,
) -> None:
    with pytest.raises(keymutex.LockLost) as lost:
        async with alocks.lock("doc", ttl=SHORT_TTL, renew=False) as lease:
            await await_out(lease)
    assert lost.value.key == "doc"
    assert lease.lost is True


class BlockFailed(Exception):
    pass


def test_block_error_wins_over_lock_lost(make_locks: Callable[..., keymutex.Locks]) -> None:
    thief = make_locks()
    with pytest.raises(BlockFailed), make_locks().lock("doc") as lease:  # noqa: PT012 - the block is the subject
        thief.acquire("doc", steal=True, timeout=0)
        raise BlockFailed
    assert lease.lost is True


@pytest.mark.asyncio
async def test_block_error_wins_over_lock_lost_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    thief = make_alocks()
    with pytest.raises(BlockFailed):  # noqa: PT012 - the block is the subject
        async with make_alocks().lock("doc") as lease:
            await thief.acquire("doc", steal=True, timeout=0)
            raise BlockFailed
    assert lease.lost is True


def test_leaving_block_after_expiry_is_harmless_to_the_next_holder(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    # A stale exit must never release somebody else's lease.
    other = make_locks()
    with (  # noqa: PT012 - the block is the subject
        pytest.raises(keymutex.LockLost),
        make_locks().lock("doc", ttl=SHORT_TTL, renew=False) as lease,
    ):
        wait_out(lease)
        newer = other.acquire("doc", timeout=PATIENCE)
    assert_is_holder_of(other.holder("doc"), newer)
    newer.release()


@pytest.mark.asyncio
async def test_leaving_block_after_expiry_is_harmless_to_the_next_holder_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    other = make_alocks()
    with pytest.raises(keymutex.LockLost):  # noqa: PT012 - the block is the subject
        async with make_alocks().lock("doc", ttl=SHORT_TTL, renew=False) as lease:
            await await_out(lease)
            newer = await other.acquire("doc", timeout=PATIENCE)
    assert_is_holder_of(await other.holder("doc"), newer)
    await newer.release()


# --- a block that raises or is cancelled releases ----------------------------------


def test_block_that_raises_releases(locks: keymutex.Locks) -> None:
    with pytest.raises(BlockFailed), locks.lock("order"):  # noqa: PT012 - the block is the subject
        assert locks.holder("order") is not None
        raise BlockFailed
    assert locks.holder("order") is None
    locks.acquire("order", timeout=0).release()


@pytest.mark.asyncio
async def test_block_that_raises_releases_async(alocks: keymutex.AsyncLocks) -> None:
    with pytest.raises(BlockFailed):  # noqa: PT012 - the block is the subject
        async with alocks.lock("order"):
            assert await alocks.holder("order") is not None
            raise BlockFailed
    assert await alocks.holder("order") is None
    await (await alocks.acquire("order", timeout=0)).release()


@pytest.mark.asyncio
async def test_cancelled_holder_releases_async(alocks: keymutex.AsyncLocks) -> None:
    inside = asyncio.Event()

    async def hold() -> None:
        async with alocks.lock("order"):
            inside.set()
            await asyncio.Event().wait()  # until cancelled

    task = asyncio.create_task(hold())
    async with asyncio.timeout(PATIENCE):
        await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await alocks.holder("order") is None
    await (await alocks.acquire("order", timeout=0)).release()


@pytest.mark.asyncio
async def test_release_cancelled_on_its_way_is_completed_before_aclose_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    """A task cancelled while its ``async with`` block is releasing: the release goes
    on, and ``aclose()`` waits for it, so the key is free afterwards (not held to its
    TTL by a release the closed store never finished)."""
    alocks = make_alocks()
    releasing = asyncio.Event()
    store_release = alocks._store.release

    released = asyncio.Event()

    async def slow_release(key: str, token: str) -> Outcome:
        releasing.set()
        await asyncio.sleep(0.2)  # a slow round trip
        outcome = await store_release(key, token)
        released.set()
        return outcome

    alocks._store.release = slow_release  # type: ignore[method-assign]

    async def hold() -> None:
        async with alocks.lock("order"):
            pass

    task = asyncio.create_task(hold())
    async with asyncio.timeout(PATIENCE):
        await releasing.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not released.is_set()  # the cancelled caller did not wait for the release
    await alocks.aclose()
    assert released.is_set()  # aclose() did
    assert await make_alocks().holder("order") is None

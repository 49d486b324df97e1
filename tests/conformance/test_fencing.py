"""Fences: every grant on a key gets a fence larger than every fence before it."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

import keymutex

from ._support import PATIENCE, await_out, wait_out

SHORT_TTL = 0.3


def _strictly_increasing(fences: list[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(fences))


def test_fences_increase_across_every_kind_of_grant(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    first, second = make_locks(), make_locks()
    fences: list[int] = []

    lease = first.acquire("row")  # first acquire
    fences.append(lease.fence)
    lease.renew()  # a renewal is not a grant: nothing to record, but it must not go back
    lease.release()

    lease = first.acquire("row")  # re-acquire after release, same client
    fences.append(lease.fence)
    lease.release()

    lease = second.acquire("row")  # re-acquire after release, another client
    fences.append(lease.fence)
    assert first.holder("row").fence == lease.fence  # type: ignore[union-attr]

    lease = first.acquire("row", steal=True, timeout=0)  # steal
    fences.append(lease.fence)
    lease.release()

    lease = first.acquire("row", ttl=SHORT_TTL)
    fences.append(lease.fence)
    wait_out(lease)
    lease = second.acquire("row", timeout=PATIENCE)  # re-acquire after expiry
    fences.append(lease.fence)
    lease = first.acquire("row", steal=True, timeout=0)  # steal again
    fences.append(lease.fence)
    lease.release()

    assert all(type(fence) is int for fence in fences)
    assert _strictly_increasing(fences), fences


@pytest.mark.asyncio
async def test_fences_increase_across_every_kind_of_grant_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    first, second = make_alocks(), make_alocks()
    fences: list[int] = []

    lease = await first.acquire("row")
    fences.append(lease.fence)
    await lease.renew()
    await lease.release()

    lease = await first.acquire("row")
    fences.append(lease.fence)
    await lease.release()

    lease = await second.acquire("row")
    fences.append(lease.fence)
    assert (await first.holder("row")).fence == lease.fence  # type: ignore[union-attr]

    lease = await first.acquire("row", steal=True, timeout=0)
    fences.append(lease.fence)
    await lease.release()

    lease = await first.acquire("row", ttl=SHORT_TTL)
    fences.append(lease.fence)
    await await_out(lease)
    lease = await second.acquire("row", timeout=PATIENCE)
    fences.append(lease.fence)
    lease = await first.acquire("row", steal=True, timeout=0)
    fences.append(lease.fence)
    await lease.release()

    assert all(type(fence) is int for fence in fences)
    assert _strictly_increasing(fences), fences


def test_fences_increase_per_key_when_keys_interleave(locks: keymutex.Locks) -> None:
    per_key: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for _ in range(5):
        for key, fences in per_key.items():
            lease = locks.acquire(key)
            fences.append(lease.fence)
            lease.release()
    for key, fences in per_key.items():
        assert _strictly_increasing(fences), (key, fences)


@pytest.mark.asyncio
async def test_fences_increase_per_key_when_keys_interleave_async(
    alocks: keymutex.AsyncLocks,
) -> None:
    per_key: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for _ in range(5):
        for key, fences in per_key.items():
            lease = await alocks.acquire(key)
            fences.append(lease.fence)
            await lease.release()
    for key, fences in per_key.items():
        assert _strictly_increasing(fences), (key, fences)


@pytest.mark.asyncio
async def test_fences_increase_across_sync_and_async_clients(
    make_locks: Callable[..., keymutex.Locks], make_alocks: Callable[..., keymutex.AsyncLocks]
) -> None:
    locks, alocks = make_locks(), make_alocks()
    fences = []
    for _ in range(3):
        lease = locks.acquire("row")
        fences.append(lease.fence)
        lease.release()
        alease = await alocks.acquire("row")
        fences.append(alease.fence)
        await alease.release()
    assert _strictly_increasing(fences), fences


def test_renewal_keeps_the_fence(make_locks: Callable[..., keymutex.Locks]) -> None:
    # A resource that checks fences must keep accepting the holder that renews.
    locks = make_locks()
    lease = locks.acquire("row")
    fence = lease.fence
    lease.renew()
    assert lease.fence == fence
    renewed = make_locks().renew("row", lease.token)
    assert renewed.fence == fence
    assert locks.holder("row").fence == fence  # type: ignore[union-attr]
    lease.release()


@pytest.mark.asyncio
async def test_renewal_keeps_the_fence_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    alocks = make_alocks()
    lease = await alocks.acquire("row")
    fence = lease.fence
    await lease.renew()
    assert lease.fence == fence
    renewed = await make_alocks().renew("row", lease.token)
    assert renewed.fence == fence
    assert (await alocks.holder("row")).fence == fence  # type: ignore[union-attr]
    await lease.release()


def test_fenced_resource_rejects_the_late_writer(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    # The story of API.md: a holder pauses past its expiry, another takes over and
    # writes; the late writer's fence is smaller, so the resource rejects it.
    largest_seen = 0

    def write(fence: int) -> bool:
        nonlocal largest_seen
        if fence < largest_seen:
            return False
        largest_seen = fence
        return True

    paused = make_locks().acquire("account", ttl=SHORT_TTL)
    wait_out(paused)
    successor = make_locks().acquire("account", timeout=PATIENCE)
    assert write(successor.fence) is True
    assert write(paused.fence) is False
    successor.release()


def test_fences_keep_increasing_after_every_client_closed(store_url: str, namespace: str) -> None:
    # Fences belong to the store, not to a client: a new client continues the sequence.
    with keymutex.Locks(store_url, namespace=namespace) as first:
        lease = first.acquire("row")
        lease.release()
    with keymutex.Locks(store_url, namespace=namespace) as second:
        again = second.acquire("row")
        assert again.fence > lease.fence
        again.release()

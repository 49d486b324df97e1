"""What a ``Lease`` tells its holder, and the clients' own lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
from collections.abc import Callable

import pytest

import keymutex

from ._support import (
    HOLDER_FIELDS,
    TOKEN_PATTERN,
    assert_fresh_lease,
    assert_is_holder_of,
    default_owner,
)


def test_acquired_lease_attributes(locks: keymutex.Locks) -> None:
    lease = locks.acquire("user:42", ttl=5.0, info={"page": "edit"})
    assert isinstance(lease, keymutex.Lease)
    assert_fresh_lease(lease, "user:42", 5.0, owner=default_owner(), info={"page": "edit"})
    lease.release()


@pytest.mark.asyncio
async def test_acquired_lease_attributes_async(alocks: keymutex.AsyncLocks) -> None:
    lease = await alocks.acquire("user:42", ttl=5.0, info={"page": "edit"})
    assert isinstance(lease, keymutex.AsyncLease)
    assert_fresh_lease(lease, "user:42", 5.0, owner=default_owner(), info={"page": "edit"})
    await lease.release()


def test_lock_lease_attributes(make_locks: Callable[..., keymutex.Locks]) -> None:
    with make_locks(owner="bob").lock("user:42", ttl=5.0, info={"a": [1]}) as lease:
        assert isinstance(lease, keymutex.Lease)
        assert_fresh_lease(lease, "user:42", 5.0, owner="bob", info={"a": [1]})


@pytest.mark.asyncio
async def test_lock_lease_attributes_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    async with make_alocks(owner="bob").lock("user:42", ttl=5.0, info={"a": [1]}) as lease:
        assert isinstance(lease, keymutex.AsyncLease)
        assert_fresh_lease(lease, "user:42", 5.0, owner="bob", info={"a": [1]})


def test_tokens_are_random_and_url_safe(locks: keymutex.Locks) -> None:
    tokens = set()
    for i in range(50):
        lease = locks.acquire(f"k{i % 3}")
        assert TOKEN_PATTERN.fullmatch(lease.token), lease.token
        tokens.add(lease.token)
        lease.release()
    assert len(tokens) == 50


def test_acquired_lease_is_a_context_manager(locks: keymutex.Locks) -> None:
    with locks.acquire("doc") as lease:
        assert_is_holder_of(locks.holder("doc"), lease)
    assert locks.holder("doc") is None
    # Released: no time left, though not lost (found by review: it went on counting).
    assert (lease.remaining, lease.lost) == (0.0, False)
    with pytest.raises(keymutex.LockLost):
        lease.release()


@pytest.mark.asyncio
async def test_acquired_lease_is_a_context_manager_async(alocks: keymutex.AsyncLocks) -> None:
    async with await alocks.acquire("doc") as lease:
        assert_is_holder_of(await alocks.holder("doc"), lease)
    assert await alocks.holder("doc") is None
    assert (lease.remaining, lease.lost) == (0.0, False)
    with pytest.raises(keymutex.LockLost):
        await lease.release()


def test_lock_releases_at_the_end_of_the_block(locks: keymutex.Locks) -> None:
    with locks.lock("doc") as lease:
        assert_is_holder_of(locks.holder("doc"), lease)
    assert locks.holder("doc") is None
    locks.acquire("doc", timeout=0).release()


@pytest.mark.asyncio
async def test_lock_releases_at_the_end_of_the_block_async(alocks: keymutex.AsyncLocks) -> None:
    async with alocks.lock("doc") as lease:
        assert_is_holder_of(await alocks.holder("doc"), lease)
    assert await alocks.holder("doc") is None
    await (await alocks.acquire("doc", timeout=0)).release()


def test_unicode_and_punctuation_keys_round_trip(locks: keymutex.Locks) -> None:
    keys = ["Zoë/ärger", "emoji 🔒", "quote ' \" `", "semi;colon--", "line\nbreak", "x" * 1024]
    leases = [locks.acquire(key, timeout=0) for key in keys]
    for key, lease in zip(keys, leases, strict=True):
        assert lease.key == key
        assert_is_holder_of(locks.holder(key), lease)
    assert sorted(h.key for h in locks.holders()) == sorted(keys)
    for lease in leases:
        lease.release()


def test_key_of_exactly_1024_utf8_bytes_is_accepted(locks: keymutex.Locks) -> None:
    key = "é" * 512  # 1024 bytes as UTF-8
    lease = locks.acquire(key, timeout=0)
    assert lease.key == key
    assert_is_holder_of(locks.holder(key), lease)
    lease.release()


def test_holder_fields_are_exactly_the_public_ones() -> None:
    assert dataclasses.is_dataclass(keymutex.Holder)
    assert {field.name for field in dataclasses.fields(keymutex.Holder)} == HOLDER_FIELDS


# --- the clients' lifecycle ---------------------------------------------------------------


def test_locks_is_a_context_manager(store_url: str, namespace: str) -> None:
    client = keymutex.Locks(store_url, namespace=namespace)
    with client as entered:
        assert entered is client
        lease = entered.acquire("doc", timeout=0)
        assert_is_holder_of(entered.holder("doc"), lease)
        lease.release()
    # Another client opened afterwards works on the same store.
    with keymutex.Locks(store_url, namespace=namespace) as again:
        assert again.holder("doc") is None
        again.acquire("doc", timeout=0).release()


@pytest.mark.asyncio
async def test_async_locks_is_a_context_manager(store_url: str, namespace: str) -> None:
    client = keymutex.AsyncLocks(store_url, namespace=namespace)
    async with client as entered:
        assert entered is client
        lease = await entered.acquire("doc", timeout=0)
        assert_is_holder_of(await entered.holder("doc"), lease)
        await lease.release()
    async with keymutex.AsyncLocks(store_url, namespace=namespace) as again:
        assert await again.holder("doc") is None
        await (await again.acquire("doc", timeout=0)).release()


def _leases_end_with_the_client(url: str) -> bool:
    """ZooKeeper's leases are ephemeral nodes of the client's session, which closing
    ends (README, footnote 11); every other store keeps them to their TTL."""
    return url.startswith(("zookeeper://", "zookeepers://"))


def test_close(store_url: str, namespace: str) -> None:
    client = keymutex.Locks(store_url, namespace=namespace, ttl=5.0)
    with client.lock("doc"):
        pass
    held = client.acquire("held", ttl=60)
    client.close()
    # Closed: every method refuses, before the store; a lease held is not released.
    for call in (
        lambda: client.acquire("doc", timeout=0),
        lambda: client.holder("doc"),
        lambda: client.release("held", held.token),
    ):
        with pytest.raises(RuntimeError, match="this Locks is closed"):
            call()
    with keymutex.Locks(store_url, namespace=namespace) as again:
        again.acquire("doc", timeout=0).release()
        still = again.holder("held")
        if _leases_end_with_the_client(store_url):
            assert still is None
        else:
            assert still is not None
            assert still.fence == held.fence
            again.release("held", held.token)


@pytest.mark.asyncio
async def test_aclose(store_url: str, namespace: str) -> None:
    client = keymutex.AsyncLocks(store_url, namespace=namespace, ttl=5.0)
    async with client.lock("doc"):
        pass
    held = await client.acquire("held", ttl=60)
    await client.aclose()
    for call in (
        lambda: client.acquire("doc", timeout=0),
        lambda: client.holder("doc"),
        lambda: client.release("held", held.token),
    ):
        with pytest.raises(RuntimeError, match="this AsyncLocks is closed"):
            await call()
    async with keymutex.AsyncLocks(store_url, namespace=namespace) as again:
        await (await again.acquire("doc", timeout=0)).release()
        still = await again.holder("held")
        if _leases_end_with_the_client(store_url):
            assert still is None
        else:
            assert still is not None
            assert still.fence == held.fence
            await again.release("held", held.token)


def test_close_stops_renewing(store_url: str, namespace: str) -> None:
    # A client that is closed with a renewing lease leaves nothing behind that keeps
    # the key forever: at the latest the lease expires.
    client = keymutex.Locks(store_url, namespace=namespace)
    lease = client.acquire("doc", ttl=0.3, renew=True)
    client.close()
    with keymutex.Locks(store_url, namespace=namespace) as other:
        newer = other.acquire("doc", timeout=10)
        assert newer.fence > lease.fence
        newer.release()


@pytest.mark.asyncio
async def test_aclose_stops_renewing(store_url: str, namespace: str) -> None:
    client = keymutex.AsyncLocks(store_url, namespace=namespace)
    lease = await client.acquire("doc", ttl=0.3, renew=True)
    await client.aclose()
    async with keymutex.AsyncLocks(store_url, namespace=namespace) as other:
        newer = await other.acquire("doc", timeout=10)
        assert newer.fence > lease.fence
        await newer.release()


def test_an_async_client_used_by_one_asyncio_run_after_another_leaves_nothing_open(
    store_url: str, namespace: str
) -> None:
    """A module-level ``AsyncLocks`` used by several ``asyncio.run`` (found in CI on
    Redis: the connections of a loop that had ended stayed open until the garbage
    collector warned of them, in a later test). Each loop's store is closed as its loop
    shuts down: collecting afterwards finds nothing to warn of (warnings are errors)."""
    locks = keymutex.AsyncLocks(store_url, namespace=namespace)
    fences: list[int] = []

    async def use(locks: keymutex.AsyncLocks) -> None:
        async with locks.lock("user:42", ttl=5.0) as lease:
            fences.append(lease.fence)

    asyncio.run(use(locks))
    asyncio.run(use(locks))
    asyncio.run(locks.aclose())
    assert fences[0] < fences[1]
    del locks
    gc.collect()

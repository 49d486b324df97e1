"""Grants that come back already past their time, and leases lost by this client's clock
that the store still shows: given back, not left to hold the key for a TTL.

Found by review, on every store: after an outage (the server stopped for longer than
the TTL, shorter than the client's socket timeout), a waiter's try was answered with a
grant of a full TTL, which the client, counting from when it sent the try, took as
expired on arrival: ``acquire()`` returned a lost lease, its ``release()`` raised
``LockLost`` "no current holder" without reaching the store, and the key stayed held by
nobody for a whole TTL.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import keymutex
from _redis_servers import RedisServer, standalone
from keymutex import _clock

TTL = 2.0
STALL = 3.5  # longer than TTL, shorter than the Redis store's 5 s socket timeout


@pytest.fixture
def pausable_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with standalone(tmp_path / "redis") as server:
        yield server


def _stalled_for(server: RedisServer, seconds: float) -> threading.Thread:
    def stall() -> None:
        server.pause()
        try:
            time.sleep(seconds)
        finally:
            server.resume()

    thread = threading.Thread(target=stall)
    thread.start()
    time.sleep(0.1)  # stopped before the try is sent
    return thread


def test_a_grant_answered_after_its_ttl_is_given_back(pausable_redis: RedisServer) -> None:
    with keymutex.Locks(pausable_redis.url, ttl=TTL) as locks:
        stalled = _stalled_for(pausable_redis, STALL)
        try:
            lease = locks.acquire("k", timeout=10)  # sent to the stopped server
        finally:
            stalled.join()
        assert lease.lost  # it came back past its time: not a lock
        assert locks.holder("k") is None, "the dead grant still holds the key"
        with pytest.raises(keymutex.LockLost):
            lease.release()
        locks.acquire("k", timeout=0).release()  # free for the next one at once


@pytest.mark.asyncio
async def test_an_async_grant_answered_after_its_ttl_is_given_back(
    pausable_redis: RedisServer,
) -> None:
    async with keymutex.AsyncLocks(pausable_redis.url, ttl=TTL) as locks:
        stalled = _stalled_for(pausable_redis, STALL)
        try:
            lease = await locks.acquire("k", timeout=10)
        finally:
            await asyncio.to_thread(stalled.join)
        assert lease.lost
        for _ in range(25):  # given back in the background (the TTL would take 2 s)
            if await locks.holder("k") is None:
                break
            await asyncio.sleep(0.02)
        assert await locks.holder("k") is None, "the dead grant still holds the key"
        await (await locks.acquire("k", timeout=0)).release()


def _run_out(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """This client's clock moves on by ``seconds`` (a suspend); the store's does not."""
    awake = _clock.monotonic
    monkeypatch.setattr(_clock, "monotonic", lambda: awake() + seconds)


def test_releasing_a_lease_lost_by_its_deadline_frees_the_key_the_store_still_shows(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with keymutex.Locks(redis_url, namespace="ran-out", ttl=30) as locks:
        lost = threading.Event()
        lease = locks.acquire("k", renew=True, on_lost=lambda lease: lost.set())
        _run_out(monkeypatch, 40)
        assert lost.wait(10), "on_lost was not called"
        assert locks.holder("k") is not None  # the store's TTL has 30 s to run
        with pytest.raises(keymutex.LockLost, match="its time ran out by this client's clock"):
            lease.release()
        assert locks.holder("k") is None, "the key stays held until the store's TTL"


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_release_past_the_deadline_of_a_lease_not_renewed_is_lock_lost(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    """No renewer marks it lost: the release itself finds its deadline passed by this
    client's clock, though the store (its own clock) still shows it. Found by a mutation
    audit: a release that ignored the deadline, and said it released a lease that may
    have been another's by then, survived every test."""
    namespace = f"ran-out-unrenewed-{asynchronous}"
    if asynchronous:

        async def main() -> None:
            async with keymutex.AsyncLocks(redis_url, namespace=namespace, ttl=30) as locks:
                lease = await locks.acquire("k", renew=False)
                _run_out(monkeypatch, 40)
                with pytest.raises(keymutex.LockLost):
                    await lease.release()
                assert await locks.holder("k") is None

        asyncio.run(main())
        return
    with keymutex.Locks(redis_url, namespace=namespace, ttl=30) as locks:
        lease = locks.acquire("k", renew=False)
        _run_out(monkeypatch, 40)
        with pytest.raises(keymutex.LockLost):
            lease.release()
        assert locks.holder("k") is None, "the key stays held until the store's TTL"


@pytest.mark.asyncio
async def test_releasing_an_async_lease_lost_by_its_deadline_frees_the_key(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with keymutex.AsyncLocks(redis_url, namespace="ran-out-async", ttl=30) as locks:
        lost = asyncio.Event()
        lease = await locks.acquire("k", renew=True, on_lost=lambda lease: lost.set())
        _run_out(monkeypatch, 40)
        await asyncio.wait_for(lost.wait(), 10)
        assert await locks.holder("k") is not None
        with pytest.raises(keymutex.LockLost, match="its time ran out by this client's clock"):
            await lease.release()
        assert await locks.holder("k") is None

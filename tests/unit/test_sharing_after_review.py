"""One lease or one ``lock()`` object used by several threads or tasks, after review:
each test here failed before its fix.

- A ``locks.lock(key)`` object shared by threads (as one shares a ``threading.Lock``):
  while the first thread's lease was lost, a second was granted the key through the
  same object; the first one's exit then released the *second* one's lease (the key
  free at the store while its holder worked), and neither heard of it.
- ``lease.release()`` racing ``lease.renew()`` or another ``lease.release()``: the one
  that reached the store second was told "not yours", and called the released lease
  lost: ``lease.lost`` for good, ``on_lost`` called, "was lost" instead of "already
  released".
- ``on_lost`` callbacks ran one after another on one thread: one that blocked (waiting
  for its worker to wind down) held back every other lease's.

On ``memory://`` and SQLite: these are client behaviours, the same on every store.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

import keymutex

PATIENCE = 20.0  # reached only on failure
ROUNDS = 100


@pytest.fixture(params=["memory", "sqlite", "redis"])
def race_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The local stores, and Redis: two calls of one client interleave at a networked
    store as they rarely do at a local one (an async release and renewal never do).
    Tests give their ``Locks`` a namespace of their own."""
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_url")
        return url
    if request.param == "memory":
        return "memory://"
    return f"sqlite:///{tmp_path}/locks.db"


def test_a_shared_lock_object_releases_each_threads_own_lease(url: str) -> None:
    with keymutex.Locks(url, ttl=30) as locks, keymutex.Locks(url) as thief:
        orders = locks.lock("orders", timeout=PATIENCE)
        b_inside, b_may_leave = threading.Event(), threading.Event()
        b_saw: list[keymutex.Holder | None] = []

        def b() -> None:
            with orders as lease:
                b_inside.set()
                assert b_may_leave.wait(PATIENCE)
                holder = locks.holder("orders")
                b_saw.append(holder)
                assert holder is not None
                assert holder.fence == lease.fence

        a_lease = orders.__enter__()
        stolen = thief.acquire("orders", steal=True)
        thief.release("orders", stolen.token)
        second = threading.Thread(target=b)
        second.start()
        assert b_inside.wait(PATIENCE), "B was not granted the key"
        with pytest.raises(keymutex.LockLost):  # A's own lease was taken
            orders.__exit__(None, None, None)
        assert a_lease.lost
        holder = locks.holder("orders")
        assert holder is not None, "A's exit released B's lease"
        b_may_leave.set()
        second.join(PATIENCE)
        assert b_saw
        assert b_saw[0] is not None
        assert locks.holder("orders") is None  # B's exit released B's lease


@pytest.mark.asyncio
async def test_a_shared_async_lock_object_releases_each_tasks_own_lease(url: str) -> None:
    async with keymutex.AsyncLocks(url, ttl=30) as locks, keymutex.AsyncLocks(url) as thief:
        orders = locks.lock("orders", timeout=PATIENCE)
        b_inside, b_may_leave = asyncio.Event(), asyncio.Event()

        async def b() -> keymutex.Holder | None:
            async with orders as lease:
                b_inside.set()
                await b_may_leave.wait()
                holder = await locks.holder("orders")
                assert holder is not None
                assert holder.fence == lease.fence
                return holder

        a_lease = await orders.__aenter__()
        stolen = await thief.acquire("orders", steal=True)
        await thief.release("orders", stolen.token)
        second = asyncio.create_task(b())
        await asyncio.wait_for(b_inside.wait(), PATIENCE)
        with pytest.raises(keymutex.LockLost):
            await orders.__aexit__(None, None, None)
        assert a_lease.lost
        assert await locks.holder("orders") is not None, "A's exit released B's lease"
        b_may_leave.set()
        assert await asyncio.wait_for(second, PATIENCE) is not None
        assert await locks.holder("orders") is None


def _race(first: Any, second: Any) -> list[BaseException | None]:
    """Call ``first`` and ``second`` on two threads at once; what each raised."""
    start = threading.Barrier(2)
    raised: list[BaseException | None] = [None, None]

    def run(index: int, call: Any) -> None:
        start.wait(PATIENCE)
        try:
            call()
        except BaseException as exc:
            raised[index] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate([first, second])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE)
    return raised


@pytest.mark.parametrize("other", ["renew", "release"])
def test_a_release_racing_a_renewal_or_release_is_no_loss(race_url: str, other: str) -> None:
    lost: list[str] = []
    with keymutex.Locks(race_url, ttl=30, namespace=uuid.uuid4().hex) as locks:
        for round_ in range(ROUNDS):
            lease = locks.acquire(f"k{round_}", on_lost=lambda lease: lost.append(lease.key))
            raised = _race(lease.release, getattr(lease, other))
            assert not lease.lost, f"round {round_}: a released lease was called lost"
            assert locks.holder(lease.key) is None
            for exc in raised:  # the renewal or release that came after the release
                assert exc is None or "already released" in str(exc), repr(exc)
    assert lost == []


@pytest.mark.asyncio
@pytest.mark.parametrize("other", ["renew", "release"])
async def test_an_async_release_racing_a_renewal_or_release_is_no_loss(
    race_url: str, other: str
) -> None:
    lost: list[str] = []
    async with keymutex.AsyncLocks(race_url, ttl=30, namespace=uuid.uuid4().hex) as locks:
        for round_ in range(ROUNDS):
            lease = await locks.acquire(f"k{round_}", on_lost=lambda lease: lost.append(lease.key))
            raised = await asyncio.gather(
                lease.release(), getattr(lease, other)(), return_exceptions=True
            )
            assert not lease.lost, f"round {round_}: a released lease was called lost"
            assert await locks.holder(lease.key) is None
            for outcome in raised:  # None, the renewed lease, or what was raised
                if isinstance(outcome, BaseException):
                    assert "already released" in str(outcome), repr(outcome)
    assert lost == []


def test_a_blocking_on_lost_holds_back_no_other_leases(url: str) -> None:
    with keymutex.Locks(url, ttl=1.5) as locks, keymutex.Locks(url) as thief:
        a_called, a_may_return, b_called = threading.Event(), threading.Event(), threading.Event()

        def a_lost(lease: keymutex.Lease) -> None:
            a_called.set()
            a_may_return.wait(PATIENCE)  # as one that waits for its worker to wind down

        try:
            locks.acquire("a", renew=True, on_lost=a_lost)
            locks.acquire("b", renew=True, on_lost=lambda lease: b_called.set())
            thief.acquire("a", steal=True)
            assert a_called.wait(PATIENCE), "the renewer did not find a lost"
            thief.acquire("b", steal=True)
            assert b_called.wait(PATIENCE), "b's on_lost waited for a's to return"
        finally:
            a_may_return.set()

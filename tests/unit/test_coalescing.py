"""Callers of one Locks waiting for one key queue locally: one of them waits at the store."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import pytest

import keymutex

WAITERS = 8


def queued_at_store(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        (count,) = conn.execute("SELECT count(*) FROM keymutex_waiters").fetchone()
    return int(count)


def wait_for(predicate: object, what: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_threads_of_one_locks_queue_locally(tmp_path: Path) -> None:
    db = tmp_path / "locks.db"
    holder = keymutex.Locks(f"sqlite:///{db}", owner="holder")
    waiters = keymutex.Locks(f"sqlite:///{db}", owner="waiters")
    held = holder.acquire("doc")
    order: list[int] = []
    started = threading.Barrier(WAITERS + 1)

    def wait(number: int) -> None:
        started.wait()
        with waiters.lock("doc", timeout=30, renew=False):
            order.append(number)

    threads = [threading.Thread(target=wait, args=(n,)) for n in range(WAITERS)]
    for thread in threads:
        thread.start()
    started.wait()
    wait_for(lambda: queued_at_store(db) >= 1, "a waiter to queue at the store")
    time.sleep(0.2)  # give the others every chance to reach the store too
    assert queued_at_store(db) == 1, "more than one thread of one Locks waits at the store"
    held.release()
    for thread in threads:
        thread.join(30)
    assert sorted(order) == list(range(WAITERS))
    assert queued_at_store(db) == 0
    holder.close()
    waiters.close()


@pytest.mark.asyncio
async def test_tasks_of_one_async_locks_queue_locally(tmp_path: Path) -> None:
    db = tmp_path / "locks.db"
    holder = keymutex.AsyncLocks(f"sqlite:///{db}", owner="holder")
    waiters = keymutex.AsyncLocks(f"sqlite:///{db}", owner="waiters")
    held = await holder.acquire("doc")
    order: list[int] = []

    async def wait(number: int) -> None:
        async with waiters.lock("doc", timeout=30, renew=False):
            order.append(number)

    tasks = [asyncio.create_task(wait(n)) for n in range(WAITERS)]
    deadline = time.monotonic() + 10
    while queued_at_store(db) < 1:
        assert time.monotonic() < deadline, "no waiter queued at the store"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert queued_at_store(db) == 1, "more than one task of one AsyncLocks waits at the store"
    await held.release()
    await asyncio.gather(*tasks)
    assert order == list(range(WAITERS)), "tasks of one AsyncLocks were not served FIFO"
    await holder.aclose()
    await waiters.aclose()

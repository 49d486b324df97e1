"""One ``AsyncLocks`` and several event loops, after review.

Its waiters' gate and its renewer belong to one loop. Shared by loops running at the
same time in two threads, waiters of one loop were woken from the other's thread, that
is never: they slept to their timeout and raised ``Locked`` with the key free. A second
loop is now refused while the first still runs, with a message that says what to do;
loops that run one after another still share one client.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

import keymutex

PATIENCE = 20.0  # reached only on failure


def test_a_second_loop_is_refused_while_the_first_runs(url: str) -> None:
    locks = keymutex.AsyncLocks(url)
    first_used, first_may_end = threading.Event(), threading.Event()

    async def first() -> None:
        async with locks.lock("k", timeout=PATIENCE):
            pass
        first_used.set()
        await asyncio.to_thread(first_may_end.wait, PATIENCE)  # the loop still runs

    thread = threading.Thread(target=asyncio.run, args=(first(),))
    thread.start()
    try:
        assert first_used.wait(PATIENCE)

        async def second() -> None:
            with pytest.raises(RuntimeError, match="make one AsyncLocks per event loop"):
                await locks.acquire("k", timeout=PATIENCE)
            assert await locks.holder("k") is None  # nothing was taken on the way

        asyncio.run(second())
    finally:
        first_may_end.set()
        thread.join(PATIENCE)

    async def after_the_first_ended() -> None:  # then the client is this loop's
        async with locks.lock("k", timeout=PATIENCE) as lease:
            assert not lease.lost
        await locks.aclose()

    asyncio.run(after_the_first_ended())


def test_loops_in_threads_with_a_client_each_count_exactly(url: str) -> None:
    """What the refusal points to: one AsyncLocks per loop, here two threads' loops of
    five tasks each, all waiting on one key."""
    counter = {"value": 0}
    errors: list[BaseException] = []

    async def loop_of_tasks() -> None:
        async with keymutex.AsyncLocks(url) as locks:

            async def task() -> None:
                for _ in range(10):
                    async with locks.lock("c", timeout=PATIENCE):
                        value = counter["value"]
                        await asyncio.sleep(0)
                        counter["value"] = value + 1

            await asyncio.gather(*(task() for _ in range(5)))

    def run() -> None:
        try:
            asyncio.run(loop_of_tasks())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE * 3)
    assert errors == []
    assert counter["value"] == 100

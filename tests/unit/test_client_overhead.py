"""What keeps ``with lock():`` cheap stays correct: the renewer is left asleep by leases
that come and go, yet renews on time a lease that needs it sooner; the async renewer
outlives a lease but not a quiet spell; a cancelled ``async with`` exit still releases.

On ``memory://``: these are client behaviours, the same on every store.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import keymutex

PATIENCE = 5.0


def test_leases_held_briefly_never_enter_the_renewal_heaps() -> None:
    with keymutex.Locks("memory://", ttl=30.0) as locks:
        for _ in range(200):
            with locks.lock("k"):
                pass
        plan = locks._renewer._plan
        # At most the lease(s) held when the renewer thread first looked.
        assert len(plan._heap) <= 2
        assert len(plan._deadlines) <= 2
        assert not plan._fresh
        assert not plan


def test_a_stream_of_leases_does_not_wake_the_renewer_each_time() -> None:
    with keymutex.Locks("memory://", ttl=30.0) as locks:
        with locks.lock("k"):  # starts the thread
            pass
        time.sleep(0.05)  # let it look once and fall asleep
        condition = locks._renewer._wakeup
        calls = 0
        notify = condition.notify

        def counting_notify(n: int = 1) -> None:
            nonlocal calls
            calls += 1
            notify(n)

        condition.notify = counting_notify  # type: ignore[method-assign]
        for _ in range(200):
            with locks.lock("k"):
                pass
        assert calls == 0


@pytest.mark.slow
def test_a_shorter_lease_after_a_stream_is_still_renewed_on_time() -> None:
    with keymutex.Locks("memory://", ttl=30.0) as locks:
        for _ in range(10):
            with locks.lock("k"):  # the renewer sleeps for 10 s now
                pass
        time.sleep(0.05)
        lost: list[Any] = []
        with locks.lock("short", ttl=1.0, on_lost=lost.append) as lease:
            time.sleep(2.5)  # lost at 1 s unless renewed before the renewer's 10 s nap ends
            assert not lease.lost
            assert lease.remaining > 0
        assert lost == []


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_async_renewer_outlives_a_lease_but_not_a_quiet_spell() -> None:
    async with keymutex.AsyncLocks("memory://", ttl=0.3) as locks:
        async with locks.lock("k"):
            pass
        task = locks._renewer._task
        assert task is not None
        for _ in range(20):
            async with locks.lock("k"):
                pass
        assert locks._renewer._task is task  # one task for them all, not one per lease
        async with asyncio.timeout(PATIENCE):  # quiet for two idle spells of 0.1 s: it ends
            await asyncio.wait([task])
        # A lease after that gets a new task, and is renewed.
        async with locks.lock("again", ttl=1.0) as lease:
            assert locks._renewer._task is not task
            await asyncio.sleep(2.5)
            assert not lease.lost

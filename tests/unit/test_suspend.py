"""A machine suspended while its process holds renewing leases.

Lease deadlines are on ``CLOCK_BOOTTIME``, which counts a suspend, but threads and
asyncio time their sleeps on ``CLOCK_MONOTONIC``, which does not: the renewer used to
sleep on, after waking, until a renewal was due (a third of the TTL), while the lease
was gone and the key maybe someone else's. What a suspend looks like from inside is
keymutex's clock jumping ahead of the clock sleeps are timed by; these tests make it
jump. ``on_lost`` must come within a second or so of waking.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import keymutex
from keymutex import _clock

# Far less than the first renewal (TTL / 3 = 10 s), far more than SUSPEND_LOOK (1 s).
SOON = 5.0


def suspend(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """keymutex's clock (and the memory store's TTLs) move on by ``seconds`` at once."""
    awake = _clock.monotonic
    monkeypatch.setattr(_clock, "monotonic", lambda: awake() + seconds)


def test_a_lease_that_expired_during_a_suspend_is_lost_soon_after_waking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with keymutex.Locks("memory://", ttl=30) as locks:
        lost = threading.Event()
        lease = locks.acquire("report", renew=True, on_lost=lambda lease: lost.set())
        time.sleep(0.2)  # the renewer is asleep until the first renewal
        suspend(monkeypatch, 40)
        assert lease.lost
        assert lost.wait(SOON), "on_lost not called within 5 s of waking"
        with pytest.raises(keymutex.LockLost):
            lease.release()


@pytest.mark.asyncio
async def test_an_async_lease_that_expired_during_a_suspend_is_lost_soon_after_waking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with keymutex.AsyncLocks("memory://", ttl=30) as locks:
        lost = asyncio.Event()
        lease = await locks.acquire("report", renew=True, on_lost=lambda lease: lost.set())
        await asyncio.sleep(0.2)
        suspend(monkeypatch, 40)
        assert lease.lost
        await asyncio.wait_for(lost.wait(), SOON)
        with pytest.raises(keymutex.LockLost):
            await lease.release()


def test_a_short_suspend_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    with keymutex.Locks("memory://", ttl=30) as locks:
        lost = threading.Event()
        with locks.lock("report", on_lost=lambda lease: lost.set()) as lease:
            suspend(monkeypatch, 5)
            assert not lost.wait(2.0)
            assert not lease.lost
            assert 20 < lease.remaining <= 25

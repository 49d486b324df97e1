"""An acquire that is interrupted, or whose client is closed under it, leaves nothing held.

Found by an audit against API.md: a KeyboardInterrupt landing between the store's grant
and the caller kept the lease for its whole TTL; ``close()`` left calls that were
waiting to wait on (forever, with no timeout), to be granted a lease that nobody could
release; and leaving a ``with`` block after ``close()`` replaced the block's exception.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import keymutex
from keymutex import _client


class _Interrupted(Exception):
    pass


def test_an_interrupt_after_the_grant_gives_the_lease_back(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interrupt lands after the store granted the key, before the caller has it."""

    class InterruptedLease(keymutex.Lease):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise KeyboardInterrupt

    with keymutex.Locks(url) as locks:
        monkeypatch.setattr(_client, "Lease", InterruptedLease)
        for timeout in (0, None):  # the single try, and the waiting path
            with pytest.raises(KeyboardInterrupt):
                locks.acquire("doc", timeout=timeout)
            assert locks.holder("doc") is None


def test_an_interrupt_inside_the_store_step_gives_a_grant_back(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with keymutex.Locks(url) as locks:
        granting = locks._store.try_acquire

        def granted_then_interrupted(key: str, **kwargs: Any) -> Any:
            outcome = granting(key, **kwargs)
            assert outcome.ok
            raise KeyboardInterrupt  # as if the answer were on its way back

        monkeypatch.setattr(locks._store, "try_acquire", granted_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            locks.acquire("doc", timeout=5)
        monkeypatch.undo()
        assert locks.holder("doc") is None
        locks.acquire("doc", timeout=0).release()  # free at once, not after 30 s


def _acquire_in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    result: list[object] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize("form", ["acquire", "lock", "timeout"])
def test_close_ends_an_acquire_that_waits(url: str, form: str) -> None:
    with keymutex.Locks(url) as holder:
        lease = holder.acquire("doc")
        waiting = keymutex.Locks(url)
        calls: dict[str, Callable[[], object]] = {
            "acquire": lambda: waiting.acquire("doc"),
            "lock": lambda: waiting.lock("doc").__enter__(),
            "timeout": lambda: waiting.acquire("doc", timeout=30),
        }
        thread, result = _acquire_in_thread(calls[form])
        time.sleep(0.3)  # queued at the store
        waiting.close()
        thread.join(10)  # it wakes to re-check within a second
        assert not thread.is_alive(), "the acquire still waits after close()"
        assert len(result) == 1
        assert isinstance(result[0], RuntimeError)
        assert "this Locks was closed while an acquire of 'doc' waited" in str(result[0])
        lease.release()
        time.sleep(0.1)
        assert holder.holder("doc") is None  # nobody holds what it would have been handed
        holder.acquire("doc", timeout=0).release()


@pytest.mark.asyncio
async def test_aclose_ends_an_acquire_that_waits(url: str) -> None:
    async with keymutex.AsyncLocks(url) as holder:
        lease = await holder.acquire("doc")
        waiting = keymutex.AsyncLocks(url)
        task = asyncio.create_task(waiting.acquire("doc"))
        await asyncio.sleep(0.3)
        await waiting.aclose()
        with pytest.raises(RuntimeError, match="this AsyncLocks was closed while an acquire"):
            await asyncio.wait_for(task, 10)
        await lease.release()
        await asyncio.sleep(0.1)
        assert await holder.holder("doc") is None


def test_a_key_handed_to_a_waiter_as_its_client_closes_is_given_back(url: str) -> None:
    """Before: close() closed the store at once; a release that handed the key to the
    closed client's queued waiter (SQLite's handoff) left it held for its whole TTL,
    as the waiter could no longer leave the queue."""
    with keymutex.Locks(url) as holder:
        lease = holder.acquire("doc")
        waiting = keymutex.Locks(url)
        thread, result = _acquire_in_thread(lambda: waiting.acquire("doc", timeout=30))
        time.sleep(0.3)  # queued at the store
        waiting.close()
        lease.release()  # handed to the queue's first: the closed client's waiter
        thread.join(10)
        assert not thread.is_alive(), "the acquire still waits after close()"
        assert len(result) == 1
        assert isinstance(result[0], RuntimeError), result
        assert holder.holder("doc") is None  # given back, not held for 30 s
        holder.acquire("doc", timeout=0).release()
        with pytest.raises(RuntimeError, match="this Locks is closed"):
            waiting.acquire("doc", timeout=1)


@pytest.mark.asyncio
async def test_a_key_handed_to_an_async_waiter_as_its_client_closes_is_given_back(
    url: str,
) -> None:
    async with keymutex.AsyncLocks(url) as holder:
        lease = await holder.acquire("doc")
        waiting = keymutex.AsyncLocks(url)
        task = asyncio.create_task(waiting.acquire("doc", timeout=30))
        await asyncio.sleep(0.3)
        await waiting.aclose()
        await lease.release()
        with pytest.raises(RuntimeError, match="this AsyncLocks was closed while an acquire"):
            await asyncio.wait_for(task, 10)
        assert await holder.holder("doc") is None
        await (await holder.acquire("doc", timeout=0)).release()


def _close_then_fail(locks: keymutex.Locks) -> None:
    with locks.lock("doc"):
        locks.close()
        raise _Interrupted


def test_the_blocks_own_exception_wins_over_a_close_inside_it(url: str) -> None:
    locks = keymutex.Locks(url)
    with pytest.raises(_Interrupted):
        _close_then_fail(locks)
    with pytest.raises(RuntimeError, match="this Locks is closed"), locks.lock("doc"):
        pass  # and a new block is refused before the store


def test_leaving_a_block_normally_after_close_says_the_lock_was_not_released(url: str) -> None:
    locks = keymutex.Locks(url)
    with pytest.raises(RuntimeError, match="this Locks is closed"), locks.lock("doc"):
        locks.close()

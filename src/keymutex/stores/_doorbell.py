"""A one-shot wake-up that a thread rings and a thread or an asyncio task waits on."""

from __future__ import annotations

import asyncio
import contextlib
import threading

__all__ = ["Doorbell", "LoopDoorbell", "wake"]


class Doorbell:
    """Rung by any thread; waited on by one thread (``wait``) or one task (``wait_async``).

    A ring that comes while nobody waits is kept until the next wait consumes it, so a
    ring between "refused" and "parked" is never lost.
    """

    __slots__ = ("_event", "_loop", "_loop_event", "_mutex")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._event = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_event: asyncio.Event | None = None

    def ring(self) -> None:
        with self._mutex:
            self._event.set()
            loop, loop_event = self._loop, self._loop_event
        if loop is not None and loop_event is not None:
            # RuntimeError: the loop is closed, so nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop_event.set)

    def forget(self) -> None:
        """Drop a ring not yet consumed (it was about an earlier state of the key)."""
        self._event.clear()  # a wait reports what this says, whatever woke it

    def wait(self, timeout: float) -> bool:
        rung = self._event.wait(timeout)
        self._event.clear()
        return rung

    async def wait_async(self, timeout: float) -> bool:
        with self._mutex:
            if self._event.is_set():
                self._event.clear()
                return True
            if self._loop_event is None:
                self._loop = asyncio.get_running_loop()
                self._loop_event = asyncio.Event()
            loop_event = self._loop_event
        try:
            async with asyncio.timeout(timeout):
                await loop_event.wait()
        except TimeoutError:
            pass
        with self._mutex:
            loop_event.clear()
            rung = self._event.is_set()
            self._event.clear()
        return rung


class LoopDoorbell:
    """``Doorbell`` for a store whose wake-ups are read by a task on the waiter's loop.

    Rung and waited on in that loop only, so it needs no lock. A ring that comes while
    nobody waits is kept until the next wait consumes it.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def ring(self) -> None:
        self._event.set()

    def forget(self) -> None:
        """Drop a ring not yet consumed (it was about an earlier state of the key)."""
        self._event.clear()

    async def wait(self, timeout: float) -> bool:
        """``True`` when rung (now or since the last wait) within ``timeout`` seconds."""
        if not self._event.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._event.wait()
        rung = self._event.is_set()
        self._event.clear()
        return rung


def wake(future: asyncio.Future[None]) -> None:
    """Resolve ``future`` unless it is done: a reader callback scheduled in the turn
    its waiter was cancelled (or timed out) would otherwise log ``InvalidStateError``."""
    if not future.done():
        future.set_result(None)

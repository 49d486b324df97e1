"""A one-shot wake-up that a thread rings and a thread or an asyncio task waits on."""

from __future__ import annotations

import asyncio
import contextlib
import threading

__all__ = ["Doorbell"]


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

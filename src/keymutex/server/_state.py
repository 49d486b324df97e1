"""What the server keeps between requests: open clients, change signals, waiting counts.

Everything here lives on the server's one event loop and is touched only from it, so
plain dicts and ``asyncio.Event`` need no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from typing import Generic, TypeVar

from keymutex._client import AsyncLocks

__all__ = ["Changes", "Namespaces", "Signals"]

K = TypeVar("K", bound=Hashable)


class Signals(Generic[K]):
    """One ``asyncio.Event`` per watched name, set and replaced each time it fires.

    A watcher takes ``event(name)`` *before* it reads the state it watches, so a change
    that lands between the read and the wait is never missed. An event is kept only
    while a watcher holds it (weakly referenced here), so nothing grows with the names
    ever seen, whichever way a watcher ends: an event stream whose client went away
    before it began has no ``finally`` to run.
    """

    def __init__(self) -> None:
        self._events: weakref.WeakValueDictionary[K, asyncio.Event] = weakref.WeakValueDictionary()

    def __len__(self) -> int:
        """How many names have an event (someone holds it) right now."""
        return len(self._events)

    def event(self, name: K) -> asyncio.Event:
        event = self._events.get(name)
        if event is None:
            event = self._events[name] = asyncio.Event()
        return event

    def fire(self, name: K) -> None:
        event = self._events.pop(name, None)
        if event is not None:
            event.set()


class Changes:
    """Changes made through this server, and the requests waiting at it, per key.

    ``keys`` wakes long polls on one key; ``namespaces`` wakes event streams.
    ``waiting`` counts the requests waiting per (namespace, key).
    """

    def __init__(self, on_waiting: Callable[[int], None]) -> None:
        self.keys: Signals[tuple[str, str]] = Signals()
        self.namespaces: Signals[str] = Signals()
        self.waiting: Counter[tuple[str, str]] = Counter()
        self._on_waiting = on_waiting

    def changed(self, namespace: str, key: str) -> None:
        self.keys.fire((namespace, key))
        self.namespaces.fire(namespace)

    def renewed(self, namespace: str) -> None:
        """A lease's expiry moved: event streams show it (dashboards count down from
        the last snapshot); long polls on its key have nothing to learn."""
        self.namespaces.fire(namespace)

    @contextlib.contextmanager
    def waiting_on(self, namespace: str, key: str) -> Iterator[None]:
        """Count a request as waiting on ``key`` for the block (shown by holders, events)."""
        name = (namespace, key)
        self.waiting[name] += 1
        self._on_waiting(self.waiting.total())
        self.namespaces.fire(namespace)
        try:
            yield
        finally:
            self.waiting[name] -= 1
            if self.waiting[name] <= 0:
                del self.waiting[name]
            self._on_waiting(self.waiting.total())
            self.namespaces.fire(namespace)

    def waiting_in(self, namespace: str) -> dict[str, int]:
        return {key: n for (ns, key), n in self.waiting.items() if ns == namespace}


class Namespaces:
    """One ``AsyncLocks`` per namespace, opened lazily; the least recently used idle
    ones are closed beyond ``limit`` (those in use stay open until their requests end)."""

    def __init__(self, url: str, limit: int) -> None:
        self._url = url
        self._limit = limit
        self._open: OrderedDict[str, AsyncLocks] = OrderedDict()
        self._users: Counter[str] = Counter()
        self._opening: dict[str, asyncio.Future[AsyncLocks]] = {}
        self._closed = False

    def add(self, namespace: str, locks: AsyncLocks) -> None:
        """Adopt a client opened beforehand (the default namespace, opened at start)."""
        self._open[namespace] = locks

    def names(self) -> list[str]:
        return list(self._open)

    @contextlib.asynccontextmanager
    async def using(self, namespace: str) -> AsyncIterator[AsyncLocks]:
        # Counted before any await: a trim while the client opens must not close it.
        self._users[namespace] += 1
        try:
            yield await self._get(namespace)
        finally:
            self._users[namespace] -= 1
            if self._users[namespace] <= 0:
                del self._users[namespace]
            await self._trim()

    async def _get(self, namespace: str) -> AsyncLocks:
        if self._closed:
            raise RuntimeError("the server is shutting down")
        locks = self._open.get(namespace)
        if locks is not None:
            self._open.move_to_end(namespace)
            return locks
        pending = self._opening.get(namespace)
        if pending is None:
            pending = asyncio.ensure_future(self._open_one(namespace))
            self._opening[namespace] = pending
        return await asyncio.shield(pending)

    async def _open_one(self, namespace: str) -> AsyncLocks:
        try:
            # Opening may do blocking I/O (SQLite connects and prepares its schema).
            locks = await asyncio.to_thread(AsyncLocks, self._url, namespace=namespace)
        finally:
            del self._opening[namespace]
        if self._closed:
            await locks.aclose()
            raise RuntimeError("the server is shutting down")
        self._open[namespace] = locks
        return locks

    async def _trim(self) -> None:
        excess = len(self._open) - self._limit
        if excess <= 0:
            return
        # Chosen and taken out with no await in between: a request that comes for one
        # of them while they close opens a client of its own.
        idle = [name for name in self._open if not self._users[name]][:excess]
        closing = [self._open.pop(name) for name in idle]
        for locks in closing:
            await locks.aclose()

    async def aclose(self) -> None:
        self._closed = True
        while self._open:
            _, locks = self._open.popitem()
            await locks.aclose()

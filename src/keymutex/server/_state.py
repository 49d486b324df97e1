"""What the server keeps between requests: open clients, change signals, waiting counts.

Everything here lives on the server's one event loop and is touched only from it, so
plain dicts and ``asyncio.Event`` need no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from typing import Generic, TypeVar

from keymutex import _clock
from keymutex._client import AsyncLocks
from keymutex.server._input import SHUTTING_DOWN
from keymutex.server._metrics import Metrics

__all__ = ["Changes", "Namespaces", "Signals"]

K = TypeVar("K", bound=Hashable)
LOG = logging.getLogger("keymutex.server")

KEEP_RECENT = 60.0  # seconds: an idle namespace used this recently is closed last
WARN_EVERY = 60.0  # seconds between warnings that namespaces in use are being closed


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
    """One ``AsyncLocks`` per namespace, opened lazily; at most ``limit`` kept open
    between requests (those in use stay open until their requests end).

    An open namespace holds its store's connections (on SQLite a connection: three file
    descriptors; on PostgreSQL or Redis, connections that count against the database
    server's limit) and some 20 KB; never a task, as the server renews nothing itself,
    and leases live in the store whether or not their namespace is open here. Closing
    buys the connections back, and costs a new one (on SQLite, a schema-check write
    transaction too) when the namespace is next used.

    Beyond ``limit``, the idle namespaces not used for ``KEEP_RECENT`` are closed
    first, longest idle first; then, if still beyond, those opened last (they found the
    limit reached). So with more namespaces in steady use than ``limit``, those already
    open stay open and only the others are opened again, and a client that makes up
    namespaces still keeps no more than ``limit`` open between its requests. Found by a
    load test: closed least recently used first, 120 namespaces used in turn through a
    limit of 64 were each closed just before their next use (1,823 opens for 2,400
    requests; now 1,241: the requests of the namespaces beyond the limit). Closing is done
    by a background task: before, a request closed them before its reply was sent, and
    waited for the close of other namespaces (the store's disconnect, in a thread).
    """

    def __init__(self, url: str, limit: int, metrics: Metrics) -> None:
        self._url = url
        self._limit = limit
        self._metrics = metrics
        self._open: dict[str, _Open] = {}
        self._users: Counter[str] = Counter()
        self._opening: dict[str, asyncio.Future[AsyncLocks]] = {}
        self._closing: asyncio.Future[None] | None = None  # the background task, if any
        self._closed = False
        self._recent_closed = 0  # namespaces used within KEEP_RECENT closed since the warning
        self._warned_at = -math.inf

    def add(self, namespace: str, locks: AsyncLocks) -> None:
        """Adopt a client opened beforehand (the default namespace, opened at start)."""
        self._metrics.namespace_opens.inc()
        self._opened(namespace, locks)

    def names(self) -> list[str]:
        return list(self._open)

    @contextlib.asynccontextmanager
    async def using(self, namespace: str) -> AsyncIterator[AsyncLocks]:
        """The namespace's client for a request: opened if need be, kept open for the
        block, and counted as used (the namespaces closed first are the others)."""
        # Counted before any await: a trim while the client opens must not close it.
        self._users[namespace] += 1
        try:
            yield await self._get(namespace)
        finally:
            entry = self._open.get(namespace)
            if entry is not None:
                entry.used_at = _clock.monotonic()
            self._done_with(namespace)

    @contextlib.asynccontextmanager
    async def visiting(self, namespace: str) -> AsyncIterator[AsyncLocks | None]:
        """The namespace's client if it is open (else ``None``), kept open for the block,
        for the server's own reads (the metrics' count of leases): neither opens it nor
        counts as a use, so a scrape every few seconds keeps no namespace open."""
        entry = self._open.get(namespace)
        if entry is None or self._closed:
            yield None
            return
        self._users[namespace] += 1
        try:
            yield entry.locks
        finally:
            self._done_with(namespace)

    def _done_with(self, namespace: str) -> None:
        self._users[namespace] -= 1
        if self._users[namespace] <= 0:
            del self._users[namespace]
        if len(self._open) > self._limit and self._closing is None and not self._closed:
            self._closing = asyncio.ensure_future(self._trim())

    async def _get(self, namespace: str) -> AsyncLocks:
        if self._closed:
            raise SHUTTING_DOWN
        entry = self._open.get(namespace)
        if entry is not None:
            entry.used_at = _clock.monotonic()
            return entry.locks
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
            raise SHUTTING_DOWN
        self._metrics.namespace_opens.inc()
        self._opened(namespace, locks)
        return locks

    def _opened(self, namespace: str, locks: AsyncLocks) -> None:
        now = _clock.monotonic()
        self._open[namespace] = _Open(locks, opened_at=now, used_at=now)
        self._metrics.namespaces_open.set(len(self._open))

    def _to_close(self) -> list[str]:
        """The idle namespaces to close to be back at ``limit``, in the order above."""
        excess = len(self._open) - self._limit
        if excess <= 0:
            return []
        now = _clock.monotonic()
        idle = [(name, entry) for name, entry in self._open.items() if not self._users[name]]
        stale = [(name, e) for name, e in idle if now - e.used_at >= KEEP_RECENT]
        recent = [(name, e) for name, e in idle if now - e.used_at < KEEP_RECENT]
        stale.sort(key=lambda item: item[1].used_at)
        recent.sort(key=lambda item: item[1].opened_at, reverse=True)
        chosen = (stale + recent)[:excess]
        self._recent_closed += sum(1 for _, e in chosen if now - e.used_at < KEEP_RECENT)
        return [name for name, _ in chosen]

    async def _trim(self) -> None:
        """Close idle namespaces until ``limit`` are open (the background task)."""
        try:
            while chosen := self._to_close():
                # Taken out with no await in between: a request that comes for one of
                # them while it closes opens a client of its own.
                closing = [self._open.pop(name).locks for name in chosen]
                self._metrics.namespaces_open.set(len(self._open))
                self._warn_if_reopening()
                for locks in closing:
                    try:
                        await locks.aclose()
                    except Exception:  # a bug: the next ones are closed all the same
                        LOG.exception("cannot close the client of namespace %r", locks.namespace)
                    self._metrics.namespace_closes.inc()
        finally:
            self._closing = None

    def _warn_if_reopening(self) -> None:
        """Say, once a minute at most, that namespaces in use are being closed."""
        now = _clock.monotonic()
        if not self._recent_closed or now - self._warned_at < WARN_EVERY:
            return
        LOG.warning(
            "more namespaces are in use than this server keeps open (max_namespaces=%d):"
            " %d used in the last %.0f s were closed since the last warning, and each"
            " opens its store again when next used; raise it (keymutex serve"
            " --max-namespaces)",
            self._limit,
            self._recent_closed,
            KEEP_RECENT,
        )
        self._recent_closed = 0
        self._warned_at = now

    async def aclose(self) -> None:
        self._closed = True
        if self._closing is not None:
            await asyncio.wait([self._closing])  # not cancelled if this call is
        while self._open:
            _, entry = self._open.popitem()
            await entry.locks.aclose()
            self._metrics.namespaces_open.set(len(self._open))


@dataclasses.dataclass(slots=True)
class _Open:
    """An open namespace's client, and when it was opened and last used (monotonic)."""

    locks: AsyncLocks
    opened_at: float
    used_at: float

"""``memory://[name]``: leases in this process only.

Every ``Locks("memory://name")`` of one process shares one table (``memory://`` is
the table named ""), so stateless renew and release work across instances. Steps take
one mutex for microseconds and never block, so the async store runs them inline.
Waiters are queued per key and woken in arrival order. Nothing survives the process:
fences start again at 1 in a new process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keymutex import _clock
from keymutex._lease import Holder, Outcome
from keymutex._store import (
    AsyncStore,
    Capabilities,
    RenewRequest,
    ThreadedAsyncStore,
)
from keymutex._urls import redacted, split_url
from keymutex.stores._doorbell import Doorbell

__all__ = ["MemoryStore", "driver"]

CAPABILITIES = Capabilities(
    notifies=True, fair=True, cross_process=False, durable_fences=False, clock="process-monotonic"
)


@dataclass(slots=True)
class _Lease:
    token: str
    owner: str
    info: str | None  # as JSON: each Holder gets a dict of its own, as from other stores
    fence: int
    acquired_at: float
    expires: float  # on _clock.monotonic: what decides
    expires_at: float  # the same moment in wall-clock seconds, for display (as stored)


class _MemoryWaiter(Doorbell):
    __slots__ = ("_table", "key", "queued")

    def __init__(self, table: _Table, key: tuple[str, str]) -> None:
        super().__init__()
        self._table = table
        self.key = key
        self.queued = False

    def close(self) -> None:
        self._table.leave(self)


class _Table:
    """The shared state of one ``memory://name``; every access holds ``mutex``."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.leases: dict[tuple[str, str], _Lease] = {}
        self.queues: dict[tuple[str, str], deque[_MemoryWaiter]] = {}
        self.fence = 0
        self._grants_since_sweep = 0

    def live(self, key: tuple[str, str], now: float) -> _Lease | None:
        lease = self.leases.get(key)
        if lease is not None and lease.expires <= now:
            del self.leases[key]
            return None
        return lease

    def sweep(self, now: float) -> None:
        """Drop expired leases, amortised: one full pass per as many grants as leases."""
        self._grants_since_sweep += 1
        if self._grants_since_sweep < len(self.leases):
            return
        self._grants_since_sweep = 0
        for key in [k for k, lease in self.leases.items() if lease.expires <= now]:
            del self.leases[key]

    def enqueue(self, waiter: _MemoryWaiter) -> None:
        if not waiter.queued:
            self.queues.setdefault(waiter.key, deque()).append(waiter)
            waiter.queued = True

    def dequeue(self, waiter: _MemoryWaiter) -> None:
        if waiter.queued:
            queue = self.queues[waiter.key]
            queue.remove(waiter)
            if not queue:
                del self.queues[waiter.key]
            waiter.queued = False

    def head(self, key: tuple[str, str]) -> _MemoryWaiter | None:
        queue = self.queues.get(key)
        return queue[0] if queue else None

    def leave(self, waiter: _MemoryWaiter) -> None:
        with self.mutex:
            was_head = self.head(waiter.key) is waiter
            self.dequeue(waiter)
            successor = self.head(waiter.key)
            if not (was_head and successor and self.live(waiter.key, _clock.monotonic()) is None):
                successor = None
        if successor is not None:  # the key is free and it was our turn: pass it on
            successor.ring()


_TABLES: dict[str, _Table] = {}
_TABLES_MUTEX = threading.Lock()


def _reset_after_fork() -> None:
    """A forked child keeps the tables' leases but none of the parent's waiters or mutexes."""
    global _TABLES_MUTEX
    _TABLES_MUTEX = threading.Lock()
    for table in _TABLES.values():
        table.mutex = threading.Lock()
        for queue in table.queues.values():
            for waiter in queue:
                waiter.queued = False
        table.queues.clear()


os.register_at_fork(after_in_child=_reset_after_fork)


def _holder(key: str, lease: _Lease) -> Holder:
    return Holder(
        key=key,
        owner=lease.owner,
        info=None if lease.info is None else json.loads(lease.info),
        fence=lease.fence,
        acquired_at=lease.acquired_at,
        expires_at=lease.expires_at,
    )


class MemoryStore:
    """The ``memory://`` store for one namespace."""

    capabilities = CAPABILITIES

    def __init__(self, table: _Table, namespace: str) -> None:
        self._table = table
        self._namespace = namespace

    def _outcome(self, ok: bool, key: str, lease: _Lease | None, now: float) -> Outcome:
        if lease is None:
            return Outcome(ok)
        return Outcome(ok, _holder(key, lease), lease.expires - now)

    def try_acquire(
        self,
        key: str,
        *,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: Any,
    ) -> Outcome:
        table, full_key = self._table, (self._namespace, key)
        assert waiter is None or isinstance(waiter, _MemoryWaiter)
        info_json = None if info is None else json.dumps(info, separators=(",", ":"))
        with table.mutex:
            now = _clock.monotonic()
            current = table.live(full_key, now)
            if current is not None and current.token == token:
                # Granted already (a retry whose reply was lost): the lease as it stands.
                if waiter is not None:
                    table.dequeue(waiter)
                return self._outcome(True, key, current, now)
            head = table.head(full_key)
            if not steal and (current is not None or (head is not None and head is not waiter)):
                if waiter is not None:
                    table.enqueue(waiter)
                return self._outcome(False, key, current, now)
            if waiter is not None:
                table.dequeue(waiter)
            table.fence += 1
            wall = time.time()
            lease = _Lease(token, owner, info_json, table.fence, wall, now + ttl, wall + ttl)
            table.leases[full_key] = lease
            table.sweep(now)
            return self._outcome(True, key, lease, now)

    def renew(self, key: str, token: str, ttl: float) -> Outcome:
        return self.renew_many([RenewRequest(key, token, ttl)])[0]

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        outcomes = []
        with self._table.mutex:
            now = _clock.monotonic()
            for request in requests:
                current = self._table.live((self._namespace, request.key), now)
                if current is None or current.token != request.token:
                    outcomes.append(self._outcome(False, request.key, current, now))
                    continue
                current.expires = now + request.ttl
                current.expires_at = time.time() + request.ttl
                outcomes.append(self._outcome(True, request.key, current, now))
        return outcomes

    def release(self, key: str, token: str) -> Outcome:
        table, full_key = self._table, (self._namespace, key)
        with table.mutex:
            now = _clock.monotonic()
            current = table.leases.get(full_key)
            if current is None or current.token != token:
                return self._outcome(False, key, table.live(full_key, now), now)
            del table.leases[full_key]
            successor = table.head(full_key)
        if successor is not None:  # the key is free now: wake the first waiter
            successor.ring()
        # A lease past its expiry was no longer ours to release: report it lost.
        return Outcome(current.expires > now)

    def holder(self, key: str) -> Holder | None:
        with self._table.mutex:
            now = _clock.monotonic()
            lease = self._table.live((self._namespace, key), now)
            return None if lease is None else _holder(key, lease)

    def holders(self, prefix: str) -> list[Holder]:
        with self._table.mutex:
            now = _clock.monotonic()
            found = [
                _holder(key, lease)
                for (namespace, key), lease in self._table.leases.items()
                if namespace == self._namespace and key.startswith(prefix) and lease.expires > now
            ]
        return sorted(found, key=lambda holder: holder.key)

    def waiter(self, key: str) -> _MemoryWaiter:
        return _MemoryWaiter(self._table, (self._namespace, key))

    def close(self) -> None:
        """Nothing to close: the table lives as long as the process."""


def table_name(url: str) -> str:
    """The table a memory URL names (``""`` for ``memory://``); ``ValueError`` if malformed."""
    parts = split_url(url, "memory", "memory:// or memory://NAME")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"memory URLs are memory:// or memory://NAME, not {redacted(url)!r}")
    return parts.netloc


class MemoryDriver:
    def open(self, url: str, *, namespace: str, options: Mapping[str, object]) -> MemoryStore:
        name = table_name(url)
        if options:
            raise TypeError(f"the memory store takes no options, got {sorted(options)}")
        with _TABLES_MUTEX:
            table = _TABLES.setdefault(name, _Table())
        return MemoryStore(table, namespace)

    def open_async(self, url: str, *, namespace: str, options: Mapping[str, object]) -> AsyncStore:
        return ThreadedAsyncStore(
            self.open(url, namespace=namespace, options=options), inline=True
        )


driver = MemoryDriver()

"""A lease and what is known of it: ``Holder``, ``Outcome``, ``Lease``, ``AsyncLease``.

The twins ``Lease`` / ``AsyncLease`` differ only in how they call back into their
``Locks`` / ``AsyncLocks``; every attribute and state change is written once in
``LeaseState``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from keymutex import _clock
from keymutex._errors import LockLost

if TYPE_CHECKING:
    from keymutex._client import AsyncLocks, Locks

__all__ = ["AsyncLease", "Holder", "Lease", "LeaseState", "Outcome"]

_LOG = logging.getLogger("keymutex")

JSONDict = dict[str, Any]


# No slots=True here: on Python 3.11 a frozen dataclass with slots raises TypeError
# instead of FrozenInstanceError on assignment (fixed in 3.12), which users would see.
@dataclass(frozen=True)
class Holder:
    """What anyone may see about a current lease. It never contains the token.

    ``acquired_at`` and ``expires_at`` are wall-clock UNIX seconds, for display only:
    decisions use the monotonic clock. Two holders are equal when they describe the
    same grant (key, owner, info, fence, acquired_at): ``expires_at`` is left out, as
    each read works it out from the time left then, and a renewal moves it.
    """

    key: str
    owner: str
    # Left out of the hash (a dict has none), not out of ==: equal holders hash alike.
    info: JSONDict | None = field(hash=False)
    fence: int
    acquired_at: float
    expires_at: float = field(compare=False)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A store's answer to one atomic step.

    ``ok`` says whether the step took effect. ``holder`` is the lease after the step
    when ``ok`` (``None`` after a release), else the key's current holder, if any.
    ``remaining`` is the holder's time left in seconds by the store's clock, when known:
    waiters use it to wake up when the holder expires.
    """

    ok: bool
    holder: Holder | None = None
    remaining: float | None = None


class LeaseState:
    """What a granted lease knows about itself.

    ``remaining`` comes from this process's monotonic clock, counted from *before* the
    request that granted or renewed the lease was sent: it is never more than the
    store granted. ``lost`` is ``True`` once the lease is known to be gone or its
    local deadline has passed.
    """

    __slots__ = (
        "__weakref__",
        "_deadline",
        "_drawn",
        "_lost",
        "_mutex",
        "_new_holder",
        "_on_lost",
        "_pid",
        "_released",
        "_ttl",
        "acquired_at",
        "expires_at",
        "fence",
        "info",
        "key",
        "owner",
        "token",
    )

    key: str
    token: str
    fence: int
    owner: str
    info: dict[str, Any] | None
    acquired_at: float
    expires_at: float

    def __init__(
        self,
        key: str,
        token: str,
        outcome: Outcome,
        *,
        ttl: float,
        sent_at: float,
        on_lost: Callable[[Any], object] | None,
    ) -> None:
        self.key = key
        self.token = token
        self._ttl = ttl
        self._on_lost = on_lost
        self._lost = False
        self._released = False
        # The token was drawn by this client, not named by its caller (the lock server
        # passes its clients'): a release by it may go on in the background.
        self._drawn = False
        self._new_holder: Holder | None = None
        self._mutex = threading.Lock()
        # A forked child holds a copy, not the lease. Read from the kernel, never cached
        # across forks: a child forked without Python's at-fork hooks (uWSGI's prefork
        # workers by default) took itself for its parent when it was (found by review).
        self._pid = os.getpid()
        self._granted(outcome, sent_at, ttl)

    def _granted(self, outcome: Outcome, sent_at: float, ttl: float) -> None:
        """Take in a store's reply to a grant or renewal sent at ``sent_at``."""
        holder = outcome.holder
        assert outcome.ok
        assert holder is not None
        self.fence = holder.fence
        self.owner = holder.owner
        self.info = holder.info
        self.acquired_at = holder.acquired_at
        self.expires_at = holder.expires_at
        granted = ttl if outcome.remaining is None else min(ttl, outcome.remaining)
        self._deadline = sent_at + granted
        self._ttl = ttl

    @property
    def remaining(self) -> float:
        """Seconds left by this process's monotonic clock (0 once past, once the lease is
        known to be lost, and once released: found by review, a lease taken over, or
        released, went on showing the seconds to its old deadline, to code that checks
        ``remaining``)."""
        if self._lost or self._released:
            return 0.0
        return max(0.0, self._deadline - _clock.monotonic())

    @property
    def lost(self) -> bool:
        """``True`` once the lease is known to be gone, or its deadline has passed."""
        return self._lost or (not self._released and self._deadline <= _clock.monotonic())

    def _check_process(self) -> None:
        """A lease is renewed and released only by the process it was granted to."""
        if self._pid != os.getpid():
            raise LockLost(
                self.key,
                None,
                f"the lease on {self.key!r} belongs to process {self._pid}, not to this"
                " forked child; a child that must end it calls locks.release(key, token)",
            )

    def _mark_lost(self, holder: Holder | None) -> bool:
        """Record the loss; ``True`` the first time, when ``on_lost`` is due."""
        with self._mutex:
            if self._lost:
                return False
            self._lost = True
            self._new_holder = holder
            return True

    def _notify_lost(self) -> object:
        """Call ``on_lost(self)``; a failing callback is logged, never raised."""
        if self._on_lost is None:
            return None
        try:
            return self._on_lost(self)
        except Exception:
            _LOG.exception("on_lost callback for %r failed", self.key)
            return None

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self._released else "held"
        return (
            f"<{type(self).__name__} key={self.key!r} fence={self.fence} owner={self.owner!r}"
            f" {state} remaining={self.remaining:.3f}>"
        )


class Lease(LeaseState):
    """A granted lock, from ``Locks``. A context manager: leaving it releases.

    Leaving the ``with`` block raises ``LockLost`` when the lease was lost (taken
    over, expired, or unreachable until its deadline), unless the block raised.
    """

    __slots__ = ("_locks", "_renewing")

    def __init__(
        self,
        locks: Locks,
        key: str,
        token: str,
        outcome: Outcome,
        *,
        ttl: float,
        sent_at: float,
        on_lost: Callable[[Any], object] | None,
    ) -> None:
        super().__init__(key, token, outcome, ttl=ttl, sent_at=sent_at, on_lost=on_lost)
        self._locks = locks
        # Held across each renewal's round trip: replies applied in the order the store
        # applied their requests, so ``remaining`` never overstates the store's grant.
        self._renewing = threading.Lock()

    def renew(self, ttl: float | None = None) -> Lease:
        """Renew the lease to ``ttl`` seconds from now (default: its current TTL);
        ``LockLost`` if gone."""
        self._locks._renew_lease(self, ttl)
        return self

    def release(self) -> None:
        """Release the lease; ``LockLost`` if it no longer held its key or was released."""
        self._locks._release_lease(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._locks._finish_lease(self, block_failed=exc_type is not None)


class AsyncLease(LeaseState):
    """A granted lock, from ``AsyncLocks``. An async context manager: leaving releases.

    Leaving the ``async with`` block raises ``LockLost`` when the lease was lost,
    unless the block raised (cancellation included).
    """

    __slots__ = ("_locks", "_renewing")

    def __init__(
        self,
        locks: AsyncLocks,
        key: str,
        token: str,
        outcome: Outcome,
        *,
        ttl: float,
        sent_at: float,
        on_lost: Callable[[Any], object] | None,
    ) -> None:
        super().__init__(key, token, outcome, ttl=ttl, sent_at=sent_at, on_lost=on_lost)
        self._locks = locks
        self._renewing = asyncio.Lock()  # as Lease._renewing

    async def renew(self, ttl: float | None = None) -> AsyncLease:
        """Renew the lease to ``ttl`` seconds from now (default: its current TTL);
        ``LockLost`` if gone."""
        await self._locks._renew_lease(self, ttl)
        return self

    async def release(self) -> None:
        """Release the lease; ``LockLost`` if it no longer held its key or was released.

        Once started, the release goes on if the caller is cancelled."""
        await self._locks._released(self)

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._locks._finish_lease(self, block_failed=exc_type is not None)

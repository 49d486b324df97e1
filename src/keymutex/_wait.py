"""Sans-I/O waiting decisions shared by the sync and async clients.

Nothing here sleeps or touches a store: the clients ask how long to park, park with
their own primitive, and try again.
"""

from __future__ import annotations

import random

from keymutex import _clock

__all__ = ["RECHECK_INTERVAL", "STORE_WAIT", "Backoff", "Deadline", "park_time"]

# Waiters on a store that notifies still look again this often: a safety net for a
# notification that could not be delivered (its sender died between commit and send).
RECHECK_INTERVAL = 1.0
# The longest wait queued at a lock server (which caps waits at 30 s by default).
STORE_WAIT = 25.0
# How long after the holder's expiry a waiter wakes, so the store's clock has passed it.
EXPIRY_MARGIN = 0.002


class Deadline:
    """A point on the monotonic clock, or none (wait as long as it takes)."""

    __slots__ = ("at",)

    def __init__(self, timeout: float | None) -> None:
        self.at = None if timeout is None else _clock.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left (never negative), or ``None`` when there is no deadline."""
        if self.at is None:
            return None
        return max(0.0, self.at - _clock.monotonic())

    def passed(self) -> bool:
        return self.at is not None and _clock.monotonic() >= self.at


class Backoff:
    """Exponential backoff with full jitter, for stores that cannot notify."""

    __slots__ = ("_ceiling", "_maximum")

    def __init__(self, initial: float = 0.002, maximum: float = 0.25) -> None:
        self._ceiling = initial
        self._maximum = maximum

    def next(self) -> float:
        ceiling = self._ceiling
        self._ceiling = min(self._maximum, ceiling * 2)
        return random.uniform(ceiling / 2, ceiling)


def park_time(
    deadline: Deadline,
    holder_remaining: float | None,
    backoff: Backoff | None,
    *,
    at_store: bool = False,
) -> float:
    """How long a refused waiter parks before it tries again.

    With ``backoff`` (the store cannot notify) the next backoff step; without it
    (woken by notification) the safety-net interval. Either way no later than the
    holder's expiry and the caller's deadline. A wait ``at_store`` (queued at the lock
    server, which watches the holder's expiry itself) lasts up to the caller's
    deadline, at most ``STORE_WAIT``.
    """
    if at_store:
        park = STORE_WAIT
    else:
        park = backoff.next() if backoff is not None else RECHECK_INTERVAL
        if holder_remaining is not None:
            park = min(park, holder_remaining + EXPIRY_MARGIN)
    left = deadline.remaining()
    if left is not None:
        park = min(park, left)
    return max(0.0, park)

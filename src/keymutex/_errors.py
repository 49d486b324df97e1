"""The errors keymutex raises on purpose.

    LockError                 base of everything keymutex raises on purpose
    ├── Locked                not acquired within timeout; .key, .holder
    ├── LockLost              the lease no longer holds its key; .key, .holder
    └── StoreError            the store failed or is unreachable; original as __cause__

Bad arguments are not ``LockError``: they raise ``ValueError`` or ``TypeError``
before anything touches a store.
"""

from __future__ import annotations

import datetime
from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from keymutex._lease import Holder

__all__ = ["LockError", "LockLost", "Locked", "StoreError"]


class LockError(Exception):
    """Base of every error keymutex raises on purpose."""


def _utc(timestamp: float) -> str:
    """A UNIX time as ISO 8601, UTC, to the second: ``2026-11-27T17:30:05Z``."""
    try:
        moment = datetime.datetime.fromtimestamp(timestamp, datetime.UTC)
    except (OverflowError, OSError, ValueError):  # out of the platform's range
        return f"{timestamp:.0f} (UNIX time)"
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _describe(holder: Holder | None) -> str:
    """Who holds the key, since when and until when (unless renewed), and its fence."""
    if holder is None:
        return "no current holder"
    return (
        f"held by {holder.owner!r} since {_utc(holder.acquired_at)}, until"
        f" {_utc(holder.expires_at)} unless renewed (fence {holder.fence})"
    )


class _KeyedError(LockError):
    """An error about one key and its holder: pickled and copied with both.

    The constructor's arguments are not ``args`` (that is the message alone, as for
    any exception), so ``__reduce__`` says how to build it again: in another process
    (a ``ProcessPoolExecutor`` job that raised it), or by ``copy``.
    """

    key: Hashable
    holder: Holder | None

    def __reduce__(self) -> tuple[type[_KeyedError], tuple[Hashable, Holder | None, str]]:
        return type(self), (self.key, self.holder, str(self))


class Locked(_KeyedError):
    """The key was not acquired within the timeout; ``holder`` is who had it, if known.

    ``key`` is a ``str`` for lease locks, any hashable for the in-process ``KeyedLock``.
    """

    def __init__(self, key: Hashable, holder: Holder | None, message: str | None = None) -> None:
        self.key = key
        self.holder = holder
        super().__init__(message or f"{key!r} is locked: {_describe(holder)}")


class LockLost(_KeyedError):
    """The lease no longer holds its key; ``holder`` is the new holder, if any."""

    key: str

    def __init__(self, key: str, holder: Holder | None, message: str | None = None) -> None:
        self.key = key
        self.holder = holder
        super().__init__(message or f"lease on {key!r} was lost: {_describe(holder)}")


class StoreError(LockError):
    """The store failed or could not be reached; the driver's exception is ``__cause__``."""

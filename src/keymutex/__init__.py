"""keymutex: a lock per key, in one process and across processes, machines and languages."""

from keymutex._client import AsyncLocks, Locks
from keymutex._errors import Locked, LockError, LockLost, StoreError
from keymutex._lease import AsyncLease, Holder, Lease
from keymutex._local import AsyncKeyedLock, KeyedLock
from keymutex._version import __version__

__all__ = [
    "AsyncKeyedLock",
    "AsyncLease",
    "AsyncLocks",
    "Holder",
    "KeyedLock",
    "Lease",
    "LockError",
    "LockLost",
    "Locked",
    "Locks",
    "StoreError",
    "__version__",
]

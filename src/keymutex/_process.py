"""This process's id, as every fork check of keymutex reads it.

Read from the kernel at each call (``os.getpid()``), never cached: a cache refreshed by
an ``os.register_at_fork`` hook goes stale in a child forked without Python's at-fork
hooks, uWSGI's prefork workers by default (no ``--py-call-osafterfork`` nor
``--py-call-uwsgi-fork-hooks``) or a C extension's ``fork()``. Such a child then took
itself for its parent: it named the parent as the owner of its grants and went on
using the parent's sockets and SQLite connection, whose replies other workers read
(found by review, in uWSGI with 3 workers: 0 of 600 grants named their owner, 1 in 3
acquires read another worker's reply). The process-id checks are what still tells a
child from its parent where no hook ran.
"""

from __future__ import annotations

import os

__all__ = ["pid"]


def pid() -> int:
    """``os.getpid()``."""
    return os.getpid()

"""This process's id, read once per process instead of by a system call at each use.

``os.getpid()`` asks the kernel every time (glibc stopped caching it in 2.25), and a
lock's steps ask several times each: the owner named in a grant, whether a ``Lease``
belongs to this process, whether a store's sockets are this process's or a forked
parent's. Between two round trips, cold, those calls cost more than their own few
hundred nanoseconds: found by counting the system calls of a memcached acquire +
release (14 against sherlock's 7, three of them ``getpid``).

The id is read again in a child forked by ``os.fork()`` (``multiprocessing``,
``subprocess``'s ``preexec_fn``, ``pty.fork()`` go through it) before any other
after-fork hook of keymutex runs: this module is imported first, and hooks run in
the order they were registered.
"""

from __future__ import annotations

import os

__all__ = ["pid"]

_pid = os.getpid()


def _forked() -> None:
    global _pid  # read by pid() at each call
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def pid() -> int:
    """``os.getpid()``, without a system call."""
    return _pid

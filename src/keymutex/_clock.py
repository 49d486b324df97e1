"""The clock every time decision uses.

On Linux this is ``CLOCK_BOOTTIME``: monotonic, shared by every process on the host
(read as the host's in a time namespace too), and still running while the machine is
suspended (a suspended holder's lease must expire in real time). Elsewhere it is
``time.monotonic()``. Wall-clock time is used only for display (``acquired_at``,
``expires_at``).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

__all__ = ["boot_id", "monotonic"]


def _boottime_offset(path: str = "/proc/self/timens_offsets") -> float:
    """How far this process's ``CLOCK_BOOTTIME`` is set off the host's (seconds).

    A Linux time namespace (``unshare --time``, CRIU's restore, some container
    runtimes) shifts it per process, and the boot id does not tell. Found by review:
    a process in one, 50,000 s behind, wrote expiry times long past for the host's
    processes (another was granted the key it held) and read theirs as hours away.

    The file describes the namespace of the process's children: after ``unshare`` of
    a time namespace, before a fork, the process itself is still in its old one (taken
    to be the host's: its offsets can no longer be read).
    """
    try:
        if os.readlink("/proc/self/ns/time") != os.readlink("/proc/self/ns/time_for_children"):
            return 0.0
        with open(path, encoding="ascii") as file:
            for line in file:
                name, seconds, nanoseconds = line.split()
                if name == "boottime":
                    return int(seconds) + int(nanoseconds) / 1e9
    except (OSError, ValueError):
        pass
    return 0.0


def _pick_clock() -> Callable[[], float]:
    clock_id = getattr(time, "CLOCK_BOOTTIME", None)
    if clock_id is None:
        return time.monotonic
    try:
        time.clock_gettime(clock_id)
    except OSError:  # pragma: no cover - kernels without CLOCK_BOOTTIME
        return time.monotonic
    offset = _boottime_offset()
    if offset:
        return lambda: time.clock_gettime(clock_id) - offset
    return functools.partial(time.clock_gettime, clock_id)


monotonic: Callable[[], float] = _pick_clock()


def _forked() -> None:
    """A child forked after its parent made a time namespace for its children is in
    it: read the offset again."""
    global monotonic  # callers look it up at each call (_clock.monotonic)
    monotonic = _pick_clock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


@functools.cache
def boot_id() -> str | None:
    """An id of this boot of the host, when the kernel offers one (Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return None

"""The clock every time decision uses.

On Linux this is ``CLOCK_BOOTTIME``: monotonic, shared by every process on the host,
and still running while the machine is suspended (a suspended holder's lease must
expire in real time). Elsewhere it is ``time.monotonic()``. Wall-clock time is used
only for display (``acquired_at``, ``expires_at``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

__all__ = ["boot_id", "monotonic"]


def _pick_clock() -> Callable[[], float]:
    clock_id = getattr(time, "CLOCK_BOOTTIME", None)
    if clock_id is None:
        return time.monotonic
    try:
        time.clock_gettime(clock_id)
    except OSError:  # pragma: no cover - kernels without CLOCK_BOOTTIME
        return time.monotonic
    return functools.partial(time.clock_gettime, clock_id)


monotonic: Callable[[], float] = _pick_clock()


@functools.cache
def boot_id() -> str | None:
    """An id of this boot of the host, when the kernel offers one (Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return None

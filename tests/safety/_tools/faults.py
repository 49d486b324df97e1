"""Fault injectors: pause or kill a process, wait for a condition, run a store to break.

Network faults are in ``proxy.py``; these act on processes (holders or servers).
Each injector undoes itself on the way out of its ``with`` block, also when the test
fails: a paused process is always resumed, a started server always stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from _redis_servers import RedisServer

__all__ = ["kill", "paused", "redis_standalone", "wait_until"]

T = TypeVar("T")


def _pid(process: subprocess.Popen[bytes] | subprocess.Popen[str] | int) -> int:
    return process if isinstance(process, int) else process.pid


@contextlib.contextmanager
def paused(process: subprocess.Popen[bytes] | subprocess.Popen[str] | int) -> Iterator[float]:
    """SIGSTOP the process for the block (its threads too: no renewals), then SIGCONT.

    Yields the monotonic time of the pause.
    """
    pid = _pid(process)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def kill(process: subprocess.Popen[bytes] | subprocess.Popen[str]) -> float:
    """SIGKILL, as a crash would: no ``finally``, no release. The monotonic time of it."""
    process.send_signal(signal.SIGKILL)
    at = time.monotonic()
    process.wait()
    return at


def wait_until(
    predicate: Callable[[], T], timeout: float, *, interval: float = 0.01, what: str = ""
) -> T:
    """Poll ``predicate`` until it returns something true; its value. Fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout} s: {what or predicate}")
        time.sleep(interval)


@contextlib.contextmanager
def redis_standalone(directory: Path, *, appendonly: bool) -> Iterator[RedisServer]:
    """A redis-server of the test's own, to pause, kill and restart (``RedisServer``).

    With ``appendonly``, every write is fsynced before its reply (``appendfsync always``).
    """
    from _redis_fixtures import require_redis

    require_redis()
    from _redis_servers import standalone

    with standalone(directory, appendonly=appendonly, appendfsync="always") as server:
        yield server

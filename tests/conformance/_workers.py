"""Code that runs in child processes (importable under the spawn start method).

Each worker opens its own client on the URL, waits for the start signal so that all
workers contend at once, then increments a counter file under the lock. Inside the
critical section it also claims a marker file with ``O_EXCL``: a second process
inside at the same time fails to create it, and the worker exits non-zero.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import keymutex


def _critical_section(directory: Path, fence: int) -> None:
    marker = directory / "inside"
    fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # FileExistsError on overlap
    try:
        counter = directory / "counter"
        value = int(counter.read_text())
        time.sleep(0.001)  # widen the window a lost update needs
        counter.write_text(str(value + 1))
        with open(directory / "fences", "a") as log:
            log.write(f"{fence}\n")
    finally:
        os.close(fd)
        os.unlink(marker)


def count_sync(
    url: str, namespace: str, key: str, directory: str, rounds: int, start: Any
) -> None:
    with keymutex.Locks(url, namespace=namespace, ttl=10.0) as locks:
        start.wait(60)
        for _ in range(rounds):
            with locks.lock(key, timeout=50) as lease:
                _critical_section(Path(directory), lease.fence)


async def _count_async(url: str, namespace: str, key: str, directory: str, rounds: int) -> None:
    async with keymutex.AsyncLocks(url, namespace=namespace, ttl=10.0) as alocks:
        for _ in range(rounds):
            async with alocks.lock(key, timeout=50) as lease:
                _critical_section(Path(directory), lease.fence)
                await asyncio.sleep(0)


def count_async(
    url: str, namespace: str, key: str, directory: str, rounds: int, start: Any
) -> None:
    start.wait(60)
    asyncio.run(_count_async(url, namespace, key, directory, rounds))


def try_once(url: str, namespace: str, key: str) -> tuple[str, object, object, int]:
    """Try ``key`` once from this process; say what happened."""
    with keymutex.Locks(url, namespace=namespace, owner="child") as locks:
        try:
            lease = locks.acquire(key, timeout=0)
        except keymutex.Locked as exc:
            holder = exc.holder
        else:
            lease.release()
            return ("acquired", lease.owner, lease.info, lease.fence)
    if holder is None:
        return ("locked", None, None, -1)
    return ("locked", holder.owner, holder.info, holder.fence)


def hold_until_killed(url: str, namespace: str, key: str, ttl: float, report: Any) -> None:
    """Hold ``key`` with a renewing lease, report its fence, then hang until killed."""
    locks = keymutex.Locks(url, namespace=namespace, owner="doomed")
    lease = locks.acquire(key, ttl=ttl, renew=True)
    report.put(lease.fence)
    time.sleep(600)


def wait_for_key(url: str, namespace: str, key: str, timeout: float, report: Any) -> None:
    """Say we are about to wait, wait for ``key``, report the lease's fence and owner."""
    with keymutex.Locks(url, namespace=namespace, owner="patient") as locks:
        report.put("waiting")
        lease = locks.acquire(key, ttl=30.0, timeout=timeout, info={"pid": os.getpid()})
        report.put((lease.fence, lease.owner, lease.info))
        lease.release()

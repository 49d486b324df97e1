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

__all__ = [
    "NetworkNamespace",
    "kill",
    "network_namespace",
    "paused",
    "paused_tree",
    "redis_standalone",
    "wait_until",
]

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


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid …": comm may hold spaces and parentheses.
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry.name))
    return found


@contextlib.contextmanager
def paused_tree(process: subprocess.Popen[bytes] | subprocess.Popen[str] | int) -> Iterator[float]:
    """``paused`` for a server made of processes (PostgreSQL: the postmaster and every
    backend and worker it started): all of them frozen, sockets open, nothing answered.

    Yields the monotonic time of the pause.
    """
    root = _pid(process)
    stopped: list[int] = []
    try:
        os.kill(root, signal.SIGSTOP)  # first: it starts nobody new meanwhile
        stopped.append(root)
        for child in _children(root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGSTOP)
                stopped.append(child)
        yield time.monotonic()
    finally:
        for pid in reversed(stopped):
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


class NetworkNamespace:
    """A network namespace linked to this one by a veth pair (``network_namespace``).

    A process started with ``command(...)`` runs inside it and reaches this namespace
    only through the link, at ``host_ip``; ``partition()`` takes the link down (packets
    are dropped, sockets stay open: a real partition, not an in-process proxy),
    ``heal()`` brings it back.
    """

    def __init__(self, name: str, host_link: str, host_ip: str) -> None:
        self.name, self.host_link, self.host_ip = name, host_link, host_ip

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def partition(self) -> None:
        _ip("link", "set", self.host_link, "down")

    def heal(self) -> None:
        _ip("link", "set", self.host_link, "up")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def network_namespace_problem() -> str | None:
    """Why ``network_namespace`` cannot run here, or ``None``."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); the tests ran as a user"
    try:
        _ip("netns", "add", "km-probe")
        _ip("netns", "delete", "km-probe")
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"cannot make a network namespace here: {exc}"
    return None


@contextlib.contextmanager
def network_namespace(tag: str) -> Iterator[NetworkNamespace]:
    """A namespace ``km-<tag>`` with a veth link: 10.213.<n>.1 here, 10.213.<n>.2 there."""
    subnet = int.from_bytes(os.urandom(1), "big")
    name, host_link, ns_link = f"km-{tag}", f"km{tag}h"[:15], f"km{tag}n"[:15]
    host_ip, ns_ip = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
    _ip("netns", "add", name)
    try:
        _ip("link", "add", host_link, "type", "veth", "peer", "name", ns_link)
        _ip("link", "set", ns_link, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_link)
        _ip("link", "set", host_link, "up")
        _ip("-n", name, "addr", "add", f"{ns_ip}/30", "dev", ns_link)
        _ip("-n", name, "link", "set", ns_link, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield NetworkNamespace(name, host_link, host_ip)
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "delete", host_link)  # its peer goes with it
        _ip("netns", "delete", name)

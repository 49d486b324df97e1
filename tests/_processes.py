"""What every helper that starts a real server for the tests needs: a free port that no
other helper of this process was given, a way to die with the test run, and a registry
of what still runs, killed when the interpreter exits."""

from __future__ import annotations

import atexit
import shutil
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol

HOST = "127.0.0.1"

_ports_lock = threading.Lock()
_ports_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on now, never the same one twice in this process."""
    with _ports_lock:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((HOST, 0))
                port = int(sock.getsockname()[1])
            if port not in _ports_handed_out:
                _ports_handed_out.add(port)
                return port


def parent_death_guard() -> list[str]:
    """A command prefix that kills the server if the test run dies (``setpriv``).

    PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, so it is only
    used for servers started by the main thread (which lives as long as the process).
    """
    if threading.current_thread() is threading.main_thread() and shutil.which("setpriv"):
        return ["setpriv", "--pdeathsig", "KILL", "--"]
    return []


class _Killable(Protocol):
    def kill(self) -> None: ...


class Running:
    """The servers of one kind this process started and has not stopped yet.

    ``add`` when started, ``discard`` when reaped; whatever is left when the interpreter
    exits (a failed test, an interrupted run) is killed then, and ``then`` is called on
    it (e.g. to remove its directory).
    """

    def __init__(self, then: Callable[[Any], object] | None = None) -> None:
        self._servers: set[_Killable] = set()
        self._lock = threading.Lock()
        self._then = then
        atexit.register(self.kill_all)

    def add(self, server: _Killable) -> None:
        with self._lock:
            self._servers.add(server)

    def discard(self, server: _Killable) -> None:
        with self._lock:
            self._servers.discard(server)

    def __contains__(self, server: object) -> bool:
        with self._lock:
            return server in self._servers

    def kill_all(self) -> None:
        with self._lock:
            leftovers = list(self._servers)
        for server in leftovers:
            server.kill()
            if self._then is not None:
                self._then(server)

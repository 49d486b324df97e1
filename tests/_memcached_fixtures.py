"""A real memcached for the tests, started once per session and shared.

``tests/conftest.py`` names this module in ``pytest_plugins``, so every test can ask for
``memcached_url`` (``memcached://127.0.0.1:PORT``) or ``memcached_server`` (the process).
The server starts on first use; a run that uses neither starts nothing. It is shared by
every test: never stop, restart or flush it (tests keep apart by namespace). A test that
breaks a server starts its own ``MemcachedServer`` in a ``with`` block.

It runs as the Debian package installs it (``/usr/bin/memcached``)::

    memcached -l 127.0.0.1 -p PORT -U 0 -m 64 [-u nobody]

``-U 0`` turns UDP off, ``-m 64`` caps it at 64 MB, ``-u nobody`` drops root (memcached
refuses to run as root otherwise). Startup polls ``version`` every 10 ms, and a server
started from the main thread gets SIGKILL as its parent-death signal (``setpriv``), so
even a SIGKILLed pytest leaves nothing behind. Without ``memcached`` on ``PATH`` the
tests that need it are skipped, with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Self

import pytest

from _processes import Running, free_port

__all__ = ["MemcachedServer", "memcached_server", "memcached_url", "require_memcached"]

HOST = "127.0.0.1"
PATIENCE = 30.0  # seconds a start may take on a small, shared machine
_POLL = 0.01
_STOP_GRACE = 5.0

_running = Running()  # killed at exit if still running


def require_memcached() -> str:
    """The memcached executable; skips the calling test when it is not installed."""
    pytest.importorskip("pymemcache", reason="pymemcache is not installed (keymutex[memcached])")
    executable = shutil.which("memcached")
    if executable is None:
        pytest.skip("memcached not on PATH: the memcached tests run against a real server"
                    " (Debian/Ubuntu: apt install memcached)")  # fmt: skip
    return executable


class MemcachedServer:
    """One memcached process on ``port``; ``restart()`` comes back empty on the same port."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        memory_mb: int = 64,
        threads: int | None = None,
    ) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.memory_mb = memory_mb
        self.threads = threads  # worker threads (-t); None: memcached's default (4)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"memcached://{HOST}:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.directory / "memcached.log"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __repr__(self) -> str:
        return f"<MemcachedServer {self.url}>"

    def command(self, line: str, *, until: bytes = b"\r\n") -> str:
        """Send one text-protocol line; the reply, read until it ends with ``until``."""
        with socket.create_connection((HOST, self.port), timeout=2.0) as sock:
            sock.sendall(line.encode("ascii") + b"\r\n")
            reply = b""
            while not reply.endswith(until):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
        return reply.decode("ascii", errors="replace")

    def stats(self) -> dict[str, str]:
        fields = {}
        for row in self.command("stats", until=b"END\r\n").splitlines():
            parts = row.split(" ", 2)
            if len(parts) == 3 and parts[0] == "STAT":
                fields[parts[1]] = parts[2]
        return fields

    def _answers(self) -> bool:
        try:
            return self.command("version").startswith("VERSION ")
        except OSError:
            return False

    def start(self) -> Self:
        """Start and wait until it answers ``version`` (another port if ours was taken)."""
        for attempt in range(3):
            self._spawn()
            deadline = time.monotonic() + PATIENCE
            while self.alive and not self._answers():
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{self!r} did not answer:\n{self.log_tail()}")
                time.sleep(_POLL)
            if self.alive:
                return self
            self._reap()
            if "Address already in use" not in self.log_tail() or attempt == 2:
                raise RuntimeError(f"{self!r} exited at start:\n{self.log_tail()}")
            self.port = free_port()
        raise AssertionError("unreachable")

    def restart(self) -> Self:
        """Stop (cleanly) and start again on the same port: every item is gone."""
        self.stop()
        port = self.port
        self.start()
        assert self.port == port, f"port {port} was taken while memcached restarted"
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it is not gone within 5 s."""
        if self.alive:
            assert self.process is not None
            self.process.terminate()
        self._reap()

    def kill(self) -> None:
        if self.alive:
            assert self.process is not None
            self.process.kill()
        self._reap()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _spawn(self) -> None:
        executable = shutil.which("memcached")
        if executable is None:
            raise RuntimeError("memcached is not installed")
        guard: list[str] = []
        # PR_SET_PDEATHSIG fires when the thread that forked ends: main thread only.
        if threading.current_thread() is threading.main_thread() and shutil.which("setpriv"):
            guard = ["setpriv", "--pdeathsig", "KILL", "--"]
        as_user = ["-u", "nobody"] if os.geteuid() == 0 else []
        threads = [] if self.threads is None else ["-t", str(self.threads)]
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                [*guard, executable, "-l", HOST, "-p", str(self.port), "-U", "0",
                 "-m", str(self.memory_mb), *threads, *as_user],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        _running.add(self)

    def _reap(self) -> None:
        process = self.process
        if process is not None:
            try:
                process.wait(_STOP_GRACE)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        _running.discard(self)


@pytest.fixture(scope="session")
def memcached_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MemcachedServer]:
    require_memcached()
    with MemcachedServer(tmp_path_factory.mktemp("memcached")).start() as server:
        yield server


@pytest.fixture(scope="session")
def memcached_url(memcached_server: MemcachedServer) -> str:
    return memcached_server.url

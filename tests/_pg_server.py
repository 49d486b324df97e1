"""A real PostgreSQL server for tests and benchmarks: ``initdb`` into a temporary
directory, ``postgres`` on a free port of 127.0.0.1, stopped and removed afterwards.

Nothing is mocked: this is Debian's (or any) PostgreSQL, found on ``PATH`` or under
``/usr/lib/postgresql/*/bin`` (the newest version). ``missing_binaries()`` says what is
not there, so callers can skip with the reason.

PostgreSQL refuses to run as root. When the tests run as root (as they do in CI),
``initdb`` and ``postgres`` run as an unprivileged user: ``keymutex-test``, created on
first use (``useradd --system``), or ``nobody`` when it cannot be created. The server's
directory is made in ``/tmp`` (not under pytest's root-only ``tmp_path``) and owned by
that user.

The server runs with ``fsync=off`` (tests do not survive power cuts, and it is much
faster), loads ``pg_stat_statements`` (statement counts for the tests) and allows
300 connections (every ``Locks`` has a pool and a listener connection).

No process outlives its user:

- ``PostgresServer`` is a context manager; the fixtures use ``with``, so a failing test
  still stops the server (SIGINT: PostgreSQL's fast shutdown; SIGKILL after 10 s);
- what still runs when the interpreter exits is killed by an ``atexit`` hook;
- a server started from the main thread also gets SIGKILL as its parent-death signal
  (``setpriv --pdeathsig``), so even a SIGKILLed pytest leaves no postmaster behind
  (its backends notice the postmaster's death and exit on their own).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Self

from _processes import Running
from _processes import free_port as _free_port

__all__ = [
    "PATIENCE",
    "PostgresServer",
    "ServerError",
    "find_binaries",
    "missing_binaries",
    "running_server",
]

HOST = "127.0.0.1"
SUPERUSER = "postgres"
DATABASE = "postgres"
UNPRIVILEGED_USER = "keymutex-test"
# How long a start may take before we call it broken: generous, the machine is shared.
PATIENCE = 60.0
_STOP_GRACE = 10.0
_POLL = 0.02
_PROGRAMS = ("initdb", "postgres")

SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "on",
    "full_page_writes": "off",
    "max_connections": "300",
    "shared_buffers": "32MB",
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "top",
    "log_min_messages": "warning",
    "log_min_error_statement": "panic",
}


class ServerError(RuntimeError):
    """The server did not start or stop as expected (its log attached)."""


def find_binaries() -> Path | None:
    """The directory holding ``initdb`` and ``postgres``: ``PATH`` first, else the
    newest ``/usr/lib/postgresql/*/bin`` (Debian keeps them off ``PATH``)."""
    on_path = [shutil.which(program) for program in _PROGRAMS]
    if all(on_path):
        return Path(on_path[0]).parent  # type: ignore[arg-type]
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda path: int(Path(path).parent.name) if Path(path).parent.name.isdigit() else 0,
    )
    for directory in reversed(candidates):
        if all((Path(directory) / program).exists() for program in _PROGRAMS):
            return Path(directory)
    return None


def missing_binaries() -> list[str]:
    """The PostgreSQL programs that cannot be found (empty: all there)."""
    return [] if find_binaries() is not None else list(_PROGRAMS)


def _server_account() -> pwd.struct_passwd | None:
    """The unprivileged account to run PostgreSQL as, or ``None`` when not root."""
    if os.geteuid() != 0:
        return None
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(UNPRIVILEGED_USER)
    useradd = shutil.which("useradd")
    if useradd is not None:
        # Another test session may create it at the same moment: look again either way.
        subprocess.run(
            [
                useradd,
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                UNPRIVILEGED_USER,
            ],
            capture_output=True,
            check=False,
        )
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(UNPRIVILEGED_USER)
    return pwd.getpwnam("nobody")


def _as_account(account: pwd.struct_passwd | None, *, guard: bool) -> list[str]:
    """The command prefix that drops to ``account`` (and sets the parent-death signal)."""
    setpriv = shutil.which("setpriv")
    prefix: list[str] = []
    if setpriv is not None and (guard or account is not None):
        prefix = [setpriv]
        if guard:
            prefix += ["--pdeathsig", "KILL"]
        if account is not None:
            prefix += [
                f"--reuid={account.pw_uid}",
                f"--regid={account.pw_gid}",
                "--init-groups" if account.pw_name != "nobody" else "--clear-groups",
            ]
        prefix.append("--")
    elif account is not None:
        runuser = shutil.which("runuser")
        if runuser is None:
            raise ServerError("running as root needs setpriv or runuser to drop privileges")
        prefix = [runuser, "-u", account.pw_name, "--"]
    return prefix


# Killed at exit if still running, and its directory removed.
_running = Running(then=lambda server: server.remove())


class PostgresServer:
    """One PostgreSQL cluster in a directory of its own, and its ``postgres`` process.

    ``start()`` runs ``initdb`` the first time and waits until connections are accepted;
    ``stop()`` is a fast shutdown (SIGINT), ``kill()`` is SIGKILL (crash recovery at the
    next start), ``restart()`` starts the same data directory on the same port again.
    ``url`` is a superuser URL (``trust`` authentication on 127.0.0.1).
    """

    def __init__(self, *, settings: dict[str, str] | None = None) -> None:
        binaries = find_binaries()
        if binaries is None:
            raise ServerError("PostgreSQL is not installed (Debian: apt install postgresql)")
        self.binaries = binaries
        self.account = _server_account()
        self.directory = Path(tempfile.mkdtemp(prefix="keymutex-pg-"))
        self.data = self.directory / "data"
        self.sockets = self.directory / "sockets"
        self.log_file = self.directory / "postgres.log"
        self.port = _free_port()
        self.settings = {**SETTINGS, **(settings or {})}
        self.process: subprocess.Popen[bytes] | None = None
        self._initialised = False

    # --- what clients connect to

    @property
    def url(self) -> str:
        return f"postgresql://{SUPERUSER}@{HOST}:{self.port}/{DATABASE}"

    def __repr__(self) -> str:
        state = "running" if self.alive else "down"
        return f"<PostgresServer {HOST}:{self.port} {self.directory} {state}>"

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return f"--- {self!r}: no log"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- last lines of {self.log_file}:\n{tail}"

    # --- life cycle

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, *, patience: float = PATIENCE) -> Self:
        """Initialise (first time only), start, and wait until connections are accepted."""
        if not self._initialised:
            self._initdb()
        for attempt in range(3):
            self._spawn()
            try:
                self._wait_ready(patience)
                return self
            except ServerError:
                taken = "could not bind" in self.log_tail(10) or "in use" in self.log_tail(10)
                self._reap()
                if not taken or attempt == 2:
                    raise
            self.port = _free_port()
        raise AssertionError("unreachable")

    def restart(self, *, patience: float = PATIENCE) -> Self:
        """Stop (if running) and start the same data directory on the same port."""
        self.stop()
        self._spawn()
        self._wait_ready(patience)
        return self

    def restart_after_crash(self, patience: float = PATIENCE) -> Self:
        """``restart()`` after ``kill()``: the killed postmaster's backends exit once they
        notice; until then a new postmaster refuses the data directory ("pre-existing
        shared memory block"), so it is tried again until ``patience`` runs out."""
        deadline = time.monotonic() + patience
        while True:
            try:
                return self.restart()
            except ServerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        """Fast shutdown (SIGINT: clients are disconnected, a checkpoint is written)."""
        if self.alive:
            assert self.process is not None
            self.process.send_signal(signal.SIGINT)
        self._reap()

    def kill(self) -> None:
        """SIGKILL the postmaster, as a crash would (the next start recovers from WAL)."""
        if self.alive:
            assert self.process is not None
            self.process.kill()
        self._reap()

    def remove(self) -> None:
        """Delete the server's directory (stopped servers only)."""
        if not self.alive:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
        self.remove()

    # --- internals

    def _chown(self, path: Path) -> None:
        if self.account is not None:
            os.chown(path, self.account.pw_uid, self.account.pw_gid)

    def _initdb(self) -> None:
        self.sockets.mkdir(mode=0o700)
        for path in (self.directory, self.sockets):
            self._chown(path)
        self.log_file.touch()
        self._chown(self.log_file)
        result = subprocess.run(
            [
                *_as_account(self.account, guard=False),
                str(self.binaries / "initdb"),
                "-D",
                str(self.data),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            ],
            cwd=self.directory,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PATIENCE,
            check=False,
        )
        if result.returncode != 0:
            raise ServerError(
                f"initdb failed ({result.returncode}):\n{result.stdout}{result.stderr}"
            )
        self._initialised = True

    def _spawn(self) -> None:
        command = [
            *_as_account(
                self.account, guard=threading.current_thread() is threading.main_thread()
            ),
            str(self.binaries / "postgres"),
            "-D",
            str(self.data),
            "-k",
            str(self.sockets),
            "-h",
            HOST,
            "-p",
            str(self.port),
        ]
        for name, value in self.settings.items():
            command += ["-c", f"{name}={value}"]
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                command,
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        _running.add(self)

    def _wait_ready(self, patience: float) -> None:
        """Poll until a connection is accepted and answers (not 'starting up')."""
        import psycopg  # here: the module is importable without psycopg for skip checks

        deadline = time.monotonic() + patience
        while True:
            if not self.alive:
                raise ServerError(f"{self!r} exited\n{self.log_tail()}")
            try:
                with psycopg.connect(self.url, connect_timeout=2, autocommit=True) as conn:
                    conn.execute("SELECT 1")
                    return
            except psycopg.OperationalError:
                pass
            if time.monotonic() > deadline:
                raise ServerError(
                    f"{self!r} did not accept connections within {patience:.0f} s\n"
                    f"{self.log_tail()}"
                )
            time.sleep(_POLL)

    def _reap(self) -> None:
        process = self.process
        if process is not None:
            try:
                process.wait(_STOP_GRACE)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        _running.discard(self)


@contextlib.contextmanager
def running_server(*, settings: dict[str, str] | None = None) -> Iterator[PostgresServer]:
    """A started server, stopped and removed when the block ends (also on error)."""
    server = PostgresServer(settings=settings)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        server.remove()

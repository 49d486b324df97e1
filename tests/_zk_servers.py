"""Real ZooKeeper servers for tests and benchmarks: one standalone server, or an ensemble.

Every server is a real ``java … org.apache.zookeeper.server.quorum.QuorumPeerMain
zoo.cfg`` process (Debian's ``zookeeper`` package: jars under ``/usr/share/java``; an
upstream tarball works too, through ``$ZOOKEEPER_HOME``), listening on free ports of
127.0.0.1, with a directory of its own under the ``tmp_dir`` it is given: ``zoo.cfg``,
``data/`` (snapshots, transaction log, ``myid``) and ``zookeeper.log``. Nothing is
mocked.

Settings that matter to the tests: ``tickTime`` 200 ms (session timeouts from 0.4 s
to 60 s are granted: ``minSessionTimeout``/``maxSessionTimeout``), no admin server,
every four-letter command allowed (``srvr``, ``wchp``, ``cons`` are how tests look
inside), empty container nodes removed every second
(``znode.container.checkIntervalMs``), not every minute, and no fsync of the
transaction log (``forceSync=no``: a SIGKILLed server loses nothing, a power cut
would; ``settings=["forceSync=yes"]`` puts it back).

Startup never sleeps on a guess: it asks ``srvr`` every 20 ms until the server says it
serves (``Mode: standalone``, ``leader`` or ``follower``), and gives up after
``PATIENCE`` seconds with a ``ServerError`` carrying the log's tail. A JVM takes 1-3 s
to start here, so the fixtures start one server per test session.

No process outlives the tests: every server and ensemble is a context manager (SIGTERM,
SIGKILL after 5 s); what still runs at interpreter exit is killed by an ``atexit`` hook;
and a server started from the main thread gets SIGKILL as its parent-death signal
(``setpriv --pdeathsig``), so even a SIGKILLed pytest leaves no JVM behind.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self
from urllib.parse import quote

from _processes import Running
from _processes import free_port as _free_port
from _processes import parent_death_guard as _parent_death_guard
from _tls import TlsFiles

__all__ = [
    "PATIENCE",
    "Ensemble",
    "ServerError",
    "ZooKeeperServer",
    "classpath",
    "ensemble",
    "four_letter",
    "missing",
    "standalone",
]

HOST = "127.0.0.1"
PATIENCE = 60.0  # a JVM start on a small shared machine; a healthy one takes 1-3 s
TICK_MS = 200
_POLL = 0.02
_STOP_GRACE = 5.0
_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
_JVM_OPTIONS = (
    "-Xmx256m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",  # starts faster; the tests are not about server speed
    "-Dznode.container.checkIntervalMs=1000",
    "-Dzookeeper.jmx.log4j.disable=true",
    "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
    "-Dorg.slf4j.simpleLogger.showDateTime=true",
)


class ServerError(RuntimeError):
    """A server did not start, serve or stop as expected (its log attached)."""


def classpath() -> str | None:
    """The jars a server needs (with an slf4j binding for its log), or ``None``."""
    home = os.environ.get("ZOOKEEPER_HOME")
    if home:
        jars = sorted(glob.glob(f"{home}/lib/*.jar")) + sorted(glob.glob(f"{home}/*.jar"))
        return ":".join(jars) if jars else None
    # Debian: the jar's manifest names its dependencies under /usr/share/java.
    if Path("/usr/share/java/zookeeper.jar").exists():
        jars = ["/usr/share/java/zookeeper.jar"]
        # slf4j-simple: the server's log; netty-codec: TLS clients (the jar's manifest
        # names the rest of Netty but not this part, which NettyServerCnxnFactory needs).
        for extra in ("slf4j-simple.jar", "netty-codec.jar", "netty-resolver.jar"):
            if Path(f"/usr/share/java/{extra}").exists():
                jars.append(f"/usr/share/java/{extra}")
        return ":".join(jars)
    return None


def missing() -> str | None:
    """Why servers cannot be started here, or ``None`` when they can."""
    if shutil.which("java") is None:
        return "java is not on PATH"
    if classpath() is None:
        return "no ZooKeeper jars (apt install zookeeper, or set ZOOKEEPER_HOME)"
    return None


def four_letter(port: int, command: str, timeout: float = 2.0) -> str:
    """Send a four-letter command (``srvr``, ``wchp``, ``cons`` …); the reply as text."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(command.encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


_running = Running()  # killed at exit if still running


def _poll(
    condition: Callable[[], bool], what: str, patience: float, logs: Callable[[], str]
) -> None:
    deadline = time.monotonic() + patience
    while True:
        try:
            if condition():
                return
        except OSError:
            pass  # not listening yet, or going through an election
        if time.monotonic() > deadline:
            raise ServerError(f"timed out after {patience:.0f} s waiting until {what}\n{logs()}")
        time.sleep(_POLL)


class ZooKeeperServer:
    """One ZooKeeper server process: standalone, or member ``myid`` of an ensemble.

    ``kill()`` is SIGKILL (a crash), ``stop()`` a clean SIGTERM, ``pause()``/``resume()``
    SIGSTOP/SIGCONT (a frozen server: connections stay open, nothing is answered),
    ``start()`` (again) keeps the same ports and data directory.
    """

    def __init__(
        self,
        directory: Path,
        *,
        myid: int = 0,
        settings: Sequence[str] = (),
        tls: TlsFiles | None = None,
    ) -> None:
        self.directory = directory
        self.myid = myid
        self.settings = list(settings)
        self.tls = tls
        self.port = _free_port()
        self.secure_port = _free_port() if tls else None  # TLS clients (Netty), with ``tls``
        self.quorum_port = _free_port()
        self.election_port = _free_port()
        self.peers: Sequence[ZooKeeperServer] = ()
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"zookeeper://{self.address}"

    @property
    def secure_url(self) -> str:
        """``zookeepers://127.0.0.1:PORT?ca_file=…`` (a server started with ``tls``)."""
        assert self.tls is not None
        return f"zookeepers://{HOST}:{self.secure_port}?ca_file={quote(str(self.tls.ca))}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def log_file(self) -> Path:
        return self.directory / "zookeeper.log"

    def __repr__(self) -> str:
        state = "running" if self.alive else "down"
        return f"<ZooKeeperServer {self.myid} {self.address} {state}>"

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return f"--- {self!r}: no log"
        return f"--- last lines of {self.log_file}:\n" + "\n".join(text.splitlines()[-lines:])

    def mode(self) -> str | None:
        """``standalone``, ``leader`` or ``follower`` while serving; else ``None``."""
        try:
            reply = four_letter(self.port, "srvr", timeout=1.0)
        except OSError:
            return None
        for line in reply.splitlines():
            if line.startswith("Mode: "):
                return line.removeprefix("Mode: ").strip()
        return None

    def command(self, command: str) -> str:
        return four_letter(self.port, command)

    def _write_config(self) -> None:
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        lines = [
            f"tickTime={TICK_MS}",
            "initLimit=25",
            "syncLimit=10",
            f"dataDir={data}",
            f"clientPort={self.port}",
            f"clientPortAddress={HOST}",
            f"minSessionTimeout={2 * TICK_MS}",
            "maxSessionTimeout=60000",
            "admin.enableServer=false",
            "4lw.commands.whitelist=*",
            "maxClientCnxns=0",
            "autopurge.purgeInterval=0",
            # No fsync of the transaction log: a crash of the process (SIGKILL) loses
            # nothing the OS was given, only a power cut would. Tests and benchmarks
            # measure the protocol, not this machine's shared disk.
            "forceSync=no",
            *self.settings,
        ]
        if self.tls is not None:
            # TLS on a second port, through Netty (the plain port stays, for ``srvr``):
            # the server's key and certificate, and the CA, as PEM files.
            lines += [
                "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
                f"secureClientPort={self.secure_port}",
                f"secureClientPortAddress={HOST}",
                f"ssl.keyStore.location={self.tls.server_pem}",
                "ssl.keyStore.type=PEM",
                f"ssl.trustStore.location={self.tls.ca}",
                "ssl.trustStore.type=PEM",
                f"ssl.clientAuth={'need' if self.tls.client_cert_auth else 'none'}",
            ]
        if self.peers:
            (data / "myid").write_text(f"{self.myid}\n")
            lines += [
                f"server.{peer.myid}={HOST}:{peer.quorum_port}:{peer.election_port}"
                for peer in self.peers
            ]
        (self.directory / "zoo.cfg").write_text("\n".join(lines) + "\n")

    def spawn(self) -> Self:
        """Start the process without waiting (members of an ensemble start together)."""
        if self.alive:
            return self
        self._write_config()
        java = shutil.which("java")
        jars = classpath()
        if java is None or jars is None:
            raise ServerError(missing() or "cannot start ZooKeeper")
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                [
                    *_parent_death_guard(),
                    java,
                    *_JVM_OPTIONS,
                    "-cp",
                    jars,
                    _MAIN,
                    str(self.directory / "zoo.cfg"),
                ],
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.paused = False
        _running.add(self)
        return self

    def wait_serving(self, patience: float = PATIENCE) -> None:
        def serving() -> bool:
            if not self.alive:
                raise ServerError(f"{self!r} exited\n{self.log_tail()}")
            return self.mode() is not None

        _poll(serving, f"{self!r} serves clients", patience, self.log_tail)

    def start(self, patience: float = PATIENCE) -> Self:
        self.spawn()
        self.wait_serving(patience)
        return self

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown at all."""
        if self.alive:
            assert self.process is not None
            self.process.send_signal(signal.SIGKILL)
        self._reap()

    def stop(self) -> None:
        """A clean shutdown: SIGTERM, then SIGKILL if it is not gone within 5 s."""
        if self.alive:
            assert self.process is not None
            if self.paused:
                self.resume()
            self.process.terminate()
        self._reap()

    def pause(self) -> None:
        if self.alive:
            assert self.process is not None
            self.process.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.alive:
            assert self.process is not None
            self.process.send_signal(signal.SIGCONT)
        self.paused = False

    def _reap(self) -> None:
        process = self.process
        if process is not None:
            try:
                process.wait(_STOP_GRACE)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.paused = False
        _running.discard(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def standalone(
    tmp_dir: Path, *, settings: Sequence[str] = (), tls: TlsFiles | None = None
) -> ZooKeeperServer:
    """A started standalone server; ``settings`` are extra ``zoo.cfg`` lines; with ``tls``
    it also serves TLS clients on ``secure_port``."""
    server = ZooKeeperServer(Path(tmp_dir) / "zookeeper", settings=settings, tls=tls)
    try:
        return server.start()
    except BaseException:
        server.stop()
        raise


class Ensemble:
    """``size`` servers voting as one ensemble; ``url`` names them all."""

    def __init__(self, members: Sequence[ZooKeeperServer]) -> None:
        self.members = list(members)

    @property
    def url(self) -> str:
        return "zookeeper://" + ",".join(member.address for member in self.members)

    def leader(self) -> ZooKeeperServer | None:
        for member in self.members:
            if member.alive and member.mode() == "leader":
                return member
        return None

    def followers(self) -> list[ZooKeeperServer]:
        return [m for m in self.members if m.alive and m.mode() == "follower"]

    def logs(self) -> str:
        return "\n".join(member.log_tail(15) for member in self.members)

    def wait_quorum(self, patience: float = PATIENCE) -> ZooKeeperServer:
        """Wait until one live member leads and every other live member follows it."""

        def settled() -> bool:
            modes = [m.mode() for m in self.members if m.alive]
            return modes.count("leader") == 1 and all(
                mode in ("leader", "follower") for mode in modes
            )

        _poll(settled, "the ensemble has a leader and followers", patience, self.logs)
        leader = self.leader()
        assert leader is not None
        return leader

    def stop(self) -> None:
        for member in self.members:
            if member.alive and member.process is not None:
                if member.paused:
                    member.resume()
                member.process.terminate()
        for member in self.members:
            member._reap()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def ensemble(tmp_dir: Path, size: int = 3) -> Ensemble:
    """A started ensemble of ``size`` servers with a leader elected."""
    members = [ZooKeeperServer(Path(tmp_dir) / f"zk-{i}", myid=i) for i in range(1, size + 1)]
    for member in members:
        member.peers = members
    group = Ensemble(members)
    with contextlib.ExitStack() as on_failure:
        on_failure.callback(group.stop)
        for member in members:
            member.spawn()
        group.wait_quorum()
        on_failure.pop_all()
    return group

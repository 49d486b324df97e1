"""Real etcd for tests: one member, or a cluster of several, on loopback ports.

Every member is a real ``etcd`` process (Debian's ``etcd-server``) with a data
directory of its own under the ``tmp_dir`` it is given and its log in
``etcd.log`` there. Nothing is mocked.

Startup polls every 20 ms until every member answers ``/v3/maintenance/status`` and
agrees on a leader, and gives up after ``PATIENCE`` seconds with the logs' tails.

No process outlives the tests: members and clusters are context managers (the
fixtures use ``with``), leftovers are SIGKILLed by an ``atexit`` hook, and a member
started from the main thread gets SIGKILL as its parent-death signal (``setpriv``).
"""

from __future__ import annotations

import base64
import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from _processes import Running, free_port
from _processes import parent_death_guard as _parent_death_guard
from _tls import TlsFiles, make_tls

__all__ = [
    "PATIENCE",
    "EtcdCluster",
    "EtcdMember",
    "TlsFiles",
    "TopologyError",
    "cluster",
    "enable_auth",
    "make_tls",
    "single",
]

HOST = "127.0.0.1"
PATIENCE = 30.0
_POLL = 0.02
_STOP_GRACE = 5.0


class TopologyError(RuntimeError):
    """A member or cluster did not reach the state we waited for (logs attached)."""


def _poll(condition: Callable[[], bool], what: str, logs: Callable[[], str]) -> None:
    deadline = time.monotonic() + PATIENCE
    while True:
        try:
            if condition():
                return
        except (httpx.HTTPError, OSError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TopologyError(f"timed out after {PATIENCE:.0f} s waiting until {what}\n{logs()}")
        time.sleep(_POLL)


_running = Running()  # killed at exit if still running


class EtcdMember:
    """One ``etcd`` process: its client and peer ports and its data directory.

    ``kill()`` is SIGKILL (a crash), ``stop()`` SIGTERM (SIGKILL after 5 s),
    ``restart()`` starts it again with the same ports and data.
    """

    def __init__(
        self,
        directory: Path,
        name: str,
        *,
        heartbeat_ms: int,
        election_ms: int,
        tls: TlsFiles | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.directory = directory
        self.tls = tls
        self.extra_args = list(extra_args)
        self.name = name
        self.client_port = free_port()
        self.peer_port = free_port()
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.initial_cluster = f"{name}={self.peer_url}"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{HOST}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{HOST}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.client_port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def log_file(self) -> Path:
        return self.directory / "etcd.log"

    def __repr__(self) -> str:
        return f"<EtcdMember {self.name} {self.endpoint} {'up' if self.alive else 'down'}>"

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return f"--- {self!r}: no log"
        return f"--- last lines of {self.log_file}:\n" + "\n".join(text.splitlines()[-lines:])

    def status(self) -> dict[str, object]:
        """``/v3/maintenance/status`` of this member (its id, the leader's, raft term)."""
        reply = httpx.post(
            f"{self.client_url}/v3/maintenance/status",
            json={},
            timeout=2.0,
            verify=self.tls.context() if self.tls else True,
        )
        reply.raise_for_status()
        body = reply.json()
        assert isinstance(body, dict)
        return body

    def member_id(self) -> str:
        header = self.status()["header"]
        assert isinstance(header, dict)
        return str(header["member_id"])

    def spawn(self, *, new: bool) -> None:
        executable = shutil.which("etcd")
        if executable is None:
            raise TopologyError("etcd is not installed")
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [
            *_parent_death_guard(),
            executable,
            "--name",
            self.name,
            "--data-dir",
            str(self.directory / "data"),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            self.initial_cluster,
            "--initial-cluster-state",
            "new" if new else "existing",
            "--initial-cluster-token",
            f"keymutex-{self.directory.parent.name}",  # the same for every member
            "--heartbeat-interval",
            str(self.heartbeat_ms),
            "--election-timeout",
            str(self.election_ms),
            "--log-level",
            "warn",
            *self.extra_args,
        ]
        if self.tls is not None:
            command += ["--cert-file", str(self.tls.server_cert)]
            command += ["--key-file", str(self.tls.server_key)]
            if self.tls.client_cert_auth:
                command += ["--client-cert-auth", "--trusted-ca-file", str(self.tls.ca)]
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        _running.add(self)

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown at all."""
        if self.alive:
            assert self.process is not None
            self.process.send_signal(signal.SIGKILL)
        self._reap()

    def stop(self) -> None:
        if self.alive:
            assert self.process is not None
            self.process.terminate()
        self._reap()

    def restart(self) -> None:
        self.stop()
        self.spawn(new=False)

    def _reap(self) -> None:
        process = self.process
        if process is not None:
            try:
                process.wait(_STOP_GRACE)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        _running.discard(self)


class EtcdCluster:
    """Members started together; ``url`` is ``etcd://`` with every member's client port."""

    def __init__(self, members: Sequence[EtcdMember]) -> None:
        self.members = list(members)

    @property
    def url(self) -> str:
        scheme = "etcds" if self.members[0].tls else "etcd"
        return f"{scheme}://" + ",".join(member.endpoint for member in self.members)

    def logs(self) -> str:
        return "\n".join(member.log_tail() for member in self.members)

    def live(self) -> list[EtcdMember]:
        return [member for member in self.members if member.alive]

    def leader(self) -> EtcdMember:
        """The member every live member names as leader (waits until they agree)."""
        found: list[EtcdMember] = []

        def agreed() -> bool:
            leaders = {str(member.status()["leader"]) for member in self.live()}
            if len(leaders) != 1 or "0" in leaders:
                return False
            (leader_id,) = leaders
            found[:] = [m for m in self.live() if m.member_id() == leader_id]
            return bool(found)

        _poll(agreed, "the live members agree on a leader", self.logs)
        return found[0]

    def wait_ready(self) -> None:
        self.leader()

    def stop(self) -> None:
        for member in self.members:
            if member.alive and member.process is not None:
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


def cluster(
    tmp_dir: Path,
    *,
    members: int = 3,
    heartbeat_ms: int = 100,
    election_ms: int = 1000,
    tls: TlsFiles | None = None,
    extra_args: Sequence[str] = (),
) -> EtcdCluster:
    """A started cluster of ``members`` members with a leader elected."""
    nodes = [
        EtcdMember(
            Path(tmp_dir) / f"member-{index}",
            f"m{index}",
            heartbeat_ms=heartbeat_ms,
            election_ms=election_ms,
            tls=tls,
            extra_args=extra_args,
        )
        for index in range(members)
    ]
    initial = ",".join(f"{node.name}={node.peer_url}" for node in nodes)
    topology = EtcdCluster(nodes)
    with contextlib.ExitStack() as on_failure:
        on_failure.callback(topology.stop)
        for node in nodes:
            node.initial_cluster = initial
            node.spawn(new=True)
        topology.wait_ready()
        on_failure.pop_all()
    return topology


def single(
    tmp_dir: Path, *, tls: TlsFiles | None = None, extra_args: Sequence[str] = ()
) -> EtcdCluster:
    """One member. Short heartbeat and election timeout: etcd's minimum lease TTL is 1 s."""
    return cluster(
        tmp_dir, members=1, heartbeat_ms=50, election_ms=500, tls=tls, extra_args=extra_args
    )


def enable_auth(topology: EtcdCluster, users: dict[str, tuple[str, bytes]]) -> None:
    """Turn etcd's authentication on: ``root`` (password ``root``) and, for each
    ``name: (password, prefix)``, a user allowed to read and write keys under
    ``prefix`` only (a role of its own)."""

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    member = topology.members[0]
    verify = member.tls.context() if member.tls else True

    def call(path: str, body: dict[str, object]) -> None:
        reply = httpx.post(f"{member.client_url}/v3/auth/{path}", json=body, verify=verify)
        if reply.status_code != 200 or "error" in reply.json():
            raise TopologyError(f"etcd /v3/auth/{path} failed: {reply.text}")

    call("user/add", {"name": "root", "password": "root"})
    call("user/grant", {"user": "root", "role": "root"})
    for name, (password, prefix) in users.items():
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        call("role/add", {"name": name})
        call(
            "role/grant",
            {
                "name": name,
                "perm": {"permType": "READWRITE", "key": b64(prefix), "range_end": b64(end)},
            },
        )
        call("user/add", {"name": name, "password": password})
        call("user/grant", {"user": name, "role": name})
    call("enable", {})

"""Real Redis topologies for tests: a standalone server, a cluster, a sentinel group.

Every server is a real ``redis-server`` (or ``redis-sentinel``) process listening on a
free port of 127.0.0.1, with a directory of its own under the ``tmp_dir`` it is given:
``redis.conf`` (what it runs with) and ``redis.log`` (its stdout and stderr). Nothing is
mocked.

Startup never sleeps on a guess: it polls every 10 ms until the server answers (and,
for topologies, until the replicas are in sync and every node agrees), and gives up
after ``PATIENCE`` seconds with a ``TopologyError`` that carries the tail of the logs.

No process outlives the tests:

- every server and topology is a context manager, and the pytest fixtures use ``with``,
  so a failing test still stops what it started (SIGTERM, then SIGKILL after 5 s);
- what is still running when the interpreter exits is killed by an ``atexit`` hook;
- on Linux a server started from the main thread also gets SIGKILL as its parent-death
  signal (``setpriv --pdeathsig``), so even a SIGKILLed pytest leaves nothing behind.

Ports are picked by binding port 0, so two pickers can race for one; a server that fails
with "Address already in use" on its first start is retried on another port.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from _processes import Running
from _processes import free_port as _free_port
from _processes import parent_death_guard as _parent_death_guard

__all__ = [
    "PATIENCE",
    "RedisCluster",
    "RedisSentinel",
    "RedisServer",
    "TopologyError",
    "caught_up",
    "cluster",
    "missing_executables",
    "sentinel",
    "standalone",
    "wait_caught_up",
]

HOST = "127.0.0.1"

# How long a server, a cluster or a failover may take before we call it broken: generous,
# because the test machine is small and shared; a healthy start takes well under 3 s.
PATIENCE = 30.0

_POLL = 0.01
_STOP_GRACE = 5.0
_SLOTS = 16384


class TopologyError(RuntimeError):
    """A server or topology did not reach the state we waited for (logs attached)."""


def missing_executables() -> list[str]:
    """The Redis programs these helpers need that are not on ``PATH`` (empty: all there)."""
    return [
        name for name in ("redis-server", "redis-sentinel", "redis-cli") if not shutil.which(name)
    ]


# ---------------------------------------------------------------------------------------
# Ports, polling, process hygiene


def _poll(
    condition: Callable[[], bool],
    what: str,
    *,
    patience: float = PATIENCE,
    logs: Callable[[], str] = lambda: "",
) -> None:
    """Call ``condition`` every 10 ms until it holds; ``TopologyError`` after ``patience``."""
    deadline = time.monotonic() + patience
    while True:
        try:
            if condition():
                return
        except (redis.RedisError, OSError, KeyError):
            pass  # not up yet, or in the middle of a change: ask again
        if time.monotonic() > deadline:
            raise TopologyError(f"timed out after {patience:.0f} s waiting until {what}\n{logs()}")
        time.sleep(_POLL)


def _answers_ping(port: int) -> bool:
    """The server on ``port`` answers PING (not ``-LOADING``, not refused)."""
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _parse_info(text: str) -> dict[str, str]:
    fields = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and not line.startswith("#"):
            fields[name] = value.strip()
    return fields


_running = Running()  # killed at exit if still running


# ---------------------------------------------------------------------------------------
# One server


class RedisServer:
    """One ``redis-server`` (or ``redis-sentinel``) process, its port and its directory.

    ``pause()``/``resume()`` freeze and thaw it (SIGSTOP/SIGCONT: connections stay open,
    nothing is answered), ``kill()`` is SIGKILL (no shutdown, no final fsync),
    ``stop()`` is a clean SIGTERM, ``restart()`` starts it again on the same port with
    the same directory (so the same AOF, ``nodes.conf`` or rewritten sentinel config).
    """

    def __init__(
        self,
        directory: Path,
        config: Sequence[str],
        *,
        program: str = "redis-server",
        extra_ports: int = 0,
    ) -> None:
        self.directory = directory
        self.program = program
        self.port = _free_port()
        # Cluster nodes need a second port for the cluster bus ("cluster-port").
        self.extra_ports = [_free_port() for _ in range(extra_ports)]
        self._config = list(config)
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False

    # --- what others connect to

    @property
    def address(self) -> tuple[str, int]:
        return (HOST, self.port)

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def __repr__(self) -> str:
        state = "running" if self.alive else "down"
        return f"<{type(self).__name__} {self.program} {HOST}:{self.port} {state}>"

    def client(self) -> redis.Redis:
        """A redis-py client of this server alone, without retries (close it after use)."""
        return redis.Redis(
            host=HOST,
            port=self.port,
            decode_responses=True,
            socket_timeout=5.0,
            socket_connect_timeout=2.0,
            retry=Retry(NoBackoff(), 0),
        )

    def command(self, *args: str | int) -> object:
        """One command on a fresh connection, no retries; the reply as sent (RESP2, str).

        Raw on purpose: redis-py's reply callbacks reshape INFO, SENTINEL and CLUSTER
        replies, and we parse what ``redis-cli`` would show.
        """
        conn = redis.Connection(
            host=HOST,
            port=self.port,
            decode_responses=True,
            socket_timeout=5.0,
            socket_connect_timeout=2.0,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            conn.send_command(*args)
            return conn.read_response()
        finally:
            conn.disconnect()

    def info(self, section: str = "default") -> dict[str, str]:
        """``INFO section`` as ``name -> value`` strings."""
        return _parse_info(str(self.command("INFO", section)))

    # --- life cycle

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def config_file(self) -> Path:
        return self.directory / ("sentinel.conf" if "sentinel" in self.program else "redis.conf")

    @property
    def log_file(self) -> Path:
        return self.directory / "redis.log"

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return f"--- {self!r}: no log"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- last lines of {self.log_file}:\n{tail}"

    def start(self, *, patience: float = PATIENCE) -> Self:
        """Start the process and wait until it answers PING (a fresh port if ours was taken)."""
        for attempt in range(3):
            self._write_config()
            self._spawn()
            try:
                self.wait_ready(patience=patience)
                return self
            except TopologyError:
                taken = "Address already in use" in self.log_tail(5)
                self._reap()
                if not taken or attempt == 2:
                    raise
            self.port = _free_port()
            self.extra_ports = [_free_port() for _ in self.extra_ports]
        raise AssertionError("unreachable")

    def wait_ready(self, *, patience: float = PATIENCE) -> None:
        def ready() -> bool:
            if not self.alive:
                raise TopologyError(f"{self!r} exited\n{self.log_tail()}")
            return _answers_ping(self.port)

        _poll(ready, f"{self!r} answers PING", patience=patience, logs=self.log_tail)

    def restart(self, *, patience: float = PATIENCE) -> Self:
        """Start again on the same port and directory (stopping it first if it runs)."""
        if self.alive:
            self.stop()
        self._spawn()
        self.wait_ready(patience=patience)
        return self

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but answers nothing until ``resume()``."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        """SIGKILL, as a crash or a power cut of the process would: no shutdown at all."""
        self._signal(signal.SIGKILL)
        self._reap()

    def stop(self) -> None:
        """A clean shutdown: SIGTERM, then SIGKILL if it is not gone within 5 s."""
        if self.alive:
            assert self.process is not None
            if self.paused:
                self.resume()  # a stopped process would not act on SIGTERM
            self.process.terminate()
        self._reap()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # --- internals

    def _write_config(self) -> None:
        # Written once per start(); restart() reuses it, as rewritten by the server
        # (a sentinel records there what it learnt, a cluster node keeps nodes.conf).
        self.directory.mkdir(parents=True, exist_ok=True)
        lines = [
            f"port {self.port}",
            f"bind {HOST}",
            f"dir {self.directory}",
            'logfile ""',
            "daemonize no",
            *self._config,
        ]
        if self.extra_ports:
            lines.append(f"cluster-port {self.extra_ports[0]}")
        self.config_file.write_text("\n".join(lines) + "\n")

    def _spawn(self) -> None:
        executable = shutil.which(self.program)
        if executable is None:
            raise TopologyError(f"{self.program} is not installed")
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                [*_parent_death_guard(), executable, str(self.config_file)],
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.paused = False
        _running.add(self)

    def _signal(self, signum: signal.Signals) -> None:
        if self.alive:
            assert self.process is not None
            self.process.send_signal(signum)

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


def caught_up(master: RedisServer, replicas: Sequence[RedisServer]) -> bool:
    """Each of ``replicas`` has processed every write ``master`` has replicated so far.

    Replication is asynchronous: a reply to a client does not mean a replica has the
    write. Wait on this (``wait_caught_up``) to fail over with nothing in flight.
    """
    offset = master.info("replication")["master_repl_offset"]
    return all(
        replica.info("replication").get("slave_repl_offset") == offset for replica in replicas
    )


def wait_caught_up(
    master: RedisServer, replicas: Sequence[RedisServer], *, patience: float = PATIENCE
) -> None:
    _poll(
        lambda: caught_up(master, replicas),
        f"the replicas of {master!r} have all it sent",
        patience=patience,
        logs=master.log_tail,
    )


def _stop_all(servers: Sequence[RedisServer]) -> None:
    """Stop servers in parallel: SIGTERM to all, then reap each (SIGKILL if stuck)."""
    for server in servers:
        if server.alive and server.process is not None:
            if server.paused:
                server.resume()
            server.process.terminate()
    for server in servers:
        server._reap()


def _data_config(*, appendonly: bool, appendfsync: str) -> list[str]:
    return [
        'save ""',
        f"appendonly {'yes' if appendonly else 'no'}",
        f"appendfsync {appendfsync}",
        # Redis 7 waits up to 10 s on SIGTERM for lagging replicas; tests stop faster.
        "shutdown-timeout 1",
        # A replica's first sync would otherwise wait 5 s for more replicas to share it.
        "repl-diskless-sync-delay 0",
    ]


def standalone(
    tmp_dir: Path,
    *,
    appendonly: bool = False,
    appendfsync: Literal["always", "everysec", "no"] = "always",
) -> RedisServer:
    """A started standalone server; persistence only with ``appendonly`` (no RDB saves).

    ``appendfsync`` matters only with ``appendonly``: ``always`` fsyncs every write
    before the reply, so whatever a client was told survives ``kill()``.
    """
    server = RedisServer(
        Path(tmp_dir) / "standalone",
        _data_config(appendonly=appendonly, appendfsync=appendfsync),
    )
    return server.start()


# ---------------------------------------------------------------------------------------
# Cluster


class RedisCluster:
    """A Redis Cluster of ``masters`` masters, each with ``replicas_per_master`` replicas.

    ``url`` lists every node (``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,…``). Roles
    change on failover, so ``masters()``/``replicas_of()`` ask the cluster each time.
    """

    def __init__(self, nodes: list[RedisServer]) -> None:
        self.nodes = nodes

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{HOST}:{node.port}" for node in self.nodes)

    def __repr__(self) -> str:
        return f"<RedisCluster {self.url}>"

    def client(self, **options: object) -> redis.RedisCluster:
        """A redis-py RedisCluster client on every node (close it after use)."""
        startup = [redis.cluster.ClusterNode(HOST, node.port) for node in self.nodes]
        return redis.RedisCluster(startup_nodes=startup, decode_responses=True, **options)  # type: ignore[arg-type]

    def live_nodes(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.alive and not node.paused]

    def _by_port(self, port: int) -> RedisServer:
        for node in self.nodes:
            if node.port == port:
                return node
        raise TopologyError(f"port {port} is not a node of {self!r}")

    def topology(
        self, node: RedisServer | None = None
    ) -> dict[int, tuple[str, int | None, list[tuple[int, int]]]]:
        """What ``node`` (or a live node) says: port -> (flags, master's port, slot ranges).

        Flags as in ``CLUSTER NODES`` ("myself,master", "slave", "master,fail", …);
        the master's port is None for a master.
        """
        asked = node or self.live_nodes()[0]
        ids: dict[str, int] = {}
        rows: list[tuple[int, str, str, list[tuple[int, int]]]] = []
        for line in str(asked.command("CLUSTER", "NODES")).splitlines():
            fields = line.split()
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            ids[fields[0]] = port
            ranges = []
            for item in fields[8:]:
                if item.startswith("["):
                    continue  # a slot being migrated
                first, _, last = item.partition("-")
                ranges.append((int(first), int(last or first)))
            rows.append((port, fields[2], fields[3], ranges))
        return {
            port: (flags, ids.get(master) if master != "-" else None, ranges)
            for port, flags, master, ranges in rows
        }

    def masters(self) -> list[RedisServer]:
        """The nodes that serve slots now (failed ones excluded)."""
        return [
            self._by_port(port)
            for port, (flags, _master, ranges) in self.topology().items()
            if "master" in flags.split(",") and "fail" not in flags.split(",") and ranges
        ]

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        return [
            self._by_port(port)
            for port, (flags, of, _ranges) in self.topology().items()
            if of == master.port and "fail" not in flags.split(",")
        ]

    def owner_of(self, key: str) -> RedisServer:
        """The master that serves ``key``'s slot now."""
        slot = int(self.live_nodes()[0].command("CLUSTER", "KEYSLOT", key))  # type: ignore[call-overload]
        for port, (_flags, _master, ranges) in self.topology().items():
            if any(first <= slot <= last for first, last in ranges):
                return self._by_port(port)
        raise TopologyError(f"no node serves slot {slot}")

    def logs(self) -> str:
        return "\n".join(node.log_tail(8) for node in self.nodes)

    def is_healthy(self) -> bool:
        """Every live node: state ok, all slots served, the same slot map; replicas synced."""
        views = set()
        for node in self.live_nodes():
            info = _parse_info(str(node.command("CLUSTER", "INFO")))
            if info.get("cluster_state") != "ok":
                return False
            if info.get("cluster_slots_ok") != str(_SLOTS):
                return False
            if info.get("cluster_known_nodes") != str(len(self.nodes)):
                return False
            slots = node.command("CLUSTER", "SHARDS")
            views.add(repr(_slot_map(slots)))
            replication = node.info("replication")
            if replication.get("role") == "slave":
                master_port = int(replication["master_port"])
                if self._by_port(master_port).alive and (
                    replication.get("master_link_status") != "up"
                    or replication.get("master_sync_in_progress") != "0"
                ):
                    return False
        return len(views) == 1

    def wait_healthy(self, *, patience: float = PATIENCE) -> None:
        _poll(self.is_healthy, f"{self!r} is healthy", patience=patience, logs=self.logs)

    def kill_master_with_replica(self) -> RedisServer:
        """SIGKILL a master that has a replica (in sync); returns the killed node."""
        for master in self.masters():
            if self.replicas_of(master):
                master.kill()
                return master
        raise TopologyError(f"no master of {self!r} has a replica")

    def wait_for_promotion(
        self, failed: RedisServer, *, patience: float = PATIENCE
    ) -> RedisServer:
        """Wait until a replica of ``failed`` serves its slots and the cluster is ok again."""
        replicas = [
            self._by_port(port)
            for port, (_flags, of, _ranges) in self.topology().items()
            if of == failed.port
        ]
        promoted: list[RedisServer] = []

        def done() -> bool:
            for replica in replicas:
                if replica.alive and replica.info("replication").get("role") == "master":
                    promoted[:] = [replica]
                    return self.is_healthy()
            return False

        _poll(done, f"a replica of {failed!r} took over", patience=patience, logs=self.logs)
        return promoted[0]

    def stop(self) -> None:
        _stop_all(self.nodes)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _slot_map(shards: object) -> list[tuple[int, ...]]:
    """From ``CLUSTER SHARDS``: sorted (first slot, last slot, master port) of each range."""
    result = []
    assert isinstance(shards, list)
    for shard in shards:
        shard = _as_dict(shard)
        master = next(
            (
                _as_dict(node)
                for node in shard["nodes"]
                if _as_dict(node)["role"] == "master" and _as_dict(node)["health"] == "online"
            ),
            None,
        )
        if master is None:
            continue
        slots = shard["slots"]
        for index in range(0, len(slots), 2):
            result.append((int(slots[index]), int(slots[index + 1]), int(master["port"])))
    return sorted(result)


def _as_dict(value: object) -> dict[str, object] | dict[str, list[object]]:
    if isinstance(value, dict):
        return value
    assert isinstance(value, list)
    return dict(zip(value[::2], value[1::2], strict=True))


def cluster(
    tmp_dir: Path,
    masters: int = 3,
    replicas_per_master: int = 0,
    *,
    appendonly: bool = False,
    appendfsync: Literal["always", "everysec", "no"] = "always",
    extra_config: Sequence[str] = (),
) -> RedisCluster:
    """A started cluster, created by ``redis-cli --cluster create``, healthy and in sync.

    ``extra_config``: more lines for every node's configuration file."""
    if masters < 3:
        raise ValueError(f"masters must be at least 3 (redis-cli's minimum), not {masters}")
    config = [
        *_data_config(appendonly=appendonly, appendfsync=appendfsync),
        "cluster-enabled yes",
        "cluster-config-file nodes.conf",
        "cluster-node-timeout 2000",
        *extra_config,
    ]
    count = masters * (1 + replicas_per_master)
    nodes = [
        RedisServer(Path(tmp_dir) / f"cluster-{index}", config, extra_ports=1)
        for index in range(count)
    ]
    topology = RedisCluster(nodes)
    with contextlib.ExitStack() as on_failure:
        on_failure.callback(topology.stop)
        for node in nodes:
            node.start()
        create = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"{HOST}:{node.port}" for node in nodes),
                "--cluster-replicas",
                str(replicas_per_master),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=PATIENCE,
            check=False,
        )
        if create.returncode != 0:
            raise TopologyError(
                f"redis-cli --cluster create failed ({create.returncode}):\n"
                f"{create.stdout}\n{create.stderr}\n{topology.logs()}"
            )

        def complete() -> bool:
            # Every node sees every replica attached to its master, and the cluster is ok.
            for node in nodes:
                roles = topology.topology(node).values()
                if sum(1 for _flags, of, _ranges in roles if of is not None) != (
                    masters * replicas_per_master
                ):
                    return False
            return topology.is_healthy()

        _poll(complete, f"{topology!r} is complete", logs=topology.logs)
        on_failure.pop_all()
    return topology


# ---------------------------------------------------------------------------------------
# Sentinel


class RedisSentinel:
    """A master, its replicas, and the sentinels that watch them as ``service``.

    ``url`` is ``redis+sentinel://127.0.0.1:s1,…/SERVICE``. The sentinels use quorum 2,
    ``down-after-milliseconds 1000``, ``failover-timeout 5000``, ``parallel-syncs 1``.
    """

    def __init__(
        self,
        data_nodes: list[RedisServer],
        sentinels: list[RedisServer],
        service: str,
    ) -> None:
        self.data_nodes = data_nodes
        self.sentinels = sentinels
        self.service = service

    @property
    def url(self) -> str:
        addresses = ",".join(f"{HOST}:{node.port}" for node in self.sentinels)
        return f"redis+sentinel://{addresses}/{self.service}"

    def __repr__(self) -> str:
        return f"<RedisSentinel {self.url}>"

    def client(self) -> redis.Sentinel:
        """A redis-py Sentinel on every sentinel (``.master_for(service)``)."""
        return redis.Sentinel(
            [node.address for node in self.sentinels],
            socket_timeout=2.0,
            decode_responses=True,
        )

    def _by_port(self, port: int) -> RedisServer:
        for node in self.data_nodes:
            if node.port == port:
                return node
        raise TopologyError(f"port {port} is not a data node of {self!r}")

    def reported_masters(self) -> set[int]:
        """The master port each live sentinel reports (a set: one element when they agree)."""
        ports = set()
        for node in self.sentinels:
            if node.alive and not node.paused:
                address = node.command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                assert isinstance(address, list | tuple), address
                ports.add(int(address[1]))
        return ports

    @property
    def master(self) -> RedisServer:
        """The master the sentinels agree on now."""
        reported = self.reported_masters()
        if len(reported) != 1:
            raise TopologyError(f"sentinels disagree on the master: ports {sorted(reported)}")
        return self._by_port(reported.pop())

    @property
    def replicas(self) -> list[RedisServer]:
        master = self.master
        return [node for node in self.data_nodes if node is not master]

    def logs(self) -> str:
        return "\n".join(node.log_tail(8) for node in [*self.data_nodes, *self.sentinels])

    def replicas_synced(self) -> bool:
        """Every live replica of the current master has its link up and no sync running."""
        master = self.master
        if master.info("replication").get("role") != "master":
            return False
        for node in self.data_nodes:
            if node is master or not node.alive:
                continue
            replication = node.info("replication")
            if (
                replication.get("role") != "slave"
                or int(replication.get("master_port", 0)) != master.port
                or replication.get("master_link_status") != "up"
                or replication.get("master_sync_in_progress") != "0"
            ):
                return False
        return True

    def sentinels_ready(self) -> bool:
        """Each sentinel sees the master up, every live replica, and every other sentinel."""
        live_replicas = sum(1 for node in self.replicas if node.alive)
        for node in self.sentinels:
            state = _as_dict(node.command("SENTINEL", "MASTER", self.service))
            if state["flags"] != "master":
                return False
            if int(state["num-other-sentinels"]) != len(self.sentinels) - 1:  # type: ignore[call-overload]
                return False
            known = node.command("SENTINEL", "REPLICAS", self.service)
            assert isinstance(known, list)
            up = [r for r in map(_as_dict, known) if r["flags"] == "slave"]
            if len(up) < live_replicas:
                return False
        return True

    def wait_ready(self, *, patience: float = PATIENCE) -> None:
        """Wait until replicas are in sync and every sentinel can take part in a failover."""
        _poll(self.replicas_synced, "the replicas are in sync", patience=patience, logs=self.logs)
        _poll(
            self.sentinels_ready, "the sentinels know everyone", patience=patience, logs=self.logs
        )

    def kill_master(self) -> RedisServer:
        """SIGKILL the current master (no shutdown, no last fsync); returns it."""
        master = self.master
        master.kill()
        return master

    def wait_for_new_master(self, old: RedisServer, *, patience: float = PATIENCE) -> RedisServer:
        """Wait until every live sentinel reports a master other than ``old`` that says so."""

        def switched() -> bool:
            reported = self.reported_masters()
            if len(reported) != 1 or old.port in reported:
                return False
            new = self._by_port(next(iter(reported)))
            return new.alive and new.info("replication").get("role") == "master"

        _poll(
            switched,
            f"the sentinels promote a master other than {old!r}",
            patience=patience,
            logs=self.logs,
        )
        return self.master

    def failover(
        self, how: Literal["kill", "command"] = "kill", *, patience: float = PATIENCE
    ) -> RedisServer:
        """Fail the master over and wait until the sentinels report the new one; returns it.

        ``"kill"``: SIGKILL the master (the sentinels notice after about 1 s, vote,
        promote). ``"command"``: ``SENTINEL FAILOVER`` (no vote; the old master stays up
        and becomes a replica of the new one).
        """
        if how == "kill":
            old = self.kill_master()
        else:
            old = self.master
            self.sentinels[0].command("SENTINEL", "FAILOVER", self.service)
        return self.wait_for_new_master(old, patience=patience)

    def stop(self) -> None:
        _stop_all(self.sentinels)  # first, so that they start no failover while we stop
        _stop_all(self.data_nodes)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def sentinel(
    tmp_dir: Path,
    *,
    replicas: int = 1,
    sentinels: int = 3,
    appendonly: bool = True,
    appendfsync: Literal["always", "everysec", "no"] = "always",
    service: str = "mymaster",
) -> RedisSentinel:
    """A started master with ``replicas`` synced replicas, watched by ``sentinels``."""
    config = _data_config(appendonly=appendonly, appendfsync=appendfsync)
    master = RedisServer(Path(tmp_dir) / "master", config)
    replica_nodes = [
        RedisServer(Path(tmp_dir) / f"replica-{index}", config) for index in range(replicas)
    ]
    sentinel_nodes: list[RedisServer] = []
    topology = RedisSentinel([master, *replica_nodes], sentinel_nodes, service)
    with contextlib.ExitStack() as on_failure:
        on_failure.callback(topology.stop)
        master.start()
        for node in replica_nodes:
            node._config.append(f"replicaof {HOST} {master.port}")
            node.start()
        # Replicas first: a sentinel learns them from the master's INFO when it connects,
        # and would otherwise only ask again 10 s later.
        _poll(_replicas_attached(master, replicas), "the replicas attach", logs=topology.logs)
        for index in range(sentinels):
            node = RedisServer(
                Path(tmp_dir) / f"sentinel-{index}",
                [
                    f"sentinel monitor {service} {HOST} {master.port} 2",
                    f"sentinel down-after-milliseconds {service} 1000",
                    f"sentinel failover-timeout {service} 5000",
                    f"sentinel parallel-syncs {service} 1",
                ],
                program="redis-sentinel",
            )
            sentinel_nodes.append(node)
            node.start()
        topology.wait_ready()
        on_failure.pop_all()
    return topology


def _replicas_attached(master: RedisServer, count: int) -> Callable[[], bool]:
    def attached() -> bool:
        info = master.info("replication")
        online = [
            value
            for name, value in info.items()
            if name.startswith("slave") and name[5:].isdigit() and "state=online" in value
        ]
        return len(online) >= count

    return attached

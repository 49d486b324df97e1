"""A throw-away redis-server for the Redis benchmarks, and the counters they read.

Server side: ``INFO commandstats`` (every command the server ran, including the ones a
Lua script ran) and ``total_reads_processed`` (socket reads: one per round trip, a few
per large pipeline). Client side: ``ClientTraffic`` counts what redis-py sends (commands
and socket sends, i.e. round trips) by wrapping redis-py's packer and connection, so the
commands a script runs inside Redis are not counted there.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class RedisServer:
    """``redis-server`` on a free loopback port, without persistence; stopped on exit."""

    def __init__(self, executable: str = "redis-server") -> None:
        found = shutil.which(executable)
        if found is None:
            raise SystemExit(f"{executable} not found (apt-get install redis-server)")
        self.executable = found
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="keymutex-redis-bench-")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)

    def __enter__(self) -> RedisServer:
        log = Path(self._dir.name, "redis.log")
        self._process = subprocess.Popen(
            [
                self.executable,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", self._dir.name,
                "--logfile", str(log),
            ],
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return self
            except redis.ConnectionError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"redis-server did not start: {log.read_text()}") from None
                time.sleep(0.05)

    def __exit__(self, *exc_info: object) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._dir.cleanup()

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def version(self) -> str:
        return str(self.client().info("server")["redis_version"])


@dataclass
class ServerCounters:
    """Server-side counters at one moment."""

    commands: dict[str, int]
    reads: int

    @classmethod
    def read(cls, client: redis.Redis) -> ServerCounters:
        stats = client.info("commandstats")
        commands = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
        return cls(commands, int(client.info("stats")["total_reads_processed"]))

    def since(self, before: ServerCounters) -> ServerCounters:
        """What happened between ``before`` and ``self``, less the bookkeeping of this module."""
        commands = {
            name: calls - before.commands.get(name, 0)
            for name, calls in self.commands.items()
            if name not in ("info", "config|resetstat", "dbsize")
        }
        # The INFO that read ``self`` ran and read once more than the one that read ``before``.
        return ServerCounters(
            {k: v for k, v in commands.items() if v}, self.reads - before.reads - 2
        )

    @property
    def total(self) -> int:
        return sum(self.commands.values())


@dataclass
class ClientTraffic:
    """Commands and round trips redis-py sent from this process (sync and asyncio)."""

    commands: int = 0
    round_trips: int = 0
    by_name: Counter[str] = field(default_factory=Counter)  # commands, by command name
    send_times: list[float] | None = None  # monotonic time of each send, when recording
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self, *, record_times: bool = False) -> None:
        with self._lock:
            self.commands = 0
            self.round_trips = 0
            self.by_name = Counter()
            self.send_times = [] if record_times else None

    def _command(self, packer: object, name: object = "?", *args: object) -> None:
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        with self._lock:
            self.commands += 1
            self.by_name[str(name).lower()] += 1

    def _send(self, *args: object) -> None:
        with self._lock:
            self.round_trips += 1
            if self.send_times is not None:
                self.send_times.append(time.monotonic())


_TRAFFIC: ClientTraffic | None = None


def count_client_traffic() -> ClientTraffic:
    """Wrap redis-py (once per process) so that every command and socket send is counted.

    A command is one call of the RESP packer; a round trip is one ``send_packed_command``
    (a pipeline is one). Connection handshakes (HELLO, CLIENT SETINFO) count too.
    """
    global _TRAFFIC
    if _TRAFFIC is not None:
        return _TRAFFIC
    import redis.asyncio.connection as async_connection
    import redis.connection as sync_connection

    traffic = _TRAFFIC = ClientTraffic()

    def counting(method: Callable[..., Any], hook: Callable[..., None]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            hook(*args)
            return method(*args, **kwargs)

        return wrapper

    packers = [
        getattr(sync_connection, name)
        for name in ("PythonRespSerializer", "HiredisRespSerializer")
        if hasattr(sync_connection, name)
    ]
    for packer in packers:
        packer.pack = counting(packer.pack, traffic._command)
    sync_base = sync_connection.AbstractConnection
    sync_base.send_packed_command = counting(sync_base.send_packed_command, traffic._send)  # type: ignore[method-assign]
    async_base = async_connection.AbstractConnection
    async_base.pack_command = counting(async_base.pack_command, traffic._command)  # type: ignore[method-assign]
    async_base.send_packed_command = counting(async_base.send_packed_command, traffic._send)  # type: ignore[method-assign]
    # keymutex's async store writes a command to the socket itself when nothing is
    # buffered (keymutex.stores.redis._send), past send_packed_command: count that
    # send too (found by review: its row showed 0.01 round trips per acquire). Its
    # other path goes through send_packed_command, counted above.
    import keymutex.stores.redis as keymutex_redis

    direct = keymutex_redis._send

    async def counted_send(conn: Any, args: tuple[Any, ...]) -> None:
        if getattr(conn, "_writer", None) is not None and not conn.health_check_interval:
            traffic._send(conn)
        await direct(conn, args)

    keymutex_redis._send = counted_send
    return traffic

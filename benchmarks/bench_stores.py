"""Every store side by side: an uncontended acquire+release, and a handoff between processes.

Run: .venv/bin/python benchmarks/bench_stores.py [--seconds 0.5] [--rounds 5]
     [--handoffs 100] [--hold-ms 10] [STORE ...]

One run, one workload, every store that can run here (``STORE ...`` picks some: memory,
sqlite, redis, redis-aof, redis-cluster, redis-sentinel, postgresql, memcached, etcd,
zookeeper, http). Each server is started the way the tests start it, by the tests' own
helpers (tests/_redis_servers.py, _pg_server.py, _etcd_servers.py, _zk_servers.py,
_memcached_fixtures.py; the lock server as benchmarks/bench_server.py starts it), one
store at a time, and stopped before the next. A store whose server cannot start is
reported as not run, with the reason. MongoDB cannot be installed here: not measured.

1. Uncontended: one ``keymutex.Locks(url)``, ``acquire(key, timeout=0)`` then
   ``release()``, interleaved pair by pair with the store's floor: one trivial round
   trip of its own client (Redis PING, PostgreSQL ``SELECT 1``, memcached ``version``,
   an etcd range read on the JSON gateway through httpx, ZooKeeper ``exists``, SQLite an
   empty ``BEGIN IMMEDIATE`` + ``COMMIT``, the lock server a GET that answers 404).
   Rounds last ``--seconds`` each; figures are medians of the per-round medians (p90:
   of the per-round p90s), and × floor the median of the per-round ratios.
2. Handoff: 2 processes (2 threads for ``memory://``, which is one process's table),
   each with its own ``Locks``, take turns on one key. The waiter says it is about to
   call ``acquire(key)``; the holder then holds ``--hold-ms`` more (time for the
   waiter's refused try and its registration), notes the time and releases. Handoff:
   from just before that ``release()`` to the waiter's ``acquire`` returning, on the
   host's boot-time clock (shared by its processes). The first 5 handoffs of each store
   are warm-up and not counted. On a store that polls, the figure depends on the hold:
   the waiter's backoff has grown while it waited.

Results go to benchmarks/results/stores.md (and stdout). The header names the commit of
the keymutex imported; to measure a commit while src/ has uncommitted changes, run with
``PYTHONPATH=<a clean clone>/src`` (the header then says "from <clone>").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import multiprocessing as mp
import os
import platform
import queue
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import keymutex

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import cpu_model as _cpu
from _common import host_clock as _clock
from _common import percentile as _percentile
from _common import revision as _revision
from bench_server import LockServer  # how the lock server benchmark starts `keymutex serve`

import _etcd_servers  # the tests' server helpers
import _memcached_fixtures
import _pg_server
import _redis_servers
import _zk_servers

RESULTS = Path(__file__).parent / "results"
COMMAND = ".venv/bin/python benchmarks/bench_stores.py"
WARM_UP_PAIRS = 30
MAX_PAIRS = 3000  # per case and round: enough for a stable median on the fast stores
WARM_UP_HANDOFFS = 5
KEY = "bench:key"


# -- the stores ---------------------------------------------------------------------------


@dataclass
class Target:
    """A running store: its URL, its server's version, and how to time its floor."""

    url: str
    version: str
    floor: Callable[[], tuple[Callable[[], None], Callable[[], None]]] | None  # (call, close)


@dataclass(frozen=True)
class Store:
    name: str
    round_trips: str  # acquire + release, from the store module's docstring
    floor: str  # what the floor is
    start: Callable[[Path], contextlib.AbstractContextManager[Target]]
    threads: bool = False  # handoff between threads of one process (memory://)


def _command_output(*command: str) -> str:
    try:
        out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "?"
    return (out.stdout or out.stderr).strip().splitlines()[0]


@contextlib.contextmanager
def _memory(directory: Path) -> Iterator[Target]:
    yield Target(f"memory://bench-{uuid.uuid4().hex[:8]}", "in-process", None)


@contextlib.contextmanager
def _sqlite(directory: Path) -> Iterator[Target]:
    path = directory / "locks.db"

    def floor() -> tuple[Callable[[], None], Callable[[], None]]:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

        def call() -> None:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("COMMIT")

        return call, conn.close

    yield Target(f"sqlite:///{path}", f"SQLite {sqlite3.sqlite_version}", floor)


def _redis_floor(client: Any) -> Callable[[], tuple[Callable[[], None], Callable[[], None]]]:
    def floor() -> tuple[Callable[[], None], Callable[[], None]]:
        return client.ping, client.close

    return floor


def _redis_version(server: _redis_servers.RedisServer) -> str:
    return f"redis-server {server.info('server')['redis_version']}"


@contextlib.contextmanager
def _redis(directory: Path) -> Iterator[Target]:
    with _redis_servers.standalone(directory) as server:
        yield Target(server.url, _redis_version(server), _redis_floor(server.client()))


@contextlib.contextmanager
def _redis_aof(directory: Path) -> Iterator[Target]:
    with _redis_servers.standalone(directory, appendonly=True, appendfsync="always") as server:
        yield Target(server.url, _redis_version(server), _redis_floor(server.client()))


@contextlib.contextmanager
def _redis_cluster(directory: Path) -> Iterator[Target]:
    with _redis_servers.cluster(directory, masters=3) as topology:
        version = _redis_version(topology.nodes[0]) + ", 3 masters, no replicas"
        yield Target(topology.url, version, _redis_floor(topology.client()))


@contextlib.contextmanager
def _redis_sentinel(directory: Path) -> Iterator[Target]:
    with _redis_servers.sentinel(directory, replicas=1, sentinels=3, appendonly=False) as group:
        version = _redis_version(group.master) + ", 1 master + 1 replica, 3 sentinels"
        master = group.client().master_for(group.service)
        yield Target(group.url, version, _redis_floor(master))


@contextlib.contextmanager
def _postgresql(directory: Path) -> Iterator[Target]:
    import psycopg

    with _pg_server.running_server() as server:
        with psycopg.connect(server.url, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        version = f"PostgreSQL {row[0] if row else '?'}, fsync=off"

        def floor() -> tuple[Callable[[], None], Callable[[], None]]:
            conn = psycopg.connect(server.url, autocommit=True)
            return lambda: conn.execute("SELECT 1").fetchone(), conn.close

        yield Target(server.url, version, floor)


@contextlib.contextmanager
def _memcached(directory: Path) -> Iterator[Target]:
    from pymemcache.client.base import Client

    with _memcached_fixtures.MemcachedServer(directory).start() as server:
        version = f"memcached {server.command('version').split()[-1]}"

        def floor() -> tuple[Callable[[], None], Callable[[], None]]:
            client = Client(("127.0.0.1", server.port))
            return client.version, client.close

        yield Target(server.url, version, floor)


@contextlib.contextmanager
def _etcd(directory: Path) -> Iterator[Target]:
    with _etcd_servers.single(directory) as cluster:
        member = cluster.members[0]
        version = f"etcd {cluster.members[0].status().get('version', '?')}, one member"
        endpoint = f"{member.client_url}/v3/kv/range"

        def floor() -> tuple[Callable[[], None], Callable[[], None]]:
            client = httpx.Client(trust_env=False)

            def call() -> None:
                client.post(endpoint, json={"key": "YmVuY2g="}).raise_for_status()

            return call, client.close

        yield Target(cluster.url, version, floor)


@contextlib.contextmanager
def _zookeeper(directory: Path) -> Iterator[Target]:
    from kazoo.client import KazooClient

    with _zk_servers.standalone(directory) as server:
        reply = server.command("srvr").splitlines()[0]
        version = "ZooKeeper " + reply.split(":", 1)[1].strip().split("-")[0] + ", forceSync=no"

        def floor() -> tuple[Callable[[], None], Callable[[], None]]:
            client = KazooClient(hosts=server.address)
            client.start(timeout=30)

            def close() -> None:
                client.stop()
                client.close()

            return lambda: client.exists("/"), close

        yield Target(server.url, version, floor)


@contextlib.contextmanager
def _http(directory: Path) -> Iterator[Target]:
    with LockServer(f"sqlite:///{directory / 'server.db'}", directory) as server:

        def floor() -> tuple[Callable[[], None], Callable[[], None]]:
            client = httpx.Client(trust_env=False)

            def call() -> None:
                assert client.get(f"{server.url}/v1/no-such-route").status_code == 404

            return call, client.close

        yield Target(server.url, "keymutex serve on a SQLite store", floor)


STORES = [
    Store("memory", "0", "— (no round trip)", _memory, threads=True),
    Store("sqlite", "2 transactions", "empty `BEGIN IMMEDIATE` + `COMMIT`", _sqlite),
    Store("redis", "2", "PING", _redis),
    Store("redis-aof", "2", "PING", _redis_aof),
    Store("redis-cluster", "2", "PING", _redis_cluster),
    Store("redis-sentinel", "2", "PING (to the master)", _redis_sentinel),
    Store("postgresql", "2", "`SELECT 1`", _postgresql),
    Store("memcached", "2 (1 + 1)", "`version`", _memcached),
    Store("etcd", "3 (2 + 1)", "range read (httpx, JSON gateway)", _etcd),
    Store("zookeeper", "3 (2 + 1)", "kazoo `exists`", _zookeeper),
    Store("http", "2 requests", "GET that answers 404 (httpx)", _http),
]
LABELS = {
    "redis": "redis (standalone, no persistence)",
    "redis-aof": "redis (standalone, `appendonly yes`, `appendfsync always`)",
    "redis-cluster": "redis cluster (no persistence)",
    "redis-sentinel": "redis sentinel (no persistence)",
    "http": "http lock server (on SQLite)",
}


# -- 1. uncontended -----------------------------------------------------------------------


@dataclass
class Uncontended:
    floor_median: float | None
    floor_p90: float | None
    ratio: float | None  # median of the per-round ratios keymutex median / floor median
    median: float
    p90: float
    pairs: int


def uncontended(target: Target, seconds: float, rounds: int) -> Uncontended:
    locks = keymutex.Locks(target.url, namespace=f"bench-{uuid.uuid4().hex[:8]}", ttl=30)

    def pair() -> None:
        locks.acquire(KEY, timeout=0).release()

    floor_call, floor_close = target.floor() if target.floor else (None, lambda: None)
    cases: dict[str, Callable[[], None]] = {"keymutex": pair}
    if floor_call is not None:
        cases["floor"] = floor_call
    medians: dict[str, list[float]] = {name: [] for name in cases}
    p90s: dict[str, list[float]] = {name: [] for name in cases}
    pairs = 0
    try:
        for _ in range(WARM_UP_PAIRS):
            for call in cases.values():
                call()
        for round_number in range(rounds):
            # Interleaved call by call (the order rotates each round): the machine is
            # shared and its load drifts, so both cases see the same moments.
            order = list(cases.items())[round_number % len(cases) :]
            order += list(cases.items())[: round_number % len(cases)]
            times: dict[str, list[float]] = {name: [] for name in cases}
            ends = time.monotonic() + seconds
            while time.monotonic() < ends and len(times["keymutex"]) < MAX_PAIRS:
                for name, call in order:
                    started = time.perf_counter()
                    call()
                    times[name].append((time.perf_counter() - started) * 1e6)
            pairs += len(times["keymutex"])
            for name in cases:
                medians[name].append(statistics.median(times[name]))
                p90s[name].append(_percentile(times[name], 0.9))
    finally:
        floor_close()
        locks.close()
    has_floor = "floor" in cases
    return Uncontended(
        floor_median=statistics.median(medians["floor"]) if has_floor else None,
        floor_p90=statistics.median(p90s["floor"]) if has_floor else None,
        ratio=statistics.median(
            pair / floor for pair, floor in zip(medians["keymutex"], medians["floor"], strict=True)
        )
        if has_floor
        else None,
        median=statistics.median(medians["keymutex"]),
        p90=statistics.median(p90s["keymutex"]),
        pairs=pairs,
    )


# -- 2. handoff ---------------------------------------------------------------------------


def _take_turns(
    url: str, namespace: str, first: bool, peer: Any, handoffs: int, hold: float, out: Any
) -> None:
    """One of the two contenders: hold, release, then wait for the key again, in turn.

    Puts ``(kind, number, time)`` rows on ``out``: ``release`` just before a release,
    ``grant`` just after an acquire returned; handoff number n is grant n - release n.
    """
    rows: list[tuple[str, int, float]] = []
    try:
        with keymutex.Locks(url, namespace=namespace, ttl=30) as locks:
            locks.acquire("bench:connect", timeout=30).release()  # connections, scripts
            holding = first
            lease = None
            if first:
                lease = locks.acquire(KEY, timeout=30)
                peer.send("holding")
            else:
                peer.recv()
            for number in range(handoffs):
                if holding:
                    assert lease is not None
                    peer.recv()  # the other one is about to wait
                    time.sleep(hold)
                    rows.append(("release", number, _clock()))
                    lease.release()
                    peer.recv()  # ... and got the key
                else:
                    peer.send("waiting")
                    lease = locks.acquire(KEY, timeout=60)
                    rows.append(("grant", number, _clock()))
                    peer.send("granted")
                holding = not holding
            if holding and lease is not None:
                lease.release()
        out.put(("ok", rows))
    except BaseException:
        out.put(("error", traceback.format_exc()))
        raise


def handoff(store: Store, target: Target, handoffs: int, hold: float) -> list[float]:
    """Handoff times in ms (warm-up left out)."""
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    total = handoffs + WARM_UP_HANDOFFS
    if store.threads:
        ends = mp.Pipe()  # a pair of connected sockets: fine between threads too
        out: Any = queue.Queue()
        workers: list[Any] = [
            threading.Thread(
                target=_take_turns,
                args=(target.url, namespace, index == 0, ends[index], total, hold, out),
            )
            for index in range(2)
        ]
    else:
        context = mp.get_context("spawn")
        ends = context.Pipe()
        out = context.Queue()
        workers = [
            context.Process(
                target=_take_turns,
                args=(target.url, namespace, index == 0, ends[index], total, hold, out),
            )
            for index in range(2)
        ]
    for worker in workers:
        worker.start()
    try:
        replies = [out.get(timeout=120 + total * 2) for _ in workers]
    finally:
        for worker in workers:
            worker.join(30)
            if isinstance(worker, mp.process.BaseProcess) and worker.is_alive():
                worker.kill()  # a contender stuck after a failure
    errors = [detail for status, detail in replies if status != "ok"]
    if errors:
        raise RuntimeError("a contender failed:\n" + "\n".join(errors))
    releases: dict[int, float] = {}
    grants: dict[int, float] = {}
    for _status, rows in replies:
        for kind, number, at in rows:
            (releases if kind == "release" else grants)[number] = at
    return [(grants[number] - releases[number]) * 1e3 for number in range(WARM_UP_HANDOFFS, total)]


# -- the run ------------------------------------------------------------------------------


@dataclass
class Row:
    store: Store
    version: str = ""
    uncontended: Uncontended | None = None
    handoffs: list[float] | None = None
    failure: str = ""
    seconds: float = 0.0


def _run_store(store: Store, args: argparse.Namespace) -> Row:
    row = Row(store)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"km-bench-{store.name}-") as tmp:
        directory = Path(tmp)
        with contextlib.ExitStack() as stack:
            try:
                target = stack.enter_context(store.start(directory))
            except Exception as exc:  # not installed, or did not start: say so
                row.failure = f"not run: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                return row
            row.version = target.version
            print(f"{store.name}: uncontended ...", flush=True)
            row.uncontended = uncontended(target, args.seconds, args.rounds)
            print(f"{store.name}: handoff ...", flush=True)
            row.handoffs = handoff(store, target, args.handoffs, args.hold_ms / 1e3)
    row.seconds = time.monotonic() - began
    return row


def _versions() -> str:
    names = ["keymutex", "redis", "hiredis", "psycopg", "pymemcache", "kazoo", "httpx"]
    found = []
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name} {importlib.metadata.version(name)}")
    return ", ".join(found)


def _number(value: float | None, digits: int = 0) -> str:
    if value is None or value != value:  # None or NaN
        return "—"
    return f"{value:,.{digits}f}"


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def report(rows: list[Row], args: argparse.Namespace, elapsed: float, load_before: str) -> str:
    chosen = " ".join(args.stores)
    command = (
        f"{COMMAND} --seconds {args.seconds:g} --rounds {args.rounds}"
        f" --handoffs {args.handoffs} --hold-ms {args.hold_ms:g}"
        + (f" {chosen}" if chosen else "")
    )
    lines = [
        "## Every store: uncontended cost and handoff (`benchmarks/bench_stores.py`)",
        "",
        f"Run on {time.strftime('%Y-%m-%d')}: {_cpu()}, {os.cpu_count()} cores (shared),"
        f" Linux {platform.release()}, Python {platform.python_version()}; load average at"
        f" the start {load_before}, at the end {_load()}. keymutex at"
        f" {_revision()}. Whole run: {elapsed:.0f} s.",
        "",
        f"Command: `{command}`",
        "",
        f"Versions: {_versions()}.",
        "",
        "This machine is shared with other work and has 2 cores: absolute figures move"
        " between runs (disk-bound rows, which wait for an fsync, most of all); compare"
        " ratios measured in one run (× floor: the median of per-round ratios; and one"
        " store against another in this table).",
        "",
        f"Uncontended: {args.rounds} rounds of {args.seconds:g} s, `acquire(key, timeout=0)`"
        " + `release()` interleaved call by call with the floor. Handoff: 2 processes take"
        f" turns on one key, the holder holding {args.hold_ms:g} ms after the waiter starts"
        " waiting; release call → the other's grant.",
        "",
        "| store | server | round trips | floor | floor µs | keymutex median µs"
        " | keymutex p90 µs | × floor | handoff p50 ms | handoff p90 ms | handoffs |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        label = LABELS.get(row.store.name, row.store.name)
        if row.failure:
            lines.append(f"| {label} | {row.failure} | | | | | | | | | |")
            continue
        measured = row.uncontended
        assert measured is not None
        assert row.handoffs is not None
        ratio = _number(measured.ratio, 2)
        handoffs = row.handoffs
        lines.append(
            f"| {label} | {row.version} | {row.store.round_trips} | {row.store.floor}"
            f" | {_number(measured.floor_median)} | {_number(measured.median)}"
            f" | {_number(measured.p90)} | {ratio}"
            f" | {_number(_percentile(handoffs, 0.5), 2)}"
            f" | {_number(_percentile(handoffs, 0.9), 2)} | {len(handoffs)} |"
        )
    lines.append(
        "| mongodb | not measured here: no MongoDB server can be installed on this machine"
        " | 2 (1 + 1) | | | | | | | | |"
    )
    lines += [
        "",
        "Notes:",
        "",
        "- Round trips per acquire+release, from each store module's docstring (granted"
        " acquire + release). memcached: a meta `ms` add (with the index append in"
        " the same write), then a meta `md` by CAS (plus a compaction every 64 grants). etcd: lease grant +"
        " transaction, then revoke. ZooKeeper: create + list, then delete. The lock"
        " server runs each request's step on its own store (SQLite).",
        "- Servers run as the tests run them: PostgreSQL with `fsync=off`, ZooKeeper with"
        " `forceSync=no`, Redis without persistence (one row with `appendfsync always`,"
        " which fsyncs every write), etcd with its defaults, which fsync every write:"
        " most of an etcd round trip is this machine's fsync.",
        "- `memory://` takes no round trip; its handoff is between 2 threads of one"
        " process (the store is one process's table).",
        "- Handoff is driven by each store's wait mechanism: a wake-up (memory, SQLite"
        " datagram, Redis pub/sub, PostgreSQL LISTEN/NOTIFY, etcd watch, ZooKeeper watch,"
        " the lock server's long poll) or, for memcached, polling: 1 ms after the key"
        " changed hands, growing 1.5 x to at most 50 ms per queue position, with the"
        " released key kept for the first queued waiter.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stores", nargs="*", help="stores to run (default: all)")
    parser.add_argument("--seconds", type=float, default=0.5, help="per uncontended round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--handoffs", type=int, default=100, help="counted handoffs per store")
    parser.add_argument("--hold-ms", type=float, default=10.0, help="hold before a release")
    parser.add_argument("--output", default=str(RESULTS / "stores.md"))
    args = parser.parse_args()
    known = {store.name for store in STORES}
    unknown = sorted(set(args.stores) - known)
    if unknown:
        parser.error(f"unknown stores {unknown}; known: {', '.join(sorted(known))}")

    began = time.monotonic()
    load_before = _load()
    rows = []
    for store in STORES:
        if args.stores and store.name not in args.stores:
            continue
        row = _run_store(store, args)
        print(f"{store.name}: {row.failure or f'{row.seconds:.0f} s'}", flush=True)
        rows.append(row)
    text = report(rows, args, time.monotonic() - began, load_before)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

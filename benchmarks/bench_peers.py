"""keymutex side by side with the lock libraries people use on PostgreSQL, memcached, etcd, ZooKeeper.

Run: .venv/bin/python benchmarks/bench_peers.py [--stores postgresql,memcached,etcd,zookeeper]
     [--seconds 3] [--rounds 3] [--pair-seconds 1.5]

One command does everything. Like benchmarks/redis_bench.py, it creates (or updates)
its own virtualenv, benchmarks/.peers/peers-venv, installs there the peers pinned in
benchmarks/peers-requirements.txt plus keymutex from this checkout (``pip install -e
.[postgresql,memcached,etcd,zookeeper]``) and re-executes itself inside it: the peers
never enter the project's .venv. A peer that cannot be installed is reported, not run.

Each store's server is started the way the tests start it (tests/_pg_server.py,
_memcached_fixtures.py, _etcd_servers.py, _zk_servers.py: free loopback ports,
temporary directories), one store at a time, and stopped before the next.

The peers, per store:

- PostgreSQL: tooz's ``postgresql://`` driver (session advisory locks, psycopg2), and pals
  (session advisory locks on a SQLAlchemy pool);
- memcached: tooz's ``memcached://`` driver (pymemcache), sherlock's ``MCLock`` (pylibmc);
- etcd: tooz's ``etcd3+http://`` driver (etcd3gw, etcd's JSON gateway), and python-etcd3's
  ``Lock`` (gRPC) when it can run: its generated code needs pure-Python protobuf
  (``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python``) with protobuf 4 or later, and its
  ``acquire`` waits through a tenacity callback of the old signature that tenacity 8 and
  later reject, so the wait loop is re-stated here, step for step (``_etcd3_acquire``);
  both problems are probed again in every run and reported;
- ZooKeeper: tooz's ``zookeeper://`` driver and kazoo's own ``Lock`` recipe.

The workload, the same for every library of a store, in one run:

1. Uncontended: one client in this process takes a free key and releases it (each
   library's blocking acquire, keymutex ``with locks.lock(key, renew=False)``; keymutex's
   try-once ``acquire(key, timeout=0)`` as an extra row), interleaved call by call with the
   store's floor, one trivial round trip of a plain client: PostgreSQL ``SELECT 1``
   (psycopg), memcached ``version`` (pymemcache), an etcd range read on the JSON gateway
   (httpx), ZooKeeper ``exists`` (kazoo). ``--rounds`` rounds of ``--pair-seconds`` each, the
   order of the cases rotating; medians of the per-round medians and p90s, × floor and ×
   keymutex the medians of the per-round ratios.
2. Contention: 4 processes, each with its own client, loop for ``--seconds`` on one key;
   the critical section is a read-modify-write of a counter file. Acquires/s (grants
   before the deadline), lost updates (grants − the counter: must be 0), overlaps (a
   grant before the previous holder's release), handoff p50/p90 (just before a release
   call → another process's acquire returning, on ``CLOCK_BOOTTIME``, which all the
   processes share), same-holder % (consecutive grants to one process), worst wait (ask →
   grant). ``--rounds`` rounds, the order of the libraries rotating; medians over rounds,
   except lost updates and overlaps (sums) and the worst wait (the worst of all rounds).

Results: benchmarks/results/peers.md (and stdout). The header names the commit of the
keymutex imported; to measure a commit while src/ has uncommitted changes, run with
``PYTHONPATH=<a clean clone>/src`` (the header then says "from <clone>").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the server helpers
from _common import contention_row, enter_peer_venv
from _common import cpu_model as _cpu
from _common import host_clock as _clock
from _common import percentile as _percentile
from _common import revision as _revision

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PEERS_VENV = HERE / ".peers" / "peers-venv"
PEERS_FILE = HERE / "peers-requirements.txt"
FAILURES_FILE = PEERS_VENV / "install-failures.json"
KEYMUTEX_EXTRAS = "postgresql,memcached,etcd,zookeeper"
RESULTS = HERE / "results"
COMMAND = ".venv/bin/python benchmarks/bench_peers.py"

PROCESSES = 4
KEY = "contended"
TTL_S = 30  # every library's lease or item lifetime (tooz's default lock_timeout)
WAIT_S = 60.0  # how long a contender may wait, where the library lets us say it
ETCD3_WAIT_S = 10.0  # python-etcd3's own default acquire timeout
WARM_UP_PAIRS = 20
MAX_PAIRS = 3000  # per case and uncontended round


# -- the peers' virtualenv (the approach of redis_bench.py) ------------------------------


# -- the libraries: one client each, holding a key as a context manager ------------------


class GaveUp(Exception):
    """A library's acquire came back without the lock (its own timeout ran out)."""


@dataclass
class Client:
    """One library's client: ``hold(key)`` holds the key for a ``with`` block."""

    hold: Callable[[str], contextlib.AbstractContextManager[None]]
    close: Callable[[], None]


@contextlib.contextmanager
def _held(acquire: Callable[[], Any], release: Callable[[], Any]) -> Iterator[None]:
    if not acquire():
        raise GaveUp
    try:
        yield
    finally:
        release()


def _per_key(make: Callable[[str], Any]) -> Callable[[str], Any]:
    """One lock object per key, made on first use (kazoo's ensures its path only once)."""
    made: dict[str, Any] = {}

    def lock(key: str) -> Any:
        if key not in made:
            made[key] = make(key)
        return made[key]

    return lock


def _keymutex(where: dict[str, Any], namespace: str) -> Client:
    import keymutex

    locks = keymutex.Locks(where["url"], namespace=namespace, ttl=TTL_S)
    return Client(lambda key: locks.lock(key, timeout=WAIT_S, renew=False), locks.close)


def _keymutex_try_once(where: dict[str, Any], namespace: str) -> Client:
    import keymutex

    locks = keymutex.Locks(where["url"], namespace=namespace, ttl=TTL_S)

    @contextlib.contextmanager
    def hold(key: str) -> Iterator[None]:
        lease = locks.acquire(key, timeout=0)
        try:
            yield
        finally:
            lease.release()

    return Client(hold, locks.close)


def _tooz(where: dict[str, Any], namespace: str) -> Client:
    from tooz import coordination

    member = f"bench-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
    coordinator = coordination.get_coordinator(where["tooz"], member)
    coordinator.start()
    lock = _per_key(lambda key: coordinator.get_lock(f"{namespace}-{key}".encode()))

    def hold(key: str) -> contextlib.AbstractContextManager[None]:
        this = lock(key)
        return _held(lambda: this.acquire(blocking=True), this.release)

    return Client(hold, coordinator.stop)


def _pals(where: dict[str, Any], namespace: str) -> Client:
    import pals

    # Its defaults (a SQLAlchemy engine's pool on psycopg2), but the wait: 60 s as the
    # others' (its default is 30 s, in ms, PostgreSQL's lock_timeout).
    locker = pals.Locker(namespace, where["url"], acquire_timeout_default=int(WAIT_S * 1000))
    lock = _per_key(locker.lock)

    def hold(key: str) -> contextlib.AbstractContextManager[None]:
        this = lock(key)
        return _held(lambda: this.acquire(blocking=True), this.release)

    return Client(hold, locker.engine.dispose)


def _sherlock(where: dict[str, Any], namespace: str) -> Client:
    import pylibmc
    from sherlock import LockTimeoutException, MCLock

    client = pylibmc.Client([f"127.0.0.1:{where['port']}"], binary=True)
    # Defaults but two: the item's lifetime (60 s) as the others', and the wait budget
    # (10 s, counted as tries × retry_interval, not by a clock) raised so none gives up.
    lock = _per_key(
        lambda key: MCLock(f"{namespace}-{key}", client=client, expire=TTL_S, timeout=WAIT_S)
    )

    def acquire(this: Any) -> bool:
        try:
            return bool(this.acquire())
        except LockTimeoutException:
            return False

    def hold(key: str) -> contextlib.AbstractContextManager[None]:
        this = lock(key)
        return _held(lambda: acquire(this), this.release)

    return Client(hold, client.disconnect_all)


def _etcd3_acquire(lock: Any, timeout: float) -> bool:
    """python-etcd3 0.12.0's ``Lock.acquire``, its wait step callable by tenacity ≥ 8.

    The shipped one hands tenacity ``wait(previous_attempt_number,
    delay_since_first_attempt)``, which tenacity ≥ 8 calls with one argument: a
    ``TypeError`` as soon as a try is refused. Same steps here: grant a lease, a
    transaction that puts the key if it has never been created, else ``watch_once``
    on the key for what is left of the timeout, and again.
    """
    from etcd3 import exceptions

    client = lock.etcd_client
    started = time.monotonic()
    while True:
        lock.lease = client.lease(lock.ttl)
        succeeded, _ = client.transaction(
            compare=[client.transactions.create(lock.key) == 0],
            success=[client.transactions.put(lock.key, lock.uuid, lease=lock.lease)],
            failure=[client.transactions.get(lock.key)],
        )
        if succeeded:
            return True
        lock.lease = None
        remaining = timeout - (time.monotonic() - started)
        if remaining <= 0:
            return False
        with contextlib.suppress(exceptions.WatchTimedOut):
            client.watch_once(lock.key, remaining)


def _etcd3(where: dict[str, Any], namespace: str) -> Client:
    import etcd3

    client = etcd3.client(host="127.0.0.1", port=where["port"])
    lock = _per_key(lambda key: client.lock(f"{namespace}-{key}", ttl=TTL_S))

    def hold(key: str) -> contextlib.AbstractContextManager[None]:
        this = lock(key)
        return _held(lambda: _etcd3_acquire(this, ETCD3_WAIT_S), this.release)

    def close() -> None:
        # Once a watch ran, python-etcd3's watch thread loops on its channel for ever
        # and dies with a traceback when the channel closes: leave it to process exit.
        if client.watcher._callback_thread is None:
            client.close()

    return Client(hold, close)


def _kazoo(where: dict[str, Any], namespace: str) -> Client:
    from kazoo.client import KazooClient
    from kazoo.exceptions import LockTimeout

    client = KazooClient(hosts=where["address"])
    client.start(timeout=30)
    identifier = f"bench-{os.getpid()}"
    lock = _per_key(lambda key: client.Lock(f"/bench-kazoo/{namespace}/{key}", identifier))

    def hold(key: str) -> contextlib.AbstractContextManager[None]:
        this = lock(key)

        def acquire() -> bool:
            try:
                return bool(this.acquire(timeout=WAIT_S))
            except LockTimeout:
                return False

        return _held(acquire, this.release)

    def close() -> None:
        client.stop()
        client.close()

    return Client(hold, close)


FACTORIES: dict[str, Callable[[dict[str, Any], str], Client]] = {
    "keymutex": _keymutex,
    "keymutex-try-once": _keymutex_try_once,
    "tooz": _tooz,
    "pals": _pals,
    "sherlock": _sherlock,
    "etcd3": _etcd3,
    "kazoo": _kazoo,
}
DISTRIBUTIONS = {  # whose install failure stops a case
    "keymutex": "keymutex",
    "keymutex-try-once": "keymutex",
    "tooz": "tooz",
    "pals": "pals",
    "sherlock": "sherlock",
    "etcd3": "etcd3",
    "kazoo": "kazoo",
}


# -- the stores ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    library: str  # a key of FACTORIES
    label: str
    round_trips: str  # acquire + release, from reading each library's code
    contends: bool = True  # in part 2 too


@dataclass
class Target:
    """A running store: what clients need to reach it, its version, and its floor."""

    where: dict[str, Any]  # picklable: sent to the contending processes
    version: str
    floor: Callable[[], tuple[Callable[[], object], Callable[[], object]]]  # (call, close)


@dataclass(frozen=True)
class Store:
    name: str
    title: str
    floor: str
    start: Callable[[Path], contextlib.AbstractContextManager[Target]]
    cases: tuple[Case, ...]
    notes: tuple[str, ...]


@contextlib.contextmanager
def _postgresql(directory: Path) -> Iterator[Target]:
    import psycopg

    import _pg_server

    with _pg_server.running_server() as server:
        with psycopg.connect(server.url, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        version = f"PostgreSQL {str(row[0]).split()[0] if row else '?'} (fsync=off)"

        def floor() -> tuple[Callable[[], object], Callable[[], object]]:
            conn = psycopg.connect(server.url, autocommit=True)
            return lambda: conn.execute("SELECT 1").fetchone(), conn.close

        where = {"url": server.url, "tooz": server.url}
        yield Target(where, version, floor)


@contextlib.contextmanager
def _memcached(directory: Path) -> Iterator[Target]:
    from pymemcache.client.base import Client as MemcacheClient

    import _memcached_fixtures

    with _memcached_fixtures.MemcachedServer(directory).start() as server:
        version = f"memcached {server.command('version').split()[-1]}"

        def floor() -> tuple[Callable[[], object], Callable[[], object]]:
            client = MemcacheClient(("127.0.0.1", server.port))
            return client.version, client.close

        where = {"url": server.url, "tooz": server.url, "port": server.port}
        yield Target(where, version, floor)


@contextlib.contextmanager
def _etcd(directory: Path) -> Iterator[Target]:
    import httpx

    import _etcd_servers

    with _etcd_servers.single(directory) as cluster:
        member = cluster.members[0]
        version = f"etcd {member.status().get('version', '?')} (one member)"
        endpoint = f"{member.client_url}/v3/kv/range"
        port = int(member.client_url.rsplit(":", 1)[1])

        def floor() -> tuple[Callable[[], object], Callable[[], object]]:
            client = httpx.Client(trust_env=False)

            def call() -> None:
                client.post(endpoint, json={"key": "YmVuY2g="}).raise_for_status()

            return call, client.close

        where = {"url": cluster.url, "tooz": f"etcd3+http://127.0.0.1:{port}", "port": port}
        yield Target(where, version, floor)


@contextlib.contextmanager
def _zookeeper(directory: Path) -> Iterator[Target]:
    from kazoo.client import KazooClient

    import _zk_servers

    with _zk_servers.standalone(directory) as server:
        reply = server.command("srvr").splitlines()[0]
        version = "ZooKeeper " + reply.split(":", 1)[1].strip().split("-")[0] + " (forceSync=no)"

        def floor() -> tuple[Callable[[], object], Callable[[], object]]:
            client = KazooClient(hosts=server.address)
            client.start(timeout=30)

            def close() -> None:
                client.stop()
                client.close()

            return lambda: client.exists("/"), close

        where = {"url": server.url, "tooz": f"zookeeper://{server.address}"}
        where["address"] = server.address
        yield Target(where, version, floor)


KEYMUTEX_LABEL = "**keymutex** `with locks.lock(key, renew=False)`"
TRY_ONCE_LABEL = "keymutex `acquire(key, timeout=0)` + `release()`"

STORES = [
    Store(
        "postgresql",
        "PostgreSQL",
        "`SELECT 1` (psycopg 3)",
        _postgresql,
        (
            Case("keymutex", KEYMUTEX_LABEL, "2 statements"),
            Case("keymutex-try-once", TRY_ONCE_LABEL, "2 statements", contends=False),
            Case(
                "tooz",
                "tooz `postgresql://` (advisory lock)",
                "a new connection, `BEGIN`, lock; unlock, close",
            ),
            Case(
                "pals",
                "pals `Locker` (advisory lock, SQLAlchemy pool)",
                "`lock_timeout` set, lock, each in a transaction; unlock, pool check-in",
            ),
        ),
        (
            "**tooz `postgresql://`** takes a session-level `pg_advisory_lock` on a *new*"
            " psycopg2 connection for every acquire and closes that connection at release:"
            " most of its time is a PostgreSQL connection start (a backend process). The lock"
            " lives exactly as long as that connection: a crash frees it at once, but so does"
            " a network blip or a pooler recycling the connection, and the holder is not told."
            " No TTL, no fence, no holder information; the connection stays idle in a"
            " transaction while it holds (psycopg2 is not in autocommit). The lock's id is"
            " 2 bytes of the name's MD5: names collide (65,536 slots), and two unrelated"
            " names can exclude each other. A waiter blocks inside PostgreSQL's lock manager,"
            " so a release wakes the next one at once. tooz 9.1.0 marks the driver deprecated.",
            "**pals** (0.4.0, 2024) takes a session-level `pg_advisory_lock` on a connection"
            " of its SQLAlchemy pool, held until release; before each blocking acquire it sets"
            " `lock_timeout` (the wait) in a transaction of its own, every statement runs in"
            " a transaction, and each check-in of the connection unlocks all and rolls back:"
            " many round trips, and SQLAlchemy's work around each. The lock lives as long as that connection, as tooz's does (a crash frees"
            " it, so does a dropped connection, unseen by the holder); no TTL, no fence, no"
            " holder information. The lock's id is 8 bytes of SHA-1 of the app name and key"
            " (collisions are negligible). A waiter blocks in PostgreSQL's lock manager, so a"
            " release wakes the next one at once.",
            "**keymutex `postgresql://`**: a lease row per key, TTL by the server's clock,"
            " a fence from a sequence, holder information; it survives a dropped connection"
            " (it ends at its TTL or release, not with a socket). Waiters queue in the row"
            " and a release hands the key to the first queued one (`pg_notify`), which its"
            " docstring says keeps the releaser from barging back in ahead of the queue; the"
            " same holder % above is how often the key still went back to the releaser.",
        ),
    ),
    Store(
        "memcached",
        "memcached",
        "`version` (pymemcache)",
        _memcached,
        (
            Case("keymutex", KEYMUTEX_LABEL, "2 (`ms` add + index append; `md` by CAS)"),
            Case("keymutex-try-once", TRY_ONCE_LABEL, "2", contends=False),
            Case("tooz", "tooz `memcached://` (pymemcache)", "3 (`add`; `get`, `delete`)"),
            Case("sherlock", "sherlock `MCLock` (pylibmc, binary)", "3 (`add`; `get`, `delete`)"),
        ),
        (
            "No memcached lock is safe against eviction or a restart of memcached: the item"
            " goes, and the key looks free (keymutex's docs call its memcached store an"
            " efficiency lock).",
            "**tooz `memcached://`**: `add` with a 30 s expiry; release is `get`, compare,"
            " then `delete`, two commands, not one: if the item expired and another client"
            " took the key in between, the `delete` removes *its* lock (tooz's own comment"
            " says so). No fence. The item lives 30 s unless the coordinator's `heartbeat()`"
            " is called; nothing renews it by itself. A refused waiter retries through"
            " tenacity's `wait_exponential(max=1)`, which is 1 s from the first retry on: it"
            " polls once a second.",
            "**sherlock `MCLock`**: `add` with an expiry (set to 30 s here; 60 s by"
            " default), release `get`, compare, `delete` (the same window as tooz's), no"
            " fence. A waiter polls every `retry_interval` (0.1 s); its `timeout` is counted"
            " as tries × interval, not by a clock (raised to 60 here so no contender gives up).",
            "**keymutex `memcached://`**: a lease record with a fence (not durable), released"
            " by compare-and-delete (`md … C<cas>`, the CAS of its own grant), never a plain"
            " `delete`, so a late release cannot remove someone else's lease; expiry judged"
            " by the clients' wall clocks. memcached cannot notify: a refused waiter polls"
            " on growing steps (1 ms, × 1.5, at most 50 ms × (1 + the waiters ahead of it))."
            " Until a waiter has been refused for `patience` (0.1 s), the releaser may take"
            " the key straight back; after that the waiter queues in the lease record and a"
            " release keeps the key for the first queued waiter (a tombstone written by"
            " compare-and-swap), which is what bounds same holder % and the worst wait.",
        ),
    ),
    Store(
        "etcd",
        "etcd",
        "range read (httpx on the JSON gateway)",
        _etcd,
        (
            Case("keymutex", KEYMUTEX_LABEL, "3 (lease grant, txn; revoke)"),
            Case("keymutex-try-once", TRY_ONCE_LABEL, "3", contends=False),
            Case(
                "tooz",
                "tooz `etcd3+http://` (etcd3gw, JSON gateway)",
                "3 (lease grant, txn; txn)",
            ),
            Case(
                "etcd3",
                "python-etcd3 `Lock` (gRPC, pure-Python protobuf)",
                "3 (lease grant, txn; txn)",
            ),
        ),
        (
            "**tooz `etcd3+http://`**: a lease grant and a create-if-absent transaction (so"
            " the lock is linearizable), release a compare-value transaction that deletes the"
            " key. Its lease is never revoked: it outlives the release by its 30 s, and a"
            " refused try grants a new one each time, left to expire too. No fence (the"
            " create revision is not kept: a TODO in its code). The lease is not kept alive"
            " unless the coordinator's `heartbeat()` is called: a hold longer than 30 s loses"
            " the lock silently. A refused waiter polls, 1 s apart (tenacity"
            " `wait_exponential(max=1)`).",
            "**python-etcd3 `Lock`** (0.12.0, 2020, unmaintained): the same lease + transaction"
            " steps over gRPC, the lease not revoked at release either, no fence. A refused"
            " waiter watches the key (`watch_once`) and tries again on its next event; the"
            " watch starts after the refusal, so a release in between is missed until"
            " another event on the key or its timeout (10 s by default), the worst wait"
            " column shows it. See *python-etcd3* below for what it needed to run at all.",
            "The leases tooz and python-etcd3 leave behind expire 30 s later, each expiry a"
            " raft write (fsynced): in this run they land during the contention runs that"
            " follow, whichever library is running then (the order rotates).",
            "**keymutex `etcd://`**: an etcd lease per token, revoked at release (etcd deletes"
            " the key with it, atomically); fence = the key's revision; waiters share one"
            " watch stream per namespace, started at the revision after their refusal, so no"
            " release is missed. Waiters queue by create revision and only the first is woken"
            " (`fair=True`).",
        ),
    ),
    Store(
        "zookeeper",
        "ZooKeeper",
        "`exists` (kazoo)",
        _zookeeper,
        (
            Case("keymutex", KEYMUTEX_LABEL, "3 (create, list; delete)"),
            Case("keymutex-try-once", TRY_ONCE_LABEL, "3", contends=False),
            Case("tooz", "tooz `zookeeper://` (kazoo's Lock inside)", "3 (create, list; delete)"),
            Case("kazoo", "kazoo `Lock` recipe", "3 (create, list; delete)"),
        ),
        (
            "**kazoo `Lock`**, and **tooz `zookeeper://`**, which is kazoo's `Lock` behind"
            " tooz's interface: a FIFO queue of ephemeral sequential nodes, each waiter"
            " watching the one before it, so a release wakes exactly the next waiter. The"
            " lock lives as long as the ZooKeeper session, with no TTL of its own: a holder"
            " that is stuck but connected keeps it forever, and one whose session expires"
            " loses it without the `Lock` object noticing (`is_acquired` stays true; only a"
            " connection-state listener tells). No fence is exposed (the node's `czxid`"
            " would be one, read by hand).",
            "**keymutex `zookeeper://`**: the same queue of ephemeral sequential nodes, plus"
            " a per-lease TTL by the leader's clock that contenders enforce, the node's"
            " `czxid` as fence, holder information, and a lease reported lost at its local"
            " deadline when the session is in doubt. Its acquire claims the node (`setData`)"
            " after finding itself first: one more write than the recipe on a handoff.",
        ),
    ),
]
STORE_NAMES = [store.name for store in STORES]


# -- 1. uncontended -----------------------------------------------------------------------


@dataclass
class Uncontended:
    medians: dict[str, float] = field(default_factory=dict)  # label -> µs
    p90s: dict[str, float] = field(default_factory=dict)
    per_floor: dict[str, float] = field(default_factory=dict)
    per_keymutex: dict[str, float] = field(default_factory=dict)
    pairs: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


FLOOR = "floor"


def _open_calls(
    target: Target, cases: list[Case], namespace: str, skip: dict[str, str], result: Uncontended
) -> tuple[dict[str, Callable[[], object]], list[Callable[[], object]]]:
    """The floor's call and each case's pair on connections of their own, warmed up,
    and what closes them. A case that cannot be made or fails is noted in ``result``."""
    calls: dict[str, Callable[[], object]] = {}
    closers: list[Callable[[], object]] = []
    floor_call, floor_close = target.floor()
    closers.append(floor_close)
    calls[FLOOR] = floor_call
    for case in cases:
        if case.library in skip:
            result.failed[case.label] = skip[case.library]
            continue
        if case.label in result.failed:
            continue
        try:
            client = FACTORIES[case.library](target.where, namespace)
        except Exception as exc:
            result.failed[case.label] = f"{type(exc).__name__}: {exc}"
            continue
        closers.append(client.close)
        key = f"free-{case.library}"

        def pair(client: Client = client, key: str = key) -> None:
            with client.hold(key):
                pass

        calls[case.label] = pair
    for _ in range(WARM_UP_PAIRS):
        for label, call in list(calls.items()):
            try:
                call()
            except Exception as exc:
                result.failed[label] = f"{type(exc).__name__}: {exc}"
                del calls[label]
    return calls, closers


def uncontended(
    target: Target, cases: list[Case], seconds: float, rounds: int, skip: dict[str, str]
) -> Uncontended:
    """Each case's pair, and the floor, side by side.

    Every round opens new connections for all of them: a server serves a connection
    from one of its threads or processes for the connection's whole life, and the
    scheduler's placement of that thread beside the client or away from it made one
    connection's round trip 20 µs and another's 80 µs on this 2-core machine, for as
    long as each lived. Found when the two keymutex rows, the same store's code on two
    connections, came out 1.4–2 × apart in one run and alike in the next. New
    connections each round draw that lot again, and the medians over rounds even it out.
    """
    result = Uncontended()
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    medians: dict[str, list[float]] = {}
    p90s: dict[str, list[float]] = {}
    for round_number in range(rounds):
        calls, closers = _open_calls(target, cases, namespace, skip, result)
        try:
            # Interleaved call by call: the machine is shared and its load drifts, so
            # every case sees the same moments. In another order each round, not
            # rotated: a rotation keeps each case behind the same one (tooz's closed
            # connection, a PostgreSQL backend that exits, slowed whichever came next).
            order = list(calls.items())
            random.Random(round_number).shuffle(order)
            times: dict[str, list[float]] = {label: [] for label in calls}
            ends = time.monotonic() + seconds
            while time.monotonic() < ends and len(times[FLOOR]) < MAX_PAIRS:
                for label, call in order:
                    started = time.perf_counter()
                    call()
                    times[label].append((time.perf_counter() - started) * 1e6)
        finally:
            for close in reversed(closers):
                with contextlib.suppress(Exception):
                    close()
        for label, values in times.items():
            medians.setdefault(label, []).append(statistics.median(values))
            p90s.setdefault(label, []).append(_percentile(values, 0.9))
            result.pairs[label] = result.pairs.get(label, 0) + len(values)
    # A case that failed in a later round has fewer rounds than the floor: left out.
    medians = {label: values for label, values in medians.items() if label not in result.failed}
    reference = KEYMUTEX_LABEL if KEYMUTEX_LABEL in medians else None
    for label in medians:
        result.medians[label] = statistics.median(medians[label])
        result.p90s[label] = statistics.median(p90s[label])
        result.per_floor[label] = statistics.median(
            a / b for a, b in zip(medians[label], medians[FLOOR], strict=True)
        )
        if reference is not None:
            result.per_keymutex[label] = statistics.median(
                a / b for a, b in zip(medians[label], medians[reference], strict=True)
            )
    return result


# -- 2. contention ------------------------------------------------------------------------


def _contender(
    library: str,
    where: dict[str, Any],
    namespace: str,
    counter: str,
    seconds: float,
    ready: Any,
    out: Any,
) -> None:
    """One of the processes: hold KEY, read-modify-write the counter file, release; again."""
    try:
        client = FACTORIES[library](where, namespace)
        with client.hold(f"warm-{os.getpid()}"):  # connect, create paths, load scripts
            pass
        path = Path(counter)
        holds: list[tuple[float, float, float]] = []  # (asked, acquired, released)
        gave_up = 0
        ready.wait(timeout=120)
        deadline = _clock() + seconds
        while (asked := _clock()) < deadline:
            try:
                with client.hold(KEY):
                    acquired = _clock()
                    path.write_text(str(int(path.read_text() or "0") + 1))
                    released = _clock()
            except GaveUp:
                gave_up += 1
                continue
            holds.append((asked, acquired, released))
        client.close()
        out.put(("ok", os.getpid(), holds, gave_up))
    except BaseException:
        with contextlib.suppress(Exception):
            ready.abort()  # the others, and the parent, stop waiting for this one
        out.put(("error", os.getpid(), traceback.format_exc(), 0))
        raise


def contention(library: str, where: dict[str, Any], seconds: float) -> dict[str, float]:
    """One run of PROCESSES contenders on one key: the metrics."""
    context = mp.get_context("spawn")
    ready = context.Barrier(PROCESSES + 1)
    out = context.Queue()
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="km-bench-peers-") as workdir:
        counter = Path(workdir) / "counter"
        counter.write_text("0")
        processes = [
            context.Process(
                target=_contender,
                args=(library, where, namespace, str(counter), seconds, ready, out),
                daemon=True,
            )
            for _ in range(PROCESSES)
        ]
        for process in processes:
            process.start()
        try:
            with contextlib.suppress(threading.BrokenBarrierError):
                ready.wait(timeout=120)
            replies = [out.get(timeout=seconds + 120) for _ in processes]
        except queue.Empty:
            raise RuntimeError("contenders did not finish in time (hang?)") from None
        finally:
            for process in processes:
                process.join(10)
                if process.is_alive():
                    process.kill()
                    process.join()
        errors = [detail for status, _, detail, _ in replies if status != "ok"]
        if errors:
            raise RuntimeError(errors[0].strip().splitlines()[-1])
        counted = int(counter.read_text())
    holds = sorted(
        (acquired, released, asked, pid)
        for _, pid, rows, _ in replies
        for asked, acquired, released in rows
    )
    return {
        **contention_row(holds, seconds, counted),
        "gave up": sum(reply[3] for reply in replies),
        "acquires": len(holds),
    }


# -- python-etcd3's problems, probed in every run ----------------------------------------


def _etcd3_problems(where: dict[str, Any]) -> list[str]:
    """What python-etcd3 does with this venv's protobuf and tenacity, as it ships."""
    found = []
    env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    probe = subprocess.run(
        [sys.executable, "-c", "import etcd3"], capture_output=True, text=True, env=env
    )
    if probe.returncode != 0:
        lines = [line for line in probe.stderr.splitlines() if "Error" in line]
        found.append(
            f"with protobuf {_version('protobuf')} (the C implementation, the default),"
            f" `import etcd3` fails: `{(lines or ['?'])[-1].strip()[:160]}`. It runs here"
            " with `PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python` (pure-Python parsing,"
            " which protobuf's error suggests), set by this script for every process."
        )
    else:
        found.append(f"`import etcd3` works with protobuf {_version('protobuf')} as shipped.")
    try:
        import etcd3

        holder = etcd3.client(host="127.0.0.1", port=where["port"])
        waiter = etcd3.client(host="127.0.0.1", port=where["port"])
        try:
            name = f"probe-{uuid.uuid4().hex[:8]}"
            assert holder.lock(name, ttl=TTL_S).acquire(timeout=1)
            try:
                refused = waiter.lock(name, ttl=TTL_S).acquire(timeout=0.2)
                found.append(
                    f"its own `Lock.acquire` on a held key returned {refused!r}"
                    f" with tenacity {_version('tenacity')}."
                )
            except Exception as exc:
                found.append(
                    f"its own `Lock.acquire` on a held key raises `{type(exc).__name__}:"
                    f" {exc}` with tenacity {_version('tenacity')} (its wait callback has"
                    " the signature tenacity dropped in 8.0): blocking waits cannot work,"
                    " nor even a timed try on a held key. The rows above use"
                    " `_etcd3_acquire`, the same loop re-stated with a callable wait."
                )
        finally:
            holder.close()
            waiter.close()
    except Exception as exc:
        found.append(f"probing its `Lock` failed: {type(exc).__name__}: {exc}")
    return found


# -- the run ------------------------------------------------------------------------------


@dataclass
class Row:
    store: Store
    version: str = ""
    failure: str = ""
    uncontended: Uncontended | None = None
    contention: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    contention_failed: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _log(began: float, message: str) -> None:
    print(f"[{time.monotonic() - began:6.1f} s] {message}", file=sys.stderr, flush=True)


def _run_store(store: Store, args: argparse.Namespace, skip: dict[str, str], began: float) -> Row:
    row = Row(store)
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix=f"km-bench-peers-{store.name}-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        try:
            target = stack.enter_context(store.start(Path(tmp)))
        except Exception as exc:  # not installed, or did not start: say so
            row.failure = f"not run: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            return row
        row.version = target.version
        _log(began, f"{store.name}: {target.version}")
        if store.name == "etcd" and "etcd3" not in skip:
            row.problems = _etcd3_problems(target.where)
        _log(began, f"{store.name}: uncontended")
        row.uncontended = uncontended(
            target, list(store.cases), args.pair_seconds, args.rounds, skip
        )
        contenders = [
            case
            for case in store.cases
            if case.contends and case.library not in skip
            if case.label not in row.uncontended.failed
        ]
        for round_number in range(args.rounds):
            shift = round_number % len(contenders)
            for case in contenders[shift:] + contenders[:shift]:
                if len(row.contention_failed.get(case.label, ())) >= 2:
                    continue  # broken, not unlucky: spare the time
                try:
                    run = contention(case.library, target.where, args.seconds)
                except Exception as exc:
                    why = f"round {round_number + 1}: {type(exc).__name__}: {exc}"
                    row.contention_failed.setdefault(case.label, []).append(why)
                    _log(began, f"  {case.library}: failed: {why}")
                    continue
                row.contention.setdefault(case.label, []).append(run)
                _log(
                    began,
                    f"  round {round_number + 1} {case.library}: {run['acquires/s']:,.0f}/s,"
                    f" handoff p90 {run['handoff p90']:.2f} ms, same {run['same %']:.0f} %,"
                    f" lost {run['lost']:.0f}, gave up {run['gave up']:.0f}",
                )
    row.seconds = time.monotonic() - started
    return row


# -- the report ---------------------------------------------------------------------------


LIBRARIES = [
    "keymutex",
    "tooz",
    "pals",
    "sqlalchemy",
    "psycopg2-binary",
    "psycopg",
    "pymemcache",
    "sherlock",
    "pylibmc",
    "etcd3gw",
    "etcd3",
    "protobuf",
    "grpcio",
    "tenacity",
    "httpx",
    "kazoo",
]


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _number(value: float | None, digits: int = 0) -> str:
    if value is None or value != value:  # None or NaN
        return "—"
    return f"{value:,.{digits}f}"


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _store_section(row: Row, args: argparse.Namespace) -> list[str]:
    store = row.store
    lines = [f"### {store.title}", ""]
    if row.failure:
        return [*lines, f"{row.failure}", ""]
    measured = row.uncontended
    assert measured is not None
    lines += [
        f"Server: {row.version}, on loopback. Floor: {store.floor}.",
        "",
        "Uncontended acquire + release, one client (µs):",
        "",
        "| case | round trips | median µs | p90 µs | × floor | × keymutex | pairs |",
        "|---|---|---:|---:|---:|---:|---:|",
        f"| floor: {store.floor} | 1 | {_number(measured.medians.get(FLOOR))}"
        f" | {_number(measured.p90s.get(FLOOR))} | 1.00"
        f" | {_number(measured.per_keymutex.get(FLOOR), 2)}"
        f" | {measured.pairs.get(FLOOR, 0):,} |",
    ]
    for case in store.cases:
        if case.label in measured.failed:
            lines.append(f"| {case.label} | {case.round_trips} | not run: {measured.failed[case.label]} | | | | |")  # fmt: skip
            continue
        lines.append(
            f"| {case.label} | {case.round_trips} | {_number(measured.medians.get(case.label))}"
            f" | {_number(measured.p90s.get(case.label))}"
            f" | {_number(measured.per_floor.get(case.label), 2)}"
            f" | {_number(measured.per_keymutex.get(case.label), 2)}"
            f" | {measured.pairs.get(case.label, 0):,} |"
        )
    lines += [
        "",
        f"{PROCESSES} processes on one key, critical section a read-modify-write of a counter"
        f" file, {args.seconds:g} s per run:",
        "",
        "| lock | runs | acquires/s | lost updates | overlaps | handoff p50 ms"
        " | handoff p90 ms | handoffs | same holder % | worst wait ms | gave up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in store.cases:
        if not case.contends:
            continue
        runs = row.contention.get(case.label, [])
        failed = row.contention_failed.get(case.label, [])
        if case.label in measured.failed:
            lines.append(f"| {case.label} | 0 | not run (see above) | | | | | | | | |")
            continue
        if not runs:
            why = "; ".join(failed) or "not run"
            lines.append(f"| {case.label} | 0 | failed: {why} | | | | | | | | |")
            continue

        def median(name: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(run[name] for run in runs)

        runs_text = f"{len(runs)}" + (f" ({len(failed)} failed)" if failed else "")
        lines.append(
            f"| {case.label} | {runs_text} | {_number(median('acquires/s'))}"
            f" | {sum(run['lost'] for run in runs):.0f}"
            f" | {sum(run['overlaps'] for run in runs):.0f}"
            f" | {_number(median('handoff p50'), 2)} | {_number(median('handoff p90'), 2)}"
            f" | {sum(run['handoffs'] for run in runs):,.0f}"
            f" | {_number(median('same %'))} | {_number(max(run['worst wait'] for run in runs))}"
            f" | {sum(run['gave up'] for run in runs):.0f} |"
        )
    failures = [f"{label}: {why}" for label, whys in row.contention_failed.items() for why in whys]
    if failures:
        lines += ["", "Failed runs: " + "; ".join(failures) + "."]
    lines += ["", "What each lock guarantees (from reading their code at these versions):", ""]
    lines += [f"- {note}" for note in store.notes]
    if row.problems:
        lines += ["", "python-etcd3, as shipped, in this run:", ""]
        lines += [f"- {problem}" for problem in row.problems]
    return [*lines, ""]


def report(
    rows: list[Row],
    args: argparse.Namespace,
    elapsed: float,
    load_before: str,
    install_failures: dict[str, str],
) -> str:
    pythonpath = os.environ.get("PYTHONPATH")
    command = (
        (f"PYTHONPATH={pythonpath} " if pythonpath else "")
        + f"{COMMAND} --stores {','.join(row.store.name for row in rows)}"
        f" --seconds {args.seconds:g} --rounds {args.rounds} --pair-seconds {args.pair_seconds:g}"
    )
    servers = "; ".join(f"{row.store.title}: {row.version or row.failure}" for row in rows)
    lines = [
        "## keymutex and its peers on PostgreSQL, memcached, etcd, ZooKeeper"
        " (`benchmarks/bench_peers.py`)",
        "",
        f"Run on {time.strftime('%Y-%m-%d %H:%M %Z')}: {_cpu()}, {os.cpu_count()} cores"
        f" (shared), Linux {platform.release()}, Python {platform.python_version()}; load"
        f" average at the start {load_before}, at the end {_load()}. keymutex at"
        f" {_revision()}. Whole run: {elapsed:.0f} s.",
        "",
        f"Command: `{command}`",
        "",
        "Libraries (benchmarks/.peers/peers-venv, pinned in benchmarks/peers-requirements.txt): "
        + ", ".join(f"{name} {_version(name)}" for name in LIBRARIES)
        + ".",
        "",
        f"Servers: {servers}.",
        "",
    ]
    if install_failures:
        lines += [
            "Could not be installed: "
            + "; ".join(f"{name}: {why}" for name, why in install_failures.items())
            + ".",
            "",
        ]
    lines += [
        "This machine is shared with other work and has 2 cores: absolute figures move"
        " between runs. Compare within one run: × floor and × keymutex are medians of"
        " per-round ratios, measured call by call side by side, each round on new"
        " connections (a connection's round trip depends for its whole life on where the"
        " server's thread or process that serves it runs). Contention runs rotate"
        " the order of the libraries each round; the table shows medians over runs, the"
        " sums of lost updates, overlaps and handoffs (grants to another process than the"
        " one that just released: the handoff percentiles come from these alone), and the"
        " worst wait of all runs. Acquires/s alone says little: read it with same holder %"
        " (a releaser that takes the key straight back makes a high rate and starves the"
        " others: near 100 %, one process loops alone for most of a run) and the worst wait.",
        "",
        f"Every lease or item lives {TTL_S} s where the library has a lifetime; nothing is"
        " renewed during a hold (keymutex `renew=False`; tooz's heartbeat is not started).",
        "",
    ]
    for row in rows:
        lines += _store_section(row, args)
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stores",
        default=",".join(STORE_NAMES),
        help=f"comma-separated subset of {','.join(STORE_NAMES)} (default: all)",
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="length of a contention run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each part")
    parser.add_argument(
        "--pair-seconds", type=float, default=1.5, help="length of an uncontended round"
    )
    parser.add_argument("--output", default=str(RESULTS / "peers.md"))
    args = parser.parse_args()
    chosen = [name.strip() for name in args.stores.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(STORE_NAMES))
    if unknown or not chosen:
        parser.error(f"unknown stores {unknown}; known: {', '.join(STORE_NAMES)}")

    if Path(sys.prefix).resolve() != PEERS_VENV.resolve():
        enter_peer_venv(PEERS_VENV, PEERS_FILE, KEYMUTEX_EXTRAS, __file__)  # does not return

    # python-etcd3's generated code needs it with protobuf >= 4 (_etcd3_problems says
    # what happens without); set before anything imports protobuf, and inherited by the
    # contending processes.
    os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    install_failures: dict[str, str] = (
        json.loads(FAILURES_FILE.read_text()) if FAILURES_FILE.exists() else {}
    )
    skip = {
        library: f"not installed: {install_failures[distribution]}"
        for library, distribution in DISTRIBUTIONS.items()
        if distribution in install_failures
    }
    began = time.monotonic()
    load_before = _load()
    rows = []
    for store in STORES:
        if store.name not in chosen:
            continue
        row = _run_store(store, args, skip, began)
        _log(began, f"{store.name}: {row.failure or f'{row.seconds:.0f} s'}")
        rows.append(row)
    text = report(rows, args, time.monotonic() - began, load_before, install_failures)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""PostgreSQL store against bare PostgreSQL locking: the uncontended cost, and contention.

Run: .venv/bin/python benchmarks/bench_postgresql.py [--pairs 2000] [--seconds 3]
     [--rounds 3] [--fsync]

Starts its own PostgreSQL (tests/_pg_server.py: initdb in a temporary directory,
``fsync=off`` unless ``--fsync``), on loopback, and removes it afterwards.

Uncontended: µs per acquire+release pair in one process, one after the other, next to
one ``SELECT 1`` (the floor: one round trip), a bare session advisory lock
(``pg_advisory_lock`` + ``pg_advisory_unlock``: two round trips, no writes) and a bare
lock table (``INSERT`` + compare-token ``DELETE``: two single-statement transactions).
Every case runs on autocommit connections with psycopg's prepared statements.

Contention: 4 processes loop on one key for a fixed time; the critical section is a
read-modify-write of a counter file. For each lock: acquires/s, lost updates (counter
vs acquisitions), handoff latency (a release -> the next holder's acquire in another
process, on the host's shared monotonic clock), same-holder % (consecutive holds by
the process that just released) and the worst wait of a single acquire.

Rounds interleave the cases; tables show medians over rounds. Results go to
benchmarks/results/postgresql.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import psycopg

import keymutex
from keymutex.stores.postgresql import _Steps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _pg_server import running_server  # the tests' server helper

PROCESSES = 4
WARM_UP = 200
RESULTS = Path(__file__).parent / "results"
ADVISORY_KEY = 0x5EED


def _clock() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)  # shared by all processes on the host


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# -- uncontended -------------------------------------------------------------------------


def _uncontended_cases(url: str) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """name -> (one acquire+release pair, close)."""
    cases: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {}

    floor = psycopg.connect(url, autocommit=True)

    def floor_pair() -> None:
        floor.execute("SELECT 1").fetchall()

    cases["SELECT 1 (floor: one round trip)"] = (floor_pair, floor.close)

    advisory = psycopg.connect(url, autocommit=True)

    def advisory_pair() -> None:
        advisory.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_KEY,)).fetchall()
        advisory.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_KEY,)).fetchall()

    cases["bare pg_advisory_lock + pg_advisory_unlock"] = (advisory_pair, advisory.close)

    table = psycopg.connect(url, autocommit=True)
    table.execute(
        "CREATE TABLE IF NOT EXISTS bare_locks (key text PRIMARY KEY, token text NOT NULL)"
    )

    def table_pair() -> None:
        token = uuid.uuid4().hex
        table.execute("INSERT INTO bare_locks (key, token) VALUES (%s, %s)", ("counter", token))
        table.execute("DELETE FROM bare_locks WHERE key = %s AND token = %s", ("counter", token))

    cases["bare INSERT + DELETE (lock table)"] = (table_pair, table.close)

    # keymutex's own two statements, sent by hand on one connection: what the server's
    # side costs, without the pool and the API around them.
    statements = psycopg.connect(url, autocommit=True)
    steps = _Steps("keymutex_leases", "bench-statements")
    statements.execute(steps.sql.schema)  # what a store does once, at first use

    def statements_pair() -> None:
        token = uuid.uuid4().hex
        for call in (
            steps.acquire("counter", token, 30.0, "bench", None, False, False),
            steps.release("counter", token),
        ):
            call.read(statements.execute(call.query, call.params).fetchall())

    cases["keymutex's two statements alone (one connection, no pool, no API)"] = (
        statements_pair,
        statements.close,
    )

    locks = keymutex.Locks(url, namespace="bench-uncontended", ttl=30)
    cases["**keymutex Locks: acquire() + release()**"] = (
        lambda: locks.acquire("counter", timeout=0).release(),
        locks.close,
    )

    def with_lock() -> None:
        with locks.lock("counter-renewed", timeout=0):
            pass

    cases["**keymutex Locks: with lock() (renew=True)**"] = (with_lock, lambda: None)

    loop = asyncio.new_event_loop()
    alocks = keymutex.AsyncLocks(url, namespace="bench-uncontended-async", ttl=30)

    async def async_pair() -> None:
        lease = await alocks.acquire("counter", timeout=0)
        await lease.release()

    def close_async() -> None:
        loop.run_until_complete(alocks.aclose())
        loop.close()

    cases["**keymutex AsyncLocks: acquire() + release()**"] = (
        lambda: loop.run_until_complete(async_pair()),
        close_async,
    )
    return cases


def uncontended(url: str, pairs: int, rounds: int) -> list[tuple[str, float, float]]:
    cases = _uncontended_cases(url)
    medians: dict[str, list[float]] = {name: [] for name in cases}
    p90s: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(WARM_UP):
            for pair, _close in cases.values():
                pair()
        for _ in range(rounds):
            for name, (pair, _close) in cases.items():
                times = []
                for _ in range(pairs):
                    started = time.perf_counter()
                    pair()
                    times.append((time.perf_counter() - started) * 1e6)
                medians[name].append(statistics.median(times))
                p90s[name].append(_percentile(times, 0.9))
    finally:
        for _pair, close in cases.values():
            close()
    return [
        (name, statistics.median(medians[name]), statistics.median(p90s[name])) for name in cases
    ]


# -- contention --------------------------------------------------------------------------


def _lock_factory(
    kind: str, url: str, namespace: str
) -> Callable[[], AbstractContextManager[Any]]:
    if kind == "keymutex":
        locks = keymutex.Locks(url, namespace=namespace, ttl=10.0)
        return lambda: locks.lock("counter", timeout=60, renew=False)
    if kind == "advisory":
        conn = psycopg.connect(url, autocommit=True)

        @contextmanager
        def advisory() -> Iterator[None]:
            conn.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_KEY,)).fetchall()
            try:
                yield
            finally:
                conn.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_KEY,)).fetchall()

        return advisory
    raise ValueError(kind)


def _worker(
    kind: str, url: str, namespace: str, counter: str, seconds: float, start: Any, out: Any
) -> None:
    lock = _lock_factory(kind, url, namespace)
    with lock():  # connect and warm up before the clock starts
        pass
    holds: list[tuple[float, float, float]] = []  # asked, acquired, released
    start.wait()
    deadline = _clock() + seconds
    while _clock() < deadline:
        asked = _clock()
        with lock():
            acquired = _clock()
            value = int(Path(counter).read_text() or "0")
            Path(counter).write_text(str(value + 1))
            released = _clock()
        holds.append((asked, acquired, released))
    out.put((os.getpid(), holds))


def contention(url: str, kind: str, seconds: float) -> dict[str, float]:
    context = mp.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="km-bench-pg-")
    counter = str(Path(workdir) / "counter")
    Path(counter).write_text("0")
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    start = context.Barrier(PROCESSES)
    out = context.Queue()
    processes = [
        context.Process(target=_worker, args=(kind, url, namespace, counter, seconds, start, out))
        for _ in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    results = [out.get(timeout=seconds + 120) for _ in processes]
    for process in processes:
        process.join(30)
    holds = sorted(
        (acquired, released, asked, pid)
        for pid, rows in results
        for asked, acquired, released in rows
    )
    handoffs = []
    same = overlaps = 0
    for (_, released, _, pid), (acquired, _, _, next_pid) in itertools.pairwise(holds):
        if acquired < released:
            overlaps += 1
        if next_pid == pid:
            same += 1
        else:
            handoffs.append((acquired - released) * 1e6)
    counted = int(Path(counter).read_text())
    first = min(h[2] for h in holds)
    last = max(h[1] for h in holds)
    return {
        "acquires_per_s": len(holds) / (last - first),
        "lost": len(holds) - counted,
        "overlaps": overlaps,
        "handoff_p50": _percentile(handoffs, 0.5) if handoffs else float("nan"),
        "handoff_p90": _percentile(handoffs, 0.9) if handoffs else float("nan"),
        "same_holder": 100.0 * same / max(1, len(holds) - 1),
        "worst_wait_ms": max(acquired - asked for acquired, _, asked, _ in holds) * 1e3,
        "acquires": len(holds),
    }


# -- report ------------------------------------------------------------------------------


def _server_version(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "?"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _revision() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "src"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + (" + uncommitted changes in src/" if dirty else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000, help="pairs per case and round")
    parser.add_argument("--seconds", type=float, default=3.0, help="per contention round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fsync", action="store_true", help="a durable server (fsync=on)")
    parser.add_argument("--output", default=str(RESULTS / "postgresql.md"))
    args = parser.parse_args()

    settings = {"fsync": "on", "full_page_writes": "on"} if args.fsync else {}
    began = time.monotonic()
    with running_server(settings=settings) as server:
        url = server.url
        version = _server_version(url)
        print("uncontended ...", flush=True)
        rows = uncontended(url, args.pairs, args.rounds)
        kinds = {
            "keymutex": "**keymutex Locks: with lock()**",
            "advisory": "bare pg_advisory_lock (session, blocking)",
        }
        runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
        for round_number in range(args.rounds):
            for kind in kinds:
                print(f"contention round {round_number + 1}: {kind} ...", flush=True)
                runs[kind].append(contention(url, kind, args.seconds))
    elapsed = time.monotonic() - began

    floor = rows[0][1]
    lines = [
        "## PostgreSQL: keymutex vs bare PostgreSQL locking (`benchmarks/bench_postgresql.py`)",
        "",
        f"Run on {time.strftime('%Y-%m-%d')}: {_cpu()}, {os.cpu_count()} cores, Linux"
        f" {platform.release()}, Python {platform.python_version()}; load average at the end:"
        f" {', '.join(f'{x:.2f}' for x in os.getloadavg())}. PostgreSQL {version}, on loopback"
        f" TCP, {'fsync=on' if args.fsync else 'fsync=off (as in the tests)'},"
        " synchronous_commit=on. keymutex at"
        f" {_revision()}; psycopg {psycopg.__version__}. Whole run: {elapsed:.0f} s.",
        "",
        f"Command: `.venv/bin/python benchmarks/bench_postgresql.py{' --fsync' if args.fsync else ''}"
        f" --pairs {args.pairs} --seconds {args.seconds:g} --rounds {args.rounds}`",
        "",
        f"### 1. Uncontended acquire+release, one client ({args.rounds} rounds × {args.pairs:,} pairs per case)",
        "",
        "| case | round trips | median µs | p90 µs | × floor |",
        "|---|---:|---:|---:|---:|",
    ]
    trips = {
        "SELECT 1 (floor: one round trip)": "1",
        "bare pg_advisory_lock + pg_advisory_unlock": "2",
        "bare INSERT + DELETE (lock table)": "2",
    }
    for name, median, p90 in rows:
        lines.append(
            f"| {name} | {trips.get(name, '2')} | {median:,.0f} | {p90:,.0f} | {median / floor:.2f} |"
        )
    lines += [
        "",
        f"### 2. {PROCESSES} processes on one key, critical section: read-modify-write of a counter"
        f" file (median of {args.rounds} interleaved rounds of {args.seconds:g} s)",
        "",
        "| lock | acquires/s | lost updates | overlaps | handoff p50 µs | handoff p90 µs"
        " | same holder % | worst wait ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, label in kinds.items():
        results = runs[kind]

        def median(field: str, results: list[dict[str, float]] = results) -> float:
            return statistics.median(r[field] for r in results)

        lines.append(
            f"| {label} | {median('acquires_per_s'):,.0f}"
            f" | {sum(int(r['lost']) for r in results)}"
            f" | {sum(int(r['overlaps']) for r in results)}"
            f" | {median('handoff_p50'):,.0f} | {median('handoff_p90'):,.0f}"
            f" | {median('same_holder'):.0f} | {median('worst_wait_ms'):,.0f} |"
        )
    lines += [
        "",
        "Notes:",
        "",
        "- Round trips: every keymutex step is one statement, so acquire+release is two"
        " round trips, as for the bare pairs. What costs more is what the statements do"
        " (the acquire is an upsert that also takes a transaction-scoped lock on the"
        " key's hash, draws a fence from a sequence, reads the server's clock and"
        " returns the holder; the release may NOTIFY): compare the bare lock table with"
        " keymutex's statements alone. The rest is the client: the connection pool (a"
        " check-out and check-in per step) and the API (validation, token, lease).",
        "- `lost updates` and `overlaps` are summed over all rounds (both must be 0);"
        " handoff is measured only between different processes.",
        "- keymutex waiters are woken by LISTEN/NOTIFY and race for the key (`fair` is"
        " false), so the releasing process often takes it again (`same holder %`);"
        " pg_advisory_lock queues waiters in the server's lock manager.",
        "- A session advisory lock dies with its connection and has no TTL, fence, holder"
        " information or stateless renew/release; see the PostgreSQL store's docstring.",
    ]
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""etcd store against the bare etcd requests it is made of: uncontended cost, and contention.

Run: .venv/bin/python benchmarks/bench_etcd.py [--pairs 500] [--seconds 3] [--rounds 3]

Starts its own single-member etcd (tests/_etcd_servers.py: a temporary data directory,
loopback ports) and stops it afterwards.

Uncontended: µs per acquire+release pair in one process, next to one range read (the
floor: one round trip) and the bare sequence a lease lock needs, sent by hand with the
same client (httpx on etcd's JSON gateway): lease grant + create-if-absent transaction
+ delete (three round trips; keymutex: grant + transaction + revoke, also three).

Contention: 4 processes loop on one key for a fixed time, with ``Locks.lock()``; the
critical section is a read-modify-write of a counter file. Reported: acquires/s, lost
updates (counter vs acquisitions), overlaps, handoff latency (a release -> the next
holder's grant in another process, on the host's shared monotonic clock), same-holder %.

Uncontended cases are interleaved pair by pair; tables show medians over rounds. Results go to
benchmarks/results/etcd.md.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

import keymutex

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import cpu_model as _cpu
from _common import host_clock as _clock
from _common import percentile as _percentile

from _etcd_servers import single  # the tests' server helper

PROCESSES = 4
WARM_UP = 100
RESULTS = Path(__file__).parent / "results"
FLOOR = "range read (floor: one round trip)"
BARE = "bare lease grant + txn + delete (same client)"
SYNC = "**keymutex Locks: acquire() + release()**"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# -- uncontended -------------------------------------------------------------------------


def _uncontended_cases(url: str) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """name -> (one acquire+release pair, close)."""
    base = "http://" + url.removeprefix("etcd://")
    client = httpx.Client(trust_env=False, headers={"content-type": "application/json"})

    def post(path: str, body: object) -> Any:
        reply = client.post(base + path, content=json.dumps(body).encode())
        reply.raise_for_status()
        return reply.json()

    key = _b64("bench/bare/counter")

    def floor() -> None:
        post("/v3/kv/range", {"key": key})

    def bare() -> None:
        lease = post("/v3/lease/grant", {"TTL": "30"})["ID"]
        reply = post(
            "/v3/kv/txn",
            {
                "compare": [
                    {"target": "CREATE", "key": key, "result": "EQUAL", "create_revision": "0"}
                ],
                "success": [{"request_put": {"key": key, "value": _b64("x"), "lease": lease}}],
                "failure": [{"request_range": {"key": key}}],
            },
        )
        assert reply.get("succeeded")
        post("/v3/kv/deleterange", {"key": key})

    locks = keymutex.Locks(url, namespace="bench-uncontended", ttl=30)
    loop = asyncio.new_event_loop()
    alocks = keymutex.AsyncLocks(url, namespace="bench-uncontended-async", ttl=30)

    async def async_pair() -> None:
        lease = await alocks.acquire("counter", timeout=0)
        await lease.release()

    def close_async() -> None:
        loop.run_until_complete(alocks.aclose())
        loop.close()

    return {
        FLOOR: (floor, lambda: None),
        BARE: (bare, client.close),
        SYNC: (lambda: locks.acquire("counter", timeout=0).release(), locks.close),
        "**keymutex AsyncLocks: acquire() + release()**": (
            lambda: loop.run_until_complete(async_pair()),
            close_async,
        ),
    }


def uncontended(url: str, pairs: int, rounds: int) -> list[tuple[str, float, float]]:
    cases = _uncontended_cases(url)
    medians: dict[str, list[float]] = {name: [] for name in cases}
    p90s: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(WARM_UP):
            for pair, _close in cases.values():
                pair()
        for _ in range(rounds):
            # Interleaved pair by pair: the machine is shared, and its load drifts.
            times: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(pairs):
                for name, (pair, _close) in cases.items():
                    started = time.perf_counter()
                    pair()
                    times[name].append((time.perf_counter() - started) * 1e6)
            for name in cases:
                medians[name].append(statistics.median(times[name]))
                p90s[name].append(_percentile(times[name], 0.9))
    finally:
        for _pair, close in cases.values():
            close()
    return [
        (name, statistics.median(medians[name]), statistics.median(p90s[name])) for name in cases
    ]


# -- contention --------------------------------------------------------------------------


def _worker(url: str, namespace: str, counter: str, seconds: float, start: Any, out: Any) -> None:
    with keymutex.Locks(url, namespace=namespace, ttl=10.0) as locks:
        with locks.lock("counter", timeout=60, renew=False):  # connect before the clock
            pass
        holds: list[tuple[float, float, float]] = []  # asked, acquired, released
        start.wait()
        deadline = _clock() + seconds
        while _clock() < deadline:
            asked = _clock()
            with locks.lock("counter", timeout=60, renew=False):
                acquired = _clock()
                value = int(Path(counter).read_text() or "0")
                Path(counter).write_text(str(value + 1))
                released = _clock()
            holds.append((asked, acquired, released))
    out.put((os.getpid(), holds))


def contention(url: str, seconds: float) -> dict[str, float]:
    context = mp.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="km-bench-etcd-")
    counter = str(Path(workdir) / "counter")
    Path(counter).write_text("0")
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    start = context.Barrier(PROCESSES)
    out = context.Queue()
    processes = [
        context.Process(target=_worker, args=(url, namespace, counter, seconds, start, out))
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
            handoffs.append((acquired - released) * 1e3)
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
    }


# -- report ------------------------------------------------------------------------------


def _etcd_version() -> str:
    try:
        out = subprocess.run(["etcd", "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return out.stdout.splitlines()[0].removeprefix("etcd Version: ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=500, help="pairs per case and round")
    parser.add_argument("--seconds", type=float, default=3.0, help="per contention round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=str(RESULTS / "etcd.md"))
    args = parser.parse_args()

    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="km-bench-etcd-") as tmp, single(Path(tmp)) as etcd:
        print("uncontended ...", flush=True)
        rows = uncontended(etcd.url, args.pairs, args.rounds)
        runs = []
        for round_number in range(args.rounds):
            print(f"contention round {round_number + 1} ...", flush=True)
            runs.append(contention(etcd.url, args.seconds))
    elapsed = time.monotonic() - began

    by_name = {name: median for name, median, _ in rows}
    ratio = by_name[SYNC] / by_name[BARE]

    def median(field: str) -> float:
        return statistics.median(r[field] for r in runs)

    lines = [
        "## etcd: keymutex vs the bare etcd requests (`benchmarks/bench_etcd.py`)",
        "",
        f"Run on {time.strftime('%Y-%m-%d')}: {_cpu()}, {os.cpu_count()} cores (shared),"
        f" Linux {platform.release()}, Python {platform.python_version()}; load average at"
        f" the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}. etcd {_etcd_version()},"
        f" one member, loopback, data in a temporary directory; httpx {httpx.__version__}."
        f" Whole run: {elapsed:.0f} s.",
        "",
        f"Command: `.venv/bin/python benchmarks/bench_etcd.py --pairs {args.pairs}"
        f" --seconds {args.seconds:g} --rounds {args.rounds}`",
        "",
        f"### 1. Uncontended acquire+release, one client ({args.rounds} rounds ×"
        f" {args.pairs:,} pairs per case)",
        "",
        "| case | round trips | median µs | p90 µs | × bare |",
        "|---|---:|---:|---:|---:|",
    ]
    trips = {FLOOR: "1", BARE: "3"}
    for name, med, p90 in rows:
        lines.append(
            f"| {name} | {trips.get(name, '3')} | {med:,.0f} | {p90:,.0f}"
            f" | {med / by_name[BARE]:.2f} |"
        )
    lines += [
        "",
        f"keymutex Locks / bare sequence: **{ratio:.2f} ×** (goal ≤ 1.5)",
        "",
        f"### 2. {PROCESSES} processes on one key, `with locks.lock()`, critical section:"
        f" read-modify-write of a counter file (median of {args.rounds} rounds of"
        f" {args.seconds:g} s)",
        "",
        "| acquires/s | lost updates | overlaps | handoff p50 ms | handoff p90 ms"
        " | same holder % | worst wait ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {median('acquires_per_s'):,.0f} | {sum(int(r['lost']) for r in runs)}"
        f" | {sum(int(r['overlaps']) for r in runs)} | {median('handoff_p50'):.2f}"
        f" | {median('handoff_p90'):.2f} | {median('same_holder'):.0f}"
        f" | {median('worst_wait_ms'):,.0f} |",
        "",
        f"Handoff p90: **{median('handoff_p90'):.2f} ms** (goal ≤ 10 ms)",
        "",
        "Notes:",
        "",
        "- Every write (grant, transaction, revoke) is a raft entry fsynced to etcd's WAL"
        " before the reply: the disk's fsync latency is most of each round trip.",
        "- keymutex's acquire is the bare grant + transaction; its release is one revoke"
        " (etcd deletes the key with its lease), where the bare delete leaves its lease"
        " to expire: three round trips each. The rest is the API (validation, token,"
        " lease object) and JSON.",
        "- `lost updates` and `overlaps` are summed over all rounds (both must be 0);"
        " handoff is measured only between different processes: a release's deletion"
        " reaches the waiters through their watch stream, and they race for the key"
        " (`fair` is false).",
    ]
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

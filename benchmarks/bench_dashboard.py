"""Open dashboards against a large namespace: the lock API's latency, and what they cost.

Run: .venv/bin/python benchmarks/bench_dashboard.py [--leases 10000] [--seconds 8]
         [--baseline-src DIR]

A lock server on a SQLite store of its own (``python -m keymutex serve --port 0``) holds
``--leases`` leases in one namespace (keys ``order:NNNNN``, a small info each), written
straight into its store file. Then, for 0, 1 and 4 open dashboards (each one
``GET /v1/events`` stream of the namespace, read by a thread that counts its bytes and
snapshots), one client renews one lease of the namespace over HTTP every 0.1 s for
``--seconds``: each renewal is a change that every stream is told of. Reported: the
renewals' latency (median, p99, max) and each stream's snapshots and bytes per second.
The issue-4 goal this reads with: the server stays responsive while dashboards watch.
``--baseline-src DIR`` (the ``src`` of another checkout, e.g. a ``git worktree`` of an
earlier commit) runs the same rows against a server of that code, in the same run.

Found by review (2026-11-28): each stream read and encoded the whole namespace on its
own after every change, 2 MB a snapshot at 10,000 leases; four open dashboards made a
renewal take half a second. Streams now share each read, carry 500 rows at most, and
a large namespace is read a tenth of the time at most.
Results: benchmarks/results/dashboard.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
from _common import percentile, revision
from bench_server import LockServer

import keymutex

RESULTS = Path(__file__).resolve().parent / "results"
NAMESPACE = "bench"
RENEW_EVERY = 0.1
STREAMS = (0, 1, 4)


def populate(store_url: str, leases: int) -> str:
    """``leases`` leases held for an hour; the token of the first (the one renewed)."""
    with keymutex.Locks(store_url, namespace=NAMESPACE, ttl=3600) as locks:
        first = locks.acquire("order:00000", info={"customer": 0, "host": "bench"})
        for n in range(1, leases):
            locks.acquire(f"order:{n:05d}", info={"customer": n, "host": "bench"})
        return first.token


class Stream(threading.Thread):
    """One dashboard: the namespace's event stream, its bytes and snapshots counted."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.bytes = 0
        self.snapshots = 0
        self.stop = threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        params = {"namespace": NAMESPACE}
        with (
            httpx.Client(timeout=60) as client,
            client.stream("GET", f"{self.url}/v1/events", params=params) as events,
        ):
            for chunk in events.iter_raw():
                self.bytes += len(chunk)
                self.snapshots += chunk.count(b"event: holders")
                self.ready.set()
                if self.stop.is_set():
                    return


def measure(url: str, token: str, streams: int, seconds: float) -> dict[str, float]:
    readers = [Stream(url) for _ in range(streams)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.ready.wait(60)
    started = time.monotonic()
    before = [(r.bytes, r.snapshots) for r in readers]
    latencies = []
    with keymutex.Locks(url, namespace=NAMESPACE) as locks:
        while time.monotonic() - started < seconds:
            sent = time.perf_counter()
            locks.renew("order:00000", token, ttl=3600)
            latencies.append(time.perf_counter() - sent)
            time.sleep(max(0.0, RENEW_EVERY - (time.perf_counter() - sent)))
    elapsed = time.monotonic() - started
    for reader in readers:
        reader.stop.set()
    per_stream = [
        ((r.bytes - b) / elapsed, (r.snapshots - s) / elapsed)
        for r, (b, s) in zip(readers, before, strict=True)
    ]
    return {
        "renewals": len(latencies),
        "p50": statistics.median(latencies) * 1000,
        "p99": percentile(latencies, 0.99) * 1000,
        "max": max(latencies) * 1000,
        "bytes": statistics.mean(b for b, _ in per_stream) if per_stream else 0.0,
        "snapshots": statistics.mean(s for _, s in per_stream) if per_stream else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--baseline-src", help="the src directory of another checkout")
    args = parser.parse_args()
    servers = {"this checkout": None}
    if args.baseline_src:
        servers[f"baseline ({args.baseline_src})"] = str(Path(args.baseline_src).resolve())
    rows: dict[tuple[str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="keymutex-bench-dashboard-") as directory:
        store_url = f"sqlite:///{directory}/locks.db"
        token = populate(store_url, args.leases)
        for name, src in servers.items():
            server = LockServer(store_url, Path(directory))
            if src is not None:
                server._env = {**os.environ, "PYTHONPATH": src}
            with server:
                with httpx.Client(timeout=60) as probe:
                    answer = probe.get(f"{server.url}/v1/holders", params={"namespace": NAMESPACE})
                    size = len(answer.content)
                for streams in STREAMS:
                    rows[name, streams] = measure(server.url, token, streams, args.seconds)
    lines = [
        "## Lock server: open dashboards on a large namespace (`benchmarks/bench_dashboard.py`)",
        "",
        f"Run on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC: Python"
        f" {platform.python_version()}, {os.cpu_count()} cores; keymutex at {revision()}."
        f" One namespace of {args.leases:,} leases on SQLite (`GET /v1/holders` of it:"
        f" {size / 1e6:.1f} MB); a client renews one of them over HTTP every {RENEW_EVERY} s"
        f" for {args.seconds:g} s per row, while 0, 1 or 4 dashboards (`GET /v1/events`"
        " streams) watch the namespace.",
        "",
        "| server | open dashboards | renewals | renewal p50 ms | p99 ms | max ms"
        " | snapshots/s per dashboard | KB/s per dashboard |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (name, streams), row in rows.items():
        lines.append(
            f"| {name} | {streams} | {row['renewals']:.0f} | {row['p50']:.1f}"
            f" | {row['p99']:.1f} | {row['max']:.1f} | {row['snapshots']:.1f}"
            f" | {row['bytes'] / 1000:,.0f} |"
        )
    command = ".venv/bin/python benchmarks/bench_dashboard.py"
    if args.baseline_src:
        command += f" --baseline-src {args.baseline_src}"
    lines += ["", f"Command: `{command}`"]
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dashboard.md").write_text(table)


if __name__ == "__main__":
    main()

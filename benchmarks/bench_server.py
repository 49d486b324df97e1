"""The lock server (``keymutex serve``) against the store it serves, on SQLite and Redis.

Run: .venv/bin/python benchmarks/bench_server.py [--quick]

One command starts everything it measures, and stops it at the end: a redis-server on a
free loopback port (``--save '' --appendonly no``, see redis_server.py), and two lock
servers started as users start them (``python -m keymutex serve --port 0 --store URL``),
one on a SQLite file in a temp dir and one on that Redis. Their output goes to a log
file that the URL is read from (never a pipe nobody reads).

Measured in one run, both backends side by side (and, unless ``--no-plain``, a third lock
server on SQLite with uvloop and httptools hidden, so that uvicorn runs asyncio and h11:
what the server's stack is worth, in the same run):
1. one client, acquire+release pairs: ``Locks("http://…")``, and raw POSTs on a
   persistent ``httpx.Client`` and on httpx's own transport layer, an
   ``httpcore.ConnectionPool`` (the HTTP floors), against ``Locks`` on the server's own
   store (same SQLite file, same Redis). Median and p90 µs, the ratio to direct, and
   CPU per pair (client; lock server), which shared-machine noise moves far less than
   wall time. Rounds interleave the cases. Goal: HTTP ≤ 3 × direct.
2. 32 clients (asyncio tasks in one child process, each with its own
   ``AsyncLocks("http://…")``), each on its own key and then all on 4 keys: pairs/s,
   p50/p99 pair latency, fairness on the shared keys (same holder %: consecutive grants
   of a key to the client that just released it), HTTP requests per pair (from the
   server's ``/metrics``), CPU of each process. Meanwhile a probe in this process asks
   ``/``, ``/metrics`` and ``/v1/holders`` every 100 ms. Goal: each answers within
   100 ms during the load (max and p99).
3. long-poll wake-up: a thread waits in ``POST /v1/wait`` (raw httpx) or in
   ``Locks("http://…").acquire(key, timeout=10)`` on a key this thread holds; once the
   server counts it as waiting, the holder releases. Time from the release call
   returning to the waiter's answer (``time.monotonic``, one process), over the
   trials. Goal: median ≤ 5 ms.
Results: benchmarks/results/server.md.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime
import importlib.metadata
import itertools
import json
import multiprocessing as mp
import os
import platform
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpcore
import httpx
from redis_server import RedisServer

import keymutex

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
COMMAND = ".venv/bin/python benchmarks/bench_server.py"
LISTENING = re.compile(r"keymutex server on (http://\S+?)/? ")
START_TIMEOUT = 30.0
CLIENTS = 32
HOT_KEYS = 4
PROBE_EVERY = 0.1  # seconds between two probes of the three pages
PROBE_PATHS = ("/", "/metrics", "/v1/holders")
LOADS = {  # part 2's variants: what the 32 clients do
    "own": "own keys, `AsyncLocks`",
    "hot": f"{HOT_KEYS} keys, `AsyncLocks`",
    "server-wait": f"{HOT_KEYS} keys, httpx acquire with `timeout`",
}
LATENCY_GOAL = 3.0  # HTTP pair / direct pair
PROBE_GOAL_MS = 100.0
WAKEUP_GOAL_MS = 5.0
PLAIN_HIDES = ("uvloop", "httptools")  # hidden from the --plain server
PLAIN = "SQLite, asyncio+h11"
TICKS = os.sysconf("SC_CLK_TCK")
REQUEST_COUNT = re.compile(
    r'^keymutex_http_request_duration_seconds_count\{method="(\w+)",route="([^"]+)",'
    r'status="(\d+)"\} ([0-9.e+]+)$',
    re.M,
)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _cpu_wait_seconds(pid: int) -> float:
    """Time the process's live threads spent runnable but waiting for a CPU (schedstat).

    On a shared machine this is the time other tenants took from us: it says how much
    of a wall-clock figure is the machine's load rather than the code.
    """
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, by the nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def _fmt(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def _verdict(value: float, bound: float) -> str:
    return "met" if value <= bound else "missed"


# -- the servers ----------------------------------------------------------------------


class LockServer:
    """``python -m keymutex serve --port 0 --store URL``, its output in a log file.

    ``hide``: packages made to fail on import in the server (a directory of stand-ins
    first on its ``PYTHONPATH``), as if they were not installed.
    """

    def __init__(self, store_url: str, directory: Path, hide: tuple[str, ...] = ()) -> None:
        self.store_url = store_url
        self.log = directory / "server.log"
        self.url = ""
        self._env: dict[str, str] | None = None
        if hide:
            for name in hide:
                (directory / "hidden" / name).mkdir(parents=True)
                (directory / "hidden" / name / "__init__.py").write_text(
                    f"raise ImportError('{name} is hidden by the benchmark')\n"
                )
            self._env = {**os.environ, "PYTHONPATH": str(directory / "hidden")}
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LockServer:
        with self.log.open("wb") as output:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "keymutex",
                    "serve",
                    "--port",
                    "0",
                    "--store",
                    self.store_url,
                ],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                env=self._env,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while (found := LISTENING.search(self.log.read_text(errors="replace"))) is None:
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise SystemExit(f"keymutex serve did not start:\n{self.log.read_text()}")
            time.sleep(0.02)
        self.url = found.group(1)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._process is None:
            return
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def request_counts(self) -> Counter[str]:
        """Requests answered so far, by route template (the server's own /metrics)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        counts: Counter[str] = Counter()
        for _method, route, _status, value in REQUEST_COUNT.findall(text):
            counts[route] += round(float(value))
        return counts


@dataclass
class Backend:
    """One store, the lock server on it, and what the parts measured there."""

    name: str
    store_url: str
    server: LockServer
    store_pid: int | None  # redis-server's, to read its CPU; None for SQLite (in-process)
    latency: dict[str, list[float]] = field(default_factory=dict)
    latency_cpu: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    load: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    probes_idle: dict[str, list[float]] = field(default_factory=dict)
    wakeups: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


# -- part 1: one client ------------------------------------------------------------------


def _pair_makers(backend: Backend) -> dict[str, Callable[[], Callable[[], None]]]:
    """Case name -> a function that opens the case's clients and returns one pair."""
    url = backend.server.url
    scheme = backend.store_url.split(":", 1)[0]

    def direct() -> Callable[[], None]:
        locks = keymutex.Locks(backend.store_url, ttl=30.0)
        return lambda: locks.acquire("direct", timeout=0).release()

    def http_locks() -> Callable[[], None]:
        locks = keymutex.Locks(url, ttl=30.0)
        return lambda: locks.acquire("http-locks", timeout=0).release()

    def http_raw() -> Callable[[], None]:
        client = httpx.Client(base_url=url, timeout=10)

        def pair() -> None:
            lease = client.post("/v1/acquire", json={"key": "http-raw", "ttl": 30})
            token = lease.raise_for_status().json()["token"]
            client.post("/v1/release", json={"key": "http-raw", "token": token}).raise_for_status()

        return pair

    def http_core() -> Callable[[], None]:
        pool = httpcore.ConnectionPool()
        headers = [
            (b"Host", url.split("//", 1)[1].encode()),
            (b"Content-Type", b"application/json"),
        ]

        def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            reply = pool.request(
                "POST", f"{url}{path}", headers=headers, content=json.dumps(body).encode()
            )
            if reply.status != 200:
                raise RuntimeError(f"{path} answered {reply.status}")
            answer: dict[str, Any] = json.loads(reply.content)
            return answer

        def pair() -> None:
            token = post("/v1/acquire", {"key": "http-core", "ttl": 30})["token"]
            post("/v1/release", {"key": "http-core", "token": token})

        return pair

    def http_no_store() -> Callable[[], None]:
        client = httpx.Client(base_url=url, timeout=10)

        def pair() -> None:
            for _ in range(2):
                if client.get("/v1/no-such-route").status_code != 404:
                    raise RuntimeError("expected 404")

        return pair

    return {
        f"direct: Locks('{scheme}://…')": direct,
        "HTTP: Locks('http://…')": http_locks,
        "HTTP floor: httpx POST acquire + release": http_raw,
        "HTTP floor: httpcore POST acquire + release": http_core,
        "HTTP, no store: 2 × GET of a 404 (httpx)": http_no_store,
    }


def part_latency(
    backends: list[Backend], rounds: int, pairs: int, log: Callable[[str], None]
) -> None:
    pairs_of = {b.name: {c: make() for c, make in _pair_makers(b).items()} for b in backends}
    for round_ in range(rounds):
        for backend in backends:
            for case, pair in pairs_of[backend.name].items():
                for _ in range(20):  # warm: connections, prepared statements, scripts
                    pair()
                samples = backend.latency.setdefault(case, [])
                pids = (os.getpid(), backend.server.pid)
                client_cpu, server_cpu = time.process_time(), _cpu_seconds(backend.server.pid)
                cpu_wait = sum(map(_cpu_wait_seconds, pids))
                for _ in range(pairs):
                    started = time.perf_counter()
                    pair()
                    samples.append(time.perf_counter() - started)
                backend.latency_cpu.setdefault(case, []).append(
                    (
                        time.process_time() - client_cpu,
                        _cpu_seconds(backend.server.pid) - server_cpu,
                        sum(map(_cpu_wait_seconds, pids)) - cpu_wait,
                    )
                )
        log(
            f"  round {round_ + 1}: "
            + ", ".join(
                f"{b.name} {c.split(':')[0]} {statistics.median(s[-pairs:]) * 1e6:,.0f} µs"
                for b in backends
                for c, s in b.latency.items()
            )
        )


# -- part 2: 32 clients, and the probe ------------------------------------------------------


def _load_child(
    url: str, keys: list[str], server_wait: bool, seconds: float, ready: Any, go: Any, out: Any
) -> None:
    """In a child process: one client per key of ``keys``, looping acquire+release."""
    out.put(asyncio.run(_load(url, keys, server_wait, seconds, ready, go)))


class _ServerWaitClient:
    """A client that waits at the server: ``POST /v1/acquire`` with a ``timeout``.

    Not what ``AsyncLocks("http://…")`` does (it tries with ``timeout: 0``, then long
    polls ``/v1/wait``); measured to show what the server's own queue gives.
    """

    def __init__(self, url: str) -> None:
        self._client = httpx.AsyncClient(base_url=url, timeout=60)

    async def pair(self, key: str) -> tuple[float, int]:
        reply = await self._client.post("/v1/acquire", json={"key": key, "ttl": 30, "timeout": 30})
        lease = reply.raise_for_status().json()
        granted = time.monotonic()
        release = {"key": key, "token": lease["token"]}
        (await self._client.post("/v1/release", json=release)).raise_for_status()
        return granted, lease["fence"]

    async def aclose(self) -> None:
        await self._client.aclose()


class _LocksClient:
    """A client of its own: ``AsyncLocks("http://…")``."""

    def __init__(self, url: str) -> None:
        self._locks = keymutex.AsyncLocks(url, ttl=30.0)

    async def pair(self, key: str) -> tuple[float, int]:
        lease = await self._locks.acquire(key, timeout=30)
        granted = time.monotonic()
        await lease.release()
        return granted, lease.fence

    async def aclose(self) -> None:
        await self._locks.aclose()


async def _load(
    url: str, keys: list[str], server_wait: bool, seconds: float, ready: Any, go: Any
) -> dict[str, Any]:
    kind = _ServerWaitClient if server_wait else _LocksClient
    clients = [kind(url) for _ in keys]
    for client, key in zip(clients, keys, strict=True):  # warm: connection and /healthz
        await client.pair(key)
    ready.set()
    await asyncio.to_thread(go.wait)
    samples: list[tuple[int, str, int, float, float, float]] = []
    cpu = time.process_time()
    started = time.monotonic()
    stop_at = started + seconds

    async def loop(number: int, client: _LocksClient | _ServerWaitClient, key: str) -> None:
        while (asked := time.monotonic()) < stop_at:
            granted, fence = await client.pair(key)
            samples.append((number, key, fence, asked, granted, time.monotonic()))

    await asyncio.gather(
        *(loop(i, c, k) for i, (c, k) in enumerate(zip(clients, keys, strict=True)))
    )
    ended = time.monotonic()
    cpu = time.process_time() - cpu
    for client in clients:
        await client.aclose()
    return {"samples": samples, "started": started, "ended": ended, "cpu": cpu}


def _probe(url: str, stop: threading.Event) -> dict[str, list[float]]:
    """Each of ``PROBE_PATHS`` every ``PROBE_EVERY`` until ``stop``: seconds per answer."""
    answers: dict[str, list[float]] = {path: [] for path in PROBE_PATHS}
    with httpx.Client(base_url=url, timeout=30) as client:
        next_at = time.monotonic()
        while not stop.is_set():
            for path in PROBE_PATHS:
                started = time.perf_counter()
                client.get(path).raise_for_status()
                answers[path].append(time.perf_counter() - started)
            next_at += PROBE_EVERY
            stop.wait(max(0.0, next_at - time.monotonic()))
    return answers


def _same_holder_percent(samples: list[tuple[int, str, int, float, float, float]]) -> float:
    """Consecutive grants of a key (in fence order) to the client that had it before."""
    by_key: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for number, key, fence, *_ in samples:
        by_key[key].append((fence, number))
    same = pairs = 0
    for grants in by_key.values():
        grants.sort()
        for (_, a), (_, b) in itertools.pairwise(grants):
            same += a == b
            pairs += 1
    return 100.0 * same / max(1, pairs)


def load_run(backend: Backend, variant: str, seconds: float) -> dict[str, Any]:
    keys = (
        [f"own-{i}" for i in range(CLIENTS)]
        if variant == "own"
        else [f"{variant}-{i % HOT_KEYS}" for i in range(CLIENTS)]
    )
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(
        target=_load_child,
        args=(backend.server.url, keys, variant == "server-wait", seconds, ready, go, out),
    )
    child.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the load process did not get ready")
        before = backend.server.request_counts()
        stop = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            cpu_before = {
                "server wait": _cpu_wait_seconds(backend.server.pid),
                "server": _cpu_seconds(backend.server.pid),
                "store": _cpu_seconds(backend.store_pid) if backend.store_pid else 0.0,
            }
            probe = pool.submit(_probe, backend.server.url, stop)
            go.set()
            result = out.get(timeout=seconds + 120)
            stop.set()
            probes = probe.result()
        cpu = {
            "server wait": _cpu_wait_seconds(backend.server.pid) - cpu_before["server wait"],
            "server": _cpu_seconds(backend.server.pid) - cpu_before["server"],
            "store": (_cpu_seconds(backend.store_pid) if backend.store_pid else 0.0)
            - cpu_before["store"],
            "clients": result["cpu"],
        }
        after = backend.server.request_counts()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    samples = result["samples"]
    elapsed = result["ended"] - result["started"]
    pair_ms = [(done - asked) * 1e3 for *_, asked, _, done in samples]
    waits_ms = [(granted - asked) * 1e3 for *_, asked, granted, _ in samples]
    count = len(samples)
    return {
        "pairs/s": count / elapsed,
        "pair p50 ms": statistics.median(pair_ms),
        "pair p99 ms": _quantile(pair_ms, 0.99),
        "worst wait ms": max(waits_ms),
        "same holder %": None if variant == "own" else _same_holder_percent(samples),
        "acquire requests/pair": (after["/v1/acquire"] - before["/v1/acquire"]) / count,
        "wait requests/pair": (after["/v1/wait"] - before["/v1/wait"]) / count,
        "server CPU %": 100 * cpu["server"] / elapsed,
        "server waiting for a CPU %": 100 * cpu["server wait"] / elapsed,
        "store CPU %": 100 * cpu["store"] / elapsed,
        "clients CPU %": 100 * cpu["clients"] / elapsed,
        "server CPU µs/pair": 1e6 * cpu["server"] / count,
        "probes": probes,
    }


def probe_idle(backend: Backend, seconds: float) -> None:
    with httpx.Client(base_url=backend.server.url, timeout=30) as client:
        for path in PROBE_PATHS:  # warm: first answers (files opened, modules imported)
            client.get(path).raise_for_status()
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    for path, answers in _probe(backend.server.url, stop).items():
        backend.probes_idle.setdefault(path, []).extend(answers)


# -- part 3: long-poll wake-up --------------------------------------------------------------


def _waiter_raw(client: httpx.Client, key: str, fence: int) -> tuple[float, None]:
    reply = client.post("/v1/wait", json={"key": key, "fence": fence, "timeout": 10})
    answered = time.monotonic()
    if not reply.raise_for_status().json()["changed"]:
        raise RuntimeError("the wait timed out")
    return answered, None


def _waiter_locks(locks: keymutex.Locks, key: str, fence: int) -> tuple[float, keymutex.Lease]:
    lease = locks.acquire(key, timeout=10)
    return time.monotonic(), lease


def wakeup_trials(backend: Backend, variant: str, trials: int) -> None:
    """``trials`` hand-overs: (release call's duration, release returned -> waiter answered).

    ``variant``: the waiter in ``wait`` (raw ``/v1/wait``) or ``acquire`` (``Locks``), the
    holder a ``Locks`` of the server; or ``direct``: a raw ``/v1/wait`` while the holder
    is a ``Locks`` on the server's store itself, not going through the server.
    """
    url = backend.server.url
    key = f"wake-{variant}"
    holder = keymutex.Locks(backend.store_url if variant == "direct" else url, ttl=30.0)
    watcher = httpx.Client(base_url=url, timeout=10)
    waiter_client: Any = (
        keymutex.Locks(url, ttl=30.0)
        if variant == "acquire"
        else httpx.Client(base_url=url, timeout=30)
    )
    wait = _waiter_locks if variant == "acquire" else _waiter_raw
    samples = backend.wakeups.setdefault(variant, [])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for _ in range(trials):
            lease = holder.acquire(key, timeout=5)
            answer = pool.submit(wait, waiter_client, key, lease.fence)
            deadline = time.monotonic() + 10
            while watcher.get("/v1/holders", params={"prefix": key}).json()["waiting"] != {key: 1}:
                if answer.done() or time.monotonic() > deadline:
                    answer.result()
                    raise RuntimeError("the waiter never waited at the server")
                time.sleep(0.001)
            time.sleep(0.005)  # parked, not just counted
            asked = time.monotonic()
            lease.release()
            returned = time.monotonic()
            answered, taken = answer.result(timeout=30)
            samples.append((returned - asked, answered - returned))
            if taken is not None:
                taken.release()
    watcher.close()
    waiter_client.close()
    holder.close()


# -- the report ------------------------------------------------------------------------------


def _versions() -> str:
    names = ["keymutex", "uvicorn", "starlette", "h11", "httpx", "httpcore", "redis", "hiredis"]
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    for name in ("uvloop", "httptools"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name} {importlib.metadata.version(name)}")
    return ", ".join(found)


def _machine(load_at_start: tuple[float, ...]) -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    loads = (
        ", ".join(f"{x:.2f}" for x in load_at_start),
        ", ".join(f"{x:.2f}" for x in os.getloadavg()),
    )
    return (
        f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()},"
        f" Python {platform.python_version()}, SQLite {sqlite3.sqlite_version};"
        f" load average at the start {loads[0]}, at the end {loads[1]}"
    )


def _git_revision() -> str:
    try:
        head = subprocess.run(
            ["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(HERE.parent), "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} + uncommitted changes in src/" if dirty else head


def _median_of(runs: list[dict[str, Any]], column: str) -> float:
    return statistics.median(run[column] for run in runs)


def report(
    backends: list[Backend], args: argparse.Namespace, context: dict[str, Any]
) -> tuple[str, list[str]]:
    """The markdown, and the goal lines (for the terminal too)."""
    goals: list[str] = []
    lines = [
        "## Lock server: HTTP against its own store, SQLite and Redis (`benchmarks/bench_server.py`)",
        "",
        f"Run on {datetime.date.today()}: {context['machine']}. redis-server"
        f" {context['redis_version']} (Debian) on loopback, `--save '' --appendonly no`; the"
        " SQLite store in a temp dir (default `synchronous=normal`, WAL). keymutex at"
        f" {_git_revision()}. Whole run: {context['seconds']:.0f} s.",
        "",
        f"Command: `{COMMAND}{' ' + ' '.join(args.argv) if args.argv else ''}`",
        "",
        f"Versions: {_versions()}. The servers are started as users start them: `python -m"
        " keymutex serve --port 0 --store URL` (uvicorn's defaults: `loop` and `http` `auto`,"
        " which take uvloop and httptools when they are installed (see Versions) and asyncio"
        " and h11 otherwise; no access log, `serve`'s default; its log to a file)."
        + (
            f" *{PLAIN}*: the same server on a SQLite file of its own, with"
            f" {' and '.join(PLAIN_HIDES)} hidden (stand-ins that fail to import first on its"
            " `PYTHONPATH`), as where they are not installed."
            if args.plain
            else ""
        ),
        "",
        "The machine is shared (see the load averages, and the columns *waiting for a CPU*:"
        " time other tenants took): compare ratios and CPU per pair within a table, not"
        " absolute times across runs.",
        "",
        f"### 1. One client, acquire+release pairs ({args.rounds} interleaved rounds × {args.pairs} pairs per case)",
        "",
        "CPU µs/pair: user+system time over the case's pairs, of this process (client)"
        " and of the lock server process; they move far less with the machine's load than"
        " wall time does. Waiting for a CPU: time the threads of both were runnable but not"
        " running (`/proc/PID/task/*/schedstat`): what other tenants of the machine took.",
        "",
        "| store | case | median µs | p90 µs | × direct | client CPU µs/pair |"
        " server CPU µs/pair | waiting for a CPU µs/pair |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for backend in backends:
        cases = list(backend.latency)
        direct = statistics.median(backend.latency[cases[0]])
        for case in cases:
            samples = backend.latency[case]
            median = statistics.median(samples)
            total = args.pairs * len(backend.latency_cpu[case])
            client_cpu = sum(c for c, _, _ in backend.latency_cpu[case]) / total
            server_cpu = sum(s for _, s, _ in backend.latency_cpu[case]) / total
            cpu_wait = sum(w for _, _, w in backend.latency_cpu[case]) / total
            lines.append(
                f"| {backend.name} | {case} | {_fmt(median * 1e6)} |"
                f" {_fmt(_quantile(samples, 0.9) * 1e6)} | {median / direct:,.1f} |"
                f" {_fmt(client_cpu * 1e6)} |"
                f" {'—' if case.startswith('direct') else _fmt(server_cpu * 1e6)} |"
                f" {_fmt(cpu_wait * 1e6)} |"
            )
        http = statistics.median(backend.latency["HTTP: Locks('http://…')"]) / direct
        floor = statistics.median(backend.latency[cases[2]]) / direct
        core = statistics.median(backend.latency[cases[3]]) / direct
        goals.append(
            f"1. {backend.name}: Locks('http://…') / direct = **{http:,.1f} ×** (httpx floor"
            f" {floor:,.1f} ×, httpcore floor {core:,.1f} ×); goal ≤ {LATENCY_GOAL:g} ×:"
            f" **{_verdict(http, LATENCY_GOAL)}**"
        )
    lines += [
        "",
        f"### 2. {CLIENTS} clients on the server (asyncio tasks in one process, each with a"
        f" client of its own), median of {args.load_rounds} interleaved rounds of"
        f" {args.seconds:g} s",
        "",
        "A pair: acquire until granted, then release at once. Own keys: each client on a"
        f" key of its own. {HOT_KEYS} keys: {CLIENTS // HOT_KEYS} clients per key."
        " `AsyncLocks('http://…').acquire(key, timeout=30)` is what Python users run: a"
        " try (`/v1/acquire` with `timeout: 0`), and when refused `/v1/acquire` again with"
        " the same token and a `timeout` (a long poll at the server). For comparison, raw"
        " httpx clients that wait *at the server* (`/v1/acquire` with `timeout: 30`, which"
        " queues in the server's `AsyncLocks`)."
        " Same holder %: consecutive grants of a key (in fence order) to the client that"
        " just released it. Requests per pair: from the server's own `/metrics`. CPU %"
        " (of one core) over the run: the lock server, redis-server, and the process of"
        f" the {CLIENTS} clients; waiting for a CPU: the server's threads runnable but not"
        " running (other tenants, or our own clients, had the cores).",
        "",
        "| store | clients | pairs/s | pair p50 ms | pair p99 ms | worst wait ms | same holder % |"
        " acquire req/pair | wait req/pair | server CPU µs/pair | server CPU % |"
        " server waiting for a CPU % | redis CPU % |"
        " clients CPU % |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for backend in backends:
        for variant, runs in backend.load.items():
            same = None if variant == "own" else _median_of(runs, "same holder %")
            lines.append(
                f"| {backend.name} | {LOADS[variant]} |"
                f" {_fmt(_median_of(runs, 'pairs/s'))} |"
                f" {_fmt(_median_of(runs, 'pair p50 ms'), 1)} |"
                f" {_fmt(_median_of(runs, 'pair p99 ms'), 1)} |"
                f" {_fmt(max(r['worst wait ms'] for r in runs), 1)} |"
                f" {'—' if same is None else _fmt(same, 1)} |"
                f" {_fmt(_median_of(runs, 'acquire requests/pair'), 2)} |"
                f" {_fmt(_median_of(runs, 'wait requests/pair'), 2)} |"
                f" {_fmt(_median_of(runs, 'server CPU µs/pair'))} |"
                f" {_fmt(_median_of(runs, 'server CPU %'))} |"
                f" {_fmt(_median_of(runs, 'server waiting for a CPU %'))} |"
                f" {_fmt(_median_of(runs, 'store CPU %')) if backend.store_pid else '—'} |"
                f" {_fmt(_median_of(runs, 'clients CPU %'))} |"
            )
    lines += [
        "",
        f"Worst wait: the longest acquire of any round. The probe (a separate client in"
        f" the benchmark's process) asks each page every {PROBE_EVERY * 1e3:g} ms, one after"
        " the other; ms per answer, all rounds pooled (idle: before the loads, no other"
        " request):",
        "",
        "| store | load | page | answers | p50 ms | p99 ms | max ms |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for backend in backends:
        for path in PROBE_PATHS:
            idle = [s * 1e3 for s in backend.probes_idle[path]]
            lines.append(
                f"| {backend.name} | idle | `{path}` | {len(idle)} |"
                f" {_fmt(statistics.median(idle), 1)} | {_fmt(_quantile(idle, 0.99), 1)} |"
                f" {_fmt(max(idle), 1)} |"
            )
        for variant, runs in backend.load.items():
            worst = []
            for path in PROBE_PATHS:
                answers = [s * 1e3 for run in runs for s in run["probes"][path]]
                p99, top = _quantile(answers, 0.99), max(answers)
                worst.append((top, p99, path))
                lines.append(
                    f"| {backend.name} | {LOADS[variant]} | `{path}` | {len(answers)} | {_fmt(statistics.median(answers), 1)} |"
                    f" {_fmt(p99, 1)} | {_fmt(top, 1)} |"
                )
            top, p99, path = max(worst)
            worst_p99 = max(w[1] for w in worst)
            goals.append(
                f"2. {backend.name}, {CLIENTS} clients ({LOADS[variant]}): pages' worst p99"
                f" {worst_p99:,.1f} ms, worst max {top:,.1f} ms (`{path}`); goal ≤"
                f" {PROBE_GOAL_MS:g} ms: p99 **{_verdict(worst_p99, PROBE_GOAL_MS)}**, max"
                f" **{_verdict(top, PROBE_GOAL_MS)}**"
            )
    lines += [
        "",
        "### 3. Long-poll wake-up (interleaved blocks of trials)",
        "",
        "The holder (`Locks('http://…')`) releases once the server counts the waiter as"
        " waiting (`/v1/holders`), and 5 ms more. Wake-up: from the holder's release call"
        " returning to the waiter's answer (`time.monotonic`, one process, two threads); it"
        " can be below 0 when the waiter's answer arrives before the release's. The"
        " `acquire` waiter is woken by its `/v1/wait` and then tries again: its figure"
        " includes that second acquire request. The rows where the holder releases in the"
        " store itself are not the goal's case: the server learns of such a release by"
        " its recheck (docs/http-api.md: at least every second) or the store's"
        " notification.",
        "",
        "| store | waiter | trials | wake-up p50 ms | p90 ms | max ms | release call p50 ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    names = {
        "wait": "raw `POST /v1/wait`",
        "acquire": "`Locks.acquire(key, timeout=10)`",
        "direct": "raw `POST /v1/wait`; the holder releases in the store, not via the server",
    }
    for backend in backends:
        for variant, samples in backend.wakeups.items():
            wake = [w * 1e3 for _, w in samples]
            release = [r * 1e3 for r, _ in samples]
            median = statistics.median(wake)
            lines.append(
                f"| {backend.name} | {names[variant]} | {len(wake)} | {_fmt(median, 2)} |"
                f" {_fmt(_quantile(wake, 0.9), 2)} | {_fmt(max(wake), 2)} |"
                f" {_fmt(statistics.median(release), 2)} |"
            )
            if variant == "direct":
                continue  # not the goal's case: the API promises a recheck every second
            goals.append(
                f"3. {backend.name}, {names[variant]}: wake-up median {median:,.2f} ms (p90"
                f" {_quantile(wake, 0.9):,.2f}); goal ≤ {WAKEUP_GOAL_MS:g} ms:"
                f" **{_verdict(median, WAKEUP_GOAL_MS)}**"
            )
    lines += ["", "### Goals (issue 4)", "", *[f"- {goal}" for goal in goals], ""]
    return "\n".join(lines), goals


# -- main ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _backends(workdir: Path, plain: bool) -> Iterator[tuple[list[Backend], str]]:
    with RedisServer() as redis_server, contextlib.ExitStack() as stack:
        sqlite_url = f"sqlite:///{workdir}/locks.db"
        (workdir / "sqlite").mkdir()
        (workdir / "redis").mkdir()
        sqlite_server = stack.enter_context(LockServer(sqlite_url, workdir / "sqlite"))
        redis_lock_server = stack.enter_context(LockServer(redis_server.url, workdir / "redis"))
        backends = [
            Backend("SQLite", sqlite_url, sqlite_server, None),
            Backend("Redis", redis_server.url, redis_lock_server, redis_server.pid),
        ]
        if plain:
            plain_url = f"sqlite:///{workdir}/plain.db"
            (workdir / "plain").mkdir()
            plain_server = stack.enter_context(
                LockServer(plain_url, workdir / "plain", hide=PLAIN_HIDES)
            )
            backends.append(Backend(PLAIN, plain_url, plain_server, None))
        yield backends, redis_server.version()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="part 1 rounds")
    parser.add_argument("--pairs", type=int, default=200, help="part 1 pairs per case per round")
    parser.add_argument("--seconds", type=float, default=5.0, help="part 2 run length")
    parser.add_argument("--load-rounds", type=int, default=3, help="part 2 rounds")
    parser.add_argument("--trials", type=int, default=200, help="part 3 trials per case")
    parser.add_argument(
        "--direct-trials",
        type=int,
        default=10,
        help="part 3 trials where the holder releases in the store (each up to 1 s)",
    )
    parser.add_argument(
        "--plain",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"also a SQLite lock server without {' and '.join(PLAIN_HIDES)} (uvicorn then"
        " runs asyncio and h11): the server stack's share, side by side",
    )
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    if args.quick:
        args.rounds, args.pairs, args.seconds, args.load_rounds = 2, 50, 2.0, 1
        args.trials, args.direct_trials = 20, 2
    load_at_start = os.getloadavg()
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    with (
        tempfile.TemporaryDirectory(prefix="keymutex-server-bench-") as tmp,
        _backends(Path(tmp), args.plain) as (backends, redis_version),
    ):
        for backend in backends:
            log(f"{backend.name}: lock server {backend.server.url} (pid {backend.server.pid})")

        log("part 1: one client, acquire+release")
        part_latency(backends, args.rounds, args.pairs, log)

        log(f"part 2: {CLIENTS} clients, probe every {PROBE_EVERY * 1e3:g} ms")
        for backend in backends:
            probe_idle(backend, 1.0)
        variants = list(LOADS)
        for round_ in range(args.load_rounds):
            shift = round_ % len(variants)  # each variant in turn first: load drifts
            for variant in variants[shift:] + variants[:shift]:
                for backend in backends:
                    run = load_run(backend, variant, args.seconds)
                    backend.load.setdefault(variant, []).append(run)
                    log(
                        f"  round {round_ + 1} {backend.name} {variant}:"
                        f" {run['pairs/s']:,.0f} pairs/s, p99 {run['pair p99 ms']:.1f} ms,"
                        f" probe max {max(max(v) for v in run['probes'].values()) * 1e3:.1f} ms"
                    )

        log(f"part 3: wake-up, {args.trials} trials per case")
        blocks = 4 if args.trials >= 40 else 1
        for block in range(blocks):
            size = args.trials // blocks + (block < args.trials % blocks)
            for backend in backends:
                for variant in ("wait", "acquire"):
                    wakeup_trials(backend, variant, size)
        for backend in backends:
            wakeup_trials(backend, "direct", args.direct_trials)
            log(
                f"  {backend.name}: "
                + ", ".join(
                    f"{v} p50 {statistics.median(w for _, w in s) * 1e3:.2f} ms"
                    for v, s in backend.wakeups.items()
                )
            )
    context = {
        "machine": _machine(load_at_start),
        "redis_version": redis_version,
        "seconds": time.monotonic() - started,
    }
    text, _ = report(backends, args, context)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "server.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

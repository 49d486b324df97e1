"""Parts 2 and 3: processes contending on one key; fairness, handoff and commands per acquire.

Part 2 (``contention``): 4 processes, one waiter each, loop for a fixed time on one key;
the critical section is GET + SET of a counter key through a separate client. Times
come from ``time.monotonic()`` (CLOCK_MONOTONIC, shared by all processes of the host):
``asked`` before the acquire, ``acquired`` after it, ``released`` just before the
release, so a handoff (one holder's ``released`` to the next holder's ``acquired``)
includes the release round trip and the wake-up.

Part 3 (``coalescing``): 4 processes × 16 asyncio tasks (or threads) on one key, each
sharing one client object per process. Commands per completed acquire are read from
``INFO commandstats`` deltas (after ``CONFIG RESETSTAT``, once every process is ready)
and from redis-py's side (what the clients sent), less the critical section's GET + SET.

When the time is up, a waiter still waits for its turn (no timeout): every wait counted
ends in an acquire, and the ones that finish after the deadline are counted for lost
updates and commands, but not for acquires/s.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import queue
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager, contextmanager
from typing import Any

import redis
import redis.asyncio
from redis_server import ClientTraffic, ServerCounters, count_client_traffic

PROCESSES = 4
TTL_S = 10
KEY = "bench:contended"
COUNTER = "bench:contended:counter"
SLEEP_RAW_S = 0.001
TASKS = 16  # per process, in part 3

# Part 2 contenders: one waiter per process.
CONTENDERS = {
    "keymutex Locks: with lock()": "keymutex",
    "python-redis-lock (BLPOP wake-up)": "python-redis-lock",
    "redis-py Lock (polls, sleep=0.1)": "redis",
    f"raw SET NX PX, {SLEEP_RAW_S * 1000:g} ms sleep between tries": "redis",
}
# Part 3: (name, distribution, "async" | "threads")
COALESCERS = {
    "keymutex AsyncLocks, 16 tasks/process": ("keymutex", "async"),
    "redis-py asyncio Lock (polls, sleep=0.1), 16 tasks/process": ("redis", "async"),
    "keymutex Locks, 16 threads/process": ("keymutex", "threads"),
    "redis-py Lock (polls, sleep=0.1), 16 threads/process": ("redis", "threads"),
}


def _sync_lock_factory(kind: str, port: int) -> Callable[[], AbstractContextManager[Any]]:
    """A callable that returns a fresh context manager holding KEY, the library's way."""
    r = redis.Redis(host="127.0.0.1", port=port)
    if kind.startswith("keymutex"):
        import keymutex

        locks = keymutex.Locks(f"redis://127.0.0.1:{port}/0", namespace="bench", ttl=TTL_S)
        return lambda: locks.lock(KEY)
    if kind.startswith("python-redis-lock"):
        import redis_lock

        return lambda: redis_lock.Lock(r, KEY, expire=TTL_S)
    if kind.startswith("redis-py"):
        return lambda: r.lock(KEY, timeout=TTL_S, sleep=0.1)
    if kind.startswith("raw"):
        return lambda: _raw_spin_lock(r)
    raise ValueError(kind)


@contextmanager
def _raw_spin_lock(r: redis.Redis) -> Any:
    token = os.urandom(16).hex()
    while not r.set(KEY, token, nx=True, px=TTL_S * 1000):
        time.sleep(SLEEP_RAW_S)
    try:
        yield
    finally:
        r.eval(
            "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0",
            1,
            KEY,
            token,
        )


def _async_lock_factory(kind: str, port: int) -> Callable[[], AbstractAsyncContextManager[Any]]:
    if kind.startswith("keymutex"):
        import keymutex

        locks = keymutex.AsyncLocks(f"redis://127.0.0.1:{port}/0", namespace="bench", ttl=TTL_S)
        return lambda: locks.lock(KEY)
    if kind.startswith("redis-py"):
        r = redis.asyncio.Redis(host="127.0.0.1", port=port)
        return lambda: r.lock(KEY, timeout=TTL_S, sleep=0.1)
    raise ValueError(kind)


def _contention_worker(
    kind: str, port: int, seconds: float, ready: Any, go: Any, start: Any, out: Any
) -> None:
    try:
        traffic = count_client_traffic()
        make_lock = _sync_lock_factory(kind, port)
        counter = redis.Redis(host="127.0.0.1", port=port)
        with make_lock():  # connect, load scripts: not part of the measurement
            counter.get(COUNTER)
        spans: list[tuple[float, float, float]] = []  # (asked, acquired, released)
        traffic.reset()
        ready.put(os.getpid())
        go.wait()
        stop_at = start.value + seconds
        while (asked := time.monotonic()) < stop_at:
            with make_lock():
                acquired = time.monotonic()
                value = int(counter.get(COUNTER) or 0)
                counter.set(COUNTER, value + 1)
                released = time.monotonic()
            spans.append((asked, acquired, released))
        out.put((os.getpid(), spans, traffic.commands, traffic.round_trips, None))
    except BaseException as exc:
        out.put((os.getpid(), [], 0, 0, f"{type(exc).__name__}: {exc}"))
        raise


def _coalescing_worker(
    kind: str, mode: str, port: int, seconds: float, ready: Any, go: Any, start: Any, out: Any
) -> None:
    try:
        traffic = count_client_traffic()
        tasks = TASKS
        if mode == "async":
            acquires = asyncio.run(_coalesce_async(kind, port, seconds, tasks, ready, go, start))
        else:
            acquires = _coalesce_threads(kind, port, seconds, tasks, ready, go, start, traffic)
        out.put(
            (os.getpid(), acquires, traffic.commands, traffic.round_trips, traffic.by_name, None)
        )
    except BaseException as exc:
        out.put((os.getpid(), (0, 0), 0, 0, {}, f"{type(exc).__name__}: {exc}"))
        raise


async def _coalesce_async(
    kind: str, port: int, seconds: float, tasks: int, ready: Any, go: Any, start: Any
) -> tuple[int, int]:
    make_lock = _async_lock_factory(kind, port)
    counter = redis.asyncio.Redis(host="127.0.0.1", port=port)
    async with make_lock():
        await counter.get(COUNTER)
    count_client_traffic().reset()
    ready.put(os.getpid())
    await asyncio.to_thread(go.wait)
    stop_at = start.value + seconds
    in_time = 0
    total = 0

    async def loop() -> None:
        nonlocal in_time, total
        while time.monotonic() < stop_at:
            async with make_lock():
                acquired = time.monotonic()
                value = int(await counter.get(COUNTER) or 0)
                await counter.set(COUNTER, value + 1)
            total += 1
            in_time += acquired < stop_at

    await asyncio.gather(*(loop() for _ in range(tasks)))
    return in_time, total


def _coalesce_threads(
    kind: str,
    port: int,
    seconds: float,
    tasks: int,
    ready: Any,
    go: Any,
    start: Any,
    traffic: ClientTraffic,
) -> tuple[int, int]:
    make_lock = _sync_lock_factory(kind, port)
    counter = redis.Redis(host="127.0.0.1", port=port)
    with make_lock():
        counter.get(COUNTER)
    counts: list[tuple[int, int]] = []
    guard = threading.Lock()

    def loop() -> None:
        in_time = total = 0
        go.wait()
        stop_at = start.value + seconds
        while time.monotonic() < stop_at:
            with make_lock():
                acquired = time.monotonic()
                value = int(counter.get(COUNTER) or 0)
                counter.set(COUNTER, value + 1)
            total += 1
            in_time += acquired < stop_at
        with guard:
            counts.append((in_time, total))

    threads = [threading.Thread(target=loop) for _ in range(tasks)]
    traffic.reset()
    for thread in threads:
        thread.start()
    ready.put(os.getpid())
    for thread in threads:
        thread.join()
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def _wait_until_ready(procs: list[Any], ready: Any, out: Any, limit_s: float = 60.0) -> None:
    """Wait for every worker's "ready"; fail at once if one of them died setting up."""
    deadline = time.monotonic() + limit_s
    waiting = len(procs)
    while waiting:
        try:
            ready.get(timeout=0.2)
            waiting -= 1
            continue
        except queue.Empty:
            pass
        if any(not proc.is_alive() for proc in procs):
            try:
                error = out.get(timeout=1)[-1]
            except queue.Empty:
                error = None
            raise RuntimeError(error or "a worker died while setting up")
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not ready after {limit_s:g} s (hang?)")


def _run_processes(
    target: Callable[..., None], args: tuple[Any, ...], seconds: float, admin: redis.Redis
) -> tuple[list[tuple[Any, ...]], ServerCounters, float]:
    """Start PROCESSES workers, reset the server's stats once all are ready, let them go."""
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    start = ctx.Value("d", 0.0)
    admin.delete(KEY, COUNTER)
    admin.set(COUNTER, 0)
    procs = [
        ctx.Process(target=target, args=(*args, seconds, ready, go, start, out), daemon=True)
        for _ in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    try:
        _wait_until_ready(procs, ready, out)
        admin.config_resetstat()
        before = ServerCounters.read(admin)
        start.value = time.monotonic() + 0.05
        go.set()
        results = [out.get(timeout=seconds + 120) for _ in procs]
        after = ServerCounters.read(admin)
        for proc in procs:
            proc.join(10)
    except queue.Empty:
        raise RuntimeError("workers did not finish in time (hang?)") from None
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = [r[-1] for r in results if r[-1]]
    if errors:
        raise RuntimeError(errors[0])
    return results, after.since(before), int(admin.get(COUNTER) or 0)


def contention(name: str, port: int, seconds: float) -> dict[str, float]:
    """Part 2 for one contender: the metrics of one run."""
    admin = redis.Redis(host="127.0.0.1", port=port)
    results, server, counter = _run_processes(_contention_worker, (name, port), seconds, admin)
    events = sorted(
        (acquired, released, asked, pid)
        for pid, spans, *_ in results
        for asked, acquired, released in spans
    )
    first_asked = min(e[2] for e in events)
    stop_at = first_asked + seconds
    in_time = [e for e in events if e[0] < stop_at]
    # Release -> the next grant to *another* process (found by review: the releaser's
    # re-takes, 99.7 % of redis-py Lock's grants, were counted as 0.25 ms hand-overs).
    handoffs = [b[0] - a[1] for a, b in itertools.pairwise(in_time) if a[3] != b[3]]
    deciles = statistics.quantiles(handoffs, n=10) if len(handoffs) > 1 else [float("nan")] * 9
    by_pid: dict[int, list[int]] = {}
    for a, b in itertools.pairwise(in_time):
        by_pid.setdefault(b[3], []).append(a[3] == b[3])
    same_share = max(sum(v) / len(v) for v in by_pid.values())
    same = sum(1 for a, b in itertools.pairwise(in_time) if a[3] == b[3])
    acquires = len(events)
    client_commands = sum(r[2] for r in results) - 2 * acquires
    client_trips = sum(r[3] for r in results) - 2 * acquires
    return {
        "acquires/s": len(in_time) / seconds,
        "lost updates": acquires - counter,
        "handoff p50 ms": statistics.median(handoffs) * 1e3 if handoffs else float("nan"),
        "handoff p90 ms": deciles[8] * 1e3,
        "handoffs": len(handoffs),
        "worst wait ms": max(e[0] - e[2] for e in events) * 1e3,
        "same holder %": 100.0 * same / max(1, len(in_time) - 1),
        "max per-process re-acquire %": 100.0 * same_share,
        "server commands/acquire": (server.total - 2 * acquires) / acquires,
        "round trips/acquire": client_trips / acquires,
        "client commands/acquire": client_commands / acquires,
    }


def coalescing(name: str, port: int, seconds: float) -> dict[str, Any]:
    """Part 3 for one configuration: the metrics of one run."""
    _, mode = COALESCERS[name]
    admin = redis.Redis(host="127.0.0.1", port=port)
    results, server, counter = _run_processes(
        _coalescing_worker, (name, mode, port), seconds, admin
    )
    in_time = sum(r[1][0] for r in results)
    acquires = sum(r[1][1] for r in results)
    commands = dict(server.commands)
    for name_ in ("get", "set"):  # the critical section's, once per acquire
        commands[name_] = commands.get(name_, 0) - acquires
    lock_commands = sum(commands.values())
    # A command sent at most once per task in the whole run (connection handshakes, a
    # first SUBSCRIBE, SCRIPT LOAD) is set-up, not a cost of each acquire. Counted on the
    # clients' side, which also sees what Redis rejects unnamed (CLIENT SETINFO on 7.0).
    sent: Counter[str] = Counter()
    for r in results:
        sent.update(r[4])
    one_off = sum(n for n in sent.values() if n <= PROCESSES * TASKS)
    return {
        "acquires/s": in_time / seconds,
        "acquires": acquires,
        "lost updates": acquires - counter,
        "server commands/acquire": lock_commands / acquires,
        "client commands/acquire": (sum(r[2] for r in results) - 2 * acquires) / acquires,
        "one-off commands/acquire": one_off / acquires,
        "round trips/acquire": (sum(r[3] for r in results) - 2 * acquires) / acquires,
        "socket reads/acquire": (server.reads - 2 * acquires) / acquires,
        "breakdown": {k: v / acquires for k, v in sorted(commands.items()) if v},
    }

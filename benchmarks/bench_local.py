"""In-process keyed locks against what people write by hand and against asyncio-keyed-lock.

Run: .venv/bin/python benchmarks/bench_local.py [--rounds 7] [--thread-ops 30000]

(a) asyncio: 1000 tasks over 100 keys, each doing 20 x (acquire / ``await
    asyncio.sleep(0)`` / release) on keys drawn at random (the same draw for every
    lock in a round). Contenders: ``AsyncKeyedLock`` through ``async with`` and through
    ``acquire``/``release``; a never-cleaned ``defaultdict(asyncio.Lock)``; a
    reference-counted dict of ``asyncio.Lock`` (entries removed when unused); and the
    ``asyncio-keyed-lock`` package.
(b) threads: 8 threads, each doing N acquire / counter += 1 / release on random keys
    out of 100. Contenders: ``KeyedLock`` (``with`` and ``acquire``/``release``); a
    reference-counted dict of ``threading.Lock`` guarded by one global lock (used
    through ``acquire``/``release`` methods and through ``with``); a never-cleaned
    ``defaultdict(threading.Lock)``. Counters are checked: a lost update fails the run.
(c) 100,000 distinct keys used once each, one after the other and all held at once:
    entries left afterwards and bytes still allocated (tracemalloc, after gc).
(d) fairness on one hot key (threads): acquires/s, same-holder % (the releasing thread
    takes the key again) and the worst single wait. Not a goal; read (b) with it.

Thread figures of designs with one global guard that blocks (the ref-counted dict) jump
between two levels from one round to the next, up to ten times apart: when a thread
loses the GIL while it holds the guard, the others block on it in the kernel and a
convoy forms. The slowest-fastest column shows it; KeyedLock avoids it (see
``_take_guard`` in ``src/keymutex/_local.py``).

Rounds interleave the contenders (rotating their order); the tables show medians, and
ratios are medians of the per-round ratios. Results go to benchmarks/results/local.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import itertools
import os
import platform
import random
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Hashable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from asyncio_keyed_lock import AsyncioKeyedLock

from keymutex import AsyncKeyedLock, KeyedLock

RESULTS = Path(__file__).parent / "results"

TASKS, KEYS, TASK_OPS = 1000, 100, 20
THREADS = 8
DISTINCT_KEYS = 100_000
FAIRNESS_SECONDS = 0.4

# Goals (see the brief in docs / PERFORMANCE.md): ratios measured within this run.
GOAL_VS_DICT = 0.95  # AsyncKeyedLock vs never-cleaned defaultdict(asyncio.Lock)
GOAL_VS_PACKAGE = 1.5  # AsyncKeyedLock vs asyncio-keyed-lock
GOAL_VS_REFCOUNTED = 1.0  # KeyedLock vs ref-counted dict + global lock


# --------------------------------------------------------------------------- (a) asyncio

Plan = list[list[str]]


async def _async_keymutex_with(lock: AsyncKeyedLock, keys: list[str]) -> None:
    sleep = asyncio.sleep
    for key in keys:
        async with lock(key):
            await sleep(0)


async def _async_keymutex_methods(lock: AsyncKeyedLock, keys: list[str]) -> None:
    sleep = asyncio.sleep
    for key in keys:
        await lock.acquire(key)
        try:
            await sleep(0)
        finally:
            lock.release(key)


async def _async_dict(locks: collections.defaultdict[str, asyncio.Lock], keys: list[str]) -> None:
    sleep = asyncio.sleep
    for key in keys:
        async with locks[key]:
            await sleep(0)


async def _async_refcounted(locks: dict[str, list[Any]], keys: list[str]) -> None:
    # The usual hand-written cleanup: [lock, users] per key, removed when users hits 0.
    sleep = asyncio.sleep
    for key in keys:
        entry = locks.get(key)
        if entry is None:
            entry = locks[key] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                await sleep(0)
        finally:
            entry[1] -= 1
            if not entry[1]:
                del locks[key]


async def _async_package(lock: AsyncioKeyedLock, keys: list[str]) -> None:
    sleep = asyncio.sleep
    for key in keys:
        async with lock(key):
            await sleep(0)


ASYNC_CONTENDERS: dict[str, tuple[Callable[[Any, list[str]], Awaitable[None]], Any]] = {
    "keymutex AsyncKeyedLock, `async with`": (_async_keymutex_with, AsyncKeyedLock),
    "keymutex AsyncKeyedLock, acquire/release": (_async_keymutex_methods, AsyncKeyedLock),
    "defaultdict(asyncio.Lock), never cleaned": (
        _async_dict,
        lambda: collections.defaultdict(asyncio.Lock),
    ),
    "ref-counted dict of asyncio.Lock": (_async_refcounted, dict),
    "asyncio-keyed-lock 1.x": (_async_package, AsyncioKeyedLock),
}


def _run_async(name: str, plan: Plan) -> float:
    worker, make = ASYNC_CONTENDERS[name]

    async def main() -> float:
        lock = make()
        started = time.perf_counter()
        await asyncio.gather(*(worker(lock, keys) for keys in plan))
        elapsed = time.perf_counter() - started
        left = lock.active_keys_count if isinstance(lock, AsyncioKeyedLock) else len(lock)
        assert left == 0 or name.startswith("defaultdict"), (name, left)
        return elapsed

    gc.collect()
    elapsed = asyncio.run(main())
    return TASKS * TASK_OPS / elapsed


# --------------------------------------------------------------------------- (b) threads


class RefCountedLocks:
    """The usual hand-written keyed lock: a [lock, users] pair per key under one guard."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Hashable, list[Any]] = {}

    def acquire(self, key: Hashable) -> None:
        with self._guard:
            entry = self._locks.get(key)
            if entry is None:
                entry = self._locks[key] = [threading.Lock(), 0]
            entry[1] += 1
        entry[0].acquire()

    def release(self, key: Hashable) -> None:
        with self._guard:
            entry = self._locks[key]
            entry[1] -= 1
            if not entry[1]:
                del self._locks[key]
        entry[0].release()

    def __call__(self, key: Hashable) -> _RefCountedHeld:
        return _RefCountedHeld(self, key)

    def __len__(self) -> int:
        return len(self._locks)


class _RefCountedHeld:
    __slots__ = ("_key", "_locks")

    def __init__(self, locks: RefCountedLocks, key: Hashable) -> None:
        self._locks = locks
        self._key = key

    def __enter__(self) -> None:
        self._locks.acquire(self._key)

    def __exit__(self, *exc_info: object) -> None:
        self._locks.release(self._key)


def _thread_with(lock: Any, keys: list[str], counts: dict[str, int]) -> None:
    for key in keys:
        with lock(key):
            counts[key] += 1


def _thread_methods(lock: Any, keys: list[str], counts: dict[str, int]) -> None:
    acquire, release = lock.acquire, lock.release
    for key in keys:
        acquire(key)
        counts[key] += 1
        release(key)


def _thread_dict(locks: Any, keys: list[str], counts: dict[str, int]) -> None:
    for key in keys:
        with locks[key]:
            counts[key] += 1


THREAD_CONTENDERS: dict[str, tuple[Callable[[Any, list[str], dict[str, int]], None], Any]] = {
    "keymutex KeyedLock, `with`": (_thread_with, KeyedLock),
    "keymutex KeyedLock, acquire/release": (_thread_methods, KeyedLock),
    "ref-counted dict + global lock, acquire/release": (_thread_methods, RefCountedLocks),
    "ref-counted dict + global lock, `with`": (_thread_with, RefCountedLocks),
    "defaultdict(threading.Lock), never cleaned": (
        _thread_dict,
        lambda: collections.defaultdict(threading.Lock),
    ),
}
THREAD_REFERENCE = "ref-counted dict + global lock, acquire/release"


def _run_threads(name: str, plans: Plan) -> float:
    worker, make = THREAD_CONTENDERS[name]
    lock = make()
    counts = dict.fromkeys({key for keys in plans for key in keys}, 0)
    start = threading.Barrier(len(plans) + 1)

    def run(keys: list[str]) -> None:
        start.wait()
        worker(lock, keys, counts)

    threads = [threading.Thread(target=run, args=(keys,)) for keys in plans]
    gc.collect()
    for thread in threads:
        thread.start()
    start.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    total = sum(len(keys) for keys in plans)
    if sum(counts.values()) != total:
        raise SystemExit(f"{name}: lost updates ({sum(counts.values())} of {total})")
    assert len(lock) == 0 or name.startswith("defaultdict"), (name, len(lock))
    return total / elapsed


# --------------------------------------------------------------------------- (c) memory


def _retained(scenario: Callable[[int], int]) -> tuple[int, int]:
    """(bytes retained after gc, entries left) by ``scenario(DISTINCT_KEYS)``."""
    scenario(1000)  # warm-up: caches and specialised code are not what we measure
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        entries = scenario(DISTINCT_KEYS)
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return retained, entries


def _memory_rows() -> list[tuple[str, str, int, int]]:
    keyed = KeyedLock()
    akeyed = AsyncKeyedLock()
    package = AsyncioKeyedLock()
    never_cleaned: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(
        asyncio.Lock
    )

    def threads_one_by_one(count: int) -> int:
        for index in range(count):
            with keyed(f"key:{index}"):
                pass
        return len(keyed)

    def threads_all_at_once(count: int) -> int:
        keys = [f"key:{index}" for index in range(count)]
        for key in keys:
            keyed.acquire(key)
        for key in keys:
            keyed.release(key)
        return len(keyed)

    def asyncio_one_by_one(count: int) -> int:
        async def main() -> None:
            for index in range(count):
                async with akeyed(f"key:{index}"):
                    pass

        asyncio.run(main())
        return len(akeyed)

    def asyncio_all_at_once(count: int) -> int:
        async def main() -> None:
            keys = [f"key:{index}" for index in range(count)]
            for key in keys:
                await akeyed.acquire(key)
            for key in keys:
                akeyed.release(key)

        asyncio.run(main())
        return len(akeyed)

    def package_one_by_one(count: int) -> int:
        async def main() -> None:
            for index in range(count):
                async with package(f"key:{index}"):
                    pass

        asyncio.run(main())
        return package.active_keys_count

    def dict_one_by_one(count: int) -> int:
        async def main() -> None:
            for index in range(count):
                async with never_cleaned[f"key:{index}"]:
                    pass

        never_cleaned.clear()
        asyncio.run(main())
        return len(never_cleaned)

    def asyncio_run_only(count: int) -> int:
        async def main() -> None:
            for _ in range(count):
                await asyncio.sleep(0)

        asyncio.run(main())
        return 0

    scenarios = [
        ("no lock: `asyncio.run` alone (baseline)", "—", asyncio_run_only),
        ("keymutex KeyedLock", "one after the other", threads_one_by_one),
        ("keymutex KeyedLock", "all held at once", threads_all_at_once),
        ("keymutex AsyncKeyedLock", "one after the other", asyncio_one_by_one),
        ("keymutex AsyncKeyedLock", "all held at once", asyncio_all_at_once),
        ("asyncio-keyed-lock 1.x", "one after the other", package_one_by_one),
        ("defaultdict(asyncio.Lock)", "one after the other", dict_one_by_one),
    ]
    rows = []
    for name, how, scenario in scenarios:
        retained, entries = _retained(scenario)
        rows.append((name, how, entries, retained))
    return rows


# --------------------------------------------------------------------------- (d) fairness


def _fairness(name: str) -> tuple[float, float, float]:
    """(acquires/s, same-holder %, worst wait in ms) for 8 threads on one key."""
    lock: AbstractContextManager[Any]
    if name == "keymutex KeyedLock":
        lock = KeyedLock()("hot")
    elif name == "ref-counted dict + global lock":
        lock = RefCountedLocks()("hot")
    else:
        lock = threading.Lock()
    holders: list[int] = []
    worst = [0.0] * THREADS
    start = threading.Barrier(THREADS + 1)
    stop_at = [0.0]

    def run(me: int) -> None:
        clock = time.perf_counter
        worst_wait = 0.0
        start.wait()
        while True:
            asked = clock()
            if asked >= stop_at[0]:
                break
            with lock:
                waited = clock() - asked
                holders.append(me)
            worst_wait = max(worst_wait, waited)
        worst[me] = worst_wait

    threads = [threading.Thread(target=run, args=(me,)) for me in range(THREADS)]
    for thread in threads:
        thread.start()
    gc.collect()
    stop_at[0] = time.perf_counter() + FAIRNESS_SECONDS
    start.wait()
    for thread in threads:
        thread.join()
    same = sum(a == b for a, b in itertools.pairwise(holders))
    return (
        len(holders) / FAIRNESS_SECONDS,
        100.0 * same / max(1, len(holders) - 1),
        1000.0 * max(worst),
    )


# --------------------------------------------------------------------------- report


def _interleaved(
    names: list[str], rounds: int, measure: Callable[[str], float]
) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            results[name].append(measure(name))
    return results


def _ratio(results: dict[str, list[float]], name: str, reference: str) -> float:
    return statistics.median(a / b for a, b in zip(results[name], results[reference], strict=True))


def _spread(values: list[float]) -> str:
    """Median, then slowest and fastest round (table cells)."""
    return f"{statistics.median(values):,.0f} | {min(values):,.0f}–{max(values):,.0f}"


def _verdict(ratio: float, goal: float) -> str:
    return f"{ratio:.2f} (goal ≥ {goal:g}: {'met' if ratio >= goal else 'NOT met'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved repetitions (≥ 3)")
    parser.add_argument("--thread-ops", type=int, default=30_000, help="operations per thread")
    args = parser.parse_args()
    rounds = max(3, args.rounds)
    began = time.perf_counter()
    rng = random.Random(20_240_601)
    keys = [f"key:{index}" for index in range(KEYS)]

    def async_plan() -> Plan:
        return [[rng.choice(keys) for _ in range(TASK_OPS)] for _ in range(TASKS)]

    def thread_plan() -> Plan:
        return [[rng.choice(keys) for _ in range(args.thread_ops)] for _ in range(THREADS)]

    print(f"(a) asyncio, {rounds} rounds", flush=True)
    plans = [async_plan() for _ in range(rounds)]
    round_of: dict[str, int] = collections.Counter()

    def measure_async(name: str) -> float:
        plan = plans[round_of[name]]
        round_of[name] += 1
        return _run_async(name, plan)

    async_results = _interleaved(list(ASYNC_CONTENDERS), rounds, measure_async)

    print(f"(b) threads, {rounds} rounds", flush=True)
    thread_plans = [thread_plan() for _ in range(rounds)]
    thread_round: dict[str, int] = collections.Counter()

    def measure_threads(name: str) -> float:
        plan = thread_plans[thread_round[name]]
        thread_round[name] += 1
        return _run_threads(name, plan)

    thread_results = _interleaved(list(THREAD_CONTENDERS), rounds, measure_threads)

    print("(c) 100,000 distinct keys", flush=True)
    memory = _memory_rows()

    print("(d) fairness on one hot key", flush=True)
    fairness = {
        name: _fairness(name)
        for name in ("keymutex KeyedLock", "ref-counted dict + global lock", "threading.Lock")
    }

    dict_name = "defaultdict(asyncio.Lock), never cleaned"
    package_name = "asyncio-keyed-lock 1.x"
    lines = [
        "## In-process keyed locks (`benchmarks/bench_local.py`)",
        "",
        f"Python {platform.python_version()}, {os.cpu_count()} cores, {sys.platform};"
        f" medians of {rounds} interleaved rounds; ratios are medians of per-round ratios."
        f" Whole run: {time.perf_counter() - began:.0f} s.",
        "",
        f"### (a) asyncio: {TASKS} tasks × {TASK_OPS} × (acquire / `sleep(0)` / release),"
        f" {KEYS} keys",
        "",
        "| lock | ops/s | slowest–fastest round | vs never-cleaned dict | vs asyncio-keyed-lock |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, values in async_results.items():
        versus_dict = _ratio(async_results, name, dict_name)
        versus_package = _ratio(async_results, name, package_name)
        if name.startswith("keymutex"):
            cells = [
                _verdict(versus_dict, GOAL_VS_DICT),
                _verdict(versus_package, GOAL_VS_PACKAGE),
            ]
        else:
            cells = [f"{versus_dict:.2f}", f"{versus_package:.2f}"]
        lines.append(f"| {name} | {_spread(values)} | {' | '.join(cells)} |")
    lines += [
        "",
        f"### (b) threads: {THREADS} threads × {args.thread_ops:,} × (acquire / counter += 1 /"
        f" release), {KEYS} keys",
        "",
        "| lock | ops/s | slowest–fastest round"
        " | vs ref-counted dict + global lock, acquire/release"
        " | vs ref-counted dict + global lock, same form |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, values in thread_results.items():
        ratio = _ratio(thread_results, name, THREAD_REFERENCE)
        if name.startswith("keymutex"):
            form = name.split(", ")[-1]
            same_form = _ratio(thread_results, name, f"ref-counted dict + global lock, {form}")
            cells = [_verdict(ratio, GOAL_VS_REFCOUNTED), _verdict(same_form, GOAL_VS_REFCOUNTED)]
        else:
            cells = [f"{ratio:.2f}", ""]
        lines.append(f"| {name} | {_spread(values)} | {' | '.join(cells)} |")
    lines += [
        "",
        f"### (c) {DISTINCT_KEYS:,} distinct keys, each used once",
        "",
        "| lock | keys used | entries left | bytes retained after gc |",
        "|---|---|---:|---:|",
    ]
    for name, how, entries, retained in memory:
        lines.append(f"| {name} | {how} | {entries:,} | {retained:,} |")
    lines += [
        "",
        f"### (d) fairness: {THREADS} threads on one key for {FAIRNESS_SECONDS:g} s"
        " (one run; read (b) with it)",
        "",
        "| lock | acquires/s | same holder again | worst wait |",
        "|---|---:|---:|---:|",
    ]
    for name, (rate, same, worst) in fairness.items():
        lines.append(f"| {name} | {rate:,.0f} | {same:.0f} % | {worst:.1f} ms |")
    table = "\n".join(lines) + "\n"
    print()
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "local.md").write_text(table)
    print(f"wrote {RESULTS / 'local.md'}")


if __name__ == "__main__":
    main()

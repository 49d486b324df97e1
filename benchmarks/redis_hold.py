"""Part 4: 10,000 leases held with renew=True in one keymutex ``Locks``: renewal and memory.

Runs in a process of its own (it wraps redis-py to count what is sent, which must not
slow part 1 down). The leases are ``locks.lock(key)`` contexts entered on an ExitStack.
While all are held, the renewal window lasts three renewal periods (3 × ttl/3): every
lease is due about three times. Reported:

* server side: ``INFO commandstats`` deltas (EVALSHA and every other command, including
  the ones scripts ran) and socket reads (one per round trip, a few per large pipeline);
* client side: commands and round trips redis-py sent;
* renewal ticks: calls of the store's ``renew_many`` (one per renewer wake-up), counted
  through a private hook when the store has that method; otherwise bursts of sends
  separated by 0.2 s of silence;
* ``used_memory`` and ``DBSIZE`` before, while held, and after release.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import time
from contextlib import ExitStack
from typing import Any

import redis
from redis_server import ServerCounters, count_client_traffic

PREFIX = "bench:hold"


def _used_memory(admin: redis.Redis) -> int:
    return int(admin.info("memory")["used_memory"])


def _hook_renew_many(locks: Any) -> list[tuple[float, float, int]] | None:
    """Record (start, seconds, leases) of each renew_many call, if the store has one."""
    store = getattr(locks, "_store", None)
    original = getattr(store, "renew_many", None)
    if original is None:
        return None
    calls: list[tuple[float, float, int]] = []

    def renew_many(requests: Any) -> Any:
        started = time.monotonic()
        try:
            return original(requests)
        finally:
            calls.append((started, time.monotonic() - started, len(requests)))

    store.renew_many = renew_many  # type: ignore[union-attr]
    return calls


def _bursts(times: list[float], gap: float = 0.2) -> int:
    return 1 + sum(1 for a, b in itertools.pairwise(times) if b - a > gap) if times else 0


def _hold(port: int, leases: int, ttl: float, out: Any) -> None:
    try:
        out.put(_measure(port, leases, ttl))
    except BaseException as exc:
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def _measure(port: int, leases: int, ttl: float) -> dict[str, Any]:
    import keymutex

    traffic = count_client_traffic()
    admin = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)
    result: dict[str, Any] = {"leases": leases, "ttl s": ttl}
    with keymutex.Locks(f"redis://127.0.0.1:{port}/0", namespace="bench-hold", ttl=ttl) as locks:
        with locks.lock(f"{PREFIX}:warm-up"):
            pass
        calls = _hook_renew_many(locks)
        result["dbsize before"] = admin.dbsize()
        memory_before = _used_memory(admin)
        with ExitStack() as stack:
            started = time.monotonic()
            held = [stack.enter_context(locks.lock(f"{PREFIX}:{i}")) for i in range(leases)]
            result["acquire µs/lease"] = (time.monotonic() - started) / leases * 1e6
            result["dbsize held"] = admin.dbsize()
            memory_held = _used_memory(admin)
            sample = next(
                iter(admin.scan_iter(match=f"*{PREFIX}:{leases // 2}*", count=1000)), None
            )
            if sample is not None:
                result["sample key"] = sample
                result["sample key MEMORY USAGE"] = admin.memory_usage(sample, samples=0)
            window = ttl  # three renewal periods of ttl/3
            admin.config_resetstat()
            before = ServerCounters.read(admin)
            if calls is not None:
                calls.clear()
            traffic.reset(record_times=True)
            time.sleep(window)
            commands, round_trips = traffic.commands, traffic.round_trips
            send_times = list(traffic.send_times or [])
            ticks = list(calls or [])
            traffic.reset()
            server = ServerCounters.read(admin).since(before)
            result["lost during hold"] = sum(1 for lease in held if lease.lost)
            started = time.monotonic()
        result["release µs/lease"] = (time.monotonic() - started) / leases * 1e6
    time.sleep(0.1)
    result["dbsize after"] = admin.dbsize()
    result["used_memory delta bytes"] = memory_held - memory_before
    result["bytes/lease"] = (memory_held - memory_before) / leases
    result["keys/lease"] = (result["dbsize held"] - result["dbsize before"]) / leases
    result["window s"] = window
    result["lease renewals expected"] = leases * window / (ttl / 3)
    if ticks:
        result["ticks (renew_many calls)"] = len(ticks)
        result["lease renewals seen"] = sum(c[2] for c in ticks)
        result["largest batch"] = max(c[2] for c in ticks)
        result["slowest tick ms"] = max(c[1] for c in ticks) * 1e3
        result["renewer busy %"] = 100 * sum(c[1] for c in ticks) / window
    else:
        result["ticks (bursts of sends)"] = _bursts(send_times)
    tick_count = (
        result.get("ticks (renew_many calls)") or result.get("ticks (bursts of sends)") or 1
    )
    renewals = result.get("lease renewals seen") or result["lease renewals expected"]
    result["client round trips"] = round_trips
    result["client commands"] = commands
    result["server commands"] = server.commands
    result["server socket reads"] = server.reads
    result["round trips/tick"] = round_trips / tick_count
    result["EVALSHA/tick"] = server.commands.get("evalsha", 0) / tick_count
    result["client commands/lease renewal"] = commands / renewals
    result["server commands/lease renewal"] = server.total / renewals
    result["round trips/1000 lease renewals"] = 1000 * round_trips / renewals
    return result


def run(port: int, leases: int, ttl: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_hold, args=(port, leases, ttl, out), daemon=True)
    proc.start()
    try:
        result: dict[str, Any] = out.get(timeout=ttl + leases * 0.01 + 120)
    except queue.Empty:
        result = {"error": "timed out"}
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return result

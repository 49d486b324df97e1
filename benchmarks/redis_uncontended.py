"""Part 1: one client, one key, acquire+release in a loop: latency of each library.

Each case is built the way its library's README shows it: redis-py, python-redis-lock,
aioredlock and keymutex make a lock object per use (``with r.lock(name):``); pottery,
sherlock, tooz and portalocker build one lock object and enter it again and again.
Every case gets its own key, ``bench:<case>:uncontended``, before the library's own
prefix. Latency is per acquire+release pair (``perf_counter_ns`` around each pair).
"""

from __future__ import annotations

import asyncio
import gc
import secrets
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import redis
import redis.asyncio

# KEYS[1] - lock name; ARGV[1] - token. Deletes the key only if it still holds the token;
# returns 1 if it did, 0 if the lock was not ours any more.
COMPARE_AND_DELETE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""

TTL_S = 10
MIN_PAIRS = 20


@dataclass
class Case:
    """One library's acquire+release, ready to be timed."""

    name: str
    distribution: str  # whose version the report shows
    flavour: str  # "sync" or "async"
    pair: Callable[[], object] | Callable[[], Awaitable[object]]
    close: Callable[[], object] = lambda: None
    note: str = ""

    @property
    def short(self) -> str:
        """A label for progress lines."""
        return self.name.replace("keymutex ", "km ").split(" (")[0].split(" +")[0][:24]


@dataclass
class Timing:
    median_us: list[float] = field(default_factory=list)  # one per round
    p90_us: list[float] = field(default_factory=list)
    pairs: list[int] = field(default_factory=list)


def _key(case: str) -> str:
    return f"bench:{case}:uncontended"


def _sync_client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port)


def _async_client(port: int) -> redis.asyncio.Redis:
    return redis.asyncio.Redis(host="127.0.0.1", port=port)


def _ping(port: int, runner: asyncio.Runner) -> Case:
    r = _sync_client(port)
    return Case("PING (floor: 1 round trip)", "redis", "sync", r.ping, r.close)


def _raw(port: int, runner: asyncio.Runner) -> Case:
    r = _sync_client(port)
    compare_and_delete = r.register_script(COMPARE_AND_DELETE)
    key = _key("raw")

    def pair() -> None:
        token = secrets.token_urlsafe(16)
        if not r.set(key, token, nx=True, px=TTL_S * 1000):
            raise RuntimeError("raw baseline: key unexpectedly held")
        compare_and_delete(keys=[key], args=[token])

    return Case("raw SET NX PX + Lua compare-and-delete", "redis", "sync", pair, r.close)


def _redis_py(port: int, runner: asyncio.Runner) -> Case:
    r = _sync_client(port)
    key = _key("redis-py")

    def pair() -> None:
        with r.lock(key, timeout=TTL_S):
            pass

    return Case("redis-py Lock", "redis", "sync", pair, r.close)


def _python_redis_lock(port: int, runner: asyncio.Runner) -> Case:
    import redis_lock

    r = _sync_client(port)
    key = _key("python-redis-lock")

    def pair() -> None:
        with redis_lock.Lock(r, key, expire=TTL_S):
            pass

    return Case("python-redis-lock", "python-redis-lock", "sync", pair, r.close)


def _pottery(port: int, runner: asyncio.Runner) -> Case:
    from pottery import Redlock

    r = _sync_client(port)
    lock = Redlock(key=_key("pottery"), masters={r}, auto_release_time=TTL_S)

    def pair() -> None:
        with lock:
            pass

    return Case("pottery Redlock (1 master)", "pottery", "sync", pair, r.close)


def _sherlock(port: int, runner: asyncio.Runner) -> Case:
    import sherlock

    r = _sync_client(port)
    lock = sherlock.RedisLock(_key("sherlock"), client=r, expire=TTL_S)

    def pair() -> None:
        with lock:
            pass

    return Case("sherlock RedisLock", "sherlock", "sync", pair, r.close)


def _tooz(port: int, runner: asyncio.Runner) -> Case:
    from tooz import coordination

    coordinator = coordination.get_coordinator(
        f"redis://127.0.0.1:{port}?lock_timeout={TTL_S}", b"bench-member"
    )
    coordinator.start()
    lock = coordinator.get_lock(_key("tooz").encode())

    def pair() -> None:
        with lock:
            pass

    return Case("tooz (redis driver) get_lock", "tooz", "sync", pair, coordinator.stop)


def _portalocker(port: int, runner: asyncio.Runner) -> Case:
    import portalocker

    lock = portalocker.RedisLock(
        _key("portalocker"), redis_kwargs={"host": "127.0.0.1", "port": port}
    )

    def pair() -> None:
        with lock:
            pass

    return Case(
        "portalocker RedisLock",
        "portalocker",
        "sync",
        pair,
        note="pub/sub channel lock: a new subscription (connection + keep-alive thread) per"
        " hold; release waits for that thread (thread_sleep_time=0.1 s default)",
    )


def _keymutex_with(port: int, runner: asyncio.Runner) -> Case:
    import keymutex

    locks = keymutex.Locks(f"redis://127.0.0.1:{port}/0", namespace="bench", ttl=TTL_S)
    key = _key("keymutex")

    def pair() -> None:
        with locks.lock(key):
            pass

    return Case(
        "keymutex Locks: with lock() (renew=True)",
        "keymutex",
        "sync",
        pair,
        locks.close,
    )


def _keymutex_acquire(port: int, runner: asyncio.Runner) -> Case:
    import keymutex

    locks = keymutex.Locks(f"redis://127.0.0.1:{port}/0", namespace="bench", ttl=TTL_S)
    key = _key("keymutex-acquire")

    def pair() -> None:
        locks.acquire(key).release()

    return Case("keymutex Locks: acquire() + release()", "keymutex", "sync", pair, locks.close)


def _async_ping(port: int, runner: asyncio.Runner) -> Case:
    r = _async_client(port)
    return Case("PING, asyncio (floor)", "redis", "async", r.ping, lambda: runner.run(r.aclose()))


def _async_raw(port: int, runner: asyncio.Runner) -> Case:
    r = _async_client(port)
    compare_and_delete = r.register_script(COMPARE_AND_DELETE)
    key = _key("raw-async")

    async def pair() -> None:
        token = secrets.token_urlsafe(16)
        if not await r.set(key, token, nx=True, px=TTL_S * 1000):
            raise RuntimeError("raw baseline: key unexpectedly held")
        await compare_and_delete(keys=[key], args=[token])

    return Case(
        "raw SET NX PX + Lua, asyncio", "redis", "async", pair, lambda: runner.run(r.aclose())
    )


def _aioredlock(port: int, runner: asyncio.Runner) -> Case:
    from aioredlock import Aioredlock

    async def make() -> Aioredlock:
        return Aioredlock([{"host": "127.0.0.1", "port": port}])

    manager = runner.run(make())
    key = _key("aioredlock")

    async def pair() -> None:
        async with await manager.lock(key, lock_timeout=TTL_S):
            pass

    return Case(
        "aioredlock (asyncio)",
        "aioredlock",
        "async",
        pair,
        lambda: runner.run(manager.destroy()),
        note="on aioredis 1.3 (its own client, not redis-py)",
    )


def _keymutex_async_with(port: int, runner: asyncio.Runner) -> Case:
    import keymutex

    async def make() -> keymutex.AsyncLocks:
        return keymutex.AsyncLocks(f"redis://127.0.0.1:{port}/0", namespace="bench", ttl=TTL_S)

    locks = runner.run(make())
    key = _key("keymutex-async")

    async def pair() -> None:
        async with locks.lock(key):
            pass

    return Case(
        "keymutex AsyncLocks: async with lock() (renew=True)",
        "keymutex",
        "async",
        pair,
        lambda: runner.run(locks.aclose()),
    )


def _keymutex_async_acquire(port: int, runner: asyncio.Runner) -> Case:
    import keymutex

    async def make() -> keymutex.AsyncLocks:
        return keymutex.AsyncLocks(f"redis://127.0.0.1:{port}/0", namespace="bench", ttl=TTL_S)

    locks = runner.run(make())
    key = _key("keymutex-async-acquire")

    async def pair() -> None:
        lease = await locks.acquire(key)
        await lease.release()

    return Case(
        "keymutex AsyncLocks: acquire() + release()",
        "keymutex",
        "async",
        pair,
        lambda: runner.run(locks.aclose()),
    )


BUILDERS: dict[str, Callable[[int, asyncio.Runner], Case]] = {
    "PING (floor: 1 round trip)": _ping,
    "raw SET NX PX + Lua compare-and-delete": _raw,
    "redis-py Lock": _redis_py,
    "python-redis-lock": _python_redis_lock,
    "pottery Redlock (1 master)": _pottery,
    "sherlock RedisLock": _sherlock,
    "tooz (redis driver) get_lock": _tooz,
    "portalocker RedisLock": _portalocker,
    "keymutex Locks: with lock() (renew=True)": _keymutex_with,
    "keymutex Locks: acquire() + release()": _keymutex_acquire,
    "PING, asyncio (floor)": _async_ping,
    "raw SET NX PX + Lua, asyncio": _async_raw,
    "aioredlock (asyncio)": _aioredlock,
    "keymutex AsyncLocks: async with lock() (renew=True)": _keymutex_async_with,
    "keymutex AsyncLocks: acquire() + release()": _keymutex_async_acquire,
}
PING = "PING (floor: 1 round trip)"
RAW = "raw SET NX PX + Lua compare-and-delete"
ASYNC_PING = "PING, asyncio (floor)"
ASYNC_RAW = "raw SET NX PX + Lua, asyncio"


def _time_pairs(case: Case, runner: asyncio.Runner, pairs: int, budget_s: float) -> list[int]:
    """Nanoseconds of each acquire+release pair: ``pairs`` of them, or fewer (but at least
    ``MIN_PAIRS``) when they take longer than ``budget_s`` in all."""
    clock = time.perf_counter_ns
    give_up_at = clock() + int(budget_s * 1e9)
    if case.flavour == "sync":
        pair_sync: Callable[[], object] = case.pair  # type: ignore[assignment]
        spans = []
        for _ in range(pairs):
            started = clock()
            pair_sync()
            ended = clock()
            spans.append(ended - started)
            if ended > give_up_at and len(spans) >= MIN_PAIRS:
                break
        return spans

    pair_async: Callable[[], Awaitable[object]] = case.pair  # type: ignore[assignment]

    async def loop() -> list[int]:
        spans = []
        for _ in range(pairs):
            started = clock()
            await pair_async()
            ended = clock()
            spans.append(ended - started)
            if ended > give_up_at and len(spans) >= MIN_PAIRS:
                break
        return spans

    return runner.run(loop())


def run(
    port: int,
    rounds: int,
    pairs: int,
    budget_s: float,
    log: Callable[[str], None],
) -> tuple[dict[str, Timing], dict[str, Case], dict[str, str]]:
    """Time every case for ``rounds`` interleaved rounds; the cases that could not run, why.

    Each case is warmed up first (a tenth of ``pairs``); a case slower than ``budget_s``
    per round is cut short there (its pair count is reported).
    """
    runner = asyncio.Runner()
    cases: dict[str, Case] = {}
    failed: dict[str, str] = {}
    for name, build in BUILDERS.items():
        try:
            case = build(port, runner)
            _time_pairs(case, runner, max(50, pairs // 10), budget_s / 4)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}".strip()
            log(f"  {name}: not runnable: {failed[name]}")
            continue
        cases[name] = case
    timings = {name: Timing() for name in cases}
    order = list(cases)
    try:
        for round_ in range(rounds):
            # Rotate the order so that no case always runs right after the same neighbour.
            shift = round_ % len(order)
            for name in order[shift:] + order[:shift]:
                gc.collect()
                try:
                    spans = _time_pairs(cases[name], runner, pairs, budget_s)
                except Exception as exc:
                    failed[name] = f"failed in round {round_ + 1}: {type(exc).__name__}: {exc}"
                    log(f"  {name}: {failed[name]}")
                    order.remove(name)
                    continue
                deciles = statistics.quantiles(spans, n=10)
                timings[name].median_us.append(statistics.median(spans) / 1e3)
                timings[name].p90_us.append(deciles[8] / 1e3)
                timings[name].pairs.append(len(spans))
            log(
                f"  round {round_ + 1}/{rounds} (threads alive: {threading.active_count()}): "
                + ", ".join(
                    f"{case.short} {t.median_us[-1]:.0f}"
                    for case, t in ((cases[n], t) for n, t in timings.items())
                    if len(t.median_us) == round_ + 1
                )
                + " µs"
            )
    finally:
        for name, case in cases.items():
            try:
                case.close()
            except Exception as exc:
                log(f"  {name}: close failed: {exc!r}")
        runner.close()
    for name in failed:
        timings.pop(name, None)
        cases.pop(name, None)
    return timings, cases, failed

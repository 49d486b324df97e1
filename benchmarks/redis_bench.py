"""keymutex's Redis store side by side with the Redis lock libraries people use.

Run: .venv/bin/python benchmarks/redis_bench.py [--quick]

One command does everything: it creates (or updates) its own virtualenv,
benchmarks/.peers/redis-venv, installs there the peers pinned in
benchmarks/redis-peers.txt plus keymutex from this checkout (``pip install -e .[redis]``),
re-executes itself inside it (the peers never enter the project's .venv), starts a
redis-server of its own on a free loopback port (no persistence) and stops it at the end.

Measured in one run, on one server:
1. uncontended acquire+release latency, one client (redis_uncontended.py);
2. 4 processes contending on one key: lost updates, acquires/s, handoff latency,
   fairness (redis_contention.py);
3. 4 processes × 16 tasks or threads on one key: Redis commands per acquire
   (redis_contention.py);
4. 10,000 leases held with renew=True: renewal cost, memory, DBSIZE (redis_hold.py).
Results: benchmarks/results/redis.md and redis.png (redis_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from _common import enter_peer_venv

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PEERS_VENV = HERE / ".peers" / "redis-venv"
PEERS_FILE = HERE / "redis-peers.txt"
FAILURES_FILE = PEERS_VENV / "install-failures.json"
COMMAND = ".venv/bin/python benchmarks/redis_bench.py"


def _keymutex_problem(url: str) -> str | None:
    """Why keymutex's Redis store cannot be benchmarked, or None if it can."""
    try:
        import keymutex

        with keymutex.Locks(url, namespace="bench-probe", ttl=5.0) as locks:
            locks.acquire("probe").release()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@contextmanager
def _client_and_server_on_two_cores(server_pid: int) -> Iterator[str]:
    """Pin this process and redis-server to two different cores, then undo it.

    Unpinned, the scheduler sometimes runs client and server on one core (a round trip
    then costs about 2/3 of the cross-core one here) and moves them mid-measurement,
    which makes per-case medians bimodal. Two cores is how a client meets its server.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        yield "not pinned (fewer than 2 cores)"
        return
    server_cores = os.sched_getaffinity(server_pid)
    os.sched_setaffinity(0, {cores[0]})
    os.sched_setaffinity(server_pid, {cores[1]})
    try:
        yield f"client pinned to core {cores[0]}, redis-server to core {cores[1]}"
    finally:
        os.sched_setaffinity(0, set(cores))
        os.sched_setaffinity(server_pid, server_cores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="part 1 rounds")
    parser.add_argument("--pairs", type=int, default=3000, help="part 1 pairs per case per round")
    parser.add_argument(
        "--budget",
        type=float,
        default=2.0,
        help="part 1: at most this many seconds per case per round",
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="parts 2 and 3 run length")
    parser.add_argument("--contention-rounds", type=int, default=5, help="part 2 rounds")
    parser.add_argument("--coalescing-rounds", type=int, default=3, help="part 3 rounds")
    parser.add_argument("--leases", type=int, default=10_000, help="part 4 leases")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.pairs, args.seconds = 2, 200, 1.0
        args.contention_rounds, args.coalescing_rounds, args.leases = 1, 1, 1000

    if Path(sys.prefix).resolve() != PEERS_VENV.resolve():
        enter_peer_venv(PEERS_VENV, PEERS_FILE, "redis", __file__)  # does not return

    import redis_contention
    import redis_hold
    import redis_report
    import redis_uncontended
    from redis_server import RedisServer

    install_failures: dict[str, str] = (
        json.loads(FAILURES_FILE.read_text()) if FAILURES_FILE.exists() else {}
    )
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    report = redis_report.Report(
        args={**vars(args), "argv": sys.argv[1:]}, install_failures=install_failures
    )
    with RedisServer() as server:
        report.redis_version = server.version()
        log(f"redis-server {report.redis_version} on port {server.port}")
        keymutex_problem = install_failures.get("keymutex") or _keymutex_problem(server.url)
        if keymutex_problem:
            log(f"keymutex is not runnable: {keymutex_problem}")
            report.keymutex_problem = keymutex_problem

        log("part 1: uncontended acquire+release")
        builders = redis_uncontended.BUILDERS
        if keymutex_problem:
            redis_uncontended.BUILDERS = {k: v for k, v in builders.items() if "keymutex" not in k}
        with _client_and_server_on_two_cores(server.pid) as pinned:
            report.pinned = pinned
            report.uncontended, report.cases, report.uncontended_failed = redis_uncontended.run(
                server.port, args.rounds, args.pairs, args.budget, log=log
            )

        log(f"part 2: {redis_contention.PROCESSES} processes on one key")
        names = [
            n for n in redis_contention.CONTENDERS if not (keymutex_problem and "keymutex" in n)
        ]
        for round_ in range(args.contention_rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                if len(report.contention_failed.get(name, ())) >= 2:
                    continue  # broken, not unlucky: spare the time
                try:
                    run = redis_contention.contention(name, server.port, args.seconds)
                except Exception as exc:
                    why = f"round {round_ + 1}: {type(exc).__name__}: {exc}"
                    report.contention_failed.setdefault(name, []).append(why)
                    log(f"  {name}: failed: {why}")
                    continue
                report.contention.setdefault(name, []).append(run)
                log(
                    f"  round {round_ + 1} {name}: {run['acquires/s']:,.0f}/s,"
                    f" handoff p90 {run['handoff p90 ms']:.2f} ms,"
                    f" same holder {run['same holder %']:.0f} %, lost {run['lost updates']}"
                )

        log("part 3: coalescing, 4 processes × 16 tasks/threads on one key")
        names = [
            n for n in redis_contention.COALESCERS if not (keymutex_problem and "keymutex" in n)
        ]
        for round_ in range(args.coalescing_rounds):
            for name in names:
                if len(report.coalescing_failed.get(name, ())) >= 2:
                    continue  # broken, not unlucky: spare the time
                try:
                    run = redis_contention.coalescing(name, server.port, args.seconds)
                except Exception as exc:
                    why = f"round {round_ + 1}: {type(exc).__name__}: {exc}"
                    report.coalescing_failed.setdefault(name, []).append(why)
                    log(f"  {name}: failed: {why}")
                    continue
                report.coalescing.setdefault(name, []).append(run)
                log(
                    f"  round {round_ + 1} {name}: {run['acquires/s']:,.0f}/s,"
                    f" {run['server commands/acquire']:.2f} server commands/acquire,"
                    f" {run['round trips/acquire']:.2f} round trips/acquire"
                )

        if keymutex_problem:
            report.hold = {"error": f"keymutex not runnable: {keymutex_problem}"}
        else:
            log(f"part 4: {args.leases:,} leases held with renew=True")
            report.hold = redis_hold.run(server.port, args.leases, ttl=10.0)
            log(f"  {report.hold}")
    report.seconds = time.monotonic() - started
    report.write()
    print(report.summary())


if __name__ == "__main__":
    main()

"""memcached store: contention on one key (fairness without notifications), and the uncontended cost.

Run: .venv/bin/python benchmarks/bench_memcached.py [--pairs 2000] [--seconds 3]
     [--rounds 3] [--baseline OTHER_memcached.py [--baseline-label TEXT]]
     [--patience 0,0.05,…]

Starts its own memcached (tests/_memcached_fixtures.py: a free loopback port, a
temporary directory) and stops it afterwards: for the uncontended part, one with a
single worker thread (``-t 1``), so that every case's connection is served by the same
thread (see ``main``).

``--baseline`` names another version of ``src/keymutex/stores/memcached.py`` (e.g.
``git show HEAD:src/keymutex/stores/memcached.py > /tmp/memcached_before.py``): it is
loaded as a module of its own and put under a ``Locks`` in place of this checkout's
store, everything else being this checkout's. Both versions then run in the same
rounds, interleaved, on the same server: compare them within one run. ``--patience``
runs this checkout's store once per value of its ``patience`` option (seconds a
waiter polls before it queues; 0 is strict hand-over), as versions of their own.

Uncontended: µs per pair in one process — ``with locks.lock(key, renew=False)`` and
``acquire(key, timeout=0)`` + ``release()`` — taking turns in blocks of 50 calls with the
floor, one ``version`` round trip (pymemcache), and with a bare pair (the store's own
two round trips on a raw socket, with no lock logic); × floor and × baseline (the
baseline's same case) are medians of per-round ratios.

Contention: 4 processes loop on one key for a fixed time; the critical section is a
read-modify-write of a counter file. Acquires/s, lost updates (counter vs
acquisitions), overlaps (a grant before the previous release), handoff p50/p90 (a
release -> another process's acquire returning, on the host's shared clock),
same-holder % (consecutive holds by the process that just released), the busiest
process's share of the grants, the worst wait of a single acquire, and memcached
commands per grant (``stats``: gets, sets, incr, deletes, text or meta; the waiters'
polling shows here).
Rounds rotate the versions; tables show medians over rounds (sums for lost updates
and overlaps, the worst of all rounds for the worst wait). Results go to
benchmarks/results/memcached.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from pymemcache.client.base import Client

import keymutex

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the server helper
from _common import contention_row, load_module
from _common import cpu_model as _cpu
from _common import host_clock as _clock
from _common import percentile as _percentile
from _common import revision as _revision

from _memcached_fixtures import MemcachedServer

PROCESSES = 4
KEY = "counter"
TTL_S = 30.0
WAIT_S = 60.0
WARM_UP = 200
# Uncontended cases take turns in blocks of this many calls, not call by call: on a
# virtual machine a round trip costs from 40 to 100 µs by what the client did just
# before (a call made right after another case's reply is often the cheap one), so a
# call-by-call turn gives each case the state its predecessor left. In a block, each
# call follows its own kind, as in a loop of the user's.
BLOCK = 50
RESULTS = Path(__file__).parent / "results"
CHECKOUT = "checkout"
BASELINE = "baseline"


def _baseline_module(path: str) -> ModuleType:
    return load_module(path, "keymutex_baseline_memcached")


Version = tuple[str | None, float | None]  # a baseline module's path; a patience


def _locks(url: str, namespace: str, version: Version) -> keymutex.Locks:
    """A ``Locks`` on this checkout's store (with a patience), or on the baseline's."""
    baseline, patience = version
    options = {} if patience is None else {"patience": patience}
    locks = keymutex.Locks(url, namespace=namespace, ttl=TTL_S, **options)
    if baseline is not None:
        locks._store.close()
        store = _baseline_module(baseline).driver.open(url, namespace=namespace, options={})
        locks._store = store  # only renew=False is measured: the renewer is never used
    return locks


# -- uncontended -------------------------------------------------------------------------


FLOOR = "floor: `version` (pymemcache)"
BARE = "bare: the store's two round trips on a raw socket, no lock logic"


class _BarePair:
    """What any two-round-trip memcached lock must send, and nothing more: the store's
    own commands with a record of its size (``ms`` add + ``append`` to an index item in
    one write; ``md`` by the CAS the add returned), on one raw socket, with no token,
    lease, validation or pool. The cost of a lock that does no work of its own."""

    RECORD = b"x" * 106  # a lease record's size (key, token, owner, fence, times)
    ENTRY = b"y" * 43 + b" "  # an index entry: a lease digest and a space

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(5.0)  # as the store's sockets: a timeout, so non-blocking
        self.grants = 0

    def _exchange(self, commands: bytes, replies: int) -> bytes:
        self.sock.sendall(commands)
        data = b""
        while data.count(b"\r\n") < replies:
            data += self.sock.recv(65536)
        return data

    def __call__(self) -> None:
        added = self._exchange(
            b"ms bare:l %d T33 c ME\r\n%s\r\nms bare:i %d MA\r\n%s\r\n"
            % (len(self.RECORD), self.RECORD, len(self.ENTRY), self.ENTRY),
            2,
        )
        cas = added.split(b"\r\n", 1)[0].partition(b" c")[2]
        if not added.startswith(b"HD") or not cas.isdigit():
            raise RuntimeError(f"memcached refused the bare add: {added!r}")
        self._exchange(b"md bare:l C%s\r\n" % cas, 1)
        self.grants += 1
        if self.grants % 64 == 0:  # keep the index item small, as the store compacts it
            self._exchange(b"md bare:i\r\n", 1)

    def close(self) -> None:
        self.sock.close()


FORMS = ("`with locks.lock(key, renew=False)`", "`acquire(key, timeout=0)` + `release()`")


def uncontended(
    url: str, port: int, versions: dict[str, Version], pairs: int, rounds: int
) -> dict[str, tuple[float, float, float, float | None]]:
    """case -> (median µs, p90 µs, × floor, × the baseline's same case)."""
    floor = Client(("127.0.0.1", port), default_noreply=False)
    bare = _BarePair(port)
    cases: dict[str, Callable[[], object]] = {FLOOR: floor.version, BARE: bare}
    opened = []
    for version, spec in versions.items():
        locks = _locks(url, f"bench-unc-{uuid.uuid4().hex[:8]}", spec)
        opened.append(locks)

        def with_lock(locks: keymutex.Locks = locks) -> None:
            with locks.lock(KEY, renew=False):
                pass

        def try_once(locks: keymutex.Locks = locks) -> None:
            locks.acquire(KEY, timeout=0).release()

        cases[f"{version}: {FORMS[0]}"] = with_lock
        cases[f"{version}: {FORMS[1]}"] = try_once
    # Each case's counterpart in the baseline, when there is one.
    counterpart = {
        f"{version}: {form}": f"{BASELINE}: {form}"
        for version in versions
        for form in FORMS
        if BASELINE in versions
    }
    medians: dict[str, list[float]] = {name: [] for name in cases}
    p90s: dict[str, list[float]] = {name: [] for name in cases}
    per_floor: dict[str, list[float]] = {name: [] for name in cases}
    per_baseline: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(WARM_UP):
            for call in cases.values():
                call()
        names = list(cases)
        for round_number in range(rounds):
            times: dict[str, list[float]] = {name: [] for name in cases}
            order = names[round_number % len(names) :] + names[: round_number % len(names)]
            for _ in range(pairs // BLOCK):
                for name in order:
                    call = cases[name]
                    for _ in range(BLOCK):
                        started = time.perf_counter()
                        call()
                        times[name].append((time.perf_counter() - started) * 1e6)
            this_round = {name: statistics.median(times[name]) for name in cases}
            for name in cases:
                medians[name].append(this_round[name])
                p90s[name].append(_percentile(times[name], 0.9))
                per_floor[name].append(this_round[name] / this_round[FLOOR])
                if name in counterpart:
                    per_baseline[name].append(this_round[name] / this_round[counterpart[name]])
    finally:
        floor.close()
        bare.close()
        for locks in opened:
            locks.close()
    return {
        name: (
            statistics.median(medians[name]),
            statistics.median(p90s[name]),
            statistics.median(per_floor[name]),
            statistics.median(per_baseline[name]) if per_baseline[name] else None,
        )
        for name in cases
    }


# -- contention --------------------------------------------------------------------------


def _worker(
    url: str,
    baseline: Version,
    namespace: str,
    counter: str,
    seconds: float,
    ready: Any,
    out: Any,
) -> None:
    locks = _locks(url, namespace, baseline)
    with locks.lock(f"warm-{os.getpid()}", renew=False):  # connect before the clock starts
        pass
    path = Path(counter)
    holds: list[tuple[float, float, float]] = []  # asked, acquired, released
    ready.wait(timeout=120)
    deadline = _clock() + seconds
    while (asked := _clock()) < deadline:
        with locks.lock(KEY, timeout=WAIT_S, renew=False):
            acquired = _clock()
            path.write_text(str(int(path.read_text() or "0") + 1))
            released = _clock()
        holds.append((asked, acquired, released))
    locks.close()
    out.put((os.getpid(), holds))


def _commands(server: MemcachedServer) -> int:
    stats = server.stats()
    names = ("cmd_get", "cmd_set", "incr_hits", "incr_misses", "delete_hits", "delete_misses")
    return sum(int(stats[name]) for name in names)


def contention(server: MemcachedServer, baseline: Version, seconds: float) -> dict[str, float]:
    context = mp.get_context("spawn")
    ready = context.Barrier(PROCESSES + 1)
    out = context.Queue()
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="km-bench-mc-") as workdir:
        counter = Path(workdir) / "counter"
        counter.write_text("0")
        processes = [
            context.Process(
                target=_worker,
                args=(server.url, baseline, namespace, str(counter), seconds, ready, out),
                daemon=True,
            )
            for _ in range(PROCESSES)
        ]
        for process in processes:
            process.start()
        try:
            ready.wait(timeout=120)
            commands_before = _commands(server)
            replies = [out.get(timeout=seconds + 120) for _ in processes]
            commands = _commands(server) - commands_before
        finally:
            for process in processes:
                process.join(10)
                if process.is_alive():
                    process.kill()
                    process.join()
        counted = int(counter.read_text())
    holds = sorted(
        (acquired, released, asked, pid)
        for pid, rows in replies
        for asked, acquired, released in rows
    )
    return {
        **contention_row(holds, seconds, counted),
        "busiest %": 100.0 * max(len(rows) for _, rows in replies) / max(1, len(holds)),
        "commands/grant": commands / max(1, len(holds)),
    }


# -- report ------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000, help="pairs per case and round")
    parser.add_argument("--seconds", type=float, default=3.0, help="per contention run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="another memcached.py to compare, in the same run")
    parser.add_argument(
        "--baseline-label", help="what the baseline is, for the report (e.g. 'HEAD 3b9ffd7')"
    )
    parser.add_argument(
        "--patience", help="comma-separated patience values (s) to run this checkout with"
    )
    parser.add_argument("--output", default=str(RESULTS / "memcached.md"))
    args = parser.parse_args()
    versions: dict[str, Version] = {}
    if args.baseline:
        versions[BASELINE] = (str(Path(args.baseline).resolve()), None)
    if args.patience:
        for value in args.patience.split(","):
            versions[f"{CHECKOUT} (patience {float(value):g} s)"] = (None, float(value))
    else:
        versions[CHECKOUT] = (None, None)

    began = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="km-bench-memcached-") as directory,
        MemcachedServer(Path(directory)).start() as server,
    ):
        server_version = server.command("version").split()[-1]
        print("uncontended ...", flush=True)
        # On a server of its own with one worker thread: memcached gives each connection
        # to one of its threads in turn, and on a small virtual machine a round trip to a
        # thread the scheduler keeps beside the client costs 23 µs, to another 85 µs (seen
        # on 2 cores). With one thread, every case's connection is served alike.
        with MemcachedServer(Path(directory) / "uncontended", threads=1).start() as single:
            rows = uncontended(single.url, single.port, versions, args.pairs, args.rounds)
        runs: dict[str, list[dict[str, float]]] = {version: [] for version in versions}
        names = list(versions)
        for round_number in range(args.rounds):
            for version in names[round_number % 2 :] + names[: round_number % 2]:
                print(f"contention round {round_number + 1}: {version} ...", flush=True)
                runs[version].append(contention(server, versions[version], args.seconds))
                print(f"  {runs[version][-1]}", flush=True)
    elapsed = time.monotonic() - began

    command = f".venv/bin/python benchmarks/bench_memcached.py --pairs {args.pairs} --seconds {args.seconds:g} --rounds {args.rounds}"
    if args.baseline:
        command += f" --baseline {args.baseline}"
    if args.baseline_label:
        command += f" --baseline-label '{args.baseline_label}'"
    if args.patience:
        command += f" --patience {args.patience}"
    lines = [
        "## memcached store: fairness without notifications (`benchmarks/bench_memcached.py`)",
        "",
        f"Run on {time.strftime('%Y-%m-%d %H:%M')}: {_cpu()}, {os.cpu_count()} cores, Linux"
        f" {platform.release()}, Python {platform.python_version()}; load average at the end:"
        f" {', '.join(f'{x:.2f}' for x in os.getloadavg())}. memcached {server_version} on"
        f" loopback TCP. keymutex at {_revision()}. Whole run: {elapsed:.0f} s.",
        "",
        f"Command: `{command}`",
        "",
    ]
    if args.baseline:
        lines += [
            f"`{BASELINE}`: the store module `{args.baseline}`"
            + (f" ({args.baseline_label})" if args.baseline_label else "")
            + f"; `{CHECKOUT}`: this checkout's store. Everything else (client, waiting) is"
            " this checkout's.",
            "",
        ]
    lines += [
        f"### Uncontended, one client ({args.rounds} rounds × {args.pairs:,} pairs, in blocks of {BLOCK} calls taking turns)",
        "",
        "| case | median µs | p90 µs | × floor | × baseline |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (median, p90, ratio, relative) in rows.items():
        versus = "" if relative is None else f"{relative:.3f}"
        lines.append(f"| {name} | {median:,.0f} | {p90:,.0f} | {ratio:.2f} | {versus} |")
    lines += [
        "",
        f"### {PROCESSES} processes on one key, critical section a read-modify-write of a"
        f" counter file ({args.rounds} rounds of {args.seconds:g} s)",
        "",
        "| store | acquires/s | lost updates | overlaps | handoff p50 ms | handoff p90 ms"
        " | same holder % | busiest process % | worst wait ms | memcached commands / grant |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for version, results in runs.items():

        def median(field: str, results: list[dict[str, float]] = results) -> float:
            return statistics.median(r[field] for r in results)

        lines.append(
            f"| {version} | {median('acquires/s'):,.0f}"
            f" | {sum(int(r['lost']) for r in results)}"
            f" | {sum(int(r['overlaps']) for r in results)}"
            f" | {median('handoff p50'):,.2f} | {median('handoff p90'):,.2f}"
            f" | {median('same %'):.0f} | {median('busiest %'):.0f}"
            f" | {max(r['worst wait'] for r in results):,.0f}"
            f" | {median('commands/grant'):.1f} |"
        )
    lines += [
        "",
        "Notes:",
        "",
        "- Uncontended: × floor and × baseline are medians of per-round ratios (each"
        f" round runs every case in turns of {BLOCK} calls, so they share its"
        " conditions); the absolute µs move with the machine's load from round to round.",
        "- The bare pair is the floor of any lock that answers both its acquire and its"
        " release (two round trips): the store's own commands, with no token, lease,"
        " validation or pool.",
        "- A handoff is measured only between different processes; with 4 processes a"
        " fair lock gives each about 25 % of the grants and a same-holder share near 0.",
        "- memcached cannot notify: every waiter polls, so commands / grant counts the"
        " waiters' looks as well as the holder's own steps (this checkout, uncontended:"
        " add + append to acquire, one compare-and-delete to release).",
    ]
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

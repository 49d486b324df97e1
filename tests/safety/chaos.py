"""The long safety run (``make chaos``): fenced writes under injected faults, per store.

For each store, four workers (processes of their own, ``_tools/worker.py``) take a lock
on one of three keys, write through it to the protected resource with their fence,
and release, round after round. Meanwhile the injector pauses a worker (SIGSTOP) past
its lease's TTL and resumes it, or kills one (SIGKILL, mid-anything) and starts a new
one, until the resource has accepted ``--writes`` fenced writes. Half the workers renew
their leases (TTL 1 s), half do not (TTL 1 s, well above a round's length).

Then the checkers (``_tools/checkers.py``) read what the workers and the resource
recorded: accepted fences strictly increase per key, no stale write was accepted, no
fence was granted twice; every write the resource refused came from a worker whose
lease already said ``lost`` (a holder learns of its loss, it is not only stopped by
the fence); and, for the record, how many critical sections overlapped in time — the
pauses make them overlap, and fencing is what makes that harmless.

Run: ``make chaos`` (10,000 writes on every store), or with ``tests/`` on
``PYTHONPATH``: ``python -m safety.chaos --writes 2000 --stores sqlite,redis``. The
servers are started here as the test suite starts them, on free loopback ports, and
stopped at the end. ``tests/safety/test_chaos.py`` runs a short version in
``make test``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ._tools.checkers import check_fencing, find_overlaps
from ._tools.faults import kill, paused
from ._tools.history import load_ops
from ._tools.resource import ResourceServer, child_env
from ._tools.worker import WorkerConfig, command

__all__ = ["STORES", "ChaosReport", "chaos_run", "store_server"]

STORES = ("sqlite", "redis", "postgresql", "memcached", "etcd", "zookeeper", "http-sqlite")
WORKERS = 4
KEYS = ("a", "b", "c")
TTL = 1.0  # etcd's shortest lease is 1 s
HOLD = 0.01  # a worker spends much of its time in its critical section: pauses land there


@dataclass
class ChaosReport:
    store: str
    accepted: int = 0  # fenced writes the resource accepted
    rejected: int = 0  # stale writes it refused: what fencing stopped
    stale_accepted: int = 0
    grants: int = 0
    unaware: int = 0  # refused writes whose lease did not say ``lost``
    overlaps: int = 0  # pairs of critical sections of one key overlapping in time
    pauses: int = 0
    kills: int = 0
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations and self.stale_accepted == 0

    def row(self) -> str:
        verdict = "ok" if self.ok else f"**{len(self.violations)} violations**"
        return (
            f"| {self.store} | {self.accepted:,} | {self.grants:,} | {self.rejected:,} |"
            f" {self.stale_accepted} | {self.unaware} | {self.overlaps:,} | {self.pauses} |"
            f" {self.kills} | {self.seconds:.0f} | {verdict} |"
        )


TABLE_HEAD = (
    "| store | fenced writes accepted | grants | stale writes refused | stale accepted"
    " | refused while lease not `lost` | overlapping sections | pauses | kills | seconds"
    " | result |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
)


@contextlib.contextmanager
def store_server(name: str, directory: Path) -> Iterator[str]:
    """A real server for ``name`` on free loopback ports (as the tests start them)."""
    if name == "sqlite":
        yield f"sqlite:///{directory}/locks.db"
    elif name == "redis":
        from _redis_servers import standalone as redis_standalone

        with redis_standalone(directory) as redis:
            yield redis.url
    elif name == "postgresql":
        from _pg_server import running_server

        with running_server() as postgres:
            yield postgres.url
    elif name == "memcached":
        from _memcached_fixtures import MemcachedServer

        with MemcachedServer(directory).start() as memcached:
            yield memcached.url
    elif name == "etcd":
        from _etcd_servers import single

        with single(directory) as etcd:
            yield etcd.url
    elif name == "zookeeper":
        from _zk_servers import standalone as zk_standalone

        with zk_standalone(directory) as zookeeper:
            yield zookeeper.url
    elif name == "http-sqlite":
        from conformance._http_server import _serve

        yield from _serve(f"sqlite:///{directory}/locks.db", directory)
    else:
        raise ValueError(f"unknown store {name!r}; known: {', '.join(STORES)}")


class _Workers:
    """The worker processes of one run; a killed one is replaced by a new one."""

    def __init__(self, url: str, resource: str, directory: Path, seed: int) -> None:
        self.url, self.resource, self.directory = url, resource, directory
        self.namespace = f"chaos-{uuid.uuid4().hex[:8]}"
        self.configs: list[WorkerConfig] = []
        self.slots: list[subprocess.Popen[bytes]] = []
        self.current: list[WorkerConfig] = []  # each slot's worker
        self._seed = seed
        for slot in range(WORKERS):
            self.slots.append(self._start(slot))

    def _start(self, slot: int) -> subprocess.Popen[bytes]:
        name = f"w{slot}.{len(self.configs)}"
        config = WorkerConfig(
            url=self.url,
            resource=self.resource,
            history=str(self.directory / f"{name}.history.jsonl"),
            name=name,
            namespace=self.namespace,
            keys=KEYS,
            rounds=10**9,
            ttl=TTL,
            hold=HOLD,
            renew=slot % 2 == 0,
            timeout=60.0,
            seed=self._seed * 1000 + len(self.configs),
        )
        self.configs.append(config)
        if slot < len(self.current):
            self.current[slot] = config
        else:
            self.current.append(config)
        with open(self.directory / f"{name}.stderr", "ab") as log:
            return subprocess.Popen(command(config), env=child_env(), stdout=log, stderr=log)

    def replace(self, slot: int) -> None:
        kill(self.slots[slot])
        self.slots[slot] = self._start(slot)

    def stop(self) -> None:
        for process in self.slots:
            if process.poll() is None:
                kill(process)  # SIGKILL also ends a stopped process

    def holding(self) -> list[int]:
        """Slots whose worker is in its critical section (by the last line it wrote)."""
        found = []
        for slot, config in enumerate(self.current):
            with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
                with open(config.history, "rb") as file:
                    file.seek(max(0, file.seek(0, 2) - 1024))
                    last = json.loads(file.read().splitlines()[-1])
                if last["type"] == "invoke" and last["op"] in ("cs", "write"):
                    found.append(slot)
        return found

    def dead(self) -> list[str]:
        """Workers that exited by themselves (a crash: see their ``.stderr``)."""
        return [
            f"{c.name} exited with {p.returncode}"
            for c, p in zip(self.current, self.slots, strict=True)
            if p.poll() is not None
        ]


class _AcceptedCounter:
    """Counts accepted writes in the resource's log as it grows."""

    def __init__(self, log: Path) -> None:
        self._log, self._offset, self.count = log, 0, 0

    def update(self) -> int:
        if self._log.exists():
            with self._log.open("rb") as file:
                file.seek(self._offset)
                data = file.read()
            complete = data[: data.rfind(b"\n") + 1]
            self._offset += len(complete)
            self.count += sum(json.loads(line)["accepted"] for line in complete.splitlines())
        return self.count


def chaos_run(
    store: str,
    url: str,
    directory: Path,
    *,
    writes: int,
    seed: int = 0,
    max_seconds: float = 900.0,
    min_faults: int = 0,
    log: Callable[[str], None] = lambda _: None,
) -> ChaosReport:
    """Run the workers and the injector on ``url`` until ``writes`` writes were accepted
    (and at least ``min_faults`` pauses and as many kills were injected); check."""
    rng = random.Random(seed)
    report = ChaosReport(store)
    started = time.monotonic()
    with ResourceServer(directory / "resource.jsonl", fencing=True) as resource:
        workers = _Workers(url, resource.address, directory, seed)
        counter = _AcceptedCounter(directory / "resource.jsonl")
        try:
            while (
                counter.update() < writes
                or report.pauses < min_faults
                or report.kills < min_faults
            ):
                if time.monotonic() - started > max_seconds:
                    report.violations.append(f"only {counter.count} writes in {max_seconds} s")
                    break
                if dead := workers.dead():
                    report.violations.append(f"worker crashed: {dead}")
                    break
                time.sleep(rng.uniform(0.2, 0.6))
                # Mostly a holder in its critical section, sometimes anyone (waiting,
                # acquiring, releasing): pauses and kills land everywhere.
                holding = workers.holding() if rng.random() < 0.7 else []
                slot = rng.choice(holding) if holding else rng.randrange(WORKERS)
                if rng.random() < 0.7 or report.kills >= max(min_faults, report.pauses):
                    with paused(workers.slots[slot]):  # past its TTL: others take its key
                        time.sleep(rng.uniform(1.3 * TTL, 2.5 * TTL))
                    report.pauses += 1
                else:
                    workers.replace(slot)
                    report.kills += 1
                log(
                    f"{store}: {counter.count} writes, {report.pauses} pauses, {report.kills} kills"
                )
        finally:
            workers.stop()
        entries = resource.entries()
    report.seconds = time.monotonic() - started
    ops = load_ops(c.history for c in workers.configs)
    fencing = check_fencing(entries, ops)
    report.accepted, report.rejected = fencing.accepted, fencing.rejected
    report.stale_accepted, report.grants = fencing.stale_accepted, fencing.grants
    report.violations += [str(v) for v in fencing.violations]
    refused = [o for o in ops if o.op == "write" and o.result == "fail"]
    unaware = [o for o in refused if o.extra.get("lost") is not True]
    report.unaware = len(unaware)
    report.violations += [
        f"write of {o.process} refused while its lease did not say lost: key {o.key!r},"
        f" fence {o.fence}, largest accepted {o.extra.get('last')}, invoked {o.invoke:.3f}"
        for o in unaware
    ]
    report.overlaps = len(find_overlaps(ops))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=10_000)
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the histories and logs")
    args = parser.parse_args(argv)
    names = [n for n in args.stores.split(",") if n]
    reports = []
    for name in names:
        directory = Path(tempfile.mkdtemp(prefix=f"keymutex-chaos-{name}-"))
        try:
            with store_server(name, directory) as url:
                report = chaos_run(
                    name,
                    url,
                    directory,
                    writes=args.writes,
                    seed=args.seed,
                    log=lambda line: print(line, file=sys.stderr, flush=True),
                )
        finally:
            if args.keep:
                print(f"{name}: histories and logs kept in {directory}", file=sys.stderr)
            else:
                shutil.rmtree(directory, ignore_errors=True)
        reports.append(report)
        for violation in report.violations[:20]:
            print(f"{name}: {violation}", file=sys.stderr)
    print(f"\n{TABLE_HEAD}")
    for report in reports:
        print(report.row())
    print(
        f"\nCommand: make chaos (python -m safety.chaos --writes {args.writes} --seed {args.seed})"
    )
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())

"""A worker: takes a keymutex lock, writes through it to the resource, logs its history.

Each round: ``acquire`` the key (waiting up to ``--timeout``), enter the critical
section (``cs``), sleep ``--hold`` seconds (the window faults aim at), ``write`` to the
resource with the lease's fence, leave the section, ``release``. Every step is an
operation of the history (``history.HistoryWriter``), with its invoke and complete
times, result and fence. The worker does not look at ``lease.lost`` before writing: it
plays the process that was paused right after its last check, which is exactly the case
fencing exists for.

Run as a process: ``python -m safety._tools.worker --url URL --resource HOST:PORT
--history FILE ...``, or in this process with ``run(WorkerConfig(...))`` (threads, for
``memory://``). ``--start-file`` makes it wait until that file exists, so that every
worker contends at once.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from dataclasses import dataclass

import keymutex

from .history import HistoryWriter
from .resource import ResourceClient

__all__ = ["WorkerConfig", "run"]


@dataclass(frozen=True)
class WorkerConfig:
    url: str
    resource: str
    history: str
    name: str = ""
    namespace: str = ""
    keys: tuple[str, ...] = ("k",)
    rounds: int = 10
    ttl: float = 5.0
    hold: float = 0.0
    timeout: float = 30.0
    renew: bool = False
    start_file: str = ""
    seed: int = 0
    socket_timeout: float | None = None


def _open(config: WorkerConfig) -> keymutex.Locks:
    options: dict[str, object] = {}
    if config.socket_timeout is not None:
        options["socket_timeout"] = config.socket_timeout
    return keymutex.Locks(
        config.url, namespace=config.namespace, ttl=config.ttl, owner=config.name, **options
    )


def run(config: WorkerConfig) -> None:
    name = config.name or f"w{os.getpid()}"
    rng = random.Random(config.seed)
    history = HistoryWriter(config.history, name)
    resource = ResourceClient(config.resource, name)
    locks = _open(config)
    try:
        history.note("ready", pid=os.getpid())
        if config.start_file:
            while not os.path.exists(config.start_file):
                time.sleep(0.005)
        for round_ in range(config.rounds):
            key = rng.choice(config.keys)
            _one_round(config, name, round_, key, locks, history, resource)
    finally:
        locks.close()
        resource.close()
        history.close()


def _one_round(
    config: WorkerConfig,
    name: str,
    round_: int,
    key: str,
    locks: keymutex.Locks,
    history: HistoryWriter,
    resource: ResourceClient,
) -> None:
    ttl = None if config.renew else config.ttl  # a renewed lease does not expire by itself
    op = history.invoke("acquire", key, ttl=ttl, pid=os.getpid())
    try:
        lease = locks.acquire(
            key,
            timeout=config.timeout,
            renew=config.renew,
            on_lost=lambda lost: history.note("on_lost", key=key, fence=lost.fence),
        )
    except keymutex.Locked:
        history.complete(op, "fail")
        return
    except keymutex.StoreError as exc:
        history.complete(op, "info", error=str(exc))
        return
    lease_id = f"{name}:{round_}"
    history.complete(op, "ok", fence=lease.fence, lease=lease_id, remaining=lease.remaining)
    section = history.invoke("cs", key, fence=lease.fence, lease=lease_id)
    if config.hold:
        # Not time.sleep: under libfaketime with FAKETIME_DONT_FAKE_MONOTONIC (the clock
        # jump scenario) its clock_nanosleep fails with EINVAL; a timed wait does not.
        threading.Event().wait(config.hold)
    value = f"{name}:{round_}"
    op = history.invoke("write", key, fence=lease.fence, lease=lease_id, value=value)
    accepted, last = resource.write(key, lease.fence, value)
    history.complete(op, "ok" if accepted else "fail", last=last, lost=lease.lost)
    history.complete(section, "ok")
    op = history.invoke("release", key, fence=lease.fence, lease=lease_id, ttl=ttl)
    try:
        lease.release()
    except keymutex.LockLost:
        history.complete(op, "fail")
    except keymutex.StoreError as exc:
        history.complete(op, "info", error=str(exc))
    else:
        history.complete(op, "ok")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--resource", required=True)
    parser.add_argument("--history", required=True)
    parser.add_argument("--name", default="")
    parser.add_argument("--namespace", default="")
    parser.add_argument("--keys", default="k")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ttl", type=float, default=5.0)
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--renew", action="store_true")
    parser.add_argument("--start-file", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--socket-timeout", type=float, default=None)
    args = parser.parse_args(argv)
    run(
        WorkerConfig(
            url=args.url,
            resource=args.resource,
            history=args.history,
            name=args.name,
            namespace=args.namespace,
            keys=tuple(args.keys.split(",")),
            rounds=args.rounds,
            ttl=args.ttl,
            hold=args.hold,
            timeout=args.timeout,
            renew=args.renew,
            start_file=args.start_file,
            seed=args.seed,
            socket_timeout=args.socket_timeout,
        )
    )


def command(config: WorkerConfig) -> list[str]:
    """The command line that runs ``config`` in a process of its own."""
    args = [sys.executable, "-m", "safety._tools.worker"]
    args += ["--url", config.url, "--resource", config.resource, "--history", config.history]
    args += ["--name", config.name, "--namespace", config.namespace]
    args += ["--keys", ",".join(config.keys), "--rounds", str(config.rounds)]
    args += ["--ttl", str(config.ttl), "--hold", str(config.hold)]
    args += ["--timeout", str(config.timeout), "--seed", str(config.seed)]
    if config.renew:
        args.append("--renew")
    if config.start_file:
        args += ["--start-file", config.start_file]
    if config.socket_timeout is not None:
        args += ["--socket-timeout", str(config.socket_timeout)]
    return args


if __name__ == "__main__":
    main()

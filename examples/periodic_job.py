"""Story 4, the periodic job: only one instance runs at a time, whichever worker fires it.

A scheduler (Celery beat, cron on several hosts, a Kubernetes CronJob with replicas)
fires the nightly report on every worker at once. Each worker wraps the job in
``@locks.locked(..., timeout=0)``: the first one runs it, the others skip at once and
say who is running it (host and pid are in the holder's info). The lease is renewed
while the job runs, and a crashed worker's lease expires after its TTL.

    python examples/periodic_job.py [REDIS_URL]      # default: $KEYMUTEX_STORE or redis://127.0.0.1:6379/0

Redis needs ``pip install 'keymutex[redis]'``; any other store URL works the same, e.g.
``sqlite:///tmp/jobs.db`` or a lock server's ``http://127.0.0.1:7420``.

Each worker records what it did as JSON lines, so the claims can be checked: the runs
never overlap, and every run has a larger fence than the one before. ``--record FILE``
keeps that record in FILE (replacing what it held); without it, the record lives in a
temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from _shared import check_shared_store, ctrl_c_ignored, with_record

import keymutex

WORKERS = 4
TICKS = 3  # the scheduler fires the job this many times on every worker
JOB_SECONDS = 0.8


def worker(url: str, namespace: str, number: int, record: str, fire: Any) -> None:
    with keymutex.Locks(url, namespace=namespace, ttl=5) as locks:
        info = {"host": socket.gethostname(), "pid": os.getpid(), "worker": number}

        @locks.locked("job:nightly-report", timeout=0, info=info)
        def nightly_report(tick: int) -> None:
            lease_holder = locks.holder("job:nightly-report")
            fence = lease_holder.fence if lease_holder else -1
            started = time.time()
            time.sleep(JOB_SECONDS)  # the report itself
            write(
                record,
                {"worker": number, "tick": tick, "ran": [started, time.time()], "fence": fence},
            )

        for tick in range(TICKS):
            fire.wait()  # the scheduler fires the job on every worker at the same moment
            try:
                nightly_report(tick)
            except keymutex.Locked as refused:
                holder = refused.holder
                who = holder.info if holder else None
                # One write per line: print() writes the text and its newline apart, and
                # the workers' lines ran into each other.
                sys.stdout.write(
                    f"worker {number}, tick {tick}: skipped, already running on {who}\n"
                )
                sys.stdout.flush()
                write(record, {"worker": number, "tick": tick, "skipped_for": who})


def write(record: str, entry: dict[str, object]) -> None:
    with open(record, "a", encoding="utf-8") as file:
        file.write(json.dumps(entry) + "\n")


def play(url: str, record: str) -> int:
    """The scheduler fires the job on every worker, TICKS times; prints who ran it."""
    namespace = f"periodic-{os.getpid()}"
    fire = multiprocessing.Barrier(WORKERS)
    processes = [
        multiprocessing.Process(target=worker, args=(url, namespace, n, record, fire))
        for n in range(WORKERS)
    ]
    try:
        with ctrl_c_ignored():
            for process in processes:
                process.start()
        for process in processes:
            process.join()
    finally:
        for process in processes:
            if process.is_alive():  # interrupted: no worker is left behind
                process.terminate()
                process.join()
    if any(process.exitcode for process in processes):
        print("a worker failed", file=sys.stderr)
        return 1
    entries = [json.loads(line) for line in Path(record).read_text().splitlines()]
    runs = sorted((e for e in entries if "ran" in e), key=lambda e: e["ran"][0])
    print(
        f"{len(runs)} runs for {TICKS} ticks on {WORKERS} workers;"
        f" {len(entries) - len(runs)} skips"
    )
    for run in runs:
        print(f"tick {run['tick']}: ran on worker {run['worker']} with fence {run['fence']}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "url", nargs="?", default=os.environ.get("KEYMUTEX_STORE", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--record", help="JSON-lines file of what each worker did")
    args = parser.parse_args()
    check_shared_store(parser, args.url, "sqlite:///tmp/jobs.db")
    return with_record(lambda record: play(args.url, record), args.record, "runs.jsonl")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(
            "interrupted: the workers were stopped; a lease they held expires after its TTL",
            file=sys.stderr,
        )
        sys.exit(130)

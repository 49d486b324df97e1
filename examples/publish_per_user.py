"""Story 1: one publishing job per user, across serverless workers.

A user uploads media; a worker stores it, resizes it, sends it to compliance checks,
then publishes it. While one upload of a user is in that pipeline, another upload of
the same user is answered at once — "already publishing, held by …" — instead of
waiting; other users never wait. Each request runs in a worker process of its own, as
serverless invocations do, so an in-process lock would be useless: the lock lives in
the store named by the URL (PostgreSQL here; a MongoDB URL works unchanged).

What happens, on a timeline (seconds from the start):

- alice uploads (0.0); her second upload (0.5) is refused at once, naming the worker
  that holds the lock, the upload and since when; her third (1.7) goes through;
- bob's upload (0.1) runs at the same time as alice's: other users do not wait;
- carol's first upload fails its compliance check: the ``with`` block releases the
  lock, and her next upload (1.1) goes through at once;
- dave's worker dies in the middle of resizing (0.6): nobody releases, so his next
  upload (1.4) is refused, until the lease expires (its TTL, 2 s, is no longer renewed)
  and his last upload (3.0) goes through, with a larger fence.

    python examples/publish_per_user.py URL [--record FILE]
    # URL: postgresql://user@host/db, mongodb://host/db, sqlite:///tmp/p.db, ... (default: $KEYMUTEX_STORE)

Every worker appends what it did to a JSON-lines record, so the claims can be checked
from what happened rather than from the lines printed here. ``--record FILE`` keeps that
record in FILE (replacing what it held); without it, the record lives in a temporary
directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from _shared import check_shared_store, ctrl_c_ignored, with_record

import keymutex

TTL = 2.0  # a dead worker's lock frees itself this long after its last renewal
STEPS = ("store", "resize", "compliance", "publish")
STEP_SECONDS = 0.3


@dataclass(frozen=True)
class Request:
    """One upload, handled by one worker invocation at ``at`` seconds from the start."""

    at: float
    user: str
    upload: str
    fault: str | None = None  # "reject": compliance fails; "crash": the worker dies


REQUESTS = (
    Request(0.0, "alice", "a1"),
    Request(0.1, "bob", "b1"),
    Request(0.2, "carol", "c1", fault="reject"),
    Request(0.3, "dave", "d1", fault="crash"),
    Request(0.5, "alice", "a2"),
    Request(1.1, "carol", "c2"),
    Request(1.4, "dave", "d2"),
    Request(1.7, "alice", "a3"),
    Request(3.0, "dave", "d3"),
)


class ComplianceError(Exception):
    """The compliance check refused the media."""


class Record:
    """The JSON-lines record that every worker appends to (one line per write)."""

    def __init__(self, path: str, worker: str) -> None:
        self.path = path
        self.worker = worker

    def write(self, event: str, request: Request, **fields: Any) -> None:
        entry = {
            "event": event,
            "worker": self.worker,
            "user": request.user,
            "upload": request.upload,
            "t": time.time(),
            **fields,
        }
        line = (json.dumps(entry) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write with O_APPEND: lines never interleave
        finally:
            os.close(fd)


def clock(seconds: float) -> str:
    return datetime.fromtimestamp(seconds).strftime("%H:%M:%S.%f")[:-3]


def publish(locks: keymutex.Locks, request: Request, record: Record) -> None:
    """Handle one upload: the four steps under the user's lock, or an answer at once."""
    asked = time.time()
    info = {
        "worker": record.worker,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "upload": request.upload,
    }
    try:
        # timeout=0: try once and answer now. The lease is renewed while the block
        # runs, and released when it ends, also when a step raises.
        with locks.lock(f"publish:{request.user}", timeout=0, info=info) as lease:
            record.write(
                "start",
                request,
                fence=lease.fence,
                acquired_at=lease.acquired_at,
                expires_at=lease.expires_at,
                answered_in=time.time() - asked,
            )
            print(f"{request.user}: upload {request.upload} publishing (fence {lease.fence})")
            for step in STEPS:
                if request.fault == "crash" and step == "resize":
                    record.write("crash", request, step=step, fence=lease.fence)
                    print(f"{request.user}: worker {record.worker} dies while resizing")
                    os._exit(3)  # no clean-up of any kind: the lease is left to expire
                if request.fault == "reject" and step == "compliance":
                    raise ComplianceError(f"the compliance check refused upload {request.upload}")
                time.sleep(STEP_SECONDS)
                record.write("step", request, step=step)
        record.write("done", request)
        print(f"{request.user}: upload {request.upload} published")
    except keymutex.Locked as refused:
        holder = refused.holder
        answered_in = time.time() - asked
        seen = None
        if holder is not None:
            seen = {
                "owner": holder.owner,
                "info": holder.info,
                "fence": holder.fence,
                "acquired_at": holder.acquired_at,
                "expires_at": holder.expires_at,
            }
        record.write("refused", request, answered_in=answered_in, holder=seen)
        who = "someone"
        if holder is not None and holder.info:
            who = (
                f"worker {holder.info['worker']} (upload {holder.info['upload']},"
                f" pid {holder.info['pid']} on {holder.info['host']})"
                f" since {clock(holder.acquired_at)}"
            )
        print(
            f"{request.user}: upload {request.upload} answered in {answered_in * 1000:.0f} ms:"
            f" already publishing, held by {who}"
        )
    except ComplianceError as error:
        record.write("failed", request, error=str(error))
        print(f"{request.user}: upload {request.upload} failed ({error}); lock released")


def worker(
    url: str,
    namespace: str,
    number: int,
    request: Request,
    record_path: str,
    ready: Any,
    go: Any,
) -> None:
    """One serverless invocation: its own process, its own client."""
    record = Record(record_path, f"w{number}")
    with keymutex.Locks(url, namespace=namespace, ttl=TTL) as locks:
        locks.holder("warm-up")  # connect now, not on the clock
        ready.wait()
        while go.value == 0.0:
            time.sleep(0.001)
        delay = go.value + request.at - time.time()
        if delay > 0:
            time.sleep(delay)
        publish(locks, request, record)


def play(url: str, record: str) -> int:
    """Every request in a worker process of its own, each at its time; prints how many
    leases were left. 0 if every worker exited as planned (only the crashing one died)."""
    namespace = f"publish-{uuid.uuid4().hex[:8]}"
    context = multiprocessing.get_context("spawn")  # fresh interpreters, as serverless
    ready = context.Barrier(len(REQUESTS) + 1)
    go = context.Value("d", 0.0)
    processes = [
        context.Process(target=worker, args=(url, namespace, n, request, record, ready, go))
        for n, request in enumerate(REQUESTS, start=1)
    ]
    try:
        with ctrl_c_ignored():
            for process in processes:
                process.start()
        ready.wait(120)
        go.value = time.time() + 0.05
        for process in processes:
            process.join(60)
    finally:
        for process in processes:
            if process.is_alive():  # interrupted (or stuck): no worker is left behind
                process.terminate()
                process.join()

    crashed = {f"w{n}" for n, r in enumerate(REQUESTS, start=1) if r.fault == "crash"}
    unexpected = [
        (f"w{n}", process.exitcode)
        for n, process in enumerate(processes, start=1)
        if process.exitcode != (3 if f"w{n}" in crashed else 0)
    ]
    with keymutex.Locks(url, namespace=namespace) as locks:
        left = locks.holders("publish:")
    Record(record, "main").write(
        "end", Request(0.0, "", ""), leases_left=len(left), unexpected_exits=unexpected
    )
    print(f"leases left after the last upload: {len(left)}")
    if unexpected:
        print(f"workers that exited unexpectedly: {unexpected}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", default=os.environ.get("KEYMUTEX_STORE"))
    parser.add_argument("--record", help="JSON-lines file of what every worker did")
    args = parser.parse_args()
    if not args.url:
        parser.error(
            "give a store URL (postgresql://…, mongodb://…, sqlite:///tmp/p.db) or set"
            " $KEYMUTEX_STORE"
        )
    check_shared_store(parser, args.url, "sqlite:///tmp/p.db")
    return with_record(lambda record: play(args.url, record), args.record, "publish.jsonl")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(
            "interrupted: the workers were stopped; a lease they held expires after its"
            f" {TTL:.0f} s TTL",
            file=sys.stderr,
        )
        sys.exit(130)

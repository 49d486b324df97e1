"""Story 2: orders queued per user in an asyncio web service.

Two orders of the same user must run one after the other; orders of different users
run in parallel. A dict of ``asyncio.Lock`` per user grows forever; one global lock
serialises everybody. ``keymutex.AsyncKeyedLock`` keeps an entry only while a user
has an order running or waiting, whatever errors or cancellations happen.

Round 1 runs the service in one process on ``AsyncKeyedLock``. Round 2 runs the very
same handler in two service processes (as two workers behind a load balancer) on
``keymutex.AsyncLocks("sqlite:///…")``: only the line that makes ``user_lock``
changes.

    python examples/orders_per_user.py
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _shared import ctrl_c_ignored

import keymutex

STEP = 0.05  # seconds per step of an order: reserve stock, then charge the card
CLIENT_GIVES_UP_AFTER = 0.03  # seconds before a client disconnects (see C2)


@dataclass(frozen=True)
class Order:
    user: str
    order_id: str
    declined: bool = False  # the card is declined in the middle of the order
    client_gone: bool = False  # the client disconnects while the order waits


ORDERS = [
    Order("alice", "A1"),
    Order("bob", "B1"),
    Order("carol", "C1"),
    Order("dave", "D1"),
    Order("alice", "A2"),
    Order("bob", "B2", declined=True),
    Order("carol", "C2", client_gone=True),
    Order("alice", "A3"),
    Order("bob", "B3"),
]


class PaymentDeclined(Exception):
    pass


UserLock = Callable[[str], AbstractAsyncContextManager[Any]]
Event = tuple[float, str, str, str, str]  # (time, where, user, order, what)


# -- the service: the same code in both rounds ---------------------------------------


async def handle_order(order: Order, user_lock: UserLock, events: list[Event], where: str) -> str:
    """The request handler: one order of one user, never two of a user at once."""

    def log(what: str) -> None:
        events.append((time.time(), where, order.user, order.order_id, what))

    entered = False
    try:
        async with user_lock(f"user:{order.user}"):
            entered = True
            log("start")
            try:
                await asyncio.sleep(STEP)  # reserve stock
                if order.declined:
                    raise PaymentDeclined
                await asyncio.sleep(STEP)  # charge the card
            except PaymentDeclined:
                log("failed: card declined")
                return "402 Payment Required"
            log("done")
            return "201 Created"
    except asyncio.CancelledError:
        log("cancelled: client gone " + ("while running" if entered else "while waiting"))
        raise


async def serve(orders: Iterable[Order], user_lock: UserLock, where: str) -> list[Event]:
    """Handle the orders as concurrent requests; a gone client cancels its request."""
    events: list[Event] = []
    tasks = []
    for order in orders:
        task = asyncio.create_task(handle_order(order, user_lock, events, where))
        if order.client_gone:
            asyncio.get_running_loop().call_later(CLIENT_GIVES_UP_AFTER, task.cancel)
        tasks.append(task)
    await asyncio.gather(*tasks, return_exceptions=True)
    return events


# -- round 1: one process, AsyncKeyedLock --------------------------------------------


@asynccontextmanager
async def sampling(akl: keymutex.AsyncKeyedLock, seen: list[int]) -> AsyncIterator[None]:
    """Record ``len(akl)`` every few milliseconds while the block runs."""

    async def sample() -> None:
        while True:
            seen.append(len(akl))
            await asyncio.sleep(0.005)

    sampler = asyncio.create_task(sample())
    try:
        yield
    finally:
        sampler.cancel()


async def round_in_one_process() -> tuple[list[Event], int, int]:
    user_lock = keymutex.AsyncKeyedLock()  # <- the line that changes in round 2
    sizes: list[int] = []
    async with sampling(user_lock, sizes):
        events = await serve(ORDERS, user_lock, "service")
    return events, max(sizes), len(user_lock)


# -- round 2: two processes, AsyncLocks on SQLite ------------------------------------


async def worker(index: int, url: str) -> None:
    """One of the service processes: handles every other order, prints its events."""
    async with keymutex.AsyncLocks(url) as locks:
        user_lock = locks.lock  # <- the only change: AsyncKeyedLock() -> AsyncLocks(url).lock
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # "go": both processes start at once
        events = await serve(ORDERS[index::2], user_lock, f"worker-{index + 1}")
    print(json.dumps(events), flush=True)


def round_in_two_processes(url: str) -> tuple[list[Event], int]:
    workers: list[subprocess.Popen[str]] = []
    events: list[Event] = []
    try:
        with ctrl_c_ignored():
            for index in range(2):
                workers.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "--worker", str(index), url],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
        for process in workers:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "ready"
        for process in workers:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        for process in workers:
            output, _ = process.communicate(timeout=60)
            assert process.returncode == 0, f"a worker failed (exit {process.returncode})"
            events.extend(tuple(event) for event in json.loads(output))
    finally:
        for process in workers:
            if process.poll() is None:  # interrupted or failed: no worker is left behind
                process.kill()
            process.communicate()  # closes its pipes
    with keymutex.Locks(url) as locks:
        left = len(locks.holders("user:"))
    return sorted(events), left


# -- what happened -------------------------------------------------------------------


def intervals(events: list[Event]) -> dict[str, list[tuple[float, float, str]]]:
    """Per user: (start, end, order) of every order that got the lock, by start."""
    starts: dict[str, float] = {}
    per_user: dict[str, list[tuple[float, float, str]]] = {}
    for at, _, user, order_id, what in sorted(events):
        if what == "start":
            starts[order_id] = at
        elif order_id in starts:
            per_user.setdefault(user, []).append((starts.pop(order_id), at, order_id))
    return {user: sorted(spans) for user, spans in sorted(per_user.items())}


def report(events: list[Event]) -> None:
    began = min(at for at, *_ in events)
    for at, where, user, order_id, what in sorted(events):
        print(f"  +{at - began:.3f}s  {where:<9} {user:<6} {order_id}  {what}")
    spans = intervals(events)
    for user, user_spans in spans.items():
        serial = all(
            end <= next_start for (_, end, _), (next_start, _, _) in itertools.pairwise(user_spans)
        )
        chain = " -> ".join(order_id for _, _, order_id in user_spans)
        verdict = "one after the other" if serial else "OVERLAPPED"
        print(f"  {user:<6} {chain}: {verdict if len(user_spans) > 1 else 'one order'}")
    overlap = next(
        (
            (a, b)
            for a, spans_a in spans.items()
            for b, spans_b in spans.items()
            if a < b
            for start_a, end_a, _ in spans_a
            for start_b, end_b, _ in spans_b
            if start_a < end_b and start_b < end_a
        ),
        None,
    )
    if overlap:
        print(f"  different users in parallel: yes ({overlap[0]} and {overlap[1]} overlapped)")
    else:
        print("  different users in parallel: no")


def main() -> None:
    print("Story 2: orders queued per user in an asyncio web service.")
    print(
        f"{len(ORDERS)} orders arrive at once; each takes two {STEP * 1000:.0f} ms steps."
        " B2's card is declined; C2's client\ndisconnects while C2 waits. The handler:"
        '  async with user_lock(f"user:{order.user}"): ...\n'
    )
    print("Round 1: one process,  user_lock = keymutex.AsyncKeyedLock()")
    events, busiest, left = asyncio.run(round_in_one_process())
    report(events)
    print(f"  entries in the AsyncKeyedLock while orders ran: up to {busiest}")
    print(f"  entries in the AsyncKeyedLock after the last order: {left}\n")

    with tempfile.TemporaryDirectory(prefix="keymutex-orders-") as directory:
        url = f"sqlite://{Path(directory) / 'locks.db'}"
        print(f'Round 2: two processes,  user_lock = keymutex.AsyncLocks("{url}").lock')
        print("  (the same handler; every other order goes to each worker; across processes")
        print("  a user's orders run in the order they reached the store)")
        events, left = round_in_two_processes(url)
        report(events)
        print(f"  leases left in the store after the last order: {left}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        asyncio.run(worker(int(sys.argv[2]), sys.argv[3]))
    else:
        try:
            main()
        except KeyboardInterrupt:
            print(
                "interrupted: the orders were stopped, and the service processes of round 2"
                " if it had begun",
                file=sys.stderr,
            )
            sys.exit(130)

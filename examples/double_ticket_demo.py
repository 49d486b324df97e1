"""Story 3: a double click buys two tickets; one keymutex lock per user stops it.

Several users each click "Buy" twice. Every click is a separate process (as when two
requests land on two workers of a service). Each one checks "has this user a ticket
for this event?", waits for the order service (a sleep), and creates a ticket if
there was none. Without a lock both clicks of a user pass the check before either
creates its ticket: duplicates. With ``keymutex.Locks("sqlite:///…")`` and one lock
per user id around check-and-create, the second click sees the first one's ticket.

Run it with ``make demo`` (or ``python examples/double_ticket_demo.py``). Its files
live in a temporary directory that is removed at the end.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _shared import ctrl_c_ignored

import keymutex

EVENT = "concert-2031-06-21"
USERS = ["alice", "bob", "carol"]
CLICKS_PER_USER = 2
ORDER_SERVICE_DELAY = 0.25  # seconds between "no ticket yet" and "ticket created"


def open_tickets(path: Path) -> sqlite3.Connection:
    connection = sqlite3.connect(path, timeout=30, isolation_level=None)
    connection.execute(
        "CREATE TABLE IF NOT EXISTS tickets (id INTEGER PRIMARY KEY, user_id TEXT,"
        " event_id TEXT, pid INTEGER, created_at REAL)"
    )
    return connection


def buy_ticket(tickets: sqlite3.Connection, user: str) -> tuple[bool, int, float]:
    """What the service does per click: check, then create. Not atomic on its own.

    Returns (created, ticket id, when the check saw no ticket or found one).
    """
    row = tickets.execute(
        "SELECT id FROM tickets WHERE user_id = ? AND event_id = ?", (user, EVENT)
    ).fetchone()
    checked_at = time.time()
    if row is not None:
        return False, row[0], checked_at
    time.sleep(ORDER_SERVICE_DELAY)  # the order service takes its time
    cursor = tickets.execute(
        "INSERT INTO tickets (user_id, event_id, pid, created_at) VALUES (?, ?, ?, ?)",
        (user, EVENT, os.getpid(), time.time()),
    )
    assert cursor.lastrowid is not None
    return True, cursor.lastrowid, checked_at


def click(user: str, demo_dir: str, locks_url: str | None, start: Any, results: Any) -> None:
    """One click, in its own process: buy a ticket, report what happened."""
    tickets = open_tickets(Path(demo_dir) / "tickets.db")
    start.wait()  # every click starts at once, as a double click does
    clicked_at = time.time()
    fence = None
    if locks_url is None:
        created, ticket, checked_at = buy_ticket(tickets, user)
    else:
        with keymutex.Locks(locks_url) as locks, locks.lock(f"ticket:{user}") as lease:
            fence = lease.fence
            created, ticket, checked_at = buy_ticket(tickets, user)
    tickets.close()
    results.put(
        {
            "user": user,
            "pid": os.getpid(),
            "clicked_at": clicked_at,
            "checked_at": checked_at,
            "done_at": time.time(),
            "created": created,
            "ticket": ticket,
            "fence": fence,
        }
    )


def play(demo_dir: Path, locks_url: str | None) -> tuple[int, int]:
    """Every user clicks twice at once; prints what happened; (tickets, duplicates)."""
    tickets_path = demo_dir / "tickets.db"
    tickets_path.unlink(missing_ok=True)
    open_tickets(tickets_path).close()
    context = multiprocessing.get_context("spawn")
    clicks = [user for user in USERS for _ in range(CLICKS_PER_USER)]
    start = context.Barrier(len(clicks))
    results = context.Queue()
    processes = [
        context.Process(target=click, args=(user, str(demo_dir), locks_url, start, results))
        for user in clicks
    ]
    try:
        with ctrl_c_ignored():
            for process in processes:
                process.start()
        reports = [results.get(timeout=60) for _ in processes]
        for process in processes:
            process.join()
            assert process.exitcode == 0, f"a click process failed (exit {process.exitcode})"
    finally:
        for process in processes:
            if process.is_alive():  # interrupted or failed: no click is left behind
                process.terminate()
                process.join()

    began = min(report["clicked_at"] for report in reports)
    for r in sorted(reports, key=lambda r: (r["user"], r["checked_at"])):
        who = f"  {r['user']:<6} pid {r['pid']:<7}"
        if r["fence"] is None:
            got = ""
        else:
            waited = r["checked_at"] - r["clicked_at"]
            got = f"locked (fence {r['fence']})"
            got += f" after {waited:.2f}s, " if waited >= 0.05 else " at once, "
        seen = "no ticket yet" if r["created"] else f"has ticket #{r['ticket']}: done"
        line = f"{who} +{r['checked_at'] - began:.2f}s {got}{seen}"
        if r["created"]:
            line += f"; +{r['done_at'] - began:.2f}s created ticket #{r['ticket']}"
        print(line)

    with contextlib.closing(open_tickets(tickets_path)) as tickets:
        rows = tickets.execute("SELECT user_id FROM tickets WHERE event_id = ?", (EVENT,))
        per_user = Counter(user for (user,) in rows)
    total = sum(per_user.values())
    duplicates = sum(count - 1 for count in per_user.values())
    print("  tickets per user: " + ", ".join(
        f"{user} {per_user[user]}" + (" (DUPLICATE)" if per_user[user] > 1 else "")
        for user in USERS
    ))  # fmt: skip
    return total, duplicates


def main() -> int:
    print("Story 3: a double click buys two tickets.")
    print(
        f"{len(USERS)} users each click 'Buy' {CLICKS_PER_USER} times at once for {EVENT}:"
        f" {len(USERS) * CLICKS_PER_USER} processes.\nEach click checks 'has this user a"
        f" ticket?', waits {ORDER_SERVICE_DELAY * 1000:.0f} ms for the order service,\nthen"
        " creates one if there was none. (+time: when a click checked, from the first click.)\n"
    )
    with tempfile.TemporaryDirectory(prefix="keymutex-demo-") as directory:
        demo_dir = Path(directory)
        print("Round 1: no lock")
        total, duplicates = play(demo_dir, None)
        print(f"  result without a lock: {total} tickets for {len(USERS)} users,"
              f" {duplicates} duplicates\n")  # fmt: skip

        locks_url = f"sqlite://{demo_dir / 'locks.db'}"
        print(f'Round 2: keymutex.Locks("{locks_url}")')
        print('  each click: with locks.lock(f"ticket:{user}"): check, then create')
        locked_total, locked_duplicates = play(demo_dir, locks_url)
        print(f"  result with keymutex: {locked_total} tickets for {len(USERS)} users,"
              f" {locked_duplicates} duplicates\n")  # fmt: skip

    return verdict(duplicates, locked_duplicates)


def verdict(duplicates: int, locked_duplicates: int) -> int:
    """Say what the two rounds showed; the exit status (0: the race, then its fix)."""
    if duplicates > 0 and locked_duplicates == 0:
        print(
            f"Verdict: without a lock the double clicks created {duplicates} duplicate"
            " ticket(s);\nwith one keymutex lock per user id, none."
        )
        return 0
    if duplicates == 0:
        print("Verdict: inconclusive, the race did not happen without a lock this time.")
        return 1
    print(f"Verdict: FAILED, {locked_duplicates} duplicate(s) even with the lock.")
    return 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(
            "interrupted: the clicks were stopped and their temporary directory removed",
            file=sys.stderr,
        )
        sys.exit(130)

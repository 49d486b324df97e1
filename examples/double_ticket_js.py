"""Story 3 across languages: a double click lands on a Node.js and a Python service.

The double ticket demo (double_ticket_demo.py) again, with the two clicks of each
user served in two languages: one by a Node process running
``clients/js/examples/buy_ticket.mjs`` (the small JavaScript client), the other by a
Python process using ``keymutex.Locks("http://…")``. Both go through a real lock
server, ``keymutex serve`` on SQLite, that this example starts on a free loopback
port and stops at the end. Each click checks "has this user a ticket for this
event?", waits for the order service (a sleep), and creates a ticket if there was
none; tickets are lines of a JSON-lines file that both languages read and append to.
Without a lock both clicks of a user pass the check: duplicates. With one lock per
user id, ``ticket:{user}`` in the same namespace from both languages, one click waits
for the other's lock, whichever language holds it, and sees its ticket.

Run it with ``python examples/double_ticket_js.py``. It needs Node.js 18 or later on
PATH (e.g. ``apt-get install nodejs``) and the server extra
(``pip install 'keymutex[server]'``). Its files live in a temporary directory that is
removed at the end. ``python examples/double_ticket_js.py click …``, with the
arguments of buy_ticket.mjs, is one Python click: the example runs it in each round.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from double_ticket_demo import EVENT, ORDER_SERVICE_DELAY, USERS, verdict  # its neighbour

import keymutex

NAMESPACE = "shop"  # the same namespace and keys from both languages
BUY_TICKET_JS = (
    Path(__file__).resolve().parents[1] / "clients" / "js" / "examples" / "buy_ticket.mjs"
)
MIN_NODE = 18  # what clients/js/keymutex.js needs (fetch, AbortController, …)
EX_UNAVAILABLE = 69  # exit status when Node.js or the server extra is missing
SERVER_START_TIMEOUT = 30.0  # seconds for `keymutex serve` to answer /healthz
CLICK_TIMEOUT = 60.0  # seconds for the clicks of a round to start and finish
# Seconds from "every click is ready" to the click: enough for each process to read
# the start time and go to sleep until then, even on a loaded machine.
START_MARGIN = 0.2


class DemoError(Exception):
    """Something the example needs failed (the server, a click): said in one message."""


# -- one click, in either language ---------------------------------------------------


def ticket_of(tickets: Path, user: str, event: str, pid: int | None = None) -> int | None:
    """The number of ``user``'s first ticket for ``event`` (the one ``pid`` created, if
    given), or None. A ticket's number is its line in the file, as buy_ticket.mjs counts."""
    lines = [line for line in tickets.read_text().split("\n") if line]
    for number, line in enumerate(lines, start=1):
        ticket = json.loads(line)
        if ticket["user"] == user and ticket["event"] == event and pid in (None, ticket["pid"]):
            return number
    return None


def buy_ticket(tickets: Path, user: str, event: str) -> tuple[bool, int, float, float]:
    """What the service does per click: check, then create. Not atomic on its own.

    Returns (created, ticket number, when it checked, when it was done).
    """
    found = ticket_of(tickets, user, event)
    checked_at = time.time()
    if found is not None:
        return False, found, checked_at, checked_at
    time.sleep(ORDER_SERVICE_DELAY)  # the order service takes its time
    ticket = {"user": user, "event": event, "lang": "python", "pid": os.getpid()}
    ticket["created_at"] = time.time()
    # One small appended write per ticket: a reader never sees half a line.
    with tickets.open("a") as file:
        file.write(json.dumps(ticket) + "\n")
    done_at = time.time()
    number = ticket_of(tickets, user, event, os.getpid())
    assert number is not None
    return True, number, checked_at, done_at


def python_click(url: str, namespace: str, user: str, event: str, file: str, mode: str) -> None:
    """One click from the Python service; the twin of buy_ticket.mjs, same protocol:
    "ready", then the start time from stdin, then one JSON line of what happened."""
    tickets = Path(file)
    # Set up before "ready", so that starting Python does not count as part of the click;
    # a first request connects to the server, as a running service would be connected.
    locks = None
    if mode == "lock":
        locks = keymutex.Locks(url, namespace=namespace, owner=f"python:{os.getpid()}")
        locks.holder(f"ticket:{user}")
    print("ready", flush=True)
    # The wall clock, as the only clock that processes in both languages share.
    start = float(sys.stdin.readline().strip() or 0)  # nothing: click at once
    time.sleep(max(0.0, start - time.time()))  # every click starts at once, as a double click does
    clicked_at = time.time()
    fence = None
    if locks is None:
        created, ticket, checked_at, done_at = buy_ticket(tickets, user, event)
    else:
        with locks, locks.lock(f"ticket:{user}", ttl=10, timeout=30) as lease:
            fence = lease.fence
            created, ticket, checked_at, done_at = buy_ticket(tickets, user, event)
    report = {
        "lang": "python",
        "user": user,
        "pid": os.getpid(),
        "clicked_at": clicked_at,
        "checked_at": checked_at,
        "done_at": done_at,
        "created": created,
        "ticket": ticket,
        "fence": fence,
    }
    print(json.dumps(report), flush=True)


# -- the lock server -----------------------------------------------------------------


def missing_requirement(node: str | None) -> str | None:
    """What this example lacks to run, in one line; None when it has everything."""
    if node is None:
        return "This example needs Node.js on PATH (node), e.g. apt-get install nodejs."
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    major = re.match(r"v(\d+)\.", version.stdout)
    if major is None or int(major[1]) < MIN_NODE:
        found = version.stdout.strip() or "an unknown version"
        return f"This example needs Node.js {MIN_NODE} or later; {node} is {found}."
    try:  # what `keymutex serve` and Locks("http://…") import
        for module in ("uvicorn", "keymutex.server", "httpx"):
            importlib.import_module(module)
    except ImportError as exc:
        return (
            f"This example needs keymutex's lock server ({exc.name} is missing):"
            " pip install 'keymutex[server]'"
        )
    return None


@contextlib.contextmanager
def lock_server(directory: Path) -> Iterator[str]:
    """Runs ``keymutex serve`` on ``directory/locks.db`` until the block ends; its URL.

    The server takes any free port (``--port 0``) and says which in its first line;
    it is ready once ``/healthz`` answers. Its output goes to ``directory/server.log``.
    """
    log = directory / "server.log"
    command = [sys.executable, "-m", "keymutex", "serve", "--store"]
    command += [f"sqlite://{directory / 'locks.db'}", "--host", "127.0.0.1", "--port", "0"]
    with log.open("wb") as output:
        server = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # its URL line at once, in the log
        )
    try:
        yield wait_ready(server, log)
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def wait_ready(server: subprocess.Popen[bytes], log: Path) -> str:
    """The server's URL, once it answers /healthz (within SERVER_START_TIMEOUT)."""
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise DemoError(f"keymutex serve exited; its output:\n{log.read_text()}")
        if listening := re.search(r"keymutex server on (http://[^/\s]+)/", log.read_text()):
            url = listening[1]
            with (
                contextlib.suppress(OSError),  # not answering yet
                urllib.request.urlopen(f"{url}/healthz", timeout=2) as reply,
            ):
                if reply.status == 200:
                    return url
        time.sleep(0.05)
    raise DemoError(
        f"keymutex serve did not answer /healthz within {SERVER_START_TIMEOUT:.0f} s;"
        f" its output:\n{log.read_text()}"
    )


# -- a round of double clicks --------------------------------------------------------


def run_clicks(commands: list[list[str]]) -> list[dict[str, Any]]:
    """Starts every click, starts them clicking at one moment, returns their reports."""
    clicks: list[subprocess.Popen[str]] = []
    try:
        for command in commands:
            clicks.append(
                subprocess.Popen(
                    command,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        # A barrier across languages: once every click is ready (Python and Node have
        # started, their clients are connected), all are told one moment to click at.
        # Nothing follows "ready" on stdout until then, so communicate() below, which
        # reads the pipe itself, misses nothing that readline() could have buffered.
        for click in clicks:
            assert click.stdout is not None
            if click.stdout.readline().strip() != "ready":
                click.kill()
                _, errors = click.communicate()
                raise DemoError(f"a click did not start ({' '.join(click.args)}):\n{errors}")
        start = time.time() + START_MARGIN
        for click in clicks:
            assert click.stdin is not None
            click.stdin.write(f"{start}\n")
            click.stdin.flush()
        deadline = time.monotonic() + CLICK_TIMEOUT
        reports = []
        for click in clicks:
            try:
                out, errors = click.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise DemoError(f"a click took over {CLICK_TIMEOUT:.0f} s: {click.args}") from None
            if click.returncode != 0:
                raise DemoError(f"a click failed (exit {click.returncode}):\n{out}{errors}")
            reports.append(json.loads(out.splitlines()[-1]))
        return reports
    finally:
        for click in clicks:  # on failure or Ctrl-C, no click is left behind
            if click.poll() is None:
                click.kill()
            click.communicate()  # closes its pipes


def describe(r: dict[str, Any], other: dict[str, Any], began: float) -> str:
    """One click's line: who, when it checked, how it got the lock, what it saw or did.
    ``other`` is the other click of the same user; ``began``, when the first click was."""
    who = f"  {r['user']:<6} {r['lang']:<6} pid {r['pid']:<7}"
    if r["fence"] is None:
        got = ""
    else:
        waited = r["checked_at"] - r["clicked_at"]
        got = f"locked (fence {r['fence']})"
        if waited < 0.05:
            got += " at once, "
        elif other["fence"] < r["fence"]:
            got += f" after {waited:.2f}s ({other['lang']} held it), "
        else:
            got += f" after {waited:.2f}s, "
    seen = "no ticket yet" if r["created"] else f"has ticket #{r['ticket']}: done"
    line = f"{who} +{r['checked_at'] - began:.2f}s {got}{seen}"
    if r["created"]:
        line += f"; +{r['done_at'] - began:.2f}s created ticket #{r['ticket']}"
    return line


def play(demo_dir: Path, node: str, url: str, locked: bool) -> tuple[int, int]:
    """Every user clicks twice at once, in Node and in Python; prints what happened;
    (tickets, duplicates)."""
    tickets_path = demo_dir / "tickets.jsonl"
    tickets_path.write_text("")
    mode = "lock" if locked else "nolock"
    commands = []
    for user in USERS:
        args = [url, NAMESPACE, user, EVENT, str(tickets_path), mode]
        commands.append([node, str(BUY_TICKET_JS), *args])
        commands.append([sys.executable, str(Path(__file__).resolve()), "click", *args])
    reports = run_clicks(commands)

    began = min(report["clicked_at"] for report in reports)
    waits: dict[str, list[str]] = {}  # "python waited for node's lock": [users]
    for r in sorted(reports, key=lambda r: (r["user"], r["checked_at"])):
        other = next(o for o in reports if o["user"] == r["user"] and o is not r)
        print(describe(r, other, began))
        if locked and other["fence"] < r["fence"]:  # the other click held the lock first
            waits.setdefault(f"{r['lang']} waited for {other['lang']}'s lock", []).append(
                r["user"]
            )

    tickets = [json.loads(line) for line in tickets_path.read_text().splitlines() if line]
    per_user = Counter(ticket["user"] for ticket in tickets if ticket["event"] == EVENT)
    total = sum(per_user.values())
    duplicates = sum(count - 1 for count in per_user.values())
    print("  tickets per user: " + ", ".join(
        f"{user} {per_user[user]}" + (" (DUPLICATE)" if per_user[user] > 1 else "")
        for user in USERS
    ))  # fmt: skip
    if waits:
        print("  across languages: " + "; ".join(
            f"{what} ({', '.join(users)})" for what, users in sorted(waits.items())
        ))  # fmt: skip
    return total, duplicates


def main() -> int:
    node = shutil.which("node")
    if missing := missing_requirement(node):
        print(missing)
        return EX_UNAVAILABLE
    assert node is not None
    print("Story 3 across languages: a double click buys two tickets.")
    print(
        f"{len(USERS)} users each click 'Buy' twice at once for {EVENT}: one click is"
        " served by Node.js\n(clients/js/examples/buy_ticket.mjs), the other by Python,"
        f" {len(USERS) * 2} processes. Each checks 'has this\nuser a ticket?', waits"
        f" {ORDER_SERVICE_DELAY * 1000:.0f} ms for the order service, then creates one if"
        " there was none.\n(+time: when a click checked, from the first click.)\n"
    )
    with (
        tempfile.TemporaryDirectory(prefix="keymutex-demo-") as directory,
        lock_server(Path(directory)) as url,
    ):
        demo_dir = Path(directory)
        print(f"Lock server: keymutex serve on {url} (SQLite store in a temporary directory)\n")
        print("Round 1: no lock")
        total, duplicates = play(demo_dir, node, url, locked=False)
        print(f"  result without a lock: {total} tickets for {len(USERS)} users,"
              f" {duplicates} duplicates\n")  # fmt: skip

        print(f'Round 2: one lock per user id on the lock server, namespace "{NAMESPACE}"')
        print(
            "  node:   await locks.withLock(`ticket:${user}`, async () => { check, then create })"
        )
        print('  python: with locks.lock(f"ticket:{user}"): check, then create')
        locked_total, locked_duplicates = play(demo_dir, node, url, locked=True)
        print(f"  result with keymutex: {locked_total} tickets for {len(USERS)} users,"
              f" {locked_duplicates} duplicates\n")  # fmt: skip

    return verdict(duplicates, locked_duplicates)


if __name__ == "__main__":
    if sys.argv[1:2] == ["click"]:  # one Python click, run by play() (see its docstring)
        if len(sys.argv) != 8 or sys.argv[7] not in ("lock", "nolock"):
            usage = "usage: double_ticket_js.py click URL NAMESPACE USER EVENT FILE lock|nolock"
            print(usage, file=sys.stderr)
            sys.exit(2)
        python_click(*sys.argv[2:])
        sys.exit(0)
    try:
        sys.exit(main())
    except DemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted: the lock server and the clicks were stopped", file=sys.stderr)
        sys.exit(130)

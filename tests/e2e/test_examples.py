"""The runnable examples do what they say: run each one and check its claims.

The checks re-derive every claim from the example's own record of what happened
(counts, timelines), rather than trusting its verdict lines.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout


# -- story 3: the double ticket demo (make demo) -------------------------------------

RESULT = re.compile(
    r"result (without a lock|with keymutex): (\d+) tickets for (\d+) users, (\d+) duplicates"
)
PER_USER = re.compile(r"tickets per user: (.*)")


def test_double_ticket_demo_shows_duplicates_without_the_lock_and_none_with_it() -> None:
    output = run_example("double_ticket_demo.py")
    results = {m[1]: (int(m[2]), int(m[3]), int(m[4])) for m in RESULT.finditer(output)}
    assert set(results) == {"without a lock", "with keymutex"}, output

    tickets, users, duplicates = results["without a lock"]
    assert duplicates > 0, output
    assert tickets == users + duplicates

    tickets, users, duplicates = results["with keymutex"]
    assert duplicates == 0, output
    assert tickets == users

    # The per-user counts agree with the totals.
    unlocked, locked = PER_USER.findall(output)
    counts = [int(n) for n in re.findall(r"\b(\d+)\b", unlocked)]
    assert sum(n - 1 for n in counts) == results["without a lock"][2]
    assert [int(n) for n in re.findall(r"\b(\d+)\b", locked)] == [1] * users
    # Every click of round 2 took the lock with its own, distinct fence.
    fences = [int(f) for f in re.findall(r"locked \(fence (\d+)\)", output)]
    assert len(fences) == len(set(fences)) == 2 * users
    assert "Verdict: without a lock" in output


# -- story 2: orders per user, in one process and in two -----------------------------

EVENT = re.compile(r"^\s+\+(\d+\.\d+)s\s+(\S+)\s+(\w+)\s+([A-Z]\d)\s+(.+)$")


def parse_rounds(output: str) -> list[list[tuple[float, str, str, str, str]]]:
    rounds: list[list[tuple[float, str, str, str, str]]] = []
    for line in output.splitlines():
        if line.startswith("Round "):
            rounds.append([])
        elif rounds and (match := EVENT.match(line)):
            at, where, user, order, what = match.groups()
            rounds[-1].append((float(at), where, user, order, what))
    return rounds


def spans_per_user(
    events: list[tuple[float, str, str, str, str]],
) -> dict[str, list[tuple[float, float, str]]]:
    """Per user, (start, end, order) of each order that held the lock, by start."""
    starts: dict[str, float] = {}
    spans: dict[str, list[tuple[float, float, str]]] = {}
    for at, _, user, order, what in events:
        if what == "start":
            starts[order] = at
        else:
            assert what.startswith(("done", "failed", "cancelled")), what
            if order in starts:
                spans.setdefault(user, []).append((starts.pop(order), at, order))
    assert not starts, f"orders that never ended: {starts}"
    return {user: sorted(s) for user, s in spans.items()}


def test_orders_per_user_run_one_after_the_other_and_users_in_parallel() -> None:
    output = run_example("orders_per_user.py")
    rounds = parse_rounds(output)
    assert len(rounds) == 2, output
    for events in rounds:
        orders = {order for _, _, _, order, _ in events}
        assert orders == {"A1", "A2", "A3", "B1", "B2", "B3", "C1", "C2", "D1"}, output
        spans = spans_per_user(events)
        # Per user: each order starts only once the previous one has ended.
        for user, user_spans in spans.items():
            for (_, end, first), (start, _, second) in itertools.pairwise(user_spans):
                assert end <= start, f"{user}: {first} and {second} overlapped\n{output}"
        # Across users: some orders of different users ran at the same time.
        assert any(
            start_a < end_b and start_b < end_a
            for a, b in itertools.combinations(spans, 2)
            for start_a, end_a, _ in spans[a]
            for start_b, end_b, _ in spans[b]
        ), output
        # The declined order let go of the lock: all of bob's orders got their turn.
        assert sorted(order for _, _, order in spans["bob"]) == ["B1", "B2", "B3"]
        assert any(order == "B2" and what.startswith("failed") for *_, order, what in events)
        assert any(order == "C2" and what.startswith("cancelled") for *_, order, what in events)

    # In one process, a user's orders are served in arrival order.
    in_one_process = spans_per_user(rounds[0])
    assert [order for _, _, order in in_one_process["alice"]] == ["A1", "A2", "A3"]
    assert {where for _, where, *_ in rounds[0]} == {"service"}
    # Round 2 really ran in two processes.
    assert {where for _, where, *_ in rounds[1]} == {"worker-1", "worker-2"}

    assert re.search(r"entries in the AsyncKeyedLock after the last order: 0$", output, re.M)
    busiest = re.search(r"entries in the AsyncKeyedLock while orders ran: up to (\d+)", output)
    assert busiest is not None
    assert int(busiest[1]) >= 2
    assert re.search(r"leases left in the store after the last order: 0$", output, re.M)


# -- story 4: periodic job and cache lock, on a real Redis ---------------------------


def run_example_with(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout


def test_periodic_job_runs_once_per_tick_and_never_overlaps(
    redis_url: str, tmp_path: Path
) -> None:
    record = tmp_path / "runs.jsonl"
    # An earlier run's record: found by review, the example appended to it, and its
    # summary counted both runs ("6 runs for 3 ticks").
    earlier = {"worker": 0, "tick": 0, "ran": [1.0, 2.0], "fence": 1}
    record.write_text(json.dumps(earlier) + "\n")
    output = run_example_with("periodic_job.py", redis_url, "--record", str(record))
    assert "3 runs for 3 ticks on 4 workers; 9 skips" in output
    assert f"record: {record}" in output
    entries = [json.loads(line) for line in record.read_text().splitlines()]
    assert earlier not in entries
    runs = sorted((e for e in entries if "ran" in e), key=lambda e: e["ran"][0])
    skips = [e for e in entries if "skipped_for" in e]
    ticks = {e["tick"] for e in entries}
    # Every tick ran on exactly one worker; every other worker skipped it.
    assert sorted(run["tick"] for run in runs) == sorted(ticks)
    assert len(skips) == len(entries) - len(runs)
    for earlier, later in itertools.pairwise(runs):
        assert earlier["ran"][1] <= later["ran"][0], (earlier, later)
        assert earlier["fence"] < later["fence"]
    # A skipping worker was told who ran the job (its host and pid), and it was another one.
    for skip in skips:
        who = skip["skipped_for"]
        assert who is not None
        assert who["worker"] != skip["worker"]
        assert {"host", "pid"} <= set(who)


def test_periodic_job_without_record_leaves_nothing_in_the_temporary_directory(
    redis_url: str, tmp_path: Path
) -> None:
    """Found by review: without ``--record``, each run left a directory in /tmp with its
    record, and printed its path."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "periodic_job.py"), redis_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 runs for 3 ticks on 4 workers; 9 skips" in result.stdout
    assert "record:" not in result.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def redis_socket_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``unix:///…/redis.sock``: a Redis of this module's own, on a Unix socket alone (no
    other test's keys in it). The socket's path is short, as a socket path must be."""
    from _redis_fixtures import require_redis

    require_redis()
    from _redis_servers import RedisServer

    sockets = Path(tempfile.mkdtemp(prefix="km-", dir="/tmp"))
    socket = sockets / "redis.sock"
    server = RedisServer(
        tmp_path_factory.mktemp("redis-socket"),
        ["save ''", "appendonly no", f"unixsocket {socket}", "unixsocketperm 700"],
    )
    try:
        with server.start():
            yield f"unix://{socket}"
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.mark.parametrize("store", ["redis_url", "redis_socket_url"])
def test_cache_lock_shows_the_holes_of_the_hand_rolled_lock_and_their_fixes(
    store: str, request: pytest.FixtureRequest
) -> None:
    output = run_example_with("cache_lock.py", request.getfixturevalue(store))
    assert "hand-rolled: still locked after the holder died: True" in output
    assert "keymutex: free again after the 0.2 s TTL: True" in output
    assert "hand-rolled: workers inside at once: ['B', 'C'] (1 overlap)" in output
    assert "keymutex: A's late release raised LockLost" in output
    assert "keymutex: C refused, B still holds it: True" in output
    fences = re.search(r"fences A (\d+) < B (\d+)", output)
    assert fences
    assert int(fences[1]) < int(fences[2])
    polled = re.search(r"hand-rolled: (\d+) commands while waiting", output)
    notified = re.search(r"keymutex: (\d+) commands while waiting", output)
    assert polled
    assert notified
    # Polling every 100 ms for a second costs about ten commands; notification a few.
    assert int(notified[1]) < int(polled[1])
    assert re.search(r"held by \S+ with info \{'host': '[^']+', 'pid': \d+\}", output)
    # Story 4's fair queue: waiters served in the order they arrived (polling: any order).
    assert "keymutex: served in the order [0, 1, 2, 3, 4]: the order they arrived in" in output


# -- story 3 across languages: Node.js and Python clicks on one lock server ----------

NODE = shutil.which("node")
# A click's line: user, language, pid, [locked (fence N) …,] what it created or saw.
CLICK = re.compile(
    r"^  (\w+)\s+(node|python)\s+pid \d+\s+\+\d+\.\d+s (?:locked \(fence (\d+)\)[^,]*, )?"
    r"(?:no ticket yet; \+\d+\.\d+s created ticket #(\d+)|has ticket #(\d+): done)$"
)


def clicks_per_round(output: str) -> list[dict[str, dict[str, tuple[int | None, bool, int]]]]:
    """Per round, per user, per language: (fence, created, ticket number)."""
    rounds: list[dict[str, dict[str, tuple[int | None, bool, int]]]] = []
    for line in output.splitlines():
        if line.startswith("Round "):
            rounds.append({})
        elif rounds and (match := CLICK.match(line)):
            user, lang, fence, created, seen = match.groups()
            clicks = rounds[-1].setdefault(user, {})
            assert lang not in clicks, f"two {lang} clicks for {user}\n{output}"
            fence_number = None if fence is None else int(fence)
            clicks[lang] = (fence_number, created is not None, int(created or seen))
    return rounds


@pytest.mark.slow
@pytest.mark.skipif(
    NODE is None, reason="node is not installed: the JavaScript client needs Node >= 18"
)
def test_double_ticket_js_shares_one_lock_between_node_and_python() -> None:
    output = run_example("double_ticket_js.py")
    results = {m[1]: (int(m[2]), int(m[3]), int(m[4])) for m in RESULT.finditer(output)}
    assert set(results) == {"without a lock", "with keymutex"}, output
    unlocked, locked = clicks_per_round(output)
    # Every user double-clicked: one click in Node, the other in Python.
    for clicks in (unlocked, locked):
        assert len(clicks) == results["without a lock"][1], output
        assert all(set(by_lang) == {"node", "python"} for by_lang in clicks.values()), output

    # Round 1: no fences, and duplicates: both clicks of some user created a ticket.
    tickets, users, duplicates = results["without a lock"]
    assert duplicates > 0, output
    assert tickets == users + duplicates
    created = [sum(c[1] for c in by_lang.values()) for by_lang in unlocked.values()]
    assert sum(created) == tickets, output
    assert all(fence is None for by_lang in unlocked.values() for fence, *_ in by_lang.values())

    # Round 2: per user, both languages held the lock; the one with the smaller fence
    # created the ticket, and the other one, which waited for it, saw that very ticket.
    tickets, users, duplicates = results["with keymutex"]
    assert duplicates == 0, output
    assert tickets == users
    for user, by_lang in locked.items():
        (first_fence, first_created, ticket), (second_fence, second_created, seen) = sorted(
            by_lang.values(), key=lambda click: click[0] or 0
        )
        assert first_fence is not None, f"{user}: a click without the lock\n{output}"
        assert second_fence is not None, f"{user}: a click without the lock\n{output}"
        assert first_fence < second_fence
        assert first_created, f"{user}: the first holder did not create the ticket\n{output}"
        assert not second_created, f"{user}: the second holder created another\n{output}"
        assert seen == ticket
    assert "Verdict: without a lock" in output


@pytest.mark.parametrize("example", ["periodic_job.py", "publish_per_user.py"])
def test_an_example_of_processes_refuses_the_memory_store(example: str) -> None:
    """Found by review: on ``memory://`` each worker process held its own locks, and the
    example printed its broken run (every worker ran every tick) as if it were fine."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / example), "memory://"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "memory:// lives in one process" in result.stderr
    assert "Traceback" not in result.stderr


# -- Ctrl-C ------------------------------------------------------------------------------


def running_in_session(session: int) -> list[str]:
    """The command lines of the live processes (zombies aside) of a session."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # Any process's: its arguments need not be UTF-8 (seen in CI: 0xff).
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # gone meanwhile
            continue
        state, _, _, sid = stat.rsplit(")", 1)[1].split()[:4]
        if int(sid) == session and state != "Z":
            found.append(f"{entry.name}: {command.decode(errors='replace')}")
    return found


def interrupt(
    command: list[str], after: str, directory: Path, children: int = 0, delay: float = 0.0
) -> tuple[int, str, str]:
    """Runs an example as a terminal runs a command, in a process group (and session) of
    its own, with ``directory/tmp`` as its TMPDIR; once a line of its output matched
    ``after``, it has started ``children`` processes, and ``delay`` seconds later, sends
    SIGINT to the whole group, as Ctrl-C does. Its exit status, output and errors;
    checks that every process it started is gone and its temporary directories are
    removed."""
    temporary = directory / "tmp"
    temporary.mkdir()
    stdout, stderr = directory / "stdout", directory / "stderr"
    env = {**os.environ, "TMPDIR": str(temporary), "PYTHONUNBUFFERED": "1"}
    with stdout.open("w") as out, stderr.open("w") as err:
        example = subprocess.Popen(
            command, stdout=out, stderr=err, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 30
        while not re.search(after, stdout.read_text(), re.M):
            assert example.poll() is None, f"it ended first:\n{stdout.read_text()}"
            assert time.monotonic() < deadline, f"no {after!r} in:\n{stdout.read_text()}"
            time.sleep(0.01)
        while len(running_in_session(example.pid)) <= children:  # itself and them
            assert example.poll() is None, f"it ended first:\n{stdout.read_text()}"
            assert time.monotonic() < deadline, running_in_session(example.pid)
            time.sleep(0.01)
        time.sleep(delay)
        os.killpg(example.pid, signal.SIGINT)
        status = example.wait(timeout=30)
    finally:
        if example.poll() is None:
            os.killpg(example.pid, signal.SIGKILL)
            example.wait()
    # What it started and stopped may take a moment to be reaped.
    deadline = time.monotonic() + 10
    while (left := running_in_session(example.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(example.pid, signal.SIGKILL)  # whatever was left, for the next tests
    assert left == [], f"processes left running:\n{left}\n{stderr.read_text()}"
    assert list(temporary.iterdir()) == [], stderr.read_text()
    return status, stdout.read_text(), stderr.read_text()


# (example, its store's fixture, a line of progress to interrupt after, the processes it
# has started by then)
INTERRUPTED = [
    # Interrupted while its six click processes start (spawn: fresh interpreters).
    ("double_ticket_demo.py", None, r"^Round 1: no lock", 6),
    # While its worker processes (fork) run the job or skip it.
    ("periodic_job.py", "redis_url", r"^worker \d, tick 0: skipped", 0),
    # While its worker processes (spawn) publish, and the crashing one has died.
    ("publish_per_user.py", "postgresql_url", r"^dave: worker \S+ dies", 0),
    # While its two service processes (subprocess) start.
    ("orders_per_user.py", None, r"^Round 2: ", 2),
    # In one process, after its first request.
    ("cms_edit_lock.py", "memcached_url", r"alice\s+open\s+-> editing", 0),
]


@pytest.mark.parametrize(
    ("example", "store", "after", "children"), INTERRUPTED, ids=[e[0] for e in INTERRUPTED]
)
def test_ctrl_c_stops_an_example_with_one_line(
    example: str,
    store: str | None,
    after: str,
    children: int,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """Found by review: Ctrl-C flooded the terminal with a KeyboardInterrupt traceback
    from the example and from each of its processes, and it exited on the signal (-2)."""
    command = [sys.executable, str(EXAMPLES / example)]
    if store is not None:
        command.append(request.getfixturevalue(store))
    status, output, errors = interrupt(command, after, tmp_path, children, delay=0.1)
    assert "Traceback" not in output + errors, output + errors
    assert status == 130, output + errors
    (line,) = errors.splitlines()
    assert line.startswith("interrupted: "), errors


def test_cache_lock_without_the_redis_extra_says_what_to_install() -> None:
    """Found by review: a traceback (ModuleNotFoundError), where the other examples say
    which extra to install."""
    without_redis = (
        "import runpy, sys; sys.modules['redis'] = None; sys.argv = sys.argv[1:];"
        " runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", without_redis, str(EXAMPLES / "cache_lock.py")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr == (
        "error: this example needs the Redis client library: pip install 'keymutex[redis]'\n"
    )


def test_cache_lock_on_another_store_says_it_needs_redis_before_the_redis_extra() -> None:
    """Found by a new user's walk-through: ``cache_lock.py sqlite:///x.db`` without the
    Redis extra said to install it, and only then would have said that it needs a Redis
    URL."""
    without_redis = (
        "import runpy, sys; sys.modules['redis'] = None; sys.argv = sys.argv[1:];"
        " runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", without_redis, str(EXAMPLES / "cache_lock.py"), "sqlite:///x.db"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr == (
        "error: 'sqlite:///x.db': this example compares with a lock hand-rolled on Redis and"
        " needs a Redis URL (redis://, rediss:// or unix:///path/redis.sock)\n"
    )


def test_publish_per_user_without_a_url_suggests_sqlite_too() -> None:
    """Found by a new user's walk-through: it suggested only PostgreSQL and MongoDB,
    though it runs on a SQLite file (as its check of a memory:// URL suggests)."""
    env = {k: v for k, v in os.environ.items() if k != "KEYMUTEX_STORE"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "publish_per_user.py")],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert result.returncode == 2
    assert "give a store URL (postgresql://…, mongodb://…, sqlite:///tmp/p.db)" in result.stderr


def test_ctrl_c_in_cache_lock_leaves_no_key_in_redis(
    redis_socket_url: str, tmp_path: Path
) -> None:
    """Found by review: part 1's hand-rolled lock has no TTL, and a Ctrl-C while it was
    held left its key in Redis for good."""
    import redis

    command = [sys.executable, str(EXAMPLES / "cache_lock.py"), redis_socket_url]
    # Part 1 holds its key 0.3 s after this line.
    status, output, errors = interrupt(command, r"^1\. a crashed holder", tmp_path, delay=0.1)
    assert "Traceback" not in output + errors, output + errors
    assert status == 130, output + errors
    (line,) = errors.splitlines()
    assert line.startswith("interrupted: "), errors
    with redis.Redis.from_url(redis_socket_url) as client:
        assert client.keys("cache-lock:*") == []

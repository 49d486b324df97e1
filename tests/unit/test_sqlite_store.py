"""What the SQLite store promises beyond the conformance suite: no residue, boots, files."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import keymutex
from _fork import fork_running


def rows(db: Path, table: str) -> int:
    with sqlite3.connect(db) as conn:
        (count,) = conn.execute(f"SELECT count(*) FROM keymutex_{table}").fetchone()
    return int(count)


def test_released_keys_leave_no_rows(tmp_path: Path) -> None:
    db = tmp_path / "locks.db"
    with keymutex.Locks(f"sqlite:///{db}") as locks:
        for number in range(2000):
            with locks.lock(f"user:{number}", renew=False):
                pass
    assert rows(db, "leases") == 0
    assert rows(db, "waiters") == 0


def test_expired_leases_are_swept_by_later_grants(tmp_path: Path) -> None:
    db = tmp_path / "locks.db"
    with keymutex.Locks(f"sqlite:///{db}") as locks:
        for number in range(300):
            locks.acquire(f"abandoned:{number}", ttl=0.05)  # never released
        time.sleep(0.1)
        for number in range(300):
            with locks.lock(f"fresh:{number}", renew=False):
                pass
        assert rows(db, "leases") < 50, "expired leases were not swept"
        assert locks.holders("abandoned:") == []


def test_short_lived_clients_sweep_expired_leases_too(tmp_path: Path) -> None:
    """Each store counted its grants from 0 and swept at the 16th: clients granted
    fewer (every `keymutex run`) never swept, and killed holders' rows stayed."""
    db = tmp_path / "locks.db"
    with keymutex.Locks(f"sqlite:///{db}") as locks:
        for number in range(20):
            locks.acquire(f"abandoned:{number}", ttl=0.05)  # never released
    time.sleep(0.1)
    # One grant each: with a sweep every 16th grant from a random start, the odds that
    # none of 200 sweeps are (15/16)^200, about 2.5e-6.
    for _ in range(200):
        with keymutex.Locks(f"sqlite:///{db}") as locks:
            locks.acquire("busy", timeout=0).release()
    assert rows(db, "leases") == 0


def test_an_interrupt_just_after_a_transaction_began_rolls_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C between BEGIN and the step left the connection in a write transaction:
    every later step of that Locks failed, every other process got "database is
    locked", until the interrupted process ended."""
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    with keymutex.Locks(url) as locks, keymutex.Locks(url, busy_timeout=1) as other:
        locks.acquire("warm-up", timeout=0).release()  # connected: BEGIN is all that is left
        store = locks._store
        began = store._retry_busy  # type: ignore[attr-defined]
        interrupts = [KeyboardInterrupt()]

        def begin_then_interrupt(attempt: Any) -> Any:
            result = began(attempt)
            if interrupts:
                raise interrupts.pop()
            return result

        monkeypatch.setattr(store, "_retry_busy", begin_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            locks.acquire("doc", timeout=0)
        other.acquire("doc", timeout=0).release()
        locks.acquire("doc", timeout=0).release()


def test_a_database_file_replaced_under_a_process_ends_its_leases(tmp_path: Path) -> None:
    """The process went on alone in the deleted file: its lease stayed valid there
    (renewals succeeded) while others, in the new file, were granted the same key."""
    db = tmp_path / "locks.db"
    with keymutex.Locks(f"sqlite:///{db}") as first:
        lease = first.acquire("k", ttl=60)
        for leftover in tmp_path.glob("locks.db*"):  # an operator's rm, a redeploy
            leftover.unlink()
        with keymutex.Locks(f"sqlite:///{db}") as second:
            other = second.acquire("k", timeout=0)
            with pytest.raises(keymutex.LockLost):
                lease.renew()
            held = first.holder("k")
            assert held is not None
            assert held.fence == other.fence
            other.release()


def test_a_relative_path_keeps_naming_the_file_after_a_change_of_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replaced-file check stat()ed the relative path: after os.chdir it found no
    file there and reopened one in the new directory, which nobody else used."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    with keymutex.Locks("sqlite:locks.db") as locks:
        lease = locks.acquire("k", ttl=60)
        monkeypatch.chdir(tmp_path / "b")
        lease.renew()
        locks.acquire("k2", timeout=0).release()
        assert not (tmp_path / "b" / "locks.db").exists()
        with keymutex.Locks(f"sqlite:///{tmp_path}/a/locks.db") as other:
            held = other.holder("k")
            assert held is not None
            assert held.fence == lease.fence
        lease.release()


def test_a_relative_path_through_a_symlink_names_the_file_the_os_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``link/../locks.db`` with ``link`` a symlink to ``real/sub``: the OS opens
    ``real/locks.db``; normalised as text, the path named ``./locks.db``, another file."""
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    monkeypatch.chdir(tmp_path)
    with keymutex.Locks("sqlite:link/../locks.db") as locks:
        locks.acquire("k", timeout=0).release()
    assert (tmp_path / "real" / "locks.db").exists()
    assert not (tmp_path / "locks.db").exists()


def test_a_killed_waiter_whose_forked_child_lives_on_is_seen_gone(tmp_path: Path) -> None:
    """A forked child kept its copy of the socket a waiter of its parent was waiting on:
    once the parent was killed, its address still looked alive, a release handed the
    key to the dead waiter, and the next waiter waited for that lease's whole TTL."""
    db = tmp_path / "locks.db"
    url = f"sqlite:///{db}"
    child_pid = tmp_path / "child.pid"
    code = f"""if True:
        import os, threading, time, keymutex
        locks = keymutex.Locks({url!r})
        threading.Thread(target=locks.acquire, args=("k",), kwargs={{"ttl": 60}}).start()
        time.sleep(0.5)  # queued by now (the test checks)
        pid = os.fork()
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        open({str(child_pid)!r}, "w").write(str(pid))
        time.sleep(120)
    """
    with keymutex.Locks(url) as holding, keymutex.Locks(url) as waiting:
        lease = holding.acquire("k", timeout=0)
        parent = subprocess.Popen([sys.executable, "-c", code])
        try:
            deadline = time.monotonic() + 30
            while not (child_pid.exists() and child_pid.read_text()):
                assert time.monotonic() < deadline, "the waiter never forked"
                time.sleep(0.01)
            assert rows(db, "waiters") == 1
            got: list[keymutex.Lease] = []
            thread = threading.Thread(target=lambda: got.append(waiting.acquire("k", timeout=20)))
            thread.start()
            while rows(db, "waiters") < 2:
                assert time.monotonic() < deadline, "the second waiter never queued"
                time.sleep(0.01)
            parent.kill()  # the waiting process dies; its forked child lives on
            parent.wait(10)
            lease.release()
            thread.join(30)
            assert len(got) == 1, "the key went to the dead waiter"
            got[0].release()
        finally:
            parent.kill()
            parent.wait(10)
            with contextlib.suppress(ValueError, ProcessLookupError):
                os.kill(int(child_pid.read_text()), signal.SIGKILL)


def test_a_waiter_in_another_network_namespace_keeps_its_place(tmp_path: Path) -> None:
    """Its address cannot be rung from here (abstract sockets are per network
    namespace: a container sharing the file): it was taken for dead, its place
    dropped, and a releaser that looped took the key back every time."""
    db = tmp_path / "locks.db"
    url = f"sqlite:///{db}"
    with keymutex.Locks(url) as holding, keymutex.Locks(url) as waiting:
        lease = holding.acquire("k", timeout=0)
        got: list[keymutex.Lease] = []
        thread = threading.Thread(target=lambda: got.append(waiting.acquire("k", timeout=20)))
        thread.start()
        deadline = time.monotonic() + 30
        while rows(db, "waiters") < 1:
            assert time.monotonic() < deadline, "the waiter never queued"
            time.sleep(0.01)
        elsewhere = b"\0keymutex-f00f-" + secrets.token_hex(12).encode()  # bound nowhere here
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE keymutex_waiters SET address = ?", (elsewhere,))
        lease.release()
        with pytest.raises(keymutex.Locked):  # handed over: not free for the releaser
            holding.acquire("k", timeout=0)
        thread.join(30)  # the waiter finds its grant at its recheck
        assert len(got) == 1
        got[0].release()


def test_a_dead_waiter_in_another_network_namespace_holds_the_key_no_longer_than_its_row(
    tmp_path: Path,
) -> None:
    """Found by review: a release handed the key to the first waiter even when it was in
    another network namespace (a container sharing the file), where it cannot be seen
    to be gone; dead (the container stopped), it held the key for its whole TTL, and
    the waiter queued behind it waited that long, not the WAITER_TTL documented."""
    db = tmp_path / "locks.db"
    url = f"sqlite:///{db}"
    code = f"""if True:
        import keymutex
        keymutex.Locks({url!r}).acquire("k", ttl=600, timeout=120)
    """
    with keymutex.Locks(url) as holding, keymutex.Locks(url) as waiting:
        lease = holding.acquire("k", timeout=0)
        container = subprocess.Popen([sys.executable, "-c", code])
        try:
            deadline = time.monotonic() + 30
            while rows(db, "waiters") < 1:
                assert time.monotonic() < deadline, "the first waiter never queued"
                time.sleep(0.01)
            elsewhere = b"\0keymutex-f00f-" + secrets.token_hex(12).encode()
            with sqlite3.connect(db) as conn:
                conn.execute("UPDATE keymutex_waiters SET address = ?", (elsewhere,))
            container.kill()
            container.wait(10)
            got: list[keymutex.Lease] = []
            thread = threading.Thread(target=lambda: got.append(waiting.acquire("k", timeout=30)))
            thread.start()
            while rows(db, "waiters") < 2:
                assert time.monotonic() < deadline, "the second waiter never queued"
                time.sleep(0.01)
            lease.release()
            thread.join(40)
            assert len(got) == 1, "the key went to the dead waiter for its TTL"
            assert got[0].fence > lease.fence
            got[0].release()
        finally:
            container.kill()
            container.wait(10)


def _time_namespaces() -> bool:
    """Whether this process may start one in a time namespace (root, Linux >= 5.6)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    tried = subprocess.run(
        [unshare, "--time", "--boottime", "1", "true"], capture_output=True, check=False
    )
    return tried.returncode == 0


def test_a_process_in_a_time_namespace_judges_expiry_as_the_host_does(tmp_path: Path) -> None:
    """Found by review: CLOCK_BOOTTIME is shifted per time namespace (unshare --time,
    CRIU): a holder in one, 50,000 s behind (here: up to that), wrote an expiry long past for the host's
    processes, and another was granted the key it held."""
    if not _time_namespaces():
        pytest.skip("cannot start a process in a time namespace here (needs root)")
    # Behind by more than the TTL, as far as the host's uptime allows (a namespace's
    # clock cannot go below 0: found on a machine up for less than 50,000 s).
    behind = int(min(50_000, time.clock_gettime(time.CLOCK_BOOTTIME) - 10))
    assert behind > 120, f"the host has been up for too short a time ({behind + 10} s)"
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    code = f"""if True:
        import sys, keymutex
        lease = keymutex.Locks({url!r}).acquire("k", ttl=60, timeout=0)
        print(lease.fence, flush=True)
        sys.stdin.read()
    """
    with subprocess.Popen(  # the with closes its pipes
        ["unshare", "--time", "--boottime", f"-{behind}", sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as shifted:
        try:
            assert shifted.stdout is not None
            fence = int(shifted.stdout.readline())
            with keymutex.Locks(url) as host:
                with pytest.raises(keymutex.Locked) as refused:
                    host.acquire("k", timeout=0)
                assert refused.value.holder is not None
                assert refused.value.holder.fence == fence
                assert 0 < refused.value.holder.expires_at - time.time() <= 60
        finally:
            shifted.kill()


def test_a_process_that_makes_a_time_namespace_for_its_children_keeps_the_hosts_clock() -> None:
    """Found by review of the fix above: /proc/self/timens_offsets describes the
    namespace of a process's children; one that had unshared a time namespace for them
    (and stayed in its own) read its clock 50,000 s off. Its child, forked afterwards,
    is in the new namespace and must read the host's clock too."""
    if not _time_namespaces():
        pytest.skip("cannot make a time namespace here (needs root)")
    code = """if True:
        import ctypes, os, time
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.unshare(0x80) == 0  # CLONE_NEWTIME, for the children
        with open("/proc/self/timens_offsets", "w") as file:
            file.write("boottime 50000 0")
        from keymutex import _clock
        print(round(_clock.monotonic() - time.clock_gettime(time.CLOCK_BOOTTIME)), flush=True)
        reader, writer = os.pipe()
        if os.fork() == 0:
            os.write(writer, b"%d" % round(_clock.monotonic()))
            os._exit(0)
        os.wait()
        print(round(float(os.read(reader, 64)) - time.clock_gettime(time.CLOCK_BOOTTIME)))
    """
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    parent, child = (int(line) for line in ran.stdout.split())
    assert parent == 0, "the process that made the namespace read its clock off"
    assert abs(child) <= 1, "its child, in the namespace, read its clock off"


def test_leases_of_an_earlier_boot_are_dropped(tmp_path: Path) -> None:
    db = tmp_path / "locks.db"
    with keymutex.Locks(f"sqlite:///{db}") as locks:
        lease = locks.acquire("doc", ttl=3600)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE keymutex_meta SET value = 'another-boot' WHERE name = 'boot'")
    with keymutex.Locks(f"sqlite:///{db}") as locks:
        assert locks.holder("doc") is None, "a lease timed by an earlier boot's clock survived"
        again = locks.acquire("doc", timeout=0)
        assert again.fence > lease.fence, "fences must survive the reboot"


def test_a_releaser_that_loops_does_not_starve_a_queued_waiter(tmp_path: Path) -> None:
    db = tmp_path / "locks.db"
    order: list[str] = []
    with keymutex.Locks(f"sqlite:///{db}") as mine, keymutex.Locks(f"sqlite:///{db}") as theirs:
        first = mine.acquire("counter")

        def wait_for_it() -> None:
            with theirs.lock("counter", renew=False):
                order.append("theirs")

        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        while rows(db, "waiters") == 0:  # until it is queued
            time.sleep(0.001)
        first.release()
        for _ in range(6):  # take it straight back, again and again
            with mine.lock("counter", renew=False):
                order.append("mine")
        waiter.join()
    # At most one grant may go back to the releaser before the queued waiter's turn.
    assert "theirs" in order[:2], order
    assert order.count("mine") == 6


def test_a_lease_that_expires_goes_to_the_queued_waiter_not_to_a_newcomer(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    with (
        keymutex.Locks(url) as holding,
        keymutex.Locks(url) as waiting,
        keymutex.Locks(url) as newcomer,
    ):
        holding.acquire("doc", ttl=0.2)
        # The waiter's steps by hand: refused (and queued), then silent until it looks
        # again, as a waiter parked until the holder's expiry is.
        store = waiting._store
        waiter = store.waiter("doc")
        request = {"token": secrets.token_urlsafe(18), "ttl": 5.0, "owner": "w", "info": None}
        try:
            assert not store.try_acquire("doc", **request, steal=False, waiter=waiter).ok
            time.sleep(0.3)
            assert holding.holder("doc") is None  # expired: the key is free, but kept
            with pytest.raises(keymutex.Locked):
                newcomer.acquire("doc", timeout=0)
            assert store.try_acquire("doc", **request, steal=False, waiter=waiter).ok
        finally:
            waiter.close()
        assert newcomer.holder("doc").owner == "w"


@pytest.mark.asyncio
async def test_async_steps_never_hold_the_event_loop_while_the_database_is_busy(
    tmp_path: Path,
) -> None:
    db = tmp_path / "locks.db"
    async with keymutex.AsyncLocks(f"sqlite:///{db}") as locks:
        await (await locks.acquire("warm-up", timeout=0)).release()
        # Another process's long write transaction: SQLite's write lock is taken.
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        lease = await _acquired_in_a_thread_while_busy(locks, other)
        assert (await locks.holder("doc")) is not None
        await lease.release()


async def _acquired_in_a_thread_while_busy(
    locks: keymutex.AsyncLocks, other: sqlite3.Connection
) -> keymutex.AsyncLease:
    """Acquire "doc" while ``other`` holds the write lock, which it lets go after
    0.3 s: meanwhile the step waits in a worker thread, and the event loop goes on."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    acquire = asyncio.create_task(locks.acquire("doc", timeout=0))
    await asyncio.sleep(0.3)
    assert not acquire.done()  # the step waits for the write lock...
    assert ticks > 0  # ...in a worker thread: the loop went on
    other.execute("COMMIT")
    other.close()
    lease = await acquire
    ticker.cancel()
    return lease


def _remove_database(db: Path) -> None:
    for path in db.parent.glob(f"{db.name}*"):  # with its -wal and -shm
        path.unlink()


@pytest.mark.asyncio
async def test_an_async_step_that_reopens_the_file_never_holds_the_event_loop_either(
    tmp_path: Path,
) -> None:
    """Found by review: a step that first reopened the file (replaced, or after a fork)
    committed the opening's own transaction, which ended the step's inline part: its own
    transaction then waited for a busy file on the event loop's thread, up to the busy
    timeout. Here the file is replaced, and another process takes the write lock just
    after the store has reopened it."""
    db = tmp_path / "locks.db"
    async with keymutex.AsyncLocks(f"sqlite:///{db}") as locks:
        await (await locks.acquire("warm-up", timeout=0)).release()
        _remove_database(db)  # replaced: the next step reopens the file at the path
        inner = locks._store._store  # type: ignore[attr-defined]
        open_file = inner._open_file
        other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)

        def reopened_then_busy() -> sqlite3.Connection:
            conn = open_file()
            other.execute("BEGIN IMMEDIATE")  # another process's long write transaction
            return conn

        inner._open_file = reopened_then_busy
        lease = await _acquired_in_a_thread_while_busy(locks, other)
        await lease.release()


@pytest.mark.asyncio
async def test_an_async_waiter_cancelled_as_its_wake_up_arrives_logs_nothing(
    tmp_path: Path,
) -> None:
    """Found by a review: the wake-up's reader callback, run in the turn the waiting
    task was cancelled, set the cancelled future's result, and the event loop logged
    ``Exception in callback ... InvalidStateError`` (nothing was left held)."""
    url = f"sqlite:///{tmp_path}/locks.db"
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    with keymutex.Locks(url) as holder:
        lease = holder.acquire("doc")
        async with keymutex.AsyncLocks(url) as locks:
            waiting = asyncio.create_task(locks.acquire("doc", timeout=30))
            await asyncio.sleep(0.3)  # queued at the store, parked on its socket

            def release_then_cancel() -> None:
                # The loop is busy meanwhile: the wake-up is readable before the cancel
                # runs, and its callback comes right after it, in the same turn.
                releasing = threading.Thread(target=lease.release)
                releasing.start()
                releasing.join(10)
                time.sleep(0.1)
                loop.call_soon(waiting.cancel)

            loop.call_soon(release_then_cancel)
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await asyncio.sleep(0.1)
            assert await locks.holders() == []  # the key handed to it was given back
    assert errors == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_reopens_a_relative_path_after_a_change_of_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a daemon that changes directory and then forks workers. The
    child's new connection checked the directory of the relative path from the new
    working directory, and refused ("its directory ... does not exist")."""
    (tmp_path / "run" / "sub").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    with keymutex.Locks("sqlite:sub/locks.db") as locks:
        locks.acquire("parent", timeout=0).release()
        monkeypatch.chdir(tmp_path / "elsewhere")
        pid = fork_running(lambda: _acquire_in_each(locks))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the forked child could not acquire"
        held = locks.holder("child")
        assert held is not None  # in the file the parent uses, not another one
    assert not (tmp_path / "elsewhere" / "sub").exists()


def test_a_new_database_beside_the_wal_of_a_deleted_one_says_what_to_delete(
    tmp_path: Path,
) -> None:
    """Found by review: ``rm locks.db`` alone, while a process keeps the old -wal and
    -shm open: every new process got a bare "disk I/O error" until that one's next step."""
    db = tmp_path / "locks.db"
    with keymutex.Locks(f"sqlite:///{db}") as first:
        first.acquire("k", timeout=0).release()
        db.unlink()  # the -wal and -shm stay, open in this process
        probe = (
            "import keymutex, sys\n"
            "try:\n"
            f"    keymutex.Locks('sqlite:///{db}').acquire('k', timeout=0)\n"
            "except keymutex.StoreError as exc:\n"
            "    print(exc)\n"
        )
        for _ in range(2):  # the first failed open leaves an empty file: the same advice
            said = subprocess.run(
                [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
            )
            assert "delete the three files together" in said.stdout, said.stdout + said.stderr


def test_the_database_of_another_application_is_left_alone(tmp_path: Path) -> None:
    """Found by review: keymutex added its tables to it and switched it to WAL."""
    app = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(app)) as conn:
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY)")
        conn.commit()
    with pytest.raises(keymutex.StoreError, match=r"database of something else.*'users'"):
        keymutex.Locks(f"sqlite:///{app}")
    with contextlib.closing(sqlite3.connect(app)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
        tables = conn.execute("SELECT name FROM sqlite_master").fetchall()
        assert tables == [("users",)]


@pytest.mark.parametrize("url", ["sqlite::memory:", "sqlite:///:memory:"])
def test_an_in_memory_sqlite_url_is_refused_with_the_alternative(url: str) -> None:
    """Found by review: these made files named ':memory:' (one at the root)."""
    with pytest.raises(ValueError, match="use memory:// for locks within one process"):
        keymutex.Locks(url)


def test_the_synchronous_option_ignores_case(tmp_path: Path) -> None:
    """As SQLite's own PRAGMA does: FULL was refused."""
    with keymutex.Locks(f"sqlite:///{tmp_path}/locks.db?synchronous=FULL") as locks:
        assert locks._store.synchronous == "full"
        locks.acquire("k", timeout=0).release()


def test_a_missing_directory_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(keymutex.StoreError, match="cannot open"):
        keymutex.Locks(f"sqlite:///{tmp_path}/no/such/dir/locks.db")


@pytest.mark.parametrize(
    ("url", "error", "match"),
    [
        ("sqlite://host/locks.db", ValueError, "no host"),
        ("sqlite://", ValueError, "names no file"),
        ("sqlite:///x.db?synchronous=maybe", ValueError, "synchronous"),
        ("sqlite:///x.db?busy_timeout=-1", ValueError, "busy_timeout"),
        ("sqlite:///x.db?colour=blue", TypeError, "unknown SQLite store option"),
    ],
)
def test_bad_sqlite_urls_say_what_is_accepted(
    url: str, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        keymutex.Locks(url)


def test_threads_on_namespaces_of_one_file_never_find_it_locked_by_each_other(
    tmp_path: Path,
) -> None:
    """One process with a client per namespace of one file (as the lock server has):
    its steps take turns in the process, and none waits on SQLite's write lock for
    another. Found under load (a lock server, 100 clients over 120 namespaces): each
    namespace's connection waited for the others' on the write lock, sleeping and
    looking again in a worker thread, and renewals queued behind those threads. Here
    the busy timeout is so short that one such wait raises "database is locked"."""
    url = f"sqlite:///{tmp_path}/locks.db?busy_timeout=0.000001"
    clients = [keymutex.Locks(url, namespace=f"team-{number}") for number in range(12)]
    failures: list[BaseException] = []

    def work(locks: keymutex.Locks) -> None:
        try:
            for number in range(100):
                lease = locks.acquire(f"doc-{number % 3}", timeout=0)
                lease.renew()
                assert locks.holder(lease.key) is not None
                lease.release()
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(locks,)) for locks in clients]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        for locks in clients:
            locks.close()
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []


def _acquire_in_each(*clients: keymutex.Locks) -> int:
    """0 once each client has acquired "child" (a forked child's exit status)."""
    for locks in clients:
        locks.acquire("child", timeout=0, ttl=60)
    return 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_with_several_namespaces_of_one_file_forks(tmp_path: Path) -> None:
    """The stores of one file share their mutex, which the fork handler takes once (a
    second take of it would never return) and the child gets anew."""
    url = f"sqlite:///{tmp_path}/locks.db"
    with keymutex.Locks(url, namespace="a") as a, keymutex.Locks(url, namespace="b") as b:
        a.acquire("doc", timeout=0).release()
        b.acquire("doc", timeout=0).release()
        pid = fork_running(lambda: _acquire_in_each(a, b))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the forked child could not acquire"
        assert a.holder("child") is not None
        assert b.holder("child") is not None
        a.acquire("after", timeout=0).release()  # the parent's mutex was let go


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_opens_a_store_does_not_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a thread opening a store looks its file's mutex up in a table
    under a lock of its own; a fork in that moment left the lock held in the child,
    whose fork handler, giving its stores their mutexes anew, took it and hung for good
    (before it could run a line of its own). Here the opening thread is held inside the
    lookup (making the mutex of its new file) for a while, and the process forks."""
    from keymutex.stores import sqlite as store_module

    url = f"sqlite:///{tmp_path}/locks.db"
    inside, opener = threading.Event(), threading.current_thread()

    class SlowToMake(store_module._StepLock):
        __slots__ = ()

        def __init__(self) -> None:
            super().__init__()
            if threading.current_thread() is opener:
                inside.set()
                time.sleep(2)  # the lookup's lock held meanwhile

    with keymutex.Locks(url, namespace="kept") as locks:
        monkeypatch.setattr(store_module, "_StepLock", SlowToMake)
        opener = threading.Thread(
            target=lambda: keymutex.Locks(f"sqlite:///{tmp_path}/b.db").close()
        )
        opener.start()
        assert inside.wait(30), "the opening thread never made its file's mutex"
        pid = fork_running(lambda: _acquire_in_each(locks))
        deadline = time.monotonic() + 30
        while (found := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        if found == (0, 0):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        opener.join(30)
        assert found != (0, 0), "the forked child hung in the fork handler"
        assert os.waitstatus_to_exitcode(found[1]) == 0, "the forked child could not acquire"


def test_a_read_in_one_namespace_does_not_wait_for_a_write_blocked_in_another(
    tmp_path: Path,
) -> None:
    """Found by review of the shared mutex: a read in one namespace waited for a write of
    another that waited for another process's write lock, up to ``busy_timeout``. In
    WAL mode a read waits for no writer, and now takes only its own store's mutex."""
    url = f"sqlite:///{tmp_path}/locks.db?busy_timeout=60"
    with keymutex.Locks(url, namespace="a") as a, keymutex.Locks(url, namespace="b") as b:
        b.acquire("doc", timeout=0)
        other = sqlite3.connect(tmp_path / "locks.db", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process's write, as SQLite sees it
        writing = threading.Thread(target=lambda: a.acquire("doc", timeout=0).release())
        try:
            writing.start()
            writes: Any = a._store._writes._lock  # a's acquire waits for SQLite, holding it
            deadline = time.monotonic() + 30
            while not writes.locked():
                assert time.monotonic() < deadline, "the write never started"
                time.sleep(0.01)
            read: list[Any] = []
            reading = threading.Thread(target=lambda: read.append(b.holder("doc")))
            reading.start()
            reading.join(30)
            assert read, "the read waited for the other namespace's blocked write"
            assert read[0] is not None
            assert writing.is_alive()  # the write was still waiting all along
        finally:
            other.execute("ROLLBACK")
            other.close()
            writing.join(30)

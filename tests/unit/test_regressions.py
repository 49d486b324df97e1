"""Regression tests from a review of the client and the stores: each showed a bug, now fixed."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import keymutex
from keymutex.stores import sqlite as sqlite_store


def wait_for(predicate: Callable[[], object], what: str, limit: float = 4.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def queued_rows(db: Path) -> int:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        (count,) = conn.execute("SELECT count(*) FROM keymutex_waiters").fetchone()
    return int(count)


def run_in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = target()
        except BaseException as exc:  # reported to the test
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


# -- 1. handoff datagram truncated for a large (but legal) info ---------------------


@pytest.mark.skipif(not sqlite_store.NOTIFIES, reason="handoff needs Linux sockets")
def test_sqlite_handoff_with_max_size_info(tmp_path: Path) -> None:
    db = tmp_path / "locks.db"
    url = f"sqlite:///{db}"
    info = {"q": '"' * 2040}  # 4090 bytes as JSON: within the 4 KiB limit
    with keymutex.Locks(url) as holder_locks, keymutex.Locks(url) as waiter_locks:
        held = holder_locks.acquire("doc")
        thread, result = run_in_thread(lambda: waiter_locks.acquire("doc", timeout=4, info=info))
        wait_for(lambda: queued_rows(db) == 1, "the waiter to queue")
        held.release()  # hands the key to the waiter in one datagram
        thread.join()
        assert "error" not in result, repr(result.get("error"))
        lease = result["value"]
        assert lease.info == info
        lease.release()


# -- 2. a handed-off lease that expired before the waiter read it -------------------


@pytest.mark.skipif(not sqlite_store.NOTIFIES, reason="handoff needs Linux sockets")
def test_sqlite_expired_handoff_is_not_an_assertion_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "locks.db"
    url = f"sqlite:///{db}"
    original_wait = sqlite_store._SqliteWaiter.wait

    def slow_reader(self: Any, timeout: float) -> bool:
        rung = original_wait(self, timeout)
        if self.granted is not None:
            time.sleep(0.1)  # the waiting thread is descheduled: the 0.02 s lease runs out
        return rung

    monkeypatch.setattr(sqlite_store._SqliteWaiter, "wait", slow_reader)
    with keymutex.Locks(url) as holder_locks, keymutex.Locks(url) as waiter_locks:
        held = holder_locks.acquire("doc")
        thread, result = run_in_thread(lambda: waiter_locks.acquire("doc", ttl=0.02, timeout=4))
        wait_for(lambda: queued_rows(db) == 1, "the waiter to queue")
        held.release()
        thread.join()
        # Acceptable outcomes: a fresh lease (the key is free again), or Locked/LockLost.
        error = result.get("error")
        assert error is None or isinstance(error, keymutex.LockError), repr(error)


# -- 3. select.select() on a socket whose fd is above FD_SETSIZE --------------------


@contextlib.contextmanager
def many_open_files(count: int) -> Iterator[None]:
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(count)]
    try:
        yield
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.skipif(not sqlite_store.NOTIFIES, reason="waiting sockets are Linux only")
def test_sqlite_wait_in_a_process_with_many_files(tmp_path: Path) -> None:
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("cannot open 1100 files here")
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    with keymutex.Locks(url) as holder_locks, keymutex.Locks(url) as waiter_locks:
        held = holder_locks.acquire("doc")
        with many_open_files(1100), pytest.raises(keymutex.Locked):
            waiter_locks.acquire("doc", timeout=0.2)
        held.release()


# -- 4. a second cancellation while _try waits for its shielded step ----------------


@pytest.mark.skipif(not sqlite_store.NOTIFIES, reason="handoff needs Linux sockets")
@pytest.mark.asyncio
async def test_twice_cancelled_acquire_leaves_no_queue_row(tmp_path: Path) -> None:
    db = tmp_path / "locks.db"
    url = f"sqlite:///{db}"
    async with keymutex.AsyncLocks(url) as holder_locks, keymutex.AsyncLocks(url) as alocks:
        held = await holder_locks.acquire("doc")
        store: Any = alocks._store._store  # type: ignore[attr-defined]  # the sync SqliteStore
        original = store.try_acquire
        started, go, finished = threading.Event(), threading.Event(), threading.Event()

        def gated_try_acquire(*args: Any, **kwargs: Any) -> Any:
            started.set()
            go.wait(4)
            try:
                return original(*args, **kwargs)
            finally:
                finished.set()

        store.try_acquire = gated_try_acquire
        task = asyncio.ensure_future(alocks.acquire("doc", timeout=4))
        assert await asyncio.to_thread(started.wait, 4)
        task.cancel()
        for _ in range(5):
            await asyncio.sleep(0)  # the task now waits for its shielded step
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        go.set()
        await asyncio.to_thread(finished.wait, 4)
        store.try_acquire = original

        # Nobody waits for "doc" any more: releasing it must leave it free.
        await held.release()
        assert await holder_locks.holder("doc") is None
        assert queued_rows(db) == 0


# -- 5. raw sqlite3 errors from the SQLite store's constructor ----------------------


def test_sqlite_open_on_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "not-a-db.db"
    path.write_bytes(b"this is not an SQLite database, just some text" * 100)
    with pytest.raises(keymutex.StoreError):
        keymutex.Locks(f"sqlite:///{path}")


def test_sqlite_open_while_another_process_holds_a_write_lock(tmp_path: Path) -> None:
    db = tmp_path / "locks.db"
    keymutex.Locks(f"sqlite:///{db}").close()  # create the schema
    blocker = sqlite3.connect(db, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(keymutex.StoreError):
            keymutex.Locks(f"sqlite:///{db}", busy_timeout=0.05)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


# -- 6. OSError from the waiter's socket escapes as itself -------------------------


@pytest.mark.skipif(not sqlite_store.NOTIFIES, reason="waiting sockets are Linux only")
def test_sqlite_waiter_socket_failure_is_a_store_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    with keymutex.Locks(url) as holder_locks, keymutex.Locks(url) as waiter_locks:
        held = holder_locks.acquire("doc")

        def out_of_files(*args: Any, **kwargs: Any) -> socket.socket:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(socket, "socket", out_of_files)
        try:
            with pytest.raises(keymutex.LockError):
                waiter_locks.acquire("doc", timeout=0.2)
        finally:
            monkeypatch.undo()
            held.release()


# -- 7. deeply nested info: RecursionError instead of ValueError --------------------


def test_deeply_nested_info_is_a_value_error() -> None:
    nested: list[Any] = []
    for _ in range(1500):
        nested = [nested]  # 3000 bytes as JSON: under the 4 KiB limit
    with (
        keymutex.Locks("memory://review-7") as locks,
        pytest.raises(ValueError, match="info is nested too deeply"),
    ):
        locks.acquire("doc", info={"a": nested})


# -- 8. a closed Locks still grants, then fails and leaves the lease held -----------


def test_holders_are_hashable_values() -> None:
    # A frozen value: holders go in sets and dict keys (what changed between two
    # listings). Its info dict used to make hash() raise TypeError.
    with keymutex.Locks("memory://") as locks:
        locks.acquire("a", info={"job": "report"})
        locks.acquire("b")
        first = set(locks.holders())
        assert set(locks.holders()) == first
        locks.acquire("c", info={"job": ["x"]})
        (new,) = set(locks.holders()) - first
    assert new.key == "c"
    assert new.info == {"job": ["x"]}
    same = keymutex.Holder("k", "o", {"n": 1}, 5, 1.0, 2.0)
    assert hash(same) == hash(keymutex.Holder("k", "o", {"n": 1}, 5, 1.0, 2.0))
    assert same != keymutex.Holder("k", "o", {"n": 2}, 5, 1.0, 2.0)  # info still counts


def test_closed_locks_does_not_leave_a_lease_behind() -> None:
    locks = keymutex.Locks("memory://review-8")
    locks.close()
    with contextlib.suppress(Exception), locks.lock("doc"):
        pass
    with keymutex.Locks("memory://review-8") as other:
        assert other.holder("doc") is None


@pytest.mark.asyncio
async def test_closed_async_locks_does_not_leave_a_lease_behind() -> None:
    alocks = keymutex.AsyncLocks("memory://review-8a")
    await alocks.aclose()
    with contextlib.suppress(Exception):
        async with alocks.lock("doc"):
            pass
    async with keymutex.AsyncLocks("memory://review-8a") as other:
        assert await other.holder("doc") is None


# -- 9. overlapping renewals: an older reply overwrites a newer deadline -----------


def test_overlapping_renewals_never_overstate_remaining() -> None:
    with keymutex.Locks("memory://review-9") as locks:
        lease = locks.acquire("doc", ttl=5)
        store = locks._store
        original = store.renew
        applied, go = threading.Event(), threading.Event()

        def renew(key: str, token: str, ttl: float) -> Any:
            outcome = original(key, token, ttl)
            if ttl == 100:  # the slow reply: applied at the store, not yet returned
                applied.set()
                go.wait(4)
            return outcome

        store.renew = renew  # type: ignore[method-assign]
        thread, result = run_in_thread(lambda: lease.renew(ttl=100))
        assert applied.wait(4)
        lease.renew(ttl=1)  # applied after: the store now grants ~1 s
        go.set()
        thread.join()
        assert "error" not in result
        holder = locks.holder("doc")
        assert holder is not None
        granted = holder.expires_at - time.time()
        assert lease.remaining <= granted + 0.5, (lease.remaining, granted)
        store.renew = original  # type: ignore[method-assign]
        lease.release()


# -- 10. fork: per-process state copied into the child ------------------------------


def fork_child(child: Callable[[], int]) -> int:
    """Run ``child`` in a forked process; its return value is the exit status."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: fork with threads
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 99
        try:
            status = child()
        except BaseException:  # any failure is a distinct status
            status = 98
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def park_event(monkeypatch: pytest.MonkeyPatch, waiter_class: Any) -> threading.Event:
    parked = threading.Event()
    original = waiter_class.wait

    def wait(self: Any, timeout: float) -> bool:
        parked.set()
        return bool(original(self, timeout))

    monkeypatch.setattr(waiter_class, "wait", wait)
    return parked


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_is_not_blocked_by_the_parents_waiting_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    parked = park_event(monkeypatch, sqlite_store._SqliteWaiter)
    with keymutex.Locks(url) as holder_locks, keymutex.Locks(url) as locks:
        held = holder_locks.acquire("doc")
        thread, _ = run_in_thread(lambda: locks.acquire("doc", timeout=0.3))
        assert parked.wait(4)
        go_read, go_write = os.pipe()

        def child() -> int:
            os.close(go_write)
            os.read(go_read, 1)  # the parent's thread gave up, and the key is free
            if locks._gate.locked("doc"):
                return 3  # the parent thread's place in the local queue came along
            try:
                locks.acquire("doc", timeout=1.0).release()
            except keymutex.Locked:
                return 1
            return 0

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pid_status: list[int] = []
            waiter, _ = run_in_thread(lambda: pid_status.append(fork_child(child)))
        os.close(go_read)
        thread.join()
        held.release()
        os.write(go_write, b"!")
        os.close(go_write)
        waiter.join()
        assert pid_status == [0]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_memory_queue_has_no_phantom_waiter(monkeypatch: pytest.MonkeyPatch) -> None:
    from keymutex.stores import memory as memory_store

    url = "memory://review-10b"
    parked = park_event(monkeypatch, memory_store._MemoryWaiter)
    with keymutex.Locks(url) as locks:
        held = locks.acquire("doc")
        thread, _ = run_in_thread(lambda: locks.acquire("doc", timeout=0.5))
        assert parked.wait(4)

        def child() -> int:
            with keymutex.Locks(url) as mine:
                mine.release("doc", held.token)  # our copy of the lease: now free
                try:
                    mine.acquire("doc", timeout=0.3).release()
                except keymutex.Locked:
                    return 1
            return 0

        status = fork_child(child)
        thread.join()
        held.release()
        assert status == 0


@pytest.mark.skipif(not (hasattr(os, "fork") and sqlite_store.NOTIFIES), reason="Linux fork")
def test_forked_child_does_not_share_waiter_sockets(tmp_path: Path) -> None:
    with keymutex.Locks(f"sqlite:///{tmp_path / 'locks.db'}") as locks:
        store: Any = locks._store
        store.waiter("doc").close()  # one bound socket now sits in the pool
        parent_addresses = {address for _, address in store._sockets._free}
        read, write = os.pipe()

        def child() -> int:
            waiter = store.waiter("doc")
            os.write(write, waiter.address or b"")
            return 0

        assert fork_child(child) == 0
        os.close(write)
        child_address = os.read(read, 100)
        os.close(read)
        assert child_address not in parent_addresses


# -- 11. schema changed in 47c62cb without a SCHEMA_VERSION bump ---------------------

_SCHEMA_BEFORE_47C62CB = (
    "CREATE TABLE keymutex_meta (name TEXT PRIMARY KEY, value ANY) STRICT",
    "CREATE TABLE keymutex_leases ("
    " namespace TEXT NOT NULL, key TEXT NOT NULL, token TEXT NOT NULL, owner TEXT NOT NULL,"
    " info TEXT, fence INTEGER NOT NULL, acquired_at REAL NOT NULL, expires REAL NOT NULL,"
    " wake BLOB, PRIMARY KEY (namespace, key)) STRICT",
    "CREATE TABLE keymutex_waiters ("
    " seq INTEGER PRIMARY KEY AUTOINCREMENT, namespace TEXT NOT NULL, key TEXT NOT NULL,"
    " address BLOB, expires REAL NOT NULL, token TEXT NOT NULL, owner TEXT NOT NULL,"
    " info TEXT, ttl REAL NOT NULL) STRICT",
    "INSERT INTO keymutex_meta VALUES ('schema', 1), ('fence', 0)",
)


def test_database_from_the_previous_layout_is_migrated_or_refused(tmp_path: Path) -> None:
    db = tmp_path / "locks.db"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        for statement in _SCHEMA_BEFORE_47C62CB:
            conn.execute(statement)
        conn.commit()
    try:
        locks = keymutex.Locks(f"sqlite:///{db}")
    except keymutex.StoreError:
        return  # refused up front with a clear message: fine
    with locks, keymutex.Locks(f"sqlite:///{db}") as other:
        held = locks.acquire("doc")
        with pytest.raises(keymutex.Locked):
            other.acquire("doc", timeout=0.1)  # StoreError: datatype mismatch
        held.release()

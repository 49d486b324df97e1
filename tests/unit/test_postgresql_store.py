"""What the PostgreSQL store promises beyond the conformance suite: one statement per
step, fences that never go back (expiry, steal, server restart and crash), leases that
outlive their connections, prompt wake-ups by NOTIFY on one shared listener, no rows
left behind, a table created once, and strict option checks.

Against a real PostgreSQL (the session's ``postgresql_server``); tests that restart or
crash a server start their own. Each test uses a namespace, and where it counts rows or
statements a table, of its own.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import keymutex
from _pg_fixtures import require_postgresql
from _pg_server import PostgresServer, running_server
from keymutex._store import RenewRequest


@pytest.fixture
def admin(postgresql_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A superuser connection of our own, to look at the server from outside."""
    with psycopg.connect(postgresql_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def namespace() -> str:
    return f"unit-{uuid.uuid4().hex}"


@pytest.fixture
def table() -> str:
    """A table no other test uses: its rows and statements are this test's alone."""
    return f"unit_{uuid.uuid4().hex[:16]}"


def _with_app(url: str, name: str) -> str:
    """The URL with an application_name, to find our connections in pg_stat_activity."""
    return f"{url}?application_name={name}"


# -- one statement per step --------------------------------------------------------------


def _statement_calls(admin: psycopg.Connection[Any], table: str) -> int:
    """Top-level statements the server ran that name ``table`` (pg_stat_statements).

    pg_stat_statements (``track = top``) counts each statement a client sent, once,
    however many CTEs or functions it contains; our own queries here do not name the
    table in their text, only as a parameter, so they are not counted.
    """
    row = admin.execute(
        "SELECT coalesce(sum(calls), 0)::int FROM pg_stat_statements"
        " WHERE query LIKE '%%' || %s || '%%' AND toplevel",
        (table,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_each_step_is_one_statement(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str, table: str
) -> None:
    admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    # One connection, so that after the warm-up every statement is prepared on it: no
    # step pays for psycopg's one-off Parse round trip in what is measured.
    with keymutex.Locks(
        postgresql_url, namespace=namespace, table=table, min_size=1, max_size=1
    ) as locks:
        for _ in range(8):
            warm = locks.acquire("warm-up", timeout=0)
            warm.renew()
            locks.holder("warm-up")
            locks.holders("warm")
            warm.release()
        steps = {}
        before = _statement_calls(admin, table)
        lease = locks.acquire("k", timeout=0)
        steps["acquire"] = -before + (before := _statement_calls(admin, table))
        with pytest.raises(keymutex.Locked) as refused:
            locks.acquire("k", timeout=0)
        assert refused.value.holder is not None
        assert refused.value.holder.fence == lease.fence
        steps["refused acquire, with the holder"] = -before + (
            before := _statement_calls(admin, table)
        )
        lease.renew()
        steps["renew"] = -before + (before := _statement_calls(admin, table))
        locks.holder("k")
        steps["holder"] = -before + (before := _statement_calls(admin, table))
        locks.holders("")
        steps["holders"] = -before + (before := _statement_calls(admin, table))
        lease.release()
        steps["release"] = -before + (before := _statement_calls(admin, table))
        many = [locks.acquire(f"many-{n}", timeout=0) for n in range(40)]
        before = _statement_calls(admin, table)
        outcomes = locks._store.renew_many([RenewRequest(x.key, x.token, 30.0) for x in many])
        steps["renew_many of 40"] = _statement_calls(admin, table) - before
        assert all(outcome.ok for outcome in outcomes)
        for lease in many:
            lease.release()
    assert steps == {
        "acquire": 1,
        "refused acquire, with the holder": 1,
        "renew": 1,
        "holder": 1,
        "holders": 1,
        "release": 1,
        "renew_many of 40": 1,
    }


def test_a_sweeping_acquire_is_still_one_statement(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str, table: str
) -> None:
    from keymutex.stores.postgresql import SWEEP_EVERY

    admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    with keymutex.Locks(postgresql_url, namespace=namespace, table=table) as locks:
        before = _statement_calls(admin, table)
        for n in range(SWEEP_EVERY):
            locks.acquire(f"k{n}", timeout=0)
        # The schema set-up, then one statement per acquire (one of them sweeping).
        assert _statement_calls(admin, table) - before == 1 + SWEEP_EVERY


# -- fences ------------------------------------------------------------------------------


def _grant_kinds(locks: keymutex.Locks, key: str) -> list[int]:
    """Fences of a first grant, a grant after expiry, a steal and a grant after release."""
    fences = []
    first = locks.acquire(key, ttl=0.2)
    fences.append(first.fence)
    time.sleep(0.3)
    after_expiry = locks.acquire(key, timeout=0)
    fences.append(after_expiry.fence)
    stolen = locks.acquire(key, steal=True)
    fences.append(stolen.fence)
    stolen.release()
    again = locks.acquire(key, timeout=0)
    fences.append(again.fence)
    again.release()
    return fences


def test_fences_strictly_increase_across_expiry_steal_restart_and_crash(namespace: str) -> None:
    require_postgresql()  # this test starts a server of its own
    fences: list[int] = []
    with running_server() as server, keymutex.Locks(server.url, namespace=namespace) as locks:
        fences += _grant_kinds(locks, "k")
        held = locks.acquire("k")
        fences.append(held.fence)
        server.restart()  # a clean shutdown and start of the same data directory
        # The lease lives on: its row survived, and the pool reconnects by itself.
        holder = locks.holder("k")
        assert holder is not None
        assert (holder.owner, holder.fence) == (held.owner, held.fence)
        held.release()
        fences += _grant_kinds(locks, "k")
        server.kill()  # SIGKILL: crash recovery from the WAL at the next start
        _restart_after_crash(server)
        fences += _grant_kinds(locks, "k")
        fences.append(locks.acquire("other-key").fence)  # one counter for all keys
    assert fences == sorted(fences)
    assert len(set(fences)) == len(fences), fences


def _restart_after_crash(server: PostgresServer) -> None:
    # The killed postmaster's backends exit once they notice; until then a new
    # postmaster refuses the data directory ("pre-existing shared memory block").
    deadline = time.monotonic() + 30
    while True:
        try:
            server.restart()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# -- connections come and go, leases stay ------------------------------------------------


def _backends(admin: psycopg.Connection[Any], application: str) -> list[tuple[int, str]]:
    return [
        (int(pid), str(query))
        for pid, query in admin.execute(
            "SELECT pid, query FROM pg_stat_activity WHERE application_name = %s",
            (application,),
        )
    ]


def _listener_pid(admin: psycopg.Connection[Any], application: str, *, other_than: int = 0) -> int:
    """The pid of the client's LISTEN connection, once there is one (not ``other_than``)."""
    deadline = time.monotonic() + 10
    while True:
        pids = [
            pid
            for pid, query in _backends(admin, application)
            if query.startswith("LISTEN") and pid != other_than
        ]
        if pids or time.monotonic() > deadline:
            (pid,) = pids
            return pid
        time.sleep(0.02)


def test_a_lease_survives_its_connection_being_killed(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str
) -> None:
    application = f"km-{uuid.uuid4().hex[:12]}"
    url = _with_app(postgresql_url, application)
    with (
        keymutex.Locks(url, namespace=namespace) as locks,
        keymutex.Locks(postgresql_url, namespace=namespace) as other,
    ):
        lease = locks.acquire("k", ttl=30)
        killed = _backends(admin, application)
        assert killed, "the client has a connection"
        for pid, _ in killed:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        # The lease is a row, not a session lock: it is still held, by the same fence.
        holder = other.holder("k")
        assert holder is not None
        assert holder.fence == lease.fence
        with pytest.raises(keymutex.Locked):
            other.acquire("k", timeout=0)
        # The client reconnects on its own; the token still renews and releases.
        lease.renew()
        assert {pid for pid, _ in _backends(admin, application)}.isdisjoint(
            pid for pid, _ in killed
        )
        lease.release()
        assert other.holder("k") is None


# -- waiting -----------------------------------------------------------------------------


def test_notify_wakes_a_waiter_promptly(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str
) -> None:
    from keymutex.stores.postgresql import _channel

    # Without a notification a waiter would look again only after a second (the
    # client's safety recheck, RECHECK_INTERVAL): every hand-over here is much faster.
    with (
        keymutex.Locks(postgresql_url, namespace=namespace) as holder_side,
        keymutex.Locks(postgresql_url, namespace=namespace) as waiter_side,
    ):
        lags = []
        for _ in range(5):
            lease = holder_side.acquire("k", ttl=30)
            got: list[float] = []
            waiting = threading.Thread(
                target=lambda got=got: got.append(_acquire_and_release(waiter_side, "k"))
            )
            waiting.start()
            time.sleep(0.4)  # the waiter is refused, listens, and parks
            released_at = time.monotonic()
            lease.release()
            waiting.join(10)
            assert got, "the waiter did not get the key"
            lags.append(got[0] - released_at)
        assert max(lags) < 0.5, lags

    # The wake-up is a NOTIFY on the namespace's channel, carrying the key, and only
    # for a lease someone waits for.
    channel = _channel("keymutex_leases", namespace)
    with psycopg.connect(postgresql_url, autocommit=True) as listener:
        listener.execute(f"LISTEN {channel}")
        with keymutex.Locks(postgresql_url, namespace=namespace) as locks:
            locks.acquire("quiet").release()
            lease = locks.acquire("busy")
            with (
                keymutex.Locks(postgresql_url, namespace=namespace) as other,
                pytest.raises(keymutex.Locked),
            ):
                other.acquire("busy", timeout=0.3)
            lease.release()
        heard = [n.payload for n in listener.notifies(timeout=1.0)]
    assert heard == ["busy"]


def _acquire_and_release(locks: keymutex.Locks, key: str) -> float:
    lease = locks.acquire(key, timeout=10)
    at = time.monotonic()
    lease.release()
    return at


def test_waiters_of_one_locks_share_one_listener_connection(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str
) -> None:
    application = f"km-{uuid.uuid4().hex[:12]}"
    keys = [f"k{n}" for n in range(6)]
    with (
        keymutex.Locks(postgresql_url, namespace=namespace) as holder_side,
        keymutex.Locks(
            _with_app(postgresql_url, application), namespace=namespace, max_size=3
        ) as waiter_side,
    ):
        leases = [holder_side.acquire(key, ttl=30) for key in keys]
        results: list[str] = []
        threads = [
            threading.Thread(
                target=lambda key=key: results.append(waiter_side.acquire(key, timeout=20).key)
            )
            for key in keys
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while True:
            listening = [q for _, q in _backends(admin, application) if q.startswith("LISTEN")]
            if listening or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        time.sleep(0.5)  # every waiter has been refused twice and parks by now
        backends = _backends(admin, application)
        assert [q for _, q in backends if q.startswith("LISTEN")] == [
            f"LISTEN {waiter_side._store._steps.channel}"
        ]
        assert len(backends) <= 3 + 1  # the pool, and one listener
        for lease in leases:
            lease.release()
        for thread in threads:
            thread.join(20)
        assert sorted(results) == keys


@pytest.mark.asyncio
async def test_async_waiters_share_one_listener_and_wake_promptly(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str
) -> None:
    application = f"km-{uuid.uuid4().hex[:12]}"
    keys = [f"k{n}" for n in range(5)]
    async with (
        keymutex.AsyncLocks(postgresql_url, namespace=namespace) as holder_side,
        keymutex.AsyncLocks(
            _with_app(postgresql_url, application), namespace=namespace
        ) as waiter_side,
    ):
        leases = [await holder_side.acquire(key, ttl=30) for key in keys]
        waiting = [asyncio.create_task(waiter_side.acquire(key, timeout=20)) for key in keys]
        await asyncio.to_thread(_listener_pid, admin, application)
        # Every waiter has been refused twice and parks: without a notification it would
        # look again only at its safety recheck, a second from now.
        await asyncio.sleep(0.2)
        backends = await asyncio.to_thread(_backends, admin, application)
        assert len([q for _, q in backends if q.startswith("LISTEN")]) == 1
        released_at = time.monotonic()
        for lease in leases:
            await lease.release()
        granted = await asyncio.gather(*waiting)
        assert time.monotonic() - released_at < 0.5
        assert [lease.key for lease in granted] == keys
        for lease in granted:
            await lease.release()


def test_a_waiter_is_woken_after_its_listener_connection_was_killed(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str
) -> None:
    application = f"km-{uuid.uuid4().hex[:12]}"
    with (
        keymutex.Locks(postgresql_url, namespace=namespace) as holder_side,
        keymutex.Locks(_with_app(postgresql_url, application), namespace=namespace) as waiter_side,
    ):
        lease = holder_side.acquire("k", ttl=30)
        got: list[keymutex.Lease] = []
        waiting = threading.Thread(target=lambda: got.append(waiter_side.acquire("k", timeout=20)))
        waiting.start()
        listener = _listener_pid(admin, application)
        time.sleep(0.2)
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", (listener,))
        # The listener reconnects, listens again and wakes the waiter, which is refused
        # once more and parks: from then on only a notification wakes it within a second.
        _listener_pid(admin, application, other_than=listener)
        time.sleep(0.2)
        released_at = time.monotonic()
        lease.release()
        waiting.join(20)
        assert got
        assert time.monotonic() - released_at < 0.5
        got[0].release()


# -- nothing left behind -----------------------------------------------------------------


def _rows(admin: psycopg.Connection[Any], table: str) -> int:
    row = admin.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


def test_no_rows_are_left_after_release(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str, table: str
) -> None:
    with keymutex.Locks(postgresql_url, namespace=namespace, table=table) as locks:
        for n in range(50):
            with locks.lock(f"user:{n}"):
                pass
        lease = locks.acquire("contended")
        waiter = threading.Thread(target=lambda: locks.acquire("contended", timeout=10).release())
        waiter.start()
        time.sleep(0.3)
        lease.release()
        waiter.join(10)
        assert _rows(admin, table) == 0


def test_expired_rows_are_swept_so_the_table_does_not_grow(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str, table: str
) -> None:
    from keymutex.stores.postgresql import SWEEP_BATCH, SWEEP_EVERY

    with keymutex.Locks(postgresql_url, namespace=namespace, table=table) as locks:
        abandoned = 3 * SWEEP_BATCH  # never released: their holders "crashed"
        for n in range(abandoned):
            locks.acquire(f"abandoned:{n}", ttl=0.2)
        assert _rows(admin, table) == abandoned
        time.sleep(0.3)
        # Every SWEEP_EVERY acquires look at SWEEP_BATCH rows: a few rounds clear them.
        for _ in range(4 * SWEEP_EVERY):
            locks.acquire("busy", timeout=0).release()
        assert _rows(admin, table) == 0


def test_the_table_is_created_once_under_concurrent_first_use(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str, table: str
) -> None:
    clients = 8
    start = threading.Barrier(clients)
    errors: list[BaseException] = []
    fences: list[int] = []

    def first_use(n: int) -> None:
        try:
            with keymutex.Locks(postgresql_url, namespace=namespace, table=table) as locks:
                start.wait(10)
                lease = locks.acquire(f"k{n}", timeout=0)
                fences.append(lease.fence)
                lease.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first_use, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert sorted(fences) == list(range(1, clients + 1))
    tables = admin.execute(
        "SELECT relname FROM pg_class WHERE relname LIKE %s || '%%' ORDER BY relname", (table,)
    ).fetchall()
    assert [name for (name,) in tables] == [
        table,
        f"{table}_fence",
        f"{table}_meta",
        f"{table}_meta_pkey",
        f"{table}_pkey",
    ]
    assert admin.execute(f"SELECT name, value FROM {table}_meta").fetchall() == [("schema", "1")]


def test_a_table_of_another_schema_version_is_refused(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str, table: str
) -> None:
    with keymutex.Locks(postgresql_url, namespace=namespace, table=table) as locks:
        locks.holder("k")  # creates the table
    admin.execute(f"UPDATE {table}_meta SET value = '99' WHERE name = 'schema'")
    with (
        keymutex.Locks(postgresql_url, namespace=namespace, table=table) as locks,
        pytest.raises(keymutex.StoreError, match="schema version 99") as failed,
    ):
        locks.holder("k")
    assert isinstance(failed.value.__cause__, psycopg.Error)


# -- errors and options ------------------------------------------------------------------


def test_an_unreachable_server_is_a_store_error(namespace: str) -> None:
    require_postgresql()
    with running_server() as server:
        url = server.url
    # The server is gone: nothing listens on its port any more.
    started = time.monotonic()
    with (
        keymutex.Locks(url, namespace=namespace, connect_timeout=1) as locks,
        pytest.raises(keymutex.StoreError) as failed,
    ):
        locks.acquire("k", timeout=0)
    assert isinstance(failed.value.__cause__, psycopg.Error)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"tabel": "x"}, TypeError, "accepted: table, min_size, max_size, connect_timeout"),
        ({"password": "x"}, TypeError, "go in the URL"),
        ({"table": "Leases"}, ValueError, "table must be NAME or SCHEMA.NAME"),
        ({"table": "a;drop table x"}, ValueError, "table must be"),
        ({"table": "a.b.c"}, ValueError, "table must be"),
        ({"table": "x" * 49}, ValueError, "table must be"),
        ({"table": 7}, TypeError, "table must be a str"),
        ({"min_size": -1}, ValueError, "min_size"),
        ({"min_size": 1.5}, TypeError, "min_size must be an int"),
        ({"max_size": 0}, ValueError, "max_size"),
        ({"min_size": 5, "max_size": 2}, ValueError, "max_size"),
        ({"connect_timeout": 0}, ValueError, "connect_timeout"),
        ({"connect_timeout": float("nan")}, ValueError, "connect_timeout"),
        ({"connect_timeout": True}, TypeError, "connect_timeout"),
    ],
)
def test_bad_options_are_refused_before_connecting(
    options: dict[str, object], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace(".", r"\.")):
        keymutex.Locks("postgresql://127.0.0.1:1/db", **options)
    with pytest.raises(error):
        keymutex.AsyncLocks("postgresql://127.0.0.1:1/db", **options)


def test_bad_urls_are_refused() -> None:
    with pytest.raises(ValueError, match="not a PostgreSQL URL"):
        keymutex.Locks("postgresql://127.0.0.1/db?no_such_parameter=1")
    with pytest.raises(ValueError, match="both in the URL and as arguments"):
        keymutex.Locks("postgresql://127.0.0.1/db?table=a", table="b")
    with pytest.raises(ValueError, match="min_size must be a number"):
        keymutex.Locks("postgres://127.0.0.1/db?min_size=many")


def test_options_may_come_in_the_url(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str, table: str
) -> None:
    # The command line has only --store URL: our options ride in its query string,
    # next to libpq's own (application_name here).
    application = f"km-{uuid.uuid4().hex[:12]}"
    url = f"{postgresql_url}?table={table}&max_size=2&application_name={application}"
    with keymutex.Locks(url.replace("postgresql://", "postgres://"), namespace=namespace) as locks:
        lease = locks.acquire("k")
        assert _rows(admin, table) == 1
        assert _backends(admin, application)
        lease.release()

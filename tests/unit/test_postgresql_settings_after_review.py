"""The PostgreSQL store behind a pooler and under a role's settings, found by review.

Against a real PostgreSQL (the session's ``postgresql_url``).
"""

from __future__ import annotations

import inspect
import logging
import select
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import keymutex
from keymutex.stores.postgresql import LOCK_SPACE

WAIT = 10.0


@pytest.fixture
def namespace() -> str:
    return f"settings-{uuid.uuid4().hex}"


@pytest.fixture
def admin(postgresql_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(postgresql_url, autocommit=True) as conn:
        yield conn


def _table() -> str:
    return f"unit_{uuid.uuid4().hex[:16]}"


def _rows(admin: psycopg.Connection[Any], table: str) -> int:
    row = admin.execute(f'SELECT count(*) FROM "{table}"').fetchone()
    assert row is not None
    return int(row[0])


def test_a_server_session_passed_on_by_a_pooler_runs_this_tables_statements(
    postgresql_url: str, admin: psycopg.Connection[Any], namespace: str
) -> None:
    """A pooler that hands a server session from client to client (PgBouncer's session
    mode without a reset query) leaves the last client's prepared statements in it.
    Their names were the same for every table and version: the next client's steps
    failed with "already exists", or ran the other table's statement (its leases were
    granted in the wrong table). Simulated here by handing one store's connection,
    statements prepared, to another's pool, which knows of none of them."""
    first, second = _table(), _table()
    with (
        keymutex.Locks(f"{postgresql_url}?table={first}", namespace=namespace) as before,
        keymutex.Locks(f"{postgresql_url}?table={second}", namespace=namespace) as after,
    ):
        before.acquire("warm-up", timeout=0).release()
        after.holder("warm-up")  # its table is made
        donor, taker = before._store._sessions, after._store._sessions  # type: ignore[attr-defined]
        session = donor._free.pop()
        donor._open -= 1
        session.prepared.clear()  # a new client of the pooler has prepared nothing
        taker._free.append(session)
        taker._open += 1
        lease = after.acquire("k", timeout=0)
        assert after.holder("k") is not None
        assert before.holder("k") is None
        assert _rows(admin, second) == 1
        assert _rows(admin, first) == 0
        lease.release()
        assert _rows(admin, second) == 0


def test_a_roles_lock_timeout_does_not_fail_steps(postgresql_url: str, namespace: str) -> None:
    """Steps wait for the key's gate by design (bounded by statement_timeout): a role's
    lock_timeout of 1 ms failed them under contention, releases and give-backs too."""
    url = f"{postgresql_url}?options=-c%20lock_timeout%3D1&table={_table()}"
    failures: list[BaseException] = []
    with keymutex.Locks(url, namespace=namespace) as locks:
        start = threading.Barrier(8)

        def contend() -> None:
            start.wait()
            for _ in range(60):
                try:
                    locks.acquire("hot", timeout=0).release()
                except keymutex.Locked:
                    pass
                except BaseException as exc:
                    failures.append(exc)

        threads = [threading.Thread(target=contend) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert failures == []
        assert locks.holder("hot") is None


# A role's idle_session_timeout, and a wait well past it (the waiter's step connection is
# used again every second; the listener idles all along).
IDLE_MS = 2000
IDLE_WAIT = 3.5


def test_a_roles_idle_session_timeout_does_not_end_the_listener(
    postgresql_url: str, admin: psycopg.Connection[Any], namespace: str, caplog: Any
) -> None:
    """The listener connection idles by design: a role's idle_session_timeout ended it
    every few moments, each time ringing every waiter and logging a warning. (The
    timeout is 2 s: found in CI, a loaded machine took longer than 200 ms between
    opening a step connection and its first statement, and the server had ended it;
    and with 1 s, the waiter's step connection, idle for its one-second recheck, was
    ended by the server as it was used again.)"""
    url = f"{postgresql_url}?options=-c%20idle_session_timeout%3D{IDLE_MS}&table={_table()}"
    caplog.set_level(logging.WARNING, logger="keymutex")
    with keymutex.Locks(url, namespace=namespace) as locks:
        held = locks.acquire("k")
        with pytest.raises(keymutex.Locked):
            locks.acquire("k", timeout=IDLE_WAIT)  # a waiter listens, idle, that long
        held.release()
    assert [r.getMessage() for r in caplog.records if "listener" in r.getMessage()] == []


@pytest.mark.asyncio
async def test_a_roles_idle_session_timeout_does_not_end_the_async_listener(
    postgresql_url: str, namespace: str, caplog: Any
) -> None:
    url = f"{postgresql_url}?options=-c%20idle_session_timeout%3D{IDLE_MS}&table={_table()}"
    caplog.set_level(logging.WARNING, logger="keymutex")
    async with keymutex.AsyncLocks(url, namespace=namespace) as locks:
        held = await locks.acquire("k")
        with pytest.raises(keymutex.Locked):
            await locks.acquire("k", timeout=IDLE_WAIT)
        await held.release()
    assert [r.getMessage() for r in caplog.records if "listener" in r.getMessage()] == []


def _ended_by_the_server(session: Any) -> None:
    """Wait until the server has ended ``session``: its error is on the socket."""
    poller = select.poll()
    poller.register(session.pgconn.socket, select.POLLIN)
    assert poller.poll(30_000), "the server did not end the connection"


def _lent_as_the_server_ends_it(sessions: Any, end: Callable[[Any], None]) -> list[Any]:
    """Make the pool's next ``take`` lend its idle connection as the server ends it: the
    pool checks it (alive), then ``end`` (the session) returns once the server has
    ended it, and the step sends its statement. Returns the sessions lent, in order."""
    take = sessions.take
    lent: list[Any] = []

    def taken(session: Any) -> Any:
        if not lent:
            assert session.idle_since > 0, "not a connection reused from the pool"
            end(session)
        lent.append(session)
        return session

    if inspect.iscoroutinefunction(take):

        async def take_async(**options: Any) -> Any:
            return taken(await take(**options))

        sessions.take = take_async
    else:
        sessions.take = lambda **options: taken(take(**options))
    return lent


def test_a_pooled_connection_ended_for_idle_session_timeout_as_it_is_lent_is_replaced(
    postgresql_url: str, admin: psycopg.Connection[Any], namespace: str
) -> None:
    """Found by review: the server ended a pooled connection for idle_session_timeout
    (57P05) after the pool had checked it and before the step's statement arrived, and
    the step failed with StoreError. The server ends only a session waiting for a
    command: the statement had not run, and the step is sent again on a new connection.
    That moment is made here: the pool's check passes, then the step waits until the
    server has ended the connection (however loaded the machine, the server has)."""
    table = _table()
    url = f"{postgresql_url}?options=-c%20idle_session_timeout%3D{IDLE_MS}&table={table}"
    with keymutex.Locks(url, namespace=namespace) as locks:
        locks.holder("k")  # a connection in the pool
        lent = _lent_as_the_server_ends_it(locks._store._sessions, _ended_by_the_server)  # type: ignore[attr-defined]
        lease = locks.acquire("k", timeout=0)
        first, again = lent[:2]
        assert again is not first, "not sent again on a new connection"
        holder = locks.holder("k")
        assert holder is not None
        assert holder.fence == lease.fence
        assert _rows(admin, table) == 1
        lease.release()


@pytest.mark.asyncio
async def test_an_async_pooled_connection_ended_for_idle_session_timeout_is_replaced(
    postgresql_url: str, admin: psycopg.Connection[Any], namespace: str
) -> None:
    table = _table()
    url = f"{postgresql_url}?options=-c%20idle_session_timeout%3D{IDLE_MS}&table={table}"
    async with keymutex.AsyncLocks(url, namespace=namespace) as locks:
        await locks.holder("k")
        lent = _lent_as_the_server_ends_it(locks._store._sessions, _ended_by_the_server)  # type: ignore[attr-defined]
        lease = await locks.acquire("k", timeout=0)
        first, again = lent[:2]
        assert again is not first, "not sent again on a new connection"
        holder = await locks.holder("k")
        assert holder is not None
        assert holder.fence == lease.fence
        assert _rows(admin, table) == 1
        await lease.release()


class _Idle:
    """A connection of the pool, alive, that records being closed (no server needed)."""

    def __init__(self) -> None:
        self.idle_since = 0.0
        self.closed = False

    def suspect(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


def test_a_fresh_connection_is_opened_beside_an_idle_one_even_at_max_size() -> None:
    """The step sent again takes a new connection, never an idle one (idle as long, it
    may be ended by the server the same way); at max_size the longest idle one is
    closed to make room, rather than waiting for a connection given back."""
    from keymutex.stores.postgresql import _Sessions

    sessions: Any = _Sessions(_Idle, min_size=1, max_size=2, wait=0.1)  # type: ignore[arg-type]
    older, newer = sessions.take(), sessions.take()
    sessions.give(older)
    sessions.give(newer)
    assert sessions.take() is newer  # the most recently used, as usual
    fresh = sessions.take(fresh=True)
    assert fresh not in (older, newer)
    assert older.closed
    assert not newer.closed


def test_a_pooled_connection_ended_otherwise_as_it_is_lent_fails_the_step(
    postgresql_url: str, admin: psycopg.Connection[Any], namespace: str
) -> None:
    """Only idle_session_timeout says the statement did not run: a connection ended
    otherwise (here pg_terminate_backend, 57P01) fails the step as before, never sent
    again (another end, a crash or the network, can come while the statement runs)."""

    def terminated(session: Any) -> None:
        admin.execute("SELECT pg_terminate_backend(%s)", (session.pgconn.backend_pid,))
        _ended_by_the_server(session)

    with keymutex.Locks(f"{postgresql_url}?table={_table()}", namespace=namespace) as locks:
        locks.holder("k")
        lent = _lent_as_the_server_ends_it(locks._store._sessions, terminated)  # type: ignore[attr-defined]
        with pytest.raises(keymutex.StoreError, match="administrator command"):
            locks.acquire("k", timeout=0)
        assert len(lent) == 1
        assert locks.holder("k") is None


def test_a_table_of_something_else_is_refused_and_left_alone(
    postgresql_url: str, admin: psycopg.Connection[Any], namespace: str
) -> None:
    """Found by review: a table of the application's own, named by ?table=, got a
    keymutex meta table and sequence beside it, then every step failed on its columns."""
    table = _table()
    admin.execute(f'CREATE TABLE "{table}" (id int)')
    with (
        keymutex.Locks(f"{postgresql_url}?table={table}", namespace=namespace) as locks,
        pytest.raises(keymutex.StoreError, match="is not a keymutex table"),
    ):
        locks.acquire("k", timeout=0)
    found = admin.execute(
        "SELECT count(*) FROM pg_class WHERE relname IN (%s, %s)",
        (f"{table}_meta", f"{table}_fence"),
    ).fetchone()
    assert found == (0,)


def test_a_roles_extra_float_digits_does_not_round_the_times(
    postgresql_url: str, namespace: str
) -> None:
    """Found by review: the steps return epoch seconds as text, and a role's or
    database's negative extra_float_digits rounded them (acquired_at off by years)."""
    url = f"{postgresql_url}?options=-c%20extra_float_digits%3D-14&table={_table()}"
    with keymutex.Locks(url, namespace=namespace) as locks:
        before = time.time()
        lease = locks.acquire("k", ttl=30, timeout=0)
        after = time.time()
        assert before - 1 <= lease.acquired_at <= after + 1
        holder = locks.holder("k")
        assert holder is not None
        assert holder.expires_at == pytest.approx(lease.acquired_at + 30, abs=0.01)
        lease.release()


def test_first_clients_spelling_the_table_apart_create_it_one_at_a_time(
    postgresql_url: str, admin: psycopg.Connection[Any], namespace: str
) -> None:
    """Found by review: the lock that serialises the table's creators was named by the
    table as spelt, so a client of "T" and one of "public.T" took two locks, both
    created the table at once, and one failed on a catalog unique index. Here a
    creator of "T" holds the lock while a client of "public.T" makes its first step."""
    table = _table()
    created = threading.Event()

    def first_step() -> None:
        url = f"{postgresql_url}?table=public.{table}"
        with keymutex.Locks(url, namespace=namespace) as locks:
            locks.holder("k")
            created.set()

    with admin.transaction():
        admin.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (LOCK_SPACE, f"schema {table}")
        )
        other = threading.Thread(target=first_step)
        other.start()
        assert not created.wait(1.0), "the table was made while another was making it"
    other.join(WAIT)
    assert created.is_set()

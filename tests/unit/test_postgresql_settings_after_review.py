"""The PostgreSQL store behind a pooler and under a role's settings, found by review.

Against a real PostgreSQL (the session's ``postgresql_url``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
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

"""What the PostgreSQL store promises beyond the conformance suite: one statement per
step on its common path, fences that never go back (expiry, steal, server restart and
crash), leases that outlive their connections, connections of a forked child its own,
a release that hands the key over to the first queued waiter and wakes it alone, no
rows left behind, a table created once (and upgraded from version 1), every step
ended in bounded time by a silent server, and strict option checks.

Against a real PostgreSQL (the session's ``postgresql_server``); tests that restart or
crash a server start their own. Each test uses a namespace, and where it counts rows or
statements a table, of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import os
import secrets
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import keymutex
from _pg_fixtures import require_postgresql
from _pg_server import PostgresServer, running_server
from keymutex._store import RenewRequest
from keymutex.cli import _descendants
from keymutex.stores.postgresql import SCHEMA_VERSION

# With rechecks put off to a minute (no_rechecks), a waiter granted within this of the
# release was woken by its notification: far above any hand-over, far below the minute.
NOTIFIED = 10.0


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
    # step pays for the one-off Parse round trip in what is measured.
    with keymutex.Locks(
        postgresql_url, namespace=namespace, table=table, min_size=1, max_size=1
    ) as locks:
        store = locks._store
        for _ in range(8):
            warm = locks.acquire("warm-up", timeout=0)
            warm.renew()
            locks.holder("warm-up")
            locks.holders("warm")
            warm.release()
        # No sweep among the acquires counted below: a sweeping acquire goes to the
        # upsert at once (one statement less on a held key), and the count of acquires
        # between sweeps starts at a random place (1 run in 16 failed here).
        store._steps._acquires = itertools.count(1)
        steps = {}
        before = _statement_calls(admin, table)

        def count(step: str) -> None:
            nonlocal before
            steps[step] = -before + (before := _statement_calls(admin, table))

        lease = locks.acquire("free", timeout=0)
        count("acquire")
        lease.renew()
        count("renew")
        locks.holder("free")
        count("holder")
        locks.holders("")
        count("holders")
        lease.release()
        count("release")

        lease = locks.acquire("k", timeout=0)
        with pytest.raises(keymutex.Locked) as refused:
            locks.acquire("k", timeout=0)
        assert refused.value.holder is not None
        assert refused.value.holder.fence == lease.fence
        count("acquire, then a refused try (with the holder)")
        for step in ("first", "second"):
            waiter = store.waiter("k")
            try:
                outcome = store.try_acquire(
                    "k", token="t" * 24, ttl=30.0, owner="o", info=None, steal=False, waiter=waiter
                )
                assert not outcome.ok
                count(f"{step} waiter's first try")
                outcome = store.try_acquire(
                    "k", token="t" * 24, ttl=30.0, owner="o", info=None, steal=False, waiter=waiter
                )
                assert not outcome.ok
                count(f"{step} waiter's next try")
            finally:
                waiter.close()
            count(f"{step} waiter leaving the queue")
        lease.release()
        count("release of a key contended lately")
        many = [locks.acquire(f"many-{n}", timeout=0) for n in range(40)]
        before = _statement_calls(admin, table)
        outcomes = store.renew_many([RenewRequest(x.key, x.token, 30.0) for x in many])
        count("renew_many of 40")
        assert all(outcome.ok for outcome in outcomes)
        for lease in many:
            lease.release()
    assert steps == {
        "acquire": 1,
        "renew": 1,
        "holder": 1,
        "holders": 1,
        "release": 1,
        # A free key has no row: a first try runs a plain insert; on a key that has a
        # row, it then runs the upsert that refuses (or grants). From then on the key
        # counts as contended for a while, and tries go to the upsert at once.
        "acquire, then a refused try (with the holder)": 1 + 2,
        # Queued; then registered with the listener, which rings it once it listens,
        # for a look again (a hand-over before the LISTEN): not in this call.
        "first waiter's first try": 1,
        "first waiter's next try": 1,
        "first waiter leaving the queue": 1,
        # The store listens already: no second look.
        "second waiter's first try": 1,
        "second waiter's next try": 1,
        "second waiter leaving the queue": 1,
        "release of a key contended lately": 1,
        "renew_many of 40": 1,
    }


def test_a_contended_release_hands_over_in_a_second_statement(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str, table: str
) -> None:
    admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    with (
        keymutex.Locks(postgresql_url, namespace=namespace, table=table) as locks,
        keymutex.Locks(postgresql_url, namespace=namespace, table=table) as other,
    ):
        lease = locks.acquire("k")
        waiter = other._store.waiter("k")
        try:
            outcome = other._store.try_acquire(
                "k", token="w" * 24, ttl=30.0, owner="o", info=None, steal=False, waiter=waiter
            )
            assert not outcome.ok
            before = _statement_calls(admin, table)
            lease.release()
            # The uncontended release (a delete) finds the key queued, the hand-over takes it.
            assert _statement_calls(admin, table) - before == 2
            assert waiter.wait(5.0)
        finally:
            waiter.close()


def test_a_batch_renewal_sends_any_key_intact(postgresql_url: str, namespace: str) -> None:
    # The batch goes out as text[] literals, quoted and escaped by hand.
    keys = ['a"b', "c\\d", "{x,y}", " spaced ", "NULL", "", "é", "🙂", "k'\\\""]
    keys.remove("")  # (keys are never empty)
    with keymutex.Locks(postgresql_url, namespace=namespace) as locks:
        leases = [locks.acquire(key, timeout=0) for key in keys]
        outcomes = locks._store.renew_many(
            [RenewRequest(lease.key, lease.token, 20.0 + n) for n, lease in enumerate(leases)]
        )
        assert [outcome.ok for outcome in outcomes] == [True] * len(keys)
        assert [outcome.holder.key for outcome in outcomes if outcome.holder] == keys
        for n, lease in enumerate(leases):
            holder = locks.holder(lease.key)
            assert holder is not None
            assert holder.expires_at - time.time() > 19 + n
            lease.release()


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
        server.restart_after_crash()
        fences += _grant_kinds(locks, "k")
        fences.append(locks.acquire("other-key").fence)  # one counter for all keys
    assert fences == sorted(fences)
    assert len(set(fences)) == len(fences), fences


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


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_forked_child_uses_connections_of_its_own(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str
) -> None:
    with keymutex.Locks(postgresql_url, namespace=namespace) as locks:
        lease = locks.acquire("parent's", timeout=0)
        store = locks._store
        # Another thread of the parent holds the connections' lock at the moment of the
        # fork: the child must not wait for it (that thread does not exist there).
        holding = threading.Event()
        done = threading.Event()

        def hold_the_lock() -> None:
            with store._sessions._mutex:
                holding.set()
                done.wait(10)

        holder = threading.Thread(target=hold_the_lock)
        holder.start()
        holding.wait(10)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, and leave without running pytest's teardown
            signal.alarm(10)  # rather than hang
            try:
                child = locks.acquire("child's", timeout=0)
                child.release()
                os.write(write_end, b"ok")
            except BaseException as exc:
                os.write(write_end, repr(exc).encode())
            finally:
                os._exit(0)
        done.set()
        holder.join(10)
        os.close(write_end)
        os.waitpid(pid, 0)
        assert os.read(read_end, 1000) == b"ok"
        os.close(read_end)
        # The parent's connections went on working for the parent alone.
        holder_now = locks.holder("parent's")
        assert holder_now is not None
        assert holder_now.fence == lease.fence
        lease.release()


def test_an_async_store_used_before_a_fork_gives_the_child_connections_of_its_own(
    postgresql_url: str, namespace: str
) -> None:
    """The child sent its statements on the parent's connections, and each read the
    other's replies: errors on both sides, releases lost (a pre-fork server's master
    that checked its lock store before forking its workers)."""
    locks = keymutex.AsyncLocks(postgresql_url, namespace=namespace)

    async def work(name: str) -> list[str]:
        errors = []
        for n in range(200):
            try:
                lease = await locks.acquire(f"{name}:{n % 5}", ttl=30, timeout=5)
                await lease.release()
            except Exception as exc:  # what the test reports
                errors.append(repr(exc))
        return errors

    async def warm_up() -> None:
        await (await locks.acquire("warm-up", timeout=0)).release()

    asyncio.run(warm_up())  # a connection of the parent's, in the pool
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and leave without running pytest's teardown
        signal.alarm(60)  # rather than hang
        try:
            os.write(write_end, json.dumps(asyncio.run(work("child"))).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    parent_errors = asyncio.run(work("parent"))
    os.waitpid(pid, 0)
    child_errors = json.loads(os.read(read_end, 100_000) or b'["no report"]')
    os.close(read_end)
    asyncio.run(locks.aclose())
    assert parent_errors == []
    assert child_errors == []


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

    # The wake-up is a NOTIFY on the namespace's channel, carrying the id of the one
    # waiter the key is handed over to (never a token: anyone may LISTEN), and only
    # when someone waits.
    channel = _channel("keymutex_leases", namespace)
    with (
        psycopg.connect(postgresql_url, autocommit=True) as listener,
        keymutex.Locks(postgresql_url, namespace=namespace) as locks,
        keymutex.Locks(postgresql_url, namespace=namespace) as other,
    ):
        listener.execute(f"LISTEN {channel}")
        locks.acquire("quiet").release()
        lease = locks.acquire("busy")
        waiter = other._store.waiter("busy")
        token = "b" * 24
        try:
            outcome = other._store.try_acquire(
                "busy", token=token, ttl=30.0, owner="o", info=None, steal=False, waiter=waiter
            )
            assert not outcome.ok
            lease.release()
            heard = [n.payload for n in listener.notifies(timeout=1.0)]
        finally:
            waiter.close()
    assert heard == [waiter.id]
    assert token not in heard[0]


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


@pytest.mark.usefixtures("no_rechecks")
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
        assert time.monotonic() - released_at < NOTIFIED
        assert [lease.key for lease in granted] == keys
        for lease in granted:
            await lease.release()


@pytest.mark.usefixtures("no_rechecks")
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
        assert time.monotonic() - released_at < NOTIFIED
        got[0].release()


# -- hand-over: one waiter woken, in queue order -----------------------------------------


def _token() -> str:
    return secrets.token_urlsafe(18)


def _listening(store: Any, key: str) -> None:
    """Make the listener of ``store`` listen, with a waiter refused ``key`` (it is
    registered after its refusal, and rung once the listener listens: a hand-over
    notified before went unheard), which then leaves the queue."""
    waiter = store.waiter(key)
    try:
        outcome = store.try_acquire(
            key, token=_token(), ttl=30.0, owner="waiter", info=None, steal=False, waiter=waiter
        )
        assert not outcome.ok
        assert waiter.wait(5.0), "not rung once the listener listened"
    finally:
        waiter.close()


def _queue(store: Any, key: str, waiters: int) -> list[Any]:
    """``waiters`` waiters of ``store`` queued for ``key`` (refused, listening), in order."""
    _listening(store, key)
    queued = []
    for _ in range(waiters):
        waiter = store.waiter(key)
        queued.append(waiter)
        outcome = store.try_acquire(
            key, token=_token(), ttl=30.0, owner="waiter", info=None, steal=False, waiter=waiter
        )
        assert not outcome.ok
    return queued


def _rung(waiters: list[Any], expected: set[int]) -> list[int]:
    """Which waiters were rung (and forget it): those ``expected`` are waited for (a few
    seconds at most), then the others are looked at a moment later, without waiting."""
    rung = [n for n in sorted(expected) if waiters[n].wait(5.0)]
    time.sleep(0.05)  # a wrong ring would come with the right one
    return sorted(
        rung + [n for n in range(len(waiters)) if n not in expected and waiters[n].wait(0)]
    )


def test_a_release_wakes_the_first_queued_waiter_only(postgresql_url: str, namespace: str) -> None:
    with (
        keymutex.Locks(postgresql_url, namespace=namespace) as holder_side,
        keymutex.Locks(postgresql_url, namespace=namespace) as waiter_side,
    ):
        store = waiter_side._store
        lease = holder_side.acquire("k")
        waiters = _queue(store, "k", 3)
        try:
            assert _rung(waiters, set()) == []
            lease.release()
            # The key is kept for the first waiter: not the releaser, nor anyone else.
            with pytest.raises(keymutex.Locked) as refused:
                holder_side.acquire("k", timeout=0)
            assert refused.value.holder is None  # handed over: nobody holds it yet
            assert _rung(waiters, {0}) == [0]
            for turn, waiter in enumerate(waiters):
                token = _token()
                outcome = store.try_acquire(
                    "k", token=token, ttl=30.0, owner="w", info=None, steal=False, waiter=waiter
                )
                assert outcome.ok, f"waiter {turn} was not given the key"
                assert store.release("k", token).ok
                after = {turn + 1} if turn + 1 < len(waiters) else set()
                assert _rung(waiters, after) == sorted(after)
        finally:
            for waiter in waiters:
                waiter.close()
        # The last release found nobody queued: the row is gone, the key free for all.
        holder_side.acquire("k", timeout=0).release()


@pytest.mark.parametrize("lapsed", [False, True], ids=["in-its-turn", "after-its-turn-lapsed"])
def test_a_waiter_that_gives_up_passes_the_key_on(
    postgresql_url: str, namespace: str, lapsed: bool
) -> None:
    """A waiter handed the key that gives up passes it on, and the next waiter is rung;
    also when it gave up after its turn lapsed (slower than HANDOVER_MS: a busy host),
    as nobody was granted the key since."""
    from keymutex.stores.postgresql import HANDOVER_MS

    with (
        keymutex.Locks(postgresql_url, namespace=namespace) as holder_side,
        keymutex.Locks(postgresql_url, namespace=namespace) as waiter_side,
    ):
        store = waiter_side._store
        lease = holder_side.acquire("k")
        first, second = waiters = _queue(store, "k", 2)
        try:
            lease.release()
            # The key is handed to the first; its ring comes through the listener
            # thread, so it is waited for before the first leaves (a waiter closed
            # before its ring arrives is rung no more).
            assert _rung(waiters, {0}) == [0]
            if lapsed:
                time.sleep(HANDOVER_MS / 1000 + 0.1)
            first.close()  # leaves the queue with the key just handed to it
            assert _rung(waiters, {1}) == [1]
            token = _token()
            outcome = store.try_acquire(
                "k", token=token, ttl=30.0, owner="w", info=None, steal=False, waiter=second
            )
            assert outcome.ok
            assert store.release("k", token).ok
        finally:
            for waiter in waiters:
                waiter.close()


def test_a_retried_acquire_of_ones_own_lease_does_not_queue_its_waiter(
    postgresql_url: str, namespace: str, admin: psycopg.Connection[Any], table: str
) -> None:
    """A caller retrying with the token it already holds the key with (the lock server
    passes callers' tokens) is granted again, and leaves no place in the queue that
    would reserve the key, after the release, for a waiter that will never come."""
    with (
        keymutex.Locks(postgresql_url, namespace=namespace, table=table) as holder_side,
        keymutex.Locks(postgresql_url, namespace=namespace, table=table) as other,
    ):
        store = holder_side._store
        token = _token()
        for _ in range(2):
            waiter = store.waiter("k")
            outcome = store.try_acquire(
                "k", token=token, ttl=30.0, owner="me", info=None, steal=False, waiter=waiter
            )
            assert outcome.ok
            # Granted: the client drops its waiter without leaving any queue (on_close
            # is cleared), so the row must not keep the waiter's place.
            (queued,) = admin.execute(f"SELECT waiters FROM {table}").fetchone()
            assert queued in (None, [])
            waiter.close()
        assert store.release("k", token).ok
        other.acquire("k", timeout=0).release()  # not reserved for anyone


def _queued_row(
    admin: psycopg.Connection[Any], table: str, namespace: str, *, held: bool, waiters: list[str]
) -> None:
    """The row of key ``k``: its lease live (``held``) and nobody handed the key, or its
    lease ended and the key handed over to waiter ``A``; ``waiters`` queued."""
    reserved = "NULL, NULL" if held else "'A', now() + interval '1 minute'"
    admin.execute(
        f"INSERT INTO {table} (namespace, key, token, owner, fence, acquired_at, expires_at,"
        f" waiters, queue_until, reserved_for, reserved_until) VALUES (%s, 'k', 't', 'o', 1,"
        f" now(), now() + interval '{60 if held else 0} seconds', %s,"
        f" now() + interval '1 minute', {reserved})",
        (namespace, waiters),
    )


def test_a_waiter_leaving_as_the_queue_changes_under_it_notifies_one_waiter(
    postgresql_url: str, admin: psycopg.Connection[Any], table: str, namespace: str
) -> None:
    """Found by review: a waiter leaving with the key handed to it notified the next
    waiter from the UPDATE's SET, which PostgreSQL computes again, on the newest
    version, when the row changed after the statement's snapshot; the first
    computation's notification was sent too. Here A, handed the key, leaves while B,
    next in the queue, leaves too: B's transaction commits after A's statement read the
    row and before it could lock it. Only C, next now, is notified (not B as well)."""
    from keymutex.stores.postgresql import _channel

    application = f"km-{uuid.uuid4().hex[:12]}"
    url = f"{postgresql_url}?table={table}&application_name={application}"
    with (
        keymutex.Locks(url, namespace=namespace) as locks,
        psycopg.connect(postgresql_url, autocommit=True) as listening,
        psycopg.connect(postgresql_url) as other,
    ):
        store: Any = locks._store  # its steps, below the public API
        locks.holder("k")  # the table exists
        _queued_row(admin, table, namespace, held=False, waiters=["B", "C"])
        channel = _channel(table, namespace)
        listening.execute(f"LISTEN {channel}")
        # B's leave, as its statement does it (B was not handed the key), held open.
        other.execute(f"UPDATE {table} SET waiters = array_remove(waiters, 'B')")
        leaving = concurrent.futures.ThreadPoolExecutor(1)
        left = leaving.submit(store._run, store._steps.leave("k", "A"))

        def waits_for_the_row() -> bool:
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name = %s AND wait_event_type = 'Lock'",
                (application,),
            ).fetchone()
            return row is not None and row[0] == 1

        _wait_for(waits_for_the_row)
        other.commit()
        assert left.result(timeout=10) is True
        leaving.shutdown()
        # Notifications come in commit order: the leave's are all in before this one.
        admin.execute("SELECT pg_notify(%s, 'end')", (channel,))
        notified = []
        for notification in listening.notifies(timeout=10):
            if notification.payload == "end":
                break
            notified.append(notification.payload)
        assert notified == ["C"]
        row = admin.execute(f"SELECT waiters, reserved_for FROM {table}").fetchone()
        assert row == ([], "C")


def test_a_waiter_leaving_a_key_not_handed_to_it_leaves_no_hand_over_behind(
    postgresql_url: str, admin: psycopg.Connection[Any], table: str, namespace: str
) -> None:
    """Found by review: the leave's "handed to me" was NULL when nobody was handed the
    key, and the NULL took the hand-over's branch for reserved_until: a hand-over to
    nobody for HANDOVER_MS, which kept the key from everyone if its lease ended then."""
    with keymutex.Locks(f"{postgresql_url}?table={table}", namespace=namespace) as locks:
        store: Any = locks._store  # its steps, below the public API
        locks.holder("k")
        _queued_row(admin, table, namespace, held=True, waiters=["D", "E"])
        assert store._run(store._steps.leave("k", "D")) is True
        row = admin.execute(
            f"SELECT waiters, reserved_for, reserved_until FROM {table}"
        ).fetchone()
        assert row == (["E"], None, None)


def test_closing_twice_touches_no_file_of_someone_else(postgresql_url: str) -> None:
    locks = keymutex.Locks(postgresql_url)
    locks.acquire("k", timeout=0).release()
    locks.close()
    read_end, write_end = os.pipe()  # may get the numbers the store's pipe had
    try:
        locks.close()
        os.write(write_end, b"mine")
        assert os.read(read_end, 16) == b"mine"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_nul_in_a_text_parameter_is_refused_not_cut_short(
    postgresql_url: str, namespace: str
) -> None:
    with keymutex.Locks(postgresql_url, namespace=namespace) as locks:
        # Below the public API, which refuses NUL in keys and owners itself.
        with pytest.raises(ValueError, match="NUL"):
            locks._store.try_acquire(
                "a\x00b", token=_token(), ttl=5.0, owner="o", info=None, steal=False, waiter=None
            )
        assert locks.holder("a") is None


def test_a_vanished_waiter_holds_the_others_up_for_a_hand_over_and_a_recheck(
    postgresql_url: str, namespace: str
) -> None:
    from keymutex.stores.postgresql import HANDOVER_MS

    with (
        keymutex.Locks(postgresql_url, namespace=namespace) as holder_side,
        keymutex.Locks(postgresql_url, namespace=namespace) as waiter_side,
    ):
        lease = holder_side.acquire("k")
        (vanished,) = _queue(waiter_side._store, "k", 1)  # never tries again, never leaves
        try:
            got: list[float] = []
            waiting = threading.Thread(
                target=lambda: got.append(_acquire_and_release(waiter_side, "k"))
            )
            waiting.start()
            time.sleep(0.3)  # queued behind the vanished waiter
            released_at = time.monotonic()
            lease.release()
            waiting.join(10)
            assert got, "the waiter did not get the key"
            # Nobody tells the next waiter that the hand-over lapsed: it finds out at
            # its one-second recheck.
            assert HANDOVER_MS / 1000 - 0.05 < got[0] - released_at < HANDOVER_MS / 1000 + 1.5
        finally:
            vanished.close()


@pytest.mark.usefixtures("no_rechecks")
def test_waiters_get_the_key_in_arrival_order(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str, table: str
) -> None:
    clients = [
        keymutex.Locks(postgresql_url, namespace=namespace, table=table, owner=f"w{n}")
        for n in range(4)
    ]
    order: list[str] = []

    def take(locks: keymutex.Locks) -> None:
        lease = locks.acquire("k", timeout=20)
        order.append(lease.owner)
        time.sleep(0.02)
        lease.release()

    def queued() -> int:
        row = admin.execute(
            f"SELECT cardinality(waiters) FROM {table} WHERE namespace = %s", (namespace,)
        ).fetchone()
        return 0 if row is None else int(row[0])

    try:
        lease = clients[0].acquire("k")
        threads = []
        for n, locks in enumerate(clients[1:], start=1):
            thread = threading.Thread(target=take, args=(locks,))
            thread.start()
            threads.append(thread)
            deadline = time.monotonic() + 10
            while queued() < n and time.monotonic() < deadline:
                time.sleep(0.01)
        released_at = time.monotonic()
        lease.release()
        # The releaser cannot take the key back ahead of the queue.
        with pytest.raises(keymutex.Locked):
            clients[0].acquire("k", timeout=0)
        for thread in threads:
            thread.join(20)
        assert order == ["w1", "w2", "w3"]
        # Each hand-over wakes its waiter at once (three holds of 20 ms each).
        assert time.monotonic() - released_at < NOTIFIED
    finally:
        for locks in clients:
            locks.close()


@pytest.mark.usefixtures("no_rechecks")
@pytest.mark.asyncio
async def test_async_waiters_get_the_key_in_arrival_order(
    postgresql_url: str, namespace: str
) -> None:
    clients = [
        keymutex.AsyncLocks(postgresql_url, namespace=namespace, owner=f"w{n}") for n in range(4)
    ]
    order: list[str] = []

    async def take(locks: keymutex.AsyncLocks) -> None:
        lease = await locks.acquire("k", timeout=20)
        order.append(lease.owner)
        await asyncio.sleep(0.02)
        await lease.release()

    try:
        lease = await clients[0].acquire("k")
        tasks = []
        for locks in clients[1:]:
            tasks.append(asyncio.create_task(take(locks)))
            await asyncio.sleep(0.3)  # refused, queued, listening
        released_at = time.monotonic()
        await lease.release()
        await asyncio.gather(*tasks)
        assert order == ["w1", "w2", "w3"]
        assert time.monotonic() - released_at < NOTIFIED
    finally:
        for locks in clients:
            await locks.aclose()


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
        abandoned = 3 * SWEEP_BATCH
        for n in range(abandoned):
            locks.acquire(f"abandoned:{n}", ttl=30)
        assert _rows(admin, table) == abandoned
        # Their holders "crashed" and the leases ran out (by hand: no sweep sees them
        # expire while they are being made). Some rows also carry a hand-over to a
        # waiter that vanished and a lapsed queue. One row's queue is live: it stays.
        admin.execute(f"UPDATE {table} SET expires_at = now() - interval '1 s'")
        admin.execute(
            f"UPDATE {table} SET reserved_for = 'gone', reserved_until = now() - interval '1 s',"
            " waiters = '{x}', queue_until = now() - interval '1 s'"
            " WHERE key LIKE 'abandoned:1%'"
        )
        admin.execute(
            f"UPDATE {table} SET waiters = '{{x}}', queue_until = now() + interval '1 minute'"
            " WHERE key = 'abandoned:7'"
        )
        # Every SWEEP_EVERY acquires look at SWEEP_BATCH rows: a few rounds clear them.
        for _ in range(4 * SWEEP_EVERY):
            locks.acquire("busy", timeout=0).release()
        assert admin.execute(f"SELECT key FROM {table}").fetchall() == [("abandoned:7",)]


def test_short_lived_clients_sweep_expired_rows_too(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str, table: str
) -> None:
    """Each store counted its acquires from 1 and swept at the 16th: clients making
    fewer (a CLI run, a cron job, a Locks per request) never swept, and the rows of
    holders that died stayed for good."""
    from keymutex.stores.postgresql import SWEEP_BATCH

    with keymutex.Locks(postgresql_url, namespace=namespace, table=table) as locks:
        for n in range(SWEEP_BATCH // 2):
            locks.acquire(f"abandoned:{n}", ttl=30)
    admin.execute(f"UPDATE {table} SET expires_at = now() - interval '1 s'")  # they died
    # One acquire each: with a sweep every 16th acquire from a random start, the odds
    # that none of 200 sweeps are (15/16)^200, about 2.5e-6.
    for _ in range(200):
        with keymutex.Locks(postgresql_url, namespace=namespace, table=table) as locks:
            locks.acquire("busy", timeout=0).release()
    assert _rows(admin, table) == 0


def test_unix_socket_and_libpq_parameters_with_spaces_reach_libpq_intact(
    admin: psycopg.Connection[Any], postgresql_server: PostgresServer, namespace: str
) -> None:
    """``postgresql:///db?host=/socket/dir`` lost its ``//`` (libpq then read it as
    key=value text), and ``options=-c%20search_path%3D…`` reached libpq as
    ``+c+search_path…`` (re-encoded with ``+`` for spaces)."""
    application = f"km {uuid.uuid4().hex[:12]}"
    url = (
        f"postgresql:///postgres?host={postgresql_server.sockets}&port={postgresql_server.port}"
        f"&user=postgres&application_name={application.replace(' ', '%20')}"
        "&options=-c%20search_path%3Dpublic"
    )
    with keymutex.Locks(url, namespace=namespace) as locks:
        lease = locks.acquire("k", timeout=0)
        assert _backends(admin, application)
        lease.release()


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
    assert admin.execute(f"SELECT name, value FROM {table}_meta").fetchall() == [
        ("schema", str(SCHEMA_VERSION))
    ]


def test_a_table_of_schema_version_1_is_upgraded_in_place(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str, table: str
) -> None:
    # What version 1 created (it had no queue), with a lease of one of its clients.
    admin.execute(f"CREATE TABLE {table}_meta (name text PRIMARY KEY, value text NOT NULL)")
    admin.execute(f"INSERT INTO {table}_meta VALUES ('schema', '1')")
    admin.execute(f"CREATE SEQUENCE {table}_fence AS bigint START 7")
    admin.execute(
        f'CREATE TABLE {table} (namespace text COLLATE "C" NOT NULL,'
        ' key text COLLATE "C" NOT NULL, token text NOT NULL, owner text NOT NULL,'
        " info json, fence bigint NOT NULL, acquired_at timestamptz NOT NULL,"
        " expires_at timestamptz NOT NULL, contended boolean NOT NULL DEFAULT false,"
        " PRIMARY KEY (namespace, key)) WITH (fillfactor = 80)"
    )
    admin.execute(
        f"INSERT INTO {table} VALUES (%s, 'k', 'old-token', 'old client', NULL, 6, now(),"
        " now() + interval '1 minute', false)",
        (namespace,),
    )
    with keymutex.Locks(postgresql_url, namespace=namespace, table=table) as locks:
        holder = locks.holder("k")
        assert holder is not None
        assert (holder.owner, holder.fence) == ("old client", 6)
        with pytest.raises(keymutex.Locked):
            locks.acquire("k", timeout=0)
        got: list[keymutex.Lease] = []
        waiting = threading.Thread(target=lambda: got.append(locks.acquire("k", timeout=10)))
        waiting.start()
        time.sleep(0.3)
        locks.release("k", "old-token")  # the old client's lease, released statelessly
        waiting.join(10)
        assert got
        assert got[0].fence > 6
        got[0].release()
    assert admin.execute(f"SELECT value FROM {table}_meta").fetchall() == [(str(SCHEMA_VERSION),)]


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


# -- a silent server: every step ends in bounded time ------------------------------------

# A step waits this long for the server's reply in these tests (the default is 5 s).
TIMEOUT = 0.5
# Room for a busy machine between the timeout and the step's end.
SLACK = 1.5


@contextlib.contextmanager
def _paused(pid: int) -> Iterator[None]:
    """SIGSTOP a server process for the block: its socket stays open, nothing answers."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _step_backend(admin: psycopg.Connection[Any], application: str) -> int:
    """The pid of the client's one step connection (it has no listener: nobody waited)."""
    (pid,) = [pid for pid, _ in _backends(admin, application)]
    return pid


def _gone(admin: psycopg.Connection[Any], pid: int) -> bool:
    row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return row is not None and row[0] == 0


def _wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {predicate}"
        time.sleep(0.02)


STEPS: dict[str, Callable[[keymutex.Locks, keymutex.Lease], object]] = {
    "acquire": lambda locks, lease: locks.acquire("other", timeout=0, ttl=1.0),
    "renew": lambda locks, lease: lease.renew(),
    "release": lambda locks, lease: lease.release(),
    "holder": lambda locks, lease: locks.holder("k"),
    "holders": lambda locks, lease: locks.holders(""),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_silent_server_fails_a_step_within_the_timeout(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str, step: str
) -> None:
    application = f"km-{uuid.uuid4().hex[:12]}"
    url = _with_app(postgresql_url, application)
    with keymutex.Locks(url, namespace=namespace, timeout=TIMEOUT, max_size=1) as locks:
        lease = locks.acquire("k", ttl=30)
        pid = _step_backend(admin, application)
        with _paused(pid):
            started = time.monotonic()
            with pytest.raises(keymutex.StoreError) as failed:
                STEPS[step](locks, lease)
            took = time.monotonic() - started
        assert TIMEOUT <= took < TIMEOUT + SLACK
        assert f"no reply from the server within {TIMEOUT:g} s" in str(failed.value)
        assert isinstance(failed.value.__cause__, TimeoutError)
        # The connection with a statement in flight was closed, never used again: the
        # resumed server process sees it gone and exits; the next step connects anew.
        _wait_for(lambda: _gone(admin, pid))
        locks.holders("")
        assert _step_backend(admin, application) != pid
        # (The resumed server process may have run the statement it was sent.)
        if step == "release":
            # The failed release is the client's to finish: it tries again in the
            # background until it lands (found in CI: a release here, made before that
            # landed, raised LockLost, "already released").
            _wait_for(lambda: locks.holder("k") is None)
        elif locks.holder("k") is not None:
            lease.release()


@pytest.mark.asyncio
async def test_a_silent_server_fails_an_async_step_within_the_timeout(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str
) -> None:
    application = f"km-{uuid.uuid4().hex[:12]}"
    url = _with_app(postgresql_url, application)
    async with keymutex.AsyncLocks(url, namespace=namespace, timeout=TIMEOUT, max_size=1) as locks:
        lease = await locks.acquire("k", ttl=30)
        pid = _step_backend(admin, application)
        with _paused(pid):
            started = time.monotonic()
            with pytest.raises(keymutex.StoreError, match="no reply from the server") as failed:
                await lease.renew()
            took = time.monotonic() - started
        assert TIMEOUT <= took < TIMEOUT + SLACK
        assert isinstance(failed.value.__cause__, TimeoutError)
        await asyncio.to_thread(_wait_for, lambda: _gone(admin, pid))
        await lease.renew()  # on a new connection
        assert _step_backend(admin, application) != pid
        await lease.release()


@contextlib.contextmanager
def _whole_server_paused(server: PostgresServer) -> Iterator[None]:
    """SIGSTOP the server's every process for the block: nothing answers, nor connects."""
    assert server.process is not None
    paused = []
    for pid in [server.process.pid, *_descendants(server.process.pid)]:
        # A backend may end between the listing and the signal (seen in CI, under
        # load): it needs no pausing.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
            paused.append(pid)
    try:
        yield
    finally:
        for pid in paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_a_waiter_whose_try_went_unanswered_leaves_without_waiting_again(
    namespace: str,
) -> None:
    """Found by a review: with the whole server paused, the waiter's failed try waited
    ``timeout``, then leaving the queue waited for a new connection (``connect_timeout``)
    once more. Its place is passed over at its turn instead (module: _UNANSWERED)."""
    with running_server() as server:
        url = f"{server.url}?connect_timeout=3"
        with (
            keymutex.Locks(server.url, namespace=namespace, owner="holder") as holding,
            keymutex.Locks(url, namespace=namespace, timeout=3.0) as waiting,
        ):
            lease = holding.acquire("job", ttl=600.0, timeout=0)
            waiting.holder("job")  # connected
            with _whole_server_paused(server):
                started = time.monotonic()
                with pytest.raises(keymutex.StoreError):
                    waiting.acquire("job", timeout=1.0)
                took = time.monotonic() - started
            assert took < 5.0, f"{took:.1f} s: more than the one 3 s timeout it waited for"
            lease.release()
            again = waiting.acquire("job", timeout=10.0)  # nothing of it is in the way
            assert again.fence > lease.fence
            again.release()


@pytest.mark.asyncio
async def test_an_async_waiter_whose_try_went_unanswered_leaves_without_waiting_again(
    namespace: str,
) -> None:
    with running_server() as server:
        url = f"{server.url}?connect_timeout=3"
        async with (
            keymutex.AsyncLocks(server.url, namespace=namespace, owner="holder") as holding,
            keymutex.AsyncLocks(url, namespace=namespace, timeout=3.0) as waiting,
        ):
            lease = await holding.acquire("job", ttl=600.0, timeout=0)
            await waiting.holder("job")  # connected
            with _whole_server_paused(server):
                started = time.monotonic()
                with pytest.raises(keymutex.StoreError):
                    await waiting.acquire("job", timeout=1.0)
                took = time.monotonic() - started
            assert took < 5.0, f"{took:.1f} s: more than the one 3 s timeout it waited for"
            await lease.release()
            again = await waiting.acquire("job", timeout=10.0)
            assert again.fence > lease.fence
            await again.release()


def test_a_grant_whose_reply_was_lost_is_given_back(
    admin: psycopg.Connection[Any],
    postgresql_url: str,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Resumed, the server process reads the statement it was sent and grants the key,
    though nobody hears of it: the key was held by nobody for its TTL. The client now
    gives it back, by its token (keymutex._giveback)."""
    # No sweeping acquire: its statement, not prepared by the warm-up, would wait for
    # its preparation first, and the server paused then: nothing granted to test.
    monkeypatch.setattr("keymutex.stores.postgresql.SWEEP_EVERY", 10**9)
    application = f"km-{uuid.uuid4().hex[:12]}"
    url = _with_app(postgresql_url, application)
    # 2 x TIMEOUT: resumed, the server runs the statement within 0.9 x timeout (its
    # statement_timeout) or gives it up; a starved server took over 0.45 s once.
    # Found in CI, on a loaded machine: the resumed server gave the statement up (its
    # statement_timeout) and granted nothing, so nothing was given back. Tried again
    # then: each time the key must be free for another client (a grant not given
    # back would hold it 600 s), and once at least the server must have granted it.
    with (
        keymutex.Locks(url, namespace=namespace, timeout=2 * TIMEOUT, owner="lost") as locks,
        keymutex.Locks(postgresql_url, namespace=namespace) as other,
    ):
        locks.acquire("warm-up", timeout=0).release()  # connected, statements prepared
        for attempt in range(3):
            key = f"k{attempt}"
            with _paused(_step_backend(admin, application)), pytest.raises(keymutex.StoreError):
                locks.acquire(key, timeout=0, ttl=600.0)
            other.acquire(key, timeout=10.0).release()
            if any(f"released {key!r}" in r.getMessage() for r in caplog.records):
                break
    given_back = [r.getMessage() for r in caplog.records if "released 'k" in r.getMessage()]
    assert given_back, "the server never granted the key after the client gave up (3 tries)"


def test_a_statement_the_client_gave_up_on_is_given_up_by_the_server_too(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str
) -> None:
    from keymutex.stores.postgresql import LOCK_SPACE

    application = f"km-{uuid.uuid4().hex[:12]}"
    url = _with_app(postgresql_url, application)

    def waiting_for_the_gate() -> int:
        row = admin.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE application_name = %s AND wait_event = 'advisory'",
            (application,),
        ).fetchone()
        return 0 if row is None else int(row[0])

    with (
        keymutex.Locks(url, namespace=namespace, timeout=TIMEOUT) as locks,
        keymutex.Locks(postgresql_url, namespace=namespace) as other,
    ):
        locks.holder("k")
        # The key's gate is taken by someone else's transaction: the acquire waits in the
        # server, which answers nothing meanwhile.
        with admin.transaction():
            admin.execute(
                "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (LOCK_SPACE, f"{namespace}/k")
            )
            started = time.monotonic()
            # The server's error (statement_timeout, a little shorter than the client's
            # timeout) comes first, unless a busy host delays it past the client's own.
            with pytest.raises(
                keymutex.StoreError, match=r"statement timeout|no reply from the server within"
            ):
                locks.acquire("k", timeout=0)
            assert time.monotonic() - started < TIMEOUT + SLACK
            # Either way the server cancels the statement: it does not grant the key once
            # the gate opens, long after its client gave up.
            _wait_for(lambda: waiting_for_the_gate() == 0)
        time.sleep(0.2)
        assert other.holder("k") is None


def test_no_connection_free_within_connect_timeout_is_a_store_error(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str
) -> None:
    application = f"km-{uuid.uuid4().hex[:12]}"
    url = _with_app(postgresql_url, application)
    with keymutex.Locks(
        url, namespace=namespace, timeout=5, max_size=1, connect_timeout=0.5
    ) as locks:
        locks.holder("k")

        def hold_the_connection() -> None:
            with contextlib.suppress(keymutex.StoreError):
                locks.holder("k")

        busy = threading.Thread(target=hold_the_connection)
        with _paused(_step_backend(admin, application)):
            busy.start()  # takes the one connection, and waits on it
            time.sleep(0.2)
            started = time.monotonic()
            with pytest.raises(keymutex.StoreError, match=r"no connection free within 0\.5 s"):
                locks.holder("k")
            assert time.monotonic() - started < 0.5 + SLACK
        busy.join(10)


def test_connections_have_keepalives_and_a_tcp_user_timeout() -> None:
    from keymutex.stores.postgresql import _parse

    target = _parse("postgresql://h/db", {"timeout": 2.5})
    assert target.timeout == 2.5
    assert target.connect_kwargs["keepalives"] == 1
    assert target.connect_kwargs["tcp_user_timeout"] == 2500
    assert target.setup() == (
        b"SET statement_timeout = 2250; SET lock_timeout = 0;"
        b" SET default_transaction_isolation = 'read committed'; SET extra_float_digits = 3"
    )
    # What the URL says wins.
    target = _parse("postgresql://h/db?keepalives=0&tcp_user_timeout=100&timeout=1", {})
    assert target.timeout == 1
    assert "keepalives" not in target.connect_kwargs
    assert "tcp_user_timeout" not in target.connect_kwargs


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
        (
            {"tabel": "x"},
            TypeError,
            "accepted: table, min_size, max_size, connect_timeout, timeout",
        ),
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
        ({"timeout": 0}, ValueError, "option timeout must be seconds > 0 and at most 2147483"),
        ({"timeout": float("inf")}, ValueError, "at most 2147483, not inf"),
        ({"timeout": 30 * 86400}, ValueError, "at most 2147483, not 2592000"),
        ({"timeout": 10**400}, ValueError, "not an integer of about 401 digits"),
        ({"timeout": "soon"}, ValueError, "option timeout must be seconds, not 'soon'"),
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
    # Found by review: the last one won, silently.
    with pytest.raises(ValueError, match="option 'table' is given twice"):
        keymutex.Locks("postgresql://127.0.0.1/db?table=a&table=b")
    with pytest.raises(ValueError, match="min_size must be an int, not 'many'"):
        keymutex.Locks("postgres://127.0.0.1/db?min_size=many")
    for port in ("abc", "99999", "0"):
        with pytest.raises(
            ValueError, match=f"port must be a number from 1 to 65535, not '{port}'"
        ):
            keymutex.Locks(f"postgresql://127.0.0.1:{port}/db")
    keymutex.Locks("postgresql://h1:5432,h2:5433/db").close()  # one port per host
    keymutex.Locks("postgresql://h1,h2/db").close()  # the default port


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("sslmode=bogus", "sslmode must be one of disable, allow, prefer, require"),
        ("gssencmode=nope", "gssencmode must be one of disable, prefer, require, not 'nope'"),
        ("channel_binding=x", "channel_binding must be one of"),
        ("target_session_attrs=bogus", "target_session_attrs must be one of any, read-write"),
        ("load_balance_hosts=x", "load_balance_hosts must be one of disable, random"),
        ("keepalives=abc", "keepalives must be a whole number"),
        ("keepalives_idle=x", "keepalives_idle must be a whole number"),
        ("tcp_user_timeout=1.5", "tcp_user_timeout must be a whole number"),
    ],
)
def test_libpq_settings_libpq_would_refuse_are_refused_before_connecting(
    query: str, message: str
) -> None:
    """Found by review: accepted by ``Locks()``, they failed the first call with a
    ``StoreError``, which reads as "the server is down, try again"."""
    with pytest.raises(ValueError, match=message):
        keymutex.Locks(f"postgresql://127.0.0.1:9/db?{query}")


def test_libpq_settings_of_known_values_are_taken_and_a_fragment_is_not() -> None:
    good = (
        "sslmode=verify-full&gssencmode=disable&channel_binding=prefer"
        "&target_session_attrs=read-write&load_balance_hosts=random&keepalives=1"
        "&keepalives_idle=30&tcp_user_timeout=5000"
    )
    keymutex.Locks(f"postgresql://127.0.0.1:9/db?{good}").close()
    with pytest.raises(ValueError, match="a PostgreSQL URL has no fragment"):
        keymutex.Locks("postgresql://127.0.0.1:9/db#frag")


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


@pytest.mark.parametrize("isolation", ["repeatable%20read", "serializable"])
def test_a_stricter_default_isolation_does_not_fail_contended_steps(
    postgresql_url: str, namespace: str, table: str, isolation: str
) -> None:
    """Found by review: with ``default_transaction_isolation`` set to repeatable read or
    serializable (by a role or database, for the application's own sake), clients
    contending for one key failed acquires and releases with "could not serialize
    access due to concurrent update": a statement's snapshot is taken before it waits
    for the key's gate. The store's sessions now use read committed whatever the
    default."""
    url = f"{postgresql_url}?options=-c%20default_transaction_isolation%3D{isolation.replace('%20', '%5C%20')}"
    stop = time.monotonic() + 2.0

    def contend(locks: keymutex.Locks) -> int:
        grants = 0
        while time.monotonic() < stop:
            with locks.lock("k", ttl=5, timeout=5):  # raised: the test fails with it
                grants += 1
        return grants

    with contextlib.ExitStack() as clients:
        contenders = [
            clients.enter_context(keymutex.Locks(url, namespace=namespace, table=table))
            for _ in range(4)
        ]
        with concurrent.futures.ThreadPoolExecutor(len(contenders)) as pool:
            assert sum(pool.map(contend, contenders)) > 4


def test_an_unqualified_table_another_schema_already_has_is_not_made_again(
    admin: psycopg.Connection[Any], postgresql_url: str, namespace: str, table: str
) -> None:
    """Found by review: the default table name is unqualified, so each session's
    search_path chose its schema. A service whose role has a schema of its own (the
    usual advice since PostgreSQL 15) made ``alice.keymutex_leases``; a cron job of
    another role, same URL, made ``public.keymutex_leases``: both held one key at once,
    with the same fence. Now the second is refused, and told to name the schema."""
    schema = f"s_{uuid.uuid4().hex[:12]}"
    admin.execute(f"CREATE SCHEMA {schema}")
    try:
        own = f"{postgresql_url}?options=-c%20search_path%3D{schema}%2Cpublic"
        with keymutex.Locks(own, namespace=namespace, table=table) as service:
            lease = service.acquire("nightly", timeout=0)  # made {schema}.{table}
            with (
                keymutex.Locks(postgresql_url, namespace=namespace, table=table) as cron,
                pytest.raises(keymutex.StoreError, match=rf"in schema {schema}, which"),
            ):
                cron.acquire("nightly", timeout=0)
            named = f"{schema}.{table}"
            with keymutex.Locks(postgresql_url, namespace=namespace, table=named) as cron:
                refused = cron.holder("nightly")
                assert refused is not None
                assert refused.fence == lease.fence
            lease.release()
        assert admin.execute("SELECT to_regclass(%s)", (f"public.{table}",)).fetchone() == (None,)
    finally:
        admin.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def limited_url(postgresql_url: str, admin: psycopg.Connection[Any], table: str) -> Iterator[str]:
    """The URL of a role allowed one connection, on ``table`` (made by the admin first):
    a store with ``max_size=1`` gets its one step connection, never its listener."""
    role = f"limited_{uuid.uuid4().hex[:8]}"
    with keymutex.Locks(f"{postgresql_url}?table={table}") as maker:
        maker.holder("k")  # the table and its companions exist
    admin.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 1")
    admin.execute(f"GRANT ALL ON {table}, {table}_meta, {table}_fence TO {role}")
    yield postgresql_url.replace("://postgres@", f"://{role}@", 1) + f"?table={table}"
    admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
    )
    admin.execute(f"DROP OWNED BY {role}")
    admin.execute(f"DROP ROLE {role}")


def _queue_of(admin: psycopg.Connection[Any], table: str, namespace: str) -> list[str]:
    row = admin.execute(
        f"SELECT waiters FROM {table} WHERE namespace = %s AND key = 'k'", (namespace,)
    ).fetchone()
    return [] if row is None or row[0] is None else list(row[0])


def _gave_up_alone(
    began: float, admin: psycopg.Connection[Any], table: str, namespace: str
) -> None:
    """The refused waiter gave up at its timeout (0.5 s), not at the listener's
    ``connect_timeout`` (10 s), and left the key's queue."""
    assert time.monotonic() - began < 5, "it waited for the listener, not its timeout"
    assert _queue_of(admin, table, namespace) == [], "its place stayed in the queue"


def test_a_waiter_whose_listener_cannot_connect_still_gives_up_at_its_timeout(
    postgresql_url: str,
    admin: psycopg.Connection[Any],
    table: str,
    namespace: str,
    limited_url: str,
) -> None:
    """Found by review: a refused waiter waited for the store's listener to connect for
    ``connect_timeout``, whatever its own timeout, then failed with ``StoreError``, and
    its place stayed in the queue (the key was handed to it after the release). Here
    the listener can never connect (the role may hold one connection)."""
    with (
        keymutex.Locks(f"{postgresql_url}?table={table}", namespace=namespace) as holder_side,
        keymutex.Locks(
            limited_url, namespace=namespace, max_size=1, connect_timeout=10
        ) as waiting,
    ):
        lease = holder_side.acquire("k", ttl=30)
        waiting.holder("k")  # its one connection is open
        began = time.monotonic()
        with pytest.raises(keymutex.Locked):
            waiting.acquire("k", timeout=0.5)
        _gave_up_alone(began, admin, table, namespace)
        lease.release()


@pytest.mark.asyncio
async def test_an_async_waiter_whose_listener_cannot_connect_gives_up_at_its_timeout(
    postgresql_url: str,
    admin: psycopg.Connection[Any],
    table: str,
    namespace: str,
    limited_url: str,
) -> None:
    async with (
        keymutex.AsyncLocks(f"{postgresql_url}?table={table}", namespace=namespace) as holder_side,
        keymutex.AsyncLocks(
            limited_url, namespace=namespace, max_size=1, connect_timeout=10
        ) as waiting,
    ):
        lease = await holder_side.acquire("k", ttl=30)
        await waiting.holder("k")
        began = time.monotonic()
        with pytest.raises(keymutex.Locked):
            await waiting.acquire("k", timeout=0.5)
        _gave_up_alone(began, admin, table, namespace)
        await lease.release()


def test_an_async_store_checks_its_schema_in_one_loop_after_another(
    postgresql_url: str, namespace: str, table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: the lock that serialises the schema check was an asyncio.Lock
    made once; one that made a task wait is bound to that task's loop. Checked by two
    tasks at once in an ``asyncio.run`` where it failed, then in the next, it raised
    RuntimeError ("bound to a different event loop") instead of checking."""
    locks = keymutex.AsyncLocks(f"{postgresql_url}?table={table}", namespace=namespace)
    store = locks._store
    exchange = store._exchange
    starting = True

    async def server_starting(run: Any) -> Any:
        if starting and not store._ready:  # type: ignore[attr-defined]
            await asyncio.sleep(0.05)
            raise psycopg.OperationalError("the database system is starting up")
        return await exchange(run)

    monkeypatch.setattr(store, "_exchange", server_starting)

    async def two_at_once() -> list[Any]:
        return await asyncio.gather(locks.holder("a"), locks.holder("b"), return_exceptions=True)

    first = asyncio.run(two_at_once())
    assert all(isinstance(result, keymutex.StoreError) for result in first), first
    starting = False
    assert asyncio.run(two_at_once()) == [None, None]

    async def close() -> None:
        await locks.aclose()

    asyncio.run(close())


def test_a_lease_asked_twice_in_one_batch_renewal_is_renewed_for_both(
    postgresql_url: str, namespace: str
) -> None:
    """Found by review: the batch renewal joined the renewed rows back by position, so
    the second copy of a lease (the lock server passes a client's list on as it is) was
    reported lost though it had just been renewed; memory and SQLite renew both."""
    with keymutex.Locks(postgresql_url, namespace=namespace) as locks:
        lease = locks.acquire("doc", ttl=30)
        other = locks.acquire("other", ttl=30)
        request = RenewRequest("doc", lease.token, 60.0)
        outcomes = locks._store.renew_many(
            [request, request, RenewRequest("other", "not-its-token", 60.0)]
        )
        assert [o.ok for o in outcomes] == [True, True, False]
        assert outcomes[0].holder == outcomes[1].holder
        assert outcomes[0].holder.fence == lease.fence
        assert outcomes[2].holder is not None
        assert outcomes[2].holder.fence == other.fence
        lease.release()
        other.release()


def test_forgetting_keys_contended_long_ago_is_safe_while_other_threads_add_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: the keys contended lately were filtered by iterating the dict
    that other threads of the store add to: RuntimeError out of a step, in principle.
    Here another thread's key lands while the filter iterates."""
    from keymutex.stores import postgresql

    class Meddled(dict[str, float]):
        def items(self) -> Any:
            iterating = iter(super().items())
            first = next(iterating)
            self[f"another thread's {len(self)}"] = 0.0
            yield first
            yield from iterating

    monkeypatch.setattr(postgresql, "CONTENDED_KEYS", 2)
    steps = postgresql._Steps("keymutex_leases", "n")
    steps._busy = Meddled({"a": 0.0, "b": 0.0})  # both long since no longer contended
    steps._contend("c")
    assert steps._contended("c")
    assert not steps._contended("a")

"""``postgresql://…``, ``postgres://…``: leases in a PostgreSQL table.

- Each step is one SQL statement, so one round trip, in autocommit: acquire is an
  ``INSERT … ON CONFLICT DO UPDATE … RETURNING`` that answers with the lease it granted
  or, when refused, with the current holder; renew is a compare-token ``UPDATE``
  (``renew_many`` one ``UPDATE … FROM unnest(…)`` for the whole batch), release a
  compare-token ``DELETE`` that also sends the wake-up (``pg_notify``) in the same
  statement. Connections come from a pool (psycopg 3, ``psycopg_pool``); the async
  store is native (``AsyncConnectionPool``), not threads.
- One table holds every lease of every namespace (``table`` option, default
  ``keymutex_leases``), with a schema version in ``<table>_meta``. Both are created on
  first use; concurrent first users are serialised, so the table is created once.
- TTLs are measured by the database server's clock (``clock_timestamp()``): clients'
  clocks never decide who holds a key.
- Fences come from one sequence (``<table>_fence``) drawn under a transaction-scoped
  lock on the key's hash, so grants of one key draw them in order: strictly increasing
  per key, and they survive restarts of the server (sequences are WAL-logged; with
  ``synchronous_commit = off``, or after a failover to an asynchronous standby that
  missed the last commits, the last grants — and their fences — can be lost).
- A released lease's row is deleted. An expired one is taken over in place by the
  next acquire, and every ``SWEEP_EVERY`` acquires of a store also delete the expired
  rows among the next ``SWEEP_BATCH`` rows of a rolling scan in key order (in the same
  statement), so the table never outgrows the live leases by much, however many
  distinct keys are ever used.
- Waiting: each store has one dedicated listener connection (``LISTEN`` on a channel
  of its table and namespace), read by one thread (or one task for the async store)
  and shared by all its waiters. A refused waiter registers with it (waiting until the
  listener is ``LISTEN``-ing), then tries once more, now marking the lease
  *contended*; releasing a contended lease notifies the channel with the key, so a
  release after that second try always wakes the waiter, and no notification is sent
  for leases nobody waits for. Waiters also wake at the holder's expiry (the refusal
  carries its time left). A dropped listener reconnects and wakes every waiter, which
  then looks again. Waiters are not served in arrival order (``fair`` is false).

How this differs from ``pg_advisory_lock``: an advisory lock belongs to the session
that took it. It is gone when that connection drops (a network blip, a pooler
recycling the connection, a failover), it cannot be renewed, released or inspected
from another connection or process, it has no expiry of its own, no fence and no
holder information, and it pins one connection per held lock. A keymutex lease is a
row: it lives until it is released or its TTL runs out, whatever happens to the
connections; any process holding the token can renew or release it; ``holders()``
shows who holds what; and every grant has a fence. No advisory lock holds a lease:
the only advisory locks taken are transaction-scoped (``pg_advisory_xact_lock``),
held for the few microseconds of one statement, to order fences and schema creation.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import re
import select
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
import psycopg.conninfo
import psycopg_pool
from psycopg import pq

from keymutex._errors import StoreError
from keymutex._lease import Holder, Outcome
from keymutex._store import Capabilities, RenewRequest, translate_errors
from keymutex.stores._doorbell import Doorbell

__all__ = ["AsyncPostgresStore", "PostgresStore", "driver"]

_LOG = logging.getLogger("keymutex")

CAPABILITIES = Capabilities(
    notifies=True, fair=False, cross_process=True, durable_fences=True, clock="server"
)
SCHEMA_VERSION = 1
DEFAULT_TABLE = "keymutex_leases"
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_MIN_SIZE = 1
DEFAULT_MAX_SIZE = 10
SWEEP_EVERY = 16  # acquires of one store between two sweeps
SWEEP_BATCH = 64  # rows a sweep looks at: more than SWEEP_EVERY, so it keeps up
# The first key of transaction-scoped advisory locks taken by keymutex ("kmtx"): the
# two-key form keeps them apart from applications' one-key (bigint) advisory locks.
LOCK_SPACE = 0x6B6D7478

# -- identifiers -----------------------------------------------------------------------

# A table name, optionally schema-qualified; lower case so that it means the same
# quoted or not. Short enough for the suffixes of the sequence and meta table.
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,47}")


def _check_table(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"table must be a str such as 'keymutex_leases', not {value!r}")
    parts = value.split(".")
    if len(parts) > 2 or not all(_IDENTIFIER.fullmatch(part) for part in parts):
        raise ValueError(
            f"table must be NAME or SCHEMA.NAME, each 1 to 48 characters of a-z, 0-9 and _"
            f" (not starting with a digit), not {value!r}"
        )
    return value


# -- the statements --------------------------------------------------------------------
# Parameters are psycopg's named placeholders. Identifiers ({table}, {sequence}, {meta})
# are validated by _check_table and formatted in, quoted, once per store. Every
# statement runs alone in autocommit: it is its own transaction. Times leave the
# server as epoch seconds (acquired_at) and seconds left by its clock (remaining).

# Contract: create the table, its sequence and its meta table unless they exist, and
# check the recorded schema version (raises if it differs). Creators are serialised by
# a transaction-scoped advisory lock: CREATE ... IF NOT EXISTS alone can still fail on
# a catalog unique index when two sessions create the same table at the same moment.
_SCHEMA = """
DO $keymutex$
BEGIN
    PERFORM pg_advisory_xact_lock({lock_space}, hashtext('schema {table}'));
    IF current_setting('server_encoding') <> 'UTF8' THEN
        RAISE EXCEPTION 'keymutex needs a UTF8 database, not %',
            current_setting('server_encoding');
    END IF;
    IF to_regclass('{meta}') IS NULL THEN
        CREATE TABLE {meta} (name text PRIMARY KEY, value text NOT NULL);
        INSERT INTO {meta} (name, value) VALUES ('schema', '{version}');
    END IF;
    IF to_regclass('{sequence}') IS NULL THEN
        CREATE SEQUENCE {sequence} AS bigint;
    END IF;
    IF to_regclass('{table}') IS NULL THEN
        CREATE TABLE {table} (
            namespace text COLLATE "C" NOT NULL,
            key text COLLATE "C" NOT NULL,
            token text NOT NULL,
            owner text NOT NULL,
            info json,
            fence bigint NOT NULL,
            acquired_at timestamptz NOT NULL,
            expires_at timestamptz NOT NULL,
            contended boolean NOT NULL DEFAULT false,
            PRIMARY KEY (namespace, key)
        ) WITH (fillfactor = 80);
    END IF;
    IF (SELECT value FROM {meta} WHERE name = 'schema') IS DISTINCT FROM '{version}' THEN
        RAISE EXCEPTION 'keymutex: table {table} has schema version %, this version needs {version}',
            (SELECT value FROM {meta} WHERE name = 'schema');
    END IF;
END
$keymutex$
"""

# Whether the conflicting row in an upsert is free to take: expired by the clock read
# after the gate (excluded.acquired_at), or taken by force.
_FREE = "(held.expires_at <= excluded.acquired_at OR %(steal)s)"

# Contract: grant (namespace, key) to token if it is free or steal is set, else leave
# the lease as it is (marking it contended when the caller waits).
# Params: namespace, key, token, owner, info (JSON text or NULL), ttl (s), steal,
# contend (mark the lease contended if refused).
# Returns one row: granted, owner, info, fence, acquired_at (epoch s), remaining (s):
# the lease granted, or the current holder when refused.
# - The gate is a transaction-scoped lock on the key's hash, held until the statement
#   commits: grants of one key draw their fences one after the other, so a fence drawn
#   before a concurrent grant cannot land after it.
# - A refused upsert rewrites the row unchanged instead of skipping it: ON CONFLICT DO
#   UPDATE ... WHERE false locks (and so writes) the row anyway, and RETURNING then
#   gives the current holder exactly. A separate read would use the statement's
#   snapshot, taken before the wait for the gate, and miss a grant made meanwhile.
# - granted: only a grant (or the caller's own live lease) leaves our token in the row.
_ACQUIRE_CTES = """
WITH clock AS MATERIALIZED (
    SELECT clock_timestamp() AS now
    FROM (
        SELECT pg_advisory_xact_lock({lock_space}, hashtext(%(namespace)s::text || '/' || %(key)s::text))
        OFFSET 0
    ) AS gate
),
lease AS (
    INSERT INTO {table} AS held
        (namespace, key, token, owner, info, fence, acquired_at, expires_at, contended)
    SELECT %(namespace)s, %(key)s, %(token)s, %(owner)s, %(info)s::json,
           nextval('{sequence}'), now, now + %(ttl)s * interval '1 second', false
    FROM clock
    ON CONFLICT (namespace, key) DO UPDATE SET
        token = CASE WHEN {free} THEN excluded.token ELSE held.token END,
        owner = CASE WHEN {free} THEN excluded.owner ELSE held.owner END,
        info = CASE WHEN {free} THEN excluded.info ELSE held.info END,
        fence = CASE WHEN {free} THEN excluded.fence ELSE held.fence END,
        acquired_at = CASE WHEN {free} THEN excluded.acquired_at ELSE held.acquired_at END,
        expires_at = CASE WHEN {free} THEN excluded.expires_at ELSE held.expires_at END,
        contended = CASE WHEN {free} THEN false ELSE held.contended OR %(contend)s END
    RETURNING held.token = %(token)s AS granted, held.owner, held.info, held.fence,
              held.acquired_at, held.expires_at
)"""
_ACQUIRE_RESULT = """
SELECT granted, owner, info::text, fence, extract(epoch FROM acquired_at)::float8,
       extract(epoch FROM expires_at - clock_timestamp())::float8{sweep_columns}
FROM lease"""

# Contract (appended to the acquire's CTEs every SWEEP_EVERY acquires of a store):
# delete the expired rows among the SWEEP_BATCH rows after (sweep_namespace, sweep_key)
# in key order, except the acquired key's. Adds three result columns: the last row
# looked at (namespace, key) and how many rows were looked at (fewer than SWEEP_BATCH:
# the next scan starts again from the beginning).
# - The scan is a range of the primary key; the expired rows are then locked by their
#   row address (a TID scan): the cost is the batch's, never the table's.
# - SKIP LOCKED: a row someone else is writing is left for a later sweep, so a sweep
#   never waits, and two sweeping acquires can never deadlock on each other's rows.
_SWEEP_CTES = """,
scanned AS MATERIALIZED (
    SELECT namespace, key, ctid AS address, expires_at <= clock_timestamp() AS expired
    FROM {table}
    WHERE (namespace, key) > (%(sweep_namespace)s, %(sweep_key)s)
    ORDER BY namespace, key
    LIMIT {sweep_batch}
),
doomed AS (
    SELECT ctid AS address FROM {table}
    WHERE ctid = ANY (ARRAY(
        SELECT address FROM scanned
        WHERE expired AND (namespace, key) <> (%(namespace)s, %(key)s)
    ))
      AND expires_at <= clock_timestamp()
    FOR UPDATE SKIP LOCKED
),
swept AS (
    DELETE FROM {table}
    WHERE ctid = ANY (ARRAY(SELECT address FROM doomed)) AND expires_at <= clock_timestamp()
)"""
_SWEEP_COLUMNS = """,
       (SELECT namespace FROM scanned ORDER BY namespace DESC, key DESC LIMIT 1),
       (SELECT key FROM scanned ORDER BY namespace DESC, key DESC LIMIT 1),
       (SELECT count(*) FROM scanned)"""

# Contract: renew each (key, token) of the arrays that holds a live lease, by its ttl.
# Params: namespace, keys, tokens, ttls (s): arrays of one length.
# Returns one row per request, in order: position (1-based), renewed, then owner, info,
# fence, acquired_at (epoch s), remaining (s) of the lease after the renewal, or of the
# key's current holder (all NULL when the key is free) when not renewed.
_RENEW_MANY = """
WITH request AS (
    SELECT * FROM unnest(%(keys)s::text[], %(tokens)s::text[], %(ttls)s::float8[])
        WITH ORDINALITY AS request (key, token, ttl, seq)
),
renewed AS (
    UPDATE {table} AS held
    SET expires_at = clock_timestamp() + request.ttl * interval '1 second'
    FROM request
    WHERE held.namespace = %(namespace)s AND held.key = request.key
      AND held.token = request.token AND held.expires_at > clock_timestamp()
    RETURNING request.seq, held.owner, held.info, held.fence, held.acquired_at,
              held.expires_at
)
SELECT request.seq, renewed.seq IS NOT NULL,
       coalesce(renewed.owner, holder.owner),
       coalesce(renewed.info, holder.info)::text,
       coalesce(renewed.fence, holder.fence),
       extract(epoch FROM coalesce(renewed.acquired_at, holder.acquired_at))::float8,
       extract(epoch FROM coalesce(renewed.expires_at, holder.expires_at)
                          - clock_timestamp())::float8
FROM request
LEFT JOIN renewed ON renewed.seq = request.seq
LEFT JOIN {table} AS holder
    ON renewed.seq IS NULL AND holder.namespace = %(namespace)s
   AND holder.key = request.key AND holder.expires_at > clock_timestamp()
ORDER BY request.seq
"""

# Contract: delete (namespace, key) if token holds it (live or expired) and, if the
# lease was contended, notify channel with the key, in the same transaction.
# Params: namespace, key, token, channel.
# Returns one row when released: true, live (false: it had expired), notified; else
# one row describing the current holder: false, false, false, owner, info, fence,
# acquired_at (epoch s), remaining (s); else (free key, not ours) no row.
_RELEASE = """
WITH released AS (
    DELETE FROM {table}
    WHERE namespace = %(namespace)s AND key = %(key)s AND token = %(token)s
    RETURNING expires_at > clock_timestamp() AS live, contended
)
SELECT true, live,
       (CASE WHEN contended THEN pg_notify(%(channel)s, %(key)s)::text END) IS NOT NULL,
       NULL, NULL, NULL, NULL, NULL
FROM released
UNION ALL
SELECT false, false, false, owner, info::text, fence,
       extract(epoch FROM acquired_at)::float8,
       extract(epoch FROM expires_at - clock_timestamp())::float8
FROM {table}
WHERE namespace = %(namespace)s AND key = %(key)s AND expires_at > clock_timestamp()
  AND NOT EXISTS (SELECT FROM released)
"""

# Contract: the live lease of (namespace, key), if any. Params: namespace, key.
# Returns owner, info, fence, acquired_at (epoch s), remaining (s).
_HOLDER = """
SELECT owner, info::text, fence, extract(epoch FROM acquired_at)::float8,
       extract(epoch FROM expires_at - clock_timestamp())::float8
FROM {table}
WHERE namespace = %(namespace)s AND key = %(key)s AND expires_at > clock_timestamp()
"""

# Contract: every live lease of namespace whose key starts with prefix, by key.
# Params: namespace, prefix, end (a string above every key that starts with prefix,
# see _prefix_end), length (of the prefix in characters).
# Returns key, owner, info, fence, acquired_at (epoch s), remaining (s). The range
# [prefix, end) is a range of the primary key's index (keys sort by code point, as in
# Python); left() states the condition itself.
_HOLDERS = """
SELECT key, owner, info::text, fence, extract(epoch FROM acquired_at)::float8,
       extract(epoch FROM expires_at - clock_timestamp())::float8
FROM {table}
WHERE namespace = %(namespace)s AND key >= %(prefix)s AND key < %(end)s
  AND left(key, %(length)s) = %(prefix)s AND expires_at > clock_timestamp()
ORDER BY key
"""


def _quoted(name: str) -> str:
    """A checked name as a quoted identifier: reserved words such as ``user`` work too."""
    return ".".join(f'"{part}"' for part in name.split("."))


@dataclass(frozen=True, slots=True)
class _Statements:
    """Every statement of one table, identifiers formatted in."""

    schema: str
    acquire: str
    acquire_sweeping: str
    renew_many: str
    release: str
    holder: str
    holders: str

    @classmethod
    def of(cls, table: str) -> _Statements:
        names = {
            "table": _quoted(table),
            "sequence": _quoted(f"{table}_fence"),
            "meta": _quoted(f"{table}_meta"),
            "version": SCHEMA_VERSION,
            "lock_space": LOCK_SPACE,
            "sweep_batch": SWEEP_BATCH,
        }
        ctes = _ACQUIRE_CTES.replace("{free}", _FREE).format(**names)
        return cls(
            schema=_SCHEMA.format(**names),
            acquire=ctes + _ACQUIRE_RESULT.format(sweep_columns=""),
            acquire_sweeping=ctes
            + _SWEEP_CTES.format(**names)
            + _ACQUIRE_RESULT.format(sweep_columns=_SWEEP_COLUMNS),
            renew_many=_RENEW_MANY.format(**names),
            release=_RELEASE.format(**names),
            holder=_HOLDER.format(**names),
            holders=_HOLDERS.format(**names),
        )


# -- arguments and replies (no I/O) ------------------------------------------------------

Row = Sequence[Any]


def _describe(key: str, row: Row, now: float) -> tuple[Holder | None, float | None]:
    """The holder in ``row`` (owner, info, fence, acquired_at, remaining) and its time left."""
    owner, info, fence, acquired_at, remaining = row
    if owner is None:
        return None, None
    left = max(0.0, float(remaining))
    holder = Holder(
        key=key,
        owner=owner,
        info=None if info is None else json.loads(info),
        fence=int(fence),
        acquired_at=float(acquired_at),
        expires_at=now + left,
    )
    return holder, left


_MAX_CHAR = "\U0010ffff"
# Longer than any key (at most 1024 bytes of UTF-8: 256 characters of 4 bytes).
_ABOVE_EVERY_KEY = _MAX_CHAR * 257


def _prefix_end(prefix: str) -> str:
    """The least string above every string that starts with ``prefix`` (code point order)."""
    stem = prefix.rstrip(_MAX_CHAR)
    if not stem:
        return _ABOVE_EVERY_KEY
    last = ord(stem[-1]) + 1
    if 0xD800 <= last <= 0xDFFF:  # surrogates are not characters of a key
        last = 0xE000
    return stem[:-1] + chr(last)


def _channel(table: str, namespace: str) -> str:
    """The LISTEN channel of a table's namespace: an identifier of 41 characters."""
    digest = hashlib.sha256(f"{table}\x00{namespace}".encode()).hexdigest()
    return f"keymutex_{digest[:32]}"


@dataclass(frozen=True, slots=True)
class _Call:
    """One statement: what it is for (in errors), its SQL and parameters, how to read it."""

    what: str
    query: str
    params: Mapping[str, Any]
    read: Callable[[list[tuple[Any, ...]]], Any]


class _Steps:
    """The statements and parameters of every step, for the sync and async stores.

    Also keeps the sweep's place: which acquire sweeps, and where its scan resumes.
    """

    def __init__(self, table: str, namespace: str) -> None:
        self.table = table
        self.namespace = namespace
        self.sql = _Statements.of(table)
        self.channel = _channel(table, namespace)
        self._acquires = itertools.count(1)
        self._sweep_from = ("", "")

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        contend: bool,
    ) -> _Call:
        params = {
            "namespace": self.namespace,
            "key": key,
            "token": token,
            "owner": owner,
            "info": None if info is None else json.dumps(info, separators=(",", ":")),
            "ttl": ttl,
            "steal": steal,
            "contend": contend,
        }
        if next(self._acquires) % SWEEP_EVERY:
            return _Call(f"acquire of {key!r}", self.sql.acquire, params, self._read_acquire)
        params["sweep_namespace"], params["sweep_key"] = self._sweep_from
        return _Call(f"acquire of {key!r}", self.sql.acquire_sweeping, params, self._read_sweep)

    @staticmethod
    def _read_acquire(rows: list[tuple[Any, ...]]) -> tuple[bool, Row]:
        (row,) = rows
        return bool(row[0]), row[1:6]

    def _read_sweep(self, rows: list[tuple[Any, ...]]) -> tuple[bool, Row]:
        (row,) = rows
        last_namespace, last_key, scanned = row[6:9]
        # A short scan reached the end of the table: the next one starts over.
        if scanned < SWEEP_BATCH or last_namespace is None:
            self._sweep_from = ("", "")
        else:
            self._sweep_from = (last_namespace, last_key)
        return bool(row[0]), row[1:6]

    def acquire_outcome(self, key: str, reply: tuple[bool, Row]) -> Outcome:
        granted, row = reply
        holder, remaining = _describe(key, row, time.time())
        return Outcome(granted, holder, remaining)

    def renew_many(self, requests: Sequence[RenewRequest]) -> _Call:
        params = {
            "namespace": self.namespace,
            "keys": [request.key for request in requests],
            "tokens": [request.token for request in requests],
            "ttls": [float(request.ttl) for request in requests],
        }
        keys = [request.key for request in requests]

        def read(rows: list[tuple[Any, ...]]) -> list[Outcome]:
            now = time.time()
            outcomes: list[Outcome] = []
            for (position, renewed, *holder_row), key in zip(rows, keys, strict=True):
                assert position == len(outcomes) + 1
                holder, remaining = _describe(key, holder_row, now)
                outcomes.append(Outcome(bool(renewed), holder, remaining))
            return outcomes

        return _Call(f"renewal of {len(requests)} lease(s)", self.sql.renew_many, params, read)

    def release(self, key: str, token: str) -> _Call:
        params = {"namespace": self.namespace, "key": key, "token": token, "channel": self.channel}

        def read(rows: list[tuple[Any, ...]]) -> Outcome:
            if not rows:
                return Outcome(False)
            released, live, _, *holder_row = rows[0]
            if released:
                # A lease past its expiry was no longer ours to release: report it lost.
                return Outcome(bool(live))
            holder, remaining = _describe(key, holder_row, time.time())
            return Outcome(False, holder, remaining)

        return _Call(f"release of {key!r}", self.sql.release, params, read)

    def holder(self, key: str) -> _Call:
        def read(rows: list[tuple[Any, ...]]) -> Holder | None:
            return _describe(key, rows[0], time.time())[0] if rows else None

        params = {"namespace": self.namespace, "key": key}
        return _Call(f"read of {key!r}", self.sql.holder, params, read)

    def holders(self, prefix: str) -> _Call:
        def read(rows: list[tuple[Any, ...]]) -> list[Holder]:
            now = time.time()
            found = []
            for key, *holder_row in rows:
                holder, _ = _describe(key, holder_row, now)
                if holder is not None:
                    found.append(holder)
            return found

        params = {
            "namespace": self.namespace,
            "prefix": prefix,
            "end": _prefix_end(prefix),
            "length": len(prefix),
        }
        return _Call(f"listing of {prefix!r}", self.sql.holders, params, read)


_DRIVER_ERRORS = (psycopg.Error, OSError)


# -- waiting: the sync store -------------------------------------------------------------


class _PostgresWaiter(Doorbell):
    """A waiter of the sync store: rung by the store's listener thread."""

    __slots__ = ("key", "listener", "registered")

    def __init__(self, listener: _Listener, key: str) -> None:
        super().__init__()
        self.listener = listener
        self.key = key
        self.registered = False

    def close(self) -> None:
        if self.registered:
            self.registered = False
            self.listener.leave(self)


def _backoff(failures: int) -> float:
    return float(min(2.0, 0.05 * 2**failures))


class _Listener:
    """One ``LISTEN`` connection per sync store, read by one daemon thread.

    ``join`` registers a waiter and returns once the connection is listening: a
    notification sent after that reaches the waiter. After the connection drops, the
    thread reconnects and rings every waiter (it may have missed a release).
    """

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], channel: str) -> None:
        self._connect = connect
        self._channel = channel
        self._mutex = threading.Lock()
        self._waiters: dict[str, set[_PostgresWaiter]] = {}
        self._listening = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._pid = os.getpid()
        self._abandoned: list[object] = []

    def join(self, waiter: _PostgresWaiter, timeout: float) -> None:
        with self._mutex:
            if self._closing.is_set():
                raise RuntimeError("this store is closed")
            if self._pid != os.getpid():
                self._after_fork()
            self._waiters.setdefault(waiter.key, set()).add(waiter)
            waiter.registered = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="keymutex-postgresql-listener", daemon=True
                )
                self._thread.start()
        if not self._listening.wait(timeout):
            raise StoreError(f"PostgreSQL: could not LISTEN within {timeout} s")

    def _after_fork(self) -> None:
        # The parent's thread did not come along, and its connection is the parent's:
        # keep a reference (never close it from here) and start afresh.
        self._abandoned.append((self._wake_r, self._wake_w))
        self._wake_r, self._wake_w = os.pipe()
        self._pid = os.getpid()
        self._thread = None
        self._listening.clear()
        self._waiters.clear()

    def leave(self, waiter: _PostgresWaiter) -> None:
        with self._mutex:
            waiters = self._waiters.get(waiter.key)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[waiter.key]

    def _dispatch(self, key: str) -> None:
        with self._mutex:
            waiters = list(self._waiters.get(key, ()))
        for waiter in waiters:
            waiter.ring()

    def _ring_all(self) -> None:
        with self._mutex:
            waiters = [waiter for group in self._waiters.values() for waiter in group]
        for waiter in waiters:
            waiter.ring()

    def _run(self) -> None:
        failures = 0
        while not self._closing.is_set():
            conn: psycopg.Connection[Any] | None = None
            try:
                conn = self._connect()
                # Notifications that arrive while LISTEN's own reply is read go to the
                # handler; later ones are read below.
                conn.add_notify_handler(lambda notify: self._dispatch(notify.payload))
                conn.execute(f"LISTEN {self._channel}")
                self._listening.set()
                if failures:
                    self._ring_all()  # releases during the outage were not heard
                failures = 0
                self._pump(conn)
            except Exception as exc:  # the driver's, or a socket closed under it
                if self._closing.is_set():
                    break
                failures += 1
                _LOG.warning("PostgreSQL listener connection failed (%s); reconnecting", exc)
            finally:
                self._listening.clear()
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
            self._closing.wait(_backoff(failures))

    def _pump(self, conn: psycopg.Connection[Any]) -> None:
        """Read notifications until the connection fails or the store closes."""
        pgconn = conn.pgconn
        poller = select.poll()
        poller.register(pgconn.socket, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._closing.is_set():
            events = poller.poll()
            if any(fd == self._wake_r for fd, _ in events):
                return
            pgconn.consume_input()  # raises OperationalError when the connection is gone
            while (notify := pgconn.notifies()) is not None:
                self._dispatch(notify.extra.decode())
            if pgconn.status != pq.ConnStatus.OK:
                raise psycopg.OperationalError("the listener connection was lost")

    def close(self) -> None:
        with self._mutex:
            self._closing.set()
            thread = self._thread
            same_process = self._pid == os.getpid()
        if same_process:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"!")
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5.0)
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)


# -- waiting: the async store ------------------------------------------------------------


class _AsyncPostgresWaiter:
    __slots__ = ("_event", "key", "listener", "registered")

    def __init__(self, listener: _AsyncListener, key: str) -> None:
        self.listener = listener
        self.key = key
        self.registered = False
        self._event = asyncio.Event()

    def ring(self) -> None:
        self._event.set()

    async def wait(self, timeout: float) -> bool:
        if not self._event.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._event.wait()
        rung = self._event.is_set()
        self._event.clear()
        return rung

    async def aclose(self) -> None:
        if self.registered:
            self.registered = False
            self.listener.leave(self)


class _AsyncListener:
    """One ``LISTEN`` connection per async store, read by one task on the store's loop."""

    def __init__(
        self, connect: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]], channel: str
    ) -> None:
        self._connect = connect
        self._channel = channel
        self._waiters: dict[str, set[_AsyncPostgresWaiter]] = {}
        self._listening = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    async def join(self, waiter: _AsyncPostgresWaiter, timeout: float) -> None:
        if self._closed:
            raise RuntimeError("this store is closed")
        self._waiters.setdefault(waiter.key, set()).add(waiter)
        waiter.registered = True
        if self._task is None or self._task.done():
            self._listening = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="keymutex-postgresql-listener")
        try:
            async with asyncio.timeout(timeout):
                await self._listening.wait()
        except TimeoutError:
            raise StoreError(f"PostgreSQL: could not LISTEN within {timeout} s") from None

    def leave(self, waiter: _AsyncPostgresWaiter) -> None:
        waiters = self._waiters.get(waiter.key)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiters[waiter.key]

    def _dispatch(self, key: str) -> None:
        for waiter in list(self._waiters.get(key, ())):
            waiter.ring()

    async def _run(self) -> None:
        failures = 0
        while not self._closed:
            conn: psycopg.AsyncConnection[Any] | None = None
            try:
                conn = await self._connect()
                await conn.execute(f"LISTEN {self._channel}")
                self._listening.set()
                if failures:  # releases during the outage were not heard
                    for group in list(self._waiters.values()):
                        for waiter in list(group):
                            waiter.ring()
                failures = 0
                # Notifications that came with LISTEN's reply are yielded first.
                async for notify in conn.notifies():
                    self._dispatch(notify.payload)
            except Exception as exc:  # the driver's: reconnect
                failures += 1
                _LOG.warning("PostgreSQL listener connection failed (%s); reconnecting", exc)
            finally:
                self._listening.clear()
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()
            await asyncio.sleep(_backoff(failures))

    async def aclose(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# -- the stores --------------------------------------------------------------------------


def _is_suspect(conn: psycopg.BaseConnection[Any]) -> bool:
    """Whether an idle pooled connection may be dead: closed, or its socket readable.

    An idle connection receives nothing, except the error a server sends when it
    terminates the session (shutdown, ``pg_terminate_backend``) before closing it.
    """
    if conn.closed or conn.pgconn.status != pq.ConnStatus.OK:
        return True
    poller = select.poll()
    poller.register(conn.pgconn.socket, select.POLLIN)
    return bool(poller.poll(0))


def _check(conn: psycopg.Connection[Any]) -> None:
    """The pool's check before lending a connection: a round trip only when suspect."""
    if _is_suspect(conn):
        conn.execute("")  # raises if the connection is dead: the pool then drops it


async def _check_async(conn: psycopg.AsyncConnection[Any]) -> None:
    if _is_suspect(conn):
        await conn.execute("")


@dataclass(frozen=True, slots=True)
class _Target:
    """What a URL and the options name: where to connect, and how."""

    conninfo: str
    connect_kwargs: dict[str, Any]
    table: str
    min_size: int
    max_size: int
    connect_timeout: float


class PostgresStore:
    """The PostgreSQL store for one namespace (sync, on a ``psycopg_pool.ConnectionPool``)."""

    capabilities = CAPABILITIES

    def __init__(self, target: _Target, namespace: str) -> None:
        self._target = target
        self._steps = _Steps(target.table, namespace)
        self._mutex = threading.Lock()
        self._pool: psycopg_pool.ConnectionPool[Any] | None = None
        self._ready = False
        self._closed = False
        self._pid = os.getpid()
        self._abandoned: list[object] = []
        self._listener = _Listener(self._connect, self._steps.channel)

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.Connection.connect(
            self._target.conninfo, autocommit=True, **self._target.connect_kwargs
        )

    def _new_pool(self) -> psycopg_pool.ConnectionPool[Any]:
        target = self._target
        pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
            target.conninfo,
            kwargs={"autocommit": True, **target.connect_kwargs},
            min_size=target.min_size,
            max_size=target.max_size,
            timeout=target.connect_timeout,
            check=_check,
            name="keymutex",
            open=False,
        )
        pool.open(wait=False)
        return pool

    def _ready_pool(self) -> psycopg_pool.ConnectionPool[Any]:
        """The pool, opened (and the schema checked) on first use."""
        pool = self._pool
        if self._ready and pool is not None and self._pid == os.getpid():
            return pool
        with self._mutex:
            if self._closed:
                raise RuntimeError("this store is closed")
            if self._pid != os.getpid():  # forked: the parent's connections are not ours
                self._abandoned.append(self._pool)
                self._pool, self._ready, self._pid = None, False, os.getpid()
            if self._pool is None:
                self._pool = self._new_pool()
            if not self._ready:
                with self._pool.connection() as conn:
                    conn.execute(self._steps.sql.schema)
                self._ready = True
            return self._pool

    def _run(self, call: _Call) -> Any:
        with (
            translate_errors(*_DRIVER_ERRORS, what=f"PostgreSQL {call.what}"),
            self._ready_pool().connection() as conn,
            conn.cursor() as cursor,
        ):
            cursor.execute(call.query, call.params)
            rows = cursor.fetchall()
        return call.read(rows)

    def _acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        contend: bool,
    ) -> Outcome:
        reply = self._run(self._steps.acquire(key, token, ttl, owner, info, steal, contend))
        return self._steps.acquire_outcome(key, reply)

    def try_acquire(
        self,
        key: str,
        *,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: Any,
    ) -> Outcome:
        assert waiter is None or isinstance(waiter, _PostgresWaiter)
        registered = waiter is not None and waiter.registered
        outcome = self._acquire(key, token, ttl, owner, info, steal, registered)
        if outcome.ok or waiter is None or registered:
            return outcome
        # Listen, then look again (marking the lease contended): a release between the
        # refusal and the LISTEN would otherwise go unheard.
        with translate_errors(*_DRIVER_ERRORS, what=f"PostgreSQL LISTEN for {key!r}"):
            self._listener.join(waiter, self._target.connect_timeout)
        return self._acquire(key, token, ttl, owner, info, steal, True)

    def renew(self, key: str, token: str, ttl: float) -> Outcome:
        return self.renew_many([RenewRequest(key, token, ttl)])[0]

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        if not requests:
            return []
        outcomes: list[Outcome] = self._run(self._steps.renew_many(requests))
        return outcomes

    def release(self, key: str, token: str) -> Outcome:
        outcome: Outcome = self._run(self._steps.release(key, token))
        return outcome

    def holder(self, key: str) -> Holder | None:
        holder: Holder | None = self._run(self._steps.holder(key))
        return holder

    def holders(self, prefix: str) -> list[Holder]:
        holders: list[Holder] = self._run(self._steps.holders(prefix))
        return holders

    def waiter(self, key: str) -> _PostgresWaiter:
        return _PostgresWaiter(self._listener, key)

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            pool, self._pool = self._pool, None
            same_process = self._pid == os.getpid()
        self._listener.close()
        if pool is not None and same_process:
            with contextlib.suppress(*_DRIVER_ERRORS):
                pool.close()


class AsyncPostgresStore:
    """The PostgreSQL store for one namespace (asyncio, on an ``AsyncConnectionPool``)."""

    capabilities = CAPABILITIES

    def __init__(self, target: _Target, namespace: str) -> None:
        self._target = target
        self._steps = _Steps(target.table, namespace)
        self._pool: psycopg_pool.AsyncConnectionPool[Any] | None = None
        self._opening: asyncio.Lock | None = None
        self._ready = False
        self._closed = False
        self._listener = _AsyncListener(self._connect, self._steps.channel)

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(
            self._target.conninfo, autocommit=True, **self._target.connect_kwargs
        )

    async def _ready_pool(self) -> psycopg_pool.AsyncConnectionPool[Any]:
        """The pool, opened (and the schema checked) on first use."""
        if self._ready and self._pool is not None:
            return self._pool
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._closed:
                raise RuntimeError("this store is closed")
            if self._pool is None:
                target = self._target
                pool: psycopg_pool.AsyncConnectionPool[Any] = psycopg_pool.AsyncConnectionPool(
                    target.conninfo,
                    kwargs={"autocommit": True, **target.connect_kwargs},
                    min_size=target.min_size,
                    max_size=target.max_size,
                    timeout=target.connect_timeout,
                    check=_check_async,
                    name="keymutex",
                    open=False,
                )
                await pool.open(wait=False)
                self._pool = pool
            if not self._ready:
                async with self._pool.connection() as conn:
                    await conn.execute(self._steps.sql.schema)
                self._ready = True
            return self._pool

    async def _run(self, call: _Call) -> Any:
        with translate_errors(*_DRIVER_ERRORS, what=f"PostgreSQL {call.what}"):
            pool = await self._ready_pool()
            async with pool.connection() as conn, conn.cursor() as cursor:
                await cursor.execute(call.query, call.params)
                rows = await cursor.fetchall()
        return call.read(rows)

    async def _acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        contend: bool,
    ) -> Outcome:
        call = self._steps.acquire(key, token, ttl, owner, info, steal, contend)
        return self._steps.acquire_outcome(key, await self._run(call))

    async def try_acquire(
        self,
        key: str,
        *,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: Any,
    ) -> Outcome:
        assert waiter is None or isinstance(waiter, _AsyncPostgresWaiter)
        registered = waiter is not None and waiter.registered
        outcome = await self._acquire(key, token, ttl, owner, info, steal, registered)
        if outcome.ok or waiter is None or registered:
            return outcome
        with translate_errors(*_DRIVER_ERRORS, what=f"PostgreSQL LISTEN for {key!r}"):
            await self._listener.join(waiter, self._target.connect_timeout)
        return await self._acquire(key, token, ttl, owner, info, steal, True)

    async def renew(self, key: str, token: str, ttl: float) -> Outcome:
        return (await self.renew_many([RenewRequest(key, token, ttl)]))[0]

    async def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        if not requests:
            return []
        outcomes: list[Outcome] = await self._run(self._steps.renew_many(requests))
        return outcomes

    async def release(self, key: str, token: str) -> Outcome:
        outcome: Outcome = await self._run(self._steps.release(key, token))
        return outcome

    async def holder(self, key: str) -> Holder | None:
        holder: Holder | None = await self._run(self._steps.holder(key))
        return holder

    async def holders(self, prefix: str) -> list[Holder]:
        holders: list[Holder] = await self._run(self._steps.holders(prefix))
        return holders

    async def waiter(self, key: str) -> _AsyncPostgresWaiter:
        return _AsyncPostgresWaiter(self._listener, key)

    async def aclose(self) -> None:
        self._closed = True
        await self._listener.aclose()
        pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(*_DRIVER_ERRORS):
                await pool.close()


# -- URLs and options --------------------------------------------------------------------

# Options a user may pass as ``Locks(url, **options)`` or in the URL's query string.
OPTIONS = ("table", "min_size", "max_size", "connect_timeout")


def _number(value: object, name: str, *, integer: bool) -> float:
    """An option's value as a number; strings come from the URL's query string."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, not {value!r}")
    if isinstance(value, str):
        try:
            return int(value) if integer else float(value)
        except ValueError:
            raise ValueError(f"{name} must be a number, not {value!r}") from None
    if integer and not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {value!r}")
    if not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, not {value!r}")
    return value


def _parse(url: str, options: Mapping[str, object]) -> _Target:
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(
            f"unknown PostgreSQL store option(s) {sorted(unknown)}; accepted: {', '.join(OPTIONS)}"
            " (connection settings such as sslmode go in the URL)"
        )
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {name: value for name, value in query if name in OPTIONS}
    twice = set(ours) & set(options)
    if twice:
        raise ValueError(f"{url!r}: {sorted(twice)} given both in the URL and as arguments")
    merged: dict[str, object] = {**ours, **options}
    conninfo = urlunsplit(
        parts._replace(query=urlencode([(n, v) for n, v in query if n not in OPTIONS]))
    )
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.Error as exc:
        raise ValueError(f"{url!r} is not a PostgreSQL URL: {exc}") from None

    table = _check_table(merged.get("table", DEFAULT_TABLE))
    timeout = _number(
        merged.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT), "connect_timeout", integer=False
    )
    if not 0 < timeout < math.inf:
        raise ValueError(f"connect_timeout must be seconds > 0, not {timeout!r}")
    min_size = int(_number(merged.get("min_size", DEFAULT_MIN_SIZE), "min_size", integer=True))
    max_size = int(
        _number(merged.get("max_size", max(DEFAULT_MAX_SIZE, min_size)), "max_size", integer=True)
    )
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, not {min_size}")
    if max_size < max(1, min_size):
        raise ValueError(f"max_size must be >= 1 and >= min_size ({min_size}), not {max_size}")

    connect_kwargs: dict[str, Any] = {}
    if "connect_timeout" not in params:
        # libpq takes whole seconds, at least 2.
        connect_kwargs["connect_timeout"] = max(2, math.ceil(timeout))
    if "application_name" not in params:
        connect_kwargs["application_name"] = "keymutex"
    return _Target(conninfo, connect_kwargs, table, min_size, max_size, timeout)


class PostgresDriver:
    def open(self, url: str, *, namespace: str, options: Mapping[str, object]) -> PostgresStore:
        return PostgresStore(_parse(url, options), namespace)

    def open_async(
        self, url: str, *, namespace: str, options: Mapping[str, object]
    ) -> AsyncPostgresStore:
        return AsyncPostgresStore(_parse(url, options), namespace)


driver = PostgresDriver()

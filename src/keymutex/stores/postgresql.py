"""``postgresql://…``, ``postgres://…``: leases in a PostgreSQL table.

- A step is one SQL statement, so one round trip, in autocommit (each statement is
  its own transaction: no BEGIN or COMMIT to send), on its common path. Acquiring a
  free key (it has no row: released leases' rows are deleted) is a plain ``INSERT …
  ON CONFLICT DO NOTHING``; a key that has a row (held, queued for, handed over,
  expired) takes an ``INSERT … ON CONFLICT DO UPDATE … RETURNING`` that answers with
  the lease it granted or, when refused, with the current holder. So a first try on a
  held key is two statements; a key refused lately (``CONTENDED_FOR``) goes to the
  upsert at once. Renew is a compare-token ``UPDATE`` (``renew_many`` one ``UPDATE …
  FROM unnest(…)`` for a whole batch); release a compare-token ``DELETE`` if nobody
  waits, else (a second statement, or the first on a key contended lately) the
  hand-over below. A refused renewal or release reads the holder in a statement of its
  own.
- The store keeps its own few connections (psycopg 3, at most ``max_size``; idle ones
  beyond ``min_size`` close after ``MAX_IDLE``), prepares each statement once per
  connection, and sends steps through libpq directly: psycopg's cursor and pool
  machinery cost about as much as the round trip itself on loopback. The async store
  is native asyncio, not threads. A step is never sent twice, but for one case: the
  server ended the idle connection it was lent for ``idle_session_timeout`` (PostgreSQL
  14 and later) just as it was sent, before it ran; it is sent again, once, on a new
  connection (``_ended_idle``).
- Every statement waits at most ``timeout`` seconds (5 by default) for the server's reply,
  connecting at most ``connect_timeout``; a step that finds all ``max_size`` connections
  busy waits for one up to ``connect_timeout`` first (so a step on a stalled server
  with a full pool ends within twice ``connect_timeout`` and its ``timeout``). A step
  that runs out of time raises
  ``StoreError``, and its connection is closed, never reused with a statement in
  flight; the server gives the statement up by then too (``statement_timeout``). Its
  effect is unknown: a grant whose reply was lost is a lease like any other, and
  expires by its TTL. TCP keepalives and ``tcp_user_timeout`` find a dead link under
  an idle connection (the listener's) in seconds rather than hours.
- One table holds every lease of every namespace (``table`` option, default
  ``keymutex_leases``), with a schema version in ``<table>_meta``. Both are created on
  first use; concurrent first users are serialised, so the table is created once. A
  table of schema version 1 (no queue) is upgraded in place. Spell ``table`` the same
  way in every client: the notification channel is named after it as written, so a
  client given ``public.keymutex_leases`` shares the rows of one given
  ``keymutex_leases`` but not its wake-ups (its waiters then find a release at their
  one-second recheck). An unqualified name is found by each session's ``search_path``:
  a client whose search_path finds no table of that name while another schema has one
  is refused rather than make a second table (whose locks the first would never see);
  name the schema (``?table=app.keymutex_leases``) where roles' search paths differ.
- Each session reads committed data (``default_transaction_isolation`` is set so,
  whatever the role's or database's default: a stricter one failed contended steps),
  and gives a statement up a little before its client does (``statement_timeout``).
- TTLs are measured by the database server's clock (``clock_timestamp()``): clients'
  clocks never decide who holds a key.
- Fences come from one sequence (``<table>_fence``) drawn under a transaction-scoped
  lock on the key's hash, so grants of one key draw them in order: strictly increasing
  per key, and they survive restarts of the server (sequences are WAL-logged; with
  ``synchronous_commit = off``, or after a failover to an asynchronous standby that
  missed the last commits, the last grants — and their fences — can be lost).
- A released lease's row is deleted (unless the key is handed over). An expired one
  is taken over in place by the next acquire, and every ``SWEEP_EVERY`` acquires of a
  store (counted from a random place, so that short-lived clients sweep too) also
  delete the rows kept for nothing any more (lease ended, no hand-over nor live queue)
  among the next ``SWEEP_BATCH`` rows of a rolling scan in key order (in the same
  statement), so the table never outgrows the live leases by much, however many
  distinct keys are ever used.
- Waiting: a refused waiter joins the key's queue (an array in the lease's row) in the
  same statement. A release hands the key over to the first queued waiter in its
  statement: the key is kept for it for ``HANDOVER_MS`` and its id notified
  (``pg_notify``), so exactly one waiter wakes, tries once, and gets the key: no herd,
  and the releaser cannot barge back in ahead of the queue. Each store has one
  dedicated listener connection (``LISTEN`` on a channel of its table and namespace),
  read by one thread (or one task for the async store) and shared by all its waiters;
  a waiter is registered with it before its first try if it listens already, else
  after the first refusal, without waiting for it: the listener rings it once it
  listens (at once if it does already), and it tries again, so no hand-over is missed
  and no wait outlasts the caller's timeout. A
  waiter that gives up leaves the queue (passing on a key just handed to it), unless
  its last try went unanswered (``_UNANSWERED``); one that vanished costs the others
  at most ``HANDOVER_MS`` plus their one-second recheck, and its place lapses
  ``QUEUE_LIFETIME_MS`` after the last refusal. Waiters also wake at the holder's expiry (the refusal carries its time
  left); a key freed by expiry goes to whoever tries first, so the order is first
  come, first served through releases, not strictly (``fair`` is false). A dropped
  listener reconnects and wakes every waiter, which then looks again.

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
import collections
import contextlib
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import random
import re
import secrets
import select
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote

import psycopg
import psycopg.conninfo
import psycopg.errors
from psycopg import pq

from keymutex._errors import StoreError
from keymutex._lease import Holder, Outcome
from keymutex._store import Capabilities, RenewRequest, stop_task, translate_errors
from keymutex._urls import redacted, scrubbed, split_url
from keymutex.stores._doorbell import Doorbell, LoopDoorbell, wake
from keymutex.stores._settings import count, digits, seconds

__all__ = ["AsyncPostgresStore", "PostgresStore", "driver"]

_LOG = logging.getLogger("keymutex")

CAPABILITIES = Capabilities(
    notifies=True, fair=False, cross_process=True, durable_fences=True, clock="server"
)
SCHEMA_VERSION = 2
DEFAULT_TABLE = "keymutex_leases"
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_TIMEOUT = 5.0  # seconds a step waits for the server's reply
DEFAULT_MIN_SIZE = 1
DEFAULT_MAX_SIZE = 10
MAX_IDLE = 600.0  # seconds an idle connection beyond min_size stays open
# TCP keepalives of every connection, unless the URL sets them: a link that went dead
# under an idle connection is found in about KEEPALIVE_IDLE + timeout seconds.
KEEPALIVE_IDLE = 10
KEEPALIVE_INTERVAL = 5
KEEPALIVE_COUNT = 3
# How long a released key is kept for the waiter it was handed over to: long enough
# for a woken waiter on a busy host to send its try; if the waiter has vanished, the
# key is free again after this.
HANDOVER_MS = 200
# A key's queue outlives the last refusal of a waiter by this much: waiters look again
# at least every second, so only the ids of waiters that vanished lapse with it.
QUEUE_LIFETIME_MS = 60_000
# _UNANSWERED: a waiter whose try failed (the server did not answer, or could not be
# reached) does not leave the queue when it gives up: that would wait for the server
# once more, as long again. A place it may hold is passed over at its turn (a hand-over
# to it lapses after HANDOVER_MS) or lapses with the queue (QUEUE_LIFETIME_MS).

# A key refused or handed over counts as contended for this long (and at most this many
# keys are remembered): its acquires and releases skip the statements for free keys.
CONTENDED_FOR = 2.0
CONTENDED_KEYS = 1024
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
# Parameters are written as named placeholders, %(name)s, and numbered ($1, $2, ...)
# when a statement is compiled; each name has one type (_PARAMETER_TYPES). Identifiers
# ({table}, {sequence}, {meta}) are validated by _check_table and formatted in, quoted,
# once per store, as are the constants. Every statement runs alone in autocommit: it is
# its own transaction. Times leave the server as epoch seconds (acquired_at) and
# seconds left by its clock (remaining).
#
# A row is a lease (token, owner, info, fence, acquired_at, expires_at), live while
# expires_at is ahead, plus the key's queue: waiters (ids in arrival order, lapsing at
# queue_until) and a hand-over: reserved_for (a waiter's id) until reserved_until. A
# row handed over keeps its ended lease, with expires_at set to the release.

# Contract: create the table, its sequence and its meta table unless they exist,
# upgrade a table of schema version 1 (add the queue's columns: instant, their defaults
# are constants), and check the recorded schema version (raises if it differs).
# Creators are serialised by a transaction-scoped advisory lock: CREATE ... IF NOT
# EXISTS alone can still fail on a catalog unique index when two sessions create the
# same table at the same moment. The lock is named by the bare table name, which every
# spelling of it shares (found by review: keymutex_leases and public.keymutex_leases
# took two locks, and one of two first clients failed). Clients of version 1 that are still running go on
# working on the upgraded table (their column "contended" stays, unused), without
# hand-overs; newly started ones refuse it.
_SCHEMA = """
DO $keymutex$
BEGIN
    PERFORM pg_advisory_xact_lock({lock_space}, hashtext('schema {relname}'));
    IF current_setting('server_encoding') <> 'UTF8' THEN
        RAISE EXCEPTION 'keymutex needs a UTF8 database, not %',
            current_setting('server_encoding');
    END IF;
    IF to_regclass('{meta}') IS NULL AND to_regclass('{table}') IS NOT NULL THEN
        RAISE EXCEPTION 'keymutex: table {table} is not a keymutex table (it has no {meta}):'
            ' name one of keymutex''s own with ?table=';
    END IF;
    IF NOT {qualified} AND to_regclass('{table}') IS NULL AND EXISTS (
        SELECT FROM pg_class WHERE relname = '{relname}' AND relkind IN ('r', 'p')
    ) THEN
        RAISE EXCEPTION 'keymutex: a table {relname} exists in schema %, which this'
            ' session''s search_path (%) does not find: a table made here would hold other'
            ' locks than that one. Name the table with its schema in every client:'
            ' ?table=SCHEMA.{relname}',
            (SELECT string_agg(quote_ident(n.nspname), ', ' ORDER BY n.nspname)
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE c.relname = '{relname}' AND c.relkind IN ('r', 'p')),
            current_setting('search_path');
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
            waiters text[] NOT NULL DEFAULT '{{}}',
            queue_until timestamptz,
            reserved_for text,
            reserved_until timestamptz,
            PRIMARY KEY (namespace, key)
        ) WITH (fillfactor = 80);
    END IF;
    IF (SELECT value FROM {meta} WHERE name = 'schema') = '1' THEN
        ALTER TABLE {table}
            ADD COLUMN IF NOT EXISTS waiters text[] NOT NULL DEFAULT '{{}}',
            ADD COLUMN IF NOT EXISTS queue_until timestamptz,
            ADD COLUMN IF NOT EXISTS reserved_for text,
            ADD COLUMN IF NOT EXISTS reserved_until timestamptz;
        UPDATE {meta} SET value = '{version}' WHERE name = 'schema';
    END IF;
    IF (SELECT value FROM {meta} WHERE name = 'schema') IS DISTINCT FROM '{version}' THEN
        RAISE EXCEPTION 'keymutex: table {table} has schema version %, this version needs {version}',
            (SELECT value FROM {meta} WHERE name = 'schema');
    END IF;
END
$keymutex$
"""

# Whether the conflicting row in an upsert is free for this caller to take: stolen, or
# its lease ended by the clock read after the gate (excluded.acquired_at) and the key
# is not handed over to another waiter.
_FREE = """(%(steal)s OR (held.expires_at <= excluded.acquired_at AND (
    held.reserved_until IS NULL OR held.reserved_until <= excluded.acquired_at
    OR held.reserved_for = %(waiter)s)))"""

# The gate: a transaction-scoped lock on the key's hash, held until the statement
# commits, then the clock. Grants of one key draw their fences one after the other, so a
# fence drawn before a concurrent grant cannot land after it.
_GATE = """
WITH clock AS MATERIALIZED (
    SELECT clock_timestamp() AS now
    FROM (
        SELECT pg_advisory_xact_lock({lock_space}, hashtext(%(namespace)s || '/' || %(key)s))
        OFFSET 0
    ) AS gate
)"""

# Contract: grant (namespace, key) to token if it has no row: the common case of a
# free key, since a released lease's row is deleted. Params: namespace, key, token,
# owner, info (JSON text or NULL), ttl (s). Returns one row when granted: fence,
# acquired_at (epoch s), remaining (s); else no row (the key has a row: see _ACQUIRE).
# A plain insert is far cheaper for the server than the upsert below.
_GRANT_FREE = """
INSERT INTO {table} AS held
    (namespace, key, token, owner, info, fence, acquired_at, expires_at)
SELECT %(namespace)s, %(key)s, %(token)s, %(owner)s, %(info)s::json,
       nextval('{sequence}'), now, now + %(ttl)s * interval '1 second'
FROM clock
ON CONFLICT (namespace, key) DO NOTHING
RETURNING held.fence, extract(epoch FROM held.acquired_at)::float8,
          extract(epoch FROM held.expires_at - clock_timestamp())::float8
"""

# Contract: grant (namespace, key) to token if it is free for the caller (see _FREE),
# else leave the lease as it is and, when the caller waits (waiter is not NULL), queue
# the waiter's id (once; a lapsed queue starts afresh) and extend the queue's life.
# Params: namespace, key, token, owner, info (JSON text or NULL), ttl (s), steal,
# waiter (the waiter's id, or NULL).
# Returns one row: granted, owner, info, fence, acquired_at (epoch s), remaining (s,
# of the row's lease: <= 0 when it has ended), reserved (s left of a hand-over, or
# NULL): the lease granted, or the row as it stands when refused.
# - The gate (_GATE) orders the grants of one key, as in _GRANT_FREE.
# - A refused upsert rewrites the row instead of skipping it: ON CONFLICT DO UPDATE
#   ... WHERE false locks (and so writes) the row anyway, and RETURNING then gives the
#   current holder exactly. A separate read would use the statement's snapshot, taken
#   before the wait for the gate, and miss a grant made meanwhile.
# - granted: only a grant (or the caller's own live lease: a retried call) leaves our
#   token in the row with its lease running. A granted waiter leaves the queue.
_ACQUIRE_CTES = """,
lease AS (
    INSERT INTO {table} AS held
        (namespace, key, token, owner, info, fence, acquired_at, expires_at)
    SELECT %(namespace)s, %(key)s, %(token)s, %(owner)s, %(info)s::json,
           nextval('{sequence}'), now, now + %(ttl)s * interval '1 second'
    FROM clock
    ON CONFLICT (namespace, key) DO UPDATE SET
        token = CASE WHEN {free} THEN excluded.token ELSE held.token END,
        owner = CASE WHEN {free} THEN excluded.owner ELSE held.owner END,
        info = CASE WHEN {free} THEN excluded.info ELSE held.info END,
        fence = CASE WHEN {free} THEN excluded.fence ELSE held.fence END,
        acquired_at = CASE WHEN {free} THEN excluded.acquired_at ELSE held.acquired_at END,
        expires_at = CASE WHEN {free} THEN excluded.expires_at ELSE held.expires_at END,
        waiters = CASE
            WHEN {free} OR held.token = excluded.token
                THEN array_remove(held.waiters, %(waiter)s)
            WHEN %(waiter)s IS NULL THEN held.waiters
            WHEN held.queue_until IS NULL OR held.queue_until <= excluded.acquired_at
                THEN ARRAY[%(waiter)s]
            WHEN %(waiter)s = ANY (held.waiters) THEN held.waiters
            ELSE held.waiters || %(waiter)s
        END,
        queue_until = CASE
            WHEN {free} OR held.token = excluded.token OR %(waiter)s IS NULL
                THEN held.queue_until
            ELSE excluded.acquired_at + {queue_lifetime_ms} * interval '1 millisecond'
        END,
        reserved_for = CASE WHEN {free} THEN NULL ELSE held.reserved_for END,
        reserved_until = CASE WHEN {free} THEN NULL ELSE held.reserved_until END
    RETURNING held.token = %(token)s AS mine, held.owner, held.info, held.fence,
              held.acquired_at, held.expires_at, held.reserved_until
)"""
_ACQUIRE_RESULT = """
SELECT mine AND expires_at > clock.now, owner, info::text, fence,
       extract(epoch FROM acquired_at)::float8,
       extract(epoch FROM expires_at - clock_timestamp())::float8,
       extract(epoch FROM reserved_until - clock_timestamp())::float8{sweep_columns}
FROM lease, clock"""

# Until when a row must be kept: its lease, its hand-over and its queue (if any).
_KEPT_UNTIL = (
    "greatest(expires_at, reserved_until, CASE WHEN cardinality(waiters) > 0 THEN queue_until END)"
)

# Contract (appended to the acquire's CTEs every SWEEP_EVERY acquires of a store):
# delete the rows kept for nothing any more (_KEPT_UNTIL passed) among the SWEEP_BATCH
# rows after (sweep_namespace, sweep_key) in key order, except the acquired key's. Adds
# three result columns: the last row looked at (namespace, key) and how many rows were
# looked at (fewer than SWEEP_BATCH: the next scan starts again from the beginning).
# - The scan is a range of the primary key; the doomed rows are then locked by their
#   row address (a TID scan): the cost is the batch's, never the table's.
# - SKIP LOCKED: a row someone else is writing is left for a later sweep, so a sweep
#   never waits, and two sweeping acquires can never deadlock on each other's rows.
_SWEEP_CTES = """,
scanned AS MATERIALIZED (
    SELECT namespace, key, ctid AS address, {kept_until} <= clock_timestamp() AS expired
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
      AND {kept_until} <= clock_timestamp()
    FOR UPDATE SKIP LOCKED
),
swept AS (
    DELETE FROM {table}
    WHERE ctid = ANY (ARRAY(SELECT address FROM doomed)) AND {kept_until} <= clock_timestamp()
)"""
_SWEEP_COLUMNS = """,
       (SELECT namespace FROM scanned ORDER BY namespace DESC, key DESC LIMIT 1),
       (SELECT key FROM scanned ORDER BY namespace DESC, key DESC LIMIT 1),
       (SELECT count(*) FROM scanned)"""

# Contract: renew (namespace, key) by ttl if token holds a live lease of it.
# Params: namespace, key, token, ttl (s). Returns one row when renewed: owner, info,
# fence, acquired_at (epoch s), remaining (s) of the lease; else no row.
_RENEW = """
UPDATE {table} SET expires_at = clock_timestamp() + %(ttl)s * interval '1 second'
WHERE namespace = %(namespace)s AND key = %(key)s AND token = %(token)s
  AND expires_at > clock_timestamp()
RETURNING owner, info::text, fence, extract(epoch FROM acquired_at)::float8,
          extract(epoch FROM expires_at - clock_timestamp())::float8
"""

# Contract: renew each (key, token) of the arrays that holds a live lease, by its ttl.
# Params: namespace, keys, tokens, ttls (s): arrays of one length.
# Returns one row per request, in order: position (1-based), renewed, then owner, info,
# fence, acquired_at (epoch s), remaining (s) of the lease after the renewal, or of the
# key's current holder (all NULL when the key is free) when not renewed. A (key, token)
# asked twice is renewed once, by one of its ttls, and both requests say renewed: the
# renewed rows are joined back by key and token (found by review: joined by position,
# the second copy of a lease just renewed was reported lost).
_RENEW_MANY = """
WITH request AS (
    SELECT * FROM unnest(%(keys)s, %(tokens)s, %(ttls)s)
        WITH ORDINALITY AS request (key, token, ttl, seq)
),
renewed AS (
    UPDATE {table} AS held
    SET expires_at = clock_timestamp() + request.ttl * interval '1 second'
    FROM request
    WHERE held.namespace = %(namespace)s AND held.key = request.key
      AND held.token = request.token AND held.expires_at > clock_timestamp()
    RETURNING held.key, held.token, held.owner, held.info, held.fence, held.acquired_at,
              held.expires_at
)
SELECT request.seq, renewed.key IS NOT NULL,
       coalesce(renewed.owner, holder.owner),
       coalesce(renewed.info, holder.info)::text,
       coalesce(renewed.fence, holder.fence),
       extract(epoch FROM coalesce(renewed.acquired_at, holder.acquired_at))::float8,
       extract(epoch FROM coalesce(renewed.expires_at, holder.expires_at)
                          - clock_timestamp())::float8
FROM request
LEFT JOIN renewed ON renewed.key = request.key AND renewed.token = request.token
LEFT JOIN {table} AS holder
    ON renewed.key IS NULL AND holder.namespace = %(namespace)s
   AND holder.key = request.key AND holder.expires_at > clock_timestamp()
ORDER BY request.seq
"""

# A row's queue is live: someone waits for the key.
_QUEUED = "(cardinality(held.waiters) > 0 AND coalesce(held.queue_until > {now}, false))"

# Contract: delete (namespace, key) if token holds it (live or expired) and nobody waits
# for it (no live queue): the release of an uncontended lease. Params: namespace, key,
# token. Returns one row when deleted: live (false: it had expired); else no row (not
# token's, or queued: see _RELEASE_QUEUED). A plain delete: the cheapest release.
_RELEASE = """
DELETE FROM {table} AS held
WHERE namespace = %(namespace)s AND key = %(key)s AND token = %(token)s
  AND reserved_for IS NULL AND NOT {queued_now}
RETURNING expires_at > clock_timestamp()
"""

# Contract: release token's lease of (namespace, key) (live or expired): delete its row
# as _RELEASE does if nobody waits; else end the lease in place and hand the key over
# to the first queued waiter: the key is kept for that waiter for HANDOVER_MS, and its
# id notified on channel, in the same transaction. A row handed over is no one's lease
# (reserved_for is set): it cannot be released twice. Params: namespace, key, token,
# channel. Returns one row when token held the key: live (false: it had expired),
# handed over; else no row.
# - The hand-over is an UPDATE, not a DELETE and INSERT: a waiter leaving at the same
#   moment waits for this row and then sees the hand-over (an UPDATE follows the row to
#   its new version; a deleted row would be skipped).
# - The UPDATE runs only if the DELETE deleted nothing (its NOT EXISTS is evaluated
#   first, once), and its condition leaves out the queue: a waiter queued after this
#   statement's snapshot is seen once the row is locked (the condition is checked
#   again on the newest version, the SET computed from it). If the queue lapsed
#   meanwhile, the lease ends in place; the row stays until the next acquire of its
#   key or a sweep.
_RELEASE_QUEUED = """
WITH released AS (
    DELETE FROM {table} AS held
    WHERE namespace = %(namespace)s AND key = %(key)s AND token = %(token)s
      AND reserved_for IS NULL AND NOT {queued_now}
    RETURNING expires_at > clock_timestamp() AS live
),
handed AS (
    UPDATE {table} AS held SET
        expires_at = least(held.expires_at, clock.now),
        waiters = CASE WHEN {queued} THEN held.waiters[2:] ELSE held.waiters END,
        reserved_for = CASE WHEN {queued} THEN held.waiters[1] END,
        reserved_until = CASE
            WHEN {queued} THEN clock.now + {handover_ms} * interval '1 millisecond'
        END
    FROM (SELECT clock_timestamp() AS now) AS clock
    WHERE held.namespace = %(namespace)s AND held.key = %(key)s AND held.token = %(token)s
      AND held.reserved_for IS NULL AND NOT EXISTS (SELECT FROM released)
    RETURNING held.expires_at = clock.now AS live,
              (CASE WHEN held.reserved_for IS NOT NULL
                    THEN pg_notify(%(channel)s, held.reserved_for)::text END) IS NOT NULL
              AS handed
)
SELECT live, false FROM released
UNION ALL
SELECT live, handed FROM handed
"""

# Contract: waiter (an id) gives up waiting for (namespace, key): it leaves the queue,
# and if the key is handed over to it, the key goes to the next queued waiter, whose
# id is notified on channel (as in a release), or is free if nobody is left.
# Params: namespace, key, waiter, channel. Returns one row if the waiter was found:
# whether the key was passed on to a waiter.
# - The waiter was handed the key if the row is reserved for it and nobody was granted
#   the key since (every grant clears reserved_for): the hand-over passes on even when
#   its time lapsed (a slow waiter on a busy host), so the next waiter is rung, not left
#   to its recheck.
# - The row is locked first (current), and every decision is made on the version
#   locked: the newest, which nobody changes until this statement commits. The
#   notification is sent from RETURNING, computed once, for the row written. Found by
#   review: it was sent from SET, which an UPDATE that finds its row changed since its
#   snapshot computes again on the newest version (read committed), and the first
#   computation's pg_notify stays sent: with the queue changed under it (the next
#   waiter leaving at the same moment), two waiters were notified, one for nothing.
# - A waiter leaving a key not handed to it leaves reserved_until as it was. Found by
#   review: "reserved_for = waiter" is NULL when nobody is handed the key, and the
#   NULL fell through to the hand-over's branch: a phantom hand-over to nobody for
#   HANDOVER_MS, which kept the key from everyone if its lease ended meanwhile.
_LEAVE = """
WITH current AS MATERIALIZED (
    SELECT coalesce(held.reserved_for = %(waiter)s, false) AS handed_to_me,
           array_remove(held.waiters, %(waiter)s) AS others,
           held.reserved_for, held.reserved_until
    FROM {table} AS held
    WHERE namespace = %(namespace)s AND key = %(key)s
      AND (%(waiter)s = ANY (held.waiters) OR held.reserved_for = %(waiter)s)
    FOR UPDATE
)
UPDATE {table} AS held SET
    waiters = CASE WHEN current.handed_to_me THEN current.others[2:] ELSE current.others END,
    reserved_for = CASE
        WHEN current.handed_to_me THEN current.others[1] ELSE current.reserved_for
    END,
    reserved_until = CASE
        WHEN NOT current.handed_to_me THEN current.reserved_until
        WHEN cardinality(current.others) > 0
            THEN clock.now + {handover_ms} * interval '1 millisecond'
    END
FROM current, (SELECT clock_timestamp() AS now) AS clock
WHERE held.namespace = %(namespace)s AND held.key = %(key)s
RETURNING (CASE WHEN current.handed_to_me AND held.reserved_for IS NOT NULL
                THEN pg_notify(%(channel)s, held.reserved_for)::text END) IS NOT NULL
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

# Type OIDs of the parameters, by name: each is sent as text in that type's format.
_TEXT, _BOOL, _INT4, _FLOAT8, _TEXT_ARRAY, _FLOAT8_ARRAY = 25, 16, 23, 701, 1009, 1022
_PARAMETER_TYPES = {
    "namespace": _TEXT,
    "key": _TEXT,
    "token": _TEXT,
    "owner": _TEXT,
    "info": _TEXT,
    "ttl": _FLOAT8,
    "steal": _BOOL,
    "waiter": _TEXT,
    "sweep_namespace": _TEXT,
    "sweep_key": _TEXT,
    "keys": _TEXT_ARRAY,
    "tokens": _TEXT_ARRAY,
    "ttls": _FLOAT8_ARRAY,
    "channel": _TEXT,
    "prefix": _TEXT,
    "end": _TEXT,
    "length": _INT4,
}
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


@dataclass(frozen=True, slots=True)
class _Statement:
    """A statement ready to prepare: its name on a connection, SQL, parameters in order."""

    name: bytes
    sql: bytes
    parameters: tuple[str, ...]
    types: tuple[int, ...]

    @classmethod
    def compile(cls, name: str, text: str) -> _Statement:
        order: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match[1] not in order:
                order.append(match[1])
            return f"${order.index(match[1]) + 1}"

        sql = _PLACEHOLDER.sub(number, text).replace("%%", "%")
        types = tuple(_PARAMETER_TYPES[parameter] for parameter in order)
        # The name says what the statement is: found by review, behind a pooler that
        # hands a server session from client to client (PgBouncer's session mode with
        # no reset query), one client's statement of the same name was there already:
        # another table's (leases granted in the wrong table) or another version's,
        # or the same (and every step failed with "already exists").
        digest = hashlib.sha256(f"{sql}\0{types}".encode()).hexdigest()[:12]
        return cls(f"keymutex_{name}_{digest}".encode(), sql.encode(), tuple(order), types)


def _quoted(name: str) -> str:
    """A checked name as a quoted identifier: reserved words such as ``user`` work too."""
    return ".".join(f'"{part}"' for part in name.split("."))


@dataclass(frozen=True, slots=True)
class _Statements:
    """Every statement of one table, identifiers formatted in."""

    schema: bytes
    grant_free: _Statement
    acquire: _Statement
    acquire_sweeping: _Statement
    renew: _Statement
    renew_many: _Statement
    release: _Statement
    release_queued: _Statement
    leave: _Statement
    holder: _Statement
    holders: _Statement

    @classmethod
    def of(cls, table: str) -> _Statements:
        names = {
            "table": _quoted(table),
            # An unqualified table is found by search_path: checked (see _SCHEMA).
            "qualified": "true" if "." in table else "false",
            "relname": table.rpartition(".")[2],  # a checked identifier (_check_table)
            "sequence": _quoted(f"{table}_fence"),
            "meta": _quoted(f"{table}_meta"),
            "version": SCHEMA_VERSION,
            "lock_space": LOCK_SPACE,
            "sweep_batch": SWEEP_BATCH,
            "handover_ms": HANDOVER_MS,
            "queue_lifetime_ms": QUEUE_LIFETIME_MS,
            "kept_until": _KEPT_UNTIL,
            "queued": _QUEUED.format(now="clock.now"),
            "queued_now": _QUEUED.format(now="clock_timestamp()"),
        }
        gate = _GATE.format(**names)
        ctes = gate + _ACQUIRE_CTES.replace("{free}", _FREE).format(**names)

        def compile_(name: str, text: str) -> _Statement:
            return _Statement.compile(name, text.format(**names))

        return cls(
            schema=_SCHEMA.format(**names).encode(),
            grant_free=_Statement.compile("grant_free", gate + _GRANT_FREE.format(**names)),
            acquire=_Statement.compile("acquire", ctes + _ACQUIRE_RESULT.format(sweep_columns="")),
            acquire_sweeping=_Statement.compile(
                "acquire_sweeping",
                ctes
                + _SWEEP_CTES.format(**names)
                + _ACQUIRE_RESULT.format(sweep_columns=_SWEEP_COLUMNS),
            ),
            renew=compile_("renew", _RENEW),
            renew_many=compile_("renew_many", _RENEW_MANY),
            release=compile_("release", _RELEASE),
            release_queued=compile_("release_queued", _RELEASE_QUEUED),
            leave=compile_("leave", _LEAVE),
            holder=compile_("holder", _HOLDER),
            holders=compile_("holders", _HOLDERS),
        )


# -- arguments and replies (no I/O) ------------------------------------------------------

# A row of a reply: every value in PostgreSQL's text format (NULL is None).
Row = Sequence[bytes | None]


def _encode(value: object) -> bytes | None:
    """A parameter in PostgreSQL's text format."""
    if type(value) is str:
        if "\x00" in value:  # libpq sends C strings: it would cut the value short
            raise ValueError(f"PostgreSQL text cannot hold NUL characters: {value!r}")
        return value.encode()
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, int | float):
        return repr(value).encode()
    raise TypeError(f"no PostgreSQL text format for {value!r}")


def _text_array(values: Sequence[str]) -> str:
    """A ``text[]`` literal: every element quoted, backslashes and quotes escaped."""
    quoted = (value.replace("\\", "\\\\").replace('"', '\\"') for value in values)
    return "{" + ",".join(f'"{value}"' for value in quoted) + "}"


def _float_array(values: Sequence[float]) -> str:
    return "{" + ",".join(repr(float(value)) for value in values) + "}"


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def _describe(key: str, row: Row, now: float) -> tuple[Holder | None, float | None]:
    """The holder in ``row`` (owner, info, fence, acquired_at, remaining) and its time left."""
    owner, info, fence, acquired_at, remaining = row
    if owner is None or fence is None or acquired_at is None or remaining is None:
        return None, None
    left = max(0.0, float(remaining))
    holder = Holder(
        key=key,
        owner=owner.decode(),
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


def _waiter_id() -> str:
    """A waiter's id: what its queue entry holds and a hand-over notifies.

    Not the acquire's token: anyone who can connect may LISTEN, so what is notified
    must not be a secret.
    """
    return secrets.token_urlsafe(12)


Rows = list[list[bytes | None]]


@dataclass(frozen=True, slots=True)
class _Call:
    """One statement: what it is for (in errors), the statement, and its parameters (text
    format, in the statement's order)."""

    what: str
    statement: _Statement
    params: list[bytes | None]


def _call(what: str, statement: _Statement, params: Mapping[str, object]) -> _Call:
    return _Call(what, statement, [_encode(params[name]) for name in statement.parameters])


# A step: a generator that yields the statements to run, one after the other, is sent
# each one's rows, and returns the step's result. The sync and async stores drive the
# same flows (their _run), so the decisions are written once.
Flow = Generator[_Call, Rows, Any]


class _Steps:
    """The flows of every step, for the sync and async stores.

    Also keeps the sweep's place: which acquire sweeps, and where its scan resumes.
    """

    def __init__(self, table: str, namespace: str) -> None:
        self.table = table
        self.namespace = namespace
        self.sql = _Statements.of(table)
        self.channel = _channel(table, namespace)
        # From a random place: a store that makes fewer than SWEEP_EVERY acquires (a
        # CLI run, a cron job, a Locks per request) still sweeps now and then, with the
        # same odds per acquire as a long-lived one. Counting from 1, none ever did.
        self._acquires = itertools.count(random.randrange(1, SWEEP_EVERY + 1))
        self._sweep_from = ("", "")
        # Keys contended lately (key -> until when, monotonic), to skip statements that
        # would find the key held or queued: a hint, read and written without a lock
        # (a stale answer costs a statement, never a wrong step).
        self._busy: dict[str, float] = {}

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: str | None,
        *,
        queued: bool,
    ) -> Flow:
        """Try to grant ``key``: on a key without a row, one plain insert; else the
        upsert, which queues ``waiter`` when refused. A waiter queued already, or a key
        contended lately, goes to the upsert at once (it would find the key's row).
        Every ``SWEEP_EVERY``-th acquire sweeps."""
        info_text = None if info is None else json.dumps(info, separators=(",", ":"))
        params: dict[str, object] = {
            "namespace": self.namespace,
            "key": key,
            "token": token,
            "owner": owner,
            "info": info_text,
            "ttl": float(ttl),
            "steal": steal,
            "waiter": waiter,
        }
        what = f"acquire of {key!r}"
        sweeping = next(self._acquires) % SWEEP_EVERY == 0
        if not queued and not sweeping and not self._contended(key):
            rows = yield _call(what, self.sql.grant_free, params)
            if rows:
                fence, acquired_at, remaining = rows[0]
                row = [owner.encode(), None if info_text is None else info_text.encode()]
                return _read_acquire(key, [[b"t", *row, fence, acquired_at, remaining, None]])
        if not sweeping:
            rows = yield _call(what, self.sql.acquire, params)
        else:
            params["sweep_namespace"], params["sweep_key"] = self._sweep_from
            rows = yield _call(what, self.sql.acquire_sweeping, params)
            last_namespace, last_key, scanned = rows[0][7:10]
            # A short scan reached the end of the table: the next one starts over.
            if scanned is None or int(scanned) < SWEEP_BATCH or last_namespace is None:
                self._sweep_from = ("", "")
            else:
                self._sweep_from = (last_namespace.decode(), _text(last_key) or "")
        outcome = _read_acquire(key, rows)
        if not outcome.ok:
            self._contend(key)
        return outcome

    def _contend(self, key: str) -> None:
        """Remember that ``key`` is contended: a refusal, or a hand-over, came just now."""
        now = time.monotonic()
        if len(self._busy) >= CONTENDED_KEYS:
            # From a copy, made at once: other threads add to the dict meanwhile, and
            # iterating it then would raise RuntimeError (found by review).
            busy = dict(self._busy)
            self._busy = {k: until for k, until in busy.items() if until > now}
            if len(self._busy) >= CONTENDED_KEYS:
                self._busy = {}
        self._busy[key] = now + CONTENDED_FOR

    def _contended(self, key: str) -> bool:
        until = self._busy.get(key)
        return until is not None and until > time.monotonic()

    def renew_many(self, requests: Sequence[RenewRequest]) -> Flow:
        if len(requests) == 1:  # a simpler statement for the server
            (request,) = requests
            params = {
                "namespace": self.namespace,
                "key": request.key,
                "token": request.token,
                "ttl": float(request.ttl),
            }
            rows = yield _call(f"renewal of {request.key!r}", self.sql.renew, params)
            if rows:
                holder, remaining = _describe(request.key, rows[0], time.time())
                return [Outcome(True, holder, remaining)]
            return [(yield from self._refused(request.key))]
        params = {
            "namespace": self.namespace,
            "keys": _text_array([request.key for request in requests]),
            "tokens": _text_array([request.token for request in requests]),
            "ttls": _float_array([request.ttl for request in requests]),
        }
        rows = yield _call(f"renewal of {len(requests)} leases", self.sql.renew_many, params)
        now = time.time()
        outcomes: list[Outcome] = []
        for (position, renewed, *holder_row), request in zip(rows, requests, strict=True):
            assert position is not None
            assert int(position) == len(outcomes) + 1
            holder, remaining = _describe(request.key, holder_row, now)
            outcomes.append(Outcome(renewed == b"t", holder, remaining))
        return outcomes

    def release(self, key: str, token: str) -> Flow:
        """Delete the lease's row; if waiters are queued, hand the key over instead; if
        the token does not hold the key, say who does."""
        params = {"namespace": self.namespace, "key": key, "token": token, "channel": self.channel}
        what = f"release of {key!r}"
        if not self._contended(key):
            rows = yield _call(what, self.sql.release, params)
            if rows:
                # A lease past its expiry was no longer ours to release: report it lost.
                return Outcome(rows[0][0] == b"t")
        rows = yield _call(what, self.sql.release_queued, params)
        if rows:
            live, handed = rows[0]
            if handed == b"t":
                self._contend(key)
            return Outcome(live == b"t")
        return (yield from self._refused(key))

    def _refused(self, key: str) -> Flow:
        """A step refused, and who holds the key now: a read of its own, on the refused
        path only, so that the steps themselves stay simple statements."""
        params = {"namespace": self.namespace, "key": key}
        rows = yield _call(f"read of {key!r}", self.sql.holder, params)
        holder, remaining = _describe(key, rows[0], time.time()) if rows else (None, None)
        return Outcome(False, holder, remaining)

    def leave(self, key: str, waiter: str) -> Flow:
        params = {
            "namespace": self.namespace,
            "key": key,
            "waiter": waiter,
            "channel": self.channel,
        }
        return bool((yield _call(f"leaving the queue of {key!r}", self.sql.leave, params)))

    def holder(self, key: str) -> Flow:
        outcome: Outcome = yield from self._refused(key)
        return outcome.holder

    def holders(self, prefix: str) -> Flow:
        params = {
            "namespace": self.namespace,
            "prefix": prefix,
            "end": _prefix_end(prefix),
            "length": len(prefix),
        }
        rows = yield _call(f"listing of {prefix!r}", self.sql.holders, params)
        now = time.time()
        found = []
        for key, *holder_row in rows:
            assert key is not None
            holder, _ = _describe(key.decode(), holder_row, now)
            if holder is not None:
                found.append(holder)
        return found


def _read_acquire(key: str, rows: Rows) -> Outcome:
    """An acquire's reply: the lease granted, or the holder and how long to wait."""
    (row,) = rows
    granted = row[0] == b"t"
    remaining = row[5]
    if granted or (remaining is not None and float(remaining) > 0):
        holder, left = _describe(key, row[1:6], time.time())
        return Outcome(granted, holder, left)
    # Refused, and the row's lease has ended: the key is handed over to another waiter
    # (look again when that lapses), or it ended between two clock reads (look again).
    reserved = row[6]
    return Outcome(False, None, 0.0 if reserved is None else max(0.0, float(reserved)))


_DRIVER_ERRORS = (psycopg.Error, OSError)  # OSError includes TimeoutError


# -- fork ------------------------------------------------------------------------------

# Objects with locks, threads or connections that a forked child must not inherit as
# they are: another thread of the parent may hold a lock at the moment of the fork.
_FORK_AWARE: weakref.WeakSet[
    _Sessions | _Listener | PostgresStore | _AsyncSessions | _AsyncListener | AsyncPostgresStore
] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for thing in list(_FORK_AWARE):
        thing._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- connections and the wire (sync) -----------------------------------------------------


def _no_reply(timeout: float) -> TimeoutError:
    return TimeoutError(
        f"no reply from the server within {timeout:g} s (timeout); the connection was"
        " closed, and whatever the statement did stands (a grant expires by its TTL)"
    )


def _server_error(results: Sequence[pq.abc.PGresult]) -> psycopg.Error | None:
    """The server's error among a statement's results, as psycopg's exception."""
    for result in results:
        if result.status == pq.ExecStatus.FATAL_ERROR:
            return psycopg.errors.error_from_result(result, encoding="utf-8")
    return None


def _checked(results: Sequence[pq.abc.PGresult]) -> pq.abc.PGresult:
    """The last result of a statement, or the server's error as psycopg's exception."""
    error = _server_error(results)
    if error is not None:
        raise error
    if not results:
        raise psycopg.OperationalError("the server sent no result")
    return results[-1]


def _rows(result: pq.abc.PGresult) -> list[list[bytes | None]]:
    columns = range(result.nfields)
    return [[result.get_value(row, column) for column in columns] for row in range(result.ntuples)]


def _prepared(results: list[pq.abc.PGresult]) -> None:
    """Check a prepare's reply: one that says a statement of that name exists already
    is the same statement (its name hashes its text), prepared in this server session
    by an earlier client of a pooler (``_Statement.compile``)."""
    with contextlib.suppress(psycopg.errors.DuplicatePreparedStatement):
        _checked(results)


def _consume(pgconn: pq.abc.PGconn, results: Sequence[pq.abc.PGresult]) -> None:
    """Read what the server sent, for a statement whose ``results`` so far are given.

    A server that ends a session sends its error, then closes the connection: libpq
    gives the error as a result, then the next read fails without its SQLSTATE ("server
    closed the connection unexpectedly"). The server's error, read already, is raised
    instead: it says why (found by review: a session ended for
    ``idle_session_timeout``, 57P05, was a bare ``OperationalError``, and nothing could
    tell it from a connection lost while its statement ran).
    """
    try:
        pgconn.consume_input()
    except psycopg.OperationalError as exc:
        error = _server_error(results)
        if error is None:
            raise
        raise error from exc


def _ended_idle(idle_since: float, exc: BaseException) -> bool:
    """Whether a step may be sent again, on a new connection, after ``exc``: the server
    ended the connection, reused from the pool (idle since ``idle_since``; 0.0 if new),
    for ``idle_session_timeout`` (57P05) as the step sent its statement.

    Found by review: the pool checks an idle connection before it lends it
    (``suspect``), and a server ending the session after that check and before the
    statement arrives failed the step. The server ends only a session that waits for
    a command, and checks for the timeout once more after reading one, before running
    it (and never while it runs one): the statement did not run. Not after any other
    error: a connection lost otherwise (a crash, ``pg_terminate_backend``, the network)
    may have run the statement, and the step's effect is unknown.
    """
    return idle_since > 0 and isinstance(exc, psycopg.errors.IdleSessionTimeout)


def _reusable(pgconn: pq.abc.PGconn, exc: BaseException) -> bool:
    """Whether a connection is fine after a step raised ``exc``: only after the server's
    own error reply, read to the end (the connection idle again), and not one that says
    our prepared statements are gone (``DISCARD ALL`` by a pooler)."""
    return (
        isinstance(exc, psycopg.DatabaseError)
        and not isinstance(exc, psycopg.errors.InvalidSqlStatementName)
        and pgconn.status == pq.ConnStatus.OK
        and pgconn.transaction_status == pq.TransactionStatus.IDLE
    )


class _Session:
    """One connection of a sync store, used by one step at a time.

    Steps go through libpq: a statement is prepared the first time this connection
    sends it, then each step is one Bind/Execute/Sync and its reply, waited for with
    ``poll`` up to the step's deadline.
    """

    __slots__ = ("conn", "idle_since", "pgconn", "poller", "prepared")

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.pgconn = conn.pgconn
        self.poller = select.poll()
        self.poller.register(self.pgconn.socket, select.POLLIN)
        self.prepared: set[bytes] = set()
        self.idle_since = 0.0  # when last given back to the pool; 0.0: never (new)

    def suspect(self) -> bool:
        """Whether this idle connection may be dead: broken, or its socket readable.

        An idle connection receives nothing, except the error a server sends when it
        terminates the session (shutdown, ``pg_terminate_backend``) before closing it.
        """
        return self.pgconn.status != pq.ConnStatus.OK or bool(self.poller.poll(0))

    def run(
        self, statement: _Statement, params: Sequence[bytes | None], timeout: float
    ) -> pq.abc.PGresult:
        deadline = time.monotonic() + timeout
        pgconn = self.pgconn
        if statement.name not in self.prepared:
            pgconn.send_prepare(statement.name, statement.sql, statement.types)
            _prepared(self._results(deadline, timeout))
            self.prepared.add(statement.name)
        pgconn.send_query_prepared(statement.name, params)
        return _checked(self._results(deadline, timeout))

    def simple(self, sql: bytes, timeout: float) -> None:
        """Run a statement without parameters (simple query protocol)."""
        self.pgconn.send_query(sql)
        _checked(self._results(time.monotonic() + timeout, timeout))

    def _results(self, deadline: float, timeout: float) -> list[pq.abc.PGresult]:
        pgconn = self.pgconn
        while pgconn.flush():  # not all sent yet: a long statement on a full socket
            self._wait(select.POLLIN | select.POLLOUT, deadline, timeout)
            pgconn.consume_input()
        results: list[pq.abc.PGresult] = []
        while True:
            while pgconn.is_busy():
                self._wait(select.POLLIN, deadline, timeout)
                _consume(pgconn, results)  # raises if the connection broke
            result = pgconn.get_result()
            if result is None:
                return results
            results.append(result)

    def _wait(self, events: int, deadline: float, timeout: float) -> None:
        left = deadline - time.monotonic()
        if events == select.POLLIN:
            ready = left > 0 and self.poller.poll(math.ceil(left * 1000))
        else:
            poller = select.poll()
            poller.register(self.pgconn.socket, events)
            ready = left > 0 and poller.poll(math.ceil(left * 1000))
        if not ready:
            raise _no_reply(timeout)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


class _Sessions:
    """The connections of a sync store: at most ``max_size``, opened when needed.

    A step takes one (the most recently used: its statements are prepared and its
    buffers warm) and gives it back, or drops it if it may be unusable. Idle ones beyond
    ``min_size`` close after ``MAX_IDLE``. A forked child opens its own: the parent's
    are kept, never closed from the child (that would end the parent's sessions).
    """

    def __init__(
        self, open_session: Callable[[], _Session], *, min_size: int, max_size: int, wait: float
    ) -> None:
        self._open_session = open_session
        self._min_size = min_size
        self._max_size = max_size
        self._wait = wait
        self._mutex = threading.Lock()
        self._changed = threading.Condition(self._mutex)
        self._free: list[_Session] = []
        self._open = 0
        self._waiting = 0  # threads waiting for a connection (nobody, nearly always)
        self._closed = False
        self._pid = os.getpid()
        self._abandoned: list[object] = []
        _FORK_AWARE.add(self)

    def _forked(self) -> None:
        """In a forked child: the parent's connections are not ours, nor its threads'
        hold on the mutex. Keep them referenced, never closed from here."""
        self._mutex = threading.Lock()
        self._changed = threading.Condition(self._mutex)
        self._abandoned.append(self._free)
        self._free, self._open, self._waiting, self._pid = [], 0, 0, os.getpid()

    def take(self, *, fresh: bool = False) -> _Session:
        """A connection for one step: the most recently used idle one that looks alive,
        else a new one (waiting up to ``wait`` for one given back at ``max_size``).
        ``fresh``: a new one, never an idle one (at ``max_size``, the longest idle one is
        closed to make room)."""
        doomed = []
        try:
            with self._mutex:
                deadline = None
                while True:
                    if self._closed:
                        raise RuntimeError("this store is closed")
                    while self._free and not fresh:
                        session = self._free.pop()
                        if not session.suspect():
                            return session
                        self._open -= 1
                        doomed.append(session)
                    if fresh and self._free and self._open >= self._max_size:
                        self._open -= 1
                        doomed.append(self._free.pop(0))
                    if self._open < self._max_size:
                        self._open += 1
                        break
                    if deadline is None:
                        deadline = time.monotonic() + self._wait
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(
                            f"no connection free within {self._wait:g} s (max_size is"
                            f" {self._max_size})"
                        )
                    self._waiting += 1
                    try:
                        self._changed.wait(left)
                    finally:
                        self._waiting -= 1
        finally:
            for session in doomed:
                session.close()
        try:
            return self._open_session()
        except BaseException:
            with self._mutex:
                self._open -= 1
                self._notify()
            raise

    def _notify(self) -> None:
        """A connection was given back or closed (the mutex held): wake a waiting thread."""
        if self._waiting:
            self._changed.notify()

    def give(self, session: _Session) -> None:
        now = time.monotonic()
        with self._mutex:
            if self._closed or self._pid != os.getpid():
                stale = session if self._pid == os.getpid() else None
            else:
                session.idle_since = now
                self._free.append(session)
                stale = None
                oldest = self._free[0]
                if len(self._free) > self._min_size and now - oldest.idle_since > MAX_IDLE:
                    del self._free[0]
                    self._open -= 1
                    stale = oldest
                self._notify()
        if stale is not None:
            stale.close()

    def settle(self, session: _Session, exc: BaseException) -> None:
        """After a step raised ``exc``: give the connection back, or drop it."""
        if _reusable(session.pgconn, exc):
            self.give(session)
            return
        with self._mutex:
            same_process = self._pid == os.getpid()
            if same_process:
                self._open -= 1
                self._notify()
        if same_process:
            session.close()

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            free, self._free = self._free, []
            same_process = self._pid == os.getpid()
            self._changed.notify_all()
        if same_process:
            for session in free:
                session.close()


# -- connections and the wire (async) ----------------------------------------------------


def _expire(future: asyncio.Future[None], timeout: float) -> None:
    if not future.done():
        future.set_exception(_no_reply(timeout))


class _AsyncSession:
    """``_Session`` for an async store: the same steps, waiting on the event loop."""

    __slots__ = ("conn", "fd", "idle_since", "pgconn", "poller", "prepared")

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.pgconn = conn.pgconn
        self.fd = self.pgconn.socket
        self.poller = select.poll()
        self.poller.register(self.fd, select.POLLIN)
        self.prepared: set[bytes] = set()
        self.idle_since = 0.0  # when last given back to the pool; 0.0: never (new)

    def suspect(self) -> bool:
        return self.pgconn.status != pq.ConnStatus.OK or bool(self.poller.poll(0))

    async def run(
        self, statement: _Statement, params: Sequence[bytes | None], timeout: float
    ) -> pq.abc.PGresult:
        deadline = asyncio.get_running_loop().time() + timeout
        pgconn = self.pgconn
        if statement.name not in self.prepared:
            pgconn.send_prepare(statement.name, statement.sql, statement.types)
            _prepared(await self._results(deadline, timeout))
            self.prepared.add(statement.name)
        pgconn.send_query_prepared(statement.name, params)
        return _checked(await self._results(deadline, timeout))

    async def simple(self, sql: bytes, timeout: float) -> None:
        self.pgconn.send_query(sql)
        deadline = asyncio.get_running_loop().time() + timeout
        _checked(await self._results(deadline, timeout))

    async def _results(self, deadline: float, timeout: float) -> list[pq.abc.PGresult]:
        pgconn = self.pgconn
        while pgconn.flush():
            await self._wait(True, deadline, timeout)
            pgconn.consume_input()
        results: list[pq.abc.PGresult] = []
        while True:
            while pgconn.is_busy():
                await self._wait(False, deadline, timeout)
                _consume(pgconn, results)
            result = pgconn.get_result()
            if result is None:
                return results
            results.append(result)

    async def _wait(self, writing: bool, deadline: float, timeout: float) -> None:
        # A future, a reader and a timer: the least the event loop needs to wake us.
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        if writing:
            loop.add_writer(self.fd, wake, ready)
        loop.add_reader(self.fd, wake, ready)
        timer = loop.call_at(deadline, _expire, ready, timeout)
        try:
            await ready
        finally:
            timer.cancel()
            loop.remove_reader(self.fd)
            if writing:
                loop.remove_writer(self.fd)

    def close(self) -> None:
        # What AsyncConnection.close() does, without a suspension point: callable from
        # a cancelled step's cleanup.
        with contextlib.suppress(Exception):
            self.pgconn.finish()


class _AsyncSessions:
    """``_Sessions`` for an async store (used from its event loop only)."""

    def __init__(
        self,
        open_session: Callable[[], Awaitable[_AsyncSession]],
        *,
        min_size: int,
        max_size: int,
        wait: float,
    ) -> None:
        self._open_session = open_session
        self._min_size = min_size
        self._max_size = max_size
        self._wait = wait
        self._free: list[_AsyncSession] = []
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._open = 0
        self._closed = False
        self._abandoned: list[object] = []
        _FORK_AWARE.add(self)

    def _forked(self) -> None:
        """In a forked child: the parent's connections are not ours (a child sending on
        them reads the parent's replies). Keep them referenced, never closed from here:
        closing one would end the parent's session."""
        self._abandoned.append((self._free, self._waiting))
        self._free, self._open, self._waiting = [], 0, collections.deque()

    async def take(self, *, fresh: bool = False) -> _AsyncSession:
        """As ``_Sessions.take``."""
        deadline = None
        while True:
            if self._closed:
                raise RuntimeError("this store is closed")
            while self._free and not fresh:
                session = self._free.pop()
                if not session.suspect():
                    return session
                self._open -= 1
                session.close()
            if fresh and self._free and self._open >= self._max_size:
                self._open -= 1
                self._free.pop(0).close()
            if self._open < self._max_size:
                self._open += 1
                try:
                    return await self._open_session()
                except BaseException:
                    self._open -= 1
                    self._changed()
                    raise
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self._wait
            turn: asyncio.Future[None] = loop.create_future()
            self._waiting.append(turn)
            try:
                async with asyncio.timeout_at(deadline):
                    await turn
            except BaseException as exc:
                if turn.done() and not turn.cancelled():
                    self._changed()  # woken, but going: the next task waiting looks again
                with contextlib.suppress(ValueError):
                    self._waiting.remove(turn)
                if isinstance(exc, TimeoutError):
                    raise TimeoutError(
                        f"no connection free within {self._wait:g} s"
                        f" (max_size is {self._max_size})"
                    ) from None
                raise

    def _changed(self) -> None:
        """A connection was given back or closed: the first task waiting looks again."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return

    def give(self, session: _AsyncSession) -> None:
        if self._closed:
            session.close()
            return
        now = time.monotonic()
        session.idle_since = now
        self._free.append(session)
        oldest = self._free[0]
        if len(self._free) > self._min_size and now - oldest.idle_since > MAX_IDLE:
            del self._free[0]
            self._open -= 1
            oldest.close()
        self._changed()

    def settle(self, session: _AsyncSession, exc: BaseException) -> None:
        if _reusable(session.pgconn, exc):
            self.give(session)
            return
        self._open -= 1
        session.close()
        self._changed()

    def close(self) -> None:
        self._closed = True
        free, self._free = self._free, []
        for session in free:
            session.close()
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)


# -- waiting: the sync store -------------------------------------------------------------


class _PostgresWaiter(Doorbell):
    """A waiter of the sync store: rung by the store's listener thread when a release
    hands it the key (or when the listener reconnected)."""

    __slots__ = ("id", "key", "listener", "on_close", "queued", "registered")

    def __init__(self, listener: _Listener, key: str) -> None:
        super().__init__()
        self.listener = listener
        self.key = key
        self.id = _waiter_id()
        self.registered = False  # with the listener: rung by a hand-over
        self.queued = False  # refused once: in the key's queue
        # Set while the waiter is queued in the table: leaves the queue (one statement).
        self.on_close: Callable[[], None] | None = None

    def close(self) -> None:
        on_close, self.on_close = self.on_close, None
        try:
            if on_close is not None:
                on_close()
        finally:
            if self.registered:
                self.registered = False
                self.listener.leave(self)


def _backoff(failures: int) -> float:
    return float(min(2.0, 0.05 * 2**failures))


# The listener connection idles by design: a role's idle_session_timeout (PostgreSQL 14
# and later; no row before) would end it every few moments, each time ringing every
# waiter and logging a warning (found by review).
_LISTENER_SETUP = (
    b"SELECT set_config(name, '0', false) FROM pg_settings WHERE name = 'idle_session_timeout'"
)


class _Listener:
    """One ``LISTEN`` connection per sync store, read by one daemon thread.

    ``join`` registers a waiter, and the waiter is rung once the connection listens (at
    once if it does already): a hand-over notified before went unheard, so it looks
    again. A notification carries the id of the waiter a key was handed over to, and
    rings that waiter only. After the connection drops, the thread reconnects and rings
    every waiter (it may have missed a hand-over).
    """

    def __init__(
        self, connect: Callable[[], psycopg.Connection[Any]], channel: str, timeout: float
    ) -> None:
        self._connect = connect
        self._channel = channel
        self._timeout = timeout
        self._mutex = threading.Lock()
        self._waiters: dict[str, _PostgresWaiter] = {}
        self._listening = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._pid = os.getpid()
        self._abandoned: list[object] = []
        _FORK_AWARE.add(self)

    def _forked(self) -> None:
        """In a forked child: the parent's thread did not come along, and its connection
        is the parent's: keep a reference (never close it from here) and start afresh."""
        self._mutex = threading.Lock()
        self._abandoned.append((self._wake_r, self._wake_w))
        self._wake_r, self._wake_w = os.pipe()
        self._pid = os.getpid()
        self._thread = None
        self._listening = threading.Event()
        closing, self._closing = self._closing, threading.Event()
        if closing.is_set():
            self._closing.set()
        self._waiters = {}

    def join(self, waiter: _PostgresWaiter) -> None:
        """Register ``waiter`` without waiting for the connection to listen (found by
        review: waiting for it here took ``connect_timeout`` whatever the caller's
        timeout, then failed the acquire with ``StoreError``)."""
        with self._mutex:
            if self._closing.is_set():
                raise RuntimeError("this store is closed")
            self._waiters[waiter.id] = waiter
            waiter.registered = True
            listening = self._listening.is_set()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="keymutex-postgresql-listener", daemon=True
                )
                self._thread.start()
        if listening:  # a hand-over notified before it was registered went unheard
            waiter.ring()

    def try_join(self, waiter: _PostgresWaiter) -> bool:
        """Register a waiter without waiting, if the connection is listening already."""
        with self._mutex:
            if not self._listening.is_set():
                return False
            self._waiters[waiter.id] = waiter
        waiter.registered = True
        return True

    def leave(self, waiter: _PostgresWaiter) -> None:
        with self._mutex:
            if self._waiters.get(waiter.id) is waiter:
                del self._waiters[waiter.id]

    def _dispatch(self, waiter_id: str) -> None:
        with self._mutex:
            waiter = self._waiters.get(waiter_id)
        if waiter is not None:
            waiter.ring()

    def _ring_all(self) -> None:
        with self._mutex:
            waiters = list(self._waiters.values())
        for waiter in waiters:
            waiter.ring()

    def _run(self) -> None:
        failures = 0
        while not self._closing.is_set():
            session: _Session | None = None
            try:
                session = _Session(self._connect())
                session.simple(_LISTENER_SETUP, self._timeout)
                session.simple(f"LISTEN {self._channel}".encode(), self._timeout)
                self._listening.set()
                # Hand-overs notified before were not heard: to the waiters registered
                # while it connected, or during an outage.
                self._ring_all()
                failures = 0
                self._pump(session.pgconn)
            except Exception as exc:  # the driver's, a timeout, or a socket closed under it
                if self._closing.is_set():
                    break
                failures += 1
                _LOG.warning("PostgreSQL listener connection failed (%s); reconnecting", exc)
            finally:
                self._listening.clear()
                if session is not None:
                    session.close()
            self._closing.wait(_backoff(failures))

    def _pump(self, pgconn: pq.abc.PGconn) -> None:
        """Read notifications until the connection fails or the store closes."""
        poller = select.poll()
        poller.register(pgconn.socket, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._closing.is_set():
            # Notifications that came with LISTEN's reply are read first.
            while (notify := pgconn.notifies()) is not None:
                self._dispatch(notify.extra.decode())
            events = poller.poll()
            if any(fd == self._wake_r for fd, _ in events):
                return
            pgconn.consume_input()  # raises OperationalError when the connection is gone
            if pgconn.status != pq.ConnStatus.OK:
                raise psycopg.OperationalError("the listener connection was lost")

    def close(self) -> None:
        with self._mutex:
            if self._closing.is_set():  # closed before: its pipe's fds may be others' now
                return
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


class _AsyncPostgresWaiter(LoopDoorbell):
    __slots__ = ("id", "key", "listener", "on_close", "queued", "registered")

    def __init__(self, listener: _AsyncListener, key: str) -> None:
        super().__init__()
        self.listener = listener
        self.key = key
        self.id = _waiter_id()
        self.registered = False
        self.queued = False
        self.on_close: Callable[[], Awaitable[None]] | None = None

    async def aclose(self) -> None:
        on_close, self.on_close = self.on_close, None
        try:
            if on_close is not None:
                await on_close()
        finally:
            if self.registered:
                self.registered = False
                self.listener.leave(self)


class _AsyncListener:
    """One ``LISTEN`` connection per async store, read by one task on the store's loop."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]],
        channel: str,
        timeout: float,
    ) -> None:
        self._connect = connect
        self._channel = channel
        self._timeout = timeout
        self._waiters: dict[str, _AsyncPostgresWaiter] = {}
        self._listening = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._abandoned: list[object] = []
        _FORK_AWARE.add(self)

    def _forked(self) -> None:
        """In a forked child: the parent's task and its connection are the parent's;
        start afresh (keeping a reference: never closed from here)."""
        self._abandoned.append(self._task)
        self._task = None
        self._listening = asyncio.Event()
        self._waiters = {}

    def join(self, waiter: _AsyncPostgresWaiter) -> None:
        """As the sync listener's: registered now, rung once the connection listens."""
        if self._closed:
            raise RuntimeError("this store is closed")
        self._waiters[waiter.id] = waiter
        waiter.registered = True
        if self._task is None or self._task.done():
            self._listening = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="keymutex-postgresql-listener")
        elif self._listening.is_set():  # a hand-over notified before it went unheard
            waiter.ring()

    def try_join(self, waiter: _AsyncPostgresWaiter) -> bool:
        if self._closed or not self._listening.is_set():
            return False
        self._waiters[waiter.id] = waiter
        waiter.registered = True
        return True

    def leave(self, waiter: _AsyncPostgresWaiter) -> None:
        if self._waiters.get(waiter.id) is waiter:
            del self._waiters[waiter.id]

    def _dispatch(self, waiter_id: str) -> None:
        waiter = self._waiters.get(waiter_id)
        if waiter is not None:
            waiter.ring()

    async def _run(self) -> None:
        failures = 0
        while not self._closed:
            conn: psycopg.AsyncConnection[Any] | None = None
            try:
                conn = await self._connect()
                async with asyncio.timeout(self._timeout):
                    await conn.execute(_LISTENER_SETUP.decode())
                    await conn.execute(f"LISTEN {self._channel}")
                self._listening.set()
                # Hand-overs notified before were not heard (as in the sync listener).
                for waiter in list(self._waiters.values()):
                    waiter.ring()
                failures = 0
                # Notifications that came with LISTEN's reply are yielded first.
                async for notify in conn.notifies():
                    self._dispatch(notify.payload)
            except Exception as exc:  # the driver's, or a timeout: reconnect
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
        await stop_task(task)


# -- the stores --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Target:
    """What a URL and the options name: where to connect, and how."""

    conninfo: str
    connect_kwargs: dict[str, Any]
    table: str
    min_size: int
    max_size: int
    connect_timeout: float
    timeout: float

    def setup(self) -> bytes:
        """What a new step connection runs first: the server gives a statement up by the
        time its client does (a step waits ``timeout`` for the reply), a little earlier,
        so that a statement held up in the server (waiting for a lock) ends with an
        error that reaches the client in time, and the connection stays usable."""
        # lock_timeout: found by review, a role's (1 ms) failed steps waiting for the
        # key's gate, releases and give-backs among them; statement_timeout bounds them.
        # The isolation: found by review, a role's or database's repeatable read or
        # serializable failed contended acquires and releases ("could not serialize
        # access"): each statement's snapshot is taken before it waits for the gate.
        # extra_float_digits: found by review, a role's -14 rounded the epoch seconds
        # the steps return as text (acquired_at off by years).
        return (
            f"SET statement_timeout = {math.ceil(self.timeout * 900)}; SET lock_timeout = 0;"
            " SET default_transaction_isolation = 'read committed'; SET extra_float_digits = 3"
        ).encode()


class PostgresStore:
    """The PostgreSQL store for one namespace (sync)."""

    capabilities = CAPABILITIES

    def __init__(self, target: _Target, namespace: str) -> None:
        self._target = target
        self._timeout = target.timeout
        self._steps = _Steps(target.table, namespace)
        self._mutex = threading.Lock()
        self._ready = False
        self._closed = False
        self._sessions = _Sessions(
            self._open_session,
            min_size=target.min_size,
            max_size=target.max_size,
            wait=target.connect_timeout,
        )
        self._listener = _Listener(self._connect, self._steps.channel, target.timeout)
        _FORK_AWARE.add(self)

    def _forked(self) -> None:
        self._mutex = threading.Lock()

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.Connection.connect(
            self._target.conninfo, autocommit=True, **self._target.connect_kwargs
        )

    def _open_session(self) -> _Session:
        session = _Session(self._connect())
        try:
            session.simple(self._target.setup(), self._timeout)
        except BaseException:
            session.close()
            raise
        return session

    def _exchange(self, run: Callable[[_Session], Any]) -> Any:
        """Run a statement on a connection of the pool; once more, on a new connection,
        if the server had ended the one lent before the statement ran (``_ended_idle``)."""
        fresh = False
        while True:
            session = self._sessions.take(fresh=fresh)
            try:
                result = run(session)
            except BaseException as exc:
                self._sessions.settle(session, exc)
                if fresh or not _ended_idle(session.idle_since, exc):
                    raise
                fresh = True
                continue
            self._sessions.give(session)
            return result

    def _check_schema(self) -> None:
        """Create or check the table, once per store (the first step waits for it)."""
        with self._mutex:
            if not self._ready:
                self._exchange(lambda s: s.simple(self._steps.sql.schema, self._timeout))
                self._ready = True

    def _execute(self, call: _Call) -> Rows:
        with translate_errors(*_DRIVER_ERRORS, what=f"PostgreSQL {call.what}"):
            if not self._ready:
                self._check_schema()
            result = self._exchange(lambda s: s.run(call.statement, call.params, self._timeout))
        return _rows(result)

    def _run(self, flow: Flow) -> Any:
        """Drive a step's flow: run each statement it yields, send it the rows."""
        call = next(flow)
        while True:
            try:
                call = flow.send(self._execute(call))
            except StopIteration as done:
                return done.value

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
        steps = self._steps
        if waiter is None:
            once: Outcome = self._run(
                steps.acquire(key, token, ttl, owner, info, steal, None, queued=False)
            )
            return once
        if not waiter.registered:
            self._listener.try_join(waiter)  # the store listens already: no wait
        flow = steps.acquire(key, token, ttl, owner, info, steal, waiter.id, queued=waiter.queued)
        # Set before the step: if its reply is lost, the waiter may be queued all the
        # same, and must leave the queue when it gives up (a no-op if it never joined).
        waiter.on_close = functools.partial(self._leave, key, waiter.id)
        try:
            outcome: Outcome = self._run(flow)
            if not outcome.ok:
                waiter.queued = True
                waiter.on_close = functools.partial(self._leave, key, waiter.id)
                if not waiter.registered:
                    # Queued now, not registered yet: a hand-over notified before the
                    # listener listens goes unheard, so it rings the waiter once it
                    # does, and the waiter looks again. Meanwhile the caller parks, by
                    # its own deadline.
                    self._listener.join(waiter)
        except StoreError:
            waiter.on_close = None  # see _UNANSWERED
            raise
        waiter.on_close = None if outcome.ok else functools.partial(self._leave, key, waiter.id)
        return outcome

    def _leave(self, key: str, waiter_id: str) -> None:
        if self._closed:
            return
        try:
            self._run(self._steps.leave(key, waiter_id))
        except StoreError as exc:  # its place lapses with the queue; a hand-over to it too
            _LOG.warning("could not leave the queue of %r: %s", key, exc)

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
        self._closed = True
        self._listener.close()
        self._sessions.close()


class AsyncPostgresStore:
    """The PostgreSQL store for one namespace (asyncio)."""

    capabilities = CAPABILITIES

    def __init__(self, target: _Target, namespace: str) -> None:
        self._target = target
        self._timeout = target.timeout
        self._steps = _Steps(target.table, namespace)
        # The schema check's lock, and the loop it belongs to: an asyncio.Lock that made
        # a task wait is bound to that task's loop (found by review: contended in one
        # asyncio.run, then in the next, it raised RuntimeError).
        self._opening: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._ready = False
        self._closed = False
        self._sessions = _AsyncSessions(
            self._open_session,
            min_size=target.min_size,
            max_size=target.max_size,
            wait=target.connect_timeout,
        )
        self._listener = _AsyncListener(self._connect, self._steps.channel, target.timeout)
        _FORK_AWARE.add(self)

    def _forked(self) -> None:
        self._opening = None  # an asyncio.Lock of the parent's event loop

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(
            self._target.conninfo, autocommit=True, **self._target.connect_kwargs
        )

    async def _open_session(self) -> _AsyncSession:
        session = _AsyncSession(await self._connect())
        try:
            await session.simple(self._target.setup(), self._timeout)
        except BaseException:
            session.close()
            raise
        return session

    async def _exchange(self, run: Callable[[_AsyncSession], Awaitable[Any]]) -> Any:
        """As ``PostgresStore._exchange``."""
        fresh = False
        while True:
            session = await self._sessions.take(fresh=fresh)
            try:
                result = await run(session)
            except BaseException as exc:  # cancelled mid-step too: the reply may be on its way
                self._sessions.settle(session, exc)
                if fresh or not _ended_idle(session.idle_since, exc):
                    raise
                fresh = True
                continue
            self._sessions.give(session)
            return result

    async def _check_schema(self) -> None:
        loop = asyncio.get_running_loop()
        if self._opening is None or self._opening[0] is not loop:
            self._opening = (loop, asyncio.Lock())
        async with self._opening[1]:
            if not self._ready:
                await self._exchange(lambda s: s.simple(self._steps.sql.schema, self._timeout))
                self._ready = True

    async def _execute(self, call: _Call) -> Rows:
        with translate_errors(*_DRIVER_ERRORS, what=f"PostgreSQL {call.what}"):
            if not self._ready:
                await self._check_schema()
            result = await self._exchange(
                lambda s: s.run(call.statement, call.params, self._timeout)
            )
        return _rows(result)

    async def _run(self, flow: Flow) -> Any:
        call = next(flow)
        while True:
            try:
                call = flow.send(await self._execute(call))
            except StopIteration as done:
                return done.value

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
        steps = self._steps
        if waiter is None:
            once: Outcome = await self._run(
                steps.acquire(key, token, ttl, owner, info, steal, None, queued=False)
            )
            return once
        if not waiter.registered:
            self._listener.try_join(waiter)
        flow = steps.acquire(key, token, ttl, owner, info, steal, waiter.id, queued=waiter.queued)
        waiter.on_close = functools.partial(self._leave, key, waiter.id)  # as in the sync store
        try:
            outcome: Outcome = await self._run(flow)
            if not outcome.ok:
                waiter.queued = True
                waiter.on_close = functools.partial(self._leave, key, waiter.id)
                if not waiter.registered:
                    self._listener.join(waiter)  # as in the sync store
        except StoreError:
            waiter.on_close = None  # see _UNANSWERED
            raise
        waiter.on_close = None if outcome.ok else functools.partial(self._leave, key, waiter.id)
        return outcome

    async def _leave(self, key: str, waiter_id: str) -> None:
        if self._closed:
            return
        try:
            await self._run(self._steps.leave(key, waiter_id))
        except StoreError as exc:
            _LOG.warning("could not leave the queue of %r: %s", key, exc)

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
        self._sessions.close()


# -- URLs and options --------------------------------------------------------------------

# Options a user may pass as ``Locks(url, **options)`` or in the URL's query string.
OPTIONS = ("table", "min_size", "max_size", "connect_timeout", "timeout")


# libpq settings with a closed set of values, and whole-number ones: checked here, as
# libpq would only when connecting, and the error would read as the server being down
# (found by review: ?sslmode=bogus gave StoreError at the first call).
_LIBPQ_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "target_session_attrs": (
        "any",
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ),
    "load_balance_hosts": ("disable", "random"),
}
_LIBPQ_NUMBERS = (
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
)


def _check_libpq_values(params: Mapping[str, object], url: str) -> None:
    for name, accepted in _LIBPQ_CHOICES.items():
        value = params.get(name)
        if value is not None and str(value) not in accepted:
            raise ValueError(
                f"{redacted(url)!r}: {name} must be one of {', '.join(accepted)}, not {value!r}"
            )
    for name in _LIBPQ_NUMBERS:
        value = params.get(name)
        if value is not None and not digits(str(value).strip()):
            raise ValueError(
                f"{redacted(url)!r}: {name} must be a whole number (libpq's), not {value!r}"
            )


def _parse(url: str, options: Mapping[str, object]) -> _Target:
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(
            f"unknown PostgreSQL store option(s) {sorted(unknown)}; accepted: {', '.join(OPTIONS)}"
            " (connection settings such as sslmode go in the URL)"
        )
    parts = split_url(url, "PostgreSQL", "postgresql://[user[:password]@]host[:port]/dbname")
    if parts.fragment:  # found by review: ignored (libpq drops it), where others refuse it
        raise ValueError(
            f"{redacted(url)!r}: a PostgreSQL URL has no fragment (a '#' in a password is"
            " written %23)"
        )
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours: dict[str, str] = {}
    for name, value in query:
        if name in ours:
            raise ValueError(f"{redacted(url)!r}: option {name!r} is given twice")
        if name in OPTIONS:
            ours[name] = value
    twice = set(ours) & set(options)
    if twice:
        raise ValueError(
            f"{redacted(url)!r}: {sorted(twice)} given both in the URL and as arguments"
        )
    merged: dict[str, object] = {**ours, **options}
    # What libpq reads: the URL less our options, the rest as written. Not re-encoded
    # (urlencode writes a space as "+", which libpq keeps as a plus: "-c search_path=x"
    # became "+c+search_path=x"), nor rebuilt by urlunsplit (which drops the "//" of an
    # empty host: postgresql:///db, a Unix socket, became postgresql:/db).
    theirs = [
        part
        for part in parts.query.split("&")
        if part and unquote(part.partition("=")[0]) not in OPTIONS
    ]
    conninfo = f"{parts.scheme}://{parts.netloc}{parts.path}"
    if theirs:
        conninfo += "?" + "&".join(theirs)
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.Error as exc:
        raise ValueError(
            f"{redacted(url)!r} is not a PostgreSQL URL: {scrubbed(str(exc), url)}"
        ) from None
    # libpq would only find out when connecting; one port per host, empty: the default.
    for port in str(params.get("port", "")).split(","):
        if port and not (digits(port) and 1 <= int(port) <= 65535):
            raise ValueError(
                f"{redacted(url)!r} is not a PostgreSQL URL: port must be a number from 1 to 65535,"
                f" not {port!r}"
            )

    _check_libpq_values(params, url)

    table = _check_table(merged.get("table", DEFAULT_TABLE))
    connect_timeout, timeout = (
        seconds("PostgreSQL", name, merged.get(name, default))
        for name, default in (
            ("connect_timeout", DEFAULT_CONNECT_TIMEOUT),
            ("timeout", DEFAULT_TIMEOUT),
        )
    )
    min_size = count("PostgreSQL", "min_size", merged.get("min_size", DEFAULT_MIN_SIZE), minimum=0)
    max_size = count(
        "PostgreSQL", "max_size", merged.get("max_size", max(DEFAULT_MAX_SIZE, min_size))
    )
    if max_size < min_size:
        raise ValueError(
            f"PostgreSQL option max_size must be >= min_size ({min_size}), not {max_size}"
        )

    connect_kwargs: dict[str, Any] = {
        # Parameters go out in PostgreSQL's text format, encoded here as UTF-8.
        "client_encoding": "UTF8",
    }
    defaults = {
        # libpq takes whole seconds, at least 2.
        "connect_timeout": max(2, math.ceil(connect_timeout)),
        "application_name": "keymutex",
        "keepalives": 1,
        "keepalives_idle": KEEPALIVE_IDLE,
        "keepalives_interval": KEEPALIVE_INTERVAL,
        "keepalives_count": KEEPALIVE_COUNT,
        # Data the server has not acknowledged for this long ends the connection.
        "tcp_user_timeout": math.ceil(timeout * 1000),
    }
    connect_kwargs.update({name: value for name, value in defaults.items() if name not in params})
    return _Target(conninfo, connect_kwargs, table, min_size, max_size, connect_timeout, timeout)


class PostgresDriver:
    def open(self, url: str, *, namespace: str, options: Mapping[str, object]) -> PostgresStore:
        return PostgresStore(_parse(url, options), namespace)

    def open_async(
        self, url: str, *, namespace: str, options: Mapping[str, object]
    ) -> AsyncPostgresStore:
        return AsyncPostgresStore(_parse(url, options), namespace)


driver = PostgresDriver()

"""``sqlite:///path/to/locks.db``: leases shared by the processes of one host.

- Each step is one ``BEGIN IMMEDIATE`` transaction on a WAL database: atomic across
  every process that opens the file.
- TTLs are measured by the host's boot-time clock (``CLOCK_BOOTTIME``), which every
  process shares; the database records the boot it belongs to, and leases of an
  earlier boot are dropped. The file must not live on a network file system.
- Deleting or replacing the file ends every lease in it: a process notices at its
  next step and reopens the file now at the path (its renewals and releases then say
  ``LockLost``), rather than go on alone in a file nobody else sees. Delete its
  ``-wal`` and ``-shm`` files with it: SQLite cannot open a new file beside the old
  ones while a process that has not noticed yet keeps them open ("disk I/O error").
- Fences come from one counter row that survives restarts of every process: a
  fence never goes backwards while the file lives. With ``synchronous=normal`` (the
  default) an OS crash or power loss may lose the last transactions, and with them
  fences; ``synchronous=full`` closes that gap at the cost of an fsync per step.
- A released lease's row is deleted; expired ones are swept a few at a time by later
  grants, so nothing grows with the number of distinct keys ever used.
- The stores of one process on one file (one per namespace: the lock server has one
  for each namespace it serves) take turns on one mutex of that file for their write
  transactions: they do not meet on SQLite's write lock, where a blocked step sleeps
  and looks again. Processes meet there, as they must. Reads (``holder``,
  ``holders``) wait for no writer.
- Async (``AsyncLocks``): a step first runs on the event loop's thread, where it
  never waits: if another thread of the process is in a step on the file, or another
  process holds the write lock, it gives up before changing anything and runs in a
  worker thread instead (a round trip to a thread costs several times a step). With
  ``synchronous=full`` (an fsync per commit) every step runs in a worker thread.
- Waiting: each waiter binds a Linux abstract datagram socket and joins the key's
  queue (a row holding its request) in the same transaction that refused it. A
  release grants the key to the first waiter in that same transaction and sends it
  one datagram with its fence: handoff is first come, first served across
  processes, in one transaction and one wake-up, with no polling. A free key is
  granted only to the first waiter. A waiter whose process died is found when the
  datagram bounces; its row, and a lease handed to it, are dropped. Abstract sockets
  exist per network namespace: a waiter in another one (a container sharing the file)
  cannot be rung, so the key is left free for it (the queue's head) and it takes it at
  its next recheck (within a second); if it is gone, its row lapses after
  ``WAITER_TTL`` and the next waiter takes the key.
  Elsewhere than Linux, waiters poll with backoff and no handoff is made.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import random
import secrets
import select
import socket
import sqlite3
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote

from keymutex import _clock
from keymutex._errors import StoreError
from keymutex._lease import Holder, Outcome
from keymutex._store import (
    AsyncStore,
    Capabilities,
    RenewRequest,
    ThreadedAsyncStore,
    WouldBlock,
    translate_errors,
)
from keymutex._urls import redacted, split_url
from keymutex.stores._doorbell import wake
from keymutex.stores._settings import seconds

__all__ = ["SqliteStore", "driver"]

T = TypeVar("T")
_LOG = logging.getLogger("keymutex")

SCHEMA_VERSION = 2  # 1: an unreleased layout of November 2026 (waiters by rowid)
NOTIFIES = sys.platform == "linux"  # abstract-namespace sockets are Linux only
CAPABILITIES = Capabilities(
    notifies=NOTIFIES,
    fair=NOTIFIES,  # the hand-over queue needs the wake-up; elsewhere waiters poll
    cross_process=True,
    durable_fences=True,
    clock="host-boottime",
)
# A queued waiter refreshes its row at every try (at least once a second); a row not
# refreshed for this long belongs to a waiter that is gone.
WAITER_TTL = 5.0
SWEEP_EVERY = 16  # grants of one store between two sweeps
SWEEP_BATCH = 32  # rows a sweep deletes at most: more than SWEEP_EVERY, so it keeps up

# Tables. leases: one row per live lease. waiters: one row per client waiting for a
# key, seq giving arrival order (from a counter: a seq is never reused, so a waiter's
# own seq never names another's row). meta: 'schema' version, 'fence' and 'queue'
# counters, 'boot' id. Both row tables are clustered on their key (WITHOUT ROWID) and
# have no other index: a step changes as few pages as it can, and each changed page
# is written whole to the WAL at commit.
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS keymutex_meta (name TEXT PRIMARY KEY, value ANY) STRICT",
    "CREATE TABLE IF NOT EXISTS keymutex_leases ("
    " namespace TEXT NOT NULL, key TEXT NOT NULL, token TEXT NOT NULL, owner TEXT NOT NULL,"
    " info TEXT, fence INTEGER NOT NULL, acquired_at REAL NOT NULL, expires REAL NOT NULL,"
    " wake BLOB, PRIMARY KEY (namespace, key)) STRICT, WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS keymutex_waiters ("
    " namespace TEXT NOT NULL, key TEXT NOT NULL, seq INTEGER NOT NULL, address BLOB,"
    " expires REAL NOT NULL, token TEXT NOT NULL, owner TEXT NOT NULL, info TEXT,"
    " ttl REAL NOT NULL, PRIMARY KEY (namespace, key, seq)) STRICT, WITHOUT ROWID",
    "CREATE TRIGGER IF NOT EXISTS keymutex_queued AFTER INSERT ON keymutex_waiters BEGIN"
    " UPDATE keymutex_meta SET value = NEW.seq WHERE name = 'queue';"
    " END",
    # Every grant inserts a lease with the next fence: the trigger moves the counter
    # and takes the grantee out of the queue, inside the same statement.
    "CREATE TRIGGER IF NOT EXISTS keymutex_granted AFTER INSERT ON keymutex_leases BEGIN"
    " UPDATE keymutex_meta SET value = NEW.fence WHERE name = 'fence';"
    " DELETE FROM keymutex_waiters"
    " WHERE namespace = NEW.namespace AND key = NEW.key AND token = NEW.token;"
    " END",
)
# A handoff datagram: b"G", fence, acquired_at, expires, then the grantee's token.
_HANDOFF_MESSAGE = struct.Struct("!cqdd")
_LEASE_COLUMNS = " (namespace, key, token, owner, info, fence, acquired_at, expires, wake)"
_DELETE_WAITER = "DELETE FROM keymutex_waiters WHERE namespace = ? AND key = ? AND seq = ?"
_DELETE_LEASE = "DELETE FROM keymutex_leases WHERE namespace = ? AND key = ? AND token = ?"
_SELECT_LEASE = (
    "SELECT token, owner, info, fence, acquired_at, expires FROM keymutex_leases"
    " WHERE namespace = ? AND key = ?"
)
_ANY_QUEUED = (
    "SELECT EXISTS (SELECT 1 FROM keymutex_waiters"
    " WHERE namespace = ? AND key = ? AND expires > ?)"
)
_SELECT_QUEUE = (
    "SELECT seq, address FROM keymutex_waiters"
    " WHERE namespace = ? AND key = ? AND expires > ? ORDER BY seq LIMIT 8"
)
# Grant to the caller: ? = namespace, key, token, owner, info, acquired_at, expires.
_GRANT = (
    "INSERT OR REPLACE INTO keymutex_leases"
    + _LEASE_COLUMNS
    + " SELECT ?, ?, ?, ?, ?, value + 1, ?, ?, NULL FROM keymutex_meta WHERE name = 'fence'"
    " RETURNING fence"
)
# Grant to the caller if the key is free and nobody waits for it: the common case, in
# one statement. ?1 = namespace, ?2 = key, then token, owner, info, acquired_at,
# expires, ?8 = now. No row: held, or waited for; the step then looks closer.
_GRANT_IF_FREE = (
    "INSERT OR REPLACE INTO keymutex_leases"
    + _LEASE_COLUMNS
    + " SELECT ?1, ?2, ?3, ?4, ?5, value + 1, ?6, ?7, NULL FROM keymutex_meta"
    " WHERE name = 'fence' AND NOT EXISTS (SELECT 1 FROM keymutex_leases"
    " WHERE namespace = ?1 AND key = ?2 AND expires > ?8) AND NOT EXISTS (SELECT 1"
    " FROM keymutex_waiters WHERE namespace = ?1 AND key = ?2 AND expires > ?8)"
    " RETURNING fence"
)
# Grant to the first live waiter that can be woken: ? = acquired_at, now, namespace, key,
# now. Returns the lease and where to send the news. Run only once that waiter is known
# to be of our network namespace (``_hand_off``).
_HAND_OFF = (
    "INSERT OR REPLACE INTO keymutex_leases"
    + _LEASE_COLUMNS
    + " SELECT namespace, key, token, owner, info,"
    " (SELECT value + 1 FROM keymutex_meta WHERE name = 'fence'), ?, ? + ttl, address"
    " FROM keymutex_waiters WHERE namespace = ? AND key = ? AND expires > ?"
    " AND address IS NOT NULL ORDER BY seq LIMIT 1"
    " RETURNING token, owner, info, fence, acquired_at, expires, wake"
)
# The address of the waiter _HAND_OFF would grant the key to: ? = namespace, key, now.
_FIRST_WAITER = (
    "SELECT address FROM keymutex_waiters WHERE namespace = ?1 AND key = ?2 AND expires > ?3"
    " AND address IS NOT NULL ORDER BY seq LIMIT 1"
)
# Release: only the token's own lease (an expired one is deleted too, and reported lost).
# ? = namespace, key, token, now. Returns its expiry, and the address of the waiter that
# _HAND_OFF would grant the key to, if any (none: there is nothing to do).
_RELEASE = (
    "DELETE FROM keymutex_leases WHERE namespace = ?1 AND key = ?2 AND token = ?3"
    " RETURNING expires, (SELECT address FROM keymutex_waiters WHERE namespace = ?1"
    " AND key = ?2 AND expires > ?4 AND address IS NOT NULL ORDER BY seq LIMIT 1)"
)
# Renew: only the token's own live lease; returns the renewed lease.
_RENEW = (
    "UPDATE keymutex_leases SET expires = ? WHERE namespace = ? AND key = ? AND token = ?"
    " AND expires > ? RETURNING token, owner, info, fence, acquired_at, expires"
)


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) or "locked" in str(exc)


def _holder(key: str, row: Sequence[Any], now: float) -> Holder:
    _, owner, info, fence, acquired_at, expires = row
    return Holder(
        key=key,
        owner=owner,
        info=None if info is None else json.loads(info),
        fence=fence,
        acquired_at=acquired_at,
        expires_at=time.time() + (expires - now),
    )


def _outcome(ok: bool, key: str, row: Sequence[Any] | None, now: float) -> Outcome:
    if row is None or row[5] <= now:
        return Outcome(ok)
    return Outcome(ok, _holder(key, row, now), row[5] - now)


@dataclass(frozen=True, slots=True)
class _Handoff:
    """A lease granted to a waiter, and the datagram that tells it so."""

    key: str
    token: str
    address: bytes
    message: bytes


def _network_namespace() -> bytes:
    """This process's network namespace, as a tag for its waiting addresses."""
    try:
        return b"%x" % os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return b"0"


# Abstract socket addresses exist per network namespace: a waiter in another one (a
# container sharing the database file) cannot be rung from here, nor seen to be gone.
_NETWORK_NAMESPACE = _network_namespace() if NOTIFIES else b"0"


# How the addresses of this network namespace begin (see _SocketPool.take).
_HERE = b"\0keymutex-%s-" % _NETWORK_NAMESPACE


def _elsewhere(address: bytes) -> bool:
    """Whether ``address`` was bound in another network namespace than ours."""
    parts = address.split(b"-")
    return len(parts) == 3 and parts[1] != _NETWORK_NAMESPACE


def _ring(sender: socket.socket, address: bytes, message: bytes = b"!") -> bool:
    """Send a datagram; ``False`` when nobody listens there any more.

    A waiter in another network namespace is not rung (it cannot be): it is taken to
    be there, takes the key at its next recheck (within a second), and if it is gone
    its row lapses after ``WAITER_TTL``.
    """
    if _elsewhere(address):
        return True
    try:
        sender.sendto(message, address)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except (BlockingIOError, OSError):
        return True  # its buffer is full of wake-ups already
    return True


class _SqliteWaiter:
    """A waiter's socket and its place in a key's queue (``seq``, once queued).

    ``granted`` is (fence, acquired_at, expires) when a release said it handed us
    the key: the datagram carries those and our token (owner and info are ours).
    The socket is taken when the waiter first queues (``bind``): most first tries
    are granted, and never need one.
    """

    def __init__(self, store: SqliteStore, key: str) -> None:
        self._store = store
        self.key = key
        self.seq: int | None = None
        self.token: str | None = None  # the request's token, once queued
        self.granted: tuple[int, float, float] | None = None
        self.address: bytes | None = None
        self._socket: socket.socket | None = None

    def bind(self) -> None:
        """Take a socket to be woken on (where the host has them), before queueing."""
        if NOTIFIES and self._socket is None:
            self._socket, self.address = self._store._sockets.take()
            self._drain()  # wake-ups meant for the socket's previous user

    def _drain(self) -> bool:
        """Read every datagram waiting; ``True`` if there was any."""
        assert self._socket is not None
        rung = False
        while True:
            try:
                message = self._socket.recv(8192)
            except BlockingIOError:
                return rung
            rung = True
            # A grant for another token (a previous user of this pooled socket) is
            # just a wake-up.
            grant = (
                _HANDOFF_MESSAGE.unpack_from(message)
                if len(message) > _HANDOFF_MESSAGE.size
                else None
            )
            if (
                grant
                and grant[0] == b"G"
                and message[_HANDOFF_MESSAGE.size :] == (self.token or "").encode()
            ):
                self.granted = grant[1:]
                self.seq = None  # the granting transaction removed our row

    def wait(self, timeout: float) -> bool:
        if self._socket is None:
            time.sleep(timeout)
            return False
        if self._drain():
            return True
        poller = select.poll()  # not select(): descriptors may be above 1023
        poller.register(self._socket, select.POLLIN)
        return bool(poller.poll(timeout * 1000)) and self._drain()

    async def wait_async(self, timeout: float) -> bool:
        if self._socket is None:
            await asyncio.sleep(timeout)
            return False
        if self._drain():
            return True
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(self._socket.fileno(), wake, readable)
        try:
            async with asyncio.timeout(timeout):
                await readable
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(self._socket.fileno())
        return self._drain()

    def close(self) -> None:
        sock, self._socket = self._socket, None
        try:
            if self.seq is not None or self.granted is not None:
                self._store._leave(self)
        finally:
            if sock is not None:
                assert self.address is not None
                self._store._sockets.give_back(sock, self.address)


# .on: this thread makes an inline attempt (``SqliteStore.attempt``), of whichever store.
_ATTEMPTING = threading.local()


class _StepLock:
    """A mutex of the SQLite store: a store's own (one step at a time on its
    connection), or a database file's (one write transaction at a time on it, of any of
    the process's stores of that file: ``_file_mutex``).

    In an inline attempt (``SqliteStore.attempt``, on the event loop's thread) it never
    waits: a mutex held by a step in a worker thread is ``WouldBlock``.
    """

    __slots__ = ("__weakref__", "_lock")  # weak: kept per file while used

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=not getattr(_ATTEMPTING, "on", False)):
            raise WouldBlock

    def __exit__(self, *_: object) -> None:
        self._lock.release()


class _SocketPool:
    """Bound datagram sockets kept for reuse: a waiter costs no system call.

    It knows the sockets it lent out too: a forked child closes its copies of all of
    them (``close``), those of waiters waiting at the fork included. A copy left open
    in the child would keep the address alive after the parent died: releases would
    hand the key to the dead parent's waiter, and everyone would wait for its TTL.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._free: list[tuple[socket.socket, bytes]] = []
        self._lent: set[socket.socket] = set()
        self._closed = False

    def take(self) -> tuple[socket.socket, bytes]:
        with self._mutex:
            if self._free:
                sock, address = self._free.pop()
                self._lent.add(sock)
                return sock, address
        address = _HERE + secrets.token_hex(12).encode()
        with translate_errors(OSError, what="cannot open a socket to wait on"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                sock.bind(address)
                sock.setblocking(False)
            except OSError:
                sock.close()
                raise
        with self._mutex:
            self._lent.add(sock)
        return sock, address

    def give_back(self, sock: socket.socket, address: bytes) -> None:
        if sock.fileno() == -1:  # closed by a fork's reset, lent before it: not reusable
            return
        with self._mutex:
            self._lent.discard(sock)
            if not self._closed and len(self._free) < 16:
                self._free.append((sock, address))
                return
        sock.close()

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            for sock, _ in self._free:
                sock.close()
            for sock in self._lent:
                sock.close()
            self._free.clear()
            self._lent.clear()


def _new_sender() -> socket.socket | None:
    if not NOTIFIES:
        return None
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.setblocking(False)
    return sender


_STORES: weakref.WeakSet[SqliteStore] = weakref.WeakSet()
# The mutexes that _before_fork took, for the parent to let go of after the fork.
_HELD_OVER_FORK: list[_StepLock] = []
# Per database file (its real path), the mutex its stores in this process share; kept
# while a store of that file lives.
_FILE_MUTEXES: weakref.WeakValueDictionary[str, _StepLock] = weakref.WeakValueDictionary()
_FILE_MUTEXES_GUARD = threading.Lock()


def _file_mutex(real_path: str) -> _StepLock:
    """The write mutex shared by this process's stores of the file at ``real_path``.

    Each store (one per namespace: the lock server opens one per namespace it serves)
    has a connection of its own; the write transactions of one process on one file
    take turns on this mutex rather than on SQLite's write lock (reads take only their
    store's own mutex: in WAL mode they wait for no writer, and found by review, a
    read in one namespace waited here for another's write that waited for another
    process's, up to ``busy_timeout``). Found under load (100 clients over 120
    namespaces of a lock server): on the write lock, a blocked step sleeps and looks
    again (``_retry_busy``), with nobody's turn kept, in a worker thread it holds the
    while; on a mutex it is woken when the step before it ends. Other processes still
    meet on the write lock, as before.
    """
    with _FILE_MUTEXES_GUARD:
        mutex = _FILE_MUTEXES.get(real_path)
        if mutex is None:
            mutex = _FILE_MUTEXES[real_path] = _StepLock()
        return mutex


def _before_fork() -> None:
    """No step of ours is inside SQLite when the process forks: each store's mutex is
    taken first (a step under way ends; its thread does not exist in the child).

    A child forked while a thread (a renewal batch, a waiter's try) was inside SQLite
    inherited SQLite's own state as that thread left it: its first connection hung
    forever in ``sqlite3.connect``, or found the database locked for ``busy_timeout``
    (3 children in 100, forked from a parent renewing 300 leases).
    """
    # The table's lock first, and held over the fork: the child's handler takes it to
    # give its stores new mutexes (found by review: a child forked while another thread
    # looked a file's mutex up inherited that lock held, and hung for good in its
    # handler). Then each store's own mutex (a read, a step under way), then each
    # file's (a write; a store that is opening, not yet in _STORES, too): in the order
    # a step takes them.
    _FILE_MUTEXES_GUARD.acquire()
    for mutex in [store._mutex for store in list(_STORES)] + list(_FILE_MUTEXES.values()):
        mutex._lock.acquire()
        _HELD_OVER_FORK.append(mutex)


def _after_fork_in_parent() -> None:
    while _HELD_OVER_FORK:
        _HELD_OVER_FORK.pop()._lock.release()
    _FILE_MUTEXES_GUARD.release()


def _reset_after_fork() -> None:
    _HELD_OVER_FORK.clear()  # the child's stores get mutexes of their own
    _FILE_MUTEXES.clear()
    _FILE_MUTEXES_GUARD.release()  # taken by _before_fork, in this thread
    for store in list(_STORES):
        store._after_fork_in_child()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_reset_after_fork
)


class SqliteStore:
    """The ``sqlite:///path`` store for one namespace."""

    capabilities = CAPABILITIES

    def __init__(
        self, path: str, namespace: str, *, synchronous: str, busy_timeout: float
    ) -> None:
        self._path = path
        # The file connected to, whatever the cwd later: joined, not normalised (".." after
        # a symlink is the OS's to follow, as for every other opener of the path).
        self._file = os.path.join(os.getcwd(), path)
        self._identity: tuple[int, int] | None = None  # of the file connected to
        self._namespace = namespace
        self.synchronous = synchronous
        self._busy_timeout = busy_timeout
        self._mutex = _StepLock()  # its connection's
        self._writes = _file_mutex(os.path.realpath(self._file))  # the file's, in the process
        self._pid = os.getpid()
        # From a random place: a store that grants fewer than SWEEP_EVERY leases (a
        # `keymutex run`, a cron job) still sweeps now and then, at the same odds per
        # grant as a long-lived one. Counting from 0, none ever did.
        self._grants = random.randrange(SWEEP_EVERY)
        self._sweep_from = ("", "")
        self._conn = self._connect()  # first: if it fails, there is nothing to close
        self._sockets = _SocketPool()
        self._sender = _new_sender()
        _STORES.add(self)

    def _after_fork_in_child(self) -> None:
        """A forked child gets its own mutexes and sockets; its connection reopens lazily.

        The child's copies of the parent's waiting sockets are closed, so that a parent
        that dies is seen as gone, and the child never reads the parent's wake-ups.
        """
        self._mutex = _StepLock()
        self._writes = _file_mutex(os.path.realpath(self._file))
        self._sockets.close()
        self._sockets = _SocketPool()
        if self._sender is not None:
            self._sender.close()
        self._sender = _new_sender()

    def attempt(self, step: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``step`` (one of this store's) without waiting for the mutex or for the
        database's write lock: ``WouldBlock``, having changed nothing, where it would.

        For ``AsyncLocks``, on the event loop's thread: a step is tens of microseconds
        of SQLite when nobody else writes, a round trip to a worker thread several
        times that. A step that has committed goes on as usual (a handoff to a waiter
        that is gone, rare, is a second transaction). With ``synchronous=full`` every
        commit waits for the disk: those steps always run in threads.
        """
        _ATTEMPTING.on = True
        try:
            return step(*args, **kwargs)
        finally:
            _ATTEMPTING.on = False

    # -- connection and transactions -----------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # Of the file resolved at start: a forked child of a process that has changed
        # directory since reconnects to the same file, and checks that file's directory.
        directory = os.path.dirname(self._file)
        if not os.path.isdir(directory):  # SQLite would only say "unable to open database file"
            raise StoreError(
                f"cannot open SQLite database {self._path!r}: its directory {directory!r} does"
                " not exist (keymutex creates the file, not its directory)"
            )
        try:
            return self._open_file()
        except StoreError as exc:
            if "disk I/O error" not in str(exc) or not os.path.exists(self._file + "-wal"):
                raise
            raise StoreError(
                f"{exc} (if the database was deleted while processes had it open, its -wal"
                " and -shm files are still theirs: delete the three files together)"
            ) from exc.__cause__

    def _open_file(self) -> sqlite3.Connection:
        with translate_errors(sqlite3.Error, what=f"cannot open SQLite database {self._path!r}"):
            conn = sqlite3.connect(
                self._file, isolation_level=None, check_same_thread=False, timeout=0
            )
            try:
                # Small pages: each step touches a few rows in a few b-trees, and every
                # page it changes is written whole to the WAL at commit.
                conn.execute("PRAGMA page_size=1024")  # only takes effect on a new file
                self._refuse_foreign(conn)
                self._retry_busy(lambda: conn.execute("PRAGMA journal_mode=WAL"))
                conn.execute(f"PRAGMA synchronous={self.synchronous}")
                self._transaction(conn, self._prepare)
                self._identity = self._file_identity()  # the file, created by now
            except BaseException:
                conn.close()
                raise
        return conn

    def _refuse_foreign(self, conn: sqlite3.Connection) -> None:
        """Refuse a database of another application, before changing anything in it.

        Found by review: a URL naming an application's own database was taken as is,
        and keymutex added its tables and triggers and switched the file to WAL for
        good. A lock file is keymutex's alone.
        """
        others = [
            name
            for (name,) in self._retry_busy(
                lambda: conn.execute(
                    "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')"
                    " AND name NOT GLOB 'keymutex_*' AND name NOT GLOB 'sqlite_*'"
                    " ORDER BY name LIMIT 4"  # GLOB: case-sensitive, _ is itself
                ).fetchall()
            )
        ]
        if others:
            raise StoreError(
                f"{self._path!r} is the database of something else (it has {others[:3]}"
                f"{' and more' if len(others) > 3 else ''}): keymutex needs a SQLite file"
                " of its own, such as locks.db beside it"
            )

    def _prepare(self, conn: sqlite3.Connection, now: float) -> None:
        conn.execute(_SCHEMA[0])  # meta first: the schema version decides the rest
        meta = dict(conn.execute("SELECT name, value FROM keymutex_meta").fetchall())
        version = meta.get("schema", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise StoreError(
                f"{self._path!r} has keymutex schema {version}; this version reads"
                f" {SCHEMA_VERSION}: use a new file (leases are short-lived)"
            )
        for statement in _SCHEMA[1:]:
            conn.execute(statement)
        boot = _clock.boot_id() or "unknown"
        if meta.get("boot") != boot:
            # Expiry times count from an earlier boot of the host: those leases are gone.
            conn.execute("DELETE FROM keymutex_leases")
            conn.execute("DELETE FROM keymutex_waiters")
        conn.executemany(
            "INSERT OR REPLACE INTO keymutex_meta (name, value) VALUES (?, ?)",
            [("schema", SCHEMA_VERSION), ("boot", boot)],
        )
        conn.execute(
            "INSERT OR IGNORE INTO keymutex_meta (name, value) VALUES ('fence', 0), ('queue', 0)"
        )

    def _retry_busy(self, attempt: Callable[[], T]) -> T:
        """Run ``attempt``, retrying while the database is busy, with short sleeps.

        SQLite's own busy handler sleeps a whole millisecond at first; our steps take
        tens of microseconds, so a tighter retry keeps handoff fast under contention.
        """
        give_up = _clock.monotonic() + self._busy_timeout
        delay = 0.00005
        while True:
            try:
                return attempt()
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                if getattr(_ATTEMPTING, "on", False):
                    raise WouldBlock from None  # nothing changed yet: go to a thread
                if _clock.monotonic() >= give_up:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.002)

    def _transaction(
        self, conn: sqlite3.Connection, step: Callable[[sqlite3.Connection, float], T]
    ) -> T:
        with self._writes:  # the process's writers of the file take turns here
            try:
                # Inside the try: an interrupt (Ctrl-C) just after BEGIN must roll back
                # too, or the connection stays in a write transaction that locks out
                # every process until this one ends.
                self._retry_busy(lambda: conn.execute("BEGIN IMMEDIATE"))
                result = step(conn, _clock.monotonic())
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        # Committed: an inline attempt can no longer be given up (and run again in a
        # thread). What else the step does waits as it must, in the loop's thread.
        _ATTEMPTING.on = False
        return result

    def _write(self, step: Callable[[sqlite3.Connection, float], T]) -> T:
        """Run ``step`` in one write transaction; driver errors become ``StoreError``."""
        with self._mutex:
            return self._write_locked(step)

    def _write_locked(self, step: Callable[[sqlite3.Connection, float], T]) -> T:
        with translate_errors(sqlite3.Error, what=f"SQLite store {self._path!r}"):
            return self._transaction(self._connection(), step)

    def _read(self, query: Callable[[sqlite3.Connection, float], T]) -> T:
        with self._mutex, translate_errors(sqlite3.Error, what=f"SQLite store {self._path!r}"):
            conn = self._connection()
            return self._retry_busy(lambda: query(conn, _clock.monotonic()))

    def _connection(self) -> sqlite3.Connection:
        if os.getpid() != self._pid:  # forked: a SQLite connection must not cross a fork
            self._conn = self._reconnect()  # if it fails, the next step tries again
            self._pid = os.getpid()
        elif self._file_identity() != self._identity:
            # The file was deleted or replaced under this connection, which would go on
            # granting and renewing in a file nobody else sees (two holders of a key).
            # Its leases went with it: from the file at the path now, renew and release
            # find them gone (LockLost).
            _LOG.warning("SQLite database %r was replaced or removed; reopening", self._path)
            old, self._conn = self._conn, self._reconnect()
            old.close()
        return self._conn

    def _reconnect(self) -> sqlite3.Connection:
        """A new connection, made by a step: an inline attempt stays one. Opening
        commits a transaction of its own, which ends an attempt's inline part (found by
        review: the step's own transaction then waited for a busy file on the event
        loop's thread, up to the busy timeout)."""
        inline = getattr(_ATTEMPTING, "on", False)
        try:
            return self._connect()
        finally:
            _ATTEMPTING.on = inline

    def _file_identity(self) -> tuple[int, int] | None:
        """The file at the path now (``None``: none there, or none this process can see).

        Of the absolute path: a relative one would name another file after os.chdir.
        """
        try:
            found = os.stat(self._file)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:  # cannot tell (a permission changed): take it to be the same
            return self._identity
        return found.st_dev, found.st_ino

    # -- the queue of waiters -----------------------------------------------------

    def _queue_head(
        self, conn: sqlite3.Connection, key: str, now: float
    ) -> tuple[Any, ...] | None:
        """The first live waiter for ``key``, dropping those whose process is gone."""
        while True:
            rows = conn.execute(_SELECT_QUEUE, (self._namespace, key, now)).fetchall()
            if not rows:
                return None
            for row in rows:
                address = row[1]
                if address is None or self._sender is None or _ring(self._sender, address):
                    return tuple(row)
                conn.execute(_DELETE_WAITER, (self._namespace, key, row[0]))

    def _hand_off(
        self, conn: sqlite3.Connection, key: str, now: float, first: bytes | None = None
    ) -> _Handoff | None:
        """Grant a free ``key`` to its first waiter, in the caller's transaction; ``first``
        is its address when the caller knows it (a release reads it as it deletes).

        Returns what to send it once the transaction has committed. A first waiter of
        another network namespace is not handed the key: it cannot be rung, nor seen to
        be gone, so the key stays free for it, the queue's head, and it takes it at its
        next recheck. Found by review: handed over, the key of such a waiter that had
        died (its container stopped) was held for its whole TTL, not the WAITER_TTL its
        row lapses after.
        """
        if first is None:
            found = conn.execute(_FIRST_WAITER, (self._namespace, key, now)).fetchone()
            if found is None:
                return None
            (first,) = found
        if _elsewhere(first):
            return None
        row = conn.execute(_HAND_OFF, (time.time(), now, self._namespace, key, now)).fetchone()
        if row is None:
            return None
        token, _, _, fence, acquired_at, expires, address = row
        message = _HANDOFF_MESSAGE.pack(b"G", fence, acquired_at, expires) + token.encode()
        return _Handoff(key, token, address, message)

    def _deliver(self, handoff: _Handoff | None) -> None:
        """Tell the waiter it was handed the key; if it is gone, take the lease back."""
        while handoff is not None and self._sender is not None:
            if _ring(self._sender, handoff.address, handoff.message):
                # Let the waiter we just woke run now, if it was queued on this CPU:
                # otherwise it often waits for the releaser's next step (4 processes on
                # one key, 2 cores: handoff p50 0.20 -> 0.16 ms).
                os.sched_yield()
                return
            handoff = self._write_locked(functools.partial(self._take_back, handoff))

    def _take_back(self, gone: _Handoff, conn: sqlite3.Connection, now: float) -> _Handoff | None:
        """Undo a handoff to a waiter that is gone, and hand the key to the next one."""
        deleted = conn.execute(
            _DELETE_LEASE,
            (self._namespace, gone.key, gone.token),
        )
        return self._hand_off(conn, gone.key, now) if deleted.rowcount else None

    def _enqueue(
        self,
        conn: sqlite3.Connection,
        waiter: _SqliteWaiter,
        request: tuple[str, str, str | None, float],
        now: float,
    ) -> None:
        expires = now + WAITER_TTL
        waiter.bind()
        if waiter.seq is not None:
            updated = conn.execute(
                "UPDATE keymutex_waiters SET expires = ?"
                " WHERE namespace = ? AND key = ? AND seq = ?",
                (expires, self._namespace, waiter.key, waiter.seq),
            )
            if updated.rowcount:
                return
        token, owner, info_json, ttl = request
        (waiter.seq,) = conn.execute(
            "INSERT INTO keymutex_waiters"
            " (namespace, key, seq, address, expires, token, owner, info, ttl)"
            " SELECT ?, ?, value + 1, ?, ?, ?, ?, ?, ? FROM keymutex_meta WHERE name = 'queue'"
            " RETURNING seq",
            (self._namespace, waiter.key, waiter.address, expires, token, owner, info_json, ttl),
        ).fetchone()
        waiter.token = token

    def _leave(self, waiter: _SqliteWaiter) -> None:
        """Leave the queue; give back a lease handed over meanwhile, passing it on."""
        namespace, key = self._namespace, waiter.key

        def step(conn: sqlite3.Connection, now: float) -> _Handoff | None:
            if waiter.seq is not None:
                conn.execute(_DELETE_WAITER, (namespace, key, waiter.seq))
            if waiter.token is not None:
                conn.execute(
                    _DELETE_LEASE,
                    (namespace, key, waiter.token),
                )
            row = conn.execute(_SELECT_LEASE, (namespace, key)).fetchone()
            return self._hand_off(conn, key, now) if row is None or row[5] <= now else None

        with self._mutex:
            self._deliver(self._write_locked(step))
        waiter.seq = None
        waiter.granted = None

    # -- the steps -----------------------------------------------------------------

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
        assert waiter is None or isinstance(waiter, _SqliteWaiter)
        info_json = None if info is None else json.dumps(info, separators=(",", ":"))
        if waiter is not None and waiter.granted is not None and not steal:
            # A release handed us the key and told us its fence and times. Expired
            # meanwhile? Then try for it like anybody else, below.
            (fence, acquired_at, expires), waiter.granted = waiter.granted, None
            now = _clock.monotonic()
            if expires > now:
                waiter.token = None
                return _outcome(
                    True, key, (token, owner, info_json, fence, acquired_at, expires), now
                )
        namespace = self._namespace

        def step(conn: sqlite3.Connection, now: float) -> Outcome:
            if not steal and (waiter is None or waiter.seq is None):
                acquired_at, expires = time.time(), now + ttl
                granted = conn.execute(
                    _GRANT_IF_FREE,
                    (namespace, key, token, owner, info_json, acquired_at, expires, now),
                ).fetchone()
                if granted is not None:
                    return self._granted(
                        conn,
                        waiter,
                        key,
                        now,
                        (token, owner, info_json, granted[0], acquired_at, expires),
                    )
            row = conn.execute(_SELECT_LEASE, (namespace, key)).fetchone()
            live = row is not None and row[5] > now
            if live and row[0] == token and not steal:
                # A release handed us the key before its datagram reached us.
                if waiter is not None:
                    waiter.seq = waiter.token = None
                return _outcome(True, key, row, now)
            if not steal:
                queued = waiter is not None and waiter.seq is not None
                if not (live or queued):  # is anybody queued? (rarely anybody, when free)
                    queued = conn.execute(_ANY_QUEUED, (namespace, key, now)).fetchone()[0]
                head = self._queue_head(conn, key, now) if queued and not live else None
                mine = waiter is not None and head is not None and head[0] == waiter.seq
                if live or (head is not None and not mine):
                    if waiter is not None:
                        self._enqueue(conn, waiter, (token, owner, info_json, ttl), now)
                    return _outcome(False, key, row, now)
            acquired_at, expires = time.time(), now + ttl
            (fence,) = conn.execute(
                _GRANT, (namespace, key, token, owner, info_json, acquired_at, expires)
            ).fetchone()
            return self._granted(
                conn, waiter, key, now, (token, owner, info_json, fence, acquired_at, expires)
            )

        if waiter is None:
            return self._write(step)
        # The step notes the waiter's place in the queue as it goes; a transaction that
        # rolls back must leave the note as it was.
        noted = waiter.seq, waiter.token
        try:
            return self._write(step)
        except BaseException:
            waiter.seq, waiter.token = noted
            raise

    def _granted(
        self,
        conn: sqlite3.Connection,
        waiter: _SqliteWaiter | None,
        key: str,
        now: float,
        lease: tuple[str, str, str | None, int, float, float],
    ) -> Outcome:
        """A grant to the caller just written (``lease``, as _SELECT_LEASE reads it)."""
        if waiter is not None:  # the trigger took our row out of the queue
            waiter.seq = None
            waiter.token = None
        self._grants += 1
        if self._grants % SWEEP_EVERY == 0:
            self._sweep(conn, now)
        return _outcome(True, key, lease, now)

    def _sweep(self, conn: sqlite3.Connection, now: float) -> None:
        """Delete expired leases and stale waiters, a bounded slice per call.

        Leases are visited by a rolling scan in key order (no index on expiry to keep
        up to date at every step): each call looks at the next SWEEP_BATCH rows, more
        than the grants between two calls, so the table never outgrows the live leases
        by much. The waiters table holds only current waiters and is swept whole.
        """
        rows = conn.execute(
            "SELECT namespace, key, expires FROM keymutex_leases"
            " WHERE (namespace, key) > (?, ?) ORDER BY namespace, key LIMIT ?",
            (*self._sweep_from, SWEEP_BATCH),
        ).fetchall()
        conn.executemany(
            "DELETE FROM keymutex_leases WHERE namespace = ? AND key = ? AND expires <= ?",
            [(namespace, key, now) for namespace, key, expires in rows if expires <= now],
        )
        self._sweep_from = (rows[-1][0], rows[-1][1]) if len(rows) == SWEEP_BATCH else ("", "")
        conn.execute("DELETE FROM keymutex_waiters WHERE expires <= ?", (now,))

    def renew(self, key: str, token: str, ttl: float) -> Outcome:
        return self.renew_many([RenewRequest(key, token, ttl)])[0]

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        namespace = self._namespace

        def step(conn: sqlite3.Connection, now: float) -> list[Outcome]:
            outcomes = []
            for request in requests:
                key = request.key
                row = conn.execute(
                    _RENEW, (now + request.ttl, namespace, key, request.token, now)
                ).fetchone()
                if row is not None:
                    outcomes.append(_outcome(True, key, row, now))
                else:
                    current = conn.execute(_SELECT_LEASE, (namespace, key)).fetchone()
                    outcomes.append(_outcome(False, key, current, now))
            return outcomes

        return self._write(step)

    def release(self, key: str, token: str) -> Outcome:
        namespace = self._namespace

        def step(conn: sqlite3.Connection, now: float) -> tuple[Outcome, _Handoff | None]:
            deleted = conn.execute(_RELEASE, (namespace, key, token, now)).fetchone()
            if deleted is None:
                row = conn.execute(_SELECT_LEASE, (namespace, key)).fetchone()
                return _outcome(False, key, row, now), None
            expires, first = deleted
            # A lease past its expiry was no longer ours: report it lost.
            handoff = None if first is None else self._hand_off(conn, key, now, first)
            return Outcome(expires > now), handoff

        with self._mutex:
            outcome, handoff = self._write_locked(step)
            try:
                self._deliver(handoff)
            except StoreError as exc:  # released all the same; a stray handoff expires
                _LOG.warning("after releasing %r, handing it on failed: %s", key, exc)
        return outcome

    def holder(self, key: str) -> Holder | None:
        def query(conn: sqlite3.Connection, now: float) -> Holder | None:
            row = conn.execute(_SELECT_LEASE, (self._namespace, key)).fetchone()
            return None if row is None or row[5] <= now else _holder(key, row, now)

        return self._read(query)

    def holders(self, prefix: str) -> list[Holder]:
        def query(conn: sqlite3.Connection, now: float) -> list[Holder]:
            rows = conn.execute(
                "SELECT key, token, owner, info, fence, acquired_at, expires FROM keymutex_leases"
                " WHERE namespace = ? AND key >= ? AND substr(key, 1, ?) = ? AND expires > ?"
                " ORDER BY key",
                (self._namespace, prefix, len(prefix), prefix, now),
            ).fetchall()
            return [_holder(row[0], row[1:], now) for row in rows]

        return self._read(query)

    def waiter(self, key: str) -> _SqliteWaiter:
        return _SqliteWaiter(self, key)

    def close(self) -> None:
        with self._mutex:
            self._conn.close()
            if self._sender is not None:
                self._sender.close()
            self._sockets.close()


def _path(url: str, encoded: str) -> str:
    """The file a URL's percent-encoded path names: UTF-8, no NUL, encodable by the OS."""
    try:
        path = unquote(encoded, errors="strict")
    except UnicodeDecodeError:
        raise ValueError(
            f"SQLite URL {redacted(url)!r}: the path's percent-escapes (such as %FF) must encode UTF-8"
        ) from None
    if "\x00" in path:
        raise ValueError(f"SQLite URL {redacted(url)!r}: the path must not contain NUL characters")
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        raise ValueError(
            f"SQLite URL {redacted(url)!r}: the path cannot be encoded for the file system"
            " (it contains a lone surrogate)"
        ) from None
    return path


def _options(url: str, options: Mapping[str, object]) -> tuple[str, str, float]:
    parts = split_url(url, "SQLite", "sqlite:///path/to/locks.db")
    if parts.netloc:
        raise ValueError(
            f"SQLite URLs have no host: use sqlite:///absolute/path.db or"
            f" sqlite:relative/path.db, not {redacted(url)!r}"
        )
    if parts.fragment:
        raise ValueError(
            f"SQLite URL {redacted(url)!r} has a fragment ('#{parts.fragment}'); a # in the"
            " file's name is written %23"
        )
    path = _path(url, parts.path)
    if not path or path == "/":
        raise ValueError(
            f"SQLite URL {redacted(url)!r} names no file: use sqlite:///path/to/locks.db"
        )
    if os.path.basename(path) == ":memory:":
        raise ValueError(
            f"SQLite URL {redacted(url)!r} names ':memory:', which this store would take for"
            " a file of that name: no other process or connection could share an in-memory"
            " database; use memory:// for locks within one process, or a file path"
        )
    merged: dict[str, object] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in merged:
            raise ValueError(
                f"SQLite URL {redacted(url)!r} gives the option {name!r} more than once"
            )
        merged[name] = value
    twice = sorted(set(merged) & set(options))
    if twice:
        raise ValueError(
            f"SQLite URL {redacted(url)!r}: option(s) {twice} given both in the URL and as"
            " arguments"
        )
    merged.update(options)
    synchronous = merged.pop("synchronous", "normal")
    if not isinstance(synchronous, str) or synchronous.lower() not in ("normal", "full"):
        raise ValueError(f"synchronous must be 'normal' or 'full', not {synchronous!r}")
    synchronous = synchronous.lower()  # as SQLite's PRAGMA takes it
    busy = seconds("SQLite", "busy_timeout", merged.pop("busy_timeout", 10.0))
    if merged:
        raise TypeError(
            f"unknown SQLite store option(s) {sorted(merged)}; accepted: synchronous, busy_timeout"
        )
    return path, str(synchronous), busy


def url_path(url: str) -> str:
    """The file a ``sqlite:`` URL names (``ValueError`` if the URL is not a valid one)."""
    return _options(url, {})[0]


class SqliteDriver:
    def open(self, url: str, *, namespace: str, options: Mapping[str, object]) -> SqliteStore:
        path, synchronous, busy_timeout = _options(url, options)
        return SqliteStore(path, namespace, synchronous=synchronous, busy_timeout=busy_timeout)

    def open_async(self, url: str, *, namespace: str, options: Mapping[str, object]) -> AsyncStore:
        store = self.open(url, namespace=namespace, options=options)
        attempt = store.attempt if store.synchronous == "normal" else None
        return ThreadedAsyncStore(store, inline=False, attempt=attempt)


driver = SqliteDriver()

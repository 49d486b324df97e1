"""``zookeeper[s]://[user:pw@]host:port[,…][/chroot]``: leases as ephemeral sequential nodes.

**Layout.** Under ``[/chroot]/keymutex`` each namespace has a node ``n<namespace>`` and
each key a node ``k<key>`` below it (both percent-encoded, so any key is one ASCII
path component). These are *container* nodes (ZooKeeper 3.5.3+): the server deletes
one once it has no children left (every ``znode.container.checkIntervalMs``, one minute
by default), so nothing piles up with the number of keys ever locked. A contender —
an acquire in progress, queued or granted — is one ephemeral sequential child of its
key's node, ``<digest>-<sequence>``, where ``<digest>`` is 128 bits of SHA-256 of its
token. The token itself is never written to ZooKeeper (whose nodes anyone allowed to
connect may read): the digest in the name is what proves ownership, and it lets a
client find its own node again from a listing alone (a create whose reply was lost,
a ``renew(key, token)`` from another process). Node data is compact JSON: state
(``h`` holding, ``w`` waiting), owner, info, acquired-at (wall clock, for display) and
the TTL in milliseconds.

**Who holds a key.** The contender with the lowest sequence, once it is in state
``h`` and its deadline has not passed. Nobody else is ever granted the key: a
newcomer's node always sorts behind every existing one, so the queue is strictly
first come, first served (``fair=True``), and no release can be missed (the node
exists before the newcomer looks). Each waiter watches only the node just ahead of it
(one data watch): a release wakes exactly one waiter, never a herd. A waiter
that finds itself first claims the key by rewriting its node to ``h``. A key handed
over like this to a waiter that does not claim it within ``HANDOVER_GRACE`` (as seen by
the next contender's clock) is taken from it: its process is gone or stuck. Nodes only
ever leave the part of the queue ahead of a node, so a waiter whose last listing showed
one node ahead of its own knows itself first once that node is deleted (its watch says
so, or a read finds it gone), and claims without listing again.

**Fences** are the creation zxid (``czxid``) of the holder's node. Zxids are assigned
by the leader in one total order, grow across leader elections (the epoch is their
high half) and are never reused, and the holder is always the oldest contender left:
every grant — first, after a release, after an expiry, a steal — gets a fence larger
than any before it on that key, for as long as the ensemble's data directories live
(``durable_fences=True``).

**Time and sessions.** A ZooKeeper ephemeral node lives as long as the session that
created it, not for a TTL. keymutex keeps a per-lease deadline on top:

- a lease's deadline is its node's ``mtime`` (set by the leader when the lease was
  granted or last renewed) plus its TTL, both by the *leader's* clock
  (``clock="server"``): no client's clock is trusted. A contender learns the leader's
  current time from its own writes (the ``mtime`` of its own node), and may delete an
  expired holder's node — with a version check, so that a renewal that got there
  first wins;
- a renewal rewrites the node (``setData`` with its version): a new ``mtime``; one
  that arrives after the deadline is undone and reported lost;
- a lease also ends when its session does: when the holder's ``Locks`` is closed
  (unlike other stores, closing *releases* its leases early — never late), when its
  process dies, or when it stays disconnected longer than the negotiated session
  timeout (option ``session_timeout``, 40 s by default; the server bounds it between
  its ``minSessionTimeout`` and ``maxSessionTimeout``, 2 and 20 ticks by default). The
  server cannot expire a session sooner than that timeout after it last heard of it,
  so every grant and renewal reports ``remaining = min(ttl, session timeout)``: the
  holder's local deadline always comes before the server could drop its node. While
  disconnected, renewals fail and the lease is marked lost at that deadline, before
  anyone else can be granted the key. Hence: a ``ttl`` longer than the session timeout
  only lasts the session timeout as far as its holder knows, and a lease renewed in
  the background (every ``ttl/3``) needs ``ttl < 3 × session timeout``.
- a ``renew(key, token)`` from another client moves the deadline but cannot keep the
  holder's *session* alive: only the holding client knows its session's state.

**Steps** (round trips). Uncontended acquire [2]: create the node already holding,
list the key's contenders, find it first. Release [1]: delete (by version). Renew [1]:
``setData`` by version. A refused try [3, pipelined to 2]: create, list, then read the
holder, set our node waiting and watch our predecessor at once (the holder's read sets
the watch when the holder is our predecessor). A woken waiter [2]: list, claim; one
that was second in line at its last listing [1]: claim, once the node ahead is deleted,
else read that node again (and watch it). ``renew(key, token)`` / ``release(key, token)``
from a client that did not grant the lease add a listing and a read. Writes go through
the leader; reads may be served by a follower a little behind, which can only make a key
look held longer.

**Security.** With credentials (``zookeeper://user:password@…``, or the options
``username``/``password``) the session authenticates with the ``digest`` scheme, and
the namespace's node and everything under it are created with an ACL that gives that
user every permission and nobody else any: other credentials get ``StoreError``
(``NoAuthError``) on that namespace, which is why every client of a namespace must use
the same credentials. The shared nodes above it (the chroot's, ``keymutex``) let anyone
list them and create in them, and no more (no ``setACL``). Without credentials,
everything is open (``OPEN_ACL_UNSAFE``), as ZooKeeper's own default. ``zookeepers://``
connects with TLS (the server's ``secureClientPort``): the server's certificate is
checked against ``ca_file`` (else the system's CAs) and the host name; ``cert_file``/
``key_file`` are shown when the server asks (``ssl.clientAuth``).

**Failures.** Every ZooKeeper error and every request that gets no reply within
``timeout`` (10 s by default) becomes ``StoreError``. A create whose reply was lost may
still have made its node: the client remembers the token digest and deletes such
orphans as soon as the connection is back (or the session's end removes them). A
client that never had a session fails its steps with ``NotSent``: it never created a
node, so its failed acquires leave nothing to give back. Watches
do not survive a reconnection: every waiter is woken to look again, and waiters look
again every second anyway. A connection attempt whose handshake gets no answer within a
third of ``timeout`` (at least 2 s) is given up and made again: kazoo waits up to the
whole session timeout, and a ZooKeeper that is starting can leave a connection it
accepted unanswered for good (its close fails while its database is not loaded), so
a client that reconnected at that moment stayed away 40 s from a server that was back.
kazoo's own log (each connection attempt that fails, every reconnection) goes to the
logger ``keymutex.zookeeper`` at DEBUG: what it warned of last is in the message of a
step that finds no connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote, unquote

from kazoo.client import KazooClient, KazooState  # type: ignore[import-untyped]
from kazoo.exceptions import (  # type: ignore[import-untyped]
    BadVersionError,
    ConnectionLoss,
    KazooException,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError  # type: ignore[import-untyped]
from kazoo.protocol.serialization import Create2  # type: ignore[import-untyped]
from kazoo.protocol.states import EventType  # type: ignore[import-untyped]
from kazoo.retry import KazooRetry  # type: ignore[import-untyped]
from kazoo.security import (  # type: ignore[import-untyped]
    OPEN_ACL_UNSAFE,
    make_acl,
    make_digest_acl,
)

from keymutex._errors import StoreError
from keymutex._lease import Holder, Outcome
from keymutex._store import (
    AsyncStore,
    Capabilities,
    NotSent,
    RenewRequest,
    ThreadedAsyncStore,
    translate_errors,
)
from keymutex.stores._doorbell import Doorbell
from keymutex.stores._settings import (
    TLS_OPTIONS,
    TlsFiles,
    digits,
    seconds,
    settings_of,
    tls_files,
)

__all__ = ["ZooKeeperStore", "driver"]

T = TypeVar("T")
_LOG = logging.getLogger("keymutex")

CAPABILITIES = Capabilities(
    notifies=True, fair=True, cross_process=True, durable_fences=True, clock="server"
)


class _KazooLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The logger a store gives its kazoo client: kazoo warns of every connection
    attempt that fails (a line each, many while a server is down), which the store
    reports itself as ``StoreError``; so its records go to ``keymutex.zookeeper`` at
    DEBUG, and the last warning is kept for that error's message."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("keymutex.zookeeper"), {})
        self.last_warning: str | None = None

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if level >= logging.WARNING:
            with contextlib.suppress(Exception):  # a message that does not format
                self.last_warning = str(msg) % args if args else str(msg)
        super().log(min(level, logging.DEBUG), msg, *args, **kwargs)


ROOT = "keymutex"
DEFAULT_PORT = 2181
# ZooKeeper's own default maxSessionTimeout (20 ticks of 2 s): the longest a default
# server grants, so that the default ttl (30 s) is never cut short by the session.
DEFAULT_SESSION_TIMEOUT = 40.0
DEFAULT_TIMEOUT = 10.0
# A connection's handshake is given up after a third of ``timeout``, never sooner than
# this (a loaded server may take a second or two to answer).
HANDSHAKE_TIMEOUT_FLOOR = 2.0
# A key handed over to a waiter (its node is first but still waiting) that has not
# claimed it after this long, by the clock of the contender that sees it, is taken
# from it. A live waiter claims within milliseconds (its watch fires), or within a
# second (its recheck) if the watch was lost with a connection.
HANDOVER_GRACE = 3.0
# Rounds of "look, delete an expired holder, look again" in one try before refusing.
ROUNDS = 8
# Granted leases whose node this client remembers (path and version), for one-round-
# trip renewals and releases; the oldest are forgotten beyond this (they still work,
# through a listing).
REMEMBERED_LEASES = 10_000
_DRIVER_ERRORS = (KazooException, KazooTimeoutError)
_SEQUENCE_DIGITS = 10  # ZooKeeper appends %010d
_HOLDING, _WAITING = "h", "w"


class _CreateContainer(Create2):  # type: ignore[misc]
    """``create2`` of a container node: kazoo has no option for it (opcode 19)."""

    type = 19


_CONTAINER_FLAG = 4
_SHARED_ACL = [make_acl("world", "anyone", read=True, create=True)]


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:32]


def _sequence(name: str) -> int:
    return int(name[-_SEQUENCE_DIGITS:])


def _contenders(names: Iterable[str]) -> list[str]:
    """Contender node names in queue order (foreign children are ignored)."""
    return sorted(
        (n for n in names if len(n) > _SEQUENCE_DIGITS + 1 and n[-_SEQUENCE_DIGITS:].isdigit()),
        key=_sequence,
    )


def _encode_data(state: str, owner: str, info: dict[str, Any] | None, ttl_ms: int) -> bytes:
    record = {"s": state, "o": owner, "i": info, "a": time.time(), "t": ttl_ms}
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()


def _ttl_ms(ttl: float) -> int:
    # Rounded up: the server's deadline is never earlier than the holder's.
    return max(1, math.ceil(ttl * 1000))


@dataclass(slots=True)
class _Node:
    """A contender node as last seen: its path, data version, creation zxid, and data."""

    path: str
    version: int
    czxid: int
    record: dict[str, Any]
    mtime: int
    session: int  # the session the node lives and dies with

    @property
    def name(self) -> str:
        return self.path.rpartition("/")[2]

    @property
    def deadline_ms(self) -> int:
        """The lease's deadline by the leader's clock (meaningful in state ``h``)."""
        return self.mtime + int(self.record.get("t", 0))


def _node(path: str, data: bytes, stat: Any) -> _Node:
    try:
        record = json.loads(data.decode()) if data else {}
    except ValueError:
        record = {}
    if not isinstance(record, dict):
        record = {}
    return _Node(
        path, int(stat.version), int(stat.czxid), record, int(stat.mtime), int(stat.ephemeralOwner)
    )


class _Ahead:
    """What a waiter's last listing told: only the node at ``path`` was ahead of its
    node ``mine`` (made in ``session``).

    Nodes only ever leave the part of a queue ahead of a node: a newcomer sorts behind
    every existing one (sequence numbers grow while the key's node has children, and ours
    is one). So once ``path`` is gone, ``mine`` is first, and no listing is needed to
    know it. ``gone`` is set when that is known: a ``NodeDeleted`` event of the watch set
    through this object (one object per listing), a read that finds the node missing,
    or our own delete of it. It only ever goes from false to true, set before the
    waiter is rung.
    """

    __slots__ = ("gone", "mine", "path", "session", "waiter")

    def __init__(self, waiter: _ZooKeeperWaiter, mine: _Node, path: str) -> None:
        self.waiter = waiter
        self.mine = mine.path
        self.session = mine.session
        self.path = path
        self.gone = False

    @property
    def name(self) -> str:
        return self.path.rpartition("/")[2]

    def watched(self, event: Any) -> None:
        """kazoo's watch callback on ``path``: deleted (so ours is first), or changed."""
        if event.type == EventType.DELETED:
            self.gone = True
        self.waiter.ring()


class _ZooKeeperWaiter(Doorbell):
    """A client waiting for a key: its contender node, once it has one.

    The node is the place in the queue. Rung by the watch on the node just ahead, and
    by every reconnection (watches do not survive one).
    """

    __slots__ = ("__weakref__", "ahead", "digest", "key", "node", "store", "unanswered")

    def __init__(self, store: ZooKeeperStore, key: str) -> None:
        super().__init__()
        self.store = store
        self.key = key
        self.node: _Node | None = None
        self.digest: str | None = None
        # Set while the last listing found the node one place from the front.
        self.ahead: _Ahead | None = None
        # Its last try failed for want of the server: leaving asks it nothing more.
        self.unanswered = False

    def _watched(self, event: object) -> None:
        """kazoo's watch callback: the node ahead of ours changed or went away."""
        self.ring()

    def close(self) -> None:
        self.store._leave(self)


class ZooKeeperStore:
    """The ``zookeeper://`` store for one namespace (one ZooKeeper session)."""

    capabilities = CAPABILITIES

    def __init__(
        self,
        client: Any,
        namespace: str,
        *,
        chroot: str,
        session_timeout: float,
        timeout: float,
        acl: Sequence[Any] = OPEN_ACL_UNSAFE,
    ) -> None:
        self._client = client
        self._acl = list(acl)
        self._root = f"{chroot}/{ROOT}"
        self._base = f"{self._root}/n{quote(namespace, safe='')}"
        self._timeout = timeout
        self._mutex = threading.Lock()
        # Until the server says otherwise, the session lasts what we asked for.
        self._session_timeout = session_timeout
        self._leases: dict[tuple[str, str], _Node] = {}
        self._orphans: set[tuple[str, str]] = set()  # (key node path, token digest)
        # One pass over the orphans at a time: an entry leaves the set once its nodes are
        # deleted, so a step that still finds its own entry waits for every pass that
        # copied it. Found by review: a pass started at a reconnect, slow, deleted the
        # node a retried acquire with the same token had just been granted (another
        # client was granted the key while its holder still held it).
        self._orphan_pass = threading.Lock()
        self._handovers: dict[tuple[str, int], float] = {}  # (path, mzxid) -> first seen
        self._waiters: weakref.WeakSet[_ZooKeeperWaiter] = weakref.WeakSet()
        # Taken to add to ``_waiters``, to take from it and to copy it: kazoo's thread
        # copies it at a reconnect while other threads add waiters, and a WeakSet
        # changed during its iteration raises RuntimeError (found by review: the
        # reconnect's rings were skipped, waiters left to their one-second recheck).
        self._waiters_mutex = threading.Lock()
        self._offset_ms = 0.0  # the leader's wall clock minus ours, from our last write
        self._closed = False
        self._learn_session_timeouts()
        # Set while kazoo is connected: cleared when the connection is suspended or the
        # session lost, set again when kazoo has reconnected. A step waits for it (up
        # to ``timeout``) rather than go into a connection kazoo is replacing.
        self._connected = threading.Event()
        self._had_session = False  # set for good at the first connection
        client.add_listener(self._on_state)
        # Connecting goes on in kazoo's thread; the first step waits for it.
        started = client.start_async()
        if started.is_set() and client.connected:  # connected before the listener saw it
            self._had_session = True
            self._connected.set()

    # -- the session ---------------------------------------------------------------

    def _learn_session_timeouts(self) -> None:
        """Record the session timeout the server grants at every (re)connection, and
        bound the handshake of each (see the module's Failures).

        kazoo does not keep the negotiated timeout anywhere; its connection's
        ``_connect`` returns the read timeout it derives from it (two thirds). A
        kazoo without that method leaves the requested timeout, with a warning.
        ``_connect`` waits (TCP connect, then the server's answer) through its
        handler's ``create_connection`` and ``select``: while it runs, on kazoo's
        connection thread, their timeouts are cut to ``_handshake_timeout``.
        """
        connection: Any = getattr(self._client, "_connection", None)
        connect = getattr(connection, "_connect", None)
        if connect is None:
            _LOG.warning(
                "this kazoo does not expose the negotiated session timeout; assuming %.1f s",
                self._session_timeout,
            )
            return
        handler = self._client.handler
        create_connection, select = handler.create_connection, handler.select
        limit = max(HANDSHAKE_TIMEOUT_FLOOR, self._timeout / 3)
        connecting = threading.local()

        def bounded_create_connection(*args: Any, **kwargs: Any) -> Any:
            if getattr(connecting, "now", False) and kwargs.get("timeout") is not None:
                kwargs["timeout"] = min(kwargs["timeout"], limit)
            return create_connection(*args, **kwargs)

        def bounded_select(*args: Any, **kwargs: Any) -> Any:
            if getattr(connecting, "now", False) and len(args) == 4 and args[3] is not None:
                args = (*args[:3], min(args[3], limit))
            return select(*args, **kwargs)

        def learning_connect(*args: Any) -> Any:
            connecting.now = True
            try:
                read_timeout, connect_timeout = connect(*args)
            finally:
                connecting.now = False
            self._session_timeout = read_timeout * 1.5 / 1000.0
            return read_timeout, connect_timeout

        handler.create_connection = bounded_create_connection
        handler.select = bounded_select
        connection._connect = learning_connect

    def _on_state(self, state: Any) -> None:
        """kazoo's connection thread: never block here."""
        if state == KazooState.CONNECTED:
            self._had_session = True  # before a step can see it connected
            self._connected.set()
            # Our watches died with the old connection: every waiter looks again.
            for waiter in self._every_waiter():
                waiter.ring()
            if self._orphans and not self._closed:
                self._client.handler.spawn(self._clean_orphans_quietly)
        elif state == KazooState.SUSPENDED:
            self._connected.clear()
        elif state == KazooState.LOST:
            self._connected.clear()
            # The session ended (or was closed): its nodes are gone, and so are our
            # queue places; waiters look again and queue anew, once kazoo has
            # reconnected (their steps wait for it: see _step).
            with self._mutex:
                self._leases.clear()
                self._orphans.clear()
            for waiter in self._every_waiter():
                waiter.ring()

    def _every_waiter(self) -> list[_ZooKeeperWaiter]:
        with self._waiters_mutex:
            return list(self._waiters)

    def _grant_cap(self, node: _Node, ttl: float) -> float:
        """What a grant or renewal may report as remaining.

        The node dies with its session, which the server cannot expire sooner than the
        negotiated timeout after the step's request reached it. Another client's
        session (a ``renew(key, token)`` from elsewhere) is not ours to know.
        """
        session = self._client.client_id
        if session is not None and node.session == session[0]:
            return min(ttl, self._session_timeout)
        return ttl

    # -- requests -------------------------------------------------------------------

    def _wait(self, result: Any) -> Any:
        """Wait for one kazoo request; no reply within the timeout is a ``StoreError``."""
        return result.get(timeout=self._timeout)

    def _write_seen(self, stat: Any, sent_wall: float) -> None:
        """Learn the leader's clock from a write: its ``mtime`` is within our round trip."""
        self._offset_ms = stat.mtime - (sent_wall + time.time()) * 500.0

    def _server_estimate_ms(self) -> float:
        """The leader's clock now, as well as our last write tells (for reads only)."""
        return time.time() * 1000.0 + self._offset_ms

    def _create_container(self, path: str) -> None:
        result = self._client.handler.async_result()
        # The namespace's nodes get the store's ACL; the ones above it (the chroot, the
        # root) are shared by every namespace: anyone may list them and create in them.
        mine = path == self._base or path.startswith(self._base + "/")
        acl = self._acl if mine or self._acl == OPEN_ACL_UNSAFE else _SHARED_ACL
        request = _CreateContainer(path, b"", acl, _CONTAINER_FLAG)
        self._client._call(request, result)
        with contextlib.suppress(NodeExistsError):
            self._wait(result)

    def _ensure_parents(self, path: str) -> None:
        """Create ``path`` and its missing ancestors, as container nodes."""
        missing = [path]
        while missing:
            try:
                self._create_container(missing[-1])
            except NoNodeError:
                parent = missing[-1].rpartition("/")[0]
                if not parent:
                    raise
                missing.append(parent)
                continue
            missing.pop()

    def _create(self, parent: str, digest: str, data: bytes) -> tuple[_Node, int]:
        """Create our contender node; (node, the leader's time of the create in ms)."""
        for _ in range(ROUNDS):
            sent_wall = time.time()
            try:
                path, stat = self._wait(
                    self._client.create_async(
                        f"{parent}/{digest}-",
                        data,
                        ephemeral=True,
                        sequence=True,
                        include_data=True,
                    )
                )
            except NoNodeError:
                # The key's node is missing, or the server just removed it as an
                # empty container: make it (again).
                self._ensure_parents(parent)
                continue
            except BaseException:
                # The create may have reached the server with its reply lost: find
                # the node by its digest later, and delete it.
                with self._mutex:
                    self._orphans.add((parent, digest))
                raise
            self._write_seen(stat, sent_wall)
            return _node(path, data, stat), int(stat.mtime)
        raise StoreError(f"ZooKeeper keeps removing {parent!r} while we create in it")

    def _children(self, parent: str) -> list[str] | None:
        """The contenders of a key in queue order; ``None`` if it has no node."""
        try:
            return _contenders(self._wait(self._client.get_children_async(parent)))
        except NoNodeError:
            return None

    def _read(self, path: str) -> _Node | None:
        try:
            data, stat = self._wait(self._client.get_async(path))
        except NoNodeError:
            return None
        return _node(path, data, stat)

    def _delete(self, path: str, version: int = -1) -> bool:
        """Delete a node; ``False`` if it was gone or changed meanwhile."""
        try:
            self._wait(self._client.delete_async(path, version))
        except (NoNodeError, BadVersionError):
            return False
        return True

    def _set(self, node: _Node, data: bytes) -> tuple[_Node, int] | None:
        """Rewrite our node if unchanged since we saw it; (node, leader's time), or None."""
        sent_wall = time.time()
        try:
            stat = self._wait(self._client.set_async(node.path, data, node.version))
        except (NoNodeError, BadVersionError):
            return None
        self._write_seen(stat, sent_wall)
        return _node(node.path, data, stat), int(stat.mtime)

    # -- decisions on what a listing and a read show ---------------------------------

    def _parent(self, key: str) -> str:
        return f"{self._base}/k{quote(key, safe='')}"

    def _holder(self, key: str, node: _Node) -> Holder:
        record = node.record
        return Holder(
            key=key,
            owner=str(record.get("o", "")),
            info=record.get("i"),
            fence=node.czxid,
            acquired_at=float(record.get("a", 0.0)),
            expires_at=(node.deadline_ms - self._offset_ms) / 1000.0,
        )

    def _live_holder(self, key: str, node: _Node | None) -> Holder | None:
        """``node`` as a Holder if it holds by our best estimate of the leader's clock."""
        if node is None or node.record.get("s") != _HOLDING:
            return None
        if node.deadline_ms <= self._server_estimate_ms():
            return None
        return self._holder(key, node)

    def _stale_handover(self, node: _Node) -> bool:
        """A waiting first node we have seen unclaimed for ``HANDOVER_GRACE`` seconds."""
        now = time.monotonic()
        seen = (node.path, node.mtime)
        with self._mutex:
            first = self._handovers.setdefault(seen, now)
            if len(self._handovers) > 1000:
                self._handovers = {
                    k: v for k, v in self._handovers.items() if now - v < 10 * HANDOVER_GRACE
                }
        return now - first >= HANDOVER_GRACE

    @contextlib.contextmanager
    def _step(self, what: str) -> Iterator[None]:
        """One step: connected (waiting up to ``timeout``), driver errors translated."""
        with translate_errors(*_DRIVER_ERRORS, what=f"ZooKeeper: {what}"):
            if not self._connected.is_set() and not self._connected.wait(self._timeout):
                last = getattr(self._client.logger, "last_warning", None)
                # kazoo only logs why it cannot connect: its connection-loss error,
                # with that warning, stands as the driver's exception (found by review:
                # this StoreError had no __cause__, unlike every other store's).
                # A client that never had a session never created a node: an acquire
                # that fails here was granted nothing (NotSent), wherever it was.
                error = StoreError if self._had_session else NotSent
                raise error(
                    f"ZooKeeper: {what}: not connected to {self._client.hosts!r}"
                    f" after {self._timeout:g} s" + (f" (kazoo: {last})" if last else "")
                ) from ConnectionLoss(last or f"not connected after {self._timeout:g} s")
            try:
                if self._orphans:  # nodes of creates whose reply was lost: delete them first
                    self._clean_orphans()
                yield
            except NoAuthError as exc:
                raise StoreError(
                    f"ZooKeeper: {what}: NoAuthError: the key's nodes are not ours to"
                    " touch (their ACL is for other credentials)"
                ) from exc

    # -- the steps --------------------------------------------------------------------

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
        assert waiter is None or isinstance(waiter, _ZooKeeperWaiter)
        what = f"acquiring {key!r}"
        if waiter is None:
            with self._step(what):
                return self._try_acquire(key, token, ttl, owner, info, steal, waiter)
        # A waiter's try whose connection is lost under it (kazoo replacing it, or its
        # session expiring: the waiter is rung then, and looks again at once) is made
        # again once kazoo has reconnected, within ``timeout``, instead of failing the
        # acquire while the server is there. A create whose reply was lost is found
        # and deleted by the next step, as always.
        give_up = time.monotonic() + self._timeout
        while True:
            try:
                with self._step(what):
                    outcome = self._try_acquire(key, token, ttl, owner, info, steal, waiter)
                waiter.unanswered = False
                return outcome
            except StoreError as exc:
                lost = isinstance(exc.__cause__, ConnectionLoss | SessionExpiredError)
                if not lost or time.monotonic() >= give_up or self._closed:
                    waiter.unanswered = True
                    raise
            # kazoo learns of the loss in its own thread: let it, before _step waits.
            time.sleep(0.05)

    def _try_acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: _ZooKeeperWaiter | None,
    ) -> Outcome:
        parent, digest, ttl_ms = self._parent(key), _digest(token), _ttl_ms(ttl)
        mine: _Node | None = None
        if waiter is not None and waiter.digest == digest:
            mine = waiter.node
        elif waiter is not None and waiter.node is not None:  # another token's place
            self._leave(waiter)
        # The leader's time, once one of our writes in this try has told it.
        server_now: int | None = None
        # True while our node holds the data of a grant made by this very try.
        fresh_grant = False
        try:
            for _ in range(ROUNDS):
                if mine is None:
                    holding = _encode_data(_HOLDING, owner, info, ttl_ms)
                    mine, server_now = self._create(parent, digest, holding)
                    fresh_grant = True
                    if waiter is not None:
                        waiter.node, waiter.digest = mine, digest
                # Second at our last listing (and set waiting since): only the node
                # ahead can have changed. Gone, ours is first (claimed below, by our
                # node's version: a node taken from us fails the claim); there, it is
                # read (and watched) again.
                ahead = None if steal or fresh_grant else self._ahead_of(waiter, mine)
                if ahead is not None:
                    queue, position = [ahead.name, mine.name], 0 if ahead.gone else 1
                else:
                    queue = self._children(parent) or []
                    if mine.name not in queue:
                        # Our node is gone: a steal, a handover we were too slow for, or
                        # the session's end. Queue again, at the back.
                        mine = None
                        continue
                    position = queue.index(mine.name)
                    if position > 0 and not steal and queue[0].startswith(digest + "-"):
                        held = self._held_already(key, token, f"{parent}/{queue[0]}", waiter)
                        if held is not None:
                            self._delete(mine.path)
                            mine = None
                            return held
                    if steal and position > 0:
                        self._take_over(parent, queue[:position])
                        position = 0
                    if waiter is not None:
                        waiter.ahead = ahead = (
                            _Ahead(waiter, mine, f"{parent}/{queue[0]}")
                            if position == 1 and not queue[0].startswith(digest + "-")
                            else None
                        )
                if position == 0:
                    if not fresh_grant:
                        claimed = self._set(mine, _encode_data(_HOLDING, owner, info, ttl_ms))
                        if claimed is None:  # taken from us meanwhile: queue again
                            mine = None
                            continue
                        mine, server_now = claimed
                    outcome = self._granted(key, token, mine, ttl, waiter)
                    mine = None  # the lease's now, not ours to clean up
                    return outcome
                refusal, mine, server_now, fresh_grant = self._refused(
                    key,
                    parent,
                    queue,
                    position,
                    mine,
                    server_now,
                    fresh_grant,
                    waiter,
                    owner,
                    ahead,
                )
                if waiter is not None:
                    waiter.node = mine
                if refusal is not None:
                    return refusal
            return Outcome(False, None)
        except BaseException:
            if waiter is None and mine is not None:
                with self._mutex:  # deleted once the connection allows
                    self._orphans.add((parent, digest))
                mine = None
            raise
        finally:
            if waiter is not None and mine is None:
                waiter.node = None
            elif waiter is None and mine is not None:
                # A try without a waiter does not stay in the queue.
                self._delete(mine.path)

    def _ahead_of(self, waiter: _ZooKeeperWaiter | None, mine: _Node) -> _Ahead | None:
        """The waiter's ``_Ahead``, if it is about ``mine`` in the session we have now
        (a node of an ended session is gone, whatever our last listing showed)."""
        ahead = waiter.ahead if waiter is not None else None
        session = self._client.client_id
        if ahead is None or ahead.mine != mine.path or session is None:
            return None
        return ahead if ahead.session == session[0] else None

    def _held_already(
        self, key: str, token: str, path: str, waiter: _ZooKeeperWaiter | None
    ) -> Outcome | None:
        """The lease the token's own node at ``path`` holds, as it stands (its fence,
        owner and info), or ``None`` if that node does not hold the key: a retried
        acquire whose first reply was lost (the lock server retries so)."""
        node = self._read(path)
        holder = self._live_holder(key, node)
        if node is None or holder is None:
            return None
        return self._granted(key, token, node, holder.expires_at - time.time(), waiter)

    def _take_over(self, parent: str, ahead: Sequence[str]) -> None:
        """Steal: delete every contender ahead of ours, the holder first."""
        results = [self._client.delete_async(f"{parent}/{name}") for name in ahead]
        for result in results:
            with contextlib.suppress(NoNodeError):
                self._wait(result)

    def _refused(
        self,
        key: str,
        parent: str,
        queue: list[str],
        position: int,
        mine: _Node,
        server_now: int | None,
        fresh_grant: bool,
        waiter: _ZooKeeperWaiter | None,
        owner: str,
        ahead: _Ahead | None = None,
    ) -> tuple[Outcome | None, _Node, int | None, bool]:
        """Someone is ahead of us: refuse, or clear an expired first contender away.

        ``ahead``: the waiter's ``_Ahead`` when ours is second (``position`` 1); its
        watch is the one set, and it learns here when the first node is gone.

        Returns (the outcome, or None to look again; our node; the leader's time; whether
        our node still carries a grant's data).
        """
        first_path = f"{parent}/{queue[0]}"
        # ``get``, not ``exists``, to watch: on a node already gone, ``exists`` would
        # leave a watch for its creation on the server until the session ends.
        if ahead is not None:
            # The node ahead of ours is the first: one read tells of it and watches it.
            first_result = self._client.get_async(first_path, watch=ahead.watched)
        else:
            first_result = self._client.get_async(first_path)
        state_result = watch_result = None
        sent_wall = time.time()
        waiting = _encode_data(_WAITING, owner, None, 0)
        if waiter is not None:
            if fresh_grant:
                # Our node was made holding (the uncontended case); as a waiter it
                # must not look like a holder when it comes first.
                state_result = self._client.set_async(mine.path, waiting, mine.version)
            if ahead is None:
                predecessor = f"{parent}/{queue[position - 1]}"
                watch_result = self._client.get_async(predecessor, watch=waiter._watched)
        try:
            data, stat = self._wait(first_result)
            first: _Node | None = _node(first_path, data, stat)
        except NoNodeError:
            first = None
            if ahead is not None:
                ahead.gone = True
        if state_result is not None:
            try:
                stat = self._wait(state_result)
            except (NoNodeError, BadVersionError):
                return None, mine, server_now, fresh_grant  # look again
            self._write_seen(stat, sent_wall)
            mine = _node(mine.path, waiting, stat)
            server_now, fresh_grant = int(stat.mtime), False
        if watch_result is not None:
            assert waiter is not None
            try:
                self._wait(watch_result)
            except NoNodeError:
                waiter.ring()  # gone before our watch was set: look again at once
        if first is None:
            return None, mine, server_now, fresh_grant
        if first.record.get("s") == _HOLDING:
            deadline = first.deadline_ms
            if server_now is None and deadline <= self._server_estimate_ms() + 50:
                # It looks expired: learn the leader's time exactly from a write of
                # our own before deciding anything.
                refreshed = self._set(mine, _encode_data(_WAITING, owner, None, 0))
                if refreshed is None:
                    return None, mine, server_now, fresh_grant
                mine, server_now = refreshed
                fresh_grant = False
            if server_now is not None and server_now >= deadline:
                # Expired by the leader's clock. The version check lets a renewal
                # that got there first win.
                if self._delete(first.path, first.version) and ahead is not None:
                    ahead.gone = True
                return None, mine, server_now, fresh_grant
            now = server_now if server_now is not None else self._server_estimate_ms()
            holder = self._holder(key, first)
            return (
                Outcome(False, holder, max(0.0, (deadline - now) / 1000.0)),
                mine,
                server_now,
                fresh_grant,
            )
        # The first contender waits to claim the key handed over to it.
        if self._stale_handover(first):
            if self._delete(first.path, first.version) and ahead is not None:
                ahead.gone = True
            return None, mine, server_now, fresh_grant
        return Outcome(False, None), mine, server_now, fresh_grant

    def _granted(
        self, key: str, token: str, node: _Node, ttl: float, waiter: _ZooKeeperWaiter | None
    ) -> Outcome:
        if waiter is not None:
            waiter.node = None  # the node is the lease now, not a place in the queue
            waiter.ahead = None
        with self._mutex:
            self._leases[(key, token)] = node
            if len(self._leases) > REMEMBERED_LEASES:
                del self._leases[next(iter(self._leases))]
        return Outcome(True, self._holder(key, node), self._grant_cap(node, ttl))

    def _find_lease(self, key: str, token: str) -> tuple[_Node | None, Holder | None]:
        """The node holding ``key`` for ``token``, else (None, the key's live holder)."""
        queue = self._children(self._parent(key))
        if not queue:
            return None, None
        first = self._read(f"{self._parent(key)}/{queue[0]}")
        if first is None:
            return None, None
        if first.name.startswith(_digest(token) + "-") and first.record.get("s") == _HOLDING:
            return first, None
        return None, self._live_holder(key, first)

    def _current_holder(self, key: str) -> Holder | None:
        queue = self._children(self._parent(key))
        if not queue:
            return None
        return self._live_holder(key, self._read(f"{self._parent(key)}/{queue[0]}"))

    def renew(self, key: str, token: str, ttl: float) -> Outcome:
        return self.renew_many([RenewRequest(key, token, ttl)])[0]

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        with self._step(f"renewing {len(requests)} lease(s)"):
            # Leases this client granted: one setData each, all sent at once.
            pending: list[tuple[int, _Node, bytes, Any, float]] = []
            outcomes: list[Outcome | None] = [None] * len(requests)
            for index, request in enumerate(requests):
                with self._mutex:
                    node = self._leases.get((request.key, request.token))
                if node is None:
                    continue
                data = self._renewed_data(node, request.ttl)
                pending.append(
                    (
                        index,
                        node,
                        data,
                        self._client.set_async(node.path, data, node.version),
                        time.time(),
                    )
                )
            for index, node, data, result, sent_wall in pending:
                request = requests[index]
                try:
                    stat = self._wait(result)
                except NoNodeError:
                    self._forget(request.key, request.token)
                    outcomes[index] = Outcome(False, self._current_holder(request.key))
                    continue
                except BadVersionError:  # renewed from elsewhere: look it up below
                    self._forget(request.key, request.token)
                    continue
                self._write_seen(stat, sent_wall)
                outcomes[index] = self._renewed(request, node, _node(node.path, data, stat))
            for index, request in enumerate(requests):
                if outcomes[index] is None:
                    outcomes[index] = self._renew_found(request)
            return [o for o in outcomes if o is not None]

    def _renewed_data(self, node: _Node, ttl: float) -> bytes:
        record = dict(node.record)
        record["t"] = _ttl_ms(ttl)
        return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()

    def _renewed(self, request: RenewRequest, before: _Node, after: _Node) -> Outcome:
        """A renewal landed: keep it, unless it came after the lease's deadline."""
        if after.mtime >= before.deadline_ms:
            # Expired before the renewal arrived (nobody had taken the key yet): undo,
            # so that the token no longer holds it.
            self._forget(request.key, request.token)
            self._delete(after.path, after.version)
            return Outcome(False, None)
        with self._mutex:
            self._leases[(request.key, request.token)] = after
        return Outcome(True, self._holder(request.key, after), self._grant_cap(after, request.ttl))

    def _renew_found(self, request: RenewRequest) -> Outcome:
        """Renew a lease this client does not know: find its node by the token's digest."""
        node, holder = self._find_lease(request.key, request.token)
        if node is None:
            return Outcome(False, holder)
        data = self._renewed_data(node, request.ttl)
        sent_wall = time.time()
        try:
            stat = self._wait(self._client.set_async(node.path, data, node.version))
        except (NoNodeError, BadVersionError):
            return Outcome(False, self._current_holder(request.key))
        self._write_seen(stat, sent_wall)
        return self._renewed(request, node, _node(node.path, data, stat))

    def _forget(self, key: str, token: str) -> None:
        with self._mutex:
            self._leases.pop((key, token), None)

    def release(self, key: str, token: str) -> Outcome:
        with self._step(f"releasing {key!r}"):
            with self._mutex:
                node = self._leases.pop((key, token), None)
            if node is not None:
                try:
                    self._wait(self._client.delete_async(node.path, node.version))
                except NoNodeError:
                    return Outcome(False, self._current_holder(key))
                except BadVersionError:  # renewed from elsewhere: look it up
                    node = None
            if node is None:
                node, holder = self._find_lease(key, token)
                if node is None:
                    return Outcome(False, holder)
                if not self._delete(node.path, node.version):
                    return Outcome(False, self._current_holder(key))
            # Released; a lease already past its deadline was no longer ours to release.
            return Outcome(node.deadline_ms > self._server_estimate_ms())

    def holder(self, key: str) -> Holder | None:
        with self._step(f"reading the holder of {key!r}"):
            return self._current_holder(key)

    def holders(self, prefix: str) -> list[Holder]:
        with self._step(f"listing holders under {prefix!r}"):
            try:
                names = self._wait(self._client.get_children_async(self._base))
            except NoNodeError:
                return []
            keys = sorted(
                key
                for key in (unquote(name[1:]) for name in names if name.startswith("k"))
                if key.startswith(prefix)
            )
            listings = [(key, self._client.get_children_async(self._parent(key))) for key in keys]
            reads: list[tuple[str, str, Any]] = []
            for key, result in listings:
                try:
                    queue = _contenders(self._wait(result))
                except NoNodeError:
                    continue
                if queue:
                    path = f"{self._parent(key)}/{queue[0]}"
                    reads.append((key, path, self._client.get_async(path)))
            found = []
            for key, path, result in reads:
                try:
                    data, stat = self._wait(result)
                except NoNodeError:
                    continue
                holder = self._live_holder(key, _node(path, data, stat))
                if holder is not None:
                    found.append(holder)
            return found

    # -- waiting ------------------------------------------------------------------------

    def waiter(self, key: str) -> _ZooKeeperWaiter:
        waiter = _ZooKeeperWaiter(self, key)
        with self._waiters_mutex:
            self._waiters.add(waiter)
        return waiter

    def _leave(self, waiter: _ZooKeeperWaiter) -> None:
        """Take the waiter's node out of the queue (a key handed to it passes on)."""
        node, waiter.node = waiter.node, None
        digest, waiter.digest = waiter.digest, None
        waiter.ahead = None
        with self._waiters_mutex:
            self._waiters.discard(waiter)
        # The server did not answer the waiter's last try, or is not connected: leaving
        # now would wait a whole ``timeout`` more for it. The node, if any, is left to
        # the next step or the reconnection (or goes with the session).
        unreachable = waiter.unanswered or not self._connected.is_set()
        if node is None:
            if self._orphans and not unreachable:  # a create may have lost its reply
                self._clean_orphans_quietly()
            return
        if unreachable:
            with self._mutex:
                self._orphans.add((self._parent(waiter.key), digest or node.name[:32]))
            return
        try:
            with self._step(f"leaving the queue of {waiter.key!r}"):
                self._delete(node.path)
        except StoreError as exc:
            # Found and deleted once the connection is back (or gone with the session).
            _LOG.warning("could not leave the queue of %r: %s", waiter.key, exc)
            with self._mutex:
                self._orphans.add((self._parent(waiter.key), digest or node.name[:32]))

    # -- orphans ------------------------------------------------------------------------

    def _clean_orphans(self) -> None:
        """Delete the nodes of creates whose reply was lost (see the module)."""
        with self._orphan_pass:
            with self._mutex:
                orphans = list(self._orphans)
            for parent, digest in orphans:
                for name in self._children(parent) or []:
                    if name.startswith(digest + "-"):
                        self._delete(f"{parent}/{name}")
                with self._mutex:
                    self._orphans.discard((parent, digest))

    def _clean_orphans_quietly(self) -> None:
        try:
            with self._step("deleting orphaned nodes"):
                pass  # the step itself deletes them
        except StoreError as exc:
            _LOG.warning("%s (will try again)", exc)

    def close(self) -> None:
        """End the session: ZooKeeper deletes its nodes, so its leases end now.

        Within ``timeout``: kazoo waits for the server's answer to the session's close
        up to its ping timeout (two thirds of the session timeout), on a server that
        does not answer. Past ``timeout`` it is left to finish on its own (a daemon
        thread, which frees the client's sockets then), and the server ends the session
        at its timeout.
        """
        self._closed = True
        failed: list[BaseException] = []

        def stop_then_close() -> None:
            try:
                try:
                    self._client.stop()
                finally:
                    self._client.close()
            except BaseException as exc:  # raised by close(), when it waited for it
                failed.append(exc)

        closing = threading.Thread(
            target=stop_then_close, name="keymutex-zookeeper-close", daemon=True
        )
        closing.start()
        closing.join(self._timeout)
        if closing.is_alive():
            _LOG.warning(
                "ZooKeeper did not answer the close of the session within %g s; it ends"
                " the session at its timeout",
                self._timeout,
            )
        elif failed:
            raise failed[0]


# -- URLs ---------------------------------------------------------------------------

# Options of ``Locks(url, **options)``; all but the credentials may be in the URL's
# query string instead (keymutex/stores/_settings.py).
OPTIONS = ("session_timeout", "timeout", *TLS_OPTIONS, "username", "password")
_FORM = "zookeeper[s]://[user:password@]host:port[,host:port…][/chroot][?option=…]"


@dataclass(frozen=True, slots=True)
class _Target:
    hosts: str
    chroot: str
    session_timeout: float
    timeout: float
    tls: TlsFiles | None = None  # zookeepers://: the files kazoo's TLS context loads
    credentials: tuple[str, str] | None = field(default=None, repr=False)


def _refused_in_paths(ch: str) -> bool:
    """Characters ZooKeeper refuses in a path (its PathUtils.validatePath): control
    characters, U+D800-U+F8FF (surrogates and private use), U+FFF0-U+FFFF."""
    code = ord(ch)
    return (
        code < 0x20 or 0x7F <= code <= 0x9F or 0xD800 <= code <= 0xF8FF or 0xFFF0 <= code <= 0xFFFF
    )


def parse(url: str, options: Mapping[str, object]) -> _Target:
    """``zookeeper[s]://[user:password@]host:port[,host:port…][/chroot]`` and the
    options, checked."""
    settings = settings_of(
        url,
        options,
        store="ZooKeeper",
        schemes=("zookeeper", "zookeepers"),
        form=_FORM,
        accepted=OPTIONS,
    )
    shown, parts = settings.shown, settings.parts
    hosts = []
    for part in settings.netloc.split(","):
        if part.startswith("["):  # an IPv6 address: [::1]:2181
            host, _, rest = part[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else "" if not rest else "x"
        else:
            host, _, port = part.partition(":")
        port = port or str(DEFAULT_PORT)
        if not host or not digits(port) or not 0 < int(port) < 65536:
            raise ValueError(
                f"{shown!r}: expected zookeeper://host:port[,host:port…][/chroot], got {part!r}"
            )
        hosts.append(f"[{host}]:{int(port)}" if ":" in host else f"{host}:{int(port)}")
    try:
        chroot = unquote(parts.path, errors="strict").rstrip("/")
    except UnicodeDecodeError:
        raise ValueError(f"{shown!r}: the chroot is not UTF-8 once %-decoded") from None
    components = chroot.split("/")[1:]
    if any(c in ("", ".", "..") for c in components) or any(
        _refused_in_paths(ch) for ch in chroot
    ):
        raise ValueError(f"{shown!r}: the chroot {chroot!r} is not a valid ZooKeeper path")
    options = settings.options
    return _Target(
        hosts=",".join(hosts),
        chroot=chroot,
        session_timeout=seconds(
            "ZooKeeper",
            "session_timeout",
            options.get("session_timeout", DEFAULT_SESSION_TIMEOUT),
        ),
        timeout=seconds("ZooKeeper", "timeout", options.get("timeout", DEFAULT_TIMEOUT)),
        tls=tls_files("ZooKeeper", options)[0] if settings.tls else None,
        credentials=settings.credentials,
    )


class ZooKeeperDriver:
    def open(self, url: str, *, namespace: str, options: Mapping[str, object]) -> ZooKeeperStore:
        target = parse(url, options)
        # Reconnect quickly and forever: the session outlives short outages, and every
        # request is bounded by ``timeout`` anyway.
        retry = KazooRetry(max_tries=-1, delay=0.05, backoff=2, max_delay=1.0)
        security: dict[str, Any] = {}
        acl = OPEN_ACL_UNSAFE
        if target.credentials is not None:
            # Digest authentication; what we create is for this user alone.
            user, password = target.credentials
            security["auth_data"] = [("digest", f"{user}:{password}")]
            acl = [make_digest_acl(user, password, all=True)]
        if target.tls is not None:
            security.update(
                use_ssl=True,
                verify_certs=True,
                check_hostname=True,
                ca=target.tls.ca_file,
                certfile=target.tls.cert_file,
                keyfile=target.tls.key_file or target.tls.cert_file,
            )
        client = KazooClient(
            hosts=target.hosts,
            timeout=target.session_timeout,
            connection_retry=retry,
            command_retry=KazooRetry(max_tries=0),
            default_acl=acl,
            logger=_KazooLog(),
            **security,
        )
        return ZooKeeperStore(
            client,
            namespace,
            chroot=target.chroot,
            session_timeout=target.session_timeout,
            timeout=target.timeout,
            acl=acl,
        )

    def open_async(self, url: str, *, namespace: str, options: Mapping[str, object]) -> AsyncStore:
        # kazoo is built on threads: each step runs in a worker thread; waiting parks
        # on the waiter's doorbell without holding one.
        return ThreadedAsyncStore(
            self.open(url, namespace=namespace, options=options), inline=False
        )


driver = ZooKeeperDriver()

"""``memcached://host:port[,host:port…]``: leases in memcached — efficiency locks only.

**What memcached cannot promise.** memcached is a cache. It may evict a lease item
under memory pressure, and it forgets every item when it restarts; either way the key
looks free and a second client can take it while the first still believes it holds
it. Use these locks to keep work from being done twice *most of the time* (an edit
lock in a CMS, a cache-stampede guard, a periodic job), never where two holders at
once would corrupt data: for that, pick a store that keeps what it is told (SQLite,
Redis with AOF, PostgreSQL, etcd, ZooKeeper) and check fences at the resource.

**Items.** Every item name is ASCII and short, derived by SHA-256, so any key and
namespace fit memcached's 250-byte limit and ``("a", "b:c")`` never meets ``("a:b", "c")``:

- ``km1:l:<digest of namespace and key>``: the lease, one compact JSON record (key,
  token, owner, info, fence, acquired-at, expires-at, and the queue of waiters when
  there is one). The record is the truth; the item's own exptime is only garbage
  collection, set to ``ceil(ttl) + 1`` seconds so that memcached (1-second
  granularity) never drops a live lease early.
- a released lease becomes a *tombstone* by ``cas``: ``["T", fence]``, exptime 1 s;
  with waiters queued, ``["T", fence, queue, heir, kept-until]``, exptime
  ``QUEUED_TOMBSTONE_SECONDS`` (see *Waiting*). Never ``delete``: between our ``gets``
  and a ``delete``, our lease could expire and another client take the key, and the
  delete would remove *its* lock. Records without waiters are, byte for byte, those
  of earlier versions; a client of an earlier version takes one with a queue for a
  foreign item (``StoreError``): mixed versions on a contended key fail, never with
  two holders.
- per namespace and server: a fence counter ``km1:f:…`` and index buckets ``km1:i:…``,
  placed on the same server as the leases they serve (see *Several servers*).

**Steps** (round trips in brackets). Acquire [1 when refused, 2 when a refused
waiter writes its place, 4 when granted, plus a compaction every ``COMPACT_EVERY``
grants]: ``gets``; a live lease of someone else, or a tombstone that keeps the key
for another waiter, refuses at once (and a waiter whose place is missing or due for
a refresh ``cas``-es it into the record it read); else ``incr`` a fence and ``add``
(no item) or ``cas`` over the tombstone or expired lease (or the live one, when
stealing), the grantee's place taken out of the queue in that same write; then
``append`` the lease to the index. A lost race (``add`` found an item, ``cas`` found
it changed or gone) starts again from a fresh ``gets``, at most ``RACE_ATTEMPTS``
times; after that the caller is refused as if the key were held. Renew [2]:
``gets``, compare the token, ``cas`` the new expiry and exptime (the queue kept as
it is). Release [2]: ``gets``, compare the token, ``cas`` to a tombstone. A waiter
giving up [2, none once granted]: ``gets``, ``cas`` without its place. Renew and
release retry a lost race too (a renewer and a manual renewal of one lease, or a
waiter writing its place), then raise ``StoreError``.
``renew_many`` reads all its leases with one ``gets`` per server. A step's first
command is a read; on a pooled connection that died (memcached restarted, or dropped
an idle client) the pool is emptied and that read sent once more, never a write.

**Time.** memcached has no clock a client can read cheaply and precisely, so a lease's
expiry is recorded in wall-clock UNIX seconds of the client that grants or renews it,
and judged by the wall clock of whoever reads it (``clock="client-wall"``). The
clients' clocks must agree (NTP): a client whose clock runs ahead by *s* seconds sees
leases expire *s* seconds early and may take a key from a live holder; one that runs
behind waits longer than needed. A wall-clock step (a manual change, an NTP step)
moves every lease by the step. Keep TTLs large against the skew of your hosts.

**Fences.** Each server's counter for a namespace (``incr``) is created on first use,
and again after eviction or a restart, with the current wall clock in microseconds; a
grant also takes a fence above the one recorded in the item it replaces. So fences
keep increasing across a restart of memcached as long as the clients' clocks are
right and fewer than a million grants a second were made — but nothing in memcached
guarantees it, hence ``durable_fences=False``: a wall clock stepped backwards, or a
server that was unreachable and comes back with its old counter, can hand out a
fence smaller than one granted before.

**Listing (``holders``).** memcached cannot list keys. Each grant appends its lease's
digest to one of ``INDEX_BUCKETS`` index items per server and namespace (``append`` is
atomic, so no retry loop); ``holders(prefix)`` reads the buckets and then the leases
they name, and keeps the live ones. Released and expired entries are dropped by a
compaction (``gets`` + ``cas``) of one bucket every ``COMPACT_EVERY`` grants. The
listing is best effort, like memcached itself: an evicted index bucket, or a client
that died between its grant and its ``append``, leaves a live lease out of it.
``holder(key)`` is always exact.

**Several servers.** A key's items live on one server, chosen by rendezvous hashing
(pymemcache's ``RendezvousHash``), and its counter and index bucket live on that same
server, so a dead server stops only its own keys (``StoreError``) and takes its
fences with it. Unlike pymemcache's ``HashClient``, a dead server is never taken out
of the ring: moving its keys to another server would let a second client take a key
that is still held on the first. Every client must list the same servers.

**Waiting.** memcached cannot notify (``notifies=False``), so waiters poll; but they
queue, so that a releaser cannot take the key straight back while others wait.

- A refused waiter writes its *place* (a random id, and the wall-clock time it was
  last refused) at the end of the key's queue, with the ``cas`` of the very record
  whose ``gets`` refused it, and rewrites it at most every ``REFRESH_SECONDS`` as it
  polls. A place not rewritten for ``GONE_SECONDS`` is a waiter that is gone (its
  process died, or stalled): every write of the record drops it. At most
  ``QUEUE_LIMIT`` places; a waiter beyond them polls without one.
- A release leaves a tombstone that keeps the key for the first waiter still there,
  its *heir*, for ``HANDOVER_SECONDS`` (longer than any waiter's poll interval):
  only the heir, by its id, can take it; the releaser and newcomers are refused with
  no holder and the hand-over's time left. The grant takes the heir's place out of
  the queue in its own ``cas``. When the hand-over time runs out (the heir is gone or
  stalled), the key is free for anyone; the heir keeps its place.
- A waiter that gives up (``close``) takes its place out; if the key was kept for it,
  it is kept for the next waiter still there, for a whole hand-over time.
- Nothing wakes the heir: each waiter polls ``POLL_FIRST`` after it saw the key
  change hands, then ``POLL_GROWTH`` times longer each time, at most ``POLL_LIMIT``
  × (1 + the waiters before it), and never longer than the client's backoff step.
  So the first in line finds a released key within about half of the last hold
  (``POLL_LIMIT`` at most), for a few ``gets`` per waiter and handoff.
- What is not promised (``fair=False``): a key freed by expiry, or whose hand-over
  time ran out, goes to whoever tries first; a client joins the queue only from its
  second try (the client passes no waiter to the first one of a polling store);
  and places and hand-overs are timed by the clients' wall clocks, so clocks that
  disagree by a good part of ``HANDOVER_SECONDS`` degrade the hand-over towards first
  come, first served. None of this touches safety: a waiter's write is a ``cas`` of
  the record it read, so it changes only the queue and never undoes a renewal, a
  release or a grant made in between; the token is checked and fences drawn as
  before.

**Async.** ``AsyncLocks`` runs these same steps in worker threads
(``ThreadedAsyncStore``): one implementation for both, several servers, and the
pooled pymemcache client. aiomcache would save the threads but has no multi-server
support, and the two implementations would have to be kept in step by hand.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import math
import os
import secrets
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from pymemcache.client.base import PooledClient  # type: ignore[import-untyped]
from pymemcache.client.rendezvous import RendezvousHash  # type: ignore[import-untyped]
from pymemcache.exceptions import (  # type: ignore[import-untyped]
    MemcacheError,
    MemcacheServerError,
    MemcacheUnexpectedCloseError,
)

from keymutex._errors import StoreError
from keymutex._lease import Holder, Outcome
from keymutex._store import (
    AsyncStore,
    Capabilities,
    RenewRequest,
    ThreadedAsyncStore,
    translate_errors,
)

__all__ = ["MemcachedStore", "Place", "QueuedWaiter", "Record", "Tombstone", "decode", "driver"]

_LOG = logging.getLogger("keymutex")

CAPABILITIES = Capabilities(
    notifies=False, fair=False, cross_process=True, durable_fences=False, clock="client-wall"
)
DEFAULT_PORT = 11211
DEFAULT_SOCKET_TIMEOUT = 5.0
# How many times a step starts again after losing a race to another client's write.
RACE_ATTEMPTS = 8
# A tombstone only has to outlive the race it closes; memcached rounds to the second.
TOMBSTONE_SECONDS = 1
# Waiting (see *Waiting* above). A release keeps the key this long for the first queued
# waiter: longer than any waiter's poll interval (at most ``Backoff``'s 0.25 s).
HANDOVER_SECONDS = 0.5
# A queued waiter rewrites its place at most this often as it polls; a place not
# rewritten for ``GONE_SECONDS`` belongs to a waiter that is gone, and is skipped.
REFRESH_SECONDS = 0.5
GONE_SECONDS = 2.0
QUEUE_LIMIT = 32  # places per key; a waiter beyond them polls without a place
# A tombstone that carries a queue lives as long as a place in it can.
QUEUED_TOMBSTONE_SECONDS = math.ceil(GONE_SECONDS) + 1
# A queued waiter looks again POLL_FIRST after it saw the key change hands, then each
# time POLL_GROWTH times later, at most POLL_LIMIT × (1 + its place in the queue).
POLL_FIRST = 0.001
POLL_GROWTH = 1.5
POLL_LIMIT = 0.05
_WAITER_ID_BYTES = 9  # 12 characters: a waiter's id only has to be unique per key
# memcached reads an exptime above 30 days as an absolute UNIX time (by the server's
# clock); longer leases get 0 ("no expiry": only eviction or a release removes them).
MAX_RELATIVE_EXPTIME = 30 * 24 * 3600
INDEX_BUCKETS = 16
COMPACT_EVERY = 16  # grants on a server (by its fence counter) between two compactions
READ_BATCH = 1000  # items per multi-get
_PREFIX = "km1"
_DRIVER_ERRORS = (MemcacheError, OSError)


def fence_seed() -> int:
    """The value a new fence counter starts from: wall-clock microseconds."""
    return time.time_ns() // 1000


# -- records: what an item holds (pure) ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Place:
    """A waiter's place in a key's queue: its id, and when it last said it still waits.

    ``seen`` is in wall-clock UNIX seconds of the waiter's host.
    """

    waiter: str
    seen: float

    def encode(self) -> list[object]:
        return [self.waiter, round(self.seen, 3)]


@dataclass(frozen=True, slots=True)
class Record:
    """A lease as stored: ``acquired_at`` and ``expires_at`` are wall-clock UNIX seconds.

    ``queue``: the places of the waiters refused while it holds, in arrival order.
    """

    key: str
    token: str
    owner: str
    info: dict[str, Any] | None
    fence: int
    acquired_at: float
    expires_at: float
    queue: tuple[Place, ...] = ()

    def encode(self) -> bytes:
        fields: list[object] = [
            "L",
            self.key,
            self.token,
            self.owner,
            self.info,
            self.fence,
            self.acquired_at,
            self.expires_at,
        ]
        if self.queue:  # an uncontended lease is the same 8 fields as ever
            fields.append([place.encode() for place in self.queue])
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()

    def holder(self) -> Holder:
        return Holder(
            key=self.key,
            owner=self.owner,
            info=self.info,
            fence=self.fence,
            acquired_at=self.acquired_at,
            expires_at=self.expires_at,
        )


@dataclass(frozen=True, slots=True)
class Tombstone:
    """What a released lease leaves for a moment: its fence, and no token.

    With waiters queued, it keeps their queue, and the key for ``heir`` (the first of
    them still there at the release) until ``kept_until`` (wall-clock UNIX seconds).
    """

    fence: int
    queue: tuple[Place, ...] = ()
    heir: str | None = None
    kept_until: float = 0.0

    def encode(self) -> bytes:
        fields: list[object] = ["T", self.fence]
        if self.queue or self.heir is not None:
            queue = [place.encode() for place in self.queue]
            fields += [queue, self.heir, round(self.kept_until, 3)]
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(value)
    return float(value)


def _places(value: object) -> tuple[Place, ...]:
    if not isinstance(value, list):
        raise TypeError(value)
    places = []
    for waiter, seen in value:
        if not isinstance(waiter, str):
            raise TypeError(waiter)
        places.append(Place(waiter, _number(seen)))
    return tuple(places)


def decode(raw: bytes, name: str = "") -> Record | Tombstone:
    """The record an item holds; ``StoreError`` when it is not one of ours."""
    try:
        fields = json.loads(raw)
        if fields[0] == "T" and type(fields[1]) is int:
            if len(fields) == 2:
                return Tombstone(fields[1])
            _, fence, queue, heir, kept_until = fields
            if heir is None or isinstance(heir, str):
                return Tombstone(fence, _places(queue), heir, _number(kept_until))
        tag, key, token, owner, info, fence, acquired_at, expires_at, *rest = fields
        if (
            tag == "L"
            and isinstance(key, str)
            and isinstance(token, str)
            and isinstance(owner, str)
            and (info is None or isinstance(info, dict))
            and type(fence) is int
            and len(rest) <= 1
        ):
            queue = _places(rest[0]) if rest else ()
            return Record(
                key, token, owner, info, fence, _number(acquired_at), _number(expires_at), queue
            )
    except (ValueError, TypeError, IndexError, KeyError):
        pass
    raise StoreError(f"memcached item {name!r} does not hold a keymutex lease: {raw[:80]!r}")


def live(record: Record | Tombstone | None, now: float) -> Record | None:
    """``record`` if it is a lease that has not expired at ``now``."""
    if isinstance(record, Record) and record.expires_at > now:
        return record
    return None


def exptime(seconds: float) -> int:
    """The item exptime for a lease with ``seconds`` left: never shorter than the lease."""
    whole = math.ceil(seconds) + 1
    return 0 if whole > MAX_RELATIVE_EXPTIME else whole


def outcome(ok: bool, record: Record | None, now: float) -> Outcome:
    if record is None or record.expires_at <= now:
        return Outcome(ok)
    return Outcome(ok, record.holder(), record.expires_at - now)


def granted(record: Record, now: float) -> Outcome:
    """A grant or renewal that set ``record`` at ``now``: all its TTL, however short.

    The client counts the TTL from before it sent the request, so the lease never
    lasts longer on its side than here, even when a tiny TTL ran out in transit.
    """
    return Outcome(True, record.holder(), record.expires_at - now)


# -- the queue: who a freed key is kept for (pure) -------------------------------------


def present(queue: tuple[Place, ...], now: float) -> tuple[Place, ...]:
    """The places of ``queue`` whose waiters are still there (seen within ``GONE_SECONDS``)."""
    return tuple(place for place in queue if now - place.seen < GONE_SECONDS)


def position(queue: tuple[Place, ...], waiter: str, now: float) -> int:
    """How many waiters still there stand before ``waiter`` (all of them if it has no place)."""
    places = present(queue, now)
    for index, place in enumerate(places):
        if place.waiter == waiter:
            return index
    return len(places)


def rejoined(queue: tuple[Place, ...], waiter: str, now: float) -> tuple[Place, ...] | None:
    """The queue to write so that ``waiter`` keeps its place; ``None``: nothing to write.

    Its place is refreshed where it stands, or added at the end, and places of waiters
    that are gone are dropped. Nothing is written while its place was refreshed less
    than ``REFRESH_SECONDS`` ago, nor when the queue is full without it.
    """
    places = present(queue, now)
    for index, place in enumerate(places):
        if place.waiter == waiter:
            if now - place.seen < REFRESH_SECONDS:
                return None
            return (*places[:index], Place(waiter, now), *places[index + 1 :])
    if len(places) >= QUEUE_LIMIT:
        return None
    return (*places, Place(waiter, now))


def kept_for(item: Record | Tombstone | None, now: float) -> str | None:
    """The waiter a released key is kept for at ``now``, if any."""
    if isinstance(item, Tombstone) and item.heir is not None and now < item.kept_until:
        return item.heir
    return None


def handed_over(fence: int, queue: tuple[Place, ...], now: float) -> Tombstone:
    """What a release (or the heir giving up) leaves: the key kept for the first waiter still there."""
    places = present(queue, now) if queue else ()
    if not places:
        return Tombstone(fence)
    return Tombstone(fence, places, places[0].waiter, now + HANDOVER_SECONDS)


def item_exptime(item: Record | Tombstone, now: float) -> int:
    """The exptime to write ``item`` with: never shorter than its lease or its queue."""
    if isinstance(item, Record):
        return exptime(max(0.0, item.expires_at - now))
    return QUEUED_TOMBSTONE_SECONDS if item.queue else TOMBSTONE_SECONDS


def _digest(*parts: str) -> str:
    """An unambiguous digest of ``parts`` (each length-prefixed), URL-safe base64."""
    hasher = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        hasher.update(len(data).to_bytes(8, "big"))
        hasher.update(data)
    return base64.urlsafe_b64encode(hasher.digest()).rstrip(b"=").decode("ascii")


# -- where items live -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Shard:
    """One server's share of a namespace: its fence counter and index buckets."""

    server: str
    counter: str
    buckets: tuple[str, ...]


class Layout:
    """Item names of one namespace, and which server holds each (rendezvous hashing).

    Counter and index buckets are named so that they hash to the server they serve:
    ``km1:f:<ns>:<n>`` with the first ``n`` that lands on it.
    """

    def __init__(self, namespace: str, servers: Sequence[str]) -> None:
        self._namespace = namespace
        self._hasher = RendezvousHash(nodes=list(servers))
        self.servers = tuple(servers)
        space = _digest(namespace)
        self.shards = {
            server: _Shard(
                server,
                self._landing(f"{_PREFIX}:f:{space}", server, 0),
                tuple(
                    self._landing(f"{_PREFIX}:i:{space}:{bucket}", server, 0)
                    for bucket in range(INDEX_BUCKETS)
                ),
            )
            for server in servers
        }

    def _landing(self, stem: str, server: str, start: int) -> str:
        for n in range(start, start + 100_000):
            name = f"{stem}:{n}"
            if self.server_of(name) == server:
                return name
        raise AssertionError(f"no item name of {stem!r} hashes to {server!r}")  # pragma: no cover

    def server_of(self, name: str) -> str:
        if len(self.servers) == 1:
            return self.servers[0]
        return str(self._hasher.get_node(name))

    def lease(self, key: str) -> str:
        return f"{_PREFIX}:l:{_digest(self._namespace, key)}"

    def shard_of(self, lease: str) -> _Shard:
        return self.shards[self.server_of(lease)]

    @staticmethod
    def bucket_of(shard: _Shard, lease: str) -> str:
        return shard.buckets[hashlib.sha256(lease.encode()).digest()[0] % INDEX_BUCKETS]

    @staticmethod
    def index_entry(lease: str) -> bytes:
        return lease.rpartition(":")[2].encode("ascii") + b" "

    @staticmethod
    def index_leases(raw: bytes | None) -> list[str]:
        """The lease item names an index bucket lists, each once, in first-seen order."""
        if not raw:
            return []
        digests = dict.fromkeys(raw.decode("ascii").split())
        return [f"{_PREFIX}:l:{digest}" for digest in digests]


# -- the store ---------------------------------------------------------------------


class QueuedWaiter:
    """One client waiting for one key: its place in the key's queue, and its polling.

    memcached cannot notify, so the waiter polls: ``POLL_FIRST`` after it saw the key
    change hands (a grant, a release kept for another waiter), then each time
    ``POLL_GROWTH`` times later, up to ``POLL_LIMIT`` × (1 + its place): the first in
    line finds the key kept for it within half the time the last holder held it (and
    at most ``POLL_LIMIT``), those behind it look less often. ``wait`` never parks
    longer than the client asked. ``close`` leaves the queue (passing on the key if it
    was kept for this waiter); a waiter that was granted the key has left it already.
    """

    __slots__ = ("_limit", "_seen", "_step", "_store", "id", "key", "queued")

    def __init__(self, store: MemcachedStore, key: str) -> None:
        self.id = secrets.token_urlsafe(_WAITER_ID_BYTES)
        self.key = key
        self.queued = False  # it may have a place in the key's queue
        self._store = store
        self._seen: tuple[int, bool] | None = None  # the last state of the key it saw
        self._step = POLL_FIRST
        self._limit = POLL_LIMIT

    def saw(self, state: tuple[int, bool], place: int) -> None:
        """After a refusal: the key's state (fence, held) and how many stand before us."""
        if state != self._seen:
            self._seen = state
            self._step = POLL_FIRST
        self._limit = POLL_LIMIT * (1 + place)

    def park(self, timeout: float) -> float:
        """How long the next wait lasts: the polling step, at most ``timeout``."""
        step = self._step
        self._step = min(step * POLL_GROWTH, self._limit)
        return max(0.0, min(timeout, step))

    def wait(self, timeout: float) -> bool:
        time.sleep(self.park(timeout))
        return False

    async def wait_async(self, timeout: float) -> bool:
        await asyncio.sleep(self.park(timeout))
        return False

    def close(self) -> None:
        if self.queued:
            self.queued = False
            self._store._leave(self.key, self.id)


_STORES: weakref.WeakSet[MemcachedStore] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for store in list(_STORES):
        store._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_after_fork)


class MemcachedStore:
    """The ``memcached://`` store for one namespace (see the module for the guarantees)."""

    capabilities = CAPABILITIES

    def __init__(
        self, servers: Sequence[str], namespace: str, make_client: Callable[[str], Any]
    ) -> None:
        self._layout = Layout(namespace, servers)
        self._make_client = make_client
        self._clients = {server: make_client(server) for server in servers}
        _STORES.add(self)

    def _after_fork_in_child(self) -> None:
        # The parent's pooled sockets must not be shared: new pools (the old ones are
        # dropped unclosed, since another thread may have held a pool's lock at fork).
        self._clients = {server: self._make_client(server) for server in self._layout.servers}

    def _client(self, shard: _Shard) -> Any:
        return self._clients[shard.server]

    def _first_read(self, shard: _Shard, command: str, argument: Any) -> Any:
        """A step's first command (always a read), sent again once on a dead connection.

        Pooled connections die silently when memcached restarts or drops idle clients;
        the first use then fails. The pool is emptied and the read sent once more on a
        new connection: harmless for a read, and the step's writes come after it.
        A timeout is not retried (the server is there, but slow).
        """
        try:
            return getattr(self._client(shard), command)(argument)
        except TimeoutError:
            raise
        except (MemcacheUnexpectedCloseError, OSError):
            self._client(shard).close()
            return getattr(self._client(shard), command)(argument)

    # -- fences and the index ------------------------------------------------------

    def _next_fence(self, shard: _Shard, above: int) -> int:
        """A fence from the shard's counter, and above ``above`` (the replaced item's)."""
        client = self._client(shard)
        fence = client.incr(shard.counter, 1, noreply=False)
        if fence is None:  # first use, eviction or restart: start again from the clock
            seed = max(fence_seed(), above)
            client.add(shard.counter, str(seed).encode(), expire=0, noreply=False)
            fence = client.incr(shard.counter, 1, noreply=False)
        if fence is not None and int(fence) <= above:
            # The counter was lost and recreated behind this key's last fence: catch up.
            fence = client.incr(shard.counter, above - int(fence) + 1, noreply=False)
        if fence is None:
            raise StoreError(f"the fence counter {shard.counter!r} vanished as it was used")
        return int(fence)

    def _index(self, shard: _Shard, lease: str, fence: int) -> None:
        """List a granted lease for ``holders``; best effort, never fails the grant."""
        client, bucket = self._client(shard), Layout.bucket_of(shard, lease)
        entry = Layout.index_entry(lease)
        try:
            if fence % COMPACT_EVERY == 0:
                self._compact(shard, bucket)
            for _ in range(RACE_ATTEMPTS):
                try:
                    if client.append(bucket, entry, noreply=False):
                        return
                except MemcacheServerError:  # the bucket outgrew the item size limit
                    self._compact(shard, bucket)
                    continue
                if client.add(bucket, entry, expire=0, noreply=False):
                    return
            _LOG.warning("memcached: could not list %s in %s for holders()", lease, bucket)
        except (*_DRIVER_ERRORS, StoreError) as exc:
            _LOG.warning("memcached: listing %s for holders() failed: %s", lease, exc)

    def _compact(self, shard: _Shard, bucket: str) -> None:
        """Rewrite ``bucket`` with only its live leases (if nobody appended meanwhile)."""
        client = self._client(shard)
        raw, cas = client.gets(bucket)
        if raw is None:
            return
        names = Layout.index_leases(raw)
        now = time.time()
        keep = [
            name
            for name, record in self._read(shard, names).items()
            if live(record, now) is not None
        ]
        rewritten = b"".join(Layout.index_entry(name) for name in keep)
        client.cas(bucket, rewritten, cas, expire=0, noreply=False)

    def _read(self, shard: _Shard, names: Sequence[str]) -> dict[str, Record | Tombstone]:
        client = self._client(shard)
        found: dict[str, Record | Tombstone] = {}
        for start in range(0, len(names), READ_BATCH):
            batch = names[start : start + READ_BATCH]
            for name, raw in client.get_many(batch).items():
                found[name] = decode(raw, name)
        return found

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
        name = self._layout.lease(key)
        shard = self._layout.shard_of(name)
        client = self._client(shard)
        queued = waiter if isinstance(waiter, QueuedWaiter) and waiter.key == key else None
        me = None if queued is None else queued.id
        with translate_errors(*_DRIVER_ERRORS, what=f"memcached acquire of {key!r}"):
            for attempt in range(RACE_ATTEMPTS):
                raw, cas = client.gets(name) if attempt else self._first_read(shard, "gets", name)
                now = time.time()
                current = None if raw is None else decode(raw, name)
                holder = live(current, now)
                heir = kept_for(current, now)
                if current is not None and not steal:
                    if holder is not None:
                        if holder.token == token:
                            return outcome(True, holder, now)
                        refused = outcome(False, holder, now)
                    elif isinstance(current, Tombstone) and heir is not None and heir != me:
                        refused = Outcome(False, None, current.kept_until - now)
                    else:
                        refused = None
                    if refused is not None:
                        if queued is None:
                            return refused
                        # Refused: take (or keep) our place in the queue, in this same
                        # gets/cas, so that the next release keeps the key for us.
                        places = rejoined(current.queue, queued.id, now)
                        state = (current.fence, holder is not None)
                        if places is None:
                            queued.saw(state, position(current.queue, queued.id, now))
                            return refused
                        queued.queued = True
                        waiting = replace(current, queue=places)
                        expire = item_exptime(waiting, now)
                        if client.cas(name, waiting.encode(), cas, expire=expire, noreply=False):
                            queued.saw(state, position(places, queued.id, now))
                            return refused
                        continue  # renewed, released or joined meanwhile: look again
                fence = self._next_fence(shard, 0 if current is None else current.fence)
                queue = () if current is None else current.queue
                now = time.time()
                # A grant takes its waiter out of the queue, and the gone ones with it.
                places = tuple(p for p in present(queue, now) if p.waiter != me) if queue else ()
                record = Record(key, token, owner, info, fence, now, now + ttl, places)
                if raw is None:
                    stored = client.add(name, record.encode(), expire=exptime(ttl), noreply=False)
                else:
                    stored = client.cas(
                        name, record.encode(), cas, expire=exptime(ttl), noreply=False
                    )
                if stored:
                    if queued is not None:
                        queued.queued = False
                    self._index(shard, name, fence)
                    return granted(record, now)
            # Every try lost a race: others keep writing this key, so it is not ours.
            raw = client.get(name)
            now = time.time()
            return outcome(False, live(None if raw is None else decode(raw, name), now), now)

    def renew(self, key: str, token: str, ttl: float) -> Outcome:
        return self.renew_many([RenewRequest(key, token, ttl)])[0]

    def _renew(self, shard: _Shard, name: str, request: RenewRequest, item: Any) -> Outcome:
        """Renew from a ``gets`` reply already in hand (``item``), then from fresh ones."""
        client = self._client(shard)
        for attempt in range(RACE_ATTEMPTS):
            if attempt:
                item = client.gets(name)
            raw, cas = item
            now = time.time()
            current = live(None if raw is None else decode(raw, name), now)
            if current is None or current.token != request.token:
                return outcome(False, current, now)
            renewed = replace(current, expires_at=now + request.ttl)
            expire = exptime(request.ttl)
            if client.cas(name, renewed.encode(), cas, expire=expire, noreply=False):
                return granted(renewed, now)
        raise StoreError(f"memcached renewal of {request.key!r} lost {RACE_ATTEMPTS} races")

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        names = [self._layout.lease(request.key) for request in requests]
        by_server: dict[str, list[int]] = {}
        for index, name in enumerate(names):
            by_server.setdefault(self._layout.server_of(name), []).append(index)
        outcomes: list[Outcome | None] = [None] * len(requests)
        for server, indices in by_server.items():
            shard = self._layout.shards[server]
            with translate_errors(*_DRIVER_ERRORS, what=f"memcached renewal on {server}"):
                unique = list(dict.fromkeys(names[i] for i in indices))
                items = self._first_read(shard, "gets_many", unique)
                for index in indices:
                    item = items.get(names[index], (None, None))
                    outcomes[index] = self._renew(shard, names[index], requests[index], item)
        return [found for found in outcomes if found is not None]

    def release(self, key: str, token: str) -> Outcome:
        name = self._layout.lease(key)
        shard = self._layout.shard_of(name)
        client = self._client(shard)
        with translate_errors(*_DRIVER_ERRORS, what=f"memcached release of {key!r}"):
            for attempt in range(RACE_ATTEMPTS):
                raw, cas = client.gets(name) if attempt else self._first_read(shard, "gets", name)
                now = time.time()
                current = None if raw is None else decode(raw, name)
                if not isinstance(current, Record) or current.token != token:
                    return outcome(False, live(current, now), now)
                # The key is kept for the first queued waiter still there, if any.
                tombstone = handed_over(current.fence, current.queue, now)
                expire = item_exptime(tombstone, now)
                if client.cas(name, tombstone.encode(), cas, expire=expire, noreply=False):
                    # A lease past its expiry was no longer ours to release: report it lost.
                    return Outcome(current.expires_at > now)
        raise StoreError(f"memcached release of {key!r} lost {RACE_ATTEMPTS} races")

    def _leave(self, key: str, waiter: str) -> None:
        """Take ``waiter``'s place out of ``key``'s queue [2]; best effort, never raises.

        If the key was kept for it, it is kept for the next waiter still there (for a
        full ``HANDOVER_SECONDS``), or freed. A place that cannot be removed (memcached
        unreachable) lapses ``GONE_SECONDS`` after it was last refreshed.
        """
        name = self._layout.lease(key)
        shard = self._layout.shard_of(name)
        client = self._client(shard)
        try:
            with translate_errors(
                *_DRIVER_ERRORS, what=f"memcached: leaving the queue of {key!r}"
            ):
                for attempt in range(RACE_ATTEMPTS):
                    raw, cas = (
                        client.gets(name) if attempt else self._first_read(shard, "gets", name)
                    )
                    if raw is None:
                        return
                    current = decode(raw, name)
                    now = time.time()
                    kept = kept_for(current, now) == waiter
                    if not kept and all(place.waiter != waiter for place in current.queue):
                        return
                    places = tuple(place for place in current.queue if place.waiter != waiter)
                    rest: Record | Tombstone
                    if isinstance(current, Record):
                        rest = replace(current, queue=places)
                    elif kept:
                        rest = handed_over(current.fence, places, now)
                    elif places:
                        rest = replace(current, queue=places)
                    else:
                        rest = Tombstone(current.fence)
                    expire = item_exptime(rest, now)
                    if client.cas(name, rest.encode(), cas, expire=expire, noreply=False):
                        return
                _LOG.warning("memcached: a waiter could not leave the queue of %r", key)
        except StoreError as exc:
            _LOG.warning("%s", exc)

    def holder(self, key: str) -> Holder | None:
        name = self._layout.lease(key)
        with translate_errors(*_DRIVER_ERRORS, what=f"memcached read of {key!r}"):
            raw = self._first_read(self._layout.shard_of(name), "get", name)
        record = live(None if raw is None else decode(raw, name), time.time())
        return None if record is None else record.holder()

    def holders(self, prefix: str) -> list[Holder]:
        found: dict[str, Holder] = {}
        for server, shard in self._layout.shards.items():
            with translate_errors(*_DRIVER_ERRORS, what=f"memcached listing on {server}"):
                buckets = self._first_read(shard, "get_many", list(shard.buckets))
                names = list(
                    dict.fromkeys(
                        name for bucket in buckets.values() for name in Layout.index_leases(bucket)
                    )
                )
                records = self._read(shard, names)
            now = time.time()
            for record in records.values():
                current = live(record, now)
                if current is not None and current.key.startswith(prefix):
                    found[current.key] = current.holder()
        return [found[key] for key in sorted(found)]

    def waiter(self, key: str) -> QueuedWaiter:
        return QueuedWaiter(self, key)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()


# -- URLs ----------------------------------------------------------------------------

# Options a user may pass as ``Locks(url, **options)``; named as the Redis store names them.
OPTIONS = frozenset({"socket_timeout", "socket_connect_timeout", "max_connections"})


@dataclass(frozen=True, slots=True)
class Target:
    """What a URL names: the servers (``host:port`` or a socket path) and client options."""

    servers: tuple[str, ...]
    socket_timeout: float
    socket_connect_timeout: float
    max_connections: int | None


def _seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be seconds (a number > 0), not {value!r}")
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be seconds > 0, not {value!r}")
    return float(value)


def _server(part: str, url: str) -> str:
    host, colon, port = part.rpartition(":")
    if not colon or host.endswith(":") or (part.startswith("[") and part.endswith("]")):
        host, port = part, str(DEFAULT_PORT)  # no port: an IPv4 name or a bracketed IPv6
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{url!r}: expected memcached://host[:port][,host[:port]…], got {part!r}")
    if not host.startswith("[") and ":" in host:
        raise ValueError(f"{url!r}: write an IPv6 address in brackets, e.g. [::1]:11211")
    return f"{host}:{int(port)}"


def parse(url: str, options: Mapping[str, object]) -> Target:
    """Check a ``memcached://`` URL and the store options; the servers to use."""
    unknown = set(options) - OPTIONS
    if unknown:
        raise TypeError(
            f"unknown memcached store options {sorted(unknown)}; accepted: {sorted(OPTIONS)}"
        )
    parts = urlsplit(url)
    if parts.scheme.lower() != "memcached":
        raise ValueError(f"{url!r} is not a memcached:// URL")
    if parts.query or parts.fragment:
        raise ValueError(
            f"{url!r}: memcached URLs take no query; pass options as keyword arguments,"
            " e.g. Locks(url, socket_timeout=2.0)"
        )
    if "@" in parts.netloc:
        raise ValueError(
            f"{url!r}: memcached's text protocol has no authentication; remove the user name"
        )
    if parts.netloc:
        if parts.path not in ("", "/"):
            raise ValueError(f"{url!r}: memcached has no databases; remove the path")
        servers = tuple(_server(part, url) for part in parts.netloc.split(","))
    elif parts.path not in ("", "/"):
        servers = (parts.path,)  # memcached:///run/memcached.sock: a Unix socket
    else:
        raise ValueError(f"{url!r} names no server: use memcached://host:port")
    if len(set(servers)) != len(servers):
        raise ValueError(f"{url!r} names a server twice")
    pool = options.get("max_connections")
    if pool is not None and (isinstance(pool, bool) or not isinstance(pool, int) or pool < 1):
        raise ValueError(f"max_connections must be an int >= 1 or None, not {pool!r}")
    return Target(
        servers,
        _seconds(options.get("socket_timeout", DEFAULT_SOCKET_TIMEOUT), "socket_timeout"),
        _seconds(
            options.get("socket_connect_timeout", DEFAULT_SOCKET_TIMEOUT),
            "socket_connect_timeout",
        ),
        pool,
    )


def _client_maker(target: Target) -> Callable[[str], Any]:
    def make(server: str) -> Any:
        spec: Any = server if server.startswith("/") else _address(server)
        return PooledClient(
            spec,
            connect_timeout=target.socket_connect_timeout,
            timeout=target.socket_timeout,
            no_delay=True,
            max_pool_size=target.max_connections,
            default_noreply=False,
        )

    return make


def _address(server: str) -> tuple[str, int]:
    host, _, port = server.rpartition(":")
    return host.strip("[]"), int(port)


class MemcachedDriver:
    def open(self, url: str, *, namespace: str, options: Mapping[str, object]) -> MemcachedStore:
        target = parse(url, options)
        return MemcachedStore(target.servers, namespace, _client_maker(target))

    def open_async(self, url: str, *, namespace: str, options: Mapping[str, object]) -> AsyncStore:
        return ThreadedAsyncStore(
            self.open(url, namespace=namespace, options=options), inline=False
        )


driver = MemcachedDriver()

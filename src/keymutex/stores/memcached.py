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
  token, owner, info, fence, acquired-at, expires-at). The record is the truth; the
  item's own exptime is only garbage collection, set to ``ceil(ttl) + 1`` seconds so
  that memcached (1-second granularity) never drops a live lease early.
- a released lease becomes a *tombstone* (``["T", fence]``, exptime 1 s) by ``cas``.
  Never ``delete``: between our ``gets`` and a ``delete``, our lease could expire and
  another client take the key, and the delete would remove *its* lock.
- per namespace and server: a fence counter ``km1:f:…`` and index buckets ``km1:i:…``,
  placed on the same server as the leases they serve (see *Several servers*).

**Steps** (round trips in brackets). Acquire [1 when refused, 4 when granted, plus a
compaction every ``COMPACT_EVERY`` grants]: ``gets``;
a live lease of someone else refuses at once with its holder; else ``incr`` a fence
and ``add`` (no item) or ``cas`` over the tombstone or expired lease (or the live one,
when stealing); then ``append`` the lease to the index. A lost race (``add`` found an
item, ``cas`` found it changed or gone) starts again from a fresh ``gets``, at most
``RACE_ATTEMPTS`` times; after that the caller is refused as if the key were held.
Renew [2]: ``gets``, compare the token, ``cas`` the new expiry and exptime. Release
[2]: ``gets``, compare the token, ``cas`` to a tombstone. Renew and release retry a
lost race too (a renewer and a manual renewal of one lease), then raise ``StoreError``.
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

**Waiting.** memcached cannot notify: waiters poll with jittered backoff
(``notifies=False``) and wake at the holder's recorded expiry. Nothing is queued, so
waiters are not served in order (``fair=False``).

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

__all__ = ["MemcachedStore", "Record", "Tombstone", "decode", "driver"]

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
class Record:
    """A lease as stored: ``acquired_at`` and ``expires_at`` are wall-clock UNIX seconds."""

    key: str
    token: str
    owner: str
    info: dict[str, Any] | None
    fence: int
    acquired_at: float
    expires_at: float

    def encode(self) -> bytes:
        fields = [
            "L",
            self.key,
            self.token,
            self.owner,
            self.info,
            self.fence,
            self.acquired_at,
            self.expires_at,
        ]
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
    """What a released lease leaves for a moment: its fence, and no token."""

    fence: int

    def encode(self) -> bytes:
        return json.dumps(["T", self.fence], separators=(",", ":")).encode()


def decode(raw: bytes, name: str = "") -> Record | Tombstone:
    """The record an item holds; ``StoreError`` when it is not one of ours."""
    try:
        fields = json.loads(raw)
        if fields[0] == "T" and len(fields) == 2 and type(fields[1]) is int:
            return Tombstone(fields[1])
        tag, key, token, owner, info, fence, acquired_at, expires_at = fields
        if (
            tag == "L"
            and isinstance(key, str)
            and isinstance(token, str)
            and isinstance(owner, str)
            and (info is None or isinstance(info, dict))
            and type(fence) is int
            and all(isinstance(t, int | float) for t in (acquired_at, expires_at))
        ):
            return Record(key, token, owner, info, fence, float(acquired_at), float(expires_at))
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


class _PollingWaiter:
    """memcached cannot notify: a waiter just sleeps its backoff step."""

    __slots__ = ()

    def wait(self, timeout: float) -> bool:
        time.sleep(timeout)
        return False

    async def wait_async(self, timeout: float) -> bool:
        await asyncio.sleep(timeout)
        return False

    def close(self) -> None:
        """Nothing to leave: nothing is queued."""


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
        with translate_errors(*_DRIVER_ERRORS, what=f"memcached acquire of {key!r}"):
            for attempt in range(RACE_ATTEMPTS):
                raw, cas = client.gets(name) if attempt else self._first_read(shard, "gets", name)
                now = time.time()
                current = None if raw is None else decode(raw, name)
                holder = live(current, now)
                if holder is not None and not steal:
                    return outcome(holder.token == token, holder, now)
                fence = self._next_fence(shard, 0 if current is None else current.fence)
                now = time.time()
                record = Record(key, token, owner, info, fence, now, now + ttl)
                if raw is None:
                    stored = client.add(name, record.encode(), expire=exptime(ttl), noreply=False)
                else:
                    stored = client.cas(
                        name, record.encode(), cas, expire=exptime(ttl), noreply=False
                    )
                if stored:
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
                tombstone = Tombstone(current.fence).encode()
                if client.cas(name, tombstone, cas, expire=TOMBSTONE_SECONDS, noreply=False):
                    # A lease past its expiry was no longer ours to release: report it lost.
                    return Outcome(current.expires_at > now)
        raise StoreError(f"memcached release of {key!r} lost {RACE_ATTEMPTS} races")

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

    def waiter(self, key: str) -> _PollingWaiter:
        return _PollingWaiter()

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

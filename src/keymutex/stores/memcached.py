"""``memcached://host:port[,host:port…]``: leases in memcached — efficiency locks only.

**What memcached cannot promise.** memcached is a cache. It may evict a lease item
under memory pressure, and it forgets every item when it restarts; either way the key
looks free and a second client can take it while the first still believes it holds
it. Use these locks to keep work from being done twice *most of the time* (an edit
lock in a CMS, a cache-stampede guard, a periodic job), never where two holders at
once would corrupt data: for that, pick a store that keeps what it is told (SQLite,
Redis with AOF, PostgreSQL, etcd, ZooKeeper) and check fences at the resource.

**Protocol.** The store speaks memcached's *meta* commands (``mg``, ``ms``, ``md``,
``mn``; memcached 1.6 and later, see ``protocol.txt``) over its own small pool of
sockets, so that several commands go in one write and their replies come back in one
read: a step costs the round trips listed below, not one per command. pymemcache is
used only for its rendezvous hash.

**Items.** Every item name is ASCII and short, derived by SHA-256, so any key and
namespace fit memcached's 250-byte limit and ``("a", "b:c")`` never meets ``("a:b", "c")``:

- ``km2:l:<digest of namespace and key>``: the lease, one compact JSON record (key,
  token, owner, info, fence, acquired-at, expires-at, and the queue of waiters when
  there is one). The record is the truth; the item's own exptime is only garbage
  collection, set to ``ceil(ttl) + EXPTIME_MARGIN`` seconds so that memcached never
  drops a live lease early (see ``exptime``).
- a released lease is deleted by compare-and-delete (``md <item> C<cas>``), or, when
  waiters are queued, replaced by compare-and-swap with a *tombstone* that keeps the
  key for the first of them (see *Waiting*).
- ``km2:epoch``, one per server: the wall-clock microseconds at which a client first
  found it missing (see *Fences*).
- per namespace and server: index buckets ``km2:i:…`` for ``holders`` (see *Listing*).

The format changed with the prefix (``km1`` → ``km2``): clients of earlier versions
use other items, so mixing versions on one key gives two holders. Upgrade every client
of a namespace at once.

**Compare-and-swap, and why a delete is safe here.** memcached gives every item a CAS
value on every write, from one counter per server (``get_cas_id()`` in ``items.c``,
taken in ``do_item_link()`` whenever an item is stored; no flag this store sends sets
it). A write with ``C<cas>`` takes effect only if the item still has that CAS, checked
and applied under the item's lock. Every write of a lease item other than the first
``add`` is such a write, made with the CAS of a read (or of our own last write) whose
record carried our token; so is the release's delete (``md … C<cas>``): it deletes the
item only if nobody wrote it since, so it can never remove a lease that replaced ours
(a plain ``get``, compare, ``delete`` can, when our lease expires in between). This is
the guarantee the earlier tombstone-by-``cas`` gave, in one command.

**Steps** (round trips in brackets).

- Acquire [1 when the key is free, or held]: ``ms <item> … c ME`` (``add``, returning
  the new CAS), with the ``append`` to the index and an ``mg`` of the item in the same
  write (a grant ignores what the read found). Not stored: decide from that read: our
  own lease (the same token) is granted again; a live lease of someone else, or a
  tombstone that keeps the key for another waiter, refuses; a tombstone or an expired
  lease is replaced by ``ms … C<cas> c`` [+1] (the grantee's place taken out of the
  queue in that same write), as is a live lease when stealing; an item gone meanwhile
  is ``add``-ed again. A waiter's later tries, and a try at a
  key that refused this store while the lease (or hand-over) that refused it lasts,
  send the ``add`` and the ``mg`` in one write [1], and no ``append`` (a grant then
  appends [+1]). A lost race starts again from a fresh ``mg``, at most
  ``RACE_ATTEMPTS`` times; after that the caller is refused as if the key were held.
- Release [1 when nothing wrote the item since our grant or renewal]: ``md <item>
  C<cas>`` with the CAS of our own last write, which the store keeps for each lease it
  granted or renewed (with the server's epoch: a CAS is only compared on the server
  that issued it). Otherwise (a waiter wrote its place, another client renewed, a
  ``release(key, token)`` from a client that did not grant it): ``mg``, compare the
  token, then ``md … C<cas>``, or ``ms … C<cas>`` to a tombstone when waiters are
  queued [2]. An expired lease that is still there is removed all the same, and
  reported lost.
- Renew [1 likewise]: ``ms … C<cas> c`` of the record we last wrote with the new expiry;
  otherwise ``mg``, compare the token, ``ms … C<cas> c`` [2]. ``renew_many`` sends the
  renewals of one server in one write, every server's at once (a thread each), and
  waits a third of the shortest TTL at most: a server that has not answered by then
  fails its share, and holds up nobody else's.
- A waiter writing or refreshing its place [+1], or giving up [2]: ``mg``, ``ms …
  C<cas>`` (or ``md … C<cas>`` when nothing is left to keep).

A step runs on one connection. Before a pooled connection is used it is checked for a
close from the server (memcached restarted, or dropped an idle client: the socket reads
as closed); such a connection is dropped and a new one made, so that no write goes down
a dead socket. A step that starts with a read and fails on a reused connection is sent
once more on a new one, never a step that started with a write.

**Time.** memcached has no clock a client can read cheaply and precisely, so a lease's
expiry is recorded in wall-clock UNIX seconds of the client that grants or renews it,
and judged by the wall clock of whoever reads it (``clock="client-wall"``). The
clients' clocks must agree (NTP): a client whose clock runs ahead by *s* seconds sees
leases expire *s* seconds early and may take a key from a live holder; one that runs
behind waits longer than needed. A wall-clock step (a manual change, an NTP step)
moves every lease by the step. Keep TTLs large against the skew of your hosts. A
waiter's write of its place never shortens the item: it keeps at least the time the
item had left (``mg … t``), whatever the waiter's clock says.

**Fences: the server's epoch plus the grant's CAS.** A lease's fence is ``epoch +
CAS`` of the write that granted it, so the grant costs no counter round trip. Within a
run of memcached the CAS counter only grows, and every grant is a new write, so a key's
fences strictly increase across releases, expiries and steals. The write that grants
cannot contain its own CAS, so the record of a new lease names only the epoch (as its
connection read it) and the item's CAS completes it; every later write of that record
(renewal, a waiter's place) is a compare-and-swap after a read, and writes the fence
in. A lease's fence never changes during its life, and every reader sees the same
one. The epoch (``km2:epoch``) is read once per connection; a client that finds it
missing (a new or restarted server) writes the current wall clock in microseconds
with ``add``. A restart resets the CAS counter and forgets the
epoch; the new epoch is later by the time between the two, so fences keep increasing
across a restart as long as the clients' clocks are right and the server made fewer
than a million writes a second on average (all of its writes: other users of the same
memcached count). Nothing in memcached guarantees that, hence ``durable_fences=False``:
fences may go backwards after a restart (a clock stepped back, a busier server), and
also if ``km2:epoch`` is evicted while clients still use the old one.

**Listing (``holders``).** memcached cannot list keys. Each acquire appends its lease's
digest to one of ``INDEX_BUCKETS`` index items per server and namespace, in the same
write as its ``add`` (``append`` is atomic, and memcached runs it after the ``add``, so
a compaction never drops it), or after the write that granted; ``holders(prefix)``
reads the buckets and then the leases they name, and keeps the live ones. A refused
``add`` leaves an entry too, but only once per store while the key stays held (later
tries send none, see *Steps*): polling a held key does not grow its bucket. Released,
expired, refused and repeated entries are dropped by a compaction (``mg`` + ``ms …
C<cas>``) of a bucket at every ``COMPACT_EVERY``-th grant of a store (counted from a
random place, so that short-lived clients compact too), and whenever a grant's entry
does not fit: memcached refuses an ``append`` that would take an item past its size
limit (1 MB by default), with ``NS``. The listing is best effort, like memcached
itself: an evicted index bucket leaves a live lease out of it, and so would a bucket
full of live leases (some 24,000 per bucket). ``holder(key)`` is always exact.

**Several servers.** A key's items live on one server, chosen by rendezvous hashing
(pymemcache's ``RendezvousHash``), and its index bucket lives on that same server, so
a dead server stops only its own keys (``StoreError``). Unlike pymemcache's
``HashClient``, a dead server is never taken out of the ring: moving its keys to
another server would let a second client take a key that is still held on the first.
Every client must list the same servers.

**Waiting: bounded barging.** memcached cannot notify (``notifies=False``), so waiters
poll. A released key with nobody queued goes to whoever asks first, the releaser
included: under a tight loop the releaser mostly takes it straight back, one round trip
after its release, which is what gives throughput (a hand-over to a polling waiter
costs that waiter's poll delay each time). So that nobody starves, a waiter that has
been refused for ``patience`` seconds (the ``patience`` store option, default
``PATIENCE_SECONDS``; ``0`` queues from the first refused poll: strict hand-over)
joins the key's queue, and from then on the key is handed over to the queue, first in
line first:

- A queued waiter writes its *place* (a random id, and the wall-clock time it was
  last refused) at the end of the key's queue, with the CAS of the very record whose
  read refused it, and rewrites it at most every ``REFRESH_SECONDS`` as it polls. A
  place not rewritten for ``GONE_SECONDS`` is a waiter that is gone (its process died,
  or stalled): every write of the record drops it. At most ``QUEUE_LIMIT`` places; a
  waiter beyond them polls without one.
- A release leaves a tombstone that keeps the key for the first waiter still there,
  its *heir*, for ``HANDOVER_SECONDS`` (longer than any waiter's poll interval):
  only the heir, by its id, can take it; the releaser and newcomers are refused with
  no holder and the hand-over's time left. The grant takes the heir's place out of
  the queue in its own write. When the hand-over time runs out (the heir is gone or
  stalled), the key is free for anyone; the heir keeps its place.
- A waiter that gives up (``close``) takes its place out; if the key was kept for it,
  it is kept for the next waiter still there, for a whole hand-over time.
- Nothing wakes the heir: a queued waiter polls ``POLL_FIRST`` after it saw the key
  change hands, then ``POLL_GROWTH`` times longer each time, at most ``POLL_LIMIT``
  × (1 + the waiters before it), and ``POLL_CEILING`` at most (shorter than
  ``HANDOVER_SECONDS``; so does a waiter without a place). The waiter sets this pace
  itself (``Capabilities.paces_waits``): the client adds no backoff of its own, and
  parks it no later than the holder's expiry and the caller's deadline.
- Before its patience runs out, a waiter polls on the same growing steps while the
  key stays with one holder (it may be freed for good any moment). Once it sees the
  key change hands (under barging: the releaser took it back, or another client got
  it), it looks again every ``POLL_LIMIT`` (the longest step it would have grown to),
  and when its patience ends, and queues then: the key is busy, and quick looks could
  only barge in. Such steals cost every holder's throughput (each one moves the key to
  another process, and the loser polls): found by measuring four processes on one key
  (``benchmarks/bench_peers.py``).
- So a waiter waits about ``patience``, plus one hold per waiter queued before it,
  plus its poll delays — unless the key is freed by expiry, or a hand-over time runs
  out, when it goes to whoever tries first. What is not promised (``fair=False``):
  arrival order before the patience ends; places and hand-overs timed by the clients'
  wall clocks (clocks that disagree by a good part of ``HANDOVER_SECONDS`` degrade the
  hand-over towards first come, first served). None of this touches safety: a waiter's
  write is a compare-and-swap of the record it read, so it changes only the queue and
  never undoes a renewal, a release or a grant made in between.

**Async.** ``AsyncLocks`` runs these same steps in worker threads
(``ThreadedAsyncStore``): one implementation for both, several servers, one pool.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import random
import secrets
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pymemcache.client.rendezvous import RendezvousHash  # type: ignore[import-untyped]

from keymutex import _clock
from keymutex._errors import StoreError
from keymutex._lease import Holder, Outcome
from keymutex._store import (
    AsyncStore,
    Capabilities,
    PartialRenewal,
    RenewRequest,
    ThreadedAsyncStore,
    each_within,
    translate_errors,
)
from keymutex._urls import check_host, redacted, split_url
from keymutex.stores._settings import count, digits, seconds

__all__ = ["MemcachedStore", "Place", "QueuedWaiter", "Record", "Tombstone", "decode", "driver"]

_LOG = logging.getLogger("keymutex")

CAPABILITIES = Capabilities(
    notifies=False,
    fair=False,
    cross_process=True,
    durable_fences=False,
    clock="client-wall",
    paces_waits=True,  # QueuedWaiter
)
DEFAULT_PORT = 11211
DEFAULT_SOCKET_TIMEOUT = 5.0
# How many times a step starts again after losing a race to another client's write.
RACE_ATTEMPTS = 8
# Waiting (see *Waiting* above). A waiter refused for this long joins the key's queue.
# Chosen from bench_memcached.py --patience (4 processes looping on one key, 2 cores):
# 20 ms gave ~1,800 acquires/s, 50 ms ~1,450, 100 ms ~2,350, 200 ms ~2,200 (medians of
# 3 runs, noisy), with worst waits of 28, 60, 105 and 209 ms; 0 (strict hand-over)
# ~630/s. 100 ms: the throughput of the peers that never hand over, and a worst wait a
# person does not notice.
PATIENCE_SECONDS = 0.1
# A release keeps the key this long for the first queued waiter: longer than any
# waiter's poll interval (at most ``POLL_CEILING``).
HANDOVER_SECONDS = 0.5
# A queued waiter rewrites its place at most this often as it polls; a place not
# rewritten for ``GONE_SECONDS`` belongs to a waiter that is gone, and is skipped.
REFRESH_SECONDS = 0.5
GONE_SECONDS = 2.0
QUEUE_LIMIT = 32  # places per key; a waiter beyond them polls without a place
# A tombstone carries a queue: it lives as long as a place in it can.
TOMBSTONE_SECONDS = math.ceil(GONE_SECONDS) + 1
# A queued waiter looks again POLL_FIRST after it saw the key change hands, then each
# time POLL_GROWTH times later, at most POLL_LIMIT × (1 + its place in the queue), and
# never more than POLL_CEILING later (a waiter without a place as well).
POLL_FIRST = 0.001
POLL_GROWTH = 1.5
POLL_LIMIT = 0.05
POLL_CEILING = 0.25
_WAITER_ID_BYTES = 9  # 12 characters: a waiter's id only has to be unique per key
# memcached reads an exptime above 30 days as an absolute UNIX time (by the server's
# clock); longer leases get 0 ("no expiry": only eviction or a release removes them).
MAX_RELATIVE_EXPTIME = 30 * 24 * 3600
EXPTIME_MARGIN = 3  # seconds an item outlives its lease, at least (see exptime)
INDEX_BUCKETS = 16
COMPACT_EVERY = 64  # grants by one store between two compactions (of the granted one's bucket)
READ_BATCH = 1000  # items per pipelined multi-read
OWN_WRITES_KEPT = 10_000  # leases whose last write (CAS) a store remembers for release
_PREFIX = "km2"
EPOCH_ITEM = f"{_PREFIX}:epoch"
_RECV_BYTES = 65536
_NAMES_KEPT = 4096
# One encoder for every record: json.dumps with options builds a new one per call.
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


class ProtocolError(Exception):
    """memcached answered with an error, or something this store did not ask for."""


_DRIVER_ERRORS = (OSError, ProtocolError)


def epoch_seed() -> int:
    """The value a server's missing epoch is created with: wall-clock microseconds."""
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

    ``fence`` is ``None`` in the record a grant writes (the fence is then ``epoch``,
    the server's epoch as the granting connection knew it, plus the item's CAS, unknown
    until written); ``decode`` fills it in. ``queue``: the places of the waiters that
    queued while it holds, in arrival order.
    """

    key: str
    token: str
    owner: str
    info: dict[str, Any] | None
    fence: int | None
    acquired_at: float
    expires_at: float
    queue: tuple[Place, ...] = ()
    epoch: int | None = None

    def encode(self) -> bytes:
        fields: list[object] = [
            "L",
            self.key,
            self.token,
            self.owner,
            self.info,
            # The fence, or [the epoch it is to be added to the CAS of], or neither
            # (written so by earlier versions: the reader's epoch then).
            self.fence if self.fence is not None or self.epoch is None else [self.epoch],
            self.acquired_at,
            self.expires_at,
        ]
        if self.queue:
            fields.append([place.encode() for place in self.queue])
        return _JSON.encode(fields).encode()

    def holder(self) -> Holder:
        assert self.fence is not None
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
    """What a release leaves when waiters are queued: the key kept for one of them.

    It keeps their queue, and the key for ``heir`` (the first of them still there at
    the release) until ``kept_until`` (wall-clock UNIX seconds).
    """

    queue: tuple[Place, ...]
    heir: str | None = None
    kept_until: float = 0.0

    def encode(self) -> bytes:
        queue = [place.encode() for place in self.queue]
        fields: list[object] = ["T", queue, self.heir, round(self.kept_until, 3)]
        return _JSON.encode(fields).encode()


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


def decode(
    raw: bytes, name: str = "", epoch: int | None = None, cas: int | None = None
) -> Record | Tombstone:
    """The record an item holds; ``StoreError`` when it is not one of ours.

    A grant's record names the epoch its fence is counted from, and ``cas`` (the
    item's) is added to it: every reader finds the same fence, whatever epoch its own
    connection read. Found by review: each added its own, and once ``km2:epoch`` had
    been evicted and made again, a client on a newer connection saw another fence for
    the same lease than its holder. ``epoch``: the reader's, for a record that names
    none (written by an earlier version).
    """
    try:
        fields = json.loads(raw)
        if fields[0] == "T":
            _, queue, heir, kept_until = fields
            if heir is None or isinstance(heir, str):
                return Tombstone(_places(queue), heir, _number(kept_until))
        tag, key, token, owner, info, recorded, acquired_at, expires_at, *rest = fields
        if isinstance(recorded, list):  # [the grant's epoch]: the fence is it + the CAS
            (epoch,) = recorded
            if type(epoch) is not int:
                raise TypeError(epoch)
            recorded = None
        fence = None if epoch is None or cas is None else epoch + cas
        if (
            tag == "L"
            and isinstance(key, str)
            and isinstance(token, str)
            and isinstance(owner, str)
            and (info is None or isinstance(info, dict))
            and (type(recorded) is int or (recorded is None and fence is not None))
            and len(rest) <= 1
        ):
            queue = _places(rest[0]) if rest else ()
            return Record(
                key,
                token,
                owner,
                info,
                fence if recorded is None else recorded,
                _number(acquired_at),
                _number(expires_at),
                queue,
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
    """The item exptime for a lease with ``seconds`` left: never shorter than the lease.

    memcached counts time in whole seconds, by a clock a timer moves once a second: an
    item set with exptime N lives at least N - 1 s when the timer is on time, and less
    when it is late (a starved memcached catches up by two at once). Found in a
    clean-clone CI run, both cores busy: with N = ceil(ttl) + 1 a holder's lease
    (TTL 1 s, renewed) vanished 0.54 s after its grant, and another process was
    granted the key. ``EXPTIME_MARGIN`` leaves room for a timer up to 2 s late; a
    lease's end is still the record's ``expires_at``, so an item outliving it costs
    only its memory for those seconds."""
    whole = math.ceil(seconds) + EXPTIME_MARGIN
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


def handed_over(queue: tuple[Place, ...], now: float) -> Tombstone | None:
    """What a release (or the heir giving up) leaves: the key kept for the first waiter
    still there; ``None`` (delete the item) when nobody waits."""
    places = present(queue, now) if queue else ()
    if not places:
        return None
    return Tombstone(places, places[0].waiter, now + HANDOVER_SECONDS)


def item_exptime(item: Record | Tombstone, now: float, left: int | None) -> int:
    """The exptime to rewrite ``item`` with (a waiter's place in its queue, added or
    taken out): never shorter than its lease or its queue, nor than the item had
    ``left`` (``None``: never expires). Found by review: a waiter whose clock ran ahead
    of the holder's by 5 s set the holder's item to expire by its own reckoning, and
    memcached dropped it while the lease was live: a third client was granted the key."""
    own = (
        exptime(max(0.0, item.expires_at - now)) if isinstance(item, Record) else TOMBSTONE_SECONDS
    )
    if left is None or own == 0:
        return 0
    return max(own, left)


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
    """One server's share of a namespace: its index buckets."""

    server: str
    buckets: tuple[str, ...]


class Layout:
    """Item names of one namespace, and which server holds each (rendezvous hashing).

    Index buckets are named so that they hash to the server they serve:
    ``km2:i:<ns>:<bucket>:<n>`` with the first ``n`` that lands on it.
    """

    def __init__(self, namespace: str, servers: Sequence[str]) -> None:
        self._namespace = namespace
        self._leases: dict[str, str] = {}  # key -> item name: a digest costs microseconds
        self._listings: dict[str, tuple[str, bytes]] = {}  # item name -> (bucket, entry)
        self._hasher = RendezvousHash(nodes=list(servers))
        self.servers = tuple(servers)
        space = _digest(namespace)
        self.shards = {
            server: _Shard(
                server,
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
        name = self._leases.get(key)
        if name is None:
            if len(self._leases) >= _NAMES_KEPT:
                self._leases.clear()
            name = self._leases[key] = f"{_PREFIX}:l:{_digest(self._namespace, key)}"
        return name

    def shard_of(self, lease: str) -> _Shard:
        return self.shards[self.server_of(lease)]

    def listing(self, lease: str) -> tuple[str, bytes]:
        """Where ``lease`` is listed for ``holders``: its index bucket, and its entry."""
        found = self._listings.get(lease)
        if found is None:
            if len(self._listings) >= _NAMES_KEPT:
                self._listings.clear()
            bucket = self.bucket_of(self.shard_of(lease), lease)
            found = self._listings[lease] = (bucket, self.index_entry(lease))
        return found

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


# -- the wire: meta commands over pooled sockets ---------------------------------------


def ms(name: str, value: bytes, *flags: str) -> bytes:
    """A meta set of ``value`` (flags such as ``T30``, ``c``, ``C<cas>``, ``ME``)."""
    return b"ms %s %d %s\r\n%s\r\n" % (name.encode(), len(value), " ".join(flags).encode(), value)


def mg(name: str) -> bytes:
    """A meta get of the value, its CAS, and the item's own time left (``t``)."""
    return b"mg %s v c t\r\n" % name.encode()


def md(name: str, cas: int) -> bytes:
    """A compare-and-delete: only while the item's CAS is still ``cas``."""
    return b"md %s C%d\r\n" % (name.encode(), cas)


@dataclass(frozen=True, slots=True)
class Reply:
    """One meta reply: its code (``HD``, ``VA``, ``NS``, ``EX``, ``NF``, ``EN``, ``MN``),
    its flags (``c`` → the CAS…) and, for ``VA``, the value."""

    code: bytes
    flags: dict[str, str]
    value: bytes | None = None
    line: bytes = b""

    @property
    def cas(self) -> int:
        return self._number("c")

    @property
    def seconds_left(self) -> int | None:
        """An item's own time left in whole seconds, as ``mg … t`` says (``None``: it
        never expires; memcached answers -1)."""
        left = self._number("t")
        return None if left < 0 else left

    def _number(self, flag: str) -> int:
        try:
            return int(self.flags[flag])
        except (KeyError, ValueError):
            raise ProtocolError(f"no number {flag} in the reply {self.line!r}") from None

    def expect(self, *codes: bytes) -> Reply:
        """This reply, if its code is one of ``codes``; else ``ProtocolError``."""
        if self.code not in codes:
            raise ProtocolError(self.line.decode("ascii", "replace") or "no reply")
        return self


class Connection:
    """One socket to one memcached, and what it learnt there: the server's epoch.

    ``incarnation`` is the epoch item's whole value (microseconds and a random part):
    a CAS kept from an earlier write is compared only on a connection to the same
    incarnation, never on a server that restarted since (whose counter starts again).
    """

    __slots__ = ("__weakref__", "_buffer", "_poll", "epoch", "incarnation", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self.epoch = 0
        self.incarnation = b""

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except TimeoutError as exc:
            if exc.errno is not None:  # the kernel's ETIMEDOUT, not the socket timeout
                raise
            raise TimeoutError("memcached took no more of the request in time") from None

    def _fill(self) -> None:
        try:
            chunk = self.sock.recv(_RECV_BYTES)
        except TimeoutError as exc:
            if exc.errno is not None:  # the kernel's ETIMEDOUT, not the socket timeout
                raise
            raise TimeoutError("memcached did not answer in time") from None
        if not chunk:
            raise ConnectionResetError("memcached closed the connection")
        self._buffer += chunk

    def reply(self) -> Reply:
        while (end := self._buffer.find(b"\r\n")) < 0:
            self._fill()
        line = self._buffer[:end]
        self._buffer = self._buffer[end + 2 :]
        code, _, rest = line.partition(b" ")
        if code in (b"ERROR", b"CLIENT_ERROR", b"SERVER_ERROR"):
            # The reply to a command memcached refused (e.g. an item too large): the
            # stream stays in step; the caller decides (``expect``).
            return Reply(code, {}, None, line)
        value = None
        try:  # what memcached sends parses; anything else is a ProtocolError (StoreError)
            # Decoded once for the line, not per flag: most replies have one flag or none.
            tokens = rest.decode("ascii").split(" ") if rest else []
            if code == b"VA":
                size = int(tokens.pop(0))
                while len(self._buffer) < size + 2:
                    self._fill()
                value = self._buffer[:size]
                self._buffer = self._buffer[size + 2 :]
            flags = {token[:1]: token[1:] for token in tokens} if tokens else {}
        except (IndexError, ValueError):  # UnicodeDecodeError among them
            raise ProtocolError(f"a malformed reply from memcached: {line[:80]!r}") from None
        return Reply(code, flags, value, line)

    def idle_and_open(self) -> bool:
        """Whether this pooled connection may be used: nothing to read, not closed."""
        if self._buffer:
            return False
        try:
            # Readable while idle: the server closed it (or sent what we never asked).
            return not self._poll.poll(0)
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class Pool:
    """Connections to one server: reused, checked before use, made with the epoch read.

    A connection given back after ``close`` is closed, not kept: a step left running
    on a thread of its own (a renewal waited for only a third of the TTL, see
    ``renew_many``) may end after its store closed. Found in CI: such a socket stayed
    open until the garbage collector found it.
    """

    def __init__(
        self,
        server: str,
        *,
        connect_timeout: float,
        timeout: float,
        max_connections: int | None,
    ) -> None:
        self.server = server
        self._connect_timeout = connect_timeout
        self._timeout = timeout
        self._idle: list[Connection] = []
        self._made: weakref.WeakSet[Connection] = weakref.WeakSet()  # open or not
        self._closed = False
        self._lock = threading.Lock()
        self._slots = None if max_connections is None else threading.Semaphore(max_connections)

    def _connect(self) -> Connection:
        if self.server.startswith("/"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._connect_timeout)
            try:
                sock.connect(self.server)
            except BaseException:
                sock.close()
                raise
        else:
            host, _, port = self.server.rpartition(":")
            sock = socket.create_connection(
                (host.strip("[]"), int(port)), timeout=self._connect_timeout
            )
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Python's timeout, though it polls before each send and receive: not the
        # kernel's (SO_SNDTIMEO, SO_RCVTIMEO on a blocking socket), tried for those two
        # system calls a round trip and found wrong by review: CPython retries a call a
        # signal interrupted (PEP 475) with the kernel's whole timeout again, so a
        # process that got a signal more often than ``timeout`` (a timer, SIGCHLD, a
        # profiler) waited for ever on a paused server. Python's is one deadline a call.
        sock.settimeout(self._timeout)
        connection = Connection(sock)
        with self._lock:
            self._made.add(connection)
        try:
            _learn_epoch(connection)
        except BaseException:
            connection.close()
            raise
        return connection

    def take(self, *, fresh: bool = False) -> tuple[Connection, bool]:
        """A connection, and whether it was reused from the pool."""
        while not fresh:
            with self._lock:
                if not self._idle:
                    break
                connection = self._idle.pop()
            if connection.idle_and_open():
                return connection, True
            connection.close()
        return self._connect(), False

    def give_back(self, connection: Connection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(connection)
                return
        connection.close()

    def session(self) -> Session:
        """A step's connection (``with pool.session() as session``): back to the pool
        when the step ends, closed if it failed."""
        return Session(self)

    def forget_after_fork(self) -> None:
        """In a forked child: close this process's copies of the parent's sockets, idle
        or in use by a thread that did not come along (the parent's connections stay
        open: closing a copy sends nothing). The pool's lock is not taken, since one of
        those threads may have held it at the fork. Dropped unclosed, each warned of an
        unclosed socket in the child when collected (seen in the fork tests)."""
        self._closed = True
        for connection in list(self._made):
            connection.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


class Session:
    """One step's use of a pool: one connection for all its commands.

    ``max_connections`` bounds the sessions open at once; one that finds them all busy
    waits for one up to the socket timeout, then fails with ``StoreError``.
    """

    __slots__ = ("_connection", "_pool", "_reused", "_wrote")

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._connection: Connection | None = None
        self._reused = False
        self._wrote = False

    def __enter__(self) -> Session:
        slots = self._pool._slots
        if slots is not None and not slots.acquire(timeout=self._pool._timeout):
            raise StoreError(
                f"memcached {self._pool.server}: every connection of the pool is busy"
            )
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            if exc_type is None:
                self.finish()
            else:
                self.discard()
        finally:
            if self._pool._slots is not None:
                self._pool._slots.release()

    @property
    def connection(self) -> Connection:
        if self._connection is None:
            self._connection, self._reused = self._pool.take()
        return self._connection

    @property
    def epoch(self) -> int:
        return self.connection.epoch

    @property
    def incarnation(self) -> bytes:
        return self.connection.incarnation

    def write(self, commands: bytes, replies: int) -> list[Reply]:
        """Send ``commands`` (which may change items) in one write; their ``replies``."""
        connection = self.connection
        self._wrote = True
        connection.send(commands)
        return [connection.reply() for _ in range(replies)]

    def read(self, commands: bytes, replies: int) -> list[Reply]:
        """Send read-only ``commands`` and take ``replies`` (``-1``: up to ``MN``); sent
        once more on a new connection if the step has written nothing yet and a reused
        connection turns out dead (not on a timeout)."""
        try:
            return _exchange(self.connection, commands, replies)
        except TimeoutError:
            raise
        except OSError:
            if self._wrote or not self._reused:
                raise
            self.discard()
            self._connection, self._reused = self._pool.take(fresh=True)
            return _exchange(self._connection, commands, replies)

    def read_many(self, names: Sequence[str]) -> dict[str, Reply]:
        """The items ``names`` that exist (value and CAS), by pipelined quiet reads."""
        found: dict[str, Reply] = {}
        for start in range(0, len(names), READ_BATCH):
            batch = names[start : start + READ_BATCH]
            commands = b"".join(b"mg %s v c k q\r\n" % name.encode() for name in batch)
            for reply in self.read(commands + b"mn\r\n", -1):
                name = reply.expect(b"VA").flags.get("k")
                if name is None:
                    raise ProtocolError(f"a read with no item name: {reply.line!r}")
                found[name] = reply
        return found

    def discard(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def finish(self) -> None:
        if self._connection is not None:
            self._pool.give_back(self._connection)
            self._connection = None


def _exchange(connection: Connection, commands: bytes, replies: int) -> list[Reply]:
    connection.send(commands)
    if replies >= 0:
        return [connection.reply() for _ in range(replies)]
    found = []
    while (reply := connection.reply()).code != b"MN":
        found.append(reply)
    return found


def _learn_epoch(connection: Connection) -> None:
    """Read the server's epoch (creating it if missing) into a new connection."""
    get = b"mg %s v c\r\n" % EPOCH_ITEM.encode()
    connection.send(get)
    found = connection.reply()
    if found.expect(b"VA", b"EN").code == b"EN":
        seed = b"%d:%s" % (epoch_seed(), secrets.token_hex(8).encode())
        # Never expires (T0); a client that lost the race reads the winner's.
        connection.send(ms(EPOCH_ITEM, seed, "T0", "ME") + get)
        connection.reply().expect(b"HD", b"NS")
        found = connection.reply().expect(b"VA")
    if found.cas == 0:  # memcached -C: no CAS, so no compare-and-swap and no fences
        raise ProtocolError("this memcached runs without CAS (-C); the lock store needs it")
    try:
        assert found.value is not None
        connection.epoch = int(found.value.split(b":")[0])
        connection.incarnation = found.value
    except (AssertionError, ValueError) as exc:
        raise ProtocolError(f"{EPOCH_ITEM} holds {found.value!r}, not an epoch") from exc


# -- the store ---------------------------------------------------------------------


class QueuedWaiter:
    """One client waiting for one key: its patience, its place in the queue, its polling.

    Until its patience runs out it polls ``POLL_FIRST`` after its first refusal, then
    each time ``POLL_GROWTH`` times later (and once more when its patience ends),
    barging like any newcomer; once it saw the key change hands, every ``POLL_LIMIT``.
    Then it queues: it polls ``POLL_FIRST`` after it saw the key change hands (a
    grant, a release kept for another waiter), then each time ``POLL_GROWTH`` times
    later, up to ``POLL_LIMIT`` × (1 + its place), ``POLL_CEILING`` at most: the first
    in line finds the key kept for it within half the time the last holder held it
    (and at most ``POLL_LIMIT``), those behind it look less often. ``wait`` never
    parks longer than the client asked. ``close`` leaves the queue (passing on the key
    if it was kept for this waiter); a waiter that was granted the key has left it
    already.
    """

    __slots__ = ("_impatient_at", "_limit", "_seen", "_step", "_store", "id", "key", "queued")

    def __init__(self, store: MemcachedStore, key: str, patience: float) -> None:
        self.id = secrets.token_urlsafe(_WAITER_ID_BYTES)
        self.key = key
        self.queued = False  # it may have a place in the key's queue
        self._store = store
        self._impatient_at = time.monotonic() + patience
        self._seen: object = None  # the last state of the key it saw
        self._step = POLL_FIRST
        self._limit = POLL_LIMIT

    def impatient(self) -> bool:
        """Whether it queues when refused: its patience ran out (or it queued before)."""
        return self.queued or time.monotonic() >= self._impatient_at

    def saw(self, state: object, place: int) -> None:
        """After a refusal: the key's state (who holds it) and how many stand before us.

        A queued waiter looks again soon after the key changed hands. One that is not
        queued yet looks again ``POLL_LIMIT`` later (or when its patience ends): the key
        is busy (under barging it changes hands at every grant), and its quick looks
        could only steal it from the holders; a key freed for good meanwhile is still
        found within ``POLL_LIMIT``.
        """
        if state != self._seen:
            if self.queued:
                self._step = POLL_FIRST
            elif self._seen is not None:
                self._step = POLL_LIMIT  # (and not past the end of its patience: park)
            self._seen = state
        self._limit = min(POLL_LIMIT * (1 + place), POLL_CEILING)

    def joined(self) -> None:
        """It wrote its place in the queue: look again soon."""
        self.queued = True
        self._step = POLL_FIRST

    def park(self, timeout: float) -> float:
        """How long the next wait lasts: the polling step, at most ``timeout`` (the
        holder's expiry, the caller's deadline), and not past the end of its patience."""
        step = self._step
        self._step = min(step * POLL_GROWTH, self._limit)
        if not self.queued:
            left = self._impatient_at - time.monotonic()
            if left > 0:
                step = min(step, left)
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


@dataclass(frozen=True, slots=True)
class _Written:
    """Our last write of a lease: the record (fence known), its CAS, and the server
    incarnation that issued the CAS."""

    record: Record
    cas: int
    incarnation: bytes


_MISSING = Reply(b"EN", {})

_STORES: weakref.WeakSet[MemcachedStore] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for store in list(_STORES):
        store._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_after_fork)


class MemcachedStore:
    """The ``memcached://`` store for one namespace (see the module for the guarantees)."""

    capabilities = CAPABILITIES

    def __init__(
        self,
        servers: Sequence[str],
        namespace: str,
        make_pool: Callable[[str], Pool],
        *,
        patience: float = PATIENCE_SECONDS,
    ) -> None:
        self._layout = Layout(namespace, servers)
        self._make_pool = make_pool
        self._pools = {server: make_pool(server) for server in servers}
        self._patience = patience
        # Grants made by this store: every COMPACT_EVERY-th compacts. Counted from a random
        # place, so that stores making fewer grants (short-lived clients) compact too.
        self._grants = random.randrange(COMPACT_EVERY)
        # Each lease this store granted or renewed, by item name: its last write, so
        # that a release or renewal can compare-and-swap it without reading it first.
        # Oldest first: forgotten by ``popitem``, which threads sharing the store cannot
        # break (found by review: ``next(iter(…))`` raised RuntimeError when another
        # thread wrote meanwhile, out of an acquire whose grant was written).
        self._written: collections.OrderedDict[str, _Written] = collections.OrderedDict()
        # Keys this store was refused, by item name: until when (_clock.monotonic) the
        # lease or hand-over that refused it lasts. A try before then is most likely refused
        # again, and sends no index entry (see ``try_acquire``).
        self._held: dict[str, float] = {}
        _STORES.add(self)

    def _after_fork_in_child(self) -> None:
        # The parent's pooled sockets must not be shared: new pools, and the child's
        # copies of the old ones' sockets closed.
        for pool in self._pools.values():
            pool.forget_after_fork()
        self._pools = {server: self._make_pool(server) for server in self._layout.servers}

    def _pool(self, name: str) -> Pool:
        return self._pools[self._layout.server_of(name)]

    def _read(self, session: Session, name: str) -> Reply:
        """A step's read of a lease item (value and CAS)."""
        (reply,) = session.read(mg(name), 1)
        return reply.expect(b"VA", b"EN")

    @staticmethod
    def _decode(session: Session, name: str, reply: Reply) -> Record | Tombstone | None:
        if reply.code == b"EN":
            return None
        assert reply.value is not None
        return decode(reply.value, name, session.epoch, reply.cas)

    def _remember(self, name: str, record: Record, cas: int, session: Session) -> None:
        written = self._written
        written.pop(name, None)
        while len(written) >= OWN_WRITES_KEPT:  # leases lost and never released
            try:
                written.popitem(last=False)
            except KeyError:  # emptied by other threads meanwhile
                break
        written[name] = _Written(record, cas, session.incarnation)

    def _own(self, name: str, token: str, session: Session) -> _Written | None:
        """Our last write of ``name`` for ``token``, if its CAS can be compared here."""
        known = self._written.get(name)
        if known is None or known.record.token != token:
            return None
        if known.incarnation != session.incarnation:
            return None
        return known

    # -- the index -------------------------------------------------------------------

    def _held_lately(self, name: str) -> bool:
        """Whether a try at ``name`` now is most likely refused: the lease (or
        hand-over) that refused this store last time still lasts."""
        until = self._held.get(name)
        if until is None:
            return False
        if _clock.monotonic() < until:
            return True
        self._held.pop(name, None)
        return False

    def _answered(self, name: str, answer: Outcome) -> Outcome:
        """``answer`` to a try at ``name``; a refusal is remembered for as long as the
        lease or hand-over that refused it lasts."""
        if answer.ok or not answer.remaining:
            self._held.pop(name, None)
        else:
            if len(self._held) >= _NAMES_KEPT:
                self._held.clear()
            self._held[name] = _clock.monotonic() + answer.remaining
        return answer

    def _index(self, session: Session, name: str, appended: Reply | None) -> None:
        """List a granted lease for ``holders``; best effort, never fails the grant.

        ``appended``: the reply to the append sent with the grant, or ``None`` when it
        is still to be sent. A missing bucket is created; one too large, compacted.
        """
        bucket, entry = self._layout.listing(name)
        try:
            self._grants += 1
            if self._grants % COMPACT_EVERY == 0:
                self._compact(session, bucket)
            for _ in range(RACE_ATTEMPTS):
                if appended is None:
                    (appended,) = session.write(ms(bucket, entry, "MA"), 1)
                if appended.code == b"HD":
                    return
                if appended.code == b"NS":  # no bucket yet (or evicted), or no room in it
                    (created,) = session.write(ms(bucket, entry, "T0", "ME"), 1)
                    if created.expect(b"HD", b"NS").code == b"HD":
                        return
                    # Made by another client since our append: append to it now. Found
                    # by review: compacting it found only live entries ("full"), and a
                    # lease granted as a bucket was first made was never listed.
                    (appended,) = session.write(ms(bucket, entry, "MA"), 1)
                    if appended.code == b"HD":
                        return
                # The bucket is there and took no more: memcached 1.6 answers NS, not
                # SERVER_ERROR, to an append that would take an item past its size limit
                # (-I, 1 MB by default).
                if not self._compact(session, bucket):
                    _LOG.warning(
                        "memcached: could not list %s for holders(): %s is full of live leases",
                        name,
                        bucket,
                    )
                    return
                appended = None
            _LOG.warning("memcached: could not list %s in %s for holders()", name, bucket)
        except (*_DRIVER_ERRORS, StoreError) as exc:
            session.discard()  # it may be out of step: the next command makes a new one
            _LOG.warning("memcached: listing %s for holders() failed: %s", name, exc)

    def _compact(self, session: Session, bucket: str) -> bool:
        """Rewrite ``bucket`` with only its live leases, each once (if nobody appended
        meanwhile); ``False`` when there was nothing to drop, so no room to make."""
        (found,) = session.read(mg(bucket), 1)
        if found.expect(b"VA", b"EN").code == b"EN":
            return True
        assert found.value is not None
        names = Layout.index_leases(found.value)
        now = time.time()
        keep = [
            name
            for name, reply in session.read_many(names).items()
            if live(self._decode(session, name, reply), now) is not None
        ]
        rewritten = b"".join(Layout.index_entry(name) for name in keep)
        if len(rewritten) >= len(found.value):
            return False
        session.write(ms(bucket, rewritten, "T0", f"C{found.cas}"), 1)[0].expect(
            b"HD", b"EX", b"NF"
        )
        return True

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
        pool = self._pool(name)
        queued = waiter if isinstance(waiter, QueuedWaiter) and waiter.key == key else None
        me = None if queued is None else queued.id
        with (
            translate_errors(*_DRIVER_ERRORS, what=f"memcached acquire of {key!r}"),
            pool.session() as session,
        ):
            now = time.time()
            record = Record(key, token, owner, info, None, now, now + ttl, epoch=session.epoch)
            reply: Reply | None = None  # the item, once read
            if not steal:
                add = ms(name, record.encode(), f"T{exptime(ttl)}", "c", "ME")
                if queued is None and not self._held_lately(name):
                    # First try: the index entry goes in the same write, and so does a
                    # read, which a refusal needs (a grant ignores it): one round trip
                    # either way.
                    bucket, entry = self._layout.listing(name)
                    append = ms(bucket, entry, "MA")
                    added, appended, reply = session.write(add + append + mg(name), 3)
                    if added.expect(b"HD", b"NS").code == b"HD":
                        return self._granted(session, name, record, added, appended)
                    reply.expect(b"VA", b"EN")
                else:
                    # A waiter's poll, or a try at a key that refused us and is still
                    # held: the add and a read in one write, and no index entry. Refused,
                    # it would only grow the bucket, by one entry a try until the next
                    # compaction (a client polling with timeout=0 fills 1 MB in about
                    # 24,000 tries); granted, ``_index`` appends it after the add, as
                    # for every grant made by a later write.
                    added, reply = session.write(add + mg(name), 2)
                    if added.expect(b"HD", b"NS").code == b"HD":
                        if queued is not None:
                            queued.queued = False
                        return self._granted(session, name, record, added, None)
                    reply.expect(b"VA", b"EN")
            for _ in range(RACE_ATTEMPTS):
                if reply is None:
                    reply = self._read(session, name)
                decided = self._decide(
                    session, name, reply, record, steal=steal, queued=queued, me=me
                )
                if isinstance(decided, Outcome):
                    return self._answered(name, decided)
                if decided is not None:
                    if queued is not None:
                        queued.queued = False
                    return self._granted(session, name, decided[0], decided[1], None)
                reply = None  # a lost race: look again
            # Every try lost a race: others keep writing this key, so it is not ours.
            now = time.time()
            current = self._decode(session, name, self._read(session, name))
            return self._answered(name, outcome(False, live(current, now), now))

    def _decide(
        self,
        session: Session,
        name: str,
        reply: Reply,
        wanted: Record,
        *,
        steal: bool,
        queued: QueuedWaiter | None,
        me: str | None,
    ) -> Outcome | tuple[Record, Reply] | None:
        """One try from the item as read: a refusal or our own lease (``Outcome``), a
        grant (the record written and the reply), or ``None``: a race lost."""
        now = time.time()
        current = self._decode(session, name, reply)
        holder = live(current, now)
        if current is not None and not steal:
            refused: Outcome | None = None
            if holder is not None:
                if holder.token == wanted.token:  # ours already (a retried acquire)
                    self._remember(name, holder, reply.cas, session)
                    # Its listing may have been lost with the reply to the grant (a
                    # waiter's grant is listed after it, by a write of its own).
                    self._index(session, name, None)
                    return outcome(True, holder, now)
                refused = outcome(False, holder, now)
            elif isinstance(current, Tombstone) and kept_for(current, now) not in (None, me):
                refused = Outcome(False, None, current.kept_until - now)
            if refused is not None:
                if queued is None:
                    return refused
                state = ("held", holder.fence) if holder is not None else ("kept", reply.cas)
                places = rejoined(current.queue, queued.id, now) if queued.impatient() else None
                if places is None:  # patient still, fresh in its place, or the queue is full
                    queued.saw(state, position(current.queue, queued.id, now))
                    return refused
                # Out of patience: take (or keep) its place in the queue, by a
                # compare-and-swap of the record that refused it.
                queued.joined()
                waiting = replace(current, queue=places)
                expire = item_exptime(waiting, now, reply.seconds_left)
                write = ms(name, waiting.encode(), f"T{expire}", f"C{reply.cas}")
                (written,) = session.write(write, 1)
                if written.expect(b"HD", b"EX", b"NF").code == b"HD":
                    queued.saw(state, position(places, queued.id, now))
                    return refused
                return None  # renewed, released or joined meanwhile: look again
        # Free (no item, a tombstone not kept for another, an expired lease), or a steal.
        # A grant takes its waiter out of the queue, and the gone ones with it.
        queue = () if current is None else current.queue
        places = tuple(p for p in present(queue, now) if p.waiter != me) if queue else ()
        ttl = wanted.expires_at - wanted.acquired_at
        # The epoch of the connection that writes it (found by review: a steal's first
        # read, sent again on a new connection when the pooled one was dead, kept the
        # dead one's epoch: after a restart, a fence below those already granted).
        record = replace(
            wanted, acquired_at=now, expires_at=now + ttl, queue=places, epoch=session.epoch
        )
        over = "ME" if current is None else f"C{reply.cas}"
        (stored,) = session.write(ms(name, record.encode(), f"T{exptime(ttl)}", "c", over), 1)
        if stored.expect(b"HD", b"NS", b"EX", b"NF").code == b"HD":
            return record, stored
        return None

    def _granted(
        self,
        session: Session,
        name: str,
        record: Record,
        stored: Reply,
        appended: Reply | None,
    ) -> Outcome:
        """A grant stored by ``stored`` (its reply carries the CAS): the fence, and the
        index entry (``appended``: the reply to the append sent with it, if any)."""
        assert record.epoch is not None  # every grant's record names its epoch
        cas = stored.cas
        lease = Record(
            record.key,
            record.token,
            record.owner,
            record.info,
            record.epoch + cas,
            record.acquired_at,
            record.expires_at,
            record.queue,
        )
        self._remember(name, lease, cas, session)
        self._held.pop(name, None)
        self._index(session, name, appended)
        return granted(lease, record.acquired_at)

    def renew(self, key: str, token: str, ttl: float) -> Outcome:
        return self.renew_many([RenewRequest(key, token, ttl)])[0]

    def _renew(self, session: Session, name: str, request: RenewRequest, reply: Reply) -> Outcome:
        """Renew from a read already in hand (``reply``), then from fresh ones."""
        for attempt in range(RACE_ATTEMPTS):
            if attempt:
                reply = self._read(session, name)
            now = time.time()
            current = live(self._decode(session, name, reply), now)
            if current is None or current.token != request.token:
                return outcome(False, current, now)
            renewed = replace(current, expires_at=now + request.ttl)
            write = ms(name, renewed.encode(), f"T{exptime(request.ttl)}", f"C{reply.cas}", "c")
            (written,) = session.write(write, 1)
            if written.expect(b"HD", b"EX", b"NF").code == b"HD":
                self._remember(name, renewed, written.cas, session)
                return granted(renewed, now)
        raise StoreError(f"memcached renewal of {request.key!r} lost {RACE_ATTEMPTS} races")

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        names = [self._layout.lease(request.key) for request in requests]
        by_server: dict[str, list[int]] = {}
        for index, name in enumerate(names):
            by_server.setdefault(self._layout.server_of(name), []).append(index)
        outcomes: list[Outcome | None] = [None] * len(requests)
        failures = self._renew_on_each(by_server, names, requests, outcomes)
        if failures:
            raise PartialRenewal(
                "; ".join(str(failure) for failure in failures), outcomes
            ) from failures[0]
        return [found for found in outcomes if found is not None]

    def _renew_on_each(
        self,
        by_server: dict[str, list[int]],
        names: list[str],
        requests: Sequence[RenewRequest],
        outcomes: list[Outcome | None],
    ) -> list[StoreError]:
        """``renew_many``'s requests: with several servers, each server's share at once,
        on a thread of its own, waited for a third of the shortest TTL at most; the
        failures.

        A server that has not answered by then counts as failed (its leases are tried
        again), and the others' outcomes come back without waiting for it. Found by
        review: a paused server (``kill -STOP``, a hung host) held every other server's
        renewals up for its whole ``socket_timeout`` (5 s by default), in the same batch
        (the servers were asked one after the other) and in the batches after it (the
        client's renewer then made one call at a time), and leases with a shorter TTL on
        servers that answered were lost. The call left behind ends at its
        ``socket_timeout``.
        """
        if len(self._layout.servers) == 1:  # nobody else to hold up: no thread
            ((server, indices),) = by_server.items()
            try:
                self._renew_on(server, indices, names, requests, outcomes)
            except StoreError as exc:
                return [exc]
            return []
        within = min(request.ttl for request in requests) / 3

        def renew_on(server: str) -> tuple[list[Outcome | None], StoreError | None]:
            mine: list[Outcome | None] = [None] * len(requests)
            try:
                self._renew_on(server, by_server[server], names, requests, mine)
            except StoreError as exc:
                return mine, exc
            return mine, None

        answers = each_within(
            {server: functools.partial(renew_on, server) for server in by_server},
            within,
            name="keymutex-memcached-renew",
        )
        failures: list[StoreError] = []
        for server, indices in by_server.items():
            answer = answers.get(server)
            if answer is None:
                failures.append(
                    StoreError(
                        f"memcached renewal on {server}: no answer within {within:g} s"
                        " (a third of the shortest TTL renewed)"
                    )
                )
                continue
            if isinstance(answer, Exception):  # not a StoreError: a bug, not the server
                raise answer
            mine, error = answer
            for index in indices:
                outcomes[index] = mine[index]
            if error is not None:
                failures.append(error)
        return failures

    def _renew_on(
        self,
        server: str,
        indices: list[int],
        names: list[str],
        requests: Sequence[RenewRequest],
        outcomes: list[Outcome | None],
    ) -> None:
        """``renew_many``'s requests on one server (``indices``), into ``outcomes``."""
        with (
            translate_errors(*_DRIVER_ERRORS, what=f"memcached renewal on {server}"),
            self._pools[server].session() as session,
        ):
            # The leases whose last write we made: compare-and-swap them at once,
            # all in one write.
            now = time.time()
            fast: list[tuple[int, Record, int]] = []
            for index in indices:
                request = requests[index]
                known = self._own(names[index], request.token, session)
                if known is not None and known.record.expires_at > now:
                    renewed = replace(known.record, expires_at=now + request.ttl)
                    fast.append((index, renewed, known.cas))
            if fast:
                commands = b"".join(
                    ms(
                        names[index],
                        renewed.encode(),
                        f"T{exptime(requests[index].ttl)}",
                        f"C{cas}",
                        "c",
                    )
                    for index, renewed, cas in fast
                )
                replies = session.write(commands, len(fast))
                for (index, renewed, _), reply in zip(fast, replies, strict=True):
                    if reply.expect(b"HD", b"EX", b"NF").code == b"HD":
                        self._remember(names[index], renewed, reply.cas, session)
                        outcomes[index] = granted(renewed, now)
            # The others (or those written since by someone else): read, then swap.
            rest = [index for index in indices if outcomes[index] is None]
            if rest:
                items = session.read_many(list(dict.fromkeys(names[i] for i in rest)))
                for index in rest:
                    reply = items.get(names[index], _MISSING)
                    outcomes[index] = self._renew(session, names[index], requests[index], reply)

    def release(self, key: str, token: str) -> Outcome:
        name = self._layout.lease(key)
        pool = self._pool(name)
        with (
            translate_errors(*_DRIVER_ERRORS, what=f"memcached release of {key!r}"),
            pool.session() as session,
        ):
            known = self._own(name, token, session)
            if known is not None:
                self._written.pop(name, None)
                # Nothing wrote the item since we did: delete it by its CAS, one round trip.
                now = time.time()
                if self._end(session, name, known.record, known.cas, now):
                    return Outcome(known.record.expires_at > now)
            for _ in range(RACE_ATTEMPTS):
                reply = self._read(session, name)
                now = time.time()
                current = self._decode(session, name, reply)
                if not isinstance(current, Record) or current.token != token:
                    return outcome(False, live(current, now), now)
                if self._end(session, name, current, reply.cas, now):
                    self._written.pop(name, None)
                    # A lease past its expiry was no longer ours to release: report it lost.
                    return Outcome(current.expires_at > now)
        raise StoreError(f"memcached release of {key!r} lost {RACE_ATTEMPTS} races")

    @staticmethod
    def _end(session: Session, name: str, lease: Record, cas: int, now: float) -> bool:
        """Remove ``lease`` if the item still has ``cas``: delete it, or, with waiters
        queued, leave the tombstone that keeps the key for the first of them."""
        tombstone = handed_over(lease.queue, now)
        if tombstone is None:
            (done,) = session.write(md(name, cas), 1)
        else:
            write = ms(name, tombstone.encode(), f"T{TOMBSTONE_SECONDS}", f"C{cas}")
            (done,) = session.write(write, 1)
        return done.expect(b"HD", b"EX", b"NF").code == b"HD"

    def _leave(self, key: str, waiter: str) -> None:
        """Take ``waiter``'s place out of ``key``'s queue [2]; best effort, never raises.

        If the key was kept for it, it is kept for the next waiter still there (for a
        full ``HANDOVER_SECONDS``), or freed. A place that cannot be removed (memcached
        unreachable) lapses ``GONE_SECONDS`` after it was last refreshed.
        """
        name = self._layout.lease(key)
        pool = self._pool(name)
        try:
            with (
                translate_errors(*_DRIVER_ERRORS, what=f"memcached: leaving the queue of {key!r}"),
                pool.session() as session,
            ):
                for _ in range(RACE_ATTEMPTS):
                    reply = self._read(session, name)
                    current = self._decode(session, name, reply)
                    if current is None:
                        return
                    now = time.time()
                    kept = kept_for(current, now) == waiter
                    if not kept and all(place.waiter != waiter for place in current.queue):
                        return
                    places = tuple(place for place in current.queue if place.waiter != waiter)
                    rest: Record | Tombstone | None
                    if isinstance(current, Record):
                        rest = replace(current, queue=places)
                    elif kept:
                        rest = handed_over(places, now)
                    elif places:
                        rest = replace(current, queue=places)
                    else:
                        rest = None  # nobody left to keep it for: free
                    if rest is None:
                        write = md(name, reply.cas)
                    else:
                        expire = item_exptime(rest, now, reply.seconds_left)
                        write = ms(name, rest.encode(), f"T{expire}", f"C{reply.cas}")
                    (done,) = session.write(write, 1)
                    if done.expect(b"HD", b"EX", b"NF").code == b"HD":
                        return
                _LOG.warning("memcached: a waiter could not leave the queue of %r", key)
        except StoreError as exc:
            _LOG.warning("%s", exc)

    def holder(self, key: str) -> Holder | None:
        name = self._layout.lease(key)
        pool = self._pool(name)
        with (
            translate_errors(*_DRIVER_ERRORS, what=f"memcached read of {key!r}"),
            pool.session() as session,
        ):
            current = self._decode(session, name, self._read(session, name))
        record = live(current, time.time())
        return None if record is None else record.holder()

    def holders(self, prefix: str) -> list[Holder]:
        found: dict[str, Holder] = {}
        for server, shard in self._layout.shards.items():
            with (
                translate_errors(*_DRIVER_ERRORS, what=f"memcached listing on {server}"),
                self._pools[server].session() as session,
            ):
                buckets = session.read_many(list(shard.buckets))
                names = list(
                    dict.fromkeys(
                        name
                        for bucket in buckets.values()
                        for name in Layout.index_leases(bucket.value)
                    )
                )
                records = {
                    name: self._decode(session, name, reply)
                    for name, reply in session.read_many(names).items()
                }
            now = time.time()
            for record in records.values():
                current = live(record, now)
                if current is not None and current.key.startswith(prefix):
                    found[current.key] = current.holder()
        return [found[key] for key in sorted(found)]

    def waiter(self, key: str) -> QueuedWaiter:
        return QueuedWaiter(self, key, self._patience)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


# -- URLs ----------------------------------------------------------------------------

# Options a user may pass as ``Locks(url, **options)``; named as the Redis store names them.
# ``patience``: seconds a refused waiter polls before it queues (see *Waiting*).
OPTIONS = frozenset({"socket_timeout", "socket_connect_timeout", "max_connections", "patience"})


@dataclass(frozen=True, slots=True)
class Target:
    """What a URL names: the servers (``host:port`` or a socket path) and client options."""

    servers: tuple[str, ...]
    socket_timeout: float
    socket_connect_timeout: float
    max_connections: int | None
    patience: float = PATIENCE_SECONDS


def _server(part: str, url: str) -> str:
    host, colon, port = part.rpartition(":")
    if not colon or host.endswith(":") or (part.startswith("[") and part.endswith("]")):
        host, port = part, str(DEFAULT_PORT)  # no port: an IPv4 name or a bracketed IPv6
    if not host or not digits(port) or not 0 < int(port) < 65536:
        raise ValueError(
            f"{redacted(url)!r}: expected memcached://host[:port][,host[:port]…], got {part!r}"
        )
    if not host.startswith("[") and "%" in host:  # found by review: "%2c" was taken for IPv6
        raise ValueError(
            f"{redacted(url)!r}: {part!r} is not a host[:port]: write host names and"
            " addresses as they are, not percent-encoded, and separate servers with ','"
        )
    if not host.startswith("[") and ":" in host:
        raise ValueError(f"{redacted(url)!r}: write an IPv6 address in brackets, e.g. [::1]:11211")
    check_host(host, url, "memcached")
    return f"{host}:{int(port)}"


def parse(url: str, options: Mapping[str, object]) -> Target:
    """Check a ``memcached://`` URL and the store options; the servers to use."""
    unknown = set(options) - OPTIONS
    if unknown:
        raise TypeError(
            f"unknown memcached store options {sorted(unknown)}; accepted: {sorted(OPTIONS)}"
        )
    parts = split_url(url, "memcached", "memcached://host[:port][,host[:port]…]")
    if parts.scheme.lower() != "memcached":
        raise ValueError(f"{redacted(url)!r} is not a memcached:// URL")
    if parts.query or parts.fragment:
        raise ValueError(
            f"{redacted(url)!r}: memcached URLs take no query; pass options as keyword arguments,"
            " e.g. Locks(url, socket_timeout=2.0)"
        )
    if "@" in parts.netloc:
        raise ValueError(
            f"{redacted(url)!r}: memcached's text protocol has no authentication; remove the user name"
        )
    if parts.netloc:
        if parts.path not in ("", "/"):
            raise ValueError(f"{redacted(url)!r}: memcached has no databases; remove the path")
        servers = tuple(_server(part, url) for part in parts.netloc.split(","))
    elif parts.path not in ("", "/"):
        servers = (parts.path,)  # memcached:///run/memcached.sock: a Unix socket
    else:
        raise ValueError(f"{redacted(url)!r} names no server: use memcached://host:port")
    if len(set(servers)) != len(servers):
        raise ValueError(f"{redacted(url)!r} names a server twice")
    pool = options.get("max_connections")
    if pool is not None:
        pool = count("memcached", "max_connections", pool, text=False)

    def option(name: str, default: float, zero: str | None = None) -> float:
        return seconds("memcached", name, options.get(name, default), zero=zero, text=False)

    return Target(
        servers,
        option("socket_timeout", DEFAULT_SOCKET_TIMEOUT),
        option("socket_connect_timeout", DEFAULT_SOCKET_TIMEOUT),
        pool,
        option("patience", PATIENCE_SECONDS, zero="strict hand-over"),
    )


def _pool_maker(target: Target) -> Callable[[str], Pool]:
    def make(server: str) -> Pool:
        return Pool(
            server,
            connect_timeout=target.socket_connect_timeout,
            timeout=target.socket_timeout,
            max_connections=target.max_connections,
        )

    return make


class MemcachedDriver:
    def open(self, url: str, *, namespace: str, options: Mapping[str, object]) -> MemcachedStore:
        target = parse(url, options)
        return MemcachedStore(
            target.servers, namespace, _pool_maker(target), patience=target.patience
        )

    def open_async(self, url: str, *, namespace: str, options: Mapping[str, object]) -> AsyncStore:
        return ThreadedAsyncStore(
            self.open(url, namespace=namespace, options=options), inline=False
        )


driver = MemcachedDriver()

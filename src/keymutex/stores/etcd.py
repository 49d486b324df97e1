"""``etcd[s]://[user:password@]host:port[,…]``: leases in etcd v3, through its JSON gateway.

**Client.** etcd serves its v3 API as JSON over HTTP too (the grpc-gateway, ``/v3/…``,
on the client port, in every etcd since 3.4). keymutex talks to it with httpx: one
plain-Python description of every step below, driven by ``httpx.Client`` or
``httpx.AsyncClient``, so the sync and async stores cannot drift
(``docs/choosing-etcd-client.md`` says why no etcd client library is used).

**Layout.** A lease is one etcd key, ``km/<n>:<namespace>/<key>`` (``n``: the
namespace's length in bytes, so namespaces and keys never run into each other), whose
value is JSON ``{"o": owner, "i": info, "a": acquired-at ms, ["f": fence]}``. The key
is attached to an etcd *lease* of its own: etcd deletes it when the lease expires, by
the etcd leader's clock (``clock="server"``), so a crashed holder's key frees itself.
The token is not stored: the etcd lease's id is derived from it (64 bits of SHA-256 of
the namespace, key and token; ``_lease_ids``), so holding the key *is* having the key
attached to the lease only the token's owner can name.

A key's waiters queue under ``<key name>\\0``: each refused waiter puts one empty *entry*,
``<key name>\\0<its lease id>``, attached to the same etcd lease as the key it will hold.
Entries are served by create revision (etcd's order of arrival): first come, first
served (``fair=True``). An entry lives as long as its lease: a waiter that gives up
revokes it, a holder that came through the queue keeps it until its release (the same
revoke deletes both), a crashed waiter's goes when its lease expires — or, once the key
is free, within seconds: see **Dead waiters** below. Keys never contain NUL, so entries
never look like holders.

**TTLs.** etcd leases live whole seconds, at least etcd's minimum (1.5 election
timeouts, rounded up: 2 s with the default flags), and are revoked by a sweep that runs
every 500 ms. A lease is granted ``ceil(ttl)`` seconds (at least 1) and the client
counts ``ttl`` from before the grant was sent, so the client's deadline is never later
than etcd's. The price: a key whose holder vanished stays held in etcd up to
``max(ceil(ttl), minimum) - ttl`` + 0.5 s past the holder's own deadline (its own
client, which knows the deadline passed, releases it on the next call it makes).

**Steps** (HTTP round trips in brackets; every write — grant, transaction with a put
or a delete, revoke — is a raft entry, fsynced before etcd replies):

- acquire [2]: grant the lease (``ceil(ttl)``), then one transaction: if the key does
  not exist (``create_revision == 0``) and nobody is queued (every key of the queue's
  range has ``create_revision`` 0: there is none), put it with the lease; else read the
  holder and the queue. Refused [+1 to read the holder's lease TTL, +1 to revoke the
  unused lease]. A waiter's first try is the same transaction, which, refused, also
  puts its entry; it keeps its lease for its next tries (one grant per acquire, not per
  try) and revokes it if it gives up.
- a waiter's turn [1]: woken (below), it claims the key with one transaction: if the
  key does not exist and its entry is there and first (every entry's
  ``create_revision`` is at least its own), put the key with its lease. Its lease was
  granted when it started waiting: if less than ``SHORT_GRANT`` of ``ttl`` is left, it
  is refreshed by a keep-alive [+1] (not a write), and ``remaining`` says what is left.
  A contended acquire thus costs etcd four writes in all — grant, queueing transaction,
  claiming transaction, release — and the handoff's path is two of them: the release
  and the claim. A waiter that looks again without being woken (its once-a-second
  recheck) reads the key and the queue first [+1, a read] and claims only on its turn.
  Every look that is not a claim keeps its lease alive [+1, not a write] if its last
  grant or keep-alive was ``HEARTBEAT`` (0.5 s) ago or more: about once a second.
- steal: revoke the holder's lease (etcd deletes its key with it), then create the key
  as an acquire does [+1, +2 more per lost race]. The old token's lease is gone before
  the key is anyone else's, so its renewals and its release fail from then on.
- fence: the key's ``mod_revision`` when granted, which is its ``create_revision``
  (etcd's cluster-wide revision: strictly increasing, never reused, kept across
  restarts: ``durable_fences=True``). A lease moved to another etcd lease (a renewal
  with another TTL) keeps its fence in the value (``"f"``).
- renew [2]: a keep-alive of the lease, then a read that checks the key is still
  attached to it. ``renew_many`` sends every keep-alive in one request (the gateway
  may cut a long stream short: the rest are sent again) and every read in one
  transaction. A renewal with another TTL (``ceil`` differs, or is far shorter) moves
  the key to the token's second lease (``b``, then ``a`` again) in a transaction
  comparing the key's lease [+3].
- release [1]: revoke the token's lease; etcd deletes the key with it, atomically. The
  key is attached to one of the token's leases exactly while the token holds it, so a
  revoke that finds neither lease is a loss [+1 to read the new holder]. A token this
  store was not granted the key to (a release by token from another process) may be
  only waiting, its lease holding a queue entry: the key is read first [+1], and the
  token told it does not hold the key unless the key is on its lease; then both of the
  token's leases are revoked [+1] and the key read again [+1], as renewals *with
  another TTL* by its holder may move the key from one to the other meanwhile. (Calls
  with one token through one store do not race: a lease renews under its own lock.)
  Known limit: renewals of one token *with different TTLs* from two processes at the
  same moment do race. A move's clean-up revoke may end the lease the other just moved
  the key back onto (etcd deletes the key, while both renewals said "renewed"), and the
  holder's own release may revoke the lease the key has just left (the key stays held
  for the other TTL). Where several processes renew one lease by token, give them one
  TTL: renewals that keep the TTL never move the key.
- holder / holders [1 + 1 per lease]: a range read, then each lease's remaining TTL
  (whole seconds: ``expires_at`` is for display, up to a second early).

**Waiting.** Each store opens, on its first refused waiter, one watch stream on its
namespace's key range (deletions only), shared by all its waiters. The stream starts at
the revision right after the refusal, so a release between the refusal and the watch is
still seen; a deletion the stream delivers while the waiter's try is still under way is
kept and weighed against what that try saw (``_View``), so none is missed either. A
waiter is rung only when its turn may have come: every entry that was ahead of it at
its refusal is deleted and the key has no holder. A release wakes the one waiter next
in line, not the herd, and an acquire that arrives meanwhile queues behind it. The
stream is closed ``LINGER`` seconds after its last waiter left. Everything deleted in
the namespace reaches every store that waits in it: keep busy, unrelated keys in
different namespaces.

**Dead waiters.** A crashed waiter's entry would hold up everyone behind it (and every
try that does not wait) until its lease expired: up to its whole TTL. A live waiter
keeps its lease alive at each look (above), so the lease's age since its last
keep-alive, which etcd tells every client (``grantedTTL - TTL`` of
``/v3/lease/timetolive``, by the etcd leader's clock), says whether the waiter lives.
A refused try that finds the key without a holder reads the lease of the first entry
[+1] (and of the next ones, while they are dead, ``DEAD_TURNS_CHECKED`` at most): an
entry whose lease went more than ``HANDOVER_GRACE`` (3 s) without a keep-alive is
deleted, in one transaction that checks the key still has no holder and each entry is
unchanged [+1]. Any client does so, fresh or not, on its first look: nothing is
counted in a client's memory. A try that does not wait and has so passed every queued
turn tries once more [+1 to revoke its lease, +2] and gets the key (unless another
try got it first); a waiter behind is rung. So the key is free for everyone
``HANDOVER_GRACE`` after the dead waiter's last keep-alive (which came before its
death), or at once if that was longer ago (etcd's TTL left, rounded down to whole
seconds, bounds the lease's age from below: ``grantedTTL - TTL - 1``). Entries of
keymutex versions that kept no heartbeat may see their turn passed the same way if
the waiter does not claim at once. A live waiter is rung and claims within
milliseconds of the release; one stalled for more than about 2 s (a GC pause, a
suspended process: ``HANDOVER_GRACE`` minus its once-a-second look) just when the key
is free may have its turn passed: its claim then finds its entry gone and it queues
again, at the back. It never holds the key with another: the key is created only by a
transaction that checks it does not exist.

**Security.** ``etcds://`` speaks TLS to every endpoint (``ca_file``: a private CA,
else the system's; ``cert_file``/``key_file``: a client certificate for etcd's
``--client-cert-auth``). With credentials (``etcd[s]://user:password@…``, or the options
``username``/``password``) the store logs in (``/v3/auth/authenticate``) on its first
request and sends etcd's token with every request and watch; when etcd says a token
is no longer valid (its TTL, a member's restart), the store logs in again and sends the
refused request once more: etcd refused it before carrying it out. The user's role needs
read-write on ``km/``, or on ``km/<n>:<namespace>/`` for one namespace (leases too:
etcd lets a user revoke a lease only if it may write every key attached to it).

**Failures.** Every request goes to the first endpoint that accepts a connection
(etcd forwards to the leader); a refused connection moves on to the next endpoint at
once, any other failure raises ``StoreError`` (nothing is sent twice) and the next
requests go to the next endpoint. The watch stream follows them: one open on the
endpoint they left is closed and opened again where they go, resuming where it was
(a member that hangs, its sockets open, would keep it silent for as long as it hangs).
While the cluster has no quorum, writes fail after the request timeout (``timeout``,
5 s).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import math
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from keymutex import _clock
from keymutex._errors import StoreError
from keymutex._lease import Holder, Outcome
from keymutex._store import Capabilities, RenewRequest, stop_task, translate_errors
from keymutex._urls import check_host
from keymutex.stores._doorbell import Doorbell, LoopDoorbell
from keymutex.stores._settings import TLS_OPTIONS, digits, seconds, settings_of, tls_files

__all__ = ["AsyncEtcdStore", "EtcdDriver", "EtcdStore", "driver"]

_LOG = logging.getLogger("keymutex")

CAPABILITIES = Capabilities(
    notifies=True, fair=True, cross_process=True, durable_fences=True, clock="server"
)
DEFAULT_PORT = 2379
DEFAULT_TIMEOUT = 5.0
# The watch stream stays open this long after its last waiter left, so that a process
# that keeps contending opens it once.
LINGER = 5.0
# Operations in one transaction: etcd refuses more (its --max-txn-ops, 128 by default).
MAX_TXN_OPS = 128
# A renewal asking for a TTL this much shorter than the lease has moves the key to a
# lease of the requested TTL (a small difference is etcd's minimum TTL at work, and so
# is a larger one once a move's grant has shown it: _Layout.ttl_floor).
SHORTEN_FACTOR = 2

T = TypeVar("T")

# gRPC status codes in the gateway's error replies.
_INVALID_ARGUMENT = 3
_NOT_FOUND = 5
_FAILED_PRECONDITION = 9
_UNAVAILABLE = 14
_UNAUTHENTICATED = 16


class _ReplyError(Exception):
    """etcd answered with an error (``code`` is a gRPC status code)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"etcd error {code}: {message}")
        self.code = code
        self.message = message


_DRIVER_ERRORS = (httpx.HTTPError, OSError, _ReplyError, ValueError)


# -- requests and replies (no I/O) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Call:
    """One HTTP request to the gateway: ``path`` and its JSON ``body``.

    ``stream`` calls (keep-alive) send one JSON document per line and get one reply line
    per document; their reply is the list of ``result`` objects.
    """

    path: str
    body: Any
    stream: bool = False


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _range_end(prefix: bytes) -> bytes:
    """The smallest key after every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # the whole keyspace


def _int(value: Any) -> int:
    return int(value) if value is not None else 0


def etcd_ttl(ttl: float) -> int:
    """The etcd lease TTL for a keymutex TTL: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(ttl))


@dataclass(frozen=True, slots=True)
class _Kv:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int
    create_revision: int = 0

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> _Kv:
        return cls(
            _unb64(raw["key"]),
            _unb64(raw.get("value", "")),
            _int(raw.get("mod_revision")),
            _int(raw.get("lease")),
            _int(raw.get("create_revision")),
        )

    def record(self) -> dict[str, Any]:
        decoded = json.loads(self.value)
        assert isinstance(decoded, dict)
        return decoded

    def fence(self) -> int:
        return int(self.record().get("f", self.mod_revision))


def _first_kv(range_response: Mapping[str, Any]) -> _Kv | None:
    kvs = range_response.get("kvs") or ()
    return _Kv.of(kvs[0]) if kvs else None


def _all_kvs(range_response: Mapping[str, Any]) -> list[_Kv]:
    return [_Kv.of(raw) for raw in range_response.get("kvs") or ()]


def _encode_record(owner: str, info: dict[str, Any] | None, acquired_ms: int) -> bytes:
    return json.dumps({"o": owner, "i": info, "a": acquired_ms}, separators=(",", ":")).encode()


class _Layout:
    """Names of one namespace's etcd keys, the lease ids of a token, and etcd's minimum
    lease TTL once a grant has shown it (what the flows learn of the cluster)."""

    __slots__ = ("namespace", "prefix", "ttl_floor")

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        name = namespace.encode()
        self.prefix = b"km/%d:" % len(name) + name + b"/"
        # etcd's minimum lease TTL, once a move's grant showed it (0: not seen yet).
        self.ttl_floor = 0

    def granted(self, asked: int, got: int) -> None:
        """etcd granted ``got`` seconds for ``asked``: more is its minimum TTL."""
        if got > asked:
            self.ttl_floor = max(self.ttl_floor, got)

    def name(self, key: str) -> bytes:
        return self.prefix + key.encode()

    def key_of(self, name: bytes) -> str:
        """The key of a holder name or of a queue entry name."""
        return name[len(self.prefix) :].partition(b"\0")[0].decode()

    def is_entry(self, name: bytes) -> bool:
        return b"\0" in name[len(self.prefix) :]

    def queue(self, key: str) -> tuple[bytes, bytes]:
        """The range of ``key``'s queue entries: ``<name>\\0…`` (keys never contain NUL)."""
        name = self.name(key)
        return name + b"\0", name + b"\1"

    def entry(self, key: str, lease: int) -> bytes:
        """The queue entry of the waiter whose etcd lease is ``lease``."""
        return self.name(key) + b"\0%016x" % lease

    def lease_ids(self, key: str, token: str) -> tuple[int, int]:
        """The two etcd lease ids of ``token`` on ``key`` (``a``, and ``b`` for a move).

        64 bits of SHA-256 (63 kept: etcd ids are positive int64): only the token's
        owner can name them, and etcd readers see the ids, never the token.
        """
        ids = []
        for generation in (b"a", b"b"):
            digest = hashlib.sha256(
                b"keymutex-etcd\0%s\0%s\0%s" % (self.name(key), token.encode(), generation)
            ).digest()
            ids.append(int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF or 1)
        return ids[0], ids[1]


def _grant(lease: int, ttl: int) -> _Call:
    return _Call("/v3/lease/grant", {"ID": str(lease), "TTL": str(ttl)})


def _revoke(lease: int) -> _Call:
    return _Call("/v3/lease/revoke", {"ID": str(lease)})


def _time_to_live(lease: int) -> _Call:
    return _Call("/v3/lease/timetolive", {"ID": str(lease)})


def _keepalive(leases: Sequence[int]) -> _Call:
    return _Call("/v3/lease/keepalive", [{"ID": str(lease)} for lease in leases], stream=True)


def _txn(
    compare: Sequence[dict[str, Any]],
    success: Sequence[dict[str, Any]],
    failure: Sequence[dict[str, Any]] = (),
) -> _Call:
    return _Call(
        "/v3/kv/txn",
        {"compare": list(compare), "success": list(success), "failure": list(failure)},
    )


def _op_range(name: bytes) -> dict[str, Any]:
    return {"request_range": {"key": _b64(name)}}


def _op_put(name: bytes, value: bytes, lease: int, *, prev_kv: bool = False) -> dict[str, Any]:
    return {
        "request_put": {
            "key": _b64(name),
            "value": _b64(value),
            "lease": str(lease),
            "prev_kv": prev_kv,
        }
    }


def _op_delete(name: bytes) -> dict[str, Any]:
    return {"request_delete_range": {"key": _b64(name)}}


def _leased_by(name: bytes, lease: int) -> dict[str, Any]:
    return {"target": "LEASE", "key": _b64(name), "result": "EQUAL", "lease": str(lease)}


def _responses(reply: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(reply.get("responses") or ())


# -- the steps, as flows: generators that yield calls and receive replies -------------
#
# A flow yields ``_Call``s; its driver (sync or async) sends each and sends the decoded
# reply back in, or throws ``_ReplyError`` in when etcd answered with an error. The
# flow's return value is the step's answer. Nothing here does I/O or sleeps.

Flow = Generator[_Call, Any, T]


def _holder_of(key: str, kv: _Kv, seconds_left: float) -> Holder:
    record = kv.record()
    return Holder(
        key=key,
        owner=str(record["o"]),
        info=record.get("i"),
        fence=kv.fence(),
        acquired_at=int(record["a"]) / 1000,
        expires_at=time.time() + max(0.0, seconds_left),
    )


def _lease_left(lease: int) -> Flow[int | None]:
    """Whole seconds left on ``lease`` (rounded down), ``None`` once it is gone."""
    reply = yield _time_to_live(lease)
    left = _int(reply.get("TTL"))
    return None if left < 0 else left


def _current_holder(key: str, kv: _Kv | None) -> Flow[Holder | None]:
    if kv is None:
        return None
    left = yield from _lease_left(kv.lease)
    return None if left is None else _holder_of(key, kv, left)


def _quietly_revoke(lease: int) -> Flow[None]:
    try:
        yield _revoke(lease)
    except _ReplyError as exc:
        if exc.code != _NOT_FOUND:
            raise


def _keep_alive(leases: Sequence[int]) -> Flow[dict[int, int]]:
    """Keep ``leases`` alive, in as few requests as the gateway allows: id -> TTL left.

    A TTL of 0 means the lease is gone (expired, revoked, or never granted). Renewing
    a lease twice is harmless, so the leases a cut-short stream left out are sent again.
    """
    left: dict[int, int] = {}
    remaining = list(dict.fromkeys(leases))
    while remaining:
        results = yield _keepalive(remaining)
        for result in results:
            left[_int(result.get("ID"))] = _int(result.get("TTL"))
        missing = [lease for lease in remaining if lease not in left]
        if len(missing) == len(remaining):
            raise _ReplyError(_UNAVAILABLE, "etcd answered no keep-alive")
        remaining = missing
    return left


def _fresh_lease(lease: int, ttl: int) -> Flow[int]:
    """Grant ``lease`` for ``ttl`` s (or refresh it, if a refused try left it); its TTL."""
    try:
        reply = yield _grant(lease, ttl)
        return _int(reply.get("TTL"))
    except _ReplyError as exc:
        if exc.code != _FAILED_PRECONDITION:  # not "lease already exists"
            raise
    left = (yield from _keep_alive([lease]))[lease]
    if left > 0:
        return left
    reply = yield _grant(lease, ttl)  # it expired in between
    return _int(reply.get("TTL"))


@dataclass
class _Place:
    """A waiter's etcd lease and its place in its key's queue, kept from try to try.

    The flow of a try updates it as it goes, so that a try cut short by an error or a
    cancellation still leaves the lease where the waiter's ``close`` revokes it (which
    deletes its queue entry with it).
    """

    lease: int = 0  # the etcd lease this waiter's tries use (0: none yet)
    granted: int = 0  # its TTL as etcd granted it, in seconds
    kept_until: float = 0.0  # a monotonic time before which etcd will not expire it
    kept_at: float = 0.0  # when its last grant or keep-alive was sent (monotonic)
    created: int = 0  # the create revision of its queue entry (0: not queued)
    rung: bool = True  # whether the next try follows a wake-up (else it looks first)


@dataclass(frozen=True, slots=True)
class _Refusal:
    """What a refused waiter saw at ``revision``: the queue entries ahead of it
    (``None``: unknown, try again at once) and whether the key had a holder."""

    revision: int
    ahead: frozenset[bytes] | None
    held: bool


@dataclass(frozen=True, slots=True)
class _Acquired:
    outcome: Outcome
    refusal: _Refusal | None = None  # a refused waiter's view (None for other callers)
    again: bool = False  # a try that does not wait passed dead turns: the key is free


STEAL_ATTEMPTS = 5
# Reads of a key after a release by token revoked its token's leases, while the holder's
# renewals move it between them (each move is three requests: this is plenty).
RACE_ROUNDS = 3
# A kept lease with at least this long to live is used as it is and refreshed after
# the grant (its transaction cannot outlast it).
REFRESH_AFTER_MIN = 0.5
# A waiter granted the key keeps what is left of the lease it took for the wait when
# that is at least this part of ``ttl`` (it waited briefly: the common handoff), and
# saves a refresh, one round trip, on the handoff's path; after a longer wait it
# refreshes the lease first. ``remaining`` says what is left either way.
SHORT_GRANT = 0.98
# A refused waiter refreshes its lease once less than this part of it is left; it
# looks again, at the latest, when a third is left (its refusal's ``remaining``), so its
# lease (and its place in the queue) never runs out while it waits.
REFRESH_BELOW = 2 / 3
# A waiter keeps its etcd lease alive at every look (its once-a-second recheck, a
# refused claim) once this long has passed since the last grant or keep-alive: the
# lease's age since then, which etcd tells anyone (``grantedTTL - TTL``), says the
# waiter is alive.
HEARTBEAT = 0.5
# A queued waiter whose etcd lease has gone more than this long without a keep-alive,
# by etcd's clock, is dead or stuck: while the key has no holder, any client that sees
# its entry first in the queue deletes it (it would otherwise block the key until the
# lease expires, up to the waiter's whole TTL). A live waiter keeps it alive every
# second, and claims within milliseconds of its ring.
HANDOVER_GRACE = 3.0
# Dead turns looked at by one try (a lease TTL read each).
DEAD_TURNS_CHECKED = 8


def _created_is(name: bytes, revision: int) -> dict[str, Any]:
    return {
        "target": "CREATE",
        "key": _b64(name),
        "result": "EQUAL",
        "create_revision": str(revision),
    }


def _all_created(span: tuple[bytes, bytes], result: str, revision: int) -> dict[str, Any]:
    """Every key of ``span`` (none: a key of create revision 0) compares so to ``revision``."""
    return {
        "target": "CREATE",
        "key": _b64(span[0]),
        "range_end": _b64(span[1]),
        "result": result,
        "create_revision": str(revision),
    }


def _op_range_of(span: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"request_range": {"key": _b64(span[0]), "range_end": _b64(span[1])}}


def _hold_lease(place: _Place, lease: int, seconds: int) -> Flow[None]:
    """Grant ``lease`` (or refresh the one ``place`` keeps); note until when etcd keeps it."""
    sent = _clock.monotonic()
    if place.lease:
        left = (yield from _keep_alive([lease]))[lease]
        if left > 0:
            place.kept_until, place.kept_at = sent + left, sent
            return
        place.created = 0  # expired, and its queue entry with it
    granted = yield from _fresh_lease(lease, seconds)
    place.lease, place.granted, place.kept_until = lease, granted, sent + granted
    place.kept_at = sent


def _claim_call(
    layout: _Layout, key: str, value: bytes, lease: int, place: _Place | None, steal: bool
) -> _Call:
    """The transaction that creates ``key``'s holder, attached to ``lease``.

    If: the key has no holder, and (unless ``steal``) nobody is queued — or, for a queued
    waiter, its entry is still there and first in the queue. Else: a waiter puts its queue
    entry (again: same create revision), and the holder and the queue are read.
    """
    name = layout.name(key)
    queue = layout.queue(key)
    compare = [_created_is(name, 0)]
    if not steal:
        if place is not None and place.created:
            entry = layout.entry(key, lease)
            compare += [
                _created_is(entry, place.created),
                _all_created(queue, "GREATER", place.created - 1),
            ]
        else:
            compare.append(_all_created(queue, "EQUAL", 0))  # the queue is empty
    failure = [_op_range(name)]
    if place is not None:
        failure.insert(0, _op_put(layout.entry(key, lease), b"", lease, prev_kv=True))
    if not steal:
        failure.append(_op_range_of(queue))
    return _txn(compare, [_op_put(name, value, lease)], failure)


def _acquire(
    layout: _Layout,
    key: str,
    token: str,
    ttl: float,
    owner: str,
    info: dict[str, Any] | None,
    steal: bool,
    place: _Place | None,
) -> Flow[_Acquired]:
    """Try to grant ``key`` (``_attempt``); once more if the try, which does not wait,
    found the key free and passed the turns of dead waiters: nobody else is queued."""
    done = yield from _attempt(layout, key, token, ttl, owner, info, steal, place)
    if done.again:
        done = yield from _attempt(layout, key, token, ttl, owner, info, steal, place)
    return _Acquired(done.outcome, done.refusal)


def _attempt(
    layout: _Layout,
    key: str,
    token: str,
    ttl: float,
    owner: str,
    info: dict[str, Any] | None,
    steal: bool,
    place: _Place | None,
) -> Flow[_Acquired]:
    """Try to grant ``key``; a waiter (``place``) keeps its etcd lease and its queue entry.

    A first try grants the token's etcd lease and creates the holder key if the key is
    free and nobody is queued; a refused waiter puts its queue entry in the same
    transaction (so the release it waits for comes after it is queued). Its next try,
    once its watch rings, creates the holder key if its entry is first in the queue; a
    try that follows no ring (a recheck) reads first, and claims only if it is its turn.

    A steal revokes the holder's etcd lease (which deletes the key), then creates the
    key as an acquire does, whoever is queued: the old token's lease is gone before the
    key is anyone else's, so its renewals and its release fail from then on.
    """
    name = layout.name(key)
    lease, _ = layout.lease_ids(key, token)
    seconds = etcd_ttl(ttl)
    started = _clock.monotonic()
    waiting = place is not None
    place = _Place() if place is None else place
    if not place.lease or place.kept_until - started < REFRESH_AFTER_MIN:
        yield from _hold_lease(place, lease, seconds)
    if waiting and place.created and not place.rung:
        # A recheck, not a wake-up: look (a read, not a raft write) before claiming.
        reply = yield _txn((), [_op_range(name), _op_range_of(layout.queue(key))])
        holder_kv = _first_kv(_responses(reply)[0]["response_range"])
        queue = _all_kvs(_responses(reply)[1]["response_range"])
        own = layout.entry(key, lease)
        mine = [kv for kv in queue if kv.key == own]
        if not mine or mine[0].create_revision != place.created:
            place.created = 0  # the entry is gone: queue again, at the back
        elif holder_kv is not None or any(kv.create_revision < place.created for kv in queue):
            revision = _int(reply["header"].get("revision"))
            return (yield from _refused(layout, key, place, lease, holder_kv, queue, revision))
    acquired_ms = math.floor(time.time() * 1000)
    value = _encode_record(owner, info, acquired_ms)
    for _ in range(STEAL_ATTEMPTS if steal else 1):
        try:
            reply = yield _claim_call(layout, key, value, lease, place if waiting else None, steal)
        except _ReplyError as exc:
            if exc.code != _NOT_FOUND:
                raise
            # The lease is gone after all (revoked by hand, or etcd lost it), and the
            # queue entry with it.
            started = _clock.monotonic()
            place.lease = place.created = 0
            yield from _hold_lease(place, lease, seconds)
            reply = yield _claim_call(layout, key, value, lease, place if waiting else None, steal)
        if reply.get("succeeded") or not steal:
            break
        current = _first_kv(_responses(reply)[0]["response_range"])
        if current is None:
            break
        yield from _quietly_revoke(current.lease)  # deletes the key with it
    revision = _int(reply["header"].get("revision"))
    if reply.get("succeeded"):
        granted_to = Holder(key, owner, info, revision, acquired_ms / 1000, time.time() + ttl)
        remaining = min(ttl, place.kept_until - started)
        if remaining < SHORT_GRANT * ttl:
            # A lease kept through a long wait: refresh it now that it holds the key.
            # Sent after ``started``: etcd's new expiry is later than started + left.
            left = (yield from _keep_alive([lease]))[lease]
            if left <= 0:  # expired under us, and the key with it: not granted
                place.lease = place.created = 0
                return _Acquired(Outcome(False, None), _Refusal(revision, None, False))
            remaining = min(ttl, left)
        place.lease = 0  # the lease is the holder's now: the waiter must not revoke it
        return _Acquired(Outcome(True, granted_to, remaining))
    responses = _responses(reply)
    if waiting:
        put = responses.pop(0)["response_put"]
        previous = put.get("prev_kv")
        place.created = _int(previous.get("create_revision")) if previous else revision
    holder_kv = _first_kv(responses[0]["response_range"])
    if not steal and holder_kv is not None and holder_kv.lease in layout.lease_ids(key, token):
        kept = place if waiting else None
        return (yield from _held_already(layout, key, kept, lease, holder_kv, revision))
    queue = _all_kvs(responses[1]["response_range"]) if not steal else []
    return (
        yield from _refused(
            layout, key, place if waiting else None, lease, holder_kv, queue, revision
        )
    )


def _held_already(
    layout: _Layout, key: str, place: _Place | None, lease: int, holder_kv: _Kv, revision: int
) -> Flow[_Acquired]:
    """The token's own lease holds ``key``: a retried acquire whose first reply was lost
    (the lock server retries so). Answered with that lease as it stands: its fence,
    owner and info. The try's lease, if the key is on the token's other one, is revoked
    (with the queue entry a waiter's refused try just put); else that entry is deleted.
    """
    if holder_kv.lease != lease:
        yield from _quietly_revoke(lease)
    elif place is not None:
        yield _txn([], [_op_delete(layout.entry(key, lease))])
    if place is not None:
        place.lease = place.created = 0  # the lease is the holder's: never revoke it
    left = yield from _lease_left(holder_kv.lease)
    if left is None:  # expired meanwhile: the key is free, or somebody else's
        return _Acquired(Outcome(False, None), _Refusal(revision, None, False))
    return _Acquired(Outcome(True, _holder_of(key, holder_kv, left), float(left)))


def _idle(lease: int) -> Flow[float | None]:
    """How long ``lease`` has gone without a grant or keep-alive, by etcd's clock: a lower
    bound (etcd rounds the TTL left down to whole seconds); ``None`` once it is gone."""
    if not lease:
        return None  # not a waiter's entry: nothing keeps it alive
    reply = yield _time_to_live(lease)
    left = _int(reply.get("TTL"))
    if left < 0:
        return None
    return float(_int(reply.get("grantedTTL")) - left - 1)


def _pass_dead_turns(layout: _Layout, key: str, own: bytes, queue: list[_Kv]) -> Flow[list[_Kv]]:
    """``key``'s queue without the dead waiters at its head (the key has no holder).

    The first entries whose etcd lease went more than ``HANDOVER_GRACE`` s without a
    keep-alive (etcd says so, to every client alike) are deleted, in one transaction
    that checks the key still has no holder and each entry is unchanged (a waiter whose
    claim was refused puts its entry again). A waiter that was only stalled finds its
    entry gone and queues again, at the back; the key is only ever created by one.
    """
    dead: list[_Kv] = []
    for kv in sorted(queue, key=lambda kv: kv.create_revision)[:DEAD_TURNS_CHECKED]:
        if kv.key == own:
            break
        idle = yield from _idle(kv.lease)
        if idle is not None and idle < HANDOVER_GRACE:
            break  # alive: its turn
        dead.append(kv)
    if not dead:
        return queue
    unchanged = [
        {
            "target": "MOD",
            "key": _b64(kv.key),
            "result": "EQUAL",
            "mod_revision": str(kv.mod_revision),
        }
        for kv in dead
    ]
    reply = yield _txn(
        [_created_is(layout.name(key), 0), *unchanged], [_op_delete(kv.key) for kv in dead]
    )
    if not reply.get("succeeded"):
        return queue  # claimed, or changed meanwhile: the next try looks again
    _LOG.warning(
        "etcd: %d waiter(s) for %r kept no lease alive for %g s; their turn passes",
        len(dead),
        key,
        HANDOVER_GRACE,
    )
    gone = {kv.key for kv in dead}
    return [kv for kv in queue if kv.key not in gone]


def _refused(
    layout: _Layout,
    key: str,
    place: _Place | None,
    lease: int,
    holder_kv: _Kv | None,
    queue: list[_Kv],
    revision: int,
) -> Flow[_Acquired]:
    """The answer to a refused try, given the holder and the queue it saw at ``revision``.

    Reads the holder's lease (for its expiry), passes the turns of dead waiters
    (``_pass_dead_turns``); a waiter keeps its lease alive (``HEARTBEAT``), another
    caller revokes it, and tries again if it passed every queued turn.
    """
    holder = yield from _current_holder(key, holder_kv)
    passed = False
    if holder_kv is None and queue:
        left = yield from _pass_dead_turns(layout, key, layout.entry(key, lease), queue)
        passed, queue = len(left) < len(queue), left
    if place is None:
        yield from _quietly_revoke(lease)
        return _Acquired(Outcome(False, holder), again=passed and not queue)
    now = _clock.monotonic()
    if now - place.kept_at >= HEARTBEAT or place.kept_until - now < REFRESH_BELOW * place.granted:
        yield from _hold_lease(place, lease, place.granted)
    # ``remaining`` tells the waiter when to look again at the latest: while a third of
    # its lease is left, so that the look refreshes it (a lease as short as etcd's
    # minimum outlives no once-a-second recheck). The holder's expiry needs no such
    # wake-up: etcd deletes its key, and the watch rings.
    look_again = place.kept_until - _clock.monotonic() - place.granted / 3
    ahead = frozenset(kv.key for kv in queue if 0 < kv.create_revision < place.created)
    return _Acquired(
        Outcome(False, holder, max(0.0, look_again)),
        _Refusal(revision, ahead, holder_kv is not None),
    )


def _needs_move(granted: int, wanted: int) -> bool:
    """Whether a lease of ``granted`` seconds must move to one of ``wanted`` seconds."""
    return granted < wanted or granted > SHORTEN_FACTOR * wanted + 2


def _renew_many(layout: _Layout, requests: Sequence[RenewRequest]) -> Flow[list[Outcome]]:
    ids = [layout.lease_ids(r.key, r.token) for r in requests]
    # Keep-alive first, then look: a lease found attached after its keep-alive was
    # extended while it held the key.
    left = yield from _keep_alive([lease for pair in ids for lease in pair])
    kvs: list[_Kv | None] = []
    for start in range(0, len(requests), MAX_TXN_OPS):  # etcd refuses longer transactions
        chunk = requests[start : start + MAX_TXN_OPS]
        reply = yield _txn((), [_op_range(layout.name(r.key)) for r in chunk])
        kvs += [_first_kv(response["response_range"]) for response in _responses(reply)]
    outcomes = []
    for request, (a, b), kv in zip(requests, ids, kvs, strict=True):
        alive = {a: left[a], b: left[b]}
        if kv is None or kv.lease not in alive:
            # Taken over or expired: drop what is left of our leases.
            for lease, seconds in alive.items():
                if seconds > 0:
                    yield from _quietly_revoke(lease)
            holder = yield from _current_holder(request.key, kv)
            outcomes.append(Outcome(False, holder))
            continue
        seconds = alive[kv.lease]
        if seconds <= 0:  # expired; etcd's sweep has not deleted the key yet
            outcomes.append(Outcome(False, None))
            continue
        # Not to shorten a lease to what etcd's minimum would make as long again: found
        # by review, with a minimum of 5 s (a 3-s election timeout) every renewal of a
        # 1-s lease moved its key, 3 requests and 2 raft writes more each time.
        if _needs_move(seconds, max(etcd_ttl(request.ttl), layout.ttl_floor)):
            other = b if kv.lease == a else a
            outcome = yield from _move(layout, request, kv, other, alive[other] > 0)
            outcomes.append(outcome)
            continue
        holder = _holder_of(request.key, kv, seconds)
        outcomes.append(Outcome(True, holder, float(seconds)))
    return outcomes


def _move(
    layout: _Layout, request: RenewRequest, kv: _Kv, target: int, target_exists: bool
) -> Flow[Outcome]:
    """Move the key from its lease to ``target``, granted ``ceil(request.ttl)`` s."""
    name = layout.name(request.key)
    if target_exists:
        yield from _quietly_revoke(target)  # left behind by an interrupted move
    reply = yield _grant(target, etcd_ttl(request.ttl))
    granted = _int(reply.get("TTL"))
    layout.granted(etcd_ttl(request.ttl), granted)
    record = kv.record()
    record["f"] = kv.fence()
    value = json.dumps(record, separators=(",", ":")).encode()
    reply = yield _txn(
        [_leased_by(name, kv.lease)], [_op_put(name, value, target)], [_op_range(name)]
    )
    if reply.get("succeeded"):
        yield from _quietly_revoke(kv.lease)
        moved = _Kv(name, value, kv.mod_revision, target)
        return Outcome(True, _holder_of(request.key, moved, granted), float(granted))
    yield from _quietly_revoke(target)
    current = _first_kv(_responses(reply)[0]["response_range"])
    holder = yield from _current_holder(request.key, current)
    return Outcome(False, holder)


def _release(layout: _Layout, key: str, token: str, *, granted: bool) -> Flow[Outcome]:
    """Revoke the token's etcd lease: etcd deletes the key with it, in one step.

    A token this store was granted the key to (``granted``) has the key attached to one
    of its two leases exactly while it holds it (a steal revokes the holder's lease
    before it takes the key), so a revoke that finds the lease is a release; one that
    finds neither lease is a loss. Another token (a release by token from elsewhere)
    may only be *waiting* for the key, its lease holding a queue entry: the key is read
    first [+1], and unless it is on one of the token's leases the token is told it does
    not hold the key, and its wait goes on. If it is, both of the token's leases are
    revoked, and the key read again [+1]: renewals with another TTL by its holder may
    have moved it from one lease to the other meanwhile, onto one already revoked
    before it arrived; that one is revoked again, a few rounds at most.
    """
    ids: tuple[int, ...] = layout.lease_ids(key, token)
    if not granted:
        reply = yield _Call("/v3/kv/range", {"key": _b64(layout.name(key))})
        kv = _first_kv(reply)
        if kv is None or kv.lease not in ids:
            holder = yield from _current_holder(key, kv)
            return Outcome(False, holder)
        # The lease read first, then the other, even after the first was found: a
        # renewal with another TTL may move the key to the token's other lease
        # meanwhile, and revoke the first lease only after (a holder is never also
        # queued: the other lease holds no queue entry).
        ids = (kv.lease, *(lease for lease in ids if lease != kv.lease))
    released = False
    for lease in ids:
        try:
            yield _revoke(lease)
        except _ReplyError as exc:
            if exc.code != _NOT_FOUND:
                raise
        else:
            if granted:
                return Outcome(True)
            released = True
    for _ in range(RACE_ROUNDS if released else 0):
        reply = yield _Call("/v3/kv/range", {"key": _b64(layout.name(key))})
        kv = _first_kv(reply)
        if kv is None or kv.lease not in ids:
            return Outcome(True)
        yield from _quietly_revoke(kv.lease)  # moved there after its revoke
    if released:
        raise StoreError(
            f"etcd release of {key!r}: its holder's renewals kept moving the key between"
            f" the token's leases ({RACE_ROUNDS} rounds); try again"
        )
    reply = yield _Call("/v3/kv/range", {"key": _b64(layout.name(key))})
    holder = yield from _current_holder(key, _first_kv(reply))
    return Outcome(False, holder)


def _holders(layout: _Layout, prefix: str) -> Flow[list[Holder]]:
    start = layout.name(prefix)
    reply = yield _Call("/v3/kv/range", {"key": _b64(start), "range_end": _b64(_range_end(start))})
    found = []
    for raw in reply.get("kvs") or ():
        kv = _Kv.of(raw)
        if layout.is_entry(kv.key):
            continue  # a waiter's place in a queue
        holder = yield from _current_holder(layout.key_of(kv.key), kv)
        if holder is not None:
            found.append(holder)
    return found


def _holder(layout: _Layout, key: str) -> Flow[Holder | None]:
    reply = yield _Call("/v3/kv/range", {"key": _b64(layout.name(key))})
    holder = yield from _current_holder(key, _first_kv(reply))
    return holder


# -- transport -----------------------------------------------------------------------


def _decode(call: _Call, response: httpx.Response) -> Any:
    """The reply of ``call``; ``_ReplyError`` when etcd answered with an error."""
    if call.stream:
        # The gateway may end the stream before every request got its reply (it does
        # under load); callers ask again for the rest (``_keep_alive``).
        results = []
        for line in response.text.splitlines():
            if line.strip():
                results.append(_result(json.loads(line)))
        return results
    reply = response.json()
    if not isinstance(reply, dict):
        raise ValueError(f"not an etcd reply: {response.text[:80]!r}")
    if response.status_code != 200 or "error" in reply:
        raise _ReplyError(_int(reply.get("code")), str(reply.get("message") or reply))
    if "header" not in reply:  # every reply of etcd's gateway has one
        raise ValueError(f"not an etcd reply: {response.text[:80]!r}")
    return reply


def _result(message: Any) -> Any:
    """One line of a streamed reply. Anything but etcd's is a ``ValueError`` (found by
    review: a URL naming another service gave AttributeError, KeyError or TypeError
    instead of StoreError, and a holder read of it said the key was free)."""
    if not isinstance(message, dict) or not ("result" in message or "error" in message):
        raise ValueError(f"not an etcd reply: {str(message)[:80]!r}")
    if "error" in message:
        error = message["error"]
        if not isinstance(error, dict):
            raise ValueError(f"not an etcd error: {str(error)[:80]!r}")
        raise _ReplyError(_int(error.get("grpc_code", error.get("code"))), str(error))
    result = message["result"]
    if not isinstance(result, dict):
        raise ValueError(f"not an etcd result: {str(result)[:80]!r}")
    return result


def _content(call: _Call) -> bytes:
    if call.stream:
        return b"\n".join(json.dumps(part).encode() for part in call.body)
    return json.dumps(call.body).encode()


class _Endpoints:
    """The cluster's client URLs and which one is in use (the next after a failure).

    Listeners (``when_left``) hear each move away from a URL: the store's watch stream
    follows the steps to their new member (``_WatchHub._steps_left``).
    """

    def __init__(self, urls: Sequence[str]) -> None:
        self._urls = list(urls)
        self._current = 0
        self._mutex = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []

    def __len__(self) -> int:
        return len(self._urls)

    def current(self) -> str:
        return self._urls[self._current]

    def when_left(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(url)`` after each move of the requests away from ``url``."""
        self._listeners.append(listener)

    def failed(self, url: str) -> None:
        """``url`` failed a request: the next ones go to the next URL (unless another
        failure moved them already), and the listeners hear it, outside the mutex."""
        with self._mutex:
            if self._urls[self._current] != url:
                return
            self._current = (self._current + 1) % len(self._urls)
            if self._urls[self._current] == url:
                return  # one endpoint: nowhere to move to
        for listener in self._listeners:
            listener(url)


class _Auth:
    """etcd's auth token for one user, shared by a store's requests and watch streams.

    Fetched by the first request (``/v3/auth/authenticate``) and again when etcd says
    the token is no longer valid (simple tokens die with the member that issued them,
    and after ``--auth-token-ttl`` unused; JWTs at their expiry). A request that etcd
    refused for its token was not carried out, so it is sent again once, with the new
    token. The password and the token are never logged nor put in an error message.
    """

    def __init__(self, username: str, password: str) -> None:
        self.username = username
        self._password = password
        self._mutex = threading.Lock()
        self.token: str | None = None

    def __repr__(self) -> str:
        return f"<etcd credentials of {self.username!r}>"

    def login(self) -> _Call:
        return _Call("/v3/auth/authenticate", {"name": self.username, "password": self._password})

    def learn(self, reply: Mapping[str, Any]) -> None:
        token = reply.get("token")
        if not isinstance(token, str) or not token:
            raise _ReplyError(_UNAUTHENTICATED, "etcd's authentication reply has no token")
        with self._mutex:
            self.token = token

    def forget(self, token: str | None) -> None:
        """Drop ``token`` (unless another request already replaced it)."""
        with self._mutex:
            if self.token == token:
                self.token = None

    @staticmethod
    def rejected(exc: _ReplyError) -> bool:
        """Whether etcd refused a request for its token (so it may be sent again)."""
        return exc.code == _UNAUTHENTICATED or (
            exc.code == _INVALID_ARGUMENT and "auth store is old" in exc.message
        )


def _login_failure(auth: _Auth, exc: _ReplyError) -> _ReplyError:
    return _ReplyError(
        exc.code, f"authentication as {auth.username!r} refused by etcd: {exc.message}"
    )


@dataclass(frozen=True, slots=True)
class _Post:
    """An HTTP POST for a driver to send: the one piece of I/O of a delivery."""

    url: str
    content: bytes
    headers: Mapping[str, str]


def _post(
    endpoints: _Endpoints, call: _Call, headers: Mapping[str, str]
) -> Generator[_Post, httpx.Response, tuple[str, httpx.Response]]:
    """Send ``call`` to the endpoint in use; a refused connection moves on to the next.

    Any other failure is raised (nothing is sent twice: a request that may have
    reached etcd is not repeated).
    """
    content = _content(call)
    for attempt in range(len(endpoints)):
        url = endpoints.current()
        try:
            response = yield _Post(url + call.path, content, headers)
        except httpx.ConnectError:
            endpoints.failed(url)
            if attempt == len(endpoints) - 1:
                raise
            continue
        except httpx.TransportError:
            endpoints.failed(url)
            raise
        return url, response
    raise AssertionError("unreachable")


def _authorization(
    endpoints: _Endpoints, auth: _Auth | None
) -> Generator[_Post, httpx.Response, dict[str, str]]:
    """The headers that authenticate a request (logging in first if needed)."""
    if auth is None:
        return {}
    token = auth.token
    if token is None:
        login = auth.login()
        _, response = yield from _post(endpoints, login, {})
        try:
            auth.learn(_decode(login, response))
        except _ReplyError as exc:
            raise _login_failure(auth, exc) from None
        token = auth.token
    return {"authorization": token or ""}


def _delivery(
    endpoints: _Endpoints, auth: _Auth | None, call: _Call
) -> Generator[_Post, httpx.Response, Any]:
    """Everything it takes to get ``call``'s reply: endpoint failover, authentication.

    Written once for ``_Transport`` and ``_AsyncTransport``, which only send the
    ``_Post`` requests it yields (and throw their transport errors into it).
    """
    for attempt in range(2):
        headers = yield from _authorization(endpoints, auth)
        url, response = yield from _post(endpoints, call, headers)
        try:
            return _decode(call, response)
        except _ReplyError as exc:
            if exc.code == _UNAVAILABLE:
                endpoints.failed(url)
            if auth is not None and attempt == 0 and _Auth.rejected(exc):
                auth.forget(headers.get("authorization"))
                continue  # refused before it was carried out: once more, logged in anew
            raise
    raise AssertionError("unreachable")


def _operation(
    endpoints: _Endpoints, auth: _Auth | None, flow: Flow[T]
) -> Generator[_Post, httpx.Response, T]:
    """A whole step: each call of ``flow`` delivered, its reply (or etcd's error) given
    back to it, until it returns. The transports only send the posts."""
    try:
        call = next(flow)
        while True:
            try:
                reply = yield from _delivery(endpoints, auth, call)
            except _ReplyError as exc:
                call = flow.throw(exc)
            else:
                call = flow.send(reply)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


def _forget_rejected(auth: _Auth | None, exc: _ReplyError, headers: Mapping[str, str]) -> None:
    """A watch stream refused for its token: the next one logs in anew."""
    if auth is not None and _Auth.rejected(exc):
        auth.forget(headers.get("authorization"))


def _http_client_options(target: _Target, *, streaming: bool = False) -> dict[str, Any]:
    return {
        "timeout": None if streaming else httpx.Timeout(target.timeout),
        "trust_env": False,  # etcd is reached directly, never through $HTTP_PROXY
        "headers": {"content-type": "application/json"},
        "verify": target.tls if target.tls is not None else True,
    }


class _Transport:
    """Sends calls with one ``httpx.Client`` (see ``_delivery``)."""

    def __init__(self, target: _Target) -> None:
        self.target = target
        self.endpoints = _Endpoints(target.endpoints)
        self.auth = None if target.credentials is None else _Auth(*target.credentials)
        self._pid = os.getpid()
        self._client = httpx.Client(**_http_client_options(target))

    def drive(self, delivery: Generator[_Post, httpx.Response, T]) -> T:
        """Send what ``delivery`` asks for until it is done."""
        if self._pid != os.getpid():  # forked: the parent's connections are not ours
            self._pid, self._client = (
                os.getpid(),
                httpx.Client(**_http_client_options(self.target)),
            )
        try:
            post = next(delivery)
            while True:
                try:
                    response = self._client.post(
                        post.url, content=post.content, headers=post.headers
                    )
                except httpx.TransportError as exc:
                    post = delivery.throw(exc)
                else:
                    post = delivery.send(response)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def run(self, flow: Flow[T], what: str) -> T:
        with translate_errors(*_DRIVER_ERRORS, what=what):
            return self.drive(_operation(self.endpoints, self.auth, flow))

    def close(self) -> None:
        self._client.close()


class _AsyncTransport:
    """The same as ``_Transport`` with ``httpx.AsyncClient``."""

    def __init__(self, target: _Target) -> None:
        self.target = target
        self.endpoints = _Endpoints(target.endpoints)
        self.auth = None if target.credentials is None else _Auth(*target.credentials)
        self._client = httpx.AsyncClient(**_http_client_options(target))

    async def drive(self, delivery: Generator[_Post, httpx.Response, T]) -> T:
        try:
            post = next(delivery)
            while True:
                try:
                    response = await self._client.post(
                        post.url, content=post.content, headers=post.headers
                    )
                except httpx.TransportError as exc:
                    post = delivery.throw(exc)
                else:
                    post = delivery.send(response)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    async def run(self, flow: Flow[T], what: str) -> T:
        with translate_errors(*_DRIVER_ERRORS, what=what):
            return await self.drive(_operation(self.endpoints, self.auth, flow))

    async def aclose(self) -> None:
        await self._client.aclose()


# -- waiting -------------------------------------------------------------------------


def _watch_request(layout: _Layout, start_revision: int) -> bytes:
    return json.dumps(
        {
            "create_request": {
                "key": _b64(layout.prefix),
                "range_end": _b64(_range_end(layout.prefix)),
                "start_revision": str(start_revision),
                "filters": ["NOPUT"],
            }
        }
    ).encode()


class _View:
    """What a refused waiter waits for, kept up to date by its store's watch stream.

    Refused at revision ``since``, a waiter's turn comes once every queue entry that was
    ahead of it then (``ahead``) is deleted and the key has no holder (``held`` false):
    only then is it rung, so a release wakes the one waiter next in line, not the herd.
    Only deletions are watched: a holder that appears after the refusal (the waiter
    ahead claiming the key) is not seen, which can ring too early (the try that follows
    looks again), never too late. While a try is under way (``pending`` is a list),
    deletions are kept and weighed against the view that try brings back, so none that
    lands between the try's reply and the view's update is missed.

    Its hub's mutex (sync) or event loop (async) guards it.
    """

    __slots__ = ("ahead", "held", "holder", "pending", "since")

    def __init__(self, holder: bytes) -> None:
        self.holder = holder  # the name of the key's holder in etcd
        self.since = 0
        self.ahead: set[bytes] | None = None  # None: unknown, any deletion of the key rings
        self.held = True
        self.pending: list[tuple[int, bytes]] | None = None

    def begin(self) -> None:
        """A try is under way: keep what the stream says until it is settled."""
        self.pending = []

    def end(self) -> None:
        """The try granted the key or failed: nothing to wait for."""
        self.pending = None
        self.ahead = None

    def settle(self, refusal: _Refusal) -> bool:
        """Take in a refusal's view; whether the waiter's turn has already come."""
        pending, self.pending = self.pending or [], None
        if refusal.ahead is None:
            self.ahead = None
            return True
        self.since, self.ahead, self.held = refusal.revision, set(refusal.ahead), refusal.held
        turn = not self.ahead and not self.held
        for revision, name in pending:
            turn = self.hear(revision, name) or turn
        return turn

    def hear(self, revision: int, name: bytes) -> bool:
        """Take in the deletion of ``name`` (the holder or a queue entry of the waiter's
        key) at ``revision``; whether it rings the waiter."""
        if self.pending is not None:
            self.pending.append((revision, name))
            return False
        if revision <= self.since:
            return False  # the refusal's view already tells
        if self.ahead is None:
            return True
        if name == self.holder:
            self.held = False
        elif name in self.ahead:
            self.ahead.discard(name)
        else:
            return False  # someone behind this waiter left
        return not self.ahead and not self.held


@dataclass
class _WatchState:
    """What the watch stream of one store has seen (shared by the sync and async hubs).

    ``start``: the revision the stream was opened from (0: no stream); ``next``: the
    revision to resume from after a broken connection; ``member``: the URL of the
    member the open stream is on ("": none open).
    """

    layout: _Layout
    waiters: dict[str, set[Any]] = field(default_factory=dict)
    start: int = 0
    next: int = 0
    idle_since: float | None = None
    member: str = ""

    def add(self, key: str, waiter: Any) -> None:
        self.waiters.setdefault(key, set()).add(waiter)
        self.idle_since = None

    def remove(self, key: str, waiter: Any) -> None:
        waiters = self.waiters.get(key)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self.waiters[key]
        if not self.waiters:
            self.idle_since = time.monotonic()

    def covers(self, revision: int) -> bool:
        """Whether the running stream delivers every deletion from ``revision`` on."""
        return 0 < self.start <= revision

    def lingered(self) -> bool:
        return self.idle_since is not None and time.monotonic() - self.idle_since >= LINGER

    def everyone(self) -> list[Any]:
        return [waiter for waiters in self.waiters.values() for waiter in waiters]

    def message(self, line: str) -> tuple[list[Any], bool]:
        """Take in one line of the stream: the waiters to ring, and whether it ended."""
        if not line.strip():
            return [], False
        result = _result(json.loads(line)) or {}  # an error line raises _ReplyError
        if result.get("created") and self.start == 0:  # watching from now on
            self.start = self.next = _int(result.get("header", {}).get("revision")) + 1
        if result.get("canceled") or _int(result.get("compact_revision")):
            # Compacted past where we were: ring everyone, resume from now.
            self.next = 0
            return self.everyone(), True
        ring: list[Any] = []
        for event in result.get("events") or ():
            kv = event.get("kv") or {}
            revision = _int(kv.get("mod_revision"))
            self.next = max(self.next, revision + 1)
            if event.get("type") == "DELETE":
                name = _unb64(kv.get("key", ""))
                if name.startswith(self.layout.prefix):
                    for waiter in self.waiters.get(self.layout.key_of(name), ()):
                        if waiter.view.hear(revision, name) and waiter not in ring:
                            ring.append(waiter)
        return ring, False


class _EtcdWaiter(Doorbell):
    """A waiter of the sync store, rung by its watch thread when its turn may have come."""

    __slots__ = ("key", "place", "store", "view")

    def __init__(self, store: EtcdStore, key: str) -> None:
        super().__init__()
        self.store = store
        self.key = key
        self.place = _Place()
        self.view = _View(store._layout.name(key))

    def forget_rings(self) -> None:
        """A try is starting: it sees everything a ring until now was about."""
        self.forget()

    def wait(self, timeout: float) -> bool:
        self.place.rung = super().wait(timeout)
        return self.place.rung

    async def wait_async(self, timeout: float) -> bool:
        self.place.rung = await super().wait_async(timeout)
        return self.place.rung

    def close(self) -> None:
        """Leave the queue: revoke the kept lease (etcd deletes the entry with it)."""
        self.store._hub.leave(self)
        lease, self.place.lease = self.place.lease, 0
        if lease:
            self.store._drop_lease(lease)


class _WatchHub:
    """One watch stream per sync store, read by one thread, shared by its waiters."""

    def __init__(self, transport: _Transport, layout: _Layout) -> None:
        self._transport = transport
        self._mutex = threading.Lock()
        self._state = _WatchState(layout)
        self._thread: threading.Thread | None = None
        # The watch's socket (a descriptor of our own: ``_handle``), from its connect:
        # a stream still opening (a member that hangs, TLS handshake included) can be
        # broken too, not only one that has its response.
        self._stream: socket.socket | None = None
        self._closed = False
        self._pid = os.getpid()
        # The one timer that closes the stream once it has lingered unused. Found by
        # review: a timer thread for each waiter that left piled up (5 s × the acquire
        # rate), and one that could not start failed an acquire granted meanwhile.
        self._linger: threading.Timer | None = None
        transport.endpoints.when_left(self._steps_left)

    def join(self, waiter: _EtcdWaiter) -> None:
        with self._mutex:
            if self._pid != os.getpid():  # forked: the parent's stream is not ours
                self._pid, self._thread, self._stream = os.getpid(), None, None
                self._state = _WatchState(self._state.layout)
                self._linger = None
            self._state.add(waiter.key, waiter)

    def leave(self, waiter: _EtcdWaiter) -> None:
        with self._mutex:
            self._state.remove(waiter.key, waiter)
            idle = not self._state.waiters and self._thread is not None
        if idle:  # close the stream once it has lingered unused
            self._linger_for(LINGER + 0.1)

    def _linger_for(self, seconds: float) -> None:
        with self._mutex:
            if self._linger is not None or self._closed:
                return  # the timer under way looks then, and again if need be
            self._linger = timer = threading.Timer(seconds, self._lingered)
            timer.daemon = True
        try:
            timer.start()
        except RuntimeError as exc:  # no thread to be had: the stream stays open a while
            with self._mutex:
                self._linger = None
            _LOG.warning("etcd: cannot time the watch stream's close: %s", exc)

    def _lingered(self) -> None:
        with self._mutex:
            self._linger = None
            idle_since = None if self._thread is None else self._state.idle_since
        if idle_since is not None:
            left = LINGER + 0.1 - (time.monotonic() - idle_since)
            if left > 0:  # a waiter came and went since: look again when it has lingered
                self._linger_for(left)
                return
        self.poke()

    def begin(self, waiter: _EtcdWaiter) -> None:
        with self._mutex:
            waiter.forget_rings()
            waiter.view.begin()

    def end(self, waiter: _EtcdWaiter) -> None:
        with self._mutex:
            waiter.view.end()

    def settle(self, waiter: _EtcdWaiter, refusal: _Refusal) -> None:
        """Wait for ``waiter``'s turn after ``refusal``: deletions from the revision after
        it reach it (it is rung now if its turn came meanwhile, or if unsure)."""
        revision = refusal.revision + 1
        with self._mutex:
            if self._closed:
                raise RuntimeError("this store is closed")
            ring = waiter.view.settle(refusal)
            if self._thread is None:
                self._state.start = self._state.next = revision
                self._thread = threading.Thread(
                    target=self._read, name="keymutex-etcd-watch", daemon=True
                )
                self._thread.start()
            elif not self._state.covers(revision):
                ring = True  # the stream may have missed a deletion: look again now
        if ring:
            waiter.ring()

    def _read(self) -> None:
        failures = 0
        while True:
            with self._mutex:
                if self._closed or self._state.lingered() or self._thread is None:
                    self._thread = None
                    self._state.start = 0
                    return
                if self._state.next == 0:  # compacted: nothing to resume, watch from now
                    self._state.start = 0
                resume = self._state.next
            url = self._transport.endpoints.current()
            try:
                self._stream_once(url, resume)
                failures = 0
            except (*_DRIVER_ERRORS,) as exc:
                with self._mutex:
                    stopping = self._closed or self._state.lingered()
                if stopping:
                    continue  # broken on purpose by poke()
                if self._transport.endpoints.current() != url:
                    # Broken on purpose by _steps_left (or broken after the steps left
                    # its member): open it at once where the steps are now.
                    _LOG.info("etcd watch stream moves off %s (%s)", url, exc)
                else:
                    self._transport.endpoints.failed(url)
                    failures += 1
                    _LOG.warning("etcd watch stream failed (%s); reconnecting", exc)
                    time.sleep(min(1.0, 0.05 * 2**failures))
            with self._mutex:
                everyone = self._state.everyone()
            # A stream that ended may have missed something: every waiter looks again.
            # The next stream resumes from the revision after the last one this one
            # delivered, so nothing between them is missed either.
            for waiter in everyone:
                waiter.ring()

    def _stream_once(self, url: str, resume: int) -> None:
        transport = self._transport
        headers = transport.drive(_authorization(transport.endpoints, transport.auth))
        client = httpx.Client(**_http_client_options(transport.target, streaming=True))

        def connected(event: str, info: dict[str, Any]) -> None:
            if event == _CONNECTED:  # from now on, _steps_left can break it
                handle = _handle(info.get("return_value"))
                with self._mutex:
                    self._stream = handle
                if transport.endpoints.current() != url:
                    _shutdown(handle)  # the steps left this member while it connected

        with self._mutex:
            self._state.member = url
        try:
            with client.stream(
                "POST",
                url + "/v3/watch",
                content=_watch_request(self._state.layout, resume),
                headers=headers,
                extensions={"trace": connected},
            ) as response:
                if response.status_code != 200:
                    raise ValueError(f"watch refused: HTTP {response.status_code}")
                with self._mutex:
                    if self._stream is None:  # a connection reused: no connect
                        self._stream = _handle(response.extensions.get("network_stream"))
                    if transport.endpoints.current() != url:
                        return  # the steps left this member while the stream opened
                for line in response.iter_lines():
                    with self._mutex:
                        ring, ended = self._state.message(line)
                        stop = self._closed or self._state.lingered()
                    for waiter in ring:
                        waiter.ring()
                    if ended or stop:
                        return
        except _ReplyError as exc:
            _forget_rejected(transport.auth, exc, headers)
            raise
        finally:
            with self._mutex:  # _steps_left and poke shut it down under the mutex
                handle, self._stream, self._state.member = self._stream, None, ""
                if handle is not None:
                    handle.close()
            client.close()

    def _steps_left(self, url: str) -> None:
        """The store's steps left ``url`` (it failed one of them): a stream open there
        is broken, and the reader opens it again on the member the steps use now.

        Found by a test on a 3-member cluster: a member stopped by SIGSTOP keeps its
        sockets open and answers nothing, so a stream there never ended. The steps,
        which time out, moved to another member; the stream stayed, heard no release,
        and waiters woke only at their once-a-second recheck (hand-overs of up to 1 s
        instead of ~10 ms) until that member answered again. The stream resumes from
        the revision after the last deletion it delivered and every waiter is rung,
        as after any reconnect, so no release in between is missed.

        A stream still *opening* there is broken too (its socket is known from its
        connect, ``_CONNECTED``). Found by review: the steps' failure that moves the
        stream may move it onto a member that hangs (a healthy follower's steps fail
        while the leader that hung is replaced, and the next URL is that leader's); the
        stream, opening there, had nothing to break, and stayed for as long as that
        member hung, long after the steps had moved on.
        """
        with self._mutex:  # the reader closes the socket's descriptor under it
            if self._state.member == url:
                _shutdown(self._stream)

    def poke(self) -> None:
        """Wake the reader if it should stop (closed, or idle past ``LINGER``)."""
        with self._mutex:
            if self._closed or self._state.lingered():
                _shutdown(self._stream)

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            thread, linger = self._thread, self._linger
        if linger is not None:
            linger.cancel()
        self.poke()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)


# httpcore's trace event that gives a new connection (its network stream).
_CONNECTED = "connection.connect_tcp.complete"


def _handle(network: Any) -> socket.socket | None:
    """A descriptor of our own on the socket of ``network`` (httpcore's network stream):
    shut down, it breaks the connection at any stage, for whoever is blocked on it. Its
    own: it stays valid however httpcore closes or wraps the socket (a sync TLS socket
    takes over the descriptor the connect made)."""
    sock = network.get_extra_info("socket") if network is not None else None
    if sock is None:
        return None
    try:
        return socket.socket(fileno=os.dup(sock.fileno()))
    except OSError:
        return None


def _shutdown(handle: socket.socket | None) -> None:
    """Break the watch connection ``handle`` is on (another thread or task reads it)."""
    if handle is not None:
        with contextlib.suppress(OSError):
            handle.shutdown(socket.SHUT_RDWR)


class _AsyncEtcdWaiter(LoopDoorbell):
    """A waiter of the async store, rung by its watch task when its turn may have come."""

    __slots__ = ("key", "place", "store", "view")

    def __init__(self, store: AsyncEtcdStore, key: str) -> None:
        super().__init__()
        self.store = store
        self.key = key
        self.place = _Place()
        self.view = _View(store._layout.name(key))

    def forget_rings(self) -> None:
        self.forget()

    async def wait(self, timeout: float) -> bool:
        self.place.rung = await super().wait(timeout)
        return self.place.rung

    async def aclose(self) -> None:
        self.store._hub.leave(self)
        lease, self.place.lease = self.place.lease, 0
        if lease:
            await self.store._drop_lease(lease)


class _AsyncWatchHub:
    """One watch stream per async store, read by one task, shared by its waiters."""

    def __init__(self, transport: _AsyncTransport, layout: _Layout) -> None:
        self._transport = transport
        self._state = _WatchState(layout)
        self._task: asyncio.Task[None] | None = None
        self._stream: socket.socket | None = None  # as in _WatchHub
        self._closed = False
        transport.endpoints.when_left(self._steps_left)

    def join(self, waiter: _AsyncEtcdWaiter) -> None:
        self._state.add(waiter.key, waiter)

    def leave(self, waiter: _AsyncEtcdWaiter) -> None:
        self._state.remove(waiter.key, waiter)
        if not self._state.waiters and self._task is not None:
            asyncio.get_running_loop().call_later(LINGER + 0.1, self._stop_if_idle)

    def _stop_if_idle(self) -> None:
        if self._state.lingered() and self._task is not None:
            self._task.cancel()
            self._task = None
            self._state.start = 0

    def begin(self, waiter: _AsyncEtcdWaiter) -> None:
        waiter.forget_rings()
        waiter.view.begin()

    def end(self, waiter: _AsyncEtcdWaiter) -> None:
        waiter.view.end()

    def settle(self, waiter: _AsyncEtcdWaiter, refusal: _Refusal) -> None:
        """As ``_WatchHub.settle``."""
        if self._closed:
            raise RuntimeError("this store is closed")
        revision = refusal.revision + 1
        ring = waiter.view.settle(refusal)
        if self._task is None or self._task.done():
            self._state.start = self._state.next = revision
            self._task = asyncio.create_task(self._read(), name="keymutex-etcd-watch")
        elif not self._state.covers(revision):
            ring = True
        if ring:
            waiter.ring()

    async def _read(self) -> None:
        failures = 0
        transport = self._transport
        client = httpx.AsyncClient(**_http_client_options(transport.target, streaming=True))
        try:
            while not self._closed:
                if self._state.next == 0:
                    self._state.start = 0
                resume = self._state.next
                url = transport.endpoints.current()
                headers: dict[str, str] = {}
                try:
                    headers = await transport.drive(
                        _authorization(transport.endpoints, transport.auth)
                    )
                    self._state.member = url
                    try:
                        async with client.stream(
                            "POST",
                            url + "/v3/watch",
                            content=_watch_request(self._state.layout, resume),
                            headers=headers,
                            extensions={"trace": self._connected},
                        ) as response:
                            if response.status_code != 200:
                                raise ValueError(f"watch refused: HTTP {response.status_code}")
                            if self._stream is None:  # a connection reused: no connect
                                self._stream = _handle(response.extensions.get("network_stream"))
                            # Unless the steps left this member while the stream opened.
                            if transport.endpoints.current() == url:
                                async for line in response.aiter_lines():
                                    ring, ended = self._state.message(line)
                                    for waiter in ring:
                                        waiter.ring()
                                    if ended:
                                        break
                    finally:
                        handle, self._stream, self._state.member = self._stream, None, ""
                        if handle is not None:
                            handle.close()
                    failures = 0
                except (*_DRIVER_ERRORS,) as exc:
                    if isinstance(exc, _ReplyError):
                        _forget_rejected(transport.auth, exc, headers)
                    if transport.endpoints.current() != url:
                        # Broken on purpose by _steps_left (or broken after the steps
                        # left its member): open it at once where the steps are now.
                        _LOG.info("etcd watch stream moves off %s (%s)", url, exc)
                    else:
                        transport.endpoints.failed(url)
                        failures += 1
                        _LOG.warning("etcd watch stream failed (%s); reconnecting", exc)
                        await asyncio.sleep(min(1.0, 0.05 * 2**failures))
                # As in _WatchHub._read: everyone looks again; the next stream resumes.
                for waiter in self._state.everyone():
                    waiter.ring()
        finally:
            await client.aclose()

    async def _connected(self, event: str, info: dict[str, Any]) -> None:
        """As in ``_WatchHub._stream_once``: the stream's socket, from its connect."""
        if event == _CONNECTED:
            self._stream = _handle(info.get("return_value"))
            if self._transport.endpoints.current() != self._state.member:
                _shutdown(self._stream)

    def _steps_left(self, url: str) -> None:
        """As ``_WatchHub._steps_left``: a stream open (or opening) on ``url``, which the
        store's steps left, is broken, and ``_read`` opens it again where the steps are
        now. Called on the store's event loop (its steps run there), as the task reads."""
        if self._stream is not None and self._state.member == url:
            _shutdown(self._stream)

    async def aclose(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        await stop_task(task)


# -- the stores ----------------------------------------------------------------------

GRANTS_KEPT = 10_000  # (key, token) grants a store remembers for a one-step release


class _Granted:
    """The (key, token) pairs this store was granted and has not released: their
    release is one revoke. A pair it does not know (a release by token from another
    process, or one forgotten past ``GRANTS_KEPT``) is read first (``_release``)."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[str, str], None] = {}
        self._mutex = threading.Lock()

    def note(self, key: str, token: str, outcome: Outcome) -> Outcome:
        if outcome.ok:
            with self._mutex:
                self._pairs.pop((key, token), None)
                while len(self._pairs) >= GRANTS_KEPT:  # leases lost and never released
                    self._pairs.pop(next(iter(self._pairs)))
                self._pairs[(key, token)] = None
        return outcome

    def pop(self, key: str, token: str) -> bool:
        with self._mutex:
            return self._pairs.pop((key, token), 0) is None

    def forget(self, requests: Sequence[RenewRequest]) -> None:
        """After a renewal that failed or was interrupted: it may have moved a key to
        its token's other lease and not revoked the first (both alive), so the release
        reads where the key is. Found by review: the release revoked the first lease,
        said released, and the key stayed held on the second for its TTL."""
        with self._mutex:
            for request in requests:
                self._pairs.pop((request.key, request.token), None)


class EtcdStore:
    """The etcd store for one namespace (sync, on ``httpx.Client``)."""

    capabilities = CAPABILITIES

    def __init__(self, target: _Target, namespace: str) -> None:
        self._layout = _Layout(namespace)
        self._transport = _Transport(target)
        self._hub = _WatchHub(self._transport, self._layout)
        self._granted = _Granted()

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
        assert waiter is None or isinstance(waiter, _EtcdWaiter)
        place = None if waiter is None else waiter.place
        flow = _acquire(self._layout, key, token, ttl, owner, info, steal, place)
        what = f"etcd acquire of {key!r}"
        if waiter is None:
            return self._granted.note(key, token, self._transport.run(flow, what).outcome)
        self._hub.begin(waiter)
        try:
            done = self._transport.run(flow, what)
        except BaseException:
            self._hub.end(waiter)
            raise
        if done.refusal is None:
            self._hub.end(waiter)
        else:
            self._hub.settle(waiter, done.refusal)
        return self._granted.note(key, token, done.outcome)

    def renew(self, key: str, token: str, ttl: float) -> Outcome:
        return self.renew_many([RenewRequest(key, token, ttl)])[0]

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        if not requests:
            return []
        try:
            return self._transport.run(
                _renew_many(self._layout, requests), f"etcd renewal of {len(requests)} lease(s)"
            )
        except BaseException:
            self._granted.forget(requests)
            raise

    def release(self, key: str, token: str) -> Outcome:
        flow = _release(self._layout, key, token, granted=self._granted.pop(key, token))
        return self._transport.run(flow, f"etcd release of {key!r}")

    def holder(self, key: str) -> Holder | None:
        return self._transport.run(_holder(self._layout, key), f"etcd read of {key!r}")

    def holders(self, prefix: str) -> list[Holder]:
        return self._transport.run(_holders(self._layout, prefix), f"etcd range of {prefix!r}")

    def waiter(self, key: str) -> _EtcdWaiter:
        waiter = _EtcdWaiter(self, key)
        self._hub.join(waiter)
        return waiter

    def _drop_lease(self, lease: int) -> None:
        """Revoke the lease a waiter kept, when it gives up (best effort)."""
        try:
            self._transport.run(_quietly_revoke(lease), "etcd revoke")
        except StoreError as exc:  # it expires by its TTL
            _LOG.warning("could not revoke an unused etcd lease: %s", exc)

    def close(self) -> None:
        self._hub.close()
        with contextlib.suppress(*_DRIVER_ERRORS):
            self._transport.close()


class AsyncEtcdStore:
    """The etcd store for one namespace (asyncio, on ``httpx.AsyncClient``)."""

    # Its connections belong to the event loop that made them: an AsyncLocks used by
    # one loop after another opens a store of its own in each (_store.StoreOfTheLoop).
    loop_bound = True

    capabilities = CAPABILITIES

    def __init__(self, target: _Target, namespace: str) -> None:
        self._layout = _Layout(namespace)
        self._transport = _AsyncTransport(target)
        self._hub = _AsyncWatchHub(self._transport, self._layout)
        self._granted = _Granted()

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
        assert waiter is None or isinstance(waiter, _AsyncEtcdWaiter)
        place = None if waiter is None else waiter.place
        flow = _acquire(self._layout, key, token, ttl, owner, info, steal, place)
        what = f"etcd acquire of {key!r}"
        if waiter is None:
            return self._granted.note(key, token, (await self._transport.run(flow, what)).outcome)
        self._hub.begin(waiter)
        try:
            done = await self._transport.run(flow, what)
        except BaseException:
            self._hub.end(waiter)
            raise
        if done.refusal is None:
            self._hub.end(waiter)
        else:
            self._hub.settle(waiter, done.refusal)
        return self._granted.note(key, token, done.outcome)

    async def renew(self, key: str, token: str, ttl: float) -> Outcome:
        return (await self.renew_many([RenewRequest(key, token, ttl)]))[0]

    async def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        if not requests:
            return []
        try:
            return await self._transport.run(
                _renew_many(self._layout, requests), f"etcd renewal of {len(requests)} lease(s)"
            )
        except BaseException:  # cancelled too: as in EtcdStore
            self._granted.forget(requests)
            raise

    async def release(self, key: str, token: str) -> Outcome:
        flow = _release(self._layout, key, token, granted=self._granted.pop(key, token))
        return await self._transport.run(flow, f"etcd release of {key!r}")

    async def holder(self, key: str) -> Holder | None:
        return await self._transport.run(_holder(self._layout, key), f"etcd read of {key!r}")

    async def holders(self, prefix: str) -> list[Holder]:
        return await self._transport.run(
            _holders(self._layout, prefix), f"etcd range of {prefix!r}"
        )

    async def waiter(self, key: str) -> _AsyncEtcdWaiter:
        waiter = _AsyncEtcdWaiter(self, key)
        self._hub.join(waiter)
        return waiter

    async def _drop_lease(self, lease: int) -> None:
        try:
            await self._transport.run(_quietly_revoke(lease), "etcd revoke")
        except StoreError as exc:
            _LOG.warning("could not revoke an unused etcd lease: %s", exc)

    async def aclose(self) -> None:
        await self._hub.aclose()
        with contextlib.suppress(*_DRIVER_ERRORS):
            await self._transport.aclose()


# -- URLs ----------------------------------------------------------------------------

# Options of ``Locks(url, **options)``; all but the credentials may be in the URL's
# query string instead (keymutex/stores/_settings.py).
OPTIONS = ("timeout", *TLS_OPTIONS, "username", "password")
_FORM = "etcd[s]://[user:password@]host:port[,host:port…][?timeout=…&ca_file=…&cert_file=…]"


@dataclass(frozen=True, slots=True)
class _Target:
    """Where and how to reach etcd: every setting of a store's connections."""

    endpoints: tuple[str, ...]
    timeout: float
    tls: ssl.SSLContext | None = None  # etcds://: certificates checked by this context
    credentials: tuple[str, str] | None = field(default=None, repr=False)


def _parse(url: str, options: Mapping[str, object]) -> _Target:
    settings = settings_of(
        url, options, store="etcd", schemes=("etcd", "etcds"), form=_FORM, accepted=OPTIONS
    )
    shown = settings.shown
    if settings.parts.path not in ("", "/"):
        raise ValueError(f"{shown!r}: expected {_FORM}, with no path")
    tls = tls_files("etcd", settings.options)[1] if settings.tls else None
    endpoints = []
    for part in settings.netloc.split(","):
        host, port = part, str(DEFAULT_PORT)
        if part.startswith("["):  # [IPv6]:port
            host, _, rest = part[1:].partition("]")
            if rest:
                if not rest.startswith(":"):
                    raise ValueError(f"{shown!r}: bad endpoint {part!r}")
                port = rest[1:]
            host = f"[{host}]"
        elif ":" in part:
            host, _, port = part.rpartition(":")
        if not host or not digits(port) or not 0 < int(port) < 65536:
            raise ValueError(f"{shown!r}: expected host:port[,host:port…], got {part!r}")
        check_host(host, url, "etcd")
        endpoints.append(f"{'https' if tls else 'http'}://{host}:{int(port)}")
    return _Target(
        tuple(endpoints),
        seconds("etcd", "timeout", settings.options.get("timeout", DEFAULT_TIMEOUT)),
        tls=tls,
        credentials=settings.credentials,
    )


class EtcdDriver:
    def open(self, url: str, *, namespace: str, options: Mapping[str, object]) -> EtcdStore:
        return EtcdStore(_parse(url, options), namespace)

    def open_async(
        self, url: str, *, namespace: str, options: Mapping[str, object]
    ) -> AsyncEtcdStore:
        return AsyncEtcdStore(_parse(url, options), namespace)


driver = EtcdDriver()

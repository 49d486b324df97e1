"""``mongodb://…``, ``mongodb+srv://…``: leases in MongoDB (4.4 or later, as pymongo).

**One document per key** in the collection ``keymutex_locks`` (option ``collection``) of
the URL's database (else ``keymutex``; option ``database``). Its ``_id`` is
``"<length of namespace>:<namespace>/<key>"``: unambiguous, and a namespace's keys
share one prefix, so ``holders(prefix)`` is one anchored range on the ``_id`` index.

    {_id, k: key, t: token, o: owner, i: info (JSON text), f: fence,
     a: acquired at, e: expires at,
     n: time of the last grant, renewal, or acquire answered to the holding token}

``a``, ``e`` and ``n`` are ``Date``s from the **server's clock** (``$$NOW`` in an
aggregation-pipeline update): every expiry is judged by the primary, never by clients.
A lease is live while ``e > $$NOW`` and ``t`` is set. A refusal's time left (when a
waiter looks again) is the holder's ``e`` less the server's now as this host
estimates it (``ServerClock``).

**Acquire is one round trip, granted or refused.** One ``find_one_and_update`` on
``{_id}`` with ``upsert=True``, whose pipeline first computes *grant* = "no live lease,
or steal", then sets every field to the new lease's value if *grant*, else to its own
value, and returns the document *after* the update: it carries our token when
granted, and is the current holder when refused, so a refusal says who holds the key
and until when without a second read. (The classic shape — a filter that matches only
a free document, where the upsert's ``DuplicateKeyError`` on ``_id`` means "locked"
— needs that second read to name the holder.) A refusal changes nothing, which
MongoDB applies as a no-op (nothing is written to the oplog). Two clients upserting
a missing document at once collide on ``_id``; the server retries such an upsert
(an equality filter on ``_id`` only), and so do we once, for older servers.

**Fences without a second round trip.** The fence lives in the key's document: a grant
sets ``f`` to ``max(f + 1, $$NOW in microseconds)``. A counter document (``$inc`` with
``find_one_and_update``, upsert) would cost a second round trip on every acquire and
make one hot document that every acquire of a namespace writes. The document is kept
after release (the token is removed and ``e`` set to now), so a key's next fence is the
last one plus one, through restarts and failovers: every write waits for a majority
(``w=majority``, unless the URL sets ``w``; ``w=0`` is refused), so an acknowledged
grant is not rolled back by a failover. A URL that sets ``w=1`` gives that up: a
grant the primary alone acknowledged may be rolled back, and the key granted again. Reads go to the primary whatever the URL's
``readPreference``. A TTL index on ``e`` (``expireAfterSeconds=GC_GRACE``) deletes a
document a day after its last lease ended: the next grant then starts from the
server's clock in microseconds, larger than every earlier fence unless the primary's
clock went back more than the time elapsed since. Hence ``durable_fences=True``.

**The TTL index** is made at a store's first step, which waits for it up to
``INDEX_FIRST_PATIENCE`` seconds: once per store, beside the ``hello`` that step waits
for anyway; a short-lived process (``keymutex run``, a job that takes one lock) would
otherwise close its store before the index was made. It is made again every
``INDEX_RECHECK`` seconds while the store is used (a no-op while the index is there),
so that after a failure that may pass, and after the collection was dropped, it comes
back; after a failure to reach the server (or its primary), sooner:
``INDEX_RETRY_FIRST`` seconds later, doubled at each such failure in a row up to
``INDEX_RECHECK``. Every making runs off the steps, in a thread (the async store: a task
of its loop), one at a time: the step that finds it due starts it and goes on (found by
review: it was made inside that step, a createIndexes round trip every ten minutes in
a user's acquire or the renewer's call). Its failure is a warning, never a step's, the
first's too (found by review: a first making that timed out failed its step, and the
next step tried again, so while a build stalled — a voting member down, the index
missing on a collection with documents — every step of a new store failed; a server
lost after the ``hello`` still fails the step, by the step's own round trip).
``close()`` waits up to ``INDEX_CLOSE_PATIENCE`` seconds for one under way (pymongo
cannot stop a sync call: a slower one ends by itself, within the client's socket
timeout); ``aclose()`` cancels it. No making is tried again after a failure that
trying again will not mend (codes 13, 85, 86). A sync store used in a forked child
makes the index again at its first step there, and reads its change stream with a
thread of its own (``MongoStore._forked``). Reads (``holder``, ``holders``) neither
make the index nor start a making: every document is written by a step, whose store
made the index at its first step and keeps it while it writes; and a dashboard or a
monitor, often under a role that may only read, would ask for a createIndexes it may
not run (code 13: a warning in each such process) and wait for it in its first read.

**Renew** and **release** are one conditional update each (``{_id, t: token, e >
$$NOW}``): ``e`` moves on, or the token is removed and ``e`` set to now (``$unset``
and ``$currentDate``: update operators, which change streams report as an update
that removed ``t``). When the
token no longer holds the key, a second read names the current holder for
``LockLost``: a second round trip only on that rare path.

**Waiting.** On a replica set or a sharded cluster (asked once with ``hello``) each
store opens one change stream on the collection, read by one thread (or task), and
wakes the waiters of a key when its lease is released or its document deleted
(``notifies=True``); waiters still wake at the holder's expiry and recheck every
second. A standalone server has no change streams: waiters poll with jittered backoff
(``notifies=False``). Nothing is queued: ``fair=False``.

**What is tested, and what is not.** No MongoDB server can be installed where this
store was written. ``tests/unit/test_mongodb_store.py`` checks the pure parts — ids,
filters, the update pipelines (their structure and the literal-wrapping of user
values, and what they do to a lease document by MongoDB's documented semantics,
``tests/_mongo_semantics.py``), the decoding of replies shaped as pymongo returns
them, the server's clock as learnt, change events, URL and options, and when the TTL
index is made and who waits for it, in a forked child too (on collections that
only record the calls). The
conformance suite runs against a real server only when
``KEYMUTEX_TEST_MONGODB_URL`` is set; until someone runs it, the I/O shells below,
the change-stream waiting and the no-op claim for refusals are untested.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import parse_qsl, unquote

import dns.exception
import pymongo
import pymongo.asynchronous.collection
import pymongo.collection
from bson.codec_options import CodecOptions
from pymongo import AsyncMongoClient, MongoClient, ReadPreference, ReturnDocument
from pymongo.common import URI_OPTIONS_VALIDATOR_MAP
from pymongo.errors import (
    ConfigurationError,
    ConnectionFailure,
    DuplicateKeyError,
    OperationFailure,
    PyMongoError,
)
from pymongo.uri_parser import split_options

from keymutex import _clock
from keymutex._errors import StoreError
from keymutex._lease import Holder, Outcome
from keymutex._store import Capabilities, RenewRequest, stop_task, translate_errors
from keymutex._urls import redacted, scrubbed, split_url
from keymutex.stores._doorbell import Doorbell, LoopDoorbell

__all__ = ["AsyncMongoStore", "MongoStore", "driver"]

_LOG = logging.getLogger("keymutex")

CAPABILITIES = Capabilities(
    notifies=False, fair=False, cross_process=True, durable_fences=True, clock="server"
)
DEFAULT_DATABASE = "keymutex"
DEFAULT_COLLECTION = "keymutex_locks"
GC_GRACE = 24 * 3600  # seconds a document outlives its last lease (TTL index on ``e``)
# Seconds between two makings of the TTL index, while the store is used: it is made again
# after a failure that may pass, and after the collection was dropped (which drops it).
INDEX_RECHECK = 600.0
# Seconds close() waits for a making of the index under way (in its thread) to end: a
# no-op answers in milliseconds. A slower one (an index built on a large collection) is
# left to end by itself, within the client's socket timeout (10 s unless the URL sets
# it): pymongo cannot stop a sync call under way, and discards its connection when it
# comes back to the closed client. aclose() cancels its task instead.
INDEX_CLOSE_PATIENCE = 5.0
# Seconds a store's first step waits for the first making of the index (a no-op, or an
# index on an empty collection, answers in milliseconds) before it goes on without it,
# the making left to end in its thread or task: a build that stalls (a voting member
# down while the index is built on a collection that has documents) must not hold up
# or fail the steps.
INDEX_FIRST_PATIENCE = 2.0
# What trying again will not mend: no privilege, or an index on ``e`` already there
# with other options or under another name.
_INDEX_FINAL_CODES = frozenset({13, 85, 86})
# Seconds to the first making again after a failure that passes in seconds (the server
# or its primary out of reach, ``_index_failure_passes``), doubled at each such failure
# in a row up to ``INDEX_RECHECK``. Found by review: made again only after
# ``INDEX_RECHECK``, a first making that met a server restarting or an election left
# the documents of ended leases uncollected for ten minutes.
INDEX_RETRY_FIRST = 5.0
# What a mongos (or a member) answers when it cannot reach another member:
# HostUnreachable, HostNotFound, NetworkTimeout, SocketException. pymongo raises them as
# ``OperationFailure``; its own failures to reach a server are ``ConnectionFailure``.
_INDEX_NETWORK_CODES = frozenset({6, 7, 89, 9001})
# Taken by a forked child's first use of a sync store (``MongoStore._forked``) only.
_FORK_MUTEX = threading.Lock()
# Timeouts pymongo gets unless the URL sets them: a lock call must not hang for 30 s.
DEFAULT_TIMEOUTS_MS = {
    "serverSelectionTimeoutMS": 5000,
    "connectTimeoutMS": 5000,
    "socketTimeoutMS": 10000,
}
WATCH_AWAIT_MS = 500  # a change stream's getMore waits this long, so close() is prompt
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_PROJECTION = {"k": 1, "t": 1, "o": 1, "i": 1, "f": 1, "a": 1, "e": 1, "n": 1}

# -- documents, filters and pipelines (pure) -----------------------------------------


def document_id(namespace: str, key: str) -> str:
    """The ``_id`` of ``key``'s document: the namespace's length makes it unambiguous."""
    return f"{len(namespace)}:{namespace}/{key}"


def id_pattern(namespace: str, prefix: str) -> str:
    """An anchored regex for the ``_id``s of ``namespace``'s keys that start with ``prefix``."""
    return "^" + re.escape(document_id(namespace, prefix))


_LIVE = {"$and": [{"$gt": ["$e", "$$NOW"]}, {"$ne": [{"$type": "$t"}, "missing"]}]}


def acquire_filter(doc_id: str) -> dict[str, Any]:
    # An equality on _id only: the server retries a colliding upsert itself.
    return {"_id": doc_id}


def info_text(info: dict[str, Any] | None) -> str | None:
    """``info`` as the document keeps it: JSON text, as every other store does.

    Not a sub-document: JSON allows what BSON or MongoDB's field names do not
    (integers beyond 64 bits, NUL, and names with ``$`` or ``.``, which MongoDB
    accepts in some operations and refuses in others, by version).
    """
    return None if info is None else json.dumps(info, separators=(",", ":"), ensure_ascii=False)


def acquire_pipeline(
    key: str, token: str, ttl: float, owner: str, info: dict[str, Any] | None, steal: bool
) -> list[dict[str, Any]]:
    """Grant if no live lease (or ``steal``), else leave every field as it is.

    A live lease of ``token`` itself (an acquire asked again, its answer lost) is not
    granted again, even by ``steal``: it is answered as it stands, its fence and expiry
    kept, with ``n`` moved to now so that ``e - n`` is the time it has left (found by
    review: it was the whole TTL of the first grant, however long ago that was).

    User values are wrapped in ``$literal``: an owner or a key that starts with ``$``
    is data, never a field path or an operator.
    """
    mine = {"$eq": ["$t", {"$literal": token}]}
    grant: Any = {"$not": [{"$and": [_LIVE, mine]}]} if steal else {"$not": [_LIVE]}
    fence = {
        "$max": [
            {"$add": [{"$ifNull": ["$f", 0]}, 1]},
            {"$multiply": [{"$toLong": "$$NOW"}, 1000]},
        ]
    }
    new = {
        "k": {"$literal": key},
        "t": {"$literal": token},
        "o": {"$literal": owner},
        "i": {"$literal": info_text(info)},
        "f": fence,
        "a": "$$NOW",
        "e": {"$add": ["$$NOW", _milliseconds(ttl)]},
        "n": "$$NOW",
    }
    fields = {name: {"$cond": ["$_grant", value, f"${name}"]} for name, value in new.items()}
    fields["n"] = {"$cond": [{"$or": ["$_grant", mine]}, "$$NOW", "$n"]}
    return [{"$set": {"_grant": grant}}, {"$set": fields}, {"$unset": "_grant"}]


def renew_filter(doc_id: str, token: str) -> dict[str, Any]:
    return {"_id": doc_id, "t": token, "$expr": {"$gt": ["$e", "$$NOW"]}}


def renew_pipeline(ttl: float) -> list[dict[str, Any]]:
    return [{"$set": {"e": {"$add": ["$$NOW", _milliseconds(ttl)]}, "n": "$$NOW"}}]


def release_filter(doc_id: str, token: str) -> dict[str, Any]:
    return renew_filter(doc_id, token)


# The document stays (its fence is the key's next one); the token goes, ``e`` ends now
# (the server's clock). Update operators, not a pipeline: MongoDB may log a pipeline
# update as a "replace" in change streams (SERVER-85923: "unsets done by update
# aggregation pipelines show up as replacement"), which waiters would not hear.
RELEASE_UPDATE: dict[str, Any] = {"$unset": {"t": ""}, "$currentDate": {"e": True, "n": True}}


def holder_filter(doc_id: str) -> dict[str, Any]:
    return {"_id": doc_id, "t": {"$exists": True}, "$expr": {"$gt": ["$e", "$$NOW"]}}


def holders_filter(namespace: str, prefix: str) -> dict[str, Any]:
    return {
        "_id": {"$regex": id_pattern(namespace, prefix)},
        "t": {"$exists": True},
        "$expr": {"$gt": ["$e", "$$NOW"]},
    }


def released_pipeline(namespace: str) -> list[dict[str, Any]]:
    """The change-stream filter: this namespace's releases and deletions (and a
    document replaced by one without a token, however the server logged a release)."""
    return [
        {
            "$match": {
                "documentKey._id": {"$regex": id_pattern(namespace, "")},
                "$or": [
                    {"operationType": "delete"},
                    {"operationType": "update", "updateDescription.removedFields": "t"},
                    {"operationType": "replace", "fullDocument.t": {"$exists": False}},
                ],
            }
        }
    ]


def released_id(change: Mapping[str, Any]) -> str | None:
    """The ``_id`` whose key a change-stream event frees, if any."""
    kind = change.get("operationType")
    doc_id = change.get("documentKey", {}).get("_id")
    if not isinstance(doc_id, str):
        return None
    if kind == "delete":
        return doc_id
    if kind == "update" and "t" in change.get("updateDescription", {}).get("removedFields", []):
        return doc_id
    if kind == "replace" and "t" not in (change.get("fullDocument") or {"t": None}):
        return doc_id
    return None


# MongoDB 4.4.0 and 4.4.1 (which pymongo still serves) have no ``hello``: ``isMaster``.
_COMMAND_NOT_FOUND = 59


def notifies(hello: Mapping[str, Any]) -> bool:
    """Whether a server with this ``hello`` reply has change streams (not a standalone)."""
    return "setName" in hello or hello.get("msg") == "isdbgrid"


def _milliseconds(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def unix_seconds(moment: datetime.datetime) -> float:
    """A BSON date as pymongo decodes it (naive UTC, or aware) in UNIX seconds."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return (moment - _EPOCH).total_seconds()


class ServerClock:
    """The primary's wall clock as this host estimates it: a refusal's time left is
    the holder's ``e`` minus the server's now, and a host whose clock runs ahead by more
    than that would otherwise see every held key as about to expire, and look again
    every few milliseconds (found by review).

    Learnt from ``hello``'s ``localTime`` and from every grant or renewal, whose ``n``
    is the server's ``$$NOW``: the offset at the middle of that round trip.
    """

    __slots__ = ("_offset",)

    def __init__(self) -> None:
        self._offset = 0.0

    def learn(self, server_time: datetime.datetime, sent: float, received: float) -> None:
        self._offset = unix_seconds(server_time) - (sent + received) / 2

    def learn_from(self, outcome: Outcome, doc: Mapping[str, Any] | None, sent: float) -> Outcome:
        """``outcome``, read from ``doc``: a grant or renewal carries the server's now."""
        if outcome.ok and doc is not None:
            self.learn(doc["n"], sent, time.time())
        return outcome

    def learn_from_hello(self, hello: Mapping[str, Any], sent: float, received: float) -> None:
        local_time = hello.get("localTime")
        if isinstance(local_time, datetime.datetime):
            self.learn(local_time, sent, received)

    def now(self) -> float:
        return time.time() + self._offset


def decode_holder(doc: Mapping[str, Any]) -> Holder:
    try:
        info = doc.get("i")
        return Holder(
            key=str(doc["k"]),
            owner=str(doc["o"]),
            info=None if info is None else dict(json.loads(info)),
            fence=int(doc["f"]),
            acquired_at=unix_seconds(doc["a"]),
            expires_at=unix_seconds(doc["e"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StoreError(f"MongoDB document {doc.get('_id')!r} is not a keymutex lease") from exc


def acquire_outcome(doc: Mapping[str, Any] | None, token: str, now: float) -> Outcome:
    """Read the document after an acquire: ours if it carries our token.

    A grant's time left is measured on the server (``e - n``); a refusal's is
    estimated with ``now``, the server's clock as this host knows it (``ServerClock``:
    it only tells a waiter when to look again).
    """
    if doc is None:  # only without upsert; kept total for safety
        return Outcome(False)
    if doc.get("t") == token:
        return _granted(doc)
    if doc.get("t") is None:
        return Outcome(False)
    holder = decode_holder(doc)
    return Outcome(False, holder, max(0.0, holder.expires_at - now))


def _granted(doc: Mapping[str, Any]) -> Outcome:
    holder = decode_holder(doc)
    try:
        remaining = (doc["e"] - doc["n"]).total_seconds()
    except (KeyError, TypeError) as exc:  # found by review: a bare KeyError before
        raise StoreError(f"MongoDB document {doc.get('_id')!r} is not a keymutex lease") from exc
    return Outcome(True, holder, remaining)


def renew_outcome(doc: Mapping[str, Any] | None) -> Outcome | None:
    """The outcome of a renewal that matched, or ``None``: the token holds nothing."""
    return None if doc is None else _granted(doc)


def holder_outcome(doc: Mapping[str, Any] | None, now: float) -> Outcome:
    """A refusal (of renew or release) naming the current holder, read just after."""
    if doc is None:
        return Outcome(False)
    holder = decode_holder(doc)
    return Outcome(False, holder, max(0.0, holder.expires_at - now))


# -- URLs and options (pure) ---------------------------------------------------------

OPTIONS = frozenset({"database", "collection"})


@dataclass(frozen=True, slots=True)
class Target:
    """What a URL and the options name: the URL for pymongo, extra client options, names."""

    url: str
    client_options: dict[str, Any]
    database: str | None  # None: the URL's default database, else DEFAULT_DATABASE
    collection: str


# What MongoDB refuses in names (its "Naming Restrictions"), checked before pymongo,
# whose InvalidName would otherwise come out of Locks() as is.
_DATABASE_REFUSED = set('/\\. "$\0')
_MAX_DATABASE_BYTES = 63


def _name(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str (a MongoDB {what} name), not {value!r}")
    if what == "database":
        if (
            not value
            or _DATABASE_REFUSED & set(value)
            or len(value.encode()) > _MAX_DATABASE_BYTES
        ):
            raise ValueError(
                f"database must be a MongoDB database name: 1 to {_MAX_DATABASE_BYTES}"
                f' bytes without / \\ . space " $ or NUL, not {value!r}'
            )
        return value
    if (
        not value
        or "\0" in value
        or "$" in value
        or ".." in value
        or value.startswith((".", "system."))
        or value.endswith(".")
    ):
        raise ValueError(
            f"collection must be a MongoDB collection name: not empty, without $, NUL or"
            f" '..', not starting with '.' or 'system.' nor ending with '.', not {value!r}"
        )
    return value


def parse(url: str, options: Mapping[str, object]) -> Target:
    unknown = set(options) - OPTIONS
    if unknown:
        raise TypeError(
            f"unknown MongoDB store options {sorted(unknown)}; accepted: {sorted(OPTIONS)}"
            " (client options such as replicaSet or tls go in the URL's query)"
        )
    parts = split_url(url, "MongoDB", "mongodb://… or mongodb+srv://…")
    if parts.scheme.lower() not in ("mongodb", "mongodb+srv"):
        raise ValueError(f"{redacted(url)!r} is not a mongodb:// or mongodb+srv:// URL")
    # Split as pymongo does: by ';' when the query has no '&' (found by review: read by
    # '&' alone, "?appname=a;w=1" named only appname, and the store's defaults then
    # overrode the URL's w and timeouts).
    separator = ";" if ";" in parts.query and "&" not in parts.query else "&"
    query = parse_qsl(parts.query, keep_blank_values=True, separator=separator)
    given = {name.lower(): name for name, _ in query}
    if parts.query:
        for lowered, name in given.items():
            # pymongo's own refusal does not name the option (since pymongo 4.20).
            if lowered not in URI_OPTIONS_VALIDATOR_MAP:
                raise ValueError(
                    f"{redacted(url)!r} is not a usable MongoDB URL: unknown option {name!r}"
                    " in its query (the options of pymongo's connection strings are accepted)"
                )
        try:
            # pymongo only warns about an unknown option, and then ignores it.
            parsed = split_options(parts.query, validate=True, warn=False)
        # OSError: tlsCAFile=…; KeyError: datetime_conversion=…; TypeError: server_api=…
        except (ConfigurationError, ValueError, OSError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{redacted(url)!r} is not a usable MongoDB URL: {scrubbed(str(exc), url)}"
            ) from None
        # As pymongo reads it: w=00 and w=-0 are w=0 too (found by review).
        if parsed.get("w") == 0:
            raise ValueError(
                f"{redacted(url)!r}: w=0 (unacknowledged writes) cannot hold locks: the"
                " store reads each write's result to know whether it was granted. Use"
                " w=majority (the store's default)"
            )
    client_options: dict[str, Any] = {
        name: value for name, value in DEFAULT_TIMEOUTS_MS.items() if name.lower() not in given
    }
    if "appname" not in given:
        client_options["appname"] = "keymutex"
    if "w" not in given:
        # Whatever the server's default (w: 1 on MongoDB 4.4, with some arbiters, or
        # set so by an admin): a grant acknowledged by the primary alone can be rolled
        # back by a failover, and the key granted again to another client.
        client_options["w"] = "majority"
    path_database = unquote(parts.path.lstrip("/"))
    if "." in path_database:
        raise ValueError(
            f"{redacted(url)!r}: the URL's path names a database.collection; name the"
            " database alone in the URL (or with database=…) and the collection with"
            " collection=…"
        )
    if path_database:
        _name(path_database, "database")
    database = options.get("database")
    return Target(
        url,
        client_options,
        None if database is None else _name(database, "database"),
        _name(options.get("collection", DEFAULT_COLLECTION), "collection"),
    )


def _database_name(client: Any, target: Target) -> str:
    if target.database is not None:
        return target.database
    return str(client.get_default_database(default=DEFAULT_DATABASE).name)


# How replies are decoded whatever the URL says (found by review: with
# ?datetime_conversion=DATETIME_MS dates came back as DatetimeMS, and every grant,
# ours too, read as "not a keymutex lease").
_CODEC_OPTIONS: CodecOptions[dict[str, Any]] = CodecOptions(tz_aware=True, tzinfo=datetime.UTC)


def _collection(client: Any, target: Target) -> Any:
    """The leases' collection, read on the primary whatever the URL's readPreference:
    a secondary's copy may name a holder that has released, or none for a held key."""
    return client[_database_name(client, target)].get_collection(
        target.collection, read_preference=ReadPreference.PRIMARY, codec_options=_CODEC_OPTIONS
    )


# -- the synchronous store ---------------------------------------------------------


class _MongoWaiter(Doorbell):
    __slots__ = ("_watcher", "doc_id")

    def __init__(self, watcher: _Watcher | None, doc_id: str) -> None:
        super().__init__()
        self._watcher = watcher
        self.doc_id = doc_id

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.leave(self)


def _failed_stream(exc: Exception, *, again: bool) -> None:
    """A change stream failed: a warning the first time, then DEBUG until it has opened
    again (found by review: one that can never open, change streams refused to the
    user's role, warned every 2 s for ever, per namespace)."""
    _LOG.log(
        logging.DEBUG if again else logging.WARNING,
        "MongoDB change stream failed, reopening%s: %s",
        " (still)" if again else " (waiters look again every second meanwhile)",
        exc,
    )


class _Watcher:
    """One change stream per store, read by one thread, that rings released keys' waiters.

    ``join`` returns once the stream is open, so a release after it is never missed.
    When the stream fails, every waiter is rung (each looks again) and it reopens;
    once it has, every waiter is rung again (a release while it was down was missed).
    While it is down, or cannot open at all (change streams disabled, as on some
    MongoDB-compatible services, or a role without the changeStream action), ``join``
    returns at once. Found by review: it waited ``patience`` (5 s) for every waiter,
    whatever the caller's timeout, while the stream could not open, and after a
    primary step-down while it reopened.
    """

    def __init__(self, collection: pymongo.collection.Collection[Any], namespace: str) -> None:
        self._collection = collection
        self._pipeline = released_pipeline(namespace)
        self._mutex = threading.Lock()
        self._waiters: dict[str, set[_MongoWaiter]] = {}
        self._open = threading.Event()
        self._tried = threading.Event()  # the first attempt to open ended, either way
        self._failing = False  # the last attempt to open failed: the stream is down
        self._thread: threading.Thread | None = None
        self._closed = False

    def join(self, waiter: _MongoWaiter, patience: float) -> None:
        with self._mutex:
            self._waiters.setdefault(waiter.doc_id, set()).add(waiter)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="keymutex-mongodb-watch", daemon=True
                )
                self._thread.start()
        # Else the waiter relies on its rechecks.
        give_up = time.monotonic() + patience
        if self._tried.wait(patience) and not self._failing:
            self._open.wait(max(0.0, give_up - time.monotonic()))

    def leave(self, waiter: _MongoWaiter) -> None:
        with self._mutex:
            waiting = self._waiters.get(waiter.doc_id)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self._waiters[waiter.doc_id]

    def _ring(self, doc_id: str | None) -> None:
        with self._mutex:
            if doc_id is None:
                ringing = [w for waiting in self._waiters.values() for w in waiting]
            else:
                ringing = list(self._waiters.get(doc_id, ()))
        for waiter in ringing:
            waiter.ring()

    def _run(self) -> None:
        pause = 0.05
        while not self._closed:
            try:
                with self._collection.watch(
                    self._pipeline, max_await_time_ms=WATCH_AWAIT_MS
                ) as stream:
                    reopened, self._failing = self._failing, False
                    self._open.set()
                    self._tried.set()
                    if reopened:  # a waiter that joined while it was down looks again
                        self._ring(None)
                    pause = 0.05
                    while not self._closed and stream.alive:
                        change = stream.try_next()
                        if change is not None:
                            self._ring(released_id(change))
            except Exception as exc:  # PyMongoError, or a bad event (InvalidBSON, …)
                if self._closed:
                    return
                _failed_stream(exc, again=self._failing)
                self._failing = True  # until it opens again: joins do not wait for it
                self._open.clear()
                self._tried.set()
                self._ring(None)  # releases may have been missed: everyone looks again
                time.sleep(pause)
                pause = min(2.0, pause * 2)

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._thread.join(WATCH_AWAIT_MS / 1000 * 4)


def _index_failure_passes(exc: Exception) -> bool:
    """Whether a making of the index failed because the server (or its primary) could
    not be reached, which passes in seconds: a restart, an election, a network blip.

    pymongo's ``ConnectionFailure``: ``AutoReconnect`` and its ``NetworkTimeout``,
    ``NotPrimaryError`` (also raised for the server's "not primary" and "shutting down"
    codes) and ``ServerSelectionTimeoutError``, and ``WaitQueueTimeoutError``; and a
    mongos's network errors (``_INDEX_NETWORK_CODES``). Not the other
    ``OperationFailure``s: a time limit exceeded (a build slower than the client waits,
    which a making again soon would only wait for again), a write concern not met, or
    no privilege (``_INDEX_FINAL_CODES``, never made again).
    """
    if isinstance(exc, ConnectionFailure):
        return True
    return isinstance(exc, OperationFailure) and exc.code in _INDEX_NETWORK_CODES


class _IndexPlan:
    """When a store makes its TTL index (again): at its first step, then every
    ``INDEX_RECHECK`` seconds while used (a no-op while the index is there), one at a
    time, and never again after a failure that trying again will not mend.

    After a failure that passes in seconds (``_index_failure_passes``), it is due again
    ``INDEX_RETRY_FIRST`` seconds after that failure, doubled at each such failure in
    a row up to ``INDEX_RECHECK``; a making that ends well starts that count again. As
    every making, it is started by the store's first step after it fell due.

    Not thread-safe: the sync store consults it under a mutex.
    """

    __slots__ = ("_due", "_making", "_retry_in")

    def __init__(self) -> None:
        self._due: float | None = 0.0
        self._making = False
        self._retry_in = INDEX_RETRY_FIRST  # after the next failure that passes

    def take(self) -> bool:
        """Whether to make it now; if so, the next time is set already, and nothing is
        taken until ``made`` or ``failed`` says that this one ended (a createIndexes
        slower than ``INDEX_RECHECK``, on a socket without a timeout, is not doubled)."""
        now = _clock.monotonic()
        if self._making or self._due is None or now < self._due:
            return False
        self._due = now + INDEX_RECHECK
        self._making = True
        return True

    def made(self) -> None:
        self._making = False
        self._retry_in = INDEX_RETRY_FIRST

    def failed(self, exc: Exception) -> None:
        # Locks work without the index; only the garbage collection of documents does not.
        self._making = False
        if isinstance(exc, OperationFailure) and exc.code in _INDEX_FINAL_CODES:
            self._due = None
            _LOG.warning("MongoDB: cannot create the TTL index on 'e': %s", exc)
            return
        if _index_failure_passes(exc):
            retry_in = self._retry_in
            self._due = _clock.monotonic() + retry_in
            self._retry_in = min(INDEX_RECHECK, retry_in * 2)
        else:  # due INDEX_RECHECK after it was taken; a run of the others ends here
            retry_in, self._retry_in = INDEX_RECHECK, INDEX_RETRY_FIRST
        # A warning at the first failure in a row that passes, and at each once the
        # backoff has reached INDEX_RECHECK, as at any other failure; the six in between
        # (over the first ten minutes or so that a server is down) at DEBUG.
        quiet = INDEX_RETRY_FIRST < retry_in < INDEX_RECHECK
        _LOG.log(
            logging.DEBUG if quiet else logging.WARNING,
            "MongoDB: cannot create the TTL index on 'e' (tried again in %.0f s): %s",
            retry_in,
            exc,
        )


class MongoStore:
    """The MongoDB store for one namespace (see the module for the guarantees)."""

    def __init__(self, client: MongoClient[Any], target: Target, namespace: str) -> None:
        self._client = client
        self._namespace = namespace
        self._collection = _collection(client, target)
        self.capabilities = CAPABILITIES
        self._clock = ServerClock()
        self._prepared = False
        self._prepare_mutex = threading.Lock()
        self._watcher: _Watcher | None = None
        self._index = _IndexPlan()
        self._index_mutex = threading.Lock()  # for the plan, the thread, ``_closed``
        self._index_thread: threading.Thread | None = None
        self._closed = False
        self._pid = os.getpid()  # the process whose threads and mutexes these are

    def _prepare(self) -> None:
        """Once per store (per process): ask the server what it is, and start making the
        TTL index, which the first step waits for up to ``INDEX_FIRST_PATIENCE``; then
        start making it again when it is due (``_recheck_index``), without waiting."""
        if self._pid != os.getpid():
            self._forked()
        if self._prepared:
            self._recheck_index()
            return
        with self._prepare_mutex:
            if self._prepared:
                return
            with translate_errors(PyMongoError, what="MongoDB hello"):
                sent = time.time()
                try:
                    hello = self._client.admin.command("hello", codec_options=_CODEC_OPTIONS)
                except OperationFailure as exc:
                    if exc.code != _COMMAND_NOT_FOUND:
                        raise
                    hello = self._client.admin.command("isMaster", codec_options=_CODEC_OPTIONS)
            self._clock.learn_from_hello(hello, sent, time.time())
            making = self._recheck_index()  # the first making (none before it)
            if notifies(hello):
                self._watcher = _Watcher(self._collection, self._namespace)
                self.capabilities = replace(CAPABILITIES, notifies=True)
            self._prepared = True
        if making is not None:  # outside the mutex: the other threads' steps go on
            making.join(INDEX_FIRST_PATIENCE)

    def _forked(self) -> None:
        """Make the store this process's own, at its first use in a forked child.

        The parent's threads did not come along: the making of the index under way
        and the change stream's reader (the child starts its own), and any of them may
        have held a mutex at the fork, held for good in the child (found by review: a
        child forked while the parent's first step waited for the server hung at its
        own first step; one forked while the index was made never made it again, and
        its waiters were never rung). The process id is compared at use, not reset by
        ``os.register_at_fork``: uWSGI's workers are forked without Python's hooks.
        pymongo's client and pools reset themselves in the child.
        """
        with _FORK_MUTEX:
            if self._pid == os.getpid():  # another thread of the child did it
                return
            self._prepare_mutex = threading.Lock()
            self._index_mutex = threading.Lock()
            self._index_thread = None
            # Due at once: a making under way at the fork was the parent's, whose end is
            # never told here (found by review: the child never made the index again).
            self._index = _IndexPlan()
            if self._watcher is not None:
                self._watcher = _Watcher(self._collection, self._namespace)
            self._pid = os.getpid()

    def _make_index(self) -> None:
        self._collection.create_index("e", expireAfterSeconds=GC_GRACE, name="keymutex_gc")

    def _recheck_index(self) -> threading.Thread | None:
        """If the index is due to be made (again), start making it in a thread of its
        own, and return that thread.

        Found by review: it was made in the step that found it due, one createIndexes
        round trip every ``INDEX_RECHECK`` inside a user's acquire or the renewer's
        call, which a slow answer (a sharded cluster, a large collection, a busy
        primary) delayed or failed.
        """
        with self._index_mutex:
            if self._closed or not self._index.take():
                return None
            thread = threading.Thread(
                target=self._remake_index, name="keymutex-mongodb-index", daemon=True
            )
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had (the interpreter is exiting)
                self._index.failed(exc)
                return None
            self._index_thread = thread
            return thread

    def _remake_index(self) -> None:
        failure: Exception | None = None
        try:
            self._make_index()
        except Exception as exc:  # PyMongoError, or else: a warning, never a step's failure
            failure = exc
        with self._index_mutex:
            if failure is None:
                self._index.made()
            elif not self._closed:  # else the client was closed under it: nothing to say
                self._index.failed(failure)

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
        pipeline = acquire_pipeline(key, token, ttl, owner, info, steal)  # checks info first
        self._prepare()
        doc_id = document_id(self._namespace, key)
        with translate_errors(PyMongoError, what=f"MongoDB acquire of {key!r}"):
            sent = time.time()
            for attempt in range(2):
                try:
                    doc = self._collection.find_one_and_update(
                        acquire_filter(doc_id),
                        pipeline,
                        projection=_PROJECTION,
                        upsert=True,
                        return_document=ReturnDocument.AFTER,
                    )
                    break
                except DuplicateKeyError:  # a concurrent upsert created it first
                    if attempt:
                        raise
        return self._clock.learn_from(acquire_outcome(doc, token, self._clock.now()), doc, sent)

    def renew(self, key: str, token: str, ttl: float) -> Outcome:
        self._prepare()
        doc_id = document_id(self._namespace, key)
        with translate_errors(PyMongoError, what=f"MongoDB renewal of {key!r}"):
            sent = time.time()
            doc = self._collection.find_one_and_update(
                renew_filter(doc_id, token),
                renew_pipeline(ttl),
                projection=_PROJECTION,
                return_document=ReturnDocument.AFTER,
            )
            found = renew_outcome(doc)
            if found is not None:
                return self._clock.learn_from(found, doc, sent)
            current = self._collection.find_one(holder_filter(doc_id), _PROJECTION)
        return holder_outcome(current, self._clock.now())

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        return [self.renew(r.key, r.token, r.ttl) for r in requests]

    def release(self, key: str, token: str) -> Outcome:
        self._prepare()
        doc_id = document_id(self._namespace, key)
        with translate_errors(PyMongoError, what=f"MongoDB release of {key!r}"):
            doc = self._collection.find_one_and_update(
                release_filter(doc_id, token), RELEASE_UPDATE, projection={"_id": 1}
            )
            if doc is not None:
                return Outcome(True)
            current = self._collection.find_one(holder_filter(doc_id), _PROJECTION)
        return holder_outcome(current, self._clock.now())

    def holder(self, key: str) -> Holder | None:
        doc_id = document_id(self._namespace, key)
        with translate_errors(PyMongoError, what=f"MongoDB read of {key!r}"):
            doc = self._collection.find_one(holder_filter(doc_id), _PROJECTION)
        return None if doc is None else decode_holder(doc)

    def holders(self, prefix: str) -> list[Holder]:
        with translate_errors(PyMongoError, what=f"MongoDB listing of {prefix!r}"):
            docs = list(
                self._collection.find(holders_filter(self._namespace, prefix), _PROJECTION).sort(
                    "_id", pymongo.ASCENDING
                )
            )
        return sorted((decode_holder(doc) for doc in docs), key=lambda holder: holder.key)

    def waiter(self, key: str) -> _MongoWaiter:
        self._prepare()
        waiter = _MongoWaiter(self._watcher, document_id(self._namespace, key))
        if self._watcher is not None:
            self._watcher.join(waiter, DEFAULT_TIMEOUTS_MS["serverSelectionTimeoutMS"] / 1000)
        return waiter

    def close(self) -> None:
        if self._pid != os.getpid():  # not the parent's mutex, nor its threads to wait for
            self._forked()
        with self._index_mutex:
            self._closed = True  # no making of the index starts any more
            making = self._index_thread
        if making is not None:
            making.join(INDEX_CLOSE_PATIENCE)
        if self._watcher is not None:
            self._watcher.close()
        self._client.close()


# -- the asyncio store -------------------------------------------------------------


class _AsyncMongoWaiter(LoopDoorbell):
    __slots__ = ("_watcher", "doc_id")

    def __init__(self, watcher: _AsyncWatcher | None, doc_id: str) -> None:
        super().__init__()
        self._watcher = watcher
        self.doc_id = doc_id

    async def aclose(self) -> None:
        if self._watcher is not None:
            self._watcher.leave(self)


class _AsyncWatcher:
    """``_Watcher`` for asyncio: one task reads the change stream."""

    def __init__(
        self, collection: pymongo.asynchronous.collection.AsyncCollection[Any], namespace: str
    ) -> None:
        self._collection = collection
        self._pipeline = released_pipeline(namespace)
        self._waiters: dict[str, set[_AsyncMongoWaiter]] = {}
        self._open = asyncio.Event()
        self._tried = asyncio.Event()  # as in _Watcher
        self._failing = False
        self._task: asyncio.Task[None] | None = None

    async def join(self, waiter: _AsyncMongoWaiter, patience: float) -> None:
        self._waiters.setdefault(waiter.doc_id, set()).add(waiter)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="keymutex-mongodb-watch"
            )
        with contextlib.suppress(TimeoutError):  # else the waiter relies on its rechecks
            async with asyncio.timeout(patience):
                await self._tried.wait()
                if not self._failing:
                    await self._open.wait()

    def leave(self, waiter: _AsyncMongoWaiter) -> None:
        waiting = self._waiters.get(waiter.doc_id)
        if waiting is not None:
            waiting.discard(waiter)
            if not waiting:
                del self._waiters[waiter.doc_id]

    def _ring(self, doc_id: str | None) -> None:
        if doc_id is None:
            ringing = [w for waiting in self._waiters.values() for w in waiting]
        else:
            ringing = list(self._waiters.get(doc_id, ()))
        for waiter in ringing:
            waiter.ring()

    async def _run(self) -> None:
        pause = 0.05
        while True:
            try:
                async with await self._collection.watch(
                    self._pipeline, max_await_time_ms=WATCH_AWAIT_MS
                ) as stream:
                    reopened, self._failing = self._failing, False
                    self._open.set()
                    self._tried.set()
                    if reopened:
                        self._ring(None)
                    pause = 0.05
                    while stream.alive:
                        change = await stream.try_next()
                        if change is not None:
                            self._ring(released_id(change))
            except Exception as exc:  # as in _Watcher
                _failed_stream(exc, again=self._failing)
                self._failing = True
                self._open.clear()
                self._tried.set()
                self._ring(None)
                await asyncio.sleep(pause)
                pause = min(2.0, pause * 2)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)


class AsyncMongoStore:
    """The MongoDB store for asyncio, on pymongo's native ``AsyncMongoClient``."""

    # Its connections belong to the event loop that made them: an AsyncLocks used by
    # one loop after another opens a store of its own in each (_store.StoreOfTheLoop).
    loop_bound = True

    def __init__(self, client: AsyncMongoClient[Any], target: Target, namespace: str) -> None:
        self._client = client
        self._namespace = namespace
        self._collection = _collection(client, target)
        self.capabilities = CAPABILITIES
        self._clock = ServerClock()
        self._prepared = False
        self._prepare_lock: asyncio.Lock | None = None
        self._watcher: _AsyncWatcher | None = None
        self._index = _IndexPlan()
        self._index_task: asyncio.Task[None] | None = None
        self._closed = False

    async def _prepare(self) -> None:
        """As ``MongoStore._prepare``: the first making of the index is a task that the
        first step waits for up to ``INDEX_FIRST_PATIENCE``; cancelling the step (a
        timeout around it) does not cancel the task.

        Not made again after a fork, unlike ``MongoStore``: a store belongs to its event
        loop (``loop_bound``), and asyncio gives a forked child no running loop of its
        parent's; each loop of the child opens a store of its own.
        """
        if self._prepared:
            self._recheck_index()
            return
        if self._prepare_lock is None:
            self._prepare_lock = asyncio.Lock()
        async with self._prepare_lock:
            if self._prepared:
                return
            with translate_errors(PyMongoError, what="MongoDB hello"):
                sent = time.time()
                try:
                    hello = await self._client.admin.command("hello", codec_options=_CODEC_OPTIONS)
                except OperationFailure as exc:
                    if exc.code != _COMMAND_NOT_FOUND:
                        raise
                    hello = await self._client.admin.command(
                        "isMaster", codec_options=_CODEC_OPTIONS
                    )
            self._clock.learn_from_hello(hello, sent, time.time())
            making = self._recheck_index()  # the first making (none before it)
            if notifies(hello):
                self._watcher = _AsyncWatcher(self._collection, self._namespace)
                self.capabilities = replace(CAPABILITIES, notifies=True)
            self._prepared = True
        if making is not None:  # asyncio.wait cancels it neither at its timeout nor if
            # the step is cancelled; and the other tasks' steps go on meanwhile
            await asyncio.wait({making}, timeout=INDEX_FIRST_PATIENCE)

    async def _make_index(self) -> None:
        await self._collection.create_index("e", expireAfterSeconds=GC_GRACE, name="keymutex_gc")

    def _recheck_index(self) -> asyncio.Task[None] | None:
        """As ``MongoStore._recheck_index``: a task of the store's loop makes it."""
        if self._closed or not self._index.take():
            return None
        self._index_task = asyncio.get_running_loop().create_task(
            self._remake_index(), name="keymutex-mongodb-index"
        )
        return self._index_task

    async def _remake_index(self) -> None:
        try:
            await self._make_index()
        except Exception as exc:  # as in MongoStore; cancelled only by aclose()
            self._index.failed(exc)
        else:
            self._index.made()

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
        pipeline = acquire_pipeline(key, token, ttl, owner, info, steal)  # checks info first
        await self._prepare()
        doc_id = document_id(self._namespace, key)
        with translate_errors(PyMongoError, what=f"MongoDB acquire of {key!r}"):
            sent = time.time()
            for attempt in range(2):
                try:
                    doc = await self._collection.find_one_and_update(
                        acquire_filter(doc_id),
                        pipeline,
                        projection=_PROJECTION,
                        upsert=True,
                        return_document=ReturnDocument.AFTER,
                    )
                    break
                except DuplicateKeyError:
                    if attempt:
                        raise
        return self._clock.learn_from(acquire_outcome(doc, token, self._clock.now()), doc, sent)

    async def renew(self, key: str, token: str, ttl: float) -> Outcome:
        await self._prepare()
        doc_id = document_id(self._namespace, key)
        with translate_errors(PyMongoError, what=f"MongoDB renewal of {key!r}"):
            sent = time.time()
            doc = await self._collection.find_one_and_update(
                renew_filter(doc_id, token),
                renew_pipeline(ttl),
                projection=_PROJECTION,
                return_document=ReturnDocument.AFTER,
            )
            found = renew_outcome(doc)
            if found is not None:
                return self._clock.learn_from(found, doc, sent)
            current = await self._collection.find_one(holder_filter(doc_id), _PROJECTION)
        return holder_outcome(current, self._clock.now())

    async def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        return list(await asyncio.gather(*(self.renew(r.key, r.token, r.ttl) for r in requests)))

    async def release(self, key: str, token: str) -> Outcome:
        await self._prepare()
        doc_id = document_id(self._namespace, key)
        with translate_errors(PyMongoError, what=f"MongoDB release of {key!r}"):
            doc = await self._collection.find_one_and_update(
                release_filter(doc_id, token), RELEASE_UPDATE, projection={"_id": 1}
            )
            if doc is not None:
                return Outcome(True)
            current = await self._collection.find_one(holder_filter(doc_id), _PROJECTION)
        return holder_outcome(current, self._clock.now())

    async def holder(self, key: str) -> Holder | None:
        doc_id = document_id(self._namespace, key)
        with translate_errors(PyMongoError, what=f"MongoDB read of {key!r}"):
            doc = await self._collection.find_one(holder_filter(doc_id), _PROJECTION)
        return None if doc is None else decode_holder(doc)

    async def holders(self, prefix: str) -> list[Holder]:
        with translate_errors(PyMongoError, what=f"MongoDB listing of {prefix!r}"):
            cursor = self._collection.find(holders_filter(self._namespace, prefix), _PROJECTION)
            docs = await cursor.sort("_id", pymongo.ASCENDING).to_list(None)
        return sorted((decode_holder(doc) for doc in docs), key=lambda holder: holder.key)

    async def waiter(self, key: str) -> _AsyncMongoWaiter:
        await self._prepare()
        waiter = _AsyncMongoWaiter(self._watcher, document_id(self._namespace, key))
        if self._watcher is not None:
            await self._watcher.join(
                waiter, DEFAULT_TIMEOUTS_MS["serverSelectionTimeoutMS"] / 1000
            )
        return waiter

    async def aclose(self) -> None:
        self._closed = True  # no making of the index starts any more
        making, self._index_task = self._index_task, None
        await stop_task(making)  # a createIndexes cancelled: made again by the next store
        if self._watcher is not None:
            await self._watcher.aclose()
        await self._client.close()


# -- the driver --------------------------------------------------------------------


class MongoDriver:
    def open(self, url: str, *, namespace: str, options: Mapping[str, object]) -> MongoStore:
        target = parse(url, options)
        try:
            client: MongoClient[Any] = MongoClient(target.url, **target.client_options)
        except (ConfigurationError, ValueError) as exc:  # InvalidURI, bad ports among them
            if isinstance(exc.__cause__, dns.exception.DNSException):
                # A mongodb+srv:// name looked up now (the async client looks later):
                # a resolver that timed out is the store unreachable, not a bad URL.
                raise StoreError(
                    f"MongoDB: cannot look up {redacted(url)!r}: {scrubbed(str(exc), url)}"
                ) from exc
            raise ValueError(
                f"{redacted(url)!r} is not a usable MongoDB URL: {scrubbed(str(exc), url)}"
            ) from None
        try:
            return MongoStore(client, target, namespace)
        except BaseException:
            client.close()
            raise

    def open_async(
        self, url: str, *, namespace: str, options: Mapping[str, object]
    ) -> AsyncMongoStore:
        target = parse(url, options)
        try:
            client: AsyncMongoClient[Any] = AsyncMongoClient(target.url, **target.client_options)
        except (ConfigurationError, ValueError) as exc:
            raise ValueError(
                f"{redacted(url)!r} is not a usable MongoDB URL: {scrubbed(str(exc), url)}"
            ) from None
        return AsyncMongoStore(client, target, namespace)


driver = MongoDriver()

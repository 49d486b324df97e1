"""The MongoDB store's pure parts: ids, filters, update pipelines, reply decoding, URLs.

No MongoDB server can be installed where these tests were written, and nothing here
pretends to be one: these tests check the documents the store sends (their structure,
and that user values are always literals) and decode replies shaped as pymongo
returns them. Whether MongoDB evaluates the pipelines as intended is checked only by
the conformance suite, which runs the store against a real server when
``KEYMUTEX_TEST_MONGODB_URL`` is set (``test_conformance_server_is_usable`` below
says when it is not).
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import inspect
import os
import re
import time
from typing import Any

import pytest
from bson.int64 import Int64
from pymongo.errors import OperationFailure

import keymutex
from keymutex.stores import mongodb
from keymutex.stores.mongodb import (
    AsyncMongoStore,
    MongoStore,
    acquire_filter,
    acquire_outcome,
    acquire_pipeline,
    decode_holder,
    document_id,
    holder_filter,
    holder_outcome,
    holders_filter,
    id_pattern,
    notifies,
    parse,
    release_filter,
    released_id,
    released_pipeline,
    renew_filter,
    renew_outcome,
    renew_pipeline,
    unix_seconds,
)

TOKEN = "T" * 24
NOW = datetime.datetime(2026, 5, 4, 10, 0, 0, 250000)  # naive UTC, as pymongo decodes


def reply(**fields: Any) -> dict[str, Any]:
    """A lease document as ``find_one_and_update`` returns it (our projection)."""
    doc: dict[str, Any] = {
        "_id": document_id("shop", "order:1"),
        "k": "order:1",
        "t": TOKEN,
        "o": "host:1",
        "i": {"name": "Alice"},
        "f": Int64(1_777_000_000_000_001),
        "a": NOW,
        "e": NOW + datetime.timedelta(seconds=30),
        "n": NOW,
    }
    doc.update(fields)
    return {name: value for name, value in doc.items() if value is not None or name == "i"}


# -- ids and prefixes ------------------------------------------------------------------


def test_ids_are_unambiguous() -> None:
    assert document_id("a", "b/c") != document_id("a/b", "c")
    assert document_id("shop", "a:b") != document_id("shop:a", "b")
    assert document_id("", "x") == "0:/x"
    assert document_id("shop", "k") == "4:shop/k"


KEYS = ["a:1", "a:2", "a_3", "ab", "A:4", "%x", "*y", "[z]", "b:1", "a", "Zoë/1", "🔒a", "a.b"]


@pytest.mark.parametrize(
    "prefix", ["", "a", "a:", "a_", "A", "%", "*", "[", "[z", "Zo", "🔒", "a."]
)
def test_prefix_pattern_selects_exactly_the_namespaces_keys_with_the_prefix(prefix: str) -> None:
    # Python's re and MongoDB's PCRE read an escaped literal the same way.
    ids = {document_id(ns, key): key for ns in ("shop", "shop:a", "sho") for key in KEYS}
    pattern = id_pattern("shop", prefix)
    assert pattern.startswith("^")  # anchored: MongoDB scans only that range of _id
    found = {key for doc_id, key in ids.items() if re.match(pattern, doc_id) and doc_id[0] == "4"}
    matched = [doc_id for doc_id in ids if re.match(pattern, doc_id)]
    assert all(doc_id.startswith("4:shop/") for doc_id in matched)
    assert found == {key for key in KEYS if key.startswith(prefix)}


# -- what acquire sends ------------------------------------------------------------------


def test_acquire_is_one_upsert_on_the_id_alone() -> None:
    # An equality on _id only: the server retries a colliding upsert by itself.
    assert acquire_filter("4:shop/k") == {"_id": "4:shop/k"}


def test_acquire_pipeline_grants_only_a_free_key_and_keeps_a_held_one_untouched() -> None:
    pipeline = acquire_pipeline("k", TOKEN, 0.3, "$where", {"$gt": "$e"}, steal=False)
    assert [list(stage) for stage in pipeline] == [["$set"], ["$set"], ["$unset"]]
    grant = pipeline[0]["$set"]["_grant"]
    assert grant == {
        "$not": [{"$and": [{"$gt": ["$e", "$$NOW"]}, {"$ne": [{"$type": "$t"}, "missing"]}]}]
    }
    fields = pipeline[1]["$set"]
    assert set(fields) == {"k", "t", "o", "i", "f", "a", "e", "n"}
    for name, expression in fields.items():
        # Every field: the new value when granted, else its own value (a no-op update).
        condition, _new, old = expression["$cond"]
        assert condition == "$_grant"
        assert old == f"${name}"
    # User values are literals: an owner "$where" or an info {"$gt": "$e"} is data.
    assert fields["k"]["$cond"][1] == {"$literal": "k"}
    assert fields["t"]["$cond"][1] == {"$literal": TOKEN}
    assert fields["o"]["$cond"][1] == {"$literal": "$where"}
    assert fields["i"]["$cond"][1] == {"$literal": {"$gt": "$e"}}
    # Times from the server's clock; the TTL in milliseconds.
    assert fields["a"]["$cond"][1] == "$$NOW"
    assert fields["n"]["$cond"][1] == "$$NOW"
    assert fields["e"]["$cond"][1] == {"$add": ["$$NOW", 300]}
    # The key's next fence: one more than its last, and never below the clock in µs.
    assert fields["f"]["$cond"][1] == {
        "$max": [
            {"$add": [{"$ifNull": ["$f", 0]}, 1]},
            {"$multiply": [{"$toLong": "$$NOW"}, 1000]},
        ]
    }
    assert pipeline[2] == {"$unset": "_grant"}


def test_steal_grants_whatever_the_current_lease() -> None:
    pipeline = acquire_pipeline("k", TOKEN, 30, "me", None, steal=True)
    assert pipeline[0] == {"$set": {"_grant": True}}
    assert pipeline[1]["$set"]["i"]["$cond"][1] == {"$literal": None}


def test_tiny_ttls_still_last_a_millisecond() -> None:
    assert acquire_pipeline("k", TOKEN, 0.0001, "me", None, steal=False)[1]["$set"]["e"]["$cond"][
        1
    ] == {"$add": ["$$NOW", 1]}
    assert renew_pipeline(2.5) == [
        {"$set": {"e": {"$add": ["$$NOW", 2500]}, "n": "$$NOW"}},
    ]


def test_renew_release_and_reads_match_only_a_live_lease() -> None:
    live = {"$expr": {"$gt": ["$e", "$$NOW"]}}
    assert renew_filter("id", TOKEN) == {"_id": "id", "t": TOKEN, **live}
    assert release_filter("id", TOKEN) == {"_id": "id", "t": TOKEN, **live}
    assert holder_filter("id") == {"_id": "id", "t": {"$exists": True}, **live}
    assert holders_filter("shop", "a:") == {
        "_id": {"$regex": id_pattern("shop", "a:")},
        "t": {"$exists": True},
        **live,
    }
    # Release keeps the document (its fence is the key's next one), ends the lease now.
    assert mongodb.RELEASE_PIPELINE == [
        {"$set": {"e": "$$NOW", "n": "$$NOW"}},
        {"$unset": "t"},
    ]


# -- what the replies mean -------------------------------------------------------------


def test_a_grant_is_the_document_with_our_token_and_its_time_is_the_servers() -> None:
    outcome = acquire_outcome(reply(n=NOW + datetime.timedelta(seconds=1)), TOKEN, now=0.0)
    assert outcome.ok
    assert outcome.remaining == 29.0  # e - n, both by the server's clock
    holder = outcome.holder
    assert holder == keymutex.Holder(
        key="order:1",
        owner="host:1",
        info={"name": "Alice"},
        fence=1_777_000_000_000_001,
        acquired_at=unix_seconds(NOW),
        expires_at=unix_seconds(NOW) + 30,
    )
    assert type(holder.fence) is int


def test_a_refusal_is_the_current_holder_at_once() -> None:
    now = unix_seconds(NOW) + 10
    outcome = acquire_outcome(reply(t="someone-else" * 2, o="bob"), TOKEN, now=now)
    assert outcome.ok is False
    assert outcome.holder is not None
    assert outcome.holder.owner == "bob"
    assert outcome.remaining == pytest.approx(20.0)
    late = acquire_outcome(reply(t="someone-else" * 2), TOKEN, now=now + 60)
    assert late.remaining == 0.0
    assert acquire_outcome(None, TOKEN, now=now) == keymutex._lease.Outcome(False)


def test_renewal_and_holder_replies() -> None:
    assert renew_outcome(None) is None  # the token holds nothing: read the holder
    renewed = renew_outcome(reply(e=NOW + datetime.timedelta(seconds=5)))
    assert renewed is not None
    assert renewed.ok
    assert renewed.remaining == 5.0
    refused = holder_outcome(reply(o="thief"), unix_seconds(NOW))
    assert refused.ok is False
    assert refused.holder is not None
    assert refused.holder.owner == "thief"
    assert holder_outcome(None, 0.0) == keymutex._lease.Outcome(False)


def test_dates_naive_or_aware_are_the_same_instant() -> None:
    aware = NOW.replace(tzinfo=datetime.UTC)
    assert unix_seconds(NOW) == unix_seconds(aware) == aware.timestamp()


@pytest.mark.parametrize("broken", [{"f": None}, {"k": None}, {"a": "yesterday"}, {"i": [1]}])
def test_a_document_that_is_not_a_lease_is_a_store_error(broken: dict[str, Any]) -> None:
    with pytest.raises(keymutex.StoreError, match="is not a keymutex lease"):
        decode_holder(reply(**broken))


# -- waiting -------------------------------------------------------------------------


def test_change_events_that_free_a_key() -> None:
    doc_id = document_id("shop", "k")
    released = {
        "operationType": "update",
        "documentKey": {"_id": doc_id},
        "updateDescription": {"updatedFields": {"e": NOW, "n": NOW}, "removedFields": ["t"]},
    }
    renewed = {
        "operationType": "update",
        "documentKey": {"_id": doc_id},
        "updateDescription": {"updatedFields": {"e": NOW, "n": NOW}, "removedFields": []},
    }
    assert released_id(released) == doc_id
    assert released_id(renewed) is None
    assert released_id({"operationType": "delete", "documentKey": {"_id": doc_id}}) == doc_id
    assert released_id({"operationType": "insert", "documentKey": {"_id": doc_id}}) is None
    assert released_id({"operationType": "delete", "documentKey": {"_id": 7}}) is None
    assert released_id({"operationType": "invalidate"}) is None
    (stage,) = released_pipeline("shop")
    assert stage["$match"]["documentKey._id"] == {"$regex": id_pattern("shop", "")}
    assert stage["$match"]["$or"] == [
        {"operationType": "delete"},
        {"operationType": "update", "updateDescription.removedFields": "t"},
    ]


def test_change_streams_only_where_the_server_has_them() -> None:
    assert notifies({"isWritablePrimary": True, "setName": "rs0"}) is True
    assert notifies({"isWritablePrimary": True, "msg": "isdbgrid"}) is True
    assert notifies({"isWritablePrimary": True}) is False
    assert mongodb.CAPABILITIES.notifies is False  # until hello says otherwise
    assert mongodb.CAPABILITIES.durable_fences is True
    assert mongodb.CAPABILITIES.clock == "server"


class _NoChangeStreams:
    """A collection whose change streams cannot open (disabled, as on some
    MongoDB-compatible services, or a role without the changeStream action)."""

    def watch(self, *args: object, **kwargs: object) -> Any:
        raise OperationFailure("Change Streams are not enabled on this collection")

    async def watch_async(self, *args: object, **kwargs: object) -> Any:
        raise OperationFailure("Change Streams are not enabled on this collection")


def test_a_change_stream_that_cannot_open_does_not_hold_waiters_up() -> None:
    """Every waiter waited for the stream to open (5 s) before its first try, whatever
    its acquire's timeout: acquire(timeout=0.5) took 5 s. Now only the first waits, and
    only until the first attempt to open fails; the others rely on their rechecks."""
    watcher = mongodb._Watcher(_NoChangeStreams(), "")  # type: ignore[arg-type]
    try:
        started = time.monotonic()
        for _ in range(3):
            watcher.join(mongodb._MongoWaiter(watcher, "0:/k"), patience=30)
        assert time.monotonic() - started < 10, "a waiter waited out its patience"
    finally:
        watcher.close()


def test_an_async_change_stream_that_cannot_open_does_not_hold_waiters_up() -> None:
    collection = _NoChangeStreams()
    collection.watch = collection.watch_async  # type: ignore[method-assign]

    async def main() -> float:
        watcher = mongodb._AsyncWatcher(collection, "")  # type: ignore[arg-type]
        started = time.monotonic()
        try:
            for _ in range(3):
                await watcher.join(mongodb._AsyncMongoWaiter(watcher, "0:/k"), patience=30)
            return time.monotonic() - started
        finally:
            await watcher.aclose()

    assert asyncio.run(main()) < 10, "a waiter waited out its patience"


# -- URLs, options, the two shells -------------------------------------------------------


def test_default_timeouts_unless_the_url_sets_them() -> None:
    target = parse("mongodb://db.example:27017/app", {})
    assert target.client_options == {
        "serverSelectionTimeoutMS": 5000,
        "connectTimeoutMS": 5000,
        "socketTimeoutMS": 10000,
        "appname": "keymutex",
    }
    assert target.collection == "keymutex_locks"
    assert target.database is None
    mine = parse("mongodb://h/app?serverselectiontimeoutms=1&socketTimeoutMS=2&appName=x", {})
    assert mine.client_options == {"connectTimeoutMS": 5000}  # option names ignore case
    named = parse("mongodb+srv://cluster.example/app", {"database": "d", "collection": "c"})
    assert (named.database, named.collection) == ("d", "c")


@pytest.mark.parametrize(
    ("url", "options", "error"),
    [
        ("mongodb://h", {"replicaSet": "rs0"}, TypeError),
        ("mongo://h", {}, ValueError),
        ("mongodb://h", {"collection": ""}, ValueError),
        ("mongodb://h", {"collection": "$cmd"}, ValueError),
        ("mongodb://h", {"database": 3}, TypeError),
        ("mongodb://h", {"collection": 5}, TypeError),
        # What pymongo refuses when it opens them (InvalidName came out of Locks()).
        ("mongodb://h", {"database": "a.b"}, ValueError),
        ("mongodb://h", {"database": "a b"}, ValueError),
        ("mongodb://h", {"database": "d" * 64}, ValueError),
        ("mongodb://h", {"collection": "a..b"}, ValueError),
        ("mongodb://h", {"collection": ".x"}, ValueError),
        ("mongodb://h/a.b", {}, ValueError),  # a collection in the URL: not used: database a
        ("mongodb://h:port", {}, ValueError),
    ],
)
def test_bad_urls_and_options(
    url: str, options: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        mongodb.driver.open(url, namespace="n", options=options).close()


def test_the_database_comes_from_the_url_else_keymutex() -> None:
    # Constructing a client sends nothing until a command runs; no server is involved.
    for url, database in [
        ("mongodb://127.0.0.1:9/app", "app"),
        ("mongodb://127.0.0.1:9", "keymutex"),
    ]:
        store = mongodb.driver.open(url, namespace="n", options={})
        try:
            assert store._collection.database.name == database
            assert store._collection.name == "keymutex_locks"
        finally:
            store.close()


@pytest.mark.parametrize(
    ("info", "message"),
    [
        ({"n": 2**64}, "8-byte ints"),
        ({"a\x00b": 1}, "NULL byte"),
        ({"deep": functools.reduce(lambda inner, _: {"x": inner}, range(100), {})}, "nested"),
    ],
)
def test_info_that_bson_cannot_hold_is_refused_before_anything_is_sent(
    info: dict[str, Any], message: str
) -> None:
    # Nothing listens on port 9: a request sent would fail with StoreError instead.
    url = "mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=100"
    with keymutex.Locks(url) as locks, pytest.raises(ValueError, match=message):
        locks.acquire("k", timeout=0, info=info)

    async def main() -> None:
        async with keymutex.AsyncLocks(url) as alocks:
            with pytest.raises(ValueError, match=message):
                await alocks.acquire("k", timeout=0, info=info)

    asyncio.run(main())


def test_sync_and_async_shells_have_the_same_steps() -> None:
    renamed = {"close": "aclose"}
    steps = ["try_acquire", "renew", "renew_many", "release", "holder", "holders", "waiter"]
    for name in [*steps, "close"]:
        sync = inspect.signature(getattr(MongoStore, name))
        other = getattr(AsyncMongoStore, renamed.get(name, name))
        assert inspect.iscoroutinefunction(other), name
        assert [(p.name, p.kind, p.default) for p in sync.parameters.values()] == [
            (p.name, p.kind, p.default) for p in inspect.signature(other).parameters.values()
        ], name


def test_conformance_server_is_usable() -> None:
    """Says plainly when the store has not been run against a server in this session."""
    url = os.environ.get("KEYMUTEX_TEST_MONGODB_URL")
    if not url:
        pytest.skip(
            "KEYMUTEX_TEST_MONGODB_URL is not set: the MongoDB store was not run against a"
            " server (no MongoDB can be installed here); set it to run tests/conformance"
        )
    import pymongo

    with pymongo.MongoClient(url, serverSelectionTimeoutMS=5000) as client:
        version = tuple(int(part) for part in client.server_info()["version"].split(".")[:2])
    assert version >= (4, 2), "the store needs $$NOW in pipeline updates (MongoDB 4.2+)"

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

import bson
import pytest
from bson.int64 import Int64
from pymongo.errors import NotPrimaryError, OperationFailure

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
        "i": '{"name":"Alice"}',
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
    assert fields["i"]["$cond"][1] == {"$literal": '{"$gt":"$e"}'}  # JSON text
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
    # Release keeps the document (its fence is the key's next one), ends the lease now
    # by the server's clock, with update operators: a pipeline update may reach change
    # streams as a "replace" (SERVER-85923), and waiters listen for a removed "t".
    assert mongodb.RELEASE_UPDATE == {"$unset": {"t": ""}, "$currentDate": {"e": True, "n": True}}


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


@pytest.mark.parametrize(
    "broken",
    [{"f": None}, {"k": None}, {"a": "yesterday"}, {"i": [1]}, {"i": "[1]"}, {"i": "{"}],
)
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
    # A release the server logged as a replacement (as it may a pipeline update): the
    # new document has no token. A grant or a renewal logged so has one.
    replaced = {"operationType": "replace", "documentKey": {"_id": doc_id}}
    assert released_id({**replaced, "fullDocument": {"_id": doc_id, "f": 3}}) == doc_id
    assert released_id({**replaced, "fullDocument": {"_id": doc_id, "t": TOKEN}}) is None
    assert released_id(replaced) is None
    (stage,) = released_pipeline("shop")
    assert stage["$match"]["documentKey._id"] == {"$regex": id_pattern("shop", "")}
    assert stage["$match"]["$or"] == [
        {"operationType": "delete"},
        {"operationType": "update", "updateDescription.removedFields": "t"},
        {"operationType": "replace", "fullDocument.t": {"$exists": False}},
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


class _SteppedDown:
    """A collection whose first change stream fails after 0.3 s (a primary stepping
    down); opening the next one takes ``reopen`` seconds (the election)."""

    def __init__(self, reopen: float) -> None:
        self.reopen = reopen
        self.watches = 0

    def watch(self, *args: object, **kwargs: object) -> Any:
        self.watches += 1
        if self.watches > 1:
            time.sleep(self.reopen)
        return _Stream(fails_after=0.3 if self.watches == 1 else None)


class _Stream:
    def __init__(self, fails_after: float | None) -> None:
        self.alive = True
        self._fails_at = None if fails_after is None else time.monotonic() + fails_after

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def try_next(self) -> None:
        time.sleep(0.02)
        if self._fails_at is not None and time.monotonic() > self._fails_at:
            raise NotPrimaryError("primary stepped down")


def test_waiters_do_not_wait_for_a_change_stream_that_is_reopening() -> None:
    """Found by review: after a stream that had opened failed (a primary step-down),
    every new waiter waited up to its patience (5 s) for the reopen, whatever its
    acquire's timeout. Now a waiter that joins while the stream is down is not held
    up, and is rung when the stream is back (a release meanwhile was missed)."""
    collection = _SteppedDown(reopen=3)
    watcher = mongodb._Watcher(collection, "")  # type: ignore[arg-type]
    try:
        watcher.join(mongodb._MongoWaiter(watcher, "0:/a"), patience=30)  # opens it
        deadline = time.monotonic() + 10
        while collection.watches < 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # until it failed and is reopening
        assert collection.watches == 2
        late = mongodb._MongoWaiter(watcher, "0:/b")
        watcher.join(late, patience=30)
        assert not watcher._open.is_set(), "joined only once the stream reopened"
        late.forget()
        assert late.wait(15), "not rung when the stream reopened"
        assert watcher._open.is_set()
    finally:
        watcher.close()


def test_an_async_waiter_does_not_wait_for_a_change_stream_that_is_reopening() -> None:
    class Async(_SteppedDown):
        reopening: asyncio.Event

        async def watch(self, *args: object, **kwargs: object) -> Any:  # type: ignore[override]
            self.watches += 1
            if self.watches > 1:
                self.reopening.set()
                await asyncio.sleep(self.reopen)
            return _AsyncStream(_Stream(fails_after=0.3 if self.watches == 1 else None))

    async def main() -> None:
        collection = Async(reopen=3)
        collection.reopening = asyncio.Event()
        watcher = mongodb._AsyncWatcher(collection, "")  # type: ignore[arg-type]
        try:
            await watcher.join(mongodb._AsyncMongoWaiter(watcher, "0:/a"), patience=30)
            async with asyncio.timeout(10):
                await collection.reopening.wait()  # it failed and is reopening
            late = mongodb._AsyncMongoWaiter(watcher, "0:/b")
            await watcher.join(late, patience=30)
            assert not watcher._open.is_set(), "joined only once the stream reopened"
            late.forget()
            assert await late.wait(15), "not rung when the stream reopened"
            assert watcher._open.is_set()
        finally:
            await watcher.aclose()

    asyncio.run(main())


class _AsyncStream:
    def __init__(self, stream: _Stream) -> None:
        self._stream = stream
        self.alive = True

    async def __aenter__(self) -> _AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def try_next(self) -> None:
        await asyncio.sleep(0.02)
        if self._stream._fails_at is not None and time.monotonic() > self._stream._fails_at:
            raise NotPrimaryError("primary stepped down")


def test_a_server_without_hello_is_asked_with_is_master() -> None:
    """MongoDB 4.4.0 and 4.4.1 have no ``hello`` (pymongo serves them): every step
    failed with StoreError on them."""

    class Admin:
        def __init__(self) -> None:
            self.asked: list[str] = []

        def command(self, name: str) -> dict[str, Any]:
            self.asked.append(name)
            if name == "hello":
                raise OperationFailure("no such command: 'hello'", code=59)
            return {"ismaster": True, "setName": "rs0"}

    class Collection:
        def create_index(self, *args: object, **kwargs: object) -> str:
            return "keymutex_gc"

        def watch(self, *args: object, **kwargs: object) -> Any:
            raise OperationFailure("not in this test")

    def prepared(command: Any) -> MongoStore:
        store = mongodb.driver.open("mongodb://127.0.0.1:9/", namespace="n", options={})
        client = store._client
        try:
            store._client = type("Client", (), {"admin": type("Admin", (), {})()})()  # type: ignore[assignment]
            store._client.admin.command = command  # type: ignore[attr-defined]
            store._collection = Collection()
            store._prepare()
            return store
        finally:
            store._client = client
            store.close()

    admin = Admin()
    assert prepared(admin.command).capabilities.notifies is True  # isMaster says: rs0
    assert admin.asked == ["hello", "isMaster"]
    with pytest.raises(keymutex.StoreError, match="not authorized"):
        prepared(_unauthorized)  # another failure of hello is not retried as isMaster


def _unauthorized(name: str) -> dict[str, Any]:
    raise OperationFailure(f"not authorized to run {name}", code=13)


# -- URLs, options, the two shells -------------------------------------------------------


def test_default_timeouts_unless_the_url_sets_them() -> None:
    target = parse("mongodb://db.example:27017/app", {})
    assert target.client_options == {
        "serverSelectionTimeoutMS": 5000,
        "connectTimeoutMS": 5000,
        "socketTimeoutMS": 10000,
        "appname": "keymutex",
        "w": "majority",  # whatever the server's default: see the next test
    }
    assert target.collection == "keymutex_locks"
    assert target.database is None
    mine = parse("mongodb://h/app?serverselectiontimeoutms=1&socketTimeoutMS=2&appName=x&W=1", {})
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
        ("mongodb://h/" + "d" * 64, {}, ValueError),  # as database="d" * 64
        ("mongodb://h/a%20b", {}, ValueError),
        ("mongodb://h:port", {}, ValueError),
    ],
)
def test_bad_urls_and_options(
    url: str, options: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        mongodb.driver.open(url, namespace="n", options=options).close()


def test_writes_wait_for_a_majority_and_reads_go_to_the_primary() -> None:
    """Found by review: no write concern was set, so the server's default applied (w: 1
    on MongoDB 4.4, with some arbiters, or set so by an admin), and a grant
    acknowledged by the primary alone can be rolled back by a failover: the key is
    then granted again. A readPreference in the URL sent holder reads to secondaries,
    whose copy may be stale. w=0 made every grant look refused (pymongo fakes an empty
    reply): refused before anything is sent."""
    store = mongodb.driver.open(
        "mongodb://127.0.0.1:9/?readPreference=secondaryPreferred", namespace="n", options={}
    )
    try:
        assert store._collection.write_concern.document == {"w": "majority"}
        assert store._collection.read_preference.mongos_mode == "primary"
    finally:
        store.close()
    own = mongodb.driver.open("mongodb://127.0.0.1:9/?w=1", namespace="n", options={})
    try:
        assert own._collection.write_concern.document == {"w": 1}  # the URL's choice
    finally:
        own.close()
    for url in ("mongodb://127.0.0.1:9/?w=0", "mongodb://127.0.0.1:9/?journal=true&W=0"):
        with pytest.raises(ValueError, match=r"w=0 \(unacknowledged writes\) cannot hold locks"):
            keymutex.Locks(url)


def test_a_failed_lookup_of_an_srv_name_is_a_store_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: pymongo looks a mongodb+srv:// name up when the sync client is
    made, and a resolver that timed out came out of Locks() as ValueError ("not a
    usable MongoDB URL"); the async client, which looks later, raised StoreError. A
    service that retries on StoreError at start-up crashed instead."""
    import dns.resolver

    def timed_out(*args: object, **kwargs: object) -> Any:
        raise dns.resolver.LifetimeTimeout(timeout=0.5, errors={})

    monkeypatch.setattr(dns.resolver, "resolve", timed_out)
    with pytest.raises(keymutex.StoreError, match="cannot look up") as caught:
        keymutex.Locks("mongodb+srv://user:s3cret@cluster0.example.com/app")
    assert "s3cret" not in str(caught.value)
    assert isinstance(caught.value.__cause__, mongodb.ConfigurationError)
    # An SRV name with a port is still a bad URL, whatever the resolver.
    with pytest.raises(ValueError, match="not a usable MongoDB URL"):
        keymutex.Locks("mongodb+srv://cluster0.example.com:27017/app")


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
    "info",
    [
        {"n": 2**64},  # beyond BSON's 8-byte ints
        {"a\x00b": 1},  # NUL in a name
        {"$gt": "$e", "a.b": {"$set": 1}},  # names MongoDB takes in some updates only
        {"deep": functools.reduce(lambda inner, _: {"x": inner}, range(30), {})},
        {"é": "ü 日本"},
    ],
)
def test_any_info_every_store_takes_is_kept_as_json_text(info: dict[str, Any]) -> None:
    """Info is JSON text in the document, as in every other store. As a sub-document,
    info that JSON allows and BSON does not (big ints, NUL) was refused by this store
    alone, and names with $ or . depended on the server's version and the operation."""
    info = keymutex._validate.check_info(info) or {}  # what Locks passes on
    fields = acquire_pipeline("k", TOKEN, 30, "me", info, steal=False)[1]["$set"]
    text = fields["i"]["$cond"][1]["$literal"]
    assert isinstance(text, str)
    assert bson.decode(bson.encode({"i": text})) == {"i": text}  # BSON can hold it
    assert decode_holder(reply(i=text)).info == info


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

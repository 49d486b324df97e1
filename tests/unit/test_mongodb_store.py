"""The MongoDB store's pure parts: ids, filters, update pipelines, reply decoding, URLs.

No MongoDB server can be installed where these tests were written, and nothing here
pretends to be one: these tests check the documents the store sends (their structure,
that user values are always literals, and what they do to a lease document by
MongoDB's documented semantics, ``tests/_mongo_semantics.py``) and decode replies shaped
as pymongo returns them. When the store makes its TTL index, and which calls wait for
it, is checked on collections that only count and hold up calls to ``create_index``.
Whether MongoDB evaluates the pipelines as documented is
checked only by the conformance suite, which runs the store against a real server when
``KEYMUTEX_TEST_MONGODB_URL`` is set (``test_conformance_server_is_usable`` below
says when it is not).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import inspect
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import bson
import pytest
from bson.int64 import Int64
from pymongo.errors import (
    AutoReconnect,
    NetworkTimeout,
    NotPrimaryError,
    OperationFailure,
    ServerSelectionTimeoutError,
)

import keymutex
from _fork import fork_running
from _mongo_semantics import matches, run_pipeline, run_update
from keymutex._lease import Outcome
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
        # Every field: the new value when granted, else its own value (a no-op update),
        # but ``n``, moved to now for the token's own lease too (see the semantics below).
        condition, _new, old = expression["$cond"]
        if name == "n":
            assert condition == {"$or": ["$_grant", {"$eq": ["$t", {"$literal": TOKEN}]}]}
        else:
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


def test_steal_grants_whatever_the_current_lease_but_the_tokens_own() -> None:
    pipeline = acquire_pipeline("k", TOKEN, 30, "me", None, steal=True)
    live = {"$and": [{"$gt": ["$e", "$$NOW"]}, {"$ne": [{"$type": "$t"}, "missing"]}]}
    mine = {"$eq": ["$t", {"$literal": TOKEN}]}
    assert pipeline[0] == {"$set": {"_grant": {"$not": [{"$and": [live, mine]}]}}}
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


# -- what the documents do, by MongoDB's documented semantics (tests/_mongo_semantics.py) --

ID = document_id("shop", "k")
T0 = datetime.datetime(2026, 5, 4, 10, 0, 0)  # naive UTC, as pymongo decodes


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def acquired(
    doc: dict[str, Any] | None, token: str, when: float, *, ttl: float = 30, steal: bool = False
) -> tuple[dict[str, Any], keymutex._lease.Outcome]:
    """The key's document after an acquire at ``T0 + when`` (upserted if ``None``), and
    the outcome the store reads from it."""
    before = {"_id": ID} if doc is None else doc  # an upsert starts from the filter's _id
    after = run_pipeline(
        before, acquire_pipeline("k", token, ttl, token[:3], None, steal), at(when)
    )
    return after, acquire_outcome(after, token, unix_seconds(at(when)))


def test_pipelines_grant_refuse_and_answer_the_holder_again_as_mongodb_runs_them() -> None:
    alice, bob = "alice-" + "a" * 18, "bob-" + "b" * 20
    doc, first = acquired(None, alice, 0)
    assert first.ok
    assert first.remaining == 30.0
    assert first.holder is not None
    assert first.holder.fence >= unix_seconds(at(0)) * 1_000_000  # the clock in µs
    # Another token is refused, and nothing changes (a no-op: nothing written).
    refused_doc, refused = acquired(doc, bob, 1)
    assert refused_doc == doc
    assert not refused.ok
    assert refused.holder is not None
    assert refused.holder.owner == "ali"
    assert refused.remaining == pytest.approx(29.0)
    # The same token again, 20 s on (an answer lost, asked again): the lease as it
    # stands, with the 10 s it has left (before the fix: the first grant's 30 s).
    again_doc, again = acquired(doc, alice, 20)
    assert again.ok
    assert again.remaining == pytest.approx(10.0)
    assert again.holder == first.holder
    assert {name for name in doc if doc[name] != again_doc[name]} == {"n"}
    # Even with steal: not granted again (fence and expiry kept).
    _, stolen_by_itself = acquired(again_doc, alice, 21, ttl=5, steal=True)
    assert stolen_by_itself.remaining == pytest.approx(9.0)
    assert stolen_by_itself.holder == first.holder
    # Another token's steal takes it, with a larger fence.
    doc, stolen = acquired(again_doc, bob, 22, steal=True)
    assert stolen.ok
    assert stolen.holder is not None
    assert stolen.holder.fence > first.holder.fence
    assert not matches(doc, renew_filter(ID, alice), at(23))  # alice's token holds nothing


def test_pipelines_renew_release_and_expiry_as_mongodb_runs_them() -> None:
    alice, bob = "alice-" + "a" * 18, "bob-" + "b" * 20
    doc, first = acquired(None, alice, 0, ttl=10)
    assert first.holder is not None
    # A renewal by the token moves the expiry; by another token it matches nothing.
    assert not matches(doc, renew_filter(ID, bob), at(5))
    assert matches(doc, renew_filter(ID, alice), at(5))
    doc = run_pipeline(doc, renew_pipeline(10), at(5))
    renewed = renew_outcome(doc)
    assert renewed is not None
    assert renewed.remaining == 10.0
    assert matches(doc, holder_filter(ID), at(14.9))
    # Past its expiry (by the server's clock) it is nobody's: the filters say so, and
    # another token is granted, with a larger fence.
    assert not matches(doc, holder_filter(ID), at(15))
    assert not matches(doc, renew_filter(ID, alice), at(15))
    doc, taken = acquired(doc, bob, 15)
    assert taken.ok
    assert taken.holder is not None
    assert taken.holder.fence > first.holder.fence
    # Release by the token: the token goes, the document (and its fence) stays.
    assert not matches(doc, release_filter(ID, alice), at(16))
    assert matches(doc, release_filter(ID, bob), at(16))
    doc = run_update(doc, mongodb.RELEASE_UPDATE, at(16))
    assert "t" not in doc
    assert doc["f"] == taken.holder.fence
    assert not matches(doc, holder_filter(ID), at(16))
    assert (
        released_id(
            {
                "operationType": "update",
                "documentKey": {"_id": ID},
                "updateDescription": {"removedFields": ["t"]},
            }
        )
        == ID
    )
    # The next grant, even by a clock that went back a second: a larger fence still.
    doc, next_grant = acquired(doc, alice, 14)
    assert next_grant.ok
    assert next_grant.holder is not None
    assert next_grant.holder.fence == taken.holder.fence + 1


def test_holders_filter_selects_the_live_leases_of_the_prefix_as_mongodb_runs_it() -> None:
    live = run_pipeline(
        {"_id": document_id("shop", "order:1")},
        acquire_pipeline("order:1", TOKEN, 30, "me", None, False),
        at(0),
    )
    other_ns = dict(live, _id=document_id("shop2", "order:1"))
    expired = run_pipeline(
        {"_id": document_id("shop", "order:2")},
        acquire_pipeline("order:2", TOKEN, 1, "me", None, False),
        at(0),
    )
    released = run_update(
        dict(live, _id=document_id("shop", "order:3")), mongodb.RELEASE_UPDATE, at(0)
    )
    query = holders_filter("shop", "order:")
    assert [d["_id"] for d in (live, other_ns, expired, released) if matches(d, query, at(2))] == [
        live["_id"]
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


def test_a_refusal_counts_the_time_left_by_the_servers_clock_as_this_host_knows_it() -> None:
    """Found by review: by this host's own clock, one running 31 s ahead of the
    primary's saw every lease of a 30 s TTL as expired (time left 0), and its waiters
    looked again every 2 ms. The store learns the server's clock from ``hello`` and
    from every grant or renewal (``n`` is the server's ``$$NOW``)."""
    clock = mongodb.ServerClock()
    assert clock.now() == pytest.approx(time.time(), abs=1)
    # A grant whose reply says the server's now is 31 s behind this host's.
    sent = time.time()
    server_now = datetime.datetime.fromtimestamp(sent - 31, datetime.UTC).replace(tzinfo=None)
    granted = reply(n=server_now, a=server_now, e=server_now + datetime.timedelta(seconds=30))
    outcome = clock.learn_from(renew_outcome(granted) or Outcome(False), granted, sent)
    assert outcome.ok
    assert clock.now() == pytest.approx(sent - 31, abs=0.5)
    held = reply(t="someone-else" * 2, a=server_now, e=server_now + datetime.timedelta(seconds=30))
    assert holder_outcome(held, time.time()).remaining == 0.0  # by this host's clock
    assert holder_outcome(held, clock.now()).remaining == pytest.approx(30, abs=0.5)
    # A refusal says nothing of the server's now: nothing learnt from it.
    clock.learn_from(Outcome(False), held, time.time())
    assert clock.now() == pytest.approx(sent - 31, abs=0.5)
    # hello's localTime.
    clock.learn_from_hello({"localTime": server_now + datetime.timedelta(hours=1)}, sent, sent)
    assert clock.now() == pytest.approx(sent - 31 + 3600, abs=0.5)
    clock.learn_from_hello({}, sent, sent)  # none: as before
    assert clock.now() == pytest.approx(sent - 31 + 3600, abs=0.5)


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


def test_a_change_stream_that_never_opens_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """Found by review: one that can never open (a role without the changeStream
    action) warned every 2 s for ever, per namespace. Once, then DEBUG until it opens."""
    caplog.set_level(logging.DEBUG, logger="keymutex")
    watcher = mongodb._Watcher(_NoChangeStreams(), "")  # type: ignore[arg-type]
    try:
        watcher.join(mongodb._MongoWaiter(watcher, "0:/k"), patience=30)
        deadline = time.monotonic() + 10
        while len(caplog.records) < 3:
            assert time.monotonic() < deadline, "the stream was not tried three times"
            time.sleep(0.05)
    finally:
        watcher.close()
    levels = [r.levelno for r in caplog.records if "change stream failed" in r.getMessage()]
    assert levels[0] == logging.WARNING
    assert set(levels[1:]) == {logging.DEBUG}


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

        def command(self, name: str, **options: object) -> dict[str, Any]:
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


class _IndexedCollection:
    """A collection whose ``create_index`` fails as told, then succeeds."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.made = 0

    def create_index(self, *args: object, **kwargs: object) -> str:
        self.made += 1
        if self.failures:
            raise self.failures.pop(0)
        return "keymutex_gc"


def _standalone(name: str, **options: object) -> dict[str, Any]:
    return {"isWritablePrimary": True}


# A client that starts no monitor threads until used: a fork without Python's hooks
# (which then do not reset the GIL) is safe only while no other thread is running.
_UNUSED_URL = "mongodb://127.0.0.1:9/?connect=false"


def _prepared_on(
    collection: object, hello: Callable[..., dict[str, Any]] = _standalone
) -> MongoStore:
    """A store whose first step was taken on a server that answers ``hello`` so (a
    standalone server), with ``collection`` for its documents (its client is not used
    after that first step)."""
    store = mongodb.driver.open(_UNUSED_URL, namespace="n", options={})
    client = store._client
    try:
        store._client = type("Client", (), {"admin": type("Admin", (), {})()})()  # type: ignore[assignment]
        store._client.admin.command = hello  # type: ignore[attr-defined]
        store._collection = collection
        store._prepare()
    except BaseException:
        store._client = client
        store.close()
        raise
    store._client = client
    return store


def _index_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "keymutex-mongodb-index"]


def _made_again(store: MongoStore) -> None:
    """Wait for the making of the index that a step started, if any."""
    if store._index_thread is not None:
        store._index_thread.join(10)


@pytest.mark.parametrize(
    ("failure", "made_again"),
    [
        (OperationFailure("operation exceeded time limit", code=50), True),
        # A mongos that cannot reach a shard (code 6): made again within seconds, below.
        (OperationFailure("waiting for replication timed out", code=64), True),
        (OperationFailure("not authorized on keymutex", code=13), False),
        (OperationFailure("index keymutex_gc exists with other options", code=85), False),
    ],
)
def test_the_ttl_index_is_made_again_unless_trying_again_cannot_mend_it(
    failure: Exception,
    made_again: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by review: a failure to make the TTL index was logged once and never tried
    again, even one that passes (a time limit, an election), and a collection dropped
    under a running store lost its index for good: documents were never collected.
    The first making fails in the first step, the second in its thread (neither fails
    a step); the third is made."""
    collection = _IndexedCollection(failure, failure)
    with caplog.at_level(logging.WARNING, logger="keymutex"):
        store = _prepared_on(collection)
    try:
        assert collection.made == 1
        assert "cannot create the TTL index" in caplog.text
        store._prepare()
        assert collection.made == 1, "not again before INDEX_RECHECK"
        later = time.monotonic() + mongodb.INDEX_RECHECK
        monkeypatch.setattr(mongodb._clock, "monotonic", lambda: later)
        with caplog.at_level(logging.WARNING, logger="keymutex"):
            store._prepare()
            _made_again(store)
        store._prepare()
        _made_again(store)
        assert collection.made == (2 if made_again else 1), "once again when due"
        warned = [r for r in caplog.records if "cannot create the TTL index" in r.getMessage()]
        assert len(warned) == (2 if made_again else 1)
        later += mongodb.INDEX_RECHECK  # made: made again later (a dropped collection)
        store._prepare()
        _made_again(store)
        assert collection.made == (3 if made_again else 1)
    finally:
        store.close()


@pytest.mark.asyncio
async def test_the_async_store_makes_the_ttl_index_again_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = mongodb.driver.open_async("mongodb://127.0.0.1:9/", namespace="n", options={})
    client = store._client

    async def standalone(name: str, **options: object) -> dict[str, Any]:
        return _standalone(name)

    class Collection(_IndexedCollection):
        async def create_index(self, *args: object, **kwargs: object) -> str:  # type: ignore[override]
            return super().create_index(*args, **kwargs)

    try:
        store._client = type("Client", (), {"admin": type("Admin", (), {})()})()  # type: ignore[assignment]
        store._client.admin.command = standalone  # type: ignore[attr-defined]
        collection = Collection(OperationFailure("operation exceeded time limit", code=50))
        store._collection = collection
        await store._prepare()
        await store._prepare()
        assert collection.made == 1, "not again before INDEX_RECHECK"
        later = time.monotonic() + mongodb.INDEX_RECHECK
        monkeypatch.setattr(mongodb._clock, "monotonic", lambda: later)
        await store._prepare()
        assert store._index_task is not None
        await store._index_task
        assert collection.made == 2
    finally:
        store._client = client
        await store.aclose()


class _SlowIndex:
    """A collection whose ``create_index`` after the first is answered only once
    ``release`` is set: a createIndexes that a sharded cluster, a large collection or a
    busy primary is slow to answer. At most 5 s, so that a store that waits for it in
    a step is slow, not hung, and its test fails rather than times out."""

    def __init__(self) -> None:
        self.made = 0
        self.ended = 0
        self.callers: list[threading.Thread] = []
        self.release = threading.Event()

    def create_index(self, *args: object, **kwargs: object) -> str:
        self.made += 1
        self.callers.append(threading.current_thread())
        if self.made > 1:
            self.release.wait(5)
        self.ended += 1
        return "keymutex_gc"


def test_the_ttl_index_is_made_again_off_the_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: the index made again every ``INDEX_RECHECK`` was made inside the
    first step after it fell due: a createIndexes round trip every 10 minutes in a
    user's acquire or the renewer's call, which a slow answer delayed or failed. Now
    the step starts it in a thread and goes on; one at a time."""
    collection = _SlowIndex()
    store = _prepared_on(collection)
    try:
        assert collection.ended == 1, "the first step did not wait for the first making"
        later = time.monotonic() + mongodb.INDEX_RECHECK
        monkeypatch.setattr(mongodb._clock, "monotonic", lambda: later)
        store._prepare()
        assert collection.ended == 1, "the step waited for the index to be made"
        for _ in range(3):  # due again while the first is under way: not started again
            later += mongodb.INDEX_RECHECK
            store._prepare()
        (thread,) = _index_threads()
        collection.release.set()
        thread.join(10)
        assert collection.made == collection.ended == 2
        assert collection.callers[1] is thread
        store._prepare()  # due, and none under way
        _made_again(store)
        assert collection.made == 3
    finally:
        collection.release.set()
        store.close()
    assert not _index_threads()


def test_close_waits_for_the_ttl_index_under_way_and_leaves_no_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    collection = _SlowIndex()
    store = _prepared_on(collection)
    try:
        later = time.monotonic() + mongodb.INDEX_RECHECK
        monkeypatch.setattr(mongodb._clock, "monotonic", lambda: later)
        store._prepare()
        assert _index_threads(), "no thread makes the index"
        monkeypatch.setattr(mongodb, "INDEX_CLOSE_PATIENCE", 30.0)  # a loaded machine
        answer = threading.Timer(0.2, collection.release.set)
        answer.start()
        store.close()
        answer.join()
        assert collection.ended == 2, "close() did not wait for it"
        assert not _index_threads(), "a thread left behind after close()"
        later += mongodb.INDEX_RECHECK
        store._prepare()  # a closed store starts none
        assert collection.made == 2
        assert not _index_threads()
    finally:
        collection.release.set()
        store.close()


def test_the_ttl_index_is_made_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan the two stores follow: due every ``INDEX_RECHECK``, never while one is
    under way (a createIndexes slower than that: a socket without a timeout), and never
    again after a failure that trying again will not mend."""
    now = time.monotonic()
    monkeypatch.setattr(mongodb._clock, "monotonic", lambda: now)
    plan = mongodb._IndexPlan()
    assert plan.take()  # at the first step
    now += 2 * mongodb.INDEX_RECHECK
    assert not plan.take(), "made again while it is under way"
    plan.made()
    assert plan.take()  # due long since, and none under way
    assert not plan.take()
    plan.failed(OperationFailure("operation exceeded time limit", code=50))
    assert not plan.take(), "not again before INDEX_RECHECK"
    now += mongodb.INDEX_RECHECK
    assert plan.take()
    plan.failed(OperationFailure("not authorized on keymutex", code=13))
    now += 10 * mongodb.INDEX_RECHECK
    assert not plan.take(), "made again after a failure that cannot pass"


# Failures to reach the server (or its primary), as pymongo raises them.
_UNREACHABLE = [
    ServerSelectionTimeoutError("127.0.0.1:27017: [Errno 111] Connection refused"),
    AutoReconnect("127.0.0.1:27017: connection closed"),
    NetworkTimeout("127.0.0.1:27017: timed out (socketTimeoutMS: 10000.0ms)"),
    NotPrimaryError("not primary"),
    OperationFailure("a mongos could not reach the shard", code=6),
]


@pytest.mark.parametrize("failure", _UNREACHABLE, ids=lambda exc: type(exc).__name__)
def test_the_ttl_index_is_made_again_within_seconds_after_the_server_could_not_be_reached(
    failure: Exception, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: a making that failed because the server could not be reached
    (restarting, an election, a network blip) was tried again only ``INDEX_RECHECK``
    (ten minutes) later, and meanwhile the documents of ended leases were not collected.
    Now it is due ``INDEX_RETRY_FIRST`` seconds after such a failure, doubled at each
    one in a row up to ``INDEX_RECHECK``; once made, every ``INDEX_RECHECK`` again. A
    warning at the first failure in a row and at the long interval, not at each try."""
    now = mongodb._clock.monotonic()
    monkeypatch.setattr(mongodb._clock, "monotonic", lambda: now)
    plan = mongodb._IndexPlan()
    assert plan.take()
    with caplog.at_level(logging.WARNING, logger="keymutex"):
        for wait in [5, 10, 20, 40, 80, 160, 320, 600, 600]:  # failures in a row
            plan.failed(failure)
            failed_at = now
            now = failed_at + wait - 1
            assert not plan.take(), f"made again sooner than {wait} s after a failure"
            now = failed_at + wait
            assert plan.take(), f"not made again {wait} s after a failure"
    assert [r.getMessage() for r in caplog.records] == [
        f"MongoDB: cannot create the TTL index on 'e' (tried again in {wait} s): {failure}"
        for wait in (5, 600, 600)
    ]
    plan.made()  # made: the backoff starts again, and it is due every INDEX_RECHECK
    now += mongodb.INDEX_RECHECK - 1
    assert not plan.take()
    now += 1
    assert plan.take()
    plan.failed(failure)
    now += 5  # INDEX_RETRY_FIRST
    assert plan.take(), "the backoff did not start again after the index was made"
    plan.failed(failure)  # the next in a row: 10 s
    now += 10
    assert plan.take()
    # A failure of another kind ends the run (found by review: the next failure to reach
    # the server went on doubling, and was logged at DEBUG only).
    plan.failed(OperationFailure("waiting for replication timed out", code=64))
    now += mongodb.INDEX_RECHECK
    assert plan.take()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="keymutex"):
        plan.failed(failure)
    now += 5
    assert plan.take(), "the backoff did not start again after a failure of another kind"
    assert len(caplog.records) == 1


@pytest.mark.parametrize(
    "failure",
    [
        OperationFailure("not authorized on keymutex", code=13),
        OperationFailure("operation exceeded time limit", code=50),
        RuntimeError("can't create new thread at interpreter shutdown"),
    ],
    ids=["unauthorized", "time-limit", "no-thread"],
)
def test_other_failures_to_make_the_ttl_index_keep_the_long_interval(
    failure: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No privilege is never mended by trying again (never made again, as before); a
    time limit exceeded is a build slower than the client waits, which a making again
    soon would only wait for again: ``INDEX_RECHECK``, as before."""
    now = mongodb._clock.monotonic()
    monkeypatch.setattr(mongodb._clock, "monotonic", lambda: now)
    plan = mongodb._IndexPlan()
    assert plan.take()
    plan.failed(failure)
    now += mongodb.INDEX_RECHECK - 1
    assert not plan.take(), "made again sooner than INDEX_RECHECK"
    now += 1
    final = isinstance(failure, OperationFailure) and failure.code == 13
    assert plan.take() is not final


def test_a_first_making_that_could_not_reach_the_server_is_made_again_within_seconds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The sync store: its first step, whose making of the index found no server,
    does not fail; a step ``INDEX_RETRY_FIRST`` seconds later makes it again."""
    collection = _IndexedCollection(ServerSelectionTimeoutError("connection refused"))
    with caplog.at_level(logging.WARNING, logger="keymutex"):
        store = _prepared_on(collection)
    try:
        assert collection.made == 1
        later = mongodb._clock.monotonic() + 5  # INDEX_RETRY_FIRST
        monkeypatch.setattr(mongodb._clock, "monotonic", lambda: later)
        store._prepare()
        _made_again(store)
        assert collection.made == 2, "not made again 5 s later"
        assert "cannot create the TTL index on 'e' (tried again in 5 s)" in caplog.text
        store._prepare()
        _made_again(store)
        assert collection.made == 2, "made again before INDEX_RECHECK once made"
    finally:
        store.close()


@pytest.mark.asyncio
async def test_an_async_first_making_that_could_not_reach_the_server_is_made_again_within_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Collection(_IndexedCollection):
        async def create_index(self, *args: object, **kwargs: object) -> str:  # type: ignore[override]
            return super().create_index(*args, **kwargs)

    store = mongodb.driver.open_async("mongodb://127.0.0.1:9/", namespace="n", options={})
    client = store._client
    collection = Collection(AutoReconnect("127.0.0.1:27017: connection closed"))
    try:
        store._client = type("Client", (), {"admin": type("Admin", (), {})()})()  # type: ignore[assignment]
        store._client.admin.command = _standalone_async  # type: ignore[attr-defined]
        store._collection = collection
        await store._prepare()
        assert collection.made == 1
        later = mongodb._clock.monotonic() + 5  # INDEX_RETRY_FIRST
        monkeypatch.setattr(mongodb._clock, "monotonic", lambda: later)
        await store._prepare()
        assert store._index_task is not None
        await asyncio.wait_for(store._index_task, 10)
        assert collection.made == 2, "not made again 5 s later"
    finally:
        store._client = client
        await store.aclose()


@pytest.mark.asyncio
async def test_the_async_store_makes_the_ttl_index_again_in_a_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the sync store: the step starts it (a task of the store's loop) and goes on;
    ``aclose()`` cancels one under way and leaves no task behind."""

    class Collection:
        def __init__(self) -> None:
            self.made = 0
            self.ended = 0
            self.cancelled = 0
            self.release = asyncio.Event()

        async def create_index(self, *args: object, **kwargs: object) -> str:
            self.made += 1
            if self.made > 1:
                try:
                    async with asyncio.timeout(5):  # as _SlowIndex
                        await self.release.wait()
                except TimeoutError:
                    pass
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
            self.ended += 1
            return "keymutex_gc"

    async def standalone(name: str, **options: object) -> dict[str, Any]:
        return _standalone(name)

    store = mongodb.driver.open_async("mongodb://127.0.0.1:9/", namespace="n", options={})
    client = store._client
    collection = Collection()
    try:
        store._client = type("Client", (), {"admin": type("Admin", (), {})()})()  # type: ignore[assignment]
        store._client.admin.command = standalone  # type: ignore[attr-defined]
        store._collection = collection
        await store._prepare()
        store._client = client
        later = time.monotonic() + mongodb.INDEX_RECHECK
        monkeypatch.setattr(mongodb._clock, "monotonic", lambda: later)
        await store._prepare()
        await asyncio.sleep(0)  # it starts
        assert collection.made == 2
        assert collection.ended == 1, "the step waited for the index to be made"
        later += mongodb.INDEX_RECHECK
        await store._prepare()
        await asyncio.sleep(0)
        assert collection.made == 2, "made again while it is under way"
    finally:
        store._client = client
        await store.aclose()
    assert collection.cancelled == 1, "aclose() did not stop it"
    assert asyncio.all_tasks() == {asyncio.current_task()}, "a task left behind"


def _unauthorized(name: str, **options: object) -> dict[str, Any]:
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
    for url in (
        "mongodb://127.0.0.1:9/?w=0",
        "mongodb://127.0.0.1:9/?journal=true&W=0",
        # As pymongo reads them, w=0 too (found by review: they got through).
        "mongodb://127.0.0.1:9/?w=00",
        "mongodb://127.0.0.1:9/?w=-0",
    ):
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


def test_a_query_split_by_semicolons_is_read_as_pymongo_reads_it() -> None:
    """Found by review: the query was split by '&' alone, so "?appname=a;w=1;…" named
    only appname, and the store's defaults then overrode the URL's w and timeouts."""
    url = "mongodb://h/app?appname=billing;w=1;serverSelectionTimeoutMS=30000;socketTimeoutMS=0"
    assert parse(url, {}).client_options == {"connectTimeoutMS": 5000}
    store = mongodb.driver.open(url.replace("h/", "127.0.0.1:9/"), namespace="n", options={})
    try:
        assert store._collection.write_concern.document == {"w": 1}  # the URL's choice
    finally:
        store.close()
    with pytest.raises(ValueError, match="unknown option 'nosuchoption'"):
        parse("mongodb://h/app?w=1;nosuchoption=2", {})
    with pytest.raises(ValueError, match=r"w=0 \(unacknowledged writes\)"):
        parse("mongodb://h/app?appname=a;w=0", {})


@pytest.mark.parametrize("query", ["datetime_conversion=datetime_ms", "server_api=1"])
def test_an_option_value_pymongo_refuses_is_a_bad_url(query: str) -> None:
    """Found by review: these came out of Locks() as pymongo's raw KeyError and
    TypeError."""
    with pytest.raises(ValueError, match="not a usable MongoDB URL"):
        keymutex.Locks(f"mongodb://127.0.0.1:9/?{query}")


@pytest.mark.parametrize(
    "query",
    ["datetime_conversion=DATETIME_MS", "tz_aware=false", "datetime_conversion=DATETIME_AUTO"],
)
def test_replies_decode_the_same_whatever_the_url_says_of_dates(query: str) -> None:
    """Found by review: with ?datetime_conversion=DATETIME_MS pymongo decoded dates as
    DatetimeMS, and every grant, ours too, read as "not a keymutex lease"."""
    acquired = datetime.datetime(2026, 11, 29, 6, 0, tzinfo=datetime.UTC)
    stored = bson.encode(
        {
            "_id": "n/k",
            "k": "k",
            "t": "token",
            "o": "host:1",
            "f": 7,
            "a": acquired,
            "e": acquired + datetime.timedelta(seconds=30),
        }
    )
    store = mongodb.driver.open(f"mongodb://127.0.0.1:9/?{query}", namespace="n", options={})
    try:
        doc = bson.decode(stored, codec_options=store._collection.codec_options)
    finally:
        store.close()
    holder = mongodb.decode_holder(doc)
    assert holder.acquired_at == acquired.timestamp()
    assert holder.expires_at == acquired.timestamp() + 30


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


class _HangsFirst:
    """A collection whose first ``create_index`` answers only once ``release`` is set."""

    def __init__(self) -> None:
        self.made = 0
        self.ended = 0
        self.release = asyncio.Event()

    async def create_index(self, *args: object, **kwargs: object) -> str:
        self.made += 1
        if self.made == 1:
            await self.release.wait()
        self.ended += 1
        return "keymutex_gc"


async def _standalone_async(name: str, **options: object) -> dict[str, Any]:
    return _standalone(name)


@pytest.mark.asyncio
async def test_a_first_step_cancelled_while_it_makes_the_index_does_not_stop_its_making(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: the first step, cancelled while it made the TTL index (an
    ``asyncio.timeout`` around a user's first acquire), left the plan "under way" for
    good: that store never made the index again, however long it was used. The making
    is a task of its own now, which the step's cancellation leaves to end."""
    store = mongodb.driver.open_async("mongodb://127.0.0.1:9/", namespace="n", options={})
    client = store._client
    collection = _HangsFirst()
    try:
        store._client = type("Client", (), {"admin": type("Admin", (), {})()})()  # type: ignore[assignment]
        store._client.admin.command = _standalone_async  # type: ignore[attr-defined]
        store._collection = collection
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await store._prepare()
        await store._prepare()  # the next step
        collection.release.set()
        making = store._index_task
        assert making is not None, "the first making was stopped with its step"
        await asyncio.wait_for(making, 10)
        assert collection.made == collection.ended == 1
        later = time.monotonic()
        monkeypatch.setattr(mongodb._clock, "monotonic", lambda: later)
        later += mongodb.INDEX_RECHECK
        await store._prepare()
        assert store._index_task is not None, "not made again when due"
        await store._index_task
        assert collection.ended == 2
    finally:
        store._client = client
        await store.aclose()


class _InterruptedFirst(_IndexedCollection):
    """A collection whose first ``create_index`` is under way when the user presses
    Ctrl-C (SIGINT to the main thread) as the first step waits for it, and answers once
    ``answer`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = False
        self.answer = threading.Event()
        self.step_waits = lambda: True

    def create_index(self, *args: object, **kwargs: object) -> str:
        if not self.interrupted:  # once: the next ones answer at once
            self.interrupted = True
            deadline = time.monotonic() + 10
            while not self.step_waits() and time.monotonic() < deadline:
                time.sleep(0.01)
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            self.answer.wait(10)
        return super().create_index(*args, **kwargs)


def test_a_first_step_interrupted_while_it_makes_the_index_does_not_stop_its_making(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, for the sync store: a Ctrl-C during the first step's wait for it."""
    store = mongodb.driver.open("mongodb://127.0.0.1:9/", namespace="n", options={})
    client = store._client
    collection = _InterruptedFirst()
    collection.step_waits = lambda: store._prepared
    # Ctrl-C raises KeyboardInterrupt even where the test runner was started with SIGINT
    # ignored (a shell's background job).
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        store._client = type("Client", (), {"admin": type("Admin", (), {})()})()  # type: ignore[assignment]
        store._client.admin.command = _standalone  # type: ignore[attr-defined]
        store._collection = collection
        with pytest.raises(KeyboardInterrupt):
            store._prepare()
        store._prepare()  # the next step
        collection.answer.set()
        # Not by joining its thread: Python 3.11 takes a thread whose join was
        # interrupted for one that has ended (bpo-45274).
        deadline = time.monotonic() + 10
        while collection.made == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert collection.made == 1, "the first making was stopped with its step"
        while store._index._making and time.monotonic() < deadline:
            time.sleep(0.01)
        later = time.monotonic()
        monkeypatch.setattr(mongodb._clock, "monotonic", lambda: later)
        later += mongodb.INDEX_RECHECK
        store._prepare()
        _made_again(store)
        assert collection.made == 2, "not made again when due"
    finally:
        signal.signal(signal.SIGINT, handler)
        collection.answer.set()
        store._client = client
        store.close()


class _StalledBuild:
    """A collection whose first ``create_index`` is a build that stalls (a voting
    member down while the index is built on a collection that has documents): it
    fails with pymongo's ``NetworkTimeout`` at the socket's timeout, here when
    ``release`` is set (or after 10 s). Those after it are no-ops."""

    def __init__(self) -> None:
        self.made = 0
        self.ended = 0
        self.release = threading.Event()

    def create_index(self, *args: object, **kwargs: object) -> str:
        self.made += 1
        if self.made == 1:
            self.release.wait(10)
            raise NetworkTimeout("127.0.0.1:27017: timed out (socketTimeoutMS: 10000.0ms)")
        self.ended += 1
        return "keymutex_gc"


def test_a_first_making_that_stalls_neither_holds_up_nor_fails_the_first_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: the first step waited for the first making of the index
    however long it took, and failed with StoreError when it timed out; the next step
    tried again. While a build stalled, every step of every new store (each worker of
    a web app that starts) waited 10 s and failed. The first step now waits
    ``INDEX_FIRST_PATIENCE`` seconds at most, and a failure is a warning."""
    monkeypatch.setattr(mongodb, "INDEX_FIRST_PATIENCE", 0.2)
    collection = _StalledBuild()
    with caplog.at_level(logging.WARNING, logger="keymutex"):
        store = _prepared_on(collection)  # the first step: no StoreError
        try:
            assert collection.made == 1
            assert collection.ended == 0, "the step waited for the stalled build to end"
            collection.release.set()
            _made_again(store)
            assert "cannot create the TTL index" in caplog.text
            later = time.monotonic() + mongodb.INDEX_RECHECK
            monkeypatch.setattr(mongodb._clock, "monotonic", lambda: later)
            store._prepare()
            _made_again(store)
            assert collection.ended == 1, "not made again when due"
        finally:
            collection.release.set()
            store.close()


@pytest.mark.asyncio
async def test_the_async_first_making_that_stalls_neither_holds_up_nor_fails_the_first_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Collection(_StalledBuild):
        async def create_index(self, *args: object, **kwargs: object) -> str:  # type: ignore[override]
            if self.made == 0:
                self.made += 1
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(10):
                        await released.wait()
                raise NetworkTimeout("127.0.0.1:27017: timed out (socketTimeoutMS: 10000.0ms)")
            return super().create_index(*args, **kwargs)

    monkeypatch.setattr(mongodb, "INDEX_FIRST_PATIENCE", 0.2)
    released = asyncio.Event()
    collection = Collection()
    store = mongodb.driver.open_async("mongodb://127.0.0.1:9/", namespace="n", options={})
    client = store._client
    try:
        store._client = type("Client", (), {"admin": type("Admin", (), {})()})()  # type: ignore[assignment]
        store._client.admin.command = _standalone_async  # type: ignore[attr-defined]
        store._collection = collection
        with caplog.at_level(logging.WARNING, logger="keymutex"):
            await store._prepare()  # the first step: no StoreError
            assert collection.made == 1
            assert collection.ended == 0, "the step waited for the stalled build to end"
            released.set()
            assert store._index_task is not None
            await asyncio.wait_for(store._index_task, 10)
        assert "cannot create the TTL index" in caplog.text
    finally:
        store._client = client
        await store.aclose()


# -- a forked child (the sync store: an async store belongs to its parent's loop) --------


def _in_a_child(child: Callable[[], int], *, hooks: bool) -> int:
    """Run ``child`` in a forked child and return its exit code, or minus the signal that
    killed it (SIGALRM: it hung for 10 s)."""
    pid = fork_running(child, hooks=hooks)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _replica_set(name: str, **options: object) -> dict[str, Any]:
    return {"isWritablePrimary": True, "setName": "rs0"}


class _ForkedWorkers(_SlowIndex):
    """A replica set's collection: its second ``create_index`` (the parent's making
    again) is slow, as ``_SlowIndex``; its change stream reports the deletion of key
    ``k``'s document once ``deleted`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.deleted = threading.Event()

    def create_index(self, *args: object, **kwargs: object) -> str:
        if self.made != 1:  # only the parent's second making is slow
            self.made += 1
            self.ended += 1
            return "keymutex_gc"
        return super().create_index(*args, **kwargs)

    def watch(self, *args: object, **kwargs: object) -> Any:
        return _Deletions(self.deleted)


class _Deletions:
    def __init__(self, deleted: threading.Event) -> None:
        self.alive = True
        self._deleted = deleted
        self._told = False

    def __enter__(self) -> _Deletions:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def try_next(self) -> dict[str, Any] | None:
        if self._told or not self._deleted.wait(mongodb.WATCH_AWAIT_MS / 1000):
            return None
        self._told = True
        return {"operationType": "delete", "documentKey": {"_id": document_id("n", "k")}}


NOT_MADE, NOT_RUNG = 1, 2


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
@pytest.mark.parametrize("hooks", [True, False], ids=["os.fork", "fork-without-hooks"])
def test_a_forked_child_makes_the_index_and_reads_the_change_stream_on_its_own(
    hooks: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a child forked while its parent's store made the index again
    (a gunicorn or uWSGI worker) took that making for its own, under way for ever: the
    child never made the index. Nor did it read the change stream (the parent's
    reader thread did not come along): its waiters were never rung by a release."""
    collection = _ForkedWorkers()
    store = _prepared_on(collection, hello=_replica_set)
    now = [time.monotonic()]
    monkeypatch.setattr(mongodb._clock, "monotonic", lambda: now[0])
    try:
        store.waiter("k").close()  # the parent reads its change stream
        now[0] += mongodb.INDEX_RECHECK
        store._prepare()  # the parent makes the index again: under way at the fork
        assert collection.made == 2
        assert collection.ended == 1, "the parent's making is not under way"

        def child() -> int:
            failed = 0
            made = collection.made
            now[0] += mongodb.INDEX_RECHECK
            mongodb._clock.monotonic = lambda: now[0]  # picked again at the fork
            store._prepare()
            _made_again(store)
            if collection.made != made + 1:
                failed |= NOT_MADE
            # An event of the child's: the parent's reader may have held its lock at the fork.
            collection.deleted = threading.Event()
            waiter = store.waiter("k")
            collection.deleted.set()
            if not waiter.wait(5):
                failed |= NOT_RUNG
            return failed

        code = _in_a_child(child, hooks=hooks)
        assert code == 0, {
            NOT_MADE: "the child did not make the index when due",
            NOT_RUNG: "the child's waiter was not rung by the change stream",
            NOT_MADE | NOT_RUNG: "the child neither made the index nor read the stream",
        }.get(code, f"the child failed: exit code {code}")
    finally:
        collection.release.set()
        store.close()


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
@pytest.mark.parametrize("hooks", [True, False], ids=["os.fork", "fork-without-hooks"])
def test_a_child_forked_during_its_parents_first_step_takes_its_own(hooks: bool) -> None:
    """Found by review: a child forked while a thread of its parent took the store's
    first step (the server slow to answer ``hello``) hung at its own first step, on the
    copy of a mutex that thread held at the fork."""
    answered = threading.Event()

    def slow_hello(name: str, **options: object) -> dict[str, Any]:
        answered.wait(10)
        return _standalone(name)

    store = mongodb.driver.open(_UNUSED_URL, namespace="n", options={})
    client = store._client
    collection = _IndexedCollection()
    store._client = type("Client", (), {"admin": type("Admin", (), {})()})()  # type: ignore[assignment]
    store._client.admin.command = slow_hello  # type: ignore[attr-defined]
    store._collection = collection
    first = threading.Thread(target=store._prepare)
    first.start()
    try:
        deadline = time.monotonic() + 10
        while not store._prepare_mutex.locked():
            assert time.monotonic() < deadline, "the parent's first step never started"
            time.sleep(0.01)

        def child() -> int:
            # The child's own hello, answered at once (not by setting ``answered``: the
            # parent's thread may have held that event's lock at the fork).
            store._client.admin.command = _standalone  # type: ignore[attr-defined]
            store._prepare()
            _made_again(store)
            return 0 if collection.made == 1 else NOT_MADE

        assert _in_a_child(child, hooks=hooks) == 0, "the child's first step failed or hung"
    finally:
        answered.set()
        first.join(10)
        store._client = client
        store.close()

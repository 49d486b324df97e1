"""What the memcached store promises beyond the conformance suite, and what it does not.

Against real memcached processes: the session's ``memcached_server``, or servers a test
starts for itself when it restarts, fills or kills one. Races are made deterministic
by letting another client write right after one of the store's own reads (``interleave``
wraps ``Session.read``), before the store's compare-and-swap — the server itself is
never imitated. Round trips are counted as the writes the store sends on its sockets.
"""

from __future__ import annotations

import collections
import itertools
import json
import multiprocessing
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pymemcache.client.base import Client

import keymutex
from _memcached_fixtures import MemcachedServer
from keymutex.stores import memcached
from keymutex.stores.memcached import (
    EPOCH_ITEM,
    HANDOVER_SECONDS,
    INDEX_BUCKETS,
    POLL_CEILING,
    POLL_FIRST,
    POLL_LIMIT,
    QUEUE_LIMIT,
    RACE_ATTEMPTS,
    REFRESH_SECONDS,
    TOMBSTONE_SECONDS,
    Connection,
    Layout,
    MemcachedStore,
    Place,
    QueuedWaiter,
    Record,
    Session,
    Tombstone,
    decode,
    exptime,
    handed_over,
    kept_for,
    parse,
    rejoined,
)

TOKEN_A = "A" * 24
TOKEN_B = "B" * 24


@pytest.fixture
def namespace() -> str:
    return f"unit-{uuid.uuid4().hex}"


@pytest.fixture
def raw(memcached_server: MemcachedServer) -> Iterator[Client]:
    """A plain pymemcache client on the session's server, to look at items directly."""
    client = Client(("127.0.0.1", memcached_server.port), default_noreply=False)
    yield client
    client.close()


def open_store(url: str, namespace: str, **options: object) -> MemcachedStore:
    return memcached.driver.open(url, namespace=namespace, options=options)


class Interleaved:
    """Runs ``between`` right after ``store`` reads the item of ``key`` (``times`` times).

    ``between`` plays another client that writes the item after we read it and before
    our compare-and-swap: the race the store must survive. ``reads`` counts our reads
    of the item (``mg``, alone or sent with other commands).
    """

    def __init__(
        self, store: MemcachedStore, key: str, between: Callable[[], None], times: int
    ) -> None:
        self.name = store._layout.lease(key).encode()
        self.pools = set(map(id, store._pools.values()))
        self.between = between
        self.times = times
        self.reads = 0
        self.busy = False

    def after(self, session: Session, commands: bytes) -> None:
        mine = id(session._pool) in self.pools
        if self.busy or not mine or b"mg " + self.name not in commands:
            return
        self.reads += 1
        if self.times > 0:
            self.times -= 1
            self.busy = True  # ``between`` reads too, through other stores
            try:
                self.between()
            finally:
                self.busy = False


@pytest.fixture
def interleave(
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[..., Interleaved]:
    def install(
        store: MemcachedStore, key: str, between: Callable[[], None], times: int = 1
    ) -> Interleaved:
        hook = Interleaved(store, key, between, times)
        read, write = Session.read, Session.write

        def read_then(session: Session, commands: bytes, replies: int) -> Any:
            found = read(session, commands, replies)
            hook.after(session, commands)
            return found

        def write_then(session: Session, commands: bytes, replies: int) -> Any:
            found = write(session, commands, replies)
            hook.after(session, commands)
            return found

        monkeypatch.setattr(Session, "read", read_then)
        monkeypatch.setattr(Session, "write", write_then)
        return hook

    return install


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every write the stores send on their sockets (one round trip each)."""
    sent: list[bytes] = []
    send = Connection.send

    def counted(connection: Connection, data: bytes) -> None:
        sent.append(data)
        send(connection, data)

    monkeypatch.setattr(Connection, "send", counted)
    return sent


def acquire(
    store: MemcachedStore,
    key: str,
    token: str,
    ttl: float = 30.0,
    *,
    steal: bool = False,
    waiter: QueuedWaiter | None = None,
) -> Any:
    return store.try_acquire(
        key, token=token, ttl=ttl, owner="o", info=None, steal=steal, waiter=waiter
    )


def item(raw: Client, store: MemcachedStore, key: str) -> Record | Tombstone:
    """What the key's item holds now, as memcached has it (its fence resolved)."""
    name = store._layout.lease(key)
    value, cas = raw.gets(name)
    assert value is not None
    epoch = int(raw.get(EPOCH_ITEM).split(b":")[0])
    return decode(value, name, epoch, int(cas))


def gone(raw: Client, store: MemcachedStore, key: str) -> bool:
    return raw.get(store._layout.lease(key)) is None


def waiters(item: Record | Tombstone) -> list[str]:
    return [place.waiter for place in item.queue]


# -- races ---------------------------------------------------------------------------


def test_release_never_removes_the_lock_that_replaced_ours(
    memcached_url: str, namespace: str, interleave: Callable[..., Interleaved]
) -> None:
    ours, theirs = open_store(memcached_url, namespace), open_store(memcached_url, namespace)
    try:
        assert acquire(ours, "doc", TOKEN_A).ok
        # Our lease is taken over (a steal here; an expiry followed by an acquire is the
        # same race) before we release: a get-then-delete would delete *their* lock,
        # and so would a delete by a CAS older than their write.
        stolen = acquire(theirs, "doc", TOKEN_B, steal=True)
        released = ours.release("doc", TOKEN_A)
        assert released.ok is False
        assert released.holder == stolen.holder
        # The same, between a read and the compare-and-delete: a waiter wrote its place
        # (so the holder's own last CAS is stale), and the key is stolen after the
        # holder read the item again.
        waiting = open_store(memcached_url, namespace, patience=0)
        assert acquire(waiting, "doc", "W" * 24, waiter=waiting.waiter("doc")).ok is False
        hook = interleave(theirs, "doc", lambda: acquire(ours, "doc", TOKEN_A, steal=True))
        assert theirs.release("doc", TOKEN_B).ok is False
        assert hook.reads == 2  # its compare-and-swap failed; it read the item again
        waiting.close()
        current = ours.holder("doc")
        assert current is not None
        assert current.fence > stolen.holder.fence
        assert ours.renew("doc", TOKEN_A, 30.0).ok
        assert ours.release("doc", TOKEN_A).ok
    finally:
        ours.close()
        theirs.close()


def test_a_lost_race_on_an_expired_lease_is_retried_and_decided_afresh(
    memcached_url: str, namespace: str, interleave: Callable[..., Interleaved]
) -> None:
    first, second, third = (open_store(memcached_url, namespace) for _ in range(3))
    try:
        old = acquire(first, "job", "C" * 24, ttl=0.2)
        time.sleep(0.3)  # expired by its record; memcached still keeps the item
        # While `second` replaces the expired lease, `third` gets there first.
        hook = interleave(second, "job", lambda: acquire(third, "job", TOKEN_B))
        outcome = acquire(second, "job", TOKEN_A)
        assert hook.reads == 2
        assert outcome.ok is False  # the second read saw the third's live lease
        assert outcome.holder is not None
        assert outcome.holder.fence > old.holder.fence
        assert third.holder("job") == outcome.holder
    finally:
        for store in (first, second, third):
            store.close()


def test_lost_races_are_bounded(
    memcached_url: str, namespace: str, raw: Client, interleave: Callable[..., Interleaved]
) -> None:
    store = open_store(memcached_url, namespace)
    try:
        assert acquire(store, "hot", TOKEN_A, ttl=0.2).ok
        name = store._layout.lease("hot")
        value = raw.get(name)
        time.sleep(0.3)

        def rewrite() -> None:  # another client writes the item after every read of ours
            raw.set(name, value, expire=5)

        hook = interleave(store, "hot", rewrite, times=10 * RACE_ATTEMPTS)
        refused = acquire(store, "hot", TOKEN_B)
        assert refused.ok is False
        assert hook.reads == RACE_ATTEMPTS + 1  # and a last look, to say who holds it

        hook.reads = 0
        with pytest.raises(keymutex.StoreError, match="lost 8 races"):
            store.release("hot", TOKEN_A)
        assert hook.reads == RACE_ATTEMPTS
        # Renewal: the rewritten record is live again for a moment, and ours.
        fresh = json.loads(value)
        fresh[7] = time.time() + 30
        value = json.dumps(fresh).encode()
        raw.set(name, value, expire=5)
        hook.reads = 0
        with pytest.raises(keymutex.StoreError, match="lost 8 races"):
            store.renew("hot", TOKEN_A, 30.0)
        assert hook.reads == RACE_ATTEMPTS
    finally:
        store.close()


# -- the queue and the hand-over ------------------------------------------------------


@pytest.fixture
def stores(memcached_url: str, namespace: str) -> Iterator[list[MemcachedStore]]:
    """Four clients of one namespace whose waiters queue at once (``patience=0``)."""
    opened = [open_store(memcached_url, namespace, patience=0) for _ in range(4)]
    yield opened
    for store in opened:
        store.close()


@pytest.fixture
def long_hand_over(monkeypatch: pytest.MonkeyPatch) -> float:
    """A hand-over time no pause of a loaded test machine outlasts."""
    monkeypatch.setattr(memcached, "HANDOVER_SECONDS", 60.0)
    return 60.0


def test_a_release_keeps_the_key_for_the_first_queued_waiter(
    stores: list[MemcachedStore], raw: Client, long_hand_over: float
) -> None:
    holder, first, second, other = stores
    held = acquire(holder, "doc", TOKEN_A)
    one, two = first.waiter("doc"), second.waiter("doc")
    # A refusal with a waiter out of patience queues it, by a compare-and-swap of the
    # record that refused it.
    refused = acquire(first, "doc", "1" * 24, waiter=one)
    assert refused.ok is False
    assert refused.holder == held.holder
    assert acquire(second, "doc", "2" * 24, waiter=two).ok is False
    assert waiters(item(raw, holder, "doc")) == [one.id, two.id]
    # The holder's renewal keeps the queue (and the fence).
    renewed = holder.renew("doc", TOKEN_A, 30.0)
    assert renewed.ok
    assert renewed.holder.fence == held.holder.fence
    assert waiters(item(raw, holder, "doc")) == [one.id, two.id]

    assert holder.release("doc", TOKEN_A).ok
    kept = item(raw, holder, "doc")
    assert isinstance(kept, Tombstone)
    assert kept.heir == one.id
    assert kept.kept_until == pytest.approx(time.time() + long_hand_over, abs=5)
    # Nobody else takes it: not the releaser, not a newcomer, not the second waiter.
    tries = [(holder, TOKEN_A, None), (other, TOKEN_B, None), (second, "2" * 24, two)]
    for store, token, waiter in tries:
        refused = acquire(store, "doc", token, waiter=waiter)
        assert refused.ok is False
        assert refused.holder is None  # nobody holds it ...
        assert 0 < refused.remaining < long_hand_over + 0.01  # ... until the hand-over ends
    # The first waiter does, and its place goes in the same write.
    taken = acquire(first, "doc", "1" * 24, waiter=one)
    assert taken.ok
    assert taken.holder.fence > held.holder.fence
    assert one.queued is False
    assert waiters(item(raw, holder, "doc")) == [two.id]
    one.close()  # granted: nothing to leave, no round trip
    assert waiters(item(raw, holder, "doc")) == [two.id]


def _seconds_left(server: MemcachedServer, store: MemcachedStore, key: str) -> int:
    """The lease item's own time left, as memcached has it (``mg … t``)."""
    reply = server.command(f"mg {store._layout.lease(key)} t", until=b"\r\n")
    return int(reply.split()[1][1:])


def test_a_waiter_whose_clock_runs_ahead_never_cuts_the_holders_item_short(
    stores: list[MemcachedStore],
    memcached_server: MemcachedServer,
    raw: Client,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a waiter 5 s ahead wrote its place with an exptime by its own
    clock (the lease's 12 s less 5), memcached dropped the item while the lease was
    live, and a third client was granted the key. Its writes now keep at least what the
    item had left (``mg … t``)."""
    holder, waiting, *_ = stores
    assert acquire(holder, "doc", TOKEN_A, ttl=12.0).ok
    before = _seconds_left(memcached_server, holder, "doc")
    assert before >= 12
    ahead = time.time
    monkeypatch.setattr(memcached.time, "time", lambda: ahead() + 5.0)
    place = waiting.waiter("doc")
    try:
        assert acquire(waiting, "doc", "1" * 24, waiter=place).ok is False  # queued
        assert _seconds_left(memcached_server, holder, "doc") >= before - 1
        place.close()  # leaving the queue: the same
        assert _seconds_left(memcached_server, holder, "doc") >= before - 1
    finally:
        monkeypatch.undo()
    assert waiters(item(raw, holder, "doc")) == []


def test_a_patient_waiter_leaves_the_key_to_barging_and_then_is_handed_it(
    memcached_url: str, namespace: str, raw: Client, long_hand_over: float
) -> None:
    """Bounded barging: before its patience runs out a waiter writes nothing, and the
    releaser takes the key straight back; after, it queues and is handed the key ahead
    of the releaser."""
    holder = open_store(memcached_url, namespace)
    patient = open_store(memcached_url, namespace, patience=3600)
    try:
        held = acquire(holder, "doc", TOKEN_A)
        waiter = patient.waiter("doc")
        assert acquire(patient, "doc", "1" * 24, waiter=waiter).ok is False
        assert waiters(item(raw, holder, "doc")) == []  # it polled, and wrote nothing
        assert waiter.queued is False
        steps = [waiter.park(1.0) for _ in range(12)]  # slower and slower meanwhile
        assert steps[0] == POLL_FIRST
        assert steps == sorted(steps)
        assert waiter.park(0.0001) == 0.0001  # never longer than the client asked
        assert holder.release("doc", TOKEN_A).ok
        assert gone(raw, holder, "doc")  # deleted: free for whoever comes first
        again = acquire(holder, "doc", TOKEN_A)  # the releaser barges back in
        assert again.ok
        assert again.holder.fence > held.holder.fence

        patient._patience = 0.0  # as if its hour had passed
        impatient = patient.waiter("doc")
        assert impatient.park(1.0) == POLL_FIRST  # it looks again soon
        assert acquire(patient, "doc", "1" * 24, waiter=impatient).ok is False
        assert impatient.queued is True
        assert waiters(item(raw, holder, "doc")) == [impatient.id]
        # The holder's own last write is stale now: its release reads the item and
        # leaves the key to the waiter, and its next try is refused.
        assert holder.release("doc", TOKEN_A).ok
        assert acquire(holder, "doc", TOKEN_A).ok is False
        taken = acquire(patient, "doc", "1" * 24, waiter=impatient)
        assert taken.ok
        assert taken.holder.fence > again.holder.fence
        # The queue is empty again: its release deletes the item; barging resumes.
        assert patient.release("doc", "1" * 24).ok
        assert gone(raw, holder, "doc")
    finally:
        holder.close()
        patient.close()


def test_release_after_a_waiter_wrote_its_place(
    stores: list[MemcachedStore], raw: Client, round_trips: list[bytes], long_hand_over: float
) -> None:
    holder, first, _, _ = stores
    held = acquire(holder, "doc", TOKEN_A)
    waiter = first.waiter("doc")
    assert acquire(first, "doc", "1" * 24, waiter=waiter).ok is False
    queued = item(raw, holder, "doc")
    assert isinstance(queued, Record)
    assert queued.fence == held.holder.fence  # written into the record by the waiter
    del round_trips[:]
    assert holder.release("doc", TOKEN_A).ok
    # The compare-and-delete by the holder's own CAS failed (a waiter wrote since),
    # then a read and the tombstone that keeps the key for the waiter.
    assert [sent.split(b" ")[0] for sent in round_trips] == [b"md", b"mg", b"ms"]
    kept = item(raw, holder, "doc")
    assert isinstance(kept, Tombstone)
    assert kept.heir == waiter.id


def test_a_waiter_that_stopped_refreshing_its_place_is_skipped(
    stores: list[MemcachedStore], raw: Client, long_hand_over: float
) -> None:
    holder, first, second, _ = stores
    assert acquire(holder, "doc", TOKEN_A).ok
    gone, there = first.waiter("doc"), second.waiter("doc")
    assert acquire(first, "doc", "1" * 24, waiter=gone).ok is False
    assert acquire(second, "doc", "2" * 24, waiter=there).ok is False
    # The first waiter's process died long ago: its place was last written 10 s back.
    name = holder._layout.lease("doc")
    record = item(raw, holder, "doc")
    assert isinstance(record, Record)
    stale = (Place(gone.id, time.time() - 10), *record.queue[1:])
    raw.set(name, replace(record, queue=stale).encode(), expire=30)

    assert holder.release("doc", TOKEN_A).ok
    kept = item(raw, holder, "doc")
    assert isinstance(kept, Tombstone)
    assert kept.heir == there.id
    assert waiters(kept) == [there.id]  # and its place is dropped
    assert acquire(second, "doc", "2" * 24, waiter=there).ok


def test_a_waiter_refreshes_its_place_and_so_is_never_taken_for_gone(
    stores: list[MemcachedStore],
    raw: Client,
    memcached_server: MemcachedServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    holder, first, _, _ = stores
    assert acquire(holder, "doc", TOKEN_A).ok
    waiter = first.waiter("doc")
    monkeypatch.setattr(memcached, "REFRESH_SECONDS", 60.0)
    assert acquire(first, "doc", "1" * 24, waiter=waiter).ok is False
    joined = item(raw, holder, "doc").queue[0].seen
    # Looking again while the place is fresh costs one write: an add and a read.
    before = _counts(memcached_server)
    assert acquire(first, "doc", "1" * 24, waiter=waiter).ok is False
    assert _delta(before, _counts(memcached_server)) == {"cmd_get": 1, "cmd_set": 1}
    # Once it is REFRESH_SECONDS old, the look rewrites it by compare-and-swap.
    monkeypatch.setattr(memcached, "REFRESH_SECONDS", 0.05)
    time.sleep(0.1)
    before = _counts(memcached_server)
    assert acquire(first, "doc", "1" * 24, waiter=waiter).ok is False
    assert _delta(before, _counts(memcached_server)) == {"cmd_get": 1, "cmd_set": 2}
    record = item(raw, holder, "doc")
    assert waiters(record) == [waiter.id]
    assert record.queue[0].seen > joined


def test_an_expired_hand_over_frees_the_key_for_anyone(
    stores: list[MemcachedStore], raw: Client, long_hand_over: float
) -> None:
    holder, first, _, other = stores
    held = acquire(holder, "doc", TOKEN_A)
    slow = first.waiter("doc")
    assert acquire(first, "doc", "1" * 24, waiter=slow).ok is False
    assert holder.release("doc", TOKEN_A).ok
    assert acquire(other, "doc", TOKEN_B).ok is False  # kept for the waiter ...
    kept = item(raw, holder, "doc")
    assert isinstance(kept, Tombstone)
    expired = replace(kept, kept_until=time.time() - 0.001)  # ... which did not come in time
    raw.set(holder._layout.lease("doc"), expired.encode(), expire=30)
    taken = acquire(other, "doc", TOKEN_B)
    assert taken.ok
    assert taken.holder.fence > held.holder.fence
    # The slow waiter keeps its place, first in line for the next release.
    assert waiters(item(raw, holder, "doc")) == [slow.id]
    assert acquire(first, "doc", "1" * 24, waiter=slow).ok is False
    assert other.release("doc", TOKEN_B).ok
    assert acquire(other, "doc", TOKEN_B).ok is False
    assert acquire(first, "doc", "1" * 24, waiter=slow).ok


def test_a_waiter_that_gives_up_leaves_the_queue(
    stores: list[MemcachedStore],
    raw: Client,
    memcached_server: MemcachedServer,
    long_hand_over: float,
) -> None:
    holder, first, second, other = stores
    assert acquire(holder, "doc", TOKEN_A).ok
    one, two = first.waiter("doc"), second.waiter("doc")
    assert acquire(first, "doc", "1" * 24, waiter=one).ok is False
    assert acquire(second, "doc", "2" * 24, waiter=two).ok is False
    before = _counts(memcached_server)
    two.close()
    assert _delta(before, _counts(memcached_server)) == {"cmd_get": 1, "cmd_set": 1}
    assert waiters(item(raw, holder, "doc")) == [one.id]
    two.close()  # twice: nothing left to do
    assert waiters(item(raw, holder, "doc")) == [one.id]
    assert holder.renew("doc", TOKEN_A, 30.0).ok  # the lease itself is untouched

    # The last waiter gives up while the key is kept for it: the key is free again.
    assert holder.release("doc", TOKEN_A).ok
    assert acquire(other, "doc", TOKEN_B).ok is False
    one.close()
    assert gone(raw, holder, "doc")
    assert acquire(other, "doc", TOKEN_B).ok


def test_a_waiter_that_gives_up_passes_a_key_kept_for_it_on(
    stores: list[MemcachedStore], raw: Client, long_hand_over: float
) -> None:
    holder, first, second, other = stores
    assert acquire(holder, "doc", TOKEN_A).ok
    one, two = first.waiter("doc"), second.waiter("doc")
    assert acquire(first, "doc", "1" * 24, waiter=one).ok is False
    assert acquire(second, "doc", "2" * 24, waiter=two).ok is False
    assert holder.release("doc", TOKEN_A).ok
    first_kept = item(raw, holder, "doc")
    assert isinstance(first_kept, Tombstone)
    assert first_kept.heir == one.id
    time.sleep(0.1)
    one.close()
    kept = item(raw, holder, "doc")
    assert isinstance(kept, Tombstone)
    assert kept.heir == two.id
    assert waiters(kept) == [two.id]
    assert kept.kept_until >= first_kept.kept_until + 0.09  # a whole hand-over time of its own
    assert acquire(other, "doc", TOKEN_B).ok is False
    assert acquire(second, "doc", "2" * 24, waiter=two).ok


def test_a_waiters_write_never_undoes_a_renewal(
    stores: list[MemcachedStore], raw: Client, interleave: Callable[..., Interleaved]
) -> None:
    holder, first, _, _ = stores
    held = acquire(holder, "doc", TOKEN_A, ttl=5.0)
    waiter = first.waiter("doc")
    # Between the waiter's read and its compare-and-swap, the holder renews for an hour.
    hook = interleave(first, "doc", lambda: holder.renew("doc", TOKEN_A, 3600.0))
    assert acquire(first, "doc", "1" * 24, waiter=waiter).ok is False
    assert hook.reads == 2  # its compare-and-swap failed, it read the item again
    record = item(raw, holder, "doc")
    assert isinstance(record, Record)
    assert record.token == TOKEN_A
    assert record.expires_at > time.time() + 3000
    assert waiters(record) == [waiter.id]
    assert record.fence == held.holder.fence  # the same lease, the same fence


def test_the_queue_is_bounded(
    stores: list[MemcachedStore], raw: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memcached, "QUEUE_LIMIT", 2)
    holder, *others = stores
    assert acquire(holder, "doc", TOKEN_A).ok
    queued = [store.waiter("doc") for store in others]
    for n, (store, waiter) in enumerate(zip(others, queued, strict=True)):
        assert acquire(store, "doc", f"{n}" * 24, waiter=waiter).ok is False
    assert waiters(item(raw, holder, "doc")) == [queued[0].id, queued[1].id]
    assert queued[2].queued is False  # it polls without a place, and has none to leave


def test_steal_ignores_the_hand_over_and_keeps_the_queue(
    stores: list[MemcachedStore], raw: Client
) -> None:
    holder, first, _, other = stores
    held = acquire(holder, "doc", TOKEN_A)
    waiter = first.waiter("doc")
    assert acquire(first, "doc", "1" * 24, waiter=waiter).ok is False
    assert holder.release("doc", TOKEN_A).ok
    stolen = acquire(other, "doc", TOKEN_B, steal=True)
    assert stolen.ok
    assert stolen.holder.fence > held.holder.fence
    assert waiters(item(raw, holder, "doc")) == [waiter.id]


def test_contenders_take_turns_with_strict_hand_over(memcached_url: str, namespace: str) -> None:
    """Three clients looping on one key, waiters queueing at once (``patience=0``): a
    releaser cannot take the key straight back while another waits."""
    clients = [keymutex.Locks(memcached_url, namespace=namespace, patience=0) for _ in range(3)]
    grants: list[int] = []
    mutex = threading.Lock()

    def loop(n: int) -> None:
        for _ in range(15):
            with clients[n].lock("doc", timeout=30, renew=False):
                with mutex:
                    grants.append(n)
                time.sleep(0.002)

    threads = [threading.Thread(target=loop, args=(n,)) for n in range(3)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        for locks in clients:
            locks.close()
    assert len(grants) == 45
    same = sum(1 for a, b in itertools.pairwise(grants) if a == b)
    # Before the queue, a releaser took the key straight back almost every time.
    assert same < len(grants) / 3, grants


def test_a_waiter_polls_soon_after_a_change_and_less_often_further_back(
    memcached_url: str, namespace: str
) -> None:
    store = open_store(memcached_url, namespace)
    try:
        waiter = store.waiter("doc")
        waiter.queued = True
        waiter.saw((1, True), 0)
        steps = [waiter.park(1.0) for _ in range(20)]
        assert steps[0] == POLL_FIRST
        assert steps == sorted(steps)
        assert max(steps) == pytest.approx(POLL_LIMIT)
        assert waiter.park(0.0001) == 0.0001  # never longer than the client asked
        waiter.saw((1, True), 3)  # the same state, further back: slower
        assert max(waiter.park(1.0) for _ in range(30)) == pytest.approx(4 * POLL_LIMIT)
        waiter.saw((1, True), QUEUE_LIMIT)  # without a place: within a hand-over still
        assert max(waiter.park(2.0) for _ in range(30)) == pytest.approx(POLL_CEILING)
        assert POLL_CEILING < HANDOVER_SECONDS
        waiter.saw((1, False), 0)  # the key changed hands: soon again
        assert waiter.park(1.0) == POLL_FIRST
    finally:
        store.close()


def test_a_patient_waiter_that_sees_the_key_change_hands_polls_on_its_longest_step(
    memcached_url: str, namespace: str
) -> None:
    """Under barging a key that changed hands between two looks is busy: quick looks
    could only steal it. While one holder keeps it, the waiter polls on growing steps
    from the quickest (the key may be freed for good any moment)."""
    holder = open_store(memcached_url, namespace)
    patient = open_store(memcached_url, namespace, patience=60)
    try:
        assert acquire(holder, "doc", TOKEN_A).ok
        waiter = patient.waiter("doc")
        for _ in range(3):  # the same lease at each look: soon again, a little later
            assert acquire(patient, "doc", "1" * 24, waiter=waiter).ok is False
            assert waiter.park(1.0) < POLL_LIMIT
        assert holder.release("doc", TOKEN_A).ok
        assert acquire(holder, "doc", TOKEN_A).ok  # the releaser took it back
        assert acquire(patient, "doc", "1" * 24, waiter=waiter).ok is False
        assert waiter.queued is False
        # The longest step from now on, not the quick ones: a key freed for good is
        # still found within it.
        assert waiter.park(120.0) == pytest.approx(POLL_LIMIT)
        assert waiter.park(120.0) == pytest.approx(POLL_LIMIT)
    finally:
        holder.close()
        patient.close()


def test_the_client_lets_a_memcached_waiter_set_its_own_pace(
    memcached_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No client backoff under the waiter's own step: the client parks it up to the
    holder's expiry or the caller's deadline, and the waiter chooses how long."""
    holder = keymutex.Locks(memcached_url, namespace=namespace)
    waiting = keymutex.Locks(memcached_url, namespace=namespace, patience=60)
    asked: list[float] = []

    class Recording(QueuedWaiter):
        def wait(self, timeout: float) -> bool:
            asked.append(timeout)
            return super().wait(timeout)

    store = waiting._store
    assert isinstance(store, MemcachedStore)
    monkeypatch.setattr(store, "waiter", lambda key: Recording(store, key, 60))
    try:
        with holder.lock("doc", ttl=30), pytest.raises(keymutex.Locked):
            waiting.acquire("doc", timeout=0.6)
        # The first wait may last to the deadline (0.6 s less the first try): a client
        # backoff would have cut it to a step of 1 to 2 ms.
        assert asked
        assert asked[0] > 0.3, asked
    finally:
        holder.close()
        waiting.close()


# -- fences --------------------------------------------------------------------------


def test_fences_are_epoch_plus_cas_and_increase_across_grants_expiries_and_steals(
    memcached_url: str, namespace: str, raw: Client
) -> None:
    one, two = open_store(memcached_url, namespace), open_store(memcached_url, namespace)
    try:
        two.holder("row")  # the first connection reads the epoch, or sets it on a new server
        after_first_use = time.time_ns() // 1000
        fences = []
        for round_ in range(20):
            store = one if round_ % 2 else two
            token = f"{round_:024d}"
            outcome = acquire(store, "row", token, ttl=0.05 if round_ % 5 == 4 else 30.0)
            if not outcome.ok:  # the last lease is held: steal it
                outcome = acquire(store, "row", token, steal=True)
            assert outcome.ok
            fences.append(outcome.holder.fence)
            if round_ % 5 == 4:
                time.sleep(0.1)  # left to expire: the next grant replaces it
            elif round_ % 3 != 2:
                assert store.release("row", token).ok
        assert all(a < b for a, b in itertools.pairwise(fences)), fences
        # The fence is the server's epoch (the wall clock, in microseconds, when it was
        # first needed) plus the grant's CAS.
        epoch = int(raw.get(EPOCH_ITEM).split(b":")[0])
        assert epoch <= after_first_use
        assert all(epoch < fence < epoch + 10**9 for fence in fences)
    finally:
        one.close()
        two.close()


def test_a_fence_never_changes_during_a_lease(
    stores: list[MemcachedStore], raw: Client, long_hand_over: float
) -> None:
    holder, first, second, other = stores
    held = acquire(holder, "doc", TOKEN_A)
    fence = held.holder.fence
    # The record a grant writes leaves the fence out: it is the epoch it names + the
    # item's CAS.
    epoch = int(raw.get(EPOCH_ITEM).split(b":")[0])
    assert json.loads(raw.get(holder._layout.lease("doc")))[5] == [epoch]
    seen = [fence]
    for store, token in ((first, "1" * 24), (second, "2" * 24)):
        refused = acquire(store, "doc", token, waiter=store.waiter("doc"))  # writes a place
        seen.append(refused.holder.fence)
        seen.append(item(raw, holder, "doc").fence)  # now written into the record
        renewed = holder.renew("doc", TOKEN_A, 30.0)
        seen.append(renewed.holder.fence)
    # A renewal from a client that did not grant it (read, compare, swap).
    seen.append(other.renew("doc", TOKEN_A, 30.0).holder.fence)
    seen.append(holder.renew("doc", TOKEN_A, 30.0).holder.fence)
    seen.append(holder.holder("doc").fence)
    assert seen == [fence] * len(seen)
    assert holder.release("doc", TOKEN_A).ok


def test_every_reader_sees_a_lease_s_own_fence_after_the_epoch_was_evicted(
    memcached_url: str, namespace: str, raw: Client
) -> None:
    """Found by review: a reader added its own connection's epoch to the item's CAS.
    Once ``km2:epoch`` had been evicted (a shared cache under pressure) and made again
    by a newer connection, that connection's client saw another fence for the same
    lease than its holder (and than ``lease.fence``)."""
    holder = open_store(memcached_url, namespace)
    try:
        held = acquire(holder, "doc", TOKEN_A)
        assert raw.delete(EPOCH_ITEM)  # evicted
        newer = open_store(memcached_url, namespace)  # a new connection makes a new one
        try:
            seen = newer.holder("doc")
            assert seen is not None
            assert int(raw.get(EPOCH_ITEM).split(b":")[0]) != held.holder.fence - _cas_of(
                raw, holder, "doc"
            )  # the epoch did change
            assert seen.fence == held.holder.fence
            # ... and after a renewal by the newer client, which writes the fence in.
            renewed = newer.renew("doc", TOKEN_A, 30.0)
            assert renewed.holder.fence == held.holder.fence
            assert holder.holder("doc").fence == held.holder.fence
        finally:
            newer.close()
        assert holder.release("doc", TOKEN_A).ok
    finally:
        holder.close()


def _cas_of(raw: Client, store: MemcachedStore, key: str) -> int:
    _, cas = raw.gets(store._layout.lease(key))
    return int(cas)


def test_concurrent_grants_never_share_a_fence(memcached_url: str, namespace: str) -> None:
    stores = [open_store(memcached_url, namespace) for _ in range(4)]
    fences: list[int] = []
    mutex = threading.Lock()

    def grab(store: MemcachedStore, n: int) -> None:
        for i in range(25):
            outcome = acquire(store, f"k{i % 3}", f"{n}-{i}".rjust(24, "x"), steal=True)
            if outcome.ok:
                with mutex:
                    fences.append(outcome.holder.fence)

    threads = [threading.Thread(target=grab, args=(s, n)) for n, s in enumerate(stores)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for store in stores:
        store.close()
    assert len(fences) > 50
    assert len(set(fences)) == len(fences)


def test_restart_forgets_every_lease_and_fences_rest_on_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with MemcachedServer(tmp_path / "restarted").start() as server:
        holder = keymutex.Locks(server.url, namespace="n", owner="before")
        other = keymutex.Locks(server.url, namespace="n", owner="after")
        try:
            lease = holder.acquire("doc", ttl=60)
            server.restart()
            # The documented hazard: memcached forgot the lock, so a second client takes
            # the key while the first still believes it holds it (until it renews).
            assert lease.lost is False
            assert other.holder("doc") is None
            taken = other.acquire("doc", timeout=0)
            # The epoch was created again from the clock: fences still went up...
            assert taken.fence > lease.fence
            # The restarted server gave the new lease the very CAS that the holder's
            # last write had (its counter started again): the holder's release must not
            # delete it by that CAS. It reads, compares the token, and finds it lost.
            assert (
                _cas(server, holder, "doc")
                == holder._store._written[  # type: ignore[attr-defined]
                    holder._store._layout.lease("doc")  # type: ignore[attr-defined]
                ].cas
            )
            with pytest.raises(keymutex.LockLost):
                lease.release()
            assert other.holder("doc") == locks_holder(other, taken)

            # ... but only because the clock did. With the clock set back (here: the
            # seed), a restart hands out a fence smaller than one granted before.
            monkeypatch.setattr(memcached, "epoch_seed", lambda: 1000)
            taken.release()
            server.restart()
            again = other.acquire("doc", timeout=0)
            assert again.fence < taken.fence
            assert again.fence < 10**6
        finally:
            holder.close()
            other.close()


def _cas(server: MemcachedServer, store: keymutex.Locks, key: str) -> int:
    name = store._store._layout.lease(key)  # type: ignore[attr-defined]
    reply = server.command(f"mg {name} c", until=b"\r\n")
    return int(reply.split()[1][1:])


def locks_holder(locks: keymutex.Locks, lease: keymutex.Lease) -> keymutex.Holder:
    return keymutex.Holder(
        lease.key, lease.owner, lease.info, lease.fence, lease.acquired_at, lease.expires_at
    )


# -- round trips ---------------------------------------------------------------------


def _counts(server: MemcachedServer) -> dict[str, int]:
    stats = server.stats()
    names = ("cmd_get", "cmd_set", "delete_hits", "delete_misses")
    return {name: int(stats[name]) for name in names}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in after if after[name] != before[name]}


def test_round_trips_of_each_step(
    memcached_server: MemcachedServer,
    namespace: str,
    round_trips: list[bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memcached, "COMPACT_EVERY", 10**30)  # no compaction in between
    store, other = (open_store(memcached_server.url, namespace) for _ in range(2))
    try:
        assert acquire(store, "doc", "W" * 24).ok  # connects, creates the index bucket
        assert store.release("doc", "W" * 24).ok
        assert other.holder("doc") is None  # connects

        def step(do: Callable[[], object]) -> tuple[list[bytes], dict[str, int]]:
            del round_trips[:]
            before = _counts(memcached_server)
            do()
            return [sent.split(b" ")[0] for sent in round_trips], _delta(
                before, _counts(memcached_server)
            )

        # A free key: add, append to the index and a read (for a refusal), in one write.
        assert step(lambda: acquire(store, "doc", TOKEN_A)) == (
            [b"ms"],
            {"cmd_set": 2, "cmd_get": 1},
        )
        # Refused: the same one write; its read says who holds the key.
        assert step(lambda: acquire(other, "doc", TOKEN_B)) == (
            [b"ms"],
            {"cmd_set": 2, "cmd_get": 1},
        )
        # Refused again while that lease lasts: the add and the read in one write, and
        # no index entry.
        assert step(lambda: acquire(other, "doc", TOKEN_B)) == (
            [b"ms"],
            {"cmd_set": 1, "cmd_get": 1},
        )
        # Renew and release by the CAS of our own last write: one command each.
        assert step(lambda: store.renew("doc", TOKEN_A, 30)) == ([b"ms"], {"cmd_set": 1})
        assert step(lambda: store.release("doc", TOKEN_A)) == ([b"md"], {"delete_hits": 1})

        # From a client that did not write the lease last: read, then compare-and-swap.
        assert acquire(store, "doc", TOKEN_A).ok
        assert step(lambda: other.renew("doc", TOKEN_A, 30)) == (
            [b"mg", b"ms"],
            {"cmd_get": 1, "cmd_set": 1},
        )
        assert step(lambda: store.release("doc", TOKEN_A)) == (  # its CAS is stale now
            [b"md", b"mg", b"md"],
            {"delete_misses": 1, "cmd_get": 1, "delete_hits": 1},
        )
        # A waiter's poll: the add and the read in one write.
        assert acquire(store, "doc", TOKEN_A).ok
        assert step(lambda: acquire(other, "doc", TOKEN_B, waiter=other.waiter("doc"))) == (
            [b"ms"],
            {"cmd_set": 1, "cmd_get": 1},
        )
    finally:
        store.close()
        other.close()


def test_a_dead_pooled_connection_is_replaced_before_a_write(tmp_path: Path) -> None:
    with MemcachedServer(tmp_path / "restarted").start() as server:
        store = open_store(server.url, "n")
        try:
            assert acquire(store, "doc", TOKEN_A).ok
            server.restart()  # every pooled connection is closed by the server
            # The next step, a write first, goes down a new connection, and succeeds.
            assert acquire(store, "doc", TOKEN_B).ok
        finally:
            store.close()


def test_a_steal_sent_again_on_a_new_connection_takes_its_fence_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a steal starts with a read, which goes again down a new
    connection when the pooled one turns out dead (a host gone without a FIN: nothing
    to read while idle, a reset at the first send). The grant kept the dead
    connection's epoch, so after a restart its fence fell below those the restarted
    server had already granted."""
    with MemcachedServer(tmp_path / "restarted").start() as server:
        stealer = keymutex.Locks(server.url, namespace="n", ttl=30)
        other = keymutex.Locks(server.url, namespace="n", ttl=30)
        try:
            stealer.acquire("doc").release()  # its connection stays in its pool
            server.restart()
            taken = other.acquire("doc")  # the new epoch, from the clock: fences go up
            # As if the host had gone without a FIN: the dead socket looks idle.
            monkeypatch.setattr(memcached.Connection, "idle_and_open", lambda self: True)
            stolen = stealer.acquire("doc", steal=True)
            assert stolen.fence > taken.fence
            assert other.holder("doc") == locks_holder(stealer, stolen)
        finally:
            stealer.close()
            other.close()


def test_the_pool_is_bounded(memcached_url: str, namespace: str) -> None:
    store = open_store(memcached_url, namespace, max_connections=1, socket_timeout=0.2)
    try:
        pool = next(iter(store._pools.values()))
        with pool.session() as session:
            assert session.epoch > 0
            with pytest.raises(keymutex.StoreError, match="busy"):
                store.holder("doc")
        assert store.holder("doc") is None  # the connection came back
    finally:
        store.close()


def test_a_step_that_ends_after_the_store_closed_closes_its_connection(
    memcached_url: str, namespace: str
) -> None:
    """Found in CI: a renewal left running on a thread of its own (a paused server,
    waited for a third of the TTL) ended after its store closed, and gave its
    connection back to the closed pool, where it stayed open until the garbage
    collector warned of an unclosed socket during some later test."""
    store = open_store(memcached_url, namespace)
    pool = next(iter(store._pools.values()))
    with pool.session() as session:
        connection = session.connection
        assert session.epoch > 0
        store.close()
    assert connection.sock.fileno() == -1  # closed, not kept in the closed pool
    assert not pool._idle


def _all_closed(connections: list[memcached.Connection]) -> None:
    if any(connection.sock.fileno() != -1 for connection in connections):
        raise SystemExit(1)


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_forked_child_closes_its_copies_of_the_pooled_sockets_and_not_the_parents(
    memcached_url: str, namespace: str
) -> None:
    """Seen in the fork tests: the child dropped the parent's pools unclosed, and each
    copied socket warned of being unclosed when the child's garbage collector found
    it. The child closes its copies; the parent's connections go on working."""
    store = open_store(memcached_url, namespace)
    try:
        assert acquire(store, "doc", TOKEN_A).ok
        pool = next(iter(store._pools.values()))
        pooled = list(pool._idle)
        assert len(pooled) == 1
        child = multiprocessing.get_context("fork").Process(target=_all_closed, args=(pooled,))
        child.start()
        child.join(20)
        assert child.exitcode == 0, "the child's copy of the pooled socket is still open"
        assert store.holder("doc") is not None
        assert pool._idle == pooled  # reused: the parent's connection is still open
    finally:
        store.close()


def test_capabilities_say_what_memcached_does_not_promise() -> None:
    capabilities = memcached.CAPABILITIES
    assert capabilities.durable_fences is False
    assert capabilities.notifies is False
    assert capabilities.fair is False
    assert capabilities.cross_process is True
    assert capabilities.clock == "client-wall"


# -- eviction --------------------------------------------------------------------------


@pytest.mark.slow
def test_eviction_drops_a_live_lease(tmp_path: Path) -> None:
    """The other documented hazard: under memory pressure memcached evicts a lease."""
    with MemcachedServer(tmp_path / "small", memory_mb=8).start() as server:
        locks = keymutex.Locks(server.url, namespace="n")
        filler = Client(("127.0.0.1", server.port), default_noreply=True)
        try:
            lease = locks.acquire("doc", ttl=600, info={"pad": "x" * 200})
            # Items of the lease's size (so of its slab class), never read back, until
            # eight times the cache was written: the lease is the oldest of its class.
            name = Layout("n", ["one"]).lease("doc")
            size = len(
                Record("doc", lease.token, lease.owner, lease.info, None,
                       lease.acquired_at, lease.expires_at).encode()
            )  # fmt: skip
            padding = b"p" * size
            count = 8 * 8 * 2**20 // (size + len(name) + 60)
            for batch in range(0, count, 1000):
                filler.set_many(
                    {f"fill:{batch + i}".ljust(len(name), "x"): padding for i in range(1000)},
                    expire=0,
                )
            assert int(server.stats()["evictions"]) > 0
            assert locks.holder("doc") is None
            assert lease.lost is False  # its holder cannot know
            assert locks.acquire("doc", timeout=0).fence > lease.fence
        finally:
            filler.close()
            locks.close()


# -- holders() and its index -----------------------------------------------------------


def test_index_is_compacted_as_leases_come_and_go(
    memcached_url: str, namespace: str, raw: Client
) -> None:
    store = open_store(memcached_url, namespace)
    try:
        for i in range(300):
            token = f"{i:024d}"
            assert acquire(store, f"key:{i}", token).ok
            if i % 10:
                assert store.release(f"key:{i}", token).ok
        listed = [holder.key for holder in store.holders("key:")]
        assert listed == sorted(f"key:{i}" for i in range(0, 300, 10))
        shard = next(iter(store._layout.shards.values()))
        entries = sum(len(Layout.index_leases(raw.get(name))) for name in shard.buckets)
        raw_entries = sum(len((raw.get(name) or b"").split()) for name in shard.buckets)
        assert raw_entries < 300  # released leases were dropped from the index
        assert entries >= 30
    finally:
        store.close()


def test_short_lived_stores_compact_the_index_too(
    memcached_url: str, namespace: str, raw: Client
) -> None:
    """Each store counted its grants from 0 and compacted at the 64th: stores granting
    fewer (short-lived clients) never did, and the index grew with every acquire."""
    grants = 1000  # no compaction in 1000 grants at 1 in 64: odds (63/64)^1000, 1.5e-7
    shard_buckets: list[str] = []
    for i in range(grants):
        store = open_store(memcached_url, namespace)
        try:
            token = f"{i:024d}"
            assert acquire(store, f"key:{i}", token).ok
            assert store.release(f"key:{i}", token).ok
            shard_buckets = next(iter(store._layout.shards.values())).buckets
        finally:
            store.close()
    raw_entries = sum(len((raw.get(name) or b"").split()) for name in shard_buckets)
    assert raw_entries < grants  # released leases were dropped from the index


def test_an_evicted_index_only_hides_leases_from_holders(
    memcached_url: str, namespace: str, raw: Client
) -> None:
    store = open_store(memcached_url, namespace)
    try:
        assert acquire(store, "doc", TOKEN_A).ok
        for name in next(iter(store._layout.shards.values())).buckets:
            raw.delete(name)  # as an eviction would
        assert store.holders("") == []  # best effort: the listing lost it ...
        assert store.holder("doc") is not None  # ... the lock itself is intact
        assert acquire(store, "doc", TOKEN_B).ok is False
    finally:
        store.close()


def _fill(raw: Client, bucket: str, entry: bytes) -> None:
    """Append ``entry`` to ``bucket`` until memcached takes no more: its item size limit."""
    for chunk in (entry * 4096, entry):
        while raw.append(bucket, chunk, noreply=False):
            pass


def test_a_full_index_bucket_is_compacted_and_lists_new_leases(
    memcached_url: str, namespace: str, raw: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: every first try appends an entry, refused or not, and memcached
    1.6 answers ``NS`` (not ``SERVER_ERROR``) to an append past its 1 MB item limit. The
    store took that for a missing bucket, failed to create it, and never compacted it:
    after ~40,000 refused tries at a held key, every lease listed in its bucket was
    missing from ``holders()``. The bucket is filled here as those tries filled it."""
    monkeypatch.setattr(memcached, "COMPACT_EVERY", 10**30)  # only a full bucket compacts
    with (
        keymutex.Locks(memcached_url, namespace=namespace) as a,
        keymutex.Locks(memcached_url, namespace=namespace) as b,
        keymutex.Locks(memcached_url, namespace=namespace) as c,
    ):
        layout = a._store._layout  # type: ignore[attr-defined]
        job = layout.lease("job")
        shard = layout.shard_of(job)
        bucket = Layout.bucket_of(shard, job)
        a.acquire("job", ttl=600)
        _fill(raw, bucket, Layout.index_entry(job))
        assert len(raw.get(bucket)) > 1_000_000
        with pytest.raises(keymutex.Locked):
            b.acquire("job", timeout=0)
        users = [f"user:{i}" for i in range(60)]
        users += list(
            itertools.islice(
                (
                    key
                    for key in (f"user:{i}" for i in itertools.count(60))
                    if Layout.bucket_of(shard, layout.lease(key)) == bucket
                ),
                4,
            )
        )  # some in the full bucket, whatever the namespace hashes to
        leases = [c.acquire(key, ttl=600) for key in users]
        assert [holder.key for holder in c.holders("user:")] == sorted(users)
        assert [holder.key for holder in b.holders()] == sorted([*users, "job"])
        assert len(raw.get(bucket)) < 10_000  # the duplicates of the held key are gone
        for lease in leases:
            lease.release()


def test_polling_a_held_key_does_not_grow_its_index_bucket(
    memcached_url: str, namespace: str, raw: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client refused a key lately tries it again without an index entry; its grant,
    when it comes, lists itself (one round trip more)."""
    monkeypatch.setattr(memcached, "COMPACT_EVERY", 10**30)
    with (
        keymutex.Locks(memcached_url, namespace=namespace) as a,
        keymutex.Locks(memcached_url, namespace=namespace) as b,
    ):
        layout = a._store._layout  # type: ignore[attr-defined]
        job = layout.lease("job")
        bucket = Layout.bucket_of(layout.shard_of(job), job)
        lease = a.acquire("job", ttl=600)
        for _ in range(500):
            with pytest.raises(keymutex.Locked):
                b.acquire("job", timeout=0)
        assert len(raw.get(bucket).split()) <= 2  # a's grant, b's first refusal
        lease.release()
        raw.delete(bucket)  # no entry left for "job": b's grant must write its own
        mine = b.acquire("job", timeout=0, ttl=600)
        assert [holder.key for holder in a.holders()] == ["job"]
        mine.release()


def test_a_foreign_item_is_a_store_error(memcached_url: str, namespace: str, raw: Client) -> None:
    store = open_store(memcached_url, namespace)
    try:
        raw.set(store._layout.lease("doc"), b"somebody else's", expire=5)
        with pytest.raises(keymutex.StoreError, match="does not hold a keymutex lease"):
            acquire(store, "doc", TOKEN_A)
    finally:
        store.close()


# -- several servers -----------------------------------------------------------------


def test_several_servers_spread_keys_and_a_dead_one_is_never_replaced(tmp_path: Path) -> None:
    with (
        MemcachedServer(tmp_path / "one").start() as one,
        MemcachedServer(tmp_path / "two").start() as two,
    ):
        url = f"memcached://127.0.0.1:{one.port},127.0.0.1:{two.port}"
        locks = keymutex.Locks(url, namespace="n", socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            leases = {f"k{i}": locks.acquire(f"k{i}") for i in range(20)}
            layout = locks._store._layout  # type: ignore[attr-defined]
            homes = {key: layout.server_of(layout.lease(key)) for key in leases}
            assert set(homes.values()) == {f"127.0.0.1:{one.port}", f"127.0.0.1:{two.port}"}
            assert [h.key for h in locks.holders()] == sorted(leases)
            for shard in layout.shards.values():  # index buckets live on their server
                assert all(layout.server_of(b) == shard.server for b in shard.buckets)

            two.stop()
            for key, lease in leases.items():
                if homes[key].endswith(f":{one.port}"):
                    lease.renew()  # unaffected
                else:  # never moved to the live server, where it would look free
                    with pytest.raises(keymutex.StoreError):
                        locks.acquire(key, timeout=0)
        finally:
            locks.close()


def test_a_paused_server_does_not_cost_another_servers_renewing_lease(tmp_path: Path) -> None:
    """Found by a review: one server failing failed the whole batch renewal, and a lease
    on a server that answered every time was lost with the others at its deadline
    (renewed together from then on, they failed together). A server that answers now
    renews its own leases (``PartialRenewal`` carries them)."""
    with (
        MemcachedServer(tmp_path / "one").start() as one,
        MemcachedServer(tmp_path / "two").start() as two,
    ):
        url = f"memcached://127.0.0.1:{one.port},127.0.0.1:{two.port}"
        with keymutex.Locks(url, namespace=uuid.uuid4().hex[:8], socket_timeout=1.0) as locks:
            layout = locks._store._layout  # type: ignore[attr-defined]
            keys = [f"k{i}" for i in range(60)]
            on_one = [
                k for k in keys if layout.server_of(layout.lease(k)).endswith(f":{one.port}")
            ]
            on_two = [k for k in keys if k not in on_one]
            # A lease on server two falls due first; while its renewal waits for the
            # paused server, the next two fall due and are renewed in one batch.
            first = locks.acquire(on_two[0], ttl=5, renew=True)
            time.sleep(0.2)
            healthy = locks.acquire(on_one[0], ttl=5, renew=True)
            doomed = locks.acquire(on_two[1], ttl=5, renew=True)
            os.kill(two.process.pid, signal.SIGSTOP)
            try:
                time.sleep(6.5)  # past every lease's deadline
            finally:
                os.kill(two.process.pid, signal.SIGCONT)
            assert first.lost
            assert doomed.lost
            assert not healthy.lost  # its server answered every time
            assert locks.holder(on_one[0]) is not None
            healthy.release()


def _stop(pid: int) -> None:
    """SIGSTOP, and wait until every thread has stopped: ``kill`` returns before (found
    on a loaded machine: a request sent at once was still answered)."""
    os.kill(pid, signal.SIGSTOP)
    tasks = Path(f"/proc/{pid}/task")
    while not all(
        (task / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
        for task in tasks.iterdir()
    ):
        time.sleep(0.001)


def test_a_server_that_stops_answering_fails_the_step_at_the_socket_timeout(
    tmp_path: Path,
) -> None:
    """A paused server fails the step at the socket timeout with ``StoreError``, whose
    cause says that memcached did not answer in time (not Python's bare "timed out"),
    and the connection it left out of step is not used again."""
    with (
        MemcachedServer(tmp_path).start() as server,
        keymutex.Locks(server.url, namespace=uuid.uuid4().hex[:8], socket_timeout=0.5) as locks,
    ):
        locks.acquire("warm", timeout=0).release()  # a pooled connection, reused below
        _stop(server.process.pid)
        try:
            with pytest.raises(keymutex.StoreError) as caught:
                locks.acquire("k", timeout=0)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert isinstance(caught.value.__cause__, TimeoutError)
        assert "did not answer in time" in str(caught.value.__cause__)
        # The paused server answers the lost request late; a step on another
        # connection is not confused by it.
        with locks.lock("k2", timeout=2, renew=False) as lease:
            assert locks.holder("k2") == locks_holder(locks, lease)


def test_a_paused_server_does_not_hold_up_the_renewals_of_leases_shorter_than_its_timeout(
    tmp_path: Path,
) -> None:
    """Found by review: a batch renewal asked the servers one after the other, so one
    paused server held every other server's renewals up for its ``socket_timeout`` (5 s
    by default), and a lease of TTL 3 s on a server that answered was lost. Each
    server's share now goes at once, and is waited for a third of the shortest TTL."""
    with (
        MemcachedServer(tmp_path / "one").start() as one,
        MemcachedServer(tmp_path / "two").start() as two,
    ):
        url = f"memcached://127.0.0.1:{one.port},127.0.0.1:{two.port}"
        with keymutex.Locks(url, namespace=uuid.uuid4().hex[:8]) as locks:  # timeout 5 s
            layout = locks._store._layout  # type: ignore[attr-defined]
            keys = [f"k{i}" for i in range(60)]
            on_one = next(
                k for k in keys if layout.server_of(layout.lease(k)).endswith(f":{one.port}")
            )
            on_two = next(
                k for k in keys if layout.server_of(layout.lease(k)).endswith(f":{two.port}")
            )
            healthy = locks.acquire(on_one, ttl=3, renew=True)
            doomed = locks.acquire(on_two, ttl=3, renew=True)
            os.kill(two.process.pid, signal.SIGSTOP)
            try:
                time.sleep(7.0)  # past the doomed lease's deadline, and two timeouts more
            finally:
                os.kill(two.process.pid, signal.SIGCONT)
            assert doomed.lost
            assert not healthy.lost  # its server answered every time
            assert locks.holder(on_one) == locks_holder(locks, healthy)
            healthy.release()


# -- pure parts ------------------------------------------------------------------------


def test_records_round_trip_and_garbage_is_refused() -> None:
    record = Record("k", "t" * 24, "me", {"n": "é"}, 7, 1.5, 31.5)
    assert decode(record.encode()) == record
    # A grant's record names the epoch its fence counts from: + the item's CAS.
    fresh = replace(record, fence=None, epoch=1000)
    assert json.loads(fresh.encode())[5] == [1000]
    assert decode(fresh.encode(), "name", epoch=900, cas=12) == replace(record, fence=1012)
    assert decode(record.encode(), "name", epoch=900, cas=12) == record  # a written fence wins
    # One of an earlier version names no epoch: the reader's own.
    legacy = replace(record, fence=None)
    assert json.loads(legacy.encode())[5] is None
    assert decode(legacy.encode(), "name", epoch=900, cas=12) == replace(record, fence=912)
    assert decode(b'["L","k","t","o",null,3,1,2]') == Record("k", "t", "o", None, 3, 1.0, 2.0)
    queue = (Place("w1", 10.5), Place("w2", 11.0))
    queued = Record("k", "t" * 24, "me", None, 7, 1.5, 31.5, queue)
    assert decode(queued.encode()) == queued
    kept = Tombstone(queue, "w1", 12.25)
    assert decode(kept.encode()) == kept
    assert len(json.loads(record.encode())) == 8  # no queue, no field for it
    for garbage in (
        b"",
        b"x",
        b"[]",
        b"{}",
        b'["L",1]',
        b'["T",9]',
        b'["T",[],7,1]',
        b'["T",[[1,2]],null,1]',
        b'["L","k","t","o",[],3,1,2]',
        b'["L","k","t","o",null,null,1,2]',  # no fence, and none to resolve it
        b'["L","k","t","o",null,[1],1,2]',  # an epoch, and no CAS to add to it
        b'["L","k","t","o",null,["1"],1,2]',
        b'["L","k","t","o",null,[1,2],1,2]',
        b'["L","k","t","o",null,3,1,2,[["w",true]]]',
        b'["L","k","t","o",null,3,1,2,[["w"]]]',
        b'["L","k","t","o",null,3,1,2,[],[]]',
    ):
        with pytest.raises(keymutex.StoreError):
            decode(garbage, "name")


def test_places_are_kept_refreshed_and_dropped_when_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    now = 1000.0
    fresh = Place("a", now - 0.1)
    old = Place("b", now - 1.0)  # older than REFRESH_SECONDS, not yet gone
    gone = Place("c", now - 60)
    assert rejoined((fresh, old), "a", now) is None  # fresh: nothing to write
    assert rejoined((gone, old, fresh), "b", now) == (Place("b", now), fresh)
    assert rejoined((fresh,), "new", now) == (fresh, Place("new", now))
    monkeypatch.setattr(memcached, "QUEUE_LIMIT", 1)
    assert rejoined((fresh,), "new", now) is None  # full
    assert handed_over((gone, old, fresh), now) == Tombstone(
        (old, fresh), "b", now + HANDOVER_SECONDS
    )
    assert handed_over((gone,), now) is None  # nobody waits: delete
    kept = handed_over((fresh,), now)
    assert kept_for(kept, now + HANDOVER_SECONDS - 0.01) == "a"
    assert kept_for(kept, now + HANDOVER_SECONDS) is None  # then anyone may take it
    assert kept_for(Tombstone((fresh,)), now) is None
    assert REFRESH_SECONDS < memcached.GONE_SECONDS < TOMBSTONE_SECONDS
    assert HANDOVER_SECONDS < TOMBSTONE_SECONDS


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0.001, 4),
        (0.3, 4),
        (1.0, 4),
        (1.01, 5),
        (30.0, 33),
        (30 * 86400 - 3, 30 * 86400),
        (30 * 86400 - 2, 0),
    ],
)
def test_exptime_never_cuts_a_lease_short(seconds: float, expected: int) -> None:
    assert exptime(seconds) == expected


def test_item_names_fit_memcached_and_never_collide() -> None:
    layout = Layout("a", ["h:1"])
    assert layout.lease("b:c") != Layout("a:b", ["h:1"]).lease("c")
    long = Layout("n" * 256, ["h:1"]).lease("🔒" * 256)
    for name in (long, *layout.shards["h:1"].buckets, memcached.EPOCH_ITEM):
        assert name.isascii()
        assert len(name) < 250
        assert " " not in name
    assert len(set(layout.shards["h:1"].buckets)) == INDEX_BUCKETS


@pytest.mark.parametrize(
    ("url", "servers"),
    [
        ("memcached://cache", ("cache:11211",)),
        ("memcached://cache:11212/", ("cache:11212",)),
        ("memcached://a:1,b:2", ("a:1", "b:2")),
        ("memcached://[::1]:11212,[::1]", ("[::1]:11212", "[::1]:11211")),
        ("memcached:///run/memcached.sock", ("/run/memcached.sock",)),
    ],
)
def test_urls(url: str, servers: tuple[str, ...]) -> None:
    assert parse(url, {}).servers == servers


def test_a_percent_encoded_server_list_is_named_as_such() -> None:
    with pytest.raises(ValueError, match="not percent-encoded, and separate servers with ','"):
        parse("memcached://127.0.0.1:11211%2c127.0.0.1:1", {})


@pytest.mark.parametrize(
    ("url", "options", "error"),
    [
        ("memcached://u:p@host", {}, ValueError),
        ("memcached://host?timeout=1", {}, ValueError),
        ("memcached://host/0", {}, ValueError),
        ("memcached://", {}, ValueError),
        ("memcached://host:x", {}, ValueError),
        ("memcached://::1", {}, ValueError),
        ("memcached://a:1,a:1", {}, ValueError),
        ("memcached://a:1%2cb:2", {}, ValueError),
        ("memcached://host", {"timeout": 1}, TypeError),
        ("memcached://host", {"socket_timeout": 0}, ValueError),
        ("memcached://host", {"socket_timeout": True}, TypeError),
        ("memcached://host", {"max_connections": 0}, ValueError),
        ("memcached://host", {"patience": -1}, ValueError),
        ("memcached://host", {"patience": "1"}, TypeError),
    ],
)
def test_bad_urls_and_options(
    url: str, options: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        parse(url, options)
    with pytest.raises(error):
        keymutex.Locks(url, **options)


def test_a_store_forgets_its_oldest_writes_while_other_threads_write(
    memcached_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: once a store remembered ``OWN_WRITES_KEPT`` writes (leases
    granted here and released elsewhere by token), each grant forgot the oldest with
    ``next(iter(…))``; another thread of the same ``Locks`` granting in between made it
    raise RuntimeError, out of an acquire whose grant was written: the key stayed held
    by nobody for its TTL. Here another thread's grant lands at that very moment."""

    class Meddled(collections.OrderedDict[str, Any]):
        def __iter__(self) -> Iterator[str]:
            iterating = super().__iter__()
            self[f"another thread's grant {len(self)}"] = None
            return iterating

    monkeypatch.setattr(memcached, "OWN_WRITES_KEPT", 2)
    here = keymutex.Locks(memcached_url, namespace=namespace, ttl=60)
    elsewhere = keymutex.Locks(memcached_url, namespace=namespace, ttl=60)
    try:
        here._store._written = Meddled()  # type: ignore[attr-defined]
        for turn in range(4):
            lease = here.acquire(f"doc:{turn}", timeout=0)
            elsewhere.release(lease.key, lease.token)
        assert len(here._store._written) <= 2  # type: ignore[attr-defined]
    finally:
        here.close()
        elsewhere.close()


@pytest.mark.parametrize(
    "sent",
    [b"VA x c1\r\n", b"VA\r\n", b"HD c\xff\r\n"],
)
def test_a_malformed_reply_is_a_protocol_error(sent: bytes) -> None:
    """Found by review: a reply memcached would never send (a proxy's, or a stream out of
    step) came out of a step as ValueError or IndexError, not as StoreError."""
    mine, server = socket.socketpair()
    connection = Connection(mine)
    try:
        server.sendall(sent)
        with pytest.raises(memcached.ProtocolError):
            connection.reply()
    finally:
        connection.close()
        server.close()


def test_a_reply_without_the_number_asked_for_is_a_protocol_error() -> None:
    reply = memcached.Reply(b"HD", {}, None, b"HD")
    with pytest.raises(memcached.ProtocolError):
        _ = reply.cas
    with pytest.raises(memcached.ProtocolError):
        _ = memcached.Reply(b"VA", {"t": "x"}, b"", b"VA 0 tx").seconds_left


def test_a_lease_granted_as_another_client_makes_its_bucket_is_listed(
    memcached_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: our append found no index bucket; another client made it before
    our own make of it, which was refused; compacting the bucket then found only live
    entries, took it for full, and our lease was never listed by ``holders()`` (48
    clients granted at once in a new namespace: up to ten of them unlisted)."""
    store = open_store(memcached_url, namespace)
    other = open_store(memcached_url, namespace)
    layout = store._layout
    bucket_of = {key: layout.listing(layout.lease(key))[0] for key in map(str, range(200))}
    ours = "0"
    theirs = next(k for k, b in bucket_of.items() if k != ours and b == bucket_of[ours])
    index = store._index

    def another_client_makes_the_bucket(session: Session, name: str, appended: Any) -> None:
        assert acquire(other, theirs, TOKEN_B).ok  # its grant makes the bucket, listed
        index(session, name, appended)

    monkeypatch.setattr(store, "_index", another_client_makes_the_bucket)
    try:
        assert acquire(store, ours, TOKEN_A).ok
        assert sorted(h.key for h in store.holders("")) == sorted([ours, theirs])
    finally:
        store.close()
        other.close()


def test_an_acquire_retried_for_its_own_lease_lists_it_again(
    memcached_url: str, namespace: str, raw: Client
) -> None:
    """A grant whose reply was lost, asked for again with the same token (the lock
    server's clients do), is answered "ours already". A waiter's grant is listed by a
    write after it, which may have been lost with the reply: the lease was then never
    listed by ``holders()``. Here its listing is gone when it is asked again."""
    store = open_store(memcached_url, namespace)
    try:
        assert acquire(store, "doc", TOKEN_A).ok
        raw.delete(store._layout.listing(store._layout.lease("doc"))[0])  # the listing lost
        assert store.holders("") == []
        assert acquire(store, "doc", TOKEN_A).ok  # ours already
        assert [h.key for h in store.holders("")] == ["doc"]
    finally:
        store.close()


def test_a_step_fails_at_the_socket_timeout_while_the_process_gets_signals(
    tmp_path: Path,
) -> None:
    """A signal every 0.1 s (a timer, SIGCHLD from children, a sampling profiler) must not
    restart the socket timeout: the step fails within ``socket_timeout``, not never."""
    with (
        MemcachedServer(tmp_path).start() as server,
        keymutex.Locks(server.url, namespace=uuid.uuid4().hex[:8], socket_timeout=0.5) as locks,
    ):
        locks.acquire("warm", timeout=0).release()
        previous = signal.signal(signal.SIGALRM, lambda *_: None)
        _stop(server.process.pid)
        # The signals end after 5 s at the latest, whatever the step does.
        ender = threading.Timer(5.0, signal.setitimer, (signal.ITIMER_REAL, 0))
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.1, 0.1)
            ender.start()
            started = time.monotonic()
            with pytest.raises(keymutex.StoreError):
                locks.acquire("k", timeout=0)
            took = time.monotonic() - started
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            ender.cancel()
            signal.signal(signal.SIGALRM, previous)
            os.kill(server.process.pid, signal.SIGCONT)
        assert took < 2.0

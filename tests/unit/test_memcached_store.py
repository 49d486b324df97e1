"""What the memcached store promises beyond the conformance suite, and what it does not.

Against real memcached processes: the session's ``memcached_server``, or servers a test
starts for itself when it restarts, fills or kills one. Races are made deterministic
by wrapping the store's own pymemcache client so that another client writes between
its ``gets`` and its ``cas`` — the server itself is never imitated.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pymemcache.client.base import Client

import keymutex
from _memcached_fixtures import MemcachedServer
from keymutex.stores import memcached
from keymutex.stores.memcached import (
    INDEX_BUCKETS,
    RACE_ATTEMPTS,
    Layout,
    MemcachedStore,
    Record,
    Tombstone,
    decode,
    exptime,
    parse,
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


def open_store(url: str, namespace: str) -> MemcachedStore:
    return memcached.driver.open(url, namespace=namespace, options={})


class Interleaved:
    """The store's own client, with ``between`` run after its ``gets`` of one item.

    ``between`` plays another client that writes the item after we read it and before
    we ``cas`` it: the race the store must survive. Everything else goes straight through.
    """

    def __init__(self, inner: Any, name: str, between: Callable[[], None], times: int) -> None:
        self._inner = inner
        self._name = name
        self._between = between
        self._times = times
        self.gets_calls = 0

    def gets(self, name: str) -> Any:
        reply = self._inner.gets(name)
        self._after_read([name])
        return reply

    def gets_many(self, names: list[str]) -> Any:
        reply = self._inner.gets_many(names)
        self._after_read(names)
        return reply

    def _after_read(self, names: list[str]) -> None:
        if self._name in names:
            self.gets_calls += 1
            if self._times > 0:
                self._times -= 1
                self._between()

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._inner, attribute)


def interleave(
    store: MemcachedStore, key: str, between: Callable[[], None], times: int = 1
) -> Interleaved:
    name = store._layout.lease(key)
    server = store._layout.server_of(name)
    wrapped = Interleaved(store._clients[server], name, between, times)
    store._clients[server] = wrapped
    return wrapped


def acquire(store: MemcachedStore, key: str, token: str, ttl: float = 30.0, **kw: Any) -> Any:
    return store.try_acquire(
        key, token=token, ttl=ttl, owner="o", info=None, steal=kw.get("steal", False), waiter=None
    )


# -- races ---------------------------------------------------------------------------


def test_release_never_removes_the_lock_that_replaced_ours(
    memcached_url: str, namespace: str
) -> None:
    ours, theirs = open_store(memcached_url, namespace), open_store(memcached_url, namespace)
    try:
        assert acquire(ours, "doc", TOKEN_A).ok
        # Between our gets and our write, someone takes the key over (a steal here; an
        # expiry followed by an acquire is the same race). A gets-then-delete would now
        # delete *their* lock.
        wrapped = interleave(ours, "doc", lambda: acquire(theirs, "doc", TOKEN_B, steal=True))
        released = ours.release("doc", TOKEN_A)
        assert released.ok is False
        assert released.holder is not None
        assert released.holder.owner == "o"
        assert wrapped.gets_calls == 2  # the lost cas was noticed and the item read again
        current = theirs.holder("doc")
        assert current is not None
        assert current.fence == released.holder.fence
        assert theirs.renew("doc", TOKEN_B, 30.0).ok
        assert theirs.release("doc", TOKEN_B).ok
    finally:
        ours.close()
        theirs.close()


def test_a_lost_race_on_an_expired_lease_is_retried_and_decided_afresh(
    memcached_url: str, namespace: str
) -> None:
    first, second, third = (open_store(memcached_url, namespace) for _ in range(3))
    try:
        old = acquire(first, "job", "C" * 24, ttl=0.2)
        time.sleep(0.3)  # expired by its record; memcached still keeps the item
        # While `second` replaces the expired lease, `third` gets there first.
        wrapped = interleave(second, "job", lambda: acquire(third, "job", TOKEN_B))
        outcome = acquire(second, "job", TOKEN_A)
        assert wrapped.gets_calls == 2
        assert outcome.ok is False  # the second read saw the third's live lease
        assert outcome.holder is not None
        assert outcome.holder.fence > old.holder.fence
        assert third.holder("job") == outcome.holder
    finally:
        for store in (first, second, third):
            store.close()


def test_lost_races_are_bounded(
    memcached_url: str, namespace: str, raw: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(memcached_url, namespace)
    try:
        assert acquire(store, "hot", TOKEN_A, ttl=0.2).ok
        name = store._layout.lease("hot")
        value = raw.get(name)
        time.sleep(0.3)

        def rewrite() -> None:  # another client writes the item after every read of ours
            raw.set(name, value, expire=5)

        wrapped = interleave(store, "hot", rewrite, times=10 * RACE_ATTEMPTS)
        refused = acquire(store, "hot", TOKEN_B)
        assert refused.ok is False
        assert wrapped.gets_calls == RACE_ATTEMPTS

        wrapped.gets_calls = 0
        with pytest.raises(keymutex.StoreError, match="lost 8 races"):
            store.release("hot", TOKEN_A)
        assert wrapped.gets_calls == RACE_ATTEMPTS
        raw.set(name, value, expire=5)
        wrapped.gets_calls = 0
        # Renewal: the rewritten record is live again for a moment, and ours.
        fresh = json.loads(value)
        fresh[7] = time.time() + 30
        value = json.dumps(fresh).encode()
        raw.set(name, value, expire=5)
        with pytest.raises(keymutex.StoreError, match="lost 8 races"):
            store.renew("hot", TOKEN_A, 30.0)
        assert wrapped.gets_calls == RACE_ATTEMPTS
    finally:
        store.close()


def test_a_grant_always_describes_its_lease_even_when_its_ttl_ran_out_in_transit(
    memcached_url: str, namespace: str
) -> None:
    # A TTL shorter than the round trips: the reply still carries the holder (and the
    # client's own deadline, counted from before the request, has passed already).
    store = open_store(memcached_url, namespace)
    try:
        granted = acquire(store, "blink", TOKEN_A, ttl=1e-6)
        assert granted.ok
        assert granted.holder is not None
        assert granted.remaining == pytest.approx(1e-6, abs=1e-5)
        assert acquire(store, "blink", TOKEN_B).ok  # and it is expired for everyone
        renewed = store.renew("blink", TOKEN_B, 1e-6)
        assert renewed.ok
        assert renewed.holder is not None
    finally:
        store.close()


# -- fences --------------------------------------------------------------------------


def test_fences_increase_and_start_from_the_clock(memcached_url: str, namespace: str) -> None:
    before = time.time_ns() // 1000
    one, two = open_store(memcached_url, namespace), open_store(memcached_url, namespace)
    try:
        fences = []
        for round_ in range(20):
            store = one if round_ % 2 else two
            token = f"{round_:024d}"
            outcome = acquire(store, "row", token, steal=round_ % 3 == 0)
            assert outcome.ok
            fences.append(outcome.holder.fence)
            if round_ % 3 != 2:
                assert store.release("row", token).ok
        assert all(a < b for a, b in itertools.pairwise(fences)), fences
        # The counter was created from the wall clock in microseconds.
        assert before <= fences[0] <= time.time_ns() // 1000 + 1
    finally:
        one.close()
        two.close()


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
            # The counter was recreated from the clock: fences still went up...
            assert taken.fence > lease.fence
            with pytest.raises(keymutex.LockLost):
                lease.renew()

            # ... but only because the clock did. With the clock set back (here: the
            # seed), a restart hands out a fence smaller than one granted before.
            monkeypatch.setattr(memcached, "fence_seed", lambda: 1000)
            server.restart()
            again = other.acquire("doc", timeout=0)
            assert again.fence < taken.fence
            assert again.fence == 1001
        finally:
            holder.close()
            other.close()


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
                Record("doc", lease.token, lease.owner, lease.info, lease.fence,
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


def test_a_foreign_item_is_a_store_error(memcached_url: str, namespace: str, raw: Client) -> None:
    store = open_store(memcached_url, namespace)
    try:
        raw.set(store._layout.lease("doc"), b"somebody else's", expire=5)
        with pytest.raises(keymutex.StoreError, match="does not hold a keymutex lease"):
            acquire(store, "doc", TOKEN_A)
    finally:
        store.close()


# -- round trips ---------------------------------------------------------------------


def _counts(server: MemcachedServer) -> dict[str, int]:
    stats = server.stats()
    names = ("cmd_get", "cmd_set", "incr_hits", "incr_misses", "delete_hits", "delete_misses")
    return {name: int(stats[name]) for name in names}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in after if after[name] != before[name]}


def test_round_trips_of_each_step(
    memcached_server: MemcachedServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memcached, "COMPACT_EVERY", 10**30)  # no compaction in between
    store = open_store(memcached_server.url, namespace)
    try:
        assert acquire(store, "doc", "W" * 24).ok  # creates the counter and the index bucket
        assert store.release("doc", "W" * 24).ok
        before = _counts(memcached_server)
        assert acquire(store, "doc", TOKEN_A).ok
        assert _delta(before, after := _counts(memcached_server)) == {
            "cmd_get": 1,  # gets (the tombstone)
            "incr_hits": 1,  # the fence
            "cmd_set": 2,  # cas, append to the index
        }
        assert acquire(store, "doc", TOKEN_B).ok is False
        assert _delta(after, after2 := _counts(memcached_server)) == {"cmd_get": 1}
        assert store.renew("doc", TOKEN_A, 30).ok
        assert _delta(after2, after3 := _counts(memcached_server)) == {"cmd_get": 1, "cmd_set": 1}
        assert store.release("doc", TOKEN_A).ok
        # gets + cas to a tombstone: never a delete.
        assert _delta(after3, _counts(memcached_server)) == {"cmd_get": 1, "cmd_set": 1}
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
            for shard in layout.shards.values():  # counter and index live on their server
                assert layout.server_of(shard.counter) == shard.server
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


# -- pure parts ------------------------------------------------------------------------


def test_records_round_trip_and_garbage_is_refused() -> None:
    record = Record("k", "t" * 24, "me", {"n": "é"}, 7, 1.5, 31.5)
    assert decode(record.encode()) == record
    assert decode(Tombstone(9).encode()) == Tombstone(9)
    assert decode(b'["L","k","t","o",null,3,1,2]') == Record("k", "t", "o", None, 3, 1.0, 2.0)
    for garbage in (
        b"",
        b"x",
        b"[]",
        b"{}",
        b'["L",1]',
        b'["T","9"]',
        b'["L","k","t","o",[],3,1,2]',
    ):
        with pytest.raises(keymutex.StoreError):
            decode(garbage, "name")


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0.001, 2),
        (0.3, 2),
        (1.0, 2),
        (1.01, 3),
        (30.0, 31),
        (30 * 86400 - 1, 30 * 86400),
        (30 * 86400, 0),
    ],
)
def test_exptime_never_cuts_a_lease_short(seconds: float, expected: int) -> None:
    assert exptime(seconds) == expected


def test_item_names_fit_memcached_and_never_collide() -> None:
    layout = Layout("a", ["h:1"])
    assert layout.lease("b:c") != Layout("a:b", ["h:1"]).lease("c")
    long = Layout("n" * 256, ["h:1"]).lease("🔒" * 256)
    for name in (long, *layout.shards["h:1"].buckets, layout.shards["h:1"].counter):
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
        ("memcached://host", {"timeout": 1}, TypeError),
        ("memcached://host", {"socket_timeout": 0}, ValueError),
        ("memcached://host", {"socket_timeout": True}, TypeError),
        ("memcached://host", {"max_connections": 0}, ValueError),
    ],
)
def test_bad_urls_and_options(
    url: str, options: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        parse(url, options)
    with pytest.raises(error):
        keymutex.Locks(url, **options)

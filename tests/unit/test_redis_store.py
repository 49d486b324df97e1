"""What the Redis store promises beyond the conformance suite: round trips, residue,
script reloading, shared subscriptions, no barging, key layout and URL checks.

Against a real redis-server (the session's ``redis_url``); each test has a namespace
of its own, so tests never see each other's keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

import keymutex
from _processes import free_port
from _redis_servers import RedisCluster, RedisServer
from keymutex import _clock as clock
from keymutex._store import RenewRequest
from keymutex.stores.redis import RedisStore
from safety._tools.proxy import Proxy


@pytest.fixture
def server(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def namespace() -> str:
    return f"unit-{uuid.uuid4().hex}"


def _commands(server: redis.Redis) -> dict[str, int]:
    stats = server.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


# What the scripts call inside Redis: counted by INFO commandstats, but no round trip.
SCRIPT_INTERNAL = frozenset(
    {
        *("hmget", "hget", "hset", "pttl", "incr", "del", "pexpire"),
        *("lpos", "rpush", "lpop", "lrem", "publish", "spublish"),
    }
)


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Commands the clients sent (not counting our own INFO calls) between two readings."""
    changed = {name: after[name] - before.get(name, 0) for name in after}
    return {
        name: n
        for name, n in changed.items()
        if n and name != "info" and name not in SCRIPT_INTERNAL
    }


def test_each_step_is_one_script_call(server: redis.Redis, redis_url: str, namespace: str) -> None:
    with keymutex.Locks(redis_url, namespace=namespace) as locks:
        locks.holder("warm-up")  # the connection's own set-up is not a step
        warm_up = locks.acquire("warm-up", timeout=0)
        warm_up.renew()
        warm_up.release()  # every script is loaded now
        steps = {}
        before = _commands(server)
        lease = locks.acquire("k", timeout=0)
        steps["acquire"] = _delta(before, before := _commands(server))
        lease.renew()
        steps["renew"] = _delta(before, before := _commands(server))
        lease.release()
        steps["release"] = _delta(before, _commands(server))
    assert steps == {"acquire": {"evalsha": 1}, "renew": {"evalsha": 1}, "release": {"evalsha": 1}}


def test_renewals_of_many_leases_go_in_one_pipeline(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    with keymutex.Locks(redis_url, namespace=namespace, ttl=30) as locks:
        store = locks._store
        assert isinstance(store, RedisStore)
        leases = [locks.acquire(f"k{i}", timeout=0) for i in range(50)]
        requests = [RenewRequest(lease.key, lease.token, 30.0) for lease in leases]
        store.renew_many(requests[:1])  # the pipeline's connection is set up
        clients_before = int(server.info("stats")["total_connections_received"])
        before = _commands(server)
        outcomes = store.renew_many(requests)
        assert _delta(before, _commands(server)) == {"evalsha": 50}
        assert int(server.info("stats")["total_connections_received"]) == clients_before
        assert all(outcome.ok for outcome in outcomes)
        for lease in leases:
            lease.release()


def test_a_lease_key_holding_something_else_does_not_fail_the_batch(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    """One key overwritten by other data (WRONGTYPE in the script) failed the whole
    batch: no lease of the Locks was renewed until every one was lost."""
    with keymutex.Locks(redis_url, namespace=namespace, ttl=30) as locks:
        store = locks._store
        assert isinstance(store, RedisStore)
        kept, clobbered = locks.acquire("kept", timeout=0), locks.acquire("clobbered", timeout=0)
        name = store._layout.lease("clobbered")
        server.delete(name)
        server.set(name, "someone else's data")
        outcomes = store.renew_many(
            [RenewRequest(x.key, x.token, 30.0) for x in (kept, clobbered)]
        )
        assert [outcome.ok for outcome in outcomes] == [True, False]
        with pytest.raises(keymutex.LockLost):  # one renewal alone says so too
            clobbered.renew()
        server.delete(name)
        kept.release()


def test_released_and_expired_leases_leave_nothing_behind(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    with keymutex.Locks(redis_url, namespace=namespace) as locks:
        locks.acquire("first", timeout=0).release()  # the fence counter exists from now on
        names_before = set(server.scan_iter(match="km:*"))
        for i in range(200):
            locks.acquire(f"key-{i}", timeout=0).release()
        for i in range(20):
            locks.acquire(f"short-{i}", ttl=0.05, timeout=0)
        time.sleep(0.2)
        assert set(server.scan_iter(match="km:*")) == names_before


def test_a_flushed_script_cache_is_reloaded(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    with keymutex.Locks(redis_url, namespace=namespace) as locks:
        locks.acquire("k", timeout=0).release()
        server.script_flush()
        lease = locks.acquire("k", timeout=0)
        server.script_flush()
        lease.renew()
        server.script_flush()
        store = locks._store  # the background renewer's batch, loaded again too
        (renewed,) = store.renew_many([RenewRequest("k", lease.token, 30.0)])  # type: ignore[attr-defined]
        assert renewed.ok
        server.script_flush()
        lease.release()
        assert locks.holder("k") is None


def test_waiters_of_one_locks_share_one_subscription(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    with (
        keymutex.Locks(redis_url, namespace=namespace) as holder,
        keymutex.Locks(redis_url, namespace=namespace, client_name=namespace) as waiting,
    ):
        leases = [holder.acquire(f"k{i}", timeout=0) for i in range(8)]
        got: list[int] = []
        threads = [
            threading.Thread(target=lambda i=i: got.append(waiting.acquire(f"k{i}").fence))
            for i in range(8)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        # One channel for all the waiters of a Locks (in this process), whatever the key.
        layout = waiting._store._layout  # type: ignore[attr-defined]
        channels = sorted({layout.channel(f"k{i}") for i in range(8)})
        assert len(channels) == 1
        while time.monotonic() < deadline:
            counts = server.pubsub_numsub(*channels)
            if all(n == 1 for _, n in counts):
                break
            time.sleep(0.01)
        # The waiting Locks's own connections (others of the session may linger).
        pubsub_clients = [
            c for c in server.client_list() if c["name"] == namespace and int(c["sub"]) > 0
        ]
        assert {n for _, n in server.pubsub_numsub(*channels)} == {1}
        assert len(pubsub_clients) == 1
        for lease in leases:
            lease.release()
        for thread in threads:
            thread.join(10)
        assert len(got) == 8


def test_a_releaser_cannot_barge_ahead_of_the_waiter_it_woke(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    with (
        keymutex.Locks(redis_url, namespace=namespace) as first,
        keymutex.Locks(redis_url, namespace=namespace) as second,
    ):
        lease = first.acquire("k", timeout=0)
        got = threading.Event()
        waiter = threading.Thread(target=lambda: (second.acquire("k", timeout=10), got.set()))
        waiter.start()
        # The waiter has been refused and queued.
        deadline = time.monotonic() + 10
        queue = first._store._layout.queue("k")  # type: ignore[attr-defined]
        while server.llen(queue) != 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        lease.release()
        with pytest.raises(keymutex.Locked):
            first.acquire("k", timeout=0)
        waiter.join(10)
        assert got.is_set()


def test_namespace_and_key_never_run_into_each_other(redis_url: str) -> None:
    suffix = uuid.uuid4().hex
    with (
        keymutex.Locks(redis_url, namespace=f"a:b{suffix}") as one,
        keymutex.Locks(redis_url, namespace="a") as other,
    ):
        lease = one.acquire("c", timeout=0)
        # Same characters once joined with ':', but another namespace and key.
        other.acquire(f"b{suffix}:c", timeout=0).release()
        assert [h.key for h in one.holders()] == ["c"]
        lease.release()


def test_holders_treats_glob_characters_in_a_prefix_literally(
    redis_url: str, namespace: str
) -> None:
    with keymutex.Locks(redis_url, namespace=namespace) as locks:
        for key in ["a*b", "a*c", "axb", "[x]", "q?"]:
            locks.acquire(key, timeout=0)
        assert [h.key for h in locks.holders("a*")] == ["a*b", "a*c"]
        assert [h.key for h in locks.holders("[")] == ["[x]"]
        assert [h.key for h in locks.holders("q?")] == ["q?"]
        assert len(locks.holders()) == 5


@pytest.mark.asyncio
async def test_async_steps_are_one_script_call_each(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    async with keymutex.AsyncLocks(redis_url, namespace=namespace) as locks:
        warm_up = await locks.acquire("warm-up", timeout=0)
        await warm_up.renew()
        await warm_up.release()
        before = _commands(server)
        lease = await locks.acquire("k", timeout=0)
        await lease.renew()
        await lease.release()
        assert _delta(before, _commands(server)) == {"evalsha": 3}


@pytest.mark.asyncio
@pytest.mark.usefixtures("no_rechecks")
async def test_async_waiters_are_woken_by_release(redis_url: str, namespace: str) -> None:
    async with (
        keymutex.AsyncLocks(redis_url, namespace=namespace) as one,
        keymutex.AsyncLocks(redis_url, namespace=namespace) as two,
    ):
        lease = await one.acquire("k", timeout=0)
        waiter = asyncio.ensure_future(two.acquire("k", timeout=10))
        await asyncio.sleep(0.05)
        released_at = time.monotonic()
        await lease.release()
        granted = await waiter
        # Woken by the release: its recheck is a minute away (no_rechecks).
        assert time.monotonic() - released_at < 5.0
        assert granted.fence > lease.fence
        await granted.release()


def _wait_for_subscribers(server: redis.Redis, channel: str, wanted: int) -> int:
    deadline = time.monotonic() + 10
    while True:
        ((_, count),) = server.pubsub_numsub(channel)
        if count == wanted or time.monotonic() > deadline:
            return int(count)
        time.sleep(0.02)


def test_a_channel_nobody_waits_on_is_unsubscribed_after_lingering(
    server: redis.Redis, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("keymutex.stores.redis.LINGER", 0.3)
    with (
        keymutex.Locks(redis_url, namespace=namespace) as holder,
        keymutex.Locks(redis_url, namespace=namespace) as waiting,
    ):
        channel = waiting._store._layout.channel("k")  # type: ignore[attr-defined]
        for _ in range(2):  # and subscribed again by the next waiter
            lease = holder.acquire("k", timeout=0)
            got = threading.Thread(target=lambda: waiting.acquire("k", timeout=10).release())
            got.start()
            assert _wait_for_subscribers(server, channel, 1) == 1
            lease.release()
            got.join(10)
            assert not got.is_alive()
            # Nobody waits any more: the tending thread drops the channel.
            assert _wait_for_subscribers(server, channel, 0) == 0


@pytest.mark.asyncio
async def test_async_a_channel_nobody_waits_on_is_unsubscribed_after_lingering(
    server: redis.Redis, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("keymutex.stores.redis.LINGER", 0.3)
    async with (
        keymutex.AsyncLocks(redis_url, namespace=namespace) as holder,
        keymutex.AsyncLocks(redis_url, namespace=namespace) as waiting,
    ):
        channel = waiting._store._layout.channel("k")  # type: ignore[attr-defined]
        for _ in range(2):
            lease = await holder.acquire("k", timeout=0)
            got = asyncio.ensure_future(waiting.acquire("k", timeout=10))
            count = await asyncio.to_thread(_wait_for_subscribers, server, channel, 1)
            assert count == 1
            await lease.release()
            await (await got).release()
            count = await asyncio.to_thread(_wait_for_subscribers, server, channel, 0)
            assert count == 0


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+cluster://127.0.0.1", "host:port"),
        ("redis+cluster://127.0.0.1:7000/3", "only database 0"),
        ("redis+sentinel://127.0.0.1:26379", "SERVICE"),
        ("redis+sentinel://127.0.0.1:26379/svc/x", "SERVICE"),
        ("redis+cluster://127.0.0.1:7000?password=x", "keyword arguments"),
        # redis-py would take db= over the path and write to database 2.
        ("redis://127.0.0.1:6379/1?db=2", r"database twice, in its path \(/1\) and as db="),
        ("rediss://127.0.0.1:6379/0?db=0", "database twice"),
        # Found by review: these failed only at the first command ("DB index is out of
        # range", "Connection refused" for an empty socket path).
        ("redis://127.0.0.1:6379?db=-5", "database must be a number from 0"),
        ("redis://127.0.0.1:6379/99999999999999999999", "database must be a number from 0"),
        ("unix:///run/redis.sock?db=-1", "database must be a number from 0"),
        ("unix://", "needs the socket's path"),
    ],
)
def test_malformed_urls_are_refused_before_connecting(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        keymutex.Locks(url)


def test_unknown_options_are_refused_with_the_accepted_ones() -> None:
    with pytest.raises(TypeError, match="socket_timeout"):
        keymutex.Locks("redis://127.0.0.1:1/0", sockettimeout=3)


def test_an_unreachable_cluster_fails_its_first_step_not_the_constructor() -> None:
    """redis-py's sync RedisCluster connects when made: the store makes it at first use."""
    url = f"redis+cluster://127.0.0.1:{free_port()}"  # nothing listens there
    with keymutex.Locks(url, socket_connect_timeout=1.0) as locks:
        for step in (
            lambda: locks.acquire("k", timeout=0),
            lambda: locks.holder("k"),
            lambda: locks.holders(""),
            lambda: locks.release("k", "t" * 24),
        ):
            with pytest.raises(keymutex.StoreError, match="Redis Cluster cannot be connected"):
                step()


def test_an_unreachable_cluster_is_a_store_error_for_async_clients_too() -> None:
    async def main() -> None:
        url = f"redis+cluster://127.0.0.1:{free_port()}"
        async with keymutex.AsyncLocks(url, socket_connect_timeout=1.0) as alocks:
            with pytest.raises(keymutex.StoreError, match="Redis Cluster cannot be connected"):
                await alocks.acquire("k", timeout=0)
            with pytest.raises(keymutex.StoreError):
                await alocks.holder("k")

    asyncio.run(main())


def test_url_query_options_that_redis_py_parses_are_accepted() -> None:
    url = "redis://127.0.0.1:1/2?socket_timeout=0.5&health_check_interval=10&client_name=me"
    keymutex.Locks(url).close()  # no connection is made until the first step


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:1?db=2", "redis://127.0.0.1:1/?db=2", "rediss://127.0.0.1:1/3"]
)
def test_a_database_given_once_as_db_is_accepted(url: str) -> None:
    keymutex.Locks(url).close()


def test_releases_hand_the_key_to_waiters_in_arrival_order(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    holder = keymutex.Locks(redis_url, namespace=namespace)
    waiting = [keymutex.Locks(redis_url, namespace=namespace) for _ in range(4)]
    queue = holder._store._layout.queue("k")  # type: ignore[attr-defined]
    order: list[int] = []
    try:
        lease = holder.acquire("k", timeout=0)

        def wait(number: int) -> None:
            with waiting[number].lock("k", timeout=20):
                order.append(number)
                time.sleep(0.01)

        threads = []
        for number in range(4):  # each one queued before the next arrives
            threads.append(threading.Thread(target=wait, args=(number,)))
            threads[-1].start()
            deadline = time.monotonic() + 10
            while server.llen(queue) != number + 1 and time.monotonic() < deadline:
                time.sleep(0.002)
        lease.release()
        for thread in threads:
            thread.join(20)
        assert order == [0, 1, 2, 3]
        assert server.exists(queue) == 0
    finally:
        for locks in [holder, *waiting]:
            locks.close()


def test_a_waiter_that_gives_up_leaves_the_queue(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    with (
        keymutex.Locks(redis_url, namespace=namespace) as holder,
        keymutex.Locks(redis_url, namespace=namespace) as waiting,
    ):
        lease = holder.acquire("k", timeout=0)
        with pytest.raises(keymutex.Locked):
            waiting.acquire("k", timeout=0.2)
        assert server.exists(holder._store._layout.queue("k")) == 0  # type: ignore[attr-defined]
        lease.release()
        # Nobody was handed the key: it is free at once.
        holder.acquire("k", timeout=0).release()


def test_a_process_that_keeps_contending_subscribes_once(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    with (
        keymutex.Locks(redis_url, namespace=namespace) as holder,
        keymutex.Locks(redis_url, namespace=namespace) as waiting,
    ):
        before = _commands(server)
        for _ in range(5):
            lease = holder.acquire("k", timeout=0)
            releaser = threading.Timer(0.05, lease.release)
            releaser.start()
            waiting.acquire("k", timeout=10).release()
            releaser.join()
        assert _delta(before, _commands(server)).get("subscribe") == 1


def test_a_retried_acquire_whose_first_reply_was_lost_gets_its_own_grant(
    redis_url: str, namespace: str
) -> None:
    with keymutex.Locks(redis_url, namespace=namespace) as locks:
        store = locks._store
        args = {"token": "t" * 22, "ttl": 5.0, "owner": "me", "info": None, "steal": False}
        first = store.try_acquire("k", waiter=None, **args)
        again = store.try_acquire("k", waiter=None, **args)  # as after a lost reply
        assert first.ok
        assert again.ok
        assert again.holder is not None
        assert first.holder is not None
        assert again.holder.fence == first.holder.fence
        other = store.try_acquire("k", waiter=None, **{**args, "token": "u" * 22})
        assert not other.ok


def test_a_connection_closed_by_the_server_is_replaced_without_an_error(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    with keymutex.Locks(redis_url, namespace=namespace, client_name="km-test-conn") as locks:
        locks.acquire("k", timeout=0).release()
        killed = server.client_kill_filter(_type="normal", skipme=True, laddr=None, user=None)
        assert killed >= 1
        locks.acquire("k", timeout=0).release()


def test_a_redis_that_is_down_fails_reads_and_renewals_at_once(
    tmp_path: Path, namespace: str
) -> None:
    """redis-py (6 and later) tries a command again up to ten times after a refused
    connection, with backoff, on a client made from host and port (over 4 s to fail):
    the store's clients send once, so a dead server is a ``StoreError`` at once, and
    the renewer's other leases do not wait for it. (A cluster's node clients: see
    ``test_a_dead_cluster_master_fails_its_own_renewals_alone_and_at_once``.)"""
    from _redis_servers import standalone

    with standalone(tmp_path) as own, keymutex.Locks(own.url, namespace=namespace) as locks:
        lease = locks.acquire("k", ttl=30)
        own.kill()
        store = locks._store
        for call in (
            lambda: locks.holder("k"),
            lambda: store.renew_many([RenewRequest("k", lease.token, 30.0)]),
        ):
            started = time.monotonic()
            with pytest.raises(keymutex.StoreError, match="refused"):
                call()
            took = time.monotonic() - started
            assert took < 2.0, f"{took:.1f} s to fail on a dead server"


@pytest.fixture
def two_locks(redis_url: str, namespace: str) -> Iterator[tuple[keymutex.Locks, keymutex.Locks]]:
    """A holder's and a waiter's ``Locks`` on one namespace."""
    with (
        keymutex.Locks(redis_url, namespace=namespace) as holder,
        keymutex.Locks(redis_url, namespace=namespace) as waiting,
    ):
        yield holder, waiting


def _queue_entry(token: str, channel: str, ttl_ms: int = 60_000) -> str:
    """A waiter's queue entry, as the store writes it (see the scripts)."""
    return json.dumps([token, ttl_ms, "ghost", "", channel], separators=(",", ":"))


def _wait_in_thread(
    server: redis.Redis, locks: keymutex.Locks, queued: int
) -> tuple[threading.Thread, list[keymutex.Lease]]:
    """A thread acquiring "k" with ``locks``, started, once the queue is ``queued`` long."""
    got: list[keymutex.Lease] = []
    thread = threading.Thread(target=lambda: got.append(locks.acquire("k", timeout=30)))
    thread.start()
    queue = locks._store._layout.queue("k")  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while server.llen(queue) != queued and time.monotonic() < deadline:
        time.sleep(0.002)
    return thread, got


def test_a_grant_nobody_hears_goes_to_the_next_waiter(
    server: redis.Redis, two_locks: tuple[keymutex.Locks, keymutex.Locks]
) -> None:
    holder, waiting = two_locks
    lease = holder.acquire("k", timeout=0)
    layout = holder._store._layout  # type: ignore[attr-defined]
    # First in line: a waiter whose process died (nobody listens on its channel).
    server.rpush(layout.queue("k"), _queue_entry("g" * 22, layout.bucket("k") + "w:gone"))
    thread, got = _wait_in_thread(server, waiting, queued=2)
    lease.release()
    thread.join(30)
    assert len(got) == 1
    # The live waiter holds the key, not the one that vanished (whose grant was
    # taken back at once: had it kept it, the waiter would have waited 60 s).
    found = holder.holder("k")
    assert found is not None
    assert found.fence == got[0].fence
    assert server.hget(layout.lease("k"), "t") == got[0].token
    assert server.exists(layout.queue("k")) == 0
    got[0].release()


def test_a_waiter_leaving_passes_on_a_key_granted_to_it(
    server: redis.Redis, two_locks: tuple[keymutex.Locks, keymutex.Locks]
) -> None:
    holder, waiting = two_locks
    lease = holder.acquire("k", timeout=0)
    store = holder._store  # type: ignore[attr-defined]
    layout = store._layout
    # A waiter that listens (so the release grants it the key) but gives up before
    # it takes the grant: its leave must hand the key on, not keep it.
    channel = layout.bucket("k") + "w:listening"
    entry = _queue_entry("l" * 22, channel)
    listener = server.pubsub()
    listener.subscribe(channel)
    assert listener.get_message(timeout=5) is not None  # the confirmation
    server.rpush(layout.queue("k"), entry)
    thread, got = _wait_in_thread(server, waiting, queued=2)
    lease.release()
    message = listener.get_message(timeout=5)
    assert message is not None
    assert message["data"].startswith("l" * 22 + ":")
    assert server.hget(layout.lease("k"), "t") == "l" * 22
    store._leave("k", "l" * 22, entry)
    thread.join(30)
    listener.close()
    assert len(got) == 1
    assert server.hget(layout.lease("k"), "t") == got[0].token
    assert got[0].fence > int(message["data"].split(":")[1])
    got[0].release()


def test_a_waiter_granted_by_a_release_takes_the_lease_without_a_round_trip(
    server: redis.Redis, two_locks: tuple[keymutex.Locks, keymutex.Locks]
) -> None:
    holder, waiting = two_locks
    holder.acquire("warm-up", timeout=0).release()  # the release script is loaded now
    lease = holder.acquire("k", timeout=0)
    thread, got = _wait_in_thread(server, waiting, queued=1)
    before = _commands(server)
    lease.release()
    thread.join(30)
    delta = _delta(before, _commands(server))
    assert len(got) == 1
    assert got[0].fence > lease.fence
    assert 0 < got[0].remaining <= 30
    # The release's script was the only one: the waiter, granted by it, sent
    # nothing more to take the lease.
    assert delta.get("evalsha") == 1
    found = waiting.holder("k")
    assert found is not None
    assert found.fence == got[0].fence
    got[0].release()


def test_a_grant_older_than_the_last_refusal_is_not_taken() -> None:
    from keymutex._lease import Holder, Outcome
    from keymutex.stores.redis import _Grantee

    waiter = _Grantee("channel")
    refusal = Outcome(False, Holder("k", "other", None, 7, 0.0, 0.0), 1.0)
    waiter.refused(refusal, sent_at=clock.monotonic())
    # A grant made before that refusal (fence below the refusing holder's): stale.
    waiter.granted = (6, 1000)
    assert waiter.take_grant("k", 10.0, "me", None) is None
    assert waiter.granted is None
    # One made after it: taken, counted from the refused request.
    waiter.granted = (8, 1000)
    outcome = waiter.take_grant("k", 10.0, "me", {"a": 1})
    assert outcome is not None
    assert outcome.ok
    assert outcome.holder is not None
    assert outcome.holder.fence == 8
    assert outcome.holder.info == {"a": 1}
    assert outcome.remaining is not None
    assert 9.0 < outcome.remaining < 10.0
    # Past the TTL, counted from the refusal: not taken (a real try will tell).
    waiter.refused(refusal, sent_at=clock.monotonic() - 11.0)
    waiter.granted = (9, 1000)
    assert waiter.take_grant("k", 10.0, "me", None) is None


# -- a server slower than the client's socket timeout ------------------------------------
#
# A Lua script that loops keeps Redis from serving anyone else for a while; then it
# serves what waited, including the commands of clients that gave up meanwhile. The
# client's read times out although Redis will run what it sent: the ambiguous failure
# these tests are about, on a real server.

BUSY_SCRIPT = """
local started = redis.call('TIME')
while true do
  local now = redis.call('TIME')
  if (now[1] - started[1]) * 1000000 + (now[2] - started[2]) > tonumber(ARGV[1]) then
    return 1
  end
end
"""
BUSY_FOR = 1.5  # seconds Redis serves nobody else: far more than the head start below
SLOW_TIMEOUT = 0.3  # a client that gives up before then
SLOW_CLIENT = f"socket_timeout={SLOW_TIMEOUT}"


def _slow_url(redis_url: str) -> str:
    return f"{redis_url}?{SLOW_CLIENT}"


@contextlib.contextmanager
def _busy(server: redis.Redis) -> Iterator[None]:
    """Keep Redis busy for ``BUSY_FOR`` s from now; the block's next command waits.

    The block starts once the script is sent (not once a thread to send it started: on
    a loaded machine a release went first, and did not time out), and a moment later,
    for Redis to have read it: it then serves nobody else until the script ends."""
    conn = server.connection_pool.get_connection()
    sent = threading.Event()

    def run() -> None:
        conn.send_command("EVAL", BUSY_SCRIPT, 0, int(BUSY_FOR * 1e6))
        sent.set()
        conn.read_response()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert sent.wait(10)
        # For Redis to have read it. Found in CI: after 0.05 s (Redis busy for 0.5 s) a
        # loaded machine's Redis had not, and served the block's release at once.
        time.sleep(0.3)
        yield
    finally:
        thread.join(30)
        server.connection_pool.release(conn)


@pytest.fixture(params=["single", "cluster"])
def slow_topology(
    request: pytest.FixtureRequest, redis_url: str, server: redis.Redis
) -> tuple[str, Callable[[str], redis.Redis]]:
    """A Redis URL, and the server that serves an item's name there (to keep busy)."""
    if request.param == "single":
        return redis_url, lambda name: server
    cluster: RedisCluster = request.getfixturevalue("redis_cluster")
    return cluster.url, lambda name: cluster.owner_of(name).client()


def test_a_release_that_timed_out_is_not_sent_again(
    slow_topology: tuple[str, Callable[[str], redis.Redis]], namespace: str
) -> None:
    """Sent again on a new connection, the release ran twice in Redis, and the second
    run, finding the lease gone (the first had released it), told the user
    ``LockLost``. A release whose answer did not come is a ``StoreError``: its outcome
    is unknown (Redis may run it, or drop it with the connection). On a cluster it was
    redis-py's cluster client that sent it again (up to three times, after a pause)."""
    url, serving = slow_topology
    with keymutex.Locks(url, namespace=namespace, socket_timeout=SLOW_TIMEOUT) as locks:
        lease = locks.acquire("k", timeout=0)
        server = serving(locks._store._layout.lease("k"))  # type: ignore[attr-defined]
        with _busy(server), pytest.raises(keymutex.StoreError, match="Timeout"):
            lease.release()
        with contextlib.suppress(keymutex.LockLost):  # if Redis did not run it
            locks.release("k", lease.token)
        locks.acquire("k", timeout=0).release()


@pytest.mark.asyncio
async def test_async_a_release_that_timed_out_is_not_sent_again(
    slow_topology: tuple[str, Callable[[str], redis.Redis]], namespace: str
) -> None:
    url, serving = slow_topology
    async with keymutex.AsyncLocks(url, namespace=namespace, socket_timeout=SLOW_TIMEOUT) as locks:
        lease = await locks.acquire("k", timeout=0)
        server = serving(locks._store._layout.lease("k"))  # type: ignore[attr-defined]
        with _busy(server), pytest.raises(keymutex.StoreError, match="Timeout"):
            await lease.release()
        with contextlib.suppress(keymutex.LockLost):
            await locks.release("k", lease.token)
        await (await locks.acquire("k", timeout=0)).release()


GHOST_TTL = 60.0  # a grant nobody gives back holds the key this long
AFTER_GHOST = 10.0  # how long another client waits for the key


def test_an_acquire_whose_answer_came_too_late_does_not_keep_the_key(
    redis_url: str, server: redis.Redis, namespace: str
) -> None:
    """Found by review: the try timed out while Redis was busy, and Redis ran it
    afterwards: the key was granted to a token nobody had, for its whole TTL, against
    the very caller who tried again. The client now gives it back (keymutex._giveback)."""
    with (
        keymutex.Locks(redis_url, namespace=namespace, socket_timeout=SLOW_TIMEOUT) as slow,
        keymutex.Locks(redis_url, namespace=namespace) as other,
    ):
        slow.acquire("warm-up", timeout=0).release()  # connected, its scripts loaded
        with _busy(server), pytest.raises(keymutex.StoreError, match="Timeout"):
            slow.acquire("k", ttl=GHOST_TTL, timeout=0)
        other.acquire("k", timeout=AFTER_GHOST).release()
        slow.acquire("k", timeout=AFTER_GHOST).release()


@pytest.mark.asyncio
async def test_async_an_acquire_whose_answer_came_too_late_does_not_keep_the_key(
    redis_url: str, server: redis.Redis, namespace: str
) -> None:
    async with (
        keymutex.AsyncLocks(redis_url, namespace=namespace, socket_timeout=SLOW_TIMEOUT) as slow,
        keymutex.AsyncLocks(redis_url, namespace=namespace) as other,
    ):
        await (await slow.acquire("warm-up", timeout=0)).release()
        with pytest.raises(keymutex.StoreError, match="Timeout"), _busy(server):
            await slow.acquire("k", ttl=GHOST_TTL, timeout=0)
        await (await other.acquire("k", timeout=AFTER_GHOST)).release()
        await (await slow.acquire("k", timeout=AFTER_GHOST)).release()


# In the release script's reply when it released: {1, ...} (set just before a release,
# nothing else answers meanwhile).
RELEASED_REPLY = b":1\r\n"


@contextlib.contextmanager
def _release_answer_lost(redis_url: str) -> Iterator[tuple[str, Proxy]]:
    """A URL through a proxy; ``lose()`` arms it to cut the connection (RST) instead of
    passing the next release's answer, after Redis ran the release."""
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    with Proxy(("127.0.0.1", port)) as proxy:
        yield f"redis://127.0.0.1:{proxy.port}/0", proxy


def test_a_release_whose_answer_was_lost_to_a_reset_is_not_lock_lost(
    redis_url: str, namespace: str
) -> None:
    """Its connection (used before) broke after the release went out: the store sent it
    again on a new one, which found the lease gone (the first had released it) and told
    the user ``LockLost``. It cannot tell that from a lease lost before: StoreError."""
    with (
        _release_answer_lost(redis_url) as (url, proxy),
        keymutex.Locks(url, namespace=namespace) as locks,
    ):
        lease = locks.acquire("k", timeout=0)
        proxy.set_mode("lose_reply", from_reply=RELEASED_REPLY)
        with pytest.raises(keymutex.StoreError, match="outcome unknown"):
            lease.release()
        assert proxy.mode == "pass", "the release's answer was lost"
        assert locks.holder("k") is None  # released, by the first one
        locks.acquire("k", timeout=0).release()


@pytest.mark.asyncio
async def test_async_a_release_whose_answer_was_lost_to_a_reset_is_not_lock_lost(
    redis_url: str, namespace: str
) -> None:
    with _release_answer_lost(redis_url) as (url, proxy):
        async with keymutex.AsyncLocks(url, namespace=namespace) as locks:
            lease = await locks.acquire("k", timeout=0)
            proxy.set_mode("lose_reply", from_reply=RELEASED_REPLY)
            with pytest.raises(keymutex.StoreError, match="outcome unknown"):
                await lease.release()
            assert proxy.mode == "pass", "the release's answer was lost"
            assert await locks.holder("k") is None


@contextlib.contextmanager
def _cluster_through_proxies(
    redis_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch, client: str = "_Cluster"
) -> Iterator[list[Proxy]]:
    """The store's cluster client (``_Cluster`` or ``_AsyncCluster``) reaches the nodes
    through a proxy each (redis-py's ``address_remap``); the rest is the real cluster."""
    from keymutex.stores import redis as store

    with contextlib.ExitStack() as stack:
        proxies = {
            node.port: stack.enter_context(Proxy(("127.0.0.1", node.port)))
            for node in redis_cluster.nodes
        }

        def through_proxy(address: tuple[str, int]) -> tuple[str, int]:
            proxy = proxies.get(address[1])
            return address if proxy is None else ("127.0.0.1", proxy.port)

        original = getattr(store, client)
        proxied = type(client, (original,), {})
        proxied.__init__ = functools.partialmethod(  # type: ignore[misc]
            original.__init__, address_remap=through_proxy
        )
        monkeypatch.setattr(store, client, proxied)
        yield list(proxies.values())


def test_a_release_whose_answer_was_lost_to_a_reset_on_a_cluster_is_not_lock_lost(
    redis_cluster: RedisCluster, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py's cluster client sends a command again after a broken connection: the
    release ran twice on its master and said ``LockLost`` although it had released.
    It is sent once: a StoreError, outcome unknown."""
    with (
        _cluster_through_proxies(redis_cluster, monkeypatch) as proxies,
        keymutex.Locks(redis_cluster.url, namespace=namespace) as locks,
    ):
        lease = locks.acquire("k", timeout=0)
        for proxy in proxies:
            proxy.set_mode("lose_reply", from_reply=RELEASED_REPLY)
        with pytest.raises(keymutex.StoreError, match="Redis release of 'k'"):
            lease.release()
        assert any(proxy.dropped_bytes for proxy in proxies), "no answer was lost"
        for proxy in proxies:
            proxy.set_mode("pass")
        assert locks.holder("k") is None  # released, by the one release sent
        locks.acquire("k", timeout=0).release()


@pytest.mark.asyncio
async def test_async_a_release_whose_answer_was_lost_to_a_reset_on_a_cluster_is_not_lock_lost(
    redis_cluster: RedisCluster, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _cluster_through_proxies(redis_cluster, monkeypatch, "_AsyncCluster") as proxies:
        async with keymutex.AsyncLocks(redis_cluster.url, namespace=namespace) as locks:
            # redis-py's async client keeps one node at the address it first learnt
            # (not remapped): take a key it reaches through a proxy.
            client, layout = locks._store._client, locks._store._layout  # type: ignore[attr-defined]
            await client.initialize()
            proxied = {proxy.port for proxy in proxies}
            key = next(
                f"k{n}"
                for n in range(1000)
                if client.get_node_from_key(layout.lease(f"k{n}")).port in proxied
            )
            lease = await locks.acquire(key, timeout=0)
            for proxy in proxies:
                proxy.set_mode("lose_reply", from_reply=RELEASED_REPLY)
            with pytest.raises(keymutex.StoreError, match=f"Redis release of '{key}'"):
                await lease.release()
            assert any(proxy.dropped_bytes for proxy in proxies), "no answer was lost"
            for proxy in proxies:
                proxy.set_mode("pass")
            assert await locks.holder(key) is None


def test_a_cluster_node_that_fails_fails_only_its_own_leases_renewals(
    redis_cluster: RedisCluster, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review of the memcached store's batch renewal, which had the same
    shape: one node that could not be reached failed the whole batch, and the leases on
    the nodes that answered were lost at their deadlines with it. The batch now says
    which renewals are unknown (``PartialRenewal``) and gives the others' outcomes."""
    from keymutex._store import PartialRenewal

    with (
        _cluster_through_proxies(redis_cluster, monkeypatch) as proxies,
        keymutex.Locks(redis_cluster.url, namespace=namespace) as locks,
    ):
        store = locks._store
        # A node as the cluster client knows it: at its proxy's address (remapped).
        by_port = {proxy.port: proxy for proxy in proxies}
        client, layout = store._client, store._layout  # type: ignore[attr-defined]
        leases = [locks.acquire(f"k{n}", timeout=0) for n in range(12)]
        port_of = {
            lease.key: client.get_node_from_key(layout.lease(lease.key)).port for lease in leases
        }
        failed_port = port_of["k0"]
        assert len(set(port_of.values())) > 1, "every key on one node"
        by_port[failed_port].set_mode("reset")
        requests = [RenewRequest(lease.key, lease.token, 30.0) for lease in leases]
        with pytest.raises(PartialRenewal) as partial:
            store.renew_many(requests)
        by_port[failed_port].set_mode("pass")
        for lease, outcome in zip(leases, partial.value.outcomes, strict=True):
            if port_of[lease.key] == failed_port:
                assert outcome is None  # unknown: its node could not be reached
            else:
                assert outcome is not None
                assert outcome.ok  # renewed: its node answered
        for lease in leases:
            lease.release()


def test_a_waiter_whose_queueing_try_timed_out_leaves_the_queue(
    server: redis.Redis, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The try that puts a waiter in the queue fails on the client but runs in Redis:
    the waiter must still leave the queue, or the next release hands the key to an
    acquire that is gone, and the key stays held by nobody for the lease's TTL."""
    from keymutex.stores.redis import _Subscriptions

    subscribed = _Subscriptions.join
    busy = contextlib.ExitStack()

    def join_then_busy(self: _Subscriptions, waiter: object, timeout: float) -> None:
        subscribed(self, waiter, timeout)  # type: ignore[arg-type]
        busy.enter_context(_busy(server))  # the next step is the try that queues

    with (
        keymutex.Locks(redis_url, namespace=namespace) as holder,
        keymutex.Locks(_slow_url(redis_url), namespace=namespace) as waiting,
    ):
        lease = holder.acquire("k", ttl=30, timeout=0)
        monkeypatch.setattr(_Subscriptions, "join", join_then_busy)
        with busy, pytest.raises(keymutex.StoreError, match="Timeout"):
            waiting.acquire("k", ttl=30, timeout=5)
        monkeypatch.undo()
        lease.release()
        # Free long before the 30 s a lease handed to the gone acquire would hold it.
        holder.acquire("k", timeout=5).release()
        assert server.llen(holder._store._layout.queue("k")) == 0  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_async_a_waiter_whose_queueing_try_timed_out_leaves_the_queue(
    server: redis.Redis, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from keymutex.stores.redis import _AsyncSubscriptions

    subscribed = _AsyncSubscriptions.join
    busy = contextlib.ExitStack()

    async def join_then_busy(self: _AsyncSubscriptions, waiter: object, timeout: float) -> None:
        await subscribed(self, waiter, timeout)  # type: ignore[arg-type]
        await asyncio.to_thread(busy.enter_context, _busy(server))

    async with (
        keymutex.AsyncLocks(redis_url, namespace=namespace) as holder,
        keymutex.AsyncLocks(_slow_url(redis_url), namespace=namespace) as waiting,
    ):
        lease = await holder.acquire("k", ttl=30, timeout=0)
        monkeypatch.setattr(_AsyncSubscriptions, "join", join_then_busy)
        with pytest.raises(keymutex.StoreError, match="Timeout"):
            await waiting.acquire("k", ttl=30, timeout=5)
        await asyncio.to_thread(busy.close)
        monkeypatch.undo()
        await lease.release()
        await (await holder.acquire("k", timeout=5)).release()  # as in the sync test
        assert server.llen(holder._store._layout.queue("k")) == 0  # type: ignore[attr-defined]


def test_a_channel_joined_while_it_is_being_unsubscribed_stays_subscribed(
    server: redis.Redis, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter joining a lingering channel just as the hub unsubscribes it: Redis must
    end with the channel subscribed, else the hub takes it for confirmed and the waiter
    never hears its hand-over (it waits for its once-a-second recheck)."""
    monkeypatch.setattr("keymutex.stores.redis.LINGER", 0.3)
    unsubscribe = redis.client.PubSub.unsubscribe
    unsubscribing = threading.Event()

    def slow_unsubscribe(self: redis.client.PubSub, *channels: str) -> object:
        if not unsubscribing.is_set():
            unsubscribing.set()
            time.sleep(0.3)  # widens the window between deciding and sending
        return unsubscribe(self, *channels)

    with (
        keymutex.Locks(redis_url, namespace=namespace) as holder,
        keymutex.Locks(redis_url, namespace=namespace) as waiting,
    ):
        channel = waiting._store._layout.channel("k")  # type: ignore[attr-defined]
        lease = holder.acquire("k", timeout=0)
        thread, got = _wait_in_thread(server, waiting, queued=1)
        lease.release()
        thread.join(10)
        got[0].release()  # nobody waits on the channel now: it lingers, then goes
        monkeypatch.setattr(redis.client.PubSub, "unsubscribe", slow_unsubscribe)
        lease = holder.acquire("k", timeout=0)
        assert unsubscribing.wait(10)
        thread, got = _wait_in_thread(server, waiting, queued=1)
        ((_, subscribers),) = server.pubsub_numsub(channel)
        assert subscribers == 1
        lease.release()
        thread.join(10)
        assert len(got) == 1
        got[0].release()


class _Alarm(Exception):
    pass


def test_an_exception_a_signal_handler_raises_while_waiting_reaches_the_caller(
    redis_url: str, namespace: str
) -> None:
    """Found by review: raised in the waiting thread while it read the subscription
    connection (an alarm-based timeout, a job's soft time limit), the exception was
    taken for a connection failure, logged, and the wait went on until the key was
    free. It reaches the caller, and waiting works afterwards."""
    import signal

    def alarm(signum: int, frame: object) -> None:
        raise _Alarm

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        with (
            keymutex.Locks(redis_url, namespace=namespace) as holding,
            keymutex.Locks(redis_url, namespace=namespace) as waiting,
        ):
            lease = holding.acquire("k", ttl=60.0, timeout=0)
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(_Alarm):
                waiting.acquire("k", timeout=20.0)
            threading.Timer(0.3, lease.release).start()
            waiting.acquire("k", timeout=20.0).release()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _named(server: redis.Redis, namespace: str) -> int:
    """How many connections the store of ``namespace`` has open at the server."""
    return sum(1 for c in server.client_list() if c["name"] == namespace)


def _until_none_named(server: redis.Redis, namespace: str) -> int:
    for _ in range(200):  # the server sees a closed connection go shortly after
        if not _named(server, namespace):
            break
        time.sleep(0.01)
    return _named(server, namespace)


def test_an_async_client_works_in_one_event_loop_after_another(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    """Found by review: an ``AsyncLocks`` used by a second ``asyncio.run`` (a
    module-level client; pytest-asyncio's loop per test) failed with ``RuntimeError:
    Event loop is closed``: redis.asyncio's connections belong to the first loop. The
    store is opened again in the next loop (``StoreOfTheLoop``); a lease granted in the
    first is renewed and released in the second.

    And found in CI: the store of a loop that had ended kept its connections open until
    the garbage collector warned of them, in some later test. Each loop's store is
    closed when ``asyncio.run`` ends it."""
    locks = keymutex.AsyncLocks(redis_url, namespace=namespace, client_name=namespace)

    async def first() -> keymutex.AsyncLease:
        return await locks.acquire("kept", ttl=5.0, timeout=0)

    async def second(kept: keymutex.AsyncLease) -> None:
        await kept.renew()
        await (await locks.acquire("k", timeout=0)).release()

        async def hold() -> None:
            held = await locks.acquire("w", timeout=0)
            await asyncio.sleep(0.2)
            await held.release()

        holding = asyncio.create_task(hold())
        await asyncio.sleep(0.05)
        await (await locks.acquire("w", timeout=5.0)).release()  # waits, woken
        await holding
        await kept.release()

    kept = asyncio.run(first())
    assert _until_none_named(server, namespace) == 0, "the first loop's connections"
    asyncio.run(second(kept))
    assert _until_none_named(server, namespace) == 0, "the second loop's connections"
    asyncio.run(locks.aclose())


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_async_client_works_in_loops_that_were_not_closed(
    redis_url: str, namespace: str
) -> None:
    """Found by review: a loop left open (``run_until_complete`` on new loops, or loops
    in threads) kept its store, which the next loop then used: "attached to a different
    loop". Each loop has a store of its own."""
    clients = [keymutex.AsyncLocks(redis_url, namespace=namespace)]
    loops = [asyncio.new_event_loop() for _ in range(3)]

    async def use(n: int) -> None:
        await (await clients[0].acquire(f"k{n}", timeout=0)).release()

    try:
        for n, loop in enumerate(loops):
            loop.run_until_complete(use(n))
        loops[-1].run_until_complete(clients[0].aclose())
    finally:
        for loop in loops:
            loop.close()
    clients.clear()
    loops.clear()
    del loop
    gc.collect()  # the stores of the other loops, closed with their sockets: here


def test_redis_on_a_unix_socket(tmp_path: Path) -> None:
    """``unix:///path/redis.sock``, as redis-py spells a Unix socket: the store took it,
    and said so in its errors, but no entry point named the scheme, so ``Locks()``
    answered "unknown store URL scheme 'unix'" (found by review, from an example that
    accepted such URLs)."""
    sockets = Path(tempfile.mkdtemp(prefix="km-", dir="/tmp"))  # a socket path is short
    socket = sockets / "redis.sock"
    server = RedisServer(
        tmp_path / "unix",
        ["save ''", "appendonly no", f"unixsocket {socket}", "unixsocketperm 700"],
    )
    try:
        with server.start():
            url = f"unix://{socket}?db=3"
            with keymutex.Locks(url, namespace="unix") as locks:
                lease = locks.acquire("k", timeout=0)
                with pytest.raises(keymutex.Locked) as refused:
                    locks.acquire("k", timeout=0)
                assert refused.value.holder is not None
                assert refused.value.holder.fence == lease.fence
                lease.release()
                assert locks.holder("k") is None

            async def main() -> None:
                alocks = keymutex.AsyncLocks(url, namespace="unix")
                async with alocks, alocks.lock("k", timeout=1) as held:
                    assert held.fence > lease.fence

            asyncio.run(main())
            # In database 3 of this server, not in 0.
            assert server.client().keys("*") == []
            assert redis.Redis(unix_socket_path=str(socket), db=3).keys("*") != []
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def test_a_lease_in_its_last_millisecond_is_read_as_held() -> None:
    """PTTL 0: Redis expires a key only once its clock has passed the expiry time, and
    till then the lease's token renews it and an acquire is refused. ``holder()`` called
    it free: a heartbeat sent right after renewed it (47 times in 60 against a real
    server; the conformance suite's expired-token test catches it now and then, this
    reading of the reply always)."""
    from keymutex.stores.redis import _hash_reply

    fields = ["alice", None, "7", "1700000000000"]
    before = time.time()
    held = _hash_reply("k", fields, 0)
    assert held is not None
    assert (held.owner, held.fence) == ("alice", 7)
    assert before <= held.expires_at <= time.time()
    assert _hash_reply("k", fields, 1500) is not None
    assert _hash_reply("k", fields, -2) is None  # gone between the two reads
    assert _hash_reply("k", [None, None, None, None], -2) is None


def test_a_step_that_ends_after_the_store_closed_closes_its_connection(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    """Found in CI (the async store's, below): a step whose connection the store's
    close closed under it was tried again on a new connection, which it kept in the
    closed store, open until the garbage collector warned during some later test."""
    store = keymutex.Locks(redis_url, namespace=namespace, client_name=namespace)._store
    conns = store._conns
    conns.call("PING")  # a connection used before: a broken one is replaced
    replies: list[object] = []
    step = threading.Thread(target=lambda: replies.append(conns.call("BLPOP", namespace, 0.5)))
    step.start()
    deadline = time.monotonic() + 5
    while not any(c["name"] == namespace and c["cmd"] == "blpop" for c in server.client_list()):
        assert time.monotonic() < deadline, "the step never reached the server"
        time.sleep(0.01)
    store.close()  # closes the connection under the step, which takes a new one
    step.join(10)
    assert replies == [None]  # the step ended on a new connection
    assert _until_none_named(server, namespace) == 0, "a connection was left open"


@pytest.mark.asyncio
async def test_an_async_step_that_ends_after_the_store_closed_closes_its_connection(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    store = keymutex.AsyncLocks(redis_url, namespace=namespace, client_name=namespace)._store
    conns = store._conns
    await conns.call("PING")
    step = asyncio.ensure_future(conns.call("BLPOP", namespace, 0.5))
    deadline = time.monotonic() + 5
    while not any(c["name"] == namespace and c["cmd"] == "blpop" for c in server.client_list()):
        assert time.monotonic() < deadline, "the step never reached the server"
        await asyncio.sleep(0.01)
    await store.aclose()
    assert await step is None  # the step ended on a new connection
    assert _until_none_named(server, namespace) == 0, "a connection was left open"

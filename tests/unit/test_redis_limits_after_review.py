"""The Redis store under limits users set on it: a pool limited by ``max_connections``
and an ACL user without the pub/sub channels keymutex uses (found by review), and an
ACL user without ``SCRIPT``.

Against a real redis-server (the session's ``redis_url``).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

import keymutex

WAIT = 10.0


@pytest.fixture
def server(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def namespace() -> str:
    return f"limits-{uuid.uuid4().hex}"


# -- max_connections ------------------------------------------------------------------
# The store kept every connection its steps had used out of redis-py's pool: after two
# acquires at once on max_connections=2, renewals (the lease was lost), holder(),
# pub/sub and reloading the scripts all failed with "Too many connections", for good.


def _two_steps_at_once(locks: keymutex.Locks) -> None:
    """Two acquires and releases from two threads at once: two connections in use."""
    start = threading.Barrier(2)

    def at_once(i: int) -> None:
        start.wait()
        locks.acquire(f"k{i}", timeout=WAIT).release()

    threads = [threading.Thread(target=at_once, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_a_pool_of_one_connection_is_refused_with_the_least_accepted() -> None:
    with pytest.raises(ValueError, match="max_connections must be an int from 2 to"):
        keymutex.Locks("redis://127.0.0.1:1/0", max_connections=1)


def test_a_limited_pool_still_renews_reads_and_reloads_after_steps_at_once(
    server: redis.Redis, redis_url: str, namespace: str
) -> None:
    lost: list[keymutex.Lease] = []
    with keymutex.Locks(redis_url, namespace=namespace, max_connections=2) as locks:
        locks.acquire("warm-up").release()
        _two_steps_at_once(locks)
        assert locks.holder("held") is None
        with locks.lock("held", ttl=0.6, on_lost=lost.append) as lease:
            threading.Event().wait(1.5)  # renewed past two TTLs
            assert not lease.lost
        assert lost == []
        server.script_flush()  # as after a restart: the scripts are loaded again
        locks.acquire("after-flush", timeout=0).release()


def test_a_limited_pool_still_lets_a_waiter_hear_the_release(
    redis_url: str, namespace: str
) -> None:
    with keymutex.Locks(redis_url, namespace=namespace, max_connections=2) as locks:
        _two_steps_at_once(locks)
        with keymutex.Locks(redis_url, namespace=namespace) as other:
            held = other.acquire("k")
            threading.Timer(0.3, held.release).start()
            locks.acquire("k", timeout=WAIT).release()


@pytest.mark.asyncio
async def test_async_a_limited_pool_still_renews_and_reads_after_steps_at_once(
    redis_url: str, namespace: str
) -> None:
    lost: list[keymutex.AsyncLease] = []
    async with keymutex.AsyncLocks(redis_url, namespace=namespace, max_connections=2) as locks:
        await (await locks.acquire("warm-up")).release()

        async def one(i: int) -> None:
            await (await locks.acquire(f"k{i}", timeout=WAIT)).release()

        await asyncio.gather(one(0), one(1))
        assert await locks.holder("held") is None
        async with locks.lock("held", ttl=0.6, on_lost=lost.append) as lease:
            await asyncio.sleep(1.5)
            assert not lease.lost
        assert lost == []


# -- an ACL user without channels -----------------------------------------------------
# Redis 7 gives a new ACL user no channels (acl-pubsub-default resetchannels). Its
# refused SUBSCRIBE was only logged: a waiting acquire waited 5 s whatever its timeout,
# then failed with "did not confirm the subscription", naming no cause. Its refused
# PUBLISH, inside a release that had already handed the key over, made the release
# raise StoreError although it had happened.


@pytest.fixture
def channelless_url(server: redis.Redis, redis_url: str) -> Iterator[str]:
    user = f"app-{uuid.uuid4().hex[:8]}"
    server.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "+@all", "resetchannels")
    host_port = redis_url.split("://", 1)[1]
    yield f"redis://{user}:pw@{host_port}"
    server.execute_command("ACL", "DELUSER", user)


def test_a_refused_subscription_fails_the_wait_at_once_and_says_why(
    channelless_url: str, redis_url: str, namespace: str
) -> None:
    with (
        keymutex.Locks(redis_url, namespace=namespace) as holder,
        keymutex.Locks(channelless_url, namespace=namespace) as waiter,
    ):
        lease = holder.acquire("k")
        with pytest.raises(keymutex.StoreError, match="refused the subscription") as caught:
            waiter.acquire("k", timeout=60)
        assert "no permissions" in str(caught.value)
        assert "&km:*" in str(caught.value)
        assert holder.holder("k") is not None
        assert lease.fence == holder.holder("k").fence  # type: ignore[union-attr]
        lease.release()
        waiter.acquire("k", timeout=0).release()  # the waiter left nothing behind


@pytest.mark.asyncio
async def test_async_a_refused_subscription_fails_the_wait_at_once_and_says_why(
    channelless_url: str, redis_url: str, namespace: str
) -> None:
    async with (
        keymutex.AsyncLocks(redis_url, namespace=namespace) as holder,
        keymutex.AsyncLocks(channelless_url, namespace=namespace) as waiter,
    ):
        lease = await holder.acquire("k")
        with pytest.raises(keymutex.StoreError, match="refused the subscription"):
            await waiter.acquire("k", timeout=60)
        await lease.release()
        await (await waiter.acquire("k", timeout=0)).release()


def test_a_release_whose_publish_is_refused_is_a_release_all_the_same(
    channelless_url: str, redis_url: str, namespace: str
) -> None:
    with (
        keymutex.Locks(channelless_url, namespace=namespace) as releaser,
        keymutex.Locks(redis_url, namespace=namespace) as waiter,
    ):
        lease = releaser.acquire("k")
        got: list[keymutex.Lease] = []
        waiting = threading.Thread(target=lambda: got.append(waiter.acquire("k", timeout=WAIT)))
        waiting.start()
        while not waiter.holder("k") or not _queued(redis_url, namespace):
            threading.Event().wait(0.01)
        lease.release()  # raised StoreError (a refused PUBLISH) after the hand-over
        waiting.join()
        assert got
        assert got[0].fence > lease.fence
        got[0].release()


def _queued(redis_url: str, namespace: str) -> bool:
    with redis.Redis.from_url(redis_url) as client:
        return any(client.scan_iter(match=f"km:q:*{namespace}*"))


# -- an ACL user without SCRIPT -------------------------------------------------------
# The scripts run by EVALSHA, and by EVAL (their source) on a server that lacks them
# (restarted, flushed). The renewer's batch loaded them with SCRIPT LOAD instead, which
# an ACL user without SCRIPT is refused (NOPERM): after a restart, a lease renewed in
# the background was never renewed again, and was lost.

TTL = 3.0


@pytest.fixture
def scriptless_url(server: redis.Redis, redis_url: str) -> Iterator[str]:
    user = f"app-{uuid.uuid4().hex[:8]}"
    server.execute_command(
        "ACL", "SETUSER", user, "on", ">pw", "~*", "allchannels", "+@all", "-script"
    )
    host_port = redis_url.split("://", 1)[1]
    yield f"redis://{user}:pw@{host_port}"
    server.execute_command("ACL", "DELUSER", user)


def _renewed(holder: keymutex.Holder | None, granted: keymutex.Holder | None) -> bool:
    """Whether the lease seen (``holder``) was renewed since it was seen as ``granted``:
    its expiry moved by a renewal's worth (one is due a third of the TTL after the
    grant), not by the milliseconds of reading it (``expires_at`` is read as PTTL)."""
    assert granted is not None
    assert holder is not None, "the lease expired: not renewed after the flush"
    return holder.expires_at > granted.expires_at + TTL / 6


def test_a_lease_renewed_in_the_background_outlives_a_flush_without_script(
    server: redis.Redis, scriptless_url: str, redis_url: str, namespace: str
) -> None:
    lost: list[keymutex.Lease] = []
    with (
        keymutex.Locks(scriptless_url, namespace=namespace) as locks,
        keymutex.Locks(redis_url, namespace=namespace) as observer,
    ):
        lease = locks.acquire("k", ttl=TTL, renew=True, on_lost=lost.append)
        server.script_flush()  # as after a restart: the renewal script is gone
        granted = observer.holder("k")
        deadline = time.monotonic() + WAIT
        while not _renewed(observer.holder("k"), granted):
            assert time.monotonic() < deadline, "never renewed after the flush"
            time.sleep(0.05)
        assert not lease.lost
        assert lost == []
        lease.release()


@pytest.mark.asyncio
async def test_async_a_lease_renewed_in_the_background_outlives_a_flush_without_script(
    server: redis.Redis, scriptless_url: str, redis_url: str, namespace: str
) -> None:
    async with (
        keymutex.AsyncLocks(scriptless_url, namespace=namespace) as locks,
        keymutex.AsyncLocks(redis_url, namespace=namespace) as observer,
    ):
        lease = await locks.acquire("k", ttl=TTL, renew=True)
        server.script_flush()
        granted = await observer.holder("k")
        deadline = time.monotonic() + WAIT
        while not _renewed(await observer.holder("k"), granted):
            assert time.monotonic() < deadline, "never renewed after the flush"
            await asyncio.sleep(0.05)
        assert not lease.lost
        await lease.release()

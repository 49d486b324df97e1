"""A ``redis://`` URL whose name or address moves to a new master: READONLY, then on.

A DNS name or a virtual IP in front of Redis moves to the new master in a failover;
connections opened before the move stay with the old server, now a replica. Here a TCP
proxy stands for that name: connections it accepted keep their server, new ones go to
the one it points to now. Two real servers: B replicates A, then B is promoted and A
made its replica (``REPLICAOF``), and the proxy is pointed at B.

Found by review: every step of a client that held a connection from before the move
failed with ``READONLY``, as long as that connection lived. Now a step answered
``READONLY`` (its server ran none of it: a replica writes nothing) drops the idle
connections and is sent once more on a new one; a second ``READONLY`` is a
``StoreError`` that says what is wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

import _redis_servers as servers
import keymutex
from _redis_fixtures import Waiter, require_redis
from safety._tools.proxy import Proxy

pytestmark = pytest.mark.usefixtures("_needs_redis")

PATIENCE = 30.0


@pytest.fixture
def _needs_redis() -> None:
    require_redis()


@dataclass
class MovingMaster:
    """Server ``a``, the master, its replica ``b``, and ``proxy``: the URL's address."""

    a: servers.RedisServer
    b: servers.RedisServer
    proxy: Proxy

    @property
    def url(self) -> str:
        return f"redis://{self.proxy.host}:{self.proxy.port}/0"

    def demote_a(self) -> None:
        """Promote ``b``, make ``a`` its replica; the proxy still points at ``a``."""
        servers.wait_caught_up(self.a, [self.b])
        self.b.command("REPLICAOF", "NO", "ONE")
        self.a.command("REPLICAOF", servers.HOST, self.b.port)
        _wait_until(
            lambda: self.a.info("replication").get("master_link_status") == "up",
            "the old master replicates the new one",
        )

    def move(self) -> None:
        """A failover: ``b`` the master, ``a`` its replica, the URL's address ``b``'s."""
        self.demote_a()
        self.proxy.upstream = self.b.address


@pytest.fixture
def moving(tmp_path: Path) -> Iterator[MovingMaster]:
    with (
        servers.standalone(tmp_path / "a") as a,
        servers.standalone(tmp_path / "b") as b,
        Proxy(a.address) as proxy,
    ):
        b.command("REPLICAOF", servers.HOST, a.port)
        servers.wait_caught_up(a, [b])
        yield MovingMaster(a, b, proxy)


@pytest.fixture
def namespace() -> str:
    return f"moved-{uuid.uuid4().hex[:12]}"


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {PATIENCE} s waiting until {what}")
        time.sleep(0.02)


def _connected(locks: keymutex.Locks) -> None:
    """A step, so that ``locks`` keeps a connection to the current master for the next."""
    locks.acquire(f"warm-{uuid.uuid4().hex}", timeout=0).release()


async def _connected_async(locks: keymutex.AsyncLocks) -> None:
    await (await locks.acquire(f"warm-{uuid.uuid4().hex}", timeout=0)).release()


def test_each_step_after_the_master_moved_goes_to_the_new_master(
    moving: MovingMaster, namespace: str
) -> None:
    """Each client below makes its first step after the move on the connection it kept
    to the old master, and is served by the new one: the holder's lease is there
    (replicated), renewed and released by its token alone; an acquire of a free key is
    granted; a waiting acquire of the held key is refused (one lease, one holder). Each
    of those writes, meets ``READONLY``, and is sent again. A wrong token renews
    nothing (the replica says so: a renewal that finds another token writes nothing)."""

    def locks(owner: str) -> keymutex.Locks:
        return stack.enter_context(keymutex.Locks(moving.url, namespace=namespace, owner=owner))

    with contextlib.ExitStack() as stack:
        holder, rival, renewer, releaser, newcomer, intruder = (
            locks(name) for name in ("holder", "rival", "renewer", "releaser", "new", "intruder")
        )
        held = holder.acquire("doc", ttl=30.0)
        for client in (rival, renewer, releaser, newcomer, intruder):
            _connected(client)
        moving.move()

        with pytest.raises(keymutex.Locked) as refused:  # waits: a queue entry, a write
            rival.acquire("doc", timeout=0.5)
        assert refused.value.holder is not None
        assert (refused.value.holder.owner, refused.value.holder.fence) == ("holder", held.fence)

        renewed = renewer.renew("doc", held.token, ttl=60.0)
        assert renewed.fence == held.fence
        assert renewed.remaining > 30.0

        with pytest.raises(keymutex.LockLost):
            intruder.renew("doc", "not-the-token")

        granted = newcomer.acquire("new", timeout=0)
        assert granted.fence > held.fence

        releaser.release("doc", held.token)
        with keymutex.Locks(moving.b.url, namespace=namespace) as on_b:
            assert on_b.holder("doc") is None
            assert on_b.holder("new") is not None
        after = rival.acquire("doc", timeout=0)
        assert after.fence > granted.fence
        after.release()
        granted.release()


def test_each_step_after_the_master_moved_goes_to_the_new_master_async(
    moving: MovingMaster, namespace: str
) -> None:
    """The same with ``AsyncLocks``."""

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            holder, rival, renewer, releaser, newcomer = [
                await stack.enter_async_context(
                    keymutex.AsyncLocks(moving.url, namespace=namespace, owner=name)
                )
                for name in ("holder", "rival", "renewer", "releaser", "new")
            ]
            held = await holder.acquire("doc", ttl=30.0)
            for client in (rival, renewer, releaser, newcomer):
                await _connected_async(client)
            moving.move()

            with pytest.raises(keymutex.Locked) as refused:
                await rival.acquire("doc", timeout=0.5)
            assert refused.value.holder is not None
            assert refused.value.holder.owner == "holder"
            renewed = await renewer.renew("doc", held.token, ttl=60.0)
            assert renewed.remaining > 30.0
            granted = await newcomer.acquire("new", timeout=0)
            assert granted.fence > held.fence
            await releaser.release("doc", held.token)
            after = await rival.acquire("doc", timeout=0)
            assert after.fence > granted.fence
            await after.release()
            await granted.release()

    asyncio.run(scenario())


def _renewed_on_b(moving: MovingMaster, namespace: str, since: float) -> bool:
    with keymutex.Locks(moving.b.url, namespace=namespace) as on_b:
        found = on_b.holder("doc")
    assert found is not None, "the lease expired on the new master: never renewed there"
    return found.expires_at > since


def test_a_lease_renewed_in_the_background_keeps_its_key_when_the_master_moves(
    moving: MovingMaster, namespace: str
) -> None:
    """The renewer's batch meets ``READONLY`` too, and is sent again to the new master."""
    lost: list[keymutex.Lease] = []
    with keymutex.Locks(moving.url, namespace=namespace) as locks:
        lease = locks.acquire("doc", ttl=3.0, renew=True, on_lost=lost.append)
        moving.move()
        since = time.time() + 3.0  # the expiry of a renewal sent before the move, at most
        _wait_until(lambda: _renewed_on_b(moving, namespace, since), "a renewal reached B")
        assert not lost
        assert not lease.lost
        lease.release()


def test_a_lease_renewed_in_the_background_keeps_its_key_when_the_master_moves_async(
    moving: MovingMaster, namespace: str
) -> None:
    """The same with ``AsyncLocks``."""

    async def scenario() -> None:
        async with keymutex.AsyncLocks(moving.url, namespace=namespace) as locks:
            lease = await locks.acquire("doc", ttl=3.0, renew=True)
            moving.move()
            since = time.time() + 3.0
            deadline = time.monotonic() + PATIENCE
            while not await asyncio.to_thread(_renewed_on_b, moving, namespace, since):
                assert time.monotonic() < deadline, "no renewal reached B"
                await asyncio.sleep(0.05)
            assert not lease.lost
            await lease.release()

    asyncio.run(scenario())


def _assert_still_a_replica(error: keymutex.StoreError) -> None:
    assert isinstance(error.__cause__, redis.exceptions.ReadOnlyError)
    message = str(error)
    assert "READONLY, and again on a new connection" in message
    assert "must lead to a master" in message


def _free_on_b(moving: MovingMaster, namespace: str) -> bool:
    with keymutex.Locks(moving.b.url, namespace=namespace) as on_b:
        return on_b.holder("doc") is None


def test_a_url_that_still_leads_to_a_replica_fails_clearly_after_one_more_try(
    moving: MovingMaster, namespace: str
) -> None:
    """The address has not moved yet (the proxy still points at the demoted server):
    a step is tried once more, on one new connection, and fails with a ``StoreError``
    that says the URL leads to a replica. Nothing loops. The release that failed is
    given back in the background, as any failed release, once the address moved."""
    with keymutex.Locks(moving.url, namespace=namespace) as locks:
        held = locks.acquire("doc", ttl=30.0)
        moving.demote_a()
        connections = moving.proxy.connections
        with pytest.raises(keymutex.StoreError) as failed:
            locks.renew("doc", held.token)
        _assert_still_a_replica(failed.value)
        assert moving.proxy.connections == connections + 1
        for step in (
            lambda: locks.acquire("other", timeout=0),
            lambda: locks.release("doc", held.token),
        ):
            with pytest.raises(keymutex.StoreError) as failed:
                step()
            _assert_still_a_replica(failed.value)
        moving.proxy.upstream = moving.b.address
        _wait_until(lambda: _free_on_b(moving, namespace), "the failed release was given back")


def test_a_url_that_still_leads_to_a_replica_fails_clearly_after_one_more_try_async(
    moving: MovingMaster, namespace: str
) -> None:
    """The same with ``AsyncLocks``."""

    async def scenario() -> None:
        async with keymutex.AsyncLocks(moving.url, namespace=namespace) as locks:
            held = await locks.acquire("doc", ttl=30.0)
            moving.demote_a()
            connections = moving.proxy.connections
            with pytest.raises(keymutex.StoreError) as failed:
                await locks.renew("doc", held.token)
            _assert_still_a_replica(failed.value)
            assert moving.proxy.connections == connections + 1
            with pytest.raises(keymutex.StoreError) as failed:
                await locks.release("doc", held.token)
            _assert_still_a_replica(failed.value)
            moving.proxy.upstream = moving.b.address
            deadline = time.monotonic() + PATIENCE
            while not await asyncio.to_thread(_free_on_b, moving, namespace):
                assert time.monotonic() < deadline, "the failed release was never given back"
                await asyncio.sleep(0.05)

    asyncio.run(scenario())


def test_a_waiter_of_a_client_that_met_the_move_listens_on_the_new_master(
    moving: MovingMaster, namespace: str
) -> None:
    """A waiter subscribed on the old master; its client then meets ``READONLY`` in
    another step. Found by review: its pub/sub connection stayed on the old master, now
    a replica, which replays the new master's PUBLISH of the hand-over although that
    PUBLISH counted no listener, so the release took the grant back; the waiter took it
    all the same, and believed it held a key that was free (a second holder, for the
    next acquire). Now the client's pub/sub connection moves, and its waiters confirm
    what they hear: the waiter gets the key on the new master, and is its holder there."""
    with (
        keymutex.Locks(moving.url, namespace=namespace, owner="holder") as holder,
        keymutex.Locks(moving.url, namespace=namespace, owner="waiter") as waiting,
        keymutex.Locks(moving.b.url, namespace=namespace) as on_b,
    ):
        held = holder.acquire("doc", ttl=60.0)
        waiter = Waiter(waiting, "doc", patience=PATIENCE)
        _wait_until(lambda: bool(moving.a.command("PUBSUB", "CHANNELS")), "the waiter listens")
        time.sleep(0.3)  # its try with a place in the queue, after the subscription
        moving.move()
        _connected(waiting)  # its kept connection: READONLY, then the new master
        holder.release("doc", held.token)
        got = waiter.lease()
        seen = on_b.holder("doc")
        assert seen is not None, "the waiter took a grant the new master does not hold"
        assert (seen.owner, seen.fence) == ("waiter", got.fence)
        with pytest.raises(keymutex.Locked):
            on_b.acquire("doc", timeout=0)
        got.release()

"""What only the etcd store promises, checked on a real etcd (tests/_etcd_fixtures.py).

etcd itself is the witness: its ``/metrics`` count the requests a step made, and its
gateway shows the keys and leases a step left behind.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

import keymutex
from keymutex.stores import etcd as etcd_store
from keymutex.stores.etcd import _Layout, _Refusal, _View, etcd_ttl

# With rechecks put off to a minute (no_rechecks), a waiter granted within this of the
# release was woken by its watch: far above any hand-over, far below the minute.
NOTIFIED = 10.0

pytestmark = pytest.mark.usefixtures("etcd_url")


@pytest.fixture
def namespace() -> str:
    return f"unit-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def locks(etcd_url: str, namespace: str) -> Iterator[keymutex.Locks]:
    with keymutex.Locks(etcd_url, namespace=namespace, ttl=10.0) as client:
        yield client


class Etcd:
    """The test's own look at the etcd behind ``etcd_url``, through its JSON gateway."""

    def __init__(self, url: str, namespace: str) -> None:
        self.base = "http://" + url.removeprefix("etcd://")
        self.layout = _Layout(namespace)

    def post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        reply = httpx.post(self.base + path, json=body, timeout=5.0)
        reply.raise_for_status()
        decoded = reply.json()
        assert isinstance(decoded, dict)
        return decoded

    def kv(self, key: str) -> dict[str, str] | None:
        name = base64.b64encode(self.layout.name(key)).decode()
        kvs = self.post("/v3/kv/range", {"key": name}).get("kvs")
        assert kvs is None or isinstance(kvs, list)
        return kvs[0] if kvs else None

    def namespace_keys(self) -> list[object]:
        prefix = self.layout.prefix
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        reply = self.post(
            "/v3/kv/range",
            {
                "key": base64.b64encode(prefix).decode(),
                "range_end": base64.b64encode(end).decode(),
            },
        )
        kvs = reply.get("kvs") or []
        assert isinstance(kvs, list)
        return kvs

    def lease_ids(self) -> set[int]:
        leases = self.post("/v3/lease/leases", {}).get("leases") or []
        assert isinstance(leases, list)
        return {int(lease["ID"]) for lease in leases}

    def queue(self, key: str) -> list[dict[str, str]]:
        """The key's queue entries, first come first."""
        start, end = self.layout.queue(key)
        reply = self.post(
            "/v3/kv/range",
            {"key": base64.b64encode(start).decode(), "range_end": base64.b64encode(end).decode()},
        )
        kvs = reply.get("kvs") or []
        assert isinstance(kvs, list)
        return sorted(kvs, key=lambda kv: int(kv["create_revision"]))

    def wait_for_queue(self, key: str, length: int) -> list[dict[str, str]]:
        deadline = time.monotonic() + 10
        while len(entries := self.queue(key)) != length:
            assert time.monotonic() < deadline, f"{key!r}: {len(entries)} queued, not {length}"
            time.sleep(0.01)
        return entries

    def granted_ttl(self, lease: int) -> int:
        return int(str(self.post("/v3/lease/timetolive", {"ID": lease}).get("grantedTTL", 0)))

    def requests(self) -> dict[str, int]:
        """How many requests etcd has started, by gRPC method (the gateway's included)."""
        text = httpx.get(self.base + "/metrics", timeout=5.0).text
        counts: dict[str, int] = {}
        pattern = re.compile(r'^grpc_server_started_total\{.*grpc_method="(\w+)".*\} (\d+)', re.M)
        for method, count in pattern.findall(text):
            counts[method] = counts.get(method, 0) + int(count)
        return counts

    def wait_for_requests(self, before: dict[str, int], method: str) -> None:
        """Until etcd has started a ``method`` request since ``before`` (10 s at most)."""
        deadline = time.monotonic() + 10
        while not made(before, self.requests()).get(method):
            assert time.monotonic() < deadline, f"no {method} request reached etcd"
            time.sleep(0.01)

    def puts(self) -> int:
        """How many keys etcd has written (a transaction's puts included)."""
        text = httpx.get(self.base + "/metrics", timeout=5.0).text
        found = re.search(r"^etcd_mvcc_put_total (\d+)", text, re.M)
        assert found is not None
        return int(found.group(1))


@pytest.fixture
def etcd(etcd_url: str, namespace: str) -> Etcd:
    return Etcd(etcd_url, namespace)


def made(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {m: after.get(m, 0) - n for m, n in before.items() if after.get(m, 0) - n}


def test_acquire_is_one_grant_and_one_transaction_release_one_revoke(
    locks: keymutex.Locks, etcd: Etcd
) -> None:
    locks.acquire("warm-up", timeout=0).release()  # the connection is open
    before = etcd.requests()
    lease = locks.acquire("doc", timeout=0)
    assert made(before, etcd.requests()) == {"LeaseGrant": 1, "Txn": 1}
    before = etcd.requests()
    lease.release()
    assert made(before, etcd.requests()) == {"LeaseRevoke": 1}  # etcd deletes the key


def test_renew_many_batches_keepalives_and_reads_in_one_transaction(
    locks: keymutex.Locks, etcd: Etcd
) -> None:
    leases = [locks.acquire(f"job:{n}", ttl=10.0) for n in range(20)]
    store = locks._store
    before = etcd.requests()
    outcomes = store.renew_many(
        [keymutex._store.RenewRequest(x.key, x.token, 10.0) for x in leases]
    )
    assert all(outcome.ok for outcome in outcomes)
    requests = made(before, etcd.requests())
    assert requests["Txn"] == 1  # every key read in one transaction
    # All keep-alives in one request; the gateway may cut a stream short, and the
    # leases it left out are sent again: still far fewer requests than leases.
    assert 1 <= requests["LeaseKeepAlive"] <= 5
    assert set(requests) == {"Txn", "LeaseKeepAlive"}
    for lease in leases:
        lease.release()


def test_renew_many_of_more_leases_than_etcd_takes_in_one_transaction(
    locks: keymutex.Locks, etcd: Etcd
) -> None:
    """One read per lease in one transaction: etcd refused a batch of more than 128
    ("too many operations in txn request"), so a Locks renewing more leases than that
    (or catching up after a stall) failed every batch until the leases were lost."""
    from keymutex.stores.etcd import MAX_TXN_OPS

    count = MAX_TXN_OPS + 72
    leases = [locks.acquire(f"job:{n}", ttl=10.0) for n in range(count)]
    before = etcd.requests()
    outcomes = locks._store.renew_many(
        [keymutex._store.RenewRequest(x.key, x.token, 10.0) for x in leases]
    )
    assert [outcome.ok for outcome in outcomes] == [True] * count
    assert made(before, etcd.requests())["Txn"] == 2
    for lease in leases:
        lease.release()


def test_the_fence_is_the_keys_etcd_revision_and_grows_across_expiry_and_steal(
    make_pair: tuple[keymutex.Locks, keymutex.Locks], etcd: Etcd
) -> None:
    alice, bob = make_pair
    first = alice.acquire("row", ttl=0.5)
    kv = etcd.kv("row")
    assert kv is not None
    assert first.fence == int(kv["mod_revision"]) == int(kv["create_revision"])
    # Expiry: etcd deletes the key itself; the waiter is woken by the deletion.
    second = bob.acquire("row", timeout=10)
    assert second.fence > first.fence
    # Steal: an overwrite, a newer revision.
    third = alice.acquire("row", steal=True, timeout=0)
    assert third.fence > second.fence
    kv = etcd.kv("row")
    assert kv is not None
    assert int(kv["mod_revision"]) == third.fence
    with pytest.raises(keymutex.LockLost):
        second.release()
    # A renewal with another TTL moves the key to another etcd lease, fence unchanged.
    third.renew(ttl=40)
    assert alice.holder("row").fence == third.fence  # type: ignore[union-attr]
    assert third.fence < int(etcd.kv("row")["mod_revision"])  # type: ignore[index]
    third.release()


@pytest.fixture
def make_pair(etcd_url: str, namespace: str) -> Iterator[tuple[keymutex.Locks, keymutex.Locks]]:
    with (
        keymutex.Locks(etcd_url, namespace=namespace, owner="alice") as alice,
        keymutex.Locks(etcd_url, namespace=namespace, owner="bob") as bob,
    ):
        yield alice, bob


def test_etcd_deletes_the_key_when_the_lease_expires(locks: keymutex.Locks, etcd: Etcd) -> None:
    # 0.9 s, not less: a clean-clone CI run on a loaded machine spent 0.3 s between the
    # grant and the look at ``remaining`` (two reads of etcd's JSON gateway).
    lease = locks.acquire("job", ttl=0.9)
    remaining = lease.remaining
    kv = etcd.kv("job")
    assert kv is not None
    lease_id = int(kv["lease"])
    assert etcd.granted_ttl(lease_id) == etcd_ttl(0.9) == 1  # whole seconds, rounded up
    assert 0 < remaining <= 0.9  # the client counts the TTL it asked for
    started = time.monotonic()
    while etcd.kv("job") is not None:
        assert time.monotonic() - started < 5, "etcd kept an expired lease's key"
        time.sleep(0.02)
    # ceil(0.9) = 1 s, plus up to 0.5 s for etcd's expiry sweep.
    assert time.monotonic() - started < 2.5
    assert lease_id not in etcd.lease_ids()
    assert locks.holder("job") is None


@pytest.mark.parametrize(
    ("ttl", "seconds"), [(0.001, 1), (0.3, 1), (1.0, 1), (1.000001, 2), (29.5, 30), (30.0, 30)]
)
def test_etcd_ttl_rounds_up_to_whole_seconds(ttl: float, seconds: int) -> None:
    assert etcd_ttl(ttl) == seconds


def waited_handoff(locks: keymutex.Locks, holder: keymutex.Lease) -> float:
    got: list[float] = []

    def wait() -> None:
        lease = locks.acquire(holder.key, timeout=10)
        got.append(time.monotonic())
        lease.release()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.5)  # parked on the watch (the safety-net recheck is put off: no_rechecks)
    released = time.monotonic()
    holder.release()
    thread.join(10)
    assert got, "the waiter did not get the key"
    return got[0] - released


@pytest.mark.usefixtures("no_rechecks")
def test_a_release_wakes_a_waiter_through_the_watch_promptly(
    make_pair: tuple[keymutex.Locks, keymutex.Locks],
) -> None:
    alice, bob = make_pair
    delays = [waited_handoff(bob, alice.acquire("doc", timeout=0)) for _ in range(3)]
    # Without the watch the waiter would only look again at its recheck, a minute away.
    assert max(delays) < NOTIFIED, delays


@pytest.mark.asyncio
@pytest.mark.usefixtures("no_rechecks")
async def test_a_release_wakes_an_async_waiter_promptly(etcd_url: str, namespace: str) -> None:
    async with (
        keymutex.AsyncLocks(etcd_url, namespace=namespace) as alice,
        keymutex.AsyncLocks(etcd_url, namespace=namespace) as bob,
    ):
        for _ in range(3):
            held = await alice.acquire("doc", timeout=0)
            waiting = asyncio.create_task(bob.acquire("doc", timeout=10))
            await asyncio.sleep(0.5)
            released = time.monotonic()
            await held.release()
            lease = await waiting
            assert time.monotonic() - released < NOTIFIED
            await lease.release()


def test_nothing_is_left_in_etcd_after_release(locks: keymutex.Locks, etcd: Etcd) -> None:
    before = etcd.lease_ids()
    leases = [locks.acquire(f"k{n}", info={"n": n}) for n in range(5)]
    moved = locks.acquire("moved", ttl=2)
    moved.renew(ttl=30)  # on a second etcd lease now
    assert len(etcd.namespace_keys()) == 6
    for lease in [*leases, moved]:
        lease.release()
    assert etcd.namespace_keys() == []
    assert etcd.lease_ids() <= before


def test_the_token_is_never_stored_in_etcd(locks: keymutex.Locks, etcd: Etcd) -> None:
    lease = locks.acquire("doc", info={"user": "alice"})
    kv = etcd.kv("doc")
    assert kv is not None
    assert lease.token not in base64.b64decode(kv["value"]).decode()
    assert lease.token not in repr(locks.holder("doc"))
    lease.release()


def test_a_refused_try_leaves_no_lease_behind(
    make_pair: tuple[keymutex.Locks, keymutex.Locks], etcd: Etcd
) -> None:
    alice, bob = make_pair
    held = alice.acquire("doc")
    before = etcd.lease_ids()
    with pytest.raises(keymutex.Locked):
        bob.acquire("doc", timeout=0)
    with pytest.raises(keymutex.Locked):
        bob.acquire("doc", timeout=0.3)  # a waiter: keeps its lease between tries
    assert etcd.lease_ids() <= before
    held.release()


@pytest.mark.parametrize(
    "url",
    [
        "etcd://",
        "etcd://host:notaport",
        "etcd://host:70000",
        "etcd://h1:2379,:2380",
        "etcd://host:2379/prefix",
        "etcd://host:2379#fragment",
        "etcd://host:2379?nope=3",
        "etcd://host:2379?ca_file=/ca.pem",  # TLS settings are for etcds://
        "etcd://host:2379?password=pw",  # credentials go before the host
        "etcd://host:2379?timeout=soon",
        "etcd://host:2379?timeout=3&timeout=4",
        "etcd://user@host:2379",  # a user without a password
        "ftp://host:2379",
        "etcd://[::1",
    ],
)
def test_bad_urls_are_refused_before_connecting(url: str) -> None:
    with pytest.raises(ValueError, match="etcd"):
        keymutex.Locks(url)


def test_options_are_checked_before_connecting() -> None:
    with pytest.raises(TypeError, match="timeout"):
        keymutex.Locks("etcd://127.0.0.1:1", passwd="x")
    with pytest.raises(ValueError, match="timeout"):
        keymutex.Locks("etcd://127.0.0.1:1", timeout=0)
    with pytest.raises(TypeError, match="timeout"):
        keymutex.Locks("etcd://127.0.0.1:1", timeout=True)


def test_an_unreachable_etcd_is_a_store_error() -> None:
    with socket_nobody_listens_on() as port, keymutex.Locks(f"etcd://127.0.0.1:{port}") as locks:
        with pytest.raises(keymutex.StoreError) as failed:
            locks.acquire("doc", timeout=0)
        assert isinstance(failed.value.__cause__, httpx.ConnectError)


def test_a_dead_endpoint_is_skipped(etcd_url: str, namespace: str) -> None:
    with socket_nobody_listens_on() as port:
        url = f"etcd://127.0.0.1:{port},{etcd_url.removeprefix('etcd://')}"
        with keymutex.Locks(url, namespace=namespace) as locks:
            locks.acquire("doc", timeout=0).release()


def test_endpoints_tell_their_listeners_when_requests_move_off_a_url() -> None:
    """What moves a store's watch stream along with its steps (the stream on a paused
    member: tests/integration/test_etcd_cluster.py)."""
    endpoints = etcd_store._Endpoints(["http://a", "http://b"])
    left: list[str] = []
    endpoints.when_left(left.append)
    endpoints.failed("http://b")  # not in use: nothing moves
    assert (endpoints.current(), left) == ("http://a", [])
    endpoints.failed("http://a")
    assert (endpoints.current(), left) == ("http://b", ["http://a"])
    endpoints.failed("http://a")  # another request failed there too: moved already
    assert (endpoints.current(), left) == ("http://b", ["http://a"])
    alone = etcd_store._Endpoints(["http://a"])
    alone.when_left(left.append)
    alone.failed("http://a")  # one endpoint: nowhere to go, the stream stays
    assert left == ["http://a"]


class socket_nobody_listens_on:  # a context manager named like the function it acts as
    def __enter__(self) -> int:
        from _etcd_servers import free_port

        return free_port()

    def __exit__(self, *exc: object) -> None:
        return None


# -- waiting: one queue per key, served in order, one waiter woken per release ---------


class Waiting:
    """An ``acquire`` waiting in a thread of its own."""

    def __init__(self, locks: keymutex.Locks, key: str, **options: Any) -> None:
        self.lease: keymutex.Lease | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(locks, key, options), daemon=True)
        self._thread.start()

    def _run(self, locks: keymutex.Locks, key: str, options: dict[str, Any]) -> None:
        try:
            self.lease = locks.acquire(key, **{"timeout": 10, **options})
        except BaseException as exc:  # handed to the test by result()
            self.error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> keymutex.Lease:
        self._thread.join(15)
        assert self.done(), "still waiting"
        if self.error is not None:
            raise self.error
        assert self.lease is not None
        return self.lease


@pytest.fixture
def clients(etcd_url: str, namespace: str) -> Iterator[list[keymutex.Locks]]:
    """Four clients of the namespace (``w0`` … ``w3``), connected, as four processes are."""
    made = [keymutex.Locks(etcd_url, namespace=namespace, owner=f"w{n}") for n in range(4)]
    try:
        for client in made:
            client.acquire("warm-up", timeout=0).release()
        yield made
    finally:
        for client in made:
            client.close()


@pytest.mark.usefixtures("no_rechecks")
def test_a_contended_acquire_is_one_grant_two_transactions_and_a_ttl_read(
    clients: list[keymutex.Locks], etcd: Etcd
) -> None:
    alice, bob = clients[:2]
    held = alice.acquire("doc", timeout=0)
    before = etcd.requests()
    waiting = Waiting(bob, "doc")
    etcd.wait_for_queue("doc", 1)
    etcd.wait_for_requests(before, "Watch")  # opened by bob's reader thread, after the refusal
    queued = made(before, etcd.requests())
    queued.pop("Range", None)  # the test's own look at the queue
    # One grant for the whole acquire; the refused transaction queued bob; the holder's
    # TTL was read for the refusal's Holder; the watch stream opened.
    assert queued == {"LeaseGrant": 1, "Txn": 1, "LeaseTimeToLive": 1, "Watch": 1}
    held.release()
    lease = waiting.result()
    requests = made(before, etcd.requests())
    requests.pop("Range", None)
    # Then alice's revoke and bob's claiming transaction: nothing else. Bob waited far
    # less than 2 % of his 30 s TTL: no keep-alive, his lease has almost all of it left.
    assert requests == {
        "LeaseGrant": 1,
        "Txn": 2,
        "LeaseTimeToLive": 1,
        "Watch": 1,
        "LeaseRevoke": 1,
    }
    assert lease.fence > held.fence
    assert 0.97 * 30 < lease.remaining <= 30
    lease.release()
    assert etcd.namespace_keys() == []


@pytest.mark.usefixtures("no_rechecks")
def test_a_release_wakes_only_the_next_waiter_first_come_first_served(
    clients: list[keymutex.Locks], etcd: Etcd
) -> None:
    held = clients[0].acquire("doc", timeout=0)
    waiting = []
    for n, client in enumerate(clients[1:], 1):
        waiting.append(Waiting(client, "doc"))
        etcd.wait_for_queue("doc", n)  # queued in this order
    for n, next_one in enumerate(waiting, 1):
        before, puts = etcd.requests(), etcd.puts()
        held.release()
        lease = next_one.result()
        assert lease.owner == f"w{n}"
        assert lease.fence > held.fence
        time.sleep(0.2)  # time for a woken herd to show itself
        # One revoke, one write: the claim. A waiter woken out of turn would write too
        # (its refused claim puts its entry again); the waiters behind only read, at
        # their once-a-second recheck.
        assert made(before, etcd.requests()).get("LeaseRevoke") == 1
        assert etcd.puts() - puts == 1
        held = lease
    held.release()
    assert etcd.namespace_keys() == []


def test_a_waiter_that_gives_up_revokes_its_lease_and_wakes_nobody_early(
    clients: list[keymutex.Locks], etcd: Etcd
) -> None:
    alice, bob, carol = clients[:3]
    held = alice.acquire("doc", timeout=0)
    giving_up = Waiting(bob, "doc", timeout=1.0)
    etcd.wait_for_queue("doc", 1)
    patient = Waiting(carol, "doc")
    bobs, _ = etcd.wait_for_queue("doc", 2)
    with pytest.raises(keymutex.Locked) as refused:
        giving_up.result()
    assert refused.value.holder is not None
    assert refused.value.holder.fence == held.fence
    # Bob's lease is revoked, his place in the queue with it.
    (carols,) = etcd.wait_for_queue("doc", 1)
    assert carols["key"] != bobs["key"]
    assert int(bobs["lease"]) not in etcd.lease_ids()
    time.sleep(0.3)
    assert not patient.done()  # alice still holds: carol was not handed anything
    assert alice.holder("doc").fence == held.fence  # type: ignore[union-attr]
    held.release()
    assert patient.result().owner == "w2"


def test_view_keeps_what_the_stream_says_while_a_try_is_under_way() -> None:
    holder = b"km/1:n/doc"
    ahead = holder + b"\0" + b"%016x" % 7
    behind = holder + b"\0" + b"%016x" % 9
    view = _View(holder)
    # A try is under way; the holder is released (revision 11) before its refusal
    # (seen at revision 10) is settled: the refusal's view must not hide it.
    view.begin()
    assert not view.hear(11, holder)
    assert view.settle(_Refusal(10, frozenset(), held=True))
    # Deletions the refusal already saw change nothing.
    view.begin()
    assert not view.hear(9, holder)
    assert not view.settle(_Refusal(10, frozenset({ahead}), held=True))
    # Someone behind leaving, or the one ahead while the key is held: no ring.
    assert not view.hear(12, behind)
    assert not view.hear(13, ahead)
    # The key freed with nobody ahead any more: its turn.
    assert view.hear(14, holder)
    # A view that is not known (before any refusal): every deletion rings.
    assert _View(holder).hear(1, behind)


@pytest.mark.usefixtures("no_rechecks")
def test_no_wake_up_is_missed_when_the_release_lands_before_the_refusal_is_noted(
    clients: list[keymutex.Locks], etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, bob = clients[:2]
    # Bob's watch stream is open already (it lingers after a wait on another key).
    other = alice.acquire("other", timeout=0)
    with pytest.raises(keymutex.Locked):
        bob.acquire("other", timeout=0.2)
    other.release()
    held = alice.acquire("doc", timeout=0)
    store = bob._store
    assert isinstance(store, etcd_store.EtcdStore)
    run = store._transport.run
    released_at: list[float] = []

    def refused_then_released(flow: Any, what: str) -> Any:
        done = run(flow, what)
        if isinstance(done, etcd_store._Acquired) and done.refusal and not released_at:
            # The release lands, and bob's stream delivers it, before bob's store has
            # taken in the refusal: only the deletion it kept can wake bob.
            held.release()
            released_at.append(time.monotonic())
            revision = int(etcd.post("/v3/kv/range", {"key": "AA=="})["header"]["revision"])  # type: ignore[index]
            while store._hub._state.next <= revision:
                assert time.monotonic() - released_at[0] < 5, "the stream did not deliver"
                time.sleep(0.005)
        return done

    monkeypatch.setattr(store._transport, "run", refused_then_released)
    lease = bob.acquire("doc", timeout=10)
    # Woken by the deletion it kept, not by its recheck (a minute away).
    assert time.monotonic() - released_at[0] < NOTIFIED
    assert lease.fence > held.fence
    lease.release()


def test_a_try_that_does_not_wait_does_not_jump_the_queue_and_a_dead_waiters_turn_passes(
    clients: list[keymutex.Locks], etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(etcd_store, "HANDOVER_GRACE", 0.5)
    alice, bob = clients[:2]
    held = alice.acquire("doc", timeout=0)
    # A waiter whose process died: its entry is first in the queue, its lease alive.
    dead = int(str(etcd.post("/v3/lease/grant", {"TTL": 60})["ID"]))
    entry = base64.b64encode(etcd.layout.entry("doc", dead)).decode()
    etcd.post("/v3/kv/put", {"key": entry, "value": "", "lease": dead})
    held.release()
    with pytest.raises(keymutex.Locked) as refused:
        bob.acquire("doc", timeout=0)
    assert refused.value.holder is None  # free, but someone is queued
    started = time.monotonic()
    lease = bob.acquire("doc", timeout=10)
    # The dead waiter's turn passed after the grace, at bob's next look (a recheck).
    assert time.monotonic() - started < 3
    assert lease.fence > held.fence
    assert all(kv["key"] != entry for kv in etcd.queue("doc"))
    lease.release()
    etcd.post("/v3/lease/revoke", {"ID": dead})


def test_a_long_wait_keeps_its_place_in_the_queue(clients: list[keymutex.Locks]) -> None:
    alice, bob, carol = clients[:3]
    held = alice.acquire("doc", timeout=0)
    # Bob's etcd lease (1 s asked, etcd's 2 s minimum granted) would lapse three times
    # over; his rechecks keep it, and his place before carol.
    first = Waiting(bob, "doc", ttl=1.0)
    time.sleep(0.3)
    second = Waiting(carol, "doc")
    time.sleep(4)
    assert not first.done()
    held.release()
    lease = first.result()
    assert lease.owner == "w1"
    assert 0 < lease.remaining <= 1.0
    lease.release()
    assert second.result().owner == "w2"


def test_a_release_by_a_token_that_only_waits_is_a_loss_and_keeps_its_place(
    clients: list[keymutex.Locks], etcd: Etcd
) -> None:
    """The token's lease held only its queue entry, not the key: the release revoked it
    (ending the wait) and said released. API.md: a token that does not hold the key
    raises LockLost; the wait is the waiting client's business."""
    holding, waiting, elsewhere = clients[0], clients[1], clients[2]
    lease = holding.acquire("k", timeout=0)
    store = waiting._store
    waiter = store.waiter("k")
    token = "w" * 24
    args = {"ttl": 10.0, "owner": "w1", "info": None, "steal": False, "waiter": waiter}
    try:
        assert not store.try_acquire("k", token=token, **args).ok  # queued
        before = etcd.requests()
        with pytest.raises(keymutex.LockLost):
            elsewhere.release("k", token)  # a release by token, from another process
        requests = made(before, etcd.requests())
        assert requests.get("Range") == 1  # read first: not its key …
        assert "LeaseRevoke" not in requests  # … so its lease is left alone
        held = holding.holder("k")
        assert held is not None
        assert held.fence == lease.fence
        lease.release()
        assert store.try_acquire("k", token=token, **args).ok  # its turn, its place kept
        holding.release("k", token)
    finally:
        waiter.close()


def test_holders_leave_the_queue_out(clients: list[keymutex.Locks], etcd: Etcd) -> None:
    alice, bob = clients[:2]
    held = alice.acquire("doc", timeout=0)
    waiting = Waiting(bob, "doc")
    etcd.wait_for_queue("doc", 1)
    assert len(etcd.namespace_keys()) == 2  # the key and bob's entry
    assert [h.fence for h in alice.holders()] == [held.fence]
    assert [h.fence for h in alice.holders("do")] == [held.fence]
    held.release()
    waiting.result().release()


@pytest.mark.asyncio
async def test_a_cancelled_async_waiter_leaves_the_queue(
    etcd_url: str, namespace: str, etcd: Etcd
) -> None:
    async with (
        keymutex.AsyncLocks(etcd_url, namespace=namespace) as alice,
        keymutex.AsyncLocks(etcd_url, namespace=namespace) as bob,
    ):
        held = await alice.acquire("doc", timeout=0)
        waiting = asyncio.create_task(bob.acquire("doc", timeout=10))
        (entry,) = await asyncio.to_thread(etcd.wait_for_queue, "doc", 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert etcd.queue("doc") == []
        assert int(entry["lease"]) not in etcd.lease_ids()
        await held.release()
        assert (await bob.acquire("doc", timeout=0)).fence > held.fence


# -- a release by token from another store, racing what the holder does meanwhile -------
#
# A store that was not granted the key to a token (a release by token from another
# process, or after the granting Locks is gone) reads the key first, then revokes the
# token's lease it found the key on, then the token's other one. A hook on the real
# HTTP client of the releasing store runs what the holder does at the one moment that
# matters: after that read, before the first revoke reaches etcd.


class Interleaving:
    """The requests a store sent (path, and the lease of a revoke); ``between`` ran
    once, just before the first revoke went."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int | None]] = []
        self.ran = False

    def runs_before(self, url: str, content: bytes) -> bool:
        """Note a request about to go; whether ``between`` must run first."""
        path = urlsplit(url).path
        revoke = path == "/v3/lease/revoke"
        self.sent.append((path, int(json.loads(content)["ID"]) if revoke else None))
        first, self.ran = revoke and not self.ran, self.ran or revoke
        return first

    def revoked(self) -> list[int]:
        return [lease for path, lease in self.sent if lease is not None]


def interleave(
    monkeypatch: pytest.MonkeyPatch, locks: keymutex.Locks, between: Callable[[], object]
) -> Interleaving:
    store = locks._store
    assert isinstance(store, etcd_store.EtcdStore)
    client = store._transport._client
    post = client.post
    seen = Interleaving()

    def hooked(url: str, **options: Any) -> httpx.Response:
        if seen.runs_before(url, options["content"]):
            between()
        return post(url, **options)

    monkeypatch.setattr(client, "post", hooked)
    return seen


def interleave_async(
    monkeypatch: pytest.MonkeyPatch,
    locks: keymutex.AsyncLocks,
    between: Callable[[], Awaitable[object]],
) -> Interleaving:
    store = locks._store._store  # type: ignore[attr-defined] # within StoreOfTheLoop
    assert isinstance(store, etcd_store.AsyncEtcdStore)
    client = store._transport._client
    post = client.post
    seen = Interleaving()

    async def hooked(url: str, **options: Any) -> httpx.Response:
        if seen.runs_before(url, options["content"]):
            await between()
        return await post(url, **options)

    monkeypatch.setattr(client, "post", hooked)
    return seen


async def nothing() -> None:
    return None


def lease_of(etcd: Etcd, key: str) -> int:
    """The etcd lease ``key`` is attached to."""
    kv = etcd.kv(key)
    assert kv is not None, f"{key!r} is not held"
    return int(kv["lease"])


def test_a_release_by_token_finds_the_key_moved_to_the_tokens_other_lease_meanwhile(
    etcd_url: str, namespace: str, etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder renewed with another TTL between the release's read and its revoke:
    the key moved to the token's other etcd lease, and the lease the read found was
    revoked by the move. A release that revoked only that one (as before 4a0896f)
    found nothing, raised LockLost for a key its token held, and left the key locked
    for the renewal's whole TTL (40 s) after the holder asked to let it go."""
    with (
        keymutex.Locks(etcd_url, namespace=namespace, owner="alice") as alice,
        keymutex.Locks(etcd_url, namespace=namespace, owner="web") as elsewhere,
    ):
        lease = alice.acquire("doc", ttl=10, renew=False, timeout=0)
        first, second = etcd.layout.lease_ids("doc", lease.token)
        assert lease_of(etcd, "doc") == first
        moved: list[tuple[int, bool]] = []

        def renewal_with_another_ttl() -> None:
            lease.renew(ttl=40)  # 10 s -> 40 s: the key moves to the token's other lease
            moved.append((lease_of(etcd, "doc"), first in etcd.lease_ids()))

        seen = interleave(monkeypatch, elsewhere, renewal_with_another_ttl)
        elsewhere.release("doc", lease.token)  # another store: never granted this token
        # The read found the key on the first lease; the move ran before its revoke.
        assert seen.sent[:2] == [("/v3/kv/range", None), ("/v3/lease/revoke", first)]
        assert moved == [(second, False)]  # the lease the read found is gone
        assert set(seen.revoked()) <= {first, second}  # only the token's own leases
        assert etcd.kv("doc") is None
        assert not {first, second} & etcd.lease_ids()
        alice.acquire("doc", timeout=0).release()  # free at once, not 40 s later


@pytest.mark.asyncio
async def test_an_async_release_by_token_finds_the_key_moved_to_the_tokens_other_lease(
    etcd_url: str, namespace: str, etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the sync test: AsyncLocks must not say LockLost for a key its token held, nor
    leave it locked for the renewal's whole TTL."""
    async with (
        keymutex.AsyncLocks(etcd_url, namespace=namespace, owner="alice") as alice,
        keymutex.AsyncLocks(etcd_url, namespace=namespace, owner="web") as elsewhere,
    ):
        lease = await alice.acquire("doc", ttl=10, renew=False, timeout=0)
        first, second = etcd.layout.lease_ids("doc", lease.token)
        assert lease_of(etcd, "doc") == first
        moved: list[tuple[int, bool]] = []

        async def renewal_with_another_ttl() -> None:
            await lease.renew(ttl=40)
            moved.append((lease_of(etcd, "doc"), first in etcd.lease_ids()))

        seen = interleave_async(monkeypatch, elsewhere, renewal_with_another_ttl)
        await elsewhere.release("doc", lease.token)
        assert seen.sent[:2] == [("/v3/kv/range", None), ("/v3/lease/revoke", first)]
        assert moved == [(second, False)]
        assert set(seen.revoked()) <= {first, second}
        assert etcd.kv("doc") is None
        assert not {first, second} & etcd.lease_ids()
        await (await alice.acquire("doc", timeout=0)).release()


def bob_kept_the_key(
    etcd: Etcd,
    seen: Interleaving,
    lost: keymutex.LockLost,
    ids: tuple[int, int],
    bobs: keymutex.Lease | keymutex.AsyncLease,
) -> None:
    """The release by alice's token read the key, revoked her leases alone, and said
    LockLost naming bob, whose key is still on his live lease."""
    assert seen.sent[:2] == [("/v3/kv/range", None), ("/v3/lease/revoke", ids[0])]
    assert lost.holder is not None
    assert (lost.holder.owner, lost.holder.fence) == ("bob", bobs.fence)
    assert set(seen.revoked()) <= set(ids)
    bobs_lease = etcd.layout.lease_ids("doc", bobs.token)[0]
    assert lease_of(etcd, "doc") == bobs_lease
    assert bobs_lease in etcd.lease_ids()


def test_a_release_by_token_racing_a_handover_leaves_the_new_holders_lease_alone(
    etcd_url: str, namespace: str, etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the release's read (the key on the token's lease) and its revoke, the
    holder released the key and bob took it. The release must say LockLost, naming
    bob, and revoke only the token's own leases: one that went after the key where it
    is now would revoke bob's lease, and etcd delete his key while he believed he held
    it (anyone could take it)."""
    with (
        keymutex.Locks(etcd_url, namespace=namespace, owner="alice") as alice,
        keymutex.Locks(etcd_url, namespace=namespace, owner="bob") as bob,
        keymutex.Locks(etcd_url, namespace=namespace, owner="web") as elsewhere,
    ):
        lease = alice.acquire("doc", ttl=10, renew=False, timeout=0)
        ids = etcd.layout.lease_ids("doc", lease.token)
        taken: list[keymutex.Lease] = []

        def handover() -> None:
            lease.release()
            taken.append(bob.acquire("doc", ttl=10, renew=False, timeout=0))

        seen = interleave(monkeypatch, elsewhere, handover)
        with pytest.raises(keymutex.LockLost) as lost:
            elsewhere.release("doc", lease.token)
        (bobs,) = taken
        bob_kept_the_key(etcd, seen, lost.value, ids, bobs)
        bobs.renew()
        bobs.release()


@pytest.mark.asyncio
async def test_an_async_release_by_token_racing_a_handover_leaves_the_new_holder_alone(
    etcd_url: str, namespace: str, etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the sync test: bob's lease must outlive a release by a token he took over from."""
    async with (
        keymutex.AsyncLocks(etcd_url, namespace=namespace, owner="alice") as alice,
        keymutex.AsyncLocks(etcd_url, namespace=namespace, owner="bob") as bob,
        keymutex.AsyncLocks(etcd_url, namespace=namespace, owner="web") as elsewhere,
    ):
        lease = await alice.acquire("doc", ttl=10, renew=False, timeout=0)
        ids = etcd.layout.lease_ids("doc", lease.token)
        taken: list[keymutex.AsyncLease] = []

        async def handover() -> None:
            await lease.release()
            taken.append(await bob.acquire("doc", ttl=10, renew=False, timeout=0))

        seen = interleave_async(monkeypatch, elsewhere, handover)
        with pytest.raises(keymutex.LockLost) as lost:
            await elsewhere.release("doc", lease.token)
        (bobs,) = taken
        bob_kept_the_key(etcd, seen, lost.value, ids, bobs)
        await bobs.renew()
        await bobs.release()


def test_a_stale_tokens_release_by_token_is_lock_lost_and_revokes_nothing(
    etcd_url: str, namespace: str, etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bob took the key over; alice's old token, released by token from another
    process, must raise LockLost naming bob and revoke nothing. The key it reads is on
    bob's lease: a release that revoked the lease it found would have said released,
    and etcd deleted bob's key under him."""
    with (
        keymutex.Locks(etcd_url, namespace=namespace, owner="alice") as alice,
        keymutex.Locks(etcd_url, namespace=namespace, owner="bob") as bob,
        keymutex.Locks(etcd_url, namespace=namespace, owner="web") as elsewhere,
    ):
        lease = alice.acquire("doc", ttl=10, renew=False, timeout=0)
        lease.renew(ttl=40)  # on the token's second lease: both have been used
        stolen = bob.acquire("doc", ttl=10, renew=False, steal=True, timeout=0)
        bobs_lease = lease_of(etcd, "doc")
        assert bobs_lease not in etcd.layout.lease_ids("doc", lease.token)
        seen = interleave(monkeypatch, elsewhere, lambda: None)
        with pytest.raises(keymutex.LockLost) as lost:
            elsewhere.release("doc", lease.token)
        assert lost.value.holder is not None
        assert (lost.value.holder.owner, lost.value.holder.fence) == ("bob", stolen.fence)
        assert seen.revoked() == []
        assert lease_of(etcd, "doc") == bobs_lease
        assert bobs_lease in etcd.lease_ids()
        stolen.renew()
        stolen.release()


@pytest.mark.asyncio
async def test_an_async_stale_tokens_release_by_token_is_lock_lost_and_revokes_nothing(
    etcd_url: str, namespace: str, etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the sync test: AsyncLocks must not delete bob's key for alice's old token."""
    async with (
        keymutex.AsyncLocks(etcd_url, namespace=namespace, owner="alice") as alice,
        keymutex.AsyncLocks(etcd_url, namespace=namespace, owner="bob") as bob,
        keymutex.AsyncLocks(etcd_url, namespace=namespace, owner="web") as elsewhere,
    ):
        lease = await alice.acquire("doc", ttl=10, renew=False, timeout=0)
        await lease.renew(ttl=40)
        stolen = await bob.acquire("doc", ttl=10, renew=False, steal=True, timeout=0)
        bobs_lease = lease_of(etcd, "doc")
        assert bobs_lease not in etcd.layout.lease_ids("doc", lease.token)
        seen = interleave_async(monkeypatch, elsewhere, nothing)
        with pytest.raises(keymutex.LockLost) as lost:
            await elsewhere.release("doc", lease.token)
        assert lost.value.holder is not None
        assert (lost.value.holder.owner, lost.value.holder.fence) == ("bob", stolen.fence)
        assert seen.revoked() == []
        assert lease_of(etcd, "doc") == bobs_lease
        assert bobs_lease in etcd.lease_ids()
        await stolen.renew()
        await stolen.release()


def around_posts(
    monkeypatch: pytest.MonkeyPatch,
    locks: keymutex.Locks,
    before: Callable[[str, int | None], object],
    after: Callable[[str, int | None], object],
) -> None:
    """Run ``before`` and ``after`` each request of ``locks``' store (with its path, and
    the lease of a revoke)."""
    store = locks._store
    assert isinstance(store, etcd_store.EtcdStore)
    client = store._transport._client
    post = client.post

    def hooked(url: str, **options: Any) -> httpx.Response:
        path = urlsplit(url).path
        lease = int(json.loads(options["content"])["ID"]) if path == "/v3/lease/revoke" else None
        before(path, lease)
        reply = post(url, **options)
        after(path, lease)
        return reply

    monkeypatch.setattr(client, "post", hooked)


def test_a_release_by_token_between_a_moves_put_and_its_revoke_releases_the_key(
    etcd_url: str, namespace: str, etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The narrower window of the same race: the release's revoke of the lease it read
    lands after the holder's move put the key on the token's other lease, and before
    the move revoked the old one. That revoke found its lease (holding nothing by then):
    the release said released, and the key stayed held for the renewal's 40 s."""
    with (
        keymutex.Locks(etcd_url, namespace=namespace, owner="alice") as alice,
        keymutex.Locks(etcd_url, namespace=namespace, owner="web") as elsewhere,
    ):
        lease = alice.acquire("doc", ttl=10, renew=False, timeout=0)
        first, second = etcd.layout.lease_ids("doc", lease.token)
        read, moved, revoked = threading.Event(), threading.Event(), threading.Event()
        by_release: list[int] = []

        def move_waits_for_the_release(path: str, lease: int | None) -> None:
            # The move's first revoke is of the lease it moved from: the put is done.
            if lease is not None and not moved.is_set():
                moved.set()
                assert revoked.wait(10), "the release never revoked"

        def release_waits_for_the_put(path: str, lease: int | None) -> None:
            if lease is not None:
                by_release.append(lease)
                if not read.is_set():  # its read went: let the holder move the key
                    read.set()
                    assert moved.wait(10), "the move never put the key on the other lease"

        def release_revoked(path: str, lease: int | None) -> None:
            if lease is not None:
                revoked.set()

        around_posts(monkeypatch, alice, move_waits_for_the_release, lambda *_: None)
        around_posts(monkeypatch, elsewhere, release_waits_for_the_put, release_revoked)
        said: list[object] = []
        release = threading.Thread(
            target=lambda: said.append(elsewhere.release("doc", lease.token))
        )
        release.start()
        assert read.wait(10), "the release never read the key"
        lease.renew(ttl=40)  # 10 s -> 40 s: the key moves to the token's second lease
        release.join(10)
        assert said == [None], "the release by token did not finish"
        assert by_release[0] == first  # the lease its read found the key on
        assert set(by_release) == {first, second}  # then the other: only the token's own
        assert etcd.kv("doc") is None, "the key stayed held after its release"
        alice.acquire("doc", timeout=0).release()  # free at once, not 40 s later


def test_a_release_by_token_racing_two_moves_does_not_leave_the_key_held(
    etcd_url: str, namespace: str, etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two renewals with other TTLs between the release's read and its revokes: the
    first moved the key from lease a to b (so the revoke of a found nothing), the
    second put it back on a and revoked b after the release had revoked b (found,
    empty by then). The release said released, and the key stayed on a."""
    with (
        keymutex.Locks(etcd_url, namespace=namespace, owner="alice") as alice,
        keymutex.Locks(etcd_url, namespace=namespace, owner="web") as elsewhere,
    ):
        lease = alice.acquire("doc", ttl=10, renew=False, timeout=0)
        a, b = etcd.layout.lease_ids("doc", lease.token)
        put_back, revoked_b = threading.Event(), threading.Event()
        second_move = threading.Event()
        by_release: list[int] = []

        def second_move_waits_for_the_release(path: str, lease_id: int | None) -> None:
            # The second move's revoke of b comes after its put on a.
            if lease_id == b and second_move.is_set() and not put_back.is_set():
                put_back.set()
                assert revoked_b.wait(10), "the release never revoked b"

        def release_meets_both_moves(path: str, lease_id: int | None) -> None:
            if lease_id is None:
                return
            by_release.append(lease_id)
            if len(by_release) == 1:  # before revoking a: the key moves to b
                lease.renew(ttl=40)
            elif len(by_release) == 2:  # before revoking b: it moves back onto a
                second_move.set()
                threading.Thread(target=lambda: lease.renew(ttl=10), daemon=True).start()
                assert put_back.wait(10), "the second move never put the key back on a"

        def release_revoked(path: str, lease_id: int | None) -> None:
            if lease_id == b:
                revoked_b.set()

        around_posts(monkeypatch, alice, second_move_waits_for_the_release, lambda *_: None)
        around_posts(monkeypatch, elsewhere, release_meets_both_moves, release_revoked)
        elsewhere.release("doc", lease.token)
        assert by_release[:2] == [a, b]
        assert set(by_release) <= {a, b}  # only the token's own leases
        assert etcd.kv("doc") is None, "the release said released, yet the key is held"
        alice.acquire("doc", timeout=0).release()  # free at once, not 10 s later


def test_renewals_do_not_move_a_lease_that_etcds_minimum_ttl_keeps_long(
    tmp_path: Any, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: with etcd's minimum lease TTL at 5 s (an election timeout of
    3 s, as across regions), every renewal of a 1-s lease moved its key to the token's
    other etcd lease (a grant, a transaction and a revoke: 2 raft writes more) to
    shorten it, and etcd granted 5 s again. The first move shows the minimum; no
    renewal moves the key after it."""
    from _etcd_servers import cluster

    moves: list[str] = []
    move = etcd_store._move

    def counted(layout: _Layout, request: Any, *args: Any) -> Any:
        moves.append(request.key)
        return (yield from move(layout, request, *args))

    monkeypatch.setattr(etcd_store, "_move", counted)
    with (
        cluster(tmp_path, members=1, heartbeat_ms=300, election_ms=3000) as slow_elections,
        keymutex.Locks(slow_elections.url, namespace=namespace) as locks,
    ):
        lease = locks.acquire("k", ttl=1.0)
        for _ in range(5):
            lease.renew()
        assert moves == ["k"]
        held = locks.holder("k")
        assert held is not None
        assert held.fence == lease.fence
        lease.release()


def test_a_release_after_a_renewal_that_failed_half_way_frees_the_key(
    etcd_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a renewal to another TTL moves the key to its token's other
    lease, then revokes the first; when that revoke failed (etcd unreachable for that
    one request) both leases lived on, the release revoked the first, said released,
    and the key stayed held on the second for the new TTL."""
    post = httpx.Client.post
    state = {"armed": False, "moved": False}

    def revoke_fails_after_the_move(client: httpx.Client, url: Any, **kwargs: Any) -> Any:
        if state["armed"]:
            if str(url).endswith("/v3/kv/txn") and b"request_put" in kwargs.get("content", b""):
                state["moved"] = True
            elif str(url).endswith("/v3/lease/revoke") and state["moved"]:
                state["armed"] = False
                raise httpx.ConnectError("etcd unreachable for this request")
        return post(client, url, **kwargs)

    monkeypatch.setattr(httpx.Client, "post", revoke_fails_after_the_move)
    with (
        keymutex.Locks(etcd_url, namespace=namespace, ttl=5) as locks,
        keymutex.Locks(etcd_url, namespace=namespace) as other,
    ):
        lease = locks.acquire("doc")
        state["armed"] = True
        with pytest.raises(keymutex.StoreError):
            lease.renew(ttl=60)  # moved to the other lease; the first not revoked
        assert state["moved"]
        assert not state["armed"], "the revoke after the move was not made"
        lease.release()
        assert other.holder("doc") is None, "released, yet the key is still held"
        other.acquire("doc", timeout=0).release()


def test_waiters_that_leave_one_after_another_share_one_linger_timer(
    etcd_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: each waiter that left while the watch stream ran started a
    thread of its own to close the stream once it had lingered, 5 s later: a thread per
    ``lock()`` piled up (430 after 4 s of a loop), and one that could not start failed
    an acquire that had been granted. One timer does it, and still closes the stream."""
    monkeypatch.setattr(etcd_store, "LINGER", 0.5)
    with (
        keymutex.Locks(etcd_url, namespace=namespace, ttl=5) as locks,
        keymutex.Locks(etcd_url, namespace=namespace, ttl=5) as other,
    ):
        held = other.acquire("doc")
        threading.Timer(0.3, held.release).start()
        with locks.lock("doc", timeout=10):  # refused once: the watch stream starts
            pass
        for _ in range(50):
            with locks.lock("doc", timeout=10):  # a waiter each, which leaves
                pass
        timers = [t for t in threading.enumerate() if isinstance(t, threading.Timer)]
        assert len(timers) <= 1, f"{len(timers)} linger timers"
        hub = locks._store._hub  # type: ignore[attr-defined]
        deadline = time.monotonic() + 20
        while hub._thread is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hub._thread is None, "the watch stream was not closed once it lingered"


@pytest.mark.parametrize("body", [b"[]", b'{"x": 1}', b'{"result": 1}\n'])
def test_a_url_naming_a_service_that_is_not_etcd_is_a_store_error(body: bytes) -> None:
    """Found by review: an HTTP service that answers 200 with JSON other than etcd's
    (the wrong port, a proxy) gave AttributeError, KeyError or TypeError, not
    StoreError, and a holder read of it said the key was free."""
    import http.server

    class NotEtcd(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotEtcd)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"etcd://127.0.0.1:{server.server_address[1]}"
        with keymutex.Locks(url, namespace="not-etcd", timeout=2) as locks:
            with pytest.raises(keymutex.StoreError):
                locks.holder("doc")
            with pytest.raises(keymutex.StoreError):
                locks.acquire("doc", timeout=0)
            with pytest.raises(keymutex.StoreError):
                locks.renew("doc", "t" * 24)
    finally:
        server.shutdown()
        server.server_close()

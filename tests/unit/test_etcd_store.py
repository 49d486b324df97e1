"""What only the etcd store promises, checked on a real etcd (tests/_etcd_fixtures.py).

etcd itself is the witness: its ``/metrics`` count the requests a step made, and its
gateway shows the keys and leases a step left behind.
"""

from __future__ import annotations

import asyncio
import base64
import re
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import keymutex
from keymutex.stores import etcd as etcd_store
from keymutex.stores.etcd import _Layout, _Refusal, _View, etcd_ttl

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
    lease = locks.acquire("job", ttl=0.3)
    kv = etcd.kv("job")
    assert kv is not None
    lease_id = int(kv["lease"])
    assert etcd.granted_ttl(lease_id) == etcd_ttl(0.3) == 1  # whole seconds, rounded up
    assert 0 < lease.remaining <= 0.3  # the client counts the TTL it asked for
    started = time.monotonic()
    while etcd.kv("job") is not None:
        assert time.monotonic() - started < 5, "etcd kept an expired lease's key"
        time.sleep(0.02)
    # ceil(0.3) = 1 s, plus up to 0.5 s for etcd's expiry sweep.
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
        locks.acquire(holder.key, timeout=10).release()
        got.append(time.monotonic())

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.5)  # parked on the watch (the safety-net recheck is 1 s away)
    released = time.monotonic()
    holder.release()
    thread.join(10)
    assert got, "the waiter did not get the key"
    return got[0] - released


def test_a_release_wakes_a_waiter_through_the_watch_promptly(
    make_pair: tuple[keymutex.Locks, keymutex.Locks],
) -> None:
    alice, bob = make_pair
    delays = [waited_handoff(bob, alice.acquire("doc", timeout=0)) for _ in range(3)]
    # Without the watch the waiter would only look again at its 1 s recheck.
    assert max(delays) < 0.25, delays


@pytest.mark.asyncio
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
            assert time.monotonic() - released < 0.25
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
    # Woken by the deletion it kept, not by its once-a-second recheck.
    assert time.monotonic() - released_at[0] < 0.5
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

"""What a user of the ZooKeeper store can expect when members of an ensemble crash.

A real three-member ensemble on loopback (tests/_zk_servers.py), real SIGKILLs, the
public API only. Each test prints what it observed; the asserts are what keymutex
guarantees: a lease is either still valid (renewable, the holder ZooKeeper reports) or
reported lost — never silently granted to someone else — new grants work once a quorum
serves again, and fences never go backwards.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

import keymutex
from _zk_fixtures import require_zookeeper

T = TypeVar("T")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PATIENCE = 40.0  # an election takes a few seconds here; a stuck one fails the test
TTL = 6.0  # leases held across the crash: renewed every 2 s, longer than an election
SESSION = 10.0  # the clients' session timeout: longer than an election too


@pytest.fixture
def group(tmp_path: Path) -> Iterator[object]:
    require_zookeeper()
    import _zk_servers

    with _zk_servers.ensemble(tmp_path, size=3) as ensemble:
        yield ensemble


@pytest.fixture
def namespace() -> str:
    return f"ensemble-{uuid.uuid4().hex[:12]}"


def served(call: Callable[[], T], what: str) -> tuple[T, int, float]:
    """Retry ``call`` while it raises ``StoreError``: its result, errors seen, seconds."""
    errors = 0
    started = time.monotonic()
    while True:
        try:
            return call(), errors, time.monotonic() - started
        except keymutex.StoreError:
            errors += 1
            if time.monotonic() - started > PATIENCE:
                raise
            time.sleep(0.05)


class Rival:
    """Tries to take ``keys`` every 20 ms while running; records every grant it gets."""

    def __init__(self, locks: keymutex.Locks, keys: list[str]) -> None:
        self.granted: list[tuple[str, int, float]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(locks, keys), daemon=True)
        self._thread.start()

    def _run(self, locks: keymutex.Locks, keys: list[str]) -> None:
        while not self._stop.is_set():
            for key in keys:
                try:
                    lease = locks.acquire(key, timeout=0)
                except keymutex.Locked:
                    continue
                except keymutex.StoreError:
                    self.errors += 1
                    continue
                self.granted.append((key, lease.fence, time.monotonic()))
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(PATIENCE)


def test_leader_killed_leases_survive_or_are_lost_never_double_granted(
    group: object, namespace: str
) -> None:
    import _zk_servers

    assert isinstance(group, _zk_servers.Ensemble)
    keys = [f"job:{i}" for i in range(4)]
    lost: list[keymutex.Lease] = []
    lost_at: dict[str, float] = {}

    def on_lost(lease: keymutex.Lease) -> None:
        lost.append(lease)
        lost_at[lease.key] = time.monotonic()

    with (
        keymutex.Locks(group.url, namespace=namespace, session_timeout=SESSION) as holder,
        keymutex.Locks(
            group.url, namespace=namespace, owner="rival", session_timeout=SESSION
        ) as rival_locks,
        keymutex.Locks(group.url, namespace=namespace, session_timeout=SESSION) as other,
    ):
        before = []
        for _ in range(3):  # some history on the key whose fences we follow
            lease = other.acquire("fenced", timeout=0)
            before.append(lease.fence)
            lease.release()
        leases = [
            holder.acquire(key, ttl=TTL, renew=True, on_lost=on_lost, timeout=PATIENCE)
            for key in keys
        ]
        before += [lease.fence for lease in leases]
        rival = Rival(rival_locks, keys)
        time.sleep(0.5)
        assert rival.granted == []

        old_leader = group.leader()
        assert old_leader is not None
        killed_at = time.monotonic()
        old_leader.kill()
        new_leader = group.wait_quorum(PATIENCE)
        elected_after = time.monotonic() - killed_at

        fresh, errors, waited = served(
            lambda: other.acquire("fresh", timeout=0), "a new key after the crash"
        )
        granted_after = time.monotonic() - killed_at
        # Watch the held leases for two renewal periods after the quorum is back.
        time.sleep(2 * TTL / 3 + 1)
        rival.stop()

        survived = [lease for lease in leases if not lease.lost]
        print(
            f"\nzookeeper ensemble: killed leader {old_leader!r}; {new_leader!r} leads"
            f" {elected_after:.2f} s later; first new grant {granted_after:.2f} s after the"
            f" kill ({waited:.2f} s of retries, {errors} StoreError(s)); leases held across"
            f" it: {len(survived)} of {len(leases)} still valid, {len(lost)} reported lost;"
            f" rival grants {rival.granted}, rival StoreErrors {rival.errors}"
        )

        # Never silently double-granted: the rival got a key only after its lease was
        # reported lost (by its holder's own clock), and got a larger fence.
        for key, fence, at in rival.granted:
            assert key in lost_at, f"{key} was granted to the rival while still held"
            assert lost_at[key] <= at
            assert fence > max(before)
        # A lease still valid is the one ZooKeeper reports, and it renews.
        for lease in survived:
            seen = served(lambda lease=lease: other.holder(lease.key), "holder")[0]
            assert seen is not None
            assert seen.fence == lease.fence
            served(lease.renew, "renew")
            with pytest.raises(keymutex.Locked):
                other.acquire(lease.key, timeout=0)
        assert fresh.fence > max(before)
        fresh.release()

        # Fences never go backwards: the new leader's epoch is larger.
        after = []
        for _ in range(3):
            lease = served(lambda: other.acquire("fenced", timeout=0), "re-acquire")[0]
            after.append(lease.fence)
            lease.release()
        print(f"zookeeper ensemble: fences before {before}, after {after}")
        assert after == sorted(after)
        assert after[0] > max(before)
        for lease in survived:
            lease.release()

        # The killed member comes back and follows; nothing changes for the clients.
        old_leader.start(PATIENCE)
        group.wait_quorum(PATIENCE)
        assert old_leader.mode() == "follower"
        again = served(lambda: other.acquire("fenced", timeout=0), "after the rejoin")[0]
        assert again.fence > max(after)
        again.release()


def test_stopping_a_follower_changes_nothing(group: object, namespace: str) -> None:
    import _zk_servers

    assert isinstance(group, _zk_servers.Ensemble)
    lost: list[keymutex.Lease] = []
    # Several clients, so that some are connected to the follower we stop.
    clients = [
        keymutex.Locks(group.url, namespace=namespace, session_timeout=SESSION) for _ in range(4)
    ]
    try:
        leases = [
            client.acquire(f"held:{i}", ttl=TTL, renew=True, on_lost=lost.append)
            for i, client in enumerate(clients)
        ]
        # The follower serving the most of our clients (``cons`` lists sessions).
        follower = max(group.followers(), key=lambda m: m.command("cons").count("sid=0x"))
        connected = follower.command("cons").count("sid=0x")
        stopped_at = time.monotonic()
        follower.stop()

        fences = []
        slowest = 0.0
        for round_ in range(6):
            for i, client in enumerate(clients):
                started = time.monotonic()
                lease = client.acquire(f"new:{i}", timeout=PATIENCE)
                slowest = max(slowest, time.monotonic() - started)
                fences.append(lease.fence)
                lease.release()
            if round_ == 0:
                first_round = time.monotonic() - stopped_at
            time.sleep(0.5)
        print(
            f"\nzookeeper ensemble: stopped follower {follower!r} ({connected} of our"
            f" {len(clients)} sessions were connected to it); first round of grants {first_round:.2f} s after;"
            f" slowest acquire {slowest:.3f} s; leases lost: {len(lost)}"
        )
        assert lost == []
        for lease in leases:
            assert not lease.lost
            lease.renew()
            lease.release()
        assert fences == sorted(fences)
        assert group.leader() is not None
    finally:
        for client in clients:
            client.close()

"""What a user of the etcd store can expect when cluster members crash or stop.

A real 3-member etcd cluster on loopback (tests/_etcd_servers.py), real SIGKILLs, the
public API only. Each test says in its docstring what it shows; the asserts are the
guarantees. Members run etcd's default timing (heartbeat 100 ms, election 1 s).

Common ground: etcd commits through a quorum (2 of 3), so a grant acknowledged before
a crash is on a majority and survives it; fences are etcd revisions, which a new leader
continues. A new leader extends every lease by its election timeout, so leases never
expire early because of a failover. While a write cannot reach a quorum, the call
raises ``StoreError`` after the client's ``timeout``: nothing hangs.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

import _etcd_servers as servers
import keymutex
from _etcd_fixtures import require_etcd

T = TypeVar("T")

PATIENCE = 30.0
TTL = 8.0  # longer than a failover (about 1-3 s here), so that leases ride it out
CLIENT_TIMEOUT = 2.0


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[servers.EtcdCluster]:
    require_etcd()
    with servers.cluster(tmp_path / "etcd", members=3) as topology:
        yield topology


@pytest.fixture
def namespace() -> str:
    return f"cluster-{uuid.uuid4().hex[:12]}"


def served(call: Callable[[], T], what: str) -> tuple[T, int, float]:
    """Retry ``call`` while it raises ``StoreError``: its result, failures, seconds taken."""
    failures = 0
    started = time.monotonic()
    while True:
        try:
            return call(), failures, time.monotonic() - started
        except keymutex.StoreError as exc:
            failures += 1
            if time.monotonic() - started > PATIENCE:
                raise AssertionError(f"{what}: still failing after {PATIENCE} s") from exc
            time.sleep(0.05)


def refused_or_unavailable(locks: keymutex.Locks, key: str) -> str:
    """Try to take a held key once: it must never be granted."""
    try:
        lease = locks.acquire(key, timeout=0)
    except keymutex.Locked:
        return "refused"
    except keymutex.StoreError:
        return "unavailable"
    lease.release()
    raise AssertionError(f"{key!r} was granted to a second client while held")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_of_the_leader_keeps_leases_and_fences(
    etcd_cluster: servers.EtcdCluster, namespace: str
) -> None:
    """SIGKILL the leader while 5 renewing leases are held and a rival keeps trying.

    Shown: the rival is never granted a held key (only refused, or ``StoreError``
    while there is no leader); a new leader is elected and a new acquire succeeds
    within a few seconds; every held lease is still held afterwards, with its fence,
    and renews; no lease is reported lost; fences granted after the crash are larger
    than every fence before it.
    """
    url = etcd_cluster.url
    lost: list[keymutex.Lease] = []
    with (
        keymutex.Locks(url, namespace=namespace, ttl=TTL, timeout=CLIENT_TIMEOUT) as holder,
        keymutex.Locks(url, namespace=namespace, ttl=TTL, timeout=CLIENT_TIMEOUT) as rival,
    ):
        fences = [holder.acquire("warm", timeout=0).fence]
        leases = [
            holder.acquire(f"job:{n}", timeout=0, renew=True, on_lost=lost.append)
            for n in range(5)
        ]
        fences += [lease.fence for lease in leases]

        leader = etcd_cluster.leader()
        killed_at = time.monotonic()
        leader.kill()

        answers = [refused_or_unavailable(rival, lease.key) for lease in leases]
        new, failures, _ = served(lambda: rival.acquire("after", timeout=0), "a new acquire")
        recovered_after = time.monotonic() - killed_at
        assert new.fence > max(fences)
        answers += [refused_or_unavailable(rival, lease.key) for lease in leases]
        assert set(answers) <= {"refused", "unavailable"}

        new_leader = etcd_cluster.leader()
        assert new_leader is not leader
        for lease in leases:
            lease.renew()  # the lease survived: its key is still attached to it
            seen, _, _ = served(lambda key=lease.key: rival.holder(key), "a read")
            assert seen is not None
            assert seen.fence == lease.fence
        # Past a renewal period: the background renewer rode out the failover.
        time.sleep(TTL / 3 + 0.5)
        assert lost == []
        assert not any(lease.lost for lease in leases)
        later = [rival.acquire(f"later:{n}", timeout=0) for n in range(3)]
        assert min(x.fence for x in later) > new.fence
        for lease in [*leases, new, *later]:
            lease.release()
        print(
            f"\nleader {leader.name} killed; new leader {new_leader.name};"
            f" first acquire after {recovered_after:.2f} s ({failures} StoreErrors);"
            f" rival answers {sorted(set(answers))}"
        )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_losing_quorum_reports_leases_lost_never_double_grants(
    etcd_cluster: servers.EtcdCluster, namespace: str
) -> None:
    """SIGKILL two of three members (no quorum) for longer than a lease's TTL.

    Shown: calls fail with ``StoreError`` within the client timeout (none hangs); a
    renewing lease whose deadline passes is reported lost (``on_lost``, ``LockLost``
    on leaving the block); once the members are back, etcd still holds the old key
    until its lease expires (a new leader extends leases), so the rival is refused
    until then and is granted the key afterwards with a larger fence.
    """
    url = etcd_cluster.url
    lost: list[keymutex.Lease] = []
    ttl = 3.0
    with (
        keymutex.Locks(url, namespace=namespace, ttl=ttl, timeout=CLIENT_TIMEOUT) as holder,
        keymutex.Locks(url, namespace=namespace, ttl=ttl, timeout=CLIENT_TIMEOUT) as rival,
    ):
        lease = holder.acquire("job", timeout=0, renew=True, on_lost=lost.append)
        leader = etcd_cluster.leader()
        killed = [leader, next(m for m in etcd_cluster.members if m is not leader)]
        for member in killed:
            member.kill()

        started = time.monotonic()
        with pytest.raises(keymutex.StoreError):
            rival.acquire("other", timeout=0)
        assert time.monotonic() - started < 3 * CLIENT_TIMEOUT + 1

        deadline = time.monotonic() + ttl + 5
        while not lost and time.monotonic() < deadline:
            assert refused_or_unavailable(rival, "job") in {"refused", "unavailable"}
            time.sleep(0.2)
        assert lost == [lease]
        assert lease.lost
        with pytest.raises(keymutex.LockLost):
            lease.release()

        for member in killed:
            member.spawn(new=False)
        etcd_cluster.wait_ready()
        answers = []
        granted = None
        give_up = time.monotonic() + PATIENCE
        while granted is None:
            assert time.monotonic() < give_up, "the key never became free again"
            try:
                granted = rival.acquire("job", timeout=0)
            except keymutex.Locked:
                answers.append("refused")
            except keymutex.StoreError:
                answers.append("unavailable")
            time.sleep(0.1)
        assert granted.fence > lease.fence
        granted.release()
        print(f"\nafter the restart the rival was refused {answers.count('refused')} times")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stopping_a_minority_member_changes_nothing(
    etcd_cluster: servers.EtcdCluster, namespace: str
) -> None:
    """Stop one follower (SIGTERM), then lock, wait, renew and release as usual.

    Shown: no call fails (a refused connection goes to the next endpoint within the
    same call), a waiter is still woken by a release, fences keep growing.
    """
    url = etcd_cluster.url
    leader = etcd_cluster.leader()
    with (
        keymutex.Locks(url, namespace=namespace, ttl=TTL, timeout=CLIENT_TIMEOUT) as alice,
        keymutex.Locks(url, namespace=namespace, ttl=TTL, timeout=CLIENT_TIMEOUT) as bob,
    ):
        before = alice.acquire("warm", timeout=0)
        before.release()
        for member in etcd_cluster.members:
            if member is not leader:
                member.stop()
                break
        fences = [before.fence]
        for round_ in range(5):
            held = alice.acquire("doc", timeout=0, info={"round": round_})
            held.renew()
            got: list[keymutex.Lease] = []
            waiter = threading.Thread(
                target=lambda got=got: got.append(bob.acquire("doc", timeout=10))
            )
            waiter.start()
            time.sleep(0.2)
            held.release()
            waiter.join(15)
            assert got, "the waiter was not granted the released key"
            fences += [held.fence, got[0].fence]
            got[0].release()
        assert fences == sorted(fences)
        assert len(set(fences)) == len(fences)
        assert etcd_cluster.leader() is leader

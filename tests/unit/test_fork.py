"""A forked child renews its own leases, and the parent goes on renewing its own."""

from __future__ import annotations

import functools
import multiprocessing
import os
import socket
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

import keymutex
from _fork import fork_running

# Short enough that the leases live only if renewed; long enough that a loaded CI
# machine (other tests forking dozens of children beside it) does not starve a renewal.
TTL = 1.0


def _hold_past_the_ttl(locks: keymutex.Locks) -> None:
    with locks.lock("child", ttl=TTL):  # survives only if the child's renewer runs
        time.sleep(3 * TTL)


# Python 3.12+ warns about fork() in a process with threads: that is the point here.
@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_forked_child_renews_its_own_leases(tmp_path: Path) -> None:
    locks = keymutex.Locks(f"sqlite:///{tmp_path}/locks.db")
    with locks, locks.lock("parent", ttl=TTL) as parent:  # the renewer thread runs now
        child = multiprocessing.get_context("fork").Process(
            target=_hold_past_the_ttl, args=(locks,)
        )
        child.start()
        child.join(20)
        assert child.exitcode == 0, "the child's lease was lost: nothing renewed it"
        time.sleep(2 * TTL)
        assert parent.lost is False, "the parent's own renewals stopped"


def _exit_codes(pids: list[int]) -> Counter[int]:
    """Each child's exit code; a child killed by a signal counts as minus the signal."""
    return Counter(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids)


LOCKED = 3


def _refused_within_its_timeout(locks: keymutex.Locks) -> int:
    try:
        locks.acquire("held", timeout=1)
    except keymutex.Locked:
        return LOCKED
    return 0


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_child_forked_while_a_thread_waits_on_redis_waits_within_its_timeout(
    redis_url: str,
) -> None:
    """Forked while a parent's thread was waiting (taking the store's subscription
    mutexes many times a second), about half the children hung for good in their own
    first wait, whatever its timeout: the child's copy of a mutex held at the fork
    stays held. The child now starts with mutexes of its own."""
    namespace = f"fork-{uuid.uuid4().hex}"
    pids = []
    with keymutex.Locks(redis_url, namespace=namespace) as other:
        held = other.acquire("held", ttl=60)
        for _ in range(8):
            with keymutex.Locks(redis_url, namespace=namespace) as locks:
                waiting = threading.Thread(target=_refused_within_its_timeout, args=(locks,))
                waiting.start()
                for n in range(6):  # forks while that thread starts waiting
                    pids.append(
                        fork_running(functools.partial(_refused_within_its_timeout, locks))
                    )
                    time.sleep(0.001 * n)
                waiting.join()
        assert _exit_codes(pids) == Counter({LOCKED: len(pids)})
        held.release()


def _acquire_a_free_key(locks: keymutex.Locks) -> int:
    locks.acquire(f"free-{os.getpid()}", timeout=2).release()
    return 0


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_children_forked_from_a_parent_renewing_on_sqlite_can_use_its_store(
    tmp_path: Path,
) -> None:
    """A parent renewing many leases is almost always inside SQLite in its renewer
    thread. Forked at such a moment, a child inherited SQLite's own state as that
    thread left it: its first step hung in ``sqlite3.connect`` for good, or found the
    database locked for 10 s (3 children in 100). No step is under way at a fork now."""
    with keymutex.Locks(f"sqlite:///{tmp_path}/locks.db") as locks:
        # Renewed every 0.2 s: the renewer is inside SQLite much of the time. (Whether
        # the parent's renewals go on is test_a_forked_child_renews_its_own_leases's:
        # leases this short may lapse on a loaded machine.)
        _renewing = [locks.acquire(f"busy-{n}", ttl=0.6, renew=True) for n in range(200)]
        pids = []
        for _ in range(60):
            pids.append(fork_running(functools.partial(_acquire_a_free_key, locks)))
            time.sleep(0.005)
        assert _exit_codes(pids) == Counter({0: len(pids)})


NAMED_THE_WRONG_PROCESS, RELEASED_THE_PARENTS_LEASE, OWNED_AS_THE_PARENT = 4, 5, 6


def _a_child_of_its_own(locks: keymutex.Locks, parents: keymutex.Lease) -> int:
    try:
        parents.release()
    except keymutex.LockLost as exc:
        if f"process {os.getppid()}," not in str(exc):
            return NAMED_THE_WRONG_PROCESS
    else:
        return RELEASED_THE_PARENTS_LEASE
    with locks.lock("child", timeout=2, renew=False):
        holder = locks.holder("child")
        if holder is None or holder.owner != f"{socket.gethostname()}:{os.getpid()}":
            return OWNED_AS_THE_PARENT
    return 0


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_forked_child_is_another_process_to_its_leases_and_owners(tmp_path: Path) -> None:
    """A forked child is told apart from its parent: it cannot release the parent's
    lease (that is the parent's to end), and its own grants name it as their owner
    (a process id cached across forks, tried once, must keep this true)."""
    with keymutex.Locks(f"sqlite:///{tmp_path}/locks.db") as locks:
        parents = locks.acquire("parent", ttl=60, renew=False)
        pids = [
            fork_running(functools.partial(_a_child_of_its_own, locks, parents)) for _ in range(3)
        ]
        assert _exit_codes(pids) == Counter({0: len(pids)})
        holder = locks.holder("parent")
        assert holder is not None
        assert holder.owner == f"{socket.gethostname()}:{os.getpid()}"
        parents.release()


def _owns_as_itself(locks: keymutex.Locks) -> int:
    with locks.lock(f"child-{os.getpid()}", timeout=2, renew=False):
        holder = locks.holder(f"child-{os.getpid()}")
        if holder is None or holder.owner != f"{socket.gethostname()}:{os.getpid()}":
            return OWNED_AS_THE_PARENT
    return 0


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_child_forked_without_pythons_hooks_is_still_another_process(tmp_path: Path) -> None:
    """A fork that runs no at-fork hook (uWSGI's default) must still be told apart from
    its parent by the process id: the grants name the child, not the parent."""
    with keymutex.Locks(f"sqlite:///{tmp_path}/locks.db") as locks:
        locks.acquire("warm", timeout=0, renew=False).release()
        pids = [fork_running(functools.partial(_owns_as_itself, locks), hooks=False)]
        assert _exit_codes(pids) == Counter({0: 1})

"""Mutual exclusion under contention: threads, tasks and processes.

Each contender does a read-modify-write with a yield in the middle, which loses
updates unless the lock excludes the others; the counter must end exact. Fences
recorded inside the critical section must come out strictly increasing, since
each grant's fence is larger than every fence before it on the key.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import multiprocessing
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import keymutex

from . import _workers
from ._support import PATIENCE

THREADS = 6
THREAD_ROUNDS = 15
TASKS = 8
TASK_ROUNDS = 15
PROCESSES = 3
PROCESS_ROUNDS = 10


class Ledger:
    """What happened inside the critical sections, recorded by the contenders."""

    def __init__(self) -> None:
        self.counter = 0
        self.inside = 0
        self.most_inside = 0
        self.fences: list[int] = []
        self._guard = threading.Lock()

    def enter(self, fence: int) -> None:
        with self._guard:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            self.fences.append(fence)

    def leave(self) -> None:
        with self._guard:
            self.inside -= 1

    def check(self, expected: int) -> None:
        assert self.most_inside == 1, "two contenders were inside the lock at once"
        assert self.counter == expected, "an update was lost: the lock did not exclude"
        assert len(self.fences) == expected
        assert all(a < b for a, b in itertools.pairwise(self.fences)), (
            f"fences not strictly increasing in grant order: {self.fences}"
        )


def test_threads_exclude_each_other(make_locks: Callable[..., keymutex.Locks]) -> None:
    # Two clients on one URL, shared by all threads: Locks is thread-safe, and two
    # clients of one store see each other's leases.
    clients = [make_locks(), make_locks()]
    ledger = Ledger()
    errors: list[BaseException] = []

    def contend(client: keymutex.Locks) -> None:
        try:
            for _ in range(THREAD_ROUNDS):
                with client.lock("counter", timeout=PATIENCE) as lease:
                    ledger.enter(lease.fence)
                    value = ledger.counter
                    time.sleep(0)
                    time.sleep(0.0005)
                    ledger.counter = value + 1
                    ledger.leave()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(clients[i % 2],)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE * 2)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    ledger.check(THREADS * THREAD_ROUNDS)
    assert clients[0].holder("counter") is None


@pytest.mark.asyncio
async def test_tasks_exclude_each_other(make_alocks: Callable[..., keymutex.AsyncLocks]) -> None:
    clients = [make_alocks(), make_alocks()]
    ledger = Ledger()

    async def contend(client: keymutex.AsyncLocks) -> None:
        for _ in range(TASK_ROUNDS):
            async with client.lock("counter", timeout=PATIENCE) as lease:
                ledger.enter(lease.fence)
                value = ledger.counter
                await asyncio.sleep(0)
                await asyncio.sleep(0.0005)
                ledger.counter = value + 1
                ledger.leave()

    async with asyncio.timeout(PATIENCE * 2):
        await asyncio.gather(*(contend(clients[i % 2]) for i in range(TASKS)))
    ledger.check(TASKS * TASK_ROUNDS)
    assert await clients[0].holder("counter") is None


@pytest.mark.asyncio
async def test_sync_and_async_clients_exclude_each_other(
    make_locks: Callable[..., keymutex.Locks], make_alocks: Callable[..., keymutex.AsyncLocks]
) -> None:
    # The same store through both APIs at once: a thread with Locks, tasks with AsyncLocks.
    locks, alocks = make_locks(), make_alocks()
    ledger = Ledger()

    def in_thread() -> None:
        for _ in range(THREAD_ROUNDS):
            with locks.lock("counter", timeout=PATIENCE) as lease:
                ledger.enter(lease.fence)
                value = ledger.counter
                time.sleep(0.0005)
                ledger.counter = value + 1
                ledger.leave()

    async def in_task() -> None:
        for _ in range(TASK_ROUNDS):
            async with alocks.lock("counter", timeout=PATIENCE) as lease:
                ledger.enter(lease.fence)
                value = ledger.counter
                await asyncio.sleep(0.0005)
                ledger.counter = value + 1
                ledger.leave()

    async with asyncio.timeout(PATIENCE * 2):
        await asyncio.gather(asyncio.to_thread(in_thread), in_task(), in_task())
    ledger.check(THREAD_ROUNDS + 2 * TASK_ROUNDS)


def _run_processes(
    worker: Callable[..., None], store_url: str, namespace: str, tmp_path: Path
) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    (directory / "counter").write_text("0")
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    processes = [
        context.Process(
            target=worker,
            args=(store_url, namespace, "counter", str(directory), PROCESS_ROUNDS, start),
        )
        for _ in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    start.set()
    for process in processes:
        process.join(50)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    assert [process.exitcode for process in processes] == [0] * PROCESSES
    assert int((directory / "counter").read_text()) == PROCESSES * PROCESS_ROUNDS
    fences = [int(line) for line in (directory / "fences").read_text().split()]
    assert len(fences) == PROCESSES * PROCESS_ROUNDS
    assert all(a < b for a, b in itertools.pairwise(fences)), fences


@pytest.mark.store_needs("cross_process")
def test_processes_exclude_each_other(store_url: str, namespace: str, tmp_path: Path) -> None:
    _run_processes(_workers.count_sync, store_url, namespace, tmp_path)
    # This process sees what the others left: nothing held.
    with keymutex.Locks(store_url, namespace=namespace) as locks:
        assert list(locks.holders()) == []


@pytest.mark.store_needs("cross_process")
def test_async_processes_exclude_each_other(
    store_url: str, namespace: str, tmp_path: Path
) -> None:
    _run_processes(_workers.count_async, store_url, namespace, tmp_path)


@pytest.mark.store_needs("cross_process")
def test_lease_held_here_excludes_another_process(
    make_locks: Callable[..., keymutex.Locks], store_url: str, namespace: str, tmp_path: Path
) -> None:
    # A child process that tries the held key once is refused, and sees the holder.
    lease = make_locks(owner="parent").acquire("shared", info={"who": "parent"})
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        seen = pool.apply(_workers.try_once, (store_url, namespace, "shared"))
    assert seen == ("locked", "parent", {"who": "parent"}, lease.fence)
    lease.release()
    with context.Pool(1) as pool:
        seen = pool.apply(_workers.try_once, (store_url, namespace, "shared"))
    assert seen[0] == "acquired"
    assert seen[3] > lease.fence


@pytest.mark.store_needs("cross_process")
def test_lease_of_a_killed_process_expires(
    make_locks: Callable[..., keymutex.Locks], store_url: str, namespace: str
) -> None:
    # Story 1: a worker dies mid-pipeline; its lock must not stay forever. A TTL of 2 s,
    # renewed every 0.7 s: found on a loaded machine with a TTL of 0.5 s, the lease had
    # lapsed before the second client (TLS and auth to etcd) asked for the key.
    context = multiprocessing.get_context("spawn")
    report = context.Queue()
    doomed = context.Process(
        target=_workers.hold_until_killed, args=(store_url, namespace, "user:7", 2.0, report)
    )
    doomed.start()
    try:
        fence = report.get(timeout=PATIENCE)
        locks = make_locks()
        with pytest.raises(keymutex.Locked) as refused:
            locks.acquire("user:7", timeout=0)
        assert refused.value.holder is not None
        assert refused.value.holder.owner == "doomed"
    finally:
        doomed.kill()
        doomed.join()
    lease = locks.acquire("user:7", timeout=PATIENCE)
    assert lease.fence > fence
    lease.release()


@pytest.mark.store_needs("cross_process")
def test_release_here_wakes_a_waiter_in_another_process(
    make_locks: Callable[..., keymutex.Locks], store_url: str, namespace: str
) -> None:
    # The holder's lease lasts an hour: only the release can let the other process in.
    holding = make_locks().acquire("doc", ttl=3600)
    context = multiprocessing.get_context("spawn")
    report = context.Queue()
    waiter = context.Process(
        target=_workers.wait_for_key, args=(store_url, namespace, "doc", PATIENCE, report)
    )
    waiter.start()
    try:
        assert report.get(timeout=PATIENCE) == "waiting"
        time.sleep(0.2)  # let it start waiting (not a timing assertion)
        holding.release()
        fence, owner, info = report.get(timeout=PATIENCE)
    finally:
        waiter.join(PATIENCE)
        if waiter.is_alive():
            waiter.kill()
            waiter.join()
    assert waiter.exitcode == 0
    assert fence > holding.fence
    assert owner == "patient"
    assert info == {"pid": waiter.pid}
    assert make_locks().holder("doc") is None


class _Resource(str, enum.Enum):  # noqa: UP042  # StrEnum formats as its text: not this case
    REPORTS = "reports"


def test_a_str_subclass_key_or_namespace_is_the_lock_of_its_text(
    make_locks: Callable[..., keymutex.Locks], namespace: str
) -> None:
    """Found by a review: the Redis store named items by formatting the key and the
    namespace, and a ``(str, Enum)`` member formats as ``_Resource.REPORTS``: the member
    and ``"reports"`` (from another process, or the lock server's JSON) were two locks,
    both granted at once."""
    first = make_locks(owner="enum-user").acquire(_Resource.REPORTS, timeout=0)
    assert type(first.key) is str
    with pytest.raises(keymutex.Locked):
        make_locks(owner="plain-user").acquire("reports", timeout=0).release()
    assert [h.key for h in make_locks().holders("rep")] == ["reports"]
    first.release()
    by_member = enum.Enum("Space", {"X": namespace}, type=str).X  # type: ignore[attr-defined]
    second = make_locks(namespace=by_member).acquire("k", timeout=0)
    with pytest.raises(keymutex.Locked):
        make_locks(namespace=namespace).acquire("k", timeout=0).release()
    second.release()


@pytest.mark.asyncio
async def test_a_str_subclass_key_is_the_lock_of_its_text_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    first = await make_alocks().acquire(_Resource.REPORTS, timeout=0)
    with pytest.raises(keymutex.Locked):
        await (await make_alocks().acquire("reports", timeout=0)).release()
    assert [h.key for h in await make_alocks().holders("rep")] == ["reports"]
    await first.release()

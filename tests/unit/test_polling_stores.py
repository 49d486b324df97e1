"""Waiting on a store that cannot notify: jittered backoff, and a wake-up at the holder's
expiry; and on one that learns at its first step that it can.

No store of this version lacks notifications on Linux, so a memory store stands in
with its notifications switched off (its waiters are never queued nor rung).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import pytest

import keymutex
from keymutex._lease import Outcome
from keymutex.stores.memory import MemoryStore


class SilentWaiter:
    """A waiter nobody rings: ``wait`` just sleeps."""

    def __init__(self) -> None:
        self.parks: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.parks.append(timeout)
        time.sleep(timeout)
        return False

    async def wait_async(self, timeout: float) -> bool:  # pragma: no cover - sync tests
        raise NotImplementedError

    def close(self) -> None:
        pass


class PollingStore:
    """A memory store that says it cannot notify, and never queues waiters."""

    def __init__(self, inner: MemoryStore) -> None:
        self._inner = inner
        self.capabilities = dataclasses.replace(inner.capabilities, notifies=False, fair=False)
        self.waiters: list[SilentWaiter] = []

    def try_acquire(self, key: str, **kwargs: Any) -> Outcome:
        kwargs["waiter"] = None
        return self._inner.try_acquire(key, **kwargs)

    def waiter(self, key: str) -> SilentWaiter:
        waiter = SilentWaiter()
        self.waiters.append(waiter)
        return waiter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def polling_locks(namespace: str) -> tuple[keymutex.Locks, PollingStore]:
    locks = keymutex.Locks("memory://", namespace=namespace)
    store = PollingStore(locks._store)  # type: ignore[arg-type]
    locks._store = store  # type: ignore[assignment]
    return locks, store


def test_a_waiter_polls_until_the_key_is_released() -> None:
    holder = keymutex.Locks("memory://", namespace="poll-release")
    waiting, store = polling_locks("poll-release")
    lease = holder.acquire("doc")
    threading.Timer(0.3, lease.release).start()
    got = waiting.acquire("doc", timeout=10)
    assert got.fence > lease.fence
    parks = store.waiters[0].parks
    assert len(parks) >= 3, "a polling waiter should back off in several short steps"
    assert max(parks) <= 0.25 + 1e-9, "backoff steps are bounded"
    got.release()


def test_a_polling_waiter_gives_up_at_its_timeout() -> None:
    holder = keymutex.Locks("memory://", namespace="poll-timeout")
    waiting, store = polling_locks("poll-timeout")
    lease = holder.acquire("doc", ttl=30)
    started = time.monotonic()
    with pytest.raises(keymutex.Locked) as refused:
        waiting.acquire("doc", timeout=0.3)
    assert refused.value.holder is not None
    assert refused.value.holder.fence == lease.fence
    assert sum(store.waiters[0].parks) <= 0.3 + 0.05
    assert time.monotonic() - started < 5
    lease.release()


class RecordingWaiter:
    """A store's own waiter, with each park recorded."""

    def __init__(self, inner: Any, parks: list[float]) -> None:
        self.inner = inner
        self._parks = parks

    def wait(self, timeout: float) -> Any:
        self._parks.append(timeout)
        return self.inner.wait(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class LearningStore:
    """A memory store that, like MongoDB's, learns at its first step that it can notify
    (MongoDB asks the server whether it has change streams): until then its
    capabilities say it cannot. Counts its tries, and records its waiters' parks."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.capabilities = dataclasses.replace(inner.capabilities, notifies=False, fair=False)
        self.tries = 0
        self.parks: list[float] = []

    def _tried(self, kwargs: dict[str, Any]) -> None:
        self.tries += 1
        self.capabilities = self._inner.capabilities
        if isinstance(kwargs["waiter"], RecordingWaiter):
            kwargs["waiter"] = kwargs["waiter"].inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class SyncLearningStore(LearningStore):
    def try_acquire(self, key: str, **kwargs: Any) -> Outcome:
        self._tried(kwargs)
        return self._inner.try_acquire(key, **kwargs)

    def waiter(self, key: str) -> RecordingWaiter:
        return RecordingWaiter(self._inner.waiter(key), self.parks)


class AsyncLearningStore(LearningStore):
    async def try_acquire(self, key: str, **kwargs: Any) -> Outcome:
        self._tried(kwargs)
        return await self._inner.try_acquire(key, **kwargs)

    async def waiter(self, key: str) -> RecordingWaiter:
        return RecordingWaiter(await self._inner.waiter(key), self.parks)


def test_the_first_wait_of_a_store_that_learns_it_notifies_waits_for_the_release() -> None:
    """Found by review: the client read the store's capabilities before its first try,
    so the first wait of every client of a store that learns them at its first step
    (MongoDB on a replica set) polled on backoff steps of 1 ms and up."""
    holder = keymutex.Locks("memory://", namespace="learns")
    waiting = keymutex.Locks("memory://", namespace="learns")
    store = SyncLearningStore(waiting._store)
    waiting._store = store  # type: ignore[assignment]
    lease = holder.acquire("doc", ttl=30)
    threading.Timer(0.6, lease.release).start()
    got = waiting.acquire("doc", timeout=10)
    assert got.fence > lease.fence
    assert store.parks, "the waiter never parked"
    assert store.parks[0] > 0.25, f"parked on backoff steps: {store.parks}"
    assert store.tries <= 3, f"{store.tries} tries: the waiter polled instead of waiting"
    got.release()


@pytest.mark.asyncio
async def test_the_first_wait_of_an_async_store_that_learns_it_notifies_waits_too() -> None:
    holder = keymutex.AsyncLocks("memory://", namespace="learns-async")
    waiting = keymutex.AsyncLocks("memory://", namespace="learns-async")
    store = AsyncLearningStore(waiting._store)
    waiting._store = store  # type: ignore[assignment]
    lease = await holder.acquire("doc", ttl=30)
    asyncio.get_running_loop().call_later(0.6, lambda: asyncio.ensure_future(lease.release()))
    got = await waiting.acquire("doc", timeout=10)
    assert got.fence > lease.fence
    assert store.parks, "the waiter never parked"
    assert store.parks[0] > 0.25, f"parked on backoff steps: {store.parks}"
    assert store.tries <= 3, f"{store.tries} tries: the waiter polled instead of waiting"
    await got.release()


def test_a_release_before_the_first_waiter_joins_is_not_missed() -> None:
    """Found by review of the test above's fix: the waiter of a store that learns at
    its first step that it notifies is made after the first refusal; a release between
    the two was unheard, and the waiter parked a whole recheck (a second). It looks
    again at once."""
    holder = keymutex.Locks("memory://", namespace="learns-late")
    waiting = keymutex.Locks("memory://", namespace="learns-late")
    store = SyncLearningStore(waiting._store)
    waiting._store = store  # type: ignore[assignment]
    lease = holder.acquire("doc", ttl=30)
    make_waiter = store.waiter

    def released_before_joining(key: str) -> RecordingWaiter:
        lease.release()  # between the refusal and the waiter: nobody hears it
        return make_waiter(key)

    store.waiter = released_before_joining  # type: ignore[method-assign]
    got = waiting.acquire("doc", timeout=10)
    assert store.parks == [], f"parked {store.parks} though the key was free"
    got.release()

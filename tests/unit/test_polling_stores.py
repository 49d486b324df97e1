"""Waiting on a store that cannot notify: jittered backoff, and a wake-up at the holder's expiry.

No store of this version lacks notifications on Linux, so a memory store stands in
with its notifications switched off (its waiters are never queued nor rung).
"""

from __future__ import annotations

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

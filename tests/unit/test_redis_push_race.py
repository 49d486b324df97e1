"""Review of 1e8497a: Redis's own ``sunsubscribe`` push, dispatched by the reading
thread the instant a joining waiter lets go of its hub's mutex, must not leave the
waiter marked subscribed while it is registered nowhere (contend() would never
subscribe it again, and its hand-overs would go unheard until the acquire ends)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from keymutex.stores import redis as redis_store

CHANNEL = "km:{7}:w:2:ns:abc"


class _ReaderAtRelease:
    """A mutex after whose next release the reading thread dispatches ``hook``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hook: Any = None

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()


class _PubSub:
    connection = None

    def __init__(self) -> None:
        self.shard_channels: dict[str, None] = {CHANNEL: None}


@pytest.mark.parametrize("entry", ["try_join", "join"])
def test_a_push_right_after_a_join_leaves_the_waiter_unsubscribed(entry: str) -> None:
    hub = redis_store._Subscriptions(_PubSub, sharded=True)
    hub._pubsub = _PubSub()
    hub._tending = threading.current_thread()  # no tending thread here
    confirmed = redis_store._Confirmation()
    confirmed.set()
    hub._confirmed[CHANNEL] = confirmed  # subscribed and confirmed already
    mutex = hub._mutex = _ReaderAtRelease()  # type: ignore[assignment]
    waiter = redis_store._RedisWaiter(hub, CHANNEL)
    mutex.hook = lambda: hub._dispatch({"type": "sunsubscribe", "channel": CHANNEL, "data": 0})
    if entry == "try_join":
        hub.try_join(waiter)
    else:
        hub.join(waiter, 1.0)
    registered = waiter in hub._channels.waiters.get(CHANNEL, ())
    assert waiter.subscribed == registered, "subscribed, but registered nowhere"
    assert waiter.rung

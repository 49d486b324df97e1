"""Waiting through the ``http://`` store happens at the server, in its store's order.

A refused client's wait is the acquire itself, with a timeout: on a SQLite-backed
server the waiters are served first come, first served, each release wakes one of
them, and a grant that arrives while a client gives up is handed back.
"""

from __future__ import annotations

import threading
import time

import pytest

import keymutex

from .conftest import Live


def _queued(live: Live, count: int) -> None:
    """Wait until ``count`` requests wait at the server for key "k"."""
    deadline = time.monotonic() + 10
    with keymutex.Locks(live.url) as observer:
        while time.monotonic() < deadline:
            waiting = observer._store._send(  # type: ignore[attr-defined]
                keymutex.stores.http._Protocol("").holders("k")
            )[1]["waiting"]
            if waiting.get("k", 0) >= count:
                return
            time.sleep(0.005)
    raise AssertionError(f"{count} waiters never queued at the server")


def test_waiters_are_served_in_arrival_order_one_per_release(live: Live) -> None:
    holder = keymutex.Locks(live.url)
    clients = [keymutex.Locks(live.url) for _ in range(4)]
    order: list[int] = []
    try:
        lease = holder.acquire("k", timeout=0)

        def wait(number: int) -> None:
            with clients[number].lock("k", timeout=20):
                order.append(number)
                time.sleep(0.02)

        threads = []
        for number in range(4):  # each one queued before the next arrives
            threads.append(threading.Thread(target=wait, args=(number,)))
            threads[-1].start()
            _queued(live, number + 1)
        lease.release()
        for thread in threads:
            thread.join(20)
        assert order == [0, 1, 2, 3]
    finally:
        for locks in [holder, *clients]:
            locks.close()


def test_a_waiter_that_gives_up_leaves_the_key_free(live: Live) -> None:
    with keymutex.Locks(live.url) as holder, keymutex.Locks(live.url) as waiting:
        lease = holder.acquire("k", timeout=0)
        with pytest.raises(keymutex.Locked) as refused:
            waiting.acquire("k", timeout=0.3)
        assert refused.value.holder is not None
        assert refused.value.holder.fence == lease.fence
        lease.release()
        # Nobody took the key on the gone waiter's behalf: it is free at once.
        holder.acquire("k", timeout=0).release()

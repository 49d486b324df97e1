"""Waiting through the ``http://`` store happens at the server, in its store's order.

A refused client's wait is the acquire itself, with a timeout: on a SQLite-backed
server the waiters are served first come, first served, each release wakes one of
them, and a grant that arrives while a client gives up is handed back.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

import keymutex
from safety._tools.proxy import Proxy

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


def _refusals(live: Live) -> float:
    return live.metric("keymutex_refusals_total")


def test_a_long_wait_is_one_request_at_the_server(live: Live) -> None:
    """A waiter waits at the server up to its own deadline: not a request each second,
    which would also send it to the back of the server's queue each time."""
    with keymutex.Locks(live.url) as holder, keymutex.Locks(live.url) as waiting:
        holder.acquire("k", timeout=0)
        before = _refusals(live)
        with pytest.raises(keymutex.Locked):
            waiting.acquire("k", timeout=3.5)
        # A try, the wait (refused at the deadline), and the try that finds it passed.
        assert _refusals(live) - before == 3


WAITER = """
import json, sys, keymutex
with keymutex.Locks(sys.argv[1]) as locks:
    lease = locks.acquire("k", ttl=1.0, timeout=30)
    print(json.dumps({"fence": lease.fence, "lost": lease.lost}), flush=True)
"""


def test_a_grant_read_late_is_not_counted_from_when_it_was_read(live: Live) -> None:
    """A waiter is granted the key while it is frozen (the reply waits in its socket)
    until well past the TTL, and another client takes the key meanwhile: when it reads
    the grant, its lease must already say ``lost`` — the grant's time is counted from
    when its request was sent, not from when the reply was read."""
    with keymutex.Locks(live.url) as holder:
        lease = holder.acquire("k", timeout=0)
        waiter = subprocess.Popen(
            [sys.executable, "-c", WAITER, live.url], stdout=subprocess.PIPE, text=True
        )
        try:
            _queued(live, 1)
            waiter.send_signal(signal.SIGSTOP)
            try:
                lease.release()  # the server grants the frozen waiter its turn
                # Its lease expires at the server, and another takes the key.
                other = holder.acquire("k", timeout=10)
            finally:
                waiter.send_signal(signal.SIGCONT)
            out, _ = waiter.communicate(timeout=30)
        finally:
            if waiter.poll() is None:
                waiter.kill()
                waiter.wait()
        granted = json.loads(out)
        assert granted["fence"] < other.fence
        assert granted["lost"] is True, "the late grant looked valid while another held the key"
        other.release()


@contextlib.contextmanager
def _lost_first_answer(live: Live) -> Iterator[str]:
    """A URL through a proxy that loses the first acquire's answer (the key granted)."""
    upstream = httpx.URL(live.url)
    with Proxy((upstream.host, upstream.port)) as proxy:
        proxy.set_mode("lose_reply", from_reply=b'"token"')
        yield f"http://127.0.0.1:{proxy.port}"
        assert proxy.mode == "pass", "the answer was lost"


def test_an_acquire_whose_answer_was_lost_gets_the_lease_it_was_granted(live: Live) -> None:
    """Before: StoreError, and the lease stayed granted to a token nobody had: the key
    was held by nobody, even against the same client, for the lease's whole TTL."""
    with (
        _lost_first_answer(live) as url,
        keymutex.Locks(url, ttl=60) as locks,
    ):
        lease = locks.acquire("k", timeout=0)
        held = locks.holder("k")
        assert held is not None
        assert held.fence == lease.fence
        lease.release()
        assert locks.holder("k") is None


@pytest.mark.asyncio
async def test_async_an_acquire_whose_answer_was_lost_gets_the_lease_it_was_granted(
    live: Live,
) -> None:
    with _lost_first_answer(live) as url:
        async with keymutex.AsyncLocks(url, ttl=60) as locks:
            lease = await locks.acquire("k", timeout=0)
            held = await locks.holder("k")
            assert held is not None
            assert held.fence == lease.fence
            await lease.release()
            assert await locks.holder("k") is None

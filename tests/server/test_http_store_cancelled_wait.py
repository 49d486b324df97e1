"""``http://`` store, asyncio: a wait cancelled after its grant's answer was lost gives it back.

Found by the third mutation audit: a waiter gives back, when it closes, whatever an
acquire it *sent* may have been granted (``_WaiterState.unclaimed_token``: ``asked``),
not only a grant it received. With only received grants given back the suite passed:
a task cancelled while its long poll's answer (a grant) was on its way left the key
held by a token nobody had, for the lease's whole TTL. (A cancellation is no
``StoreError``: the client's background give-back does not see it; and the server saw
its answer sent, not a disconnect.)

The grant's answer is held back by a proxy in front of a real server.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

import keymutex

from .conftest import Live


def _waiting(live: Live) -> int:
    with httpx.Client() as client:
        reply = client.get(f"{live.url}/v1/holders", params={"namespace": "", "prefix": "k"})
        return int(reply.json()["waiting"].get("k", 0))


@pytest.mark.asyncio
async def test_async_a_wait_cancelled_after_its_grant_was_lost_gives_it_back(
    live: Live,
) -> None:
    with live.proxied() as (proxy, url):
        async with (
            keymutex.AsyncLocks(live.url) as other,
            keymutex.AsyncLocks(url, timeout=0.5) as locks,
        ):
            lease = await other.acquire("k", timeout=0)
            waiting = asyncio.create_task(locks.acquire("k", ttl=60, timeout=20))
            deadline = time.monotonic() + 10
            while _waiting(live) < 1:
                assert time.monotonic() < deadline, "the wait never reached the server"
                await asyncio.sleep(0.01)
            proxy.set_mode("drop_replies", from_reply=b'"fence"')  # the grant's answer
            await lease.release()  # the server grants the key to the waiting acquire
            while (held := await other.holder("k")) is None:
                assert time.monotonic() < deadline, "the waiter was never granted the key"
                await asyncio.sleep(0.01)
            assert held.fence > lease.fence
            proxy.set_mode("pass")
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            deadline = time.monotonic() + 5
            while await other.holder("k") is not None:
                assert time.monotonic() < deadline, "the lost grant was never given back"
                await asyncio.sleep(0.02)

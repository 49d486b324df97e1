"""``http://`` store: a kept-alive connection closed by the server as a request goes out.

A server closes a kept-alive connection that sat idle too long (the lock server after
5 s); a request sent on it just then never reaches the server, and the client reads an
end of file instead of an answer. Found by review: a heartbeat every 5 s, or a release
after 5 s of work, failed with ``StoreError`` now and then (5 renewals in 160) against a
healthy server. The client now closes idle connections sooner than the server does, and
sends a renewal, a read or a release once more when its connection ends before an
answer comes.

The close is made by a proxy in front of a real server (``close_on_request``): the
matched request is not forwarded, and the client's connection is closed.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import keymutex
from keymutex.stores.http import KEEPALIVE_EXPIRY
from safety._tools.proxy import Proxy

from .conftest import Live

STEPS = [
    pytest.param(b"POST /v1/renew ", id="renew"),
    pytest.param(b"GET /v1/holder?", id="holder"),
    pytest.param(b"GET /v1/holders?", id="holders"),
    pytest.param(b"POST /v1/release ", id="release"),
]


def _closing(proxy: Proxy, request: bytes) -> None:
    proxy.set_mode("close_on_request", after_request=request)


def _closed(proxy: Proxy) -> None:
    assert proxy.closed_on_request == 1, "the request's connection was not closed"


@pytest.mark.parametrize("request_line", STEPS)
def test_a_step_whose_connection_the_server_closes_as_it_goes_out_is_sent_again(
    live: Live, request_line: bytes
) -> None:
    """Before: ``StoreError: … Server disconnected without sending a response``."""
    with live.proxied() as (proxy, url), keymutex.Locks(url, ttl=60) as locks:
        lease = locks.acquire("k", timeout=0)
        _closing(proxy, request_line)
        if request_line.startswith(b"POST /v1/renew"):
            assert locks.renew("k", lease.token, ttl=30).fence == lease.fence
        elif request_line.startswith(b"GET /v1/holders"):
            assert [holder.fence for holder in locks.holders("")] == [lease.fence]
        elif request_line.startswith(b"GET /v1/holder"):
            held = locks.holder("k")
            assert held is not None
            assert held.fence == lease.fence
        else:
            lease.release()
            assert locks.holder("k") is None
        _closed(proxy)
        if request_line.startswith(b"POST /v1/release"):
            return
        lease.release()


@pytest.mark.asyncio
@pytest.mark.parametrize("request_line", STEPS)
async def test_async_a_step_whose_connection_the_server_closes_as_it_goes_out_is_sent_again(
    live: Live, request_line: bytes
) -> None:
    with live.proxied() as (proxy, url):
        async with keymutex.AsyncLocks(url, ttl=60) as locks:
            lease = await locks.acquire("k", timeout=0)
            _closing(proxy, request_line)
            if request_line.startswith(b"POST /v1/renew"):
                assert (await locks.renew("k", lease.token, ttl=30)).fence == lease.fence
            elif request_line.startswith(b"GET /v1/holders"):
                assert [holder.fence for holder in await locks.holders("")] == [lease.fence]
            elif request_line.startswith(b"GET /v1/holder"):
                held = await locks.holder("k")
                assert held is not None
                assert held.fence == lease.fence
            else:
                await lease.release()
                assert await locks.holder("k") is None
            _closed(proxy)
            if not request_line.startswith(b"POST /v1/release"):
                await lease.release()


def test_a_release_whose_answer_is_lost_is_not_called_lost(live: Live) -> None:
    """The server released, and the answer was lost (the connection cut): sent again,
    the release finds the lease gone. It cannot tell "released by the first" from "lost
    before it": a ``StoreError`` saying so, not ``LockLost``. The key is free."""
    with live.proxied() as (proxy, url), keymutex.Locks(url, ttl=60) as locks:
        lease = locks.acquire("k", timeout=0)
        proxy.set_mode("lose_reply", from_reply=b'"released"')
        with pytest.raises(keymutex.StoreError, match="outcome unknown") as failed:
            locks.release("k", lease.token)
        assert not isinstance(failed.value, keymutex.LockLost)
        assert locks.holder("k") is None


@pytest.mark.asyncio
async def test_async_a_release_whose_answer_is_lost_is_not_called_lost(live: Live) -> None:
    with live.proxied() as (proxy, url):
        async with keymutex.AsyncLocks(url, ttl=60) as locks:
            lease = await locks.acquire("k", timeout=0)
            proxy.set_mode("lose_reply", from_reply=b'"released"')
            with pytest.raises(keymutex.StoreError, match="outcome unknown") as failed:
                await locks.release("k", lease.token)
            assert not isinstance(failed.value, keymutex.LockLost)
            assert await locks.holder("k") is None


def test_an_idle_connection_is_not_used_after_the_keepalive_expiry(live: Live) -> None:
    """The client closes an idle connection before the lock server would (5 s): the
    request after a pause longer than ``KEEPALIVE_EXPIRY`` goes on a new one."""
    assert KEEPALIVE_EXPIRY < 5
    with live.proxied() as (proxy, url), keymutex.Locks(url, ttl=60) as locks:
        locks.holder("k")
        locks.holder("k")
        assert proxy.connections == 1, "kept alive between steps close together"
        time.sleep(KEEPALIVE_EXPIRY + 0.5)
        locks.holder("k")
        assert proxy.connections == 2


@pytest.mark.asyncio
async def test_async_an_idle_connection_is_not_used_after_the_keepalive_expiry(
    live: Live,
) -> None:
    with live.proxied() as (proxy, url):
        async with keymutex.AsyncLocks(url, ttl=60) as locks:
            await locks.holder("k")
            await locks.holder("k")
            assert proxy.connections == 1, "kept alive between steps close together"
            await asyncio.sleep(KEEPALIVE_EXPIRY + 0.5)
            await locks.holder("k")
            assert proxy.connections == 2

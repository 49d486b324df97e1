"""``http://`` store: what an acquire does when its answer is not the lock server's.

Found by the third mutation audit (each test kills a mutant the suite let through):

- an acquire whose answer does not come in ``timeout`` is not sent again (a silent
  server would make each retry wait as long again): the server saw one acquire;
- a 500 with a JSON body (an error handler's or a gateway's, not only 502/503) may
  follow a grant just as well: the acquire is asked again and gets its lease;
- a 400 that is not the lock server's ``invalid_argument`` (a proxy's, say) is a
  ``StoreError``, not a ``ValueError``: it says nothing about the caller's arguments,
  and a ``ValueError`` would skip the give-back of a grant the proxy's answer hid.
"""

from __future__ import annotations

import json
import time

import pytest

import keymutex

from .conftest import Live


def _acquires(live: Live) -> float:
    return live.metric("keymutex_acquires_total")


def _http(status: str, payload: dict[str, str]) -> bytes:
    body = json.dumps(payload).encode()
    return (
        b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status.encode(), len(body), body)
    )


def test_an_acquire_that_times_out_is_not_sent_again(live: Live) -> None:
    before = _acquires(live)
    with live.proxied() as (proxy, url):
        locks = keymutex.Locks(url, timeout=0.5)
        try:
            # The acquire reaches the server (granted); no reply comes back.
            proxy.set_mode("drop_replies", after_request=b"POST /v1/acquire ")
            with pytest.raises(keymutex.StoreError, match=r"[Tt]ime[do]|took more than"):
                locks.acquire("k", ttl=60, timeout=0)
            assert _acquires(live) - before == 1, "the timed-out acquire was sent again"
            proxy.set_mode("pass")
        finally:
            locks.close()  # the give-back's last round frees the key
    with keymutex.Locks(live.url) as other:
        assert other.holder("k") is None


@pytest.mark.asyncio
async def test_async_an_acquire_that_times_out_is_not_sent_again(live: Live) -> None:
    before = _acquires(live)
    with live.proxied() as (proxy, url):
        locks = keymutex.AsyncLocks(url, timeout=0.5)
        try:
            proxy.set_mode("drop_replies", after_request=b"POST /v1/acquire ")
            with pytest.raises(keymutex.StoreError, match=r"[Tt]ime[do]|took more than"):
                await locks.acquire("k", ttl=60, timeout=0)
            assert _acquires(live) - before == 1, "the timed-out acquire was sent again"
            proxy.set_mode("pass")
        finally:
            await locks.aclose()


def test_an_acquire_answered_500_with_json_gets_the_lease_it_was_granted(live: Live) -> None:
    answer = _http("500 Internal Server Error", {"error": "internal", "message": "oops"})
    before = _acquires(live)
    with live.proxied() as (proxy, url), keymutex.Locks(url, ttl=60) as locks:
        proxy.set_mode("fail_reply", after_request=b"POST /v1/acquire ", answer=answer)
        lease = locks.acquire("k", timeout=0)
        assert proxy.failed_replies == 1
        assert _acquires(live) - before == 2  # the failed answer's grant, and again
        held = locks.holder("k")
        assert held is not None
        assert held.fence == lease.fence
        lease.release()


@pytest.mark.asyncio
async def test_async_an_acquire_answered_500_with_json_gets_the_lease(live: Live) -> None:
    answer = _http("500 Internal Server Error", {"error": "internal", "message": "oops"})
    with live.proxied() as (proxy, url):
        async with keymutex.AsyncLocks(url, ttl=60) as locks:
            proxy.set_mode("fail_reply", after_request=b"POST /v1/acquire ", answer=answer)
            lease = await locks.acquire("k", timeout=0)
            assert proxy.failed_replies == 1
            held = await locks.holder("k")
            assert held is not None
            assert held.fence == lease.fence
            await lease.release()


def test_a_400_that_is_not_the_lock_servers_is_a_store_error(live: Live) -> None:
    answer = _http("400 Bad Request", {"error": "bad_request", "message": "header too large"})
    with live.proxied() as (proxy, url), keymutex.Locks(url, ttl=60) as locks:
        proxy.set_mode("fail_reply", after_request=b"POST /v1/acquire ", answer=answer)
        with pytest.raises(keymutex.StoreError, match="answered acquire with 400") as failed:
            locks.acquire("k", timeout=0)
        assert not isinstance(failed.value, ValueError)
        # The proxy answered after the server granted: the grant is given back.
        deadline = time.monotonic() + 10
        while locks.holder("k") is not None:
            assert time.monotonic() < deadline, "the hidden grant was never given back"
            time.sleep(0.02)
    with keymutex.Locks(live.url) as locks, pytest.raises(ValueError, match="86400"):
        locks.acquire("k", ttl=100_000, timeout=0)  # the server's own 400: ValueError


def test_a_renewal_that_times_out_is_not_sent_again(live: Live) -> None:
    """Only a connection that ends before an answer comes is sent again (``_DROPPED``),
    not a timeout: found by the same audit, resending after any ``StoreError`` passed
    the suite; a silent server then made every renewal, read and release wait twice
    ``timeout`` (and renewed twice)."""
    with live.proxied() as (proxy, url), keymutex.Locks(url, ttl=60, timeout=0.5) as locks:
        lease = locks.acquire("k", timeout=0)
        before = live.metric("keymutex_renewals_total")
        proxy.set_mode("drop_replies", after_request=b"POST /v1/renew ")
        with pytest.raises(keymutex.StoreError, match=r"[Tt]ime[do]|took more than"):
            locks.renew("k", lease.token, ttl=60)
        assert live.metric("keymutex_renewals_total") - before == 1, "sent again"
        proxy.set_mode("pass")
        lease.release()

"""``Locks.release(key, token)`` of a renewing lease whose release fails: no more renewals.

Found by the third mutation audit: ``_finish_later`` takes the lease out of the
renewer (``renewer.discard``); ``Lease.release`` does that itself before it calls the
store, so only the stateless ``locks.release(key, token)`` depends on it, and no test
covered it. Without it the suite passed, and the renewer went on renewing a lease its
owner had released: the release had landed (its answer was lost), so the next renewal
was refused and the released lease was reported lost to ``on_lost``.

Against a real lock server, through a proxy that replaces the release's answer (sent
after the server released) by a 503.
"""

from __future__ import annotations

import time
from http import HTTPStatus

import pytest

import keymutex
from keymutex.server._protocol import error_response

from .conftest import Live

STORE_FAILED = error_response(
    HTTPStatus.SERVICE_UNAVAILABLE, "store_unavailable", "the lock server's store failed"
)


def test_a_released_lease_is_not_renewed_after_its_release_failed(live: Live) -> None:
    lost: list[keymutex.Lease] = []
    with live.proxied() as (proxy, url), keymutex.Locks(url, ttl=0.6) as locks:
        lease = locks.acquire("k", renew=True, on_lost=lost.append)
        proxy.set_mode("fail_reply", after_request=b"POST /v1/release ", answer=STORE_FAILED)
        with keymutex.Locks(live.url) as other:
            with pytest.raises(keymutex.StoreError):
                locks.release("k", lease.token)
            before = live.metric("keymutex_renewals_total")
            assert proxy.failed_replies == 1
            assert other.holder("k") is None  # the server did release it
            time.sleep(1.5)  # several renewal periods (ttl / 3)
            renewals = live.metric("keymutex_renewals_total") - before
        assert lost == [], "a lease released by its owner was reported lost"
        assert not lease.lost
        # One renewal may have been on its way as the release went out (seen in CI);
        # a renewer that goes on renews every 0.2 s: 7 in these 1.5 s.
        assert renewals <= 1, f"{renewals} renewals of a released lease"

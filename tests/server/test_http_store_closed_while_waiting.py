"""``http://`` store: a grant that reaches a waiter of a client closed meanwhile is given back.

Found by the third mutation audit: the synchronous waiter's ``close()`` releases, by its
token, a grant that came during the wait and that nobody took. Without that release
the suite passed; then a ``Locks`` closed (from another thread) while one of its
acquires waited at the server, and granted the key just after, left the key held by a
token nobody had for the lease's whole TTL: the acquire raised ``RuntimeError`` (the
client is closed), and nothing gave the grant back.
"""

from __future__ import annotations

import threading
import time

import httpx

import keymutex

from .conftest import Live


def _waiting(live: Live) -> int:
    with httpx.Client() as client:
        reply = client.get(f"{live.url}/v1/holders", params={"namespace": "", "prefix": "k"})
        return int(reply.json()["waiting"].get("k", 0))


def test_a_grant_to_a_client_closed_while_it_waited_is_given_back(live: Live) -> None:
    with keymutex.Locks(live.url) as other:
        lease = other.acquire("k", timeout=0)
        locks = keymutex.Locks(live.url)
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                locks.acquire("k", ttl=60, timeout=20)
            except BaseException as exc:
                failed.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        deadline = time.monotonic() + 10
        while _waiting(live) < 1:
            assert time.monotonic() < deadline, "the wait never reached the server"
            time.sleep(0.01)
        closer = threading.Thread(target=locks.close)
        closer.start()
        time.sleep(0.2)  # closed (its acquire still waits at the server)
        lease.release()  # the server grants the key to the closed client's wait
        waiter.join(10)
        closer.join(10)
        assert not waiter.is_alive()
        assert len(failed) == 1
        assert isinstance(failed[0], RuntimeError), failed
        deadline = time.monotonic() + 5
        while other.holder("k") is not None:
            assert time.monotonic() < deadline, "the grant was never given back"
            time.sleep(0.02)

"""``http://`` store: a lock server that refuses the connection is worded one way.

Found by a new user's walk-through: ``Locks`` (httpx's sync transport) said "[Errno
111] Connection refused", and ``AsyncLocks`` (anyio under httpx) "All connection
attempts failed" for the same refusal, so ``keymutex ls`` and ``keymutex run`` told one
situation two ways.
"""

from __future__ import annotations

import asyncio
import errno
import os

import httpx
import pytest

import keymutex
from _processes import free_port


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_refused_connection_says_the_same_from_locks_and_async_locks(host: str) -> None:
    url = f"http://{host}:{free_port()}"  # nobody listens there
    said = f"lock server {url} failed: [Errno 111] Connection refused"
    with keymutex.Locks(url) as locks, pytest.raises(keymutex.StoreError) as sync_failed:
        locks.holders("")

    async def holders() -> None:
        async with keymutex.AsyncLocks(url) as locks:
            await locks.holders("")

    with pytest.raises(keymutex.StoreError) as async_failed:
        asyncio.run(holders())
    assert (str(sync_failed.value), str(async_failed.value)) == (said, said)


def test_of_several_addresses_tried_the_last_ones_error_is_said_as_the_sync_client_does() -> None:
    """``localhost`` on a host without IPv6: anyio's attempt on ``::1`` fails with errno
    99 ("Cannot assign requested address"), then 127.0.0.1 refuses; the sync client
    (``socket.create_connection``) reports the last address's error, and so does the
    async one (found by review: it reported the first's, so the two differed there)."""
    from keymutex.stores import http

    attempts = ExceptionGroup(
        "attempts",
        [OSError(errno.EADDRNOTAVAIL, "no IPv6"), ConnectionRefusedError(errno.ECONNREFUSED, "")],
    )
    failure = httpx.ConnectError("All connection attempts failed")
    failure.__cause__ = attempts
    assert http._why(failure) == f"[Errno {errno.ECONNREFUSED}] {os.strerror(errno.ECONNREFUSED)}"

"""``http://`` store: a lock server that refuses the connection is worded one way.

Found by a new user's walk-through: ``Locks`` (httpx's sync transport) said "[Errno
111] Connection refused", and ``AsyncLocks`` (anyio under httpx) "All connection
attempts failed" for the same refusal, so ``keymutex ls`` and ``keymutex run`` told one
situation two ways.
"""

from __future__ import annotations

import asyncio

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

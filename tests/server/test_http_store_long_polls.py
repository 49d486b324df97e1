"""A wait at the lock server longer than the ``http://`` store's ``timeout`` option.

``timeout`` bounds each phase of a request "beyond the time a long poll may wait"
(stores/http.py): a waiting acquire's read timeout and overall budget both add the
wait. Found by the third mutation audit: with either addition dropped (the read
timeout, or the budget, without ``call.wait``) the suite still passed, and every wait
longer than ``timeout`` (2 x ``timeout``) failed with ``StoreError`` instead of getting
the key when it was released.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import keymutex

from .conftest import Live

TIMEOUT = 0.5  # the store's per-phase timeout
HELD_FOR = 2.0  # > 2 x TIMEOUT: longer than any budget that forgets the wait


def test_a_wait_longer_than_the_timeout_option_gets_the_key(live: Live) -> None:
    with (
        keymutex.Locks(live.url) as holding,
        keymutex.Locks(live.url, timeout=TIMEOUT) as waiting,
    ):
        lease = holding.acquire("k", timeout=0)
        threading.Timer(HELD_FOR, lease.release).start()
        started = time.monotonic()
        got = waiting.acquire("k", timeout=HELD_FOR + 5)
        assert time.monotonic() - started >= HELD_FOR - 0.1
        assert got.fence > lease.fence
        got.release()


@pytest.mark.asyncio
async def test_async_a_wait_longer_than_the_timeout_option_gets_the_key(live: Live) -> None:
    async with (
        keymutex.AsyncLocks(live.url) as holding,
        keymutex.AsyncLocks(live.url, timeout=TIMEOUT) as waiting,
    ):
        lease = await holding.acquire("k", timeout=0)

        async def release_later() -> None:
            await asyncio.sleep(HELD_FOR)
            await lease.release()

        releasing = asyncio.create_task(release_later())
        started = time.monotonic()
        got = await waiting.acquire("k", timeout=HELD_FOR + 5)
        assert time.monotonic() - started >= HELD_FOR - 0.1
        assert got.fence > lease.fence
        await got.release()
        await releasing

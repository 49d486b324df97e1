"""A caller that hangs up leaves no lease behind, even when the grant comes at that moment."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from starlette.requests import ClientDisconnect, Request
from starlette.types import Message

import keymutex
from keymutex.server._app import _unless_disconnected


@pytest.mark.asyncio
async def test_a_grant_that_comes_with_the_hang_up_is_given_back() -> None:
    """Before: the lease was answered to a connection already gone, and stayed held for
    its TTL (2 in 15 tries of a release racing a reset socket)."""
    async with keymutex.AsyncLocks(f"memory://t{uuid.uuid4().hex}") as locks:
        granted = asyncio.Event()

        async def receive() -> Message:
            await granted.wait()  # the hang-up is read just after the grant
            return {"type": "http.disconnect"}

        async def acquire() -> keymutex.AsyncLease:
            lease = await locks.acquire("doc", ttl=60)
            granted.set()
            return lease

        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        with pytest.raises(ClientDisconnect):
            await _unless_disconnected(request, acquire(), asyncio.Event())
        assert await locks.holder("doc") is None

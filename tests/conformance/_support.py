"""Checks shared by the sync and async tests of the conformance suite."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import keymutex

T = TypeVar("T")

# Long enough for any healthy store on a loaded CI machine; a test that reaches it fails.
PATIENCE = 20.0

# Random, at least 128 bits, URL-safe: 22 base64url characters carry 132 bits.
TOKEN_PATTERN = re.compile(r"[A-Za-z0-9._~-]{22,}")

HOLDER_FIELDS = {"key", "owner", "info", "fence", "acquired_at", "expires_at"}


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def wait_until(
    condition: Callable[[], bool], what: str, patience: float = PATIENCE, every: float = 0.01
) -> None:
    """Poll ``condition`` until it holds, every ``every`` seconds (0: at once again);
    fail after ``patience`` seconds."""
    deadline = time.monotonic() + patience
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {patience} s waiting until {what}")
        time.sleep(every)


async def await_until(
    condition: Callable[[], Awaitable[bool]],
    what: str,
    patience: float = PATIENCE,
    every: float = 0.01,
) -> None:
    deadline = time.monotonic() + patience
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {patience} s waiting until {what}")
        await asyncio.sleep(every)


def wait_out(lease: Any) -> None:
    """Wait until ``lease`` has expired by this process's clock (``remaining`` is 0)."""
    wait_until(lambda: lease.remaining == 0, f"the lease on {lease.key!r} runs out")


async def await_out(lease: Any) -> None:
    async def ran_out() -> bool:
        return bool(lease.remaining == 0)

    await await_until(ran_out, f"the lease on {lease.key!r} runs out")


def assert_is_holder_of(holder: object, lease: Any) -> None:
    """``holder`` is a ``Holder`` describing ``lease`` (and does not carry its token)."""
    assert isinstance(holder, keymutex.Holder), holder
    assert holder.key == lease.key
    assert holder.owner == lease.owner
    assert holder.info == lease.info
    assert holder.fence == lease.fence
    assert abs(holder.acquired_at - lease.acquired_at) < 1.0
    assert_no_token(holder, lease.token)


def assert_no_token(value: object, token: str) -> None:
    """Nothing reachable from ``value`` (a Holder or an error) reveals ``token``."""
    assert not hasattr(value, "token")
    assert token not in repr(value)
    assert token not in str(value)
    if isinstance(value, BaseException):
        assert token not in repr(value.args)
        for name in ("holder",):
            inner = getattr(value, name, None)
            if inner is not None:
                assert_no_token(inner, token)
    if dataclasses.is_dataclass(value):
        assert "token" not in {field.name for field in dataclasses.fields(value)}
        for field in dataclasses.fields(value):
            assert token not in repr(getattr(value, field.name))


def assert_fresh_lease(lease: Any, key: str, ttl: float, *, owner: str, info: Any) -> None:
    """Everything a user reads on a lease they were just granted."""
    now = time.time()
    assert lease.key == key
    assert isinstance(lease.token, str)
    assert TOKEN_PATTERN.fullmatch(lease.token), lease.token
    assert type(lease.fence) is int
    assert lease.owner == owner
    assert lease.info == info
    assert isinstance(lease.acquired_at, float)
    assert isinstance(lease.expires_at, float)
    assert now - 5 <= lease.acquired_at <= now + 1
    assert lease.acquired_at <= lease.expires_at
    assert abs((lease.expires_at - lease.acquired_at) - ttl) < 1.0
    assert 0 < lease.remaining <= ttl
    assert lease.lost is False


class Worker(threading.Thread):
    """A thread that runs ``target`` and keeps its result or exception for ``join``."""

    def __init__(self, target: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._target_call = target
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._target_call()
        except BaseException as exc:  # handed to the test by outcome()
            self.error = exc

    def outcome(self, patience: float = PATIENCE) -> Any:
        self.join(patience)
        assert not self.is_alive(), f"thread still running after {patience} s"
        if self.error is not None:
            raise self.error
        return self.result


def start(target: Callable[[], T]) -> Worker:
    worker = Worker(target)
    worker.start()
    return worker

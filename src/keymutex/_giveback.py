"""Giving back what the store may have granted to an acquire that failed.

An acquire that fails at the store (``StoreError``) may have been granted all the same:
its answer timed out while the server was only slow (a pause, a busy script, a
congested link), or the answer was lost on its way back. Such a grant belongs to a
token that only the client drew, and the caller never saw: the key would be held by
nobody for its whole TTL, against the very caller who tries again.

So the client releases by that token in the background: at once, then 0.1, 0.4, 1.3,
4 … seconds after the failure (three times longer each time), and a last time when a
grant made at the failure would have expired, until one release finds the grant. A
release checks the token atomically in the store, so it ends that grant and nothing
else; where nothing was granted it finds nothing and changes nothing. A server that
stalls past the TTL and grants afterwards is not waited for: that grant expires by
its TTL, as before.

Not for a token the caller named: the lock server passes its clients' tokens, and a
client asks again with the same token when an answer was lost, to be answered with
the lease it holds; releasing that token behind its back would take the lease from it.

One thread (``GiveBacks``) or task (``AsyncGiveBacks``) per client does it, while it
has tokens to give back. Each round of releases stops at the first that fails (the
store is still out of reach): the others wait for their next time. Closing the client
makes one last round of every token still waiting, then the store closes; it waits for
that round at most ``JOIN_GRACE`` seconds (the round goes on, and closes the store at
its end). An ``AsyncLocks`` gives back in the event loop where its acquire failed; the
tokens still waiting when that loop ends are taken up by the next failure in a later
loop, or left to their TTL. At most ``MAX_TOKENS`` wait at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from keymutex import _clock
from keymutex._lease import Outcome

_LOG = logging.getLogger("keymutex")

FIRST_WAIT = 0.1  # seconds between the first two releases
GROWTH = 3.0  # each wait this much longer than the one before
JOIN_GRACE = 5.0  # seconds close() and aclose() wait for the last round
# Tokens kept at most: beyond, a failed acquire's grant is left to its TTL. Bounds the
# memory, and the releases once the store is back, of an application that retries
# failing acquires in a tight loop.
MAX_TOKENS = 10_000


class _Calls(Protocol):
    """What a client counts its calls at the store with (``_client._StoreCalls``): the
    last call to leave after the client's ``close()`` closes the store."""

    def enter(self, *, beside: bool = False) -> bool: ...

    def __exit__(self, *exc_info: object) -> None: ...

    async def __aexit__(self, *exc_info: object) -> None: ...


@dataclass
class _Token:
    key: str
    token: str
    last: float  # monotonic: when a grant made at the failure would have expired
    wait: float  # from the next release to the one after


class _Plan:
    """The tokens to give back, by when their next release is due."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, _Token]] = []
        self._order = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._due)

    def add(self, key: str, token: str, ttl: float, now: float) -> None:
        if len(self._due) >= MAX_TOKENS:  # failing acquires in a tight loop, store down
            _LOG.debug("not giving back %r: %d tokens wait already", key, MAX_TOKENS)
            return
        self._push(now, _Token(key, token, now + ttl, FIRST_WAIT))

    def next_batch(self, now: float, *, closing: bool) -> list[_Token] | float | None:
        """The tokens to release now, or how long to wait for the next, or ``None``:
        nothing left. Closing, every token is released once more, now."""
        if closing or (self._due and self._due[0][0] <= now):
            batch = []
            while self._due and (closing or self._due[0][0] <= now):
                batch.append(heapq.heappop(self._due)[2])
            return batch or None
        return self._due[0][0] - now if self._due else None

    def again(self, tokens: list[_Token], now: float) -> None:
        """Tokens whose grant was not found (or not looked for): their next release,
        unless the last one was made."""
        for token in tokens:
            if now < token.last:
                self._push(min(now + token.wait, token.last), token)
                token.wait *= GROWTH

    def _push(self, when: float, token: _Token) -> None:
        heapq.heappush(self._due, (when, next(self._order), token))


def _found(token: _Token, outcome: Outcome) -> bool:
    if outcome.ok:
        _LOG.warning(
            "released %r in the background: an acquire's grant whose answer came too late"
            " or was lost, or a lease whose release had failed",
            token.key,
        )
    return outcome.ok


def _failed(token: _Token, exc: Exception) -> None:
    _LOG.debug("giving back %r failed, tried again later: %s", token.key, exc)


class GiveBacks:
    """The background releases of one ``Locks`` (see the module's docstring)."""

    def __init__(self, release: Callable[[str, str], Outcome], calls: _Calls) -> None:
        self._release = release
        self._calls = calls
        self._plan = _Plan()
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False

    def add(self, key: str, token: str, ttl: float) -> None:
        """Give back ``token``'s grant of ``key``, if any. Called by an acquire still
        counted at the store: the store is open, whether the client is closing or not."""
        with self._wakeup:
            self._plan.add(key, token, ttl, _clock.monotonic())
            if self._thread is None:
                self._calls.enter(beside=True)  # held until the thread ends
                self._thread = threading.Thread(
                    target=self._run, name="keymutex-give-back", daemon=True
                )
                self._thread.start()
            else:
                self._wakeup.notify()

    def close(self) -> None:
        """One last round for every token waiting; ``close()`` waits for it, boundedly."""
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_GRACE)

    def _run(self) -> None:
        try:
            while (batch := self._next_batch()) is not None:
                self._round(batch)
        finally:
            self._calls.__exit__()

    def _next_batch(self) -> list[_Token] | None:
        with self._wakeup:
            while True:
                step = self._plan.next_batch(_clock.monotonic(), closing=self._closing)
                if not isinstance(step, float):
                    if step is None:
                        self._thread = None
                    return step
                self._wakeup.wait(step)

    def _round(self, batch: list[_Token]) -> None:
        for done, token in enumerate(batch):
            try:
                if _found(token, self._release(token.key, token.token)):
                    continue
            except Exception as exc:  # StoreError (or a bug): the rest wait too
                _failed(token, exc)
                self._again(batch[done:])
                return
            self._again([token])

    def _again(self, tokens: list[_Token]) -> None:
        with self._wakeup:
            if not self._closing:
                self._plan.again(tokens, _clock.monotonic())


class AsyncGiveBacks:
    """The background releases of one ``AsyncLocks``: one task, as ``GiveBacks``."""

    def __init__(self, release: Callable[[str, str], Awaitable[Outcome]], calls: _Calls) -> None:
        self._release = release
        self._calls = calls
        self._plan = _Plan()
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._closing = False

    def add(self, key: str, token: str, ttl: float) -> None:
        """As ``GiveBacks.add``; called in the client's event loop."""
        self._plan.add(key, token, ttl, _clock.monotonic())
        if not self._runs_here(self._task):  # none yet, or ended with an earlier loop
            self._calls.enter(beside=True)
            self._wakeup = asyncio.Event()
            self._task = asyncio.ensure_future(self._run(self._wakeup))
        elif self._wakeup is not None:
            self._wakeup.set()

    @staticmethod
    def _runs_here(task: asyncio.Task[None] | None) -> bool:
        """Whether ``task`` is under way in the running loop. (An ``AsyncLocks`` may be
        used by one ``asyncio.run`` after another: a task of an ended loop is over.)"""
        return (
            task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop()
        )

    async def aclose(self) -> None:
        """One last round for every token waiting, awaited (unless from it)."""
        self._closing = True
        task = self._task
        if task is None or not self._runs_here(task):
            return
        if self._wakeup is not None:
            self._wakeup.set()
        if task is not asyncio.current_task():  # bounded, as Locks.close: it may hang
            await asyncio.wait([task], timeout=JOIN_GRACE)

    async def _run(self, wakeup: asyncio.Event) -> None:
        try:
            while True:
                step = self._plan.next_batch(_clock.monotonic(), closing=self._closing)
                if step is None:
                    return
                if isinstance(step, float):
                    wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wakeup.wait(), step)
                    continue
                await self._round(step)
        finally:
            if self._task is asyncio.current_task():
                self._task = None
            await self._calls.__aexit__()

    async def _round(self, batch: list[_Token]) -> None:
        for done, token in enumerate(batch):
            try:
                if _found(token, await self._release(token.key, token.token)):
                    continue
            except Exception as exc:  # as GiveBacks._round
                _failed(token, exc)
                self._again(batch[done:])
                return
            self._again([token])

    def _again(self, tokens: list[_Token]) -> None:
        if not self._closing:
            self._plan.again(tokens, _clock.monotonic())

"""What a store provides: non-blocking atomic steps, and a way to wait for a release.

A store knows nothing of waiting, renewing or context managers: ``Locks`` and
``AsyncLocks`` (``_client``) write those once over any store. A store is opened for one
namespace and speaks in keys without it.

Contract of each step (sync shown; ``AsyncStore`` is the same with ``await``):

- ``try_acquire``: grant the key to ``token`` if it is free (no live lease) or
  ``steal`` is set, with a fence larger than any granted before on that key. A store
  that queues waiters (``Capabilities.fair``) grants a free key only to a caller whose
  ``waiter`` is first in the key's queue, or to anyone when the queue is empty; a
  refused caller with a ``waiter`` joins the queue in the same atomic step, so a release
  that follows is sure to notify it. A key that ``token`` holds already is granted
  again as it stands (a retry whose reply was lost), its expiry never shortened.
- ``renew`` / ``release``: only while ``token`` holds a live lease, checked atomically.
- ``holder`` / ``holders``: read-only.
- ``renew_many``: the renewals of a batch; a store of several servers that reached some
  of them raises ``PartialRenewal`` with the outcomes it has, so that a failed server
  does not fail the leases of the others.

Every step returns an ``Outcome`` or raises ``StoreError``; driver exceptions are
translated by ``translate_errors`` in the store module, never leaked.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from keymutex import _clock
from keymutex._errors import StoreError
from keymutex._lease import Holder, Outcome
from keymutex._validate import MAX_TTL

__all__ = [
    "AsyncStore",
    "AsyncWaiter",
    "Capabilities",
    "PartialRenewal",
    "RenewRequest",
    "Store",
    "StoreDriver",
    "ThreadedAsyncStore",
    "Waiter",
    "WouldBlock",
    "cancel_left",
    "each_within",
    "each_within_async",
    "stop_task",
    "translate_errors",
]

P = ParamSpec("P")
R = TypeVar("R")
K = TypeVar("K")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store guarantees; the client adapts its waiting to it.

    - ``notifies``: a release wakes a registered waiter (else waiters back off and poll).
    - ``fair``: waiters are granted a freed key in arrival order, across clients.
    - ``cross_process``: other processes see the same leases.
    - ``durable_fences``: fences never go backwards across a restart of the store.
    - ``clock``: whose clock measures TTLs, e.g. "host-monotonic", "server".
    - ``waits_at_store``: a waiter's wait is itself a request queued at the store (the
      lock server), answered at its turn or at the holder's expiry: the client lets it
      wait up to its own deadline rather than look again every second, which would
      send it to the back of the queue each time.
    - ``paces_waits``: the store's waiter sets the pace of its own polling (memcached:
      its patience, then its place in the queue): the client parks it for the step it
      chooses, up to the holder's expiry and the caller's deadline, and adds no backoff
      of its own, which would make it look sooner than it means to.
    """

    notifies: bool
    fair: bool
    cross_process: bool
    durable_fences: bool
    clock: str
    waits_at_store: bool = False
    paces_waits: bool = False


@dataclass(frozen=True, slots=True)
class RenewRequest:
    key: str
    token: str
    ttl: float


class Waiter(Protocol):
    """A registration to be woken when a key is released (one per waiting client).

    ``wait`` parks up to ``timeout`` seconds and says whether a notification came.
    ``wait_async`` does the same without blocking the event loop, for adapters.
    ``close`` leaves the queue; if the key is free, it passes the turn on.
    """

    def wait(self, timeout: float) -> bool: ...

    async def wait_async(self, timeout: float) -> bool: ...

    def close(self) -> None: ...


class Store(Protocol):
    capabilities: Capabilities

    def try_acquire(
        self,
        key: str,
        *,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: Waiter | None,
    ) -> Outcome: ...

    def renew(self, key: str, token: str, ttl: float) -> Outcome: ...

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]: ...

    def release(self, key: str, token: str) -> Outcome: ...

    def holder(self, key: str) -> Holder | None: ...

    def holders(self, prefix: str) -> list[Holder]: ...

    def waiter(self, key: str) -> Waiter: ...

    def close(self) -> None: ...


class AsyncWaiter(Protocol):
    async def wait(self, timeout: float) -> bool: ...

    async def aclose(self) -> None: ...


class AsyncStore(Protocol):
    capabilities: Capabilities

    async def try_acquire(
        self,
        key: str,
        *,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: AsyncWaiter | None,
    ) -> Outcome: ...

    async def renew(self, key: str, token: str, ttl: float) -> Outcome: ...

    async def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]: ...

    async def release(self, key: str, token: str) -> Outcome: ...

    async def holder(self, key: str) -> Holder | None: ...

    async def holders(self, prefix: str) -> list[Holder]: ...

    async def waiter(self, key: str) -> AsyncWaiter: ...

    async def aclose(self) -> None: ...


class StoreDriver(Protocol):
    """What a store module exports as its entry point (group ``keymutex.stores``).

    A driver whose store accepts shorter leases than the library's ten years says so
    in a ``max_ttl`` attribute (seconds): clients refuse a longer ``ttl`` before
    opening or calling the store.
    """

    def open(self, url: str, *, namespace: str, options: Mapping[str, object]) -> Store: ...

    def open_async(
        self, url: str, *, namespace: str, options: Mapping[str, object]
    ) -> AsyncStore: ...


def max_ttl_of(driver: StoreDriver) -> float:
    """The longest ``ttl`` the driver's store accepts (see ``StoreDriver``)."""
    return float(getattr(driver, "max_ttl", MAX_TTL))


class _Translation:
    """What ``translate_errors`` returns: a context manager as a class, not a
    ``contextlib.contextmanager`` generator, which costs several times more to enter
    and leave (it wraps every store step)."""

    __slots__ = ("_driver_errors", "_reason", "_what")

    def __init__(
        self,
        driver_errors: tuple[type[BaseException], ...],
        what: str,
        reason: Callable[[BaseException], str] | None,
    ) -> None:
        self._driver_errors = driver_errors
        self._what = what
        self._reason = reason

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is not None and isinstance(exc, self._driver_errors):
            reason = str(exc) if self._reason is None else self._reason(exc)
            raise StoreError(f"{self._what}: {reason or type(exc).__name__}") from exc


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (a background reader, watcher or renewer) and wait until it ends.

    Its cancellation is its end and is not raised; a failure of its own is, as awaiting
    it raised. A caller cancelled while it waits is cancelled: found by review,
    ``suppress(CancelledError)`` around ``await task`` swallowed the caller's own
    cancellation too, and an ``asyncio.timeout()`` around ``aclose()`` never fired.
    """
    if task is None:
        return
    if task.done():
        if not task.cancelled():
            task.exception()  # ended by itself earlier: retrieved, it said so when it did
        return
    task.cancel()
    task.add_done_callback(_retrieve)  # if the caller is cancelled before it ends
    await asyncio.wait([task])
    if not task.cancelled():
        task.result()


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def translate_errors(
    *driver_errors: type[BaseException],
    what: str,
    reason: Callable[[BaseException], str] | None = None,
) -> _Translation:
    """Turn the driver's own exceptions into ``StoreError`` (the original as cause):
    ``what: reason``, the reason by default the exception's own text."""
    return _Translation(driver_errors, what, reason)


def _settle(step: asyncio.Future[Any]) -> None:
    """Mark a step's outcome as seen: its caller may have been cancelled meanwhile."""
    if not step.cancelled():
        step.exception()


class _AdaptedWaiter:
    __slots__ = ("_call", "_inner")

    def __init__(self, inner: Waiter, call: Callable[..., Awaitable[Any]]) -> None:
        self._inner = inner
        self._call = call

    async def wait(self, timeout: float) -> bool:
        return await self._inner.wait_async(timeout)

    async def aclose(self) -> None:
        await self._call(self._inner.close)


class PartialRenewal(StoreError):
    """``renew_many`` reached only some of the store's servers: ``outcomes`` has the
    outcome of each request that was answered, ``None`` for each that was not (its
    server failed, as the message and ``__cause__`` say)."""

    def __init__(self, message: str, outcomes: Sequence[Outcome | None]) -> None:
        super().__init__(message)
        self.outcomes = list(outcomes)


def each_within(
    jobs: Mapping[K, Callable[[], R]], within: float, *, name: str
) -> dict[K, R | Exception]:
    """Run each of ``jobs`` at once on a daemon thread of its own, and wait ``within``
    seconds at most: what each job that ended by then returned (or the ``Exception`` it
    raised). A job missing from the result has not answered: it goes on in the
    background, and what it returns is dropped.

    For a ``renew_many`` over several servers or nodes: one that does not answer (a
    paused process, a hung host) must not hold up the others' renewals of the same
    batch for its socket timeout, nor cost leases that their own servers would have
    renewed. (The client's renewer does not wait for a slow call to start the next
    one: the batches after it are not held up either.)
    """
    ended: dict[K, R | Exception] = {}

    def run(key: K, job: Callable[[], R]) -> None:
        try:
            ended[key] = job()
        except Exception as exc:  # handed to the caller
            ended[key] = exc

    threads = [
        threading.Thread(target=run, args=item, name=name, daemon=True) for item in jobs.items()
    ]
    for thread in threads:
        thread.start()
    give_up = _clock.monotonic() + within
    for thread in threads:
        thread.join(max(0.0, give_up - _clock.monotonic()))
    return dict(ended)  # a copy: a job that ends later writes only in ``ended``


async def each_within_async(
    jobs: Mapping[K, Callable[[], Awaitable[R]]],
    within: float,
    left: set[asyncio.Future[Any]],
) -> dict[K, R | Exception]:
    """As ``each_within``, for coroutines: each runs as a task of the running loop. A
    task still running after ``within`` seconds is left to end (at its own timeout), not
    cancelled (a cancelled command could leave its connection out of step): it goes in
    ``left`` until it ends, its outcome dropped and its exception retrieved, so that its
    owner can cancel it when it closes. Cancelled while it waits, this cancels the tasks
    and waits for them to end (found by review: left behind, a renewal still running
    after ``aclose()`` held a connection of the closed client)."""
    tasks = {key: asyncio.ensure_future(job()) for key, job in jobs.items()}
    if not tasks:
        return {}
    try:
        await asyncio.wait(tasks.values(), timeout=within)
    except BaseException:
        await cancel_left(tasks.values())
        raise
    ended: dict[K, R | Exception] = {}
    for key, task in tasks.items():
        if not task.done():
            left.add(task)
            task.add_done_callback(functools.partial(_left_ended, left))
        elif task.cancelled():
            raise asyncio.CancelledError
        elif (error := task.exception()) is not None:
            if not isinstance(error, Exception):
                raise error
            ended[key] = error
        else:
            ended[key] = task.result()
    return ended


async def cancel_left(left: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel tasks left running (by ``each_within_async``, by a renewer that stopped
    waiting for a call), and wait for them to end; what they raised is retrieved."""
    tasks = list(left)
    for task in tasks:
        task.cancel()
        task.add_done_callback(_retrieve)
    if tasks:
        await asyncio.wait(tasks)


def _left_ended(left: set[asyncio.Future[Any]], task: asyncio.Future[Any]) -> None:
    left.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: an error of a renewal nobody waits for any more


class NotSent(StoreError):
    """An acquire's step that failed before any step with its token could reach the
    store: nothing can have been granted to that token, so there is nothing to give
    back. A store raises it only when that is certain (ZooKeeper: this client never had
    a session, so it never created a node); otherwise a plain ``StoreError``."""


class WouldBlock(Exception):
    """An inline attempt (``ThreadedAsyncStore``'s ``attempt``) would have to wait: it
    was given up before it changed anything, and the step runs in a thread instead."""


class ThreadedAsyncStore:
    """An ``AsyncStore`` over a sync ``Store``.

    Each step runs in a worker thread of the loop's default executor, as a plain
    future (``run_in_executor``: no task and no context copy, which cost about a
    tenth of a step's round trip to the thread), or inline when ``inline`` is set
    because the store's steps never block (the memory store).

    ``attempt``, for a store whose steps are short unless they must wait for a lock
    (SQLite): ``attempt(step, *args)`` runs a step in the loop's thread, never waiting,
    and raises ``WouldBlock`` (having changed nothing) where it would have to; only
    then does the step go to a thread. A round trip to a thread costs several times
    such a step.

    Waiting never holds a thread: it uses the waiter's ``wait_async``.
    """

    def __init__(
        self, store: Store, *, inline: bool, attempt: Callable[..., Any] | None = None
    ) -> None:
        self._store = store
        self._inline = inline
        self._attempt = attempt
        self.capabilities = store.capabilities
        # Steps running in threads: a cancelled caller stops waiting, the thread goes
        # on, and ``aclose`` lets it finish before it closes the store under it.
        self._running: set[asyncio.Future[Any]] = set()

    async def _call(self, function: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        if self._inline:
            return function(*args, **kwargs)
        if self._attempt is not None:
            try:
                return cast(R, self._attempt(function, *args, **kwargs))
            except WouldBlock:
                pass
        step = asyncio.get_running_loop().run_in_executor(
            None, functools.partial(function, *args, **kwargs)
        )
        self._running.add(step)
        step.add_done_callback(_settle)
        step.add_done_callback(self._running.discard)
        return await asyncio.shield(step)

    async def try_acquire(
        self,
        key: str,
        *,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: AsyncWaiter | None,
    ) -> Outcome:
        inner = waiter._inner if isinstance(waiter, _AdaptedWaiter) else None
        return await self._call(
            self._store.try_acquire,
            key,
            token=token,
            ttl=ttl,
            owner=owner,
            info=info,
            steal=steal,
            waiter=inner,
        )

    async def renew(self, key: str, token: str, ttl: float) -> Outcome:
        return await self._call(self._store.renew, key, token, ttl)

    async def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        return await self._call(self._store.renew_many, requests)

    async def release(self, key: str, token: str) -> Outcome:
        return await self._call(self._store.release, key, token)

    async def holder(self, key: str) -> Holder | None:
        return await self._call(self._store.holder, key)

    async def holders(self, prefix: str) -> list[Holder]:
        return await self._call(self._store.holders, prefix)

    async def waiter(self, key: str) -> AsyncWaiter:
        return _AdaptedWaiter(self._store.waiter(key), self._call)

    async def aclose(self) -> None:
        if self._running:
            await asyncio.wait(set(self._running))
        await self._call(self._store.close)


class StoreOfTheLoop:
    """An ``AsyncStore`` of its own for each event loop it is used in.

    The connections of ``redis.asyncio`` and ``httpx`` belong to the loop that made
    them: an ``AsyncLocks`` used by one ``asyncio.run`` after another (a module-level
    client; pytest-asyncio's loop per test) failed in the second with ``RuntimeError:
    Event loop is closed`` or "attached to a different loop". Each step takes the store of the running loop, opened at its
    first step there, and closed when that loop shuts down (``asyncio.run`` and
    ``asyncio.Runner`` close the loop's async generators before the loop: one of
    ours, started with the store, closes it then). A loop closed without that (by
    hand, ``loop.close()``) leaves its store to be closed as far as it can be without
    its loop, in the background. Tokens work from any store
    instance, so leases granted in one loop are renewed and released in the next.
    Only for stores that say ``loop_bound = True`` (Redis, etcd, MongoDB, the lock
    server); the others work in one loop after another as they are (SQLite and memory
    in threads, PostgreSQL, memcached, ZooKeeper: checked with two ``asyncio.run``).
    """

    def __init__(self, store: AsyncStore, open_store: Callable[[], AsyncStore]) -> None:
        self._open = open_store
        self._unused: AsyncStore | None = store  # opened already, for the first loop
        self._store = store  # the one used last: its capabilities, its extras
        self._stores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncStore]
        self._stores = weakref.WeakKeyDictionary()
        # Per loop, the async generator that closes its store when the loop shuts down
        # (the loop keeps its generators in a weak set: held here).
        self._closers: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, AsyncGenerator[None, None]
        ] = weakref.WeakKeyDictionary()
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def capabilities(self) -> Capabilities:
        return self._store.capabilities

    @capabilities.setter
    def capabilities(self, value: Capabilities) -> None:
        self._store.capabilities = value

    def _here(self) -> AsyncStore:
        loop = asyncio.get_running_loop()
        store = self._stores.get(loop)
        if store is None:
            store, self._unused = self._unused or self._open(), None
            self._stores[loop] = store
            self._closers[loop] = _started(self._close_at_shutdown())
            for ended in [x for x in self._stores if x.is_closed()]:
                task = asyncio.ensure_future(_close_quietly(self._stores.pop(ended)))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        self._store = store
        return store

    def __getattr__(self, name: str) -> Any:  # a store's own extras (tests, the CLI)
        return getattr(self._store, name)

    async def try_acquire(self, key: str, **arguments: Any) -> Outcome:
        return await self._here().try_acquire(key, **arguments)

    async def renew(self, key: str, token: str, ttl: float) -> Outcome:
        return await self._here().renew(key, token, ttl)

    async def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        return await self._here().renew_many(requests)

    async def release(self, key: str, token: str) -> Outcome:
        return await self._here().release(key, token)

    async def holder(self, key: str) -> Holder | None:
        return await self._here().holder(key)

    async def holders(self, prefix: str) -> list[Holder]:
        return await self._here().holders(prefix)

    async def waiter(self, key: str) -> AsyncWaiter:
        return await self._here().waiter(key)

    async def _close_at_shutdown(self) -> AsyncGenerator[None, None]:
        """Close the running loop's store when the loop shuts its async generators down,
        unless ``aclose()`` did. Found in CI: a store of a loop that ``asyncio.run``
        had ended kept its Redis connections open until the garbage collector warned
        of them, during some later test. (No reference to the loop here: it is the
        key of the weak dictionaries.)"""
        try:
            yield
        finally:
            store = self._stores.pop(asyncio.get_running_loop(), None)
            if store is not None:
                await _close_quietly(store)

    async def aclose(self) -> None:
        """Close the store of the running loop (and those of closed loops). The stores
        of other loops still open are theirs: closed when they shut down."""
        loop = asyncio.get_running_loop()
        for ended in [x for x in self._stores if x.is_closed()]:
            await _close_quietly(self._stores.pop(ended))
        if self._closing:
            await asyncio.wait(self._closing)
        store = self._stores.pop(loop, None) or self._unused
        self._unused = None
        if store is not None:
            await store.aclose()


def _started(generator: AsyncGenerator[None, None]) -> AsyncGenerator[None, None]:
    """``generator`` run to its first ``yield`` (which it reaches without waiting: the
    step ends at once), in the running loop: the loop now knows it, and closes it when
    it shuts down."""
    with contextlib.suppress(StopIteration):
        generator.asend(None).send(None)
    return generator


async def _close_quietly(store: AsyncStore) -> None:
    """Close a store whose loop has ended: what needed that loop fails, and is let be."""
    with contextlib.suppress(Exception):  # its connections went with their loop
        await store.aclose()

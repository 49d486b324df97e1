"""In-process keyed locks: one lock per key, for threads and for asyncio tasks.

Both classes keep one dict from each *held* key to its queue of waiters::

    key absent           nobody holds the key
    key -> None          held, nobody waits
    key -> deque         held; the waiters in arrival order (the deque may be empty)

``release`` hands the key straight to the first waiter (the entry stays, now owned by
that waiter) or deletes the entry when nobody waits. Because of the direct hand-off:

- waiters are served first come, first served, and a holder that releases and at once
  acquires again queues behind the waiters instead of overtaking them;
- a waiter exists only while someone holds the key, so an entry exists only while its
  key has a holder or a waiter, and ``len()`` is back to 0 once all work has ended.

A free key costs one dict entry and nothing else: no lock, no future, no queue. Parking
primitives (a ``threading.Lock`` or an ``asyncio.Future`` per waiter) are allocated only
when a caller has to wait, and dropped as soon as it stops waiting. A dict never shrinks
its table when entries are deleted, so the table is dropped (``clear()``) whenever the
last entry goes: a burst of 100,000 keys held at once leaves no memory behind once no
key is held (while one stays held, the table keeps its size). That
costs nothing measurable for ``str`` keys (CPython recycles small tables).

The context managers returned by ``kl(key)`` / ``akl(key)`` repeat a few lines of
``acquire`` and ``release`` (the thread one: both fast paths; the asyncio one: all of
``acquire``) instead of calling them: every call saved there shows in
``benchmarks/bench_local.py``. Tests run every behaviour through both the context
managers and ``acquire``/``release``, so the copies cannot drift unnoticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Hashable, Iterator
from types import TracebackType
from typing import Final, Protocol

from keymutex._errors import Locked
from keymutex._validate import check_timeout

__all__ = ["AsyncKeyedLock", "KeyedLock"]

# How often a thread yields the GIL to the holder of a KeyedLock's guard before it
# blocks (see _take_guard).
_GUARD_SPINS = 100


class _Free(enum.Enum):
    FREE = enum.auto()


# What ``entries.get(key, _FREE)`` returns for a key that nobody holds (``None`` means
# "held, nobody waits", so it cannot be the default).
_FREE: Final = _Free.FREE


def _check_hashable(key: object) -> None:
    """Raise a ``TypeError`` that names the problem if ``key`` cannot be a dict key.

    Called only after the dict raised ``TypeError``; returns if the key is hashable
    (its ``__eq__`` raised instead), and the caller re-raises the original error.
    """
    try:
        hash(key)
    except TypeError as exc:
        raise TypeError(
            f"key must be hashable (usable as a dict key), not {type(key).__name__}"
        ) from exc


def _not_held(key: object) -> RuntimeError:
    return RuntimeError(f"cannot release {key!r}: it is not held")


def _timed_out(key: Hashable, timeout: float) -> Locked:
    if timeout == 0:
        message = f"{key!r} is locked (in-process); timeout=0 tried once"
    else:
        message = f"{key!r} is locked (in-process) after waiting {timeout:g} s"
    # Locked.key is annotated ``str`` for store keys; in-process keys are any hashable
    # and are only stored as ``.key``.
    return Locked(key, None, message)


class _Guard(Protocol):
    """A KeyedLock's guard: a ``threading.RLock`` (typeshed lacks ``_recursion_count``,
    which ``_thread.RLock`` has had since Python 3.11)."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...
    def release(self) -> None: ...
    def _recursion_count(self) -> int: ...


def _reentered() -> RuntimeError:
    return RuntimeError(
        "a KeyedLock was called from a signal handler while the thread it interrupted"
        " was inside the same KeyedLock: refused (it would have corrupted the table)"
    )


def _take_guard(guard: _Guard) -> None:
    """Take a ``KeyedLock``'s guard after a first non-blocking try failed.

    The guarded sections never block (unless a key's ``__hash__`` or ``__eq__`` does), so
    a guard that is taken belongs to a thread that lost the GIL inside one. Blocking in
    the kernel here would have that thread wait for the GIL and every later one queue
    behind it: a convoy that cuts throughput by up to ten times
    (``benchmarks/bench_local.py``, the ref-counted dict). Yielding the GIL lets the
    holder finish its few operations; if that does not happen soon (a free-threaded
    build, a holder stopped in a debugger), we block after all.
    """
    for _ in range(_GUARD_SPINS):
        time.sleep(0)  # releases the GIL, if only for an instant
        if guard.acquire(False):
            return
    guard.acquire()


@contextlib.contextmanager
def _guarded(guard: _Guard) -> Iterator[None]:
    """``with _guarded(guard):`` for the cold paths; the hot paths spell it out (cheaper).

    The guard is an RLock for one reason: it knows its owner. Each guarded section
    takes it *inside* its ``try`` and gives it back in ``finally`` only if this thread
    has it (``release`` refuses otherwise). Found by review: taken before the ``try``,
    an exception that a signal handler raised just after ``acquire()`` returned (Python
    runs handlers there: KeyboardInterrupt, a SIGTERM handler's SystemExit) left it
    taken for good, and every later call on every key of that KeyedLock hung,
    ``timeout=0`` included. (``with guard:`` is safe too, but cost 10-20 % of the
    thread benchmark.) Being reentrant, it would let a signal handler that calls into
    the KeyedLock it interrupted change the table in the middle of a section (two
    holders of one key): that is refused (``_reentered``), where a plain lock hung.
    """
    try:
        if not guard.acquire(False):
            _take_guard(guard)
        if guard._recursion_count() > 1:
            raise _reentered()
        yield
    finally:
        with contextlib.suppress(RuntimeError):  # never taken: interrupted before
            guard.release()


# Every KeyedLock, for the fork hooks below (registered under _KEYED_LOCKS_MUTEX).
_KEYED_LOCKS: weakref.WeakSet[KeyedLock] = weakref.WeakSet()
_KEYED_LOCKS_MUTEX = threading.Lock()
_HELD_OVER_FORK: list[threading.Lock | _Guard] = []


def _before_fork() -> None:
    """Take every KeyedLock's guard, so that no fork copies one taken by a thread that
    the child will not have. Found by review: in children forked while other threads
    used a KeyedLock, even ``acquire(key, timeout=0)`` on a key nobody held hung (31
    in 60). Each guard is held only for a few dict operations, never while waiting."""
    _KEYED_LOCKS_MUTEX.acquire()
    _HELD_OVER_FORK.append(_KEYED_LOCKS_MUTEX)
    for lock in list(_KEYED_LOCKS):
        lock._guard.acquire()
        _HELD_OVER_FORK.append(lock._guard)


def _after_fork() -> None:
    while _HELD_OVER_FORK:
        _HELD_OVER_FORK.pop().release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)


class KeyedLock:
    """A lock per key for threads: ``with kl(key):`` holds ``key``; other keys stay free.

    Keys are any hashable value. Guaranteed:

    - at most one holder per key; waiters on a key are served first come, first served,
      and a thread that releases and re-acquires queues behind the existing waiters;
    - ``timeout=None`` waits as long as it takes, ``0`` tries once, ``t > 0`` waits up to
      about ``t`` seconds; a key handed over just as the timeout ends is kept (acquired);
    - an entry exists only while its key has a holder or a waiter: ``len(kl)`` is 0
      again after all work ends, whatever exceptions or timeouts happened.

    Not guaranteed:

    - reentrancy: a thread that acquires a key it already holds waits for itself (for
      ever with ``timeout=None``); pass a ``timeout`` to fail with ``Locked`` instead;
    - ownership: like ``threading.Lock``, any thread may release a held key, not only
      the one that acquired it;
    - anything across processes: that is what ``keymutex.Locks`` is for. A child
      forked while other threads hold or wait for keys sees those keys held (by threads
      it does not have) for good; its own use of other keys works.

    ``KeyboardInterrupt`` and other exceptions raised while waiting leave no trace: a key
    handed over at that moment is passed on to the next waiter. One raised (by a signal
    handler) as ``release`` or the ``with`` block's exit begins can leave the key held,
    as with any lock written in Python; never the whole table. First come, first served
    has a price on a hot key: every hand-off wakes a parked thread, where
    ``threading.Lock`` lets the releasing thread take the lock again at once (more
    acquires per second, but a waiter can starve).
    """

    __slots__ = ("__weakref__", "_entries", "_guard")

    def __init__(self) -> None:
        # One guard for the whole table: held only for a few dict and deque operations,
        # never while anyone waits, so it is cheaper than a lock object per key. A
        # thread finding it taken yields to its holder first (see _take_guard).
        self._guard: _Guard = threading.RLock()  # type: ignore[assignment]
        self._entries: dict[Hashable, deque[threading.Lock] | None] = {}
        with _KEYED_LOCKS_MUTEX:
            _KEYED_LOCKS.add(self)

    def __call__(self, key: Hashable, timeout: float | None = None) -> _Held:
        """A context manager that holds ``key``; entering raises ``Locked`` after ``timeout``.

        The timeout is checked here, the key when entering. The same object may be
        entered again after it exits; it never holds more than the one key.
        """
        if timeout is not None:
            timeout = check_timeout(timeout)
        return _Held(self, key, timeout)

    def acquire(self, key: Hashable, timeout: float | None = None) -> bool:
        """Hold ``key``: ``True`` once held, ``False`` if ``timeout`` ran out first.

        ``None`` waits as long as it takes, ``0`` tries once without waiting, ``t > 0``
        waits up to about ``t`` seconds. Raises ``TypeError`` for an unhashable key and
        ``TypeError``/``ValueError`` for a bad timeout. Not reentrant (see the class).
        """
        if timeout is not None:
            timeout = check_timeout(timeout)
        guard = self._guard
        try:
            if not guard.acquire(False):
                _take_guard(guard)
            if guard._recursion_count() > 1:
                raise _reentered()
            entries = self._entries
            try:
                waiters = entries.get(key, _FREE)
            except TypeError:
                _check_hashable(key)
                raise
            if waiters is _FREE:
                entries[key] = None
                return True
            if timeout == 0:
                return False
            if waiters is None:
                waiters = entries[key] = deque()
            # Our parking spot: a lock born held, released by whoever hands us the key.
            parker = threading.Lock()
            parker.acquire()
            waiters.append(parker)
        finally:
            try:  # noqa: SIM105 - contextlib.suppress costs a call on the hot path
                guard.release()
            except RuntimeError:  # never taken: interrupted before (see _guarded)
                pass
        return self._park(key, waiters, parker, timeout)

    def _park(
        self,
        key: Hashable,
        waiters: deque[threading.Lock],
        parker: threading.Lock,
        timeout: float | None,
    ) -> bool:
        # The parker leaves ``waiters`` in exactly two ways, both under the guard: popped
        # by release (the key is now ours) or removed here (we stopped waiting). So once
        # we hold the guard, membership tells which one happened.
        try:
            if timeout is None:
                granted = parker.acquire()
            else:
                granted = parker.acquire(timeout=min(timeout, threading.TIMEOUT_MAX))
        except BaseException:  # KeyboardInterrupt, or anything a signal handler raises
            if self._withdraw(waiters, parker):
                self.release(key)  # handed to us meanwhile: pass it on
            raise
        return granted or self._withdraw(waiters, parker)

    def _withdraw(self, waiters: deque[threading.Lock], parker: threading.Lock) -> bool:
        """Stop waiting; ``True`` if the key was handed to us first (we hold it now)."""
        with _guarded(self._guard):
            try:
                waiters.remove(parker)
            except ValueError:  # popped by release: the key is ours
                return True
        return False

    def release(self, key: Hashable) -> None:
        """Let go of ``key``; the first waiter, if any, holds it at once.

        Raises ``RuntimeError`` if ``key`` is not held. Any thread may release.
        """
        guard = self._guard
        try:
            if not guard.acquire(False):
                _take_guard(guard)
            if guard._recursion_count() > 1:
                raise _reentered()
            entries = self._entries
            try:
                waiters = entries.get(key, _FREE)
            except TypeError:
                _check_hashable(key)
                raise
            if waiters is _FREE:
                raise _not_held(key)
            if waiters:
                # Direct hand-off: the entry stays and the first waiter owns the key.
                waiters.popleft().release()
            else:
                del entries[key]
                if not entries:
                    entries.clear()  # drop the table too (see the module docstring)
        finally:
            try:  # noqa: SIM105 - contextlib.suppress costs a call on the hot path
                guard.release()
            except RuntimeError:  # never taken: interrupted before (see _guarded)
                pass

    def locked(self, key: Hashable) -> bool:
        """Whether ``key`` is held right now (by anyone); stale as soon as it returns."""
        with _guarded(self._guard):
            try:
                return key in self._entries
            except TypeError:
                _check_hashable(key)
                raise

    def _waiting(self, key: Hashable) -> int:
        """How many callers wait for ``key`` (for tests and debugging)."""
        with _guarded(self._guard):
            return len(self._entries.get(key) or ())

    def __len__(self) -> int:
        """The number of keys that have a holder or a waiter."""
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} keys={len(self._entries)}>"


class _Held:
    """``with kl(key, timeout):`` — acquire on enter (or raise ``Locked``), release on exit."""

    __slots__ = ("_key", "_lock", "_timeout")

    def __init__(self, lock: KeyedLock, key: Hashable, timeout: float | None) -> None:
        self._lock = lock
        self._key = key
        self._timeout = timeout

    def __enter__(self) -> None:
        # KeyedLock.acquire's fast path (the key is free), repeated here to save a call
        # per ``with`` (see the module docstring).
        lock = self._lock
        key = self._key
        guard = lock._guard
        try:
            if not guard.acquire(False):
                _take_guard(guard)
            if guard._recursion_count() > 1:
                raise _reentered()
            entries = lock._entries
            try:
                waiters = entries.get(key, _FREE)
            except TypeError:
                _check_hashable(key)
                raise
            if waiters is _FREE:
                entries[key] = None
                return
        finally:
            try:  # noqa: SIM105 - contextlib.suppress costs a call on the hot path
                guard.release()
            except RuntimeError:  # never taken: interrupted before (see _guarded)
                pass
        if not lock.acquire(key, self._timeout):
            assert self._timeout is not None  # only a timeout can refuse
            raise _timed_out(key, self._timeout)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # KeyedLock.release's fast path (nobody waits) inlined.
        lock = self._lock
        key = self._key
        guard = lock._guard
        try:
            if not guard.acquire(False):
                _take_guard(guard)
            if guard._recursion_count() > 1:
                raise _reentered()
            entries = lock._entries
            if entries.get(key, _FREE) is None:
                del entries[key]
                if not entries:
                    entries.clear()  # drop the table too (see the module docstring)
                return
        finally:
            try:  # noqa: SIM105 - contextlib.suppress costs a call on the hot path
                guard.release()
            except RuntimeError:  # never taken: interrupted before (see _guarded)
                pass
        lock.release(key)


def _expire(waiter: asyncio.Future[bool], waiters: deque[asyncio.Future[bool]]) -> None:
    # Timer callback. A waiter that is not done is still in ``waiters`` (release pops
    # only the waiter it completes), and the event loop runs one callback at a time.
    if not waiter.done():
        waiter.set_result(False)
        waiters.remove(waiter)


class AsyncKeyedLock:
    """A lock per key for asyncio tasks: ``async with akl(key):`` holds ``key``.

    Keys are any hashable value. Guaranteed:

    - at most one holder per key; waiters on a key are served first come, first served,
      and a task that releases and re-acquires queues behind the existing waiters;
    - ``timeout=None`` waits as long as it takes, ``0`` tries once, ``t > 0`` waits up to
      about ``t`` seconds;
    - an entry exists only while its key has a holder or a waiter: ``len(akl)`` is 0
      again after all work ends. Cancelling a task that waits leaves no trace — even
      when the key was handed to it just as it was cancelled, it passes the key on —
      and cancelling a task inside ``async with`` releases the key on the way out.

    Not guaranteed:

    - reentrancy: a task that acquires a key it already holds waits for itself; pass a
      ``timeout`` to fail with ``Locked`` instead;
    - ownership: like ``asyncio.Lock``, any task may release a held key;
    - thread safety: use one instance from one event loop at a time, like ``asyncio.Lock``
      (for threads, use ``KeyedLock``).

    Acquiring a free key does not yield to the event loop.
    """

    __slots__ = ("__weakref__", "_entries")

    def __init__(self) -> None:
        self._entries: dict[Hashable, deque[asyncio.Future[bool]] | None] = {}

    def __call__(self, key: Hashable, timeout: float | None = None) -> _AsyncHeld:
        """An async context manager that holds ``key``; raises ``Locked`` after ``timeout``.

        The timeout is checked here, the key when entering. The same object may be
        entered again after it exits; it never holds more than the one key.
        """
        if timeout is not None:
            timeout = check_timeout(timeout)
        return _AsyncHeld(self, key, timeout)

    async def acquire(self, key: Hashable, timeout: float | None = None) -> bool:
        """Hold ``key``: ``True`` once held, ``False`` if ``timeout`` ran out first.

        ``None`` waits as long as it takes, ``0`` tries once without waiting, ``t > 0``
        waits up to about ``t`` seconds. Raises ``TypeError`` for an unhashable key and
        ``TypeError``/``ValueError`` for a bad timeout. Not reentrant (see the class).
        If the task is cancelled while it waits, it neither holds nor waits afterwards.
        """
        if timeout is not None:
            timeout = check_timeout(timeout)
        entries = self._entries
        try:
            waiters = entries.get(key, _FREE)
        except TypeError:
            _check_hashable(key)
            raise
        if waiters is _FREE:
            entries[key] = None
            return True
        if timeout == 0:
            return False
        waiter = self._enqueue(key, waiters, timeout)
        try:
            return await waiter
        except BaseException:
            self._abandon(key, waiter)
            raise

    def _enqueue(
        self,
        key: Hashable,
        waiters: deque[asyncio.Future[bool]] | None,
        timeout: float | None,
    ) -> asyncio.Future[bool]:
        """Queue a waiter for a held key: a future that ``release`` completes with ``True``.

        With a timeout, a timer completes it with ``False`` first; the timer is cancelled
        whenever the future completes, however that happens.
        """
        loop = asyncio.get_running_loop()
        if waiters is None:
            waiters = self._entries[key] = deque()
        waiter: asyncio.Future[bool] = loop.create_future()
        waiters.append(waiter)
        if timeout is not None:
            timer = loop.call_later(timeout, _expire, waiter, waiters)
            waiter.add_done_callback(lambda _: timer.cancel())
        return waiter

    def _abandon(self, key: Hashable, waiter: asyncio.Future[bool]) -> None:
        """Stop waiting after the waiting task was cancelled (or its coroutine closed).

        If the key was handed to the waiter just before, pass it on: we hold it.
        """
        if waiter.done() and not waiter.cancelled() and waiter.result():
            self.release(key)
            return
        # Still queued unless a release popped it (cancelled) or the timer removed it.
        waiters = self._entries.get(key)
        if waiters:
            with contextlib.suppress(ValueError):
                waiters.remove(waiter)
        if not waiter.done() and not waiter.get_loop().is_closed():
            # The coroutine was closed or thrown into, not cancelled (a closed loop's
            # waiter is left as it is: cancelling would call into that loop).
            waiter.cancel()  # also cancels the timer (see _enqueue)

    def release(self, key: Hashable) -> None:
        """Let go of ``key``; the first waiter, if any, holds it at once.

        Raises ``RuntimeError`` if ``key`` is not held. Any task may release; call it
        from the event loop's thread.
        """
        _release(self._entries, key)

    def locked(self, key: Hashable) -> bool:
        """Whether ``key`` is held right now (by anyone)."""
        try:
            return key in self._entries
        except TypeError:
            _check_hashable(key)
            raise

    def _waiting(self, key: Hashable) -> int:
        """How many waiters are queued for ``key`` (for tests and debugging).

        A cancelled waiter stays queued until its task has run (or a release skipped it).
        """
        return len(self._entries.get(key) or ())

    def __len__(self) -> int:
        """The number of keys that have a holder or a waiter."""
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} keys={len(self._entries)}>"


class _AsyncHeld:
    """``async with akl(key, timeout):`` — acquire on enter (or raise ``Locked``), release on exit."""

    __slots__ = ("_key", "_lock", "_timeout")

    def __init__(self, lock: AsyncKeyedLock, key: Hashable, timeout: float | None) -> None:
        self._lock = lock
        self._key = key
        self._timeout = timeout

    async def __aenter__(self) -> None:
        # AsyncKeyedLock.acquire, repeated here to save a coroutine per entry (see the
        # module docstring).
        key = self._key
        entries = self._lock._entries
        try:
            waiters = entries.get(key, _FREE)
        except TypeError:
            _check_hashable(key)
            raise
        if waiters is _FREE:
            entries[key] = None
            return
        timeout = self._timeout
        if timeout == 0:
            raise _timed_out(key, timeout)
        lock = self._lock
        waiter = lock._enqueue(key, waiters, timeout)
        try:
            granted = await waiter
        except BaseException:
            lock._abandon(key, waiter)
            raise
        if not granted:
            assert timeout is not None  # only a timeout can refuse
            raise _timed_out(key, timeout)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Also on CancelledError: a task cancelled while it holds the key releases it here.
        _release(self._lock._entries, self._key)


def _release(entries: dict[Hashable, deque[asyncio.Future[bool]] | None], key: Hashable) -> None:
    """``AsyncKeyedLock.release``; ``__aexit__`` calls it directly (one call less)."""
    try:
        waiters = entries.get(key, _FREE)
    except TypeError:
        _check_hashable(key)
        raise
    if waiters is _FREE:
        raise _not_held(key)
    while waiters:
        waiter = waiters.popleft()
        # Skip waiters cancelled since they queued (their task removes them too, but
        # may not have run yet).
        if not waiter.done():
            if waiter.get_loop().is_closed():
                # Its event loop was closed with the waiting task in it: that task will
                # never run. Found by review: the release raised "Event loop is closed"
                # and the key stayed held. Skipped, as a cancelled one.
                continue
            waiter.set_result(True)  # direct hand-off: the entry stays
            return
    del entries[key]
    if not entries:
        entries.clear()  # drop the table too (see the module docstring)

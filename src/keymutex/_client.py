"""``Locks`` and ``AsyncLocks``: waiting, renewal and context managers, written once.

The stores give non-blocking atomic steps (``_store``). Everything that decides —
validation, deadlines, backoff, renewal schedules, turning replies into leases and
errors — lives in plain code shared by both twins (``_Config``, ``_wait``,
``_RenewalPlan``); the two classes below only do the I/O, one with threads and one
with asyncio.

Waiting: on a store that notifies, every attempt carries a waiter, so a refusal
queues it in the same atomic step and a release that follows is sure to wake it; it
parks until notified, until the holder's expiry, or a safety recheck. On a store that
cannot notify it parks for a jittered backoff step (never past the holder's expiry).
Within one ``Locks``, callers waiting for the same key queue locally (a
``KeyedLock`` gate), so only one of them contends at the store.

Fork: the child gets a fresh gate and renewer (``_reset_after_fork``); the parent's
waiters and leases stay the parent's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import inspect
import itertools
import logging
import math
import os
import queue
import secrets
import socket
import string
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn, ParamSpec, Protocol, TypeVar

from keymutex import _clock
from keymutex._errors import Locked, LockError, LockLost, StoreError
from keymutex._giveback import AsyncGiveBacks, GiveBacks
from keymutex._lease import AsyncLease, Holder, Lease, LeaseState, Outcome
from keymutex._local import AsyncKeyedLock, KeyedLock
from keymutex._store import (
    AsyncStore,
    AsyncWaiter,
    NotSent,
    PartialRenewal,
    RenewRequest,
    Store,
    StoreOfTheLoop,
    Waiter,
    cancel_left,
    max_ttl_of,
    stop_task,
)
from keymutex._urls import driver_for, redacted, scheme_of
from keymutex._validate import (
    check_bool,
    check_callback,
    check_info,
    check_key,
    check_prefix,
    check_text,
    check_timeout,
    check_token,
    check_ttl,
)
from keymutex._wait import Backoff, Deadline, park_time

__all__ = ["AsyncLocks", "Locks"]

_LOG = logging.getLogger("keymutex")
_HOSTNAME = socket.gethostname()
_TOKEN_BYTES = 18  # 144 bits, 24 URL-safe characters
# How long close() waits for on_lost callbacks under way (aclose(): for the coroutines,
# then again for them to end once cancelled): long enough for a callback's few store
# calls, bounded against one that hangs.
CALLBACK_GRACE = 5.0
# At most this many threads run on_lost callbacks of one Locks at once; one idle this
# many seconds ends (see _CallbackThreads).
MAX_CALLBACK_THREADS = 8
CALLBACK_THREAD_IDLE = 30.0
# The longest a renewer with leases sleeps between looks at the clock. Its sleeps are
# timed by CLOCK_MONOTONIC (threading and asyncio), which stops while the machine is
# suspended; the leases' deadlines are on CLOCK_BOOTTIME (_clock), which does not. A
# lease whose TTL ran out while a laptop slept is so found lost, and its on_lost
# called, within this of waking, not when its next renewal (a third of its TTL) was due.
SUSPEND_LOOK = 1.0
# A renewal call still unanswered after this long is slow: the renewer stops waiting
# for it when other leases fall due (and after a third of its batch's shortest TTL in
# any case), and renews them on another thread. Well above a healthy call (a few ms),
# so that leases falling due one after another are still renewed in batches.
SLOW_RENEWAL = 0.25
MAX_OWNER_BYTES = 256
MAX_NAMESPACE_BYTES = 256

P = ParamSpec("P")
R = TypeVar("R")
L = TypeVar("L", bound=LeaseState)
OnLost = Callable[[Any], object]


_CLIENTS: weakref.WeakSet[Locks | AsyncLocks] = weakref.WeakSet()


def _reset_after_fork() -> None:
    """A forked child keeps none of the parent's local waiters nor renewals.

    Its threads and tasks did not come along, and the parent's leases are the
    parent's to renew; so are the grants to give back. The store calls counted are
    those of the parent's threads, and the count's mutex may have been taken by one
    of them at the fork: the child counts afresh.
    """
    for client in list(_CLIENTS):
        client._forked()


os.register_at_fork(after_in_child=_reset_after_fork)


def _new_token() -> str:
    return secrets.token_urlsafe(_TOKEN_BYTES)


@dataclass(frozen=True, slots=True)
class _Request:
    """One validated acquire."""

    key: str
    ttl: float
    timeout: float | None
    renew: bool
    info: dict[str, Any] | None
    steal: bool
    on_lost: OnLost | None
    # Set only by the lock server, which acquires for its HTTP callers: their owner,
    # and the token a caller chose (the http:// store's own); else this client's.
    owner: str | None = None
    token: str | None = None


class _Config:
    """The validated settings of a ``Locks`` / ``AsyncLocks`` and its argument checks."""

    def __init__(
        self, url: object, namespace: object, ttl: object, owner: object, *, asynchronous: bool
    ) -> None:
        self.driver = driver_for(url)
        assert isinstance(url, str)
        # The scheme in lower case, as the drivers' clients expect it (redis-py and
        # pymongo refuse REDIS:// and MONGODB://): schemes are case-insensitive (RFC 3986).
        scheme = scheme_of(url)
        self.url = scheme + url[len(scheme) :]
        self.asynchronous = asynchronous
        self.namespace = check_text(
            namespace, "namespace", allow_empty=True, max_bytes=MAX_NAMESPACE_BYTES
        )
        self.max_ttl = max_ttl_of(self.driver)
        self.ttl = self.check_ttl(ttl)
        self.owner = (
            None
            if owner is None
            else check_text(owner, "owner", allow_empty=False, max_bytes=MAX_OWNER_BYTES)
        )

    def shown(self, kind: str, *, closed: bool) -> str:
        """The client's ``repr``: its store (password hidden) and namespace."""
        state = ", closed" if closed else ""
        return f"{kind}({redacted(self.url)!r}, namespace={self.namespace!r}{state})"

    def check_ttl(self, ttl: object) -> float:
        """A ``ttl`` argument, within the store's range."""
        return check_ttl(ttl, at_most=self.max_ttl)

    def owner_now(self) -> str:
        # The pid is read at each acquire: a forked child is a different owner.
        return self.owner if self.owner is not None else f"{_HOSTNAME}:{os.getpid()}"

    def request(
        self,
        key: object,
        ttl: object,
        timeout: object,
        renew: object,
        info: object,
        steal: object,
        on_lost: OnLost | None,
    ) -> _Request:
        return _Request(
            key=check_key(key),
            ttl=self.ttl if ttl is None else self.check_ttl(ttl),
            timeout=check_timeout(timeout),
            renew=check_bool(renew, "renew"),
            info=check_info(info),
            steal=check_bool(steal, "steal"),
            on_lost=check_callback(on_lost, "on_lost", awaited=self.asynchronous),
        )

    def renew_args(self, key: object, token: object, ttl: object) -> RenewRequest:
        return RenewRequest(
            check_key(key), check_token(token), self.ttl if ttl is None else self.check_ttl(ttl)
        )


def _pacing(store: Store | AsyncStore) -> tuple[bool, Backoff | None]:
    """How a refused waiter of ``store`` parks: whether at the store, and the backoff of
    a store that cannot wake its waiters (``None`` for one that can).

    Read again once the waiter is made: a store may learn what it can do at its first
    step. Found by review: a MongoDB store learns at its first call that the server has
    change streams, and the first wait of each client still polled on backoff steps.
    """
    capabilities = store.capabilities
    paced = capabilities.notifies or capabilities.paces_waits
    return capabilities.waits_at_store, None if paced else Backoff()


# _looked_again_at_once: a waiter made only after a refusal, of a store that turns out
# to wake its waiters (it learnt so at that first step), may have missed a release
# between the refusal and its joining: it tries again at once rather than park until
# the next recheck (found by review: a second, as the first wait of a MongoDB client).


def _key_template(template: object, function: Callable[..., Any]) -> inspect.Signature:
    """Check that ``template`` only names parameters of ``function``; its signature."""
    if not isinstance(template, str):
        raise TypeError(
            f"key must be a str template such as 'order:{{user_id}}', not {template!r}"
        )
    signature = inspect.signature(function)
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError as exc:  # "Single '{' encountered in format string", …
        raise ValueError(
            f"key template {template!r} is malformed: {exc} (write {{{{ and }}}} for literal"
            " braces)"
        ) from None
    if not template:
        raise ValueError("key template must not be empty; e.g. 'order:{user_id}'")
    nested = [
        inner
        for _, _, spec, _ in fields
        if spec and "{" in spec
        for inner in string.Formatter().parse(spec)
    ]
    for _, field, _, conversion in [*fields, *nested]:
        if field is None:
            continue
        if conversion not in (None, "r", "s", "a"):
            raise ValueError(
                f"key template {template!r} is malformed: unknown conversion !{conversion}"
                " (use !s, !r or !a)"
            )
        name = field.split(".", 1)[0].split("[", 1)[0]
        if name not in signature.parameters:
            raise ValueError(
                f"key template {template!r} names {name!r}, which is not a parameter of"
                f" {function.__qualname__}{signature}"
            )
    return signature


def _refuse_generator(function: Callable[..., Any], *, asynchronous: bool) -> None:
    """A generator runs after the call that makes it returns: no lock would cover it."""
    if (inspect.isasyncgenfunction if asynchronous else inspect.isgeneratorfunction)(function):
        decorator, block = ("AsyncLocks", "async with") if asynchronous else ("Locks", "with")
        raise TypeError(
            f"{decorator}.locked cannot decorate generator function {function.__qualname__}:"
            " the lock would be held only while the generator is created, not while it"
            f" runs; take it inside the generator ({block} locks.lock(…))"
        )


def _format_key(
    template: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    try:
        return template.format(**bound.arguments)
    except (LookupError, AttributeError, ValueError, TypeError) as exc:
        # An index, attribute or format spec that the call's arguments do not have:
        # found by review, a bare KeyError 'z' (or IndexError, …) that named nothing.
        raise ValueError(
            f"key template {template!r} cannot be filled from the call's arguments"
            f" ({', '.join(bound.arguments)}): {type(exc).__name__}: {exc}"
        ) from exc


def _returns_coroutines(function: Callable[..., Any]) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    call = (
        None if inspect.isroutine(function) else inspect.getattr_static(function, "__call__", None)
    )
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


def _renewal_due(lease: LeaseState, since: float) -> float:
    """When ``lease``, granted or renewed by a request sent at ``since``, is renewed next:
    a third of its TTL later, or of what the store granted if that was less. ZooKeeper
    grants no more than its session timeout: a lease with a TTL over three times that
    was renewed too late, and lost on a healthy cluster (found by review)."""
    return since + min(lease._ttl, max(0.0, lease._deadline - since)) / 3


class _RenewalPlan:
    """When each renewing lease is due, and what a renewal's reply means (no I/O).

    A lease enters the heaps only when the renewer looks at the plan (``_take_in``):
    most leases of ``with lock():`` are released long before their first renewal, and
    then cost a dict entry, not two heap entries (each holding the lease) that stay
    until their time has come.

    Each lease has at most one live entry in each heap, the one whose order number
    ``_due`` / ``_watched`` names; an entry left behind by a reschedule (a renewal by
    the lease's owner) or by ``discard`` is stale and skipped when reached.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, LeaseState]] = []
        # Each lease's local deadline as last seen: a live entry may be out of date (the
        # lease was renewed since), and is then pushed again with the new one when reached.
        self._deadlines: list[tuple[float, int, LeaseState]] = []
        self._order = itertools.count()
        self._active: set[int] = set()
        # Added since the renewer last looked: id -> (first renewal due, lease).
        self._fresh: dict[int, tuple[float, LeaseState]] = {}
        self._due: dict[int, int] = {}  # id -> order of the lease's live entry in _heap
        # id -> (when, order) of the lease's live entry in _deadlines.
        self._watched: dict[int, tuple[float, int]] = {}

    def add(self, lease: LeaseState, now: float) -> float:
        """Plan ``lease``'s renewals; returns when the renewer must first look at it.

        That is when its first renewal is due, or its deadline if that comes sooner (a
        TTL of a few ms, cut short by the store's clock grain).
        """
        due = _renewal_due(lease, now)
        self._active.add(id(lease))
        self._fresh[id(lease)] = (due, lease)
        return min(due, lease._deadline)

    def renewed(self, lease: LeaseState, sent_at: float) -> float | None:
        """``lease`` was renewed outside the renewer (``lease.renew``, a renewal by token)
        by a request sent at ``sent_at``: its next renewal is due a third of its TTL, maybe
        a new one, after that, and its deadline may have come nearer.

        Returns when the renewer must look at it next; ``None`` when it is not planned.
        """
        if not self.active(lease):
            return None
        due = _renewal_due(lease, sent_at)
        if id(lease) in self._fresh:
            self._fresh[id(lease)] = (due, lease)
        else:
            self._schedule(lease, due)
            self._watch(lease)
        return min(due, lease._deadline)

    def discard(self, lease: LeaseState) -> None:
        self._active.discard(id(lease))
        self._fresh.pop(id(lease), None)
        self._due.pop(id(lease), None)
        self._watched.pop(id(lease), None)

    def active(self, lease: LeaseState) -> bool:
        return id(lease) in self._active

    def __bool__(self) -> bool:
        return bool(self._active)

    def _schedule(self, lease: LeaseState, when: float) -> None:
        """Make ``when`` the lease's next look, replacing any other."""
        order = next(self._order)
        self._due[id(lease)] = order
        heapq.heappush(self._heap, (when, order, lease))

    def _watch(self, lease: LeaseState) -> None:
        """Watch the lease's current deadline, unless a nearer one is watched already.

        A farther one is not pushed: ``overdue`` moves the entry on when it is reached.
        """
        deadline = lease._deadline
        watched = self._watched.get(id(lease))
        if watched is None or deadline < watched[0]:
            order = next(self._order)
            self._watched[id(lease)] = (deadline, order)
            heapq.heappush(self._deadlines, (deadline, order, lease))

    def _live_due(self, entry: tuple[float, int, LeaseState]) -> bool:
        return self._due.get(id(entry[2])) == entry[1]

    def _live_deadline(self, entry: tuple[float, int, LeaseState]) -> bool:
        watched = self._watched.get(id(entry[2]))
        return watched is not None and watched[1] == entry[1]

    def _take_in(self) -> None:
        """Move the leases added since the last look into the heaps."""
        fresh, self._fresh = self._fresh, {}
        for due, lease in fresh.values():
            self._schedule(lease, due)
            self._watch(lease)

    def next_due(self) -> float | None:
        if self._fresh:
            self._take_in()
        heap = self._heap
        while heap and not self._live_due(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def next_deadline(self) -> float | None:
        """When the first lease may reach its deadline (maybe earlier: then it was renewed)."""
        if self._fresh:
            self._take_in()
        heap = self._deadlines
        while heap and not self._live_deadline(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def overdue(self, now: float) -> list[LeaseState]:
        """Leases past their local deadline, now lost: those whose ``on_lost`` is due.

        However long a renewal call takes, its leases' holders learn of the loss by
        their deadline: the reply of a call still under way comes too late to count.
        """
        if self._fresh:
            self._take_in()
        lost = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if not self._live_deadline(entry):
                continue
            lease = entry[2]
            if lease._deadline > now:  # renewed since this entry was made
                del self._watched[id(lease)]
                self._watch(lease)
                continue
            self.discard(lease)
            if lease._mark_lost(None):
                lost.append(lease)
        return lost

    def take_due(self, now: float) -> list[LeaseState]:
        due = []
        while (when := self.next_due()) is not None and when <= now:
            due.append(heapq.heappop(self._heap)[2])
        return due

    def later(self, lease: LeaseState, now: float) -> None:
        """A renewal of ``lease`` is under way elsewhere: look again shortly."""
        if self.active(lease):
            self._schedule(lease, now + max(0.01, min(0.25, lease._ttl / 10)))

    def settle(self, lease: LeaseState, outcome: Outcome, sent_at: float, now: float) -> bool:
        """Apply one renewal reply (come back at ``now``); ``True`` when it showed the
        lease lost.

        A grant that comes back past the lease's deadline does not revive it: its holder
        was told it was lost then (``lost``), even if the renewer had not marked it yet
        (found in CI: a renewal left to end on its own answered after ``close()`` had
        stopped the renewer, and revived a lease the test had seen lost; it was kept
        from everyone for another TTL instead of released as renewed too late)."""
        if not self.active(lease):
            return False  # released meanwhile
        if outcome.ok and now >= lease._deadline:
            self.discard(lease)
            return lease._mark_lost(None)
        if outcome.ok:
            lease._granted(outcome, sent_at, lease._ttl)
            self._schedule(lease, _renewal_due(lease, sent_at))
            self._watch(lease)  # the store may have granted less than before
            return False
        self.discard(lease)
        return lease._mark_lost(outcome.holder)

    def settle_batch(
        self, batch: Sequence[L], outcomes: Sequence[Outcome | None], sent_at: float
    ) -> list[L]:
        """Take in a batch's renewals (``None``: not answered, its server failed); the
        leases this showed lost."""
        now = _clock.monotonic()
        return [
            x
            for x, o in zip(batch, outcomes, strict=True)
            if (self.failed(x, now) if o is None else self.settle(x, o, sent_at, now))
        ]

    def failed(self, lease: LeaseState, now: float) -> bool:
        """The store could not be reached: retry, or give up at the lease's deadline."""
        if not self.active(lease):
            return False
        deadline = lease._deadline
        if now >= deadline:
            self.discard(lease)
            return lease._mark_lost(None)
        self._schedule(lease, min(now + max(0.05, min(1.0, lease._ttl / 10)), deadline))
        return False


def _outcome_or_lost(key: str, outcome: Outcome) -> Outcome:
    if not outcome.ok:
        raise LockLost(key, outcome.holder)
    return outcome


class _Discards(Protocol):
    def discard(self, lease: LeaseState) -> None: ...


class _GivesBack(Protocol):
    def add(self, key: str, token: str, ttl: float) -> None: ...


def _finish_later(
    give_backs: _GivesBack, renewer: _Discards, lease: LeaseState | None, exc: StoreError
) -> None:
    """A release of ``lease`` failed with ``exc``: it goes on in the background.

    Its outcome is unknown (a reply lost, a store that came back a moment later), and
    nothing else would end the lease before its TTL, however short the glitch: the
    renewer has let it go. It is given back as a grant whose answer was lost is
    (``_giveback``): release by its token, until one finds it or the TTL has passed, and
    once more at close. A release checks the token in the store, so it can only end
    this lease: given back only for a lease this client granted to a token it drew
    (a token the caller named may be named again, for another lease; and the TTL of
    a lease granted elsewhere is not known here). The caller still gets the error;
    the lease counts as released (its owner asked for it), so nobody renews it
    meanwhile. Found by review: the key stayed held to its TTL after a release that
    met a half-second outage.
    """
    if lease is None or not lease._drawn:
        return
    renewer.discard(lease)
    lease._released = True
    give_backs.add(lease.key, lease.token, lease._ttl)
    exc.add_note("keymutex tries the release again in the background until it lands")


def _granted_here(leases: Mapping[str, L], key: str, token: str) -> L | None:
    """The live ``Lease`` this client granted to the token a call by key and token names."""
    lease = leases.get(token)
    if lease is None or lease.key != key or lease._pid != os.getpid():
        return None
    return None if lease._released or lease.lost else lease


def _extend(lease: LeaseState, outcome: Outcome, sent_at: float, ttl: float) -> bool:
    """Take a renewal by token into the ``Lease`` it renewed: a heartbeat keeps an edit
    session's lease object alive too. One that was lost or released meanwhile stays so
    (``False``)."""
    if lease._released or lease.lost:
        return False
    lease._granted(outcome, sent_at, ttl)
    return True


class _CallbackThreads:
    """Daemon threads that run calls, each on a free one: ``on_lost`` callbacks, and
    (another instance) the renewer's store calls.

    A callback may block (waits for its worker to wind down, renews a lease whose
    renewal is under way): another lease's loss found meanwhile is reported on another
    thread, not after it. A store call may hang on a silent server: the next batch's
    call goes on another thread, not after it. A thread is started when the calls
    waiting outnumber the idle threads, up to ``MAX_CALLBACK_THREADS`` (a thousand
    leases lost at once are not a thousand threads); one idle for
    ``CALLBACK_THREAD_IDLE`` seconds ends.
    """

    def __init__(self, name: str = "keymutex-on-lost") -> None:
        self._name = name
        self._calls: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._waiting = 0  # calls submitted that no thread has taken yet
        self._idle = 0  # threads waiting for a call

    def submit(self, call: Callable[[], object]) -> None:
        with self._lock:
            self._waiting += 1
            self._calls.put(call)
            if self._waiting > self._idle and len(self._threads) < MAX_CALLBACK_THREADS:
                thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._threads.add(thread)
                self._idle += 1
                thread.start()

    def call(self, work: Callable[[], R]) -> Future[R]:
        """Run ``work`` on a free thread: its result, or what it raised, in the future."""
        future: Future[R] = Future()

        def run() -> None:
            try:
                future.set_result(work())
            except BaseException as exc:
                future.set_exception(exc)

        self.submit(run)
        return future

    def _run(self) -> None:
        while True:
            try:
                call = self._calls.get(timeout=CALLBACK_THREAD_IDLE)
            except queue.Empty:
                with self._lock:
                    if self._waiting < self._idle:  # the others can take what comes
                        self._idle -= 1
                        self._threads.discard(threading.current_thread())
                        return
                continue
            if call is None:  # close()
                with self._lock:  # a call submitted after close() starts a thread anew
                    self._idle -= 1
                    self._threads.discard(threading.current_thread())
                return
            with self._lock:
                self._waiting -= 1
                self._idle -= 1
            try:
                call()
            finally:
                with self._lock:
                    self._idle += 1

    def close(self) -> None:
        """End the threads once the calls submitted before are done."""
        with self._lock:
            for _ in self._threads:
                self._calls.put(None)

    def join(self, timeout: float) -> None:
        """Wait for the calls submitted before ``close`` (not from one of them), at most
        ``timeout`` seconds in all."""
        ends = _clock.monotonic() + timeout
        with self._lock:
            threads = [x for x in self._threads if x is not threading.current_thread()]
        for thread in threads:
            thread.join(max(0.0, ends - _clock.monotonic()))


def _call_on_lost(lease: LeaseState) -> None:
    """Call ``on_lost`` on the callback thread: whatever it raises is logged, not raised.

    ``_notify_lost`` logs an ``Exception``; this logs the rest (``SystemExit``,
    ``KeyboardInterrupt`` raised by the callback itself), which would end the thread.
    """
    try:
        lease._notify_lost()
    except BaseException:
        _LOG.exception("on_lost callback for %r failed", lease.key)


class _StoreCalls:
    """The calls of one client under way at its store, so that ``close()`` can leave the
    store open until the last of them has ended; the last one then closes it.

    An acquire that waits may have been handed the key meanwhile (SQLite and PostgreSQL
    hand a released key to the first queued waiter): leaving the queue gives such a
    grant back, which takes the store. A release or renewal another thread sent just
    before ``close()`` must reach the store too. Closed under them, the grant or the
    lease stayed held until its TTL.
    """

    def __init__(self, client: str, close_store: Callable[[], Any]) -> None:
        self._client = client
        self._close_store = close_store  # Store.close, or AsyncStore.aclose
        self._lock = threading.Lock()
        self._count = 0
        self._closing = False

    def __enter__(self) -> None:
        """``with``: one call at the store; ``RuntimeError`` once the client is closed."""
        if not self.enter():
            raise RuntimeError(f"this {self._client} is closed")

    def __exit__(self, *exc_info: object) -> None:
        if self.leave():
            self._close_store()

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(self, *exc_info: object) -> None:
        if self.leave():
            await _to_the_end(self._close_store())

    def enter(self, *, beside: bool = False) -> bool:
        """Count a call in; ``False`` once the client is closing. ``beside``: a call made
        on behalf of one under way (which keeps the store open), counted in all the same."""
        with self._lock:
            if self._closing and not (beside and self._count > 0):
                return False
            self._count += 1
            return True

    def leave(self) -> bool:
        """Count a call out; ``True``: it was the last after ``close()``, which left the
        store for it to close."""
        with self._lock:
            self._count -= 1
            return self._closing and self._count == 0

    def close(self) -> bool:
        """``True``: the caller closes the store now (no call is under way at it, and it
        was not closed before)."""
        with self._lock:
            first, self._closing = not self._closing, True
            return first and self._count == 0


class _Renewer:
    """One thread that renews every renewing lease of a ``Locks``, in batches.

    ``on_lost`` callbacks run on threads of their own (``_callbacks``), started in the
    order the losses were found: while a batch's renewal is under way this thread holds
    its leases' ``_renewing`` locks, and a callback run here that renewed one of them
    would wait for this thread forever; one that raised ``SystemExit`` would end it.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._plan = _RenewalPlan()
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._calls = _CallbackThreads("keymutex-renewer-call")
        self._callbacks = _CallbackThreads()
        self._closed = False
        # Done at close(): a renewal call waited for is then left to end on its own.
        self._stop: Future[None] = Future()
        # When the thread looks at the plan next (-inf: it is at work and will look
        # soon). A lease due later needs no wake-up: a thread switch per lock() saved.
        self._until = -math.inf
        # How long the thread sleeps when it finds nothing to renew (see _idle_until).
        self._idle: float | None = None

    def add(self, lease: Lease) -> None:
        with self._wakeup:
            if self._closed:
                raise RuntimeError("this Locks is closed")
            first_look = self._plan.add(lease, _clock.monotonic())
            self._idle = lease._ttl / 3
            # A thread that died (an error it could not survive) is replaced: the leases
            # it left in the plan are renewed again, from now on.
            if self._thread is None or not self._thread.is_alive():
                self._until = -math.inf
                self._thread = threading.Thread(
                    target=self._run, name="keymutex-renewer", daemon=True
                )
                self._thread.start()
            if first_look < self._until:
                self._wakeup.notify()

    def renewed(self, lease: Lease, sent_at: float) -> None:
        """``lease`` was renewed by its owner (request sent at ``sent_at``): reschedule it.

        A renewal with a shorter TTL brings its next renewal and its deadline nearer,
        maybe before the thread's next look: it is woken then.
        """
        with self._wakeup:
            look = self._plan.renewed(lease, sent_at)
            if look is not None and look < self._until:
                self._wakeup.notify()

    def discard(self, lease: LeaseState) -> None:
        with self._wakeup:
            self._plan.discard(lease)

    def _next_batch(self) -> tuple[list[LeaseState], list[LeaseState]] | None:
        """The leases due for renewal, and those found lost; ``None`` once closed."""
        with self._wakeup:
            while not self._closed:
                now = _clock.monotonic()
                lost = self._plan.overdue(now)
                due = self._plan.take_due(now)
                if due or lost:
                    return due, lost
                when = _next_look(self._plan, now)
                if when is None:
                    when = self._idle_until(now)
                self._until = math.inf if when is None else when
                self._wakeup.wait(None if when is None else when - now)
                self._until = -math.inf
            return None

    def _idle_until(self, now: float) -> float | None:
        """When to look again with nothing to renew; ``None``: once notified.

        Leases that come and go (``with lock():`` in a loop) would each find the thread
        asleep for good and wake it, a thread switch per lease. So while leases keep
        coming, the thread sleeps as long as the last one would have waited for its
        first renewal: the next one, with the same TTL, is due no earlier and needs no
        wake-up. A quiet spell of that length without a new lease ends this.
        """
        idle, self._idle = self._idle, None
        return None if idle is None else now + idle

    def _notify(self, leases: Sequence[LeaseState]) -> None:
        """Hand the ``on_lost`` calls of ``leases`` to the callback thread."""
        for lease in leases:
            if lease._on_lost is not None:
                self._callbacks.submit(functools.partial(_call_on_lost, lease))

    def _run(self) -> None:
        while (work := self._next_batch()) is not None:
            due, overdue = work
            self._notify(overdue)
            # A lease its owner is renewing right now is looked at again shortly.
            batch: list[Lease] = []
            for lease in due:
                assert isinstance(lease, Lease)
                if lease._renewing.acquire(blocking=False):
                    batch.append(lease)
                else:
                    with self._wakeup:
                        self._plan.later(lease, _clock.monotonic())
            if batch:
                self._renew(batch)  # frees the batch's leases, now or when the call ends

    def _renew(self, batch: list[Lease]) -> None:
        """Renew ``batch`` in one store call, and take in its outcome (``_settle``).

        The call is waited for until another lease falls due (once it has run
        ``SLOW_RENEWAL``), and a third of the batch's shortest TTL at most, or until
        ``close()``. One that
        takes longer is left to end on its own thread and settled then, while this
        thread goes on with the other leases.
        Found by review: a Redis Cluster master that stopped answering (``kill -STOP``,
        a hung host) held its renewal call for the socket timeout (5 s); the renewer
        made one call at a time, so every lease due meanwhile, on masters that answered,
        waited too, and those of a TTL under ~5 s were lost.
        """
        try:
            sent_at = _clock.monotonic()
            requests = [RenewRequest(lease.key, lease.token, lease._ttl) for lease in batch]
            call = self._calls.call(functools.partial(self._store.renew_many, requests))
            give_up = sent_at + min(lease._ttl for lease in batch) / 3
            while True:  # while the call runs, holders past their deadline learn it
                with self._wakeup:
                    leave_at = _leave_at(self._plan, sent_at, give_up)
                    until = min(leave_at, self._plan.next_deadline() or math.inf)
                wait = max(0.0, until - _clock.monotonic())
                waited: list[Future[Any]] = [call, self._stop]
                done, _ = futures.wait(waited, wait, futures.FIRST_COMPLETED)
                if call in done:
                    break
                now = _clock.monotonic()
                with self._wakeup:
                    overdue = self._plan.overdue(now)
                self._notify(overdue)
                # Closed: not waited for here until a third of the TTL (found by review:
                # close() took that long with a hung store), but within close()'s grace.
                if now >= leave_at or self._stop.done():
                    # Left to end on its own: the other leases go on meanwhile.
                    call.add_done_callback(functools.partial(self._settle, batch, sent_at, True))
                    return
        except BaseException:
            for lease in batch:
                lease._renewing.release()
            raise
        self._settle(batch, sent_at, False, call)

    def _settle(
        self, batch: list[Lease], sent_at: float, late: bool, call: Future[list[Outcome]]
    ) -> None:
        """Take in a batch renewal's outcome, free the batch's leases, report the lost.

        ``late``: on the call's own thread, when the renewer stopped waiting for it. A
        lease renewed too late is then released right there: ``close()`` waits for that
        thread (within its grace) before the store closes, as for a release handed over.
        """
        try:
            try:
                outcomes = _outcomes_of(call.result, batch)
            except BaseException as exc:  # StoreError, or a bug (any kind): the renewer lives on
                _LOG.warning("renewing %d lease(s) failed: %s", len(batch), exc)
                with self._wakeup:
                    lost = [x for x in batch if self._plan.failed(x, _clock.monotonic())]
                    self._wakeup.notify()  # a retry may be due before the thread's next look
            else:
                with self._wakeup:
                    lost = self._plan.settle_batch(batch, outcomes, sent_at)
                    self._wakeup.notify()
                for lease in _renewed_too_late(batch, outcomes):  # on the renewal's connection
                    release = functools.partial(_release_quietly, self._store, lease)
                    if late:
                        release()
                    else:
                        self._calls.submit(release)
        finally:
            for lease in batch:
                lease._renewing.release()
        self._notify(lost)

    def close(self) -> None:
        """Stop renewing; wait for the calls already due (unless made by one of them):
        the renewals left to end on their own and the releases of leases renewed too
        late, before the store closes, then the ``on_lost`` callbacks, those of losses
        the renewals left to end found included (found by review: closed first, their
        threads had gone, and such a loss's ``on_lost`` was never called). Bounded,
        as ``AsyncLocks.aclose``: one may hang."""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        if not self._stop.done():
            self._stop.set_result(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._calls.close()
        self._calls.join(CALLBACK_GRACE)
        self._callbacks.close()
        self._callbacks.join(CALLBACK_GRACE)


def _release_quietly(store: Store, lease: LeaseState) -> None:
    try:
        store.release(lease.key, lease.token)
    except Exception as exc:
        _LOG.warning("releasing the lost lease on %r failed: %s", lease.key, exc)


async def _release_quietly_async(store: AsyncStore, lease: LeaseState) -> None:
    try:
        await store.release(lease.key, lease.token)
    except Exception as exc:
        _LOG.warning("releasing the lost lease on %r failed: %s", lease.key, exc)


def _earliest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


def _leave_at(plan: _RenewalPlan, sent_at: float, give_up: float) -> float:
    """When a renewer stops waiting for a renewal call sent at ``sent_at`` (and leaves it
    to end on its own): at ``give_up``, or once another lease is due and the call has
    been running ``SLOW_RENEWAL`` seconds, whichever comes first."""
    due = plan.next_due()
    return give_up if due is None else min(give_up, max(due, sent_at + SLOW_RENEWAL))


def _next_look(plan: _RenewalPlan, now: float) -> float | None:
    """When a renewer looks at ``plan`` next: its first renewal or deadline, and at
    least every ``SUSPEND_LOOK`` (see there); ``None`` when it has no lease."""
    when = _earliest(plan.next_due(), plan.next_deadline())
    return None if when is None else min(when, now + SUSPEND_LOOK)


def _outcomes_of(result: Callable[[], list[Outcome]], batch: Sequence[L]) -> list[Outcome | None]:
    """A batch renewal's outcomes; those of the servers it reached when it reached only
    some (logged), ``None`` for the others."""
    try:
        return list(result())
    except PartialRenewal as exc:
        failed = sum(outcome is None for outcome in exc.outcomes)
        _LOG.warning("renewing %d of %d lease(s) failed: %s", failed, len(batch), exc)
        return exc.outcomes


def _renewed_too_late(batch: Sequence[L], outcomes: Sequence[Outcome | None]) -> list[L]:
    """Leases the store renewed after their holder was told they were lost.

    The holder stopped relying on them at their deadline: release them rather than
    keep the key from everyone for another TTL.
    """
    return [x for x, o in zip(batch, outcomes, strict=True) if o is not None and o.ok and x._lost]


def _renewed_past_deadline(lease: LeaseState) -> bool:
    """A renewal by ``renew()`` that came back after the lease's deadline (or after it
    was marked lost): its holder was told it was lost then (``on_lost``), so it is not
    revived; it is released, as the renewer releases a lease renewed too late. Found by
    review: ``renew()`` returned as renewed a lease that ``lost`` said was gone, and the
    store kept the key from everyone for another TTL."""
    return lease._lost or _clock.monotonic() >= lease._deadline


def _dead_on_arrival(lease: LeaseState) -> bool:
    """A grant that came back past its deadline (the store answered after the lease's
    time, as after an outage): lost already, and given back at once if its token was
    drawn here. Found by review: nobody released it, and the key stayed held by nobody
    for a whole TTL after the outage."""
    return lease._drawn and lease.remaining <= 0


_RAN_OUT = (
    "lease on {key!r} was lost: its time ran out by this client's clock before a"
    " renewal landed; the store still had it, and it was released now"
)


def _after_loss(lease: LeaseState, holder: Holder | None) -> Holder | None:
    """The key's holder after ``lease`` was lost, from the store's current ``holder``.

    A lease lost at its local deadline (the store did not answer in time) learnt of no
    new holder; the store is asked later. A holder with the lease's own fence is that
    lease still in the store, not a new holder.
    """
    return None if holder is None or holder.fence == lease.fence else holder


def _closed_while_waiting(locks: Locks | AsyncLocks, key: str, *, waited: bool = True) -> str:
    during = "waited" if waited else "was under way"
    return f"this {type(locks).__name__} was closed while an acquire of {key!r} {during}"


def _quiet_if(closed: bool) -> contextlib.AbstractContextManager[None]:
    """Suppress a store's errors once its client is closed (nothing more can be done)."""
    return contextlib.suppress(Exception) if closed else contextlib.nullcontext()


def _leave_entered(entered: list[tuple[object, L]], who: object) -> L | None:
    """The lease ``who`` entered one ``lock()`` object with, taken out of ``entered``.

    One object may serve several threads or tasks at once, as a ``threading.Lock``
    does (``orders = locks.lock("orders")``, then ``with orders:`` in each): while the
    first one's lease is lost, a second may be granted the key. Each exit must release
    the lease its own enter took, never the other's: the last one ``who`` (a thread's
    id, a task) entered with; else (an exit elsewhere than its enter) the first one
    left. Safe while others append and leave: ``remove`` finds the very entry.
    """
    if len(entered) == 1 and entered[0][0] == who:  # the usual case: one block under way
        with contextlib.suppress(IndexError):  # (an enter meanwhile appends after it)
            return entered.pop(0)[1]
    entries = entered.copy()
    mine = [entry for entry in entries if entry[0] == who]
    for entry in mine[-1:] or entries[:1]:
        with contextlib.suppress(ValueError):  # taken meanwhile by its own exit
            entered.remove(entry)
            return entry[1]
    return None


class _LockContext:
    """What ``Locks.lock()`` returns: acquires on enter, releases on exit."""

    __slots__ = ("_entered", "_locks", "_request")

    def __init__(self, locks: Locks, request: _Request) -> None:
        self._locks = locks
        self._request = request
        self._entered: list[tuple[object, Lease]] = []  # see _leave_entered

    def __enter__(self) -> Lease:
        lease = self._locks._acquire(self._request)
        self._entered.append((threading.get_ident(), lease))
        return lease

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        lease = _leave_entered(self._entered, threading.get_ident())
        if lease is not None:
            self._locks._finish_lease(lease, block_failed=exc_type is not None)


class _Contending:
    """``Locks._contending``: a class, not a generator, as it runs at every acquire."""

    __slots__ = ("_locks", "_request", "_token", "_waits")

    def __init__(self, locks: Locks, request: _Request, token: str, waits: bool) -> None:
        self._locks = locks
        self._request = request
        self._token = token
        self._waits = waits

    def __enter__(self) -> None:
        if not self._locks._at_store.enter():
            key = self._request.key
            raise RuntimeError(_closed_while_waiting(self._locks, key, waited=self._waits))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            # Drawn here: nobody else holds it. Unless no step with it reached the store.
            request = self._request
            if (
                isinstance(exc, StoreError)
                and request.token is None
                and not isinstance(exc, NotSent)
            ):
                self._locks._give_backs.add(request.key, self._token, request.ttl)
        finally:
            self._locks._at_store.__exit__()


class Locks:
    """Lease locks on a store chosen by URL; synchronous and thread-safe.

    A lease lives ``ttl`` seconds unless renewed. Fences strictly increase per key.
    Callers of one ``Locks`` waiting for the same key are served in arrival order;
    across ``Locks`` instances and processes, the order is the store's (see its
    ``Capabilities.fair``). Not reentrant: acquiring a key you hold waits.
    """

    def __init__(
        self,
        url: str = "memory://",
        *,
        namespace: str = "",
        ttl: float = 30.0,
        owner: str | None = None,
        **store_options: object,
    ) -> None:
        self._config = _Config(url, namespace, ttl, owner, asynchronous=False)
        self._store: Store = self._config.driver.open(
            self._config.url, namespace=self._config.namespace, options=store_options
        )
        self._gate: KeyedLock = KeyedLock()
        self._renewer = _Renewer(self._store)
        self._at_store = _StoreCalls("Locks", self._store.close)
        self._give_backs = GiveBacks(self._store.release, self._at_store)
        # The leases this client granted, by token: a renewal by key and token through
        # this client extends the Lease object too (an edit session's heartbeats).
        self._leases: weakref.WeakValueDictionary[str, Lease] = weakref.WeakValueDictionary()
        self._closed = False
        _CLIENTS.add(self)

    def _forked(self) -> None:
        """In a forked child (``_reset_after_fork``)."""
        self._gate = KeyedLock()
        self._renewer = _Renewer(self._store)
        self._at_store = _StoreCalls("Locks", self._store.close)
        if self._closed:
            self._at_store.close()
        self._give_backs = GiveBacks(self._store.release, self._at_store)

    def __repr__(self) -> str:
        return self._config.shown(type(self).__name__, closed=self._closed)

    @property
    def url(self) -> str:
        return self._config.url

    @property
    def namespace(self) -> str:
        return self._config.namespace

    def __enter__(self) -> Locks:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop renewing and close the store connection. Held leases are not released.

        Every method called afterwards raises ``RuntimeError``, before the store. An
        acquire that waits for a key raises it too, when it next wakes to re-check
        (within a second, on the lock server within its long poll). The store stays
        open until such acquires have left its queue, giving back a key handed to them
        meanwhile, and until the calls other threads made before (a release, a renewal)
        have ended; the last of them closes it.
        """
        self._closed = True
        self._renewer.close()
        if self._at_store.close():
            self._store.close()
        self._give_backs.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Locks is closed")

    def lock(
        self,
        key: str,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = True,
        info: dict[str, Any] | None = None,
        steal: bool = False,
        on_lost: OnLost | None = None,
    ) -> _LockContext:
        """A context manager holding ``key`` for its block (renewed by default)."""
        request = self._config.request(key, ttl, timeout, renew, info, steal, on_lost)
        return _LockContext(self, request)

    def acquire(
        self,
        key: str,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        info: dict[str, Any] | None = None,
        steal: bool = False,
        on_lost: OnLost | None = None,
    ) -> Lease:
        """Acquire ``key``: wait up to ``timeout`` (``None`` forever, ``0`` try once).

        Raises ``Locked`` (with the holder) when not acquired in time.
        """
        return self._acquire(self._config.request(key, ttl, timeout, renew, info, steal, on_lost))

    def renew(self, key: str, token: str, ttl: float | None = None) -> Lease:
        """Extend the lease that ``token`` holds on ``key``; ``LockLost`` if it holds none.

        To ``ttl`` seconds from now; ``None``: this client's default TTL, not the lease's
        own (which a request by key and token cannot know): a heartbeat for a lease
        granted with another TTL passes it.
        Returns the ``Lease`` this client granted to ``token``, renewed, if it has it;
        else a new ``Lease`` for the token (not renewed in the background).
        """
        request = self._config.renew_args(key, token, ttl)
        with self._at_store:
            granted = _granted_here(self._leases, request.key, request.token)
            with granted._renewing if granted is not None else contextlib.nullcontext():
                sent_at = _clock.monotonic()
                outcome = _outcome_or_lost(
                    key, self._store.renew(request.key, request.token, request.ttl)
                )
                if granted is not None and _extend(granted, outcome, sent_at, request.ttl):
                    self._renewer.renewed(granted, sent_at)  # maybe to a shorter TTL
                    # The lease itself: releasing what renew returned releases it, not
                    # a twin whose release left the lease to be found lost.
                    return granted
        return Lease(
            self,
            request.key,
            request.token,
            outcome,
            ttl=request.ttl,
            sent_at=sent_at,
            on_lost=None,
        )

    def release(self, key: str, token: str) -> None:
        """Release the lease that ``token`` holds on ``key``; ``LockLost`` if it holds none."""
        key, token = check_key(key), check_token(token)
        with self._at_store:
            # A lease this client granted, maybe renewing: once released, it must not be
            # renewed (a refused renewal would call it lost) and its owner sees it released.
            granted = _granted_here(self._leases, key, token)
            with granted._renewing if granted is not None else contextlib.nullcontext():
                try:
                    outcome = self._store.release(key, token)
                except StoreError as exc:
                    _finish_later(self._give_backs, self._renewer, granted, exc)
                    raise
                _outcome_or_lost(key, outcome)
                if granted is not None:
                    self._renewer.discard(granted)
                    granted._released = True

    def holder(self, key: str) -> Holder | None:
        """The current holder of ``key``, or ``None`` when it is free."""
        key = check_key(key)
        with self._at_store:
            return self._store.holder(key)

    def holders(self, prefix: str = "") -> list[Holder]:
        """Every current lease whose key starts with ``prefix``, sorted by key."""
        prefix = check_prefix(prefix)
        with self._at_store:
            return self._store.holders(prefix)

    def locked(
        self,
        key: str,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = True,
        info: dict[str, Any] | None = None,
        steal: bool = False,
        on_lost: OnLost | None = None,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Decorator: hold the lock ``key.format(**arguments)`` while the function runs."""
        self._config.request("template", ttl, timeout, renew, info, steal, on_lost)

        def decorate(function: Callable[P, R]) -> Callable[P, R]:
            if not callable(function):
                raise TypeError(
                    f"Locks.locked decorates functions; {function!r} is not a callable object"
                )
            if _returns_coroutines(function) or inspect.isasyncgenfunction(function):
                raise TypeError("Locks.locked decorates plain functions; use AsyncLocks.locked")
            _refuse_generator(function, asynchronous=False)
            signature = _key_template(key, function)

            @functools.wraps(function)
            def locked_call(*args: P.args, **kwargs: P.kwargs) -> R:
                name = _format_key(key, signature, args, kwargs)
                with self.lock(name, ttl, timeout, renew, info, steal, on_lost):
                    result = function(*args, **kwargs)
                    if inspect.isawaitable(result):
                        # It runs after the lock is released: found by review, a plain
                        # function that returns a coroutine held no lock, silently.
                        if inspect.iscoroutine(result):
                            result.close()
                        raise TypeError(
                            f"{function!r} returned an awaitable, which would run after"
                            " Locks.locked released the lock; use AsyncLocks.locked"
                        )
                    return result

            return locked_call

        return decorate

    # -- the I/O of acquiring, renewing and releasing ------------------------------

    def _acquire(self, request: _Request) -> Lease:
        self._check_open()
        token = _new_token() if request.token is None else request.token
        try:
            if request.steal or request.timeout == 0:
                return self._attempt_once(request, token)
            deadline = Deadline(request.timeout)
            if request.token is not None and self._gate.locked(request.key):
                # A token named by the caller (the lock server's clients) may hold
                # the key already: a retry whose first answer was lost. Queued at
                # the gate behind waiters for its own lease, it waited out its
                # timeout, refused, the key kept from all. One try first. (With
                # the gate free, the first try of _contend answers it at once.)
                with contextlib.suppress(Locked):
                    return self._attempt_once(request, token)
            if not self._gate.acquire(request.key, timeout=deadline.remaining()):
                raise Locked(request.key, self._holder_if_known(request.key))
            try:
                return self._contend(request, token, deadline)
            finally:
                self._gate.release(request.key)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                # Interrupted (KeyboardInterrupt, SystemExit): the store may have granted
                # the key in a step whose answer the caller will never see.
                self._give_back(request.key, token)
            raise

    def _attempt_once(self, request: _Request, token: str) -> Lease:
        """One try: the lease, or ``Locked`` if refused.

        Counted as a contender, like a wait: ``close()`` meanwhile leaves the store open
        until the try is answered and the lease made (or the grant given back). Found by
        review: the lease was made after the count was left, so a ``close()`` in between
        closed the store, and a grant that then could not be renewed was given back to
        a closed store: the key stayed held by nobody for its TTL.
        """
        with self._contending(request, token, waits=False):
            sent_at = _clock.monotonic()
            outcome = self._try(request, token, None)
            if not outcome.ok:
                raise Locked(request.key, outcome.holder)
            self._unless_closed(request.key, token, waited=False)
            return self._granted(request, token, outcome, sent_at)

    def _contend(self, request: _Request, token: str, deadline: Deadline) -> Lease:
        """Try, wait, try again until granted: as ``_attempt_once``, by ``deadline``."""
        with self._contending(request, token, waits=True):
            sent_at, outcome = self._contend_counted(request, token, deadline)
            # Once its waiter is closed (a round trip on some stores): closed meanwhile?
            self._unless_closed(request.key, token, waited=True)
            return self._granted(request, token, outcome, sent_at)

    def _contending(self, request: _Request, token: str, *, waits: bool) -> _Contending:
        """An acquire at the store, counted in ``_at_store``: ``close()`` meanwhile
        leaves the store open until it has left; the last to leave closes it.

        A ``StoreError`` may hide a grant (an answer that came too late, or was lost):
        it is given back in the background (``_giveback``), if the token is ours. Not
        after ``NotSent``: no step with the token reached the store (found by review: a
        ZooKeeper client that never connected then spent another ``timeout`` giving
        back, and ``keymutex run`` took twice as long to say the store was down).
        """
        return _Contending(self, request, token, waits)

    def _unless_closed(self, key: str, token: str, *, waited: bool) -> None:
        """A grant that landed as the client closed: nobody could release it. Given back."""
        if self._closed:
            self._give_back(key, token)
            raise RuntimeError(_closed_while_waiting(self, key, waited=waited))

    def _contend_counted(
        self, request: _Request, token: str, deadline: Deadline
    ) -> tuple[float, Outcome]:
        # With a store that notifies, even the first try carries the waiter: a refusal
        # queues it in the same atomic step, so no release can slip in between.
        waiter = self._store.waiter(request.key) if self._store.capabilities.notifies else None
        at_store, backoff = _pacing(self._store)
        try:
            while True:
                sent_at = _clock.monotonic()
                outcome = self._try(request, token, waiter)
                if outcome.ok:
                    return sent_at, outcome
                if deadline.passed():
                    raise Locked(request.key, outcome.holder)
                if waiter is None:
                    waiter = self._store.waiter(request.key)
                    at_store, backoff = _pacing(self._store)
                    if self._store.capabilities.notifies:
                        continue  # _looked_again_at_once
                waiter.wait(park_time(deadline, outcome.remaining, backoff, at_store=at_store))
                if self._closed:
                    raise RuntimeError(_closed_while_waiting(self, request.key))
        finally:
            if waiter is not None:
                with _quiet_if(self._closed):  # closed client: best effort (entries expire)
                    waiter.close()

    def _try(self, request: _Request, token: str, waiter: Waiter | None) -> Outcome:
        return self._store.try_acquire(
            request.key,
            token=token,
            ttl=request.ttl,
            owner=self._config.owner_now() if request.owner is None else request.owner,
            info=request.info,
            steal=request.steal,
            waiter=waiter,
        )

    def _granted(self, request: _Request, token: str, outcome: Outcome, sent_at: float) -> Lease:
        lease = Lease(
            self,
            request.key,
            token,
            outcome,
            ttl=request.ttl,
            sent_at=sent_at,
            on_lost=request.on_lost,
        )
        lease._drawn = request.token is None
        if _dead_on_arrival(lease):
            self._give_back(request.key, token)
        self._leases[token] = lease
        if request.renew:
            try:
                self._renewer.add(lease)
            except RuntimeError:  # closed while the grant was on its way: give it back
                self._give_back(request.key, token)
                raise
        return lease

    def _give_back(self, key: str, token: str) -> None:
        """Release a grant that the caller will never see (by token: nobody else's)."""
        try:
            self._store.release(key, token)
        except Exception as exc:  # the lease will expire by its TTL
            _LOG.warning("could not give back %r (it expires by its TTL): %s", key, exc)

    def _holder_if_known(self, key: str) -> Holder | None:
        try:
            return self._store.holder(key)
        except StoreError:
            return None

    def _lost(self, lease: Lease, holder: Holder | None) -> LockLost:
        if lease._mark_lost(holder):
            lease._notify_lost()
        return LockLost(lease.key, lease._new_holder if holder is None else holder)

    def _gone(self, lease: Lease) -> LockLost:
        """The error for a lease already known lost or released: see ``_after_loss``.

        A lease lost at its local deadline that the store still shows (its own fence)
        is released now, if its token was drawn here: it cannot be renewed (a waiter
        may be granted the key any moment), and would keep the key from everyone until
        the store's TTL. The message said "no current holder".
        """
        holder = lease._new_holder
        if holder is None:
            current = self._holder_if_known(lease.key)
            if current is not None and current.fence == lease.fence and lease._drawn:
                self._give_back(lease.key, lease.token)
                return LockLost(lease.key, None, _RAN_OUT.format(key=lease.key))
            holder = _after_loss(lease, current)
        return LockLost(lease.key, holder)

    def _renew_lease(self, lease: Lease, ttl: float | None) -> None:
        ttl = lease._ttl if ttl is None else self._config.check_ttl(ttl)
        lease._check_process()
        with self._at_store:
            # Known gone: raised without waiting for a renewal under way (on_lost may call
            # this while the renewer waits for a silent store).
            self._raise_if_ended(lease)
            with lease._renewing:
                self._raise_if_ended(lease)  # released or lost while this waited
                if lease.remaining <= 0:
                    # Past its deadline by our clock, though the store may not have seen it
                    # expire yet: never revive it (a waiter may be granted it any moment).
                    outcome = self._store.release(lease.key, lease.token)
                    outcome = Outcome(False, None if outcome.ok else outcome.holder)
                else:
                    sent_at = _clock.monotonic()
                    outcome = self._store.renew(lease.key, lease.token, ttl)
                    if outcome.ok and _renewed_past_deadline(lease):
                        _release_quietly(self._store, lease)
                        outcome = Outcome(False)
                    elif outcome.ok:
                        lease._granted(outcome, sent_at, ttl)
                        self._renewer.renewed(lease, sent_at)  # maybe to a shorter TTL
                        return
            self._renewer.discard(lease)
            raise self._lost(lease, outcome.holder)

    def _raise_if_ended(self, lease: Lease) -> None:
        """``LockLost`` for a lease released or lost already."""
        if lease._released:
            holder = self._holder_if_known(lease.key)
            raise LockLost(lease.key, holder, f"lease on {lease.key!r} was already released")
        if lease._lost:
            raise self._gone(lease)

    def _release_lease(self, lease: Lease) -> None:
        lease._check_process()
        with self._at_store:
            self._renewer.discard(lease)
            self._raise_if_ended(lease)
            # After a renewal or release of it under way in another thread: the store's
            # "not yours" to the second of two would call a released lease lost.
            with lease._renewing:
                self._raise_if_ended(lease)
                expired = lease.remaining <= 0  # by our own clock, before the store's says so
                try:
                    outcome = self._store.release(lease.key, lease.token)
                except StoreError as exc:
                    _finish_later(self._give_backs, self._renewer, lease, exc)
                    raise
                if not outcome.ok or expired:
                    raise self._lost(lease, outcome.holder)
                lease._released = True

    def _finish_lease(self, lease: Lease, *, block_failed: bool) -> None:
        """Leave a ``with`` block: release, and report a loss unless the block raised."""
        if lease._released:
            return
        try:
            self._release_lease(lease)
        except (LockError, RuntimeError):  # RuntimeError: closed before the block ended
            if not block_failed:
                raise


async def _taken_at_once(lock: asyncio.Lock) -> bool:
    """Take ``lock`` if that needs no wait; ``False`` (not taken) otherwise.

    ``asyncio.Lock`` has no non-blocking acquire, and ``locked()`` is not enough: a lock
    just let go of may be promised to a waiter that has not run yet, and ``acquire``
    then waits for that waiter's turn. Found by review: the renewer waited there behind
    an owner's ``renew()`` of one lease on a hung store, and renewed no other lease.
    """
    if lock.locked():
        return False
    try:
        async with asyncio.timeout(0):  # fires only if ``acquire`` has to wait
            await lock.acquire()
    except TimeoutError:
        return False
    return True


class _AsyncRenewer:
    """One task that renews every renewing lease of an ``AsyncLocks``, in batches."""

    def __init__(self, store: AsyncStore) -> None:
        self._store = store
        self._plan = _RenewalPlan()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._callbacks: set[asyncio.Task[Any]] = set()
        self._releases: set[asyncio.Task[Any]] = set()  # of leases renewed too late
        self._late: set[asyncio.Future[Any]] = set()  # calls left to end on their own
        self._until = -math.inf  # as in _Renewer
        self._idle: float | None = None  # as in _Renewer
        # An exit raised by a plain on_lost, queued to end the loop's run (_report_lost).
        self._exiting = False

    def add(self, lease: AsyncLease) -> None:
        if self._closed:
            raise RuntimeError("this AsyncLocks is closed")
        first_look = self._plan.add(lease, _clock.monotonic())
        self._idle = lease._ttl / 3
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wakeup = asyncio.Event()
            self._until = -math.inf
            self._exiting = False  # one queued in a loop that ended never ran
            self._task = loop.create_task(self._run(self._wakeup), name="keymutex-renewer")
        assert self._wakeup is not None
        if first_look < self._until:
            self._wakeup.set()

    def renewed(self, lease: AsyncLease, sent_at: float) -> None:
        """As ``_Renewer.renewed``."""
        look = self._plan.renewed(lease, sent_at)
        if look is not None and look < self._until and self._wakeup is not None:
            self._wakeup.set()

    def discard(self, lease: LeaseState) -> None:
        self._plan.discard(lease)

    async def _run(self, wakeup: asyncio.Event) -> None:
        # The task ends after a quiet spell without leases (see _Renewer._idle_until),
        # not as soon as the plan is empty: a task per lock() saved.
        while True:
            now = _clock.monotonic()
            for lease in self._plan.overdue(now):
                self._report_lost(lease)
            batch = self._plan.take_due(now)
            if not batch:
                when = _next_look(self._plan, now)
                if when is None:
                    idle, self._idle = self._idle, None
                    if idle is None:
                        return
                    when = now + idle
                wakeup.clear()
                self._until = when
                try:
                    async with asyncio.timeout(when - now):
                        await wakeup.wait()
                except TimeoutError:
                    pass
                finally:
                    self._until = -math.inf
                continue
            # A lease its owner is renewing right now is looked at again shortly.
            mine: list[AsyncLease] = []
            try:
                for lease in batch:
                    assert isinstance(lease, AsyncLease)
                    if await _taken_at_once(lease._renewing):  # may yield: cancellable
                        mine.append(lease)
                    else:
                        self._plan.later(lease, now)
            except BaseException:  # cancelled by aclose(): nothing renews those taken
                for lease in mine:
                    lease._renewing.release()
                raise
            if mine:
                await self._renew(mine)  # frees the batch's leases, now or when the call ends

    async def _renew(self, batch: list[AsyncLease]) -> None:
        """Renew ``batch`` in one store call, and take in its outcome (``_settle``): as
        ``_Renewer._renew``, a slow call (``_leave_at``) is left to end on its own task,
        and settled then, while this task goes on with the other leases."""
        try:
            sent_at = _clock.monotonic()
            requests = [RenewRequest(lease.key, lease.token, lease._ttl) for lease in batch]
            call = asyncio.ensure_future(self._store.renew_many(requests))
            give_up = sent_at + min(lease._ttl for lease in batch) / 3
            try:
                while True:  # while the call runs, holders past their deadline learn it
                    leave_at = _leave_at(self._plan, sent_at, give_up)
                    until = min(leave_at, self._plan.next_deadline() or math.inf)
                    wait = max(0.0, until - _clock.monotonic())
                    if (await asyncio.wait([call], timeout=wait))[0]:
                        break
                    now = _clock.monotonic()
                    for lease in self._plan.overdue(now):
                        self._report_lost(lease)
                    if now >= leave_at:
                        # Left to end on its own: the other leases go on meanwhile.
                        self._late.add(call)
                        call.add_done_callback(functools.partial(self._settle, batch, sent_at))
                        return
            except BaseException:  # cancelled (aclose): the call goes too, and ends first
                call.cancel()
                await asyncio.wait([call])
                raise
        except BaseException:
            for lease in batch:
                lease._renewing.release()
            raise
        self._settle(batch, sent_at, call)

    def _settle(
        self, batch: list[AsyncLease], sent_at: float, call: asyncio.Future[list[Outcome]]
    ) -> None:
        """Take in a batch renewal's outcome, free the batch's leases, report the lost
        (on the renewer's task, or as the call's done-callback when it was left to end)."""
        self._late.discard(call)
        try:
            if call.cancelled():  # aclose() cancelled a call left to end
                return
            try:
                outcomes = _outcomes_of(call.result, batch)
            except Exception as exc:  # StoreError, or a bug: the renewer must live on
                _LOG.warning("renewing %d lease(s) failed: %s", len(batch), exc)
                lost = [x for x in batch if self._plan.failed(x, _clock.monotonic())]
            else:
                lost = self._plan.settle_batch(batch, outcomes, sent_at)
                for lease in _renewed_too_late(batch, outcomes):
                    self._spawn(_release_quietly_async(self._store, lease), self._releases)
        finally:
            for lease in batch:
                lease._renewing.release()
        for lease in lost:
            self._report_lost(lease)
        if self._wakeup is not None:
            self._wakeup.set()  # a retry or a renewal may be due before the task's next look

    def call_on_lost(self, lease: LeaseState) -> None:
        """Call ``lease``'s ``on_lost``; the coroutine of an ``async def`` one is spawned.

        A plain one's ``Exception`` is logged (``_notify_lost``); anything else it raises
        reaches the caller, as with ``Locks`` when the owner's own call finds the loss.
        """
        result = lease._notify_lost()
        if inspect.isawaitable(result):
            self._spawn(_logged_on_lost(lease, result), self._callbacks)

    def _report_lost(self, lease: LeaseState) -> None:
        """``call_on_lost`` for the renewer (its task, or a late renewal's done-callback):
        whatever a plain ``on_lost`` raises leaves the renewer running.

        Found by review: a plain ``on_lost`` raising a ``BaseException`` that is not an
        ``Exception`` (a class of the user's own) ended the renewer task, and no lease
        of that ``AsyncLocks`` taken before was renewed again. Such an exception is
        logged, as ``_call_on_lost`` logs it on the sync client's callback thread.

        ``SystemExit`` and ``KeyboardInterrupt`` are not: on the sync client they can
        only end a callback thread, but here the callback runs on the loop's thread,
        where they are the program's exit (``sys.exit()`` in the callback, a Ctrl-C that
        landed in it), and asyncio lets them out of the loop's run from any task or
        callback (an ``on_lost`` coroutine's too). They are raised again from a callback
        of their own (``call_soon``): the run ends, as asyncio would end it, but the
        renewer task does not, and a loop run again goes on renewing.

        One at a time: found by review, the on_lost of each lease lost in one pass (a
        store out of reach: every deadline passes at once) queued an exit of its own;
        the first ended the run, the next one ended ``asyncio.run``'s clean-up (the
        cancelled tasks' ``finally`` blocks, ``async with AsyncLocks``) before it began.
        While one is queued, the others are logged.
        """
        try:
            self.call_on_lost(lease)
        except (KeyboardInterrupt, SystemExit) as exc:
            if self._exiting:
                _LOG.exception("on_lost callback for %r: the loop's run ends already", lease.key)
            else:
                self._exiting = True
                asyncio.get_running_loop().call_soon(self._exit, exc)
        except BaseException:
            _LOG.exception("on_lost callback for %r failed", lease.key)

    def _exit(self, exc: BaseException) -> NoReturn:
        """Raise ``exc`` (from a loop callback: see ``_report_lost``)."""
        self._exiting = False
        raise exc

    @staticmethod
    def _spawn(work: Awaitable[Any], tasks: set[asyncio.Task[Any]]) -> None:
        task = asyncio.ensure_future(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def aclose(self, closer: asyncio.Task[Any] | None = None) -> None:
        """Stop renewing; let the ``on_lost`` coroutines end (but ``closer``, the task
        that called ``AsyncLocks.aclose()``: an ``on_lost`` that closes its client)."""
        self._closed = True
        task, self._task = self._task, None
        await stop_task(task)
        await cancel_left(self._late)  # calls left to end on their own: they go too, first
        await self._end_callbacks(closer)
        if self._releases:  # before the store closes
            await asyncio.wait(self._releases)

    async def _end_callbacks(self, closer: asyncio.Task[Any] | None) -> None:
        """Let the ``on_lost`` coroutines under way finish, for ``CALLBACK_GRACE``
        seconds at most, then cancel the rest. (The ``AsyncLocks`` is closed already:
        what they do with it raises; what they do elsewhere, such as stopping the work
        the lease protected, gets its time.)

        One that calls ``aclose()`` (``closer``) is not waited for by it: found by review,
        ``aclose()`` runs in a task of its own (``_to_the_end``), so the callback's task
        was never the current one here; it was waited for, then cancelled, 10 s in all.
        One that will not end when cancelled is left behind after a second grace, with a
        warning.
        """
        loop = asyncio.get_running_loop()
        pending = {x for x in self._callbacks if x is not closer and x.get_loop() is loop}
        if not pending:
            return
        _, pending = await asyncio.wait(pending, timeout=CALLBACK_GRACE)
        if not pending:
            return
        for callback in pending:
            callback.cancel()
        _, pending = await asyncio.wait(pending, timeout=CALLBACK_GRACE)
        if pending:
            _LOG.warning(
                "%d on_lost callback(s) still running after aclose() cancelled them",
                len(pending),
            )


async def _logged_on_lost(lease: LeaseState, callback: Awaitable[Any]) -> None:
    """Await an ``on_lost`` coroutine; its failure is logged as a plain callback's is
    by the renewer (``_AsyncRenewer._report_lost``): a ``BaseException`` of the user's
    own too, which asyncio reported only when the task was collected, if ever.
    Cancellation (``aclose()``), ``SystemExit`` and ``KeyboardInterrupt`` go on."""
    try:
        await callback
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        _LOG.exception("on_lost callback for %r failed", lease.key)


async def _hand_over(work: Awaitable[R], reply: asyncio.Future[R]) -> R | None:
    """Await ``work`` and hand its result or exception to ``reply``, if still awaited.

    Returns the result, or ``None`` when ``work`` raised: the exception goes to
    ``reply`` alone, for the task running this must not end with an exception that
    nobody retrieves.
    """
    try:
        result = await work
    except Exception as exc:
        if not reply.done():
            reply.set_exception(exc)
        return None
    except BaseException:  # this task was cancelled (the loop is closing), or worse
        reply.cancel()
        raise
    if not reply.done():
        reply.set_result(result)
    return result


def _shielded(work: Awaitable[R]) -> tuple[asyncio.Future[R], asyncio.Task[R | None]]:
    """``asyncio.shield(work)``, a turn of the event loop cheaper: (reply, task).

    ``work`` runs in a task of its own, which the caller's cancellation does not
    reach; the caller awaits ``reply``, which the task completes directly, rather than
    through its done callback and then a second future as ``asyncio.shield`` does
    (a few µs per shielded step). As with ``asyncio.shield``, the caller keeps the task
    referenced while it awaits, so the task cannot be collected under it.
    """
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[R] = loop.create_future()
    handing_over = _hand_over(work, reply)  # (inferred wrongly inside create_task())
    return reply, loop.create_task(handing_over)


async def _to_the_end(work: Awaitable[R]) -> R:
    """Await ``work`` in a task of its own that cancellation does not stop; a cancelled
    caller waits for it to end (through further cancellations too), then is cancelled.

    For clean-up that must be over before the caller goes on: a waiter's leaving the
    queue, before the store may close. ``asyncio.shield`` alone let a second
    cancellation go on at once: the client's store was closed under the leave (Redis,
    the lock server: a connection left open; etcd: its lease left), or the event loop
    ended before it ran (memory: a queue entry that blocked the key for good).
    """
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller gets
        raise


class _Waiting:
    """A store's waiter for one ``AsyncLocks`` acquire, and whether it is closed."""

    __slots__ = ("closed", "error", "waiter")

    def __init__(self, waiter: AsyncWaiter) -> None:
        self.waiter = waiter
        self.closed = False
        self.error: Exception | None = None

    async def close_granted(self) -> None:
        """Close the waiter after a grant; a failure is raised later, by ``_contend``."""
        self.closed = True
        try:
            await self.waiter.aclose()
        except Exception as exc:  # raised where closing happened before: after the step
            self.error = exc

    def raise_close_error(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error


class _AsyncLockContext:
    """What ``AsyncLocks.lock()`` returns: acquires on enter, releases on exit."""

    __slots__ = ("_entered", "_locks", "_request")

    def __init__(self, locks: AsyncLocks, request: _Request) -> None:
        self._locks = locks
        self._request = request
        self._entered: list[tuple[object, AsyncLease]] = []  # see _leave_entered

    async def __aenter__(self) -> AsyncLease:
        lease = await self._locks._acquire(self._request)
        self._entered.append((asyncio.current_task(), lease))
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        lease = _leave_entered(self._entered, asyncio.current_task())
        if lease is not None:
            await self._locks._finish_lease(lease, block_failed=exc_type is not None)


class AsyncLocks:
    """Lease locks on a store chosen by URL, for asyncio. The twin of ``Locks``.

    Cancelling a task that waits leaves nothing behind: a grant that lands after the
    cancellation is released in the background.
    """

    def __init__(
        self,
        url: str = "memory://",
        *,
        namespace: str = "",
        ttl: float = 30.0,
        owner: str | None = None,
        **store_options: object,
    ) -> None:
        self._config = _Config(url, namespace, ttl, owner, asynchronous=True)

        def open_store() -> AsyncStore:
            return self._config.driver.open_async(
                self._config.url, namespace=self._config.namespace, options=store_options
            )

        store = open_store()
        # A store whose connections belong to a loop has a store of its own per loop.
        self._store: AsyncStore = store
        if getattr(store, "loop_bound", False):
            self._store = StoreOfTheLoop(store, open_store)
        self._gate: AsyncKeyedLock = AsyncKeyedLock()
        self._renewer = _AsyncRenewer(self._store)
        self._store_closed = asyncio.Event()
        self._at_store = _StoreCalls("AsyncLocks", self._close_store)
        self._give_backs = AsyncGiveBacks(self._store.release, self._at_store)
        self._leases: weakref.WeakValueDictionary[str, AsyncLease] = (
            weakref.WeakValueDictionary()
        )  # as in Locks
        self._closed = False
        _CLIENTS.add(self)
        self._background: set[asyncio.Task[Any]] = set()
        self._loop: weakref.ref[asyncio.AbstractEventLoop] | None = None  # see _check_loop
        self._loop_switch = threading.Lock()

    def _forked(self) -> None:
        """As ``Locks._forked``."""
        self._loop, self._loop_switch = None, threading.Lock()
        self._gate = AsyncKeyedLock()
        self._renewer = _AsyncRenewer(self._store)
        self._store_closed = asyncio.Event()
        self._at_store = _StoreCalls("AsyncLocks", self._close_store)
        if self._closed:
            self._at_store.close()
        self._give_backs = AsyncGiveBacks(self._store.release, self._at_store)

    def __repr__(self) -> str:
        return self._config.shown(type(self).__name__, closed=self._closed)

    @property
    def url(self) -> str:
        return self._config.url

    @property
    def namespace(self) -> str:
        return self._config.namespace

    async def __aenter__(self) -> AsyncLocks:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop renewing and close the store connection. Held leases are not released.

        Every method called afterwards raises ``RuntimeError``, before the store. An
        acquire that waits for a key raises it too, as ``Locks.close`` says.
        """
        self._closed = True
        # To the end even if the caller is cancelled (which it then is): found by
        # review, a cancellation in the middle left the store's connections open, and a
        # second aclose() did not close them (the store is closed once).
        await _to_the_end(self._close(asyncio.current_task()))

    async def _close(self, closer: asyncio.Task[Any] | None) -> None:
        await self._renewer.aclose(closer)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        # The give-backs' last round first: their task is a call at the store, which
        # the wait below would wait out (found by review: `keymutex run` on a store
        # that refused its connection took CALLBACK_GRACE, 5 s, to exit). Tokens that
        # calls still under way add later are given back at once, by a task they start.
        await self._give_backs.aclose()
        if self._at_store.close():
            await self._close_store()
        else:
            # Calls under way at the store (a cancelled waiter leaving its queue and
            # giving back a key handed to it, the release of a cancelled block) close it
            # when the last one ends: waited for, ``CALLBACK_GRACE`` at most. Found by
            # review: aclose() returned first, the application ended its event loop
            # (uvicorn's shutdown, asyncio.run), which cancelled those tasks half-way,
            # and a key handed to a leaving waiter stayed held by nobody for its TTL.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CALLBACK_GRACE):
                    await self._store_closed.wait()
                    while self._background:  # releases started meanwhile
                        await asyncio.gather(*self._background, return_exceptions=True)

    async def _close_store(self) -> None:
        try:
            await self._store.aclose()
        finally:
            self._store_closed.set()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this AsyncLocks is closed")

    def _check_loop(self) -> None:
        """Refuse a second event loop while the one this client waits and renews in runs.

        The gate of its waiters (``AsyncKeyedLock``) and its renewer (a task) belong to
        one loop. Loops that run one after another may share the client (a module-level
        one, a loop per test); a loop of another thread, while the last one still runs,
        may not: a waiter of one loop woken from the other's thread slept until its
        timeout, and two renewer tasks shared one plan.
        """
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop() is loop:
            return
        with self._loop_switch:
            previous = None if self._loop is None else self._loop()
            if previous is not None and previous is not loop and previous.is_running():
                raise RuntimeError(
                    "this AsyncLocks is in use by an event loop that still runs in another"
                    " thread: make one AsyncLocks per event loop (loops that run one after"
                    " another may share one)"
                )
            self._loop = weakref.ref(loop)

    def lock(
        self,
        key: str,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = True,
        info: dict[str, Any] | None = None,
        steal: bool = False,
        on_lost: OnLost | None = None,
    ) -> _AsyncLockContext:
        """An async context manager holding ``key`` for its block (renewed by default)."""
        request = self._config.request(key, ttl, timeout, renew, info, steal, on_lost)
        return _AsyncLockContext(self, request)

    async def acquire(
        self,
        key: str,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        info: dict[str, Any] | None = None,
        steal: bool = False,
        on_lost: OnLost | None = None,
    ) -> AsyncLease:
        """Acquire ``key``: wait up to ``timeout`` (``None`` forever, ``0`` try once).

        Raises ``Locked`` (with the holder) when not acquired in time.
        """
        request = self._config.request(key, ttl, timeout, renew, info, steal, on_lost)
        return await self._acquire(request)

    async def renew(self, key: str, token: str, ttl: float | None = None) -> AsyncLease:
        """Extend the lease that ``token`` holds on ``key``; ``LockLost`` if it holds none.

        As ``Locks.renew``: ``ttl=None`` is this client's default TTL.
        """
        request = self._config.renew_args(key, token, ttl)
        async with self._at_store:
            granted = _granted_here(self._leases, request.key, request.token)
            async with granted._renewing if granted is not None else contextlib.nullcontext():
                sent_at = _clock.monotonic()
                outcome = _outcome_or_lost(
                    key, await self._store.renew(request.key, request.token, request.ttl)
                )
                if granted is not None and _extend(granted, outcome, sent_at, request.ttl):
                    self._renewer.renewed(granted, sent_at)  # as in Locks.renew
                    return granted
        return AsyncLease(
            self,
            request.key,
            request.token,
            outcome,
            ttl=request.ttl,
            sent_at=sent_at,
            on_lost=None,
        )

    async def release(self, key: str, token: str) -> None:
        """Release the lease that ``token`` holds on ``key``; ``LockLost`` if it holds none.

        Once started, the release goes on if the caller is cancelled, and ``aclose()``
        waits for it.
        """
        key, token = check_key(key), check_token(token)
        await self._unstopped(self._release_by_token(key, token))

    async def _release_by_token(self, key: str, token: str) -> None:
        async with self._at_store:
            granted = _granted_here(self._leases, key, token)  # as in Locks.release
            async with granted._renewing if granted is not None else contextlib.nullcontext():
                try:
                    outcome = await self._store.release(key, token)
                except StoreError as exc:
                    _finish_later(self._give_backs, self._renewer, granted, exc)
                    raise
                _outcome_or_lost(key, outcome)
                if granted is not None:
                    self._renewer.discard(granted)
                    granted._released = True

    async def holder(self, key: str) -> Holder | None:
        """The current holder of ``key``, or ``None`` when it is free."""
        key = check_key(key)
        async with self._at_store:
            return await self._store.holder(key)

    async def holders(self, prefix: str = "") -> list[Holder]:
        """Every current lease whose key starts with ``prefix``, sorted by key."""
        prefix = check_prefix(prefix)
        async with self._at_store:
            return await self._store.holders(prefix)

    def locked(
        self,
        key: str,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = True,
        info: dict[str, Any] | None = None,
        steal: bool = False,
        on_lost: OnLost | None = None,
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
        """Decorator: hold the lock ``key.format(**arguments)`` while the coroutine runs."""
        self._config.request("template", ttl, timeout, renew, info, steal, on_lost)

        def decorate(function: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
            if not callable(function):
                raise TypeError(
                    f"AsyncLocks.locked decorates async functions; {function!r} is not a"
                    " callable object"
                )
            _refuse_generator(function, asynchronous=True)
            if not _returns_coroutines(function):
                raise TypeError("AsyncLocks.locked decorates async functions; use Locks.locked")
            signature = _key_template(key, function)

            @functools.wraps(function)
            async def locked_call(*args: P.args, **kwargs: P.kwargs) -> R:
                name = _format_key(key, signature, args, kwargs)
                async with self.lock(name, ttl, timeout, renew, info, steal, on_lost):
                    return await function(*args, **kwargs)

            return locked_call

        return decorate

    # -- the I/O of acquiring, renewing and releasing ------------------------------

    async def _acquire(self, request: _Request) -> AsyncLease:
        self._check_open()
        self._check_loop()
        token = _new_token() if request.token is None else request.token
        if request.steal or request.timeout == 0:
            return await self._attempt_once(request, token)
        deadline = Deadline(request.timeout)
        if request.token is not None and self._gate.locked(request.key):  # Locks._acquire
            with contextlib.suppress(Locked):
                return await self._attempt_once(request, token)
        if not await self._gate.acquire(request.key, timeout=deadline.remaining()):
            raise Locked(request.key, await self._holder_if_known(request.key))
        try:
            return await self._contend(request, token, deadline)
        finally:
            self._gate.release(request.key)

    async def _attempt_once(self, request: _Request, token: str) -> AsyncLease:
        """As ``Locks._attempt_once``: counted as a contender, a late grant given back."""
        async with self._contending(request, token, waits=False):
            sent_at = _clock.monotonic()
            outcome = await self._try(request, token, None)
            if not outcome.ok:
                raise Locked(request.key, outcome.holder)
            await self._unless_closed(request.key, token, waited=False)
            return self._granted(request, token, outcome, sent_at)

    async def _contend(self, request: _Request, token: str, deadline: Deadline) -> AsyncLease:
        async with self._contending(request, token, waits=True):
            return await self._contend_counted(request, token, deadline)

    @contextlib.asynccontextmanager
    async def _contending(
        self, request: _Request, token: str, *, waits: bool
    ) -> AsyncIterator[None]:
        """As ``Locks._contending``."""
        if not self._at_store.enter():
            raise RuntimeError(_closed_while_waiting(self, request.key, waited=waits))
        try:
            yield
        except StoreError as exc:
            if request.token is None and not isinstance(exc, NotSent):
                self._give_backs.add(request.key, token, request.ttl)
            raise
        finally:
            await self._at_store.__aexit__()

    async def _unless_closed(self, key: str, token: str, *, waited: bool) -> None:
        """As ``Locks._unless_closed``."""
        if self._closed:
            await _to_the_end(self._release_quietly(key, token))
            raise RuntimeError(_closed_while_waiting(self, key, waited=waited))

    async def _contend_counted(
        self, request: _Request, token: str, deadline: Deadline
    ) -> AsyncLease:
        notifies = self._store.capabilities.notifies
        waiting = _Waiting(await self._store.waiter(request.key)) if notifies else None
        at_store, backoff = _pacing(self._store)
        outcome = None
        try:
            while True:
                sent_at = _clock.monotonic()
                outcome = await self._try(request, token, waiting)
                if outcome.ok:
                    break
                if deadline.passed():
                    raise Locked(request.key, outcome.holder)
                if waiting is None:
                    waiting = _Waiting(await self._store.waiter(request.key))
                    at_store, backoff = _pacing(self._store)
                    if self._store.capabilities.notifies:
                        continue  # _looked_again_at_once
                await waiting.waiter.wait(
                    park_time(deadline, outcome.remaining, backoff, at_store=at_store)
                )
                if self._closed:
                    raise RuntimeError(_closed_while_waiting(self, request.key))
        finally:
            if waiting is not None:
                try:
                    if waiting.closed:  # by the granted step: nothing left to wait for
                        waiting.raise_close_error()
                    else:
                        with _quiet_if(self._closed):  # closed client: best effort
                            await _to_the_end(waiting.waiter.aclose())
                except asyncio.CancelledError:
                    if outcome is not None and outcome.ok:  # cancelled with the key in hand
                        self._give_back(request.key, token)
                    raise
        await self._unless_closed(request.key, token, waited=True)
        return self._granted(request, token, outcome, sent_at)

    async def _try(self, request: _Request, token: str, waiting: _Waiting | None) -> Outcome:
        reply, step = _shielded(self._step(request, token, waiting))
        try:
            return await reply
        except asyncio.CancelledError:
            # The step may still grant the key: give it back once it has.
            step.add_done_callback(functools.partial(self._undo_grant, request.key, token))
            # And it may still queue the waiter: let it finish before the caller's
            # cleanup leaves the queue, or a release could hand the key to nobody.
            # Further cancellations wait too; the first one goes on afterwards.
            while not step.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([step])
            raise

    async def _step(self, request: _Request, token: str, waiting: _Waiting | None) -> Outcome:
        """One try at the store; once granted, the waiter is closed here too.

        Closing it in the step, which ``_try`` runs in a task of its own to shield it
        from cancellation, spares ``_contend`` a second shielded task for the close.
        """
        outcome = await self._store.try_acquire(
            request.key,
            token=token,
            ttl=request.ttl,
            owner=self._config.owner_now() if request.owner is None else request.owner,
            info=request.info,
            steal=request.steal,
            waiter=None if waiting is None else waiting.waiter,
        )
        if outcome.ok and waiting is not None:
            await waiting.close_granted()
        return outcome

    def _undo_grant(self, key: str, token: str, step: asyncio.Future[Outcome | None]) -> None:
        if step.cancelled() or step.exception() is not None:
            return
        outcome = step.result()
        if outcome is not None and outcome.ok:
            self._give_back(key, token)

    def _give_back(self, key: str, token: str) -> None:
        """Release, in the background, a grant that a cancelled caller will never see.

        Called by an acquire still counted at the store; the release is counted too,
        so the store closes after it. Found in CI: counted only by the acquire, which
        then left, it could close the store under the release, whose Redis step, its
        connection closed, took a new one from the closed pool and left it open.
        """
        counted = self._at_store.enter(beside=True)
        task = asyncio.ensure_future(self._given_back(key, token, counted=counted))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _given_back(self, key: str, token: str, *, counted: bool) -> None:
        try:
            await self._release_quietly(key, token)
        finally:
            if counted:
                await self._at_store.__aexit__()

    async def _release_quietly(self, key: str, token: str) -> None:
        try:
            await self._store.release(key, token)
        except StoreError as exc:  # the lease will expire by its TTL
            _LOG.warning("could not give back %r (it expires by its TTL): %s", key, exc)

    def _granted(
        self, request: _Request, token: str, outcome: Outcome, sent_at: float
    ) -> AsyncLease:
        lease = AsyncLease(
            self,
            request.key,
            token,
            outcome,
            ttl=request.ttl,
            sent_at=sent_at,
            on_lost=request.on_lost,
        )
        lease._drawn = request.token is None
        if _dead_on_arrival(lease):
            self._give_back(request.key, token)
        self._leases[token] = lease
        if request.renew:
            try:
                self._renewer.add(lease)
            except RuntimeError:  # closed while the grant was on its way: give it back
                self._give_back(request.key, token)
                raise
        return lease

    async def _holder_if_known(self, key: str) -> Holder | None:
        try:
            return await self._store.holder(key)
        except StoreError:
            return None

    def _lost(self, lease: AsyncLease, holder: Holder | None) -> LockLost:
        if lease._mark_lost(holder):
            self._renewer.call_on_lost(lease)
        return LockLost(lease.key, lease._new_holder if holder is None else holder)

    async def _gone(self, lease: AsyncLease) -> LockLost:
        """As ``Locks._gone``."""
        holder = lease._new_holder
        if holder is None:
            current = await self._holder_if_known(lease.key)
            if current is not None and current.fence == lease.fence and lease._drawn:
                await self._release_quietly(lease.key, lease.token)
                return LockLost(lease.key, None, _RAN_OUT.format(key=lease.key))
            holder = _after_loss(lease, current)
        return LockLost(lease.key, holder)

    async def _renew_lease(self, lease: AsyncLease, ttl: float | None) -> None:
        ttl = lease._ttl if ttl is None else self._config.check_ttl(ttl)
        lease._check_process()
        async with self._at_store:
            await self._raise_if_ended(lease)  # as in Locks._renew_lease
            async with lease._renewing:
                await self._raise_if_ended(lease)
                if lease.remaining <= 0:  # as in Locks._renew_lease
                    outcome = await self._store.release(lease.key, lease.token)
                    outcome = Outcome(False, None if outcome.ok else outcome.holder)
                else:
                    sent_at = _clock.monotonic()
                    outcome = await self._store.renew(lease.key, lease.token, ttl)
                    if outcome.ok and _renewed_past_deadline(lease):  # as in Locks
                        await _release_quietly_async(self._store, lease)
                        outcome = Outcome(False)
                    elif outcome.ok:
                        lease._granted(outcome, sent_at, ttl)
                        self._renewer.renewed(lease, sent_at)  # maybe to a shorter TTL
                        return
            self._renewer.discard(lease)
            raise self._lost(lease, outcome.holder)

    async def _raise_if_ended(self, lease: AsyncLease) -> None:
        """As ``Locks._raise_if_ended``."""
        if lease._released:
            holder = await self._holder_if_known(lease.key)
            raise LockLost(lease.key, holder, f"lease on {lease.key!r} was already released")
        if lease._lost:
            raise await self._gone(lease)

    async def _release_lease(self, lease: AsyncLease) -> None:
        lease._check_process()
        async with self._at_store:
            self._renewer.discard(lease)
            await self._raise_if_ended(lease)
            async with lease._renewing:  # as in Locks._release_lease
                await self._raise_if_ended(lease)
                expired = lease.remaining <= 0  # by our own clock, before the store's says so
                try:
                    outcome = await self._store.release(lease.key, lease.token)
                except StoreError as exc:
                    _finish_later(self._give_backs, self._renewer, lease, exc)
                    raise
                if not outcome.ok or expired:
                    raise self._lost(lease, outcome.holder)
                lease._released = True

    async def _released(self, lease: AsyncLease) -> None:
        """``_release_lease``, in a task of its own: a caller cancelled meanwhile (on its
        way out of a block, or in ``await lease.release()``) stops waiting, but the
        release goes on, and ``aclose()`` waits for it (in ``_background``) before it
        closes the store. Cancelled with it, a release that had started left the key
        held for its TTL (PostgreSQL, etcd, the lock server: 1 cancellation in 10)."""
        await self._unstopped(self._release_lease(lease))

    async def _unstopped(self, work: Awaitable[R]) -> R:
        """Await ``work`` in a task that the caller's cancellation does not stop, and that
        ``aclose()`` waits for (``_background``)."""
        reply, task = _shielded(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return await reply

    async def _finish_lease(self, lease: AsyncLease, *, block_failed: bool) -> None:
        """Leave an ``async with`` block: release, and report a loss unless it raised."""
        if lease._released:
            return
        try:
            await self._released(lease)
        except (LockError, RuntimeError):  # RuntimeError: closed before the block ended
            if not block_failed:
                raise

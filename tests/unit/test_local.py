"""KeyedLock and AsyncKeyedLock: exclusion, FIFO hand-off, timeouts, and no leftovers.

Every behaviour is checked through both ways of using a lock — the context manager
(``with kl(key):``) and ``acquire``/``release`` — because the context managers inline
their own fast paths. ``len(lock) == 0`` at the end of a test means no entry leaked.
Nothing here asserts how long anything took; timing is for ``benchmarks/``.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import math
import os
import random
import signal
import sys
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    ExitStack,
    asynccontextmanager,
    contextmanager,
)
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keymutex import AsyncKeyedLock, KeyedLock, Locked

# How long a test polls for a state that other threads reach, before it fails.
PATIENCE = 10.0

Hold = Callable[..., AbstractContextManager[None]]
AsyncHold = Callable[..., AbstractAsyncContextManager[None]]


class NotAcquired(Exception):
    """``acquire`` returned False in the acquire/release form of a test."""


@contextmanager
def hold_with_methods(
    kl: KeyedLock, key: Hashable, timeout: float | None = None
) -> Iterator[None]:
    if not kl.acquire(key, timeout=timeout):
        raise NotAcquired(key)
    try:
        yield
    finally:
        kl.release(key)


def hold_with_context(kl: KeyedLock, key: Hashable, timeout: float | None = None) -> Any:
    return kl(key, timeout=timeout)


@asynccontextmanager
async def ahold_with_methods(
    akl: AsyncKeyedLock, key: Hashable, timeout: float | None = None
) -> AsyncIterator[None]:
    if not await akl.acquire(key, timeout=timeout):
        raise NotAcquired(key)
    try:
        yield
    finally:
        akl.release(key)


def ahold_with_context(akl: AsyncKeyedLock, key: Hashable, timeout: float | None = None) -> Any:
    return akl(key, timeout=timeout)


REFUSED = (Locked, NotAcquired)


@pytest.fixture(params=["context", "methods"])
def hold(request: pytest.FixtureRequest) -> Hold:
    """``hold(kl, key, timeout)``: a context manager through one of the two forms."""
    return hold_with_context if request.param == "context" else hold_with_methods


@pytest.fixture(params=["context", "methods"])
def ahold(request: pytest.FixtureRequest) -> AsyncHold:
    """``ahold(akl, key, timeout)``: an async context manager through one of the two forms."""
    return ahold_with_context if request.param == "context" else ahold_with_methods


def wait_until(condition: Callable[[], bool]) -> None:
    """Poll until ``condition()`` holds; fail the test after ``PATIENCE`` seconds."""
    deadline = time.monotonic() + PATIENCE
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached")
        time.sleep(0.001)


async def settle(rounds: int = 5) -> None:
    """Let every ready task run a few steps."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def start_thread(target: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def join_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(PATIENCE)
        assert not thread.is_alive(), "a thread is still blocked"


# --------------------------------------------------------------------------- threads


def test_threads_exclusion_read_modify_write(hold: Hold) -> None:
    kl = KeyedLock()
    keys = ["a", "b", "c"]
    counters = dict.fromkeys(keys, 0)
    inside: dict[str, int] = dict.fromkeys(keys, 0)
    overlaps: list[str] = []
    per_thread = 300

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(per_thread):
            key = rng.choice(keys)
            with hold(kl, key):
                inside[key] += 1
                if inside[key] != 1:
                    overlaps.append(key)
                value = counters[key]
                time.sleep(0)  # invite another thread in between read and write
                counters[key] = value + 1
                inside[key] -= 1

    threads = [start_thread(functools.partial(work, seed)) for seed in range(8)]
    join_all(threads)
    assert overlaps == []
    assert sum(counters.values()) == 8 * per_thread
    assert len(kl) == 0


def test_threads_exclusion_under_constant_preemption(hold: Hold) -> None:
    # A tiny switch interval makes threads lose the GIL everywhere, also inside the
    # lock's own bookkeeping: its guard is then contended all the time.
    kl = KeyedLock()
    keys = ["a", "b", "c", "d"]
    counters = dict.fromkeys(keys, 0)
    inside = dict.fromkeys(keys, 0)
    overlaps: list[str] = []
    per_thread = 2000

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(per_thread):
            key = rng.choice(keys)
            with hold(kl, key):
                inside[key] += 1
                if inside[key] != 1:
                    overlaps.append(key)
                value = counters[key]
                abs(value)  # a call: a point where the GIL can change hands
                counters[key] = value + 1
                inside[key] -= 1

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        join_all([start_thread(functools.partial(work, seed)) for seed in range(8)])
    finally:
        sys.setswitchinterval(previous)
    assert overlaps == []
    assert sum(counters.values()) == 8 * per_thread
    assert len(kl) == 0


def test_threads_fifo_and_direct_hand_off(hold: Hold) -> None:
    kl = KeyedLock()
    order: list[int] = []
    kl.acquire("k")

    def waiter(index: int) -> None:
        with hold(kl, "k"):
            order.append(index)

    threads = []
    for index in range(6):
        threads.append(start_thread(functools.partial(waiter, index)))
        wait_until(lambda: kl._waiting("k") == len(threads))
    kl.release("k")
    # The key went straight to the first waiter: the releaser cannot take it back.
    assert not kl.acquire("k", timeout=0)
    join_all(threads)
    assert order == list(range(6))
    assert len(kl) == 0


def test_threads_releaser_that_reacquires_queues_behind_waiters() -> None:
    kl = KeyedLock()
    order: list[str] = []
    kl.acquire("k")

    def other() -> None:
        with kl("k"):
            order.append("other")

    thread = start_thread(other)
    wait_until(lambda: kl._waiting("k") == 1)
    kl.release("k")
    with kl("k"):  # queues behind "other", which was waiting first
        order.append("releaser")
    join_all([thread])
    assert order == ["other", "releaser"]
    assert len(kl) == 0


def test_threads_timeout_refuses_and_leaves_no_waiter(hold: Hold) -> None:
    kl = KeyedLock()
    kl.acquire("k")
    with pytest.raises(REFUSED), hold(kl, "k", 0.02):
        pytest.fail("acquired a held key")
    assert kl._waiting("k") == 0
    assert not kl.acquire("k", timeout=0)
    assert len(kl) == 1
    kl.release("k")
    assert len(kl) == 0


def test_threads_locked_error_names_the_key() -> None:
    kl = KeyedLock()
    kl.acquire(("user", 42))
    with pytest.raises(Locked, match="in-process") as caught, kl(("user", 42), timeout=0):
        pass
    key: object = caught.value.key  # any hashable, though typed ``str`` for stores
    assert key == ("user", 42)
    assert caught.value.holder is None
    with pytest.raises(Locked, match="after waiting"), kl(("user", 42), timeout=0.01):
        pass
    kl.release(("user", 42))
    assert len(kl) == 0


def test_threads_waiter_with_timeout_gets_the_key_when_released_in_time() -> None:
    kl = KeyedLock()
    kl.acquire("k")
    results: list[bool] = []
    thread = start_thread(lambda: results.append(kl.acquire("k", timeout=PATIENCE)))
    wait_until(lambda: kl._waiting("k") == 1)
    kl.release("k")
    join_all([thread])
    assert results == [True]
    assert kl.locked("k")
    kl.release("k")
    assert len(kl) == 0


def test_threads_many_short_timeouts_leave_nothing_behind() -> None:
    kl = KeyedLock()
    granted = [0]
    tally = threading.Lock()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(200):
            key = rng.choice("ab")
            if kl.acquire(key, timeout=rng.choice([0, 0.0001, 0.001, None])):
                with tally:
                    granted[0] += 1
                time.sleep(0)
                kl.release(key)

    join_all([start_thread(functools.partial(work, seed)) for seed in range(8)])
    assert granted[0] > 0
    assert len(kl) == 0


def test_threads_release_not_held() -> None:
    kl = KeyedLock()
    with pytest.raises(RuntimeError, match="not held"):
        kl.release("k")
    kl.acquire("k")
    kl.release("k")
    with pytest.raises(RuntimeError, match="not held"):
        kl.release("k")
    assert len(kl) == 0


def test_threads_release_from_another_thread() -> None:
    kl = KeyedLock()
    kl.acquire("k")
    join_all([start_thread(lambda: kl.release("k"))])
    assert not kl.locked("k")
    assert len(kl) == 0


def test_threads_exception_in_body_releases(hold: Hold) -> None:
    kl = KeyedLock()
    with pytest.raises(ZeroDivisionError), hold(kl, "k"):
        1 / 0  # noqa: B018 - the error is the point
    assert len(kl) == 0


def test_threads_different_keys_do_not_block(hold: Hold) -> None:
    kl = KeyedLock()
    with hold(kl, "a"), hold(kl, "b", 0), hold(kl, 1, 0), hold(kl, ("a",), 0):
        assert len(kl) == 4
        assert kl.locked("a")
        assert not kl.locked("c")
    assert len(kl) == 0


def test_threads_not_reentrant(hold: Hold) -> None:
    kl = KeyedLock()
    with hold(kl, "k"):
        assert not kl.acquire("k", timeout=0)
        assert not kl.acquire("k", timeout=0.01)
        with pytest.raises(REFUSED), hold(kl, "k", 0.01):
            pass
    assert len(kl) == 0


class _Interrupted(Exception):
    pass


@contextmanager
def _signalled_soon(handler: Callable[[int, object], None]) -> Iterator[None]:
    """``handler`` runs in the main thread (where Python runs signal handlers) 50 ms
    from now, while the block waits."""
    if not hasattr(signal, "pthread_kill"):  # pragma: no cover - Windows
        pytest.skip("needs POSIX signals")
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("Python runs signal handlers in the main thread only")
    previous = signal.signal(signal.SIGUSR1, handler)
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(0.05, signal.pthread_kill, (main, signal.SIGUSR1))
    try:
        timer.start()
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)


def test_threads_interrupted_wait_leaves_no_trace() -> None:
    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    kl = KeyedLock()
    kl.acquire("k")
    with _signalled_soon(interrupt), pytest.raises(_Interrupted):
        kl.acquire("k")  # waits for itself until the signal arrives
    assert kl._waiting("k") == 0
    kl.release("k")
    assert len(kl) == 0


@pytest.mark.parametrize("how", ["acquire", "with"])
def test_threads_interrupt_as_the_key_is_handed_over_passes_it_on(how: str) -> None:
    """Found by a mutation audit: the only interrupted wait above is handed nothing;
    with the pass-on removed (``_park``'s ``self.release``) the suite passed, and such
    an interrupt left the key held by nobody, for ever. The interleaving is exact: the
    signal handler itself releases the key (handing it to the waiting main thread),
    then raises."""
    kl = KeyedLock()
    kl.acquire("k")
    handed: list[bool] = []

    def hand_over_then_interrupt(signum: int, frame: object) -> None:
        kl.release("k")  # the holder lets go: the key is the waiting main thread's
        handed.append(kl.locked("k") and kl._waiting("k") == 0)
        raise _Interrupted

    wait = (lambda: kl.acquire("k")) if how == "acquire" else kl("k").__enter__
    with _signalled_soon(hand_over_then_interrupt), pytest.raises(_Interrupted):
        wait()
    assert handed == [True], "the key was not handed to the waiter"
    assert not kl.locked("k"), "the interrupted waiter kept the key it was handed"
    assert len(kl) == 0
    assert kl.acquire("k", timeout=0)
    kl.release("k")


@pytest.mark.parametrize("how", ["acquire", "with"])
def test_threads_a_timeout_beyond_timeout_max_waits_for_the_key(how: str) -> None:
    """A finite timeout past ``threading.TIMEOUT_MAX`` (about 292 years) waits: a
    mutation audit found the cap in ``_park`` untested (``OverflowError`` without it)."""
    timeout = threading.TIMEOUT_MAX * 100
    kl = KeyedLock()
    kl.acquire("k")
    got: list[object] = []

    def wait() -> None:
        try:
            if how == "acquire":
                got.append(kl.acquire("k", timeout=timeout))
                kl.release("k")
            else:
                with kl("k", timeout=timeout):
                    got.append(True)
        except BaseException as exc:
            got.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    while kl._waiting("k") == 0 and waiter.is_alive():
        time.sleep(0.005)
    kl.release("k")
    waiter.join(10)
    assert got == [True]
    assert len(kl) == 0


class _Interrupt(BaseException):
    """What a signal handler may raise (as KeyboardInterrupt is)."""


@contextmanager
def _at_c_return(number: int, handler: Callable[[], None]) -> Iterator[None]:
    """In the block, ``handler`` runs in this thread as the ``number``-th call of a C
    function returns: where Python runs a signal handler (a profile function at
    ``c_return``; what it raises replaces the call's result)."""
    seen = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal seen
        if event == "c_return":
            seen += 1
            if seen == number:
                handler()

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


def _raise_interrupt() -> None:
    raise _Interrupt


def _interrupted_after_c_call(number: int, action: Callable[[], object]) -> bool:
    """Run ``action``, with ``_Interrupt`` raised as its ``number``-th C call returns.
    ``True`` if it was."""
    try:
        with _at_c_return(number, _raise_interrupt):
            action()
    except _Interrupt:
        return True
    return False
    return False


def _usable(kl: KeyedLock) -> bool:
    """Whether a call on another key of ``kl`` completes (it hung for good when an
    interrupt left the table's guard taken)."""
    done = threading.Event()

    def other_key() -> None:
        if kl.acquire("other", timeout=0):
            kl.release("other")
        done.set()

    threading.Thread(target=other_key, daemon=True).start()
    return done.wait(5)


THREAD_STEPS: list[tuple[str, Callable[[KeyedLock], None], Callable[[KeyedLock], object]]] = [
    ("acquire", lambda kl: None, lambda kl: kl.acquire("k")),
    ("release", lambda kl: kl.acquire("k") and None, lambda kl: kl.release("k")),
    ("with", lambda kl: None, lambda kl: kl("k").__enter__()),
    ("exit", lambda kl: kl("k").__enter__(), lambda kl: kl("k").__exit__(None, None, None)),
    ("locked", lambda kl: None, lambda kl: kl.locked("k")),
]


@pytest.mark.parametrize(
    ("setup", "step"), [pytest.param(s, t, id=name) for name, s, t in THREAD_STEPS]
)
def test_threads_an_interrupt_after_any_call_never_leaves_the_table_stuck(
    setup: Callable[[KeyedLock], None], step: Callable[[KeyedLock], object]
) -> None:
    """Found by review: a ``KeyboardInterrupt`` (or a signal handler's ``SystemExit``)
    raised just after the guard was taken and before the ``try`` that gives it back
    left it taken: every later call on every key of that ``KeyedLock`` hung,
    ``timeout=0`` included. Here the interrupt comes after each C call of the step in
    turn. The key itself may be left held (as with any lock written in Python); the
    table must stay usable."""
    number = 1
    while True:
        kl = KeyedLock()
        setup(kl)
        if not _interrupted_after_c_call(number, functools.partial(step, kl)):
            break  # the step made fewer C calls: every one was tried
        assert _usable(kl), f"the table hung after an interrupt at C call {number}"
        number += 1
    assert number > 1, "the step made no C call"


def _acquire_called_into_at(number: int) -> tuple[KeyedLock, dict[str, object], bool]:
    """``kl.acquire("k", timeout=0)``, with the same call made again, in the same
    thread, at the return of its ``number``-th C call (by a profile function: as a
    signal handler would). In a thread of its own: whether that thread hung."""
    kl = KeyedLock()
    outcome: dict[str, object] = {}

    def inner() -> None:
        try:
            outcome["inner"] = kl.acquire("k", timeout=0)
        except RuntimeError as exc:
            outcome["inner"] = exc

    def run() -> None:
        with _at_c_return(number, inner):
            outcome["outer"] = kl.acquire("k", timeout=0)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(5)
    return kl, outcome, worker.is_alive()


def test_threads_a_call_from_a_handler_that_interrupted_a_section_is_refused() -> None:
    """A signal handler that calls into the KeyedLock whose section it interrupted
    (here at each C call's return in turn): refused with ``RuntimeError``, never both
    calls holding the key (the guard is reentrant), never hung (as with a plain
    lock)."""
    number = 1
    while True:
        kl, outcome, hung = _acquire_called_into_at(number)
        assert not hung, f"hung: a call from C call {number} of acquire"
        if "inner" not in outcome:
            break  # acquire made fewer C calls: every one was tried
        granted = [outcome["outer"], outcome["inner"]].count(True)
        assert granted <= 1, f"two holders of one key (a call from C call {number})"
        assert granted == len(kl), outcome
        number += 1
    assert number > 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_threads_a_child_forked_while_threads_use_the_table_can_use_it() -> None:
    """Found by review: a child forked while another thread held the table's guard got
    it taken for good, and even ``acquire(key, timeout=0)`` on a key nobody held hung
    (31 children in 60). The keys other threads held at the fork stay held in the
    child (by threads it does not have); its own keys work."""
    kl = KeyedLock()
    stop = threading.Event()

    def churn(worker: int) -> None:
        number = 0
        while not stop.is_set():
            with kl((worker, number)):
                number += 1

    workers = [threading.Thread(target=churn, args=(n,), daemon=True) for n in range(3)]
    for worker in workers:
        worker.start()
    try:
        for _ in range(30):
            child = os.fork()
            if child == 0:  # pragma: no cover - the child's status says what happened
                code = 0 if kl.acquire("fresh", timeout=0) else 1
                kl.release("fresh")
                os._exit(code)
            deadline = time.monotonic() + 10
            while (done := os.waitpid(child, os.WNOHANG))[0] == 0:
                if time.monotonic() > deadline:
                    os.kill(child, signal.SIGKILL)
                    os.waitpid(child, 0)
                    pytest.fail("a forked child's acquire(timeout=0) hung")
                time.sleep(0.005)
            assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    assert len(kl) == 0


def test_async_a_waiter_left_in_a_closed_event_loop_is_skipped() -> None:
    """An event loop closed with a task still waiting in it (as some runners do); the
    key released from another loop. Before: the release raised ``RuntimeError: Event
    loop is closed`` and the key stayed held by a task that would never run."""
    akl = AsyncKeyedLock()

    async def wait_for_it() -> None:
        async with akl("k"):
            pass  # pragma: no cover - never granted: its loop is closed first

    first = asyncio.new_event_loop()
    first.run_until_complete(akl.acquire("k"))
    stranded = first.create_task(wait_for_it())
    first.run_until_complete(asyncio.sleep(0.01))
    assert akl._waiting("k") == 1
    first.close()

    async def release_and_take() -> bool:
        akl.release("k")
        return await akl.acquire("k", timeout=0)

    assert asyncio.run(release_and_take())
    akl.release("k")
    assert len(akl) == 0
    stranded.get_coro().close()  # as the garbage collector would: it had not the key
    assert len(akl) == 0
    stranded._log_destroy_pending = False  # type: ignore[attr-defined]


BAD_TIMEOUTS = [
    (-1, ValueError),
    (-0.001, ValueError),
    (math.nan, ValueError),
    (math.inf, ValueError),
    (True, TypeError),
    ("1", TypeError),
]


@pytest.mark.parametrize(("timeout", "error"), BAD_TIMEOUTS)
def test_threads_bad_timeout(timeout: object, error: type[Exception]) -> None:
    kl = KeyedLock()
    with pytest.raises(error, match="timeout"):
        kl.acquire("k", timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(error, match="timeout"):
        kl("k", timeout=timeout)  # type: ignore[arg-type]
    assert len(kl) == 0


def test_threads_unhashable_key() -> None:
    kl = KeyedLock()
    key: Any = ["not", "hashable"]
    with pytest.raises(TypeError, match="hashable"):
        kl.acquire(key)
    with pytest.raises(TypeError, match="hashable"), kl(key):
        pass
    with pytest.raises(TypeError, match="hashable"):
        kl.release(key)
    with pytest.raises(TypeError, match="hashable"):
        kl.locked(key)
    assert len(kl) == 0


def test_threads_key_whose_eq_raises_keeps_its_error() -> None:
    class Grumpy:
        def __hash__(self) -> int:
            return 1

        def __eq__(self, other: object) -> bool:
            raise TypeError("no comparisons today")

    kl = KeyedLock()
    kl.acquire(Grumpy())
    with pytest.raises(TypeError, match="no comparisons today"):
        kl.acquire(Grumpy(), timeout=0)


def test_threads_repr_and_len() -> None:
    kl = KeyedLock()
    kl.acquire("a")
    kl.acquire("b")
    assert len(kl) == 2
    assert "keys=2" in repr(kl)
    kl.release("a")
    kl.release("b")
    assert len(kl) == 0


def test_threads_context_manager_can_be_reused() -> None:
    kl = KeyedLock()
    guard = kl("k")
    for _ in range(3):
        with guard:
            assert kl.locked("k")
        assert not kl.locked("k")


@pytest.mark.parametrize("how", ["acquire", "with"])
def test_threads_burst_of_keys_leaves_no_memory(how: str) -> None:
    """Both ways: ``with``'s exit repeats ``release``'s fast path, and a mutation audit
    found that copy's ``clear()`` untested (a 20,000-key burst kept ~1 MB)."""
    kl = KeyedLock()
    keys = [f"key:{index}" for index in range(20_000)]
    kl.acquire("warm-up")
    kl.release("warm-up")
    holds = [kl(key) for key in keys]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        if how == "acquire":
            for key in keys:
                kl.acquire(key)
            for key in keys:
                kl.release(key)
        else:
            with ExitStack() as stack:
                for hold in holds:
                    stack.enter_context(hold)
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(kl) == 0
    assert retained < 10_000  # the table of 20,000 entries alone is ~1 MB


# --------------------------------------------------------------------------- asyncio


@pytest.mark.asyncio
async def test_async_exclusion_read_modify_write(ahold: AsyncHold) -> None:
    akl = AsyncKeyedLock()
    keys = ["a", "b", "c"]
    counters = dict.fromkeys(keys, 0)
    inside = dict.fromkeys(keys, 0)
    overlaps: list[str] = []

    async def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(50):
            key = rng.choice(keys)
            async with ahold(akl, key):
                inside[key] += 1
                if inside[key] != 1:
                    overlaps.append(key)
                value = counters[key]
                await asyncio.sleep(0)  # every other task runs in between
                counters[key] = value + 1
                inside[key] -= 1

    await asyncio.gather(*(work(seed) for seed in range(20)))
    assert overlaps == []
    assert sum(counters.values()) == 20 * 50
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_fifo_and_direct_hand_off(ahold: AsyncHold) -> None:
    akl = AsyncKeyedLock()
    order: list[int] = []
    await akl.acquire("k")

    async def waiter(index: int) -> None:
        async with ahold(akl, "k"):
            order.append(index)
            await asyncio.sleep(0)

    tasks = []
    for index in range(6):
        tasks.append(asyncio.create_task(waiter(index)))
        await settle()
        assert akl._waiting("k") == index + 1
    akl.release("k")
    # The key went straight to the first waiter: the releaser cannot take it back.
    assert not await akl.acquire("k", timeout=0)
    await asyncio.gather(*tasks)
    assert order == list(range(6))
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_releaser_that_reacquires_queues_behind_waiters(ahold: AsyncHold) -> None:
    akl = AsyncKeyedLock()
    order: list[str] = []

    async def worker(name: str) -> None:
        for _ in range(3):
            async with ahold(akl, "k"):
                order.append(name)
                await asyncio.sleep(0)

    await asyncio.gather(worker("a"), worker("b"))
    assert order == ["a", "b"] * 3  # strict alternation: no task overtakes a waiter
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_timeout_refuses_and_leaves_no_waiter(ahold: AsyncHold) -> None:
    akl = AsyncKeyedLock()
    await akl.acquire("k")
    with pytest.raises(REFUSED):
        async with ahold(akl, "k", 0.01):
            pytest.fail("acquired a held key")
    assert akl._waiting("k") == 0
    assert not await akl.acquire("k", timeout=0)
    assert len(akl) == 1
    akl.release("k")
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_locked_error_names_the_key() -> None:
    akl = AsyncKeyedLock()
    await akl.acquire(("user", 42))
    with pytest.raises(Locked, match="in-process") as caught:
        async with akl(("user", 42), timeout=0):
            pass
    key: object = caught.value.key  # any hashable, though typed ``str`` for stores
    assert key == ("user", 42)
    assert caught.value.holder is None
    with pytest.raises(Locked, match="after waiting"):
        async with akl(("user", 42), timeout=0.01):
            pass
    akl.release(("user", 42))
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_waiter_with_timeout_gets_the_key_when_released_in_time() -> None:
    akl = AsyncKeyedLock()
    await akl.acquire("k")
    task = asyncio.create_task(akl.acquire("k", timeout=PATIENCE))
    await settle()
    akl.release("k")
    assert await task
    assert akl.locked("k")
    akl.release("k")
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_timed_out_waiter_is_skipped_by_release() -> None:
    akl = AsyncKeyedLock()
    await akl.acquire("k")
    impatient = asyncio.create_task(akl.acquire("k", timeout=0.01))
    patient = asyncio.create_task(akl.acquire("k"))
    assert not await impatient
    akl.release("k")
    assert await patient
    akl.release("k")
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_release_not_held() -> None:
    akl = AsyncKeyedLock()
    with pytest.raises(RuntimeError, match="not held"):
        akl.release("k")
    await akl.acquire("k")
    akl.release("k")
    with pytest.raises(RuntimeError, match="not held"):
        akl.release("k")
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_release_from_another_task() -> None:
    akl = AsyncKeyedLock()
    await akl.acquire("k")

    async def release() -> None:
        akl.release("k")

    await asyncio.create_task(release())
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_exception_in_body_releases(ahold: AsyncHold) -> None:
    akl = AsyncKeyedLock()
    with pytest.raises(ZeroDivisionError):
        async with ahold(akl, "k"):
            1 / 0  # noqa: B018 - the error is the point
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_different_keys_do_not_block(ahold: AsyncHold) -> None:
    akl = AsyncKeyedLock()
    async with ahold(akl, "a"), ahold(akl, "b", 0), ahold(akl, 1, 0), ahold(akl, ("a",), 0):
        assert len(akl) == 4
        assert akl.locked("a")
        assert not akl.locked("c")
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_not_reentrant(ahold: AsyncHold) -> None:
    akl = AsyncKeyedLock()
    async with ahold(akl, "k"):
        assert not await akl.acquire("k", timeout=0)
        assert not await akl.acquire("k", timeout=0.01)
        with pytest.raises(REFUSED):
            async with ahold(akl, "k", 0.01):
                pass
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_cancel_while_waiting(ahold: AsyncHold) -> None:
    akl = AsyncKeyedLock()
    order: list[int] = []
    await akl.acquire("k")

    async def waiter(index: int) -> None:
        async with ahold(akl, "k"):
            order.append(index)

    tasks = [asyncio.create_task(waiter(index)) for index in range(6)]
    await settle()
    for index in (0, 2, 3):
        tasks[index].cancel()
    await settle()
    assert akl._waiting("k") == 3
    akl.release("k")
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert [isinstance(result, asyncio.CancelledError) for result in results] == [
        True,
        False,
        True,
        True,
        False,
        False,
    ]
    assert order == [1, 4, 5]
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_cancel_of_every_waiter_frees_the_key_on_release() -> None:
    akl = AsyncKeyedLock()
    await akl.acquire("k")
    tasks = [asyncio.create_task(akl.acquire("k")) for _ in range(3)]
    await settle()
    for task in tasks:
        task.cancel()
    akl.release("k")  # the waiters are cancelled but have not run yet
    assert len(akl) == 0
    await asyncio.gather(*tasks, return_exceptions=True)
    assert len(akl) == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("followers", [0, 2])
async def test_async_cancel_during_hand_off_passes_the_key_on(
    ahold: AsyncHold, followers: int
) -> None:
    akl = AsyncKeyedLock()
    got: list[str] = []
    await akl.acquire("k")

    async def waiter(name: str) -> None:
        async with ahold(akl, "k"):
            got.append(name)

    first = asyncio.create_task(waiter("first"))
    await settle()
    rest = [asyncio.create_task(waiter(f"follower {n}")) for n in range(followers)]
    await settle()
    akl.release("k")  # hands the key to ``first`` ...
    first.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.gather(*rest)
    assert got == [f"follower {n}" for n in range(followers)]
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_cancel_while_holding_releases(ahold: AsyncHold) -> None:
    akl = AsyncKeyedLock()
    entered = asyncio.Event()

    async def holder() -> None:
        async with ahold(akl, "k"):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(holder())
    await entered.wait()
    follower = asyncio.create_task(akl.acquire("k"))
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await follower  # the cancelled holder handed the key on
    akl.release("k")
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_timeout_around_acquire_leaves_no_trace() -> None:
    akl = AsyncKeyedLock()
    await akl.acquire("k")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await akl.acquire("k")
    assert akl._waiting("k") == 0
    akl.release("k")
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_closed_waiting_coroutine_leaves_no_trace() -> None:
    akl = AsyncKeyedLock()
    await akl.acquire("k")
    coroutine = akl.acquire("k", timeout=PATIENCE)
    coroutine.send(None)  # runs up to the wait, as a task's first step would
    coroutine.close()  # e.g. the task was garbage-collected while waiting
    assert akl._waiting("k") == 0
    akl.release("k")
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_acquire_of_a_free_key_does_not_yield() -> None:
    akl = AsyncKeyedLock()
    coroutine = akl.acquire("k")
    with pytest.raises(StopIteration) as done:
        coroutine.send(None)
    assert done.value.value is True
    enter = akl("other").__aenter__()
    with pytest.raises(StopIteration):
        enter.send(None)
    akl.release("k")
    akl.release("other")
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_timeout_zero_tries_once_without_yielding() -> None:
    akl = AsyncKeyedLock()
    await akl.acquire("k")
    coroutine = akl.acquire("k", timeout=0)
    with pytest.raises(StopIteration) as done:
        coroutine.send(None)
    assert done.value.value is False
    enter = akl("k", timeout=0).__aenter__()
    with pytest.raises(Locked):
        enter.send(None)
    assert akl._waiting("k") == 0
    akl.release("k")
    assert len(akl) == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(("timeout", "error"), BAD_TIMEOUTS)
async def test_async_bad_timeout(timeout: object, error: type[Exception]) -> None:
    akl = AsyncKeyedLock()
    with pytest.raises(error, match="timeout"):
        await akl.acquire("k", timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(error, match="timeout"):
        akl("k", timeout=timeout)  # type: ignore[arg-type]
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_unhashable_key() -> None:
    akl = AsyncKeyedLock()
    key: Any = {"not": "hashable"}
    with pytest.raises(TypeError, match="hashable"):
        await akl.acquire(key)
    with pytest.raises(TypeError, match="hashable"):
        async with akl(key):
            pass
    with pytest.raises(TypeError, match="hashable"):
        akl.release(key)
    with pytest.raises(TypeError, match="hashable"):
        akl.locked(key)
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_repr_and_reuse() -> None:
    akl = AsyncKeyedLock()
    guard = akl("k")
    for _ in range(3):
        async with guard:
            assert "keys=1" in repr(akl)
        assert not akl.locked("k")
    assert len(akl) == 0


@pytest.mark.asyncio
async def test_async_burst_of_keys_leaves_no_memory() -> None:
    akl = AsyncKeyedLock()
    keys = [f"key:{index}" for index in range(20_000)]
    await akl.acquire("warm-up")
    akl.release("warm-up")
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for key in keys:
            await akl.acquire(key)
        for key in keys:
            akl.release(key)
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(akl) == 0
    assert retained < 10_000  # the table of 20,000 entries alone is ~1 MB


@pytest.mark.asyncio
async def test_async_granted_waiters_leave_no_timers_behind() -> None:
    akl = AsyncKeyedLock()

    async def one_round() -> None:
        await akl.acquire("k")
        tasks = [asyncio.create_task(akl.acquire("k", timeout=PATIENCE)) for _ in range(2000)]
        await settle()
        akl.release("k")
        for task in tasks:
            assert await task
            akl.release("k")
        await settle()

    await one_round()  # warm-up
    gc.collect()
    # Only what keymutex's own code allocated counts: other tests' threads may allocate
    # meanwhile when the whole suite runs.
    ours = [tracemalloc.Filter(True, "*keymutex/_local.py", all_frames=True)]
    tracemalloc.start(16)
    try:
        before = tracemalloc.take_snapshot().filter_traces(ours)
        await one_round()
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(ours)
    finally:
        tracemalloc.stop()
    retained = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert len(akl) == 0
    # A timer still pending would keep its waiter (and more) alive for PATIENCE s.
    assert retained < 50_000


# A random schedule of tasks, each holding one of a few keys for a few steps, some
# with timeouts, some cancelled at a random step (while waiting, while holding, or at
# the very moment the key is handed to them).


@dataclass(frozen=True)
class Plan:
    key: int
    hold_steps: int
    timeout: float | None
    cancel_at: int | None
    context: bool


plans = st.lists(
    st.builds(
        Plan,
        key=st.integers(0, 2),
        hold_steps=st.integers(0, 3),
        timeout=st.sampled_from([None, None, 0, 0.0005]),
        cancel_at=st.none() | st.integers(0, 12),
        context=st.booleans(),
    ),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(plans)
def test_async_random_cancellations_keep_fifo_exclusion_and_leave_nothing(
    schedule: list[Plan],
) -> None:
    akl = AsyncKeyedLock()
    holders: dict[int, int] = {}
    overlaps: list[int] = []
    asked: list[int] = []  # task indexes, in the order they asked for their key
    granted: list[int] = []  # ... and in the order they got it

    async def run(index: int, plan: Plan) -> None:
        async def body() -> None:
            if plan.key in holders:
                overlaps.append(plan.key)
            holders[plan.key] = index
            granted.append(index)
            try:
                for _ in range(plan.hold_steps):
                    await asyncio.sleep(0)
            finally:
                del holders[plan.key]

        asked.append(index)  # nothing yields between here and joining the queue
        if plan.context:
            try:
                async with akl(plan.key, timeout=plan.timeout):
                    await body()
            except Locked:
                pass
        elif await akl.acquire(plan.key, timeout=plan.timeout):
            try:
                await body()
            finally:
                akl.release(plan.key)

    async def main() -> None:
        tasks = [asyncio.create_task(run(index, plan)) for index, plan in enumerate(schedule)]
        for step in range(14):
            for task, plan in zip(tasks, schedule, strict=True):
                if plan.cancel_at == step:
                    task.cancel()
            await asyncio.sleep(0)
        # A leaked key shows as a task that never ends. Only the 0.5 ms timeouts need
        # real time, so wait briefly rather than PATIENCE: hypothesis replays a failing
        # example many times while it shrinks it.
        for _ in range(100):
            _, pending = await asyncio.wait(tasks, timeout=0.002)
            if not pending:
                break
        stuck = [plan for task, plan in zip(tasks, schedule, strict=True) if not task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert stuck == []
        assert len(akl) == 0

    asyncio.run(main())
    assert overlaps == []
    assert holders == {}
    assert len(akl) == 0
    # First come, first served: per key, nobody was served before someone who asked
    # earlier and was served too (the others timed out or were cancelled).
    for key in {plan.key for plan in schedule}:
        served = [index for index in granted if schedule[index].key == key]
        assert served == [index for index in asked if index in served]


def test_async_lock_is_usable_from_successive_event_loops() -> None:
    akl = AsyncKeyedLock()

    async def contend() -> None:
        await asyncio.gather(*(akl.acquire("k", timeout=0) for _ in range(3)))
        waiter = asyncio.create_task(akl.acquire("k"))
        await settle()
        akl.release("k")
        assert await waiter
        akl.release("k")

    for _ in range(2):
        asyncio.run(contend())
    assert len(akl) == 0

"""Grants that landed after their acquire failed are given back (keymutex._giveback).

The memory store stands in for a server whose answer was lost: ``AnswerLost`` wraps it,
runs a try for real, and then raises ``StoreError`` as a client would whose reply never
came. (Against real servers: the Redis busy-script tests in test_redis_store.py, and
the safety suite's *acquire reply dropped* on every networked store.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
import uuid
from typing import Any

import pytest

import keymutex
from keymutex import _client, _giveback
from keymutex._giveback import _Plan
from keymutex._lease import Outcome
from keymutex._store import NotSent

GHOST_TTL = 600.0  # a grant nobody gives back would hold the key this long
WAIT = 10.0


@pytest.fixture
def namespace() -> str:
    return f"give-back-{uuid.uuid4().hex}"


class AnswerLost:
    """A store whose tries run, and whose answers are lost while ``lose`` is set (the
    caller gets ``StoreError``). Releases fail while ``down`` is set."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.lose = False
        self.unsent = False  # tries fail before they reach the store (NotSent)
        self.down = 0  # the next this many releases fail
        self.releases: list[tuple[str, str]] = []

    def try_acquire(self, key: str, **kwargs: Any) -> Outcome:
        if self.unsent:
            raise NotSent(f"try of {key!r}: no connection to send it on")
        outcome: Outcome = self._inner.try_acquire(key, **kwargs)
        if self.lose:
            raise keymutex.StoreError(
                f"try of {key!r}: the answer was lost (granted: {outcome.ok})"
            )
        return outcome

    def release(self, key: str, token: str) -> Outcome:
        self.releases.append((key, token))
        if self.down:
            self.down -= 1
            raise keymutex.StoreError(f"release of {key!r}: the store is out of reach")
        outcome: Outcome = self._inner.release(key, token)
        return outcome

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class AsyncAnswerLost(AnswerLost):
    async def try_acquire(self, key: str, **kwargs: Any) -> Outcome:  # type: ignore[override]
        if self.unsent:
            raise NotSent(f"try of {key!r}: no connection to send it on")
        outcome: Outcome = await self._inner.try_acquire(key, **kwargs)
        if self.lose:
            raise keymutex.StoreError(
                f"try of {key!r}: the answer was lost (granted: {outcome.ok})"
            )
        return outcome

    async def release(self, key: str, token: str) -> Outcome:  # type: ignore[override]
        self.releases.append((key, token))
        if self.down:
            self.down -= 1
            raise keymutex.StoreError(f"release of {key!r}: the store is out of reach")
        outcome: Outcome = await self._inner.release(key, token)
        return outcome


def _wait_until(predicate: Any, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.01)


async def _until(predicate: Any) -> None:
    while not predicate():  # noqa: ASYNC110 - a condition of a store wrapper's list
        await asyncio.sleep(0.01)


def losing(locks: keymutex.Locks) -> AnswerLost:
    store = AnswerLost(locks._store)
    locks._store = store  # type: ignore[assignment]
    locks._give_backs._release = store.release
    return store


def losing_async(locks: keymutex.AsyncLocks) -> AsyncAnswerLost:
    store = AsyncAnswerLost(locks._store)
    locks._store = store  # type: ignore[assignment]
    locks._give_backs._release = store.release
    return store


# -- the schedule ----------------------------------------------------------------------


def test_a_token_is_released_at_once_then_ever_more_rarely_until_its_ttl() -> None:
    plan = _Plan()
    plan.add("k", "t", 10.0, now=100.0)
    times = []
    now = 100.0
    while (step := plan.next_batch(now, closing=False)) is not None:
        if isinstance(step, float):
            now += step
            continue
        times.append(round(now - 100.0, 6))
        plan.again(step, now)  # not found
    assert times == [0.0, 0.1, 0.4, 1.3, 4.0, 10.0]


def test_closing_releases_every_token_once_more_at_once() -> None:
    plan = _Plan()
    plan.add("a", "1", 10.0, now=0.0)
    plan.add("b", "2", 10.0, now=0.0)
    first = plan.next_batch(0.0, closing=False)
    assert isinstance(first, list)
    plan.again(first, 0.0)
    assert plan.next_batch(0.0, closing=False) == pytest.approx(_giveback.FIRST_WAIT)
    last = plan.next_batch(0.0, closing=True)
    assert isinstance(last, list)
    assert sorted(token.key for token in last) == ["a", "b"]
    assert plan.next_batch(0.0, closing=True) is None


# -- Locks -----------------------------------------------------------------------------


def test_a_try_whose_answer_was_lost_is_given_back(namespace: str) -> None:
    with (
        keymutex.Locks(namespace=namespace) as failing,
        keymutex.Locks(namespace=namespace) as other,
    ):
        store = losing(failing)
        store.lose = True
        with pytest.raises(keymutex.StoreError, match="granted: True"):
            failing.acquire("k", ttl=GHOST_TTL, timeout=0)
        store.lose = False
        lease = other.acquire("k", timeout=WAIT)
        assert [key for key, _ in store.releases] == ["k"]
        lease.release()


def test_a_waiting_try_whose_answer_was_lost_is_given_back(namespace: str) -> None:
    with (
        keymutex.Locks(namespace=namespace) as holding,
        keymutex.Locks(namespace=namespace) as failing,
    ):
        store = losing(failing)
        lease = holding.acquire("k", timeout=0)
        refused = threading.Event()
        real_try = store.try_acquire

        def try_acquire(key: str, **kwargs: Any) -> Outcome:
            outcome = real_try(key, **kwargs)
            refused.set()
            return outcome

        store.try_acquire = try_acquire  # type: ignore[method-assign]
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                failing.acquire("k", ttl=GHOST_TTL, timeout=WAIT)
            except BaseException as exc:
                failed.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert refused.wait(WAIT)
        store.lose = True  # the try after the release
        lease.release()
        waiter.join(WAIT)
        assert not waiter.is_alive()
        assert len(failed) == 1, failed
        assert "granted: True" in str(failed[0])
        store.lose = False
        holding.acquire("k", timeout=WAIT).release()


def test_a_release_that_fails_is_tried_again_later(namespace: str) -> None:
    with (
        keymutex.Locks(namespace=namespace) as failing,
        keymutex.Locks(namespace=namespace) as other,
    ):
        store = losing(failing)
        store.lose, store.down = True, 2
        with pytest.raises(keymutex.StoreError):
            failing.acquire("k", ttl=GHOST_TTL, timeout=0)
        store.lose = False
        other.acquire("k", timeout=WAIT).release()
        assert len(store.releases) == 3  # at once, 0.1 s and 0.4 s later


def test_closing_gives_back_what_is_waiting(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The releases still to come are made at ``close()``: the store out of reach until
    then, the grant is gone once the client is closed."""
    monkeypatch.setattr(_giveback, "FIRST_WAIT", 600.0)  # no second try before close()
    with keymutex.Locks(namespace=namespace) as other:
        failing = keymutex.Locks(namespace=namespace)
        store = losing(failing)
        store.lose, store.down = True, 1
        with pytest.raises(keymutex.StoreError):
            failing.acquire("k", ttl=GHOST_TTL, timeout=0)
        _wait_until(lambda: len(store.releases) == 1)  # made at once, and failed
        assert other.holder("k") is not None
        failing.close()
        assert len(store.releases) == 2
        assert other.holder("k") is None


@pytest.mark.parametrize("timeout", [0, 0.2])
def test_a_try_that_never_reached_the_store_is_not_given_back(
    namespace: str, timeout: float
) -> None:
    """``NotSent``: no step with the token reached the store, so nothing was granted
    to it. A give-back would only wait for a store that is out of reach: found by
    review, ``keymutex run`` on a ZooKeeper that refused every connection waited its
    ``timeout`` once more for it before it could exit."""
    failing = keymutex.Locks(namespace=namespace)
    store = losing(failing)
    store.unsent = True
    with pytest.raises(NotSent, match="no connection"):
        failing.acquire("k", ttl=GHOST_TTL, timeout=timeout)
    failing.close()  # would have made the last round
    assert store.releases == []


@pytest.mark.asyncio
async def test_async_a_try_that_never_reached_the_store_is_not_given_back(
    namespace: str,
) -> None:
    failing = keymutex.AsyncLocks(namespace=namespace)
    store = losing_async(failing)
    store.unsent = True
    with pytest.raises(NotSent, match="no connection"):
        await failing.acquire("k", ttl=GHOST_TTL, timeout=0.2)
    await failing.aclose()
    assert store.releases == []


def test_a_token_the_caller_named_is_not_given_back(namespace: str) -> None:
    """The lock server passes its clients' tokens (``_Request.token``), and a client
    whose answer was lost asks again with its token, to be answered with the lease it
    holds: given back behind its back, that lease would be gone under it."""
    with keymutex.Locks(namespace=namespace) as other:
        failing = keymutex.Locks(namespace=namespace)
        store = losing(failing)
        store.lose = True
        plan = dataclasses.replace(
            failing._config.request("k", GHOST_TTL, 0, False, None, False, None),
            token="a-token-the-caller-named",
        )
        with pytest.raises(keymutex.StoreError):
            failing._acquire(plan)
        failing.close()  # would have made the last round
        assert store.releases == []
        assert other.holder("k") is not None
        other.release("k", "a-token-the-caller-named")


def test_a_forked_child_does_not_give_back_the_parents_tokens(namespace: str) -> None:
    with keymutex.Locks(namespace=namespace) as locks:
        store = losing(locks)
        store.lose, store.down = True, 10**6  # the parent's releases all fail
        with pytest.raises(keymutex.StoreError):
            locks.acquire("k", ttl=GHOST_TTL, timeout=0)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0 if not locks._give_backs._plan else 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        store.down = 0


# -- AsyncLocks ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_a_try_whose_answer_was_lost_is_given_back(namespace: str) -> None:
    async with (
        keymutex.AsyncLocks(namespace=namespace) as failing,
        keymutex.AsyncLocks(namespace=namespace) as other,
    ):
        store = losing_async(failing)
        store.lose = True
        with pytest.raises(keymutex.StoreError, match="granted: True"):
            await failing.acquire("k", ttl=GHOST_TTL, timeout=0)
        store.lose = False
        lease = await other.acquire("k", timeout=WAIT)
        assert [key for key, _ in store.releases] == ["k"]
        await lease.release()


@pytest.mark.asyncio
async def test_async_a_release_that_fails_is_tried_again_later(namespace: str) -> None:
    async with (
        keymutex.AsyncLocks(namespace=namespace) as failing,
        keymutex.AsyncLocks(namespace=namespace) as other,
    ):
        store = losing_async(failing)
        store.lose, store.down = True, 2
        with pytest.raises(keymutex.StoreError):
            await failing.acquire("k", ttl=GHOST_TTL, timeout=0)
        store.lose = False
        await (await other.acquire("k", timeout=WAIT)).release()
        assert len(store.releases) == 3


@pytest.mark.asyncio
async def test_async_closing_gives_back_what_is_waiting(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_giveback, "FIRST_WAIT", 600.0)
    # Found by review: aclose() waited out CALLBACK_GRACE (5 s: `keymutex run` on a
    # store that refused its connection took 5 s to exit 69) for the give-back task,
    # which made its last round only once that wait was over.
    monkeypatch.setattr(_client, "CALLBACK_GRACE", 600.0)
    async with keymutex.AsyncLocks(namespace=namespace) as other:
        failing = keymutex.AsyncLocks(namespace=namespace)
        store = losing_async(failing)
        store.lose, store.down = True, 1
        with pytest.raises(keymutex.StoreError):
            await failing.acquire("k", ttl=GHOST_TTL, timeout=0)
        await asyncio.wait_for(_until(lambda: len(store.releases) == 1), WAIT)
        assert await other.holder("k") is not None
        await asyncio.wait_for(failing.aclose(), WAIT)
        assert len(store.releases) == 2
        assert await other.holder("k") is None


@pytest.mark.asyncio
async def test_async_a_token_the_caller_named_is_not_given_back(namespace: str) -> None:
    async with keymutex.AsyncLocks(namespace=namespace) as other:
        failing = keymutex.AsyncLocks(namespace=namespace)
        store = losing_async(failing)
        store.lose = True
        plan = dataclasses.replace(
            failing._config.request("k", GHOST_TTL, 0, False, None, False, None),
            token="a-token-the-caller-named",
        )
        with pytest.raises(keymutex.StoreError):
            await failing._acquire(plan)
        await failing.aclose()
        assert store.releases == []
        assert await other.holder("k") is not None
        await other.release("k", "a-token-the-caller-named")


def test_an_async_client_used_by_one_event_loop_after_another_gives_back_in_each(
    namespace: str,
) -> None:
    """Found by review: the give-back task of a first ``asyncio.run`` ended with its
    loop, and later failures only rang it: nothing was given back, and ``aclose()``
    waited for a task of a closed loop (``RuntimeError: Event loop is closed``)."""
    failing = keymutex.AsyncLocks(namespace=namespace)
    store = losing_async(failing)
    other = keymutex.Locks(namespace=namespace)

    async def fail_once(key: str) -> None:
        store.lose, store.down = True, 1  # the first release fails: the next is 0.1 s on
        with pytest.raises(keymutex.StoreError):
            await failing.acquire(key, ttl=GHOST_TTL, timeout=0)
        store.lose = False
        await asyncio.wait_for(_until(lambda: store.down == 0), WAIT)

    async def given_back() -> None:
        while other.holder("k1") is not None or other.holder("k2") is not None:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    async def fail_again_and_wait() -> None:
        await fail_once("k2")
        await asyncio.wait_for(given_back(), WAIT)  # k2's ghost, and k1's left over

    asyncio.run(fail_once("k1"))  # its loop ends before the give-back could end
    asyncio.run(fail_again_and_wait())
    asyncio.run(failing.aclose())
    other.close()


def test_at_most_max_tokens_wait_to_be_given_back() -> None:
    plan = _Plan()
    for n in range(_giveback.MAX_TOKENS + 5):
        plan.add("k", str(n), 10.0, now=0.0)
    batch = plan.next_batch(0.0, closing=True)
    assert isinstance(batch, list)
    assert len(batch) == _giveback.MAX_TOKENS


@pytest.mark.asyncio
async def test_async_closing_waits_a_bounded_time_for_the_last_round(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_giveback, "JOIN_GRACE", 0.2)
    failing = keymutex.AsyncLocks(namespace=namespace)
    store = losing_async(failing)
    store.lose = True
    hang = asyncio.Event()
    real_release = store.release

    async def release(key: str, token: str) -> Outcome:
        if store.lose:
            await hang.wait()  # a store that does not answer
        return await real_release(key, token)

    failing._give_backs._release = release
    with pytest.raises(keymutex.StoreError):
        await failing.acquire("k", ttl=GHOST_TTL, timeout=0)
    await asyncio.wait_for(failing.aclose(), WAIT)  # returns after JOIN_GRACE
    store.lose = False
    hang.set()  # the store answers: the give-back ends, and closes the store


# -- releases whose outcome is unknown (found by review) -------------------------------
# A release that met a half-second outage raised StoreError, and nothing released the
# lease afterwards: the key stayed held to its TTL.


@pytest.mark.parametrize("how", ["lease.release", "with-block", "locks.release"])
def test_a_release_that_failed_goes_on_in_the_background(namespace: str, how: str) -> None:
    with keymutex.Locks(f"memory://{namespace}", ttl=GHOST_TTL) as locks:
        store = losing(locks)
        lease = locks.acquire("k")

        def with_block() -> None:
            with locks.lock("j"):
                pass

        release = {
            "lease.release": lease.release,
            "with-block": with_block,
            "locks.release": lambda: locks.release("k", lease.token),
        }[how]
        if how == "with-block":
            lease.release()
        store.down = 1  # the release meets the outage; the store is back at once
        with pytest.raises(keymutex.StoreError) as failed:
            release()
        assert any("in the background" in note for note in failed.value.__notes__)
        _wait_until(lambda: locks.holder("k") is None and locks.holder("j") is None)
        assert len(store.releases) >= 2  # the caller's, then the background's


def test_a_lease_whose_release_failed_is_neither_renewed_nor_lost(namespace: str) -> None:
    with keymutex.Locks(f"memory://{namespace}", ttl=0.3) as locks:
        lost: list[keymutex.Lease] = []
        lease = locks.acquire("k", renew=True, on_lost=lost.append)
        store = losing(locks)
        store.down = 10**6  # down for good: only the TTL frees the key
        with pytest.raises(keymutex.StoreError):
            lease.release()
        with pytest.raises(keymutex.LockLost, match="already released"):
            lease.renew()
        _wait_until(lambda: locks.holder("k") is None)  # by its TTL (0.3 s)
        time.sleep(0.5)
        assert lost == []
        assert not lease.lost


@pytest.mark.asyncio
async def test_an_async_release_that_failed_goes_on_in_the_background(namespace: str) -> None:
    async with keymutex.AsyncLocks(f"memory://{namespace}", ttl=GHOST_TTL) as locks:
        store = losing_async(locks)
        store.down = 1
        with pytest.raises(keymutex.StoreError):
            async with locks.lock("k"):
                pass
        async with asyncio.timeout(WAIT):
            while await locks.holder("k") is not None:  # noqa: ASYNC110 - the store's state
                await asyncio.sleep(0.01)

"""Acquire either answers at once or waits up to a timeout; refusals say who holds the key."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
import threading
import time
from collections.abc import Callable

import pytest

import keymutex

from ._support import (
    PATIENCE,
    assert_is_holder_of,
    assert_no_token,
    default_owner,
    start,
)

INFO = {"user": 42, "name": "Alice Ł", "email": "alice@example.com", "tags": ["a", 1, None]}
WAIT = 0.3


# --- timeout=0: try once ----------------------------------------------------------------


def test_timeout_zero_refuses_at_once_and_says_who_holds(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    holder = make_locks(owner="alice@example.com")
    lease = holder.acquire("doc", info=INFO)
    started = time.monotonic()
    with pytest.raises(keymutex.Locked) as refused:
        make_locks().acquire("doc", timeout=0)
    assert time.monotonic() - started < PATIENCE / 2
    assert refused.value.key == "doc"
    assert_is_holder_of(refused.value.holder, lease)
    assert refused.value.holder.owner == "alice@example.com"  # type: ignore[union-attr]
    assert refused.value.holder.info == INFO  # type: ignore[union-attr]
    assert abs(refused.value.holder.expires_at - lease.expires_at) < 1.0  # type: ignore[union-attr]
    assert_no_token(refused.value, lease.token)
    assert isinstance(refused.value, keymutex.LockError)
    # The refusal changed nothing.
    assert_is_holder_of(holder.holder("doc"), lease)
    lease.release()


@pytest.mark.asyncio
async def test_timeout_zero_refuses_at_once_and_says_who_holds_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    holder = make_alocks(owner="alice@example.com")
    lease = await holder.acquire("doc", info=INFO)
    started = time.monotonic()
    with pytest.raises(keymutex.Locked) as refused:
        await make_alocks().acquire("doc", timeout=0)
    assert time.monotonic() - started < PATIENCE / 2
    assert refused.value.key == "doc"
    assert_is_holder_of(refused.value.holder, lease)
    assert refused.value.holder.owner == "alice@example.com"  # type: ignore[union-attr]
    assert refused.value.holder.info == INFO  # type: ignore[union-attr]
    assert abs(refused.value.holder.expires_at - lease.expires_at) < 1.0  # type: ignore[union-attr]
    assert_no_token(refused.value, lease.token)
    assert_is_holder_of(await holder.holder("doc"), lease)
    await lease.release()


def test_timeout_zero_refuses_in_lock_too(locks: keymutex.Locks) -> None:
    lease = locks.acquire("doc")
    with pytest.raises(keymutex.Locked) as refused, locks.lock("doc", timeout=0):
        pytest.fail("entered a held lock")
    assert_is_holder_of(refused.value.holder, lease)
    lease.release()


@pytest.mark.asyncio
async def test_timeout_zero_refuses_in_lock_too_async(alocks: keymutex.AsyncLocks) -> None:
    lease = await alocks.acquire("doc")
    with pytest.raises(keymutex.Locked) as refused:
        async with alocks.lock("doc", timeout=0):
            pytest.fail("entered a held lock")
    assert_is_holder_of(refused.value.holder, lease)
    await lease.release()


def test_not_reentrant_even_for_the_same_client(locks: keymutex.Locks) -> None:
    # Locks are per lease, not per thread: a second acquire by the holder is refused.
    with locks.lock("doc") as lease, pytest.raises(keymutex.Locked) as refused:
        locks.acquire("doc", timeout=0)
    assert refused.value.holder is not None
    assert refused.value.holder.fence == lease.fence


@pytest.mark.asyncio
async def test_not_reentrant_even_for_the_same_client_async(alocks: keymutex.AsyncLocks) -> None:
    async with alocks.lock("doc") as lease:
        with pytest.raises(keymutex.Locked) as refused:
            await alocks.acquire("doc", timeout=0)
    assert refused.value.holder is not None
    assert refused.value.holder.fence == lease.fence


def test_timeout_zero_on_a_free_key_acquires(locks: keymutex.Locks) -> None:
    lease = locks.acquire("doc", timeout=0)
    assert_is_holder_of(locks.holder("doc"), lease)
    lease.release()


def test_unrelated_keys_never_wait(make_locks: Callable[..., keymutex.Locks]) -> None:
    held = make_locks().acquire("user:1")
    other = make_locks().acquire("user:2", timeout=0)
    also = make_locks().acquire("user:10", timeout=0)  # not a prefix match either
    for lease in (held, other, also):
        lease.release()


@pytest.mark.asyncio
async def test_unrelated_keys_never_wait_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    held = await make_alocks().acquire("user:1")
    other = await make_alocks().acquire("user:2", timeout=0)
    also = await make_alocks().acquire("user:10", timeout=0)
    for lease in (held, other, also):
        await lease.release()


# --- timeout=t: wait, then give up ----------------------------------------------------------


def test_timeout_waits_then_raises_locked(make_locks: Callable[..., keymutex.Locks]) -> None:
    lease = make_locks(owner="alice").acquire("doc", info={"job": 7})
    started = time.monotonic()
    with pytest.raises(keymutex.Locked) as refused:
        make_locks().acquire("doc", timeout=WAIT)
    waited = time.monotonic() - started
    assert WAIT - 0.05 <= waited < PATIENCE
    assert refused.value.key == "doc"
    assert_is_holder_of(refused.value.holder, lease)
    assert refused.value.holder.owner == "alice"  # type: ignore[union-attr]
    assert refused.value.holder.info == {"job": 7}  # type: ignore[union-attr]
    lease.release()


@pytest.mark.asyncio
async def test_timeout_waits_then_raises_locked_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    lease = await make_alocks(owner="alice").acquire("doc", info={"job": 7})
    started = time.monotonic()
    with pytest.raises(keymutex.Locked) as refused:
        await make_alocks().acquire("doc", timeout=WAIT)
    waited = time.monotonic() - started
    assert WAIT - 0.05 <= waited < PATIENCE
    assert refused.value.key == "doc"
    assert_is_holder_of(refused.value.holder, lease)
    assert refused.value.holder.owner == "alice"  # type: ignore[union-attr]
    await lease.release()


def test_lock_with_timeout_waits_then_raises_locked(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    lease = make_locks().acquire("doc")
    started = time.monotonic()
    with pytest.raises(keymutex.Locked), make_locks().lock("doc", timeout=WAIT):
        pytest.fail("entered a held lock")
    assert time.monotonic() - started >= WAIT - 0.05
    lease.release()


@pytest.mark.asyncio
async def test_lock_with_timeout_waits_then_raises_locked_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    lease = await make_alocks().acquire("doc")
    started = time.monotonic()
    with pytest.raises(keymutex.Locked):
        async with make_alocks().lock("doc", timeout=WAIT):
            pytest.fail("entered a held lock")
    assert time.monotonic() - started >= WAIT - 0.05
    await lease.release()


# --- a waiter is woken by a release ----------------------------------------------------------


def test_waiter_gets_the_key_when_the_holder_releases(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    # The holder's lease would last far longer than the waiter's timeout: only the
    # release can let the waiter in.
    holding = make_locks().acquire("doc", ttl=3600)
    waiting_client = make_locks(owner="bob")
    waiter = start(lambda: waiting_client.acquire("doc", timeout=PATIENCE, info={"window": 2}))
    time.sleep(0.1)  # let the waiter start waiting (not a timing assertion)
    assert waiter.is_alive(), "the waiter did not wait for a held key"
    holding.release()
    lease = waiter.outcome()
    assert lease.fence > holding.fence
    assert lease.owner == "bob"
    assert lease.info == {"window": 2}
    assert_is_holder_of(waiting_client.holder("doc"), lease)
    lease.release()
    assert waiting_client.holder("doc") is None


def test_waiter_without_timeout_waits_as_long_as_it_takes(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    holding = make_locks().acquire("doc", ttl=3600)
    waiting_client = make_locks()
    waiter = start(lambda: waiting_client.acquire("doc", timeout=None))
    time.sleep(1.2)  # past the client's internal re-check interval (not a timing assertion)
    assert waiter.is_alive(), "timeout=None gave up"
    holding.release()
    lease = waiter.outcome()
    assert lease.fence > holding.fence
    lease.release()


@pytest.mark.asyncio
async def test_waiter_gets_the_key_when_the_holder_releases_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    holding = await make_alocks().acquire("doc", ttl=3600)
    waiting_client = make_alocks(owner="bob")
    waiter = asyncio.create_task(
        waiting_client.acquire("doc", timeout=PATIENCE, info={"window": 2})
    )
    await asyncio.sleep(0.1)  # let the waiter start waiting (not a timing assertion)
    assert not waiter.done(), "the waiter did not wait for a held key"
    await holding.release()
    lease = await waiter
    assert lease.fence > holding.fence
    assert lease.owner == "bob"
    assert lease.info == {"window": 2}
    assert_is_holder_of(await waiting_client.holder("doc"), lease)
    await lease.release()
    assert await waiting_client.holder("doc") is None


@pytest.mark.asyncio
async def test_waiter_without_timeout_waits_as_long_as_it_takes_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    holding = await make_alocks().acquire("doc", ttl=3600)
    waiter = asyncio.create_task(make_alocks().acquire("doc", timeout=None))
    await asyncio.sleep(1.2)  # past the internal re-check interval (not a timing assertion)
    assert not waiter.done(), "timeout=None gave up"
    await holding.release()
    lease = await waiter
    assert lease.fence > holding.fence
    await lease.release()


def test_waiters_in_one_client_all_get_their_turn(locks: keymutex.Locks) -> None:
    # Several threads of one client wait for one key; each release lets one in.
    holding = locks.acquire("doc", ttl=3600)
    entered: list[int] = []
    guard = threading.Lock()

    def wait_then_hold() -> int:
        with locks.lock("doc", timeout=PATIENCE) as lease:
            with guard:
                entered.append(lease.fence)
            return lease.fence

    waiters = [start(wait_then_hold) for _ in range(4)]
    holding.release()
    fences = sorted(waiter.outcome() for waiter in waiters)
    assert len(set(fences)) == 4
    assert fences[0] > holding.fence
    assert locks.holder("doc") is None


@pytest.mark.asyncio
async def test_waiters_in_one_client_all_get_their_turn_async(
    alocks: keymutex.AsyncLocks,
) -> None:
    holding = await alocks.acquire("doc", ttl=3600)

    async def wait_then_hold() -> int:
        async with alocks.lock("doc", timeout=PATIENCE) as lease:
            await asyncio.sleep(0)
            return lease.fence

    waiters = [asyncio.create_task(wait_then_hold()) for _ in range(4)]
    await asyncio.sleep(0.05)
    await holding.release()
    async with asyncio.timeout(PATIENCE):
        fences = sorted(await asyncio.gather(*waiters))
    assert len(set(fences)) == 4
    assert fences[0] > holding.fence
    assert await alocks.holder("doc") is None


@pytest.mark.asyncio
async def test_sync_holder_release_wakes_async_waiter(
    make_locks: Callable[..., keymutex.Locks], make_alocks: Callable[..., keymutex.AsyncLocks]
) -> None:
    holding = make_locks().acquire("doc", ttl=3600)
    alocks = make_alocks()
    waiter = asyncio.create_task(alocks.acquire("doc", timeout=PATIENCE))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    await asyncio.to_thread(holding.release)
    lease = await waiter
    assert lease.fence > holding.fence
    await lease.release()


# --- a waiter that gives up leaves no trace -------------------------------------------------


def test_waiter_that_timed_out_does_not_block_later_acquires(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    holding = make_locks().acquire("doc", ttl=3600)
    with pytest.raises(keymutex.Locked):
        make_locks().acquire("doc", timeout=0.1)
    holding.release()
    # The key is free and nobody waits any more: a try-once must succeed.
    make_locks().acquire("doc", timeout=0).release()


@pytest.mark.asyncio
async def test_waiter_that_was_cancelled_does_not_block_later_acquires_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    holding = await make_alocks().acquire("doc", ttl=3600)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await make_alocks().acquire("doc")
    with pytest.raises(keymutex.Locked):
        await make_alocks().acquire("doc", timeout=0.1)
    await holding.release()
    lease = await make_alocks().acquire("doc", timeout=0)
    await lease.release()
    # A cancelled waiter must not have been granted the key behind our back either.
    assert await make_alocks().holder("doc") is None


# --- owner ---------------------------------------------------------------------------------


def test_owner_defaults_to_host_and_pid(make_locks: Callable[..., keymutex.Locks]) -> None:
    lease = make_locks().acquire("doc")
    assert lease.owner == default_owner()
    with pytest.raises(keymutex.Locked) as refused:
        make_locks(owner="someone else").acquire("doc", timeout=0)
    assert refused.value.holder.owner == default_owner()  # type: ignore[union-attr]
    lease.release()


@pytest.mark.asyncio
async def test_owner_defaults_to_host_and_pid_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    lease = await make_alocks().acquire("doc")
    assert lease.owner == default_owner()
    with pytest.raises(keymutex.Locked) as refused:
        await make_alocks(owner="someone else").acquire("doc", timeout=0)
    assert refused.value.holder.owner == default_owner()  # type: ignore[union-attr]
    await lease.release()


def test_custom_owner_is_stored(make_locks: Callable[..., keymutex.Locks]) -> None:
    owner = "editor Zoë <zoe@example.com> window 2"
    locks = make_locks(owner=owner)
    lease = locks.acquire("doc")
    assert lease.owner == owner
    assert make_locks().holder("doc").owner == owner  # type: ignore[union-attr]
    lease.release()


@pytest.mark.asyncio
async def test_custom_owner_is_stored_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    owner = "editor Zoë <zoe@example.com> window 2"
    lease = await make_alocks(owner=owner).acquire("doc")
    assert lease.owner == owner
    assert (await make_alocks().holder("doc")).owner == owner  # type: ignore[union-attr]
    await lease.release()


# --- info ------------------------------------------------------------------------------


def test_info_round_trips_and_is_a_copy(make_locks: Callable[..., keymutex.Locks]) -> None:
    info = {
        "user": {"id": 42, "name": "Ålice", "admin": False},
        "tabs": [1, 2.5, None, "x"],
        "empty": {},
        "quote": "\"'\\",
    }
    expected = copy.deepcopy(info)
    lease = make_locks().acquire("doc", info=info)
    # Changing the caller's dict afterwards does not change what the store keeps.
    info["user"]["id"] = 7  # type: ignore[index]
    info["later"] = True
    seen = make_locks().holder("doc")
    assert seen is not None
    assert seen.info == expected
    assert lease.info == seen.info
    lease.release()


def test_empty_info_round_trips(make_locks: Callable[..., keymutex.Locks]) -> None:
    lease = make_locks().acquire("doc", info={})
    assert lease.info == {}
    assert make_locks().holder("doc").info == {}  # type: ignore[union-attr]
    lease.release()


def test_no_info_is_none(make_locks: Callable[..., keymutex.Locks]) -> None:
    lease = make_locks().acquire("doc")
    assert lease.info is None
    assert make_locks().holder("doc").info is None  # type: ignore[union-attr]
    lease.release()


@pytest.mark.asyncio
async def test_info_round_trips_async(make_alocks: Callable[..., keymutex.AsyncLocks]) -> None:
    lease = await make_alocks().acquire("doc", info=INFO)
    seen = await make_alocks().holder("doc")
    assert seen is not None
    assert seen.info == INFO
    assert lease.info == INFO
    await lease.release()


# --- giving up, many times over, leaves nothing behind ------------------------------------

CONTENDERS = 5
ROUNDS = 15
# Longer than the background clean-up of a cancelled acquire needs; far shorter than
# the 30 s lease a leftover grant would hold.
SETTLE = 3.0


def test_waiters_that_give_up_leave_no_lease_behind(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    errors: list[BaseException] = []

    def contend(seed: int) -> None:
        choose = random.Random(seed)
        client = make_locks(owner=f"contender {seed}")
        try:
            for _ in range(ROUNDS):
                try:
                    lease = client.acquire(
                        "doc", ttl=30, timeout=choose.choice([0, 0.001, 0.005, 0.02])
                    )
                except keymutex.Locked:
                    continue
                time.sleep(choose.uniform(0, 0.004))
                lease.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(seed,)) for seed in range(CONTENDERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE)
    assert errors == []
    observer = make_locks()
    deadline = time.monotonic() + SETTLE
    while (left := observer.holder("doc")) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert left is None, f"a lease was left behind: {left}"
    observer.acquire("doc", timeout=0).release()


@pytest.mark.asyncio
async def test_cancelled_waiters_leave_no_lease_behind_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    async def contend(seed: int) -> None:
        choose = random.Random(seed)
        client = make_alocks(owner=f"contender {seed}")
        for _ in range(ROUNDS):
            try:
                async with asyncio.timeout(choose.uniform(0, 0.005)):
                    lease = await client.acquire("doc", ttl=30)
            except TimeoutError:
                continue
            await asyncio.sleep(choose.uniform(0, 0.004))
            await lease.release()

    async with asyncio.timeout(PATIENCE):
        await asyncio.gather(*(contend(seed) for seed in range(CONTENDERS)))
    observer = make_alocks()
    deadline = time.monotonic() + SETTLE
    while True:
        left = await observer.holder("doc")
        if left is None or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    assert left is None, f"a lease was left behind: {left}"
    await (await observer.acquire("doc", timeout=0)).release()


# --- a release that lands as the waiter's park runs out ---------------------------------------

HANDOVER_ROUNDS = 300
SHORT_HOLD = 0.01
# A waiter's own lease: a lease left behind would hold the key this long.
LONG_TTL = 60.0
# How long a waiter may take to get a key held for SHORT_HOLD at a time (generous).
HANDOVER_PATIENCE = 5.0


def test_releases_at_the_holders_expiry_never_strand_the_key(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    # A holder that releases right as its lease runs out, while a waiter parks exactly
    # until that expiry: the waiter's park times out as the release lands. Whatever the
    # interleaving, once the waiter has released, nobody may hold the key.
    short, patient = make_locks(owner="short"), make_locks(owner="patient")
    done = threading.Event()

    def hold_briefly_again_and_again() -> None:
        choose = random.Random(1)
        while not done.is_set():
            try:
                lease = short.acquire("doc", ttl=SHORT_HOLD, timeout=1)
            except keymutex.Locked:
                continue
            time.sleep(SHORT_HOLD + choose.uniform(-0.002, 0.003))
            with contextlib.suppress(keymutex.LockLost):
                lease.release()

    holder = start(hold_briefly_again_and_again)
    choose = random.Random(2)
    try:
        for _ in range(HANDOVER_ROUNDS):
            time.sleep(choose.uniform(0, SHORT_HOLD))
            try:
                lease = patient.acquire("doc", ttl=LONG_TTL, timeout=HANDOVER_PATIENCE)
            except keymutex.Locked as refused:
                pytest.fail(f"key stranded after every lease of ours was released: {refused}")
            lease.release()
    finally:
        done.set()
        holder.outcome()
    left = patient.holder("doc")
    assert left is None or left.owner == "short"


@pytest.mark.asyncio
async def test_releases_at_the_holders_expiry_never_strand_the_key_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    short, patient = make_alocks(owner="short"), make_alocks(owner="patient")
    done = asyncio.Event()

    async def hold_briefly_again_and_again() -> None:
        choose = random.Random(1)
        while not done.is_set():
            try:
                lease = await short.acquire("doc", ttl=SHORT_HOLD, timeout=1)
            except keymutex.Locked:
                continue
            await asyncio.sleep(SHORT_HOLD + choose.uniform(-0.002, 0.003))
            with contextlib.suppress(keymutex.LockLost):
                await lease.release()

    holder = asyncio.create_task(hold_briefly_again_and_again())
    choose = random.Random(2)
    try:
        for _ in range(HANDOVER_ROUNDS):
            await asyncio.sleep(choose.uniform(0, SHORT_HOLD))
            try:
                lease = await patient.acquire("doc", ttl=LONG_TTL, timeout=HANDOVER_PATIENCE)
            except keymutex.Locked as refused:
                pytest.fail(f"key stranded after every lease of ours was released: {refused}")
            await lease.release()
    finally:
        done.set()
        await holder
    left = await patient.holder("doc")
    assert left is None or left.owner == "short"

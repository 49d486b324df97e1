"""``@locks.locked("order:{user_id}", timeout=5)``: one call per formatted key at a time."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import keymutex

from ._support import PATIENCE, start

# Renewed jobs: a renewal is sent every TTL/3, so a lease outlives a renewer stalled
# for up to 2/3 TTL (1 s here; 0.8 s gave a busy CI host's memcached run a miss).
SHORT_TTL = 1.5


def test_key_is_formatted_from_positional_and_keyword_arguments(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    locks, observer = make_locks(), make_locks()
    seen: list[list[str]] = []

    @locks.locked("order:{user_id}", timeout=5)
    def place_order(user_id: int, order_id: int) -> int:
        seen.append([holder.key for holder in observer.holders()])
        return order_id * 10

    assert place_order(42, 1) == 10
    assert place_order(user_id=42, order_id=2) == 20
    assert place_order(7, order_id=3) == 30
    assert place_order(order_id=4, user_id="x y") == 40
    assert seen == [["order:42"], ["order:42"], ["order:7"], ["order:x y"]]
    assert list(observer.holders()) == []


@pytest.mark.asyncio
async def test_key_is_formatted_from_positional_and_keyword_arguments_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    alocks, observer = make_alocks(), make_alocks()
    seen: list[list[str]] = []

    @alocks.locked("order:{user_id}", timeout=5)
    async def place_order(user_id: int, order_id: int) -> int:
        seen.append([holder.key for holder in await observer.holders()])
        return order_id * 10

    assert await place_order(42, 1) == 10
    assert await place_order(user_id=42, order_id=2) == 20
    assert await place_order(7, order_id=3) == 30
    assert seen == [["order:42"], ["order:42"], ["order:7"]]
    assert list(await observer.holders()) == []


def test_key_uses_defaults_and_several_arguments(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    locks, observer = make_locks(), make_locks()
    seen: list[str] = []

    @locks.locked("{region}/{user_id}", timeout=5)
    def sync_user(user_id: int, region: str = "eu") -> None:
        seen.extend(holder.key for holder in observer.holders())

    sync_user(1)
    sync_user(2, "us")
    sync_user(3, region="ap")
    assert seen == ["eu/1", "us/2", "ap/3"]


def test_decorated_function_keeps_its_name_and_releases_on_error(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    locks = make_locks()

    @locks.locked("order:{user_id}", timeout=5)
    def place_order(user_id: int) -> None:
        """Place an order."""
        raise ValueError("out of stock")

    assert place_order.__name__ == "place_order"
    assert place_order.__doc__ == "Place an order."
    with pytest.raises(ValueError, match="out of stock"):
        place_order(5)
    assert locks.holder("order:5") is None


@pytest.mark.asyncio
async def test_decorated_coroutine_releases_on_error_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    alocks = make_alocks()

    @alocks.locked("order:{user_id}", timeout=5)
    async def place_order(user_id: int) -> None:
        raise ValueError("out of stock")

    assert place_order.__name__ == "place_order"
    with pytest.raises(ValueError, match="out of stock"):
        await place_order(5)
    assert await alocks.holder("order:5") is None


def test_same_key_is_excluded_other_keys_are_not(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    locks = make_locks()
    inside = threading.Event()
    leave = threading.Event()

    @locks.locked("order:{user_id}", timeout=5)
    def place_order(user_id: int, hold: bool = False) -> str:
        if hold:
            inside.set()
            assert leave.wait(PATIENCE)
        return f"placed for {user_id}"

    @make_locks().locked("order:{user_id}", timeout=0)
    def place_order_now(user_id: int) -> str:
        return f"placed now for {user_id}"

    holding = start(lambda: place_order(7, hold=True))
    assert inside.wait(PATIENCE)
    # The same user is refused while the first call runs ...
    with pytest.raises(keymutex.Locked) as refused:
        place_order_now(7)
    assert refused.value.key == "order:7"
    # ... another user is not.
    assert place_order(8) == "placed for 8"
    assert place_order_now(9) == "placed now for 9"
    leave.set()
    assert holding.outcome() == "placed for 7"
    assert place_order_now(7) == "placed now for 7"


@pytest.mark.asyncio
async def test_same_key_is_excluded_other_keys_are_not_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    alocks = make_alocks()
    inside = asyncio.Event()
    leave = asyncio.Event()

    @alocks.locked("order:{user_id}", timeout=5)
    async def place_order(user_id: int, hold: bool = False) -> str:
        if hold:
            inside.set()
            await leave.wait()
        return f"placed for {user_id}"

    @make_alocks().locked("order:{user_id}", timeout=0)
    async def place_order_now(user_id: int) -> str:
        return f"placed now for {user_id}"

    holding = asyncio.create_task(place_order(7, hold=True))
    async with asyncio.timeout(PATIENCE):
        await inside.wait()
    with pytest.raises(keymutex.Locked) as refused:
        await place_order_now(7)
    assert refused.value.key == "order:7"
    assert await place_order(8) == "placed for 8"
    assert await place_order_now(9) == "placed now for 9"
    leave.set()
    assert await holding == "placed for 7"
    assert await place_order_now(7) == "placed now for 7"


def test_concurrent_calls_for_one_key_run_one_at_a_time(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    locks = make_locks()
    state: dict[str, Any] = {"counter": 0, "inside": 0, "most": 0}
    guard = threading.Lock()

    @locks.locked("order:{user_id}", timeout=PATIENCE)
    def place_order(user_id: int) -> None:
        with guard:
            state["inside"] += 1
            state["most"] = max(state["most"], state["inside"])
        value = state["counter"]
        time.sleep(0.001)
        state["counter"] = value + 1
        with guard:
            state["inside"] -= 1

    workers = [start(lambda: [place_order(1) for _ in range(10)]) for _ in range(4)]
    for worker in workers:
        worker.outcome()
    assert state["most"] == 1
    assert state["counter"] == 40


@pytest.mark.asyncio
async def test_concurrent_calls_for_one_key_run_one_at_a_time_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    alocks = make_alocks()
    state: dict[str, Any] = {"counter": 0, "inside": 0, "most": 0}

    @alocks.locked("order:{user_id}", timeout=PATIENCE)
    async def place_order(user_id: int) -> None:
        state["inside"] += 1
        state["most"] = max(state["most"], state["inside"])
        value = state["counter"]
        await asyncio.sleep(0.001)
        state["counter"] = value + 1
        state["inside"] -= 1

    async def ten_orders() -> None:
        for _ in range(10):
            await place_order(1)

    async with asyncio.timeout(PATIENCE * 2):
        await asyncio.gather(*(ten_orders() for _ in range(4)))
    assert state["most"] == 1
    assert state["counter"] == 40


def test_decorator_renews_by_default(make_locks: Callable[..., keymutex.Locks]) -> None:
    observer = make_locks()
    locks = make_locks(ttl=SHORT_TTL)

    @locks.locked("job:{name}")
    def long_job(name: str) -> int:
        time.sleep(3 * SHORT_TTL)  # a job that outlives its TTL: renewal keeps it held
        holder = observer.holder(f"job:{name}")
        assert holder is not None
        return holder.fence

    fence = long_job("nightly")
    assert observer.holder("job:nightly") is None
    assert isinstance(fence, int)


@pytest.mark.asyncio
async def test_decorator_renews_by_default_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
) -> None:
    observer = make_alocks()
    alocks = make_alocks(ttl=SHORT_TTL)

    @alocks.locked("job:{name}")
    async def long_job(name: str) -> bool:
        await asyncio.sleep(3 * SHORT_TTL)
        return await observer.holder(f"job:{name}") is not None

    assert await long_job("nightly") is True
    assert await observer.holder("job:nightly") is None

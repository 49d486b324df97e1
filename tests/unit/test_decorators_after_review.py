"""``Locks.locked`` / ``AsyncLocks.locked``: what a review of them in applications found.

- A plain function that returns a coroutine (or an object whose ``__call__`` is
  ``async def``) went through ``Locks.locked``: the coroutine ran after the lock was
  released, and nothing said so. ``AsyncLocks.locked`` refused such an object and sent
  its user to ``Locks.locked``.
- A template's nested field (``{user:{width}}``) was not checked when decorating, and an
  index or attribute the call's arguments lack raised a bare ``KeyError`` /
  ``IndexError`` / ``AttributeError`` naming nothing; an empty template was accepted.
"""

from __future__ import annotations

import asyncio
import uuid
import warnings
from typing import Any

import pytest

import keymutex


def _url() -> str:
    return f"memory://decorators-{uuid.uuid4().hex}"


class AsyncCallable:
    def __init__(self, locks: keymutex.AsyncLocks | None = None) -> None:
        self.locks = locks
        self.held: list[bool] = []

    async def __call__(self, user: str) -> str:
        if self.locks is not None:
            self.held.append(await self.locks.holder(f"user:{user}") is not None)
        return user


def test_locks_locked_refuses_an_object_whose_call_is_a_coroutine_function() -> None:
    with keymutex.Locks(_url()) as locks, pytest.raises(TypeError, match=r"AsyncLocks\.locked"):
        locks.locked("user:{user}")(AsyncCallable())


def test_a_plain_function_returning_a_coroutine_is_an_error_not_an_unlocked_run() -> None:
    async def work(user: str) -> str:
        return user

    with keymutex.Locks(_url()) as locks:

        @locks.locked("user:{user}")
        def start(user: str) -> Any:
            return work(user)

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "coroutine ... was never awaited": closed
            with pytest.raises(TypeError, match="returned an awaitable"):
                start("ann")
        assert locks.holders() == []


def test_async_locks_locked_takes_an_object_whose_call_is_a_coroutine_function() -> None:
    async def main() -> None:
        async with keymutex.AsyncLocks(_url()) as locks:
            target = AsyncCallable(locks)
            decorated = locks.locked("user:{user}")(target)
            assert await decorated("ann") == "ann"
            assert target.held == [True]  # held while it ran
            assert await locks.holders() == []

    asyncio.run(main())


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("order:{user:{width}}", "names 'width', which is not a parameter"),
        ("", "must not be empty"),
    ],
)
def test_templates_are_checked_whole_when_decorating(template: str, message: str) -> None:
    with keymutex.Locks(_url()) as locks, pytest.raises(ValueError, match=message):

        @locks.locked(template)
        def place(user: str) -> None:
            pass


@pytest.mark.parametrize(
    ("template", "args", "error"),
    [
        ("var:{items[5]}", ([1, 2],), "IndexError"),
        ("var:{options[z]}", ({"a": 1},), "KeyError"),
        ("var:{items.missing}", ([1],), "AttributeError"),
    ],
)
def test_a_template_the_arguments_cannot_fill_names_itself(
    template: str, args: tuple[Any, ...], error: str
) -> None:
    with keymutex.Locks(_url()) as locks:

        @locks.locked(template)
        def run(items: Any = None, options: Any = None) -> None:
            pytest.fail("ran without the lock")

        if "options" in template:
            args = (None, *args)
        with pytest.raises(ValueError, match=rf"key template '{template[:4]}.*{error}"):
            run(*args)
        assert locks.holders() == []

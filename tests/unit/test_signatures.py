"""Every sync/async twin of the public API has the same methods with the same parameters.

The twins may only differ where API.md says they do: ``close`` / ``aclose`` and the
context-manager and iterator protocols (``__enter__`` / ``__aenter__``, ...). A
parameter added to one twin only, a default that differs, or a method that exists on
one side only makes this test fail.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import keymutex

TWINS = [
    ("KeyedLock", "AsyncKeyedLock"),
    ("Locks", "AsyncLocks"),
    ("Lease", "AsyncLease"),
]

# Sync name -> async name, for the only documented differences.
RENAMED = {
    "close": "aclose",
    "__enter__": "__aenter__",
    "__exit__": "__aexit__",
    "__iter__": "__aiter__",
    "__next__": "__anext__",
}

# Dunder methods that are part of the public surface when a class defines them.
PUBLIC_DUNDERS = {"__init__", "__call__", "__len__", "__contains__", *RENAMED, *RENAMED.values()}


def public_names(cls: type) -> set[str]:
    """Public attribute names of ``cls``, with async names mapped to their sync twins."""
    names = set()
    for name in dir(cls):
        if name.startswith("_") and name not in PUBLIC_DUNDERS:
            continue
        if (
            name in PUBLIC_DUNDERS
            and name != "__init__"
            and getattr(cls, name, None) is getattr(object, name, None)
        ):
            continue  # inherited from object: not a protocol the class implements
        names.add(name)
    reverse = {async_name: sync_name for sync_name, async_name in RENAMED.items()}
    return {reverse.get(name, name) for name in names}


def parameters(function: Any) -> list[tuple[str, Any, Any]]:
    """Name, kind and default of each parameter (annotations may differ between twins)."""
    return [
        (parameter.name, parameter.kind, parameter.default)
        for parameter in inspect.signature(function).parameters.values()
    ]


def _actual_name(cls: type, name: str) -> str:
    """``name``, or its async spelling when ``cls`` has that one instead."""
    return name if hasattr(cls, name) else RENAMED.get(name, name)


def differences(sync_cls: type, async_cls: type) -> list[str]:
    """Every way ``async_cls`` differs from ``sync_cls`` beyond the documented renames."""
    found = []
    sync_names, async_names = public_names(sync_cls), public_names(async_cls)
    for name in sorted(sync_names - async_names):
        found.append(f"{sync_cls.__name__}.{name} has no twin on {async_cls.__name__}")
    for name in sorted(async_names - sync_names):
        found.append(
            f"{async_cls.__name__}.{RENAMED.get(name, name)} has no twin on {sync_cls.__name__}"
        )
    for name in sorted(sync_names & async_names):
        sync_attr = inspect.getattr_static(sync_cls, _actual_name(sync_cls, name))
        async_attr = inspect.getattr_static(async_cls, _actual_name(async_cls, name))
        if isinstance(sync_attr, property) or isinstance(async_attr, property):
            if not (isinstance(sync_attr, property) and isinstance(async_attr, property)):
                found.append(f"{name}: a property on one twin only")
            continue
        sync_member = getattr(sync_cls, _actual_name(sync_cls, name))
        async_member = getattr(async_cls, _actual_name(async_cls, name))
        if not (callable(sync_member) and callable(async_member)):
            if callable(sync_member) != callable(async_member):
                found.append(f"{name}: callable on one twin only")
            continue
        if parameters(sync_member) != parameters(async_member):
            found.append(
                f"{name}: {sync_cls.__name__}{inspect.signature(sync_member)}"
                f" != {async_cls.__name__}{inspect.signature(async_member)}"
            )
    return found


@pytest.mark.parametrize(("sync_name", "async_name"), TWINS)
def test_twins_have_the_same_public_signatures(sync_name: str, async_name: str) -> None:
    sync_cls = getattr(keymutex, sync_name)
    async_cls = getattr(keymutex, async_name)
    assert differences(sync_cls, async_cls) == []


@pytest.mark.parametrize(("sync_name", "async_name"), TWINS)
def test_twins_are_sync_and_async_where_they_should_be(sync_name: str, async_name: str) -> None:
    # Where the sync twin's method blocks on I/O, the async twin's is a coroutine function;
    # the documented protocol pairs too.
    async_cls = getattr(keymutex, async_name)
    for name in ("aclose", "__aenter__", "__aexit__"):
        if hasattr(async_cls, name):
            assert inspect.iscoroutinefunction(getattr(async_cls, name)), name


def test_locks_io_methods_are_coroutines_on_the_async_twin() -> None:
    for name in ("acquire", "renew", "release", "holder", "holders", "close"):
        async_name = RENAMED.get(name, name)
        assert inspect.iscoroutinefunction(getattr(keymutex.AsyncLocks, async_name)), name
        assert not inspect.iscoroutinefunction(getattr(keymutex.Locks, name)), name
    for name in ("renew", "release"):
        assert inspect.iscoroutinefunction(getattr(keymutex.AsyncLease, name)), name
        assert not inspect.iscoroutinefunction(getattr(keymutex.Lease, name)), name
    assert inspect.iscoroutinefunction(keymutex.AsyncKeyedLock.acquire)
    assert not inspect.iscoroutinefunction(keymutex.KeyedLock.acquire)


def test_documented_signatures_of_locks() -> None:
    # API.md's signatures, checked on the sync twin (the test above holds the async one to it).
    assert parameters(keymutex.Locks.__init__) == [
        ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        ("url", inspect.Parameter.POSITIONAL_OR_KEYWORD, "memory://"),
        ("namespace", inspect.Parameter.KEYWORD_ONLY, ""),
        ("ttl", inspect.Parameter.KEYWORD_ONLY, 30.0),
        ("owner", inspect.Parameter.KEYWORD_ONLY, None),
        ("store_options", inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty),
    ]
    acquire_defaults = {
        "ttl": None,
        "timeout": None,
        "renew": False,
        "info": None,
        "steal": False,
        "on_lost": None,
    }
    for name, renew_default in (("lock", True), ("acquire", False)):
        signature = inspect.signature(getattr(keymutex.Locks, name))
        names = list(signature.parameters)
        assert names[:2] == ["self", "key"], name
        assert {
            parameter: signature.parameters[parameter].default for parameter in acquire_defaults
        } == {**acquire_defaults, "renew": renew_default}, name
    renew = inspect.signature(keymutex.Locks.renew)
    assert list(renew.parameters)[:3] == ["self", "key", "token"]
    assert renew.parameters["ttl"].default is None
    assert list(inspect.signature(keymutex.Locks.release).parameters) == ["self", "key", "token"]
    assert inspect.signature(keymutex.Locks.holders).parameters["prefix"].default == ""
    assert inspect.signature(keymutex.Lease.renew).parameters["ttl"].default is None


# --- the comparison itself must be able to fail -------------------------------------------


class _Sync:
    def __init__(self, url: str, *, ttl: float = 1.0) -> None: ...

    def acquire(self, key: str, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> _Sync:
        return self

    def __exit__(self, *exc: object) -> None: ...


class _Async:
    def __init__(self, url: str, *, ttl: float = 1.0) -> None: ...

    async def acquire(self, key: str, timeout: float | None = None) -> None: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> _Async:
        return self

    async def __aexit__(self, *exc: object) -> None: ...


class _AsyncExtraParameter(_Async):
    async def acquire(
        self, key: str, timeout: float | None = None, fair: bool = False
    ) -> None: ...


class _AsyncOtherDefault(_Async):
    async def acquire(self, key: str, timeout: float | None = 5.0) -> None: ...


class _AsyncKeywordOnly(_Async):
    async def acquire(self, key: str, *, timeout: float | None = None) -> None: ...


class _AsyncExtraMethod(_Async):
    async def peek(self, key: str) -> None: ...


class _AsyncNoContextManager:
    def __init__(self, url: str, *, ttl: float = 1.0) -> None: ...

    async def acquire(self, key: str, timeout: float | None = None) -> None: ...

    async def aclose(self) -> None: ...


def test_comparison_accepts_documented_differences() -> None:
    assert differences(_Sync, _Async) == []


@pytest.mark.parametrize(
    "drifted",
    [
        _AsyncExtraParameter,
        _AsyncOtherDefault,
        _AsyncKeywordOnly,
        _AsyncExtraMethod,
        _AsyncNoContextManager,
    ],
)
def test_comparison_catches_drift(drifted: type) -> None:
    assert differences(_Sync, drifted) != []
    assert differences(drifted, _Sync) != []

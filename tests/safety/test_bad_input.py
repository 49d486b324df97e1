"""Bad-input catalogue, Python API: every public entry point, one table per kind of input.

``docs/bad-input.md`` is the readable form of these tables. Each row is one bad call
and what API.md promises for it: the exception type *and* the part of its message
that names the argument and what is accepted. After each refusal the store must be as
it was before the call:

- ``holders("")`` of the test's namespace is the same. A bystander lease is held
  throughout (TTL 20 s, while the client's default is 30 s), so a renewal that slipped
  through would move its expiry by 10 s, and a steal or a release would change the list;
- no fence was consumed: a probe acquire of ``doc`` after the call gets exactly the
  fence after the one a probe got just before it. ``memory://`` and ``sqlite://``
  draw fences from one counter per table / file, so a grant of *any* key in between
  would show.

Every row runs through ``Locks`` on ``memory://`` and ``sqlite://``, and through
``AsyncLocks`` on ``sqlite://`` (a failure says which). The value families run whole
through ``acquire``; the other entry points run the core of each family (the classes
issue 7 names), as they all share one check. Rows marked ``xfail(strict=True)`` are
bugs in ``src/`` that this catalogue found; the reason says what is wrong, and a bug is
shown once, where it is first met. Inputs that look bad but that API.md accepts (control characters in
keys, ``timeout=0``, any hashable key for ``KeyedLock``) have tables of their own at
the end, so that the line between the two stays written down.

The tables are kept one row per line (``fmt: off``): they are read as tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import keymutex
from keymutex.stores import memory as memory_store

KEY = "doc"  # the valid key of the rows, and the probe key
HELD = "held"  # held by the bystander lease during every call
GONE = "gone"  # a lease that was released, expired or stolen before the call
CLIENT_TTL = 30.0
BYSTANDER_TTL = 20.0  # != CLIENT_TTL: a renewal with the default TTL would show
EXPIRY_SLACK = 1.0  # how far two reads of one unchanged lease's expires_at may differ
PATIENCE = 20.0

# -- bugs found by this catalogue: the rows that show them are xfail(strict=True), with the
# reason. Every finding of the first run is fixed (see docs/bad-input.md). ----------------


def _xfail(reason: str | None) -> list[pytest.MarkDecorator]:
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


# -- the context of a row ------------------------------------------------------------


@dataclass
class Ctx:
    """What a row's call may use: the bystander, the lease its setup made, helpers."""

    client: Any  # the Locks / AsyncLocks of the test's namespace
    held: Any  # the bystander Lease / AsyncLease on HELD
    function: Callable[..., Any]  # plain for Locks, async for AsyncLocks
    wrong_function: Callable[..., Any]  # the other kind
    calls: list[object] = field(default_factory=list)
    gone: Any = None  # setup "released" / "expired" / "stolen": the lease on GONE
    thief: Any = None  # setup "stolen": the lease that stole GONE
    closed: Any = None  # setup "closed": a closed client of the same store
    other: Any = None  # setup "other": a client of the same store, another namespace


Call = Callable[[Any, Ctx], object]


@dataclass(frozen=True)
class Bad:
    """One refused call: what to call, what it raises, what the message says."""

    call: Call
    error: type[BaseException]
    message: str | dict[str, str]  # a fragment of str(error), or one per client class
    setup: str | None = None  # "released", "expired", "stolen", "closed" or "other"
    holder: str | None = None  # LockLost.holder: "bystander", "thief" or "none"


def bad(
    case_id: str,
    call: Call,
    error: type[BaseException],
    message: str | dict[str, str],
    *,
    setup: str | None = None,
    holder: str | None = None,
    xfail: str | None = None,
) -> Any:
    return pytest.param(Bad(call, error, message, setup, holder), id=case_id, marks=_xfail(xfail))


def _leave(lease: Any) -> object:
    """Leave ``with lease:`` / ``async with lease:`` without an exception."""
    if isinstance(lease, keymutex.AsyncLease):
        return lease.__aexit__(None, None, None)
    return lease.__exit__(None, None, None)


def _generator(name: str) -> Iterator[str]:
    yield name


async def _async_generator(name: str) -> AsyncIterator[str]:
    yield name


def _deeply_nested() -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for _ in range(100_000):
        nested = {"a": nested}
    return nested


def _nested_lists(levels: int) -> list[Any]:
    """A list in a list … ``levels`` deep."""
    nested: list[Any] = []
    for _ in range(levels - 1):
        nested = [nested]
    return nested


def _circular() -> dict[str, Any]:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    return loop


def _info_of(size: int) -> dict[str, str]:
    """An info dict that is exactly ``size`` bytes as compact JSON."""
    return {"b": "x" * (size - len('{"b":""}'))}


# -- the tables ------------------------------------------------------------------------

# fmt: off
# Keys: (id, value, error, message), run through every entry point that takes a key.
BAD_KEYS: list[tuple[str, object, type[Exception], str]] = [
    ("empty", "", ValueError, "key must not be empty: 1 to 1024 bytes of UTF-8 text are accepted"),
    ("1025-bytes", "k" * 1025, ValueError, "key is 1025 bytes as UTF-8; at most 1024 are accepted"),
    ("1025-utf8-bytes", "é" * 512 + "a", ValueError, "key is 1025 bytes as UTF-8; at most 1024 are accepted"),  # 513 characters
    ("huge", "k" * 1_000_000, ValueError, "key is 1000000 bytes as UTF-8; at most 1024 are accepted"),
    ("nul", "a\x00b", ValueError, "key must not contain NUL characters; any other Unicode character is accepted"),
    ("lone-surrogate", "a\ud800b", ValueError, "key must be valid Unicode text; it contains a lone surrogate"),
    ("lone-low-surrogate", "\udfff", ValueError, "key must be valid Unicode text; it contains a lone surrogate"),
    ("int", 42, TypeError, "key must be a str, not int"),
    ("bytes", b"doc", TypeError, "key must be a str, not bytes"),
    ("none", None, TypeError, "key must be a str, not NoneType"),
    ("tuple", ("doc",), TypeError, "key must be a str, not tuple"),
]
CORE_KEYS = {"empty", "1025-bytes", "huge", "nul", "lone-surrogate", "int"}

# ``locked-call`` formats the key from the call's arguments: a str stays what it is.
KEY_ENTRY_POINTS: dict[str, Callable[[Any, Ctx, Any], object]] = {
    "acquire": lambda c, x, k: c.acquire(k),
    "steal": lambda c, x, k: c.acquire(k, steal=True),
    "lock": lambda c, x, k: c.lock(k),
    "renew": lambda c, x, k: c.renew(k, x.held.token),
    "release": lambda c, x, k: c.release(k, x.held.token),
    "holder": lambda c, x, k: c.holder(k),
    "locked-call": lambda c, x, k: c.locked("{name}")(x.function)(k),
}

BAD_PREFIXES: list[tuple[str, object, type[Exception], str]] = [
    ("int", 42, TypeError, "prefix must be a str, not int"),
    ("none", None, TypeError, "prefix must be a str, not NoneType"),
    ("bytes", b"d", TypeError, "prefix must be a str, not bytes"),
    ("nul", "d\x00", ValueError, "prefix must not contain NUL characters"),
    ("lone-surrogate", "\ud800", ValueError, "prefix must be valid Unicode text; it contains a lone surrogate"),
    ("1025-bytes", "p" * 1025, ValueError, "prefix is 1025 bytes as UTF-8; at most 1024 are accepted"),
]

TTL_RANGE = "ttl must be greater than 0 and at most 315360000 s, not "
TTL_TYPE = "ttl must be a number of seconds (int or float), not "
TTL_MINIMUM = "ttl must be at least 0.001 s (1 ms), not "
# (id, value, error, message, bug)
BAD_TTLS: list[tuple[str, object, type[Exception], str, str | None]] = [
    ("zero", 0, ValueError, TTL_RANGE + "0", None),
    ("zero-float", 0.0, ValueError, TTL_RANGE + "0.0", None),
    ("minus-zero", -0.0, ValueError, TTL_RANGE + "-0.0", None),
    ("negative", -1, ValueError, TTL_RANGE + "-1", None),
    ("tiny-negative", -1e-9, ValueError, TTL_RANGE + "-1e-09", None),
    ("nan", math.nan, ValueError, "ttl must be a number of seconds, not NaN", None),
    ("inf", math.inf, ValueError, TTL_RANGE + "inf", None),
    ("minus-inf", -math.inf, ValueError, TTL_RANGE + "-inf", None),
    ("over-ten-years", 315_360_001, ValueError, TTL_RANGE + "315360001", None),
    ("1e308", 1e308, ValueError, TTL_RANGE + "1e+308", None),
    ("true", True, TypeError, TTL_TYPE + "True", None),
    ("false", False, TypeError, TTL_TYPE + "False", None),
    ("str", "30", TypeError, TTL_TYPE + "'30'", None),
    ("decimal", Decimal("30"), TypeError, TTL_TYPE + "Decimal('30')", None),
    ("complex", 1j, TypeError, TTL_TYPE + "1j", None),
    ("huge-int", 10**400, ValueError, TTL_RANGE + "an integer of about 401 digits", None),
    ("minus-huge-int", -(10**400), ValueError, TTL_RANGE + "a negative integer of about 401 digits", None),
    ("below-clock-resolution", 1e-300, ValueError, TTL_MINIMUM + "1e-300", None),
    ("below-a-millisecond", 0.0009, ValueError, TTL_MINIMUM + "0.0009", None),
]
CORE_TTLS = {"zero", "negative", "nan", "inf", "minus-inf", "true", "str"}

TTL_ENTRY_POINTS: dict[str, Callable[[Any, Ctx, Any], object]] = {
    "acquire": lambda c, x, t: c.acquire(KEY, ttl=t),
    "steal": lambda c, x, t: c.acquire(HELD, ttl=t, steal=True),
    "lock": lambda c, x, t: c.lock(KEY, ttl=t),
    "renew": lambda c, x, t: c.renew(HELD, x.held.token, ttl=t),
    "lease-renew": lambda c, x, t: x.held.renew(ttl=t),
    "locked": lambda c, x, t: c.locked("k:{name}", ttl=t),
}

TIMEOUT_RANGE = "timeout must be None (wait forever), 0 (try once) or finite seconds > 0, not "
TIMEOUT_TYPE = "timeout must be a number of seconds (int or float), not "
BAD_TIMEOUTS: list[tuple[str, object, type[Exception], str, str | None]] = [
    ("negative", -1, ValueError, TIMEOUT_RANGE + "-1", None),
    ("tiny-negative", -1e-9, ValueError, TIMEOUT_RANGE + "-1e-09", None),
    ("nan", math.nan, ValueError, "timeout must be a number of seconds, not NaN", None),
    ("inf", math.inf, ValueError, TIMEOUT_RANGE + "inf", None),
    ("minus-inf", -math.inf, ValueError, TIMEOUT_RANGE + "-inf", None),
    ("true", True, TypeError, TIMEOUT_TYPE + "True", None),
    ("false", False, TypeError, TIMEOUT_TYPE + "False", None),
    ("str", "5", TypeError, TIMEOUT_TYPE + "'5'", None),
    ("decimal", Decimal("5"), TypeError, TIMEOUT_TYPE + "Decimal('5')", None),
    ("huge-int", 10**400, ValueError, TIMEOUT_RANGE + "an integer of about 401 digits", None),
]
CORE_TIMEOUTS = {"negative", "nan", "inf", "minus-inf", "true", "str"}

TIMEOUT_ENTRY_POINTS: dict[str, Callable[[Any, Ctx, Any], object]] = {
    "acquire": lambda c, x, t: c.acquire(KEY, timeout=t),
    "steal": lambda c, x, t: c.acquire(HELD, timeout=t, steal=True),
    "lock": lambda c, x, t: c.lock(KEY, timeout=t),
    "locked": lambda c, x, t: c.locked("k:{name}", timeout=t),
}

NOT_JSON = "info must be JSON-serialisable (no NaN or infinity): "
BAD_INFOS: list[tuple[str, object, type[Exception], str, str | None]] = [
    ("list", [1, 2], TypeError, "info must be a dict or None, not list", None),
    ("str", "alice", TypeError, "info must be a dict or None, not str", None),
    ("set-value", {"s": {1}}, ValueError, NOT_JSON + "Object of type set is not JSON serializable", None),
    ("object-value", {"o": object()}, ValueError, NOT_JSON + "Object of type object is not JSON serializable", None),
    ("bytes-value", {"b": b"x"}, ValueError, NOT_JSON + "Object of type bytes is not JSON serializable", None),
    ("tuple-key", {(1, 2): 1}, TypeError, "info keys must be str (JSON object keys are strings), not tuple (1, 2)", None),
    ("nan-value", {"f": math.nan}, ValueError, NOT_JSON + "Out of range float values are not JSON compliant", None),
    ("inf-value", {"f": math.inf}, ValueError, NOT_JSON + "Out of range float values are not JSON compliant", None),
    ("circular", _circular(), ValueError, NOT_JSON + "Circular reference detected", None),
    ("deeply-nested", _deeply_nested(), ValueError, "info is nested too deeply to be stored as JSON", None),
    ("nested-33-levels", {"a": _nested_lists(32)}, ValueError, "info is nested more than 32 levels deep (of dicts and lists); at most 32 are accepted", None),
    ("4097-bytes", _info_of(4097), ValueError, "info is 4097 bytes as JSON; at most 4096 are accepted", None),
    ("huge", {"blob": "x" * 1_000_000}, ValueError, "info is 1000011 bytes as JSON; at most 4096 are accepted", None),
    ("4097-utf8-bytes", {"b": "é" * 2044 + "a"}, ValueError, "info is 4097 bytes as JSON; at most 4096 are accepted", None),  # UTF-8, as sent over HTTP
    ("lone-surrogate", {"name": "\ud800"}, ValueError, "info must be valid Unicode text; it contains a lone surrogate", None),
    ("int-key", {1: "one", "1": "un"}, TypeError, "info keys must be str (JSON object keys are strings), not int 1", None),  # JSON would keep one of the two
    ("nested-none-key", {"a": [{"b": {None: 1}}]}, TypeError, "info keys must be str (JSON object keys are strings), not NoneType None", None),
    ("lone-surrogate-in-a-name", {"\udc80": 1}, ValueError, "info must be valid Unicode text; it contains a lone surrogate", None),
]
CORE_INFOS = {"list", "set-value", "nan-value", "4097-bytes", "lone-surrogate"}

INFO_ENTRY_POINTS: dict[str, Callable[[Any, Ctx, Any], object]] = {
    "acquire": lambda c, x, i: c.acquire(KEY, info=i),
    "steal": lambda c, x, i: c.acquire(HELD, info=i, steal=True),
    "lock": lambda c, x, i: c.lock(KEY, info=i),
    "locked": lambda c, x, i: c.locked("k:{name}", info=i),
}

# Flags and callbacks: no parameter is a bool *or* something else (STYLE.md).
BAD_OPTIONS: list[tuple[str, str, object, str]] = [
    ("renew-str", "renew", "no", "renew must be True or False, not 'no'"),
    ("renew-int", "renew", 1, "renew must be True or False, not 1"),
    ("renew-none", "renew", None, "renew must be True or False, not None"),
    ("steal-str", "steal", "yes", "steal must be True or False, not 'yes'"),
    ("steal-int", "steal", 1, "steal must be True or False, not 1"),
    ("steal-none", "steal", None, "steal must be True or False, not None"),
    ("on-lost-int", "on_lost", 42, "on_lost must be a callable or None, not int"),
    ("on-lost-str", "on_lost", "print", "on_lost must be a callable or None, not str"),
]
CORE_OPTIONS = {"renew-str", "steal-int", "on-lost-int"}

OPTION_ENTRY_POINTS: dict[str, Callable[[Any, Ctx, dict[str, Any]], object]] = {
    "acquire": lambda c, x, o: c.acquire(KEY, **o),
    "lock": lambda c, x, o: c.lock(KEY, **o),
    "locked": lambda c, x, o: c.locked("k:{name}", **o),
}

TOKEN_FORMAT = "token must be 1 to 256 URL-safe characters (A-Z a-z 0-9 - _) as returned in Lease.token"
# Tokens that are not tokens: refused before the store.
BAD_TOKENS: list[tuple[str, Callable[[Ctx], object], type[Exception], str]] = [
    ("int", lambda x: 42, TypeError, "token must be a str, not int"),
    ("none", lambda x: None, TypeError, "token must be a str, not NoneType"),
    ("bytes", lambda x: x.held.token.encode(), TypeError, "token must be a str, not bytes"),
    ("empty", lambda x: "", ValueError, TOKEN_FORMAT),
    ("space", lambda x: "not a token", ValueError, TOKEN_FORMAT),
    ("nul", lambda x: x.held.token + "\x00", ValueError, TOKEN_FORMAT),
    ("base64-padding", lambda x: x.held.token + "==", ValueError, TOKEN_FORMAT),
    ("base64-plus-slash", lambda x: "ab+cd/ef", ValueError, TOKEN_FORMAT),
    ("dot", lambda x: "ab.cd", ValueError, TOKEN_FORMAT),
    ("non-ascii", lambda x: "tökén", ValueError, TOKEN_FORMAT),
    ("lone-surrogate", lambda x: "\ud800" * 24, ValueError, TOKEN_FORMAT),
    ("257-chars", lambda x: "t" * 257, ValueError, TOKEN_FORMAT),
    ("huge", lambda x: "t" * 1_000_000, ValueError, TOKEN_FORMAT),
]

# Well-formed tokens that do not hold the key: LockLost, whose holder is the bystander.
WRONG_TOKENS: list[tuple[str, Callable[[Ctx], str]]] = [
    ("random", lambda x: "t" * 24),
    ("truncated", lambda x: x.held.token[:-1]),
    ("extended", lambda x: x.held.token + "A"),
    ("case-swapped", lambda x: x.held.token.swapcase()),
    ("256-chars", lambda x: "t" * 256),
]
# fmt: on


def _key_rows() -> list[Any]:
    rows = []
    for point, call in KEY_ENTRY_POINTS.items():
        for name, value, error, message in BAD_KEYS:
            if point != "acquire" and name not in CORE_KEYS:
                continue
            if point == "locked-call" and not isinstance(value, str):
                continue  # str.format makes a valid key of it ("42")

            def row(c: Any, x: Ctx, call: Any = call, value: object = value) -> object:
                return call(c, x, value)

            rows.append(bad(f"{point}-key-{name}", row, error, message))
    for name, value, error, message in BAD_PREFIXES:
        rows.append(
            bad(f"holders-prefix-{name}", lambda c, x, v=value: c.holders(v), error, message)
        )
    return rows


def _value_rows(
    kind: str,
    points: dict[str, Callable[[Any, Ctx, Any], object]],
    values: list[tuple[str, object, type[Exception], str, str | None]],
    core: set[str],
) -> list[Any]:
    rows = []
    for point, call in points.items():
        for name, value, error, message, bug in values:
            if point != "acquire" and name not in core:
                continue

            def row(c: Any, x: Ctx, call: Any = call, value: object = value) -> object:
                return call(c, x, value)

            rows.append(bad(f"{point}-{kind}-{name}", row, error, message, xfail=bug))
    return rows


def _option_rows() -> list[Any]:
    rows = []
    for point, call in OPTION_ENTRY_POINTS.items():
        for name, option, value, message in BAD_OPTIONS:
            if point != "acquire" and name not in CORE_OPTIONS:
                continue

            def row(
                c: Any, x: Ctx, call: Any = call, option: str = option, value: object = value
            ) -> object:
                return call(c, x, {option: value})

            rows.append(bad(f"{point}-{name}", row, TypeError, message))
    return rows


def _token_rows() -> list[Any]:
    rows = []
    for name, token, error, message in BAD_TOKENS:
        for point in ("renew", "release"):

            def row(c: Any, x: Ctx, token: Any = token, point: str = point) -> object:
                return getattr(c, point)(HELD, token(x))

            rows.append(bad(f"{point}-token-{name}", row, error, message))
    for name, token in WRONG_TOKENS:
        for point in ("renew", "release"):

            def row(c: Any, x: Ctx, token: Any = token, point: str = point) -> object:
                return getattr(c, point)(HELD, token(x))

            rows.append(
                bad(
                    f"{point}-token-{name}",
                    row,
                    keymutex.LockLost,
                    "lease on 'held' was lost: held by ",
                    holder="bystander",
                )
            )
    return rows


# fmt: off
MISC_ROWS = [
    # A token is good for its own key, in its own namespace, only.
    bad("renew-token-of-another-key", lambda c, x: c.renew(KEY, x.held.token), keymutex.LockLost, "lease on 'doc' was lost: no current holder", holder="none"),
    bad("release-token-of-another-key", lambda c, x: c.release(KEY, x.held.token), keymutex.LockLost, "lease on 'doc' was lost: no current holder", holder="none"),
    bad("renew-token-of-another-namespace", lambda c, x: x.other.renew(HELD, x.held.token), keymutex.LockLost, "lease on 'held' was lost: no current holder", holder="none", setup="other"),
    bad("release-token-of-another-namespace", lambda c, x: x.other.release(HELD, x.held.token), keymutex.LockLost, "lease on 'held' was lost: no current holder", holder="none", setup="other"),
    # Calls that Python itself refuses.
    bad("acquire-unknown-keyword", lambda c, x: c.acquire(KEY, wait=5), TypeError, "unexpected keyword argument 'wait'"),
    bad("acquire-no-key", lambda c, x: c.acquire(), TypeError, "missing 1 required positional argument: 'key'"),
    bad("renew-no-token", lambda c, x: c.renew(HELD), TypeError, "missing 1 required positional argument: 'token'"),
    bad("lease-renew-positional-key", lambda c, x: x.held.renew(HELD, 5), TypeError, "positional arguments but 3 were given"),
    # The decorator: the template is checked when decorating, the key at each call.
    bad("locked-template-int", lambda c, x: c.locked(42)(x.function), TypeError, "key must be a str template such as 'order:{user_id}', not 42"),
    bad("locked-template-none", lambda c, x: c.locked(None)(x.function), TypeError, "key must be a str template such as 'order:{user_id}', not None"),
    bad("locked-template-unknown-name", lambda c, x: c.locked("order:{order}")(x.function), ValueError, "key template 'order:{order}' names 'order', which is not a parameter of"),
    bad("locked-template-positional-field", lambda c, x: c.locked("order:{0}")(x.function), ValueError, "key template 'order:{0}' names '0', which is not a parameter of"),
    bad("locked-template-unbalanced-brace", lambda c, x: c.locked("order:{name")(x.function), ValueError, "key template 'order:{name' is malformed: expected '}' before end of string (write {{ and }} for literal braces)"),
    bad("locked-template-stray-closing-brace", lambda c, x: c.locked("order:}{name}")(x.function), ValueError, "key template 'order:}{name}' is malformed: Single '}' encountered in format string"),
    bad("locked-template-bad-conversion", lambda c, x: c.locked("order:{name!x}")(x.function), ValueError, "key template 'order:{name!x}' is malformed: unknown conversion !x (use !s, !r or !a)"),
    bad("locked-not-callable", lambda c, x: c.locked("k")(42), TypeError, {"Locks": "Locks.locked decorates functions; 42 is not a callable object", "AsyncLocks": "AsyncLocks.locked decorates async functions; 42 is not a callable object"}),
    bad("locked-generator-function", lambda c, x: c.locked("k:{name}")(_generator if isinstance(c, keymutex.Locks) else _async_generator), TypeError, {"Locks": "Locks.locked cannot decorate generator function _generator: the lock would be held only while the generator is created", "AsyncLocks": "AsyncLocks.locked cannot decorate generator function _async_generator: the lock would be held only while the generator is created"}),
    bad("locked-wrong-kind-of-function", lambda c, x: c.locked("k")(x.wrong_function), TypeError, {"Locks": "Locks.locked decorates plain functions; use AsyncLocks.locked", "AsyncLocks": "AsyncLocks.locked decorates async functions; use Locks.locked"}),
    bad("locked-call-missing-argument", lambda c, x: c.locked("k:{name}")(x.function)(), TypeError, "missing a required argument: 'name'"),
    bad("locked-call-unknown-argument", lambda c, x: c.locked("k:{name}")(x.function)("a", extra=1), TypeError, "got an unexpected keyword argument 'extra'"),
]

# Leases that no longer hold their key: double release, renewal after expiry or a steal.
LIFECYCLE_ROWS = [
    bad(f"{point}-{setup}", call, keymutex.LockLost, message, setup=setup, holder=holder)
    for setup, holder, lost in [
        ("released", "none", "lease on 'gone' was lost: no current holder"),
        ("expired", "none", "lease on 'gone' was lost: no current holder"),
        ("stolen", "thief", "lease on 'gone' was lost: held by "),
    ]
    for point, call, message in [
        ("lease-renew", lambda c, x: x.gone.renew(), "lease on 'gone' was already released" if setup == "released" else lost),
        ("lease-release", lambda c, x: x.gone.release(), "lease on 'gone' was already released" if setup == "released" else lost),
        ("renew", lambda c, x: c.renew(GONE, x.gone.token), lost),
        ("release", lambda c, x: c.release(GONE, x.gone.token), lost),
        ("lease-exit", lambda c, x: _leave(x.gone), lost),
    ]
    if not (setup == "released" and point == "lease-exit")  # leaving it after release is fine
]

# Every method of a closed client refuses, before the store (see also test_closed_leases).
CLOSED = {"Locks": "this Locks is closed", "AsyncLocks": "this AsyncLocks is closed"}
CLOSED_ROWS = [
    bad("closed-acquire", lambda c, x: x.closed.acquire(KEY), RuntimeError, CLOSED, setup="closed"),
    bad("closed-steal", lambda c, x: x.closed.acquire(HELD, steal=True), RuntimeError, CLOSED, setup="closed"),
    bad("closed-lock", lambda c, x: x.closed.lock(KEY), RuntimeError, CLOSED, setup="closed"),
    bad("closed-locked-call", lambda c, x: x.closed.locked("{name}")(x.function)(KEY), RuntimeError, CLOSED, setup="closed"),
    bad("closed-holder", lambda c, x: x.closed.holder(KEY), RuntimeError, CLOSED, setup="closed"),
    bad("closed-holders", lambda c, x: x.closed.holders(""), RuntimeError, CLOSED, setup="closed"),
    bad("closed-renew", lambda c, x: x.closed.renew(HELD, x.held.token), RuntimeError, CLOSED, setup="closed"),
    bad("closed-release", lambda c, x: x.closed.release(HELD, x.held.token), RuntimeError, CLOSED, setup="closed"),
    bad("closed-release-wrong-token", lambda c, x: x.closed.release(KEY, "t" * 24), RuntimeError, CLOSED, setup="closed"),
]
# fmt: on

ROWS = [
    *_key_rows(),
    *_value_rows("ttl", TTL_ENTRY_POINTS, BAD_TTLS, CORE_TTLS),
    *_value_rows("timeout", TIMEOUT_ENTRY_POINTS, BAD_TIMEOUTS, CORE_TIMEOUTS),
    *_value_rows("info", INFO_ENTRY_POINTS, BAD_INFOS, CORE_INFOS),
    *_option_rows(),
    *_token_rows(),
    *MISC_ROWS,
    *LIFECYCLE_ROWS,
    *CLOSED_ROWS,
]


# -- stores, and the state that must not change ------------------------------------------


@pytest.fixture(scope="session")
def shared_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One SQLite file per test process, kept open: opening it again is then cheap.

    Tests share it in namespaces of their own. Its fence counter is this process's
    alone, and the tests of one process run one at a time.
    """
    url = f"sqlite:///{tmp_path_factory.mktemp('bad-input')}/locks.db"
    with keymutex.Locks(url):
        yield url


@pytest.fixture(params=["memory", "sqlite"])
def bad_input_store(request: pytest.FixtureRequest) -> str:
    """A fresh memory:// table, or this process's SQLite file (use a fresh namespace)."""
    if request.param == "memory":
        return f"memory://bad-input-{uuid.uuid4().hex}"
    return str(request.getfixturevalue("shared_sqlite"))


def _namespace() -> str:
    return f"bad-input-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class State:
    """What the store shows: the holders (their expiry apart) and the next fence."""

    holders: list[tuple[object, ...]]
    expires: list[float]
    fence: int


def _state(holders: list[keymutex.Holder], probe: Any) -> State:
    return State(
        [(h.key, h.owner, h.info, h.fence, h.acquired_at) for h in holders],
        [h.expires_at for h in holders],
        probe.fence,
    )


def _assert_unchanged(before: State, after: State) -> None:
    assert after.holders == before.holders, "the holders changed"
    for was, now in zip(before.expires, after.expires, strict=True):
        assert abs(now - was) < EXPIRY_SLACK, f"a lease's expiry moved by {now - was:.3f} s"
    # The two probes were the only grants: one counter per table/file, one step per grant.
    assert after.fence == before.fence + 1, (
        f"fences were consumed: the probe got {after.fence} after {before.fence}"
    )


def _pattern(row: Bad, client: object) -> str:
    message = row.message
    if isinstance(message, dict):
        message = message[type(client).__name__]
    return re.escape(message)


def _check_error(error: BaseException, row: Bad, x: Ctx) -> None:
    """No token in the error; ``LockLost.holder`` is who holds the key now."""
    assert x.held.token not in str(error)
    assert x.held.token not in repr(error.args)
    if row.holder is None:
        return
    assert isinstance(error, keymutex.LockLost)
    holder = error.holder
    if row.holder == "none":
        assert holder is None, holder
    else:
        owner = x.held if row.holder == "bystander" else x.thief
        assert holder is not None
        assert holder.fence == owner.fence
        assert holder.owner == owner.owner


def _functions(calls: list[object]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A plain and an async function for the decorator rows; both note their calls."""

    def plain(name: str) -> None:
        calls.append(name)

    async def coroutine(name: str) -> None:
        calls.append(name)

    return plain, coroutine


@contextlib.contextmanager
def _through(name: str) -> Iterator[None]:
    """Say in a failure which twin it was: each test runs the sync and the async one."""
    try:
        yield
    except BaseException as exc:
        exc.add_note(f"(through {name})")
        raise


# -- Locks, then AsyncLocks ------------------------------------------------------------------


def _probe(locks: keymutex.Locks) -> keymutex.Lease:
    lease = locks.acquire(KEY, timeout=0)
    lease.release()
    return lease


def _sync_ctx(stack: contextlib.ExitStack, url: str, setup: str | None) -> Ctx:
    namespace = _namespace()
    locks = stack.enter_context(keymutex.Locks(url, namespace=namespace, ttl=CLIENT_TTL))
    calls: list[object] = []
    plain, coroutine = _functions(calls)
    held = locks.acquire(HELD, ttl=BYSTANDER_TTL, info={"role": "bystander"})
    x = Ctx(locks, held, function=plain, wrong_function=coroutine, calls=calls)
    if setup in ("released", "expired", "stolen"):
        x.gone = locks.acquire(GONE, ttl=0.05 if setup == "expired" else CLIENT_TTL)
    if setup == "released":
        x.gone.release()
    elif setup == "expired":
        deadline = time.monotonic() + PATIENCE
        while not (x.gone.remaining == 0 and locks.holder(GONE) is None):
            assert time.monotonic() < deadline, "the lease did not expire"
            time.sleep(0.01)
    elif setup == "stolen":
        x.thief = locks.acquire(GONE, steal=True)
    elif setup == "closed":
        x.closed = keymutex.Locks(url, namespace=namespace)
        x.closed.close()
    elif setup == "other":
        x.other = stack.enter_context(keymutex.Locks(url, namespace=namespace + "-other"))
    return x


def _sync_call(row: Bad, locks: keymutex.Locks, x: Ctx) -> None:
    result = row.call(locks, x)
    assert not inspect.isawaitable(result)
    if isinstance(result, contextlib.AbstractContextManager):
        with result:  # lock(): the refusal may only come on entering
            pass


def _refused_by_locks(row: Bad, url: str) -> None:
    with contextlib.ExitStack() as stack:
        x = _sync_ctx(stack, url, row.setup)
        locks = x.client
        before = _state(locks.holders(""), _probe(locks))

        with pytest.raises(row.error, match=_pattern(row, locks)) as caught:
            _sync_call(row, locks, x)

        _check_error(caught.value, row, x)
        assert x.calls == [], "the decorated function ran"
        assert x.held.lost is False
        _assert_unchanged(before, _state(locks.holders(""), _probe(locks)))


async def _aprobe(alocks: keymutex.AsyncLocks) -> keymutex.AsyncLease:
    lease = await alocks.acquire(KEY, timeout=0)
    await lease.release()
    return lease


async def _async_ctx(stack: contextlib.AsyncExitStack, url: str, setup: str | None) -> Ctx:
    namespace = _namespace()
    alocks = await stack.enter_async_context(
        keymutex.AsyncLocks(url, namespace=namespace, ttl=CLIENT_TTL)
    )
    calls: list[object] = []
    plain, coroutine = _functions(calls)
    held = await alocks.acquire(HELD, ttl=BYSTANDER_TTL, info={"role": "bystander"})
    x = Ctx(alocks, held, function=coroutine, wrong_function=plain, calls=calls)
    if setup in ("released", "expired", "stolen"):
        x.gone = await alocks.acquire(GONE, ttl=0.05 if setup == "expired" else CLIENT_TTL)
    if setup == "released":
        await x.gone.release()
    elif setup == "expired":
        deadline = time.monotonic() + PATIENCE
        while not (x.gone.remaining == 0 and await alocks.holder(GONE) is None):
            assert time.monotonic() < deadline, "the lease did not expire"
            await asyncio.sleep(0.01)
    elif setup == "stolen":
        x.thief = await alocks.acquire(GONE, steal=True)
    elif setup == "closed":
        x.closed = keymutex.AsyncLocks(url, namespace=namespace)
        await x.closed.aclose()
    elif setup == "other":
        x.other = await stack.enter_async_context(
            keymutex.AsyncLocks(url, namespace=namespace + "-other")
        )
    return x


async def _async_call(row: Bad, alocks: keymutex.AsyncLocks, x: Ctx) -> None:
    result = row.call(alocks, x)
    if inspect.isawaitable(result):
        result = await result
    if isinstance(result, contextlib.AbstractAsyncContextManager):
        async with result:  # lock(): the refusal may only come on entering
            pass


async def _refused_by_async_locks(row: Bad, url: str) -> None:
    async with contextlib.AsyncExitStack() as stack:
        x = await _async_ctx(stack, url, row.setup)
        alocks = x.client
        before = _state(await alocks.holders(""), await _aprobe(alocks))

        with pytest.raises(row.error, match=_pattern(row, alocks)) as caught:
            await _async_call(row, alocks, x)

        _check_error(caught.value, row, x)
        assert x.calls == [], "the decorated function ran"
        assert x.held.lost is False
        _assert_unchanged(before, _state(await alocks.holders(""), await _aprobe(alocks)))


@pytest.mark.parametrize("row", ROWS)
def test_refused(row: Bad, bad_input_store: str) -> None:
    """The row through ``Locks``, then through ``AsyncLocks``, on one store.

    ``AsyncLocks`` runs on ``sqlite://`` only: on ``memory://`` its store is the same
    table behind the same adapter, run inline, and the checks are the same code.
    """
    with _through("Locks"):
        _refused_by_locks(row, bad_input_store)
    if bad_input_store.startswith("sqlite:"):
        with _through("AsyncLocks"):
            asyncio.run(_refused_by_async_locks(row, bad_input_store))


# -- constructors: Locks(url, namespace=, ttl=, owner=, **store_options) --------------------

# fmt: off
# (arguments besides the URL, error, message); the URL is a fresh one of the store.
BAD_CONSTRUCTIONS: list[Any] = [
    *(
        pytest.param({"namespace": value}, error, message, id=f"namespace-{name}")
        for name, value, error, message in [
            ("int", 42, TypeError, "namespace must be a str, not int"),
            ("bytes", b"ns", TypeError, "namespace must be a str, not bytes"),
            ("none", None, TypeError, "namespace must be a str, not NoneType"),
            ("257-bytes", "n" * 257, ValueError, "namespace is 257 bytes as UTF-8; at most 256 are accepted"),
            ("nul", "n\x00", ValueError, "namespace must not contain NUL characters"),
            ("lone-surrogate", "\ud800", ValueError, "namespace must be valid Unicode text; it contains a lone surrogate"),
        ]
    ),
    *(
        pytest.param({"owner": value}, error, message, id=f"owner-{name}")
        for name, value, error, message in [
            ("int", 42, TypeError, "owner must be a str, not int"),
            ("bytes", b"me", TypeError, "owner must be a str, not bytes"),
            ("empty", "", ValueError, "owner must not be empty: 1 to 256 bytes of UTF-8 text are accepted"),
            ("257-bytes", "o" * 257, ValueError, "owner is 257 bytes as UTF-8; at most 256 are accepted"),
            ("nul", "me\x00", ValueError, "owner must not contain NUL characters"),
            ("lone-surrogate", "\udc80", ValueError, "owner must be valid Unicode text; it contains a lone surrogate"),
        ]
    ),
    *(
        pytest.param({"ttl": value}, error, message, id=f"ttl-{name}", marks=_xfail(bug))
        for name, value, error, message, bug in [*BAD_TTLS, ("none", None, TypeError, TTL_TYPE + "None", None)]
    ),
    pytest.param(
        {"nosuch": 1},
        TypeError,
        {"memory": "the memory store takes no options, got ['nosuch']", "sqlite": "unknown SQLite store option(s) ['nosuch']; accepted: synchronous, busy_timeout"},
        id="unknown-store-option",
    ),
]
# fmt: on


def _fresh_url(kind: str, tmp_path: Path) -> tuple[str, Callable[[], bool]]:
    """A URL nothing has opened yet, and a check that nothing has opened it since."""
    if kind == "memory":
        name = f"bad-input-{uuid.uuid4().hex}"
        return f"memory://{name}", lambda: name not in memory_store._TABLES
    path = tmp_path / "fresh" / "locks.db"
    path.parent.mkdir()
    return f"sqlite:///{path}", lambda: list(path.parent.iterdir()) == []


async def _aconstruct(url: object, arguments: dict[str, Any]) -> None:
    await keymutex.AsyncLocks(url, **arguments).aclose()  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
@pytest.mark.parametrize(("arguments", "error", "message"), BAD_CONSTRUCTIONS)
def test_refused_by_the_constructor(
    kind: str,
    arguments: dict[str, Any],
    error: type[Exception],
    message: str | dict[str, str],
    tmp_path: Path,
) -> None:
    """``Locks(...)`` and ``AsyncLocks(...)`` refuse before they open the store."""
    text = re.escape(message[kind] if isinstance(message, dict) else message)
    url, untouched = _fresh_url(kind, tmp_path)
    with _through("Locks"), pytest.raises(error, match=text):
        keymutex.Locks(url, **arguments).close()  # close() only if wrongly accepted
    with _through("AsyncLocks"), pytest.raises(error, match=text):
        asyncio.run(_aconstruct(url, arguments))
    assert untouched(), "the constructor touched the store"


# -- URLs --------------------------------------------------------------------------------

KNOWN = "known schemes: etcd, etcds, http, https, memcached, memory, mongodb, mongodb+srv, postgres, postgresql, redis, redis+cluster, redis+sentinel, rediss, sqlite, unix, zookeeper, zookeepers"  # fmt: skip
PARSE = "does not parse as a store URL: expected scheme://…, with a scheme among etcd, etcds, http"
HTTP = "http://127.0.0.1:7420"

# fmt: off
# (id, URL with {tmp} for the test's directory, options, error, message, bug)
BAD_URLS: list[tuple[str, object, dict[str, object], type[Exception], str, str | None]] = [
    # Not a string, no scheme, an unknown scheme.
    ("int", 42, {}, TypeError, "url must be a str such as 'sqlite:///path/locks.db', not int", None),
    ("none", None, {}, TypeError, "url must be a str such as 'sqlite:///path/locks.db', not None", None),
    ("bytes", b"memory://", {}, TypeError, "url must be a str such as 'sqlite:///path/locks.db', not bytes", None),
    ("path", Path("locks.db"), {}, TypeError, "url must be a str such as 'sqlite:///path/locks.db', not PosixPath", None),
    ("empty", "", {}, ValueError, "url '' " + PARSE, None),
    ("blank", "   ", {}, ValueError, "url '   ' " + PARSE, None),
    ("words", "not a url", {}, ValueError, "url 'not a url' " + PARSE, None),
    ("no-scheme", "://host", {}, ValueError, "url '://host' " + PARSE, None),
    ("scheme-only", "memory", {}, ValueError, "url 'memory' " + PARSE, None),
    ("leading-space", " memory://", {}, ValueError, "url ' memory://' " + PARSE, None),
    ("leading-nul", "\x00memory://", {}, ValueError, PARSE, None),
    ("unknown-scheme", "nosuch://x", {}, ValueError, "unknown store URL scheme 'nosuch'; " + KNOWN, None),
    ("file-scheme", "file:///{tmp}/locks.db", {}, ValueError, "unknown store URL scheme 'file'; known schemes:", None),
    ("sqlite3-scheme", "sqlite3:///{tmp}/locks.db", {}, ValueError, "unknown store URL scheme 'sqlite3'; known schemes:", None),
    ("mysql-scheme", "mysql://h/db", {}, ValueError, "unknown store URL scheme 'mysql'; known schemes:", None),
    # memory://
    ("memory-path", "memory:///x", {}, ValueError, "memory URLs are memory:// or memory://NAME, not 'memory:///x'", None),
    ("memory-query", "memory://a?x=1", {}, ValueError, "memory URLs are memory:// or memory://NAME, not 'memory://a?x=1'", None),
    ("memory-fragment", "memory://a#f", {}, ValueError, "memory URLs are memory:// or memory://NAME, not 'memory://a#f'", None),
    ("memory-option", "memory://", {"ttl_max": 1}, TypeError, "the memory store takes no options, got ['ttl_max']", None),
    # sqlite://
    ("sqlite-no-path", "sqlite://", {}, ValueError, "SQLite URL 'sqlite://' names no file: use sqlite:///path/to/locks.db", None),
    ("sqlite-root", "sqlite:///", {}, ValueError, "SQLite URL 'sqlite:///' names no file: use sqlite:///path/to/locks.db", None),
    ("sqlite-host", "sqlite://host/{tmp}/locks.db", {}, ValueError, "SQLite URLs have no host: use sqlite:///absolute/path.db or sqlite:relative/path.db", None),
    ("sqlite-fragment", "sqlite:///{tmp}/locks.db#x", {}, ValueError, "has a fragment ('#x'); a # in the file's name is written %23", None),
    ("sqlite-option-twice", "sqlite:///{tmp}/locks.db?synchronous=full", {"synchronous": "normal"}, ValueError, "option(s) ['synchronous'] given both in the URL and as arguments", None),
    ("sqlite-synchronous", "sqlite:///{tmp}/locks.db?synchronous=bogus", {}, ValueError, "synchronous must be 'normal' or 'full', not 'bogus'", None),
    ("sqlite-busy-timeout-negative", "sqlite:///{tmp}/locks.db?busy_timeout=-1", {}, ValueError, "SQLite option busy_timeout must be seconds > 0 and at most 2147483, not '-1'", None),
    ("sqlite-busy-timeout-zero", "sqlite:///{tmp}/locks.db?busy_timeout=0", {}, ValueError, "SQLite option busy_timeout must be seconds > 0 and at most 2147483, not '0'", None),
    ("sqlite-busy-timeout-nan", "sqlite:///{tmp}/locks.db?busy_timeout=nan", {}, ValueError, "SQLite option busy_timeout must be seconds > 0 and at most 2147483, not 'nan'", None),
    ("sqlite-busy-timeout-inf", "sqlite:///{tmp}/locks.db?busy_timeout=inf", {}, ValueError, "SQLite option busy_timeout must be seconds > 0 and at most 2147483, not 'inf'", None),
    ("sqlite-busy-timeout-word", "sqlite:///{tmp}/locks.db?busy_timeout=soon", {}, ValueError, "SQLite option busy_timeout must be seconds, not 'soon'", None),
    ("sqlite-unknown-query", "sqlite:///{tmp}/locks.db?journal=wal", {}, TypeError, "unknown SQLite store option(s) ['journal']; accepted: synchronous, busy_timeout", None),
    ("sqlite-synchronous-option", "sqlite:///{tmp}/locks.db", {"synchronous": "off"}, ValueError, "synchronous must be 'normal' or 'full', not 'off'", None),
    ("sqlite-busy-timeout-option", "sqlite:///{tmp}/locks.db", {"busy_timeout": -5}, ValueError, "SQLite option busy_timeout must be seconds > 0 and at most 2147483, not -5", None),
    ("sqlite-unknown-option", "sqlite:///{tmp}/locks.db", {"timeout": 5}, TypeError, "unknown SQLite store option(s) ['timeout']; accepted: synchronous, busy_timeout", None),
    ("sqlite-repeated-query-option", "sqlite:///{tmp}/locks.db?synchronous=full&synchronous=normal", {}, ValueError, "gives the option 'synchronous' more than once", None),
    ("sqlite-busy-timeout-bool", "sqlite:///{tmp}/locks.db", {"busy_timeout": True}, TypeError, "SQLite option busy_timeout must be seconds (a number), not True", None),
    ("sqlite-busy-timeout-huge-int", "sqlite:///{tmp}/locks.db", {"busy_timeout": 10**400}, ValueError, "SQLite option busy_timeout must be seconds > 0 and at most 2147483, not an integer of about 401 digits", None),
    ("sqlite-nul-in-path", "sqlite:///{tmp}/a%00b.db", {}, ValueError, "/a%00b.db': the path must not contain NUL characters", None),
    ("sqlite-surrogate-in-path", "sqlite:///{tmp}/a\ud800b.db", {}, ValueError, "/a\\ud800b.db': the path cannot be encoded for the file system (it contains a lone surrogate)", None),
    ("sqlite-bad-utf8-escape-in-path", "sqlite:///{tmp}/a%FFb.db", {}, ValueError, "/a%FFb.db': the path's percent-escapes (such as %FF) must encode UTF-8", None),
    # http://, https://
    ("http-no-host", "http://", {}, ValueError, "lock server URLs are http://host:port[/base] or https://…, not 'http://'", None),
    ("https-no-host", "https://", {}, ValueError, "lock server URLs are http://host:port[/base] or https://…, not 'https://'", None),
    ("http-port-only", "http://:7420", {}, ValueError, "lock server URLs are http://host:port[/base] or https://…, not 'http://:7420'", None),
    ("http-port-out-of-range", "http://127.0.0.1:99999", {}, ValueError, "Port out of range 0-65535 (lock server URL 'http://127.0.0.1:99999')", None),
    ("http-port-not-a-number", "http://127.0.0.1:abc", {}, ValueError, "Port could not be cast to integer value as 'abc' (lock server URL 'http://127.0.0.1:abc')", None),
    ("http-port-negative", "http://127.0.0.1:-1", {}, ValueError, "Port could not be cast to integer value as '-1'", None),
    ("http-bad-ipv6", "http://[::1:7420", {}, ValueError, "Invalid IPv6 URL", None),
    ("http-credentials", "http://user:secret@127.0.0.1:7420", {}, ValueError, "lock server URL '127.0.0.1' must not carry credentials: pass api_token=… or set $KEYMUTEX_API_TOKEN", None),
    ("http-query", HTTP + "/?ttl=5", {}, ValueError, "lock server URL must have no query or fragment, not 'http://127.0.0.1:7420/?ttl=5'", None),
    ("http-fragment", HTTP + "/#x", {}, ValueError, "lock server URL must have no query or fragment", None),
    ("http-api-token-int", HTTP, {"api_token": 42}, TypeError, "api_token must be a str, not int", None),
    ("http-api-token-non-ascii", HTTP, {"api_token": "tökén"}, ValueError, "api_token must be the API token as the token file has it: visible ASCII characters, without spaces or line breaks", None),
    ("http-api-token-empty", HTTP, {"api_token": ""}, ValueError, "api_token must be the API token as the token file has it: visible ASCII characters, without spaces or line breaks", None),
    ("http-api-token-line-break", HTTP, {"api_token": "x" * 32 + "\n"}, ValueError, "api_token must be the API token as the token file has it: visible ASCII characters, without spaces or line breaks", None),
    ("http-timeout-zero", HTTP, {"timeout": 0}, ValueError, "http store option timeout must be seconds > 0 and at most 2147483, not 0", None),
    ("http-timeout-bool", HTTP, {"timeout": True}, TypeError, "http store option timeout must be seconds (a number), not True", None),
    ("http-timeout-inf", HTTP, {"timeout": math.inf}, ValueError, "http store option timeout must be seconds > 0 and at most 2147483, not inf", None),
    ("http-unknown-option", HTTP, {"retries": 3}, TypeError, "unknown http store option(s) ['retries']; accepted: api_token, timeout", None),
    ("http-lone-surrogate-host", "http://h\ud800st:7420", {}, ValueError, "'http://h\\ud800st:7420' is not a usable lock server URL: Invalid IDNA hostname: 'h\\ud800st'", None),
    # redis://, rediss://, redis+cluster://, redis+sentinel://
    ("redis-port-out-of-range", "redis://127.0.0.1:99999/0", {}, ValueError, "'redis://127.0.0.1:99999/0' is not a Redis URL: Port out of range 0-65535", None),
    ("redis-port-not-a-number", "redis://127.0.0.1:abc/0", {}, ValueError, "'redis://127.0.0.1:abc/0' is not a Redis URL: Port could not be cast to integer value as 'abc'", None),
    ("redis-bad-query-value", "redis://127.0.0.1:6379/0?socket_timeout=soon", {}, ValueError, "is not a Redis URL: Invalid value for 'socket_timeout' in connection URL.", None),
    ("redis-unknown-option", "redis://127.0.0.1:6379/0", {"pool": 3}, TypeError, "unknown Redis store options ['pool']; accepted: ['client_name',", None),
    ("redis-query-socket-timeout-negative", "redis://127.0.0.1:6379/0?socket_timeout=-1", {}, ValueError, "'redis://127.0.0.1:6379/0?socket_timeout=-1' is not a Redis URL: Redis option socket_timeout must be seconds > 0 and at most 2147483, not -1.0", None),
    ("redis-query-max-connections-huge", "redis://127.0.0.1:6379/0?max_connections=100000000", {}, ValueError, "is not a Redis URL: Redis option max_connections must be an int from 2 to 10000, not 100000000", None),
    ("redis-unknown-query", "redis://127.0.0.1:6379/0?colour=blue", {}, ValueError, "'redis://127.0.0.1:6379/0?colour=blue' is not a Redis URL: unknown query option(s) ['colour']; accepted: ['client_name', 'db',", None),
    ("redis-repeated-query", "redis://127.0.0.1:6379/0?db=1&db=2", {}, ValueError, "is not a Redis URL: query option(s) ['db'] given twice", None),
    ("redis-query-timeout", "redis://127.0.0.1:6379/0?timeout=1", {}, ValueError, "is not a Redis URL: unknown query option(s) ['timeout']", None),
    ("redis-query-retry-on-error", "redis://127.0.0.1:6379/0?retry_on_error=TimeoutError", {}, ValueError, "is not a Redis URL: unknown query option(s) ['retry_on_error']", None),
    ("redis-query-tls-option-plain", "redis://127.0.0.1:6379/0?ssl_cert_reqs=none", {}, ValueError, "is not a Redis URL: option ssl_cert_reqs applies to TLS connections only: use a rediss:// URL (this one is redis://)", None),
    ("redis-query-tls-version-plain", "redis://127.0.0.1:6379/0?ssl_min_version=3", {}, ValueError, "option ssl_min_version applies to TLS connections only", None),
    ("redis-tls-option-plain", "redis://127.0.0.1:6379/0", {"ssl_ca_certs": "/etc/ssl/certs/ca.pem"}, ValueError, "Redis store option ssl_ca_certs applies to TLS connections only: use a rediss:// URL (this one is redis://)", None),
    ("redis-cluster-tls-option", "redis+cluster://127.0.0.1:7000", {"ssl_certfile": "/x.pem"}, ValueError, "Redis store option ssl_certfile applies to TLS connections only: use a rediss:// URL (this one is redis+cluster://)", None),
    ("redis-query-protocol", "redis://127.0.0.1:6379/0?protocol=4", {}, ValueError, "is not a Redis URL: protocol must be 2 or 3 (RESP2 or RESP3), not '4'", None),
    ("redis-client-name-space", "redis://127.0.0.1:6379/0", {"client_name": "my app"}, ValueError, "Redis store option client_name must be printable ASCII without spaces, not 'my app'", None),
    ("redis-query-client-name-space", "redis://127.0.0.1:6379/0?client_name=my%20app", {}, ValueError, "is not a Redis URL: Redis store option client_name must be printable ASCII without spaces", None),
    ("redis-database-not-a-number", "redis://127.0.0.1:6379/zero", {}, ValueError, "'redis://127.0.0.1:6379/zero' is not a Redis URL: the database must be a number (/0, /1, …), not 'zero'", None),
    ("rediss-database-two-segments", "rediss://127.0.0.1:6379/0/1", {}, ValueError, "is not a Redis URL: the database must be a number (/0, /1, …), not '0/1'", None),
    ("redis-cluster-no-host", "redis+cluster://", {}, ValueError, "'redis+cluster://': expected host:port[,host:port…], got ''", None),
    ("redis-cluster-no-port", "redis+cluster://127.0.0.1", {}, ValueError, "expected host:port[,host:port…], got '127.0.0.1'", None),
    ("redis-cluster-port-not-a-number", "redis+cluster://127.0.0.1:abc", {}, ValueError, "expected host:port[,host:port…], got '127.0.0.1:abc'", None),
    ("redis-cluster-database", "redis+cluster://127.0.0.1:7000/1", {}, ValueError, "'redis+cluster://127.0.0.1:7000/1': a Redis cluster has only database 0", None),
    ("redis-cluster-query", "redis+cluster://127.0.0.1:7000?x=1", {}, ValueError, "query parameters are not accepted for redis+cluster; pass options as keyword arguments", None),
    ("redis-sentinel-no-service", "redis+sentinel://127.0.0.1:26379", {}, ValueError, "expected redis+sentinel://host:port[,host:port…]/SERVICE[/DB]", None),
    ("redis-sentinel-database-not-a-number", "redis+sentinel://127.0.0.1:26379/svc/x", {}, ValueError, "expected redis+sentinel://host:port[,host:port…]/SERVICE[/DB]", None),
    ("redis-sentinel-query", "redis+sentinel://127.0.0.1:26379/svc?x=1", {}, ValueError, "query parameters are not accepted for redis+sentinel; pass options as keyword arguments", None),
    ("redis-sentinel-port-out-of-range", "redis+sentinel://127.0.0.1:99999/svc", {}, ValueError, "'redis+sentinel://127.0.0.1:99999/svc': port 99999 of '127.0.0.1:99999' is out of range 1-65535", None),
    ("redis-cluster-port-out-of-range", "redis+cluster://127.0.0.1:99999", {}, ValueError, "'redis+cluster://127.0.0.1:99999': port 99999 of '127.0.0.1:99999' is out of range 1-65535", None),
    ("redis-cluster-port-zero", "redis+cluster://127.0.0.1:7000,127.0.0.1:0", {}, ValueError, "port 0 of '127.0.0.1:0' is out of range 1-65535", None),
    # postgresql://
    ("postgresql-unknown-query", "postgresql://127.0.0.1/db?colour=blue", {}, ValueError, "'postgresql://127.0.0.1/db?colour=blue' is not a PostgreSQL URL: invalid URI query parameter: \"colour\"", None),
    ("postgresql-min-size-huge", "postgresql://127.0.0.1/db?min_size=99999999", {}, ValueError, "PostgreSQL option min_size must be an int from 0 to 10000, not '99999999'", None),
    ("postgresql-timeout-huge-int", "postgresql://127.0.0.1/db", {"timeout": 10**400}, ValueError, "PostgreSQL option timeout must be seconds > 0 and at most 2147483, not an integer of about 401 digits", None),
    ("postgresql-connect-timeout", "postgresql://127.0.0.1/db?connect_timeout=-1", {}, ValueError, "PostgreSQL option connect_timeout must be seconds > 0 and at most 2147483, not '-1'", None),
    ("postgresql-unknown-option", "postgresql://127.0.0.1/db", {"pool": 3}, TypeError, "unknown PostgreSQL store option", None),
    ("postgresql-port-not-a-number", "postgresql://127.0.0.1:abc/db", {}, ValueError, "port", None),
    ("postgresql-port-out-of-range", "postgresql://127.0.0.1:99999/db", {}, ValueError, "port", None),
    # memcached://, etcd://, zookeeper://, mongodb://
    ("memcached-port-not-ascii-digits", "memcached://127.0.0.1:\u0663", {}, ValueError, "expected memcached://host[:port][,host[:port]…], got '127.0.0.1:\u0663'", None),
    ("etcd-port-not-ascii-digits", "etcd://127.0.0.1:\u0663", {}, ValueError, "expected host:port[,host:port…], got '127.0.0.1:\u0663'", None),
    ("zookeeper-port-not-ascii-digits", "zookeeper://127.0.0.1:\u0663", {}, ValueError, "got '127.0.0.1:\u0663'", None),
    ("postgresql-port-not-ascii-digits", "postgresql://127.0.0.1:\u0663/db", {}, ValueError, "port must be a number from 1 to 65535, not '\u0663'", None),
    ("redis-cluster-port-not-ascii-digits", "redis+cluster://127.0.0.1:\u0663", {}, ValueError, "expected host:port[,host:port…], got '127.0.0.1:\u0663'", None),
    ("redis-database-not-ascii-digits", "redis://127.0.0.1:6379/\u0663", {}, ValueError, "the database must be a number (/0, /1, …), not '\u0663'", None),
    # Found by review: a host with a space was taken, and failed at the first call
    ("memcached-host-with-space", "memcached://cache host:11211", {}, ValueError, "the memcached host 'cache host' has ' ' in it; a host is a name or an address, without spaces or control characters", None),
    ("redis-host-with-space", "redis://cache host:6379/0", {}, ValueError, "the Redis host 'cache host' has ' ' in it", None),
    ("redis-cluster-host-with-space", "redis+cluster://127.0.0.1:7000,cache host:7001", {}, ValueError, "the Redis host 'cache host' has ' ' in it", None),
    ("redis-sentinel-host-with-space", "redis+sentinel://sentinel one:26379/mymaster", {}, ValueError, "the Redis host 'sentinel one' has ' ' in it", None),
    ("etcd-host-with-space", "etcd://my host:2379", {}, ValueError, "the etcd host 'my host' has ' ' in it", None),
    # urlsplit drops tabs and line breaks without a word: 'a\tb' would be the host 'ab'
    ("etcd-host-with-tab", "etcd://a\tb:2379", {}, ValueError, "is not a etcd URL (etcd[s]://[user:password@]host:port[,host:port…][?timeout=…&ca_file=…&cert_file=…]): it has a tab or a line break in it", None),
    ("memcached-url-with-newline", "memcached://127.0.0.1:11211\n", {}, ValueError, "it has a tab or a line break in it", None),
    ("redis-url-with-newline", "redis://127.0.0.1:6379/0\n", {}, ValueError, "it has a tab or a line break in it", None),
    ("memcached-no-host", "memcached://", {}, ValueError, "'memcached://' names no server: use memcached://host:port", None),
    ("memcached-port-not-a-number", "memcached://127.0.0.1:abc", {}, ValueError, "expected memcached://host[:port][,host[:port]…], got '127.0.0.1:abc'", None),
    ("memcached-port-out-of-range", "memcached://127.0.0.1:99999", {}, ValueError, "expected memcached://host[:port][,host[:port]…], got '127.0.0.1:99999'", None),
    ("memcached-patience-huge-int", "memcached://127.0.0.1:11211", {"patience": 10**400}, ValueError, "memcached option patience must be seconds >= 0 (0: strict hand-over) and at most 2147483, not an integer of about 401 digits", None),
    ("memcached-max-connections-huge", "memcached://127.0.0.1:11211", {"max_connections": 10**30}, ValueError, "memcached option max_connections must be an int from 1 to 10000, not 1000000000000000000000000000000", None),
    ("memcached-socket-timeout-huge-float", "memcached://127.0.0.1:11211", {"socket_timeout": 1e308}, ValueError, "memcached option socket_timeout must be seconds > 0 and at most 2147483, not 1e+308", None),
    ("memcached-query", "memcached://127.0.0.1:11211?x=1", {}, ValueError, "memcached URLs take no query; pass options as keyword arguments", None),
    ("etcd-no-host", "etcd://", {}, ValueError, "'etcd://': expected host:port[,host:port…], got ''", None),
    ("etcd-port-not-a-number", "etcd://127.0.0.1:abc", {}, ValueError, "expected host:port[,host:port…], got '127.0.0.1:abc'", None),
    ("etcd-port-out-of-range", "etcd://127.0.0.1:99999", {}, ValueError, "expected host:port[,host:port…], got '127.0.0.1:99999'", None),
    ("etcd-timeout-huge-int", "etcd://127.0.0.1:2379", {"timeout": 10**400}, ValueError, "etcd option timeout must be seconds > 0 and at most 2147483, not an integer of about 401 digits", None),
    ("etcd-query", "etcd://127.0.0.1:2379?x=1", {}, ValueError, "'etcd://127.0.0.1:2379?x=1': unknown query parameter 'x'; accepted: ['ca_file', 'cert_file', 'key_file', 'timeout']", None),
    ("zookeeper-no-host", "zookeeper://", {}, ValueError, "expected zookeeper://host:port[,host:port…][/chroot], got ''", None),
    ("zookeeper-port-not-a-number", "zookeeper://127.0.0.1:abc", {}, ValueError, "expected zookeeper://host:port[,host:port…][/chroot], got '127.0.0.1:abc'", None),
    ("zookeeper-port-out-of-range", "zookeeper://127.0.0.1:99999", {}, ValueError, "expected zookeeper://host:port[,host:port…][/chroot], got '127.0.0.1:99999'", None),
    ("zookeeper-timeout-huge-negative-int", "zookeeper://127.0.0.1:2181", {"timeout": -(10**400)}, ValueError, "ZooKeeper option timeout must be seconds > 0 and at most 2147483, not a negative integer of about 401 digits", None),
    ("zookeeper-session-timeout-huge-float", "zookeeper://127.0.0.1:2181?session_timeout=1e308", {}, ValueError, "ZooKeeper option session_timeout must be seconds > 0 and at most 2147483, not '1e308'", None),
    ("zookeeper-query", "zookeeper://127.0.0.1:2181?x=1", {}, ValueError, "unknown query parameter 'x'; accepted: ['ca_file', 'cert_file', 'key_file', 'session_timeout', 'timeout']", None),
    ("mongodb-no-host", "mongodb://", {}, ValueError, "'mongodb://' is not a usable MongoDB URL: Must provide at least one hostname or IP", None),
    ("mongodb-port-out-of-range", "mongodb://127.0.0.1:99999", {}, ValueError, "'mongodb://127.0.0.1:99999' is not a usable MongoDB URL: Port must be an integer between 0 and 65535", None),
    ("mongodb-port-not-a-number", "mongodb://127.0.0.1:abc", {}, ValueError, "'mongodb://127.0.0.1:abc' is not a usable MongoDB URL: Port contains non-digit characters", None),
    ("mongodb-unknown-query", "mongodb://127.0.0.1/?colour=blue", {}, ValueError, "'mongodb://127.0.0.1/?colour=blue' is not a usable MongoDB URL: unknown option 'colour' in its query", None),
    ("mongodb-bad-query-value", "mongodb://127.0.0.1/?serverSelectionTimeoutMS=soon", {}, ValueError, "is not a usable MongoDB URL:", None),
    ("mongodb-unreadable-ca-file", "mongodb://127.0.0.1/?tls=true&tlsCAFile=/nonexistent/ca.pem", {}, ValueError, "is not a usable MongoDB URL:", None),
    # URLs that do not split at all, for every store
    ("redis-bad-ipv6", "redis://[::1", {}, ValueError, "'redis://[::1' is not a Redis URL (redis://host:port/db, rediss://…, unix://…, redis+cluster://…, redis+sentinel://…): Invalid IPv6 URL", None),
    ("postgresql-bad-ipv6", "postgresql://[::1/db", {}, ValueError, "'postgresql://[::1/db' is not a PostgreSQL URL (postgresql://[user[:password]@]host[:port]/dbname): Invalid IPv6 URL", None),
    ("memcached-bad-ipv6", "memcached://[::1", {}, ValueError, "'memcached://[::1' is not a memcached URL (memcached://host[:port][,host[:port]…]): Invalid IPv6 URL", None),
    ("mongodb-bad-ipv6", "mongodb://[::1", {}, ValueError, "'mongodb://[::1' is not a MongoDB URL (mongodb://… or mongodb+srv://…): Invalid IPv6 URL", None),
    ("http-bad-ipv6", "http://[::1", {}, ValueError, "'http://[::1' is not a lock server URL (http://host:port[/base] or https://…): Invalid IPv6 URL", None),
    ("memory-bad-ipv6", "memory://[::1", {}, ValueError, "'memory://[::1' is not a memory URL (memory:// or memory://NAME): Invalid IPv6 URL", None),
    ("sqlite-bad-ipv6", "sqlite://[::1/x", {}, ValueError, "'sqlite://[::1/x' is not a SQLite URL (sqlite:///path/to/locks.db): Invalid IPv6 URL", None),
    # Redis client options: checked when the client is made, not at the first command
    ("redis-socket-timeout-word", "redis://127.0.0.1:1/0", {"socket_timeout": "x"}, TypeError, "Redis option socket_timeout must be seconds (a number), not 'x'", None),
    ("redis-socket-timeout-huge-int", "redis://127.0.0.1:1/0", {"socket_timeout": 10**400}, ValueError, "Redis option socket_timeout must be seconds > 0 and at most 2147483, not an integer of about 401 digits", None),
    ("redis-socket-timeout-negative", "redis://127.0.0.1:1/0", {"socket_timeout": -1}, ValueError, "Redis option socket_timeout must be seconds > 0 and at most 2147483, not -1", None),
    ("redis-health-check-list", "redis://127.0.0.1:1/0", {"health_check_interval": [1]}, TypeError, "Redis option health_check_interval must be seconds (a number), not [1]", None),
    ("redis-health-check-negative", "redis://127.0.0.1:1/0", {"health_check_interval": -1}, ValueError, "Redis option health_check_interval must be seconds >= 0 (0: never) and at most 2147483, not -1", None),
    ("redis-max-connections-zero", "redis://127.0.0.1:1/0", {"max_connections": 0}, ValueError, "Redis option max_connections must be an int from 2 to 10000, not 0", None),
    ("redis-password-not-text", "redis://127.0.0.1:1/0", {"password": 1234}, TypeError, "Redis store option password must be a str, not a value", None),
    # The lock server's range of ttl, refused before anything is sent
    ("http-ttl-above-a-day", "http://127.0.0.1:1", {"ttl": 86401}, ValueError, "ttl must be greater than 0 and at most 86400 s, not 86401", None),
]
# fmt: on

URL_ROWS = [
    pytest.param(url, options, error, message, id=name, marks=_xfail(bug))
    for name, url, options, error, message, bug in BAD_URLS
]


@contextlib.contextmanager
def _nothing_created(tmp_path: Path) -> Iterator[None]:
    before = sorted(tmp_path.rglob("*"))
    yield
    assert sorted(tmp_path.rglob("*")) == before, "a bad URL created files"


def _url(url: object, tmp_path: Path) -> object:
    return url.replace("{tmp}", str(tmp_path).lstrip("/")) if isinstance(url, str) else url


@pytest.mark.parametrize(("url", "options", "error", "message"), URL_ROWS)
def test_bad_url_is_refused(
    url: object, options: dict[str, Any], error: type[Exception], message: str, tmp_path: Path
) -> None:
    """``Locks(url)`` and ``AsyncLocks(url)`` refuse, and create no file."""
    url = _url(url, tmp_path)
    with _nothing_created(tmp_path):
        with _through("Locks"), pytest.raises(error, match=re.escape(message)):
            keymutex.Locks(url, **options).close()  # type: ignore[arg-type]
        with _through("AsyncLocks"), pytest.raises(error, match=re.escape(message)):
            asyncio.run(_aconstruct(url, options))


# -- KeyedLock and AsyncKeyedLock ------------------------------------------------------------

HASHABLE = "key must be hashable (usable as a dict key), not "


@dataclass(frozen=True)
class LocalBad:
    call: Callable[[Any], object]
    error: type[BaseException]
    message: str
    setup: str | None = None  # "released": KEY was acquired and released before


def _local(
    case_id: str,
    call: Callable[[Any], object],
    error: type[BaseException],
    message: str,
    *,
    setup: str | None = None,
    xfail: str | None = None,
) -> Any:
    return pytest.param(LocalBad(call, error, message, setup), id=case_id, marks=_xfail(xfail))


# fmt: off
LOCAL_ROWS = [
    _local("constructor-argument", lambda kl: type(kl)(1), TypeError, "__init__() takes 1 positional argument but 2 were given"),
    _local("acquire-list", lambda kl: kl.acquire([1]), TypeError, HASHABLE + "list"),
    _local("acquire-dict", lambda kl: kl.acquire({}), TypeError, HASHABLE + "dict"),
    _local("acquire-set", lambda kl: kl.acquire(set()), TypeError, HASHABLE + "set"),
    _local("acquire-list-timeout-0", lambda kl: kl.acquire([1], timeout=0), TypeError, HASHABLE + "list"),
    _local("call-list", lambda kl: kl([1]), TypeError, HASHABLE + "list"),
    _local("release-list", lambda kl: kl.release([1]), TypeError, HASHABLE + "list"),
    _local("locked-list", lambda kl: kl.locked([1]), TypeError, HASHABLE + "list"),
    _local("release-free", lambda kl: kl.release(KEY), RuntimeError, "cannot release 'doc': it is not held"),
    _local("release-twice", lambda kl: kl.release(KEY), RuntimeError, "cannot release 'doc': it is not held", setup="released"),
    _local("acquire-unknown-keyword", lambda kl: kl.acquire(KEY, wait=1), TypeError, "unexpected keyword argument 'wait'"),
    _local("call-unknown-keyword", lambda kl: kl(KEY, wait=1), TypeError, "unexpected keyword argument 'wait'"),
    *(
        _local(f"{point}-timeout-{name}", lambda kl, c=call, v=value: c(kl, v), error, message, xfail=bug)
        for point, call in [
            ("acquire", lambda kl, t: kl.acquire(KEY, timeout=t)),
            ("call", lambda kl, t: kl(KEY, timeout=t)),
        ]
        for name, value, error, message, bug in BAD_TIMEOUTS
        if not (bug and point != "acquire")
    ),
]
# fmt: on


def _check_local(kl: Any) -> None:
    assert len(kl) == 1, "an entry was left behind (or the held key was let go)"
    assert kl.locked(HELD)
    assert not kl.locked(KEY)


def _refused_by_keyed_lock(row: LocalBad) -> None:
    kl = keymutex.KeyedLock()
    assert kl.acquire(HELD)
    if row.setup == "released":
        kl.acquire(KEY)
        kl.release(KEY)
    with pytest.raises(row.error, match=re.escape(row.message)):
        _enter(row.call(kl))
    _check_local(kl)


def _enter(result: object) -> None:
    if isinstance(result, contextlib.AbstractContextManager):
        with result:  # kl(key): the key is checked on entering
            pass


async def _aenter(result: object) -> None:
    if inspect.isawaitable(result):
        await result
    elif isinstance(result, contextlib.AbstractAsyncContextManager):
        async with result:
            pass


async def _refused_by_async_keyed_lock(row: LocalBad) -> None:
    akl = keymutex.AsyncKeyedLock()
    assert await akl.acquire(HELD)
    if row.setup == "released":
        await akl.acquire(KEY)
        akl.release(KEY)
    with pytest.raises(row.error, match=re.escape(row.message)):
        await _aenter(row.call(akl))
    _check_local(akl)


@pytest.mark.parametrize("row", LOCAL_ROWS)
def test_refused_by_keyed_lock(row: LocalBad) -> None:
    """The row through ``KeyedLock``, then ``AsyncKeyedLock``: nothing held is let go."""
    with _through("KeyedLock"):
        _refused_by_keyed_lock(row)
    with _through("AsyncKeyedLock"):
        asyncio.run(_refused_by_async_keyed_lock(row))


# -- what looks bad but is accepted (API.md) ------------------------------------------------

# Only NUL and lone surrogates are refused in keys: other control characters, format
# characters and whitespace are valid, kept exactly, and found by prefix.
ODD_BUT_VALID_KEYS = [
    pytest.param("line\nbreak", id="newline"),
    pytest.param("tab\there", id="tab"),
    pytest.param("\x1b[2J\x1b]0;title\x07", id="terminal-escapes"),
    pytest.param("del\x7f", id="del"),
    pytest.param("c1\x85\x9b", id="c1-controls"),
    pytest.param("line\u2028separator", id="line-separator"),
    pytest.param("\ufeffbom", id="byte-order-mark"),
    pytest.param("rtl\u202eoverride", id="bidi-override"),
    pytest.param(" ", id="single-space"),
    pytest.param("k" * 1024, id="1024-bytes"),
    pytest.param("é" * 512, id="1024-utf8-bytes"),
    pytest.param("\U0001f512" * 256, id="1024-bytes-of-emoji"),
]


@pytest.mark.parametrize("key", ODD_BUT_VALID_KEYS)
def test_odd_but_valid_keys_are_kept_exactly(key: str, bad_input_store: str) -> None:
    with keymutex.Locks(bad_input_store, namespace=_namespace()) as locks:
        lease = locks.acquire(key, timeout=0)
        holder = locks.holder(key)
        assert holder is not None
        assert holder.key == key
        assert holder.fence == lease.fence
        assert [h.key for h in locks.holders(key)] == [key]
        locks.release(key, lease.token)
        assert locks.holder(key) is None


def test_accepted_edges_of_the_ranges(bad_input_store: str) -> None:
    """``timeout=0`` tries once, info of exactly 4096 bytes fits, NUL inside info is data."""
    with keymutex.Locks(bad_input_store, namespace=_namespace()) as locks:
        lease = locks.acquire(KEY, timeout=0, info=_info_of(4096))
        assert lease.info == _info_of(4096)
        with pytest.raises(keymutex.Locked) as caught:
            locks.acquire(KEY, timeout=0)
        assert caught.value.holder is not None
        assert caught.value.holder.fence == lease.fence
        lease.release()
        for timeout in (0, 0.0, -0.0, 1e308):
            locks.acquire(KEY, timeout=timeout, info={"nul": "\x00", "empty": {}}).release()
        locks.acquire(KEY, ttl=1, timeout=0).release()  # an int TTL
        assert locks.holders("") == []


def test_the_least_ttl_is_granted(bad_input_store: str) -> None:
    """``ttl=0.001`` (1 ms, the least accepted) is granted, and then expires."""
    with keymutex.Locks(bad_input_store, namespace=_namespace()) as locks:
        lease = locks.acquire(KEY, ttl=0.001, timeout=0)
        assert lease.fence > 0
        deadline = time.monotonic() + PATIENCE
        while locks.holder(KEY) is not None:
            assert time.monotonic() < deadline, "the lease did not expire"
            time.sleep(0.005)
        assert lease.lost


def test_info_is_measured_in_utf8_bytes(bad_input_store: str) -> None:
    """4096 bytes of compact JSON as UTF-8 (as the lock server receives it) fit: "é" is 2."""
    with keymutex.Locks(bad_input_store, namespace=_namespace()) as locks:
        for info in ({"b": "é" * 2044}, {"b": "é" * 1500}, {"é" * 1000: "🔒" * 500}):
            lease = locks.acquire(KEY, timeout=0, info=info)
            assert lease.info == info
            holder = locks.holder(KEY)
            assert holder is not None
            assert holder.info == info
            lease.release()


def test_leases_of_a_closed_client_refuse(bad_input_store: str) -> None:
    """``Lease.renew`` / ``release`` go through their client: closed, it refuses them too."""
    namespace = _namespace()
    locks = keymutex.Locks(bad_input_store, namespace=namespace, ttl=CLIENT_TTL)
    lease = locks.acquire(KEY)
    locks.close()
    for call in (lease.renew, lease.release, lambda: lease.renew(ttl=5)):
        with pytest.raises(RuntimeError, match="this Locks is closed"):
            call()
    with keymutex.Locks(bad_input_store, namespace=namespace) as again:
        holder = again.holder(KEY)  # untouched: still held, by the same lease
        assert holder is not None
        assert holder.fence == lease.fence
        assert abs(holder.expires_at - lease.expires_at) < EXPIRY_SLACK
        again.release(KEY, lease.token)


def test_leases_of_a_closed_async_client_refuse(tmp_path: Path) -> None:
    async def main() -> None:
        url = f"sqlite:///{tmp_path}/locks.db"
        alocks = keymutex.AsyncLocks(url, ttl=CLIENT_TTL)
        lease = await alocks.acquire(KEY)
        await alocks.aclose()
        for call in (lease.renew, lease.release):
            with pytest.raises(RuntimeError, match="this AsyncLocks is closed"):
                await call()
        async with keymutex.AsyncLocks(url) as again:
            holder = await again.holder(KEY)
            assert holder is not None
            assert holder.fence == lease.fence

    asyncio.run(main())


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("", id="empty-str"),
        pytest.param("\x00", id="nul"),
        pytest.param("\ud800", id="lone-surrogate"),
        pytest.param(None, id="none"),
        pytest.param(0, id="zero"),
        pytest.param((1, "a"), id="tuple"),
        pytest.param(frozenset({1}), id="frozenset"),
        pytest.param(b"bytes", id="bytes"),
    ],
)
def test_keyed_lock_takes_any_hashable_key(key: object) -> None:
    kl = keymutex.KeyedLock()
    assert kl.acquire(key, timeout=0)
    assert kl.acquire(key, timeout=0) is False  # held: tried once
    kl.release(key)
    with kl(key, timeout=0):
        assert kl.locked(key)
    assert len(kl) == 0


# -- found by an audit against API.md (2026-11-22) -------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://u:s3cret@localhost:abc",
        "redis+cluster://u:s3cret@localhost:abc",
        "postgresql://u:s3cret@h:abc/db",
        "postgresql://h/db?user=u&password=s3cret&port=abc",
        "mongodb://u:s3cret@h:abc",
        "memcached://u:s3cret@h:11211",
        "http://u:s3cret@h:abc",
        "etcd://u:s3cret@h:abc",
        "zookeeper://u:s3cret@h:abc",
        "redis://u:s3cret@[::1",
        "nosuch://u:s3cret@h",
    ],
)
def test_no_error_about_a_url_shows_its_password(url: str) -> None:
    with pytest.raises((TypeError, ValueError)) as refused:
        keymutex.Locks(url).close()
    assert "s3cret" not in str(refused.value)
    assert "***" in str(refused.value) or "u:" not in str(refused.value)


def test_an_async_on_lost_is_refused_where_nothing_would_await_it(tmp_path: Path) -> None:
    async def on_lost(lease: object) -> None:  # pragma: no cover - must never be called
        pass

    with keymutex.Locks(f"sqlite:///{tmp_path}/locks.db") as locks:
        for call in (
            lambda: locks.acquire(KEY, on_lost=on_lost),
            lambda: locks.lock(KEY, on_lost=on_lost),
            lambda: locks.locked("k", on_lost=on_lost),
        ):
            with pytest.raises(TypeError, match="on_lost must be a plain function for Locks"):
                call()
        assert locks.holder(KEY) is None

    async def main() -> None:  # AsyncLocks awaits it: accepted
        async with keymutex.AsyncLocks(f"sqlite:///{tmp_path}/locks.db") as alocks:
            await (await alocks.acquire(KEY, on_lost=on_lost)).release()

    asyncio.run(main())


@pytest.mark.parametrize("url", ["memory://", "sqlite:///{tmp}/locks.db"])
def test_a_holder_s_info_is_a_copy_nobody_else_sees_changed(url: str, tmp_path: Path) -> None:
    with keymutex.Locks(url.replace("{tmp}", str(tmp_path)), namespace=_namespace()) as locks:
        lease = locks.acquire(KEY, info={"user": "bob"})
        lease.info["user"] = "mallory"  # type: ignore[index]
        seen = locks.holder(KEY)
        assert seen is not None
        assert seen.info == {"user": "bob"}
        seen.info["user"] = "eve"  # type: ignore[index]
        assert [h.info for h in locks.holders("")] == [{"user": "bob"}]
        lease.release()


def test_a_grant_that_lands_on_a_closed_client_is_given_back() -> None:
    """``close()`` while an acquire is on its way: the caller gets ``RuntimeError`` and
    no lease is left held (it would otherwise stay until its TTL, with no token)."""
    namespace = _namespace()
    with keymutex.Locks("memory://audit", namespace=namespace) as other:
        locks = keymutex.Locks("memory://audit", namespace=namespace)
        store = locks._store  # type: ignore[attr-defined]
        granting = store.try_acquire

        def try_acquire(*args: Any, **kwargs: Any) -> Any:
            outcome = granting(*args, **kwargs)
            locks.close()  # another thread closes the client meanwhile
            return outcome

        store.try_acquire = try_acquire
        with pytest.raises(RuntimeError, match="closed"):
            locks.acquire(KEY, renew=True)
        assert other.holder(KEY) is None

    async def main() -> None:
        async with keymutex.AsyncLocks("memory://audit", namespace=namespace) as other:
            alocks = keymutex.AsyncLocks("memory://audit", namespace=namespace)
            astore = alocks._store  # type: ignore[attr-defined]
            agranting = astore.try_acquire

            async def atry_acquire(*args: Any, **kwargs: Any) -> Any:
                outcome = await agranting(*args, **kwargs)
                await alocks.aclose()
                return outcome

            astore.try_acquire = atry_acquire
            with pytest.raises(RuntimeError, match="closed"):
                await alocks.acquire(KEY, renew=True)
            await asyncio.sleep(0.05)  # the give-back runs in the background
            assert await other.holder(KEY) is None

    asyncio.run(main())


def test_a_missing_directory_for_the_sqlite_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    with pytest.raises(keymutex.StoreError, match=r"its directory .*no-such-dir' does not exist"):
        keymutex.Locks(f"sqlite:///{missing}/locks.db")
    assert not missing.exists()


def test_a_client_shows_its_store_without_the_password() -> None:
    locks = keymutex.Locks("redis://me:s3cret@127.0.0.1:1/0", namespace="shop")
    assert repr(locks) == "Locks('redis://me:***@127.0.0.1:1/0', namespace='shop')"
    locks.close()
    assert repr(locks).endswith(", closed)")

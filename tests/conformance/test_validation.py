"""Bad arguments raise ``ValueError`` / ``TypeError`` naming the argument, before any I/O.

Each case is a call on a client; the sync and async tests run the same table. After
each refusal the store must be unchanged: no lease appeared, none was renewed or
released.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import pytest

import keymutex

from ._support import assert_is_holder_of

Call = Callable[[Any], Any]

LONG_KEY = "a" * 1025
LONG_UTF8_KEY = "é" * 512 + "a"  # 513 characters but 1025 bytes: the limit is in bytes
BIG_INFO = {"blob": "x" * 5000}


def _bad(call: object, error: object, name: str, case_id: str) -> Any:
    """One refused call: what to call, the error it must raise, the name its message gives."""
    return pytest.param(call, error, name, id=case_id)


ANY = (TypeError, ValueError)

# Calls that must be refused on a fresh namespace; ``c`` is the client.
ACQUIRE_CASES = [
    _bad(lambda c: c.acquire(""), ValueError, "key", "key-empty"),
    _bad(lambda c: c.acquire(LONG_KEY), ValueError, "key", "key-1025-bytes"),
    _bad(lambda c: c.acquire(LONG_UTF8_KEY), ValueError, "key", "key-1025-utf8-bytes"),
    _bad(lambda c: c.acquire(42), TypeError, "key", "key-int"),
    _bad(lambda c: c.acquire(b"doc"), TypeError, "key", "key-bytes"),
    _bad(lambda c: c.acquire(None), TypeError, "key", "key-none"),
    _bad(lambda c: c.acquire("a\x00b"), ValueError, "key", "key-nul"),
    _bad(lambda c: c.acquire("a\ud800b"), ValueError, "key", "key-lone-surrogate"),
    _bad(lambda c: c.acquire("doc", ttl=0), ValueError, "ttl", "ttl-zero"),
    _bad(lambda c: c.acquire("doc", ttl=-1), ValueError, "ttl", "ttl-negative"),
    _bad(lambda c: c.acquire("doc", ttl=math.nan), ValueError, "ttl", "ttl-nan"),
    _bad(lambda c: c.acquire("doc", ttl=math.inf), ValueError, "ttl", "ttl-inf"),
    _bad(lambda c: c.acquire("doc", ttl=True), ANY, "ttl", "ttl-bool"),
    _bad(lambda c: c.acquire("doc", ttl="1"), TypeError, "ttl", "ttl-str"),
    _bad(lambda c: c.acquire("doc", timeout=-1), ValueError, "timeout", "timeout-negative"),
    _bad(lambda c: c.acquire("doc", timeout=math.nan), ValueError, "timeout", "timeout-nan"),
    _bad(lambda c: c.acquire("doc", timeout=math.inf), ValueError, "timeout", "timeout-inf"),
    _bad(lambda c: c.acquire("doc", timeout=True), ANY, "timeout", "timeout-bool"),
    _bad(lambda c: c.acquire("doc", timeout=False), ANY, "timeout", "timeout-false"),
    _bad(lambda c: c.acquire("doc", timeout="1"), TypeError, "timeout", "timeout-str"),
    _bad(lambda c: c.acquire("doc", info=[1, 2]), ANY, "info", "info-list"),
    _bad(lambda c: c.acquire("doc", info="x"), ANY, "info", "info-str"),
    _bad(lambda c: c.acquire("doc", info={"s": {1, 2}}), ANY, "info", "info-set"),
    _bad(lambda c: c.acquire("doc", info={"o": object()}), ANY, "info", "info-object"),
    _bad(lambda c: c.acquire("doc", info={"f": math.nan}), ANY, "info", "info-nan"),
    _bad(lambda c: c.acquire("doc", info={"f": math.inf}), ANY, "info", "info-inf"),
    _bad(lambda c: c.acquire("doc", info=BIG_INFO), ValueError, "info", "info-over-4k"),
    _bad(lambda c: c.acquire("doc", on_lost=42), TypeError, "on_lost", "on-lost-not-callable"),
    _bad(lambda c: c.acquire("doc", steal="yes"), TypeError, "steal", "steal-str"),
    _bad(lambda c: c.acquire("doc", renew="no"), TypeError, "renew", "renew-str"),
    _bad(lambda c: c.renew("", "t" * 24), ValueError, "key", "renew-key-empty"),
    _bad(lambda c: c.renew(7, "t" * 24), TypeError, "key", "renew-key-int"),
    _bad(lambda c: c.renew("doc", 42), TypeError, "token", "renew-token-int"),
    _bad(lambda c: c.renew("doc", None), TypeError, "token", "renew-token-none"),
    _bad(lambda c: c.renew("doc", b"x" * 24), TypeError, "token", "renew-token-bytes"),
    _bad(lambda c: c.renew("doc", ""), ValueError, "token", "renew-token-empty"),
    _bad(lambda c: c.renew("doc", "not a token!"), ValueError, "token", "renew-token-garbage"),
    _bad(lambda c: c.renew("doc", "a\x00" * 12), ValueError, "token", "renew-token-nul"),
    _bad(lambda c: c.renew("doc", "t" * 24, ttl=0), ValueError, "ttl", "renew-ttl-zero"),
    _bad(lambda c: c.renew("doc", "t" * 24, ttl=math.nan), ValueError, "ttl", "renew-ttl-nan"),
    _bad(lambda c: c.release("", "t" * 24), ValueError, "key", "release-key-empty"),
    _bad(lambda c: c.release(LONG_KEY, "t" * 24), ValueError, "key", "release-key-long"),
    _bad(lambda c: c.release("doc", 42), TypeError, "token", "release-token-int"),
    _bad(lambda c: c.release("doc", ""), ValueError, "token", "release-token-empty"),
    _bad(lambda c: c.release("doc", "nope nope"), ValueError, "token", "release-token-garbage"),
    _bad(lambda c: c.holder(""), ValueError, "key", "holder-key-empty"),
    _bad(lambda c: c.holder(42), TypeError, "key", "holder-key-int"),
    _bad(lambda c: c.holder("a\x00"), ValueError, "key", "holder-key-nul"),
    _bad(lambda c: c.holders(42), TypeError, "prefix", "holders-prefix-int"),
    _bad(lambda c: c.holders(None), TypeError, "prefix", "holders-prefix-none"),
    _bad(lambda c: c.holders(b"a"), TypeError, "prefix", "holders-prefix-bytes"),
]

# The same checks through lock(), entered as a context manager.
LOCK_CASES = [
    _bad({"key": ""}, ValueError, "key", "lock-key-empty"),
    _bad({"key": 42}, TypeError, "key", "lock-key-int"),
    _bad({"key": "doc", "ttl": 0}, ValueError, "ttl", "lock-ttl-zero"),
    _bad({"key": "doc", "ttl": True}, ANY, "ttl", "lock-ttl-bool"),
    _bad({"key": "doc", "timeout": -0.5}, ValueError, "timeout", "lock-timeout-negative"),
    _bad({"key": "doc", "info": {"x": {1}}}, ANY, "info", "lock-info-set"),
    _bad({"key": "doc", "info": BIG_INFO}, ValueError, "info", "lock-info-over-4k"),
]

CONSTRUCTOR_CASES = [
    _bad(lambda cls, url: cls("nosuch://x"), ValueError, "(?i)url|scheme", "url-unknown-scheme"),
    _bad(lambda cls, url: cls(""), ValueError, "(?i)url", "url-empty"),
    _bad(lambda cls, url: cls("not a url"), ValueError, "(?i)url", "url-unparsable"),
    _bad(lambda cls, url: cls(42), TypeError, "(?i)url", "url-int"),
    _bad(lambda cls, url: cls(None), TypeError, "(?i)url", "url-none"),
    _bad(lambda cls, url: cls(url, namespace=42), TypeError, "namespace", "namespace-int"),
    _bad(lambda cls, url: cls(url, namespace=b"ns"), TypeError, "namespace", "namespace-bytes"),
    _bad(lambda cls, url: cls(url, owner=42), TypeError, "owner", "owner-int"),
    _bad(lambda cls, url: cls(url, owner=b"me"), TypeError, "owner", "owner-bytes"),
    _bad(
        lambda cls, url: cls(url, no_such_option=1),
        TypeError,
        "no_such_option",
        "unknown-store-option",
    ),
    _bad(lambda cls, url: cls(url, ttl=0), ValueError, "ttl", "default-ttl-zero"),
    _bad(lambda cls, url: cls(url, ttl=-3), ValueError, "ttl", "default-ttl-negative"),
    _bad(lambda cls, url: cls(url, ttl=math.nan), ValueError, "ttl", "default-ttl-nan"),
    _bad(lambda cls, url: cls(url, ttl=math.inf), ValueError, "ttl", "default-ttl-inf"),
    _bad(lambda cls, url: cls(url, ttl=True), ANY, "ttl", "default-ttl-bool"),
    _bad(lambda cls, url: cls(url, ttl="30"), TypeError, "ttl", "default-ttl-str"),
]


def _call_through(call: Call, locks: keymutex.Locks) -> None:
    result = call(locks)
    if not isinstance(result, keymutex.Lease | keymutex.Holder | None):
        list(result)  # holders() may be lazy: its error may only come on iteration


async def _acall_through(call: Call, alocks: keymutex.AsyncLocks) -> None:
    result = call(alocks)
    if inspect.isawaitable(result):
        await result


def _construct_and_close(make: Callable[..., Any], url: str) -> None:
    client = make(keymutex.Locks, url)
    client.close()  # only reached when the constructor wrongly accepted


async def _aconstruct_and_aclose(make: Callable[..., Any], url: str) -> None:
    client = make(keymutex.AsyncLocks, url)
    await client.aclose()


@pytest.mark.parametrize(("call", "error", "name"), ACQUIRE_CASES)
def test_bad_argument_is_refused_before_the_store(
    make_locks: Callable[..., keymutex.Locks],
    call: Call,
    error: type[Exception],
    name: str,
) -> None:
    locks = make_locks()
    with pytest.raises(error, match=name):
        _call_through(call, locks)
    assert list(make_locks().holders()) == []


@pytest.mark.asyncio
@pytest.mark.parametrize(("call", "error", "name"), ACQUIRE_CASES)
async def test_bad_argument_is_refused_before_the_store_async(
    make_alocks: Callable[..., keymutex.AsyncLocks],
    call: Call,
    error: type[Exception],
    name: str,
) -> None:
    alocks = make_alocks()
    with pytest.raises(error, match=name):
        await _acall_through(call, alocks)
    assert list(await make_alocks().holders()) == []


@pytest.mark.parametrize(("options", "error", "name"), LOCK_CASES)
def test_bad_argument_to_lock_is_refused(
    locks: keymutex.Locks, options: dict[str, Any], error: type[Exception], name: str
) -> None:
    options = dict(options)
    key = options.pop("key")
    with pytest.raises(error, match=name), locks.lock(key, **options):
        pytest.fail("entered the block")
    assert list(locks.holders()) == []


@pytest.mark.asyncio
@pytest.mark.parametrize(("options", "error", "name"), LOCK_CASES)
async def test_bad_argument_to_lock_is_refused_async(
    alocks: keymutex.AsyncLocks, options: dict[str, Any], error: type[Exception], name: str
) -> None:
    options = dict(options)
    key = options.pop("key")
    with pytest.raises(error, match=name):
        async with alocks.lock(key, **options):
            pytest.fail("entered the block")
    assert list(await alocks.holders()) == []


@pytest.mark.parametrize(("make", "error", "name"), CONSTRUCTOR_CASES)
def test_bad_constructor_argument_is_refused(
    store_url: str, make: Callable[..., Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        _construct_and_close(make, store_url)


@pytest.mark.asyncio
@pytest.mark.parametrize(("make", "error", "name"), CONSTRUCTOR_CASES)
async def test_bad_constructor_argument_is_refused_async(
    store_url: str, make: Callable[..., Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        await _aconstruct_and_aclose(make, store_url)


# --- refusals on a held lease change nothing --------------------------------------------


@pytest.mark.parametrize(
    ("ttl", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (True, ANY),
        ("5", TypeError),
    ],
)
def test_bad_ttl_on_renew_leaves_the_lease_as_it_was(
    make_locks: Callable[..., keymutex.Locks], ttl: object, error: type[Exception]
) -> None:
    locks = make_locks()
    lease = locks.acquire("doc", ttl=30)
    before = locks.holder("doc")
    assert before is not None
    with pytest.raises(error, match="ttl"):
        lease.renew(ttl=ttl)  # type: ignore[arg-type]
    with pytest.raises(error, match="ttl"):
        make_locks().renew("doc", lease.token, ttl=ttl)  # type: ignore[arg-type]
    after = locks.holder("doc")
    assert_is_holder_of(after, lease)
    assert after is not None
    assert abs(after.expires_at - before.expires_at) < 0.5
    assert lease.lost is False
    lease.release()


@pytest.mark.asyncio
@pytest.mark.parametrize("ttl", [0, -1, math.nan, math.inf])
async def test_bad_ttl_on_renew_leaves_the_lease_as_it_was_async(
    make_alocks: Callable[..., keymutex.AsyncLocks], ttl: float
) -> None:
    alocks = make_alocks()
    lease = await alocks.acquire("doc", ttl=30)
    before = await alocks.holder("doc")
    assert before is not None
    with pytest.raises(ValueError, match="ttl"):
        await lease.renew(ttl=ttl)
    with pytest.raises(ValueError, match="ttl"):
        await make_alocks().renew("doc", lease.token, ttl=ttl)
    after = await alocks.holder("doc")
    assert_is_holder_of(after, lease)
    assert after is not None
    assert abs(after.expires_at - before.expires_at) < 0.5
    await lease.release()


def test_bad_token_on_release_leaves_the_lease_held(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    locks = make_locks()
    lease = locks.acquire("doc")
    for token in ("", "garbage token", lease.token + "!"):
        with pytest.raises(ValueError, match="token"):
            make_locks().release("doc", token)
    assert_is_holder_of(locks.holder("doc"), lease)
    lease.release()


def test_bad_template_argument_for_the_decorator(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    locks = make_locks()

    @locks.locked("order:{user_id}", timeout=5)
    def place_order(user_id: str) -> None:
        pytest.fail("ran without the lock")

    # The formatted key is checked like any key.
    with pytest.raises(ValueError, match="key"):
        place_order("x" * 1100)
    with pytest.raises(ValueError, match="key"):
        place_order("\x00")
    assert list(locks.holders()) == []

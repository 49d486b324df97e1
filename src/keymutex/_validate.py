"""Argument checks that run before anything touches a store.

Each check raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value) with a
message that names the argument and says what is accepted. Within ``json_words()`` the
messages speak of JSON values (a string, an object, ``null``, ``true``), as the lock
server receives them from clients in any language.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

__all__ = [
    "LOCK_SERVER_MAX_TTL",
    "MAX_INFO_BYTES",
    "MAX_KEY_BYTES",
    "MAX_TTL",
    "MIN_TTL",
    "check_bool",
    "check_callback",
    "check_info",
    "check_key",
    "check_prefix",
    "check_reason",
    "check_text",
    "check_timeout",
    "check_token",
    "check_ttl",
    "json_words",
    "received",
    "seconds_of",
    "shown_number",
]

MAX_KEY_BYTES = 1024
MAX_INFO_BYTES = 4096
# Levels of objects and arrays in info, the top object counting one. Far more than any
# holder description needs, and far below the depth at which decoding it again (every
# listing does) would exhaust Python's stack.
MAX_INFO_DEPTH = 32
MAX_TOKEN_CHARS = 256
MAX_TTL = 10.0 * 365 * 24 * 3600  # ten years: beyond that a lease is a configuration error
LOCK_SERVER_MAX_TTL = 86400.0  # a day: a lease held over HTTP longer than that is a mistake
# A millisecond: the finest unit every store counts in (Redis PEXPIRE, SQL intervals),
# and far above the clocks' resolution. Below it, ``now + ttl`` may equal ``now``: the
# lease would be granted already expired (and some stores refuse such a grant midway).
MIN_TTL = 0.001
MAX_REASON_CHARS = 500  # why a key was force-released, as logged
_TOKEN_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")

T = TypeVar("T")
_JSON_WORDS: ContextVar[bool] = ContextVar("keymutex_json_words", default=False)
_SHOWN_CHARS = 60  # a received value shown in a message is cut after this many characters


@contextlib.contextmanager
def json_words() -> Iterator[None]:
    """Within: the checks' messages name JSON types and show values as JSON text."""
    reset = _JSON_WORDS.set(True)
    try:
        yield
    finally:
        _JSON_WORDS.reset(reset)


def _words(python: str, json_: str) -> str:
    return json_ if _JSON_WORDS.get() else python


def received(value: object, *, python: str | None = None) -> str:
    """How a refused value is shown: ``python`` (default its ``repr``), or its JSON text.

    JSON text is cut to about 60 characters: a message repeats a value, not a body.
    """
    if not _JSON_WORDS.get():
        return repr(value) if python is None else python
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):  # not from JSON: show it as Python does
        text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 1] + "…"


def _type_name(value: object) -> str:
    return received(value, python=type(value).__name__)


def _utf8_length(value: str, name: str) -> int:
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(
            f"{name} must be valid Unicode text; it contains a lone surrogate"
        ) from None


def check_text(
    value: object, name: str, *, allow_empty: bool, max_bytes: int, accepted: str = ""
) -> str:
    """A ``str`` without NUL or lone surrogates, at most ``max_bytes`` as UTF-8.

    ``accepted`` says what is, for the message of an empty one (by default: 1 to
    ``max_bytes`` bytes of UTF-8 text).
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be {_words('a str', 'a string')}, not {_type_name(value)}")
    if not value and not allow_empty:
        accepted = accepted or f"1 to {max_bytes} bytes of UTF-8 text"
        raise ValueError(f"{name} must not be empty: {accepted} are accepted")
    if "\x00" in value:
        raise ValueError(
            f"{name} must not contain NUL characters; any other Unicode character is accepted"
        )
    size = _utf8_length(value, name)
    if size > max_bytes:
        raise ValueError(f"{name} is {size} bytes as UTF-8; at most {max_bytes} are accepted")
    return _exact_str(value)


def _exact_str(value: str) -> str:
    """``value``'s text as a plain ``str``: a subclass (``class Kind(str, Enum)``) may
    format as another text (``Kind.REPORTS``), and a store that named it by formatting
    would hold a lock of another name than the other stores and clients."""
    return value if type(value) is str else str.__str__(value)


def check_key(key: object, name: str = "key") -> str:
    """A store key: a non-empty ``str`` of at most 1024 bytes UTF-8, no NUL or surrogates."""
    return check_text(key, name, allow_empty=False, max_bytes=MAX_KEY_BYTES)


def check_prefix(prefix: object) -> str:
    """A key prefix: like a key, but may be empty (every key)."""
    return check_text(prefix, "prefix", allow_empty=True, max_bytes=MAX_KEY_BYTES)


def check_reason(value: object, name: str = "reason") -> str:
    """Why a lock is force-released (logged): 1 to ``MAX_REASON_CHARS`` characters, not
    all of them blank."""
    text = check_text(
        value,
        name,
        allow_empty=False,
        max_bytes=4 * MAX_REASON_CHARS,
        accepted=f"1 to {MAX_REASON_CHARS} characters",
    )
    if not text.strip():
        raise ValueError(f"{name} must say why, not be blank ({text!r})")
    if len(text) > MAX_REASON_CHARS:
        raise ValueError(f"{name} must be 1 to {MAX_REASON_CHARS} characters, not {len(text)}")
    return text


def shown_number(value: object) -> str:
    """``value`` as ``received`` shows it, or in words for an int too large for a float."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
        digits = int(value.bit_length() * math.log10(2)) + 1
        article = "a negative" if value < 0 else "an"
        return f"{article} integer of about {digits} digits"  # its repr: 1000s of digits
    return received(value)


def seconds_of(value: object, name: str) -> float:
    """``value`` as a float number of seconds: ``TypeError`` unless an int or float.

    An int too large for a float is ``±inf``: the caller's range check refuses it with a
    message that names ``name``. ``ValueError`` for NaN.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        kinds = _words(" (int or float)", "")
        raise TypeError(f"{name} must be a number of seconds{kinds}, not {received(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond 1.8e308
        number = math.inf if value > 0 else -math.inf
    if math.isnan(number):
        raise ValueError(f"{name} must be a number of seconds, not NaN")
    return number


def check_ttl(ttl: object, name: str = "ttl", *, at_most: float = MAX_TTL) -> float:
    """A lease lifetime: seconds, at least ``MIN_TTL`` (1 ms), at most ``at_most``.

    ``at_most`` is ten years for the library; the lock server passes its own limit, so
    that the message states the range that applies.
    """
    seconds = seconds_of(ttl, name)
    if not 0 < seconds <= at_most:
        raise ValueError(
            f"{name} must be greater than 0 and at most {at_most:.0f} s, not {shown_number(ttl)}"
        )
    if seconds < MIN_TTL:
        raise ValueError(
            f"{name} must be at least {MIN_TTL} s (1 ms), not {received(ttl)}: a shorter lease"
            " would expire before it could be granted"
        )
    return seconds


def check_timeout(timeout: object, name: str = "timeout") -> float | None:
    """``None`` (wait as long as it takes), ``0`` (try once) or finite seconds > 0."""
    if timeout is None:
        return None
    seconds = seconds_of(timeout, name)
    if not 0 <= seconds < math.inf:
        raise ValueError(
            f"{name} must be None (wait forever), 0 (try once) or finite seconds > 0,"
            f" not {shown_number(timeout)}"
        )
    return seconds


def check_info(info: object) -> dict[str, Any] | None:
    """``None`` or a JSON-serialisable dict of at most 4 KiB as JSON (no NaN or infinity),
    nested at most ``MAX_INFO_DEPTH`` levels.

    The size is that of compact JSON in UTF-8, as the lock server receives it: ``"é"``
    counts two bytes. Strings must be valid Unicode (no lone surrogates): no store could
    keep them as text, nor any program print them.
    """
    if info is None:
        return None
    if not isinstance(info, dict):
        kinds = _words("a dict or None", "an object or null")
        raise TypeError(f"info must be {kinds}, not {_type_name(info)}")
    too_deep = _check_shape(info)
    try:
        encoded = json.dumps(info, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"info must be JSON-serialisable (no NaN or infinity): {exc}") from None
    except RecursionError:
        raise ValueError("info is nested too deeply to be stored as JSON") from None
    if too_deep:
        kinds = _words("dicts and lists", "objects and arrays")
        raise ValueError(
            f"info is nested more than {MAX_INFO_DEPTH} levels deep (of {kinds});"
            f" at most {MAX_INFO_DEPTH} are accepted"
        )
    size = _utf8_length(encoded, "info")
    if size > MAX_INFO_BYTES:
        raise ValueError(f"info is {size} bytes as JSON; at most {MAX_INFO_BYTES} are accepted")
    # A copy through JSON: what others see is exactly what the store keeps.
    try:
        decoded: dict[str, Any] = json.loads(encoded)
    except RecursionError:
        raise ValueError("info is nested too deeply to be stored as JSON") from None
    return decoded


def _check_shape(info: dict[Any, Any]) -> bool:
    """Check that keys are text (JSON keys are strings: ``{1: "a", "1": "b"}`` would
    silently lose an entry); ``True`` if nesting goes past ``MAX_INFO_DEPTH`` levels."""
    pending: list[tuple[object, int]] = [(info, 1)]
    too_deep = False
    for _ in range(100_000):  # bounded: the JSON size limit is checked after this
        if not pending:
            break
        value, depth = pending.pop()
        if isinstance(value, dict | list | tuple) and depth > MAX_INFO_DEPTH:
            too_deep = True
            continue  # not deeper: a structure that refers to itself never ends
        if isinstance(value, dict):
            for name, item in value.items():
                if not isinstance(name, str):
                    raise TypeError(
                        f"info keys must be str (JSON object keys are strings), not"
                        f" {type(name).__name__} {name!r}"
                    )
                pending.append((item, depth + 1))
        elif isinstance(value, list | tuple):
            pending.extend((item, depth + 1) for item in value)
    return too_deep


def check_token(token: object) -> str:
    """A lease token as keymutex issues them: a non-empty URL-safe ``str``."""
    if not isinstance(token, str):
        raise TypeError(f"token must be {_words('a str', 'a string')}, not {_type_name(token)}")
    if not token or len(token) > MAX_TOKEN_CHARS or not _TOKEN_ALPHABET.issuperset(token):
        raise ValueError(
            f"token must be 1 to {MAX_TOKEN_CHARS} URL-safe characters (A-Z a-z 0-9 - _)"
            f" as returned {_words('in Lease.token', 'by acquire')}"
        )
    return _exact_str(token)


def check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(
            f"{name} must be {_words('True or False', 'true or false')}, not {received(value)}"
        )
    return value


def check_callback(value: T | None, name: str, *, awaited: bool = True) -> T | None:
    """``None`` or a callable; an ``async def`` one only where it is awaited."""
    if value is None:
        return None
    if not callable(value):
        raise TypeError(f"{name} must be a callable or None, not {type(value).__name__}")
    if not awaited and inspect.iscoroutinefunction(value):
        raise TypeError(
            f"{name} must be a plain function for Locks: an async one would never be"
            " awaited (use AsyncLocks, or call asyncio.run_coroutine_threadsafe from it)"
        )
    return value

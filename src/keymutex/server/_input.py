"""Strict reading of what an HTTP caller sends, and the errors the API answers with.

No I/O here: the endpoints hand over the raw body bytes or the query parameters, and
get back checked values or an ``ApiError`` that names the field and what is accepted.
Field checks reuse the library's own (``keymutex._validate``), so a key the Python API
refuses is refused over HTTP with the same message.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn, TypeVar
from urllib.parse import parse_qsl

from keymutex._client import MAX_NAMESPACE_BYTES, MAX_OWNER_BYTES
from keymutex._lease import Holder
from keymutex._validate import (
    LOCK_SERVER_MAX_TTL,
    check_bool,
    check_info,
    check_key,
    check_prefix,
    check_reason,
    check_text,
    check_token,
    check_ttl,
    json_words,
    received,
    shown_number,
)

__all__ = [
    "DEFAULT_TTL",
    "MAX_BODY_BYTES",
    "MAX_RENEWALS",
    "MAX_TTL",
    "SHUTTING_DOWN",
    "ApiError",
    "Fields",
    "holder_json",
    "not_utf8",
    "parse_body",
    "query_fields",
    "query_params",
]

T = TypeVar("T")

MAX_BODY_BYTES = 16 * 1024
MAX_TTL = LOCK_SERVER_MAX_TTL  # a day: a lease held over HTTP longer than that is a mistake
DEFAULT_TTL = 30.0
MAX_RENEWALS = 1000  # leases in one renew-many request
# A caller-chosen lease token must be able to carry 128 bits: 22 base64url characters.
MIN_CALLER_TOKEN_CHARS = 22
MAX_FENCE = 2**63 - 1  # what every store can count to; JSON readers lose nothing below

reason = check_reason  # why an admin force-releases a key (logged)


class ApiError(Exception):
    """An answer other than 200: HTTP ``status``, stable ``error`` code, human message.

    ``extra`` fields are added to the JSON body (``holder`` for the 409s).
    """

    def __init__(
        self,
        status: int,
        error: str,
        message: str,
        *,
        extra: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message
        self.extra = dict(extra or {})
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": self.error, "message": self.message, **self.extra}


def invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_argument", message)


SHUTTING_DOWN = ApiError(
    503,
    "shutting_down",
    "the lock server is shutting down: nothing was acquired or changed; try again",
)


def too_large() -> ApiError:
    return ApiError(413, "payload_too_large", f"the body is over {MAX_BODY_BYTES} bytes")


def holder_json(holder: Holder | None, *, now: float) -> dict[str, Any] | None:
    """A ``Holder`` as the API shows it: its fields plus ``expires_in`` (by wall clock)."""
    if holder is None:
        return None
    return {
        "key": holder.key,
        "owner": holder.owner,
        "info": holder.info,
        "fence": holder.fence,
        "acquired_at": holder.acquired_at,
        "expires_at": holder.expires_at,
        "expires_in": max(0.0, holder.expires_at - now),
    }


# -- the body ----------------------------------------------------------------------


class _Duplicate(ValueError):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, value in pairs:
        if name in result:
            raise _Duplicate(f"field {name!r} appears more than once")
        result[name] = value
    return result


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"number {text} is out of range")
    return number


# One decoder for every body: ``json.loads`` with options builds a new one per call.
# Strict: duplicate fields, NaN, Infinity and numbers beyond a float raise ValueError.
STRICT_JSON = json.JSONDecoder(
    object_pairs_hook=_object, parse_constant=_no_constant, parse_float=_finite
)


def parse_body(raw: bytes) -> dict[str, Any]:
    """One JSON object: UTF-8, no NaN/Infinity, no duplicate fields, no lone surrogates."""
    if len(raw) > MAX_BODY_BYTES:
        raise too_large()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("the body is not UTF-8 text") from None
    if text.startswith("\ufeff"):  # JSON text must not begin with one (RFC 8259, 8.1)
        raise invalid("the body begins with a byte order mark (EF BB BF): send JSON without it")
    try:
        data = STRICT_JSON.decode(text)
    except RecursionError:
        raise invalid("the body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, duplicates, NaN, too many digits
        raise invalid(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        with json_words():
            raise invalid(f"the body must be a JSON object, not {received(data)}")
    # json.loads turns "\ud800" escapes into lone surrogates: no store can keep them.
    # Text that decoded as UTF-8 holds none, so only a body with \u escapes is checked.
    if "\\u" in text:
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise invalid("the body contains a lone surrogate (\\ud800-\\udfff) escape") from None
    return data


def query_params(raw: bytes) -> list[tuple[str, str]]:
    """The raw query string's parameters, in order, decoded as UTF-8; one that is not
    UTF-8 is ``invalid_argument``."""
    try:
        return parse_qsl(raw.decode("utf-8"), keep_blank_values=True, errors="strict")
    except UnicodeDecodeError:
        raise not_utf8("the query string") from None


def not_utf8(what: str) -> ApiError:
    return invalid(
        f"{what} is not UTF-8 text: percent-escapes such as %FF must encode UTF-8 bytes"
    )


def query_fields(raw: bytes, allowed: Iterable[str]) -> Fields:
    """The raw query string's parameters as ``Fields``: UTF-8, each at most once, none unknown.

    Parsed here rather than by Starlette, which decodes a percent-escape that is not
    UTF-8 (``%FF``) as U+FFFD: the key asked about would not be the one sent.
    """
    seen: dict[str, Any] = {}
    for name, value in query_params(raw):
        if name in seen:
            raise invalid(f"query parameter {name!r} appears more than once")
        seen[name] = value
    return Fields(seen, allowed, where="query parameter")


_MISSING: Any = object()


class Fields:
    """The fields of one request object: each read with a check; unknown ones refused."""

    def __init__(self, data: Mapping[str, Any], allowed: Iterable[str], *, where: str) -> None:
        self._data = data
        self._where = where
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            names = ", ".join(repr(name) for name in unknown)
            accepted = ", ".join(sorted(allowed)) or "none"
            raise invalid(f"unknown {where}(s) {names}; accepted: {accepted}")

    def get(self, name: str, check: Callable[[object, str], T], default: T = _MISSING) -> T:
        """The field checked by ``check(value, name)``; ``default`` when it is absent."""
        if name not in self._data:
            if default is _MISSING:
                raise invalid(f"{self._where} {name!r} is required")
            return default
        return checked(check, self._data[name], name)


def checked(check: Callable[[object, str], T], value: object, name: str) -> T:
    """``check(value, name)``; its refusal as a 400 whose message speaks of JSON values."""
    try:
        with json_words():
            return check(value, name)
    except (TypeError, ValueError, OverflowError) as exc:
        raise invalid(str(exc)) from None


# -- field checks: (value, name) -> value, TypeError/ValueError naming the field -----------


def namespace(value: object, name: str) -> str:
    return check_text(value, name, allow_empty=True, max_bytes=MAX_NAMESPACE_BYTES)


def key(value: object, name: str) -> str:
    return check_key(value, name)


def prefix(value: object, name: str) -> str:
    return check_prefix(value)


def ttl(value: object, name: str) -> float:
    """As the library's ``ttl``, within the server's range: at most a day."""
    return check_ttl(value, name, at_most=MAX_TTL)


def timeout(value: object, name: str) -> float:
    """Seconds to wait: finite, 0 or more (``null`` is not accepted: the server caps it)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, 0 or more, not {received(value)}")
    try:
        seconds = float(value)
    except OverflowError:  # a JSON integer of hundreds of digits
        seconds = math.inf if value > 0 else -math.inf
    if not 0 <= seconds < math.inf:
        raise ValueError(
            f"{name} must be a finite number of seconds, 0 or more, not {shown_number(value)}"
        )
    return seconds


def info(value: object, name: str) -> dict[str, Any] | None:
    return check_info(value)


def flag(value: object, name: str) -> bool:
    return check_bool(value, name)


def owner(value: object, name: str) -> str:
    return check_text(value, name, allow_empty=False, max_bytes=MAX_OWNER_BYTES)


def token(value: object, name: str) -> str:
    try:
        return check_token(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("token", name, 1)) from None


def caller_token(value: object, name: str) -> str:
    """A lease token the caller chose: like any token, and long enough to carry 128 bits."""
    chosen = token(value, name)
    if len(chosen) < MIN_CALLER_TOKEN_CHARS:
        raise ValueError(
            f"{name} must be at least {MIN_CALLER_TOKEN_CHARS} random URL-safe characters"
            " (128 bits), e.g. secrets.token_urlsafe(18)"
        )
    return chosen


def fence(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an integer (a lease's fence) or null, not {received(value)}"
        )
    if not 0 <= value <= MAX_FENCE:
        raise ValueError(f"{name} must be between 0 and {MAX_FENCE}, not {shown_number(value)}")
    return value


def renewals(value: object, name: str) -> list[tuple[str, str, float]]:
    """The ``leases`` of renew-many: (key, token, ttl) for each, at most ``MAX_RENEWALS``."""
    if not isinstance(value, list):
        raise TypeError(f"{name} must be an array of {{key, token, ttl?}} objects")
    if len(value) > MAX_RENEWALS:
        raise ValueError(f"{name} holds {len(value)} leases; at most {MAX_RENEWALS} are accepted")
    result = []
    for index, item in enumerate(value):
        where = f"{name}[{index}]"
        if not isinstance(item, dict):
            raise TypeError(f"{where} must be an object {{key, token, ttl?}}")
        unknown = sorted(set(item) - {"key", "token", "ttl"})
        if unknown:
            names = ", ".join(repr(name) for name in unknown)
            raise ValueError(f"unknown field(s) {names} in {where}; accepted: key, token, ttl")
        for required in ("key", "token"):
            if required not in item:
                raise ValueError(f"{where}.{required} is required")
        result.append(
            (
                key(item["key"], f"{where}.key"),
                token(item["token"], f"{where}.token"),
                ttl(item["ttl"], f"{where}.ttl") if "ttl" in item else DEFAULT_TTL,
            )
        )
    return result

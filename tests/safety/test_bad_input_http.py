"""Bad-input catalogue, HTTP API of the lock server (docs/http-api.md), table-driven.

Each row is one request the server must refuse: the HTTP status, the stable ``error``
code of the JSON body, and the parts of its ``message`` that name the field and what
is accepted. After each refusal the store must be as it was:

- ``GET /v1/holders`` lists the same leases (a bystander lease is held throughout,
  TTL 20 s where a renewal's default is 30 s, so a renewal that slipped through would
  move its expiry by 10 s, and a steal or a release would change the list);
- no fence was consumed: a probe acquire of ``doc`` after the request gets exactly
  the fence after the one a probe got just before it (one counter per store).

The app runs in-process (``httpx.ASGITransport``), on a fresh ``memory://`` table per
test; rows that need a store with durable fences say ``store="sqlite"``. Every reply
must be JSON without a stack trace and without the bystander's token. Rows marked
``xfail(strict=True)`` are bugs in ``src/`` that the catalogue found (see the reasons).
The tables are kept one row per line (``fmt: off``): they are read as tables.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from keymutex.server import create_app

KEY = "doc"  # the probe key, and the valid key of the rows
HELD = "held"  # held by the bystander lease during every request
GONE = "gone"  # a lease released, expired or stolen before the request
BYSTANDER_TTL = 20.0  # the server's default TTL is 30 s: a default renewal would show
EXPIRY_SLACK = 1.0
PATIENCE = 20.0
JSON_TYPE = {"Content-Type": "application/json"}

ADMIN = "admin-" + "a" * 40
READER = "reader-" + "r" * 40
TOKENS = {
    "tokens": [
        {
            "name": "ops",
            "token": ADMIN,
            "grants": [{"namespace": "*", "prefix": "", "allow": ["lock", "read", "admin"]}],
        },
        {
            "name": "dashboard",
            "token": READER,
            "grants": [{"namespace": "", "prefix": "", "allow": ["read"]}],
        },
    ]
}

# -- bugs found by this catalogue: rows marked xfail(strict=True), with the reason (none ----
# open today: the findings of the first run are fixed) ----------------------------------


def _xfail(reason: str | None) -> list[pytest.MarkDecorator]:
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


# -- rows ------------------------------------------------------------------------------------


@dataclass
class Ctx:
    token: str  # the bystander's lease token
    fence: int  # the bystander's fence
    gone: str | None = None  # setup: the token of the lease on GONE
    thief: int | None = None  # setup "stolen": the fence of the lease that stole GONE


Send = dict[str, Any] | bytes | str | Callable[[Ctx], Any]


@dataclass(frozen=True)
class Req:
    """One refused request and the answer it must get."""

    method: str
    path: str
    send: Send  # POST: a JSON value or raw bytes; GET: the query string
    status: int
    error: str
    fragments: tuple[str, ...]
    headers: dict[str, str] = field(default_factory=dict)
    setup: str | None = None  # "released", "expired" or "stolen" (a lease on GONE)
    holder: str | None = None  # the 409's holder: "bystander", "thief" or "none"
    auth: str | None = None  # the bearer token (then the server has a token file)
    store: str = "memory"


def req(
    case_id: str,
    method: str,
    path: str,
    send: Send,
    status: int,
    error: str,
    *fragments: str,
    headers: dict[str, str] | None = None,
    setup: str | None = None,
    holder: str | None = None,
    auth: str | None = None,
    store: str = "memory",
    xfail: str | None = None,
) -> Any:
    return pytest.param(
        Req(
            method, path, send, status, error, fragments, headers or {}, setup, holder, auth, store
        ),
        id=case_id,
        marks=_xfail(xfail),
    )


def post(case_id: str, path: str, send: Send, *fragments: str, **options: Any) -> Any:
    """A POST refused with 400 invalid_argument (unless ``status``/``error`` say else)."""
    status = options.pop("status", 400)
    error = options.pop("error", "invalid_argument")
    return req(case_id, "POST", path, send, status, error, *fragments, **options)


def get(case_id: str, path: str, query: str, *fragments: str, **options: Any) -> Any:
    status = options.pop("status", 400)
    error = options.pop("error", "invalid_argument")
    return req(case_id, "GET", path, query, status, error, *fragments, **options)


def acquire(case_id: str, send: Send, *fragments: str, **options: Any) -> Any:
    return post(f"acquire-{case_id}", "/v1/acquire", send, *fragments, **options)


def _nested_lists(levels: int) -> list[Any]:
    """A list in a list … ``levels`` deep."""
    nested: list[Any] = []
    for _ in range(levels - 1):
        nested = [nested]
    return nested


def with_key(**fields: Any) -> dict[str, Any]:
    return {"key": KEY, **fields}


TTL_RANGE = "ttl must be greater than 0 and at most "
TOKEN_FORMAT = (
    "token must be 1 to 256 URL-safe characters (A-Z a-z 0-9 - _) as returned by acquire"
)
ACQUIRE_FIELDS = "accepted: info, key, namespace, owner, steal, timeout, token, ttl"
LOST = "the token no longer holds "

# fmt: off
ROWS = [
    # The body: one JSON object, UTF-8, strict (every endpoint reads it the same way).
    acquire("body-empty", b"", "the body is not valid JSON: Expecting value", headers=JSON_TYPE),
    acquire("body-truncated", b'{"key": "doc"', "the body is not valid JSON", headers=JSON_TYPE),
    acquire("body-not-utf8", b"\xff\xfe{}", "the body is not UTF-8 text", headers=JSON_TYPE),
    acquire("body-bom", b'\xef\xbb\xbf{"key": "a"}', "the body begins with a byte order mark", headers=JSON_TYPE),
    acquire("body-array", b'["doc"]', "the body must be a JSON object, not [\"doc\"]", headers=JSON_TYPE),
    acquire("body-string", b'"doc"', "the body must be a JSON object, not \"doc\"", headers=JSON_TYPE),
    acquire("body-null", b"null", "the body must be a JSON object, not null", headers=JSON_TYPE),
    acquire("body-nan", b'{"key": "doc", "ttl": NaN}', "the body is not valid JSON: NaN is not a JSON number", headers=JSON_TYPE),
    acquire("body-infinity", b'{"key": "doc", "ttl": -Infinity}', "the body is not valid JSON: -Infinity is not a JSON number", headers=JSON_TYPE),
    acquire("body-huge-float", b'{"key": "doc", "ttl": 1e999}', "the body is not valid JSON: number 1e999 is out of range", headers=JSON_TYPE),
    acquire("body-duplicate-field", b'{"key": "doc", "key": "held"}', "the body is not valid JSON: field 'key' appears more than once", headers=JSON_TYPE),
    acquire("body-unknown-field", with_key(wait=5), "unknown field(s) 'wait'; " + ACQUIRE_FIELDS),
    acquire("body-field-case", {"Key": KEY}, "unknown field(s) 'Key'; " + ACQUIRE_FIELDS),
    acquire("body-deeply-nested", b"[" * 5000 + b"]" * 5000, "the body is nested too deeply", headers=JSON_TYPE),
    acquire("body-lone-surrogate", b'{"key": "doc", "owner": "\\udfff"}', "the body contains a lone surrogate (\\ud800-\\udfff) escape", headers=JSON_TYPE),
    acquire("body-over-16-kib", with_key(info={"pad": "x" * 17_000}), "the body is over 16384 bytes", status=413, error="payload_too_large"),
    acquire("content-type-missing", b'{"key": "doc"}', "send the body as JSON with 'Content-Type: application/json'", status=415, error="unsupported_media_type"),
    acquire("content-type-text", b'{"key": "doc"}', "send the body as JSON with 'Content-Type: application/json'", headers={"Content-Type": "text/plain"}, status=415, error="unsupported_media_type"),
    acquire("content-type-form", b"key=doc", "send the body as JSON", headers={"Content-Type": "application/x-www-form-urlencoded"}, status=415, error="unsupported_media_type"),
    acquire("content-type-charset-latin-1", b'{"key": "doc"}', "send the body as UTF-8 JSON: charset 'latin-1' is not accepted", headers={"Content-Type": "application/json; charset=latin-1"}, status=415, error="unsupported_media_type"),
    acquire("content-encoding-gzip", b'{"key": "doc"}', "send the body unencoded: Content-Encoding 'gzip' is not accepted", headers={**JSON_TYPE, "Content-Encoding": "gzip"}, status=415, error="unsupported_media_type"),
    post("acquire-query-parameter", "/v1/acquire?key=other", with_key(), "POST /v1/acquire takes no query parameters: send every field in the JSON body"),
    post("release-query-parameter", "/v1/release?token=x", with_key(token="t" * 24), "POST /v1/release takes no query parameters: send every field in the JSON body"),
    acquire("content-length-not-a-number", b'{"key": "doc"}', "Content-Length must be a number of bytes", headers={**JSON_TYPE, "Content-Length": "ten"}),
    # acquire: key
    acquire("key-missing", {}, "field 'key' is required"),
    acquire("key-empty", {"key": ""}, "key must not be empty"),
    acquire("key-1025-bytes", {"key": "k" * 1025}, "key is 1025 bytes as UTF-8; at most 1024 are accepted"),
    acquire("key-1025-utf8-bytes", {"key": "é" * 512 + "a"}, "key is 1025 bytes as UTF-8; at most 1024 are accepted"),
    acquire("key-huge", {"key": "k" * 100_000}, "the body is over 16384 bytes", status=413, error="payload_too_large"),
    acquire("key-nul", {"key": "a\x00b"}, "key must not contain NUL characters"),
    acquire("key-lone-surrogate", b'{"key": "a\\ud800b"}', "the body contains a lone surrogate", headers=JSON_TYPE),
    acquire("key-int", {"key": 42}, "key must be a string, not 42"),
    acquire("key-null", {"key": None}, "key must be a string, not null"),
    acquire("key-list", {"key": [KEY]}, "key must be a string, not [\"doc\"]"),
    acquire("key-long-array", {"key": list(range(100))}, "key must be a string, not [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, …"),
    # acquire: ttl (range (0, 86400])
    acquire("ttl-zero", with_key(ttl=0), TTL_RANGE, "not 0"),
    acquire("ttl-negative", with_key(ttl=-1), TTL_RANGE, "not -1"),
    acquire("ttl-over-a-day", with_key(ttl=86401), "ttl must be greater than 0 and at most 86400 s, not 86401"),
    acquire("ttl-1e308", with_key(ttl=1e308), TTL_RANGE, "not 1e+308"),
    acquire("ttl-true", with_key(ttl=True), "ttl must be a number of seconds, not true"),
    acquire("ttl-string", with_key(ttl="30"), "ttl must be a number of seconds, not \"30\""),
    acquire("ttl-null", with_key(ttl=None), "ttl must be a number of seconds, not null"),
    acquire("ttl-zero-names-the-server-range", with_key(ttl=0), "ttl must be greater than 0 and at most 86400 s, not 0"),
    acquire("ttl-1e308-names-the-server-range", with_key(ttl=1e308), "ttl must be greater than 0 and at most 86400 s, not 1e+308"),
    acquire("ttl-huge-int", with_key(ttl=10**400), "ttl must be greater than 0 and at most 86400 s, not an integer of about 401 digits"),
    acquire("ttl-below-clock-resolution", with_key(ttl=1e-300), "ttl must be at least 0.001 s (1 ms), not 1e-300", store="sqlite"),
    acquire("ttl-below-a-millisecond", with_key(ttl=0.0009), "ttl must be at least 0.001 s (1 ms), not 0.0009"),
    # acquire: timeout (0 or more, finite; null is not accepted: the server caps waits)
    acquire("timeout-negative", with_key(timeout=-1), "timeout must be a finite number of seconds, 0 or more, not -1"),
    acquire("timeout-string", with_key(timeout="1"), "timeout must be a number of seconds, 0 or more, not \"1\""),
    acquire("timeout-true", with_key(timeout=True), "timeout must be a number of seconds, 0 or more, not true"),
    acquire("timeout-null", with_key(timeout=None), "timeout must be a number of seconds, 0 or more, not null"),
    acquire("timeout-huge-int", with_key(timeout=10**400), "timeout must be a finite number of seconds, 0 or more, not an integer of about 401 digits"),
    # acquire: info, steal, owner, namespace, token
    acquire("info-list", with_key(info=[1]), "info must be an object or null, not [1]"),
    acquire("info-string", with_key(info="alice"), "info must be an object or null, not \"alice\""),
    acquire("info-nested-33-levels", with_key(info={"a": _nested_lists(32)}), "info is nested more than 32 levels deep (of objects and arrays); at most 32 are accepted"),
    acquire("info-4097-bytes", with_key(info={"b": "x" * (4097 - 8)}), "info is 4097 bytes as JSON; at most 4096 are accepted"),
    acquire("info-4097-utf8-bytes", with_key(info={"b": "é" * 2044 + "a"}), "info is 4097 bytes as JSON; at most 4096 are accepted"),
    acquire("info-lone-surrogate", b'{"key": "doc", "info": {"name": "\\ud800"}}', "the body contains a lone surrogate", headers=JSON_TYPE),
    acquire("info-nan", b'{"key": "doc", "info": {"f": NaN}}', "NaN is not a JSON number", headers=JSON_TYPE),
    acquire("steal-int", with_key(steal=1), "steal must be true or false, not 1"),
    acquire("steal-string", with_key(steal="true"), "steal must be true or false, not \"true\""),
    acquire("steal-null", with_key(steal=None), "steal must be true or false, not null"),
    acquire("owner-empty", with_key(owner=""), "owner must not be empty"),
    acquire("owner-257-bytes", with_key(owner="o" * 257), "owner is 257 bytes as UTF-8; at most 256 are accepted"),
    acquire("owner-nul", with_key(owner="me\x00"), "owner must not contain NUL characters"),
    acquire("owner-int", with_key(owner=42), "owner must be a string, not 42"),
    acquire("namespace-int", with_key(namespace=7), "namespace must be a string, not 7"),
    acquire("namespace-257-bytes", with_key(namespace="n" * 257), "namespace is 257 bytes as UTF-8; at most 256 are accepted"),
    acquire("namespace-nul", with_key(namespace="n\x00"), "namespace must not contain NUL characters"),
    acquire("token-garbage", with_key(token="bad token!"), TOKEN_FORMAT),
    acquire("token-too-short", with_key(token="t" * 21), "token must be at least 22 random URL-safe characters (128 bits)"),
    acquire("token-257-chars", with_key(token="t" * 257), TOKEN_FORMAT),
    acquire("token-int", with_key(token=42), "token must be a string, not 42"),
    # renew: a token that is not one, or that does not hold the key
    post("renew-token-missing", "/v1/renew", {"key": HELD}, "field 'token' is required"),
    post("renew-token-int", "/v1/renew", {"key": HELD, "token": 5}, "token must be a string, not 5"),
    post("renew-token-empty", "/v1/renew", {"key": HELD, "token": ""}, TOKEN_FORMAT),
    post("renew-token-garbage", "/v1/renew", {"key": HELD, "token": "not a token"}, TOKEN_FORMAT),
    post("renew-key-empty", "/v1/renew", lambda x: {"key": "", "token": x.token}, "key must not be empty"),
    post("renew-ttl-zero", "/v1/renew", lambda x: {"key": HELD, "token": x.token, "ttl": 0}, TTL_RANGE),
    post("renew-ttl-over-a-day", "/v1/renew", lambda x: {"key": HELD, "token": x.token, "ttl": 86401}, "ttl must be greater than 0 and at most 86400 s, not 86401"),
    post("renew-ttl-true", "/v1/renew", lambda x: {"key": HELD, "token": x.token, "ttl": True}, "ttl must be a number of seconds, not true"),
    post("renew-ttl-huge-int", "/v1/renew", lambda x: {"key": HELD, "token": x.token, "ttl": 10**400}, "ttl must be greater than 0 and at most 86400 s, not an integer of about 401 digits"),
    post("renew-ttl-below-a-millisecond", "/v1/renew", lambda x: {"key": HELD, "token": x.token, "ttl": 1e-4}, "ttl must be at least 0.001 s (1 ms), not 0.0001"),
    post("renew-token-random", "/v1/renew", {"key": HELD, "token": "t" * 24}, LOST + "held", status=409, error="lock_lost", holder="bystander"),
    post("renew-token-truncated", "/v1/renew", lambda x: {"key": HELD, "token": x.token[:-1]}, LOST + "held", status=409, error="lock_lost", holder="bystander"),
    post("renew-token-case-swapped", "/v1/renew", lambda x: {"key": HELD, "token": x.token.swapcase()}, LOST + "held", status=409, error="lock_lost", holder="bystander"),
    post("renew-token-of-another-key", "/v1/renew", lambda x: {"key": KEY, "token": x.token}, LOST + "doc", status=409, error="lock_lost", holder="none"),
    post("renew-token-of-another-namespace", "/v1/renew", lambda x: {"namespace": "other", "key": HELD, "token": x.token}, LOST + "held", status=409, error="lock_lost", holder="none"),
    post("renew-released", "/v1/renew", lambda x: {"key": GONE, "token": x.gone}, LOST + "gone", status=409, error="lock_lost", holder="none", setup="released"),
    post("renew-expired", "/v1/renew", lambda x: {"key": GONE, "token": x.gone}, LOST + "gone", status=409, error="lock_lost", holder="none", setup="expired"),
    post("renew-stolen", "/v1/renew", lambda x: {"key": GONE, "token": x.gone}, LOST + "gone", status=409, error="lock_lost", holder="thief", setup="stolen"),
    # release
    post("release-token-missing", "/v1/release", {"key": HELD}, "field 'token' is required"),
    post("release-token-empty", "/v1/release", {"key": HELD, "token": ""}, TOKEN_FORMAT),
    post("release-token-nul", "/v1/release", lambda x: {"key": HELD, "token": x.token + "\x00"}, TOKEN_FORMAT),
    post("release-key-empty", "/v1/release", lambda x: {"key": "", "token": x.token}, "key must not be empty"),
    post("release-with-ttl", "/v1/release", lambda x: {"key": HELD, "token": x.token, "ttl": 3}, "unknown field(s) 'ttl'; accepted: key, namespace, token"),
    post("release-token-random", "/v1/release", {"key": HELD, "token": "t" * 24}, LOST + "held", status=409, error="lock_lost", holder="bystander"),
    post("release-token-truncated", "/v1/release", lambda x: {"key": HELD, "token": x.token[:-1]}, LOST + "held", status=409, error="lock_lost", holder="bystander"),
    post("release-token-of-another-namespace", "/v1/release", lambda x: {"namespace": "other", "key": HELD, "token": x.token}, LOST + "held", status=409, error="lock_lost", holder="none"),
    post("release-twice", "/v1/release", lambda x: {"key": GONE, "token": x.gone}, LOST + "gone", status=409, error="lock_lost", holder="none", setup="released"),
    post("release-expired", "/v1/release", lambda x: {"key": GONE, "token": x.gone}, LOST + "gone", status=409, error="lock_lost", holder="none", setup="expired"),
    post("release-stolen", "/v1/release", lambda x: {"key": GONE, "token": x.gone}, LOST + "gone", status=409, error="lock_lost", holder="thief", setup="stolen"),
    # renew-many
    post("renew-many-leases-missing", "/v1/renew-many", {}, "field 'leases' is required"),
    post("renew-many-leases-object", "/v1/renew-many", {"leases": {}}, "leases must be an array of {key, token, ttl?} objects"),
    post("renew-many-item-not-object", "/v1/renew-many", {"leases": [1]}, "leases[0] must be an object {key, token, ttl?}"),
    post("renew-many-item-token-missing", "/v1/renew-many", {"leases": [{"key": HELD}]}, "leases[0].token is required"),
    post("renew-many-item-unknown-field", "/v1/renew-many", lambda x: {"leases": [{"key": HELD, "token": x.token, "x": 1}]}, "unknown field(s) 'x' in leases[0]; accepted: key, token, ttl"),
    post("renew-many-item-key-empty", "/v1/renew-many", lambda x: {"leases": [{"key": "", "token": x.token}]}, "leases[0].key must not be empty"),
    post("renew-many-item-token-garbage", "/v1/renew-many", {"leases": [{"key": HELD, "token": "no good"}]}, "leases[0].token must be 1 to 256 URL-safe characters"),
    post("renew-many-item-ttl-zero", "/v1/renew-many", lambda x: {"leases": [{"key": HELD, "token": x.token, "ttl": 0}]}, "leases[0].ttl must be greater than 0 and at most"),
    post("renew-many-second-item-bad", "/v1/renew-many", lambda x: {"leases": [{"key": HELD, "token": x.token}, {"key": HELD, "token": x.token, "ttl": -1}]}, "leases[1].ttl must be greater than 0"),
    post("renew-many-over-16-kib", "/v1/renew-many", {"leases": [{"key": HELD, "token": "t" * 24}] * 1001}, "the body is over 16384 bytes", status=413, error="payload_too_large"),
    # wait
    post("wait-fence-missing", "/v1/wait", {"key": HELD, "timeout": 0}, "field 'fence' is required"),
    post("wait-fence-float", "/v1/wait", {"key": HELD, "fence": 1.5, "timeout": 0}, "fence must be an integer (a lease's fence) or null, not 1.5"),
    post("wait-fence-true", "/v1/wait", {"key": HELD, "fence": True, "timeout": 0}, "fence must be an integer (a lease's fence) or null, not true"),
    post("wait-fence-negative", "/v1/wait", {"key": HELD, "fence": -1, "timeout": 0}, "fence must be between 0 and 9223372036854775807, not -1"),
    post("wait-fence-2-to-the-63", "/v1/wait", {"key": HELD, "fence": 2**63, "timeout": 0}, "fence must be between 0 and 9223372036854775807, not 9223372036854775808"),
    post("wait-timeout-missing", "/v1/wait", {"key": HELD, "fence": 1}, "field 'timeout' is required"),
    post("wait-timeout-negative", "/v1/wait", {"key": HELD, "fence": 1, "timeout": -1}, "timeout must be a finite number of seconds, 0 or more, not -1"),
    post("wait-key-empty", "/v1/wait", {"key": "", "fence": None, "timeout": 0}, "key must not be empty"),
    post("wait-holding-not-a-bool", "/v1/wait", {"key": HELD, "fence": 1, "timeout": 0, "holding": "yes"}, 'holding must be true or false, not "yes"'),
    post("wait-holding-without-fence", "/v1/wait", {"key": HELD, "fence": None, "timeout": 0, "holding": True}, "holding: true needs fence, the fence of the caller's own lease"),
    # force-release (admin)
    post("force-release-reason-missing", "/v1/force-release", {"key": HELD}, "field 'reason' is required"),
    post("force-release-reason-empty", "/v1/force-release", {"key": HELD, "reason": ""}, "reason must not be empty: 1 to 500 characters are accepted"),
    post("force-release-reason-501-chars", "/v1/force-release", {"key": HELD, "reason": "r" * 501}, "reason must be 1 to 500 characters, not 501"),
    post("force-release-reason-blank", "/v1/force-release", {"key": HELD, "reason": "   "}, "reason must say why, not be blank ('   ')"),
    post("force-release-fence-text", "/v1/force-release", {"key": HELD, "reason": "stuck", "fence": "7"}, "fence must be an integer (a lease's fence) or null, not \"7\""),
    post("force-release-fence-negative", "/v1/force-release", {"key": HELD, "reason": "stuck", "fence": -1}, "fence must be between 0 and"),
    post("force-release-reason-nul", "/v1/force-release", {"key": HELD, "reason": "\x00"}, "reason must not contain NUL characters"),
    post("force-release-reason-int", "/v1/force-release", {"key": HELD, "reason": 42}, "reason must be a string, not 42"),
    post("force-release-key-empty", "/v1/force-release", {"key": "", "reason": "stuck"}, "key must not be empty"),
    post("force-release-unknown-field", "/v1/force-release", {"key": HELD, "reason": "stuck", "force": True}, "unknown field(s) 'force'; accepted: fence, key, namespace, reason"),
    # GET: the query parameters
    get("holder-key-missing", "/v1/holder", "", "query parameter 'key' is required"),
    get("holder-key-empty", "/v1/holder", "key=", "key must not be empty"),
    get("holder-key-nul", "/v1/holder", "key=a%00b", "key must not contain NUL characters"),
    get("holder-key-1025-bytes", "/v1/holder", "key=" + "k" * 1025, "key is 1025 bytes as UTF-8; at most 1024 are accepted"),
    get("holder-key-repeated", "/v1/holder", "key=doc&key=held", "query parameter 'key' appears more than once"),
    get("holder-unknown-parameter", "/v1/holder", "key=doc&token=x", "unknown query parameter(s) 'token'; accepted: key, namespace"),
    get("holder-namespace-257-bytes", "/v1/holder", "key=doc&namespace=" + "n" * 257, "namespace is 257 bytes as UTF-8; at most 256 are accepted"),
    get("holder-key-not-utf8", "/v1/holder", "key=%FF", "the query string is not UTF-8 text: percent-escapes such as %FF must encode UTF-8 bytes"),
    get("holder-key-encoded-surrogate", "/v1/holder", "key=%ED%A0%80", "the query string is not UTF-8 text"),
    get("holder-namespace-not-utf8", "/v1/holder", "key=doc&namespace=%C3", "the query string is not UTF-8 text"),
    get("holders-prefix-not-utf8", "/v1/holders", "prefix=d%FF", "the query string is not UTF-8 text"),
    get("events-prefix-not-utf8", "/v1/events", "prefix=%FF", "the query string is not UTF-8 text"),
    get("holders-prefix-nul", "/v1/holders", "prefix=%00", "prefix must not contain NUL characters"),
    get("holders-prefix-1025-bytes", "/v1/holders", "prefix=" + "p" * 1025, "prefix is 1025 bytes as UTF-8; at most 1024 are accepted"),
    get("holders-unknown-parameter", "/v1/holders", "prefx=d", "unknown query parameter(s) 'prefx'; accepted: namespace, prefix"),
    get("holders-prefix-repeated", "/v1/holders", "prefix=a&prefix=b", "query parameter 'prefix' appears more than once"),
    get("events-prefix-nul", "/v1/events", "prefix=%00", "prefix must not contain NUL characters"),
    get("events-unknown-parameter", "/v1/events", "since=0", "unknown query parameter(s) 'since'; accepted: namespace, prefix"),
    # routes and methods
    post("route-unknown", "/v1/nosuch", {}, "no such route: POST /v1/nosuch", status=404, error="not_found"),
    post("route-other-version", "/v2/acquire", with_key(), "no such route: POST /v2/acquire", status=404, error="not_found"),
    post("route-trailing-slash", "/v1/acquire/", with_key(), "no such route: POST /v1/acquire/", status=404, error="not_found"),
    get("route-trailing-slash-on-get", "/v1/holders/", "prefix=", "no such route: GET /v1/holders/", status=404, error="not_found"),
    get("method-get-on-acquire", "/v1/acquire", "key=doc", "GET is not allowed here", status=405, error="method_not_allowed"),
    post("method-post-on-holder", "/v1/holder", with_key(), "POST is not allowed here", status=405, error="method_not_allowed"),
    # API tokens (the server has a token file): checked before anything else
    acquire("auth-missing", with_key(), "this server needs an API token: send 'Authorization: Bearer <token>'", status=401, error="unauthorized", auth=""),
    acquire("auth-basic", with_key(), "send 'Authorization: Bearer <token>'", status=401, error="unauthorized", auth="Basic b3BzOnNlY3JldA=="),
    acquire("auth-bearer-empty", with_key(), "send 'Authorization: Bearer <token>'", status=401, error="unauthorized", auth="Bearer "),
    acquire("auth-unknown-token", with_key(), "unknown API token", status=401, error="unauthorized", auth="Bearer " + "x" * 46),
    acquire("auth-truncated-token", with_key(), "unknown API token", status=401, error="unauthorized", auth="Bearer " + ADMIN[:-1]),
    acquire("auth-no-lock-permission", with_key(), "API token 'dashboard' has no 'lock' permission on key 'doc' in namespace ''", status=403, error="forbidden", auth="Bearer " + READER),
    post("auth-no-admin-permission", "/v1/force-release", {"key": HELD, "reason": "stuck"}, "API token 'dashboard' has no 'admin' permission", status=403, error="forbidden", auth="Bearer " + READER),
    get("auth-no-read-permission", "/v1/holders", "namespace=other", "API token 'dashboard' has no 'read' permission", status=403, error="forbidden", auth="Bearer " + READER),
]
# fmt: on


# -- the server, and the state that must not change ----------------------------------------


class Server:
    """The app in-process; ``call`` sends with the admin token when there is a token file."""

    def __init__(self, api: httpx.AsyncClient, secured: bool) -> None:
        self.api = api
        self.headers = {"Authorization": f"Bearer {ADMIN}"} if secured else {}

    async def call(self, method: str, path: str, **options: Any) -> httpx.Response:
        reply = await self.api.request(method, path, headers=self.headers, **options)
        assert reply.status_code == 200, reply.text
        return reply

    async def acquire(self, key: str, **fields: Any) -> dict[str, Any]:
        return dict((await self.call("POST", "/v1/acquire", json={"key": key, **fields})).json())

    async def release(self, key: str, token: str) -> None:
        await self.call("POST", "/v1/release", json={"key": key, "token": token})

    async def holder(self, key: str) -> dict[str, Any] | None:
        reply = await self.call("GET", "/v1/holder", params={"key": key})
        return reply.json()["holder"]  # type: ignore[no-any-return]

    async def state(self) -> tuple[list[tuple[Any, ...]], list[float], int]:
        """The listing (expiry apart), the expiries, and the fence a probe gets."""
        holders = (await self.call("GET", "/v1/holders")).json()["holders"]
        probe = await self.acquire(KEY)
        await self.release(KEY, probe["token"])
        return (
            [(h["key"], h["owner"], h["info"], h["fence"], h["acquired_at"]) for h in holders],
            [h["expires_at"] for h in holders],
            probe["fence"],
        )


async def _prepare(server: Server, setup: str | None) -> Ctx:
    held = await server.acquire(HELD, ttl=BYSTANDER_TTL, info={"role": "bystander"})
    x = Ctx(held["token"], held["fence"])
    if setup is None:
        return x
    gone = await server.acquire(GONE, ttl=0.05 if setup == "expired" else 30)
    x.gone = gone["token"]
    if setup == "released":
        await server.release(GONE, gone["token"])
    elif setup == "expired":
        deadline = time.monotonic() + PATIENCE
        while await server.holder(GONE) is not None:
            assert time.monotonic() < deadline, "the lease did not expire"
            await asyncio.sleep(0.01)
    elif setup == "stolen":
        x.thief = (await server.acquire(GONE, steal=True))["fence"]
    return x


async def _send(api: httpx.AsyncClient, row: Req, x: Ctx) -> httpx.Response:
    send = row.send(x) if callable(row.send) else row.send
    headers = dict(row.headers)
    if row.auth:
        headers["Authorization"] = row.auth
    if row.method == "GET":
        return await api.get(f"{row.path}?{send}", headers=headers)
    if isinstance(send, bytes):
        return await api.post(row.path, content=send, headers=headers)
    body = json.dumps(send).encode()  # ensure_ascii: "\x00" travels as \u0000
    return await api.post(row.path, content=body, headers={**JSON_TYPE, **headers})


def _check_reply(reply: httpx.Response, row: Req, x: Ctx) -> None:
    text = reply.text
    assert reply.status_code == row.status, f"{reply.status_code} {text}"
    assert reply.headers["content-type"] == "application/json", reply.headers
    assert "Traceback" not in text
    assert x.token not in text, "the reply shows the bystander's token"
    body = reply.json()
    assert body["error"] == row.error, body
    message = body["message"]
    assert isinstance(message, str)
    for fragment in row.fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    if row.status == 401:
        assert reply.headers["www-authenticate"].startswith("Bearer")
    if row.holder is not None:
        holder = body["holder"]
        if row.holder == "none":
            assert holder is None, holder
        else:
            assert holder is not None
            assert holder["fence"] == (x.fence if row.holder == "bystander" else x.thief)


async def _refused(row: Req, url: str, tmp_path: Path) -> None:
    token_file = None
    if row.auth is not None:
        token_file = tmp_path / "tokens.json"
        token_file.write_text(json.dumps(TOKENS))
    app = create_app(url, max_wait=2.0, token_file=token_file)
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:7420") as api:
            server = Server(api, secured=token_file is not None)
            x = await _prepare(server, row.setup)
            before = await server.state()

            _check_reply(await _send(api, row, x), row, x)

            holders, expires, fence = await server.state()
            assert holders == before[0], "the holders changed"
            for was, now in zip(before[1], expires, strict=True):
                assert abs(now - was) < EXPIRY_SLACK, f"a lease's expiry moved by {now - was} s"
            assert fence == before[2] + 1, f"fences were consumed: {before[2]} then {fence}"
    finally:
        await app.state.keymutex.namespaces.aclose()  # ASGITransport runs no lifespan


def _url(store: str, tmp_path: Path) -> str:
    if store == "sqlite":
        return f"sqlite:///{tmp_path}/locks.db"
    return f"memory://bad-input-http-{uuid.uuid4().hex}"


@pytest.mark.parametrize("row", ROWS)
def test_refused_over_http(row: Req, tmp_path: Path) -> None:
    asyncio.run(_refused(row, _url(row.store, tmp_path), tmp_path))


# -- refusals that are not an error reply ---------------------------------------------------


async def _renew_many_refuses_each_wrong_token(url: str) -> None:
    app = create_app(url, max_wait=2.0)
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:7420") as api:
            server = Server(api, secured=False)
            x = await _prepare(server, None)
            before = await server.state()
            leases = [
                {"key": HELD, "token": x.token[:-1]},
                {"key": HELD, "token": "t" * 24},
                {"key": KEY, "token": x.token},
            ]
            reply = await api.post("/v1/renew-many", json={"leases": leases})
            assert reply.status_code == 200, reply.text
            assert x.token not in reply.text
            results = reply.json()["results"]
            assert [r["error"] for r in results] == ["lock_lost"] * 3
            assert [r["holder"] and r["holder"]["fence"] for r in results] == [
                x.fence,
                x.fence,
                None,
            ]
            after = await server.state()
            assert after[0] == before[0]
            assert all(abs(a - b) < EXPIRY_SLACK for a, b in zip(after[1], before[1], strict=True))
            assert after[2] == before[2] + 1
    finally:
        await app.state.keymutex.namespaces.aclose()


def test_renew_many_answers_200_and_refuses_each_wrong_token() -> None:
    """A batch is not refused whole: each lease that a token does not hold is lock_lost."""
    asyncio.run(_renew_many_refuses_each_wrong_token(_url("memory", Path())))


# -- what looks bad but is accepted -------------------------------------------------------


async def _utf8_is_accepted(url: str) -> None:
    app = create_app(url, max_wait=2.0)
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:7420") as api:
            server = Server(api, secured=False)
            info = {"b": "é" * 2044}  # 4096 bytes as UTF-8 JSON, as the Python API counts
            lease = await server.acquire("clé", info=info)
            assert lease["info"] == info
            # The key percent-encoded as UTF-8, in the query string: found.
            reply = await server.call("GET", "/v1/holder", params={"key": "clé"})
            assert reply.json()["holder"]["fence"] == lease["fence"]
            reply = await server.call("GET", "/v1/holders", params={"prefix": "cl\u00e9"})
            assert [h["key"] for h in reply.json()["holders"]] == ["clé"]
            await server.release("clé", lease["token"])
            # The least TTL, 1 ms, is granted (and is gone soon after).
            await server.acquire(KEY, ttl=0.001)
    finally:
        await app.state.keymutex.namespaces.aclose()


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_utf8_info_and_queries_are_accepted(store: str, tmp_path: Path) -> None:
    asyncio.run(_utf8_is_accepted(_url(store, tmp_path)))

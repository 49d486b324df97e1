"""The OpenAPI 3 document served at ``/openapi.json``: docs/http-api.md, for machines.

Written by hand next to the limits it states (``_input``), so that the two cannot
drift apart unseen: the server tests drive the API from this document (schemathesis).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from keymutex._client import MAX_NAMESPACE_BYTES, MAX_OWNER_BYTES
from keymutex._validate import MAX_KEY_BYTES, MAX_REASON_CHARS, MAX_TOKEN_CHARS, MIN_TTL
from keymutex._version import __version__
from keymutex.server._input import (
    DEFAULT_TTL,
    MAX_FENCE,
    MAX_RENEWALS,
    MAX_TTL,
    MIN_CALLER_TOKEN_CHARS,
)

__all__ = ["openapi_document"]

JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = list(required)
    return schema


_URL_SAFE = "^[A-Za-z0-9_-]+$"

SCHEMAS: dict[str, Any] = {
    # Lengths are in bytes of UTF-8 for the server; maxLength counts characters.
    "Namespace": {
        "type": "string",
        "maxLength": MAX_NAMESPACE_BYTES,
        "default": "",
        "description": f"At most {MAX_NAMESPACE_BYTES} bytes of UTF-8, no NUL.",
    },
    "Key": {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_KEY_BYTES,
        "description": f"1 to {MAX_KEY_BYTES} bytes of UTF-8, no NUL.",
    },
    "Ttl": {
        "type": "number",
        "minimum": MIN_TTL,
        "maximum": MAX_TTL,
        "default": DEFAULT_TTL,
        "description": f"Seconds the lease lives unless renewed: {MIN_TTL} (1 ms) to {MAX_TTL:.0f}.",
    },
    "Timeout": {
        "type": "number",
        "minimum": 0,
        "description": "Seconds to wait; the server waits at most its max_wait (30 s).",
    },
    "Info": {
        "type": "object",
        "nullable": True,
        "description": "Any JSON object of at most 4 KiB, shown to everyone with the lease.",
    },
    "LeaseToken": {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_TOKEN_CHARS,
        "pattern": _URL_SAFE,
        "description": "The secret of a lease, as returned by acquire.",
    },
    "Holder": _object(
        {
            "key": _ref("Key"),
            "owner": {"type": "string"},
            "info": _ref("Info"),
            "fence": {"type": "integer", "minimum": 0},
            "acquired_at": {"type": "number", "description": "UNIX seconds (display only)."},
            "expires_at": {"type": "number", "description": "UNIX seconds (display only)."},
            "expires_in": {"type": "number", "minimum": 0},
        },
        ("key", "owner", "info", "fence", "acquired_at", "expires_at", "expires_in"),
    ),
    "NullableHolder": {"allOf": [_ref("Holder")], "nullable": True},
    "Lease": _object(
        {
            "key": _ref("Key"),
            "owner": {"type": "string"},
            "info": _ref("Info"),
            "fence": {"type": "integer", "minimum": 0},
            "acquired_at": {"type": "number"},
            "expires_at": {"type": "number"},
            "expires_in": {"type": "number", "minimum": 0},
            "token": _ref("LeaseToken"),
            "ttl": {"type": "number"},
        },
        (
            "key",
            "owner",
            "info",
            "fence",
            "acquired_at",
            "expires_at",
            "expires_in",
            "token",
            "ttl",
        ),
    ),
    "Error": {
        "type": "object",
        "properties": {
            "error": {
                "type": "string",
                "enum": [
                    "invalid_argument",
                    "unauthorized",
                    "forbidden",
                    "not_found",
                    "method_not_allowed",
                    "locked",
                    "lock_lost",
                    "payload_too_large",
                    "request_timeout",
                    "headers_too_large",
                    "unsupported_media_type",
                    "store_unavailable",
                    "shutting_down",
                    "internal_error",
                ],
            },
            "message": {"type": "string"},
            "holder": _ref("NullableHolder"),
        },
        "required": ["error", "message"],
    },
    "AcquireRequest": _object(
        {
            "namespace": _ref("Namespace"),
            "key": _ref("Key"),
            "ttl": _ref("Ttl"),
            "timeout": {**_ref("Timeout")},
            "info": _ref("Info"),
            "steal": {"type": "boolean", "default": False},
            "owner": {"type": "string", "minLength": 1, "maxLength": MAX_OWNER_BYTES},
            "token": {
                "type": "string",
                "minLength": MIN_CALLER_TOKEN_CHARS,
                "maxLength": MAX_TOKEN_CHARS,
                "pattern": _URL_SAFE,
                "description": "The lease token, chosen by the caller (at least 128 random"
                " bits); default: the server draws one.",
            },
        },
        ("key",),
    ),
    "RenewRequest": _object(
        {
            "namespace": _ref("Namespace"),
            "key": _ref("Key"),
            "token": _ref("LeaseToken"),
            "ttl": _ref("Ttl"),
        },
        ("key", "token"),
    ),
    "RenewManyRequest": _object(
        {
            "namespace": _ref("Namespace"),
            "leases": {
                "type": "array",
                "maxItems": MAX_RENEWALS,
                "items": _object(
                    {"key": _ref("Key"), "token": _ref("LeaseToken"), "ttl": _ref("Ttl")},
                    ("key", "token"),
                ),
            },
        },
        ("leases",),
    ),
    "RenewManyResult": {
        "oneOf": [
            _ref("Lease"),
            _object(
                {
                    "error": {"type": "string", "enum": ["lock_lost"]},
                    "message": {"type": "string"},
                    "holder": _ref("NullableHolder"),
                },
                ("error", "holder"),
            ),
        ]
    },
    "ReleaseRequest": _object(
        {"namespace": _ref("Namespace"), "key": _ref("Key"), "token": _ref("LeaseToken")},
        ("key", "token"),
    ),
    "WaitRequest": _object(
        {
            "namespace": _ref("Namespace"),
            "key": _ref("Key"),
            "fence": {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_FENCE,
                "nullable": True,
                "description": "The fence of the holder last seen; null: the key was seen free.",
            },
            "timeout": _ref("Timeout"),
            "holding": {
                "type": "boolean",
                "description": "true: the caller holds the lease of this fence and watches"
                " it (to learn at once that it was taken over): not counted as a waiter.",
            },
        },
        ("key", "fence", "timeout"),
    ),
    "ForceReleaseRequest": _object(
        {
            "namespace": _ref("Namespace"),
            "key": _ref("Key"),
            "reason": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_REASON_CHARS,
                "pattern": r"\S",
                "description": "Why (logged): not blank.",
            },
            "fence": {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_FENCE,
                "nullable": True,
                "description": "Release only the lease of this fence: if another holds the"
                " key now, 409 locked (nothing released).",
            },
        },
        ("key", "reason"),
    ),
    "Holders": _object(
        {
            "holders": {"type": "array", "items": _ref("Holder")},
            "waiting": {
                "type": "object",
                "additionalProperties": {"type": "integer", "minimum": 1},
            },
        },
        ("holders", "waiting"),
    ),
}

_ERRORS = {
    "400": "Bad JSON, an unknown or missing field, or a value out of range (invalid_argument).",
    "401": "Missing or unknown API token (unauthorized).",
    "403": "The API token has no such permission here (forbidden).",
    "408": "Under keymutex serve: the request had not all arrived --request-timeout seconds"
    " after its first byte (request_timeout); nothing was done, the connection is closed.",
    "413": "The body is over 16 KiB (payload_too_large).",
    "415": "The body is not application/json, or not UTF-8 (unsupported_media_type).",
    "431": "The request line and headers are over 32 KiB (headers_too_large).",
    "503": "The server's store failed (store_unavailable), or the server was stopped while"
    " the request waited (shutting_down).",
}


def _answers(
    ok: dict[str, Any], *codes: str, body: bool = True, conflict: str | None = None
) -> dict[str, Any]:
    error = {"content": {JSON: {"schema": _ref("Error")}}}
    answers: dict[str, Any] = {"200": ok}
    for code in codes:
        if not body and code in ("413", "415"):
            continue
        answers[code] = {"description": _ERRORS[code], **error}
    if conflict is not None:
        answers["409"] = {"description": conflict, **error}
    return answers


def _json_ok(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _post(
    summary: str, request: str, ok: dict[str, Any], conflicts: str | None = None
) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
            "responses": _answers(
                ok, "400", "401", "403", "408", "413", "415", "431", "503", conflict=conflicts
            ),
        }
    }


def _query(name: str, schema: dict[str, Any], required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "schema": schema}


_ALL_CODES = ("400", "401", "403", "408", "431", "503")

PATHS: dict[str, Any] = {
    "/v1/acquire": _post(
        "Acquire a key: try once (timeout 0) or wait up to min(timeout, max_wait).",
        "AcquireRequest",
        _json_ok("The lease, with its token.", _ref("Lease")),
        "Not acquired in time (locked); holder is the current holder or null.",
    ),
    "/v1/renew": _post(
        "Extend the lease that token holds on key.",
        "RenewRequest",
        _json_ok("The renewed lease.", _ref("Lease")),
        "The token no longer holds the key (lock_lost); holder is the new holder or null.",
    ),
    "/v1/renew-many": _post(
        "Renew many leases in one request; results in request order.",
        "RenewManyRequest",
        _json_ok(
            "One result per lease.",
            _object(
                {"results": {"type": "array", "items": _ref("RenewManyResult")}}, ("results",)
            ),
        ),
    ),
    "/v1/release": _post(
        "Release the lease that token holds on key.",
        "ReleaseRequest",
        _json_ok(
            "Released.",
            _object({"released": {"type": "boolean", "enum": [True]}}, ("released",)),
        ),
        "The token no longer holds the key (lock_lost).",
    ),
    "/v1/wait": _post(
        "Long poll until the key is no longer held by the lease with this fence.",
        "WaitRequest",
        _json_ok(
            "changed: the key is free or held by another lease; else the time ran out.",
            _object(
                {"changed": {"type": "boolean"}, "holder": _ref("NullableHolder")},
                ("changed", "holder"),
            ),
        ),
    ),
    "/v1/force-release": _post(
        "Take the key over and release it (admin): the fence moves on.",
        "ForceReleaseRequest",
        _json_ok(
            "released: whether a lease was displaced; holder: the displaced one.",
            _object(
                {"released": {"type": "boolean"}, "holder": _ref("NullableHolder")},
                ("released", "holder"),
            ),
        ),
        "fence was given and another lease holds the key now (locked); holder is it.",
    ),
    "/v1/holder": {
        "get": {
            "summary": "The current holder of a key, or null.",
            "parameters": [
                _query("namespace", _ref("Namespace")),
                _query("key", _ref("Key"), required=True),
            ],
            "responses": _answers(
                _json_ok("The holder.", _object({"holder": _ref("NullableHolder")}, ("holder",))),
                *_ALL_CODES,
                body=False,
            ),
        }
    },
    "/v1/holders": {
        "get": {
            "summary": "Every current lease whose key starts with prefix, sorted by key.",
            "parameters": [
                _query("namespace", _ref("Namespace")),
                _query("prefix", {"type": "string", "maxLength": MAX_KEY_BYTES, "default": ""}),
            ],
            "responses": _answers(
                _json_ok("Holders, and requests waiting at this server.", _ref("Holders")),
                *_ALL_CODES,
                body=False,
            ),
        }
    },
    "/v1/events": {
        "get": {
            "summary": "Server-Sent Events: a `holders` snapshot on each change and every 5 s.",
            "parameters": [
                _query("namespace", _ref("Namespace")),
                _query("prefix", {"type": "string", "maxLength": MAX_KEY_BYTES, "default": ""}),
            ],
            "responses": _answers(
                {
                    "description": (
                        "event: holders, data: Holders (the first 500 holders and waited-for"
                        " keys by key) plus total (holders in the view) and server_time."
                    ),
                    "content": {"text/event-stream": {"schema": {"type": "string"}}},
                },
                *_ALL_CODES,
                body=False,
            ),
        }
    },
    "/healthz": {
        "get": {
            "summary": "Whether the server reaches its store.",
            "security": [],
            "responses": _answers(
                _json_ok(
                    "Healthy.",
                    _object(
                        {
                            "ok": {"type": "boolean"},
                            "store": {"type": "string"},
                            "durable_fences": {"type": "boolean"},
                        },
                        ("ok", "store", "durable_fences"),
                    ),
                ),
                "400",
                "503",
                body=False,
            ),
        }
    },
    "/metrics": {
        "get": {
            "summary": "Prometheus metrics (read permission on every namespace, '*').",
            "responses": _answers(
                {
                    "description": (
                        "Prometheus text format: acquires, refusals, waits, renewals, lost"
                        " leases, releases, force releases and held locks per namespace, the"
                        " namespaces open, request latency per route (docs/http-api.md)."
                    ),
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                },
                "401",
                "403",
                "408",
                "431",
                body=False,
            ),
        }
    },
}


@functools.cache
def _document() -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "keymutex lock server",
            "version": __version__,
            "description": "Lease locks per key over HTTP. See docs/http-api.md.",
        },
        "paths": PATHS,
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        # A token is needed only when the server runs with --token-file.
        "security": [{}, {"bearer": []}],
    }


def openapi_document() -> dict[str, Any]:
    """A fresh copy of the document (callers may change theirs)."""
    return copy.deepcopy(_document())

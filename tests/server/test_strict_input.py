"""What the server refuses: every refusal is a 4xx JSON error with its stable code."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from keymutex.server._input import renewals

pytestmark = pytest.mark.asyncio

JSON = {"Content-Type": "application/json"}


def _error(reply: httpx.Response, status: int, code: str, *names: str) -> str:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert body["error"] == code
    assert isinstance(body["message"], str)
    for name in names:
        assert name in body["message"], body["message"]
    return str(body["message"])


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        pytest.param(b'{"key": "a", "ttl": NaN}', ("NaN",), id="nan"),
        pytest.param(b'{"key": "a", "ttl": Infinity}', ("Infinity",), id="infinity"),
        pytest.param(b'{"key": "a", "ttl": -Infinity}', ("Infinity",), id="minus-infinity"),
        pytest.param(b'{"key": "a", "ttl": 1e999}', ("range",), id="huge-float"),
        pytest.param(b'{"key": "a", "key": "b"}', ("key", "more than once"), id="duplicate"),
        pytest.param(b'{"key": "a", "extra": 1}', ("extra",), id="unknown-field"),
        pytest.param(b'{"key": "a", "Key": "b"}', ("Key",), id="unknown-case"),
        pytest.param(b'{"key": "a"', ("JSON",), id="truncated"),
        pytest.param(b"", ("JSON",), id="empty"),
        pytest.param(b'["key"]', ("object",), id="array"),
        pytest.param(b'"key"', ("object",), id="string"),
        pytest.param(b"\xff\xfe{}", ("UTF-8",), id="not-utf8"),
        pytest.param(b'{"key": "\\ud800"}', ("surrogate",), id="lone-surrogate-key"),
        pytest.param(
            b'{"key": "a", "info": {"x": "\\udfff"}}', ("surrogate",), id="lone-surrogate-info"
        ),
        pytest.param(b"[" * 5000 + b"]" * 5000, ("nested",), id="deep-nesting"),
        pytest.param(b'{"key": "a", "ttl": ' + b"9" * 5000 + b"}", (), id="huge-int"),
        pytest.param(b"{}", ("key", "required"), id="missing-key"),
        pytest.param(b'{"key": ""}', ("key",), id="empty-key"),
        pytest.param(b'{"key": "a\\u0000b"}', ("key", "NUL"), id="nul-key"),
        pytest.param(b'{"key": "' + b"k" * 1025 + b'"}', ("key", "1024"), id="long-key"),
        pytest.param(b'{"key": 42}', ("key",), id="int-key"),
        pytest.param(b'{"key": "a", "ttl": 0}', ("ttl",), id="ttl-zero"),
        pytest.param(b'{"key": "a", "ttl": 86401}', ("ttl", "86400"), id="ttl-over-a-day"),
        pytest.param(b'{"key": "a", "ttl": true}', ("ttl",), id="ttl-bool"),
        pytest.param(b'{"key": "a", "ttl": "5"}', ("ttl",), id="ttl-string"),
        pytest.param(b'{"key": "a", "timeout": -1}', ("timeout",), id="timeout-negative"),
        pytest.param(b'{"key": "a", "timeout": null}', ("timeout",), id="timeout-null"),
        pytest.param(b'{"key": "a", "info": [1]}', ("info",), id="info-list"),
        pytest.param(
            b'{"key": "a", "info": {"b": "' + b"x" * 5000 + b'"}}', ("info",), id="info-over-4k"
        ),
        pytest.param(b'{"key": "a", "steal": 1}', ("steal",), id="steal-int"),
        pytest.param(b'{"key": "a", "owner": ""}', ("owner",), id="owner-empty"),
        pytest.param(b'{"key": "a", "namespace": 7}', ("namespace",), id="namespace-int"),
        pytest.param(b'{"key": "a", "token": "bad token!"}', ("token",), id="token-garbage"),
    ],
)
async def test_bad_acquire_bodies_are_invalid_argument(
    api: httpx.AsyncClient, raw: bytes, names: tuple[str, ...]
) -> None:
    reply = await api.post("/v1/acquire", content=raw, headers=JSON)
    _error(reply, 400, "invalid_argument", *names)
    # Nothing was acquired by any of them.
    assert (await api.get("/v1/holders")).json()["holders"] == []


@pytest.mark.parametrize(
    ("path", "body", "names"),
    [
        ("/v1/renew", {"key": "a"}, ("token", "required")),
        ("/v1/renew", {"key": "a", "token": 5}, ("token",)),
        ("/v1/release", {"key": "a", "token": "t" * 24, "ttl": 3}, ("ttl",)),
        ("/v1/renew-many", {"leases": {}}, ("leases",)),
        ("/v1/renew-many", {"leases": [{"key": "a"}]}, ("leases[0].token",)),
        ("/v1/renew-many", {"leases": [{"key": "a", "token": "t" * 24, "x": 1}]}, ("x",)),
        ("/v1/wait", {"key": "a", "timeout": 1}, ("fence", "required")),
        ("/v1/wait", {"key": "a", "fence": 1.5, "timeout": 1}, ("fence",)),
        ("/v1/wait", {"key": "a", "fence": True, "timeout": 1}, ("fence",)),
        ("/v1/wait", {"key": "a", "fence": -1, "timeout": 1}, ("fence",)),
        ("/v1/wait", {"key": "a", "fence": 1}, ("timeout", "required")),
        ("/v1/force-release", {"key": "a"}, ("reason", "required")),
        ("/v1/force-release", {"key": "a", "reason": ""}, ("reason",)),
        ("/v1/force-release", {"key": "a", "reason": "r" * 501}, ("reason", "500")),
    ],
)
async def test_bad_bodies_of_other_endpoints(
    api: httpx.AsyncClient, path: str, body: object, names: tuple[str, ...]
) -> None:
    _error(await api.post(path, json=body), 400, "invalid_argument", *names)


async def test_body_over_16_kib_is_payload_too_large(api: httpx.AsyncClient) -> None:
    padding = "x" * (16 * 1024)
    reply = await api.post("/v1/acquire", content=f'{{"key": "{padding}"}}', headers=JSON)
    _error(reply, 413, "payload_too_large")


async def test_streamed_body_over_16_kib_is_payload_too_large(api: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked
        yield b'{"key": "'
        for _ in range(40):
            yield b"y" * 1024
        yield b'"}'

    reply = await api.post("/v1/acquire", content=chunks(), headers=JSON)
    _error(reply, 413, "payload_too_large")


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "application/jsonx"]
)
async def test_body_that_is_not_json_is_unsupported_media_type(
    api: httpx.AsyncClient, content_type: str | None
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    reply = await api.post("/v1/acquire", content=b'{"key": "a"}', headers=headers)
    _error(reply, 415, "unsupported_media_type")


async def test_json_with_a_charset_parameter_is_accepted(api: httpx.AsyncClient) -> None:
    headers = {"Content-Type": "Application/JSON; charset=utf-8"}
    reply = await api.post("/v1/acquire", content=b'{"key": "a"}', headers=headers)
    assert reply.status_code == 200


@pytest.mark.parametrize(
    ("query", "names"),
    [
        ("", ("key", "required")),
        ("key=a&key=b", ("key", "more than once")),
        ("key=a&secret=1", ("secret",)),
        ("key=a%00b", ("key", "NUL")),
        ("key=" + "k" * 1025, ("key",)),
    ],
)
async def test_bad_queries_are_invalid_argument(
    api: httpx.AsyncClient, query: str, names: tuple[str, ...]
) -> None:
    _error(await api.get(f"/v1/holder?{query}"), 400, "invalid_argument", *names)


async def test_holders_refuses_unknown_query_parameters(api: httpx.AsyncClient) -> None:
    _error(await api.get("/v1/holders?prefx=a"), 400, "invalid_argument", "prefx")
    _error(await api.get("/v1/events?namespace=a&namespace=b"), 400, "invalid_argument")


async def test_healthz_refuses_query_parameters_as_the_api_does(api: httpx.AsyncClient) -> None:
    """Found by a new user's walk-through: ``/healthz?x=1`` was answered 200, though an
    unknown query parameter is ``invalid_argument`` (docs/http-api.md, Conventions)."""
    message = _error(await api.get("/healthz?x=1"), 400, "invalid_argument", "'x'")
    assert message == "unknown query parameter(s) 'x'; accepted: none"
    _error(await api.get("/healthz?%FF"), 400, "invalid_argument", "UTF-8")
    assert (await api.get("/healthz")).status_code == 200


async def test_renew_many_is_bounded_by_count_and_by_body_size(api: httpx.AsyncClient) -> None:
    # 1000 leases never fit in 16 KiB; the count limit holds however the body is sent.
    leases = [{"key": "a", "token": "t"}] * 1001
    _error(await api.post("/v1/renew-many", json={"leases": leases}), 413, "payload_too_large")
    with pytest.raises(ValueError, match="1000"):
        renewals(leases, "leases")

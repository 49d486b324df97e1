"""The server's front door: which Host it answers without a token file, and many namespaces at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from keymutex.server import create_app

from .conftest import EDITOR_TOKEN, Live, bearer, close_app, write_tokens

ANSWERED = [
    "127.0.0.1:7420",
    "127.0.0.2",
    "localhost:7420",
    "LocalHost.",
    "app.localhost",
    "[::1]:7420",
    "[::1]",
    "10.0.0.1:7420",  # an IP address cannot be rebound (a TCP proxy may send one)
    "[2001:db8::1]:7420",
]
OTHERS = [
    "attacker.example:7420",
    "attacker.example",
    "localhost.attacker.example",
    "127.0.0.1.nip.io",
    "",
]


async def _post(
    app: object, host: str | None, path: str, body: dict[str, object], **headers: str
) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:7420") as client:
        if host is not None:
            headers["Host"] = host
        return await client.post(path, json=body, headers=headers)


@pytest.mark.asyncio
@pytest.mark.parametrize("host", ANSWERED)
async def test_without_a_token_file_an_ip_address_or_localhost_is_answered(
    tmp_path: Path, host: str
) -> None:
    app = create_app(f"sqlite:///{tmp_path}/locks.db")
    try:
        reply = await _post(app, host, "/v1/acquire", {"key": "doc"})
        assert reply.status_code == 200, reply.text
    finally:
        await close_app(app)


@pytest.mark.asyncio
@pytest.mark.parametrize("host", OTHERS)
async def test_without_a_token_file_another_host_is_refused_and_changes_nothing(
    tmp_path: Path, host: str
) -> None:
    """DNS rebinding: a page's own name pointed at 127.0.0.1 is in its requests' Host.
    (An IP address cannot be rebound: a TCP proxy in front of the server may use one.)"""
    app = create_app(f"sqlite:///{tmp_path}/locks.db")
    try:
        for path, body in [
            ("/v1/acquire", {"key": "doc"}),
            ("/v1/force-release", {"key": "doc", "reason": "x"}),
        ]:
            reply = await _post(app, host, path, body)
            assert reply.status_code == 403, reply.text
            assert reply.json()["error"] == "forbidden"
            assert (
                "answers only requests addressed to an IP address or localhost"
                in reply.json()["message"]
            )
        listing = await _post(app, None, "/v1/acquire", {"key": "doc", "timeout": 0})
        assert listing.status_code == 200  # the key was never taken
    finally:
        await close_app(app)


def test_the_refusal_of_a_host_names_the_address_the_server_was_reached_at(live: Live) -> None:
    """Found by a new user's walk-through: the example was always ``127.0.0.1:7420``,
    whatever port the server listened on."""
    port = httpx.URL(live.url).port
    reply = httpx.post(
        f"{live.url}/v1/acquire", json={"key": "doc"}, headers={"Host": "attacker.example"}
    )
    assert reply.status_code == 403, reply.text
    message = reply.json()["message"]
    assert f"(Host: 127.0.0.1:{port}, localhost:{port}, [::1]:{port})" in message, message


@pytest.mark.asyncio
async def test_with_a_token_file_any_host_is_answered(tmp_path: Path) -> None:
    app = create_app(f"sqlite:///{tmp_path}/locks.db", token_file=write_tokens(tmp_path))
    try:
        reply = await _post(
            app,
            "locks.internal.example:7420",
            "/v1/acquire",
            {"namespace": "cms", "key": "doc:1"},
            **bearer(EDITOR_TOKEN),
        )
        assert reply.status_code == 200, reply.text
    finally:
        await close_app(app)


@pytest.mark.asyncio
async def test_many_namespaces_at_once_beyond_the_open_client_limit(tmp_path: Path) -> None:
    """Before: a client still being opened for one request was closed by another's trim,
    and 1 to 35 of 150 concurrent acquires answered 503 internal_error."""
    app = create_app(f"sqlite:///{tmp_path}/locks.db", max_namespaces=4)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://127.0.0.1:7420"
        ) as client:

            async def acquire(n: int) -> httpx.Response:
                return await client.post("/v1/acquire", json={"namespace": f"ns{n}", "key": "k"})

            replies = await asyncio.gather(*(acquire(n) for n in range(150)))
            assert [r.status_code for r in replies if r.status_code != 200] == []
            again = await asyncio.gather(*(acquire(n) for n in range(150)))
            assert {r.json()["error"] for r in again} == {"locked"}  # every lease still held
    finally:
        await close_app(app)


@pytest.mark.asyncio
async def test_two_authorization_headers_are_refused_and_change_nothing(tmp_path: Path) -> None:
    """Which of two headers counts depends on each proxy on the way: neither does."""
    app = create_app(f"sqlite:///{tmp_path}/locks.db", token_file=write_tokens(tmp_path))
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://127.0.0.1:7420"
        ) as client:
            body = {"namespace": "cms", "key": "doc:1"}
            twice = [
                ("Authorization", f"Bearer {EDITOR_TOKEN}"),
                ("Authorization", "Bearer someone-else-entirely-0000000000"),
            ]
            reply = await client.post("/v1/acquire", json=body, headers=twice)
            assert reply.status_code == 400, reply.text
            assert reply.json() == {
                "error": "invalid_argument",
                "message": "send one Authorization header, not 2",
            }
            once = await client.post("/v1/acquire", json=body, headers=bearer(EDITOR_TOKEN))
            assert once.status_code == 200, once.text  # the key was not taken
    finally:
        await close_app(app)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
        ('Application/JSON; Charset="UTF-8"', 200),
        ("application/json; charset=latin-1", 415),
        ("application/json; charset=utf-16", 415),
    ],
)
async def test_a_body_in_another_charset_than_utf_8_is_refused(
    tmp_path: Path, content_type: str, status: int
) -> None:
    """Before: a body declared latin-1 was read as UTF-8, so 'é' in info came out mangled."""
    app = create_app(f"sqlite:///{tmp_path}/locks.db")
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://127.0.0.1:7420"
        ) as client:
            body = '{"key": "doc", "info": {"editor": "Zoé"}}'.encode("latin-1")
            if "utf" in content_type.lower() or "charset" not in content_type:
                body = '{"key": "doc", "info": {"editor": "Zoé"}}'.encode()
            reply = await client.post(
                "/v1/acquire", content=body, headers={"Content-Type": content_type}
            )
            assert reply.status_code == status, reply.text
            if status == 200:
                assert reply.json()["info"] == {"editor": "Zoé"}
            else:
                assert reply.json()["error"] == "unsupported_media_type"
                assert "send the body as UTF-8 JSON: charset" in reply.json()["message"]
                holder = await client.get("/v1/holder", params={"key": "doc"})
                assert holder.json()["holder"] is None
    finally:
        await close_app(app)


@pytest.mark.parametrize("when", ["before", "while"])
def test_a_namespace_asked_for_as_the_server_shuts_down_is_503_shutting_down(when: str) -> None:
    """Found by a hunt: a request that reached the namespaces after shutdown began (or
    whose namespace was still opening then) raised a plain RuntimeError, which the
    server logged with a traceback and answered 503 ``internal_error``; it is the
    ``shutting_down`` every other request gets then, which says to try again."""
    from keymutex.server._input import ApiError
    from keymutex.server._metrics import Metrics
    from keymutex.server._state import Namespaces

    async def scenario() -> ApiError:
        namespaces = Namespaces("memory://", 2, Metrics())

        async def use() -> None:
            async with namespaces.using("orders"):
                pass

        if when == "before":
            await namespaces.aclose()
            using = asyncio.ensure_future(use())
        else:
            using = asyncio.ensure_future(use())
            await asyncio.sleep(0)  # its namespace is opening (in a thread)
            await namespaces.aclose()
        with pytest.raises(ApiError) as refused:
            await using
        assert namespaces.names() == []  # nothing left open
        return refused.value

    refused = asyncio.run(scenario())
    assert (refused.status, refused.error) == (503, "shutting_down")

"""API tokens: who may do what, per namespace and key prefix (docs/http-api.md, Auth)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from keymutex.server import create_app

from .conftest import ADMIN_TOKEN, EDITOR_TOKEN, READER_TOKEN, bearer

pytestmark = pytest.mark.asyncio


async def test_requests_without_a_known_token_are_unauthorized(
    secured: httpx.AsyncClient,
) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}):
        reply = await secured.post("/v1/acquire", json={"key": "a"}, headers=headers)
        assert reply.status_code == 401
        assert reply.json()["error"] == "unauthorized"
        assert reply.headers["www-authenticate"].startswith("Bearer")
    assert (
        await secured.get("/v1/holders", headers={"Authorization": "Bearer"})
    ).status_code == 401
    assert (await secured.get("/metrics")).status_code == 401


async def test_open_routes_need_no_token(secured: httpx.AsyncClient) -> None:
    assert (await secured.get("/healthz")).status_code == 200
    assert (await secured.get("/openapi.json")).status_code == 200
    assert (await secured.get("/static/none.js")).status_code == 404  # not 401


async def test_grants_are_per_namespace_prefix_and_permission(
    secured: httpx.AsyncClient,
) -> None:
    editor, reader = bearer(EDITOR_TOKEN), bearer(READER_TOKEN)
    ok = await secured.post(
        "/v1/acquire", json={"namespace": "cms", "key": "doc:1"}, headers=editor
    )
    assert ok.status_code == 200
    assert ok.json()["owner"] == "editor-app"  # the token's name by default
    for body in ({"namespace": "cms", "key": "img:1"}, {"namespace": "shop", "key": "doc:1"}):
        refused = await secured.post("/v1/acquire", json=body, headers=editor)
        assert refused.status_code == 403
        assert refused.json()["error"] == "forbidden"
        assert "editor-app" in refused.json()["message"]
    # read only: may look, may not lock.
    looked = await secured.get(
        "/v1/holder", params={"namespace": "cms", "key": "doc:1"}, headers=reader
    )
    assert looked.json()["holder"]["owner"] == "editor-app"
    refused = await secured.post(
        "/v1/acquire", json={"namespace": "cms", "key": "doc:2"}, headers=reader
    )
    assert refused.status_code == 403
    # renew-many: every key must be granted.
    lease = ok.json()
    many = {
        "namespace": "cms",
        "leases": [{"key": "doc:1", "token": lease["token"]}, {"key": "x", "token": "t" * 24}],
    }
    assert (await secured.post("/v1/renew-many", json=many, headers=editor)).status_code == 403
    # lock does not include admin.
    forced = await secured.post(
        "/v1/force-release",
        json={"namespace": "cms", "key": "doc:1", "reason": "mine"},
        headers=editor,
    )
    assert forced.status_code == 403
    # /metrics names every namespace: it needs read on all of them ("*"), not on one.
    refused = await secured.get("/metrics", headers=reader)
    assert refused.status_code == 403
    assert 'on every namespace ("*")' in refused.json()["message"]
    assert (await secured.get("/metrics", headers=bearer(ADMIN_TOKEN))).status_code == 200


async def test_a_key_is_read_and_released_only_with_its_grant(
    secured: httpx.AsyncClient,
) -> None:
    """A mutation audit found neither check tested: any token could read any key's
    holder (its owner and info), or release a lease (given its token) on a key it has
    no ``lock`` grant for, such as a read-only dashboard's token."""
    admin, editor, reader = bearer(ADMIN_TOKEN), bearer(EDITOR_TOKEN), bearer(READER_TOKEN)
    place = {"namespace": "cms", "key": "img:1"}
    lease = (await secured.post("/v1/acquire", json=place, headers=admin)).json()
    for params in (place, {"namespace": "shop", "key": "doc:1"}):
        looked = await secured.get("/v1/holder", params=params, headers=editor)
        assert (looked.status_code, looked.json()["error"]) == (403, "forbidden")
    for who in (editor, reader):
        released = await secured.post(
            "/v1/release", json={**place, "token": lease["token"]}, headers=who
        )
        assert (released.status_code, released.json()["error"]) == (403, "forbidden")
    held = (await secured.get("/v1/holder", params=place, headers=admin)).json()
    assert held["holder"]["fence"] == lease["fence"]


async def test_a_token_that_differs_anywhere_is_unknown(secured: httpx.AsyncClient) -> None:
    """The whole secret is compared: one that differs in its last character, or is
    one longer or shorter, is refused (a mutation comparing a prefix survived)."""
    last = "b" if ADMIN_TOKEN[-1] != "b" else "c"
    for near in (ADMIN_TOKEN[:-1] + last, ADMIN_TOKEN + "a", ADMIN_TOKEN[:-1]):
        reply = await secured.post("/v1/acquire", json={"key": "a"}, headers=bearer(near))
        assert reply.status_code == 401, near


async def test_listings_show_only_the_keys_a_token_may_read(secured: httpx.AsyncClient) -> None:
    admin, editor = bearer(ADMIN_TOKEN), bearer(EDITOR_TOKEN)
    for key in ("doc:1", "img:1"):
        body = {"namespace": "cms", "key": key}
        assert (await secured.post("/v1/acquire", json=body, headers=admin)).status_code == 200
    everything = await secured.get("/v1/holders", params={"namespace": "cms"}, headers=admin)
    assert [h["key"] for h in everything.json()["holders"]] == ["doc:1", "img:1"]
    mine = await secured.get("/v1/holders", params={"namespace": "cms"}, headers=editor)
    assert [h["key"] for h in mine.json()["holders"]] == ["doc:1"]
    none = await secured.get(
        "/v1/holders", params={"namespace": "cms", "prefix": "img:"}, headers=editor
    )
    assert none.status_code == 403
    elsewhere = await secured.get("/v1/holders", params={"namespace": "shop"}, headers=editor)
    assert elsewhere.status_code == 403


async def test_admin_force_release_is_logged_and_displaces_the_holder(
    secured: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    editor, admin = bearer(EDITOR_TOKEN), bearer(ADMIN_TOKEN)
    body = {"namespace": "cms", "key": "doc:9"}
    lease = (await secured.post("/v1/acquire", json=body, headers=editor)).json()
    with caplog.at_level(logging.INFO, logger="keymutex.server"):
        forced = await secured.post(
            "/v1/force-release", json={**body, "reason": "stuck editor"}, headers=admin
        )
    assert forced.status_code == 200
    assert forced.json()["released"] is True
    assert forced.json()["holder"]["fence"] == lease["fence"]
    assert "ops" in caplog.text
    assert "stuck editor" in caplog.text
    assert lease["token"] not in caplog.text
    assert ADMIN_TOKEN not in caplog.text
    renew = await secured.post("/v1/renew", json={**body, "token": lease["token"]}, headers=editor)
    assert renew.status_code == 409
    assert renew.json()["error"] == "lock_lost"
    again = (await secured.post("/v1/acquire", json=body, headers=editor)).json()
    assert again["fence"] > lease["fence"] + 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not JSON"),
        ('{"tokens": {}}', "tokens"),
        ('{"tokens": [{"name": "a", "token": "short", "grants": []}]}', "32"),
        (
            '{"tokens": [{"name": "a", "token": "%s", "grants": [{"namespace": "*",'
            ' "allow": ["write"]}]}]}' % ("x" * 32),
            "allow",
        ),
        (
            '{{"tokens": [{{"name": "a", "token": "{}", "grants": []}},'
            ' {{"name": "b", "token": "{}", "grants": []}}]}}'.format("x" * 32, "x" * 32),
            "same",
        ),
        # Found by review: these loaded, and then fewer grants or tokens counted than
        # written, or a token could never be sent as written.
        (
            '{"tokens": [{"name": "a", "token": "%s", "grants": [], "grants": []}]}' % ("x" * 32),
            "field 'grants' appears more than once",
        ),
        ('{"tokens": [], "tokens": []}', "field 'tokens' appears more than once"),
        ('{"tokens": NaN}', "not a JSON number"),
        *(
            (
                json.dumps({"tokens": [{"name": "a", "token": token, "grants": []}]}),
                "visible ASCII characters, without spaces",
            )
            for token in [" " + "x" * 32, "x" * 32 + "\n", " " * 40, "x" * 16 + " " + "x" * 16]
        ),
        (
            json.dumps({"tokens": [{"name": "a\nINFO: forged", "token": "x" * 32, "grants": []}]}),
            "without control characters",
        ),
        (
            json.dumps({"tokens": [{"name": " ", "token": "x" * 32, "grants": []}]}),
            "not blank",
        ),
    ],
)
async def test_bad_token_files_are_refused_at_start(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as refused:
        create_app("memory://", token_file=path)
    assert "x" * 32 not in str(refused.value)


async def test_token_file_secrets_never_appear_in_answers(secured: httpx.AsyncClient) -> None:
    reply = await secured.post(
        "/v1/acquire", json={"namespace": "x", "key": "a"}, headers=bearer(EDITOR_TOKEN)
    )
    assert EDITOR_TOKEN not in reply.text
    assert json.loads(reply.text)["error"] == "forbidden"

"""Each endpoint of docs/http-api.md, called in-process (ASGI): replies, errors, effects."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from keymutex._validate import MAX_INFO_DEPTH
from keymutex.server._app import STATIC
from keymutex.server._metrics import NAMESPACE_SERIES
from keymutex.server._state import Signals

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.asyncio

HOLDER_FIELDS = {"key", "owner", "info", "fence", "acquired_at", "expires_at", "expires_in"}
LEASE_FIELDS = HOLDER_FIELDS | {"token", "ttl"}


async def acquire(api: httpx.AsyncClient, key: str = "doc:1", **body: Any) -> dict[str, Any]:
    reply = await api.post("/v1/acquire", json={"key": key, **body})
    assert reply.status_code == 200, reply.text
    lease: dict[str, Any] = reply.json()
    return lease


async def test_acquire_answers_a_lease_and_a_second_try_is_locked(api: httpx.AsyncClient) -> None:
    lease = await acquire(api, info={"name": "Alice"}, ttl=12, owner="alice@laptop")
    assert set(lease) == LEASE_FIELDS
    assert lease["owner"] == "alice@laptop"
    assert lease["info"] == {"name": "Alice"}
    assert lease["ttl"] == 12
    assert 0 < lease["expires_in"] <= 12
    assert len(lease["token"]) >= 22
    assert abs(lease["expires_at"] - lease["acquired_at"] - 12) < 1
    refused = await api.post("/v1/acquire", json={"key": "doc:1"})
    assert refused.status_code == 409
    body = refused.json()
    assert body["error"] == "locked"
    assert "alice@laptop" in body["message"]
    assert set(body["holder"]) == HOLDER_FIELDS
    assert body["holder"]["fence"] == lease["fence"]
    assert lease["token"] not in refused.text


async def test_owner_defaults_to_the_peer_address(api: httpx.AsyncClient) -> None:
    lease = await acquire(api)
    assert lease["owner"] == "127.0.0.1"  # httpx's ASGITransport client address


async def test_acquire_with_a_chosen_token_and_steal(api: httpx.AsyncClient) -> None:
    token = "T" * 24
    first = await acquire(api, token=token)
    assert first["token"] == token
    stolen = await acquire(api, steal=True, owner="thief")
    assert stolen["fence"] > first["fence"]
    lost = await api.post("/v1/renew", json={"key": "doc:1", "token": token})
    assert lost.status_code == 409
    assert lost.json()["error"] == "lock_lost"
    assert lost.json()["holder"]["owner"] == "thief"
    short = await api.post("/v1/acquire", json={"key": "doc:2", "token": "short"})
    assert short.status_code == 400
    assert "token" in short.json()["message"]


async def test_acquire_waits_at_most_max_wait(api: httpx.AsyncClient) -> None:
    await acquire(api)
    started = time.monotonic()
    refused = await api.post("/v1/acquire", json={"key": "doc:1", "timeout": 3600})
    assert refused.status_code == 409
    assert 1.5 < time.monotonic() - started < 20  # the fixture's max_wait is 2 s


async def test_waiting_acquire_gets_the_key_on_release(api: httpx.AsyncClient) -> None:
    lease = await acquire(api)
    waiting = asyncio.create_task(api.post("/v1/acquire", json={"key": "doc:1", "timeout": 10}))
    for _ in range(200):
        counts = (await api.get("/v1/holders")).json()["waiting"]
        if counts.get("doc:1") == 1:
            break
        await asyncio.sleep(0.01)
    assert counts == {"doc:1": 1}
    released = await api.post("/v1/release", json={"key": "doc:1", "token": lease["token"]})
    assert released.json() == {"released": True}
    granted = (await waiting).json()
    assert granted["fence"] > lease["fence"]
    assert (await api.get("/v1/holders")).json()["waiting"] == {}


async def test_a_holders_waiting_retry_is_answered_with_its_lease_while_others_wait(
    api: httpx.AsyncClient,
) -> None:
    """docs/http-api.md: an acquire whose token holds the key is answered with that
    lease. Found by a review: a retry with a ``timeout`` (the JS client's, after a lost
    answer) queued behind the waiters for its own lease, was refused at its timeout,
    and the key stayed held by a lease its holder did not know it had."""
    token = "R" * 24
    lease = await acquire(api, token=token, ttl=30)
    waiting = asyncio.create_task(api.post("/v1/acquire", json={"key": "doc:1", "timeout": 10}))
    for _ in range(200):
        if (await api.get("/v1/holders")).json()["waiting"].get("doc:1") == 1:
            break
        await asyncio.sleep(0.01)
    again = await api.post("/v1/acquire", json={"key": "doc:1", "token": token, "timeout": 1.5})
    assert again.status_code == 200, again.text
    assert again.json()["fence"] == lease["fence"]
    released = await api.post("/v1/release", json={"key": "doc:1", "token": token})
    assert released.json() == {"released": True}
    granted = await waiting
    assert granted.status_code == 200
    assert granted.json()["fence"] > lease["fence"]


async def test_renew_extends_and_renew_many_answers_in_order(api: httpx.AsyncClient) -> None:
    one, two = await acquire(api, "a", ttl=5), await acquire(api, "b", ttl=5)
    renewed = await api.post("/v1/renew", json={"key": "a", "token": one["token"], "ttl": 60})
    assert renewed.status_code == 200
    assert renewed.json()["ttl"] == 60
    assert 5 < renewed.json()["expires_in"] <= 60
    assert renewed.json()["fence"] == one["fence"]
    many = await api.post(
        "/v1/renew-many",
        json={
            "leases": [
                {"key": "b", "token": two["token"], "ttl": 40},
                {"key": "a", "token": "X" * 24},
                {"key": "a", "token": one["token"]},
            ]
        },
    )
    assert many.status_code == 200
    first, second, third = many.json()["results"]
    assert first["key"] == "b"
    assert first["token"] == two["token"]
    assert first["ttl"] == 40
    assert second["error"] == "lock_lost"
    assert second["holder"]["fence"] == one["fence"]
    assert "token" not in second["holder"]
    assert third["key"] == "a"
    assert third["ttl"] == 30
    empty = await api.post("/v1/renew-many", json={"leases": []})
    assert empty.json() == {"results": []}


async def test_release_twice_is_lock_lost(api: httpx.AsyncClient) -> None:
    lease = await acquire(api)
    body = {"key": "doc:1", "token": lease["token"]}
    assert (await api.post("/v1/release", json=body)).status_code == 200
    again = await api.post("/v1/release", json=body)
    assert again.status_code == 409
    assert again.json() == {
        "error": "lock_lost",
        "message": again.json()["message"],
        "holder": None,
    }


async def test_holder_and_holders(api: httpx.AsyncClient) -> None:
    free = await api.get("/v1/holder", params={"key": "doc:1"})
    assert free.json() == {"holder": None}
    await acquire(api, "doc:2")
    await acquire(api, "doc:1", namespace="other")
    await acquire(api, "doc:1")
    await acquire(api, "img:1")
    held = (await api.get("/v1/holder", params={"key": "doc:1"})).json()["holder"]
    assert set(held) == HOLDER_FIELDS
    listed = (await api.get("/v1/holders", params={"prefix": "doc:"})).json()
    assert [h["key"] for h in listed["holders"]] == ["doc:1", "doc:2"]
    other = (await api.get("/v1/holders", params={"namespace": "other"})).json()
    assert [h["key"] for h in other["holders"]] == ["doc:1"]


async def test_force_release_moves_the_fence_on(api: httpx.AsyncClient) -> None:
    lease = await acquire(api, owner="bob")
    reply = await api.post("/v1/force-release", json={"key": "doc:1", "reason": "bob left"})
    assert reply.status_code == 200
    assert reply.json()["released"] is True
    assert reply.json()["holder"]["owner"] == "bob"
    assert (await api.get("/v1/holder", params={"key": "doc:1"})).json() == {"holder": None}
    lost = await api.post("/v1/renew", json={"key": "doc:1", "token": lease["token"]})
    assert lost.json()["error"] == "lock_lost"
    after = await acquire(api)
    assert after["fence"] > lease["fence"] + 1  # the force-release's own grant came between
    nothing = await api.post("/v1/force-release", json={"key": "free", "reason": "tidy"})
    assert nothing.json() == {"released": False, "holder": None}


async def test_force_release_of_a_chosen_lease_leaves_a_newer_holder_alone(
    api: httpx.AsyncClient,
) -> None:
    """The dashboard's dialog stays open while the admin types a reason: meanwhile the
    holder clicked may release, and someone else take the key. With the fence of the
    lease chosen, the newcomer's lease is not the one released."""
    alice = await acquire(api, owner="alice")
    await api.post("/v1/release", json={"key": "doc:1", "token": alice["token"]})
    bob = await acquire(api, owner="bob")
    chosen = {"key": "doc:1", "reason": "alice's tab crashed", "fence": alice["fence"]}
    refused = await api.post("/v1/force-release", json=chosen)
    assert refused.status_code == 409
    assert refused.json()["error"] == "locked"
    assert refused.json()["holder"]["owner"] == "bob"
    assert "nothing was released" in refused.json()["message"]
    renewed = await api.post("/v1/renew", json={"key": "doc:1", "token": bob["token"]})
    assert renewed.status_code == 200
    released = await api.post("/v1/force-release", json={**chosen, "fence": bob["fence"]})
    assert released.json()["holder"]["owner"] == "bob"


async def test_wait_answers_at_once_when_already_changed(api: httpx.AsyncClient) -> None:
    lease = await acquire(api)
    body = {"key": "doc:1", "fence": lease["fence"] - 1, "timeout": 30}
    started = time.monotonic()
    reply = (await api.post("/v1/wait", json=body)).json()
    assert reply["changed"] is True
    assert reply["holder"]["fence"] == lease["fence"]
    free = (await api.post("/v1/wait", json={"key": "free", "fence": 3, "timeout": 30})).json()
    assert free == {"changed": True, "holder": None}
    assert time.monotonic() - started < 1.5  # far below the 30 s asked (max_wait 2 s)


async def test_wait_times_out_unchanged(api: httpx.AsyncClient) -> None:
    lease = await acquire(api)
    body = {"key": "doc:1", "fence": lease["fence"], "timeout": 0.2}
    reply = (await api.post("/v1/wait", json=body)).json()
    assert reply["changed"] is False
    assert reply["holder"]["fence"] == lease["fence"]


async def test_wait_waits_at_most_max_wait(api: httpx.AsyncClient) -> None:
    """As an acquire's (a mutation that dropped the cap on ``wait`` survived)."""
    lease = await acquire(api)
    body = {"key": "doc:1", "fence": lease["fence"], "timeout": 3600}
    started = time.monotonic()
    reply = (await api.post("/v1/wait", json=body)).json()
    assert reply["changed"] is False
    assert 1.5 < time.monotonic() - started < 20  # the fixture's max_wait is 2 s


async def test_a_holders_own_wait_is_not_counted_among_the_waiters(
    api: httpx.AsyncClient,
) -> None:
    """``holding: true`` (the holder watching its own lease) is not a waiter: only the
    other client's waiting acquire is counted (a mutation counting both survived)."""
    lease = await acquire(api)
    watch = {"key": "doc:1", "fence": lease["fence"], "timeout": 10, "holding": True}
    watching = asyncio.create_task(api.post("/v1/wait", json=watch))
    waiting = asyncio.create_task(api.post("/v1/acquire", json={"key": "doc:1", "timeout": 10}))
    for _ in range(200):
        counts = (await api.get("/v1/holders")).json()["waiting"]
        if counts:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the watch, sent first, has had every chance to count
    assert (await api.get("/v1/holders")).json()["waiting"] == {"doc:1": 1}
    await api.post("/v1/release", json={"key": "doc:1", "token": lease["token"]})
    assert (await watching).json()["changed"] is True
    assert (await waiting).json()["fence"] > lease["fence"]


async def test_wait_returns_when_the_holder_expires(api: httpx.AsyncClient) -> None:
    lease = await acquire(api, ttl=0.3)
    body = {"key": "doc:1", "fence": lease["fence"], "timeout": 10}
    started = time.monotonic()
    reply = (await api.post("/v1/wait", json=body)).json()
    assert reply == {"changed": True, "holder": None}
    assert time.monotonic() - started < 1.9  # before max_wait: woken by the expiry


async def test_healthz_openapi_and_metrics(api: httpx.AsyncClient) -> None:
    assert (await api.get("/healthz")).json() == {
        "ok": True,
        "store": "memory",
        "durable_fences": False,
    }
    document = (await api.get("/openapi.json")).json()
    assert document["openapi"].startswith("3.")
    expected = {"acquire", "renew", "renew-many", "release", "wait", "holder", "holders"}
    expected |= {"force-release", "events"}
    assert {f"/v1/{name}" for name in expected} <= set(document["paths"])
    assert {"/healthz", "/metrics"} <= set(document["paths"])  # /metrics: found by review
    documented = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    metrics = await api.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert list(documented) == ["text/plain"]
    assert "keymutex_http_request_duration_seconds" in metrics.text


async def test_metrics_count_what_happened(api: httpx.AsyncClient) -> None:
    lease = await acquire(api, namespace="shop")
    await api.post("/v1/acquire", json={"namespace": "shop", "key": "doc:1"})
    await api.post(
        "/v1/renew", json={"namespace": "shop", "key": "doc:1", "token": lease["token"]}
    )
    await api.post(
        "/v1/wait", json={"namespace": "shop", "key": "doc:1", "fence": 0, "timeout": 0}
    )
    await acquire(api, "doc:2", namespace="shop")
    await api.post("/v1/release", json={"namespace": "shop", "key": "doc:1", "token": "Z" * 24})
    text = (await api.get("/metrics")).text
    assert 'keymutex_acquires_total{namespace="shop"} 2.0' in text
    assert 'keymutex_refusals_total{namespace="shop"} 1.0' in text
    assert 'keymutex_renewals_total{namespace="shop"} 1.0' in text
    assert 'keymutex_lost_leases_total{namespace="shop"} 1.0' in text
    assert 'keymutex_waits_total{kind="wait",namespace="shop"} 1.0' in text
    assert 'keymutex_wait_seconds_count{kind="wait",namespace="shop"} 1.0' in text
    assert 'keymutex_held_locks{namespace="shop"} 2.0' in text
    assert 'route="/v1/acquire",status="409"' in text


async def test_metrics_keep_a_series_for_the_first_namespaces_only(
    api: httpx.AsyncClient,
) -> None:
    """Before: every namespace a client made up added series for good (memory, scrapes)."""
    count = NAMESPACE_SERIES + 44
    for n in range(count):
        await acquire(api, namespace=f"made-up-{n}")
    text = (await api.get("/metrics")).text
    acquires = [line for line in text.splitlines() if line.startswith("keymutex_acquires_total")]
    assert len(acquires) == NAMESPACE_SERIES + 1
    assert 'keymutex_acquires_total{namespace="made-up-0"} 1.0' in acquires
    assert f'keymutex_acquires_total{{namespace="made-up-{count - 45}"}} 1.0' in acquires
    assert 'keymutex_acquires_total{namespace="*"} 44.0' in acquires
    held = [line for line in text.splitlines() if line.startswith("keymutex_held_locks{")]
    assert len(held) <= NAMESPACE_SERIES + 1
    assert sum(float(line.split()[-1]) for line in held) >= 1  # the open namespaces' leases


async def test_a_lease_with_info_nested_as_deep_as_accepted_is_listed(
    api: httpx.AsyncClient,
) -> None:
    """Info nested ~950 levels deep was accepted, and every listing (``/v1/holders``,
    the dashboard's events, ``/metrics``) then failed decoding it, while it lived."""
    nested: list[Any] = []
    for _ in range(MAX_INFO_DEPTH - 2):  # the info object and its "a" list are 2 levels
        nested = [nested]
    lease = await acquire(api, info={"a": nested})
    assert lease["fence"] >= 1
    deeper = await api.post("/v1/acquire", json={"key": "doc:2", "info": {"a": [nested]}})
    assert deeper.status_code == 400
    listed = await api.get("/v1/holders")
    assert [h["info"] for h in listed.json()["holders"]] == [{"a": nested}]
    metrics = await api.get("/metrics")
    assert metrics.status_code == 200
    assert 'keymutex_held_locks{namespace=""} 1.0' in metrics.text


async def test_made_up_methods_share_one_metrics_label(api: httpx.AsyncClient) -> None:
    for n in range(5):
        await api.request(f"X{n}", "/v1/holders")
    text = (await api.get("/metrics")).text
    assert 'method="other",route="/v1/holders"' in text
    assert 'method="X0"' not in text


async def test_pages_and_static_files(api: httpx.AsyncClient) -> None:
    pages = [("/", "index.html"), ("/demo/edit/doc%3A42", "edit.html")]
    pages.append(("/demo/edit/line1%0Aline2", "edit.html"))  # was a 404: a newline in a key
    for path, name in pages:
        reply = await api.get(path)
        if (STATIC / name).is_file():
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/html")
            if name == "edit.html":  # the server writes the key into it
                assert b'<script id="page" type="application/json">{"key":"' in reply.content
            else:
                assert reply.content == (STATIC / name).read_bytes()
            # A browser revalidating (Cache-Control: no-cache) gets a 304 while unchanged.
            etag = reply.headers["etag"]
            again = await api.get(path, headers={"If-None-Match": etag})
            assert again.status_code == 304
            assert again.content == b""
            stale = await api.get(path, headers={"If-None-Match": '"0-0"'})
            assert stale.status_code == 200
            assert stale.content == reply.content
        else:
            assert reply.json()["error"] == "not_found"
    # The JavaScript client the pages import is the one in clients/js (what npm packs).
    client = await api.get("/static/keymutex.js")
    assert client.status_code == 200
    assert client.headers["content-type"].startswith(("text/javascript", "application/javascript"))
    assert client.content == (ROOT / "clients" / "js" / "keymutex.js").read_bytes()
    missing = await api.get("/static/no-such-file.js")
    assert missing.status_code == 404
    assert missing.json()["error"] == "not_found"
    escape = await api.get("/static/..%2F_app.py")
    assert escape.status_code == 404


@pytest.mark.parametrize("asked", ["bytes=abc", "bytes=5-2", "bytes=999999-", "items=0-5"])
async def test_static_files_are_sent_whole_whatever_range_asks(
    api: httpx.AsyncClient, asked: str
) -> None:
    """Found by a review: Starlette answered these with a plain-text 400 or 416 of its
    own (not the JSON error of every other 4xx). A server may ignore Range: the files
    are small, and sent whole."""
    whole = (ROOT / "clients" / "js" / "keymutex.js").read_bytes()
    for headers in ({"Range": asked}, {"Range": "bytes=0-9", "If-Range": '"x"'}):
        reply = await api.get("/static/keymutex.js", headers=headers)
        assert reply.status_code == 200
        assert reply.content == whole


async def test_unknown_routes_and_methods_answer_json(api: httpx.AsyncClient) -> None:
    missing = await api.get("/v1/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"] == "not_found"
    wrong = await api.get("/v1/acquire")
    assert wrong.status_code == 405
    assert wrong.json()["error"] == "method_not_allowed"
    wrong = await api.post("/v1/holders", json={})
    assert wrong.status_code == 405


async def test_change_signals_are_kept_only_while_someone_holds_them() -> None:
    signals: Signals[str] = Signals()
    held = signals.event("watched")
    for n in range(1000):
        signals.event(f"looked-at-once-{n}")  # a watcher that went away at once
    assert len(signals) == 1
    assert signals.event("watched") is held
    signals.fire("watched")
    assert held.is_set()
    assert len(signals) == 0
    assert not signals.event("watched").is_set()  # a new one for the next change

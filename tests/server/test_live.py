"""The server on real uvicorn: long polls, event streams, hang-ups, and the http:// store."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

import keymutex
from keymutex._store import Capabilities
from keymutex.server._app import HEARTBEAT

from .conftest import ADMIN_TOKEN, EDITOR_TOKEN, Live, bearer, write_tokens

PATIENCE = 20.0
# With the server's rechecks and heartbeats put off to a minute (quiet_server), an answer
# within this of a change was pushed by the change itself: far from any machine's load.
PUSHED = 5.0


@pytest.fixture
def quiet_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long polls look again and event streams send a snapshot only when told of a
    change: their once-a-second recheck and 4 s heartbeat are put off to a minute."""
    from keymutex.server import _app

    monkeypatch.setattr(_app, "RECHECK_INTERVAL", 60.0)
    monkeypatch.setattr(_app, "HEARTBEAT", 60.0)


def _acquire(client: httpx.Client, key: str, **body: Any) -> dict[str, Any]:
    reply = client.post("/v1/acquire", json={"key": key, **body})
    assert reply.status_code == 200, reply.text
    lease: dict[str, Any] = reply.json()
    return lease


@pytest.fixture
def http(live: Live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=PATIENCE) as client:
        yield client


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    return thread, result


@pytest.mark.usefixtures("quiet_server")
def test_long_poll_returns_promptly_on_release(live: Live, http: httpx.Client) -> None:
    lease = _acquire(http, "doc:1", ttl=3600)
    body = {"key": "doc:1", "fence": lease["fence"], "timeout": 60}
    thread, result = _in_thread(lambda: http.post("/v1/wait", json=body))
    time.sleep(0.2)  # let the poll park (not a timing assertion)
    assert thread.is_alive()
    released_at = time.monotonic()
    http.post("/v1/release", json={"key": "doc:1", "token": lease["token"]})
    thread.join(PATIENCE)
    assert time.monotonic() - released_at < PUSHED  # woken by the release, not a recheck
    assert result[0].json() == {"changed": True, "holder": None}


def test_long_poll_on_arrival_sees_a_change_that_came_before(http: httpx.Client) -> None:
    lease = _acquire(http, "doc:1")
    http.post("/v1/release", json={"key": "doc:1", "token": lease["token"]})
    started = time.monotonic()
    reply = http.post("/v1/wait", json={"key": "doc:1", "fence": lease["fence"], "timeout": 60})
    assert reply.json()["changed"] is True
    assert time.monotonic() - started < 2.0


def test_long_poll_sees_changes_made_in_the_store_by_others(
    live: Live, http: httpx.Client, tmp_path: Any
) -> None:
    # A client of the same SQLite file, not of the server: found by the recheck.
    lease = _acquire(http, "doc:1", ttl=3600)
    body = {"key": "doc:1", "fence": lease["fence"], "timeout": 4}
    thread, result = _in_thread(lambda: http.post("/v1/wait", json=body))
    with keymutex.Locks(f"sqlite:///{tmp_path}/locks-0.db") as direct:
        direct.release("doc:1", lease["token"])
    thread.join(PATIENCE)
    assert result[0].json() == {"changed": True, "holder": None}


@pytest.mark.usefixtures("quiet_server")
def test_event_stream_sends_a_snapshot_after_a_change(http: httpx.Client) -> None:
    with http.stream("GET", "/v1/events", params={"prefix": "doc:"}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.iter_lines()
        first = _next_event(lines)
        assert first["holders"] == []
        assert first["waiting"] == {}
        assert abs(first["server_time"] - time.time()) < 60
        changed_at = time.monotonic()
        with httpx.Client(base_url=str(http.base_url)) as other:
            _acquire(other, "doc:7", info={"who": "me"})
        snapshot = _next_event(lines)
        assert time.monotonic() - changed_at < PUSHED  # pushed by the change, no heartbeat
        assert [h["key"] for h in snapshot["holders"]] == ["doc:7"]
        assert snapshot["holders"][0]["info"] == {"who": "me"}


def test_event_stream_sends_a_snapshot_after_a_renewal(http: httpx.Client) -> None:
    """Found by review: renewals sent no event, so a dashboard counted a short lease
    down from a snapshot up to 5 s old and showed it expired while it was renewed."""
    with httpx.Client(base_url=str(http.base_url)) as other:
        lease = _acquire(other, "renewed:1")
        with http.stream("GET", "/v1/events", params={"prefix": "renewed:"}) as stream:
            lines = stream.iter_lines()
            first = _next_event(lines)
            assert [h["key"] for h in first["holders"]] == ["renewed:1"]
            started = time.monotonic()
            for _ in range(3):  # the event of each renewal, not the heartbeat's (4 s)
                reply = other.post(
                    "/v1/renew", json={"key": "renewed:1", "token": lease["token"], "ttl": 90}
                )
                assert reply.status_code == 200, reply.text
                snapshot = _next_event(lines)
                assert snapshot["holders"][0]["expires_at"] > first["holders"][0]["expires_at"]
                first = snapshot
            assert time.monotonic() - started < HEARTBEAT  # not three heartbeats


def test_head_of_the_event_stream_is_its_headers_and_ends(http: httpx.Client) -> None:
    """Before: HEAD started the endless stream and never finished its response, so the
    connection's next request (keep-alive, pipelined) was never answered."""
    reply = http.head("/v1/events", timeout=5)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert http.get("/healthz", timeout=5).status_code == 200  # the same connection


def test_event_streams_that_ended_leave_nothing_behind(live: Live, http: httpx.Client) -> None:
    """Before: each namespace an ended stream had watched kept its change signal until
    a change came there, which in a made-up namespace is never."""
    signals = live.app.state.keymutex.changes.namespaces
    for n in range(30):
        with http.stream("GET", "/v1/events", params={"namespace": f"gone-{n}"}) as stream:
            assert _next_event(stream.iter_lines())["holders"] == []
    deadline = time.monotonic() + 20
    while len(signals) > 0:  # each stream ends once the server sees its client gone
        assert time.monotonic() < deadline, f"{len(signals)} namespaces still signalled"
        time.sleep(0.02)


@pytest.mark.usefixtures("quiet_server")
def test_event_streams_of_one_view_share_one_read_per_change(
    live: Live, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: each stream read and encoded the whole namespace on its own
    after each change; at 10,000 leases four open dashboards slowed a renewal from 2 ms
    to 500 ms. Streams of one view told of one change now share one read."""
    server = live.app.state.keymutex
    reads: list[object] = []
    read = server.snapshot

    async def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(args)
        return await read(*args, **kwargs)

    monkeypatch.setattr(server, "snapshot", counted)
    with contextlib.ExitStack() as streams:
        opened = []
        for _ in range(4):
            client = streams.enter_context(httpx.Client(base_url=live.url, timeout=PATIENCE))
            stream = streams.enter_context(
                client.stream("GET", "/v1/events", params={"prefix": "shared:"})
            )
            lines = stream.iter_lines()
            assert _next_event(lines)["holders"] == []
            opened.append(lines)
        before = len(reads)
        _acquire(http, "shared:1")
        for lines in opened:
            assert [h["key"] for h in _next_event(lines)["holders"]] == ["shared:1"]
        assert len(reads) - before == 1, "one read per stream"


def test_event_snapshots_list_the_first_rows_and_count_them_all(
    http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dashboard is sent the first STREAM_ROWS holders by key and the total (see the
    browser test of a namespace of 520 leases); /v1/holders still lists all."""
    from keymutex.server import _app

    monkeypatch.setattr(_app, "STREAM_ROWS", 5)
    for n in range(7):
        _acquire(http, f"row:{n}")
    with http.stream("GET", "/v1/events", params={"prefix": "row:"}) as stream:
        snapshot = _next_event(stream.iter_lines())
    assert [h["key"] for h in snapshot["holders"]] == [f"row:{n}" for n in range(5)]
    assert snapshot["total"] == 7
    everything = http.get("/v1/holders", params={"prefix": "row:"}).json()
    assert len(everything["holders"]) == 7
    assert "total" not in everything


def test_a_held_key_past_the_first_rows_is_not_shown_free(
    live: Live, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: holders and waiting counts were cut to STREAM_ROWS each, so a
    held key past the holders' cut, waited for, came with its waiting count alone, and
    the dashboard showed it free, without its holder or a force release."""
    from keymutex.server import _app

    monkeypatch.setattr(_app, "STREAM_ROWS", 5)
    for n in range(7):
        _acquire(http, f"row:{n}", ttl=60)
    with httpx.Client(base_url=live.url, timeout=PATIENCE) as other:
        thread, _ = _in_thread(
            lambda: other.post("/v1/acquire", json={"key": "row:6", "timeout": 2})
        )
        deadline = time.monotonic() + PATIENCE
        while http.get("/v1/holders", params={"prefix": "row:"}).json()["waiting"] != {"row:6": 1}:
            assert time.monotonic() < deadline, "the waiter never queued"
            time.sleep(0.01)
        with http.stream("GET", "/v1/events", params={"prefix": "row:"}) as stream:
            snapshot = _next_event(stream.iter_lines())
        thread.join()
    shown = {h["key"] for h in snapshot["holders"]}
    assert set(snapshot["waiting"]) <= shown, "a waited-for key shown without its holder"
    assert snapshot["total"] == 7


def test_pages_may_not_be_framed_by_other_sites(http: httpx.Client) -> None:
    """Found by review: the dashboard (force release) and the edit page (take over) are
    one click from acting, and any site could show them in a frame (clickjacking)."""
    for path in ("/", "/demo/edit/doc:1"):
        reply = http.get(path)
        assert reply.status_code == 200
        assert reply.headers["content-security-policy"] == "frame-ancestors 'self'"
        assert reply.headers["x-frame-options"] == "SAMEORIGIN"


def _next_event(lines: Iterator[str]) -> dict[str, Any]:
    event = None
    for line in lines:
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: ") and event == "holders":
            data: dict[str, Any] = json.loads(line.removeprefix("data: "))
            return data
    raise AssertionError("the stream ended")


@pytest.mark.asyncio
async def test_a_waiting_acquire_whose_caller_hangs_up_leaves_nothing(live: Live) -> None:
    async with httpx.AsyncClient(base_url=live.url, timeout=PATIENCE) as client:
        first = (await client.post("/v1/acquire", json={"key": "k", "ttl": 3600})).json()
        body = {"key": "k", "timeout": 60, "owner": "quitter"}
        waiting = asyncio.create_task(client.post("/v1/acquire", json=body))
        for _ in range(500):
            if (await client.get("/v1/holders")).json()["waiting"] == {"k": 1}:
                break
            await asyncio.sleep(0.01)
        waiting.cancel()  # closes its connection
        for _ in range(500):
            if (await client.get("/v1/holders")).json()["waiting"] == {}:
                break
            await asyncio.sleep(0.01)
        assert (await client.get("/v1/holders")).json()["waiting"] == {}
        await client.post("/v1/release", json={"key": "k", "token": first["token"]})
        await asyncio.sleep(0.2)
        assert (await client.get("/v1/holder", params={"key": "k"})).json() == {"holder": None}


def _half_closed_steal(live: Live, key: str) -> bytes:
    """Steal ``key`` in a request whose sender half-closes at once; what it reads back."""
    body = json.dumps({"key": key, "ttl": 3600, "steal": True, "owner": "quitter"})
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=PATIENCE) as conn:
        conn.sendall(
            b"POST /v1/acquire HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s"
            % (host.encode(), port.encode(), len(body), body.encode())
        )
        conn.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        return answer


def test_a_grant_for_a_caller_already_gone_is_given_back(live: Live, http: httpx.Client) -> None:
    """A client that half-closes its connection once its request is sent reads as one
    that hung up: when the server sees that before the grant is answered, the grant
    (a steal here) is given back at once. (When the request's grant was answered first,
    the client read its lease: then it is released, and the exchange is tried again.)

    Before: the stolen key stayed with nobody for the request's TTL (an hour here).
    """
    deadline = time.monotonic() + PATIENCE
    while True:
        mine = _acquire(http, "gone", ttl=3600)
        answer = _half_closed_steal(live, "gone")
        if not answer:
            break
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        stolen = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert http.post("/v1/release", json={"key": "gone", "token": stolen["token"]}).is_success
        assert time.monotonic() < deadline, "the server never saw the half-close first"
    renew = {"key": "gone", "token": mine["token"]}
    while http.post("/v1/renew", json=renew).status_code == 200:  # until the steal
        assert time.monotonic() < deadline, "the half-closed request never stole the key"
        time.sleep(0.01)
    while (holder := http.get("/v1/holder", params={"key": "gone"}).json()["holder"]) is not None:
        assert time.monotonic() < deadline, f"the key stayed with {holder}"
        time.sleep(0.01)
    assert _acquire(http, "gone")["fence"] > mine["fence"] + 1  # the steal's was given back


# -- the http:// store against a real server ----------------------------------------------


def test_http_store_round_trip_and_capabilities(live: Live) -> None:
    with keymutex.Locks(live.url + "/", namespace="shop", owner="me") as locks:
        lease = locks.acquire("order:1", info={"n": 1})
        store = locks._store
        assert store.capabilities == Capabilities(
            notifies=True,
            fair=False,
            cross_process=True,
            durable_fences=True,
            clock="server",
            waits_at_store=True,
        )
        seen = locks.holder("order:1")
        assert seen is not None
        assert (seen.owner, seen.info, seen.fence) == ("me", {"n": 1}, lease.fence)
        with pytest.raises(keymutex.Locked) as refused:
            locks.acquire("order:1", timeout=0.2)
        assert refused.value.holder is not None
        assert refused.value.holder.fence == lease.fence
        with pytest.raises(ValueError, match="86400"):
            locks.acquire("order:2", ttl=86400 * 2)
        lease.release()
        with pytest.raises(keymutex.LockLost):
            locks.release("order:1", lease.token)


def test_http_store_renew_many_splits_large_batches(live: Live) -> None:
    with keymutex.Locks(live.url, namespace="many") as locks:
        leases = [locks.acquire("k" * 900 + str(i), ttl=60) for i in range(40)]
        outcomes = locks._store.renew_many(
            [keymutex._store.RenewRequest(x.key, x.token, 60.0) for x in leases]  # type: ignore[attr-defined]
        )
        assert [o.ok for o in outcomes] == [True] * 40
        assert [o.holder.fence for o in outcomes] == [x.fence for x in leases]  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_async_http_store_waits_for_a_release(live: Live) -> None:
    async with (
        keymutex.AsyncLocks(live.url, namespace="a") as holder,
        keymutex.AsyncLocks(live.url, namespace="a") as waiter,
    ):
        lease = await holder.acquire("doc", ttl=3600)
        task = asyncio.create_task(waiter.acquire("doc", timeout=PATIENCE))
        await asyncio.sleep(0.2)
        assert not task.done()
        await lease.release()
        got = await task
        assert got.fence > lease.fence
        await got.release()


def test_http_store_with_api_tokens(make_live: Callable[..., Live], tmp_path: Any) -> None:
    live = make_live(token_file=write_tokens(tmp_path))
    with (
        keymutex.Locks(live.url, namespace="cms") as anonymous,
        pytest.raises(keymutex.StoreError, match="401") as refused,
    ):
        anonymous.holder("doc:1")
    assert "sends the API token of api_token=… or $KEYMUTEX_API_TOKEN" in str(refused.value)
    with (
        keymutex.Locks(live.url, namespace="cms", api_token=EDITOR_TOKEN) as editor,
        httpx.Client(base_url=live.url, headers=bearer(ADMIN_TOKEN)) as admin,
        pytest.MonkeyPatch.context() as patch,
    ):
        lease = editor.acquire("doc:1")
        assert lease.owner == f"{socket.gethostname()}:{os.getpid()}"  # the client's owner
        with pytest.raises(keymutex.StoreError, match="403"):
            editor.acquire("img:1")
        patch.setenv("KEYMUTEX_API_TOKEN", ADMIN_TOKEN)
        with keymutex.Locks(live.url, namespace="cms") as ops:
            assert ops.holder("doc:1") is not None
        forced = admin.post(
            "/v1/force-release", json={"namespace": "cms", "key": "doc:1", "reason": "test"}
        )
        assert forced.json()["released"] is True
        with pytest.raises(keymutex.LockLost):
            lease.renew()


def test_http_store_unreachable_is_a_store_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with keymutex.Locks(f"http://127.0.0.1:{port}", timeout=2) as locks:
        with pytest.raises(keymutex.StoreError) as failed:
            locks.acquire("a")
        assert failed.value.__cause__ is not None


@pytest.fixture
def dripping_server() -> Iterator[str]:
    """A "lock server" whose replies come one byte every 0.1 s (a stuck proxy or link):
    each read is within any read timeout, and a reply would take hours."""
    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)

    def answer(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
            conn.sendall(b"Content-Length: 100000\r\n\r\n")
            while not stop.wait(0.1):
                conn.sendall(b" ")

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = listener.accept()
                threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


def test_http_store_calls_end_however_slowly_the_reply_comes(dripping_server: str) -> None:
    """Found by review: httpx's read timeout is between two reads, so a reply that kept
    coming a byte at a time kept every call waiting for ever: a release, ``close()``,
    and an async acquire that its caller cancelled (it waits for its store step). A
    request now takes twice ``timeout`` at most (plus its long poll)."""
    results: list[BaseException | None] = []

    def call() -> None:
        with keymutex.Locks(dripping_server, timeout=0.5) as locks:
            for step in (lambda: locks.holder("k"), lambda: locks.release("k", "t" * 22)):
                try:
                    step()
                except BaseException as exc:
                    results.append(exc)
                else:
                    results.append(None)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "a call still waits for the reply"
    assert all(isinstance(exc, keymutex.StoreError) for exc in results), results
    assert all(isinstance(exc.__cause__, httpx.ReadTimeout) for exc in results if exc)

    async def main() -> None:
        async with keymutex.AsyncLocks(dripping_server, timeout=0.5) as locks:
            with pytest.raises(keymutex.StoreError, match="took more than 1 s"):
                await asyncio.wait_for(locks.acquire("k", timeout=0), 60)

    asyncio.run(main())


@pytest.mark.parametrize("store", ["sync", "async"])
def test_http_store_takes_its_proxy_from_the_environment(
    live: Live, monkeypatch: pytest.MonkeyPatch, store: str
) -> None:
    """As ``httpx.Client`` does: ``HTTP_PROXY`` unless ``NO_PROXY`` names the host."""
    with socket.socket() as sock:  # a proxy that is not there: connections to it fail
        sock.bind(("127.0.0.1", 0))
        dead_proxy = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("HTTP_PROXY", dead_proxy)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)

    def use() -> None:
        if store == "sync":
            with keymutex.Locks(live.url, timeout=2) as locks:
                locks.acquire("proxied", timeout=0).release()
        else:

            async def run() -> None:
                async with keymutex.AsyncLocks(live.url, timeout=2) as locks:
                    await (await locks.acquire("proxied", timeout=0)).release()

            asyncio.run(run())

    with pytest.raises(keymutex.StoreError):
        use()  # sent to the proxy
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    use()  # straight to the server


@pytest.mark.parametrize(
    ("url", "options", "error"),
    [
        ("http://", {}, ValueError),
        ("http://user:pw@host", {}, ValueError),
        ("http://host?x=1", {}, ValueError),
        ("http://host:99999", {}, ValueError),
        ("http://host", {"timeout": 0}, ValueError),
        ("http://host", {"api_token": 5}, TypeError),
        ("http://host", {"verify": False}, TypeError),
    ],
)
def test_http_store_refuses_bad_urls_and_options(
    url: str, options: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        keymutex.Locks(url, **options)


@pytest.mark.parametrize("token", [" " * 40, "x" * 32 + " y"])
def test_a_bad_api_token_in_the_environment_is_named_before_any_request(
    monkeypatch: pytest.MonkeyPatch, token: str
) -> None:
    """Found by review: it failed at the first request, as a StoreError."""
    monkeypatch.setenv("KEYMUTEX_API_TOKEN", token)
    with pytest.raises(ValueError, match=r"\$KEYMUTEX_API_TOKEN must be the API token"):
        keymutex.Locks("http://127.0.0.1:1")


def test_metrics_through_real_http(live: Live, http: httpx.Client) -> None:
    _acquire(http, "m", namespace="met")
    text = http.get("/metrics").text
    assert 'keymutex_acquires_total{namespace="met"} 1.0' in text
    assert 'keymutex_held_locks{namespace="met"} 1.0' in text

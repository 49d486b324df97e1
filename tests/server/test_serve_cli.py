"""``keymutex serve``, run for real: refusals, the URL it prints, and a clean stop."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import keymutex
from keymutex.server._openapi import openapi_document

from .conftest import write_tokens

KEYMUTEX = [sys.executable, "-m", "keymutex"]
WAIT = 30.0
LISTENING = re.compile(r"keymutex server on (http://127\.0\.0\.1:\d+)/ \(store (\S+)\)")


def _serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KEYMUTEX, "serve", *args], capture_output=True, text=True, timeout=WAIT, cwd=cwd
    )


@contextlib.contextmanager
def _running(
    *args: str,
    log: Path,
    env: dict[str, str] | None = None,
    open_files: tuple[int, int] | None = None,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``keymutex serve ARGS`` with its output in ``log``, once it listens: (process, URL).

    ``open_files``: the (soft, hard) limit on open files it starts with (``ulimit -Sn``,
    ``-Hn``). Killed on the way out if the test did not stop it.
    """
    limit_open_files = None  # set in the child, before it runs keymutex
    if open_files is not None:
        limit_open_files = functools.partial(
            resource.setrlimit, resource.RLIMIT_NOFILE, open_files
        )
    with log.open("wb") as output:
        process = subprocess.Popen(
            [*KEYMUTEX, "serve", "--port", "0", *args],
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=limit_open_files,
        )
    try:
        deadline = time.monotonic() + WAIT
        while (found := LISTENING.search(log.read_text())) is None:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        yield process, found.group(1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_refuses_a_public_host_without_a_token_file(tmp_path: Path) -> None:
    for host in ("0.0.0.0", "::"):
        done = _serve("--host", host, "--store", f"sqlite:///{tmp_path}/x.db", cwd=tmp_path)
        assert done.returncode == 2
        assert "--token-file" in done.stderr
        assert not (tmp_path / "x.db").exists()  # refused before opening anything


def test_refuses_a_bad_token_file_and_a_bad_store(tmp_path: Path) -> None:
    bad = tmp_path / "tokens.json"
    bad.write_text('{"tokens": [{"name": "x", "token": "short", "grants": []}]}')
    done = _serve("--token-file", str(bad), "--store", "memory://", cwd=tmp_path)
    assert done.returncode == 2
    assert "token" in done.stderr
    done = _serve("--store", "nosuch://x", cwd=tmp_path)
    assert done.returncode == 2
    assert "nosuch" in done.stderr


def test_max_namespaces_is_documented_and_checked(tmp_path: Path) -> None:
    helped = _serve("--help", cwd=tmp_path)
    assert helped.returncode == 0
    assert "--max-namespaces N" in helped.stdout
    assert "[default: 64; x>=1]" in helped.stdout
    for bad in ("0", "-3", "many"):
        store = f"sqlite:///{tmp_path}/x.db"
        done = _serve("--max-namespaces", bad, "--store", store, cwd=tmp_path)
        assert done.returncode == 2
        assert "Invalid value for '--max-namespaces'" in done.stderr, done.stderr
        assert not (tmp_path / "x.db").exists()  # refused before opening anything


def test_max_namespaces_keeps_that_many_open(tmp_path: Path) -> None:
    """Before: ``serve`` had no such option, and with more than 64 namespaces in use
    some were closed and opened again (a new store connection) as they were used."""
    log = tmp_path / "out.log"
    store = f"sqlite:///{tmp_path}/locks.db"
    with (
        _running("--store", store, "--max-namespaces", "100", log=log) as (_, url),
        httpx.Client(base_url=url, timeout=WAIT) as client,
    ):
        for _ in range(2):
            for n in range(80):
                reply = client.get("/v1/holder", params={"namespace": f"ns{n}", "key": "k"})
                assert reply.status_code == 200, reply.text
        metrics = client.get("/metrics").text
    assert "keymutex_namespace_opens_total 81.0" in metrics  # the default one, and 80
    assert "keymutex_namespaces_open 81.0" in metrics


def _open_files_limit(pid: int) -> tuple[int, int]:
    """A process's (soft, hard) limit on open files, as ``prlimit --pid PID -n`` says."""
    return resource.prlimit(pid, resource.RLIMIT_NOFILE)


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="prlimit() is Linux's")
def test_raises_a_low_limit_on_open_files_to_fit_max_namespaces(tmp_path: Path) -> None:
    """Before: nothing compared the limit on open files with --max-namespaces; a server
    started with ``ulimit -n 256`` kept it, and answered 503 ("unable to open database
    file") from about the 80th namespace open on (each SQLite namespace holds three
    files). Now it raises it (up to the hard limit) to 8 per namespace and 256 besides."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2000:
        pytest.skip(f"the hard limit on open files here is {hard}")
    log = tmp_path / "out.log"
    args = ("--store", f"sqlite:///{tmp_path}/locks.db", "--max-namespaces", "100")
    with _running(*args, log=log, open_files=(256, hard)) as (process, url):
        assert _open_files_limit(process.pid) == (100 * 8 + 256, hard)
        with httpx.Client(base_url=url, timeout=WAIT) as client:
            # 100 open with the default one: 300 files, more than the limit it started with
            for n in range(99):
                reply = client.get("/v1/holder", params={"namespace": f"ns{n}", "key": "k"})
                assert reply.status_code == 200, reply.text
            assert "keymutex_namespaces_open 100.0" in client.get("/metrics").text
    assert "WARNING" not in log.read_text()


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="prlimit() is Linux's")
def test_warns_when_the_hard_limit_on_open_files_is_too_low_for_max_namespaces(
    tmp_path: Path,
) -> None:
    """A hard limit below what --max-namespaces needs cannot be raised by the server:
    it says what to do, and serves all the same."""
    log = tmp_path / "out.log"
    args = ("--store", f"sqlite:///{tmp_path}/locks.db", "--max-namespaces", "64")
    with _running(*args, log=log, open_files=(300, 600)) as (process, url):
        assert httpx.get(f"{url}/healthz", timeout=WAIT).status_code == 200
        assert _open_files_limit(process.pid) == (600, 600)  # raised as far as it goes
    assert (
        "keymutex: WARNING: the limit on open files is 600 (ulimit -n; hard limit 600),"
        " below the 768 that --max-namespaces 64 is counted to need (8 per namespace,"
        " 256 besides): raise it (ulimit -n 768, or LimitNOFILE=768 in a systemd unit)"
        " or lower --max-namespaces (to 43 for this limit)"
    ) in log.read_text()


def test_a_max_namespaces_beyond_what_setrlimit_takes_is_warned_of_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: where the hard limit is unlimited (macOS's default; Linux has
    none such), ``--max-namespaces 2000000000000000000`` asked setrlimit() for more than
    a C long holds, and its OverflowError ended ``serve`` in a traceback. It is warned
    of as any limit that cannot be raised. The hard limit is read as unlimited here;
    setrlimit() is the real one, and this process's limit stays as it was."""
    from keymutex import cli

    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    monkeypatch.setattr(resource, "getrlimit", lambda _: (256, resource.RLIM_INFINITY))
    with caplog.at_level(logging.WARNING, logger="keymutex.server"):
        cli._enough_open_files(2_000_000_000_000_000_000)
    monkeypatch.undo()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == before
    assert "the limit on open files is 256 (ulimit -n; hard limit unlimited)" in caplog.text


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_prints_its_url_serves_and_stops_cleanly(tmp_path: Path, stop: signal.Signals) -> None:
    log = tmp_path / "out.log"
    store = f"sqlite:///{tmp_path}/locks.db"
    tokens = write_tokens(tmp_path)
    with _running("--store", store, "--token-file", str(tokens), log=log) as (process, url):
        found = LISTENING.search(log.read_text())
        assert found is not None
        assert found.group(2) == store
        assert httpx.get(f"{url}/healthz").json()["store"] == "sqlite"
        assert httpx.get(f"{url}/v1/holders").status_code == 401  # the token file applies
        process.send_signal(stop)
        assert process.wait(WAIT) == 0, log.read_text()
    assert "keymutex server stopped" in log.read_text()
    assert "Traceback" not in log.read_text()


def _server_env(tmp_path: Path, fast: bool) -> dict[str, str] | None:
    """The server's environment: as it is (``fast``: uvloop and httptools if installed),
    or one in which importing them fails, as if they were not installed."""
    if fast:
        return None
    hidden = tmp_path / "hidden"
    for name in ("uvloop", "httptools"):
        (hidden / name).mkdir(parents=True)
        (hidden / name / "__init__.py").write_text(f"raise ImportError('{name} hidden')\n")
    path = [str(hidden), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


@pytest.mark.parametrize("fast", [True, False], ids=["uvloop+httptools", "asyncio+h11"])
def test_serves_with_and_without_uvloop_and_httptools(tmp_path: Path, fast: bool) -> None:
    log = tmp_path / "out.log"
    env = _server_env(tmp_path, fast)
    store = f"sqlite:///{tmp_path}/locks.db"
    with _running("--store", store, log=log, env=env) as (process, url):
        with keymutex.Locks(url, ttl=30.0) as locks:
            lease = locks.acquire("job", timeout=0)
            assert locks.holder("job") is not None
            lease.release()
            assert locks.holder("job") is None
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT) == 0, log.read_text()
    text = log.read_text()
    if fast:
        assert "pip install 'keymutex[server]'" not in text  # both installed: no warning
    else:
        assert "event loop asyncio." in text
        assert "HTTP parser h11; without uvloop and httptools" in text
        assert "pip install 'keymutex[server]'" in text


MALFORMED = {
    "a header name with a space": b"POST /v1/acquire HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
    "TLS to the plain-HTTP port": bytes.fromhex("16030100a5010000a10303") + bytes(32),
    "no request line": b"\x00\x01\x02 hello\r\n\r\n",
}


def _raw_exchange(url: str, request: bytes) -> bytes:
    """Send ``request`` as is and read the answer until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("fast", [True, False], ids=["uvloop+httptools", "asyncio+h11"])
def test_a_request_that_is_not_http_gets_a_json_400(tmp_path: Path, fast: bool) -> None:
    log = tmp_path / "out.log"
    env = _server_env(tmp_path, fast)
    with _running("--store", "memory://", log=log, env=env) as (process, url):
        for name, request in MALFORMED.items():
            head, _, body = _raw_exchange(url, request).partition(b"\r\n\r\n")
            lines = head.decode("latin-1").lower().split("\r\n")
            assert lines[0].startswith("http/1.1 400"), (name, head)
            assert "content-type: application/json" in lines, (name, head)
            error = json.loads(body)
            assert error["error"] == "invalid_argument", (name, error)
            assert "malformed HTTP request" in error["message"], (name, error)
        # And the server goes on serving.
        assert httpx.get(f"{url}/healthz", timeout=WAIT).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT) == 0, log.read_text()
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("logged", [False, True], ids=["default", "--access-log"])
def test_the_access_log_is_off_unless_asked_for(tmp_path: Path, logged: bool) -> None:
    log = tmp_path / "out.log"
    store = f"sqlite:///{tmp_path}/locks.db"
    extra = ["--access-log"] if logged else []
    with _running("--store", store, *extra, log=log) as (process, url):
        assert httpx.get(f"{url}/healthz").status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT) == 0, log.read_text()
    assert ("GET /healthz" in log.read_text()) is logged, log.read_text()


def test_requests_waiting_at_shutdown_are_answered_and_streams_end(tmp_path: Path) -> None:
    """A stop answers long polls with a 503 ``shutting_down`` (JSON, not uvicorn's
    plain-text 500 after its graceful timeout) and ends event streams."""
    log = tmp_path / "out.log"
    with _running("--store", f"sqlite:///{tmp_path}/locks.db", log=log) as (process, url):
        held = httpx.post(f"{url}/v1/acquire", json={"key": "w"}).json()
        answers: dict[str, httpx.Response] = {}
        streamed: list[str] = []

        def ask(name: str, path: str, body: dict[str, object]) -> None:
            answers[name] = httpx.post(f"{url}{path}", json=body, timeout=WAIT)

        def listen() -> None:
            with httpx.stream("GET", f"{url}/v1/events", timeout=WAIT) as events:
                streamed.extend(events.iter_lines())

        threads = [
            threading.Thread(
                target=ask, args=("acquire", "/v1/acquire", {"key": "w", "timeout": 25})
            ),
            threading.Thread(
                target=ask,
                args=("wait", "/v1/wait", {"key": "w", "timeout": 25, "fence": held["fence"]}),
            ),
            threading.Thread(target=listen),
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + WAIT
        # Both requests waiting at the server. (Found in CI: counting two 'kind="'
        # lines let one waiting acquire through, whose counter has two, its total and
        # its created time: the stop came before the wait had connected.)
        while not streamed or not all(
            f'kind="{kind}"' in httpx.get(f"{url}/metrics").text for kind in ("acquire", "wait")
        ):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(WAIT)
            assert not thread.is_alive()
        assert process.wait(WAIT) == 0, log.read_text()
    for name in ("acquire", "wait"):
        assert answers[name].status_code == 503, answers[name].text
        assert answers[name].json()["error"] == "shutting_down"
    assert any(line.startswith("event: holders") for line in streamed)  # then it ended
    assert "Traceback" not in log.read_text()
    assert "ERROR" not in log.read_text()


def test_shutdown_with_a_store_that_does_not_answer_still_answers_in_json(
    tmp_path: Path,
) -> None:
    """Found by review: with Redis stopped (SIGSTOP: a partition), a waiting acquire's
    clean-up (leaving its queue) held its 503 until uvicorn's graceful timeout, and a
    read waiting for Redis was cut off: both were answered uvicorn's plain-text 500,
    with tracebacks in the log."""
    from _redis_servers import standalone

    with standalone(tmp_path / "redis") as redis_server:
        log = tmp_path / "out.log"
        with _running("--store", redis_server.url, log=log) as (process, url):
            held = httpx.post(f"{url}/v1/acquire", json={"key": "k", "ttl": 60})
            assert held.status_code == 200, held.text
            answers: dict[str, httpx.Response] = {}

            def ask(name: str, method: str, path: str, **kwargs: object) -> None:
                answers[name] = httpx.request(method, f"{url}{path}", timeout=WAIT, **kwargs)

            waiting = threading.Thread(
                target=ask,
                args=("acquire", "POST", "/v1/acquire"),
                kwargs={"json": {"key": "k", "timeout": 25}},
            )
            waiting.start()
            deadline = time.monotonic() + WAIT
            while "keymutex_waiting_requests 1.0" not in httpx.get(f"{url}/metrics").text:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
            redis_server.pause()
            try:
                reading = threading.Thread(
                    target=ask,
                    args=("holder", "GET", "/v1/holder"),
                    kwargs={"params": {"key": "k"}},
                )
                reading.start()
                time.sleep(0.3)  # the read is sent to the stopped Redis
                process.send_signal(signal.SIGTERM)
                for thread in (waiting, reading):
                    thread.join(WAIT)
                    assert not thread.is_alive()
                process.wait(WAIT)
            finally:
                redis_server.resume()
    for name in ("acquire", "holder"):
        assert answers[name].status_code == 503, answers[name].text
        assert answers[name].json()["error"] == "shutting_down", answers[name].text
    assert "Traceback" not in log.read_text()
    assert "Exception in ASGI application" not in log.read_text()


def test_a_store_whose_extra_is_missing_is_named_without_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()  # as if redis-py were not installed
    (tmp_path / "redis" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'redis'\", name='redis')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for args in (
        ["ls", "--store", "redis://127.0.0.1:1/0"],
        ["serve", "--store", "redis://127.0.0.1:1/0"],
    ):
        done = subprocess.run(
            [*KEYMUTEX, *args], capture_output=True, text=True, timeout=WAIT, env=env, cwd=tmp_path
        )
        assert done.returncode == 69, done.stderr
        assert (
            "the redis:// store needs its client library (module 'redis' is missing):"
            " pip install 'keymutex[redis]'"
        ) in done.stderr
        assert "Traceback" not in done.stderr


@pytest.mark.parametrize("fast", [True, False], ids=["uvloop+httptools", "asyncio+h11"])
def test_a_request_head_over_32_kib_is_refused(tmp_path: Path, fast: bool) -> None:
    """httptools took a head of any size (a client could fill the server's memory);
    h11 stopped at 16 KiB, which a browser's cookies for localhost can pass."""
    log = tmp_path / "out.log"
    with _running("--store", "memory://", log=log, env=_server_env(tmp_path, fast)) as (
        process,
        url,
    ):
        ask = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        served = _raw_exchange(url, ask + b"Cookie: " + b"c" * 20_000 + b"\r\n\r\n")
        assert served.startswith(b"HTTP/1.1 200"), served[:200]
        refused = _raw_exchange(url, ask + b"Cookie: " + b"c" * 40_000 + b"\r\n\r\n")
        head, _, body = refused.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431"), head
        assert b"content-type: application/json" in head.lower()
        assert json.loads(body) == {
            "error": "headers_too_large",
            "message": "the request line and headers are over 32 KiB",
        }
        assert "headers_too_large" in _DOCUMENTED_ERRORS
        assert httpx.get(f"{url}/healthz", timeout=WAIT).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT) == 0, log.read_text()
    assert "Traceback" not in log.read_text()


def _answer_and_time(url: str, request: bytes) -> tuple[bytes, float]:
    """Send ``request`` (part of one, maybe) and read until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=15) as conn:
        sent_at = time.monotonic()
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        return answer, time.monotonic() - sent_at


def _json_errors(answer: bytes) -> list[tuple[int, str]]:
    """The status and ``error`` code of each response in ``answer``, in order."""
    found = []
    for response in answer.split(b"HTTP/1.1 ")[1:]:
        head, _, body = response.partition(b"\r\n\r\n")
        assert b"content-type: application/json" in head.lower(), head
        found.append((int(head[:3]), json.loads(body)["error"]))
    return found


HOST = b"Host: 127.0.0.1\r\n"
# The error codes /openapi.json lists: every code the server sends must be among them.
_DOCUMENTED_ERRORS = openapi_document()["components"]["schemas"]["Error"]["properties"]["error"][
    "enum"
]
JSON_HEAD = HOST + b"Content-Type: application/json\r\n"


def test_a_request_that_does_not_arrive_in_time_is_answered_408(tmp_path: Path) -> None:
    """Before: the server waited for the rest for ever (each such connection a slot
    taken for good); it also kept a connection that never sent anything."""
    log = tmp_path / "out.log"
    with _running("--store", "memory://", "--request-timeout", "0.5", log=log) as (
        process,
        url,
    ):
        half_head = b"POST /v1/acquire HTTP/1.1\r\n" + HOST
        answer, _ = _answer_and_time(url, half_head)
        assert _json_errors(answer) == [(408, "request_timeout")]
        half_body = b'POST /v1/acquire HTTP/1.1\r\n%sContent-Length: 40\r\n\r\n{"key": "doc"' % (
            JSON_HEAD
        )
        answer, _ = _answer_and_time(url, half_body)
        assert _json_errors(answer) == [(408, "request_timeout")]
        assert b"nothing was done" in answer
        assert "request_timeout" in _DOCUMENTED_ERRORS
        # A long poll is not a slow request: the wait is the server's, not the client's.
        held = httpx.post(f"{url}/v1/acquire", json={"key": "held"}, timeout=WAIT)
        assert held.status_code == 200
        poll = b'{"key": "held", "timeout": 1.5}'
        waiting = b"POST /v1/acquire HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (
            JSON_HEAD,
            len(poll),
            poll,
        )
        # ... and a half request pipelined behind it is timed from when it can arrive.
        answer, took = _answer_and_time(url, waiting + half_head)
        assert _json_errors(answer) == [(409, "locked"), (408, "request_timeout")]
        assert took >= 1.5
        assert httpx.get(f"{url}/v1/holder?key=doc", timeout=WAIT).json()["holder"] is None
        # A connection that sends nothing is closed (after uvicorn's keep-alive timeout).
        answer, _ = _answer_and_time(url, b"")
        assert answer == b""
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT) == 0, log.read_text()
    assert "Traceback" not in log.read_text()


def _answered_then(url: str, request: bytes, then: bytes) -> bytes:
    """Send ``request``, read its whole answer, send ``then``; what follows until the
    server closes (a socket timeout, 15 s, if it never does)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=15) as conn:
        conn.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += conn.recv(65536)
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))  # type: ignore[union-attr]
        while len(body) < length:
            body += conn.recv(65536)
        conn.sendall(then)
        rest = b""
        while chunk := conn.recv(65536):
            rest += chunk
        return rest


def test_bytes_that_begin_no_request_do_not_keep_a_connection_open(tmp_path: Path) -> None:
    """Found by review: a bare CRLF (which httptools skips) cancelled uvicorn's idle
    timeout and started no request clock; so did the rest of a body the server had
    refused without reading it. Either kept the connection open for good: 140 such
    connections, without a token, took every descriptor of a server."""
    log = tmp_path / "out.log"
    with _running("--store", "memory://", "--request-timeout", "0.5", log=log) as (
        process,
        url,
    ):
        answer, _ = _answer_and_time(url, b"\r\n")  # on a new connection
        assert _json_errors(answer) == [(408, "request_timeout")]
        health = b"GET /healthz HTTP/1.1\r\n" + HOST + b"\r\n"
        assert _answered_then(url, health, b"\r\n") == b""  # after a kept-alive answer
        refused = b"POST /v1/acquire HTTP/1.1\r\n%sContent-Type: text/plain\r\n" % HOST
        refused += b"Content-Length: 100000\r\n\r\n{"
        assert _answered_then(url, refused, b'"') == b""  # answered 415, body unread
        assert httpx.get(f"{url}/healthz", timeout=WAIT).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT) == 0, log.read_text()
    assert "Traceback" not in log.read_text()


def test_shutdown_answers_a_request_whose_body_is_still_coming(tmp_path: Path) -> None:
    """Before: uvicorn's graceful timeout cancelled the app waiting for the body, logged
    the traceback, and answered a plain-text 500."""
    log = tmp_path / "out.log"
    with _running("--store", "memory://", log=log) as (process, url):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=WAIT) as conn:
            conn.sendall(
                b'POST /v1/acquire HTTP/1.1\r\n%sContent-Length: 40\r\n\r\n{"key"' % JSON_HEAD
            )
            # Answered on a connection made after those bytes were sent: the server has
            # read them (its loop takes every socket ready before this one's request).
            assert httpx.get(f"{url}/healthz", timeout=WAIT).status_code == 200
            process.send_signal(signal.SIGTERM)
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
        assert process.wait(WAIT) == 0, log.read_text()
    assert _json_errors(answer) == [(503, "shutting_down")]
    assert b"nothing was acquired or changed" in answer
    assert "Traceback" not in log.read_text()
    assert "Exception in ASGI application" not in log.read_text()

"""The tools on their own: the resource keeps the largest fence, the proxy's faults do
what they say (against a real echo server on loopback)."""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._tools.faults import wait_until
from ._tools.proxy import Proxy
from ._tools.resource import ResourceClient, ResourceServer


@pytest.mark.parametrize("fencing", [True, False])
def test_resource_accepts_only_larger_fences_when_fencing(tmp_path: Path, fencing: bool) -> None:
    with ResourceServer(tmp_path / "log.jsonl", fencing=fencing) as server:
        client = ResourceClient(server.address, "t")
        try:
            results = [client.write("a", f, f"v{f}")[0] for f in (1, 3, 2, 3, 4)]
            other_key = client.write("b", 1, "x")[0]
        finally:
            client.close()
        entries = server.entries()
    expected = [True, True, False, False, True] if fencing else [True] * 5
    assert results == expected
    assert other_key is True
    assert [e["accepted"] for e in entries] == [*expected, True]
    assert [e["last"] for e in entries[:3]] == [None, 1, 3]
    assert all(a["t"] <= b["t"] for a, b in itertools.pairwise(entries))


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """A threaded TCP echo server on loopback."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the proxy may reset us: that is the test
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()
    stop.set()
    thread.join()
    server.close()


def _connect(proxy: Proxy) -> socket.socket:
    sock = socket.create_connection(proxy.address, timeout=1.0)
    sock.settimeout(0.5)
    return sock


def _round_trip(sock: socket.socket, data: bytes = b"ping") -> bytes:
    sock.sendall(data)
    return sock.recv(100)


def test_proxy_pass_and_latency(echo: tuple[str, int]) -> None:
    with Proxy(echo) as proxy, _connect(proxy) as sock:
        assert _round_trip(sock) == b"ping"
        proxy.set_mode("latency", latency=0.1)
        started = time.monotonic()
        assert _round_trip(sock) == b"ping"
        assert time.monotonic() - started >= 0.2  # both directions delayed


def test_proxy_blackhole_keeps_the_socket_open_and_silent(echo: tuple[str, int]) -> None:
    with Proxy(echo) as proxy, _connect(proxy) as sock:
        assert _round_trip(sock) == b"ping"
        proxy.set_mode("blackhole")
        with pytest.raises(TimeoutError):
            _round_trip(sock)
        sock.sendall(b"more")  # still open: no reset, no close
        wait_until(lambda: proxy.dropped_bytes >= len(b"pingmore"), 5, what="bytes dropped")
        proxy.set_mode("pass")
        assert _round_trip(sock, b"back") == b"back"
        assert proxy.dropped_bytes >= len(b"pingmore")


def test_proxy_drop_replies_forwards_requests_only(echo: tuple[str, int]) -> None:
    with Proxy(echo) as proxy, _connect(proxy) as sock:
        proxy.set_mode("drop_replies")
        with pytest.raises(TimeoutError):
            _round_trip(sock)
        assert proxy.dropped_bytes == len(b"ping"), "the request reached the echo server"


def test_proxy_lose_reply_cuts_the_connection_once(echo: tuple[str, int]) -> None:
    with Proxy(echo) as proxy, _connect(proxy) as sock:
        proxy.set_mode("lose_reply", from_reply=b"ping")
        with pytest.raises(ConnectionError):
            _round_trip(sock)
        assert proxy.dropped_bytes == len(b"ping"), "the request reached the echo server"
        assert proxy.mode == "pass"
        with _connect(proxy) as again:
            assert _round_trip(again) == b"ping"


def test_proxy_fail_reply_answers_matched_requests_with_the_answer(
    echo: tuple[str, int],
) -> None:
    """Each of the next ``times`` matched requests reaches the server, whose reply is
    replaced by ``answer`` and the connection closed; other requests pass, and so does
    everything once those are spent."""
    answer = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
    with Proxy(echo) as proxy:
        proxy.set_mode("fail_reply", after_request=b"ping", times=2, answer=answer)
        with _connect(proxy) as sock:
            assert _round_trip(sock, b"pong") == b"pong"  # not matched: passes
            assert _round_trip(sock) == answer
            assert sock.recv(100) == b"", "the connection was closed after the answer"
        assert proxy.dropped_bytes == len(b"ping"), "the request reached the echo server"
        assert proxy.mode == "fail_reply"
        with _connect(proxy) as again:
            assert _round_trip(again, b"ping again") == answer
        assert proxy.failed_replies == 2
        assert proxy.mode == "pass"
        with _connect(proxy) as third:
            assert _round_trip(third) == b"ping"


def test_proxy_close_on_request_closes_instead_of_forwarding_once(
    echo: tuple[str, int],
) -> None:
    with Proxy(echo) as proxy, _connect(proxy) as sock:
        assert _round_trip(sock, b"pong") == b"pong"  # kept alive, not matched: passes
        proxy.set_mode("close_on_request", after_request=b"ping")
        assert _round_trip(sock) == b"", "closed (a FIN) instead of an answer"
        assert (proxy.dropped_bytes, proxy.closed_on_request) == (len(b"ping"), 1)
        assert proxy.mode == "pass"
        with _connect(proxy) as again:
            assert _round_trip(again) == b"ping"


def test_proxy_reset_breaks_open_and_new_connections(echo: tuple[str, int]) -> None:
    with Proxy(echo) as proxy, _connect(proxy) as sock:
        assert _round_trip(sock) == b"ping"
        proxy.set_mode("reset")
        with pytest.raises(ConnectionError):  # reset by peer, or a broken pipe
            _round_trip(sock)
        # A new connection is reset as soon as it is accepted (connect may see it too).
        with pytest.raises(ConnectionError), _connect(proxy) as again:
            _round_trip(again)

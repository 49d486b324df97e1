"""Fixtures of the lock server's tests: the app in-process, and the app on real uvicorn.

- ``api``: an ``httpx.AsyncClient`` calling the ASGI app directly (fast; no sockets).
- ``live``: the app served by a real uvicorn on a free loopback port, in a thread of
  this process; ``live.url`` is its base URL. Used by everything that needs real HTTP:
  long polls, event streams, disconnects, the ``http://`` store, schemathesis.

Each test gets its own store (a ``memory://`` table or a SQLite file), so tests never
see each other's locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import uvicorn
from starlette.applications import Starlette

from keymutex.server import create_app
from keymutex.server._protocol import http_protocol
from safety._tools.proxy import Proxy

ADMIN_TOKEN = "admin-" + "a" * 40
EDITOR_TOKEN = "editor-" + "e" * 40
READER_TOKEN = "reader-" + "r" * 40
TOKENS = [
    {
        "name": "ops",
        "token": ADMIN_TOKEN,
        "grants": [{"namespace": "*", "prefix": "", "allow": ["lock", "read", "admin"]}],
    },
    {
        "name": "editor-app",
        "token": EDITOR_TOKEN,
        "grants": [{"namespace": "cms", "prefix": "doc:", "allow": ["lock", "read"]}],
    },
    {
        "name": "dashboard",
        "token": READER_TOKEN,
        "grants": [{"namespace": "cms", "prefix": "", "allow": ["read"]}],
    },
]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def write_tokens(directory: Path, tokens: list[dict[str, Any]] = TOKENS) -> Path:
    path = directory / "tokens.json"
    path.write_text(json.dumps({"tokens": tokens}))
    return path


async def close_app(app: Starlette) -> None:
    """What the app's lifespan does at shutdown (ASGITransport runs no lifespan)."""
    await app.state.keymutex.namespaces.aclose()


@pytest_asyncio.fixture
async def api() -> AsyncIterator[httpx.AsyncClient]:
    """The app on a fresh memory:// table, without a token file, max_wait 2 s."""
    app = create_app(f"memory://{uuid.uuid4().hex}", max_wait=2.0)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:7420") as client:
        yield client
    await close_app(app)


@pytest_asyncio.fixture
async def secured(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The app with the token file ``TOKENS``."""
    app = create_app(f"memory://{uuid.uuid4().hex}", token_file=write_tokens(tmp_path))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:7420") as client:
        yield client
    await close_app(app)


@dataclass
class Live:
    url: str
    app: Starlette

    @contextlib.contextmanager
    def proxied(self) -> Iterator[tuple[Proxy, str]]:
        """A fault-injecting proxy in front of this server, and the URL through it."""
        upstream = httpx.URL(self.url)
        with Proxy((upstream.host, upstream.port)) as proxy:
            yield proxy, f"http://127.0.0.1:{proxy.port}"

    def metric(self, name: str) -> float:
        """The server's counter ``name`` from ``/metrics``, summed over its labels."""
        metrics = httpx.get(f"{self.url}/metrics").text
        return sum(
            float(line.rpartition(" ")[2])
            for line in metrics.splitlines()
            if line.startswith(name)
        )


def _run(server: uvicorn.Server, sock: socket.socket) -> None:
    """``server.run()``, then the connections uvicorn leaves open closed in their loop.

    At its graceful-shutdown timeout uvicorn cancels the requests still running (a long
    poll, an event stream) but not their connections: left to the garbage collector,
    their sockets would warn (``ResourceWarning``) in whatever test runs then.
    """
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(server.serve(sockets=[sock]))
        for connection in list(server.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()
        loop.run_until_complete(asyncio.sleep(0.01))  # the aborts close in callbacks
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _serve(app: Starlette, **config: Any) -> Iterator[Live]:
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it every answer waits ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=1,
            http=http_protocol(),  # as keymutex serve runs it
            **config,  # e.g. TLS: ssl_certfile=…
        )
    )
    thread = threading.Thread(target=_run, args=(server, sock), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    scheme = "https" if "ssl_certfile" in config else "http"
    try:
        yield Live(f"{scheme}://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


@pytest.fixture
def make_live(tmp_path: Path) -> Iterator[Callable[..., Live]]:
    """Start servers (closed after the test): ``make_live(token_file=…, max_wait=…)``;
    ``uvicorn_config`` goes to uvicorn (TLS: ``ssl_certfile``, …)."""
    running: list[Iterator[Live]] = []

    def make(*, uvicorn_config: dict[str, Any] | None = None, **options: Any) -> Live:
        options.setdefault("max_wait", 5.0)
        store = options.pop("store", f"sqlite:///{tmp_path}/locks-{len(running)}.db")
        serving = _serve(create_app(store, **options), **(uvicorn_config or {}))
        running.append(serving)
        return next(serving)

    yield make
    for serving in running:
        for _ in serving:  # runs the generator's clean-up
            pass


@pytest.fixture
def live(make_live: Callable[..., Live]) -> Live:
    """A real uvicorn serving a SQLite store, without a token file."""
    return make_live()

"""Fixtures of the safety suite: stores by name, the protected resource, worker processes.

A scenario says which stores it runs on with
``@pytest.mark.parametrize("store_url", ["sqlite", "redis"], indirect=True)``; the
servers are the session's (``tests/_redis_fixtures.py``, ``tests/_pg_fixtures.py``,
``tests/_memcached_fixtures.py``, ``tests/_etcd_fixtures.py``, ``tests/_zk_fixtures.py``;
``http`` is a ``keymutex serve`` on SQLite, the conformance suite's
``conformance/_http_server.py``), and each test works in a namespace of its own. A
scenario that breaks a server starts its own (``faults.redis_standalone``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conformance._http_server import http_sqlite_url  # noqa: F401 - the "http" store's server

from ._tools.resource import ResourceServer, child_env
from ._tools.worker import WorkerConfig, command

STORE_FIXTURES = {
    "redis": "redis_url",
    "postgresql": "postgresql_url",
    "memcached": "memcached_url",
    "etcd": "etcd_url",
    "zookeeper": "zookeeper_url",
    "http": "http_sqlite_url",  # ``keymutex serve`` on SQLite (one per test session)
}


@pytest.fixture
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = request.param
    if name == "memory":
        return "memory://"
    if name == "sqlite":
        return f"sqlite:///{tmp_path}/locks.db"
    if name == "mongodb":  # only generated when the variable is set (test_scenarios.py)
        return os.environ["KEYMUTEX_TEST_MONGODB_URL"]
    return str(request.getfixturevalue(STORE_FIXTURES[name]))


@pytest.fixture
def namespace() -> str:
    return f"safety-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_resource(tmp_path: Path) -> Iterator[Callable[..., ResourceServer]]:
    """Start protected resources (separate processes); stopped after the test."""
    started: list[ResourceServer] = []

    def make(*, fencing: bool = True, name: str = "resource") -> ResourceServer:
        server = ResourceServer(tmp_path / f"{name}.jsonl", fencing=fencing).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def spawn_worker(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start workers as processes of their own; killed (after SIGCONT) if still running."""
    started: list[subprocess.Popen[bytes]] = []

    def spawn(
        config: WorkerConfig,
        env: dict[str, str] | None = None,
        wrap: Callable[[list[str]], list[str]] | None = None,
    ) -> subprocess.Popen[bytes]:
        """``env``: added to the worker's; ``wrap``: turns its command line into another
        (e.g. ``ip netns exec …``)."""
        log = open(tmp_path / f"{config.name or 'worker'}.stderr", "ab")  # noqa: SIM115
        argv = command(config) if wrap is None else wrap(command(config))
        with log:
            process = subprocess.Popen(
                argv,
                env={**child_env(), **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        started.append(process)
        return process

    yield spawn
    for process in started:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)
                process.kill()
        process.wait()


def worker_output(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"{name}.stderr"
    return path.read_text(errors="replace") if path.exists() else ""

"""The ``http-sqlite`` and ``http-redis`` store cases: a real ``keymutex serve`` on a
SQLite store, and one on the session's Redis server.

One server process per case for the whole session, started as users start it
(``python -m keymutex serve --port 0``); its first line of output says where it
listens. Its output (that line, then uvicorn's log) goes to ``server.log`` in its
temp dir: a file, never a pipe that nobody reads and that would fill up.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT = 30.0  # seconds for the server to print its URL
LISTENING = re.compile(r"keymutex server on (http://\S+?)/? ")


@pytest.fixture(scope="session")
def http_sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("http-sqlite")
    yield from _serve(f"sqlite:///{directory}/locks.db", directory)


@pytest.fixture(scope="session")
def http_redis_url(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[str]:
    yield from _serve(redis_url, tmp_path_factory.mktemp("http-redis"))


def _serve(store_url: str, directory: Path) -> Iterator[str]:
    log = directory / "server.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "keymutex", "serve", "--port", "0", "--store", store_url],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while (found := LISTENING.search(log.read_text(errors="replace"))) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"keymutex serve did not start:\n{log.read_text()}")
            time.sleep(0.02)
        yield found.group(1)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

"""A real ``keymutex serve`` in a subprocess, for the end-to-end tests of the clients and pages.

The server runs on a SQLite store in the test's temp dir and a free loopback port;
it is ready once ``/healthz`` answers. Its output goes to ``server.log`` next to the
store, which failing assertions can quote.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from _processes import free_port

__all__ = ["Server", "serve"]

START_TIMEOUT = 20.0  # seconds for the server to answer /healthz


@dataclass(frozen=True)
class Server:
    url: str
    log: Path

    def output(self) -> str:
        """The server's output so far, for assertion messages."""
        return self.log.read_text(errors="replace")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(process: subprocess.Popen[bytes], url: str) -> bool:
    """True once /healthz answers 200; False if the process exited first."""
    deadline = time.monotonic() + START_TIMEOUT
    with httpx.Client(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                return False
            with contextlib.suppress(httpx.TransportError):
                if http.get(f"{url}/healthz").status_code == 200:
                    return True
            time.sleep(0.05)
    raise TimeoutError(f"keymutex serve did not answer {url}/healthz within {START_TIMEOUT} s")


@contextlib.contextmanager
def serve(
    directory: Path,
    *,
    tokens: list[dict[str, object]] | None = None,
    store: str | None = None,
) -> Iterator[Server]:
    """Runs ``keymutex serve`` on ``store`` (default: ``directory/locks.db``) until the
    block ends.

    ``tokens``, if given, is written as the ``--token-file`` (the "tokens" list of
    docs/http-api.md). A port taken between choosing and binding it is retried.
    """
    log = directory / "server.log"
    store = store or f"sqlite://{directory}/locks.db"
    command = [sys.executable, "-m", "keymutex", "serve", "--store", store]
    if tokens is not None:
        token_file = directory / "tokens.json"
        token_file.write_text(json.dumps({"tokens": tokens}))
        command += ["--token-file", str(token_file)]
    for _attempt in range(3):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with log.open("ab") as output:
            process = subprocess.Popen(
                [*command, "--host", "127.0.0.1", "--port", str(port)],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        try:
            if _wait_ready(process, url):
                yield Server(url=url, log=log)
                return
        finally:
            _stop(process)
    raise RuntimeError(
        f"keymutex serve did not start; its output:\n{log.read_text(errors='replace')}"
    )

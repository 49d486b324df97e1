"""``keymutex serve``, run for real: refusals, the URL it prints, and a clean stop."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import write_tokens

KEYMUTEX = [sys.executable, "-m", "keymutex"]
WAIT = 30.0
LISTENING = re.compile(r"keymutex server on (http://127\.0\.0\.1:\d+)/ \(store (\S+)\)")


def _serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KEYMUTEX, "serve", *args], capture_output=True, text=True, timeout=WAIT, cwd=cwd
    )


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


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_prints_its_url_serves_and_stops_cleanly(tmp_path: Path, stop: signal.Signals) -> None:
    log = tmp_path / "out.log"
    store = f"sqlite:///{tmp_path}/locks.db"
    tokens = write_tokens(tmp_path)
    with log.open("wb") as output:
        process = subprocess.Popen(
            [*KEYMUTEX, "serve", "--port", "0", "--store", store, "--token-file", str(tokens)],
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + WAIT
        while (found := LISTENING.search(log.read_text())) is None:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        url, shown_store = found.groups()
        assert shown_store == store
        assert httpx.get(f"{url}/healthz").json()["store"] == "sqlite"
        assert httpx.get(f"{url}/v1/holders").status_code == 401  # the token file applies
        process.send_signal(stop)
        assert process.wait(WAIT) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "keymutex server stopped" in log.read_text()
    assert "Traceback" not in log.read_text()

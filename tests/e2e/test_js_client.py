"""The JavaScript client (clients/js) against a real ``keymutex serve``.

``node --test clients/js/test/`` runs with ``KEYMUTEX_URL`` pointing at the server;
then a Node process and this Python process increment one counter file under one
lock, and no update is lost.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _server import Server, serve

import keymutex

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "clients" / "js"
NODE = shutil.which("node")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        NODE is None, reason="node is not installed: the JavaScript client needs Node >= 18"
    ),
]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with serve(tmp_path) as running:
        yield running


def test_node_suite_passes(server: Server) -> None:
    assert NODE is not None
    result = subprocess.run(
        [NODE, "--test", "--test-reporter=spec", "test/"],
        cwd=CLIENT,
        env={**os.environ, "KEYMUTEX_URL": server.url, "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"node --test failed:\n{report}\nserver log:\n{server.output()}"
    assert "# fail 0" in report or "ℹ fail 0" in report, report
    assert "skipped 0" in report, f"some node tests were skipped:\n{report}"


def test_python_and_node_share_one_lock(server: Server, tmp_path: Path) -> None:
    assert NODE is not None
    rounds = 25
    counter = tmp_path / "counter.json"
    counter.write_text(json.dumps({"count": 0, "fence": 0}))
    key = "ticket:user-42"
    node = subprocess.Popen(
        [
            NODE,
            str(CLIENT / "examples" / "counter.mjs"),
            server.url,
            "cross",
            key,
            str(counter),
            str(rounds),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert node.stdout is not None
        assert node.stdout.readline().strip() == "ready"
        with keymutex.Locks(server.url, namespace="cross", owner="python-test") as locks:
            for _ in range(rounds):
                with locks.lock(key, ttl=10, timeout=30) as lease:
                    state = json.loads(counter.read_text())
                    assert lease.fence > state["fence"], "fences grow across languages"
                    # Read, pause, write: where an unlocked counter loses updates.
                    time.sleep(0.005)
                    state.update(
                        count=state["count"] + 1,
                        fence=lease.fence,
                        writers=state.get("writers", "") + "p",
                    )
                    counter.write_text(json.dumps(state))
        out, err = node.communicate(timeout=40)
    finally:
        if node.poll() is None:
            node.kill()
            node.communicate()
    assert node.returncode == 0, f"node failed:\n{out}\n{err}\nserver log:\n{server.output()}"
    assert out.strip() == f"done {rounds}"
    final = json.loads(counter.read_text())
    assert final["count"] == 2 * rounds
    # Both writers are in the trace, and they took turns: the lock was contended.
    writers = final["writers"]
    assert sorted(writers) == sorted("p" * rounds + "n" * rounds)
    switches = sum(a != b for a, b in itertools.pairwise(writers))
    assert switches >= 2, f"the processes did not contend: {writers}"

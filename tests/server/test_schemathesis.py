"""Schemathesis drives every /v1 operation of /openapi.json: no answer may be a 5xx.

A bounded run (30 examples per operation, at most 30 s) against a real uvicorn. The
event stream is left out: it never ends, by design. ``max_wait`` is short so that
generated waits and acquires with a timeout answer quickly.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import Live

pytestmark = pytest.mark.slow


def test_no_operation_answers_a_server_error(
    make_live: Callable[..., Live], tmp_path: Path
) -> None:
    live = make_live(store="memory://schemathesis", max_wait=0.05)
    schemathesis = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if schemathesis is None:
        pytest.skip("schemathesis is not installed")
    done = subprocess.run(
        [
            schemathesis, "run", f"{live.url}/openapi.json",
            "--checks", "not_a_server_error",
            "--max-examples", "30",
            "--max-time", "30",
            "--exclude-path", "/v1/events",
            "--seed", "1",
            "--workers", "1",
            "--request-timeout", "10",
            "--generation-database", "none",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=55,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "10 selected" in done.stdout  # the /v1 operations but events, /healthz, /metrics

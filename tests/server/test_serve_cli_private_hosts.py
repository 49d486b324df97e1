"""``keymutex serve`` on a private (LAN) address without ``--token-file`` is refused.

Found by the third mutation audit: the only refusal tested was for 0.0.0.0 and ::,
which are also "private" to ``ipaddress``; a check of ``is_private`` instead of
``is_loopback`` passed the suite and would serve every lock, unauthenticated, to a
whole LAN (10/8, 192.168/16, fd00::/8 addresses are the usual ones of a server).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

KEYMUTEX = [sys.executable, "-m", "keymutex"]


@pytest.mark.parametrize(
    "host", ["10.1.2.3", "192.168.1.10", "172.16.0.1", "fd00::1", "[fd00::1]"]
)
def test_refuses_a_private_host_without_a_token_file(tmp_path: Path, host: str) -> None:
    done = subprocess.run(
        [*KEYMUTEX, "serve", "--host", host, "--store", f"sqlite:///{tmp_path}/x.db"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "refusing to serve" in done.stderr
    assert "--token-file" in done.stderr
    assert not (tmp_path / "x.db").exists()  # refused before opening anything

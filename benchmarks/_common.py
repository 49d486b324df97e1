"""What every benchmark script shares: the host's clock, percentiles, the machine line."""

from __future__ import annotations

import platform
import subprocess
import time
from pathlib import Path

import keymutex

__all__ = ["cpu_model", "host_clock", "percentile", "revision"]


def host_clock() -> float:
    """``CLOCK_BOOTTIME``: one clock for every process on the host (handoff times)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def revision() -> str:
    """The commit of the keymutex this run imported (``PYTHONPATH`` may pick a clean copy)."""
    checkout = Path(keymutex.__file__).resolve().parents[2]  # <checkout>/src/keymutex/

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", "-C", str(checkout), *args], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "src")
    where = "" if checkout == Path(__file__).resolve().parents[1] else f" (from {checkout})"
    return head + (" + uncommitted changes in src/" if dirty else "") + where

"""What every benchmark script shares: the host's clock, percentiles, the machine line."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import keymutex

__all__ = ["cpu_model", "enter_peer_venv", "host_clock", "percentile", "revision"]

REPO = Path(__file__).resolve().parents[1]


def load_module(path: str, name: str) -> ModuleType:
    """The module at ``path`` (another version of a store, to compare), loaded once per
    process under ``name``."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None, path
        assert spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while it loads
        spec.loader.exec_module(module)
    return sys.modules[name]


@dataclass(frozen=True)
class HoldFigures:
    """What the holds of a contention run say about the lock (times in seconds)."""

    overlaps: int  # holds that began before the previous one ended (must be 0)
    same: int  # holds that followed one of the same process
    handoffs: list[float]  # a release -> the next holder's grant, between processes
    worst_wait: float  # the longest asked -> granted

    def same_percent(self, holds: int) -> float:
        return 100.0 * self.same / max(1, holds - 1)


def hold_figures(holds: Sequence[tuple[float, float, float, int]]) -> HoldFigures:
    """``holds``: (acquired, released, asked, pid) of every hold, sorted by acquired."""
    handoffs: list[float] = []
    same = overlaps = 0
    for (_, released, _, pid), (acquired, _, _, next_pid) in itertools.pairwise(holds):
        overlaps += acquired < released
        if next_pid == pid:
            same += 1
        else:
            handoffs.append(acquired - released)
    worst = max((acquired - asked for acquired, _, asked, _ in holds), default=0.0)
    return HoldFigures(overlaps, same, handoffs, worst)


def contention_row(
    holds: Sequence[tuple[float, float, float, int]], seconds: float, counted: int
) -> dict[str, float]:
    """The common columns of a contention run (times in ms): grants within ``seconds``
    of the first ask per second, updates lost against the ``counted`` counter, and
    ``hold_figures``."""
    figures = hold_figures(holds)
    handoffs = [handoff * 1e3 for handoff in figures.handoffs]
    first_asked = min(hold[2] for hold in holds)
    return {
        "acquires/s": sum(1 for hold in holds if hold[0] < first_asked + seconds) / seconds,
        "lost": len(holds) - counted,
        "overlaps": figures.overlaps,
        "handoff p50": percentile(handoffs, 0.5),
        "handoff p90": percentile(handoffs, 0.9),
        "same %": figures.same_percent(len(holds)),
        "worst wait": figures.worst_wait * 1e3,
        "handoffs": len(handoffs),
    }


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


# -- a virtualenv of pinned peer libraries (they never go into the project's own) -------


def _requirements(pins: Path) -> list[str]:
    lines = (line.split("#")[0].strip() for line in pins.read_text().splitlines())
    return [line for line in lines if line]


def _pip(python: Path, *args: str, log: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
    )
    with log.open("a") as f:
        f.write(f"$ pip install {' '.join(args)}\n{result.stdout}\n{result.stderr}\n")
    return result


def _pip_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    return (lines[-1] if lines else result.stderr.strip().splitlines()[-1])[:300]


def _install_peers(python: Path, venv: Path, pins: Path, extras: str) -> dict[str, str]:
    """Install every pinned peer and keymutex; the ones that failed, with pip's reason."""
    log = venv / "install.log"
    log.write_text("")
    failures: dict[str, str] = {}
    requirements = _requirements(pins)
    print(f"installing {len(requirements)} pinned packages into {venv} ...", flush=True)
    if _pip(python, "-r", str(pins), log=log).returncode != 0:
        for requirement in requirements:  # one by one, to know which ones cannot install
            result = _pip(python, requirement, log=log)
            if result.returncode != 0:
                name = requirement.split("==")[0].split("[")[0]
                failures[name] = f"pip install failed: {_pip_error(result)}"
    result = _pip(python, "-e", f"{REPO}[{extras}]", log=log)
    if result.returncode != 0:
        failures["keymutex"] = f"pip install -e failed: {_pip_error(result)}"
    return failures


def enter_peer_venv(venv: Path, pins: Path, extras: str, script: str) -> None:
    """Create or update ``venv`` with the ``pins`` and ``keymutex[extras]``, then re-execute
    ``script`` in it (does not return). What failed to install is in
    ``venv/install-failures.json``; the install is redone when the pins or pyproject change.
    """
    python = venv / "bin" / "python"
    if not python.exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        print(f"creating {venv} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    stamp = venv / "installed.sha256"
    wanted = hashlib.sha256(pins.read_bytes() + (REPO / "pyproject.toml").read_bytes()).hexdigest()
    if not stamp.exists() or stamp.read_text() != wanted:
        failures = _install_peers(python, venv, pins, extras)
        (venv / "install-failures.json").write_text(json.dumps(failures, indent=1))
        stamp.write_text(wanted)
    os.execv(python, [str(python), str(Path(script).resolve()), *sys.argv[1:]])

"""Run every benchmark in one go and gather their tables in benchmarks/RESULTS.md.

Run: make bench   (or .venv/bin/python benchmarks/run_all.py)

Each script measures keymutex side by side with its peers in one run (ratios, not
absolute times, are what to compare: these machines are shared and noisy) and writes
its table to benchmarks/results/<name>.md.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
SCRIPTS = {
    "local": ["bench_local.py"],
    "sqlite": ["bench_sqlite.py"],
}


def main() -> None:
    sections = []
    for name, command in SCRIPTS.items():
        print(f"== {name}: {' '.join(command)}", flush=True)
        subprocess.run([sys.executable, str(HERE / command[0]), *command[1:]], check=True)
        table = (HERE / "results" / f"{name}.md").read_text().strip()
        sections.append(f"{table}\n\nCommand: `.venv/bin/python benchmarks/{' '.join(command)}`")
    header = (
        "# Benchmark results\n\n"
        f"Run by `make bench` on {datetime.date.today()}: Python {platform.python_version()},"
        f" {os.cpu_count()} cores, {platform.system()} {platform.release()}.\n"
        "Compare ratios within one table: absolute figures vary between runs on shared machines.\n"
    )
    (HERE / "RESULTS.md").write_text(header + "\n" + "\n\n".join(sections) + "\n")
    print(f"wrote {HERE / 'RESULTS.md'}")


if __name__ == "__main__":
    main()

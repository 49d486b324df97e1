"""Run every benchmark in one go and gather their tables in benchmarks/RESULTS.md.

Run: make bench   (or .venv/bin/python benchmarks/run_all.py [NAME ...])

``NAME ...`` runs only those benchmarks; ``--gather`` runs none and only gathers the
tables already in benchmarks/results/ (each says when and how it was made), each followed
by ``results/<name>.notes.md`` if there is one: what was found by hand (a profile, an
A/B run), which a new run of the script does not overwrite.

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
    "redis": ["redis_bench.py"],
    "postgresql": ["bench_postgresql.py"],
    "zookeeper": ["bench_zookeeper.py"],
    "etcd": ["bench_etcd.py"],
    "server": ["bench_server.py"],
    "dashboard": ["bench_dashboard.py"],
    "stores": ["bench_stores.py"],
    "peers": ["bench_peers.py"],
    "memcached": ["bench_memcached.py"],
}


def main() -> None:
    arguments = sys.argv[1:]
    gather_only = "--gather" in arguments
    chosen = [a for a in arguments if a != "--gather"] or list(SCRIPTS)
    unknown = sorted(set(chosen) - set(SCRIPTS))
    if unknown:
        sys.exit(f"unknown benchmarks {unknown}; known: {', '.join(SCRIPTS)}")
    sections = []
    for name, command in SCRIPTS.items():
        if name in chosen and not gather_only:
            print(f"== {name}: {' '.join(command)}", flush=True)
            subprocess.run([sys.executable, str(HERE / command[0]), *command[1:]], check=True)
        result = HERE / "results" / f"{name}.md"
        if not result.exists():
            print(f"== {name}: no results yet (run it: benchmarks/run_all.py {name})")
            continue
        table = result.read_text().strip()
        if "Command:" not in table:  # most scripts write their own, with their options
            table += f"\n\nCommand: `.venv/bin/python benchmarks/{' '.join(command)}`"
        notes = HERE / "results" / f"{name}.notes.md"  # written by hand: kept across runs
        if notes.exists():
            table += "\n\n" + notes.read_text().strip()
        sections.append(table)
    header = (
        "# Benchmark results\n\n"
        f"Gathered by `benchmarks/run_all.py` on {datetime.date.today()}: Python"
        f" {platform.python_version()}, {os.cpu_count()} cores, {platform.system()}"
        f" {platform.release()}. Each table says when and how it was measured.\n"
        "Compare ratios within one table: absolute figures vary between runs on shared machines.\n"
    )
    (HERE / "RESULTS.md").write_text(header + "\n" + "\n\n".join(sections) + "\n")
    print(f"wrote {HERE / 'RESULTS.md'}")


if __name__ == "__main__":
    main()

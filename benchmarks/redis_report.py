"""The Redis benchmark's report: markdown table, PNG chart and the goals summary."""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import platform
import statistics
import subprocess
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis_contention
import redis_uncontended as unc

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DISTRIBUTIONS = [
    "keymutex",
    "redis",
    "hiredis",
    "python-redis-lock",
    "pottery",
    "sherlock",
    "tooz",
    "aioredlock",
    "aioredis",
    "portalocker",
    "matplotlib",
]
KM_SYNC = "keymutex Locks: with lock() (renew=True)"
KM_SYNC_ACQUIRE = "keymutex Locks: acquire() + release()"
KM_ASYNC = "keymutex AsyncLocks: async with lock() (renew=True)"
KM_ASYNC_ACQUIRE = "keymutex AsyncLocks: acquire() + release()"
KM_CONTENDER = "keymutex Locks: with lock()"
PRL_CONTENDER = "python-redis-lock (BLPOP wake-up)"
CAVEATS = [
    "Client, server and the 4 contending processes share the same 2 cores with other "
    "engineers' work: absolute figures move between runs, ratios measured in one run are "
    "what to compare. Everything runs over loopback TCP, so a round trip costs CPU "
    "(system calls and scheduling), not network latency.",
    "Part 1 rounds interleave the cases (rotated order); each figure is the median of the "
    "per-round medians (p90: of the per-round p90s); ratios are medians of per-round ratios. "
    "The client process (with all its threads: pottery's pool, portalocker's keep-alive, "
    "keymutex's renewer) is pinned to one core and redis-server to the other: unpinned, the "
    "scheduler now and then put both on one core, where a round trip is ~1/3 cheaper, and "
    "the medians went bimodal. Parts 2–4 are not pinned.",
    "Usage follows each README: redis-py, python-redis-lock, aioredlock and keymutex create "
    "a lock object per use; pottery, sherlock, tooz and portalocker reuse one lock object. "
    "Keys are `bench:<case>:uncontended` before each library's own prefix.",
    "pottery `Redlock` with one master still runs the Redlock protocol (thread pool, "
    "quorum and clock-drift bookkeeping) on every acquire and release.",
    "tooz's Redis lock is redis-py's `Lock` (thread_local=False) behind tooz's coordinator; "
    "sherlock sets the key with SETNX + EXPIRE in a script.",
    "portalocker's `RedisLock` is not a key lock: it holds a pub/sub subscription (a "
    "connection and a keep-alive thread) and counts the channel's subscribers; its cost is "
    "that subscription.",
    "aioredlock runs on aioredis 1.3 (unmaintained, its own client), not redis-py; it "
    "starts a watchdog task per lock to extend it.",
    "keymutex `lock()` defaults to renew=True (the lease is registered with the Locks' "
    "renewer thread/task while held); the acquire()+release() rows use renew=False, the "
    "`acquire()` default. Both are shown.",
    "Part 2: the critical section is GET + SET of a counter key through a second client; "
    "handoff = next holder's grant minus the previous holder's time just before its "
    "release call (so it includes the release round trip and the wake-up), on "
    "CLOCK_MONOTONIC shared by the processes. Acquires/s counts grants before the deadline; "
    "waiters still queued at the deadline finish (no timeout) and count for lost updates.",
    "Part 2/3 redis-py Lock polls with its default sleep=0.1 s; the raw baseline retries "
    "SET NX PX with a 1 ms sleep.",
    "Commands per acquire exclude the critical section's GET + SET. 'server' counts "
    "`INFO commandstats` deltas, which include the commands Lua scripts run inside Redis; "
    "'client' counts what redis-py sent (its packer); 'one-off' are server commands sent "
    "at most once per task in the whole run (handshakes, first SUBSCRIBE, SCRIPT LOAD), which "
    "the coalescing goal leaves out; round trips are redis-py "
    "socket sends (a pipeline is one), and the writes keymutex's async store makes to the "
    "socket itself; socket reads are the server's "
    "`total_reads_processed`. Client counts exist only for redis-py based libraries.",
    "Part 4 ticks are the store's `renew_many` calls (one per renewer wake-up), counted "
    "through a private hook on `Locks._store`; bytes/lease is the `used_memory` delta "
    "(includes allocator overhead and any per-namespace structures) divided by the leases.",
]


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()},"
        f" Python {platform.python_version()}; load average at the end: {load}"
    )


def _git_revision() -> str:
    try:
        head = subprocess.run(
            ["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(HERE.parent), "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    if not dirty:
        return head
    return f"{head} + uncommitted changes in src/ (stores/redis.py sha256 {store_digest()}…)"


def store_digest() -> str:
    """A short digest of keymutex's Redis store source, to tell versions apart."""
    store = HERE.parent / "src" / "keymutex" / "stores" / "redis.py"
    return hashlib.sha256(store.read_bytes()).hexdigest()[:12] if store.exists() else "absent"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@dataclass
class Goal:
    text: str
    figure: str
    met: bool | None  # None: could not be measured


@dataclass
class Report:
    args: dict[str, Any]
    install_failures: dict[str, str]
    redis_version: str = "?"
    keymutex_problem: str | None = None
    uncontended: dict[str, unc.Timing] = field(default_factory=dict)
    cases: dict[str, unc.Case] = field(default_factory=dict)
    uncontended_failed: dict[str, str] = field(default_factory=dict)
    contention: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    contention_failed: dict[str, list[str]] = field(default_factory=dict)
    coalescing: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    coalescing_failed: dict[str, list[str]] = field(default_factory=dict)
    hold: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    pinned: str = "not pinned"
    store_digest_at_start: str = field(default_factory=store_digest)

    # -- figures ---------------------------------------------------------------------
    def _ratio(self, name: str, reference: str) -> float | None:
        a, b = self.uncontended.get(name), self.uncontended.get(reference)
        if a is None or b is None:
            return None
        return _median([x / y for x, y in zip(a.median_us, b.median_us, strict=True)])

    def _contention(self, name: str, column: str) -> float | None:
        runs = self.contention.get(name)
        return _median([r[column] for r in runs]) if runs else None

    def _coalescing(self, name: str, column: str) -> float | None:
        runs = self.coalescing.get(name)
        return _median([r[column] for r in runs]) if runs else None

    def _reason(self, name: str, failed: dict[str, Any]) -> str:
        for distribution, why in self.install_failures.items():
            if distribution in name.lower():
                return why
        if "keymutex" in name and self.keymutex_problem:
            return self.keymutex_problem
        why = failed.get(name, "not measured")
        return "; ".join(why) if isinstance(why, list) else why

    @staticmethod
    def _failed_rounds(failed: dict[str, list[str]], measured: dict[str, Any]) -> list[str]:
        """Lines naming the rounds that failed, for contenders that also had good rounds."""
        lines = [
            f"- {name}: {len(whys)} failed round(s): " + "; ".join(whys)
            for name, whys in failed.items()
            if name in measured
        ]
        return (
            ["**Failed rounds** (the figures above are from the other rounds):", "", *lines, ""]
            if lines
            else []
        )

    # -- goals -----------------------------------------------------------------------
    def goals(self) -> list[Goal]:
        goals: list[Goal] = []

        def ratio_goal(name: str, reference: str, bound: float, label: str) -> None:
            value = self._ratio(name, reference)
            goals.append(
                Goal(
                    f"{label} ≤ {bound} ×",
                    "not measured" if value is None else f"{value:.2f} ×",
                    None if value is None else value <= bound,
                )
            )

        ratio_goal(KM_SYNC, unc.RAW, 1.1, "uncontended: keymutex `with lock()` / raw baseline")
        ratio_goal(
            KM_SYNC_ACQUIRE, unc.RAW, 1.1, "uncontended: keymutex acquire+release / raw baseline"
        )
        ratio_goal(
            KM_ASYNC, unc.ASYNC_RAW, 1.1, "uncontended: keymutex async / raw asyncio baseline"
        )
        ratio_goal(KM_SYNC, unc.PING, 2.3, "uncontended: keymutex `with lock()` / PING")
        raw_vs_ping = self._ratio(unc.RAW, unc.PING)
        if raw_vs_ping is not None:  # the bound is below two round trips: say so
            goals[-1].figure += f" (the raw baseline itself: {raw_vs_ping:.2f} ×)"
        for km in (KM_SYNC, KM_SYNC_ACQUIRE, KM_ASYNC, KM_ASYNC_ACQUIRE):
            flavour = "async" if "Async" in km else "sync"
            peers = [
                n
                for n, case in self.cases.items()
                if "keymutex" not in n
                and n not in _FLOORS_AND_BASELINES
                and case.flavour == flavour
            ]
            if km not in self.uncontended or not peers:
                goals.append(
                    Goal(
                        f"uncontended: {km} faster than every {flavour} peer", "not measured", None
                    )
                )
                continue
            mine = _median(self.uncontended[km].median_us)
            best = min(peers, key=lambda n: _median(self.uncontended[n].median_us))
            theirs = _median(self.uncontended[best].median_us)
            goals.append(
                Goal(
                    f"uncontended: {km} faster than every {flavour} peer",
                    f"{mine:.0f} µs vs fastest {flavour} peer, {best}: {theirs:.0f} µs",
                    mine < theirs,
                )
            )
        km_rate = self._contention(KM_CONTENDER, "acquires/s")
        prl_rate = self._contention(PRL_CONTENDER, "acquires/s")
        goals.append(
            Goal(
                "contention: keymutex acquires/s ≥ python-redis-lock's",
                "not measured"
                if km_rate is None or prl_rate is None
                else f"{km_rate:,.0f} vs {prl_rate:,.0f} /s ({km_rate / prl_rate:.2f} ×)",
                None if km_rate is None or prl_rate is None else km_rate >= prl_rate,
            )
        )
        for column, bound, label in (
            ("handoff p90 ms", 1.0, "contention: keymutex handoff p90 ≤ 1 ms"),
            (
                "max per-process re-acquire %",
                50.0,
                "contention: no process > 50 % re-acquisitions",
            ),
            ("lost updates", 0.0, "contention: keymutex lost updates = 0"),
        ):
            value = self._contention(KM_CONTENDER, column)
            if column == "lost updates" and KM_CONTENDER in self.contention:
                value = max(r[column] for r in self.contention[KM_CONTENDER])
            goals.append(
                Goal(
                    label,
                    "not measured" if value is None else _fmt(value),
                    None if value is None else value <= bound,
                )
            )
        for name in redis_contention.COALESCERS:
            if not name.startswith("keymutex"):
                continue
            server = self._coalescing(name, "server commands/acquire")
            client = self._coalescing(name, "client commands/acquire")
            setup = self._coalescing(name, "one-off commands/acquire") or 0.0
            goals.append(
                Goal(
                    f"coalescing: {name}: ≤ 3 commands per acquire (sent by the client,"
                    " less one-off set-up)",
                    "not measured"
                    if server is None or client is None
                    else f"{client - setup:.3f} sent (+ {setup:.3f} one-off set-up: commands sent ≤ once per task in the run);"
                    f" {server:.2f} in commandstats incl. inside scripts",
                    # Judged at the table's precision: a handful of commands at the start
                    # and end of a run (e.g. CLIENT SETINFO, which Redis 7.0 rejects
                    # unnamed) move the third decimal.
                    None if client is None else round(client - setup, 2) <= 3,
                )
            )
        keymutex_failures = [
            f"{name}: {why}"
            for failed in (self.contention_failed, self.coalescing_failed)
            for name, whys in failed.items()
            if "keymutex" in name
            for why in whys
        ] + [f"{n}: {why}" for n, why in self.uncontended_failed.items() if "keymutex" in n]
        goals.append(
            Goal(
                "keymutex: every round of parts 1–3 completed without error",
                "; ".join(keymutex_failures) or "no failure",
                not keymutex_failures,
            )
        )
        bytes_per_lease = self.hold.get("bytes/lease")
        goals.append(
            Goal(
                "10k held leases: ≤ 300 bytes of used_memory per lease",
                "not measured" if bytes_per_lease is None else f"{bytes_per_lease:.0f} B",
                None if bytes_per_lease is None else bytes_per_lease <= 300,
            )
        )
        if "dbsize after" in self.hold:
            before, after = self.hold["dbsize before"], self.hold["dbsize after"]
            goals.append(
                Goal(
                    "10k held leases: DBSIZE back to before after release",
                    f"before {before}, held {self.hold['dbsize held']:,}, after {after}",
                    after <= before,
                )
            )
            lost = self.hold.get("lost during hold", 0)
            goals.append(Goal("10k held leases: none lost while renewing", str(lost), lost == 0))
        return goals

    # -- output ----------------------------------------------------------------------
    def markdown(self) -> str:
        out = [
            "## Redis: keymutex vs Redis lock libraries (`benchmarks/redis_bench.py`)",
            "",
            f"Run on {datetime.date.today()}: {_machine()}. Redis server {self.redis_version}"
            f" (Debian), on loopback, `--save '' --appendonly no`. keymutex at {_git_revision()}."
            f" Whole run: {self.seconds:.0f} s.",
            "",
            f"Command: `{_command(self.args)}` (creates benchmarks/.peers/redis-venv with the"
            " pins of benchmarks/redis-peers.txt and re-executes itself there).",
            "",
            "Versions: "
            + ", ".join(f"{d} {_version(d)}" for d in DISTRIBUTIONS)
            + f", redis-server {self.redis_version}.",
            "",
        ]
        if store_digest() != self.store_digest_at_start:
            out += [
                f"**Warning:** src/keymutex/stores/redis.py changed during the run"
                f" ({self.store_digest_at_start}… → {store_digest()}…): processes started at"
                " different times ran different code. Run again on a quiet tree.",
                "",
            ]
        out += self._markdown_uncontended()
        out += self._markdown_contention()
        out += self._markdown_coalescing()
        out += self._markdown_hold()
        out += ["### Goals", "", "| goal | figure | met |", "|---|---|---|"]
        for goal in self.goals():
            met = {True: "met", False: "**missed**", None: "not measured"}[goal.met]
            out.append(f"| {goal.text} | {goal.figure} | {met} |")
        out += ["", "### Caveats", ""] + [f"- {c}" for c in CAVEATS] + [""]
        return "\n".join(out)

    def _markdown_uncontended(self) -> list[str]:
        a = self.args
        out = [
            f"### 1. Uncontended acquire+release, one client ({a['rounds']} rounds × {a['pairs']:,} pairs per case)",
            "",
            f"During this part: {self.pinned}. A case slower than {a['budget']:g} s per round"
            " stops early (at least 20 pairs): see the pairs column.",
            "",
            "| library | median µs | p90 µs | × raw baseline | × PING | × raw of its flavour | pairs | note |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for name in unc.BUILDERS:
            if name not in self.uncontended:
                out.append(
                    f"| {name} | not runnable: {self._reason(name, self.uncontended_failed)} | | | | | | |"
                )
                continue
            timing = self.uncontended[name]
            flavour = self.cases[name].flavour
            own_raw = unc.RAW if flavour == "sync" else unc.ASYNC_RAW
            cells = [
                _fmt(_median(timing.median_us), 0),
                _fmt(_median(timing.p90_us), 0),
                _fmt(self._ratio(name, unc.RAW)),
                _fmt(self._ratio(name, unc.PING)),
                _fmt(self._ratio(name, own_raw)),
                _fmt(sum(timing.pairs)),
                self.cases[name].note,
            ]
            bold = "**" if "keymutex" in name else ""
            out.append(f"| {bold}{name}{bold} | " + " | ".join(cells) + " |")
        return [*out, ""]

    def _markdown_contention(self) -> list[str]:
        a = self.args
        columns = [
            "acquires/s",
            "lost updates",
            "handoff p50 ms",
            "handoff p90 ms",
            "handoffs",
            "worst wait ms",
            "same holder %",
            "max per-process re-acquire %",
            "server commands/acquire",
            "round trips/acquire",
        ]
        out = [
            f"### 2. {redis_contention.PROCESSES} processes on one key, critical section GET + SET"
            f" (median of {a['contention_rounds']} interleaved rounds of {a['seconds']:g} s)",
            "",
            "| lock | " + " | ".join(columns) + " |",
            "|---" + "|---:" * len(columns) + "|",
        ]
        for name in redis_contention.CONTENDERS:
            if name not in self.contention:
                out.append(
                    f"| {name} | not runnable: {self._reason(name, self.contention_failed)} |"
                    + " |" * (len(columns) - 1)
                )
                continue
            cells = []
            for column in columns:
                value = self._contention(name, column)
                if column == "lost updates":
                    value = max(r[column] for r in self.contention[name])
                cells.append(_fmt(value, 0 if column == "acquires/s" else 2))
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out += [
            "",
            "Same holder %: consecutive grants to the process that just released. Max per-process"
            " re-acquire %: for the process where it is highest, the share of its grants that"
            " directly followed its own release. Lost updates: the worst round.",
            "",
        ]
        return out + self._failed_rounds(self.contention_failed, self.contention)

    def _markdown_coalescing(self) -> list[str]:
        a = self.args
        columns = [
            "acquires/s",
            "lost updates",
            "server commands/acquire",
            "client commands/acquire",
            "one-off commands/acquire",
            "round trips/acquire",
            "socket reads/acquire",
        ]
        out = [
            f"### 3. Coalescing: {redis_contention.PROCESSES} processes × 16 tasks/threads on one"
            f" key (median of {a['coalescing_rounds']} rounds of {a['seconds']:g} s)",
            "",
            "| configuration | "
            + " | ".join(columns)
            + " | server commands per acquire, by name |",
            "|---" + "|---:" * len(columns) + "|---|",
        ]
        for name in redis_contention.COALESCERS:
            if name not in self.coalescing:
                out.append(
                    f"| {name} | not runnable: {self._reason(name, self.coalescing_failed)} |"
                    + " |" * len(columns)
                )
                continue
            runs = self.coalescing[name]
            cells = [
                _fmt(
                    self._coalescing(name, c),
                    0 if c == "acquires/s" else 3 if "set-up" in c else 2,
                )
                if c != "lost updates"
                else _fmt(max(r[c] for r in runs))
                for c in columns
            ]
            last = runs[-1]["breakdown"]
            breakdown = ", ".join(f"{k} {v:.2f}" for k, v in last.items())
            out.append(f"| {name} | " + " | ".join(cells) + f" | {breakdown} (last round) |")
        return [*out, "", *self._failed_rounds(self.coalescing_failed, self.coalescing)]

    def _markdown_hold(self) -> list[str]:
        out = [
            f"### 4. {self.args['leases']:,} leases held with renew=True in one keymutex Locks (ttl 10 s)",
            "",
        ]
        if "error" in self.hold or not self.hold:
            return [*out, f"not runnable: {self.hold.get('error', 'not measured')}", ""]
        out += ["| measure | value |", "|---|---:|"]
        for key, value in self.hold.items():
            if isinstance(value, dict):
                value = ", ".join(f"{k} {v:,}" for k, v in sorted(value.items()))
            out.append(f"| {key} | {_fmt(value)} |")
        return [*out, ""]

    def chart(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(
            1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [3, 2]}
        )
        names = [n for n in unc.BUILDERS if n in self.uncontended]
        medians = [_median(self.uncontended[n].median_us) for n in names]
        colors = [
            "tab:green"
            if "keymutex" in n
            else "tab:gray"
            if n in _FLOORS_AND_BASELINES
            else "tab:blue"
            for n in names
        ]
        left.barh(names, medians, color=colors)
        left.invert_yaxis()
        for y, value in enumerate(medians):
            left.text(value, y, f" {value:.0f}", va="center", fontsize=8)
        if unc.PING in self.uncontended:
            ping = _median(self.uncontended[unc.PING].median_us)
            left.axvline(ping, color="tab:red", linestyle="--", label=f"PING floor {ping:.0f} µs")
        if unc.RAW in self.uncontended:
            raw = _median(self.uncontended[unc.RAW].median_us)
            left.axvline(
                raw, color="tab:orange", linestyle=":", label=f"raw baseline {raw:.0f} µs"
            )
        left.set_xscale("log")
        left.set_xlabel("median µs per acquire+release, log scale (lower is better)")
        left.set_title("1. Uncontended, one client")
        left.legend(loc="lower right", fontsize=8)
        left.tick_params(axis="y", labelsize=8)

        names = [n for n in redis_contention.CONTENDERS if n in self.contention]
        rates = [self._contention(n, "acquires/s") or 0.0 for n in names]
        same = [self._contention(n, "same holder %") or 0.0 for n in names]
        right.bar(
            range(len(names)),
            rates,
            color=["tab:green" if "keymutex" in n else "tab:blue" for n in names],
        )
        for x, (rate, share) in enumerate(zip(rates, same, strict=True)):
            right.text(
                x,
                rate,
                f"{rate:,.0f}/s\n{share:.0f} % same holder",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        right.set_xticks(range(len(names)), [textwrap.fill(n, 16) for n in names], fontsize=7)
        right.set_ylabel("acquires/s (higher is better)")
        right.set_title(f"2. {redis_contention.PROCESSES} processes on one key")
        right.margins(y=0.2)
        fig.suptitle(f"Redis {self.redis_version}, 2 shared cores, loopback: medians of rounds")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def summary(self) -> str:
        lines = ["", "Goals:"]
        if store_digest() != self.store_digest_at_start:
            lines.insert(0, "WARNING: src/keymutex/stores/redis.py changed during the run")
        for goal in self.goals():
            met = {True: "MET   ", False: "MISSED", None: "n/a   "}[goal.met]
            lines.append(f"  {met} {goal.text}: {goal.figure}")
        lines += [
            "",
            f"wrote {RESULTS / 'redis.md'} and {RESULTS / 'redis.png'} ({self.seconds:.0f} s)",
        ]
        return "\n".join(lines)

    def write(self) -> None:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "redis.md").write_text(self.markdown())
        try:
            self.chart(RESULTS / "redis.png")
        except Exception as exc:  # the table matters more than the picture
            print(f"chart failed: {exc!r}")


_FLOORS_AND_BASELINES = {unc.PING, unc.RAW, unc.ASYNC_PING, unc.ASYNC_RAW}


def _command(args: dict[str, Any]) -> str:
    return " ".join([".venv/bin/python benchmarks/redis_bench.py", *args.get("argv", [])])

"""Checkers of histories: pure functions, no I/O.

- ``check_fencing``: what the protected resource let through (its log), and the
  fences the lock granted (the workers' ``acquire`` operations): accepted fences
  strictly increase per key, no stale write was accepted, no fence was granted twice
  for one key, and a grant that began after another ended has the larger fence.
- ``find_overlaps``: pairs of critical sections of one key, of different processes,
  that overlap in time (by their invoke/complete times). With fencing off, this is
  what a lock alone lets happen under faults.
- ``check_mutex``: a small linearizability checker (Wing & Gong, with the memoisation
  of Lowe / Knossos) for the history of one lease mutex per key: owner-aware, fenced,
  with expiry. It looks for an order of the operations, each taking effect at one
  instant between its invoke and its complete, that a mutex model accepts.

The mutex model
---------------
State per key: the holder (a lease id, or none), the largest fence granted, and a window
``[lo, hi]`` in which the holder's lease expires (the store's clock is not ours: the
grant happened somewhere in its operation's interval, and TTLs are counted from there,
give or take ``slack`` seconds).

- ``acquire`` ok: the key has no holder, or the holder's lease has expired by then;
  the fence is larger than every fence before it. ``steal`` ok: the same, without
  waiting for expiry.
- ``acquire`` fail (``Locked``): with ``strict_refusals``, the key must be held then.
  Stores with fair queues or hand-over (sqlite, Redis) may refuse a free key reserved
  for a waiter, so refusals are unconstrained by default.
- ``renew`` / ``release`` ok: the lease is the holder and has not expired.
- ``renew`` / ``release`` fail (``LockLost``): the lease is not the holder, or has
  expired by then (it then has no holder).
- an ``info`` operation (outcome unknown, e.g. its process was killed) may take effect
  at any time after its invocation, or never. An acquire of unknown fence counts as
  granting the smallest fence it could have had.

Each operation is given the earliest instant that its model step allows; the window of
the lease it grants or renews is taken from its whole interval, so the check never
reports a violation that some timing within the intervals would explain (it can miss
some near the edges of ``slack``).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .history import Op

__all__ = [
    "FencingReport",
    "MutexReport",
    "Overlap",
    "Violation",
    "check_fencing",
    "check_mutex",
    "find_overlaps",
]


@dataclass(frozen=True)
class Violation:
    kind: str  # "stale-accepted", "fence-granted-twice", "fence-order"
    key: str
    detail: str


@dataclass
class FencingReport:
    accepted: int = 0
    rejected: int = 0
    stale_accepted: int = 0
    grants: int = 0
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def __str__(self) -> str:
        head = (
            f"{self.accepted} writes accepted, {self.rejected} rejected,"
            f" {self.stale_accepted} stale accepted, {self.grants} grants"
        )
        return "\n".join([head, *(f"  {v.kind} [{v.key}]: {v.detail}" for v in self.violations)])


def check_fencing(
    resource_log: Sequence[dict[str, Any]], grants: Iterable[Op] = ()
) -> FencingReport:
    """Check the resource's log (in its order) and the granted fences.

    ``resource_log``: entries ``{"key", "fence", "accepted", ...}`` as the resource wrote
    them. ``grants``: operations; only successful ``acquire``/``steal`` are looked at.
    """
    report = FencingReport()
    largest: dict[str, int] = {}
    for entry in resource_log:
        key, fence = entry["key"], int(entry["fence"])
        if not entry["accepted"]:
            report.rejected += 1
            continue
        report.accepted += 1
        last = largest.get(key)
        if last is not None and fence <= last:
            report.stale_accepted += 1
            report.violations.append(
                Violation(
                    "stale-accepted",
                    key,
                    f"fence {fence} accepted after fence {last} (client {entry.get('client')})",
                )
            )
        largest[key] = fence if last is None else max(last, fence)

    by_key: dict[str, list[Op]] = defaultdict(list)
    for o in grants:
        if o.op in ("acquire", "steal") and o.result == "ok" and o.fence is not None:
            by_key[o.key].append(o)
    for key, ops in by_key.items():
        report.grants += len(ops)
        seen: dict[int, Op] = {}
        for o in ops:
            first = seen.setdefault(o.fence, o)  # type: ignore[arg-type]
            if first is not o:
                report.violations.append(
                    Violation(
                        "fence-granted-twice",
                        key,
                        f"fence {o.fence} granted to {first.process} and to {o.process}",
                    )
                )
        # A grant that completed before another was invoked must have a smaller fence.
        ended = sorted(ops, key=lambda o: o.complete)
        ends = [o.complete for o in ended]
        prefix_max: list[tuple[int, Op]] = []
        for o in ended:
            best = prefix_max[-1] if prefix_max else None
            prefix_max.append((o.fence, o) if best is None or o.fence > best[0] else best)  # type: ignore[operator]
        for o in ops:
            n = bisect.bisect_left(ends, o.invoke)
            if n and prefix_max[n - 1][0] >= o.fence:  # type: ignore[operator]
                before = prefix_max[n - 1][1]
                report.violations.append(
                    Violation(
                        "fence-order",
                        key,
                        f"{o.process} was granted fence {o.fence} after {before.process}'s"
                        f" grant of fence {before.fence} had completed",
                    )
                )
    return report


@dataclass(frozen=True)
class Overlap:
    key: str
    first: Op
    second: Op

    @property
    def seconds(self) -> float:
        return min(self.first.complete, self.second.complete) - self.second.invoke


def find_overlaps(ops: Iterable[Op], name: str = "cs", until: float = math.inf) -> list[Overlap]:
    """Pairs of ``name`` operations of one key, by different processes, overlapping in time.

    A section that never completed (its process died) is open until ``until``.
    """
    by_key: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        if o.op == name:
            by_key[o.key].append(o)
    found = []
    for key, sections in by_key.items():
        sections.sort(key=lambda o: o.invoke)
        active: list[Op] = []
        for o in sections:
            active = [a for a in active if min(a.complete, until) > o.invoke]
            found.extend(Overlap(key, a, o) for a in active if a.process != o.process)
            active.append(o)
    return found


# -- the mutex model ------------------------------------------------------------------

MODEL_OPS = frozenset({"acquire", "steal", "renew", "release"})


@dataclass(frozen=True, slots=True)
class _State:
    holder: str | None
    fence: int | None  # the largest fence granted (a lower bound after unknown grants)
    lo: float  # the holder's lease expires at some instant in [lo, hi]
    hi: float
    now: float  # the earliest instant the last operation can have taken effect


@dataclass
class KeyResult:
    key: str
    valid: bool | None  # None: gave up after max_states
    ops: int
    explored: int
    detail: str = ""


@dataclass
class MutexReport:
    results: list[KeyResult]

    @property
    def valid(self) -> bool:
        return all(r.valid for r in self.results)

    @property
    def explored(self) -> int:
        return sum(r.explored for r in self.results)

    def __str__(self) -> str:
        return "\n".join(
            f"[{r.key}] {'valid' if r.valid else 'INVALID' if r.valid is False else 'unknown'}:"
            f" {r.ops} ops, {r.explored} states {r.detail}"
            for r in self.results
        )


def _lease_id(o: Op) -> str:
    return o.lease if o.lease is not None else f"{o.process}#{o.fence}"


def _window(t: float, o: Op, ttl: float | None, slack: float) -> tuple[float, float]:
    if ttl is None:  # renewed in the background: never expires in the model
        return math.inf, math.inf
    return t + ttl - slack, o.complete + ttl + slack


def _step(s: _State, o: Op, *, slack: float, strict_refusals: bool) -> _State | None:
    """The state after ``o`` takes effect next, at its earliest instant; None if it cannot."""
    t = max(s.now, o.invoke)
    end = o.complete
    name = o.op
    succeeded = o.result in ("ok", "info")  # an info op is tried as having succeeded
    if name in ("acquire", "steal"):
        if not succeeded:
            if not strict_refusals:
                return s
            if s.holder is None or t >= s.hi:
                return None  # refused, but nobody held the key
            return _State(s.holder, s.fence, max(s.lo, t), s.hi, t)
        if o.fence is not None and s.fence is not None and o.fence <= s.fence:
            return None
        if s.holder is not None and name == "acquire":
            t = max(t, s.lo)  # the holder's lease must have expired first
            if t > end:
                return None
        fence = o.fence if o.fence is not None else (s.fence or 0) + 1
        lo, hi = _window(t, o, o.ttl, slack)
        return _State(_lease_id(o), fence, lo, hi, t)
    mine = s.holder is not None and s.holder == o.lease
    if succeeded:  # renew / release ok: held, and not expired yet
        if not mine or t >= s.hi:
            return None
        if name == "release":
            return _State(None, s.fence, 0.0, 0.0, t)
        lo, hi = _window(t, o, o.ttl, slack)
        return _State(s.holder, s.fence, lo, hi, t)
    if not mine:  # LockLost: someone else holds it, or nobody
        return _State(s.holder, s.fence, s.lo, s.hi, t)
    t = max(t, s.lo)  # LockLost for the holder: its lease expired by then
    if t > end:
        return None
    return _State(None, s.fence, 0.0, 0.0, t)


def _check_key(
    key: str,
    ops: list[Op],
    *,
    slack: float,
    strict_refusals: bool,
    max_states: int,
) -> KeyResult:
    ops = sorted(ops, key=lambda o: o.invoke)
    n = len(ops)
    required = 0
    for i, o in enumerate(ops):
        if o.result != "info":
            required |= 1 << i
    start = _State(None, None, 0.0, 0.0, -math.inf)
    seen: set[tuple[int, _State]] = {(0, start)}
    stack: list[tuple[int, _State]] = [(0, start)]
    deepest = (-1, 0)
    explored = 0
    while stack:
        mask, state = stack.pop()
        explored += 1
        if mask & required == required:
            return KeyResult(key, True, n, explored)
        if explored > max_states:
            return KeyResult(key, None, n, explored, f"gave up after {max_states} states")
        # The first operation not yet taken, and the earliest completion among those left:
        # an operation invoked after that completion cannot come next.
        first = 0
        while mask >> first & 1:
            first += 1
        depth = mask.bit_count()
        if depth > deepest[0]:
            deepest = (depth, first)
        bound = math.inf
        i = first
        while i < n and ops[i].invoke <= bound:
            if not mask >> i & 1:
                bound = min(bound, ops[i].complete)
            i += 1
        successors = []
        for j in range(first, i):
            if mask >> j & 1 or ops[j].invoke > bound:
                continue
            after = _step(state, ops[j], slack=slack, strict_refusals=strict_refusals)
            if after is not None:
                successors.append((mask | 1 << j, after))
        for item in reversed(successors):
            if item not in seen:
                seen.add(item)
                stack.append(item)
    depth, first = deepest
    stuck = ops[first]
    return KeyResult(
        key,
        False,
        n,
        explored,
        f"no valid order: at most {depth} of {n} ops linearize; stuck at {stuck.process}"
        f" {stuck.op} {stuck.result} fence={stuck.fence} [{stuck.invoke:.3f},"
        f" {stuck.complete:.3f}]",
    )


def check_mutex(
    ops: Iterable[Op],
    *,
    slack: float = 0.05,
    strict_refusals: bool = False,
    max_states: int = 500_000,
) -> MutexReport:
    """Is the history of ``acquire``/``steal``/``renew``/``release`` linearizable?

    Keys are independent (checked one by one). Other operations are ignored.
    ``ttl`` of an operation is its lease's TTL (``None``: renewed in the background,
    never expires in the model).
    """
    by_key: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        if o.op in MODEL_OPS:
            by_key[o.key].append(o)
    return MutexReport(
        [
            _check_key(
                key, key_ops, slack=slack, strict_refusals=strict_refusals, max_states=max_states
            )
            for key, key_ops in sorted(by_key.items())
        ]
    )

"""JSON-lines histories of operations, in the style of Jepsen: invoke, then complete.

A process writes one line when it *invokes* an operation and one when the operation
*completes* (``ok``, ``fail`` or ``info``: outcome unknown). A process that is killed
leaves invocations without completions; ``load_ops`` turns those into ``info``
operations with no completion time (they may or may not have taken effect).

Each line is written and flushed at once, so what a killed process did is on disk.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["HistoryWriter", "Op", "load_events", "load_ops", "op"]

RESULTS = ("ok", "fail", "info")


@dataclass(frozen=True)
class Op:
    """One operation of one process: invoked at ``invoke``, completed at ``complete``.

    ``complete`` is ``math.inf`` when the operation never completed (its process died)
    or completed as ``info`` (outcome unknown): it may take effect at any time after
    ``invoke``, or never.
    """

    process: str
    op: str
    key: str
    invoke: float
    complete: float
    result: str
    fence: int | None = None
    lease: str | None = None
    ttl: float | None = None
    value: Any = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def completed(self) -> bool:
        return self.result != "info" and math.isfinite(self.complete)


def op(
    process: str,
    name: str,
    invoke: float,
    complete: float | None,
    result: str,
    *,
    key: str = "k",
    fence: int | None = None,
    lease: str | None = None,
    ttl: float | None = None,
    value: Any = None,
) -> Op:
    """A hand-made operation (for tests of the checkers); ``complete=None``: never."""
    assert result in RESULTS, result
    end = math.inf if complete is None or result == "info" else complete
    return Op(process, name, key, invoke, end, result, fence, lease, ttl, value)


class HistoryWriter:
    """Appends the events of one process (or thread) to a JSON-lines file."""

    def __init__(self, path: str | Path, process: str) -> None:
        self.process = process
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _write(self, event: dict[str, Any]) -> None:
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)  # one write per line, O_APPEND: never torn

    def invoke(self, name: str, key: str, **fields: Any) -> int:
        """Record the start of an operation; returns its id for ``complete``."""
        op_id = next(self._ids)
        event = {"type": "invoke", "process": self.process, "id": op_id, "op": name, "key": key}
        event.update(fields)
        event["t"] = time.monotonic()
        self._write(event)
        return op_id

    def complete(self, op_id: int, result: str, **fields: Any) -> None:
        assert result in RESULTS, result
        t = time.monotonic()
        event = {"type": result, "process": self.process, "id": op_id, "t": t}
        event.update(fields)
        self._write(event)

    def note(self, what: str, **fields: Any) -> None:
        """A line that is not an operation (e.g. "lost", with the time it was seen)."""
        event = {"type": "note", "process": self.process, "what": what, "t": time.monotonic()}
        event.update(fields)
        self._write(event)

    def close(self) -> None:
        os.close(self._fd)


def load_events(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    events = []
    for path in paths:
        text = Path(path).read_text() if Path(path).exists() else ""
        events.extend(json.loads(line) for line in text.splitlines() if line.strip())
    return events


_OP_FIELDS = ("fence", "lease", "ttl", "value")


def load_ops(paths: Iterable[str | Path]) -> list[Op]:
    """Pair invocations with completions; unmatched invocations become ``info``."""
    invoked: dict[tuple[str, int], dict[str, Any]] = {}
    done: dict[tuple[str, int], dict[str, Any]] = {}
    for event in load_events(paths):
        if event["type"] == "note":
            continue
        ident = (event["process"], event["id"])
        (invoked if event["type"] == "invoke" else done)[ident] = event
    ops = []
    for ident, start in invoked.items():
        end = done.get(ident)
        merged = {**start, **(end or {})}
        result = end["type"] if end else "info"
        known = {name: merged.get(name) for name in _OP_FIELDS}
        extra = {k: v for k, v in merged.items() if k not in {*_OP_FIELDS, "type", "t"}}
        ops.append(
            Op(
                process=start["process"],
                op=start["op"],
                key=start["key"],
                invoke=start["t"],
                complete=end["t"] if end and result != "info" else math.inf,
                result=result,
                extra=extra,
                **known,
            )
        )
    ops.sort(key=lambda o: (o.invoke, o.process))
    return ops

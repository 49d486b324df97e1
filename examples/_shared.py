"""What the examples that start worker processes share: Ctrl-C reaches the parent
alone, a store every worker can use, and a record that lives as long as it should."""

from __future__ import annotations

import argparse
import contextlib
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import keymutex


@contextlib.contextmanager
def ctrl_c_ignored() -> Iterator[None]:
    """Ctrl-C (SIGINT) is ignored for good in the processes started in the block, which
    inherit that: a Ctrl-C at the terminal, sent to every process of the group,
    interrupts this one alone, which stops them. Here it is held back until the block
    ends (blocked as well as ignored: Linux keeps a blocked signal pending), so one
    pressed while they start is not lost (it was, and the example ran to its end)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    masks = hasattr(signal, "pthread_sigmask")
    if masks:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if masks:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def check_shared_store(parser: argparse.ArgumentParser, url: str, example: str) -> None:
    """One line, not a traceback from every worker, if the workers cannot share ``url``;
    ``example`` is a URL to suggest instead."""
    if url.partition(":")[0] == "memory":  # what `keymutex run` says too
        parser.error(
            "memory:// lives in one process, and the workers here are processes: each"
            f" would hold its own locks; give a store they share, e.g. {example}"
        )
    try:
        with keymutex.Locks(url) as probe:
            probe.holder("probe")
    except (ImportError, ValueError, keymutex.StoreError) as exc:
        parser.error(f"{str(exc).rstrip('.')}; give another store URL, e.g. {example}")


def with_record(play: Callable[[str], int], record: str | None, name: str) -> int:
    """``play(record_path)``: in ``record`` (emptied first: an earlier run's lines would
    read as this run's), whose path is then printed; without it, in a temporary
    directory removed at the end."""
    if not record:
        with tempfile.TemporaryDirectory(prefix="keymutex-example-") as directory:
            return play(str(Path(directory) / name))
    Path(record).write_text("", encoding="utf-8")
    status = play(record)
    print(f"record: {record}")
    return status

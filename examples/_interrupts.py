"""What the examples that start processes share: Ctrl-C reaches the parent alone."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def ctrl_c_ignored() -> Iterator[None]:
    """Ctrl-C (SIGINT) is ignored in the block, and for good in the processes started in
    it, which inherit that: a Ctrl-C at the terminal, sent to every process of the group,
    interrupts this one alone, which stops them. (One pressed in the few milliseconds
    that starting them takes is lost.)"""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)

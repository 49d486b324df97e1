"""A forked child renews its own leases, and the parent goes on renewing its own."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

import keymutex


def _hold_past_the_ttl(locks: keymutex.Locks) -> None:
    with locks.lock("child", ttl=0.3):  # survives only if the child's renewer runs
        time.sleep(1.0)


# Python 3.12+ warns about fork() in a process with threads: that is the point here.
@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_forked_child_renews_its_own_leases(tmp_path: Path) -> None:
    locks = keymutex.Locks(f"sqlite:///{tmp_path}/locks.db")
    with locks, locks.lock("parent", ttl=0.3) as parent:  # the renewer thread runs now
        child = multiprocessing.get_context("fork").Process(
            target=_hold_past_the_ttl, args=(locks,)
        )
        child.start()
        child.join(20)
        assert child.exitcode == 0, "the child's lease was lost: nothing renewed it"
        time.sleep(0.5)
        assert parent.lost is False, "the parent's own renewals stopped"

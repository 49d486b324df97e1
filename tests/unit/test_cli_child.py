"""``keymutex run``'s handling of its child process, below the command line."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from keymutex.cli import _Run


@pytest.mark.asyncio
async def test_a_signal_forwarded_to_a_child_that_just_died_keeps_its_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal to the whole process group (systemd, ``timeout``, ``kill -- -PGID``) may
    kill the child before keymutex forwards its own copy. Forwarding must not reap the
    dead child behind asyncio's watcher: asyncio then lost its status and ``run`` exited
    255 ("Unknown child process pid …") instead of 128+N, about once in 30 tries.
    """
    real_waitpid = os.waitpid

    def watcher_reaps_late(pid: int, options: int) -> tuple[int, int]:
        if options == 0:  # asyncio's child watcher blocks in waitpid(pid, 0)
            time.sleep(0.3)  # widen the race's window to certainty
        return real_waitpid(pid, options)

    monkeypatch.setattr(os, "waitpid", watcher_reaps_late)
    child = await asyncio.create_subprocess_exec("sleep", "30")
    run = _Run("job", ["sleep", "30"], quiet=True, info=None)
    run.process, run.phase = child, "running"
    os.kill(child.pid, signal.SIGTERM)  # the group's signal reaches the child first
    await asyncio.sleep(0.1)  # dead, not yet reaped
    run.on_signal(signal.SIGTERM)  # keymutex's own copy, forwarded
    assert await asyncio.wait_for(child.wait(), 10) == -signal.SIGTERM

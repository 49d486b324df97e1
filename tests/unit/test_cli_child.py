"""``keymutex run``'s handling of its child process, below the command line."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from keymutex import cli
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


class _Exited(Exception):
    """``os._exit`` and the re-raised signal, caught: keymutex would have ended."""


@pytest.mark.asyncio
async def test_a_ctrl_c_that_came_before_the_command_started_reaches_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a Ctrl-C between the grant and the command's start was kept,
    then taken for one the terminal had sent the command too (keymutex is the
    terminal's foreground job): nobody sent it, and the command ran to its end under
    the lock. Here the terminal is taken to deliver Ctrl-C to the command's group."""
    monkeypatch.setattr(cli, "_terminal_delivered_to_child", lambda signum, child: True)
    run = _Run("job", ["sleep", "30"], quiet=True, info=None)
    run.phase = "starting"
    run.on_signal(signal.SIGINT)  # the grant has come; the command is not running yet
    lease = type("Lease", (), {"fence": 7, "token": "t" * 24})()
    status = await asyncio.wait_for(run._child(lease), 10)  # type: ignore[arg-type]
    assert status == 128 + signal.SIGINT


@pytest.mark.parametrize("phase", ["ended", "done"])
def test_a_signal_once_the_command_is_over_ends_keymutex_by_it(
    phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: once the release was over (or the command could not start), a
    signal was kept, not acted on, while the client closed (a failed release is tried
    once more then, and waits for the store as long): keymutex ended with status 0."""

    def exited(status: int) -> None:
        raise _Exited(status)

    monkeypatch.setattr(cli, "_die_by", lambda signum: None)
    monkeypatch.setattr(os, "_exit", exited)
    run = _Run("job", ["sleep", "30"], quiet=True, info=None)
    run.phase = phase
    with pytest.raises(_Exited) as ended:
        run.on_signal(signal.SIGTERM)
    assert ended.value.args == (128 + signal.SIGTERM,)


@pytest.mark.asyncio
async def test_a_signal_while_a_lease_lost_before_the_start_is_released_ends_keymutex(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: when the lease was lost before the command started, a signal
    during the release was kept, as if the command were about to start."""

    def exited(status: int) -> None:
        raise _Exited(status)

    monkeypatch.setattr(cli, "_die_by", lambda signum: None)
    monkeypatch.setattr(os, "_exit", exited)
    run = _Run("job", ["sleep", "30"], quiet=True, info=None)
    run.lost = True  # before the command could start: it will not

    class Releasing:
        async def __aenter__(self) -> Releasing:
            return self

        async def __aexit__(self, *exc_info: object) -> None:
            run.on_signal(signal.SIGTERM)  # while the release waits for the store

    with pytest.raises(_Exited) as ended:
        await run._hold(Releasing())  # type: ignore[arg-type]
    assert ended.value.args == (128 + signal.SIGTERM,)
    assert run.process is None

"""``keymutex run``'s handling of its child process, below the command line."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import keymutex
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


# --- a Ctrl-C while the command is being started ----------------------------------------

# COMMAND for the tests below: exits 3 on SIGINT once its handler is set (a SIGINT before
# that kills it: 130, or 1 while Python imports ``site``), else runs to its end (exit 0:
# no Ctrl-C reached it).
_TRAPS_SIGINT = r"""
import os, signal, sys, time
signal.signal(signal.SIGINT, lambda *_: os._exit(3))
open(sys.argv[1], "w").close()
time.sleep(5)
"""
PATIENCE = 20.0


async def _run_at_a_terminal(
    monkeypatch: pytest.MonkeyPatch, ready: Path
) -> tuple[int, list[int]]:
    """``run.main`` of the command above, as a terminal's foreground job (a Ctrl-C
    reaches keymutex and its command's group alike): its status, and the signals
    keymutex sent the command."""
    monkeypatch.setattr(cli, "_terminal_delivered_to_child", lambda signum, child: True)

    def exited(status: int) -> None:  # a copy acted on once the command ended
        raise _Exited(status)

    monkeypatch.setattr(cli, "_die_by", lambda signum: None)
    monkeypatch.setattr(os, "_exit", exited)
    sent: list[int] = []
    send = cli._signal

    def spy(process: asyncio.subprocess.Process, signum: int, *, descendants: bool) -> None:
        sent.append(signum)
        send(process, signum, descendants=descendants)

    monkeypatch.setattr(cli, "_signal", spy)
    command = [sys.executable, "-c", _TRAPS_SIGINT, str(ready)]
    run = _Run("job", command, quiet=True, info=None)
    url = f"memory://t{uuid.uuid4().hex}"
    status = await asyncio.wait_for(
        run.main(lambda: keymutex.AsyncLocks(url), None, None), PATIENCE
    )
    return status, sent


def _spawn_then(
    monkeypatch: pytest.MonkeyPatch, before: Callable[[], object], after: Callable[[int], object]
) -> None:
    """Call ``before()`` just before keymutex spawns its command, ``after(pid)`` once the
    spawn has returned to asyncio (the command runs) but not yet to keymutex."""
    spawn = asyncio.create_subprocess_exec

    async def spawning(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        before()
        process = await spawn(*args, **kwargs)
        after(process.pid)
        return process

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spawning)


def _ctrl_c_to_keymutex() -> None:
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.asyncio
async def test_a_ctrl_c_just_before_the_fork_reaches_the_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Found by review: nothing yields between the grant and the fork, so asyncio ran
    the callback of a Ctrl-C that came then only once the spawn had returned; keymutex
    took it for one the terminal had sent the command too and dropped it, and the
    command ran to its end under the lock."""
    _spawn_then(monkeypatch, _ctrl_c_to_keymutex, lambda pid: None)
    status, sent = await _run_at_a_terminal(monkeypatch, tmp_path / "ready")
    assert sent == [signal.SIGINT]
    assert status != 0  # it did not run to its end


@pytest.mark.asyncio
async def test_a_ctrl_c_between_the_fork_and_the_exec_reaches_the_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Found by review: the child, before its exec, still has keymutex's handlers: it
    caught the terminal's Ctrl-C there (and wrote it to keymutex's asyncio wakeup fd,
    a second copy), and the command never saw it; keymutex dropped its own copies as
    the terminal's, and the command ran to its end. Now the child gets it with the
    default action: it ends by SIGINT before the command is executed."""

    def ctrl_c_in_the_child() -> None:  # the terminal's Ctrl-C, to the whole group
        os.kill(os.getppid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(cli, "_parent_death_signal", lambda: ctrl_c_in_the_child)
    status, _ = await _run_at_a_terminal(monkeypatch, tmp_path / "ready")
    assert status == 128 + signal.SIGINT
    assert not (tmp_path / "ready").exists()  # the command was not executed


@pytest.mark.asyncio
async def test_a_ctrl_c_after_the_exec_is_not_forwarded_as_well(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A Ctrl-C once the command is executed, while asyncio has not yet handed its
    process to keymutex, reached the command from the terminal: keymutex must not send
    it a second one (programs take a second Ctrl-C as "quit now, skip the clean-up")."""
    ready = tmp_path / "ready"

    def ctrl_c_to_both(pid: int) -> None:
        deadline = time.monotonic() + PATIENCE
        while not ready.exists():  # its handler is set
            assert time.monotonic() < deadline, "the command never got ready"
            time.sleep(0.01)
        os.kill(pid, signal.SIGINT)
        _ctrl_c_to_keymutex()

    _spawn_then(monkeypatch, lambda: None, ctrl_c_to_both)
    status, sent = await _run_at_a_terminal(monkeypatch, ready)
    assert status == 3
    assert sent == []


@pytest.mark.asyncio
async def test_a_signal_while_the_handlers_are_installed_is_not_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal that came after asyncio had set its handler for it and before keymutex
    set ``_arrived`` in its place ran asyncio's (``_nothing``) and was lost: the wait
    went on, and the command ran to its end under the lock. Here it comes just then."""
    loop = asyncio.get_running_loop()
    add = loop.add_signal_handler

    def add_then_a_sigterm(signum: int, callback: Callable[..., object], *args: Any) -> None:
        add(signum, callback, *args)
        if signum == signal.SIGTERM:  # to this thread: held here while it is blocked
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    monkeypatch.setattr(loop, "add_signal_handler", add_then_a_sigterm)
    monkeypatch.setattr(cli, "_die_by", lambda signum: None)
    run = _Run("job", [sys.executable, "-c", "import time; time.sleep(3)"], quiet=True, info=None)
    url = f"memory://t{uuid.uuid4().hex}"
    status = await asyncio.wait_for(
        run.main(lambda: keymutex.AsyncLocks(url), None, None), PATIENCE
    )
    assert status == 128 + signal.SIGTERM

"""The ``keymutex`` command, run for real: subprocesses on a SQLite store in a temp dir.

Processes coordinate through files (a child says it is ready, the test says "go"),
never through sleeps: every assertion holds however slow the machine is.
"""

from __future__ import annotations

import contextlib
import getpass
import http.server
import json
import os
import pty
import select
import shlex
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _server import serve

import keymutex as keymutex_lib

KEYMUTEX = [sys.executable, "-m", "keymutex"]
WAIT = 20.0  # seconds before a helper gives up waiting for a file or a line

# A child command for `keymutex run`, driven by its arguments:
#   --env PATH      write the KEYMUTEX_* variables it received as JSON
#   --log PATH NAME append "NAME start" now and "NAME end" when it ends
#   --trap SIG N    on signal SIG, append "got SIG" to the log and exit N
#   --ready PATH    create PATH once set up (after --trap)
#   --wait PATH     wait until PATH exists
#   --exit N        exit with status N
CHILD = r"""
import json, os, signal, sys, time
args = sys.argv[1:]
log = name = None
exit_status = 0

def append(line):
    if log:
        with open(log, "a") as f:
            f.write(line + "\n")

while args:
    option, args = args[0], args[1:]
    if option == "--env":
        env = {k: v for k, v in os.environ.items() if k.startswith("KEYMUTEX_")}
        with open(args.pop(0), "w") as f:
            json.dump(env, f)
    elif option == "--log":
        log, name = args.pop(0), args.pop(0)
        append(f"{name} start")
    elif option == "--trap":
        signum, status = getattr(signal, args.pop(0)), int(args.pop(0))
        def handler(received, frame, status=status):
            append(f"got {signal.Signals(received).name}")
            os._exit(status)
        signal.signal(signum, handler)
    elif option == "--ready":
        open(args.pop(0), "w").close()
    elif option == "--wait":
        path = args.pop(0)
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
    elif option == "--exit":
        exit_status = int(args.pop(0))
if name:
    append(f"{name} end")
sys.exit(exit_status)
"""


@pytest.fixture
def store(tmp_path: Path) -> str:
    return f"sqlite://{tmp_path}/locks.db"


@pytest.fixture
def child(tmp_path: Path) -> list[str]:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return [sys.executable, str(path)]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The environment of every keymutex process: no inherited store, a private HOME."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KEYMUTEX_")}
    environ["XDG_DATA_HOME"] = str(tmp_path / "xdg-data")
    return environ


class Background:
    """``keymutex ...`` running in the background (its own session: no terminal)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [*KEYMUTEX, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.stderr_lines: list[str] = []

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_for_stderr(self, fragment: str) -> str:
        """Read stderr until a line contains ``fragment``; that line."""
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr_lines.append(line)
            if fragment in line:
                return line
        raise AssertionError(f"{fragment!r} never appeared on stderr: {self.stderr_lines}")

    def finish(self) -> tuple[int, str, str]:
        """Wait for the end: exit status, stdout, the rest of stderr."""
        stdout, stderr = self.process.communicate(timeout=WAIT)
        return self.process.returncode, stdout, "".join(self.stderr_lines) + stderr

    def kill(self) -> None:
        """Make sure it is gone (after a failed test): kill its process group."""
        if self.process.returncode is not None:
            return  # finished and reaped
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.communicate(timeout=WAIT)


@pytest.fixture
def background(env: dict[str, str]) -> Iterator[Any]:
    started: list[Background] = []

    def start(*args: str) -> Background:
        process = Background(list(args), env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()


# python -c this ARGUMENT COMMAND…: runs COMMAND, ignoring ARGUMENT.
SKIP_ONE_ARGUMENT = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[2:]).returncode)"


def keymutex(
    *args: str, env: dict[str, str], check: int | None = 0
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [*KEYMUTEX, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT,
        start_new_session=True,
        check=False,
    )
    assert "Traceback" not in result.stderr, result.stderr
    if check is not None:
        assert result.returncode == check, (result.returncode, result.stdout, result.stderr)
    return result


def wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + WAIT
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def holder_json(key: str, store: str, env: dict[str, str], *extra: str) -> Any:
    return json.loads(keymutex("show", key, "--store", store, "--json", *extra, env=env).stdout)


# -- run -----------------------------------------------------------------------------


def test_run_exits_with_the_command_status_and_passes_fence_and_token(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str]
) -> None:
    seen = tmp_path / "env.json"
    result = keymutex(
        "run", "job", "--store", store, "--", *child, "--env", str(seen), "--exit", "3",
        env=env, check=3,
    )  # fmt: skip
    assert result.stderr == ""
    variables = json.loads(seen.read_text())
    assert variables["KEYMUTEX_KEY"] == "job"
    assert int(variables["KEYMUTEX_FENCE"]) >= 1
    token = variables["KEYMUTEX_TOKEN"]
    assert len(token) >= 22
    assert set(token) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert holder_json("job", store, env) is None  # released after the command

    keymutex("run", "job", "--store", store, "--", *child, "--env", str(seen), env=env)
    assert int(json.loads(seen.read_text())["KEYMUTEX_FENCE"]) > int(variables["KEYMUTEX_FENCE"])


def test_run_passes_command_arguments_and_output_through(store: str, env: dict[str, str]) -> None:
    script = "import sys; print(sys.argv[1:]); sys.exit(0)"
    result = keymutex(
        "run", "job", "--store", store, "--", sys.executable, "-c", script, "--ttl", "-x", "",
        env=env,
    )  # fmt: skip
    assert result.stdout.strip() == "['--ttl', '-x', '']"


def test_run_without_dashes_leaves_the_commands_options_to_it(
    store: str, env: dict[str, str]
) -> None:
    """Found by review: without ``--``, click took the command's options that share a
    name with keymutex's (``--ttl``, ``-q``, ``--info``) for itself, silently, and
    failed on the others (``ls -la``: "No such option"). Everything from the command
    on is the command's; keymutex's own options go before it."""
    script = "import sys; print(sys.argv[1:])"
    result = keymutex(
        "run", "--store", store, "job", "--timeout", "5", sys.executable, "-c", script,
        "--ttl", "600", "-q", "--info", "{}", "-la", "rest",
        env=env,
    )  # fmt: skip
    assert result.stdout.strip() == "['--ttl', '600', '-q', '--info', '{}', '-la', 'rest']"
    assert holder_json("job", store, env) is None


def test_two_runs_on_one_key_take_turns(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str], background: Any
) -> None:
    log, ready, go = tmp_path / "log", tmp_path / "ready", tmp_path / "go"
    first = background(
        "run", "job", "--store", store, "--",
        *child, "--log", str(log), "A", "--ready", str(ready), "--wait", str(go),
    )  # fmt: skip
    wait_for_file(ready)
    second = background("run", "job", "--store", store, "--", *child, "--log", str(log), "B")
    line = second.wait_for_stderr("waiting for")
    assert f":{first.pid}" in line  # the holder is named
    go.touch()
    assert first.finish()[0] == 0
    assert second.finish()[0] == 0
    assert log.read_text().splitlines() == ["A start", "A end", "B start", "B end"]


def test_run_with_timeout_0_exits_75_naming_the_holder(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str], background: Any
) -> None:
    ready, go, seen = tmp_path / "ready", tmp_path / "go", tmp_path / "env.json"
    holder = background(
        "run", "job", "--store", store, "--",
        *child, "--env", str(seen), "--ready", str(ready), "--wait", str(go),
    )  # fmt: skip
    wait_for_file(ready)
    fence = json.loads(seen.read_text())["KEYMUTEX_FENCE"]
    ran = tmp_path / "ran"
    result = keymutex(
        "run", "job", "--store", store, "--timeout", "0", "--", *child, "--ready", str(ran),
        env=env, check=75,
    )  # fmt: skip
    assert not ran.exists()
    message = result.stderr
    assert "'job' was not acquired within 0s" in message
    assert f"{socket.gethostname()}:{holder.pid}" in message
    assert f"fence {fence}" in message
    assert "since" in message
    go.touch()
    assert holder.finish()[0] == 0


def test_namespaces_are_separate(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str], background: Any
) -> None:
    ready, go = tmp_path / "ready", tmp_path / "go"
    holder = background(
        "run", "job", "--store", store, "--namespace", "a", "--",
        *child, "--ready", str(ready), "--wait", str(go),
    )  # fmt: skip
    wait_for_file(ready)
    keymutex("run", "job", "--store", store, "--namespace", "b", "--timeout", "0", "--", "true",
             env=env)  # fmt: skip
    keymutex("run", "job", "--store", store, "--timeout", "0", "--", "true", env=env)
    keymutex("run", "job", "--store", store, "--namespace", "a", "--timeout", "0", "--", "true",
             env=env, check=75)  # fmt: skip
    go.touch()
    assert holder.finish()[0] == 0


def test_a_ctrl_c_stops_the_shell_loop_that_runs_keymutex(store: str, env: dict[str, str]) -> None:
    """Found by review: after a Ctrl-C (SIGINT to the foreground process group), a
    shell loop calling ``keymutex run`` went on with its next round, as keymutex exited
    130 instead of ending by SIGINT: a shell stops only if its child died by it."""
    keymutex_line = " ".join(shlex.quote(word) for word in [*KEYMUTEX, "run", "--store", store])
    loop = f"for i in 1 2 3; do {keymutex_line} job -- sleep 5; echo round $i; done"
    shell = subprocess.Popen(
        ["bash", "-c", loop], env=env, start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + WAIT
    while holder_json("job", store, env) is None:
        assert time.monotonic() < deadline, "keymutex never held the key"
        time.sleep(0.05)
    os.killpg(shell.pid, signal.SIGINT)  # what a terminal does at Ctrl-C
    out, _ = shell.communicate(timeout=WAIT)
    assert shell.returncode == -signal.SIGINT
    assert out == ""
    assert holder_json("job", store, env) is None


@pytest.mark.parametrize(
    ("program", "key"),
    [
        pytest.param(["timeout", "60"], b"\x03", id="timeout-Ctrl-C"),
        pytest.param(["timeout", "60"], b"\x1c", id="timeout-Ctrl-backslash"),
        pytest.param(["setsid"], b"\x03", id="setsid-Ctrl-C"),
    ],
)
def test_ctrl_c_at_a_terminal_reaches_a_command_in_a_process_group_of_its_own(
    store: str, env: dict[str, str], program: list[str], key: bytes
) -> None:
    """Found by review: GNU timeout and setsid leave keymutex's process group, so the
    terminal's SIGINT (SIGQUIT) reached keymutex alone, which forwarded nothing: the
    command ran on holding the lock, and the terminal hung."""
    pid, terminal = pty.fork()
    if pid == 0:  # the child: keymutex, in a terminal of its own
        try:
            command = [*KEYMUTEX, "run", "--store", store, "job", "--", *program, "sleep", "60"]
            os.execve(command[0], command, env)
        finally:
            os._exit(127)
    try:
        deadline = time.monotonic() + WAIT
        while holder_json("job", store, env) is None:
            assert time.monotonic() < deadline, "keymutex never held the key"
            time.sleep(0.05)
        time.sleep(0.3)  # the command has left the group by now
        os.write(terminal, key)
        while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline + WAIT, "the command ran on after Ctrl-C"
            with contextlib.suppress(OSError):
                select.select([terminal], [], [], 0.05) and os.read(terminal, 4096)
        assert os.WIFSIGNALED(ended[1])
        assert holder_json("job", store, env) is None
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(terminal)


@pytest.mark.parametrize(
    ("sent", "trap", "expected"),
    [
        pytest.param("SIGTERM", ["--trap", "SIGTERM", "5"], 5, id="SIGTERM-handled"),
        pytest.param("SIGTERM", [], -signal.SIGTERM, id="SIGTERM-kills"),
        pytest.param("SIGINT", [], -signal.SIGINT, id="SIGINT-kills"),
        pytest.param("SIGHUP", ["--trap", "SIGHUP", "0"], 0, id="SIGHUP-handled"),
        pytest.param("SIGUSR1", ["--trap", "SIGUSR1", "9"], 9, id="SIGUSR1-handled"),
    ],
)
def test_signals_reach_the_command_and_the_lock_is_released(
    tmp_path: Path,
    store: str,
    child: list[str],
    env: dict[str, str],
    background: Any,
    sent: str,
    trap: list[str],
    expected: int,
) -> None:
    log, ready, go = tmp_path / "log", tmp_path / "ready", tmp_path / "go"
    holder = background(
        "run", "job", "--store", store, "--",
        *child, "--log", str(log), "C", *trap, "--ready", str(ready), "--wait", str(go),
    )  # fmt: skip
    wait_for_file(ready)
    os.kill(holder.pid, getattr(signal, sent))
    status, _, stderr = holder.finish()
    assert status == expected, stderr
    if trap:
        assert log.read_text().splitlines() == ["C start", f"got {sent}"]
    assert holder_json("job", store, env) is None


def test_a_signal_while_waiting_stops_the_wait_without_running_the_command(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str], background: Any
) -> None:
    ready, go, ran = tmp_path / "ready", tmp_path / "go", tmp_path / "ran"
    holder = background(
        "run", "job", "--store", store, "--", *child, "--ready", str(ready), "--wait", str(go)
    )
    wait_for_file(ready)
    waiter = background("run", "job", "--store", store, "--", *child, "--ready", str(ran))
    waiter.wait_for_stderr("waiting for")
    os.kill(waiter.pid, signal.SIGTERM)
    status, _, stderr = waiter.finish()
    assert status == -signal.SIGTERM  # ended by it, as the shell that waits must see
    assert "SIGTERM while waiting for 'job'" in stderr
    assert not ran.exists()
    go.touch()
    assert holder.finish()[0] == 0
    # The waiter left nothing behind: the key is free at once.
    keymutex("run", "job", "--store", store, "--timeout", "0", "--", "true", env=env)


def test_missing_command_exits_127_and_releases(store: str, env: dict[str, str]) -> None:
    result = keymutex(
        "run", "job", "--store", store, "--", "no-such-command-keymutex", env=env, check=127
    )
    assert "no-such-command-keymutex: command not found" in result.stderr
    assert holder_json("job", store, env) is None


def test_a_forgotten_key_is_pointed_out(store: str, env: dict[str, str]) -> None:
    """``keymutex run -- echo hi`` took 'echo' as the key and said only 'hi: command not
    found'; a key that names a program now gets a hint."""
    result = keymutex("run", "--store", store, "--", "echo", "hi", env=env, check=127)
    assert "keymutex: hi: command not found (KEY was 'echo', which is also a program" in (
        result.stderr
    )
    assert "keymutex run KEY -- echo hi" in result.stderr
    assert holder_json("echo", store, env) is None
    plain = keymutex("run", "job", "--store", store, "--", "hi-keymutex", env=env, check=127)
    assert plain.stderr.strip() == "keymutex: hi-keymutex: command not found"


def test_non_executable_command_exits_126_and_releases(
    tmp_path: Path, store: str, env: dict[str, str]
) -> None:
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    result = keymutex("run", "job", "--store", store, "--", str(script), env=env, check=126)
    assert "permission denied" in result.stderr
    assert holder_json("job", store, env) is None


@pytest.mark.parametrize(
    ("command", "status", "message"),
    [
        ("", 127, "keymutex: '': command not found (COMMAND is empty)"),
        ("dir-keymutex", 127, "keymutex: dir-keymutex: command not found"),
        ("{bin}/dir-keymutex", 126, "keymutex: {bin}/dir-keymutex: is a directory"),
        ("{bin}/missing", 127, "keymutex: {bin}/missing: no such file or directory"),
        ("text-keymutex", 126, "keymutex: {bin}/text-keymutex: permission denied"),
        (
            "{bin}/bad-interpreter",
            127,
            "keymutex: {bin}/bad-interpreter: cannot execute: required file not found"
            " (the interpreter on its #! line?)",
        ),
    ],
    ids=["empty", "dir-in-path", "dir", "missing-path", "not-executable", "bad-interpreter"],
)
def test_a_command_that_cannot_run_gets_a_shells_status_and_reason(
    tmp_path: Path, store: str, env: dict[str, str], command: str, status: int, message: str
) -> None:
    """Found by review: ``run job -- ""`` exited 126, "permission denied", where bash
    says "command not found", 127; so did a name that is a directory in PATH. A name
    looked up in PATH is found as a shell finds it (a file that exists and is not a
    directory): none is 127, one that cannot be executed 126. The message says what
    was wrong (bash 5.2's words: a missing #! interpreter is 127 too)."""
    bin_ = tmp_path / "bin"
    (bin_ / "dir-keymutex").mkdir(parents=True)
    (bin_ / "text-keymutex").write_text("echo not executable\n")
    (bin_ / "bad-interpreter").write_text("#!/nonexistent/keymutex-sh\n")
    (bin_ / "bad-interpreter").chmod(0o755)
    env = {**env, "PATH": f"{bin_}{os.pathsep}{env['PATH']}"}
    result = keymutex(
        "run", "job", "--store", store, "--", command.format(bin=bin_), env=env, check=status
    )
    assert result.stderr.strip() == message.format(bin=bin_)
    assert holder_json("job", store, env) is None


# -- run, after a review: scripts, signals ignored at start, a stuck release ----------


def wait_for_line(path: Path, line: str) -> None:
    deadline = time.monotonic() + WAIT
    while not (path.exists() and line in path.read_text().splitlines()):
        assert time.monotonic() < deadline, f"{line!r} never appeared in {path}"
        time.sleep(0.01)


def script_running(child: list[str], *args: str) -> list[str]:
    """COMMAND as a shell script whose own child does the work (the usual cron job):
    the shell waits for it, then has more to do."""
    return ["sh", "-c", f"{shlex.join([*child, *args])}; true"]


def test_a_lost_lease_stops_the_command_even_when_stderr_cannot_be_written(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str]
) -> None:
    """Found by review: with stderr on a full disk (or a pipe whose reader left), the
    warning before the SIGTERM failed, and the SIGTERM was never sent: the command ran
    on beside the next holder, and keymutex exited 74, not 70."""
    log, ready, go = tmp_path / "log", tmp_path / "ready", tmp_path / "go"
    args = [*child, "--log", str(log), "S", "--trap", "SIGTERM", "0"]
    with open("/dev/full", "w") as full:
        holder = subprocess.Popen(
            [*KEYMUTEX, "run", "job", "--store", store, "--ttl", "120", "--",
             *args, "--ready", str(ready), "--wait", str(go)],
            env=env, stderr=full, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for_file(ready)
        keymutex("release", "job", "--force", "--store", store, env=env)
        wait_for_line(log, "got SIGTERM")
        assert holder.wait(WAIT) == 70
    finally:
        go.touch()
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def _running_a_trapping_command(
    tmp_path: Path, store: str, child: list[str], background: Any
) -> tuple[Any, Path, Path]:
    """``run job`` (TTL 120 s: renewed every 40 s) of a command that logs a SIGTERM and
    waits for ``go``, started: (keymutex, the command's log, ``go``)."""
    log, ready, go = tmp_path / "log", tmp_path / "ready", tmp_path / "go"
    holder = background(
        "run", "job", "--store", store, "--ttl", "120", "--",
        *child, "--log", str(log), "C", "--trap", "SIGTERM", "0",
        "--ready", str(ready), "--wait", str(go),
    )  # fmt: skip
    wait_for_file(ready)
    return holder, log, go


def test_keymutex_killed_with_sigkill_takes_its_command_along(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str], background: Any
) -> None:
    """Found by review: ``keymutex run`` killed with SIGKILL (the OOM killer) could
    neither renew nor tell its command, which ran on past the TTL beside the next
    holder. The command now gets SIGTERM when keymutex dies (Linux: PR_SET_PDEATHSIG)."""
    holder, log, go = _running_a_trapping_command(tmp_path, store, child, background)
    try:
        os.kill(holder.pid, signal.SIGKILL)
        wait_for_line(log, "got SIGTERM")
    finally:
        go.touch()


def test_a_force_release_stops_the_command_within_seconds_not_at_the_next_renewal(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str], background: Any
) -> None:
    """Found by review: ``release --force`` frees the key at once, but ``run`` learnt
    of it only at its next renewal, TTL/3 later (here 40 s; 10 s by default): its
    command ran on that long beside the next holder. It now renews every second while
    its command runs."""
    holder, log, go = _running_a_trapping_command(tmp_path, store, child, background)
    try:
        released = time.monotonic()
        keymutex("release", "job", "--force", "--store", store, env=env)
        wait_for_line(log, "got SIGTERM")  # WAIT (20 s) is half the renewal interval
        stopped = time.monotonic() - released
        status, _, stderr = holder.finish()
        assert status == 70, stderr
        assert stopped < WAIT
    finally:
        go.touch()


@pytest.mark.parametrize("how", ["lost lease", "SIGTERM to keymutex"])
def test_the_work_of_a_script_is_stopped_not_only_its_shell(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str], background: Any, how: str
) -> None:
    """Before: SIGTERM went to the shell alone, which ended and left its job running
    (to init): after a lost lease the old holder's work overlapped the next holder's,
    and after a forwarded SIGTERM the lock was released under it."""
    log, ready, go = tmp_path / "log", tmp_path / "ready", tmp_path / "go"
    holder = background(
        "run", "job", "--store", store, "--ttl", "1.5", "--",
        *script_running(child, "--log", str(log), "W", "--trap", "SIGTERM", "0",
                        "--ready", str(ready), "--wait", str(go)),
    )  # fmt: skip
    try:
        wait_for_file(ready)
        if how == "lost lease":
            keymutex("release", "job", "--force", "--store", store, env=env)
        else:
            os.kill(holder.pid, signal.SIGTERM)
        status, _, stderr = holder.finish()
        wait_for_line(log, "got SIGTERM")  # the script's own child was told
        if how == "lost lease":
            assert status == 70, stderr
            assert "and the processes it started" in stderr
        else:
            assert status in (0, -signal.SIGTERM), stderr
    finally:
        go.touch()  # lets a child left running (the bug) end


def test_signals_ignored_at_start_stay_ignored(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str]
) -> None:
    """``nohup keymutex run …``: before, keymutex handled (and forwarded) SIGHUP anyway,
    and COMMAND, started with it no longer ignored, died of it (exit 129)."""
    log, ready, go = tmp_path / "log", tmp_path / "ready", tmp_path / "go"
    command = [*child, "--log", str(log), "C", "--ready", str(ready), "--wait", str(go)]
    process = subprocess.Popen(
        [*KEYMUTEX, "run", "job", "--store", store, "--", *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),  # as nohup does
    )
    try:
        wait_for_file(ready)
        os.kill(process.pid, signal.SIGHUP)
        go.touch()
        _, stderr = process.communicate(timeout=WAIT)
        assert process.returncode == 0, stderr
        assert log.read_text().splitlines() == ["C start", "C end"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=WAIT)


def test_a_key_that_begins_with_a_dash_follows_a_double_dash(
    store: str, env: dict[str, str]
) -> None:
    """Before: in ``run -- -KEY -- COMMAND`` the second -- was taken for COMMAND (127)."""
    result = keymutex(
        "run", "--store", store, "--", "-nightly", "--", "sh", "-c", 'echo "$KEYMUTEX_KEY"',
        env=env,
    )  # fmt: skip
    assert result.stdout == "-nightly\n"


def test_a_script_without_a_shebang_line_is_run_by_sh(
    tmp_path: Path, store: str, env: dict[str, str]
) -> None:
    """As a shell, env and flock run it; before: 126, 'Exec format error'."""
    script = tmp_path / "job"
    script.write_text('echo "ran under $KEYMUTEX_KEY: $1"\n')
    script.chmod(0o755)
    result = keymutex("run", "nightly", "--store", store, "--", str(script), "one", env=env)
    assert result.stdout == "ran under nightly: one\n"


@pytest.mark.parametrize(
    "content",
    [b"\x7fELF\x02\x01\x01" + bytes(9) + b"\x02\x00\xff\xff", b"MZ\x90\x00\x03\x00echo ran\n"],
    ids=["elf-for-another-machine", "nul-in-first-line"],
)
def test_a_binary_the_kernel_cannot_run_is_not_run_by_sh(
    content: bytes, tmp_path: Path, store: str, env: dict[str, str]
) -> None:
    """As bash: 126, "cannot execute binary file". Before: handed to /bin/sh, which
    printed the binary's bytes back as syntax errors (or ran what it could read)."""
    program = tmp_path / "tool"
    program.write_bytes(content)
    program.chmod(0o755)
    result = keymutex("run", "nightly", "--store", store, "--", str(program), env=env, check=126)
    assert f"{program}: cannot execute binary file: Exec format error" in result.stderr
    assert "ran" not in result.stdout
    assert keymutex("show", "nightly", "--store", store, env=env).stdout == "nightly is free\n"


def test_a_signal_after_the_command_ended_stops_a_release_that_hangs(
    tmp_path: Path, store: str, child: list[str], background: Any
) -> None:
    """Before: once COMMAND had ended, SIGTERM and SIGINT were ignored while the release
    waited for a busy store (about ten seconds here, then exit 0)."""
    log, ready, go = tmp_path / "log", tmp_path / "ready", tmp_path / "go"
    holder = background(
        "run", "job", "--store", store, "--",
        *child, "--log", str(log), "C", "--ready", str(ready), "--wait", str(go),
    )  # fmt: skip
    wait_for_file(ready)
    busy = sqlite3.connect(store.removeprefix("sqlite://"), isolation_level=None)
    try:
        busy.execute("BEGIN EXCLUSIVE")  # another process's long write: the store waits
        go.touch()
        wait_for_line(log, "C end")
        deadline = time.monotonic() + WAIT
        while holder.process.poll() is None:  # the first may come before COMMAND is reaped
            assert time.monotonic() < deadline, "keymutex never stopped"
            os.kill(holder.pid, signal.SIGTERM)
            time.sleep(0.2)
        status, _, stderr = holder.finish()
        assert status == -signal.SIGTERM, stderr
        assert "SIGTERM while releasing 'job'" in stderr
        assert "expires by its TTL" in stderr
    finally:
        busy.close()


def test_run_shows_others_its_info_and_can_hide_the_commands_arguments(
    store: str, env: dict[str, str]
) -> None:
    """What others see of a run: --info's fields with keymutex's own; with
    --hide-command, the program's name without the arguments (they may hold secrets)."""
    show = [*KEYMUTEX, "show", "job", "--store", store, "--json"]
    seen = json.loads(
        keymutex("run", "job", "--store", store, "--info", '{"job": "nightly"}', "--", *show, env=env).stdout
    )["info"]  # fmt: skip
    assert seen["job"] == "nightly"
    assert seen["cmd"] == shlex.join(show)
    assert {"host", "pid"} <= set(seen)
    seen = json.loads(
        keymutex("run", "job", "--store", store, "--hide-command", "--", *show, env=env).stdout
    )["info"]
    assert seen["cmd"] == Path(show[0]).name
    assert "--json" not in json.dumps(seen)


@pytest.mark.parametrize(
    ("argument", "shown"),
    [
        (os.fsdecode(b"caf\xe9.txt"), "caf\\xe9.txt"),  # a file name that is not UTF-8
        ("é" * 1000, "é" * 400),  # 2000 bytes: cut, by bytes, to fit info's 4 KiB
        ("\x01" * 2000, "\x01" * 100),  # 6 bytes each in JSON: cut by JSON bytes
    ],
    ids=["not-utf-8", "long-non-ascii", "control-characters"],
)
def test_run_shows_any_command_line_it_can_run(
    argument: str, shown: str, store: str, env: dict[str, str]
) -> None:
    """Refused before, blaming an --info nobody gave: a lone surrogate in the info, or
    over 4 KiB once 1024 *characters* of command line took 2 bytes each."""
    show = [*KEYMUTEX, "show", "job", "--store", store, "--json"]
    runs_show = [sys.executable, "-c", SKIP_ONE_ARGUMENT, argument, *show]
    seen = json.loads(keymutex("run", "job", "--store", store, "--", *runs_show, env=env).stdout)
    cmd = seen["info"]["cmd"]
    assert shown in cmd
    assert len(json.dumps(cmd, ensure_ascii=False).encode()) - 2 <= 1024


# -- ls, show, release ---------------------------------------------------------------


def test_ls_aligns_wide_characters_and_says_when_it_cannot_write(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str], background: Any
) -> None:
    """Found by review: a key of wide (CJK) characters pushed its row's columns right
    (padding counted characters, not columns); and ``ls > /dev/full`` ended in a
    traceback."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    holders = []
    for n, key in enumerate(["wide:日本語キー", "narrow:abcdefghijk"]):
        ready_n = str(ready.with_suffix(f".{n}"))
        args = ["run", key, "--store", store, "--", *child, "--ready", ready_n, "--wait", str(go)]
        holders.append(background(*args))
    for n in range(len(holders)):
        wait_for_file(ready.with_suffix(f".{n}"))
    table = keymutex("ls", "--store", store, env=env).stdout.splitlines()

    def columns(text: str) -> int:  # the test's own count: kana and CJK ideographs
        return sum(
            2 if "\u3040" <= c <= "\u30ff" or "\u4e00" <= c <= "\u9fff" else 1 for c in text
        )

    owner = f"{socket.gethostname()}:"
    owner_columns = {columns(line[: line.index(owner)]) for line in table[1:]}
    assert len(owner_columns) == 1, table
    with open("/dev/full", "w") as full:
        failed = subprocess.run(
            [*KEYMUTEX, "ls", "--store", store],
            env=env, stdout=full, stderr=subprocess.PIPE, text=True, timeout=WAIT, check=False,
        )  # fmt: skip
    assert failed.returncode == 74
    assert failed.stderr == "keymutex: cannot write output: No space left on device\n"
    go.touch()
    for holder in holders:
        assert holder.finish()[0] == 0


def test_output_into_a_closed_pipe_ends_quietly_with_1(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str], background: Any
) -> None:
    """As ``keymutex ls | head -1`` once ``head`` has gone: no traceback, no message,
    status 1 (README's table, found undocumented by review); ``release`` has released
    the key all the same."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    holder = background(
        "run", "job", "--store", store, "--", *child, "--ready", str(ready), "--wait", str(go)
    )
    wait_for_file(ready)
    for args in (["ls"], ["show", "job"], ["release", "job", "--force"]):
        reader, writer = os.pipe()
        os.close(reader)
        try:
            ended = subprocess.run(
                [*KEYMUTEX, *args, "--store", store],
                env=env, stdout=writer, stderr=subprocess.PIPE, text=True, timeout=WAIT,
                check=False,
            )  # fmt: skip
        finally:
            os.close(writer)
        assert (ended.returncode, ended.stderr) == (1, ""), args
    assert keymutex("show", "job", "--store", store, env=env).stdout == "job is free\n"
    go.touch()
    holder.finish()


def test_ls_show_and_release_force(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str], background: Any
) -> None:
    ready, log, go = tmp_path / "ready", tmp_path / "log", tmp_path / "go"
    holder = background(
        "run", "deploy:web", "--store", store, "--ttl", "1.5", "--",
        *child, "--log", str(log), "D", "--trap", "SIGTERM", "0",
        "--ready", str(ready), "--wait", str(go),
    )  # fmt: skip
    wait_for_file(ready)
    owner = f"{socket.gethostname()}:{holder.pid}"

    listed = json.loads(keymutex("ls", "--store", store, "--json", env=env).stdout)
    assert [entry["key"] for entry in listed] == ["deploy:web"]
    entry = listed[0]
    assert set(entry) == {"key", "owner", "info", "fence", "acquired_at", "expires_at"}
    assert entry["owner"] == owner
    assert entry["info"]["pid"] == holder.pid
    assert entry["info"]["host"] == socket.gethostname()
    assert entry["info"]["cmd"].startswith(sys.executable)
    assert entry["acquired_at"] <= time.time() < entry["expires_at"]
    assert json.loads(keymutex("ls", "deploy:", "--store", store, "--json", env=env).stdout)
    assert json.loads(keymutex("ls", "other", "--store", store, "--json", env=env).stdout) == []

    table = keymutex("ls", "--store", store, env=env).stdout.splitlines()
    assert table[0].split() == ["KEY", "OWNER", "FENCE", "HELD", "FOR", "EXPIRES", "IN", "INFO"]
    assert table[1].split()[:3] == ["deploy:web", owner, str(entry["fence"])]
    assert (
        "no locks are held under prefix 'other'"
        in keymutex("ls", "other", "--store", store, env=env).stdout
    )

    def without_expiry(holder: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in holder.items() if k != "expires_at"}  # renewals move it

    assert without_expiry(holder_json("deploy:web", store, env)) == without_expiry(entry)
    shown = keymutex("show", "deploy:web", "--store", store, env=env).stdout
    assert f"owner:    {owner}" in shown
    assert f"fence:    {entry['fence']}" in shown

    refused = keymutex("release", "deploy:web", "--store", store, env=env, check=2)
    assert "without --force" in refused.stderr
    assert without_expiry(holder_json("deploy:web", store, env)) == without_expiry(entry)

    released = keymutex("release", "deploy:web", "--force", "--store", store, env=env)
    assert f"displaced {owner}" in released.stdout
    assert f"fence {entry['fence']}" in released.stdout
    assert holder_json("deploy:web", store, env) is None

    # The displaced run finds out at its next renewal: it stops its command and exits 70.
    status, _, stderr = holder.finish()
    assert status == 70, stderr
    assert "lost the lock on 'deploy:web'" in stderr
    assert log.read_text().splitlines() == ["D start", "got SIGTERM"]

    # The next holder's fence is above both the displaced one and the takeover.
    seen = tmp_path / "env.json"
    keymutex("run", "deploy:web", "--store", store, "--", *child, "--env", str(seen), env=env)
    assert int(json.loads(seen.read_text())["KEYMUTEX_FENCE"]) > entry["fence"] + 1


def test_show_and_release_a_free_key(store: str, env: dict[str, str]) -> None:
    keymutex("run", "other", "--store", store, "--", sys.executable, "-c", "pass", env=env)
    assert keymutex("show", "free", "--store", store, env=env).stdout == "free is free\n"
    assert keymutex("show", "free", "--store", store, "--json", env=env).stdout == "null\n"
    released = keymutex("release", "free", "--force", "--store", store, env=env)
    assert "free is free" in released.stdout
    assert keymutex("ls", "--store", store, env=env).stdout == "no locks are held\n"
    assert keymutex("ls", "--store", store, "--json", env=env).stdout == "[]\n"


def test_looking_at_a_sqlite_store_that_does_not_exist_creates_nothing(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """Before: ``ls``, ``show`` and ``release --force`` on a mistyped path created an
    empty database there and said nothing is held, as if it were the store in use."""
    store = f"sqlite://{tmp_path}/mistyped.db"
    note = f"no SQLite database at '{tmp_path}/mistyped.db'"
    listed = keymutex("ls", "--store", store, env=env)
    assert (listed.stdout, note in listed.stderr) == ("no locks are held\n", True)
    shown = keymutex("show", "k", "--store", store, "--json", env=env)
    assert (shown.stdout, note in shown.stderr) == ("null\n", True)
    released = keymutex("release", "k", "--force", "--store", store, env=env)
    assert (released.stdout, note in released.stderr) == ("k is free; nothing to release\n", True)
    assert list(tmp_path.iterdir()) == []
    # The first lock taken there makes it; then nothing is noted.
    keymutex("run", "k", "--store", store, "--", sys.executable, "-c", "pass", env=env)
    assert keymutex("ls", "--store", store, env=env).stderr == ""


def test_looking_at_the_default_store_of_a_new_user_creates_nothing(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """Before: a new user's first ``ls``, ``show`` or ``release --force`` made the
    default store's directory (in the user's data directory) to look into it."""
    data = tmp_path / "xdg-data"
    note = f"no SQLite database at '{data}/keymutex/locks.db'"
    listed = keymutex("ls", env=env)
    assert (listed.stdout, note in listed.stderr) == ("no locks are held\n", True)
    shown = keymutex("show", "k", "--json", env=env)
    assert (shown.stdout, note in shown.stderr) == ("null\n", True)
    released = keymutex("release", "k", "--force", env=env)
    assert (released.stdout, note in released.stderr) == ("k is free; nothing to release\n", True)
    assert not data.exists()
    keymutex("run", "k", "--", sys.executable, "-c", "pass", env=env)
    assert (data / "keymutex" / "locks.db").exists()
    assert keymutex("ls", env=env).stderr == ""


def test_a_sqlite_file_out_of_reach_is_not_taken_for_a_missing_one(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """A database the caller cannot stat (here a symlink loop; a directory it may not
    enter alike) was said to hold nothing, exit 0: it is the store's error, exit 69."""
    (tmp_path / "locks.db").symlink_to(tmp_path / "locks.db")
    store = f"sqlite://{tmp_path}/locks.db"
    for command in (["ls"], ["show", "k"], ["release", "k", "--force"]):
        result = keymutex(*command, "--store", store, env=env, check=69)
        assert "no SQLite database" not in result.stderr
        assert result.stderr.startswith(f"keymutex: store {store} failed:"), result.stderr


@pytest.mark.parametrize("command", [["ls"], ["show", "k"], ["release", "k", "--force"]])
@pytest.mark.parametrize("url", ["memory://", "memory://shared"])
def test_a_memory_store_is_refused_where_it_could_only_mislead(
    command: list[str], url: str, env: dict[str, str]
) -> None:
    """A memory store lives in one process: a new keymutex process always found it
    empty, said nobody holds anything, and its run held a lock nobody else saw."""
    result = keymutex(*command, "--store", url, env=env, check=2)
    assert f"{url!r} lives inside one process" in result.stderr
    run = keymutex(
        "run", "k", "--store", url, "--", sys.executable, "-c", "pass", env=env, check=2
    )
    assert "lives inside one process" in run.stderr


def test_release_force_shows_an_odd_key_escaped_on_every_line(
    store: str, env: dict[str, str]
) -> None:
    key = "evil\x1b[31m\nforged line"
    with keymutex_lib.Locks(store) as locks:
        locks.acquire(key, ttl=30)
    released = keymutex("release", key, "--force", "--store", store, env=env).stdout
    assert not any(line.startswith("forged") for line in released.splitlines()), released
    assert "\x1b" not in released
    assert released.count("evil\\x1b[31m\\nforged line") == 2, released


def test_release_force_on_a_lock_server_is_its_logged_admin_force_release(
    tmp_path: Path, env: dict[str, str]
) -> None:
    writer, admin = "w" * 40, "a" * 40
    tokens = [
        {"name": "app", "token": writer, "grants": [{"namespace": "*", "prefix": "", "allow": ["lock", "read"]}]},
        {"name": "ops", "token": admin, "grants": [{"namespace": "*", "prefix": "", "allow": ["lock", "read", "admin"]}]},
    ]  # fmt: skip
    with serve(tmp_path, tokens=tokens) as server:
        with keymutex_lib.Locks(server.url, api_token=writer) as locks:
            lease = locks.acquire("deploy:web", ttl=60, info={"job": "deploy"})
            before = locks.holder("deploy:web")
            assert before is not None

            # Without the admin permission the server refuses, and the lease stays.
            refused = keymutex(
                "release", "deploy:web", "--force", "--store", server.url,
                env={**env, "KEYMUTEX_API_TOKEN": writer}, check=69,
            )  # fmt: skip
            assert "403 forbidden" in refused.stderr
            assert lease.renew()

            released = keymutex(
                "release", "deploy:web", "--force", "--reason", "stuck deploy",
                "--store", server.url, env={**env, "KEYMUTEX_API_TOKEN": admin},
            ).stdout  # fmt: skip
            assert f"displaced {before.owner}" in released
            assert f"fence {lease.fence}" in released
            assert locks.holder("deploy:web") is None
            with pytest.raises(keymutex_lib.LockLost):
                lease.renew()

            # Without --reason the server logs who ran the command, and where.
            locks.acquire("deploy:api", ttl=60)
            keymutex(
                "release", "deploy:api", "--force", "--store", server.url,
                env={**env, "KEYMUTEX_API_TOKEN": admin},
            )  # fmt: skip
        log = server.output()
    assert "force-release of 'deploy:web' in namespace '' by ops, reason 'stuck deploy'" in log
    assert f"by ops, reason 'keymutex release --force by {getpass.getuser()} on " in log
    assert writer not in log
    assert admin not in log


# -- the default store ---------------------------------------------------------------


def test_store_defaults_to_keymutex_store_variable(
    tmp_path: Path, store: str, child: list[str], env: dict[str, str], background: Any
) -> None:
    ready, go = tmp_path / "ready", tmp_path / "go"
    env["KEYMUTEX_STORE"] = store
    holder = background("run", "job", "--", *child, "--ready", str(ready), "--wait", str(go))
    wait_for_file(ready)
    assert holder_json("job", store, env)["owner"].endswith(f":{holder.pid}")
    assert json.loads(keymutex("show", "job", "--json", env=env).stdout) is not None
    go.touch()
    assert holder.finish()[0] == 0
    assert not (tmp_path / "xdg-data").exists()  # the user's data directory was not used


def test_store_defaults_to_the_user_data_directory(tmp_path: Path, env: dict[str, str]) -> None:
    keymutex("run", "job", "--", sys.executable, "-c", "pass", env=env)
    assert (tmp_path / "xdg-data" / "keymutex" / "locks.db").exists()
    assert keymutex("show", "job", env=env).stdout == "job is free\n"


# -- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "k", "--ttl", "0", "--", "true"], "ttl must be greater than 0"),
        (["run", "k", "--ttl", "-1", "--", "true"], "ttl must be greater than 0"),
        (["run", "k", "--ttl", "nan", "--", "true"], "not 'nan'"),
        (["run", "k", "--ttl", "inf", "--", "true"], "ttl must be greater than 0"),
        (["run", "k", "--ttl", "soon", "--", "true"], "'soon' is not a number of seconds"),
        (["run", "k", "--timeout", "-1", "--", "true"], "timeout must be left out (wait forever)"),
        (
            ["run", "k", "--timeout", "inf", "--", "true"],
            "timeout must be left out (wait forever)",
        ),
        (["run", "k", "--timeout", "nan", "--", "true"], "not 'nan'"),
        (["run", "", "--", "true"], "key must not be empty"),
        (["run", "k" * 1025, "--", "true"], "at most 1024 are accepted"),
        (["run", "k"], "Missing argument"),
        (["show", ""], "key must not be empty"),
        (["release", "", "--force"], "key must not be empty"),
        (["release", "k"], "refusing to release 'k' without --force"),
        (["ls", "--store", "nosuch://x"], "unknown store URL scheme 'nosuch'"),
        (["show", "k", "--store", "not a url"], "does not parse as a store URL"),
        (["ls", "--namespace", "n" * 300], "namespace is 300 bytes"),
        (["frobnicate"], "No such command"),
    ],
)
def test_bad_input_is_a_usage_error(args: list[str], message: str, env: dict[str, str]) -> None:
    result = keymutex(*args, env=env, check=2)
    assert message in result.stderr
    assert "Usage:" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["run", "k", "--ttl", "0"],
            "ttl must be greater than 0 and at most 315360000 s, not '0'",
        ),
        (["run", "k", "--ttl", "1e400"], "at most 315360000 s, not '1e400'"),
        (["run", "k", "--ttl=-1"], "at most 315360000 s, not '-1'"),
        (["run", "k", "--ttl", "0.0005"], "ttl must be at least 0.001 s (1 ms), not '0.0005'"),
        (
            ["run", "k", "--ttl", "100000", "--store", "http://127.0.0.1:9"],
            "ttl must be greater than 0 and at most 86400 s, not '100000'",
        ),
        (["run", "k", "--timeout", "1e400"], "finite seconds > 0, not '1e400'"),
        (["run", "k", "--timeout=-1"], "finite seconds > 0, not '-1'"),
        (["serve", "--port", "70000"], "'70000' is not in the range 0<=x<=65535."),
        (["serve", "--port", "http"], "'http' is not a whole number."),
        # found by review: what was typed read " is not in the range " itself
        (
            ["serve", "--port", "1 is not in the range 2"],
            "'1 is not in the range 2' is not a whole number.",
        ),
        (
            ["serve", "--request-timeout", "x is not in the range y"],
            "'x is not in the range y' is not a number of seconds.",
        ),
        (["serve", "--request-timeout", "0"], "'0' is not in the range 0.1<=x<=3600."),
        (["serve", "--request-timeout", "1e400"], "'1e400' is not in the range 0.1<=x<=3600."),
        (["serve", "--request-timeout", "soon"], "'soon' is not a number of seconds."),
        (["serve", "--max-namespaces", "0"], "'0' is not in the range x>=1."),
    ],
)
def test_a_number_refused_is_quoted_as_it_was_typed(
    args: list[str], message: str, env: dict[str, str]
) -> None:
    """Found by a new user's walk-through: ``--ttl 0`` said "not 0.0" and ``--ttl 1e400``
    "not inf", and ``serve --request-timeout 0`` "0.0 is not in the range": not what
    was typed. Every numeric option of every subcommand quotes it."""
    if args[0] == "run":
        args = [*args, "--", "true"]
    result = keymutex(*args, env=env, check=2)
    assert message in result.stderr, result.stderr


def test_an_unknown_option_where_key_goes_says_how_to_give_a_key_beginning_with_a_dash(
    store: str, env: dict[str, str]
) -> None:
    """Found by a new user's walk-through: ``run -k -- true`` said only "No such option
    '-k'". The form it names works; an unknown option after KEY, or one like a known
    option, gets no such hint."""
    refused = keymutex("run", "-k", "--store", store, "--", "true", env=env, check=2)
    assert "No such option '-k'." in refused.stderr
    assert "A KEY that begins with - follows --: keymutex run -- -k -- COMMAND" in refused.stderr
    keymutex("run", "--store", store, "--", "-k", "--", sys.executable, "-c", "pass", env=env)
    after_key = keymutex("run", "k", "--wait", "5", "--", "true", env=env, check=2)
    assert "No such option '--wait'" in after_key.stderr
    assert "begins with -" not in after_key.stderr
    # A typo of an option is not a key (found by review: it was told to lock "--tll").
    typo = keymutex("run", "--tll", "5", "k", "--", "true", env=env, check=2)
    assert "Did you mean '--ttl'?" in typo.stderr
    assert "begins with -" not in typo.stderr


def test_show_has_no_info_line_when_the_holder_has_no_info(
    store: str, env: dict[str, str]
) -> None:
    """Found by a new user's walk-through: a bare "info:" line."""
    with keymutex_lib.Locks(store) as locks:
        locks.acquire("bare", ttl=30)
        locks.acquire("described", ttl=30, info={"job": "nightly"})
        bare = keymutex("show", "bare", "--store", store, env=env).stdout.splitlines()
        assert [line.split(":")[0] for line in bare] == [
            "key", "owner", "fence", "acquired", "expires"
        ]  # fmt: skip
        described = keymutex("show", "described", "--store", store, env=env).stdout
        assert 'info:     {"job":"nightly"}' in described.splitlines()


def test_key_that_is_not_valid_utf8_is_a_usage_error(env: dict[str, str]) -> None:
    result = subprocess.run(
        [*KEYMUTEX, "show", os.fsdecode(b"\xff")], env=env, capture_output=True, timeout=WAIT
    )
    assert result.returncode == 2
    assert b"lone surrogate" in result.stderr
    assert b"Traceback" not in result.stderr


def test_bad_store_from_the_environment_says_where_it_came_from(env: dict[str, str]) -> None:
    env["KEYMUTEX_STORE"] = "nosuch://x"
    result = keymutex("ls", env=env, check=2)
    assert "'--store' (from $KEYMUTEX_STORE)" in result.stderr


def test_a_bad_api_token_in_the_environment_is_not_blamed_on_the_store(
    env: dict[str, str],
) -> None:
    """Found by review: it was "Invalid value for '--store'"."""
    env["KEYMUTEX_API_TOKEN"] = "a token with spaces, pasted from a chat"
    result = keymutex("ls", "--store", "http://127.0.0.1:1", env=env, check=2)
    assert "$KEYMUTEX_API_TOKEN must be the API token" in result.stderr
    assert "--store" not in result.stderr


@pytest.mark.parametrize(
    "args", [["ls"], ["show", "k"], ["release", "k", "--force"], ["run", "k", "--", "true"]]
)
def test_a_lock_server_that_refuses_connections_is_said_once_and_alike(
    tmp_path: Path, env: dict[str, str], args: list[str]
) -> None:
    """Found by a new user's walk-through: "store URL failed: lock server URL failed:
    [Errno 111] Connection refused", and from ``run`` (the async client) "All
    connection attempts failed": one situation, two wordings, the store named twice.
    Here a server that was just stopped, at the address it served."""
    with serve(tmp_path) as server:
        url = server.url
    result = keymutex(args[0], "--store", url, *args[1:], env=env, check=69)
    assert result.stderr == f"keymutex: lock server {url} failed: [Errno 111] Connection refused\n"


def test_unreachable_store_exits_69(tmp_path: Path, env: dict[str, str]) -> None:
    missing = f"sqlite://{tmp_path}/no/such/dir/locks.db"
    result = keymutex("ls", "--store", missing, env=env, check=69)
    assert result.stderr.startswith(f"keymutex: store {missing} failed:")
    keymutex("run", "k", "--store", missing, "--", "true", env=env, check=69)


def test_version_and_help(env: dict[str, str]) -> None:
    import keymutex as package

    assert package.__version__ in keymutex("--version", env=env).stdout
    assert "release" in keymutex("--help", env=env).stdout
    help_text = keymutex("run", "--help", env=env).stdout
    assert "KEYMUTEX_FENCE" in help_text
    assert "Lost lease" in help_text


# -- found by review: what is not the lock server, and output that cannot be written -----


class _Gateway(http.server.BaseHTTPRequestHandler):
    """An API gateway in front of nothing: 400 with a JSON body of its own."""

    def _answer(self) -> None:
        body = b'{"message": "Bad Request"}'
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    "args", [["ls"], ["show", "k"], ["release", "k", "--force"], ["run", "k", "--", "true"]]
)
def test_a_400_from_something_else_than_the_lock_server_is_one_line_and_69(
    env: dict[str, str], args: list[str]
) -> None:
    """Found by review: a JSON 400 (an API gateway, a proxy) became ValueError: a
    traceback and exit 1, on every subcommand."""
    gateway = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{gateway.server_address[1]}"
        result = keymutex(args[0], "--store", url, *args[1:], env=env, check=69)
        assert result.stderr.count("\n") == 1
        assert "answered" in result.stderr
        assert "Bad Request" in result.stderr
    finally:
        gateway.shutdown()
        gateway.server_close()


def test_a_closed_stdout_is_exit_74_not_silence(store: str, env: dict[str, str]) -> None:
    """Found by review: `keymutex ls >&-` showed nothing and exited 0."""
    keymutex("run", "k", "--store", store, "--", "true", env=env)
    closed = subprocess.run(
        [*KEYMUTEX, "ls", "--store", store], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, timeout=WAIT, check=False,
        preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert closed.returncode == 74, closed.stderr
    assert "standard output is closed" in closed.stderr


def test_serve_refuses_a_request_timeout_that_is_not_a_number(env: dict[str, str]) -> None:
    """Found by review: --request-timeout nan passed the range check, and the server
    answered 400 to every request."""
    result = keymutex("serve", "--port", "0", "--request-timeout", "nan", env=env, check=2)
    assert "--request-timeout" in result.stderr


def test_permission_denied_names_the_file_that_may_not_be_executed(
    tmp_path: Path, store: str, env: dict[str, str]
) -> None:
    """Python's PATH search reports the first error other than "not found": here the
    second file's, which may not be executed. keymutex named the first file found, an
    executable one (whose #! interpreter is missing), as the one denied."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "tool-keymutex").write_text("#!/nonexistent/keymutex-sh\n")
    (first / "tool-keymutex").chmod(0o755)
    (second / "tool-keymutex").write_text("echo not executable\n")
    env = {**env, "PATH": os.pathsep.join([str(first), str(second), env["PATH"]])}
    result = keymutex("run", "job", "--store", store, "--", "tool-keymutex", env=env, check=126)
    assert result.stderr.strip() == f"keymutex: {second}/tool-keymutex: permission denied"

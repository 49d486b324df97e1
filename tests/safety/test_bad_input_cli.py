"""Bad-input catalogue, command line: ``keymutex run / ls / show / release``, table-driven.

Each row is one command line, run for real (``python -m keymutex`` in a subprocess, as
``tests/e2e/test_cli.py`` does), and what ``src/keymutex/cli.py`` documents for it: the
exit status (2 for bad usage or arguments, "nothing touched the store"), and a message
on stderr that names the argument (click's ``Invalid value for 'KEY'`` …) and says what
is accepted (the library's own message). No row may print a traceback. After each
refusal the store must be as it was: a bystander lease is held throughout, and the
holders and the fence of a probe acquire (through the Python API, from this process)
are compared before and after, as in ``test_bad_input.py``. For ``run``, the COMMAND
creates a file: it must never have run.

A NUL cannot be passed in an argument (the OS refuses it before keymutex runs); a key
that is not UTF-8 reaches keymutex as lone surrogates (PEP 383), which is what the
``surrogate`` rows send. Rows marked ``xfail(strict=True)`` are bugs in ``src/`` that
the catalogue found (see the reasons). The tables are kept one row per line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import keymutex

KEYMUTEX = [sys.executable, "-m", "keymutex"]
WAIT = 30.0
KEY = "doc"
HELD = "held"
BYSTANDER_TTL = 20.0
EXPIRY_SLACK = 1.0
USAGE = 2

# -- bugs found by this catalogue: rows marked xfail(strict=True), with the reason (none ----
# open today: the findings of the first run are fixed) ----------------------------------


def _xfail(reason: str | None) -> list[pytest.MarkDecorator]:
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


# -- rows ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cli:
    """One command line and what it must give.

    In ``args``, ``{store}`` is the bystander's store, ``{tmp}`` the test's directory, and
    the argument ``{child}`` expands to a COMMAND that creates a file when it runs.
    """

    args: tuple[str | bytes, ...]
    status: int
    fragments: tuple[str, ...]
    stream: str = "stderr"
    env: dict[str, str] = field(default_factory=dict)
    setup: str | None = None  # "surrogate-info", "newline-key", "escapes": a lease to show
    usage: bool = True  # a usage error shows the usage line (not for option syntax)


def cli(
    case_id: str,
    args: list[str | bytes],
    *fragments: str,
    status: int = USAGE,
    stream: str = "stderr",
    env: dict[str, str] | None = None,
    setup: str | None = None,
    usage: bool = True,
    xfail: str | None = None,
) -> Any:
    return pytest.param(
        Cli(tuple(args), status, fragments, stream, env or {}, setup, usage),
        id=case_id,
        marks=_xfail(xfail),
    )


S = "{store}"
CHILD = "{child}"
INVALID_KEY = "Error: Invalid value for 'KEY': "
LONE = "must be valid Unicode text; it contains a lone surrogate"
NOT_UTF8 = " (the argument's bytes are not UTF-8 text)"
UNKNOWN_SCHEME = "Error: Invalid value for '--store': unknown store URL scheme 'nosuch'; known schemes: etcd, etcds, http"  # fmt: skip

# fmt: off
ROWS = [
    # run: KEY
    cli("run-key-empty", ["run", "", "--store", S, "--", CHILD], INVALID_KEY + "key must not be empty"),
    cli("run-key-1025-bytes", ["run", "k" * 1025, "--store", S, "--", CHILD], INVALID_KEY + "key is 1025 bytes as UTF-8; at most 1024 are accepted"),
    cli("run-key-huge", ["run", "k" * 100_000, "--store", S, "--", CHILD], INVALID_KEY + "key is 100000 bytes as UTF-8; at most 1024 are accepted"),
    cli("run-key-surrogate", ["run", b"doc\xff", "--store", S, "--", CHILD], INVALID_KEY + "key " + LONE + NOT_UTF8),
    cli("run-key-missing", ["run", "--store", S], "Error: Missing argument 'KEY'."),
    cli("run-command-missing", ["run", KEY, "--store", S], "Error: Missing argument '-- COMMAND [ARG]...'."),
    cli("run-command-empty", ["run", KEY, "--store", S, "--"], "Error: Missing argument '-- COMMAND [ARG]...'."),
    cli("run-unknown-option", ["run", KEY, "--wait", "5", "--store", S, "--", CHILD], "Error: No such option '--wait'"),
    # run: --ttl
    cli("run-ttl-zero", ["run", KEY, "--ttl", "0", "--store", S, "--", CHILD], "Error: Invalid value for '--ttl': ttl must be greater than 0 and at most 315360000 s, not '0'"),
    cli("run-ttl-negative", ["run", KEY, "--ttl=-1", "--store", S, "--", CHILD], "Error: Invalid value for '--ttl': ttl must be greater than 0 and at most 315360000 s, not '-1'"),
    cli("run-ttl-nan", ["run", KEY, "--ttl", "nan", "--store", S, "--", CHILD], "Error: Invalid value for '--ttl': ttl must be a number of seconds, not 'nan'"),
    cli("run-ttl-inf", ["run", KEY, "--ttl", "inf", "--store", S, "--", CHILD], "Error: Invalid value for '--ttl': ttl must be greater than 0 and at most 315360000 s, not 'inf'"),
    cli("run-ttl-1e999", ["run", KEY, "--ttl", "1e999", "--store", S, "--", CHILD], "Error: Invalid value for '--ttl': ttl must be greater than 0 and at most 315360000 s, not '1e999'"),
    cli("run-ttl-word", ["run", KEY, "--ttl", "soon", "--store", S, "--", CHILD], "Error: Invalid value for '--ttl': 'soon' is not a number of seconds"),
    cli("run-ttl-empty", ["run", KEY, "--ttl", "", "--store", S, "--", CHILD], "Error: Invalid value for '--ttl': '' is not a number of seconds"),
    cli("run-ttl-true", ["run", KEY, "--ttl", "true", "--store", S, "--", CHILD], "Error: Invalid value for '--ttl': 'true' is not a number of seconds"),
    cli("run-ttl-missing-value", ["run", KEY, "--store", S, "--ttl"], "Error: Option '--ttl' requires an argument.", usage=False),
    cli("run-ttl-below-clock-resolution", ["run", KEY, "--ttl", "1e-300", "--store", S, "--", CHILD], "Error: Invalid value for '--ttl': ttl must be at least 0.001 s (1 ms), not '1e-300'"),
    cli("run-ttl-above-the-lock-servers-day", ["run", KEY, "--ttl", "100000", "--store", "http://127.0.0.1:9", "--", CHILD], "Error: Invalid value for '--ttl': ttl must be greater than 0 and at most 86400 s, not '100000'"),
    cli("run-ttl-below-a-millisecond", ["run", KEY, "--ttl", "0.0005", "--store", S, "--", CHILD], "Error: Invalid value for '--ttl': ttl must be at least 0.001 s (1 ms), not '0.0005'"),
    cli("run-info-not-json", ["run", KEY, "--info", "job=nightly", "--store", S, "--", CHILD], "Error: Invalid value for '--info': 'job=nightly' is not a JSON object: Expecting value: line 1 column 1 (char 0)"),
    cli("run-info-not-an-object", ["run", KEY, "--info", "[1]", "--store", S, "--", CHILD], "Error: Invalid value for '--info': '[1]' is not a JSON object ({\"name\": value, ...})"),
    cli("run-info-nan", ["run", KEY, "--info", '{"a": NaN}', "--store", S, "--", CHILD], "Error: Invalid value for '--info': '{\"a\": NaN}' is not a JSON object: NaN is not JSON"),
    cli("run-info-keymutex-field", ["run", KEY, "--info", '{"pid": 1, "cmd": "x"}', "--store", S, "--", CHILD], "Error: Invalid value for '--info': cmd, pid: keymutex sets these fields of the info itself (cmd, host, pid, user)"),
    cli("run-info-too-big", ["run", KEY, "--info", '{"a": "' + "x" * 5000 + '"}', "--store", S, "--", CHILD], "Error: Invalid value for '--info': info is"),
    # run: --timeout
    cli("run-timeout-negative", ["run", KEY, "--timeout=-1", "--store", S, "--", CHILD], "Error: Invalid value for '--timeout': timeout must be left out (wait forever), 0 (try once) or finite seconds > 0, not '-1'"),
    cli("run-timeout-nan", ["run", KEY, "--timeout", "nan", "--store", S, "--", CHILD], "Error: Invalid value for '--timeout': timeout must be a number of seconds, not 'nan'"),
    cli("run-timeout-inf", ["run", KEY, "--timeout", "inf", "--store", S, "--", CHILD], "Error: Invalid value for '--timeout': timeout must be left out (wait forever), 0 (try once) or finite seconds > 0, not 'inf'"),
    cli("run-timeout-word", ["run", KEY, "--timeout", "never", "--store", S, "--", CHILD], "Error: Invalid value for '--timeout': 'never' is not a number of seconds"),
    # run: --store and --namespace
    cli("run-store-unknown-scheme", ["run", KEY, "--store", "nosuch://x", "--", CHILD], UNKNOWN_SCHEME),
    cli("run-store-from-environment", ["run", KEY, "--", CHILD], "Error: Invalid value for '--store' (from $KEYMUTEX_STORE): unknown store URL scheme 'nosuch'", env={"KEYMUTEX_STORE": "nosuch://x"}),
    cli("run-store-not-a-url", ["run", KEY, "--store", "not a url", "--", CHILD], "Error: Invalid value for '--store': url 'not a url' does not parse as a store URL"),
    cli("run-store-sqlite-no-file", ["run", KEY, "--store", "sqlite://", "--", CHILD], "Error: Invalid value for '--store': SQLite URL 'sqlite://' names no file: use sqlite:///path/to/locks.db"),
    cli("run-store-sqlite-bad-option", ["run", KEY, "--store", "sqlite:///{tmp}/other.db?synchronous=off", "--", CHILD], "Error: Invalid value for '--store': synchronous must be 'normal' or 'full', not 'off'"),
    cli("run-store-http-bad-port", ["run", KEY, "--store", "http://127.0.0.1:99999", "--", CHILD], "Error: Invalid value for '--store': Port out of range 0-65535 (lock server URL 'http://127.0.0.1:99999')"),
    cli("run-store-redis-unknown-query", ["run", KEY, "--store", "redis://127.0.0.1:9/0?colour=blue", "--", CHILD], "Error: Invalid value for '--store': 'redis://127.0.0.1:9/0?colour=blue' is not a Redis URL: unknown query option(s) ['colour']"),
    cli("run-store-sqlite-path-not-utf8", ["run", KEY, "--store", "sqlite:///{tmp}/a%FF.db", "--", CHILD], "Error: Invalid value for '--store': SQLite URL", "the path's percent-escapes (such as %FF) must encode UTF-8"),
    cli("run-namespace-300-bytes", ["run", KEY, "--namespace", "n" * 300, "--store", S, "--", CHILD], "Error: Invalid value for '--namespace': namespace is 300 bytes as UTF-8; at most 256 are accepted"),
    cli("run-namespace-surrogate", ["run", KEY, "--namespace", b"n\xff", "--store", S, "--", CHILD], "Error: Invalid value for '--namespace': namespace " + LONE),
    # ls
    cli("ls-prefix-1025-bytes", ["ls", "p" * 1025, "--store", S], "Error: Invalid value for '[PREFIX]': prefix is 1025 bytes as UTF-8; at most 1024 are accepted"),
    cli("ls-prefix-surrogate", ["ls", b"d\xff", "--store", S], "Error: Invalid value for '[PREFIX]': prefix " + LONE),
    cli("ls-extra-argument", ["ls", "a", "b", "--store", S], "Error: Got unexpected extra argument (b)"),
    cli("ls-unknown-option", ["ls", "--all", "--store", S], "Error: No such option '--all'"),
    cli("ls-store-unknown-scheme", ["ls", "--store", "nosuch://x"], UNKNOWN_SCHEME),
    cli("ls-store-bad-ipv6", ["ls", "--store", "redis://[::1"], "Error: Invalid value for '--store': 'redis://[::1' is not a Redis URL (redis://host:port/db, rediss://…, unix://…, redis+cluster://…, redis+sentinel://…): Invalid IPv6 URL"),
    cli("ls-store-password-hidden", ["ls", "--store", "redis://me:s3cret@localhost:abc"], "Error: Invalid value for '--store': 'redis://me:***@localhost:abc' is not a Redis URL"),
    cli("ls-store-memory-path", ["ls", "--store", "memory:///x"], "Error: Invalid value for '--store': memory URLs are memory:// or memory://NAME, not 'memory:///x'"),
    cli("ls-store-memory", ["ls", "--store", "memory://"], "Error: Invalid value for '--store': 'memory://' lives inside one process: this keymutex command would see none of the locks your programs hold there, nor hold any against them."),
    cli("ls-namespace-surrogate", ["ls", "--namespace", b"n\xff", "--store", S], "Error: Invalid value for '--namespace': namespace " + LONE),
    # show
    cli("show-key-empty", ["show", "", "--store", S], INVALID_KEY + "key must not be empty"),
    cli("show-key-1025-bytes", ["show", "k" * 1025, "--store", S], INVALID_KEY + "key is 1025 bytes as UTF-8; at most 1024 are accepted"),
    cli("show-key-surrogate", ["show", b"doc\xff", "--store", S], INVALID_KEY + "key " + LONE),
    cli("show-key-missing", ["show", "--store", S], "Error: Missing argument 'KEY'."),
    cli("show-store-not-a-url", ["show", KEY, "--store", ""], "Error: Invalid value for '--store': url '' does not parse as a store URL"),
    cli("show-store-sqlite-unknown-option", ["show", KEY, "--store", "sqlite:///{tmp}/other.db?mode=ro"], "Error: Invalid value for '--store': unknown SQLite store option(s) ['mode']; accepted: synchronous, busy_timeout"),
    # release
    cli("release-without-force", ["release", HELD, "--store", S], "Error: refusing to release 'held' without --force: it displaces whoever holds the lock while they may still be working"),
    cli("release-key-empty", ["release", "", "--force", "--store", S], INVALID_KEY + "key must not be empty"),
    cli("release-key-1025-bytes", ["release", "k" * 1025, "--force", "--store", S], INVALID_KEY + "key is 1025 bytes as UTF-8; at most 1024 are accepted"),
    cli("release-key-surrogate", ["release", b"held\xff", "--force", "--store", S], INVALID_KEY + "key " + LONE),
    cli("release-key-missing", ["release", "--force", "--store", S], "Error: Missing argument 'KEY'."),
    cli("release-force-with-value", ["release", HELD, "--force=yes", "--store", S], "Error: Option '--force' does not take a value.", usage=False),
    cli("release-reason-empty", ["release", HELD, "--force", "--reason", "", "--store", S], "Error: Invalid value for '--reason': reason must not be empty: 1 to 500 characters are accepted"),
    cli("release-reason-501-chars", ["release", HELD, "--force", "--reason", "x" * 501, "--store", S], "Error: Invalid value for '--reason': reason must be 1 to 500 characters, not 501"),
    cli("release-reason-missing-value", ["release", HELD, "--force", "--store", S, "--reason"], "Error: Option '--reason' requires an argument.", usage=False),
    cli("release-store-unknown-scheme", ["release", HELD, "--force", "--store", "nosuch://x"], UNKNOWN_SCHEME),
    # Accepted, and changing nothing: --force on a free key does not take it over.
    cli("release-force-free-key", ["release", KEY, "--force", "--store", S], "doc is free; nothing to release", status=0, stream="stdout"),
    # Showing what others stored must not break, nor let a key forge output.
    # (The library refuses such info now; a store may still hold it, from an older client.)
    cli("ls-info-with-lone-surrogate", ["ls", "--store", S], 'surrogate-info \\ud800"', status=0, stream="stdout", setup="surrogate-info"),
    cli("show-info-with-lone-surrogate", ["show", "odd", "--store", S], "odd", 'surrogate-info \\ud800"', status=0, stream="stdout", setup="surrogate-info"),
    cli("ls-key-with-newline", ["ls", "--store", S], "evil\\nforged  mallory", status=0, stream="stdout", setup="newline-key"),
    cli("show-key-with-newline", ["show", "evil\nforged  mallory  1  0s  30s", "--store", S], "evil\\nforged  mallory  1  0s  30s", status=0, stream="stdout", setup="newline-key"),
    cli("ls-terminal-escapes", ["ls", "--store", S], "\\x1b]0;owned\\x07\\x1b[2J", "\\x9b31m", '"\\u001b[5m"', status=0, stream="stdout", setup="escapes"),
    cli("show-terminal-escapes", ["show", "\x1b]0;owned\x07\x1b[2J", "--store", S], "\\x1b]0;owned\\x07\\x1b[2J", "\\x9b31m", status=0, stream="stdout", setup="escapes"),
]
# fmt: on


# -- running one row --------------------------------------------------------------------------


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    """No inherited store, and a private data directory for the default one."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KEYMUTEX_")}
    environ["XDG_DATA_HOME"] = str(tmp_path / "xdg-data")
    return environ


@pytest.fixture
def bystander_store(tmp_path: Path) -> Iterator[tuple[keymutex.Locks, keymutex.Lease]]:
    """The store every row names, with the bystander lease held on it."""
    with keymutex.Locks(f"sqlite:///{tmp_path}/locks.db", ttl=30.0) as locks:
        yield locks, locks.acquire(HELD, ttl=BYSTANDER_TTL, info={"role": "bystander"})


def _expand(args: tuple[str | bytes, ...], store: str, tmp_path: Path) -> list[str | bytes]:
    marker = tmp_path / "command-ran"
    child = [sys.executable, "-c", "import sys; open(sys.argv[1], 'w').close()", str(marker)]
    expanded: list[str | bytes] = []
    for arg in args:
        if arg == CHILD:
            expanded += child
        elif isinstance(arg, str):
            expanded.append(arg.replace(S, store).replace("{tmp}", str(tmp_path).lstrip("/")))
        else:
            expanded.append(arg)
    return expanded


def _state(locks: keymutex.Locks) -> tuple[list[tuple[Any, ...]], list[float], int]:
    holders = locks.holders("")
    probe = locks.acquire(KEY, timeout=0)
    probe.release()
    return (
        [(h.key, h.owner, h.info, h.fence, h.acquired_at) for h in holders],
        [h.expires_at for h in holders],
        probe.fence,
    )


def _setup(locks: keymutex.Locks, setup: str | None) -> None:
    if setup == "surrogate-info":
        # Past the library's check (which refuses it now), as an older client stored it.
        locks._store.try_acquire(
            "odd",
            token="t" * 24,
            ttl=30.0,
            owner="old-client",
            info={"name": "surrogate-info \ud800"},
            steal=False,
            waiter=None,
        )
    elif setup == "newline-key":
        locks.acquire("evil\nforged  mallory  1  0s  30s")
    elif setup == "escapes":  # a window title, a cleared screen; a C1 CSI; ESC in info
        with keymutex.Locks(locks.url, owner="\x9b31mroot") as other:
            other.acquire("\x1b]0;owned\x07\x1b[2J", info={"blink": "\x1b[5m"})


@pytest.mark.parametrize("row", ROWS)
def test_refused_by_the_cli(
    row: Cli,
    bystander_store: tuple[keymutex.Locks, keymutex.Lease],
    cli_env: dict[str, str],
    tmp_path: Path,
) -> None:
    locks, bystander = bystander_store
    _setup(locks, row.setup)
    store = f"sqlite:///{tmp_path}/locks.db"
    before = _state(locks)
    files = sorted(tmp_path.rglob("*"))

    result = subprocess.run(
        [*KEYMUTEX, *_expand(row.args, store, tmp_path)],
        env={**cli_env, **row.env},
        capture_output=True,
        timeout=WAIT,
        check=False,
    )

    stdout = result.stdout.decode("utf-8", "backslashreplace")
    stderr = result.stderr.decode("utf-8", "backslashreplace")
    assert "Traceback" not in stderr, stderr
    assert result.returncode == row.status, (result.returncode, stdout, stderr)
    shown = stderr if row.stream == "stderr" else stdout
    for fragment in row.fragments:
        assert fragment in shown, (fragment, stdout, stderr)
    if row.status == USAGE:
        assert "Usage: keymutex " in stderr or not row.usage
        assert stdout == ""
    if row.setup == "newline-key":  # no line of the table may be forged by a key
        assert not any(line.startswith("forged") for line in stdout.splitlines()), stdout
    # Nothing stored reaches the terminal raw: no control character but line ends.
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f]", stdout), stdout
    assert not (tmp_path / "command-ran").exists(), "run started COMMAND"
    assert sorted(tmp_path.rglob("*")) == files, "files were created or removed"
    after = _state(locks)
    assert after[0] == before[0], "the holders changed"
    for was, now in zip(before[1], after[1], strict=True):
        assert abs(now - was) < EXPIRY_SLACK, f"a lease's expiry moved by {now - was:.3f} s"
    assert after[2] == before[2] + 1, f"fences were consumed: {before[2]} then {after[2]}"
    assert bystander.lost is False

"""The ``keymutex`` command: run a command under a lock, and look at or clear locks.

    keymutex serve [--store URL] [--host 127.0.0.1] [--port 7420] [--token-file F]
                   [--access-log] [--request-timeout S] [--max-namespaces N]
    keymutex run KEY [--store URL] [--ttl S] [--timeout S] -- COMMAND [ARG...]
    keymutex ls [PREFIX] [--store URL] [--json]
    keymutex show KEY [--store URL] [--json]
    keymutex release KEY --force [--store URL] [--reason TEXT]

Exit statuses (``sysexits.h`` where one fits):

    0..255  run: COMMAND's own status; 128+N when COMMAND was killed by signal N
    2       bad usage or arguments (click's usage errors); nothing touched the store
    69      EX_UNAVAILABLE: the store failed or could not be reached
    70      EX_SOFTWARE: run: the lease was lost while COMMAND ran
    74      EX_IOERR: ls, show, release: the output could not be written (a full disk,
            a closed stdout); release may have released the key all the same
    1       ls, show, release: the output went into a pipe whose reader had gone
            (``keymutex ls | head -1``): quietly; release may have released the key
    75      EX_TEMPFAIL: run: the lock was not acquired within --timeout
    126     run: COMMAND was found but could not be executed
    127     run: COMMAND was not found

``run`` is written on ``AsyncLocks``: a signal that arrives while waiting for the lock
cancels the wait, and the client gives back a grant that lands after the
cancellation, so an interrupted ``run`` never leaves a lease behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import errno
import functools
import gc
import getpass
import ipaddress
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar
from urllib.parse import quote

import click
import platformdirs
from click.core import ParameterSource

from keymutex import AsyncLease, AsyncLocks, Holder, Locked, LockLost, Locks, StoreError
from keymutex._client import MAX_NAMESPACE_BYTES
from keymutex._store import max_ttl_of, stop_task
from keymutex._urls import driver_for, redacted, scheme_of, scrubbed
from keymutex._validate import (
    check_info,
    check_key,
    check_prefix,
    check_reason,
    check_text,
    check_timeout,
    check_ttl,
    shown_number,
)
from keymutex._version import __version__
from keymutex.stores.memory import table_name as memory_table_name
from keymutex.stores.sqlite import url_path as sqlite_url_path

__all__ = ["main"]

EX_USAGE = 2  # click's status for usage errors
EX_UNAVAILABLE = 69
EX_SOFTWARE = 70
EX_IOERR = 74
EX_TEMPFAIL = 75
EX_NOEXEC = 126
EX_NOTFOUND = 127

STORE_ENVVAR = "KEYMUTEX_STORE"
FORWARDED_SIGNALS = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
# Signals that a terminal sends to its whole foreground process group (Ctrl-C, Ctrl-\).
TERMINAL_SIGNALS = frozenset({signal.SIGINT, signal.SIGQUIT})
# Forwarded signals that end a job: sent to COMMAND's own children too, as a terminal
# (its foreground group) or systemd (the unit's processes) would; SIGUSR1 and SIGUSR2
# mean something to COMMAND only.
ENDING_SIGNALS = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM})
MAX_CMD_BYTES = 1024  # JSON bytes of the command line shown to others in the lease's info
RUN_INFO_FIELDS = ("cmd", "host", "pid", "user")  # what `run` shows of itself
RELEASE_TTL = 5.0  # lifetime of the lease that `release --force` takes and gives back
PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCH_EVERY = 1.0  # seconds between the checks of a `run`'s lease while its command runs

AnyLocks = TypeVar("AnyLocks", Locks, AsyncLocks)


# -- errors and exit statuses --------------------------------------------------------


class _Failure(click.ClickException):
    """Ends the command: ``keymutex: <message>`` on stderr, exit with ``exit_code``."""

    def show(self, file: Any = None) -> None:
        # Unwritable stderr: the exit status (69, 75, ...) still says what happened.
        with contextlib.suppress(OSError, ValueError):
            click.echo(f"keymutex: {self.format_message()}", err=True, file=file)


class _Unavailable(_Failure):
    """The store failed or could not be reached."""

    exit_code = EX_UNAVAILABLE


class _NotAcquired(_Failure):
    """``run`` did not get the lock within ``--timeout``."""

    exit_code = EX_TEMPFAIL


@contextlib.contextmanager
def _store_errors(url: str) -> Iterator[None]:
    """Turn ``StoreError`` into exit status 69 with the store named; and ``ValueError``:
    the arguments were checked when parsed, so one raised by a store call is the
    store's refusal (a lock server's 400, as from another version of keymutex). Found
    by review: a traceback and exit 1."""
    try:
        yield
    except StoreError as exc:
        message = scrubbed(str(exc), url)
        if _names_store(message, url):  # a lock server's: "lock server URL failed: ..."
            raise _Unavailable(message) from exc
        raise _Unavailable(f"store {redacted(url)} failed: {message}") from exc
    except ValueError as exc:
        raise _Unavailable(f"store {redacted(url)} refused: {scrubbed(str(exc), url)}") from exc


def _names_store(message: str, url: str) -> bool:
    """Whether the store's ``message`` names ``url`` itself: said once, not twice. Found
    by a new user's walk-through: "store http://127.0.0.1:1 failed: lock server
    http://127.0.0.1:1 failed: [Errno 111] Connection refused"."""
    return redacted(url).rstrip("/").lower() in message.lower()


def _echo(line: str) -> None:
    """A line of ``ls``, ``show`` or ``release`` output. With standard output closed
    (``>&-``), click writes nothing and says nothing: found by review, such a command
    exited 0 having shown nothing; it is the 74 of any output that cannot be written."""
    if sys.stdout is None:
        raise OSError(errno.EBADF, "standard output is closed")
    click.echo(line)


# -- argument types ------------------------------------------------------------------

if TYPE_CHECKING:
    # Click 8.4+ makes ParamType generic in (value, input); earlier versions are not.
    _TextParam = click.ParamType[str, Any]
    _SecondsParam = click.ParamType[float, Any]
    _ObjectParam = click.ParamType[dict[str, Any], Any]
else:
    _TextParam = _SecondsParam = _ObjectParam = click.ParamType


class _Checked(_TextParam):
    """A string checked by one of keymutex's own argument checks."""

    def __init__(self, name: str, check: Callable[[object, str], str]) -> None:
        self.name = name
        self._check = check

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            return self._check(value, self.name)
        except (TypeError, ValueError) as exc:
            self.fail(str(exc) + _not_utf8_hint(value), param, ctx)


def _not_utf8_hint(value: object) -> str:
    """Why an argument holds lone surrogates: its bytes were not UTF-8 (PEP 383)."""
    if not isinstance(value, str) or value.isascii():
        return ""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        try:
            value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return ""
        return " (the argument's bytes are not UTF-8 text)"
    return ""


def _as_typed(message: str, number: object, value: object) -> str:
    """``message`` about ``number`` with ``value`` quoted as it was typed in its place.

    Found by a new user's walk-through: ``--ttl 0`` said "not 0.0" and ``--ttl 1e400``
    "not inf", which is not what was typed; the Python API says "not 0". A message that
    does not show ``number`` is left as it is.
    """
    if not isinstance(value, str):  # a default, or a value passed by a program
        return message
    nan = isinstance(number, float) and math.isnan(number)
    shown = "NaN" if nan else shown_number(number)  # NaN: as seconds_of says it
    return message.replace(f"not {shown}", f"not {value!r}", 1)


class _InRange:
    """click's range types, whose messages quote the value as it was typed (``'0' is
    not in the range ...``), not the number it was read as (``0.0``, ``inf``)."""

    what = "a number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return super().convert(value, param, ctx)  # type: ignore[misc]
        except click.BadParameter as exc:
            if not isinstance(value, str):
                raise
            # "Not a valid" first: that message quotes what was typed, which may read
            # " is not in the range " itself (found by review: --port "1 is not in the
            # range 2" was said to be "not in the range 2' is not a valid integer
            # range."); a range's message holds only numbers.
            _, in_range, rest = exc.message.partition(" is not in the range ")
            if " is not a valid " in exc.message:  # click's "'x' is not a valid integer."
                message = f"{value!r} is not {self.what}."
            elif in_range:
                message = f"{value!r} is not in the range {rest}"
            else:  # worded otherwise by another click: as it says it
                raise
            raise click.BadParameter(message, ctx=ctx, param=param) from None


class _FiniteRange(_InRange, click.FloatRange):
    """``click.FloatRange`` that refuses NaN, which passes its comparisons (found by
    review: ``serve --request-timeout nan`` answered 400 to every request)."""

    what = "a number of seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if math.isnan(number):
            self.fail(f"{value!r} is not {self.what}.", param, ctx)
        return number


class _IntRange(_InRange, click.IntRange):
    """``click.IntRange`` whose messages quote what was typed."""

    what = "a whole number"


class _Seconds(_SecondsParam):
    """A number of seconds, checked as the library checks ``ttl`` / ``timeout``."""

    def __init__(self, name: str, check: Callable[[object, str], float | None]) -> None:
        self.name = name
        self._check = check

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if ctx is not None:  # for the checks made once the store is known (_check_ttl_for)
            ctx.meta[_typed_key(self.name)] = value
        try:
            checked = self._check(seconds, self.name)
        except (TypeError, ValueError) as exc:
            # The library's words for "wait forever" (None) are the CLI's "leave it out".
            message = str(exc).replace("None (wait forever)", "left out (wait forever)")
            self.fail(_as_typed(message, seconds, value), param, ctx)
        assert checked is not None
        return checked


def _typed_key(name: str) -> str:
    """Where ``ctx.meta`` keeps the text typed for the option ``name``."""
    return f"keymutex.typed.{name}"


class _InfoObject(_ObjectParam):
    """``--info``: a JSON object of fields to show with the lease."""

    name = "info"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> dict[str, Any]:
        if isinstance(value, dict):
            return value

        def no_constant(name: str) -> None:
            raise ValueError(f"{name} is not JSON")

        try:
            decoded = json.loads(value, parse_constant=no_constant)
        except ValueError as exc:
            self.fail(f"{value!r} is not a JSON object: {exc}", param, ctx)
        except RecursionError:
            self.fail("the JSON object is nested too deeply", param, ctx)
        if not isinstance(decoded, dict):
            self.fail(f'{value!r} is not a JSON object ({{"name": value, ...}})', param, ctx)
        taken = sorted(set(decoded) & set(RUN_INFO_FIELDS))
        if taken:
            self.fail(
                f"{', '.join(taken)}: keymutex sets these fields of the info itself"
                f" ({', '.join(RUN_INFO_FIELDS)})",
                param,
                ctx,
            )
        return decoded


KEY = _Checked("key", check_key)
NAMESPACE = _Checked(
    "namespace",
    lambda value, name: check_text(value, name, allow_empty=True, max_bytes=MAX_NAMESPACE_BYTES),
)
PREFIX = _Checked("prefix", lambda value, _name: check_prefix(value))
REASON = _Checked("reason", check_reason)
TTL = _Seconds("ttl", check_ttl)
TIMEOUT = _Seconds("timeout", check_timeout)


# -- the store -----------------------------------------------------------------------


def default_store_url(*, create: bool = True) -> str:
    """``sqlite:///`` a ``locks.db`` in the user's data directory (created if missing,
    unless not ``create``: a command that only looks makes nothing)."""
    directory = Path(platformdirs.user_data_dir("keymutex", appauthor=False))
    if not create:
        return "sqlite://" + quote(str((directory / "locks.db").absolute()))
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _Unavailable(
            f"cannot create the default store's directory {str(directory)!r}: {exc};"
            f" pass --store or set ${STORE_ENVVAR}"
        ) from exc
    return "sqlite://" + quote(str((directory / "locks.db").absolute()))


def _store_url(store: str | None, *, create: bool = True) -> str:
    return default_store_url(create=create) if store is None else store


def _bad_store(ctx: click.Context, exc: Exception) -> NoReturn:
    if str(exc).startswith("$KEYMUTEX_API_TOKEN "):  # the lock server's token, not --store
        raise click.UsageError(str(exc), ctx)
    source = ctx.get_parameter_source("store")
    where = f" (from ${STORE_ENVVAR})" if source is ParameterSource.ENVIRONMENT else ""
    raise click.BadParameter(str(exc), ctx, param_hint=f"'--store'{where}")


def _check_ttl_for(ctx: click.Context, url: str, ttl: float) -> None:
    """``--ttl`` within the range of the store's ``ttl`` (the lock server's is a day)."""
    try:
        limit = max_ttl_of(driver_for(url))
    except (TypeError, ValueError) as exc:
        _bad_store(ctx, exc)
    except ImportError:
        return  # opening the store says which extra to install
    try:
        check_ttl(ttl, at_most=limit)
    except ValueError as exc:
        message = _as_typed(str(exc), ttl, ctx.meta.get(_typed_key("ttl")))
        raise click.BadParameter(message, ctx, param_hint="'--ttl'") from None


def _scheme(url: str) -> str | None:
    """The URL's scheme, or ``None`` when it has none (opening it says what is wrong)."""
    try:
        return scheme_of(url)
    except (TypeError, ValueError):
        return None


def _open(ctx: click.Context, kind: type[AnyLocks], url: str, namespace: str) -> AnyLocks:
    """``Locks`` or ``AsyncLocks`` on the store; a bad URL is a usage error.

    The namespace was checked when the arguments were parsed, so a ``ValueError`` or
    ``TypeError`` here is about the URL. A ``memory://`` store is refused: it lives in
    this one process, so a command on it would see no other program's locks and hold
    none against them (``keymutex serve`` takes one: the server is that process).
    """
    if _scheme(url) == "memory":
        try:
            memory_table_name(url)
        except ValueError as exc:
            _bad_store(ctx, exc)
        _bad_store(
            ctx,
            ValueError(
                f"{url!r} lives inside one process: this keymutex command would see none"
                " of the locks your programs hold there, nor hold any against them. Pass"
                " the store they lock in: sqlite:///path, redis://..., or a lock server's"
                " http://..."
            ),
        )
    with _store_errors(url):
        try:
            return kind(url, namespace=namespace)
        except (TypeError, ValueError) as exc:
            _bad_store(ctx, exc)
        except ImportError as exc:  # the store's client library is an extra
            raise _Unavailable(str(exc)) from exc


def _no_sqlite_file(url: str, *, default: bool = False) -> bool:
    """Whether ``url`` is a SQLite store whose file does not exist (yet).

    Opening it would create the file: a command that only looks (``ls``, ``show``,
    ``release``) says instead that nothing is held there, and creates nothing, so a
    mistyped path does not leave an empty database behind. The ``default`` store's
    directory may be missing too (a new user's first ``keymutex ls``): nothing was
    locked there either.
    """
    if _scheme(url) != "sqlite":
        return False
    try:
        path = sqlite_url_path(url)
    except (TypeError, ValueError):
        return False  # opening it says what is wrong
    try:
        os.stat(path)
        return False  # there: look in it
    except FileNotFoundError:
        pass
    except OSError:
        return False  # there but out of reach (EACCES, a symlink loop): opening it says so
    if not default and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        return False  # a directory missing: opening it says so (exit 69)
    click.echo(
        f"note: there is no SQLite database at {path!r}: nothing has been locked in it"
        " (it is made by the first lock taken there)",
        err=True,
    )
    return True


def _store_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--store`` and ``--namespace``, shared by every command."""
    command = click.option(
        "--namespace",
        type=NAMESPACE,
        default="",
        show_default=True,
        metavar="NAME",
        help="Namespace of the keys (Locks(namespace=...)): the same key in two"
        " namespaces is two locks.",
    )(command)
    return click.option(
        "--store",
        envvar=STORE_ENVVAR,
        metavar="URL",
        help=f"Store URL, e.g. sqlite:///path/locks.db, redis://host:6379/0 or a lock"
        f" server's http://host:7420 (its API token from $KEYMUTEX_API_TOKEN)."
        f"  [default: ${STORE_ENVVAR}, else sqlite:/// a locks.db in"
        f" {platformdirs.user_data_dir('keymutex', appauthor=False)}]",
    )(command)


# -- display -------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    """``0.4s``, ``12s``, ``3m04s``, ``2h05m``, ``3d04h``."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def _clock_time(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="seconds")


# What must not reach a terminal as it is: C0 controls (newline, ESC, …), DEL, C1
# controls, line and paragraph separators, bidi overrides, and lone surrogates (which
# stdout cannot encode). A key, owner or info holding them could forge lines of the
# output or drive the terminal: they are shown as escapes.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _shown(text: str) -> str:
    """``text`` fit for a terminal: unsafe characters as ``\\x1b`` / ``\\u2028`` escapes.

    Backslashes are left as they are: the escapes keep the output to one line per
    holder and the terminal in its state; they do not make every key unambiguous.
    """
    return _UNSAFE.sub(_escape, text)


_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    character = match.group()
    if character in _NAMED_ESCAPES:
        return _NAMED_ESCAPES[character]
    code = ord(character)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _info_text(info: dict[str, Any] | None) -> str:
    """Compact JSON, still valid JSON after escaping (``\\u`` escapes only)."""
    if info is None:
        return ""
    text = json.dumps(info, ensure_ascii=False, separators=(",", ":"))
    return _UNSAFE.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def _describe(holder: Holder) -> str:
    """One line: who holds the key, since when, until when, with which fence."""
    now = time.time()
    text = (
        f"{_shown(holder.owner)} since {_clock_time(holder.acquired_at)}"
        f" ({_duration(now - holder.acquired_at)} ago), fence {holder.fence},"
        f" expires in {_duration(holder.expires_at - now)}"
    )
    if holder.info:
        text += f", info {_info_text(holder.info)}"
    return text


def _as_json(holder: Holder | None) -> dict[str, Any] | None:
    return None if holder is None else dataclasses.asdict(holder)


def _table(holders: Sequence[Holder]) -> list[str]:
    now = time.time()
    header = ("KEY", "OWNER", "FENCE", "HELD FOR", "EXPIRES IN", "INFO")
    rows = [
        (
            _shown(holder.key),
            _shown(holder.owner),
            str(holder.fence),
            _duration(now - holder.acquired_at),
            _duration(holder.expires_at - now),
            _info_text(holder.info),
        )
        for holder in holders
    ]
    widths = [max(_width(row[column]) for row in [header, *rows]) for column in range(5)]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell + " " * (width - _width(cell))
            for cell, width in zip(row[:5], widths, strict=True)
        ]
        lines.append("  ".join([*cells, row[5]]).rstrip())
    return lines


def _width(text: str) -> int:
    """Columns ``text`` takes in a terminal: wide (East Asian) characters take two,
    combining marks none."""
    return sum(
        0
        if unicodedata.combining(char)
        else 2
        if unicodedata.east_asian_width(char) in "WF"
        else 1
        for char in text
    )


# -- the commands --------------------------------------------------------------------


@click.group(
    name="keymutex",
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit statuses: 2 bad usage, 69 store unavailable, 70 lease lost (run),"
    " 74 output not written (1: into a closed pipe, quietly), 75 not acquired in time"
    " (run), 126/127 COMMAND not executable/not found (run).",
)
@click.version_option(__version__, prog_name="keymutex")
def cli() -> None:
    """A lock per key, shared by the processes and machines that use one store."""
    _show_library_warnings()


def _show_library_warnings() -> None:
    """The library's log warnings (a renewal that failed, …) as ``keymutex: …`` lines."""
    logger = logging.getLogger("keymutex")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("keymutex: %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)


@cli.command(name="ls")
@click.argument("prefix", required=False, default="", type=PREFIX)
@_store_options
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of holders.")
@click.pass_context
def ls_command(
    ctx: click.Context, prefix: str, store: str | None, namespace: str, as_json: bool
) -> None:
    """List the current holders of keys that start with PREFIX (every key by default).

    The table shows each key's owner, fence, how long it has been held and when it
    expires unless renewed. --json prints a list of objects with key, owner, info,
    fence, acquired_at and expires_at (UNIX seconds).
    """
    url = _store_url(store, create=False)
    holders: list[Holder] = []
    if not _no_sqlite_file(url, default=store is None):
        with _store_errors(url), _open(ctx, Locks, url, namespace) as locks:
            holders = locks.holders(prefix)
    if as_json:
        _echo(json.dumps([_as_json(holder) for holder in holders], indent=2))
    elif not holders:
        under = f" under prefix {prefix!r}" if prefix else ""
        _echo(f"no locks are held{under}")
    else:
        for line in _table(holders):
            _echo(line)


@cli.command(name="show")
@click.argument("key", type=KEY)
@_store_options
@click.option("--json", "as_json", is_flag=True, help="Print the holder as JSON (null if free).")
@click.pass_context
def show_command(
    ctx: click.Context, key: str, store: str | None, namespace: str, as_json: bool
) -> None:
    """Show who holds KEY, since when and until when.

    Prints "KEY is free" (--json: null) when nobody holds it. The exit status is 0
    in both cases: test the JSON output to tell them apart.
    """
    url = _store_url(store, create=False)
    holder: Holder | None = None
    if not _no_sqlite_file(url, default=store is None):
        with _store_errors(url), _open(ctx, Locks, url, namespace) as locks:
            holder = locks.holder(key)
    if as_json:
        _echo(json.dumps(_as_json(holder), indent=2))
        return
    if holder is None:
        _echo(f"{_shown(key)} is free")
        return
    now = time.time()
    fields = [
        ("key", _shown(holder.key)),
        ("owner", _shown(holder.owner)),
        ("fence", str(holder.fence)),
        (
            "acquired",
            f"{_clock_time(holder.acquired_at)} ({_duration(now - holder.acquired_at)} ago)",
        ),
        ("expires", f"{_clock_time(holder.expires_at)} (in {_duration(holder.expires_at - now)})"),
    ]
    if holder.info is not None:  # none: no line (found by a new user's walk-through: "info:")
        fields.append(("info", _info_text(holder.info)))
    for name, value in fields:
        _echo(f"{name + ':':<10}{value}".rstrip())


@cli.command(name="release")
@click.argument("key", type=KEY)
@_store_options
@click.option(
    "--force",
    is_flag=True,
    help="Required: release whatever lease holds KEY, whoever holds it.",
)
@click.option(
    "--reason",
    type=REASON,
    metavar="TEXT",
    help="Why (1 to 500 characters). A lock server (http/https store) logs it with the"
    " API token's name; other stores keep it in the info of the lease that takes the"
    " key over. Default for a lock server: 'keymutex release --force by USER on HOST'.",
)
@click.pass_context
def release_command(
    ctx: click.Context,
    key: str,
    store: str | None,
    namespace: str,
    force: bool,
    reason: str | None,
) -> None:
    """Force-release KEY, displacing whoever holds it.

    The key is taken over and given back, which gives it a new, larger fence: the
    displaced holder's token stops working at once, its renewals fail (a `keymutex
    run` holding it terminates its command), and resources that check fences reject
    its late writes. Prints who was displaced. A free key is left as it is.

    On a lock server (an http or https store) this is the server's admin
    force-release: the API token needs the admin permission, and the server logs who
    released the key and why.
    """
    if not force:
        raise click.UsageError(
            f"refusing to release {key!r} without --force: it displaces whoever holds"
            " the lock while they may still be working",
            ctx,
        )
    url = _store_url(store, create=False)
    info = {"cmd": "keymutex release --force", "host": socket.gethostname(), "pid": os.getpid()}
    if _no_sqlite_file(url, default=store is None):
        _echo(f"{_shown(key)} is free; nothing to release")
        return
    with _store_errors(url), _open(ctx, Locks, url, namespace) as locks:
        force_release = getattr(locks._store, "force_release", None)
        if force_release is not None:  # a lock server: its admin step, logged there
            if reason is None:
                reason = f"keymutex release --force by {_user() or '?'} on {info['host']}"
            holder = force_release(key, reason)
            fence = None if holder is None else holder.fence
        else:
            holder = locks.holder(key)
            if holder is not None:
                extra = {} if reason is None else {"reason": reason}
                lease = locks.acquire(
                    key, ttl=RELEASE_TTL, timeout=0, steal=True, info={**info, **extra}
                )
                lease.release()
                fence = lease.fence
    if holder is None:
        _echo(f"{_shown(key)} is free; nothing to release")
        return
    _echo(f"released {_shown(key)}: displaced {_describe(holder)}")
    _echo(f"{_shown(key)} is free; its next holder gets a fence above {fence}")


def _user() -> str | None:
    """The login name, or ``None`` where there is none (a container's bare uid)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None


# -- serve ---------------------------------------------------------------------------


class _Stopped(Exception):
    """SIGINT or SIGTERM reached ``serve`` once uvicorn had shut down (or before it ran)."""


def _is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return bool(addresses) and all(
        ipaddress.ip_address(str(address).split("%", 1)[0]).is_loopback for address in addresses
    )


# What ``serve`` counts on in open files (descriptors): per open namespace (at most
# --max-namespaces between requests), SQLite's database, -wal and -shm files (3), or a
# network store's idle connections: PostgreSQL's one and its LISTEN connection, Redis's
# one and its pub/sub connection, MongoDB's one, its change stream's, and pymongo's two
# monitoring connections per member (8 on a replica set of three). A store's busy
# connections, which come with concurrent requests, are counted with those requests:
SERVE_FILES_PER_NAMESPACE = 8
# and for the rest of the process: the clients' connections (a waiting request on
# SQLite holds one more, its waiter's socket), the listening socket, the event loop's
# own, the interpreter's.
SERVE_FILES_BESIDES = 256


def _enough_open_files(max_namespaces: int) -> None:
    """Raise this process's soft limit on open files (``RLIMIT_NOFILE``) to what
    ``max_namespaces`` open namespaces are counted to need, as far as its hard limit
    allows, and warn if that is still short.

    Never refuses to start: the estimate is rough, and a limit reached fails the
    requests that need a file then (503: the store's connection cannot be opened), not
    the server. Raised to the estimate, not to the hard limit: no further than it is
    counted to need. Found by review: nothing compared the limit with
    ``--max-namespaces``; by this estimate a soft limit of 1,024 (a common default)
    fits 96 namespaces.
    """
    if sys.platform == "win32":  # no such limit
        return
    import resource

    needed = max_namespaces * SERVE_FILES_PER_NAMESPACE + SERVE_FILES_BESIDES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if raised > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        except (OSError, ValueError, OverflowError):
            # ValueError: on macOS, above kern.maxfilesperproc. OverflowError: beyond a C
            # long, which only an unlimited hard limit (macOS's) lets through: found by
            # review, --max-namespaces 2000000000000000000 was a traceback there.
            pass
        else:
            soft = raised
    if soft >= needed:
        return
    fits = (soft - SERVE_FILES_BESIDES) // SERVE_FILES_PER_NAMESPACE
    logging.getLogger("keymutex.server").warning(
        "the limit on open files is %d (ulimit -n; hard limit %s), below the %d that"
        " --max-namespaces %d is counted to need (%d per namespace, %d besides): raise it"
        " (ulimit -n %d, or LimitNOFILE=%d in a systemd unit)%s, or requests fail (503)"
        " once the files run out",
        soft,
        "unlimited" if hard == resource.RLIM_INFINITY else hard,
        needed,
        max_namespaces,
        SERVE_FILES_PER_NAMESPACE,
        SERVE_FILES_BESIDES,
        needed,
        needed,
        f" or lower --max-namespaces (to {fits} for this limit)" if fits >= 1 else "",
    )


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free port)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


@cli.command(name="serve")
@click.option(
    "--store",
    envvar=STORE_ENVVAR,
    metavar="URL",
    help=f"Store URL whose locks the server serves.  [default: ${STORE_ENVVAR}, else"
    f" sqlite:/// a locks.db in {platformdirs.user_data_dir('keymutex', appauthor=False)}]",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=_IntRange(0, 65535),
    default=7420,
    show_default=True,
    help="Port to listen on (0: any free port; the URL printed says which).",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="F",
    help="JSON file of API tokens and their grants (docs/http-api.md). Without one,"
    " every request is allowed and only a loopback --host is accepted.",
)
@click.option(
    "--access-log/--no-access-log",
    default=False,
    show_default=True,
    help="Log a line per request (uvicorn's access log). Off by default: it costs a"
    " good part of a lock request's time, and /metrics counts and times every request.",
)
@click.option(
    "--request-timeout",
    type=_FiniteRange(0.1, 3600),
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="How long a request may take to arrive, from its first byte to its last, before"
    " it is answered 408 and its connection closed. Waiting for a lock does not count.",
)
@click.option(
    "--max-namespaces",
    type=_IntRange(min=1),
    default=64,  # create_app's default (the server's modules load only when it runs)
    show_default=True,
    metavar="N",
    help="Namespaces whose store connections stay open between requests. When more are"
    " in use, the others connect again each time they are used: a warning is logged, and"
    " /metrics counts keymutex_namespace_opens_total. Each open namespace holds its"
    " store's connections: 3 file descriptors on SQLite; on PostgreSQL or Redis,"
    " connections that count against the database server's own limit. At start, the"
    " limit on open files is raised to fit (up to the hard limit), else a warning says so.",
)
@click.pass_context
def serve_command(
    ctx: click.Context,
    store: str | None,
    host: str,
    port: int,
    token_file: Path | None,
    access_log: bool,
    request_timeout: float,
    max_namespaces: int,
) -> None:
    """Serve the store's locks over HTTP, with a dashboard at / (Ctrl-C stops).

    Clients in any language use the HTTP API (docs/http-api.md); Python uses
    Locks("http://HOST:PORT"). Prints the server's URL once it listens.
    """
    try:
        # Imported here: the server extra is optional, and `run` must not need it.
        import uvicorn

        from keymutex.server import create_app
        from keymutex.server._auth import load_token_file
        from keymutex.server._protocol import HEAD_LIMIT, http_protocol
    except ImportError as exc:
        raise _Unavailable(
            f"the lock server needs {exc.name or 'its packages'}: pip install 'keymutex[server]'"
        ) from exc
    if token_file is None and not _is_loopback(host):
        raise click.UsageError(
            f"refusing to serve on {host!r} without --token-file: anyone who can reach it"
            " could take and release every lock. Use a loopback --host, or --token-file.",
            ctx,
        )
    url = _store_url(store)
    if token_file is not None:
        try:
            load_token_file(token_file)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx, param_hint="'--token-file'") from exc
    _enough_open_files(max_namespaces)
    with _store_errors(url):
        try:
            app = create_app(url, token_file=token_file, max_namespaces=max_namespaces)
        except (TypeError, ValueError) as exc:
            _bad_store(ctx, exc)
        except ImportError as exc:
            raise _Unavailable(str(exc)) from exc
    try:
        sock = _listen(host, port)
    except OSError as exc:
        raise _Unavailable(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (choose another with"
            " --port, or --port 0 for any free one; make serve PORT=…)"
        ) from exc
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    click.echo(f"keymutex server on http://{shown}:{bound_port}/ (store {redacted(url)})")
    config = uvicorn.Config(
        app,
        log_level="info",
        access_log=access_log,
        # uvicorn's own, answering what it cannot parse in JSON, with bounds on the size
        # of a request's head and on the time it takes to arrive
        http=http_protocol(request_timeout),
        h11_max_incomplete_event_size=HEAD_LIMIT,  # h11's own bound, where it runs
        timeout_graceful_shutdown=3,
        lifespan="on",
        proxy_headers=False,
    )

    def stop(signum: int, frame: object) -> None:
        raise _Stopped(signum)

    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal with
    # the handlers it found: ours, which end the command with status 0.
    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    # What start-up made lives as long as the server: out of the collector's way, so
    # that full collections (pauses of tens of ms under load) have less to walk.
    gc.collect()
    gc.freeze()

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.keymutex.shutting_down()  # no request left waiting at shutdown
            super().handle_exit(sig, frame)

    try:
        Server(config).run(sockets=[sock])
    except _Stopped:
        pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sock.close()
    click.echo("keymutex server stopped", err=True)


# -- run -----------------------------------------------------------------------------


def _terminal_delivered_to_child(signum: int, child: int) -> bool:
    """Whether the terminal already sent ``signum`` to the child (Ctrl-C, Ctrl-\\).

    The child starts in keymutex's process group. When its group is the foreground
    group of the controlling terminal, the terminal delivers SIGINT and SIGQUIT to
    every process of it, the child included: forwarding would deliver them twice. A
    child that left for a group of its own (GNU ``timeout``, ``setsid``) is not sent
    them by the terminal: found by review, Ctrl-C then reached keymutex alone, which
    forwarded nothing, and the command ran on holding the lock.
    """
    if signum not in TERMINAL_SIGNALS:
        return False
    try:
        fd = os.open(os.ctermid(), os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False  # no controlling terminal: the signal was sent by kill(2)
    try:
        return os.tcgetpgrp(fd) == os.getpgid(child)
    except OSError:
        return False
    finally:
        os.close(fd)


def _json_bytes(text: str) -> int:
    """The bytes ``text`` takes in info as JSON (a control character takes six)."""
    return len(json.dumps(text, ensure_ascii=False).encode()) - 2


def _cut(text: str, limit: int) -> str:
    """``text``, or its longest start that with "…" takes at most ``limit`` JSON bytes."""
    if _json_bytes(text) <= limit:
        return text
    low, high = 0, len(text)
    while low < high:
        middle = (low + high + 1) // 2
        if _json_bytes(text[:middle] + "…") <= limit:
            low = middle
        else:
            high = middle - 1
    return text[:low] + "…"


def _lease_info(
    command: Sequence[str], *, hide_command: bool = False, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What others see of this run: ``extra``, the command line (its program's name
    alone with ``hide_command``), host, keymutex's pid and user."""
    # An argument that is not UTF-8 (a file name is any bytes) comes as lone surrogates,
    # which no store keeps as text: shown as backslash escapes instead.
    shown = [
        arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        for arg in command
    ]
    cmd = _cut(Path(shown[0]).name if hide_command else shlex.join(shown), MAX_CMD_BYTES)
    info: dict[str, Any] = {**(extra or {}), "cmd": cmd}
    info.update(host=socket.gethostname(), pid=os.getpid())
    user = _user()
    if user is not None:
        info["user"] = user
    return info


def _signal(process: asyncio.subprocess.Process, signum: int, *, descendants: bool) -> None:
    """Send ``signum`` to the child, unless it has ended, and with ``descendants`` to the
    processes it started and theirs (collected first: a shell that the signal ends
    leaves its jobs to init, still running, where nothing would find them after).

    Not ``Process.send_signal``: ``Popen.send_signal`` first polls, and may reap a child
    that a signal to the whole process group has just killed, behind asyncio's child
    watcher, which then loses its status ("Unknown child process pid …", status 255).
    """
    if process.returncode is None:
        for pid in [process.pid, *(_descendants(process.pid) if descendants else ())]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)


def _descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs, from ``/proc`` (Linux; none found
    elsewhere). A process that left the tree (daemonised: its parent ended) is not
    among them."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                stat = file.read()
            # After the command name, which may hold spaces and ")": state, then ppid.
            parent = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile, or not a process we may read
        children.setdefault(parent, []).append(int(entry))
    found: list[int] = []
    pending = [pid]
    while pending:
        for child in children.get(pending.pop(), ()):
            found.append(child)
            pending.append(child)
    return found


def _nothing() -> None:
    """asyncio's callback for a signal ``run`` handles: ``_Run._arrived`` acts."""


class _ForkHooks:
    """The process's at-fork hooks, which tell the ``_Run`` whose child is being
    started of the forks made for it (``before_fork``, ``after_fork``).

    ``os.register_at_fork`` cannot take hooks back: they are registered at the first
    spawn, and do nothing but for a fork by the thread starting a child. CPython calls
    them for the fork of a ``subprocess`` given a ``preexec_fn``, which ``run`` always
    gives (and then never uses the vfork or posix_spawn that would skip them).
    """

    def __init__(self) -> None:
        self._run: _Run | None = None
        self._thread: int | None = None
        self._registered = False

    @contextlib.contextmanager
    def spawning(self, run: _Run) -> Iterator[None]:
        """While ``run`` starts its child, on this thread."""
        if not self._registered:
            os.register_at_fork(before=self._before, after_in_parent=self._after_in_parent)
            self._registered = True
        self._run, self._thread = run, threading.get_ident()
        try:
            yield
        finally:
            self._run = self._thread = None
            run._unblock()  # had the fork failed without the hook after it

    def _spawning(self) -> _Run | None:
        return self._run if self._thread == threading.get_ident() else None

    def _before(self) -> None:
        if (run := self._spawning()) is not None:
            run.before_fork()

    def _after_in_parent(self) -> None:
        if (run := self._spawning()) is not None:
            run.after_fork()


_FORK_HOOKS = _ForkHooks()


def _tell(message: str) -> None:
    """A line for the user on stderr, from ``run``: a stderr that cannot be written (a
    full disk, a reader gone) must not stop what ``run`` does next (send SIGTERM to a
    command whose lease was lost), nor change its exit status."""
    with contextlib.suppress(OSError, ValueError):
        click.echo(message, err=True)


class _Run:
    """One ``keymutex run``: wait for the lock, run the child, forward signals.

    Phases, in order: ``waiting`` for the lock (a signal cancels the wait and ends
    keymutex with 128+N), ``starting`` the child (signals are kept, and forwarded once
    it runs, as ``_forward`` says), ``running`` (signals are forwarded as they come;
    once the child has ended, the release is under way, and a signal ends keymutex at
    once with 128+N: the lease expires by its TTL), ``ended`` (the child could not be
    started, or the lease was lost before it was: the release is under way, and a
    signal ends keymutex as in ``running``), ``done`` (the release is over, the client
    closes: a signal ends keymutex likewise). Everything runs on the event loop, so the
    phase changes only between awaits. A signal that keymutex was started
    ignoring (``nohup``, a script's ``&``) is left ignored, for the child too.

    A signal is acted on by what it came before or after, not by the phase when its
    callback runs: ``_arrived`` counts the forks for the child made by then
    (``_ForkHooks``), and the child starts with keymutex's signals blocked, then takes
    their default actions before its exec (``_prepare_child``).
    """

    def __init__(
        self, key: str, command: Sequence[str], *, quiet: bool, info: dict[str, Any] | None
    ) -> None:
        self.info = info
        self.key = key
        self.command = list(command)
        self.quiet = quiet
        self.phase = "waiting"
        self.process: asyncio.subprocess.Process | None = None
        # The signals that came while starting: (signum, forks made when it came).
        self.pending: list[tuple[int, int]] = []
        self.handled: tuple[int, ...] = ()  # the signals keymutex handles (see main)
        self.forks = 0  # the forks made to start the child so far
        self._mask: set[int | signal.Signals] | None = None  # this thread's, while it forks
        self.interrupted_by: int | None = None
        self.received: set[int] = set()  # the signals sent to keymutex itself
        self.lost = False
        self.new_holder: Holder | None = None
        self._task: asyncio.Task[Any] | None = None

    @property
    def name(self) -> str:
        return self.command[0]

    def _arrived(self, loop: asyncio.AbstractEventLoop, signum: int, frame: object) -> None:
        """The Python handler of the signals keymutex handles: act on ``signum`` on the
        loop (``on_signal``), with the number of forks for the child made by now.

        It runs on the main thread as soon as that runs Python code after the signal
        came. asyncio's callback came a turn of the loop or more later: found by
        review, nothing yields between the grant and the fork, so a Ctrl-C that came
        while the child was being started was acted on only once it ran, and dropped as
        one the terminal had sent the child too; the command ran to its end.
        """
        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to act on
            loop.call_soon_threadsafe(self.on_signal, signum, self.forks)

    def on_signal(self, signum: int, forks: int | None = None) -> None:
        """Act on ``signum``, which came after ``forks`` forks for the child (by
        default: as many as now)."""
        came_after = self.forks if forks is None else forks
        self.received.add(signum)
        if self.phase == "waiting":
            if self._task is not None and self.interrupted_by is None:
                self.interrupted_by = signum
                self._task.cancel()
        elif self.phase == "starting":
            self.pending.append((signum, came_after))
        elif self.phase == "running" and self.process is not None:
            if self.process.returncode is None:
                self._forward(signum, came_after)
            else:  # the child has ended: only the release is left, which may hang
                self._abandon_release(signum)
        else:
            # "ended": the command could not be started, and the release is under way;
            # "done": the release is over, the client closes (a release that failed is
            # tried once more then, and may hang as long). Found by review: the signal
            # was ignored until then, and keymutex exited 0.
            self._abandon_release(signum)

    def _abandon_release(self, signum: int) -> NoReturn:
        """Exit at once, 128+N: the release waits for a store that does not answer (a
        closing client would wait for it too, and so would the interpreter's exit, for
        the thread it runs in). The lease expires by its TTL."""
        after = f"after {self.name} ended" if self.process else f"({self.name} was not started)"
        what = (
            f"closing the store {after}"
            if self.phase == "done"
            else f"releasing {self.key!r} {after}"
        )
        _tell(
            f"keymutex: {signal.Signals(signum).name} while {what}; the lease, if still"
            " held, expires by its TTL"
        )
        _die_by(signum)
        os._exit(128 + signum)

    def _forward(self, signum: int, came_after: int) -> None:
        """Send the child ``signum``, which came after ``came_after`` forks for it,
        unless the terminal sent it the child too.

        One that came before the child's fork reached keymutex alone (found by review:
        a Ctrl-C just after the grant, taken for the terminal's, and the command ran to
        its end under the lock). One that came after it reached the child from the
        terminal as well, before its exec (it then ends by it: ``_prepare_child``) or
        after: sent again, it would reach a program twice, and many take a second
        Ctrl-C for "quit now, skip the clean-up".
        """
        assert self.process is not None
        if came_after < self.forks or not _terminal_delivered_to_child(signum, self.process.pid):
            _signal(self.process, signum, descendants=signum in ENDING_SIGNALS)

    def before_fork(self) -> None:
        """Block the handled signals on this thread, which forks: the child starts with
        them blocked, so that none that comes before its exec is caught by keymutex's
        handlers, which it still has (see ``_prepare_child``)."""
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.handled)

    def after_fork(self) -> None:
        """In keymutex, once forked: unblock, then count the fork. A signal held
        meanwhile is handled within the unblocking (CPython runs the handlers of the
        signals it unblocks before ``pthread_sigmask`` returns), so it counts as before
        the fork: it came before it, or reached the child too, which then ends by it
        before its exec, and a second copy does no harm. (Unless this process is held
        off the CPU between the unblocking and the count long enough for the child to
        exec and set its own handler: the command then gets a terminal's Ctrl-C twice.
        Counting first would lose one that came just before the fork instead.)"""
        self._unblock()
        self.forks += 1

    def _unblock(self) -> None:
        mask, self._mask = self._mask, None
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _prepare_child(self, orphaned: Callable[[], object] | None) -> None:
        """The child's first steps, between the fork and the exec: ask for a signal at
        keymutex's death (``orphaned``), give the handled signals their default
        actions, and unblock them.

        Found by review: the child had keymutex's handlers until its exec, so a Ctrl-C
        that came then was caught there (and written to keymutex's own wakeup fd, which
        it shares), and the command never saw it. Blocked since the fork
        (``before_fork``), such a signal now takes its default action here: the child
        ends by it, as the command would have, before its exec. Only built-in calls,
        with values made beforehand: no lock that another of keymutex's threads may hold
        is taken.
        """
        if orphaned is not None:
            orphaned()
        for signum in self.handled:
            signal.signal(signum, signal.SIG_DFL)
        if self._mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)

    def on_lost(self, lease: object) -> None:
        """The lease is gone: warn, and terminate the child if it runs."""
        self.lost = True
        process = self.process
        if self.phase != "running" or process is None or process.returncode is not None:
            return  # not started yet (it will not be), or already ended
        _signal(process, signal.SIGTERM, descendants=True)  # first: whatever stderr does
        _tell(
            f"keymutex: warning: lost the lock on {self.key!r} while {self.name} runs;"
            f" sent SIGTERM to it (pid {process.pid}) and the processes it started"
        )

    async def main(
        self, open_locks: Callable[[], AsyncLocks], ttl: float | None, timeout: float | None
    ) -> int:
        """Acquire, run the child, release; the exit status."""
        self._task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        handled = [s for s in FORWARDED_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
        self.handled = tuple(handled)
        arrived = functools.partial(self._arrived, loop)
        # Blocked meanwhile: one that came between asyncio's handler and ``_arrived``
        # ran asyncio's, which does nothing, and was lost (the command then ran to its
        # end under the lock); held, it reaches ``_arrived`` as they are unblocked.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, handled)
        try:
            for signum in handled:
                # asyncio's handler wakes the loop (its wakeup fd; removed in the end),
                # and does nothing else: ``_arrived``, set in place of its Python
                # handler, acts.
                loop.add_signal_handler(signum, _nothing)
                signal.signal(signum, arrived)
                signal.siginterrupt(signum, False)  # as asyncio sets it: fewer EINTR
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        try:
            async with open_locks() as locks:
                lease = await self._acquire(locks, ttl, timeout)
                return await self._hold(lease)
        except asyncio.CancelledError:
            if self.interrupted_by is None:
                raise
            _tell(
                f"keymutex: {signal.Signals(self.interrupted_by).name} while waiting for"
                f" {self.key!r}; {self.name} was not started"
            )
            return 128 + self.interrupted_by
        finally:
            for signum in handled:
                loop.remove_signal_handler(signum)

    async def _acquire(
        self, locks: AsyncLocks, ttl: float | None, timeout: float | None
    ) -> AsyncLease:
        """Try once; if the key is held, say so on stderr and wait up to ``timeout``."""
        info = self.info
        started = time.monotonic()
        try:
            return await locks.acquire(
                self.key, ttl=ttl, timeout=0, renew=True, info=info, on_lost=self.on_lost
            )
        except Locked as exc:
            if timeout == 0:
                raise self._not_acquired(exc, timeout) from exc
            if not self.quiet:
                holder = "" if exc.holder is None else f", held by {_describe(exc.holder)}"
                _tell(f"keymutex: waiting for {self.key!r}{holder}")
        remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        try:
            return await locks.acquire(
                self.key, ttl=ttl, timeout=remaining, renew=True, info=info, on_lost=self.on_lost
            )
        except Locked as exc:
            raise self._not_acquired(exc, timeout) from exc

    def _not_acquired(self, exc: Locked, timeout: float | None) -> _NotAcquired:
        holder = "" if exc.holder is None else f": held by {_describe(exc.holder)}"
        waited = "" if timeout is None else f" within {timeout:g}s"
        return _NotAcquired(f"{self.key!r} was not acquired{waited}{holder}")

    async def _hold(self, lease: AsyncLease) -> int:
        """Run the child under the lease, then release it; the exit status."""
        self.phase = "starting"
        status = EX_SOFTWARE
        try:
            async with lease:
                if not self.lost:
                    status = await self._child(lease)
                else:  # lost before it started: it will not be; the release is left
                    self.phase = "ended"
        except LockLost as exc:
            self.lost = True
            self.new_holder = exc.holder
        except StoreError as exc:
            # Only the release failed: the lease expires by its TTL, and the
            # command's status is still the answer.
            _tell(
                f"keymutex: warning: could not release {self.key!r} ({exc});"
                " it is freed when its lease expires"
            )
        finally:
            self.phase = "done"
        if not self.lost:
            return status
        holder = "" if self.new_holder is None else f"; now held by {_describe(self.new_holder)}"
        ran = (
            f"{self.name} was not started"
            if self.process is None
            else f"{self.name} exited with status {status}"
        )
        _tell(
            f"keymutex: the lock on {self.key!r} was lost{holder}; {ran}; exit status {EX_SOFTWARE}"
        )
        return EX_SOFTWARE

    def _key_hint(self) -> str:
        """When COMMAND is not found and KEY names a program: KEY was likely left out
        (``keymutex run -- echo hi`` locks 'echo' and runs 'hi')."""
        if shutil.which(self.key) is None:
            return ""
        meant = shlex.join([self.key, *self.command])
        return (
            f" (KEY was {self.key!r}, which is also a program: if you meant to run"
            f" '{meant}', give the key first: keymutex run KEY -- {meant})"
        )

    async def _child(self, lease: AsyncLease) -> int:
        """Run the child with the lease's fence and token; its status as a shell gives it."""
        env = dict(
            os.environ,
            KEYMUTEX_KEY=self.key,
            KEYMUTEX_FENCE=str(lease.fence),
            KEYMUTEX_TOKEN=lease.token,
        )
        prepare = functools.partial(self._prepare_child, _parent_death_signal())
        try:
            with _FORK_HOOKS.spawning(self):
                try:
                    process = await asyncio.create_subprocess_exec(
                        *self.command, env=env, preexec_fn=prepare
                    )
                except OSError as exc:
                    if exc.errno != errno.ENOEXEC:
                        raise
                    # A script without #!: run by /bin/sh, as a shell, env or flock do;
                    # a binary the kernel cannot run (another machine's) is not a script.
                    path = shutil.which(self.name) if os.sep not in self.name else self.name
                    if path is not None and _is_binary(path):
                        raise
                    script = [path or self.name, *self.command[1:]]
                    process = await asyncio.create_subprocess_exec(
                        "/bin/sh", *script, env=env, preexec_fn=prepare
                    )
        except OSError as exc:
            self.phase = "ended"
            status, reason = _not_started(self.name, exc, os.get_exec_path(env))
            if reason is None:
                shown, why = (self.name, "") if self.name else ("''", " (COMMAND is empty)")
                _tell(f"keymutex: {shown}: command not found{why}{self._key_hint()}")
            else:
                _tell(f"keymutex: {reason}")
            return status
        self.process = process
        self.phase = "running"
        for signum, came_after in self.pending:  # those that came while it was started
            self._forward(signum, came_after)
        if self.lost:
            _signal(process, signal.SIGTERM, descendants=True)
        watch = asyncio.create_task(self._watch(lease))
        try:
            returncode = await process.wait()
        finally:
            await stop_task(watch)
        return 128 - returncode if returncode < 0 else returncode

    async def _watch(self, lease: AsyncLease) -> None:
        """Renew every ``WATCH_EVERY`` seconds while COMMAND runs, not only every TTL/3.

        A ``release --force`` (or a takeover) frees the key at once: renewing only
        every TTL/3 (10 s by default, 20 min with --ttl 3600), COMMAND ran on that long
        beside the next holder. A renewal by this lease's token fails as soon as it is
        taken: ``on_lost`` then stops COMMAND within a second. A store that cannot be
        reached is the background renewer's to judge, by the lease's deadline.
        """
        if lease._ttl / 3 <= WATCH_EVERY:
            return  # the renewer looks as often already
        while not lease.lost:
            await asyncio.sleep(WATCH_EVERY)
            try:
                await lease.renew()
            except (LockLost, StoreError):
                continue  # lost: on_lost has run (and the loop ends); else the renewer's


def _found_in(
    search_path: Sequence[str], name: str, *, executable: bool | None = None
) -> str | None:
    """The first ``name`` in the directories of ``search_path`` that exists and is not a
    directory, as bash looks a command up (with ``executable=False``: the first of them
    that may not be executed); ``None``: there is none."""
    if not name:
        return None
    for directory in search_path:
        path = os.path.join(directory, name)
        if (
            os.path.exists(path)
            and not os.path.isdir(path)
            and (executable is None or os.access(path, os.X_OK) == executable)
        ):
            return path
    return None


def _not_started(name: str, exc: OSError, search_path: Sequence[str]) -> tuple[int, str | None]:
    """Why COMMAND ``name`` could not be started (``exc``), as bash 5.2 says it: the exit
    status, and the message (``None``: "command not found", which ``_Run`` words).

    Found by review: ``run KEY -- ""`` exited 126, "permission denied", where a shell
    exits 127, "command not found". Python looks up a name without a slash by trying
    to execute it in each directory of PATH, and keeps the first error other than
    "not found": "" joined to a directory is that directory, which cannot be executed
    (EACCES); a directory of that name in PATH, or a directory of PATH that may not be
    searched, did the same. A shell looks only at files that exist and are not
    directories: none is 127, whatever the attempts raised; one that cannot be
    executed is 126 (a file without the execute bit, a path that is a directory). A
    file found whose execution is "not found" lacks its ``#!`` interpreter (or its
    loader): 127, as bash 5.2, but not "command not found", which it said before.
    """
    path = name
    if os.sep not in name:
        found = _found_in(search_path, name)
        if found is None:
            return EX_NOTFOUND, None
        path = found
    if isinstance(exc, FileNotFoundError):
        if os.path.exists(path):
            return EX_NOTFOUND, (
                f"{path}: cannot execute: required file not found"
                " (the interpreter on its #! line?)"
            )
        return EX_NOTFOUND, f"{path}: no such file or directory"
    if isinstance(exc, PermissionError):
        if os.sep not in name:
            # Python reports the first error other than "not found" in PATH's order:
            # that of the first file that may not be executed, not of the first found
            # (which may be executable, and have failed as "not found").
            path = _found_in(search_path, name, executable=False) or path
        return (
            EX_NOEXEC,
            f"{path}: {'is a directory' if os.path.isdir(path) else 'permission denied'}",
        )
    if exc.errno == errno.ENOEXEC:
        return EX_NOEXEC, f"{path}: cannot execute binary file: {exc.strerror or exc}"
    return EX_NOEXEC, f"{path}: cannot execute: {exc.strerror or exc}"


def _is_binary(path: str) -> bool:
    """Whether the file at ``path``, which the kernel would not execute, is a binary
    rather than a script without ``#!``, as bash 5.2 tells them apart: an ELF header,
    or a NUL byte in the first line of its first 80 bytes. Noted by review: a binary
    for another machine (or a truncated one) was handed to ``/bin/sh``, which printed
    its bytes as syntax errors, where bash exits 126, "cannot execute binary file"."""
    try:
        with open(path, "rb") as file:
            sample = file.read(80)
    except OSError:
        return False  # what /bin/sh makes of it is then the answer, as before
    return sample.startswith(b"\x7fELF") or b"\0" in sample.partition(b"\n")[0]


def _parent_death_signal() -> Callable[[], object] | None:
    """What COMMAND's process runs before its program: on Linux, ask for SIGTERM when
    keymutex dies (``prctl(PR_SET_PDEATHSIG)``). keymutex killed with SIGKILL (the OOM
    killer, ``kill -9``) cannot tell COMMAND, nor renew: COMMAND ran on past the TTL
    beside the next holder. ``None`` where there is no such call.

    The function runs in the child between fork and exec (``_Run._prepare_child``),
    where another thread's locks may be held: it only calls a C function resolved
    beforehand, with numbers.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return functools.partial(prctl, PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _die_by(signum: int) -> None:
    """End keymutex by ``signum`` itself, as the signal would have (returns if it could
    not). A shell running keymutex in a script or loop stops at a Ctrl-C only if its
    child died *by* SIGINT ("wait and cooperative exit"); an exit with 130 lets the
    loop go on. Only for the ending signals keymutex was sent itself (at a terminal,
    Ctrl-C reaches keymutex and COMMAND alike); a core dump is not made for SIGQUIT."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    if signum not in ENDING_SIGNALS:
        return
    with contextlib.suppress(OSError, ValueError):
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_CORE)
        resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)


class _RunCommand(click.Command):
    """``run``: everything from COMMAND on is COMMAND's, ``--`` or not.

    click takes options anywhere on the line: ``keymutex run job rsync -q src dst``
    gave ``-q`` to keymutex and ``rsync src dst`` to run, and ``run job ls -la`` failed
    with "No such option". Like ``flock``, ``timeout`` or ``nohup``, the first word
    after KEY (and keymutex's own options) starts COMMAND: a ``--`` is put before it.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        takes_value = {
            name: not (param.is_flag or param.count)
            for param in self.get_params(ctx)
            if isinstance(param, click.Option)
            for name in (*param.opts, *param.secondary_opts)
        }
        at, positional = 0, 0
        unknown: str | None = None  # the first unknown option before KEY: meant as KEY?
        while at < len(args):
            arg = args[at]
            if arg == "--":
                break
            if arg.startswith("-") and len(arg) > 1:  # an option, maybe with its value
                name = arg.partition("=")[0]
                if positional == 0 and unknown is None and name not in takes_value:
                    unknown = arg
                at += 2 if "=" not in arg and takes_value.get(arg, False) else 1
                continue
            positional += 1
            if positional == 2:  # KEY, then COMMAND
                args = [*args[:at], "--", *args[at:]]
                break
            at += 1
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            if unknown is None or exc.possibilities:  # none, or a typo ("Did you mean")
                raise
            # Found by a new user's walk-through: `run -k -- true` said only "No such
            # option '-k'", not how to lock a key that begins with -.
            raise click.UsageError(
                f"{exc.format_message()} A KEY that begins with - follows --:"
                f" keymutex run -- {shlex.quote(unknown)} -- COMMAND",
                ctx,
            ) from None


@cli.command(name="run", cls=_RunCommand)
@click.argument("key", type=KEY)
@click.argument(
    "command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- COMMAND [ARG]..."
)
@_store_options
@click.option(
    "--ttl",
    type=TTL,
    default=None,
    metavar="S",
    help="Seconds the lease lives unless renewed. It is renewed about every TTL/3 while"
    " COMMAND runs: TTL is how long the key stays locked after keymutex dies, and how"
    " long an unreachable store is tolerated.  [default: 30]",
)
@click.option(
    "--timeout",
    type=TIMEOUT,
    default=None,
    metavar="S",
    help="Seconds to wait for the lock: 0 tries once. Then exit 75.  [default: wait"
    " as long as it takes]",
)
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="Do not say on stderr that keymutex is waiting (errors are still shown).",
)
@click.option(
    "--hide-command",
    is_flag=True,
    help="Show others (ls, show, the dashboard) only COMMAND's program name, not its"
    " arguments, which may hold secrets.",
)
@click.option(
    "--info",
    "extra_info",
    type=_InfoObject(),
    default=None,
    metavar="JSON",
    help="Fields to show with the lease besides keymutex's own (cmd, host, pid, user),"
    ' as a JSON object: --info \'{"job": "nightly"}\'. At most 4 KiB in all.',
)
@click.pass_context
def run_command(
    ctx: click.Context,
    key: str,
    command: tuple[str, ...],
    store: str | None,
    namespace: str,
    ttl: float | None,
    timeout: float | None,
    quiet: bool,
    hide_command: bool,
    extra_info: dict[str, Any] | None,
) -> None:
    """Run COMMAND while holding the lock KEY; exit with COMMAND's status.

    Waits for KEY (up to --timeout; if KEY is held, says so and by whom on stderr
    unless --quiet), then runs COMMAND with KEYMUTEX_FENCE, KEYMUTEX_TOKEN and
    KEYMUTEX_KEY added to its environment, renews the lease in the background while
    it runs, and releases it when it ends, whatever its status. Put -- before
    COMMAND when it has options of its own.

    \b
    Exit status:
      COMMAND's status, or 128+N if COMMAND was killed by signal N (as a shell does)
      75   KEY was not acquired within --timeout (the holder is named on stderr)
      127  COMMAND was not found, 126 it could not be executed (the lock is released)
      70   the lease was lost while COMMAND ran (see below)
      69   the store failed; 2 bad arguments

    \b
    Signals: SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1 and SIGUSR2 sent to keymutex
    are forwarded to COMMAND, and keymutex exits once COMMAND has; the first four also
    reach the processes COMMAND started (a script's own commands), as a terminal's
    would. Ctrl-C and Ctrl-\\ at a terminal already reach COMMAND (it is in the
    terminal's foreground process group), so they are not forwarded twice (a COMMAND
    that left that group, as GNU timeout and setsid do, is sent them); keymutex
    cannot tell them from a SIGINT or SIGQUIT sent to it with kill while it runs in a
    terminal's foreground, which is therefore not forwarded either (send SIGTERM, or
    signal COMMAND itself). A signal keymutex was started ignoring (nohup, a script's
    &) stays ignored, by COMMAND too. A signal that arrives while waiting for the lock
    stops the wait: COMMAND is not started and the exit status is 128+N; one that
    arrives after COMMAND ended stops the release: the lease expires by its TTL, exit
    status 128+N. When the signal that ended keymutex or COMMAND was sent to keymutex
    too (SIGHUP, SIGINT, SIGQUIT, SIGTERM), keymutex ends by it rather than exiting
    128+N, so that a script or loop running it stops at a Ctrl-C as for COMMAND alone.

    \b
    Lost lease: if renewing fails (the key was force-released or taken over, or the
    store stayed unreachable until the lease expired), the lock no longer protects
    COMMAND and another holder may already be running. keymutex then warns on stderr
    and sends SIGTERM to COMMAND and the processes it started (on Linux) rather than
    letting two holders overlap; it waits for COMMAND to end and exits 70, whatever
    COMMAND's status. While COMMAND runs, the lease is renewed every second (not only
    every TTL/3), so that a force release stops COMMAND within about a second. A
    resource that checks KEYMUTEX_FENCE rejects its late writes either way.

    \b
    A KEY that begins with - follows --: keymutex run -- -KEY -- COMMAND. A script
    without a #! line is run by /bin/sh.
    """
    if command[:1] == ("--",):  # `run -- -KEY -- COMMAND`: the first -- ended the options
        command = command[1:]
        if not command:
            raise click.UsageError("Missing argument '-- COMMAND [ARG]...'.", ctx)
    try:
        info = check_info(_lease_info(command, hide_command=hide_command, extra=extra_info))
    except ValueError as exc:
        if extra_info:  # the command line itself always fits (see _lease_info)
            raise click.BadParameter(str(exc), ctx, param_hint="'--info'") from None
        raise click.UsageError(str(exc), ctx) from None
    url = _store_url(store)
    if ttl is not None:
        _check_ttl_for(ctx, url, ttl)
    run = _Run(key, command, quiet=quiet, info=info)
    with _store_errors(url):
        status = asyncio.run(
            run.main(lambda: _open(ctx, AsyncLocks, url, namespace), ttl, timeout)
        )
    if status > 128 and status - 128 in run.received:  # ended by a signal sent to it too
        _die_by(status - 128)
    ctx.exit(status)


# What writing to stdout fails with, other than a closed pipe (click's own).
_OUTPUT_ERRORS = {errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG, errno.EBADF}


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of the ``keymutex`` console script and of ``python -m keymutex``.

    Output that cannot be written (a full disk, a closed terminal) is one line on
    stderr and exit 74 (EX_IOERR), not a traceback. (A closed pipe is click's: quiet.)
    """
    try:
        cli.main(args=args, prog_name="keymutex")
    except OSError as exc:
        if exc.errno not in _OUTPUT_ERRORS:
            raise
        with contextlib.suppress(OSError):
            sys.stderr.write(f"keymutex: cannot write output: {exc.strerror or exc}\n")
            sys.stderr.flush()
        sys.exit(EX_IOERR)

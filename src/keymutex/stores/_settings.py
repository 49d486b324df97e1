"""Store settings shared by the stores that parse their URLs themselves (etcd, ZooKeeper),
and the check of every store's duration options (``seconds``).

A store URL says everything the CLI and the lock server need, which take a URL alone:
credentials before the host (``scheme://user:password@host``, percent-encoded), and
non-secret settings in the query string. ``Locks(url, **options)`` may give the same
settings as keyword arguments instead (a password kept out of the URL), never both.
Everything is checked before anything is sent; no message shows a password.
"""

from __future__ import annotations

import math
import ssl
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import NamedTuple, TypeVar
from urllib.parse import SplitResult, parse_qsl, unquote

from keymutex._urls import redacted, split_url
from keymutex._validate import shown_number

__all__ = [
    "MAX_COUNT",
    "MAX_SECONDS",
    "TLS_OPTIONS",
    "Settings",
    "TlsFiles",
    "count",
    "digits",
    "redacted",
    "seconds",
    "settings_of",
    "text",
    "tls_files",
]

TLS_OPTIONS = ("ca_file", "cert_file", "key_file")
# Durations: up to 2**31 - 1 milliseconds (about 24.8 days), what every client library
# and socket here takes (libpq, redis-py, kazoo, etcd's gateway, socket timeouts).
MAX_SECONDS = 2_147_483.0
MAX_COUNT = 10_000  # connections in a pool

T = TypeVar("T")
_CREDENTIALS = ("username", "password")


def _from_text(store: str, name: str, value: str, parse: Callable[[str], T], kind: str) -> T:
    """A URL query's ``value`` read by ``parse``; what it must be, if it does not parse."""
    try:
        return parse(value)
    except ValueError:
        raise ValueError(f"{store} option {name} must be {kind}, not {value!r}") from None


def seconds(
    store: str, name: str, value: object, *, zero: str | None = None, text: bool = True
) -> float:
    """A number of seconds > 0 and at most ``MAX_SECONDS``; also 0 when ``zero`` says
    what 0 means. A str is read as a number when ``text`` (a value from a URL's query),
    else refused. Every store's durations (timeouts, intervals) go through here."""
    given = value
    if isinstance(value, str) and text:
        value = _from_text(store, name, value, float, "seconds")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{store} option {name} must be seconds (a number), not {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        number = math.inf if value > 0 else -math.inf
    low_ok = number >= 0 if zero else number > 0
    if not (low_ok and number <= MAX_SECONDS):  # also refuses NaN
        accepted = f"seconds >= 0 (0: {zero})" if zero else "seconds > 0"
        raise ValueError(
            f"{store} option {name} must be {accepted} and at most {MAX_SECONDS:.0f},"
            f" not {shown_number(given)}"
        )
    return number


def digits(text: str) -> bool:
    """Whether ``text`` is ASCII digits (``str.isdigit`` takes "٣" and "³" too)."""
    return text.isascii() and text.isdigit()


def count(store: str, name: str, value: object, *, minimum: int = 1, text: bool = True) -> int:
    """A whole number from ``minimum`` to ``MAX_COUNT`` (connections in a pool); a str
    is read as one when ``text`` (a value from a URL's query)."""
    given = value
    if isinstance(value, str) and text:
        value = _from_text(store, name, value, int, "an int")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{store} option {name} must be an int, not {value!r}")
    if not minimum <= value <= MAX_COUNT:
        raise ValueError(
            f"{store} option {name} must be an int from {minimum} to {MAX_COUNT},"
            f" not {shown_number(given)}"
        )
    return value


def text(store: str, settings: Mapping[str, object], name: str) -> str | None:
    value = settings.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(f"{store} option {name} must be a non-empty str, not {value!r}")
    return value


class TlsFiles(NamedTuple):
    ca_file: str | None
    cert_file: str | None
    key_file: str | None


def tls_files(store: str, settings: Mapping[str, object]) -> tuple[TlsFiles, ssl.SSLContext]:
    """The TLS files, checked by loading them into a client context (also returned):
    the server's certificate is checked against ``ca_file`` (else the system's CAs) and
    its host name, and ``cert_file``/``key_file`` are shown when the server asks."""
    files = TlsFiles(*(text(store, settings, name) for name in TLS_OPTIONS))
    if files.key_file is not None and files.cert_file is None:
        raise ValueError(f"{store} option key_file needs cert_file (the certificate it signs for)")
    try:
        context = ssl.create_default_context(cafile=files.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"{store} option ca_file {files.ca_file!r} is not a readable PEM file of CAs: {exc}"
        ) from None
    if files.cert_file is not None:
        try:
            context.load_cert_chain(files.cert_file, files.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"{store} options cert_file {files.cert_file!r} / key_file {files.key_file!r}:"
                f" not a readable PEM certificate and its private key: {exc}"
            ) from None
    return files, context


@dataclass(frozen=True, slots=True)
class Settings:
    """A store URL taken apart: ``netloc`` without credentials, the options merged."""

    parts: SplitResult
    shown: str  # the URL for messages (password replaced)
    netloc: str
    options: dict[str, object]
    credentials: tuple[str, str] | None
    tls: bool  # the scheme is the TLS one


def settings_of(
    url: str,
    options: Mapping[str, object],
    *,
    store: str,
    schemes: tuple[str, str],
    form: str,
    accepted: Collection[str],
) -> Settings:
    """Parse ``url`` (``schemes``: plain and TLS) and merge its query with ``options``.

    ``accepted``: the option names (keywords); all but the credentials may be in the
    query. TLS files are refused with the plain scheme.
    """
    unknown = set(options) - set(accepted)
    if unknown:
        raise TypeError(
            f"unknown {store} store options {sorted(unknown)}; accepted: {sorted(accepted)}"
        )
    shown = redacted(url)
    parts = split_url(url, store, form)
    username, password = parts.username, parts.password
    scheme = parts.scheme.lower()
    if scheme not in schemes:
        raise ValueError(f"{shown!r} is not a {store} URL ({form})")
    if parts.fragment:
        raise ValueError(f"{shown!r}: a {store} URL has no fragment ({form})")
    merged: dict[str, object] = dict(options)
    in_query = sorted(set(accepted) - set(_CREDENTIALS))
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in in_query:
            hint = (
                f" (credentials go before the host: {scheme}://user:password@host)"
                if name in (*_CREDENTIALS, "user")
                else ""
            )
            raise ValueError(
                f"{shown!r}: unknown query parameter {name!r}; accepted: {in_query}{hint}"
            )
        if name in merged:
            raise ValueError(f"{shown!r}: option {name!r} is given twice")
        merged[name] = value
    if username is not None or password is not None:
        if any(name in merged for name in _CREDENTIALS):
            raise ValueError(f"{shown!r}: credentials are given both in the URL and as options")
        if password is None:
            raise ValueError(f"{shown!r}: {store} authentication needs user:password@")
        merged["username"], merged["password"] = unquote(username or ""), unquote(password)
    credentials = None
    if any(name in merged for name in _CREDENTIALS):
        user, secret = text(store, merged, "username"), merged.get("password")
        if user is None or not isinstance(secret, str):
            raise ValueError(f"{store} authentication needs a username and a password (str)")
        credentials = (user, secret)
    tls = scheme == schemes[1]
    if not tls and any(name in merged for name in TLS_OPTIONS):
        raise ValueError(f"{shown!r}: {', '.join(TLS_OPTIONS)} are for {schemes[1]}:// (TLS)")
    return Settings(parts, shown, parts.netloc.rpartition("@")[2], merged, credentials, tls)

"""Store URL -> store driver, through the ``keymutex.stores`` entry points.

A new store is one module that exports a ``StoreDriver`` plus one entry point whose
name is the URL scheme (``sqlite = "keymutex.stores.sqlite:driver"``).
"""

from __future__ import annotations

import functools
import re
from importlib.metadata import EntryPoint, entry_points
from typing import cast
from urllib.parse import SplitResult, urlsplit

from keymutex._store import StoreDriver

__all__ = ["driver_for", "known_schemes", "redacted", "scheme_of", "scrubbed", "split_url"]

ENTRY_POINT_GROUP = "keymutex.stores"
# The extra that installs a scheme's client library, where it is not named as the scheme.
_EXTRAS = {
    "rediss": "redis",
    "unix": "redis",
    "redis+cluster": "redis",
    "redis+sentinel": "redis",
    "https": "http",
    "postgres": "postgresql",
    "mongodb+srv": "mongodb",
    "etcds": "etcd",
    "zookeepers": "zookeeper",
}
_SCHEME = re.compile(r"([a-zA-Z][a-zA-Z0-9+.\-]*):")
# Query options that carry a secret: a password, passwd or pass; any option whose name
# ends in password, secret or token (PostgreSQL's sslpassword, MongoDB's
# tlsCertificateKeyFilePassword, an api_token); MongoDB's authMechanismProperties.
_QUERY_PASSWORD = re.compile(
    r"(?i)([?&](?:[^&=#]*(?:password|passwd|secret|token)|pass|authmechanismproperties)=)[^&#]*"
)


def _password_span(url: str) -> tuple[int, int] | None:
    """Where ``url``'s password is (after ``user:``, before the ``@`` of the host).

    Errs on the side of hiding. A password with an unescaped ``/``, ``?``, ``#`` or
    ``@`` is found whole, whatever ``urlsplit`` would make of it: when the authority
    (up to the first ``/``, ``?`` or ``#``) holds no ``@``, the last ``@`` of the URL
    ends the password. A scheme written without ``//`` (``redis:/u:pw@…``,
    ``postgresql:u:pw@…``) hides the same. Found by review: a ``?`` or ``#`` in the
    password, or a mistyped ``//``, printed it in full.
    """
    # Spaces before the scheme are urlsplit's to strip: a URL with them still works.
    scheme = _SCHEME.match(url, len(url) - len(url.lstrip()))
    if scheme is None or scheme.group(1).lower() in ("sqlite", "memory"):  # paths, names
        return None
    start = scheme.end()
    while url.startswith("/", start):
        start += 1
    rest = url[start:]
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, cut)
    if at < 0:
        at = rest.rfind("@")
    if at < 0:
        return None
    # The user's colon is in the authority: one in the path or query is not (redis://h/0?
    # client_name=a:b@c has no password).
    colon = rest.find(":", 0, min(at, cut))
    if colon < 0:
        return None
    return start + colon + 1, start + at


def redacted(url: str) -> str:
    """``url`` without its password (after ``user:`` or as ``?password=``), for messages."""
    url = _QUERY_PASSWORD.sub(r"\1***", url)
    span = _password_span(url)
    if span is None:
        return url
    return f"{url[: span[0]]}***{url[span[1] :]}"


def scrubbed(text: str, url: str) -> str:
    """``text`` (a client library's message about ``url``) without ``url``'s password.

    The whole password, and each piece of it a parser may have split it into at ``/``,
    ``?``, ``#``, ``@`` or ``:`` when quoted (redis-py: "Port could not be cast to
    integer value as 'pa'").
    """
    secrets = [match.group(0).partition("=")[2] for match in _QUERY_PASSWORD.finditer(url)]
    span = _password_span(_QUERY_PASSWORD.sub(r"\1***", url))
    if span is not None:
        secrets.append(url[span[0] : span[1]])
    for secret in filter(None, secrets):
        text = text.replace(secret, "***")
        for piece in filter(None, re.split(r"[/?#@:]", secret)):
            for quote in "'\"":
                text = text.replace(f"{quote}{piece}{quote}", f"{quote}***{quote}")
    return text


def split_url(url: str, store: str, form: str) -> SplitResult:
    """``urlsplit(url)``; a URL that does not split is a ``ValueError`` naming it.

    A tab or line break is refused: ``urlsplit`` drops them without a word (as browsers
    do), so ``etcd://a\tb:2379`` would name the host ``ab``."""
    if any(c in url for c in "\t\r\n"):
        raise ValueError(
            f"{redacted(url)!r} is not a {store} URL ({form}): it has a tab or a line break in it"
        )
    try:
        return urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL", …
        raise ValueError(
            f"{redacted(url)!r} is not a {store} URL ({form}): {scrubbed(str(exc), url)}"
        ) from None


def check_host(host: str, url: str, store: str) -> None:
    """A host name or address of a store URL: refused if it has a space or a control
    character (found by review: ``memcached://cache host:11211`` was taken, and failed at
    the first call with a ``StoreError`` about a name that no resolver would take)."""
    bad = next((c for c in host if c.isspace() or ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ValueError(
            f"{redacted(url)!r}: the {store} host {host!r} has {bad!r} in it; a host is a"
            " name or an address, without spaces or control characters"
        )


@functools.cache
def _registry() -> dict[str, EntryPoint]:
    """Scheme -> entry point, read once per process: scanning every installed
    distribution's metadata costs milliseconds, and each ``Locks()`` needs it."""
    registry: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        registry.setdefault(ep.name, ep)  # the first, as entry_points(name=…) gave
    return registry


def known_schemes() -> list[str]:
    return sorted(_registry())


def scheme_of(url: object) -> str:
    """The URL's scheme, lower-cased; ``ValueError``/``TypeError`` if it has none."""
    if not isinstance(url, str):
        raise TypeError(
            f"url must be a str such as 'sqlite:///path/locks.db', not {type(url).__name__}"
        )
    match = _SCHEME.match(url)
    if match is None:
        raise ValueError(
            f"url {redacted(url)!r} does not parse as a store URL: expected scheme://…,"
            f" with a scheme among {', '.join(known_schemes())}"
        )
    return match.group(1).lower()


def driver_for(url: object) -> StoreDriver:
    """The driver of the URL's scheme; ``ValueError`` for an unknown scheme."""
    scheme = scheme_of(url)
    ep = _registry().get(scheme)
    if ep is not None:
        try:
            return cast(StoreDriver, ep.load())  # imported once: then a dict lookup
        except ModuleNotFoundError as exc:  # the store's client library is an extra
            extra = _EXTRAS.get(scheme, scheme)
            raise ImportError(
                f"the {scheme}:// store needs its client library (module"
                f" {(exc.name or '?').partition('.')[0]!r} is missing): pip install"
                f" 'keymutex[{extra}]'"
            ) from exc
    hint = ""
    if scheme in {"redis", "rediss", "postgresql", "postgres", "mongodb", "memcached", "etcd"}:
        hint = f" (the {scheme} store is not installed in this version of keymutex)"
    raise ValueError(
        f"unknown store URL scheme {scheme!r}{hint}; known schemes: {', '.join(known_schemes())}"
    )

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

__all__ = ["driver_for", "known_schemes", "redacted", "scheme_of", "split_url"]

ENTRY_POINT_GROUP = "keymutex.stores"
# The extra that installs a scheme's client library, where it is not named as the scheme.
_EXTRAS = {
    "rediss": "redis",
    "redis+cluster": "redis",
    "redis+sentinel": "redis",
    "https": "http",
    "postgres": "postgresql",
    "mongodb+srv": "mongodb",
    "etcds": "etcd",
    "zookeepers": "zookeeper",
}
_SCHEME = re.compile(r"([a-zA-Z][a-zA-Z0-9+.\-]*):")
_QUERY_PASSWORD = re.compile(r"(?i)([?&](?:password|passwd|pass)=)[^&#]*")


def redacted(url: str) -> str:
    """``url`` without its password (after ``user:`` or as ``?password=``), for messages.

    Errs on the side of hiding: a password with an unescaped ``/`` or ``@`` is hidden
    whole, whatever ``urlsplit`` would make of it.
    """
    url = _QUERY_PASSWORD.sub(r"\1***", url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    userinfo, at, after = rest[:cut].rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return f"{scheme}://{user}:***@{after}{rest[cut:]}"


def split_url(url: str, store: str, form: str) -> SplitResult:
    """``urlsplit(url)``; a URL that does not split is a ``ValueError`` naming it."""
    try:
        return urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL", …
        raise ValueError(f"{redacted(url)!r} is not a {store} URL ({form}): {exc}") from None


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
                f"the {scheme}:// store needs its client library (module {exc.name!r} is"
                f" missing): pip install 'keymutex[{extra}]'"
            ) from exc
    hint = ""
    if scheme in {"redis", "rediss", "postgresql", "postgres", "mongodb", "memcached", "etcd"}:
        hint = f" (the {scheme} store is not installed in this version of keymutex)"
    raise ValueError(
        f"unknown store URL scheme {scheme!r}{hint}; known schemes: {', '.join(known_schemes())}"
    )

"""API tokens from ``--token-file`` and what each may do (docs/http-api.md, Auth).

A token file names each token and grants it permissions per namespace and key
prefix: ``lock`` (acquire, renew, release, wait), ``read`` (holder, holders, events,
metrics) and ``admin`` (force-release). Tokens are compared in constant time and never
logged or shown; errors name the token only by its ``name``.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keymutex._client import MAX_OWNER_BYTES
from keymutex.server._input import STRICT_JSON, ApiError

__all__ = ["Auth", "Grant", "Identity", "load_token_file"]

PERMISSIONS = frozenset({"lock", "read", "admin"})
MIN_TOKEN_CHARS = 32
ANY_NAMESPACE = "*"


@dataclass(frozen=True, slots=True)
class Grant:
    namespace: str  # or "*": every namespace
    prefix: str
    allow: frozenset[str]

    def covers_namespace(self, namespace: str) -> bool:
        return self.namespace in (ANY_NAMESPACE, namespace)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is calling: the API token's name and grants (never its secret)."""

    name: str
    grants: tuple[Grant, ...]


@dataclass(frozen=True, slots=True)
class _Token:
    secret: bytes
    identity: Identity


def _fail(path: Path, message: str) -> ValueError:
    return ValueError(f"token file {str(path)!r}: {message}")


def _grant(path: Path, where: str, raw: object) -> Grant:
    if not isinstance(raw, dict):
        raise _fail(path, f"{where} must be an object {{namespace, prefix, allow}}")
    unknown = sorted(set(raw) - {"namespace", "prefix", "allow"})
    if unknown:
        raise _fail(path, f"{where} has unknown field(s) {unknown}")
    namespace, prefix, allow = raw.get("namespace"), raw.get("prefix", ""), raw.get("allow")
    if not isinstance(namespace, str):
        raise _fail(path, f'{where}.namespace must be a string (or "*" for every namespace)')
    if not isinstance(prefix, str):
        raise _fail(path, f"{where}.prefix must be a string")
    if (
        not isinstance(allow, list)
        or not allow
        or not all(isinstance(p, str) and p in PERMISSIONS for p in allow)
    ):
        raise _fail(path, f"{where}.allow must be a non-empty list among {sorted(PERMISSIONS)}")
    return Grant(namespace, prefix, frozenset(allow))


def _sendable(secret: str) -> bool:
    """Whether a client can send ``secret`` as it is, after ``Bearer `` in a header:
    spaces around it are stripped on the way, and a header holds no control characters."""
    return all("!" <= char <= "~" for char in secret)


def load_token_file(path: str | Path) -> list[tuple[str, Identity]]:
    """The (secret, identity) pairs of a token file; ``ValueError`` naming what is wrong."""
    path = Path(path)
    try:
        data: Any = STRICT_JSON.decode(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise _fail(path, f"cannot be read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise _fail(path, f"is not JSON: {exc}") from None
    if (
        not isinstance(data, dict)
        or set(data) != {"tokens"}
        or not isinstance(data["tokens"], list)
    ):
        raise _fail(path, 'must be a JSON object {"tokens": [...]}')
    result: list[tuple[str, Identity]] = []
    names: set[str] = set()
    secrets: set[str] = set()
    for index, entry in enumerate(data["tokens"]):
        where = f"tokens[{index}]"
        if not isinstance(entry, dict):
            raise _fail(path, f"{where} must be an object {{name, token, grants}}")
        unknown = sorted(set(entry) - {"name", "token", "grants"})
        if unknown:
            raise _fail(path, f"{where} has unknown field(s) {unknown}")
        name, secret, grants = entry.get("name"), entry.get("token"), entry.get("grants")
        if (
            not isinstance(name, str)
            or not name.strip()
            or len(name.encode("utf-8", "replace")) > MAX_OWNER_BYTES
            or not name.isprintable()
            or name in names
        ):
            raise _fail(
                path,
                f"{where}.name must be a string of 1 to {MAX_OWNER_BYTES} bytes, not blank,"
                " without control characters (it is the default owner of its leases and what"
                " the logs show), unique in the file",
            )
        if not isinstance(secret, str) or len(secret) < MIN_TOKEN_CHARS or not _sendable(secret):
            raise _fail(
                path,
                f"{where}.token ({name}) must be at least {MIN_TOKEN_CHARS} visible ASCII"
                " characters, without spaces (as a client sends it after 'Bearer ')",
            )
        if secret in secrets:
            raise _fail(path, f"{where}.token ({name}) is the same as another token's")
        if not isinstance(grants, list):
            raise _fail(path, f"{where}.grants must be a list")
        names.add(name)
        secrets.add(secret)
        identity = Identity(
            name,
            tuple(_grant(path, f"{where}.grants[{i}]", g) for i, g in enumerate(grants)),
        )
        result.append((secret, identity))
    return result


class Auth:
    """Checks bearer tokens and permissions; ``open`` (no token file) allows everything."""

    def __init__(self, tokens: Sequence[tuple[str, Identity]] | None) -> None:
        self.open = tokens is None
        self._tokens = [_Token(secret.encode(), identity) for secret, identity in tokens or ()]

    def identify(self, authorization: str | None) -> Identity | None:
        """The caller's identity from its ``Authorization`` header (``None`` when open).

        Raises ``ApiError`` 401 for a missing or unknown token. Every known token is
        compared, each in constant time, so timing does not tell which one nearly matched.
        """
        if self.open:
            return None
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ApiError(
                401,
                "unauthorized",
                "this server needs an API token: send 'Authorization: Bearer <token>'",
                headers={"WWW-Authenticate": 'Bearer realm="keymutex"'},
            )
        secret = given.strip().encode("utf-8", "surrogateescape")
        found = None
        for token in self._tokens:
            if hmac.compare_digest(secret, token.secret) and found is None:
                found = token.identity
        if found is None:
            raise ApiError(
                401,
                "unauthorized",
                "unknown API token",
                headers={"WWW-Authenticate": 'Bearer realm="keymutex", error="invalid_token"'},
            )
        return found

    @staticmethod
    def _forbidden(who: Identity, permission: str, what: str) -> ApiError:
        return ApiError(
            403, "forbidden", f"API token {who.name!r} has no {permission!r} permission {what}"
        )

    def require_key(
        self, who: Identity | None, permission: str, namespace: str, keys: Sequence[str]
    ) -> None:
        """``permission`` on every one of ``keys`` in ``namespace``, else 403."""
        if who is None:
            return
        for key in keys:
            if not any(
                permission in g.allow
                and g.covers_namespace(namespace)
                and key.startswith(g.prefix)
                for g in who.grants
            ):
                raise self._forbidden(
                    who, permission, f"on key {key!r} in namespace {namespace!r}"
                )

    def readable_prefixes(self, who: Identity | None, namespace: str, prefix: str) -> list[str]:
        """The key prefixes ``who`` may read within ``prefix``; 403 when there are none.

        ``[""]`` means every key. A listing shows only keys under one of these.
        """
        if who is None:
            return [""]
        found = []
        for grant in who.grants:
            if "read" not in grant.allow or not grant.covers_namespace(namespace):
                continue
            if prefix.startswith(grant.prefix):
                return [""]  # the whole listing is covered
            if grant.prefix.startswith(prefix):
                found.append(grant.prefix)
        if not found:
            raise self._forbidden(
                who, "read", f"on keys starting with {prefix!r} in namespace {namespace!r}"
            )
        return found

    def require_everywhere(self, who: Identity | None, permission: str) -> None:
        """``permission`` on every namespace (``"*"``), for server-wide reads: ``/metrics``
        names every namespace in its labels, which a token of one may not know of."""
        if who is None or any(
            grant.namespace == ANY_NAMESPACE and permission in grant.allow for grant in who.grants
        ):
            return
        raise self._forbidden(who, permission, f'on every namespace ("{ANY_NAMESPACE}")')

"""The lock server: the HTTP API of docs/http-api.md over any store, on ``AsyncLocks``.

Each namespace is served by one ``AsyncLocks`` (opened lazily, the idle ones closed
beyond a bound), so validation and waiting are the library's own: an acquire with a
timeout waits inside ``AsyncLocks``, woken by the store's notification when it has
one. The server acquires *for* its callers: their owner, and the token the ``http://``
store chose (a private field of the client's request, ``_Request.owner``/``token``).

``wait`` (a long poll for "the lease with this fence no longer holds the key") checks
the key on arrival, then parks until a change made through this server, the holder's
expiry, or a recheck every ``RECHECK_INTERVAL`` (for changes made in the store by
others). On a store whose waiters are woken without queueing for the key
(``notifies`` and not ``fair``) it also listens to the store's own waiter; a fair
store's waiter queues for the key and would be handed it, so it is not used there.

Every answer is JSON: errors are 4xx with a stable ``error`` code, 503 when the store
fails; an unexpected exception is logged and answered 503 ``internal_error``, never
with a stack trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import ipaddress
import json
import logging
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import unquote_to_bytes

from starlette.applications import Starlette
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from keymutex import _clock
from keymutex._client import AsyncLocks
from keymutex._errors import Locked, LockError, LockLost, StoreError
from keymutex._lease import AsyncLease, Holder
from keymutex._store import Capabilities, RenewRequest
from keymutex._urls import scheme_of
from keymutex._validate import MIN_TTL, check_ttl
from keymutex._wait import EXPIRY_MARGIN, RECHECK_INTERVAL
from keymutex.server import _input as field
from keymutex.server._auth import Auth, Identity, load_token_file
from keymutex.server._input import (
    DEFAULT_TTL,
    MAX_BODY_BYTES,
    SHUTTING_DOWN,
    ApiError,
    Fields,
    holder_json,
    invalid,
    not_utf8,
    parse_body,
    query_fields,
    query_params,
    too_large,
)
from keymutex.server._metrics import CONTENT_TYPE_LATEST, Metrics, MetricsMiddleware
from keymutex.server._openapi import openapi_document
from keymutex.server._protocol import HEAD_LIMIT, HEAD_TOO_LARGE_ERROR
from keymutex.server._state import Changes, Namespaces

__all__ = ["create_app"]

T = TypeVar("T")
LOG = logging.getLogger("keymutex.server")

STATIC = Path(__file__).parent / "static"
HEARTBEAT = 4.0  # seconds between event-stream snapshots when nothing changes (doc: <= 5)
COALESCE = 0.1  # after a change, an event stream waits this long: one snapshot per burst
STREAM_ROWS = 500  # holders (and waited-for keys) an event snapshot lists; "total" counts all
SHARED_FOR = 1.0  # a heartbeat snapshot may be one read this long ago for another stream
FORCE_RELEASE_TTL = 5.0  # the lease force-release takes over, then gives back at once
HEALTH_KEY = "keymutex:healthz"  # read (never written) by /healthz to reach the store


class _KeyConvertor(PathConvertor):
    """A key in a page's path: any characters, a newline too (``path`` stops at one,
    so the edit page of such a key, which the API takes, was a 404)."""

    regex = r"[\s\S]*"


register_url_convertor("keymutex_key", _KeyConvertor())


# Built once: ``json.dumps`` with options builds a new encoder per call.
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_JSON_ASCII = json.JSONEncoder(separators=(",", ":"))


class JSONResponse(Response):
    """JSON as UTF-8; text that UTF-8 cannot carry (a lone surrogate) as \\u escapes."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        try:
            return _JSON.encode(content).encode()
        except UnicodeEncodeError:
            return _JSON_ASCII.encode(content).encode()


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _store_failed(exc: StoreError) -> JSONResponse:
    LOG.warning("the store failed: %s", exc)
    return JSONResponse(
        {"error": "store_unavailable", "message": f"the lock server's store failed: {exc}"},
        status_code=503,
    )


# -- exception handling --------------------------------------------------------------


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _on_store_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StoreError)
    return _store_failed(exc)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        error, message = "not_found", f"no such route: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        error, message = "method_not_allowed", f"{request.method} is not allowed here"
    else:
        error, message = "invalid_argument", str(exc.detail)
    status = exc.status_code if 400 <= exc.status_code < 500 else 400
    return JSONResponse(
        {"error": error, "message": message}, status_code=status, headers=exc.headers
    )


class _Guard:
    """The first and last line: a request head over ``HEAD_LIMIT`` is refused (431),
    and an exception no handler took is logged and answered 503 JSON.

    (``keymutex serve`` stops a head that large while it arrives; this is for the
    parsers that read one whole, as h11 does when it comes in one piece.)

    A request that the ASGI server cancels as it shuts down (uvicorn, when its graceful
    timeout ends: its store did not answer) is answered 503 ``shutting_down`` in JSON.
    Found by review: uvicorn answered it a plain-text 500, with a traceback in the log.
    """

    def __init__(self, app: ASGIApp, stopping: asyncio.Event) -> None:
        self.app = app
        self.stopping = stopping

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = len(scope.get("raw_path") or b"") + len(scope["query_string"])
        head += sum(len(name) + len(value) + 4 for name, value in scope["headers"])
        if head > HEAD_LIMIT:
            await HEAD_TOO_LARGE(scope, receive, send)
            return
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except ClientDisconnect:
            return  # nobody to answer
        except asyncio.CancelledError:
            if started or not self.stopping.is_set():
                raise
            with contextlib.suppress(OSError, RuntimeError):  # the caller may be gone
                await CUT_BY_SHUTDOWN(scope, receive, send)
        except Exception:
            LOG.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            if not started:
                response = JSONResponse(
                    {
                        "error": "internal_error",
                        "message": "the lock server failed to answer; the error was logged",
                    },
                    status_code=503,
                )
                await response(scope, receive, send)


HEAD_TOO_LARGE = JSONResponse(HEAD_TOO_LARGE_ERROR, status_code=431)
CUT_BY_SHUTDOWN = JSONResponse(
    {
        "error": "shutting_down",
        "message": (
            "the lock server shut down before its store answered: a change asked for may"
            " or may not have been made; ask another server, or this one when it is back"
        ),
    },
    status_code=503,
)


def _charset(parameters: str) -> str | None:
    """The ``charset`` of a Content-Type's parameters (after its ``;``), lower-cased."""
    for parameter in parameters.split(";"):
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return None


def _is_rebinding_proof_host(host: str) -> bool:
    """Whether a ``Host`` header is an IP address or localhost: no name that DNS, hence
    a stranger, could point at this machine."""
    if host.startswith("["):  # [::1]:7420
        name = host[1 : host.find("]")] if "]" in host else ""
    else:
        name, colon, port = host.rpartition(":")
        if not (colon and port.isdigit()):
            name = host
    name = name.rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _own_host(scope: Scope) -> str:
    """``Host`` values this server answers, by the address and port it was reached at.

    Found by a new user's walk-through: the refusal gave ``127.0.0.1:7420`` whatever
    port the server listened on."""
    server = scope.get("server")
    if not server or server[1] is None:  # a Unix socket, or no address known
        return "127.0.0.1, localhost, [::1]"
    address, port = server
    own = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    others = [
        f"{name}:{port}" for name in ("localhost", "[::1]") if name != own.rpartition(":")[0]
    ]
    return ", ".join([own, *others])


class _NoRebinding:
    """Without a token file: refuse requests addressed by a DNS name other than localhost.

    Such a server binds loopback only, yet a web page can still reach it through its
    visitor's browser, under a name of its own that it points at 127.0.0.1 (DNS
    rebinding). The request then says that name in ``Host``: refused, it can neither
    take nor release a lock. An IP address in ``Host`` cannot be rebound (a TCP proxy or
    port forward in front of the server may use one), and a request without ``Host``
    (HTTP/1.0) comes from no browser.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host")
            if host is not None and not _is_rebinding_proof_host(host):
                refusal = ApiError(
                    403,
                    "forbidden",
                    "this lock server has no token file, so it answers only requests"
                    f" addressed to an IP address or localhost (Host: {_own_host(scope)}),"
                    f" not to a DNS name such as {host[:100]!r}",
                )
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


@contextlib.contextmanager
def _arguments() -> Any:
    """A ``TypeError``/``ValueError`` from the library's own checks is a 400."""
    try:
        yield
    except (TypeError, ValueError, OverflowError) as exc:
        raise invalid(str(exc)) from None


# -- waiting ---------------------------------------------------------------------------


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T], stopping: asyncio.Event) -> T:
    """Await ``work``; cancel it if the caller goes away first (``ClientDisconnect``), or
    if the server starts shutting down (a 503 ``shutting_down``).

    A waiting acquire that is cancelled gives back a grant landing meanwhile
    (``AsyncLocks``), so a caller that hangs up leaves no lease behind. At shutdown the
    503 does not wait for that clean-up more than ``STOP_GRACE``: found by review, an
    acquire leaving its queue in a store that did not answer (Redis stopped) held the
    503 until uvicorn's graceful 3 s ran out, and the caller got a plain-text 500. The
    clean-up goes on in the background, as long as the store and the process allow.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait((task, gone, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in (task, gone, stop):
            if not future.done():
                future.cancel()
        if stop.done() and not stop.cancelled():
            await asyncio.wait([task], timeout=STOP_GRACE)
        if not task.done():
            _BACKGROUND.add(task)
            task.add_done_callback(_ended_in_background)
        results = await asyncio.gather(
            *([task] if task.done() else []), gone, stop, return_exceptions=True
        )
    if not task.done():
        raise SHUTTING_DOWN
    if task.cancelled() or isinstance(results[0], asyncio.CancelledError):
        if stop.done() and not stop.cancelled():
            raise SHUTTING_DOWN
        raise ClientDisconnect()
    result = task.result()
    if gone.done() and not gone.cancelled() and gone.exception() is None:
        await _caller_gone(result)  # the grant and the hang-up came together
    return result


STOP_GRACE = 0.5  # seconds a request cancelled by shutdown may take to clean up
_BACKGROUND: set[asyncio.Future[Any]] = set()  # their clean-up, when it takes longer


def _ended_in_background(task: asyncio.Future[Any]) -> None:
    _BACKGROUND.discard(task)
    if not task.cancelled() and task.exception() is not None:
        LOG.warning("a request cancelled by shutdown ended with: %s", task.exception())


async def _unless_gone(request: Request, lease: AsyncLease) -> AsyncLease:
    """``lease``, unless its caller is already gone: a client that gave up on a busy
    server before its turn came, or one that half-closed its connection after sending
    (which reads the same as a hang-up)."""
    if await request.is_disconnected():
        await _caller_gone(lease)
    return lease


async def _caller_gone(result: object) -> NoReturn:
    """End a request whose caller is gone (``ClientDisconnect``), giving back the lease
    granted for it, if any: nobody could ever learn its token, so it would hold the key
    for its whole TTL."""
    if isinstance(result, AsyncLease):
        with contextlib.suppress(LockError):
            await result.release()
    raise ClientDisconnect()


async def _first(*waits: Awaitable[Any], timeout: float | None = None) -> None:
    """Until one of ``waits`` is done, or ``timeout`` seconds pass; cancels the others."""
    futures = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(futures, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in futures:
            future.cancel()
        await asyncio.gather(*futures, return_exceptions=True)


def _ttl_from(received: float, ttl: float) -> float:
    """The TTL to ask the store for, so that a lease lasts ``ttl`` from the request's arrival.

    The time the server spends before the store's step (opening a namespace, say) is
    not added to the lease: a client counting ``ttl`` from when it sent the request
    sees the lease expire at most one network trip before the store does. Never below
    a tenth of ``ttl`` (a lease that would be born expired is still granted, briefly),
    nor below the library's least TTL.
    """
    return max(ttl - (_clock.monotonic() - received), ttl / 10, MIN_TTL)


def _sse(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {JSONResponse(None).render(data).decode()}\n\n"


View = tuple[str, str, tuple[str, ...]]  # namespace, prefix, the prefixes the caller may read


class _Snapshots:
    """Event-stream snapshots, read and encoded once per view however many streams show it.

    Found by review: each stream read and encoded the whole namespace on its own, after
    every change and renewal and at every heartbeat; with 10,000 leases (2 MB a
    snapshot) one open dashboard made a renewal take 50 ms, four took 500 ms. Now a
    stream takes a snapshot whose read *started* after the moment it needs (the change
    it was told of, or its heartbeat less ``SHARED_FOR``): one being read already, or
    the last one read, else a new read. Streams of one view woken by one change share
    one read.

    A stream told of a change waits ``pause(view)`` before it asks: ``COALESCE``, or
    nine times the view's last read, up to 1 s, so that a large namespace under
    constant renewals is read a tenth of the time at most (and its page still shows a
    change within a second, as documented).
    """

    def __init__(self, read: Callable[[View], Awaitable[str]]) -> None:
        self._read = read
        self._latest: dict[View, tuple[float, asyncio.Future[str]]] = {}
        self._took: dict[View, float] = {}  # how long the view's last read took

    def pause(self, view: View) -> float:
        return max(COALESCE, min(1.0, 9 * self._took.get(view, 0.0)))

    async def _timed(self, view: View) -> str:
        started = _clock.monotonic()
        try:
            return await self._read(view)
        finally:
            self._took[view] = _clock.monotonic() - started

    async def get(self, view: View, since: float) -> str:
        found = self._latest.get(view)
        if found is None or found[0] < since:
            now = _clock.monotonic()
            for old in [v for v, (started, _) in self._latest.items() if started < now - 60]:
                del self._latest[old]  # views nobody asked for in a minute
                self._took.pop(old, None)
            future = asyncio.ensure_future(self._timed(view))
            future.add_done_callback(_retrieved)
            found = self._latest[view] = (now, future)
        # Shielded: a stream whose client left does not cancel the read others await.
        return await asyncio.shield(found[1])


def _retrieved(future: asyncio.Future[str]) -> None:
    """Mark a failed read's error as seen: every stream that awaited it has its copy."""
    if not future.cancelled():
        future.exception()


# The pages act (force release, take over an edit lock) on a click: another site must not
# show them in a frame under its own buttons (clickjacking). Found by review.
_NOT_FRAMED = {
    "Content-Security-Policy": "frame-ancestors 'self'",
    "X-Frame-Options": "SAMEORIGIN",
}


# -- the API -----------------------------------------------------------------------------


class _Server:
    """The endpoints and what they share."""

    def __init__(
        self,
        store_url: str,
        default: AsyncLocks,
        *,
        auth: Auth,
        max_wait: float,
        max_namespaces: int,
    ) -> None:
        self.scheme = scheme_of(store_url)
        self.capabilities: Capabilities = default._store.capabilities
        self.auth = auth
        self.max_wait = max_wait
        self.metrics = Metrics()
        self.changes = Changes(self.metrics.waiting.set)
        self.snapshots = _Snapshots(self.stream_snapshot)
        self.namespaces = Namespaces(store_url, max_namespaces, self.metrics)
        # Set when shutdown starts: requests waiting are answered, event streams end.
        self.stopping = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.namespaces.add("", default)

    # -- request plumbing

    def identify(self, request: Request) -> Identity | None:
        sent = request.headers.getlist("authorization")
        if len(sent) > 1:  # which one counts would depend on the proxies on the way
            raise invalid(f"send one Authorization header, not {len(sent)}")
        return self.auth.identify(sent[0] if sent else None)

    @staticmethod
    async def body(request: Request, allowed: Iterable[str]) -> Fields:
        content_type = request.headers.get("content-type", "")
        media_type, _, parameters = content_type.partition(";")
        if media_type.strip().lower() != "application/json":
            raise ApiError(
                415,
                "unsupported_media_type",
                "send the body as JSON with 'Content-Type: application/json'",
            )
        charset = _charset(parameters)
        if charset is not None and charset not in ("utf-8", "utf8"):
            raise ApiError(
                415,
                "unsupported_media_type",
                f"send the body as UTF-8 JSON: charset {charset!r} is not accepted",
            )
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            raise ApiError(
                415,
                "unsupported_media_type",
                f"send the body unencoded: Content-Encoding {encoding!r} is not accepted",
            )
        if request.scope["query_string"]:
            raise invalid(
                f"{request.method} {request.url.path} takes no query parameters: send every"
                " field in the JSON body"
            )
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise invalid("Content-Length must be a number of bytes")
            if int(declared) > MAX_BODY_BYTES:
                raise too_large()
        received = bytearray()
        async for chunk in request.stream():
            received += chunk
            if len(received) > MAX_BODY_BYTES:
                break
        return Fields(parse_body(bytes(received)), allowed, where="field")

    @staticmethod
    def query(request: Request, allowed: Iterable[str]) -> Fields:
        return query_fields(request.scope["query_string"], allowed)

    @staticmethod
    def peer(request: Request) -> str:
        return request.client.host if request.client else "unknown"

    async def waiting(
        self,
        request: Request,
        namespace: str,
        key: str,
        kind: str,
        work: Awaitable[T],
        *,
        counted: bool = True,
    ) -> T:
        """Run ``work`` as a request waiting on ``key``: timed, cancelled on hang-up, and
        (unless not ``counted``: a holder watching its own lease) counted as a waiter."""
        label = self.metrics.namespace(namespace)
        self.metrics.waits.labels(label, kind).inc()
        started = _clock.monotonic()
        try:
            with self.changes.waiting_on(namespace, key) if counted else contextlib.nullcontext():
                return await _unless_disconnected(request, work, self.stopping)
        finally:
            self.metrics.wait_seconds.labels(label, kind).observe(_clock.monotonic() - started)

    @staticmethod
    def lease_json(
        lease: AsyncLease, ttl: float, received: float, *, waited: bool = False
    ) -> dict[str, Any]:
        """A lease as the API shows it to its holder.

        ``expires_in`` counts from when the request was ``received``: a client that
        counts it from when it sent the request never overstates what the store
        granted, and loses only the request's way here, not the server's work (at
        most ``ttl``) — nor, after an acquire that may have ``waited`` here for its
        turn, that wait (then it may exceed ``ttl``). A client that counted it from
        when the reply came would overstate it by the reply's way back, which nothing
        bounds (a paused client, a slow network).
        """
        expires_in = max(0.0, lease.remaining + _clock.monotonic() - received)
        return {
            "key": lease.key,
            "owner": lease.owner,
            "info": lease.info,
            "fence": lease.fence,
            "acquired_at": lease.acquired_at,
            "expires_at": lease.expires_at,
            "expires_in": expires_in if waited else min(ttl, expires_in),
            "token": lease.token,
            "ttl": ttl,
        }

    # -- /v1 endpoints

    async def acquire(self, request: Request) -> Response:
        received = _clock.monotonic()
        who = self.identify(request)
        fields = await self.body(
            request, ("namespace", "key", "ttl", "timeout", "info", "steal", "owner", "token")
        )
        namespace = fields.get("namespace", field.namespace, "")
        key = fields.get("key", field.key)
        ttl = fields.get("ttl", field.ttl, DEFAULT_TTL)
        timeout = fields.get("timeout", field.timeout, 0.0)
        info = fields.get("info", field.info, None)
        steal = fields.get("steal", field.flag, False)
        owner = fields.get("owner", field.owner, None)
        token = fields.get("token", field.caller_token, None)
        self.auth.require_key(who, "lock", namespace, [key])
        if owner is None:
            owner = who.name if who is not None else self.peer(request)
        limit = 0.0 if steal else min(timeout, self.max_wait)
        async with self.namespaces.using(namespace) as locks:
            with _arguments():
                plan = dataclasses.replace(
                    locks._config.request(
                        key,
                        ttl if limit > 0 else _ttl_from(received, ttl),
                        limit,
                        False,
                        info,
                        steal,
                        None,
                    ),
                    owner=owner,
                    token=token,
                )
            try:
                if limit > 0:
                    lease = await self.waiting(
                        request, namespace, key, "acquire", locks._acquire(plan)
                    )
                else:
                    lease = await _unless_gone(request, await locks._acquire(plan))
            except Locked as exc:
                self.metrics.refusals.labels(self.metrics.namespace(namespace)).inc()
                held = f"held by {exc.holder.owner}" if exc.holder else "not free"
                raise ApiError(
                    409,
                    "locked",
                    f"{key} is {held}",
                    extra={"holder": holder_json(exc.holder, now=time.time())},
                ) from None
        self.metrics.acquires.labels(self.metrics.namespace(namespace)).inc()
        self.changes.changed(namespace, key)
        return JSONResponse(self.lease_json(lease, ttl, received, waited=limit > 0))

    async def renew(self, request: Request) -> Response:
        received = _clock.monotonic()
        who = self.identify(request)
        fields = await self.body(request, ("namespace", "key", "token", "ttl"))
        namespace = fields.get("namespace", field.namespace, "")
        key = fields.get("key", field.key)
        token = fields.get("token", field.token)
        ttl = fields.get("ttl", field.ttl, DEFAULT_TTL)
        self.auth.require_key(who, "lock", namespace, [key])
        async with self.namespaces.using(namespace) as locks:
            try:
                with _arguments():
                    lease = await locks.renew(key, token, _ttl_from(received, ttl))
            except LockLost as exc:
                raise self.lost(namespace, exc) from None
        self.metrics.renewals.labels(self.metrics.namespace(namespace)).inc()
        self.changes.renewed(namespace)
        return JSONResponse(self.lease_json(lease, ttl, received))

    def lost(self, namespace: str, exc: LockLost) -> ApiError:
        self.metrics.lost.labels(self.metrics.namespace(namespace)).inc()
        return ApiError(
            409,
            "lock_lost",
            f"the token no longer holds {exc.key}",
            extra={"holder": holder_json(exc.holder, now=time.time())},
        )

    async def renew_many(self, request: Request) -> Response:
        received = _clock.monotonic()
        who = self.identify(request)
        fields = await self.body(request, ("namespace", "leases"))
        namespace = fields.get("namespace", field.namespace, "")
        leases = fields.get("leases", field.renewals)
        self.auth.require_key(who, "lock", namespace, [key for key, _, _ in leases])
        if not leases:
            return JSONResponse({"results": []})
        async with self.namespaces.using(namespace) as locks:
            outcomes = await locks._store.renew_many(
                [RenewRequest(key, token, _ttl_from(received, ttl)) for key, token, ttl in leases]
            )
        now = time.time()
        results: list[dict[str, Any]] = []
        for (_, token, ttl), outcome in zip(leases, outcomes, strict=True):
            shown = holder_json(outcome.holder, now=now)
            if outcome.ok and shown is not None:
                if outcome.remaining is not None:  # measured by the store after receipt
                    shown["expires_in"] = min(ttl, outcome.remaining)
                results.append({**shown, "token": token, "ttl": ttl})
                self.metrics.renewals.labels(self.metrics.namespace(namespace)).inc()
                self.changes.renewed(namespace)
            else:
                self.metrics.lost.labels(self.metrics.namespace(namespace)).inc()
                results.append(
                    {
                        "error": "lock_lost",
                        "message": "the token no longer holds the key",
                        "holder": shown,
                    }
                )
        return JSONResponse({"results": results})

    async def release(self, request: Request) -> Response:
        who = self.identify(request)
        fields = await self.body(request, ("namespace", "key", "token"))
        namespace = fields.get("namespace", field.namespace, "")
        key = fields.get("key", field.key)
        token = fields.get("token", field.token)
        self.auth.require_key(who, "lock", namespace, [key])
        async with self.namespaces.using(namespace) as locks:
            try:
                with _arguments():
                    await locks.release(key, token)
            except LockLost as exc:
                self.changes.changed(namespace, key)  # an expired lease was cleared
                raise self.lost(namespace, exc) from None
        self.metrics.releases.labels(self.metrics.namespace(namespace)).inc()
        self.changes.changed(namespace, key)
        return JSONResponse({"released": True})

    async def wait(self, request: Request) -> Response:
        who = self.identify(request)
        fields = await self.body(request, ("namespace", "key", "fence", "timeout", "holding"))
        namespace = fields.get("namespace", field.namespace, "")
        key = fields.get("key", field.key)
        fence = fields.get("fence", field.fence)
        timeout = fields.get("timeout", field.timeout)
        holding = fields.get("holding", field.flag, False)
        if holding and fence is None:
            raise invalid("holding: true needs fence, the fence of the caller's own lease")
        self.auth.require_key(who, "lock", namespace, [key])
        limit = min(timeout, self.max_wait)
        async with self.namespaces.using(namespace) as locks:
            changed, holder = await self.waiting(
                request,
                namespace,
                key,
                "wait",
                self.watch(locks, namespace, key, fence, limit),
                counted=not holding,
            )
        return JSONResponse({"changed": changed, "holder": holder_json(holder, now=time.time())})

    async def watch(
        self, locks: AsyncLocks, namespace: str, key: str, fence: int | None, limit: float
    ) -> tuple[bool, Holder | None]:
        """Until ``key`` is free or held by another fence than ``fence``, or ``limit`` s."""
        deadline = _clock.monotonic() + limit
        store = locks._store
        listens = store.capabilities.notifies and not store.capabilities.fair
        waiter = await store.waiter(key) if listens else None
        try:
            while True:
                # Taken before the read: a change landing after it still wakes us.
                event = self.changes.keys.event((namespace, key))
                holder = await locks.holder(key)
                if holder is None or holder.fence != fence:
                    return True, holder
                left = deadline - _clock.monotonic()
                if left <= 0:
                    return False, holder
                until_expiry = max(0.0, holder.expires_at - time.time()) + EXPIRY_MARGIN
                park = min(left, RECHECK_INTERVAL, until_expiry)
                # Until a change here, the store's waiter rings, or the recheck is due.
                rings = [] if waiter is None else [waiter.wait(park)]
                await _first(event.wait(), *rings, timeout=park)
        finally:
            if waiter is not None:
                await waiter.aclose()

    async def holder(self, request: Request) -> Response:
        who = self.identify(request)
        query = self.query(request, ("namespace", "key"))
        namespace = query.get("namespace", field.namespace, "")
        key = query.get("key", field.key)
        self.auth.require_key(who, "read", namespace, [key])
        async with self.namespaces.using(namespace) as locks:
            holder = await locks.holder(key)
        return JSONResponse({"holder": holder_json(holder, now=time.time())})

    async def snapshot(
        self, namespace: str, prefix: str, visible: Sequence[str], rows: int | None = None
    ) -> dict[str, Any]:
        """What ``holders`` answers: the holders and waiting counts the caller may see;
        with ``rows``, those of the first ``rows`` keys, held or waited for, and
        ``total`` (holders). Found by review: cut to ``rows`` each, a held key past the
        holders' cut but within the waiting counts' was shown free on the dashboard."""
        async with self.namespaces.using(namespace) as locks:
            holders = await locks.holders(prefix)
        now = time.time()

        def shown(key: str) -> bool:
            return key.startswith(prefix) and any(key.startswith(p) for p in visible)

        held = [h for h in holders if shown(h.key)]
        waiting = [
            (key, count)
            for key, count in sorted(self.changes.waiting_in(namespace).items())
            if shown(key)
        ]
        total = len(held)
        if rows is not None:
            first = set(sorted({h.key for h in held} | {key for key, _ in waiting})[:rows])
            held = [h for h in held if h.key in first]
            waiting = [(key, count) for key, count in waiting if key in first]
        snapshot: dict[str, Any] = {
            "holders": [holder_json(h, now=now) for h in held],
            "waiting": dict(waiting),
        }
        if rows is not None:
            snapshot["total"] = total
        return snapshot

    async def stream_snapshot(self, view: View) -> str:
        """One ``holders`` event, ``STREAM_ROWS`` rows at most: a dashboard shows the
        first ones and the total (a prefix narrows it), and a namespace of 10,000
        leases does not send megabytes to each open page every few seconds."""
        namespace, prefix, visible = view
        snapshot = await self.snapshot(namespace, prefix, visible, rows=STREAM_ROWS)
        return _sse("holders", {**snapshot, "server_time": time.time()})

    async def holders(self, request: Request) -> Response:
        who = self.identify(request)
        query = self.query(request, ("namespace", "prefix"))
        namespace = query.get("namespace", field.namespace, "")
        prefix = query.get("prefix", field.prefix, "")
        visible = self.auth.readable_prefixes(who, namespace, prefix)
        return JSONResponse(await self.snapshot(namespace, prefix, visible))

    async def force_release(self, request: Request) -> Response:
        who = self.identify(request)
        fields = await self.body(request, ("namespace", "key", "reason", "fence"))
        namespace = fields.get("namespace", field.namespace, "")
        key = fields.get("key", field.key)
        reason = fields.get("reason", field.reason)
        fence = fields.get("fence", field.fence, None)
        self.auth.require_key(who, "admin", namespace, [key])
        by = who.name if who is not None else f"anonymous at {self.peer(request)}"
        async with self.namespaces.using(namespace) as locks:
            previous = await locks.holder(key)
            if previous is None:
                return JSONResponse({"released": False, "holder": None})
            if fence is not None and previous.fence != fence:
                # The lease the admin chose (the dashboard sends its fence) is gone, and
                # someone else holds the key now: theirs is not the one to release.
                raise ApiError(
                    409,
                    "locked",
                    f"{key} is now held by {previous.owner} (fence {previous.fence}),"
                    f" not by the lease of fence {fence}: nothing was released",
                    extra={"holder": holder_json(previous, now=time.time())},
                )
            # Take it over, then give it back: the fence moves on, the old token is dead.
            with _arguments():
                plan = dataclasses.replace(
                    locks._config.request(
                        key, FORCE_RELEASE_TTL, 0, False, {"force_release": reason}, True, None
                    ),
                    owner=f"force-release by {by}"[:200],
                )
            lease = await locks._acquire(plan)
            with contextlib.suppress(LockLost):  # expired already on a very slow store: free
                await lease.release()
        LOG.warning(
            "force-release of %r in namespace %r by %s, reason %r: displaced %r (fence %d)",
            key,
            namespace,
            by,
            reason,
            previous.owner,
            previous.fence,
        )
        self.metrics.force_releases.labels(self.metrics.namespace(namespace)).inc()
        self.changes.changed(namespace, key)
        return JSONResponse({"released": True, "holder": holder_json(previous, now=time.time())})

    async def events(self, request: Request) -> Response:
        who = self.identify(request)
        query = self.query(request, ("namespace", "prefix"))
        namespace = query.get("namespace", field.namespace, "")
        prefix = query.get("prefix", field.prefix, "")
        visible = self.auth.readable_prefixes(who, namespace, prefix)
        # Taken before the first snapshot, so no change slips in between. The first
        # snapshot is read before answering: a failing store is a plain 503.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if request.method == "HEAD":  # the headers only: a stream would never end
            return Response(media_type="text/event-stream", headers=headers)
        view = (namespace, prefix, tuple(visible))
        since = _clock.monotonic()
        changed = self.changes.namespaces.event(namespace)
        first = await self.snapshots.get(view, since)
        return StreamingResponse(
            self.stream(view, changed, first),
            media_type="text/event-stream",
            headers=headers,
        )

    async def stream(self, view: View, changed: asyncio.Event, event: str) -> AsyncIterator[str]:
        """A snapshot now, within ``COALESCE`` of each change, and every ``HEARTBEAT``
        (read then, or at most ``SHARED_FOR`` before for another stream of the view)."""
        while True:
            yield event
            try:
                async with asyncio.timeout(HEARTBEAT):
                    await _first(changed.wait(), self.stopping.wait())
            except TimeoutError:
                yield ": ping\n\n"
                since = _clock.monotonic() - SHARED_FOR
            else:
                if self.stopping.is_set():
                    return  # the page reconnects to whichever server comes up
                since = _clock.monotonic()  # a read started after the change shows it
                await asyncio.sleep(self.snapshots.pause(view))
            changed = self.changes.namespaces.event(view[0])
            while True:
                try:
                    event = await self.snapshots.get(view, since)
                    break
                except StoreError as exc:
                    yield _sse("error", {"error": "store_unavailable", "message": str(exc)})
                    await asyncio.sleep(HEARTBEAT)
                    since = _clock.monotonic()

    # -- the rest

    async def healthz(self, request: Request) -> Response:
        # No query parameters: an unknown one is refused as everywhere in the API (found
        # by a new user's walk-through: /healthz?x=1 was answered).
        self.query(request, ())
        async with self.namespaces.using("") as locks:
            await locks.holder(HEALTH_KEY)
        return JSONResponse(
            {
                "ok": True,
                "store": self.scheme,
                "durable_fences": self.capabilities.durable_fences,
            }
        )

    async def metrics_page(self, request: Request) -> Response:
        who = self.identify(request)
        self.auth.require_everywhere(who, "read")
        held: dict[str, int] = {}
        for namespace in self.namespaces.names():
            try:
                async with self.namespaces.visiting(namespace) as locks:
                    if locks is not None:  # not closed since
                        held[namespace] = len(await locks.holders(""))
            except StoreError as exc:  # one namespace's store failing leaves the others'
                LOG.warning("metrics: cannot count the leases of namespace %r: %s", namespace, exc)
            except Exception:  # a bug: its traceback
                LOG.exception("metrics: cannot count the leases of namespace %r", namespace)
        self.metrics.set_held(held)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())

    @staticmethod
    def page(
        name: str, fill: Callable[[Request, bytes], bytes] | None = None
    ) -> Callable[[Request], Awaitable[Response]]:
        """A page served from memory, read again when the file changes; ``fill`` makes
        the answer from the file's bytes and the request (the edit page's key).

        Not a ``FileResponse``: it hops to a worker thread four times per answer (stat,
        open, read, close), and each hop waits for the event loop's turn, which under
        load made the dashboard the slowest answer of the server. A ``stat`` of a local
        file in the loop costs microseconds. ``ETag`` answers revalidations with 304:
        the file's version is enough, as what ``fill`` adds depends on the URL only.
        """
        path = STATIC / name
        cache: dict[str, tuple[tuple[int, int], bytes]] = {}

        async def serve(request: Request) -> Response:
            try:
                found = path.stat()
            except OSError:
                found = None
            if found is None or not stat.S_ISREG(found.st_mode):
                raise ApiError(404, "not_found", f"this server has no page {name!r} installed")
            version = (found.st_mtime_ns, found.st_size)
            etag = f'"{version[0]:x}-{version[1]:x}"'
            headers = {"Cache-Control": "no-cache", "ETag": etag, **_NOT_FRAMED}
            if request.headers.get("if-none-match") == etag:
                return Response(status_code=304, headers=headers)
            cached = cache.get(name)
            if cached is None or cached[0] != version:
                cached = cache[name] = (version, await asyncio.to_thread(path.read_bytes))
            body = cached[1] if fill is None else fill(request, cached[1])
            return Response(body, media_type="text/html", headers=headers)

        return serve

    def shutting_down(self) -> None:
        """Answer the requests that wait (503 ``shutting_down``) and end event streams.

        Safe from any thread, and from a signal handler: call it when shutdown starts,
        before the server waits for its connections to close.
        """
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.stopping.set)

    def routes(self) -> list[BaseRoute]:
        post, get = ["POST"], ["GET"]
        return [
            Route("/v1/acquire", self.acquire, methods=post),
            Route("/v1/renew", self.renew, methods=post),
            Route("/v1/renew-many", self.renew_many, methods=post),
            Route("/v1/release", self.release, methods=post),
            Route("/v1/wait", self.wait, methods=post),
            Route("/v1/holder", self.holder, methods=get),
            Route("/v1/holders", self.holders, methods=get),
            Route("/v1/force-release", self.force_release, methods=post),
            Route("/v1/events", self.events, methods=get),
            Route("/healthz", self.healthz, methods=get),
            Route("/metrics", self.metrics_page, methods=get),
            Route("/openapi.json", self.openapi, methods=get),
            Route("/", self.page("index.html"), methods=get),
            Route(
                "/demo/edit/{key:keymutex_key}", self.page("edit.html", _edit_page), methods=get
            ),
            Mount(
                "/static",
                # keymutex.js links to clients/js/keymutex.js in a checkout (a wheel has
                # the file itself); a path still cannot leave the directory.
                app=_WholeFiles(
                    StaticFiles(directory=STATIC, check_dir=False, follow_symlink=True)
                ),
                name="static",
            ),
        ]


def _edit_page(request: Request, template: bytes) -> bytes:
    """edit.html for the key that the request names, with its way back to the server.

    The key is the rest of the path after the route's ``/demo/edit/`` (the first one the
    server sees: a proxy's base path is gone by then), decoded as every route's path,
    else the ``key`` query parameter: a browser drops a path's
    ``.`` and ``..`` segments, even percent-encoded, so those keys can only be asked for
    as ``/demo/edit/?key=..``. The page's ``<base>`` climbs one ``../`` per slash of the
    path as it arrived, to where the server is mounted, however deep below a proxy's
    base path. The page used to find both in its own address, after the *last*
    ``/demo/edit/``: a link that left a key such as ``a/demo/edit/b`` unencoded opened
    key ``b``, and looked for the page's script below ``a/`` (the page stayed blank).
    """
    path = request.scope.get("raw_path") or request.scope["path"].encode()
    # The path (as uvicorn decodes it) and the query (as Starlette does) read a
    # percent-escape that is not UTF-8 (%FF) as U+FFFD: found by a new user's
    # walk-through, /demo/edit/%FF and /demo/edit/%FE opened one key, "\ufffd", that
    # neither link names. Refused as the API refuses ?key=%FF.
    try:
        unquote_to_bytes(path).decode("utf-8")
    except UnicodeDecodeError:
        raise not_utf8("the page's path") from None
    query = dict(query_params(request.scope["query_string"]))
    key = request.path_params["key"] or query.get("key", "")
    mount = "../" * (path.count(b"/") - 1) or "./"
    # "<" escaped: a key cannot end the script element ("</script>") it is written in.
    page = _JSON_ASCII.encode({"key": key}).replace("<", "\\u003c")
    return template.replace(b"{{mount}}", mount.encode()).replace(b"{{page}}", page.encode())


class _WholeFiles:
    """Static files answered whole, whatever ``Range`` asks: Starlette answers a range
    it cannot serve (``bytes=abc``, ``bytes=5-2``, past the end) with a plain-text 400
    or 416 of its own, past the app's JSON errors. The files are small; a server may
    ignore ``Range`` (RFC 9110, 14.2)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = [(n, v) for n, v in scope["headers"] if n not in (b"range", b"if-range")]
            scope = {**scope, "headers": headers}
        await self._app(scope, receive, send)


def _log_runtime() -> None:
    """Say at start-up whether the fast event loop and HTTP parser are in use.

    uvicorn picks uvloop and httptools when they are installed (``loop="auto"``,
    ``http="auto"``, its defaults; the ``server`` extra installs both): together they
    take 30-40 % less of the server's CPU per request (benchmarks/bench_server.py).
    Without them it runs on asyncio and h11, which is logged as a warning. The loop is
    the one running; the parser is the one uvicorn's ``http="auto"`` picks (an ASGI app
    cannot see which one a server was told to use).
    """
    loop = type(asyncio.get_running_loop())
    fast_loop = loop.__module__.partition(".")[0] == "uvloop"
    try:
        importlib.import_module("httptools")  # as uvicorn's http="auto" decides
        fast_parser = True
    except ImportError:
        fast_parser = False
    missing = [name for name, ok in (("uvloop", fast_loop), ("httptools", fast_parser)) if not ok]
    LOG.log(
        logging.WARNING if missing else logging.INFO,
        "event loop %s.%s, HTTP parser %s%s",
        loop.__module__,
        loop.__qualname__,
        "httptools" if fast_parser else "h11",
        f"; without {' and '.join(missing)} each request costs more CPU (pip install"
        " 'keymutex[server]' installs them where they are available)"
        if missing
        else "",
    )


def create_app(
    store_url: str,
    *,
    token_file: str | Path | None = None,
    max_wait: float = 30.0,
    max_namespaces: int = 64,
) -> Starlette:
    """The lock server as an ASGI app, serving the store at ``store_url``.

    - ``token_file``: API tokens and their grants (docs/http-api.md, Auth); without it
      every request addressed to an IP address or localhost (``Host``) is allowed
      (bind to loopback only), and one addressed by another DNS name refused 403.
    - ``max_wait``: the longest a request waits at the server (acquire, wait).
    - ``max_namespaces``: namespaces whose store client (its connections) stays open
      between requests, at least 1; more in use than this are reopened when used
      (``Namespaces`` says which are closed).

    Raises ``ValueError``/``TypeError`` for a bad URL or token file and ``StoreError``
    when the store cannot be opened, before serving anything. The store is closed when
    the app's lifespan ends.
    """
    max_wait = check_ttl(max_wait, "max_wait")
    if isinstance(max_namespaces, bool) or not isinstance(max_namespaces, int):
        raise TypeError(f"max_namespaces must be an int, not {max_namespaces!r}")
    if max_namespaces < 1:
        raise ValueError(
            f"max_namespaces must be at least 1 (namespaces kept open between requests),"
            f" not {max_namespaces}"
        )
    auth = Auth(None if token_file is None else load_token_file(token_file))
    default = AsyncLocks(store_url, namespace="")
    server = _Server(
        store_url, default, auth=auth, max_wait=float(max_wait), max_namespaces=max_namespaces
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        _log_runtime()
        server.loop = asyncio.get_running_loop()
        try:
            yield
        finally:
            await server.namespaces.aclose()

    app = Starlette(
        routes=server.routes(),
        middleware=[
            Middleware(MetricsMiddleware, metrics=server.metrics),
            Middleware(_Guard, stopping=server.stopping),
            *([Middleware(_NoRebinding)] if auth.open else []),
        ],
        exception_handlers={
            ApiError: _on_api_error,
            StoreError: _on_store_error,
            HTTPException: _on_http_error,
        },
        lifespan=lifespan,
    )
    # A path with a slash too many or too few is not a route: a 404 in JSON, as the
    # error table says, not Starlette's empty 307 to the other spelling (which a
    # client's POST would follow without its body, or not at all).
    app.router.redirect_slashes = False
    app.state.keymutex = server
    return app

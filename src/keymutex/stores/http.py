"""``http://host:port[/base]``: the leases of a keymutex lock server (docs/http-api.md).

- Each step is one HTTP request to the server (``keymutex serve``), which runs it on
  its own store: ``try_acquire`` is ``/v1/acquire`` with ``timeout: 0``, ``renew_many``
  one ``/v1/renew-many``, and ``renew``, ``release``, ``holder``, ``holders`` their own
  endpoints. Each store sends its requests through one pooled ``httpx`` transport
  (``httpx.HTTPTransport``, the layer under ``httpx.Client``), which keeps connections
  alive: the client's per-request work (merging URLs, default headers, cookies, auth and
  redirect hooks) would cost more than the server's answer. Its URLs, headers and
  timeouts are built once per store; proxies come from the environment as with
  ``httpx.Client`` (``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``, ``NO_PROXY``), and so
  do the certificates (certifi's bundle, or ``SSL_CERT_FILE``/``SSL_CERT_DIR``).
- Tokens are drawn by the client as for every store, and sent with the acquire: a
  lease's token works from any process, through any server of the same store.
- Waiting happens at the server: a refused ``try_acquire`` records its arguments on
  its waiter, and the waiter's wait is ``/v1/acquire`` again with the same token and a
  ``timeout`` (capped by the server). The server waits with its own store, in that
  store's order (first come, first served on SQLite and memory; hand-over on Redis),
  so a release wakes one waiter, not a herd. A grant during the wait is kept on the
  waiter and returned by the next ``try_acquire`` without a request, its time left
  reduced by the time since the reply and a round trip; a waiter that gives up after
  asking releases, by its token, whatever it may have been granted.
- Fences, durability and clock are those of the server's store; ``durable_fences`` is
  read from ``/healthz`` at the first step (``False`` until then). TTLs are measured by
  the server's store; ``remaining`` is counted from before each request was sent.
- ``HttpStore.force_release(key, reason)`` (what ``keymutex release --force`` uses on
  this store) is the server's admin ``/v1/force-release``, logged at the server.
- An acquire whose answer does not come (the connection fails, or the reply does not
  parse), or is a server error (5xx: its store failed, perhaps after writing), may have
  been granted all the same: it is sent once more, with the same token,
  which the server answers with the lease that token holds (docs/http-api.md: a retried
  acquire). If that fails too, the store releases by the token, as far as it can, and
  raises: a lease granted to nobody would block the key for its whole TTL. Not after a
  timeout: a server that does not answer would make each of those wait as long again;
  ``Locks`` gives back a grant it made later, in the background (``_giveback``).
- A kept-alive connection is dropped after ``KEEPALIVE_EXPIRY`` idle, before the lock
  server closes it (after 5 s): a request sent just as the server closes it is lost.
  A renewal, a read or a release whose connection closes or breaks before an answer
  comes (not a timeout) is sent once more, on a new connection: a renewal by token and
  a read can be repeated; a release sent again that finds the lease gone raises
  ``StoreError`` (the first may have released it, or it was lost before: unknown),
  not ``LockLost``.
- Errors: an unreachable server, a 5xx or a reply that does not parse raise
  ``StoreError``, as do 401/403 (a missing or insufficient API token); a 400 raises
  ``ValueError`` with the server's message (e.g. a ``ttl`` over the server's limit).

Options: ``api_token`` (default ``$KEYMUTEX_API_TOKEN``), ``timeout`` (seconds for
each phase of a request: connect, send, wait for each part of the reply, beyond the
time a long poll may wait; default 10). A request, its reply read to the end, takes
twice ``timeout`` (plus its long poll) at most, however slowly the reply comes. For
``https://``, as for the other stores' TLS: ``ca_file`` (the CAs the server's
certificate is checked against, instead of certifi's bundle), ``cert_file`` and
``key_file`` (a client certificate, for a TLS front that asks for one).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import ssl
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit
from urllib.request import getproxies_environment, proxy_bypass

import httpx

from keymutex import _clock
from keymutex._errors import StoreError
from keymutex._lease import Holder, Outcome
from keymutex._store import Capabilities, RenewRequest, translate_errors
from keymutex._urls import redacted, scrubbed, split_url
from keymutex._validate import LOCK_SERVER_MAX_TTL
from keymutex._version import __version__
from keymutex.stores._settings import TLS_OPTIONS, seconds, tls_files

__all__ = ["AsyncHttpStore", "HttpStore", "driver"]

CAPABILITIES = Capabilities(
    notifies=True,
    fair=False,
    cross_process=True,
    durable_fences=False,
    clock="server",
    waits_at_store=True,
)
TOKEN_ENVVAR = "KEYMUTEX_API_TOKEN"  # noqa: S105 - the name of a variable, not a secret
DEFAULT_TIMEOUT = 10.0
MAX_RENEWALS = 1000  # leases per renew-many request (the server's limit)
MAX_BODY_BYTES = 16 * 1024  # per request body (the server's limit)
HTTP_ERRORS = (httpx.HTTPError, httpx.StreamError, httpx.InvalidURL)

# How long a kept-alive connection may sit idle before it is closed here: below the
# lock server's 5 s (uvicorn's default). With both at 5 s, a request sent as the server
# closed the connection was lost (found by review: 5 renewals in 160, each after 5 s
# idle, failed against a healthy server).
KEEPALIVE_EXPIRY = 2.0

# A connection that closed or broke before any answer came: the request may not have
# reached the server (see _sent_again). Not a timeout: a silent server would make the
# second try wait as long again.
_DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def _dropped(exc: StoreError) -> bool:
    return isinstance(exc.__cause__, _DROPPED)


def _why(exc: BaseException) -> str:
    """The reason a ``StoreError`` gives for httpx's ``exc``: its text; for a connection
    that could not be made, the system's words for the last attempt's error, as the
    sync client says them (``[Errno 111] Connection refused``).

    Found by a new user's walk-through: the async client (anyio) says "All connection
    attempts failed" for the same refusal, with the attempts' errors as its cause, so
    ``keymutex ls`` and ``keymutex run`` worded one situation two ways.
    """
    if isinstance(exc, httpx.ConnectError):
        number = _system_errno(exc)
        if number is not None:
            return f"[Errno {number}] {os.strerror(number)}"
    return str(exc)


def _system_errno(exc: BaseException) -> int | None:
    """The errno of the system error behind ``exc``, along its causes: of a group's
    last (as the sync client's ``socket.create_connection`` reports its last address's:
    ``localhost`` on a host without IPv6 fails on ``::1`` with errno 99, then is
    refused on 127.0.0.1); ``None`` if there is none, or it is a TLS error (whose errno
    is OpenSSL's, not the system's)."""
    cause: BaseException | None = exc
    for _ in range(16):  # bounded: a chain may loop through __context__
        if cause is None:
            return None
        if isinstance(cause, BaseExceptionGroup) and cause.exceptions:
            cause = cause.exceptions[-1]
            continue
        if isinstance(cause, OSError) and cause.errno is not None:
            number = cause.errno
            if isinstance(cause, ssl.SSLError) or not isinstance(number, int) or number <= 0:
                return None
            return number
        cause = cause.__cause__ or cause.__context__
    return None


def _released_again(outcome: Outcome, key: str) -> Outcome:
    """A release sent again after its first try's connection broke: one that finds the
    lease gone cannot tell whether the first released it or it was lost before."""
    if not outcome.ok:
        raise StoreError(
            f"release of {key!r}: the connection broke before the answer came; sent again,"
            " it found the lease gone: released by the first, or lost before it (outcome"
            " unknown)"
        )
    return outcome


JSONDict = dict[str, Any]


# -- the protocol, without I/O: requests to send, and what their answers mean -------------


@dataclass(frozen=True, slots=True)
class _Call:
    """One request: ``wait`` is how long the server may hold it before answering."""

    method: str
    path: str
    body: JSONDict | None = None
    params: dict[str, str] | None = None
    wait: float = 0.0


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _encode(body: JSONDict) -> bytes:
    return _ENCODER.encode(body).encode()


@contextlib.contextmanager
def _reading(what: str) -> Iterator[None]:
    """A reply that lacks a field or has one of the wrong type is a ``StoreError``."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StoreError(f"the lock server's reply to {what} does not parse: {exc!r}") from exc


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _holder(data: object) -> Holder | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise TypeError(f"expected a holder object, got {data!r}")
    key, owner, info, fence = data["key"], data["owner"], data["info"], data["fence"]
    if not isinstance(key, str) or not isinstance(owner, str):
        raise TypeError("key and owner must be strings")
    if info is not None and not isinstance(info, dict):
        raise TypeError("info must be an object or null")
    if isinstance(fence, bool) or not isinstance(fence, int):
        raise TypeError("fence must be an integer")
    return Holder(
        key=key,
        owner=owner,
        info=info,
        fence=fence,
        acquired_at=_number(data["acquired_at"]),
        expires_at=_number(data["expires_at"]),
    )


def _outcome(ok: bool, data: object) -> Outcome:
    """An ``Outcome`` from a Lease or Holder object (or null): ``remaining`` is expires_in."""
    holder = _holder(data)
    if holder is None:
        return Outcome(ok)
    assert isinstance(data, dict)
    return Outcome(ok, holder, _number(data["expires_in"]))


def _json_text(payload: JSONDict, limit: int = 200) -> str:
    text = json.dumps(payload, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "…"


def _expect(what: str, status: int, payload: JSONDict, conflict: str | None = None) -> bool:
    """``True`` for a 200, ``False`` for the 409 ``conflict``; raise for anything else."""
    if status == 200:
        return True
    error, message = payload.get("error"), payload.get("message")
    if status == 409 and conflict is not None and error == conflict:
        return False
    if not isinstance(message, str) or not message.strip():
        # Not one of the server's errors, which all say what happened: found by review,
        # a proxy's {"error": "bad gateway"} ended the message with an empty tail.
        message = f"{_json_text(payload)} (not the lock server's answer: a proxy in between?)"
    if status == 400 and error == "invalid_argument":
        raise ValueError(f"the lock server refused {what}: {message}")
    if status == 401:
        message += f" (this client sends the API token of api_token=… or ${TOKEN_ENVVAR})"
    code = f" {error}" if isinstance(error, str) and error else ""
    raise StoreError(f"the lock server answered {what} with {status}{code}: {message}")


class _Protocol:
    """The steps of one namespace as HTTP calls, and their replies as results.

    Shared by ``HttpStore`` and ``AsyncHttpStore``: they only send the calls.
    """

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        timeout: float = 0.0,
    ) -> _Call:
        body = {
            "namespace": self.namespace,
            "key": key,
            "token": token,
            "ttl": ttl,
            "timeout": timeout,
            "owner": owner,
            "info": info,
            "steal": steal,
        }
        return _Call("POST", "/v1/acquire", body, wait=timeout)

    @staticmethod
    def acquired(status: int, payload: JSONDict) -> Outcome:
        ok = _expect("acquire", status, payload, "locked")
        with _reading("acquire"):
            return _outcome(True, payload) if ok else _outcome(False, payload["holder"])

    def renew(self, key: str, token: str, ttl: float) -> _Call:
        body = {"namespace": self.namespace, "key": key, "token": token, "ttl": ttl}
        return _Call("POST", "/v1/renew", body)

    @staticmethod
    def renewed(status: int, payload: JSONDict) -> Outcome:
        ok = _expect("renew", status, payload, "lock_lost")
        with _reading("renew"):
            return _outcome(True, payload) if ok else _outcome(False, payload["holder"])

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[tuple[_Call, int]]:
        """One call per batch that fits the server's limits, and the batch's size."""
        envelope = len(_encode({"namespace": self.namespace, "leases": []}))
        batches: list[list[JSONDict]] = [[]]
        size = envelope
        for request in requests:
            lease = {"key": request.key, "token": request.token, "ttl": request.ttl}
            cost = len(_encode(lease)) + 1  # and a comma
            if batches[-1] and (size + cost > MAX_BODY_BYTES or len(batches[-1]) == MAX_RENEWALS):
                batches.append([])
                size = envelope
            batches[-1].append(lease)
            size += cost
        return [
            (_Call("POST", "/v1/renew-many", {"namespace": self.namespace, "leases": b}), len(b))
            for b in batches
            if b
        ]

    @staticmethod
    def renewed_many(status: int, payload: JSONDict, count: int) -> list[Outcome]:
        _expect("renew-many", status, payload)
        with _reading("renew-many"):
            results = payload["results"]
            if not isinstance(results, list) or len(results) != count:
                raise ValueError(f"expected {count} results")
            return [
                _outcome(False, item["holder"]) if "error" in item else _outcome(True, item)
                for item in results
            ]

    def release(self, key: str, token: str) -> _Call:
        body = {"namespace": self.namespace, "key": key, "token": token}
        return _Call("POST", "/v1/release", body)

    @staticmethod
    def released(status: int, payload: JSONDict) -> Outcome:
        if _expect("release", status, payload, "lock_lost"):
            return Outcome(True)
        with _reading("release"):
            return _outcome(False, payload["holder"])

    def holder(self, key: str) -> _Call:
        return _Call("GET", "/v1/holder", params={"namespace": self.namespace, "key": key})

    @staticmethod
    def held(status: int, payload: JSONDict) -> Holder | None:
        _expect("holder", status, payload)
        with _reading("holder"):
            return _holder(payload["holder"])

    def holders(self, prefix: str) -> _Call:
        return _Call("GET", "/v1/holders", params={"namespace": self.namespace, "prefix": prefix})

    @staticmethod
    def listed(status: int, payload: JSONDict) -> list[Holder]:
        _expect("holders", status, payload)
        with _reading("holders"):
            found = [_holder(item) for item in payload["holders"]]
        return sorted((h for h in found if h is not None), key=lambda h: h.key)

    def force_release(self, key: str, reason: str) -> _Call:
        body = {"namespace": self.namespace, "key": key, "reason": reason}
        return _Call("POST", "/v1/force-release", body)

    @staticmethod
    def force_released(status: int, payload: JSONDict) -> Holder | None:
        _expect("force-release", status, payload)
        with _reading("force-release"):
            return _holder(payload["holder"])

    @staticmethod
    def health() -> _Call:
        return _Call("GET", "/healthz")

    @staticmethod
    def capabilities(status: int, payload: JSONDict) -> Capabilities:
        durable = status == 200 and payload.get("durable_fences") is True
        return dataclasses.replace(CAPABILITIES, durable_fences=durable)


def _decode(
    request: httpx.Request, response: httpx.Response, body: bytes | bytearray
) -> tuple[int, JSONDict]:
    status = response.status_code
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        raise StoreError(
            f"the lock server answered {request.method} {request.url.path} with {status} and"
            " a body that is not a JSON object (a proxy or gateway in between?)"
        )
    return status, payload


class _WaiterState:
    """A waiter waits *at the server*: its wait is the acquire itself, with a timeout.

    The server queues it with its store (FIFO where the store is fair) and grants it
    the key the moment it is its turn, so one release wakes one waiter, with no herd
    of retries. A grant that comes during the wait is kept here, and the next
    ``try_acquire`` of this waiter returns it without another request.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.request: dict[str, Any] | None = None  # the refused acquire's arguments
        self.sent_at = 0.0  # when the last wait (an acquire) was sent
        self.granted: tuple[Outcome, float] | None = None  # and when its request was sent
        self.asked = False  # an acquire was sent while waiting: the key may be ours

    def refused(self, request: dict[str, Any]) -> None:
        self.request = request

    def wait_call(self, protocol: _Protocol, timeout: float) -> _Call | None:
        if self.request is None:
            return None
        self.asked = True
        self.sent_at = _clock.monotonic()
        return protocol.acquire(self.key, **self.request, steal=False, timeout=timeout)

    def answered(self, outcome: Outcome) -> bool:
        if outcome.ok:
            self.granted = (outcome, self.sent_at)
        else:
            self.asked = False  # refused for good: nothing of ours to give back
        return outcome.ok

    def take_grant(self) -> Outcome | None:
        """The grant that came while waiting, its time left counted from now.

        The server's ``expires_in`` counts from when it received the request, so it is
        counted here from when the request was sent: never more than the store granted,
        however long the reply took to come or to be read (a paused process).
        """
        if self.granted is None:
            return None
        (outcome, sent_at), self.granted = self.granted, None
        self.asked = False
        remaining = outcome.remaining
        if remaining is not None:
            remaining = max(0.0, sent_at + remaining - _clock.monotonic())
        return Outcome(True, outcome.holder, remaining)

    def unclaimed_token(self) -> str | None:
        """The token of an acquire this waiter sent but whose grant nobody took."""
        if self.request is None or not (self.asked or self.granted is not None):
            return None
        token = self.request["token"]
        assert isinstance(token, str)
        return token


def _verify(tls: ssl.SSLContext | None) -> ssl.SSLContext:
    """httpx's ``verify`` for the store's TLS options; none given: httpx's default (certifi's
    bundle, or ``SSL_CERT_FILE``/``SSL_CERT_DIR``), made once per process.

    Found under load: every store made its own, which loads the whole CA bundle (20-40 ms
    of CPU, on the event loop's thread for ``AsyncLocks``), even for an ``http://`` URL that
    never uses it; a server's clients made per task stalled the loop for seconds. One
    context serves every connection (each store's transport speaks HTTP/1.1 only, the
    one setting httpcore writes into it).
    """
    return _default_tls() if tls is None else tls


@functools.cache
def _default_tls() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def _environment_proxy(base_url: str) -> str | None:
    """The proxy ``httpx.Client`` would take from the environment for ``base_url``, if any."""
    parts = urlsplit(base_url)
    proxies = getproxies_environment()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or proxy_bypass(parts.netloc):  # NO_PROXY
        return None
    return proxy


class _Requests:
    """What every request of one store shares, built once: URLs, headers, timeouts.

    ``build`` makes the ``httpx.Request`` of a ``_Call``; the transport sends it as is
    (no base-URL merging, default headers or cookies per request).
    """

    def __init__(self, base_url: str, api_token: str | None, timeout: float) -> None:
        self.base_url = base_url
        headers = {"User-Agent": f"keymutex/{__version__}"}
        if api_token is not None:
            headers["Authorization"] = f"Bearer {api_token}"
        self._get_headers = httpx.Headers(headers)
        self._post_headers = httpx.Headers({**headers, "Content-Type": "application/json"})
        self._timeout = timeout
        self._no_wait = self.timeouts(0.0)
        self._urls: dict[str, httpx.URL] = {}

    def timeouts(self, wait: float) -> dict[str, float]:
        """httpx's per-request timeouts: ``timeout`` for each phase, plus ``wait`` to read."""
        seconds = self._timeout
        return {"connect": seconds, "read": seconds + wait, "write": seconds, "pool": seconds}

    def budget(self, call: _Call) -> float:
        """How long ``call`` may take in all, its reply read to the end.

        httpx's read timeout is between two reads: found by review, a reply that came a
        byte at a time (a stuck proxy or link) kept a call, a release, ``close()`` and a
        cancelled async acquire waiting for ever."""
        return 2 * self._timeout + call.wait

    def url(self, path: str) -> httpx.URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.base_url + path)
        return url

    def build(self, call: _Call) -> httpx.Request:
        url = self.url(call.path)
        if call.params is not None:
            url = url.copy_merge_params(call.params)
        timeouts = self._no_wait if call.wait == 0 else self.timeouts(call.wait)
        if call.body is None:
            return httpx.Request(
                call.method, url, headers=self._get_headers, extensions={"timeout": timeouts}
            )
        return httpx.Request(
            call.method,
            url,
            headers=self._post_headers,
            content=_encode(call.body),
            extensions={"timeout": timeouts},
        )


def _late(request: httpx.Request, budget: float) -> httpx.ReadTimeout:
    return httpx.ReadTimeout(
        f"the reply to {request.method} {request.url.path} took more than {budget:g} s",
        request=request,
    )


# -- the synchronous store -------------------------------------------------------------


class _HttpWaiter(_WaiterState):
    def __init__(self, store: HttpStore, key: str) -> None:
        super().__init__(key)
        self._store = store

    def wait(self, timeout: float) -> bool:
        call = self.wait_call(self._store._protocol, timeout)
        if call is None:
            time.sleep(timeout)
            return False
        return self.answered(_Protocol.acquired(*self._store._send(call)))

    async def wait_async(self, timeout: float) -> bool:
        return await asyncio.to_thread(self.wait, timeout)

    def close(self) -> None:
        """Give back a grant that came while waiting but was never taken."""
        token = self.unclaimed_token()
        if token is not None:
            with contextlib.suppress(StoreError, ValueError):
                self._store.release(self.key, token)


class HttpStore:
    """The ``http://`` store for one namespace, on one pooled ``httpx.HTTPTransport``."""

    def __init__(
        self,
        base_url: str,
        namespace: str,
        *,
        api_token: str | None,
        timeout: float,
        tls: ssl.SSLContext | None = None,
    ):
        self.capabilities = CAPABILITIES
        self._base_url = base_url
        self._tls = tls
        self._requests = _Requests(base_url, api_token, timeout)
        self._protocol = _Protocol(namespace)
        self._pid = os.getpid()
        self._transport = self._new_transport()
        self._asked_capabilities = False

    def _new_transport(self) -> httpx.HTTPTransport:
        return httpx.HTTPTransport(
            proxy=_environment_proxy(self._base_url),
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY),
            verify=_verify(self._tls),
        )

    def _sent_again(self, call: _Call) -> tuple[tuple[int, JSONDict], bool]:
        """``call``'s answer, sent once more if its connection dropped before an answer
        came (a kept-alive one closed by the server as it went out); and whether it was."""
        try:
            return self._send(call), False
        except StoreError as exc:
            if not _dropped(exc):
                raise
        return self._send(call), True

    def _send(self, call: _Call) -> tuple[int, JSONDict]:
        if self._pid != os.getpid():  # a forked child must not share the parent's sockets
            self._pid, self._transport = os.getpid(), self._new_transport()
        with translate_errors(
            *HTTP_ERRORS, what=f"lock server {self._base_url} failed", reason=_why
        ):
            request = self._requests.build(call)
            budget = self._requests.budget(call)
            deadline = _clock.monotonic() + budget
            response = self._transport.handle_request(request)
            try:
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    if _clock.monotonic() > deadline:
                        raise _late(request, budget)
            finally:
                response.close()
        if not self._asked_capabilities:
            # After the first step's request, not before: a lease's ``remaining`` counts
            # from before its request was sent, and must not lose this round trip.
            self._asked_capabilities = True
            self._ask_capabilities()
        return _decode(request, response, body)

    def _ask_capabilities(self) -> None:
        with contextlib.suppress(StoreError):
            self.capabilities = _Protocol.capabilities(*self._send(_Protocol.health()))

    def try_acquire(
        self,
        key: str,
        *,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: Any,
    ) -> Outcome:
        assert waiter is None or isinstance(waiter, _HttpWaiter)
        granted = None if waiter is None else waiter.take_grant()
        if granted is not None:
            return granted
        call = self._protocol.acquire(key, token, ttl, owner, info, steal)
        try:
            answer = self._send(call)
        except StoreError as exc:
            if isinstance(exc.__cause__, httpx.TimeoutException):
                raise  # a silent server: asking again would only wait as long again
            outcome = self._ask_again(key, token, call)
        else:
            if answer[0] >= 500:  # the server's store failed: perhaps after granting it
                outcome = self._ask_again(key, token, call)
            else:
                outcome = _Protocol.acquired(*answer)
        if waiter is not None and not outcome.ok:
            request = {"token": token, "ttl": ttl, "owner": owner, "info": info}
            waiter.refused(request)
        return outcome

    def _ask_again(self, key: str, token: str, call: _Call) -> Outcome:
        """An acquire whose answer did not come (see the module's docstring)."""
        try:
            return _Protocol.acquired(*self._send(call))
        except StoreError:  # the second answer lost too, or a failure (a 5xx) of the server
            with contextlib.suppress(StoreError, ValueError):
                self.release(key, token)
            raise

    def renew(self, key: str, token: str, ttl: float) -> Outcome:
        answer, _ = self._sent_again(self._protocol.renew(key, token, ttl))
        return _Protocol.renewed(*answer)

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for call, count in self._protocol.renew_many(requests):
            answer, _ = self._sent_again(call)
            outcomes += _Protocol.renewed_many(*answer, count)
        return outcomes

    def release(self, key: str, token: str) -> Outcome:
        answer, again = self._sent_again(self._protocol.release(key, token))
        outcome = _Protocol.released(*answer)
        return _released_again(outcome, key) if again else outcome

    def holder(self, key: str) -> Holder | None:
        answer, _ = self._sent_again(self._protocol.holder(key))
        return _Protocol.held(*answer)

    def holders(self, prefix: str) -> list[Holder]:
        answer, _ = self._sent_again(self._protocol.holders(prefix))
        return _Protocol.listed(*answer)

    def force_release(self, key: str, reason: str) -> Holder | None:
        """The server's admin force-release (``keymutex release --force``): the key is
        taken over and given back, logged at the server with the API token's name and
        ``reason``. Returns the displaced holder, or ``None`` if the key was free."""
        return _Protocol.force_released(*self._send(self._protocol.force_release(key, reason)))

    def waiter(self, key: str) -> _HttpWaiter:
        return _HttpWaiter(self, key)

    def close(self) -> None:
        self._transport.close()


# -- the asynchronous store --------------------------------------------------------------


class _AsyncHttpWaiter(_WaiterState):
    def __init__(self, store: AsyncHttpStore, key: str) -> None:
        super().__init__(key)
        self._store = store

    async def wait(self, timeout: float) -> bool:
        call = self.wait_call(self._store._protocol, timeout)
        if call is None:
            await asyncio.sleep(timeout)
            return False
        return self.answered(_Protocol.acquired(*await self._store._send(call)))

    async def aclose(self) -> None:
        """Give back a grant that came while waiting but was never taken."""
        token = self.unclaimed_token()
        if token is not None:
            with contextlib.suppress(StoreError, ValueError):
                await self._store.release(self.key, token)


class AsyncHttpStore:
    """The ``http://`` store for one namespace, for asyncio: one ``httpx.AsyncHTTPTransport``."""

    # Its connections belong to the event loop that made them: an AsyncLocks used by
    # one loop after another opens a store of its own in each (_store.StoreOfTheLoop).
    loop_bound = True

    def __init__(
        self,
        base_url: str,
        namespace: str,
        *,
        api_token: str | None,
        timeout: float,
        tls: ssl.SSLContext | None = None,
    ):
        self.capabilities = CAPABILITIES
        self._base_url = base_url
        self._tls = tls
        self._requests = _Requests(base_url, api_token, timeout)
        self._protocol = _Protocol(namespace)
        self._pid = os.getpid()
        self._transport = self._new_transport()
        self._asked_capabilities = False

    def _new_transport(self) -> httpx.AsyncHTTPTransport:
        return httpx.AsyncHTTPTransport(
            proxy=_environment_proxy(self._base_url),
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY),
            verify=_verify(self._tls),
        )

    async def _sent_again(self, call: _Call) -> tuple[tuple[int, JSONDict], bool]:
        """As ``HttpStore._sent_again``."""
        try:
            return await self._send(call), False
        except StoreError as exc:
            if not _dropped(exc):
                raise
        return await self._send(call), True

    async def _send(self, call: _Call) -> tuple[int, JSONDict]:
        if self._pid != os.getpid():  # a forked child must not share the parent's sockets
            self._pid, self._transport = os.getpid(), self._new_transport()
        with translate_errors(
            *HTTP_ERRORS, what=f"lock server {self._base_url} failed", reason=_why
        ):
            request = self._requests.build(call)
            budget = self._requests.budget(call)
            try:
                async with asyncio.timeout(budget):
                    response = await self._transport.handle_async_request(request)
                    try:
                        body = await response.aread()
                    finally:
                        await response.aclose()
            except TimeoutError:
                raise _late(request, budget) from None
        if not self._asked_capabilities:
            # After the first step's request, not before: a lease's ``remaining`` counts
            # from before its request was sent, and must not lose this round trip.
            self._asked_capabilities = True
            await self._ask_capabilities()
        return _decode(request, response, body)

    async def _ask_capabilities(self) -> None:
        with contextlib.suppress(StoreError):
            self.capabilities = _Protocol.capabilities(*await self._send(_Protocol.health()))

    async def try_acquire(
        self,
        key: str,
        *,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: Any,
    ) -> Outcome:
        assert waiter is None or isinstance(waiter, _AsyncHttpWaiter)
        granted = None if waiter is None else waiter.take_grant()
        if granted is not None:
            return granted
        call = self._protocol.acquire(key, token, ttl, owner, info, steal)
        try:
            answer = await self._send(call)
        except StoreError as exc:
            if isinstance(exc.__cause__, httpx.TimeoutException):
                raise  # a silent server: asking again would only wait as long again
            outcome = await self._ask_again(key, token, call)
        else:
            if answer[0] >= 500:  # the server's store failed: perhaps after granting it
                outcome = await self._ask_again(key, token, call)
            else:
                outcome = _Protocol.acquired(*answer)
        if waiter is not None and not outcome.ok:
            request = {"token": token, "ttl": ttl, "owner": owner, "info": info}
            waiter.refused(request)
        return outcome

    async def _ask_again(self, key: str, token: str, call: _Call) -> Outcome:
        """An acquire whose answer did not come (see the module's docstring)."""
        try:
            return _Protocol.acquired(*await self._send(call))
        except StoreError:  # as in HttpStore
            with contextlib.suppress(StoreError, ValueError):
                await self.release(key, token)
            raise

    async def renew(self, key: str, token: str, ttl: float) -> Outcome:
        answer, _ = await self._sent_again(self._protocol.renew(key, token, ttl))
        return _Protocol.renewed(*answer)

    async def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for call, count in self._protocol.renew_many(requests):
            answer, _ = await self._sent_again(call)
            outcomes += _Protocol.renewed_many(*answer, count)
        return outcomes

    async def release(self, key: str, token: str) -> Outcome:
        answer, again = await self._sent_again(self._protocol.release(key, token))
        outcome = _Protocol.released(*answer)
        return _released_again(outcome, key) if again else outcome

    async def holder(self, key: str) -> Holder | None:
        answer, _ = await self._sent_again(self._protocol.holder(key))
        return _Protocol.held(*answer)

    async def holders(self, prefix: str) -> list[Holder]:
        answer, _ = await self._sent_again(self._protocol.holders(prefix))
        return _Protocol.listed(*answer)

    async def waiter(self, key: str) -> _AsyncHttpWaiter:
        return _AsyncHttpWaiter(self, key)

    async def aclose(self) -> None:
        await self._transport.aclose()


# -- the driver --------------------------------------------------------------------------


class _Options(NamedTuple):
    base_url: str
    api_token: str | None
    timeout: float
    tls: ssl.SSLContext | None


def _options(url: str, options: Mapping[str, object]) -> _Options:
    """The base URL, API token, timeout and TLS context from the URL and the options."""
    parts = split_url(url, "lock server", "http://host:port[/base] or https://…")
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"lock server URLs are http://host:port[/base] or https://…, not {redacted(url)!r}"
        )
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that does not parse
    except ValueError as exc:
        raise ValueError(
            f"{scrubbed(str(exc), url)} (lock server URL {redacted(url)!r})"
        ) from None
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"lock server URL {parts.hostname!r} must not carry credentials: pass"
            f" api_token=… or set ${TOKEN_ENVVAR}"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"lock server URL must have no query or fragment, not {redacted(url)!r}")
    base = urlunsplit((parts.scheme.lower(), parts.netloc, parts.path.rstrip("/"), "", ""))
    try:
        httpx.URL(base)  # what the client will do with it: IDNA for the host, …
    except httpx.InvalidURL as exc:
        # httpx quotes the host as it is: a lone surrogate would reach the message.
        reason = str(exc).encode("utf-8", "backslashreplace").decode("utf-8")
        raise ValueError(f"{redacted(url)!r} is not a usable lock server URL: {reason}") from None
    merged = dict(options)
    api_token = merged.pop("api_token", None)
    source = "api_token"
    if api_token is None:
        api_token, source = os.environ.get(TOKEN_ENVVAR) or None, f"${TOKEN_ENVVAR}"
    if api_token is not None:
        if not isinstance(api_token, str):
            raise TypeError(f"api_token must be a str, not {type(api_token).__name__}")
        # Sent as it is after "Bearer ": a header holds no control characters, and
        # spaces around it would be stripped on the way (found by review: these
        # failed only at the first request, as a StoreError).
        if not api_token or not all("!" <= char <= "~" for char in api_token):
            raise ValueError(
                f"{source} must be the API token as the token file has it: visible ASCII"
                " characters, without spaces or line breaks"
            )
    timeout = seconds("http store", "timeout", merged.pop("timeout", DEFAULT_TIMEOUT), text=False)
    files = {name: merged.pop(name) for name in TLS_OPTIONS if name in merged}
    if merged:
        raise TypeError(
            f"unknown http store option(s) {sorted(merged)}; accepted: api_token, timeout,"
            f" {', '.join(TLS_OPTIONS)}"
        )
    tls = None
    if files:
        if not base.startswith("https:"):
            raise ValueError(f"{redacted(url)!r}: {', '.join(TLS_OPTIONS)} are for https:// (TLS)")
        tls = tls_files("http store", files)[1]
    return _Options(base, api_token, timeout, tls)


class HttpDriver:
    max_ttl = LOCK_SERVER_MAX_TTL  # the lock server's range

    def open(self, url: str, *, namespace: str, options: Mapping[str, object]) -> HttpStore:
        base, api_token, timeout, tls = _options(url, options)
        return HttpStore(base, namespace, api_token=api_token, timeout=timeout, tls=tls)

    def open_async(
        self, url: str, *, namespace: str, options: Mapping[str, object]
    ) -> AsyncHttpStore:
        base, api_token, timeout, tls = _options(url, options)
        return AsyncHttpStore(base, namespace, api_token=api_token, timeout=timeout, tls=tls)


driver = HttpDriver()

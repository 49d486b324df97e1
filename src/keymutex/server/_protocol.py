"""uvicorn's HTTP/1.1 protocol for ``keymutex serve``, with JSON for what the app never
sees, and bounds on how big a request head is and how long a request takes to arrive.

A request uvicorn cannot parse (a malformed request line or header, an unsupported
upgrade) is answered by uvicorn itself, before any ASGI app runs, with a ``text/plain``
400. ``keymutex serve`` runs uvicorn's own protocol (httptools when it is installed, else
h11: what ``http="auto"`` picks) with that answer replaced by the lock server's JSON
error, ``invalid_argument``, as every other 4xx it gives. On top of uvicorn:

- **A bounded head.** httptools takes request lines and headers of any size; a head over
  ``HEAD_LIMIT`` is answered 431 ``headers_too_large`` as it arrives, and the connection
  closed. (h11 stops a head that size only while it is incomplete, with its own 400;
  one that arrives whole is refused 431 by the app's outer guard, ``_app._Guard``.)
- **A request must arrive in time.** uvicorn waits for the rest of a request for ever,
  and for a first request on a new connection too: a client that sends half a request
  (or nothing) keeps its connection, and its slot in the server, as long as it likes.
  With httptools, a request that has not wholly arrived ``request_timeout`` seconds
  after its first byte is answered 408 ``request_timeout`` and the connection closed
  (nothing was done: the app never acts on half a body), and a new connection that sends
  nothing is closed after uvicorn's keep-alive timeout, as an idle one is after a
  response. Bytes that begin no request (blank lines) and the rest of a body the app
  answered without reading start the same clock, and the connection is closed when it
  runs out. Time spent waiting for a lock is not counted: the request has arrived.
- **A client that closes its side is gone at once**: the app learns it as soon as the
  end of its stream is read, not a turn of the event loop later when uvicorn's
  connection is lost, so a lease granted meanwhile is given back, not answered to
  nobody.
- **Shutdown answers a request whose body is still coming** with a 503
  ``shutting_down`` (JSON), instead of uvicorn's plain-text 500 and a logged traceback
  when its graceful timeout cancels the app that waits for the body.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from http import HTTPStatus
from typing import Any

__all__ = ["HEAD_LIMIT", "HEAD_TOO_LARGE_ERROR", "REQUEST_TIMEOUT", "http_protocol"]

HEAD_LIMIT = 32 * 1024  # bytes of request line and headers
REQUEST_TIMEOUT = 10.0  # seconds from a request's first byte to its last


def error_response(status: HTTPStatus, error: str, message: str) -> bytes:
    """A whole JSON error response, with the connection closed after it."""
    body = json.dumps({"error": error, "message": message}).encode()
    head = (
        b"HTTP/1.1 %d %s\r\n"
        b"content-type: application/json\r\n"
        b"content-length: %d\r\n"
        b"connection: close\r\n\r\n"
    )
    return head % (status.value, status.phrase.encode(), len(body)) + body


def malformed_request(message: str) -> bytes:
    """The whole 400 response for uvicorn's ``message``."""
    return error_response(
        HTTPStatus.BAD_REQUEST,
        "invalid_argument",
        f"malformed HTTP request ({message.rstrip('.')}); send HTTP/1.1 with a JSON body,"
        " as docs/http-api.md describes",
    )


# The 431's body, also answered by the app's outer guard (``_app._Guard``).
HEAD_TOO_LARGE_ERROR = {
    "error": "headers_too_large",
    "message": f"the request line and headers are over {HEAD_LIMIT // 1024} KiB",
}
HEAD_TOO_LARGE = error_response(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, **HEAD_TOO_LARGE_ERROR)
SHUT_DOWN_BEFORE_THE_BODY = error_response(
    HTTPStatus.SERVICE_UNAVAILABLE,
    "shutting_down",
    "the server is shutting down and the request's body had not all arrived: nothing"
    " was acquired or changed",
)


class _HeadTooLarge(Exception):
    """Raised in a parser callback: httptools stops, and uvicorn answers 400 (ours: 431)."""


class _JsonErrors:
    """Put before uvicorn's protocol class (httptools or h11): its 400 answer in JSON, and
    a shutdown that answers a request whose body has not arrived."""

    transport: asyncio.Transport
    cycle: Any  # uvicorn's RequestResponseCycle, or None

    def send_400_response(self, msg: str) -> None:
        self._answer_instead(None, malformed_request(msg))

    def eof_received(self) -> None:
        """The client closed its side: the app is told at once that it went away.

        uvicorn closes the connection then, and tells the app only when the connection
        is lost, a turn of the event loop later: an app that asked in between was told
        the caller was there, and its answer (a lease, say) went nowhere.
        """
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        super().eof_received()  # type: ignore[misc]

    def shutdown(self) -> None:
        cycle = self.cycle
        if (
            cycle is not None
            and cycle.more_body
            and not cycle.response_started
            and not getattr(self, "pipeline", None)  # httptools: nothing queued behind it
        ):
            self._answer_instead(cycle, SHUT_DOWN_BEFORE_THE_BODY)
            return
        super().shutdown()  # type: ignore[misc]

    def _answer_instead(self, cycle: Any, response: bytes) -> None:
        """Answer ``response`` in place of the app, and close.

        The app, if it runs, is told the client went away (its ``receive()`` says
        ``http.disconnect``) and what it sends is dropped.
        """
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.write(response)
        self.transport.close()


class _Guarded(_JsonErrors):
    """Put before uvicorn's httptools protocol: the bounds on the head and on arrival."""

    request_timeout = REQUEST_TIMEOUT
    # uvicorn's, used here:
    loop: asyncio.AbstractEventLoop
    pipeline: deque[Any]
    timeout_keep_alive: int
    timeout_keep_alive_task: asyncio.TimerHandle | None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._head_bytes = 0
        self._head_done = False
        self._head_too_large = False
        self._arriving: asyncio.TimerHandle | None = None
        # uvicorn arms its keep-alive timeout after a response only: a connection that
        # never sends a request would stay open for good.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive,
            self.timeout_keep_alive_handler,  # type: ignore[attr-defined]
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        """uvicorn cancels its keep-alive timeout at any byte, and arms it again only
        after a response. Found by review: bytes that begin no request (a bare CRLF,
        which httptools skips) or that carry on a body the app answered without
        reading (a 401) left a connection with no timeout at all, open for good: a
        client without a token could take every connection the server may have. Such
        bytes now start the request's clock."""
        super().data_received(data)  # type: ignore[misc]
        if (
            self._arriving is None
            and self.timeout_keep_alive_task is None
            and not self.pipeline
            and (self.cycle is None or self.cycle.response_complete)
            and not self.transport.is_closing()
        ):
            self._start_clock()

    # -- httptools' parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()  # type: ignore[misc]
        self._head_bytes = 0
        self._head_done = False
        self._start_clock()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)  # type: ignore[misc]

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)  # type: ignore[misc]

    def on_headers_complete(self) -> None:
        self._head_done = True
        super().on_headers_complete()  # type: ignore[misc]

    def on_message_complete(self) -> None:
        self._stop_clock()
        super().on_message_complete()  # type: ignore[misc]

    # -- the bounds

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > HEAD_LIMIT:
            self._head_too_large = True
            raise _HeadTooLarge

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            self._answer_instead(None, HEAD_TOO_LARGE)
        else:
            super().send_400_response(msg)

    def _start_clock(self) -> None:
        self._stop_clock()
        self._arriving = self.loop.call_later(self.request_timeout, self._not_arrived)

    def _stop_clock(self) -> None:
        if self._arriving is not None:
            self._arriving.cancel()
            self._arriving = None

    def _not_arrived(self) -> None:
        """``request_timeout`` after a request's first byte, and it has not all come."""
        self._arriving = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if self._head_done else None
        earlier = self.cycle if not self._head_done else None
        if self.pipeline or (earlier is not None and not earlier.response_complete):
            # An earlier request is still being answered, and uvicorn reads no more
            # until it is: this one's time starts when it can arrive.
            self._start_clock()
            return
        if cycle is not None and cycle.response_complete:
            # Answered (a refusal, without waiting for the body), or a request before
            # bytes that began none: the rest is not waited for.
            self.transport.close()
            return
        if cycle is not None and cycle.response_started:
            # The answer is on its way: the keep-alive timeout, armed once it is out,
            # or the clock again at the next byte, ends the connection.
            return
        self._answer_instead(
            cycle,
            error_response(
                HTTPStatus.REQUEST_TIMEOUT,
                "request_timeout",
                f"the request had not all arrived {self.request_timeout:g} s after its"
                " first byte: nothing was done; send each request whole",
            ),
        )


def http_protocol(request_timeout: float = REQUEST_TIMEOUT) -> type[asyncio.Protocol]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``)."""
    try:  # as uvicorn's http="auto" decides
        import httptools  # noqa: F401
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class H11JsonErrors(_JsonErrors, H11Protocol):
            pass

        return H11JsonErrors
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsGuarded(_Guarded, HttpToolsProtocol):
        pass

    HttpToolsGuarded.request_timeout = request_timeout
    return HttpToolsGuarded

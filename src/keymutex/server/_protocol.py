"""uvicorn's HTTP/1.1 protocol for ``keymutex serve``, with JSON for what the app never sees.

A request uvicorn cannot parse (a malformed request line or header, headers too large,
an unsupported upgrade) is answered by uvicorn itself, before any ASGI app runs, with a
``text/plain`` 400. ``keymutex serve`` runs uvicorn's own protocol (httptools when it is
installed, else h11: what ``http="auto"`` picks) with only that answer replaced: the
lock server's JSON error, ``invalid_argument``, as every other 4xx it gives.
"""

from __future__ import annotations

import asyncio
import json

__all__ = ["http_protocol"]


def malformed_request(message: str) -> bytes:
    """The whole 400 response, connection closed after it, for uvicorn's ``message``."""
    body = json.dumps(
        {
            "error": "invalid_argument",
            "message": f"malformed HTTP request ({message.rstrip('.')}); send HTTP/1.1"
            " with a JSON body, as docs/http-api.md describes",
        }
    ).encode()
    head = (
        b"HTTP/1.1 400 Bad Request\r\n"
        b"content-type: application/json\r\n"
        b"content-length: %d\r\n"
        b"connection: close\r\n\r\n"
    )
    return head % len(body) + body


class _JsonErrors:
    """Put before uvicorn's protocol class: its 400 answer, in JSON."""

    transport: asyncio.Transport

    def send_400_response(self, msg: str) -> None:
        self.transport.write(malformed_request(msg))
        self.transport.close()


def http_protocol() -> type[asyncio.Protocol]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``)."""
    try:  # as uvicorn's http="auto" decides
        import httptools  # noqa: F401
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class H11JsonErrors(_JsonErrors, H11Protocol):
            pass

        return H11JsonErrors
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsJsonErrors(_JsonErrors, HttpToolsProtocol):
        pass

    return HttpToolsJsonErrors

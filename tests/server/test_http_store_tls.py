"""``https://``: the ``http`` store's TLS options, against a lock server serving TLS.

uvicorn serves the lock server with a certificate of a CA made for the test, and asks
each client for a certificate of that CA (a TLS front such as a company's gateway).
Found by review: the store took no TLS option; a private CA could only be trusted
through ``SSL_CERT_FILE``, for every HTTPS client of the process, and a client
certificate could not be given at all.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import keymutex
from _tls import TlsFiles, make_tls

from .conftest import Live


@pytest.fixture
def tls(tmp_path: Path) -> TlsFiles:
    return make_tls(tmp_path / "tls", client_cert_auth=True)


@pytest.fixture
def secure(make_live: Callable[..., Live], tls: TlsFiles) -> Live:
    return make_live(
        uvicorn_config={
            "ssl_certfile": str(tls.server_cert),
            "ssl_keyfile": str(tls.server_key),
            "ssl_ca_certs": str(tls.ca),
            "ssl_cert_reqs": ssl.CERT_REQUIRED,
        }
    )


def _options(tls: TlsFiles) -> dict[str, Any]:
    return {
        "ca_file": str(tls.ca),
        "cert_file": str(tls.client_cert),
        "key_file": str(tls.client_key),
    }


def test_a_lock_server_behind_tls_with_a_private_ca_and_client_certificates(
    secure: Live, tls: TlsFiles
) -> None:
    assert secure.url.startswith("https://")
    with keymutex.Locks(secure.url, ttl=30, **_options(tls)) as locks:
        lease = locks.acquire("k", timeout=0)
        held = locks.holder("k")
        assert held is not None
        assert held.fence == lease.fence
        lease.release()
        assert locks.holder("k") is None


@pytest.mark.asyncio
async def test_async_a_lock_server_behind_tls_with_a_private_ca_and_client_certificates(
    secure: Live, tls: TlsFiles
) -> None:
    async with keymutex.AsyncLocks(secure.url, ttl=30, **_options(tls)) as locks:
        lease = await locks.acquire("k", timeout=0)
        held = await locks.holder("k")
        assert held is not None
        assert held.fence == lease.fence
        await lease.release()


def test_without_the_private_ca_the_server_is_not_trusted(secure: Live, tls: TlsFiles) -> None:
    with (
        keymutex.Locks(secure.url) as locks,
        pytest.raises(keymutex.StoreError, match="CERTIFICATE_VERIFY_FAILED"),
    ):
        locks.holder("k")


def test_without_a_client_certificate_the_server_refuses(secure: Live, tls: TlsFiles) -> None:
    with (
        keymutex.Locks(secure.url, ca_file=str(tls.ca)) as locks,
        pytest.raises(keymutex.StoreError),
    ):
        locks.holder("k")


@pytest.mark.parametrize(
    ("url", "options", "message"),
    [
        ("http://127.0.0.1:1", {"ca_file": "ca.pem"}, "are for https://"),
        ("https://127.0.0.1:1", {"ca_file": "/nonexistent/ca.pem"}, "not a readable PEM file"),
        ("https://127.0.0.1:1", {"key_file": "key.pem"}, "key_file needs cert_file"),
        ("https://127.0.0.1:1", {"cert_file": "/nonexistent/c.pem"}, "not a readable PEM"),
    ],
)
def test_tls_options_are_checked_before_any_request(
    url: str, options: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        keymutex.Locks(url, **options)


def test_clients_without_tls_options_share_one_default_context(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found under load: each client loaded the whole CA bundle for a context of its own
    (20-40 ms, on the event loop's thread for ``AsyncLocks``), even for ``http://``. The
    default context is made once per process; with it, a server of a private CA is still
    not trusted (the test above)."""
    loads: list[object] = []
    load = ssl.SSLContext.load_verify_locations

    def counted(context: ssl.SSLContext, *args: Any, **kwargs: Any) -> None:
        loads.append(args or kwargs)
        load(context, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    for number in range(5):
        with keymutex.Locks(live.url, namespace=f"client-{number}") as locks:
            locks.acquire("k", timeout=0).release()
    assert len(loads) <= 1, loads

"""The etcd store on a secured etcd: TLS (``etcds://``), passwords, client certificates.

Real etcd members serve over TLS with certificates of a CA made for the test
(``trustme``); authentication is etcd's own (users, roles, tokens). The whole
conformance suite also runs on such a member (``etcd-tls-auth`` in
tests/conformance/conftest.py); this file checks what only security changes: wrong
credentials, certificates, permissions, and tokens that expire.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

import keymutex
from _etcd_fixtures import SECURE_PASSWORD, SECURE_USER, require_etcd
from _etcd_servers import EtcdCluster, enable_auth, make_tls, single


@pytest.fixture
def namespace() -> str:
    return f"sec-{uuid.uuid4().hex[:12]}"


def _url(server: EtcdCluster, *, user: str = "", password: str = "", **query: Path) -> str:
    credentials = f"{quote(user, safe='')}:{quote(password, safe='')}@" if user else ""
    encoded = "&".join(f"{name}={quote(str(path))}" for name, path in query.items())
    return f"etcds://{credentials}{server.members[0].endpoint}" + (
        f"?{encoded}" if encoded else ""
    )


def _ca(server: EtcdCluster) -> Path:
    tls = server.members[0].tls
    assert tls is not None
    return tls.ca


# -- the session's secured member: TLS, a password, read-write on km/ only ----------------


def test_the_password_may_be_given_as_options_and_files_as_keywords(
    etcd_secure_server: EtcdCluster, namespace: str
) -> None:
    url = f"etcds://{etcd_secure_server.members[0].endpoint}"
    with keymutex.Locks(
        url,
        namespace=namespace,
        username=SECURE_USER,
        password=SECURE_PASSWORD,
        ca_file=str(_ca(etcd_secure_server)),
    ) as locks:
        with locks.lock("doc", info={"by": "options"}) as lease:
            holder = locks.holder("doc")
            assert holder is not None
            assert holder.fence == lease.fence
            assert holder.info == {"by": "options"}
        assert locks.holder("doc") is None


def test_a_wrong_password_is_a_store_error_that_names_the_user_and_not_the_password(
    etcd_secure_server: EtcdCluster, namespace: str
) -> None:
    url = _url(
        etcd_secure_server, user=SECURE_USER, password="not-it", ca_file=_ca(etcd_secure_server)
    )
    with (
        keymutex.Locks(url, namespace=namespace) as locks,
        pytest.raises(keymutex.StoreError) as failed,
    ):
        locks.acquire("doc", timeout=0)
    message = str(failed.value)
    assert f"authentication as {SECURE_USER!r} refused by etcd" in message
    assert "not-it" not in message


def test_without_credentials_a_secured_etcd_refuses_every_step(
    etcd_secure_server: EtcdCluster, namespace: str
) -> None:
    url = _url(etcd_secure_server, ca_file=_ca(etcd_secure_server))
    with (
        keymutex.Locks(url, namespace=namespace) as locks,
        pytest.raises(keymutex.StoreError, match="user name is empty"),
    ):
        locks.acquire("doc", timeout=0)


def test_a_server_certificate_from_an_unknown_ca_is_refused(
    etcd_secure_server: EtcdCluster, namespace: str, tmp_path: Path
) -> None:
    other_ca = make_tls(tmp_path / "other").ca
    for url in (
        _url(etcd_secure_server, user=SECURE_USER, password=SECURE_PASSWORD),  # system CAs
        _url(etcd_secure_server, user=SECURE_USER, password=SECURE_PASSWORD, ca_file=other_ca),
    ):
        with keymutex.Locks(url, namespace=namespace) as locks:
            with pytest.raises(keymutex.StoreError) as failed:
                locks.acquire("doc", timeout=0)
            assert "CERTIFICATE_VERIFY_FAILED" in repr(failed.value.__cause__)


def test_plain_http_to_a_tls_member_fails_without_hanging(
    etcd_secure_server: EtcdCluster, namespace: str
) -> None:
    endpoint = etcd_secure_server.members[0].endpoint
    url = f"etcd://{quote(SECURE_USER)}:{quote(SECURE_PASSWORD, safe='')}@{endpoint}"
    with (
        keymutex.Locks(url, namespace=namespace, timeout=3) as locks,
        pytest.raises(keymutex.StoreError),
    ):
        locks.acquire("doc", timeout=0)


@pytest.mark.usefixtures("no_rechecks")
def test_a_waiter_is_woken_through_an_authenticated_watch(
    etcd_secure_url: str, namespace: str
) -> None:
    with (
        keymutex.Locks(etcd_secure_url, namespace=namespace) as first,
        keymutex.Locks(etcd_secure_url, namespace=namespace) as second,
    ):
        lease = first.acquire("doc")
        got: list[keymutex.Lease] = []
        waiter = threading.Thread(target=lambda: got.append(second.acquire("doc", timeout=10)))
        waiter.start()
        time.sleep(0.5)  # queued behind the holder
        released_at = time.monotonic()
        lease.release()
        waiter.join(10)
        assert got, "the waiter was not granted the key"
        # Woken by the watch: its recheck is a minute away (no_rechecks).
        assert time.monotonic() - released_at < 5.0
        assert got[0].fence > lease.fence
        got[0].release()


# -- a user whose role covers one namespace ---------------------------------------------


@pytest.fixture(scope="module")
def shop_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """A secured member with a user allowed the keys of namespace ``shop`` only, and
    simple tokens that expire after 1 s unused (``--auth-token-ttl``)."""
    require_etcd()
    directory = tmp_path_factory.mktemp("etcd-shop")
    with single(
        directory, tls=make_tls(directory / "tls"), extra_args=("--auth-token-ttl", "1")
    ) as server:
        enable_auth(server, {"shop": ("shop-pw", b"km/4:shop/")})
        yield server


def test_a_role_limited_to_a_namespace_works_there_and_is_refused_elsewhere(
    shop_server: EtcdCluster,
) -> None:
    url = _url(shop_server, user="shop", password="shop-pw", ca_file=_ca(shop_server))
    with (
        keymutex.Locks(url, namespace="shop") as locks,
        locks.lock("order:1", renew=False) as lease,
    ):
        assert [h.key for h in locks.holders()] == ["order:1"]
        assert locks.renew("order:1", lease.token).fence == lease.fence
    with (
        keymutex.Locks(url, namespace="books") as locks,
        pytest.raises(keymutex.StoreError, match="permission denied"),
    ):
        locks.acquire("order:1", timeout=0)


def test_an_expired_token_is_replaced_without_the_caller_noticing(
    shop_server: EtcdCluster,
) -> None:
    url = _url(shop_server, user="shop", password="shop-pw", ca_file=_ca(shop_server))
    with (
        keymutex.Locks(url, namespace="shop") as locks,
        keymutex.Locks(url, namespace="shop") as other,
    ):
        lease = locks.acquire("order:2", ttl=30)
        token = locks._store._transport.auth.token  # type: ignore[attr-defined]
        time.sleep(2.5)  # the token expires unused
        holder = other.holder("order:2")  # another client: its own token expired too
        assert holder is not None
        assert holder.fence == lease.fence
        renewed = locks.renew("order:2", lease.token, ttl=30)
        assert renewed.fence == lease.fence
        assert locks._store._transport.auth.token != token  # type: ignore[attr-defined]
        # A waiter whose watch starts on a fresh token is woken by the release.
        got: list[keymutex.Lease] = []
        waiter = threading.Thread(target=lambda: got.append(other.acquire("order:2", timeout=10)))
        waiter.start()
        time.sleep(2.5)  # both tokens expire while the waiter waits
        lease.release()
        waiter.join(10)
        assert got
        assert got[0].fence > lease.fence
        got[0].release()


@pytest.mark.asyncio
async def test_an_async_client_logs_in_again_after_its_token_expired(
    shop_server: EtcdCluster,
) -> None:
    url = _url(shop_server, user="shop", password="shop-pw", ca_file=_ca(shop_server))
    async with keymutex.AsyncLocks(url, namespace="shop") as locks:
        lease = await locks.acquire("order:3", ttl=30)
        await asyncio.sleep(2.5)
        assert (await locks.renew("order:3", lease.token)).fence == lease.fence
        await locks.release("order:3", lease.token)
        assert await locks.holder("order:3") is None


# -- client certificates (--client-cert-auth) ----------------------------------------------


@pytest.fixture(scope="module")
def mutual_tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    require_etcd()
    directory = tmp_path_factory.mktemp("etcd-mtls")
    with single(directory, tls=make_tls(directory / "tls", client_cert_auth=True)) as server:
        yield server


def test_a_client_certificate_is_presented_when_etcd_asks_for_one(
    mutual_tls_server: EtcdCluster, namespace: str
) -> None:
    tls = mutual_tls_server.members[0].tls
    assert tls is not None
    url = _url(
        mutual_tls_server, ca_file=tls.ca, cert_file=tls.client_cert, key_file=tls.client_key
    )
    with keymutex.Locks(url, namespace=namespace) as locks, locks.lock("doc") as lease:
        assert locks.holder("doc") is not None
        assert lease.fence > 0
    without = _url(mutual_tls_server, ca_file=tls.ca)
    with (
        keymutex.Locks(without, namespace=namespace, timeout=3) as locks,
        pytest.raises(keymutex.StoreError),
    ):
        locks.acquire("doc", timeout=0)


# -- settings, checked before anything is sent ---------------------------------------------


@pytest.mark.parametrize(
    ("url", "options", "error", "message"),
    [
        ("etcds://h:1?ca_file=/nowhere/ca.pem", {}, ValueError, "ca_file '/nowhere/ca.pem'"),
        ("etcds://h:1", {"ca_file": 3}, TypeError, "ca_file must be a non-empty str"),
        ("etcds://h:1?key_file=/k.pem", {}, ValueError, "key_file needs cert_file"),
        ("etcds://h:1", {"cert_file": "/nowhere/c.pem"}, ValueError, "cert_file '/nowhere/c.pem'"),
        ("etcd://h:1", {"cert_file": "/c.pem"}, ValueError, "are for etcds://"),
        ("etcds://h:1?ca_file=/a&ca_file=/b", {}, ValueError, "given twice"),
        ("etcds://h:1?ca_file=/a", {"ca_file": "/b"}, ValueError, "given twice"),
        ("etcd://u:p@h:1", {"username": "v"}, ValueError, "both in the URL and as options"),
        ("etcd://h:1", {"username": "u"}, ValueError, "a username and a password"),
        ("etcd://h:1", {"password": "p"}, ValueError, "a username and a password"),
        (
            "etcd://h:1",
            {"username": "u", "password": b"p"},
            ValueError,
            "a username and a password",
        ),
        ("etcd://h:1?user=u", {}, ValueError, "credentials go before the host"),
    ],
)
def test_security_settings_are_checked_before_connecting(
    url: str, options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        keymutex.Locks(url, **options)


@pytest.mark.parametrize(
    "url",
    [
        "etcd://app:hunter2@h:1/path",
        "etcd://app:hunter2@h:notaport",
        "etcd://app:hunter2@h:1?nope=1",
        "ftp://app:hunter2@h:1",
        "etcd://app:hunter2@[::1",
    ],
)
def test_a_refused_url_is_shown_without_its_password(url: str) -> None:
    with pytest.raises(ValueError, match="etcd") as refused:
        keymutex.Locks(url)
    assert "hunter2" not in str(refused.value)


def test_credentials_are_percent_decoded(etcd_secure_server: EtcdCluster, namespace: str) -> None:
    # SECURE_PASSWORD has ':', '@' and '/', which the fixture's URL percent-encodes.
    assert {":", "@", "/"} <= set(SECURE_PASSWORD)
    url = _url(
        etcd_secure_server,
        user=SECURE_USER,
        password=SECURE_PASSWORD,
        ca_file=_ca(etcd_secure_server),
    )
    with keymutex.Locks(url, namespace=namespace) as locks:
        locks.acquire("doc", timeout=0).release()

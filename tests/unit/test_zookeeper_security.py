"""The ZooKeeper store with credentials (digest ACLs) and over TLS (``zookeepers://``).

Real servers: the session's ZooKeeper for credentials (digest authentication needs no
server setting), and servers of this module serving TLS on a second port through
Netty, with certificates of a CA made for the test (``trustme``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

import keymutex
from _tls import make_tls
from _zk_fixtures import require_zookeeper


@pytest.fixture
def namespace() -> str:
    return f"sec-{uuid.uuid4().hex[:12]}"


def _with_credentials(url: str, user: str, password: str) -> str:
    return url.replace("://", f"://{quote(user, safe='')}:{quote(password, safe='')}@", 1)


@contextlib.contextmanager
def _kazoo(zookeeper_url: str, auth: str | None = None) -> Iterator[Any]:
    """A kazoo client of the test's own, with digest credentials ``user:password`` or none."""
    from kazoo.client import KazooClient

    client = KazooClient(
        hosts=zookeeper_url.removeprefix("zookeeper://"),
        auth_data=[("digest", auth)] if auth else None,
    )
    client.start(timeout=10)
    try:
        yield client
    finally:
        client.stop()
        client.close()


def test_with_credentials_a_lease_is_for_that_user_alone(
    zookeeper_url: str, namespace: str
) -> None:
    from kazoo.exceptions import NoAuthError

    url = _with_credentials(zookeeper_url, "app", "p@ss:word")
    with (
        keymutex.Locks(url, namespace=namespace) as locks,
        locks.lock("doc") as lease,
        _kazoo(zookeeper_url, "app:p@ss:word") as same_user,
        _kazoo(zookeeper_url) as raw,
    ):
        key_node = f"/keymutex/n{namespace}/kdoc"
        (name,) = same_user.get_children(key_node)
        node = f"{key_node}/{name}"
        acls, _ = same_user.get_acls(node)
        assert [(acl.id.scheme, acl.id.id.split(":")[0], acl.perms) for acl in acls] == [
            ("digest", "app", 31)  # every permission, for this user only
        ]
        with pytest.raises(NoAuthError):
            raw.get(node)  # the holder's information is not for everyone
        with pytest.raises(NoAuthError):
            raw.get_acls(node)
        with pytest.raises(NoAuthError):
            raw.get_children(key_node)
        assert locks.holder("doc") is not None
        assert lease.fence > 0


def test_another_password_cannot_touch_the_users_locks(zookeeper_url: str, namespace: str) -> None:
    ours = _with_credentials(zookeeper_url, "app", "right")
    theirs = _with_credentials(zookeeper_url, "app", "wrong")
    with (
        keymutex.Locks(ours, namespace=namespace) as locks,
        keymutex.Locks(theirs, namespace=namespace) as intruder,
        locks.lock("doc") as lease,
    ):
        with pytest.raises(keymutex.StoreError, match="NoAuth"):
            intruder.acquire("doc", timeout=0)
        with pytest.raises(keymutex.StoreError, match="NoAuth"):
            intruder.acquire("doc", steal=True, timeout=0)
        with pytest.raises(keymutex.StoreError, match="NoAuth"):
            intruder.release("doc", lease.token)
        holder = locks.holder("doc")
        assert holder is not None
        assert holder.fence == lease.fence


@pytest.mark.usefixtures("no_rechecks")
def test_clients_with_the_same_credentials_queue_and_hand_over(
    zookeeper_url: str, namespace: str
) -> None:
    url = zookeeper_url
    with (
        keymutex.Locks(url, namespace=namespace, username="app", password="pw") as first,
        keymutex.Locks(_with_credentials(url, "app", "pw"), namespace=namespace) as second,
    ):
        lease = first.acquire("doc")
        got: list[keymutex.Lease] = []
        waiter = threading.Thread(target=lambda: got.append(second.acquire("doc", timeout=10)))
        waiter.start()
        time.sleep(0.3)
        released_at = time.monotonic()
        lease.release()
        waiter.join(10)
        assert got
        # Woken by its watch: its recheck is a minute away (no_rechecks).
        assert time.monotonic() - released_at < 5.0
        assert got[0].fence > lease.fence
        got[0].release()


# -- TLS ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    require_zookeeper()
    from _zk_servers import standalone

    directory = tmp_path_factory.mktemp("zookeeper-tls")
    with standalone(directory, tls=make_tls(directory / "tls")) as server:
        yield server


def test_locks_work_over_tls_with_credentials(tls_server: Any, namespace: str) -> None:
    url = _with_credentials(tls_server.secure_url, "app", "pw")
    with (
        keymutex.Locks(url, namespace=namespace) as first,
        keymutex.Locks(url, namespace=namespace) as second,
    ):
        lease = first.acquire("doc")
        with pytest.raises(keymutex.Locked) as refused:
            second.acquire("doc", timeout=0)
        assert refused.value.holder is not None
        assert refused.value.holder.fence == lease.fence
        assert first.renew("doc", lease.token).fence == lease.fence
        got: list[keymutex.Lease] = []
        waiter = threading.Thread(target=lambda: got.append(second.acquire("doc", timeout=10)))
        waiter.start()
        time.sleep(0.3)
        lease.release()
        waiter.join(10)
        assert got
        assert got[0].fence > lease.fence
        got[0].release()


# kazoo does not close the socket of a failed TLS handshake (each connection retry):
# Python warns when one is collected. The fixture frees them within the test, so that
# the warnings are this test's, which ignores them.
_KAZOO_LEAKS = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class _MessagesOnly(logging.Filter):
    """Log records keep their message, not the exception (whose frames hold the socket)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = record.getMessage(), ()
        return True


@pytest.fixture
def kazoo_leaks() -> Iterator[None]:
    # A store's kazoo client logs through keymutex.zookeeper; a bare KazooClient, kazoo.
    logs = [logging.getLogger("kazoo.client"), logging.getLogger("keymutex.zookeeper")]
    only_messages = _MessagesOnly()
    for log in logs:
        log.addFilter(only_messages)
    try:
        yield
    finally:
        gc.collect()
        for log in logs:
            log.removeFilter(only_messages)


@_KAZOO_LEAKS
@pytest.mark.usefixtures("kazoo_leaks")
def test_a_server_certificate_from_an_unknown_ca_is_refused(
    tls_server: Any, namespace: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = make_tls(tmp_path / "other")
    url = f"zookeepers://127.0.0.1:{tls_server.secure_port}?ca_file={quote(str(other.ca))}"
    with (
        caplog.at_level(logging.DEBUG),
        # 3 s: the refused handshake must come within it for its warning to be in the
        # error (a clean-clone CI run on a loaded machine saw it come after 1 s).
        keymutex.Locks(url, namespace=namespace, timeout=3) as locks,
        pytest.raises(keymutex.StoreError, match="not connected") as refused,
    ):
        locks.acquire("doc", timeout=0)
    assert "CERTIFICATE_VERIFY_FAILED" in caplog.text
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value)  # kazoo's last warning


@pytest.fixture(scope="module")
def mutual_tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    require_zookeeper()
    from _zk_servers import standalone

    directory = tmp_path_factory.mktemp("zookeeper-mtls")
    with standalone(directory, tls=make_tls(directory / "tls", client_cert_auth=True)) as server:
        yield server


@_KAZOO_LEAKS
@pytest.mark.usefixtures("kazoo_leaks")
def test_a_client_certificate_is_presented_when_the_server_asks(
    mutual_tls_server: Any, namespace: str
) -> None:
    tls = mutual_tls_server.tls
    with keymutex.Locks(
        mutual_tls_server.secure_url,
        namespace=namespace,
        cert_file=str(tls.client_cert),
        key_file=str(tls.client_key),
    ) as locks:
        locks.acquire("doc", timeout=0).release()
    with (
        keymutex.Locks(mutual_tls_server.secure_url, namespace=namespace, timeout=1) as locks,
        pytest.raises(keymutex.StoreError, match="not connected"),
    ):
        locks.acquire("doc", timeout=0)

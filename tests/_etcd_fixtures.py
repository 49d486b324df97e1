"""Session fixtures for a real etcd, started once per test run and shared.

``tests/conftest.py`` names this module in ``pytest_plugins``, so every test can ask for
``etcd_url`` (``etcd://127.0.0.1:p``, one member) or the ``etcd_server`` behind it. It
starts on first use; a run that uses none starts nothing. It is shared: never kill or
restart it (tests keep apart by namespace); a test that breaks etcd starts its own with
the helpers of ``tests/_etcd_servers.py`` in a ``with`` block.

Without ``etcd`` on ``PATH`` (Debian/Ubuntu: ``apt install etcd-server``) the tests
that use it are skipped, with the reason.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING
from urllib.parse import quote

import pytest

if TYPE_CHECKING:
    from _etcd_servers import EtcdCluster

__all__ = [
    "SECURE_PASSWORD",
    "SECURE_USER",
    "etcd_secure_server",
    "etcd_secure_url",
    "etcd_server",
    "etcd_url",
    "require_etcd",
]

# The user of the secured etcd: read-write on keymutex's keys (``km/``) only. The
# password has characters a URL must percent-encode.
SECURE_USER = "app"
SECURE_PASSWORD = "s3cr:t@/pw"


def require_etcd() -> None:
    """Skip the calling test unless the etcd server is installed."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd not on PATH: the etcd tests run a real server (apt install etcd-server)")


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    require_etcd()
    from _etcd_servers import single

    with single(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(scope="session")
def etcd_url(etcd_server: EtcdCluster) -> str:
    return etcd_server.url


@pytest.fixture(scope="session")
def etcd_secure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """Another member, serving over TLS (its own CA) with authentication on."""
    require_etcd()
    from _etcd_servers import enable_auth, make_tls, single

    directory = tmp_path_factory.mktemp("etcd-secure")
    with single(directory, tls=make_tls(directory / "tls")) as server:
        enable_auth(server, {SECURE_USER: (SECURE_PASSWORD, b"km/")})
        yield server


@pytest.fixture(scope="session")
def etcd_secure_url(etcd_secure_server: EtcdCluster) -> str:
    """``etcds://app:…@127.0.0.1:p?ca_file=…``: every setting in the URL alone."""
    member = etcd_secure_server.members[0]
    assert member.tls is not None
    credentials = f"{quote(SECURE_USER, safe='')}:{quote(SECURE_PASSWORD, safe='')}"
    return f"etcds://{credentials}@{member.endpoint}?ca_file={quote(str(member.tls.ca))}"

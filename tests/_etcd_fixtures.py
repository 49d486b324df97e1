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

import pytest

if TYPE_CHECKING:
    from _etcd_servers import EtcdCluster

__all__ = ["etcd_server", "etcd_url", "require_etcd"]


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

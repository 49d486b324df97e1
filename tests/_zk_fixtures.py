"""A real ZooKeeper server for the tests, started once per session and shared.

``tests/conftest.py`` names this module in ``pytest_plugins``, so every test can ask for
``zookeeper_url`` (``zookeeper://127.0.0.1:PORT``) or ``zookeeper_server`` (the process,
see ``tests/_zk_servers.py``). The server starts on first use (a JVM: 1-3 s); a run
that uses neither starts nothing. It is shared by every test: never stop, pause or
wipe it (tests keep apart by namespace). A test that breaks a server starts its own in
a ``with`` block.

Without Java, the ZooKeeper jars or kazoo, the tests that need them are skipped, with
the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from _zk_servers import ZooKeeperServer

__all__ = ["require_zookeeper", "zookeeper_server", "zookeeper_url"]


def require_zookeeper() -> None:
    """Skip the calling test unless kazoo, Java and the ZooKeeper jars are installed."""
    pytest.importorskip("kazoo", reason="kazoo is not installed (pip install keymutex[zookeeper])")
    from _zk_servers import missing

    reason = missing()
    if reason is not None:
        pytest.skip(f"{reason}: the ZooKeeper tests run against a real server")


@pytest.fixture(scope="session")
def zookeeper_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    require_zookeeper()
    from _zk_servers import standalone

    with standalone(tmp_path_factory.mktemp("zookeeper")) as server:
        yield server


@pytest.fixture(scope="session")
def zookeeper_url(zookeeper_server: ZooKeeperServer) -> str:
    return zookeeper_server.url

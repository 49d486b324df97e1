"""Session fixtures for real Redis servers, started once per test run and shared.

``tests/conftest.py`` names this module in ``pytest_plugins``, so every test can ask for:

- ``redis_url``: a standalone server without persistence (``redis://127.0.0.1:p/0``);
- ``redis_cluster_url``: three masters, no replicas (``redis+cluster://…``);
- ``redis_sentinel_url``: a master, one replica and three sentinels
  (``redis+sentinel://…/mymaster``);

and for the topology objects behind them (``redis_server``, ``redis_cluster``,
``redis_sentinel``). Each starts on first use; a run that uses none starts nothing.
They are shared by every test: never kill, pause, restart or flush them (tests keep
apart by namespace). A test that breaks a server starts its own, with the helpers of
``tests/_redis_servers.py`` in a ``with`` block.

Without ``redis-server`` (or ``redis-sentinel``, ``redis-cli``) on ``PATH``, or without
redis-py, the tests that use them are skipped, with the reason.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

import keymutex

if TYPE_CHECKING:
    from _redis_servers import RedisCluster, RedisSentinel, RedisServer

__all__ = [
    "Waiter",
    "redis_cluster",
    "redis_cluster_url",
    "redis_sentinel",
    "redis_sentinel_url",
    "redis_server",
    "redis_url",
    "the_sole_holder",
]


def require_redis() -> None:
    """Skip the calling test unless redis-py and the Redis programs are installed."""
    pytest.importorskip("redis", reason="redis-py is not installed (pip install keymutex[test])")
    # Imported here so that a missing redis-py skips these tests instead of failing the run.
    from _redis_servers import missing_executables

    missing = missing_executables()
    if missing:
        pytest.skip(
            f"{', '.join(missing)} not on PATH: the Redis tests run against real servers"
            " (Debian/Ubuntu: apt install redis-server redis-sentinel)"
        )


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    require_redis()
    from _redis_servers import standalone

    with standalone(tmp_path_factory.mktemp("redis-standalone")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    require_redis()
    from _redis_servers import cluster

    with cluster(tmp_path_factory.mktemp("redis-cluster"), masters=3) as topology:
        yield topology


@pytest.fixture(scope="session")
def redis_cluster_url(redis_cluster: RedisCluster) -> str:
    return redis_cluster.url


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinel]:
    require_redis()
    from _redis_servers import sentinel

    with sentinel(tmp_path_factory.mktemp("redis-sentinel"), replicas=1, sentinels=3) as group:
        yield group


@pytest.fixture(scope="session")
def redis_sentinel_url(redis_sentinel: RedisSentinel) -> str:
    return redis_sentinel.url


def the_sole_holder(lease: keymutex.Lease, owner: str, other: keymutex.Locks) -> None:
    """``lease`` (granted to ``owner``) is what the store holds, and ``other`` is refused:
    a waiter that took a grant the store took back would be a second holder."""
    holder = other.holder(lease.key)
    assert holder is not None, (
        f"{owner} believes it holds {lease.key!r} (fence {lease.fence}) but the store has no"
        " holder"
    )
    assert (holder.owner, holder.fence) == (owner, lease.fence)
    with pytest.raises(keymutex.Locked):
        other.acquire(lease.key, timeout=0)


class Waiter:
    """A thread blocked in ``locks.acquire(key, timeout=patience)``; keeps what it got."""

    def __init__(self, locks: keymutex.Locks, key: str, patience: float = 30.0) -> None:
        self.result: keymutex.Lease | BaseException | None = None
        self.done = threading.Event()
        self._patience = patience
        self._thread = threading.Thread(target=self._run, args=(locks, key), daemon=True)
        self._thread.start()

    def _run(self, locks: keymutex.Locks, key: str) -> None:
        try:
            self.result = locks.acquire(key, timeout=self._patience)
        except BaseException as exc:  # handed to the test by outcome()
            self.result = exc
        self.done.set()

    def outcome(self) -> keymutex.Lease | BaseException:
        self._thread.join(self._patience + 5)
        assert self.result is not None, "the waiter is still waiting"
        return self.result

    def lease(self) -> keymutex.Lease:
        """What it got, which must be a lease (the waiter's error is the cause)."""
        got = self.outcome()
        if isinstance(got, BaseException):
            raise AssertionError(f"the waiter failed: {got!r}") from got
        return got

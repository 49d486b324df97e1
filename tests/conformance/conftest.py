"""The store registry of the conformance suite, and the fixtures every test uses.

Every test in ``tests/conformance/`` that asks for ``store_url``, ``locks``,
``alocks``, ``make_locks`` or ``make_alocks`` runs once per entry of ``STORES``.
That list is the only place a store is named.

How a new store joins the suite
-------------------------------
Add one ``StoreCase`` to ``STORES``. Its ``make_url(request, tmp_path)`` returns
the URL to test. A store that needs a server gets it from a session fixture,
started once and shared by every test (tests never collide: each test works in a
namespace of its own)::

    @pytest.fixture(scope="session")
    def redis_url() -> Iterator[str]:
        server = shutil.which("redis-server") or pytest.skip("redis-server not installed")
        port = free_port()
        process = subprocess.Popen([server, "--port", str(port), "--save", ""])
        wait_for_port(port)
        yield f"redis://127.0.0.1:{port}/0"
        process.terminate()
        process.wait()

    STORES.append(
        StoreCase(
            "redis",
            lambda request, tmp_path: request.getfixturevalue("redis_url"),
            cross_process=True,
        )
    )

Capabilities
------------
A test that only makes sense for some stores says so with
``@pytest.mark.store_needs("cross_process")``; it is then generated only for the
stores whose ``StoreCase`` has that capability set. Capabilities are the
guarantees of API.md a store may or may not give (``memory://`` is seen by this
process only); they never excuse a store from the rest of the contract.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

import keymutex

from ._http_server import http_redis_url, http_sqlite_url  # noqa: F401 - fixtures of http cases

# The default TTL of the clients the fixtures make: long enough that no lease expires
# by accident on a slow machine; tests about expiry pass a short ``ttl`` themselves.
DEFAULT_TTL = 10.0


@dataclass(frozen=True)
class StoreCase:
    """One store under test: how to get its URL, and what it guarantees.

    - ``make_url(request, tmp_path)``: the URL for one test. ``request`` lets it use
      session fixtures (a server); ``tmp_path`` is the test's own directory.
    - ``cross_process``: other processes that open the same URL see the same leases.
    - ``marks``: pytest marks for every test of this store (e.g. ``pytest.mark.slow``).
    """

    name: str
    make_url: Callable[[pytest.FixtureRequest, Path], str]
    cross_process: bool
    marks: tuple[pytest.MarkDecorator, ...] = ()


STORES: list[StoreCase] = [
    # One table per process: every ``Locks("memory://")`` of this process shares it.
    StoreCase("memory", lambda request, tmp_path: "memory://", cross_process=False),
    StoreCase(
        "sqlite",
        lambda request, tmp_path: f"sqlite:///{tmp_path}/locks.db",
        cross_process=True,
    ),
    # A real redis-server on a free port, started once per session (tests/_redis_fixtures.py).
    StoreCase(
        "redis",
        lambda request, tmp_path: request.getfixturevalue("redis_url"),
        cross_process=True,
    ),
    # Three masters (tests/_redis_fixtures.py): keys spread over the slots.
    StoreCase(
        "redis-cluster",
        lambda request, tmp_path: request.getfixturevalue("redis_cluster_url"),
        cross_process=True,
    ),
    # A master, a replica and three sentinels; the store finds the master through them.
    StoreCase(
        "redis-sentinel",
        lambda request, tmp_path: request.getfixturevalue("redis_sentinel_url"),
        cross_process=True,
    ),
    # A real PostgreSQL (initdb + postgres), started once per session (tests/_pg_fixtures.py).
    StoreCase(
        "postgresql",
        lambda request, tmp_path: request.getfixturevalue("postgresql_url"),
        cross_process=True,
    ),
    # `keymutex serve` on a SQLite store, started once per session (_http_server.py).
    StoreCase(
        "http-sqlite",
        lambda request, tmp_path: request.getfixturevalue("http_sqlite_url"),
        cross_process=True,
    ),
    # The same on the session's Redis server.
    StoreCase(
        "http-redis",
        lambda request, tmp_path: request.getfixturevalue("http_redis_url"),
        cross_process=True,
    ),
    # A real memcached on a free port, started once per session (tests/_memcached_fixtures.py).
    StoreCase(
        "memcached",
        lambda request, tmp_path: request.getfixturevalue("memcached_url"),
        cross_process=True,
    ),
    # A real etcd (one member) on free ports, started once per session (tests/_etcd_fixtures.py).
    StoreCase(
        "etcd", lambda request, tmp_path: request.getfixturevalue("etcd_url"), cross_process=True
    ),
    # Another etcd member serving over TLS with authentication on: etcds://user:pw@…?ca_file=…
    StoreCase(
        "etcd-tls-auth",
        lambda request, tmp_path: request.getfixturevalue("etcd_secure_url"),
        cross_process=True,
    ),
    # A real MongoDB (4.2+) only where KEYMUTEX_TEST_MONGODB_URL names one: none can be
    # installed on the development machine. Without it the case is left out, and one
    # skip in tests/unit/test_mongodb_store.py says so (rather than 300 skips here).
    *(
        [
            StoreCase(
                "mongodb",
                lambda request, tmp_path: os.environ["KEYMUTEX_TEST_MONGODB_URL"],
                cross_process=True,
            )
        ]
        if os.environ.get("KEYMUTEX_TEST_MONGODB_URL")
        else []
    ),
    # A real ZooKeeper (a JVM), started once per session (tests/_zk_fixtures.py).
    StoreCase(
        "zookeeper",
        lambda request, tmp_path: request.getfixturevalue("zookeeper_url"),
        cross_process=True,
    ),
]

CAPABILITIES = ("cross_process",)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "store_needs(*capabilities): run only against the stores that have these"
        f" capabilities (among {', '.join(CAPABILITIES)})",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize every test that uses a store over ``STORES``, filtered by capability."""
    if "store_case" not in metafunc.fixturenames:
        return
    needs: set[str] = set()
    for marker in metafunc.definition.iter_markers("store_needs"):
        unknown = set(marker.args) - set(CAPABILITIES)
        if unknown:
            raise pytest.UsageError(f"unknown store capabilities {sorted(unknown)}")
        needs.update(marker.args)
    cases = [case for case in STORES if all(getattr(case, need) for need in needs)]
    metafunc.parametrize(
        "store_case",
        [pytest.param(case, id=case.name, marks=case.marks) for case in cases],
    )


@pytest.fixture
def store_url(store_case: StoreCase, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return store_case.make_url(request, tmp_path)


def _unique_namespace() -> str:
    return f"test-{uuid.uuid4().hex}"


@pytest.fixture
def namespace() -> str:
    """A namespace that no other test uses, so tests never see each other's keys."""
    return _unique_namespace()


@pytest.fixture
def other_namespace() -> str:
    return _unique_namespace()


@pytest.fixture
def make_locks(store_url: str, namespace: str) -> Iterator[Callable[..., keymutex.Locks]]:
    """Open ``Locks`` on the test's store (default: the test's namespace); closed after."""
    opened: list[keymutex.Locks] = []

    def make(**options: Any) -> keymutex.Locks:
        options.setdefault("namespace", namespace)
        options.setdefault("ttl", DEFAULT_TTL)
        locks = keymutex.Locks(store_url, **options)
        opened.append(locks)
        return locks

    yield make
    for locks in opened:
        locks.close()


@pytest_asyncio.fixture
async def make_alocks(
    store_url: str, namespace: str
) -> AsyncIterator[Callable[..., keymutex.AsyncLocks]]:
    """Open ``AsyncLocks`` on the test's store (default: the test's namespace); closed after."""
    opened: list[keymutex.AsyncLocks] = []

    def make(**options: Any) -> keymutex.AsyncLocks:
        options.setdefault("namespace", namespace)
        options.setdefault("ttl", DEFAULT_TTL)
        alocks = keymutex.AsyncLocks(store_url, **options)
        opened.append(alocks)
        return alocks

    yield make
    for alocks in opened:
        await alocks.aclose()


@pytest.fixture
def locks(make_locks: Callable[..., keymutex.Locks]) -> keymutex.Locks:
    return make_locks()


@pytest_asyncio.fixture
async def alocks(make_alocks: Callable[..., keymutex.AsyncLocks]) -> keymutex.AsyncLocks:
    return make_alocks()

"""Session fixtures for a real PostgreSQL server, started once per test run and shared.

``tests/conftest.py`` names this module in ``pytest_plugins``, so every test can ask for:

- ``postgresql_server``: the ``PostgresServer`` (``tests/_pg_server.py``);
- ``postgresql_url``: its superuser URL (``postgresql://postgres@127.0.0.1:p/postgres``).

The server starts on first use (a run that uses neither starts nothing) and is stopped
and removed at the end of the session, also when tests fail. It is shared by every
test: never stop, restart or reconfigure it (tests keep apart by namespace or by a
table of their own). A test that breaks a server starts its own, with
``_pg_server.running_server()`` in a ``with`` block.

Without the PostgreSQL server programs (``initdb``, ``postgres``), or without psycopg,
the tests that use them are skipped, with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from _pg_server import PostgresServer

__all__ = ["postgresql_server", "postgresql_url", "require_postgresql"]


def require_postgresql() -> None:
    """Skip the calling test unless psycopg and the PostgreSQL server are installed."""
    pytest.importorskip(
        "psycopg", reason="psycopg is not installed (pip install keymutex[postgresql])"
    )
    from _pg_server import missing_binaries

    missing = missing_binaries()
    if missing:
        pytest.skip(
            f"{', '.join(missing)} not found (on PATH or in /usr/lib/postgresql/*/bin): the"
            " PostgreSQL tests run against a real server (Debian/Ubuntu: apt install postgresql)"
        )


@pytest.fixture(scope="session")
def postgresql_server() -> Iterator[PostgresServer]:
    require_postgresql()
    from _pg_server import running_server

    with running_server() as server:
        yield server


@pytest.fixture(scope="session")
def postgresql_url(postgresql_server: PostgresServer) -> str:
    return postgresql_server.url

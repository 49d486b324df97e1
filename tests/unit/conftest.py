"""Fixtures shared by the unit tests of the client layer."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# The stores that need no server: every client-layer test runs on both.
LOCAL_STORES = ["memory", "sqlite"]


@pytest.fixture(params=LOCAL_STORES)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store of the test's own, on memory:// or SQLite (tests taking ``url``
    from ``parametrize`` get that instead)."""
    if request.param == "memory":
        yield f"memory://t{uuid.uuid4().hex}"
    else:
        yield f"sqlite:///{tmp_path}/locks.db"

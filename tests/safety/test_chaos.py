"""``make chaos`` in small: every store, a few hundred fenced writes, pauses and kills.

The long run (``make chaos``, ``chaos.py``) needs 10,000 writes per store; this one
shows in every ``make test`` that the harness and the stores still hold together.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from .chaos import STORES, chaos_run, store_server
from .conftest import STORE_FIXTURES

SMOKE_WRITES = 150


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("store", STORES)
def test_chaos_smoke(
    store: str, request: pytest.FixtureRequest, tmp_path: Path, record_property
) -> None:  # type: ignore[no-untyped-def]
    with contextlib.ExitStack() as stack:
        if store in STORE_FIXTURES:  # the session's server
            url = str(request.getfixturevalue(STORE_FIXTURES[store]))
        else:
            url = stack.enter_context(store_server(store, tmp_path))
        report = chaos_run(
            store, url, tmp_path, writes=SMOKE_WRITES, seed=7, min_faults=1, max_seconds=150
        )
    record_property("row", report.row())
    assert report.violations == []
    assert report.stale_accepted == 0
    assert report.unaware == 0, "a write was refused while its lease did not say lost"
    assert report.accepted >= SMOKE_WRITES
    assert report.pauses >= 1
    assert report.kills >= 1

"""Fixtures for every test directory: real servers (Redis, PostgreSQL, memcached,
ZooKeeper, etcd), started on first use and stopped at the end of the session (see the
plugin modules)."""

from __future__ import annotations

import os

import pytest

pytest_plugins = [
    "_etcd_fixtures",
    "_memcached_fixtures",
    "_pg_fixtures",
    "_redis_fixtures",
    "_zk_fixtures",
]


@pytest.fixture
def no_rechecks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters are woken by their store's notification only: their once-a-second
    safety recheck is put off to a minute. A test of "woken at once" then asserts a
    bound far from any machine's load (a few seconds) and still fails if the
    notification is missed, rather than racing the recheck with a sub-second bound."""
    from keymutex import _wait

    monkeypatch.setattr(_wait, "RECHECK_INTERVAL", 60.0)


# -- in CI, a skip is a failure ----------------------------------------------------------

# The one skip CI may show: no MongoDB server can be installed here (README, MongoDB).
ALLOWED_IN_CI = ("KEYMUTEX_TEST_MONGODB_URL",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """With ``CI`` set (``.ci/run``), a test skipped for a missing program, permission
    or server fails instead: ``make test`` installs everything the suite needs, so a
    skip there means a test that did not run while the suite said it passed."""
    outcome = yield
    report = outcome.get_result()
    if not os.environ.get("CI") or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
    if any(allowed in reason for allowed in ALLOWED_IN_CI):
        return
    report.outcome = "failed"
    report.longrepr = f"skipped in CI, where everything it needs is installed: {reason}"

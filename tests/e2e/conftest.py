"""Fixtures of the browser tests (see _browser.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _browser import CHROMIUM, CHROMIUM_ARGS, Windows
from _server import Server, serve
from playwright.sync_api import Browser, sync_playwright


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with serve(tmp_path) as running:
        yield running


@pytest.fixture
def store(tmp_path: Path, server: Server) -> str:
    """The server's own store, for Python clients next to it."""
    return f"sqlite://{tmp_path}/locks.db"


# Tests list `server` (and `proxy`) before `windows`: fixtures are torn down in reverse
# order, so the windows close before the server stops.
@pytest.fixture
def windows(browser: Browser) -> Iterator[Windows]:
    opened = Windows(browser)
    yield opened
    opened.close()
    assert opened.errors == []

"""What the browser tests share: Debian's chromium, windows, screenshots, visibility.

The fixtures (``browser``, ``server``, ``store``, ``windows``) are in conftest.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from playwright.sync_api import Browser, BrowserContext, Page

CHROMIUM = shutil.which("chromium")
ARTIFACTS = Path(__file__).parent / "artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
HEARTBEAT = 5.0  # seconds between the edit page's renewals (edit.js)

# A browser test module's pytestmark.
BROWSER_TESTS = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)"
    ),
]


class Windows:
    """Browser windows of one test, each a context of its own (its own storage, like
    another person's browser; ``context`` opens one to hold several tabs). They are
    closed before the server stops (open event streams would hold up its shutdown),
    and none of their pages may have thrown an uncaught error."""

    def __init__(self, browser: Browser) -> None:
        self.browser = browser
        self.contexts: list[BrowserContext] = []
        self.errors: list[str] = []

    def context(self, name: str) -> BrowserContext:
        context = self.browser.new_context()
        self.contexts.append(context)
        context.on(
            "page",
            lambda page: page.on(
                "pageerror", lambda error: self.errors.append(f"{name}: {error}")
            ),
        )
        return context

    def open(self, name: str) -> Page:
        return self.context(name).new_page()

    def close(self) -> None:
        for context in self.contexts:
            context.close()
        self.contexts.clear()


def screenshot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def set_visibility(page: Page, state: str) -> None:
    """Make the page hidden or visible, as switching tabs does (headless pages stay
    visible on their own)."""
    page.evaluate(
        """state => {
            Object.defineProperty(document, 'visibilityState', {value: state, configurable: true});
            document.dispatchEvent(new Event('visibilitychange'));
        }""",
        state,
    )

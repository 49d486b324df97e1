"""The dashboard and the edit-lock demo page in a real browser (Debian's chromium).

Each test starts ``keymutex serve`` on a SQLite store in its temp dir; Python clients
hold locks in the same store directly, as a worker next to the server would. Pages
are driven with Playwright; screenshots land in tests/e2e/artifacts/.
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

import pytest
from _browser import BROWSER_TESTS, HEARTBEAT, Windows, screenshot, set_visibility
from _server import Server, serve
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Page, expect

import keymutex

pytestmark = BROWSER_TESTS


def open_editor(windows: Windows, url: str, name: str) -> Page:
    page = windows.open(name)
    page.goto(url)
    page.fill("#name", name)
    page.click("#start")
    return page


def test_second_editor_sees_the_first_takes_over_and_the_first_learns_it(
    server: Server, store: str, windows: Windows
) -> None:
    url = f"{server.url}/demo/edit/doc%3A42"
    alice = open_editor(windows, url, "Alice")
    expect(alice.locator("#state")).to_have_text("Editing as Alice")
    expect(alice.locator("#text")).to_be_enabled()
    alice.fill("#text", "Alice's draft")

    with keymutex.Locks(store) as locks:
        holder = locks.holder("doc:42")
        assert holder is not None
        assert holder.owner == "Alice"
        assert holder.info is not None
        assert holder.info["name"] == "Alice"
        assert holder.expires_at - holder.acquired_at == pytest.approx(15, abs=0.5)

    bob = open_editor(windows, url, "Bob")
    expect(bob.locator("#state")).to_have_text(re.compile(r"^Locked by Alice since \d{1,2}:\d{2}"))
    expect(bob.locator("#text")).to_be_disabled()
    screenshot(bob, "edit-locked-by-alice")

    # Alice's heartbeats fail from here on (her page says it cannot reach the server
    # and keeps her lease until its own deadline, 15 s): the take-over reaches her page
    # through the watch on her own lease, not through a renewal refused.
    alice.route("**/v1/renew", lambda route: route.abort())
    bob.click("#take-over")
    expect(bob.locator("#state")).to_have_text("Editing as Bob")
    expect(bob.locator("#text")).to_be_enabled()
    expect(alice.locator("#state")).to_have_text("Your lock was taken over by Bob", timeout=10_000)
    expect(alice.locator("#text")).to_be_disabled()
    screenshot(alice, "edit-taken-over")

    with keymutex.Locks(store) as locks:
        holder = locks.holder("doc:42")
        assert holder is not None
        assert holder.info is not None
        assert holder.info["name"] == "Bob"

        # Bob's page renews its lease (same fence, later expiry) at its heartbeat.
        deadline = time.monotonic() + HEARTBEAT * 2 + 2
        while time.monotonic() < deadline:
            renewed = locks.holder("doc:42")
            assert renewed is not None
            assert renewed.fence == holder.fence
            if renewed.expires_at > holder.expires_at:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the editing page did not renew its lock")


def test_a_hidden_editing_tab_learns_of_a_take_over_when_shown_again(
    server: Server, windows: Windows
) -> None:
    """A hidden tab does not hold a long poll (a browser has six connections per server,
    which many editing tabs would use up); shown again, it learns at once."""
    url = f"{server.url}/demo/edit/doc%3A43"
    alice = open_editor(windows, url, "Alice")
    expect(alice.locator("#state")).to_have_text("Editing as Alice")
    polls: list[str] = []
    alice.on(
        "request", lambda request: polls.append(request.url) if "/v1/wait" in request.url else None
    )
    set_visibility(alice, "hidden")
    alice.route("**/v1/renew", lambda route: route.abort())  # only the watch can tell her
    bob = open_editor(windows, url, "Bob")
    expect(bob.locator("#state")).to_have_text(re.compile("^Locked by Alice"))
    polls.clear()  # the watch she asked for while she was shown
    bob.click("#take-over")
    expect(bob.locator("#state")).to_have_text("Editing as Bob")
    assert polls == []  # hidden: no watch was asked for
    expect(alice.locator("#state")).to_have_text("Editing as Alice")
    set_visibility(alice, "visible")
    expect(alice.locator("#state")).to_have_text("Your lock was taken over by Bob", timeout=10_000)
    expect(alice.locator("#text")).to_be_disabled()


def test_closing_the_page_releases_and_the_waiting_window_gets_the_lock(
    server: Server, store: str, windows: Windows
) -> None:
    url = f"{server.url}/demo/edit/report%2F2025"  # a key with a slash, URL-encoded
    alice = open_editor(windows, url, "Alice")
    expect(alice.locator("#state")).to_have_text("Editing as Alice")
    bob = open_editor(windows, url, "Bob")
    expect(bob.locator("#state")).to_have_text(re.compile("^Locked by Alice"))

    closed_at = time.monotonic()
    alice.close()
    # Far sooner than the 15 s ttl: the release was sent as the page closed, and Bob's
    # window, waiting on the server, got the lock right after.
    expect(bob.locator("#state")).to_have_text("Editing as Bob", timeout=8000)
    assert time.monotonic() - closed_at < 10
    screenshot(bob, "edit-got-lock-after-close")

    with keymutex.Locks(store) as locks:
        holder = locks.holder("report/2025")
        assert holder is not None
        assert holder.owner == "Bob"
        remaining = holder.expires_at - time.time()
        bob.close()
        deadline = time.monotonic() + 5
        while locks.holder("report/2025") is not None:
            assert time.monotonic() < deadline, "closing the page did not release the lock"
            time.sleep(0.1)
    assert remaining > 8, "the lock was released by the page, not by expiry"


def test_a_crashed_tab_blocks_only_until_its_lease_expires(
    server: Server, store: str, windows: Windows
) -> None:
    url = f"{server.url}/demo/edit/doc%3A99"
    alice = open_editor(windows, url, "Alice")
    expect(alice.locator("#state")).to_have_text("Editing as Alice")
    bob = open_editor(windows, url, "Bob")
    expect(bob.locator("#state")).to_have_text(re.compile("^Locked by Alice"))

    with keymutex.Locks(store) as locks:
        holder = locks.holder("doc:99")
        assert holder is not None
        # The renderer dies: no pagehide, no release, no more heartbeats.
        with contextlib.suppress(PlaywrightError):
            alice.goto("chrome://crash", timeout=5000)
        time.sleep(1)
        still = locks.holder("doc:99")
        assert still is not None
        assert still.fence == holder.fence, "a crashed tab cannot release"
        # Bob's window, waiting on the server, gets the lock once the lease expires.
        expect(bob.locator("#state")).to_have_text("Editing as Bob", timeout=25_000)
        taken = locks.holder("doc:99")
        assert taken is not None
        assert taken.fence > holder.fence
        assert time.time() >= holder.expires_at - 1, "taken before the crashed lease expired"
    screenshot(bob, "edit-after-crashed-tab")


def test_dashboard_lists_counts_down_and_force_releases(
    server: Server, store: str, windows: Windows
) -> None:
    with keymutex.Locks(store, owner="py-worker") as locks:
        lease = locks.acquire("job:nightly", ttl=50, info={"host": "worker-3"})
        other = locks.acquire("report:1", ttl=50)
        page = windows.open("dashboard")
        page.goto(server.url)

        row = page.locator("tr[data-key='job:nightly']")
        expect(row.locator(".owner")).to_have_text("py-worker")
        expect(row.locator(".info")).to_have_text("host: worker-3")
        expect(row.locator(".fence")).to_have_text(str(lease.fence))
        expect(page.locator("tr[data-key='report:1']")).to_be_visible()

        # "Expires in" counts down client-side between snapshots; "held for" counts up.
        first = seconds(row.locator(".expires-in").inner_text())
        assert 40 <= first <= 50
        time.sleep(2.2)
        later = seconds(row.locator(".expires-in").inner_text())
        assert first - 4 <= later <= first - 1, (first, later)
        assert seconds(row.locator(".held-for").inner_text()) >= 2
        screenshot(page, "dashboard")

        # The prefix filter narrows the list.
        page.fill("#prefix", "job:")
        page.click("#filter button[type=submit]")
        expect(row).to_be_visible()
        expect(page.locator("tr[data-key='report:1']")).to_have_count(0)

        row.get_by_role("button", name="Force release job:nightly").click()
        page.fill("#reason", "stuck nightly job")
        page.get_by_role("button", name="Force release", exact=True).click()
        expect(page.locator("#message")).to_have_text(re.compile("Released job:nightly"))
        expect(row).to_have_count(0)
        screenshot(page, "dashboard-force-released")

        with pytest.raises(keymutex.LockLost):
            lease.renew()
        assert locks.holder("job:nightly") is None
        other.release()


def test_dashboard_follows_the_namespace_and_sees_changes_live(
    server: Server, store: str, windows: Windows
) -> None:
    page = windows.open("dashboard")
    page.goto(f"{server.url}/?namespace=shop")
    expect(page.locator("#namespace")).to_have_value("shop")
    expect(page.locator("#empty")).to_be_visible()
    with keymutex.Locks(store, namespace="shop", owner="py-shop") as locks:
        # Changes made in the store directly show up at the next snapshot (<= 5 s).
        with locks.lock("order:7", ttl=30):
            expect(page.locator("tr[data-key='order:7'] .owner")).to_have_text(
                "py-shop", timeout=8000
            )
        expect(page.locator("tr[data-key='order:7']")).to_have_count(0, timeout=8000)


def test_dashboard_asks_for_a_token_and_shows_a_refused_force_release(
    windows: Windows, tmp_path: Path
) -> None:
    viewer = "viewer-" + "v" * 32
    tokens: list[dict[str, object]] = [
        {
            "name": "viewer",
            "token": viewer,
            "grants": [{"namespace": "*", "prefix": "", "allow": ["read"]}],
        }
    ]
    with (
        serve(tmp_path, tokens=tokens) as server,
        keymutex.Locks(f"sqlite://{tmp_path}/locks.db", owner="py-worker") as locks,
    ):
        lease = locks.acquire("invoice:9", ttl=60)
        page = windows.open("dashboard")
        page.goto(server.url)
        expect(page.locator("#token-form")).to_be_visible()
        page.fill("#token", viewer)
        page.click("#token-form button[type=submit]")
        row = page.locator("tr[data-key='invoice:9']")
        expect(row.locator(".owner")).to_have_text("py-worker")

        row.get_by_role("button", name="Force release invoice:9").click()
        page.fill("#reason", "trying without admin")
        page.get_by_role("button", name="Force release", exact=True).click()
        expect(page.locator("#force-error")).to_have_text(re.compile("^Not allowed: "))
        screenshot(page, "dashboard-forbidden")
        assert page.evaluate("sessionStorage.getItem('keymutex.apiToken')") == viewer
        lease.renew()  # still held
        lease.release()
        windows.close()


def test_edit_page_with_an_api_token_asks_for_it_and_releases_on_close(
    windows: Windows, tmp_path: Path
) -> None:
    # A beacon cannot carry the Authorization header: the page releases with a
    # keepalive fetch instead, which must outlive the closed page as well.
    editor = "editor-" + "e" * 32
    tokens: list[dict[str, object]] = [
        {
            "name": "editor-app",
            "token": editor,
            "grants": [{"namespace": "cms", "prefix": "doc:", "allow": ["lock", "read"]}],
        }
    ]
    with (
        serve(tmp_path, tokens=tokens) as server,
        keymutex.Locks(f"sqlite://{tmp_path}/locks.db", namespace="cms") as locks,
    ):
        page = open_editor(windows, f"{server.url}/demo/edit/doc%3A7?namespace=cms", "Carol")
        expect(page.locator("#token-form")).to_be_visible()
        page.fill("#token", editor)
        page.click("#token-form button[type=submit]")
        expect(page.locator("#state")).to_have_text("Editing as Carol")
        holder = locks.holder("doc:7")
        assert holder is not None
        assert holder.owner == "Carol"
        page.close()
        deadline = time.monotonic() + 5
        while locks.holder("doc:7") is not None:
            assert time.monotonic() < deadline, "closing the page did not release the lock"
            time.sleep(0.1)
        windows.close()


def seconds(text: str) -> int:
    """Seconds in the dashboard's "1 min 5 s" / "45 s" display."""
    match = re.fullmatch(r"(?:(\d+) min )?(\d+) s", text.strip())
    assert match, f"not a duration: {text!r}"
    return int(match[1] or 0) * 60 + int(match[2])


def test_a_dashboard_of_many_locks_lists_the_first_rows_and_counts_them_all(
    server: Server, store: str, windows: Windows
) -> None:
    """Found by review: every open dashboard was sent the whole namespace after each
    change and every 4 s, and drew every row: at 10,000 leases a page froze for seconds
    at each snapshot (and reconnected, never live again, with large infos), and the
    server slowed renewals to half a second. The stream carries the first 500 rows by
    key and the count of all; a prefix narrows the list."""
    with keymutex.Locks(store, namespace="many", owner="bulk") as locks:
        leases = [locks.acquire(f"item:{n:04d}", ttl=120) for n in range(520)]
        page = windows.open("dashboard")
        page.goto(f"{server.url}/?namespace=many")
        expect(page.locator("#count")).to_have_text(
            re.compile(r"520 held; the first 500 shown, narrow with a prefix")
        )
        expect(page.locator("tbody tr")).to_have_count(500)
        expect(page.locator("tr[data-key='item:0499']")).to_be_visible()
        expect(page.locator("tr[data-key='item:0500']")).to_have_count(0)
        page.fill("#prefix", "item:05")
        page.click("#filter button[type=submit]")
        expect(page.locator("tbody tr")).to_have_count(20)
        expect(page.locator("#count")).to_have_text("(20 held)")
        for lease in leases:
            lease.release()
        expect(page.locator("tbody tr")).to_have_count(0, timeout=8000)

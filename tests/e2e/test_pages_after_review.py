"""The dashboard and the edit-lock page in a real browser: what a review found broken.

- The edit page: hidden tabs waiting for a document must not take the browser's
  connections to the server (six per server) from the tab that edits; an editing tab
  whose heartbeat does not get through says so; a name or namespace too long is shown
  as an error, not a blank page.
- The dashboard: a force release names the lease it releases and spares one that took
  the key meanwhile; a blank reason is refused; a list that is not live is shown as
  the last snapshot ("as of"), with the server's store error if that is why; a filter or
  token the server refuses shows the server's message instead of retrying forever; a
  key named as a property of every object ("constructor") shows its own waiting count.
- Both pages work below a base path, behind a reverse proxy.

Each test starts ``keymutex serve`` of its own (tests/e2e/_server.py); pages are driven
with Playwright in Debian's chromium, as in test_browser.py.
"""

from __future__ import annotations

import contextlib
import http.server
import re
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from _browser import BROWSER_TESTS, HEARTBEAT, Windows, screenshot, set_visibility
from _server import Server, serve
from playwright.sync_api import Page, Route, expect

import keymutex

TTL = 15.0  # seconds: the edit page's lease (edit.js)
AT_RISK = "Your lock may be lost: editing is paused"

pytestmark = BROWSER_TESTS


def start_editing(page: Page, url: str, name: str) -> None:
    page.goto(url)
    page.fill("#name", name)
    page.click("#start")


def wait_until(condition: Callable[[], bool], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(message)
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------
# The edit page


def test_hidden_tabs_waiting_for_documents_leave_the_editing_tab_its_heartbeats(
    server: Server, store: str, windows: Windows
) -> None:
    """One browser, so one pool of six connections to the server: an editing tab (its
    watch holds one) and five tabs waiting for documents that others hold. Hidden, the
    waiting tabs hold no long poll, so the editor's renewals go through; shown again, a
    waiting tab picks up where it was and gets its document once it is free."""
    browser = windows.context("one browser")
    with keymutex.Locks(store, owner="py-other") as locks:
        others = [
            locks.acquire(f"busy:{i}", ttl=300, info={"name": f"Other{i}"}) for i in range(5)
        ]
        editor = browser.new_page()
        start_editing(editor, f"{server.url}/demo/edit/doc%3Amine", "Alice")
        expect(editor.locator("#state")).to_have_text("Editing as Alice")

        waiting = []
        for i in range(5):
            tab = browser.new_page()
            start_editing(tab, f"{server.url}/demo/edit/busy%3A{i}", "Alice")
            expect(tab.locator("#state")).to_have_text(re.compile(f"^Locked by Other{i} since"))
            set_visibility(tab, "hidden")
            waiting.append(tab)
        editor.bring_to_front()

        # Two renewals in a row get through: the server's expiry moves on, twice.
        for _renewal in range(2):
            before = locks.holder("doc:mine")
            assert before is not None
            assert before.owner == "Alice"

            def renewed(before: keymutex.Holder = before) -> bool:
                now = locks.holder("doc:mine")
                assert now is not None, "the editing tab lost its lock"
                assert now.fence == before.fence
                return now.expires_at > before.expires_at + 0.5

            wait_until(renewed, HEARTBEAT * 2 + 3, "the editing tab's lease was not renewed")
        expect(editor.locator("#state")).to_have_text("Editing as Alice")
        expect(editor.locator("#text")).to_be_editable()

        # busy:0 is released while its tab is hidden; shown again, the tab gets it.
        others[0].release()
        set_visibility(waiting[0], "visible")
        expect(waiting[0].locator("#state")).to_have_text("Editing as Alice", timeout=10_000)
        holder = locks.holder("busy:0")
        assert holder is not None
        assert holder.owner == "Alice"
        for lease in others[1:]:
            lease.release()


def test_an_editing_tab_warns_and_pauses_when_its_heartbeat_does_not_get_through(
    server: Server, store: str, windows: Windows
) -> None:
    """Renewals that hang (queued behind other requests, a server that does not answer):
    the page must not keep saying "Editing as Alice" until the lease is gone."""
    page = windows.open("editor")
    start_editing(page, f"{server.url}/demo/edit/doc%3Aslow", "Alice")
    expect(page.locator("#state")).to_have_text("Editing as Alice")
    page.fill("#text", "Alice's draft")

    stalled: list[Route] = []
    page.route("**/v1/renew", lambda route: stalled.append(route))  # held, for now
    expect(page.locator("#state")).to_have_text(AT_RISK, timeout=HEARTBEAT * 1000 + 10_000)
    with keymutex.Locks(store) as locks:
        holder = locks.holder("doc:slow")
    assert holder is not None, "the warning came only after the lock was lost"
    assert holder.expires_at - time.time() > 1
    expect(page.locator("#detail")).to_contain_text("expires at")
    expect(page.locator("#text")).not_to_be_editable()
    expect(page.locator("#text")).to_have_value("Alice's draft")
    screenshot(page, "edit-heartbeat-stalled")

    # The renewal gets through after all: editing resumes.
    page.unroute("**/v1/renew")
    for route in stalled:
        with contextlib.suppress(Exception):  # one the page gave up on already
            route.continue_()
    expect(page.locator("#state")).to_have_text("Editing as Alice", timeout=10_000)
    expect(page.locator("#text")).to_be_editable()


def test_an_editing_tab_renews_at_once_when_the_machine_wakes(
    server: Server, windows: Windows
) -> None:
    """Found by review: after a suspend shorter than the TTL, the page's heartbeat timer
    (stopped with the machine) came seconds after waking, too late for the lease the
    server kept counting down, and the page lost a lock it could have kept. A suspend
    as the page sees it: the wall clock jumps, timers and performance.now() do not."""
    page = windows.open("editor")
    renewals: list[float] = []
    page.clock.install()  # before the page loads: its client takes Date.now then
    page.on("request", lambda request: "/v1/renew" in request.url and renewals.append(1))
    start_editing(page, f"{server.url}/demo/edit/doc%3Asleepy", "Alice")
    expect(page.locator("#state")).to_have_text("Editing as Alice")

    def until(condition: Callable[[], bool], seconds: float, message: str) -> None:
        deadline = time.monotonic() + seconds
        while not condition():  # the page's events come in while Playwright waits
            if time.monotonic() > deadline:
                pytest.fail(message)
            page.wait_for_timeout(100)

    until(lambda: len(renewals) >= 1, HEARTBEAT + 10, "no heartbeat")
    page.wait_for_timeout(1000)  # a second into the heartbeat's 5 s
    before = len(renewals)
    page.clock.set_system_time(page.evaluate("Date.now()") / 1000 + 9)  # 9 s asleep
    # The next tick (every second) sends the overdue heartbeat: within about 2 s of
    # waking, not at the old timer's 4 s.
    until(lambda: len(renewals) > before, 2.5, "no renewal soon after waking")
    expect(page.locator("#state")).to_have_text("Editing as Alice")


def test_edit_page_shows_a_name_or_namespace_too_long_and_keeps_its_form(
    server: Server, store: str, windows: Windows
) -> None:
    # 90 CJK characters fit the field's maxlength (100) but are 270 bytes as UTF-8,
    # and the name is the lease's owner: at most 256 bytes.
    page = windows.open("long name")
    start_editing(page, f"{server.url}/demo/edit/doc%3Aname", "   ")  # only spaces
    expect(page.locator("#name-error")).to_have_text(re.compile("Enter your name"))
    expect(page.locator("#name-form")).to_be_visible()
    page.fill("#name", "山" * 90)
    page.click("#start")
    expect(page.locator("#name-error")).to_have_text(re.compile("too long: 270 bytes"))
    expect(page.locator("#name-form")).to_be_visible()
    expect(page.locator("#lock-state")).to_be_hidden()
    page.fill("#name", "山" * 85)  # 255 bytes
    page.click("#start")
    expect(page.locator("#state")).to_have_text("Editing as " + "山" * 85)
    expect(page.locator("#name-error")).to_be_hidden()

    other = windows.open("long namespace")
    start_editing(other, f"{server.url}/demo/edit/doc%3Ans?namespace={'n' * 300}", "Alice")
    expect(other.locator("#name-error")).to_have_text(
        re.compile("namespace is 300 bytes as UTF-8; at most 256")
    )
    expect(other.locator("#name-form")).to_be_visible()
    with keymutex.Locks(store) as locks:
        assert locks.holder("doc:name") is not None
        assert locks.holder("doc:ns") is None


def _taken_over_then_freed(server: Server, windows: Windows, quoted_key: str) -> Page:
    """Alice edits; Bob takes over, then stops: Alice's window, which says it is free."""
    url = f"{server.url}/demo/edit/{quoted_key}"
    alice = windows.open("Alice")
    start_editing(alice, url, "Alice")
    expect(alice.locator("#state")).to_have_text("Editing as Alice")
    bob = windows.open("Bob")
    start_editing(bob, url, "Bob")
    bob.click("#take-over")
    expect(bob.locator("#state")).to_have_text("Editing as Bob")
    expect(alice.locator("#state")).to_have_text("Your lock was taken over by Bob", timeout=10_000)
    bob.click("#stop")  # Bob is done: the document is free
    expect(alice.locator("#state")).to_have_text("The document is free now", timeout=10_000)
    return alice


def test_a_window_that_lost_its_lock_says_when_the_document_is_free_again(
    server: Server, store: str, windows: Windows
) -> None:
    """Found trying the demo: after Bob took over and then left, Alice's window still
    said "taken over by Bob … your changes would overwrite theirs", offering to take
    over a document nobody held. It follows the key now, and never takes it by itself."""
    alice = _taken_over_then_freed(server, windows, "doc%3Afree")
    expect(alice.locator("#edit-again")).to_be_visible()
    expect(alice.locator("#take-over")).to_be_hidden()
    with keymutex.Locks(store) as locks:
        assert locks.holder("doc:free") is None  # it did not take the lock by itself
    screenshot(alice, "edit-free-after-loss")
    alice.click("#edit-again")
    expect(alice.locator("#state")).to_have_text("Editing as Alice")


def test_a_window_shown_free_names_whoever_takes_the_document_next(
    server: Server, store: str, windows: Windows
) -> None:
    """Found by review (2026-11-28): a window that had shown "The document is free
    now" stopped following the key, and went on saying "free" while Carol edited."""
    alice = _taken_over_then_freed(server, windows, "doc%3Afree-then-taken")
    with keymutex.Locks(store, owner="Carol") as locks:
        lease = locks.acquire("doc:free-then-taken", timeout=0)
        try:
            expect(alice.locator("#state")).to_contain_text("Carol", timeout=10_000)
            expect(alice.locator("#take-over")).to_be_visible()
        finally:
            lease.release()


# ---------------------------------------------------------------------------------------
# The dashboard: force release


def test_dashboard_fits_a_phones_width(server: Server, store: str, windows: Windows) -> None:
    """Found trying the dashboard at 400 px: the page was 519 px wide and scrolled
    sideways. The table scrolls in its own box now."""
    with keymutex.Locks(store) as locks:
        lease = locks.acquire(
            "report:nightly", ttl=60, info={"job": "nightly-report", "host": "worker-7" * 4}
        )
        page = windows.open("phone")
        page.set_viewport_size({"width": 400, "height": 800})
        page.goto(server.url)
        expect(page.locator("#locks tbody th").first).to_have_text("report:nightly")
        assert page.evaluate("document.documentElement.scrollWidth") <= 400
        screenshot(page, "dashboard-phone")
        lease.release()


def test_force_release_names_the_lease_and_spares_one_that_took_the_key_meanwhile(
    server: Server, store: str, windows: Windows
) -> None:
    page = windows.open("dashboard")
    page.goto(server.url)
    with keymutex.Locks(store, owner="alice@laptop") as alice_locks:
        alice = alice_locks.acquire("doc:toctou", ttl=60, info={"name": "Alice"})
        row = page.locator("tr[data-key='doc:toctou']")
        expect(row.locator(".owner")).to_have_text("alice@laptop")
        row.get_by_role("button", name="Force release doc:toctou").click()
        dialog = page.locator("#force-dialog")
        expect(dialog).to_contain_text(f"Held by alice@laptop (fence {alice.fence})")
        page.fill("#reason", "Alice left for the day")

        # Meanwhile Alice's lease ends and Bob takes the key.
        alice.release()
        with keymutex.Locks(store, owner="bob@desk") as bob_locks:
            bob = bob_locks.acquire("doc:toctou", ttl=60, info={"name": "Bob"})
            page.get_by_role("button", name="Force release", exact=True).click()
            expect(page.locator("#force-error")).to_have_text(
                re.compile(f"^Not released: .*bob@desk \\(fence {bob.fence}\\)")
            )
            expect(dialog).to_be_visible()
            screenshot(page, "dashboard-force-release-spared")
            bob.renew()  # still Bob's
            page.click("#force-cancel")

            # Released from Bob's own row, it is Bob's lease that goes.
            expect(row.locator(".owner")).to_have_text("bob@desk")
            row.get_by_role("button", name="Force release doc:toctou").click()
            expect(dialog).to_contain_text(f"Held by bob@desk (fence {bob.fence})")
            page.fill("#reason", "Bob's turn")
            page.get_by_role("button", name="Force release", exact=True).click()
            expect(page.locator("#message")).to_have_text(
                f"Released doc:toctou (held by bob@desk, fence {bob.fence})."
            )
            with pytest.raises(keymutex.LockLost):
                bob.renew()


def test_a_key_that_turns_text_around_does_not_turn_the_message_around(
    server: Server, store: str, windows: Windows
) -> None:
    """Found by review: a right-to-left override in a key (U+202E) reversed the rest of
    the sentence it was shown in ("Released invoice/,yp yb dleh…"), its holder and
    fence among them. It is shown as an escape, as the command line shows it."""
    key = "invoice/\u202e1gp.exe"
    page = windows.open("dashboard")
    page.goto(server.url)
    with keymutex.Locks(store, owner="py") as locks:
        lease = locks.acquire(key, ttl=60)
        page.get_by_role("button", name=f"Force release {key}").click()
        page.fill("#reason", "spoofing test")
        page.get_by_role("button", name="Force release", exact=True).click()
        expect(page.locator("#message")).to_have_text(
            f"Released invoice/\\u202e1gp.exe (held by py, fence {lease.fence})."
        )


def test_focus_returns_to_the_rows_button_after_the_dialog_though_rows_were_redrawn(
    server: Server, store: str, windows: Windows
) -> None:
    """Found by review: a snapshot while the force-release dialog was open rebuilt the
    rows, and Escape left the keyboard's focus on <body>, its place lost."""
    page = windows.open("dashboard")
    page.goto(server.url)
    with keymutex.Locks(store) as locks:
        lease = locks.acquire("kb/1", ttl=60)
        button = page.get_by_role("button", name="Force release kb/1")
        button.focus()
        page.keyboard.press("Enter")
        expect(page.locator("#force-dialog")).to_be_visible()
        other = locks.acquire("kb/2", ttl=60)  # a change: a new snapshot, rows redrawn
        expect(page.locator("tr[data-key='kb/2']")).to_have_count(1)
        page.keyboard.press("Escape")
        expect(page.get_by_role("button", name="Force release kb/1")).to_be_focused()
        other.release()
        lease.release()


def test_a_long_key_and_owner_wrap_rather_than_widen_the_pages(
    server: Server, store: str, windows: Windows
) -> None:
    """Found by review: a key in the edit page's heading, and an owner without spaces on
    the dashboard, never wrapped: the pages scrolled sideways (2,663 px for 1,200)."""
    key = "documents/5f3c9a7e8b2d4c1fa6e09b7d3c2f1a48"
    with keymutex.Locks(store, owner="worker-" + "x" * 200) as locks:
        lease = locks.acquire(key, ttl=60)
        page = windows.open("dashboard")
        page.set_viewport_size({"width": 1200, "height": 800})
        page.goto(server.url)
        expect(page.locator(f"tr[data-key='{key}']")).to_have_count(1)
        assert page.evaluate("document.documentElement.scrollWidth") <= 1200
        phone = windows.open("phone")
        phone.set_viewport_size({"width": 375, "height": 800})
        phone.goto(f"{server.url}/demo/edit/{key}")
        expect(phone.locator("h1 code")).to_have_text(key)
        assert phone.evaluate("document.documentElement.scrollWidth") <= 375
        lease.release()


def test_keys_named_as_an_objects_own_properties_show_their_waiters(
    server: Server, store: str, windows: Windows
) -> None:
    """Found by review: the waiting counts were looked up in the snapshot's object, so
    a key named as a property every object has showed that property: "constructor"
    was waited for by "function Object() { [native code] }", "__proto__" by
    "[object Object]"."""
    page = windows.open("dashboard")
    page.goto(f"{server.url}/?namespace=proto")
    with keymutex.Locks(store, namespace="proto", owner="py") as locks:
        names = ["__proto__", "constructor", "hasOwnProperty", "toString", "valueOf"]
        leases = [locks.acquire(name, ttl=60) for name in names]
        with keymutex.Locks(server.url, namespace="proto") as remote:
            waiter = threading.Thread(
                target=lambda: remote.acquire("valueOf", timeout=30).release()
            )
            waiter.start()
            try:
                row = page.locator("tr[data-key='valueOf']")
                expect(row.locator(".waiting")).to_have_text("1")
                for name in names[:-1]:
                    expect(page.locator(f"tr[data-key='{name}'] .waiting")).to_have_text("0")
            finally:
                for lease in leases:
                    lease.release()
                waiter.join(timeout=30)


def test_force_release_refuses_a_reason_of_spaces(
    server: Server, store: str, windows: Windows
) -> None:
    page = windows.open("dashboard")
    sent: list[str] = []
    page.on(
        "request",
        lambda request: sent.append(request.url) if "force-release" in request.url else None,
    )
    page.goto(server.url)
    with keymutex.Locks(store, owner="py-worker") as locks:
        lease = locks.acquire("ws:doc", ttl=60)
        row = page.locator("tr[data-key='ws:doc']")
        row.get_by_role("button", name="Force release ws:doc").click()
        page.fill("#reason", "   ")
        page.get_by_role("button", name="Force release", exact=True).click()
        expect(page.locator("#force-error")).to_have_text(re.compile("^Give a reason"))
        expect(page.locator("#force-dialog")).to_be_visible()
        assert sent == []
        lease.renew()  # still held
        lease.release()


# ---------------------------------------------------------------------------------------
# The dashboard: a list that is not live


def test_dashboard_shows_the_last_snapshot_as_stale_while_the_server_is_down(
    tmp_path: Path, windows: Windows
) -> None:
    store = f"sqlite://{tmp_path}/locks.db"
    with keymutex.Locks(store, owner="cron") as locks:
        lease = locks.acquire("job:nightly", ttl=600)
        page = windows.open("dashboard")
        row = page.locator("tr[data-key='job:nightly']")
        with serve(tmp_path) as server:
            page.goto(server.url)
            expect(row.locator(".owner")).to_have_text("cron")
            expect(page.locator("#status")).to_have_text(re.compile("^Live"))
            expect(page.locator("#locks caption")).not_to_contain_text("as of")
        lease.release()  # while the server is down: the page cannot know

        expect(page.locator("#locks caption")).to_contain_text(
            re.compile(r"1 held as of \d{1,2}:\d{2}:\d{2}.*not live"), timeout=10_000
        )
        expect(page.locator("#status")).not_to_have_text(re.compile("^Live"))
        # The countdowns stand still: nothing says how long the lock still has.
        expires, held = (
            row.locator(".expires-in").inner_text(),
            row.locator(".held-for").inner_text(),
        )
        time.sleep(2.5)
        assert row.locator(".expires-in").inner_text() == expires
        assert row.locator(".held-for").inner_text() == held
        screenshot(page, "dashboard-stale")


VIEWER = "viewer-" + "v" * 32


@pytest.mark.parametrize("stream", ["EventSource", "fetch with a token"])
def test_dashboard_shows_the_stores_error_from_the_stream_and_recovers(
    tmp_path: Path, windows: Windows, stream: str
) -> None:
    """The server's store (Redis) fails: the stream goes on with `event: error`, whose
    message the page shows, its list marked stale; the store back, the list is live."""
    from _redis_fixtures import require_redis

    require_redis()
    from _redis_servers import standalone

    tokens: list[dict[str, object]] | None = None
    if stream != "EventSource":  # EventSource sends no Authorization: the page uses fetch
        grants = [{"namespace": "*", "prefix": "", "allow": ["read"]}]
        tokens = [{"name": "viewer", "token": VIEWER, "grants": grants}]
    with (
        standalone(tmp_path / "redis") as redis_server,
        serve(tmp_path, tokens=tokens, store=redis_server.url) as server,
        keymutex.Locks(redis_server.url, owner="worker") as locks,
    ):
        locks.acquire("job:a", ttl=300)
        page = windows.open("dashboard")
        if tokens is not None:
            page.add_init_script(f"sessionStorage.setItem('keymutex.apiToken', {VIEWER!r})")
        page.goto(server.url)
        row = page.locator("tr[data-key='job:a']")
        expect(row.locator(".owner")).to_have_text("worker")

        redis_server.kill()
        message = page.locator("#message")
        expect(message).to_have_text(
            re.compile("^The lock server's store failed: "), timeout=15_000
        )
        expect(page.locator("#status")).to_have_text(re.compile("cannot read its store"))
        expect(page.locator("#locks caption")).to_contain_text("as of")
        expect(row).to_be_visible()  # the last snapshot, marked stale
        screenshot(page, f"dashboard-store-error-{stream.split()[0]}")

        redis_server.restart()  # empty: no persistence
        expect(page.locator("#status")).to_have_text(re.compile("^Live"), timeout=15_000)
        expect(message).to_be_hidden()
        expect(row).to_have_count(0)
        expect(page.locator("#locks caption")).not_to_contain_text("as of")
        windows.close()


@pytest.mark.parametrize(
    ("query", "refusal"),
    [
        (f"namespace={'n' * 300}", "namespace is 300 bytes as UTF-8; at most 256 are accepted"),
        (f"prefix={'p' * 1100}", "prefix is 1100 bytes as UTF-8; at most 1024 are accepted"),
    ],
)
def test_dashboard_shows_why_the_server_refuses_a_filter_and_stops_asking(
    server: Server, windows: Windows, query: str, refusal: str
) -> None:
    page = windows.open("dashboard")
    asked: list[str] = []
    page.on(
        "request", lambda request: asked.append(request.url) if "/v1/" in request.url else None
    )
    page.goto(f"{server.url}/?{query}")
    expect(page.locator("#message")).to_have_text(refusal)
    expect(page.locator("#status")).to_have_text("Refused by the server")
    count = len(asked)
    time.sleep(3)  # a retry would come within 1 s
    assert len(asked) == count, asked[count:]

    # Another filter is asked for at once, and shown.
    page.fill("#namespace", "")
    page.fill("#prefix", "")
    page.click("#filter button[type=submit]")
    expect(page.locator("#status")).to_have_text(re.compile("^Live"))
    expect(page.locator("#message")).to_be_hidden()


def test_dashboard_with_a_token_shows_a_namespace_it_may_not_read(
    tmp_path: Path, windows: Windows
) -> None:
    reader = "reader-" + "r" * 32
    grants = [{"namespace": "cms", "prefix": "", "allow": ["read"]}]
    tokens: list[dict[str, object]] = [{"name": "cms-reader", "token": reader, "grants": grants}]
    with serve(tmp_path, tokens=tokens) as server:
        page = windows.open("dashboard")
        asked: list[str] = []
        page.on(
            "request", lambda request: asked.append(request.url) if "/v1/" in request.url else None
        )
        page.goto(f"{server.url}/?namespace=cms")
        page.fill("#token", reader)
        page.click("#token-form button[type=submit]")
        expect(page.locator("#status")).to_have_text(re.compile("^Live"))

        page.fill("#namespace", "other")
        page.click("#filter button[type=submit]")
        expect(page.locator("#status")).to_have_text("Not allowed")
        expect(page.locator("#message")).to_have_text(
            "API token 'cms-reader' has no 'read' permission"
            " on keys starting with '' in namespace 'other'"
        )
        count = len(asked)
        time.sleep(3)  # a retry would come within 1 s
        assert len(asked) == count, asked[count:]
        windows.close()


# ---------------------------------------------------------------------------------------
# Behind a reverse proxy, below a base path


class _Proxy(http.server.BaseHTTPRequestHandler):
    """/locks/… → the lock server; anything else is the site's own 404."""

    protocol_version = "HTTP/1.1"
    upstream = ""

    def _forward(self) -> None:
        if not self.path.startswith("/locks/"):
            self.send_error(404, "not the lock server")
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        skip = {"host", "content-length", "connection", "keep-alive", "transfer-encoding"}
        headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
        headers["Host"] = "127.0.0.1"  # a server without a token file answers only that
        try:
            with (
                httpx.Client(timeout=None) as client,
                client.stream(
                    self.command,
                    self.upstream + self.path.removeprefix("/locks"),
                    headers=headers,
                    content=body,
                ) as reply,
            ):
                self.send_response(reply.status_code)
                for name, value in reply.headers.items():
                    if name.lower() not in skip | {"content-encoding"}:
                        self.send_header(name, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for chunk in reply.iter_raw():
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
        except (OSError, httpx.HTTPError):
            self.close_connection = True  # the page left, or the server stopped

    do_GET = do_POST = do_HEAD = _forward

    def log_message(self, format: str, *args: object) -> None:
        pass


class _ProxyServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a connection the page dropped


@pytest.fixture
def proxy(server: Server) -> Iterator[str]:
    handler = type("Proxy", (_Proxy,), {"upstream": server.url})
    running = _ProxyServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=running.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{running.server_address[1]}/locks"
    running.shutdown()
    running.server_close()
    thread.join()


def test_pages_work_below_a_base_path_behind_a_proxy(
    server: Server, store: str, proxy: str, windows: Windows
) -> None:
    with keymutex.Locks(store, owner="py-worker") as locks:
        lease = locks.acquire("job:nightly", ttl=60)
        dashboard = windows.open("dashboard")
        dashboard.goto(f"{proxy}/")
        expect(dashboard.locator("#status")).to_have_text(re.compile("^Live"))
        expect(dashboard.locator("tr[data-key='job:nightly'] .owner")).to_have_text("py-worker")
        lease.release()

        editor = windows.open("editor")
        start_editing(editor, f"{proxy}/demo/edit/doc%3A1", "Alice")
        expect(editor.locator("#state")).to_have_text("Editing as Alice")
        holder = locks.holder("doc:1")
        assert holder is not None
        assert holder.owner == "Alice"
        expect(editor.locator("#all-locks")).to_have_attribute("href", "./")
        assert editor.eval_on_selector("#all-locks", "a => a.href") == f"{proxy}/"
        expect(dashboard.locator("tr[data-key='doc:1'] .owner")).to_have_text("Alice")

    # At the root, a key with slashes of its own still finds the page's files.
    page = windows.open("slashes")
    start_editing(page, f"{server.url}/demo/edit/reports/2025/q1?namespace=shop", "Carol")
    expect(page.locator("#key")).to_have_text("reports/2025/q1")
    expect(page.locator("#state")).to_have_text("Editing as Carol")
    assert page.eval_on_selector("#all-locks", "a => a.href") == f"{server.url}/?namespace=shop"
    with keymutex.Locks(store, namespace="shop") as shop:
        holder = shop.holder("reports/2025/q1")
        assert holder is not None
        assert holder.owner == "Carol"


def test_a_key_holding_demo_edit_opens_its_own_page_even_unencoded(
    server: Server, store: str, proxy: str, windows: Windows
) -> None:
    """Reported: a link that left the key "a/demo/edit/b" unencoded opened a blank page
    (the page looked for key "b", and for its script below a/). The keys "." and "..",
    which a browser drops from any path, open as /demo/edit/?key=.."""
    cases = [
        (f"{server.url}/demo/edit/a/demo/edit/b", "a/demo/edit/b", f"{server.url}/"),
        (f"{proxy}/demo/edit/x/demo/edit/y", "x/demo/edit/y", f"{proxy}/"),
        (f"{server.url}/demo/edit/?key=..", "..", f"{server.url}/"),
        (f"{server.url}/demo/edit/100%", "100%", f"{server.url}/"),
    ]
    for n, (url, key, all_locks) in enumerate(cases):
        page = windows.open(f"editor {n}")
        start_editing(page, url, f"Editor {n}")
        expect(page.locator("#key")).to_have_text(key)
        expect(page.locator("#state")).to_have_text(f"Editing as Editor {n}")
        assert page.eval_on_selector("#all-locks", "a => a.href") == all_locks
    with keymutex.Locks(store) as locks:
        for n, (_, key, _) in enumerate(cases):
            holder = locks.holder(key)
            assert holder is not None, key
            assert holder.owner == f"Editor {n}"
        assert locks.holder("b") is None
        assert locks.holder("y") is None

"""Keys in URLs: every key the API takes reaches the right key through every link and route.

- The edit-lock page, ``/demo/edit/<key>``: the server writes into the page the key its
  path names and the way back to where the server is mounted. Reported: a link that
  left a key holding ``/demo/edit/`` unencoded opened another key (the page took its
  address apart after the last ``/demo/edit/``); a lone ``%`` showed no document; the
  keys ``.`` and ``..``, which browsers drop from any path, had no page at all.
- The ``http://`` store: keys that look like paths, escapes or URL parts (``/``,
  ``%2F``, ``..``, ``?``, ``#``) are the same keys at the server's store.

Requests are sent with ``http.client``, which sends a path exactly as written (httpx
would quote a lone ``%``), to a real uvicorn (``live``).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote, urljoin

import httpx
import pytest

import keymutex

from .conftest import Live


class _EditPage(HTMLParser):
    """What a browser takes from the edit page: its ``<base href>`` and the key."""

    def __init__(self) -> None:
        super().__init__()
        self.base: str | None = None
        self.key: object = None
        self._in_page_data = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "base":
            self.base = dict(attrs)["href"]
        self._in_page_data = tag == "script" and ("id", "page") in attrs

    def handle_endtag(self, tag: str) -> None:
        self._in_page_data = False

    def handle_data(self, data: str) -> None:
        if self._in_page_data:
            self.key = json.loads(data)["key"]


def _get_as_written(live: Live, path: str) -> tuple[int, str, str]:
    """GET ``path`` exactly as written: the status, the content type and the body."""
    host = httpx.URL(live.url)
    connection = http.client.HTTPConnection(host.host, host.port, timeout=10)
    try:
        connection.request("GET", path)
        reply = connection.getresponse()
        body = reply.read().decode()
    finally:
        connection.close()
    return reply.status, reply.getheader("content-type", ""), body


def _open_edit_page(live: Live, path: str) -> _EditPage:
    """GET ``path`` as written, and the page's base and key."""
    status, _, body = _get_as_written(live, path)
    assert status == 200, body
    page = _EditPage()
    page.feed(body)
    assert page.base is not None, f"the page at {path} has no <base>: {body[:600]}"
    return page


def _edit_link(key: str) -> str:
    """The edit page's link for ``key`` as docs/http-api.md says to build it."""
    if key in (".", ".."):
        return f"/demo/edit/?key={quote(key, safe='')}"
    return f"/demo/edit/{quote(key, safe='')}"


def test_an_unencoded_link_to_a_key_holding_demo_edit_opens_that_key(live: Live) -> None:
    """The report: /demo/edit/a/demo/edit/b opened key "b", its script looked for
    below a/ (a blank page); behind a proxy's /locks, the same."""
    for path in ("/demo/edit/a/demo/edit/b", "/demo/edit/demo/edit/"):
        page = _open_edit_page(live, path)
        assert page.key == path.removeprefix("/demo/edit/")
        assert page.base is not None
        assert urljoin(live.url + path, page.base) == f"{live.url}/"
        script = httpx.get(urljoin(live.url + path, page.base) + "static/edit.js")
        assert script.status_code == 200
        assert script.headers["content-type"].startswith("text/javascript")
        behind_proxy = f"https://example.com/locks{path}"
        assert urljoin(behind_proxy, page.base) == "https://example.com/locks/"


KEYS = [
    "a/demo/edit/b",
    "reports/2025/q1",
    "/leading//double/",
    "a%2Fb",
    "100%",
    "50% off?",
    "a?b=c&key=d#e",
    "#top",
    "two words + more",
    "café/ünï/日本/🔒",
    "..",
    ".",
    "../x",
    "a/../b",
    "x</script><script>alert(1)</script>",
    "line1\nline2",
]


@pytest.mark.parametrize("key", KEYS)
def test_every_key_has_an_edit_page_that_names_it(live: Live, key: str) -> None:
    page = _open_edit_page(live, _edit_link(key))
    assert page.key == key
    assert page.base is not None
    assert urljoin(live.url + _edit_link(key), page.base) == f"{live.url}/"


@pytest.mark.parametrize(
    ("path", "key"),
    [
        ("/demo/edit/100%", "100%"),  # a lone "%", read as the server reads it
        ("/demo/edit/reports/2025/q1?namespace=shop", "reports/2025/q1"),
        ("/demo/edit/a%3Fb%23c", "a?b#c"),
        ("/demo/edit/?key=a%2Fb%3Fc", "a/b?c"),
        ("/demo/edit/?key=two+words", "two words"),  # as a form would send it
        ("/demo/edit/path?key=query", "path"),  # the path's key, when it names one
        ("/demo/edit/", ""),  # no key: the page says "No document here"
    ],
)
def test_links_written_by_hand_open_the_key_they_show(live: Live, path: str, key: str) -> None:
    assert _open_edit_page(live, path).key == key


@pytest.mark.parametrize(
    "path",
    [
        "/demo/edit/%FF",
        "/demo/edit/a%FEb",
        "/demo/edit/%ED%A0%80",  # an encoded lone surrogate
        "/demo/edit/?key=%FF",
        "/demo/edit/doc?namespace=%FF",
    ],
)
def test_a_link_whose_escapes_are_not_utf8_is_refused_not_read_as_another_key(
    live: Live, path: str
) -> None:
    """Found by a new user's walk-through: the path was decoded with U+FFFD for each
    bad byte, so /demo/edit/%FF and /demo/edit/%FE opened one key, "\ufffd", which
    neither link names. The API refuses ?key=%FF; the page's address is refused alike."""
    status, content_type, body = _get_as_written(live, path)
    assert status == 400, body
    assert content_type == "application/json"
    answer = json.loads(body)
    assert answer["error"] == "invalid_argument"
    assert "not UTF-8" in answer["message"]


@pytest.mark.parametrize("key", [*KEYS, "a%252F", "%2e%2e", "?", "&", "=", "+"])
def test_keys_like_urls_reach_the_server_unchanged_through_the_http_store(
    make_live: Callable[..., Live], tmp_path: Path, key: str
) -> None:
    store = f"sqlite:///{tmp_path}/keys.db"
    served = make_live(store=store)
    with (
        keymutex.Locks(served.url, namespace="ns/../x?y#z") as remote,
        keymutex.Locks(store, namespace="ns/../x?y#z") as local,
    ):
        lease = remote.acquire(key, ttl=60, timeout=0)
        seen = local.holder(key)
        assert seen is not None
        assert seen.key == key
        assert seen.fence == lease.fence
        remote_holder = remote.holder(key)
        assert remote_holder is not None
        assert remote_holder.key == key
        assert [holder.key for holder in remote.holders(key)] == [key]
        remote.renew(key, lease.token)
        remote.release(key, lease.token)
        assert local.holder(key) is None

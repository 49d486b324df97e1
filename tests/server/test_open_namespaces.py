"""Which namespaces the server keeps open (``max_namespaces``), and when it closes them.

Opens and closes are counted by instrumenting the client the server opens per
namespace (``keymutex.server._state.AsyncLocks``), and through ``/metrics``.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from keymutex._client import AsyncLocks
from keymutex.server import _state, create_app

from .conftest import Live

PATIENCE = 20.0  # seconds an answer may take on a loaded machine


class _Recorded:
    """The namespaces whose clients were opened and closed, in order."""

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.closes_started: list[str] = []
        self.closes_ended: list[str] = []
        self.close_gate = threading.Event()  # closes go on once set
        self.close_gate.set()


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Recorded]:
    """Every namespace client the server opens from now on, recorded (and its closes
    held while ``close_gate`` is clear)."""
    record = _Recorded()

    class RecordedLocks(AsyncLocks):
        def __init__(self, url: str, **options: Any) -> None:
            super().__init__(url, **options)
            record.opened.append(self.namespace)

        async def aclose(self) -> None:
            record.closes_started.append(self.namespace)
            if not record.close_gate.is_set():
                await asyncio.to_thread(record.close_gate.wait, 3 * PATIENCE)  # beyond any reply
            await super().aclose()
            record.closes_ended.append(self.namespace)

    monkeypatch.setattr(_state, "AsyncLocks", RecordedLocks)
    # Every namespace of these tests counts as used just now, however slow the machine.
    monkeypatch.setattr(_state, "KEEP_RECENT", 3600.0, raising=False)
    yield record
    record.close_gate.set()  # the server's shutdown closes what is left


def _use(client: httpx.Client, namespace: str) -> None:
    reply = client.get("/v1/holder", params={"namespace": namespace, "key": "k"})
    assert reply.status_code == 200, reply.text


def test_namespaces_in_steady_use_stay_open_when_more_are_used_than_fit(
    make_live: Callable[..., Live], recorded: _Recorded
) -> None:
    """Six namespaces used in turn through a server that keeps four open (the default
    namespace among them): the three that fit beside it stay open, and only the other
    three are opened again in each round. Before, the least recently used was closed
    first, so each namespace was closed just before its next use: every request of
    every round after the first opened one (a connection and a schema check on SQLite)."""
    live = make_live(max_namespaces=4)
    names = [f"tenant-{n}" for n in range(6)]
    with httpx.Client(base_url=live.url, timeout=PATIENCE) as client:
        for _ in range(4):
            for name in names:
                _use(client, name)
        opened = Counter(recorded.opened)
        assert {name: opened[name] for name in names[:3]} == dict.fromkeys(names[:3], 1)
        assert {name: opened[name] for name in names[3:]} == dict.fromkeys(names[3:], 4)
        # The default namespace, opened at start, and every open since.
        assert live.metric("keymutex_namespace_opens_total") == 1 + len(recorded.opened)


def test_a_namespace_no_longer_used_gives_its_place_to_one_in_use(
    make_live: Callable[..., Live], recorded: _Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Those that stay open are not the first ones for ever: a namespace idle for
    ``KEEP_RECENT`` is closed before one used more recently (here every namespace not
    used in the current round has been idle that long)."""
    monkeypatch.setattr(_state, "KEEP_RECENT", 0.0)
    live = make_live(max_namespaces=4)
    with httpx.Client(base_url=live.url, timeout=PATIENCE) as client:
        for name in ("old-0", "old-1", "old-2"):
            _use(client, name)
        for _ in range(3):
            for name in ("new-0", "new-1", "new-2"):
                _use(client, name)
    assert Counter(recorded.opened) == dict.fromkeys(
        ["old-0", "old-1", "old-2", "new-0", "new-1", "new-2"], 1
    )


def test_a_reply_does_not_wait_for_another_namespace_to_close(
    make_live: Callable[..., Live], recorded: _Recorded
) -> None:
    """The namespaces beyond the limit are closed after the reply, in the background.
    Before, a request closed them itself before its reply was sent: with a store slow to
    disconnect, a request in one namespace waited for the close of another."""
    live = make_live(max_namespaces=1)
    recorded.close_gate.clear()  # every close now hangs until the end of the test
    try:
        with httpx.Client(base_url=live.url, timeout=PATIENCE) as client:
            for name in ("first", "second", "third"):
                try:
                    _use(client, name)
                except httpx.TimeoutException:
                    pytest.fail(
                        f"the request in {name!r} was not answered while"
                        f" {recorded.closes_started} were closing"
                    )
            assert recorded.closes_started  # closes were under way, held,
            assert recorded.closes_ended == []  # and the replies came all the same
    finally:
        recorded.close_gate.set()


@pytest.mark.parametrize("limit", [0, -1])
def test_max_namespaces_below_one_is_refused_before_the_store_is_opened(
    tmp_path: Path, limit: int
) -> None:
    with pytest.raises(ValueError, match=rf"max_namespaces must be at least 1 .*, not {limit}$"):
        create_app(f"sqlite:///{tmp_path}/locks.db", max_namespaces=limit)
    assert not (tmp_path / "locks.db").exists()

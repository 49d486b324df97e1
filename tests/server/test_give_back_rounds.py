"""``_giveback.GiveBacks``: a round whose first release fails keeps the rest for later.

Found by the third mutation audit: "each round of releases stops at the first that
fails (the store is still out of reach): the others wait for their next time"
(_giveback.py) was never tested with two tokens in one round. Dropping the rest of
the round (re-planning only the token that failed) passed the suite: the other
grants were never given back, and held their keys for their whole TTL.

Against a real lock server, through a proxy that resets connections while the store
is "out of reach".
"""

from __future__ import annotations

import threading
import time

import keymutex
from keymutex._giveback import JOIN_GRACE, GiveBacks

from .conftest import Live


class _Counted:
    """What a client counts its calls at the store with (``_Calls``)."""

    def __init__(self) -> None:
        self.inside = 0

    def enter(self, *, beside: bool = False) -> bool:
        self.inside += 1
        return True

    def __exit__(self, *exc_info: object) -> None:
        self.inside -= 1


def test_a_round_whose_first_release_fails_gives_back_the_others_later(live: Live) -> None:
    with (
        keymutex.Locks(live.url) as granting,
        live.proxied() as (proxy, url),
        keymutex.Locks(url) as releasing,
    ):
        # Two grants whose tokens only the give-back has (as after two lost answers).
        a = granting.acquire("a", ttl=60, timeout=0)
        b = granting.acquire("b", ttl=60, timeout=0)
        tried: list[str] = []
        failed = threading.Event()

        def release(key: str, token: str) -> keymutex.Lease | object:
            tried.append(key)
            try:
                return releasing._store.release(key, token)  # type: ignore[attr-defined]
            except keymutex.StoreError:
                failed.set()
                raise

        proxy.set_mode("reset")  # the store is out of reach
        give_backs = GiveBacks(release, _Counted())  # type: ignore[arg-type]
        with give_backs._wakeup:  # both due when the thread first looks: one round
            give_backs.add("a", a.token, 60)
            give_backs.add("b", b.token, 60)
        assert failed.wait(10)
        # Each round stops at its first failure: while the store is out of reach, only
        # "a" is tried (again, perhaps, in later rounds), never "b".
        assert "b" not in tried, "the round went on after a release failed"
        proxy.set_mode("pass")  # the store is back
        deadline = time.monotonic() + 10
        while granting.holder("a") is not None or granting.holder("b") is not None:
            assert time.monotonic() < deadline, (
                f"not given back: a={granting.holder('a')}, b={granting.holder('b')};"
                f" releases tried: {tried}"
            )
            time.sleep(0.02)
        give_backs.close()


def test_closing_makes_one_last_round_and_stops(live: Live) -> None:
    """Found by the same audit: ``_again`` re-plans nothing once closing. Re-planning
    there too passed the suite: the last round's tokens (whose grant was not found,
    the usual case: nothing had been granted) came due again at once, for ever, until
    their TTL: ``close()`` waited ``JOIN_GRACE`` and the thread went on releasing in a
    busy loop against the server."""
    with keymutex.Locks(live.url) as locks:
        tried: list[str] = []

        def release(key: str, token: str) -> object:
            tried.append(key)
            return locks._store.release(key, token)  # type: ignore[attr-defined]

        give_backs = GiveBacks(release, _Counted())  # type: ignore[arg-type]
        give_backs.add("k", "a-token-that-was-never-granted-anything", 60)
        deadline = time.monotonic() + 10
        while not tried:  # the release at once: nothing found, planned again
            assert time.monotonic() < deadline
            time.sleep(0.01)
        started = time.monotonic()
        give_backs.close()
        assert time.monotonic() - started < JOIN_GRACE - 1, (
            "close() waited for a round that never ended"
        )
        count = len(tried)
        time.sleep(0.3)
        assert len(tried) == count, "releases went on after close()"
        assert count <= 3  # at once, perhaps 0.1 s later, and the last round

"""The sans-I/O waiting decisions: how long a refused waiter parks."""

from __future__ import annotations

import pytest

from keymutex._wait import (
    EXPIRY_MARGIN,
    RECHECK_INTERVAL,
    STORE_WAIT,
    Backoff,
    Deadline,
    park_time,
)


def test_a_notified_waiter_parks_until_the_holder_expires() -> None:
    assert park_time(Deadline(None), 0.3, None) == pytest.approx(0.3 + EXPIRY_MARGIN)


def test_a_notified_waiter_looks_again_now_and_then() -> None:
    assert park_time(Deadline(None), 3600.0, None) == RECHECK_INTERVAL
    assert park_time(Deadline(None), None, None) == RECHECK_INTERVAL


def test_no_park_outlasts_the_deadline() -> None:
    assert park_time(Deadline(0.05), 10.0, None) <= 0.05
    assert park_time(Deadline(0.0), 10.0, Backoff()) == 0.0


def test_backoff_grows_with_jitter_up_to_its_ceiling() -> None:
    backoff = Backoff(initial=0.002, maximum=0.25)
    steps = [backoff.next() for _ in range(20)]
    assert all(0.001 <= step <= 0.25 for step in steps)
    assert steps[-1] >= 0.125, "the ceiling is reached"
    assert steps[0] <= 0.002
    assert len({round(step, 6) for step in steps[-8:]}) > 1, "steps at the ceiling are jittered"


def test_a_backing_off_waiter_still_wakes_at_the_holders_expiry() -> None:
    backoff = Backoff(initial=1.0, maximum=1.0)
    assert park_time(Deadline(None), 0.01, backoff) == pytest.approx(0.01 + EXPIRY_MARGIN)


def test_a_wait_at_the_store_lasts_until_the_deadline_not_the_holders_expiry() -> None:
    # The lock server watches the holder's expiry itself, and a new wait would queue
    # at the back: one long wait, bounded by the caller's deadline.
    assert park_time(Deadline(None), 0.3, None, at_store=True) == STORE_WAIT
    assert park_time(Deadline(4.0), 0.3, None, at_store=True) == pytest.approx(4.0, abs=0.05)

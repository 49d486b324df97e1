"""keymutex's errors as a caller handles them: printed, copied, pickled, sent across processes."""

from __future__ import annotations

import copy
import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest

import keymutex


def _refused() -> keymutex.Locked:
    locks = keymutex.Locks("memory://", owner="worker")
    with locks.lock("order:7", info={"job": 12}):
        try:
            locks.acquire("order:7", timeout=0)
        except keymutex.Locked as refused:
            return refused
    raise AssertionError("the second acquire was granted")


def _refuse_in_a_worker() -> None:
    raise _refused()


@pytest.mark.parametrize(
    "clone", [copy.copy, copy.deepcopy, lambda e: pickle.loads(pickle.dumps(e))]
)
def test_locked_keeps_its_key_holder_and_message_when_copied_or_pickled(clone: object) -> None:
    refused = _refused()
    assert callable(clone)
    again = clone(refused)
    assert type(again) is keymutex.Locked
    assert (again.key, again.holder, str(again)) == (refused.key, refused.holder, str(refused))
    assert again.holder is not None
    assert again.holder.info == {"job": 12}


@pytest.mark.parametrize("holder", [None, "thief"])
def test_lock_lost_keeps_its_key_holder_and_message_when_pickled(holder: str | None) -> None:
    locks = keymutex.Locks("memory://", namespace=f"lost-{holder}")
    lease = locks.acquire("doc")
    if holder is not None:
        thief = keymutex.Locks("memory://", namespace=f"lost-{holder}", owner=holder)
        thief.acquire("doc", steal=True, ttl=5)
    else:
        locks.release("doc", lease.token)
    with pytest.raises(keymutex.LockLost) as lost:
        lease.release()
    again = pickle.loads(pickle.dumps(lost.value))
    assert type(again) is keymutex.LockLost
    assert (again.key, again.holder, str(again)) == ("doc", lost.value.holder, str(lost.value))
    assert (again.holder and again.holder.owner) == holder
    assert lease.token not in str(pickle.dumps(again))  # tokens are secret; fences are not


def test_a_custom_message_survives_pickling() -> None:
    lost = pickle.loads(pickle.dumps(keymutex.LockLost("k", None, "renewal failed: store down")))
    assert str(lost) == "renewal failed: store down"
    assert lost.key == "k"
    assert lost.holder is None


def test_locked_raised_in_a_process_pool_job_reaches_the_caller() -> None:
    """Before: unpickling called Locked(message) and broke the whole pool."""
    context = multiprocessing.get_context("spawn")
    with (
        ProcessPoolExecutor(1, mp_context=context) as pool,
        pytest.raises(keymutex.Locked) as refused,
    ):
        pool.submit(_refuse_in_a_worker).result(timeout=60)
    assert refused.value.key == "order:7"
    assert refused.value.holder is not None
    assert (refused.value.holder.owner, refused.value.holder.info) == ("worker", {"job": 12})


def test_a_refusal_says_who_holds_the_key_since_when_and_until_when() -> None:
    """Story 1: "the refusal should say who holds it and since when". The message named
    the owner and the fence only; the times were on ``.holder`` alone."""
    holder = keymutex.Holder("doc", "alice@web-3", None, 7, 1_795_800_000.0, 1_795_800_030.4)
    said = str(keymutex.Locked("doc", holder))
    assert said == (
        "'doc' is locked: held by 'alice@web-3' since 2026-11-27T17:20:00Z, until"
        " 2026-11-27T17:20:30Z unless renewed (fence 7)"
    )
    lost = str(keymutex.LockLost("doc", holder))
    assert lost.startswith("lease on 'doc' was lost: held by 'alice@web-3' since 2026-11-27")
    assert str(keymutex.Locked("doc", None)) == "'doc' is locked: no current holder"

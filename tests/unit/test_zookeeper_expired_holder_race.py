"""ZooKeeper: a waiter clears an expired holder only if the holder did not renew meanwhile.

Found by the third mutation audit: ``_refused`` deletes the first contender's node,
once the leader's clock says it expired, with the version it read ("the version check
lets a renewal that got there first win"). Deleting without the version passed the
suite. Then a holder that renewed in time, between the waiter's read of its node and
the waiter's delete, lost its node to the waiter, which took the key: two holders,
the first one told by its renewal that it still held the key.

The interleaving is made exact by running the holder's renewal inside the waiter's
own write (the one that learns the leader's time), on real ZooKeeper; the waiter's
estimate of the leader's clock is set 0.5 s ahead so that the holder renews with
0.4 s to spare (a loaded machine makes no difference).
"""

from __future__ import annotations

import secrets
import time
import uuid
from typing import Any

import keymutex


def test_a_holder_that_renewed_in_time_is_not_cleared_by_a_waiter(zookeeper_url: str) -> None:
    namespace = f"expired-holder-race-{uuid.uuid4().hex}"
    with (
        keymutex.Locks(zookeeper_url, namespace=namespace) as holding,
        keymutex.Locks(zookeeper_url, namespace=namespace) as waiting,
    ):
        lease = holding.acquire("k", ttl=1.0, timeout=0)
        store: Any = waiting._store
        waiter = store.waiter("k")
        token = secrets.token_urlsafe(16)

        def try_acquire() -> keymutex.Holder | None:
            outcome = store.try_acquire(
                "k", token=token, ttl=30, owner="w", info=None, steal=False, waiter=waiter
            )
            return None if outcome.ok else outcome.holder

        assert try_acquire() is not None  # queued behind the holder
        renewed: list[float] = []
        real_set = store._set

        def set_after_a_renewal(node: Any, data: bytes) -> Any:
            if not renewed:  # the holder renews in time, then its old deadline passes
                renewed.append(lease.renew(ttl=30).fence)
                time.sleep(max(0.0, deadline - time.time()) + 0.2)
            return real_set(node, data)

        store._set = set_after_a_renewal
        # The holder's deadline as its node has it (the leader's mtime + the TTL).
        deadline = holding._store._leases[("k", lease.token)].deadline_ms / 1000  # type: ignore[attr-defined]
        # The waiter's estimate of the leader's clock runs 0.5 s ahead (it is only an
        # estimate; the write below learns the leader's time): the holder's node looks
        # expired to it 0.4 s before it is, and the holder renews in that time.
        store._offset_ms += 500
        time.sleep(max(0.0, deadline - time.time() - 0.4))
        try:
            seen = try_acquire()
            assert renewed, "the waiter never looked at the holder's deadline"
            assert seen is not None, "the waiter took the key from a holder that renewed"
            assert seen.fence == lease.fence
            current = waiting.holder("k")
            assert current is not None
            assert current.fence == lease.fence
            lease.renew(ttl=30)  # still ours
        finally:
            store._set = real_set
            waiter.close()
            lease.release()

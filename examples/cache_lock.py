"""Story 4, the lock on a cache server: first hand-rolled, then with keymutex.

The hand-rolled version is what many codebases have: ``SET key 1 NX`` marks the
resource taken, a waiter sleeps 100 ms and retries, the holder deletes the key when
done. This script shows its three holes on a real Redis, then the same work with
keymutex:

1. A crashed holder blocks everyone forever (no TTL). keymutex: the lease expires.
2. With a TTL bolted on, a slow holder's ``DEL`` removes the *next* holder's lock, and
   a third worker walks in while the second is still inside. keymutex: the slow
   holder's release raises ``LockLost`` and the second holder's lock stays.
3. Waiting by polling costs a command every 100 ms per waiter, and a waiter notices a
   release up to 100 ms late. keymutex: the release wakes the waiter.

And who holds it? keymutex keeps the host and pid in the holder's info. And in which
order are waiters served? Polling serves whoever asks first after a release;
keymutex on Redis hands the key to the waiters in the order they arrived (a fair
queue: requests for one resource processed strictly in arrival order).

    python examples/cache_lock.py [REDIS_URL]    # default: $KEYMUTEX_STORE or redis://127.0.0.1:6379/0

It needs a Redis server and the Redis extra: ``pip install 'keymutex[redis]'``.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING

import keymutex

if TYPE_CHECKING:
    import redis  # imported by main(), once the URL is known to be a Redis one

POLL = 0.1  # the hand-rolled waiter's sleep between tries


def calls(client: redis.Redis, *names: str) -> int:
    """How many times clients sent these commands (INFO commandstats).

    Redis also counts the commands a script runs inside the server, so each side is
    measured by the commands it sends itself: SET for the hand-rolled lock, the
    script calls and (un)subscriptions for keymutex.
    """
    stats = client.info("commandstats")
    return sum(
        int(stats[f"cmdstat_{name}"]["calls"]) for name in names if f"cmdstat_{name}" in stats
    )


KEYMUTEX_CALLS = ("evalsha", "script|load", "subscribe", "unsubscribe")


def main() -> int:
    url = (
        sys.argv[1]
        if len(sys.argv) > 1
        else os.environ.get("KEYMUTEX_STORE", "redis://127.0.0.1:6379/0")
    )
    if not url.lower().startswith(("redis://", "rediss://", "unix://")):
        sys.exit(
            f"error: {url!r}: this example compares with a lock hand-rolled on Redis"
            " and needs a Redis URL (redis://, rediss:// or unix:///path/redis.sock)"
        )
    # After the URL's check: found by a new user's walk-through, a SQLite URL without
    # the Redis extra was told to install it, before being told it cannot be used.
    try:
        import redis
    except ImportError:  # one line, not a traceback (found by review)
        sys.exit(
            "error: this example needs the Redis client library: pip install 'keymutex[redis]'"
        )
    r = redis.Redis.from_url(url, decode_responses=True)
    try:
        r.ping()
    except redis.RedisError as exc:
        sys.exit(
            f"error: Redis at {url} cannot be used: {str(exc).rstrip('.')}; give another Redis URL"
        )
    run = uuid.uuid4().hex[:8]
    info = {"host": socket.gethostname(), "pid": os.getpid()}

    print("1. a crashed holder")
    key = f"cache-lock:{run}:report"
    try:
        r.set(key, "1", nx=True)  # the holder takes the lock ... and its process dies here
        time.sleep(0.3)
        print(
            f"   hand-rolled: still locked after the holder died: {r.exists(key) == 1}"
            " (and it stays so until someone deletes it by hand)"
        )
    finally:  # this example deletes it by hand, also when interrupted
        r.delete(key)
    with keymutex.Locks(url, namespace=f"cache-{run}") as locks:
        locks.acquire("report", ttl=0.2, info=info)  # never released: the holder "dies"
        time.sleep(0.3)
        print(f"   keymutex: free again after the 0.2 s TTL: {locks.holder('report') is None}")

    print("2. a slow holder deletes the next holder's lock")
    key = f"cache-lock:{run}:invoice"
    inside: list[str] = []
    overlaps = 0
    r.set(key, "A", nx=True, px=200)  # A takes it with a TTL, then is paused for 300 ms
    time.sleep(0.3)
    r.set(key, "B", nx=True, px=200)  # the lock expired: B takes it and works
    inside.append("B")
    r.delete(key)  # A wakes up, finishes, and deletes "its" lock: B's
    if r.set(key, "C", nx=True, px=200):  # C walks in while B is still inside
        inside.append("C")
        overlaps += 1
    print(f"   hand-rolled: workers inside at once: {inside} ({overlaps} overlap)")
    r.delete(key)
    with keymutex.Locks(url, namespace=f"cache-{run}") as locks:
        a = locks.acquire("invoice", ttl=0.2)
        time.sleep(0.3)  # A is paused past its TTL
        b = locks.acquire("invoice", timeout=0)
        try:
            a.release()
            print("   keymutex: A's late release went through (unexpected)")
        except keymutex.LockLost:
            print("   keymutex: A's late release raised LockLost")
        try:
            locks.acquire("invoice", timeout=0)
            print("   keymutex: C got in while B held the lock (unexpected)")
        except keymutex.Locked as refused:
            holder = refused.holder
            print(
                f"   keymutex: C refused, B still holds it: {holder is not None and holder.fence == b.fence}"
                f"; fences A {a.fence} < B {b.fence}"
            )
        b.release()

    print("3. waiting: polling against notification")
    hold = 1.0
    key = f"cache-lock:{run}:sync"
    release = threading.Timer(hold, r.delete, args=(key,))
    try:
        r.set(key, "holder", nx=True)
        release.start()
        before = calls(r, "set")
        started = time.monotonic()
        while not r.set(key, "waiter", nx=True):
            time.sleep(POLL)
        released_to_acquired = time.monotonic() - started - hold
        polled = calls(r, "set") - before
    finally:  # no TTL: deleted also when interrupted
        release.cancel()
        r.delete(key)
    print(
        f"   hand-rolled: {polled} commands while waiting {hold:.0f} s;"
        f" got it {released_to_acquired * 1000:.1f} ms after the release"
    )
    with (
        keymutex.Locks(url, namespace=f"cache-{run}") as holder_locks,
        keymutex.Locks(url, namespace=f"cache-{run}") as waiter_locks,
    ):
        lease = holder_locks.acquire("sync", info=info)
        release_at: list[float] = []

        def release_later() -> None:
            time.sleep(hold)
            release_at.append(time.monotonic())
            lease.release()

        releaser = threading.Thread(target=release_later)
        releaser.start()
        try:
            before = calls(r, *KEYMUTEX_CALLS)
            with waiter_locks.lock("sync", timeout=10):
                acquired_at = time.monotonic()
                waited_commands = calls(r, *KEYMUTEX_CALLS) - before
        finally:  # the holder has its release's answer before its client closes
            releaser.join()
        print(
            f"   keymutex: {waited_commands} commands while waiting {hold:.0f} s"
            f" (including the holder's release); got it"
            f" {(acquired_at - release_at[0]) * 1000:.1f} ms after the release"
        )

    print("4. who holds it?")
    with (
        keymutex.Locks(url, namespace=f"cache-{run}") as locks,
        locks.lock("report", info=info),
    ):
        holder = locks.holder("report")
        assert holder is not None
        print(
            f"   keymutex: held by {holder.owner} with info {holder.info},"
            f" fence {holder.fence}, expires in {holder.expires_at - time.time():.0f} s"
        )

    print("5. in which order are waiters served?")
    print(f"   hand-rolled: {hand_rolled_order(r, f'cache-lock:{run}:queue')}")
    print(f"   keymutex: {keymutex_order(url, f'cache-{run}')}")
    r.close()
    return 0


WAITERS = 5
ARRIVING = 0.05  # seconds between two waiters' arrivals
SERVING = 0.02  # how long each holds the resource


def hand_rolled_order(r: redis.Redis, key: str) -> str:
    """Five waiters arrive 50 ms apart while the resource is held, and poll."""
    served: list[int] = []

    def waiter(number: int) -> None:
        while not r.set(key, str(number), nx=True):
            time.sleep(POLL)
        served.append(number)
        time.sleep(SERVING)
        r.delete(key)

    r.set(key, "first", nx=True)
    threads = [threading.Thread(target=waiter, args=(n,)) for n in range(WAITERS)]
    try:
        for thread in threads:
            thread.start()
            time.sleep(ARRIVING)
        r.delete(key)  # the first holder is done
    finally:
        for thread in threads:
            thread.join()
        r.delete(key)
    return f"served in the order {served} (whoever polled first after each release)"


def keymutex_order(url: str, namespace: str) -> str:
    """The same five waiters, each with a client of its own, waiting with keymutex."""
    served: list[int] = []
    with keymutex.Locks(url, namespace=namespace) as first:
        lease = first.acquire("queue")
        clients = [keymutex.Locks(url, namespace=namespace) for _ in range(WAITERS)]

        def waiter(number: int) -> None:
            with clients[number].lock("queue", timeout=30):
                served.append(number)
                time.sleep(SERVING)

        threads = [threading.Thread(target=waiter, args=(n,)) for n in range(WAITERS)]
        try:
            for thread in threads:
                thread.start()
                time.sleep(ARRIVING)
            lease.release()
        finally:
            for thread in threads:
                thread.join()
            for client in clients:
                client.close()
    return f"served in the order {served}: the order they arrived in"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(
            "interrupted: the hand-rolled locks without a TTL were deleted; any other lock"
            " left held expires after its TTL",
            file=sys.stderr,
        )
        sys.exit(130)

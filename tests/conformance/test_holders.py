"""``holder(key)`` and ``holders(prefix)``: who holds what, right now, in this namespace."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import keymutex

from ._support import PATIENCE, assert_is_holder_of, assert_no_token, await_until, wait_until

SHORT_TTL = 0.3

# Keys chosen to trip prefix matching done with SQL LIKE / GLOB or regexes: "_" and "%"
# are LIKE wildcards, "*" "?" "[" are GLOB ones, LIKE ignores ASCII case by default.
KEYS = ["a:1", "a:2", "a_3", "ab", "A:4", "%x", "*y", "[z]", "b:1", "a", "Zoë/1", "🔒a"]
EXPECTED = {
    "a": {"a:1", "a:2", "a_3", "ab", "a"},
    "a:": {"a:1", "a:2"},
    "a_": {"a_3"},
    "A": {"A:4"},
    "%": {"%x"},
    "*": {"*y"},
    "[": {"[z]"},
    "[z": {"[z]"},
    "a:1": {"a:1"},
    "a:10": set(),
    "c": set(),
    "Zoë": {"Zoë/1"},
    "Zo": {"Zoë/1"},
    "🔒": {"🔒a"},
    "": set(KEYS),
}


def test_holder_of_a_free_key_is_none(locks: keymutex.Locks) -> None:
    assert locks.holder("nobody:has:this") is None


@pytest.mark.asyncio
async def test_holder_of_a_free_key_is_none_async(alocks: keymutex.AsyncLocks) -> None:
    assert await alocks.holder("nobody:has:this") is None


def test_holder_describes_the_lease(make_locks: Callable[..., keymutex.Locks]) -> None:
    lease = make_locks(owner="alice").acquire("doc", ttl=30, info={"n": 1})
    seen = make_locks().holder("doc")
    assert_is_holder_of(seen, lease)
    assert seen is not None
    assert abs(seen.expires_at - lease.expires_at) < 1.0
    assert time.time() + 20 < seen.expires_at <= time.time() + 31
    lease.release()
    assert make_locks().holder("doc") is None


def test_two_reads_of_one_lease_are_equal_holders_and_another_grant_is_not(
    make_locks: Callable[..., keymutex.Locks],
) -> None:
    """Each read works ``expires_at`` out from the time left then: two reads of the same
    lease differed by microseconds, so ``locks.holder(k) == refused.holder`` ("is it
    still the one that refused me?") was almost always False."""
    lease = make_locks(owner="alice").acquire("doc", ttl=30, info={"n": 1})
    with pytest.raises(keymutex.Locked) as refused:
        make_locks().acquire("doc", timeout=0)
    first = make_locks().holder("doc")
    time.sleep(0.05)
    lease.renew()
    assert make_locks().holder("doc") == first == refused.value.holder
    assert hash(make_locks().holder("doc")) == hash(first)
    lease.release()
    again = make_locks(owner="alice").acquire("doc", ttl=30, info={"n": 1})
    assert make_locks().holder("doc") != first  # a new grant: a new fence
    again.release()


def test_holders_lists_exactly_the_live_leases_under_a_prefix(
    make_locks: Callable[..., keymutex.Locks], other_namespace: str
) -> None:
    locks = make_locks()
    leases = {key: locks.acquire(key, info={"key": key}) for key in KEYS}
    # Noise that must never show: another namespace, a released lease.
    neighbour = make_locks(namespace=other_namespace)
    noise = [neighbour.acquire(key) for key in ("a:1", "a:9", "zzz")]
    locks.acquire("a:released").release()

    for prefix, expected in EXPECTED.items():
        found = list(make_locks().holders(prefix))
        assert sorted(holder.key for holder in found) == sorted(expected), prefix
        for holder in found:
            assert_is_holder_of(holder, leases[holder.key])
            assert_no_token(holder, leases[holder.key].token)

    assert sorted(h.key for h in neighbour.holders()) == ["a:1", "a:9", "zzz"]
    for lease in [*leases.values(), *noise]:
        lease.release()
    assert list(locks.holders()) == []


@pytest.mark.asyncio
async def test_holders_lists_exactly_the_live_leases_under_a_prefix_async(
    make_alocks: Callable[..., keymutex.AsyncLocks], other_namespace: str
) -> None:
    alocks = make_alocks()
    leases = {key: await alocks.acquire(key, info={"key": key}) for key in KEYS}
    neighbour = make_alocks(namespace=other_namespace)
    noise = [await neighbour.acquire(key) for key in ("a:1", "a:9", "zzz")]
    await (await alocks.acquire("a:released")).release()

    for prefix, expected in EXPECTED.items():
        found = list(await make_alocks().holders(prefix))
        assert sorted(holder.key for holder in found) == sorted(expected), prefix
        for holder in found:
            assert_is_holder_of(holder, leases[holder.key])

    assert sorted(h.key for h in await neighbour.holders()) == ["a:1", "a:9", "zzz"]
    for lease in [*leases.values(), *noise]:
        await lease.release()
    assert list(await alocks.holders()) == []


def test_holders_default_prefix_is_everything(locks: keymutex.Locks) -> None:
    leases = [locks.acquire(key) for key in ("x", "y:1")]
    assert sorted(h.key for h in locks.holders()) == ["x", "y:1"]
    for lease in leases:
        lease.release()


def test_expired_leases_are_not_listed(locks: keymutex.Locks) -> None:
    live = locks.acquire("job:live")
    expiring = locks.acquire("job:expiring", ttl=SHORT_TTL)

    def listed() -> set[str]:
        return {holder.key for holder in locks.holders("job:")}

    first = listed()
    # Listed while it lives. A loaded machine may take longer than its TTL to list
    # (a CI run on Redis Sentinel did): then it was rightly left out, and its holder's
    # own deadline, which comes before the store's, has passed too.
    assert first == {"job:live", "job:expiring"} or (
        first == {"job:live"} and expiring.remaining == 0
    ), first
    # Nobody touches the expired key in between: the listing itself must leave it out.
    wait_until(lambda: listed() == {"job:live"}, "the expired lease leaves holders()")
    assert locks.holder("job:expiring") is None
    assert expiring.lost is True
    assert_is_holder_of(locks.holder("job:live"), live)
    live.release()


@pytest.mark.asyncio
async def test_expired_leases_are_not_listed_async(alocks: keymutex.AsyncLocks) -> None:
    live = await alocks.acquire("job:live")
    expiring = await alocks.acquire("job:expiring", ttl=SHORT_TTL)

    async def listed() -> set[str]:
        return {holder.key for holder in await alocks.holders("job:")}

    first = await listed()
    # As in the sync test: listed while it lives.
    assert first == {"job:live", "job:expiring"} or (
        first == {"job:live"} and expiring.remaining == 0
    ), first

    async def only_live() -> bool:
        return await listed() == {"job:live"}

    await await_until(only_live, "the expired lease leaves holders()")
    assert await alocks.holder("job:expiring") is None
    assert expiring.lost is True
    await live.release()


def test_expired_lease_has_no_holder(locks: keymutex.Locks) -> None:
    lease = locks.acquire("job", ttl=SHORT_TTL)
    # Held while it lives (a loaded machine may read it after its TTL: see above).
    assert locks.holder("job") is not None or lease.remaining == 0
    wait_until(lambda: locks.holder("job") is None, "the expired lease has no holder")
    assert lease.lost is True


def test_holder_is_frozen(locks: keymutex.Locks) -> None:
    lease = locks.acquire("doc")
    seen = locks.holder("doc")
    assert seen is not None
    with pytest.raises(AttributeError):
        seen.owner = "mallory"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        seen.token = lease.token  # type: ignore[attr-defined]
    lease.release()


def test_namespaces_isolate_keys(
    make_locks: Callable[..., keymutex.Locks], other_namespace: str
) -> None:
    here = make_locks()
    there = make_locks(namespace=other_namespace)
    mine = here.acquire("user:42", timeout=0)
    theirs = there.acquire("user:42", timeout=0)  # same key, other namespace: free
    assert mine.key == theirs.key == "user:42"
    assert_is_holder_of(here.holder("user:42"), mine)
    assert_is_holder_of(there.holder("user:42"), theirs)
    # A token only works in its own namespace.
    with pytest.raises(keymutex.LockLost):
        there.release("user:42", mine.token)
    mine.release()
    assert_is_holder_of(there.holder("user:42"), theirs)
    theirs.release()


@pytest.mark.asyncio
async def test_namespaces_isolate_keys_async(
    make_alocks: Callable[..., keymutex.AsyncLocks], other_namespace: str
) -> None:
    here = make_alocks()
    there = make_alocks(namespace=other_namespace)
    mine = await here.acquire("user:42", timeout=0)
    theirs = await there.acquire("user:42", timeout=0)
    assert_is_holder_of(await here.holder("user:42"), mine)
    assert_is_holder_of(await there.holder("user:42"), theirs)
    with pytest.raises(keymutex.LockLost):
        await there.release("user:42", mine.token)
    await mine.release()
    assert_is_holder_of(await there.holder("user:42"), theirs)
    await theirs.release()


def test_namespace_that_prefixes_another_stays_separate(
    make_locks: Callable[..., keymutex.Locks], namespace: str
) -> None:
    # "shop" + "a:b" must not collide with "shop:a" + "b", whatever the store's joining.
    outer = make_locks(namespace=namespace)
    inner = make_locks(namespace=f"{namespace}:a")
    one = outer.acquire("a:b", timeout=0)
    two = inner.acquire("b", timeout=0)
    assert [h.key for h in outer.holders()] == ["a:b"]
    assert [h.key for h in inner.holders()] == ["b"]
    one.release()
    two.release()


def test_default_namespace_works(store_url: str) -> None:
    with keymutex.Locks(store_url) as locks:
        key = f"default-namespace-{time.monotonic_ns()}"
        lease = locks.acquire(key, timeout=PATIENCE)
        assert_is_holder_of(locks.holder(key), lease)
        assert key in {holder.key for holder in locks.holders(key)}
        lease.release()
        assert locks.holder(key) is None

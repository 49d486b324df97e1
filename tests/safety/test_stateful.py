"""Stateful tests: ``Locks`` and ``AsyncLocks`` against a reference model, on a fake clock.

Hypothesis drives three clients (owners alice, bob, carol) of one store (``memory://``,
``sqlite:///…``) through random sequences of steps, and checks each reply against the
model of ``_tools/model.py``:

- acquire (``timeout=0``; a ttl or the client's default; info) and steal, by any client;
- renew and release through a ``Lease`` (any lease ever granted: most are stale, some
  released, some taken over), and through a lease whose token holds its key;
- stateless ``locks.renew(key, token)`` / ``locks.release(key, token)`` by any client:
  with a lease's token, a token never issued, or a good token on the wrong key; and
  heartbeats (stateless renewals of a live grant), after which the ``Lease`` object
  itself is used around its own deadline (the edit-session story of API.md);
- ``holders(prefix)``; moving the clock: by steps, and to just before, exactly at, or
  just after a grant's expiry or a ``Lease`` object's own deadline;
- ``AsyncLocks`` only: an ``acquire(key, timeout=…)`` task waits for a held key and is
  cancelled (after 0 to 20 turns of the event loop, or once parked); a task waits while
  the holder releases, and is served, or is cancelled soon after. Afterwards the key
  is never stuck: it is held by whom the model says, or free.

After every step: ``holder(key)`` of every key and ``holders()`` show exactly the
model's live grants (so at most one holder per key). At every grant (acquire,
re-acquire after expiry, steal, hand-over to a waiter) the fence must beat every fence
seen before on that key. Refusals must be ``Locked`` naming the model's holder, failed
renewals and releases ``LockLost`` naming it (when the call asked the store), and
successes must be ones the model allows; every ``Lease``'s ``lost`` and ``remaining``
must be what the model says.

Time: every decision in keymutex reads ``keymutex._clock.monotonic()`` at call time,
which the test replaces with a clock that moves only when a rule moves it. It moves in
quarter seconds from 1000.0 and TTLs are whole or half seconds, so float sums are exact
and "at the expiry" is exactly at it. Nothing may wait on real time with this clock:
leases are taken with ``renew=False`` (no renewer) and acquires with ``timeout=0``. The
waiting acquires of the async rules never reach their (fake) timeout: they park on the
store's wake-ups (real time, at most the 1 s recheck) and are bounded in real time by
``asyncio.wait_for``.

The tests at the end check the edit-session story of API.md directly: a ``Lease``
kept alive by heartbeats through the client that granted it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import string
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

import keymutex
from keymutex import _clock

from ._tools.model import UNCHECKED, Expect, Grant, LeaseView, Model

KEYS = ("a", "ab", "b")
PREFIXES = ("", "a", "ab", "b", "c")
OWNERS = ("alice", "bob", "carol")
DEFAULT_TTL = 3.0  # the clients' own ``ttl``: what ``ttl=None`` means
TTLS = (None, 1.0, 2.0, 4.5)
CLOCK_STEPS = (0.25, 0.5, 1.0, 2.0, 5.0)
# Where the clock goes relative to an expiry or deadline: just before, exactly at, after.
EXPIRY_OFFSETS = (-0.25, 0.0, 0.25)
# A well-formed token that keymutex never issues (it issues 24 random characters).
NEVER_ISSUED = "never-issued-token"
# How a stateless renew or release is aimed: the lease's own key and token, a token
# nobody holds, or the lease's token on another key.
AIMS = ("own", "unknown-token", "other-key")
# When a waiting acquire is cancelled: after this many turns of the event loop, or
# ("parked") after 10 ms of real time, by when it is normally parked on a wake-up.
CANCEL_POINTS: tuple[int | str, ...] = (0, 1, 2, 5, 20, "parked")
WAIT_TIMEOUT = 60.0  # fake seconds: the fake clock never gets there during a wait
TOKEN_ALPHABET = frozenset(string.ascii_letters + string.digits + "-_")
# Every lease any rule got back: later rules renew and release them, stale or not.
LEASES: Bundle[Any] = Bundle("leases")

SETTINGS = settings(
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    # The SQLite machines take a few ms per step: that is what they test, not a problem.
    suppress_health_check=[HealthCheck.too_slow],
    # One bug shows as several failures (a waiter stuck, a free key refused, ...), and
    # the async steps wait in real time: shrink one of them only, to report in seconds.
    report_multiple_bugs=False,
)


class FakeClock:
    """The monotonic clock keymutex reads, moved only by the test. Never goes back."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance_to(self, when: float) -> None:
        self.now = max(self.now, when)


class Patience:
    """Real seconds a waiter may take to be served, or a cancelled grant to be given back.

    Normally a wake-up comes in milliseconds, and at worst after the 1 s recheck. Once a
    wait has run out in a test, the next ones are short: Hypothesis replays the failing
    steps hundreds of times while it shrinks them, and should report in seconds.
    """

    def __init__(self) -> None:
        self.seconds = 3.0

    def ran_out(self) -> None:
        self.seconds = 0.2


@dataclass(eq=False)
class Tracked:
    """A lease the machine got back, and what the model expects of it."""

    lease: Any  # keymutex.Lease or keymutex.AsyncLease
    view: LeaseView

    def __repr__(self) -> str:
        view = self.view
        return f"<lease {view.key!r} fence {view.fence} of {view.owner}>"


def seen(holder: keymutex.Holder | None) -> tuple[object, ...] | None:
    return None if holder is None else (holder.key, holder.owner, holder.fence, holder.info)


def expected(grant: Grant | None) -> tuple[object, ...] | None:
    return None if grant is None else (grant.key, grant.owner, grant.fence, grant.info)


class LocksMachine(RuleBasedStateMachine):
    """The rules and checks both twins share; ``do`` runs one call of the twin."""

    def __init__(self, clock: FakeClock, url: str) -> None:
        super().__init__()
        self.clock = clock
        self.model = Model(clock)
        self.tracked: list[Tracked] = []
        self.serial = itertools.count(1)
        # Each example works in a namespace of its own: the store outlives it.
        self.namespace = f"stateful-{uuid.uuid4().hex[:12]}"
        self.clients = self.open_clients(url)

    def open_clients(self, url: str) -> list[Any]:
        raise NotImplementedError

    def do(self, call: Any) -> Any:
        """The result of a call to the twin (for the async one, a coroutine to run)."""
        raise NotImplementedError

    # -- acquiring -------------------------------------------------------------------

    @rule(
        target=LEASES,
        client=st.sampled_from(range(len(OWNERS))),
        key=st.sampled_from(KEYS),
        ttl=st.sampled_from(TTLS),
    )
    def acquire(self, client: int, key: str, ttl: float | None) -> Any:
        return self._acquire(client, key, ttl, steal=False)

    @rule(
        target=LEASES,
        client=st.sampled_from(range(len(OWNERS))),
        key=st.sampled_from(KEYS),
        ttl=st.sampled_from(TTLS),
    )
    def steal(self, client: int, key: str, ttl: float | None) -> Any:
        return self._acquire(client, key, ttl, steal=True)

    def _acquire(self, client: int, key: str, ttl: float | None, *, steal: bool) -> Any:
        info = {"grant": next(self.serial)}
        current = self.model.live(key)
        locks = self.clients[client]
        try:
            lease = self.do(locks.acquire(key, ttl=ttl, timeout=0, info=info, steal=steal))
        except keymutex.Locked as exc:
            self._check_refused(exc, key, f"acquire({key!r}) by {OWNERS[client]}", steal=steal)
            return multiple()
        assert current is None or steal, (
            f"acquire({key!r}) by {OWNERS[client]} was granted fence {lease.fence}, but"
            f" {current.owner} holds it ({self.model.describe()})"
        )
        return self._track(lease, key, client, ttl, info)

    def _check_refused(
        self, refused: keymutex.Locked, key: str, what: str, *, steal: bool
    ) -> None:
        assert refused.key == key
        current = self.model.live(key)
        assert current is not None, (
            f"{what} was refused ({refused}), but the model says it is free to take"
            f" ({self.model.describe()})"
        )
        assert not steal, f"{what} with steal=True was refused: {refused}"
        assert seen(refused.holder) == expected(current), "Locked.holder is not the holder"

    def _track(
        self, lease: Any, key: str, client: int, ttl: float | None, info: Any, *, keep: bool = True
    ) -> Tracked:
        """Check a grant to ``client`` and record it in the model (and, if ``keep``, for
        the checks)."""
        owner, token = OWNERS[client], lease.token
        assert isinstance(token, str)
        assert len(token) >= 22, f"token {token!r} has less than 128 bits"
        assert TOKEN_ALPHABET.issuperset(token), f"token {token!r} is not URL-safe"
        assert (lease.key, lease.owner, lease.info) == (key, owner, info)
        view = self.model.grant(
            key,
            token=token,
            owner=owner,
            fence=lease.fence,
            info=info,
            ttl=DEFAULT_TTL if ttl is None else ttl,
            client=client,
        )
        tracked = Tracked(lease, view)
        if keep:
            self.tracked.append(tracked)
        return tracked

    # -- renewing and releasing through a Lease ---------------------------------------

    @rule(tracked=LEASES, ttl=st.sampled_from(TTLS))
    def renew_lease(self, tracked: Tracked, ttl: float | None) -> None:
        self._renew_lease(tracked, ttl)

    @rule(tracked=LEASES)
    def release_lease(self, tracked: Tracked) -> None:
        self._release_lease(tracked)

    def _holding(self) -> list[Tracked]:
        """Lease objects whose token holds its key (some may be past their own deadline)."""
        return [
            t
            for t in self.tracked
            if not (t.view.released or t.view.lost)
            and (grant := self.model.live(t.view.key)) is not None
            and grant.token == t.view.token
        ]

    @precondition(lambda self: self._holding())
    @rule(data=st.data(), ttl=st.sampled_from(TTLS), release=st.booleans())
    def use_a_held_lease(self, data: st.DataObject, ttl: float | None, release: bool) -> None:
        """What owners do most: renew or release a lease that holds its key.

        (Most leases the bundle offers are long gone; this keeps the live ones busy.)
        """
        tracked = data.draw(st.sampled_from(self._holding()), label="lease")
        if release:
            self._release_lease(tracked)
        else:
            self._renew_lease(tracked, ttl)

    def _renew_lease(self, tracked: Tracked, ttl: float | None) -> None:
        expect = self.model.lease_renew(tracked.view, ttl)
        call = functools.partial(tracked.lease.renew, ttl)
        self._expect(expect, f"{tracked}.renew(ttl={ttl})", tracked.view.key, call)

    def _release_lease(self, tracked: Tracked) -> None:
        expect = self.model.lease_release(tracked.view)
        self._expect(expect, f"{tracked}.release()", tracked.view.key, tracked.lease.release)

    # -- stateless renew and release, from any client --------------------------------

    def _aim(self, tracked: Tracked, aim: str) -> tuple[str, str]:
        key, token = tracked.view.key, tracked.view.token
        if aim == "unknown-token":
            return key, NEVER_ISSUED
        if aim == "other-key":
            return KEYS[(KEYS.index(key) + 1) % len(KEYS)], token
        return key, token

    @rule(
        target=LEASES,
        client=st.sampled_from(range(len(OWNERS))),
        tracked=LEASES,
        aim=st.sampled_from(AIMS),
        ttl=st.sampled_from(TTLS),
    )
    def renew_by_token(self, client: int, tracked: Tracked, aim: str, ttl: float | None) -> Any:
        key, token = self._aim(tracked, aim)
        what = f"locks.renew({key!r}, <token of {tracked}> ({aim}), ttl={ttl})"
        return self._renew_by_token(client, key, token, ttl, what)

    @precondition(lambda self: self.model.live_keys())
    @rule(
        target=LEASES,
        data=st.data(),
        client=st.sampled_from(range(len(OWNERS))),
        ttl=st.sampled_from(TTLS),
    )
    def heartbeat(self, data: st.DataObject, client: int, ttl: float | None) -> Any:
        """A web handler renews a live lease by key and token (any client, no Lease)."""
        key = data.draw(st.sampled_from(self.model.live_keys()), label="key")
        grant = self.model.live(key)
        assert grant is not None
        what = f"heartbeat locks.renew({key!r}, <token of fence {grant.fence}>, ttl={ttl})"
        return self._renew_by_token(client, key, grant.token, ttl, what)

    @precondition(lambda self: self._holding())
    @rule(
        data=st.data(),
        client=st.sampled_from(range(len(OWNERS))),
        ttl=st.sampled_from(TTLS),
        late=st.sampled_from(EXPIRY_OFFSETS),
        release=st.booleans(),
    )
    def lease_used_after_heartbeat(
        self, data: st.DataObject, client: int, ttl: float | None, late: float, release: bool
    ) -> None:
        """The edit-session story: a heartbeat renews by token, then the Lease is used.

        The heartbeat moves the grant's expiry; the Lease object still counts from its
        own last grant or renewal. The clock goes to around the object's deadline.
        """
        tracked = data.draw(st.sampled_from(self._holding()), label="lease")
        view = tracked.view
        self._renew_by_token(client, view.key, view.token, ttl, f"heartbeat for {tracked}")
        self.clock.advance_to(view.deadline + late)
        if release:
            self._release_lease(tracked)
        else:
            self._renew_lease(tracked, ttl)

    def _renew_by_token(
        self, client: int, key: str, token: str, ttl: float | None, what: str
    ) -> Any:
        ttl_asked = DEFAULT_TTL if ttl is None else ttl
        grant = self.model.renew_token(key, token, ttl_asked, client=client)
        what = f"{OWNERS[client]}: {what}"
        call = functools.partial(self.clients[client].renew, key, token, ttl=ttl)
        if grant is None:
            self._expect(Expect(False, self.model.live(key)), what, key, call)
            return multiple()
        lease = self._expect(Expect(True), what, key, call)
        for known in self.tracked:
            if known.lease is lease:  # the client's own live lease, which it answers
                assert known.view.client == client
                assert known.view.deadline == grant.expires  # extended by the model too
                return known
        # The lease keeps its owner and fence: renewing from elsewhere changes neither.
        assert (lease.key, lease.fence, lease.owner, lease.info) == (
            key,
            grant.fence,
            grant.owner,
            grant.info,
        )
        view = LeaseView(
            key, token, grant.owner, grant.fence, grant.info, ttl_asked, grant.expires, None
        )
        tracked = Tracked(lease, view)
        self.tracked.append(tracked)
        return tracked

    @rule(
        client=st.sampled_from(range(len(OWNERS))),
        tracked=LEASES,
        aim=st.sampled_from(AIMS),
    )
    def release_by_token(self, client: int, tracked: Tracked, aim: str) -> None:
        key, token = self._aim(tracked, aim)
        ok = self.model.release_token(key, token)
        what = f"{OWNERS[client]}: locks.release({key!r}, <token of {tracked}> ({aim}))"
        expect = Expect(True) if ok else Expect(False, self.model.live(key))
        self._expect(
            expect, what, key, functools.partial(self.clients[client].release, key, token)
        )
        if ok:
            self._released_by_token(client, key, token)

    def _released_by_token(self, client: int, key: str, token: str) -> None:
        """A release by token from the client that granted the lease: its ``Lease``
        object is released (not lost), as if its own ``release()`` had been called."""
        for tracked in self.tracked:
            view = tracked.view
            mine = (view.client, view.key, view.token) == (client, key, token)
            if mine and not (view.released or self.model.lost(view)):  # lost: past deadline
                view.released = True

    def _expect(self, expect: Expect, what: str, key: str, call: Callable[[], Any]) -> Any:
        """Call ``call``; it must succeed, or raise ``LockLost``, as ``expect`` says."""
        try:
            result = self.do(call())
        except keymutex.LockLost as exc:
            self._check_lost(exc, expect, what, key)
            return None
        assert expect.ok, f"{what} succeeded; the model says LockLost ({self.model.describe()})"
        return result

    def _check_lost(self, lost: keymutex.LockLost, expect: Expect, what: str, key: str) -> None:
        assert not expect.ok, f"{what} raised {lost!r}; the model says it works"
        assert lost.key == key
        if expect.holder is not UNCHECKED:
            assert seen(lost.holder) == expected(expect.holder), (
                f"{what}: LockLost.holder is {lost.holder}, the model's is {expect.holder}"
            )

    # -- looking ---------------------------------------------------------------------

    @rule(client=st.sampled_from(range(len(OWNERS))), prefix=st.sampled_from(PREFIXES))
    def holders_by_prefix(self, client: int, prefix: str) -> None:
        found = [seen(h) for h in self.do(self.clients[client].holders(prefix))]
        assert found == [expected(g) for g in self.model.holders(prefix)], (
            f"holders({prefix!r}) {self.model.describe()}"
        )

    # -- time ------------------------------------------------------------------------

    @rule(step=st.sampled_from(CLOCK_STEPS))
    def advance(self, step: float) -> None:
        self.clock.advance_to(self.clock.now + step)

    def _moments(self) -> list[float]:
        """When a live grant expires, or a lease object's own deadline passes."""
        now = self.clock.now
        moments = {grant.expires for grant in self.model.holders("")}
        moments.update(t.view.deadline for t in self.tracked if t.view.deadline > now)
        return sorted(moments)

    @precondition(lambda self: self._moments())
    @rule(data=st.data(), offset=st.sampled_from(EXPIRY_OFFSETS))
    def advance_to_expiry(self, data: st.DataObject, offset: float) -> None:
        # A lease object's deadline differs from its grant's expiry once the token was
        # renewed through another object (stateless renew): both edges are worth a visit.
        when = data.draw(st.sampled_from(self._moments()), label="expiry or deadline")
        self.clock.advance_to(when + offset)

    # -- after every step ------------------------------------------------------------

    @invariant()
    def store_shows_the_model_holders(self) -> None:
        for i, key in enumerate(KEYS):
            holder = self.do(self.clients[i % len(self.clients)].holder(key))
            assert seen(holder) == expected(self.model.live(key)), (
                f"holder({key!r}) is {holder}; model {self.model.describe()}"
            )
        found = [seen(h) for h in self.do(self.clients[0].holders(""))]
        assert found == [expected(g) for g in self.model.holders("")]

    @invariant()
    def leases_know_what_the_model_knows(self) -> None:
        for tracked in self.tracked:
            lease, view = tracked.lease, tracked.view
            assert lease.lost == self.model.lost(view), f"{tracked}.lost at {self.clock.now}"
            assert lease.remaining == pytest.approx(self.model.remaining(view), abs=1e-9)
            assert (lease.key, lease.token, lease.fence) == (view.key, view.token, view.fence)


class SyncMachine(LocksMachine):
    def open_clients(self, url: str) -> list[Any]:
        return [
            keymutex.Locks(url, namespace=self.namespace, ttl=DEFAULT_TTL, owner=owner)
            for owner in OWNERS
        ]

    def do(self, call: Any) -> Any:
        return call

    def teardown(self) -> None:
        for client in self.clients:
            client.close()


class AsyncMachine(LocksMachine):
    """The async twin, plus acquires that wait and are cancelled or served."""

    def __init__(self, clock: FakeClock, url: str, patience: Patience) -> None:
        self.runner = asyncio.Runner()
        self.patience = patience
        super().__init__(clock, url)

    def open_clients(self, url: str) -> list[Any]:
        async def open_all() -> list[keymutex.AsyncLocks]:
            return [
                keymutex.AsyncLocks(url, namespace=self.namespace, ttl=DEFAULT_TTL, owner=owner)
                for owner in OWNERS
            ]

        return self.runner.run(open_all())

    def do(self, call: Any) -> Any:
        return self.runner.run(call)

    def teardown(self) -> None:
        try:
            for client in getattr(self, "clients", ()):
                self.runner.run(client.aclose())
        finally:
            self.runner.close()

    # -- waiting acquires ------------------------------------------------------------

    async def _let_run(self, task: asyncio.Task[Any], when: int | str) -> None:
        if when == "parked":
            await asyncio.wait([task], timeout=0.01)
        else:
            assert isinstance(when, int)
            for _ in range(when):
                await asyncio.sleep(0)

    def _wait_for(
        self, client: int, key: str, ttl: float | None, info: Any
    ) -> Callable[[], Awaitable[Any]]:
        return lambda: self.clients[client].acquire(key, ttl=ttl, timeout=WAIT_TIMEOUT, info=info)

    @precondition(lambda self: self.model.live_keys())
    @rule(
        data=st.data(),
        client=st.sampled_from(range(len(OWNERS))),
        when=st.sampled_from(CANCEL_POINTS),
    )
    def cancel_waiting_acquire(self, data: st.DataObject, client: int, when: int | str) -> None:
        """A task waits for a held key and is cancelled: it leaves no trace."""
        key = data.draw(st.sampled_from(self.model.live_keys()), label="key")
        wait = self._wait_for(client, key, None, {"grant": next(self.serial)})

        async def scenario() -> None:
            task = asyncio.ensure_future(wait())
            await self._let_run(task, when)
            assert not task.done(), f"a waiting acquire of held {key!r} ended: {task}"
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert task.cancelled(), f"the cancelled acquire ended otherwise: {task}"

        self.runner.run(scenario())

    async def _release_while_waiting(
        self, key: str, client: int, releaser: int, ttl: float | None, when: int | str
    ) -> tuple[asyncio.Task[Any], Any]:
        """Start a waiting acquire of held ``key``; once it ran ``when``, release the holder."""
        holder = self.model.live(key)
        assert holder is not None
        info = {"grant": next(self.serial)}
        task = asyncio.ensure_future(self._wait_for(client, key, ttl, info)())
        await self._let_run(task, when)
        assert not task.done(), f"a waiting acquire of held {key!r} ended: {task}"
        await self.clients[releaser].release(key, holder.token)
        assert self.model.release_token(key, holder.token)
        self._released_by_token(releaser, key, holder.token)
        return task, info

    @precondition(lambda self: self.model.live_keys())
    @rule(
        target=LEASES,
        data=st.data(),
        client=st.sampled_from(range(len(OWNERS))),
        releaser=st.sampled_from(range(len(OWNERS))),
        when=st.sampled_from(CANCEL_POINTS),
        ttl=st.sampled_from(TTLS),
    )
    def serve_waiting_acquire(
        self, data: st.DataObject, client: int, releaser: int, when: int | str, ttl: float | None
    ) -> Tracked:
        """A task waits; the holder releases: the task gets the key, with a larger fence."""
        key = data.draw(st.sampled_from(self.model.live_keys()), label="key")

        async def scenario() -> tuple[Any, Any]:
            task, info = await self._release_while_waiting(key, client, releaser, ttl, when)
            try:
                return await asyncio.wait_for(task, self.patience.seconds), info
            except TimeoutError:
                self.patience.ran_out()
                raise AssertionError(f"the waiter for {key!r} was not served") from None

        lease, info = self.runner.run(scenario())
        return self._track(lease, key, client, ttl, info)

    @precondition(lambda self: self.model.live_keys())
    @rule(
        data=st.data(),
        client=st.sampled_from(range(len(OWNERS))),
        releaser=st.sampled_from(range(len(OWNERS))),
        when=st.sampled_from(CANCEL_POINTS),
        cancel_after=st.sampled_from(CANCEL_POINTS),
    )
    def cancel_waiting_acquire_as_key_is_released(
        self,
        data: st.DataObject,
        client: int,
        releaser: int,
        when: int | str,
        cancel_after: int | str,
    ) -> None:
        """A task waits; the holder releases; the task is cancelled soon after.

        Whether the cancellation came before or after the key was handed to the task,
        the key ends up free: a grant the task never returned is given back in the
        background, and a lease it did return (cancelled too late) is released here.
        Either way the model's state afterwards does not depend on timing.
        """
        key = data.draw(st.sampled_from(self.model.live_keys()), label="key")

        async def scenario() -> tuple[Any, Any]:
            task, info = await self._release_while_waiting(key, client, releaser, None, when)
            await self._let_run(task, cancel_after)
            task.cancel()
            try:
                return await asyncio.wait_for(task, self.patience.seconds), info
            except asyncio.CancelledError:
                return None, info
            except TimeoutError:
                self.patience.ran_out()
                raise AssertionError(f"the cancelled acquire of {key!r} never ended") from None

        lease, info = self.runner.run(scenario())
        if lease is not None:
            # Not kept: what rules draw from must not depend on timing.
            tracked = self._track(lease, key, client, None, info, keep=False)
            assert self.model.lease_release(tracked.view).ok
            self.runner.run(lease.release())
        self.runner.run(self._until_free(key))

    async def _until_free(self, key: str) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.patience.seconds
        while (holder := await self.clients[0].holder(key)) is not None:
            if loop.time() > give_up:
                self.patience.ran_out()
                raise AssertionError(f"{key!r} is stuck with {holder} after a cancel")
            await asyncio.sleep(0.005)


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(_clock, "monotonic", clock)
    return clock


def url_for(store: str, tmp_path: Path) -> str:
    return "memory://stateful" if store == "memory" else f"sqlite:///{tmp_path}/locks.db"


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_locks_follow_the_model(store: str, tmp_path: Path, fake_clock: FakeClock) -> None:
    url = url_for(store, tmp_path)
    run_state_machine_as_test(lambda: SyncMachine(fake_clock, url), settings=SETTINGS)


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_async_locks_follow_the_model(store: str, tmp_path: Path, fake_clock: FakeClock) -> None:
    url = url_for(store, tmp_path)
    patience = Patience()
    run_state_machine_as_test(lambda: AsyncMachine(fake_clock, url, patience), settings=SETTINGS)


# -- a Lease object whose token is kept alive by heartbeats ----------------------------
#
# API.md's web edit session: a lease from acquire(), renewed by heartbeats that carry its
# key and token (``locks.renew(key, token)``). Through the client that granted it, such
# a heartbeat extends the Lease object as well, so the object still holds the key after
# its first deadline: renew() renews it, release() releases it, neither says LockLost.
# (Through another client, the object cannot know: past its own deadline it is lost.)


def _fresh() -> str:
    return f"edit-{uuid.uuid4().hex[:12]}"  # the memory:// table outlives the test


def _edit_session(locks: keymutex.Locks, clock: FakeClock) -> keymutex.Lease:
    """Acquire for 2 s, heartbeat at 1.5 s for 2 s more, stop at 2.5 s: still held."""
    lease = locks.acquire("doc", ttl=2.0, timeout=0)
    clock.advance_to(clock.now + 1.5)
    locks.renew("doc", lease.token, ttl=2.0)
    clock.advance_to(clock.now + 1.0)
    holder = locks.holder("doc")
    assert holder is not None
    assert holder.fence == lease.fence
    assert not lease.lost
    assert lease.remaining == 1.0
    return lease


async def _async_edit_session(locks: keymutex.AsyncLocks, clock: FakeClock) -> keymutex.AsyncLease:
    """As ``_edit_session``, on ``AsyncLocks``."""
    lease = await locks.acquire("doc", ttl=2.0, timeout=0)
    clock.advance_to(clock.now + 1.5)
    await locks.renew("doc", lease.token, ttl=2.0)
    clock.advance_to(clock.now + 1.0)
    holder = await locks.holder("doc")
    assert holder is not None
    assert holder.fence == lease.fence
    assert not lease.lost
    assert lease.remaining == 1.0
    return lease


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_release_of_a_lease_kept_alive_by_heartbeats(
    store: str, tmp_path: Path, fake_clock: FakeClock
) -> None:
    with keymutex.Locks(url_for(store, tmp_path), namespace=_fresh(), owner="editor") as locks:
        lease = _edit_session(locks, fake_clock)
        lease.release()
        assert locks.holder("doc") is None


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_renew_of_a_lease_kept_alive_by_heartbeats(
    store: str, tmp_path: Path, fake_clock: FakeClock
) -> None:
    with keymutex.Locks(url_for(store, tmp_path), namespace=_fresh(), owner="editor") as locks:
        lease = _edit_session(locks, fake_clock)
        lease.renew(ttl=2.0)
        holder = locks.holder("doc")
        assert holder is not None
        assert holder.fence == lease.fence
        assert lease.remaining == 2.0


@pytest.mark.asyncio
@pytest.mark.parametrize("store", ["memory", "sqlite"])
async def test_async_lease_kept_alive_by_heartbeats(
    store: str, tmp_path: Path, fake_clock: FakeClock
) -> None:
    url = url_for(store, tmp_path)
    async with keymutex.AsyncLocks(url, namespace=_fresh(), owner="editor") as locks:
        lease = await _async_edit_session(locks, fake_clock)
        await lease.renew(ttl=2.0)
        assert lease.remaining == 2.0
        fake_clock.advance_to(fake_clock.now + 1.5)
        await lease.release()
        assert await locks.holder("doc") is None


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_a_heartbeat_through_another_client_is_not_seen_by_the_lease(
    store: str, tmp_path: Path, fake_clock: FakeClock
) -> None:
    """Another process's heartbeat handler: the Lease object counts from its own grant,
    and once lost by its deadline it stays lost, though its token lives on."""
    url, namespace = url_for(store, tmp_path), _fresh()
    with (
        keymutex.Locks(url, namespace=namespace, owner="editor") as locks,
        keymutex.Locks(url, namespace=namespace, owner="handler") as handler,
    ):
        lease = locks.acquire("doc", ttl=2.0, timeout=0)
        fake_clock.advance_to(fake_clock.now + 1.5)
        handler.renew("doc", lease.token, ttl=2.0)
        fake_clock.advance_to(fake_clock.now + 1.0)
        assert lease.lost
        heartbeat = locks.renew("doc", lease.token, ttl=2.0)  # the granting client's
        assert heartbeat.remaining == 2.0
        assert lease.lost
        assert lease.remaining == 0
        with pytest.raises(keymutex.LockLost):
            lease.release()
        assert locks.holder("doc") is None  # released all the same: the token held it

"""A reference model of lease locks on one store, for the stateful tests (no I/O).

The model is API.md written as plain data: per key at most one grant, live while the
clock is before its expiry; renew and release work only for the token of the live
grant; every grant's fence is larger than any before it on that key. On top of that
it follows what a ``Lease`` object documents about its own view (``_lease.py``,
``_client.py``): the lease knows its deadline by its own grants and renewals, and by
renewals of its token through the client that granted it (``locks.renew(key, token)``,
an edit session's heartbeats), counted from its process's clock.

- ``lost`` is ``True`` once a store step showed the lease gone, or while it is not
  released and its local deadline has passed; a renewal by token never revives it;
- ``lease.renew()`` past the local deadline never revives the lease: it releases the
  token's grant (if the store still has it) and raises ``LockLost``;
- ``lease.release()`` past the local deadline releases the token's grant too, and
  raises ``LockLost`` whether or not the store still had it.

A ``Lease`` learns nothing of renewals of its token through another client (another
process's heartbeat handler): past its own deadline it is lost, as above.

The clock is the test's fake one, passed in: the model reads it at each step, as the
stores do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["UNCHECKED", "Expect", "Grant", "LeaseView", "Model"]


@dataclass(slots=True)
class Grant:
    """A lease as the store holds it: live while the clock is before ``expires``."""

    key: str
    token: str
    owner: str
    fence: int
    info: dict[str, Any] | None
    expires: float


@dataclass(eq=False, slots=True)
class LeaseView:
    """What one ``Lease`` object should say about itself."""

    key: str
    token: str
    owner: str
    fence: int
    info: dict[str, Any] | None
    ttl: float  # what ``renew()`` without a ttl asks for
    deadline: float  # on the (fake) monotonic clock
    client: int | None  # the client that granted it; None: a renewal by token returned it
    released: bool = False
    lost: bool = False  # a store step showed the lease gone


class _Unchecked:
    def __repr__(self) -> str:
        return "UNCHECKED"


# ``Expect.holder`` when the error carries what the lease learnt earlier, not the
# store's current holder (a lease already known lost): nothing to compare.
UNCHECKED: Any = _Unchecked()


@dataclass(frozen=True, slots=True)
class Expect:
    """The outcome the model predicts: success, or ``LockLost`` naming ``holder``."""

    ok: bool
    holder: Grant | None = None


@dataclass(slots=True)
class Model:
    clock: Callable[[], float]
    grants: dict[str, Grant] = field(default_factory=dict)  # may be past expiry
    largest_fence: dict[str, int] = field(default_factory=dict)
    granted: list[LeaseView] = field(default_factory=list)  # the views of every grant

    # -- reading ---------------------------------------------------------------------

    def live(self, key: str) -> Grant | None:
        grant = self.grants.get(key)
        return grant if grant is not None and self.clock() < grant.expires else None

    def live_keys(self) -> list[str]:
        return sorted(key for key in self.grants if self.live(key) is not None)

    def holders(self, prefix: str) -> list[Grant]:
        return [self.grants[key] for key in self.live_keys() if key.startswith(prefix)]

    def lost(self, view: LeaseView) -> bool:
        return view.lost or (not view.released and self.clock() >= view.deadline)

    def remaining(self, view: LeaseView) -> float:
        if view.lost or view.released:  # known lost, or released: no time left
            return 0.0
        return max(0.0, view.deadline - self.clock())

    def describe(self) -> str:
        now = self.clock()
        held = ", ".join(
            f"{g.key!r}: {g.owner} fence {g.fence} for {g.expires - now:g} s"
            for g in (self.grants[k] for k in self.live_keys())
        )
        return f"at {now:g}: {held or 'nothing held'}"

    # -- grants ----------------------------------------------------------------------

    def grant(
        self,
        key: str,
        *,
        token: str,
        owner: str,
        fence: int,
        info: dict[str, Any] | None,
        ttl: float,
        client: int,
    ) -> LeaseView:
        """Record a grant the store made to ``client``; its fence must beat every earlier one."""
        before = self.largest_fence.get(key)
        assert before is None or fence > before, (
            f"fence {fence} granted on {key!r} after fence {before}: fences must increase"
        )
        self.largest_fence[key] = fence
        expires = self.clock() + ttl
        self.grants[key] = Grant(key, token, owner, fence, info, expires)
        view = LeaseView(key, token, owner, fence, info, ttl, expires, client)
        self.granted.append(view)
        return view

    # -- stateless steps: ``locks.renew(key, token)``, ``locks.release(key, token)`` --

    def renew_token(
        self, key: str, token: str, ttl: float, *, client: int | None = None
    ) -> Grant | None:
        """Extend the live grant of ``token``; the grant, or ``None`` (``LockLost``).

        Renewed by key and token through ``client``: the ``Lease`` that client was
        granted for ``token`` is extended too, if it is alive.
        """
        grant = self.live(key)
        if grant is None or grant.token != token:
            return None
        grant.expires = self.clock() + ttl
        for view in self.granted:
            alive = not (view.released or self.lost(view))
            if client is not None and view.client == client and view.token == token and alive:
                view.ttl, view.deadline = ttl, grant.expires
        return grant

    def release_token(self, key: str, token: str) -> bool:
        """Drop ``token``'s grant on ``key``; ``True`` if it was live (else ``LockLost``).

        An expired grant of the token is dropped too: nobody can tell, it was invisible.
        """
        grant = self.grants.get(key)
        if grant is None or grant.token != token:
            return False
        del self.grants[key]
        return self.clock() < grant.expires

    # -- steps through a ``Lease`` object --------------------------------------------

    def lease_renew(self, view: LeaseView, ttl: float | None) -> Expect:
        if view.released or view.lost:
            return Expect(False, UNCHECKED)
        ttl = view.ttl if ttl is None else ttl
        if self.clock() >= view.deadline:  # never revived: released instead
            self.release_token(view.key, view.token)
            view.lost = True
            return Expect(False, self.live(view.key))
        if self.renew_token(view.key, view.token, ttl) is None:
            view.lost = True
            return Expect(False, self.live(view.key))
        view.ttl, view.deadline = ttl, self.clock() + ttl
        return Expect(True)

    def lease_release(self, view: LeaseView) -> Expect:
        if view.released:
            return Expect(False, self.live(view.key))
        if view.lost:
            return Expect(False, UNCHECKED)
        expired_here = self.clock() >= view.deadline
        if not self.release_token(view.key, view.token) or expired_here:
            view.lost = True
            return Expect(False, self.live(view.key))
        view.released = True
        return Expect(True)

"""``redis://``, ``rediss://``, ``redis+cluster://``, ``redis+sentinel://``: leases in Redis or Valkey.

- Each step is one round trip: a Lua script, called by SHA (after ``NOSCRIPT``, sent
  again with its source, the way the step went, and kept by the server for the next),
  checks, grants or refuses, and returns the holder in the same reply. ``renew_many``
  sends all its scripts in one pipeline (one per node in a cluster: a node that cannot
  be reached fails only its own leases' renewals).
- A lease is one small hash (token, owner, info, fence, acquired-at) whose TTL Redis
  enforces itself (``PEXPIRE``): TTLs are measured by the server's clock, and a
  crashed holder's key frees itself.
- Fences come from a counter shared by every key of a *bucket*: one bucket for a
  single server (one counter for the whole database), 1024 buckets in a cluster so
  that keys spread over the slots while each script still touches one slot (the
  bucket is the key's hash tag). Nothing grows with the number of distinct keys ever
  locked: a released or expired lease leaves no key behind. Fences survive a restart
  only as far as the counter does: with AOF (``appendonly yes``, ideally
  ``appendfsync always``) they never go backwards; without persistence they restart
  at 1, and after a failover to a replica that missed the last writes they can repeat.
- Waiting: a refused waiter joins the key's queue in Redis in the same script, with
  everything a grant needs (token, TTL, owner, info, its channel). The waiters of a
  store listen on one channel of its own (per process, and per bucket in a cluster),
  on one pub/sub connection that a waiting thread reads itself (the others sleep
  until it rings them; see ``_Subscriptions``); a channel stays subscribed a few
  seconds after its last waiter, so a process that keeps contending subscribes
  once. A waiter joins the queue only once it listens, so no grant goes unheard.
  A release *grants* the key to the first queued waiter in the same script (a new
  fence, its lease) and publishes the grant on that waiter's channel: exactly one
  waiter wakes, already holding the key: one round trip to be refused, one to
  release, and no herd. The releaser cannot barge back in ahead of the queue.
  ``PUBLISH`` counts the connections that heard it: none means the waiter's process
  (or its connection) is gone, and the script takes the lease back and grants the
  next waiter. It counts only the master's: on a cluster or Sentinel, where a replica
  delivers the master's messages too (a shard's replicas its sharded ones, a replica
  the PUBLISHes it replays), a waiter listening on one (its master became a replica in
  a failover) hears grants that the release took back; there the woken waiter
  confirms its grant with one more round trip (a try by its token). A waiter that
  gives up leaves the queue, passing on a key granted to it meanwhile; one that
  cannot (Redis unreachable as it leaves) may be granted the key unheard, which then
  stays held until that lease's TTL, as if a holder had died. Waiters also wake at the holder's expiry (the reply carries its ``PTTL``)
  and look again at least every second. A key freed by expiry goes to whoever tries
  first, so the order is first come, first served through releases, not strictly
  (``fair`` is false).
- Cluster topology changes: a node that stops serving a slot (failover, resharding)
  unsubscribes the listeners of its channels; their waiters subscribe again on the
  node their next try went to. A renewal that a node left unanswered (hung, paused,
  partitioned) has the cluster client read the slot map again, so that the next try
  goes to a replica promoted meanwhile. A pub/sub connection that fails while no
  waiter listens on it is closed, not opened again (its node may be gone for good).
- A ``redis://`` URL whose name or address moves to a new master (DNS, a virtual IP)
  leaves the store's open connections on the old one, now a replica: a step it
  answers ``READONLY`` (having written nothing) is sent once more on a new connection,
  the idle ones dropped (see ``_Connections``); a second ``READONLY`` is a
  ``StoreError`` that says the URL leads to a replica. The store's pub/sub connections
  move too, and its waiters confirm the grants they hear from then on (as on a
  cluster). Not covered: a waiter in another process whose pub/sub connection stays
  on the old master, now a replica, while that process meets no ``READONLY`` (none of
  its steps are sent meanwhile) can hear a grant that the new master's ``PUBLISH`` did
  not count and the release took back, and take it. A name or address that moves
  while the old master lives on as a replica is safe only behind Sentinel
  (``redis+sentinel://``); a virtual IP that moves breaks the old connections.
- Sentinel: redis-py asks the sentinels for the master only when it opens a
  connection, and the store keeps its connections open; so the store asks again at
  most once a second, before a step, and moves its connections (pub/sub included) to
  a new master (see ``_MasterWatch``): an old master stays writable for seconds after
  a planned failover, and renewals sent there would never reach the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import secrets
import ssl
import threading
import time
import weakref
import zlib
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import SplitResult, parse_qsl, unquote

import redis
import redis.asyncio
import redis.asyncio.client
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.backoff
import redis.client
import redis.cluster
import redis.retry
import redis.sentinel
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from keymutex import _clock
from keymutex._errors import StoreError
from keymutex._lease import Holder, Outcome
from keymutex._store import (
    Capabilities,
    PartialRenewal,
    RenewRequest,
    cancel_left,
    each_within,
    each_within_async,
    stop_task,
    translate_errors,
)
from keymutex._urls import check_host, redacted, scrubbed, split_url
from keymutex.stores._doorbell import LoopDoorbell
from keymutex.stores._settings import count, digits, seconds

__all__ = ["AsyncRedisStore", "RedisStore", "driver"]

_LOG = logging.getLogger("keymutex")

CAPABILITIES = Capabilities(
    notifies=True, fair=False, cross_process=True, durable_fences=False, clock="server"
)
# A key's queue outlives the last refusal of a waiter by this much: waiters look again
# at least every second, so only the ids of waiters that vanished expire with it.
QUEUE_LIFETIME_MS = 60_000
# A channel stays subscribed this long after its last waiter left, so that a process
# that keeps contending for a key subscribes once, not at every wait.
LINGER = 5.0
# How often a store's tending thread reads what came in while no waiter was reading.
TEND_EVERY = 0.5
TEND_BATCH = 1000
CLUSTER_BUCKETS = 1024
SCAN_COUNT = 1000
DEFAULT_SOCKET_TIMEOUT = 5.0
# A Sentinel store asks the sentinels where the master is at most this often (at the
# start of a step), and moves its connections when it changed (see _MasterWatch).
MASTER_CHECK_EVERY = 1.0
# How long a step waits for that answer; a slower one applies to the later steps.
MASTER_CHECK_PATIENCE = 0.25

# -- the scripts ---------------------------------------------------------------------
# Every script validates its arguments before its first write (a script does not roll
# back) and answers in one shape, the *reply*:
#   {ok, owner, info, fence, acquired_ms, pttl_ms}
# ok: 1 or 0; the other fields describe the lease after the step when ok (acquire,
# renew), else the current holder (all false when the key is free). pttl_ms is the
# holder's time left.
#
# A lease hash has the fields t (token), o (owner), i (info JSON, if any), f (fence)
# and a (acquired at, wall-clock ms). A key's queue is a list of waiters' *entries*:
# each the JSON array [token, ttl ms, owner, info JSON or "", channel], everything a
# release needs to grant the key to that waiter and tell it so.

_PRELUDE = """
local function holder(ok, key)
  local h = redis.call('HMGET', key, 'o', 'i', 'f', 'a')
  if not h[1] then return {ok, false, false, false, false, false} end
  return {ok, h[1], h[2] or false, h[3], h[4], redis.call('PTTL', key)}
end
local function positive(value, name)
  local n = tonumber(value)
  if not n or n <= 0 or n ~= math.floor(n) then
    return redis.error_reply('keymutex: ' .. name .. ' must be a positive integer')
  end
  return nil
end
-- Grant the free key to the first queued waiter that hears of it: a new fence, the
-- lease made from its entry, and 'token:fence:acquired_ms' published on its channel.
-- A waiter whose channel nobody listens to any more (its process is gone, or its
-- connection) is skipped: its lease is deleted again and the next one tried. A
-- PUBLISH refused (an ACL user without the channel) keeps the grant, unheard: its
-- waiter finds it when it looks again (within a second). Raised, the error came after
-- the writes and told the releaser its release failed, which it had not.
local function hand_on(lease, queue, fence_key, publish, now_ms)
  while true do
    local head = redis.call('LPOP', queue)
    if not head then return end
    local decoded, e = pcall(cjson.decode, head)
    if decoded and type(e) == 'table' and type(e[1]) == 'string' and e[1] ~= ''
        and type(e[2]) == 'number' and e[2] >= 1 and type(e[3]) == 'string'
        and type(e[4]) == 'string' and type(e[5]) == 'string' then
      local fence = redis.call('INCR', fence_key)
      if e[4] == '' then
        redis.call('HSET', lease, 't', e[1], 'o', e[3], 'f', fence, 'a', now_ms)
      else
        redis.call('HSET', lease, 't', e[1], 'o', e[3], 'i', e[4], 'f', fence, 'a', now_ms)
      end
      redis.call('PEXPIRE', lease, math.floor(e[2]))
      local told = e[1] .. ':' .. string.format('%d', fence) .. ':' .. now_ms
      local heard = redis.pcall(publish, e[5], told)
      if type(heard) ~= 'number' or heard > 0 then return end
      redis.call('DEL', lease)
    end
  end
end
local function publisher(name)
  if name ~= 'publish' and name ~= 'spublish' then
    return redis.error_reply('keymutex: unknown publish command')
  end
  return nil
end
"""

ACQUIRE = (
    _PRELUDE
    + """
-- Contract: try to grant KEYS[1] (the lease hash) to ARGV[1] (token).
-- KEYS: 1 lease, 2 fence counter of the key's bucket, 3 queue.
-- ARGV: 1 token, 2 ttl ms, 3 owner, 4 info JSON or '', 5 steal '1'/'0',
--       6 the caller's queue entry, or '' (not a waiter: never queued), 7 acquired-at
--       wall-clock ms, 8 queue lifetime ms.
-- A key this token holds already is granted again as it is (a retried call, or a
-- waiter a release granted the key to, looking before it heard so).
-- Grants when the key is free, or when stealing: a new fence from KEYS[2], PEXPIRE
-- ttl; a waiter granted leaves the queue. Refuses otherwise with the holder; a
-- refused waiter is queued (once) and the queue's lifetime renewed. Reply: see the
-- module.
local err = positive(ARGV[2], 'ttl') or positive(ARGV[7], 'acquired-at')
  or positive(ARGV[8], 'queue lifetime')
if err then return err end
if ARGV[1] == '' then return redis.error_reply('keymutex: empty token') end
local cur = redis.call('HMGET', KEYS[1], 't', 'o', 'i', 'f', 'a')
if cur[1] == ARGV[1] then  -- granted already: this is a retry whose reply was lost
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if ARGV[6] ~= '' then redis.call('LREM', KEYS[3], 1, ARGV[6]) end
  return {1, cur[2], cur[3] or false, cur[4], cur[5], tonumber(ARGV[2])}
end
if ARGV[5] ~= '1' and cur[1] then
  if ARGV[6] ~= '' then
    if not redis.call('LPOS', KEYS[3], ARGV[6]) then
      redis.call('RPUSH', KEYS[3], ARGV[6])
    end
    redis.call('PEXPIRE', KEYS[3], ARGV[8])
  end
  return {0, cur[2], cur[3] or false, cur[4], cur[5], redis.call('PTTL', KEYS[1])}
end
local fence = redis.call('INCR', KEYS[2])
if cur[1] then redis.call('DEL', KEYS[1]) end
if ARGV[6] ~= '' then redis.call('LREM', KEYS[3], 1, ARGV[6]) end
if ARGV[4] == '' then
  redis.call('HSET', KEYS[1], 't', ARGV[1], 'o', ARGV[3], 'f', fence, 'a', ARGV[7])
else
  redis.call('HSET', KEYS[1], 't', ARGV[1], 'o', ARGV[3], 'i', ARGV[4], 'f', fence,
             'a', ARGV[7])
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, ARGV[3], ARGV[4] ~= '' and ARGV[4] or false, fence, ARGV[7], tonumber(ARGV[2])}
"""
)

RENEW = (
    _PRELUDE
    + """
-- Contract: extend KEYS[1] (the lease hash) to ARGV[2] ms from now if ARGV[1] (token)
-- holds it. KEYS: 1 lease. ARGV: 1 token, 2 ttl ms. Reply: see the module.
local err = positive(ARGV[2], 'ttl')
if err then return err end
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then return holder(0, KEYS[1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return holder(1, KEYS[1])
"""
)

RELEASE = (
    _PRELUDE
    + """
-- Contract: delete KEYS[1] (the lease hash) if ARGV[1] (token) holds it, and grant
-- the key to the first queued waiter still listening (hand_on), published with
-- ARGV[2] ('publish', or 'spublish' in a cluster). KEYS: 1 lease, 2 queue, 3 fence
-- counter of the key's bucket. ARGV: 1 token, 2 publish command, 3 now, wall-clock ms.
-- Reply: see the module ({1, false...} once released).
local err = publisher(ARGV[2]) or positive(ARGV[3], 'now')
if err then return err end
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then return holder(0, KEYS[1]) end
redis.call('DEL', KEYS[1])
hand_on(KEYS[1], KEYS[2], KEYS[3], ARGV[2], ARGV[3])
return {1, false, false, false, false, false}
"""
)

LEAVE = (
    _PRELUDE
    + """
-- Contract: the waiter with token ARGV[1] and queue entry ARGV[4] gives up waiting for
-- KEYS[1]: it leaves the queue, and if a release granted it the key meanwhile, the
-- key goes to the next waiter (as RELEASE). KEYS: 1 lease, 2 queue, 3 fence counter.
-- ARGV: 1 token, 2 publish command, 3 now, wall-clock ms, 4 entry.
-- Reply: {1, false...}.
local err = publisher(ARGV[2]) or positive(ARGV[3], 'now')
if err then return err end
redis.call('LREM', KEYS[2], 1, ARGV[4])
if redis.call('HGET', KEYS[1], 't') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  hand_on(KEYS[1], KEYS[2], KEYS[3], ARGV[2], ARGV[3])
end
return {1, false, false, false, false, false}
"""
)


@dataclass(frozen=True, slots=True)
class _Script:
    name: str
    source: str
    sha: str


def _script(name: str, source: str) -> _Script:
    return _Script(name, source, hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest())


_ACQUIRE = _script("acquire", ACQUIRE)
_RENEW = _script("renew", RENEW)
_RELEASE = _script("release", RELEASE)
_LEAVE = _script("leave", LEAVE)


# -- keys ----------------------------------------------------------------------------


class _Layout:
    """Names of one namespace's Redis keys.

    ``km:{B}:L:NS:KEY`` is a lease hash, ``km:{B}:q:L:NS:KEY`` its queue of waiters,
    ``km:{B}:fence`` the bucket's fence counter, where L is the namespace's length (so
    that namespace and key never run into each other) and B the key's bucket.
    ``km:{B}:w:L:NS:ID`` is the channel on which the waiters of one store, in one
    process (ID), hear that a release granted them a key of bucket B (sharded in a
    cluster, so that it lives on the key's node). With one bucket the braces are left
    out.
    """

    __slots__ = (
        "_buckets",
        "_id",
        "_middle",
        "_pid",
        "confirms_grants",
        "namespace",
        "publish",
        "sharded",
    )

    def __init__(self, namespace: str, buckets: int, *, replicated: bool = False) -> None:
        self.namespace = namespace
        self._buckets = buckets
        self._middle = f"{len(namespace)}:{namespace}:"
        self._pid = 0
        self._id = ""
        # In a cluster, a sharded channel lives on the key's own node, so PUBLISH's count
        # of receivers is exact there too.
        self.sharded = buckets > 1
        self.publish = "spublish" if self.sharded else "publish"
        # Whether a waiter confirms a grant it heard with a try (see _Steps.contend):
        # where its pub/sub connection can be on a replica, which delivers the master's
        # messages (a cluster forwards sharded ones within the shard, a replica replays
        # PUBLISH) while PUBLISH counts only the master's listeners.
        self.confirms_grants = replicated or self.sharded

    def bucket(self, key: str) -> str:
        if self._buckets == 1:
            return "km:"
        number = zlib.crc32(f"{self._middle}{key}".encode()) % self._buckets
        return f"km:{{{number}}}:"

    def lease(self, key: str) -> str:
        return f"{self.bucket(key)}{self._middle}{key}"

    def queue(self, key: str) -> str:
        return f"{self.bucket(key)}q:{self._middle}{key}"

    def fence(self, key: str) -> str:
        return f"{self.bucket(key)}fence"

    def channel(self, key: str) -> str:
        """Where this process's waiters for ``key`` hear of a grant."""
        if self._pid != os.getpid():  # a forked child must not hear its parent's grants
            self._pid, self._id = os.getpid(), secrets.token_hex(8)
        return f"{self.bucket(key)}w:{self._middle}{self._id}"

    def pattern(self, prefix: str) -> str:
        """A SCAN pattern that matches at least the leases of keys starting with prefix."""
        bucket = "km:" if self._buckets == 1 else "km:{*}:"
        return f"{bucket}{_glob_escape(self._middle + prefix)}*"

    def listed(self, name: str, prefix: str) -> str | None:
        """The key of a scanned name if it is a lease of ours under ``prefix``."""
        key = self.key_of(name)
        if key is None or not key.startswith(prefix) or name != self.lease(key):
            return None
        return key

    def key_of(self, name: str) -> str | None:
        """The key of a lease hash's name, or ``None`` if it is not one of ours."""
        start = name.find("}:") + 2 if self._buckets > 1 else len("km:")
        if not name.startswith(self._middle, start):
            return None
        return name[start + len(self._middle) :]


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


# -- arguments and replies (no I/O) --------------------------------------------------


def _ttl_ms(ttl: float) -> int:
    # Rounded up: the store never grants less than the client counts on.
    return max(1, math.ceil(ttl * 1000))


def _holder(key: str, reply: Sequence[Any], now: float) -> Holder | None:
    if reply[1] is None:
        return None
    pttl = int(reply[5])
    return Holder(
        key=key,
        owner=reply[1],
        info=None if reply[2] is None else json.loads(reply[2]),
        fence=int(reply[3]),
        acquired_at=int(reply[4]) / 1000,
        expires_at=now + max(pttl, 0) / 1000,
    )


# Redis keeps expiry times in whole milliseconds of its own clock, truncated: a key
# can expire up to this much before "now + ttl" by a finer clock. Time left is reported
# short by that much, so a client never counts on a lease Redis has dropped.
CLOCK_GRAIN = 0.001


def _outcome(key: str, reply: Sequence[Any]) -> Outcome:
    ok = int(reply[0]) == 1
    holder = _holder(key, reply, time.time())
    remaining = None
    if reply[5] is not None and int(reply[5]) >= 0:
        remaining = max(0.0, int(reply[5]) / 1000 - CLOCK_GRAIN)
    return Outcome(ok, holder, remaining)


def _release_outcome(key: str, reply: Sequence[Any]) -> Outcome:
    return Outcome(True) if int(reply[0]) == 1 else _outcome(key, reply)


def _hash_reply(key: str, fields: Sequence[Any], pttl: Any) -> Holder | None:
    # PTTL 0 is a lease in its last millisecond: Redis expires a key only once its
    # clock has passed the expiry time, and till then the lease's token still renews
    # it, and an acquire is still refused. Calling it free was wrong for that instant:
    # a heartbeat sent just after holder() said "free" renewed it (47 times in 60).
    if fields[0] is None or pttl is None or int(pttl) < 0:
        return None  # gone between SCAN and read (-2), or not a lease of ours (-1)
    return _holder(key, [0, *fields, pttl], time.time())


def _queue_reads(pipe: Any, names: Sequence[str]) -> None:
    """Queue the reads of lease hashes on ``pipe``: their fields, then their PTTL."""
    for name in names:
        pipe.hmget(name, "o", "i", "f", "a")
        pipe.pttl(name)


def _read_holders(keys: Sequence[str], replies: Sequence[Any]) -> list[Holder]:
    """The live holders among the replies of ``_queue_reads`` for these keys."""
    found = (_hash_reply(key, replies[2 * i], replies[2 * i + 1]) for i, key in enumerate(keys))
    return [holder for holder in found if holder is not None]


def _batches(names: Mapping[str, str]) -> list[tuple[list[str], list[str]]]:
    """Scanned lease names (name -> key) in key order, as (names, keys) batches."""
    ordered = sorted(names.items(), key=lambda item: item[1])
    return [
        ([name for name, _ in chunk], [key for _, key in chunk])
        for chunk in (ordered[i : i + SCAN_COUNT] for i in range(0, len(ordered), SCAN_COUNT))
    ]


@dataclass(frozen=True, slots=True)
class _Call:
    """One script invocation: the script, its keys and arguments, and how to read it."""

    script: _Script
    keys: tuple[str, ...]
    args: tuple[str | int, ...]
    key: str
    read: Callable[[str, Sequence[Any]], Outcome]

    def command(self, *, sourced: bool = False) -> tuple[Any, ...]:
        """Its ``EVALSHA``; ``sourced``: its ``EVAL`` with the script's source, for a
        server that answered ``NOSCRIPT`` (it keeps the script for the next ``EVALSHA``)."""
        head = ("EVAL", self.script.source) if sourced else ("EVALSHA", self.script.sha)
        return (*head, len(self.keys), *self.keys, *self.args)


def _scripted(send: Callable[..., Any], call: _Call) -> Any:
    """``call`` sent by ``send``: by SHA, and after ``NOSCRIPT`` (a new, restarted or
    flushed server) with its source, the same way. Not loaded through redis-py's pool
    (``SCRIPT LOAD``): found by review, after a redis:// URL's address moved to a new
    master (see _Connections), the pool loaded the script on the old one; a user without
    ``+script`` may not load it at all; and a cluster client sends it to every master,
    so one that could not be reached failed the call too."""
    try:
        return send(*call.command())
    except NoScriptError:
        return send(*call.command(sourced=True))


async def _scripted_async(send: Callable[..., Awaitable[Any]], call: _Call) -> Any:
    """``_scripted`` for ``redis.asyncio``."""
    try:
        return await send(*call.command())
    except NoScriptError:
        return await send(*call.command(sourced=True))


class _Steps:
    """The arguments of every step, for the sync and async stores alike."""

    __slots__ = ("layout",)

    def __init__(self, layout: _Layout) -> None:
        self.layout = layout

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: _RedisWaiter | _AsyncRedisWaiter | None,
    ) -> _Call:
        layout = self.layout
        ttl_ms = _ttl_ms(ttl)
        info_json = "" if info is None else json.dumps(info, separators=(",", ":"))
        if waiter is not None and not waiter.entry:
            waiter.entry = json.dumps(
                [token, ttl_ms, owner, info_json, waiter.channel], separators=(",", ":")
            )
        return _Call(
            _ACQUIRE,
            (layout.lease(key), layout.fence(key), layout.queue(key)),
            (
                token,
                ttl_ms,
                owner,
                info_json,
                "1" if steal else "0",
                "" if waiter is None else waiter.entry,
                math.floor(time.time() * 1000),
                QUEUE_LIFETIME_MS,
            ),
            key,
            _outcome,
        )

    def contend(
        self,
        key: str,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: _RedisWaiter | _AsyncRedisWaiter,
    ) -> Generator[_Call | None, Outcome | None, Outcome]:
        """One try of a waiter, for the sync and async stores alike: yields each script
        to run (send back its outcome), or ``None`` to subscribe the waiter's channel
        (send back ``None``); returns the try's outcome."""
        if waiter.granted is not None and not steal:
            if self.layout.confirms_grants:
                # A waiter that listens on a replica (a failover made its master one)
                # hears grants that PUBLISH did not count, and that the release took
                # back as unheard. The try below, by the token, confirms.
                waiter.granted = None
            else:
                granted = waiter.take_grant(key, ttl, owner, info)
                if granted is not None:  # a release granted it to us, and told us
                    return granted
        if not waiter.id:  # the first try of this acquire
            waiter.id = token
            waiter.hub.try_join(waiter)  # type: ignore[arg-type]  # a channel listened to already
        if not waiter.subscribed:
            # Not listening yet: a try that queued us could be granted the key unheard
            # (the release would pass us over). Try without a place; when refused,
            # subscribe, then try again with one.
            first = yield self.acquire(key, token, ttl, owner, info, steal, None)
            assert first is not None
            if first.ok:
                return first
            yield None
        call = self.acquire(key, token, ttl, owner, info, steal, waiter)
        sent_at = _clock.monotonic()
        outcome = yield call
        assert outcome is not None
        waiter.refused(outcome, sent_at)
        return outcome

    def renew(self, request: RenewRequest) -> _Call:
        return _Call(
            _RENEW,
            (self.layout.lease(request.key),),
            (request.token, _ttl_ms(request.ttl)),
            request.key,
            _outcome,
        )

    def release(self, key: str, token: str) -> _Call:
        return self._hand_on(_RELEASE, key, (token,))

    def leave(self, key: str, token: str, entry: str) -> _Call:
        return self._hand_on(_LEAVE, key, (token,), (entry,))

    def _hand_on(
        self, script: _Script, key: str, first: tuple[str, ...], last: tuple[str, ...] = ()
    ) -> _Call:
        layout = self.layout
        return _Call(
            script,
            (layout.lease(key), layout.queue(key), layout.fence(key)),
            (*first, layout.publish, math.floor(time.time() * 1000), *last),
            key,
            _release_outcome,
        )


# -- waiting -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _PubSubKind:
    """The pub/sub command names and message types of plain or sharded channels, and
    the attribute in which redis-py keeps the channels it subscribes again when it
    reconnects."""

    subscribe: str
    unsubscribe: str
    subscribed: str
    message: str
    unsubscribed: str
    kept_in: str


_PLAIN = _PubSubKind("subscribe", "unsubscribe", "subscribe", "message", "unsubscribe", "channels")
_SHARDED = _PubSubKind(
    "ssubscribe", "sunsubscribe", "ssubscribe", "smessage", "sunsubscribe", "shard_channels"
)

# Where a channel is served: a name for its server, and how to open a pub/sub there.
Locate = Callable[[str], tuple[str, Callable[[], Any]]]


def _told(data: Any) -> tuple[str, tuple[int, int] | None]:
    """A grant's message, ``token:fence:acquired_ms``: the token, and (fence, ms)."""
    text = data.decode() if isinstance(data, bytes) else str(data)
    token, _, rest = text.partition(":")
    fence, _, acquired_ms = rest.partition(":")
    if fence.isdigit() and acquired_ms.isdigit():
        return token, (int(fence), int(acquired_ms))
    return token, None


class _Grantee:
    """What the sync and async waiters share: their place in a queue, and their grant.

    Its ``id`` is the token of the acquire it waits for (set at the first try), its
    ``entry`` what it queues in Redis (see the scripts), made at the first try. A
    release that grants it the key publishes ``token:fence:acquired_ms`` on its
    ``channel``; the reader keeps the fence and time in ``granted``, and the next try
    takes the lease from there without a round trip (``take_grant``), if the grant is
    surely newer than the waiter's last refusal: its fence is above the fence of the
    holder that refused it (fences grow with every grant of the key, so a grant made
    before that refusal, and gone since, has a smaller one). The lease's time is then
    counted from that refusal's request, which the grant came after: never more than
    Redis gave. Only where the waiter surely listens on the master (a single server):
    elsewhere its next try confirms the grant (``_Layout.confirms_grants``).
    """

    __slots__ = (
        "channel",
        "entry",
        "granted",
        "id",
        "refused_at",
        "refused_fence",
        "subscribed",
    )

    def __init__(self, channel: str) -> None:
        self.channel = channel
        self.id = ""
        self.entry = ""
        self.subscribed = False
        self.granted: tuple[int, int] | None = None
        self.refused_at = 0.0
        self.refused_fence: int | None = None

    def refused(self, outcome: Outcome, sent_at: float) -> None:
        """Note a refusal of a try whose request was sent at ``sent_at`` (``_clock``)."""
        if not outcome.ok:
            self.refused_at = sent_at
            self.refused_fence = None if outcome.holder is None else outcome.holder.fence

    def take_grant(
        self, key: str, ttl: float, owner: str, info: dict[str, Any] | None
    ) -> Outcome | None:
        """The lease a release granted this waiter, if it surely still holds."""
        granted, self.granted = self.granted, None
        if granted is None or self.refused_fence is None or granted[0] <= self.refused_fence:
            return None
        remaining = ttl - (_clock.monotonic() - self.refused_at) - CLOCK_GRAIN
        if remaining <= 0:  # a real try will tell (and renew it, if it is still ours)
            return None
        holder = Holder(
            key=key,
            owner=owner,
            info=None if info is None else json.loads(json.dumps(info)),
            fence=granted[0],
            acquired_at=granted[1] / 1000,
            expires_at=time.time() + remaining,
        )
        return Outcome(True, holder, remaining)


class _RedisWaiter(_Grantee):
    """A waiter of the sync store: rung by whichever thread reads its hub's connection.

    Its event is made when it joins its channel (``arm``): only then can it be rung,
    and only a refused waiter, which has joined, is waited on. Most acquires are
    granted at the first try and never need it. A ring that comes while the waiter is
    not waiting is kept until its next wait.
    """

    __slots__ = ("event", "hub", "on_close", "rung")

    def __init__(self, hub: _Subscriptions, channel: str) -> None:
        super().__init__(channel)
        self.hub = hub
        self.rung = False  # set and consumed under the hub's mutex
        self.event: threading.Event | None = None
        # Set while the waiter is queued in Redis: leaves the queue (one round trip).
        self.on_close: Callable[[], None] | None = None

    def arm(self) -> None:
        if self.event is None:
            self.event = threading.Event()

    def ring(self, grant: tuple[int, int] | None) -> None:
        if grant is not None:
            self.granted = grant
        self.rung = True
        if self.event is not None:
            self.event.set()

    def wait(self, timeout: float) -> bool:
        self.arm()  # joined, hence armed, already: this only keeps it safe to call
        assert self.event is not None
        return self.hub.wait_for(self, self.event, timeout)

    async def wait_async(self, timeout: float) -> bool:
        # For the Waiter protocol's thread adapter; AsyncLocks on Redis uses
        # AsyncRedisStore and its own waiter, so this thread is never taken in practice.
        return await asyncio.to_thread(self.wait, timeout)

    def close(self) -> None:
        on_close, self.on_close = self.on_close, None
        try:
            if on_close is not None:
                on_close()
        finally:
            if self.subscribed:
                self.subscribed = False
                self.hub.leave(self)


class _Channels:
    """Which waiters listen on which channel, and which channels linger unused.

    Shared bookkeeping of the sync and async hubs (each guards it with its own lock).
    """

    def __init__(self) -> None:
        self.waiters: dict[str, set[Any]] = {}
        self.idle: dict[str, float] = {}  # channel -> monotonic time its last waiter left
        self.last_sweep = time.monotonic()

    def add(self, channel: str, waiter: Any) -> None:
        self.waiters.setdefault(channel, set()).add(waiter)
        self.idle.pop(channel, None)

    def remove(self, channel: str, waiter: Any) -> None:
        waiters = self.waiters.get(channel)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self.waiters[channel]
                self.idle[channel] = time.monotonic()

    def expired(self) -> list[str]:
        """Channels unused for ``LINGER`` seconds (checked about once a second)."""
        now = time.monotonic()
        if now - self.last_sweep < 1.0:
            return []
        self.last_sweep = now
        gone = [channel for channel, since in self.idle.items() if now - since >= LINGER]
        for channel in gone:
            del self.idle[channel]
        return gone

    def drop(self, channel: str) -> set[Any]:
        """Forget a channel that Redis unsubscribed; the waiters that listened on it."""
        self.idle.pop(channel, None)
        return self.waiters.pop(channel, set())

    def ring_all(self) -> None:
        """Wake every waiter to try again at once (its hub moved to a new master)."""
        for waiters in self.waiters.values():
            for waiter in waiters:
                waiter.ring(None)

    def addressees(self, channel: str, data: Any) -> tuple[list[Any], tuple[int, int] | None]:
        """The waiters a grant's message is for, and the grant (see ``_told``)."""
        token, grant = _told(data)
        return [w for w in self.waiters.get(channel, ()) if w.id == token], grant


def _unsubscribed_by_redis(
    channels: _Channels, confirmed: dict[str, Any], pubsub: Any, kind: _PubSubKind, name: Any
) -> bool:
    """Take in an unsubscription from Redis (under the hub's lock); whether it was one
    that Redis sent of itself, not the answer to one of ours.

    A cluster node that stops serving a slot (it became a replica in a failover, or the
    slot moved to another master) unsubscribes the listeners of its sharded channels.
    Found by review: that went unnoticed, the channel still counted as subscribed, and
    its waiters' hand-overs went unheard (each waited for its recheck, a second, at
    every release). Now the channel is forgotten, here and by redis-py (which would
    subscribe it again on this node when it reconnects), and its waiters are woken to
    subscribe again where their slot is served. An answer to our own unsubscription
    finds its channel forgotten already (``_unsubscribe_unused``, ``_refuse``), or
    subscribed anew and not yet confirmed: it is left alone.
    """
    channel = str(name)
    subscription = confirmed.get(channel)
    if subscription is None or not subscription.is_set():
        return False
    del confirmed[channel]
    with contextlib.suppress(AttributeError):
        getattr(pubsub, kind.kept_in).pop(channel, None)
    for waiter in channels.drop(channel):
        waiter.subscribed = False
        waiter.ring(None)
    return True


def _elsewhere(pubsub: Any, master: tuple[str, int] | None) -> bool:
    """Whether ``pubsub`` is connected to another node than ``master`` (``None``: to
    whatever node, for a ``redis://`` address that moved: see ``RedisStore._moved``)."""
    conn = None if pubsub is None else pubsub.connection
    return conn is not None and (master is None or (conn.host, conn.port) != master)


# What a forked child must reset: the locks a parent's thread may have held at the fork
# (see _Subscriptions._forked, RedisStore._forked).
_FORK_AWARE: weakref.WeakSet[_Subscriptions | _Hubs | RedisStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for thing in list(_FORK_AWARE):
        thing._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Confirmation(threading.Event):
    """Set when Redis confirmed a channel's subscription, or refused it (``refused``)."""

    refused: Exception | None = None


class _AsyncConfirmation(asyncio.Event):
    """``_Confirmation`` for an async store."""

    refused: Exception | None = None


def _refused_subscription(channel: str, refusal: Exception) -> StoreError:
    """Found by review: Redis 7 gives a new ACL user no channels
    (``acl-pubsub-default resetchannels``); the refused SUBSCRIBE was only logged, and
    every waiting acquire waited 5 s, whatever its timeout, for a confirmation that
    never came, then said nothing of why."""
    permission = isinstance(refusal, redis.exceptions.NoPermissionError) or "permission" in str(
        refusal
    )
    hint = (
        ". An ACL user needs the channels km:* (ACL SETUSER … '&km:*'), or allchannels"
        if permission
        else ""
    )
    error = StoreError(
        f"Redis refused the subscription to {channel!r}, on which this client waits to hear"
        f" of releases: {refusal}{hint}"
    )
    error.__cause__ = refusal
    return error


class _Subscriptions:
    """One pub/sub connection per sync store (per node in a cluster), read by a waiter.

    No thread of its own stands between a message and its waiter: a thread that waits
    (for a hand-over, or for a subscription to be confirmed) reads the connection
    itself when nobody else does, and dispatches what it reads to the others, which
    sleep on their events (leader and followers). When it is done, it hands the
    reading on to a thread still waiting. A waiter woken by its hand-over has then
    paid one wake-up, not two. A *tending* thread reads whatever came in while no
    waiter was reading (every ``TEND_EVERY`` seconds, without blocking), so that
    lingering channels are unsubscribed and nothing piles up on the connection.

    ``join`` subscribes a waiter's channel (unless it is subscribed already) and
    returns once Redis has confirmed the subscription: a hand-over published after
    that is sure to reach the waiter. A channel stays subscribed for ``LINGER``
    seconds after its last waiter left.
    """

    def __init__(self, make_pubsub: Callable[[], Any], *, sharded: bool) -> None:
        self._make_pubsub = make_pubsub
        self._kind = _SHARDED if sharded else _PLAIN
        self._mutex = threading.Lock()
        self._channels = _Channels()
        self._confirmed: dict[str, _Confirmation] = {}
        self._pubsub: Any = None
        # The event of the thread reading the connection now, and those of the threads
        # waiting for it to ring them (in arrival order).
        self._reader: threading.Event | None = None
        self._followers: dict[threading.Event, None] = {}
        self._tending: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        # Set when the connection is to a node that is no master any more (follow):
        # the next reader drops it, and redis-py reconnects and subscribes again.
        self._moved = False
        _FORK_AWARE.add(self)

    def _forked(self) -> None:
        """In a forked child: a mutex that a parent's thread held at the fork stays held
        for good (a child's first wait hung, whatever its timeout); the parent's
        connection and readers are not ours. Start afresh (``join`` connects anew)."""
        self._mutex = threading.Lock()
        self._pubsub, self._tending, self._stop = None, None, threading.Event()
        self._moved = False
        self._channels, self._confirmed = _Channels(), {}
        self._reader, self._followers = None, {}

    def try_join(self, waiter: _RedisWaiter) -> bool:
        """Join without I/O if the channel is subscribed and confirmed already."""
        with self._mutex:
            confirmed = self._confirmed.get(waiter.channel)
            if confirmed is None or not confirmed.is_set():
                return False
            waiter.arm()
            self._channels.add(waiter.channel, waiter)
            # Under the mutex: a push from Redis that drops the channel, dispatched by
            # the reader the moment the mutex is let go, must find it set (and clear it).
            waiter.subscribed = True
        return True

    def join(self, waiter: _RedisWaiter, timeout: float) -> None:
        with self._mutex:
            if self._closed:
                raise RuntimeError("this store is closed")
            waiter.arm()
            self._channels.add(waiter.channel, waiter)
            confirmed = self._confirmed.get(waiter.channel)
            if confirmed is None:
                confirmed = self._confirmed[waiter.channel] = _Confirmation()
                try:
                    if self._pubsub is None:
                        self._pubsub = self._make_pubsub()
                    getattr(self._pubsub, self._kind.subscribe)(waiter.channel)
                except BaseException:
                    self._channels.remove(waiter.channel, waiter)
                    self._confirmed.pop(waiter.channel, None)
                    raise
                if self._tending is None:
                    self._tending = threading.Thread(
                        target=self._tend, name="keymutex-redis-pubsub", daemon=True
                    )
                    self._tending.start()
            waiter.subscribed = True  # under the mutex, as in try_join
        deadline = time.monotonic() + timeout
        if not self._await(confirmed.is_set, threading.Event(), deadline):
            raise StoreError(f"Redis did not confirm the subscription within {timeout} s")
        if confirmed.refused is not None:
            raise _refused_subscription(waiter.channel, confirmed.refused)

    def _refuse(self, pubsub: Any, refusal: Exception) -> None:
        """Under the mutex: an error reply on the pub/sub connection answers a SUBSCRIBE
        (or an UNSUBSCRIBE): every subscription not yet confirmed fails with it at once,
        and its channel is dropped (redis-py would subscribe it again at every
        reconnection). A later join subscribes afresh."""
        refused = [channel for channel, c in self._confirmed.items() if not c.is_set()]
        for channel in refused:
            confirmed = self._confirmed.pop(channel)
            confirmed.refused = refusal
            confirmed.set()
        for event in self._followers:  # among them, the threads joining those channels
            event.set()
        if refused:
            with contextlib.suppress(Exception):
                getattr(pubsub, self._kind.unsubscribe)(*refused)

    def leave(self, waiter: _RedisWaiter) -> None:
        with self._mutex:
            if not self._closed:
                self._channels.remove(waiter.channel, waiter)

    def wait_for(self, waiter: _RedisWaiter, event: threading.Event, timeout: float) -> bool:
        """Wait until ``waiter`` is rung (True, and the ring consumed) or ``timeout``."""

        def rung() -> bool:
            return waiter.rung

        done = self._await(rung, event, time.monotonic() + timeout)
        if done:
            with self._mutex:
                waiter.rung = False
        return done

    def _await(self, done: Callable[[], bool], event: threading.Event, deadline: float) -> bool:
        """Wait until ``done()`` (checked under the mutex), reading the connection when
        nobody else does; False at ``deadline`` or when the store closes."""
        while True:
            with self._mutex:
                finished = done()
                remaining = deadline - time.monotonic()
                if finished or remaining <= 0 or self._closed:
                    self._followers.pop(event, None)
                    self._pass_on()
                    return finished
                lead = self._reader is None and self._pubsub is not None
                if lead:
                    self._reader = event
                    self._followers.pop(event, None)
                else:
                    self._followers[event] = None
                    event.clear()  # a ring or a turn to read from now on sets it again
            if not lead:
                try:
                    event.wait(remaining)
                except BaseException:  # raised in this thread (a signal handler's)
                    with self._mutex:
                        self._followers.pop(event, None)
                        self._pass_on()
                    raise
                continue
            try:
                self._read_until(done, deadline)
            finally:
                with self._mutex:
                    self._reader = None
                    self._pass_on()

    def _pass_on(self) -> None:
        """Under the mutex: with nobody reading, wake the first follower to read."""
        if self._reader is None and self._followers:
            next(iter(self._followers)).set()

    def _read_until(self, done: Callable[[], bool], deadline: float) -> None:
        failures = 0
        while True:
            with self._mutex:
                pubsub = self._pubsub
                if done() or self._closed or pubsub is None:
                    return
                self._reconnect_if_moved(pubsub)
                self._unsubscribe_unused(pubsub)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                message = pubsub.get_message(timeout=min(remaining, TEND_EVERY))
                failures = 0
            except redis.exceptions.ResponseError as exc:  # the connection is fine
                with self._mutex:
                    self._refuse(pubsub, exc)
                continue
            except Exception as exc:  # the driver's, or a socket closed under it by close()
                if self._closed:
                    return
                if not isinstance(exc, redis.exceptions.RedisError):
                    # Not the connection's: raised in this thread while it read (by a
                    # signal handler: an alarm, a job's time limit), which is the
                    # caller's to see. The reply may be half read: reconnect next time.
                    with contextlib.suppress(Exception):
                        pubsub.connection.disconnect()
                    raise
                failures += 1
                _LOG.warning("Redis pub/sub connection failed (%s); reconnecting", exc)
                time.sleep(min(1.0, 0.05 * 2**failures, max(0.0, deadline - time.monotonic())))
                continue
            if message is not None:
                self._dispatch(message)

    def follow(self, master: tuple[str, int] | None) -> None:
        """After a Sentinel failover: if the connection is to another node than
        ``master``, have the next reader reconnect (to the master the sentinels name;
        redis-py subscribes its channels again), and wake every waiter to try again at
        once: a hand-over published on the new master before that went unheard, and a
        queue entry written to the old one after the promotion is lost."""
        with self._mutex:
            if self._closed or not _elsewhere(self._pubsub, master):
                return
            self._moved = True
            self._channels.ring_all()

    def _reconnect_if_moved(self, pubsub: Any) -> None:
        """Under the mutex, by the reader: drop a connection ``follow`` found stale (the
        next read connects anew). Done by the reader, not under it: redis-py's
        connection is not safe to close while another thread reads it."""
        if self._moved:
            self._moved = False
            _LOG.info("Redis has a new master: moving the pub/sub connection")
            with contextlib.suppress(Exception):
                pubsub.connection.disconnect()

    def _unsubscribe_unused(self, pubsub: Any) -> None:
        """Under the mutex: unsubscribe the channels unused for ``LINGER`` seconds.

        Sent under the mutex, as ``join`` sends its subscriptions: a channel joined
        again meanwhile is subscribed after this goes out, never before it (which would
        leave it unsubscribed in Redis and confirmed here, its hand-overs unheard).
        """
        unused = self._channels.expired()
        if not unused:
            return
        for channel in unused:
            self._confirmed.pop(channel, None)
        try:
            getattr(pubsub, self._kind.unsubscribe)(*unused)
        except Exception as exc:  # the next read reconnects; redis-py resubscribes
            if not self._closed:
                _LOG.warning("Redis pub/sub connection failed (%s); reconnecting", exc)

    def _tend(self) -> None:
        """Read what came in while no waiter was reading; unsubscribe lingering channels."""
        turn = threading.Event()
        me = threading.current_thread()
        while not self._stop.wait(TEND_EVERY):
            with self._mutex:
                pubsub = self._pubsub
                if self._closed or pubsub is None or self._tending is not me:
                    return
                if self._reader is not None:
                    continue
                self._reader = turn
                self._reconnect_if_moved(pubsub)
                self._unsubscribe_unused(pubsub)
            try:
                for _ in range(TEND_BATCH):
                    message = pubsub.get_message(timeout=0)
                    if message is None:
                        break
                    self._dispatch(message)
            except redis.exceptions.ResponseError as exc:  # as in _read_until
                with self._mutex:
                    self._refuse(pubsub, exc)
            except Exception as exc:  # reconnects at the next read (redis-py resubscribes)
                if not self._closed and not self._retired(pubsub, exc):
                    _LOG.warning("Redis pub/sub connection failed (%s); reconnecting", exc)
            finally:
                with self._mutex:
                    self._reader = None
                    self._pass_on()

    def _retired(self, pubsub: Any, failure: Exception) -> bool:
        """Close a connection that failed while no waiter listens on it, rather than
        connect again (``join`` opens another, and starts a tending thread again).

        Found by review: a cluster node that died for good (its replica promoted) had
        every store whose waiters had listened there try to connect to it again twice a
        second, with a warning each time, for as long as the process ran: the channels
        left there could not be unsubscribed (the connection was down), and redis-py
        kept them to subscribe again."""
        with self._mutex:
            if self._channels.waiters or self._pubsub is not pubsub:
                return False
            self._pubsub, self._tending = None, None
            self._confirmed.clear()
            self._channels.idle.clear()
        _LOG.info("Redis pub/sub connection failed (%s); no waiter listens: closed", failure)
        with contextlib.suppress(RedisError, OSError):
            pubsub.close()
        return True

    def _dispatch(self, message: Mapping[str, Any]) -> None:
        channel = message.get("channel")
        with self._mutex:
            if message.get("type") == self._kind.unsubscribed:
                _unsubscribed_by_redis(
                    self._channels, self._confirmed, self._pubsub, self._kind, channel
                )
                return
            if message.get("type") == self._kind.subscribed:
                confirmed = self._confirmed.get(channel)  # type: ignore[arg-type]
                if confirmed is not None:
                    confirmed.set()
                    for event in self._followers:  # among them, the threads joining it
                        event.set()
                return
            if message.get("type") != self._kind.message:
                return
            waiters, grant = self._channels.addressees(channel, message.get("data"))  # type: ignore[arg-type]
            for waiter in waiters:
                waiter.ring(grant)

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            self._stop.set()
            pubsub, self._pubsub = self._pubsub, None
            thread = self._tending
            for event in self._followers:
                event.set()
        if pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                pubsub.close()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)


class _Hubs:
    """The subscription hubs of a sync store: one, or one per cluster node in use."""

    def __init__(self, locate: Locate, *, sharded: bool) -> None:
        self._locate = locate
        self._sharded = sharded
        self._mutex = threading.Lock()
        self._hubs: dict[str, _Subscriptions] = {}
        _FORK_AWARE.add(self)

    def _forked(self) -> None:
        """In a forked child: a fresh mutex (the hubs reset themselves)."""
        self._mutex = threading.Lock()

    def for_channel(self, channel: str) -> _Subscriptions:
        name, make_pubsub = self._locate(channel)
        with self._mutex:
            hub = self._hubs.get(name)
            if hub is None:
                hub = self._hubs[name] = _Subscriptions(make_pubsub, sharded=self._sharded)
            return hub

    def follow(self, master: tuple[str, int] | None) -> None:
        with self._mutex:
            hubs = list(self._hubs.values())
        for hub in hubs:
            hub.follow(master)

    def close(self) -> None:
        with self._mutex:
            hubs, self._hubs = list(self._hubs.values()), {}
        for hub in hubs:
            hub.close()


class _AsyncRedisWaiter(_Grantee):
    """A waiter of the async store: rung by the store's pub/sub reader task."""

    __slots__ = ("_bell", "hub", "on_close")

    def __init__(self, hub: _AsyncSubscriptions, channel: str) -> None:
        super().__init__(channel)
        self.hub = hub
        self._bell = LoopDoorbell()
        self.on_close: Callable[[], Awaitable[None]] | None = None

    def ring(self, grant: tuple[int, int] | None) -> None:
        if grant is not None:
            self.granted = grant
        self._bell.ring()

    async def wait(self, timeout: float) -> bool:
        return await self._bell.wait(timeout)

    async def aclose(self) -> None:
        on_close, self.on_close = self.on_close, None
        try:
            if on_close is not None:
                await on_close()
        finally:
            if self.subscribed:
                self.subscribed = False
                self.hub.leave(self)


class _AsyncSubscriptions:
    """One pub/sub connection per async store (per node in a cluster), read by one task.

    The same as ``_Subscriptions`` for asyncio: everything runs on the store's loop.
    """

    def __init__(self, make_pubsub: Callable[[], Any], *, sharded: bool) -> None:
        self._make_pubsub = make_pubsub
        self._kind = _SHARDED if sharded else _PLAIN
        self._mutex = asyncio.Lock()  # serialises subscribing, not the bookkeeping
        self._channels = _Channels()
        self._confirmed: dict[str, _AsyncConfirmation] = {}
        self._pubsub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._moved = False  # as in _Subscriptions

    def try_join(self, waiter: _AsyncRedisWaiter) -> bool:
        confirmed = self._confirmed.get(waiter.channel)
        if confirmed is None or not confirmed.is_set():
            return False
        self._channels.add(waiter.channel, waiter)
        waiter.subscribed = True
        return True

    async def join(self, waiter: _AsyncRedisWaiter, timeout: float) -> None:
        async with self._mutex:
            if self._closed:
                raise RuntimeError("this store is closed")
            self._channels.add(waiter.channel, waiter)
            confirmed = self._confirmed.get(waiter.channel)
            if confirmed is None:
                confirmed = self._confirmed[waiter.channel] = _AsyncConfirmation()
                try:
                    if self._pubsub is None:
                        self._pubsub = self._make_pubsub()
                    await getattr(self._pubsub, self._kind.subscribe)(waiter.channel)
                except BaseException:
                    self._channels.remove(waiter.channel, waiter)
                    self._confirmed.pop(waiter.channel, None)
                    raise
                if self._task is None:
                    self._task = asyncio.create_task(self._read(), name="keymutex-redis-pubsub")
        waiter.subscribed = True
        try:
            async with asyncio.timeout(timeout):
                await confirmed.wait()
        except TimeoutError:
            raise StoreError(
                f"Redis did not confirm the subscription within {timeout} s"
            ) from None
        if confirmed.refused is not None:
            raise _refused_subscription(waiter.channel, confirmed.refused)

    async def _refuse(self, refusal: Exception) -> None:
        """As ``_Subscriptions._refuse``."""
        refused = [channel for channel, c in self._confirmed.items() if not c.is_set()]
        for channel in refused:
            confirmed = self._confirmed.pop(channel)
            confirmed.refused = refusal
            confirmed.set()
        if refused:
            with contextlib.suppress(Exception):
                async with self._mutex:
                    await getattr(self._pubsub, self._kind.unsubscribe)(*refused)

    def leave(self, waiter: _AsyncRedisWaiter) -> None:
        if not self._closed:
            self._channels.remove(waiter.channel, waiter)

    def follow(self, master: tuple[str, int] | None) -> None:
        """As ``_Subscriptions.follow``: the reader task reconnects."""
        if self._closed or not _elsewhere(self._pubsub, master):
            return
        self._moved = True
        self._channels.ring_all()

    async def _read(self) -> None:
        failures = 0
        while not self._closed:
            try:
                if self._moved:  # not while join subscribes: under the mutex
                    async with self._mutex:
                        self._moved = False
                        _LOG.info("Redis has a new master: moving the pub/sub connection")
                        await self._pubsub.connection.disconnect()
                unused = self._channels.expired()
                for channel in unused:
                    self._confirmed.pop(channel, None)
                if unused:
                    async with self._mutex:
                        await getattr(self._pubsub, self._kind.unsubscribe)(*unused)
                message = await self._pubsub.get_message(timeout=0.5)
                failures = 0
            except redis.exceptions.ResponseError as exc:  # the connection is fine
                await self._refuse(exc)
                continue
            except Exception as exc:  # the driver's, or a socket closed under it by aclose()
                if self._closed:
                    return
                if not self._channels.waiters:  # as in _Subscriptions._retired
                    await self._retire(exc)
                    return
                failures += 1
                _LOG.warning("Redis pub/sub connection failed (%s); reconnecting", exc)
                await asyncio.sleep(min(1.0, 0.05 * 2**failures))
                continue
            if message is None:
                continue
            channel = message.get("channel")
            if message.get("type") == self._kind.subscribed:
                confirmed = self._confirmed.get(channel)
                if confirmed is not None:
                    confirmed.set()
            elif message.get("type") == self._kind.unsubscribed:  # see _unsubscribed_by_redis
                _unsubscribed_by_redis(
                    self._channels, self._confirmed, self._pubsub, self._kind, channel
                )
            elif message.get("type") == self._kind.message:
                waiters, grant = self._channels.addressees(channel, message.get("data"))
                for waiter in waiters:
                    waiter.ring(grant)

    async def _retire(self, failure: Exception) -> None:
        """As ``_Subscriptions._retired``, by the reader task, which then ends (``join``
        opens another connection and starts another reader)."""
        pubsub, self._pubsub, self._task = self._pubsub, None, None
        self._confirmed.clear()
        self._channels.idle.clear()
        _LOG.info("Redis pub/sub connection failed (%s); no waiter listens: closed", failure)
        with contextlib.suppress(RedisError, OSError):
            await pubsub.aclose()

    async def aclose(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        await stop_task(task)
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()


class _AsyncHubs:
    """The subscription hubs of an async store: one, or one per cluster node in use."""

    def __init__(
        self, locate: Callable[[str], Awaitable[tuple[str, Callable[[], Any]]]], *, sharded: bool
    ) -> None:
        self._locate = locate
        self._sharded = sharded
        self._hubs: dict[str, _AsyncSubscriptions] = {}

    async def for_channel(self, channel: str) -> _AsyncSubscriptions:
        name, make_pubsub = await self._locate(channel)
        hub = self._hubs.get(name)
        if hub is None:
            hub = self._hubs[name] = _AsyncSubscriptions(make_pubsub, sharded=self._sharded)
        return hub

    def follow(self, master: tuple[str, int] | None) -> None:
        for hub in list(self._hubs.values()):
            hub.follow(master)

    async def aclose(self) -> None:
        hubs, self._hubs = list(self._hubs.values()), {}
        for hub in hubs:
            await hub.aclose()


# -- the stores ----------------------------------------------------------------------

# Errors after which a connection is not reused: the reply may be half read.
_BROKEN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
# Of those, the ones after which Redis may have run the command: it was slow to answer,
# not gone. A step is never sent again after one (a release run twice says "not held").
_SLOW = (redis.exceptions.TimeoutError, TimeoutError)


def _not_a_lease(reply: Exception) -> bool:
    """Whether a script's error says a lease's key holds something else (foreign data)."""
    return isinstance(reply, redis.exceptions.ResponseError) and str(reply).startswith("WRONGTYPE")


def _lost_if_not_a_lease(exc: StoreError) -> Outcome:
    """A renewal whose lease key holds other data: lost (else ``exc`` is raised)."""
    if isinstance(exc.__cause__, Exception) and _not_a_lease(exc.__cause__):
        return Outcome(False, None)
    raise exc


def _pipelined(
    client: Any, calls: Sequence[_Call], indices: list[int], *, sourced: bool = False
) -> Any:
    """A pipeline of the scripts of ``calls[indices]`` on ``client``, not yet sent.

    ``sourced``: each script's first call carries its source (``EVAL``): the server
    keeps it, and the calls after it, on the same connection, find it by SHA."""
    pipe = client.pipeline(transaction=False)
    sent: set[_Script] = set()
    for index in indices:
        call = calls[index]
        first = call.script not in sent
        sent.add(call.script)
        pipe.execute_command(*call.command(sourced=sourced and first))
    return pipe


def _checked(answers: list[Any]) -> list[Any]:
    """A pipeline's answers; an error reply raised, but for a key that holds no lease."""
    for reply in answers:
        if isinstance(reply, Exception) and not _not_a_lease(reply):
            raise reply
    return answers


def _send_pipeline(
    client: Any, calls: Sequence[_Call], indices: list[int], *, sourced: bool = False
) -> list[Any]:
    pipe = _pipelined(client, calls, indices, sourced=sourced)
    return _checked(pipe.execute(raise_on_error=False))


async def _send_pipeline_async(
    client: Any, calls: Sequence[_Call], indices: list[int], *, sourced: bool = False
) -> list[Any]:
    pipe = _pipelined(client, calls, indices, sourced=sourced)
    return _checked(await pipe.execute(raise_on_error=False))


def _send_scripts(client: Any, calls: Sequence[_Call], indices: list[int]) -> list[Any]:
    """``_send_pipeline``, sent again with the scripts' source to a node that lacks them.

    The source goes in the pipeline itself (``sourced``), as a single step sends it,
    not loaded first through the client's pool (``SCRIPT LOAD``): one round trip
    fewer, and no permission needed beyond ``EVAL``/``EVALSHA``. (A renewal run twice,
    the first time answered before the ``NOSCRIPT``, answers alike.)"""
    try:
        return _send_pipeline(client, calls, indices)
    except NoScriptError:
        return _send_pipeline(client, calls, indices, sourced=True)


async def _send_scripts_async(
    client: Any, calls: Sequence[_Call], indices: list[int]
) -> list[Any]:
    """``_send_scripts`` for ``redis.asyncio``."""
    try:
        return await _send_pipeline_async(client, calls, indices)
    except NoScriptError:
        return await _send_pipeline_async(client, calls, indices, sourced=True)


@dataclass(frozen=True, slots=True)
class _Unanswered:
    """A renewal of a batch whose cluster node could not be reached (``error``)."""

    error: BaseException


def _renewed(calls: Sequence[_Call], replies: Sequence[Any]) -> list[Outcome]:
    """The outcomes of a batch of renewals. A lease whose key holds something else (a
    WRONGTYPE error) is not there: lost, without failing the others of the batch. Those
    of a node that could not be reached are unknown: ``PartialRenewal``, carrying the
    others' outcomes."""
    outcomes = [
        None
        if isinstance(reply, _Unanswered)
        else Outcome(False, None)
        if isinstance(reply, Exception)
        else call.read(call.key, reply)
        for call, reply in zip(calls, replies, strict=True)
    ]
    unanswered = [reply.error for reply in replies if isinstance(reply, _Unanswered)]
    if unanswered:
        raise PartialRenewal(
            f"Redis renewal of {len(unanswered)} of {len(calls)} leases failed: {unanswered[0]}",
            outcomes,
        ) from unanswered[0]
    return cast(list[Outcome], outcomes)


def _gather(
    groups: Sequence[tuple[str, Any, list[int]]],
    answers: Mapping[int, dict[int, Any] | Exception],
    replies: list[Any],
    within: float,
) -> None:
    """Put each node's replies (``answers``, by the node's number in ``groups``) in
    their places in ``replies``; a node that has not answered fails its calls."""
    for number, (_, _, indices) in enumerate(groups):
        answer = answers.get(number)
        if isinstance(answer, Exception):
            raise answer
        if answer is None:
            late = TimeoutError(f"no answer within {within:g} s (a third of the shortest TTL)")
            for index in indices:
                replies[index] = _Unanswered(late)
            continue
        for index, reply in answer.items():
            replies[index] = reply


def _silent_nodes(
    groups: Sequence[tuple[str, Any, list[int]]], replies: Sequence[Any]
) -> list[str]:
    """The nodes of a cluster batch that left some of its calls unanswered."""
    return [
        name
        for name, _, indices in groups
        if any(isinstance(replies[index], _Unanswered) for index in indices)
    ]


# Connections of a pool limited by ``max_connections`` that a store leaves in it, idle,
# for what goes through redis-py's own path: the pub/sub connection, a renewal's
# pipeline, ``holder``/``holders``, loading the scripts again.
POOL_RESERVE = 2


def _kept_at_most(pool: Any) -> int | None:
    """How many idle connections ``_Connections`` may keep out of ``pool``: any number,
    unless the user limited the pool (``max_connections``; redis-py's default is
    2**31), then all but ``POOL_RESERVE``. Found by review: with ``max_connections=2``,
    two acquires at once once left both connections kept idle here, and every renewal
    (the lease was lost), ``holder()`` and pub/sub failed with "Too many connections"
    from then on."""
    limit = getattr(pool, "max_connections", None)
    if not isinstance(limit, int) or limit >= 2**31:
        return None
    return max(0, limit - POOL_RESERVE)


class _Connections:
    """Connections held out of redis-py's pool, for the scripts of one sync store.

    A step is a write and a read on a connection already in hand: redis-py's
    per-command pool checkout and retry machinery cost about as much as the round trip
    on loopback. A connection that fails is dropped. A step whose connection, used
    before, turned out closed (by the server, while idle) is tried once more on a new
    one; one that timed out is not: Redis may have run it, and a release or a queueing
    try run twice would be answered wrongly the second time. A pool limited by
    ``max_connections`` keeps some of its connections (``_kept_at_most``).

    A step answered ``READONLY`` is tried once more, on a new connection, after every
    idle connection is dropped (``drop_idle``): its server became a replica. Found by
    review: a ``redis://`` URL whose name or address moved to a new master (a DNS
    name, a virtual IP) kept its connections to the old one, now a replica, and every
    step failed with ``READONLY`` until they broke. Safe to send again: a replica
    refuses a script's first write, so the step changed nothing (it is not counted in
    ``resent``), and sent again it checks the token anew. A second ``READONLY`` is
    raised (see ``_still_a_replica``). A Sentinel store never sees one: redis-py's Sentinel
    connection turns it into a ``ConnectionError`` (the previous master is now a
    replica), and the pool asks the sentinels again.
    """

    def __init__(self, pool: Any, on_moved: Callable[[], None]) -> None:
        self._pool = pool
        self._on_moved = on_moved  # told at a READONLY (``drop_idle``)
        self._free: list[Any] = []  # list.append / pop are atomic: no lock needed
        self._pid = os.getpid()
        self._kept_at_most = _kept_at_most(pool)
        self._keeping = threading.Lock()  # with a limit: the count and the append together
        self._closed = False

    def _keep(self, conn: Any) -> None:
        """Keep ``conn`` for the next step, or give it back to the pool (see there).

        After ``close()``, disconnected: a step that ended then (its connection closed
        under it, and the step tried again on a new one) kept a connection that nothing
        would close."""
        if self._closed:
            conn.disconnect()
            self._pool.release(conn)
            return
        if self._kept_at_most is None:
            self._free.append(conn)
            return
        with self._keeping:
            kept = len(self._free) < self._kept_at_most
            if kept:
                self._free.append(conn)
        if not kept:
            self._pool.release(conn)

    def call(
        self, *args: Any, resent: list[bool] | None = None, after_read_only: bool = False
    ) -> Any:
        """Send a command and read its reply. ``resent``: told (``True`` appended) when
        the command went out whole before the connection broke, and was sent again.
        ``after_read_only``: this is the try after a ``READONLY``, on a new connection."""
        if self._pid != os.getpid():  # forked: the parent's sockets are not ours
            self._free, self._pid = [], os.getpid()
        try:
            if after_read_only:  # the pool's idle connections were dropped: made anew
                conn, used = self._pool.get_connection(), False
            else:
                conn, used = self._free.pop(), True
        except IndexError:
            conn, used = self._pool.get_connection(), False
        sent = False
        try:
            conn.send_command(*args)
            sent = True
            reply = conn.read_response()
        except redis.exceptions.ReadOnlyError:
            conn.disconnect()
            self._pool.release(conn)
            if after_read_only:
                raise
            self.drop_idle()
            return self.call(*args, resent=resent, after_read_only=True)
        except redis.exceptions.ResponseError:
            self._keep(conn)  # an error reply: the connection is fine
            raise
        except _BROKEN as exc:
            conn.disconnect()
            self._pool.release(conn)
            if not used or isinstance(exc, _SLOW):
                raise
            if sent and resent is not None:
                resent.append(True)
            return self.call(*args)
        except BaseException:
            conn.disconnect()
            self._pool.release(conn)
            raise
        self._keep(conn)
        return reply

    def follow(self, master: tuple[str, int]) -> None:
        """Drop the free connections to another node than ``master`` (a Sentinel
        failover): the next steps connect to the master. (One in use now is dropped by
        a later check.) Safe while other threads take and give back connections."""
        self._drop_free(lambda conn: (conn.host, conn.port) != master)

    def drop_idle(self) -> None:
        """Disconnect every idle connection, kept here or in the pool: their server
        answered ``READONLY`` (it is a replica now), and a new connection to the same
        address may reach the new master. (One in use now meets ``READONLY`` itself.)"""
        self._on_moved()
        self._drop_free(lambda conn: True)
        self._pool.disconnect(inuse_connections=False)

    def _drop_free(self, dropped: Callable[[Any], bool]) -> None:
        if self._pid != os.getpid():
            return
        for conn in [c for c in self._free if dropped(c)]:
            try:
                self._free.remove(conn)
            except ValueError:  # taken meanwhile
                continue
            conn.disconnect()
            self._pool.release(conn)

    def close(self) -> None:
        self._closed = True
        free, self._free = self._free, []
        if self._pid == os.getpid():
            for conn in free:
                self._pool.release(conn)


async def _send(conn: Any, args: tuple[Any, ...]) -> None:
    """Send one command on a ``redis.asyncio`` connection.

    redis-py guards each write with ``asyncio.wait_for(drain, socket_timeout)``: on
    Python 3.11 a task and two turns of the event loop per command, for a write that
    cannot block when nothing is buffered (the usual case: one small command in flight
    per connection). That write is done here; the timed, redis-py way stays for a
    write that did not go out at once, and for whatever this does not know how to
    handle (no stream yet, health checks).
    """
    writer = getattr(conn, "_writer", None)
    if writer is None or conn.health_check_interval:
        await conn.send_command(*args)
        return
    writer.writelines(conn.pack_command(*args))
    if writer.transport.get_write_buffer_size():  # the socket is full: wait, timed
        await asyncio.wait_for(writer.drain(), conn.socket_timeout)
    else:
        await writer.drain()  # does not wait; raises if the connection was lost


class _AsyncConnections:
    """``_Connections`` for an async store (connections of ``redis.asyncio``)."""

    def __init__(self, pool: Any, on_moved: Callable[[], None]) -> None:
        self._pool = pool
        self._on_moved = on_moved  # as in _Connections
        self._free: list[Any] = []
        self._kept_at_most = _kept_at_most(pool)
        self._closed = False

    async def _keep(self, conn: Any) -> None:
        """As ``_Connections._keep`` (one event loop: no lock needed)."""
        if self._closed:
            await conn.disconnect()
            await self._pool.release(conn)
        elif self._kept_at_most is None or len(self._free) < self._kept_at_most:
            self._free.append(conn)
        else:
            await self._pool.release(conn)

    async def call(
        self, *args: Any, resent: list[bool] | None = None, after_read_only: bool = False
    ) -> Any:
        try:
            if after_read_only:  # as in _Connections.call
                conn, used = await self._pool.get_connection(), False
            else:
                conn, used = self._free.pop(), True
        except IndexError:
            conn, used = await self._pool.get_connection(), False
        try:
            await _send(conn, args)
            reply = await conn.read_response()
        except redis.exceptions.ReadOnlyError:
            await conn.disconnect()
            await self._pool.release(conn)
            if after_read_only:
                raise
            await self.drop_idle()
            return await self.call(*args, resent=resent, after_read_only=True)
        except redis.exceptions.ResponseError:
            await self._keep(conn)
            raise
        except _BROKEN as exc:
            await conn.disconnect()
            await self._pool.release(conn)
            if not used or isinstance(exc, _SLOW):
                raise
            if resent is not None:  # a failed drain may follow a write that went out
                resent.append(True)
            return await self.call(*args)
        except BaseException:  # cancelled mid-step: the reply may be on its way
            await asyncio.shield(conn.disconnect())
            await asyncio.shield(self._pool.release(conn))
            raise
        await self._keep(conn)
        return reply

    async def follow(self, master: tuple[str, int]) -> None:
        """As ``_Connections.follow``."""
        stale = [c for c in self._free if (c.host, c.port) != master]
        self._free = [c for c in self._free if (c.host, c.port) == master]
        for conn in stale:
            await conn.disconnect()
            await self._pool.release(conn)

    async def drop_idle(self) -> None:
        """As ``_Connections.drop_idle``."""
        self._on_moved()
        stale, self._free = self._free, []
        for conn in stale:
            await conn.disconnect()
            await self._pool.release(conn)
        await self._pool.disconnect(inuse_connections=False)

    async def aclose(self) -> None:
        self._closed = True
        free, self._free = self._free, []
        for conn in free:
            await self._pool.release(conn)


class _NodeClients:
    """Where a batch of calls goes: all to the client, or per cluster node.

    redis-py refuses scripts in a cluster pipeline, so a cluster's batch is split by
    the node that owns each key and sent as one plain pipeline per node.
    """

    def __init__(self, open_node: Callable[[str, int], Any] | None) -> None:
        self._open_node = open_node
        self._clients: dict[str, Any] = {}
        # Renewals of a batch left to end on its own may split the next batch meanwhile.
        self._lock = threading.Lock()
        self._closed = False

    def split(self, client: Any, calls: Sequence[_Call]) -> list[tuple[str, Any, list[int]]]:
        """The calls by node: (the node's name, its client, the calls' indices)."""
        if self._open_node is None:
            return [("", client, list(range(len(calls))))]
        groups: dict[str, list[int]] = {}
        opened: dict[str, Any] = {}
        for index, call in enumerate(calls):
            node = client.get_node_from_key(call.keys[0])
            if node.name not in opened:
                opened[node.name] = self._node(node.name, node.host, node.port)
            groups.setdefault(node.name, []).append(index)
        return [(name, opened[name], indices) for name, indices in groups.items()]

    def _node(self, name: str, host: str, port: int) -> Any:
        assert self._open_node is not None
        with self._lock:
            if self._closed:  # found by review: a call left running opened clients again
                raise redis.exceptions.ConnectionError("this Redis store is closed")
            if name not in self._clients:
                self._clients[name] = self._open_node(host, port)
            return self._clients[name]

    def opened(self) -> list[Any]:
        """The node clients opened so far, to close: no more are opened after this."""
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        return clients

    def clients(self) -> list[Any]:
        with self._lock:
            return list(self._clients.values())


# RedisClusterException (no nodes reachable, slots not covered) is not a RedisError.
_DRIVER_ERRORS = (RedisError, RedisClusterException, OSError)


# redis-py's cluster clients send a command again after these errors. Not after a
# timeout here: Redis may have run the command (a release run twice says "not held").
# After the others (a refused or broken connection, a cluster that is down, a slot
# nobody serves) they still do: harmless for every step but a release (see _ONCE).
_CLUSTER_RETRY = tuple(
    error
    for error in redis.cluster.RedisCluster.ERRORS_ALLOW_RETRY
    if not issubclass(error, _SLOW)
)


# _ONCE: a release on a cluster goes to the node of its key's slot (target_nodes): redis-py
# then sends it once (following MOVED and ASK, which nothing ran), and a connection that
# breaks after it went out is a StoreError, outcome unknown: sent again, a release that
# had released says "not held". Other steps run twice answer alike, and are resent.


class _Cluster(redis.cluster.RedisCluster):
    """redis-py's sync cluster client, but a command that timed out is not sent again."""

    ERRORS_ALLOW_RETRY = _CLUSTER_RETRY  # type: ignore[assignment]


class _AsyncCluster(redis.asyncio.cluster.RedisCluster):
    """redis-py's async cluster client, but a command that timed out is not sent again."""

    ERRORS_ALLOW_RETRY = _CLUSTER_RETRY  # type: ignore[assignment]


class _LazyCluster:
    """A sync ``RedisCluster``, made at its first use rather than in ``Locks()``.

    redis-py's constructor connects to the startup nodes to learn the slots: made
    eagerly, an unreachable cluster would fail ``Locks()`` with redis-py's own
    exception. Made here, the failure comes from a store step, as a ``StoreError``
    (every use of the client is inside ``translate_errors``); the next step tries again.
    """

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._client: Any = None
        self._lock = threading.Lock()
        self._closed = False

    def _get(self) -> Any:
        client = self._client
        if client is None:
            with self._lock:
                if self._closed:
                    # Found by review: a renewal left to end on its own, failing as the
                    # store closed, made a new client (its connections never closed).
                    raise redis.exceptions.ConnectionError("this Redis store is closed")
                if self._client is None:
                    self._client = self._make()
                client = self._client
        return client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _step_name(call: _Call) -> str:
    return f"Redis {call.script.name} of {call.key!r}"


def _sender(
    client: Any, conns: _Connections | _AsyncConnections | None, call: _Call, resent: list[bool]
) -> Callable[..., Any]:
    """What sends ``call``'s command: the store's own connections (noting in ``resent``
    a command sent again), else the cluster client; a cluster release to its key's node,
    so that it is sent once (_ONCE)."""
    if conns is not None:
        return functools.partial(conns.call, resent=resent)
    if call.script is _RELEASE:
        node = client.get_node_from_key(call.keys[0])
        return functools.partial(client.execute_command, target_nodes=node)
    send: Callable[..., Any] = client.execute_command
    return send


def _still_a_replica(what: str, exc: redis.exceptions.ReadOnlyError) -> StoreError:
    """A step answered ``READONLY`` on a connection made anew too (see ``_Connections``)."""
    return StoreError(
        f"{what}: Redis answered READONLY, and again on a new connection: the server this"
        " URL leads to is a replica. A redis:// or rediss:// URL must lead to a master (one"
        " whose name or address moves to the new master in a failover has not moved yet;"
        f" for Sentinel use redis+sentinel://): {exc}"
    )


def _read_once_more(call: _Call, reply: Any, resent: list[bool]) -> Outcome:
    """``call``'s outcome from ``reply``. A release sent again after its connection broke
    with the first one out (Redis may have run it) that finds the lease gone cannot tell
    whether the first released it or it was lost before: not ``LockLost``, unknown."""
    outcome = call.read(call.key, reply)
    if resent and call.script is _RELEASE and not outcome.ok:
        raise StoreError(
            f"{_step_name(call)}: the connection broke after the release was sent; sent"
            " again, it found the lease gone: released by the first, or lost before it"
            " (outcome unknown)"
        )
    return outcome


class RedisStore:
    """The Redis store for one namespace (sync, on redis-py)."""

    capabilities = CAPABILITIES

    def __init__(
        self,
        client: Any,
        locate: Locate,
        layout: _Layout,
        nodes: _NodeClients | None = None,
        also_close: Sequence[Any] = (),
    ) -> None:
        self._client = client
        self._also_close = also_close
        self._nodes = nodes or _NodeClients(None)
        # A cluster routes each script by its key: redis-py's own path does that.
        self._conns = None if layout.sharded else _Connections(client.connection_pool, self._moved)
        self._steps = _Steps(layout)
        self._layout = layout
        self._hubs = _Hubs(locate, sharded=layout.sharded)
        self._subscribe_timeout = DEFAULT_SOCKET_TIMEOUT
        self._reading_slots = threading.Lock()  # held while _read_slots_again reads
        _FORK_AWARE.add(self)

    def _moved(self) -> None:
        """A step met ``READONLY``: the URL's address leads to a new master now (see
        ``_Connections``). The pub/sub connections, still to the old one, move too
        (their waiters try again at once), and from now on a waiter confirms a grant it
        hears (``_Layout.confirms_grants``). Found by review: a waiter listening on the
        old master, now a replica, heard the new master's grant that PUBLISH had not
        counted, and that the release had therefore taken back, and took it (a second
        holder). A waiter of another process that has met no ``READONLY`` is not told:
        see the module's docstring."""
        self._layout.confirms_grants = True
        self._hubs.follow(None)

    def _forked(self) -> None:
        """In a forked child: redis-py's pools reset themselves at their first use there,
        under their own lock; one that a parent's thread held at the fork stays held for
        good (redis-py 8: 7 children in 48 hung in their first acquire). Fresh locks."""
        clients = [self._client, *self._nodes.clients()]
        if isinstance(self._client, _LazyCluster):
            self._client._lock = threading.Lock()
            made = self._client._client
            nodes = made.get_nodes() if made is not None else []
            clients = [node.redis_connection for node in nodes] + clients[1:]
        for client in clients:
            pool = getattr(client, "connection_pool", None)
            if pool is not None and hasattr(pool, "_lock"):
                pool._lock = threading.Lock()
        self._reading_slots = threading.Lock()  # the parent's read is not running here

    def _run(self, call: _Call) -> Outcome:
        resent: list[bool] = []
        try:
            # (A cluster client is made here, at its first use: see _LazyCluster.)
            reply = _scripted(_sender(self._client, self._conns, call, resent), call)
        except _DRIVER_ERRORS as exc:
            if isinstance(exc, redis.exceptions.ReadOnlyError) and self._conns is not None:
                raise _still_a_replica(_step_name(call), exc) from exc
            # Translated by the one translator, entered only on failure: on every step
            # it cost about as much as the rest of this method.
            with translate_errors(*_DRIVER_ERRORS, what=_step_name(call)):
                raise
        return _read_once_more(call, reply, resent)

    def try_acquire(
        self,
        key: str,
        *,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: Any,
    ) -> Outcome:
        assert waiter is None or isinstance(waiter, _RedisWaiter)
        if waiter is None:
            return self._run(self._steps.acquire(key, token, ttl, owner, info, steal, None))
        flow = self._steps.contend(key, token, ttl, owner, info, steal, waiter)
        try:
            step = next(flow)
            while True:
                if step is None:
                    with translate_errors(*_DRIVER_ERRORS, what=f"Redis subscription for {key!r}"):
                        if self._layout.sharded:
                            # On the node that serves the channel's slot now: the try
                            # just made followed a failover or a resharding, if any.
                            waiter.hub = self._hubs.for_channel(waiter.channel)
                        waiter.hub.join(waiter, self._subscribe_timeout)
                    step = flow.send(None)
                else:
                    step = flow.send(self._run(step))
        except StopIteration as done:
            outcome: Outcome = done.value
        except BaseException:
            if waiter.entry and waiter.on_close is None:
                # The try that carried our queue entry failed, but Redis may have run
                # it: leave the queue on close, or a release would hand the key to
                # an acquire that is gone (LEAVE gives back a grant it finds).
                waiter.on_close = functools.partial(self._leave, key, token, waiter.entry)
            raise
        waiter.on_close = (
            None if outcome.ok else functools.partial(self._leave, key, token, waiter.entry)
        )
        return outcome

    def _leave(self, key: str, token: str, entry: str) -> None:
        try:
            self._run(self._steps.leave(key, token, entry))
        except StoreError as exc:  # its queue entry expires; a hand-over to it lapses
            _LOG.warning("could not leave the queue of %r: %s", key, exc)

    def renew(self, key: str, token: str, ttl: float) -> Outcome:
        try:
            return self._run(self._steps.renew(RenewRequest(key, token, ttl)))
        except StoreError as exc:
            return _lost_if_not_a_lease(exc)

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        if not requests:
            return []
        calls = [self._steps.renew(request) for request in requests]
        within = min(request.ttl for request in requests) / 3
        with translate_errors(*_DRIVER_ERRORS, what=f"Redis renewal of {len(calls)} leases"):
            replies = self._pipeline(calls, within)
        return _renewed(calls, replies)

    def _pipeline(self, calls: Sequence[_Call], within: float) -> list[Any]:
        """The replies of ``calls``, sent as one pipeline per node. A node that lacks the
        script (restarted, flushed, or never asked) is given it and asked again; one
        that cannot be reached fails its own calls alone (``_Unanswered``).

        In a cluster, each node's pipeline goes at once, on a thread of its own (one
        node's alone too), and is waited for ``within`` seconds at most (a third of the shortest
        TTL renewed): a node that has not answered by then fails its own calls, and the
        others' replies come back. Found by review: a paused master (``kill -STOP``, a
        hung host) held every other node's renewals of the batch up for its
        ``socket_timeout`` (the nodes were asked one after the other), and leases with a
        shorter TTL on masters that answered were lost. (The client's renewer, which
        then made one call at a time, no longer waits for a slow call to start the
        next.)
        """
        replies: list[Any] = [None] * len(calls)
        groups = list(self._nodes.split(self._client, calls))
        if not self._layout.sharded:  # one server: nobody else to hold up, no thread
            ((_, client, indices),) = groups
            answers: Mapping[int, dict[int, Any] | Exception] = {
                0: self._on_node(client, calls, indices)
            }
        else:  # found by review: a batch of one node's leases held a renewer thread too
            answers = each_within(
                {
                    number: functools.partial(self._on_node, client, calls, indices)
                    for number, (_, client, indices) in enumerate(groups)
                },
                within,
                name="keymutex-redis-renew",
            )
        _gather(groups, answers, replies, within)
        if self._layout.sharded:
            for name in _silent_nodes(groups, replies):
                self._read_slots_again(name)
        return replies

    def _read_slots_again(self, silent: str) -> None:
        """Have the cluster client read the slot map again, on a thread of its own,
        asking the node ``silent`` last: a master that stopped answering may have been
        failed over, and the next try of its leases' renewals must go to the node that
        serves their slots now.

        Found by review: renewals are sent by the slot map of the cluster client, which
        reads it again after a refused connection or a ``MOVED``, never after a node
        went silent (paused, hung, partitioned): a renewing holder whose master hung
        sent every renewal there, its lease expired unrenewed on the promoted replica,
        and it was lost although the new master had been serving for seconds. One read
        at a time."""
        if not self._reading_slots.acquire(blocking=False):
            return

        def read() -> None:
            try:
                manager = self._client.nodes_manager
                manager.initialize(last_failed_node_name=silent)  # asked for the map last
            except Exception as exc:  # the next renewal tries again
                _LOG.debug("could not read the Redis cluster's slots again: %s", exc)
            finally:
                self._reading_slots.release()

        try:
            threading.Thread(target=read, name="keymutex-redis-slots", daemon=True).start()
        except RuntimeError:  # no thread to be had (the interpreter is exiting)
            self._reading_slots.release()

    def _on_node(self, client: Any, calls: Sequence[_Call], indices: list[int]) -> dict[int, Any]:
        """The replies of ``calls[indices]``, all of one node, by index."""
        try:
            try:
                answers = _send_scripts(client, calls, indices)
            except redis.exceptions.ReadOnlyError:
                if self._conns is None:
                    raise
                self._conns.drop_idle()  # and once more: see _Connections
                answers = _send_scripts(client, calls, indices)
            return dict(zip(indices, answers, strict=True))
        except _DRIVER_ERRORS as exc:
            if not self._layout.sharded:
                if isinstance(exc, redis.exceptions.ReadOnlyError):
                    raise _still_a_replica(f"Redis renewal of {len(indices)} leases", exc) from exc
                raise
            if isinstance(exc, (redis.exceptions.TimeoutError, TimeoutError)):
                # A node that does not answer (paused, partitioned) still owns its slots:
                # asked again one call at a time, it would take a timeout each (found by
                # review: 5 s per lease, on a thread of the renewer's all along).
                return {index: _Unanswered(exc) for index in indices}
            # The node failed or gave its slots away (a failover): one call each
            # through the cluster client, which follows MOVED and learns the new
            # owners for the next tick. A new owner (a promoted replica) may lack
            # the script: sent its source at once, routed by the key as the EVALSHA
            # was (a failover can take most of a lease's TTL already). One that fails
            # fails its lease alone.
            replies: dict[int, Any] = {}
            for index in indices:
                try:
                    replies[index] = _scripted(self._client.execute_command, calls[index])
                except _DRIVER_ERRORS as exc:
                    replies[index] = _Unanswered(exc)
            return replies

    def release(self, key: str, token: str) -> Outcome:
        return self._run(self._steps.release(key, token))

    def holder(self, key: str) -> Holder | None:
        name = self._layout.lease(key)
        with translate_errors(*_DRIVER_ERRORS, what=f"Redis read of {key!r}"):
            pipe = self._client.pipeline(transaction=False)
            _queue_reads(pipe, [name])
            found = _read_holders([key], pipe.execute())
        return found[0] if found else None

    def holders(self, prefix: str) -> list[Holder]:
        layout = self._layout
        with translate_errors(*_DRIVER_ERRORS, what=f"Redis scan of {prefix!r}"):
            names = {
                name: key
                for name in self._client.scan_iter(match=layout.pattern(prefix), count=SCAN_COUNT)
                if (key := layout.listed(name, prefix)) is not None
            }
            found: list[Holder] = []
            for batch, keys in _batches(names):
                pipe = self._client.pipeline(transaction=False)
                _queue_reads(pipe, batch)
                found += _read_holders(keys, pipe.execute())
        return found

    def waiter(self, key: str) -> _RedisWaiter:
        channel = self._layout.channel(key)
        try:
            hub = self._hubs.for_channel(channel)
        except _DRIVER_ERRORS:  # as in _run
            with translate_errors(*_DRIVER_ERRORS, what=f"Redis node of {key!r}"):
                raise
        return _RedisWaiter(hub, channel)

    def close(self) -> None:
        self._hubs.close()
        if self._conns is not None:
            self._conns.close()
        with contextlib.suppress(*_DRIVER_ERRORS):
            for client in [*self._nodes.opened(), *self._also_close]:
                client.close()
            self._client.close()


class AsyncRedisStore:
    """The Redis store for one namespace (asyncio, on ``redis.asyncio``)."""

    # Its connections belong to the event loop that made them: an AsyncLocks used by
    # one loop after another opens a store of its own in each (_store.StoreOfTheLoop).
    loop_bound = True

    capabilities = CAPABILITIES

    def __init__(
        self,
        client: Any,
        locate: Callable[[str], Awaitable[tuple[str, Callable[[], Any]]]],
        layout: _Layout,
        nodes: _NodeClients | None = None,
        also_close: Sequence[Any] = (),
    ) -> None:
        self._client = client
        self._also_close = also_close
        self._nodes = nodes or _NodeClients(None)
        self._left: set[asyncio.Future[Any]] = (
            set()
        )  # node renewals left to end (each_within_async)
        self._conns = (
            None if layout.sharded else _AsyncConnections(client.connection_pool, self._moved)
        )
        self._steps = _Steps(layout)
        self._layout = layout
        self._hubs = _AsyncHubs(locate, sharded=layout.sharded)
        self._subscribe_timeout = DEFAULT_SOCKET_TIMEOUT
        self._reading_slots: asyncio.Task[None] | None = None  # see _read_slots_again

    def _moved(self) -> None:
        """As ``RedisStore._moved``."""
        self._layout.confirms_grants = True
        self._hubs.follow(None)

    async def _run(self, call: _Call) -> Outcome:
        resent: list[bool] = []
        try:
            if self._conns is None and call.script is _RELEASE:
                await self._client.initialize()  # learns the slots once; a no-op afterwards
            send = _sender(self._client, self._conns, call, resent)
            reply = await _scripted_async(send, call)
        except _DRIVER_ERRORS as exc:  # as in RedisStore
            if isinstance(exc, redis.exceptions.ReadOnlyError) and self._conns is not None:
                raise _still_a_replica(_step_name(call), exc) from exc
            with translate_errors(*_DRIVER_ERRORS, what=_step_name(call)):
                raise
        return _read_once_more(call, reply, resent)

    async def try_acquire(
        self,
        key: str,
        *,
        token: str,
        ttl: float,
        owner: str,
        info: dict[str, Any] | None,
        steal: bool,
        waiter: Any,
    ) -> Outcome:
        assert waiter is None or isinstance(waiter, _AsyncRedisWaiter)
        if waiter is None:
            return await self._run(self._steps.acquire(key, token, ttl, owner, info, steal, None))
        flow = self._steps.contend(key, token, ttl, owner, info, steal, waiter)  # as in RedisStore
        try:
            step = next(flow)
            while True:
                if step is None:
                    with translate_errors(*_DRIVER_ERRORS, what=f"Redis subscription for {key!r}"):
                        if self._layout.sharded:  # as in RedisStore
                            waiter.hub = await self._hubs.for_channel(waiter.channel)
                        await waiter.hub.join(waiter, self._subscribe_timeout)
                    step = flow.send(None)
                else:
                    step = flow.send(await self._run(step))
        except StopIteration as done:
            outcome: Outcome = done.value
        except BaseException:
            if waiter.entry and waiter.on_close is None:  # as in RedisStore
                waiter.on_close = functools.partial(self._leave, key, token, waiter.entry)
            raise
        waiter.on_close = (
            None if outcome.ok else functools.partial(self._leave, key, token, waiter.entry)
        )
        return outcome

    async def _leave(self, key: str, token: str, entry: str) -> None:
        try:
            await self._run(self._steps.leave(key, token, entry))
        except StoreError as exc:
            _LOG.warning("could not leave the queue of %r: %s", key, exc)

    async def renew(self, key: str, token: str, ttl: float) -> Outcome:
        try:
            return await self._run(self._steps.renew(RenewRequest(key, token, ttl)))
        except StoreError as exc:
            return _lost_if_not_a_lease(exc)

    async def renew_many(self, requests: Sequence[RenewRequest]) -> list[Outcome]:
        if not requests:
            return []
        calls = [self._steps.renew(request) for request in requests]
        within = min(request.ttl for request in requests) / 3
        with translate_errors(*_DRIVER_ERRORS, what=f"Redis renewal of {len(calls)} leases"):
            replies = await self._pipeline(calls, within)
        return _renewed(calls, replies)

    async def _pipeline(self, calls: Sequence[_Call], within: float) -> list[Any]:
        """As ``RedisStore._pipeline``: each node's pipeline at once, waited for
        ``within`` seconds at most when there are several."""
        if self._layout.sharded:
            await self._client.initialize()
        replies: list[Any] = [None] * len(calls)
        groups = list(self._nodes.split(self._client, calls))
        if not self._layout.sharded:  # one server: nobody else to hold up
            ((_, client, indices),) = groups
            answers: Mapping[int, dict[int, Any] | Exception] = {
                0: await self._on_node(client, calls, indices)
            }
        else:
            answers = await each_within_async(
                {
                    number: functools.partial(self._on_node, client, calls, indices)
                    for number, (_, client, indices) in enumerate(groups)
                },
                within,
                self._left,
            )
        _gather(groups, answers, replies, within)
        if self._layout.sharded:
            for name in _silent_nodes(groups, replies):
                self._read_slots_again(name)
        return replies

    def _read_slots_again(self, silent: str) -> None:
        """As ``RedisStore._read_slots_again``: a task of the store's loop, left to end
        (``aclose`` cancels it)."""
        if self._reading_slots is not None and not self._reading_slots.done():
            return

        async def read() -> None:
            try:
                manager = self._client.nodes_manager
                await manager.initialize(last_failed_node_name=silent)  # asked for the map last
            except Exception as exc:  # the next renewal tries again
                _LOG.debug("could not read the Redis cluster's slots again: %s", exc)

        task = self._reading_slots = asyncio.create_task(read(), name="keymutex-redis-slots")
        self._left.add(task)
        task.add_done_callback(self._left.discard)

    async def _on_node(
        self, client: Any, calls: Sequence[_Call], indices: list[int]
    ) -> dict[int, Any]:
        """As ``RedisStore._on_node``."""
        try:
            try:
                answers = await _send_scripts_async(client, calls, indices)
            except redis.exceptions.ReadOnlyError:
                if self._conns is None:
                    raise
                await self._conns.drop_idle()
                answers = await _send_scripts_async(client, calls, indices)
            return dict(zip(indices, answers, strict=True))
        except _DRIVER_ERRORS as exc:
            if not self._layout.sharded:
                if isinstance(exc, redis.exceptions.ReadOnlyError):
                    raise _still_a_replica(f"Redis renewal of {len(indices)} leases", exc) from exc
                raise
            if isinstance(exc, (redis.exceptions.TimeoutError, TimeoutError)):
                return {index: _Unanswered(exc) for index in indices}  # as RedisStore's
            replies: dict[int, Any] = {}
            for index in indices:  # as in RedisStore._on_node
                send = self._client.execute_command
                try:
                    replies[index] = await _scripted_async(send, calls[index])
                except _DRIVER_ERRORS as exc:
                    replies[index] = _Unanswered(exc)
            return replies

    async def release(self, key: str, token: str) -> Outcome:
        return await self._run(self._steps.release(key, token))

    async def holder(self, key: str) -> Holder | None:
        name = self._layout.lease(key)
        with translate_errors(*_DRIVER_ERRORS, what=f"Redis read of {key!r}"):
            pipe = self._client.pipeline(transaction=False)
            _queue_reads(pipe, [name])
            found = _read_holders([key], await pipe.execute())
        return found[0] if found else None

    async def holders(self, prefix: str) -> list[Holder]:
        layout = self._layout
        with translate_errors(*_DRIVER_ERRORS, what=f"Redis scan of {prefix!r}"):
            if layout.sharded:  # a cluster client scans the nodes it knows of
                await self._client.initialize()
            names = {
                name: key
                async for name in self._client.scan_iter(
                    match=layout.pattern(prefix), count=SCAN_COUNT
                )
                if (key := layout.listed(name, prefix)) is not None
            }
            found: list[Holder] = []
            for batch, keys in _batches(names):
                pipe = self._client.pipeline(transaction=False)
                _queue_reads(pipe, batch)
                found += _read_holders(keys, await pipe.execute())
        return found

    async def waiter(self, key: str) -> _AsyncRedisWaiter:
        channel = self._layout.channel(key)
        try:
            hub = await self._hubs.for_channel(channel)
        except _DRIVER_ERRORS:  # as in _run
            with translate_errors(*_DRIVER_ERRORS, what=f"Redis node of {key!r}"):
                raise
        return _AsyncRedisWaiter(hub, channel)

    async def aclose(self) -> None:
        await cancel_left(self._left)  # renewals left to end on their own: ended first
        await self._hubs.aclose()
        if self._conns is not None:
            await self._conns.aclose()
        with contextlib.suppress(*_DRIVER_ERRORS):
            for client in [*self._nodes.opened(), *self._also_close]:
                await client.aclose()
            await self._client.aclose()


# -- Sentinel: following the master --------------------------------------------------


def _unasked(exc: BaseException, failing: bool) -> None:
    """Log a check of the master that failed: a warning the first time in a row."""
    _LOG.log(
        logging.DEBUG if failing else logging.WARNING,
        "could not ask the Redis sentinels where the master is (%s); going on with the"
        " current connections",
        exc,
    )


class _MasterWatch:
    """Where a sync Sentinel store's master is, asked again at most once a second.

    redis-py's Sentinel client asks the sentinels only when it opens a connection. The
    store's connections stay open (``_Connections``, the pub/sub hub): after a planned
    failover (``SENTINEL FAILOVER``) the old master stays up, and a writable master,
    until the sentinels demote it some 10 s later; the steps kept going there, the
    holder's renewals never reached the new master, its lease expired there, and
    another client was granted the key. So at the start of a step, once
    ``MASTER_CHECK_EVERY`` has passed, the pool asks the sentinels (redis-py's pool
    then disconnects its idle connections if the master changed) and the store drops
    its free connections to any other node, and moves its pub/sub connection.

    Polled, not told by the sentinels' ``+switch-master``: that needs a connection to a
    sentinel kept open and read by a thread of its own, a way to pick another sentinel
    when it fails, and a poll anyway to catch up on what was missed meanwhile. A poll
    costs one round trip to a sentinel a second, and only while the store is used.

    The sentinels are asked on a thread of the check's own, which the step waits for
    ``MASTER_CHECK_PATIENCE`` at most: sentinels that are slow to answer or cannot be
    reached (redis-py tries each again, with backoff) do not hold up the renewals. A
    check that fails is logged; the step goes on with the connections it has.
    """

    def __init__(self, pool: Any, conns: _Connections, hubs: _Hubs) -> None:
        self._pool = pool
        self._conns = conns
        self._hubs = hubs
        self._asking = threading.Lock()  # held while a check runs
        # The first connection asks the sentinels itself.
        self._due = time.monotonic() + MASTER_CHECK_EVERY
        self._failing = False

    def _forked(self) -> None:
        """In a forked child: the parent's check is not running here."""
        self._asking = threading.Lock()

    def check(self) -> None:
        now = time.monotonic()
        if now < self._due or not self._asking.acquire(blocking=False):
            return
        self._due = now + MASTER_CHECK_EVERY
        answered = threading.Event()
        try:
            threading.Thread(
                target=self._ask, args=(answered,), name="keymutex-redis-sentinel", daemon=True
            ).start()
        except RuntimeError as exc:  # no thread to be had (the interpreter is exiting)
            self._asking.release()
            _unasked(exc, self._failing)
            return
        answered.wait(MASTER_CHECK_PATIENCE)

    def _ask(self, answered: threading.Event) -> None:
        try:
            master = tuple(self._pool.get_master_address())
            self._conns.follow(master)
            self._hubs.follow(master)
            self._failing = False
        except Exception as exc:  # sentinels down or unreachable: advice, not a step
            _unasked(exc, self._failing)
            self._failing = True
        finally:
            self._asking.release()
            answered.set()


class _SentinelStore(RedisStore):
    """A ``RedisStore`` on Sentinel: its steps follow the master (``_MasterWatch``).

    A store of its own, so that the other stores' steps pay nothing for it.
    """

    def __init__(
        self, client: Any, locate: Locate, layout: _Layout, also_close: Sequence[Any]
    ) -> None:
        super().__init__(client, locate, layout, also_close=also_close)
        assert self._conns is not None
        self._master = _MasterWatch(client.connection_pool, self._conns, self._hubs)

    def _forked(self) -> None:
        super()._forked()
        self._master._forked()

    def _run(self, call: _Call) -> Outcome:
        self._master.check()
        return super()._run(call)

    def _pipeline(self, calls: Sequence[_Call], within: float) -> list[Any]:
        self._master.check()
        return super()._pipeline(calls, within)

    def holder(self, key: str) -> Holder | None:
        self._master.check()
        return super().holder(key)

    def holders(self, prefix: str) -> list[Holder]:
        self._master.check()
        return super().holders(prefix)


class _AsyncMasterWatch:
    """``_MasterWatch`` for an async store: the check is a task of the store's loop."""

    def __init__(self, pool: Any, conns: _AsyncConnections, hubs: _AsyncHubs) -> None:
        self._pool = pool
        self._conns = conns
        self._hubs = hubs
        self._task: asyncio.Task[None] | None = None
        self._due = time.monotonic() + MASTER_CHECK_EVERY
        self._failing = False

    async def check(self) -> None:
        now = time.monotonic()
        if now < self._due or (self._task is not None and not self._task.done()):
            return
        self._due = now + MASTER_CHECK_EVERY
        task = self._task = asyncio.create_task(self._ask(), name="keymutex-redis-sentinel")
        await asyncio.wait({task}, timeout=MASTER_CHECK_PATIENCE)

    async def _ask(self) -> None:
        try:
            master = tuple(await self._pool.get_master_address())
            await self._conns.follow(master)
            self._hubs.follow(master)
            self._failing = False
        except Exception as exc:  # as in _MasterWatch
            _unasked(exc, self._failing)
            self._failing = True

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)


class _AsyncSentinelStore(AsyncRedisStore):
    """An ``AsyncRedisStore`` on Sentinel (see ``_SentinelStore``)."""

    def __init__(
        self,
        client: Any,
        locate: Callable[[str], Awaitable[tuple[str, Callable[[], Any]]]],
        layout: _Layout,
        also_close: Sequence[Any],
    ) -> None:
        super().__init__(client, locate, layout, also_close=also_close)
        assert self._conns is not None
        self._master = _AsyncMasterWatch(client.connection_pool, self._conns, self._hubs)

    async def _run(self, call: _Call) -> Outcome:
        await self._master.check()
        return await super()._run(call)

    async def _pipeline(self, calls: Sequence[_Call], within: float) -> list[Any]:
        await self._master.check()
        return await super()._pipeline(calls, within)

    async def holder(self, key: str) -> Holder | None:
        await self._master.check()
        return await super().holder(key)

    async def holders(self, prefix: str) -> list[Holder]:
        await self._master.check()
        return await super().holders(prefix)

    async def aclose(self) -> None:
        await self._master.aclose()
        await super().aclose()


# -- URLs ----------------------------------------------------------------------------

# Options a user may pass as ``Locks(url, **options)``, handed to redis-py as they are.
CLIENT_OPTIONS = frozenset(
    {
        "username",
        "password",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "health_check_interval",
        "client_name",
        "max_connections",
        "ssl_ca_certs",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_cert_reqs",
        "ssl_check_hostname",
    }
)


@dataclass(frozen=True, slots=True)
class _Target:
    """What a URL names: how to reach the server(s), and the client options."""

    kind: str  # "single", "cluster" or "sentinel"
    url: str  # for "single": the redis-py URL
    nodes: tuple[tuple[str, int], ...]
    service: str
    db: int
    options: dict[str, Any]


def _nodes(netloc: str, url: str) -> tuple[tuple[str, int], ...]:
    hosts = netloc.rpartition("@")[2]
    nodes = []
    for part in hosts.split(","):
        host, _, port = part.rpartition(":")
        if not host or not digits(port):
            raise ValueError(f"{redacted(url)!r}: expected host:port[,host:port…], got {part!r}")
        if not 0 < int(port) <= 65535:
            raise ValueError(f"{redacted(url)!r}: port {port} of {part!r} is out of range 1-65535")
        check_host(host, url, "Redis")
        nodes.append((host.strip("[]"), int(port)))
    return tuple(nodes)


# Options that only a TLS connection (rediss://) takes: a plain one refuses them at
# its first command, with a TypeError that says nothing of TLS.
TLS_OPTIONS = frozenset(
    {name for name in CLIENT_OPTIONS if name.startswith("ssl_")} | {"ssl_min_version"}
)
# What a redis:// URL's query may set: the options redis-py parses from URLs and hands to
# every connection, and ours. Left out: `timeout` and `retry_on_error`, which redis-py
# parses but its connections do not take (a TypeError at the first command), and the
# TLS verify flags (their names, not values, in a URL).
URL_OPTIONS = (
    frozenset(redis.connection.URL_QUERY_ARGUMENT_PARSERS)
    - {"timeout", "retry_on_error", "ssl_include_verify_flags", "ssl_exclude_verify_flags"}
) | CLIENT_OPTIONS


def _check_single(url: str, parts: SplitResult) -> None:
    """What ``redis.connection.parse_url`` lets through: unknown options, a bad database."""
    try:
        parsed = redis.connection.parse_url(url)  # type: ignore[no-untyped-call]
        # redis-py reads the numbers but lets any value through (socket_timeout=-1).
        _checked_options({k: v for k, v in parsed.items() if k in CLIENT_OPTIONS})
        _check_database(parsed.get("db"))
        if parts.scheme.lower() == "unix" and not parsed.get("path"):
            raise ValueError("a unix:// URL needs the socket's path: unix:///path/redis.sock")
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{redacted(url)!r} is not a Redis URL: {scrubbed(str(exc), url)}"
        ) from None
    names = [name for name, _ in parse_qsl(parts.query, keep_blank_values=True)]
    unknown = sorted(set(names) - URL_OPTIONS)
    if unknown:
        raise ValueError(
            f"{redacted(url)!r} is not a Redis URL: unknown query option(s) {unknown}; accepted:"
            f" {sorted(URL_OPTIONS)}"
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(
            f"{redacted(url)!r} is not a Redis URL: query option(s) {repeated} given twice"
        )
    _check_tls(parts.scheme, names, f"{redacted(url)!r} is not a Redis URL: option")
    protocol = dict(parse_qsl(parts.query, keep_blank_values=True)).get("protocol")
    if protocol not in (None, "2", "3"):
        raise ValueError(
            f"{redacted(url)!r} is not a Redis URL: protocol must be 2 or 3 (RESP2 or"
            f" RESP3), not {protocol!r}"
        )
    database = unquote(parts.path).strip("/")
    if parts.scheme.lower() != "unix" and database and not digits(database):
        raise ValueError(
            f"{redacted(url)!r} is not a Redis URL: the database must be a number (/0, /1, …),"
            f" not {database!r}"
        )
    if parts.scheme.lower() != "unix" and database and "db" in names:
        # redis-py would take db= and ignore the path: a write to another database.
        raise ValueError(
            f"{redacted(url)!r} is not a Redis URL: it names the database twice, in its path"
            f" (/{database}) and as db= in its query; give one"
        )


def _check_database(db: object) -> None:
    """A database number redis-py took as it came (found by review: ``?db=-5`` or
    ``/99999999999999999999`` failed only at the first command, as "DB index is out of
    range"). How many there are is the server's ``databases`` setting (16 by default)."""
    if db is not None and (not isinstance(db, int) or not 0 <= db <= MAX_DATABASE):
        raise ValueError(f"the database must be a number from 0 to {MAX_DATABASE}, not {db!r}")


MAX_DATABASE = 2**31 - 1


def _check_tls(scheme: str, names: Iterable[str], what: str) -> None:
    """Refuse TLS options on a URL whose connections are not TLS."""
    if scheme.lower() == "rediss":
        return
    for name in names:
        if name in TLS_OPTIONS:
            raise ValueError(
                f"{what} {name} applies to TLS connections only: use a rediss:// URL"
                f" (this one is {scheme.lower()}://)"
            )


def _credentials(netloc: str) -> dict[str, Any]:
    userinfo, at, _ = netloc.rpartition("@")
    if not at:
        return {}
    user, colon, password = userinfo.partition(":")
    found: dict[str, Any] = {}
    if user:
        found["username"] = unquote(user)
    if colon:
        found["password"] = unquote(password)
    return found


def _typed_option(name: str, value: object, kind: type, shown: str) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        what = "a value" if name == "password" else repr(value)
        raise TypeError(f"Redis store option {name} must be {shown}, not {what}")


_CERT_REQS = ("none", "optional", "required")


def _checked_options(options: Mapping[str, object]) -> dict[str, object]:
    """The keyword options, checked before any connection is made (redis-py would only
    find out at the first command, with a message that names no option); seconds given
    as text are numbers afterwards."""
    checked = dict(options)
    for name, value in options.items():
        if value is None:
            continue  # redis-py's default
        if name in ("socket_timeout", "socket_connect_timeout"):
            checked[name] = seconds("Redis", name, value, text=False)
        elif name == "health_check_interval":
            checked[name] = seconds("Redis", name, value, zero="never", text=False)
        elif name == "max_connections":
            # One connection stays with pub/sub while a waiter waits; the steps need one.
            checked[name] = count("Redis", name, value, minimum=POOL_RESERVE, text=False)
        elif name in ("socket_keepalive", "ssl_check_hostname"):
            _typed_option(name, value, bool, "True or False")
        elif name == "ssl_cert_reqs":
            if value not in _CERT_REQS and not isinstance(value, ssl.VerifyMode):
                raise ValueError(
                    f"Redis store option ssl_cert_reqs must be one of {list(_CERT_REQS)} or"
                    f" an ssl.VerifyMode, not {value!r}"
                )
        else:  # user names, passwords, client name, certificate files
            _typed_option(name, value, str, "a str")
            if name == "client_name" and not all("!" <= c <= "~" for c in str(value)):
                # Redis refuses the name at the first command (CLIENT SETNAME).
                raise ValueError(
                    "Redis store option client_name must be printable ASCII without"
                    f" spaces, not {value!r}"
                )
    return checked


def _parse(url: str, options: Mapping[str, object]) -> _Target:
    unknown = set(options) - CLIENT_OPTIONS
    if unknown:
        raise TypeError(
            f"unknown Redis store options {sorted(unknown)}; accepted: {sorted(CLIENT_OPTIONS)}"
        )
    client_options: dict[str, Any] = {
        "socket_timeout": DEFAULT_SOCKET_TIMEOUT,
        "socket_connect_timeout": DEFAULT_SOCKET_TIMEOUT,
        **_checked_options(options),
        "decode_responses": True,
    }
    parts = split_url(
        url,
        "Redis",
        "redis://host:port/db, rediss://…, unix://…, redis+cluster://…, redis+sentinel://…",
    )
    scheme = parts.scheme.lower()
    _check_tls(scheme, options, "Redis store option")
    if scheme in ("redis", "rediss", "unix"):
        check_host(parts.hostname or "", url, "Redis")
        _check_single(url, parts)
        return _Target("single", url, (), "", 0, client_options)
    if parts.query:
        raise ValueError(
            f"{redacted(url)!r}: query parameters are not accepted for {scheme}; pass options"
            " as keyword arguments, e.g. Locks(url, password=…)"
        )
    nodes = _nodes(parts.netloc, url)
    client_options = {**_credentials(parts.netloc), **client_options}
    if scheme == "redis+cluster":
        if parts.path not in ("", "/", "/0"):
            raise ValueError(f"{redacted(url)!r}: a Redis cluster has only database 0")
        return _Target("cluster", url, nodes, "", 0, client_options)
    if scheme == "redis+sentinel":
        segments = [s for s in parts.path.split("/") if s]
        if not segments or len(segments) > 2 or (len(segments) == 2 and not digits(segments[1])):
            raise ValueError(
                f"{redacted(url)!r}: expected redis+sentinel://host:port[,host:port…]/SERVICE[/DB]"
            )
        db = int(segments[1]) if len(segments) == 2 else 0
        return _Target("sentinel", url, nodes, unquote(segments[0]), db, client_options)
    raise ValueError(f"{redacted(url)!r} is not a Redis URL")


def _once(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` for a client whose commands are sent once: redis-py (6 and later)
    tries a command again up to ten times after a refused connection or a timeout,
    with backoff, unless told otherwise. A Redis that is down then took seconds to say
    so, holding up every other lease's renewal; and a timed-out command may have run.
    keymutex decides itself what may be sent again (see ``_Connections``). (Not for a
    cluster client: its retries follow the slots to a failed-over master.)"""
    return {**options, "retry": redis.retry.Retry(redis.backoff.NoBackoff(), 0)}


def _once_async(options: Mapping[str, Any]) -> dict[str, Any]:
    """``_once`` for ``redis.asyncio``."""
    return {**options, "retry": redis.asyncio.retry.Retry(redis.backoff.NoBackoff(), 0)}


class RedisDriver:
    def open(self, url: str, *, namespace: str, options: Mapping[str, object]) -> RedisStore:
        target = _parse(url, options)
        layout = _Layout(
            namespace,
            CLUSTER_BUCKETS if target.kind == "cluster" else 1,
            replicated=target.kind != "single",
        )
        if target.kind == "cluster":
            nodes = [
                redis.cluster.ClusterNode(host, port)  # type: ignore[no-untyped-call]
                for host, port in target.nodes
            ]
            cluster: Any = _LazyCluster(lambda: _Cluster(startup_nodes=nodes, **target.options))

            def on_node(channel: str) -> tuple[str, Callable[[], Any]]:
                # A sharded channel is served by the node that owns its slot. Asked at
                # each waiter and each subscription: its client is made for a new hub only.
                node: Any = cluster.get_node_from_key(channel)

                def pubsub() -> Any:
                    on: Any = redis.Redis(host=node.host, port=node.port, **_once(target.options))
                    return on.pubsub()

                return node.name, pubsub

            return RedisStore(
                cluster,
                on_node,
                layout,
                _NodeClients(
                    lambda host, port: redis.Redis(host=host, port=port, **_once(target.options))
                ),
            )
        if target.kind == "single":
            client = redis.Redis.from_url(target.url, **_once(target.options))
        else:
            sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
                list(target.nodes),
                sentinel_kwargs=_sentinel_kwargs(target.options, asynchronous=False),
                **_once(target.options),
            )
            client = sentinel.master_for(target.service, db=target.db)  # type: ignore[no-untyped-call]
            return _SentinelStore(
                client, lambda channel: ("", client.pubsub), layout, also_close=sentinel.sentinels
            )
        return RedisStore(client, lambda channel: ("", client.pubsub), layout)

    def open_async(
        self, url: str, *, namespace: str, options: Mapping[str, object]
    ) -> AsyncRedisStore:
        target = _parse(url, options)
        layout = _Layout(
            namespace,
            CLUSTER_BUCKETS if target.kind == "cluster" else 1,
            replicated=target.kind != "single",
        )
        if target.kind == "cluster":
            nodes = [redis.asyncio.cluster.ClusterNode(host, port) for host, port in target.nodes]
            cluster_options = {k: v for k, v in target.options.items() if k != "max_connections"}
            cluster = _AsyncCluster(startup_nodes=nodes, **cluster_options)

            async def on_node(channel: str) -> tuple[str, Callable[[], Any]]:
                await cluster.initialize()  # learns the slots once; a no-op afterwards
                node: Any = cluster.get_node_from_key(channel)
                return node.name, lambda: redis.asyncio.Redis(
                    host=node.host, port=node.port, **_once_async(target.options)
                ).pubsub()

            return AsyncRedisStore(
                cluster,
                on_node,
                layout,
                _NodeClients(
                    lambda host, port: redis.asyncio.Redis(
                        host=host, port=port, **_once_async(target.options)
                    )
                ),
            )
        if target.kind == "single":
            client = redis.asyncio.Redis.from_url(target.url, **_once_async(target.options))
        else:
            sentinel = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]
                list(target.nodes),
                sentinel_kwargs=_sentinel_kwargs(target.options, asynchronous=True),
                **_once_async(target.options),
            )
            client = sentinel.master_for(target.service, db=target.db)

        async def anywhere(channel: str) -> tuple[str, Callable[[], Any]]:
            return "", client.pubsub

        if target.kind == "sentinel":
            return _AsyncSentinelStore(client, anywhere, layout, also_close=sentinel.sentinels)
        return AsyncRedisStore(client, anywhere, layout)


# The longest a sentinel may take to answer (connect, then reply): a question of a few
# bytes, answered from memory.
SENTINEL_TIMEOUT = 1.0


def _sentinel_kwargs(options: Mapping[str, Any], *, asynchronous: bool) -> dict[str, Any]:
    """How the sentinels are asked: each once, for at most ``SENTINEL_TIMEOUT``.

    Credentials are the data nodes'. Found by review: with the data nodes' timeouts
    (5 s) and redis-py's retries, one frozen sentinel held a master check for about a
    minute, and with it the move to a new master: after a planned failover the holder
    renewed on the old master while another client was granted the key. redis-py asks
    the sentinels in turn and puts one that answered first: a dead one costs one
    timeout, once.
    """
    timeouts = {
        name: min(float(options.get(name) or SENTINEL_TIMEOUT), SENTINEL_TIMEOUT)
        for name in ("socket_timeout", "socket_connect_timeout")
    }
    return _once_async(timeouts) if asynchronous else _once(timeouts)


driver = RedisDriver()

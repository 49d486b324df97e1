// A machine suspended while a lease is held: performance.now() and timers stop (Node on
// Linux and macOS), the server's TTL runs on. What a suspend looks like from inside is
// the wall clock jumping ahead of performance.now(), so these tests move the client's
// wall clock forward, through the hook it reads instead of a mocked Date (which it
// ignores: see the last tests). A file of its own: the client's clock keeps the
// suspend it saw, and this process's other leases would be found lost with it.
import assert from 'node:assert/strict';
import {randomUUID} from 'node:crypto';
import {afterEach, test} from 'node:test';
import {setTimeout as sleep} from 'node:timers/promises';

import {LockClient, LockLost} from '../keymutex.js';

const url = process.env.KEYMUTEX_URL;
const skip = url ? false : 'KEYMUTEX_URL is not set (start `keymutex serve` and point it there)';
const run = randomUUID().slice(0, 8);
let serial = 0;
const newKey = (name) => `js:${run}:${name}:${++serial}`;
const client = () => new LockClient({url, namespace: 'js-test'});

const WALL_CLOCK = Symbol.for('keymutex.wallClock');
let offset = 0;
/** Moves the client's wall clock by `ms`, as a suspend of that length would. */
const wallClockJumps = (ms) => {
  offset += ms;
  globalThis[WALL_CLOCK] = () => Date.now() + offset;
};
afterEach(() => {
  offset = 0;
  delete globalThis[WALL_CLOCK];
});

test('a lease whose TTL passed while the machine slept is lost when it wakes', {skip}, async () => {
  const locks = client();
  const lease = await locks.acquire(newKey('slept'), {ttl: 30, timeout: 0});
  assert.equal(lease.lost, false);
  wallClockJumps(40_000);
  assert.equal(lease.lost, true, 'a lease 10 s past its TTL still looked held');
  assert.equal(lease.remaining, 0);
  await assert.rejects(lease.renew(), LockLost);
});

test('a short sleep counts only the time slept', {skip}, async () => {
  const lease = await client().acquire(newKey('short'), {ttl: 30, timeout: 0});
  wallClockJumps(10_000);
  assert.equal(lease.lost, false);
  assert.ok(lease.remaining > 15 && lease.remaining <= 20, `remaining ${lease.remaining} s`);
  await lease.release();
});

test('a wall clock set back changes no lease', {skip}, async () => {
  const lease = await client().acquire(newKey('set-back'), {ttl: 30, timeout: 0});
  wallClockJumps(-3_600_000);
  assert.equal(lease.lost, false);
  assert.ok(lease.remaining > 25, `remaining ${lease.remaining} s`);
  await lease.release();
});

test('withLock learns of the sleep within a second of waking, not at its next renewal', {skip}, async () => {
  let lostCalls = 0;
  const outcome = client().withLock(
    newKey('withlock-slept'),
    async (lease) => {
      wallClockJumps(40_000); // asleep, then awake: the next renewal is still 10 s away
      await new Promise((resolve) => lease.signal.addEventListener('abort', resolve, {once: true}));
      return 'went on';
    },
    {ttl: 30, timeout: 0, onLost: () => lostCalls++},
  );
  const timeout = sleep(5_000, 'still waiting', {ref: false});
  const first = await Promise.race([outcome.then(() => 'ended', () => 'ended'), timeout]);
  assert.equal(first, 'ended', 'the lease was not found lost within 5 s of waking');
  await assert.rejects(outcome, LockLost);
  assert.equal(lostCalls, 1);
});

test('withLock renews at once a lease that outlived a suspend, not its timer later', {skip}, async () => {
  let lostCalls = 0;
  const outcome = client().withLock(
    newKey('withlock-short-sleep'),
    async (lease) => {
      wallClockJumps(22_000); // 22 s of a 30 s TTL: 8 s left, the renewal timer 10 s away
      const deadline = performance.now() + 5_000;
      while (lease.remaining < 20 && performance.now() < deadline) await sleep(100);
      assert.ok(lease.remaining >= 20, `not renewed after waking: remaining ${lease.remaining} s`);
      return 'kept';
    },
    {ttl: 30, timeout: 0, onLost: () => lostCalls++},
  );
  assert.equal(await outcome, 'kept');
  assert.equal(lostCalls, 0);
});

test('a test that mocks Date loses no lease (the client keeps its own wall clock)', {skip}, async (t) => {
  const lease = await client().acquire(newKey('mocked-date'), {ttl: 30, timeout: 0});
  t.mock.timers.enable({apis: ['Date'], now: 0}); // Date.now() is 1970
  assert.equal(lease.lost, false);
  t.mock.timers.reset(); // and back: a jump of 56 years
  assert.equal(lease.lost, false);
  t.mock.timers.enable({apis: ['Date'], now: Date.now() + 3_600_000}); // an hour ahead
  assert.equal(lease.lost, false);
  assert.ok(lease.remaining > 25, `remaining ${lease.remaining} s`);
  t.mock.timers.reset();
  await lease.release();
});

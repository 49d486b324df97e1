// The client against a live lock server: KEYMUTEX_URL, e.g. http://127.0.0.1:7420
// (tests/e2e/test_js_client.py starts one and runs these). Every key is unique to the run.
import assert from 'node:assert/strict';
import {randomUUID} from 'node:crypto';
import {describe, test} from 'node:test';
import {setTimeout as sleep} from 'node:timers/promises';

import {Lease, LockClient, LockError, LockLost, Locked, StoreError} from '../keymutex.js';

const url = process.env.KEYMUTEX_URL;
const skip = url ? false : 'KEYMUTEX_URL is not set (start `keymutex serve` and point it there)';
const run = randomUUID().slice(0, 8);
let serial = 0;
const newKey = (name) => `js:${run}:${name}:${++serial}`;
const client = (options = {}) => new LockClient({url, namespace: 'js-test', ...options});

describe('acquire, renew, release, holder', {skip}, () => {
  test('a lease carries token, fence, owner, info and times', async () => {
    const locks = client({owner: 'node-test'});
    const key = newKey('basic');
    const before = Date.now() / 1000;
    const lease = await locks.acquire(key, {ttl: 10, timeout: 0, info: {name: 'Alice'}});
    assert.ok(lease instanceof Lease);
    assert.equal(lease.key, key);
    assert.match(lease.token, /^[A-Za-z0-9_-]{22,}$/, 'at least 128 bits, URL-safe');
    assert.ok(Number.isInteger(lease.fence) && lease.fence > 0);
    assert.equal(lease.owner, 'node-test');
    assert.deepEqual(lease.info, {name: 'Alice'});
    assert.equal(lease.ttl, 10);
    assert.ok(Math.abs(lease.acquiredAt - before) < 5, 'acquiredAt is wall-clock seconds');
    assert.ok(Math.abs(lease.expiresAt - lease.acquiredAt - 10) < 0.5);
    assert.ok(lease.remaining > 8 && lease.remaining <= 10, `remaining ${lease.remaining}`);
    assert.equal(lease.lost, false);

    const holder = await locks.holder(key);
    assert.deepEqual(
      {key: holder.key, owner: holder.owner, info: holder.info, fence: holder.fence},
      {key, owner: 'node-test', info: {name: 'Alice'}, fence: lease.fence},
    );
    assert.ok(!('token' in holder), 'a holder never shows the token');
    assert.ok(Object.isFrozen(holder));

    await lease.release();
    assert.equal(await locks.holder(key), null);
    assert.equal(lease.lost, false, 'a released lease is not lost');
  });

  test('renew and release are stateless: key and token only, from another client', async () => {
    const key = newKey('stateless');
    const lease = await client().acquire(key, {ttl: 2, timeout: 0});
    const other = client();
    const renewed = await other.renew(key, lease.token, {ttl: 20});
    assert.equal(renewed.fence, lease.fence, 'renewal keeps the fence');
    assert.equal(renewed.token, lease.token);
    assert.ok(renewed.remaining > 15);
    assert.ok((await other.holder(key)).expiresIn > 15);
    await other.release(key, lease.token);
    assert.equal(await other.holder(key), null);
    await assert.rejects(other.release(key, lease.token), LockLost, 'a second release is refused');
    await assert.rejects(lease.renew(), LockLost);
    assert.equal(lease.lost, true);
  });

  test('holders lists the current leases under a prefix, sorted by key', async () => {
    const locks = client();
    const prefix = newKey('list');
    const leases = [];
    for (const name of ['b', 'a', 'c']) leases.push(await locks.acquire(`${prefix}:${name}`, {timeout: 0}));
    await locks.acquire(`${newKey('elsewhere')}`, {timeout: 0, ttl: 5});
    const holders = await locks.holders(`${prefix}:`);
    assert.deepEqual(holders.map((h) => h.key), ['a', 'b', 'c'].map((name) => `${prefix}:${name}`));
    for (const lease of leases) await lease.release();
    assert.deepEqual(await locks.holders(`${prefix}:`), []);
  });

  test('namespaces are separate', async () => {
    const key = newKey('namespaces');
    const one = await client({namespace: 'js-one'}).acquire(key, {timeout: 0});
    const two = await client({namespace: 'js-two'}).acquire(key, {timeout: 0});
    assert.notEqual(one.token, two.token);
    await one.release();
    await two.release();
  });
});

describe('refusals and loss', {skip}, () => {
  test('a held key is refused with Locked naming the holder', async () => {
    const key = newKey('locked');
    const alice = await client({owner: 'alice'}).acquire(key, {timeout: 0, info: {name: 'Alice'}});
    await assert.rejects(client({owner: 'bob'}).acquire(key, {timeout: 0}), (error) => {
      assert.ok(error instanceof Locked && error instanceof LockError);
      assert.equal(error.name, 'Locked');
      assert.equal(error.key, key);
      assert.equal(error.holder.owner, 'alice');
      assert.deepEqual(error.holder.info, {name: 'Alice'});
      assert.equal(error.holder.fence, alice.fence);
      return true;
    });
    await alice.release();
  });

  test('acquire with a timeout waits for the release', async () => {
    const key = newKey('handoff');
    const first = await client().acquire(key, {timeout: 0});
    const waiting = client().acquire(key, {timeout: 10});
    await sleep(300);
    await first.release();
    const second = await waiting;
    assert.ok(second.fence > first.fence);
    await second.release();
  });

  test('acquire with a timeout gives up with Locked after about that time', async () => {
    const key = newKey('timeout');
    const holder = await client().acquire(key, {timeout: 0});
    const started = performance.now();
    await assert.rejects(client().acquire(key, {timeout: 0.7}), (error) => error instanceof Locked && error.holder.fence === holder.fence);
    const waited = (performance.now() - started) / 1000;
    assert.ok(waited >= 0.65 && waited < 5, `waited ${waited} s`);
    await holder.release();
  });

  test('an expired lease is free for the next one, with a larger fence', async () => {
    const key = newKey('expiry');
    const short = await client().acquire(key, {ttl: 0.5, timeout: 0});
    const next = await client().acquire(key, {timeout: 10});
    assert.ok(next.fence > short.fence);
    await assert.rejects(short.renew(), LockLost);
    await next.release();
  });

  test('steal takes over; the old token gets LockLost naming the new holder', async () => {
    const key = newKey('steal');
    const alice = await client({owner: 'alice'}).acquire(key, {timeout: 0, ttl: 30});
    const bob = await client({owner: 'bob'}).acquire(key, {timeout: 0, steal: true, info: {name: 'Bob'}});
    assert.ok(bob.fence > alice.fence);
    await assert.rejects(alice.renew(), (error) => {
      assert.ok(error instanceof LockLost);
      assert.equal(error.key, key);
      assert.equal(error.holder.owner, 'bob');
      assert.deepEqual(error.holder.info, {name: 'Bob'});
      return true;
    });
    assert.equal(alice.lost, true);
    assert.ok(alice.signal.aborted && alice.signal.reason instanceof LockLost);
    await assert.rejects(client().release(key, alice.token), LockLost);
    assert.equal((await client().holder(key)).fence, bob.fence, 'the thief still holds it');
    await bob.release();
  });

  test('an abort signal stops waiting', async () => {
    const key = newKey('abort');
    const holder = await client().acquire(key, {timeout: 0});
    const controller = new AbortController();
    const waiting = client().acquire(key, {signal: controller.signal});
    setTimeout(() => controller.abort(new Error('user gave up')), 200);
    await assert.rejects(waiting, /user gave up/);
    await holder.release();
  });

  test('an unknown route is a StoreError with the HTTP status', async () => {
    const locks = new LockClient({url: `${url}/no-such-base`});
    await assert.rejects(locks.holder('k'), (error) => error instanceof StoreError && error.status === 404);
  });
});

describe('wait', {skip}, () => {
  test('answers when the holder with that fence lets go', async () => {
    const key = newKey('wait');
    const locks = client();
    const lease = await locks.acquire(key, {timeout: 0});
    const unchanged = await locks.wait(key, lease.fence, 0.3);
    assert.equal(unchanged.changed, false);
    assert.equal(unchanged.holder.fence, lease.fence);
    const waiting = locks.wait(key, lease.fence, 10);
    await sleep(200);
    await lease.release();
    const {changed, holder} = await waiting;
    assert.equal(changed, true);
    assert.equal(holder, null);
  });

  test('answers at once when the key is held by another fence, or free', async () => {
    const key = newKey('wait-now');
    const locks = client();
    assert.deepEqual(await locks.wait(key, null, 5), {changed: true, holder: null});
    const lease = await locks.acquire(key, {timeout: 0});
    const seen = await locks.wait(key, lease.fence - 1 >= 0 ? lease.fence - 1 : 0, 5);
    assert.equal(seen.changed, true);
    assert.equal(seen.holder.fence, lease.fence);
    await lease.release();
  });
});

describe('withLock', {skip}, () => {
  test('runs fn holding the lock, renews past the ttl, releases after', async () => {
    const key = newKey('with');
    const locks = client();
    const result = await locks.withLock(
      key,
      async (lease) => {
        for (let i = 0; i < 6; i++) {
          await sleep(500); // 3 s in all: twice the ttl
          const holder = await locks.holder(key);
          assert.equal(holder?.fence, lease.fence, `still held after ${(i + 1) * 0.5} s`);
        }
        assert.equal(lease.lost, false);
        assert.equal(lease.signal.aborted, false);
        return 'done';
      },
      {ttl: 1.5, timeout: 0},
    );
    assert.equal(result, 'done');
    assert.equal(await locks.holder(key), null);
  });

  test('rejects with LockLost when the lock is taken over, and aborts the lease signal', async () => {
    const key = newKey('with-lost');
    const locks = client({owner: 'worker'});
    let lostCalls = 0;
    let abortedReason;
    const outcome = locks.withLock(
      key,
      async (lease) => {
        await new Promise((resolve) => lease.signal.addEventListener('abort', resolve));
        abortedReason = lease.signal.reason;
        return 'unreachable result';
      },
      {ttl: 0.6, timeout: 0, onLost: () => lostCalls++},
    );
    await sleep(100);
    const thief = await client({owner: 'thief'}).acquire(key, {steal: true, timeout: 0});
    await assert.rejects(outcome, (error) => {
      assert.ok(error instanceof LockLost);
      assert.equal(error.holder.owner, 'thief');
      return true;
    });
    assert.ok(abortedReason instanceof LockLost);
    assert.equal(lostCalls, 1);
    assert.equal((await locks.holder(key)).fence, thief.fence, 'withLock did not release the thief');
    await thief.release();
  });

  test("fn's own error wins, and the lock is released", async () => {
    const key = newKey('with-error');
    const locks = client();
    await assert.rejects(
      locks.withLock(key, () => {
        throw new Error('boom');
      }),
      /boom/,
    );
    assert.equal(await locks.holder(key), null);
  });

  test('waits for the key like acquire', async () => {
    const key = newKey('with-wait');
    const locks = client();
    const first = await locks.acquire(key, {timeout: 0, ttl: 0.5});
    const fence = await locks.withLock(key, (lease) => lease.fence, {timeout: 10});
    assert.ok(fence > first.fence);
  });
});

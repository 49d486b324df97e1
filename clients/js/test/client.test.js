// The client against a live lock server: KEYMUTEX_URL, e.g. http://127.0.0.1:7420
// (tests/e2e/test_js_client.py starts one and runs these). Every key is unique to the run.
import assert from 'node:assert/strict';
import {randomUUID} from 'node:crypto';
import http from 'node:http';
import {describe, test} from 'node:test';
import {setTimeout as sleep} from 'node:timers/promises';

import {Lease, LockClient, LockError, LockLost, Locked, StoreError} from '../keymutex.js';

const url = process.env.KEYMUTEX_URL;
const skip = url ? false : 'KEYMUTEX_URL is not set (start `keymutex serve` and point it there)';
const run = randomUUID().slice(0, 8);
let serial = 0;
const newKey = (name) => `js:${run}:${name}:${++serial}`;
const client = (options = {}) => new LockClient({url, namespace: 'js-test', ...options});

/**
 * Runs `body` with globalThis.fetch replaced by `spy(url, init, realFetch)`.
 * @template T
 * @param {(url: string, init: RequestInit, real: typeof fetch) => Promise<Response>} spy
 * @param {() => Promise<T>} body
 * @returns {Promise<T>}
 */
async function withFetch(spy, body) {
  const real = globalThis.fetch;
  globalThis.fetch = (target, init) => spy(String(target), init, real);
  try {
    return await body();
  } finally {
    globalThis.fetch = real;
  }
}

/** @param {string[]} paths where each request's path is recorded */
const recordingPaths = (paths) => (target, init, real) => {
  paths.push(new URL(target).pathname);
  return real(target, init);
};

/** Polls `check` until it resolves to true, for up to `seconds`. */
async function eventually(check, seconds = 3) {
  const deadline = performance.now() + seconds * 1000;
  while (!(await check())) {
    if (performance.now() > deadline) return false;
    await sleep(50);
  }
  return true;
}

/** A JSON reply as the lock server makes them. */
const jsonResponse = (status, body) =>
  new Response(JSON.stringify(body), {status, headers: {'Content-Type': 'application/json'}});

/**
 * A proxy to the lock server that, once hang() is called, accepts requests and never
 * answers them: a server that stopped answering, with the connections still open.
 */
async function hangingProxy() {
  const target = new URL(url);
  let hanging = false;
  const proxy = http.createServer((request, response) => {
    if (hanging) return;
    const {method, headers} = request;
    const options = {host: target.hostname, port: target.port, path: request.url, method, headers};
    const forward = http.request(options, (reply) => {
      response.writeHead(reply.statusCode, reply.headers);
      reply.pipe(response);
    });
    request.pipe(forward);
  });
  await new Promise((resolve) => proxy.listen(0, '127.0.0.1', resolve));
  return {
    url: `http://127.0.0.1:${proxy.address().port}`,
    hang: () => {
      hanging = true;
    },
    close: () => {
      proxy.closeAllConnections();
      proxy.close();
    },
  };
}

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

  test('info is measured as the server measures it, so the server takes what the client sends', async () => {
    // 5455 bytes as JSON.stringify writes it, 4093 as the server does (1e-05, not 0.00001).
    const info = {x: Array(681).fill(0.00001)};
    const lease = await client().acquire(newKey('info-size'), {timeout: 0, info});
    assert.deepEqual(lease.info, info);
    await lease.release();
  });

  test('info nested 32 levels is taken; 33, which the server refuses, is not sent', async () => {
    const nested = (levels) => {
      let value = 'bottom';
      for (let level = levels; level > 1; level--) value = level % 2 ? [value] : {a: value};
      return {a: value};
    };
    const key = newKey('info-depth');
    const lease = await client().acquire(key, {timeout: 0, info: nested(32)});
    assert.deepEqual(lease.info, nested(32));
    await lease.release();
    // The server's own limit: the same request with one level more is a 400.
    const body = {namespace: 'js-test', key, token: 'A'.repeat(24), ttl: 5, timeout: 0, info: nested(33)};
    const headers = {'Content-Type': 'application/json'};
    const reply = await fetch(`${url}/v1/acquire`, {method: 'POST', headers, body: JSON.stringify(body)});
    assert.equal(reply.status, 400, await reply.text());
    const paths = [];
    await withFetch(recordingPaths(paths), () =>
      assert.rejects(client().acquire(key, {timeout: 0, info: nested(33)}), RangeError),
    );
    assert.deepEqual(paths, []);
  });

  test('keys that look like paths, escapes or URL parts reach the server as the same key', async () => {
    const locks = client({namespace: 'js-test/../x?y#z'});
    const prefix = newKey('url-like');
    const names = ['a/demo/edit/b', 'a%2Fb', '..', '.', 'a/../b', 'x?key=y&z=1', '#top', 'two words + more', 'café/🔒', '%', '100%25'];
    for (const name of names) {
      const key = `${prefix}:${name}`;
      const lease = await locks.acquire(key, {timeout: 0, ttl: 30});
      assert.equal((await locks.holder(key))?.fence, lease.fence, key);
      // The server's own list, asked without the client: the key as it was given.
      const query = new URLSearchParams({namespace: 'js-test/../x?y#z', prefix: key});
      const listed = await (await fetch(`${url}/v1/holders?${query}`)).json();
      assert.deepEqual(listed.holders.map((/** @type {{key: string}} */ h) => h.key), [key]);
      await locks.renew(key, lease.token);
      await locks.release(key, lease.token);
      assert.equal(await locks.holder(key), null, key);
    }
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

  test('force release with a fence releases only that lease', async () => {
    const key = newKey('force');
    const alice = await client({owner: 'alice'}).acquire(key, {timeout: 0, ttl: 30});
    await alice.release();
    const bob = await client({owner: 'bob'}).acquire(key, {timeout: 0, ttl: 30});
    await assert.rejects(client().forceRelease(key, 'alice left', {fence: alice.fence}), (error) => {
      assert.ok(error instanceof Locked);
      assert.equal(error.holder.owner, 'bob');
      assert.equal(error.holder.fence, bob.fence);
      return true;
    });
    await bob.renew(); // spared
    const {released, holder} = await client().forceRelease(key, 'bob left', {fence: bob.fence});
    assert.equal(released, true);
    assert.equal(holder.fence, bob.fence);
    await assert.rejects(bob.renew(), LockLost);
    assert.deepEqual(await client().forceRelease(key, 'tidy', {fence: bob.fence}), {released: false, holder: null});
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

  test('holding: a holder watching its own lease learns of a take-over, and is no waiter', async () => {
    const key = newKey('wait-holding');
    const locks = client();
    const lease = await locks.acquire(key, {timeout: 0});
    /** @param {number} n */
    const waitersAre = async (n) => {
      for (let tries = 0; tries < 100; tries++) {
        const reply = await fetch(`${url}/v1/holders?namespace=js-test&prefix=${encodeURIComponent(key)}`);
        const count = (await reply.json()).waiting[key] ?? 0;
        if (count === n) return;
        await sleep(20);
      }
      assert.fail(`the server never counted ${n} waiter(s) on ${key}`);
    };
    const watcher = new AbortController();
    const plain = locks.wait(key, lease.fence, 10, {signal: watcher.signal});
    await waitersAre(1); // a plain wait is a waiter
    watcher.abort();
    await assert.rejects(plain);
    await waitersAre(0);
    const watching = locks.wait(key, lease.fence, 10, {holding: true});
    await sleep(200);
    await waitersAre(0);
    const taker = await client().acquire(key, {timeout: 0, steal: true});
    const {changed, holder} = await watching;
    assert.equal(changed, true);
    assert.equal(holder.fence, taker.fence);
    await assert.rejects(lease.renew(), LockLost);
    await taker.release();
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

describe('tokens', {skip}, () => {
  test('acquire draws a token and asks again with the same one', async () => {
    const key = newKey('token');
    const sent = [];
    const lease = await withFetch(
      async (target, init, real) => {
        if (target.endsWith('/v1/acquire')) {
          sent.push(JSON.parse(init.body));
          // The first ask comes back refused, as a long poll that reached the server's max_wait.
          if (sent.length === 1) return jsonResponse(409, {error: 'locked', message: 'held', holder: null});
        }
        return real(target, init);
      },
      () => client().acquire(key, {timeout: 5}),
    );
    assert.equal(sent.length, 2);
    assert.match(sent[0].token ?? '', /^[A-Za-z0-9_-]{22,}$/, 'at least 128 bits, URL-safe');
    assert.equal(sent[1].token, sent[0].token);
    assert.equal(lease.token, sent[0].token);
    await lease.release();
  });

  test('tokens are drawn without a global crypto too, as on Node 18', async () => {
    const descriptor = Object.getOwnPropertyDescriptor(globalThis, 'crypto');
    delete globalThis.crypto;
    const sent = [];
    try {
      const lease = await withFetch(
        (target, init, real) => {
          if (target.endsWith('/v1/acquire')) sent.push(JSON.parse(init.body).token);
          return real(target, init);
        },
        () => client().acquire(newKey('node18'), {timeout: 0}),
      );
      assert.equal(lease.token, sent[0]);
      await lease.release();
    } finally {
      Object.defineProperty(globalThis, 'crypto', descriptor);
    }
  });

  test('an acquire whose reply was lost is asked again with its token: one grant', async () => {
    const key = newKey('lost-reply');
    let acquires = 0;
    const lease = await withFetch(
      async (target, init, real) => {
        const response = await real(target, init);
        if (target.endsWith('/v1/acquire') && ++acquires === 1) {
          await response.text(); // granted at the server; the reply is lost on the way
          throw new TypeError('fetch failed', {cause: new Error('other side closed')});
        }
        return response;
      },
      () => client().acquire(key, {timeout: 0}),
    );
    assert.equal(acquires, 2);
    assert.equal((await client().holder(key)).fence, lease.fence, 'the first grant, not another one');
    await lease.release();
  });

  test('an aborted acquire gives back a grant that landed meanwhile', async () => {
    const key = newKey('abort-grant');
    const controller = new AbortController();
    const attempt = withFetch(
      async (target, init, real) => {
        if (!target.endsWith('/v1/acquire')) return real(target, init);
        await real(target, {...init, signal: undefined}); // the server grants...
        controller.abort(new Error('gave up')); // ...as the caller gives up
        throw init.signal.reason;
      },
      () => client().acquire(key, {timeout: 0, signal: controller.signal}),
    );
    await assert.rejects(attempt, /gave up/);
    assert.ok(await eventually(async () => (await client().holder(key)) === null), 'the grant was not given back');
  });
});

describe('request timeouts', {skip}, () => {
  test("a long poll's own wait is added to requestTimeout", async () => {
    const key = newKey('long-poll');
    const holder = await client().acquire(key, {timeout: 0});
    const started = performance.now();
    await assert.rejects(client({requestTimeout: 0.3}).acquire(key, {timeout: 1.2}), Locked);
    assert.ok((performance.now() - started) / 1000 >= 1.1);
    await holder.release();
  });

  test('withLock reports the lease lost by its deadline while a renewal hangs', {timeout: 10_000}, async () => {
    const proxy = await hangingProxy();
    try {
      // The default requestTimeout (10 s) is far past the deadline, which must not wait for it.
      const locks = new LockClient({url: proxy.url, namespace: 'js-test'});
      let started;
      let lostAt;
      const outcome = locks.withLock(
        newKey('hung'),
        async (lease) => {
          proxy.hang();
          started = performance.now();
          await new Promise((resolve) => {
            lease.signal.addEventListener('abort', resolve);
            setTimeout(resolve, 3000);
          });
          assert.ok(lease.signal.aborted, 'lease.signal was not aborted by the deadline');
          return 'done';
        },
        {ttl: 1, timeout: 0, onLost: () => (lostAt = performance.now())},
      );
      await assert.rejects(outcome, LockLost);
      const seconds = (lostAt - started) / 1000;
      // By its deadline (1 s), not the request's timeout; room for a loaded host's timers
      // (one fired 0.47 s late in a CI run), below the 3-s fallback above.
      assert.ok(seconds < 2.5, `onLost came ${seconds} s after the server stopped answering`);
    } finally {
      proxy.close();
    }
  });
});

describe('withLock ends well', {skip}, () => {
  test('an onLost that rejects is logged, and withLock goes on', async () => {
    const key = newKey('onlost-rejects');
    const logged = [];
    const unhandled = [];
    const onUnhandled = (reason) => unhandled.push(reason);
    const consoleError = console.error;
    process.on('unhandledRejection', onUnhandled);
    console.error = (...args) => logged.push(args);
    let thief;
    try {
      const outcome = client().withLock(
        key,
        async () => {
          thief = await client().acquire(key, {steal: true, timeout: 0});
          await sleep(600); // a renewal (every ttl/3) finds the key taken
        },
        {ttl: 0.6, timeout: 0, onLost: async () => Promise.reject(new Error('notify failed'))},
      );
      await assert.rejects(outcome, LockLost);
      await sleep(50);
    } finally {
      console.error = consoleError;
      process.off('unhandledRejection', onUnhandled);
    }
    assert.deepEqual(unhandled, []);
    assert.equal(logged.length, 1);
    assert.match(String(logged[0][0]), /onLost callback .* failed/);
    assert.match(String(logged[0][1]), /notify failed/);
    await thief.release();
  });

  test('a lease that fn released itself is not renewed, lost, or released again', async () => {
    const key = newKey('self-release');
    const paths = [];
    let lostCalls = 0;
    const result = await withFetch(recordingPaths(paths), () =>
      client().withLock(
        key,
        async (lease) => {
          await lease.release();
          await sleep(500); // past a renewal's time (ttl/3)
          assert.equal(lease.lost, false);
          return 'early';
        },
        {ttl: 0.3, timeout: 0, onLost: () => lostCalls++},
      ),
    );
    assert.equal(result, 'early');
    assert.equal(lostCalls, 0);
    assert.deepEqual(paths, ['/v1/acquire', '/v1/release']);
  });

  test('a lease whose deadline passed while fn kept the event loop busy is lost', async () => {
    const key = newKey('blocked');
    const paths = [];
    let lostCalls = 0;
    let signal;
    const outcome = withFetch(recordingPaths(paths), () =>
      client().withLock(
        key,
        (lease) => {
          signal = lease.signal;
          const end = performance.now() + 600;
          while (performance.now() < end); // no await: no renewal can run
          return 'too late';
        },
        {ttl: 0.3, timeout: 0, onLost: () => lostCalls++},
      ),
    );
    await assert.rejects(outcome, LockLost);
    assert.ok(signal.aborted && signal.reason instanceof LockLost);
    assert.equal(lostCalls, 1);
    assert.ok(paths.includes('/v1/release'), 'the release is sent all the same');
  });
});

test('Lease.renew never revives a lease past its deadline: it releases it', {skip}, async () => {
  const key = newKey('no-revival');
  const lease = await client().acquire(key, {ttl: 0.2, timeout: 0});
  const paths = [];
  await withFetch(recordingPaths(paths), async () => {
    // The first moment it is lost by this process's clock, the server may still hold it.
    while (!lease.lost) await new Promise((resolve) => setImmediate(resolve));
    await assert.rejects(lease.renew(), LockLost);
  });
  assert.equal(lease.lost, true);
  assert.ok(lease.signal.aborted);
  assert.deepEqual(paths, ['/v1/release']);
});

describe('withLock follows renewals and releases made while fn runs', {skip}, () => {
  /** Counts the renewals sent while `body` runs. */
  const countingRenewals = (counter) => (target, init, real) => {
    if (new URL(target).pathname === '/v1/renew') counter.renewals++;
    return real(target, init);
  };

  test('a renewal to a shorter ttl makes the renewer renew about every new ttl/3', async () => {
    const key = newKey('shorter');
    const locks = client();
    const counter = {renewals: 0};
    let lostCalls = 0;
    const result = await withFetch(countingRenewals(counter), () =>
      locks.withLock(
        key,
        async (lease) => {
          await lease.renew({ttl: 0.6}); // from 30 s: the next renewal is due in 0.2 s, not 10 s
          await sleep(1500);
          assert.equal((await locks.holder(key))?.fence, lease.fence, 'the lease expired while fn ran');
          assert.equal(lease.lost, false);
          assert.equal(lease.signal.aborted, false);
          assert.equal(lease.ttl, 0.6);
          return 'done';
        },
        {ttl: 30, timeout: 0, onLost: () => lostCalls++},
      ),
    );
    assert.equal(result, 'done');
    assert.equal(lostCalls, 0);
    assert.ok(counter.renewals >= 4, `${counter.renewals} renewals in 1.5 s at a ttl of 0.6 s`);
    assert.equal(await locks.holder(key), null);
  });

  test('a renewal to a shorter ttl brings the loss at the new deadline', {timeout: 10_000}, async () => {
    const proxy = await hangingProxy();
    try {
      const locks = new LockClient({url: proxy.url, namespace: 'js-test'});
      let renewedAt;
      let lostAt;
      const outcome = locks.withLock(
        newKey('shorter-hung'),
        async (lease) => {
          renewedAt = performance.now();
          await lease.renew({ttl: 0.6});
          proxy.hang(); // no renewal answers from now: the lease is lost 0.6 s after renewedAt
          await new Promise((resolve) => {
            lease.signal.addEventListener('abort', resolve);
            setTimeout(resolve, 3000);
          });
          assert.ok(lease.signal.aborted, 'lease.signal was not aborted by the new deadline');
          return 'done';
        },
        {ttl: 30, timeout: 0, onLost: () => (lostAt = performance.now())},
      );
      await assert.rejects(outcome, LockLost);
      const seconds = (lostAt - renewedAt) / 1000;
      // By the new deadline (0.6 s), not the old ttl's (30 s); room for a loaded host.
      assert.ok(seconds < 2.5, `onLost came ${seconds} s after a renewal to a ttl of 0.6 s`);
    } finally {
      proxy.close();
    }
  });

  test('a release by key and token is the lease released: not renewed, lost, or released again', async () => {
    const key = newKey('token-release');
    const locks = client();
    const paths = [];
    let lostCalls = 0;
    const result = await withFetch(recordingPaths(paths), () =>
      locks.withLock(
        key,
        async (lease) => {
          await locks.release(key, lease.token);
          await sleep(500); // past a renewal's time (ttl/3), and the deadline
          assert.equal(lease.lost, false);
          assert.equal(lease.signal.aborted, false);
          await assert.rejects(lease.release(), /already released/);
          return 'early';
        },
        {ttl: 0.3, timeout: 0, onLost: () => lostCalls++},
      ),
    );
    assert.equal(result, 'early');
    assert.equal(lostCalls, 0);
    assert.deepEqual(paths, ['/v1/acquire', '/v1/release']);
  });

  test('a renewal by key and token to a shorter ttl is the lease renewed', async () => {
    const key = newKey('token-renew');
    const locks = client();
    const counter = {renewals: 0};
    let lostCalls = 0;
    const result = await withFetch(countingRenewals(counter), () =>
      locks.withLock(
        key,
        async (lease) => {
          const renewed = await locks.renew(key, lease.token, {ttl: 0.6});
          assert.equal(renewed.fence, lease.fence);
          assert.equal(lease.ttl, 0.6, 'the lease took the renewal in');
          assert.ok(lease.remaining <= 0.6);
          await sleep(1500);
          assert.equal((await locks.holder(key))?.fence, lease.fence, 'the lease expired while fn ran');
          assert.equal(lease.lost, false);
          return 'done';
        },
        {ttl: 30, timeout: 0, onLost: () => lostCalls++},
      ),
    );
    assert.equal(result, 'done');
    assert.equal(lostCalls, 0);
    assert.ok(counter.renewals >= 4, `${counter.renewals} renewals in 1.5 s at a ttl of 0.6 s`);
    assert.equal(await locks.holder(key), null);
  });

  test('renewals of one lease go one at a time: the last asked is the last taken in', async () => {
    const lease = await client().acquire(newKey('one-at-a-time'), {ttl: 5, timeout: 0});
    let sending = 0;
    let most = 0;
    const counting = async (target, init, real) => {
      most = Math.max(most, ++sending);
      try {
        return await real(target, init);
      } finally {
        sending--;
      }
    };
    // Two at once could be answered out of order: the lease would keep 30 s the server no longer grants.
    await withFetch(counting, () => Promise.all([lease.renew({ttl: 30}), lease.renew({ttl: 2})]));
    assert.equal(most, 1);
    assert.equal(lease.ttl, 2);
    assert.ok(lease.remaining <= 2);
    await lease.release();
  });

  test('a renewal by key and token reaches a lease from acquire too, as a heartbeat', async () => {
    const key = newKey('heartbeat');
    const locks = client();
    const lease = await locks.acquire(key, {ttl: 0.3, timeout: 0});
    await locks.renew(key, lease.token, {ttl: 20});
    await sleep(400);
    assert.equal(lease.lost, false, 'the lease object did not see its renewal');
    assert.ok(lease.remaining > 15);
    assert.equal(lease.ttl, 20);
    await locks.release(key, lease.token);
    assert.equal(lease.lost, false, 'a released lease is not lost');
    await assert.rejects(lease.release(), /already released/);
    // Another client's renewal or release is stateless: its lease objects are its own.
    const other = await locks.acquire(newKey('heartbeat'), {ttl: 20, timeout: 0});
    await client().release(other.key, other.token);
    await assert.rejects(other.renew(), LockLost);
    assert.equal(other.lost, true);
  });
});

describe('found by review (2026-11-28)', {skip}, () => {
  test('a second release while the first is under way waits for it: no LockLost, no loss in withLock', async () => {
    const locks = client();
    const key = newKey('double-release');
    const lease = await locks.acquire(key, {timeout: 0});
    const results = await Promise.allSettled([lease.release(), lease.release()]);
    assert.deepEqual(results.map((r) => r.status), ['fulfilled', 'fulfilled']);
    await assert.rejects(lease.release(), /already released/);
    let lost = false;
    await locks.withLock(newKey('unawaited-release'), async (held) => {
      held.signal.addEventListener('abort', () => {
        lost = true;
      });
      void held.release(); // started, not awaited
    });
    assert.equal(lost, false);
  });

  test('renew by token through the client that granted the lease resolves to that lease', async () => {
    const locks = client({ttl: 2});
    const key = newKey('renew-itself');
    let lost = false;
    await locks.withLock(
      key,
      async (lease) => {
        const renewed = await locks.renew(key, lease.token);
        assert.equal(renewed, lease);
        await renewed.release();
        await sleep(1500); // a renewal would have been due
      },
      {onLost: () => (lost = true)},
    );
    assert.equal(lost, false);
  });

  test('a redirect is an error that names its target, not a POST turned GET', async () => {
    const server = http.createServer((request, response) => {
      response.writeHead(301, {Location: `${url}${request.url}`});
      response.end();
    });
    await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
    try {
      const {port} = /** @type {import('node:net').AddressInfo} */ (server.address());
      const redirected = new LockClient({url: `http://127.0.0.1:${port}`, namespace: 'js-test'});
      await assert.rejects(redirected.acquire(newKey('redirect'), {timeout: 0}), (error) => {
        assert.ok(error instanceof StoreError);
        assert.equal(error.status, 301);
        assert.match(error.message, /with a redirect to http:\/\/127\.0\.0\.1/);
        return true;
      });
    } finally {
      server.close();
    }
  });
});

describe('a release and a renewal of one lease under way together', {skip}, () => {
  /**
   * Two connections, two paths: a renewal reaches the server 100 ms late, and the reply to
   * a release comes back 300 ms late. Sent at once, the release lands first, and the
   * renewal after it is refused (lock_lost) before the release's reply is in.
   */
  const slowPaths = async (target, init, real) => {
    const path = new URL(target).pathname;
    if (path === '/v1/renew') await sleep(100);
    const reply = await real(target, init);
    if (path === '/v1/release') await sleep(300);
    return reply;
  };

  test('a release waits for the renewal under way: the lease is released, not lost', async () => {
    const lease = await client().acquire(newKey('renew-then-release'), {ttl: 10, timeout: 0});
    const [renewal, release] = await withFetch(slowPaths, () =>
      Promise.allSettled([lease.renew(), lease.release()]),
    );
    assert.equal(renewal.status, 'fulfilled', `the renewal: ${renewal.reason}`);
    assert.equal(release.status, 'fulfilled', `the release: ${release.reason}`);
    assert.equal(lease.lost, false);
    assert.equal(lease.signal.aborted, false, `the lease's signal: ${lease.signal.reason}`);
    assert.equal(await client().holder(lease.key), null);
  });

  test('a renewal asked while a release is under way finds the lease released, not lost', async () => {
    const lease = await client().acquire(newKey('release-then-renew'), {ttl: 10, timeout: 0});
    const [release, renewal] = await withFetch(slowPaths, () =>
      Promise.allSettled([lease.release(), lease.renew()]),
    );
    assert.equal(release.status, 'fulfilled', `the release: ${release.reason}`);
    assert.ok(renewal.status === 'rejected' && renewal.reason instanceof LockLost);
    assert.match(renewal.reason.message, /already released/);
    assert.equal(lease.lost, false);
    assert.equal(lease.signal.aborted, false, `the lease's signal: ${lease.signal.reason}`);
  });

  test("withLock: fn's own renewal under way as fn releases calls no onLost", async () => {
    let lostCalls = 0;
    const result = await withFetch(slowPaths, () =>
      client().withLock(
        newKey('fn-renews-and-releases'),
        async (lease) => {
          // A heartbeat of fn's own, under way as fn releases the lease.
          const heartbeat = lease.renew().then(() => 'renewed', (error) => error);
          await lease.release();
          return heartbeat;
        },
        {ttl: 10, timeout: 0, onLost: () => lostCalls++},
      ),
    );
    assert.equal(lostCalls, 0, 'onLost was called for a lease fn released');
    assert.equal(result, 'renewed');
  });
});

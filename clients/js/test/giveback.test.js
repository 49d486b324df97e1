// Giving back what the server may hold for a token nobody will use, as the Python client
// does (keymutex._giveback): the grant of an acquire whose reply was lost, a lease whose
// release met an outage. Released at once, then 0.1, 0.4, 1.3, 4 … s after the failure,
// and a last time at the ttl, until a release lands. Against a live lock server behind a
// proxy that refuses connections for a while (KEYMUTEX_URL), and fake servers that
// answer what a test needs. The tests run concurrently: each one waits for seconds.
import assert from 'node:assert/strict';
import {spawn} from 'node:child_process';
import {randomUUID} from 'node:crypto';
import http from 'node:http';
import net from 'node:net';
import {describe, test} from 'node:test';
import {setTimeout as sleep} from 'node:timers/promises';

import {LockClient, StoreError} from '../keymutex.js';

const url = process.env.KEYMUTEX_URL;
const skip = url ? false : 'KEYMUTEX_URL is not set (start `keymutex serve` and point it there)';
const run = randomUUID().slice(0, 8);
let serial = 0;
const newKey = (name) => `js:${run}:${name}:${++serial}`;
const client = (options = {}) => new LockClient({url, namespace: 'js-test', ...options});

const TOKEN = 'A'.repeat(22);
// What a failed release of a lease the client granted says.
const TRIED_AGAIN = /keymutex tries the release again in the background until it lands/;
// How long the proxy refuses connections: an outage that ends long before any ttl here.
const OUTAGE_MS = 1500;

/** Polls `check` until it resolves to true, for up to `seconds`. */
async function eventually(check, seconds) {
  const deadline = performance.now() + seconds * 1000;
  while (!(await check())) {
    if (performance.now() > deadline) return false;
    await sleep(50);
  }
  return true;
}

/**
 * The outage ends (the proxy lets connections through again); the key must then be
 * freed by the client's give-backs within 8 s, long before its ttl of 30 s.
 * @param {{restore: () => Promise<void>}} proxy
 * @param {string} key
 */
async function assertFreedAfterOutage(proxy, key) {
  await sleep(OUTAGE_MS);
  await proxy.restore();
  const freed = await eventually(async () => (await client().holder(key)) === null, 8);
  assert.ok(freed, 'the key is still held, to its ttl of 30 s');
}

/**
 * A TCP proxy to the lock server that can stop for a while: cut() refuses connections
 * and cuts the open ones (a server restarting, a network blip); restore() accepts them
 * again, on the same port. dropReply(): the next reply is dropped on its way back, the
 * request having reached the server, and the proxy is cut at that moment.
 */
async function outageProxy() {
  const target = new URL(url);
  const sockets = new Set();
  let dropping = false;
  /** @type {net.Server} */
  let server;
  let port = 0;
  const cut = () => {
    server.close();
    for (const socket of sockets) socket.destroy();
  };
  const onConnection = (socket) => {
    const upstream = net.connect(Number(target.port), target.hostname);
    for (const end of [socket, upstream]) {
      sockets.add(end);
      end.on('error', () => {});
      end.on('close', () => sockets.delete(end));
    }
    socket.pipe(upstream);
    upstream.on('data', (data) => {
      if (dropping) {
        dropping = false;
        cut();
      } else socket.write(data);
    });
    upstream.on('end', () => socket.end());
  };
  const listen = () =>
    new Promise((resolve) => {
      server = net.createServer(onConnection);
      server.listen(port, '127.0.0.1', () => {
        port = server.address().port;
        resolve(undefined);
      });
    });
  await listen();
  return {
    url: `http://127.0.0.1:${port}`,
    cut,
    restore: listen,
    dropReply: () => {
      dropping = true;
    },
    close: cut,
  };
}

describe('giving back', {concurrency: true}, () => {
  describe('after an outage, against a live server', {skip, concurrency: true}, () => {
    test('a release that met the outage lands once the server is back, long before the ttl', async () => {
      const proxy = await outageProxy();
      try {
        const key = newKey('release-outage');
        const lease = await new LockClient({url: proxy.url, namespace: 'js-test'}).acquire(key, {ttl: 30, timeout: 0});
        proxy.cut();
        await assert.rejects(lease.release(), (error) => {
          assert.ok(error instanceof StoreError, `expected a StoreError, got ${error}`);
          assert.match(error.message, TRIED_AGAIN);
          return true;
        });
        // It counts as released: nothing renews it, and it is not lost.
        assert.equal(lease.lost, false);
        await assert.rejects(lease.release(), /already released/);
        assert.equal((await client().holder(key))?.fence, lease.fence, 'held still, until the server is back');
        await assertFreedAfterOutage(proxy, key);
      } finally {
        proxy.close();
      }
    });

    test('withLock that ends in the outage: its release lands once the server is back', async () => {
      const proxy = await outageProxy();
      try {
        const key = newKey('withlock-outage');
        const locks = new LockClient({url: proxy.url, namespace: 'js-test'});
        const outcome = locks.withLock(key, () => proxy.cut(), {ttl: 30, timeout: 0});
        await assert.rejects(outcome, (error) => error instanceof StoreError && TRIED_AGAIN.test(error.message));
        assert.notEqual(await client().holder(key), null);
        await assertFreedAfterOutage(proxy, key);
      } finally {
        proxy.close();
      }
    });

    test('an acquire whose reply was lost in a network blip: the grant is given back after it', async () => {
      const proxy = await outageProxy();
      try {
        const key = newKey('lost-reply-blip');
        proxy.dropReply();
        await assert.rejects(
          new LockClient({url: proxy.url, namespace: 'js-test'}).acquire(key, {ttl: 30, timeout: 0}),
          (error) => error instanceof StoreError && error.code === 'unreachable',
        );
        assert.notEqual(await client().holder(key), null, 'the server granted what the client never saw');
        await assertFreedAfterOutage(proxy, key);
      } finally {
        proxy.close();
      }
    });
  });

  describe('the releases, seen by a fake server', {concurrency: true}, () => {
    /**
     * A server that answers each request with `answer(path, body)`: [status, reply].
     * @param {(path: string, body: any) => [number, unknown]} answer
     */
    async function fakeServer(answer) {
      /** @type {{path: string, body: any, at: number}[]} */
      const requests = [];
      const server = http.createServer(async (request, response) => {
        let text = '';
        for await (const chunk of request) text += chunk;
        const path = new URL(request.url, 'http://x').pathname;
        const body = text ? JSON.parse(text) : null;
        requests.push({path, body, at: performance.now()});
        const [status, reply] = answer(path, body);
        response.writeHead(status, {'Content-Type': 'application/json'});
        response.end(JSON.stringify(reply));
      });
      await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
      return {
        url: `http://127.0.0.1:${server.address().port}`,
        requests,
        releases: () => requests.filter((request) => request.path === '/v1/release'),
        close: () => {
          server.closeAllConnections();
          server.close();
        },
      };
    }

    const unavailable = [503, {error: 'store_unavailable', message: 'the store is down'}];
    const nothingHeld = [409, {error: 'lock_lost', message: 'not held', holder: null}];
    /** A lease as the server grants it, to `body`'s key and token. */
    const granted = ({key, token, ttl = 30}) => [
      200,
      {key, token, owner: 'o', info: null, fence: 1, ttl, acquired_at: 1, expires_at: 1 + ttl, expires_in: ttl},
    ];

    test('at once, then 0.1, 0.4, 1.3 … s after the failure and a last time at the ttl', async () => {
      // The acquire fails (503) and nothing is held: each release finds nothing.
      const server = await fakeServer((path) => (path === '/v1/acquire' ? unavailable : nothingHeld));
      try {
        const failed = new LockClient({url: server.url}).acquire('k', {ttl: 3, timeout: 0});
        await assert.rejects(failed, StoreError);
        const start = server.requests[0].at;
        // Five releases, none early; how late each comes is the machine's (a loaded CI
        // host's timers fired one 0.47 s late): no upper bound on each but the count.
        assert.ok(await eventually(() => server.releases().length >= 5, 10), 'five releases');
        await sleep(500); // and no sixth: the last is at the ttl
        const times = server.releases().map((request) => (request.at - start) / 1000);
        assert.equal(times.length, 5, `releases at ${times.map((t) => t.toFixed(2))} s`);
        [0, 0.1, 0.4, 1.3, 3].forEach((due, index) => {
          assert.ok(times[index] >= due - 0.02, `release ${index} at ${times[index]} s, due at ${due} s`);
        });
        assert.ok(server.releases().every((request) => request.body.token === server.requests[0].body.token));
      } finally {
        server.close();
      }
    });

    test('until one release lands', async () => {
      let releases = 0;
      const server = await fakeServer((path) => {
        if (path === '/v1/acquire') return unavailable;
        return ++releases < 3 ? unavailable : [200, {released: true}];
      });
      try {
        await assert.rejects(new LockClient({url: server.url}).acquire('k', {ttl: 30, timeout: 0}), StoreError);
        await sleep(1700); // past the fourth release's time (1.3 s)
        assert.equal(server.releases().length, 3);
      } finally {
        server.close();
      }
    });

    test('a failed release is tried again for a lease the client granted, not for a named token', async () => {
      const server = await fakeServer((path, body) => {
        if (path === '/v1/acquire' || path === '/v1/renew') return granted(body);
        return unavailable;
      });
      try {
        const locks = new LockClient({url: server.url});
        const named = await locks.renew('named', TOKEN); // a lease another client granted
        const notTriedAgain = (error) => error instanceof StoreError && !TRIED_AGAIN.test(error.message);
        await assert.rejects(named.release(), notTriedAgain);
        await assert.rejects(locks.release('stateless', TOKEN), notTriedAgain);
        const lease = await locks.acquire('drawn', {timeout: 0});
        await assert.rejects(lease.release(), TRIED_AGAIN);
        await sleep(600); // past the third release's time (0.4 s)
        const releasesOf = (key) => server.releases().filter((request) => request.body.key === key).length;
        assert.equal(releasesOf('named'), 1);
        assert.equal(releasesOf('stateless'), 1);
        assert.equal(releasesOf('drawn'), 4, 'the release, then again at once, 0.1 and 0.4 s after it');
      } finally {
        server.close();
      }
    });

    test('a give-back that waits does not keep a Node process alive', async () => {
      const server = await fakeServer(() => unavailable);
      try {
        const module = new URL('../keymutex.js', import.meta.url).href;
        const script = `
          import {LockClient} from ${JSON.stringify(module)};
          try {
            await new LockClient({url: ${JSON.stringify(server.url)}}).acquire('k', {ttl: 30, timeout: 0});
          } catch (error) {
            console.log(error.name);
          }`;
        const child = spawn(process.execPath, ['--input-type=module', '-e', script], {
          stdio: ['ignore', 'pipe', 'inherit'],
        });
        let output = '';
        child.stdout.on('data', (chunk) => (output += chunk));
        const killer = setTimeout(() => child.kill(), 10_000);
        const started = performance.now();
        const [code, signal] = await new Promise((resolve) => child.on('exit', (...end) => resolve(end)));
        clearTimeout(killer);
        const seconds = (performance.now() - started) / 1000;
        assert.equal(output.trim(), 'StoreError');
        assert.deepEqual([code, signal], [0, null]);
        assert.ok(seconds < 5, `the process ended ${seconds} s after it started`);
        assert.ok(server.releases().length >= 1, 'no give-back had begun');
      } finally {
        server.close();
      }
    });
  });
});

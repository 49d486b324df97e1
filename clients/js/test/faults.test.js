// A lock server that misbehaves: one that accepts requests and never answers, and one
// whose replies are not what the HTTP API promises. The client must fail with a
// StoreError, in bounded time (with the status of a reply that came), and never take
// nonsense for an answer.
import assert from 'node:assert/strict';
import http from 'node:http';
import net from 'node:net';
import {after, before, describe, test} from 'node:test';
import {setTimeout as sleep} from 'node:timers/promises';

import {LockClient, StoreError} from '../keymutex.js';

const TOKEN = 'A'.repeat(22);

/** @param {net.Server} server */
async function listen(server) {
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  return `http://127.0.0.1:${server.address().port}`;
}

/** @param {() => Promise<unknown>} call */
async function secondsUntilStoreError(call, code) {
  const started = performance.now();
  await assert.rejects(call, (error) => {
    assert.ok(error instanceof StoreError, `expected a StoreError, got ${error}`);
    assert.equal(error.code, code);
    assert.equal(error.status, null);
    return true;
  });
  return (performance.now() - started) / 1000;
}

describe('a server that accepts requests and never answers', () => {
  const sockets = new Set();
  // Reads whatever comes, answers nothing.
  const server = net.createServer((socket) => {
    sockets.add(socket);
    socket.on('data', () => {});
  });
  let locks;
  before(async () => {
    locks = new LockClient({url: await listen(server), requestTimeout: 0.3});
  });
  after(() => {
    for (const socket of sockets) socket.destroy();
    server.close();
  });

  test('each request fails with StoreError "timeout" after requestTimeout', async () => {
    const calls = [
      () => locks.acquire('k', {timeout: 0}),
      () => locks.renew('k', TOKEN),
      () => locks.release('k', TOKEN),
      () => locks.holder('k'),
      () => locks.holders(),
      () => locks.forceRelease('k', 'test'),
    ];
    for (const call of calls) {
      const seconds = await secondsUntilStoreError(call, 'timeout');
      assert.ok(seconds >= 0.25 && seconds < 2, `gave up after ${seconds} s`);
    }
  });

  test("a long poll gets its own wait on top of requestTimeout, and no more", async () => {
    const seconds = await secondsUntilStoreError(() => locks.acquire('k', {timeout: 0.6}), 'timeout');
    assert.ok(seconds >= 0.85 && seconds < 2.5, `acquire gave up after ${seconds} s`);
    const waited = await secondsUntilStoreError(() => locks.wait('k', null, 0.6), 'timeout');
    assert.ok(waited >= 0.85 && waited < 2.5, `wait gave up after ${waited} s`);
  });
});

describe('replies without the shape the API promises (200s, and 409 refusals)', () => {
  /** @type {{status: number, body: string}} */
  let reply;
  /** @type {{path: string, body: any}[]} */
  const requests = [];
  const server = http.createServer(async (request, response) => {
    let text = '';
    for await (const chunk of request) text += chunk;
    requests.push({path: new URL(request.url, 'http://x').pathname, body: text ? JSON.parse(text) : null});
    response.writeHead(reply.status, {'Content-Type': 'application/json'});
    response.end(reply.body);
  });
  let locks;
  before(async () => {
    locks = new LockClient({url: await listen(server)});
  });
  after(() => server.close());

  /**
   * @param {string} body the reply's body
   * @param {() => Promise<unknown>} call
   * @param {number} [status] the reply's HTTP status
   */
  async function refused(body, call, status = 200) {
    reply = {status, body};
    await assert.rejects(call, (error) => {
      assert.ok(error instanceof StoreError, `${body}: expected a StoreError, got ${error}`);
      assert.match(error.message, /unexpected .* from the lock server/);
      assert.equal(error.status, status, `${body}: the status of the reply, which did come`);
      return true;
    });
  }

  const holder = {key: 'k', owner: 'o', info: null, fence: 1, acquired_at: 1, expires_at: 31, expires_in: 30};

  test("a proxy's JSON error is a plain StoreError, whatever its status", async () => {
    for (const status of [400, 401, 403, 409, 413, 502]) {
      for (const body of ['{"detail": "proxy auth"}', '{"error": "", "message": ""}', '[]']) {
        reply = {status, body};
        await assert.rejects(
          () => locks.holder('k'),
          (error) => {
            assert.equal(error.constructor, StoreError, `${status} ${body}: ${error}`);
            assert.equal(error.code, null);
            assert.equal(error.status, status);
            assert.match(error.message, /not the lock server's answer: a proxy in between\?/);
            return true;
          },
        );
      }
    }
  });

  test('holder', async () => {
    await refused('null', () => locks.holder('k'));
    await refused('[]', () => locks.holder('k'));
    await refused('{}', () => locks.holder('k'));
    await refused('{"holder": {"key": "k"}}', () => locks.holder('k'));
    await refused(JSON.stringify({holder: {...holder, fence: '1'}}), () => locks.holder('k'));
  });

  test('wait', async () => {
    await refused('{}', () => locks.wait('k', null, 0));
    await refused('{"changed": "yes", "holder": null}', () => locks.wait('k', null, 0));
  });

  test('release and force-release', async () => {
    await refused('null', () => locks.release('k', TOKEN));
    await refused('{}', () => locks.release('k', TOKEN));
    await refused('{}', () => locks.forceRelease('k', 'test'));
  });

  test('a lease without its ttl or expiry, or with another token, is refused and given back', async () => {
    requests.length = 0;
    await refused(JSON.stringify({key: 'k', token: TOKEN, fence: 1}), () => locks.acquire('k', {timeout: 0}));
    const sent = requests[0].body.token;
    await refused(JSON.stringify({...holder, token: TOKEN, ttl: 30}), () => locks.acquire('k', {timeout: 0}));
    await refused(JSON.stringify({...holder, ttl: 30}), () => locks.renew('k', TOKEN));
    await refused('{}', () => locks.acquire('k', {timeout: 0}));
    await sleep(100);
    // The server may have granted what it answered so badly: the client releases it by
    // the token it sent (never with the token of the reply).
    const releases = requests.filter((request) => request.path === '/v1/release');
    assert.ok(releases.length >= 2, `releases: ${JSON.stringify(requests)}`);
    assert.equal(releases[0].body.token, sent);
  });

  test('a 409 refusal without the holder it names: a StoreError with status 409, nothing given back', async () => {
    requests.length = 0;
    await refused('{"error": "locked"}', () => locks.acquire('k', {timeout: 0}), 409);
    // (The releases of the test before go on in the background: they are not this one's.)
    const sent = requests.find((request) => request.path === '/v1/acquire').body.token;
    await refused('{"error": "locked", "holder": {"key": "k"}}', () => locks.acquire('k', {timeout: 0}), 409);
    await refused('{"error": "lock_lost"}', () => locks.renew('k', TOKEN), 409);
    await refused('{"error": "lock_lost", "holder": 1}', () => locks.release('k', TOKEN), 409);
    await sleep(100);
    // The server answered no: there is no grant to give back.
    const releases = requests.filter((request) => request.path === '/v1/release' && request.body.token === sent);
    assert.deepEqual(releases, []);
  });

  test("a lease's token is not shown in the error", async () => {
    reply = {status: 200, body: JSON.stringify({...holder, token: 'secret'.repeat(4), ttl: 'x'})};
    await assert.rejects(locks.renew('k', 'secret'.repeat(4)), (error) => !error.message.includes('secret'));
  });
});

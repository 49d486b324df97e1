// Bad arguments throw TypeError / RangeError before any request. The client points at
// a port nobody listens on: had a request been sent, the error would be a StoreError.
import assert from 'node:assert/strict';
import {describe, test} from 'node:test';

import {LockClient, LockError} from '../keymutex.js';

const client = new LockClient({url: 'http://127.0.0.1:9'});
const TOKEN = 'A'.repeat(22);

/**
 * @param {() => Promise<unknown> | unknown} call
 * @param {typeof TypeError | typeof RangeError} type
 * @param {RegExp} message
 */
async function rejects(call, type, message) {
  await assert.rejects(
    async () => call(),
    (error) => {
      assert.ok(error instanceof type, `expected ${type.name}, got ${error}`);
      assert.ok(!(error instanceof LockError), 'a bad argument is not a LockError');
      assert.match(error.message, message);
      return true;
    },
  );
}

describe('keys', () => {
  test('must be non-empty strings', async () => {
    await rejects(() => client.acquire(''), RangeError, /key must not be empty/);
    await rejects(() => client.acquire(42), TypeError, /key must be a string, not 42/);
    await rejects(() => client.holder(undefined), TypeError, /key must be a string/);
  });
  test('must be at most 1024 bytes as UTF-8', async () => {
    await client.holder('é'.repeat(512)).catch((error) => assert.ok(!(error instanceof RangeError)));
    await rejects(() => client.acquire('é'.repeat(513)), RangeError, /key is 1026 bytes as UTF-8; at most 1024/);
  });
  test('must not hold NUL or lone surrogates', async () => {
    await rejects(() => client.acquire('a\0b'), RangeError, /key must not contain NUL/);
    await rejects(() => client.acquire('a\uD800b'), RangeError, /key .*lone surrogate/);
    await rejects(() => client.release('\uDC00', TOKEN), RangeError, /lone surrogate/);
  });
  test('prefixes may be empty but follow the same rules', async () => {
    await rejects(() => client.holders(7), TypeError, /prefix must be a string/);
    await rejects(() => client.holders('x'.repeat(1025)), RangeError, /prefix is 1025 bytes/);
  });
});

describe('times', () => {
  test('ttl is a number in (0, 86400]', async () => {
    for (const ttl of [0, -1, 86400.5, Infinity]) {
      await rejects(() => client.acquire('k', {ttl}), RangeError, /ttl must be greater than 0 and at most 86400/);
    }
    await rejects(() => client.acquire('k', {ttl: NaN}), RangeError, /ttl must be a number of seconds, not NaN/);
    await rejects(() => client.acquire('k', {ttl: '5'}), TypeError, /ttl must be a number of seconds, not "5"/);
    await rejects(() => client.renew('k', TOKEN, {ttl: true}), TypeError, /ttl must be a number/);
  });
  test('timeout is null, 0 or finite seconds', async () => {
    await rejects(() => client.acquire('k', {timeout: -0.5}), RangeError, /timeout must be null .* not -0.5/);
    await rejects(() => client.acquire('k', {timeout: Infinity}), RangeError, /timeout must be null/);
    await rejects(() => client.wait('k', null, NaN), RangeError, /timeout must be a number of seconds, not NaN/);
    await rejects(() => client.acquire('k', {timeout: false}), TypeError, /timeout must be a number/);
  });
  test('ttl is at least 1 ms, as the server takes it', async () => {
    for (const ttl of [0.0009, 1e-5, Number.MIN_VALUE]) {
      await rejects(() => client.acquire('k', {ttl}), RangeError, /ttl must be at least 0.001 s \(1 ms\)/);
      await rejects(() => client.renew('k', TOKEN, {ttl}), RangeError, /ttl must be at least 0.001 s/);
      await rejects(() => client.withLock('k', () => 1, {ttl}), RangeError, /ttl must be at least 0.001 s/);
    }
  });
  test('a client-wide ttl is checked when the client is made', () => {
    assert.throws(() => new LockClient({url: 'http://127.0.0.1:9', ttl: 0}), RangeError);
    assert.throws(() => new LockClient({url: 'http://127.0.0.1:9', ttl: 0.0005}), RangeError, /at least 0.001 s/);
  });
  test('requestTimeout is finite seconds > 0', () => {
    for (const requestTimeout of [0, -1, Infinity, 86401]) {
      assert.throws(() => new LockClient({url: 'http://h', requestTimeout}), RangeError, /requestTimeout must be greater than 0/);
    }
    assert.throws(() => new LockClient({url: 'http://h', requestTimeout: NaN}), RangeError, /not NaN/);
    assert.throws(() => new LockClient({url: 'http://h', requestTimeout: '5'}), TypeError, /requestTimeout must be a number/);
  });
});

describe('info', () => {
  test('is a plain JSON object', async () => {
    await rejects(() => client.acquire('k', {info: 'Alice'}), TypeError, /info must be a plain object or null/);
    await rejects(() => client.acquire('k', {info: ['Alice']}), TypeError, /info must be a plain object/);
    await rejects(() => client.acquire('k', {info: {when: new Date()}}), TypeError, /info\.when is an object \(Date\)/);
    await rejects(() => client.acquire('k', {info: {f: () => 1}}), TypeError, /info\.f is function/);
    await rejects(() => client.acquire('k', {info: {n: 1n}}), TypeError, /info\.n is bigint/);
    await rejects(() => client.acquire('k', {info: {u: undefined}}), TypeError, /info\.u is undefined/);
  });
  test('has no NaN, infinity or cycles', async () => {
    await rejects(() => client.acquire('k', {info: {a: [1, NaN]}}), RangeError, /info\.a\[1\] is NaN/);
    const cycle = {name: 'x'};
    cycle.self = cycle;
    await rejects(() => client.acquire('k', {info: cycle}), RangeError, /info\.self refers to itself/);
  });
  test('is at most 4 KiB as JSON', async () => {
    await rejects(() => client.acquire('k', {info: {text: 'x'.repeat(4096)}}), RangeError, /info is 4107 bytes as JSON; at most 4096/);
  });
  test('is nested at most 32 levels, itself the first', async () => {
    // Objects and arrays count alike; what they hold at the 33rd level may be a string.
    const nested = (levels) => {
      let value = 'bottom';
      for (let level = levels; level > 1; level--) value = level % 2 ? [value] : {a: value};
      return {a: value};
    };
    await rejects(() => client.acquire('k', {info: nested(33)}), RangeError, /info is nested more than 32 levels deep .*at most 32/);
    await rejects(() => client.withLock('k', () => 1, {info: nested(33)}), RangeError, /nested more than 32 levels/);
    // Deeper still: refused as such, not with a stack overflow.
    await rejects(() => client.acquire('k', {info: nested(100_000)}), RangeError, /nested more than 32 levels/);
    // 32 levels: sent (the request then fails: nobody listens on port 9).
    await assert.rejects(client.acquire('k', {info: nested(32)}), (error) => error instanceof LockError);
  });
  test('is measured as the server measures it: numbers as Python writes them', async () => {
    // JSON.stringify writes 1e-7 where Python writes 1e-07: 3417 bytes here, 4099 there.
    const tiny = {x: Array(682).fill(1e-7)};
    await rejects(() => client.acquire('k', {info: tiny}), RangeError, /info is 4099 bytes as JSON; at most 4096/);
    // And 0.00001 where Python writes 1e-05: 5463 bytes here, 4099 there.
    await rejects(() => client.acquire('k', {info: {x: Array(682).fill(1e-5)}}), RangeError, /info is 4099 bytes/);
    // 4093 bytes there: sent (the request then fails: nobody listens on port 9).
    const small = {x: Array(681).fill(1e-5)};
    await assert.rejects(client.acquire('k', {info: small}), (error) => error instanceof LockError);
  });
});

describe('other arguments', () => {
  test('tokens are URL-safe strings', async () => {
    await rejects(() => client.renew('k', ''), RangeError, /token must be 1 to 256 URL-safe characters/);
    await rejects(() => client.release('k', 'a b'), RangeError, /token must be 1 to 256 URL-safe/);
    await rejects(() => client.release('k', null), TypeError, /token must be a string, not null/);
  });
  test('steal is a boolean, signal an AbortSignal', async () => {
    await rejects(() => client.acquire('k', {steal: 1}), TypeError, /steal must be true or false, not 1/);
    await rejects(() => client.acquire('k', {signal: 'stop'}), TypeError, /signal must be an AbortSignal/);
  });
  test('unknown options are refused by name', async () => {
    await rejects(() => client.acquire('k', {ttL: 5}), TypeError, /acquire: unknown option "ttL"; accepted: ttl, timeout/);
    await rejects(() => client.renew('k', TOKEN, {timeout: 1}), TypeError, /renew: unknown option "timeout"/);
    await rejects(() => client.acquire('k', 5), TypeError, /acquire: options must be an object, not 5/);
  });
  test('wait needs a fence from a holder, or null', async () => {
    await rejects(() => client.wait('k', -1, 1), RangeError, /fence must be null or a non-negative integer/);
    await rejects(() => client.wait('k', 1.5, 1), RangeError, /fence must be null or a non-negative integer/);
    await rejects(() => client.wait('k', '3', 1), TypeError, /fence must be null or the fence number/);
  });
  test('wait holding: true or false, and only with the fence of the caller\'s lease', async () => {
    await rejects(() => client.wait('k', 3, 1, {holding: 'yes'}), TypeError, /holding must be true or false, not "yes"/);
    await rejects(() => client.wait('k', null, 1, {holding: true}), TypeError, /holding: true needs fence/);
  });
  test('withLock needs a function; onLost too', async () => {
    await rejects(() => client.withLock('k', 'go'), TypeError, /fn must be a function, not "go"/);
    await rejects(() => client.withLock('k', () => 1, {onLost: 1}), TypeError, /onLost must be a function/);
  });
  test('force release needs a reason of valid text', async () => {
    await rejects(() => client.forceRelease('k', 'why\uD800'), RangeError, /reason must be valid Unicode text; it contains a lone surrogate/);
    await rejects(() => client.forceRelease('k', '\uDC00'), RangeError, /lone surrogate/);
    await rejects(() => client.forceRelease('k', 'a\0b'), RangeError, /reason must not contain NUL/);
  });
  test('force release takes the fence of the lease to release, if any', async () => {
    await rejects(() => client.forceRelease('k', 'why', {fence: -1}), RangeError, /fence must be null or a non-negative integer/);
    await rejects(() => client.forceRelease('k', 'why', {fence: '3'}), TypeError, /fence must be null or the fence number/);
    await rejects(() => client.forceRelease('k', 'why', {token: 'x'}), TypeError, /forceRelease: unknown option "token"; accepted: fence/);
    await client.forceRelease('k', 'why', {fence: 3}).catch((error) => assert.ok(error instanceof LockError));
  });
  test('force release needs a reason of 1 to 500 characters', async () => {
    await rejects(() => client.forceRelease('k', ''), RangeError, /reason must be 1 to 500 characters, not 0/);
    await rejects(() => client.forceRelease('k', '   '), RangeError, /reason must say why, not be blank/);
    await rejects(() => client.forceRelease('k', '\x1f\x85'), RangeError, /not be blank/); // blank to Python
    await rejects(() => client.forceRelease('k', '😀'.repeat(501)), RangeError, /not 501/);
    await client.forceRelease('k', '😀'.repeat(500)).catch((error) => assert.ok(error instanceof LockError));
  });
  test('the client checks its own settings', () => {
    assert.throws(() => new LockClient(), TypeError, /url must be a string or URL/);
    assert.throws(() => new LockClient({url: 'ftp://host'}), /url must start with http:\/\/ or https:\/\//);
    assert.throws(() => new LockClient({url: 'not a url'}), /url does not parse/);
    assert.throws(
      () => new LockClient({url: 'http://alice:s3cret@host:port'}),
      (error) => error instanceof RangeError && /does not parse/.test(error.message) && !error.message.includes('s3cret'),
    );
    assert.throws(() => new LockClient({url: 'http://h/?x=1'}), /must not contain credentials, a query/);
    assert.throws(() => new LockClient({url: 'http://h', namespace: 'n'.repeat(257)}), /namespace is 257 bytes/);
    assert.throws(() => new LockClient({url: 'http://h', token: 'x'}), /unknown option "token"; accepted: url, namespace, apiToken/);
    assert.equal(new LockClient({url: 'http://h:1/locks/'}).url, 'http://h:1/locks');
  });
  test('the API token must be a valid HTTP header value: visible ASCII', () => {
    for (const apiToken of ['tökén'.repeat(8), 'secret\r\nX-Evil: 1', 'with space'.repeat(4), '\t'.repeat(40), '']) {
      assert.throws(() => new LockClient({url: 'http://h', apiToken}), RangeError, /apiToken must be 1 to 4096 visible ASCII/);
    }
    assert.throws(() => new LockClient({url: 'http://h', apiToken: 42}), TypeError, /apiToken must be a string or null/);
    new LockClient({url: 'http://h', apiToken: 'editor-token-0123456789abcdefghijk~!/+='});
  });
});

test('an unreachable server is a StoreError naming the URL', async () => {
  const {StoreError} = await import('../keymutex.js');
  await assert.rejects(client.holder('k'), (error) => {
    assert.ok(error instanceof StoreError);
    assert.equal(error.status, null);
    assert.match(error.message, /cannot reach the lock server at http:\/\/127\.0\.0\.1:9/);
    return true;
  });
});

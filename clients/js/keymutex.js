// keymutex-client: lease locks on a keymutex lock server, over its HTTP API (v1).
//
// One ES module without dependencies, for Node >= 18 and browsers (it only needs
// fetch, AbortController, TextEncoder, performance.now, Date.now, btoa and
// crypto.getRandomValues).
// The lock server serves this very file as /static/keymutex.js
// (src/keymutex/server/static/ links here).
//
//   const locks = new LockClient({url: 'http://127.0.0.1:7420', namespace: 'shop'});
//   await locks.withLock(`user:${id}`, async (lease) => { ... }, {ttl: 10, timeout: 5});
//
// The semantics are those of the Python `keymutex.Locks` (docs/http-api.md, API.md):
// a lock is a lease that expires unless renewed; only the token's holder may renew
// or release it; every grant carries a fencing number larger than any before it.
//
// Errors:
//   LockError                 base of everything this client throws on purpose
//   ├── Locked                not acquired within timeout; .key, .holder (Holder | null)
//   ├── LockLost              the lease no longer holds its key; .key, .holder (new holder | null)
//   └── StoreError            the server failed, was unreachable or refused; .status, .code
//       │                     (.code "unreachable" or "timeout" when no reply came)
//       ├── InvalidArgument   the server rejected an argument (HTTP 400, 413, 415)
//       ├── Unauthorized      missing or unknown API token (HTTP 401)
//       └── Forbidden         the API token lacks the permission (HTTP 403)
// Bad arguments are not LockErrors: they throw TypeError (wrong type) or RangeError
// (wrong value) before any request is sent, as Python raises TypeError / ValueError.

const MAX_KEY_BYTES = 1024;
const MAX_NAMESPACE_BYTES = 256;
const MAX_OWNER_BYTES = 256;
const MAX_INFO_BYTES = 4096;
// Objects and arrays nested in info, info itself the first (the server's MAX_INFO_DEPTH).
const MAX_INFO_DEPTH = 32;
const MIN_TTL = 0.001; // the server's range for ttl is [0.001, 86400]
const MAX_TTL = 86400;
const MAX_TOKEN_CHARS = 256;
const MAX_REASON_CHARS = 500;
const MAX_API_TOKEN_CHARS = 4096;
const DEFAULT_TTL = 30;
// Leases a client keeps (see LockClient.#leases) before it first sweeps out the lost.
const LEASES_SWEPT_FROM = 64;
// Seconds a request may take beyond a long poll's own wait, as the Python http:// store.
const DEFAULT_REQUEST_TIMEOUT = 10;
const MAX_REQUEST_TIMEOUT = 86400;
// Giving back (GiveBacks): ms from the first release of a token to the second, each wait
// then GIVE_BACK_GROWTH times the one before, as the Python client's (keymutex._giveback).
const GIVE_BACK_FIRST_WAIT = 100;
const GIVE_BACK_GROWTH = 3;
// Tokens a client gives back at once, at most: beyond, a grant is left to its ttl. Bounds
// the memory, and the releases once the server is back, of an application that retries
// failing acquires in a tight loop.
const GIVE_BACK_TOKENS = 10_000;
// Seconds asked of the server per long poll. The server answers after at most its own
// max_wait (30 s by default) anyway; the client loops until its own deadline.
const POLL_SECONDS = 60;
const TOKEN_PATTERN = /^[A-Za-z0-9_-]+$/;
// Random bytes of a lease token the client draws: 144 bits, 24 URL-safe characters, as
// the Python client's (the server takes 22 to 256 characters carrying 128 bits or more).
const TOKEN_BYTES = 18;
// What an HTTP header value may hold without being refused or changed on the way:
// visible ASCII (no spaces, controls or non-ASCII characters).
const HEADER_TOKEN_PATTERN = /^[\x21-\x7E]+$/;
// A lone surrogate: a high one not followed by a low one, or a low one not preceded by
// a high one (String.prototype.isWellFormed is missing from Node 18 and older browsers).
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;
const encoder = new TextEncoder();

// ---------------------------------------------------------------------------------
// Errors

/** Base of every error this client throws on purpose. */
export class LockError extends Error {
  /**
   * @param {string} message
   * @param {ErrorOptions} [options]
   */
  constructor(message, options) {
    super(message, options);
    this.name = new.target.name;
  }
}

/** @param {Holder | null} holder */
function describeHolder(holder) {
  return holder === null ? 'no current holder' : `held by ${holder.owner} (fence ${holder.fence})`;
}

/** The key was not acquired within the timeout; `holder` is who had it, if known. */
export class Locked extends LockError {
  /**
   * @param {string} key
   * @param {Holder | null} holder
   * @param {string} [message]
   */
  constructor(key, holder, message) {
    super(message ?? `${JSON.stringify(key)} is locked: ${describeHolder(holder)}`);
    /** @type {string} */
    this.key = key;
    /** @type {Holder | null} */
    this.holder = holder;
  }
}

/** The lease no longer holds its key; `holder` is the new holder, if any. */
export class LockLost extends LockError {
  /**
   * @param {string} key
   * @param {Holder | null} holder
   * @param {string} [message]
   */
  constructor(key, holder, message) {
    super(message ?? `lease on ${JSON.stringify(key)} was lost: ${describeHolder(holder)}`);
    /** @type {string} */
    this.key = key;
    /** @type {Holder | null} */
    this.holder = holder;
  }
}

/**
 * The lock server failed, could not be reached, or refused the request.
 * `status` is the HTTP status (null when no reply came), `code` the server's `error`
 * field (e.g. "store_unavailable"), null when there was none; `cause` the network error.
 */
export class StoreError extends LockError {
  /**
   * @param {string} message
   * @param {{status?: number | null, code?: string | null, cause?: unknown}} [details]
   */
  constructor(message, details = {}) {
    super(message, 'cause' in details ? {cause: details.cause} : undefined);
    /** @type {number | null} */
    this.status = details.status ?? null;
    /** @type {string | null} */
    this.code = details.code ?? null;
  }
}

/** The server rejected an argument (HTTP 400 invalid_argument, 413, 415). */
export class InvalidArgument extends StoreError {}

/** The server needs an API token and got none, or an unknown one (HTTP 401). */
export class Unauthorized extends StoreError {}

/** The API token has no such permission for this namespace and key (HTTP 403). */
export class Forbidden extends StoreError {}

// ---------------------------------------------------------------------------------
// Argument checks: they run before any request, and name the argument and the range.

/** @param {unknown} value */
function show(value) {
  if (value === null) return 'null';
  if (typeof value === 'string') return JSON.stringify(value.length > 40 ? `${value.slice(0, 40)}…` : value);
  if (Array.isArray(value)) return 'an array';
  if (typeof value === 'object') return `an object (${Object.prototype.toString.call(value).slice(8, -1)})`;
  if (typeof value === 'function') return 'a function';
  return String(value);
}

/**
 * @param {unknown} value
 * @param {string} name
 * @param {{allowEmpty: boolean, maxBytes: number}} limits
 * @returns {string}
 */
function checkText(value, name, {allowEmpty, maxBytes}) {
  if (typeof value !== 'string') throw new TypeError(`${name} must be a string, not ${show(value)}`);
  if (!value && !allowEmpty) throw new RangeError(`${name} must not be empty`);
  if (value.includes('\0')) throw new RangeError(`${name} must not contain NUL characters`);
  if (LONE_SURROGATE.test(value)) {
    throw new RangeError(`${name} must be valid Unicode text; it contains a lone surrogate`);
  }
  const size = encoder.encode(value).length;
  if (size > maxBytes) {
    throw new RangeError(`${name} is ${size} bytes as UTF-8; at most ${maxBytes} are accepted`);
  }
  return value;
}

/** @param {unknown} key */
function checkKey(key) {
  return checkText(key, 'key', {allowEmpty: false, maxBytes: MAX_KEY_BYTES});
}

/** @param {unknown} value @param {string} name */
function checkSeconds(value, name) {
  if (typeof value !== 'number') {
    throw new TypeError(`${name} must be a number of seconds, not ${show(value)}`);
  }
  if (Number.isNaN(value)) throw new RangeError(`${name} must be a number of seconds, not NaN`);
  return value;
}

/** @param {unknown} ttl @returns {number} */
function checkTtl(ttl) {
  const seconds = checkSeconds(ttl, 'ttl');
  if (!(seconds > 0 && seconds <= MAX_TTL)) {
    throw new RangeError(`ttl must be greater than 0 and at most ${MAX_TTL} seconds, not ${seconds}`);
  }
  if (seconds < MIN_TTL) {
    throw new RangeError(
      `ttl must be at least ${MIN_TTL} s (1 ms), not ${seconds}: a shorter lease would expire before it could be granted`,
    );
  }
  return seconds;
}

/** @param {unknown} value @returns {number} */
function checkRequestTimeout(value) {
  const seconds = checkSeconds(value, 'requestTimeout');
  if (!(seconds > 0 && seconds <= MAX_REQUEST_TIMEOUT)) {
    throw new RangeError(
      `requestTimeout must be greater than 0 and at most ${MAX_REQUEST_TIMEOUT} seconds, not ${seconds}`,
    );
  }
  return seconds;
}

/** @param {unknown} timeout @returns {number | null} null: wait as long as it takes */
function checkTimeout(timeout) {
  if (timeout === undefined || timeout === null) return null;
  const seconds = checkSeconds(timeout, 'timeout');
  if (!(seconds >= 0 && Number.isFinite(seconds))) {
    throw new RangeError(
      `timeout must be null (wait as long as it takes), 0 (try once) or finite seconds > 0, not ${seconds}`,
    );
  }
  return seconds;
}

/** @param {unknown} token */
function checkToken(token) {
  if (typeof token !== 'string') throw new TypeError(`token must be a string, not ${show(token)}`);
  if (!token || token.length > MAX_TOKEN_CHARS || !TOKEN_PATTERN.test(token)) {
    throw new RangeError(
      `token must be 1 to ${MAX_TOKEN_CHARS} URL-safe characters (A-Z a-z 0-9 - _) as returned in lease.token`,
    );
  }
  return token;
}

/**
 * @param {unknown} fence
 * @returns {number | null}
 */
function checkFence(fence) {
  if (fence === null) return null;
  if (typeof fence !== 'number') {
    throw new TypeError(`fence must be null or the fence number of a holder or lease, not ${show(fence)}`);
  }
  if (!(Number.isSafeInteger(fence) && fence >= 0)) {
    throw new RangeError(`fence must be null or a non-negative integer from a holder or lease, not ${fence}`);
  }
  return fence;
}

// What Python's str.strip() removes (the server refuses a reason of nothing else);
// JavaScript's trim() differs (it takes U+FEFF, leaves U+001C-U+001F and U+0085).
const PYTHON_BLANK = /^[\t\n\v\f\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]*$/;

/** @param {unknown} reason @returns {string} */
function checkReason(reason) {
  // No byte limit of its own: 500 characters are at most the server's 2000 bytes.
  checkText(reason, 'reason', {allowEmpty: true, maxBytes: Infinity});
  const length = [.../** @type {string} */ (reason)].length; // in code points, as Python's len()
  if (length < 1 || length > MAX_REASON_CHARS) {
    throw new RangeError(`reason must be 1 to ${MAX_REASON_CHARS} characters, not ${length}`);
  }
  if (PYTHON_BLANK.test(/** @type {string} */ (reason))) {
    throw new RangeError(`reason must say why, not be blank (${JSON.stringify(reason)})`);
  }
  return /** @type {string} */ (reason);
}

/** @param {unknown} apiToken @returns {string} */
function checkApiToken(apiToken) {
  if (typeof apiToken !== 'string') throw new TypeError(`apiToken must be a string or null, not ${show(apiToken)}`);
  if (apiToken.length > MAX_API_TOKEN_CHARS || !HEADER_TOKEN_PATTERN.test(apiToken)) {
    throw new RangeError(
      `apiToken must be 1 to ${MAX_API_TOKEN_CHARS} visible ASCII characters, as an HTTP header takes them` +
        ' (no spaces, control or non-ASCII characters)',
    );
  }
  return apiToken;
}

/**
 * @param {unknown} value
 * @param {string} path
 * @param {Set<object>} open the objects and arrays that hold `value`
 * @param {number} depth the level of `value`: info itself is 1
 */
function checkJsonValue(value, path, open, depth) {
  switch (typeof value) {
    case 'string':
      if (LONE_SURROGATE.test(value)) throw new RangeError(`${path} contains a lone surrogate`);
      return;
    case 'boolean':
      return;
    case 'number':
      if (!Number.isFinite(value)) throw new RangeError(`${path} is ${value}; JSON has no NaN or infinity`);
      return;
    case 'object': {
      if (value === null) return;
      if (open.has(value)) throw new RangeError(`${path} refers to itself; JSON cannot hold a cycle`);
      const proto = Object.getPrototypeOf(value);
      const plain = Array.isArray(value) || proto === Object.prototype || proto === null;
      if (!plain) {
        throw new TypeError(
          `${path} is ${show(value)}; info holds only plain objects, arrays, strings, finite numbers, booleans and null`,
        );
      }
      // As the server counts: a string or number on the 33rd level is fine, an empty
      // object is not. Checked here, the recursion stays shallow whatever info holds.
      if (depth > MAX_INFO_DEPTH) {
        throw new RangeError(
          `info is nested more than ${MAX_INFO_DEPTH} levels deep (of objects and arrays);` +
            ` at most ${MAX_INFO_DEPTH} are accepted`,
        );
      }
      open.add(value);
      if (Array.isArray(value)) {
        value.forEach((item, index) => checkJsonValue(item, `${path}[${index}]`, open, depth + 1));
      } else {
        for (const [name, item] of Object.entries(value)) {
          if (LONE_SURROGATE.test(name)) throw new RangeError(`${path} has a key with a lone surrogate`);
          checkJsonValue(item, `${path}.${name}`, open, depth + 1);
        }
      }
      open.delete(value);
      return;
    }
    default:
      throw new TypeError(
        `${path} is ${typeof value}; info holds only plain objects, arrays, strings, finite numbers, booleans and null`,
      );
  }
}

// A JSON string, or a JSON number, in JSON.stringify's output.
const JSON_STRING_OR_NUMBER = /"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:e[+-]?\d+)?/g;

/**
 * How the server writes a number that JSON.stringify wrote as `text`, once it has read
 * it: Python's json.dumps gives a float's exponent two digits at least and writes the
 * exponent form below 1e-4 (JSON.stringify: below 1e-6), so 1e-7 becomes 1e-07, and
 * 0.00001 becomes 1e-05. The digits are the same: both write the shortest that round-trip.
 * @param {string} text
 */
function asPythonWritesIt(text) {
  if (!/[.e]/.test(text)) return text; // an integer: Python reads and writes the same digits
  const [mantissa, exponent] = Number(text).toExponential().split('e');
  const power = Number(exponent);
  if (power >= -4 && power < 16) return text; // positional in both
  return `${mantissa}e${power < 0 ? '-' : '+'}${String(Math.abs(power)).padStart(2, '0')}`;
}

/**
 * The size of `value` as the server measures info: compact JSON as Python's json.dumps
 * writes it (which differs from JSON.stringify in numbers only), in UTF-8 bytes.
 * @param {unknown} value
 */
function serverJsonSize(value) {
  const text = JSON.stringify(value).replace(JSON_STRING_OR_NUMBER, (token) =>
    token.startsWith('"') ? token : asPythonWritesIt(token),
  );
  return encoder.encode(text).length;
}

/** @param {unknown} info @returns {Record<string, unknown> | null} */
function checkInfo(info) {
  if (info === undefined || info === null) return null;
  if (typeof info !== 'object' || Array.isArray(info)) {
    throw new TypeError(`info must be a plain object or null, not ${show(info)}`);
  }
  checkJsonValue(info, 'info', new Set(), 1);
  const size = serverJsonSize(info);
  if (size > MAX_INFO_BYTES) {
    throw new RangeError(`info is ${size} bytes as JSON; at most ${MAX_INFO_BYTES} are accepted`);
  }
  return /** @type {Record<string, unknown>} */ (info);
}

/** @param {unknown} value @param {string} name */
function checkBoolean(value, name) {
  if (value === undefined) return false;
  if (typeof value !== 'boolean') throw new TypeError(`${name} must be true or false, not ${show(value)}`);
  return value;
}

/** @param {unknown} signal @returns {AbortSignal | undefined} */
function checkSignal(signal) {
  if (signal === undefined || signal === null) return undefined;
  const looksLikeSignal =
    typeof signal === 'object' &&
    typeof (/** @type {any} */ (signal).aborted) === 'boolean' &&
    typeof (/** @type {any} */ (signal).addEventListener) === 'function';
  if (!looksLikeSignal) throw new TypeError(`signal must be an AbortSignal, not ${show(signal)}`);
  return /** @type {AbortSignal} */ (signal);
}

/**
 * @param {unknown} options
 * @param {string} method
 * @param {readonly string[]} allowed
 * @returns {Record<string, any>}
 */
function checkOptions(options, method, allowed) {
  if (options === undefined) return {};
  if (typeof options !== 'object' || options === null || Array.isArray(options)) {
    throw new TypeError(`${method}: options must be an object, not ${show(options)}`);
  }
  for (const name of Object.keys(options)) {
    if (!allowed.includes(name)) {
      throw new TypeError(`${method}: unknown option ${JSON.stringify(name)}; accepted: ${allowed.join(', ')}`);
    }
  }
  return /** @type {Record<string, any>} */ (options);
}

// ---------------------------------------------------------------------------------
// Values

/**
 * What anyone may see about a current lease; it never contains the token.
 * `acquiredAt` and `expiresAt` are the server's wall-clock UNIX seconds, for display;
 * `expiresIn` is the seconds that were left when the server answered.
 * @typedef {object} Holder
 * @property {string} key
 * @property {string} owner
 * @property {Record<string, unknown> | null} info
 * @property {number} fence
 * @property {number} acquiredAt
 * @property {number} expiresAt
 * @property {number} expiresIn
 */

/** @param {unknown} value @returns {value is Record<string, any>} */
function isObject(value) {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/** @param {unknown} value @returns {value is number} */
function isSeconds(value) {
  return typeof value === 'number' && Number.isFinite(value);
}

/**
 * A reply without the shape the HTTP API promises (a proxy's page, another server): the
 * client cannot tell what happened, so it is a StoreError rather than a guess, with the
 * reply's HTTP status. The value is shown without its token, if it has one: a secret.
 * @param {string} what
 * @param {unknown} value
 * @param {number} status the HTTP status of the reply
 */
function malformed(what, value, status) {
  const text = JSON.stringify(value, (name, item) => (name === 'token' ? '…' : item)) ?? String(value);
  const shown = text.length > 100 ? `${text.slice(0, 100)}…` : text;
  return new StoreError(`unexpected ${what} from the lock server: ${shown}`, {status});
}

/**
 * @param {unknown} wire a Holder object of the HTTP API
 * @param {number} status the HTTP status of the reply that holds it
 * @returns {Holder}
 */
function toHolder(wire, status) {
  const valid =
    isObject(wire) &&
    typeof wire.key === 'string' &&
    typeof wire.owner === 'string' &&
    (wire.info === null || isObject(wire.info)) &&
    Number.isSafeInteger(wire.fence) &&
    wire.fence >= 0 &&
    isSeconds(wire.acquired_at) &&
    isSeconds(wire.expires_at) &&
    isSeconds(wire.expires_in);
  if (!valid) throw malformed('holder', wire, status);
  return Object.freeze({
    key: wire.key,
    owner: wire.owner,
    info: wire.info,
    fence: wire.fence,
    acquiredAt: wire.acquired_at,
    expiresAt: wire.expires_at,
    expiresIn: wire.expires_in,
  });
}

/**
 * @param {unknown} wire a Holder object or null
 * @param {number} status the HTTP status of the reply that holds it
 * @returns {Holder | null}
 */
function toHolderOrNull(wire, status) {
  return wire === null ? null : toHolder(wire, status);
}

/**
 * The granted lease of a reply to an acquire or renew of `key` by `token`, checked.
 * @typedef {{holder: Holder, token: string, ttl: number}} Granted
 */

/**
 * @param {unknown} wire a Lease object of the HTTP API
 * @param {string} key
 * @param {string} token
 * @param {number} status the HTTP status of the reply
 * @returns {Granted}
 */
function toLease(wire, key, token, status) {
  const holder = toHolder(wire, status);
  const lease = /** @type {Record<string, any>} */ (wire);
  if (holder.key !== key || lease.token !== token || !(isSeconds(lease.ttl) && lease.ttl > 0)) {
    throw malformed('lease', lease, status);
  }
  return {holder, token, ttl: /** @type {number} */ (lease.ttl)};
}

/** @param {number} ms @param {AbortSignal | undefined} signal */
function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason);
      return;
    }
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort);
      resolve(undefined);
    }, ms);
    signal?.addEventListener('abort', onAbort, {once: true});
  });
}

/**
 * The clock of every time decision, in ms: performance.now(), moved on by the time the
 * machine spent suspended. performance.now() stops during a suspend in Node and in
 * Chromium on Linux and macOS, while the server's TTLs run on: a lease must be found
 * lost when the machine wakes, not a TTL later. A suspend shows as the wall clock
 * (Date.now) getting ahead of performance.now(); a lead of more than SUSPEND_MS is
 * added to this clock. A wall clock set back is ignored (the lead shrinks, and is
 * measured from there); one set forward by more than SUSPEND_MS ends leases early, on
 * the safe side. Never goes back.
 */
const SUSPEND_MS = 1000;
// Taken once: a test that mocks Date (fake timers, MockDate) must not make this client
// think the machine slept, and lose every lease it holds. A test of the suspend itself
// sets globalThis[Symbol.for('keymutex.wallClock')] to a clock of its own.
const WALL_CLOCK = Symbol.for('keymutex.wallClock');
const dateNow = Date.now.bind(Date);
/** @returns {number} */
const wallNow = () => {
  const clock = /** @type {Record<symbol, (() => number) | undefined>} */ (globalThis)[WALL_CLOCK];
  return clock === undefined ? dateNow() : clock();
};
let wallLead = wallNow() - performance.now();
let suspended = 0;
const now = () => {
  const perf = performance.now();
  const lead = wallNow() - perf;
  if (lead - wallLead > SUSPEND_MS) suspended += lead - wallLead;
  if (lead - wallLead > SUSPEND_MS || lead < wallLead) wallLead = lead;
  return perf + suspended;
};

/**
 * A signal that aborts when `signal` does (with its reason), or after `ms` (with
 * `timedOut()`); clear() ends the timer and the listener. Made by hand: AbortSignal.any
 * is missing from Node 18.
 * @param {AbortSignal | undefined} signal
 * @param {number} ms
 * @param {() => Error} timedOut
 */
function withTimeout(signal, ms, timedOut) {
  const controller = new AbortController();
  const follow = () => controller.abort(signal?.reason);
  if (signal?.aborted) follow();
  else signal?.addEventListener('abort', follow, {once: true});
  const timer = setTimeout(() => controller.abort(timedOut()), ms);
  return {
    signal: controller.signal,
    clear() {
      clearTimeout(timer);
      signal?.removeEventListener('abort', follow);
    },
  };
}

/**
 * A new lease token: TOKEN_BYTES random bytes as URL-safe base64. The client draws its
 * own, as the Python client does, so that it can ask again for the same grant.
 * @returns {Promise<string>}
 */
async function newToken() {
  // Node 18 has no global crypto (unless started with a flag); Node >= 19 and browsers do.
  // @ts-ignore: the types of Node are not a dependency of this file
  const crypto = globalThis.crypto ?? (await import('node:crypto')).webcrypto;
  const bytes = crypto.getRandomValues(new Uint8Array(TOKEN_BYTES));
  return btoa(String.fromCharCode(...bytes)).replaceAll('+', '-').replaceAll('/', '_');
}

/**
 * Whether an acquire that failed with `error` may have been granted all the same: unless
 * the server answered no (Locked, or a 4xx refusal), a grant may have landed unseen.
 * @param {unknown} error
 */
function mayHaveGranted(error) {
  if (error instanceof Locked) return false;
  const refused = error instanceof StoreError && error.status !== null && error.status >= 400 && error.status < 500;
  return !refused;
}

/**
 * Releases by token, in the background, once: a lease past its deadline, whose grant the
 * server is about to end, or a grant that landed as the caller aborted the acquire (as
 * the Python client gives back the grant of an interrupted acquire). If the release
 * fails too, the lease expires by its ttl.
 * @param {LockClient} client
 * @param {string} key
 * @param {string} token
 */
function releaseOnce(client, key, token) {
  client[sendRelease](key, token).catch(() => {});
}

/**
 * A token whose grant of `key` in `namespace` is being given back. On the clock `now()`,
 * in ms: `at`, when its next release is due; `last`, when a grant made at the failure
 * would have expired; `wait`, from its next release to the one after.
 * @typedef {{namespace: string, key: string, token: string, at: number, last: number, wait: number}} GiveBack
 */

/**
 * The give-backs of one LockClient: releases, by token, of what the server may hold for
 * a token this client drew and nobody will use. The grant of an acquire that failed with
 * a StoreError (its reply lost or too late, a 5xx: the server may have granted all the
 * same), or a lease whose release failed so (a server restarting, a network blip): else
 * the key stays held by nobody for its whole ttl, against the very caller who tries again.
 *
 * As the Python client (keymutex._giveback): released at once, then 0.1, 0.4, 1.3, 4 …
 * s after the failure (three times longer each time), and a last time when a grant made
 * at the failure would have expired, until one release lands. A release checks the
 * token on the server, so it ends that grant and nothing else; where there is nothing
 * to release (LockLost) it changes nothing, and is sent again at its next time all the
 * same (a slow server may grant after the acquire gave up). Not for a token the caller
 * named: it may be named again, for another lease.
 *
 * One loop runs while there are tokens; each round of releases stops at the first that
 * fails (the server is still out of reach): the others wait for their next time. Its
 * timers are unref'd in Node: a give-back that waits keeps no process alive (a process
 * that ends leaves its tokens to their ttl). A LockClient has no close() (the Python
 * client's makes a last round): it holds no connection of its own, and its give-backs
 * end by themselves, by the ttl at the latest. At most GIVE_BACK_TOKENS wait at once.
 */
class GiveBacks {
  /** @type {(namespace: string, key: string, token: string) => Promise<void>} */
  #release;
  /** @type {GiveBack[]} by `at`, the soonest first */
  #due = [];
  #running = false;
  /** @type {() => void} ends the loop's pause before the next due release */
  #wake = () => {};

  /** @param {(namespace: string, key: string, token: string) => Promise<void>} release */
  constructor(release) {
    this.#release = release;
  }

  /**
   * Gives back `token`'s grant of `key`, if any: its first release is sent at once.
   * @param {string} namespace
   * @param {string} key
   * @param {string} token
   * @param {number} ttl seconds: the grant, if any, expires by then
   */
  add(namespace, key, token, ttl) {
    if (this.#due.length >= GIVE_BACK_TOKENS) return;
    const at = now();
    this.#plan({namespace, key, token, at, last: at + ttl * 1000, wait: GIVE_BACK_FIRST_WAIT});
    if (this.#running) this.#wake();
    else this.#run();
  }

  /** @param {GiveBack} entry placed after those due no later */
  #plan(entry) {
    let low = 0;
    let high = this.#due.length;
    while (low < high) {
      const middle = (low + high) >>> 1;
      if (this.#due[middle].at <= entry.at) low = middle + 1;
      else high = middle;
    }
    this.#due.splice(low, 0, entry);
  }

  async #run() {
    this.#running = true;
    try {
      while (this.#due.length > 0) {
        const time = now();
        if (this.#due[0].at > time) {
          await this.#pause(this.#due[0].at - time);
          continue;
        }
        let count = 1;
        while (count < this.#due.length && this.#due[count].at <= time) count++;
        await this.#round(this.#due.splice(0, count));
      }
    } finally {
      this.#running = false;
    }
  }

  /** @param {number} ms @returns {Promise<void>} after `ms`, or at wake() */
  #pause(ms) {
    return new Promise((resolve) => {
      const timer = setTimeout(resolve, ms);
      // Node: a give-back that waits must not keep the process alive (browsers have no unref).
      /** @type {{unref?: () => void}} */ (/** @type {unknown} */ (timer)).unref?.();
      this.#wake = () => {
        clearTimeout(timer);
        resolve();
      };
    });
  }

  /** @param {GiveBack[]} batch the tokens due, released one after the other */
  async #round(batch) {
    for (let done = 0; done < batch.length; done++) {
      const entry = batch[done];
      try {
        await this.#release(entry.namespace, entry.key, entry.token);
      } catch (error) {
        if (error instanceof LockLost) {
          this.#again([entry]); // nothing to release, yet
          continue;
        }
        this.#again(batch.slice(done)); // the server out of reach, or failing: the rest wait too
        return;
      }
    }
  }

  /** @param {GiveBack[]} entries their next release, unless the last one was made */
  #again(entries) {
    const time = now();
    for (const entry of entries) {
      if (time >= entry.last) continue;
      entry.at = Math.min(time + entry.wait, entry.last);
      entry.wait *= GIVE_BACK_GROWTH;
      this.#plan(entry);
    }
  }
}

/**
 * Calls onLost(lease): a throw or a rejected promise is logged, never passed on (an
 * unhandled rejection would end a Node process).
 * @param {(lease: Lease) => unknown} onLost
 * @param {Lease} lease
 */
function notifyLost(onLost, lease) {
  const report = (/** @type {unknown} */ error) =>
    console.error(`keymutex: the onLost callback for ${JSON.stringify(lease.key)} failed:`, error);
  try {
    Promise.resolve(onLost(lease)).catch(report);
  } catch (error) {
    report(error);
  }
}

/** @param {string} key @param {string} why */
function expired(key, why) {
  return new LockLost(key, null, `lease on ${JSON.stringify(key)} expired: ${why}`);
}

// Methods that Lease and LockClient call on each other without making them public API.
const startRenewing = Symbol('startRenewing');
const finishLease = Symbol('finishLease');
const sendRenewal = Symbol('sendRenewal');
const sendRelease = Symbol('sendRelease');
const giveBack = Symbol('giveBack');
const renewByToken = Symbol('renewByToken');
const forgetLease = Symbol('forgetLease');

/**
 * withLock's renewer of a lease, while it runs: stop() ends it; replan(sentAt) plans the
 * next renewal and the deadline watch anew after a renewal whose request was sent at
 * `sentAt` (on the clock `now()`).
 * @typedef {{stop: () => void, replan: (sentAt: number) => void}} Renewer
 */

/**
 * A granted lock. `token` is the secret that proves ownership: whoever has key and
 * token may renew or release, from any process (the server asks nothing else); through
 * the LockClient that granted it, such a call is this Lease's own renew() or release().
 * `remaining` counts down on this process's monotonic clock (which counts time
 * suspended too) from *before* the request
 * that granted or renewed the lease, so it is never more than the server granted.
 * `signal` is aborted (with a LockLost as reason) once the lease is known lost. A lease
 * once lost is never revived.
 */
export class Lease {
  /** @type {LockClient} */ #client;
  /** @type {boolean} its token was drawn by the client (acquire), not named by the caller */
  #drawn;
  /** @type {number} */ #deadline;
  /** @type {AbortController} */ #lostController = new AbortController();
  /** @type {boolean} */ #released = false;
  /** @type {Promise<void> | null} */ #releasing = null;
  /** @type {Renewer | null} */ #renewer = null;
  /** @type {Promise<void>} settles when the renewal or release under way, if any, has ended */
  #stepping = Promise.resolve();

  /**
   * @param {LockClient} client
   * @param {Granted} granted the reply that granted or renewed it, checked (toLease)
   * @param {number} sentAt now() before the request was sent
   * @param {boolean} drawn whether the client drew its token (acquire), or the caller named it
   */
  constructor(client, {holder, token, ttl}, sentAt, drawn) {
    this.#client = client;
    this.#drawn = drawn;
    /** @type {string} */ this.key = holder.key;
    /** @type {string} */ this.token = token;
    /** @type {number} */ this.fence = holder.fence;
    /** @type {string} */ this.owner = holder.owner;
    /** @type {Record<string, unknown> | null} */ this.info = holder.info;
    /** @type {number} */ this.ttl = ttl;
    /** @type {number} */ this.acquiredAt = holder.acquiredAt;
    /** @type {number} */ this.expiresAt = holder.expiresAt;
    this.#deadline = sentAt + holder.expiresIn * 1000;
  }

  /** Seconds left on this process's clock; 0 once the deadline has passed. */
  get remaining() {
    return Math.max(0, (this.#deadline - now()) / 1000);
  }

  /** True once the lease is known gone (taken over, expired, released elsewhere). */
  get lost() {
    return this.#lostController.signal.aborted || (!this.#released && this.remaining === 0);
  }

  /** Aborted, with the LockLost as `reason`, when the lease is found lost. */
  get signal() {
    return this.#lostController.signal;
  }

  /** What others see of this lease. @returns {Holder} */
  get holder() {
    return Object.freeze({
      key: this.key,
      owner: this.owner,
      info: this.info,
      fence: this.fence,
      acquiredAt: this.acquiredAt,
      expiresAt: this.expiresAt,
      expiresIn: this.remaining,
    });
  }

  /**
   * Extends the lease to `ttl` seconds from now (default: its current ttl). Throws
   * LockLost if it no longer holds its key, was released, or is lost by this process's
   * clock: a lease past its deadline is released rather than renewed (the server may
   * not have seen it expire yet, and a waiter may be granted it any moment).
   * @param {{ttl?: number}} [options]
   * @returns {Promise<Lease>} this lease
   */
  async renew(options) {
    const {ttl} = checkOptions(options, 'renew', ['ttl']);
    await this.#renew(ttl === undefined ? null : checkTtl(ttl), undefined);
    return this;
  }

  /**
   * A renewal by key and token through the client that granted this lease: the lease's
   * own renewal. Resolves to this lease: releasing what locks.renew returned releases
   * it, not a twin whose release left this one to be found lost.
   * @param {number} ttl
   * @returns {Promise<Lease>}
   */
  async [renewByToken](ttl) {
    await this.#renew(ttl, undefined);
    return this;
  }

  /**
   * Runs `step` (a renewal or the release of this lease) once the one under way, if any,
   * has ended: one request about this lease at a time. Two in flight at once may reach
   * the server, or come back, in either order: a renewal answered after another could
   * leave the lease with a deadline the server has already replaced with a nearer one,
   * and one that the server took after a release of the lease is refused (lock_lost)
   * and called the released lease lost (found by review, as in the Python client: a
   * heartbeat under way as its page released the lease aborted the lease's signal, and
   * withLock called onLost for a lease fn released on purpose).
   * @template T
   * @param {() => Promise<T>} step
   * @returns {Promise<T>}
   */
  async #oneAtATime(step) {
    const previous = this.#stepping;
    /** @type {() => void} */
    let ended = () => {};
    this.#stepping = new Promise((resolve) => {
      ended = resolve;
    });
    try {
      await previous;
      return await step();
    } finally {
      ended();
    }
  }

  /**
   * One renewal (`ttl` null: the lease's ttl when it is sent), sent once the renewal or
   * release under way has ended (#oneAtATime). Once `signal` (the renewer's) is aborted,
   * its reply counts for nothing. A renewal that succeeds re-plans the renewer, if one
   * runs, whoever asked for it.
   * @param {number | null} ttl
   * @param {AbortSignal | undefined} signal
   * @returns {Promise<Lease>} the server's reply, as a new Lease (whose deadline this one takes)
   */
  #renew(ttl, signal) {
    return this.#oneAtATime(async () => {
      if (signal?.aborted) throw signal.reason;
      this.#checkHeld('before it was renewed');
      const sentAt = now();
      let fresh;
      try {
        fresh = await this.#client[sendRenewal](this.key, this.token, ttl ?? this.ttl, signal);
      } catch (error) {
        if (error instanceof LockLost && !signal?.aborted) throw this.#lose(error);
        throw error;
      }
      if (signal?.aborted) throw signal.reason;
      // Renewed after its holder was told, or could have seen, that it was lost: not revived.
      this.#checkHeld('while it was being renewed');
      this.ttl = fresh.ttl;
      this.expiresAt = fresh.expiresAt;
      this.#deadline = fresh.#deadline;
      this.#renewer?.replan(sentAt);
      return fresh;
    });
  }

  /**
   * Releases the lease, and stops its renewal; sent once a renewal of it under way has
   * ended (a renewal asked meanwhile waits for the release). Throws LockLost if it no
   * longer holds its key, was released already, or is lost by this process's clock (a
   * lease past its deadline is released all the same, in the background: the server
   * may still count it as held). A release that fails with a StoreError (the server unreachable, restarting)
   * throws it, and the lease counts as released (nothing renews it any more): the client
   * tries the release again in the background until it lands, as it gives back the grant
   * of a failed acquire (GiveBacks). Not a lease whose token the caller named
   * (client.renew of a token this client did not grant): that release is not tried again.
   * @returns {Promise<void>}
   */
  release() {
    // A release under way is awaited, not sent again: the second would be refused
    // (the first released), and the lease reported lost.
    if (this.#releasing === null) {
      this.#releasing = this.#release().finally(() => {
        this.#releasing = null;
      });
    }
    return this.#releasing;
  }

  /**
   * Sent once the renewal under way, if any, has ended (#oneAtATime): withLock's renewer
   * is stopped (its renewal aborted), a renewal of the caller's is waited for.
   * @returns {Promise<void>}
   */
  async #release() {
    this.#stopRenewing();
    this.#checkHeld('before it was released');
    await this.#oneAtATime(async () => {
      this.#checkHeld('before it was released'); // lost while the renewal was under way
      try {
        await this.#client[sendRelease](this.key, this.token);
      } catch (error) {
        if (error instanceof LockLost) throw this.#lose(error);
        if (error instanceof StoreError && this.#drawn) this.#finishLater(error);
        throw error;
      }
      this.#released = true;
      this.#client[forgetLease](this);
    });
  }

  /**
   * The release failed with `error`: its outcome is unknown (a reply lost, a server back
   * a moment later), and nothing else would end the lease before its ttl, however short
   * the outage: its renewal has stopped. So it goes on in the background (GiveBacks),
   * and the lease counts as released: its owner asked for that, and nobody renews it
   * meanwhile. Found by review: the key stayed held to its ttl after a release that
   * met a restart of the server.
   * @param {StoreError} error
   */
  #finishLater(error) {
    this.#released = true;
    this.#client[forgetLease](this);
    this.#client[giveBack](this.key, this.token, this.ttl);
    error.message += '; keymutex tries the release again in the background until it lands';
  }

  /**
   * Throws LockLost if the lease was released, or is lost: known lost, or past its
   * deadline by this process's clock. The key of a lease past its deadline is given back,
   * as the server may not have seen it expire yet (its clock, or a renewal that came too
   * late), and a waiter should not wait another ttl for it.
   * @param {string} when what the deadline passed before, for the message
   */
  #checkHeld(when) {
    if (this.#released) {
      throw new LockLost(this.key, null, `lease on ${JSON.stringify(this.key)} was already released`);
    }
    if (!this.lost) return;
    if (this.remaining === 0) releaseOnce(this.#client, this.key, this.token);
    throw this.#lose(expired(this.key, `its deadline passed ${when}`));
  }

  /**
   * Records the loss, aborts `signal` (which calls withLock's onLost) and stops the
   * renewal; the first LockLost stays the reason. Returns that LockLost, to throw.
   * @param {LockLost} error
   * @returns {LockLost}
   */
  #lose(error) {
    if (this.#released) return error;
    if (!this.#lostController.signal.aborted) {
      this.#stopRenewing();
      this.#client[forgetLease](this);
      this.#lostController.abort(error);
    }
    return this.#lostController.signal.reason;
  }

  #stopRenewing() {
    this.#renewer?.stop();
    this.#renewer = null;
  }

  /**
   * Renews about every ttl/3 until release() or the loss: a third of the ttl after the
   * request of the last renewal was sent, whoever asked for it (the renewer, lease.renew,
   * or a renewal by key and token through this client), so that one to a shorter ttl
   * brings the next renewal nearer. A server that cannot be reached, or does not answer,
   * is asked again until the lease's local deadline, when the lease is lost: at that
   * deadline, earlier or later after each renewal, even while a renewal is under way.
   */
  [startRenewing]() {
    const stopped = new AbortController();
    const {signal} = stopped;
    // A third of the TTL, or of what the server granted if that was less (a lock
    // server on ZooKeeper grants no more than its session timeout).
    const renewalDue = (/** @type {number} */ sentAt) =>
      sentAt + Math.min(this.ttl * 1000, this.#deadline - sentAt) / 3;
    let renewAt = renewalDue(now());
    /** @type {ReturnType<typeof setTimeout> | undefined} */
    let deadlineTimer;
    const watchDeadline = () => {
      clearTimeout(deadlineTimer);
      // Timers do not count a suspend either: looked at every SUSPEND_MS, a lease
      // whose deadline passed while the machine slept is found lost when it wakes.
      // The renewal's own timer slept as long: one due by now is sent now.
      deadlineTimer = setTimeout(() => {
        if (this.remaining > 0) {
          if (now() >= renewAt) wake();
          watchDeadline(); // early, or a timer may fire a little early
        } else this.#lose(expired(this.key, 'not renewed by its deadline'));
      }, Math.min(this.#deadline - now(), SUSPEND_MS));
    };
    /** @type {() => void} ends the pause before the next renewal at once */
    let wake = () => {};
    this.#renewer = {
      stop() {
        stopped.abort();
        clearTimeout(deadlineTimer);
        wake();
      },
      replan: (sentAt) => {
        renewAt = renewalDue(sentAt);
        watchDeadline();
        wake();
      },
    };
    watchDeadline();
    const run = async () => {
      while (!signal.aborted) {
        if (now() < renewAt) {
          // Until renewAt, or until re-planned or stopped: then the loop looks again.
          await new Promise((resolve) => {
            const timer = setTimeout(resolve, renewAt - now());
            wake = () => {
              clearTimeout(timer);
              resolve(undefined);
            };
          });
          continue;
        }
        try {
          await this.#renew(null, signal); // which re-plans
        } catch {
          // Stopped or lost (the loop ends), or the server failed: try again well before
          // the deadline.
          renewAt = now() + Math.max(0.1, Math.min(this.ttl / 3, this.remaining / 4)) * 1000;
        }
      }
    };
    run();
  }

  /**
   * How withLock ends: releases the lease unless fn did, and reports a loss (LockLost)
   * unless fn failed, whose error wins.
   * @param {boolean} fnFailed
   */
  async [finishLease](fnFailed) {
    this.#stopRenewing();
    if (this.#released) return;
    const releasing = this.#releasing ?? this.release(); // one that fn started, unawaited
    try {
      await releasing;
    } catch (error) {
      if (!fnFailed) throw error;
    }
  }
}

// ---------------------------------------------------------------------------------
// The client

/**
 * @typedef {object} LockClientOptions
 * @property {string | URL} url the lock server, e.g. "http://127.0.0.1:7420" (a base
 *   path is kept: "http://host/locks" calls "/locks/v1/…"); relative in browsers
 * @property {string} [namespace] default ""
 * @property {string | null} [apiToken] sent as "Authorization: Bearer …" (visible ASCII)
 * @property {string | null} [owner] shown to others; default: the server's choice (the
 *   API token's name, else the peer address)
 * @property {number} [ttl] default lease lifetime in seconds (30)
 * @property {number} [requestTimeout] seconds a request may take beyond the wait of a
 *   long poll, then StoreError (code "timeout"); default 10
 */

/**
 * @typedef {object} AcquireOptions
 * @property {number} [ttl] seconds the lease lives unless renewed, [0.001, 86400]
 * @property {number | null} [timeout] null/undefined: wait as long as it takes;
 *   0: try once; t > 0: wait up to t seconds, then throw Locked
 * @property {Record<string, unknown> | null} [info] shown to others, ≤ 4 KiB as JSON,
 *   nested ≤ 32 levels (info itself the first)
 * @property {boolean} [steal] take the key even if held (the holder's token stops working)
 * @property {AbortSignal | null} [signal] stops waiting; the promise rejects with
 *   signal.reason (a grant that came meanwhile is given back)
 */

/**
 * @typedef {AcquireOptions & {onLost?: (lease: Lease) => unknown}} WithLockOptions
 */

/**
 * Lease locks on a keymutex lock server. It keeps its settings, and the leases it
 * granted that are still live: a renewal or release by key and token through this
 * client is taken in by the Lease it names (its renewal re-planned, or stopped).
 */
export class LockClient {
  /** @type {string} */ #base;
  /** @type {string | null} */ #apiToken;
  /** @type {string | null} */ #owner;
  /** @type {number} */ #requestTimeout;
  /**
   * The leases this client granted, by token, with the namespace they were granted in.
   * A lease leaves when released or found lost; one that expires unseen (nobody renews
   * or releases it) is swept out once the map has doubled since the last sweep.
   * @type {Map<string, {namespace: string, lease: Lease}>}
   */
  #leases = new Map();
  #sweepAt = LEASES_SWEPT_FROM;
  /** What the server may hold for tokens this client drew, and nobody will use. */
  #giveBacks = new GiveBacks((namespace, key, token) => this[sendRelease](key, token, namespace));

  /** @param {LockClientOptions} options */
  constructor(options) {
    const {
      url,
      namespace = '',
      apiToken = null,
      owner = null,
      ttl = DEFAULT_TTL,
      requestTimeout = DEFAULT_REQUEST_TIMEOUT,
    } = checkOptions(options, 'LockClient', ['url', 'namespace', 'apiToken', 'owner', 'ttl', 'requestTimeout']);
    if (typeof url !== 'string' && !(url instanceof URL)) {
      throw new TypeError(`url must be a string or URL such as "http://127.0.0.1:7420", not ${show(url)}`);
    }
    let parsed;
    try {
      parsed = new URL(url, globalThis.location?.href);
    } catch {
      // Credentials left out of the message (found by review: a password reached it).
      throw new RangeError(`url does not parse as a URL: ${show(String(url).replace(/\/\/[^/]*@/, '//…@'))}`);
    }
    if (parsed.protocol !== 'http:' && parsed.protocol !== 'https:') {
      throw new RangeError(`url must start with http:// or https://, not ${show(parsed.protocol)}`);
    }
    if (parsed.search || parsed.hash || parsed.username || parsed.password) {
      throw new RangeError('url must not contain credentials, a query or a fragment; pass apiToken for auth');
    }
    this.#base = parsed.origin + parsed.pathname.replace(/\/+$/, '');
    /** @type {string} */
    this.url = this.#base;
    /** @type {string} */
    this.namespace = checkText(namespace, 'namespace', {allowEmpty: true, maxBytes: MAX_NAMESPACE_BYTES});
    this.#apiToken = apiToken === null ? null : checkApiToken(apiToken);
    if (owner !== null) checkText(owner, 'owner', {allowEmpty: false, maxBytes: MAX_OWNER_BYTES});
    this.#owner = owner;
    /** @type {number} */
    this.ttl = checkTtl(ttl);
    this.#requestTimeout = checkRequestTimeout(requestTimeout);
  }

  /**
   * Acquires `key`, waiting up to `timeout` seconds (server long polls, repeated until
   * this client's own deadline). Throws Locked (with the last holder seen) on timeout.
   *
   * Each call draws a token and sends it with every ask, as the Python http:// store
   * does: the server answers an ask whose token already holds the key with that lease.
   * So an acquire whose reply was lost on the way is asked again once, at once, without
   * risk of a second grant; and one that fails otherwise while a grant may have landed
   * gives that grant back: a release by its token, in the background, tried again until
   * one lands or the ttl has passed (see GiveBacks); one release for an aborted acquire.
   * Not promised: a waiter's place in the server's queue from one long poll to the next
   * (the server queues each poll anew).
   * @param {string} key
   * @param {AcquireOptions} [options]
   * @returns {Promise<Lease>}
   */
  async acquire(key, options) {
    const opts = checkOptions(options, 'acquire', ['ttl', 'timeout', 'info', 'steal', 'signal']);
    checkKey(key);
    const ttl = opts.ttl === undefined ? this.ttl : checkTtl(opts.ttl);
    const timeout = checkTimeout(opts.timeout);
    const info = checkInfo(opts.info);
    const steal = checkBoolean(opts.steal, 'steal');
    const signal = checkSignal(opts.signal);
    if (signal?.aborted) throw signal.reason;

    const token = await newToken();
    /** @type {Record<string, unknown>} */
    const body = {namespace: this.namespace, key, token, ttl};
    if (info !== null) body.info = info;
    if (steal) body.steal = true;
    if (this.#owner !== null) body.owner = this.#owner;
    const deadline = timeout === null ? Infinity : now() + timeout * 1000;
    let askedAgain = false; // after a reply that was lost
    for (let attempt = 0; ; attempt++) {
      const wait = Math.min(Math.max(0, (deadline - now()) / 1000), POLL_SECONDS);
      const sentAt = now();
      try {
        const granted = await this.#request(
          'POST',
          '/v1/acquire',
          {body: {...body, timeout: wait}, signal, key, wait},
          (reply, status) => toLease(reply, key, token, status),
        );
        return this.#remember(new Lease(this, granted, sentAt, true));
      } catch (error) {
        if (error instanceof StoreError && error.code === 'unreachable' && !askedAgain) {
          askedAgain = true;
          continue;
        }
        if (!(error instanceof Locked) || now() >= deadline) {
          if (mayHaveGranted(error)) {
            // The server failing, or the way to it: given back until a release lands.
            // Aborted: the server answers, and one release ends what landed meanwhile.
            if (error instanceof StoreError) this[giveBack](key, token, ttl);
            else releaseOnce(this, key, token);
          }
          throw error;
        }
        askedAgain = false;
      }
      // A refusal long before the asked wait (e.g. the holder changed hands) is asked
      // again at once, but never in a tight loop. An abort here has nothing to give back.
      if (now() - sentAt < 20) await sleep(Math.min(250, 10 * 2 ** Math.min(attempt, 5)) * Math.random(), signal);
    }
  }

  /**
   * Extends the lease that `token` holds on `key` (stateless: key and token only).
   * Throws LockLost (with the new holder) when the token no longer holds the key.
   * A live lease this client granted to that token is renewed as by lease.renew(): it
   * takes the new ttl and deadline in, withLock's renewer of it is re-planned, and it
   * is what this resolves to.
   * @param {string} key
   * @param {string} token
   * @param {{ttl?: number}} [options]
   * @returns {Promise<Lease>}
   */
  async renew(key, token, options) {
    const opts = checkOptions(options, 'renew', ['ttl']);
    checkKey(key);
    checkToken(token);
    const ttl = opts.ttl === undefined ? this.ttl : checkTtl(opts.ttl);
    const granted = this.#grantedHere(key, token);
    if (granted !== null) return granted[renewByToken](ttl);
    return this[sendRenewal](key, token, ttl, undefined);
  }

  /**
   * The renewal request, its arguments checked: the renewed lease, as a new Lease.
   * @param {string} key
   * @param {string} token
   * @param {number} ttl
   * @param {AbortSignal | undefined} signal
   * @returns {Promise<Lease>}
   */
  async [sendRenewal](key, token, ttl, signal) {
    const sentAt = now();
    const body = {namespace: this.namespace, key, token, ttl};
    const renewed = await this.#request('POST', '/v1/renew', {body, signal, key}, (reply, status) =>
      toLease(reply, key, token, status),
    );
    return new Lease(this, renewed, sentAt, false);
  }

  /**
   * Releases the lease that `token` holds on `key` (stateless). Throws LockLost when
   * the token no longer holds the key. A live lease this client granted to that token
   * is released as by lease.release(): its renewal stops, and it is released, not lost
   * (withLock neither releases it again nor reports it lost).
   * @param {string} key
   * @param {string} token
   * @returns {Promise<void>}
   */
  async release(key, token) {
    checkKey(key);
    checkToken(token);
    const granted = this.#grantedHere(key, token);
    if (granted !== null) return granted.release();
    return this[sendRelease](key, token);
  }

  /**
   * The release request, its arguments checked.
   * @param {string} key
   * @param {string} token
   * @param {string} [namespace]
   * @returns {Promise<void>}
   */
  async [sendRelease](key, token, namespace = this.namespace) {
    await this.#request('POST', '/v1/release', {body: {namespace, key, token}, key}, (reply, status) => {
      if (reply.released !== true) throw malformed('release result', reply, status);
    });
  }

  /**
   * Gives back, in the background, what the server may hold for `token` on `key`: a
   * token this client drew, that nobody will use (see GiveBacks).
   * @param {string} key
   * @param {string} token
   * @param {number} ttl seconds the grant, if any, lives
   */
  [giveBack](key, token, ttl) {
    this.#giveBacks.add(this.namespace, key, token, ttl);
  }

  /**
   * Keeps `lease`, just granted, so that a renewal or release by its key and token
   * reaches it.
   * @param {Lease} lease
   * @returns {Lease}
   */
  #remember(lease) {
    if (this.#leases.size >= this.#sweepAt) {
      for (const [token, {lease: kept}] of this.#leases) if (kept.lost) this.#leases.delete(token);
      this.#sweepAt = Math.max(LEASES_SWEPT_FROM, 2 * this.#leases.size);
    }
    this.#leases.set(lease.token, {namespace: this.namespace, lease});
    return lease;
  }

  /**
   * `lease` was released, or found lost: a call by its key and token is stateless now.
   * @param {Lease} lease
   */
  [forgetLease](lease) {
    if (this.#leases.get(lease.token)?.lease === lease) this.#leases.delete(lease.token);
  }

  /**
   * The live lease this client granted that a call by `key` and `token` names, or null.
   * @param {string} key
   * @param {string} token
   * @returns {Lease | null}
   */
  #grantedHere(key, token) {
    const kept = this.#leases.get(token);
    if (kept === undefined || kept.namespace !== this.namespace || kept.lease.key !== key) return null;
    return kept.lease.lost ? null : kept.lease;
  }

  /**
   * Releases from a page that is going away (pagehide): the request outlives the page.
   * Uses navigator.sendBeacon when there is no API token (a beacon cannot carry an
   * Authorization header), else fetch with keepalive. Nothing reports the outcome:
   * a lease whose release got lost expires by its ttl.
   * @param {string} key
   * @param {string} token
   * @returns {boolean} whether the request was queued
   */
  releaseBeacon(key, token) {
    checkKey(key);
    checkToken(token);
    const url = `${this.#base}/v1/release`;
    const body = JSON.stringify({namespace: this.namespace, key, token});
    if (this.#apiToken === null && typeof navigator !== 'undefined' && typeof navigator.sendBeacon === 'function') {
      try {
        if (navigator.sendBeacon(url, new Blob([body], {type: 'application/json'}))) return true;
      } catch {
        // Some browsers refuse a beacon that is not a CORS-safelisted type: use fetch.
      }
    }
    try {
      fetch(url, {method: 'POST', keepalive: true, headers: this.#headers(true), body}).catch(() => {});
      return true;
    } catch {
      return false;
    }
  }

  /**
   * The current holder of `key`, or null.
   * @param {string} key
   * @returns {Promise<Holder | null>}
   */
  async holder(key) {
    checkKey(key);
    const query = {namespace: this.namespace, key};
    return this.#request('GET', '/v1/holder', {query}, (reply, status) => toHolderOrNull(reply.holder, status));
  }

  /**
   * Every current lease whose key starts with `prefix`, sorted by key.
   * @param {string} [prefix]
   * @returns {Promise<Holder[]>}
   */
  async holders(prefix = '') {
    checkText(prefix, 'prefix', {allowEmpty: true, maxBytes: MAX_KEY_BYTES});
    const query = {namespace: this.namespace, prefix};
    return this.#request('GET', '/v1/holders', {query}, (reply, status) => {
      if (!Array.isArray(reply.holders)) throw malformed('holders', reply.holders, status);
      return reply.holders.map((/** @type {unknown} */ wire) => toHolder(wire, status));
    });
  }

  /**
   * Waits until `key` is no longer held by the lease with fencing number `fence`
   * (`fence` null: "I saw the key free"), or `timeout` seconds pass (null: as long
   * as it takes). Resolves to {changed, holder}: the holder now, or null if free.
   * `holding: true`: `fence` is the caller's own lease, watched to learn at once that
   * it was taken over or expired (`changed` is then that loss); the server does not
   * count such a wait among the key's waiters.
   * @param {string} key
   * @param {number | null} fence
   * @param {number | null} [timeout]
   * @param {{signal?: AbortSignal | null, holding?: boolean}} [options]
   * @returns {Promise<{changed: boolean, holder: Holder | null}>}
   */
  async wait(key, fence, timeout = null, options) {
    const opts = checkOptions(options, 'wait', ['signal', 'holding']);
    checkKey(key);
    checkFence(fence);
    const seconds = checkTimeout(timeout);
    const signal = checkSignal(opts.signal);
    const holding = checkBoolean(opts.holding, 'holding');
    if (holding && fence === null) {
      throw new TypeError("holding: true needs fence, the fence of the caller's own lease");
    }
    const deadline = seconds === null ? Infinity : now() + seconds * 1000;
    for (;;) {
      const wait = Math.min(Math.max(0, (deadline - now()) / 1000), POLL_SECONDS);
      /** @type {Record<string, unknown>} */
      const body = {namespace: this.namespace, key, fence, timeout: wait};
      if (holding) body.holding = true;
      const sentAt = now();
      const result = await this.#request('POST', '/v1/wait', {body, signal, key, wait}, (reply, status) => {
        if (typeof reply.changed !== 'boolean') throw malformed('wait result', reply, status);
        return {changed: /** @type {boolean} */ (reply.changed), holder: toHolderOrNull(reply.holder, status)};
      });
      if (result.changed || now() >= deadline) return result;
      if (now() - sentAt < 20) await sleep(50 * Math.random(), signal);
    }
  }

  /**
   * Takes `key` over and releases it (needs the admin permission): the holder's token
   * stops working. `reason` (1 to 500 characters) is logged by the server. `fence`: the
   * fencing number of the lease to release (as a dashboard showed it); if another lease
   * holds the key by then, nothing is released and Locked is thrown with that holder.
   * @param {string} key
   * @param {string} reason
   * @param {{fence?: number | null}} [options]
   * @returns {Promise<{released: boolean, holder: Holder | null}>}
   */
  async forceRelease(key, reason, options) {
    const opts = checkOptions(options, 'forceRelease', ['fence']);
    checkKey(key);
    checkReason(reason);
    const fence = opts.fence === undefined ? null : checkFence(opts.fence);
    /** @type {Record<string, unknown>} */
    const body = {namespace: this.namespace, key, reason};
    if (fence !== null) body.fence = fence;
    return this.#request('POST', '/v1/force-release', {body, key}, (reply, status) => {
      if (typeof reply.released !== 'boolean') throw malformed('force-release result', reply, status);
      return {released: /** @type {boolean} */ (reply.released), holder: toHolderOrNull(reply.holder, status)};
    });
  }

  /**
   * Runs `fn(lease)` holding `key`: acquires (as acquire()), renews about every ttl/3
   * while fn runs (of the ttl of the last renewal: fn may renew to another ttl, with
   * lease.renew or by key and token through this client), releases afterwards (unless
   * fn released the lease, either way) and resolves to fn's result. If the lease is lost
   * meanwhile (taken over, or not renewed by its deadline: the server unreachable or not
   * answering), lease.signal is aborted at once, onLost(lease) is called once (what it
   * throws or rejects with is logged), and the promise rejects with LockLost when fn
   * ends — unless fn itself threw, whose error wins. So does a lease whose deadline
   * passed while fn kept the event loop busy.
   * @template T
   * @param {string} key
   * @param {(lease: Lease) => T | Promise<T>} fn
   * @param {WithLockOptions} [options]
   * @returns {Promise<T>}
   */
  async withLock(key, fn, options) {
    const opts = checkOptions(options, 'withLock', ['ttl', 'timeout', 'info', 'steal', 'signal', 'onLost']);
    checkKey(key);
    if (typeof fn !== 'function') throw new TypeError(`fn must be a function, not ${show(fn)}`);
    const {onLost, ...acquireOptions} = opts;
    if (onLost !== undefined && typeof onLost !== 'function') {
      throw new TypeError(`onLost must be a function, not ${show(onLost)}`);
    }
    const lease = await this.acquire(key, acquireOptions);
    if (onLost) lease.signal.addEventListener('abort', () => notifyLost(onLost, lease), {once: true});
    lease[startRenewing]();
    /** @type {T} */
    let result;
    try {
      result = await fn(lease);
    } catch (error) {
      await lease[finishLease](true);
      throw error;
    }
    await lease[finishLease](false);
    return result;
  }

  /** @param {boolean} json */
  #headers(json) {
    /** @type {Record<string, string>} */
    const headers = {Accept: 'application/json'};
    if (json) headers['Content-Type'] = 'application/json';
    if (this.#apiToken !== null) headers.Authorization = `Bearer ${this.#apiToken}`;
    return headers;
  }

  /**
   * One request; if the reply is a 2xx, what `read` makes of its JSON object and HTTP
   * status (a reply without the promised shape is a StoreError with that status), else
   * the matching LockError. No reply within requestTimeout (plus `wait`, the seconds the
   * server may hold a long poll) is a StoreError with code "timeout"; a connection that
   * fails, "unreachable".
   * @template T
   * @param {'GET' | 'POST'} method
   * @param {string} path
   * @param {{body?: object, query?: Record<string, string>, signal?: AbortSignal, key?: string, wait?: number}} request
   * @param {(reply: Record<string, any>, status: number) => T} read
   * @returns {Promise<T>}
   */
  async #request(method, path, {body, query, signal, key = '', wait = 0}, read) {
    const url = new URL(this.#base + path);
    for (const [name, value] of Object.entries(query ?? {})) url.searchParams.set(name, value);
    const seconds = this.#requestTimeout + wait;
    const limit = withTimeout(signal, seconds * 1000, () => {
      const message = `the lock server at ${this.#base} did not answer ${method} ${path} within ${seconds} s`;
      return new StoreError(message, {code: 'timeout'});
    });
    let response;
    let text;
    try {
      response = await fetch(url, {
        method,
        headers: this.#headers(body !== undefined),
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: limit.signal,
        // A redirect followed turns a POST into a GET without its body (301-303):
        // named as what it is instead, so that the client is given the right URL.
        redirect: 'manual',
      });
      text = await response.text();
    } catch (error) {
      if (signal?.aborted) throw signal.reason;
      if (limit.signal.aborted) throw limit.signal.reason;
      const cause = /** @type {{cause?: {code?: unknown}}} */ (error)?.cause;
      if (cause?.code === 'UND_ERR_HEADERS_TIMEOUT' || cause?.code === 'UND_ERR_BODY_TIMEOUT') {
        // Node's fetch gives up on a reply after 300 s of its own: a timeout all the
        // same (not a connection that failed, which an acquire would send again).
        const message = `the lock server at ${this.#base} did not answer ${method} ${path} (Node's fetch stops waiting after 300 s)`;
        throw new StoreError(message, {code: 'timeout', cause: error});
      }
      const reason = error instanceof Error ? (error.cause instanceof Error ? error.cause.message : error.message) : String(error);
      throw new StoreError(`cannot reach the lock server at ${this.#base}: ${reason}`, {code: 'unreachable', cause: error});
    } finally {
      limit.clear();
    }
    if (response.type === 'opaqueredirect' || (response.status >= 300 && response.status < 400)) {
      const target = response.headers.get('location');
      const to = target ? ` to ${new URL(target, url).href}` : '';
      throw new StoreError(
        `the lock server at ${this.#base} answered ${method} ${path} with a redirect${to}: give the client the URL it redirects to`,
        {status: response.status},
      );
    }
    let reply;
    try {
      reply = JSON.parse(text);
    } catch (error) {
      throw new StoreError(`the lock server's reply to ${method} ${path} (HTTP ${response.status}) is not JSON`, {
        status: response.status,
        cause: error,
      });
    }
    if (response.ok) {
      if (!isObject(reply)) throw malformed(`reply to ${method} ${path}`, reply, response.status);
      return read(reply, response.status);
    }
    const code = typeof reply?.error === 'string' && reply.error ? reply.error : null;
    const message =
      typeof reply?.message === 'string' && reply.message.trim()
        ? reply.message
        : `HTTP ${response.status} from ${method} ${path}: ${JSON.stringify(reply).slice(0, 200)} (not the lock server's answer: a proxy in between?)`;
    const details = {status: response.status, code};
    // Only the server's own errors (an error code) are typed: a proxy's JSON 401 or 403
    // is not an Unauthorized or Forbidden of the lock server (found by review).
    if (code === null) throw new StoreError(message, details);
    if (response.status === 409 && code === 'locked') {
      throw new Locked(key, toHolderOrNull(reply.holder, response.status), message);
    }
    if (response.status === 409 && code === 'lock_lost') {
      throw new LockLost(key, toHolderOrNull(reply.holder, response.status), message);
    }
    if (response.status === 401) throw new Unauthorized(message, details);
    if (response.status === 403) throw new Forbidden(message, details);
    if ([400, 413, 415].includes(response.status)) throw new InvalidArgument(message, details);
    throw new StoreError(message, details);
  }
}

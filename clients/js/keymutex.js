// keymutex-client: lease locks on a keymutex lock server, over its HTTP API (v1).
//
// One ES module without dependencies, for Node >= 18 and browsers (it only needs
// fetch, AbortController, TextEncoder and performance.now). The lock server serves
// this very file as /static/keymutex.js (src/keymutex/server/static/ links here).
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
//       ├── InvalidArgument   the server rejected an argument (HTTP 400, 413, 415)
//       ├── Unauthorized      missing or unknown API token (HTTP 401)
//       └── Forbidden         the API token lacks the permission (HTTP 403)
// Bad arguments are not LockErrors: they throw TypeError (wrong type) or RangeError
// (wrong value) before any request is sent, as Python raises TypeError / ValueError.

const MAX_KEY_BYTES = 1024;
const MAX_NAMESPACE_BYTES = 256;
const MAX_OWNER_BYTES = 256;
const MAX_INFO_BYTES = 4096;
const MAX_TTL = 86400; // the server's range for ttl is (0, 86400]
const MAX_TOKEN_CHARS = 256;
const MAX_REASON_CHARS = 500;
const DEFAULT_TTL = 30;
// Seconds asked of the server per long poll. The server answers after at most its own
// max_wait (30 s by default) anyway; the client loops until its own deadline.
const POLL_SECONDS = 60;
const TOKEN_PATTERN = /^[A-Za-z0-9_-]+$/;
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

/** @param {unknown} value @param {string} path @param {Set<object>} open */
function checkJsonValue(value, path, open) {
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
      open.add(value);
      if (Array.isArray(value)) {
        value.forEach((item, index) => checkJsonValue(item, `${path}[${index}]`, open));
      } else {
        for (const [name, item] of Object.entries(value)) {
          if (LONE_SURROGATE.test(name)) throw new RangeError(`${path} has a key with a lone surrogate`);
          checkJsonValue(item, `${path}.${name}`, open);
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

/** @param {unknown} info @returns {Record<string, unknown> | null} */
function checkInfo(info) {
  if (info === undefined || info === null) return null;
  if (typeof info !== 'object' || Array.isArray(info)) {
    throw new TypeError(`info must be a plain object or null, not ${show(info)}`);
  }
  try {
    checkJsonValue(info, 'info', new Set());
  } catch (error) {
    // A structure nested thousands deep overflows the stack: it is far over 4 KiB anyway.
    if (error instanceof RangeError && /call stack/i.test(error.message)) {
      throw new RangeError('info is nested too deeply to be stored as JSON');
    }
    throw error;
  }
  const size = encoder.encode(JSON.stringify(info)).length;
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

/** @param {any} wire @returns {Holder} */
function toHolder(wire) {
  if (typeof wire !== 'object' || wire === null || typeof wire.key !== 'string') {
    throw new StoreError(`unexpected holder in the lock server's reply: ${show(wire)}`);
  }
  return Object.freeze({
    key: wire.key,
    owner: wire.owner,
    info: wire.info ?? null,
    fence: wire.fence,
    acquiredAt: wire.acquired_at,
    expiresAt: wire.expires_at,
    expiresIn: wire.expires_in,
  });
}

/** @param {any} wire @returns {Holder | null} */
function toHolderOrNull(wire) {
  return wire === null || wire === undefined ? null : toHolder(wire);
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

const now = () => performance.now();

// Lets LockClient start a lease's renewer without making it public API.
const startRenewing = Symbol('startRenewing');

/**
 * A granted lock. `token` is the secret that proves ownership: whoever has key and
 * token may renew or release, from any process (the client keeps nothing else).
 * `remaining` counts down on this process's monotonic clock from *before* the request
 * that granted or renewed the lease, so it is never more than the server granted.
 * `signal` is aborted (with a LockLost as reason) once the lease is known lost.
 */
export class Lease {
  /** @type {LockClient} */ #client;
  /** @type {number} */ #deadline;
  /** @type {AbortController} */ #lostController = new AbortController();
  /** @type {boolean} */ #released = false;

  /**
   * @param {LockClient} client
   * @param {any} wire a Lease object of the HTTP API
   * @param {number} sentAt performance.now() before the request was sent
   */
  constructor(client, wire, sentAt) {
    const holder = toHolder(wire);
    if (typeof wire.token !== 'string') throw new StoreError("the lock server's lease has no token");
    this.#client = client;
    /** @type {string} */ this.key = holder.key;
    /** @type {string} */ this.token = wire.token;
    /** @type {number} */ this.fence = holder.fence;
    /** @type {string} */ this.owner = holder.owner;
    /** @type {Record<string, unknown> | null} */ this.info = holder.info;
    /** @type {number} */ this.ttl = wire.ttl;
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
   * Extends the lease to `ttl` seconds from now (default: its current ttl).
   * @param {{ttl?: number}} [options]
   * @returns {Promise<Lease>} this lease
   */
  async renew(options) {
    const {ttl = this.ttl} = checkOptions(options, 'renew', ['ttl']);
    try {
      const fresh = await this.#client.renew(this.key, this.token, {ttl});
      this.ttl = fresh.ttl;
      this.expiresAt = fresh.expiresAt;
      this.#deadline = fresh.#deadline;
      return this;
    } catch (error) {
      if (error instanceof LockLost) this.#lose(error);
      throw error;
    }
  }

  /**
   * Releases the lease. A lease already released, expired or taken over throws LockLost.
   * @returns {Promise<void>}
   */
  async release() {
    try {
      await this.#client.release(this.key, this.token);
      this.#released = true;
    } catch (error) {
      if (error instanceof LockLost) this.#lose(error);
      throw error;
    }
  }

  /** @param {LockLost} error */
  #lose(error) {
    if (!this.#lostController.signal.aborted) this.#lostController.abort(error);
  }

  /**
   * Renews about every ttl/3 until the returned stop() is awaited. Renewal that fails
   * with LockLost ends it; a server that cannot be reached is retried until the
   * lease's local deadline, after which the lease counts as lost.
   * @returns {() => Promise<void>} stop
   */
  [startRenewing]() {
    let stopped = false;
    /** @type {ReturnType<typeof setTimeout> | undefined} */
    let timer;
    /** @type {Promise<void> | undefined} */
    let inFlight;
    const schedule = (/** @type {number} */ ms) => {
      if (!stopped) timer = setTimeout(tick, ms);
    };
    const tick = () => {
      inFlight = (async () => {
        try {
          await this.renew();
          schedule((this.ttl * 1000) / 3);
        } catch (error) {
          if (error instanceof LockLost || stopped) return;
          if (this.remaining === 0) {
            const reason = error instanceof Error ? error.message : String(error);
            this.#lose(new LockLost(this.key, null, `lease on ${JSON.stringify(this.key)} expired: renewal failed (${reason})`));
            return;
          }
          // Unreachable for now: try again well before the deadline.
          schedule(Math.max(100, Math.min((this.ttl * 1000) / 3, (this.remaining * 1000) / 4)));
        }
      })();
    };
    schedule((this.ttl * 1000) / 3);
    return async () => {
      stopped = true;
      clearTimeout(timer);
      await inFlight;
    };
  }
}

// ---------------------------------------------------------------------------------
// The client

/**
 * @typedef {object} LockClientOptions
 * @property {string | URL} url the lock server, e.g. "http://127.0.0.1:7420" (a base
 *   path is kept: "http://host/locks" calls "/locks/v1/…"); relative in browsers
 * @property {string} [namespace] default ""
 * @property {string | null} [apiToken] sent as "Authorization: Bearer …"
 * @property {string | null} [owner] shown to others; default: the server's choice (the
 *   API token's name, else the peer address)
 * @property {number} [ttl] default lease lifetime in seconds (30)
 */

/**
 * @typedef {object} AcquireOptions
 * @property {number} [ttl] seconds the lease lives unless renewed, (0, 86400]
 * @property {number | null} [timeout] null/undefined: wait as long as it takes;
 *   0: try once; t > 0: wait up to t seconds, then throw Locked
 * @property {Record<string, unknown> | null} [info] shown to others, ≤ 4 KiB as JSON
 * @property {boolean} [steal] take the key even if held (the holder's token stops working)
 * @property {AbortSignal} [signal] stops waiting; the promise rejects with signal.reason
 */

/**
 * @typedef {AcquireOptions & {onLost?: (lease: Lease) => void}} WithLockOptions
 */

/** Lease locks on a keymutex lock server. Stateless apart from its settings. */
export class LockClient {
  /** @type {string} */ #base;
  /** @type {string | null} */ #apiToken;
  /** @type {string | null} */ #owner;

  /** @param {LockClientOptions} options */
  constructor(options) {
    const {url, namespace = '', apiToken = null, owner = null, ttl = DEFAULT_TTL} = checkOptions(
      options,
      'LockClient',
      ['url', 'namespace', 'apiToken', 'owner', 'ttl'],
    );
    if (typeof url !== 'string' && !(url instanceof URL)) {
      throw new TypeError(`url must be a string or URL such as "http://127.0.0.1:7420", not ${show(url)}`);
    }
    let parsed;
    try {
      parsed = new URL(url, globalThis.location?.href);
    } catch {
      throw new RangeError(`url does not parse as a URL: ${show(String(url))}`);
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
    if (apiToken !== null) checkText(apiToken, 'apiToken', {allowEmpty: false, maxBytes: 4096});
    this.#apiToken = apiToken;
    if (owner !== null) checkText(owner, 'owner', {allowEmpty: false, maxBytes: MAX_OWNER_BYTES});
    this.#owner = owner;
    /** @type {number} */
    this.ttl = checkTtl(ttl);
  }

  /**
   * Acquires `key`, waiting up to `timeout` seconds (server long polls, repeated until
   * this client's own deadline). Throws Locked (with the last holder seen) on timeout.
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

    const deadline = timeout === null ? Infinity : now() + timeout * 1000;
    for (let attempt = 0; ; attempt++) {
      const left = Math.max(0, (deadline - now()) / 1000);
      /** @type {Record<string, unknown>} */
      const body = {namespace: this.namespace, key, ttl, timeout: Math.min(left, POLL_SECONDS)};
      if (info !== null) body.info = info;
      if (steal) body.steal = true;
      if (this.#owner !== null) body.owner = this.#owner;
      const sentAt = now();
      try {
        return new Lease(this, await this.#request('POST', '/v1/acquire', {body, signal, key}), sentAt);
      } catch (error) {
        if (!(error instanceof Locked) || now() >= deadline) throw error;
        // A refusal long before the asked wait (e.g. the holder changed hands) is
        // retried at once, but never in a tight loop.
        if (now() - sentAt < 20) await sleep(Math.min(250, 10 * 2 ** Math.min(attempt, 5)) * Math.random(), signal);
      }
    }
  }

  /**
   * Extends the lease that `token` holds on `key` (stateless: key and token only).
   * Throws LockLost (with the new holder) when the token no longer holds the key.
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
    const sentAt = now();
    const wire = await this.#request('POST', '/v1/renew', {body: {namespace: this.namespace, key, token, ttl}, key});
    return new Lease(this, wire, sentAt);
  }

  /**
   * Releases the lease that `token` holds on `key` (stateless). Throws LockLost when
   * the token no longer holds the key.
   * @param {string} key
   * @param {string} token
   * @returns {Promise<void>}
   */
  async release(key, token) {
    checkKey(key);
    checkToken(token);
    await this.#request('POST', '/v1/release', {body: {namespace: this.namespace, key, token}, key});
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
    const reply = await this.#request('GET', '/v1/holder', {query: {namespace: this.namespace, key}});
    return toHolderOrNull(reply.holder);
  }

  /**
   * Every current lease whose key starts with `prefix`, sorted by key.
   * @param {string} [prefix]
   * @returns {Promise<Holder[]>}
   */
  async holders(prefix = '') {
    checkText(prefix, 'prefix', {allowEmpty: true, maxBytes: MAX_KEY_BYTES});
    const reply = await this.#request('GET', '/v1/holders', {query: {namespace: this.namespace, prefix}});
    if (!Array.isArray(reply.holders)) throw new StoreError(`unexpected reply from the lock server: ${show(reply)}`);
    return reply.holders.map(toHolder);
  }

  /**
   * Waits until `key` is no longer held by the lease with fencing number `fence`
   * (`fence` null: "I saw the key free"), or `timeout` seconds pass (null: as long
   * as it takes). Resolves to {changed, holder}: the holder now, or null if free.
   * @param {string} key
   * @param {number | null} fence
   * @param {number | null} [timeout]
   * @param {{signal?: AbortSignal}} [options]
   * @returns {Promise<{changed: boolean, holder: Holder | null}>}
   */
  async wait(key, fence, timeout = null, options) {
    const opts = checkOptions(options, 'wait', ['signal']);
    checkKey(key);
    if (fence !== null && !(Number.isSafeInteger(fence) && fence >= 0)) {
      throw new TypeError(`fence must be null or a non-negative integer from a holder or lease, not ${show(fence)}`);
    }
    const seconds = checkTimeout(timeout);
    const signal = checkSignal(opts.signal);
    const deadline = seconds === null ? Infinity : now() + seconds * 1000;
    for (;;) {
      const left = Math.max(0, (deadline - now()) / 1000);
      const body = {namespace: this.namespace, key, fence, timeout: Math.min(left, POLL_SECONDS)};
      const sentAt = now();
      const reply = await this.#request('POST', '/v1/wait', {body, signal, key});
      const holder = toHolderOrNull(reply.holder);
      if (reply.changed || now() >= deadline) return {changed: Boolean(reply.changed), holder};
      if (now() - sentAt < 20) await sleep(50 * Math.random(), signal);
    }
  }

  /**
   * Takes `key` over and releases it (needs the admin permission): the holder's token
   * stops working. `reason` (1 to 500 characters) is logged by the server.
   * @param {string} key
   * @param {string} reason
   * @returns {Promise<{released: boolean, holder: Holder | null}>}
   */
  async forceRelease(key, reason) {
    checkKey(key);
    if (typeof reason !== 'string') throw new TypeError(`reason must be a string, not ${show(reason)}`);
    const length = [...reason].length;
    if (length < 1 || length > MAX_REASON_CHARS) {
      throw new RangeError(`reason must be 1 to ${MAX_REASON_CHARS} characters, not ${length}`);
    }
    const reply = await this.#request('POST', '/v1/force-release', {body: {namespace: this.namespace, key, reason}, key});
    return {released: Boolean(reply.released), holder: toHolderOrNull(reply.holder)};
  }

  /**
   * Runs `fn(lease)` holding `key`: acquires (as acquire()), renews about every ttl/3
   * while fn runs, releases afterwards and resolves to fn's result. If renewal fails
   * (taken over, expired, server unreachable until the lease's deadline), lease.signal
   * is aborted, onLost(lease) is called once, and the promise rejects with LockLost
   * when fn ends — unless fn itself threw, whose error wins.
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
    if (onLost) {
      lease.signal.addEventListener('abort', () => {
        try {
          onLost(lease);
        } catch (error) {
          console.error('keymutex: the onLost callback threw', error);
        }
      });
    }
    const stopRenewing = lease[startRenewing]();
    /** @type {T} */
    let result;
    try {
      result = await fn(lease);
    } catch (error) {
      await stopRenewing();
      if (!lease.lost) await lease.release().catch(() => {}); // fn's error wins
      throw error;
    }
    await stopRenewing();
    if (lease.lost) throw lease.signal.reason ?? new LockLost(key, null);
    await lease.release(); // throws LockLost if it was lost in the meantime
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
   * One request; a reply other than 2xx becomes the matching LockError.
   * @param {'GET' | 'POST'} method
   * @param {string} path
   * @param {{body?: object, query?: Record<string, string>, signal?: AbortSignal, key?: string}} request
   * @returns {Promise<any>}
   */
  async #request(method, path, {body, query, signal, key = ''}) {
    const url = new URL(this.#base + path);
    for (const [name, value] of Object.entries(query ?? {})) url.searchParams.set(name, value);
    let response;
    let text;
    try {
      response = await fetch(url, {
        method,
        headers: this.#headers(body !== undefined),
        body: body === undefined ? undefined : JSON.stringify(body),
        signal,
      });
      text = await response.text();
    } catch (error) {
      if (signal?.aborted) throw signal.reason;
      const reason = error instanceof Error ? (error.cause instanceof Error ? error.cause.message : error.message) : String(error);
      throw new StoreError(`cannot reach the lock server at ${this.#base}: ${reason}`, {cause: error});
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
    if (response.ok) return reply;
    const code = typeof reply?.error === 'string' ? reply.error : null;
    const message = typeof reply?.message === 'string' ? reply.message : `HTTP ${response.status} from ${method} ${path}`;
    const details = {status: response.status, code};
    if (response.status === 409 && code === 'locked') throw new Locked(key, toHolderOrNull(reply.holder), message);
    if (response.status === 409 && code === 'lock_lost') throw new LockLost(key, toHolderOrNull(reply.holder), message);
    if (response.status === 401) throw new Unauthorized(message, details);
    if (response.status === 403) throw new Forbidden(message, details);
    if ([400, 413, 415].includes(response.status)) throw new InvalidArgument(message, details);
    throw new StoreError(message, details);
  }
}

// Types of keymutex-client (keymutex.js). Times are seconds, as in the HTTP API.

/** What anyone may see about a current lease; never the token. */
export interface Holder {
  readonly key: string;
  readonly owner: string;
  readonly info: Record<string, unknown> | null;
  /** Fencing number: larger than every fence granted before it on this key. */
  readonly fence: number;
  /** Server wall-clock UNIX seconds, for display. */
  readonly acquiredAt: number;
  /** Server wall-clock UNIX seconds, for display. */
  readonly expiresAt: number;
  /** Seconds that were left when the server answered. */
  readonly expiresIn: number;
}

export interface LockClientOptions {
  /** The lock server, e.g. "http://127.0.0.1:7420"; a base path is kept. Relative URLs resolve against the page in browsers. */
  url: string | URL;
  /** Default "". At most 256 bytes as UTF-8. */
  namespace?: string;
  /** Sent as "Authorization: Bearer …" when the server has a token file. Visible ASCII only. */
  apiToken?: string | null;
  /** Shown to others; default: the server's choice (the API token's name, else the peer address). */
  owner?: string | null;
  /** Default lease lifetime in seconds, [0.001, 86400]; default 30. */
  ttl?: number;
  /**
   * Seconds a request may take, beyond the wait of a long poll (acquire, wait), before it
   * fails with a StoreError whose code is "timeout"; default 10, as the Python http:// store.
   */
  requestTimeout?: number;
}

export interface AcquireOptions {
  /** Seconds the lease lives unless renewed, [0.001, 86400]; default: the client's ttl. */
  ttl?: number;
  /** null/undefined: wait as long as it takes; 0: try once; t > 0: wait up to t seconds, then throw Locked. */
  timeout?: number | null;
  /** Shown to others; a plain JSON object of at most 4 KiB, nested at most 32 levels. */
  info?: Record<string, unknown> | null;
  /** Take the key even if held: the previous holder's token stops working at once. */
  steal?: boolean;
  /** Stops waiting: the promise rejects with signal.reason; a grant that came meanwhile is given back. */
  signal?: AbortSignal | null;
}

export interface WithLockOptions extends AcquireOptions {
  /**
   * Called once when the lease is found lost while fn runs (taken over, or not renewed by
   * its deadline). What it throws, or the promise it returns rejects with, is logged.
   */
  onLost?: (lease: Lease) => unknown;
}

export interface WaitResult {
  /** Whether the key is no longer held by the lease with the fence waited on. */
  changed: boolean;
  /** The holder now, or null if the key is free. */
  holder: Holder | null;
}

/** A granted lock. */
export class Lease {
  private constructor();
  readonly key: string;
  /** The secret that proves ownership; renew and release need only key and token. */
  readonly token: string;
  readonly fence: number;
  readonly owner: string;
  readonly info: Record<string, unknown> | null;
  /** The lifetime granted by the last acquire or renew, in seconds. */
  readonly ttl: number;
  readonly acquiredAt: number;
  readonly expiresAt: number;
  /** Seconds left on this process's monotonic clock (time suspended counted); never more than the server granted. */
  readonly remaining: number;
  /** True once the lease is known gone, or its local deadline has passed; a lost lease is never revived. */
  readonly lost: boolean;
  /** Aborted, with the LockLost as reason, when the lease is found lost. */
  readonly signal: AbortSignal;
  /** What others see of this lease. */
  readonly holder: Holder;
  /**
   * Extends the lease (default: its current ttl). Throws LockLost if it no longer holds the key,
   * was released, or is lost by this process's clock (one past its deadline is released instead).
   */
  renew(options?: { ttl?: number }): Promise<Lease>;
  /**
   * Releases the lease and stops withLock's renewal of it, once a renewal of it under way has
   * ended. Throws LockLost if it no longer holds the key (already released, expired, taken over). A release that fails with a StoreError
   * throws it, and the lease counts as released: the client tries the release again in the
   * background until it lands, or the ttl has passed (not for a lease whose token the caller
   * named: from LockClient.renew of a token another client was granted).
   */
  release(): Promise<void>;
}

/**
 * Lease locks on a keymutex lock server. Keeps the live leases it granted, so that a renewal
 * or release by their key and token through it reaches them.
 */
export class LockClient {
  constructor(options: LockClientOptions);
  /** The server's base URL, without a trailing slash. */
  readonly url: string;
  readonly namespace: string;
  /** The default lease lifetime in seconds. */
  readonly ttl: number;
  /**
   * An acquire that fails while the server may have granted it (no reply in time, a reply
   * lost, a 5xx) gives that grant back in the background: released by its token until a
   * release lands, or the ttl has passed.
   */
  acquire(key: string, options?: AcquireOptions): Promise<Lease>;
  /**
   * Key and token only. A live lease this client granted to the token takes the renewal in
   * (as by lease.renew(); withLock's renewal of it is re-planned) and is the result;
   * otherwise the result is a new Lease.
   */
  renew(key: string, token: string, options?: { ttl?: number }): Promise<Lease>;
  /**
   * Key and token only. A live lease this client granted to the token is released as by
   * lease.release(): its renewal stops, and it is not lost.
   */
  release(key: string, token: string): Promise<void>;
  /** Release from a page that is closing (sendBeacon, or fetch with keepalive when an API token is set). */
  releaseBeacon(key: string, token: string): boolean;
  holder(key: string): Promise<Holder | null>;
  holders(prefix?: string): Promise<Holder[]>;
  wait(
    key: string,
    fence: number | null,
    timeout?: number | null,
    /** holding: fence is the caller's own lease, watched for its loss (not counted as a waiter). */
    options?: { signal?: AbortSignal | null; holding?: boolean },
  ): Promise<WaitResult>;
  /**
   * Needs the admin permission. reason: 1 to 500 characters. fence: release only the lease
   * with this fencing number; if another lease holds the key, throws Locked (with it).
   */
  forceRelease(
    key: string,
    reason: string,
    options?: { fence?: number | null },
  ): Promise<{ released: boolean; holder: Holder | null }>;
  /**
   * Runs fn holding key, renewing every ttl/3 (of the ttl of the last renewal, whoever made
   * it); releases after (unless fn released the lease, itself or by its key and token through
   * this client); rejects with LockLost if the lease was lost meanwhile, unless fn threw.
   */
  withLock<T>(key: string, fn: (lease: Lease) => T | Promise<T>, options?: WithLockOptions): Promise<T>;
}

/** Base of every error this client throws on purpose. */
export class LockError extends Error {}

/** Not acquired within the timeout. */
export class Locked extends LockError {
  constructor(key: string, holder: Holder | null, message?: string);
  readonly key: string;
  readonly holder: Holder | null;
}

/** The lease no longer holds its key. */
export class LockLost extends LockError {
  constructor(key: string, holder: Holder | null, message?: string);
  readonly key: string;
  /** The new holder, or null. */
  readonly holder: Holder | null;
}

/** The server failed, could not be reached, or refused the request. */
export class StoreError extends LockError {
  constructor(
    message: string,
    details?: { status?: number | null; code?: string | null; cause?: unknown },
  );
  /** HTTP status, or null when no reply came. */
  readonly status: number | null;
  /**
   * The server's error code, e.g. "store_unavailable"; when no reply came, "unreachable" (the
   * connection failed) or "timeout" (no answer within requestTimeout); else null.
   */
  readonly code: string | null;
}

/** The server rejected an argument (HTTP 400, 413, 415). */
export class InvalidArgument extends StoreError {}
/** Missing or unknown API token (HTTP 401). */
export class Unauthorized extends StoreError {}
/** The API token lacks the permission (HTTP 403). */
export class Forbidden extends StoreError {}

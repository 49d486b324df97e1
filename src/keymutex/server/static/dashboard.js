// The dashboard: held locks, live from the server's /v1/events stream.
//
// Each `holders` event is a snapshot {holders, waiting, total, server_time}: the first
// rows by key (the server sends 500 at most) and how many are held. Times are shown
// relative to that snapshot and counted down on this page's monotonic clock, so a
// browser whose wall clock is off still shows the right "expires in".
//
// Without an API token the stream is an EventSource. EventSource cannot send an
// Authorization header and the HTTP API has no token in the query string, so with a
// token the same stream is read through fetch() instead.
//
// While the stream is not live (lost, refused, or the server's store failing), the
// table stays as the last snapshot showed it, marked "as of" that snapshot, its
// countdowns stopped: a lock released meanwhile must not look held and ticking.
import {Forbidden, LockClient, Locked, Unauthorized} from './keymutex.js';

const TOKEN_KEY = 'keymutex.apiToken';
const STALE_MS = 15000; // the server sends a snapshot at least every 5 s
const base = new URL('.', location.href);
const $ = (/** @type {string} */ id) => /** @type {any} */ (document.getElementById(id));

const view = {
  status: $('status'),
  filter: $('filter'),
  namespace: $('namespace'),
  prefix: $('prefix'),
  tokenForm: $('token-form'),
  tokenReason: $('token-reason'),
  token: $('token'),
  message: $('message'),
  scope: $('scope'),
  count: $('count'),
  rows: document.querySelector('#locks tbody'),
  empty: $('empty'),
  dialog: $('force-dialog'),
  forceForm: $('force-form'),
  forceKey: $('force-key'),
  forceHolder: $('force-holder'),
  reason: $('reason'),
  forceError: $('force-error'),
  table: $('locks'),
  tokenError: $('token-error'),
};

const params = new URLSearchParams(location.search);
const state = {
  namespace: params.get('namespace') ?? '',
  prefix: params.get('prefix') ?? '',
  /** @type {{holders: any[], waiting: Record<string, number>, server_time: number, total?: number} | null} */
  snapshot: null,
  receivedAt: 0, // performance.now() when the snapshot arrived
  lastEventAt: 0,
  live: false, // the snapshot is the latest of a working stream
  storeFailing: false, // the message shown is the store's error, gone with the next snapshot
  /** @type {(() => void) | null} */
  closeStream: null,
  retries: 0,
  /** @type {ReturnType<typeof setTimeout> | undefined} */
  retryTimer: undefined,
  /** @type {{key: string, owner: string, fence: number} | null} */
  force: null, // the lease that the open force-release dialog is about
  /** @type {Map<string, {heldFor: Element, expiresIn: Element, row: Element}>} */
  cells: new Map(), // the cells tick() updates, by key: no lookup per row and second
};

const apiToken = () => sessionStorage.getItem(TOKEN_KEY);
const client = () => new LockClient({url: base.href, namespace: state.namespace, apiToken: apiToken()});

// ---------------------------------------------------------------------------------
// The stream

/** The URL of an endpoint, for the namespace and prefix shown. @param {string} path */
function endpoint(path) {
  const query = new URLSearchParams({namespace: state.namespace, prefix: state.prefix});
  return new URL(`${path}?${query}`, base);
}

function connect() {
  disconnect();
  state.lastEventAt = performance.now();
  setStatus('Connecting…');
  const token = apiToken();
  const url = endpoint('v1/events');
  state.closeStream = token ? streamWithFetch(url, token) : streamWithEventSource(url);
}

function disconnect() {
  clearTimeout(state.retryTimer);
  state.closeStream?.();
  state.closeStream = null;
  setLive(false);
}

/** @param {URL} url */
function streamWithEventSource(url) {
  const source = new EventSource(url);
  source.addEventListener('holders', (event) => onSnapshot(event.data));
  source.addEventListener('open', () => setStatus('Connected; waiting for the list…'));
  source.addEventListener('error', (event) => {
    if (event instanceof MessageEvent) {
      // The server's own `event: error` (its store failed): the stream goes on.
      state.lastEventAt = performance.now();
      onStoreError(event.data);
      return;
    }
    // CONNECTING: the browser retries by itself. CLOSED: the server answered an
    // error status, which EventSource neither retries nor shows us.
    setLive(false);
    if (source.readyState === EventSource.CLOSED) {
      source.close();
      diagnose();
    } else {
      setStatus('Connection lost; reconnecting…');
    }
  });
  return () => source.close();
}

/** @param {URL} url @param {string} token */
function streamWithFetch(url, token) {
  const controller = new AbortController();
  (async () => {
    const response = await fetch(url, {
      headers: {Accept: 'text/event-stream', Authorization: `Bearer ${token}`},
      cache: 'no-store',
      signal: controller.signal,
    });
    if (!response.ok) {
      await refused(response);
      return;
    }
    if (!response.body) throw new Error(`HTTP ${response.status} without a body`);
    setStatus('Connected; waiting for the list…');
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n?/g, '\n');
      let end;
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        dispatch(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
      }
    }
    throw new Error('the stream ended');
  })().catch((error) => {
    if (!controller.signal.aborted) {
      console.warn('keymutex dashboard: event stream failed', error);
      retryLater();
    }
  });
  return () => controller.abort();
}

/** One Server-Sent Event block (the lines between blank lines). @param {string} block */
function dispatch(block) {
  let event = 'message';
  const data = [];
  for (const line of block.split('\n')) {
    if (!line || line.startsWith(':')) continue; // comments are keep-alive pings
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
    if (field === 'event') event = value;
    else if (field === 'data') data.push(value);
  }
  state.lastEventAt = performance.now();
  if (event === 'holders' && data.length) onSnapshot(data.join('\n'));
  else if (event === 'error') onStoreError(data.join('\n'));
}

/**
 * After a refused stream (EventSource does not tell why): the same question as an
 * ordinary request, whose answer says why.
 */
async function diagnose() {
  let response;
  try {
    const token = apiToken();
    response = await fetch(endpoint('v1/holders'), {
      headers: token ? {Accept: 'application/json', Authorization: `Bearer ${token}`} : {Accept: 'application/json'},
      cache: 'no-store',
    });
  } catch {
    retryLater();
    return;
  }
  if (response.ok) retryLater();
  else await refused(response);
}

/**
 * A stream (or its diagnosis) answered with an error status. 401: ask for a token.
 * Another 4xx (a namespace or prefix the server refuses, a token without the read
 * permission): asking again would get the same answer, so show the server's message
 * and stop until the filter or the token changes. 5xx (the store failing): show it
 * and retry.
 * @param {Response} response
 */
async function refused(response) {
  /** @type {any} */
  let reply = null;
  try {
    reply = await response.json();
  } catch {
    // Not JSON (a proxy's error page): the status says enough.
  }
  const message = typeof reply?.message === 'string' ? reply.message : `HTTP ${response.status} ${response.statusText}`.trim();
  if (response.status === 401) {
    askToken(apiToken() ? 'The server refused this token. Enter another one.' : 'This server needs an API token.');
  } else if (response.status >= 400 && response.status < 500) {
    disconnect();
    setStatus(response.status === 403 ? 'Not allowed' : 'Refused by the server');
    showMessage(message);
  } else {
    retryLater(`The server answered ${response.status}`);
    showMessage(message, {storeFailing: reply?.error === 'store_unavailable'});
  }
}

/** The server's `event: error`: its store failed; the stream goes on. @param {string} text */
function onStoreError(text) {
  /** @type {any} */
  let reply = null;
  try {
    reply = JSON.parse(text);
  } catch {
    // shown as it came
  }
  const message = typeof reply?.message === 'string' ? reply.message : text || 'unknown error';
  setLive(false);
  setStatus('The lock server cannot read its store; waiting for it…');
  showMessage(`The lock server's store failed: ${message}`, {storeFailing: true});
}

/** @param {string} [why] what went wrong, for the status line */
function retryLater(why = 'Connection lost') {
  disconnect();
  const delay = Math.min(30000, 1000 * 2 ** state.retries) * (0.5 + Math.random() / 2);
  state.retries++;
  setStatus(`${why}; reconnecting in ${Math.ceil(delay / 1000)} s…`);
  state.retryTimer = setTimeout(connect, delay);
}

/** Live: the table counts down from the snapshot. Not live: it stays "as of" it. @param {boolean} live */
function setLive(live) {
  if (state.live === live) return;
  state.live = live;
  if (!live) render(); // the countdowns stop where the snapshot left them
}

/** @param {string} text */
function onSnapshot(text) {
  let snapshot;
  try {
    snapshot = JSON.parse(text);
  } catch {
    return;
  }
  state.snapshot = snapshot;
  state.receivedAt = state.lastEventAt = performance.now();
  state.retries = 0;
  state.live = true;
  if (state.storeFailing) hideMessage();
  setStatus(`Live · updated ${clock(snapshot.server_time)}`);
  render();
  // After the work: a page that took long to draw is not judged stale for it.
  state.lastEventAt = performance.now();
}

/** @param {number} time UNIX seconds */
function clock(time) {
  return new Date(time * 1000).toLocaleTimeString();
}

// ---------------------------------------------------------------------------------
// The table

/** @param {number} seconds */
function duration(seconds) {
  const s = Math.max(0, Math.floor(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

/** @param {string} tag @param {Record<string, string>} [attributes] @param {string} [text] */
function element(tag, attributes = {}, text = '') {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  node.textContent = text;
  return node;
}

/** "name: Alice · since: …" for an info object. @param {Record<string, unknown> | null} info */
function describeInfo(info) {
  if (info === null || typeof info !== 'object') return '';
  return Object.entries(info)
    .map(([name, value]) => `${name}: ${typeof value === 'string' ? value : JSON.stringify(value)}`)
    .join(' · ');
}

function render() {
  const snapshot = state.snapshot;
  if (!snapshot) return;
  // A Map, not the object's own lookup: a key may be named "constructor" or "__proto__",
  // which every object answers (found by review: "function Object() { [native code] }"
  // was shown waiting for a key "constructor").
  const waiting = new Map(Object.entries(snapshot.waiting ?? {}));
  const rows = new Map(snapshot.holders.map((holder) => [holder.key, holder]));
  for (const key of waiting.keys()) if (!rows.has(key)) rows.set(key, null); // free, yet awaited
  const keys = [...rows.keys()].sort();
  // Rows are rebuilt: keep the keyboard focus on the same row's button.
  const focusedKey = document.activeElement?.closest?.('tr')?.dataset.key;
  state.cells = new Map();

  view.rows.replaceChildren(
    ...keys.map((key) => {
      const holder = rows.get(key);
      const row = element('tr', {'data-key': key});
      row.append(element('th', {scope: 'row'}, key));
      if (holder) {
        const heldFor = element('td', {class: 'number held-for'});
        const expiresIn = element('td', {class: 'number expires-in'});
        row.append(
          element('td', {class: 'owner'}, holder.owner),
          element('td', {class: 'info', title: holder.info === null ? '' : JSON.stringify(holder.info)}, describeInfo(holder.info)),
          element('td', {class: 'number fence'}, String(holder.fence)),
          heldFor,
          expiresIn,
        );
        state.cells.set(key, {heldFor, expiresIn, row});
      } else {
        row.classList.add('free');
        row.append(element('td', {class: 'owner muted', colspan: '5'}, 'free'));
      }
      row.append(element('td', {class: 'number waiting'}, String(waiting.get(key) ?? 0)));
      const actions = element('td', {class: 'actions'});
      if (holder) {
        const button = element('button', {type: 'button', class: 'danger', 'aria-label': `Force release ${key}`}, 'Force release…');
        button.addEventListener('click', () => openForceRelease(holder));
        actions.append(button);
      }
      row.append(actions);
      return row;
    }),
  );
  if (focusedKey !== undefined) {
    /** @type {HTMLElement | null} */ (view.rows.querySelector(`tr[data-key="${CSS.escape(focusedKey)}"] button`))?.focus();
  }
  // The stream lists the first rows by key (the server's cap) and counts them all.
  const total = snapshot.total ?? snapshot.holders.length;
  const shown = total > snapshot.holders.length ? `; the first ${snapshot.holders.length} shown, narrow with a prefix` : '';
  const held = `${total} held${shown}`;
  view.count.textContent = state.live ? `(${held})` : `(${held} as of ${clock(snapshot.server_time)}; not live)`;
  view.table.classList.toggle('stale', !state.live);
  view.empty.hidden = keys.length > 0;
  tick();
}

/**
 * Counts "held for" up and "expires in" down from the snapshot, once a second; not
 * while the stream is not live: the table then shows the snapshot as it came.
 */
function tick() {
  const snapshot = state.snapshot;
  if (!snapshot) return;
  const elapsed = state.live ? (performance.now() - state.receivedAt) / 1000 : 0;
  for (const holder of snapshot.holders) {
    const cells = state.cells.get(holder.key);
    if (!cells) continue;
    cells.heldFor.textContent = duration(snapshot.server_time - holder.acquired_at + elapsed);
    const left = holder.expires_in - elapsed;
    // Past it by the snapshot's count: a renewal may be on its way (one made elsewhere
    // than through this server shows at the next snapshot); an expiry shows as the row gone.
    cells.expiresIn.textContent = left > 0 ? duration(Math.ceil(left)) : 'renewal due';
    cells.row.classList.toggle('expiring', left <= 5);
  }
  if (state.closeStream && performance.now() - state.lastEventAt > STALE_MS) retryLater();
}

// ---------------------------------------------------------------------------------
// Force release

/**
 * The dialog is about the lease of the row clicked: it names its owner and fence, and
 * the request carries the fence, so a lease that took the key meanwhile is not released.
 * @param {{key: string, owner: string, fence: number, acquired_at: number}} holder
 */
/**
 * A key or name inside a sentence, its bidirectional controls shown as escapes (as the
 * command line shows them): found by review, a right-to-left override in a key
 * (U+202E) turned the rest of the sentence around ("Released invoice/,yp yb dleh…").
 * @param {string} text
 */
function isolated(text) {
  return text.replace(/[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
}

function openForceRelease(holder) {
  state.force = {key: holder.key, owner: holder.owner, fence: holder.fence};
  view.forceKey.textContent = holder.key;
  view.forceHolder.textContent = `Held by ${isolated(holder.owner)} (fence ${holder.fence}) since ${clock(holder.acquired_at)}.`;
  view.reason.value = '';
  showForceError('');
  view.dialog.showModal();
  view.reason.focus();
}

/** @param {string} text none: hidden */
function showForceError(text) {
  view.forceError.textContent = text;
  view.forceError.hidden = !text;
}

view.forceForm.addEventListener('submit', async (/** @type {SubmitEvent} */ event) => {
  event.preventDefault();
  const target = state.force;
  if (!target) return;
  const reason = view.reason.value.trim();
  if (!reason) {
    // `required` lets a reason of spaces through; the server refuses it as well.
    showForceError('Give a reason: the server logs it with the release.');
    view.reason.focus();
    return;
  }
  const {key, owner, fence} = target;
  const submit = view.forceForm.querySelector('button[type=submit]');
  submit.disabled = true;
  try {
    const {released, holder} = await client().forceRelease(key, reason, {fence});
    view.dialog.close();
    showMessage(released ? `Released ${isolated(key)} (held by ${isolated(holder?.owner ?? owner)}, fence ${holder?.fence ?? fence}).` : `${isolated(key)} was not held any more.`);
  } catch (error) {
    if (error instanceof Unauthorized) {
      view.dialog.close();
      askToken('Force release needs an API token with the admin permission.');
    } else if (error instanceof Locked) {
      // Another lease holds the key now: nothing was released.
      showForceError(`Not released: ${error.message}`);
    } else {
      showForceError(error instanceof Forbidden ? `Not allowed: ${error.message}` : String(error.message ?? error));
    }
  } finally {
    submit.disabled = false;
  }
});
$('force-cancel').addEventListener('click', () => view.dialog.close());
// Back to the row's button: found by review, a snapshot while the dialog was open
// rebuilt the rows, and the button focus would return to was gone (focus on <body>).
view.dialog.addEventListener('close', () => {
  const key = state.force?.key;
  if (key === undefined) return;
  /** @type {HTMLElement | null} */ (view.rows.querySelector(`tr[data-key="${CSS.escape(key)}"] button`) ?? view.rows.closest('table'))?.focus();
});

// ---------------------------------------------------------------------------------
// Filter, token, messages

/** @param {string} text */
function setStatus(text) {
  if (view.status.textContent !== text) view.status.textContent = text;
}

/** @param {string} text @param {{storeFailing?: boolean}} [options] */
function showMessage(text, {storeFailing = false} = {}) {
  view.message.textContent = text;
  view.message.hidden = false;
  state.storeFailing = storeFailing;
}

function hideMessage() {
  view.message.hidden = true;
  state.storeFailing = false;
}

/** @param {string} reason */
function askToken(reason) {
  disconnect();
  setStatus('API token needed');
  view.tokenReason.textContent = reason;
  view.tokenForm.hidden = false;
  view.token.focus();
}

view.tokenForm.addEventListener('submit', (/** @type {SubmitEvent} */ event) => {
  event.preventDefault();
  const token = view.token.value.trim();
  try {
    new LockClient({url: base.href, apiToken: token}); // the client's own checks of a token
  } catch (error) {
    view.tokenError.textContent = `This API token cannot be sent: ${error.message}`;
    view.tokenError.hidden = false;
    return;
  }
  view.tokenError.hidden = true;
  sessionStorage.setItem(TOKEN_KEY, token);
  view.token.value = '';
  view.tokenForm.hidden = true;
  hideMessage();
  connect();
});

function showScope() {
  view.namespace.value = state.namespace;
  view.prefix.value = state.prefix;
  const where = state.namespace ? `namespace “${state.namespace}”` : 'the default namespace';
  view.scope.textContent = state.prefix ? `${where}, keys starting “${state.prefix}”` : where;
}

view.filter.addEventListener('submit', (/** @type {SubmitEvent} */ event) => {
  event.preventDefault();
  state.namespace = view.namespace.value;
  state.prefix = view.prefix.value;
  const query = new URLSearchParams();
  if (state.namespace) query.set('namespace', state.namespace);
  if (state.prefix) query.set('prefix', state.prefix);
  history.replaceState(null, '', `${location.pathname}${query.toString() ? `?${query}` : ''}`);
  state.snapshot = null;
  view.rows.replaceChildren();
  view.count.textContent = '';
  view.table.classList.remove('stale');
  view.empty.hidden = true;
  hideMessage();
  showScope();
  connect();
});

showScope();
connect();
setInterval(tick, 1000);

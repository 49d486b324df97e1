// The dashboard: held locks, live from the server's /v1/events stream.
//
// Each `holders` event is a snapshot {holders, waiting, server_time}. Times are shown
// relative to that snapshot and counted down on this page's monotonic clock, so a
// browser whose wall clock is off still shows the right "expires in".
//
// Without an API token the stream is an EventSource. EventSource cannot send an
// Authorization header and the HTTP API has no token in the query string, so with a
// token the same stream is read through fetch() instead.
import {Forbidden, LockClient, Unauthorized} from './keymutex.js';

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
  reason: $('reason'),
  forceError: $('force-error'),
};

const params = new URLSearchParams(location.search);
const state = {
  namespace: params.get('namespace') ?? '',
  prefix: params.get('prefix') ?? '',
  /** @type {{holders: any[], waiting: Record<string, number>, server_time: number} | null} */
  snapshot: null,
  receivedAt: 0, // performance.now() when the snapshot arrived
  lastEventAt: 0,
  /** @type {(() => void) | null} */
  closeStream: null,
  retries: 0,
  /** @type {ReturnType<typeof setTimeout> | undefined} */
  retryTimer: undefined,
  forceKey: '',
};

const apiToken = () => sessionStorage.getItem(TOKEN_KEY);
const client = () => new LockClient({url: base.href, namespace: state.namespace, apiToken: apiToken()});

// ---------------------------------------------------------------------------------
// The stream

function connect() {
  disconnect();
  const query = new URLSearchParams({namespace: state.namespace, prefix: state.prefix});
  const url = new URL(`v1/events?${query}`, base);
  state.lastEventAt = performance.now();
  setStatus('Connecting…');
  const token = apiToken();
  state.closeStream = token ? streamWithFetch(url, token) : streamWithEventSource(url);
}

function disconnect() {
  clearTimeout(state.retryTimer);
  state.closeStream?.();
  state.closeStream = null;
}

/** @param {URL} url */
function streamWithEventSource(url) {
  const source = new EventSource(url);
  source.addEventListener('holders', (event) => onSnapshot(event.data));
  source.addEventListener('open', () => setStatus('Live'));
  source.addEventListener('error', () => {
    // CONNECTING: the browser retries by itself. CLOSED: the server answered an
    // error status (401?), which EventSource neither retries nor shows us.
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
    if (response.status === 401) {
      askToken('The server refused this token. Enter another one.');
      return;
    }
    if (!response.ok || !response.body) throw new Error(`HTTP ${response.status}`);
    setStatus('Live');
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
}

/** After a refused stream: find out why with an ordinary request, then retry or ask. */
async function diagnose() {
  try {
    await client().holders(state.prefix);
    retryLater();
  } catch (error) {
    if (error instanceof Unauthorized) {
      askToken(apiToken() ? 'The server refused this token. Enter another one.' : 'This server needs an API token.');
    } else if (error instanceof Forbidden) {
      setStatus('Not allowed');
      showMessage(error.message);
    } else {
      retryLater();
    }
  }
}

function retryLater() {
  disconnect();
  const delay = Math.min(30000, 1000 * 2 ** state.retries) * (0.5 + Math.random() / 2);
  state.retries++;
  setStatus(`Connection lost; reconnecting in ${Math.ceil(delay / 1000)} s…`);
  state.retryTimer = setTimeout(connect, delay);
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
  setStatus(`Live · updated ${new Date(snapshot.server_time * 1000).toLocaleTimeString()}`);
  render();
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
  const waiting = snapshot.waiting ?? {};
  const rows = new Map(snapshot.holders.map((holder) => [holder.key, holder]));
  for (const key of Object.keys(waiting)) if (!rows.has(key)) rows.set(key, null); // free, yet awaited
  const keys = [...rows.keys()].sort();
  // Rows are rebuilt: keep the keyboard focus on the same row's button.
  const focusedKey = document.activeElement?.closest?.('tr')?.dataset.key;

  view.rows.replaceChildren(
    ...keys.map((key) => {
      const holder = rows.get(key);
      const row = element('tr', {'data-key': key});
      row.append(element('th', {scope: 'row'}, key));
      if (holder) {
        row.append(
          element('td', {class: 'owner'}, holder.owner),
          element('td', {class: 'info', title: holder.info === null ? '' : JSON.stringify(holder.info)}, describeInfo(holder.info)),
          element('td', {class: 'number fence'}, String(holder.fence)),
          element('td', {class: 'number held-for'}),
          element('td', {class: 'number expires-in'}),
        );
      } else {
        row.classList.add('free');
        row.append(element('td', {class: 'owner muted', colspan: '5'}, 'free'));
      }
      row.append(element('td', {class: 'number waiting'}, String(waiting[key] ?? 0)));
      const actions = element('td', {class: 'actions'});
      if (holder) {
        const button = element('button', {type: 'button', class: 'danger', 'aria-label': `Force release ${key}`}, 'Force release…');
        button.addEventListener('click', () => openForceRelease(key));
        actions.append(button);
      }
      row.append(actions);
      return row;
    }),
  );
  if (focusedKey !== undefined) {
    /** @type {HTMLElement | null} */ (view.rows.querySelector(`tr[data-key="${CSS.escape(focusedKey)}"] button`))?.focus();
  }
  view.count.textContent = `(${snapshot.holders.length} held)`;
  view.empty.hidden = keys.length > 0;
  tick();
}

/** Counts "held for" up and "expires in" down from the snapshot, once a second. */
function tick() {
  const snapshot = state.snapshot;
  if (!snapshot) return;
  const elapsed = (performance.now() - state.receivedAt) / 1000;
  for (const holder of snapshot.holders) {
    const row = view.rows.querySelector(`tr[data-key="${CSS.escape(holder.key)}"]`);
    if (!row) continue;
    row.querySelector('.held-for').textContent = duration(snapshot.server_time - holder.acquired_at + elapsed);
    const left = holder.expires_in - elapsed;
    row.querySelector('.expires-in').textContent = left > 0 ? duration(Math.ceil(left)) : 'expired';
    row.classList.toggle('expiring', left <= 5);
  }
  if (state.closeStream && performance.now() - state.lastEventAt > STALE_MS) retryLater();
}

// ---------------------------------------------------------------------------------
// Force release

/** @param {string} key */
function openForceRelease(key) {
  state.forceKey = key;
  view.forceKey.textContent = key;
  view.reason.value = '';
  view.forceError.hidden = true;
  view.dialog.showModal();
  view.reason.focus();
}

view.forceForm.addEventListener('submit', async (/** @type {SubmitEvent} */ event) => {
  event.preventDefault();
  const key = state.forceKey;
  const submit = view.forceForm.querySelector('button[type=submit]');
  submit.disabled = true;
  try {
    const {released, holder} = await client().forceRelease(key, view.reason.value.trim() || view.reason.value);
    view.dialog.close();
    showMessage(released ? `Released ${key} (held by ${holder?.owner ?? 'nobody'}).` : `${key} was not held any more.`);
  } catch (error) {
    if (error instanceof Unauthorized) {
      view.dialog.close();
      askToken('Force release needs an API token with the admin permission.');
    } else {
      view.forceError.textContent = error instanceof Forbidden ? `Not allowed: ${error.message}` : String(error.message ?? error);
      view.forceError.hidden = false;
    }
  } finally {
    submit.disabled = false;
  }
});
$('force-cancel').addEventListener('click', () => view.dialog.close());

// ---------------------------------------------------------------------------------
// Filter, token, messages

/** @param {string} text */
function setStatus(text) {
  if (view.status.textContent !== text) view.status.textContent = text;
}

/** @param {string} text */
function showMessage(text) {
  view.message.textContent = text;
  view.message.hidden = false;
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
  sessionStorage.setItem(TOKEN_KEY, view.token.value.trim());
  view.token.value = '';
  view.tokenForm.hidden = true;
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
  view.message.hidden = true;
  showScope();
  connect();
});

showScope();
connect();
setInterval(tick, 1000);

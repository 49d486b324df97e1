// The edit-lock demo (story 5): opening a document for editing takes its lock, the
// page keeps it alive with heartbeats, others see who edits and may take over.
//
// The page keeps nothing on the server but the lease: heartbeats and the release on
// close are separate requests carrying only the key and this window's token, so each
// window is its own holder, and a crashed tab's lock expires after TTL seconds.
import {LockClient, LockLost, Locked, Unauthorized} from './keymutex.js';

const TTL = 15; // seconds: how long a crashed tab blocks the document
const HEARTBEAT_MS = 5000; // three heartbeats per ttl, so one lost request costs nothing
const NAME_KEY = 'keymutex.demo.name';
const TOKEN_KEY = 'keymutex.apiToken';

const $ = (/** @type {string} */ id) => /** @type {any} */ (document.getElementById(id));
const view = {
  key: $('key'),
  nameForm: $('name-form'),
  name: $('name'),
  tokenForm: $('token-form'),
  tokenReason: $('token-reason'),
  token: $('token'),
  lockState: $('lock-state'),
  state: $('state'),
  detail: $('detail'),
  takeOver: $('take-over'),
  stop: $('stop'),
  editAgain: $('edit-again'),
  text: $('text'),
};

// /demo/edit/<key>, possibly below a base path where the server is mounted.
const route = /^(.*)\/demo\/edit\/(.+)$/.exec(location.pathname);
const base = `${location.origin}${route ? route[1] : ''}`;
const namespace = new URLSearchParams(location.search).get('namespace') ?? '';
let key = '';
try {
  key = route ? decodeURIComponent(route[2]) : '';
} catch {
  key = '';
}

let name = '';
/** @type {LockClient | null} */
let client = null;
/** @type {import('./keymutex.js').Lease | null} */
let lease = null; // set while this window holds the lock
/** @type {ReturnType<typeof setTimeout> | undefined} */
let heartbeatTimer;
/** @type {AbortController | null} */
let watching = null; // set while waiting for the holder to leave
/** @type {AbortController | null} */
let guarding = null; // set while editing: learns at once when the lock is gone
let releasedOnHide = false;

// ---------------------------------------------------------------------------------
// What the page shows

/**
 * @param {'editing' | 'locked' | 'lost' | ''} kind
 * @param {string} text
 * @param {string} detail
 * @param {{takeOver?: boolean, stop?: boolean, editAgain?: boolean}} [buttons]
 */
function show(kind, text, detail, buttons = {}) {
  view.lockState.hidden = false;
  view.lockState.className = `lock-state ${kind}`;
  view.state.textContent = text;
  view.detail.textContent = detail;
  view.takeOver.hidden = !buttons.takeOver;
  view.stop.hidden = !buttons.stop;
  view.editAgain.hidden = !buttons.editAgain;
}

/** @param {boolean} editable */
function setEditable(editable) {
  view.text.disabled = !editable;
  if (editable) view.text.focus();
}

/** @param {import('./keymutex.js').Holder} holder */
function who(holder) {
  const display = holder.info?.name;
  return typeof display === 'string' && display ? display : holder.owner;
}

/** @param {import('./keymutex.js').Holder} holder */
function since(holder) {
  return new Date(holder.acquiredAt * 1000).toLocaleTimeString([], {hour: '2-digit', minute: '2-digit'});
}

/** @param {number} ms @param {AbortSignal} signal */
function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener('abort', () => {
      clearTimeout(timer);
      resolve(undefined);
    });
  });
}

// ---------------------------------------------------------------------------------
// Taking, keeping and losing the lock

function makeClient() {
  return new LockClient({url: base, namespace, owner: name, apiToken: sessionStorage.getItem(TOKEN_KEY)});
}

function info() {
  return {name, since: new Date().toISOString()};
}

/** Try once to take the lock (or take it over); if it is held, watch its holder. */
async function open({steal = false} = {}) {
  stopWatching();
  releasedOnHide = false;
  show('', steal ? 'Taking over…' : 'Opening…', '');
  try {
    lease = await /** @type {LockClient} */ (client).acquire(key, {ttl: TTL, timeout: 0, steal, info: info()});
  } catch (error) {
    if (error instanceof Locked) watch(error.holder);
    else failed(error, () => open({steal}));
    return;
  }
  editing();
}

function editing() {
  show('editing', `Editing as ${name}`, 'Others who open this document see that you are editing it.', {stop: true});
  setEditable(true);
  heartbeatTimer = setTimeout(heartbeat, HEARTBEAT_MS);
  if (document.visibilityState === 'visible') guard(/** @type {import('./keymutex.js').Lease} */ (lease));
}

/**
 * While `current` holds the lock and the page is seen, a long poll (the server's wait)
 * that answers when the key is no longer held by its fence: taken over, released by
 * someone else, expired. A fence is never given twice, so that answer is the loss
 * itself, shown at once rather than at the next heartbeat (up to 5 s of typing into a
 * document someone else edits). Hidden tabs do not watch: a browser opens at most six
 * connections to one server, and a long poll in each of many editing tabs would leave
 * none for their heartbeats. A tab shown again watches again, and its first poll
 * answers at once if the lock was lost meanwhile.
 * @param {import('./keymutex.js').Lease} current
 */
async function guard(current) {
  stopGuarding();
  const controller = new AbortController();
  guarding = controller;
  const {signal} = controller;
  while (!signal.aborted && lease === current) {
    let result;
    try {
      result = await /** @type {LockClient} */ (client).wait(key, current.fence, null, {signal, holding: true});
    } catch {
      // Unreachable for now: the heartbeat says so, and keeps the lease's deadline.
      await sleep(2000, signal);
      continue;
    }
    if (signal.aborted || lease !== current) return;
    if (result.changed) {
      lost(result.holder);
      return;
    }
  }
}

function stopGuarding() {
  guarding?.abort();
  guarding = null;
}

async function heartbeat() {
  const current = lease;
  if (!current) return;
  try {
    await current.renew({ttl: TTL});
    if (lease !== current) return;
    view.detail.textContent = 'Others who open this document see that you are editing it.';
    heartbeatTimer = setTimeout(heartbeat, HEARTBEAT_MS);
  } catch (error) {
    if (lease !== current) return;
    if (error instanceof LockLost) {
      lost(error.holder);
    } else if (current.remaining === 0) {
      lost(null);
    } else {
      // The server is unreachable for now: retry until the lease's own deadline.
      view.detail.textContent = `Cannot reach the lock server (${error.message}); retrying…`;
      heartbeatTimer = setTimeout(heartbeat, 1000);
    }
  }
}

/** @param {import('./keymutex.js').Holder | null} holder the new holder, if any */
function lost(holder) {
  clearTimeout(heartbeatTimer);
  stopGuarding();
  lease = null;
  setEditable(false);
  const text = holder ? `Your lock was taken over by ${who(holder)}` : 'Your lock expired or was released by someone else';
  show('lost', text, 'Editing is disabled: your changes here would overwrite theirs.', {takeOver: true});
}

/** @param {import('./keymutex.js').Holder | null} holder */
function lockedBy(holder) {
  setEditable(false);
  if (holder) {
    show('locked', `Locked by ${who(holder)} since ${since(holder)}`, 'You get the lock as soon as they leave, or you can take it over.', {takeOver: true});
  } else {
    show('locked', 'Waiting for the lock…', '', {takeOver: true});
  }
}

/**
 * Waits (server long polls) for the holder to change; takes the lock once it is free.
 * @param {import('./keymutex.js').Holder | null} holder
 */
async function watch(holder) {
  stopWatching();
  const controller = new AbortController();
  watching = controller;
  const {signal} = controller;
  const locks = /** @type {LockClient} */ (client);
  let current = holder;
  lockedBy(current);
  while (!signal.aborted) {
    try {
      if (current === null) {
        let got;
        try {
          // No signal here: a grant must never be lost in an aborted request.
          got = await locks.acquire(key, {ttl: TTL, timeout: 0, info: info()});
        } catch (error) {
          if (!(error instanceof Locked)) throw error;
          current = error.holder;
          if (!signal.aborted) lockedBy(current);
          if (current === null) await sleep(250, signal);
          continue;
        }
        if (signal.aborted) {
          // "Take over" was clicked meanwhile and steals on its own: give this one back.
          locks.release(key, got.token).catch(() => {});
          return;
        }
        watching = null;
        lease = got;
        editing();
        return;
      }
      const result = await locks.wait(key, current.fence, 30, {signal});
      current = result.holder;
      if (current) lockedBy(current);
    } catch (error) {
      if (signal.aborted) return;
      if (error instanceof Unauthorized) {
        askToken(() => watch(current));
        return;
      }
      view.detail.textContent = `Cannot reach the lock server (${error.message}); retrying…`;
      await sleep(2000, signal);
    }
  }
}

function stopWatching() {
  watching?.abort();
  watching = null;
}

/**
 * @param {any} error
 * @param {() => void} retry
 */
function failed(error, retry) {
  if (error instanceof Unauthorized) {
    askToken(retry);
    return;
  }
  show('lost', `Could not open the document for editing: ${error.message}`, '', {editAgain: true});
}

async function stopEditing() {
  const current = lease;
  if (!current) return;
  clearTimeout(heartbeatTimer);
  stopGuarding();
  lease = null;
  setEditable(false);
  try {
    await current.release();
    show('', 'You stopped editing; the document is free for others.', '', {editAgain: true});
  } catch (error) {
    if (error instanceof LockLost) lost(error.holder);
    else show('lost', `Could not release the lock: ${error.message}`, 'It expires by itself within 15 s.', {editAgain: true});
  }
}

// ---------------------------------------------------------------------------------
// Token, name, buttons, page life

/** @type {(() => void) | null} */
let afterToken = null;

/** @param {() => void} retry */
function askToken(retry) {
  afterToken = retry;
  view.tokenReason.textContent = sessionStorage.getItem(TOKEN_KEY)
    ? 'The server refused this API token. Enter another one.'
    : 'This server needs an API token.';
  view.tokenForm.hidden = false;
  view.token.focus();
}

view.tokenForm.addEventListener('submit', (/** @type {SubmitEvent} */ event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, view.token.value.trim());
  view.token.value = '';
  view.tokenForm.hidden = true;
  client = makeClient();
  afterToken?.();
});

view.nameForm.addEventListener('submit', (/** @type {SubmitEvent} */ event) => {
  event.preventDefault();
  name = view.name.value.trim();
  if (!name) return;
  localStorage.setItem(NAME_KEY, name);
  view.nameForm.hidden = true;
  client = makeClient();
  open();
});

view.takeOver.addEventListener('click', () => open({steal: true}));
view.editAgain.addEventListener('click', () => open());
view.stop.addEventListener('click', () => stopEditing());

document.addEventListener('visibilitychange', () => {
  if (document.visibilityState === 'visible' && lease) guard(lease);
  else stopGuarding();
});

// Closing the page releases the lock: a beacon outlives the page. If it is lost
// anyway (crash, no network), the lease expires after TTL seconds.
addEventListener('pagehide', () => {
  if (lease && client) {
    client.releaseBeacon(key, lease.token);
    clearTimeout(heartbeatTimer);
    stopGuarding();
    lease = null;
    releasedOnHide = true;
  }
});
// Back from the back/forward cache: the lock was given up on the way out.
addEventListener('pageshow', (event) => {
  if (event.persisted && releasedOnHide) open();
});

if (key) {
  view.key.textContent = key;
  document.title = `Edit ${key} — keymutex`;
  view.name.value = localStorage.getItem(NAME_KEY) ?? '';
  view.name.focus();
} else {
  view.nameForm.hidden = true;
  show('lost', 'No document here: open /demo/edit/<key>.', '');
}

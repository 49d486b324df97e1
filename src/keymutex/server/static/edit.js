// The edit-lock demo (story 5): opening a document for editing takes its lock, the
// page keeps it alive with heartbeats, others see who edits and may take over.
//
// The page keeps nothing on the server but the lease: heartbeats and the release on
// close are separate requests carrying only the key and this window's token, so each
// window is its own holder, and a crashed tab's lock expires after TTL seconds.
import {LockClient, LockLost, Locked, Unauthorized} from './keymutex.js';

const TTL = 15; // seconds: how long a crashed tab blocks the document
const HEARTBEAT_MS = 5000; // three heartbeats per ttl, so one lost request costs nothing
const FREE_RECHECK_MS = 2000; // a lost lock's tab, shown "free": looks again this often
// Less than this many seconds left on the lease means that no heartbeat got through for
// TTL/2 (a slow or unreachable server, or requests queued behind the browser's six
// connections per server): the page warns and pauses editing until one does.
const AT_RISK = TTL / 2;
const MAX_NAME_BYTES = 256; // the name is the lease's owner: at most 256 bytes as UTF-8
const NAME_KEY = 'keymutex.demo.name';
const TOKEN_KEY = 'keymutex.apiToken';

const $ = (/** @type {string} */ id) => /** @type {any} */ (document.getElementById(id));
const view = {
  key: $('key'),
  nameForm: $('name-form'),
  name: $('name'),
  nameError: $('name-error'),
  tokenForm: $('token-form'),
  tokenReason: $('token-reason'),
  token: $('token'),
  tokenError: $('token-error'),
  lockState: $('lock-state'),
  state: $('state'),
  detail: $('detail'),
  takeOver: $('take-over'),
  stop: $('stop'),
  editAgain: $('edit-again'),
  text: $('text'),
};

// The server wrote the key into the page, and made where it is mounted the page's base:
// the page does not take its own address apart (a key may hold "/demo/edit/" itself).
const base = document.baseURI;
const namespace = new URLSearchParams(location.search).get('namespace') ?? '';
/** @type {unknown} */
const written = JSON.parse($('page').textContent).key;
const key = typeof written === 'string' ? written : '';

let name = '';
/** @type {LockClient | null} */
let client = null;
/** @type {import('./keymutex.js').Lease | null} */
let lease = null; // set while this window holds the lock
/** @type {ReturnType<typeof setTimeout> | undefined} */
let heartbeatTimer;
/** @type {AbortController | null} */
let watching = null; // set while waiting for the holder to leave
/** @type {import('./keymutex.js').Holder | null} */
let watched = null; // the holder that the watch last saw
/** @type {{holder: import('./keymutex.js').Holder | null, follow: boolean} | null} */
let paused = null; // set while a watch is stopped because the page is hidden
let following = false; // the watch is follow()'s: after a loss, it never takes the lock
/** @type {string} */
let heartbeatTrouble = ''; // why the last heartbeat failed, until one gets through
let heartbeating = false; // a heartbeat's request is under way

/** "Cannot reach the lock server (why)", without saying it twice when the client did. */
function unreachable(/** @type {string} */ why) {
  return /^cannot reach the lock server/i.test(why) ? `${why[0].toUpperCase()}${why.slice(1)}` : `Cannot reach the lock server (${why})`;
}
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
  // The section is a live region: text set again unchanged would be read out again.
  if (view.state.textContent !== text) view.state.textContent = text;
  if (view.detail.textContent !== detail) view.detail.textContent = detail;
  view.takeOver.hidden = !buttons.takeOver;
  view.stop.hidden = !buttons.stop;
  view.editAgain.hidden = !buttons.editAgain;
}

/** @param {boolean} editable */
function setEditable(editable) {
  view.text.disabled = !editable;
  view.text.readOnly = false;
  if (editable) view.text.focus();
}

/** @param {import('./keymutex.js').Holder} holder */
function who(holder) {
  const display = holder.info?.name;
  return isolated(typeof display === 'string' && display ? display : holder.owner);
}

/**
 * A key or name inside a sentence, its bidirectional controls shown as escapes (as the
 * command line shows them): found by review, a right-to-left override in a key
 * (U+202E) turned the rest of the sentence around ("Released invoice/,yp yb dleh…").
 * @param {string} text
 */
function isolated(text) {
  return text.replace(/[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
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
  paused = null;
  following = false;
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
  heartbeatTrouble = '';
  setEditable(true);
  showEditing();
  heartbeatTimer = setTimeout(heartbeat, HEARTBEAT_MS);
  if (document.visibilityState === 'visible') guard(/** @type {import('./keymutex.js').Lease} */ (lease));
}

/**
 * What an editing page shows, from what is left of its lease (checked every second).
 * A lease with less than TTL/2 left has had no heartbeat through for TTL/2: the page
 * says so and pauses editing (read-only: the text can still be copied) until one gets
 * through, rather than let its user type into a lock about to be lost.
 */
function showEditing() {
  const current = lease;
  if (!current) return;
  const left = current.remaining;
  if (left === 0) {
    lost(null); // past its deadline by this page's clock, however the renewal ends
    return;
  }
  // A heartbeat overdue by this page's clock, which counts a suspend: its timer slept
  // as long as the machine did (found by review: a suspend of 10 s lost the lock its
  // next heartbeat, 4 s after waking, came too late to keep).
  if (!heartbeating && left < TTL - HEARTBEAT_MS / 1000 - 1) {
    clearTimeout(heartbeatTimer);
    heartbeat();
  }
  if (left >= AT_RISK) {
    const detail = heartbeatTrouble
      ? `${unreachable(heartbeatTrouble)}; retrying…`
      : 'Others who open this document see that you are editing it.';
    show('editing', `Editing as ${isolated(name)}`, detail, {stop: true});
    view.text.readOnly = false;
    return;
  }
  view.text.readOnly = true;
  const until = new Date(Date.now() + left * 1000).toLocaleTimeString();
  const why = heartbeatTrouble ? `${unreachable(heartbeatTrouble)}.` : 'The lock server has not answered the last renewal.';
  show(
    'at-risk',
    'Your lock may be lost: editing is paused',
    `${why} Your lock expires at ${until} unless a renewal gets through; editing resumes when one does. Changes typed after the lock is lost would overwrite the next editor's.`,
    {stop: true},
  );
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
  heartbeating = true;
  try {
    await current.renew({ttl: TTL});
    heartbeating = false;
    if (lease !== current) return;
    heartbeatTrouble = '';
    showEditing();
    heartbeatTimer = setTimeout(heartbeat, HEARTBEAT_MS);
  } catch (error) {
    heartbeating = false;
    if (lease !== current) return;
    if (error instanceof LockLost) {
      lost(error.holder);
    } else if (current.remaining === 0) {
      lost(null);
    } else {
      // The server is unreachable for now: retry until the lease's own deadline.
      heartbeatTrouble = error.message;
      showEditing();
      heartbeatTimer = setTimeout(heartbeat, 1000);
    }
  }
}

/** @param {import('./keymutex.js').Holder | null} holder the new holder, if any */
function lost(holder) {
  clearTimeout(heartbeatTimer);
  stopGuarding();
  const gone = lease;
  lease = null;
  setEditable(false);
  const text = holder ? `Your lock was taken over by ${who(holder)}` : 'Your lock expired or was released by someone else';
  show('lost', text, 'Editing is disabled: your changes here would overwrite theirs.', {takeOver: true});
  follow(holder, gone);
}

/**
 * After this window lost its lock: follows the key as a waiting tab watches it (long
 * polls, only while the tab is shown), to say who holds it now and when it is free.
 * It never takes the lock by itself: what was typed since the loss was not saved, and
 * its writer chooses ("Edit again" once free, "Take over" while someone holds it).
 * @param {import('./keymutex.js').Holder | null} holder the holder that displaced us
 * @param {import('./keymutex.js').Lease | null} [gone] the lease lost: by the page's
 *   own clock it may still be held at the server (a heartbeat that got through late);
 *   it is given back, rather than shown as someone else's
 */
async function follow(holder, gone = null) {
  const signal = startWatching(holder, true);
  if (!signal) return;
  const locks = /** @type {LockClient} */ (client);
  let current = holder;
  let freeShown = false;
  while (!signal.aborted) {
    try {
      if (current === null) current = await locks.holder(key); // expired: held by someone?
      if (signal.aborted) return;
      if (current && gone && current.fence === gone.fence) {
        await locks.release(key, gone.token).catch(() => {}); // ours still: give it back
        gone = null;
        current = null;
        continue;
      }
      watched = current;
      if (current === null) {
        if (!freeShown) {
          show('lost', 'The document is free now', 'Your lock was lost: what you typed since was not saved here. Edit again to take the lock.', {editAgain: true});
          freeShown = true;
        }
        // Still followed: another tab may take it first (a waiting one, at once), and
        // this one must not go on saying "free" (a wait on a free key answers at once).
        holder = null;
        await sleep(FREE_RECHECK_MS, signal);
        continue;
      }
      freeShown = false;
      if (holder === null || current.fence !== holder.fence) {
        show('lost', `Your lock was lost; ${who(current)} holds it now`, 'Editing is disabled: your changes here would overwrite theirs.', {takeOver: true});
      }
      const result = await locks.wait(key, current.fence, 30, {signal});
      if (signal.aborted) return;
      if (!result.changed) continue; // the time ran out, nothing happened
      current = result.holder;
      if (current === null) continue;
      holder = null; // someone new: name them from now on
    } catch (error) {
      if (signal.aborted) return;
      if (error instanceof Unauthorized) {
        askToken(() => follow(current));
        return;
      }
      await sleep(2000, signal); // the message of the loss stays; look again
    }
  }
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
 * Only while the page is seen: a browser opens at most six connections to one server,
 * and the long polls of a few hidden tabs waiting for documents would take them all,
 * leaving an editing tab's heartbeats queued until its lease expires. A hidden tab's
 * watch stops, and starts again when the tab is shown; its first poll answers at once
 * if the holder changed meanwhile.
 * @param {import('./keymutex.js').Holder | null} holder
 */
async function watch(holder) {
  lockedBy(holder);
  const signal = startWatching(holder, false);
  if (!signal) return;
  const locks = /** @type {LockClient} */ (client);
  let current = holder;
  let unreached = false; // the last request failed: the page says so
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
          if (!signal.aborted) {
            watched = current;
            lockedBy(current);
          }
          if (current === null) await sleep(250, signal);
          continue;
        }
        if (signal.aborted) {
          // "Take over" was clicked meanwhile and steals on its own, or the page was
          // hidden (it asks again when shown): give this one back.
          locks.release(key, got.token).catch(() => {});
          return;
        }
        watching = null;
        lease = got;
        editing();
        return;
      }
      if (unreached) {
        // Back after a failure: say who holds it now, not after the next long poll
        // (up to 30 s, the "cannot reach" message shown all along).
        current = await locks.holder(key);
        unreached = false;
        if (signal.aborted) return;
        watched = current;
        lockedBy(current);
        if (current === null) continue;
      }
      const result = await locks.wait(key, current.fence, 30, {signal});
      current = result.holder;
      if (signal.aborted) return;
      watched = current;
      if (current) lockedBy(current);
    } catch (error) {
      if (signal.aborted) return;
      if (error instanceof Unauthorized) {
        askToken(() => watch(current));
        return;
      }
      view.detail.textContent = `${unreachable(error.message)}; retrying…`;
      unreached = true;
      await sleep(2000, signal);
    }
  }
}

/**
 * The start of watch() and follow(): the watch before is stopped, and the new one's
 * signal returned; null in a hidden tab, which starts it when shown (see watch()).
 * @param {import('./keymutex.js').Holder | null} holder
 * @param {boolean} follow
 * @returns {AbortSignal | null}
 */
function startWatching(holder, follow) {
  stopWatching();
  paused = null;
  following = follow;
  watched = holder;
  if (document.visibilityState === 'hidden') {
    paused = {holder, follow};
    return null;
  }
  watching = new AbortController();
  return watching.signal;
}

function stopWatching() {
  watching?.abort();
  watching = null;
}

/** Hidden: stop the watch, to start it again from the same holder when shown. */
function pauseWatching() {
  if (!watching) return;
  stopWatching();
  paused = {holder: watched, follow: following};
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

/** @param {HTMLElement} element @param {string} text none: hidden */
function showError(element, text) {
  element.textContent = text;
  element.hidden = !text;
}

view.tokenForm.addEventListener('submit', (/** @type {SubmitEvent} */ event) => {
  event.preventDefault();
  const token = view.token.value.trim();
  try {
    new LockClient({url: base, apiToken: token}); // the client's own checks of a token
  } catch (error) {
    showError(view.tokenError, `This API token cannot be sent: ${error.message}`);
    return;
  }
  showError(view.tokenError, '');
  sessionStorage.setItem(TOKEN_KEY, token);
  view.token.value = '';
  view.tokenForm.hidden = true;
  client = makeClient();
  afterToken?.();
});

view.nameForm.addEventListener('submit', (/** @type {SubmitEvent} */ event) => {
  event.preventDefault();
  const given = view.name.value.trim();
  if (!given) {
    view.name.setAttribute('aria-invalid', 'true');
    showError(view.nameError, 'Enter your name: others see it while you edit.');
    return;
  }
  // maxlength counts characters; the server counts bytes (a CJK character is three).
  const size = new TextEncoder().encode(given).length;
  if (size > MAX_NAME_BYTES) {
    view.name.setAttribute('aria-invalid', 'true');
    showError(view.nameError, `This name is too long: ${size} bytes as UTF-8, and at most ${MAX_NAME_BYTES} fit. Use a shorter one.`);
    return;
  }
  name = given;
  try {
    client = makeClient();
  } catch (error) {
    // The name is checked above: this is the page's address (its namespace) or the token.
    client = null;
    view.name.removeAttribute('aria-invalid');
    showError(view.nameError, `Cannot open this document: ${error.message}`);
    return;
  }
  view.name.removeAttribute('aria-invalid');
  showError(view.nameError, '');
  localStorage.setItem(NAME_KEY, name);
  view.nameForm.hidden = true;
  open();
});

view.takeOver.addEventListener('click', () => open({steal: true}));
view.editAgain.addEventListener('click', () => open());
view.stop.addEventListener('click', () => stopEditing());

document.addEventListener('visibilitychange', () => {
  if (document.visibilityState === 'visible') {
    if (lease) guard(lease);
    if (paused) (paused.follow ? follow : watch)(paused.holder);
  } else {
    stopGuarding();
    pauseWatching();
  }
});
// Counts what is left of the lease between heartbeats: warns when it runs low.
setInterval(showEditing, 1000);

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

if (namespace) $('all-locks').search = `?${new URLSearchParams({namespace})}`;
if (key) {
  view.key.textContent = key;
  document.title = `Edit ${key} — keymutex`;
  view.name.value = localStorage.getItem(NAME_KEY) ?? '';
  view.name.focus();
} else {
  view.nameForm.hidden = true;
  show('lost', 'No document here: open /demo/edit/<key> (the key percent-encoded), or /demo/edit/?key=<key>.', '');
}

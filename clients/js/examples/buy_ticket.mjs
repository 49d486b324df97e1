// Story 3, one click of a double click, from a Node.js service: has this user a ticket
// for this event? If not, wait for the order service (250 ms) and create one. With
// `lock`, check-and-create runs under the lock `ticket:USER` on a keymutex lock server:
// the same lock a Python service takes with
// keymutex.Locks("http://…", namespace=NAMESPACE).lock(f"ticket:{user}").
// Tickets are the lines of a JSON-lines FILE that every click appends to, whatever its
// language; a ticket's number is its line number.
//
//   node buy_ticket.mjs URL NAMESPACE USER EVENT FILE lock|nolock
//
// Prints "ready" once started, then reads one line from stdin: when to click, in Unix
// seconds (so that clicks in other processes start at the same moment; an empty line or
// none clicks at once). Then it clicks, and prints what happened as one JSON line:
// {lang, user, pid, clicked_at, checked_at, done_at, created, ticket, fence}
// (times in Unix seconds; fence is null without the lock). examples/double_ticket_js.py
// runs it next to Python clicks.
import {appendFile, readFile} from 'node:fs/promises';
import {createInterface} from 'node:readline';
import {setTimeout as sleep} from 'node:timers/promises';

import {LockClient} from '../keymutex.js';

const ORDER_SERVICE_DELAY = 250; // ms between "no ticket yet" and "ticket created"

const [url, namespace, user, event, file, mode] = process.argv.slice(2);
if (!url || namespace === undefined || !user || !event || !file || !['lock', 'nolock'].includes(mode)) {
  console.error('usage: node buy_ticket.mjs URL NAMESPACE USER EVENT FILE lock|nolock');
  process.exit(2);
}

/** The number of the first ticket of `user` for `event` (the one `pid` created, if given), or null. */
async function ticketOf(pid) {
  const lines = (await readFile(file, 'utf8')).split('\n').filter((line) => line);
  const index = lines.findIndex((line) => {
    const ticket = JSON.parse(line);
    return ticket.user === user && ticket.event === event && (pid === undefined || ticket.pid === pid);
  });
  return index < 0 ? null : index + 1;
}

/** What the service does per click: check, then create. Not atomic on its own. */
async function buyTicket() {
  const found = await ticketOf();
  const checkedAt = Date.now() / 1000;
  if (found !== null) return {created: false, ticket: found, checkedAt, doneAt: checkedAt};
  await sleep(ORDER_SERVICE_DELAY); // the order service takes its time
  // One small appended write per ticket: a reader never sees half a line.
  const ticket = {user, event, lang: 'node', pid: process.pid, created_at: Date.now() / 1000};
  await appendFile(file, `${JSON.stringify(ticket)}\n`);
  const doneAt = Date.now() / 1000;
  return {created: true, ticket: await ticketOf(process.pid), checkedAt, doneAt};
}

/** The first line of `stream`, '' if it ends without one. */
async function firstLine(stream) {
  for await (const line of createInterface({input: stream})) return line; // closes the reader
  return '';
}

// Set up before "ready", so that starting Node does not count as part of the click; a
// first request connects to the server, as a running service would be connected already.
const locks = mode === 'lock' ? new LockClient({url, namespace, owner: `node:${process.pid}`}) : null;
await locks?.holder(`ticket:${user}`);
console.log('ready');
const start = Number(await firstLine(process.stdin)) * 1000;
await sleep(Math.max(0, start - Date.now())); // every click starts at once, as a double click does
const clickedAt = Date.now() / 1000;
let fence = null;
let outcome;
if (locks === null) {
  outcome = await buyTicket();
} else {
  outcome = await locks.withLock(
    `ticket:${user}`,
    async (lease) => {
      fence = lease.fence;
      return buyTicket();
    },
    {ttl: 10, timeout: 30},
  );
}
const {created, ticket, checkedAt, doneAt} = outcome;
console.log(
  JSON.stringify({lang: 'node', user, pid: process.pid, clicked_at: clickedAt, checked_at: checkedAt, done_at: doneAt, created, ticket, fence}),
);

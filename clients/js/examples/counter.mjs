// Story 3 in miniature: increment a counter kept in a JSON file, N times, each time
// under the lock `key` on a keymutex lock server — the same lock a Python service
// takes with keymutex.Locks("http://…"). The file also keeps the fence of the last
// writer: a write whose fence is not larger than the stored one is refused, as a
// resource protected by fencing would; and a trace of its writers (`n` for this one).
//
//   node counter.mjs URL NAMESPACE KEY FILE N
//
// Prints "ready" once started, then "done N" when all increments are made.
import {readFile, writeFile} from 'node:fs/promises';
import {setTimeout as sleep} from 'node:timers/promises';

import {LockClient} from '../keymutex.js';

const [url, namespace, key, file, times] = process.argv.slice(2);
if (!url || namespace === undefined || !key || !file || !(Number(times) >= 0)) {
  console.error('usage: node counter.mjs URL NAMESPACE KEY FILE N');
  process.exit(2);
}

const locks = new LockClient({url, namespace, owner: `node:${process.pid}`});
console.log('ready');
for (let i = 0; i < Number(times); i++) {
  await locks.withLock(
    key,
    async (lease) => {
      const state = JSON.parse(await readFile(file, 'utf8'));
      if (lease.fence <= state.fence) {
        throw new Error(`fence ${lease.fence} is not larger than the stored ${state.fence}`);
      }
      await sleep(5); // read, pause, write: where an unlocked counter loses updates
      await writeFile(file, JSON.stringify({...state, count: state.count + 1, fence: lease.fence, writers: `${state.writers ?? ''}n`}));
    },
    {ttl: 10, timeout: 30},
  );
}
console.log(`done ${times}`);

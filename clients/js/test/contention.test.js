// Many clients on one key: a read-await-write counter loses no update, the critical
// sections never overlap, and each grant's fence is larger than the one before.
import assert from 'node:assert/strict';
import {randomUUID} from 'node:crypto';
import {test} from 'node:test';
import {setTimeout as sleep} from 'node:timers/promises';

import {LockClient} from '../keymutex.js';

const url = process.env.KEYMUTEX_URL;
const skip = url ? false : 'KEYMUTEX_URL is not set (start `keymutex serve` and point it there)';

test('contending clients lose no update', {skip}, async () => {
  const key = `js:${randomUUID()}:counter`;
  const workers = 4;
  const rounds = 8;
  const state = {counter: 0, inside: 0, fences: []};

  async function worker(id) {
    // One client per worker, as separate services would have.
    const locks = new LockClient({url, namespace: 'js-test', owner: `worker-${id}`});
    for (let round = 0; round < rounds; round++) {
      await locks.withLock(
        key,
        async (lease) => {
          state.inside++;
          assert.equal(state.inside, 1, 'two workers inside the lock at once');
          state.fences.push(lease.fence);
          const seen = state.counter;
          await sleep(5 + Math.random() * 10); // the interleaving point of a lost update
          state.counter = seen + 1;
          state.inside--;
        },
        {ttl: 10, timeout: 30},
      );
    }
  }

  await Promise.all(Array.from({length: workers}, (_, id) => worker(id)));
  assert.equal(state.counter, workers * rounds);
  for (let i = 1; i < state.fences.length; i++) {
    assert.ok(state.fences[i] > state.fences[i - 1], `fence ${state.fences[i]} after ${state.fences[i - 1]}`);
  }
});

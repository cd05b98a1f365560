// A `node --test` reporter for scripts/client-suites: one line per test,
// "FILE > SUITE > ... > TEST<TAB>OUTCOME" (passed, failed, skipped, todo),
// suites themselves left out; "FILE<TAB>failed" for a file that failed
// outside its tests.
import path from 'node:path';

export default async function* outcomes(source) {
  // The names of the suites a test is in, per file (files run side by side).
  const open = new Map();
  for await (const event of source) {
    const d = event.data;
    if (!d || !d.file) continue;
    const stack = open.get(d.file) ?? [];
    open.set(d.file, stack);
    if (event.type === 'test:start') {
      stack.length = d.nesting;
      stack.push(d.name);
      continue;
    }
    if (event.type !== 'test:pass' && event.type !== 'test:fail') continue;
    stack.length = d.nesting;
    if (d.details?.type === 'suite') continue;
    // A file that fails outside its tests (an uncaught error, a hang) is
    // reported as a test named after its path.
    const name = d.name === d.file ? [] : [d.name];
    const id = [path.basename(d.file), ...stack, ...name].join(' > ');
    let outcome = event.type === 'test:pass' ? 'passed' : 'failed';
    if (d.skip !== undefined) outcome = 'skipped';
    else if (d.todo !== undefined) outcome = 'todo';
    yield `${id.replace(/[\t\n]/g, ' ')}\t${outcome}\n`;
  }
}

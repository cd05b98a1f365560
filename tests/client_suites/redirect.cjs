// Preloaded (NODE_OPTIONS=--require) into amqplib's test processes by
// scripts/client-suites: amqplib's tests connect to the default broker
// address, amqp://localhost (port 5672). This points those connections at
// NACKD_SUITE_TARGET (HOST:PORT: the broker under test, or nackd in front
// of it). Nothing else changes: other ports (the suite's own refused and
// silent servers) and [::1] keep their addresses.
'use strict';
const net = require('node:net');

const target = process.env.NACKD_SUITE_TARGET;
if (!target || !target.includes(':')) {
  throw new Error(`NACKD_SUITE_TARGET=${target}: expected HOST:PORT`);
}
const at = target.lastIndexOf(':');
const host = target.slice(0, at);
const port = Number(target.slice(at + 1));

const connect = net.connect;
net.connect = net.createConnection = function redirected(options, ...rest) {
  if (
    options !== null &&
    typeof options === 'object' &&
    Number(options.port) === 5672 &&
    (options.host === 'localhost' || options.host === '127.0.0.1')
  ) {
    options = { ...options, host, port };
  }
  return connect.call(this, options, ...rest);
};

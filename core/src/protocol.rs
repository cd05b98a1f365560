//! The AMQP 0-9-1 wire format, as much of it as nackd needs: pure code, no
//! sockets, fuzzed.
//!
//! - [`frame`]: cuts a byte stream into frames (nom), checks sizes on the header.
//! - [`method`]: decodes the few methods nackd must understand (amq-protocol)
//!   and encodes the frames nackd emits itself.
//! - [`content`]: content headers (basic properties), byte-exact header splicing.
//! - [`headers`]: the retry headers nackd writes (`x-retry-count`, `x-death`, …).
//! - [`reply`]: AMQP reply codes.
//! - [`screen`]: what the broker sends a third-party client, within nackd's limits.

pub mod content;
pub mod frame;
pub mod headers;
pub mod method;
pub mod reply;
pub mod screen;

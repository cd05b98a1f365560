//! # nackd
//!
//! An AMQP 0-9-1 proxy in front of RabbitMQ that turns a consumer's
//! `basic.nack` / `basic.reject` on configured queues into a delayed retry.
//!
//! # Layout
//!
//! One directory per part of the architecture; a nack passes through them
//! in this order (README, "Follow a nack").
//!
//! - [`protocol`]: the wire, pure and fuzzed: `frame` (cutting the byte
//!   stream, nom), `method` (the few methods nackd decodes, the frames it
//!   emits), `content` (properties, byte-exact header splicing), `headers`
//!   (the retry headers nackd writes), `reply` (reply codes).
//! - `session`: one client/broker pair, split like quinn-proto: a
//!   state machine without sockets or clock (`core`), driven by `pump`
//!   (sockets, `select!`, backpressure, the link to the engine). The state
//!   machine's handlers are split by concern: `client` and `upstream`
//!   (frames from each side, cut and checked in `frames`), `channel`
//!   (per-channel tracking: consumers, deliveries, claims), `capture`
//!   (deliveries kept in case they are nacked), `claim` (claim, park, ack,
//!   and the barriers of close and recover), `settle` (rewriting settles
//!   around claimed tags), `close` and `lifecycle` (the closing handshake,
//!   faults, timers). `session/tests.rs` drives it without sockets.
//! - [`retry`]: the engine thread (`retry/engine.rs`, with `fire`,
//!   `outcome` and `link` to the replica), its `ledger` of held messages,
//!   the `wheel` (hierarchical timing wheel), `republish` (a connection per
//!   vhost, a lane per exchange), `blocks` (set-aside messages), `admin`
//!   (operator commands) and `supervisor` (recovery and readiness).
//! - [`store`]: the hold log (`log`, `segment`, `record`, `writer`,
//!   `recover`, `scan`, `inspect`).
//! - [`replica`]: the copy in a stream of the broker cluster, the lease,
//!   rebuild and adoption.
//! - [`config`] (with `policy` and `replica`), `net` (TLS, the upstream
//!   connector), [`server`] (listener, limits, the order of shutdown),
//!   `shutdown` (how each task and thread is stopped and joined),
//!   `clock` (the one clock), [`metrics`],
//!   `ops` (`/metrics`, health, status page, admin API), [`reload`]
//!   (SIGHUP), [`sched`] (`runtime.scheduling`).
//! - `fuzzing` (feature `fuzzing`): the fuzz targets' code, shared by
//!   `fuzz/` and the property tests; not in the product.
// One audited exception: `sched` (a syscall libc has no safe form of).
#![deny(unsafe_code)]

pub mod config;
pub mod metrics;
mod net;
mod ops;
pub mod reload;
pub mod replica;
pub mod retry;
pub mod sched;
pub mod server;
mod session;
mod shutdown;
pub mod store;

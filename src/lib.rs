//! # nackd
//!
//! An AMQP 0-9-1 proxy in front of RabbitMQ that turns a consumer's
//! `basic.nack` / `basic.reject` on configured queues into a delayed retry.
//!
//! What nackd *decides* lives in the `nackd_core` crate (no tokio, no
//! sockets, no clock of its own): the wire format, the session's state
//! machine, policies and schedules, the wheel, the held-message model, the
//! clock. This crate is the I/O around it: sockets, threads, the store on
//! disk, the broker connections of its own, metrics and operations.
//!
//! # Layout
//!
//! - [`server`]: the listener: accepts clients, applies limits and TLS,
//!   starts a session per client, and stops everything in the order
//!   `shutdown` writes down.
//! - `session`: the pump of one client/broker pair: reads both sockets
//!   into `nackd_core::session::Session`, writes what it says, carries
//!   its parks to the retry engine and the answers back.
//! - [`retry`]: the engine, on a thread of its own: `engine` (parks, fires,
//!   completes; `fire`, `outcome`, `link` to the replica), its `ledger` of
//!   held messages, `timer` (the alarm), `republish` (a connection per
//!   vhost, a lane per exchange), `blocks` (set-aside messages), `admin`
//!   (operator commands), `supervisor` (recovery and readiness).
//! - [`store`]: the hold log on disk (`log`, `segment`, `record`,
//!   `writer`, `recover`, `scan`, `inspect`).
//! - [`replica`]: the copy in a stream of the broker cluster, the lease,
//!   rebuild and adoption.
//! - [`delayed`]: the exchanges emulated as `x-delayed-message`, kept in
//!   the store directory.
//! - [`replay`]: dead-letter replay: messages of a dead-letter queue parked
//!   back to their queues (`nackd admin replay`).
//! - [`config`] (the file, with `replica`), `net` (TLS, the upstream
//!   connector), `shutdown` (the one way a task or thread is stopped),
//!   [`metrics`], `ops` (`/metrics`, health, status page, admin API),
//!   [`reload`] (SIGHUP), [`sched`] (`runtime.scheduling`).
//!
//! # The path of one nack
//!
//! 1. `server` accepts the client; `session` connects upstream and feeds
//!    both sockets' bytes to `nackd_core::session::Session`.
//! 2. The broker's `basic.deliver` of a configured queue: the core tracks
//!    the tag and captures the message (`core/src/session/machine.rs`,
//!    `channel.rs`, `capture.rs`).
//! 3. The client's `basic.nack`: the core claims it, picks the delay
//!    (`nackd_core::policy`), rewrites the headers
//!    (`nackd_core::protocol::headers`) and asks for a park
//!    (`core/src/session/machine.rs`, numbered by `claims.rs`,
//!    `Effect::Park`).
//! 4. `session` hands the park to the engine (`retry::RetryHandle`, a
//!    channel to the engine's thread). `retry/engine.rs` gives it an id
//!    and sends it to the store writer (`store/writer.rs`, its thread,
//!    `store/log.rs`: written, fsynced) and, with a replica, to the stream
//!    (`retry/engine/link.rs`, `replica/task.rs`).
//! 5. Durable: the engine books it in the ledger and the wheel
//!    (`retry/ledger.rs`, `nackd_core::wheel`) and answers the session,
//!    whose core acks the delivery upstream (`machine.rs`; `settle.rs`
//!    rewrites the client's other settles around it).
//! 6. Due: the wheel (`retry/engine/fire.rs`) gives it back, the engine
//!    reads it from the store and hands it to `retry/republish/lane.rs`,
//!    which publishes it to the tail of its queue on a confirm channel.
//! 7. The broker's confirm comes back through `retry/engine/outcome.rs`;
//!    the engine deletes it from the store: completed.
//!
//! The book's Architecture chapter (`docs/src/design/architecture.md`)
//! follows the same path step by step.
// Two audited exceptions: `sched` and `coalesce::precise_sleeps` (syscalls
// libc has no safe form of).
#![deny(unsafe_code)]
// The walls between rooms, checked by clippy (-D warnings in scripts/test):
// what only this crate uses is not `pub`; a function over 60 lines
// (clippy.toml) carries its reason above an `allow`; time is read only
// through `clock::Clock` (clippy.toml's disallowed methods).
#![warn(unreachable_pub)]
#![warn(clippy::too_many_lines)]

pub mod coalesce;
pub mod config;
pub mod delayed;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod metrics;
mod net;
mod ops;
/// The admin API's routes and which token each takes.
pub use ops::{Access, AdminRoute};
pub mod reload;
pub mod replay;
pub mod replica;
pub mod retry;
pub mod sched;
pub mod screen;
pub mod server;
mod session;
mod shutdown;
pub mod store;

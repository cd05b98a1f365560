//! # nackd-core
//!
//! What nackd decides, without sockets, threads or a runtime: every part
//! here takes events with the time they happened and is asked what to do
//! next. The `nackd` crate around it reads and writes the sockets, runs
//! the timers and the store, and carries what these parts ask for.
//!
//! # Layout
//!
//! - [`protocol`]: the wire, pure and fuzzed: `frame` (cutting the byte
//!   stream, nom), `method` (the few methods nackd decodes, the frames it
//!   emits), `content` (properties, byte-exact header splicing), `headers`
//!   (the retry headers nackd writes), `reply` (reply codes).
//! - [`clock`]: the one clock every time read goes through.
//! - [`held`]: the held-message model: a park, its answer, the record the
//!   store keeps, where it goes when due.
//! - [`policy`]: which queues are intercepted, with which schedule; the
//!   set in force, which a reload replaces.
//! - [`ready`]: where interception stands (recovering, ready, no lease, …).
//! - [`schema`]: how durations look in the configuration's JSON Schema.
//! - [`session`]: one client/broker pair as a state machine: frames from
//!   either side in, frames to either side and parks for the retry engine
//!   out.
//! - [`stats`]: what sessions count, as Prometheus handles.
//! - [`wheel`]: the hierarchical timing wheel that says what is due.
//! - `fuzzing` (feature `fuzzing`): the fuzz targets' code, shared by
//!   `fuzz/` and the property tests; not in the product.
//!
//! # A nack, as the core sees it
//!
//! `session::Session` (`session/machine.rs`, the coordinator) is given the
//! broker's `basic.deliver` of a configured queue (it tracks the tag in
//! `session/channel.rs`, `session/capture.rs` keeps the message), then the
//! client's `basic.nack`: it claims it (numbered by `session/claims.rs`),
//! asks [`policy`] for the delay, rewrites the headers
//! ([`protocol::headers`]) and emits `Effect::Park` (a [`held::Park`]).
//! When told `Parked` (the store has it) it writes `basic.ack` upstream,
//! and `session/settle.rs` keeps the client's other settles off the
//! claimed tag; `session/barrier.rs` holds a close behind the claims.
//! Where nackd cannot hold it, `session/deferrals.rs` keeps it unacked and
//! the session nacks it (requeue) later. The engine (in `nackd`) books what is parked in the
//! [`wheel`], which says when it is due.
#![forbid(unsafe_code)]
// The walls between rooms, checked by clippy (-D warnings in scripts/test):
// what only this crate uses is not `pub`; a function over 60 lines
// (clippy.toml) carries its reason above an `allow`; time is read only
// through `clock::Clock` (clippy.toml's disallowed methods).
#![warn(unreachable_pub)]
#![warn(clippy::too_many_lines)]

pub mod clock;
pub mod delayed;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod held;
pub mod policy;
pub mod protocol;
pub mod ready;
pub mod schema;
pub mod session;
pub mod stats;
pub mod wheel;

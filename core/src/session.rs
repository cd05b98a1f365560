//! One client connection and its upstream connection.
//!
//! The session is split the way quinn-proto splits QUIC: a state machine
//! that owns no socket and no clock ([`Session`], here), and a thin pump
//! around it (`nackd::session`, in the crate that has the sockets).
//!
//! - The core takes events: bytes from either side, the engine's answer
//!   to a park, a side gone, shutdown, a timer, each with the time it
//!   happened. It is polled for what to write to each side, for what to
//!   ask the retry engine ([`Effect`]), and for its next timer.
//! - The pump reads and writes the sockets with `select!`, applies
//!   backpressure, carries effects to the engine and answers back, and
//!   sleeps until the core's timer.
//!
//! Every rule of the core (settle rewriting, the close and recover
//! barriers, pipelined frames, the settle timeout) is unit-tested in
//! `session/tests.rs` without a socket or a broker.

use std::time::Duration;

mod barrier;
pub mod capture;
pub mod channel;
mod check;
mod claims;
mod close;
pub mod confirms;
mod consumer;
mod deferrals;
mod machine;
mod peer;
mod publishes;
mod scope;
pub mod settle;

pub use capture::Budget;
pub use machine::{Effect, Session};
pub use peer::Peer;
pub use scope::Interception;

/// A side's write buffer above which nackd stops reading the other side.
pub const HIGH_WATER: usize = 256 * 1024;
/// Time the peers get to complete a close handshake.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(3);
/// Time a claim gets to be stored: past it the session gives it up (the
/// delivery goes back to the broker, a delayed publisher gets a nack),
/// whether a close waits for it or not; the engine calls a store that
/// leaves a write unanswered this long stalled.
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest a forced session takes to end: its claims answered or given
/// up, the close handshake, the last writes (and within the slack, the
/// broker's [`ACK_GRACE`] after the last acks).
pub const FORCED_END: Duration =
    Duration::from_secs(SETTLE_TIMEOUT.as_secs() + CLOSE_TIMEOUT.as_secs() + 3);
/// Time the broker gets to apply nackd's acks before a close, recover or
/// disconnect that it held back goes on. RabbitMQ applies a quorum queue's
/// settles behind other work (a burst of them is sent a few at a time): a
/// channel that closes right after its acks can have them overtaken by its
/// own death, and the messages requeued (rabbitmq-server#10327). 100 ms was
/// not enough on a loaded 2-core CI machine: a close right after 1 000
/// nacks had 372 of 2 000 requeued (2026-11-29). Only a close that comes
/// less than this after nackd's last ack waits.
pub const ACK_GRACE: Duration = Duration::from_secs(1);
/// How often the core checks heartbeats and deadlines.
const TICK: Duration = Duration::from_millis(500);

/// Limits a session applies.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest frame accepted from either side, whatever is negotiated.
    pub max_frame: u32,
    /// From accept to `connection.open-ok`.
    pub handshake_timeout: Duration,
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests time with the real clock
mod tests;

//! The held-message model every part shares: what a session asks the
//! retry engine to park ([`Park`]) and what it answers ([`Parked`]), the
//! message as the store keeps it ([`Held`]), where it goes when due
//! ([`Route`]), and what RAM keeps of it ([`HeldMeta`]).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

/// Identifies a claimed delivery inside its session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClaimKey {
    /// Channel of the delivery.
    pub channel: u16,
    /// Which opening of that channel (channel numbers are reused).
    pub epoch: u64,
    /// Delivery tag.
    pub tag: u64,
    /// The claim's number in its session (claims are numbered in order).
    pub seq: u64,
}

/// A claimed message to park.
pub struct Park {
    /// Answer goes back with this key.
    pub key: ClaimKey,
    /// Virtual host.
    pub vhost: Arc<str>,
    /// Queue it was nacked on.
    pub queue: Arc<str>,
    /// How long to hold it.
    pub delay: Duration,
    /// Retry number in its headers.
    pub retry: u32,
    /// Where it goes when due.
    pub route: Route,
    /// Where it goes if returned as unroutable.
    pub on_return: Option<Route>,
    /// Rewritten content header payload.
    pub header: Bytes,
    /// Body.
    pub body: Bytes,
    /// Settles, once, whether the stored copy stands or its session gave
    /// the park up.
    pub ticket: Ticket,
}

/// Whether a park still stands: its session and the engine decide once,
/// atomically, between "stored, the answer is on its way" and "given up"
/// (the settle timeout ran out: the delivery went back to the broker, or
/// the publisher got a nack). A copy stored after its park was given up
/// is deleted, never fired, whether its session still runs or not.
#[derive(Clone, Debug, Default)]
pub struct Ticket(Arc<AtomicU8>);

const OPEN: u8 = 0;
const STORED: u8 = 1;
const GIVEN_UP: u8 = 2;

impl Ticket {
    /// The engine stored the copy: `true` if it stands (its answer goes to
    /// the session), `false` if the session gave the park up first (the
    /// copy must be deleted).
    pub fn stored(&self) -> bool {
        self.settle(STORED)
    }

    /// The session gives the park up: `true` if it is given up (a copy
    /// stored later is deleted), `false` if the engine stored it first
    /// (its answer is on its way: wait for it).
    pub fn give_up(&self) -> bool {
        self.settle(GIVEN_UP)
    }

    fn settle(&self, to: u8) -> bool {
        match self
            .0
            .compare_exchange(OPEN, to, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(now) => now == to,
        }
    }
}

/// The engine's answer to a [`Park`].
#[derive(Debug)]
pub struct Parked {
    /// The claim.
    pub key: ClaimKey,
    /// The store id once durable, or why it could not be stored.
    pub result: Result<u64, StoreError>,
}

/// Where a held message goes when it is due.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// Exchange `""`, routing key = the original queue: its tail.
    Queue,
    /// A dead-letter exchange (`on_exhausted = { exchange, routing_key }`).
    Exchange {
        /// Exchange name.
        exchange: String,
        /// Routing key.
        routing_key: String,
    },
    /// A delayed publish (`x-delayed-message` exchange, `x-delay`): to the
    /// real exchange it was published to, with its routing key, content
    /// unchanged. `Held::queue` then names that exchange.
    Delayed {
        /// Exchange name.
        exchange: String,
        /// Routing key.
        routing_key: String,
    },
}

impl Route {
    /// Whether this is a delayed publish (not a retry or a dead letter).
    pub fn is_delayed(&self) -> bool {
        matches!(self, Route::Delayed { .. })
    }
}

/// A message nackd holds, as stored.
#[derive(Clone, Debug)]
pub struct Held {
    /// Store id.
    pub id: u64,
    /// Virtual host it came from and goes back to.
    pub vhost: Arc<str>,
    /// Queue it was nacked on.
    pub queue: Arc<str>,
    /// When it is due, in ms since the Unix epoch.
    pub due_ms: u64,
    /// The retry number written in its headers.
    pub retry: u32,
    /// Where it goes when due.
    pub route: Route,
    /// Where it goes if the broker returns it as unroutable.
    pub on_return: Option<Route>,
    /// Content header payload, headers already rewritten.
    pub header: Bytes,
    /// Body.
    pub body: Bytes,
}

impl Held {
    /// Bytes it takes (header + body).
    pub fn size(&self) -> usize {
        self.header.len() + self.body.len()
    }

    /// What RAM keeps of it, with its queue interned as `queue`.
    pub fn meta(&self, queue: u32) -> HeldMeta {
        HeldMeta {
            queue,
            size: self.size() as u32,
            retry: self.retry.try_into().unwrap_or(u16::MAX),
            dead_letter: self.route != Route::Queue,
            delayed: self.route.is_delayed(),
        }
    }
}

/// What RAM keeps of a held message besides its id, due time and place:
/// the one record of it that recovery, the engine and its ledger share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldMeta {
    /// Interned `(vhost, queue)`.
    pub queue: u32,
    /// Header + body bytes.
    pub size: u32,
    /// Retry number in its headers (shown by the admin API and the recent
    /// events; 65 535 stands for any higher one, which no schedule reaches).
    pub retry: u16,
    /// It goes to an exchange (`on_exhausted`), not back to its queue.
    pub dead_letter: bool,
    /// A delayed publish ([`Route::Delayed`]): `queue` names its exchange.
    pub delayed: bool,
}

/// Why the store cannot take or give a message.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store is over its configured size.
    #[error("store full: {0}")]
    Full(String),
    /// An I/O error.
    #[error("store I/O error: {0}")]
    Io(String),
    /// Stored here, but the replica (the instance's stream on the broker)
    /// did not take it: not held, since a host loss would lose it.
    #[error("replica: {0}")]
    Replica(String),
}

impl StoreError {
    /// Why a claim this error answered is deferred.
    pub fn deferral(&self) -> crate::stats::PassReason {
        match self {
            Self::Replica(_) => crate::stats::PassReason::NoReplica,
            Self::Full(_) | Self::Io(_) => crate::stats::PassReason::StoreUnavailable,
        }
    }
}

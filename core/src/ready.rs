//! Where interception stands, shared by the retry engine (which sets it)
//! and the sessions and `/readyz` (which read it).

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use crate::stats::PassReason;

/// Where interception stands, as sessions and `/readyz` see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Ready {
    /// The store is being recovered (or rebuilt from the replica).
    Recovering = 0,
    /// Claims are parked and due messages fire.
    Ready = 1,
    /// The replica's lease is not held: a standby, or the broker was lost.
    NoLease = 2,
    /// The store could not be opened: nackd is a plain proxy.
    Failed = 3,
    /// The replica stream is missing: nothing new is held until an
    /// operator reseeds it (held messages still fire once the engine runs).
    NoReplica = 4,
}

/// Shared view of [`Ready`], and whether the store stalls.
#[derive(Debug)]
pub struct Readiness {
    state: AtomicU8,
    /// A store write has gone unanswered for longer than the settle
    /// timeout (a stuck disk): nothing new is held meanwhile.
    stalled: AtomicBool,
}

impl Readiness {
    /// Recovering, until the engine says otherwise.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            state: AtomicU8::new(Ready::Recovering as u8),
            stalled: AtomicBool::new(false),
        })
    }

    /// Where interception stands now.
    pub fn get(&self) -> Ready {
        match self.state.load(Ordering::Acquire) {
            1 => Ready::Ready,
            2 => Ready::NoLease,
            3 => Ready::Failed,
            4 => Ready::NoReplica,
            _ => Ready::Recovering,
        }
    }

    /// The engine says where interception stands.
    pub fn set(&self, ready: Ready) {
        self.state.store(ready as u8, Ordering::Release);
    }

    /// Whether the store stalls: a write unanswered past the settle timeout.
    pub fn stalled(&self) -> bool {
        self.stalled.load(Ordering::Acquire)
    }

    /// The engine says whether the store stalls.
    pub fn set_stalled(&self, stalled: bool) {
        self.stalled.store(stalled, Ordering::Release);
    }

    /// Whether a nack may be claimed now, else why it cannot be held (it is
    /// deferred: left unacked and requeued at the broker later).
    /// While the store opens, claims are made: their parks wait in the
    /// engine's queue until it runs (a session gives a park up after its
    /// settle timeout, and the broker keeps the delivery meanwhile), so no
    /// nack is deferred because nackd just started. While the store stalls
    /// nothing is claimed: each claim would wait a settle timeout first.
    pub fn may_claim(&self) -> Result<(), PassReason> {
        if self.stalled() {
            return Err(PassReason::StoreUnavailable);
        }
        match self.get() {
            Ready::Ready | Ready::Recovering => Ok(()),
            Ready::NoLease => Err(PassReason::NoLease),
            Ready::NoReplica => Err(PassReason::NoReplica),
            Ready::Failed => Err(PassReason::StoreUnavailable),
        }
    }
}

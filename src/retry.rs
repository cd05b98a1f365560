//! The retry engine: one task on a thread of its own that parks claimed
//! messages (store, then wheel), fires them when due to the republisher of
//! their vhost, and completes them once the broker confirmed the republish.
//!
//! - `engine`: the task, and what it does with each event.
//! - `ledger`: the book of held messages and per-queue totals.
//! - the wheel (`nackd_core::wheel`) says what is due.
//! - [`republish`]: nackd's own connection per vhost, with confirms, one
//!   channel per destination exchange.
//! - `blocks`: destinations that refuse publishes (a missing exchange, a
//!   gone queue), probed one message at a time.
//! - `admin`: list, fire now, purge, status, for operators.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::shutdown::Stopper;
pub use nackd_core::clock::Clock;
use tokio_util::sync::CancellationToken;

mod admin;
mod blocks;
mod engine;
pub(crate) mod ledger;
pub mod republish;
mod supervisor;
mod timer;

pub use engine::query::{
    BlockedStatus, DueBucket, ExchangeStatus, Kind, Listed, QueueStatus, Status, Target,
};
pub use nackd_core::ready::{Readiness, Ready};

pub use nackd_core::held::{ClaimKey, Park, Parked};

/// Where the engine answers a session's parks.
pub type ParkReply = mpsc::UnboundedSender<Parked>;

// Each command is moved once, from a session to the engine's channel
// (as the core's `Effect`); boxing would add an allocation per park.
#[allow(clippy::large_enum_variant)]
enum Command {
    Park(Park, ParkReply),
    Cancel(u64),
    Admin(engine::query::Command),
}

/// Handle sessions use to park messages (and operators to inspect them).
#[derive(Clone)]
pub struct RetryHandle {
    tx: mpsc::UnboundedSender<Command>,
    /// Where interception stands (recovering, ready, no lease).
    pub ready: Arc<Readiness>,
    /// Reseeds for the replica (closed without one).
    reseeds: mpsc::UnboundedSender<crate::replica::ReseedReply>,
}

impl RetryHandle {
    /// Asks the engine to park a message and answer to `reply`; `false`
    /// if the engine is gone.
    pub fn park(&self, park: Park, reply: &ParkReply) -> bool {
        self.tx.send(Command::Park(park, reply.clone())).is_ok()
    }

    /// Drops a parked message (its delivery went back to the broker anyway).
    pub fn cancel(&self, id: u64) {
        let _ = self.tx.send(Command::Cancel(id));
    }

    /// Replaces a missing replica stream by a new one written from the
    /// local store; answers once it is written (and nackd intercepts again).
    pub async fn reseed(&self) -> Result<crate::replica::Reseeded, crate::replica::ReplicaError> {
        use crate::replica::ReplicaError;
        let (reply, answer) = tokio::sync::oneshot::channel();
        if self.reseeds.send(reply).is_err() {
            return Err(ReplicaError("nackd has no [replica]".into()));
        }
        answer
            .await
            .map_err(|_| ReplicaError("the replica task is gone".into()))?
    }
}

/// What the engine thread needs to start.
pub struct Start {
    /// `store.path`.
    pub dir: std::path::PathBuf,
    /// How the store is sized.
    pub store: crate::store::Options,
    /// `[replica]`, resolved, when there is one.
    pub replica: Option<crate::replica::Config>,
    /// The broker.
    pub connector: crate::net::Connector,
    /// `[republish]`.
    pub options: Options,
    /// Metrics.
    pub metrics: Arc<crate::metrics::Metrics>,
    /// nackd's clock (the sessions read the same one).
    pub clock: nackd_core::clock::Clock,
}

/// How the engine republishes (`[republish]`).
#[derive(Clone, Debug)]
pub struct Options {
    /// The republishers' login, heartbeat and confirm window.
    pub republish: republish::Settings,
    /// Bytes of due messages read and not yet settled, per vhost.
    pub max_pending_bytes: u64,
    /// What becomes of the messages of a queue that is gone.
    pub queue_gone: crate::config::QueueGone,
    /// What becomes of delayed messages nothing is bound for (`[delayed]`).
    pub delayed: crate::config::Delayed,
}

impl Options {
    /// The options of `[republish]`, its password already resolved.
    pub fn new(config: &crate::config::Republish, password: String) -> Self {
        Self {
            republish: republish::Settings::new(config, password),
            max_pending_bytes: config.max_pending_bytes,
            queue_gone: config.queue_gone.clone(),
            delayed: crate::config::Delayed::default(),
        }
    }

    /// With the `[delayed]` settings of `config`.
    pub fn with_delayed(mut self, config: &crate::config::Config) -> Self {
        self.delayed = config.delayed_settings();
        self
    }
}

/// Starts the retry engine on a thread of its own: it recovers the store
/// (and syncs the replica) first, so the handle works at once but claims
/// wait for [`RetryHandle::ready`]. Stopping it stops firing, then flushes
/// and joins the store writer.
/// `stop` is the engine's token (a child of nackd's), cancelled by the
/// returned [`Stopper`].
pub fn start(start: Start, stop: CancellationToken) -> (RetryHandle, Stopper) {
    let (tx, rx) = mpsc::unbounded_channel();
    let (reseeds, reseeds_rx) = mpsc::unbounded_channel();
    let (ready, thread) = supervisor::spawn(start, rx, reseeds_rx, stop.clone());
    let engine = Stopper::thread("retry engine", stop, thread);
    let handle = RetryHandle { tx, ready, reseeds };
    (handle, engine)
}

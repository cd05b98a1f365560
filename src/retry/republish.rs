//! The republisher: nackd's own connection to one virtual host, publishing
//! due messages with publisher confirms and `mandatory=true`.
//!
//! nackd writes these frames itself (instead of using an AMQP client crate)
//! so that the content header goes out byte for byte as it was rewritten:
//! client crates re-encode field tables and change some type tags.
//!
//! # Failures are isolated
//!
//! - One connection per vhost, one channel (a *lane*) per destination
//!   exchange: retries to their queues go out on the lane of exchange `""`,
//!   each `on_exhausted` exchange has its own. A channel error closes one
//!   lane; the connection and every other lane keep going.
//! - A fresh channel publishes one message at a time until the broker
//!   confirmed one ("slow start"), and a lane to a named exchange checks it
//!   with a passive declare first: a missing exchange or a refused publish
//!   is found with nothing else in flight, so its culprit is exact.
//! - When a channel error hits a lane with several publishes unconfirmed,
//!   the broker does not say which one caused it: they are sent again one at
//!   a time, and the one that fails alone is set aside.
//! - A message that cannot be sent at all (its header is larger than
//!   `frame_max`, its `user_id` is not ours) is set aside before it is sent.
//! - Set aside means reported [`Outcome::SetAside`]: the engine keeps it and
//!   tries it again with a backoff of its own.
//!
//! See `lane` for the per-channel rules, `returned` for matching a
//! `basic.return` to its publish, `conn` for the handshake and heartbeats,
//! `task` for the I/O loop, `check` for the passive declares of startup and
//! `login` for the login check behind `/readyz`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;
use tracing::{info_span, Instrument};

use crate::metrics::{BlockReason, Metrics};
use crate::net::Connector;
use crate::replica::fence::Fence;
use crate::store::Route;
use nackd_core::clock::Clock;

mod check;
mod conn;
mod lane;
mod login;
pub mod offset;
mod precheck;
mod returned;
mod task;
#[cfg(test)]
mod tests;

pub use check::{check_exchanges, ExchangeToCheck, Missing};
pub use login::LoginCheck;

/// One message to publish.
#[derive(Clone, Debug)]
pub struct Publish {
    /// Store id, reported back with the outcome.
    pub id: u64,
    /// Queue (for [`Route::Queue`]).
    pub queue: Arc<str>,
    /// Where to.
    pub route: Route,
    /// Content header payload.
    pub header: Bytes,
    /// Body.
    pub body: Bytes,
}

impl Publish {
    /// The exchange it is published to.
    pub fn exchange(&self) -> &str {
        match &self.route {
            Route::Queue => "",
            Route::Exchange { exchange, .. } | Route::Delayed { exchange, .. } => exchange,
        }
    }

    /// Its routing key.
    pub fn routing_key(&self) -> &str {
        match &self.route {
            Route::Queue => &self.queue,
            Route::Exchange { routing_key, .. } | Route::Delayed { routing_key, .. } => routing_key,
        }
    }
}

/// Why a publish was set aside, as the broker (or nackd) said it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetAside {
    /// The kind, for metrics.
    pub reason: BlockReason,
    /// The broker's reply (`404 NOT_FOUND - no exchange 'x' in vhost '/'`)
    /// or nackd's own explanation.
    pub reply: String,
    /// The failure concerns every publish to this exchange (it is missing,
    /// or publishing to it is refused), not just this message.
    pub exchange_wide: bool,
}

/// What became of a publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The broker confirmed it: it is in a queue.
    Confirmed,
    /// The broker nacked it (internal error): try again later.
    Nacked,
    /// The broker returned it: no queue is bound for its routing key.
    Returned {
        /// The broker's reply (`312 NO_ROUTE`).
        reply: String,
    },
    /// It was not published, or the broker refused it with a channel error:
    /// keep it and try it again later.
    SetAside(SetAside),
}

/// An outcome for a store id.
#[derive(Clone, Debug)]
pub struct Report {
    /// Store id.
    pub id: u64,
    /// What happened.
    pub outcome: Outcome,
}

/// Login of nackd's own connections.
#[derive(Clone, Debug)]
pub struct Credentials {
    /// User name.
    pub username: String,
    /// Password.
    pub password: String,
}

/// How the republishers run (`[republish]`).
#[derive(Clone, Debug)]
pub struct Settings {
    /// Login.
    pub login: Credentials,
    /// Heartbeat interval asked for (`None`: no heartbeats).
    pub heartbeat: Option<Duration>,
    /// Publishes awaiting a confirm, per lane.
    pub confirm_window: u32,
    /// Publishes are written only while it holds (the replica's lease).
    pub fence: Arc<Fence>,
}

impl Settings {
    /// Settings of `[republish]`, with its password already resolved.
    pub fn new(config: &crate::config::Republish, password: String) -> Self {
        Self {
            login: Credentials {
                username: config.username(),
                password,
            },
            heartbeat: (!config.heartbeat.is_zero()).then_some(config.heartbeat),
            confirm_window: config.confirm_window,
            fence: Fence::always(),
        }
    }
}

/// Handle to a running republisher.
#[derive(Clone)]
pub struct Republisher {
    tx: mpsc::UnboundedSender<Publish>,
}

impl Republisher {
    /// Starts the republisher task for `vhost`. Its queue of publishes is
    /// unbounded: the engine bounds what it hands over
    /// (`republish.max_pending_bytes`).
    /// `tasks` tracks it: the engine waits for it at shutdown.
    pub fn spawn(
        vhost: Arc<str>,
        connector: Connector,
        settings: Settings,
        reports: mpsc::UnboundedSender<Report>,
        metrics: Arc<Metrics>,
        clock: Clock,
        tasks: &TaskTracker,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        // A spawned task does not inherit the current span: the vhost is
        // named here so every line the task logs carries it.
        let span = info_span!("republish", vhost = %vhost);
        let task = task::Task::new(vhost, connector, settings, reports, rx, metrics, clock);
        tasks.spawn(task.run().instrument(span));
        Self { tx }
    }

    /// Queues a publish; `false` if the task is gone.
    pub fn publish(&self, publish: Publish) -> bool {
        self.tx.send(publish).is_ok()
    }

    /// The task ended (it only does when the engine is gone, or on a bug).
    pub fn is_gone(&self) -> bool {
        self.tx.is_closed()
    }
}

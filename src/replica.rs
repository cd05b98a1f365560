//! The replica: every held message is also in a RabbitMQ stream owned by
//! this instance's id, replicated by the broker cluster, so losing a nackd
//! host (or its disk) loses nothing. The local store stays the fast path;
//! the stream is what survives the host.
//!
//! - One holder per id: a process acts for an id (intercepts, fires,
//!   writes its stream) only while it holds the id's lease, a majority of
//!   exclusive queues `nackd.lease.<id>.<k>`, one per node ([`lease`]). A
//!   second process with the same id waits as a standby; the broker frees
//!   the registers when the holder's connections die or go silent, and no
//!   single frozen or dead node can keep them.
//! - Each acquisition writes a new epoch to the id's directory stream
//!   `nackd.<id>`. The local store remembers the epoch it last held
//!   (`replica.state`); a newer epoch means another holder acted in
//!   between: the local copy is stale and is rebuilt from the stream.
//! - The held set lives in a generation stream `nackd.<id>.g<N>` (puts,
//!   and completed ids in batches); the directory names the current one.
//! - An id whose lease stays free for `adopt_after` is adopted by one live
//!   instance: it takes the lease, parks every message of it under its own
//!   id (same due times and retry counts), marks the directory adopted and
//!   deletes the generation stream.
//! - Every write is `mandatory`: a generation stream someone deleted makes
//!   the broker return writes instead of confirming them. Then nothing new
//!   is held (nacks are deferred) until an operator reseeds: a new
//!   generation written from the local store (`nackd admin replica reseed`).
//!
//! - [`record`]: what the streams hold, and how a generation is folded.
//! - [`client`]: the connection (lapin): streams, lease registers, probes.
//! - [`lease`]: the lease, a majority of per-node registers, and its keeper.
//! - `local`: the local store's last agreement with the cluster.
//! - `task`: the connection's life: lease, appends, completions; its
//!   `sync` lines the local store up with the stream.
//! - `completions`: completed ids until the broker confirmed them.

use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};

mod adopt;
pub mod client;
mod compact;
mod completions;
pub mod fence;
pub mod lease;
mod local;
pub mod record;
mod task;

pub use adopt::Adopt;
pub use client::{ClientError, Target};
pub use local::Synced;
pub use record::{Fold, Intent, Record, Step, PART_MAX};
#[cfg(test)]
pub(crate) use task::Command;
pub use task::SyncOutcome;

/// `[replica]`, resolved.
#[derive(Clone, Debug)]
pub struct Config {
    /// This instance's id.
    pub instance: String,
    /// The group whose instances adopt each other.
    pub group: String,
    /// How to reach the cluster.
    pub target: Target,
    /// The local store's directory (where `replica.state` lives).
    pub store_dir: PathBuf,
    /// Completed ids are written at least this often.
    pub done_every: Duration,
    /// An id whose lease stays free this long is adopted.
    pub adopt_after: Duration,
    /// An adoption commits what it took in parts of this many messages.
    pub adopt_part: usize,
    /// A generation is replaced once it holds more than twice the live
    /// bytes plus this much.
    pub generation_slack: u64,
    /// `replica.previous_addresses`: the nodes an id's last holder may
    /// have listed, besides `target.nodes`, during a change of them.
    pub previous_nodes: Vec<String>,
}

impl Config {
    /// `nackd.lease.<id>`
    pub fn lease(instance: &str) -> String {
        format!("nackd.lease.{instance}")
    }

    /// `nackd.<id>`
    pub fn directory(instance: &str) -> String {
        format!("nackd.{instance}")
    }

    /// `nackd.<id>.g<n>`
    pub fn generation(instance: &str, n: u64) -> String {
        format!("nackd.{instance}.g{n}")
    }

    /// The stream every instance of the group registers in:
    /// `nackd.instances.<group>`.
    pub fn registry(&self) -> String {
        format!("nackd.instances.{}", self.group)
    }
}

/// Where the replica stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Connecting to the cluster.
    Connecting,
    /// Connected; another process holds the lease.
    Standby,
    /// The lease is held; the local store is being checked or rebuilt.
    Syncing,
    /// The lease is held and the local store agrees with the stream:
    /// intercept and fire.
    Active,
    /// The lease was held again after it was lost, and another holder
    /// acted in between: the local store must be rebuilt ([`Replica::sync`]).
    Stale,
    /// The lease is held but the generation stream is gone (deleted by
    /// someone): held messages fire, nothing new is held, until an
    /// operator reseeds ([`Replica::reseed`]).
    Missing,
    /// A reseed was asked for: the local store must be handed back
    /// ([`Replica::sync`] writes the new generation from it).
    Reseeding,
    /// This process lists other `upstream.addresses` than its id's last
    /// holder did: it does not take the lease (and says so in the log).
    Refused,
}

/// A reseed done: how many held messages the new generation got, and its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reseeded {
    /// Messages written to the new stream (what the local store holds).
    pub seeded: u64,
    /// The new generation stream.
    pub stream: String,
}

/// Where a reseed is answered.
pub type ReseedReply = oneshot::Sender<Result<Reseeded, ReplicaError>>;

/// Why a replica write failed.
#[derive(Clone, Debug, thiserror::Error)]
#[error("replica: {0}")]
pub struct ReplicaError(pub String);

/// Handle to the replica task.
#[derive(Clone)]
pub struct Replica {
    tx: mpsc::UnboundedSender<task::Command>,
    state: watch::Receiver<State>,
    fence: std::sync::Arc<fence::Fence>,
    /// This instance's id.
    pub instance: String,
}

impl Replica {
    /// Starts the task: it connects, registers the id, and waits for the
    /// lease; [`Replica::sync`] then lines the local store up with it.
    /// Adopted messages are handed to `adopt` (the retry engine).
    pub fn spawn(
        config: Config,
        metrics: std::sync::Arc<crate::metrics::Metrics>,
        adopt: mpsc::Sender<Adopt>,
        clock: nackd_core::clock::Clock,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let (state_tx, state) = watch::channel(State::Connecting);
        let instance = config.instance.clone();
        let fence = fence::Fence::closed(clock.clone());
        tokio::spawn(task::run(
            config,
            rx,
            state_tx,
            metrics,
            adopt,
            fence.clone(),
            clock,
        ));
        Self {
            tx,
            state,
            fence,
            instance,
        }
    }

    /// Until when this process may act for its id (see [`fence`]).
    pub fn fence(&self) -> std::sync::Arc<fence::Fence> {
        self.fence.clone()
    }

    /// Where the replica stands, as it changes.
    pub fn state(&self) -> watch::Receiver<State> {
        self.state.clone()
    }

    /// Waits for the lease, then makes the local store agree with the
    /// stream: keeps it if this store was the last holder's, else wipes it
    /// and rebuilds it from the stream (or seeds a new stream from it).
    pub async fn sync(&self, log: crate::store::Log) -> Result<SyncOutcome, ReplicaError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(task::Command::Sync { log, reply })
            .map_err(|_| ReplicaError("the replica task is gone".into()))?;
        answer
            .await
            .map_err(|_| ReplicaError("the replica task is gone".into()))?
    }

    /// Appends a held message to the stream; resolves once the broker
    /// confirmed it (replicated).
    pub fn append(
        &self,
        record: Record,
    ) -> impl std::future::Future<Output = Result<(), ReplicaError>> + Send + 'static {
        let (reply, answer) = oneshot::channel();
        let sent = self.tx.send(task::Command::Append { record, reply });
        async move {
            sent.map_err(|_| ReplicaError("the replica task is gone".into()))?;
            answer
                .await
                .map_err(|_| ReplicaError("the replica task is gone".into()))?
        }
    }

    /// Records a completed message (written in batches).
    pub fn done(&self, id: u64) {
        let _ = self.tx.send(task::Command::Done(id));
    }

    /// Asks for a new generation seeded from the local store, in place of
    /// a missing one; `reply` gets the outcome once it is written.
    pub fn reseed(&self, reply: ReseedReply) {
        let state = self.state.borrow().clone();
        if matches!(state, State::Connecting | State::Standby | State::Refused) {
            // The task may wait for the lease for ever: answer now.
            let why = format!("the replica is {state:?}, not holding its lease: nothing to reseed");
            let _ = reply.send(Err(ReplicaError(why)));
            return;
        }
        if let Err(mpsc::error::SendError(task::Command::Reseed(reply))) =
            self.tx.send(task::Command::Reseed(reply))
        {
            let _ = reply.send(Err(ReplicaError("the replica task is gone".into())));
        }
    }

    /// A handle whose task is the test: it gets the commands, and sets
    /// the state.
    #[cfg(test)]
    pub(crate) fn detached(
        instance: &str,
    ) -> (
        Self,
        mpsc::UnboundedReceiver<task::Command>,
        watch::Sender<State>,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (state_tx, state) = watch::channel(State::Connecting);
        let replica = Self {
            tx,
            state,
            // No lease probes here: the test's state is the lease.
            fence: fence::Fence::always(),
            instance: instance.into(),
        };
        (replica, rx, state_tx)
    }
}

/// This host's name (the default instance id), from the kernel.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "nackd".into())
}

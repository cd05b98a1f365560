//! The lease of an instance id: which process may act for it.
//!
//! One exclusive queue could not be the lease: the broker gives it to one
//! connection, on one node, and frees it only when that node notices the
//! connection is gone. A frozen node notices nothing until the cluster's
//! `net_ticktime` (about 60 s), and on RabbitMQ 4.2+ (Khepri) a dead
//! node's exclusive queues are not deleted until it comes back.
//!
//! So the lease is a majority of registers, one per node of
//! `upstream.addresses`: register `k` is the exclusive queue
//! `nackd.lease.<id>.<k>`, declared over a connection to node `k` (an
//! exclusive queue lives on the node of its connection). A process holds
//! the lease while it holds more than half of them, each on a connection
//! of its own. What that relies on:
//! - each register has at most one holder: the broker gives an exclusive
//!   queue to one connection, and register `k` is only declared on node
//!   `k` (on 3.x a partitioned node may recreate its own, never another's),
//!   so two majorities always share a register, which only one of them
//!   can hold;
//! - a register is freed about two heartbeats after its node last heard
//!   from the holder (the connection's negotiated heartbeat timeout), or
//!   at once when the holder's connection closes: so a new holder waits
//!   1.5 heartbeats, the longest an earlier holder's fence can run, before
//!   it counts anything as heard ([`Keeper::spawn`]).
//!
//! A node that freezes or dies takes one register with it: the holder
//! keeps the others, so firing and interception go on without a pause
//! (with three nodes, one lost register still leaves two). A frozen or
//! dead holder loses every register after about two heartbeats, and a
//! standby takes a majority of them at its next try. The fence
//! ([`super::fence`]) is extended only when a majority answered a probe,
//! from the time the probe was sent, so it lapses before any register the
//! successor needs can have been freed.
//!
//! The same `nodes`, in the same order, must be configured on every
//! process of an id (and of a group, for adoption): register `k` is named
//! by its place in that list.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nackd_core::clock::Clock;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tracing::{info, warn};

use super::client::{Client, ClientError, Held, Target};
use super::fence::Fence;
use super::State;

/// The name of register `k` of the lease `lease`.
pub fn register(lease: &str, k: usize) -> String {
    format!("{lease}.{k}")
}

/// Whether a process listing `ours` (and `previous`, during a change of
/// them) may hold a lease whose last holder listed `recorded`: register
/// `k` is named by its place in the list.
pub(crate) fn nodes_agree(recorded: &[String], ours: &[String], previous: &[String]) -> bool {
    recorded == ours || recorded == previous
}

/// How many registers of `n` make a lease.
pub fn majority(n: usize) -> usize {
    n / 2 + 1
}

/// A lease held: a connection per register held.
pub struct Lease {
    target: Target,
    name: String,
    connection: String,
    /// Node `k`'s connection, while it holds register `k`.
    slots: Vec<Option<Arc<Client>>>,
    /// Registers not held, being taken again.
    retakes: JoinSet<(usize, Taken)>,
    retaking: Vec<bool>,
}

/// What taking one register gave.
enum Taken {
    Held(Box<Client>),
    /// Another connection holds it.
    Locked,
    Failed(String),
}

impl Lease {
    /// Takes a majority of the registers of `name`, or none of them:
    /// `Ok(None)` when other connections hold enough of them.
    pub async fn take(
        target: &Target,
        name: &str,
        connection: &str,
    ) -> Result<Option<Self>, ClientError> {
        let n = target.nodes.len();
        let mut attempts = JoinSet::new();
        for k in 0..n {
            let (target, name, connection) =
                (target.clone(), name.to_owned(), connection.to_owned());
            attempts.spawn(async move { (k, take_one(&target, &name, k, &connection).await) });
        }
        let mut lease = Self {
            target: target.clone(),
            name: name.to_owned(),
            connection: connection.to_owned(),
            slots: (0..n).map(|_| None).collect(),
            retakes: JoinSet::new(),
            retaking: vec![false; n],
        };
        let (mut locked, mut errors) = (0, Vec::new());
        while let Some(done) = attempts.join_next().await {
            let Ok((k, taken)) = done else { continue };
            match taken {
                Taken::Held(client) => lease.slots[k] = Some(Arc::from(client)),
                Taken::Locked => locked += 1,
                Taken::Failed(why) => errors.push(why),
            }
        }
        if lease.held() >= majority(n) {
            if lease.take_legacy().await? {
                return Ok(Some(lease));
            }
            lease.release().await;
            return Ok(None);
        }
        lease.release().await;
        match locked {
            0 => Err(ClientError::Unreachable(errors.join("; "))),
            _ => Ok(None),
        }
    }

    /// The heartbeat the broker frees a silent register after two of: the
    /// configured one, or less if a node negotiated less.
    pub fn heartbeat(&self) -> Duration {
        self.slots
            .iter()
            .flatten()
            .filter_map(|c| c.heartbeat())
            .fold(self.target.heartbeat, Duration::min)
    }

    /// The lease of earlier releases was the one exclusive queue `name`
    /// itself: it is taken too, on the first register's connection, so a
    /// process of the old version (a rolling upgrade) and one of this
    /// version never hold one id together, and an old adopter does not
    /// take a new process for gone. `false`: an old process holds it.
    async fn take_legacy(&self) -> Result<bool, ClientError> {
        let Some(client) = self.slots.iter().flatten().next() else {
            return Ok(false);
        };
        let within = self.target.answer_within();
        match tokio::time::timeout(within, client.try_lease(&self.name)).await {
            Ok(taken) => taken,
            Err(_) => Err(ClientError::Unreachable(format!(
                "{}: no answer",
                client.node
            ))),
        }
    }

    /// How many registers this process holds (their connections are up).
    pub fn held(&self) -> usize {
        self.slots.iter().flatten().filter(|c| c.alive()).count()
    }

    /// One round, within the target's answer time: each register held is
    /// asked whether it still is; `heard` is called as soon as a majority
    /// said so. A register not held is tried again beside the rounds (a
    /// node that does not answer must not slow them down), and counts
    /// from the round after it was taken. How many answered.
    pub async fn probe(&mut self, mut heard: impl FnMut()) -> usize {
        while let Some(done) = self.retakes.try_join_next() {
            let Ok((k, taken)) = done else { continue };
            self.retaking[k] = false;
            if let Taken::Held(client) = taken {
                let register = register(&self.name, k);
                info!(register, node = client.node, "lease register taken again");
                self.slots[k] = Some(Arc::from(client));
            }
        }
        let within = self.target.answer_within();
        let mut asks = JoinSet::new();
        for k in 0..self.slots.len() {
            match &self.slots[k] {
                Some(client) if client.alive() => {
                    let (client, register) = (client.clone(), register(&self.name, k));
                    asks.spawn(async move { (k, client.holds(&register, within).await) });
                }
                Some(_) => {
                    warn!(
                        register = register(&self.name, k),
                        "lease register lost with its connection"
                    );
                    self.slots[k] = None;
                }
                None => {}
            }
            if self.slots[k].is_none() && !self.retaking[k] {
                self.retaking[k] = true;
                let (target, name, connection) = (
                    self.target.clone(),
                    self.name.clone(),
                    self.connection.clone(),
                );
                self.retakes
                    .spawn(async move { (k, take_one(&target, &name, k, &connection).await) });
            }
        }
        let needed = majority(self.slots.len());
        let mut answered = 0;
        while let Some(done) = asks.join_next().await {
            match done {
                Ok((_, Held::Yes)) => {
                    answered += 1;
                    if answered == needed {
                        heard();
                    }
                }
                Ok((k, Held::Gone)) => {
                    warn!(
                        register = register(&self.name, k),
                        "lease register deleted by someone; taking it again"
                    );
                    self.slots[k] = None;
                }
                _ => {}
            }
        }
        answered
    }

    /// Gives every register back (closes their connections).
    pub async fn release(mut self) {
        // One being taken now is given back too.
        while let Some(done) = self.retakes.join_next().await {
            if let Ok((k, Taken::Held(client))) = done {
                self.slots[k] = Some(Arc::from(client));
            }
        }
        let mut closing = JoinSet::new();
        let within = self.target.answer_within();
        for client in self.slots.drain(..).flatten() {
            closing.spawn(async move {
                let _ = tokio::time::timeout(within, client.close()).await;
            });
        }
        while closing.join_next().await.is_some() {}
    }

    /// Whether some process holds `name`'s lease: more than half of its
    /// registers exist (an exclusive queue exists only while held; a dead
    /// node's may stay on RabbitMQ 4.2+, which is why one is not enough).
    pub async fn is_held(client: &Client, name: &str, nodes: usize) -> Result<bool, ClientError> {
        if client.exists(name).await? {
            return Ok(true); // held by a process of the old version
        }
        let mut existing = 0;
        for k in 0..nodes {
            if client.exists(&register(name, k)).await? {
                existing += 1;
            }
        }
        Ok(existing >= majority(nodes))
    }
}

impl Drop for Lease {
    /// A lease dropped without [`Lease::release`] (on an error path) is
    /// given back all the same.
    fn drop(&mut self) {
        let within = self.target.answer_within();
        for client in self.slots.drain(..).flatten() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    let _ = tokio::time::timeout(within, client.close()).await;
                });
            }
        }
        self.retakes.abort_all();
    }
}

/// Takes register `k` over a new connection to node `k`.
async fn take_one(target: &Target, name: &str, k: usize, connection: &str) -> Taken {
    let connection = format!("{connection} register {k}");
    let client = match Client::connect_node(target, k, &connection).await {
        Ok(client) => client,
        Err(e) => return Taken::Failed(e.to_string()),
    };
    let register = register(name, k);
    let asked = tokio::time::timeout(target.answer_within(), client.try_lease(&register));
    let taken = match asked.await {
        Ok(Ok(true)) => return Taken::Held(Box::new(client)),
        Ok(Ok(false)) => Taken::Locked,
        Ok(Err(e)) => Taken::Failed(e.to_string()),
        Err(_) => Taken::Failed(format!("{}: no answer", client.node)),
    };
    let _ = tokio::time::timeout(target.answer_within(), client.close()).await;
    taken
}

/// What the keeper of a lease tells the replica task.
#[derive(Debug)]
pub enum Kept {
    /// A majority of the registers answered a probe sent then.
    Heard(Instant),
    /// Fewer than a majority are held: the lease is gone (given back).
    Lost,
}

/// A lease kept by a task of its own, so that a node that does not answer
/// never holds up the replica's writes.
pub struct Keeper {
    news: mpsc::UnboundedReceiver<Kept>,
    /// When the last probe a majority answered was sent, once the lease
    /// settled (see [`Keeper::spawn`]).
    heard: Arc<std::sync::Mutex<Option<Instant>>>,
    heartbeat: Duration,
    stop: Option<oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<()>>,
}

impl Keeper {
    /// Probes `lease` every `every` until stopped or lost. While
    /// `active` says so, each majority heard extends `fence` at once: the
    /// replica task may be busy with a slow write meanwhile.
    ///
    /// Nothing counts as heard until 1.5 heartbeats after `taken`: a
    /// register can be freed at once (its holder's connection closed by
    /// an operator, a reset), while the process that held it may still be
    /// inside its fence for that long.
    pub fn spawn(
        lease: Lease,
        taken: Instant,
        clock: Clock,
        every: Duration,
        fence: Arc<Fence>,
        active: watch::Receiver<State>,
    ) -> Self {
        let (tell, news) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel();
        let last = Arc::new(std::sync::Mutex::new(None));
        let heartbeat = lease.heartbeat();
        let heard = Heard {
            tell,
            fence,
            active,
            heartbeat,
            settled: taken + heartbeat + heartbeat / 2,
            last: last.clone(),
        };
        let done = tokio::spawn(keep(lease, clock, every, heard, stopped));
        Self {
            heard: last,
            heartbeat,
            news,
            stop: Some(stop),
            done: Some(done),
        }
    }

    /// When the last probe a majority answered was sent (none yet: the
    /// lease is settling): what the fence may be extended from when the
    /// replica turns active.
    pub fn heard(&self) -> Option<Instant> {
        *self.heard.lock().expect("never poisoned")
    }

    /// Whether the keeper ended (the lease was lost).
    pub fn is_finished(&self) -> bool {
        self.done.as_ref().is_none_or(|d| d.is_finished())
    }

    /// The heartbeat the fence is extended by ([`Lease::heartbeat`]).
    pub fn heartbeat(&self) -> Duration {
        self.heartbeat
    }

    /// The next news of the lease; [`Kept::Lost`] once the keeper is gone
    /// (it ended or failed).
    pub async fn next(&mut self) -> Kept {
        match self.news.recv().await {
            Some(kept) => kept,
            None => Kept::Lost,
        }
    }

    /// Stops probing and gives the registers back.
    pub async fn release(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(done) = self.done.take() {
            let _ = done.await;
        }
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Where a majority heard goes.
struct Heard {
    tell: mpsc::UnboundedSender<Kept>,
    fence: Arc<Fence>,
    active: watch::Receiver<State>,
    heartbeat: Duration,
    /// Probes sent before this do not count.
    settled: Instant,
    last: Arc<std::sync::Mutex<Option<Instant>>>,
}

impl Heard {
    fn at(&self, asked: Instant) {
        if asked < self.settled {
            return;
        }
        *self.last.lock().expect("never poisoned") = Some(asked);
        // Read before the state: a revocation after this read wins.
        let seen = self.fence.revocations();
        // Missing: the stream is gone but the lease is held, and what the
        // local store holds still fires (nothing new is held).
        if matches!(*self.active.borrow(), State::Active | State::Missing) {
            self.fence
                .extend_unless_revoked(seen, asked, self.heartbeat);
        }
        let _ = self.tell.send(Kept::Heard(asked));
    }

    /// The lease is gone: nothing more goes out from now, before the
    /// registers left are given back (the replica task may be busy).
    fn lost(&self) {
        self.fence.revoke();
        *self.last.lock().expect("never poisoned") = None;
        let _ = self.tell.send(Kept::Lost);
    }
}

async fn keep(
    mut lease: Lease,
    clock: Clock,
    every: Duration,
    heard: Heard,
    mut stopped: oneshot::Receiver<()>,
) {
    let needed = majority(lease.slots.len());
    // A majority unheard for this long is surely free by now.
    let gone_after = heard.heartbeat * 2;
    let mut last_heard = clock.now();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            _ = tick.tick() => {}
        }
        let asked = clock.now();
        let answered = tokio::select! {
            _ = &mut stopped => break,
            answered = lease.probe(|| heard.at(asked)) => answered,
        };
        if heard.tell.is_closed() {
            break;
        }
        if answered >= needed {
            last_heard = asked;
        } else if lease.held() < needed
            || clock.now().saturating_duration_since(last_heard) > gone_after
        {
            warn!(
                lease = lease.name,
                held = lease.held(),
                answered,
                needed,
                "lease lost: fewer than a majority of its registers are held"
            );
            heard.lost();
            break;
        }
    }
    lease.release().await;
}

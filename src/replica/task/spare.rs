//! The spare generation, and the switch to it.
//!
//! A generation stream takes no writes while the node that leads it is
//! frozen or cut off, and RabbitMQ moves its leader only once it gives the
//! node up (`net_ticktime`, about a minute); on 3.x no stream can even be
//! declared meanwhile. So the next generation is declared ahead of time,
//! through another node than the current one's (RabbitMQ's default
//! `queue_leader_locator`, `client-local`, makes that node its leader),
//! and kept empty. When the current stream stops answering while its
//! connection's node still answers, the task switches: the engine hands
//! its store back, the spare is seeded from it, and the directory names
//! the spare (the directory is declared through a third node, its "home",
//! for the same reason).
//!
//! The leaders are where nackd put them when it declared the streams; a
//! leader RabbitMQ moved since (after an earlier fault) may share a node
//! with another, and then a freeze of that node stalls the switch too: the
//! task waits for the broker, as it did before spares.

use std::time::Duration;

use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use super::{Event, Task};
use crate::replica::client::{Client, ClientError, Probe, Target};
use crate::replica::{local, Config, Record, State};

/// A next generation stream, declared ahead and empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Spare {
    /// Its generation number (the current one's plus one).
    pub n: u64,
    /// The node it was declared through (its place in `upstream.addresses`).
    pub node: usize,
}

/// How long a spare may take to be made, or a retired generation to be
/// deleted, in heartbeats (on 3.x a declare waits while a node is frozen).
const SLOW_STEPS: u32 = 4;
/// What [`make`] says of a stream of the spare's name that is not empty.
const HOLDS_RECORDS: &str = "holds records";
/// How long after a failed attempt a spare is tried again.
const SPARE_AGAIN: Duration = Duration::from_secs(5);

/// The node (its place in `upstream.addresses`, of `nodes`) an id's
/// directory is declared through: spread over the nodes by the id (FNV-1a:
/// the same in every process and release). Its generations go to the next
/// node, their spares to the one after.
pub fn home(instance: &str, nodes: usize) -> usize {
    let hash = instance.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    (hash % nodes.max(1) as u64) as usize
}

/// The first node after `home` (in the list's order, wrapping) that is
/// not in `avoid`.
pub(super) fn pick(home: usize, nodes: usize, avoid: &[usize]) -> Option<usize> {
    (1..=nodes)
        .map(|i| (home + i) % nodes)
        .find(|n| !avoid.contains(n))
}

/// What one round trip found about the writes connection and the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Writes {
    /// Both answered.
    Alive,
    /// The stream is gone.
    Missing,
    /// The node answered, the stream did not: its leader is away.
    Stalled,
    /// The node did not answer.
    Silent,
}

/// Asks about the stream and, at once and at the same cost, about
/// `beside`, a stream led elsewhere (the directory), within `within`: a
/// broker slow to answer answers neither, a frozen leader only the one it
/// does not lead.
pub(super) async fn probe(
    client: &Client,
    stream: Option<&str>,
    beside: &str,
    within: Duration,
) -> Writes {
    let asked = tokio::join!(
        client.probe(stream, within),
        client.probe(Some(beside), within)
    );
    match asked {
        (Probe::Alive, _) => Writes::Alive,
        (Probe::Missing, _) => Writes::Missing,
        (Probe::Silent, Probe::Alive | Probe::Missing) => Writes::Stalled,
        (Probe::Silent, Probe::Silent) => Writes::Silent,
    }
}

/// Declares generation `n` of `instance` through node `node`: empty (a
/// read finds no record) and taking writes (the read's marker was
/// confirmed). A stream of that name left by a switch or a compaction that
/// did not finish holds records: `Err`, the task deletes it.
async fn make(target: Target, instance: String, n: u64, node: usize) -> Result<Spare, String> {
    let within = target.answer_within() * SLOW_STEPS;
    let name = Config::generation(&instance, n);
    let made = async {
        let client = Client::connect_node(&target, node, "nackd replica spare").await?;
        let checked = async {
            client.declare_stream(&name).await?;
            Ok::<_, ClientError>(client.read_all(&name).await?.is_empty())
        }
        .await;
        let _ = tokio::time::timeout(target.answer_within(), client.close()).await;
        checked
    };
    match tokio::time::timeout(within, made).await {
        Ok(Ok(true)) => Ok(Spare { n, node }),
        Ok(Ok(false)) => Err(format!(
            "{name} holds records (left by a switch that did not finish)"
        )),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("{name} was not made within {within:?}")),
    }
}

/// Deletes a generation the directory no longer names, over a connection
/// of its own (its leader may still be frozen).
async fn retire(target: Target, instance: String, n: u64) -> Result<(), String> {
    let within = target.answer_within() * SLOW_STEPS;
    let deleted = async {
        let client = Client::connect(&target, fastrand::usize(..), "nackd replica retire").await?;
        let deleted = client.delete(&Config::generation(&instance, n)).await;
        let _ = tokio::time::timeout(target.answer_within(), client.close()).await;
        deleted
    };
    match tokio::time::timeout(within, deleted).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {within:?}")),
    }
}

/// Reads `instance`'s directory on a connection of its own and deletes
/// generation `n` if the directory still names `current` (and the fence
/// holds): `Ok(true)`; `Ok(false)`: the directory names another.
async fn leftover(
    target: Target,
    instance: String,
    n: u64,
    current: Option<u64>,
    fence: std::sync::Arc<crate::replica::fence::Fence>,
) -> Result<bool, String> {
    let within = target.answer_within() * SLOW_STEPS;
    let cleared = async {
        let client =
            Client::connect(&target, fastrand::usize(..), "nackd replica leftover").await?;
        let checked = async {
            let dir = super::Directory::read(&client, &instance).await?;
            if dir.generation != current {
                return Ok(false);
            }
            if !fence.holds() {
                return Err(ClientError::Unreachable("the lease lapsed".into()));
            }
            client.delete(&Config::generation(&instance, n)).await?;
            Ok(true)
        }
        .await;
        let _ = tokio::time::timeout(target.answer_within(), client.close()).await;
        checked
    };
    match tokio::time::timeout(within, cleared).await {
        Ok(result) => result.map_err(|e: ClientError| e.to_string()),
        Err(_) => Err(format!("no answer within {within:?}")),
    }
}

/// The spare's side of the task: what it is making, and what it left.
#[derive(Default)]
pub(super) struct Spares {
    /// The spare, once made (for the current generation).
    pub ready: Option<Spare>,
    /// A spare being made.
    making: Option<JoinHandle<()>>,
    /// When the last attempt failed (the next waits [`SPARE_AGAIN`]).
    failed_at: Option<std::time::Instant>,
    /// A switch under way: to this spare, from this generation.
    pub switching: Option<(Spare, u64)>,
    /// Generations a switch left behind, to delete.
    retired: Vec<u64>,
    /// A delete of a retired generation under way.
    retiring: Option<JoinHandle<()>>,
    /// A leftover of the spare's name being looked at.
    clearing: Option<JoinHandle<()>>,
    /// The writes connection's channel wrote to the spare and the
    /// directory (see [`Task::warm_up`]); a switch needs it.
    pub warm: bool,
}

impl Spares {
    /// Deletes generation `n` (the directory names a later one), in a
    /// task of its own, once active.
    pub(super) fn retire(&mut self, n: u64) {
        if n > 0 && !self.retired.contains(&n) {
            self.retired.push(n);
        }
    }

    /// Whether a spare is being made (a compaction waits: it writes to
    /// the same stream).
    /// Until its answer was handled ([`Task::on_spare`]).
    pub(super) fn making(&self) -> bool {
        self.making.is_some()
    }

    /// Forgets the spare and stops making one: the lease or the
    /// generation changed.
    pub(super) fn reset(&mut self) {
        self.ready = None;
        self.warm = false;
        if let Some(h) = self.making.take() {
            h.abort();
        }
    }
}

impl Task {
    /// The directory's node.
    pub(super) fn home(&self) -> usize {
        home(&self.config.instance, self.config.target.nodes.len())
    }

    /// Where the spare goes: off the current generation's node, and off
    /// the directory's if there are nodes enough.
    fn spare_node(&self) -> Option<usize> {
        let (home, nodes) = (self.home(), self.config.target.nodes.len());
        let placed: Vec<usize> = self.placed.into_iter().collect();
        let both: Vec<usize> = placed.iter().copied().chain([home]).collect();
        pick(home, nodes, &both).or_else(|| pick(home, nodes, &placed))
    }

    /// Where a new generation goes that is no spare: off the directory's
    /// node (`None` on a single node).
    pub(super) fn fresh_node(&self) -> Option<usize> {
        let (home, nodes) = (self.home(), self.config.target.nodes.len());
        pick(home, nodes, &[home])
    }

    /// While active: makes a spare if there is none (in a task of its
    /// own), and deletes what switches left behind.
    pub(super) fn tend_spares(&mut self) {
        if !self.writable() || self.client.is_none() {
            return;
        }
        self.retire_next();
        let Some(g) = self.generation else { return };
        let now = self.clock.now();
        let again = self
            .spares
            .failed_at
            .is_some_and(|at| now < at + SPARE_AGAIN);
        if self.spares.ready.is_some() || self.spares.making() || again || self.compaction.is_some()
        {
            return;
        }
        let Some(node) = self.spare_node() else {
            return;
        };
        let (target, instance, events) = (
            self.config.target.clone(),
            self.config.instance.clone(),
            self.events_tx.clone(),
        );
        self.spares.making = Some(tokio::spawn(async move {
            let made = make(target, instance, g + 1, node).await;
            let _ = events.send(Event::Spare(made));
        }));
    }

    /// A spare was made, or not.
    pub(super) async fn on_spare(&mut self, made: Result<Spare, String>) {
        self.spares.making = None;
        let current = self.generation.map(|g| g + 1);
        // A compaction started meanwhile writes to that very stream.
        let usable = self.writable() && self.compaction.is_none();
        match made {
            Ok(spare) if Some(spare.n) == current && usable => {
                self.spares.failed_at = None;
                info!(
                    stream = Config::generation(&self.config.instance, spare.n),
                    node = self.config.target.nodes[spare.node],
                    "spare replica generation ready"
                );
                self.spares.ready = Some(spare);
                self.warm_up().await;
            }
            Ok(_) => {}
            Err(why) => {
                if self.spares.failed_at.is_none() {
                    warn!(error = why, "cannot make a spare replica generation yet; trying again every few seconds");
                }
                self.spares.failed_at = Some(self.clock.now());
                if let (true, true, Some(n)) = (why.contains(HOLDS_RECORDS), usable, current) {
                    self.clear_leftover(n);
                }
            }
        }
    }

    /// The spare's stream `n` holds records: left by a switch or a
    /// compaction that did not finish, and deleted, unless the directory
    /// names it (the `Generation` record of an attempt given up on landed
    /// after all). In a task of its own, on a connection of its own: on
    /// 3.x a delete waits while any node is frozen.
    fn clear_leftover(&mut self, n: u64) {
        if self
            .spares
            .clearing
            .as_ref()
            .is_some_and(|h| !h.is_finished())
        {
            return;
        }
        let (target, instance, events) = (
            self.config.target.clone(),
            self.config.instance.clone(),
            self.events_tx.clone(),
        );
        let (current, fence) = (self.generation, self.fence.clone());
        self.spares.clearing = Some(tokio::spawn(async move {
            let cleared = leftover(target, instance, n, current, fence).await;
            let _ = events.send(Event::Leftover(n, cleared));
        }));
    }

    /// What [`leftover`] found. Named by the directory: this process
    /// writes to another stream than the directory names, so it gives the
    /// lease up and syncs again.
    pub(super) fn on_leftover(&mut self, n: u64, cleared: Result<bool, String>) {
        match cleared {
            Ok(true) => info!(generation = n, "leftover replica stream deleted"),
            Ok(false) if self.generation.map(|g| g + 1) == Some(n) => {
                error!(
                    named = n,
                    writing = self.generation,
                    "the replica directory names another generation than the one written to; syncing again"
                );
                self.lost("the directory names another generation");
            }
            Ok(false) => {}
            Err(e) => warn!(
                error = e,
                generation = n,
                "cannot clear the leftover replica stream yet"
            ),
        }
    }

    /// Writes a marker to the spare (if ready) and the directory on the
    /// writes connection (not waited for): a switch writes there on this channel,
    /// and on 4.x a channel's first write to a stream can wait for as long
    /// as a node is frozen, where one that wrote there before does not.
    pub(super) async fn warm_up(&mut self) {
        let Some(client) = &self.client else {
            return;
        };
        let instance = &self.config.instance;
        let spare = self.spares.ready.map(|s| Config::generation(instance, s.n));
        let warm = spare.is_some();
        self.spares.warm = false;
        for stream in spare.into_iter().chain([Config::directory(instance)]) {
            let marker = Record::Marker(fastrand::u128(..));
            if client.append(&stream, &marker).await.is_err() {
                return; // the connection failed: the watch notices
            }
        }
        self.spares.warm = warm;
    }

    /// The stream takes no writes while the node answers: switches to
    /// the spare if there is one (else the connection is made again, and
    /// the broker is waited for, as before spares).
    pub(super) async fn switch_or_wait(&mut self, stream: &str) {
        // A channel that did not write to the spare before the freeze may
        // wait for as long as it lasts: then no switch, as before spares.
        let ready = self.spares.ready.filter(|_| {
            self.spares.warm
                && self.writable()
                && self.compaction.is_none()
                && !local::adoption_under_way(&self.config.store_dir)
        });
        let (Some(spare), Some(from)) = (ready, self.generation) else {
            return self.writes_lost(
                "the replica stream did not answer within a heartbeat while its node did",
            );
        };
        warn!(
            stream,
            spare = Config::generation(&self.config.instance, spare.n),
            "the replica stream takes no writes while its node answers (its leader's node is frozen or cut off): switching to the spare generation"
        );
        // Writes waiting for the old stream fail now (their nacks are
        // deferred); the engine settles them before it hands its store
        // back. The connection stays: its channel wrote to the spare and
        // the directory before (see `on_spare`), and on 4.x a channel's
        // first write to a stream can wait while a node is frozen.
        if let Some(client) = &self.client {
            client.abandon();
        }
        self.completions.lost();
        self.spares.ready = None;
        self.spares.switching = Some((spare, from));
        self.metrics.replica_switches.inc();
        self.set(State::Switching);
    }

    /// The sync wrote the switch: the spare is the generation now.
    pub(super) fn switched(&mut self) {
        if let Some((spare, from)) = self.spares.switching.take() {
            self.placed = Some(spare.node);
            self.spares.retire(from);
        }
    }

    /// Deletes the oldest generation a switch left behind, one at a time.
    fn retire_next(&mut self) {
        if self
            .spares
            .retiring
            .as_ref()
            .is_some_and(|h| !h.is_finished())
        {
            return;
        }
        let Some(&n) = self.spares.retired.first() else {
            return;
        };
        let (target, instance, events) = (
            self.config.target.clone(),
            self.config.instance.clone(),
            self.events_tx.clone(),
        );
        self.spares.retiring = Some(tokio::spawn(async move {
            let deleted = retire(target, instance, n).await;
            let _ = events.send(Event::Retired(n, deleted));
        }));
    }

    /// A retired generation was deleted, or not (tried again later).
    pub(super) fn on_retired(&mut self, n: u64, deleted: Result<(), String>) {
        match deleted {
            Ok(()) => {
                self.spares.retired.retain(|r| *r != n);
                info!(
                    stream = Config::generation(&self.config.instance, n),
                    "replica generation left by a switch deleted"
                );
            }
            Err(e) => warn!(
                error = e,
                generation = n,
                "cannot delete the replica generation left by a switch yet"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_home_node_is_the_same_everywhere_and_spread_by_id() {
        assert_eq!(home("nackd-1", 3), home("nackd-1", 3));
        let homes: std::collections::HashSet<usize> =
            (0..30).map(|i| home(&format!("nackd-{i}"), 3)).collect();
        assert_eq!(homes.len(), 3, "thirty ids use every node");
        assert_eq!(home("x", 1), 0);
        assert_eq!(home("x", 0), 0);
    }

    #[test]
    fn a_pick_avoids_what_it_is_told_starting_after_home() {
        assert_eq!(pick(0, 3, &[0]), Some(1));
        assert_eq!(pick(2, 3, &[2]), Some(0));
        assert_eq!(pick(0, 3, &[0, 1]), Some(2));
        assert_eq!(pick(1, 3, &[1, 2]), Some(0));
        assert_eq!(pick(0, 2, &[0, 1]), None);
        assert_eq!(pick(0, 1, &[0]), None);
        assert_eq!(pick(0, 1, &[]), Some(0));
    }
}

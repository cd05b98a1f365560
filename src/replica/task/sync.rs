//! The sync: the local store made to agree with the stream once the lease
//! is held (kept, rebuilt from the stream, or seeded into a new
//! generation), and the wait for an operator's reseed when the stream is
//! gone. The steps of one attempt are the states of [`phase::Sync`], a
//! transition function without I/O; `Task::try_sync` does their I/O.

use std::collections::{HashMap, HashSet};

use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{Command, Task, REBUILD_BATCH, RETRY, SEED_WINDOW};
use crate::replica::adopt::Commits;
use crate::replica::client::{Client, ClientError, Confirm, StreamReader};
use crate::replica::local;
use crate::replica::record::{Fold, Record, Step};
use crate::replica::{Config, ReplicaError, ReseedReply, Reseeded, State, SyncOutcome};
use crate::store::{Log, Recovered};
use phase::{Effect, Failure, Outcome, Phase, Sync};

mod phase;

impl Task {
    /// Takes the lease, then makes `log` agree with the stream. Broker
    /// failures are retried; a store that cannot be written is an error. A
    /// generation stream that is gone is not retried: it waits for an
    /// operator's reseed (`commands` brings it).
    pub(super) async fn sync(
        &mut self,
        log: Log,
        commands: &mut mpsc::UnboundedReceiver<Command>,
    ) -> Result<SyncOutcome, ReplicaError> {
        let mut log = log;
        loop {
            if self.client.is_none() || self.lease.is_none() {
                self.acquire().await;
            }
            self.set(State::Syncing);
            match self.try_sync(log).await {
                Ok(outcome) => {
                    self.set(State::Active);
                    if let Some((reply, reseeded)) = self.reseeded.take() {
                        let _ = reply.send(Ok(reseeded));
                    }
                    return Ok(outcome);
                }
                Err(Failed::Broker(back, e)) => {
                    warn!(error = %e, "replica sync failed; trying again");
                    self.lost(&e.to_string());
                    log = back;
                    tokio::time::sleep(RETRY).await;
                }
                Err(Failed::Missing(back, stream)) => {
                    log = back;
                    self.stream_gone(
                        &stream,
                        "the replica stream is missing (deleted?) and the local store may not hold all it held: nothing is intercepted or fired until `nackd admin replica reseed` writes a new stream from what the local store holds",
                    );
                    match self.wait_for_reseed(commands).await {
                        Some(reply) => self.reseed = Some(reply),
                        None => return Err(ReplicaError("nackd is stopping".into())),
                    }
                }
                Err(Failed::Store(e)) => {
                    self.lost("the local store failed");
                    return Err(ReplicaError(format!("local store: {e}")));
                }
            }
        }
    }

    /// The stream is gone and the local store may not hold everything it
    /// held: nothing is intercepted or fired until an operator says to
    /// start again from the local store. `None`: nackd is stopping.
    async fn wait_for_reseed(
        &mut self,
        commands: &mut mpsc::UnboundedReceiver<Command>,
    ) -> Option<ReseedReply> {
        loop {
            match commands.recv().await? {
                Command::Reseed(reply) => return Some(reply),
                Command::Done(id) => self.completions.add(id),
                Command::Append { reply, .. } => {
                    let _ = reply.send(Err(ReplicaError("the replica stream is missing".into())));
                }
                Command::Sync { reply, .. } => {
                    let _ = reply.send(Err(ReplicaError("a sync is under way".into())));
                }
            }
        }
    }

    /// One sync attempt: the steps and their order are [`Sync`]'s; this
    /// does their I/O. The log goes to each step that needs it and comes
    /// back with its outcome (but for a failed store).
    async fn try_sync(&mut self, log: Log) -> Result<SyncOutcome, Failed> {
        let first = !self.synced_once;
        let mut sync = Sync::new(&self.config.instance, self.reseed.is_some(), first);
        let mut log = Some(log);
        let mut recovered = None;
        loop {
            let phase = sync.phase().clone();
            let outcome = self.perform_sync(&phase, &mut log, &mut recovered).await;
            for effect in sync.on(outcome) {
                self.apply_sync(effect);
            }
            match sync.phase().clone() {
                Phase::Synced { epoch, rebuilt } => {
                    return Ok(SyncOutcome {
                        log: log.expect("reopened"),
                        recovered: recovered.expect("reopened"),
                        rebuilt,
                        epoch,
                    });
                }
                Phase::Failed => {
                    let failure = sync.failure().expect("failed");
                    return Err(Failed::with_log(failure, log));
                }
                _ => {}
            }
        }
    }

    /// The I/O `phase` names, and what it found.
    async fn perform_sync(
        &mut self,
        phase: &Phase,
        log: &mut Option<Log>,
        recovered: &mut Option<Recovered>,
    ) -> Outcome {
        let broker = Outcome::Broker;
        match *phase {
            Phase::Reading => match self.directory().await {
                Ok(dir) => {
                    self.given.clone_from(&dir.given);
                    Outcome::Read {
                        dir,
                        local: local::load(&self.config.store_dir),
                        adopting: local::adoption_under_way(&self.config.store_dir),
                    }
                }
                Err(e) => broker(e),
            },
            Phase::Checking { g, .. } => {
                let stream = Config::generation(&self.config.instance, g);
                let client = self.client.as_ref().expect("held");
                client
                    .exists(&stream)
                    .await
                    .map_or_else(broker, Outcome::Exists)
            }
            Phase::Reseeding { next } | Phase::Starting { next, .. } => {
                let wipe = matches!(phase, Phase::Starting { wipe: true, .. });
                let started = self.start_generation(taken(log), next, wipe).await;
                given_back(
                    log,
                    started.map(|(l, seeded)| (l, Outcome::Started { seeded })),
                )
            }
            Phase::Rebuilding { g } => {
                let rebuilt = self.rebuild(taken(log), g).await;
                given_back(log, rebuilt.map(|l| (l, Outcome::Rebuilt)))
            }
            Phase::Sealing {
                last, generation, ..
            } => self
                .new_epoch(last, generation)
                .await
                .map_or_else(broker, Outcome::Sealed),
            Phase::Reopening { .. } => {
                let reopened = reopen(taken(log)).map(|(l, r)| {
                    *recovered = Some(r);
                    (l, Outcome::Reopened)
                });
                given_back(log, reopened)
            }
            Phase::Synced { .. } | Phase::Failed => unreachable!("an ended sync is not driven"),
        }
    }

    /// Applies what a transition asked for.
    fn apply_sync(&mut self, effect: Effect) {
        match effect {
            Effect::RefuseReseed { by } => {
                if let Some(reply) = self.reseed.take() {
                    let why = format!("nothing to reseed: this id's messages were adopted by {by}");
                    let _ = reply.send(Err(ReplicaError(why)));
                }
            }
            Effect::Reseeded { seeded, generation } => {
                let stream = Config::generation(&self.config.instance, generation);
                info!(seeded, stream, "replica reseeded from the local store");
                self.metrics.replica_missing.set(None);
                if let Some(reply) = self.reseed.take() {
                    self.reseeded = Some((reply, Reseeded { seeded, stream }));
                }
            }
            Effect::EndAdoptionsAtStart => {
                local::end_adoptions_at_start(&self.config.store_dir);
                self.synced_once = true;
            }
        }
    }

    /// A new generation stream: empty when `wipe` (the held messages were
    /// adopted elsewhere), else seeded with what the local store holds;
    /// with it, how many messages it was seeded with. Completions not
    /// written yet are dropped: the new stream never held those messages.
    async fn start_generation(
        &mut self,
        log: Log,
        n: u64,
        wipe: bool,
    ) -> Result<(Log, u64), Failed> {
        let client = self.client.as_ref().expect("held");
        let stream = Config::generation(&self.config.instance, n);
        let (log, recovered) = reopen(log)?;
        let log = match wipe {
            true => {
                warn!(
                    "this id's messages were adopted by another instance: the local store is discarded"
                );
                forget_synced(&self.config.store_dir);
                wipe_log(log)?
            }
            false => drop_given(log, &recovered, &self.given)?,
        };
        // A switch that did not finish may have left a stream of that name.
        let fresh = async {
            client.delete(&stream).await?;
            client.declare_stream(&stream).await
        };
        if let Err(e) = fresh.await {
            return Err(Failed::Broker(log, e));
        }
        let mut seeded = 0;
        if !wipe {
            seeded = match seed(client, &stream, &log, &recovered, &self.given).await {
                Ok(seeded) => seeded,
                Err(e) => return Err(Failed::Broker(log, e)),
            };
            info!(
                seeded,
                generation = n,
                "new replica stream seeded from the local store"
            );
        }
        let directory = Config::directory(&self.config.instance);
        if let Err(e) = client
            .append_confirmed(&directory, &Record::Generation(n))
            .await
        {
            return Err(Failed::Broker(log, e));
        }
        self.completions.clear();
        Ok((log, seeded))
    }

    /// Wipes the local store and rebuilds it from generation `g`.
    async fn rebuild(&mut self, log: Log, g: u64) -> Result<Log, Failed> {
        warn!(
            generation = g,
            "local store is not the last holder's: rebuilding it from the stream"
        );
        forget_synced(&self.config.store_dir);
        let mut log = wipe_log(log)?;
        let client = self.client.as_ref().expect("held");
        let stream = Config::generation(&self.config.instance, g);
        let mut reader = match client.read(&stream).await {
            Ok(r) => r,
            Err(ClientError::Returned(stream)) => return Err(Failed::Missing(log, stream)),
            Err(e) => return Err(Failed::Broker(log, e)),
        };
        // Moved by an adoption that was never committed: not held, and
        // completed, so that the stream stops carrying them.
        let mut void = Vec::new();
        let replayed = replay(client, &mut reader, &mut log, &self.given, &mut void).await;
        let held = match replayed {
            Ok(held) => held,
            Err(failure) => return Err(Failed::with_log(failure, Some(log))),
        };
        if !void.is_empty() {
            warn!(
                messages = void.len(),
                "not held: moved by an adoption of this id that was cut off half way (the adopted stream still has them), or given to another instance by a committed part of an adoption"
            );
        }
        void.into_iter().for_each(|id| self.completions.add(id));
        self.metrics.replica_rebuilt.inc_by(held as u64);
        info!(held, generation = g, "local store rebuilt from the stream");
        Ok(log)
    }
}

/// Replays a generation stream into `log`; how many messages it holds
/// then. Moved puts of an adoption never committed (but for those a
/// committed part of it names), and messages a part of an adoption of
/// this id gave away (`given`), go to `void` instead.
async fn replay(
    client: &Client,
    reader: &mut StreamReader,
    log: &mut Log,
    given: &HashSet<u64>,
    void: &mut Vec<u64>,
) -> Result<usize, Failure> {
    fn store(e: impl ToString) -> Failure {
        Failure::Store(e.to_string())
    }
    let mut fold = Fold::default();
    let mut locs = HashMap::new();
    let mut staged = 0;
    let mut commits = Commits::default();
    while let Some(record) = reader.next().await.map_err(Failure::Broker)? {
        for step in fold.apply(record) {
            let from = match &step {
                Step::Put(held) => fold.intent(held.id),
                Step::Drop(_) => None,
            };
            if let Step::Put(held) = &step {
                let counts = match from {
                    _ if given.contains(&held.id) => false,
                    Some(from) => {
                        (commits.counts(client, from, held.id).await).map_err(Failure::Broker)?
                    }
                    None => true,
                };
                if !counts {
                    void.push(held.id);
                    continue;
                }
            }
            apply(log, &mut locs, step).map_err(Failure::Store)?;
            staged += 1;
        }
        if staged >= REBUILD_BATCH {
            staged = 0;
            log.commit().map_err(store)?;
        }
    }
    log.commit().map_err(store)?;
    // Past what parts of adoptions gave away too: a compaction since may
    // have left their ids out of the stream, and a message of this id
    // under one of them would be left out as given.
    let past_given = given.iter().max().map_or(0, |id| id + 1);
    log.reserve_ids(fold.next_id().max(past_given))
        .map_err(store)?;
    Ok(locs.len())
}

/// Writes what `log` holds (`recovered`) to `stream`, with up to
/// `SEED_WINDOW` writes unconfirmed at once; how many it wrote.
async fn seed(
    client: &Client,
    stream: &str,
    log: &Log,
    recovered: &Recovered,
    given: &HashSet<u64>,
) -> Result<u64, ClientError> {
    let reader = log.reader();
    let mut window = std::collections::VecDeque::new();
    let mut seeded = 0;
    for (_, _, loc) in recovered.held.iter().filter(|(id, ..)| !given.contains(id)) {
        let Ok(held) = reader.read(*loc) else {
            continue;
        };
        window.push_back(client.append(stream, &Record::put(&held, true)).await?);
        if window.len() >= SEED_WINDOW {
            let oldest: Confirm = window.pop_front().expect("full");
            oldest.wait().await?;
        }
        seeded += 1;
    }
    for confirm in window {
        confirm.wait().await?;
    }
    Ok(seeded)
}

/// Applies one step of a rebuild to the log (locations are valid once
/// committed; a later put of the same id supersedes the earlier one).
fn apply(
    log: &mut Log,
    locs: &mut HashMap<u64, crate::store::Loc>,
    step: Step,
) -> Result<(), String> {
    match step {
        Step::Put(held) => {
            let replaces = locs.get(&held.id).copied();
            let loc = log.put(&held, replaces).map_err(|e| e.to_string())?;
            locs.insert(held.id, loc);
        }
        Step::Drop(id) => {
            if let Some(loc) = locs.remove(&id) {
                log.del(id, loc);
            }
        }
    }
    Ok(())
}

/// Why a sync attempt failed: the broker (try again, the store is back),
/// the generation stream is gone (wait for an operator), or the local
/// store (give up).
#[allow(clippy::large_enum_variant)] // moved once per message or state change: boxing buys nothing
enum Failed {
    Broker(Log, ClientError),
    Missing(Log, String),
    Store(String),
}

impl Failed {
    /// `failure`, with the log given back where it still is.
    fn with_log(failure: Failure, log: Option<Log>) -> Self {
        match (failure, log) {
            (Failure::Broker(e), Some(log)) => Failed::Broker(log, e),
            (Failure::Missing(stream), Some(log)) => Failed::Missing(log, stream),
            (Failure::Store(e), _) => Failed::Store(e),
            (failure, None) => Failed::Store(format!("the store was lost on {failure:?}")),
        }
    }

    /// What the sync makes of it, with the log (if it is still open).
    fn split(self) -> (Option<Log>, Outcome) {
        match self {
            Failed::Broker(log, e) => (Some(log), Outcome::Broker(e)),
            Failed::Missing(log, stream) => (Some(log), Outcome::Missing(stream)),
            Failed::Store(e) => (None, Outcome::Store(e)),
        }
    }
}

/// The log, handed to a step.
fn taken(log: &mut Option<Log>) -> Log {
    log.take()
        .expect("a step gives the log back unless the store failed")
}

/// A step's outcome, its log put back.
fn given_back(log: &mut Option<Log>, done: Result<(Log, Outcome), Failed>) -> Outcome {
    let (back, outcome) = match done {
        Ok((back, outcome)) => (Some(back), outcome),
        Err(failed) => failed.split(),
    };
    *log = back;
    outcome
}

fn forget_synced(dir: &std::path::Path) {
    let _ = std::fs::remove_file(dir.join("replica.state"));
}

/// Closes `log` and opens it again: what it holds, as recovery reads it.
#[allow(clippy::result_large_err)] // the error gives the log back to its owner
fn reopen(log: Log) -> Result<(Log, Recovered), Failed> {
    let (dir, options) = (log.dir().to_owned(), log.options());
    drop(log);
    Log::open(&dir, options).map_err(|e| Failed::Store(e.to_string()))
}

/// Deletes from `log` what parts of an adoption of this id gave away
/// (they are another instance's: this store never fires them again).
#[allow(clippy::result_large_err)] // the error gives the log back to its owner
fn drop_given(mut log: Log, recovered: &Recovered, given: &HashSet<u64>) -> Result<Log, Failed> {
    let mut dropped = 0;
    for (id, _, loc) in recovered.held.iter().filter(|(id, ..)| given.contains(id)) {
        log.del(*id, *loc);
        dropped += 1;
    }
    if dropped > 0 {
        warn!(
            dropped,
            "held messages given to another instance by a committed part of an adoption: dropped from the local store"
        );
        if let Err(e) = log.commit() {
            return Err(Failed::Store(e.to_string()));
        }
    }
    Ok(log)
}

/// Deletes every segment of `log` and opens it empty.
#[allow(clippy::result_large_err)] // the error gives the log back to its owner
fn wipe_log(log: Log) -> Result<Log, Failed> {
    let (dir, options) = (log.dir().to_owned(), log.options());
    drop(log);
    let wiped = (|| {
        for n in crate::store::segment_numbers(&dir)? {
            std::fs::remove_file(crate::store::segment_path(&dir, n))?;
        }
        std::fs::File::open(&dir)?.sync_all()
    })();
    wiped.map_err(|e| Failed::Store(e.to_string()))?;
    let (log, _) = Log::open(&dir, options).map_err(|e| Failed::Store(e.to_string()))?;
    Ok(log)
}

//! The sync: the local store made to agree with the stream once the lease
//! is held (kept, rebuilt from the stream, or seeded into a new
//! generation), and the wait for an operator's reseed when the stream is
//! gone.

use std::collections::HashMap;

use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{Command, Task, REBUILD_BATCH, RETRY, SEED_WINDOW};
use crate::replica::adopt::Commits;
use crate::replica::client::{ClientError, Confirm};
use crate::replica::local;
use crate::replica::record::{Fold, Record, Step};
use crate::replica::{Config, ReplicaError, ReseedReply, Reseeded, State, SyncOutcome};
use crate::store::{Log, Recovered};

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

    async fn try_sync(&mut self, log: Log) -> Result<SyncOutcome, Failed> {
        let dir = match self.directory().await {
            Ok(dir) => dir,
            Err(e) => return Err(Failed::Broker(log, e)),
        };
        let local = local::load(&self.config.store_dir);
        let instance = &self.config.instance;
        // A store left by an adoption under way holds parks that may never
        // count: rebuilt from the stream, where they count once committed.
        let adopting = local::adoption_under_way(&self.config.store_dir);
        let current = |g: u64| {
            !adopting
                && local.as_ref().is_some_and(|l| {
                    &l.instance == instance
                        && l.generation == g
                        && l.epoch == dir.epoch
                        && super::same_holder(l, &dir)
                })
        };
        let reseed = match (self.reseed.take(), &dir.adopted_by) {
            (Some(reply), Some(by)) => {
                let why = format!("nothing to reseed: this id's messages were adopted by {by}");
                let _ = reply.send(Err(ReplicaError(why)));
                None
            }
            (reseed, _) => reseed,
        };
        let (log, generation, rebuilt) = match (&dir.generation, &dir.adopted_by, reseed) {
            (g, None, Some(reply)) => {
                let next = g.map_or(1, |g| g + 1);
                match self.start_generation(log, next, false).await {
                    Ok((log, seeded)) => {
                        let stream = Config::generation(&self.config.instance, next);
                        info!(seeded, stream, "replica reseeded from the local store");
                        self.metrics.replica_missing.set(None);
                        self.reseeded = Some((reply, Reseeded { seeded, stream }));
                        (log, next, false)
                    }
                    Err(failed) => {
                        self.reseed = Some(reply); // tried again with the sync
                        return Err(failed);
                    }
                }
            }
            (Some(g), None, None) => {
                let stream = Config::generation(instance, *g);
                let client = self.client.as_ref().expect("held");
                match client.exists(&stream).await {
                    Ok(true) => {}
                    Ok(false) => return Err(Failed::Missing(log, stream)),
                    Err(e) => return Err(Failed::Broker(log, e)),
                }
                match current(*g) {
                    true => (log, *g, false),
                    false => (self.rebuild(log, *g).await?, *g, true),
                }
            }
            (g, adopted, _) => {
                let next = g.map_or(1, |g| g + 1);
                let wipe = adopted.is_some();
                (self.start_generation(log, next, wipe).await?.0, next, wipe)
            }
        };
        let epoch = match self.new_epoch(dir.epoch, generation).await {
            Ok(epoch) => epoch,
            Err(e) => return Err(Failed::Broker(log, e)),
        };
        let (log, recovered) = reopen(log)?;
        if !self.synced_once {
            // A new process: no adoption of its own is under way, and the
            // rebuild the markers asked for dropped the uncommitted parks.
            // A later sync (the lease came back) keeps them: the adoption
            // task may still be parking under an intent.
            local::end_adoptions_at_start(&self.config.store_dir);
            self.synced_once = true;
        }
        Ok(SyncOutcome {
            log,
            recovered,
            rebuilt,
            epoch,
        })
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
            false => log,
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
            let reader = log.reader();
            let mut window = std::collections::VecDeque::new();
            for (_, _, loc) in &recovered.held {
                let Ok(held) = reader.read(*loc) else {
                    continue;
                };
                let sent = client.append(&stream, &Record::put(&held, true)).await;
                match sent {
                    Ok(confirm) => window.push_back(confirm),
                    Err(e) => return Err(Failed::Broker(log, e)),
                }
                if window.len() >= SEED_WINDOW {
                    let oldest: Confirm = window.pop_front().expect("full");
                    if let Err(e) = oldest.wait().await {
                        return Err(Failed::Broker(log, e));
                    }
                }
                seeded += 1;
            }
            for confirm in window {
                if let Err(e) = confirm.wait().await {
                    return Err(Failed::Broker(log, e));
                }
            }
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
        let mut fold = Fold::default();
        let mut locs = HashMap::new();
        let mut staged = 0;
        let mut commits = Commits::default();
        // Moved by an adoption that was never committed: not held, and
        // completed, so that the stream stops carrying them.
        let mut void = Vec::new();
        loop {
            let record = match reader.next().await {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => return Err(Failed::Broker(log, e)),
            };
            for step in fold.apply(record) {
                let from = match &step {
                    Step::Put(held) => fold.intent(held.id),
                    Step::Drop(_) => None,
                };
                if let (Step::Put(held), Some(from)) = (&step, from) {
                    match commits.counts(client, from).await {
                        Ok(true) => {}
                        Ok(false) => {
                            void.push(held.id);
                            continue;
                        }
                        Err(e) => return Err(Failed::Broker(log, e)),
                    }
                }
                apply(&mut log, &mut locs, step).map_err(Failed::Store)?;
                staged += 1;
            }
            if staged >= REBUILD_BATCH {
                staged = 0;
                log.commit().map_err(|e| Failed::Store(e.to_string()))?;
            }
        }
        log.commit().map_err(|e| Failed::Store(e.to_string()))?;
        log.reserve_ids(fold.next_id())
            .map_err(|e| Failed::Store(e.to_string()))?;
        if !void.is_empty() {
            warn!(
                messages = void.len(),
                "moved by an adoption of this id that was cut off half way: not held (the adopted stream still has them)"
            );
        }
        void.into_iter().for_each(|id| self.completions.add(id));
        self.metrics.replica_rebuilt.inc_by(locs.len() as u64);
        info!(
            held = locs.len(),
            generation = g,
            "local store rebuilt from the stream"
        );
        Ok(log)
    }
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

//! The replica connection's life: connect (failing over between nodes),
//! register the id, take the lease (or wait as a standby), line the local
//! store up with the stream, then append held messages and completions
//! until the connection is lost, and start over.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use tokio::sync::{mpsc, oneshot, watch};
use tracing::{error, info, info_span, warn, Instrument};

use super::adopt::Adopt;
use super::client::{Client, ClientError};
use super::local::{self, Synced};
use super::record::{Fold, Record, Step, DONE_MAX};
use super::{Config, ReplicaError, State};
use crate::metrics::Metrics;
use crate::store::{Log, Recovered};

/// How often a standby asks for the lease, and a lost connection is retried.
const RETRY: Duration = Duration::from_secs(1);
/// Steps of a rebuild committed together.
const REBUILD_BATCH: usize = 512;

#[allow(clippy::large_enum_variant)] // moved once per message or state change: boxing buys nothing
pub(crate) enum Command {
    Sync {
        log: Log,
        reply: oneshot::Sender<Result<SyncOutcome, ReplicaError>>,
    },
    Append {
        record: Record,
        reply: oneshot::Sender<Result<(), ReplicaError>>,
    },
    Done(u64),
}

/// The local store after [`super::Replica::sync`].
pub struct SyncOutcome {
    /// The store, agreeing with the stream.
    pub log: Log,
    /// What it holds (as recovery reports it).
    pub recovered: Recovered,
    /// It was wiped and rebuilt from the stream.
    pub rebuilt: bool,
    /// The lease epoch now held.
    pub epoch: u64,
}

/// What the directory stream says.
#[derive(Debug, Default)]
struct Directory {
    generation: Option<u64>,
    epoch: u64,
    adopted_by: Option<String>,
}

struct Task {
    config: Config,
    state: watch::Sender<State>,
    metrics: Arc<Metrics>,
    /// The connection that holds the lease, once it does.
    client: Option<Client>,
    /// The generation stream appends go to, once synced.
    generation: Option<u64>,
    done: Vec<u64>,
    next_node: usize,
    /// The lease epoch held (with the generation, what replica.state says).
    epoch: u64,
    /// Bytes appended to the current generation since it began.
    appended: u64,
    /// A switch to a new generation in progress.
    compaction: Option<Compaction>,
}

/// A generation switch in progress: copies come from the copier; every new
/// record goes to both generations until it ends.
struct Compaction {
    next: u64,
    appended: u64,
    copies: mpsc::Receiver<super::compact::Copy>,
    finished: oneshot::Receiver<Result<u64, ClientError>>,
}

/// The replica task: serves the engine's commands on the replica
/// connection until the engine drops its sender.
pub(super) async fn run(
    config: Config,
    commands: mpsc::UnboundedReceiver<Command>,
    state: watch::Sender<State>,
    metrics: Arc<Metrics>,
    adopt: mpsc::Sender<Adopt>,
) {
    let span = info_span!("replica", instance = %config.instance);
    let task = Task::new(config, state, metrics);
    // Adoption runs beside the task, on its own connection: it waits on
    // the engine, which waits on this task for its appends. A spawned task
    // does not inherit a span: its own is made a child of the replica's.
    let adoption = super::adopt::run(task.config.clone(), task.state.subscribe(), adopt);
    tokio::spawn(adoption.instrument(info_span!(parent: &span, "adopt")));
    task.serve(commands).instrument(span).await
}

type Reply = oneshot::Sender<Result<(), ReplicaError>>;

/// Most puts in one stream message, and about their most bytes.
const BATCH_MAX: usize = 256;
const BATCH_BYTES: usize = 1 << 20;

/// The puts waiting behind `first` (up to a batch), and the first other
/// command met, to run after them.
fn gather_puts(
    first: Bytes,
    reply: Reply,
    commands: &mut mpsc::UnboundedReceiver<Command>,
) -> (Vec<(Bytes, Reply)>, Option<Command>) {
    let mut bytes = first.len();
    let mut batch = vec![(first, reply)];
    while batch.len() < BATCH_MAX && bytes < BATCH_BYTES {
        match commands.try_recv() {
            Ok(Command::Append {
                record:
                    Record::Put {
                        copy: false,
                        record,
                    },
                reply,
            }) => {
                bytes += record.len();
                batch.push((record, reply));
            }
            Ok(other) => return (batch, Some(other)),
            Err(_) => break,
        }
    }
    (batch, None)
}

impl Task {
    /// Not connected yet, no generation.
    fn new(config: Config, state: watch::Sender<State>, metrics: Arc<Metrics>) -> Self {
        Self {
            config,
            state,
            metrics,
            client: None,
            generation: None,
            done: Vec::new(),
            next_node: 0,
            epoch: 0,
            appended: 0,
            compaction: None,
        }
    }

    /// The task's loop: commands, the periodic flush of completions (and
    /// compaction check), the lease check, and compaction's progress; at
    /// the end, the last completions go out and the connection is closed.
    async fn serve(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        let mut flush = tokio::time::interval(self.config.done_every);
        let mut check = tokio::time::interval(RETRY);
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(command) => self.on_received(command, &mut commands).await,
                    None => break,
                },
                _ = flush.tick() => {
                    self.flush_done().await;
                    self.maybe_compact().await;
                }
                _ = check.tick() => self.keep_lease().await,
                event = compaction(&mut self.compaction) => match event {
                    Progress::Copy(copy) => self.append_copy(copy).await,
                    Progress::Finished(result) => self.end_compaction(result).await,
                },
            }
        }
        if let Some(client) = self.client.take() {
            self.flush_done().await;
            client.close().await;
        }
    }

    /// A command from the engine. Parks that came together go in one
    /// stream message.
    async fn on_received(
        &mut self,
        command: Command,
        commands: &mut mpsc::UnboundedReceiver<Command>,
    ) {
        match command {
            Command::Append {
                record:
                    Record::Put {
                        copy: false,
                        record,
                    },
                reply,
            } => {
                let (batch, next) = gather_puts(record, reply, commands);
                self.append_puts(batch).await;
                if let Some(command) = next {
                    self.on_command(command).await;
                }
            }
            command => self.on_command(command).await,
        }
    }

    fn set(&self, state: State) {
        self.state.send_if_modified(|s| {
            let changed = *s != state;
            *s = state;
            changed
        });
    }

    fn active(&self) -> bool {
        *self.state.borrow() == State::Active
    }

    async fn on_command(&mut self, command: Command) {
        match command {
            Command::Sync { log, reply } => {
                let _ = reply.send(self.sync(log).await);
            }
            Command::Append { record, reply } => self.append(record, reply).await,
            Command::Done(id) => {
                self.done.push(id);
                if self.done.len() >= DONE_MAX {
                    self.flush_done().await;
                }
            }
        }
    }

    /// The generation streams a new record goes to: the current one, and
    /// the next one while a switch is in progress.
    fn targets(&self) -> Vec<String> {
        let instance = &self.config.instance;
        let mut streams: Vec<String> = self
            .generation
            .iter()
            .map(|g| Config::generation(instance, *g))
            .collect();
        if let Some(c) = &self.compaction {
            streams.push(Config::generation(instance, c.next));
        }
        streams
    }

    /// Appends `record` to every target; `reply` gets the outcome once each
    /// confirmed it.
    async fn append(&mut self, record: Record, reply: oneshot::Sender<Result<(), ReplicaError>>) {
        self.append_for(record, vec![reply]).await
    }

    /// Appends a batch of new puts as one message.
    async fn append_puts(&mut self, batch: Vec<(Bytes, Reply)>) {
        let (records, replies): (Vec<Bytes>, Vec<Reply>) = batch.into_iter().unzip();
        let record = match records.len() {
            1 => Record::Put {
                copy: false,
                record: records.into_iter().next().expect("one"),
            },
            _ => Record::Puts(records),
        };
        self.append_for(record, replies).await
    }

    /// Appends `record` to every target; each of `replies` gets the
    /// outcome once each target confirmed it.
    async fn append_for(&mut self, record: Record, replies: Vec<Reply>) {
        let reply_all = |replies: Vec<Reply>, result: Result<(), ReplicaError>| {
            for reply in replies {
                let _ = reply.send(result.clone());
            }
        };
        let (Some(client), true) = (&self.client, self.active()) else {
            reply_all(replies, Err(ReplicaError("the lease is not held".into())));
            return;
        };
        let size = record.encode().len() as u64;
        let mut confirms = Vec::new();
        for stream in self.targets() {
            match client.append(&stream, &record).await {
                Ok(confirm) => confirms.push(confirm),
                Err(e) => {
                    reply_all(replies, Err(ReplicaError(e.to_string())));
                    return self.lost(&e.to_string());
                }
            }
        }
        self.appended += size;
        if let Some(c) = &mut self.compaction {
            c.appended += size;
        }
        tokio::spawn(async move {
            let mut result = Ok(());
            for confirm in confirms {
                result = result.and(match confirm.await {
                    Ok(c) if c.is_ack() => Ok(()),
                    Ok(_) => Err(ReplicaError("the broker nacked the write".into())),
                    Err(e) => Err(ReplicaError(e.to_string())),
                });
            }
            reply_all(replies, result);
        });
    }

    /// A copy from the copier, for the next generation only.
    async fn append_copy(&mut self, (record, reply): super::compact::Copy) {
        let active = self.active();
        let (Some(client), Some(c), true) = (&self.client, &mut self.compaction, active) else {
            let _ = reply.send(Err("the lease is not held".into()));
            return;
        };
        let stream = Config::generation(&self.config.instance, c.next);
        c.appended += record.encode().len() as u64;
        match client.append(&stream, &record).await {
            Ok(confirm) => {
                tokio::spawn(async move {
                    let result = match confirm.await {
                        Ok(c) if c.is_ack() => Ok(()),
                        Ok(_) => Err("the broker nacked the copy".to_string()),
                        Err(e) => Err(e.to_string()),
                    };
                    let _ = reply.send(result);
                });
            }
            Err(e) => {
                let _ = reply.send(Err(e.to_string()));
                self.lost(&e.to_string());
            }
        }
    }

    /// Starts a generation switch when the current one holds more than
    /// about twice the live bytes plus the configured slack.
    async fn maybe_compact(&mut self) {
        let (Some(client), Some(g), true) = (&self.client, self.generation, self.active()) else {
            return;
        };
        let live = self.metrics.store_live_bytes.get().max(0) as u64;
        if self.compaction.is_some() || self.appended <= 2 * live + self.config.generation_slack {
            return;
        }
        let next = g + 1;
        let stream = Config::generation(&self.config.instance, next);
        let fresh = async {
            client.delete(&stream).await?; // left by a switch that did not finish
            client.declare_stream(&stream).await
        };
        if let Err(e) = fresh.await {
            return warn!(error = %e, "cannot start a new replica generation; trying later");
        }
        let (copies_tx, copies) = mpsc::channel(1024);
        let (finish, finished) = oneshot::channel();
        let from = Config::generation(&self.config.instance, g);
        let target = self.config.target.clone();
        tokio::spawn(async move {
            let _ = finish.send(super::compact::copy_live(target, from, copies_tx).await);
        });
        info!(
            generation = g,
            next,
            appended = self.appended,
            live,
            "replica stream compaction: copying the live set to a new generation"
        );
        self.compaction = Some(Compaction {
            next,
            appended: 0,
            copies,
            finished,
        });
    }

    /// The copier is done: the directory names the new generation, and the
    /// old one goes.
    async fn end_compaction(&mut self, finished: Result<u64, ClientError>) {
        let Some(c) = self.compaction.take() else {
            return;
        };
        let copied = match finished {
            Ok(n) => n,
            Err(e) => return warn!(error = %e, "replica stream compaction failed; trying later"),
        };
        let (Some(client), Some(old), true) = (&self.client, self.generation, self.active()) else {
            return;
        };
        let directory = Config::directory(&self.config.instance);
        if let Err(e) = client
            .append_confirmed(&directory, &Record::Generation(c.next))
            .await
        {
            return self.lost(&e.to_string());
        }
        self.generation = Some(c.next);
        self.appended = c.appended;
        self.save_synced();
        let _ = client
            .delete(&Config::generation(&self.config.instance, old))
            .await;
        self.metrics.replica_generations.inc();
        info!(generation = c.next, copied, "replica stream compacted");
    }

    async fn flush_done(&mut self) {
        if self.done.is_empty() {
            return;
        }
        let (Some(client), true) = (&self.client, self.active()) else {
            return; // kept until the lease is held again
        };
        let ids = std::mem::take(&mut self.done);
        let record = Record::Done(ids.clone());
        let size = record.encode().len() as u64;
        for stream in self.targets() {
            if let Err(e) = client.append(&stream, &record).await {
                self.done = ids;
                return self.lost(&e.to_string());
            }
        }
        self.appended += size;
        if let Some(c) = &mut self.compaction {
            c.appended += size;
        }
    }

    fn lost(&mut self, why: &str) {
        if self.compaction.take().is_some() {
            warn!("replica stream compaction abandoned with the lease");
        }
        if self.client.take().is_some() {
            warn!(error = why, "replica connection lost: the lease is gone; not intercepting or firing until it is back");
        }
        if matches!(*self.state.borrow(), State::Active | State::Syncing) {
            self.set(State::Connecting);
        }
    }

    /// Once a second: notice a dead connection; reconnect and take the
    /// lease back if it was lost (a process holding it already synced).
    async fn keep_lease(&mut self) {
        if self.client.as_ref().is_some_and(|c| !c.alive()) {
            self.lost("the connection closed");
        }
        // Fencing: the broker frees the lease about two heartbeats after it
        // last heard from this process; this process stops acting after one
        // heartbeat without an answer, before anyone else can take over.
        if let Some(client) = &self.client {
            let lease = Config::lease(&self.config.instance);
            if !client.probe(&lease, self.config.target.heartbeat).await {
                self.lost("the broker did not answer within a heartbeat");
            }
        }
        if self.client.is_some() || self.generation.is_none() {
            return; // held, or never synced: `sync` takes it
        }
        if !self.acquire_once().await {
            return;
        }
        match self.check_current().await {
            Ok(true) => self.set(State::Active),
            Ok(false) => {
                warn!("another holder acted while the lease was lost: the local store is stale and must be rebuilt");
                self.set(State::Stale);
            }
            Err(e) => self.lost(&e.to_string()),
        }
    }

    /// One attempt at a connection and the lease.
    async fn acquire_once(&mut self) -> bool {
        let target = &self.config.target;
        let client = match Client::connect(target, self.next_node, &self.name()).await {
            Ok(c) => c,
            Err(e) => {
                self.set(State::Connecting);
                warn!(error = %e, "replica cannot connect");
                return false;
            }
        };
        self.next_node += 1;
        match client
            .try_lease(&Config::lease(&self.config.instance))
            .await
        {
            Ok(true) => {
                info!(node = client.node, "lease taken");
                self.client = Some(client);
                true
            }
            Ok(false) => {
                self.set(State::Standby);
                client.close().await;
                false
            }
            Err(e) => {
                warn!(error = %e, "replica cannot ask for the lease");
                client.close().await;
                false
            }
        }
    }

    fn name(&self) -> String {
        format!("nackd replica {}", self.config.instance)
    }

    /// Waits for the lease (as a standby while another process holds it).
    async fn acquire(&mut self) {
        self.register().await;
        while !self.acquire_once().await {
            tokio::time::sleep(RETRY).await;
        }
    }

    /// Adds this id to the registry, so that others can adopt it one day.
    async fn register(&mut self) {
        loop {
            let target = &self.config.target;
            match Client::connect(target, self.next_node, &self.name()).await {
                Ok(client) => {
                    let name = Record::Instance {
                        name: self.config.instance.clone(),
                    };
                    let registry = self.config.registry();
                    let done = client.declare_registry(&registry).await.is_ok()
                        && client.append_confirmed(&registry, &name).await.is_ok();
                    client.close().await;
                    if done {
                        return;
                    }
                }
                Err(e) => warn!(error = %e, "replica cannot connect"),
            }
            self.set(State::Connecting);
            tokio::time::sleep(RETRY).await;
        }
    }

    async fn directory(&self) -> Result<Directory, ClientError> {
        let client = self.client.as_ref().expect("held");
        let name = Config::directory(&self.config.instance);
        client.declare_stream(&name).await?;
        let mut dir = Directory::default();
        for record in client.read_all(&name).await? {
            match record {
                Record::Generation(n) => {
                    dir.generation = Some(n);
                    dir.adopted_by = None;
                }
                Record::Epoch { n, .. } => dir.epoch = dir.epoch.max(n),
                Record::Adopted { by } => dir.adopted_by = Some(by),
                _ => {}
            }
        }
        Ok(dir)
    }

    /// After the lease came back: is the local store still the last
    /// holder's? If so, a new epoch is written and it goes on.
    async fn check_current(&mut self) -> Result<bool, ClientError> {
        self.set(State::Syncing);
        let dir = self.directory().await?;
        let local = local::load(&self.config.store_dir);
        let current = dir.adopted_by.is_none()
            && dir.generation.is_some()
            && local.as_ref().is_some_and(|l| {
                l.instance == self.config.instance
                    && Some(l.generation) == dir.generation
                    && l.epoch == dir.epoch
            });
        if current {
            self.new_epoch(dir.epoch, dir.generation.expect("checked"))
                .await?;
        }
        Ok(current)
    }

    async fn new_epoch(&mut self, last: u64, generation: u64) -> Result<u64, ClientError> {
        let client = self.client.as_ref().expect("held");
        let epoch = last + 1;
        let holder = format!(
            "pid {} on {}",
            std::process::id(),
            crate::replica::hostname()
        );
        let directory = Config::directory(&self.config.instance);
        client
            .append_confirmed(&directory, &Record::Epoch { n: epoch, holder })
            .await?;
        self.epoch = epoch;
        self.generation = Some(generation);
        self.save_synced();
        info!(epoch, generation, "holding the lease");
        Ok(epoch)
    }

    fn save_synced(&self) {
        let synced = Synced {
            instance: self.config.instance.clone(),
            generation: self.generation.unwrap_or(0),
            epoch: self.epoch,
        };
        if let Err(e) = local::save(&self.config.store_dir, &synced) {
            error!(error = %e, "cannot save replica.state; a restart will rebuild from the stream");
        }
    }

    /// Takes the lease, then makes `log` agree with the stream. Broker
    /// failures are retried; a store that cannot be written is an error.
    async fn sync(&mut self, log: Log) -> Result<SyncOutcome, ReplicaError> {
        let mut log = log;
        loop {
            if self.client.is_none() {
                self.acquire().await;
            }
            self.set(State::Syncing);
            match self.try_sync(log).await {
                Ok(outcome) => {
                    self.set(State::Active);
                    return Ok(outcome);
                }
                Err(Failed::Broker(back, e)) => {
                    warn!(error = %e, "replica sync failed; trying again");
                    self.lost(&e.to_string());
                    log = back;
                    tokio::time::sleep(RETRY).await;
                }
                Err(Failed::Store(e)) => {
                    self.lost("the local store failed");
                    return Err(ReplicaError(format!("local store: {e}")));
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
        let current = |g: u64| {
            local.as_ref().is_some_and(|l| {
                &l.instance == instance && l.generation == g && l.epoch == dir.epoch
            })
        };
        let (log, generation, rebuilt) = match (&dir.generation, &dir.adopted_by) {
            (Some(g), None) if current(*g) => (log, *g, false),
            (Some(g), None) => (self.rebuild(log, *g).await?, *g, true),
            (g, adopted) => {
                let next = g.map_or(1, |g| g + 1);
                let wipe = adopted.is_some();
                (self.start_generation(log, next, wipe).await?, next, wipe)
            }
        };
        let epoch = match self.new_epoch(dir.epoch, generation).await {
            Ok(epoch) => epoch,
            Err(e) => return Err(Failed::Broker(log, e)),
        };
        let (log, recovered) = reopen(log)?;
        Ok(SyncOutcome {
            log,
            recovered,
            rebuilt,
            epoch,
        })
    }

    /// A new generation stream: empty when `wipe` (the held messages were
    /// adopted elsewhere), else seeded with what the local store holds.
    async fn start_generation(&mut self, log: Log, n: u64, wipe: bool) -> Result<Log, Failed> {
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
        if let Err(e) = client.declare_stream(&stream).await {
            return Err(Failed::Broker(log, e));
        }
        if !wipe {
            let reader = log.reader();
            let mut seeded = 0;
            for (_, _, loc) in &recovered.held {
                let Ok(held) = reader.read(*loc) else {
                    continue;
                };
                if let Err(e) = client
                    .append_confirmed(&stream, &Record::put(&held, true))
                    .await
                {
                    return Err(Failed::Broker(log, e));
                }
                seeded += 1;
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
        Ok(log)
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
            Err(e) => return Err(Failed::Broker(log, e)),
        };
        let mut fold = Fold::default();
        let mut locs = HashMap::new();
        let mut staged = 0;
        loop {
            let record = match reader.next().await {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => return Err(Failed::Broker(log, e)),
            };
            for step in fold.apply(record) {
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
        self.metrics.replica_rebuilt.inc_by(locs.len() as u64);
        info!(
            held = locs.len(),
            generation = g,
            "local store rebuilt from the stream"
        );
        Ok(log)
    }
}

/// What a compaction in progress has for the task.
enum Progress {
    Copy(super::compact::Copy),
    Finished(Result<u64, ClientError>),
}

async fn compaction(c: &mut Option<Compaction>) -> Progress {
    let Some(c) = c else {
        return std::future::pending().await;
    };
    tokio::select! {
        Some(copy) = c.copies.recv() => Progress::Copy(copy),
        finished = &mut c.finished => Progress::Finished(
            finished.unwrap_or_else(|_| Err(ClientError::Unreachable("the copier is gone".into()))),
        ),
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

/// Why a sync attempt failed: the broker (try again, the store is back)
/// or the local store (give up).
#[allow(clippy::large_enum_variant)] // moved once per message or state change: boxing buys nothing
enum Failed {
    Broker(Log, ClientError),
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

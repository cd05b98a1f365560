//! The replica connection's life: connect (failing over between nodes),
//! register the id, take the lease (or wait as a standby), line the local
//! store up with the stream, then append held messages and completions
//! until the connection is lost, and start over.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nackd_core::clock::Clock;

use tokio::sync::{mpsc, oneshot, watch};
use tracing::{error, info, info_span, warn, Instrument};

use super::adopt::Adopt;
use super::client::{Client, ClientError, Confirm, Probe};
use super::completions::Completions;
use super::fence::Fence;
use super::lease::{nodes_agree, Keeper, Kept, Lease};
use super::local::{self, Synced};
use super::record::{Intent, Record};
use super::{Config, ReplicaError, Reseeded, State};
use crate::metrics::Metrics;
use crate::store::{Log, Recovered};

mod sync;

/// How often a standby asks for the lease, and a lost connection is retried.
const RETRY: Duration = Duration::from_secs(1);
/// How often a process that refuses the lease (its `upstream.addresses`
/// differ from its id's) reads the directory again, and says why.
const REFUSED_AGAIN: Duration = Duration::from_secs(30);
/// Steps of a rebuild committed together.
const REBUILD_BATCH: usize = 512;
/// Seed records of a new generation in flight at most.
const SEED_WINDOW: usize = 512;
/// How long a stop waits for the broker to confirm the last completions.
const STOP_CONFIRMS: Duration = Duration::from_secs(2);

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
    /// An operator asks for a new generation seeded from the local store
    /// (the current one is missing).
    Reseed(super::ReseedReply),
}

/// What the broker said about writes whose confirms are awaited beside
/// the task.
enum Event {
    /// A record was returned: `stream` does not exist.
    Returned(String),
    /// A batch of completions was confirmed on every target, or not.
    Done { batch: u64, confirmed: bool },
}

/// What the directory and the local store say after the lease came back.
enum Current {
    /// The local store is the last holder's and its stream exists.
    Yes,
    /// The local store is the last holder's, but its stream is gone.
    Missing(String),
    /// Another holder acted in between.
    Stale,
}

impl Directory {
    /// Reads `instance`'s directory over `client` (declared if need be).
    async fn read(client: &Client, instance: &str) -> Result<Self, ClientError> {
        let name = Config::directory(instance);
        client.declare_stream(&name).await?;
        Ok(Self::fold(client.read_all(&name).await?))
    }

    /// What the directory's records say. Of two records of the same epoch
    /// the first counts: a second one was written by a process that had
    /// lost the lease by then (it read the directory before the other's).
    fn fold(records: impl IntoIterator<Item = Record>) -> Self {
        let mut dir = Directory::default();
        for record in records {
            match record {
                Record::Generation(n) => {
                    dir.generation = Some(n);
                    dir.adopted_by = None;
                }
                Record::Epoch { n, holder, nodes } if n > dir.epoch => {
                    (dir.epoch, dir.holder, dir.nodes) = (n, Some(holder), nodes);
                    dir.given_since_epoch = false;
                }
                Record::Adopted { by, .. } => {
                    // All of it: the store is wiped, nothing to leave out.
                    dir.adopted_by = Some(by);
                    (dir.given, dir.given_since_epoch) = (HashSet::new(), false);
                }
                Record::AdoptedPart { moved, .. } => {
                    dir.given.extend(moved.iter().map(|(theirs, _)| *theirs));
                    dir.given_since_epoch = true;
                }
                _ => {}
            }
        }
        dir
    }
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
    /// Who wrote the last record of the highest epoch.
    holder: Option<String>,
    /// The `upstream.addresses` that holder listed (none: an older
    /// version's record, or no holder yet).
    nodes: Option<Vec<String>>,
    adopted_by: Option<String>,
    /// Held messages that parts of adoptions committed: another
    /// instance's now, never this one's again.
    given: HashSet<u64>,
    /// A part was committed since the highest epoch: the local store may
    /// hold messages given away.
    given_since_epoch: bool,
}

struct Task {
    config: Config,
    state: watch::Sender<State>,
    metrics: Arc<Metrics>,
    /// The lease, while held (kept by a task of its own).
    lease: Option<Keeper>,
    /// The connection the stream writes go over (any node).
    client: Option<Client>,
    /// The generation stream appends go to, once synced.
    generation: Option<u64>,
    /// Completed ids until the broker confirmed them.
    completions: Completions,
    /// Confirms awaited beside the task report here.
    events_tx: mpsc::UnboundedSender<Event>,
    events: mpsc::UnboundedReceiver<Event>,
    /// A reseed asked for, until a sync writes the new generation.
    reseed: Option<super::ReseedReply>,
    /// A reseed written, answered once the sync is done.
    reseeded: Option<(super::ReseedReply, Reseeded)>,
    next_node: usize,
    /// The lease epoch held (with the generation, what replica.state says).
    epoch: u64,
    /// Who wrote it (this process).
    holder: Option<String>,
    /// A sync has ended in this process (markers of adoptions under way
    /// are cleared only at the first).
    synced_once: bool,
    /// What the directory said at the sync's start: messages parts of an
    /// adoption gave away, which no store of this id holds again.
    given: HashSet<u64>,
    /// Bytes appended to the current generation since it began.
    appended: u64,
    /// A switch to a new generation in progress.
    compaction: Option<Compaction>,
    /// Until when this process may act: extended by each answer of the
    /// broker to a lease probe, while active.
    fence: Arc<Fence>,
    /// nackd's clock: lease probes and the stop's deadline.
    clock: Clock,
    /// When the last lease probe (or acquisition) the broker answered was sent.
    heard: Option<Instant>,
    /// While this process refuses the lease (its `upstream.addresses`
    /// differ from those its id's last holder listed): when it last read
    /// the directory. It reads again after [`REFUSED_AGAIN`].
    refused_at: Option<Instant>,
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
    fence: Arc<Fence>,
    clock: Clock,
) {
    let span = info_span!("replica", instance = %config.instance);
    let task = Task::new(config, state, metrics, fence, clock);
    // Adoption runs beside the task, on its own connection: it waits on
    // the engine, which waits on this task for its appends. A spawned task
    // does not inherit a span: its own is made a child of the replica's.
    let adoption = super::adopt::run(
        task.config.clone(),
        task.state.subscribe(),
        adopt,
        task.metrics.clone(),
        task.clock.clone(),
    );
    tokio::spawn(adoption.instrument(info_span!(parent: &span, "adopt")));
    task.serve(commands).instrument(span).await
}

type Reply = oneshot::Sender<Result<(), ReplicaError>>;

/// Most puts in one stream message, and their most bytes (but for one
/// put alone, whatever its size: the broker took it from the client).
const BATCH_MAX: usize = 256;
const BATCH_BYTES: usize = 1 << 20;

/// A new put, or a put an adoption moved (which adoption): those of one
/// kind that come together go in one stream message.
fn new_put(record: &Record) -> Option<(Option<&Intent>, &Bytes)> {
    match record {
        Record::Put {
            copy: false,
            record,
        } => Some((None, record)),
        Record::Moved {
            copy: false,
            from,
            record,
        } => Some((Some(from), record)),
        _ => None,
    }
}

/// The puts of `first`'s kind waiting behind it (up to a batch), and the
/// first other command met, to run after them; `first` alone if it is
/// not a new or moved put.
fn gather_puts(
    first: Record,
    reply: Reply,
    commands: &mut mpsc::UnboundedReceiver<Command>,
) -> (Record, Vec<Reply>, Option<Command>) {
    let Some((from, record)) = new_put(&first) else {
        return (first, vec![reply], None);
    };
    let from = from.cloned();
    let mut bytes = record.len();
    let mut records = vec![record.clone()];
    let mut replies = vec![reply];
    let mut next = None;
    while records.len() < BATCH_MAX && bytes < BATCH_BYTES {
        match commands.try_recv() {
            Ok(Command::Append { record, reply }) => match new_put(&record) {
                // Not past the bytes: a batch may not grow past what the
                // broker takes in one message (a large put goes alone).
                Some((f, one)) if f == from.as_ref() && bytes + one.len() <= BATCH_BYTES => {
                    bytes += one.len();
                    records.push(one.clone());
                    replies.push(reply);
                }
                _ => {
                    next = Some(Command::Append { record, reply });
                    break;
                }
            },
            Ok(other) => {
                next = Some(other);
                break;
            }
            Err(_) => break,
        }
    }
    let record = match (records.len(), from) {
        (1, _) => first,
        (_, None) => Record::Puts(records),
        (_, Some(from)) => Record::MovedPuts { from, records },
    };
    (record, replies, next)
}

impl Task {
    /// Not connected yet, no generation.
    fn new(
        config: Config,
        state: watch::Sender<State>,
        metrics: Arc<Metrics>,
        fence: Arc<Fence>,
        clock: Clock,
    ) -> Self {
        let (events_tx, events) = mpsc::unbounded_channel();
        Self {
            fence,
            clock,
            heard: None,
            config,
            state,
            metrics,
            lease: None,
            client: None,
            generation: None,
            completions: Completions::default(),
            events_tx,
            events,
            reseed: None,
            reseeded: None,
            next_node: 0,
            epoch: 0,
            holder: None,
            synced_once: false,
            given: HashSet::new(),
            appended: 0,
            compaction: None,
            refused_at: None,
        }
    }

    /// The task's loop: commands, what the broker said about writes, the
    /// periodic flush of completions (and compaction check), the lease
    /// check, and compaction's progress; at the end, the last completions
    /// go out (and are confirmed, for a little while) and the connection
    /// is closed.
    async fn serve(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        let mut flush = tokio::time::interval(self.config.done_every);
        let mut check = tokio::time::interval(RETRY);
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(command) => self.on_received(command, &mut commands).await,
                    None => break,
                },
                Some(event) = self.events.recv() => self.on_event(event),
                _ = flush.tick() => {
                    self.flush_done().await;
                    self.maybe_compact().await;
                }
                _ = check.tick() => self.keep_lease().await,
                kept = next_kept(&mut self.lease) => self.on_kept(kept),
                event = compaction(&mut self.compaction) => match event {
                    Progress::Copy(copy) => self.append_copy(copy).await,
                    Progress::Finished(result) => self.end_compaction(result).await,
                },
            }
        }
        if self.client.is_some() {
            self.flush_done().await;
            let until = tokio::time::Instant::from_std(self.clock.now() + STOP_CONFIRMS);
            while self.completions.unconfirmed() > 0 {
                match tokio::time::timeout_at(until, self.events.recv()).await {
                    Ok(Some(event)) => self.on_event(event),
                    _ => break,
                }
            }
        }
        if let Some(client) = self.client.take() {
            client.close().await;
        }
        if let Some(lease) = self.lease.take() {
            lease.release().await;
        }
    }

    /// What the lease's keeper said.
    fn on_kept(&mut self, kept: Kept) {
        match kept {
            // The keeper extended the fence already, if active.
            Kept::Heard(asked) => self.heard = Some(asked),
            Kept::Lost => self.lost("fewer than a majority of the lease's registers are held"),
        }
    }

    /// A command from the engine. Parks that came together go in one
    /// stream message.
    async fn on_received(
        &mut self,
        command: Command,
        commands: &mut mpsc::UnboundedReceiver<Command>,
    ) {
        let mut command = command;
        // An append that ends a batch (a put of another kind) starts the
        // next one, in order; anything else runs after the batch.
        while let Command::Append { record, reply } = command {
            let (record, replies, next) = gather_puts(record, reply, commands);
            self.append_for(record, replies).await;
            match next {
                Some(next) => command = next,
                None => return,
            }
        }
        self.on_command(command, commands).await
    }

    fn set(&self, state: State) {
        // The state first: the lease's keeper reads it before extending
        // the fence, and a revocation after that read wins.
        // Held messages fire while the stream is missing (the lease is
        // held; nothing new is held, `writable` says so).
        let active = matches!(state, State::Active | State::Missing);
        self.state.send_if_modified(|s| {
            let changed = *s != state;
            *s = state;
            changed
        });
        // The fence follows the state: only an active holder acts. A sync
        // may have lasted several probes: the keeper's last one counts
        // (none while the lease settles: the keeper extends it then).
        let heard = self
            .lease
            .as_ref()
            .and_then(|k| k.heard().map(|h| (h, k.heartbeat())));
        match (active, heard) {
            (true, Some((asked, heartbeat))) => self.fence.extend(asked, heartbeat),
            _ => self.fence.revoke(),
        }
    }

    fn active(&self) -> bool {
        *self.state.borrow() == State::Active
    }

    /// Whether a record may go to the stream now: active, and within the
    /// fence. A holder that lost its lease (frozen past it, say) writes
    /// nothing more, even on a writes connection the broker kept open.
    fn writable(&self) -> bool {
        self.active() && self.fence.holds()
    }

    /// Why nothing is written now.
    fn inactive(&self) -> &'static str {
        match *self.state.borrow() {
            State::Missing | State::Reseeding => "the replica stream is missing",
            State::Active if self.client.is_none() => {
                "the replica's writes connection is being made again"
            }
            State::Active => "the lease was not confirmed in time",
            _ => "the lease is not held",
        }
    }

    async fn on_command(
        &mut self,
        command: Command,
        commands: &mut mpsc::UnboundedReceiver<Command>,
    ) {
        match command {
            Command::Sync { log, reply } => {
                let _ = reply.send(self.sync(log, commands).await);
            }
            Command::Append { record, reply } => self.append(record, reply).await,
            Command::Done(id) => {
                self.completions.add(id);
                if self.completions.full() {
                    self.flush_done().await;
                }
            }
            Command::Reseed(reply) => self.on_reseed(reply),
        }
    }

    /// What the broker said about writes awaited beside the task.
    fn on_event(&mut self, event: Event) {
        match event {
            Event::Returned(stream) => self.on_returned(&stream),
            Event::Done { batch, confirmed } => match confirmed {
                true => self.completions.confirmed(batch),
                false => self.completions.failed(batch),
            },
        }
    }

    /// The broker returned a record written to `stream`: it is gone.
    fn on_returned(&mut self, stream: &str) {
        self.metrics.replica_returns.inc();
        let instance = &self.config.instance;
        if self
            .generation
            .map(|g| Config::generation(instance, g))
            .as_deref()
            == Some(stream)
        {
            return self.missing(stream);
        }
        let next = self.compaction.as_ref().map(|c| c.next);
        if next.map(|n| Config::generation(instance, n)).as_deref() == Some(stream) {
            self.compaction = None;
            warn!(
                stream,
                "replica stream compaction abandoned: its new stream is gone"
            );
        }
    }

    /// The current generation stream is gone (someone deleted it): what
    /// the local store holds is held, and fires, but is not replicated any
    /// more, so nothing new is held until an operator reseeds.
    fn missing(&mut self, stream: &str) {
        self.stream_gone(
            stream,
            "the replica stream is missing (deleted?): nacks are deferred, not held, until `nackd admin replica reseed` writes a new stream from the local store; held messages still fire, but a lost host would lose them",
        )
    }

    /// The stream is gone, and says so once (with what to do).
    fn stream_gone(&mut self, stream: &str, what: &str) {
        if self.compaction.take().is_some() {
            warn!("replica stream compaction abandoned: the current stream is gone");
        }
        if matches!(*self.state.borrow(), State::Missing | State::Reseeding) {
            return;
        }
        self.metrics.replica_missing.set(Some(stream));
        error!(stream, "{what}");
        match self.reseed.is_some() {
            true => self.set(State::Reseeding),
            false => self.set(State::Missing),
        }
    }

    /// An operator asks for a reseed: only a missing stream is replaced;
    /// the engine hands its store back and [`Task::sync`] writes it.
    fn on_reseed(&mut self, reply: super::ReseedReply) {
        let state = self.state.borrow().clone();
        let refused = match state {
            // A reseed would write uncommitted adopted parks as plain puts.
            // (Markers left by an earlier process do not stop it: that
            // would wait for ever for a sync only a reseed allows.)
            State::Missing
                if self.synced_once && local::adoption_under_way(&self.config.store_dir) =>
            {
                Some(
                    "an adoption by this instance is under way: try again once it is committed or given up"
                        .to_string(),
                )
            }
            State::Missing => None,
            State::Active => Some(format!(
                "nothing to reseed: the replica stream {} exists",
                self.targets().first().cloned().unwrap_or_default()
            )),
            State::Reseeding => Some("a reseed is already under way".to_string()),
            other => Some(format!(
                "the replica is {other:?}, not missing its stream: nothing to reseed now"
            )),
        };
        if let Some(why) = refused {
            let _ = reply.send(Err(ReplicaError(why)));
            return;
        }
        info!("reseed asked for: the engine hands the local store back");
        self.reseed = Some(reply);
        self.set(State::Reseeding);
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

    /// Appends `record` to every target; each of `replies` gets the
    /// outcome once each target confirmed it.
    async fn append_for(&mut self, record: Record, replies: Vec<Reply>) {
        let reply_all = |replies: Vec<Reply>, result: Result<(), ReplicaError>| {
            for reply in replies {
                let _ = reply.send(result.clone());
            }
        };
        let (Some(client), true) = (&self.client, self.writable()) else {
            reply_all(replies, Err(ReplicaError(self.inactive().into())));
            return;
        };
        let size = record.encode().len() as u64;
        let mut confirms = Vec::new();
        for stream in self.targets() {
            match client.append(&stream, &record).await {
                Ok(confirm) => confirms.push(confirm),
                Err(e) => {
                    reply_all(replies, Err(ReplicaError(e.to_string())));
                    return self.writes_lost(&e.to_string());
                }
            }
        }
        self.appended += size;
        if let Some(c) = &mut self.compaction {
            c.appended += size;
        }
        let (events, fence) = (self.events_tx.clone(), self.fence.clone());
        tokio::spawn(async move {
            let result = confirmed(confirms, &events)
                .await
                .map_err(|e| ReplicaError(e.to_string()))
                // Confirmed after the lease lapsed: a successor may have
                // read the stream before it, so it is not surely there
                // for whoever holds the id now. Not held (deferred).
                .and_then(|()| match fence.holds() {
                    true => Ok(()),
                    false => Err(ReplicaError(
                        "the lease lapsed before the stream confirmed".into(),
                    )),
                });
            reply_all(replies, result);
        });
    }

    /// A copy from the copier, for the next generation only.
    async fn append_copy(&mut self, (record, reply): super::compact::Copy) {
        let writable = self.writable();
        let (Some(client), Some(c), true) = (&self.client, &mut self.compaction, writable) else {
            let _ = reply.send(Err(self.inactive().into()));
            return;
        };
        let stream = Config::generation(&self.config.instance, c.next);
        c.appended += record.encode().len() as u64;
        match client.append(&stream, &record).await {
            Ok(confirm) => {
                let events = self.events_tx.clone();
                tokio::spawn(async move {
                    let result = confirmed(vec![confirm], &events).await;
                    let _ = reply.send(result.map_err(|e| e.to_string()));
                });
            }
            Err(e) => {
                let _ = reply.send(Err(e.to_string()));
                self.writes_lost(&e.to_string());
            }
        }
    }

    /// Starts a generation switch when the current one holds more than
    /// about twice the live bytes plus the configured slack.
    async fn maybe_compact(&mut self) {
        let (Some(client), Some(g), true) = (&self.client, self.generation, self.writable()) else {
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
        let (Some(client), Some(old), true) = (&self.client, self.generation, self.writable())
        else {
            return;
        };
        let directory = Config::directory(&self.config.instance);
        if let Err(e) = client
            .append_confirmed(&directory, &Record::Generation(c.next))
            .await
        {
            return self.writes_lost(&e.to_string());
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

    /// Writes the completions waiting; each batch counts once every
    /// target confirmed it ([`Event::Done`]), else it is written again.
    async fn flush_done(&mut self) {
        if !self.writable() {
            return; // kept until the lease is held again
        }
        while let Some((batch, ids)) = self.completions.take() {
            let Some(client) = &self.client else {
                return self.completions.failed(batch);
            };
            let record = Record::Done(ids);
            let size = record.encode().len() as u64;
            let mut confirms = Vec::new();
            let mut failed = None;
            for stream in self.targets() {
                match client.append(&stream, &record).await {
                    Ok(confirm) => confirms.push(confirm),
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            if let Some(e) = failed {
                self.completions.failed(batch);
                return self.writes_lost(&e.to_string());
            }
            self.appended += size;
            if let Some(c) = &mut self.compaction {
                c.appended += size;
            }
            let events = self.events_tx.clone();
            tokio::spawn(async move {
                let confirmed = confirmed(confirms, &events).await.is_ok();
                let _ = events.send(Event::Done { batch, confirmed });
            });
        }
    }

    /// The lease is lost: nothing is written or fired until it is taken
    /// again and the directory says the local store is still current.
    fn lost(&mut self, why: &str) {
        self.heard = None;
        self.fence.revoke();
        // Dropping the keeper gives back what is left of the lease.
        let held = self.lease.take().is_some();
        if self.compaction.take().is_some() {
            warn!("replica stream compaction abandoned with the lease");
        }
        if self.client.take().is_some() || held {
            warn!(
                error = why,
                "the replica lease is gone; not intercepting or firing until it is back"
            );
        }
        // What the old connection did not confirm is written again on the next.
        self.completions.lost();
        let state = self.state.borrow().clone();
        if matches!(
            state,
            State::Active | State::Syncing | State::Missing | State::Reseeding
        ) {
            self.set(State::Connecting);
        }
    }

    /// The writes connection failed (its node froze or died, or someone
    /// closed it): the lease does not depend on it, so only the
    /// connection is made again, to another node, at the next check.
    /// Until then appends fail (their nacks are deferred, not lost).
    fn writes_lost(&mut self, why: &str) {
        if self.compaction.take().is_some() {
            warn!("replica stream compaction abandoned with its connection");
        }
        if self.client.take().is_some() {
            warn!(error = why, "replica writes connection lost; making it again on another node (the lease is kept)");
        }
        self.completions.lost();
        self.next_node += 1;
    }

    /// Once a second: notice a dead or silent writes connection and make
    /// it again; take the lease back if it was lost (a process holding it
    /// already synced).
    async fn keep_lease(&mut self) {
        if self.client.as_ref().is_some_and(|c| !c.alive()) {
            self.writes_lost("the connection closed");
        }
        // The same round trip checks that the stream still exists.
        if let Some(client) = &self.client {
            let stream = match self.active() {
                true => self.targets().into_iter().next(),
                false => None,
            };
            let within = self.config.target.answer_within();
            match client.probe(stream.as_deref(), within).await {
                Probe::Alive => {}
                Probe::Missing => self.missing(stream.as_deref().unwrap_or_default()),
                Probe::Silent => self.writes_lost("the broker did not answer within a heartbeat"),
            }
        }
        if self.generation.is_none() {
            return; // never synced: `sync` takes the lease
        }
        if self.lease.is_some() {
            if self.client.is_none() {
                self.reconnect_writes().await;
            }
            return;
        }
        if self.still_refused().await || !self.acquire_once().await {
            return;
        }
        match self.check_current().await {
            Ok(Current::Yes) => self.set(State::Active),
            Ok(Current::Missing(stream)) => self.missing(&stream),
            Ok(Current::Stale) => {
                warn!("another holder acted while the lease was lost: the local store is stale and must be rebuilt");
                self.set(State::Stale);
            }
            Err(e) => self.lost(&e.to_string()),
        }
    }

    /// The lease is held, the writes connection is not: connect again and
    /// check that the stream is still there before anything is written.
    async fn reconnect_writes(&mut self) {
        let target = &self.config.target;
        let client = match Client::connect(target, self.next_node, &self.name()).await {
            Ok(c) => c,
            Err(e) => return warn!(error = %e, "replica cannot connect"),
        };
        let stream = self.targets().into_iter().next();
        match client
            .probe(stream.as_deref(), target.answer_within())
            .await
        {
            Probe::Alive => {
                info!(node = client.node, "replica writes connection made again");
                self.client = Some(client);
            }
            Probe::Missing => {
                self.client = Some(client);
                self.missing(stream.as_deref().unwrap_or_default());
            }
            Probe::Silent => {
                self.next_node += 1;
                client.close().await;
            }
        }
    }

    /// Takes this instance's lease and keeps it, once it settled.
    async fn take_lease(&mut self) -> bool {
        let target = &self.config.target;
        let asked = self.clock.now();
        let lease = Config::lease(&self.config.instance);
        let connection = format!("nackd lease {}", self.config.instance);
        match Lease::take(target, &lease, &connection).await {
            Ok(Some(lease)) => {
                info!(
                    registers = lease.held(),
                    of = target.nodes.len(),
                    "lease taken"
                );
                self.heard = Some(asked);
                let every = (target.heartbeat / 2).min(RETRY);
                let (fence, state) = (self.fence.clone(), self.state.subscribe());
                let keeper = Keeper::spawn(lease, asked, self.clock.clone(), every, fence, state);
                // Nothing is done under a lease before it settled (1.5
                // heartbeats: see `Keeper::spawn`) and a majority
                // answered after that.
                if !settled(&keeper, target.heartbeat * 4).await {
                    warn!("the lease was taken but not confirmed; giving it back");
                    return false;
                }
                self.lease = Some(keeper);
                true
            }
            Ok(None) => {
                self.set(State::Standby);
                false
            }
            Err(e) => {
                self.set(State::Connecting);
                warn!(error = %e, "replica cannot ask for the lease");
                false
            }
        }
    }

    /// One attempt at the lease and a writes connection. A lease just
    /// taken is given back if the directory says that its last holder
    /// listed other nodes ([`Task::judge`]): read under the lease, that
    /// record is the last one.
    async fn acquire_once(&mut self) -> bool {
        let taken = self.lease.is_none();
        if taken && !self.take_lease().await {
            return false;
        }
        let target = &self.config.target;
        if self.client.is_none() {
            match Client::connect(target, self.next_node, &self.name()).await {
                Ok(c) => self.client = Some(c),
                Err(e) => {
                    // The lease goes back: held without a way to write,
                    // it would keep a standby or an adopter out for ever.
                    warn!(error = %e, "replica cannot connect; giving the lease back");
                    self.lease = None;
                    return false;
                }
            }
            self.next_node += 1;
        }
        if taken {
            match self.directory().await {
                Ok(dir) if self.judge(&dir) => {}
                Ok(_) => {
                    self.lease = None;
                    return false;
                }
                Err(e) => {
                    warn!(error = %e, "replica cannot read its directory; giving the lease back");
                    self.lease = None;
                    return false;
                }
            }
        }
        true
    }

    fn name(&self) -> String {
        format!("nackd replica {}", self.config.instance)
    }

    /// Waits for the lease (as a standby while another process holds it,
    /// or while this one refuses it).
    async fn acquire(&mut self) {
        self.register().await;
        // Before contending: so a process started with other nodes says
        // so at once, even while another holds the lease.
        if !self.synced_once {
            self.look().await;
        }
        while self.still_refused().await || !self.acquire_once().await {
            // Jittered: standbys that each took a minority of the
            // registers gave them back, and must not meet again in step.
            let jitter = Duration::from_millis(fastrand::u64(..500));
            tokio::time::sleep(RETRY + jitter).await;
        }
    }

    /// Whether this process refuses the lease: read again once
    /// [`REFUSED_AGAIN`] passed since the last reading, else as it was.
    async fn still_refused(&mut self) -> bool {
        let Some(at) = self.refused_at else {
            return false;
        };
        if self.clock.now() >= at + REFUSED_AGAIN {
            self.look().await;
        }
        self.refused_at.is_some()
    }

    /// Reads the directory on a connection of its own (no lease is needed
    /// to read it) and judges its nodes. One that cannot be read changes
    /// nothing: a process that agreed goes on to the lease, whose reading
    /// decides; one that refused goes on refusing, and looks again later.
    async fn look(&mut self) {
        if let Some(at) = &mut self.refused_at {
            *at = self.clock.now();
        }
        let target = &self.config.target;
        let client = match Client::connect(target, self.next_node, &self.name()).await {
            Ok(c) => c,
            Err(e) => return warn!(error = %e, "replica cannot connect"),
        };
        let read = Directory::read(&client, &self.config.instance).await;
        client.close().await;
        match read {
            Ok(dir) => {
                self.judge(&dir);
            }
            Err(e) => warn!(error = %e, "replica cannot read its directory"),
        }
    }

    /// Whether this process may hold its id's lease by the nodes the last
    /// holder listed (`dir`): register `k` is named by its place in
    /// `upstream.addresses`, so two processes of one id with different
    /// lists could each hold a majority. While they differ it refuses.
    fn judge(&mut self, dir: &Directory) -> bool {
        let config = &self.config;
        let Some(recorded) = dir
            .nodes
            .as_ref()
            .filter(|r| !nodes_agree(r, &config.target.nodes, &config.previous_nodes))
        else {
            if self.refused_at.take().is_some() {
                info!("upstream.addresses agree with this instance id's last holder's again: taking part in the lease");
                self.metrics.replica_refused.set(0);
                self.set(State::Connecting);
            }
            return true;
        };
        // The gauge first: whoever reads the log line finds it set.
        self.metrics.replica_refused.set(1);
        error!(
            "upstream.addresses differ from this instance id's last holder's: this process lists [{}], {} (epoch {}) listed [{}]; not taking the lease: every process of an id must list the same nodes in the same order (to change them, see replica.previous_addresses)",
            config.target.nodes.join(", "),
            dir.holder.as_deref().unwrap_or("the holder"),
            dir.epoch,
            recorded.join(", "),
        );
        self.refused_at = Some(self.clock.now());
        self.set(State::Refused);
        false
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
        Directory::read(client, &self.config.instance).await
    }

    /// After the lease came back: is the local store still the last
    /// holder's? If so, a new epoch is written and it goes on (unless its
    /// stream is gone meanwhile).
    async fn check_current(&mut self) -> Result<Current, ClientError> {
        self.set(State::Syncing);
        let dir = self.directory().await?;
        let local = local::load(&self.config.store_dir);
        let current = dir.adopted_by.is_none()
            && !dir.given_since_epoch
            && dir.generation.is_some()
            && local.as_ref().is_some_and(|l| {
                l.instance == self.config.instance
                    && Some(l.generation) == dir.generation
                    && l.epoch == dir.epoch
                    && same_holder(l, &dir)
            });
        if !current {
            return Ok(Current::Stale);
        }
        let g = dir.generation.expect("checked");
        let stream = Config::generation(&self.config.instance, g);
        let exists = self.client.as_ref().expect("held").exists(&stream).await?;
        self.new_epoch(dir.epoch, g).await?;
        Ok(match exists {
            true => Current::Yes,
            false => Current::Missing(stream),
        })
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
            .append_confirmed(
                &directory,
                &Record::Epoch {
                    n: epoch,
                    holder: holder.clone(),
                    nodes: Some(self.config.target.nodes.clone()),
                },
            )
            .await?;
        self.holder = Some(holder);
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
            holder: self.holder.clone(),
        };
        if let Err(e) = local::save(&self.config.store_dir, &synced) {
            error!(error = %e, "cannot save replica.state; a restart will rebuild from the stream");
        }
    }
}

/// Whether the local store's epoch is the directory's by the same holder
/// (a file of an earlier release names none: its epoch number decides).
fn same_holder(local: &Synced, dir: &Directory) -> bool {
    local.holder.is_none() || local.holder == dir.holder
}

/// Whether a majority answered `keeper` after its lease settled, within
/// `limit` (a timer: no clock read) and before the keeper ended.
async fn settled(keeper: &Keeper, limit: Duration) -> bool {
    let heard = async {
        while keeper.heard().is_none() && !keeper.is_finished() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(limit, heard).await.is_ok() && keeper.heard().is_some()
}

/// The next news of the lease; never while none is held.
async fn next_kept(lease: &mut Option<Keeper>) -> Kept {
    match lease {
        Some(keeper) => keeper.next().await,
        None => std::future::pending().await,
    }
}

/// Waits for every confirm; the first failure, if any. A returned record
/// is reported to the task too: its stream is gone.
async fn confirmed(
    confirms: Vec<Confirm>,
    events: &mpsc::UnboundedSender<Event>,
) -> Result<(), ClientError> {
    let mut result = Ok(());
    for confirm in confirms {
        let outcome = confirm.wait().await;
        if let Err(ClientError::Returned(stream)) = &outcome {
            let _ = events.send(Event::Returned(stream.clone()));
        }
        result = result.and(outcome);
    }
    result
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

#[cfg(test)]
mod directory_tests {
    use super::*;

    fn epoch(n: u64, holder: &str) -> Record {
        Record::Epoch {
            n,
            holder: holder.into(),
            nodes: None,
        }
    }

    /// Issue 36: what parts of adoptions gave away stays given (a rebuild
    /// leaves it out whenever it comes); a new epoch of this id's own
    /// says its store was made without it since.
    #[test]
    fn parts_given_away_stay_given_and_a_new_epoch_clears_the_flag() {
        let part = |epoch: u64, moved: Vec<(u64, u64)>| Record::AdoptedPart {
            by: "b".into(),
            epoch,
            moved,
        };
        let dir = Directory::fold([
            Record::Generation(1),
            epoch(1, "pid 1"),
            Record::Adopting {
                by: "b".into(),
                epoch: 1,
            },
            part(1, vec![(10, 100), (11, 101)]),
        ]);
        assert!(dir.given_since_epoch);
        assert_eq!(dir.given, HashSet::from([10, 11]));
        assert_eq!(dir.adopted_by, None, "a part is not the whole adoption");
        let dir = Directory::fold([
            Record::Generation(1),
            epoch(1, "pid 1"),
            part(1, vec![(10, 100)]),
            epoch(2, "pid 2"),
            epoch(1, "late"),
            Record::Generation(2),
        ]);
        assert!(!dir.given_since_epoch);
        assert_eq!(dir.given, HashSet::from([10]));
    }

    /// Review of issue 21, item 3: H lost the lease during a long sync, S
    /// took it and wrote epoch 2, then H wrote epoch 2 too. S's store is
    /// the current one; H's, with the same epoch number, is not.
    #[test]
    fn a_second_record_of_one_epoch_does_not_make_its_writer_current() {
        let dir = Directory::fold([
            Record::Generation(1),
            epoch(1, "pid 1 on h"),
            epoch(2, "pid 2 on s"),
            epoch(2, "pid 1 on h"),
        ]);
        assert_eq!((dir.epoch, dir.holder.as_deref()), (2, Some("pid 2 on s")));
        let synced = |holder: &str| Synced {
            instance: "i".into(),
            generation: 1,
            epoch: 2,
            holder: Some(holder.into()),
        };
        assert!(same_holder(&synced("pid 2 on s"), &dir));
        assert!(!same_holder(&synced("pid 1 on h"), &dir));
        // A replica.state of an earlier release names no holder.
        let old = Synced {
            holder: None,
            ..synced("x")
        };
        assert!(same_holder(&old, &dir));
    }

    fn nodes(list: &[&str]) -> Vec<String> {
        list.iter().map(|n| n.to_string()).collect()
    }

    /// Issue 36: the nodes that count are the first record's of the
    /// highest epoch (the holder's), and a later epoch of an older
    /// version, which records none, leaves none to compare.
    #[test]
    fn the_recorded_nodes_are_the_last_holders() {
        let with = |n: u64, holder: &str, list: &[&str]| Record::Epoch {
            n,
            holder: holder.into(),
            nodes: Some(nodes(list)),
        };
        let dir = Directory::fold([
            with(1, "a", &["n1:1", "n2:1"]),
            with(2, "b", &["n1:1", "n2:1", "n3:1"]),
            with(2, "late", &["x:1"]),
        ]);
        assert_eq!(dir.nodes, Some(nodes(&["n1:1", "n2:1", "n3:1"])));
        let dir = Directory::fold([with(1, "a", &["n1:1"]), epoch(2, "old")]);
        assert_eq!(dir.nodes, None);
        assert_eq!(Directory::fold([Record::Generation(1)]).nodes, None);
    }

    #[test]
    fn nodes_agree_in_the_same_order_or_as_the_previous_list() {
        let ours = nodes(&["n1:1", "n2:1", "n3:1"]);
        assert!(nodes_agree(&ours, &ours, &[]));
        assert!(!nodes_agree(&nodes(&["n1:1", "n3:1", "n2:1"]), &ours, &[]));
        assert!(!nodes_agree(&nodes(&["n1:1", "n2:1"]), &ours, &[]));
        let old = nodes(&["n1:1", "n2:1"]);
        assert!(nodes_agree(&old, &ours, &old));
        assert!(!nodes_agree(&nodes(&["n9:1"]), &ours, &old));
    }
}

#[cfg(test)]
mod batch_tests {
    use super::*;
    use crate::replica::record::tests::{held, intent};

    fn append(record: Record, tx: &mpsc::UnboundedSender<Command>) {
        let (reply, _) = oneshot::channel();
        tx.send(Command::Append { record, reply }).unwrap();
    }

    /// What a stream message holds: a kind and its ids.
    fn ids(record: &Record) -> (&'static str, Vec<u64>) {
        let kind = match record {
            Record::Put { .. } => "put",
            Record::Puts(_) => "puts",
            Record::Moved { .. } => "moved",
            Record::MovedPuts { .. } => "moved puts",
            _ => "other",
        };
        let ids = record
            .clone()
            .flatten()
            .iter()
            .filter_map(|r| r.as_put().and_then(|(_, b)| Record::held(b)).map(|h| h.id))
            .collect();
        (kind, ids)
    }

    /// Issue 36: an adoption's moved puts that come together go in one
    /// stream message, as new puts do; a batch holds one kind (new, or
    /// moved by one intent), in order, and ends at the first other, which
    /// starts the next (as `on_received` runs them).
    #[test]
    fn puts_that_come_together_go_in_one_message_of_one_kind() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (a1, a2) = (intent("a", 1), intent("a", 2));
        for id in 2..=4 {
            append(Record::moved(&held(id), a1.clone()), &tx);
        }
        append(Record::moved(&held(5), a2.clone()), &tx);
        append(Record::put(&held(6), false), &tx);
        append(Record::put(&held(7), false), &tx);
        tx.send(Command::Done(7)).unwrap();
        append(Record::put(&held(8), true), &tx);

        let mut messages = Vec::new();
        let first = Record::moved(&held(1), a1.clone());
        let (reply, _) = oneshot::channel();
        let (mut record, mut replies, mut next) = gather_puts(first, reply, &mut rx);
        loop {
            messages.push((ids(&record), replies.len()));
            match next {
                Some(Command::Append { record: r, reply }) if new_put(&r).is_some() => {
                    (record, replies, next) = gather_puts(r, reply, &mut rx);
                }
                _ => break,
            }
        }
        assert_eq!(
            messages,
            vec![
                (("moved puts", vec![1, 2, 3, 4]), 4),
                (("moved", vec![5]), 1),
                (("puts", vec![6, 7]), 2),
            ]
        );
        assert!(
            matches!(next, Some(Command::Done(7))),
            "the completion is kept, in order"
        );
        match rx.try_recv() {
            Ok(Command::Append { record, .. }) => assert_eq!(ids(&record), ("put", vec![8])),
            _ => panic!("the compaction copy is left for the next command"),
        }
    }

    /// Review of issue 36: a batch never grows past `BATCH_BYTES` (what
    /// the broker takes in one message); a put that would take it past
    /// starts the next one, and a put larger than that goes alone.
    #[test]
    fn a_batch_stops_before_the_put_that_would_make_it_too_large() {
        let sized = |id, bytes: usize| {
            let mut h = held(id);
            h.body = Bytes::from(vec![7u8; bytes]);
            Record::put(&h, false)
        };
        let (tx, mut rx) = mpsc::unbounded_channel();
        append(sized(2, BATCH_BYTES / 2), &tx);
        append(sized(3, BATCH_BYTES), &tx);
        append(sized(4, 10), &tx);
        let (reply, _) = oneshot::channel();
        let (record, replies, next) = gather_puts(sized(1, BATCH_BYTES / 3), reply, &mut rx);
        assert_eq!((ids(&record), replies.len()), (("puts", vec![1, 2]), 2));
        assert!(
            record.encode().len() <= BATCH_BYTES + 64,
            "{}",
            record.encode().len()
        );
        let Some(Command::Append { record, reply }) = next else {
            panic!("the large put is next");
        };
        let (record, replies, next) = gather_puts(record, reply, &mut rx);
        assert_eq!((ids(&record), replies.len()), (("put", vec![3]), 1));
        assert!(next.is_none(), "a full batch takes nothing more");
        match rx.try_recv() {
            Ok(Command::Append { record, .. }) => assert_eq!(ids(&record), ("put", vec![4])),
            _ => panic!("the small put waits for the next batch"),
        }
    }
}

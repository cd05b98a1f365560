//! Adoption: an instance whose lease stays free for `adopt_after` (its
//! host is gone, or it was scaled away) has its held messages taken over
//! by one live instance, which parks each under its own id with the same
//! due time and retry count, then marks the old directory adopted and
//! deletes the old generation stream.
//!
//! Exactly one instance adopts: it must first take the other's lease (a
//! majority of its registers, [`super::lease`]), which no two connections
//! can hold at once. The
//! other instance, should it come back during the adoption, waits for that
//! lease like any standby, then finds the directory adopted and discards
//! its local copy.
//!
//! An adoption is one step (see [`super::record`]): the adopter writes its
//! intent (`Adopting`, a new epoch) to the adopted directory before it
//! parks anything; each park is a moved put naming the intent; the
//! adopted messages are held but do not fire; `Adopted` with the same
//! epoch commits them all at once, and only then are they scheduled. An
//! adopter killed half way has fired none of them, and its parks never
//! count (a rebuild or an adoption of its stream drops them): the next
//! adopter takes every message from the adopted stream again. An intent
//! whose adopter is alive is left to it (it resumes where it stopped).
//!
//! The steps of one attempt are the states of [`phase::Attempt`]: a
//! transition function without I/O (each transition is unit-tested), and
//! `Adopter::adopt`, which does the I/O of each state.
//!
//! An instance whose generation stream is gone (deleted by someone) cannot
//! be adopted: that is logged as an error once, counted in
//! `nackd_replica_unadoptable`, and its lease is given back, so that it can
//! come back with its store and reseed.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use nackd_core::clock::Clock;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{error, info, warn};

use super::client::{Client, ClientError};
use super::lease::{self, Lease};
use super::record::{Fold, Intent, Record, Step};
use super::{local, Config, State};
use crate::metrics::Metrics;
use crate::store::Held;
use phase::{Attempt, Effect, Outcome, Phase};

mod phase;

/// What an adoption asks of the retry engine.
#[allow(clippy::large_enum_variant)] // moved once per message or state change: boxing buys nothing
pub enum Adopt {
    /// Park this message (another instance's) under a new id of ours,
    /// in the local store and our stream; answer with the new id.
    /// Held, not scheduled: it fires after [`Adopt::Release`].
    Park {
        /// The message, as the other instance held it.
        held: Held,
        /// The adoption it comes with (written with it to our stream).
        from: Intent,
        /// The new id once durable on both.
        reply: oneshot::Sender<Result<u64, String>>,
    },
    /// Complete a message parked by [`Adopt::Park`] (its owner had
    /// completed it after all: its completion came later in the stream;
    /// or its adoption can no longer be committed).
    Complete(u64),
    /// Schedule these messages parked by [`Adopt::Park`]: their adoption
    /// is committed.
    Release(Vec<u64>),
}

/// Looks at the other instances every `adopt_after / 4` (1 to 15 s)
/// while this one is active, on a connection of its own.
pub(super) async fn run(
    config: Config,
    state: watch::Receiver<State>,
    engine: mpsc::Sender<Adopt>,
    metrics: std::sync::Arc<Metrics>,
    clock: Clock,
) {
    let every = (config.adopt_after / 4).clamp(Duration::from_secs(1), Duration::from_secs(15));
    let mut tick = tokio::time::interval(every);
    let mut watch = Watch::new(clock, state.clone(), metrics.clone());
    let mut client: Option<Client> = None;
    let name = format!("nackd adoption {}", config.instance);
    loop {
        tick.tick().await;
        if engine.is_closed() {
            return;
        }
        if *state.borrow() != State::Active {
            continue;
        }
        if client.as_ref().is_none_or(|c| !c.alive()) {
            client = Client::connect(&config.target, fastrand::usize(..), &name)
                .await
                .ok();
        }
        let Some(c) = &client else { continue };
        if let Err(e) = watch.round(c, &config, &engine).await {
            warn!(error = %e, "adoption check failed; trying again later");
            client = None;
        }
        metrics
            .replica_unadoptable
            .set(watch.unadoptable.len() as i64);
    }
}

/// How an adoption attempt ended.
#[derive(Debug)]
enum Adoption {
    /// Nothing is left to adopt.
    Done,
    /// Another instance adopts it, or it came back.
    Busy,
    /// A live adopter's intent (this epoch) is open: left to it to finish.
    Left(u64),
    /// Its generation stream is gone: its messages cannot be adopted.
    Missing(String),
    /// Its last holder listed these nodes, not this process's: its lease
    /// is not the one this process takes (registers are named by them).
    OtherNodes(Vec<String>),
}

/// Which other instances' leases have been free, and since when.
pub(super) struct Watch {
    clock: Clock,
    free_since: HashMap<String, Instant>,
    settled: HashSet<String>,
    /// Messages parked so far by an adoption that failed part way, not
    /// committed: a retry under the same intent skips them.
    progress: HashMap<String, Progress>,
    /// Every instance name seen in the registry (its records age out).
    known: std::collections::BTreeSet<String>,
    /// Registrations of each name at the last read: an instance registers
    /// each time it takes its lease, so a new one means it came back.
    registrations: HashMap<String, usize>,
    /// When the registry was last read, and this instance last registered.
    read_at: Option<Instant>,
    registered_at: Option<Instant>,
    /// Instances whose lease is free but whose generation stream is gone.
    unadoptable: HashSet<String>,
    /// Open intents of live adopters, and since when this one saw them.
    left: HashMap<String, (u64, Instant)>,
    /// Where this instance's replica stands: a commit needs it active.
    state: watch::Receiver<State>,
    metrics: std::sync::Arc<Metrics>,
}

/// An adoption's parks, until committed: the epoch of its intent, and the
/// messages parked so far (their id there → ours).
#[derive(Debug, Default)]
struct Progress {
    epoch: Option<u64>,
    ours: HashMap<u64, u64>,
}

impl Watch {
    fn new(clock: Clock, state: watch::Receiver<State>, metrics: std::sync::Arc<Metrics>) -> Self {
        let mut state = state;
        state.mark_unchanged();
        Self {
            left: HashMap::new(),
            state,
            metrics,
            clock,
            free_since: HashMap::new(),
            settled: HashSet::new(),
            progress: HashMap::new(),
            known: Default::default(),
            registrations: HashMap::new(),
            read_at: None,
            registered_at: None,
            unadoptable: HashSet::new(),
        }
    }

    /// How long ago `t` was, on the clock.
    fn since(&self, t: Instant) -> Duration {
        self.clock.now().saturating_duration_since(t)
    }

    /// Looks at every registered instance; adopts those free long enough.
    pub(super) async fn round(
        &mut self,
        client: &Client,
        config: &Config,
        engine: &mpsc::Sender<Adopt>,
    ) -> Result<(), ClientError> {
        if self.state.has_changed().unwrap_or(true) {
            // The lease was lost since (the store may have been rebuilt,
            // the engine started again): parks not committed yet go, those
            // of a commit whose answer was lost are scheduled.
            self.state.borrow_and_update();
            for (name, progress) in std::mem::take(&mut self.progress) {
                if let Some(kept) = settle(client, engine, config, &name, progress).await {
                    self.progress.insert(name, kept);
                }
            }
        }
        let registry = config.registry();
        if self
            .read_at
            .is_none_or(|t| self.since(t) >= config.adopt_after / 2)
        {
            // Each read appends a marker: read every half adopt_after.
            self.read_registry(client, &registry).await?;
        }
        if self
            .registered_at
            .is_none_or(|t| self.since(t) >= Duration::from_secs(86_400))
        {
            let me = Record::Instance {
                name: config.instance.clone(),
            };
            client.append_confirmed(&registry, &me).await?;
            self.registered_at = Some(self.clock.now());
        }
        for name in self.known.clone() {
            if name != config.instance {
                self.look_at(client, config, engine, &name).await?;
            }
        }
        Ok(())
    }

    /// Learns the instances of the registry, and which registered again.
    async fn read_registry(&mut self, client: &Client, registry: &str) -> Result<(), ClientError> {
        for (name, count) in registered(client, registry).await? {
            let before = self.registrations.insert(name.clone(), count);
            if before.is_some_and(|b| b != count) {
                // It started again since: adopted once, it may hold
                // messages again (a change from retention costs one
                // look at its directory).
                self.settled.remove(&name);
            }
            self.known.insert(name);
        }
        self.read_at = Some(self.clock.now());
        Ok(())
    }

    /// Another instance: free since `adopt_after` (and not adopted yet),
    /// its held messages are adopted.
    async fn look_at(
        &mut self,
        client: &Client,
        config: &Config,
        engine: &mpsc::Sender<Adopt>,
        name: &str,
    ) -> Result<(), ClientError> {
        let nodes = config.target.nodes.len();
        if Lease::is_held(client, &Config::lease(name), nodes).await? {
            self.alive(client, config, engine, name).await;
            return Ok(());
        }
        if self.settled.contains(name) {
            return Ok(());
        }
        let now = self.clock.now();
        let since = *self.free_since.entry(name.to_owned()).or_insert(now);
        if now.saturating_duration_since(since) < config.adopt_after {
            return Ok(());
        }
        // A live adopter that has not finished its intent within
        // adopt_after (it lost its lease, or it cannot write): taken over.
        // Safe either way: it commits only under the lease, and only an
        // intent that is still the open one.
        let overdue = self
            .left
            .get(name)
            .filter(|(_, since)| now.saturating_duration_since(*since) >= config.adopt_after)
            .map(|(epoch, _)| *epoch);
        let progress = self.progress.entry(name.to_owned()).or_default();
        let me = Adopter {
            client,
            config,
            engine,
            state: &self.state,
            metrics: &self.metrics,
            clock: &self.clock,
        };
        let adoption = me.adopt(name, progress, overdue).await?;
        self.ended(config, engine, name, adoption, now).await;
        Ok(())
    }

    /// Alive (again): once it is gone again it is adopted again.
    async fn alive(
        &mut self,
        client: &Client,
        config: &Config,
        engine: &mpsc::Sender<Adopt>,
        name: &str,
    ) {
        self.free_since.remove(name);
        self.settled.remove(name);
        self.unadoptable.remove(name);
        if let Some(progress) = self.progress.remove(name) {
            // It came back (or another adopter started): our parks
            // can no longer be committed, unless they were already.
            if let Some(kept) = settle(client, engine, config, name, progress).await {
                self.progress.insert(name.to_owned(), kept);
            }
        }
    }

    /// What an attempt at `name` (made at `now`) leaves for next rounds.
    async fn ended(
        &mut self,
        config: &Config,
        engine: &mpsc::Sender<Adopt>,
        name: &str,
        adoption: Adoption,
        now: Instant,
    ) {
        match adoption {
            Adoption::Left(epoch) => {
                if self.left.get(name).is_none_or(|(e, _)| *e != epoch) {
                    self.left.insert(name.to_owned(), (epoch, now));
                }
                return; // looked at again next round, still free
            }
            Adoption::Done => {
                self.settled.insert(name.to_owned());
                if let Some(progress) = self.progress.remove(name) {
                    abandon(engine, config, name, progress).await;
                }
            }
            Adoption::Busy => {}
            Adoption::OtherNodes(recorded) => {
                error!(
                    from = name,
                    "cannot adopt: the instance's last lease holder listed upstream.addresses [{}], this process lists [{}]; every process of a group must list the same nodes in the same order (or name the other list as replica.previous_addresses during a change)",
                    recorded.join(", "),
                    config.target.nodes.join(", "),
                );
                // Looked at again once it registers again (it came back).
                self.settled.insert(name.to_owned());
                self.unadoptable.insert(name.to_owned());
                if let Some(progress) = self.progress.remove(name) {
                    abandon(engine, config, name, progress).await;
                }
            }
            Adoption::Missing(stream) => {
                error!(
                    from = name,
                    stream,
                    "cannot adopt: the instance's replica stream is missing (deleted?), so its held messages are not in the cluster; if its store still exists, start it on that store and run `nackd admin replica reseed` there, else they are lost"
                );
                // Looked at again once it registers again (it came back).
                self.settled.insert(name.to_owned());
                self.unadoptable.insert(name.to_owned());
                if let Some(progress) = self.progress.remove(name) {
                    abandon(engine, config, name, progress).await;
                }
            }
        }
        self.free_since.remove(name);
        self.left.remove(name);
    }
}

/// Instance ids in the registry, with how many times each registered.
async fn registered(
    client: &Client,
    registry: &str,
) -> Result<HashMap<String, usize>, ClientError> {
    client.declare_registry(registry).await?;
    let mut names: HashMap<String, usize> = HashMap::new();
    for record in client.read_all(registry).await? {
        if let Record::Instance { name } = record {
            *names.entry(name).or_default() += 1;
        }
    }
    Ok(names)
}

/// What an adoption works with.
struct Adopter<'a> {
    client: &'a Client,
    config: &'a Config,
    engine: &'a mpsc::Sender<Adopt>,
    state: &'a watch::Receiver<State>,
    metrics: &'a Metrics,
    clock: &'a Clock,
}

/// What another instance's directory says about adoptions.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Directory {
    /// The generation stream that holds its messages.
    generation: Option<u64>,
    /// Every message was adopted (since that generation).
    adopted: bool,
    /// An intent not committed yet, and not given up (the instance did
    /// not come back since): its adopter, and its epoch.
    open: Option<(String, u64)>,
    /// The highest intent epoch written: a new intent takes the next.
    last_intent: u64,
    /// The epochs of committed intents.
    committed: HashSet<u64>,
    /// The highest lease epoch of the instance itself.
    holder_epoch: u64,
    /// The `upstream.addresses` its holder listed (none from older
    /// versions): its lease's registers are named by them.
    nodes: Option<Vec<String>>,
    /// Those nodes, when they are not this adopter's (nor its
    /// `replica.previous_addresses`): set by the adopter, not the fold.
    other_nodes: Option<Vec<String>>,
}

impl Directory {
    /// The directory of `name`; `None` if it has none.
    async fn read(client: &Client, name: &str) -> Result<Option<Self>, ClientError> {
        let directory = Config::directory(name);
        if !client.exists(&directory).await? {
            return Ok(None);
        }
        Ok(Some(Self::fold(client.read_all(&directory).await?)))
    }

    fn fold(records: Vec<Record>) -> Self {
        let mut dir = Self::default();
        for record in records {
            match record {
                Record::Generation(n) => {
                    (dir.generation, dir.adopted, dir.open) = (Some(n), false, None);
                }
                // The instance took its lease again: it holds its messages.
                Record::Epoch { n, nodes, .. } => {
                    dir.open = None;
                    // The first record of the highest epoch is its holder's.
                    if n > dir.holder_epoch {
                        (dir.holder_epoch, dir.nodes) = (n, nodes);
                    }
                }
                Record::Adopting { by, epoch } => {
                    dir.last_intent = dir.last_intent.max(epoch);
                    dir.open = Some((by, epoch));
                }
                Record::Adopted { epoch, .. } => {
                    dir.adopted = true;
                    dir.open = None;
                    dir.committed.extend(epoch);
                }
                _ => {}
            }
        }
        dir
    }
}

/// Whether moved puts count: their adoption committed, as the adopted
/// instance's directory says (read once per intent).
#[derive(Default)]
pub(super) struct Commits {
    known: HashMap<Intent, bool>,
}

impl Commits {
    /// Whether a put moved by `from` counts. A directory that is gone
    /// counts as committed: nobody can adopt that instance any more, so
    /// this is the one copy left.
    pub(super) async fn counts(
        &mut self,
        client: &Client,
        from: &Intent,
    ) -> Result<bool, ClientError> {
        if let Some(known) = self.known.get(from) {
            return Ok(*known);
        }
        let counts = Directory::read(client, &from.from)
            .await?
            .is_none_or(|d| d.committed.contains(&from.epoch));
        if !counts {
            info!(
                from = from.from,
                epoch = from.epoch,
                "moved messages of an adoption that was never committed: not held"
            );
        }
        self.known.insert(from.clone(), counts);
        Ok(counts)
    }
}

/// An adoption cut off whose commit may or may not have landed (its
/// answer lost): the adopted directory says. Committed: its parks are
/// scheduled. Not: they are completed. Unreadable: kept (returned), for
/// the next round; never completed on a guess, since a commit that landed
/// leaves the adopted stream unread by anyone else.
async fn settle(
    client: &Client,
    engine: &mpsc::Sender<Adopt>,
    config: &Config,
    from: &str,
    progress: Progress,
) -> Option<Progress> {
    let Some(epoch) = progress.epoch else {
        abandon(engine, config, from, progress).await;
        return None;
    };
    match Directory::read(client, from).await {
        // No directory: nobody can adopt it any more (as `Commits` says).
        Ok(dir) if dir.as_ref().is_none_or(|d| d.committed.contains(&epoch)) => {
            schedule(engine, config, from, epoch, progress).await;
            None
        }
        Ok(_) => {
            abandon(engine, config, from, progress).await;
            None
        }
        Err(e) => {
            warn!(from, error = %e, "cannot tell whether an adoption committed; asking again next round");
            Some(progress)
        }
    }
}

/// The intent `epoch` is committed: its parks fire from now on.
async fn schedule(
    engine: &mpsc::Sender<Adopt>,
    config: &Config,
    from: &str,
    epoch: u64,
    progress: Progress,
) {
    let ids: Vec<u64> = progress.ours.into_values().collect();
    info!(
        from,
        epoch,
        messages = ids.len(),
        "adoption committed: its messages are scheduled"
    );
    let _ = engine.send(Adopt::Release(ids)).await;
    local::end_adoption(&config.store_dir, from);
}

/// Gives the adopted instance's lease back, if it is held.
async fn give_back(lease: &mut Option<Lease>) {
    if let Some(lease) = lease.take() {
        lease.release().await;
    }
}

/// Completes what an adoption that can no longer be committed parked.
async fn abandon(engine: &mpsc::Sender<Adopt>, config: &Config, from: &str, progress: Progress) {
    local::end_adoption(&config.store_dir, from);
    if progress.ours.is_empty() {
        return;
    }
    warn!(
        from,
        epoch = progress.epoch,
        parked = progress.ours.len(),
        "an adoption cut off half way cannot be committed: its parks are dropped (the adopted stream still has them)"
    );
    for id in progress.ours.into_values() {
        let _ = engine.send(Adopt::Complete(id)).await;
    }
}

impl Adopter<'_> {
    /// Adopts `name`'s held messages, in one step: intent, parks, commit.
    /// `overdue`: the epoch of a live adopter's intent left open too long.
    /// The steps and their order are [`Attempt`]'s; this does their I/O.
    async fn adopt(
        &self,
        name: &str,
        progress: &mut Progress,
        overdue: Option<u64>,
    ) -> Result<Adoption, ClientError> {
        let mut attempt = Attempt::new(name, &self.config.instance, progress.epoch, overdue);
        // Dropped on an error exit: given back all the same.
        let mut lease: Option<Lease> = None;
        loop {
            let outcome = self
                .perform(attempt.phase(), name, progress, &mut lease)
                .await
                .unwrap_or_else(Outcome::Failed);
            for effect in attempt.on(outcome) {
                self.apply(effect, name, progress, &mut lease).await;
            }
            if let Some(exit) = attempt.exit() {
                return exit;
            }
        }
    }

    /// The I/O `phase` names, and what it found.
    async fn perform(
        &self,
        phase: &Phase,
        name: &str,
        progress: &mut Progress,
        lease: &mut Option<Lease>,
    ) -> Result<Outcome, ClientError> {
        let (client, target) = (self.client, &self.config.target);
        Ok(match phase {
            Phase::Leasing => {
                let connection = format!("nackd adoption {} of {name}", self.config.instance);
                *lease = Lease::take(target, &Config::lease(name), &connection).await?;
                Outcome::Lease(lease.is_some())
            }
            Phase::Reading => {
                let mut dir = Directory::read(client, name).await?.unwrap_or_default();
                dir.other_nodes = dir.nodes.clone().filter(|recorded| {
                    !lease::nodes_agree(recorded, &target.nodes, &self.config.previous_nodes)
                });
                Outcome::Directory(dir)
            }
            Phase::AskingAdopter { by, .. } => {
                let nodes = target.nodes.len();
                Outcome::AdopterAlive(Lease::is_held(client, &Config::lease(by), nodes).await?)
            }
            Phase::CheckingStream { g, .. } => {
                Outcome::StreamExists(client.exists(&Config::generation(name, *g)).await?)
            }
            Phase::Intending { epoch, new, .. } => {
                self.intend(name, *epoch, *new, progress).await?;
                Outcome::IntentWritten
            }
            Phase::Parking { g, epoch } => self.park(name, *g, *epoch, progress).await?,
            Phase::Confirming { .. } => Outcome::Active(
                // Changed at all: the lease was lost meanwhile, and the
                // store may have been rebuilt without these parks.
                !self.state.has_changed().unwrap_or(true) && *self.state.borrow() == State::Active,
            ),
            Phase::Probing { .. } => {
                let held = match lease.as_mut() {
                    Some(lease) => lease.probe(|| {}).await,
                    None => 0,
                };
                Outcome::Majority(held >= lease::majority(target.nodes.len()))
            }
            Phase::Committing { epoch, .. } => {
                let commit = Record::Adopted {
                    by: self.config.instance.clone(),
                    epoch: Some(*epoch),
                };
                client
                    .append_confirmed(&Config::directory(name), &commit)
                    .await?;
                Outcome::Committed
            }
            Phase::Finishing { generation, .. } => {
                if let Some(g) = generation {
                    client.delete(&Config::generation(name, *g)).await?;
                }
                give_back(lease).await;
                Outcome::Finished
            }
            Phase::Ended => unreachable!("an ended attempt is not driven"),
        })
    }

    /// Marks the adoption in the local store (again, when resumed: a sync
    /// since may have cleared it), then writes a new intent.
    async fn intend(
        &self,
        name: &str,
        epoch: u64,
        new: bool,
        progress: &Progress,
    ) -> Result<(), ClientError> {
        if !new {
            info!(
                from = name,
                epoch,
                parked = progress.ours.len(),
                "resuming an adoption cut off half way, under the same intent"
            );
        }
        local::begin_adoption(&self.config.store_dir, name)
            .map_err(|e| ClientError::Unreachable(format!("local store: {e}")))?;
        if new {
            let intent = Record::Adopting {
                by: self.config.instance.clone(),
                epoch,
            };
            self.client
                .append_confirmed(&Config::directory(name), &intent)
                .await?;
        }
        Ok(())
    }

    /// Applies what a transition asked for.
    async fn apply(
        &self,
        effect: Effect,
        name: &str,
        progress: &mut Progress,
        lease: &mut Option<Lease>,
    ) {
        let (engine, config) = (self.engine, self.config);
        match effect {
            Effect::Schedule(epoch) => {
                schedule(engine, config, name, epoch, std::mem::take(progress)).await;
            }
            Effect::Abandon => abandon(engine, config, name, std::mem::take(progress)).await,
            Effect::Intend(epoch) => progress.epoch = Some(epoch),
            Effect::GiveBackLease => give_back(lease).await,
        }
    }

    /// Parks generation `g` under intent `epoch`, skipping what was parked.
    async fn park(
        &self,
        name: &str,
        g: u64,
        epoch: u64,
        progress: &mut Progress,
    ) -> Result<Outcome, ClientError> {
        let from = Intent {
            from: name.to_owned(),
            epoch,
        };
        let began = self.clock.now();
        match self.take_over(g, from, &mut progress.ours).await {
            Ok(count) => {
                let took = self.clock.now().saturating_duration_since(began);
                info!(from = name, epoch, messages = count, took = ?took, "parked the held messages of an adoption");
                Ok(Outcome::Parked(count))
            }
            Err(ClientError::Returned(stream)) => Ok(Outcome::StreamReturned(stream)),
            Err(e) => Err(e),
        }
    }

    /// Parks every message of the adopted generation `g` under our own
    /// ids, as moved by `from`, skipping those `ours` has already.
    ///
    /// The parks are pipelined: up to [`PARKS_IN_FLIGHT`] messages (and
    /// [`BYTES_IN_FLIGHT`]) wait for their answers at once, so that the
    /// engine writes them to the store in batches and the stream's
    /// confirms come back together (one at a time, 3 000 took 3 to 12 s).
    /// The answers are taken in order, so `ours` ends as it would one by
    /// one; and every park sent is answered before this returns, on an
    /// error too: a park left out of `ours` could never be completed, and
    /// would count once this intent is committed.
    async fn take_over(
        &self,
        g: u64,
        from: Intent,
        ours: &mut HashMap<u64, u64>,
    ) -> Result<usize, ClientError> {
        let mut parks = InFlight::new(ours, &from.from, self.metrics);
        let read = self.read_and_park(g, &from, &mut parks).await;
        let answered = parks.drain(self.engine).await;
        read.and(answered)?;
        Ok(ours.len())
    }

    /// [`Adopter::take_over`]'s reading: each put is sent to the engine,
    /// each completion applied, the answers taken as they come.
    async fn read_and_park(
        &self,
        g: u64,
        from: &Intent,
        parks: &mut InFlight<'_>,
    ) -> Result<(), ClientError> {
        let mut reader = self.client.read(&Config::generation(&from.from, g)).await?;
        let mut fold = Fold::default();
        let mut commits = Commits::default();
        let already: HashSet<u64> = parks.ours.keys().copied().collect();
        let engine = self.engine;
        while let Some(record) = reader.next().await? {
            for step in fold.apply(record) {
                match step {
                    Step::Put(held) if already.contains(&held.id) => {}
                    Step::Put(held) => {
                        if let Some(theirs) = fold.intent(held.id) {
                            // Parked by an adoption of its own: only if committed.
                            if !commits.counts(self.client, theirs).await? {
                                continue;
                            }
                        }
                        parks.send(engine, held, from).await?;
                    }
                    Step::Drop(theirs) => parks.drop(engine, theirs).await,
                }
            }
        }
        Ok(())
    }
}

/// Parks of one adoption sent to the engine and not answered yet, at most.
const PARKS_IN_FLIGHT: usize = 1024;
/// Bytes of messages (header and body) of those parks, at most: each is
/// in memory about twice meanwhile (the store's queue and the stream's
/// record). One park goes whatever its size.
const BYTES_IN_FLIGHT: usize = 32 << 20;

/// The engine's answer to one park: our id for it, or why not.
type Answer = oneshot::Receiver<Result<u64, String>>;

fn engine_gone() -> ClientError {
    ClientError::Unreachable("the retry engine is gone".into())
}

/// A park sent and not answered yet.
struct Waiting {
    /// Its number among the parks sent.
    n: u64,
    theirs: u64,
    bytes: usize,
    answer: Answer,
}

/// The parks an adoption has sent and not seen answered, in order, and
/// what the answers go into (see [`Adopter::take_over`]).
struct InFlight<'a> {
    /// Their id → ours, for every park answered.
    ours: &'a mut HashMap<u64, u64>,
    /// The adopted instance, for the logs.
    from: &'a str,
    metrics: &'a Metrics,
    waiting: std::collections::VecDeque<Waiting>,
    /// Parks sent so far (numbers them).
    sent: u64,
    /// Bytes of the waiting parks.
    bytes: usize,
    /// Parks waiting, by their id.
    by_id: HashMap<u64, usize>,
    /// Their ids completed in the stream while parks of them waited: the
    /// parks up to this number are completed when answered.
    dropped: HashMap<u64, u64>,
    /// Parks that failed: the first is logged, and ends the reading.
    failed: usize,
}

impl<'a> InFlight<'a> {
    fn new(ours: &'a mut HashMap<u64, u64>, from: &'a str, metrics: &'a Metrics) -> Self {
        Self {
            ours,
            from,
            metrics,
            waiting: Default::default(),
            sent: 0,
            bytes: 0,
            by_id: HashMap::new(),
            dropped: HashMap::new(),
            failed: 0,
        }
    }

    /// Sends a park of `held` (theirs), once the window has room; takes
    /// the answers that came meanwhile first, so that a failure stops the
    /// sending at once.
    async fn send(
        &mut self,
        engine: &mpsc::Sender<Adopt>,
        held: Held,
        from: &Intent,
    ) -> Result<(), ClientError> {
        self.take_ready(engine).await?;
        let bytes = held.header.len() + held.body.len();
        while !self.waiting.is_empty()
            && (self.waiting.len() >= PARKS_IN_FLIGHT || self.bytes + bytes > BYTES_IN_FLIGHT)
        {
            self.answer_one(engine).await?;
        }
        let theirs = held.id;
        let (reply, answer) = oneshot::channel();
        let park = Adopt::Park {
            held,
            from: from.clone(),
            reply,
        };
        engine.send(park).await.map_err(|_| engine_gone())?;
        self.sent += 1;
        self.bytes += bytes;
        *self.by_id.entry(theirs).or_default() += 1;
        self.waiting.push_back(Waiting {
            n: self.sent,
            theirs,
            bytes,
            answer,
        });
        Ok(())
    }

    /// Their message `theirs` was completed in the stream after its put:
    /// our copy goes, now if answered, else once it is.
    async fn drop(&mut self, engine: &mpsc::Sender<Adopt>, theirs: u64) {
        if let Some(id) = self.ours.remove(&theirs) {
            let _ = engine.send(Adopt::Complete(id)).await;
        }
        if self.by_id.contains_key(&theirs) {
            self.dropped.insert(theirs, self.sent);
        }
    }

    /// Takes the answers at the head that have come, without waiting.
    async fn take_ready(&mut self, engine: &mpsc::Sender<Adopt>) -> Result<(), ClientError> {
        while let Some(head) = self.waiting.front_mut() {
            let answer = match head.answer.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => return Ok(()),
                Err(oneshot::error::TryRecvError::Closed) => None,
                Ok(answer) => Some(answer),
            };
            self.answered(engine, answer).await?;
        }
        Ok(())
    }

    /// Waits for the oldest answer, and takes it.
    async fn answer_one(&mut self, engine: &mpsc::Sender<Adopt>) -> Result<(), ClientError> {
        let Some(head) = self.waiting.front_mut() else {
            return Ok(());
        };
        let answer = (&mut head.answer).await.ok();
        self.answered(engine, answer).await
    }

    /// The head's answer (`None`: the engine dropped it, being gone).
    async fn answered(
        &mut self,
        engine: &mpsc::Sender<Adopt>,
        answer: Option<Result<u64, String>>,
    ) -> Result<(), ClientError> {
        let head = self.waiting.pop_front().expect("a park waits");
        self.bytes -= head.bytes;
        let dropped = self
            .dropped
            .get(&head.theirs)
            .is_some_and(|upto| head.n <= *upto);
        if let Some(left) = self.by_id.get_mut(&head.theirs) {
            *left -= 1;
            if *left == 0 {
                self.by_id.remove(&head.theirs);
                self.dropped.remove(&head.theirs);
            }
        }
        let id = match answer {
            None => return Err(engine_gone()),
            Some(Ok(id)) => id,
            Some(Err(e)) => {
                if self.failed == 0 {
                    warn!(
                        from = self.from,
                        error = e,
                        "cannot park an adopted message"
                    );
                }
                self.failed += 1;
                return Err(ClientError::Unreachable(e));
            }
        };
        self.metrics.replica_adopted.inc();
        if dropped {
            // Completed in the stream after this put: not held.
            let _ = engine.send(Adopt::Complete(id)).await;
        } else if let Some(older) = self.ours.insert(head.theirs, id) {
            // A later put of the same message: the newer copy wins.
            let _ = engine.send(Adopt::Complete(older)).await;
        }
        Ok(())
    }

    /// Takes every answer still to come (after an error too: see
    /// [`Adopter::take_over`]); the first error, if any.
    async fn drain(&mut self, engine: &mpsc::Sender<Adopt>) -> Result<(), ClientError> {
        let mut first = Ok(());
        while !self.waiting.is_empty() {
            let answered = self.answer_one(engine).await;
            if first.is_ok() {
                first = answered;
            }
        }
        if self.failed > 1 {
            warn!(
                from = self.from,
                failed = self.failed,
                "parks of an adopted message failed; the adoption is tried again"
            );
        }
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a fake engine saw.
    struct Seen {
        /// Each park's their id, in order: the k-th (from 0) got our id
        /// 1000 + k.
        parks: Vec<u64>,
        completed: Vec<u64>,
        /// The most parks, and bytes, unanswered at once.
        most: usize,
        most_bytes: usize,
    }

    /// An engine that answers parks with ids of its own (1000 on), each
    /// after a random delay (so out of order), `Err` for their ids in
    /// `fail`.
    fn engine(fail: Vec<u64>) -> (mpsc::Sender<Adopt>, tokio::task::JoinHandle<Seen>) {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        use std::sync::Arc;
        let (tx, mut rx) = mpsc::channel(16);
        let task = tokio::spawn(async move {
            let mut seen = Seen {
                parks: Vec::new(),
                completed: Vec::new(),
                most: 0,
                most_bytes: 0,
            };
            let (unanswered, bytes) =
                (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
            while let Some(adopt) = rx.recv().await {
                match adopt {
                    Adopt::Park { held, reply, .. } => {
                        let size = held.body.len();
                        seen.most = seen.most.max(unanswered.fetch_add(1, SeqCst) + 1);
                        seen.most_bytes = seen.most_bytes.max(bytes.fetch_add(size, SeqCst) + size);
                        let result = match fail.contains(&held.id) {
                            true => Err("disk full".to_string()),
                            false => Ok(1000 + seen.parks.len() as u64),
                        };
                        seen.parks.push(held.id);
                        let (unanswered, bytes) = (unanswered.clone(), bytes.clone());
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_micros(fastrand::u64(0..300))).await;
                            unanswered.fetch_sub(1, SeqCst);
                            bytes.fetch_sub(size, SeqCst);
                            let _ = reply.send(result);
                        });
                    }
                    Adopt::Complete(id) => seen.completed.push(id),
                    Adopt::Release(_) => unreachable!("not released here"),
                }
            }
            seen
        });
        (tx, task)
    }

    fn held(id: u64, size: usize) -> Held {
        Held {
            id,
            vhost: "/".into(),
            queue: "q".into(),
            due_ms: 1,
            retry: 1,
            route: crate::store::Route::Queue,
            on_return: None,
            header: bytes::Bytes::new(),
            body: bytes::Bytes::from(vec![0u8; size]),
        }
    }

    fn intent() -> Intent {
        Intent {
            from: "a".into(),
            epoch: 1,
        }
    }

    #[tokio::test]
    async fn pipelined_parks_end_as_one_at_a_time_would_within_the_window() {
        let metrics = Metrics::new();
        let (engine, task) = engine(vec![]);
        let mut ours = HashMap::new();
        let mut parks = InFlight::new(&mut ours, "a", &metrics);
        let n = 3 * PARKS_IN_FLIGHT as u64;
        for id in 1..=n {
            parks.send(&engine, held(id, 10), &intent()).await.unwrap();
            if id % 7 == 0 {
                // Completed in the stream right after its put, most
                // likely while its park waits for its answer.
                parks.drop(&engine, id).await;
            }
        }
        // Message 1 put again and again (re-routed) while the last copy
        // waits, then message 2 again and completed with both copies
        // (one answered, one waiting) out.
        for _ in 0..3 {
            parks.send(&engine, held(1, 10), &intent()).await.unwrap();
        }
        parks.send(&engine, held(2, 10), &intent()).await.unwrap();
        parks.drop(&engine, 2).await;
        parks.drain(&engine).await.unwrap();
        drop(engine);
        let seen = task.await.unwrap();
        assert!(
            seen.most <= PARKS_IN_FLIGHT,
            "{} unanswered at once",
            seen.most
        );
        assert!(seen.most > 1, "the parks were not pipelined");
        // What one at a time gives: the last copy of each put, but those
        // completed; every other copy completed.
        let mut last: HashMap<u64, u64> = HashMap::new();
        for (k, theirs) in seen.parks.iter().enumerate() {
            last.insert(*theirs, 1000 + k as u64);
        }
        let kept: HashMap<u64, u64> = last
            .iter()
            .filter(|(theirs, _)| **theirs % 7 != 0 && **theirs != 2)
            .map(|(t, o)| (*t, *o))
            .collect();
        assert_eq!(ours, kept);
        let mut completed = seen.completed.clone();
        completed.sort_unstable();
        let mut expected: Vec<u64> = (0..seen.parks.len() as u64)
            .map(|k| 1000 + k)
            .filter(|id| !kept.values().any(|o| o == id))
            .collect();
        expected.sort_unstable();
        assert_eq!(completed, expected, "each other copy completed once");
        assert_eq!(metrics.replica_adopted.get(), seen.parks.len() as u64);
    }

    #[tokio::test]
    async fn large_messages_wait_for_room_in_the_bytes_in_flight() {
        let metrics = Metrics::new();
        let (engine, task) = engine(vec![]);
        let mut ours = HashMap::new();
        let mut parks = InFlight::new(&mut ours, "a", &metrics);
        let size = 3 << 20;
        for id in 1..=40 {
            parks
                .send(&engine, held(id, size), &intent())
                .await
                .unwrap();
        }
        // One larger than the whole window still goes, alone.
        parks
            .send(&engine, held(41, BYTES_IN_FLIGHT + 1), &intent())
            .await
            .unwrap();
        parks.drain(&engine).await.unwrap();
        drop(engine);
        let seen = task.await.unwrap();
        assert_eq!(ours.len(), 41);
        assert!(seen.most > 1, "the parks were not pipelined");
        assert!(
            seen.most_bytes <= BYTES_IN_FLIGHT + 1,
            "{} bytes unanswered at once",
            seen.most_bytes
        );
    }

    #[tokio::test]
    async fn a_failed_park_stops_the_sending_and_every_park_sent_is_answered() {
        for failing in [500, 1990] {
            let metrics = Metrics::new();
            let (engine, task) = engine(vec![failing]);
            let mut ours = HashMap::new();
            let mut parks = InFlight::new(&mut ours, "a", &metrics);
            let mut failed = false;
            for id in 1..=2000 {
                if parks.send(&engine, held(id, 10), &intent()).await.is_err() {
                    failed = true;
                    break;
                }
            }
            let drained = parks.drain(&engine).await;
            assert!(failed || drained.is_err(), "the failure is reported");
            assert!(parks.waiting.is_empty());
            let sent = parks.sent;
            if failing == 500 {
                assert!(failed && sent < 2000, "the sending stopped");
            }
            drop(engine);
            let seen = task.await.unwrap();
            assert!(seen.completed.is_empty());
            // Every park the engine made is in `ours` (and so completed or
            // released later): none is left held and unknown.
            assert_eq!(seen.parks.len() as u64, sent);
            let made: HashMap<u64, u64> = (seen.parks.iter().enumerate())
                .filter(|(_, theirs)| **theirs != failing)
                .map(|(k, theirs)| (*theirs, 1000 + k as u64))
                .collect();
            assert_eq!(ours, made, "failing {failing}");
        }
    }

    fn adopting(by: &str, epoch: u64) -> Record {
        Record::Adopting {
            by: by.into(),
            epoch,
        }
    }

    /// Issue 36: the nodes an adopter compares with its own are those of
    /// the first record of the highest epoch (its holder's).
    #[test]
    fn the_nodes_are_the_last_holders() {
        let epoch = |n: u64, holder: &str, nodes: Option<&[&str]>| Record::Epoch {
            n,
            holder: holder.into(),
            nodes: nodes.map(|list| list.iter().map(|s| s.to_string()).collect()),
        };
        let dir = Directory::fold(vec![
            epoch(1, "a", Some(&["n1:1"])),
            epoch(2, "b", Some(&["n2:1"])),
            epoch(2, "late", Some(&["x:1"])),
        ]);
        assert_eq!(dir.nodes, Some(vec!["n2:1".to_string()]));
        let dir = Directory::fold(vec![
            epoch(1, "a", Some(&["n1:1"])),
            epoch(2, "old", None),
            epoch(2, "late", Some(&["x:1"])),
        ]);
        assert_eq!(dir.nodes, None, "an older version's holder recorded none");
    }

    #[test]
    fn an_intent_is_open_until_committed_or_its_instance_comes_back() {
        let epoch = Record::Epoch {
            n: 2,
            holder: "pid 1".into(),
            nodes: None,
        };
        let dir = Directory::fold(vec![Record::Generation(1), adopting("b", 1)]);
        assert_eq!(dir.open, Some(("b".into(), 1)));
        assert!(!dir.adopted);
        // The instance came back: the intent can never be committed.
        let dir = Directory::fold(vec![Record::Generation(1), adopting("b", 1), epoch]);
        assert_eq!(dir.open, None);
        assert_eq!(dir.last_intent, 1, "a new intent takes the next epoch");
        // B killed half way, C adopts in one step.
        let dir = Directory::fold(vec![
            Record::Generation(1),
            adopting("b", 1),
            adopting("c", 2),
            Record::Adopted {
                by: "c".into(),
                epoch: Some(2),
            },
        ]);
        assert_eq!(dir.open, None);
        assert!(dir.adopted);
        assert_eq!(dir.committed, HashSet::from([2]), "b's intent never counts");
        // Written by an older version: adopted, no intent.
        let old = Directory::fold(vec![
            Record::Generation(3),
            Record::Adopted {
                by: "b".into(),
                epoch: None,
            },
        ]);
        assert!(old.adopted && old.committed.is_empty());
        // Started again after its adoption: a new generation, nothing open.
        let again = Directory::fold(vec![
            Record::Generation(1),
            adopting("b", 1),
            Record::Adopted {
                by: "b".into(),
                epoch: Some(1),
            },
            Record::Generation(2),
        ]);
        assert_eq!((again.generation, again.adopted), (Some(2), false));
        assert_eq!(again.last_intent, 1);
    }
}

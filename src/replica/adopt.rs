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
//! An adoption is one intent (see [`super::record`]): the adopter writes
//! it (`Adopting`, a new epoch) to the adopted directory before it parks
//! anything; each park is a moved put naming the intent; the adopted
//! messages are held but do not fire until a commit names them. The
//! adopter reads the adopted stream once to learn what it holds, parks
//! the soonest due first, and commits every `replica.adopt_part` parks as
//! a part (`AdoptedPart`: their ids there and ours), which fire at once;
//! `Adopted` with the same epoch commits the rest. An adopter killed half
//! way has fired only what its parts committed, and its other parks never
//! count (a rebuild or an adoption of its stream drops them): the next
//! adopter takes every message from the adopted stream again, but those
//! the parts gave away, which count in the killed adopter's stream. An
//! intent whose adopter is alive is left to it (it resumes where it
//! stopped).
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
use super::record::{Fold, Intent, Record, Step, PART_MAX};
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
/// messages parked and not committed yet (their id there → ours).
#[derive(Debug, Default)]
struct Progress {
    epoch: Option<u64>,
    ours: HashMap<u64, u64>,
    /// Our ids that the directory, when last read, showed in committed
    /// parts of this intent: those of `ours` among them are committed
    /// (a part whose answer was lost), whatever becomes of the intent.
    landed: HashSet<u64>,
    /// Messages of this intent committed in parts so far.
    released: usize,
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
    /// Its messages a committed part gave away (their id there): every
    /// reader of its stream leaves them out.
    given: HashSet<u64>,
    /// The adopter's ids (of its moved puts) each intent's committed
    /// parts name: those count whatever becomes of the intent.
    parts: HashMap<u64, HashSet<u64>>,
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
                    // All of it is adopted: nothing is left to give (the
                    // instance starts a new generation, wiped), and the
                    // parts of this intent count whole.
                    dir.given.clear();
                    epoch.map(|e| dir.parts.remove(&e));
                }
                Record::AdoptedPart { epoch, moved, .. } => {
                    dir.last_intent = dir.last_intent.max(epoch);
                    if dir.committed.contains(&epoch) {
                        continue;
                    }
                    let ours = dir.parts.entry(epoch).or_default();
                    for (theirs, id) in moved {
                        dir.given.insert(theirs);
                        ours.insert(id);
                    }
                }
                _ => {}
            }
        }
        dir
    }
}

/// Whether moved puts count: their adoption committed, or a committed
/// part of it names them, as the adopted instance's directory says (read
/// once per intent).
#[derive(Default)]
pub(super) struct Commits {
    known: HashMap<Intent, Verdict>,
}

/// What the adopted instance's directory says of one intent.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Committed,
    /// Not committed: only the moved puts of these ids count.
    Parts(HashSet<u64>),
}

impl Verdict {
    /// Of the intent `epoch`, by the adopted instance's directory (none:
    /// gone, so nobody can adopt that instance any more, and this is the
    /// one copy left).
    fn of(dir: Option<Directory>, epoch: u64) -> Self {
        match dir {
            None => Verdict::Committed,
            Some(d) if d.committed.contains(&epoch) => Verdict::Committed,
            Some(mut d) => Verdict::Parts(d.parts.remove(&epoch).unwrap_or_default()),
        }
    }
}

impl Commits {
    /// Whether the put of `id` moved by `from` counts. A directory that is
    /// gone counts as committed: nobody can adopt that instance any more,
    /// so this is the one copy left.
    pub(super) async fn counts(
        &mut self,
        client: &Client,
        from: &Intent,
        id: u64,
    ) -> Result<bool, ClientError> {
        if !self.known.contains_key(from) {
            let verdict = Verdict::of(Directory::read(client, &from.from).await?, from.epoch);
            if let Verdict::Parts(parts) = &verdict {
                info!(
                    from = from.from,
                    epoch = from.epoch,
                    committed_in_parts = parts.len(),
                    "moved messages of an adoption that was never committed: only those of its committed parts are held"
                );
            }
            self.known.insert(from.clone(), verdict);
        }
        Ok(match &self.known[from] {
            Verdict::Committed => true,
            Verdict::Parts(ids) => ids.contains(&id),
        })
    }
}

/// An adoption cut off whose commit may or may not have landed (its
/// answer lost): the adopted directory says. Committed: its parks are
/// scheduled. Not: they are completed, but those a committed part names,
/// which are scheduled. Unreadable: kept (returned), for the next round;
/// never completed on a guess, since a commit that landed leaves the
/// adopted stream unread by anyone else.
async fn settle(
    client: &Client,
    engine: &mpsc::Sender<Adopt>,
    config: &Config,
    from: &str,
    mut progress: Progress,
) -> Option<Progress> {
    let Some(epoch) = progress.epoch else {
        abandon(engine, config, from, progress).await;
        return None;
    };
    match Directory::read(client, from)
        .await
        .map(|dir| Verdict::of(dir, epoch))
    {
        Ok(Verdict::Committed) => {
            schedule(engine, config, from, epoch, progress).await;
            None
        }
        Ok(Verdict::Parts(landed)) => {
            progress.landed = landed;
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
        in_parts_before = progress.released,
        "adoption committed: its messages are scheduled"
    );
    let _ = engine.send(Adopt::Release(ids)).await;
    local::end_adoption(&config.store_dir, from);
}

/// Parks (their id → ours) split into those a committed part names
/// (`landed`, by our id), and the others.
fn split_landed(ours: HashMap<u64, u64>, landed: &HashSet<u64>) -> (Vec<u64>, Vec<u64>) {
    ours.into_values().partition(|id| landed.contains(id))
}

/// Gives the adopted instance's lease back, if it is held.
async fn give_back(lease: &mut Option<Lease>) {
    if let Some(lease) = lease.take() {
        lease.release().await;
    }
}

/// Completes what an adoption that can no longer be committed parked,
/// but for the parks a committed part names (`landed`): those are ours,
/// and fire.
async fn abandon(engine: &mpsc::Sender<Adopt>, config: &Config, from: &str, progress: Progress) {
    local::end_adoption(&config.store_dir, from);
    if progress.ours.is_empty() {
        return;
    }
    let (landed, dropped) = split_landed(progress.ours, &progress.landed);
    if !dropped.is_empty() {
        warn!(
            from,
            epoch = progress.epoch,
            dropped = dropped.len(),
            committed_in_a_part = landed.len(),
            "an adoption cut off half way cannot be committed: its parks are dropped (the adopted stream still has them), but those of a part that was committed"
        );
    }
    if !landed.is_empty() {
        let _ = engine.send(Adopt::Release(landed)).await;
    }
    for id in dropped {
        let _ = engine.send(Adopt::Complete(id)).await;
    }
}

impl Adopter<'_> {
    /// Adopts `name`'s held messages under one intent: intent, parks
    /// committed in parts, commit.
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
        // Its messages committed parts gave away: never parked again.
        let mut given = HashSet::new();
        loop {
            let outcome = self
                .perform(attempt.phase(), name, progress, &mut lease, &mut given)
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
        given: &mut HashSet<u64>,
    ) -> Result<Outcome, ClientError> {
        let (client, target) = (self.client, &self.config.target);
        Ok(match phase {
            Phase::Leasing => {
                let connection = format!("nackd adoption {} of {name}", self.config.instance);
                *lease = Lease::take(target, &Config::lease(name), &connection).await?;
                Outcome::Lease(lease.is_some())
            }
            Phase::Reading => Outcome::Directory(self.read_directory(name, progress, given).await?),
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
            Phase::Parking { g, epoch } => {
                let mut parts = Parts {
                    name,
                    epoch: *epoch,
                    progress,
                    given,
                    lease,
                    first_done: false,
                };
                self.park(*g, &mut parts).await?
            }
            Phase::Confirming { .. } => Outcome::Active(self.still_active()),
            Phase::Probing { .. } => Outcome::Majority(self.majority(lease).await),
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

    /// The adopted instance's directory, read under its lease: what its
    /// committed parts gave away, and which of our parks they name.
    async fn read_directory(
        &self,
        name: &str,
        progress: &mut Progress,
        given: &mut HashSet<u64>,
    ) -> Result<Directory, ClientError> {
        let mut dir = Directory::read(self.client, name)
            .await?
            .unwrap_or_default();
        let (nodes, previous) = (&self.config.target.nodes, &self.config.previous_nodes);
        dir.other_nodes =
            (dir.nodes.clone()).filter(|recorded| !lease::nodes_agree(recorded, nodes, previous));
        given.clone_from(&dir.given);
        progress.landed = (progress.epoch)
            .and_then(|epoch| dir.parts.get(&epoch).cloned())
            .unwrap_or_default();
        Ok(dir)
    }

    /// Whether this instance is still active, and has been all along:
    /// changed at all, the lease was lost meanwhile, and the store may
    /// have been rebuilt without the parks.
    fn still_active(&self) -> bool {
        !self.state.has_changed().unwrap_or(true) && *self.state.borrow() == State::Active
    }

    /// Whether a majority of the adopted id's lease registers answered.
    async fn majority(&self, lease: &mut Option<Lease>) -> bool {
        let held = match lease.as_mut() {
            Some(lease) => lease.probe(|| {}).await,
            None => 0,
        };
        held >= lease::majority(self.config.target.nodes.len())
    }

    /// Parks generation `g` under the intent, skipping what was parked or
    /// given, and commits it in parts.
    async fn park(&self, g: u64, parts: &mut Parts<'_>) -> Result<Outcome, ClientError> {
        let began = self.clock.now();
        match self.take_over(g, parts).await {
            Ok(count) => {
                let took = self.clock.now().saturating_duration_since(began);
                info!(from = parts.name, epoch = parts.epoch, messages = count, committed_in_parts = parts.progress.released, took = ?took, "parked the held messages of an adoption");
                Ok(Outcome::Parked(count))
            }
            Err(ClientError::Returned(stream)) => Ok(Outcome::StreamReturned(stream)),
            Err(e) => Err(e),
        }
    }

    /// Parks every message of the adopted generation `g` under our own
    /// ids, as moved by the intent, but those `parts` has parked or were
    /// given. The stream is read twice: first to learn which messages it
    /// holds at its end (a completion comes after its put), keeping the
    /// soonest due of them in memory; then again for the others. The
    /// soonest due are parked first, and every `adopt_part` parks are
    /// committed as a part, so that they fire while the rest is taken.
    ///
    /// The parks are pipelined: up to [`PARKS_IN_FLIGHT`] messages (and
    /// [`BYTES_IN_FLIGHT`]) wait for their answers at once, so that the
    /// engine writes them to the store in batches and the stream's
    /// confirms come back together (one at a time, 3 000 took 3 to 12 s).
    /// Every park sent is answered before this returns, on an error too,
    /// and ends in the progress: a park left out could never be completed,
    /// and would count once this intent is committed.
    async fn take_over(&self, g: u64, parts: &mut Parts<'_>) -> Result<usize, ClientError> {
        let from = Intent {
            from: parts.name.to_owned(),
            epoch: parts.epoch,
        };
        let ours = std::mem::take(&mut parts.progress.ours);
        let mut parks = InFlight::new(ours, parts.name, self.metrics);
        let taken = self.take_in_parts(g, &from, &mut parks, parts).await;
        let answered = parks.drain(self.engine).await;
        parts.progress.ours = std::mem::take(&mut parks.ours);
        taken.and(answered)?;
        Ok(parts.progress.released + parts.progress.ours.len())
    }

    /// [`Adopter::take_over`]'s reads and parks.
    async fn take_in_parts(
        &self,
        g: u64,
        from: &Intent,
        parks: &mut InFlight<'_>,
        parts: &mut Parts<'_>,
    ) -> Result<(), ClientError> {
        let stream = Config::generation(&from.from, g);
        let skip: HashSet<u64> = (parks.ours.keys().chain(parts.given.iter()))
            .copied()
            .collect();
        let mut survey = self.survey(&stream, &skip).await?;
        // Parked by an earlier try, and not held by the stream any more
        // (completed since): not ours to hold either. (What a part gave
        // away stays: it is ours whatever the stream says.)
        let stale: Vec<u64> = (parks.ours.keys())
            .filter(|theirs| !survey.live.contains_key(theirs) && !parts.given.contains(theirs))
            .copied()
            .collect();
        for theirs in stale {
            if let Some(id) = parks.ours.remove(&theirs) {
                let _ = self.engine.send(Adopt::Complete(id)).await;
            }
        }
        let soonest = |id: &u64| survey.first_due.contains_key(id);
        let rest = (survey.live.keys())
            .filter(|id| !skip.contains(id) && !soonest(id))
            .count();
        for one in std::mem::take(&mut survey.first).into_values() {
            parks.send(self.engine, one, from).await?;
            self.part_if_full(parks, parts).await?;
        }
        if rest == 0 {
            return Ok(()); // the commit of the intent takes what is left
        }
        if self.config.adopt_part > 0 {
            // The soonest due fire while the rest is read again.
            self.commit_part(parks, parts).await?;
        }
        let mut reader = self.client.read(&stream).await?;
        let (mut fold, mut step, mut parked) = (Fold::default(), 0u64, 0usize);
        while let Some(record) = reader.next().await? {
            for one in fold.apply(record) {
                let Step::Put(put) = one else { continue };
                step += 1;
                let last = survey.live.get(&put.id) == Some(&step);
                if last && !skip.contains(&put.id) && !soonest(&put.id) {
                    parks.send(self.engine, put, from).await?;
                    parked += 1;
                    self.part_if_full(parks, parts).await?;
                }
            }
        }
        if (step, fold.held(), parked) != (survey.steps, survey.held, rest) {
            return Err(ClientError::Unreachable(format!(
                "the adopted stream {stream} changed between two reads ({parked} of {rest} found again): adopting again"
            )));
        }
        Ok(())
    }

    /// The first read: the messages `stream` holds at its end (but those
    /// moved by an adoption of its own that does not count), and the
    /// soonest due of them, but those of `skip`, in full.
    async fn survey(&self, stream: &str, skip: &HashSet<u64>) -> Result<Survey, ClientError> {
        let mut reader = self.client.read(stream).await?;
        let (mut fold, mut commits) = (Fold::default(), Commits::default());
        let mut survey = Survey::new(self.config.adopt_part);
        while let Some(record) = reader.next().await? {
            for one in fold.apply(record) {
                match one {
                    Step::Put(held) => {
                        survey.steps += 1;
                        survey.forget(held.id); // an earlier version
                        if let Some(theirs) = fold.intent(held.id) {
                            // Parked by an adoption of its own: only if committed.
                            if !commits.counts(self.client, theirs, held.id).await? {
                                continue;
                            }
                        }
                        survey.live.insert(held.id, survey.steps);
                        if !skip.contains(&held.id) {
                            survey.keep(held);
                        }
                    }
                    Step::Drop(theirs) => survey.forget(theirs),
                }
            }
        }
        survey.held = fold.held();
        Ok(survey)
    }

    /// Commits a part once `adopt_part` parks are sent ([`FIRST_PART`]
    /// for the first: the soonest due fire as soon as they can).
    async fn part_if_full(
        &self,
        parks: &mut InFlight<'_>,
        parts: &mut Parts<'_>,
    ) -> Result<(), ClientError> {
        let part = match parts.first_done {
            false => self.config.adopt_part.min(FIRST_PART),
            true => self.config.adopt_part,
        };
        if part > 0 && parks.ours.len() + parks.waiting.len() >= part {
            self.commit_part(parks, parts).await?;
        }
        Ok(())
    }

    /// Commits what is parked as parts of the intent (each at most
    /// [`PART_MAX`]), each under the checks of the intent's own commit:
    /// this instance still active, the adopted id's lease still a
    /// majority. Each part that lands is scheduled, and its messages are
    /// given.
    async fn commit_part(
        &self,
        parks: &mut InFlight<'_>,
        parts: &mut Parts<'_>,
    ) -> Result<(), ClientError> {
        parks.drain(self.engine).await?;
        let moved: Vec<(u64, u64)> = parks.ours.iter().map(|(t, o)| (*t, *o)).collect();
        for chunk in moved.chunks(PART_MAX) {
            // Checked right before each append: what is left between the
            // check and the append is one round trip (Limits, cluster.md).
            if !self.still_active() {
                return Err(ClientError::Unreachable(phase::LOST_OWN.into()));
            }
            if !self.majority(parts.lease).await {
                return Err(ClientError::Unreachable(phase::LOST_ADOPTED.into()));
            }
            let part = Record::AdoptedPart {
                by: self.config.instance.clone(),
                epoch: parts.epoch,
                moved: chunk.to_vec(),
            };
            self.client
                .append_confirmed(&Config::directory(parts.name), &part)
                .await?;
            let mut ids = Vec::with_capacity(chunk.len());
            for (theirs, ours) in chunk {
                parks.ours.remove(theirs);
                parts.given.insert(*theirs);
                ids.push(*ours);
            }
            parts.progress.released += ids.len();
            parts.first_done = true;
            info!(
                from = parts.name,
                epoch = parts.epoch,
                messages = ids.len(),
                so_far = parts.progress.released,
                "committed a part of an adoption: its messages are scheduled"
            );
            let _ = self.engine.send(Adopt::Release(ids)).await;
        }
        Ok(())
    }
}

/// What a parking attempt works on: the adopted instance, our intent,
/// what it has parked, what was given, and the adopted id's lease.
struct Parts<'a> {
    name: &'a str,
    epoch: u64,
    progress: &'a mut Progress,
    given: &'a mut HashSet<u64>,
    lease: &'a mut Option<Lease>,
    /// This attempt committed its first part.
    first_done: bool,
}

/// The first part of an adoption, at most: the soonest due are committed
/// (and fire) once this many are parked, not `adopt_part`.
const FIRST_PART: usize = 1024;

/// Messages of the adopted stream kept in memory by its first read (the
/// soonest due), at most, in bytes (with [`ENTRY_BYTES`] each): they are
/// parked without a second read.
const FIRST_BYTES: usize = 64 << 20;
/// What one message kept costs beside its header and body (the message's
/// own fields, its names, the two maps' entries), for [`FIRST_BYTES`].
const ENTRY_BYTES: usize = 256;

/// What the first read of an adopted stream found.
struct Survey {
    /// The messages it holds at its end: their id → the number of the
    /// put (among the fold's) that holds their last version.
    live: HashMap<u64, u64>,
    /// The soonest due of those to park, at most `most` of them within
    /// [`FIRST_BYTES`]: (due, id) → it. Every one of them is due before
    /// every message of `later`.
    first: std::collections::BTreeMap<(u64, u64), Held>,
    /// Their ids, and due times.
    first_due: HashMap<u64, u64>,
    first_bytes: usize,
    most: usize,
    /// Puts the fold gave, and ids it held at the end: the second read
    /// must find the same, or the stream changed in between.
    steps: u64,
    held: usize,
    /// The others to park, by (due, id), and their ids' due times: none
    /// due at or after the soonest of them is kept, so that what is kept
    /// is all the soonest due (a completion lifts that bound again).
    later: std::collections::BTreeSet<(u64, u64)>,
    later_due: HashMap<u64, u64>,
}

impl Survey {
    /// A survey that keeps the `most` soonest due in memory.
    fn new(most: usize) -> Self {
        Self {
            live: HashMap::new(),
            first: Default::default(),
            first_due: HashMap::new(),
            first_bytes: 0,
            most,
            steps: 0,
            held: 0,
            later: Default::default(),
            later_due: HashMap::new(),
        }
    }

    fn size(held: &Held) -> usize {
        held.header.len() + held.body.len() + held.queue.len() + held.vhost.len() + ENTRY_BYTES
    }

    /// Keeps `held` (a message to park) in memory if it is among the
    /// soonest due that fit, else notes it for the second read.
    fn keep(&mut self, held: Held) {
        let key = (held.due_ms, held.id);
        let size = Self::size(&held);
        if size > FIRST_BYTES {
            return; // never kept, and no bound on the others
        }
        if self.most == 0 || self.later.first().is_some_and(|soonest| key >= *soonest) {
            self.later.insert(key);
            self.later_due.insert(held.id, held.due_ms);
            return;
        }
        self.first_bytes += size;
        self.first_due.insert(held.id, held.due_ms);
        self.first.insert(key, held);
        while self.first_bytes > FIRST_BYTES || self.first.len() > self.most {
            let Some((latest, dropped)) = self.first.pop_last() else {
                break;
            };
            self.first_bytes -= Self::size(&dropped);
            self.first_due.remove(&latest.1);
            self.later.insert(latest);
            self.later_due.insert(latest.1, latest.0);
        }
    }

    /// `id` is not held (completed, or an earlier version of it).
    fn forget(&mut self, id: u64) {
        self.live.remove(&id);
        if let Some(due) = self.first_due.remove(&id) {
            if let Some(held) = self.first.remove(&(due, id)) {
                self.first_bytes -= Self::size(&held);
            }
        }
        if let Some(due) = self.later_due.remove(&id) {
            self.later.remove(&(due, id));
        }
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
    theirs: u64,
    bytes: usize,
    answer: Answer,
}

/// The parks an adoption has sent and not seen answered, in order, and
/// what the answers go into (see [`Adopter::take_over`]).
struct InFlight<'a> {
    /// Their id → ours, for every park answered and not committed.
    ours: HashMap<u64, u64>,
    /// The adopted instance, for the logs.
    from: &'a str,
    metrics: &'a Metrics,
    waiting: std::collections::VecDeque<Waiting>,
    /// Bytes of the waiting parks.
    bytes: usize,
    /// Parks that failed: the first is logged, and ends the reading.
    failed: usize,
}

impl<'a> InFlight<'a> {
    fn new(ours: HashMap<u64, u64>, from: &'a str, metrics: &'a Metrics) -> Self {
        Self {
            ours,
            from,
            metrics,
            waiting: Default::default(),
            bytes: 0,
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
        self.bytes += bytes;
        self.waiting.push_back(Waiting {
            theirs,
            bytes,
            answer,
        });
        Ok(())
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
        if let Some(older) = self.ours.insert(head.theirs, id) {
            // Parked twice (it cannot be: each is parked once, at its
            // last version): the newer copy wins.
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
        let mut parks = InFlight::new(HashMap::new(), "a", &metrics);
        let n = 3 * PARKS_IN_FLIGHT as u64;
        for id in 1..=n {
            parks.send(&engine, held(id, 10), &intent()).await.unwrap();
        }
        parks.drain(&engine).await.unwrap();
        let ours = std::mem::take(&mut parks.ours);
        drop(engine);
        let seen = task.await.unwrap();
        assert!(
            seen.most <= PARKS_IN_FLIGHT,
            "{} unanswered at once",
            seen.most
        );
        assert!(seen.most > 1, "the parks were not pipelined");
        // Answered out of order, taken in order: each their id → ours.
        let made: HashMap<u64, u64> = (seen.parks.iter().enumerate())
            .map(|(k, theirs)| (*theirs, 1000 + k as u64))
            .collect();
        assert_eq!(ours, made);
        assert!(seen.completed.is_empty());
        assert_eq!(metrics.replica_adopted.get(), n);
    }

    #[tokio::test]
    async fn large_messages_wait_for_room_in_the_bytes_in_flight() {
        let metrics = Metrics::new();
        let (engine, task) = engine(vec![]);
        let mut parks = InFlight::new(HashMap::new(), "a", &metrics);
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
        assert_eq!(parks.ours.len(), 41);
        drop(engine);
        let seen = task.await.unwrap();
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
            let mut parks = InFlight::new(HashMap::new(), "a", &metrics);
            let (mut failed, mut sent) = (false, 0u64);
            for id in 1..=2000 {
                if parks.send(&engine, held(id, 10), &intent()).await.is_err() {
                    failed = true;
                    break;
                }
                sent += 1;
            }
            let drained = parks.drain(&engine).await;
            assert!(failed || drained.is_err(), "the failure is reported");
            assert!(parks.waiting.is_empty());
            let ours = std::mem::take(&mut parks.ours);
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

    /// Issue 36: the first read keeps the soonest due of what the stream
    /// holds at its end, at most `most` of them within FIRST_BYTES: a
    /// later version replaces an earlier one, a completion drops it, past
    /// a bound the latest due go, and none due after one that went comes
    /// in while that one is held (it waits for the second read with it).
    #[test]
    fn the_first_read_keeps_the_soonest_due_within_its_bounds() {
        let size = 4 << 20;
        let at = |id: u64, due_ms: u64| Held {
            due_ms,
            ..held(id, size)
        };
        let kept = |s: &Survey| s.first.values().map(|h| h.id).collect::<Vec<u64>>();
        let consistent = |s: &Survey| {
            assert_eq!(s.first.len(), s.first_due.len());
            assert_eq!(s.later.len(), s.later_due.len());
            let bytes: usize = s.first.values().map(Survey::size).sum();
            assert_eq!(bytes, s.first_bytes);
            assert!(s.first_bytes <= FIRST_BYTES && s.first.len() <= s.most);
            if let (Some((last, _)), Some(soonest)) = (s.first.last_key_value(), s.later.first()) {
                assert!(last < soonest, "all kept are due before all left");
            }
        };
        // 40 of 4 MiB, due from the latest to the soonest: 15 fit.
        let mut survey = Survey::new(100);
        for id in 1..=40u64 {
            survey.keep(at(id, 1000 - id));
            consistent(&survey);
        }
        assert_eq!(kept(&survey), (26..=40).rev().collect::<Vec<_>>());
        assert_eq!(survey.later.len(), 25);
        // A completion makes room, but only for one due before the
        // soonest left (25, due at 975).
        survey.forget(30);
        survey.keep(at(41, 980));
        assert!(survey.later_due.contains_key(&41), "due after one left");
        survey.keep(at(42, 1));
        assert_eq!(kept(&survey)[0], 42);
        consistent(&survey);
        // Those left are completed (fired): the bound goes with them.
        for id in 1..=25 {
            survey.forget(id);
        }
        survey.forget(41);
        survey.forget(40);
        survey.keep(at(43, 990));
        assert!(survey.first_due.contains_key(&43));
        consistent(&survey);
        // One larger than the bound is never kept, and evicts nothing.
        let before = kept(&survey);
        let mut huge = at(100, 0);
        huge.body = bytes::Bytes::from(vec![0u8; FIRST_BYTES + 1]);
        survey.keep(huge);
        assert_eq!(kept(&survey), before);
        // The count bound (adopt_part), and none kept for 0.
        let mut small = Survey::new(3);
        for id in 1..=10u64 {
            small.keep(held(id, 10));
        }
        consistent(&small);
        assert_eq!((small.first.len(), small.later.len()), (3, 7));
        let mut none = Survey::new(0);
        none.keep(held(1, 10));
        assert!(none.first.is_empty());
    }

    fn part(by: &str, epoch: u64, moved: &[(u64, u64)]) -> Record {
        Record::AdoptedPart {
            by: by.into(),
            epoch,
            moved: moved.to_vec(),
        }
    }

    /// Issue 36: committed parts give their messages away (every reader
    /// of the adopted stream leaves them out) and name the adopter's ids
    /// that count whatever becomes of the intent; `Adopted` makes the
    /// parts of its intent count whole and leaves nothing to give.
    #[test]
    fn parts_give_messages_away_and_name_the_adopters_ids_until_the_commit() {
        let dir = Directory::fold(vec![
            Record::Generation(1),
            adopting("b", 1),
            part("b", 1, &[(10, 100), (11, 101)]),
            // B killed; C takes over with a new intent.
            adopting("c", 2),
            part("c", 2, &[(12, 200)]),
        ]);
        assert_eq!(dir.given, HashSet::from([10, 11, 12]));
        assert_eq!(dir.parts[&1], HashSet::from([100, 101]));
        assert_eq!(
            dir.open,
            Some(("c".into(), 2)),
            "a part leaves the intent open"
        );
        assert_eq!(dir.last_intent, 2);
        assert!(!dir.adopted);
        assert_eq!(
            Verdict::of(Some(dir), 1),
            Verdict::Parts(HashSet::from([100, 101]))
        );
        let dir = Directory::fold(vec![
            Record::Generation(1),
            adopting("b", 1),
            part("b", 1, &[(10, 100)]),
            adopting("c", 2),
            part("c", 2, &[(12, 200)]),
            Record::Adopted {
                by: "c".into(),
                epoch: Some(2),
            },
            // A part written late (by a process that lost the lease) of
            // a committed intent changes nothing.
            part("c", 2, &[(13, 201)]),
        ]);
        assert!(dir.adopted && dir.given.is_empty());
        assert!(!dir.parts.contains_key(&2));
        assert_eq!(dir.parts[&1], HashSet::from([100]), "B's part still counts");
        assert_eq!(Verdict::of(Some(dir), 2), Verdict::Committed);
        assert_eq!(
            Verdict::of(None, 7),
            Verdict::Committed,
            "no directory: the one copy left"
        );
        // An epoch of its own closes the intent; what was given stays given.
        let back = Directory::fold(vec![
            Record::Generation(1),
            adopting("b", 1),
            part("b", 1, &[(10, 100)]),
            Record::Epoch {
                n: 2,
                holder: "pid 1".into(),
                nodes: None,
            },
        ]);
        assert_eq!(
            (back.open.clone(), back.given.clone()),
            (None, HashSet::from([10]))
        );
        assert_eq!(
            Verdict::of(Some(back), 1),
            Verdict::Parts(HashSet::from([100]))
        );
    }

    /// Issue 36: an adoption cut off after a part whose answer was lost
    /// keeps (releases) the parks that part names, and drops the others.
    #[test]
    fn parks_a_committed_part_names_are_kept_when_an_adoption_is_cut_off() {
        let ours = HashMap::from([(10, 100), (11, 101), (12, 102)]);
        let (mut landed, mut dropped) = split_landed(ours, &HashSet::from([100, 102, 999]));
        landed.sort_unstable();
        dropped.sort_unstable();
        assert_eq!((landed, dropped), (vec![100, 102], vec![101]));
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

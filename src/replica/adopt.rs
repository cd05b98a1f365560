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
use super::lease::Lease;
use super::record::{Fold, Record, Step};
use super::{Config, State};
use crate::metrics::Metrics;
use crate::store::Held;

/// What an adoption asks of the retry engine.
#[allow(clippy::large_enum_variant)] // moved once per message or state change: boxing buys nothing
pub enum Adopt {
    /// Park this message (another instance's) under a new id of ours,
    /// in the local store and our stream; answer with the new id.
    Park {
        /// The message, as the other instance held it.
        held: Held,
        /// The new id once durable on both.
        reply: oneshot::Sender<Result<u64, String>>,
    },
    /// Complete a message parked by [`Adopt::Park`] (its owner had
    /// completed it after all: its completion came later in the stream).
    Complete(u64),
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
    let mut watch = Watch::new(clock);
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
enum Adoption {
    /// Nothing is left to adopt.
    Done,
    /// Another instance adopts it, or it came back.
    Busy,
    /// Its generation stream is gone: its messages cannot be adopted.
    Missing(String),
}

/// Which other instances' leases have been free, and since when.
pub(super) struct Watch {
    clock: Clock,
    free_since: HashMap<String, Instant>,
    settled: HashSet<String>,
    /// Messages parked so far by an adoption that failed part way: their
    /// id there → ours. A retry skips them instead of parking them twice.
    progress: HashMap<String, HashMap<u64, u64>>,
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
}

impl Watch {
    fn new(clock: Clock) -> Self {
        Self {
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
    pub async fn round(
        &mut self,
        client: &Client,
        config: &Config,
        engine: &mpsc::Sender<Adopt>,
    ) -> Result<(), ClientError> {
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
            // Alive (again): once it is gone again it is adopted again.
            self.free_since.remove(name);
            self.settled.remove(name);
            self.unadoptable.remove(name);
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
        let progress = self.progress.entry(name.to_owned()).or_default();
        match adopt(client, config, name, engine, progress).await? {
            Adoption::Done => {
                self.settled.insert(name.to_owned());
                self.progress.remove(name);
            }
            Adoption::Busy => {}
            Adoption::Missing(stream) => {
                error!(
                    from = name,
                    stream,
                    "cannot adopt: the instance's replica stream is missing (deleted?), so its held messages are not in the cluster; if its store still exists, start it on that store and run `nackd admin replica reseed` there, else they are lost"
                );
                // Looked at again once it registers again (it came back).
                self.settled.insert(name.to_owned());
                self.unadoptable.insert(name.to_owned());
                self.progress.remove(name);
            }
        }
        self.free_since.remove(name);
        Ok(())
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

/// Adopts `name`'s held messages.
async fn adopt(
    client: &Client,
    config: &Config,
    name: &str,
    engine: &mpsc::Sender<Adopt>,
    ours: &mut HashMap<u64, u64>,
) -> Result<Adoption, ClientError> {
    let connection = format!("nackd adoption {} of {name}", config.instance);
    let Some(lease) = Lease::take(&config.target, &Config::lease(name), &connection).await? else {
        return Ok(Adoption::Busy); // another instance adopts it, or it came back
    };
    let directory = Config::directory(name);
    let mut generation = None;
    let mut adopted = false;
    if client.exists(&directory).await? {
        for record in client.read_all(&directory).await? {
            match record {
                Record::Generation(n) => (generation, adopted) = (Some(n), false),
                Record::Adopted { .. } => adopted = true,
                _ => {}
            }
        }
    }
    if let (Some(g), false) = (generation, adopted) {
        let stream = Config::generation(name, g);
        if !client.exists(&stream).await? {
            lease.release().await; // it may come back and reseed
            return Ok(Adoption::Missing(stream));
        }
        let count = match take_over(client, name, g, engine, ours).await {
            Ok(count) => count,
            Err(e) => {
                // The owner may come back before the next try and keep all
                // of its messages: what was parked here so far goes. Its
                // stream still has every one of them.
                for id in std::mem::take(ours).into_values() {
                    let _ = engine.send(Adopt::Complete(id)).await;
                }
                if let ClientError::Returned(stream) = e {
                    lease.release().await;
                    return Ok(Adoption::Missing(stream));
                }
                return Err(e);
            }
        };
        let by = Record::Adopted {
            by: config.instance.clone(),
        };
        client.append_confirmed(&directory, &by).await?;
        client.delete(&Config::generation(name, g)).await?;
        info!(
            from = name,
            messages = count,
            "adopted the held messages of an instance whose lease was free"
        );
    }
    lease.release().await;
    Ok(Adoption::Done)
}

/// Parks every message of `name`'s generation `g` under our own ids.
async fn take_over(
    client: &Client,
    name: &str,
    g: u64,
    engine: &mpsc::Sender<Adopt>,
    ours: &mut HashMap<u64, u64>,
) -> Result<usize, ClientError> {
    let mut reader = client.read(&Config::generation(name, g)).await?;
    let mut fold = Fold::default();
    let already: HashSet<u64> = ours.keys().copied().collect();
    while let Some(record) = reader.next().await? {
        for step in fold.apply(record) {
            match step {
                Step::Put(held) if already.contains(&held.id) => {}
                Step::Put(held) => {
                    let theirs = held.id;
                    let (reply, answer) = oneshot::channel();
                    let gone = || ClientError::Unreachable("the retry engine is gone".into());
                    engine
                        .send(Adopt::Park { held, reply })
                        .await
                        .map_err(|_| gone())?;
                    match answer.await.map_err(|_| gone())? {
                        Ok(id) => {
                            if let Some(older) = ours.insert(theirs, id) {
                                // A later put of the same message: the newer copy wins.
                                let _ = engine.send(Adopt::Complete(older)).await;
                            }
                        }
                        Err(e) => {
                            warn!(from = name, error = e, "cannot park an adopted message");
                            return Err(ClientError::Unreachable(e));
                        }
                    }
                }
                Step::Drop(theirs) => {
                    if let Some(id) = ours.remove(&theirs) {
                        let _ = engine.send(Adopt::Complete(id)).await;
                    }
                }
            }
        }
    }
    Ok(ours.len())
}

//! The engine task: parks claimed messages, fires them when due, completes
//! them on the broker's confirm, and keeps the store's bookkeeping exact
//! whatever order re-routes, purges, cancels and compaction come in.
//!
//! Each held message has one current record in the store (`Entry::loc`).
//! The engine is the only one who knows which, so it tells the writer
//! exactly once what becomes of every record it was told about: deleted
//! (`Del`, with the current record), superseded (a re-route's `replaces`,
//! or a compaction copy adopted or discarded: `Release`).
//!
//! - `fire`: what is due goes to its vhost's republisher, read from the
//!   store only as far as `republish.max_pending_bytes` allows.
//! - `outcome`: what the broker said, and what is set aside.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::blocks::{Backoff, Blocks};
use super::ledger::{Entry, Ledger, StoreOp};
use super::republish::{Report, Republisher};
use super::timer::Alarm;
use super::{Clock, Command, Options, Park, Parked};
use crate::metrics::{Metrics, VhostLabels};
use crate::net::Connector;
use crate::replica::fence::Fence;
use crate::store::{
    self, Held, HeldMeta, Loc, Log, Reader, Recovered, Relocation, StoreError, WriteOp, Written,
};
use nackd_core::wheel::Wheel;

mod fire;
mod link;
mod outcome;
#[cfg(test)]
mod unroutable_tests;

/// Why a put was made: to answer a session, to adopt another instance's
/// message, or to re-route a message.
pub(super) enum PutCtx {
    Park {
        key: super::ClaimKey,
        reply: mpsc::UnboundedSender<Parked>,
        meta: HeldMeta,
        /// When it falls due, to the microsecond.
        due_us: u64,
        /// A delayed publish: its publisher sent it, so it is held even if
        /// the session is gone (a retry's delivery is the broker's again).
        keep_if_gone: bool,
        /// Whether its session gave it up meanwhile (then the copy goes).
        ticket: nackd_core::held::Ticket,
    },
    Adopt {
        reply: tokio::sync::oneshot::Sender<Result<u64, String>>,
        meta: HeldMeta,
    },
    Reroute,
}

/// How long the republishers get to end at shutdown.
const REPUBLISHERS_STOP: Duration = Duration::from_secs(2);

/// A due wheel entry: when it was due (µs) and the store id it fires.
type Slot = (u64, u64);

/// Waits between two probes of an exchange that refuses publishes.
const LANE_BACKOFF: Backoff = Backoff {
    first_ms: 1000,
    max_ms: 30_000,
};

/// Why [`Engine::run`] returned.
#[allow(clippy::large_enum_variant)] // moved once per message or state change: boxing buys nothing
pub(super) enum Exit {
    /// The command channel closed: nackd is stopping.
    Stopped,
    /// The replica found the local store stale: here it is, committed,
    /// to be rebuilt.
    Stale(Log),
}

/// What the engine keeps per vhost: its wheel and its republisher.
pub(super) struct Vhost {
    name: Arc<str>,
    /// Held messages of the vhost by due time.
    wheel: Wheel<u64>,
    /// Taken out of the wheel (due), waiting for room in the republisher:
    /// `ready[next..]`. One vector, refilled in place from the wheel.
    ready: Vec<Slot>,
    next: usize,
    republisher: Option<Republisher>,
    /// Handed to the republisher and not reported yet: count and bytes.
    outstanding: usize,
    pub(super) pending_bytes: u64,
    pending_gauge: Gauge,
}

/// A message handed to a republisher, until its report.
pub(super) struct Handed {
    vhost: u32,
    size: u64,
    queue: u32,
    /// Published to its queue (exchange `""`), not to an exchange.
    queue_route: bool,
    exchange: Arc<str>,
}

pub(super) struct Engine {
    writer: std::sync::mpsc::Sender<WriteOp<PutCtx>>,
    /// The store thread, joined when the engine stops (the log comes back).
    store: Option<store::Writer<PutCtx>>,
    events: mpsc::UnboundedReceiver<store::Event<PutCtx>>,
    reports: mpsc::UnboundedReceiver<Report>,
    /// The replica and the parks waiting on it, when there is one.
    pub(super) link: Option<link::Link>,
    /// Until when this process may hand messages to its republishers: the
    /// replica's lease, checked on the monotonic clock at each firing, so a
    /// process that was stopped fires nothing on the state it last saw.
    fence: Arc<Fence>,
    ready: Arc<super::Readiness>,
    pub(super) reader: Reader,
    pub(super) ledger: Ledger,
    pub(super) clock: Clock,
    pub(super) vhosts: Vec<Vhost>,
    connector: Connector,
    pub(super) options: Options,
    reports_tx: mpsc::UnboundedSender<Report>,
    next_id: u64,
    metrics: Arc<Metrics>,
    handed: HashMap<u64, Handed>,
    /// Exchanges (of a vhost) that refuse every publish.
    pub(super) lanes: Blocks<(u32, Arc<str>)>,
    /// Queues that are gone.
    pub(super) gone: Blocks<u32>,
    default_exchange: Arc<str>,
    /// The last pass stopped on its budget: run again at once.
    more: bool,
    /// Why nothing is fired (the store cannot record completions), and
    /// since when.
    pub(super) paused: Option<(crate::metrics::PauseReason, Instant)>,
    /// The republisher tasks, waited for at shutdown.
    republishers: TaskTracker,
    /// The store's older segments, being read beside the engine after a
    /// start ([`Engine::read_backlog`]).
    backlog: Option<tokio::sync::oneshot::Receiver<std::io::Result<(Recovered, store::Segments)>>>,
    /// Recovered messages not scheduled yet ([`Engine::load_step`]).
    loading: Option<Loading>,
    /// Since when the store's writer works on its batch ([`Engine::watch_store`]).
    store_busy: Arc<store::Busy>,
}

/// Messages recovered after the engine started, scheduled a step at a time
/// so that parks and firing go on meanwhile (10 M take seconds).
struct Loading {
    total: usize,
    held: std::vec::IntoIter<(u64, u64, Loc)>,
    meta: std::vec::IntoIter<HeldMeta>,
    /// Recovery's queue numbers, as the ledger interned them.
    queues: Vec<u32>,
}

/// Recovered messages scheduled per turn of the engine's loop.
const LOAD_STEP: usize = 65_536;

/// How often the engine looks whether the store stalls.
const STALL_CHECK: Duration = Duration::from_millis(500);

/// How long after a failed read of the older segments it is tried again.
const BACKLOG_RETRY: Duration = if cfg!(test) {
    Duration::from_millis(100)
} else {
    Duration::from_secs(10)
};

impl Engine {
    /// An engine over an opened log and what its recovery found; its store
    /// thread starts now.
    pub(super) fn new(
        log: Log,
        recovered: Recovered,
        start: &super::Start,
        replica: Option<crate::replica::Replica>,
        ready: Arc<super::Readiness>,
    ) -> Self {
        let (reports_tx, reports) = mpsc::unbounded_channel();
        let (events_tx, events) = mpsc::unbounded_channel();
        let (clock, connector) = (start.clock.clone(), start.connector.clone());
        let (options, metrics) = (start.options.clone(), start.metrics.clone());
        let probe_ms = options.queue_gone.probe_interval.as_millis() as u64;
        // Before anything is scheduled: a wall clock that went back since
        // the store last wrote must not make its messages wait longer (nor
        // what is held from now on early, once the wall clock is set right).
        // (Checked when the log opened: a damaged file stopped startup.)
        if let Ok(Some(ms)) = store::read_clock_mark(log.dir()) {
            let behind = clock.raise_to_ms(ms);
            if !behind.is_zero() {
                warn!(behind = ?behind, "the wall clock is behind the time the store last recorded (it was set back): nackd's clock goes on from that time");
            }
        }
        let reader = log.reader();
        let writer = store::spawn_writer(log, events_tx, metrics.clone(), clock.clone());
        let paused = writer.paused;
        let store_busy = writer.busy.clone();
        let fence = replica
            .as_ref()
            .map_or_else(Fence::always, crate::replica::Replica::fence);
        let mut options = options;
        options.republish.fence = fence.clone();
        let mut engine = Self {
            fence,
            reader,
            writer: writer.tx.clone(),
            store: Some(writer),
            events,
            reports,
            link: replica.map(link::Link::new),
            ready,
            ledger: Ledger::new(metrics.clone()),
            clock,
            vhosts: Vec::new(),
            connector,
            options,
            reports_tx,
            next_id: recovered.next_id,
            metrics,
            handed: HashMap::new(),
            lanes: Blocks::new(LANE_BACKOFF),
            gone: Blocks::new(Backoff {
                first_ms: probe_ms,
                max_ms: probe_ms,
            }),
            default_exchange: Arc::from(""),
            more: false,
            paused: None,
            republishers: TaskTracker::new(),
            backlog: None,
            loading: None,
            store_busy,
        };
        if !recovered.held.is_empty() {
            engine.load(recovered);
        }
        engine.on_firing(paused);
        engine
    }

    /// Reads the store's older segments on a thread of their own while the
    /// engine parks and fires new messages; they join the engine (and the
    /// store's bookkeeping) once read.
    ///
    /// A read that fails is tried again every [`BACKLOG_RETRY`] while the
    /// engine runs: the store stays "recovering" meanwhile (nothing is
    /// reclaimed, and `/readyz` and `nackd_store_recovering` say so).
    pub(super) fn read_backlog(&mut self, mut backlog: store::Backlog) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.metrics.store_recovering.set(1);
        let span = tracing::info_span!("store_recovery");
        let metrics = self.metrics.clone();
        let spawned = std::thread::Builder::new()
            .name("nackd-recover".into())
            .spawn(move || {
                let _span = span.entered();
                loop {
                    match backlog.read() {
                        Ok(read) => return drop(tx.send(Ok(read))),
                        Err(e) => {
                            metrics.store_errors.inc();
                            tracing::error!(error = %e, retry_in = ?BACKLOG_RETRY, "store: cannot read the older segments; their messages wait, the read is tried again");
                        }
                    }
                    std::thread::sleep(BACKLOG_RETRY);
                    if tx.is_closed() {
                        return; // the engine stopped
                    }
                }
            });
        match spawned {
            Ok(_) => self.backlog = Some(rx),
            Err(e) => self.on_backlog(Err(e)),
        }
    }

    /// The older segments are read: the store merges their bookkeeping
    /// (before any delete of theirs, which the same queue brings later),
    /// then their messages are scheduled.
    fn on_backlog(&mut self, read: std::io::Result<(Recovered, store::Segments)>) {
        self.backlog = None;
        match read {
            Ok((recovered, segments)) => {
                self.metrics
                    .store_damaged_bytes
                    .inc_by(recovered.damaged_bytes());
                self.write(WriteOp::Merge(segments));
                self.next_id = self.next_id.max(recovered.next_id);
                tracing::info!(
                    held = recovered.held.len(),
                    "store recovered: scheduling its messages"
                );
                self.start_loading(recovered);
            }
            Err(e) => {
                // The reading thread died. New messages are held and fire
                // as usual; the older ones stay on disk, untouched (nothing
                // is reclaimed), for the next start to read: the store
                // stays "recovering" so that it shows.
                self.metrics.store_errors.inc();
                tracing::error!(error = %e, "store: cannot read the older segments; their messages wait for a restart");
            }
        }
    }

    /// Schedules what recovery found, oldest first: overdue messages fire
    /// in due order.
    fn load(&mut self, recovered: Recovered) {
        self.start_loading(recovered);
        self.load_step(usize::MAX);
    }

    /// Takes what recovery found, to schedule [`LOAD_STEP`] at a time.
    fn start_loading(&mut self, recovered: Recovered) {
        let queues = recovered
            .queues
            .iter()
            .map(|(vhost, queue)| self.ledger.intern(vhost, queue))
            .collect();
        self.loading = Some(Loading {
            total: recovered.held.len(),
            held: recovered.held.into_iter(),
            meta: recovered.meta.into_iter(),
            queues,
        });
    }

    /// Schedules up to `n` more recovered messages; when none is left, the
    /// store counts as recovered.
    fn load_step(&mut self, n: usize) {
        let Some(mut loading) = self.loading.take() else {
            return;
        };
        self.ledger.tick(self.clock.now_ms());
        for ((id, due, loc), mut meta) in loading.held.by_ref().zip(loading.meta.by_ref()).take(n) {
            meta.queue = loading.queues[meta.queue as usize];
            if self.ledger.get(id).is_some() {
                // A NEXT_ID lowered by hand gave this id to a message
                // parked since the start (the merge reports it): the newer
                // record is the one a restart keeps, and the one whose
                // session was answered. The older one is not held, and
                // its record is released so that its segment can go.
                warn!(id, "store: an older message has the id of one parked since the start (NEXT_ID was behind): the older one is not held");
                self.tell_store(StoreOp::Release { loc });
                continue;
            }
            self.ledger.insert(id, Entry::new(loc, due, meta));
            self.schedule(id, due);
        }
        if loading.held.len() > 0 {
            self.loading = Some(loading);
            return;
        }
        debug_assert!(loading.meta.len() == 0);
        info!(
            held = loading.total,
            "store recovered: its messages are scheduled"
        );
        // Last: whoever reads it as 0 finds every message scheduled.
        self.metrics.store_recovering.set(0);
    }

    /// Runs until nackd stops or the replica finds the store stale.
    pub(super) async fn run(
        mut self,
        commands: &mut mpsc::UnboundedReceiver<Command>,
        adopts: &mut mpsc::Receiver<crate::replica::Adopt>,
        stop: &tokio_util::sync::CancellationToken,
    ) -> Exit {
        self.on_lease();
        let mut alarm = Alarm::new(self.clock.clone());
        let mut stall_check = tokio::time::interval(STALL_CHECK);
        stall_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let exit = loop {
            self.watch_store();
            let wake = match self.may_fire() {
                true => self.next_wake().map(|us| self.clock.instant_at_us(us)),
                false => None,
            };
            alarm.set(wake);
            let fence = self.fence.clone();
            let extended = fence.extended();
            tokio::pin!(extended);
            let fenced = self.fenced();
            tokio::select! {
                _ = &mut extended, if fenced => {}
                _ = stop.cancelled() => {
                    self.apply_queued(commands);
                    break Exit::Stopped;
                }
                command = commands.recv() => match command {
                    Some(Command::Park(park, reply)) => self.park(park, reply),
                    Some(Command::Cancel(id)) => self.forget(id),
                    Some(Command::Admin(command)) => self.on_admin(command),
                    None => break Exit::Stopped,
                },
                Some(event) = self.events.recv() => match event {
                    store::Event::Written(w) => self.on_written(w),
                    store::Event::Relocated(copies) => copies.into_iter().for_each(|c| self.on_relocated(c)),
                    store::Event::Firing(paused) => self.on_firing(paused),
                },
                Some(report) = self.reports.recv() => self.on_report(report),
                read = backlog_read(&mut self.backlog) => self.on_backlog(read),
                _ = std::future::ready(()), if self.loading.is_some() => self.load_step(LOAD_STEP),
                Some(adopt) = adopts.recv(), if self.link.is_some() => self.on_adopt(adopt),
                event = link::event(&mut self.link) => match event {
                    link::Event::Answer(answer) => self.on_replicated(answer),
                    link::Event::Lease => self.on_lease(),
                    link::Event::Stale => break Exit::Stale(self.stop_store()),
                    link::Event::Resync => break Exit::Stale(self.hand_back().await),
                },
                _ = alarm.rings(), if wake.is_some() => {}
                _ = stall_check.tick() => {}
            }
            if self.may_fire() {
                self.fire();
            }
        };
        if matches!(exit, Exit::Stopped) {
            self.stop_republishers().await;
            self.stop_store();
        }
        exit
    }

    /// At a stop, the commands already queued are applied before the store
    /// is joined: the sessions ended just before (shutdown drains them
    /// first), and the last thing a session does is cancel the copies it
    /// could not ack. Dropped, those copies would be republished after a
    /// restart while the broker redelivers their deliveries: twice. A park
    /// that comes this late is refused (its nack goes to the broker).
    fn apply_queued(&mut self, commands: &mut mpsc::UnboundedReceiver<Command>) {
        while let Ok(command) = commands.try_recv() {
            match command {
                Command::Cancel(id) => self.forget(id),
                Command::Park(park, reply) => {
                    let result = Err(StoreError::Io("nackd is stopping".into()));
                    let _ = reply.send(Parked {
                        key: park.key,
                        result,
                    });
                }
                Command::Admin(_) => {}
            }
        }
    }

    /// Nothing more is fired: each republisher's queue closes and its
    /// task ends (what it did not get confirmed stays held, and goes
    /// again after a restart).
    async fn stop_republishers(&mut self) {
        for vhost in &mut self.vhosts {
            vhost.republisher = None;
        }
        self.republishers.close();
        let ended = tokio::time::timeout(REPUBLISHERS_STOP, self.republishers.wait()).await;
        if ended.is_err() {
            warn!(
                open = self.republishers.len(),
                "republishers did not end in time; their connections are dropped"
            );
        }
    }

    /// Whether the store stalls: its writer has worked on one batch (a
    /// write, an fsync) for the settle timeout, a stuck disk. Sessions give
    /// their claims up by then (the deliveries go back to the broker);
    /// while it lasts nothing new is claimed (nacks are deferred at once),
    /// `/readyz` names the store, and `nackd_store_stalls_total` counts it.
    /// Nothing is lost: what the store answers later is held, or deleted if
    /// its session gave it up.
    fn watch_store(&mut self) {
        let limit = nackd_core::session::SETTLE_TIMEOUT.as_micros() as u64;
        let now = self.clock.now_us();
        let busy = self.store_busy.since_us();
        let stalled = busy.is_some_and(|since| now.saturating_sub(since) >= limit);
        if stalled == self.ready.stalled() {
            return;
        }
        self.ready.set_stalled(stalled);
        self.metrics.store_stalled.set(i64::from(stalled));
        if stalled {
            self.metrics.store_stalls.inc();
            let for_ms = busy.map_or(0, |since| now.saturating_sub(since) / 1000);
            warn!(
                for_ms,
                "store: a write has not returned within the settle timeout (a stuck disk?): nacks are deferred, /readyz says not ready"
            );
        } else {
            info!("store: writes return again: nacks are held again");
        }
    }

    /// Whether due messages may fire: while the store can record their
    /// completion, and the replica's lease is held if there is one.
    fn may_fire(&self) -> bool {
        self.paused.is_none() && self.has_lease() && self.fence.holds()
    }

    /// The lease is held but its fence lapsed (the broker's answer to the
    /// last probe is late, or this process was stopped): firing waits for
    /// the next answer.
    fn fenced(&self) -> bool {
        self.paused.is_none() && self.has_lease() && !self.fence.holds()
    }

    /// Whether this instance acts for its id: always without a replica.
    fn has_lease(&self) -> bool {
        self.link.as_ref().is_none_or(link::Link::holds_lease)
    }

    /// The lease came or went, or the stream: sessions may claim (or not)
    /// from now on.
    fn on_lease(&mut self) {
        let ready = self
            .link
            .as_ref()
            .map_or(super::Ready::Ready, link::Link::ready);
        self.ready.set(ready);
    }

    /// Stops for a reseed: nothing more is fired, what the republishers
    /// got confirmed meanwhile is completed, and the store is handed back
    /// with everything committed.
    async fn hand_back(&mut self) -> Log {
        self.ready.set(super::Ready::NoReplica);
        self.stop_republishers().await;
        while let Ok(report) = self.reports.try_recv() {
            self.on_report(report);
        }
        self.stop_store()
    }

    /// Ends the store thread once everything sent to it is committed, and
    /// takes the log back.
    fn stop_store(&mut self) -> Log {
        let (dead, _) = std::sync::mpsc::channel();
        self.writer = dead;
        let writer = self.store.take().expect("the store thread runs");
        writer.join().expect("the store thread ended cleanly")
    }

    /// The engine's state for vhost `v` (created on first use).
    pub(super) fn vhost(&mut self, v: u32) -> &mut Vhost {
        while self.vhosts.len() <= v as usize {
            let name = self.ledger.vhosts()[self.vhosts.len()].clone();
            let labels = VhostLabels {
                vhost: name.to_string(),
            };
            self.vhosts.push(Vhost {
                pending_gauge: self
                    .metrics
                    .republish_pending_bytes
                    .get_or_create_owned(&labels),
                name,
                wheel: Wheel::new(self.clock.now_us()),
                ready: Vec::new(),
                next: 0,
                republisher: None,
                outstanding: 0,
                pending_bytes: 0,
            });
        }
        &mut self.vhosts[v as usize]
    }

    fn tell_store(&self, op: StoreOp) {
        self.write(match op {
            StoreOp::Del { id, loc } => WriteOp::Del { id, loc },
            StoreOp::Release { loc } => WriteOp::Release { loc },
        });
    }

    fn write(&self, op: WriteOp<PutCtx>) {
        if let Err(std::sync::mpsc::SendError(WriteOp::Put {
            ctx: PutCtx::Park { key, reply, .. },
            ..
        })) = self.writer.send(op)
        {
            let result = Err(StoreError::Io("store thread is gone".into()));
            let _ = reply.send(Parked { key, result });
        }
    }

    fn park(&mut self, park: Park, reply: mpsc::UnboundedSender<Parked>) {
        let id = self.next_id;
        self.next_id += 1;
        // The wheel keeps the exact due time; the record keeps it rounded up
        // to its millisecond, so that a message recovered after a restart is
        // never early either.
        // Saturating: a huge delay (an `x-delay` is the publisher's number)
        // waits as good as forever; it must not wrap around to a short one.
        let delay_us = u64::try_from(park.delay.as_micros()).unwrap_or(u64::MAX);
        let due_us = self.clock.now_us().saturating_add(delay_us);
        let held = Held {
            id,
            vhost: park.vhost,
            queue: park.queue,
            due_ms: due_us.div_ceil(1000),
            retry: park.retry,
            route: park.route,
            on_return: park.on_return,
            header: park.header,
            body: park.body,
        };
        let meta = held.meta(self.ledger.intern(&held.vhost, &held.queue));
        let keep_if_gone = held.route.is_delayed();
        let ctx = PutCtx::Park {
            keep_if_gone,
            ticket: park.ticket,
            key: park.key,
            reply,
            meta,
            due_us,
        };
        self.put_new(held, ctx);
    }

    /// Writes a new message to the store, and to the replica when there is
    /// one; it is held once both have it.
    pub(super) fn put_new(&mut self, held: Held, ctx: PutCtx) {
        self.put_new_from(held, None, ctx)
    }

    /// [`Engine::put_new`]; `from`: the adoption that parks it (the
    /// replica gets a moved put, which counts once that is committed).
    pub(super) fn put_new_from(
        &mut self,
        held: Held,
        from: Option<crate::replica::Intent>,
        ctx: PutCtx,
    ) {
        if let Some(link) = &mut self.link {
            let record = match from {
                Some(from) => crate::replica::Record::moved(&held, from),
                None => crate::replica::Record::put(&held, false),
            };
            link.append(held.id, record);
        }
        self.write(WriteOp::Put {
            held,
            replaces: None,
            ctx,
        });
    }

    fn on_written(&mut self, w: Written<PutCtx>) {
        if matches!(w.ctx, PutCtx::Reroute) {
            return self.on_rerouted(w.id, w.result);
        }
        let Some(link) = &mut self.link else {
            return self.parked(w, Ok(()));
        };
        if let Some((w, replicated)) = link.written(w) {
            self.parked(w, replicated);
        } // else the replica has not answered yet
    }

    /// A new message's store answer, with the replica's (`Ok` without one).
    pub(super) fn parked(&mut self, w: Written<PutCtx>, replicated: Result<(), String>) {
        let w = match (w.result, replicated) {
            (Ok(loc), Ok(())) => Written {
                result: Ok(loc),
                ..w
            },
            (Ok(loc), Err(e)) => {
                // Stored here but not surely in the replica: not held at
                // all. The stream may have it all the same (a confirm lost
                // with its connection): a completion keeps a rebuild or an
                // adoption from bringing it back.
                self.tell_store(StoreOp::Del { id: w.id, loc });
                if let Some(link) = &self.link {
                    link.replica.done(w.id);
                }
                let result = Err(StoreError::Io(format!("replica: {e}")));
                Written { result, ..w }
            }
            (Err(e), _) => {
                // Not held; the stream may have it (even if its answer was
                // an error): completed there too.
                if let Some(link) = &self.link {
                    link.replica.done(w.id);
                }
                Written {
                    result: Err(e),
                    ..w
                }
            }
        };
        match (w.ctx, w.result) {
            (
                PutCtx::Park {
                    key,
                    reply,
                    meta,
                    due_us,
                    keep_if_gone,
                    ticket,
                },
                Ok(loc),
            ) => {
                self.ledger.tick(self.clock.now_ms());
                self.ledger.insert(w.id, Entry::new(loc, w.due_ms, meta));
                if !ticket.stored() {
                    // Its session gave it up (the settle timeout ran out):
                    // the delivery went back to the broker, or the
                    // publisher got a nack and may have published again.
                    // Firing this copy would deliver it twice: it is
                    // deleted, durably, as a completion is.
                    info!(
                        id = w.id,
                        "stored after its session gave it up: deleted, never fired"
                    );
                    let result = Err(StoreError::Io("given up by its session".into()));
                    let _ = reply.send(Parked { key, result });
                    return self.forget(w.id);
                }
                let parked = Parked {
                    key,
                    result: Ok(w.id),
                };
                if reply.send(parked).is_err() && !keep_if_gone {
                    // The session is gone and never acked the delivery: the
                    // broker has it back and redelivers it. Holding it too
                    // would deliver it twice.
                    debug!(
                        id = w.id,
                        "parked for a session that is gone: completing it"
                    );
                    return self.forget(w.id);
                }
                self.schedule_us(w.id, due_us);
            }
            (PutCtx::Park { key, reply, .. }, Err(e)) => {
                let _ = reply.send(Parked {
                    key,
                    result: Err(e),
                });
            }
            (PutCtx::Adopt { reply, meta }, Ok(loc)) => {
                // Held, not scheduled: it fires once its adoption is
                // committed ([`crate::replica::Adopt::Release`]), so that
                // an adopter killed half way has fired none of them.
                self.ledger.tick(self.clock.now_ms());
                self.ledger.insert(w.id, Entry::new(loc, w.due_ms, meta));
                let _ = reply.send(Ok(w.id));
            }
            (PutCtx::Adopt { reply, .. }, Err(e)) => {
                let _ = reply.send(Err(e.to_string()));
            }
            (PutCtx::Reroute, result) => self.on_rerouted(w.id, result),
        }
    }

    fn on_rerouted(&mut self, id: u64, result: Result<Loc, StoreError>) {
        let (op, held) = self
            .ledger
            .rewritten(id, result.as_ref().map(|l| *l).map_err(|_| ()));
        op.into_iter().for_each(|op| self.tell_store(op));
        if !held {
            return;
        }
        match result {
            Ok(_) => {
                self.ledger.rerouted(id);
                let entry = self.ledger.get_mut(id).expect("still held");
                entry.inflight = false;
                // The return was a failed attempt: its lateness was observed already.
                entry.attempts = entry.attempts.saturating_add(1);
                self.schedule(id, self.clock.now_ms());
            }
            Err(e) => self.set_aside(
                id,
                crate::metrics::BlockReason::Store,
                format!("cannot store the re-route ({e})"),
            ),
        }
    }

    fn on_relocated(&mut self, copy: Relocation) {
        let op = self.ledger.relocated(copy.id, copy.from, copy.to);
        self.tell_store(op);
    }

    /// (Re)arms the wheel for `id` at `at_ms`; wheel entries armed before
    /// are stale.
    pub(super) fn schedule(&mut self, id: u64, at_ms: u64) {
        self.schedule_us(id, at_ms.saturating_mul(1000));
    }

    /// (Re)arms the wheel for `id` at `at_us`.
    fn schedule_us(&mut self, id: u64, at_us: u64) {
        let Some(entry) = self.ledger.get(id) else {
            return;
        };
        let v = self.ledger.vhost_of(entry.meta.queue);
        let armed = self.vhost(v).wheel.insert(at_us, id);
        self.ledger.get_mut(id).expect("checked above").armed_us = armed;
    }

    /// Completes a message: it leaves the ledger now and the store with a
    /// delete record (once a re-route being written has its answer).
    pub(super) fn forget(&mut self, id: u64) {
        let Some((entry, op)) = self.ledger.complete(id) else {
            return;
        };
        if let Some(op) = op {
            self.tell_store(op);
        }
        if let Some(link) = &self.link {
            link.replica.done(id);
        }
        let queue = entry.meta.queue;
        if self.ledger.count(queue) == 0 {
            self.queue_emptied(queue);
        }
    }
}

/// The older segments' contents, once read (pending while there is none).
async fn backlog_read(
    backlog: &mut Option<
        tokio::sync::oneshot::Receiver<std::io::Result<(Recovered, store::Segments)>>,
    >,
) -> std::io::Result<(Recovered, store::Segments)> {
    match backlog {
        Some(rx) => rx
            .await
            .unwrap_or_else(|_| Err(std::io::Error::other("the store's recovery thread died"))),
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::{ClaimKey, Command, RetryHandle};
    use crate::store::{Options, Route};
    use bytes::Bytes;
    use std::time::Duration;
    use tokio_util::sync::CancellationToken;

    /// What an engine on `dir` needs, its broker unreachable.
    fn start(dir: &std::path::Path) -> crate::retry::Start {
        let upstream = crate::config::Upstream {
            address: Some("127.0.0.1:9".into()),
            ..Default::default()
        };
        crate::retry::Start {
            dir: dir.to_owned(),
            store: Options::default(),
            replica: None,
            connector: Connector::new(&upstream).unwrap(),
            options: crate::retry::Options::new(&Default::default(), "guest".into()),
            metrics: Metrics::new(),
            clock: nackd_core::clock::Clock::start(),
        }
    }

    fn park(tag: u64) -> Park {
        Park {
            key: ClaimKey {
                channel: 1,
                epoch: 1,
                tag,
                seq: tag,
            },
            vhost: Arc::from("/"),
            queue: Arc::from("q"),
            delay: Duration::from_secs(3600),
            retry: 1,
            route: Route::Queue,
            on_return: None,
            header: Bytes::from_static(b"h"),
            body: Bytes::from_static(b"body"),
            ticket: Default::default(),
        }
    }

    /// Issue 33, item 5: a delayed publish whose session gave it up (the
    /// store answered after the settle timeout; the publisher got a nack,
    /// and its connection ended) is not held when the store answers at
    /// last: deleted, on disk too, so that neither this process nor a
    /// restart fires it (its publisher republished it).
    #[tokio::test]
    async fn a_park_given_up_by_its_session_is_deleted_not_fired() {
        let dir = tempfile::tempdir().unwrap();
        let (handle, _engine): (RetryHandle, _) =
            crate::retry::start(start(dir.path()), CancellationToken::new());
        let mut withdrawn = park(1);
        withdrawn.route = Route::Delayed {
            exchange: "x".into(),
            routing_key: "k".into(),
        };
        assert!(withdrawn.ticket.give_up(), "the session gives it up first");
        let (gone, dropped) = mpsc::unbounded_channel();
        drop(dropped); // and its session ended
        assert!(handle.park(withdrawn, &gone));
        let (alive, mut answers) = mpsc::unbounded_channel();
        assert!(handle.park(park(2), &alive));
        let answer = answers.recv().await.unwrap();
        let kept = answer.result.expect("the other park is held");
        let (listed, total) = handle.list(None, None, 10).await.unwrap();
        assert_eq!(total, 1, "only the park still standing is held");
        assert_eq!(listed[0].0.id, kept);
        for _ in 0..500 {
            if crate::store::inspect::held(dir.path()).unwrap().len() == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the given-up copy is still on disk");
    }

    /// Issue 12, item 6: a session that ended before its message was
    /// stored never acked it, so the broker redelivers it: nackd must not
    /// hold it too.
    #[tokio::test]
    async fn a_park_for_a_session_that_is_gone_is_completed() {
        let dir = tempfile::tempdir().unwrap();
        let (handle, _engine): (RetryHandle, _) =
            crate::retry::start(start(dir.path()), CancellationToken::new());
        let (gone, dropped) = mpsc::unbounded_channel();
        drop(dropped);
        assert!(handle.park(park(1), &gone));
        let (alive, mut answers) = mpsc::unbounded_channel();
        assert!(handle.park(park(2), &alive));
        let answer = answers.recv().await.unwrap();
        assert!(answer.result.is_ok());
        let (listed, total) = handle.list(None, None, 10).await.unwrap();
        assert_eq!(
            total, 1,
            "only the session that is still there has one held"
        );
        assert_eq!(listed[0].0.id, answer.result.unwrap());
        // And its delete reaches the disk: a restart does not bring it back.
        for _ in 0..500 {
            if crate::store::inspect::held(dir.path()).unwrap().len() == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the orphan is still on disk");
    }

    /// Shutdown: stopping the engine ends its thread only once the store
    /// writer committed and was joined (the store's lock is free again).
    #[tokio::test]
    async fn a_stopped_engine_has_released_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let (handle, engine): (RetryHandle, _) =
            crate::retry::start(start(dir.path()), CancellationToken::new());
        let (reply, mut answers) = mpsc::unbounded_channel();
        assert!(handle.park(park(1), &reply));
        let id = answers.recv().await.unwrap().result.unwrap();
        engine.stop(Duration::from_secs(10)).await;
        let (_log, recovered) =
            Log::open(dir.path(), Options::default()).expect("the lock was released");
        let held: Vec<u64> = recovered.held.iter().map(|h| h.0).collect();
        assert_eq!(held, [id]);
        assert!(!handle.park(park(2), &reply), "the engine is gone");
    }

    /// Shutdown: the sessions end first, and the last thing a session does
    /// is cancel the copies it could not ack (the broker requeued their
    /// deliveries). Those cancels are queued when the engine is told to
    /// stop: they must be applied (and committed) before it stops, or the
    /// copies come back after a restart and are delivered twice.
    #[tokio::test]
    async fn cancels_queued_before_the_stop_are_applied() {
        let dir = tempfile::tempdir().unwrap();
        const N: u64 = 16;
        // Hold N messages, then stop cleanly.
        let (handle, engine): (RetryHandle, _) =
            crate::retry::start(start(dir.path()), CancellationToken::new());
        let (reply, mut answers) = mpsc::unbounded_channel();
        for tag in 1..=N {
            assert!(handle.park(park(tag), &reply));
        }
        let mut ids = Vec::new();
        for _ in 0..N {
            ids.push(answers.recv().await.unwrap().result.unwrap());
        }
        engine.stop(Duration::from_secs(10)).await;
        // A new engine on that store: every held copy is cancelled, and
        // shutdown comes right behind the cancels.
        let (log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
        assert_eq!(recovered.held.len() as u64, N);
        let start = start(dir.path());
        let ready = crate::retry::Readiness::new();
        let engine = Engine::new(log, recovered, &start, None, ready);
        let (tx, mut commands) = mpsc::unbounded_channel();
        for id in &ids {
            tx.send(Command::Cancel(*id)).unwrap();
        }
        let stop = CancellationToken::new();
        stop.cancel();
        let (_adopt_tx, mut adopts) = mpsc::channel(1);
        let exit = engine.run(&mut commands, &mut adopts, &stop).await;
        assert!(matches!(exit, Exit::Stopped));
        let (_log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
        assert!(
            recovered.held.is_empty(),
            "cancelled before the stop, still held: {:?}",
            recovered.held
        );
    }

    /// Issue 21, item 6: a message stored here whose replica append
    /// failed is not held (its nack is deferred): its local copy goes, and
    /// a completion goes to the stream, which may have it all the same (a
    /// confirm lost with its connection), so that no rebuild or adoption
    /// brings it back while the broker redelivers it too.
    #[tokio::test]
    async fn a_failed_replica_append_deletes_the_copy_and_completes_it_in_the_stream() {
        use crate::replica::{Command as ToReplica, Record, ReplicaError, State};
        let dir = tempfile::tempdir().unwrap();
        let (log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
        let start = start(dir.path());
        let (replica, mut to_replica, state) = crate::replica::Replica::detached("test");
        state.send(State::Active).unwrap();
        let ready = crate::retry::Readiness::new();
        let engine = Engine::new(log, recovered, &start, Some(replica), ready);
        let (tx, mut commands) = mpsc::unbounded_channel();
        let (reply, mut answers) = mpsc::unbounded_channel();
        tx.send(Command::Park(park(1), reply)).unwrap();
        let stop = CancellationToken::new();
        let (_adopt_tx, mut adopts) = mpsc::channel(1);
        let replica_side = async {
            let appended = match to_replica.recv().await {
                Some(ToReplica::Append { record, reply }) => {
                    let _ = reply.send(Err(ReplicaError("connection lost".into())));
                    record
                }
                _ => panic!("the park is appended to the replica first"),
            };
            let Record::Put { record, .. } = appended else {
                panic!("a put: {appended:?}");
            };
            let id = crate::store::record::id_of(&record).unwrap();
            let answer = answers.recv().await.unwrap();
            assert!(answer.result.is_err(), "not held: {:?}", answer.result);
            let completed = tokio::time::timeout(Duration::from_secs(5), async {
                loop {
                    match to_replica.recv().await {
                        Some(ToReplica::Done(done)) => return done,
                        Some(_) => {}
                        None => panic!("the engine dropped the replica"),
                    }
                }
            })
            .await
            .expect("a completion for the message the replica may hold");
            assert_eq!(completed, id);
            stop.cancel();
        };
        let (exit, ()) = tokio::join!(engine.run(&mut commands, &mut adopts, &stop), replica_side);
        assert!(matches!(exit, Exit::Stopped));
        let (_log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
        assert!(recovered.held.is_empty(), "the local copy is deleted");
    }

    /// Issue 33, item 7: the host slept (its monotonic clock stood still,
    /// its wall clock went on) before a nack. The stored due time is the
    /// wall clock at the nack plus the delay: a restart does not fire it
    /// early by the time slept.
    #[tokio::test]
    async fn a_due_time_after_a_suspend_is_the_wall_clock_at_the_nack_plus_the_delay() {
        use nackd_core::clock::Clock;
        const T: u64 = 1_800_000_000_000;
        const SLEPT_MS: u64 = 600_000;
        let dir = tempfile::tempdir().unwrap();
        let clock = Clock::manual(T);
        let mut started = start(dir.path());
        started.clock = clock.clone();
        let (handle, engine): (RetryHandle, _) =
            crate::retry::start(started, CancellationToken::new());
        clock.step_wall(SLEPT_MS as i64);
        let (reply, mut answers) = mpsc::unbounded_channel();
        let parked = park(1);
        let delay_ms = parked.delay.as_millis() as u64;
        assert!(handle.park(parked, &reply));
        answers.recv().await.unwrap().result.unwrap();
        engine.stop(Duration::from_secs(10)).await;
        let (_log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
        let due = recovered.held[0].1;
        assert!(
            due >= T + SLEPT_MS + delay_ms,
            "stored due {due} is {} ms before the wall clock at the nack plus the delay",
            (T + SLEPT_MS + delay_ms).saturating_sub(due)
        );
    }

    /// Issue 33, item 7: a restart after the wall clock was set back. The
    /// message waits for the time it had left when the store last wrote:
    /// not less (never early), and not the step longer.
    #[tokio::test]
    async fn a_restart_on_a_wall_clock_set_back_holds_for_the_time_that_was_left() {
        use nackd_core::clock::Clock;
        const T: u64 = 1_800_000_000_000;
        const BACK_MS: u64 = 600_000;
        let dir = tempfile::tempdir().unwrap();
        let mut before = start(dir.path());
        before.clock = Clock::manual(T);
        let (handle, engine): (RetryHandle, _) =
            crate::retry::start(before, CancellationToken::new());
        let (reply, mut answers) = mpsc::unbounded_channel();
        let parked = park(1);
        let delay_ms = parked.delay.as_millis() as u64;
        assert!(handle.park(parked, &reply));
        let id = answers.recv().await.unwrap().result.unwrap();
        engine.stop(Duration::from_secs(10)).await;
        // The restart: its wall clock was set back meanwhile.
        let (log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
        let mut after = start(dir.path());
        after.clock = Clock::manual(T - BACK_MS);
        let ready = crate::retry::Readiness::new();
        let engine = Engine::new(log, recovered, &after, None, ready);
        let due = engine.ledger.get(id).expect("held again").due_ms;
        let left = due.saturating_sub(engine.clock.now_ms());
        assert!(left >= delay_ms, "early: {left} ms left of {delay_ms}");
        assert!(
            left < delay_ms + BACK_MS,
            "{left} ms left of {delay_ms}: late by the wall clock's step back"
        );
    }

    /// Writes messages 1..=`n` (due far ahead) to the store in `dir`, as a
    /// nackd that held them before a restart left it.
    fn hold_before_a_restart(dir: &std::path::Path, n: u64) {
        let (mut log, _) = Log::open(dir, Options::default()).unwrap();
        for id in 1..=n {
            let held = Held {
                id,
                vhost: Arc::from("/"),
                queue: Arc::from("q"),
                due_ms: u64::MAX / 2,
                retry: 1,
                route: Route::Queue,
                on_return: None,
                header: Bytes::from_static(b"h"),
                body: Bytes::from_static(b"old"),
            };
            log.put(&held, None).unwrap();
        }
        log.commit().unwrap();
    }

    /// Issue 19: a restart holds nacks at once. With a store full of
    /// messages held before it, a park is answered while the older
    /// segments are still being read, and they are all scheduled after
    /// (in steps: more than one [`LOAD_STEP`] here).
    #[tokio::test]
    async fn a_restart_parks_at_once_and_schedules_what_it_held_after() {
        let dir = tempfile::tempdir().unwrap();
        let before = LOAD_STEP as u64 + 4_000;
        hold_before_a_restart(dir.path(), before);
        let start = start(dir.path());
        let metrics = start.metrics.clone();
        let (handle, engine): (RetryHandle, _) =
            crate::retry::start(start, CancellationToken::new());
        let (reply, mut answers) = mpsc::unbounded_channel();
        assert!(handle.park(park(1), &reply));
        let answer = answers.recv().await.unwrap();
        let id = answer.result.expect("parked while the store recovers");
        assert!(id > before, "a new id, above every old one: {id}");
        let mut total = 0;
        for _ in 0..1000 {
            total = handle.list(None, None, 1).await.unwrap().1;
            if total as u64 == before + 1 && metrics.store_recovering.get() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            total as u64,
            before + 1,
            "every old message scheduled, and the new one"
        );
        assert_eq!(metrics.store_recovering.get(), 0);
        engine.stop(Duration::from_secs(10)).await;
        let (_log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
        assert_eq!(recovered.held.len() as u64, before + 1);
    }

    /// Issue 19: while the store cannot record completions (another
    /// process filled its disk), the engine fires nothing, not even what
    /// an operator fires now; it resumes by itself once the disk has room.
    #[tokio::test]
    async fn nothing_fires_while_the_store_cannot_record_completions() {
        use crate::metrics::PauseReason;
        use crate::retry::admin::Target;
        use std::sync::atomic::{AtomicU64, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let (mut log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
        let disk = Arc::new(AtomicU64::new(1 << 30));
        log.faults.disk = Some(disk.clone());
        let start = start(dir.path());
        let metrics = start.metrics.clone();
        let ready = crate::retry::Readiness::new();
        let engine = Engine::new(log, recovered, &start, None, ready.clone());
        let (tx, mut commands) = mpsc::unbounded_channel();
        let handle = RetryHandle {
            tx,
            ready,
            reseeds: mpsc::unbounded_channel().0,
        };
        let (_adopt_tx, mut adopts) = mpsc::channel(1);
        let stop = CancellationToken::new();
        let wait = |what: &'static str, f: Box<dyn Fn() -> bool>| async move {
            let began = std::time::Instant::now();
            while !f() {
                assert!(began.elapsed() < Duration::from_secs(10), "{what}");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        let test = async {
            let (reply, mut answers) = mpsc::unbounded_channel();
            assert!(handle.park(park(1), &reply) && handle.park(park(2), &reply));
            let one = answers.recv().await.unwrap().result.unwrap();
            let two = answers.recv().await.unwrap().result.unwrap();
            disk.store(0, Ordering::SeqCst); // someone else took every byte
            handle.cancel(one); // a completion: its delete does not fit
            let m = metrics.clone();
            let paused = move || m.firing_paused() == Some(PauseReason::DiskFull);
            wait("paused", Box::new(paused)).await;
            // Fire now: the pass that follows the command fires nothing
            // (the list below is answered after it).
            assert_eq!(handle.fire(Target::Id(two)).await.unwrap(), 1);
            handle.list(None, None, 10).await.unwrap();
            assert_eq!(metrics.published.get(), 0, "fired while paused");
            disk.store(1 << 30, Ordering::SeqCst);
            let m = metrics.clone();
            let resumed = move || m.firing_paused().is_none() && m.published.get() == 1;
            wait("resumed and fired", Box::new(resumed)).await;
            stop.cancel();
        };
        let (exit, ()) = tokio::join!(engine.run(&mut commands, &mut adopts, &stop), test);
        assert!(matches!(exit, Exit::Stopped));
    }

    /// Review 3: with a NEXT_ID lowered by hand, a message parked at the
    /// start takes an id an older record has. The merge reports it; the
    /// engine must not then let the older record replace the parked
    /// message in the ledger: the parked one (acked to the broker) would
    /// never fire, and a cancel of its id would complete the older one.
    /// The newer record is the one a restart keeps: the engine keeps it too.
    #[tokio::test]
    async fn an_older_message_with_a_parked_id_does_not_replace_it() {
        let dir = tempfile::tempdir().unwrap();
        hold_before_a_restart(dir.path(), 3);
        std::fs::write(dir.path().join("NEXT_ID"), "ahead 1\n").unwrap();
        let (log, mut backlog) = Log::open_deferred(dir.path(), Options::default()).unwrap();
        let start = start(dir.path());
        let recovered = Recovered {
            next_id: log.next_id(),
            ..Default::default()
        };
        let ready = crate::retry::Readiness::new();
        let mut engine = Engine::new(log, recovered, &start, None, ready);
        let (reply, mut answers) = mpsc::unbounded_channel();
        engine.park(park(1), reply);
        match engine.events.recv().await.unwrap() {
            store::Event::Written(w) => engine.on_written(w),
            _ => panic!("not the park's answer"),
        }
        let id = answers.recv().await.unwrap().result.unwrap();
        assert_eq!(id, 1, "the id an older record has");
        let parked_due = engine.ledger.get(id).unwrap().due_ms;
        engine.on_backlog(backlog.read());
        engine.load_step(usize::MAX);
        let entry = engine.ledger.get(id).expect("held");
        assert_eq!(
            entry.due_ms, parked_due,
            "the older record replaced the parked one"
        );
        assert_eq!(
            entry.armed_us.div_ceil(1000),
            parked_due,
            "armed for the parked one"
        );
        assert_eq!(
            engine.ledger.len(),
            3,
            "the parked one and the older 2 and 3"
        );
        let log = engine.stop_store();
        assert_eq!(log.mismatched_releases(), 0, "the older record was live");
    }

    /// Review of issue 19: when the older segments cannot be read (an I/O
    /// error), their messages must not wait silently for a restart that
    /// nobody is told to make: the store stays "recovering" (the gauge,
    /// `/readyz`) and the read is tried again, so they fire once it works.
    #[tokio::test]
    async fn a_failed_read_of_the_older_segments_is_tried_again() {
        use crate::store::segment_path;
        let dir = tempfile::tempdir().unwrap();
        hold_before_a_restart(dir.path(), 3);
        let (log, backlog) = Log::open_deferred(dir.path(), Options::default()).unwrap();
        // The first read fails: the segment cannot be read for now.
        let first = segment_path(dir.path(), 1);
        let aside = dir.path().join("aside");
        std::fs::rename(&first, &aside).unwrap();
        let start = start(dir.path());
        let metrics = start.metrics.clone();
        let ready = crate::retry::Readiness::new();
        let recovered = Recovered {
            next_id: log.next_id(),
            ..Default::default()
        };
        let mut engine = Engine::new(log, recovered, &start, None, ready.clone());
        engine.read_backlog(backlog);
        let (tx, mut commands) = mpsc::unbounded_channel();
        let handle = RetryHandle {
            tx,
            ready,
            reseeds: mpsc::unbounded_channel().0,
        };
        let (_adopt_tx, mut adopts) = mpsc::channel(1);
        let stop = CancellationToken::new();
        let test = async {
            let began = std::time::Instant::now();
            while metrics.store_errors.get() == 0 {
                assert!(began.elapsed() < Duration::from_secs(10), "no read error");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(
                metrics.store_recovering.get(),
                1,
                "the older segments are not read: still recovering"
            );
            std::fs::rename(&aside, &first).unwrap();
            let began = std::time::Instant::now();
            loop {
                let total = handle.list(None, None, 1).await.unwrap().1;
                if total == 3 && metrics.store_recovering.get() == 0 {
                    break;
                }
                assert!(
                    began.elapsed() < Duration::from_secs(30),
                    "the older messages never came: {total} held"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            stop.cancel();
        };
        let (exit, ()) = tokio::join!(engine.run(&mut commands, &mut adopts, &stop), test);
        assert!(matches!(exit, Exit::Stopped));
    }
}

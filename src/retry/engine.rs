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
//! [`Engine`] is a coordinator: it owns the store's channels, the ledger
//! and its parts, each with fields of its own, and dispatches every event
//! to them. Only this file writes the engine's fields; each part writes
//! only its own.
//!
//! - `fire`: [`fire::Firing`], the wheels and republishers: what is due
//!   goes to its vhost's republisher, read from the store only as far as
//!   `republish.max_pending_bytes` allows.
//! - `outcome`: [`outcome::Outcomes`], what the broker said, and what is
//!   set aside (blocked exchanges, gone queues).
//! - `link`: the replica, and the parks waiting on it.
//! - `query`: what operators ask (list, fire now, purge, status).
//! - `recovery`: [`recovery::Recovery`], the older segments read beside
//!   the engine after a start, and their messages scheduled a step at a time.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::ledger::{Entry, Ledger, StoreOp};
use super::republish::Report;
use super::timer::Alarm;
use super::{Clock, Command, Park, Parked, Start};
use crate::metrics::{BlockReason, Metrics, PauseReason};
use crate::replica::fence::Fence;
use crate::store::{
    self, Held, HeldMeta, Loc, Log, Reader, Recovered, Relocation, Route, StoreError, WriteOp,
    Written,
};
use fire::Firing;
use nackd_core::ready::{Readiness, Ready};
use outcome::{Action, Admit, Outcomes};
use recovery::Recovery;

mod fire;
mod link;
mod outcome;
pub(super) mod query;
mod recovery;
#[cfg(test)]
mod unroutable_tests;

/// Why a put was made: to answer a session, to adopt another instance's
/// message, or to re-route a message.
pub(super) enum PutCtx {
    Park(ParkCtx),
    Adopt {
        reply: tokio::sync::oneshot::Sender<Result<u64, String>>,
        meta: HeldMeta,
    },
    Reroute,
}

/// A session's park, until the store (and the replica) answer.
pub(super) struct ParkCtx {
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
}

/// Why [`Engine::run`] returned.
#[allow(clippy::large_enum_variant)] // moved once per message or state change: boxing buys nothing
pub(super) enum Exit {
    /// The command channel closed: nackd is stopping.
    Stopped,
    /// The replica found the local store stale: here it is, committed,
    /// to be rebuilt.
    Stale(Log),
}

pub(super) struct Engine {
    writer: std::sync::mpsc::Sender<WriteOp<PutCtx>>,
    /// The store thread, joined when the engine stops (the log comes back).
    store: Option<store::Writer<PutCtx>>,
    events: mpsc::UnboundedReceiver<store::Event<PutCtx>>,
    reports: mpsc::UnboundedReceiver<Report>,
    /// The replica and the parks waiting on it, when there is one.
    link: Option<link::Link>,
    /// Until when this process may hand messages to its republishers: the
    /// replica's lease, checked on the monotonic clock at each firing, so a
    /// process that was stopped fires nothing on the state it last saw.
    fence: Arc<Fence>,
    ready: Arc<Readiness>,
    reader: Reader,
    ledger: Ledger,
    clock: Clock,
    next_id: u64,
    metrics: Arc<Metrics>,
    /// The wheels, the republishers and what they were handed.
    firing: Firing,
    /// The destinations that refuse publishes, and what reports mean.
    outcomes: Outcomes,
    /// The store's older segments being read beside the engine after a
    /// start, and recovered messages not scheduled yet.
    recovery: Recovery,
    /// Since when the store's writer works on its batch ([`Engine::watch_store`]).
    store_busy: Arc<store::Busy>,
}

/// Recovered messages scheduled per turn of the engine's loop.
const LOAD_STEP: usize = 65_536;

/// How often the engine looks whether the store stalls.
const STALL_CHECK: Duration = Duration::from_millis(500);

impl Engine {
    /// An engine over an opened log and what its recovery found; its store
    /// thread starts now.
    pub(super) fn new(
        log: Log,
        recovered: Recovered,
        start: &Start,
        replica: Option<crate::replica::Replica>,
        ready: Arc<Readiness>,
    ) -> Self {
        let (reports_tx, reports) = mpsc::unbounded_channel();
        let (events_tx, events) = mpsc::unbounded_channel();
        let (clock, metrics) = (start.clock.clone(), start.metrics.clone());
        raise_clock(&log, &clock);
        let reader = log.reader();
        let writer = store::spawn_writer(log, events_tx, metrics.clone(), clock.clone());
        let paused = writer.paused;
        let store_busy = writer.busy.clone();
        let fence = replica
            .as_ref()
            .map_or_else(Fence::always, crate::replica::Replica::fence);
        let options = &start.options;
        let mut settings = options.republish.clone();
        settings.fence = fence.clone();
        let firing = Firing::new(
            start.connector.clone(),
            settings,
            options.max_pending_bytes,
            reports_tx,
            metrics.clone(),
            clock.clone(),
        );
        let outcomes = Outcomes::new(
            options.queue_gone.clone(),
            options.delayed.clone(),
            metrics.clone(),
            clock.clone(),
        );
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
            next_id: recovered.next_id,
            metrics,
            firing,
            outcomes,
            recovery: Recovery::default(),
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
    /// A read that fails is tried again while the engine runs
    /// ([`Recovery::read_backlog`]): the store stays "recovering" meanwhile
    /// (nothing is reclaimed, and `/readyz` and `nackd_store_recovering`
    /// say so).
    pub(super) fn read_backlog(&mut self, backlog: store::Backlog) {
        self.metrics.store_recovering.set(1);
        if let Err(e) = self.recovery.read_backlog(backlog, self.metrics.clone()) {
            self.on_backlog(Err(e));
        }
    }

    /// The older segments are read: the store merges their bookkeeping
    /// (before any delete of theirs, which the same queue brings later),
    /// then their messages are scheduled.
    fn on_backlog(&mut self, read: recovery::Read) {
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
        self.recovery.start(recovered, &mut self.ledger);
    }

    /// Schedules up to `n` more recovered messages; when none is left, the
    /// store counts as recovered.
    fn load_step(&mut self, n: usize) {
        let Some(mut loading) = self.recovery.take() else {
            return;
        };
        self.ledger.tick(self.clock.now_ms());
        for (id, due, loc, meta) in loading.by_ref().take(n) {
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
        if !loading.is_done() {
            self.recovery.resume(loading);
            return;
        }
        info!(
            held = loading.total(),
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
                read = self.recovery.read() => self.on_backlog(read),
                _ = std::future::ready(()), if self.recovery.is_loading() => self.load_step(LOAD_STEP),
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
            self.firing.stop().await;
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
        !self.firing.is_paused() && self.has_lease() && self.fence.holds()
    }

    /// The lease is held but its fence lapsed (the broker's answer to the
    /// last probe is late, or this process was stopped): firing waits for
    /// the next answer.
    fn fenced(&self) -> bool {
        !self.firing.is_paused() && self.has_lease() && !self.fence.holds()
    }

    /// Whether this instance acts for its id: always without a replica.
    fn has_lease(&self) -> bool {
        self.link.as_ref().is_none_or(link::Link::holds_lease)
    }

    /// The lease came or went, or the stream: sessions may claim (or not)
    /// from now on.
    fn on_lease(&mut self) {
        let ready = self.link.as_ref().map_or(Ready::Ready, link::Link::ready);
        self.ready.set(ready);
    }

    /// Stops for a reseed: nothing more is fired, what the republishers
    /// got confirmed meanwhile is completed, and the store is handed back
    /// with everything committed.
    async fn hand_back(&mut self) -> Log {
        self.ready.set(Ready::NoReplica);
        self.firing.stop().await;
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

    fn tell_store(&self, op: StoreOp) {
        self.write(match op {
            StoreOp::Del { id, loc } => WriteOp::Del { id, loc },
            StoreOp::Release { loc } => WriteOp::Release { loc },
        });
    }

    fn write(&self, op: WriteOp<PutCtx>) {
        if let Err(std::sync::mpsc::SendError(WriteOp::Put {
            ctx: PutCtx::Park(ParkCtx { key, reply, .. }),
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
        let ctx = PutCtx::Park(ParkCtx {
            keep_if_gone,
            ticket: park.ticket,
            key: park.key,
            reply,
            meta,
            due_us,
        });
        self.put_new(held, ctx);
    }

    /// Writes a new message to the store, and to the replica when there is
    /// one; it is held once both have it.
    fn put_new(&mut self, held: Held, ctx: PutCtx) {
        self.put_new_from(held, None, ctx)
    }

    /// [`Engine::put_new`]; `from`: the adoption that parks it (the
    /// replica gets a moved put, which counts once that is committed).
    fn put_new_from(&mut self, held: Held, from: Option<crate::replica::Intent>, ctx: PutCtx) {
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
    fn parked(&mut self, w: Written<PutCtx>, replicated: Result<(), String>) {
        let w = self.both_answers(w, replicated);
        match (w.ctx, w.result) {
            (PutCtx::Park(park), Ok(loc)) => self.held_parked(w.id, w.due_ms, loc, park),
            (PutCtx::Park(ParkCtx { key, reply, .. }), Err(e)) => {
                let _ = reply.send(Parked {
                    key,
                    result: Err(e),
                });
            }
            (PutCtx::Adopt { reply, meta }, Ok(loc)) => {
                // Held, not scheduled: it fires once its adoption, or a
                // part of it naming it, is committed
                // ([`crate::replica::Adopt::Release`]), so that an
                // adopter killed half way has fired none of the others.
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

    /// The store's answer as the engine takes it: held only if the
    /// replica has it too; else its local copy goes, and the stream
    /// forgets it.
    fn both_answers(
        &mut self,
        w: Written<PutCtx>,
        replicated: Result<(), String>,
    ) -> Written<PutCtx> {
        match (w.result, replicated) {
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
                    link.done(w.id);
                }
                let result = Err(StoreError::Replica(e));
                Written { result, ..w }
            }
            (Err(e), _) => {
                // Not held; the stream may have it (even if its answer was
                // an error): completed there too.
                if let Some(link) = &self.link {
                    link.done(w.id);
                }
                Written {
                    result: Err(e),
                    ..w
                }
            }
        }
    }

    /// A session's park is stored (and replicated): held, answered and
    /// scheduled, unless its session gave it up or is gone.
    fn held_parked(&mut self, id: u64, due_ms: u64, loc: Loc, park: ParkCtx) {
        let ParkCtx {
            key,
            reply,
            meta,
            due_us,
            keep_if_gone,
            ticket,
        } = park;
        self.ledger.tick(self.clock.now_ms());
        self.ledger.insert(id, Entry::new(loc, due_ms, meta));
        if !ticket.stored() {
            // Its session gave it up (the settle timeout ran out):
            // the delivery went back to the broker, or the
            // publisher got a nack and may have published again.
            // Firing this copy would deliver it twice: it is
            // deleted, durably, as a completion is.
            info!(
                id,
                "stored after its session gave it up: deleted, never fired"
            );
            let result = Err(StoreError::Io("given up by its session".into()));
            let _ = reply.send(Parked { key, result });
            return self.forget(id);
        }
        let parked = Parked {
            key,
            result: Ok(id),
        };
        if reply.send(parked).is_err() && !keep_if_gone {
            // The session is gone and never acked the delivery: the
            // broker has it back and redelivers it. Holding it too
            // would deliver it twice.
            debug!(id, "parked for a session that is gone: completing it");
            return self.forget(id);
        }
        self.schedule_us(id, due_us);
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
                self.ledger.set_inflight(id, false);
                // The return was a failed attempt: its lateness was observed already.
                self.ledger.count_attempt(id);
                self.schedule(id, self.clock.now_ms());
            }
            Err(e) => self.set_aside(
                id,
                BlockReason::Store,
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
    fn schedule(&mut self, id: u64, at_ms: u64) {
        self.schedule_us(id, at_ms.saturating_mul(1000));
    }

    /// (Re)arms the wheel for `id` at `at_us`.
    fn schedule_us(&mut self, id: u64, at_us: u64) {
        let Some(entry) = self.ledger.get(id) else {
            return;
        };
        let v = self.ledger.vhost_of(entry.meta.queue);
        let armed = self.firing.arm(self.ledger.vhosts(), v, at_us, id);
        self.ledger.arm(id, armed);
    }

    /// Completes a message: it leaves the ledger now and the store with a
    /// delete record (once a re-route being written has its answer).
    fn forget(&mut self, id: u64) {
        let Some((entry, op)) = self.ledger.complete(id) else {
            return;
        };
        if let Some(op) = op {
            self.tell_store(op);
        }
        if let Some(link) = &self.link {
            link.done(id);
        }
        let queue = entry.meta.queue;
        if self.ledger.count(queue) == 0 {
            self.outcomes.queue_emptied(&self.ledger, queue);
        }
    }
    /// The store says whether completions can be recorded: firing pauses
    /// (or resumes) from now.
    fn on_firing(&mut self, paused: Option<PauseReason>) {
        self.firing.on_pause(paused, self.ledger.len());
    }

    /// When the engine must look again (µs).
    fn next_wake(&self) -> Option<u64> {
        self.firing.next_wake(self.clock.now_us())
    }

    /// Fires what was due by the last grid point (`fire::WAKE_GRID_US`),
    /// as far as each republisher has room.
    fn fire(&mut self) {
        let now_us = self.clock.now_us();
        self.ledger.tick(now_us / 1000);
        self.firing.begin_pass();
        for v in 0..self.firing.vhost_count() {
            self.fire_vhost(v, now_us);
        }
    }

    /// Fires what is due in vhost `v`, after taking back what a
    /// republisher task that ended held.
    fn fire_vhost(&mut self, v: u32, now_us: u64) {
        for (id, dest) in self.firing.take_lost(v) {
            let action = self.outcomes.lost(&mut self.ledger, id, &dest);
            self.apply(action);
        }
        let mut budget = fire::PASS;
        while let Some((armed, id)) = self.firing.next_due(v, now_us, &mut budget) {
            self.fire_one(v, id, armed, now_us / 1000);
        }
    }

    /// A due slot of vhost `v`: `id` goes to its republisher unless it was
    /// rescheduled meanwhile or its destination is known to refuse it.
    fn fire_one(&mut self, v: u32, id: u64, armed: u64, now: u64) {
        let Some(entry) = self.ledger.get(id).copied() else {
            return; // forgotten meanwhile
        };
        if entry.armed_us != armed || entry.inflight || entry.rewriting {
            return; // rescheduled (fired now, backed off) or already publishing
        }
        // An operator's "fire now" goes whatever is known to block it.
        let admit = match entry.forced {
            true => Admit::Go,
            false => self.outcomes.admit(&self.ledger, v, id, &entry, now),
        };
        if admit != Admit::Go {
            return self.held_back(id, &entry, admit);
        }
        let held = match self.reader.read(entry.loc) {
            Ok(held) => held,
            Err(e) => {
                let why = format!("cannot read the held message ({e})");
                return self.set_aside(id, BlockReason::Store, why);
            }
        };
        if !entry.forced {
            let admit = self
                .outcomes
                .admit_route(&self.ledger, v, id, &held.route, now);
            if admit != Admit::Go {
                return self.held_back(id, &entry, admit);
            }
        }
        self.ledger.set_inflight(id, true);
        self.firing.hand(v, id, &entry, held, now);
    }

    /// `id` (`entry`) does not go: its destination is known to refuse it.
    fn held_back(&mut self, id: u64, entry: &Entry, admit: Admit) {
        match admit {
            Admit::Go => {}
            Admit::Hold { at, reason } => self.hold(id, at, reason),
            Admit::GoneRule => match self.reader.read(entry.loc) {
                Ok(held) => {
                    let action = self.outcomes.gone_action(id, held);
                    self.apply(Some(action));
                }
                Err(e) => {
                    let why = format!("cannot read the held message ({e})");
                    self.set_aside(id, BlockReason::Store, why);
                }
            },
        }
    }

    /// Sets `id` aside until `at` with `reason` (a ledger reason id; 0:
    /// the reason it has stays).
    fn hold(&mut self, id: u64, at: u64, reason: u16) {
        if !self.ledger.unhand(id) {
            return;
        }
        if reason != 0 {
            self.ledger.set_blocked(id, reason);
        }
        self.schedule(id, at);
    }

    /// Sets `id` aside for a reason of its own, with a backoff of its own.
    fn set_aside(&mut self, id: u64, kind: BlockReason, why: String) {
        let action = self.outcomes.set_aside(&mut self.ledger, id, kind, why);
        self.apply(action);
    }

    /// Takes the action an outcome calls for.
    fn apply(&mut self, action: Option<Action>) {
        match action {
            None => {}
            Some(Action::Hold { id, at, reason }) => self.hold(id, at, reason),
            Some(Action::Complete(id)) => self.forget(id),
            Some(Action::Reroute { id, held, route }) => self.reroute(id, held, route),
        }
    }

    /// A republisher's report: its room is given back, and the outcome
    /// says what becomes of the message.
    fn on_report(&mut self, report: Report) {
        let Some(dest) = self.firing.on_report(report.id) else {
            return;
        };
        let (ledger, reader) = (&mut self.ledger, &self.reader);
        let action = self
            .outcomes
            .on_report(ledger, reader, report.id, &dest, report.outcome);
        self.apply(action);
    }

    /// Sends `held` to `route` instead, once the store has the new record.
    fn reroute(&mut self, id: u64, mut held: Held, route: Route) {
        held.route = route;
        if let Some(replaces) = self.ledger.start_rewrite(id) {
            if let Some(link) = &self.link {
                link.append_version(&held);
            }
            self.write(WriteOp::Put {
                held,
                replaces: Some(replaces),
                ctx: PutCtx::Reroute,
            });
        }
    }

    /// An operator's command, answered from what the engine holds now.
    fn on_admin(&mut self, command: query::Command) {
        match command {
            query::Command::List {
                vhost,
                named,
                limit,
                reply,
            } => {
                let named = named.as_ref().map(|(n, k)| (n.as_str(), *k));
                let (listed, total) = query::list(&self.ledger, vhost.as_deref(), named, limit);
                let _ = reply.send((listed, total, self.reader.clone()));
            }
            query::Command::Fire { target, reply } => {
                let _ = reply.send(self.fire_now(&target));
            }
            query::Command::Purge { target, reply } => {
                // A message being republished is not recalled: its confirm
                // completes it (docs/src/operations.md, "Admin API"), so a purge cannot race
                // with a delivery the consumer already has.
                let ids: Vec<u64> = query::matching(&self.ledger, &target)
                    .into_iter()
                    .filter(|id| self.ledger.get(*id).is_some_and(|e| !e.inflight))
                    .collect();
                ids.iter().for_each(|id| self.forget(*id));
                let _ = reply.send(ids.len());
            }
            query::Command::Status { reply } => {
                let status = query::status(
                    &self.ledger,
                    self.clock.now_ms(),
                    |q| self.outcomes.gone_since(q),
                    self.outcomes.blocked_exchanges(&self.ledger),
                    self.firing.pending_bytes(),
                );
                let _ = reply.send(status);
            }
        }
    }

    /// Moves the target's wheel entries to now; the old ones go stale.
    fn fire_now(&mut self, target: &query::Target) -> usize {
        let now = self.clock.now_ms();
        let mut fired = 0;
        for id in query::matching(&self.ledger, target) {
            if self.ledger.force(id) {
                self.schedule(id, now);
                fired += 1;
            }
        }
        fired
    }

    /// The replica's answer to a new message.
    fn on_replicated(&mut self, answer: link::Answer) {
        let both = self.link.as_mut().and_then(|l| l.replicated(answer));
        if let Some((w, replicated)) = both {
            self.parked(w, replicated);
        }
    }

    /// What an adoption asked before this engine ran (completions and
    /// releases: see the supervisor's `between_engines`).
    pub(super) fn adopt_all(&mut self, carried: Vec<crate::replica::Adopt>) {
        for adopt in carried {
            self.on_adopt(adopt);
        }
    }

    /// Another instance's message to hold under a new id of ours.
    fn on_adopt(&mut self, adopt: crate::replica::Adopt) {
        use crate::replica::Adopt;
        match adopt {
            Adopt::Park {
                mut held,
                from,
                reply,
            } => {
                held.id = self.next_id;
                self.next_id += 1;
                let meta = held.meta(self.ledger.intern(&held.vhost, &held.queue));
                self.put_new_from(held, Some(from), PutCtx::Adopt { reply, meta });
            }
            Adopt::Complete(id) => self.forget(id),
            Adopt::Release(ids) => {
                for id in ids {
                    if let Some(due_ms) = self.ledger.get(id).map(|e| e.due_ms) {
                        self.schedule(id, due_ms);
                    }
                }
            }
        }
    }
}

/// Before anything is scheduled: a wall clock that went back since the
/// store last wrote must not make its messages wait longer (nor what is
/// held from now on early, once the wall clock is set right). (Checked
/// when the log opened: a damaged file stopped startup.)
fn raise_clock(log: &Log, clock: &Clock) {
    if let Ok(Some(ms)) = store::read_clock_mark(log.dir()) {
        let behind = clock.raise_to_ms(ms);
        if !behind.is_zero() {
            warn!(behind = ?behind, "the wall clock is behind the time the store last recorded (it was set back): nackd's clock goes on from that time");
        }
    }
}

#[cfg(test)]
mod tests;

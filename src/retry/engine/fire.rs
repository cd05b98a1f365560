//! Firing: due messages leave the wheel in due order and go to their
//! vhost's republisher, read from the store only while the republisher has
//! room (`republish.max_pending_bytes`, twice the confirm window): a due
//! backlog of any size costs RAM for that much, plus a few ids.
//!
//! A message for a destination known to refuse it (an exchange that is
//! missing, a queue that is gone) is set aside without being read, except
//! for one probe at a time.
//!
//! Nothing fires while the store cannot record completions (its disk is
//! full, its deletes cannot be written): a message republished then would
//! be republished again after a restart. What the republishers already
//! have completes meanwhile, into the store's reserve.

use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};

use super::{Engine, Handed, Slot};
use crate::metrics::{BlockReason, Metrics, PauseReason};
use crate::retry::ledger::Entry;
use crate::retry::republish::{Publish, Republisher};
use crate::store::{Held, Route};

/// Entries looked at per vhost in one pass, so commands and reports are
/// served in between.
const PASS: usize = 4096;

/// The engine wakes for due messages on this grid (µs): those due within
/// the same 250 µs go together, at most 250 µs late. Waking for each
/// message at its exact microsecond cost more wake-ups and writes than it
/// saved, on a machine shared with the broker: nackd-bench at 3 000
/// retries/s measured p99 lateness 1.3–1.4 ms with this grid, 2.0–3.4 ms
/// exact, 1.8–1.9 ms with a 1 ms grid (bench/RESULTS.md, issue 19).
const WAKE_GRID_US: u64 = 250;

impl Engine {
    /// Fires what is due, as far as each republisher has room.
    pub(super) fn fire(&mut self) {
        let now_us = self.clock.now_us();
        self.ledger.tick(now_us / 1000);
        self.more = false;
        for v in 0..self.vhosts.len() {
            self.fire_vhost(v as u32, now_us);
        }
    }

    /// The store says whether completions can be recorded: firing pauses
    /// (or resumes) from now, said once per change in the log, in
    /// `nackd_firing_paused{reason}` and in `/readyz`.
    pub(super) fn on_firing(&mut self, paused: Option<PauseReason>) {
        let now = self.clock.now();
        let was = self.paused.map(|(reason, since)| (reason, now - since));
        self.paused = paused.map(|reason| match self.paused {
            Some((_, since)) => (reason, since),
            None => (reason, now),
        });
        self.metrics.set_firing_paused(paused);
        let handed = self.handed.len();
        match (was, paused) {
            (_, Some(reason)) if was.map(|w| w.0) != paused => warn!(
                reason = reason.label(), held = self.ledger.len(), handed,
                "{}; held messages wait, what is already handed to the republishers completes, new nacks the store refuses are deferred (requeued at the broker later)", reason.text()
            ),
            (Some((was, paused_for)), None) => info!(
                was = was.label(), ?paused_for, "firing resumed: the store records completions again"
            ),
            _ => {}
        }
    }

    /// When the engine must look again (µs): now if a pass stopped on its
    /// budget, else the next deadline of every vhost whose republisher has room.
    pub(super) fn next_wake(&self) -> Option<u64> {
        let now = self.clock.now_us();
        if self.more {
            return Some(now);
        }
        (0..self.vhosts.len())
            .filter(|v| self.has_room(*v as u32))
            .filter_map(
                |v| match self.vhosts[v].next == self.vhosts[v].ready.len() {
                    false => Some(now),
                    true => self.vhosts[v]
                        .wheel
                        .next_deadline()
                        .map(|at| at.div_ceil(WAKE_GRID_US).saturating_mul(WAKE_GRID_US)),
                },
            )
            .min()
    }

    /// Whether more may be handed to vhost `v`'s republisher: at least one
    /// message always, more while under twice the confirm window and
    /// `max_pending_bytes`.
    fn has_room(&self, v: u32) -> bool {
        let vh = &self.vhosts[v as usize];
        let window = 2 * self.options.republish.confirm_window as usize;
        vh.outstanding == 0
            || (vh.outstanding < window && vh.pending_bytes < self.options.max_pending_bytes)
    }

    fn fire_vhost(&mut self, v: u32, now_us: u64) {
        let now = now_us / 1000;
        self.check_republisher(v);
        let mut budget = PASS;
        loop {
            let vh = &mut self.vhosts[v as usize];
            if vh.next == vh.ready.len() {
                // One slot at a time: ids wait here, bodies stay on disk.
                vh.ready.clear();
                vh.next = 0;
                match vh.wheel.next_deadline() {
                    Some(at) if at <= now_us => {
                        vh.wheel.poll(at, &mut vh.ready);
                        continue;
                    }
                    _ => return,
                }
            }
            if !self.has_room(v) {
                return;
            }
            if budget == 0 {
                self.more = true;
                return;
            }
            budget -= 1;
            let vh = &mut self.vhosts[v as usize];
            let (armed, id): Slot = vh.ready[vh.next];
            vh.next += 1;
            self.fire_one(v, id, armed, now);
        }
    }

    fn fire_one(&mut self, v: u32, id: u64, armed: u64, now: u64) {
        let Some(entry) = self.ledger.get(id).copied() else {
            return; // forgotten meanwhile
        };
        if entry.armed_us != armed || entry.inflight || entry.rewriting {
            return; // rescheduled (fired now, backed off) or already publishing
        }
        // An operator's "fire now" goes whatever is known to block it.
        if !entry.forced && self.held_back(v, id, &entry, now) {
            return;
        }
        let held = match self.reader.read(entry.loc) {
            Ok(held) => held,
            Err(e) => {
                let why = format!("cannot read the held message ({e})");
                return self.set_aside(id, BlockReason::Store, why);
            }
        };
        if let (false, Route::Exchange { exchange, .. } | Route::Delayed { exchange, .. }) =
            (entry.forced, &held.route)
        {
            let key = (v, Arc::from(exchange.as_str()));
            if let Some(at) = self.lanes.admit(&key, id, now) {
                let reason = self.lanes.get(&key).map_or(0, |b| b.reason);
                return self.hold_back(id, at, reason);
            }
        }
        self.hand(v, id, &entry, held, now);
    }

    /// Sets `id` aside without reading it if its destination is known to
    /// refuse it; a gone queue's messages may meet `republish.queue_gone`.
    fn held_back(&mut self, v: u32, id: u64, entry: &Entry, now: u64) -> bool {
        if !entry.meta.dead_letter {
            if self.gone_holds(id, entry, now) {
                return true;
            }
            let key = (v, self.default_exchange.clone());
            if let Some(at) = self.lanes.admit(&key, id, now) {
                let reason = self.lanes.get(&key).map_or(0, |b| b.reason);
                self.hold_back(id, at, reason);
                return true;
            }
            return false;
        }
        // A delayed message's exchange is its "queue"; a dead-letter
        // route's is in the store, and a message set aside for its
        // exchange names it in its reason.
        let exchange = match entry.meta.delayed {
            true => Some(self.ledger.name(entry.meta.queue).1.clone()),
            false => self
                .ledger
                .reason(entry.blocked())
                .and_then(|r| r.exchange.clone()),
        };
        let Some(exchange) = exchange else {
            return false;
        };
        let key = (v, exchange);
        match self.lanes.admit(&key, id, now) {
            Some(at) => {
                let reason = self.lanes.get(&key).map_or(0, |b| b.reason);
                self.hold_back(id, at, reason);
                true
            }
            None => false,
        }
    }

    /// Sets `id` aside until `at` without trying it: its destination is
    /// known to refuse it. Counted by reason; logged with its destination.
    fn hold_back(&mut self, id: u64, at: u64, reason: u16) {
        if let Some(r) = self.ledger.reason(reason) {
            self.metrics.blocked(r.kind);
        }
        self.hold(id, at, reason);
    }

    /// Sets `id` aside until `at` with `reason` (a ledger reason id).
    pub(super) fn hold(&mut self, id: u64, at: u64, reason: u16) {
        let Some(entry) = self.ledger.get_mut(id) else {
            return;
        };
        entry.inflight = false;
        entry.forced = false;
        if reason != 0 {
            self.ledger.set_blocked(id, reason);
        }
        self.schedule(id, at);
    }

    fn hand(&mut self, v: u32, id: u64, entry: &Entry, held: Held, now: u64) {
        let late_ms = now.saturating_sub(entry.due_ms);
        if entry.attempts == 0 && !entry.forced {
            Metrics::observe(&self.metrics.lateness, Duration::from_millis(late_ms));
        }
        if let Some(e) = self.ledger.get_mut(id) {
            e.inflight = true;
        }
        self.metrics.published.inc();
        debug!(id, queue = %held.queue, late_ms, "due");
        let size = held.size() as u64;
        let (queue_route, exchange) = match &held.route {
            Route::Queue => (true, self.default_exchange.clone()),
            Route::Exchange { exchange, .. } | Route::Delayed { exchange, .. } => {
                (false, Arc::from(exchange.as_str()))
            }
        };
        self.handed.insert(
            id,
            Handed {
                vhost: v,
                size,
                queue: entry.meta.queue,
                queue_route,
                exchange,
            },
        );
        let publish = Publish {
            id,
            queue: held.queue,
            route: held.route,
            header: held.header,
            body: held.body,
        };
        let (connector, settings) = (self.connector.clone(), self.options.republish.clone());
        let (reports, metrics) = (self.reports_tx.clone(), self.metrics.clone());
        let (tasks, clock) = (self.republishers.clone(), self.clock.clone());
        let vh = self.vhost(v);
        vh.outstanding += 1;
        vh.pending_bytes += size;
        vh.pending_gauge.set(vh.pending_bytes as i64);
        let name = vh.name.clone();
        vh.republisher
            .get_or_insert_with(|| {
                Republisher::spawn(name, connector, settings, reports, metrics, clock, &tasks)
            })
            .publish(publish);
    }

    /// A republisher task that ended (a bug: it panicked) reports nothing
    /// more: what it held is taken back and tried again, and the next
    /// publish starts a new one.
    fn check_republisher(&mut self, v: u32) {
        let vh = &mut self.vhosts[v as usize];
        if !vh.republisher.as_ref().is_some_and(Republisher::is_gone) {
            return;
        }
        vh.republisher = None;
        let lost: Vec<u64> = self
            .handed
            .iter()
            .filter(|(_, h)| h.vhost == v)
            .map(|(id, _)| *id)
            .collect();
        tracing::error!(vhost = %self.vhosts[v as usize].name, lost = lost.len(), "the republisher task ended: its messages go again");
        for id in lost {
            let h = self.handed.remove(&id).expect("listed above");
            self.release(&h);
            self.lanes.forget_probe(&(h.vhost, h.exchange.clone()), id);
            self.gone.forget_probe(&h.queue, id);
            let why = "the republisher task ended unexpectedly".to_string();
            self.set_aside(id, BlockReason::ChannelError, why);
        }
    }

    /// A report came back for `h`: the republisher has room for it again.
    pub(super) fn release(&mut self, h: &Handed) {
        let vh = self.vhost(h.vhost);
        vh.outstanding -= 1;
        vh.pending_bytes -= h.size;
        vh.pending_gauge.set(vh.pending_bytes as i64);
    }
}

//! Firing: due messages leave the wheel in due order and go to their
//! vhost's republisher, read from the store only while the republisher has
//! room (`republish.max_pending_bytes`, twice the confirm window): a due
//! backlog of any size costs RAM for that much, plus a few ids.
//!
//! [`Firing`] owns the wheels, the republishers and what was handed to
//! them. The engine asks it for the next due slot ([`Firing::next_due`]),
//! decides with the ledger and [`super::outcome::Outcomes`] whether the
//! message goes, and hands it over ([`Firing::hand`]); a report gives the
//! room back ([`Firing::on_report`]).
//!
//! Nothing fires while the store cannot record completions (its disk is
//! full, its deletes cannot be written): a message republished then would
//! be republished again after a restart. What the republishers already
//! have completes meanwhile, into the store's reserve.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::metrics::{Metrics, PauseReason, VhostLabels};
use crate::net::Connector;
use crate::retry::ledger::Entry;
use crate::retry::republish::{Publish, Report, Republisher, Settings};
use crate::retry::Clock;
use crate::store::{Held, Route};
use nackd_core::wheel::Wheel;

/// Entries looked at per vhost in one pass, so commands and reports are
/// served in between.
pub(super) const PASS: usize = 4096;

/// Due messages fire on this grid (µs): those due within the same
/// millisecond go together, at most 1 ms late. The engine wakes at a grid
/// point (a timerfd: never before it, tens of µs after it on an idle
/// machine), and a pass fires only what was due by
/// the last point ([`Firing::grid_floor`]): a pass run for another reason
/// (a park, a store write, a confirm: thousands a second under load) fires
/// nothing new between two points. Firing each message at its own
/// microsecond (every pass fired what had just fallen due, so the 250 µs
/// wake grid before this batched nothing) put one publish in each write
/// to the broker and cost, at 3 000 retries/s, 14 % more CPU per retry in
/// nackd and 18 % more in the broker than the millisecond wheel before it;
/// on a machine shared with the broker the consumers' tail grew with it
/// (issue 37: the bisect, and the side by side runs of `nackd-bench
/// retry`, in docs/src/results.md). A 250 µs grid with the floor saved
/// nothing measurable; 1 ms took back half of that CPU and most of the
/// tail, for 0.3 ms more median lateness.
const WAKE_GRID_US: u64 = 1000;

/// How long the republishers get to end at shutdown.
const REPUBLISHERS_STOP: Duration = Duration::from_secs(2);

/// A due wheel entry: when it was armed (µs) and the store id it fires.
pub(super) type Slot = (u64, u64);

/// Where a handed message went, as its report's outcome needs it.
#[derive(Clone, Debug)]
pub(super) struct Dest {
    /// The ledger's vhost number.
    pub(super) vhost: u32,
    /// The ledger's queue number.
    pub(super) queue: u32,
    /// Published to its queue (exchange `""`), not to an exchange.
    pub(super) queue_route: bool,
    pub(super) exchange: Arc<str>,
}

/// A message handed to a republisher, until its report.
struct Handed {
    dest: Dest,
    size: u64,
}

/// What the engine keeps per vhost: its wheel and its republisher.
struct Vhost {
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
    pending_bytes: u64,
    pending_gauge: Gauge,
}

/// What a republisher is started with.
struct Spawn {
    connector: Connector,
    settings: Settings,
    reports: mpsc::UnboundedSender<Report>,
    metrics: Arc<Metrics>,
    clock: Clock,
    /// The republisher tasks, waited for at shutdown.
    tasks: TaskTracker,
}

/// The wheels, the republishers and what they were handed.
pub(super) struct Firing {
    vhosts: Vec<Vhost>,
    handed: HashMap<u64, Handed>,
    /// The last pass stopped on its budget: run again at once.
    more: bool,
    /// Why nothing is fired (the store cannot record completions), and
    /// since when.
    paused: Option<(PauseReason, Instant)>,
    max_pending_bytes: u64,
    default_exchange: Arc<str>,
    spawn: Spawn,
}

impl Firing {
    /// Nothing held yet; republishers start with `settings`, on first use,
    /// and report to `reports`.
    pub(super) fn new(
        connector: Connector,
        settings: Settings,
        max_pending_bytes: u64,
        reports: mpsc::UnboundedSender<Report>,
        metrics: Arc<Metrics>,
        clock: Clock,
    ) -> Self {
        Self {
            vhosts: Vec::new(),
            handed: HashMap::new(),
            more: false,
            paused: None,
            max_pending_bytes,
            default_exchange: Arc::from(""),
            spawn: Spawn {
                connector,
                settings,
                reports,
                metrics,
                clock,
                tasks: TaskTracker::new(),
            },
        }
    }

    /// The store says whether completions can be recorded: firing pauses
    /// (or resumes) from now, said once per change in the log, in
    /// `nackd_firing_paused{reason}` and in `/readyz`. `held`: for the log.
    pub(super) fn on_pause(&mut self, paused: Option<PauseReason>, held: usize) {
        let now = self.spawn.clock.now();
        let was = self.paused.map(|(reason, since)| (reason, now - since));
        self.paused = paused.map(|reason| match self.paused {
            Some((_, since)) => (reason, since),
            None => (reason, now),
        });
        self.spawn.metrics.set_firing_paused(paused);
        let handed = self.handed.len();
        match (was, paused) {
            (_, Some(reason)) if was.map(|w| w.0) != paused => warn!(
                reason = reason.label(), held, handed,
                "{}; held messages wait, what is already handed to the republishers completes, new nacks the store refuses are deferred (requeued at the broker later)", reason.text()
            ),
            (Some((was, paused_for)), None) => info!(
                was = was.label(), ?paused_for, "firing resumed: the store records completions again"
            ),
            _ => {}
        }
    }

    /// Whether firing is paused (the store cannot record completions).
    pub(super) fn is_paused(&self) -> bool {
        self.paused.is_some()
    }

    /// Arms vhost `v`'s wheel for `id` at `at_us`; returns the time it is
    /// armed for (wheel entries of `id` armed for another are stale).
    /// `names`: the ledger's vhosts, to create `v` on first use.
    pub(super) fn arm(&mut self, names: &[Arc<str>], v: u32, at_us: u64, id: u64) -> u64 {
        self.vhost(names, v).wheel.insert(at_us, id)
    }

    /// The last grid point at or before `now_us`: a pass fires what was
    /// due by then.
    fn grid_floor(now_us: u64) -> u64 {
        now_us - now_us % WAKE_GRID_US
    }

    /// A new pass over the vhosts begins.
    pub(super) fn begin_pass(&mut self) {
        self.more = false;
    }

    /// How many vhosts have a wheel.
    pub(super) fn vhost_count(&self) -> u32 {
        self.vhosts.len() as u32
    }

    /// The next slot of vhost `v` due by the last grid point at or before
    /// `now_us`, while its republisher has room and `budget` lasts (when
    /// it runs out, the engine is to look again at once).
    pub(super) fn next_due(&mut self, v: u32, now_us: u64, budget: &mut usize) -> Option<Slot> {
        let now_us = Self::grid_floor(now_us);
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
                    _ => return None,
                }
            }
            if !self.has_room(v) {
                return None;
            }
            if *budget == 0 {
                self.more = true;
                return None;
            }
            *budget -= 1;
            let vh = &mut self.vhosts[v as usize];
            let slot = vh.ready[vh.next];
            vh.next += 1;
            return Some(slot);
        }
    }

    /// When the engine must look again (µs): now if a pass stopped on its
    /// budget, else the next deadline of every vhost whose republisher has room.
    pub(super) fn next_wake(&self, now_us: u64) -> Option<u64> {
        if self.more {
            return Some(now_us);
        }
        (0..self.vhosts.len())
            .filter(|v| self.has_room(*v as u32))
            .filter_map(
                |v| match self.vhosts[v].next == self.vhosts[v].ready.len() {
                    false => Some(now_us),
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
        let window = 2 * self.spawn.settings.confirm_window as usize;
        vh.outstanding == 0
            || (vh.outstanding < window && vh.pending_bytes < self.max_pending_bytes)
    }

    /// Hands `held` (`entry` in the ledger) to vhost `v`'s republisher,
    /// which starts on first use. `now`: ms, for its lateness.
    pub(super) fn hand(&mut self, v: u32, id: u64, entry: &Entry, held: Held, now: u64) {
        let metrics = &self.spawn.metrics;
        let late_ms = now.saturating_sub(entry.due_ms);
        if entry.attempts == 0 && !entry.forced {
            Metrics::observe(&metrics.lateness, Duration::from_millis(late_ms));
        }
        metrics.published.inc();
        debug!(id, queue = %held.queue, late_ms, "due");
        let size = held.size() as u64;
        let (queue_route, exchange) = match &held.route {
            Route::Queue => (true, self.default_exchange.clone()),
            Route::Exchange { exchange, .. } | Route::Delayed { exchange, .. } => {
                (false, Arc::from(exchange.as_str()))
            }
        };
        let dest = Dest {
            vhost: v,
            queue: entry.meta.queue,
            queue_route,
            exchange,
        };
        self.handed.insert(id, Handed { dest, size });
        let publish = Publish {
            id,
            queue: held.queue,
            route: held.route,
            header: held.header,
            body: held.body,
        };
        let spawn = &self.spawn;
        let vh = &mut self.vhosts[v as usize];
        vh.outstanding += 1;
        vh.pending_bytes += size;
        vh.pending_gauge.set(vh.pending_bytes as i64);
        let name = vh.name.clone();
        vh.republisher
            .get_or_insert_with(|| spawn.republisher(name))
            .publish(publish);
    }

    /// A republisher reported on `id`: where it went, if it was handed
    /// (its room is given back).
    pub(super) fn on_report(&mut self, id: u64) -> Option<Dest> {
        let h = self.handed.remove(&id)?;
        self.release(&h);
        Some(h.dest)
    }

    /// A republisher task that ended (a bug: it panicked) reports nothing
    /// more: what it held is taken back (returned, to be tried again), and
    /// the next publish starts a new one.
    pub(super) fn take_lost(&mut self, v: u32) -> Vec<(u64, Dest)> {
        let vh = &mut self.vhosts[v as usize];
        if !vh.republisher.as_ref().is_some_and(Republisher::is_gone) {
            return Vec::new();
        }
        vh.republisher = None;
        let lost: Vec<u64> = self
            .handed
            .iter()
            .filter(|(_, h)| h.dest.vhost == v)
            .map(|(id, _)| *id)
            .collect();
        tracing::error!(vhost = %self.vhosts[v as usize].name, lost = lost.len(), "the republisher task ended: its messages go again");
        lost.into_iter()
            .map(|id| {
                let h = self.handed.remove(&id).expect("listed above");
                self.release(&h);
                (id, h.dest)
            })
            .collect()
    }

    /// Bytes of due messages read from the store and not yet settled.
    pub(super) fn pending_bytes(&self) -> u64 {
        self.vhosts.iter().map(|v| v.pending_bytes).sum()
    }

    /// Whether `id` is handed to a republisher.
    #[cfg(test)]
    pub(super) fn is_handed(&self, id: u64) -> bool {
        self.handed.contains_key(&id)
    }

    /// Nothing more is fired: each republisher's queue closes and its
    /// task ends (what it did not get confirmed stays held, and goes
    /// again after a restart).
    pub(super) async fn stop(&mut self) {
        for vhost in &mut self.vhosts {
            vhost.republisher = None;
        }
        let tasks = &self.spawn.tasks;
        tasks.close();
        if tokio::time::timeout(REPUBLISHERS_STOP, tasks.wait())
            .await
            .is_err()
        {
            warn!(
                open = tasks.len(),
                "republishers did not end in time; their connections are dropped"
            );
        }
    }

    /// A report came back for `h`: the republisher has room for it again.
    fn release(&mut self, h: &Handed) {
        let vh = &mut self.vhosts[h.dest.vhost as usize];
        vh.outstanding -= 1;
        vh.pending_bytes -= h.size;
        vh.pending_gauge.set(vh.pending_bytes as i64);
    }

    /// The state of vhost `v` (created on first use, named from `names`).
    fn vhost(&mut self, names: &[Arc<str>], v: u32) -> &mut Vhost {
        while self.vhosts.len() <= v as usize {
            let name = names[self.vhosts.len()].clone();
            let labels = VhostLabels {
                vhost: name.to_string(),
            };
            let metrics = &self.spawn.metrics;
            self.vhosts.push(Vhost {
                pending_gauge: metrics.republish_pending_bytes.get_or_create_owned(&labels),
                name,
                // On the grid: a message armed for a time the wheel has
                // passed (recovered overdue, "fire now") is armed at the
                // wheel's time, which the next pass has reached. One due
                // since the last grid point waits for the next one, like
                // any other.
                wheel: Wheel::new(Self::grid_floor(self.spawn.clock.now_us())),
                ready: Vec::new(),
                next: 0,
                republisher: None,
                outstanding: 0,
                pending_bytes: 0,
            });
        }
        &mut self.vhosts[v as usize]
    }
}

impl Spawn {
    fn republisher(&self, vhost: Arc<str>) -> Republisher {
        Republisher::spawn(
            vhost,
            self.connector.clone(),
            self.settings.clone(),
            self.reports.clone(),
            self.metrics.clone(),
            self.clock.clone(),
            &self.tasks,
        )
    }
}

#[cfg(test)]
mod tests;

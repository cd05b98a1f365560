//! The engine's book of held messages: where each one is in the store, when
//! it is due, and per-queue totals exported as `nackd_held_messages` and
//! `nackd_held_bytes`.
//!
//! Queue names are interned: an entry carries a `u32`, so a held message
//! costs a few dozen bytes of RAM whatever its queue name. Why a message
//! was set aside is interned too (a `u16` per entry).
//!
//! Everything the status page shows is kept here incrementally, on every
//! insert, removal and set-aside: per-queue totals, set-aside counts by
//! reason, and due times counted per second (per minute for messages
//! parked more than an hour ahead). A status request reads these
//! aggregates; it never walks the entries.
//!
//! The ledger also keeps the engine's side of the store protocol. Each held
//! message has one current record in the store, and only the ledger knows
//! which; so it says, exactly once for every record the store was told
//! about, what became of it: deleted with the current record ([`StoreOp::Del`]),
//! or superseded ([`StoreOp::Release`], and a re-route's `replaces`).

use std::collections::HashMap;
use std::sync::Arc;

use prometheus_client::metrics::gauge::Gauge;

use crate::metrics::{BlockReason, ExchangeLabels, Metrics, QueueLabels};
use crate::store::{HeldMeta, Loc};

/// One held message.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Entry {
    /// Its current put record.
    pub loc: Loc,
    /// When it is due, in ms since the Unix epoch.
    pub due_ms: u64,
    /// Queue, size, retry number, route.
    pub meta: HeldMeta,
    /// When the wheel entry that may fire it is due (µs); wheel entries of
    /// it due at another time were armed before and are stale.
    pub armed_us: u64,
    /// Failed publish attempts (nack, return, read error).
    pub attempts: u16,
    /// Handed to the republisher, not confirmed yet.
    pub inflight: bool,
    /// Fired early by an operator: its lateness means nothing.
    pub forced: bool,
    /// A put superseding `loc` (a re-route) is being written.
    pub rewriting: bool,
    /// Why its last republish was set aside ([`Ledger::reason`]; 0: never).
    blocked: u16,
    /// Counted in the due chart by the minute, not the second.
    coarse: bool,
}

impl Entry {
    /// A fresh entry.
    pub(crate) fn new(loc: Loc, due_ms: u64, meta: HeldMeta) -> Self {
        Self {
            loc,
            due_ms,
            meta,
            armed_us: u64::MAX,
            attempts: 0,
            inflight: false,
            forced: false,
            rewriting: false,
            blocked: 0,
            coarse: false,
        }
    }

    /// Why its last republish was set aside: an id for [`Ledger::reason`], 0 if never.
    pub(crate) fn blocked(&self) -> u16 {
        self.blocked
    }
}

/// Why messages were set aside: the kind and the broker's reply.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Reason {
    /// The kind (the metrics label).
    pub kind: BlockReason,
    /// `404 NOT_FOUND - no exchange 'x' in vhost '/'`, or nackd's own words.
    pub reply: String,
    /// The exchange refusing every publish (`exchange_wide`), if that is the cause.
    pub exchange: Option<Arc<str>>,
}

/// Messages parked further ahead than this are charted by the minute.
const FINE_HORIZON_MS: u64 = 3_600_000;
/// Most distinct reasons kept; beyond, one per kind stands for the rest.
const MAX_REASONS: usize = 4096;

/// What the store must be told about a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StoreOp {
    /// A delete record for the message whose current record is `loc`.
    Del {
        /// Message id.
        id: u64,
        /// Its current record.
        loc: Loc,
    },
    /// A durable record of the same message supersedes `loc`.
    Release {
        /// The superseded record.
        loc: Loc,
    },
}

/// Totals of one queue, with the handles of its exported series.
struct QueueStat {
    vhost: Arc<str>,
    vhost_index: u32,
    queue: Arc<str>,
    count: u64,
    bytes: u64,
    blocked: u64,
    series: Option<(Gauge, Gauge)>,
    /// Delayed messages of the exchange this "queue" names, and their
    /// series while there are any.
    delayed: u64,
    delayed_series: Option<Gauge>,
}

/// Held messages by store id, and per-queue totals.
pub(crate) struct Ledger {
    entries: IdMap<Entry>,
    /// Messages completed while a superseding put of theirs was being
    /// written, with their record before it: whichever record is current
    /// once the put is answered gets the delete.
    orphans: HashMap<u64, Loc>,
    queues: Vec<QueueStat>,
    names: HashMap<(Arc<str>, Arc<str>), u32>,
    vhosts: Vec<Arc<str>>,
    reasons: Vec<(Reason, u64)>,
    reason_ids: HashMap<Reason, u16>,
    due: DueCounts,
    /// The engine's clock at its last [`Ledger::tick`].
    now_ms: u64,
    metrics: Arc<Metrics>,
}

impl Ledger {
    /// An empty ledger reporting into `metrics`.
    pub(crate) fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            entries: IdMap::default(),
            orphans: HashMap::new(),
            queues: Vec::new(),
            names: HashMap::new(),
            vhosts: Vec::new(),
            reasons: Vec::new(),
            reason_ids: HashMap::new(),
            due: DueCounts::default(),
            now_ms: 0,
            metrics,
        }
    }

    /// The engine's clock moved: messages parked later than an hour from
    /// now are charted by the minute.
    pub(crate) fn tick(&mut self, now_ms: u64) {
        self.now_ms = now_ms;
        self.due.advance(now_ms);
    }

    /// The interned id of `(vhost, queue)`.
    pub(crate) fn intern(&mut self, vhost: &Arc<str>, queue: &Arc<str>) -> u32 {
        if let Some(id) = self.names.get(&(vhost.clone(), queue.clone())) {
            return *id;
        }
        let id = self.queues.len() as u32;
        let vhost_index = match self.vhosts.iter().position(|v| v == vhost) {
            Some(i) => i as u32,
            None => {
                self.vhosts.push(vhost.clone());
                (self.vhosts.len() - 1) as u32
            }
        };
        self.queues.push(QueueStat {
            vhost: vhost.clone(),
            vhost_index,
            queue: queue.clone(),
            count: 0,
            bytes: 0,
            blocked: 0,
            series: None,
            delayed: 0,
            delayed_series: None,
        });
        self.names.insert((vhost.clone(), queue.clone()), id);
        id
    }

    /// `(vhost, queue)` of an interned id.
    pub(crate) fn name(&self, queue: u32) -> (&Arc<str>, &Arc<str>) {
        let q = &self.queues[queue as usize];
        (&q.vhost, &q.queue)
    }

    /// The index of a queue's vhost (see [`Ledger::vhosts`]).
    pub(crate) fn vhost_of(&self, queue: u32) -> u32 {
        self.queues[queue as usize].vhost_index
    }

    /// Every vhost a queue was interned for, by index.
    pub(crate) fn vhosts(&self) -> &[Arc<str>] {
        &self.vhosts
    }

    /// Messages held for a queue.
    pub(crate) fn count(&self, queue: u32) -> u64 {
        self.queues[queue as usize].count
    }

    /// The id of a reason, interned (never 0).
    pub(crate) fn intern_reason(&mut self, reason: Reason) -> u16 {
        if let Some(id) = self.reason_ids.get(&reason) {
            return *id;
        }
        let reason = if self.reasons.len() >= MAX_REASONS {
            Reason {
                kind: reason.kind,
                reply: format!("{} (one of many replies)", reason.kind.label()),
                exchange: reason.exchange,
            }
        } else {
            reason
        };
        if let Some(id) = self.reason_ids.get(&reason) {
            return *id;
        }
        self.reasons.push((reason.clone(), 0));
        let id = self.reasons.len() as u16;
        self.reason_ids.insert(reason, id);
        id
    }

    /// A reason by id (`None` for 0).
    pub(crate) fn reason(&self, id: u16) -> Option<&Reason> {
        self.reasons
            .get(usize::from(id).checked_sub(1)?)
            .map(|(r, _)| r)
    }

    /// Records why a held message was set aside (replacing the reason before).
    pub(crate) fn set_blocked(&mut self, id: u64, reason: u16) {
        let Some(entry) = self.entries.get(id).copied() else {
            return;
        };
        if entry.blocked == reason {
            return;
        }
        self.count_blocked(&entry, -1);
        self.entries.get_mut(id).expect("checked above").blocked = reason;
        let entry = Entry {
            blocked: reason,
            ..entry
        };
        self.count_blocked(&entry, 1);
    }

    /// Set-aside messages by reason, most first: `(reason, count)`.
    pub(crate) fn blocked_reasons(&self) -> Vec<(&Reason, u64)> {
        let mut out: Vec<(&Reason, u64)> = self
            .reasons
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(r, n)| (r, *n))
            .collect();
        out.sort_by_key(|b| std::cmp::Reverse(b.1));
        out
    }

    /// How many held messages fall due in each interval ending at `edges`
    /// seconds from `now_ms` (the first counts what is due already; one more
    /// bucket counts the rest). Costs the number of distinct due seconds in
    /// the last edge, not the number of messages.
    pub(crate) fn due_chart(&self, now_ms: u64, edges: &[u64]) -> Vec<u64> {
        self.due.chart(now_ms, edges, self.entries.len() as u64)
    }

    /// The interned id of `(vhost, queue)` if a message of it was ever held.
    pub(crate) fn find(&self, vhost: &str, queue: &str) -> Option<u32> {
        self.names
            .get(&(Arc::from(vhost), Arc::from(queue)))
            .copied()
    }

    /// Adds (or replaces) a held message.
    pub(crate) fn insert(&mut self, id: u64, mut entry: Entry) {
        entry.coarse = entry.due_ms > self.now_ms + FINE_HORIZON_MS;
        if let Some(old) = self.entries.insert(id, entry) {
            self.account(&old, -1);
        }
        self.account(&entry, 1);
    }

    /// Removes a held message.
    pub(crate) fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.entries.remove(id)?;
        self.account(&entry, -1);
        Some(entry)
    }

    /// A held message.
    pub(crate) fn get(&self, id: u64) -> Option<&Entry> {
        self.entries.get(id)
    }

    /// Records where the wheel entry that may fire `id` is due (µs).
    pub(crate) fn arm(&mut self, id: u64, armed_us: u64) {
        if let Some(e) = self.entries.get_mut(id) {
            e.armed_us = armed_us;
        }
    }

    /// `id` was handed to its republisher (or taken back).
    pub(crate) fn set_inflight(&mut self, id: u64, inflight: bool) {
        if let Some(e) = self.entries.get_mut(id) {
            e.inflight = inflight;
        }
    }

    /// `id` waits again: neither publishing nor fired by an operator.
    /// `false` if it is not held.
    pub(crate) fn unhand(&mut self, id: u64) -> bool {
        let Some(e) = self.entries.get_mut(id) else {
            return false;
        };
        e.inflight = false;
        e.forced = false;
        true
    }

    /// An operator fires `id` now: `false` if it is not held or is
    /// publishing already.
    pub(crate) fn force(&mut self, id: u64) -> bool {
        match self.entries.get_mut(id) {
            Some(e) if !e.inflight => {
                e.forced = true;
                true
            }
            _ => false,
        }
    }

    /// One more failed attempt for `id`; its number, if still held.
    pub(crate) fn count_attempt(&mut self, id: u64) -> Option<u16> {
        let e = self.entries.get_mut(id)?;
        e.attempts = e.attempts.saturating_add(1);
        Some(e.attempts)
    }

    /// Every held message.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &Entry)> {
        self.entries.iter()
    }

    /// Number of held messages.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Completes a message: it leaves the book now. Returns its entry and
    /// the delete for the store, which waits (`None`) while a re-route of
    /// it is being written.
    pub(crate) fn complete(&mut self, id: u64) -> Option<(Entry, Option<StoreOp>)> {
        let entry = self.remove(id)?;
        if entry.rewriting {
            self.orphans.insert(id, entry.loc);
            return Some((entry, None));
        }
        Some((entry, Some(StoreOp::Del { id, loc: entry.loc })))
    }

    /// A put superseding `id`'s record starts (a re-route); returns the
    /// record it supersedes, or `None` if one is already being written.
    pub(crate) fn start_rewrite(&mut self, id: u64) -> Option<Loc> {
        let entry = self.entries.get_mut(id).filter(|e| !e.rewriting)?;
        entry.rewriting = true;
        Some(entry.loc)
    }

    /// A re-route's put was answered. Returns the delete to send if the
    /// message was completed meanwhile (for whichever record is current
    /// now), and whether it is still held.
    pub(crate) fn rewritten(
        &mut self,
        id: u64,
        result: Result<Loc, ()>,
    ) -> (Option<StoreOp>, bool) {
        if let Some(old) = self.orphans.remove(&id) {
            let loc = result.unwrap_or(old);
            return (Some(StoreOp::Del { id, loc }), false);
        }
        let Some(entry) = self.entries.get_mut(id) else {
            return (None, false);
        };
        entry.rewriting = false;
        if let Ok(loc) = result {
            entry.loc = loc;
        }
        (None, true)
    }

    /// Compaction copied a record of `id` forward (`from` → `to`): the copy
    /// becomes current if it copies the current record; otherwise (the
    /// message was completed, its delete following the copy; or it is being
    /// re-routed, which supersedes the original) the copy is stale.
    pub(crate) fn relocated(&mut self, id: u64, from: Loc, to: Loc) -> StoreOp {
        match self.entries.get_mut(id).filter(|e| !e.rewriting) {
            Some(entry) if entry.loc == from => {
                entry.loc = to;
                StoreOp::Release { loc: from }
            }
            _ => StoreOp::Release { loc: to },
        }
    }

    /// `(queue, vhost, queue name, count, bytes)` of every queue holding something.
    pub(crate) fn totals(&self) -> impl Iterator<Item = (u32, &Arc<str>, &Arc<str>, u64, u64)> {
        self.queues
            .iter()
            .enumerate()
            .filter(|(_, q)| q.count > 0)
            .map(|(i, q)| (i as u32, &q.vhost, &q.queue, q.count, q.bytes))
    }

    /// Delayed publishes among the messages held under a name (an
    /// `x-delayed-message` exchange's).
    pub(crate) fn delayed_count(&self, queue: u32) -> u64 {
        self.queues[queue as usize].delayed
    }

    /// Set-aside messages of a queue.
    pub(crate) fn blocked_count(&self, queue: u32) -> u64 {
        self.queues[queue as usize].blocked
    }

    fn count_blocked(&mut self, entry: &Entry, sign: i64) {
        if entry.blocked == 0 {
            return;
        }
        let q = &mut self.queues[entry.meta.queue as usize];
        let (reason, n) = &mut self.reasons[usize::from(entry.blocked) - 1];
        let gauge = self.metrics.blocked_now(reason.kind);
        if sign > 0 {
            q.blocked += 1;
            *n += 1;
            gauge.inc();
        } else {
            q.blocked -= 1;
            *n -= 1;
            gauge.dec();
        }
    }

    /// Moves the count of an exchange's delayed messages and its gauge
    /// (dropped when none is left).
    fn count_delayed(&mut self, queue: u32, sign: i64) {
        let q = &mut self.queues[queue as usize];
        match sign > 0 {
            true => q.delayed += 1,
            false => q.delayed -= 1,
        }
        let labels = || ExchangeLabels {
            vhost: q.vhost.to_string(),
            exchange: q.queue.to_string(),
        };
        match (&q.delayed_series, q.delayed) {
            (Some(_), 0) => {
                self.metrics.delayed.held.remove(&labels());
                q.delayed_series = None;
            }
            (Some(gauge), n) => {
                gauge.set(n as i64);
            }
            (None, 0) => {}
            (None, n) => {
                let gauge = self.metrics.delayed.held.get_or_create_owned(&labels());
                gauge.set(n as i64);
                q.delayed_series = Some(gauge);
            }
        }
    }

    /// `id` goes to an exchange of its own now (a re-route): it is no
    /// longer a delayed message, whatever it was.
    pub(crate) fn rerouted(&mut self, id: u64) {
        let Some(entry) = self.entries.get(id).copied() else {
            return;
        };
        if entry.meta.delayed {
            self.count_delayed(entry.meta.queue, -1);
        }
        let entry = self.entries.get_mut(id).expect("checked above");
        entry.meta.dead_letter = true;
        entry.meta.delayed = false;
    }

    /// Moves a queue's totals and its two gauges. A queue that holds nothing
    /// any more drops its series, so short-lived queues do not pile up.
    fn account(&mut self, entry: &Entry, sign: i64) {
        self.due.add(entry.due_ms, entry.coarse, sign);
        self.count_blocked(entry, sign);
        if entry.meta.delayed {
            self.count_delayed(entry.meta.queue, sign);
        }
        let metrics = &self.metrics;
        let q = &mut self.queues[entry.meta.queue as usize];
        if sign > 0 {
            q.count += 1;
            q.bytes += u64::from(entry.meta.size);
        } else {
            q.count -= 1;
            q.bytes -= u64::from(entry.meta.size);
        }
        let labels = || QueueLabels {
            vhost: q.vhost.to_string(),
            queue: q.queue.to_string(),
        };
        match (&q.series, q.count) {
            (Some(_), 0) => {
                let labels = labels();
                metrics.held.remove(&labels);
                metrics.held_bytes.remove(&labels);
                q.series = None;
            }
            (Some((count, bytes)), _) => {
                count.set(q.count as i64);
                bytes.set(q.bytes as i64);
            }
            (None, 0) => {}
            (None, _) => {
                let labels = labels();
                let series = (
                    metrics.held.get_or_create_owned(&labels),
                    metrics.held_bytes.get_or_create_owned(&labels),
                );
                series.0.set(q.count as i64);
                series.1.set(q.bytes as i64);
                q.series = Some(series);
            }
        }
    }
}

mod due;
mod idmap;
#[cfg(test)]
mod tests;

use due::DueCounts;
use idmap::IdMap;

// What a held message costs in RAM is mostly this (docs/src/limits.md).
const _: () = assert!(std::mem::size_of::<Entry>() <= 48);

//! The engine's book of held messages: where each one is in the store, when
//! it is due, and per-queue totals exported as `nackd_held_messages` and
//! `nackd_held_bytes`.
//!
//! Queue names are interned: an entry carries a `u32`, so a held message
//! costs a few dozen bytes of RAM whatever its queue name.

use std::collections::HashMap;
use std::sync::Arc;

use prometheus_client::metrics::gauge::Gauge;

use crate::metrics::{Metrics, QueueLabels};
use crate::store::Loc;

/// One held message.
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    /// Its put record.
    pub loc: Loc,
    /// When it is due, in ms since the Unix epoch.
    pub due_ms: u64,
    /// Interned `(vhost, queue)`.
    pub queue: u32,
    /// Header + body bytes.
    pub size: u32,
    /// Retry number in its headers.
    pub retry: u32,
    /// Matches the wheel entry that may fire it; older ones are stale.
    pub token: u32,
    /// Failed publish attempts (nack, return, read error).
    pub attempts: u16,
    /// Handed to the republisher, not confirmed yet.
    pub inflight: bool,
    /// Fired early by an operator: its lateness means nothing.
    pub forced: bool,
    /// It goes to an `on_exhausted` exchange, not back to its queue.
    pub dead_letter: bool,
}

impl Entry {
    /// A fresh entry.
    pub fn new(
        loc: Loc,
        due_ms: u64,
        queue: u32,
        size: u32,
        retry: u32,
        dead_letter: bool,
    ) -> Self {
        Self {
            loc,
            due_ms,
            queue,
            size,
            retry,
            token: 0,
            attempts: 0,
            inflight: false,
            forced: false,
            dead_letter,
        }
    }
}

/// Totals of one queue, with the handles of its exported series.
struct QueueStat {
    vhost: Arc<str>,
    queue: Arc<str>,
    count: u64,
    bytes: u64,
    series: Option<(Gauge, Gauge)>,
}

/// Held messages by store id, and per-queue totals.
pub struct Ledger {
    entries: HashMap<u64, Entry>,
    queues: Vec<QueueStat>,
    names: HashMap<(Arc<str>, Arc<str>), u32>,
    metrics: Arc<Metrics>,
}

impl Ledger {
    /// An empty ledger reporting into `metrics`.
    pub fn new(metrics: Arc<Metrics>, capacity: usize) -> Self {
        Self {
            entries: HashMap::with_capacity(capacity),
            queues: Vec::new(),
            names: HashMap::new(),
            metrics,
        }
    }

    /// The interned id of `(vhost, queue)`.
    pub fn intern(&mut self, vhost: &Arc<str>, queue: &Arc<str>) -> u32 {
        if let Some(id) = self.names.get(&(vhost.clone(), queue.clone())) {
            return *id;
        }
        let id = self.queues.len() as u32;
        self.queues.push(QueueStat {
            vhost: vhost.clone(),
            queue: queue.clone(),
            count: 0,
            bytes: 0,
            series: None,
        });
        self.names.insert((vhost.clone(), queue.clone()), id);
        id
    }

    /// `(vhost, queue)` of an interned id.
    pub fn name(&self, queue: u32) -> (&Arc<str>, &Arc<str>) {
        let q = &self.queues[queue as usize];
        (&q.vhost, &q.queue)
    }

    /// The interned id of `(vhost, queue)` if a message of it was ever held.
    pub fn find(&self, vhost: &str, queue: &str) -> Option<u32> {
        self.names
            .get(&(Arc::from(vhost), Arc::from(queue)))
            .copied()
    }

    /// Adds (or replaces) a held message.
    pub fn insert(&mut self, id: u64, entry: Entry) {
        if let Some(old) = self.entries.insert(id, entry) {
            self.account(&old, -1);
        }
        self.account(&entry, 1);
    }

    /// Removes a held message.
    pub fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        self.account(&entry, -1);
        Some(entry)
    }

    /// A held message.
    pub fn get(&self, id: u64) -> Option<&Entry> {
        self.entries.get(&id)
    }

    /// A held message, to change its schedule state.
    pub fn get_mut(&mut self, id: u64) -> Option<&mut Entry> {
        self.entries.get_mut(&id)
    }

    /// Every held message.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &Entry)> {
        self.entries.iter().map(|(id, e)| (*id, e))
    }

    /// Number of held messages.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// `(vhost, queue, count, bytes)` of every queue holding something.
    pub fn totals(&self) -> impl Iterator<Item = (u32, &Arc<str>, &Arc<str>, u64, u64)> {
        self.queues
            .iter()
            .enumerate()
            .filter(|(_, q)| q.count > 0)
            .map(|(i, q)| (i as u32, &q.vhost, &q.queue, q.count, q.bytes))
    }

    /// Moves a queue's totals and its two gauges. A queue that holds nothing
    /// any more drops its series, so short-lived queues do not pile up.
    fn account(&mut self, entry: &Entry, sign: i64) {
        let metrics = &self.metrics;
        let q = &mut self.queues[entry.queue as usize];
        if sign > 0 {
            q.count += 1;
            q.bytes += u64::from(entry.size);
        } else {
            q.count -= 1;
            q.bytes -= u64::from(entry.size);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn loc() -> Loc {
        Loc {
            segment: 1,
            offset: 0,
            len: 10,
        }
    }

    #[test]
    fn per_queue_series_follow_the_held_messages_and_leave_at_zero() {
        let metrics = Metrics::new();
        let mut ledger = Ledger::new(metrics.clone(), 4);
        let (vhost, a, b) = (Arc::from("/"), Arc::from("a"), Arc::from("b"));
        let (qa, qb) = (ledger.intern(&vhost, &a), ledger.intern(&vhost, &b));
        assert_eq!(ledger.intern(&vhost, &a), qa, "interned once");
        ledger.insert(1, Entry::new(loc(), 10, qa, 100, 1, false));
        ledger.insert(2, Entry::new(loc(), 20, qa, 50, 1, false));
        ledger.insert(3, Entry::new(loc(), 30, qb, 7, 2, false));
        let labels = |q: &str| QueueLabels {
            vhost: "/".into(),
            queue: q.into(),
        };
        assert_eq!(metrics.held.get_or_create(&labels("a")).get(), 2);
        assert_eq!(metrics.held_bytes.get_or_create(&labels("a")).get(), 150);
        ledger.insert(2, Entry::new(loc(), 25, qa, 50, 1, true)); // a re-route replaces
        assert_eq!(metrics.held.get_or_create(&labels("a")).get(), 2);
        ledger.remove(3);
        assert!(
            metrics.held.get(&labels("b")).is_none(),
            "an empty queue drops its series"
        );
        assert!(!metrics.encode().contains("queue=\"b\""));
        ledger.insert(4, Entry::new(loc(), 40, qb, 9, 1, false));
        assert_eq!(
            metrics.held_bytes.get_or_create(&labels("b")).get(),
            9,
            "and gets it back"
        );
        let totals: Vec<_> = ledger
            .totals()
            .map(|(_, _, q, n, bytes)| (q.to_string(), n, bytes))
            .collect();
        assert_eq!(
            totals,
            vec![("a".to_string(), 2, 150), ("b".to_string(), 1, 9)]
        );
        assert_eq!(ledger.find("/", "b"), Some(qb));
        assert_eq!(ledger.len(), 3);
    }
}

//! The deferred tags of a session (the session defers them), by channel and due time,
//! and the rate their nacks go at.
//!
//! Deferred nacks: a nack nackd would claim but cannot hold right now (the
//! store full or failing, no lease, the capture budget spent, headers it
//! cannot rewrite) is not settled upstream as the client sent it. With the
//! usual `requeue=false` and no dead-letter exchange that would drop the
//! message, and an immediate requeue spends a quorum queue's delivery-limit
//! in a tight loop. The delivery stays unacked at the broker instead (a
//! crash of nackd loses nothing: the broker requeues it) and, after a
//! delay, the session sends `basic.nack(tag, requeue=true)`, rate-limited.
//!
//! A deferred tag is the broker's to requeue when its channel or
//! connection goes (a close, `basic.recover`, the broker gone): then it is
//! simply forgotten, and it never holds a close or a barrier open.

use super::consumer::ConsumerRef;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;

/// The delay of a deferral when the policy's is not known (the message
/// was not captured, so its retry number is not known either).
pub(super) const FALLBACK_DELAY: Duration = Duration::from_secs(1);
/// The shortest deferral: a policy delay of zero must not make a loop.
pub(super) const MIN_DELAY: Duration = Duration::from_millis(100);
/// The longest deferral: the delivery counts against the consumer's
/// prefetch meanwhile, so long policy delays are not waited out in full.
pub(super) const MAX_DELAY: Duration = Duration::from_secs(30);
/// Deferred nacks a session sends at most: one per this interval...
pub(super) const RATE_INTERVAL: Duration = Duration::from_millis(10);
/// ... after a burst of this many.
pub(super) const RATE_BURST: u32 = 50;

/// The deferred tags of one session, by channel and by due time, and the
/// rate their nacks go at.
pub(super) struct Deferrals {
    /// (channel, tag) → when its nack is due, and the consumer its
    /// delivery went to.
    tags: BTreeMap<(u16, u64), (Instant, Option<ConsumerRef>)>,
    /// The same, in due order.
    due: BTreeSet<(Instant, u16, u64)>,
    /// The rate limit as a GCRA: the theoretical time of the next nack
    /// (`None` until the first).
    next_at: Option<Instant>,
    /// `nackd_deferred_nacks`, shared by every session.
    gauge: Gauge,
}

impl Deferrals {
    pub(super) fn new(gauge: Gauge) -> Self {
        Self {
            tags: BTreeMap::new(),
            due: BTreeSet::new(),
            next_at: None,
            gauge,
        }
    }

    /// Defers `tag` of `channel` until `due`.
    pub(super) fn insert(
        &mut self,
        channel: u16,
        tag: u64,
        due: Instant,
        from: Option<ConsumerRef>,
    ) {
        match self.tags.insert((channel, tag), (due, from)) {
            Some((old, _)) => {
                self.due.remove(&(old, channel, tag));
            }
            None => {
                self.gauge.inc();
            }
        }
        self.due.insert((due, channel, tag));
    }

    /// Forgets `tag` of `channel`; whether it was deferred.
    pub(super) fn remove(&mut self, channel: u16, tag: u64) -> bool {
        let Some((due, _)) = self.tags.remove(&(channel, tag)) else {
            return false;
        };
        self.due.remove(&(due, channel, tag));
        self.gauge.dec();
        true
    }

    /// Whether `tag` of `channel` is deferred.
    pub(super) fn contains(&self, channel: u16, tag: u64) -> bool {
        self.tags.contains_key(&(channel, tag))
    }

    /// The lowest deferred tag of `channel`.
    pub(super) fn lowest(&self, channel: u16) -> Option<u64> {
        self.of(channel).next()
    }

    /// Whether a deferred tag of `channel` is at or below `tag` (any, with
    /// `multiple` and 0), as a settle covers them.
    pub(super) fn within(&self, channel: u16, tag: u64, multiple: bool) -> bool {
        match (multiple, tag) {
            (true, 0) => self.lowest(channel).is_some(),
            (true, tag) => self.lowest(channel).is_some_and(|t| t <= tag),
            (false, tag) => self.contains(channel, tag),
        }
    }

    /// Forgets the deferred tags of `channel` whose deliveries went to
    /// consumer `from`; returns them.
    pub(super) fn take_from(&mut self, channel: u16, from: &ConsumerRef) -> Vec<u64> {
        let tags: Vec<u64> = self
            .tags
            .range((channel, 0)..=(channel, u64::MAX))
            .filter(|(_, (_, f))| f.as_ref() == Some(from))
            .map(|((_, tag), _)| *tag)
            .collect();
        for tag in &tags {
            self.remove(channel, *tag);
        }
        tags
    }

    /// Takes the deferred tags of `channel`.
    pub(super) fn take_channel(&mut self, channel: u16) -> Vec<u64> {
        let tags: Vec<u64> = self.of(channel).collect();
        for tag in &tags {
            self.remove(channel, *tag);
        }
        tags
    }

    /// Takes every deferred tag.
    pub(super) fn take_all(&mut self) -> Vec<(u16, u64)> {
        let all: Vec<(u16, u64)> = self.tags.keys().copied().collect();
        self.gauge.dec_by(all.len() as i64);
        (self.tags, self.due) = Default::default();
        all
    }

    /// Takes the tags due at `now` whose nacks the rate allows now, in due order.
    pub(super) fn take_due(&mut self, now: Instant) -> Vec<(u16, u64)> {
        let mut taken = Vec::new();
        while let Some(&(due, channel, tag)) = self.due.first() {
            if due > now || !self.rate_allows(now) {
                break;
            }
            self.remove(channel, tag);
            let next = self.next_at.map_or(now, |at| at.max(now));
            self.next_at = Some(next + RATE_INTERVAL);
            taken.push((channel, tag));
        }
        taken
    }

    /// When the next nack may go: when it is due, or later when the rate
    /// limit holds it back.
    pub(super) fn next_wake(&self) -> Option<Instant> {
        let &(due, _, _) = self.due.first()?;
        Some(due.max(self.rate_free_at().unwrap_or(due)))
    }

    /// How many tags are deferred.
    pub(super) fn len(&self) -> usize {
        self.tags.len()
    }

    fn of(&self, channel: u16) -> impl Iterator<Item = u64> + '_ {
        self.tags
            .range((channel, 0)..=(channel, u64::MAX))
            .map(|((_, tag), _)| *tag)
    }

    /// Whether a nack may go at `now` (at most [`RATE_BURST`] ahead of the
    /// rate).
    fn rate_allows(&self, now: Instant) -> bool {
        self.rate_free_at().is_none_or(|at| at <= now)
    }

    /// From when the rate lets the next nack go.
    fn rate_free_at(&self) -> Option<Instant> {
        let tolerance = RATE_INTERVAL * (RATE_BURST - 1);
        self.next_at
            .map(|at| at.checked_sub(tolerance).unwrap_or(at))
    }
}

impl Drop for Deferrals {
    fn drop(&mut self) {
        // The session is over: the broker requeued what it still had.
        self.gauge.dec_by(self.tags.len() as i64);
    }
}

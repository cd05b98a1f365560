//! Destinations that refuse publishes: an exchange that is missing or
//! refuses nackd (a whole lane), or a queue that is gone. While one is
//! blocked its messages are set aside without being read or sent, and one
//! message at a time (the *probe*) tries it again after a backoff; the
//! probe's answer lifts the block or extends it.

use std::collections::HashMap;
use std::hash::Hash;

/// How long a probe may go unanswered before another message may probe
/// (its connection may be down for long).
const PROBE_TIMEOUT_MS: u64 = 60_000;

/// Waits between probes: `first_ms`, doubling up to `max_ms`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Backoff {
    pub first_ms: u64,
    pub max_ms: u64,
}

impl Backoff {
    fn after(self, step: u32) -> u64 {
        self.first_ms
            .saturating_mul(1u64 << step.min(20))
            .min(self.max_ms)
    }
}

/// One blocked destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Block {
    /// When it was found blocked.
    pub since_ms: u64,
    /// When the next probe may go.
    pub until_ms: u64,
    /// Probes that failed.
    pub step: u32,
    /// Why (a ledger reason id).
    pub reason: u16,
    /// The message probing it now, and since when.
    pub probe: Option<(u64, u64)>,
}

/// What a refusal did to the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The destination was not blocked before.
    New,
    /// The probe failed: the next one waits longer.
    Extended,
    /// Part of a refusal already known (several messages were in flight).
    Known,
}

/// Blocked destinations by key.
#[derive(Debug)]
pub(super) struct Blocks<K> {
    map: HashMap<K, Block>,
    backoff: Backoff,
}

impl<K: Hash + Eq + Clone> Blocks<K> {
    /// None blocked; probes wait `backoff`.
    pub(super) fn new(backoff: Backoff) -> Self {
        Self {
            map: HashMap::new(),
            backoff,
        }
    }

    /// Message `id` for `key` is due at `now`: `None` lets it go (as the
    /// probe if `key` is blocked), `Some(at)` sets it aside until `at`.
    pub(super) fn admit(&mut self, key: &K, id: u64, now: u64) -> Option<u64> {
        let backoff = self.backoff;
        let b = self.map.get_mut(key)?;
        let probe_free = match b.probe {
            None => true,
            Some((probe, _)) if probe == id => return None,
            Some((_, at)) => now >= at + PROBE_TIMEOUT_MS,
        };
        if probe_free && now >= b.until_ms {
            b.probe = Some((id, now));
            return None;
        }
        Some(next_try(b, backoff, now))
    }

    /// A publish of `id` to `key` was refused for the whole destination;
    /// returns when `id` may be tried again and what changed.
    pub(super) fn refused(&mut self, key: K, id: u64, reason: u16, now: u64) -> (u64, Refusal) {
        let backoff = self.backoff;
        match self.map.get_mut(&key) {
            None => {
                let until_ms = now + backoff.after(0);
                let block = Block {
                    since_ms: now,
                    until_ms,
                    step: 0,
                    reason,
                    probe: None,
                };
                self.map.insert(key, block);
                (until_ms, Refusal::New)
            }
            Some(b) if b.probe.is_some_and(|(probe, _)| probe == id) => {
                b.step = b.step.saturating_add(1);
                b.until_ms = now + backoff.after(b.step);
                b.reason = reason;
                b.probe = None;
                (b.until_ms, Refusal::Extended)
            }
            Some(b) => (next_try(b, backoff, now), Refusal::Known),
        }
    }

    /// A publish to `key` went through: it is not blocked any more.
    pub(super) fn accepted(&mut self, key: &K) -> Option<Block> {
        self.map.remove(key)
    }

    /// `id` will not answer for `key` (it left): another may probe.
    pub(super) fn forget_probe(&mut self, key: &K, id: u64) {
        if let Some(b) = self.map.get_mut(key) {
            if b.probe.is_some_and(|(probe, _)| probe == id) {
                b.probe = None;
            }
        }
    }

    /// Unblocks `key` without a probe (its messages are all gone).
    pub(super) fn remove(&mut self, key: &K) -> Option<Block> {
        self.map.remove(key)
    }

    /// The block of `key`.
    pub(super) fn get(&self, key: &K) -> Option<&Block> {
        self.map.get(key)
    }

    /// Every block.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&K, &Block)> {
        self.map.iter()
    }
}

/// When a message set aside for `b` comes back: at the next probe time, or
/// one backoff from now if that is past (a probe is out).
fn next_try(b: &Block, backoff: Backoff, now: u64) -> u64 {
    if b.until_ms > now {
        b.until_ms
    } else {
        now + backoff.after(b.step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Backoff = Backoff {
        first_ms: 1000,
        max_ms: 4000,
    };

    #[test]
    fn one_probe_at_a_time_and_the_backoff_grows_to_its_cap() {
        let mut blocks = Blocks::new(B);
        assert_eq!(blocks.admit(&"x", 1, 0), None, "not blocked: goes");
        assert_eq!(blocks.refused("x", 1, 7, 10), (1010, Refusal::New));
        assert_eq!(
            blocks.refused("x", 2, 7, 11),
            (1010, Refusal::Known),
            "same event"
        );
        assert_eq!(
            blocks.admit(&"x", 3, 500),
            Some(1010),
            "waits for the probe time"
        );
        assert_eq!(blocks.admit(&"x", 3, 1010), None, "3 probes");
        assert_eq!(
            blocks.admit(&"x", 4, 1011),
            Some(2011),
            "one probe at a time"
        );
        assert_eq!(blocks.refused("x", 3, 7, 1020), (3020, Refusal::Extended));
        assert_eq!(blocks.admit(&"x", 4, 3020), None);
        assert_eq!(blocks.refused("x", 4, 7, 3030).0, 7030);
        assert_eq!(blocks.admit(&"x", 5, 7030), None);
        assert_eq!(blocks.refused("x", 5, 7, 7040).0, 11040, "capped at 4 s");
        assert_eq!(blocks.get(&"x").unwrap().step, 3);
        assert_eq!(blocks.admit(&"x", 6, 11040), None);
        assert!(blocks.accepted(&"x").is_some(), "the probe went through");
        assert_eq!(blocks.admit(&"x", 7, 11041), None, "all go again");
        assert_eq!(blocks.admit(&"x", 8, 11041), None);
    }

    #[test]
    fn a_probe_that_never_answers_is_replaced() {
        let mut blocks = Blocks::new(B);
        blocks.refused("x", 1, 7, 0);
        assert_eq!(blocks.admit(&"x", 2, 1000), None);
        assert!(blocks.admit(&"x", 3, 1000 + PROBE_TIMEOUT_MS - 1).is_some());
        assert_eq!(blocks.admit(&"x", 3, 1000 + PROBE_TIMEOUT_MS), None);
        blocks.forget_probe(&"x", 3);
        assert_eq!(blocks.admit(&"x", 4, 1000 + PROBE_TIMEOUT_MS), None);
    }
}

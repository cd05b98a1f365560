//! Due times of the held messages, counted per second (per minute for
//! messages parked more than an hour ahead), so that the status page's
//! chart costs the number of distinct due times within its last bucket,
//! not the number of messages. What is already due is one running count,
//! moved forward with the engine's clock.

use std::collections::BTreeMap;

/// Counts of held messages by due second and by due minute.
#[derive(Debug, Default)]
pub(super) struct DueCounts {
    seconds: BTreeMap<u64, u32>,
    minutes: BTreeMap<u64, u32>,
    /// Messages due at or before `passed_s` (seconds) or `passed_m` (minutes).
    passed: u64,
    passed_s: u64,
    passed_m: u64,
}

impl DueCounts {
    /// Counts one message more (`sign > 0`) or less.
    pub(super) fn add(&mut self, due_ms: u64, coarse: bool, sign: i64) {
        let (map, key, passed) = match coarse {
            false => (&mut self.seconds, due_ms / 1000, self.passed_s),
            true => (&mut self.minutes, due_ms / 60_000, self.passed_m),
        };
        if sign > 0 {
            *map.entry(key).or_default() += 1;
        } else if let Some(n) = map.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                map.remove(&key);
            }
        } else {
            return;
        }
        if key <= passed {
            match sign > 0 {
                true => self.passed += 1,
                false => self.passed -= 1,
            }
        }
    }

    /// The clock moved to `now_ms`: what fell due joins the running count
    /// (each distinct due time is looked at once).
    pub(super) fn advance(&mut self, now_ms: u64) {
        let (now_s, now_m) = (now_ms / 1000, now_ms / 60_000);
        if now_s > self.passed_s {
            self.passed += sum(span(&self.seconds, self.passed_s + 1, now_s));
            self.passed_s = now_s;
        }
        if now_m > self.passed_m {
            self.passed += sum(span(&self.minutes, self.passed_m + 1, now_m));
            self.passed_m = now_m;
        }
    }

    /// How many of `total` held messages fall due in each interval ending
    /// at `edges` seconds from `now_ms` (the first counts what is due
    /// already; one more bucket counts the rest).
    pub(super) fn chart(&self, now_ms: u64, edges: &[u64], total: u64) -> Vec<u64> {
        let mut counts = vec![0u64; edges.len() + 1];
        let last = edges.last().copied().unwrap_or(0);
        let (now_s, now_m) = (now_ms / 1000, now_ms / 60_000);
        let due_now = if now_s >= self.passed_s && now_m >= self.passed_m {
            self.passed
                + sum(span(&self.seconds, self.passed_s + 1, now_s))
                + sum(span(&self.minutes, self.passed_m + 1, now_m))
        } else {
            // A clock behind the last advance (never the engine's).
            sum(self.seconds.range(..=now_s)) + sum(self.minutes.range(..=now_m))
        };
        let mut counted = due_now;
        counts[0] = due_now;
        let mut add = |in_s: u64, n: u32| {
            counts[edges.partition_point(|edge| *edge < in_s)] += u64::from(n);
            counted += u64::from(n);
        };
        for (s, n) in span(&self.seconds, now_s + 1, now_s + last) {
            add(s - now_s, *n);
        }
        for (m, n) in span(&self.minutes, now_m + 1, (now_s + last) / 60) {
            add((m * 60).saturating_sub(now_s).max(1), *n);
        }
        counts[edges.len()] += total.saturating_sub(counted);
        counts
    }
}

fn sum<'a>(counts: impl Iterator<Item = (&'a u64, &'a u32)>) -> u64 {
    counts.map(|(_, n)| u64::from(*n)).sum()
}

/// The entries of `map` with keys in `from..=to` (none if `from > to`,
/// where `BTreeMap::range` would panic).
fn span(map: &BTreeMap<u64, u32>, from: u64, to: u64) -> impl Iterator<Item = (&u64, &u32)> {
    let range = (from <= to).then(|| map.range(from..=to));
    range.into_iter().flatten()
}

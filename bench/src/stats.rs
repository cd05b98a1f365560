//! Order statistics shared by every scenario: percentiles of latency
//! samples and the median of per-round figures.

use std::time::Duration;

/// The value at percentile `p` (0–100) of sorted `samples`, nearest-rank
/// method: the smallest sample with at least `p`% of the samples at or below
/// it. `None` when there are no samples.
pub fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The median of `values` (mean of the two middle ones for an even count).
pub fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// Latency samples of one run, in nanoseconds.
#[derive(Clone, Debug, Default)]
pub struct Latencies {
    samples: Vec<u64>,
}

/// What a run's latencies come to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub count: usize,
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Largest sample.
    pub max: Duration,
}

impl Latencies {
    /// Adds one sample.
    pub fn record(&mut self, latency: Duration) {
        self.samples
            .push(latency.as_nanos().min(u64::MAX as u128) as u64);
    }

    /// Adds every sample of `other`.
    pub fn extend(&mut self, other: Latencies) {
        self.samples.extend(other.samples);
    }

    /// Number of samples so far.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// True before the first sample.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Percentiles of the samples; `None` without samples.
    pub fn summary(mut self) -> Option<Summary> {
        self.samples.sort_unstable();
        let at = |p| percentile(&self.samples, p).map(Duration::from_nanos);
        Some(Summary {
            count: self.samples.len(),
            p50: at(50.0)?,
            p99: at(99.0)?,
            max: at(100.0)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let sorted: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&sorted, 50.0), Some(50));
        assert_eq!(percentile(&sorted, 99.0), Some(99));
        assert_eq!(percentile(&sorted, 99.5), Some(100));
        assert_eq!(percentile(&sorted, 100.0), Some(100));
        assert_eq!(
            percentile(&sorted, 0.0),
            Some(1),
            "p0 is the smallest sample"
        );
        assert_eq!(percentile(&[7], 99.0), Some(7));
        assert_eq!(percentile(&[], 50.0), None);
        // With 10 samples, p99 is the largest, not an interpolation.
        assert_eq!(
            percentile(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 1000], 99.0),
            Some(1000)
        );
    }

    #[test]
    fn median_of_odd_and_even_counts_ignores_order() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn summary_sorts_the_samples_it_was_given_unsorted() {
        let mut l = Latencies::default();
        for ms in [9, 1, 5, 3, 7, 2, 8, 4, 6, 10] {
            l.record(Duration::from_millis(ms));
        }
        let s = l.summary().unwrap();
        assert_eq!(s.count, 10);
        assert_eq!(s.p50, Duration::from_millis(5));
        assert_eq!(s.p99, Duration::from_millis(10));
        assert_eq!(s.max, Duration::from_millis(10));
        assert_eq!(Latencies::default().summary(), None);
    }
}

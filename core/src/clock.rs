//! nackd's one clock: the wall clock read once at start, then advanced by
//! the monotonic clock. Every time nackd reads, it reads here: due times,
//! `x-death` times, recent events, heartbeats, deadlines and lateness all
//! come from one [`Clock`], so a wall-clock step never makes a held message
//! early, the session's instants map to the same milliseconds as the
//! engine's, and a test can drive time by hand ([`Clock::manual`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, read from a monotonic clock (or, in
/// tests, moved by hand).
#[derive(Clone, Debug)]
pub struct Clock {
    origin: Instant,
    origin_ms: u64,
    source: Source,
}

#[derive(Clone, Debug)]
enum Source {
    /// The monotonic clock.
    Monotonic,
    /// µs after `origin`, moved by [`Clock::advance`].
    Manual(Arc<AtomicU64>),
}

impl Clock {
    /// A clock starting now (the only place nackd reads the wall clock).
    pub fn start() -> Self {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Self {
            origin: Instant::now(),
            origin_ms: since_epoch.as_millis() as u64,
            source: Source::Monotonic,
        }
    }

    /// A clock that stands still at `origin_ms` (ms since the epoch) until
    /// [`Clock::advance`] moves it: time in tests, without sleeping. Its
    /// clones share the hand.
    pub fn manual(origin_ms: u64) -> Self {
        Self {
            origin: Instant::now(),
            origin_ms,
            source: Source::Manual(Arc::new(AtomicU64::new(0))),
        }
    }

    /// Moves a manual clock (and its clones) forward by `by`.
    ///
    /// # Panics
    /// On a clock that follows the monotonic clock: nothing moves real time.
    pub fn advance(&self, by: Duration) {
        match &self.source {
            Source::Manual(us) => {
                us.fetch_add(by.as_micros() as u64, Ordering::SeqCst);
            }
            Source::Monotonic => panic!("only a manual clock is moved by hand"),
        }
    }

    /// Now.
    pub fn now(&self) -> Instant {
        match &self.source {
            Source::Monotonic => Instant::now(),
            Source::Manual(us) => self.origin + Duration::from_micros(us.load(Ordering::SeqCst)),
        }
    }

    /// Now, in ms since the epoch.
    pub fn now_ms(&self) -> u64 {
        self.ms_at(self.now())
    }

    /// Now, in µs since the epoch: the retry engine's timers.
    pub fn now_us(&self) -> u64 {
        self.origin_ms * 1000
            + self
                .now()
                .saturating_duration_since(self.origin)
                .as_micros() as u64
    }

    /// The instant at which `now_us()` reaches `us` (rounded up: never early).
    pub fn instant_at_us(&self, us: u64) -> Instant {
        self.origin + Duration::from_micros(us.saturating_sub(self.origin_ms * 1000))
    }

    /// `at`, in ms since the epoch (for a state machine given its time).
    pub fn ms_at(&self, at: Instant) -> u64 {
        self.origin_ms + at.saturating_duration_since(self.origin).as_millis() as u64
    }

    /// The instant at which `now_ms()` reaches `ms` (rounded up: never early).
    pub fn instant_at(&self, ms: u64) -> Instant {
        self.origin + Duration::from_millis(ms.saturating_sub(self.origin_ms))
    }

    /// The wall clock's seconds since the epoch, read now: only for what
    /// is stamped for people and other processes (a segment's creation
    /// time), never for what nackd schedules.
    pub fn wall_secs() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instants_and_milliseconds_map_both_ways() {
        let clock = Clock::start();
        let later = clock.origin + Duration::from_millis(1_500);
        assert_eq!(clock.ms_at(later), clock.origin_ms + 1_500);
        assert_eq!(clock.instant_at(clock.ms_at(later)), later);
        assert_eq!(
            clock.ms_at(clock.origin - Duration::from_secs(1)),
            clock.origin_ms
        );
        assert!(clock.now_ms() >= clock.origin_ms);
        assert_eq!(
            clock.instant_at_us(clock.origin_ms * 1000 + 1_500_250),
            clock.origin + Duration::from_micros(1_500_250)
        );
        let (ms, us) = (clock.now_ms(), clock.now_us());
        assert!(
            us / 1000 >= ms && us / 1000 - ms < 1000,
            "{us} µs vs {ms} ms"
        );
    }

    #[test]
    fn a_manual_clock_moves_only_when_advanced_and_its_clones_follow() {
        let clock = Clock::manual(1_000_000);
        let copy = clock.clone();
        let t0 = clock.now();
        assert_eq!(clock.now(), t0, "stands still");
        assert_eq!(clock.now_ms(), 1_000_000);
        copy.advance(Duration::from_micros(2_500));
        assert_eq!(clock.now(), t0 + Duration::from_micros(2_500));
        assert_eq!(clock.now_us(), 1_000_002_500);
        assert_eq!(clock.now_ms(), 1_000_002);
    }

    #[test]
    #[should_panic(expected = "only a manual clock")]
    fn the_monotonic_clock_cannot_be_moved_by_hand() {
        Clock::start().advance(Duration::from_secs(1));
    }
}

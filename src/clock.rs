//! nackd's one clock: the wall clock read once at start, then advanced by
//! the monotonic clock. Due times, `x-death` times and recent events all
//! come from it, so a wall-clock step never makes a held message early,
//! and the session's instants map to the same milliseconds as the engine's.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, read from a monotonic clock.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    origin: Instant,
    origin_ms: u64,
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
        }
    }

    /// Now, in ms since the epoch.
    pub fn now_ms(&self) -> u64 {
        self.ms_at(Instant::now())
    }

    /// Now, in µs since the epoch: the retry engine's timers.
    pub fn now_us(&self) -> u64 {
        self.origin_ms * 1000 + self.origin.elapsed().as_micros() as u64
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
}

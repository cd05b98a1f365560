//! nackd's one clock. Every time nackd reads, it reads here: due times,
//! `x-death` times, recent events, heartbeats, deadlines and lateness all
//! come from one [`Clock`], so the session's instants map to the same
//! milliseconds as the engine's, and a test can drive time by hand
//! ([`Clock::manual`]).
//!
//! Its milliseconds are the wall clock's, read at each use, but they never
//! go back: they follow the monotonic clock from the last reading, and
//! catch up with the wall clock whenever it is ahead. So a due time is the
//! wall clock at the nack plus the delay, even after the host was suspended
//! (the monotonic clock stood still) or the wall clock was set after nackd
//! started; and a wall-clock step back never makes a held message early.
//! [`Clock::raise_to_ms`] sets a floor: the latest time a store recorded,
//! so that a restart on a clock that went back holds every message by the
//! time it had left then, never less.

// This is the clock: the one place that reads the system's clocks
// (clippy.toml disallows it everywhere else).
#![allow(clippy::disallowed_methods)]

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, read from the wall clock but never
/// going back (or, in tests, moved by hand).
#[derive(Clone, Debug)]
pub struct Clock {
    origin: Instant,
    origin_ms: u64,
    source: Source,
    /// µs the clock is ahead of `origin_ms` plus the monotonic time since
    /// `origin`: the wall clock's steps forward (a suspend, a clock set
    /// late) and the floors raised. It only grows; clones share it.
    ahead_us: Arc<AtomicU64>,
}

#[derive(Clone, Debug)]
enum Source {
    /// The monotonic clock, and the system's wall clock.
    Monotonic,
    /// µs after `origin`, moved by [`Clock::advance`]; and the wall clock's
    /// µs from `origin_ms` plus that, moved by [`Clock::step_wall`].
    Manual {
        us: Arc<AtomicU64>,
        wall_us: Arc<AtomicI64>,
    },
}

impl Clock {
    /// A clock starting now.
    pub fn start() -> Self {
        // The wall clock first: a pause between the two reads then makes
        // the wall clock look behind (never ahead) of the monotonic one.
        // Rounded up: the clock is never behind the wall clock.
        let origin_ms = Self::system_us().div_ceil(1000);
        Self {
            origin: Instant::now(),
            origin_ms,
            source: Source::Monotonic,
            ahead_us: Arc::default(),
        }
    }

    /// A clock that stands still at `origin_ms` (ms since the epoch) until
    /// [`Clock::advance`] moves it: time in tests, without sleeping. Its
    /// clones share the hand.
    pub fn manual(origin_ms: u64) -> Self {
        Self {
            origin: Instant::now(),
            origin_ms,
            source: Source::Manual {
                us: Arc::default(),
                wall_us: Arc::default(),
            },
            ahead_us: Arc::default(),
        }
    }

    /// Moves a manual clock (and its clones) forward by `by`: the
    /// monotonic clock and the wall clock both.
    ///
    /// # Panics
    /// On a clock that follows the monotonic clock: nothing moves real time.
    pub fn advance(&self, by: Duration) {
        match &self.source {
            Source::Manual { us, .. } => {
                us.fetch_add(by.as_micros() as u64, Ordering::SeqCst);
            }
            Source::Monotonic => panic!("only a manual clock is moved by hand"),
        }
    }

    /// Steps a manual clock's wall clock by `by_ms` (back if negative)
    /// while its monotonic clock stands still: a host suspended (forward),
    /// or a wall clock set by hand or by NTP.
    ///
    /// # Panics
    /// On a clock that follows the monotonic clock.
    pub fn step_wall(&self, by_ms: i64) {
        match &self.source {
            Source::Manual { wall_us, .. } => {
                wall_us.fetch_add(by_ms.saturating_mul(1000), Ordering::SeqCst);
            }
            Source::Monotonic => panic!("only a manual clock is moved by hand"),
        }
    }

    /// Now.
    pub fn now(&self) -> Instant {
        match &self.source {
            Source::Monotonic => Instant::now(),
            Source::Manual { us, .. } => {
                self.origin + Duration::from_micros(us.load(Ordering::SeqCst))
            }
        }
    }

    /// Now, in ms since the epoch.
    pub fn now_ms(&self) -> u64 {
        self.now_us() / 1000
    }

    /// Now, in µs since the epoch: the retry engine's timers.
    pub fn now_us(&self) -> u64 {
        // The wall clock first, then the monotonic clock: a thread paused
        // between the two reads sees the wall clock behind by the pause,
        // which changes nothing. The other order would see it ahead, and
        // `ahead_us` would keep that pause for good (early timers).
        let wall = self.wall_us();
        let base = self.base_us(self.now());
        let ahead = self.ahead_us.load(Ordering::SeqCst);
        if wall > base.saturating_add(ahead) {
            // The wall clock is ahead of the monotonic time since the last
            // reading: it stepped forward (or the host was suspended).
            self.ahead_us.fetch_max(wall - base, Ordering::SeqCst);
        }
        base.saturating_add(self.ahead_us.load(Ordering::SeqCst))
    }

    /// Makes the clock say at least `ms` from now on (ms since the epoch):
    /// the latest time a store recorded before a restart. Returns by how
    /// much the clock was behind it (0 if it was not).
    pub fn raise_to_ms(&self, ms: u64) -> Duration {
        let now = self.now_us();
        let floor = ms.saturating_mul(1000);
        if floor <= now {
            return Duration::ZERO;
        }
        let base = self.base_us(self.now());
        self.ahead_us
            .fetch_max(floor.saturating_sub(base), Ordering::SeqCst);
        Duration::from_micros(floor - now)
    }

    /// µs since the epoch at `at`: `origin_ms` plus the monotonic time
    /// since, before the wall clock's steps forward.
    fn base_us(&self, at: Instant) -> u64 {
        (self.origin_ms * 1000)
            .saturating_add(at.saturating_duration_since(self.origin).as_micros() as u64)
    }

    /// The wall clock now, in µs since the epoch.
    fn wall_us(&self) -> u64 {
        match &self.source {
            Source::Monotonic => Self::system_us(),
            Source::Manual { us, wall_us } => {
                let mono = (self.origin_ms * 1000).saturating_add(us.load(Ordering::SeqCst));
                mono.saturating_add_signed(wall_us.load(Ordering::SeqCst))
            }
        }
    }

    fn system_us() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or_default()
    }

    /// The instant at which `now_us()` reaches `us` (rounded up: never
    /// early; late if the wall clock steps forward meanwhile).
    pub fn instant_at_us(&self, us: u64) -> Instant {
        let ahead = self.ahead_us.load(Ordering::SeqCst);
        self.origin + Duration::from_micros(us.saturating_sub(self.origin_ms * 1000 + ahead))
    }

    /// `at`, in ms since the epoch (for a state machine given its time).
    pub fn ms_at(&self, at: Instant) -> u64 {
        self.now_us(); // catches up with the wall clock first
        let ahead = self.ahead_us.load(Ordering::SeqCst);
        self.base_us(at).saturating_add(ahead) / 1000
    }

    /// The instant at which `now_ms()` reaches `ms` (rounded up: never
    /// early; late if the wall clock steps forward meanwhile).
    pub fn instant_at(&self, ms: u64) -> Instant {
        self.instant_at_us(ms.saturating_mul(1000))
    }

    /// The system's wall clock in seconds since the epoch, read now: only
    /// for what is stamped for people and other processes (a segment's
    /// creation time), never for what nackd schedules.
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
        // Back to within the millisecond: a catch-up with the wall clock
        // (µs, under load) moves the mapping by less than that.
        let back = clock.instant_at(clock.ms_at(later));
        assert!(
            back.max(later) - back.min(later) < Duration::from_millis(1),
            "{back:?} vs {later:?}"
        );
        assert_eq!(
            clock.ms_at(clock.origin - Duration::from_secs(1)),
            clock.origin_ms
        );
        assert!(clock.now_ms() >= clock.origin_ms);
        // Less what the clock caught up with the wall clock above (the
        // calls to `ms_at` and `now_ms`: some µs under load; a CI run saw
        // 596 µs). Nothing moves it between this load and the mapping.
        let ahead = clock.ahead_us.load(Ordering::SeqCst);
        assert_eq!(
            clock.instant_at_us(clock.origin_ms * 1000 + 1_500_250),
            clock.origin + Duration::from_micros(1_500_250u64.saturating_sub(ahead))
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

    /// Issue 33, item 7: the host suspended (the monotonic clock stood
    /// still while the wall clock went on): the clock says the wall
    /// clock's time at once, so a due time read from it is not early.
    #[test]
    fn a_suspend_does_not_leave_the_clock_behind_the_wall_clock() {
        let clock = Clock::manual(1_000_000);
        let t0 = clock.now();
        clock.step_wall(60_000);
        assert_eq!(clock.now(), t0, "the monotonic clock stood still");
        assert_eq!(clock.now_ms(), 1_060_000);
        assert_eq!(clock.ms_at(clock.now()), 1_060_000);
        // And it goes on from there, with the monotonic clock.
        clock.advance(Duration::from_millis(500));
        assert_eq!(clock.now_ms(), 1_060_500);
        assert_eq!(
            clock.instant_at(1_061_000),
            clock.now() + Duration::from_millis(500)
        );
    }

    /// A wall clock stepped back: the clock does not go back (what was
    /// held would be late by the step, and what is held now early once
    /// the wall clock is set right again), it goes on with the monotonic
    /// clock.
    #[test]
    fn a_wall_clock_stepped_back_does_not_take_the_clock_back() {
        let clock = Clock::manual(1_000_000);
        clock.step_wall(-30_000);
        assert_eq!(clock.now_ms(), 1_000_000);
        clock.advance(Duration::from_secs(1));
        assert_eq!(clock.now_ms(), 1_001_000);
        // Once the wall clock is ahead again, the clock follows it.
        clock.step_wall(40_000);
        assert_eq!(clock.now_ms(), 1_011_000);
    }

    /// A floor (the latest time a store recorded): the clock says at
    /// least that from then on, and a floor behind it changes nothing.
    #[test]
    fn a_floor_raises_the_clock_and_never_lowers_it() {
        let clock = Clock::manual(1_000_000);
        assert_eq!(clock.raise_to_ms(999_000), Duration::ZERO);
        assert_eq!(clock.now_ms(), 1_000_000);
        assert_eq!(clock.raise_to_ms(1_600_000), Duration::from_secs(600));
        assert_eq!(clock.now_ms(), 1_600_000);
        clock.advance(Duration::from_millis(250));
        assert_eq!(clock.now_ms(), 1_600_250);
        assert_eq!(
            clock.instant_at(1_601_250),
            clock.now() + Duration::from_secs(1)
        );
        // The clones share it.
        assert_eq!(clock.clone().now_ms(), 1_600_250);
    }

    #[test]
    #[should_panic(expected = "only a manual clock")]
    fn the_monotonic_clock_cannot_be_moved_by_hand() {
        Clock::start().advance(Duration::from_secs(1));
    }

    /// Many threads reading the clock on a loaded machine: a thread paused
    /// between its two reads must not push the clock ahead of the wall
    /// clock (a timer armed before would fire early by the pause).
    #[test]
    fn threads_paused_between_the_two_reads_do_not_push_the_clock_ahead() {
        let clock = Clock::start();
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let c = clock.clone();
                std::thread::spawn(move || {
                    let end = Instant::now() + Duration::from_millis(1000);
                    while Instant::now() < end {
                        c.now_us();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let mut worst = 0i64;
        for _ in 0..1000 {
            let ours = clock.now_us() as i64;
            let after = Clock::system_us() as i64;
            worst = worst.max(ours - after);
        }
        // 1 ms: the start's rounding up to a whole ms.
        assert!(
            worst <= 1_000,
            "the clock runs {worst} µs ahead of the wall clock"
        );
    }
}

//! Fewer wake-ups for a session whose peer streams (`runtime.coalesce`).
//!
//! On loopback or a fast network a peer that streams (a publisher with
//! many unconfirmed publishes, a broker delivering under a large prefetch)
//! wakes nackd for every message or two, and each wake-up costs a sleep, a
//! wake, a read and a write, nearly all of it in the kernel. Once a session
//! has been woken several times in a row soon after it went to sleep, each
//! time by a peer that sent without waiting for anything nackd forwarded,
//! its thread pauses for `coalesce` before reading: the read then finds
//! several messages and one write carries them on.
//!
//! What is never paused for:
//! - a frame after a quiet spell: the session slept `coalesce` or longer;
//! - a frame that answers one nackd forwarded (a confirm after a publish,
//!   a delivery after an ack under prefetch 1, any request and reply):
//!   holding it would slow the exchange, not batch it;
//! - a thread that paused less than `coalesce` ago: one pause serves every
//!   session of the thread, so a thread is never paused more than half the
//!   time, and a frame waits for one pause at most.
//!
//! Gaps are timed on the monotonic clock, not on nackd's clock: they
//! measure the thread's sleeps, which a hand-driven test clock would
//! flatten to zero.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// Short gaps in a row, each ended by a peer that sent unprompted, before
/// a wake-up pauses.
pub const STREAK: u32 = 4;

/// The longest pause `runtime.coalesce` accepts.
pub const MAX_PAUSE: Duration = Duration::from_millis(1);

thread_local! {
    /// When this thread's last pause ended.
    static PAUSED_UNTIL: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// The two sides of a session, as indices.
pub const CLIENT: usize = 0;
/// See [`CLIENT`].
pub const UPSTREAM: usize = 1;

/// One session's wake-up pattern.
#[derive(Debug)]
pub struct Coalesce {
    pause: Duration,
    /// When the session last went to sleep.
    asleep_at: Instant,
    /// Whether this wake-up came soon after the session went to sleep.
    short_gap: bool,
    /// Wake-ups in a row that were short gaps with an unprompted read.
    streak: u32,
    /// Per side: nackd wrote to it since it last sent.
    prompted: [bool; 2],
    /// A side sent without having been written to, in this wake-up.
    unprompted: bool,
}

impl Coalesce {
    /// A session that went to sleep at `now`; `pause` zero turns it off.
    pub fn new(pause: Duration, now: Instant) -> Self {
        Self {
            pause,
            asleep_at: now,
            short_gap: false,
            streak: 0,
            prompted: [false; 2],
            unprompted: false,
        }
    }

    /// The session is woken at `now`: how long its thread should pause
    /// before reading, if at all. Records the pause for the thread.
    pub fn on_wake(&mut self, now: Instant) -> Option<Duration> {
        if self.pause.is_zero() {
            return None;
        }
        self.short_gap = now.saturating_duration_since(self.asleep_at) < self.pause;
        self.unprompted = false;
        if !self.short_gap || self.streak < STREAK {
            return None;
        }
        PAUSED_UNTIL.with(|until| match until.get() {
            Some(end) if now < end + self.pause => None,
            _ => {
                until.set(Some(now + self.pause));
                Some(self.pause)
            }
        })
    }

    /// `side` sent bytes.
    pub fn read(&mut self, side: usize) {
        if !std::mem::take(&mut self.prompted[side]) {
            self.unprompted = true;
        }
    }

    /// nackd wrote bytes to `side`.
    pub fn wrote(&mut self, side: usize) {
        self.prompted[side] = true;
    }

    /// The session goes back to sleep at `now`.
    pub fn on_sleep(&mut self, now: Instant) {
        self.streak = match self.short_gap && self.unprompted {
            true => self.streak.saturating_add(1),
            false => 0,
        };
        self.asleep_at = now;
    }
}

#[cfg(test)]
mod tests;

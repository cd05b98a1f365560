//! Fewer wake-ups while a peer streams (`runtime.coalesce`).
//!
//! On loopback or a fast network a peer that streams (a publisher with
//! many unconfirmed publishes, a broker delivering under a large prefetch)
//! wakes nackd for every message or two, and each wake-up costs a sleep, a
//! wake, a read and a write, nearly all of it in the kernel. Once a session
//! has been woken several times in a row soon after it went to sleep, each
//! time by a peer that sent without waiting for anything from nackd, the
//! session thread, when it next has nothing to do, waits `coalesce` before
//! it sleeps on its sockets: what the peers send meanwhile is then read in
//! one go and carried on in one write.
//!
//! The wait happens only where the thread would sleep anyway (tokio's
//! `on_thread_park`, see [`on_park`]):
//! - a session with work ready is never delayed by it, and a thread that
//!   is never idle never waits;
//! - a frame that arrives during a wait is handled when it ends: one
//!   `coalesce` at most (the thread's timer slack is set to 1 µs so that
//!   the sleep is not stretched, see [`precise_sleeps`]);
//! - with no session streaming (request and reply, a publisher waiting for
//!   its confirms, a consumer with prefetch 1, any peer that sends only
//!   after nackd wrote to it, or a quiet spell of `coalesce`), the thread
//!   does not wait at all: a lone frame goes through at once.
//!
//! While a session streams, a frame of another session on the same thread
//! that arrives during a wait waits for it too, up to `coalesce`.
//!
//! Gaps are timed on the monotonic clock, not on nackd's clock: they
//! measure the thread's sleeps, which a hand-driven test clock would
//! flatten to zero.

use std::cell::Cell;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;

/// Short gaps in a row, each ended by a peer that sent unprompted, before
/// a session counts as streaming.
pub const STREAK: u32 = 4;

/// The longest wait `runtime.coalesce` accepts.
pub const MAX_PAUSE: Duration = Duration::from_millis(1);

/// Waits so far, every thread (`nackd_coalesce_pauses_total`).
pub static PAUSES: LazyLock<Counter> = LazyLock::new(Counter::default);

thread_local! {
    /// The wait a streaming session asked this thread for, at its next park.
    static WANTED: Cell<Option<Duration>> = const { Cell::new(None) };
    /// The time this thread has spent waiting, in all.
    static WAITED: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// The two sides of a session, as indices.
pub const CLIENT: usize = 0;
/// See [`CLIENT`].
pub const UPSTREAM: usize = 1;

/// One session's wake-up pattern.
#[derive(Debug)]
pub struct Coalesce {
    pause: Duration,
    /// When the session last went to sleep, and the thread's [`WAITED`]
    /// then: a wait of the thread is not part of the session's gap.
    asleep_at: (Instant, Duration),
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
            asleep_at: (now, waited()),
            short_gap: false,
            streak: 0,
            prompted: [false; 2],
            unprompted: false,
        }
    }

    /// The session is woken at `now`.
    pub fn on_wake(&mut self, now: Instant) {
        let (at, waited_then) = self.asleep_at;
        let thread_waited = waited().saturating_sub(waited_then);
        let gap = now
            .saturating_duration_since(at)
            .saturating_sub(thread_waited);
        self.short_gap = gap < self.pause;
        self.unprompted = false;
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

    /// The session goes back to sleep at `now`; if it streams, the thread
    /// waits before its next park.
    pub fn on_sleep(&mut self, now: Instant) {
        self.streak = match self.short_gap && self.unprompted {
            true => self.streak.saturating_add(1),
            false => 0,
        };
        self.asleep_at = (now, waited());
        if !self.pause.is_zero() && self.streak >= STREAK {
            WANTED.with(|wanted| wanted.set(Some(self.pause)));
        }
    }

    /// Whether the session streams now.
    pub fn streaming(&self) -> bool {
        self.streak >= STREAK
    }
}

fn waited() -> Duration {
    WAITED.with(Cell::get)
}

/// The wait this thread owes a streaming session, taken (at most one per
/// park); what [`on_park`] sleeps.
pub fn take_wait() -> Option<Duration> {
    WANTED.with(Cell::take)
}

/// Counts `slept` as time the thread waited (not part of sessions' gaps).
pub fn waited_for(slept: Duration) {
    WAITED.with(|w| w.set(w.get() + slept));
}

/// For tokio's `on_thread_park` of the session threads: the thread has
/// nothing to do; if a session streams, wait before sleeping on the
/// sockets.
pub fn on_park() {
    if let Some(pause) = take_wait() {
        let start = Instant::now();
        std::thread::sleep(pause);
        waited_for(start.elapsed());
        PAUSES.inc();
    }
}

/// For tokio's `on_thread_start` of the session threads: a timer slack
/// of 1 µs, so that a wait of 100 µs is not stretched by the default 50 µs.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub fn precise_sleeps() -> std::io::Result<()> {
    // SAFETY: PR_SET_TIMERSLACK takes a value and changes only the
    // calling thread.
    match unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong, 0, 0, 0) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// See the Linux version: elsewhere the default slack stays.
#[cfg(not(target_os = "linux"))]
pub fn precise_sleeps() -> std::io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests;

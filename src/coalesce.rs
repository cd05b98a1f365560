//! Fewer wake-ups while a peer streams (`runtime.coalesce`).
//!
//! On loopback or a fast network a peer that streams (a publisher with
//! many unconfirmed publishes, a broker delivering under a large prefetch)
//! wakes nackd for every message or two, and each wake-up costs a sleep, a
//! wake, a read and a write, nearly all of it in the kernel. Once a session
//! has been woken several times in a row soon after it went to sleep, each
//! time by a peer that sent without waiting for anything from nackd, its
//! thread, when it next has nothing to do, waits `coalesce` before it
//! sleeps on its sockets: what the peers send meanwhile is then read in
//! one go and carried on in one write.
//!
//! The wait happens only where the thread would sleep anyway (tokio's
//! `on_thread_park`, see [`on_park`]):
//! - a session with work ready when the thread looks for work is never
//!   delayed by it, and a thread that is never idle never waits; a task
//!   woken from another thread during a wait (an answer of the retry
//!   engine, a new connection) runs when the wait ends;
//! - a wait is owed only right after a streaming session slept: a thread
//!   that was busy for longer than `coalesce` since then does not wait (what
//!   it would wait for is there already), and at most one wait is owed per
//!   park (the timer slack of session threads is 1 µs, see
//!   [`precise_sleeps`], so a wait is not stretched by the default 50 µs;
//!   a CPU too busy to run nackd stretches it anyway);
//! - while no session of the thread streams, the thread does not wait at
//!   all: request and reply (a publisher waiting for each confirm, a
//!   consumer with prefetch 1 on one channel), a peer that sends only
//!   after nackd wrote to it, a quiet spell of `coalesce`, or a peer that
//!   sends once per `coalesce` or more slowly;
//! - nor while another session, one that does not stream (and did not
//!   in the last [`STREAMED_LATELY`], 50 ms: a stream that paused is
//!   still a stream), heard from its peer in the last [`HEARD_LATELY`]
//!   (1 ms): its next frame (a confirm, a reply, a lone publish) is not
//!   held back for a batch it is not part of. Coalescing therefore
//!   works on a thread whose busy connections all stream, and steps
//!   aside while any other one talks.
//!
//! A peer that sends about once per `coalesce / 2` to `coalesce` still
//! counts as streaming, and each of its messages waits for most of a wait
//! with little to batch: the price of a fixed wait, paid in latency (up
//! to `coalesce`), not in CPU.
//!
//! What a wait can still hold up, one `coalesce` at most each:
//! - a frame of a connection that was quiet for more than 1 ms and
//!   arrives during a wait: a confirm or reply the broker takes longer
//!   than 1 ms to send (a persistent message's confirm, an RPC reply);
//! - a confirm on a channel of a connection that itself streams (its
//!   session is a stream), or of one that streamed in the last 50 ms;
//! - the I/O of the metrics and admin endpoint (they share the session
//!   runtime);
//! - a message that arrives in many small reads (several reads of one
//!   message look like a stream).
//!
//! And what can keep a stream from batching: a busy session whose every
//! read answers a write (it never counts as a stream, so it counts as
//! talking), and heartbeats of many idle connections (each counts as
//! talking for 1 ms). The retry engine and the store writer have
//! threads of their own and never wait.
//!
//! Tuned for one session thread (the default): with more, sessions move
//! between threads, and a session that moved starts its streak again.
//!
//! Gaps are read from nackd's clock, handed in ([`Clock::now`] is the
//! monotonic clock in nackd): they measure the thread's sleeps, which a
//! hand-driven test clock ([`Clock::manual`]) would flatten to zero, so
//! the session threads are only ever given a running one.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use nackd_core::clock::Clock;
use prometheus_client::metrics::counter::Counter;

/// Short gaps in a row, each ended by a peer that sent unprompted, before
/// a session counts as streaming.
pub const STREAK: u32 = 4;

/// After a wait, a gap is short below `pause / AFTER_A_WAIT`.
pub const AFTER_A_WAIT: u32 = 4;

/// The longest wait `runtime.coalesce` accepts.
pub const MAX_PAUSE: Duration = Duration::from_millis(1);

/// Waits so far, every thread (`nackd_coalesce_pauses_total`).
pub static PAUSES: LazyLock<Counter> = LazyLock::new(Counter::default);

/// For this long after a session that does not stream heard from its
/// peer, its thread does not wait for another session's stream: that
/// session's next frame (a reply, a confirm, a lone publish) is not held
/// back for a batch it is not part of.
pub const HEARD_LATELY: Duration = Duration::from_millis(1);

/// A session that streamed this recently is a stream that paused (a long
/// gap, a wake-up with only answers in it), not one that talks: its reads
/// keep no other stream from waiting.
pub const STREAMED_LATELY: Duration = Duration::from_millis(50);

thread_local! {
    /// The wait a streaming session asked this thread for, at its next
    /// park: the pause, when it asked, and which session it is.
    static WANTED: Cell<Option<(Duration, Instant, u64)>> = const { Cell::new(None) };
    /// When sessions of this thread that do not stream last heard from
    /// their peers (see [`Heard`]).
    static HEARD: Cell<Heard> = const { Cell::new(Heard { last: None, other: None }) };
    /// The time this thread has spent waiting, in all.
    static WAITED: Cell<Duration> = const { Cell::new(Duration::ZERO) };
    /// This thread, as a number no other thread has.
    static THREAD: u64 = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
}

static NEXT_THREAD: AtomicU64 = AtomicU64::new(0);
static NEXT_SESSION: AtomicU64 = AtomicU64::new(0);

/// The latest read of a session that does not stream, and the latest of
/// any other session than that one: enough to tell whether a session
/// other than a given one was heard lately.
#[derive(Clone, Copy, Debug)]
struct Heard {
    last: Option<(Instant, u64)>,
    other: Option<Instant>,
}

impl Heard {
    fn note(self, at: Instant, session: u64) -> Self {
        let other = match self.last {
            Some((then, by)) if by != session => Some(then),
            _ => self.other,
        };
        Self {
            last: Some((at, session)),
            other,
        }
    }

    /// Whether a session other than `session` was heard within
    /// [`HEARD_LATELY`] before `now`.
    fn lately_other_than(self, session: u64, now: Instant) -> bool {
        let lately = |at: Instant| now.saturating_duration_since(at) < HEARD_LATELY;
        match self.last {
            Some((at, by)) if by != session => lately(at),
            _ => self.other.is_some_and(lately),
        }
    }
}

/// The two sides of a session, as indices.
pub const CLIENT: usize = 0;
/// See [`CLIENT`].
pub const UPSTREAM: usize = 1;

/// One session's wake-up pattern.
#[derive(Debug)]
pub struct Coalesce {
    pause: Duration,
    /// This session, among the thread's (see [`Heard`]).
    id: u64,
    /// When the session last went to sleep, the thread's [`WAITED`] then
    /// (a wait of the thread is not part of the session's gap) and which
    /// thread it was.
    asleep_at: (Instant, Duration, u64),
    /// Whether this wake-up came soon after the session went to sleep.
    short_gap: bool,
    /// Wake-ups in a row that were short gaps with an unprompted read.
    streak: u32,
    /// Per side: nackd wrote to it since it last sent.
    prompted: [bool; 2],
    /// A side sent without having been written to, in this wake-up.
    unprompted: bool,
    /// A side sent anything in this wake-up.
    heard: bool,
    /// When the session last slept as a stream.
    streamed_at: Option<Instant>,
}

impl Coalesce {
    /// A session that went to sleep at `now`; `pause` zero turns it off.
    pub fn new(pause: Duration, now: Instant) -> Self {
        Self {
            pause,
            id: NEXT_SESSION.fetch_add(1, Ordering::Relaxed),
            asleep_at: (now, waited(), thread_id()),
            short_gap: false,
            streak: 0,
            prompted: [false; 2],
            unprompted: false,
            heard: false,
            streamed_at: None,
        }
    }

    /// The session is woken at `now`.
    ///
    /// After a wait of its thread, the gap counts as short only if the
    /// peer's bytes were there (nearly) when the wait ended: a peer that
    /// sends once per `pause` to `2 × pause` would otherwise keep the
    /// thread waiting for one message at a time, a wake-up more per
    /// message instead of fewer. A session that moved to another thread
    /// (more than one worker) starts its streak again.
    pub fn on_wake(&mut self, now: Instant) {
        let (at, waited_then, thread) = self.asleep_at;
        let (waited_now, here) = (waited(), thread_id());
        let thread_waited = waited_now.saturating_sub(waited_then);
        let gap = now
            .saturating_duration_since(at)
            .saturating_sub(thread_waited);
        let limit = match thread_waited.is_zero() {
            true => self.pause,
            false => self.pause / AFTER_A_WAIT,
        };
        self.short_gap = thread == here && gap < limit;
        self.unprompted = false;
        self.heard = false;
    }

    /// `side` sent bytes.
    pub fn read(&mut self, side: usize) {
        self.heard = true;
        if !std::mem::take(&mut self.prompted[side]) {
            self.unprompted = true;
        }
    }

    /// nackd wrote bytes to `side`.
    pub fn wrote(&mut self, side: usize) {
        self.prompted[side] = true;
    }

    /// The session goes back to sleep at `now`; if it streams, the thread
    /// waits before its next park, unless another session that does not
    /// stream heard from its peer lately.
    pub fn on_sleep(&mut self, now: Instant) {
        self.streak = match self.short_gap && self.unprompted {
            true => self.streak.saturating_add(1),
            false => 0,
        };
        self.asleep_at = (now, waited(), thread_id());
        if !self.on() {
            return;
        }
        if self.streak >= STREAK {
            self.streamed_at = Some(now);
            WANTED.with(|wanted| wanted.set(Some((self.pause, now, self.id))));
        } else if self.heard && !self.streamed_lately(now) {
            HEARD.with(|heard| heard.set(heard.get().note(now, self.id)));
        }
    }

    fn streamed_lately(&self, now: Instant) -> bool {
        self.streamed_at
            .is_some_and(|at| now.saturating_duration_since(at) < STREAMED_LATELY)
    }

    /// Whether coalescing is on (a pause above zero): off, a session need
    /// not call [`on_wake`](Self::on_wake) and [`on_sleep`](Self::on_sleep).
    pub fn on(&self) -> bool {
        !self.pause.is_zero()
    }

    /// Whether the session streams now.
    pub fn streaming(&self) -> bool {
        self.streak >= STREAK
    }
}

fn waited() -> Duration {
    WAITED.with(Cell::get)
}

fn thread_id() -> u64 {
    THREAD.with(|id| *id)
}

/// The wait this thread owes a streaming session at a park at `now`,
/// taken (at most one per park); what [`on_park`] sleeps. None when:
/// - no session of the thread streams;
/// - the session asked more than its pause before `now` (the thread was
///   busy meanwhile: what it would wait for is already there);
/// - another session, one that does not stream, heard from its peer
///   within [`HEARD_LATELY`]: its next frame is not held for the stream.
pub fn take_wait(now: Instant) -> Option<Duration> {
    let (pause, asked, by) = WANTED.with(Cell::take)?;
    if now.saturating_duration_since(asked) > pause {
        return None;
    }
    if HEARD.with(Cell::get).lately_other_than(by, now) {
        return None;
    }
    Some(pause)
}

/// Counts `slept` as time the thread waited (not part of sessions' gaps).
pub fn waited_for(slept: Duration) {
    WAITED.with(|w| w.set(w.get() + slept));
}

/// For tokio's `on_thread_park` of the session threads: the thread has
/// nothing to do; if a session streams, wait before sleeping on the
/// sockets. `clock` is the sessions' (it times the wait too).
pub fn on_park(clock: &Clock) {
    let Some(pause) = take_wait(clock.now()) else {
        return;
    };
    // Tasks already queued for the runtime (woken from another thread, a
    // new connection) run first: the thread is not idle after all.
    let queued = tokio::runtime::Handle::try_current()
        .map(|h| h.metrics().global_queue_depth())
        .unwrap_or(0);
    if queued == 0 {
        let start = clock.now();
        std::thread::sleep(pause);
        waited_for(clock.now().saturating_duration_since(start));
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
#[allow(clippy::disallowed_methods)] // tests time with the real clock
mod tests;

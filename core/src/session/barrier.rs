//! The barrier of a session: client frames held back until the claims made
//! before them are answered and acked, and a close of nackd's own that
//! waits likewise; and the grace the broker gets to apply nackd's acks
//! before what was held back goes on (see [`super::ACK_GRACE`]).
//!
//! [`Barrier`] keeps the frames and the times; the session decides when
//! the claims are settled (`machine`) and writes what [`Barrier::lower`]
//! gives back.

use std::time::Instant;

use bytes::BytesMut;

use super::ACK_GRACE;

/// The barrier of one session (see the module).
#[derive(Default)]
pub(super) struct Barrier {
    /// Client frames wait behind the barrier.
    up: bool,
    /// The client frames waiting behind the barrier.
    behind: BytesMut,
    /// A close of nackd's own that waits for the claims (its reason).
    deferred_close: Option<&'static str>,
    /// When nackd last acked a held message upstream.
    acked_at: Option<Instant>,
    /// Held-back frames wait for the claims up to this number.
    upto: Option<u64>,
    /// When the last claim of the barrier was acked.
    upto_acked_at: Option<Instant>,
    /// When the frames held back may go on.
    release_at: Option<Instant>,
}

/// What lowering the barrier lets go.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Lowered {
    /// The client frames held back (`None`: the barrier was not up).
    pub(super) held: Option<BytesMut>,
    /// A close of nackd's own that waited, with its reason.
    pub(super) close: Option<&'static str>,
}

impl Barrier {
    /// Whether client frames wait behind the barrier.
    pub(super) fn is_up(&self) -> bool {
        self.up
    }

    /// Whether anything waits: frames behind the barrier, or a close.
    pub(super) fn waits(&self) -> bool {
        self.up || self.deferred_close.is_some()
    }

    /// Whether a close of nackd's own waits for the claims.
    pub(super) fn close_waits(&self) -> bool {
        self.deferred_close.is_some()
    }

    /// The claims the barrier waits for: those up to this number.
    pub(super) fn upto(&self) -> u64 {
        self.upto.unwrap_or(0)
    }

    /// How many bytes wait behind the barrier.
    pub(super) fn len(&self) -> usize {
        self.behind.len()
    }

    /// Client frames: kept behind the barrier when it is up (`true`),
    /// else left to the caller to send (`false`).
    pub(super) fn hold(&mut self, frames: &[u8]) -> bool {
        if self.up {
            self.behind.extend_from_slice(frames);
        }
        self.up
    }

    /// Puts `frames` into the frames behind the barrier at offset `at`.
    pub(super) fn insert(&mut self, at: usize, frames: &[u8]) {
        let tail = self.behind.split_off(at);
        self.behind.extend_from_slice(frames);
        self.behind.unsplit(tail);
    }

    /// Client frames wait from now until the claims up to `upto` are
    /// answered (and those made before: a channel that keeps nacking must
    /// not hold a close forever). `true` if the barrier was down.
    pub(super) fn raise(&mut self, upto: u64) -> bool {
        let was_down = !self.up;
        self.up = true;
        self.wait_for(upto);
        was_down
    }

    /// nackd's close of the broker connection (`why`) waits for the claims
    /// up to `upto`.
    pub(super) fn defer_close(&mut self, why: &'static str, upto: u64) {
        self.deferred_close = Some(why);
        self.wait_for(upto);
    }

    fn wait_for(&mut self, upto: u64) {
        self.upto = Some(self.upto.unwrap_or(0).max(upto));
        self.upto_acked_at = self.upto_acked_at.max(self.acked_at);
    }

    /// nackd acked a held message upstream at `now`: claim `seq` (`None`:
    /// acks of claims the barrier waits for, if it waits).
    pub(super) fn acked(&mut self, now: Instant, seq: Option<u64>) {
        self.acked_at = Some(now);
        let covered = match seq {
            Some(seq) => self.upto.is_some_and(|b| seq <= b),
            None => self.upto.is_some(),
        };
        if covered {
            self.upto_acked_at = Some(now);
        }
    }

    /// Whether nackd acked less than [`ACK_GRACE`] before `now`.
    pub(super) fn acked_recently(&self, now: Instant) -> bool {
        self.acked_at.is_some_and(|t| t + ACK_GRACE > now)
    }

    /// The claims are settled: the broker still needs until the returned
    /// time to apply the barrier's acks (the wake-up is kept), or `None`:
    /// what waits may go on now.
    pub(super) fn grace(&mut self, now: Instant) -> Option<Instant> {
        let at = self.upto_acked_at.map(|t| t + ACK_GRACE)?;
        if at <= now {
            return None;
        }
        self.release_at = Some(at);
        Some(at)
    }

    /// What waited goes on: the frames held back and the close.
    pub(super) fn lower(&mut self) -> Lowered {
        (self.upto, self.upto_acked_at) = (None, None);
        let held = std::mem::take(&mut self.up).then(|| std::mem::take(&mut self.behind));
        Lowered {
            held,
            close: self.deferred_close.take(),
        }
    }

    /// When the barrier wants a wake-up.
    pub(super) fn wake(&self) -> Option<Instant> {
        self.release_at
    }

    /// A wake-up at `now`: the one it asked for, if due, is spent.
    pub(super) fn on_timeout(&mut self, now: Instant) {
        if self.release_at.is_some_and(|at| at <= now) {
            self.release_at = None;
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests time with the real clock
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn frames_pass_until_raised_and_come_back_in_order_when_lowered() {
        let mut b = Barrier::default();
        assert!(!b.hold(b"a"), "down: the caller sends it");
        assert!(b.raise(3), "it was down");
        assert!(!b.raise(1), "raised once");
        assert_eq!(b.upto(), 3, "a later raise never lowers the mark");
        assert!(b.hold(b"b") && b.hold(b"d"));
        b.insert(1, b"c");
        assert_eq!(b.len(), 3);
        let lowered = b.lower();
        assert_eq!(lowered.held.as_deref(), Some(&b"bcd"[..]));
        assert_eq!(lowered.close, None);
        assert!(!b.is_up() && !b.waits());
        assert_eq!((b.upto(), b.len()), (0, 0));
        assert_eq!(b.lower(), Lowered::default(), "nothing waits");
    }

    #[test]
    fn a_deferred_close_waits_without_holding_frames() {
        let mut b = Barrier::default();
        b.defer_close("shutting down", 2);
        assert!(b.waits() && b.close_waits() && !b.is_up());
        assert!(!b.hold(b"x"), "frames are not held by a close");
        let lowered = b.lower();
        assert_eq!((lowered.held, lowered.close), (None, Some("shutting down")));
        assert!(!b.waits());
    }

    #[test]
    fn the_broker_gets_a_grace_after_the_barriers_acks() {
        let mut b = Barrier::default();
        let t0 = Instant::now();
        assert!(!b.acked_recently(t0));
        b.raise(2);
        b.acked(t0, Some(3));
        assert!(b.acked_recently(t0), "any ack counts as recent");
        assert_eq!(b.grace(t0), None, "claim 3 is not the barrier's");
        b.acked(t0, Some(2));
        assert_eq!(b.grace(t0), Some(t0 + ACK_GRACE));
        assert_eq!(b.wake(), Some(t0 + ACK_GRACE));
        b.on_timeout(t0 + Duration::from_millis(1));
        assert_eq!(b.wake(), Some(t0 + ACK_GRACE), "not due yet");
        b.on_timeout(t0 + ACK_GRACE);
        assert_eq!(b.wake(), None);
        assert_eq!(b.grace(t0 + ACK_GRACE), None, "the grace is over");
        assert!(!b.acked_recently(t0 + ACK_GRACE));
    }

    #[test]
    fn a_barrier_raised_after_an_ack_still_gives_it_its_grace() {
        let mut b = Barrier::default();
        let t0 = Instant::now();
        b.acked(t0, None);
        assert_eq!(b.grace(t0), None, "no barrier: nothing waits");
        b.raise(1);
        assert_eq!(
            b.grace(t0),
            Some(t0 + ACK_GRACE),
            "the ack came just before"
        );
        b.lower();
        assert_eq!(b.grace(t0), None, "lowered: forgotten");
    }
}

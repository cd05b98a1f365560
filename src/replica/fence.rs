//! Fencing: until when this process may still act for its id.
//!
//! The broker frees a register of the lease (an exclusive queue, see
//! [`super::lease`]) when it has not heard from the holder's connection for
//! about two heartbeats. The lease's keeper extends the fence each time a
//! majority of the registers answered a probe, to the time the probe was
//! *sent* plus one and a half heartbeats: by then no register of that
//! majority may have been freed yet, whatever happened since, and a
//! successor needs one of them. The
//! retry engine hands a message to a republisher, and a republisher writes
//! a publish to its socket, only while the fence holds. The fence is read
//! on the monotonic clock, which runs on while the process is stopped: a
//! holder frozen (SIGSTOP, a stalled VM) past its lease finds the fence
//! expired the moment it runs again, before its replica task could notice
//! anything.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nackd_core::clock::Clock;
use tokio::sync::Notify;

/// `until_us` of a fence that always holds (no replica).
const ALWAYS: u64 = u64::MAX;

/// Until when this process may act for its id.
#[derive(Debug)]
pub struct Fence {
    clock: Clock,
    origin: Instant,
    /// µs after `origin` until which the fence holds; 0: it does not.
    until_us: AtomicU64,
    /// How many times it was revoked: an extension decided before a
    /// revocation ([`Fence::extend_unless_revoked`]) must not undo it.
    revoked: std::sync::Mutex<u64>,
    extended: Notify,
}

impl Fence {
    /// A fence that always holds: nackd without a replica.
    pub fn always() -> Arc<Self> {
        Arc::new(Self::with(Clock::start(), ALWAYS))
    }

    /// A fence that holds once extended: the replica's.
    pub fn closed(clock: Clock) -> Arc<Self> {
        Arc::new(Self::with(clock, 0))
    }

    fn with(clock: Clock, until_us: u64) -> Self {
        Self {
            origin: clock.now(),
            clock,
            until_us: AtomicU64::new(until_us),
            revoked: std::sync::Mutex::new(0),
            extended: Notify::new(),
        }
    }

    /// The broker confirmed the lease to a probe sent at `asked`: the
    /// fence holds until `asked + 1.5 × heartbeat`.
    pub fn extend(&self, asked: Instant, heartbeat: Duration) {
        let until = asked + heartbeat + heartbeat / 2;
        let us = until.saturating_duration_since(self.origin).as_micros() as u64;
        self.until_us.store(us.max(1), Ordering::Release);
        self.extended.notify_waiters();
    }

    /// The lease is lost (or not agreed on): nothing more goes out.
    pub fn revoke(&self) {
        let mut revoked = self.revoked.lock().expect("never poisoned");
        *revoked += 1;
        self.until_us.store(0, Ordering::Release);
    }

    /// How many times the fence was revoked so far: read it before
    /// deciding to extend, and pass it to [`Fence::extend_unless_revoked`].
    pub fn revocations(&self) -> u64 {
        *self.revoked.lock().expect("never poisoned")
    }

    /// [`Fence::extend`], unless the fence was revoked since `seen` was
    /// read: the lease's keeper decides to extend on what it saw, and a
    /// revocation in between wins.
    pub fn extend_unless_revoked(&self, seen: u64, asked: Instant, heartbeat: Duration) -> bool {
        let revoked = self.revoked.lock().expect("never poisoned");
        if *revoked != seen {
            return false;
        }
        self.extend(asked, heartbeat);
        drop(revoked);
        true
    }

    /// Whether this process may act for its id now.
    pub fn holds(&self) -> bool {
        self.holds_at(self.clock.now())
    }

    /// Whether it may act at `at`.
    pub fn holds_at(&self, at: Instant) -> bool {
        match self.until_us.load(Ordering::Acquire) {
            ALWAYS => true,
            0 => false,
            us => at < self.origin + Duration::from_micros(us),
        }
    }

    /// Resolves at the next extension (register it before checking
    /// [`Fence::holds`] to miss none).
    pub async fn extended(&self) {
        self.extended.notified().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_replica_the_fence_always_holds() {
        let f = Fence::always();
        assert!(f.holds_at(f.origin + Duration::from_secs(86_400 * 365)));
    }

    #[test]
    fn a_replica_fence_holds_only_once_extended_and_until_one_and_a_half_heartbeats_after_the_probe(
    ) {
        let clock = Clock::manual(0);
        let f = Fence::closed(clock.clone());
        assert!(!f.holds());
        let asked = clock.now();
        f.extend(asked, Duration::from_secs(2));
        assert!(f.holds());
        clock.advance(Duration::from_millis(2_999));
        assert!(f.holds());
        clock.advance(Duration::from_millis(1));
        assert!(!f.holds());
    }

    #[test]
    fn a_process_frozen_past_its_fence_does_not_hold_it_when_it_runs_again() {
        // What a SIGSTOP looks like to the process: the clock jumped
        // between two reads.
        let clock = Clock::manual(0);
        let f = Fence::closed(clock.clone());
        f.extend(clock.now(), Duration::from_secs(1));
        clock.advance(Duration::from_millis(10));
        assert!(f.holds());
        clock.advance(Duration::from_secs(40));
        assert!(!f.holds());
    }

    #[test]
    fn an_extension_decided_before_a_revocation_does_not_undo_it() {
        let clock = Clock::manual(0);
        let f = Fence::closed(clock.clone());
        f.extend(clock.now(), Duration::from_secs(60));
        // The keeper saw the state active and read the count...
        let seen = f.revocations();
        // ... then the replica task revoked (the state changed) ...
        f.revoke();
        // ... and the keeper's extension comes too late.
        assert!(!f.extend_unless_revoked(seen, clock.now(), Duration::from_secs(60)));
        assert!(!f.holds());
        let seen = f.revocations();
        assert!(f.extend_unless_revoked(seen, clock.now(), Duration::from_secs(60)));
        assert!(f.holds());
    }

    #[test]
    fn a_revoked_fence_holds_no_more_until_extended_again() {
        let clock = Clock::manual(0);
        let f = Fence::closed(clock.clone());
        f.extend(clock.now(), Duration::from_secs(60));
        f.revoke();
        assert!(!f.holds());
        f.extend(clock.now(), Duration::from_secs(60));
        assert!(f.holds());
    }
}

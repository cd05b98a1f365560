//! The claims of a session: one numbering for the nacks nackd claims and
//! the delayed publishes it takes (a barrier waits for the claims up to a
//! number, whatever they are), and the ones the store has not answered.
//!
//! Also here: what claiming one nack came to ([`Claim`]) and where a
//! claimed message goes by its policy and retry number ([`Plan`]).
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::SETTLE_TIMEOUT;
use crate::held::{Route, Ticket};
use crate::policy::{OnExhausted, Policy, Step};
use crate::stats::PassReason;

/// The claims of one session (see the module).
#[derive(Default)]
pub(super) struct Claims {
    /// Claims made (the number of the last one).
    last: u64,
    /// The claims the store has not answered yet: number → when made,
    /// and the ticket that gives its park up.
    unanswered: BTreeMap<u64, (Instant, Ticket)>,
}

impl Claims {
    /// The number of the last claim made (0: none yet).
    pub(super) fn last(&self) -> u64 {
        self.last
    }

    /// The number the next claim gets.
    pub(super) fn next(&self) -> u64 {
        self.last + 1
    }

    /// Claim number [`Claims::next`] is made at `now`; `ticket` gives
    /// its park up.
    pub(super) fn made(&mut self, now: Instant, ticket: Ticket) -> u64 {
        self.last += 1;
        self.unanswered.insert(self.last, (now, ticket));
        self.last
    }

    /// Claim `seq` is answered (or no longer waited for).
    pub(super) fn answered(&mut self, seq: u64) {
        self.unanswered.remove(&seq);
    }

    /// Whether any claim waits for the store.
    pub(super) fn any_unanswered(&self) -> bool {
        !self.unanswered.is_empty()
    }

    /// Whether a claim up to `upto` waits for the store, leaving out those
    /// `skip` names.
    pub(super) fn waits_upto(&self, upto: u64, skip: impl Fn(u64) -> bool) -> bool {
        self.unanswered.range(..=upto).any(|(seq, _)| !skip(*seq))
    }

    /// The claims up to `upto` unanswered for [`SETTLE_TIMEOUT`] at `now`,
    /// leaving out those `skip` names. Claims are numbered in the order
    /// they were made: the scan stops at the first young one.
    pub(super) fn overdue(
        &self,
        upto: u64,
        now: Instant,
        skip: impl Fn(u64) -> bool,
    ) -> BTreeSet<u64> {
        self.unanswered
            .range(..=upto)
            .take_while(|(_, (at, _))| now.duration_since(*at) >= SETTLE_TIMEOUT)
            .filter(|(seq, _)| !skip(**seq))
            .map(|(seq, _)| *seq)
            .collect()
    }

    /// Gives claim `seq` up: `true` when its ticket says the engine had
    /// not stored it yet (it is then no longer waited for); `false` when
    /// it was stored meanwhile (its answer is on its way) or is not waited for.
    pub(super) fn give_up(&mut self, seq: u64) -> bool {
        let given_up = self.unanswered.get(&seq).is_some_and(|(_, t)| t.give_up());
        if given_up {
            self.unanswered.remove(&seq);
        }
        given_up
    }
}

/// What claiming one delivery came to.
pub(super) enum Claim {
    /// Sent to the store; its ack waits for the answer. With how long a
    /// deferral waits if the store refuses it ([`Plan::deferral`]).
    Parked(Option<Duration>),
    /// Schedule exhausted with `on_exhausted = "reject"` (after this many retries).
    Reject(u32),
    /// Not intercepted after all: forward the client's settle.
    Pass(PassReason),
    /// nackd would hold it but cannot now: it stays unacked and is nacked
    /// upstream later (after the policy's delay, when known).
    Defer(PassReason, Option<Duration>),
}

/// Where a claimed message goes, by its policy and retry number.
pub(super) struct Plan {
    /// How long it is held.
    pub(super) delay: Duration,
    /// Where it goes when due.
    pub(super) route: Route,
    /// Where it goes if returned as unroutable (`on_exhausted`).
    pub(super) dead_letter: Option<Route>,
    /// The retry count its headers carry.
    pub(super) count: u32,
    /// Why it goes to the dead-letter exchange, when it does.
    pub(super) exhausted: Option<&'static str>,
}

impl Plan {
    /// How long a deferral of this retry waits: the policy's delay for it,
    /// unknown (the fallback) once the schedule is exhausted, as the plan's
    /// zero delay would make a requeue loop at the floor.
    pub(super) fn deferral(&self) -> Option<Duration> {
        self.exhausted.is_none().then_some(self.delay)
    }

    /// The plan for retry number `retry` of a message from `queue`; `None`
    /// when the schedule is exhausted and the policy rejects.
    pub(super) fn of(policy: &Policy, queue: &str, retry: u32) -> Option<Self> {
        let dead_letter = match &policy.on_exhausted {
            OnExhausted::Reject => None,
            OnExhausted::DeadLetter {
                exchange,
                routing_key,
            } => Some(Route::Exchange {
                exchange: exchange.clone(),
                routing_key: routing_key.clone().unwrap_or_else(|| queue.to_string()),
            }),
        };
        let (delay, route, count, exhausted) = match (policy.step(retry), &dead_letter) {
            (Step::Delay(delay), _) => (delay, Route::Queue, retry, None),
            (Step::Exhausted, None) => return None,
            (Step::Exhausted, Some(route)) => (
                Duration::ZERO,
                route.clone(),
                retry - 1,
                Some("retry schedule exhausted"),
            ),
        };
        Some(Self {
            delay,
            route,
            dead_letter,
            count,
            exhausted,
        })
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests time with the real clock
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn claims_are_numbered_once_for_nacks_and_publishes() {
        let mut c = Claims::default();
        let now = Instant::now();
        assert_eq!((c.last(), c.next()), (0, 1));
        assert_eq!(c.made(now, Ticket::default()), 1);
        assert_eq!(c.made(now, Ticket::default()), 2);
        assert_eq!((c.last(), c.next()), (2, 3));
        assert!(c.any_unanswered());
        c.answered(1);
        assert!(!c.waits_upto(1, |_| false), "claim 1 is answered");
        assert!(c.waits_upto(2, |_| false));
        assert!(
            !c.waits_upto(2, |s| s == 2),
            "a skipped claim does not wait"
        );
        c.answered(2);
        assert!(!c.any_unanswered());
        assert_eq!(c.last(), 2, "answering does not renumber");
    }

    #[test]
    fn overdue_claims_are_the_old_ones_up_to_the_barrier() {
        let mut c = Claims::default();
        let t0 = Instant::now();
        c.made(t0, Ticket::default());
        c.made(t0 + Duration::from_secs(1), Ticket::default());
        c.made(t0, Ticket::default());
        let at = t0 + SETTLE_TIMEOUT;
        assert_eq!(
            c.overdue(3, at, |_| false),
            BTreeSet::from([1]),
            "stops at the young one"
        );
        let later = t0 + SETTLE_TIMEOUT + Duration::from_secs(1);
        assert_eq!(c.overdue(3, later, |_| false), BTreeSet::from([1, 2, 3]));
        assert_eq!(c.overdue(2, later, |_| false), BTreeSet::from([1, 2]));
        assert_eq!(c.overdue(3, later, |s| s == 2), BTreeSet::from([1, 3]));
    }

    #[test]
    fn a_claim_stored_meanwhile_is_not_given_up() {
        let mut c = Claims::default();
        let now = Instant::now();
        let stored = Ticket::default();
        c.made(now, Ticket::default());
        c.made(now, stored.clone());
        assert!(stored.stored(), "the engine stored claim 2 first");
        assert!(c.give_up(1));
        assert!(!c.give_up(2), "its answer is on its way");
        assert!(c.waits_upto(2, |_| false), "and still awaited");
        assert!(!c.give_up(1), "given up once");
    }
}

//! What the broker said about a republish, and what is set aside.
//!
//! - Confirmed: completed. Its exchange (and its queue) work.
//! - Nacked, or refused for this message alone: set aside with a backoff of
//!   its own (100 ms doubling to 30 s), counted by reason and logged once
//!   per backoff step.
//! - Refused for the whole exchange (missing, access refused): the exchange
//!   is blocked and probed by one message at a time (`blocks`); its other
//!   messages wait without being read or sent.
//! - Returned from its queue: the queue is gone. With an `on_exhausted`
//!   exchange it goes there; else the queue is blocked, probed every
//!   `republish.queue_gone.probe_interval`, and after
//!   `republish.queue_gone.after` its messages are kept, dropped or
//!   dead-lettered as configured.
//! - A delayed message (`Route::Delayed`) returned at its due time: nothing
//!   is bound to its exchange for its routing key. `delayed.unroutable`
//!   keeps it (set aside, tried again), drops it or sends it to
//!   `delayed.alternate_exchange`; each return is counted per exchange and
//!   action. A missing exchange keeps it, like any exchange route.
//!
//! [`Outcomes`] owns the blocked destinations (exchanges, gone queues). It
//! takes an event (a report, a due message to admit, a lost republisher)
//! and answers with the [`Action`] the engine is to take; it writes the
//! ledger only through the ledger's own methods (reasons, attempts).

use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};

use super::fire::Dest;
use super::query::ExchangeStatus;
use crate::config::{Delayed, GoneAction, QueueGone, Unroutable};
use crate::metrics::{BlockReason, Event, EventKind, Metrics, QueueLabels};
use crate::retry::blocks::{Backoff, Blocks, Refusal};
use crate::retry::ledger::{Entry, Ledger, Reason};
use crate::retry::republish::{Outcome, SetAside};
use crate::retry::Clock;
use crate::store::{Held, Reader, Route};

/// Backoff of a message set aside for a reason of its own.
const ASIDE_FIRST: Duration = Duration::from_millis(100);
const ASIDE_MAX: Duration = Duration::from_secs(30);

/// Waits between two probes of an exchange that refuses publishes.
const LANE_BACKOFF: Backoff = Backoff {
    first_ms: 1000,
    max_ms: 30_000,
};

fn aside_backoff(attempt: u16) -> Duration {
    (ASIDE_FIRST * (1u32 << attempt.min(12))).min(ASIDE_MAX)
}

/// What the engine does with a held message once an outcome is known.
#[allow(clippy::large_enum_variant)] // made once per outcome and applied at once
#[derive(Debug)]
pub(super) enum Action {
    /// Set aside (or held back) until `at` (ms), for the ledger reason
    /// `reason` (0: the reason it has stays).
    Hold { id: u64, at: u64, reason: u16 },
    /// It leaves the ledger and the store (completed, or dropped by a rule).
    Complete(u64),
    /// It goes to `route` instead, once the store has the new record.
    Reroute { id: u64, held: Held, route: Route },
}

/// Whether a due message goes, before it is read.
#[derive(Debug, PartialEq)]
pub(super) enum Admit {
    /// Nothing known blocks it.
    Go,
    /// Its destination is known to refuse it: set it aside.
    Hold { at: u64, reason: u16 },
    /// Its queue has been gone for `queue_gone.after`: read it, and
    /// [`Outcomes::gone_action`] says where it goes.
    GoneRule,
}

/// The destinations known to refuse publishes, and the rules for them.
pub(super) struct Outcomes {
    /// Exchanges (of a vhost) that refuse every publish.
    lanes: Blocks<(u32, Arc<str>)>,
    /// Queues that are gone.
    gone: Blocks<u32>,
    queue_gone: QueueGone,
    delayed: Delayed,
    default_exchange: Arc<str>,
    metrics: Arc<Metrics>,
    clock: Clock,
}

impl Outcomes {
    /// Nothing blocked yet; gone queues follow `queue_gone`, unroutable
    /// delayed messages `delayed`.
    pub(super) fn new(
        queue_gone: QueueGone,
        delayed: Delayed,
        metrics: Arc<Metrics>,
        clock: Clock,
    ) -> Self {
        let probe_ms = queue_gone.probe_interval.as_millis() as u64;
        Self {
            lanes: Blocks::new(LANE_BACKOFF),
            gone: Blocks::new(Backoff {
                first_ms: probe_ms,
                max_ms: probe_ms,
            }),
            queue_gone,
            delayed,
            default_exchange: Arc::from(""),
            metrics,
            clock,
        }
    }

    /// A republisher reported `outcome` for `id`, handed to `dest`.
    pub(super) fn on_report(
        &mut self,
        ledger: &mut Ledger,
        reader: &Reader,
        id: u64,
        dest: &Dest,
        outcome: Outcome,
    ) -> Option<Action> {
        if ledger.get(id).is_none() {
            // Purged or cancelled meanwhile: whatever it probed, it will not
            // say, so another message may.
            self.forget_probes(id, dest, true);
        }
        match outcome {
            Outcome::Confirmed => {
                self.destination_works(ledger, dest, true);
                Some(self.on_confirmed(ledger, id))
            }
            Outcome::Nacked => {
                self.metrics.nacked.inc();
                self.destination_works(ledger, dest, true);
                let why = "the broker nacked the republish (an error on its side)";
                self.set_aside(ledger, id, BlockReason::Nacked, why.into())
            }
            Outcome::Returned { reply } => {
                self.metrics.returned.inc();
                self.destination_works(ledger, dest, false);
                self.on_returned(ledger, reader, id, dest, reply)
            }
            Outcome::SetAside(aside) if aside.exchange_wide => {
                self.refused(ledger, id, dest, aside)
            }
            Outcome::SetAside(aside) => {
                // Refused for itself: says nothing about its destination.
                self.forget_probes(id, dest, dest.queue_route);
                self.set_aside(ledger, id, aside.reason, aside.reply)
            }
        }
    }

    /// `id`, handed to `dest`, was lost with its republisher task: it goes
    /// again after a backoff; whatever it probed, another message may.
    pub(super) fn lost(&mut self, ledger: &mut Ledger, id: u64, dest: &Dest) -> Option<Action> {
        self.forget_probes(id, dest, true);
        let why = "the republisher task ended unexpectedly".to_string();
        self.set_aside(ledger, id, BlockReason::ChannelError, why)
    }

    /// `id` no longer probes its exchange (nor its queue, with `queue`).
    fn forget_probes(&mut self, id: u64, dest: &Dest, queue: bool) {
        self.lanes
            .forget_probe(&(dest.vhost, dest.exchange.clone()), id);
        if queue {
            self.gone.forget_probe(&dest.queue, id);
        }
    }

    /// A publish to `dest`'s exchange went through (and reached its queue,
    /// if `reached`): lifts what blocked them.
    fn destination_works(&mut self, ledger: &Ledger, dest: &Dest, reached: bool) {
        let key = (dest.vhost, dest.exchange.clone());
        if let Some(block) = self.lanes.accepted(&key) {
            let (vhost, exchange) = (&ledger.vhosts()[dest.vhost as usize], &dest.exchange);
            let reply = reason_text(ledger, block.reason);
            info!(%vhost, %exchange, was = %reply, blocked_for = ?Duration::from_millis(self.clock.now_ms().saturating_sub(block.since_ms)), "exchange accepts publishes again");
        }
        if reached && dest.queue_route && self.gone.accepted(&dest.queue).is_some() {
            let (vhost, queue) = ledger.name(dest.queue);
            info!(%vhost, %queue, "queue is back: its held messages go again");
            let labels = queue_labels(vhost, queue);
            self.metrics.queue_gone.remove(&labels);
        }
    }

    fn on_confirmed(&mut self, ledger: &Ledger, id: u64) -> Action {
        self.metrics.confirmed.inc();
        if let Some(entry) = ledger.get(id).copied().filter(|e| e.meta.delayed) {
            let (vhost, exchange) = ledger.name(entry.meta.queue);
            self.metrics.delayed.routed(vhost, exchange);
        } else if let Some(entry) = ledger.get(id).copied() {
            let kind = match entry.meta.dead_letter {
                true => {
                    self.metrics.exhausted_dead_letter.inc();
                    EventKind::ExhaustedDeadLetter
                }
                false => EventKind::Retried,
            };
            let (vhost, queue) = ledger.name(entry.meta.queue);
            let (vhost, queue) = (vhost.to_string(), queue.to_string());
            self.metrics.session.recent.push(Event {
                at_ms: self.clock.now_ms(),
                kind,
                vhost,
                queue,
                retry: entry.meta.retry.into(),
            });
        }
        Action::Complete(id)
    }

    fn on_returned(
        &mut self,
        ledger: &mut Ledger,
        reader: &Reader,
        id: u64,
        dest: &Dest,
        reply: String,
    ) -> Option<Action> {
        let entry = ledger.get(id).copied()?;
        if entry.meta.delayed {
            return self.delayed_unroutable(ledger, reader, id, &entry, reply);
        }
        if !dest.queue_route {
            let why = format!(
                "{reply}: nothing is bound to exchange {:?} for its routing key",
                &*dest.exchange
            );
            return self.set_aside(ledger, id, BlockReason::NoRoute, why);
        }
        let held = match reader.read(entry.loc) {
            Ok(held) => held,
            Err(e) => {
                let why = format!("returned; cannot read it back ({e})");
                return self.set_aside(ledger, id, BlockReason::Store, why);
            }
        };
        if let Some(dead_letter) = held.on_return.clone() {
            warn!(id, queue = %held.queue, "queue is gone: sending to the dead-letter exchange");
            self.metrics.rerouted.inc();
            return Some(Action::Reroute {
                id,
                held,
                route: dead_letter,
            });
        }
        self.queue_gone_returned(ledger, id, &entry, held, &reply)
    }

    /// Delayed message `id` was returned at its due time: nothing is bound
    /// to its exchange for its routing key. `delayed.unroutable` says what
    /// becomes of it; whatever it is, it is counted and logged.
    fn delayed_unroutable(
        &mut self,
        ledger: &mut Ledger,
        reader: &Reader,
        id: u64,
        entry: &Entry,
        reply: String,
    ) -> Option<Action> {
        let rule = self.delayed.clone();
        let (vhost, exchange) = ledger.name(entry.meta.queue);
        let (vhost, exchange) = (vhost.clone(), exchange.clone());
        self.metrics
            .delayed
            .unroutable(&vhost, &exchange, rule.unroutable.label());
        let alternate = match (rule.unroutable, rule.alternate_exchange) {
            (Unroutable::Keep, _) | (Unroutable::Alternate, None) => {
                let why = format!(
                    "{reply}: nothing is bound to delayed exchange {:?} for its routing key (delayed.unroutable = \"keep\")",
                    &*exchange
                );
                return self.set_aside(ledger, id, BlockReason::NoRoute, why);
            }
            (Unroutable::Drop, _) => None,
            (Unroutable::Alternate, Some(alternate)) => Some(alternate),
        };
        let held = match reader.read(entry.loc) {
            Ok(held) => held,
            Err(e) => {
                let why = format!("delayed message returned; cannot read it back ({e})");
                return self.set_aside(ledger, id, BlockReason::Store, why);
            }
        };
        let routing_key = match &held.route {
            Route::Delayed { routing_key, .. } => routing_key.clone(),
            _ => String::new(),
        };
        let Some(alternate) = alternate else {
            warn!(id, %vhost, %exchange, %routing_key, %reply, "delayed message unroutable at its due time: dropped (delayed.unroutable = \"drop\")");
            return Some(Action::Complete(id));
        };
        warn!(id, %vhost, %exchange, %routing_key, %alternate, %reply, "delayed message unroutable at its due time: sent to the alternate exchange (delayed.unroutable = \"alternate\")");
        self.metrics.rerouted.inc();
        let route = Route::Exchange {
            exchange: alternate,
            routing_key,
        };
        Some(Action::Reroute { id, held, route })
    }

    /// `id` was returned from its queue and has nowhere else to go.
    fn queue_gone_returned(
        &mut self,
        ledger: &mut Ledger,
        id: u64,
        entry: &Entry,
        held: Held,
        reply: &str,
    ) -> Option<Action> {
        let now = self.clock.now_ms();
        let q = entry.meta.queue;
        let (vhost, queue) = ledger.name(q);
        let (vhost, queue) = (vhost.clone(), queue.clone());
        let reason = ledger.intern_reason(Reason {
            kind: BlockReason::QueueGone,
            reply: format!("{reply}: queue {:?} is gone", &*queue),
            exchange: None,
        });
        self.metrics.blocked(BlockReason::QueueGone);
        let (at, change) = self.gone.refused(q, id, reason, now);
        let rule = &self.queue_gone;
        match change {
            Refusal::New => {
                warn!(
                    %vhost, %queue, held = ledger.count(q), action = ?rule.action,
                    after = ?rule.after, probe_interval = ?rule.probe_interval,
                    "queue is gone (its retries are returned as unroutable): its held messages wait for it; see republish.queue_gone"
                );
                self.metrics
                    .queue_gone
                    .get_or_create(&queue_labels(&vhost, &queue))
                    .set(1);
            }
            Refusal::Extended => debug!(%vhost, %queue, "queue still gone"),
            Refusal::Known => {}
        }
        if self.gone_action_due(q, now) {
            return Some(self.gone_action(id, held));
        }
        ledger.count_attempt(id);
        Some(Action::Hold { id, at, reason })
    }

    /// Whether `republish.queue_gone.action` applies to queue `q` now.
    fn gone_action_due(&self, q: u32, now: u64) -> bool {
        let rule = &self.queue_gone;
        let after = rule.after.as_millis() as u64;
        rule.action != GoneAction::Keep
            && self
                .gone
                .get(&q)
                .is_some_and(|b| now.saturating_sub(b.since_ms) >= after)
    }

    /// At firing, before `id` (`entry`, of vhost `v`) is read: whether its
    /// destination is known to refuse it. One message probes a blocked
    /// destination at a time; a gone queue's messages may meet
    /// `republish.queue_gone`.
    pub(super) fn admit(
        &mut self,
        ledger: &Ledger,
        v: u32,
        id: u64,
        entry: &Entry,
        now: u64,
    ) -> Admit {
        if !entry.meta.dead_letter {
            let gone = self.admit_gone(id, entry, now);
            if gone != Admit::Go {
                return gone;
            }
            let key = (v, self.default_exchange.clone());
            return self.admit_lane(ledger, &key, id, now);
        }
        // A delayed message's exchange is its "queue"; a dead-letter
        // route's is in the store, and a message set aside for its
        // exchange names it in its reason.
        let exchange = match entry.meta.delayed {
            true => Some(ledger.name(entry.meta.queue).1.clone()),
            false => ledger
                .reason(entry.blocked())
                .and_then(|r| r.exchange.clone()),
        };
        match exchange {
            Some(exchange) => self.admit_lane(ledger, &(v, exchange), id, now),
            None => Admit::Go,
        }
    }

    /// Once read: whether `route`'s exchange (of vhost `v`) is known to
    /// refuse `id`.
    pub(super) fn admit_route(
        &mut self,
        ledger: &Ledger,
        v: u32,
        id: u64,
        route: &Route,
        now: u64,
    ) -> Admit {
        match route {
            Route::Exchange { exchange, .. } | Route::Delayed { exchange, .. } => {
                self.admit_lane(ledger, &(v, Arc::from(exchange.as_str())), id, now)
            }
            Route::Queue => Admit::Go,
        }
    }

    fn admit_lane(&mut self, ledger: &Ledger, key: &(u32, Arc<str>), id: u64, now: u64) -> Admit {
        let Some(at) = self.lanes.admit(key, id, now) else {
            return Admit::Go;
        };
        let reason = self.lanes.get(key).map_or(0, |b| b.reason);
        if let Some(r) = ledger.reason(reason) {
            self.metrics.blocked(r.kind);
        }
        Admit::Hold { at, reason }
    }

    /// Whether `id`'s queue is gone: held back until the next probe, or
    /// its rule applies.
    fn admit_gone(&mut self, id: u64, entry: &Entry, now: u64) -> Admit {
        let q = entry.meta.queue;
        let Some(block) = self.gone.get(&q).copied() else {
            return Admit::Go;
        };
        if self.gone_action_due(q, now) {
            return Admit::GoneRule;
        }
        match self.gone.admit(&q, id, now) {
            None => Admit::Go,
            Some(at) => {
                self.metrics.blocked(BlockReason::QueueGone);
                Admit::Hold {
                    at,
                    reason: block.reason,
                }
            }
        }
    }

    /// The queue of `held` has been gone for `queue_gone.after`: where it
    /// goes (its dead-letter route, the rule's exchange) or that it is dropped.
    pub(super) fn gone_action(&mut self, id: u64, held: Held) -> Action {
        if let Some(dead_letter) = held.on_return.clone() {
            self.metrics.rerouted.inc();
            return Action::Reroute {
                id,
                held,
                route: dead_letter,
            };
        }
        let rule = self.queue_gone.clone();
        match (rule.action, rule.exchange) {
            (GoneAction::DeadLetter, Some(exchange)) => {
                let routing_key = rule.routing_key.unwrap_or_else(|| held.queue.to_string());
                info!(id, vhost = %held.vhost, queue = %held.queue, %exchange, "queue gone longer than republish.queue_gone.after: sending its message to the dead-letter exchange");
                self.metrics.gone_dead_lettered.inc();
                let route = Route::Exchange {
                    exchange,
                    routing_key,
                };
                Action::Reroute { id, held, route }
            }
            _ => {
                warn!(id, vhost = %held.vhost, queue = %held.queue, retry = held.retry, "queue gone longer than republish.queue_gone.after: dropping its held message (action = \"drop\")");
                self.metrics.gone_dropped.inc();
                Action::Complete(id)
            }
        }
    }

    /// Queue `q` holds nothing any more: it is not watched as gone.
    pub(super) fn queue_emptied(&mut self, ledger: &Ledger, q: u32) {
        if self.gone.remove(&q).is_some() {
            let (vhost, queue) = ledger.name(q);
            let labels = queue_labels(vhost, queue);
            self.metrics.queue_gone.remove(&labels);
        }
    }

    /// A publish of `id` was refused for its whole exchange.
    fn refused(
        &mut self,
        ledger: &mut Ledger,
        id: u64,
        dest: &Dest,
        aside: SetAside,
    ) -> Option<Action> {
        let now = self.clock.now_ms();
        self.metrics.blocked(aside.reason);
        let reason = ledger.intern_reason(Reason {
            kind: aside.reason,
            reply: aside.reply.clone(),
            exchange: Some(dest.exchange.clone()),
        });
        let (at, change) = self
            .lanes
            .refused((dest.vhost, dest.exchange.clone()), id, reason, now);
        let vhost = &ledger.vhosts()[dest.vhost as usize];
        let retry_in = Duration::from_millis(at.saturating_sub(now));
        match change {
            Refusal::New => warn!(
                %vhost, exchange = %dest.exchange, reply = %aside.reply, ?retry_in,
                "exchange refuses publishes: its messages are set aside (kept) and one tries again after a backoff; other exchanges and queues carry on"
            ),
            Refusal::Extended => warn!(
                %vhost, exchange = %dest.exchange, reply = %aside.reply, ?retry_in,
                "exchange still refuses publishes"
            ),
            Refusal::Known => {}
        }
        debug!(id, reply = %aside.reply, "set aside with its exchange");
        ledger.count_attempt(id);
        Some(Action::Hold { id, at, reason })
    }

    /// Sets `id` aside for a reason of its own: it is tried again after a
    /// backoff of its own, logged once per backoff step. `None` if it is
    /// not held (purged meanwhile).
    pub(super) fn set_aside(
        &mut self,
        ledger: &mut Ledger,
        id: u64,
        kind: BlockReason,
        reply: String,
    ) -> Option<Action> {
        self.metrics.blocked(kind);
        let reason = ledger.intern_reason(Reason {
            kind,
            reply,
            exchange: None,
        });
        let attempt = ledger.count_attempt(id)?;
        let backoff = aside_backoff(attempt);
        let queue = ledger.get(id).map(|e| e.meta.queue).unwrap_or(0);
        let (vhost, queue) = ledger.name(queue);
        let reply = reason_text(ledger, reason);
        if backoff < ASIDE_MAX || aside_backoff(attempt - 1) < ASIDE_MAX {
            warn!(id, %vhost, %queue, attempt, retry_in = ?backoff, blocked = %reply, "republish set aside; keeping the message");
        } else {
            debug!(id, %vhost, %queue, attempt, retry_in = ?backoff, blocked = %reply, "republish set aside again");
        }
        let at = self.clock.now_ms() + backoff.as_millis() as u64;
        Some(Action::Hold { id, at, reason })
    }

    /// Since when queue `q` is gone (ms since the Unix epoch), if it is.
    pub(super) fn gone_since(&self, q: u32) -> Option<u64> {
        self.gone.get(&q).map(|b| b.since_ms)
    }

    /// The exchanges a whole lane waits on (missing, refused).
    pub(super) fn blocked_exchanges(&self, ledger: &Ledger) -> Vec<ExchangeStatus> {
        self.lanes
            .iter()
            .map(|((v, exchange), b)| ExchangeStatus {
                vhost: ledger.vhosts()[*v as usize].to_string(),
                exchange: exchange.to_string(),
                reply: reason_text(ledger, b.reason),
                since_ms: b.since_ms,
                next_try_ms: b.until_ms,
            })
            .collect()
    }
}

/// The reply of a ledger reason, for logs.
fn reason_text(ledger: &Ledger, reason: u16) -> String {
    ledger
        .reason(reason)
        .map_or_else(String::new, |r| r.reply.clone())
}

fn queue_labels(vhost: &str, queue: &str) -> QueueLabels {
    QueueLabels {
        vhost: vhost.to_string(),
        queue: queue.to_string(),
    }
}

#[cfg(test)]
mod tests;

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

use std::time::Duration;

use tracing::{debug, info, warn};

use super::{Engine, Handed, PutCtx};
use crate::config::{GoneAction, Unroutable};
use crate::metrics::{BlockReason, Event, EventKind, QueueLabels};
use crate::retry::blocks::Refusal;
use crate::retry::ledger::{Entry, Reason};
use crate::retry::republish::{Outcome, Report, SetAside};
use crate::store::{Held, Route, WriteOp};

/// Backoff of a message set aside for a reason of its own.
const ASIDE_FIRST: Duration = Duration::from_millis(100);
const ASIDE_MAX: Duration = Duration::from_secs(30);

fn aside_backoff(attempt: u16) -> Duration {
    (ASIDE_FIRST * (1u32 << attempt.min(12))).min(ASIDE_MAX)
}

impl Engine {
    pub(super) fn on_report(&mut self, report: Report) {
        let id = report.id;
        let Some(h) = self.handed.remove(&id) else {
            return;
        };
        self.release(&h);
        if self.ledger.get(id).is_none() {
            // Purged or cancelled meanwhile: whatever it probed, it will not
            // say, so another message may.
            self.lanes.forget_probe(&(h.vhost, h.exchange.clone()), id);
            self.gone.forget_probe(&h.queue, id);
        }
        match report.outcome {
            Outcome::Confirmed => {
                self.destination_works(&h, true);
                self.on_confirmed(id);
            }
            Outcome::Nacked => {
                self.metrics.nacked.inc();
                self.destination_works(&h, true);
                let why = "the broker nacked the republish (an error on its side)";
                self.set_aside(id, BlockReason::Nacked, why.into());
            }
            Outcome::Returned { reply } => {
                self.metrics.returned.inc();
                self.destination_works(&h, false);
                self.on_returned(id, &h, reply);
            }
            Outcome::SetAside(aside) if aside.exchange_wide => self.refused(id, &h, aside),
            Outcome::SetAside(aside) => {
                // Refused for itself: says nothing about its destination.
                self.lanes.forget_probe(&(h.vhost, h.exchange.clone()), id);
                if h.queue_route {
                    self.gone.forget_probe(&h.queue, id);
                }
                self.set_aside(id, aside.reason, aside.reply);
            }
        }
    }

    /// A publish to `h`'s exchange went through (and reached its queue, if
    /// `reached`): lifts what blocked them.
    fn destination_works(&mut self, h: &Handed, reached: bool) {
        let key = (h.vhost, h.exchange.clone());
        if let Some(block) = self.lanes.accepted(&key) {
            let (vhost, exchange) = (&self.vhosts[h.vhost as usize].name, &h.exchange);
            let reply = self.reason_text(block.reason);
            info!(%vhost, %exchange, was = %reply, blocked_for = ?Duration::from_millis(self.clock.now_ms().saturating_sub(block.since_ms)), "exchange accepts publishes again");
        }
        if reached && h.queue_route && self.gone.accepted(&h.queue).is_some() {
            let (vhost, queue) = self.ledger.name(h.queue);
            info!(%vhost, %queue, "queue is back: its held messages go again");
            let labels = queue_labels(vhost, queue);
            self.metrics.queue_gone.remove(&labels);
        }
    }

    fn on_confirmed(&mut self, id: u64) {
        self.metrics.confirmed.inc();
        if let Some(entry) = self.ledger.get(id).copied().filter(|e| e.meta.delayed) {
            let (vhost, exchange) = self.ledger.name(entry.meta.queue);
            self.metrics.delayed.routed(vhost, exchange);
        } else if let Some(entry) = self.ledger.get(id).copied() {
            let kind = match entry.meta.dead_letter {
                true => {
                    self.metrics.exhausted_dead_letter.inc();
                    EventKind::ExhaustedDeadLetter
                }
                false => EventKind::Retried,
            };
            let (vhost, queue) = self.ledger.name(entry.meta.queue);
            let (vhost, queue) = (vhost.to_string(), queue.to_string());
            self.metrics.session.recent.push(Event {
                at_ms: self.clock.now_ms(),
                kind,
                vhost,
                queue,
                retry: entry.meta.retry.into(),
            });
        }
        self.forget(id);
    }

    fn on_returned(&mut self, id: u64, h: &Handed, reply: String) {
        let Some(entry) = self.ledger.get(id).copied() else {
            return;
        };
        if entry.meta.delayed {
            return self.delayed_unroutable(id, &entry, reply);
        }
        if !h.queue_route {
            let why = format!(
                "{reply}: nothing is bound to exchange {:?} for its routing key",
                &*h.exchange
            );
            return self.set_aside(id, BlockReason::NoRoute, why);
        }
        let held = match self.reader.read(entry.loc) {
            Ok(held) => held,
            Err(e) => {
                let why = format!("returned; cannot read it back ({e})");
                return self.set_aside(id, BlockReason::Store, why);
            }
        };
        if let Some(dead_letter) = held.on_return.clone() {
            warn!(id, queue = %held.queue, "queue is gone: sending to the dead-letter exchange");
            self.metrics.rerouted.inc();
            return self.reroute(id, held, dead_letter);
        }
        self.queue_gone(id, &entry, held, &reply);
    }

    /// Delayed message `id` was returned at its due time: nothing is bound
    /// to its exchange for its routing key. `delayed.unroutable` says what
    /// becomes of it; whatever it is, it is counted and logged.
    fn delayed_unroutable(&mut self, id: u64, entry: &Entry, reply: String) {
        let rule = self.options.delayed.clone();
        let (vhost, exchange) = self.ledger.name(entry.meta.queue);
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
                return self.set_aside(id, BlockReason::NoRoute, why);
            }
            (Unroutable::Drop, _) => None,
            (Unroutable::Alternate, Some(alternate)) => Some(alternate),
        };
        let held = match self.reader.read(entry.loc) {
            Ok(held) => held,
            Err(e) => {
                let why = format!("delayed message returned; cannot read it back ({e})");
                return self.set_aside(id, BlockReason::Store, why);
            }
        };
        let routing_key = match &held.route {
            Route::Delayed { routing_key, .. } => routing_key.clone(),
            _ => String::new(),
        };
        match alternate {
            None => {
                warn!(id, %vhost, %exchange, %routing_key, %reply, "delayed message unroutable at its due time: dropped (delayed.unroutable = \"drop\")");
                self.forget(id);
            }
            Some(alternate) => {
                warn!(id, %vhost, %exchange, %routing_key, %alternate, %reply, "delayed message unroutable at its due time: sent to the alternate exchange (delayed.unroutable = \"alternate\")");
                self.metrics.rerouted.inc();
                let route = Route::Exchange {
                    exchange: alternate,
                    routing_key,
                };
                self.reroute(id, held, route);
            }
        }
    }

    /// `id` was returned from its queue and has nowhere else to go.
    fn queue_gone(&mut self, id: u64, entry: &Entry, held: Held, reply: &str) {
        let now = self.clock.now_ms();
        let q = entry.meta.queue;
        let (vhost, queue) = self.ledger.name(q);
        let (vhost, queue) = (vhost.clone(), queue.clone());
        let reason = self.ledger.intern_reason(Reason {
            kind: BlockReason::QueueGone,
            reply: format!("{reply}: queue {:?} is gone", &*queue),
            exchange: None,
        });
        self.metrics.blocked(BlockReason::QueueGone);
        let (at, change) = self.gone.refused(q, id, reason, now);
        let rule = &self.options.queue_gone;
        match change {
            Refusal::New => {
                warn!(
                    %vhost, %queue, held = self.ledger.count(q), action = ?rule.action,
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
            return self.apply_gone_action(id, held);
        }
        self.count_attempt(id);
        self.hold(id, at, reason);
    }

    /// Whether `republish.queue_gone.action` applies to queue `q` now.
    fn gone_action_due(&self, q: u32, now: u64) -> bool {
        let rule = &self.options.queue_gone;
        let after = rule.after.as_millis() as u64;
        rule.action != GoneAction::Keep
            && self
                .gone
                .get(&q)
                .is_some_and(|b| now.saturating_sub(b.since_ms) >= after)
    }

    /// At firing: `true` if `id` of a gone queue is set aside (or met the
    /// rule) instead of published. One message probes the queue each
    /// `probe_interval`.
    pub(super) fn gone_holds(&mut self, id: u64, entry: &Entry, now: u64) -> bool {
        let q = entry.meta.queue;
        let Some(block) = self.gone.get(&q).copied() else {
            return false;
        };
        if self.gone_action_due(q, now) {
            match self.reader.read(entry.loc) {
                Ok(held) => self.apply_gone_action(id, held),
                Err(e) => {
                    let why = format!("cannot read the held message ({e})");
                    self.set_aside(id, BlockReason::Store, why);
                }
            }
            return true;
        }
        match self.gone.admit(&q, id, now) {
            None => false,
            Some(at) => {
                self.metrics.blocked(BlockReason::QueueGone);
                self.hold(id, at, block.reason);
                true
            }
        }
    }

    /// The queue of `held` has been gone for `queue_gone.after`.
    fn apply_gone_action(&mut self, id: u64, held: Held) {
        if let Some(dead_letter) = held.on_return.clone() {
            self.metrics.rerouted.inc();
            return self.reroute(id, held, dead_letter);
        }
        let rule = self.options.queue_gone.clone();
        match (rule.action, rule.exchange) {
            (GoneAction::DeadLetter, Some(exchange)) => {
                let routing_key = rule.routing_key.unwrap_or_else(|| held.queue.to_string());
                info!(id, vhost = %held.vhost, queue = %held.queue, %exchange, "queue gone longer than republish.queue_gone.after: sending its message to the dead-letter exchange");
                self.metrics.gone_dead_lettered.inc();
                let route = Route::Exchange {
                    exchange,
                    routing_key,
                };
                self.reroute(id, held, route);
            }
            _ => {
                warn!(id, vhost = %held.vhost, queue = %held.queue, retry = held.retry, "queue gone longer than republish.queue_gone.after: dropping its held message (action = \"drop\")");
                self.metrics.gone_dropped.inc();
                self.forget(id);
            }
        }
    }

    /// Queue `q` holds nothing any more: it is not watched as gone.
    pub(super) fn queue_emptied(&mut self, q: u32) {
        if self.gone.remove(&q).is_some() {
            let (vhost, queue) = self.ledger.name(q);
            let labels = queue_labels(vhost, queue);
            self.metrics.queue_gone.remove(&labels);
        }
    }

    /// Sends `held` to `route` instead, once the store has the new record.
    fn reroute(&mut self, id: u64, mut held: Held, route: Route) {
        held.route = route;
        if let Some(replaces) = self.ledger.start_rewrite(id) {
            if let Some(link) = &self.link {
                link.append_version(&held);
            }
            self.write(WriteOp::Put {
                held,
                replaces: Some(replaces),
                ctx: PutCtx::Reroute,
            });
        }
    }

    /// A publish of `id` was refused for its whole exchange.
    fn refused(&mut self, id: u64, h: &Handed, aside: SetAside) {
        let now = self.clock.now_ms();
        self.metrics.blocked(aside.reason);
        let reason = self.ledger.intern_reason(Reason {
            kind: aside.reason,
            reply: aside.reply.clone(),
            exchange: Some(h.exchange.clone()),
        });
        let (at, change) = self
            .lanes
            .refused((h.vhost, h.exchange.clone()), id, reason, now);
        let vhost = &self.vhosts[h.vhost as usize].name;
        let retry_in = Duration::from_millis(at.saturating_sub(now));
        match change {
            Refusal::New => warn!(
                %vhost, exchange = %h.exchange, reply = %aside.reply, ?retry_in,
                "exchange refuses publishes: its messages are set aside (kept) and one tries again after a backoff; other exchanges and queues carry on"
            ),
            Refusal::Extended => warn!(
                %vhost, exchange = %h.exchange, reply = %aside.reply, ?retry_in,
                "exchange still refuses publishes"
            ),
            Refusal::Known => {}
        }
        debug!(id, reply = %aside.reply, "set aside with its exchange");
        self.count_attempt(id);
        self.hold(id, at, reason);
    }

    /// Sets `id` aside for a reason of its own: it is tried again after a
    /// backoff of its own, logged once per backoff step.
    pub(super) fn set_aside(&mut self, id: u64, kind: BlockReason, reply: String) {
        self.metrics.blocked(kind);
        let reason = self.ledger.intern_reason(Reason {
            kind,
            reply,
            exchange: None,
        });
        let Some(attempt) = self.count_attempt(id) else {
            return; // purged meanwhile
        };
        let backoff = aside_backoff(attempt);
        let queue = self.ledger.get(id).map(|e| e.meta.queue).unwrap_or(0);
        let (vhost, queue) = self.ledger.name(queue);
        let reply = self.reason_text(reason);
        if backoff < ASIDE_MAX || aside_backoff(attempt - 1) < ASIDE_MAX {
            warn!(id, %vhost, %queue, attempt, retry_in = ?backoff, blocked = %reply, "republish set aside; keeping the message");
        } else {
            debug!(id, %vhost, %queue, attempt, retry_in = ?backoff, blocked = %reply, "republish set aside again");
        }
        let at = self.clock.now_ms() + backoff.as_millis() as u64;
        self.hold(id, at, reason);
    }

    /// One more failed attempt for `id`; its number, if still held.
    fn count_attempt(&mut self, id: u64) -> Option<u16> {
        let entry = self.ledger.get_mut(id)?;
        entry.attempts = entry.attempts.saturating_add(1);
        Some(entry.attempts)
    }

    /// The reply of a ledger reason, for logs.
    pub(in crate::retry) fn reason_text(&self, reason: u16) -> String {
        self.ledger
            .reason(reason)
            .map_or_else(String::new, |r| r.reply.clone())
    }
}

fn queue_labels(vhost: &str, queue: &str) -> QueueLabels {
    QueueLabels {
        vhost: vhost.to_string(),
        queue: queue.to_string(),
    }
}

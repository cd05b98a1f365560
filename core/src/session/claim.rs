//! The nack path inside a session: capture deliveries of intercepted queues,
//! claim their nacks, ack them upstream once stored, and keep every other
//! settle meaning what the client meant.

use std::collections::BTreeSet;
use std::time::Duration;

use tracing::{debug, warn};

use super::capture::{Captured, Capturing};
use super::channel::{Claimed, Delivery};
use super::close::Origin;
use super::consumer::ConsumerRef;
use super::machine::{Effect, Session};
use super::settle::{self, Settle};
use crate::held::{ClaimKey, Park, Parked, Route, Ticket};
use crate::policy::{OnExhausted, Policy, Step};
use crate::protocol::frame::{Frame, FrameType};
use crate::protocol::headers::{self, Retry};
use crate::protocol::method;
use crate::stats::{Event, EventKind, PassReason};

/// What claiming one delivery came to.
enum Claim {
    /// Sent to the store; its ack waits for the answer. With how long a
    /// deferral waits if the store refuses it ([`Plan::deferral`]).
    Parked(Option<Duration>),
    /// Schedule exhausted with `on_exhausted = "reject"` (after this many retries).
    Reject(u32),
    /// Not intercepted after all: forward the client's settle.
    Pass(PassReason),
    /// nackd would hold it but cannot now: it stays unacked and is nacked
    /// upstream later (after the policy's delay, when known).
    Defer(PassReason, Option<std::time::Duration>),
}

/// Where a claimed message goes, by its policy and retry number.
struct Plan {
    /// How long it is held.
    delay: std::time::Duration,
    /// Where it goes when due.
    route: Route,
    /// Where it goes if returned as unroutable (`on_exhausted`).
    dead_letter: Option<Route>,
    /// The retry count its headers carry.
    count: u32,
    /// Why it goes to the dead-letter exchange, when it does.
    exhausted: Option<&'static str>,
}

impl Plan {
    /// How long a deferral of this retry waits: the policy's delay for it,
    /// unknown (the fallback) once the schedule is exhausted, as the plan's
    /// zero delay would make a requeue loop at the floor.
    fn deferral(&self) -> Option<Duration> {
        self.exhausted.is_none().then_some(self.delay)
    }

    /// The plan for retry number `retry` of a message from `queue`; `None`
    /// when the schedule is exhausted and the policy rejects.
    fn of(policy: &Policy, queue: &str, retry: u32) -> Option<Self> {
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
                std::time::Duration::ZERO,
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

impl Session {
    /// A delivery (deliver or get-ok) was tracked: capture it if its queue is intercepted.
    pub(super) fn start_capture(
        &mut self,
        channel_id: u16,
        tag: u64,
        exchange: &str,
        routing_key: &str,
    ) {
        let Some(state) = self.scope.as_mut() else {
            return;
        };
        let channel = self.channels.get(channel_id);
        if channel.tx {
            return;
        }
        let Some(delivery) = channel.delivery_mut(tag) else {
            return;
        }; // no-ack: never captured
        let queue = delivery.queue.clone();
        if let Some(policy) = state.policy(&queue) {
            self.channels.get(channel_id).capturing =
                Some(Capturing::new(tag, exchange, routing_key, policy));
        }
    }

    /// A content frame from the broker: feed the capture of its channel.
    pub(super) fn capture_content(&mut self, frame: &Frame) {
        let Some(state) = self.scope.as_ref() else {
            return;
        };
        let budget = state.shared.budget.clone();
        let channel = self.channels.get(frame.channel);
        let Some(capturing) = channel.capturing.as_mut() else {
            return;
        };
        let payload = frame.payload_slice();
        match frame.kind {
            FrameType::Header => {
                let size = crate::protocol::content::body_size(payload).unwrap_or(0);
                if !capturing.header(payload, size, &budget) {
                    let tag = capturing.tag;
                    channel.capturing = None;
                    if let Some(delivery) = channel.delivery_mut(tag) {
                        delivery.over_budget = true;
                    }
                    let refused = budget.refused();
                    if refused.is_power_of_two() {
                        warn!(
                            refused,
                            used = budget.used(),
                            "capture budget spent: nacks of such deliveries are deferred"
                        );
                    }
                    return;
                }
            }
            FrameType::Body => capturing.body(payload),
            _ => return,
        }
        if !channel.delivering.in_flight() {
            let capturing = channel.capturing.take().expect("checked above");
            let tag = capturing.tag;
            if let (Some(captured), Some(delivery)) =
                (capturing.finish(), channel.delivery_mut(tag))
            {
                delivery.capture = Some(captured);
            }
        }
    }

    /// A client ack/nack/reject; `true` means "forward the frame as it is".
    pub(super) fn on_settle(
        &mut self,
        channel_id: u16,
        settle: Settle,
        tag: u64,
        multiple: bool,
    ) -> bool {
        let intercepting = self.scope.is_some();
        let deferred_again =
            intercepting && !multiple && self.settled_again_deferred(channel_id, tag);
        let channel = self.channels.get(channel_id);
        let claimed_again = intercepting && !multiple && channel.pending.contains_key(&tag);
        if claimed_again {
            // A second settle of a claimed tag: the broker gets it as sent
            // and nackd steps back (no ack of its own, no held copy).
            channel.settled_again.insert(tag);
        }
        let again = claimed_again || deferred_again;
        if !intercepting || channel.tx || again {
            // Not ours (or a second settle of a held tag: the broker answers it).
            let reason = match (intercepting, channel.tx) {
                (false, _) => PassReason::NotConfigured,
                (true, true) => PassReason::TxChannel,
                (true, false) => PassReason::UnknownTag,
            };
            let covered = channel.take_covered(tag, multiple);
            if settle != Settle::Ack {
                self.count_passed(&covered, reason);
            }
            return true;
        }
        let holds = channel.claims_within(tag, multiple)
            || self.deferrals.within(channel_id, tag, multiple);
        let covered = channel.take_covered(tag, multiple);
        let claimable = settle != Settle::Ack
            && covered
                .iter()
                .any(|(_, d)| !d.returned && (d.capture.is_some() || d.over_budget));
        if !holds && !claimable {
            if settle != Settle::Ack {
                self.count_passed(&covered, PassReason::NotConfigured);
            }
            return true;
        }
        self.claim_covered(channel_id, settle, covered, multiple);
        false
    }

    /// Claims what a settle covers and sends the broker the settle of the
    /// rest: rejects of exhausted messages first (so a `multiple` frame
    /// cannot cover their tags), then the client's settle rewritten around
    /// the claimed tags.
    fn claim_covered(
        &mut self,
        channel_id: u16,
        settle: Settle,
        covered: Vec<(u64, Delivery)>,
        multiple: bool,
    ) {
        let mut forward = Vec::new();
        let mut rejects = Vec::new();
        let mut requeues = Vec::new();
        for (t, delivery) in covered {
            let queue = delivery.queue.clone();
            let from = delivery.consumer.clone();
            match self.claim(channel_id, t, delivery, settle) {
                Claim::Parked(delay) => self.note_claim(channel_id, t, settle, delay, from),
                Claim::Reject(retries) => rejects.push((t, queue, retries)),
                Claim::Defer(reason, delay) => self.defer(channel_id, t, reason, delay, from),
                // Behind a close, recover or tx.select nothing can be held or
                // deferred; as sent, a requeue=false nack would drop it.
                Claim::Pass(PassReason::Closing) if settle != Settle::Ack => {
                    self.stats.pass(PassReason::Closing, 1);
                    requeues.push(t)
                }
                Claim::Pass(reason) => {
                    if settle != Settle::Ack {
                        self.stats.pass(reason, 1);
                    }
                    forward.push(t)
                }
            }
        }
        for (t, queue, retries) in rejects {
            self.on_exhausted_reject(&queue, retries);
            self.emit_upstream(&method::reject(channel_id, t, false));
        }
        // Ahead of the held close or recover, not behind it: after a recover
        // the broker has forgotten these tags (406 unknown delivery tag).
        for t in requeues {
            self.send_own(channel_id, method::nack(channel_id, t, false, true), None);
        }
        let lowest_claimed = self.channels.get(channel_id).pending.keys().next().copied();
        let lowest_held = match (lowest_claimed, self.deferrals.lowest(channel_id)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        for f in settle::settle_frames(channel_id, settle, &forward, lowest_held, multiple) {
            self.emit_upstream(&f);
        }
    }

    /// Tag `tag` was claimed: its settle waits for the store's answer.
    fn note_claim(
        &mut self,
        channel_id: u16,
        tag: u64,
        settle: Settle,
        delay: Option<Duration>,
        from: Option<ConsumerRef>,
    ) {
        debug!(
            tag,
            ?settle,
            "claimed for a delayed retry; storing before the ack"
        );
        let seq = self.claims.last();
        let channel = self.channels.get(channel_id);
        let claimed = Claimed {
            settle,
            seq,
            delay,
            from,
        };
        channel.pending.insert(tag, claimed);
        channel.last_claim = seq;
    }

    /// Counts the nacks of deliveries forwarded as sent; a settle of tags
    /// nackd does not know counts once.
    fn count_passed(&self, covered: &[(u64, Delivery)], default: PassReason) {
        if covered.is_empty() {
            return self.stats.pass(PassReason::UnknownTag, 1);
        }
        for (_, d) in covered {
            let reason = match (d.returned, d.over_budget) {
                (true, _) => PassReason::Returned,
                (false, true) => PassReason::OverBudget,
                (false, false) => default,
            };
            self.stats.pass(reason, 1);
        }
    }

    fn on_exhausted_reject(&self, queue: &str, retry: u32) {
        self.stats.exhausted_reject.inc();
        let Some(state) = self.scope.as_ref() else {
            return;
        };
        let vhost = state.vhost.to_string();
        let at_ms = state.shared.clock.ms_at(self.now);
        let (kind, queue) = (EventKind::ExhaustedReject, queue.to_string());
        self.stats.recent.push(Event {
            at_ms,
            kind,
            vhost,
            queue,
            retry,
        });
    }

    /// Claims one delivery the client nacked: passes it on if nackd may
    /// not, defers it if nackd cannot hold it now, else parks it (or
    /// rejects it, its schedule exhausted: that needs no store).
    fn claim(&mut self, channel_id: u16, tag: u64, delivery: Delivery, settle: Settle) -> Claim {
        let queue = delivery.queue.clone();
        let captured = match self.claimable(channel_id, delivery, settle) {
            Ok(captured) => captured,
            Err(reason) if reason.defers() => return Claim::Defer(reason, None),
            Err(reason) => return Claim::Pass(reason),
        };
        let retry = headers::retry_count(&captured.header).saturating_add(1);
        let Some(plan) = Plan::of(&captured.policy, &queue, retry) else {
            return Claim::Reject(retry - 1);
        };
        let Some(state) = self.scope.as_ref() else {
            return Claim::Pass(PassReason::NotConfigured);
        };
        if let Err(reason) = state.shared.ready.may_claim() {
            return Claim::Defer(reason, plan.deferral());
        }
        let info = Retry {
            queue: &queue,
            exchange: &captured.exchange,
            routing_key: &captured.routing_key,
            count: plan.count,
            delay_ms: plan.delay.as_millis() as u64,
            now_secs: state.shared.clock.ms_at(self.now) / 1000,
            exhausted: plan.exhausted,
        };
        let header = match headers::rewrite(&captured.header, &info) {
            Ok(h) => bytes::Bytes::from(h),
            Err(e) => {
                warn!(error = %e, queue = %queue, "cannot rewrite headers: the nack is deferred");
                return Claim::Defer(PassReason::BadHeaders, plan.deferral());
            }
        };
        let key = ClaimKey {
            channel: channel_id,
            epoch: self.channels.get(channel_id).epoch,
            tag,
            seq: self.claims.next(),
        };
        let deferral = plan.deferral();
        let ticket = Ticket::default();
        let park = Park {
            key,
            vhost: state.vhost.clone(),
            queue,
            delay: plan.delay,
            retry,
            route: plan.route,
            on_return: plan.dead_letter,
            header,
            body: captured.body.clone(),
            ticket: ticket.clone(),
        };
        self.effects.push_back(Effect::Park(park));
        self.claims.made(self.now, ticket);
        Claim::Parked(deferral)
    }

    /// The captured message of a delivery nackd may claim, else why its
    /// settle passes through (or is deferred: [`PassReason::defers`]).
    /// Whether the engine takes claims now is checked by the caller.
    fn claimable(
        &mut self,
        channel_id: u16,
        delivery: Delivery,
        settle: Settle,
    ) -> Result<Captured, PassReason> {
        if settle == Settle::Ack {
            return Err(PassReason::NotConfigured);
        }
        if delivery.returned {
            // Back in its queue: the client's settle is the broker's alone.
            return Err(PassReason::Returned);
        }
        let state = self.scope.as_mut().ok_or(PassReason::NotConfigured)?;
        let policy = match (&delivery.capture, delivery.over_budget) {
            (Some(captured), _) => captured.policy.clone(),
            (None, true) => state
                .policy(&delivery.queue)
                .ok_or(PassReason::NotConfigured)?,
            (None, false) => return Err(PassReason::NotConfigured),
        };
        let closing = self
            .channels
            .peek(channel_id)
            .is_some_and(|c| c.barrier_raised);
        if closing || !self.upstream_takes_acks() {
            // An ack would come after the close (or recover) the client sent.
            return Err(PassReason::Closing);
        }
        if !policy.wants(settle.requeue()) {
            return Err(PassReason::RequeuePass);
        }
        delivery.capture.ok_or(PassReason::OverBudget)
    }

    /// The store answered for a claimed delivery.
    pub(super) fn on_parked(&mut self, parked: Parked) {
        let key = parked.key;
        if self.publishes.is_taken(key.seq) {
            return self.on_publish_parked(key.seq, parked.result);
        }
        self.claims.answered(key.seq);
        let upstream_alive = self.upstream_takes_acks();
        let settle = self
            .channels
            .get_epoch(key.channel, key.epoch)
            .filter(|c| !c.closing && upstream_alive)
            .and_then(|c| {
                let claimed = c.pending.remove(&key.tag);
                claimed
                    .map(|c| (c.delay, c.from))
                    .filter(|_| !c.settled_again.remove(&key.tag))
            });
        match (settle, parked.result) {
            (Some(_), Ok(id)) => {
                debug!(
                    channel = key.channel,
                    tag = key.tag,
                    id,
                    "held; acking upstream"
                );
                self.stats.intercepted.inc();
                self.barrier.acked(self.now, Some(key.seq));
                let ack = method::ack(key.channel, key.tag, false);
                self.send_own(key.channel, ack, Some(id));
            }
            (Some((delay, from)), Err(e)) => {
                warn!(error = %e, "cannot hold the message: it stays unacked, nacked (requeue) later");
                self.defer(
                    key.channel,
                    key.tag,
                    PassReason::StoreUnavailable,
                    delay,
                    from,
                );
            }
            (None, Ok(id)) => {
                // The broker took the delivery back (channel or connection
                // closed): holding its copy too would deliver it twice.
                self.effects.push_back(Effect::Cancel(id));
                self.drop_orphan_pending(key);
            }
            (None, Err(_)) => self.drop_orphan_pending(key),
        }
        self.release_if_settled();
    }

    /// Sends a frame of nackd's own on `channel_id`, ahead of the client
    /// frames held back, but never inside a client content that has begun
    /// going upstream: then it waits for that content's last frame.
    /// `held` is the id of the stored copy an ack stands for: if the ack
    /// never goes, the copy is cancelled (see [`Session::end`]).
    pub(super) fn send_own(&mut self, channel_id: u16, frame: bytes::Bytes, held: Option<u64>) {
        let barrier_up = self.barrier.is_up();
        let channel = self.channels.get(channel_id);
        let content_open =
            channel.publishing.in_flight() && !(barrier_up && channel.publish_behind_barrier);
        if content_open {
            channel.after_publish.push((frame, held));
        } else {
            self.to_upstream.extend_from_slice(&frame);
        }
    }

    /// Whether an ack written now still reaches a broker that applies it:
    /// not once the connection is gone, the broker closes it, or nackd's or
    /// the client's `connection.close` went upstream.
    pub(super) fn upstream_takes_acks(&self) -> bool {
        let close_sent = match self.close.awaiting_upstream() {
            Some(Origin::Client) => !self.barrier.is_up(),
            Some(_) => true,
            None => false,
        };
        let broker_closes = self.close.broker_closed();
        !self.close.upstream_gone() && !close_sent && !broker_closes
    }

    fn drop_orphan_pending(&mut self, key: ClaimKey) {
        if let Some(c) = self.channels.get_epoch(key.channel, key.epoch) {
            c.pending.remove(&key.tag);
            c.settled_again.remove(&key.tag);
        }
    }

    /// Client frames go upstream, or wait behind a barrier.
    pub(super) fn emit_upstream(&mut self, bytes: &[u8]) {
        self.upstream_tx = self.now;
        if !self.barrier.hold(bytes) {
            self.to_upstream.extend_from_slice(bytes);
        }
    }

    /// Whether a close, recover or disconnect must wait: claims are still
    /// unanswered, or nackd acked one less than [`super::ACK_GRACE`] ago (and the
    /// broker still takes acks).
    pub(super) fn must_wait(&self) -> bool {
        let recent = self.barrier.acked_recently(self.now);
        self.upstream_takes_acks()
            && (self.claims.any_unanswered() || recent || self.barrier.is_up())
    }

    /// Holds client frames until the claims made so far are answered and
    /// acked (before a connection close that would make the broker requeue
    /// held messages).
    pub(super) fn raise_barrier(&mut self) {
        let all = self.claims.last();
        self.raise_barrier_behind(all);
    }

    /// Like [`Session::hold`] for a close, recover or `tx.select` of one
    /// channel: it waits for that channel's claims (and the older ones).
    pub(super) fn raise_channel_barrier(&mut self, channel_id: u16) {
        let channel = self.channels.get(channel_id);
        channel.barrier_raised = true;
        let last = channel.last_claim;
        self.raise_barrier_behind(last);
    }

    fn raise_barrier_behind(&mut self, barrier: u64) {
        if self.barrier.raise(barrier) {
            debug!(
                pending = self.channels.pending(),
                "client frames wait behind a barrier until the claims are acked"
            );
        }
        self.close.set_settling(true);
        self.release_if_settled();
    }

    /// Closes upstream once held messages are acked (see [`Session::hold`]).
    pub(super) fn close_upstream_after_acks(&mut self, why: &'static str) {
        self.close.set_settling(true);
        self.barrier.defer_close(why, self.claims.last());
        self.release_if_settled();
    }

    /// Lets held-back frames and a deferred close go on once every claim
    /// of the barrier is answered and the broker had [`super::ACK_GRACE`] to apply
    /// nackd's acks (at once if the broker takes no more acks). A claim
    /// unanswered for [`super::SETTLE_TIMEOUT`] is given up: it is deferred, its
    /// nack (requeue) sent at once ahead of a close or recover that waits.
    pub(super) fn release_if_settled(&mut self) {
        if !self.barrier.waits() {
            return;
        }
        let now = self.now;
        if self.upstream_takes_acks() {
            let upto = self.barrier.upto();
            self.give_up_overdue(upto);
            let checks = &self.checks;
            if self
                .claims
                .waits_upto(upto, |seq| checks.stuck_behind_barrier(seq))
            {
                return;
            }
            if self.barrier.grace(now).is_some() {
                return;
            }
        }
        let lowered = self.barrier.lower();
        self.close.set_settling(false);
        // The close handshake's own timeout runs from here.
        self.close.restart(now);
        if let Some(held) = lowered.held {
            self.channels.lower_barriers();
            self.checks.barrier_lowered();
            self.to_upstream.extend_from_slice(&held);
        }
        if let Some(why) = lowered.close {
            self.close_upstream(why);
        }
    }

    /// Gives up the claims up to number `upto` the store has not answered
    /// within [`super::SETTLE_TIMEOUT`]. It runs on every tick, not only while a
    /// close waits: a store that does not answer (a stuck `fsync`) must not
    /// keep deliveries unacked for good, filling the consumers' prefetch.
    /// A claim the engine stored meanwhile is not given up (its answer is
    /// on its way); nor is it while the broker takes no more acks (it takes
    /// the deliveries back itself).
    pub(super) fn give_up_overdue(&mut self, upto: u64) {
        if !self.upstream_takes_acks() {
            return;
        }
        let now = self.now;
        // Claims are numbered in the order they were made: the old ones
        // come first, and the scan stops at the first young one. A publish
        // whose check waits for a declare (or delete) held behind a
        // barrier is not given up: that declare may be behind it.
        let checks = &self.checks;
        let mut expired = self
            .claims
            .overdue(upto, now, |seq| checks.stuck_behind_barrier(seq));
        if expired.is_empty() {
            return;
        }
        self.give_up_taken(&mut expired);
        if !expired.is_empty() {
            self.give_up_claims(&expired);
        }
    }

    /// The store did not answer these claims in time: they are deferred
    /// (unless the client settled them again itself), which requeues them
    /// at once ahead of a close that waits; a copy stored later is deleted
    /// (their tickets say so). Those the engine stored meanwhile are left
    /// to their answer.
    fn give_up_claims(&mut self, seqs: &BTreeSet<u64>) {
        let seqs: BTreeSet<u64> = seqs
            .iter()
            .copied()
            .filter(|seq| self.claims.give_up(*seq))
            .collect();
        if seqs.is_empty() {
            return;
        }
        let taken = self.channels.take_claims(&seqs);
        warn!(
            claims = taken.len(),
            "the store did not answer within the settle timeout: those deliveries go back to the broker"
        );
        for (channel, tag, claimed, again) in taken {
            if !again {
                let reason = PassReason::StoreUnavailable;
                self.defer(channel, tag, reason, claimed.delay, claimed.from);
            }
        }
    }

    /// The broker closed channel `channel_id`: acks waiting behind a client
    /// publish there will never be applied; their copies are cancelled.
    pub(super) fn cancel_after_publish(&mut self, channel_id: u16) {
        // The broker discards what the client sends on it until close-ok.
        self.channels.get(channel_id).handed_over.clear();
        let waiting = std::mem::take(&mut self.channels.get(channel_id).after_publish);
        for id in waiting.into_iter().filter_map(|(_, id)| id) {
            self.effects.push_back(Effect::Cancel(id));
        }
    }
}

//! What a session does with a nack it defers (see `deferrals` for why
//! and for the book of deferred tags): records it, sends its nack
//! (requeue) when due at the rate allowed, and forgets the tags the
//! broker takes back anyway.

use std::time::Duration;

use tracing::debug;

use super::close::Origin;
use super::consumer::ConsumerRef;
use super::deferrals::{FALLBACK_DELAY, MAX_DELAY, MIN_DELAY};
use super::machine::Session;
use crate::protocol::method;
use crate::stats::PassReason;

impl Session {
    /// nackd would hold delivery `tag` but cannot now (`reason`): it stays
    /// unacked at the broker and is nacked with `requeue=true` after
    /// `delay` (the policy's for this retry when known), bounded.
    pub(super) fn defer(
        &mut self,
        channel_id: u16,
        tag: u64,
        reason: PassReason,
        delay: Option<Duration>,
        from: Option<ConsumerRef>,
    ) {
        self.stats.defer(reason);
        let channel_closing = self
            .channels
            .peek(channel_id)
            .is_some_and(|c| c.barrier_raised || c.closing);
        let connection_closing =
            self.barrier.close_waits() || self.close.awaiting_upstream() == Some(Origin::Client);
        if channel_closing || connection_closing {
            // A close, recover or tx.select waits to go upstream: the close
            // and recover would requeue it anyway, and after a tx.select a
            // later nack would be part of the client's transaction. It goes
            // back now, ahead of them.
            debug!(
                tag,
                reason = reason.label(),
                "cannot hold: requeued now, before the close"
            );
            let nack = method::nack(channel_id, tag, false, true);
            self.send_own(channel_id, nack, None);
            return;
        }
        let delay = delay.unwrap_or(FALLBACK_DELAY).clamp(MIN_DELAY, MAX_DELAY);
        debug!(
            tag,
            reason = reason.label(),
            ?delay,
            "cannot hold: left unacked, nacked (requeue) after the delay"
        );
        self.deferrals
            .insert(channel_id, tag, self.now + delay, from);
    }

    /// Sends the nacks (requeue) of the deferred tags that are due, as the
    /// rate allows; the rest wait for [`Deferrals::next_wake`].
    pub(super) fn fire_deferred(&mut self) {
        if self.deferrals.len() == 0 {
            return;
        }
        if !self.upstream_takes_acks() {
            // The broker takes the deliveries back with the connection.
            self.deferrals.take_all();
            return;
        }
        for (channel, tag) in self.deferrals.take_due(self.now) {
            debug!(channel, tag, "deferred nack: requeued at the broker");
            self.send_own(channel, method::nack(channel, tag, false, true), None);
        }
    }

    /// The client settles a deferred tag a second time: that settle goes
    /// to the broker as sent (as for a claimed tag), and nackd steps back.
    /// The broker cancelled consumer `tag` of `channel_id` and took its
    /// unacked deliveries back (RabbitMQ 4.3's consumer timeout on a
    /// quorum queue): nackd settles none of them any more. A claim waiting
    /// for the store is left to the broker (no ack, the held copy
    /// cancelled when the store answers), a deferred nack forgotten: the
    /// broker has the message back and would refuse either settle
    /// (unknown delivery tag) by closing the channel.
    pub(super) fn on_broker_cancel(&mut self, channel_id: u16, tag: &str) {
        let Some(from) = self.channels.get(channel_id).broker_cancelled(tag) else {
            return;
        };
        let forgotten = self.deferrals.take_from(channel_id, &from);
        if !forgotten.is_empty() {
            debug!(
                channel = channel_id,
                tags = forgotten.len(),
                "the broker cancelled their consumer and took them back: deferred nacks forgotten"
            );
        }
    }

    pub(super) fn settled_again_deferred(&mut self, channel_id: u16, tag: u64) -> bool {
        self.deferrals.remove(channel_id, tag)
    }

    /// Channel `channel_id` closes or recovers: the broker requeues its
    /// unacked deliveries itself, so its deferred tags are forgotten.
    pub(super) fn forget_deferred(&mut self, channel_id: u16) {
        let forgotten = self.deferrals.take_channel(channel_id);
        if !forgotten.is_empty() {
            debug!(
                channel = channel_id,
                tags = forgotten.len(),
                "deferred nacks forgotten: the broker requeues them"
            );
        }
    }

    /// The connection ends: the broker requeues every unacked delivery.
    pub(super) fn forget_all_deferred(&mut self) {
        self.deferrals.take_all();
    }

    /// Sends the nacks (requeue) of the deferred tags of `channel_id` now
    /// (before a `tx.select`, after which they would be transactional).
    pub(super) fn requeue_deferred_now(&mut self, channel_id: u16) {
        for tag in self.deferrals.take_channel(channel_id) {
            self.send_own(channel_id, method::nack(channel_id, tag, false, true), None);
        }
    }

    /// nackd shuts down: every deferred tag is nacked (requeue) now, ahead
    /// of the connection close. The close would requeue them too, but on
    /// RabbitMQ 4.3 quorum queues an explicit nack does not count toward
    /// the delivery-limit and a return on disconnect does.
    pub(super) fn requeue_all_deferred_now(&mut self) {
        if !self.upstream_takes_acks() {
            return self.forget_all_deferred();
        }
        for (channel, tag) in self.deferrals.take_all() {
            self.send_own(channel, method::nack(channel, tag, false, true), None);
        }
    }
}

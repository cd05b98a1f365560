//! Delayed publishes inside a session: nackd emulates the archived
//! delayed-message plugin's `x-delayed-message` exchanges.
//!
//! - `exchange.declare` of that type with `x-delayed-type = T` goes to the
//!   broker as type `T` (its arguments kept), in its waiting form even when
//!   the client sent `nowait` (whose `declare-ok` then stays with nackd):
//!   the exchange becomes delayed ([`crate::delayed::DelayedExchanges`])
//!   only once the broker said yes to the client's own declare. A delete
//!   of a delayed exchange likewise: it is forgotten at the broker's
//!   `delete-ok`, a refused one leaves it delayed.
//! - A `basic.publish` to a delayed exchange (or to one whose delayed
//!   declare waits for the broker) is held until its content header says
//!   whether it carries `x-delay` > 0. If not, it goes to the broker as
//!   sent. If so, the whole message is taken, and the broker is asked
//!   whether it would take that publish from this client (`check`: the
//!   reserved channel); a publish it would refuse goes to the broker as
//!   sent, so that the client gets the broker's own refusal. One it would
//!   take is parked with [`Route::Delayed`] (the engine publishes it to the
//!   exchange when due), and on a confirm channel the publisher's
//!   `basic.ack` goes once it is stored (`basic.nack` if it cannot be);
//!   [`Renumber`] keeps the publisher's delivery tags its own while some
//!   publishes go to the broker and some to nackd.
//! - On a `tx.select` channel a delayed publish closes the connection
//!   with 540 NOT_IMPLEMENTED: nackd cannot make it part of a transaction.

use std::sync::Arc;

use amq_protocol::protocol::{channel as amqp_channel, exchange, AMQPClass};
use amq_protocol::types::AMQPValue;
use bytes::Bytes;
use tracing::{debug, warn};

use super::check::Verdict;
use super::confirms::{Confirm, Renumber};
use super::machine::{Effect, Session};
use super::peer::Fault;
use super::publishes::{Declared, Deleted, Taken, Taking};
use crate::delayed::{TYPE, TYPE_ARG};
use crate::held::{ClaimKey, Park, Route, StoreError, Ticket};
use crate::protocol::content;
use crate::protocol::frame::{Frame, FrameError, FrameType};
use crate::protocol::headers;
use crate::protocol::method::{self, ids, MethodId};

impl Session {
    /// `exchange.declare` / `exchange.delete` of the client; `false`: do not
    /// forward it (nackd sent its own version). The delayed exchanges
    /// follow the broker: a delayed declare, or a delete of a delayed
    /// exchange, goes in its waiting form and counts once the broker
    /// accepted it (a refused one changes nothing); until then publishes to
    /// that exchange are taken and their checks wait (`check`), so that no
    /// check overtakes the change on another channel.
    pub(super) fn on_client_exchange(
        &mut self,
        channel_id: u16,
        class: &AMQPClass,
    ) -> Result<bool, Fault> {
        let Some(state) = self.scope.as_ref() else {
            return Ok(true);
        };
        let registry = state.shared.delayed.clone();
        let vhost = state.vhost.clone();
        if self.channels.get(channel_id).closing {
            // The broker closed the channel: it discards what the client
            // still sends on it, and answers none of it.
            return Ok(true);
        }
        match class {
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(d))
                if d.kind.as_str() == TYPE && !d.passive && registry.enabled() =>
            {
                let Some(real) = d.arguments.inner().get(TYPE_ARG).and_then(text) else {
                    // As the plugin's absence would: the broker refuses the type.
                    self.expect_declare_ok(channel_id, d.nowait, None);
                    return Ok(true);
                };
                let name: Arc<str> = Arc::from(d.exchange.as_str());
                if !registry.reserve(&vhost, &name) {
                    warn!(exchange = %name, limit = registry.limit(), "a delayed exchange beyond the limit of its vhost: refused");
                    return Err(FrameError::NotAllowed(
                        "a delayed exchange beyond the limit of its vhost ([delayed] max_exchanges)",
                    ));
                }
                debug!(exchange = %name, kind = %real, "delayed exchange declared");
                let declared = Declared::new(name.clone(), real.clone(), d.nowait);
                self.expect_declare_ok(channel_id, false, Some(declared));
                self.publishes.declare_sent(name);
                self.checks.hold(self.barrier.is_up());
                let mut declare = d.clone();
                declare.kind = real.as_str().into();
                declare.nowait = false;
                let class = AMQPClass::Exchange(exchange::AMQPMethod::Declare(declare));
                self.emit_upstream(&method::encode(channel_id, &class));
                Ok(false)
            }
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(d)) => {
                self.expect_declare_ok(channel_id, d.nowait, None);
                Ok(true)
            }
            AMQPClass::Exchange(exchange::AMQPMethod::Delete(d)) => {
                let name: Arc<str> = Arc::from(d.exchange.as_str());
                let delayed = registry.is_delayed(&vhost, &name) || self.publishes.declaring(&name);
                let deletes = &mut self.channels.get(channel_id).exchange_deletes;
                if !delayed {
                    if !d.nowait {
                        deletes.push_back(None);
                    }
                    return Ok(true);
                }
                deletes.push_back(Some(Deleted::new(name, d.nowait)));
                self.checks.hold(self.barrier.is_up());
                let mut delete = d.clone();
                delete.nowait = false;
                let class = AMQPClass::Exchange(exchange::AMQPMethod::Delete(delete));
                self.emit_upstream(&method::encode(channel_id, &class));
                Ok(false)
            }
            _ => Ok(true),
        }
    }

    fn expect_declare_ok(&mut self, channel_id: u16, nowait: bool, declared: Option<Declared>) {
        if !nowait {
            let channel = self.channels.get(channel_id);
            channel.exchange_declares.push_back(declared);
        }
    }

    /// The broker's `exchange.declare-ok` / `delete-ok` on a channel: a
    /// delayed declare or delete counts now. `false`: the client sent
    /// `nowait`, the answer is nackd's.
    pub(super) fn on_broker_exchange_ok(&mut self, channel_id: u16, delete: bool) -> bool {
        let channel = self.channels.get(channel_id);
        let (name, swallow) = match delete {
            false => match channel.exchange_declares.pop_front() {
                Some(Some(declared)) => {
                    let (name, kind, swallow) = declared.parts();
                    if let Some(state) = self.scope.as_ref() {
                        state.shared.delayed.declare(&state.vhost, name, kind);
                    }
                    self.end_declaring(name);
                    (name.clone(), swallow)
                }
                _ => return true,
            },
            true => match channel.exchange_deletes.pop_front() {
                Some(Some(deleted)) => {
                    let (name, swallow) = deleted.parts();
                    if let Some(state) = self.scope.as_ref() {
                        state.shared.delayed.delete(&state.vhost, name);
                    }
                    (name.clone(), swallow)
                }
                _ => return true,
            },
        };
        debug!(exchange = %name, delete, "the broker accepted a change to the delayed exchanges");
        self.checks.release(&mut self.to_upstream);
        !swallow
    }

    /// A delayed declare of `name` is answered (yes or no).
    fn end_declaring(&mut self, name: &Arc<str>) {
        if let Some(state) = self.scope.as_ref() {
            state.shared.delayed.unreserve(&state.vhost, name);
        }
        self.publishes.declare_answered(name);
    }

    /// The broker closes a channel: declares and deletes it has not
    /// answered were refused (or never done): the delayed exchanges stay
    /// as they were.
    pub(super) fn on_broker_channel_close_exchanges(&mut self, channel_id: u16) {
        let channel = self.channels.get(channel_id);
        let deletes = std::mem::take(&mut channel.exchange_deletes);
        let declares = std::mem::take(&mut channel.exchange_declares);
        for declared in declares.into_iter().flatten() {
            let (name, ..) = declared.parts();
            debug!(exchange = %name, "the broker refused a delayed declare");
            self.end_declaring(name);
            self.checks.release(&mut self.to_upstream);
        }
        for deleted in deletes.into_iter().flatten() {
            debug!(exchange = %deleted.parts().0, "the broker refused a delete of a delayed exchange");
            self.checks.release(&mut self.to_upstream);
        }
    }

    /// A client method frame on a channel: `true` if it is a publish to a
    /// delayed exchange, held here until its header comes.
    pub(super) fn hold_publish(&mut self, frame: &Frame) -> Result<bool, Fault> {
        let payload = frame.payload_slice();
        if MethodId::peek(payload)? != ids::BASIC_PUBLISH {
            return Ok(false);
        }
        let Some(state) = self.scope.as_ref() else {
            return Ok(false);
        };
        let channel = self.channels.get(frame.channel);
        if channel.confirm {
            channel.published += 1;
        }
        if state.shared.delayed.none() && self.publishes.none_declaring() {
            // The pass-through path: no exchange is delayed, nothing to read.
            if let Some(r) = channel.renumber.as_mut() {
                r.forward();
            }
            return Ok(false);
        }
        // A routing key that is not UTF-8 is legal (RabbitMQ routes it):
        // such a publish is the broker's to judge, unless it is for a
        // delayed exchange (see `Taking::routing_key`).
        let (exchange, routing_key) = match method::peek_publish(payload) {
            Ok(p) => (Some(p.exchange), Some(p.routing_key)),
            Err(_) => (method::publish_exchange(payload), None),
        };
        // On a channel the broker closed, it discards what the client
        // still sends: nackd must not deliver it later either.
        let publishes = &self.publishes;
        let delayed = exchange.filter(|x| {
            !channel.closing
                && !channel.refused
                && (state.shared.delayed.is_delayed(&state.vhost, x) || publishes.declaring(x))
        });
        let Some(exchange) = delayed else {
            if let Some(r) = channel.renumber.as_mut() {
                r.forward();
            }
            return Ok(false);
        };
        channel.taking = Some(Box::new(Taking::new(
            exchange,
            routing_key,
            frame.raw.clone(),
        )));
        Ok(true)
    }

    /// A content frame of a publish held by [`Session::hold_publish`].
    pub(super) fn take_content(&mut self, frame: &Frame) -> Result<(), Fault> {
        let channel_id = frame.channel;
        let channel = self.channels.get(channel_id);
        let Some(taking) = channel.taking.as_mut() else {
            return Ok(());
        };
        taking.on_frame(&frame.raw);
        let goes_on = match frame.kind {
            FrameType::Header => self.take_header(channel_id, frame.payload())?,
            FrameType::Body => {
                taking.on_body(frame.payload_slice());
                true
            }
            _ => true,
        };
        if !goes_on {
            return Ok(());
        }
        let channel = self.channels.get(channel_id);
        if !channel.publishing.in_flight() {
            let taking = channel.taking.take().expect("checked above");
            if channel.closing {
                // The broker closed the channel meanwhile: it would have
                // discarded this publish, and so does nackd.
                debug!(exchange = %taking.exchange(), "a delayed publish on a channel the broker closed: dropped, as the broker drops it");
                self.flush_after_publish(channel_id);
                return Ok(());
            }
            self.park_publish(channel_id, *taking);
        }
        Ok(())
    }

    /// The content header of the publish being taken on `channel_id`:
    /// `false` if the publish went to the broker as sent (no delay, or
    /// over the budget on a channel without confirms).
    fn take_header(&mut self, channel_id: u16, payload: Bytes) -> Result<bool, Fault> {
        let budget = self.scope.as_ref().map(|s| s.shared.budget.clone());
        let channel = self.channels.get(channel_id);
        let taking = channel.taking.as_mut().expect("a publish is being taken");
        if headers::delay_ms(&payload).is_none() {
            // No delay: to the broker as sent, now.
            let taking = channel.taking.take().expect("checked above");
            self.forward_publish(channel_id, *taking);
            return Ok(false);
        }
        if channel.tx {
            return Err(FrameError::NotImplemented(
                "a delayed publish (x-delay) on a transactional channel",
            ));
        }
        if !taking.has_routing_key() {
            return Err(FrameError::NotImplemented(
                "a delayed publish (x-delay) whose routing key is not UTF-8",
            ));
        }
        let size = usize::try_from(content::body_size(&payload)?)
            .unwrap_or(usize::MAX)
            .saturating_add(payload.len());
        let reserved = budget.and_then(|b| b.reserve(size));
        if reserved.is_none() && !channel.confirm {
            // Nackd cannot say no: routed at once, as when the store
            // cannot take it.
            warn!(exchange = %taking.exchange(), size, "a delayed publish does not fit in the capture budget (no confirms on its channel): it is routed at once");
            self.stats.delayed_refused.inc();
            let taking = channel.taking.take().expect("checked above");
            self.forward_publish(channel_id, *taking);
            return Ok(false);
        }
        if reserved.is_none() {
            warn!(exchange = %taking.exchange(), size, "a delayed publish does not fit in the capture budget: the publisher gets a nack");
        }
        taking.on_header(payload, reserved);
        Ok(true)
    }

    /// A held publish goes to the broker after all: its method, then what
    /// came of its content (the rest follows as usual).
    fn forward_publish(&mut self, channel_id: u16, taking: Taking) {
        let barrier_up = self.barrier.is_up();
        let channel = self.channels.get(channel_id);
        if let Some(r) = channel.renumber.as_mut() {
            r.forward();
        }
        channel.publish_behind_barrier = barrier_up;
        self.emit_upstream(taking.method());
        self.emit_content(channel_id, taking.content());
    }

    /// The whole delayed publish is here: parked, or (the engine takes
    /// nothing now) refused on a confirm channel, sent on at once on one
    /// without confirms.
    fn park_publish(&mut self, channel_id: u16, taking: Taking) {
        let Some(state) = self.scope.as_ref() else {
            return;
        };
        let vhost = state.vhost.clone();
        let ready = state.shared.ready.may_claim();
        let (epoch, tag) = self.publisher_tag(channel_id);
        if taking.over_budget() {
            let tag = tag.expect("only a confirm channel's publish is refused");
            self.stats.delayed_refused.inc();
            self.answer_taken(channel_id, epoch, tag, false);
            self.flush_after_publish(channel_id);
            return;
        }
        if let Err(reason) = ready {
            self.stats.delayed_refused.inc();
            match tag {
                Some(tag) => {
                    warn!(exchange = %taking.exchange(), ?reason, "cannot hold a delayed publish now: the publisher gets a nack");
                    self.answer_taken(channel_id, epoch, tag, false);
                }
                None => {
                    warn!(exchange = %taking.exchange(), ?reason, "cannot hold a delayed publish now (no confirms on its channel): it is routed at once");
                    self.forward_whole(channel_id, &taking);
                }
            }
            self.flush_after_publish(channel_id);
            return;
        }
        let raw = taking.raw();
        let exchange = taking.exchange().clone();
        let key = ClaimKey {
            channel: channel_id,
            epoch,
            tag: tag.unwrap_or(0),
            seq: self.claims.next(),
        };
        let park = delayed_park(key, vhost, taking);
        if self.ask_check(key, &raw, &exchange, tag) {
            debug!(exchange = %exchange, delay_ms = park.delay.as_millis() as u64, ?tag, "delayed publish taken; asking the broker");
            self.claims.made(self.now, park.ticket.clone());
            self.channels.get(channel_id).last_claim = key.seq;
            let taken = Taken::new((channel_id, epoch), exchange, tag, raw, park);
            self.publishes.insert(key.seq, taken);
        }
        self.flush_after_publish(channel_id);
    }

    /// The opening of channel `channel_id`, and on a confirm channel the
    /// publisher's tag of the publish nackd takes now.
    fn publisher_tag(&mut self, channel_id: u16) -> (u64, Option<u64>) {
        let channel = self.channels.get(channel_id);
        let tag = channel.confirm.then(|| {
            let published = channel.published;
            channel
                .renumber
                .get_or_insert_with(|| Box::new(Renumber::new(published)))
                .take()
        });
        (channel.epoch, tag)
    }

    /// Asks the broker's word on publish `raw` (claim `seq`) before it is
    /// stored: nothing is stored that the broker would refuse. `false`: no
    /// channel to ask on (the broker allows the client one), and the
    /// publish was refused (its publisher gets a nack) or, without
    /// confirms, routed at once.
    fn ask_check(&mut self, key: ClaimKey, raw: &Bytes, exchange: &str, tag: Option<u64>) -> bool {
        let before = self.to_upstream.len();
        let asked = self.checks.ask(key.seq, raw, &mut self.to_upstream);
        if self.to_upstream.len() > before {
            // Held back, a check is no word to the broker: the heartbeat
            // owed in the client's name still goes.
            self.upstream_tx = self.now;
        }
        if asked {
            return true;
        }
        self.stats.delayed_refused.inc();
        match tag {
            Some(tag) => {
                warn!(exchange, "cannot check a delayed publish (no channel to spare): the publisher gets a nack");
                self.answer_taken(key.channel, key.epoch, tag, false);
            }
            None => {
                warn!(exchange, "cannot check a delayed publish (no channel to spare; no confirms on its channel): it is routed at once");
                self.emit_upstream(raw);
            }
        }
        false
    }

    /// Whether nackd reserves a channel on this session's upstream
    /// connection to check delayed publishes (it emulates the type).
    pub(super) fn reserves_channel(&self) -> bool {
        self.scope
            .as_ref()
            .is_some_and(|s| s.shared.delayed.enabled())
    }

    /// A frame the broker sent on the reserved channel (never the
    /// client's).
    pub(super) fn on_check_frame(&mut self, frame: &Frame) -> Result<(), Fault> {
        if frame.kind != FrameType::Method {
            return Ok(());
        }
        let class = method::decode_any(frame.payload_slice())?;
        match self.checks.on_broker_method(&class, &mut self.to_upstream) {
            Some(Verdict::Granted(seq)) => self.on_granted(seq),
            Some(Verdict::Refused(seq)) => {
                if let AMQPClass::Channel(amqp_channel::AMQPMethod::Close(c)) = &class {
                    debug!(
                        code = c.reply_code,
                        text = c.reply_text.as_str(),
                        "the broker refuses a delayed publish from this client"
                    );
                }
                self.on_refused(seq);
            }
            None => {}
        }
        Ok(())
    }

    /// The broker would take publish `seq` from this client: it is parked
    /// (unless given up meanwhile, or its exchange is no longer delayed:
    /// then it goes to the broker as sent).
    fn on_granted(&mut self, seq: u64) {
        let Some(taken) = self.publishes.get(seq) else {
            return;
        };
        let still_delayed = self.publishes_declaring(taken.exchange());
        let (channel, epoch) = taken.channel();
        // After a refused publish on its channel, the broker discards this
        // one: it goes there as sent, to be discarded as without nackd.
        let refused_before = self
            .channels
            .get_epoch(channel, epoch)
            .is_some_and(|c| c.refused);
        if taken.given_up() || !still_delayed || refused_before {
            let taken = self.publishes.remove(seq).expect("looked up above");
            self.claims.answered(seq);
            if !taken.given_up() {
                debug!(exchange = %taken.exchange(), refused_before, "the publish goes to the broker as sent after all");
                let unconfirmed = taken.unconfirmed() && !refused_before;
                if !self.hand_over(taken) && unconfirmed {
                    tracing::error!("a delayed publish whose exchange is no longer delayed cannot go to the broker (its channel is closed): the message is lost (its publisher used no confirms)");
                    self.stats.delayed_lost.inc();
                }
            }
            self.release_if_settled();
            return;
        }
        let taken = self.publishes.get_mut(seq).expect("looked up above");
        let park = taken.granted();
        self.effects.push_back(Effect::Park(park));
    }

    /// The broker would refuse publish `seq` from this client: it goes to
    /// the broker as sent, on its channel, for the broker to refuse it
    /// there in the client's name, as it would without nackd.
    fn on_refused(&mut self, seq: u64) {
        let Some(taken) = self.publishes.remove(seq) else {
            return;
        };
        self.claims.answered(seq);
        self.stats.delayed_denied.inc();
        if !taken.given_up() {
            let (channel, epoch) = taken.channel();
            if self.hand_over(taken) {
                if let Some(c) = self.channels.get_epoch(channel, epoch) {
                    c.refused = true;
                }
            }
        }
        self.release_if_settled();
    }

    /// A publish nackd took goes to the broker as sent, on its channel
    /// (unless that channel is gone: the broker would discard it).
    /// `false`: it did not go.
    fn hand_over(&mut self, taken: Taken) -> bool {
        let ((channel_id, epoch), tag) = (taken.channel(), taken.tag());
        let Some(raw) = taken.into_raw() else {
            return false;
        };
        // Not once the broker closes the channel, or the client's close
        // went upstream (a publish after it closes the connection).
        let barrier_up = self.barrier.is_up();
        let alive = self.channels.get_epoch(channel_id, epoch).is_some_and(|c| {
            !c.closing && (!c.client_closed || (barrier_up && c.end_behind.is_some()))
        }) && self.upstream_takes_acks();
        if !alive {
            return false;
        }
        let channel = self.channels.get(channel_id);
        match tag {
            // The broker numbers it now: its confirm is the publisher's.
            Some(tag) => {
                if let Some(r) = channel.renumber.as_mut() {
                    r.hand_over(tag);
                }
            }
            None if channel.confirm => {
                // `confirm.select` came since: the broker numbers this
                // publish, its publisher does not. The next publish the
                // publisher numbers is one not yet accounted for.
                let next = channel.published + 1 - u64::from(channel.taking.is_some());
                channel
                    .renumber
                    .get_or_insert_with(|| Box::new(Renumber::new(next)))
                    .extra();
            }
            None => {}
        }
        if channel.publishing.in_flight() && channel.taking.is_none() {
            // After the client content going upstream on this channel
            // (a publish nackd is reading sent nothing upstream yet, and
            // its number comes after this one's).
            channel.handed_over.push(raw);
        } else if let (true, Some(at)) = (barrier_up, channel.end_behind) {
            // Before the channel's close or tx.select that waits behind the
            // barrier: the client sent the publish first.
            self.insert_behind_barrier(at, &raw);
        } else {
            // In the client's order (behind a barrier if one is up).
            self.emit_upstream(&raw);
        }
        true
    }

    /// Puts `raw` into the frames behind the barrier at offset `at`; the
    /// offsets kept past it move along.
    fn insert_behind_barrier(&mut self, at: usize, raw: &[u8]) {
        self.barrier.insert(at, raw);
        self.channels.shift_end_behind(at, raw.len());
    }

    /// Sends a whole publish nackd held to the broker (frames of nackd's
    /// own wait for no client content here: this one has ended).
    fn forward_whole(&mut self, channel_id: u16, taking: &Taking) {
        if let Some(r) = self.channels.get(channel_id).renumber.as_mut() {
            r.forward();
        }
        self.emit_upstream(taking.method());
        self.emit_upstream(taking.content());
    }

    /// Taken publishes the check still holds when the session ends: the
    /// store never saw them. Those without confirms are lost (counted);
    /// a confirm publisher heard nothing and republishes.
    /// Declares the broker never answered (the session ended): their
    /// places under `[delayed] max_exchanges` are free again.
    pub(super) fn end_all_declaring(&mut self) {
        if let Some(state) = self.scope.as_ref() {
            for (name, n) in self.publishes.take_declaring() {
                for _ in 0..n {
                    state.shared.delayed.unreserve(&state.vhost, &name);
                }
            }
        }
    }

    pub(super) fn count_unparked_lost(&mut self) {
        let lost = self.publishes.unchecked_unconfirmed();
        if lost > 0 {
            tracing::error!(lost, "delayed publishes still waiting for the broker's check when the session ended: lost (their publishers used no confirms)");
            self.stats.delayed_lost.inc_by(lost as u64);
        }
    }

    /// Whether publishes to `exchange` are still delayed: it is, or a
    /// delayed declare of it waits for the broker.
    fn publishes_declaring(&self, exchange: &str) -> bool {
        self.publishes.declaring(exchange)
            || self
                .scope
                .as_ref()
                .is_some_and(|s| s.shared.delayed.is_delayed(&s.vhost, exchange))
    }

    /// The store answered for a publish nackd took.
    pub(super) fn on_publish_parked(&mut self, seq: u64, result: Result<u64, StoreError>) {
        let Some(taken) = self.publishes.remove(seq) else {
            return;
        };
        self.claims.answered(seq);
        let ((channel, epoch), tag) = (taken.channel(), taken.tag());
        match (result, taken.given_up()) {
            (Ok(id), true) => {
                // Its publisher was told "nack": the copy must not go.
                self.effects.push_back(Effect::Cancel(id));
            }
            (Err(_), true) => {}
            (Ok(id), false) => {
                debug!(id, ?tag, "delayed publish stored");
                self.stats.delayed_taken.inc();
                if let Some(tag) = tag {
                    self.answer_taken(channel, epoch, tag, true);
                }
            }
            (Err(e), false) => {
                self.stats.delayed_refused.inc();
                match tag {
                    Some(tag) => {
                        warn!(error = %e, "cannot store a delayed publish: the publisher gets a nack");
                        self.answer_taken(channel, epoch, tag, false);
                    }
                    // Early rather than nowhere: routed at once.
                    None if self.hand_over(taken) => {
                        warn!(error = %e, "cannot store a delayed publish (no confirms on its channel): it is routed at once");
                    }
                    None => {
                        tracing::error!(error = %e, "cannot store a delayed publish, and its channel is gone: the message is lost (its publisher used no confirms)");
                        self.stats.delayed_lost.inc();
                    }
                }
            }
        }
        self.release_if_settled();
    }

    /// The settle timeout gives up taken publishes among `seqs`: no longer
    /// waited for; on a confirm channel their publishers get a nack now,
    /// and their tickets say that a copy stored later is deleted by the
    /// engine, never fired, even after this session ended (one the engine
    /// stored first is not given up: its ack is on its way). The rest of
    /// `seqs` is left.
    pub(super) fn give_up_taken(&mut self, seqs: &mut std::collections::BTreeSet<u64>) {
        let publishes = &self.publishes;
        let mine: Vec<u64> = seqs
            .iter()
            .copied()
            .filter(|s| publishes.is_taken(*s))
            .collect();
        for seq in mine {
            seqs.remove(&seq);
            let unconfirmed = self.publishes.get(seq).is_some_and(|t| t.unconfirmed());
            if unconfirmed {
                // No confirms: its publisher was told nothing, and the
                // store's copy (when it answers) is the only one there is.
                self.claims.answered(seq);
                warn!("the store did not answer a delayed publish within the settle timeout: the close goes on, the publish is kept if the store takes it");
                continue;
            }
            if !self.claims.give_up(seq) {
                // Stored meanwhile: its answer (an ack) is on its way.
                continue;
            }
            let (channel, epoch, tag) = self.publishes.give_up(seq).expect("listed above");
            warn!("the store did not answer a delayed publish within the settle timeout: its publisher gets a nack");
            self.answer_taken(channel, epoch, tag.expect("a confirm channel's"), false);
        }
    }

    /// nackd's confirm of publish `tag` it took, to the publisher.
    fn answer_taken(&mut self, channel_id: u16, epoch: u64, tag: u64, ack: bool) {
        let Some(channel) = self.channels.get_epoch(channel_id, epoch) else {
            return;
        };
        if channel.closing {
            return;
        }
        let Some(confirm) = channel.renumber.as_mut().and_then(|r| r.answer(tag, ack)) else {
            return;
        };
        self.confirm_to_client(channel_id, confirm);
    }

    /// The broker's `basic.ack` / `basic.nack` on a channel nackd renumbers
    /// (`false`: not one, forward it as it is).
    pub(super) fn on_broker_confirm(
        &mut self,
        channel_id: u16,
        ack: bool,
        tag: u64,
        multiple: bool,
    ) -> bool {
        let Some(r) = self.channels.get(channel_id).renumber.as_mut() else {
            return false;
        };
        for confirm in r.broker(ack, tag, multiple) {
            self.confirm_to_client(channel_id, confirm);
        }
        true
    }

    fn confirm_to_client(&mut self, channel_id: u16, c: Confirm) {
        let frame = if c.ack {
            method::ack(channel_id, c.tag, c.multiple)
        } else {
            method::nack(channel_id, c.tag, c.multiple, false)
        };
        self.send_client_own(channel_id, frame);
    }

    /// A frame of nackd's own to the client, never inside a broker content
    /// in flight on its channel.
    fn send_client_own(&mut self, channel_id: u16, frame: Bytes) {
        if self.close.client_failed() {
            return;
        }
        let channel = self.channels.get(channel_id);
        if channel.delivering.in_flight() {
            channel.to_client_after.push(frame);
        } else {
            self.to_client.extend_from_slice(&frame);
        }
    }

    /// After a broker content frame: what waited for it to end goes.
    pub(super) fn flush_client_after(&mut self, channel_id: u16) {
        let channel = self.channels.get(channel_id);
        if channel.to_client_after.is_empty() || channel.delivering.in_flight() {
            return;
        }
        for frame in std::mem::take(&mut channel.to_client_after) {
            self.to_client.extend_from_slice(&frame);
        }
    }
}

/// The park of delayed publish `taking` (claim `key`) in `vhost`: held
/// for its `x-delay` (at most [`crate::delayed::MAX_DELAY_MS`]), then
/// published to its exchange.
fn delayed_park(key: ClaimKey, vhost: Arc<str>, taking: Taking) -> Park {
    let exchange = taking.exchange().clone();
    let (header, routing_key, body) = taking.into_message();
    let delay_ms = headers::delay_ms(&header)
        .expect("checked at the header")
        .min(crate::delayed::MAX_DELAY_MS);
    let header = headers::delivered_with_delay_spent(&header).map_or(header, Bytes::from);
    Park {
        key,
        vhost,
        queue: exchange.clone(),
        delay: std::time::Duration::from_millis(delay_ms),
        retry: 0,
        route: Route::Delayed {
            exchange: exchange.to_string(),
            routing_key,
        },
        on_return: None,
        header,
        body,
        ticket: Ticket::default(),
    }
}

/// A string argument's text.
fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

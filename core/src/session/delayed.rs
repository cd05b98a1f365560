//! Delayed publishes inside a session: nackd emulates the archived
//! delayed-message plugin's `x-delayed-message` exchanges.
//!
//! - `exchange.declare` of that type with `x-delayed-type = T` goes to the
//!   broker as type `T` (its arguments kept), and the exchange is
//!   remembered ([`crate::delayed::DelayedExchanges`], durable before the
//!   declare leaves); `exchange.delete` forgets it.
//! - A `basic.publish` to a delayed exchange is held until its content
//!   header says whether it carries `x-delay` > 0. If not, it goes to the
//!   broker as sent. If so, the whole message is taken: parked with
//!   [`Route::Delayed`] (the engine publishes it to the exchange when
//!   due), and on a confirm channel the publisher's `basic.ack` goes once
//!   it is stored (`basic.nack` if it cannot be); [`Renumber`] keeps the
//!   publisher's delivery tags its own while some publishes go to the
//!   broker and some to nackd.
//! - On a `tx.select` channel a delayed publish closes the connection
//!   with 540 NOT_IMPLEMENTED: nackd cannot make it part of a transaction.

use std::sync::Arc;

use amq_protocol::protocol::exchange;
use amq_protocol::protocol::AMQPClass;
use amq_protocol::types::AMQPValue;
use bytes::{Bytes, BytesMut};
use tracing::{debug, warn};

use super::capture::Reservation;
use super::confirms::{Confirm, Renumber};
use super::machine::{Effect, Session};
use super::peer::Fault;
use crate::delayed::{TYPE, TYPE_ARG};
use crate::held::{ClaimKey, Park, Route, StoreError};
use crate::protocol::content;
use crate::protocol::frame::{Frame, FrameError, FrameType};
use crate::protocol::headers;
use crate::protocol::method::{self, ids, MethodId};

/// A publish to a delayed exchange whose content is being read.
#[derive(Debug)]
pub struct Taking {
    exchange: Arc<str>,
    /// Its routing key; `None` when not UTF-8 (or the method does not
    /// decode): nackd cannot keep it, so it does not take it with a delay.
    routing_key: Option<String>,
    /// Its method frame, as the client sent it.
    method: Bytes,
    /// Its frames after the method, as sent (kept while it may still go
    /// to the broker at once).
    content: BytesMut,
    /// The content header payload, once come.
    header: Option<Bytes>,
    body: BytesMut,
    /// Its share of the capture budget, taken at the header for the size
    /// it announces (memory is bounded by configuration, not by clients).
    _reserved: Option<Reservation>,
    /// It did not fit in the budget: its content is read and dropped, its
    /// publisher gets a nack.
    over_budget: bool,
}

/// A publish nackd took, until the store answers.
#[derive(Debug)]
pub(super) struct Taken {
    channel: u16,
    epoch: u64,
    /// The publisher's tag, on a confirm channel.
    tag: Option<u64>,
    /// The whole publish as sent, on a channel without confirms: if it
    /// cannot be stored it goes to the broker at once rather than nowhere.
    raw: Option<Bytes>,
    /// The settle timeout gave it up (the publisher got a nack): a late
    /// stored copy is dropped.
    given_up: bool,
}

/// A delayed `exchange.declare` the broker has not answered yet.
#[derive(Debug)]
pub struct Declared {
    name: Arc<str>,
    /// The real type it set.
    kind: String,
    /// Its registry entry (real type) before this declare, if delayed.
    before: Option<String>,
}

impl Taken {
    /// The settle timeout gave it up: its publisher got a nack.
    pub(super) fn given_up(&self) -> bool {
        self.given_up
    }

    /// Taken on a channel without confirms: its publisher hears nothing.
    pub(super) fn unconfirmed(&self) -> bool {
        self.tag.is_none()
    }
}

impl Session {
    /// `exchange.declare` / `exchange.delete` of the client; `false`: do not
    /// forward it (nackd sent its own version). The registry follows the
    /// broker: a delayed declare is remembered before it leaves and
    /// forgotten again if the broker refuses it; a delete is acted on at
    /// its `delete-ok` (one refused, `if-unused` while bound, leaves the
    /// exchange delayed: its publishes must not start arriving early).
    pub(super) fn on_client_exchange(&mut self, channel_id: u16, class: &AMQPClass) -> bool {
        let Some(state) = self.scope.as_ref() else {
            return true;
        };
        let registry = state.shared.delayed.clone();
        let vhost = state.vhost.clone();
        match class {
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(d))
                if d.kind.as_str() == TYPE && !d.passive && registry.enabled() =>
            {
                let Some(real) = d.arguments.inner().get(TYPE_ARG).and_then(text) else {
                    // As the plugin's absence would: the broker refuses the type.
                    self.expect_declare_ok(channel_id, d.nowait, None);
                    return true;
                };
                let name = d.exchange.as_str();
                debug!(exchange = name, kind = %real, "delayed exchange declared");
                let before = registry.kind(&vhost, name);
                registry.declare(&vhost, name, &real);
                let declared = Declared {
                    name: Arc::from(name),
                    kind: real.clone(),
                    before,
                };
                self.expect_declare_ok(channel_id, d.nowait, Some(declared));
                let mut declare = d.clone();
                declare.kind = real.as_str().into();
                let class = AMQPClass::Exchange(exchange::AMQPMethod::Declare(declare));
                self.emit_upstream(&method::encode(channel_id, &class));
                false
            }
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(d)) => {
                self.expect_declare_ok(channel_id, d.nowait, None);
                true
            }
            AMQPClass::Exchange(exchange::AMQPMethod::Delete(d)) if d.nowait => {
                registry.delete(&vhost, d.exchange.as_str());
                true
            }
            AMQPClass::Exchange(exchange::AMQPMethod::Delete(d)) => {
                let name = Arc::from(d.exchange.as_str());
                self.channels
                    .get(channel_id)
                    .exchange_deletes
                    .push_back(name);
                true
            }
            _ => true,
        }
    }

    fn expect_declare_ok(&mut self, channel_id: u16, nowait: bool, declared: Option<Declared>) {
        if !nowait {
            let channel = self.channels.get(channel_id);
            channel.exchange_declares.push_back(declared);
        }
    }

    /// The broker's `exchange.declare-ok` / `delete-ok` on a channel.
    pub(super) fn on_broker_exchange_ok(&mut self, channel_id: u16, delete: bool) {
        let channel = self.channels.get(channel_id);
        if !delete {
            channel.exchange_declares.pop_front();
            return;
        }
        let Some(name) = channel.exchange_deletes.pop_front() else {
            return;
        };
        if let Some(state) = self.scope.as_ref() {
            state.shared.delayed.delete(&state.vhost, &name);
        }
    }

    /// The broker closes a channel: declares it has not answered were
    /// refused (or never done), deletes likewise.
    pub(super) fn on_broker_channel_close_exchanges(&mut self, channel_id: u16) {
        let channel = self.channels.get(channel_id);
        channel.exchange_deletes.clear();
        let refused = std::mem::take(&mut channel.exchange_declares);
        let Some(state) = self.scope.as_ref() else {
            return;
        };
        // The latest refused declare first: the entry before the earliest.
        for declared in refused.into_iter().flatten().rev() {
            let registry = &state.shared.delayed;
            debug!(exchange = %declared.name, "the broker refused a delayed declare");
            if registry.kind(&state.vhost, &declared.name) != Some(declared.kind) {
                // Another session declared it since (maybe the declare
                // the broker did take): its entry stays.
                continue;
            }
            match declared.before {
                Some(kind) => registry.declare(&state.vhost, &declared.name, &kind),
                None => registry.delete(&state.vhost, &declared.name),
            }
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
        if state.shared.delayed.none() {
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
        let delayed = exchange
            .filter(|x| !channel.closing && state.shared.delayed.is_delayed(&state.vhost, x));
        let Some(exchange) = delayed else {
            if let Some(r) = channel.renumber.as_mut() {
                r.forward();
            }
            return Ok(false);
        };
        channel.taking = Some(Box::new(Taking {
            exchange: Arc::from(exchange),
            routing_key: routing_key.map(str::to_string),
            method: frame.raw.clone(),
            content: BytesMut::new(),
            header: None,
            body: BytesMut::new(),
            _reserved: None,
            over_budget: false,
        }));
        Ok(true)
    }

    /// A content frame of a publish held by [`Session::hold_publish`].
    pub(super) fn take_content(&mut self, frame: &Frame) -> Result<(), Fault> {
        let channel_id = frame.channel;
        let channel = self.channels.get(channel_id);
        let Some(taking) = channel.taking.as_mut() else {
            return Ok(());
        };
        if !taking.over_budget {
            taking.content.extend_from_slice(&frame.raw);
        }
        match frame.kind {
            FrameType::Header => {
                let payload = frame.payload();
                if headers::delay_ms(&payload).is_none() {
                    // No delay: to the broker as sent, now.
                    let taking = channel.taking.take().expect("checked above");
                    self.forward_publish(channel_id, *taking);
                    return Ok(());
                }
                if channel.tx {
                    return Err(FrameError::NotImplemented(
                        "a delayed publish (x-delay) on a transactional channel",
                    ));
                }
                if taking.routing_key.is_none() {
                    return Err(FrameError::NotImplemented(
                        "a delayed publish (x-delay) whose routing key is not UTF-8",
                    ));
                }
                let size = usize::try_from(content::body_size(&payload)?)
                    .unwrap_or(usize::MAX)
                    .saturating_add(payload.len());
                let budget = self.scope.as_ref().map(|s| s.shared.budget.clone());
                match budget.and_then(|b| b.reserve(size)) {
                    Some(reserved) => taking._reserved = Some(reserved),
                    None if !channel.confirm => {
                        // Nackd cannot say no: routed at once, as when
                        // the store cannot take it.
                        warn!(exchange = %taking.exchange, size, "a delayed publish does not fit in the capture budget (no confirms on its channel): it is routed at once");
                        self.stats.delayed_refused.inc();
                        let taking = channel.taking.take().expect("checked above");
                        self.forward_publish(channel_id, *taking);
                        return Ok(());
                    }
                    None => {
                        warn!(exchange = %taking.exchange, size, "a delayed publish does not fit in the capture budget: the publisher gets a nack");
                        taking.over_budget = true;
                        taking.content = BytesMut::new();
                    }
                }
                taking.header = Some(payload);
            }
            FrameType::Body if taking.over_budget => {}
            FrameType::Body => taking.body.extend_from_slice(frame.payload_slice()),
            _ => {}
        }
        if !channel.publishing.in_flight() {
            let taking = channel.taking.take().expect("checked above");
            if channel.closing {
                // The broker closed the channel meanwhile: it would have
                // discarded this publish, and so does nackd.
                debug!(exchange = %taking.exchange, "a delayed publish on a channel the broker closed: dropped, as the broker drops it");
                self.flush_after_publish(channel_id);
                return Ok(());
            }
            self.park_publish(channel_id, *taking);
        }
        Ok(())
    }

    /// A held publish goes to the broker after all: its method, then what
    /// came of its content (the rest follows as usual).
    fn forward_publish(&mut self, channel_id: u16, taking: Taking) {
        let barrier_up = self.barrier_up;
        let channel = self.channels.get(channel_id);
        if let Some(r) = channel.renumber.as_mut() {
            r.forward();
        }
        channel.publish_behind_barrier = barrier_up;
        self.emit_upstream(&taking.method);
        self.emit_content(channel_id, &taking.content);
    }

    /// The whole delayed publish is here: parked, or (the engine takes
    /// nothing now) refused on a confirm channel, sent on at once on one
    /// without confirms.
    fn park_publish(&mut self, channel_id: u16, taking: Taking) {
        let Some(state) = self.scope.as_ref() else {
            return;
        };
        let header = taking
            .header
            .clone()
            .expect("a complete content has a header");
        let delay_ms = headers::delay_ms(&header)
            .expect("checked at the header")
            .min(crate::delayed::MAX_DELAY_MS);
        let header = headers::delivered_with_delay_spent(&header).map_or(header, Bytes::from);
        let vhost = state.vhost.clone();
        let ready = state.shared.ready.may_claim();
        let channel = self.channels.get(channel_id);
        let epoch = channel.epoch;
        let tag = channel.confirm.then(|| {
            let published = channel.published;
            channel
                .renumber
                .get_or_insert_with(|| Box::new(Renumber::new(published)))
                .take()
        });
        if taking.over_budget {
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
                    warn!(exchange = %taking.exchange, ?reason, "cannot hold a delayed publish now: the publisher gets a nack");
                    self.answer_taken(channel_id, epoch, tag, false);
                }
                None => {
                    warn!(exchange = %taking.exchange, ?reason, "cannot hold a delayed publish now (no confirms on its channel): it is routed at once");
                    self.forward_whole(channel_id, &taking);
                }
            }
            self.flush_after_publish(channel_id);
            return;
        }
        let raw = tag.is_none().then(|| {
            let mut raw = BytesMut::from(&taking.method[..]);
            raw.extend_from_slice(&taking.content);
            raw.freeze()
        });
        let seq = self.claims + 1;
        let key = ClaimKey {
            channel: channel_id,
            epoch,
            tag: tag.unwrap_or(0),
            seq,
        };
        let park = Park {
            key,
            vhost,
            queue: taking.exchange.clone(),
            delay: std::time::Duration::from_millis(delay_ms),
            retry: 0,
            route: Route::Delayed {
                exchange: taking.exchange.to_string(),
                routing_key: taking.routing_key.expect("checked at the header"),
            },
            on_return: None,
            header,
            body: taking.body.freeze(),
        };
        debug!(exchange = %taking.exchange, delay_ms, ?tag, "delayed publish taken; storing");
        self.effects.push_back(Effect::Park(park));
        self.claims = seq;
        self.unanswered.insert(seq, self.now);
        self.channels.get(channel_id).last_claim = seq;
        self.taken.insert(
            seq,
            Taken {
                channel: channel_id,
                epoch,
                tag,
                raw,
                given_up: false,
            },
        );
        self.flush_after_publish(channel_id);
    }

    /// Sends a whole publish nackd held to the broker (frames of nackd's
    /// own wait for no client content here: this one has ended).
    fn forward_whole(&mut self, channel_id: u16, taking: &Taking) {
        if let Some(r) = self.channels.get(channel_id).renumber.as_mut() {
            r.forward();
        }
        self.emit_upstream(&taking.method);
        self.emit_upstream(&taking.content);
    }

    /// Whether claim `seq` is a publish nackd took (answered here).
    pub(super) fn is_taken(&self, seq: u64) -> bool {
        self.taken.contains_key(&seq)
    }

    /// The store answered for a publish nackd took.
    pub(super) fn on_publish_parked(&mut self, seq: u64, result: Result<u64, StoreError>) {
        let Some(taken) = self.taken.remove(&seq) else {
            return;
        };
        self.unanswered.remove(&seq);
        match (result, taken.given_up) {
            (Ok(id), true) => {
                // Its publisher was told "nack": the copy must not go.
                self.effects.push_back(Effect::Cancel(id));
            }
            (Err(_), true) => {}
            (Ok(id), false) => {
                debug!(id, tag = ?taken.tag, "delayed publish stored");
                self.stats.delayed_taken.inc();
                if let Some(tag) = taken.tag {
                    self.answer_taken(taken.channel, taken.epoch, tag, true);
                }
            }
            (Err(e), false) => {
                self.stats.delayed_refused.inc();
                match (taken.tag, taken.raw) {
                    (Some(tag), _) => {
                        warn!(error = %e, "cannot store a delayed publish: the publisher gets a nack");
                        self.answer_taken(taken.channel, taken.epoch, tag, false);
                    }
                    (None, Some(raw)) => self.route_now(taken.channel, taken.epoch, raw, &e),
                    (None, None) => {}
                }
            }
        }
        self.release_if_settled();
    }

    /// A publish without confirms nackd could not store goes to the broker
    /// at once (early, rather than nowhere), unless its channel is gone.
    fn route_now(&mut self, channel_id: u16, epoch: u64, raw: Bytes, e: &StoreError) {
        let alive = self
            .channels
            .get_epoch(channel_id, epoch)
            .is_some_and(|c| !c.closing)
            && self.upstream_takes_acks();
        if alive {
            warn!(error = %e, "cannot store a delayed publish (no confirms on its channel): it is routed at once");
            let channel = self.channels.get(channel_id);
            if channel.confirm {
                // `confirm.select` came since: the broker numbers this
                // publish, its publisher does not. The next publish the
                // publisher numbers is one not yet accounted for.
                let next = channel.published + 1 - u64::from(channel.taking.is_some());
                channel
                    .renumber
                    .get_or_insert_with(|| Box::new(Renumber::new(next)))
                    .extra();
            }
            if channel.taking.is_some() {
                // Nothing of the publish nackd is reading went upstream:
                // this one goes first (after what waits behind a barrier),
                // as the broker numbers it.
                self.emit_upstream(&raw);
                return;
            }
            self.send_own(channel_id, raw, None);
        } else {
            tracing::error!(error = %e, "cannot store a delayed publish, and its channel is gone: the message is lost (its publisher used no confirms)");
            self.stats.delayed_lost.inc();
        }
    }

    /// The settle timeout gives up taken publishes among `seqs`: no longer
    /// waited for; on a confirm channel their publishers get a nack now
    /// (and a late stored copy is cancelled); the rest of `seqs` is left.
    pub(super) fn give_up_taken(&mut self, seqs: &mut std::collections::BTreeSet<u64>) {
        let mine: Vec<u64> = seqs.iter().copied().filter(|s| self.is_taken(*s)).collect();
        for seq in mine {
            seqs.remove(&seq);
            self.unanswered.remove(&seq);
            let taken = self.taken.get_mut(&seq).expect("listed above");
            let (channel, epoch, tag) = (taken.channel, taken.epoch, taken.tag);
            let Some(tag) = tag else {
                // No confirms: its publisher was told nothing, and the
                // store's copy (when it answers) is the only one there is.
                warn!("the store did not answer a delayed publish within the settle timeout: the close goes on, the publish is kept if the store takes it");
                continue;
            };
            taken.given_up = true;
            warn!("the store did not answer a delayed publish within the settle timeout: its publisher gets a nack");
            self.answer_taken(channel, epoch, tag, false);
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
        if self.close.client_failed {
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

/// A string argument's text.
fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

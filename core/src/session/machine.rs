//! The session's state machine: no socket, no clock, no channel to the
//! engine. Events go in with the time they happened; what to write to
//! each side, what to ask the engine and when to wake come out.
//!
//! [`Session`] is the coordinator, as quinn-proto's `Connection` is: its
//! one `impl` is in this file and dispatches each event to the parts that
//! own the state, each a type with private fields in a file of its own:
//!
//! - `channel`: each channel (consumers, deliveries, content in flight);
//! - `claims`: the claims, numbered once for nacks and delayed publishes,
//!   and those the store has not answered;
//! - `barrier`: client frames (and a close of nackd's own) held back until
//!   the claims before them are acked, and the broker's grace after;
//! - `deferrals`: nacks nackd would claim but cannot hold now, given back
//!   to the broker later at a bounded rate;
//! - `publishes`: delayed publishes being read and taken, and the delayed
//!   declares the broker has not answered; `check` the reserved channel
//!   that asks the broker's word on them, `confirms` their publisher's
//!   numbering;
//! - `close`: the closing handshake.
//!
//! The handlers below come in sections: frames (cutting and checking
//! them), client and broker methods, the nack path (claim, park, ack,
//! barrier), delayed publishes, deferred nacks, and the pair's end
//! (faults, sides gone, shutdown, timers).

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{basic, channel as amqp_channel, connection, exchange, tx, AMQPClass};
use amq_protocol::types::AMQPValue;
use bytes::{Bytes, BytesMut};
use tracing::{debug, info, warn, Span};

use super::barrier::Barrier;
use super::capture::{Captured, Capturing};
use super::channel::{Channels, Claimed, Delivery, HandBack};
use super::check::{Checks, Verdict};
use super::claims::{Claim, Claims, Plan};
use super::close::{Close, Origin};
use super::confirms::Confirm;
use super::consumer::ConsumerRef;
use super::deferrals::{Deferrals, FALLBACK_DELAY, MAX_DELAY, MIN_DELAY};
use super::peer::{Fault, Peer};
use super::publishes::{Declared, DelayedPublishes, Deleted, Taken, Taking};
use super::scope::{Interception, Scope};
use super::settle::{self, Settle};
use super::{Limits, HIGH_WATER, TICK};
use crate::delayed::{TYPE, TYPE_ARG};
use crate::held::{ClaimKey, Park, Parked, StoreError, Ticket};
use crate::protocol::content;
use crate::protocol::frame::{
    self, Frame, FrameDecoder, FrameError, FrameType, HANDSHAKE_FRAME_MAX,
};
use crate::protocol::headers::{self, Retry};
use crate::protocol::method::{self, ids, DeliverArgs, MethodId};
use crate::protocol::reply::ReplyCode;
use crate::stats::{Event, EventKind, PassReason, SessionStats};

/// What the session asks of the retry engine.
// Each effect is moved once, from the queue to the engine's channel.
#[allow(clippy::large_enum_variant)]
pub enum Effect {
    /// Store and hold a claimed message; answer with [`Session::handle_parked`].
    Park(Park),
    /// Drop a held message: the broker has the delivery back.
    Cancel(u64),
}

/// One client/broker pair, as a state machine.
pub struct Session {
    pub(super) limits: Limits,
    pub(super) handshake_deadline: Instant,
    /// The time of the event being handled.
    pub(super) now: Instant,
    /// When the core next checks heartbeats and deadlines.
    next_tick: Instant,
    pub(super) to_client: BytesMut,
    pub(super) to_upstream: BytesMut,
    pub(super) effects: VecDeque<Effect>,
    /// Both [`FrameDecoder::relaying`]: they take the frames RabbitMQ takes.
    pub(super) client_decoder: FrameDecoder,
    pub(super) upstream_decoder: FrameDecoder,
    pub(super) channels: Channels,
    pub(super) channel_max: u16,
    pub(super) heartbeat: Duration,
    pub(super) open: bool,
    pub(super) client_rx: Instant,
    pub(super) upstream_rx: Instant,
    /// When client frames (or nackd's heartbeat) last went toward the
    /// broker: a client whose frames nackd takes (delayed publishes) still
    /// owes the broker a heartbeat.
    pub(super) upstream_tx: Instant,
    pub(super) close: Close,
    /// What this session intercepts (none when no policy is configured).
    pub(super) scope: Option<Scope>,
    /// Client frames held back until the claims are acked (see `barrier`).
    pub(super) barrier: Barrier,
    /// The claims made, and those the store has not answered.
    pub(super) claims: Claims,
    /// Deliveries nackd could not hold, unacked until their nack (see `deferrals`).
    pub(super) deferrals: Deferrals,
    /// Delayed publishes taken and delayed declares waiting (see `publishes`).
    pub(super) publishes: DelayedPublishes,
    /// The broker's word on delayed publishes (the reserved channel).
    pub(super) checks: Checks,
    pub(super) stats: Arc<SessionStats>,
}

impl Session {
    /// A pair whose client sent its protocol header at `now` (and that has
    /// until `handshake_deadline` to open); it intercepts with `interception`.
    pub fn new(
        limits: Limits,
        handshake_deadline: Instant,
        now: Instant,
        stats: Arc<SessionStats>,
        interception: Option<&Arc<Interception>>,
    ) -> Self {
        Self {
            limits,
            handshake_deadline,
            now,
            next_tick: now + TICK,
            to_client: BytesMut::new(),
            to_upstream: BytesMut::new(),
            effects: VecDeque::new(),
            client_decoder: FrameDecoder::relaying(HANDSHAKE_FRAME_MAX),
            upstream_decoder: FrameDecoder::relaying(HANDSHAKE_FRAME_MAX),
            channels: Channels::default(),
            channel_max: 0,
            heartbeat: Duration::ZERO,
            open: false,
            client_rx: now,
            upstream_rx: now,
            upstream_tx: now,
            close: Close::default(),
            scope: interception.map(|shared| Scope::new(shared.clone())),
            barrier: Barrier::default(),
            claims: Claims::default(),
            deferrals: Deferrals::new(stats.deferred_now.clone()),
            publishes: DelayedPublishes::default(),
            checks: Checks::default(),
            stats,
        }
    }

    /// `peer` sent the bytes in `input`: every whole frame is handled and
    /// cut out of it (a partial frame stays for the next read).
    pub fn handle_bytes(&mut self, peer: Peer, input: &mut BytesMut, now: Instant) {
        self.now = now;
        match peer {
            Peer::Client => self.client_rx = now,
            Peer::Upstream => self.upstream_rx = now,
        }
        self.on_bytes(peer, input);
    }

    /// The engine answered a park.
    pub fn handle_parked(&mut self, parked: Parked, now: Instant) {
        self.now = now;
        self.on_parked(parked);
    }

    /// `peer`'s socket ended (`None`: at its end of stream, or it went
    /// silent).
    pub fn handle_gone(&mut self, peer: Peer, error: Option<std::io::Error>, now: Instant) {
        self.now = now;
        match peer {
            Peer::Client => self.on_client_gone(error),
            Peer::Upstream => self.on_upstream_gone(error),
        }
    }

    /// nackd shuts down: close both sides (after the acks nackd owes).
    pub fn handle_force(&mut self, now: Instant) {
        self.now = now;
        self.on_force();
    }

    /// The time [`Session::poll_timeout`] gave has come.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.now = now;
        self.barrier.on_timeout(now);
        if now >= self.next_tick {
            self.next_tick = now + TICK;
        }
        self.on_tick();
    }

    /// When the core wants [`Session::handle_timeout`] called.
    pub fn poll_timeout(&self) -> Instant {
        [self.barrier.wake(), self.deferrals.next_wake()]
            .into_iter()
            .flatten()
            .fold(self.next_tick, Instant::min)
    }

    /// The next thing to ask of the retry engine.
    pub fn poll_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    /// What to write to the client and to the broker. The caller takes
    /// bytes from the front as it writes them.
    pub fn transmit(&mut self) -> (&mut BytesMut, &mut BytesMut) {
        (&mut self.to_client, &mut self.to_upstream)
    }

    /// Whether `peer`'s socket is to be read now: it is open, and the
    /// other side's write buffer is below [`HIGH_WATER`].
    pub fn may_read(&self, peer: Peer) -> bool {
        match peer {
            Peer::Client => {
                !self.close.client_gone()
                    && self.to_upstream.len() + self.barrier.len() < HIGH_WATER
            }
            Peer::Upstream => {
                // Once the client is gone nothing queued for it is written.
                !self.close.upstream_gone()
                    && (self.close.client_gone() || self.to_client.len() < HIGH_WATER)
            }
        }
    }

    /// Whether `peer`'s socket is still open to writes.
    pub fn may_write(&self, peer: Peer) -> bool {
        match peer {
            Peer::Client => !self.close.client_gone(),
            Peer::Upstream => !self.close.upstream_gone(),
        }
    }

    /// Whether shutdown already asked this session to close.
    pub fn forced(&self) -> bool {
        self.close.forced()
    }

    /// Whether the pair is done (both sides closed, or out of time).
    pub fn is_finished(&self, now: Instant) -> bool {
        self.close.finished(now)
    }

    /// The session is over; `late` are the engine's answers that came
    /// after it. Stored copies nackd never acked are the broker's again
    /// (it requeues their deliveries): they are cancelled.
    pub fn end(&mut self, late: impl IntoIterator<Item = Parked>) {
        self.count_unparked_lost();
        self.end_all_declaring();
        // A delayed publish stays held: its publisher sent it (unless the
        // publisher was told "nack").
        let taken = self.publishes.take_all();
        let kept = |p: &Parked| taken.get(&p.key.seq).is_some_and(|t| !t.given_up());
        let late: Vec<Parked> = late.into_iter().collect();
        for p in &late {
            if let (Some(t), Err(e)) = (taken.get(&p.key.seq), &p.result) {
                if t.unconfirmed() {
                    // Its publisher used no confirms and its connection is
                    // gone: nothing can route it now.
                    tracing::error!(error = %e, "cannot store a delayed publish, and its session has ended: the message is lost (its publisher used no confirms)");
                    self.stats.delayed_lost.inc();
                }
            }
        }
        let mut cancel: Vec<u64> = late
            .into_iter()
            .filter(|p| !kept(p))
            .filter_map(|p| p.result.ok())
            .collect();
        // Acks that waited for a client publish that never ended.
        cancel.extend(self.channels.take_all_after_publish());
        for id in cancel {
            tracing::debug!(id, "session ended before the ack: cancelling the hold");
            self.effects.push_back(Effect::Cancel(id));
        }
    }

    /// A short word for the log line at the end.
    pub fn close_reason(&self) -> &'static str {
        self.close.reason()
    }

    // --- Frames: cutting them out of what a side sent, checking them against
    // their channel's content state, decoding the methods nackd needs.

    /// Handles every whole frame `peer` sent in `input`; counts them once
    /// per read.
    pub(super) fn on_bytes(&mut self, peer: Peer, input: &mut BytesMut) {
        let mut frames = 0;
        let fault = loop {
            let next = match peer {
                Peer::Client => self.client_decoder.decode(input),
                Peer::Upstream => self.upstream_decoder.decode(input),
            };
            let frame = match next {
                Ok(Some(frame)) => frame,
                Ok(None) => break None,
                Err(fault) => break Some(fault),
            };
            frames += 1;
            let handled = match peer {
                Peer::Client => self.on_client_frame(frame),
                Peer::Upstream => self.on_upstream_frame(frame),
            };
            if let Err(fault) = handled {
                break Some(fault);
            }
        };
        match peer {
            Peer::Client => {
                self.stats.frames.to_upstream.inc_by(frames);
                if let Some(fault) = fault {
                    // The rest of what the client sent is not read.
                    input.clear();
                    if self.close.client_failed() {
                        // Answered with connection.close already; what
                        // follows may not even be frames (the rest of an
                        // oversized body): one close, one warning.
                        debug!(error = %fault, "client bytes after its protocol error dropped");
                    } else {
                        self.on_client_fault(fault);
                    }
                }
            }
            Peer::Upstream => {
                self.stats.frames.to_client.inc_by(frames);
                if let Some(fault) = fault {
                    self.on_upstream_fault(fault);
                }
            }
        }
    }

    /// The log span of `channel` (none for channel 0).
    pub(super) fn channel_span(&mut self, channel: u16) -> Span {
        match channel {
            0 => Span::none(),
            id => self.channels.get(id).span(),
        }
    }

    /// Checks `frame` against the content state of the direction `peer`
    /// sends on, and decodes its method when nackd must understand it.
    pub(super) fn inspect(
        &mut self,
        peer: Peer,
        frame: &Frame,
    ) -> Result<Option<AMQPClass>, Fault> {
        match frame.kind {
            FrameType::Heartbeat => Ok(None),
            FrameType::Method => {
                let payload = frame.payload_slice();
                let id = MethodId::peek(payload)?;
                if frame.channel != 0 {
                    self.channels
                        .get(frame.channel)
                        .advance(peer, frame, Some(id))?;
                }
                if id == ids::BASIC_DELIVER && peer == Peer::Upstream && frame.channel != 0 {
                    // Every delivery: read in place, no allocation.
                    let deliver = method::peek_deliver(payload)?;
                    self.on_deliver(frame.channel, &deliver);
                    return Ok(None);
                }
                method::decode(payload)
            }
            FrameType::Header | FrameType::Body if frame.channel == 0 => {
                Err(FrameError::Unexpected("content frame on channel 0"))
            }
            FrameType::Header | FrameType::Body => {
                self.channels
                    .get(frame.channel)
                    .advance(peer, frame, None)?;
                Ok(None)
            }
        }
    }

    // --- Client frames: tracking, settles, the handshake's tune-ok.

    pub(super) fn on_client_frame(&mut self, frame: Frame) -> Result<(), Fault> {
        // Checked before the channel is looked up: a channel the client may
        // not use is never tracked (its span would create it).
        if self.close.client_failed() {
            return self.on_failed_client_frame(&frame);
        }
        if self.channel_max != 0 && frame.channel > self.channel_max {
            return Err(FrameError::ChannelOutOfRange {
                channel: frame.channel,
                max: self.channel_max,
            });
        }
        let span = self.channel_span(frame.channel);
        let _in_channel = span.enter();
        // Once nackd closed upstream the broker ignores the rest: only the
        // client's close-ok still matters.
        let upstream_closed = self.close.awaiting_upstream() == Some(Origin::Nackd);
        if let Some(class) = self.inspect(Peer::Client, &frame)? {
            let close_ok = matches!(
                class,
                AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))
            );
            if (upstream_closed && !close_ok) || !self.on_client_method(frame.channel, &class)? {
                return Ok(());
            }
        }
        if upstream_closed {
            return Ok(());
        }
        match frame.kind {
            // Heartbeats mean nothing in order: never held back.
            FrameType::Heartbeat => {
                self.upstream_tx = self.now;
                self.to_upstream.extend_from_slice(&frame.raw)
            }
            FrameType::Method if frame.channel != 0 => {
                if self.scope.is_some() && self.hold_publish(&frame)? {
                    return Ok(());
                }
                let barrier_up = self.barrier.is_up();
                let channel = self.channels.get(frame.channel);
                if channel.publishing().in_flight() {
                    // A publish begins: where its method goes, its content follows.
                    channel.publish_begins(barrier_up);
                }
                self.emit_upstream(&frame.raw);
            }
            FrameType::Header | FrameType::Body => {
                if self.channels.get(frame.channel).is_taking() {
                    return self.take_content(&frame);
                }
                self.emit_content(frame.channel, &frame.raw)
            }
            _ => self.emit_upstream(&frame.raw),
        }
        Ok(())
    }

    /// A content frame of a client publish follows its method: behind the
    /// hold if the method is there, else straight upstream (a hold begun
    /// mid-publish must not split a content). An ack that waited for this
    /// publish to end goes right after its last frame.
    pub(super) fn emit_content(&mut self, channel_id: u16, raw: &[u8]) {
        let channel = self.channels.get(channel_id);
        if channel.publish_behind_barrier() && self.barrier.hold(raw) {
            if !channel.publishing().in_flight() {
                // Publishes nackd gave back follow it, behind the barrier.
                for raw in channel.take_handed_over() {
                    self.barrier.hold(&raw);
                }
            }
            return;
        }
        self.upstream_tx = self.now;
        self.to_upstream.extend_from_slice(raw);
        self.flush_after_publish(channel_id);
    }

    /// Once the client's publish on `channel_id` has ended, nackd's own
    /// frames that waited for it go upstream.
    pub(super) fn flush_after_publish(&mut self, channel_id: u16) {
        let channel = self.channels.get(channel_id);
        if !channel.publishing().in_flight() && channel.has_handed_over() {
            for raw in channel.take_handed_over() {
                self.emit_upstream(&raw);
            }
        }
        let channel = self.channels.get(channel_id);
        if !channel.publishing().in_flight() && channel.waits_for_publish() {
            let mut acks = false;
            for (frame, held) in channel.take_after_publish() {
                self.to_upstream.extend_from_slice(&frame);
                acks |= held.is_some();
            }
            if !acks {
                // Deferred nacks only: nothing the broker must apply first.
                return;
            }
            // The broker's time to apply these acks runs from now.
            self.barrier.acked(self.now, None);
        }
    }

    /// Observes a decoded client method; `false` means "do not forward it".
    pub(super) fn on_client_method(
        &mut self,
        channel_id: u16,
        class: &AMQPClass,
    ) -> Result<bool, Fault> {
        if channel_id != 0 {
            self.on_client_channel_end(channel_id, class);
        }
        match class {
            AMQPClass::Exchange(_) if channel_id != 0 => {
                return self.on_client_exchange(channel_id, class);
            }
            AMQPClass::Connection(method) => return Ok(self.on_client_connection_method(method)),
            AMQPClass::Basic(basic::AMQPMethod::Ack(a)) if channel_id != 0 => {
                return Ok(self.on_settle(channel_id, Settle::Ack, a.delivery_tag, a.multiple));
            }
            AMQPClass::Basic(basic::AMQPMethod::Nack(n)) if channel_id != 0 => {
                let settle = Settle::Nack(n.requeue);
                return Ok(self.on_settle(channel_id, settle, n.delivery_tag, n.multiple));
            }
            AMQPClass::Basic(basic::AMQPMethod::Reject(r)) if channel_id != 0 => {
                let settle = Settle::Reject(r.requeue);
                return Ok(self.on_settle(channel_id, settle, r.delivery_tag, false));
            }
            AMQPClass::Channel(amqp_channel::AMQPMethod::Close(_))
            | AMQPClass::Basic(
                basic::AMQPMethod::Recover(_) | basic::AMQPMethod::RecoverAsync(_),
            )
            | AMQPClass::Tx(tx::AMQPMethod::Select(_))
                if channel_id != 0 && self.must_wait() =>
            {
                // The broker would requeue what nackd holds (or make its ack
                // part of a transaction): ack it first.
                self.raise_channel_barrier(channel_id);
                let (barrier_up, at) = (self.barrier.is_up(), self.barrier.len());
                let channel = self.channels.get(channel_id);
                if barrier_up && !matches!(class, AMQPClass::Basic(_)) {
                    // The close or tx.select goes behind the barrier next.
                    channel.end_behind_at(at);
                }
                channel.on_client_method(class);
            }
            AMQPClass::Channel(amqp_channel::AMQPMethod::CloseOk(_)) => {
                self.on_broker_channel_close_exchanges(channel_id);
                self.channels.remove(channel_id);
            }
            _ if channel_id != 0 => self.channels.get(channel_id).on_client_method(class),
            _ => {}
        }
        Ok(true)
    }

    /// A close or recover of the client's channel makes the broker requeue
    /// its unacked deliveries: its deferred tags are forgotten. A
    /// `tx.select` would make their nacks part of a transaction: they go
    /// now, ahead of it.
    fn on_client_channel_end(&mut self, channel_id: u16, class: &AMQPClass) {
        if let AMQPClass::Channel(amqp_channel::AMQPMethod::Close(_)) = class {
            self.channels.get(channel_id).on_client_close();
        }
        match class {
            AMQPClass::Channel(
                amqp_channel::AMQPMethod::Close(_) | amqp_channel::AMQPMethod::CloseOk(_),
            )
            | AMQPClass::Basic(
                basic::AMQPMethod::Recover(_) | basic::AMQPMethod::RecoverAsync(_),
            ) => self.forget_deferred(channel_id),
            AMQPClass::Tx(tx::AMQPMethod::Select(_)) => self.requeue_deferred_now(channel_id),
            _ => {}
        }
    }

    /// A `connection.*` method of the client; `false`: do not forward it.
    fn on_client_connection_method(&mut self, method: &connection::AMQPMethod) -> bool {
        match method {
            connection::AMQPMethod::StartOk(ok) => {
                Span::current().record("user", tracing::field::display(sasl_user(ok)));
            }
            connection::AMQPMethod::TuneOk(tune) => return self.on_tune_ok(tune),
            connection::AMQPMethod::Open(open) => {
                Span::current().record("vhost", open.virtual_host.as_str());
                if let Some(state) = self.scope.as_mut() {
                    state.open(open.virtual_host.as_str());
                }
            }
            connection::AMQPMethod::Close(c) => {
                debug!(
                    code = c.reply_code,
                    text = c.reply_text.as_str(),
                    "client closes the connection"
                );
                // The broker requeues every unacked delivery with the
                // connection: nothing deferred is nacked any more.
                self.forget_all_deferred();
                // Asked before the close is recorded: once it is, and not
                // behind a barrier, acks no longer count.
                let wait = self.must_wait();
                self.close
                    .expect_upstream_close_ok(Origin::Client, self.now);
                if wait {
                    self.raise_barrier();
                }
            }
            connection::AMQPMethod::CloseOk(_) => {
                return self.close.client_close_ok() == Some(Origin::Broker);
            }
            _ => {}
        }
        true
    }

    /// The client's `tune-ok`; `false`: nackd sent the broker its own
    /// (one channel more: the one it reserves, see `check`).
    pub(super) fn on_tune_ok(&mut self, tune: &connection::TuneOk) -> bool {
        let frame_max = match tune.frame_max {
            0 => self.limits.max_frame,
            n => n.min(self.limits.max_frame),
        };
        self.client_decoder.set_frame_max(frame_max);
        self.upstream_decoder.set_frame_max(frame_max);
        self.heartbeat = Duration::from_secs(tune.heartbeat.into());
        let (client, upstream) = match self.reserves_channel() {
            true => self.checks.tuned(tune.channel_max),
            false => (tune.channel_max, tune.channel_max),
        };
        self.channel_max = client;
        debug!(
            frame_max,
            channel_max = client,
            reserved = ?self.checks.channel(),
            heartbeat = tune.heartbeat,
            "tuned"
        );
        if upstream == tune.channel_max {
            return true;
        }
        let mut ok = tune.clone();
        ok.channel_max = upstream;
        let ok = AMQPClass::Connection(connection::AMQPMethod::TuneOk(ok));
        self.emit_upstream(&method::encode(0, &ok));
        false
    }

    /// After a client fault only the close handshake matters.
    pub(super) fn on_failed_client_frame(&mut self, frame: &Frame) -> Result<(), Fault> {
        if frame.kind != FrameType::Method || frame.channel != 0 {
            return Ok(());
        }
        match MethodId::peek(&frame.raw[frame::HEADER_LEN..])? {
            ids::CONNECTION_CLOSE_OK => {
                self.close.client_close_ok();
            }
            ids::CONNECTION_CLOSE => {
                if self.close.answer_failed_client() {
                    self.to_client
                        .extend_from_slice(&method::connection_close_ok());
                }
                self.close.client_close_ok();
            }
            _ => {}
        }
        Ok(())
    }

    // --- Broker frames: tracking, capture of deliveries, tune capping.

    /// A `basic.deliver` on channel `channel_id` (read in place by
    /// `inspect`): tracked, and captured if its queue is intercepted.
    pub(super) fn on_deliver(&mut self, channel_id: u16, d: &DeliverArgs<'_>) {
        self.channels
            .get(channel_id)
            .on_deliver(d.consumer_tag, d.delivery_tag);
        self.start_capture(channel_id, d.delivery_tag, d.exchange, d.routing_key);
    }

    pub(super) fn on_upstream_frame(&mut self, frame: Frame) -> Result<(), Fault> {
        if frame.channel != 0 && self.checks.channel() == Some(frame.channel) {
            return self.on_check_frame(&frame);
        }
        let span = self.channel_span(frame.channel);
        let _in_channel = span.enter();
        if let Some(class) = self.inspect(Peer::Upstream, &frame)? {
            if !self.on_upstream_method(frame.channel, &class) {
                return Ok(());
            }
        }
        let content = matches!(frame.kind, FrameType::Header | FrameType::Body);
        if content {
            self.capture_content(&frame);
        }
        if !self.close.client_failed() {
            self.to_client.extend_from_slice(&frame.raw);
        }
        if content {
            self.flush_client_after(frame.channel);
        }
        Ok(())
    }

    /// Observes a decoded broker method; `false` means "do not forward it".
    pub(super) fn on_upstream_method(&mut self, channel_id: u16, class: &AMQPClass) -> bool {
        match class {
            AMQPClass::Connection(method) => return self.on_broker_connection_method(method),
            AMQPClass::Channel(amqp_channel::AMQPMethod::CloseOk(_)) => {
                self.forget_deferred(channel_id);
                self.on_broker_channel_close_exchanges(channel_id);
                self.channels.remove(channel_id);
            }
            AMQPClass::Channel(amqp_channel::AMQPMethod::Close(_)) if channel_id != 0 => {
                self.on_broker_channel_close_exchanges(channel_id);
                // The broker requeues the channel's unacked deliveries.
                self.forget_deferred(channel_id);
                self.channels.get(channel_id).on_broker_close();
                self.cancel_after_publish(channel_id);
            }
            AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_)) if channel_id != 0 => {
                return self.on_broker_exchange_ok(channel_id, false);
            }
            AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(_)) if channel_id != 0 => {
                return self.on_broker_exchange_ok(channel_id, true);
            }
            AMQPClass::Basic(basic::AMQPMethod::Ack(a)) if channel_id != 0 => {
                return !self.on_broker_confirm(channel_id, true, a.delivery_tag, a.multiple);
            }
            AMQPClass::Basic(basic::AMQPMethod::Nack(n)) if channel_id != 0 => {
                return !self.on_broker_confirm(channel_id, false, n.delivery_tag, n.multiple);
            }
            AMQPClass::Basic(basic::AMQPMethod::Cancel(c)) if channel_id != 0 => {
                self.on_broker_cancel(channel_id, c.consumer_tag.as_str());
            }
            AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) if channel_id != 0 => {
                self.channels.get(channel_id).on_broker_method(class);
                self.start_capture(
                    channel_id,
                    ok.delivery_tag,
                    ok.exchange.as_str(),
                    ok.routing_key.as_str(),
                );
            }
            _ if channel_id != 0 => self.channels.get(channel_id).on_broker_method(class),
            _ => {}
        }
        true
    }

    /// A `connection.*` method of the broker; `false`: do not forward it.
    fn on_broker_connection_method(&mut self, method: &connection::AMQPMethod) -> bool {
        match method {
            connection::AMQPMethod::Tune(tune)
                if tune.frame_max == 0
                    || tune.frame_max > self.limits.max_frame
                    || self.reserves_channel() =>
            {
                // Offer the client no more than nackd accepts, and one
                // channel fewer when nackd reserves one (`check`).
                let mut capped = tune.clone();
                capped.frame_max = match tune.frame_max {
                    0 => self.limits.max_frame,
                    n => n.min(self.limits.max_frame),
                };
                if self.reserves_channel() {
                    capped.channel_max = self.checks.offer(tune.channel_max);
                }
                let tune = AMQPClass::Connection(connection::AMQPMethod::Tune(capped));
                self.to_client.extend_from_slice(&method::encode(0, &tune));
                return false;
            }
            connection::AMQPMethod::OpenOk(_) => {
                self.open = true;
                info!("connection open");
            }
            connection::AMQPMethod::Close(c) => {
                info!(
                    code = c.reply_code,
                    text = c.reply_text.as_str(),
                    "broker closes the connection"
                );
                self.close.expect_client_close_ok(Origin::Broker, self.now);
                self.close.on_broker_close();
                self.forget_all_deferred();
                // Nothing held back can still be acked: let it go.
                self.release_if_settled();
            }
            connection::AMQPMethod::CloseOk(_) => {
                return self.close.upstream_close_ok() == Some(Origin::Client);
            }
            _ => {}
        }
        true
    }

    // --- The nack path: capture deliveries of intercepted queues, claim their
    // nacks, ack them upstream once stored, keep every other settle meaning
    // what the client meant; the barrier that holds client frames behind
    // the claims.

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
        if channel.tx() {
            return;
        }
        let Some(delivery) = channel.delivery_mut(tag) else {
            return;
        }; // no-ack: never captured
        let queue = delivery.queue.clone();
        if let Some(policy) = state.policy(&queue) {
            self.channels.get(channel_id).start_capture(Capturing::new(
                tag,
                exchange,
                routing_key,
                policy,
            ));
        }
    }

    /// A content frame from the broker: feed the capture of its channel.
    pub(super) fn capture_content(&mut self, frame: &Frame) {
        if let Some(state) = self.scope.as_ref() {
            let budget = &state.shared.budget;
            self.channels
                .get(frame.channel)
                .capture_content(frame, budget);
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
        let claimed_again = intercepting && !multiple && channel.is_claimed(tag);
        if claimed_again {
            // A second settle of a claimed tag: the broker gets it as sent
            // and nackd steps back (no ack of its own, no held copy).
            channel.settle_again(tag);
        }
        let again = claimed_again || deferred_again;
        if !intercepting || channel.tx() || again {
            // Not ours (or a second settle of a held tag: the broker answers it).
            let reason = match (intercepting, channel.tx()) {
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
        let lowest_claimed = self.channels.get(channel_id).lowest_claimed();
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
        channel.claim(tag, claimed);
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
        let vhost = state.vhost().to_string();
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
            epoch: self.channels.get(channel_id).epoch(),
            tag,
            seq: self.claims.next(),
        };
        let deferral = plan.deferral();
        let ticket = Ticket::default();
        let park = Park {
            key,
            vhost: state.vhost().clone(),
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
            .is_some_and(|c| c.barrier_raised());
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
            .filter(|c| !c.closing() && upstream_alive)
            .and_then(|c| c.take_claim(key.tag))
            .map(|c| (c.delay, c.from));
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
                self.defer(key.channel, key.tag, e.deferral(), delay, from);
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
            channel.publishing().in_flight() && !(barrier_up && channel.publish_behind_barrier());
        if content_open {
            channel.wait_for_publish(frame, held);
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
            c.drop_claim(key.tag);
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
        let last = self.channels.get(channel_id).raise_barrier();
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
        self.channels.get(channel_id).take_handed_over();
        let waiting = self.channels.get(channel_id).take_after_publish();
        for id in waiting.into_iter().filter_map(|(_, id)| id) {
            self.effects.push_back(Effect::Cancel(id));
        }
    }

    // --- Delayed publishes (see `publishes`): declares and deletes of delayed
    // exchanges, publishes taken, the broker's check, the publisher's confirms.

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
        let vhost = state.vhost().clone();
        if self.channels.get(channel_id).closing() {
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
                // Unsynced, another instance may have declared it delayed.
                let delayed = !registry.synced() || self.publishes_declaring(&name);
                let channel = self.channels.get(channel_id);
                if !delayed {
                    if !d.nowait {
                        channel.expect_delete_ok(None);
                    }
                    return Ok(true);
                }
                channel.expect_delete_ok(Some(Deleted::new(name, d.nowait)));
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
            self.channels.get(channel_id).expect_declare_ok(declared);
        }
    }

    /// The broker's `exchange.declare-ok` / `delete-ok` on a channel: a
    /// delayed declare or delete counts now. `false`: the client sent
    /// `nowait`, the answer is nackd's.
    pub(super) fn on_broker_exchange_ok(&mut self, channel_id: u16, delete: bool) -> bool {
        let channel = self.channels.get(channel_id);
        let (name, swallow) = match delete {
            false => match channel.declare_ok() {
                Some(Some(declared)) => {
                    let (name, kind, swallow) = declared.parts();
                    if let Some(state) = self.scope.as_ref() {
                        state.shared.delayed.declare(state.vhost(), name, kind);
                    }
                    self.end_declaring(name);
                    (name.clone(), swallow)
                }
                _ => return true,
            },
            true => match channel.delete_ok() {
                Some(Some(deleted)) => {
                    let (name, swallow) = deleted.parts();
                    if let Some(state) = self.scope.as_ref() {
                        state.shared.delayed.delete(state.vhost(), name);
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
            state.shared.delayed.unreserve(state.vhost(), name);
        }
        self.publishes.declare_answered(name);
    }

    /// The broker closes a channel: declares and deletes it has not
    /// answered were refused (or never done): the delayed exchanges stay
    /// as they were.
    pub(super) fn on_broker_channel_close_exchanges(&mut self, channel_id: u16) {
        let channel = self.channels.get(channel_id);
        let (declares, deletes) = channel.take_exchange_changes();
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
        channel.count_publish();
        if state.shared.delayed.none() && self.publishes.none_declaring() {
            // The pass-through path: no exchange is delayed, nothing to read.
            channel.forward_publish();
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
        // still sends: nackd must not deliver it later either. While the
        // shared set is not synced, any named exchange may be delayed:
        // its header says whether it asks for a delay.
        let publishes = &self.publishes;
        let registry = &state.shared.delayed;
        let delayed = exchange.filter(|x| {
            !channel.closing()
                && !channel.refused()
                && (registry.is_delayed(state.vhost(), x)
                    || publishes.declaring(x)
                    || (!registry.synced() && !x.is_empty()))
        });
        let Some(exchange) = delayed else {
            channel.forward_publish();
            return Ok(false);
        };
        channel.start_taking(Box::new(Taking::new(
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
        let Some(taking) = channel.taking_mut() else {
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
        if !channel.publishing().in_flight() {
            let taking = channel.take_taking().expect("checked above");
            if channel.closing() {
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
        let (tx, confirm) = (channel.tx(), channel.confirm());
        let taking = channel.taking_mut().expect("a publish is being taken");
        if headers::delay_ms(&payload).is_none() {
            // No delay: to the broker as sent, now.
            let taking = channel.take_taking().expect("checked above");
            self.forward_publish(channel_id, *taking);
            return Ok(false);
        }
        let exchange = taking.exchange().clone();
        if !self.publishes_declaring(&exchange) {
            // Taken only because the set was not synced (see hold_publish).
            if self.delayed_synced() {
                // It is now, and the exchange is not delayed: as sent.
                let taking = self.channels.get(channel_id).take_taking();
                self.forward_publish(channel_id, *taking.expect("checked above"));
                return Ok(false);
            }
            if !confirm {
                self.stats.delayed_refused.inc();
                // No nack to give: refused with the connection, never
                // routed at once (its delay would be lost).
                warn!(%exchange, "a delayed publish (x-delay) to an exchange nackd does not know as delayed, while its registry of delayed exchanges is not read: the connection is closed (506)");
                return Err(FrameError::Unavailable(
                    "a delayed publish (x-delay) while nackd's registry of delayed exchanges is not read; publish again later",
                ));
            }
            // Nacked once its content is here, as a publish over the
            // capture budget is (park_publish): its body is not kept.
            warn!(%exchange, "a delayed publish (x-delay) to an exchange nackd does not know as delayed, while its registry of delayed exchanges is not read: the publisher gets a nack");
            let channel = self.channels.get(channel_id);
            let taking = channel.taking_mut().expect("a publish is being taken");
            taking.on_header(payload, None);
            return Ok(true);
        }
        let channel = self.channels.get(channel_id);
        let taking = channel.taking_mut().expect("a publish is being taken");
        if tx {
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
        if reserved.is_none() && !confirm {
            // Nackd cannot say no: routed at once, as when the store
            // cannot take it.
            warn!(exchange = %taking.exchange(), size, "a delayed publish does not fit in the capture budget (no confirms on its channel): it is routed at once");
            self.stats.delayed_refused.inc();
            let taking = channel.take_taking().expect("checked above");
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
        channel.forward_publish();
        channel.publish_begins(barrier_up);
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
        let vhost = state.vhost().clone();
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
        let park = taking.into_park(key, vhost);
        if self.ask_check(key, &raw, &exchange, tag) {
            debug!(exchange = %exchange, delay_ms = park.delay.as_millis() as u64, ?tag, "delayed publish taken; asking the broker");
            self.claims.made(self.now, park.ticket.clone());
            self.channels.get(channel_id).took_publish(key.seq);
            let taken = Taken::new((channel_id, epoch), exchange, tag, raw, park);
            self.publishes.insert(key.seq, taken);
        }
        self.flush_after_publish(channel_id);
    }

    /// The opening of channel `channel_id`, and on a confirm channel the
    /// publisher's tag of the publish nackd takes now.
    fn publisher_tag(&mut self, channel_id: u16) -> (u64, Option<u64>) {
        let channel = self.channels.get(channel_id);
        let tag = channel.confirm().then(|| {
            let published = channel.published();
            channel.renumber_from(published).take()
        });
        (channel.epoch(), tag)
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
            .is_some_and(|c| c.refused());
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
                    c.on_refused_publish();
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
        let barrier_up = self.barrier.is_up();
        let alive = self
            .channels
            .get_epoch(channel_id, epoch)
            .is_some_and(|c| c.takes_hand_back(barrier_up))
            && self.upstream_takes_acks();
        if !alive {
            return false;
        }
        match self
            .channels
            .get(channel_id)
            .hand_back(tag, raw, barrier_up)
        {
            HandBack::Kept => {}
            HandBack::Before(at, raw) => self.insert_behind_barrier(at, &raw),
            HandBack::Send(raw) => self.emit_upstream(&raw),
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
        self.channels.get(channel_id).forward_publish();
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
                    state.shared.delayed.unreserve(state.vhost(), &name);
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

    /// Whether this nackd knows every delayed exchange (see
    /// [`crate::delayed::DelayedExchanges::synced`]).
    fn delayed_synced(&self) -> bool {
        self.scope
            .as_ref()
            .is_none_or(|s| s.shared.delayed.synced())
    }

    /// Whether publishes to `exchange` are still delayed: it is, or a
    /// delayed declare of it waits for the broker.
    fn publishes_declaring(&self, exchange: &str) -> bool {
        self.publishes.declaring(exchange)
            || self
                .scope
                .as_ref()
                .is_some_and(|s| s.shared.delayed.is_delayed(s.vhost(), exchange))
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
        if channel.closing() {
            return;
        }
        let Some(confirm) = channel.renumber_mut().and_then(|r| r.answer(tag, ack)) else {
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
        let Some(r) = self.channels.get(channel_id).renumber_mut() else {
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
        if channel.delivering().in_flight() {
            channel.wait_for_delivery(frame);
        } else {
            self.to_client.extend_from_slice(&frame);
        }
    }

    /// After a broker content frame: what waited for it to end goes.
    pub(super) fn flush_client_after(&mut self, channel_id: u16) {
        let channel = self.channels.get(channel_id);
        if !channel.waits_for_delivery() || channel.delivering().in_flight() {
            return;
        }
        for frame in channel.take_to_client_after() {
            self.to_client.extend_from_slice(&frame);
        }
    }

    // --- Deferred nacks (see `deferrals`): recorded, sent when due at the rate
    // allowed, forgotten when the broker takes the tags back anyway.

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
            .is_some_and(|c| c.barrier_raised() || c.closing());
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

    // --- Ending a pair: protocol faults, dead sockets, shutdown, timers.

    pub(super) fn on_client_fault(&mut self, fault: Fault) {
        let code = fault.reply_code();
        warn!(code = code.code(), error = %fault, "closing the client connection: protocol error");
        self.close.on_client_failed();
        let text = format!("{} - {fault}", code.name());
        self.to_client
            .extend_from_slice(&method::connection_close(code, &text, None));
        self.close.expect_client_close_ok(Origin::Nackd, self.now);
        if self.must_wait() {
            self.close_upstream_after_acks("client connection failed");
        } else {
            self.close_upstream("client connection failed");
        }
    }

    pub(super) fn on_upstream_fault(&mut self, fault: Fault) {
        warn!(error = %fault, "the broker sent a malformed frame; closing both sides");
        self.close.on_upstream_gone();
        self.close_client(
            ReplyCode::InternalError,
            &format!("nackd: broker sent a malformed frame: {fault}"),
        );
    }

    pub(super) fn on_client_gone(&mut self, error: Option<std::io::Error>) {
        if self.close.client_gone() {
            return;
        }
        match (&error, self.close.started()) {
            (_, true) => debug!(?error, "client socket closed"),
            (Some(e), false) => info!(error = %e, "client socket failed"),
            (None, false) => info!("client closed the socket without connection.close"),
        }
        self.close.on_client_gone();
        // Nothing more is written to the client: what waited for it goes.
        self.to_client.clear();
        self.close.begin(self.now);
        if self.close.awaiting_client() == Some(Origin::Broker) {
            // The broker waits for a close-ok the client will never send.
            self.to_upstream
                .extend_from_slice(&method::connection_close_ok());
            self.close.client_close_ok();
        } else if self.must_wait() {
            // Ack what nackd holds before the broker sees the client go.
            self.close_upstream_after_acks("client socket closed");
        } else {
            self.close_upstream("client socket closed");
        }
    }

    pub(super) fn on_upstream_gone(&mut self, error: Option<std::io::Error>) {
        if self.close.upstream_gone() {
            return;
        }
        if !self.close.started() {
            warn!(error = ?error.map(|e| e.to_string()), "upstream connection lost");
        }
        self.close.on_upstream_gone();
        self.close.begin(self.now);
        // The broker requeued every unacked delivery.
        self.forget_all_deferred();
        if self.close.upstream_close_ok() == Some(Origin::Client) {
            // The client asked to close: it gets its close-ok.
            self.to_client
                .extend_from_slice(&method::connection_close_ok());
        } else if self.close.awaiting_client().is_none() {
            self.close_client(
                ReplyCode::ConnectionForced,
                "CONNECTION_FORCED - nackd: upstream connection lost",
            );
        }
    }

    /// Sends `connection.close` to the client (or drops it mid-handshake).
    pub(super) fn close_client(&mut self, code: ReplyCode, text: &str) {
        self.close.begin(self.now);
        if self.close.client_gone() || self.close.awaiting_client().is_some() {
            return;
        }
        if !self.open {
            self.close.on_client_gone();
            return;
        }
        self.to_client
            .extend_from_slice(&method::connection_close(code, text, None));
        self.close.expect_client_close_ok(Origin::Nackd, self.now);
    }

    /// Sends `connection.close` to the broker (or drops it mid-handshake).
    pub(super) fn close_upstream(&mut self, why: &'static str) {
        self.close.begin(self.now);
        if self.close.upstream_gone() || self.close.awaiting_upstream().is_some() {
            return;
        }
        if !self.open {
            self.close.on_upstream_gone();
            return;
        }
        // The broker requeues every unacked delivery with the connection.
        self.forget_all_deferred();
        let text = format!("nackd: {why}");
        self.to_upstream
            .extend_from_slice(&method::connection_close(ReplyCode::Success, &text, None));
        self.close.expect_upstream_close_ok(Origin::Nackd, self.now);
    }

    pub(super) fn on_force(&mut self) {
        self.close.on_forced();
        info!("closing: nackd is shutting down");
        // Deferred nacks go now, ahead of the close (see the function).
        self.requeue_all_deferred_now();
        self.close_client(
            ReplyCode::ConnectionForced,
            "CONNECTION_FORCED - nackd is shutting down",
        );
        if self.must_wait() {
            // Ack what nackd holds before the broker sees the session end.
            self.close_upstream_after_acks("shutting down");
        } else {
            self.close_upstream("shutting down");
        }
    }

    pub(super) fn on_tick(&mut self) {
        let now: Instant = self.now;
        // Claims have a deadline even if the store never answers, whether
        // a close waits for them or not; so have held-back frames.
        self.give_up_overdue(self.claims.last());
        self.release_if_settled();
        self.fire_deferred();
        if !self.open && now >= self.handshake_deadline && !self.close.started() {
            warn!(timeout = ?self.limits.handshake_timeout, "handshake timed out");
            self.close.begin(self.now);
            self.close.on_client_gone();
            self.close.on_upstream_gone();
            return;
        }
        if self.heartbeat.is_zero() || self.close.started() {
            return;
        }
        let limit = self.heartbeat * 2;
        if !self.may_read(Peer::Client) {
            self.client_rx = now;
        }
        if !self.may_read(Peer::Upstream) {
            self.upstream_rx = now;
        }
        let client_spoke = now.duration_since(self.client_rx) < self.heartbeat;
        if self.open && client_spoke && now.duration_since(self.upstream_tx) >= self.heartbeat / 2 {
            // The client speaks but nackd took what it sent (delayed
            // publishes): the broker gets a heartbeat in its name, as a
            // client library sends one when it has nothing else to send
            // (a silent client sends its own, or is closed below).
            self.upstream_tx = now;
            self.to_upstream
                .extend_from_slice(&crate::protocol::method::heartbeat());
        }
        if now.duration_since(self.client_rx) > limit {
            warn!(heartbeat = ?self.heartbeat, "client missed two heartbeats; closing");
            self.on_client_gone(None);
        } else if now.duration_since(self.upstream_rx) > limit {
            warn!(heartbeat = ?self.heartbeat, "broker missed two heartbeats; closing");
            self.on_upstream_gone(None);
        }
    }
}

/// The user name of a PLAIN or AMQPLAIN login, for logs (never the password).
fn sasl_user(ok: &connection::StartOk) -> String {
    match ok.mechanism.as_str() {
        "PLAIN" => ok
            .response
            .as_bytes()
            .split(|b| *b == 0)
            .nth(1)
            .map(|u| String::from_utf8_lossy(u).into_owned())
            .unwrap_or_default(),
        other => format!("({other})"),
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

//! Frames from the client: tracking, settles, the handshake's tune-ok.

use std::sync::Arc;
use std::time::Duration;

use amq_protocol::protocol::{basic, channel as amqp_channel, connection, tx, AMQPClass};
use tracing::{debug, Span};

use super::close::Origin;
use super::machine::Session;
use super::peer::Fault;
use super::peer::Peer;
use super::settle::Settle;
use crate::protocol::frame::{self, Frame, FrameError, FrameType};
use crate::protocol::method::{self, ids, MethodId};

impl Session {
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
                if channel.publishing.in_flight() {
                    // A publish begins: where its method goes, its content follows.
                    channel.publish_behind_barrier = barrier_up;
                }
                self.emit_upstream(&frame.raw);
            }
            FrameType::Header | FrameType::Body => {
                if self.channels.get(frame.channel).taking.is_some() {
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
        if channel.publish_behind_barrier && self.barrier.hold(raw) {
            if !channel.publishing.in_flight() {
                // Publishes nackd gave back follow it, behind the barrier.
                for raw in std::mem::take(&mut channel.handed_over) {
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
        if !channel.publishing.in_flight() && !channel.handed_over.is_empty() {
            for raw in std::mem::take(&mut channel.handed_over) {
                self.emit_upstream(&raw);
            }
        }
        let channel = self.channels.get(channel_id);
        if !channel.publishing.in_flight() && !channel.after_publish.is_empty() {
            let mut acks = false;
            for (frame, held) in std::mem::take(&mut channel.after_publish) {
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
                    channel.end_behind.get_or_insert(at);
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
            self.channels.get(channel_id).client_closed = true;
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
                    state.vhost = Arc::from(open.virtual_host.as_str());
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

//! Frames from the broker: tracking, capture of deliveries, tune capping.

use amq_protocol::protocol::{basic, channel as amqp_channel, connection, exchange, AMQPClass};
use tracing::info;

use super::close::Origin;
use super::machine::Session;
use super::peer::Fault;
use super::peer::Peer;
use crate::protocol::frame::{Frame, FrameType};
use crate::protocol::method::{self, DeliverArgs};

impl Session {
    /// A `basic.deliver` on channel `channel_id` (read in place by
    /// `frames`): tracked, and captured if its queue is intercepted.
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
                self.channels.get(channel_id).closing = true;
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
}

//! Frames from the broker: tracking, capture of deliveries, tune capping.

use super::*;

impl Session {
    /// Handles every whole frame the broker sent; counts them once per read.
    pub(super) fn on_upstream_bytes(&mut self) {
        let mut frames = 0;
        loop {
            match self.upstream_decoder.decode(&mut self.upstream_in) {
                Ok(Some(frame)) => {
                    frames += 1;
                    if let Err(fault) = self.on_upstream_frame(frame) {
                        self.on_upstream_fault(fault);
                        break;
                    }
                }
                Ok(None) => break,
                Err(fault) => {
                    self.on_upstream_fault(fault);
                    break;
                }
            }
        }
        self.metrics.frames.to_client.inc_by(frames);
    }

    pub(super) fn on_upstream_frame(&mut self, frame: Frame) -> Result<(), Fault> {
        let span = match frame.channel {
            0 => tracing::Span::none(),
            id => self
                .channels
                .get(id)
                .span
                .clone()
                .unwrap_or_else(tracing::Span::none),
        };
        let _in_channel = span.enter();
        match frame.kind {
            FrameType::Heartbeat => {}
            FrameType::Method => {
                let payload = &frame.raw[frame::HEADER_LEN..frame.raw.len() - 1];
                let id = MethodId::peek(payload)?;
                if frame.channel != 0 {
                    self.channels
                        .get(frame.channel)
                        .delivering
                        .advance(&frame, Some(id))?;
                }
                if let Some(class) = method::decode(payload)? {
                    if !self.on_upstream_method(frame.channel, &class) {
                        return Ok(());
                    }
                }
            }
            FrameType::Header | FrameType::Body if frame.channel == 0 => {
                return Err(FrameError::Unexpected("content frame on channel 0"));
            }
            FrameType::Header | FrameType::Body => {
                self.channels
                    .get(frame.channel)
                    .delivering
                    .advance(&frame, None)?;
                self.capture_content(&frame);
            }
        }
        if !self.close.client_failed {
            self.to_client.extend_from_slice(&frame.raw);
        }
        Ok(())
    }

    /// Observes a decoded broker method; `false` means "do not forward it".
    pub(super) fn on_upstream_method(&mut self, channel_id: u16, class: &AMQPClass) -> bool {
        match class {
            AMQPClass::Connection(connection::AMQPMethod::Tune(tune)) => {
                if tune.frame_max == 0 || tune.frame_max > self.limits.max_frame {
                    // Offer the client no more than nackd accepts.
                    let mut capped = tune.clone();
                    capped.frame_max = self.limits.max_frame;
                    let tune = AMQPClass::Connection(connection::AMQPMethod::Tune(capped));
                    self.to_client.extend_from_slice(&method::encode(0, &tune));
                    return false;
                }
            }
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)) => {
                self.open = true;
                info!("connection open");
            }
            AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
                info!(
                    code = c.reply_code,
                    text = c.reply_text.as_str(),
                    "broker closes the connection"
                );
                self.close.expect_client_close_ok(Origin::Broker);
            }
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => {
                return self.close.upstream_close_ok() == Some(Origin::Client);
            }
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                self.channels.remove(channel_id);
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(_)) if channel_id != 0 => {
                self.channels.get(channel_id).closing = true;
            }
            AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) if channel_id != 0 => {
                self.channels.get(channel_id).on_broker_method(class);
                self.start_capture(
                    channel_id,
                    d.delivery_tag,
                    d.exchange.as_str(),
                    d.routing_key.as_str(),
                );
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
}

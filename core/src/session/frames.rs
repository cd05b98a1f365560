//! What both directions do with the frames they read: cut them out of the
//! read buffer, check them against their channel's content state, and decode
//! the methods nackd needs. What differs per direction is in `client.rs`
//! and `upstream.rs`.

use amq_protocol::protocol::AMQPClass;
use bytes::BytesMut;
use tracing::{debug, Span};

use super::machine::Session;
use super::peer::{Fault, Peer};
use crate::protocol::frame::{Frame, FrameError, FrameType};
use crate::protocol::method::{self, ids, MethodId};
use crate::session::channel::ContentState;

impl Session {
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
            id => self
                .channels
                .get(id)
                .span
                .clone()
                .unwrap_or_else(Span::none),
        }
    }

    fn content_state(&mut self, peer: Peer, channel: u16) -> &mut ContentState {
        let channel = self.channels.get(channel);
        match peer {
            Peer::Client => &mut channel.publishing,
            Peer::Upstream => &mut channel.delivering,
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
                    self.content_state(peer, frame.channel)
                        .advance(frame, Some(id))?;
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
                self.content_state(peer, frame.channel)
                    .advance(frame, None)?;
                Ok(None)
            }
        }
    }
}

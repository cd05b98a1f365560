//! The screen between a third-party AMQP client (lapin) and the broker:
//! what the broker sends passes nackd's own limits before the client's
//! parser sees it.
//!
//! lapin's parser (amq-protocol) recurses once per nested field table or
//! array, so a message whose headers nest a few thousand levels (5 octets
//! a level, far below `frame_max`) overflows its thread's stack and aborts
//! the process. The screen cuts the broker's bytes into frames with
//! [`FrameDecoder`] (frame size) and decodes every method and content
//! header with nackd's decoders, which refuse nesting deeper than
//! [`MAX_TABLE_DEPTH`](super::content::MAX_TABLE_DEPTH) without recursing.
//!
//! - A content header nackd refuses is *folded*: its properties are
//!   replaced by one header, [`FOLDED`], a byte array naming the original
//!   payload, which the screen keeps. The client sees a flat, harmless
//!   message and can tell it was folded. When the client publishes that
//!   message again (a replay putting it back on its queue), the screen puts
//!   the original properties back, byte for byte. Only folds of this
//!   screen are restored: the name holds random octets the screen was
//!   given, so a header a client wrote cannot pick one.
//! - A method frame nackd refuses, a corrupt frame, or more folded bytes
//!   than [`Screen::new`]'s budget end the connection: [`ScreenError`].
//!
//! Sans-IO: the caller moves the bytes (`src/screen.rs`).

use std::collections::HashMap;

use amq_protocol::protocol::{connection, AMQPClass};
use bytes::{BufMut, Bytes, BytesMut};

use super::content;
use super::frame::{FrameDecoder, FrameError, FrameType, PROTOCOL_HEADER};
use super::method;

/// The header a folded message carries instead of its properties: a byte
/// array naming the original (random key, then a counter).
pub const FOLDED: &str = "x-nackd-folded";

/// Octets of a fold's name.
const NAME_LEN: usize = 16;

/// Flag bit of the `headers` property.
const HEADERS_FLAG: u16 = 1 << 13;

/// Why the screen ends a connection.
#[derive(Debug, thiserror::Error)]
pub enum ScreenError {
    /// The broker's bytes are not frames nackd accepts.
    #[error("broker frame refused: {0}")]
    Frame(FrameError),
    /// A method from the broker that nackd refuses to decode.
    #[error("broker method refused: {0}")]
    Method(FrameError),
    /// The client's bytes are not frames.
    #[error("client frame refused: {0}")]
    Client(FrameError),
    /// Folded messages hold more than the budget.
    #[error("folded messages hold more than {0} octets on this connection")]
    Budget(usize),
}

/// One content header the screen folded.
#[derive(Debug, PartialEq, Eq)]
pub struct Fold {
    /// The channel it came on.
    pub channel: u16,
    /// Why nackd refused it.
    pub reason: FrameError,
}

/// The state of one screened connection.
#[derive(Debug)]
pub struct Screen {
    key: [u8; 8],
    next: u64,
    /// Fold name → the original content header payload.
    folds: HashMap<[u8; NAME_LEN], Bytes>,
    held: usize,
    budget: usize,
    from_broker: FrameDecoder,
    from_client: FrameDecoder,
    /// The client's protocol header has passed.
    started: bool,
}

impl Screen {
    /// A screen whose fold names start with `key` (random, secret to the
    /// process), holding at most `budget` octets of folded properties.
    pub fn new(key: [u8; 8], budget: usize) -> Self {
        Self {
            key,
            next: 0,
            folds: HashMap::new(),
            held: 0,
            budget,
            // RabbitMQ's own tolerance: frames up to 8 octets over.
            from_broker: FrameDecoder::relaying(super::frame::HANDSHAKE_FRAME_MAX),
            from_client: FrameDecoder::new(0),
            started: false,
        }
    }

    /// Octets of folded properties held now.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Takes every whole frame from the front of `buf` (the broker's bytes)
    /// and appends it to `out` for the client, folded where nackd refuses
    /// its content header (each fold pushed on `folds`). An error ends the
    /// connection (what came before it is in `out` and `folds`).
    pub fn from_broker(
        &mut self,
        buf: &mut BytesMut,
        out: &mut BytesMut,
        folds: &mut Vec<Fold>,
    ) -> Result<(), ScreenError> {
        while let Some(frame) = self.from_broker.decode(buf).map_err(ScreenError::Frame)? {
            match frame.kind {
                FrameType::Method => {
                    method::decode_any(frame.payload_slice()).map_err(ScreenError::Method)?;
                    out.extend_from_slice(&frame.raw);
                }
                FrameType::Header => match content::decode_header(frame.payload_slice()) {
                    Ok(_) => out.extend_from_slice(&frame.raw),
                    Err(reason) => {
                        let folded = self.fold(frame.payload_slice())?;
                        method::put_frame(out, FrameType::Header, frame.channel, &folded);
                        folds.push(Fold {
                            channel: frame.channel,
                            reason,
                        });
                    }
                },
                FrameType::Body | FrameType::Heartbeat => out.extend_from_slice(&frame.raw),
            }
        }
        Ok(())
    }

    /// Takes the client's bytes from the front of `buf` and appends them to
    /// `out` for the broker, with folded properties restored. Returns how
    /// many were restored.
    pub fn from_client(
        &mut self,
        buf: &mut BytesMut,
        out: &mut BytesMut,
    ) -> Result<usize, ScreenError> {
        if !self.started {
            if buf.len() < PROTOCOL_HEADER.len() {
                return Ok(0);
            }
            out.extend_from_slice(&buf.split_to(PROTOCOL_HEADER.len()));
            self.started = true;
        }
        let mut restored = 0;
        while let Some(frame) = self.from_client.decode(buf).map_err(ScreenError::Client)? {
            match frame.kind {
                FrameType::Header => match self.restore(frame.payload_slice())? {
                    Some(original) => {
                        method::put_frame(out, FrameType::Header, frame.channel, &original);
                        restored += 1;
                    }
                    None => out.extend_from_slice(&frame.raw),
                },
                FrameType::Method => {
                    self.tuned(frame.payload_slice());
                    out.extend_from_slice(&frame.raw);
                }
                FrameType::Body | FrameType::Heartbeat => out.extend_from_slice(&frame.raw),
            }
        }
        Ok(restored)
    }

    /// Once the client's `connection.tune-ok` fixes `frame_max`, the
    /// broker's frames are held to it.
    fn tuned(&mut self, payload: &[u8]) {
        if method::MethodId::peek(payload) != Ok(method::ids::CONNECTION_TUNE_OK) {
            return;
        }
        if let Ok(AMQPClass::Connection(connection::AMQPMethod::TuneOk(t))) =
            method::decode_any(payload)
        {
            self.from_broker.set_frame_max(t.frame_max);
        }
    }

    /// The folded form of a content header payload: class, weight and body
    /// size kept, the properties replaced by [`FOLDED`].
    fn fold(&mut self, payload: &[u8]) -> Result<Vec<u8>, ScreenError> {
        if payload.len() < 12 {
            // Too short to carry a body size: nothing to keep.
            return Err(ScreenError::Frame(FrameError::Syntax(
                "content header shorter than 14 octets",
            )));
        }
        if self.held + payload.len() > self.budget {
            return Err(ScreenError::Budget(self.budget));
        }
        let mut name = [0; NAME_LEN];
        name[..8].copy_from_slice(&self.key);
        name[8..].copy_from_slice(&self.next.to_be_bytes());
        self.next += 1;
        self.held += payload.len();
        self.folds.insert(name, Bytes::copy_from_slice(payload));
        Ok(folded_header(&payload[..12], &name))
    }

    /// The original of a folded content header the client sends back. A
    /// fold of this screen sent a second time (its original went with the
    /// first) is an error: it must not reach the broker without its
    /// properties.
    fn restore(&mut self, payload: &[u8]) -> Result<Option<Vec<u8>>, ScreenError> {
        let Some(name) = self.fold_named(payload) else {
            return Ok(None);
        };
        let Some(original) = self.folds.remove(&name) else {
            return Err(ScreenError::Frame(FrameError::Syntax(
                "a folded message published a second time: its properties went with the first",
            )));
        };
        self.held -= original.len();
        let mut out = original.to_vec();
        // The body size the client announces (the same, unless it changed
        // the body).
        out[4..12].copy_from_slice(&payload[4..12]);
        Ok(Some(out))
    }

    /// The name of this screen's fold a content header carries, if any
    /// (a name with another key is someone else's bytes: left as sent).
    fn fold_named(&self, payload: &[u8]) -> Option<[u8; NAME_LEN]> {
        if self.next == 0 {
            return None;
        }
        let table = content::raw_headers(payload).ok()??;
        content::table_entries(table)
            .ok()?
            .into_iter()
            .find(|e| e.key == FOLDED.as_bytes())
            .and_then(|e| fold_name(e.bytes))
            .filter(|name| name[..8] == self.key)
    }
}

/// A content header payload with `prefix` (class, weight, body size) and
/// only the [`FOLDED`] header naming `name`.
fn folded_header(prefix: &[u8], name: &[u8; NAME_LEN]) -> Vec<u8> {
    let mut table = Vec::with_capacity(FOLDED.len() + 6 + NAME_LEN);
    table.put_u8(FOLDED.len() as u8);
    table.extend_from_slice(FOLDED.as_bytes());
    table.put_u8(b'x');
    table.put_u32(NAME_LEN as u32);
    table.extend_from_slice(name);
    let mut out = Vec::with_capacity(prefix.len() + 6 + table.len());
    out.extend_from_slice(prefix);
    out.put_u16(HEADERS_FLAG);
    out.put_u32(table.len() as u32);
    out.extend_from_slice(&table);
    out
}

/// The name in a whole [`FOLDED`] table entry, if it holds one.
fn fold_name(entry: &[u8]) -> Option<[u8; NAME_LEN]> {
    let value = entry.get(1 + FOLDED.len()..)?;
    let (&tag, rest) = value.split_first()?;
    let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    (tag == b'x' && len == NAME_LEN)
        .then(|| rest.get(4..4 + NAME_LEN)?.try_into().ok())
        .flatten()
}

#[cfg(test)]
mod tests;

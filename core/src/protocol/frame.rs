//! AMQP 0-9-1 framing: the protocol header and the general frame
//! (`type:u8 channel:u16 size:u32 payload frame-end:0xCE`).
//!
//! Frames are cut out of the read buffer as [`Bytes`] without copying, so the
//! proxy can forward the original bytes. The payload size is checked against
//! the limit on the 7-byte header, before any byte of the payload is buffered.

use bytes::{Buf, Bytes, BytesMut};
use nom::number::streaming::{be_u16, be_u32, be_u8};
use nom::Parser;

use crate::protocol::reply::ReplyCode;

/// Octets of the frame header (type, channel, size).
pub const HEADER_LEN: usize = 7;
/// The frame-end octet every frame carries after its payload.
pub const FRAME_END: u8 = 0xCE;
/// Bytes a frame adds around its payload (header + frame-end).
pub const FRAME_OVERHEAD: usize = HEADER_LEN + 1;
/// The protocol header of AMQP 0-9-1, the only protocol nackd speaks.
pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";
/// Largest frame the spec lets a peer send before `connection.tune-ok`
/// (`frame-min-size`). RabbitMQ accepts more during the handshake, so nackd
/// uses [`HANDSHAKE_FRAME_MAX`] until tuning is done.
pub const FRAME_MIN_SIZE: u32 = 4096;
/// Frame size limit in force until `connection.tune-ok` fixes the real one.
/// Large enough for big `client_properties` tables, small enough to bound
/// what an unauthenticated peer can make nackd buffer.
pub const HANDSHAKE_FRAME_MAX: u32 = 128 * 1024;

/// Most capacity [`FrameDecoder::decode`] reserves ahead of the bytes that
/// arrived. Without a cap, 7 header octets announcing a 4 GiB frame made it
/// allocate 4 GiB at once when `frame_max` is 0 (no limit), and a whole large
/// `frame_max` for every peer that sent just a header. A frame up to this
/// size is still reserved in one step; a larger one grows as its bytes come.
pub const RESERVE_STEP: usize = HANDSHAKE_FRAME_MAX as usize;
/// How far beyond the negotiated `frame_max` RabbitMQ still takes a frame:
/// 8 octets, a payload of `frame_max` (its reader's `FRAME_SIZE_FUDGE`,
/// "quite a few [clients] get it wrong - off-by 1 or 8"; rabbitpy sends
/// body frames of `frame_max` octets of payload). nackd must not refuse
/// what the broker behind it takes: see [`FrameDecoder::relaying`].
pub const RABBITMQ_OVERSHOOT: u32 = FRAME_OVERHEAD as u32;

/// The four frame types of AMQP 0-9-1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameType {
    /// A method (class id, method id, arguments).
    Method = 1,
    /// A content header (class id, weight, body size, properties).
    Header = 2,
    /// A slice of content body.
    Body = 3,
    /// A heartbeat, channel 0, empty payload.
    Heartbeat = 8,
}

impl FrameType {
    /// Maps the type octet; `None` for an octet the spec does not define.
    pub fn from_octet(octet: u8) -> Option<Self> {
        match octet {
            1 => Some(Self::Method),
            2 => Some(Self::Header),
            3 => Some(Self::Body),
            8 => Some(Self::Heartbeat),
            _ => None,
        }
    }
}

/// One frame as it came off the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// What the frame carries.
    pub kind: FrameType,
    /// Channel number (0 for the connection).
    pub channel: u16,
    /// The whole frame, header and frame-end included: what gets forwarded.
    pub raw: Bytes,
}

impl Frame {
    /// The payload: `raw` without the 7-byte header and the frame-end.
    pub fn payload(&self) -> Bytes {
        self.raw.slice(HEADER_LEN..self.raw.len() - 1)
    }

    /// The payload as a slice, without taking a reference on the buffer.
    pub fn payload_slice(&self) -> &[u8] {
        &self.raw[HEADER_LEN..self.raw.len() - 1]
    }

    /// Builds a frame around `payload` (used by the encoder and by tests).
    pub fn new(kind: FrameType, channel: u16, payload: &[u8]) -> Self {
        let mut raw = BytesMut::with_capacity(payload.len() + FRAME_OVERHEAD);
        raw.extend_from_slice(&[kind as u8]);
        raw.extend_from_slice(&channel.to_be_bytes());
        raw.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        raw.extend_from_slice(payload);
        raw.extend_from_slice(&[FRAME_END]);
        Self {
            kind,
            channel,
            raw: raw.freeze(),
        }
    }
}

/// Why a byte stream cannot be read as AMQP frames.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The header announces a payload beyond the negotiated `frame_max`.
    #[error("frame of {size} bytes exceeds frame_max {max}")]
    TooLarge {
        /// Whole frame size announced (payload + 8).
        size: u64,
        /// Limit in force.
        max: u32,
    },
    /// The octet after the payload is not 0xCE.
    #[error("frame-end octet is {0:#04x}, not 0xce")]
    BadFrameEnd(u8),
    /// A frame type octet the spec does not define.
    #[error("unknown frame type {0}")]
    UnknownType(u8),
    /// A heartbeat on a channel other than 0, or with a payload.
    #[error("malformed heartbeat frame on channel {0}")]
    BadHeartbeat(u16),
    /// A frame that is well formed but not allowed where it came.
    #[error("unexpected frame: {0}")]
    Unexpected(&'static str),
    /// A channel number above the negotiated `channel_max`.
    #[error("channel {channel} above channel_max {max}")]
    ChannelOutOfRange {
        /// Channel used.
        channel: u16,
        /// Negotiated limit.
        max: u16,
    },
    /// A method or content header whose fields cannot be decoded.
    #[error("cannot decode {0}")]
    Syntax(&'static str),
    /// Something nackd does not implement (a delayed publish inside a
    /// transaction).
    #[error("not implemented by nackd: {0}")]
    NotImplemented(&'static str),
    /// Something nackd refuses to take on (a delayed exchange beyond its
    /// limit).
    #[error("refused by nackd: {0}")]
    NotAllowed(&'static str),
    /// Something nackd cannot do now (a delayed publish while it does not
    /// know which exchanges are delayed).
    #[error("not possible now: {0}")]
    Unavailable(&'static str),
}

impl FrameError {
    /// The AMQP reply code a `connection.close` reports for this error.
    pub fn reply_code(&self) -> ReplyCode {
        match self {
            Self::TooLarge { .. }
            | Self::BadFrameEnd(_)
            | Self::UnknownType(_)
            | Self::BadHeartbeat(_) => ReplyCode::FrameError,
            Self::Unexpected(_) => ReplyCode::UnexpectedFrame,
            Self::ChannelOutOfRange { .. } => ReplyCode::ChannelError,
            Self::Syntax(_) => ReplyCode::SyntaxError,
            Self::NotImplemented(_) => ReplyCode::NotImplemented,
            Self::NotAllowed(_) => ReplyCode::NotAllowed,
            Self::Unavailable(_) => ReplyCode::ResourceError,
        }
    }
}

/// What a client opened the connection with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProtocolHeader {
    /// `AMQP 0 0 9 1`: go on.
    Amqp091,
    /// Anything else (another AMQP version, TLS hello, HTTP, garbage). The spec
    /// says: answer with the header of the version we support, then close.
    Unsupported,
}

/// Reads the 8-octet protocol header a client sends first.
/// `Ok(None)` while fewer than 8 octets have arrived (or, for a stream that
/// does not even start like `AMQP`, never: it is rejected at once).
pub fn decode_protocol_header(buf: &mut BytesMut) -> Option<ProtocolHeader> {
    let seen = buf.len().min(PROTOCOL_HEADER.len());
    if buf[..seen] != PROTOCOL_HEADER[..seen] {
        return Some(ProtocolHeader::Unsupported);
    }
    if buf.len() < PROTOCOL_HEADER.len() {
        return None;
    }
    buf.advance(PROTOCOL_HEADER.len());
    Some(ProtocolHeader::Amqp091)
}

fn frame_header(input: &[u8]) -> nom::IResult<&[u8], (u8, u16, u32)> {
    (be_u8, be_u16, be_u32).parse(input)
}

/// Cuts frames out of a read buffer.
#[derive(Clone, Debug)]
pub struct FrameDecoder {
    frame_max: u32,
    /// Octets a frame may exceed `frame_max` by (0, or
    /// [`RABBITMQ_OVERSHOOT`] for a relayed stream).
    overshoot: u32,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new(HANDSHAKE_FRAME_MAX)
    }
}

impl FrameDecoder {
    /// A decoder accepting frames of at most `frame_max` bytes (0 = no limit
    /// from the peer; nackd then applies [`u32::MAX`]).
    pub fn new(frame_max: u32) -> Self {
        Self {
            frame_max: if frame_max == 0 { u32::MAX } else { frame_max },
            overshoot: 0,
        }
    }

    /// A decoder for a stream nackd relays between a client and RabbitMQ:
    /// like [`FrameDecoder::new`], but it takes frames up to
    /// [`RABBITMQ_OVERSHOOT`] octets beyond `frame_max`, as the broker does.
    pub fn relaying(frame_max: u32) -> Self {
        Self {
            overshoot: RABBITMQ_OVERSHOOT,
            ..Self::new(frame_max)
        }
    }

    /// The limit in force.
    pub fn frame_max(&self) -> u32 {
        self.frame_max
    }

    /// Changes the limit, once `connection.tune-ok` has fixed it (a
    /// relaying decoder keeps relaying).
    pub fn set_frame_max(&mut self, frame_max: u32) {
        self.frame_max = Self::new(frame_max).frame_max;
    }

    /// Takes one frame from the front of `buf`.
    ///
    /// `Ok(None)` means "need more bytes" and leaves `buf` untouched, with
    /// capacity reserved for the rest of the frame once its size is known
    /// to be within the limit (at most [`RESERVE_STEP`] per call).
    /// `Err` means the stream is corrupt.
    pub fn decode(&self, buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        let (kind, channel, size) = match frame_header(buf) {
            Ok((_, header)) => header,
            Err(_) => return Ok(None),
        };
        let kind = FrameType::from_octet(kind).ok_or(FrameError::UnknownType(kind))?;
        let total = size as u64 + FRAME_OVERHEAD as u64;
        if total > self.frame_max as u64 + self.overshoot as u64 {
            return Err(FrameError::TooLarge {
                size: total,
                max: self.frame_max,
            });
        }
        let total = total as usize;
        if buf.len() < total {
            buf.reserve((total - buf.len()).min(RESERVE_STEP));
            return Ok(None);
        }
        let end = buf[total - 1];
        if end != FRAME_END {
            return Err(FrameError::BadFrameEnd(end));
        }
        if kind == FrameType::Heartbeat && (channel != 0 || size != 0) {
            return Err(FrameError::BadHeartbeat(channel));
        }
        let raw = buf.split_to(total).freeze();
        Ok(Some(Frame { kind, channel, raw }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heartbeat() -> Vec<u8> {
        vec![8, 0, 0, 0, 0, 0, 0, FRAME_END]
    }

    #[test]
    fn whole_frame_is_cut_without_copy() {
        let mut buf = BytesMut::from(&Frame::new(FrameType::Body, 3, b"hello").raw[..]);
        buf.extend_from_slice(&heartbeat());
        let first_ptr = buf.as_ptr();
        let frame = FrameDecoder::default().decode(&mut buf).unwrap().unwrap();
        assert_eq!(frame.kind, FrameType::Body);
        assert_eq!(frame.channel, 3);
        assert_eq!(&frame.payload()[..], b"hello");
        assert_eq!(
            frame.raw.as_ptr(),
            first_ptr,
            "frame must share the read buffer"
        );
        let hb = FrameDecoder::default().decode(&mut buf).unwrap().unwrap();
        assert_eq!(hb.kind, FrameType::Heartbeat);
        assert!(buf.is_empty());
    }

    #[test]
    fn one_byte_at_a_time() {
        let wire = Frame::new(
            FrameType::Method,
            7,
            &[0, 60, 0, 80, 1, 2, 3, 4, 5, 6, 7, 8, 0],
        )
        .raw;
        let decoder = FrameDecoder::default();
        let mut buf = BytesMut::new();
        for (i, byte) in wire.iter().enumerate() {
            assert_eq!(
                decoder.decode(&mut buf).unwrap(),
                None,
                "complete too early at {i}"
            );
            buf.extend_from_slice(&[*byte]);
        }
        let frame = decoder.decode(&mut buf).unwrap().unwrap();
        assert_eq!(frame.raw, wire);
        assert!(buf.is_empty());
    }

    #[test]
    fn oversized_frame_rejected_on_header_before_allocation() {
        let decoder = FrameDecoder::new(131_072);
        // Only the 7-byte header: claims a 1 GiB payload.
        let mut buf = BytesMut::from(&[3u8, 0, 1, 0x40, 0, 0, 0][..]);
        let cap_before = buf.capacity();
        let err = decoder.decode(&mut buf).unwrap_err();
        assert_eq!(
            err,
            FrameError::TooLarge {
                size: (1 << 30) + 8,
                max: 131_072
            }
        );
        assert_eq!(err.reply_code(), ReplyCode::FrameError);
        assert_eq!(
            buf.capacity(),
            cap_before,
            "nothing reserved for a rejected frame"
        );
    }

    /// Found by the `frames` fuzz target (libFuzzer: out-of-memory,
    /// malloc(4060086292) from a 20-byte input).
    #[test]
    fn unlimited_frame_max_does_not_reserve_what_the_header_claims() {
        let decoder = FrameDecoder::new(0);
        let mut buf = BytesMut::from(&[3u8, 0, 1, 0xff, 0xff, 0xff, 0xf0, 0][..]);
        assert_eq!(decoder.decode(&mut buf), Ok(None));
        assert!(
            buf.capacity() <= 2 * (8 + RESERVE_STEP),
            "reserved {}",
            buf.capacity()
        );
        // The reservation keeps pace with the bytes that arrive.
        buf.extend_from_slice(&vec![0; RESERVE_STEP]);
        assert_eq!(decoder.decode(&mut buf), Ok(None));
        assert!(buf.capacity() > buf.len(), "room left to read into");
        assert!(
            buf.capacity() <= 4 * (8 + RESERVE_STEP),
            "reserved {}",
            buf.capacity()
        );
    }

    #[test]
    fn frame_exactly_at_limit_is_accepted() {
        let decoder = FrameDecoder::new(4096);
        let payload = vec![0u8; 4096 - FRAME_OVERHEAD];
        let mut buf = BytesMut::from(&Frame::new(FrameType::Body, 1, &payload).raw[..]);
        assert!(decoder.decode(&mut buf).unwrap().is_some());
        let payload = vec![0u8; 4096 - FRAME_OVERHEAD + 1];
        let mut buf = BytesMut::from(&Frame::new(FrameType::Body, 1, &payload).raw[..]);
        assert!(matches!(
            decoder.decode(&mut buf),
            Err(FrameError::TooLarge { .. })
        ));
    }

    /// RabbitMQ takes a payload of `frame_max` octets (8 over the limit in
    /// all); a relaying decoder does too, and nothing more.
    #[test]
    fn relaying_decoder_takes_what_rabbitmq_takes() {
        let mut decoder = FrameDecoder::relaying(HANDSHAKE_FRAME_MAX);
        decoder.set_frame_max(4096);
        let mut buf = BytesMut::from(&Frame::new(FrameType::Body, 1, &[0u8; 4096]).raw[..]);
        let frame = decoder.decode(&mut buf).unwrap().unwrap();
        assert_eq!(frame.raw.len(), 4096 + FRAME_OVERHEAD);
        let mut buf = BytesMut::from(&Frame::new(FrameType::Body, 1, &[0u8; 4097]).raw[..]);
        assert_eq!(
            decoder.decode(&mut buf),
            Err(FrameError::TooLarge {
                size: 4097 + 8,
                max: 4096
            })
        );
        // A plain decoder holds to the limit.
        let mut buf = BytesMut::from(&Frame::new(FrameType::Body, 1, &[0u8; 4096]).raw[..]);
        assert!(FrameDecoder::new(4096).decode(&mut buf).is_err());
    }

    #[test]
    fn bad_frame_end() {
        let mut wire = heartbeat();
        wire[7] = 0xCD;
        let mut buf = BytesMut::from(&wire[..]);
        let err = FrameDecoder::default().decode(&mut buf).unwrap_err();
        assert_eq!(err, FrameError::BadFrameEnd(0xCD));
        assert_eq!(err.reply_code(), ReplyCode::FrameError);
    }

    #[test]
    fn unknown_frame_type() {
        let mut buf = BytesMut::from(&[4u8, 0, 0, 0, 0, 0, 0, FRAME_END][..]);
        let err = FrameDecoder::default().decode(&mut buf).unwrap_err();
        assert_eq!(err, FrameError::UnknownType(4));
        assert_eq!(err.reply_code(), ReplyCode::FrameError);
    }

    #[test]
    fn heartbeat_on_a_channel_is_a_frame_error() {
        let mut buf = BytesMut::from(&[8u8, 0, 5, 0, 0, 0, 0, FRAME_END][..]);
        let err = FrameDecoder::default().decode(&mut buf).unwrap_err();
        assert_eq!(err, FrameError::BadHeartbeat(5));
    }

    #[test]
    fn protocol_headers() {
        let mut ok = BytesMut::from(&PROTOCOL_HEADER[..]);
        ok.extend_from_slice(b"rest");
        assert_eq!(
            decode_protocol_header(&mut ok),
            Some(ProtocolHeader::Amqp091)
        );
        assert_eq!(&ok[..], b"rest");

        let mut partial = BytesMut::from(&b"AMQP\x00"[..]);
        assert_eq!(decode_protocol_header(&mut partial), None);

        for other in [
            &b"AMQP\x01\x01\x00\x0a"[..], // AMQP 0-10
            b"AMQP\x00\x01\x00\x00",      // AMQP 1.0
            b"AMQP\x03\x01\x00\x00",      // AMQP 1.0 SASL
            b"AMQP\x01\x01\x00\x09",      // AMQP 0-9
            b"GET / HT",
            b"\x16\x03\x01\x02\x00\x01\x00\x01", // a TLS ClientHello
        ] {
            let mut buf = BytesMut::from(other);
            assert_eq!(
                decode_protocol_header(&mut buf),
                Some(ProtocolHeader::Unsupported),
                "{other:?}"
            );
        }
        // Garbage is refused from the first octet, without waiting for 8.
        let mut g = BytesMut::from(&b"X"[..]);
        assert_eq!(
            decode_protocol_header(&mut g),
            Some(ProtocolHeader::Unsupported)
        );
    }
}

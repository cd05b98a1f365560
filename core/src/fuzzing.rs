//! Fuzz targets for the frame layer, shared by the libFuzzer targets in
//! `fuzz/` and the property tests in `tests/fuzz_props.rs`. Compiled only
//! with the `fuzzing` feature: the product carries none of it.
//!
//! A target panics only when an invariant breaks: decoding never panics, a
//! frame is cut exactly where its header says, input split anywhere decodes
//! the same as input in one piece, and whatever decodes re-encodes to bytes
//! that decode to the same value.

mod method_spec;
mod payload;
mod roundtrip;
mod spec;
mod value;

pub use method_spec::MethodSpec;
pub use roundtrip::roundtrip;
pub use spec::{FrameSpec, HeaderSpec};
pub use value::{short, table, TableSpec, Text, ValueSpec};

use bytes::BytesMut;

use crate::protocol::frame::{
    decode_protocol_header, Frame, FrameDecoder, FrameError, FrameType, ProtocolHeader, FRAME_END,
    FRAME_MIN_SIZE, FRAME_OVERHEAD, HANDSHAKE_FRAME_MAX, HEADER_LEN, PROTOCOL_HEADER, RESERVE_STEP,
};

/// Bytes as a peer sends them: an optional protocol header, then frames.
/// Cuts them with a few `frame_max` limits, whole, split at a point taken
/// from the data and byte by byte, and decodes every method and content
/// header payload that comes out.
pub fn frames(data: &[u8]) {
    let data = protocol_header(data);
    let small = FRAME_OVERHEAD as u32 + u32::from(data.last().copied().unwrap_or(0));
    let split = split_point(data);
    for frame_max in [0, FRAME_MIN_SIZE, HANDSHAKE_FRAME_MAX, small] {
        let decoder = FrameDecoder::new(frame_max);
        let whole = decode_chunks(&decoder, &[data]);
        let (head, tail) = data.split_at(split);
        assert_eq!(
            decode_chunks(&decoder, &[head, tail]),
            whole,
            "split at {split}"
        );
        if frame_max == HANDSHAKE_FRAME_MAX {
            let bytes: Vec<&[u8]> = data.chunks(1).collect();
            assert_eq!(decode_chunks(&decoder, &bytes), whole, "byte by byte");
            for frame in &whole.frames {
                match frame.kind {
                    FrameType::Method => payload::method(&frame.payload()),
                    FrameType::Header => payload::header(&frame.payload()),
                    FrameType::Body | FrameType::Heartbeat => {}
                }
            }
        }
    }
}

/// Bytes straight into the method and content-header decoders, the field
/// table splitter and the header rewrite.
pub fn method_and_header(data: &[u8]) {
    payload::method(data);
    payload::header(data);
    payload::table(data);
}

/// A `basic.deliver` payload (class and method id included): the
/// session's in-place reader and amq-protocol's decoder agree on it.
pub fn deliver(payload: &[u8]) {
    let any = crate::protocol::method::decode_any(payload);
    payload::deliver_read_in_place(payload, &any);
}

/// What a decoder made of a byte stream.
#[derive(Debug, PartialEq)]
struct Decoded {
    frames: Vec<Frame>,
    /// `Ok(bytes left over)` when the decoder wants more, or the error.
    end: Result<usize, FrameError>,
}

fn protocol_header(data: &[u8]) -> &[u8] {
    let mut buf = BytesMut::from(data);
    let seen = data.len().min(PROTOCOL_HEADER.len());
    match decode_protocol_header(&mut buf) {
        Some(ProtocolHeader::Amqp091) => {
            assert!(data.starts_with(PROTOCOL_HEADER));
            assert_eq!(&buf[..], &data[PROTOCOL_HEADER.len()..]);
            &data[PROTOCOL_HEADER.len()..]
        }
        None => {
            assert!(data.len() < PROTOCOL_HEADER.len() && PROTOCOL_HEADER.starts_with(data));
            data
        }
        Some(ProtocolHeader::Unsupported) => {
            assert_ne!(data[..seen], PROTOCOL_HEADER[..seen]);
            data
        }
    }
}

/// A split point that depends on the data, anywhere from 0 to len.
fn split_point(data: &[u8]) -> usize {
    let pick = data.get(data.len() / 2).copied().unwrap_or(0) as usize;
    data.len() * pick / 255
}

/// Feeds `chunks` one after the other, taking every frame out after each.
fn decode_chunks(decoder: &FrameDecoder, chunks: &[&[u8]]) -> Decoded {
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    let mut consumed = Vec::new();
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        loop {
            // Only the length: a copy per call would make byte-by-byte quadratic.
            let before = buf.len();
            match decoder.decode(&mut buf) {
                Ok(Some(frame)) => {
                    check_frame(decoder, &frame);
                    assert_eq!(
                        before - frame.raw.len(),
                        buf.len(),
                        "frame taken from the front"
                    );
                    consumed.extend_from_slice(&frame.raw);
                    frames.push(frame);
                }
                Ok(None) => {
                    check_incomplete(decoder, &buf);
                    assert_eq!(before, buf.len(), "Ok(None) leaves the buffer as it was");
                    break;
                }
                Err(err) => {
                    check_error(decoder, &buf, &err);
                    assert_eq!(before, buf.len(), "Err leaves the buffer as it was");
                    return Decoded {
                        frames,
                        end: Err(err),
                    };
                }
            }
        }
    }
    let input: Vec<u8> = chunks.concat();
    assert_eq!(
        &input[..consumed.len()],
        &consumed[..],
        "frames are the input, in order"
    );
    Decoded {
        frames,
        end: Ok(buf.len()),
    }
}

fn announced(buf: &[u8]) -> (u8, u16, u64) {
    let size = u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]);
    (
        buf[0],
        u16::from_be_bytes([buf[1], buf[2]]),
        size as u64 + FRAME_OVERHEAD as u64,
    )
}

fn check_frame(decoder: &FrameDecoder, frame: &Frame) {
    let raw = &frame.raw;
    let (kind, channel, total) = announced(raw);
    assert_eq!(kind, frame.kind as u8);
    assert_eq!(channel, frame.channel);
    assert_eq!(raw.len() as u64, total, "raw is payload + 8");
    assert_eq!(frame.payload().len(), raw.len() - FRAME_OVERHEAD);
    assert_eq!(raw.last(), Some(&FRAME_END));
    assert!(
        raw.len() as u64 <= decoder.frame_max() as u64,
        "frame within frame_max"
    );
    if frame.kind == FrameType::Heartbeat {
        assert_eq!(
            (frame.channel, raw.len()),
            (0, FRAME_OVERHEAD),
            "heartbeat is empty, channel 0"
        );
    }
}

/// `Ok(None)` only when the header or the rest of an acceptable frame is
/// missing, with no more memory held than the bytes in hand justify.
fn check_incomplete(decoder: &FrameDecoder, buf: &BytesMut) {
    let bound = 2 * (buf.len() + RESERVE_STEP);
    assert!(
        buf.capacity() <= bound,
        "{} reserved for {} octets",
        buf.capacity(),
        buf.len()
    );
    if buf.len() < HEADER_LEN {
        return;
    }
    let (kind, _, total) = announced(buf);
    assert!(
        FrameType::from_octet(kind).is_some(),
        "type {kind} accepted"
    );
    assert!(
        total <= decoder.frame_max() as u64,
        "oversized frame not refused on its header"
    );
    assert!(
        (buf.len() as u64) < total,
        "a complete frame was left in the buffer"
    );
}

/// Every error names what is really wrong with the front of the buffer.
fn check_error(decoder: &FrameDecoder, buf: &[u8], err: &FrameError) {
    assert!(
        buf.len() >= HEADER_LEN,
        "error before a whole header: {err}"
    );
    let (kind, channel, total) = announced(buf);
    match *err {
        FrameError::UnknownType(t) => {
            assert_eq!(t, kind);
            assert!(FrameType::from_octet(t).is_none());
        }
        FrameError::TooLarge { size, max } => {
            assert_eq!((size, max), (total, decoder.frame_max()));
            assert!(size > max as u64);
        }
        FrameError::BadFrameEnd(end) => {
            assert_ne!(end, FRAME_END);
            assert_eq!(buf[total as usize - 1], end);
        }
        FrameError::BadHeartbeat(ch) => {
            assert_eq!((kind, ch), (FrameType::Heartbeat as u8, channel));
            assert!(channel != 0 || total != FRAME_OVERHEAD as u64);
        }
        _ => panic!("the decoder cut frames only: {err}"),
    }
}

/// Bytes as the broker sends them to lapin, through the screen
/// ([`crate::protocol::screen`]), whole and split at a data-derived point
/// (the same bytes out, the same folds). Every content header that comes
/// out passes nackd's limits (so lapin's recursive parser is safe with it),
/// every method decodes, and each folded header, sent back by the client,
/// goes out to the broker as the original, byte for byte.
// Whole because: one target, its invariants checked in the order they hold.
#[allow(clippy::too_many_lines)]
pub fn screen(data: &[u8]) {
    use crate::protocol::content;
    use crate::protocol::method;
    use crate::protocol::screen::{Screen, ScreenError};

    let run = |chunks: &[&[u8]]| {
        let mut s = Screen::new(*b"fuzzkey!", 1 << 20);
        let (mut buf, mut out) = (BytesMut::new(), BytesMut::new());
        let mut folds = Vec::new();
        let mut end = None;
        for chunk in chunks {
            buf.extend_from_slice(chunk);
            if let Err(e) = s.from_broker(&mut buf, &mut out, &mut folds) {
                end = Some(e.to_string());
                break;
            }
        }
        (s, out, folds.len(), end)
    };
    let whole = run(&[data]);
    let (head, tail) = data.split_at(split_point(data));
    let split = run(&[head, tail]);
    assert_eq!((&whole.1, whole.2, &whole.3), (&split.1, split.2, &split.3));
    let (mut s, mut out, folds, _) = whole;

    // What lapin receives: frames nackd's decoders take.
    let decoder = FrameDecoder::new(0);
    let mut sent = Vec::new();
    let mut originals = BytesMut::from(data);
    let original = FrameDecoder::new(0);
    let mut seen_folds = 0;
    while let Some(frame) = decoder.decode(&mut out).expect("the screen emits frames") {
        let orig = original
            .decode(&mut originals)
            .expect("the input had this frame")
            .expect("whole");
        match frame.kind {
            FrameType::Method => {
                method::decode_any(frame.payload_slice()).expect("a method the screen passed");
                assert_eq!(frame.raw, orig.raw);
            }
            FrameType::Header => {
                content::decode_header(frame.payload_slice()).expect("a header the screen passed");
                if frame.raw != orig.raw {
                    seen_folds += 1;
                    sent.push((frame, orig));
                }
            }
            FrameType::Body | FrameType::Heartbeat => assert_eq!(frame.raw, orig.raw),
        }
    }
    assert!(out.is_empty());
    assert_eq!(seen_folds, folds);

    // The client publishes each folded message again: the original goes out.
    let mut up = BytesMut::from(&PROTOCOL_HEADER[..]);
    for (folded, _) in &sent {
        up.extend_from_slice(&folded.raw);
    }
    let mut to_broker = BytesMut::new();
    let restored = s.from_client(&mut up, &mut to_broker);
    assert!(!matches!(restored, Err(ScreenError::Client(_))));
    assert_eq!(restored.unwrap(), sent.len());
    let mut to_broker = to_broker.split_off(PROTOCOL_HEADER.len());
    for (_, orig) in &sent {
        let back = decoder.decode(&mut to_broker).unwrap().unwrap();
        assert_eq!(back.raw, orig.raw, "restored byte for byte");
    }
    assert_eq!(s.held(), 0);
}

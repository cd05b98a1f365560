//! Selective method decoding and the frames nackd emits itself.
//!
//! nackd decodes only the methods it must understand (handshake, channel
//! lifecycle, consumers, deliveries, acks, tx and confirm mode) with
//! amq-protocol's generated types; every other method stays opaque bytes.

use amq_protocol::frame::{gen_frame, AMQPFrame};
use amq_protocol::protocol::{basic, channel, connection, parse_class, AMQPClass};
use bytes::{BufMut, Bytes, BytesMut};
use nom::combinator::all_consuming;
use nom::Parser;

use crate::protocol::content;
use crate::protocol::frame::{FrameError, FrameType, FRAME_END, FRAME_OVERHEAD};
use crate::protocol::reply::ReplyCode;

/// Class and method id, the first four octets of a method payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MethodId {
    /// Class id (10 connection, 20 channel, 50 queue, 60 basic, ...).
    pub class: u16,
    /// Method id within the class.
    pub method: u16,
}

/// Well-known method ids.
pub mod ids {
    use super::MethodId;
    const fn m(class: u16, method: u16) -> MethodId {
        MethodId { class, method }
    }
    pub const CONNECTION_START: MethodId = m(10, 10);
    pub const CONNECTION_START_OK: MethodId = m(10, 11);
    pub const CONNECTION_TUNE: MethodId = m(10, 30);
    pub const CONNECTION_TUNE_OK: MethodId = m(10, 31);
    pub const CONNECTION_OPEN: MethodId = m(10, 40);
    pub const CONNECTION_OPEN_OK: MethodId = m(10, 41);
    pub const CONNECTION_CLOSE: MethodId = m(10, 50);
    pub const CONNECTION_CLOSE_OK: MethodId = m(10, 51);
    pub const CONNECTION_BLOCKED: MethodId = m(10, 60);
    pub const CONNECTION_UNBLOCKED: MethodId = m(10, 61);
    pub const CHANNEL_OPEN: MethodId = m(20, 10);
    pub const CHANNEL_OPEN_OK: MethodId = m(20, 11);
    pub const CHANNEL_CLOSE: MethodId = m(20, 40);
    pub const CHANNEL_CLOSE_OK: MethodId = m(20, 41);
    pub const EXCHANGE_DECLARE: MethodId = m(40, 10);
    pub const EXCHANGE_DECLARE_OK: MethodId = m(40, 11);
    pub const EXCHANGE_DELETE: MethodId = m(40, 20);
    pub const EXCHANGE_DELETE_OK: MethodId = m(40, 21);
    pub const QUEUE_DECLARE: MethodId = m(50, 10);
    pub const QUEUE_DECLARE_OK: MethodId = m(50, 11);
    pub const BASIC_CONSUME: MethodId = m(60, 20);
    pub const BASIC_CONSUME_OK: MethodId = m(60, 21);
    pub const BASIC_CANCEL: MethodId = m(60, 30);
    pub const BASIC_CANCEL_OK: MethodId = m(60, 31);
    pub const BASIC_PUBLISH: MethodId = m(60, 40);
    pub const BASIC_RETURN: MethodId = m(60, 50);
    pub const BASIC_DELIVER: MethodId = m(60, 60);
    pub const BASIC_GET: MethodId = m(60, 70);
    pub const BASIC_GET_OK: MethodId = m(60, 71);
    pub const BASIC_GET_EMPTY: MethodId = m(60, 72);
    pub const BASIC_ACK: MethodId = m(60, 80);
    pub const BASIC_REJECT: MethodId = m(60, 90);
    pub const BASIC_RECOVER_ASYNC: MethodId = m(60, 100);
    pub const BASIC_RECOVER: MethodId = m(60, 110);
    pub const BASIC_RECOVER_OK: MethodId = m(60, 111);
    pub const BASIC_NACK: MethodId = m(60, 120);
    pub const TX_SELECT: MethodId = m(90, 10);
    pub const TX_SELECT_OK: MethodId = m(90, 11);
    pub const CONFIRM_SELECT: MethodId = m(85, 10);
    pub const CONFIRM_SELECT_OK: MethodId = m(85, 11);
}

/// The methods nackd decodes; everything else is forwarded opaque.
/// `basic.publish` and `basic.return` are not decoded: their id is enough.
const DECODED: &[MethodId] = &[
    ids::CONNECTION_START,
    ids::CONNECTION_START_OK,
    ids::CONNECTION_TUNE,
    ids::CONNECTION_TUNE_OK,
    ids::CONNECTION_OPEN,
    ids::CONNECTION_OPEN_OK,
    ids::CONNECTION_CLOSE,
    ids::CONNECTION_CLOSE_OK,
    ids::CONNECTION_BLOCKED,
    ids::CONNECTION_UNBLOCKED,
    ids::CHANNEL_OPEN,
    ids::CHANNEL_OPEN_OK,
    ids::CHANNEL_CLOSE,
    ids::CHANNEL_CLOSE_OK,
    ids::EXCHANGE_DECLARE,
    ids::EXCHANGE_DECLARE_OK,
    ids::EXCHANGE_DELETE,
    ids::EXCHANGE_DELETE_OK,
    ids::QUEUE_DECLARE,
    ids::QUEUE_DECLARE_OK,
    ids::BASIC_CONSUME,
    ids::BASIC_CONSUME_OK,
    ids::BASIC_CANCEL,
    ids::BASIC_CANCEL_OK,
    ids::BASIC_DELIVER,
    ids::BASIC_GET,
    ids::BASIC_GET_OK,
    ids::BASIC_GET_EMPTY,
    ids::BASIC_ACK,
    ids::BASIC_REJECT,
    ids::BASIC_RECOVER_ASYNC,
    ids::BASIC_RECOVER,
    ids::BASIC_RECOVER_OK,
    ids::BASIC_NACK,
    ids::TX_SELECT,
    ids::TX_SELECT_OK,
    ids::CONFIRM_SELECT,
    ids::CONFIRM_SELECT_OK,
];

impl MethodId {
    /// Reads the class and method id at the start of a method payload.
    pub fn peek(payload: &[u8]) -> Result<Self, FrameError> {
        match payload {
            [c0, c1, m0, m1, ..] => Ok(Self {
                class: u16::from_be_bytes([*c0, *c1]),
                method: u16::from_be_bytes([*m0, *m1]),
            }),
            _ => Err(FrameError::Syntax("method frame shorter than its ids")),
        }
    }

    /// Whether a content header and body frames follow this method.
    pub fn carries_content(self) -> bool {
        matches!(
            self,
            ids::BASIC_PUBLISH | ids::BASIC_RETURN | ids::BASIC_DELIVER | ids::BASIC_GET_OK
        )
    }

    /// Whether nackd decodes this method (see [`decode`]).
    pub fn is_decoded(self) -> bool {
        DECODED.contains(&self)
    }
}

/// Decodes a method payload if it is one nackd must understand.
/// `Ok(None)`: an opaque method, to be forwarded as it is.
pub fn decode(payload: &[u8]) -> Result<Option<AMQPClass>, FrameError> {
    if !MethodId::peek(payload)?.is_decoded() {
        return Ok(None);
    }
    decode_any(payload).map(Some)
}

/// The arguments of a `basic.deliver`, read in place: every delivery the
/// broker sends passes through here, so it borrows from the frame instead
/// of allocating amq-protocol's owned strings (a measured third of the
/// session's instructions per pass-through message went to that).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeliverArgs<'a> {
    /// The consumer it is delivered to.
    pub consumer_tag: &'a str,
    /// Its tag on the channel.
    pub delivery_tag: u64,
    /// The broker delivered it before.
    pub redelivered: bool,
    /// The exchange it was published to.
    pub exchange: &'a str,
    /// The routing key it was published with.
    pub routing_key: &'a str,
}

/// Reads a `basic.deliver` payload (class and method id included) as
/// [`decode_any`] would, without allocating: the same fields, and an error
/// wherever amq-protocol's parser gives one (short strings that are not
/// UTF-8, a payload too short or too long). `core/tests/fuzz_props.rs`
/// checks the two agree on random payloads.
pub fn peek_deliver(payload: &[u8]) -> Result<DeliverArgs<'_>, FrameError> {
    let bad = || FrameError::Syntax("method arguments");
    let mut rest = payload.get(4..).ok_or_else(bad)?;
    let consumer_tag = take_short(&mut rest)?;
    let (tag, tail) = rest.split_first_chunk::<8>().ok_or_else(bad)?;
    let (&bits, tail) = tail.split_first().ok_or_else(bad)?;
    rest = tail;
    let exchange = take_short(&mut rest)?;
    let routing_key = take_short(&mut rest)?;
    if !rest.is_empty() {
        return Err(bad());
    }
    Ok(DeliverArgs {
        consumer_tag,
        delivery_tag: u64::from_be_bytes(*tag),
        redelivered: bits & 1 != 0,
        exchange,
        routing_key,
    })
}

/// The arguments of a `basic.publish`, read in place (as
/// [`peek_deliver`]): asked of every publish of a session that
/// intercepts (to find those to delayed exchanges).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublishArgs<'a> {
    /// The exchange it is published to.
    pub exchange: &'a str,
    /// Its routing key.
    pub routing_key: &'a str,
    /// The `mandatory` flag.
    pub mandatory: bool,
}

/// Reads a `basic.publish` payload (class and method id included)
/// without allocating; an error where amq-protocol's parser gives one.
pub fn peek_publish(payload: &[u8]) -> Result<PublishArgs<'_>, FrameError> {
    let bad = || FrameError::Syntax("method arguments");
    // class, method, reserved-1 (ticket).
    let mut rest = payload.get(6..).ok_or_else(bad)?;
    let exchange = take_short(&mut rest)?;
    let routing_key = take_short(&mut rest)?;
    let (&bits, tail) = rest.split_first().ok_or_else(bad)?;
    if !tail.is_empty() {
        return Err(bad());
    }
    Ok(PublishArgs {
        exchange,
        routing_key,
        mandatory: bits & 1 != 0,
    })
}

/// The exchange of a `basic.publish` payload [`peek_publish`] refuses
/// (say its routing key is not UTF-8, which RabbitMQ takes), if that much
/// reads.
pub fn publish_exchange(payload: &[u8]) -> Option<&str> {
    let mut rest = payload.get(6..)?;
    take_short(&mut rest).ok()
}

/// A short string (one length octet, then UTF-8) off the front of `rest`.
fn take_short<'a>(rest: &mut &'a [u8]) -> Result<&'a str, FrameError> {
    let bad = || FrameError::Syntax("method arguments");
    let (&len, tail) = rest.split_first().ok_or_else(bad)?;
    let (text, tail) = tail.split_at_checked(len as usize).ok_or_else(bad)?;
    *rest = tail;
    std::str::from_utf8(text).map_err(|_| bad())
}

/// Decodes any method payload amq-protocol knows (used by tests and fuzzing).
pub fn decode_any(payload: &[u8]) -> Result<AMQPClass, FrameError> {
    if let Some(table) = table_body(payload) {
        content::check_nesting(table, true)?;
    }
    all_consuming(parse_class)
        .parse(payload)
        .map(|(_, class)| class)
        .map_err(|_| FrameError::Syntax("method arguments"))
}

/// The field table a method carries (after its 4-octet length), found
/// without decoding, so its nesting can be checked before amq-protocol
/// recurses into it. `None` for methods without a table and for payloads too
/// short to hold it (amq-protocol then fails before reaching the table).
fn table_body(payload: &[u8]) -> Option<&[u8]> {
    let id = MethodId::peek(payload).ok()?;
    // Octets before the first short string, short strings, bit octets.
    let (fixed, shorts, bits) = match (id.class, id.method) {
        (10, 10) => (2, 0, 0),            // connection.start: version major, minor
        (10, 11) => (0, 0, 0),            // connection.start-ok
        (40, 10) => (2, 2, 1),            // exchange.declare: reserved, exchange, type
        (40, 30) | (40, 40) => (2, 3, 1), // exchange.bind/unbind: reserved, dest, source, key
        (50, 10) => (2, 1, 1),            // queue.declare: reserved, queue
        (50, 20) => (2, 3, 1),            // queue.bind: reserved, queue, exchange, key
        (50, 50) => (2, 3, 0),            // queue.unbind: reserved, queue, exchange, key
        (60, 20) => (2, 2, 1),            // basic.consume: reserved, queue, consumer tag
        _ => return None,
    };
    let mut at = 4 + fixed;
    for _ in 0..shorts {
        at += 1 + usize::from(*payload.get(at)?);
    }
    let at = at + bits;
    let len = u32::from_be_bytes(payload.get(at..at + 4)?.try_into().ok()?) as usize;
    payload.get(at + 4..(at + 4).checked_add(len)?)
}

/// Encodes a method frame on `channel`.
pub fn encode(channel: u16, class: &AMQPClass) -> Bytes {
    let frame = AMQPFrame::Method(channel, class.clone());
    let out = cookie_factory::gen_simple(gen_frame(&frame), Vec::with_capacity(64))
        .expect("writing into a Vec cannot fail");
    Bytes::from(out)
}

/// `basic.ack` from nackd to the broker.
pub fn ack(channel: u16, delivery_tag: u64, multiple: bool) -> Bytes {
    encode(
        channel,
        &AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag,
            multiple,
        })),
    )
}

/// `basic.nack` from nackd to the broker.
pub fn nack(channel: u16, delivery_tag: u64, multiple: bool, requeue: bool) -> Bytes {
    encode(
        channel,
        &AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag,
            multiple,
            requeue,
        })),
    )
}

/// `basic.reject` from nackd to the broker.
pub fn reject(channel: u16, delivery_tag: u64, requeue: bool) -> Bytes {
    encode(
        channel,
        &AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
            delivery_tag,
            requeue,
        })),
    )
}

fn short(text: &str) -> amq_protocol::types::ShortString {
    let mut end = text.len().min(255);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].into()
}

/// `connection.close` with a reply code and text (cut to 255 octets).
pub fn connection_close(code: ReplyCode, text: &str, cause: Option<MethodId>) -> Bytes {
    let cause = cause.unwrap_or(MethodId {
        class: 0,
        method: 0,
    });
    encode(
        0,
        &AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: code.code(),
            reply_text: short(text),
            class_id: cause.class,
            method_id: cause.method,
        })),
    )
}

/// `connection.close-ok`.
pub fn connection_close_ok() -> Bytes {
    encode(
        0,
        &AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
    )
}

/// `channel.close` with a reply code and text.
pub fn channel_close(channel: u16, code: ReplyCode, text: &str) -> Bytes {
    encode(
        channel,
        &AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: code.code(),
            reply_text: short(text),
            class_id: 0,
            method_id: 0,
        })),
    )
}

/// A heartbeat frame.
pub fn heartbeat() -> Bytes {
    Bytes::from_static(&[FrameType::Heartbeat as u8, 0, 0, 0, 0, 0, 0, FRAME_END])
}

/// Appends a content (header frame + body frames) to `out`, splitting the
/// body so that no frame exceeds `frame_max` (0 = no limit).
pub fn put_content(
    out: &mut BytesMut,
    channel: u16,
    header_payload: &[u8],
    body: &[u8],
    frame_max: u32,
) {
    put_frame(out, FrameType::Header, channel, header_payload);
    let chunk = match frame_max {
        0 => body.len().max(1),
        max => (max as usize).saturating_sub(FRAME_OVERHEAD).max(1),
    };
    for piece in body.chunks(chunk) {
        put_frame(out, FrameType::Body, channel, piece);
    }
}

/// Appends one frame around `payload` to `out`.
pub fn put_frame(out: &mut BytesMut, kind: FrameType, channel: u16, payload: &[u8]) {
    out.reserve(payload.len() + FRAME_OVERHEAD);
    out.put_u8(kind as u8);
    out.put_u16(channel);
    out.put_u32(payload.len() as u32);
    out.put_slice(payload);
    out.put_u8(FRAME_END);
}

/// A complete `basic.publish` (method, header, bodies) as nackd sends it.
pub fn publish(
    channel: u16,
    exchange: &str,
    routing_key: &str,
    mandatory: bool,
    header_payload: &[u8],
    body: &[u8],
    frame_max: u32,
) -> BytesMut {
    let method = encode(
        channel,
        &AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: short(exchange),
            routing_key: short(routing_key),
            mandatory,
            immediate: false,
        })),
    );
    let mut out = BytesMut::with_capacity(method.len() + header_payload.len() + body.len() + 64);
    out.extend_from_slice(&method);
    put_content(&mut out, channel, header_payload, body, frame_max);
    out
}

#[cfg(test)]
mod tests;

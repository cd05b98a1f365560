//! The structured round trip: what nackd encodes, its decoder reads back
//! as the same value, cut out of the stream whole or byte by byte.

use amq_protocol::protocol::{basic, AMQPClass};
use amq_protocol::types::AMQPValue;
use bytes::BytesMut;

use super::payload;
use super::spec::{FrameSpec, HeaderSpec};
use super::value::short;
use super::{decode_chunks, Decoded};
use crate::protocol::content::{self, ContentHeader};
use crate::protocol::frame::{Frame, FrameDecoder, FrameError, FrameType, FRAME_OVERHEAD};
use crate::protocol::method::{self, ids, MethodId};

/// Encodes `spec`, decodes it and asserts decode(encode(x)) == x.
pub fn roundtrip(spec: &FrameSpec) {
    match spec {
        FrameSpec::Method { channel, method: m } => {
            let class = m.class();
            let wire = method::encode(*channel, &class);
            let payload = cut(&wire, FrameType::Method, *channel).payload();
            assert!(
                MethodId::peek(&payload).expect("ids").is_decoded(),
                "{class:?}"
            );
            assert_eq!(method::decode(&payload), Ok(Some(class)));
        }
        FrameSpec::Header { channel, header } => {
            let expected = header.content_header(header.body_size);
            let payload = content::encode_header(60, header.body_size, &expected.properties);
            let wire = framed(FrameType::Header, *channel, &payload);
            assert_eq!(cut(&wire, FrameType::Header, *channel).payload(), payload);
            check_header(&payload, &expected, header.retry);
        }
        FrameSpec::Body { channel, body } => {
            let wire = framed(FrameType::Body, *channel, body);
            assert_eq!(cut(&wire, FrameType::Body, *channel).payload(), body[..]);
        }
        FrameSpec::Heartbeat => {
            cut(&method::heartbeat(), FrameType::Heartbeat, 0);
        }
        FrameSpec::Publish {
            channel,
            exchange,
            routing_key,
            mandatory,
            header,
            body,
            frame_max,
        } => {
            // At least one body octet per frame; small limits cut the body fine.
            let frame_max = u32::from(*frame_max % 4096) + FRAME_OVERHEAD as u32 + 1;
            let publish = basic::Publish {
                exchange: short(exchange),
                routing_key: short(routing_key),
                mandatory: *mandatory,
                immediate: false,
            };
            check_publish(*channel, publish, header, body, frame_max);
        }
    }
}

fn framed(kind: FrameType, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = BytesMut::new();
    method::put_frame(&mut out, kind, channel, payload);
    out.to_vec()
}

/// The one frame of `wire`: accepted at exactly its size, refused one
/// octet below on the header, and complete only with its last octet.
fn cut(wire: &[u8], kind: FrameType, channel: u16) -> Frame {
    let size = wire.len() as u32;
    let exact = FrameDecoder::new(size);
    let frame = payload::one_frame(wire);
    assert_eq!(
        (frame.kind, frame.channel, &frame.raw[..]),
        (kind, channel, wire)
    );
    assert_eq!(
        exact.decode(&mut BytesMut::from(wire)),
        Ok(Some(frame.clone()))
    );
    assert_eq!(
        FrameDecoder::new(size - 1).decode(&mut BytesMut::from(wire)),
        Err(FrameError::TooLarge {
            size: size.into(),
            max: size - 1
        })
    );
    let mut buf = BytesMut::new();
    for (i, octet) in wire.iter().enumerate() {
        assert_eq!(exact.decode(&mut buf), Ok(None), "complete at octet {i}");
        buf.extend_from_slice(&[*octet]);
    }
    assert_eq!(exact.decode(&mut buf), Ok(Some(frame.clone())));
    frame
}

fn check_header(payload: &[u8], expected: &ContentHeader, retry: i64) {
    assert_eq!(content::decode_header(payload).as_ref(), Ok(expected));
    assert_eq!(content::body_size(payload), Ok(expected.body_size));
    let has_table = content::raw_headers(payload).expect("layout").is_some();
    assert_eq!(has_table, expected.properties.headers().is_some());
    payload::header(payload);
    let edit = [("x-retry-count", AMQPValue::LongLongInt(retry))];
    let out = content::rewrite_headers(payload, &edit).expect("rewrite");
    let mut headers = expected.properties.headers().clone().unwrap_or_default();
    headers.insert("x-retry-count".into(), AMQPValue::LongLongInt(retry));
    let want = ContentHeader {
        properties: expected.properties.clone().with_headers(headers),
        ..expected.clone()
    };
    assert_eq!(content::decode_header(&out), Ok(want));
}

fn check_publish(
    channel: u16,
    publish: basic::Publish,
    header: &HeaderSpec,
    body: &[u8],
    frame_max: u32,
) {
    let expected = header.content_header(body.len() as u64);
    let header_payload = content::encode_header(60, body.len() as u64, &expected.properties);
    let wire = method::publish(
        channel,
        publish.exchange.as_str(),
        publish.routing_key.as_str(),
        publish.mandatory,
        &header_payload,
        body,
        frame_max,
    );
    let decoder = FrameDecoder::new(0);
    let whole = decode_chunks(&decoder, &[&wire]);
    let bytes: Vec<&[u8]> = wire.chunks(1).collect();
    assert_eq!(decode_chunks(&decoder, &bytes), whole, "byte by byte");
    let Decoded { frames, end } = whole;
    assert_eq!(end, Ok(0), "nothing left over");
    let [method_frame, header_frame, bodies @ ..] = &frames[..] else {
        panic!("publish without method and header: {frames:?}");
    };
    let id = MethodId::peek(&method_frame.payload()).expect("ids");
    assert!(id == ids::BASIC_PUBLISH && id.carries_content());
    let class = method::decode_any(&method_frame.payload());
    assert_eq!(
        class,
        Ok(AMQPClass::Basic(basic::AMQPMethod::Publish(publish)))
    );
    assert_eq!(
        content::decode_header(&header_frame.payload()),
        Ok(expected)
    );
    assert!(frames.iter().all(|f| f.channel == channel));
    assert_eq!(header_frame.kind, FrameType::Header);
    assert!(bodies
        .iter()
        .all(|f| f.kind == FrameType::Body && f.raw.len() as u32 <= frame_max));
    if let [full @ .., _] = bodies {
        assert!(
            full.iter().all(|f| f.raw.len() as u32 == frame_max),
            "only the last body frame is short"
        );
    }
    let joined: Vec<u8> = bodies.iter().flat_map(|f| f.payload()).collect();
    assert_eq!(joined, body, "body frames carry the body");
}

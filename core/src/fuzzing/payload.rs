//! Invariants of method and content-header payload decoding, for payloads
//! of any shape.

use std::collections::BTreeSet;
use std::fmt::Debug;

use amq_protocol::protocol::{basic, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use bytes::BytesMut;

use crate::protocol::content::{self, ContentHeader, RawEntry};
use crate::protocol::frame::{Frame, FrameDecoder, FrameError, FrameType};
use crate::protocol::method::{self, MethodId};

/// Equal, or equal but for NaNs in the same places (NaN != NaN).
pub(super) fn same<T: PartialEq + Debug>(a: &T, b: &T) -> bool {
    a == b || format!("{a:?}") == format!("{b:?}")
}

/// The one frame in `wire`, which nackd itself encoded.
pub(super) fn one_frame(wire: &[u8]) -> Frame {
    let mut buf = BytesMut::from(wire);
    let frame = FrameDecoder::new(0)
        .decode(&mut buf)
        .expect("an encoded frame is valid")
        .expect("an encoded frame is complete");
    assert!(buf.is_empty(), "one frame, nothing after it");
    frame
}

/// A method payload: `decode` agrees with `decode_any` on the methods nackd
/// decodes, and whatever decodes re-encodes to the same value.
pub(super) fn method(payload: &[u8]) {
    let id = MethodId::peek(payload);
    assert_eq!(id.is_ok(), payload.len() >= 4);
    let Ok(id) = id else { return };
    let any = method::decode_any(payload);
    match method::decode(payload) {
        Ok(None) => assert!(!id.is_decoded(), "{id:?} is decoded"),
        decoded => {
            assert!(id.is_decoded(), "{id:?} is opaque");
            assert!(
                same(&decoded, &any.clone().map(Some)),
                "{decoded:?} vs {any:?}"
            );
        }
    }
    if id == method::ids::BASIC_DELIVER {
        deliver_read_in_place(payload, &any);
    }
    if id == method::ids::BASIC_PUBLISH {
        publish_read_in_place(payload, &any);
    }
    if let Ok(class) = any {
        reencode_method(&class);
    }
}

/// [`method::peek_deliver`] (the session's allocation-free reader) agrees
/// with amq-protocol's decoder: the same fields, or both refuse.
pub(super) fn deliver_read_in_place(payload: &[u8], any: &Result<AMQPClass, FrameError>) {
    let peeked = method::peek_deliver(payload);
    match (any, &peeked) {
        (Ok(AMQPClass::Basic(basic::AMQPMethod::Deliver(d))), Ok(p)) => {
            assert_eq!(p.consumer_tag, d.consumer_tag.as_str());
            assert_eq!(p.delivery_tag, d.delivery_tag);
            assert_eq!(p.redelivered, d.redelivered);
            assert_eq!(p.exchange, d.exchange.as_str());
            assert_eq!(p.routing_key, d.routing_key.as_str());
        }
        (Err(_), Err(_)) => {}
        _ => panic!("peek_deliver {peeked:?} vs decode_any {any:?}"),
    }
}

/// [`method::peek_publish`] (read of publishes while an exchange is
/// delayed) agrees with amq-protocol's decoder: the same fields, or both
/// refuse.
pub(super) fn publish_read_in_place(payload: &[u8], any: &Result<AMQPClass, FrameError>) {
    let peeked = method::peek_publish(payload);
    match (any, &peeked) {
        (Ok(AMQPClass::Basic(basic::AMQPMethod::Publish(d))), Ok(p)) => {
            assert_eq!(p.exchange, d.exchange.as_str());
            assert_eq!(p.routing_key, d.routing_key.as_str());
            assert_eq!(p.mandatory, d.mandatory);
        }
        (Err(_), Err(_)) => {}
        _ => panic!("peek_publish {peeked:?} vs decode_any {any:?}"),
    }
}

fn reencode_method(class: &AMQPClass) {
    let wire = method::encode(7, class);
    let frame = one_frame(&wire);
    assert_eq!((frame.kind, frame.channel), (FrameType::Method, 7));
    let again = method::decode_any(&frame.payload()).expect("a re-encoded method decodes");
    assert!(same(&again, class), "{again:?} vs {class:?}");
    assert_eq!(
        method::encode(7, &again),
        wire,
        "encode . decode is a fixpoint"
    );
}

/// A content-header payload: decode, re-encode, body size, the raw headers
/// table and its rewrite all agree.
pub(super) fn header(payload: &[u8]) {
    let size = payload
        .get(4..12)
        .map(|b| u64::from_be_bytes(b.try_into().expect("8 octets")));
    assert_eq!(content::body_size(payload).ok(), size);
    let decoded = content::decode_header(payload);
    let raw = content::raw_headers(payload);
    if let Ok(h) = &decoded {
        reencode_header(h);
        match (
            raw.as_ref().expect("a decodable header has a layout"),
            h.properties.headers(),
        ) {
            (Some(table), Some(map)) => {
                let entries = content::table_entries(table).expect("a decodable table splits");
                let keys: BTreeSet<&[u8]> = entries.iter().map(|e| e.key).collect();
                assert_eq!(keys.len(), map.inner().len(), "one value per distinct key");
            }
            (None, None) => {}
            other => panic!("headers flag read two ways: {other:?}"),
        }
    }
    let unchanged = content::rewrite_headers(payload, &[]);
    let Ok(raw) = raw else {
        assert!(unchanged.is_err(), "rewrite of a header without a layout");
        return;
    };
    match raw.map(content::table_entries) {
        Some(Ok(entries)) => {
            check_entries(raw.expect("some"), &entries);
            assert_eq!(unchanged.as_deref(), Ok(payload), "no edit = same bytes");
            rewrite(payload, decoded.ok(), &entries);
        }
        Some(Err(_)) => assert!(unchanged.is_err(), "rewrite of a table that does not split"),
        None => {
            let out = unchanged.expect("no table to split");
            assert_eq!(out.len(), payload.len() + 4, "an empty table added");
            assert_eq!(content::raw_headers(&out), Ok(Some(&[][..])));
            rewrite(payload, decoded.ok(), &[]);
        }
    }
}

fn reencode_header(h: &ContentHeader) {
    let payload = content::encode_header(h.class_id, h.body_size, &h.properties);
    let again = content::decode_header(&payload).expect("a re-encoded header decodes");
    assert!(same(&again, h), "{again:?} vs {h:?}");
    let twice = content::encode_header(again.class_id, again.body_size, &again.properties);
    assert_eq!(twice, payload, "encode . decode is a fixpoint");
}

/// Bytes given as a field table (after its length): entries tile it.
pub(super) fn table(data: &[u8]) {
    if let Ok(entries) = content::table_entries(data) {
        check_entries(data, &entries);
    }
}

fn check_entries(table: &[u8], entries: &[RawEntry<'_>]) {
    let tiled: Vec<u8> = entries
        .iter()
        .flat_map(|e| e.bytes.iter().copied())
        .collect();
    assert_eq!(tiled, table, "entries tile the table");
    for e in entries {
        assert_eq!(usize::from(e.bytes[0]), e.key.len());
        assert_eq!(&e.bytes[1..1 + e.key.len()], e.key);
    }
}

/// Rewrites `x-retry-count` and the first existing key: the other entries
/// keep their bytes, nothing outside the table moves, and a header that
/// decoded before decodes after with exactly those keys changed.
fn rewrite(payload: &[u8], decoded: Option<ContentHeader>, entries: &[RawEntry<'_>]) {
    let mut set = vec![(
        "x-retry-count",
        AMQPValue::LongLongInt(payload.len() as i64),
    )];
    if let Some(key) = entries
        .first()
        .and_then(|e| std::str::from_utf8(e.key).ok())
    {
        set.push((key, AMQPValue::LongString(LongString::from("rewritten"))));
    }
    let out = content::rewrite_headers(payload, &set).expect("rewrite of a table that splits");
    let table = content::raw_headers(&out).expect("layout").expect("table");
    let got = content::table_entries(table).expect("a rewritten table splits");
    let kept: Vec<&[u8]> = entries
        .iter()
        .filter(|e| !set.iter().any(|(k, _)| k.as_bytes() == e.key))
        .map(|e| e.bytes)
        .collect();
    assert_eq!(got.len(), kept.len() + set.len());
    assert!(
        got.iter().zip(&kept).all(|(g, k)| g.bytes == *k),
        "kept entries keep their bytes and order"
    );
    assert!(got[kept.len()..]
        .iter()
        .zip(&set)
        .all(|(g, (k, _))| g.key == k.as_bytes()));
    assert_eq!(out[..12], payload[..12], "class, weight, body size");
    assert_eq!(
        out[12..14],
        [payload[12] | 0x20, payload[13]],
        "flags + headers"
    );
    let Some(before) = decoded else { return };
    let after = content::decode_header(&out).expect("a decodable header stays decodable");
    assert_eq!(
        (after.class_id, after.body_size),
        (before.class_id, before.body_size)
    );
    let mut expected = before.properties.headers().clone().unwrap_or_default();
    for (key, value) in &set {
        expected.insert((*key).into(), value.clone());
    }
    assert!(
        same(after.properties.headers(), &Some(expected)),
        "headers = before + edits"
    );
    let strip = |h: &ContentHeader| h.properties.clone().with_headers(FieldTable::default());
    assert!(
        same(&strip(&after), &strip(&before)),
        "other properties untouched"
    );
}

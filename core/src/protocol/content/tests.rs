use super::*;
use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::types::{FieldTable, LongString};
use std::collections::BTreeMap;

/// One entry per field-table type RabbitMQ accepts, written by hand as the
/// wire carries it: (key, tag, value bytes).
fn every_type() -> Vec<(&'static str, u8, Vec<u8>)> {
    let long_string = |s: &[u8]| [&(s.len() as u32).to_be_bytes()[..], s].concat();
    vec![
        ("S", b'S', long_string(b"long string \xe2\x9c\x93")),
        ("T", b'T', 1_700_000_000u64.to_be_bytes().to_vec()),
        ("b", b'b', vec![0x80]),
        ("B", b'B', vec![0xff]),
        ("s", b's', (-2i16).to_be_bytes().to_vec()),
        ("u", b'u', 65_535u16.to_be_bytes().to_vec()),
        ("I", b'I', (-70_000i32).to_be_bytes().to_vec()),
        ("i", b'i', 4_000_000_000u32.to_be_bytes().to_vec()),
        ("d", b'd', 3.25f64.to_be_bytes().to_vec()),
        ("f", b'f', 1.5f32.to_be_bytes().to_vec()),
        ("l", b'l', i64::MIN.to_be_bytes().to_vec()),
        ("L", b'L', u64::MAX.to_be_bytes().to_vec()),
        ("t", b't', vec![1]),
        ("D", b'D', [&[2u8][..], &12345u32.to_be_bytes()].concat()),
        // nested table holding an 'L', and an array holding an 'L' and an 'S'
        ("F", b'F', {
            let inner = [&[1u8, b'k', b'L'][..], &7u64.to_be_bytes()].concat();
            [&(inner.len() as u32).to_be_bytes()[..], &inner].concat()
        }),
        ("A", b'A', {
            let inner = [&b"L"[..], &9u64.to_be_bytes(), b"S", &long_string(b"x")].concat();
            [&(inner.len() as u32).to_be_bytes()[..], &inner].concat()
        }),
        ("x", b'x', long_string(&[0, 1, 2, 0xfe])),
        ("V", b'V', vec![]),
    ]
}

fn table_bytes(entries: &[(&str, u8, Vec<u8>)]) -> Vec<u8> {
    let mut t = Vec::new();
    for (key, tag, value) in entries {
        t.push(key.len() as u8);
        t.extend_from_slice(key.as_bytes());
        t.push(*tag);
        t.extend_from_slice(value);
    }
    t
}

/// A content header with content-type, content-encoding, headers, then more
/// properties after the table, so a splice that misplaces bytes shows.
fn header_with(table: &[u8]) -> Vec<u8> {
    let flags: u16 = (1 << 15) | (1 << 14) | (1 << 13) | (1 << 12) | (1 << 7);
    let mut p = vec![0, 60, 0, 0];
    p.extend_from_slice(&1024u64.to_be_bytes());
    p.extend_from_slice(&flags.to_be_bytes());
    p.extend_from_slice(&[16]);
    p.extend_from_slice(b"application/json");
    p.extend_from_slice(&[4]);
    p.extend_from_slice(b"gzip");
    p.extend_from_slice(&(table.len() as u32).to_be_bytes());
    p.extend_from_slice(table);
    p.push(2); // delivery-mode
    p.extend_from_slice(&[5]);
    p.extend_from_slice(b"id-42"); // message-id
    p
}

fn entries_by_key(table: &[u8]) -> BTreeMap<Vec<u8>, Vec<u8>> {
    table_entries(table)
        .unwrap()
        .into_iter()
        .map(|e| (e.key.to_vec(), e.bytes.to_vec()))
        .collect()
}

#[test]
fn every_rabbitmq_type_decodes_through_amq_protocol() {
    let payload = header_with(&table_bytes(&every_type()));
    let header = decode_header(&payload).unwrap();
    assert_eq!(header.body_size, 1024);
    let props = &header.properties;
    assert_eq!(
        props.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    assert_eq!(*props.delivery_mode(), Some(2));
    assert_eq!(props.message_id().as_ref().unwrap().as_str(), "id-42");
    let headers = props.headers().as_ref().unwrap().inner();
    assert_eq!(headers.len(), every_type().len());
    assert_eq!(
        headers.get("L"),
        Some(&AMQPValue::LongLongInt(-1)),
        "L read as its 64 bits"
    );
    assert_eq!(headers.get("i"), Some(&AMQPValue::LongUInt(4_000_000_000)));
    assert_eq!(headers.get("s"), Some(&AMQPValue::ShortInt(-2)));
    assert_eq!(headers.get("V"), Some(&AMQPValue::Void));
}

/// amq-protocol writes 'L' back as 'l' (also inside tables and arrays). This is
/// why nackd does not re-encode headers through it.
#[test]
fn amq_protocol_reencoding_changes_the_l_tag() {
    let table = table_bytes(&every_type());
    let payload = header_with(&table);
    let header = decode_header(&payload).unwrap();
    let reencoded = encode_header(header.class_id, header.body_size, &header.properties);
    let again = entries_by_key(raw_headers(&reencoded).unwrap().unwrap());
    let original = entries_by_key(&table);
    let changed: Vec<&str> = original
        .iter()
        .filter(|(k, v)| again.get(*k) != Some(*v))
        .map(|(k, _)| std::str::from_utf8(k).unwrap())
        .collect();
    assert_eq!(changed, vec!["A", "F", "L"]);
    assert_eq!(again[&b"L".to_vec()][2], b'l');
}

#[test]
fn rewrite_keeps_every_type_byte_for_byte() {
    let table = table_bytes(&every_type());
    let payload = header_with(&table);
    assert_eq!(
        rewrite_headers(&payload, &[]).unwrap(),
        payload,
        "no edit = same bytes"
    );

    let set = [
        ("x-retry-count", AMQPValue::LongLongInt(3)),
        ("S", AMQPValue::LongString(LongString::from("replaced"))),
    ];
    let out = rewrite_headers(&payload, &set).unwrap();
    let before = entries_by_key(&table);
    let after = entries_by_key(raw_headers(&out).unwrap().unwrap());
    for (key, bytes) in &before {
        if key != b"S" {
            assert_eq!(
                after.get(key),
                Some(bytes),
                "{}",
                String::from_utf8_lossy(key)
            );
        }
    }
    let decoded = decode_header(&out).unwrap();
    let headers = decoded.properties.headers().as_ref().unwrap();
    assert_eq!(
        headers.inner().get("x-retry-count"),
        Some(&AMQPValue::LongLongInt(3))
    );
    assert_eq!(
        headers.inner().get("S"),
        Some(&AMQPValue::LongString("replaced".into()))
    );
    // Properties before and after the table are intact.
    assert_eq!(
        decoded.properties.message_id().as_ref().unwrap().as_str(),
        "id-42"
    );
    assert_eq!(
        decoded
            .properties
            .content_encoding()
            .as_ref()
            .unwrap()
            .as_str(),
        "gzip"
    );
    assert_eq!(decoded.body_size, 1024);
}

#[test]
fn rewrite_adds_a_table_to_a_message_without_headers() {
    let props = AMQPProperties::default()
        .with_content_type("text/plain".into())
        .with_priority(7)
        .with_reply_to("replies".into());
    let payload = encode_header(60, 5, &props);
    assert_eq!(raw_headers(&payload).unwrap(), None);
    let out = rewrite_headers(&payload, &[("x-retry-count", AMQPValue::LongLongInt(1))]).unwrap();
    let decoded = decode_header(&out).unwrap();
    let mut expected = FieldTable::default();
    expected.insert("x-retry-count".into(), AMQPValue::LongLongInt(1));
    assert_eq!(decoded.properties.headers().as_ref(), Some(&expected));
    assert_eq!(*decoded.properties.priority(), Some(7));
    assert_eq!(
        decoded.properties.reply_to().as_ref().unwrap().as_str(),
        "replies"
    );
    assert_eq!(
        decoded.properties.content_type().as_ref().unwrap().as_str(),
        "text/plain"
    );
}

#[test]
fn malformed_tables_and_headers_are_errors_not_panics() {
    assert!(table_entries(&[3, b'a']).is_err());
    assert!(table_entries(&[1, b'a', b'?']).is_err());
    assert!(rewrite_headers(&[0, 60, 0], &[]).is_err());
    let mut payload = header_with(&table_bytes(&every_type()));
    payload.truncate(40);
    assert!(rewrite_headers(&payload, &[]).is_err());
    assert!(decode_header(&payload).is_err());
    assert_eq!(body_size(&header_with(&[])).unwrap(), 1024);
}

/// `levels` field arrays nested in each other, as a field value ('A'...).
fn nested_arrays(levels: usize) -> Vec<u8> {
    let mut value = vec![b'V'];
    for _ in 0..levels {
        value = [&[b'A'][..], &(value.len() as u32).to_be_bytes(), &value].concat();
    }
    value
}

/// amq-protocol's table parser recurses once per level: ~1500 levels (7.5 KB,
/// far below frame_max) overflowed a 2 MiB tokio worker stack and aborted the
/// process. Found by reading the parser; the fuzz targets check it now.
#[test]
fn deeply_nested_headers_are_refused_without_recursing() {
    let table = [&[1u8, b'a'][..], &nested_arrays(10_000)].concat();
    let payload = header_with(&table);
    let deep = FrameError::Syntax("field table nested too deeply");
    assert_eq!(decode_header(&payload), Err(deep.clone()));
    assert_eq!(table_entries(&table), Err(deep.clone()));
    assert_eq!(rewrite_headers(&payload, &[]), Err(deep.clone()));

    // Nesting up to the limit still decodes, byte for byte.
    let table = [&[1u8, b'a'][..], &nested_arrays(MAX_TABLE_DEPTH - 1)].concat();
    let payload = header_with(&table);
    assert!(decode_header(&payload).is_ok());
    assert_eq!(rewrite_headers(&payload, &[]).unwrap(), payload);
    let table = [&[1u8, b'a'][..], &nested_arrays(MAX_TABLE_DEPTH)].concat();
    assert_eq!(decode_header(&header_with(&table)), Err(deep));
}

/// RabbitMQ 4.3 returns a message with its top-level header entries sorted
/// by key (seen on 4.3.6: "b","a" came back "a","b"; nested tables kept
/// their order): the same properties still, as a return is matched.
#[test]
fn same_properties_ignores_only_the_order_of_top_level_headers() {
    let entries = every_type();
    let payload = header_with(&table_bytes(&entries));
    let mut sorted = entries.clone();
    sorted.sort_by_key(|(key, _, _)| *key);
    let reordered = header_with(&table_bytes(&sorted));
    assert_ne!(payload, reordered);
    assert!(same_properties(&payload, &reordered));
    assert!(same_properties(&payload, &payload));

    // Another value, tag, entry or property is another message.
    let mut other = entries.clone();
    other[0].2 = [&5u32.to_be_bytes()[..], b"other"].concat();
    assert!(!same_properties(
        &payload,
        &header_with(&table_bytes(&other))
    ));
    let mut retagged = entries.clone();
    retagged[10].1 = b'T'; // 'l' -> 'T', same 8 value bytes
    assert!(!same_properties(
        &payload,
        &header_with(&table_bytes(&retagged))
    ));
    assert!(!same_properties(
        &payload,
        &header_with(&table_bytes(&entries[1..]))
    ));
    let mut body_size = payload.clone();
    body_size[11] ^= 1;
    assert!(!same_properties(&payload, &body_size));
    let mut after = payload.clone();
    *after.last_mut().unwrap() ^= 1; // the message-id after the table
    assert!(!same_properties(&payload, &after));

    // Nested tables keep their order.
    let table = |inner: &[u8]| {
        let f = [&(inner.len() as u32).to_be_bytes()[..], inner].concat();
        header_with(&[&[1u8, b'n', b'F'][..], &f].concat())
    };
    let (ab, ba) = (
        table(&[1, b'a', b't', 1, 1, b'b', b't', 0]),
        table(&[1, b'b', b't', 0, 1, b'a', b't', 1]),
    );
    assert!(!same_properties(&ab, &ba));
}

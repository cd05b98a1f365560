use super::*;
use crate::protocol::frame::{Frame, FrameDecoder};
use amq_protocol::protocol::{confirm, queue, tx};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};

fn table() -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    t.insert("n".into(), AMQPValue::LongInt(-7));
    t
}

/// One instance of every method nackd decodes.
// Whole because: a list, one method per entry.
#[allow(clippy::too_many_lines)]
fn decoded_methods() -> Vec<AMQPClass> {
    use AMQPClass::*;
    vec![
        Connection(connection::AMQPMethod::Start(connection::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: table(),
            mechanisms: LongString::from("PLAIN AMQPLAIN"),
            locales: LongString::from("en_US"),
        })),
        Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: table(),
            mechanism: "PLAIN".into(),
            response: LongString::from("\0guest\0guest"),
            locale: "en_US".into(),
        })),
        Connection(connection::AMQPMethod::Tune(connection::Tune {
            channel_max: 2047,
            frame_max: 131_072,
            heartbeat: 60,
        })),
        Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 2047,
            frame_max: 131_072,
            heartbeat: 10,
        })),
        Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/billing".into(),
        })),
        Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
        Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 320,
            reply_text: "CONNECTION_FORCED".into(),
            class_id: 60,
            method_id: 40,
        })),
        Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
        Connection(connection::AMQPMethod::Blocked(connection::Blocked {
            reason: "low on memory".into(),
        })),
        Connection(connection::AMQPMethod::Unblocked(connection::Unblocked {})),
        Channel(channel::AMQPMethod::Open(channel::Open {})),
        Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 406,
            reply_text: "PRECONDITION_FAILED".into(),
            class_id: 50,
            method_id: 10,
        })),
        Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
        Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "email-queue".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: table(),
        })),
        Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
            queue: "amq.gen-abc".into(),
            message_count: 3,
            consumer_count: 1,
        })),
        Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: "email-queue".into(),
            consumer_tag: "ctag-1".into(),
            no_local: false,
            no_ack: false,
            exclusive: true,
            nowait: false,
            arguments: table(),
        })),
        Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
            consumer_tag: "amq.ctag-xyz".into(),
        })),
        Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag: "ctag-1".into(),
            nowait: true,
        })),
        Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
            consumer_tag: "ctag-1".into(),
        })),
        Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: "ctag-1".into(),
            delivery_tag: u64::MAX - 1,
            redelivered: true,
            exchange: "notifications".into(),
            routing_key: "user.42".into(),
        })),
        Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "webhook-queue".into(),
            no_ack: false,
        })),
        Basic(basic::AMQPMethod::GetOk(basic::GetOk {
            delivery_tag: 9,
            redelivered: false,
            exchange: "".into(),
            routing_key: "webhook-queue".into(),
            message_count: 41,
        })),
        Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
        Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 6,
            multiple: true,
        })),
        Basic(basic::AMQPMethod::Reject(basic::Reject {
            delivery_tag: 5,
            requeue: false,
        })),
        Basic(basic::AMQPMethod::RecoverAsync(basic::RecoverAsync {
            requeue: true,
        })),
        Basic(basic::AMQPMethod::Recover(basic::Recover { requeue: true })),
        Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
        Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: 12,
            multiple: true,
            requeue: true,
        })),
        Tx(tx::AMQPMethod::Select(tx::Select {})),
        Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})),
        Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
        Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
        Exchange(amq_protocol::protocol::exchange::AMQPMethod::Declare(
            amq_protocol::protocol::exchange::Declare {
                exchange: "waits".into(),
                kind: "x-delayed-message".into(),
                passive: false,
                durable: true,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments: FieldTable::default(),
            },
        )),
        Exchange(amq_protocol::protocol::exchange::AMQPMethod::DeclareOk(
            amq_protocol::protocol::exchange::DeclareOk {},
        )),
        Exchange(amq_protocol::protocol::exchange::AMQPMethod::Delete(
            amq_protocol::protocol::exchange::Delete {
                exchange: "waits".into(),
                if_unused: false,
                nowait: false,
            },
        )),
        Exchange(amq_protocol::protocol::exchange::AMQPMethod::DeleteOk(
            amq_protocol::protocol::exchange::DeleteOk {},
        )),
    ]
}

#[test]
fn every_decoded_method_round_trips_through_the_frame_layer() {
    let methods = decoded_methods();
    assert_eq!(
        methods.len(),
        DECODED.len(),
        "one sample per decoded method"
    );
    for class in methods {
        let wire = encode(3, &class);
        let mut buf = BytesMut::from(&wire[..]);
        let frame = FrameDecoder::new(131_072)
            .decode(&mut buf)
            .unwrap()
            .unwrap();
        assert_eq!(frame.kind, FrameType::Method);
        assert_eq!(frame.channel, 3);
        let payload = frame.payload();
        let id = MethodId::peek(&payload).unwrap();
        assert!(id.is_decoded(), "{class:?}");
        assert_eq!(decode(&payload).unwrap(), Some(class.clone()));
        assert_eq!(encode(3, &decode_any(&payload).unwrap()), wire, "{class:?}");
    }
}

#[test]
fn opaque_methods_are_not_decoded() {
    let declare = AMQPClass::Queue(amq_protocol::protocol::queue::AMQPMethod::Bind(
        amq_protocol::protocol::queue::Bind {
            queue: "q".into(),
            exchange: "x".into(),
            routing_key: "k".into(),
            nowait: false,
            arguments: FieldTable::default(),
        },
    ));
    let payload = Frame {
        kind: FrameType::Method,
        channel: 1,
        raw: encode(1, &declare),
    }
    .payload();
    assert_eq!(decode(&payload).unwrap(), None);
    // Opaque even when its arguments are garbage: nackd does not judge them.
    assert_eq!(decode(&[0, 50, 0, 20, 0xff]).unwrap(), None);
}

#[test]
fn malformed_arguments_are_a_syntax_error() {
    // basic.ack needs 9 octets of arguments; give it 3.
    let err = decode(&[0, 60, 0, 80, 0, 0, 1]).unwrap_err();
    assert_eq!(err.reply_code(), ReplyCode::SyntaxError);
    assert!(MethodId::peek(&[0, 60]).is_err());
}

#[test]
fn content_is_split_by_frame_max() {
    let body = vec![7u8; 10_000];
    let out = publish(
        1,
        "",
        "q",
        true,
        &[0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0x27, 0x10, 0, 0],
        &body,
        4096,
    );
    let decoder = FrameDecoder::new(4096);
    let mut buf = out;
    let kinds: Vec<(FrameType, usize)> = std::iter::from_fn(|| decoder.decode(&mut buf).unwrap())
        .map(|f| (f.kind, f.payload().len()))
        .collect();
    assert_eq!(
        kinds,
        vec![
            (FrameType::Method, kinds[0].1),
            (FrameType::Header, 14),
            (FrameType::Body, 4088),
            (FrameType::Body, 4088),
            (FrameType::Body, 1824),
        ]
    );
}

#[test]
fn own_frames_encode_as_the_spec_says() {
    assert_eq!(
        &ack(1, 5, false)[..],
        &[1, 0, 1, 0, 0, 0, 13, 0, 60, 0, 80, 0, 0, 0, 0, 0, 0, 0, 5, 0, FRAME_END]
    );
    assert_eq!(
        &nack(2, 6, true, false)[..],
        &[1, 0, 2, 0, 0, 0, 13, 0, 60, 0, 120, 0, 0, 0, 0, 0, 0, 0, 6, 1, FRAME_END]
    );
    assert_eq!(&heartbeat()[..], &[8, 0, 0, 0, 0, 0, 0, FRAME_END]);
    let close = connection_close(ReplyCode::FrameError, &"é".repeat(200), None);
    let payload = Frame {
        kind: FrameType::Method,
        channel: 0,
        raw: close,
    }
    .payload();
    match decode(&payload).unwrap() {
        Some(AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
            assert_eq!(c.reply_code, 501);
            assert!(c.reply_text.as_str().len() <= 255);
        }
        other => panic!("{other:?}"),
    }
    let rej = reject(4, 9, true);
    let payload = Frame {
        kind: FrameType::Method,
        channel: 4,
        raw: rej,
    }
    .payload();
    assert_eq!(
        decode(&payload).unwrap(),
        Some(AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
            delivery_tag: 9,
            requeue: true
        })))
    );
}

/// `levels` arrays and tables nested in each other, as a field value.
fn nested_value(levels: usize) -> Vec<u8> {
    let mut value = vec![b'V'];
    for i in 0..levels {
        let (tag, key): (u8, &[u8]) = if i % 2 == 0 {
            (b'A', &[])
        } else {
            (b'F', &[1, b'k'])
        };
        let inner = [key, &value].concat();
        value = [&[tag][..], &(inner.len() as u32).to_be_bytes(), &inner].concat();
    }
    value
}

/// The payload of `class`, whose table holds only `marker`, with that table
/// replaced by { "m": <nested `levels` deep> }.
fn with_nested_table(class: &AMQPClass, levels: usize) -> Vec<u8> {
    let payload = Frame {
        kind: FrameType::Method,
        channel: 1,
        raw: encode(1, class),
    }
    .payload();
    let marker = [&[1u8, b'm', b'V'][..]].concat();
    let table = [&(marker.len() as u32).to_be_bytes()[..], &marker].concat();
    let at = payload
        .windows(table.len())
        .position(|w| w == table)
        .expect("marker table");
    let entry = [&[1u8, b'm'][..], &nested_value(levels)].concat();
    let mut out = payload[..at].to_vec();
    out.extend_from_slice(&(entry.len() as u32).to_be_bytes());
    out.extend_from_slice(&entry);
    out.extend_from_slice(&payload[at + table.len()..]);
    out
}

/// Every method with a field table, the table being { "m": void }.
// Whole because: a list, one method per entry.
#[allow(clippy::too_many_lines)]
fn methods_with_tables() -> Vec<AMQPClass> {
    use amq_protocol::protocol::exchange;
    let mut marker = FieldTable::default();
    marker.insert("m".into(), AMQPValue::Void);
    let mut out: Vec<AMQPClass> = decoded_methods()
        .into_iter()
        .filter_map(|class| match class {
            AMQPClass::Connection(connection::AMQPMethod::Start(m)) => Some(AMQPClass::Connection(
                connection::AMQPMethod::Start(connection::Start {
                    server_properties: marker.clone(),
                    ..m
                }),
            )),
            AMQPClass::Connection(connection::AMQPMethod::StartOk(m)) => Some(
                AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                    client_properties: marker.clone(),
                    ..m
                })),
            ),
            AMQPClass::Queue(queue::AMQPMethod::Declare(m)) => Some(AMQPClass::Queue(
                queue::AMQPMethod::Declare(queue::Declare {
                    arguments: marker.clone(),
                    ..m
                }),
            )),
            AMQPClass::Basic(basic::AMQPMethod::Consume(m)) => Some(AMQPClass::Basic(
                basic::AMQPMethod::Consume(basic::Consume {
                    arguments: marker.clone(),
                    ..m
                }),
            )),
            _ => None,
        })
        .collect();
    let (d, s, k) = ("dest".into(), "source".into(), "key.#".into());
    out.extend([
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: "x".into(),
            kind: "topic".into(),
            passive: false,
            durable: true,
            auto_delete: false,
            internal: false,
            nowait: false,
            arguments: marker.clone(),
        })),
        AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
            destination: d,
            source: s,
            routing_key: k,
            nowait: true,
            arguments: marker.clone(),
        })),
        AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: "q".into(),
            exchange: "x".into(),
            routing_key: "k".into(),
            nowait: false,
            arguments: marker.clone(),
        })),
        AMQPClass::Queue(queue::AMQPMethod::Unbind(queue::Unbind {
            queue: "q".into(),
            exchange: "x".into(),
            routing_key: "k".into(),
            arguments: marker.clone(),
        })),
    ]);
    out
}

/// amq-protocol recurses once per nesting level: a deep table in any method
/// (connection.start-ok before authentication included) overflowed the
/// stack and aborted the process. Now it is a syntax error.
#[test]
fn deeply_nested_method_tables_are_refused_without_recursing() {
    let methods = methods_with_tables();
    assert_eq!(methods.len(), 8);
    for class in &methods {
        let deep = with_nested_table(class, 10_000);
        assert_eq!(
            decode_any(&deep),
            Err(FrameError::Syntax("field table nested too deeply")),
            "{class:?}"
        );
        // Up to the limit the method decodes as before.
        let ok = with_nested_table(class, content::MAX_TABLE_DEPTH - 1);
        assert!(decode_any(&ok).is_ok(), "{class:?}");
        let over = with_nested_table(class, content::MAX_TABLE_DEPTH);
        assert!(decode_any(&over).is_err(), "{class:?}");
    }
}

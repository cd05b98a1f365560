//! Frame decode + forward, as a session pump does it: cut every frame out
//! of the read buffer, peek the method id, decode the methods nackd decodes
//! (here `basic.deliver` and `basic.ack`; `basic.publish` is only peeked),
//! and copy the raw bytes into the output buffer.
//!
//! The mix per message: `basic.publish` + header + 1 KiB body (client side),
//! `basic.deliver` + header + 1 KiB body (broker side), `basic.ack`.
//!
//! `cargo bench --bench frames -- --warm-up-time 1 --measurement-time 5`

use std::hint::black_box;

use amq_protocol::protocol::{basic, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use bytes::BytesMut;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use nackd_core::protocol::content;
use nackd_core::protocol::frame::{FrameDecoder, FrameType};
use nackd_core::protocol::method::{self, MethodId};

const MESSAGES: usize = 500;
const BODY: usize = 1024;
const FRAME_MAX: u32 = 131_072;

/// A header as applications send it: JSON, persistent, ids, a few headers.
fn header_payload() -> Vec<u8> {
    let mut headers = FieldTable::default();
    headers.insert(
        "tenant".into(),
        AMQPValue::LongString(LongString::from("acme")),
    );
    headers.insert("x-retry-count".into(), AMQPValue::LongLongInt(0));
    headers.insert(
        "trace-id".into(),
        AMQPValue::LongString(LongString::from("4bf92f3577b34da6a3ce929d0e0e4736")),
    );
    let props = basic::AMQPProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_message_id("msg-0000001".into())
        .with_timestamp(1_700_000_000)
        .with_headers(headers);
    content::encode_header(60, BODY as u64, &props)
}

/// The byte stream of `MESSAGES` publish/deliver/ack rounds, and its frame count.
fn stream() -> (Vec<u8>, u64) {
    let header = header_payload();
    let body = vec![b'x'; BODY];
    let mut out = BytesMut::new();
    for i in 0..MESSAGES as u64 {
        out.extend_from_slice(&method::publish(
            1,
            "orders",
            "order.created",
            false,
            &header,
            &body,
            FRAME_MAX,
        ));
        let deliver = AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: "amq.ctag-4cFmCpcAyWAxHb-1".into(),
            delivery_tag: i + 1,
            redelivered: false,
            exchange: "orders".into(),
            routing_key: "order.created".into(),
        }));
        out.extend_from_slice(&method::encode(2, &deliver));
        method::put_content(&mut out, 2, &header, &body, FRAME_MAX);
        out.extend_from_slice(&method::ack(2, i + 1, false));
    }
    (out.to_vec(), 7 * MESSAGES as u64)
}

/// Decodes everything in `input` and forwards it to `output`; returns the
/// number of frames.
fn pump(decoder: &FrameDecoder, input: &mut BytesMut, output: &mut BytesMut) -> u64 {
    let mut frames = 0;
    while let Some(frame) = decoder.decode(input).expect("valid stream") {
        if frame.kind == FrameType::Method {
            let payload = frame.payload();
            let id = MethodId::peek(&payload).expect("method id");
            if id.is_decoded() {
                black_box(method::decode(&payload).expect("valid method"));
            }
        }
        output.extend_from_slice(&frame.raw);
        frames += 1;
    }
    frames
}

fn bench(c: &mut Criterion) {
    let (input, frames) = stream();
    let decoder = FrameDecoder::new(FRAME_MAX);
    let mut output = BytesMut::with_capacity(input.len());
    let mut run = |b: &mut criterion::Bencher| {
        b.iter_batched_ref(
            || BytesMut::from(&input[..]),
            |buf| {
                output.clear();
                assert_eq!(pump(&decoder, buf, &mut output), frames);
            },
            BatchSize::LargeInput,
        )
    };
    let mut group = c.benchmark_group("frame decode + forward (bytes)");
    group.throughput(Throughput::Bytes(input.len() as u64));
    group.bench_function("publish/deliver 1 KiB + ack", &mut run);
    group.finish();
    let mut group = c.benchmark_group("frame decode + forward (frames)");
    group.throughput(Throughput::Elements(frames));
    group.bench_function("publish/deliver 1 KiB + ack", &mut run);
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! The hot pieces of the retry path: wheel insert and expire, and the
//! header rewrite every retry pays.
//!
//! `cargo bench --bench retry_path -- --warm-up-time 1 --measurement-time 5`

use std::hint::black_box;

use amq_protocol::protocol::basic;
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use nackd_core::protocol::content;
use nackd_core::protocol::headers::{self, Retry};
use nackd_core::wheel::Wheel;

const N: u64 = 100_000;

/// Due times spread like a real schedule: 500 ms to 5 min from now.
fn dues(start: u64) -> Vec<u64> {
    let mut rng = fastrand::Rng::with_seed(1);
    (0..N).map(|_| start + rng.u64(500..300_000)).collect()
}

fn wheel(c: &mut Criterion) {
    let start = 1_700_000_000_000;
    let dues = dues(start);
    let mut g = c.benchmark_group("wheel");
    g.throughput(Throughput::Elements(N));
    g.bench_function("insert 100k", |b| {
        b.iter_batched(
            || Wheel::new(start),
            |mut w| {
                for (id, due) in dues.iter().enumerate() {
                    w.insert(*due, id as u64);
                }
                w
            },
            BatchSize::LargeInput,
        )
    });
    g.bench_function("expire 100k (1 ms steps over 5 min)", |b| {
        b.iter_batched(
            || {
                let mut w = Wheel::new(start);
                for (id, due) in dues.iter().enumerate() {
                    w.insert(*due, id as u64);
                }
                w
            },
            |mut w| {
                let mut fired = Vec::with_capacity(N as usize);
                let mut now = start;
                while let Some(deadline) = w.next_deadline() {
                    now = deadline.max(now);
                    w.poll(now, &mut fired);
                }
                black_box(fired.len())
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

fn rewrite(c: &mut Criterion) {
    let mut h = FieldTable::default();
    h.insert(
        "tenant".into(),
        AMQPValue::LongString(LongString::from("acme")),
    );
    h.insert(
        "trace-id".into(),
        AMQPValue::LongString(LongString::from("4bf92f3577b34da6a3ce929d0e0e4736")),
    );
    let props = basic::AMQPProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_headers(h);
    let first = content::encode_header(60, 1024, &props);
    let info = |count| Retry {
        queue: "email-queue",
        exchange: "notifications",
        routing_key: "user.42",
        count,
        delay_ms: 5000,
        now_secs: 1_700_000_000,
        exhausted: None,
    };
    // A message on its third retry already carries x-death and friends.
    let third = headers::rewrite(&headers::rewrite(&first, &info(1)).unwrap(), &info(2)).unwrap();
    let mut g = c.benchmark_group("headers");
    g.throughput(Throughput::Elements(1));
    g.bench_function("rewrite, first retry", |b| {
        b.iter(|| headers::rewrite(black_box(&first), &info(1)).unwrap())
    });
    g.bench_function("rewrite, third retry", |b| {
        b.iter(|| headers::rewrite(black_box(&third), &info(3)).unwrap())
    });
    g.bench_function("retry_count", |b| {
        b.iter(|| headers::retry_count(black_box(&third)))
    });
    g.finish();
}

criterion_group!(benches, wheel, rewrite);
criterion_main!(benches);

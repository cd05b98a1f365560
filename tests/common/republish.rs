//! What the republisher tests (isolation, republisher_health) share.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, ExchangeKind};

pub const TOKEN: &str = "test-admin-token-0123456789";

/// A `[[policy]]` table for one queue.
pub fn policy(queue: &str, delays: &str, extra: &str) -> String {
    format!("[[policy]]\nqueues = [\"{queue}\"]\ndelays = [{delays}]\n{extra}\n")
}

/// A channel in confirm mode.
pub async fn confirmed_channel(conn: &lapin::Connection) -> Channel {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch
}

/// Properties whose `x-retry-count` says the message was retried `n` times.
pub fn retried(n: i64) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert("x-retry-count".into(), AMQPValue::LongLongInt(n));
    BasicProperties::default().with_headers(headers)
}

/// Publishes to `exchange` with `key` and waits for the confirm.
pub async fn publish_to(
    ch: &Channel,
    exchange: &str,
    key: &str,
    body: &[u8],
    props: BasicProperties,
) {
    ch.basic_publish(
        exchange.into(),
        key.into(),
        BasicPublishOptions::default(),
        body,
        props,
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

/// Declares exchange `x` and a durable queue bound to it with `key`.
pub async fn bound_queue(ch: &Channel, x: &str, kind: ExchangeKind, q: &str, key: &str) {
    ch.exchange_declare(
        x.into(),
        kind,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    crate::common::declare_durable(ch, q).await;
    ch.queue_bind(
        q.into(),
        x.into(),
        key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
}

/// Takes every message of `q` (waiting up to `settle` for more after the
/// last one), acking them; returns their bodies.
pub async fn drain(ch: &Channel, q: &str, settle: Duration) -> Vec<String> {
    let mut bodies = Vec::new();
    let mut last = Instant::now();
    while last.elapsed() < settle {
        match ch
            .basic_get(q.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            Some(m) => {
                bodies.push(String::from_utf8_lossy(&m.delivery.data).into_owned());
                last = Instant::now();
            }
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    bodies
}

pub async fn delete_exchanges(ch: &Channel, names: &[&str]) {
    for n in names {
        let _ = ch
            .exchange_delete((*n).into(), ExchangeDeleteOptions::default())
            .await;
    }
}

/// The `p`-th percentile of `values` (sorted in place).
pub fn percentile(values: &mut [Duration], p: f64) -> Duration {
    values.sort();
    let i = ((values.len() as f64 - 1.0) * p).round() as usize;
    values[i]
}

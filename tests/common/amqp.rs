//! lapin calls every integration test makes, written once.
#![allow(dead_code)]

use std::time::Duration;

use futures_lite::StreamExt;
use lapin::message::Delivery;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Consumer};

/// Declares a durable queue with no arguments.
pub async fn declare_durable(ch: &Channel, q: &str) {
    ch.queue_declare(
        q.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
}

/// Messages ready in `q`, as the broker counts them (a passive declare).
pub async fn message_count(ch: &Channel, q: &str) -> u32 {
    try_message_count(ch, q).await.unwrap()
}

/// [`message_count`] for a broker that may be down (or a queue gone).
pub async fn try_message_count(ch: &Channel, q: &str) -> lapin::Result<u32> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let queue = ch
        .queue_declare(q.into(), passive, FieldTable::default())
        .await?;
    Ok(queue.message_count())
}

/// Publishes `body` to queue `q` (default exchange) and waits for the
/// confirm, if the channel is in confirm mode.
pub async fn publish(ch: &Channel, q: &str, body: &[u8]) -> Confirmation {
    ch.basic_publish(
        "".into(),
        q.into(),
        BasicPublishOptions::default(),
        body,
        BasicProperties::default(),
    )
    .await
    .unwrap()
    .await
    .unwrap()
}

/// Starts a manual-ack consumer on `q`, with a prefetch when given.
pub async fn consume(ch: &Channel, q: &str, prefetch: Option<u16>) -> Consumer {
    if let Some(n) = prefetch {
        ch.basic_qos(n, BasicQosOptions::default()).await.unwrap();
    }
    ch.basic_consume(
        q.into(),
        "".into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap()
}

/// The next delivery within `within`, or `None`.
pub async fn next(consumer: &mut Consumer, within: Duration) -> Option<Delivery> {
    match tokio::time::timeout(within, consumer.next()).await {
        Ok(Some(d)) => Some(d.unwrap()),
        _ => None,
    }
}

/// `x-retry-count` of a delivery, 0 when absent.
pub fn retry_count(d: &Delivery) -> i64 {
    match d
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-retry-count"))
    {
        Some(AMQPValue::LongLongInt(n)) => *n,
        _ => 0,
    }
}

/// Deletes each queue, whatever state it is in (a test's cleanup).
pub async fn delete_queues(ch: &Channel, names: &[&str]) {
    for n in names {
        let _ = ch
            .queue_delete((*n).into(), QueueDeleteOptions::default())
            .await;
    }
}

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

/// Declares an exclusive queue (gone with the connection) with no arguments.
pub async fn declare_exclusive(ch: &Channel, q: &str) {
    ch.queue_declare(
        q.into(),
        QueueDeclareOptions {
            exclusive: true,
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

/// The properties of a message as if dead-lettered from queue `origin` for
/// `reason` (`x-first-death-*` and an `x-death` entry), with every other
/// property set and headers of every field type RabbitMQ keeps: what a
/// message left on a dead-letter queue must come back with, unchanged.
pub fn dead_lettered_properties(origin: &str, reason: &str, id: u32) -> BasicProperties {
    use lapin::types::{DecimalValue, FieldArray, LongString};
    let mut death = FieldTable::default();
    death.insert("queue".into(), AMQPValue::LongString(origin.into()));
    death.insert("reason".into(), AMQPValue::LongString(reason.into()));
    death.insert("count".into(), AMQPValue::LongLongInt(1));
    death.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
    let mut h = FieldTable::default();
    h.insert(
        "x-first-death-queue".into(),
        AMQPValue::LongString(origin.into()),
    );
    h.insert(
        "x-first-death-reason".into(),
        AMQPValue::LongString(reason.into()),
    );
    h.insert(
        "x-death".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
    );
    h.insert("bool".into(), AMQPValue::Boolean(true));
    h.insert("i8".into(), AMQPValue::ShortShortInt(-8));
    h.insert("i16".into(), AMQPValue::ShortInt(-16));
    h.insert("i32".into(), AMQPValue::LongInt(-32));
    h.insert("i64".into(), AMQPValue::LongLongInt(i64::from(id) - 64));
    h.insert("f32".into(), AMQPValue::Float(1.5));
    h.insert("f64".into(), AMQPValue::Double(-2.25));
    h.insert(
        "decimal".into(),
        AMQPValue::DecimalValue(DecimalValue {
            scale: 2,
            value: 12345,
        }),
    );
    h.insert("bytes".into(), AMQPValue::ByteArray(vec![0, 255, 7].into()));
    h.insert("void".into(), AMQPValue::Void);
    h.insert(
        "text".into(),
        AMQPValue::LongString(LongString::from(format!("message {id}, ünïcode"))),
    );
    BasicProperties::default()
        .with_content_type("application/x-test".into())
        .with_content_encoding("identity".into())
        .with_headers(h)
        .with_delivery_mode(2)
        .with_priority(3)
        .with_correlation_id(format!("corr-{id}").into())
        .with_reply_to("replies".into())
        .with_message_id(format!("id-{id}").into())
        .with_timestamp(1_700_000_000 + u64::from(id))
        .with_type("test.kind".into())
        .with_user_id("guest".into())
        .with_app_id("nackd-tests".into())
}

/// Publishes `body` with `properties` to queue `q` and waits for the confirm.
pub async fn publish_with(ch: &Channel, q: &str, body: &[u8], properties: BasicProperties) {
    let confirm = ch
        .basic_publish(
            "".into(),
            q.into(),
            BasicPublishOptions::default(),
            body,
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack(), "{q}: {confirm:?}");
}

/// The properties of a delivery as they were published: without the count
/// a quorum queue writes on delivery (`x-delivery-count`, 0 on 3.10's first
/// delivery, absent on 4.x's), which must say "never returned".
pub fn as_published(d: &Delivery) -> BasicProperties {
    let Some(h) = d.properties.headers() else {
        return d.properties.clone();
    };
    let mut kept = h.inner().clone();
    for count in ["x-delivery-count", "x-acquired-count"] {
        if let Some(n) = kept.remove(count) {
            assert!(
                matches!(n, AMQPValue::LongLongInt(0) | AMQPValue::LongInt(0)),
                "{count} {n:?}: returned before"
            );
        }
    }
    d.properties.clone().with_headers(FieldTable::from(kept))
}

/// A durable queue that dead-letters to `dlq` through the default exchange.
pub async fn declare_dead_lettering(ch: &Channel, q: &str, dlq: &str) {
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(dlq.into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(q.into(), durable, args).await.unwrap();
}

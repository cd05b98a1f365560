//! The broker goes away while nackd holds messages: the republisher
//! reconnects and every held message is delivered.
//!
//! This test stops and starts the RabbitMQ application, so it lives alone in
//! its own test binary (cargo runs test binaries one after another).

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

fn rabbitmqctl(args: &[&str]) {
    let out = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn count(q: &str) -> Option<u32> {
    let conn = lapin::Connection::connect(
        &format!("amqp://guest:guest@{BROKER}/%2f"),
        lapin::ConnectionProperties::default(),
    )
    .await
    .ok()?;
    let ch = conn.create_channel().await.ok()?;
    let n = ch
        .queue_declare(
            q.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .ok()?
        .message_count();
    let _ = conn.close(200, "".into()).await;
    Some(n)
}

#[tokio::test]
async fn held_messages_survive_a_broker_restart() {
    let q = unique("restart");
    let nackd = start(&format!(
        "[[policy]]\nqueues = [\"{q}\"]\ndelays = [\"1500ms\"]\n"
    ))
    .await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_durable(&ch, &q).await;
    let persistent = BasicProperties::default().with_delivery_mode(2);
    // Warm-up: one retry makes the republisher connect before the restart.
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        BasicPublishOptions::default(),
        b"warm-up",
        persistent.clone(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let mut consumer = consume(&ch, &q, Some(100)).await;
    let d = consumer.next().await.unwrap().unwrap();
    d.nack(BasicNackOptions {
        requeue: false,
        multiple: false,
    })
    .await
    .unwrap();
    let d = tokio::time::timeout(Duration::from_secs(5), consumer.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    d.ack(BasicAckOptions::default()).await.unwrap();

    for i in 0..20u8 {
        ch.basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            &[i],
            persistent.clone(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    for _ in 0..20 {
        let d = tokio::time::timeout(Duration::from_secs(5), consumer.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        d.nack(BasicNackOptions {
            requeue: false,
            multiple: false,
        })
        .await
        .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&q).await, Some(0), "all 20 held by nackd");

    rabbitmqctl(&["stop_app"]);
    tokio::time::sleep(Duration::from_secs(2)).await; // they fall due while the broker is down
    rabbitmqctl(&["start_app"]);
    rabbitmqctl(&["await_startup"]);

    let began = Instant::now();
    loop {
        if count(&q).await == Some(20) {
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "held messages not republished after the restart"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let direct = direct().await;
    let ch = direct.create_channel().await.unwrap();
    let mut bodies = Vec::new();
    while let Some(m) = ch
        .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let h = m.delivery.properties.headers().clone().unwrap();
        assert_eq!(
            h.inner().get("x-retry-count"),
            Some(&AMQPValue::LongLongInt(1))
        );
        bodies.push(m.delivery.data[0]);
    }
    bodies.sort();
    assert_eq!(
        bodies,
        (0..20).collect::<Vec<u8>>(),
        "every held message, once"
    );
    ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
}

//! The broker goes away while nackd holds messages: the republisher
//! reconnects and every held message is delivered.
//!
//! This test stops and starts the RabbitMQ application, so it holds its
//! broker's `common::alone()` turn, and `.config/nextest.toml` runs it
//! once the tests of `tests/it` have ended.

use crate::common;

use std::time::{Duration, Instant};

use common::ops::scrape;
use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::AMQPValue;
use lapin::BasicProperties;

/// `(ready, unacked)` of `q` as the broker has them (AMQP's passive declare
/// tells only the ready ones).
fn broker_counts(q: &str) -> Option<(u64, u64)> {
    let out = BROKER.ctl(&[
        "list_queues",
        "-s",
        "name",
        "messages_ready",
        "messages_unacknowledged",
    ]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|line| {
            let mut f = line.split('\t');
            if f.next()? != q {
                return None;
            }
            Some((
                f.next()?.trim().parse().ok()?,
                f.next()?.trim().parse().ok()?,
            ))
        })
}

/// How long the 20 messages would be held: longer than the test, which
/// makes them due itself (the admin API's fire) once `rabbitmqctl
/// stop_app` is done, however slow a loaded machine makes that. (A delay
/// that fell due by itself had to outlast the stop: 10 s was not enough
/// for 4.3 at the end of a loaded fresh-clone run, 2026-11-29, nor 20 s at
/// load average 20, 2026-11-30; at 60 s the test took 83-88 s.)
const DELAY: Duration = Duration::from_secs(3600);

/// The admin API's token of the nackd under test.
const TOKEN: &str = "test-admin-token-0123456789";

/// How long the broker stays down after the messages fell due: the
/// republisher tries and fails meanwhile.
const DOWN: Duration = Duration::from_secs(3);

async fn count(q: &str) -> Option<u32> {
    let conn = lapin::Connection::connect(
        &format!("amqp://guest:guest@{BROKER}/%2f"),
        lapin::ConnectionProperties::default(),
    )
    .await
    .ok()?;
    let ch = conn.create_channel().await.ok()?;
    let n = common::amqp::try_message_count(&ch, q).await.ok()?;
    let _ = conn.close(200, "".into()).await;
    Some(n)
}

/// The broker's app, stopped by the test: started again if the test fails
/// before it does, so that the tests after it find the broker up (a run
/// loaded enough to fail the check after the stop left it down, and every
/// later test of that broker failed too).
struct StartsAgain;

impl Drop for StartsAgain {
    fn drop(&mut self) {
        let _ = BROKER.ctl(&["start_app"]);
        let _ = BROKER.ctl(&["await_startup"]);
    }
}

#[tokio::test]
async fn held_messages_survive_a_broker_restart() {
    let _alone = common::alone();
    let (warm, q) = (unique("restart-warm-up"), unique("restart"));
    let nackd = start(&format!(
        "[metrics]\nadmin_token = \"{TOKEN}\"\n[[policy]]\nqueues = [\"{warm}\"]\ndelays = [\"100ms\"]\n[[policy]]\nqueues = [\"{q}\"]\ndelays = [\"{}s\"]\n",
        DELAY.as_secs()
    ))
    .await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_durable(&ch, &warm).await;
    declare_durable(&ch, &q).await;
    let persistent = BasicProperties::default().with_delivery_mode(2);
    // Warm-up: one retry (on a queue of its own, same vhost) makes the
    // republisher connect before the restart.
    ch.basic_publish(
        "".into(),
        warm.as_str().into(),
        BasicPublishOptions::default(),
        b"warm-up",
        persistent.clone(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let mut warm_c = consume(&conn.create_channel().await.unwrap(), &warm, Some(10)).await;
    let d = next(&mut warm_c, Duration::from_secs(10))
        .await
        .expect("the warm-up");
    d.nack(BasicNackOptions {
        requeue: false,
        multiple: false,
    })
    .await
    .unwrap();
    let d = next(&mut warm_c, Duration::from_secs(10))
        .await
        .expect("the warm-up's retry");
    d.ack(BasicAckOptions::default()).await.unwrap();
    let mut consumer = consume(&ch, &q, Some(100)).await;

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
    // All 20 held: stored by nackd, and their acks processed by the broker.
    // A message still unacked when the broker stops would come back from
    // the broker and from nackd.
    let held = [("vhost", "/"), ("queue", q.as_str())];
    common::ops::until(
        nackd.metrics,
        "20 held, 21 intercepted (warm-up too)",
        |s| {
            s.get("nackd_held_messages", &held) == 20.0
                && s.get("nackd_nacks_intercepted_total", &[]) == 21.0
        },
    )
    .await;
    // No more deliveries to this consumer: a retry delivered to it would
    // count as unacked below (a run whose broker was slow to show the acks
    // saw the 20 retries there instead, and waited for 0 in vain). The
    // channel stays open until the broker stops, so an original whose ack
    // is not applied stays unacked.
    ch.basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await
        .unwrap();
    wait_for(
        Duration::from_secs(30),
        "the broker to have the 20 acks (0 unacked)",
        || async { broker_counts(&q) },
        |counts| counts.is_some_and(|(_, unacked)| unacked == 0),
    )
    .await;

    BROKER.ctl_ok(&["stop_app"]);
    let stopped = StartsAgain;
    // They fall due while the broker is down: none may have gone out before.
    let s = scrape(nackd.metrics).await;
    assert_eq!(
        s.get("nackd_retries_published_total", &[]),
        1.0,
        "only the warm-up was republished before the broker stopped: {s:?}"
    );
    // They fall due now, while the broker is down.
    let fired = common::ops::json(
        nackd.metrics,
        "POST",
        &format!("/api/fire{}", common::ops::query(&q)),
        Some(TOKEN),
    )
    .await;
    assert_eq!(fired, serde_json::json!({ "fired": 20 }));
    tokio::time::sleep(DOWN).await;
    let s = scrape(nackd.metrics).await;
    assert_eq!(
        s.get("nackd_retries_confirmed_total", &[]),
        1.0,
        "due, and none confirmed by the stopped broker: {s:?}"
    );
    BROKER.ctl_ok(&["start_app"]);
    BROKER.ctl_ok(&["await_startup"]);
    std::mem::forget(stopped);

    let began = Instant::now();
    loop {
        if count(&q).await == Some(20) {
            break;
        }
        // The republisher tries again with a backoff that doubles up to
        // 30 s (src/retry/republish/task.rs, BACKOFF_MAX): with the broker
        // down for as long as a loaded machine takes to stop and start it,
        // its next try may be 30 s after the start.
        assert!(
            began.elapsed() < Duration::from_secs(90),
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
    ch.queue_delete(warm.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
}

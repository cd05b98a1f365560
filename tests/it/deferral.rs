//! Nacks nackd cannot hold, through the real proxy and RabbitMQ: the
//! delivery stays unacked at the broker and nackd nacks it (requeue) after
//! the delay, instead of settling it as sent, which with `requeue=false`
//! and no dead-letter exchange drops the message.

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::ops::{scrape, until};
use common::*;
use lapin::options::*;

/// Messages the test sends.
const N: u32 = 5;
/// The policy's delay (the store refuses every message).
const DELAY: Duration = Duration::from_secs(1);

/// A full store (`max_bytes = 1`): every nack (requeue=false, a classic
/// queue without DLX) comes back from the broker about the delay later,
/// as a redelivery; none is lost, none passed through as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_the_full_store_refuses_comes_back_after_the_delay_not_dropped() {
    let q = unique("deferred-full");
    let delay = format!("{}ms", DELAY.as_millis());
    let (nackd, _store) = start_with_full_store(&q, &delay).await;
    let broker = direct().await;
    let bch = broker.create_channel().await.unwrap();
    bch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_durable(&bch, &q).await;
    for id in 0..N {
        publish(&bch, &q, &id.to_be_bytes()).await;
    }

    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, &q, Some(20)).await;
    let mut nacked: HashMap<u32, Instant> = HashMap::new();
    let mut back: HashMap<u32, Duration> = HashMap::new();
    let began = Instant::now();
    while back.len() < N as usize {
        assert!(
            began.elapsed() < Duration::from_secs(20),
            "{} nacked, only {back:?} came back: the others were dropped",
            nacked.len()
        );
        let Some(d) = next(&mut c, Duration::from_secs(1)).await else {
            continue;
        };
        let id = u32::from_be_bytes(d.data[..4].try_into().unwrap());
        match nacked.get(&id) {
            None => {
                nacked.insert(id, Instant::now());
                d.nack(BasicNackOptions {
                    requeue: false,
                    multiple: false,
                })
                .await
                .unwrap();
            }
            Some(at) => {
                assert!(d.redelivered, "{id}: the broker's own copy, requeued");
                assert_eq!(retry_count(&d), 0, "{id}: not a retry of nackd's");
                assert!(back.insert(id, at.elapsed()).is_none(), "{id} twice");
                d.ack(BasicAckOptions::default()).await.unwrap();
            }
        }
    }
    for (id, after) in &back {
        assert!(
            *after >= DELAY - Duration::from_millis(50) && *after < DELAY * 5,
            "{id} came back {after:?} after its nack, for a delay of {DELAY:?}"
        );
    }
    let s = until(nackd.metrics, "every deferral nacked", |s| {
        s.get("nackd_deferred_nacks", &[]) == 0.0
    })
    .await;
    assert_eq!(
        s.get(
            "nackd_nacks_deferred_total",
            &[("reason", "store_unavailable")]
        ),
        f64::from(N)
    );
    assert_eq!(
        s.sum("nackd_nacks_passed_total"),
        0.0,
        "none settled as sent"
    );
    assert_eq!(s.get("nackd_nacks_intercepted_total", &[]), 0.0);
    assert_eq!(message_count(&bch, &q).await, 0, "each acked once");
    conn.close(200, "".into()).await.unwrap();
    nackd.stop().await;
    delete_queues(&bch, &[&q]).await;
}

/// While a deferral waits, the delivery is unacked at the broker, and a
/// `basic.ack multiple` of a later tag does not settle it: it comes back
/// after the delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multiple_ack_does_not_settle_a_deferred_delivery() {
    let q = unique("deferred-prefetch");
    let (nackd, _store) = start_with_full_store(&q, "2s").await;
    let broker = direct().await;
    let bch = broker.create_channel().await.unwrap();
    bch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_durable(&bch, &q).await;
    for id in 0..2u32 {
        publish(&bch, &q, &id.to_be_bytes()).await;
    }

    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, &q, Some(2)).await;
    let first = next(&mut c, Duration::from_secs(5)).await.expect("first");
    let second = next(&mut c, Duration::from_secs(5)).await.expect("second");
    first
        .nack(BasicNackOptions {
            requeue: false,
            multiple: false,
        })
        .await
        .unwrap();
    // Handled either way (a nackd that settles it as sent counts a pass).
    until(nackd.metrics, "the nack handled", |s| {
        s.get("nackd_deferred_nacks", &[]) == 1.0 || s.sum("nackd_nacks_passed_total") == 1.0
    })
    .await;
    // ack(≤ second, multiple): covers the deferred first tag on the wire,
    // nackd sends the broker ack(second) only.
    second
        .ack(BasicAckOptions { multiple: true })
        .await
        .unwrap();
    assert!(
        next(&mut c, Duration::from_millis(800)).await.is_none(),
        "not back before the deferral's delay"
    );
    let again = next(&mut c, Duration::from_secs(5))
        .await
        .expect("the deferred delivery, back from the broker");
    assert_eq!(again.data, first.data);
    assert!(again.redelivered);
    again.ack(BasicAckOptions::default()).await.unwrap();
    let s = scrape(nackd.metrics).await;
    assert_eq!(s.sum("nackd_nacks_passed_total"), 0.0);
    conn.close(200, "".into()).await.unwrap();
    assert_eq!(message_count(&bch, &q).await, 0);
    nackd.stop().await;
    delete_queues(&bch, &[&q]).await;
}

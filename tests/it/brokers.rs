//! RabbitMQ 4.x behaviours that touch nackd (issue 20), run on whichever
//! broker the suite runs against (3.10, and 4.3 in its second pass): each
//! test says what that broker does and asserts nackd's part on each.

use crate::common;

use std::time::Duration;

use common::ops::scrape;
use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};

/// Declares the durable quorum queue `q` with `args` besides its type.
async fn declare_quorum(ch: &lapin::Channel, q: &str, mut args: FieldTable) {
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(q.into(), durable, args).await.unwrap();
}

/// A nack asking the broker to drop the message (no dead-letter exchange).
const DROP: BasicNackOptions = BasicNackOptions {
    requeue: false,
    multiple: false,
};

/// RabbitMQ 4.3 times out a quorum queue's consumer that holds a delivery
/// too long by cancelling it and returning its deliveries to the queue
/// (earlier brokers close the channel, and 3.10 has no per-queue timeout).
/// A nack the client sends after that must not be claimed: the queue has
/// the message again, and nackd's retry would be a second copy (issue 20,
/// item 2: two copies on main). On every broker: exactly one copy comes
/// back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_after_the_broker_took_the_delivery_back_leaves_one_copy() {
    let q = unique("consumer-timeout");
    let nackd = start(&format!(
        "[[policy]]\nqueues = [\"{q}\"]\ndelays = [\"1s\"]\n"
    ))
    .await;
    let times_out = BROKER.at_least(4, 3);
    let broker = direct().await;
    let bch = broker.create_channel().await.unwrap();
    bch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut args = FieldTable::default();
    if times_out {
        args.insert("x-consumer-timeout".into(), AMQPValue::LongLongInt(2000));
    }
    declare_quorum(&bch, &q, args).await;
    publish(&bch, &q, b"once").await;

    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, &q, Some(1)).await;
    let d = next(&mut c, Duration::from_secs(10))
        .await
        .expect("the message");
    if times_out {
        // The broker cancels the consumer (its stream ends) and returns
        // the delivery to the queue.
        assert!(
            next(&mut c, Duration::from_secs(60)).await.is_none(),
            "nothing else is delivered to a cancelled consumer"
        );
    }
    d.nack(DROP).await.unwrap();
    // Gone, so that whatever the queue gets next comes to the reader below
    // (nackd holds the close until its ack of a held nack is applied).
    ch.close(200, "done".into()).await.unwrap();

    // Everything the queue gets within the delay and well after it.
    let rch = broker.create_channel().await.unwrap();
    let mut r = consume(&rch, &q, Some(10)).await;
    let mut copies = Vec::new();
    while let Some(d) = next(&mut r, Duration::from_secs(4)).await {
        copies.push(retry_count(&d));
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    let s = scrape(nackd.metrics).await;
    match times_out {
        true => {
            assert_eq!(copies, [0], "the broker's copy only, not nackd's too");
            assert_eq!(
                s.get("nackd_nacks_passed_total", &[("reason", "returned")]),
                1.0
            );
        }
        false => assert_eq!(copies, [1], "nackd's retry, once"),
    }
    assert_eq!(s.sum("nackd_held_messages"), 0.0);
    conn.close(200, "".into()).await.unwrap();
    bch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    nackd.stop().await;
}

/// Issue 20, item 1: while nackd cannot hold (here its store is full), a
/// consumer that keeps failing nacks (`requeue=false`, a quorum queue
/// without a dead-letter exchange). As sent, the broker would drop the
/// message at once; requeued at once, RabbitMQ 4.0–4.2 would count every
/// requeue toward the quorum queue's delivery limit (20) and drop it within
/// milliseconds. Deferred, each nack goes back after the policy's delay:
/// over 10 s the message is delivered about ten times, and it is still in
/// its queue afterwards, on every broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_consumer_does_not_spend_the_delivery_limit_while_nackd_cannot_hold() {
    let q = unique("failing-quorum");
    let (nackd, _store) = start_with_full_store(&q, "1s").await;
    let broker = direct().await;
    let bch = broker.create_channel().await.unwrap();
    bch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_quorum(&bch, &q, FieldTable::default()).await;
    publish(&bch, &q, b"keeps failing").await;

    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, &q, Some(1)).await;
    let began = std::time::Instant::now();
    let mut deliveries = 0;
    while began.elapsed() < Duration::from_secs(10) {
        let Some(d) = next(&mut c, Duration::from_millis(500)).await else {
            continue;
        };
        deliveries += 1;
        d.nack(DROP).await.unwrap();
    }
    ch.close(200, "done".into()).await.unwrap();
    assert!(
        (5..=15).contains(&deliveries),
        "about one delivery per second of delay, not a tight loop: {deliveries}"
    );
    // The last delivery comes back to the queue with the closed channel
    // (the broker applies it a moment later).
    wait_for(
        Duration::from_secs(5),
        "the message still in its queue",
        || message_count(&bch, &q),
        |left| *left == 1,
    )
    .await;
    conn.close(200, "".into()).await.unwrap();
    bch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    nackd.stop().await;
}

/// Issue 20, item 4: the least privilege nackd's republish user needs, on
/// every broker: `write` only (no `configure`, no `read`). RabbitMQ 4.3
/// wants some permission on an exchange for the passive declare nackd's
/// republisher makes before it publishes to an `on_exhausted` exchange;
/// `write` is enough, so this passes on 4.3 with or without the lane's
/// handling of a refused declare (unit-tested in republish/tests.rs:
/// `a_refused_passive_declare_does_not_stop_the_publishes`). The exhausted
/// message reaches the dead-letter exchange's queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_republish_user_that_may_only_write_reaches_the_dead_letter_exchange() {
    let (q, dlq, dlx) = (
        unique("writer-src"),
        unique("writer-dst"),
        unique("writer-x"),
    );
    let user = unique("nackd-writer");
    BROKER.ctl_ok(&["add_user", &user, "secret-pw"]);
    // Write on every exchange (the default one for retries, the DLX), no
    // configure, no read.
    BROKER.ctl_ok(&["set_permissions", "-p", "/", &user, "^$", ".*", "^$"]);
    let nackd = start(&format!(
        "[republish]\nusername = \"{user}\"\npassword = \"secret-pw\"\n[[policy]]\nqueues = [\"{q}\"]\ndelays = [\"30ms\"]\non_exhausted = {{ exchange = \"{dlx}\", routing_key = \"dead\" }}\n"
    ))
    .await;
    let broker = direct().await;
    let bch = broker.create_channel().await.unwrap();
    bch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    bch.exchange_declare(
        dlx.as_str().into(),
        lapin::ExchangeKind::Direct,
        durable,
        FieldTable::default(),
    )
    .await
    .unwrap();
    declare_durable(&bch, &dlq).await;
    declare_durable(&bch, &q).await;
    bch.queue_bind(
        dlq.as_str().into(),
        dlx.as_str().into(),
        "dead".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    publish(&bch, &q, b"to the dlx").await;

    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, &q, Some(10)).await;
    for _ in 0..2 {
        // The first nack is retried after 30 ms, the second is exhausted.
        let d = next(&mut c, Duration::from_secs(10))
            .await
            .expect("a delivery");
        d.nack(DROP).await.unwrap();
    }
    let rch = broker.create_channel().await.unwrap();
    let mut dead = consume(&rch, &dlq, Some(10)).await;
    let d = next(&mut dead, Duration::from_secs(15))
        .await
        .expect("the exhausted message in the dead-letter exchange's queue");
    assert_eq!(d.data, b"to the dlx");
    conn.close(200, "".into()).await.unwrap();
    nackd.stop().await;
    for queue in [&q, &dlq] {
        bch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    bch.exchange_delete(dlx.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    BROKER.ctl_ok(&["delete_user", &user]);
}

/// Issue 20, item 5: RabbitMQ 3.x accepts messages up to 128 MiB, 4.x
/// refuses any above its `max_message_size` of 16 MiB. A message nackd held
/// from a 3.x broker is refused when nackd republishes it to 4.x after an
/// upgrade: it must stay held, set aside as `precondition_failed`, counted
/// and named (docs/src/brokers.md says what the operator can do), not be dropped and
/// not stall the other retries. Held here from the suite's 3.10 broker
/// (127.0.0.1:5672, always started by scripts/test), then republished by a
/// nackd on the same store in front of the broker under test: on 3.10 it
/// arrives, on 4.x it is set aside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_held_from_3x_above_the_4x_size_limit_is_kept_and_named() {
    const OLD: &str = "127.0.0.1:5672";
    let (q, small) = (unique("upgrade-large"), unique("upgrade-small"));
    let store = tempfile::tempdir().unwrap();
    let config = format!(
        "[store]\npath = \"{}\"\n[[policy]]\nqueues = [\"{q}\", \"{small}\"]\ndelays = [\"2s\"]\n",
        store.path().display()
    );
    let large = vec![7u8; 17 << 20];
    let before = start_upstream(OLD, &config).await;
    let old = connect(&format!("amqp://guest:guest@{OLD}/%2f")).await;
    let och = old.create_channel().await.unwrap();
    och.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for name in [&q, &small] {
        declare_durable(&och, name).await;
    }
    publish(&och, &q, &large).await;
    publish(&och, &small, b"small").await;
    let conn = before.connect().await;
    let ch = conn.create_channel().await.unwrap();
    for name in [&q, &small] {
        let mut c = consume(&ch, name, Some(1)).await;
        let d = next(&mut c, Duration::from_secs(10))
            .await
            .expect("delivery");
        d.nack(DROP).await.unwrap();
    }
    for name in [&q, &small] {
        wait_for(
            Duration::from_secs(10),
            "the nack held: acked on the old broker",
            || message_count(&och, name),
            |n| *n == 0,
        )
        .await;
    }
    conn.close(200, "".into()).await.unwrap();
    before.stop().await;
    delete_queues(&och, &[&q, &small]).await;

    // The broker is upgraded: nackd now republishes to the broker under test.
    let after = start(&config).await;
    let broker = direct().await;
    let bch = broker.create_channel().await.unwrap();
    for name in [&q, &small] {
        declare_durable(&bch, name).await;
    }
    wait_for(
        Duration::from_secs(15),
        "the small message retried",
        || message_count(&bch, &small),
        |n| *n == 1,
    )
    .await;
    if BROKER.at_least(4, 0) {
        // The small one's confirm may come after it is in the queue: held
        // is 1 once that is counted, and stays 1 (the large one is kept).
        let s = common::ops::until(
            after.metrics,
            "the large message set aside, still held",
            |s| {
                s.get(
                    "nackd_blocked_messages",
                    &[("reason", "precondition_failed")],
                ) == 1.0
                    && s.get("nackd_retries_confirmed_total", &[]) == 1.0
                    && s.sum("nackd_held_messages") == 1.0
            },
        )
        .await;
        assert_eq!(s.sum("nackd_held_messages"), 1.0, "still held");
        assert_eq!(message_count(&bch, &q).await, 0, "{}", BROKER.label());
    } else {
        wait_for(
            Duration::from_secs(15),
            "the large message retried",
            || message_count(&bch, &q),
            |n| *n == 1,
        )
        .await;
    }
    delete_queues(&bch, &[&q, &small]).await;
    after.stop().await;
}

/// Issue 33, finding 4: a dry run read every message of a dead-letter queue
/// and handed it back with `nack(requeue)`. RabbitMQ 4.0–4.2 count each
/// such return toward a quorum queue's delivery limit (default 20): after
/// 25 dry runs of a quorum dead-letter queue on 4.0.5, none of its 5
/// messages was left. Now a replay puts what it leaves back at the tail by
/// publishing it again and acking the original: after 25 dry runs (each
/// counting all 5) the 5 are there, in their order, with body and every
/// property and header as published, and never redelivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_runs_leave_a_quorum_dead_letter_queue_as_it_was() {
    const TOKEN: &str = "dry-run-test-token-0123456789";
    const N: u32 = 5;
    let (dlq, orig) = (unique("dry-quorum-dlq"), unique("dry-quorum-orig"));
    let nackd = start(&format!(
        "[metrics]\nadmin_token = \"{TOKEN}\"\n[[policy]]\nqueues = [\"{}\"]\ndelays = [\"1s\"]\n",
        unique("dry-quorum-policy")
    ))
    .await;
    let broker = direct().await;
    let ch = broker.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_quorum(&ch, &dlq, FieldTable::default()).await;
    declare_quorum(&ch, &orig, FieldTable::default()).await;
    let sent: Vec<_> = (0..N)
        .map(|id| {
            let body = format!("dead letter {id}").into_bytes();
            (body, dead_lettered_properties(&orig, "rejected", id))
        })
        .collect();
    for (body, props) in &sent {
        publish_with(&ch, &dlq, body, props.clone()).await;
    }

    let q = common::ops::query(&dlq);
    let path = format!(
        "/api/replay?dlq={}&dry_run=true",
        q.trim_start_matches("?queue=")
    );
    for run in 0..25 {
        let v = common::ops::json(nackd.metrics, "POST", &path, Some(TOKEN)).await;
        assert_eq!(v["examined"], N, "dry run {run}: {v}");
        assert_eq!(v["destinations"][&orig], N, "dry run {run}: {v}");
        assert_eq!(v["moved"], 0, "dry run {run}: {v}");
    }

    let reader = broker.create_channel().await.unwrap();
    let mut c = consume(&reader, &dlq, None).await;
    let mut left = Vec::new();
    while let Some(d) = next(&mut c, Duration::from_secs(3)).await {
        d.ack(BasicAckOptions::default()).await.unwrap();
        left.push(d);
    }
    assert_eq!(
        left.len(),
        sent.len(),
        "every message left on {} after 25 dry runs",
        BROKER.label()
    );
    for (d, (body, props)) in left.iter().zip(&sent) {
        assert_eq!(&d.data, body, "in order, body intact");
        assert_eq!(&as_published(d), props, "every property and header intact");
        assert!(!d.redelivered, "put back, never requeued");
    }
    delete_queues(&ch, &[&dlq, &orig]).await;
    let _ = broker.close(200, "".into()).await;
    nackd.stop().await;
}

/// The fallback of a replay's put-back (issue 33, finding 4): a quorum
/// dead-letter queue over its length limit with `overflow =
/// reject-publish` (a policy set once it holds 5, limit 2) refuses the
/// copy of what a dry run read. The replay ends with an error (HTTP 503),
/// the originals whose copy was refused are not acked, and the broker takes
/// them back when the replay's connection closes: every message still
/// there, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_queue_that_refuses_the_copy_stops_the_replay_and_keeps_its_messages() {
    const TOKEN: &str = "dry-run-test-token-0123456789";
    const N: u32 = 5;
    let (dlq, orig) = (unique("full-quorum-dlq"), unique("full-quorum-orig"));
    let nackd = start(&format!(
        "[metrics]\nadmin_token = \"{TOKEN}\"\n[[policy]]\nqueues = [\"{}\"]\ndelays = [\"1s\"]\n",
        unique("full-quorum-policy")
    ))
    .await;
    let broker = direct().await;
    let ch = broker.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_quorum(&ch, &dlq, FieldTable::default()).await;
    declare_quorum(&ch, &orig, FieldTable::default()).await;
    for id in 0..N {
        let props = dead_lettered_properties(&orig, "rejected", id);
        publish_with(&ch, &dlq, &id.to_be_bytes(), props).await;
    }
    let (policy, pattern) = (dlq.clone(), format!("^{dlq}$"));
    let limit = r#"{"max-length":2,"overflow":"reject-publish"}"#;
    tokio::task::spawn_blocking(move || {
        BROKER.ctl_ok(&[
            "set_policy",
            &policy,
            &pattern,
            limit,
            "--apply-to",
            "queues",
        ])
    })
    .await
    .unwrap();
    // In effect once a publish is refused; probes taken before stay, last.
    let mut expected: Vec<u32> = (0..N).collect();
    let began = std::time::Instant::now();
    loop {
        let probe = 1000 + expected.len() as u32;
        let confirm = ch
            .basic_publish(
                "".into(),
                dlq.as_str().into(),
                BasicPublishOptions::default(),
                &probe.to_be_bytes(),
                lapin::BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        if confirm.is_nack() {
            break;
        }
        expected.push(probe);
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "no limit applied"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let q = common::ops::query(&dlq);
    let path = format!(
        "/api/replay?dlq={}&dry_run=true",
        q.trim_start_matches("?queue=")
    );
    let r = common::ops::call(nackd.metrics, "POST", &path, Some(TOKEN)).await;
    assert_eq!(r.status, 503, "{}", r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("did not take back a message"),
        "{v}"
    );

    let ids = wait_for(
        Duration::from_secs(10),
        "the unacked originals back",
        || async {
            let reader = broker.create_channel().await.unwrap();
            let mut ids = Vec::new();
            while let Some(m) = reader
                .basic_get(dlq.as_str().into(), BasicGetOptions::default())
                .await
                .unwrap()
            {
                ids.push(u32::from_be_bytes(m.delivery.data[..4].try_into().unwrap()));
            }
            let _ = reader.close(200, "".into()).await;
            ids
        },
        |ids| ids.len() == expected.len(),
    )
    .await;
    // A quorum queue hands back what a closed channel held in no set order.
    let mut ids = ids;
    ids.sort_unstable();
    assert_eq!(ids, expected, "every one, once");
    let policy = dlq.clone();
    tokio::task::spawn_blocking(move || BROKER.ctl_ok(&["clear_policy", &policy]))
        .await
        .unwrap();
    delete_queues(&ch, &[&dlq, &orig]).await;
    let _ = broker.close(200, "".into()).await;
    nackd.stop().await;
}

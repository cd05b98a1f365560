//! Delayed retry end to end: lapin consumers nack through nackd, RabbitMQ
//! gets the message back at the tail of the queue after the delay.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use lapin::message::Delivery;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Consumer, ExchangeKind};

fn policy(queues: &[&str], delays: &str, extra: &str) -> String {
    let queues: Vec<String> = queues.iter().map(|q| format!("{q:?}")).collect();
    format!(
        "[[policy]]\nqueues = [{}]\ndelays = [{delays}]\n{extra}\n",
        queues.join(", ")
    )
}

async fn queue(ch: &Channel, name: &str, args: FieldTable) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
}

async fn publish(ch: &Channel, exchange: &str, key: &str, body: &[u8], props: BasicProperties) {
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

fn header<'a>(d: &'a Delivery, key: &str) -> Option<&'a AMQPValue> {
    d.properties.headers().as_ref()?.inner().get(key)
}

fn retry_count(d: &Delivery) -> Option<i64> {
    match header(d, "x-retry-count")? {
        AMQPValue::LongLongInt(n) => Some(*n),
        other => panic!("x-retry-count is {other:?}"),
    }
}

/// How RabbitMQ users read the count today: the x-death entry of the queue.
fn x_death_count(d: &Delivery, queue: &str) -> Option<i64> {
    let AMQPValue::FieldArray(deaths) = header(d, "x-death")? else {
        panic!("x-death not an array")
    };
    deaths.as_slice().iter().find_map(|e| {
        let AMQPValue::FieldTable(t) = e else {
            return None;
        };
        let q = match t.inner().get("queue")? {
            AMQPValue::LongString(s) => s.to_string(),
            _ => return None,
        };
        match (q == queue, t.inner().get("count")?) {
            (true, AMQPValue::LongLongInt(n)) => Some(*n),
            _ => None,
        }
    })
}

async fn delete(ch: &Channel, names: &[&str]) {
    for n in names {
        let _ = ch
            .queue_delete((*n).into(), QueueDeleteOptions::default())
            .await;
    }
}

#[tokio::test]
async fn notification_use_case_email_retried_three_times_webhook_once() {
    let (email, webhook, fanout) = (
        unique("email-queue"),
        unique("webhook-queue"),
        unique("notifications"),
    );
    // The first delay is 1 s: "later", published right after the first nack,
    // must be in the queue (confirmed) before that retry falls due, which a
    // 50 ms delay did not guarantee on a loaded machine.
    let nackd = start(&policy(&[&email], "\"1s\", \"100ms\", \"200ms\"", "")).await;
    let conn = nackd.connect().await;
    let setup = conn.create_channel().await.unwrap();
    setup
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    setup
        .exchange_declare(
            fanout.as_str().into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for q in [&email, &webhook] {
        queue(&setup, q, FieldTable::default()).await;
        setup
            .queue_bind(
                q.as_str().into(),
                fanout.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
    }
    let email_ch = conn.create_channel().await.unwrap();
    let webhook_ch = conn.create_channel().await.unwrap();
    let mut email_c = consume(&email_ch, &email, Some(10)).await;
    let mut webhook_c = consume(&webhook_ch, &webhook, Some(10)).await;
    publish(
        &setup,
        &fanout,
        "user.42",
        b"welcome",
        BasicProperties::default(),
    )
    .await;

    let w = next(&mut webhook_c, Duration::from_secs(5))
        .await
        .expect("webhook delivery");
    w.ack(BasicAckOptions::default()).await.unwrap();

    let delays = [1000u64, 100, 200];
    let mut order = Vec::new();
    let first = next(&mut email_c, Duration::from_secs(5))
        .await
        .expect("email delivery");
    assert_eq!(retry_count(&first), None);
    let mut nacked_at = Instant::now();
    first
        .nack(BasicNackOptions {
            requeue: false,
            multiple: false,
        })
        .await
        .unwrap();
    // Published right after the nack: it must come before the retry (tail of queue).
    publish(&setup, "", &email, b"later", BasicProperties::default()).await;
    let mut retries = 0;
    while retries < 3 || order.last() != Some(&"later".to_string()) && order.len() < 5 {
        let d = next(&mut email_c, Duration::from_secs(10))
            .await
            .expect("a delivery");
        let body = String::from_utf8(d.data.clone()).unwrap();
        order.push(body.clone());
        if body == "later" {
            d.ack(BasicAckOptions::default()).await.unwrap();
            continue;
        }
        retries += 1;
        let waited = nacked_at.elapsed();
        let delay = Duration::from_millis(delays[retries - 1]);
        assert!(
            waited >= delay,
            "retry {retries} came after {waited:?}, before its {delay:?} delay"
        );
        assert!(
            waited < delay + Duration::from_secs(5),
            "retry {retries} far too late: {waited:?}"
        );
        assert_eq!(retry_count(&d), Some(retries as i64));
        assert_eq!(
            x_death_count(&d, &email),
            Some(retries as i64),
            "x-death count as RabbitMQ users read it"
        );
        assert_eq!(
            d.exchange.as_str(),
            "",
            "republished through the default exchange"
        );
        assert_eq!(d.routing_key.as_str(), email.as_str());
        assert_eq!(
            header(&d, "x-first-death-exchange"),
            Some(&AMQPValue::LongString(fanout.as_str().into()))
        );
        if retries < 3 {
            nacked_at = Instant::now();
            d.nack(BasicNackOptions {
                requeue: false,
                multiple: false,
            })
            .await
            .unwrap();
        } else {
            d.ack(BasicAckOptions::default()).await.unwrap();
            if order.contains(&"later".to_string()) {
                break;
            }
        }
    }
    assert_eq!(
        order.first().map(String::as_str),
        Some("later"),
        "the retry went to the tail: {order:?}"
    );
    assert_eq!(
        order.iter().filter(|b| *b == "welcome").count(),
        3,
        "{order:?}"
    );
    assert!(
        next(&mut email_c, Duration::from_millis(600))
            .await
            .is_none(),
        "no extra delivery"
    );
    assert!(
        next(&mut webhook_c, Duration::from_millis(100))
            .await
            .is_none(),
        "webhook got it once"
    );
    let check = conn.create_channel().await.unwrap();
    delete(&check, &[&email, &webhook]).await;
}

/// Declares exchange `x` of `kind` and a queue bound to it with `key`.
async fn dead_letter_queue(ch: &Channel, x: &str, kind: ExchangeKind, q: &str, key: &str) {
    ch.exchange_declare(
        x.into(),
        kind,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    queue(ch, q, FieldTable::default()).await;
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

/// Nacks (or rejects) `n` deliveries, each allowed 10 s to come: the wait
/// ends on what is expected, not on a silence a slow retry can outlast.
async fn nack_n(consumer: &mut Consumer, reject: bool, n: usize) {
    for i in 0..n {
        let d = next(consumer, Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("delivery {} of {n} in 10 s", i + 1));
        if reject {
            d.reject(BasicRejectOptions { requeue: false })
                .await
                .unwrap();
        } else {
            d.nack(BasicNackOptions {
                requeue: false,
                multiple: false,
            })
            .await
            .unwrap();
        }
    }
}

/// Polls `q` (no-ack basic.get) until a message is there: dead-lettering
/// and republishing happen on other connections than the caller's.
async fn get_eventually(ch: &Channel, q: &str, what: &str) -> Delivery {
    let got = wait_for(
        Duration::from_secs(15),
        what,
        || async {
            ch.basic_get(q.into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
        },
        Option::is_some,
    )
    .await;
    got.unwrap().delivery
}

/// Polls the message count of `q` until it is `n`.
async fn count_eventually(ch: &Channel, q: &str, n: u32, what: &str) {
    wait_for(
        Duration::from_secs(15),
        what,
        || message_count(ch, q),
        |count| *count == n,
    )
    .await;
}

#[tokio::test]
async fn exhausted_schedule_goes_to_the_queues_own_dlx_with_reject_too() {
    let (q, dlq, dlx) = (unique("dlx-src"), unique("dlx-dst"), unique("dlx-x"));
    let origin = unique("dlx-origin");
    let nackd = start(&policy(
        &[&q],
        "\"30ms\", \"60ms\"",
        "on_exhausted = \"reject\"",
    ))
    .await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    dead_letter_queue(&ch, &dlx, ExchangeKind::Fanout, &dlq, "").await;
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(dlx.as_str().into()),
    );
    queue(&ch, &q, args).await;
    // Published through an exchange of its own, so that where it came from
    // is something the dead-letter consumer can lose.
    ch.exchange_declare(
        origin.as_str().into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        q.as_str().into(),
        origin.as_str().into(),
        "order.7".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    publish(
        &ch,
        &origin,
        "order.7",
        b"doomed",
        BasicProperties::default(),
    )
    .await;
    let consumer_ch = conn.create_channel().await.unwrap();
    let mut consumer = consume(&consumer_ch, &q, Some(10)).await;
    // basic.reject this time: 1 delivery + 2 retries, then the queue's DLX.
    nack_n(&mut consumer, true, 3).await;
    let dead = get_eventually(&ch, &dlq, "the message in the DLX queue").await;
    assert_eq!(dead.data, b"doomed");
    assert_eq!(retry_count(&dead), Some(2));
    // What survives the broker's own dead-lettering on every version.
    assert_eq!(
        header(&dead, "x-original-exchange"),
        Some(&AMQPValue::LongString(origin.as_str().into()))
    );
    assert_eq!(
        header(&dead, "x-original-routing-key"),
        Some(&AMQPValue::LongString("order.7".into()))
    );
    // x-death is the broker's when it dead-letters: 3.x counts on from
    // nackd's entry, 4.x replaces the header with a single entry of its own
    // (count 1, exchange "" of the retry), as docs/src/headers.md says.
    let first_exchange = header(&dead, "x-first-death-exchange");
    if BROKER.at_least(4, 0) {
        assert_eq!(x_death_count(&dead, &q), Some(1), "{}", BROKER.label());
        assert_eq!(first_exchange, Some(&AMQPValue::LongString("".into())));
    } else {
        assert_eq!(x_death_count(&dead, &q), Some(3), "{}", BROKER.label());
        assert_eq!(
            first_exchange,
            Some(&AMQPValue::LongString(origin.as_str().into()))
        );
    }
    assert!(
        next(&mut consumer, Duration::from_millis(500))
            .await
            .is_none(),
        "no fourth delivery"
    );
    assert_eq!(message_count(&ch, &q).await, 0);
    delete(&ch, &[&q, &dlq]).await;
    ch.exchange_delete(origin.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn exhausted_schedule_goes_to_the_configured_dead_letter_exchange() {
    let (q, dlq, dlx) = (
        unique("dlx-cfg-src"),
        unique("dlx-cfg-dst"),
        unique("dlx-cfg-x"),
    );
    let nackd = start(&policy(
        &[&q],
        "\"30ms\"",
        &format!("on_exhausted = {{ exchange = \"{dlx}\", routing_key = \"dead\" }}"),
    ))
    .await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    dead_letter_queue(&ch, &dlx, ExchangeKind::Direct, &dlq, "dead").await;
    queue(&ch, &q, FieldTable::default()).await;
    publish(&ch, "", &q, b"to the dlx", BasicProperties::default()).await;
    let consumer_ch = conn.create_channel().await.unwrap();
    let mut consumer = consume(&consumer_ch, &q, Some(10)).await;
    nack_n(&mut consumer, false, 2).await;
    let dead = get_eventually(
        &ch,
        &dlq,
        "the message in the configured dead-letter exchange's queue",
    )
    .await;
    assert!(
        next(&mut consumer, Duration::from_millis(500))
            .await
            .is_none(),
        "no third delivery"
    );
    assert_eq!(dead.data, b"to the dlx");
    assert_eq!(retry_count(&dead), Some(1));
    assert_eq!(x_death_count(&dead, &q), Some(2), "two rejections recorded");
    assert!(matches!(
        header(&dead, "x-exhausted-reason"),
        Some(AMQPValue::LongString(_))
    ));
    assert_eq!(message_count(&ch, &q).await, 0, "acked on the source queue");
    delete(&ch, &[&q, &dlq]).await;
}

async fn get(ch: &Channel, q: &str) -> Delivery {
    ch.basic_get(q.into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("a message")
        .delivery
}

#[tokio::test]
async fn multiple_settles_over_intercepted_and_plain_queues_do_exactly_the_right_thing() {
    let (a, b) = (unique("mixed-held"), unique("mixed-plain"));
    // 2 s: the check that a2..a4 are held (not back yet) runs well before it.
    let nackd = start(&policy(&[&a], "\"2s\"", "")).await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let setup = conn.create_channel().await.unwrap();
    setup
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for q in [&a, &b] {
        queue(&setup, q, FieldTable::default()).await;
    }
    for (q, body) in [
        (&a, "a1"),
        (&b, "b1"),
        (&a, "a2"),
        (&b, "b2"),
        (&a, "a3"),
        (&b, "b3"),
        (&a, "a4"),
    ] {
        publish(&setup, "", q, body.as_bytes(), BasicProperties::default()).await;
    }
    // Tags 1..=7 on one channel: a1 b1 a2 b2 a3 b3 a4.
    let mut tags = Vec::new();
    for q in [&a, &b, &a, &b, &a, &b, &a] {
        let d = get(&ch, q).await;
        tags.push((String::from_utf8(d.data).unwrap(), d.delivery_tag));
    }
    let tag = |name: &str| tags.iter().find(|(n, _)| n == name).unwrap().1;
    // a2 is claimed (reject), then ack(multiple) up to b2 must ack a1, b1, b2 only.
    ch.basic_reject(tag("a2"), BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    ch.basic_ack(tag("b2"), BasicAckOptions { multiple: true })
        .await
        .unwrap();
    // nack(multiple, requeue) up to a4: a3, a4 are delayed, b3 is requeued by the broker.
    ch.basic_nack(
        tag("a4"),
        BasicNackOptions {
            multiple: true,
            requeue: true,
        },
    )
    .await
    .unwrap();
    // `setup` is another channel: the broker requeues b3 when it gets to it.
    count_eventually(&setup, &b, 1, "b3 back in the plain queue at once").await;
    assert_eq!(
        message_count(&setup, &a).await,
        0,
        "a2, a3, a4 held, a1 acked"
    );
    let b3 = get(&setup, &b).await;
    assert_eq!(b3.data, b"b3");
    assert!(b3.redelivered);
    b3.ack(BasicAckOptions::default()).await.unwrap();
    count_eventually(&setup, &a, 3, "a2, a3, a4 back after the delay").await;
    let mut back = Vec::new();
    for _ in 0..3 {
        let d = get(&setup, &a).await;
        assert_eq!(retry_count(&d), Some(1));
        back.push(String::from_utf8(d.data.clone()).unwrap());
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    back.sort();
    assert_eq!(back, vec!["a2", "a3", "a4"]);
    assert_eq!(message_count(&setup, &b).await, 0);
    // A settle the broker refused closes `ch`, asynchronously: a round trip
    // on `ch` after all of its settles (the client's and nackd's acks of the
    // held ones, sent before they could be republished) shows it is open.
    let alive = ch
        .queue_declare(
            b.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    assert!(
        alive.is_ok() && ch.status().connected(),
        "no settle was refused by the broker: {alive:?}"
    );
    delete(&setup, &[&a, &b]).await;
}

#[tokio::test]
async fn requeue_pass_leaves_requeue_true_nacks_to_the_broker() {
    let q = unique("pass");
    // 1 s: the check that the requeue=false nack is held runs well before it.
    let nackd = start(&policy(&[&q], "\"1s\"", "requeue = \"pass\"")).await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    queue(&ch, &q, FieldTable::default()).await;
    publish(&ch, "", &q, b"m", BasicProperties::default()).await;
    let d = get(&ch, &q).await;
    d.nack(BasicNackOptions {
        requeue: true,
        multiple: false,
    })
    .await
    .unwrap();
    let again = get(&ch, &q).await;
    assert!(again.redelivered, "requeued by the broker");
    assert_eq!(retry_count(&again), None, "not through nackd's retry");
    again
        .nack(BasicNackOptions {
            requeue: false,
            multiple: false,
        })
        .await
        .unwrap();
    assert_eq!(
        message_count(&ch, &q).await,
        0,
        "requeue=false is still delayed"
    );
    let retried = get_eventually(&ch, &q, "the retry").await;
    assert_eq!(retry_count(&retried), Some(1));
    delete(&ch, &[&q]).await;
}

#[tokio::test]
async fn quorum_queues_work_too() {
    let q = unique("quorum");
    let nackd = start(&policy(&[&q], "\"50ms\", \"50ms\"", "")).await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    queue(&ch, &q, args).await;
    publish(&ch, "", &q, b"q", BasicProperties::default()).await;
    let consumer_ch = conn.create_channel().await.unwrap();
    let mut consumer = consume(&consumer_ch, &q, Some(10)).await;
    for n in 0..3 {
        let d = next(&mut consumer, Duration::from_secs(10))
            .await
            .expect("delivery");
        assert_eq!(retry_count(&d), if n == 0 { None } else { Some(n) });
        if n < 2 {
            d.nack(BasicNackOptions {
                requeue: false,
                multiple: false,
            })
            .await
            .unwrap();
        } else {
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
    }
    assert!(next(&mut consumer, Duration::from_millis(300))
        .await
        .is_none());
    delete(&ch, &[&q]).await;
}

#[tokio::test]
async fn headers_properties_and_body_arrive_unchanged_on_the_retry() {
    let q = unique("props");
    let nackd = start(&policy(&[&q], "\"40ms\"", "")).await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    queue(&ch, &q, FieldTable::default()).await;
    let mut nested = FieldTable::default();
    nested.insert("inner".into(), AMQPValue::LongInt(1));
    let mut h = FieldTable::default();
    h.insert("S".into(), AMQPValue::LongString("text ✓".into()));
    h.insert("t".into(), AMQPValue::Boolean(true));
    h.insert("b".into(), AMQPValue::ShortShortInt(-5));
    h.insert("B".into(), AMQPValue::ShortShortUInt(250));
    h.insert("s".into(), AMQPValue::ShortInt(-300));
    h.insert("u".into(), AMQPValue::ShortUInt(60000));
    h.insert("I".into(), AMQPValue::LongInt(-70000));
    h.insert("i".into(), AMQPValue::LongUInt(4_000_000_000));
    h.insert("l".into(), AMQPValue::LongLongInt(-9_000_000_000));
    h.insert("f".into(), AMQPValue::Float(1.5));
    h.insert("d".into(), AMQPValue::Double(2.25));
    h.insert(
        "D".into(),
        AMQPValue::DecimalValue(amq_protocol::types::DecimalValue {
            scale: 2,
            value: 12345,
        }),
    );
    h.insert("T".into(), AMQPValue::Timestamp(1_700_000_000));
    h.insert("F".into(), AMQPValue::FieldTable(nested));
    h.insert(
        "A".into(),
        AMQPValue::FieldArray(
            vec![AMQPValue::LongInt(1), AMQPValue::LongString("two".into())].into(),
        ),
    );
    h.insert("x".into(), AMQPValue::ByteArray(vec![0u8, 1, 255].into()));
    h.insert("V".into(), AMQPValue::Void);
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_content_encoding("gzip".into())
        .with_headers(h.clone())
        .with_delivery_mode(2)
        .with_priority(4)
        .with_correlation_id("corr-1".into())
        .with_reply_to("replies".into())
        .with_expiration("600000".into())
        .with_message_id("msg-1".into())
        .with_timestamp(1_700_000_123)
        .with_type("order.created".into())
        .with_user_id("guest".into())
        .with_app_id("shop".into());
    let body: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
    publish(&ch, "", &q, &body, props).await;
    let first = get(&ch, &q).await;
    first
        .nack(BasicNackOptions {
            requeue: false,
            multiple: false,
        })
        .await
        .unwrap();
    let retried = get_eventually(&ch, &q, "the retry").await;
    assert!(retried.data == body, "body intact");
    let (before, after) = (&first.properties, &retried.properties);
    let mut after_headers = after.headers().clone().unwrap();
    let ours: Vec<String> = after_headers
        .inner()
        .keys()
        .filter(|k| k.as_str().starts_with("x-"))
        .map(|k| k.to_string())
        .collect();
    let mut trimmed = FieldTable::default();
    for (k, v) in after_headers.inner() {
        if !ours.contains(&k.to_string()) {
            trimmed.insert(k.clone(), v.clone());
        }
    }
    after_headers = trimmed;
    assert_eq!(
        Some(&after_headers),
        before.headers().as_ref(),
        "every other header, value and type"
    );
    assert_eq!(before.headers().as_ref(), Some(&h));
    assert_eq!(
        before.clone().with_headers(FieldTable::default()),
        after.clone().with_headers(FieldTable::default()),
        "all properties"
    );
    let mut expected_ours = vec![
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
        "x-original-exchange",
        "x-original-routing-key",
        "x-retry-count",
        "x-retry-delay-ms",
    ];
    expected_ours.sort();
    let mut ours_sorted: Vec<&str> = ours.iter().map(String::as_str).collect();
    ours_sorted.sort();
    assert_eq!(ours_sorted, expected_ours);
    assert_eq!(
        header(&retried, "x-retry-delay-ms"),
        Some(&AMQPValue::LongLongInt(40))
    );
    delete(&ch, &[&q]).await;
}

#[tokio::test]
async fn closing_the_channel_right_after_a_nack_does_not_deliver_twice() {
    let q = unique("close-after-nack");
    let nackd = start(&policy(&[&q], "\"200ms\"", "")).await;
    let conn = nackd.connect().await;
    let setup = conn.create_channel().await.unwrap();
    setup
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    queue(&setup, &q, FieldTable::default()).await;
    for i in 0..20u8 {
        publish(&setup, "", &q, &[i], BasicProperties::default()).await;
    }
    let ch = conn.create_channel().await.unwrap();
    let mut consumer = consume(&ch, &q, Some(10)).await;
    let mut last = 0;
    for _ in 0..10 {
        let d = next(&mut consumer, Duration::from_secs(5)).await.unwrap();
        last = d.delivery_tag;
    }
    // Nack all ten and close at once, before nackd can have acked upstream.
    ch.basic_nack(
        last,
        BasicNackOptions {
            multiple: true,
            requeue: true,
        },
    )
    .await
    .unwrap();
    ch.close(200, "bye".into()).await.unwrap();
    let other = conn.create_channel().await.unwrap();
    let mut consumer = consume(&other, &q, Some(10)).await;
    let mut seen = std::collections::HashMap::<u8, Vec<Option<i64>>>::new();
    // Until every message came (the retries after their delay, however slow
    // the machine), then as long as more keep coming: a duplicate would.
    loop {
        let within = if seen.len() < 20 {
            Duration::from_secs(10)
        } else {
            Duration::from_millis(800)
        };
        let Some(d) = next(&mut consumer, within).await else {
            break;
        };
        seen.entry(d.data[0]).or_default().push(retry_count(&d));
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(seen.len(), 20, "every message arrives: {seen:?}");
    for (body, counts) in &seen {
        let want = if *body < 10 {
            vec![Some(1)]
        } else {
            vec![None]
        };
        assert_eq!(
            counts, &want,
            "message {body}: exactly once, and the nacked ones as retries"
        );
    }
    delete(&other, &[&q]).await;
}

/// Issue 12, item 5: `queue.declare("")` and `basic.consume("")` pipelined
/// on one channel. The broker consumes from the new server-named queue; a
/// nack from that consumer is held for that queue, not for the queue
/// declared before it.
#[tokio::test]
async fn pipelined_declare_and_consume_hold_for_the_queue_the_broker_named() {
    use amq_protocol::protocol::{basic, queue, AMQPClass};
    use common::raw::RawClient;
    use nackd_core::protocol::method;

    let nackd = start("[[policy]]\nqueues = [\"amq.gen-*\"]\ndelays = [\"10m\"]\n").await;
    let mut raw = RawClient::open(nackd.addr, 131072, 0).await;
    raw.open_channel(1).await;
    let declare = method::encode(
        1,
        &AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "".into(),
            passive: false,
            durable: false,
            // Exclusive: 4.3 refuses transient non-exclusive queues.
            exclusive: true,
            auto_delete: true,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    );
    let declared = |m: Option<AMQPClass>| match m {
        Some(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok))) => ok.queue.to_string(),
        other => panic!("expected declare-ok, got {other:?}"),
    };
    raw.send(&declare).await;
    let first = declared(raw.method().await);
    let consume = RawClient::consume_frame(1, "");
    // Both frames in one write: nackd sees the consume before the broker
    // has named the second queue.
    raw.send(&[declare, consume].concat()).await;
    let second = declared(raw.method().await);
    assert!(matches!(
        raw.method().await,
        Some(AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_)))
    ));
    assert_ne!(first, second);
    let direct = direct().await;
    let dch = direct.create_channel().await.unwrap();
    publish(
        &dch,
        "",
        &second,
        b"for the second queue",
        BasicProperties::default(),
    )
    .await;
    let tag = raw.delivery().await;
    raw.send(&method::nack(1, tag, false, false)).await;
    let s = common::ops::until(nackd.metrics, "the nack held", |s| {
        s.sum("nackd_held_messages") == 1.0
    })
    .await;
    let held = |q: &str| s.get("nackd_held_messages", &[("vhost", "/"), ("queue", q)]);
    assert_eq!(
        held(&second),
        1.0,
        "held for the queue the broker consumed from"
    );
    assert_eq!(held(&first), 0.0);
    drop(raw);
    nackd.stop().await;
}

/// Issue 12, item 4: the store refuses a claimed nack while the client's
/// publish on the same channel is half sent. nackd's deferred nack
/// (requeue) waits for the publish's last frame: the broker sees no frame
/// inside the content (it would close the connection with 505) and
/// requeues the message.
#[tokio::test]
async fn a_refused_nack_waits_for_the_publish_in_flight_on_its_channel() {
    use amq_protocol::protocol::{basic, AMQPClass};
    use common::raw::RawClient;
    use nackd_core::protocol::content::encode_header;
    use nackd_core::protocol::frame::FrameType;
    use nackd_core::protocol::method::{self, put_frame};

    let q = unique("refused-mid-publish");
    let (nackd, _store) = start_with_full_store(&q, "300ms").await;
    let direct = direct().await;
    let dch = direct.create_channel().await.unwrap();
    declare_durable(&dch, &q).await;
    let mut raw = RawClient::open(nackd.addr, 131072, 0).await;
    raw.open_channel(1).await;
    raw.consume(1, &q).await;
    publish(&dch, "", &q, b"refused", BasicProperties::default()).await;
    let tag = raw.delivery().await;
    // The nack, then a publish on the same channel: method and header now,
    // the body only after the store has refused the nack.
    let mut bytes = bytes::BytesMut::new();
    bytes.extend_from_slice(&method::nack(1, tag, false, true));
    let sink = unique("refused-sink");
    let publish_method = AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
        exchange: "".into(),
        routing_key: sink.as_str().into(),
        mandatory: false,
        immediate: false,
    }));
    bytes.extend_from_slice(&method::encode(1, &publish_method));
    let header = encode_header(60, 5, &Default::default());
    put_frame(&mut bytes, FrameType::Header, 1, &header);
    raw.send(&bytes).await;
    common::ops::until(nackd.metrics, "the store refusing the nack", |s| {
        s.get(
            "nackd_nacks_deferred_total",
            &[("reason", "store_unavailable")],
        ) == 1.0
    })
    .await;
    // Past the deferral's delay: its nack is due, and waits for the body.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut body = bytes::BytesMut::new();
    put_frame(&mut body, FrameType::Body, 1, b"hello");
    raw.send(&body).await;
    // The connection lives on, and the broker requeued the refused message
    // to this very consumer.
    match raw.method().await {
        Some(AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) => assert!(d.redelivered),
        other => panic!("expected the redelivery, got {other:?}"),
    }
    drop(raw);
    dch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    nackd.stop().await;
}

/// Issue 12, item 6: a client that settles a claimed tag a second time
/// (nack, then ack) before nackd has stored it. The broker gets the second
/// settle as sent; nackd sends no ack of its own (the broker would close
/// the channel with 406 for it) and keeps no copy (the client's ack ended
/// the message).
#[tokio::test]
async fn a_second_settle_of_a_claimed_tag_goes_to_the_broker_alone() {
    use amq_protocol::protocol::{basic, AMQPClass};
    use common::raw::RawClient;
    use nackd_core::protocol::method;

    let q = unique("settled-twice");
    let nackd = start(&format!(
        "[[policy]]\nqueues = [\"{q}\"]\ndelays = [\"10m\"]\n"
    ))
    .await;
    let direct = direct().await;
    let dch = direct.create_channel().await.unwrap();
    declare_durable(&dch, &q).await;
    let mut raw = RawClient::open(nackd.addr, 131072, 0).await;
    raw.open_channel(1).await;
    raw.consume(1, &q).await;
    publish(&dch, "", &q, b"twice", BasicProperties::default()).await;
    let tag = raw.delivery().await;
    raw.send(
        &[
            method::nack(1, tag, false, true),
            method::ack(1, tag, false),
        ]
        .concat(),
    )
    .await;
    // The claim was stored, then cancelled: written, and nothing live.
    let s = common::ops::until(nackd.metrics, "the claim stored and cancelled", |s| {
        s.sum("nackd_held_messages") == 0.0
            && s.get("nackd_store_live_bytes", &[]) == 0.0
            && s.get("nackd_store_bytes", &[]) > 0.0
    })
    .await;
    assert_eq!(s.get("nackd_nacks_intercepted_total", &[]), 0.0);
    // The channel is still open: a round trip on it gets its answer.
    let qos = AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
        prefetch_count: 10,
        global: false,
    }));
    raw.send(&method::encode(1, &qos)).await;
    match raw.method().await {
        Some(AMQPClass::Basic(basic::AMQPMethod::QosOk(_))) => {}
        other => panic!("expected qos-ok, got {other:?}"),
    }
    let left = message_count(&dch, &q).await;
    assert_eq!(left, 0, "the client's ack ended the message");
    drop(raw);
    dch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    nackd.stop().await;
}

//! `x-delayed-message` exchanges through nackd (issue 23), on a broker
//! without the plugin: declares, publishes with `x-delay`, publisher
//! confirms, transactions, and the registry of delayed exchanges across
//! restarts and SIGKILL. Real nackd, real RabbitMQ, real lapin clients;
//! what arrives is read straight from the broker.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::process::{delayed_config, Process};
use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, ExchangeKind};

/// The type the plugin registered, which nackd emulates.
const DELAYED_TYPE: &str = "x-delayed-message";

/// Declares `x` of type `x-delayed-message` with `x-delayed-type = kind`.
pub(super) async fn declare_delayed(ch: &Channel, x: &str, kind: &str) -> lapin::Result<()> {
    let mut args = FieldTable::default();
    args.insert("x-delayed-type".into(), AMQPValue::LongString(kind.into()));
    ch.exchange_declare(
        x.into(),
        ExchangeKind::Custom(DELAYED_TYPE.into()),
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
}

/// Declares durable queue `q` bound to `x` with `key`.
pub(super) async fn bind(ch: &Channel, x: &str, q: &str, key: &str) {
    declare_durable(ch, q).await;
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

/// Properties with `x-delay = delay` among the headers (none: no header).
pub(super) fn with_delay(props: BasicProperties, delay: Option<AMQPValue>) -> BasicProperties {
    let mut headers = props.headers().clone().unwrap_or_default();
    if let Some(delay) = delay {
        headers.insert("x-delay".into(), delay);
    }
    props.with_headers(headers)
}

/// Publishes `body` to `x` with `key` and waits for its confirm (if the
/// channel is in confirm mode).
pub(super) async fn publish_to(
    ch: &Channel,
    x: &str,
    key: &str,
    body: &[u8],
    delay: Option<AMQPValue>,
) -> Confirmation {
    ch.basic_publish(
        x.into(),
        key.into(),
        BasicPublishOptions::default(),
        body,
        with_delay(BasicProperties::default(), delay),
    )
    .await
    .unwrap()
    .await
    .unwrap()
}

/// The next delivery of `c`, acked, within `within`; panics with `what`.
pub(super) async fn arrival(
    c: &mut lapin::Consumer,
    within: Duration,
    what: &str,
) -> lapin::message::Delivery {
    let d = next(c, within)
        .await
        .unwrap_or_else(|| panic!("{what}: nothing arrived within {within:?}"));
    d.ack(BasicAckOptions::default()).await.unwrap();
    d
}

/// Nothing arrives on `c` for `quiet`.
pub(super) async fn nothing_more(c: &mut lapin::Consumer, quiet: Duration, what: &str) {
    if let Some(d) = next(c, quiet).await {
        panic!(
            "{what}: {:?} arrived",
            String::from_utf8_lossy(&d.data).into_owned()
        );
    }
}

pub(super) fn is_code(err: &lapin::Error, code: u16, name: &str) -> bool {
    let text = err.to_string();
    text.contains(&code.to_string()) || text.contains(name)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Declare, bind and publish as with the plugin: one delayed and one
/// immediate publish on a confirm channel, `x-delay` values the plugin
/// routes at once, passive declare, a conflicting redeclare, delete.
#[tokio::test]
async fn declare_bind_publish() {
    let store = tempfile::tempdir().unwrap();
    let nackd = start_delayed(store.path(), "").await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let (x, q) = (unique("dx"), unique("dq"));
    declare_delayed(&ch, &x, "direct")
        .await
        .expect("x-delayed-message declared through nackd");
    bind(&ch, &x, &q, "k").await;
    // The broker has the real type, with x-delayed-type kept on it.
    let broker = direct().await;
    let probe = broker.create_channel().await.unwrap();
    probe
        .exchange_declare(
            x.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("the broker has the exchange");
    let listed = tokio::task::spawn_blocking(|| {
        BROKER.ctl_ok(&["list_exchanges", "-q", "name", "type", "arguments"])
    })
    .await
    .unwrap();
    let line = listed
        .lines()
        .find(|l| l.split('\t').next() == Some(x.as_str()))
        .unwrap_or_else(|| panic!("rabbitmqctl does not list {x}: {listed}"));
    assert!(
        line.contains("\tdirect\t") && line.contains(r#"{"x-delayed-type","direct"}"#),
        "the broker's exchange: {line}"
    );
    let mut arrivals = consume(&broker.create_channel().await.unwrap(), &q, None).await;

    // One delayed, one immediate, both confirmed with ack.
    let props = BasicProperties::default()
        .with_content_type("text/plain".into())
        .with_message_id("m-later".into())
        .with_delivery_mode(2);
    let mut headers = FieldTable::default();
    headers.insert("h".into(), AMQPValue::LongString("v".into()));
    let sent = Instant::now();
    let confirm = ch
        .basic_publish(
            x.as_str().into(),
            "k".into(),
            BasicPublishOptions::default(),
            b"later",
            with_delay(props.with_headers(headers), Some(AMQPValue::LongInt(1500))),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack(), "delayed publish: {confirm:?}");
    let confirm = publish_to(&ch, &x, "k", b"now", None).await;
    assert!(confirm.is_ack(), "immediate publish: {confirm:?}");
    let d = arrival(&mut arrivals, Duration::from_secs(1), "the immediate one").await;
    assert_eq!(&d.data[..], b"now", "the immediate one comes first");
    let d = arrival(&mut arrivals, Duration::from_secs(6), "the delayed one").await;
    let took = sent.elapsed();
    assert_eq!(&d.data[..], b"later");
    assert!(
        took >= Duration::from_millis(1500),
        "x-delay 1500 arrived after {took:?}"
    );
    assert!(took < Duration::from_millis(4500), "arrived after {took:?}");
    // Routed by the real exchange, with its routing key, properties, body.
    assert_eq!(d.exchange.as_str(), x);
    assert_eq!(d.routing_key.as_str(), "k");
    assert_eq!(
        d.properties
            .content_type()
            .as_ref()
            .map(ShortString::as_str),
        Some("text/plain")
    );
    assert_eq!(
        d.properties.message_id().as_ref().map(ShortString::as_str),
        Some("m-later")
    );
    assert_eq!(*d.properties.delivery_mode(), Some(2));
    let h = d.properties.headers().clone().unwrap_or_default();
    assert_eq!(
        h.inner().get("h"),
        Some(&AMQPValue::LongString("v".into())),
        "headers kept: {h:?}"
    );
    // As the plugin delivers it: the delay spent, negated, of its type (a
    // consumer republishing it as it came gets it routed at once).
    assert_eq!(
        h.inner().get("x-delay"),
        Some(&AMQPValue::LongInt(-1500)),
        "x-delay as delivered: {h:?}"
    );

    // x-delay <= 0 or not an integer: routed at once, as the plugin does.
    for (what, delay) in [
        ("x-delay -5", AMQPValue::LongLongInt(-5)),
        ("x-delay 0", AMQPValue::ShortInt(0)),
        ("x-delay \"3000\"", AMQPValue::LongString("3000".into())),
    ] {
        let confirm = publish_to(&ch, &x, "k", what.as_bytes(), Some(delay)).await;
        assert!(confirm.is_ack(), "{what}: {confirm:?}");
        let d = arrival(&mut arrivals, Duration::from_secs(1), what).await;
        assert_eq!(&d.data[..], what.as_bytes());
    }

    // A passive declare finds it.
    ch.exchange_declare(
        x.as_str().into(),
        ExchangeKind::Custom(DELAYED_TYPE.into()),
        ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("passive declare through nackd");

    // Another x-delayed-type: the broker's 406 on that channel only.
    let other = conn.create_channel().await.unwrap();
    let err = declare_delayed(&other, &x, "topic")
        .await
        .expect_err("redeclare with x-delayed-type topic");
    assert!(is_code(&err, 406, "PRECONDITION_FAILED"), "{err}");
    assert!(!other.status().connected(), "that channel is closed");
    assert!(conn.status().connected(), "the connection is not");
    // The refused declare changed nothing: still delayed.
    let sent = Instant::now();
    let confirm = publish_to(&ch, &x, "k", b"still", Some(AMQPValue::LongInt(1000))).await;
    assert!(confirm.is_ack(), "{confirm:?}");
    let d = arrival(&mut arrivals, Duration::from_secs(5), "still delayed").await;
    assert_eq!(&d.data[..], b"still");
    assert!(
        sent.elapsed() >= Duration::from_millis(1000),
        "{:?}",
        sent.elapsed()
    );

    // Deleted: gone from the broker, and no longer delayed through nackd.
    ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .expect("delete through nackd");
    let probe = broker.create_channel().await.unwrap();
    let err = probe
        .exchange_declare(
            x.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect_err("the exchange is deleted on the broker");
    assert!(is_code(&err, 404, "NOT_FOUND"), "{err}");
    ch.exchange_declare(
        x.as_str().into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    bind(&ch, &x, &q, "k").await;
    let confirm = publish_to(&ch, &x, "k", b"plain", Some(AMQPValue::LongInt(1500))).await;
    assert!(confirm.is_ack(), "{confirm:?}");
    let d = arrival(
        &mut arrivals,
        Duration::from_secs(1),
        "a plain exchange's publish",
    )
    .await;
    assert_eq!(&d.data[..], b"plain");
    nothing_more(&mut arrivals, Duration::from_millis(500), "after all").await;

    let ch = broker.create_channel().await.unwrap();
    delete_queues(&ch, &[&q]).await;
    let _ = ch
        .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    nackd.stop().await;
}

/// A body of the SIGKILL test: its id and the earliest time it may arrive
/// (ms since the epoch), `"id earliest"`.
fn body(id: u32, earliest: u64) -> Vec<u8> {
    format!("{id} {earliest}").into_bytes()
}

fn parse(body: &[u8]) -> (u32, u64) {
    let text = std::str::from_utf8(body).unwrap();
    let (id, earliest) = text.split_once(' ').unwrap();
    (id.parse().unwrap(), earliest.parse().unwrap())
}

/// A small xorshift: the delays vary from run to run (the seed is printed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Thousands of confirmed publishes on one channel, delayed and immediate
/// interleaved, every confirm an ack in the publisher's own sequence;
/// nackd SIGKILLed during the wait and started again on its store: every
/// message arrives, none early, none twice but in the documented window.
#[tokio::test(flavor = "multi_thread")]
async fn thousands_confirmed_across_sigkill() {
    const N: u32 = 3000;
    let dir = tempfile::tempdir().unwrap();
    let cfg = delayed_config(dir.path(), "");
    let nackd = Process::start(&cfg);
    let (x, q) = (unique("dkill-x"), unique("dkill-q"));
    let conn = connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr)).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_delayed(&ch, &x, "direct").await.unwrap();
    bind(&ch, &x, &q, "k").await;

    // Consumed straight from the broker from the start: an arrival is seen
    // when it happens, so an early one cannot hide.
    let broker = direct().await;
    let consumer_ch = broker.create_channel().await.unwrap();
    let mut deliveries = consume(&consumer_ch, &q, Some(500)).await;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        while let Some(Ok(d)) = deliveries.next().await {
            let at = now_ms();
            let (id, earliest) = parse(&d.data);
            d.ack(BasicAckOptions::default()).await.unwrap();
            if tx.send((id, earliest, at)).is_err() {
                break;
            }
        }
    });

    let seed = now_ms() | 1;
    eprintln!("thousands_confirmed_across_sigkill: seed {seed}");
    let mut rng = Rng(seed);
    let began = Instant::now();
    let mut confirms = Vec::with_capacity(N as usize);
    let mut delayed = HashMap::new(); // id -> earliest
    for id in 0..N {
        let delay = rng
            .next()
            .is_multiple_of(2)
            .then(|| 2000 + rng.next() % 4001);
        let sent = now_ms();
        let earliest = sent + delay.unwrap_or(0);
        if delay.is_some() {
            delayed.insert(id, earliest);
        }
        let confirm = ch
            .basic_publish(
                x.as_str().into(),
                "k".into(),
                BasicPublishOptions::default(),
                &body(id, earliest),
                with_delay(
                    BasicProperties::default().with_delivery_mode(2),
                    delay.map(|d| AMQPValue::LongLongInt(d as i64)),
                ),
            )
            .await
            .unwrap();
        confirms.push(confirm);
    }
    // Every confirm, in the publisher's own sequence: all acks.
    let mut acked = HashSet::new();
    for (id, confirm) in confirms.into_iter().enumerate() {
        let c = tokio::time::timeout(Duration::from_secs(30), confirm)
            .await
            .unwrap_or_else(|_| panic!("no confirm for publish {id} in 30 s"))
            .unwrap_or_else(|e| panic!("confirm of publish {id}: {e}"));
        assert!(c.is_ack(), "publish {id} confirmed with {c:?}");
        acked.insert(id as u32);
    }
    let published = began.elapsed();
    eprintln!(
        "{N} publishes ({} delayed) confirmed in {published:?}",
        delayed.len()
    );

    // Killed in the middle of the delays (2 to 6 s): some delayed messages
    // have fired, most have not.
    let kill_at = Duration::from_millis(3500).max(published);
    tokio::time::sleep(kill_at.saturating_sub(began.elapsed())).await;
    let killed_ms = now_ms();
    nackd.kill9();
    drop(conn);
    let nackd = Process::start(&cfg);

    let mut seen: HashMap<u32, u32> = HashMap::new();
    let mut early = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.len() < N as usize {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(Some((id, earliest, at))) = tokio::time::timeout(left, rx.recv()).await else {
            break;
        };
        if at < earliest {
            early.push((id, earliest - at));
        }
        *seen.entry(id).or_default() += 1;
    }
    // Duplicates have a moment to show up too.
    let settle = Instant::now() + Duration::from_secs(2);
    while let Ok(Some((id, earliest, at))) =
        tokio::time::timeout(settle.saturating_duration_since(Instant::now()), rx.recv()).await
    {
        if at < earliest {
            early.push((id, earliest - at));
        }
        *seen.entry(id).or_default() += 1;
    }
    reader.abort();

    let missing: Vec<u32> = (0..N).filter(|id| !seen.contains_key(id)).collect();
    let twice: Vec<u32> = seen
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| *id)
        .collect();
    // The documented window: a publish not yet confirmed to the publisher,
    // or a delayed message already due at the kill (fired, confirmed by the
    // broker, its delete not yet durable).
    let excused =
        |id: &u32| !acked.contains(id) || delayed.get(id).is_some_and(|due| *due <= killed_ms);
    let unexcused: Vec<u32> = twice.iter().copied().filter(|id| !excused(id)).collect();
    let due_at_kill = delayed.values().filter(|due| **due <= killed_ms).count();
    eprintln!(
        "{N} published, {} delayed ({due_at_kill} due at the kill), {} unconfirmed at the kill; \
         arrived {} distinct, {} missing, {} twice ({} outside the window), {} early",
        delayed.len(),
        N as usize - acked.len(),
        seen.len(),
        missing.len(),
        twice.len(),
        unexcused.len(),
        early.len()
    );
    assert!(
        early.is_empty(),
        "{} arrived early, e.g. (id, ms early): {:?}",
        early.len(),
        &early[..early.len().min(20)]
    );
    assert!(
        missing.is_empty(),
        "{} never arrived, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(20)]
    );
    assert!(
        unexcused.is_empty(),
        "{} arrived twice outside the window, e.g. {:?}",
        unexcused.len(),
        &unexcused[..unexcused.len().min(20)]
    );
    // The kill fell in the middle of the wait, as meant.
    assert!(
        due_at_kill > 0 && due_at_kill < delayed.len(),
        "{due_at_kill} of {} delayed messages were due at the kill",
        delayed.len()
    );

    let (status, _) = nackd.terminate(Duration::from_secs(30));
    assert!(status.success(), "nackd exited with {status}");
    let ch = broker.create_channel().await.unwrap();
    delete_queues(&ch, &[&q]).await;
    let _ = ch
        .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
        .await;
}

/// On a `tx.select` channel a delayed publish cannot be made part of the
/// transaction: nackd closes the connection with 540 NOT_IMPLEMENTED and
/// routes nothing; other connections go on.
#[tokio::test]
async fn tx_channel_refuses_delayed_publish() {
    let store = tempfile::tempdir().unwrap();
    let nackd = start_delayed(store.path(), "").await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (x, q) = (unique("dtx-x"), unique("dtx-q"));
    declare_delayed(&ch, &x, "direct").await.unwrap();
    bind(&ch, &x, &q, "k").await;
    let broker = direct().await;
    let mut arrivals = consume(&broker.create_channel().await.unwrap(), &q, None).await;

    let tx = conn.create_channel().await.unwrap();
    tx.tx_select().await.unwrap();
    // An immediate publish in the transaction goes through on commit.
    publish_to(&tx, &x, "k", b"immediate", None).await;
    tx.tx_commit().await.unwrap();
    let d = arrival(
        &mut arrivals,
        Duration::from_secs(2),
        "the committed publish",
    )
    .await;
    assert_eq!(&d.data[..], b"immediate");

    // A delayed one is refused: nackd cannot make it part of the
    // transaction, and closes the connection with 540 NOT_IMPLEMENTED.
    publish_to(&tx, &x, "k", b"delayed", Some(AMQPValue::LongInt(500))).await;
    let err = tx
        .tx_commit()
        .await
        .expect_err("the delayed publish in a transaction is refused");
    assert!(is_code(&err, 540, "NOT_IMPLEMENTED"), "{err}");
    assert!(
        err.to_string().to_lowercase().contains("transactional"),
        "the reply says why: {err}"
    );
    assert!(!conn.status().connected(), "the connection is closed");
    nothing_more(
        &mut arrivals,
        Duration::from_millis(1500),
        "the refused publish",
    )
    .await;

    // Another connection still works, delayed publishes included.
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let sent = Instant::now();
    publish_to(&ch, &x, "k", b"after", Some(AMQPValue::LongInt(500))).await;
    let d = arrival(
        &mut arrivals,
        Duration::from_secs(4),
        "a delayed publish after",
    )
    .await;
    assert_eq!(&d.data[..], b"after");
    assert!(sent.elapsed() >= Duration::from_millis(500));

    let ch = broker.create_channel().await.unwrap();
    delete_queues(&ch, &[&q]).await;
    let _ = ch
        .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    nackd.stop().await;
}

/// The registry of delayed exchanges is durable: after a clean restart on
/// the same store, publishes with `x-delay` to exchanges declared before it
/// are still delayed, with no redeclare; a plain exchange and one deleted
/// before the restart are not.
#[tokio::test]
async fn several_exchanges_and_restart_remembers() {
    let store = tempfile::tempdir().unwrap();
    let nackd = start_delayed(store.path(), "").await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let kinds = ["direct", "fanout", "topic", "headers"];
    let delayed: Vec<(String, String)> = kinds
        .iter()
        .map(|k| (unique(&format!("dreg-{k}")), unique(&format!("dreg-{k}-q"))))
        .collect();
    for ((x, q), kind) in delayed.iter().zip(kinds) {
        declare_delayed(&ch, x, kind).await.unwrap();
        bind(&ch, x, q, "k").await;
    }
    // A plain exchange, and a delayed one deleted then declared plain.
    let (plain, plain_q) = (unique("dreg-plain"), unique("dreg-plain-q"));
    let (gone, gone_q) = (unique("dreg-gone"), unique("dreg-gone-q"));
    for x in [&plain, &gone] {
        if x == &gone {
            declare_delayed(&ch, x, "direct").await.unwrap();
            ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
                .await
                .unwrap();
        }
        ch.exchange_declare(
            x.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
    bind(&ch, &plain, &plain_q, "k").await;
    bind(&ch, &gone, &gone_q, "k").await;
    drop(conn);
    nackd.stop().await;

    let nackd = start_delayed(store.path(), "").await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let broker = direct().await;
    let mut arrivals = Vec::new();
    for (_, q) in delayed.iter().chain(
        [
            (plain.clone(), plain_q.clone()),
            (gone.clone(), gone_q.clone()),
        ]
        .iter(),
    ) {
        arrivals.push(consume(&broker.create_channel().await.unwrap(), q, None).await);
    }
    let sent = Instant::now();
    for (x, _) in delayed.iter().chain(
        [
            (plain.clone(), plain_q.clone()),
            (gone.clone(), gone_q.clone()),
        ]
        .iter(),
    ) {
        let confirm = publish_to(&ch, x, "k", x.as_bytes(), Some(AMQPValue::LongInt(2000))).await;
        assert!(confirm.is_ack(), "{x}: {confirm:?}");
    }
    let (delayed_arrivals, plain_arrivals) = arrivals.split_at_mut(kinds.len());
    // Not delayed: the plain exchange and the one deleted before.
    for (c, x) in plain_arrivals.iter_mut().zip([&plain, &gone]) {
        let d = arrival(c, Duration::from_secs(1), x).await;
        assert_eq!(d.data, x.as_bytes());
    }
    for (c, (x, _)) in delayed_arrivals.iter_mut().zip(&delayed) {
        let d = arrival(c, Duration::from_secs(7), x).await;
        assert_eq!(d.data, x.as_bytes());
        assert!(
            sent.elapsed() >= Duration::from_millis(2000),
            "{x}: x-delay 2000 arrived after {:?}",
            sent.elapsed()
        );
    }

    let ch = broker.create_channel().await.unwrap();
    for (x, q) in delayed.iter().chain(
        [
            (plain.clone(), plain_q.clone()),
            (gone.clone(), gone_q.clone()),
        ]
        .iter(),
    ) {
        delete_queues(&ch, &[q]).await;
        let _ = ch
            .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
            .await;
    }
    nackd.stop().await;
}

const TOKEN: &str = "delayed-admin-token-0123456789";

/// An operator sees and handles delayed publishes by exchange, apart from
/// the retries of a queue of the same name: the admin API lists them as
/// delayed, fires one now, purges the rest; the per-exchange gauge follows.
#[tokio::test]
async fn delayed_messages_are_listed_fired_and_purged_by_exchange() {
    let store = tempfile::tempdir().unwrap();
    let nackd = start_delayed(
        store.path(),
        &format!("[metrics]\nadmin_token = \"{TOKEN}\"\n"),
    )
    .await;
    let ops = nackd.metrics;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let (x, q) = (unique("dops-x"), unique("dops-q"));
    declare_delayed(&ch, &x, "direct").await.unwrap();
    bind(&ch, &x, &q, "k").await;
    let broker = direct().await;
    let mut arrivals = consume(&broker.create_channel().await.unwrap(), &q, None).await;
    for i in 0..3u8 {
        let c = publish_to(&ch, &x, "k", &[b'a' + i], Some(AMQPValue::LongInt(600_000))).await;
        assert!(c.is_ack());
    }
    let enc = |s: &str| s.replace('/', "%2F");
    let list = |filter: &str, name: &str| {
        let path = format!("/api/held?{filter}={}", enc(name));
        async move { common::ops::json(ops, "GET", &path, Some(TOKEN)).await }
    };
    let held = list("exchange", &x).await;
    assert_eq!(held["total"], 3, "{held}");
    let first = &held["held"][0];
    assert_eq!(first["delayed"], true, "{first}");
    assert_eq!(first["dead_letter"], false, "{first}");
    assert_eq!(first["queue"], x.as_str(), "{first}");
    // The same name as a queue: no retries there.
    let as_queue = list("queue", &x).await;
    assert_eq!(as_queue["total"], 0, "{as_queue}");
    let scrape = common::ops::scrape(ops).await;
    assert_eq!(
        scrape.get(
            "nackd_delayed_held_messages",
            &[("vhost", "/"), ("exchange", x.as_str())]
        ),
        3.0
    );
    // The status page's table names it as a delayed exchange.
    let status = common::ops::json(ops, "GET", "/status.json", None).await;
    let row = status["engine"]["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["queue"] == x.as_str())
        .cloned()
        .unwrap_or_else(|| panic!("no status row for {x}: {status}"));
    assert_eq!(
        (row["held"].clone(), row["delayed"].clone()),
        (3.into(), 3.into()),
        "{row}"
    );
    // Fire one now: it arrives at once.
    let id = first["id"].as_u64().unwrap();
    let fired = common::ops::json(ops, "POST", &format!("/api/fire?id={id}"), Some(TOKEN)).await;
    assert_eq!(fired["fired"], 1);
    arrival(&mut arrivals, Duration::from_secs(5), "the fired message").await;
    // Purge the rest by exchange: nothing else arrives, nothing is held.
    let purged = common::ops::json(
        ops,
        "POST",
        &format!("/api/purge?exchange={}", enc(&x)),
        Some(TOKEN),
    )
    .await;
    assert_eq!(purged["purged"], 2, "{purged}");
    // The fired one leaves the list once the broker confirmed its
    // publish, which can come just after its delivery to the consumer.
    let began = std::time::Instant::now();
    loop {
        let held = list("exchange", &x).await;
        if held["total"] == 0 {
            break;
        }
        let publishing = held["held"].as_array().is_some_and(|all| {
            all.iter().all(|h| h["id"].as_u64() == Some(id) && h["publishing"] == true)
        });
        assert!(publishing, "held after the purge: {held}");
        assert!(began.elapsed() < Duration::from_secs(5), "{held}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    nothing_more(&mut arrivals, Duration::from_secs(1), "a purged message").await;
    let ch = broker.create_channel().await.unwrap();
    delete_queues(&ch, &[&q]).await;
    let _ = ch
        .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    nackd.stop().await;
}

/// An `x-delay` so large that its microseconds do not fit in 64 bits is
/// never early: it waits (as good as forever), it does not wrap around to
/// a delay of a few microseconds.
#[tokio::test]
async fn a_huge_delay_is_never_early() {
    let store = tempfile::tempdir().unwrap();
    let nackd = start_delayed(store.path(), "").await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let (x, q) = (unique("dhuge-x"), unique("dhuge-q"));
    declare_delayed(&ch, &x, "direct").await.unwrap();
    bind(&ch, &x, &q, "k").await;
    let broker = direct().await;
    let mut arrivals = consume(&broker.create_channel().await.unwrap(), &q, None).await;

    // 2^64 µs / 1000, rounded up: times 1000 it wraps to 384 µs.
    let huge = AMQPValue::LongLongInt(18_446_744_073_709_552);
    let confirm = publish_to(&ch, &x, "k", b"huge", Some(huge)).await;
    assert!(confirm.is_ack(), "{confirm:?}");
    let sent = Instant::now();
    let confirm = publish_to(&ch, &x, "k", b"soon", Some(AMQPValue::LongInt(800))).await;
    assert!(confirm.is_ack(), "{confirm:?}");
    let d = arrival(&mut arrivals, Duration::from_secs(5), "the 800 ms one").await;
    assert_eq!(&d.data[..], b"soon", "the huge delay came first");
    assert!(sent.elapsed() >= Duration::from_millis(800));
    nothing_more(&mut arrivals, Duration::from_millis(500), "the huge delay").await;

    let ch = broker.create_channel().await.unwrap();
    delete_queues(&ch, &[&q]).await;
    let _ = ch
        .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    nackd.stop().await;
}

/// A delete the broker refuses (`if-unused` while bound: 406) leaves the
/// exchange delayed: its publishes do not start arriving early.
#[tokio::test]
async fn a_refused_delete_keeps_the_exchange_delayed() {
    let store = tempfile::tempdir().unwrap();
    let nackd = start_delayed(store.path(), "").await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (x, q) = (unique("drefdel-x"), unique("drefdel-q"));
    declare_delayed(&ch, &x, "direct").await.unwrap();
    bind(&ch, &x, &q, "k").await;
    let broker = direct().await;
    let mut arrivals = consume(&broker.create_channel().await.unwrap(), &q, None).await;

    let other = conn.create_channel().await.unwrap();
    let err = other
        .exchange_delete(
            x.as_str().into(),
            ExchangeDeleteOptions {
                if_unused: true,
                ..Default::default()
            },
        )
        .await
        .expect_err("the exchange is in use");
    assert!(is_code(&err, 406, "PRECONDITION_FAILED"), "{err}");

    let sent = Instant::now();
    publish_to(&ch, &x, "k", b"later", Some(AMQPValue::LongInt(1000))).await;
    let d = arrival(&mut arrivals, Duration::from_secs(5), "the delayed one").await;
    assert_eq!(&d.data[..], b"later");
    let took = sent.elapsed();
    assert!(
        took >= Duration::from_millis(1000),
        "arrived after {took:?}"
    );

    let ch = broker.create_channel().await.unwrap();
    delete_queues(&ch, &[&q]).await;
    let _ = ch
        .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    nackd.stop().await;
}

/// A publisher that only publishes delayed messages sends the broker
/// nothing itself (nackd takes every publish, and a busy client library
/// sends no heartbeats): nackd sends them in its name, or the broker would
/// close the connection after two heartbeats.
#[tokio::test]
async fn a_publisher_of_delayed_messages_only_is_not_closed_by_the_broker() {
    let store = tempfile::tempdir().unwrap();
    let nackd = start_delayed(store.path(), "").await;
    let conn = lapin::Connection::connect(
        &nackd.uri("heartbeat=1"),
        lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let x = unique("dhb-x");
    declare_delayed(&ch, &x, "direct").await.unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    let mut n = 0u32;
    while Instant::now() < until {
        let c = publish_to(&ch, &x, "k", b"hb", Some(AMQPValue::LongInt(600_000))).await;
        assert!(c.is_ack(), "publish {n}: {c:?}");
        n += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(conn.status().connected(), "the broker closed the publisher");
    let broker = direct().await;
    let bch = broker.create_channel().await.unwrap();
    let _ = bch
        .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    nackd.stop().await;
}

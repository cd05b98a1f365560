//! The trust boundary (issue 33): nackd holds and publishes later, with
//! its own credentials, what a client publishes with `x-delay`, so it must
//! grant nothing the broker would refuse that client. Each test tries the
//! same thing straight at the broker and through nackd, as a user with
//! fewer permissions than nackd's, and compares: the same refusal (code
//! and text), nothing delivered, and the delayed exchanges unchanged by
//! what the broker refused. Real nackd, real RabbitMQ, real lapin clients.

use crate::common;

use std::time::{Duration, Instant};

use common::ops::scrape;
use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};

const PASSWORD: &str = "trust-pw";

/// A user of the broker under test, deleted when dropped.
struct User(String);

impl User {
    /// A new user with `configure`, `write`, `read` permissions on "/".
    fn new(prefix: &str, configure: &str, write: &str, read: &str) -> Self {
        let name = unique(prefix);
        BROKER.ctl_ok(&["add_user", &name, PASSWORD]);
        BROKER.ctl_ok(&["set_permissions", "-p", "/", &name, configure, write, read]);
        User(name)
    }

    /// A connection as this user, straight to the broker or through `nackd`.
    async fn connect(&self, through: Option<&Nackd>) -> Connection {
        let addr = match through {
            Some(n) => n.addr.to_string(),
            None => BROKER.addr().to_string(),
        };
        connect(&format!("amqp://{}:{PASSWORD}@{addr}/%2f", self.0)).await
    }
}

impl Drop for User {
    fn drop(&mut self) {
        BROKER.ctl(&["delete_user", &self.0]);
    }
}

/// Declares `x` (through a connection of a user who may) as
/// `x-delayed-message` of `kind`, bound to a new queue with `key`; returns
/// the queue.
async fn delayed_exchange(ch: &Channel, x: &str, kind: &str, key: &str) -> String {
    let mut args = FieldTable::default();
    args.insert("x-delayed-type".into(), AMQPValue::LongString(kind.into()));
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        x.into(),
        ExchangeKind::Custom("x-delayed-message".into()),
        durable,
        args,
    )
    .await
    .unwrap();
    let q = unique("trust-q");
    declare_durable(ch, &q).await;
    ch.queue_bind(
        q.as_str().into(),
        x.into(),
        key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    q
}

fn delayed(ms: i64) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert("x-delay".into(), AMQPValue::LongLongInt(ms));
    BasicProperties::default().with_headers(h)
}

/// Publishes on a new confirm channel of `conn`; the broker's (or nackd's)
/// answer: the confirm, or the error that closed the channel.
async fn try_publish(conn: &Connection, x: &str, key: &str, props: BasicProperties) -> String {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let sent = ch
        .basic_publish(
            x.into(),
            key.into(),
            BasicPublishOptions::default(),
            b"secret",
            props,
        )
        .await;
    let answer = match sent {
        Ok(confirm) => match confirm.await {
            Ok(c) if c.is_ack() => "ack".to_string(),
            Ok(c) => format!("{c:?}"),
            Err(e) => e.to_string(),
        },
        Err(e) => e.to_string(),
    };
    // A channel the broker closed says why on the next call too.
    match ch.basic_qos(1, BasicQosOptions::default()).await {
        Ok(()) => answer,
        Err(e) if answer == "ack" => e.to_string(),
        Err(_) => answer,
    }
}

/// Nothing arrives in `q` for `quiet` (read straight from the broker).
async fn nothing_in(q: &str, quiet: Duration) {
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, q, None).await;
    if let Some(d) = next(&mut c, quiet).await {
        panic!("{:?} was delivered", String::from_utf8_lossy(&d.data));
    }
    let _ = conn.close(200, "".into()).await;
}

async fn cleanup(x: &str, queues: &[&str]) {
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    delete_queues(&ch, queues).await;
    let _ = ch
        .exchange_delete(x.into(), ExchangeDeleteOptions::default())
        .await;
    let _ = conn.close(200, "".into()).await;
}

/// Issue 33, item 1: a user that may only read publishes with `x-delay` to
/// a delayed exchange. Straight at the broker: 403. Through nackd it was
/// acked and delivered later with nackd's credentials; now the broker is
/// asked first, in the user's name, and its refusal is what the user gets.
#[tokio::test]
async fn a_user_without_write_permission_gets_the_brokers_refusal() {
    let store = tempfile::tempdir().unwrap();
    let nackd = start_delayed(store.path(), "").await;
    let admin = nackd.connect().await;
    let x = unique("trust-ro-x");
    let q = delayed_exchange(&admin.create_channel().await.unwrap(), &x, "direct", "k").await;
    let reader = User::new("trust-ro", "", "", ".*");

    let refused = try_publish(&reader.connect(None).await, &x, "k", delayed(300)).await;
    assert!(refused.contains("403") || refused.contains("ACCESS_REFUSED"), "{refused}");
    let through = try_publish(&reader.connect(Some(&nackd)).await, &x, "k", delayed(300)).await;
    assert_eq!(through, refused, "the refusal through nackd is the broker's");

    nothing_in(&q, Duration::from_secs(2)).await;
    let s = scrape(nackd.metrics).await;
    assert_eq!(s.get("nackd_delayed_publishes_denied_total", &[]), 1.0);
    assert_eq!(s.get("nackd_delayed_publishes_stored_total", &[]), 0.0);
    // A user who may write still has its publish delayed.
    let writer = User::new("trust-rw", "", ".*", ".*");
    let sent = Instant::now();
    let answer = try_publish(&writer.connect(Some(&nackd)).await, &x, "k", delayed(300)).await;
    assert_eq!(answer, "ack");
    let conn = direct().await;
    let mut c = consume(&conn.create_channel().await.unwrap(), &q, None).await;
    let d = next(&mut c, Duration::from_secs(10)).await.expect("delivered");
    assert!(sent.elapsed() >= Duration::from_millis(300));
    assert_eq!(&d.data[..], b"secret");
    cleanup(&x, &[&q]).await;
    nackd.stop().await;
}

/// Issue 33, item 1: topic permissions on the routing key are the
/// broker's too: a key the user may not write to is refused as the broker
/// refuses it, one it may write to is delayed.
#[tokio::test]
async fn topic_permissions_on_the_routing_key_are_the_brokers() {
    let store = tempfile::tempdir().unwrap();
    let nackd = start_delayed(store.path(), "").await;
    let admin = nackd.connect().await;
    let x = unique("trust-topic-x");
    let q = delayed_exchange(&admin.create_channel().await.unwrap(), &x, "topic", "#").await;
    let user = User::new("trust-topic", "", ".*", ".*");
    BROKER.ctl_ok(&[
        "set_topic_permissions",
        "-p",
        "/",
        &user.0,
        &x,
        "^allowed\\.",
        ".*",
    ]);

    let refused = try_publish(&user.connect(None).await, &x, "denied.k", delayed(300)).await;
    assert!(refused.contains("403") || refused.contains("ACCESS_REFUSED"), "{refused}");
    let through = try_publish(&user.connect(Some(&nackd)).await, &x, "denied.k", delayed(300)).await;
    assert_eq!(through, refused, "the refusal through nackd is the broker's");
    nothing_in(&q, Duration::from_secs(2)).await;

    let answer = try_publish(&user.connect(Some(&nackd)).await, &x, "allowed.k", delayed(300)).await;
    assert_eq!(answer, "ack");
    let conn = direct().await;
    let mut c = consume(&conn.create_channel().await.unwrap(), &q, None).await;
    let d = next(&mut c, Duration::from_secs(10)).await.expect("delivered");
    assert_eq!(d.routing_key.as_str(), "allowed.k");
    cleanup(&x, &[&q]).await;
    nackd.stop().await;
}

/// Issue 33, item 1: a user without configure permission declares an
/// existing plain exchange as `x-delayed-message` (`nowait`): the broker
/// refuses, and the exchange does not become delayed: another client's
/// `x-delay` publish to it is routed at once, as the broker routes it.
#[tokio::test]
async fn a_user_without_configure_permission_cannot_make_an_exchange_delayed() {
    let store = tempfile::tempdir().unwrap();
    let nackd = start_delayed(store.path(), "").await;
    let x = unique("trust-plain-x");
    let admin = direct().await;
    let ach = admin.create_channel().await.unwrap();
    ach.exchange_declare(
        x.as_str().into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let q = unique("trust-plain-q");
    declare_durable(&ach, &q).await;
    ach.queue_bind(
        q.as_str().into(),
        x.as_str().into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();

    let user = User::new("trust-noconf", "", ".*", ".*");
    let conn = user.connect(Some(&nackd)).await;
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-delayed-type".into(), AMQPValue::LongString("direct".into()));
    let nowait = ExchangeDeclareOptions {
        nowait: true,
        ..Default::default()
    };
    ch.exchange_declare(
        x.as_str().into(),
        ExchangeKind::Custom("x-delayed-message".into()),
        nowait,
        args,
    )
    .await
    .unwrap();
    let refused = ch.basic_qos(1, BasicQosOptions::default()).await;
    let refused = refused.expect_err("the broker closed the channel").to_string();
    assert!(refused.contains("403") || refused.contains("ACCESS_REFUSED"), "{refused}");

    // Not delayed: a 10-minute delay is the broker's to ignore, at once.
    let guest = nackd.connect().await;
    let answer = try_publish(&guest, &x, "k", delayed(600_000)).await;
    assert_eq!(answer, "ack");
    let mut c = consume(&admin.create_channel().await.unwrap(), &q, None).await;
    next(&mut c, Duration::from_secs(5))
        .await
        .expect("routed at once: the exchange is not delayed");
    let s = scrape(nackd.metrics).await;
    assert_eq!(s.get("nackd_delayed_publishes_stored_total", &[]), 0.0);
    cleanup(&x, &[&q]).await;
    nackd.stop().await;
}

/// Issue 33, item 2: `nowait` declares and deletes behave as their
/// waiting forms. A publish sent right after a `nowait` declare is delayed;
/// a `nowait` delete the broker refuses (`if-unused` while bound) leaves
/// the exchange delayed, so a 10-minute delay is not cut short; a `nowait`
/// delete it does makes a later publish the broker's 404.
#[tokio::test]
async fn nowait_declares_and_deletes_are_their_waiting_forms() {
    let store = tempfile::tempdir().unwrap();
    let nackd = start_delayed(store.path(), "").await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let x = unique("trust-nowait-x");
    let q = unique("trust-nowait-q");
    declare_durable(&ch, &q).await;
    let mut args = FieldTable::default();
    args.insert("x-delayed-type".into(), AMQPValue::LongString("direct".into()));
    let nowait = ExchangeDeclareOptions {
        nowait: true,
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        x.as_str().into(),
        ExchangeKind::Custom("x-delayed-message".into()),
        nowait,
        args,
    )
    .await
    .unwrap();
    ch.queue_bind(
        q.as_str().into(),
        x.as_str().into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let sent = Instant::now();
    let c = ch
        .basic_publish(x.as_str().into(), "k".into(), BasicPublishOptions::default(), b"soon", delayed(700))
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(c.is_ack());
    let broker = direct().await;
    let mut arrivals = consume(&broker.create_channel().await.unwrap(), &q, None).await;
    next(&mut arrivals, Duration::from_secs(10)).await.expect("delivered");
    assert!(sent.elapsed() >= Duration::from_millis(700), "delayed, not at once");

    // A nowait delete the broker refuses: still delayed.
    let other = conn.create_channel().await.unwrap();
    let refuse = ExchangeDeleteOptions {
        if_unused: true,
        nowait: true,
    };
    other
        .exchange_delete(x.as_str().into(), refuse)
        .await
        .unwrap();
    let refused = other.basic_qos(1, BasicQosOptions::default()).await;
    let refused = refused.expect_err("in use: 406").to_string();
    assert!(refused.contains("406") || refused.contains("PRECONDITION_FAILED"), "{refused}");
    let answer = try_publish(&conn, &x, "k", delayed(600_000)).await;
    assert_eq!(answer, "ack");
    if let Some(d) = next(&mut arrivals, Duration::from_secs(3)).await {
        panic!("a 10-minute delay arrived at once: {:?}", d.data);
    }

    // One it does: the exchange is gone, as the broker says.
    let last = conn.create_channel().await.unwrap();
    let delete = ExchangeDeleteOptions {
        if_unused: false,
        nowait: true,
    };
    last.exchange_delete(x.as_str().into(), delete).await.unwrap();
    let through = try_publish(&conn, &x, "k", delayed(1000)).await;
    assert!(through.contains("404") || through.contains("NOT_FOUND"), "{through}");
    let s = scrape(nackd.metrics).await;
    assert_eq!(s.get("nackd_delayed_publishes_stored_total", &[]), 2.0);
    cleanup(&x, &[&q]).await;
    nackd.stop().await;
}

/// Issue 33, finding 4, from the review: a dead-lettered message whose
/// `user_id` names another user. The republish user (no `impersonator`
/// tag) may not publish its copy: the broker refuses it by closing the
/// channel. A dry run puts the other messages back at the tail, keeps
/// that one unacked (the broker takes it back when the pass ends), goes
/// on, and says so: nothing lost, nothing twice.
#[tokio::test]
async fn a_dry_run_keeps_a_message_with_another_users_user_id_and_puts_the_rest_back() {
    const TOKEN: &str = "trust-user-id-token-0123456789";
    let nackd = start(&format!(
        "[metrics]\nadmin_token = \"{TOKEN}\"\n[[policy]]\nqueues = [\"{}\"]\ndelays = [\"1s\"]\n",
        unique("trust-uid-policy")
    ))
    .await;
    let alice = User::new("trust-uid", "", ".*", ".*");
    let dlq = unique("trust-uid-dlq");
    let broker = direct().await;
    let ch = broker.create_channel().await.unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(dlq.as_str().into(), durable, FieldTable::default())
        .await
        .unwrap();
    let publish = |ch: Channel, body: &'static [u8], props: BasicProperties| {
        let dlq = dlq.clone();
        async move {
            ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
            let c = ch
                .basic_publish("".into(), dlq.as_str().into(), BasicPublishOptions::default(), body, props)
                .await
                .unwrap()
                .await
                .unwrap();
            assert!(c.is_ack());
        }
    };
    publish(broker.create_channel().await.unwrap(), b"m0", BasicProperties::default()).await;
    let as_alice = alice.connect(None).await;
    let with_user_id = BasicProperties::default().with_user_id(alice.0.as_str().into());
    publish(as_alice.create_channel().await.unwrap(), b"m1", with_user_id).await;
    for body in [b"m2", b"m3"] {
        publish(broker.create_channel().await.unwrap(), body, BasicProperties::default()).await;
    }

    let q = common::ops::query(&dlq);
    let path = format!("/api/replay?dlq={}&dry_run=true", q.trim_start_matches("?queue="));
    let v = common::ops::json(nackd.metrics, "POST", &path, Some(TOKEN)).await;
    assert_eq!(v["examined"], 4, "{v}");
    assert_eq!(v["foreign_user_id"], 1, "{v}");
    assert!(v["error"].is_null(), "the pass goes on: {v}");

    let mut c = consume(&broker.create_channel().await.unwrap(), &dlq, None).await;
    let mut bodies = Vec::new();
    while let Some(d) = next(&mut c, Duration::from_secs(3)).await {
        d.ack(BasicAckOptions::default()).await.unwrap();
        if d.data == b"m1" {
            let user = d.properties.user_id().as_ref().map(|u| u.to_string());
            assert_eq!(user.as_deref(), Some(alice.0.as_str()), "kept as it was");
        }
        bodies.push(String::from_utf8(d.data).unwrap());
    }
    bodies.sort();
    assert_eq!(bodies, ["m0", "m1", "m2", "m3"], "each message once");
    ch.queue_delete(dlq.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let _ = broker.close(200, "".into()).await;
    nackd.stop().await;
}

//! `[delayed] registry` (issue 36): nackd instances in front of one broker
//! agree on which exchanges are delayed, through the stream the broker
//! keeps for them. Several real nackds, the real broker, lapin clients;
//! what arrives is read straight from the broker.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::ops::scrape;
use common::*;
use lapin::options::*;
use lapin::types::AMQPValue;

use super::delayed::{
    arrival, bind, declare_delayed, is_code, nothing_more, publish_to, with_delay,
};

/// `[delayed] registry = true` (follows common::DELAYED's `[delayed]`).
const SHARED: &str = "registry = true\n";

/// The delay of the publishes below.
const DELAY: Duration = Duration::from_millis(2000);

/// A nackd sharing its delayed exchanges, once it has read the registry
/// (and `/readyz` no longer warns that it has not).
async fn shared(store: &Path) -> Nackd {
    let nackd = start_delayed(store, SHARED).await;
    common::ops::until(nackd.metrics, "the registry read", |s| {
        s.get("nackd_delayed_registry_synced", &[]) == 1.0
    })
    .await;
    assert_eq!(registry_warnings(&nackd).await, 0);
    nackd
}

/// How many of `/readyz`'s warnings are about the registry.
async fn registry_warnings(nackd: &Nackd) -> usize {
    let r = common::ops::get(nackd.metrics, "/readyz").await;
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(r.status, 200, "ready all the same: {body}");
    body["warnings"]
        .as_array()
        .unwrap_or_else(|| panic!("{body}"))
        .iter()
        .filter(|w| w.as_str().is_some_and(|w| w.starts_with("delayed registry: ")))
        .count()
}

/// Waits until `nackd` says whether `x` (of vhost `/`) is delayed as
/// `delayed`; panics after 15 s.
async fn known(nackd: &Nackd, x: &str, delayed: bool) {
    let set = nackd.delayed.clone().expect("it intercepts");
    let what = format!("{x} to be {}delayed", if delayed { "" } else { "not " });
    eventually(Duration::from_secs(15), &what, || {
        set.is_delayed("/", x) == delayed
    })
    .await;
}

/// An x-delay publish through `nackd` to `x`, confirmed, arrives on
/// `arrivals` after its delay and not before.
async fn delayed_through(nackd: &Nackd, x: &str, arrivals: &mut lapin::Consumer, what: &str) {
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let sent = Instant::now();
    let delay = AMQPValue::LongInt(DELAY.as_millis() as i32);
    let confirm = publish_to(&ch, x, "k", what.as_bytes(), Some(delay)).await;
    assert!(confirm.is_ack(), "{what}: {confirm:?}");
    let d = arrival(arrivals, DELAY + Duration::from_secs(8), what).await;
    assert_eq!(&d.data[..], what.as_bytes());
    let took = sent.elapsed();
    assert!(took >= DELAY, "{what}: arrived after {took:?}, before its delay");
    let _ = conn.close(200, "".into()).await;
}

/// A declare through A is known to B (which never saw it) and to C
/// (started after it); a delete through A is known to both.
#[tokio::test]
async fn instances_agree_on_declares_and_deletes() {
    let (sa, sb, sc) = (tempdir(), tempdir(), tempdir());
    let (a, b) = (shared(sa.path()).await, shared(sb.path()).await);
    let (x, q) = (unique("regx"), unique("regq"));
    let conn = a.connect().await;
    let ch = conn.create_channel().await.unwrap();
    declare_delayed(&ch, &x, "direct").await.unwrap();
    let declared = Instant::now();
    known(&b, &x, true).await;
    let took = declared.elapsed();
    bind(&ch, &x, &q, "k").await;
    eprintln!("B knew the declare {took:?} after A's declare-ok");
    assert!(took < Duration::from_secs(5), "B knew it after {took:?}");
    let broker = direct().await;
    let mut arrivals = consume(&broker.create_channel().await.unwrap(), &q, None).await;
    delayed_through(&b, &x, &mut arrivals, "through B").await;

    let c = shared(sc.path()).await;
    assert!(
        c.delayed.as_ref().unwrap().is_delayed("/", &x),
        "C, started after the declare, knows it once synced"
    );
    delayed_through(&c, &x, &mut arrivals, "through C").await;

    ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    let deleted = Instant::now();
    known(&b, &x, false).await;
    let took = deleted.elapsed();
    known(&c, &x, false).await;
    eprintln!("B knew the delete {took:?} after A's delete-ok");
    // B now leaves publishes to the broker, which refuses them: the
    // exchange is gone (404), as without nackd.
    let conn_b = b.connect().await;
    let ch_b = conn_b.create_channel().await.unwrap();
    ch_b.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let delay = AMQPValue::LongInt(1000);
    let refused = ch_b
        .basic_publish(
            x.as_str().into(),
            "k".into(),
            BasicPublishOptions::default(),
            b"after the delete",
            with_delay(lapin::BasicProperties::default(), Some(delay)),
        )
        .await;
    let outcome = match refused {
        Ok(confirm) => confirm.await.map(|_| ()),
        Err(e) => Err(e),
    };
    let err = match outcome {
        Err(e) => e,
        // The close may come after the publish's own answer.
        Ok(()) => ch_b
            .basic_qos(1, BasicQosOptions::default())
            .await
            .expect_err("the broker closed the channel"),
    };
    assert!(is_code(&err, 404, "NOT_FOUND"), "{err}");
    nothing_more(&mut arrivals, Duration::from_millis(500), "after the delete").await;

    let ch = broker.create_channel().await.unwrap();
    delete_queues(&ch, &[&q]).await;
    for n in [a, b, c] {
        n.stop().await;
    }
}

/// An instance that cannot read the registry (here: its vhost does not
/// exist) refuses x-delay publishes to exchanges it does not know as
/// delayed, with a nack on a confirm channel and a 506 close without
/// confirms; it never routes them at once. Publishes without x-delay, and
/// to an exchange it knows, go on as ever.
#[tokio::test]
async fn an_instance_that_cannot_read_the_registry_routes_no_delay_at_once() {
    let store = tempdir();
    let vhost = unique("no-such-vhost");
    let unreadable = format!("{SHARED}registry_vhost = \"{vhost}\"\n");
    let nackd = start_delayed(store.path(), &unreadable).await;
    let (x, q) = (unique("regux"), unique("reguq"));
    // Declared by someone else (as another instance would), bound by us.
    let broker = direct().await;
    let setup = broker.create_channel().await.unwrap();
    setup
        .exchange_declare(
            x.as_str().into(),
            lapin::ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    bind(&setup, &x, &q, "k").await;
    let mut arrivals = consume(&broker.create_channel().await.unwrap(), &q, None).await;
    let s = scrape(nackd.metrics).await;
    assert_eq!(s.get("nackd_delayed_registry_synced", &[]), 0.0);
    // Ready all the same, with a warning that says why x-delay publishes
    // may be refused.
    assert_eq!(registry_warnings(&nackd).await, 1);

    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirm = publish_to(&ch, &x, "k", b"later", Some(AMQPValue::LongInt(60_000))).await;
    assert!(confirm.is_nack(), "refused with a nack: {confirm:?}");
    let confirm = publish_to(&ch, &x, "k", b"now", None).await;
    assert!(confirm.is_ack(), "no x-delay: as ever: {confirm:?}");
    let d = arrival(&mut arrivals, Duration::from_secs(5), "the publish without x-delay").await;
    assert_eq!(&d.data[..], b"now", "the refused one never went");

    // Without confirms there is no nack to give: the connection closes.
    let conn2 = nackd.connect().await;
    let plain = conn2.create_channel().await.unwrap();
    let _ = plain
        .basic_publish(
            x.as_str().into(),
            "k".into(),
            BasicPublishOptions::default(),
            b"later, unconfirmed",
            with_delay(
                lapin::BasicProperties::default(),
                Some(AMQPValue::LongInt(60_000)),
            ),
        )
        .await;
    let closed = Instant::now();
    while conn2.status().connected() {
        assert!(closed.elapsed() < Duration::from_secs(10), "still open");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    nothing_more(&mut arrivals, Duration::from_millis(500), "refused publishes").await;
    let s = scrape(nackd.metrics).await;
    assert_eq!(s.get("nackd_delayed_publishes_refused_total", &[]), 2.0);

    delete_queues(&setup, &[&q]).await;
    let _ = setup
        .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    nackd.stop().await;
}

/// A declare through an instance that cannot reach the registry is kept
/// with its store, and written once it can, even after a restart: an
/// instance that reads the registry then learns it.
#[tokio::test]
async fn a_declare_made_while_the_registry_is_unreachable_is_shared_after_a_restart() {
    let vhost = unique("registry-vhost");
    let config = format!("{SHARED}registry_vhost = \"{vhost}\"\n");
    let (sa, sb) = (tempdir(), tempdir());
    let a = start_delayed(sa.path(), &config).await;
    let (x, q) = (unique("regrx"), unique("regrq"));
    let conn = a.connect().await;
    let ch = conn.create_channel().await.unwrap();
    declare_delayed(&ch, &x, "direct").await.unwrap();
    bind(&ch, &x, &q, "k").await;
    assert!(a.delayed.as_ref().unwrap().is_delayed("/", &x));
    let _ = conn.close(200, "".into()).await;
    a.stop().await;
    // The file is written by a thread of its own, soon after the change.
    saved(sa.path(), "kept as unshared", |f| f.contains("\"unshared\"")).await;

    // The registry's vhost comes to be: B reads it (X is not there yet),
    // then A, restarted on its store, writes X.
    let v = vhost.clone();
    tokio::task::spawn_blocking(move || {
        BROKER.ctl_ok(&["add_vhost", &v]);
        BROKER.ctl_ok(&["set_permissions", "-p", &v, "guest", ".*", ".*", ".*"]);
    })
    .await
    .unwrap();
    let b = shared(sb.path()).await;
    assert!(!b.delayed.as_ref().unwrap().is_delayed("/", &x));
    let a = shared(sa.path()).await;
    known(&b, &x, true).await;
    saved(sa.path(), "written", |f| !f.contains("\"unshared\"")).await;
    let broker = direct().await;
    let mut arrivals = consume(&broker.create_channel().await.unwrap(), &q, None).await;
    delayed_through(&b, &x, &mut arrivals, "through B").await;

    let ch = broker.create_channel().await.unwrap();
    delete_queues(&ch, &[&q]).await;
    let _ = ch
        .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    for n in [a, b] {
        n.stop().await;
    }
    tokio::task::spawn_blocking(move || BROKER.ctl_ok(&["delete_vhost", &vhost]))
        .await
        .unwrap();
}

/// Waits until the store's delayed-exchanges.json in `store` passes `ok`;
/// panics with `what` and the file after 10 s.
async fn saved(store: &Path, what: &str, ok: impl Fn(&str) -> bool) {
    let path = store.join("delayed-exchanges.json");
    let began = Instant::now();
    loop {
        let file = std::fs::read_to_string(&path).unwrap_or_default();
        if ok(&file) {
            return;
        }
        assert!(began.elapsed() < Duration::from_secs(10), "{what}: {file}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

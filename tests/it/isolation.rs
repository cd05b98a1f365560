//! One bad message stalls nothing: a publish the broker refuses (a missing
//! or internal `on_exhausted` exchange, a header too large for `frame_max`,
//! a `user_id` that is not the republisher's) is set aside on its own, and
//! every other retry keeps its schedule on the same connection. A returned
//! message is matched to exactly the publish it was.

use crate::common;
use crate::common::republish as support;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::ops::{json, scrape, until};
use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ExchangeKind};
use support::*;

fn nack() -> BasicNackOptions {
    BasicNackOptions {
        requeue: false,
        multiple: false,
    }
}

/// Publishes `n` messages to `q`, nacks each once, and measures when each
/// comes back (every retry is acked): the lateness of each, after checking
/// that none is early and none comes twice.
async fn healthy_retries(conn: &Connection, q: &str, n: usize, delay: Duration) -> Vec<Duration> {
    let ch = confirmed_channel(conn).await;
    let consumer_ch = conn.create_channel().await.unwrap();
    let mut c = consume(&consumer_ch, q, Some(500)).await;
    for i in 0..n {
        let body = format!("healthy-{i}");
        publish_to(&ch, "", q, body.as_bytes(), BasicProperties::default()).await;
    }
    let mut nacked: HashMap<String, Instant> = HashMap::new();
    let mut retried = HashSet::new();
    let mut lateness = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while lateness.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(d) = next(&mut c, left).await else {
            panic!(
                "only {} of {n} healthy retries came back in 10 s",
                lateness.len()
            );
        };
        let body = String::from_utf8(d.data.clone()).unwrap();
        if retry_count(&d) == 0 {
            // Stamped before the nack leaves: nackd receives it later, so
            // the wait measured here is never shorter than nackd's. Stamped
            // after, a test thread resumed late made an on-time retry look
            // early (CI, stop 31: 293 ms of 300).
            nacked.insert(body, Instant::now());
            d.nack(nack()).await.unwrap();
            continue;
        }
        let waited = nacked[&body].elapsed();
        assert!(waited >= delay, "{body} early: {waited:?}");
        assert!(retried.insert(body.clone()), "{body} came back twice");
        lateness.push(waited.saturating_sub(delay));
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    if let Some(d) = next(&mut c, Duration::from_millis(800)).await {
        panic!("a retry came twice: {:?}", String::from_utf8_lossy(&d.data));
    }
    consumer_ch.close(200, "done".into()).await.unwrap();
    lateness
}

/// Publishes `body` to `q` with `props` and nacks it through nackd.
async fn nack_one(conn: &Connection, q: &str, body: &str, props: BasicProperties) {
    let ch = confirmed_channel(conn).await;
    publish_to(&ch, "", q, body.as_bytes(), props).await;
    let mut c = consume(&ch, q, Some(1)).await;
    let d = next(&mut c, Duration::from_secs(10))
        .await
        .expect("delivery");
    assert_eq!(d.data, body.as_bytes());
    d.nack(nack()).await.unwrap();
    ch.close(200, "done".into()).await.unwrap();
}

/// `nackd admin list` of a queue, as an operator runs it (the binary,
/// against this in-process nackd's operations listener).
async fn admin_list(nackd: &Nackd, q: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("cli.toml");
    std::fs::write(
        &cfg,
        format!(
            "[metrics]\naddress = \"{}\"\nadmin_token = \"{TOKEN}\"\n",
            nackd.metrics
        ),
    )
    .unwrap();
    let out = tokio::process::Command::new(common::process::NACKD)
        .arg("--config")
        .arg(&cfg)
        .args(["admin", "list", "--queue", q])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn report(what: &str, lateness: &mut [Duration]) {
    eprintln!(
        "{what}: {} healthy retries, lateness p50 {:?}, p99 {:?}, max {:?}",
        lateness.len(),
        percentile(lateness, 0.5),
        percentile(lateness, 0.99),
        percentile(lateness, 1.0)
    );
}

/// Issue item 1 (404): a typo in `on_exhausted` used to stop every retry
/// of the vhost and make the republisher reconnect every 100 ms.
#[tokio::test]
async fn a_missing_on_exhausted_exchange_delays_no_other_queue() {
    let (qa, qb, x, dq) = (
        unique("typo-src"),
        unique("healthy"),
        unique("no-such-exchange"),
        unique("typo-dst"),
    );
    let nackd = start(&format!(
        "[metrics]\nadmin_token = \"{TOKEN}\"\n{}{}",
        policy(
            &qa,
            "\"50ms\"",
            &format!("on_exhausted = {{ exchange = \"{x}\" }}")
        ),
        policy(&qb, "\"300ms\"", "")
    ))
    .await;
    let conn = nackd.connect().await;
    let ch = confirmed_channel(&conn).await;
    declare_durable(&ch, &qa).await;
    declare_durable(&ch, &qb).await;
    let mut normal = healthy_retries(&conn, &qb, 30, Duration::from_millis(300)).await;
    report("normal", &mut normal);
    // Three messages whose schedule is used up: they go to the missing exchange.
    for i in 0..3 {
        nack_one(&conn, &qa, &format!("doomed-{i}"), retried(1)).await;
    }
    until(nackd.metrics, "3 set aside: no exchange", |s| {
        s.get("nackd_blocked_messages", &[("reason", "no_exchange")]) == 3.0
    })
    .await;

    let mut lateness = healthy_retries(&conn, &qb, 30, Duration::from_millis(300)).await;
    report("with a missing on_exhausted exchange", &mut lateness);
    let (max, normal_max) = (percentile(&mut lateness, 1.0), percentile(&mut normal, 1.0));
    // What this catches: healthy retries held behind the missing
    // exchange, whose messages are tried again only after a 1 s backoff.
    // The 30 fall due together, so one stall of a loaded machine makes the
    // whole batch late at once (CI stop 32 on 4.3: 278 ms against 17 ms,
    // the test alone 2-6 ms); the limit stays below the backoff.
    assert!(
        max <= normal_max + Duration::from_millis(750),
        "healthy retries late: {max:?} against {normal_max:?} without the bad exchange"
    );

    let s = scrape(nackd.metrics).await;
    let vhost = [("vhost", "/")];
    assert_eq!(
        s.get("nackd_republisher_connects_total", &vhost),
        1.0,
        "never reconnected"
    );
    assert_eq!(s.get("nackd_republisher_connected", &vhost), 1.0);
    assert!(s.get("nackd_retries_blocked_total", &[("reason", "no_exchange")]) >= 3.0);
    assert!(s.get("nackd_republisher_channel_errors_total", &vhost) >= 1.0);
    assert_eq!(s.get("nackd_retries_confirmed_total", &[]), 60.0);

    // Operators see why: admin list, status page.
    let listed = admin_list(&nackd, &qa).await;
    assert_eq!(
        listed
            .matches("blocked: 404 NOT_FOUND - no exchange")
            .count(),
        3,
        "{listed}"
    );
    let status = json(nackd.metrics, "GET", "/status.json", None).await;
    let engine = &status["engine"];
    assert_eq!(engine["blocked"][0]["reason"], "no_exchange", "{engine}");
    assert_eq!(engine["blocked"][0]["count"], 3);
    assert_eq!(engine["blocked_exchanges"][0]["exchange"], x.as_str());
    let qa_status = engine["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["queue"] == qa.as_str())
        .unwrap()
        .clone();
    assert_eq!(qa_status["blocked"], 3);

    // The exchange appears: the held messages get there, each once.
    bound_queue(&ch, &x, ExchangeKind::Fanout, &dq, "").await;
    let fired = json(
        nackd.metrics,
        "POST",
        &format!("/api/fire{}", common::ops::query(&qa)),
        Some(TOKEN),
    )
    .await;
    assert_eq!(fired["fired"], 3);
    until(nackd.metrics, "the 3 delivered", |s| {
        s.sum("nackd_held_messages") == 0.0
    })
    .await;
    let mut got = drain(&ch, &dq, Duration::from_millis(500)).await;
    got.sort();
    assert_eq!(got, vec!["doomed-0", "doomed-1", "doomed-2"]);
    assert_eq!(
        scrape(nackd.metrics)
            .await
            .get("nackd_blocked_messages", &[("reason", "no_exchange")]),
        0.0
    );
    delete_queues(&ch, &[&qa, &qb, &dq]).await;
    delete_exchanges(&ch, &[&x]).await;
}

/// A header table that leaves `room` bytes of a 128 KiB frame once encoded.
fn huge_headers(room: usize) -> FieldTable {
    let mut headers = FieldTable::default();
    let filler = "x".repeat(131_072 - 8 - 14 - 64 - room);
    headers.insert(
        "filler".into(),
        AMQPValue::LongString(LongString::from(filler)),
    );
    headers
}

/// Issue item 1 (403, a header larger than frame_max, a user_id the broker
/// refuses from the republisher): each is set aside with the broker's (or
/// nackd's) reason while the healthy retries keep their schedule.
#[tokio::test]
async fn refused_publishes_are_set_aside_one_by_one() {
    let (qc, qb, internal) = (
        unique("refused-src"),
        unique("healthy2"),
        unique("internal-x"),
    );
    let user = unique("republisher");
    BROKER.ctl_ok(&["add_user", &user, "secret-pw"]);
    BROKER.ctl_ok(&["set_permissions", "-p", "/", &user, ".*", ".*", ".*"]);
    let nackd = start(&format!(
        "[republish]\nusername = \"{user}\"\npassword = \"secret-pw\"\n[metrics]\nadmin_token = \"{TOKEN}\"\n{}{}",
        policy(&qc, "\"50ms\"", &format!("on_exhausted = {{ exchange = \"{internal}\" }}")),
        policy(&qb, "\"200ms\"", "")
    ))
    .await;
    let conn = nackd.connect().await;
    let ch = confirmed_channel(&conn).await;
    declare_durable(&ch, &qc).await;
    declare_durable(&ch, &qb).await;
    ch.exchange_declare(
        internal.as_str().into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            internal: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    // 403: an internal exchange takes no publishes.
    nack_one(&conn, &qc, "to-internal", retried(1)).await;
    // Its rewritten headers no longer fit in a frame.
    let big = BasicProperties::default().with_headers(huge_headers(300));
    nack_one(&conn, &qc, "huge-header", big).await;
    // Published by guest with user_id guest; the republisher is another
    // user, without the impersonator tag: sent alone, refused, set aside.
    let mine = BasicProperties::default().with_user_id("guest".into());
    nack_one(&conn, &qc, "guest-user-id", mine).await;
    let s = until(nackd.metrics, "three set aside", |s| {
        ["access_refused", "frame_max", "user_id"]
            .iter()
            .all(|r| s.get("nackd_retries_blocked_total", &[("reason", r)]) >= 1.0)
    })
    .await;
    assert_eq!(
        s.get("nackd_held_messages", &[("vhost", "/"), ("queue", &qc)]),
        3.0
    );

    let mut lateness = healthy_retries(&conn, &qb, 20, Duration::from_millis(200)).await;
    report("with refused publishes", &mut lateness);
    let max = percentile(&mut lateness, 1.0);
    assert!(
        max < Duration::from_millis(500),
        "healthy retries late: {max:?}"
    );
    let s = scrape(nackd.metrics).await;
    assert_eq!(
        s.get("nackd_republisher_connects_total", &[("vhost", "/")]),
        1.0
    );

    // Each line of `nackd admin list` says why (the headers, one of them
    // 130 KB long, are left out of the comparison).
    let listed = admin_list(&nackd, &qc).await;
    let reasons: Vec<&str> = listed
        .lines()
        .filter_map(|l| l.split(" blocked: ").nth(1))
        .map(|l| l.split(" headers ").next().unwrap())
        .collect();
    for reply in [
        "403 ACCESS_REFUSED - cannot publish to internal exchange",
        "exceeds the negotiated frame_max",
        "user_id property",
    ] {
        assert!(
            reasons.iter().any(|r| r.contains(reply)),
            "{reply} in {reasons:?}"
        );
    }
    delete_queues(&ch, &[&qc, &qb]).await;
    delete_exchanges(&ch, &[&internal]).await;
    BROKER.ctl_ok(&["delete_user", &user]);
}

/// Headers `route-me: yes|no` plus an `x-retry-count` of 1 (so the first
/// nack exhausts the schedule).
fn exhausted(route: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert("x-retry-count".into(), AMQPValue::LongLongInt(1));
    headers.insert("route-me".into(), AMQPValue::LongString(route.into()));
    BasicProperties::default().with_headers(headers)
}

/// Binds `q` to headers exchange `x` for messages whose `route-me` is `value`.
async fn bind_route_me(ch: &lapin::Channel, q: &str, x: &str, value: &str) {
    declare_durable(ch, q).await;
    let mut args = FieldTable::default();
    args.insert("x-match".into(), AMQPValue::LongString("all".into()));
    args.insert("route-me".into(), AMQPValue::LongString(value.into()));
    ch.queue_bind(
        q.into(),
        x.into(),
        "".into(),
        QueueBindOptions::default(),
        args,
    )
    .await
    .unwrap();
}

/// Issue item 2: a return was matched to the first publish in flight with
/// the same routing key, whatever its exchange or content. Here retries to
/// the queue and exhausted messages to a headers exchange share the key
/// (the queue's name), and of the exhausted ones, same exchange and key,
/// only those with `route-me: yes` are routed: a mismatch either delivers
/// a message twice or loses the returned one.
#[tokio::test]
async fn a_return_is_matched_to_exactly_the_publish_it_was() {
    let (q, x) = (unique("returns"), unique("returns-x"));
    let (yes, no) = (unique("returns-yes"), unique("returns-no"));
    let nackd = start(&format!(
        "[metrics]\nadmin_token = \"{TOKEN}\"\n{}",
        policy(
            &q,
            "\"1ms\"",
            &format!("on_exhausted = {{ exchange = \"{x}\" }}")
        )
    ))
    .await;
    let conn = nackd.connect().await;
    let ch = confirmed_channel(&conn).await;
    declare_durable(&ch, &q).await;
    ch.exchange_declare(
        x.as_str().into(),
        ExchangeKind::Headers,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    bind_route_me(&ch, &yes, &x, "yes").await;
    const N: usize = 150;
    for i in 0..N {
        let retry = format!("retry-{i}");
        publish_to(&ch, "", &q, retry.as_bytes(), BasicProperties::default()).await;
        let route = if i % 2 == 0 { "yes" } else { "no" };
        let body = format!("exhausted-{route}-{i}");
        publish_to(&ch, "", &q, body.as_bytes(), exhausted(route)).await;
    }
    let consumer_ch = conn.create_channel().await.unwrap();
    let mut c = consume(&consumer_ch, &q, Some(1000)).await;
    let mut retried_back = Vec::new();
    let mut nacked = 0;
    while nacked < 2 * N || retried_back.len() < N {
        let d = next(&mut c, Duration::from_secs(10))
            .await
            .unwrap_or_else(|| {
                panic!(
                    "stuck: {nacked} nacked, {} retries back",
                    retried_back.len()
                )
            });
        let body = String::from_utf8(d.data.clone()).unwrap();
        match (body.starts_with("retry"), retry_count(&d)) {
            (true, 1) => {
                retried_back.push(body);
                d.ack(BasicAckOptions::default()).await.unwrap();
            }
            (false, 1) if nacked >= 2 * N => panic!("{body} came back to its queue"),
            _ => {
                d.nack(nack()).await.unwrap();
                nacked += 1;
            }
        }
    }
    let half = (N / 2) as f64;
    until(
        nackd.metrics,
        "the unroutable half returned and kept",
        |s| {
            s.get("nackd_held_messages", &[("vhost", "/"), ("queue", &q)]) == half
                && s.get("nackd_retries_returned_total", &[]) >= half
        },
    )
    .await;
    // Now the rest has somewhere to go: each kept message goes there, once.
    bind_route_me(&ch, &no, &x, "no").await;
    let fire = format!("/api/fire{}", common::ops::query(&q));
    json(nackd.metrics, "POST", &fire, Some(TOKEN)).await;
    until(nackd.metrics, "all delivered", |s| {
        s.sum("nackd_held_messages") == 0.0
    })
    .await;
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    let want = |route: &str, parity: usize| {
        sorted(
            (0..N)
                .filter(|i| i % 2 == parity)
                .map(|i| format!("exhausted-{route}-{i}"))
                .collect(),
        )
    };
    let routed = sorted(drain(&ch, &yes, Duration::from_millis(500)).await);
    assert_eq!(routed, want("yes", 0), "routed at once, each once");
    let kept = sorted(drain(&ch, &no, Duration::from_millis(500)).await);
    assert_eq!(kept, want("no", 1), "returned, kept, then delivered once");
    let all_retries = sorted((0..N).map(|i| format!("retry-{i}")).collect());
    assert_eq!(
        sorted(retried_back),
        all_retries,
        "each retry back in its queue once"
    );
    assert!(next(&mut c, Duration::from_millis(500)).await.is_none());
    delete_queues(&ch, &[&q, &yes, &no]).await;
    delete_exchanges(&ch, &[&x]).await;
}

//! Dead-letter replay (`nackd admin replay`): a dead-letter queue the
//! broker itself filled (real `x-death`, `x-first-death-queue`) moved back
//! to the queues its messages came from, through the real nackd binary,
//! with a SIGKILL in the middle.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::process::{Process, NACKD};
use common::*;
use lapin::options::*;
use lapin::{BasicProperties, Channel};

const TOKEN: &str = "replay-test-token-0123456789";
/// Messages per original queue.
const PER_QUEUE: u32 = 1500;

fn config(dir: &Path, policy_queue: &str) -> PathBuf {
    let path = dir.join("nackd.toml");
    std::fs::write(
        &path,
        format!(
            "[upstream]\naddress = \"{BROKER}\"\n[store]\npath = \"{}\"\n[metrics]\nadmin_token = \"{TOKEN}\"\n\
             [[policy]]\nqueues = [\"{policy_queue}\"]\ndelays = [\"1s\"]\n",
            dir.join("store").display()
        ),
    )
    .unwrap();
    path
}

/// `nackd admin replay ARGS` against `nackd`: success and stdout + stderr.
async fn replay(cfg: &Path, nackd: &Process, args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new(NACKD)
        .arg("--config")
        .arg(cfg)
        .args(["admin", "--address", &nackd.metrics.to_string()])
        .arg("replay")
        .args(args)
        .output()
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Publishes ids `ids` to `q`, confirmed.
async fn publish_ids(ch: &Channel, q: &str, ids: std::ops::Range<u32>) {
    let mut confirms = Vec::new();
    for id in ids {
        let confirm = ch
            .basic_publish(
                "".into(),
                q.into(),
                BasicPublishOptions::default(),
                &id.to_be_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap();
        confirms.push(confirm);
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack());
    }
}

/// Rejects (requeue=false) every message of `q`, directly on the broker,
/// so that the broker dead-letters them itself.
async fn reject_all(ch: &Channel, q: &str, n: u32) {
    let mut consumer = consume(ch, q, Some(500)).await;
    for _ in 0..n {
        let d = next(&mut consumer, Duration::from_secs(10))
            .await
            .expect("a message to reject");
        d.reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    ch.basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await
        .unwrap();
}

/// Every id in `q` now (acked), with how many times it came.
async fn drain(ch: &Channel, q: &str) -> HashMap<u32, u32> {
    let mut seen = HashMap::new();
    let mut consumer = consume(ch, q, Some(500)).await;
    while let Some(d) = next(&mut consumer, Duration::from_secs(2)).await {
        let id = u32::from_be_bytes(d.data[..4].try_into().unwrap());
        *seen.entry(id).or_default() += 1;
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    seen
}

/// `(unacknowledged, ready)` of queue `q` in vhost `/`, from rabbitmqctl.
async fn unacked_and_ready(q: &str) -> (u32, u32) {
    let q = q.to_string();
    tokio::task::spawn_blocking(move || {
        let out = BROKER.ctl_ok(&[
            "list_queues",
            "-q",
            "--no-table-headers",
            "name",
            "messages_unacknowledged",
            "messages_ready",
        ]);
        out.lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.len() == 3 && f[0] == q)
            .map(|f| (f[1].parse().unwrap(), f[2].parse().unwrap()))
            .unwrap_or_else(|| panic!("no queue {q} in {out}"))
    })
    .await
    .unwrap()
}

/// `(dlq, a, b)` ready counts.
async fn counts(ch: &Channel, dlq: &str, a: &str, b: &str) -> (u32, u32, u32) {
    (
        message_count(ch, dlq).await,
        message_count(ch, a).await,
        message_count(ch, b).await,
    )
}

#[tokio::test]
async fn a_dead_letter_queue_goes_back_to_its_queues_across_a_sigkill() {
    require_broker();
    let (dlq, a, b) = (unique("replay-dlq"), unique("orig-a"), unique("orig-b"));
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &unique("replay-policy"));
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_durable(&ch, &dlq).await;
    declare_dead_lettering(&ch, &a, &dlq).await;
    declare_dead_lettering(&ch, &b, &dlq).await;
    publish_ids(&ch, &a, 0..PER_QUEUE).await;
    publish_ids(&ch, &b, PER_QUEUE..2 * PER_QUEUE).await;
    let rejecting = conn.create_channel().await.unwrap();
    reject_all(&rejecting, &a, PER_QUEUE).await;
    reject_all(&rejecting, &b, PER_QUEUE).await;
    let total = 2 * PER_QUEUE;
    wait_for(
        Duration::from_secs(30),
        "every message dead-lettered",
        || counts(&ch, &dlq, &a, &b),
        |c| *c == (total, 0, 0),
    )
    .await;

    let nackd = Process::start(&cfg);

    // Dry run: exact counts per destination, nothing moved.
    let (ok, text) = replay(&cfg, &nackd, &[&dlq, "--dry-run"]).await;
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!("would move {PER_QUEUE} to {a}\n")),
        "{text}"
    );
    assert!(
        text.contains(&format!("would move {PER_QUEUE} to {b}\n")),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "examined {total}, would move {total}, skipped 0, no destination 0"
        )),
        "{text}"
    );
    // Put back at the tail, all of them, so in the same order.
    wait_for(
        Duration::from_secs(10),
        "the dry run's messages back on the DLQ",
        || counts(&ch, &dlq, &a, &b),
        |c| *c == (total, 0, 0),
    )
    .await;

    // A filter and a limit: 100 of a's, none of b's.
    let (ok, text) = replay(&cfg, &nackd, &[&dlq, "--queue", &a, "--limit", "100"]).await;
    assert!(ok, "{text}");
    assert!(text.contains(&format!("moved 100 to {a}\n")), "{text}");
    assert!(!text.contains(&b), "{text}");
    wait_for(
        Duration::from_secs(30),
        "100 of a's back in a",
        || counts(&ch, &dlq, &a, &b),
        |c| *c == (total - 100, 100, 0),
    )
    .await;

    // Everything, spread over 5 s so that parks are held when nackd dies
    // half way through reading the dead-letter queue.
    let replaying = {
        let (cfg, dlq) = (cfg.clone(), dlq.clone());
        let metrics = nackd.metrics.to_string();
        tokio::spawn(async move {
            tokio::process::Command::new(NACKD)
                .arg("--config")
                .arg(&cfg)
                .args([
                    "admin",
                    "--address",
                    &metrics,
                    "replay",
                    &dlq,
                    "--spread",
                    "5s",
                ])
                .output()
                .await
                .unwrap()
        })
    };
    let half = (total - 100) / 2;
    wait_for(
        Duration::from_secs(60),
        "the replay half way",
        || message_count(&ch, &dlq),
        |n| *n <= half,
    )
    .await;
    nackd.kill9();
    let out = replaying.await.unwrap();
    assert!(!out.status.success(), "the killed replay reports a failure");

    // Unacked gets go back to the dead-letter queue when the broker sees
    // the replay's connection gone: none unacknowledged any more.
    let left = wait_for(
        Duration::from_secs(30),
        "the broker requeued what the dead replay held",
        || unacked_and_ready(&dlq),
        |(unacked, _)| *unacked == 0,
    )
    .await
    .1;
    assert!(
        left > 0 && left < total - 100,
        "a part moved, a part left: {left}"
    );

    let nackd = Process::start(&cfg);
    let (ok, text) = replay(&cfg, &nackd, &[&dlq]).await;
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!("examined {left}, moved {left}")),
        "{text}"
    );
    // Held ones from before the kill fire from the store after the restart.
    wait_for(
        Duration::from_secs(60),
        "every message back in its queue",
        || counts(&ch, &dlq, &a, &b),
        |(d, in_a, in_b)| *d == 0 && *in_a >= PER_QUEUE && *in_b >= PER_QUEUE,
    )
    .await;
    common::ops::until(nackd.metrics, "nothing held", |s| {
        s.sum("nackd_held_messages") == 0.0
    })
    .await;
    let in_a = drain(&ch, &a).await;
    let in_b = drain(&ch, &b).await;
    assert_eq!(message_count(&ch, &dlq).await, 0, "nothing left on the DLQ");
    for id in 0..PER_QUEUE {
        assert!(in_a.contains_key(&id), "id {id} lost (not in {a})");
        assert!(!in_b.contains_key(&id), "id {id} in the wrong queue");
    }
    for id in PER_QUEUE..total {
        assert!(in_b.contains_key(&id), "id {id} lost (not in {b})");
        assert!(!in_a.contains_key(&id), "id {id} in the wrong queue");
    }
    let twice: u32 = in_a.values().chain(in_b.values()).map(|n| n - 1).sum();
    eprintln!("replay across SIGKILL: {total} messages, {left} left at the kill, {twice} twice");
    // Only parks not yet acked on the DLQ at the kill can come twice: at
    // most one window of them.
    assert!(twice <= 256, "{twice} duplicates");
    nackd.kill9();
    delete_queues(&ch, &[&dlq, &a, &b]).await;
    let _ = conn.close(200, "".into()).await;
}

/// A dead-letter queue `dlq` holding `n` messages the broker dead-lettered
/// from `orig` (ids 0..n, in order).
async fn dead_letters(ch: &Channel, dlq: &str, orig: &str, n: u32) {
    declare_durable(ch, dlq).await;
    declare_dead_lettering(ch, orig, dlq).await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    publish_ids(ch, orig, 0..n).await;
    reject_all(ch, orig, n).await;
    wait_for(
        Duration::from_secs(10),
        "dead-lettered",
        || async { (message_count(ch, dlq).await, message_count(ch, orig).await) },
        |c| *c == (n, 0),
    )
    .await;
}

/// The ids of `q` in queue order, each requeued after it is read (a peek).
async fn peek(conn: &lapin::Connection, q: &str) -> Vec<u32> {
    let ch = conn.create_channel().await.unwrap();
    let mut ids = Vec::new();
    while let Some(m) = ch
        .basic_get(q.into(), BasicGetOptions::default())
        .await
        .unwrap()
    {
        ids.push(u32::from_be_bytes(m.delivery.data[..4].try_into().unwrap()));
    }
    ch.close(200, "".into()).await.unwrap();
    ids
}

/// The API: bad parameters are refused before anything is read, a dry run
/// puts what it read back at the tail (a whole queue: the order kept; the
/// first 5: those 5 now last), and a store that refuses every park stops
/// the replay with an error and the messages it read put back at the tail:
/// nothing moved, nothing lost.
#[tokio::test]
async fn a_store_that_refuses_stops_the_replay_and_loses_nothing() {
    let (dlq, orig) = (unique("replay-full-dlq"), unique("replay-full-orig"));
    let store = tempfile::tempdir().unwrap();
    let nackd = start(&format!(
        "[store]\npath = \"{}\"\nmax_bytes = 1\n[metrics]\nadmin_token = \"{TOKEN}\"\n\
         [[policy]]\nqueues = [\"{}\"]\ndelays = [\"1s\"]\n",
        store.path().display(),
        unique("replay-full-policy")
    ))
    .await;
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    dead_letters(&ch, &dlq, &orig, 20).await;
    let api = |query: String| {
        let path = format!("/api/replay?{query}");
        async move { common::ops::call(nackd.metrics, "POST", &path, Some(TOKEN)).await }
    };
    let q = common::ops::query(&dlq);
    let dlq_param = q.trim_start_matches("?queue=").to_string();

    let r = api(format!("dlq={dlq_param}&reason=bored")).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let r = api(format!("dlq={dlq_param}&to={dlq_param}")).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let r = api("dlq=nackd-test-no-such-queue".into()).await;
    assert_eq!(r.status, 404, "{}", r.body);
    let r = common::ops::call(nackd.metrics, "POST", "/api/replay?dlq=x", None).await;
    assert_eq!(r.status, 401, "{}", r.body);

    let r = api(format!("dlq={dlq_param}&dry_run=true&limit=5")).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["examined"], 5, "{v}");
    assert_eq!(v["destinations"][&orig], 5, "{v}");
    assert_eq!(v["moved"], 0, "{v}");
    let r = api(format!(
        "dlq={dlq_param}&dry_run=true&to=nackd-test-no-such-queue"
    ))
    .await;
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(
        v["missing_destinations"]["nackd-test-no-such-queue"], 20,
        "{v}"
    );
    assert_eq!(v["destinations"], serde_json::json!({}), "{v}");
    // The first dry run put 0..5 behind the rest; the second read all 20
    // and put them back in that order.
    let order = (5..20).chain(0..5).collect::<Vec<u32>>();
    assert_eq!(peek(&conn, &dlq).await, order, "dry runs rotate the queue");

    let r = api(format!("dlq={dlq_param}")).await;
    assert_eq!(r.status, 503, "{}", r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("the store refused a park"),
        "{v}"
    );
    assert_eq!(v["moved"], 0, "{v}");
    let seen = wait_for(
        Duration::from_secs(10),
        "the refused messages put back",
        || peek(&conn, &dlq),
        |ids| ids.len() == 20,
    )
    .await;
    // Those read before the refusal stopped the pass are now last, in the
    // order read.
    let read = (1..=20)
        .find(|k| seen[..20 - k] == order[*k..] && seen[20 - k..] == order[..*k])
        .unwrap_or_else(|| panic!("not the old order rotated: {seen:?}"));
    eprintln!("refused replay: {read} read and put back");
    assert_eq!(message_count(&ch, &orig).await, 0);
    delete_queues(&ch, &[&dlq, &orig]).await;
    let _ = conn.close(200, "".into()).await;
    nackd.stop().await;
}

/// `spread=2s`: the nth of 20 messages is due `2s * n / 20` after the
/// replay, and none comes back early; the replayed message keeps the
/// broker's death headers and carries no retry count (the default reset;
/// keeping a count is `select`'s unit test).
#[tokio::test]
async fn a_spread_replay_is_never_early_and_resets_the_count() {
    let (dlq, orig) = (unique("replay-spread-dlq"), unique("replay-spread-orig"));
    let nackd = start(&format!(
        "[metrics]\nadmin_token = \"{TOKEN}\"\n[[policy]]\nqueues = [\"{}\"]\ndelays = [\"1s\"]\n",
        unique("replay-spread-policy")
    ))
    .await;
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    dead_letters(&ch, &dlq, &orig, 20).await;
    let q = common::ops::query(&dlq);
    let path = format!(
        "/api/replay?dlq={}&spread=2s",
        q.trim_start_matches("?queue=")
    );
    let began = std::time::Instant::now();
    let v = common::ops::json(nackd.metrics, "POST", &path, Some(TOKEN)).await;
    assert_eq!(v["moved"], 20, "{v}");
    let reader = conn.create_channel().await.unwrap();
    let mut c = consume(&reader, &orig, None).await;
    let mut last = Duration::ZERO;
    for _ in 0..20 {
        let d = next(&mut c, Duration::from_secs(10))
            .await
            .expect("replayed");
        let at = began.elapsed();
        let id = u32::from_be_bytes(d.data[..4].try_into().unwrap());
        let due = Duration::from_millis(2000 * u64::from(id) / 20);
        assert!(at >= due, "id {id} came at {at:?}, due {due:?}");
        assert_eq!(retry_count(&d), 0, "the count starts again");
        let h = d.properties.headers().clone().unwrap();
        assert!(h.inner().contains_key("x-first-death-queue"), "{h:?}");
        last = last.max(at);
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert!(
        last >= Duration::from_millis(1900),
        "spread: the last came at {last:?}"
    );
    delete_queues(&ch, &[&dlq, &orig]).await;
    let _ = conn.close(200, "".into()).await;
    nackd.stop().await;
}

/// An HTTP client that goes away mid-replay (a closed terminal, a proxy's
/// timeout) does not stop it half way: dropping the request's future
/// closed the replay's connection with parks in flight, so messages
/// nackd had stored went back to the dead-letter queue too (moved twice
/// by the next replay) and the rest stayed there (found by review).
#[tokio::test]
async fn a_replay_whose_client_goes_away_runs_to_its_end() {
    use tokio::io::AsyncWriteExt;
    let (dlq, orig) = (unique("replay-gone-dlq"), unique("replay-gone-orig"));
    let nackd = start(&format!(
        "[metrics]\nadmin_token = \"{TOKEN}\"\n[[policy]]\nqueues = [\"{}\"]\ndelays = [\"1s\"]\n",
        unique("replay-gone-policy")
    ))
    .await;
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    const N: u32 = 3000;
    dead_letters(&ch, &dlq, &orig, N).await;
    let q = common::ops::query(&dlq);
    let mut http = tokio::net::TcpStream::connect(nackd.metrics).await.unwrap();
    let request = format!(
        "POST /api/replay?dlq={} HTTP/1.1\r\nHost: nackd\r\nAuthorization: Bearer {TOKEN}\r\n\
         Content-Length: 0\r\n\r\n",
        q.trim_start_matches("?queue=")
    );
    http.write_all(request.as_bytes()).await.unwrap();
    wait_for(
        Duration::from_secs(20),
        "the replay under way",
        || async { message_count(&ch, &orig).await },
        |n| *n > 0,
    )
    .await;
    drop(http);
    // A bound on "eventually": on RabbitMQ 4.3 in a fresh-clone run at
    // load average 20, 2 659 of the 3 000 had moved after 60 s.
    let left = wait_for(
        Duration::from_secs(180),
        "the dead-letter queue emptied",
        || unacked_and_ready(&dlq),
        |c| *c == (0, 0),
    )
    .await;
    assert_eq!(left, (0, 0));
    let seen = wait_for(
        Duration::from_secs(20),
        "every message back",
        || async { message_count(&ch, &orig).await },
        |n| *n >= N,
    )
    .await;
    assert_eq!(seen, N);
    let ids = drain(&ch, &orig).await;
    assert_eq!(ids.len(), N as usize);
    assert!(ids.values().all(|n| *n == 1), "moved once each");
    delete_queues(&ch, &[&dlq, &orig]).await;
    let _ = conn.close(200, "".into()).await;
    nackd.stop().await;
}

/// `POST /api/replay?dlq=DLQ&QUERY` on `nackd`, which must answer 200.
async fn api_replay(nackd: &common::Nackd, dlq: &str, query: &str) -> serde_json::Value {
    let q = common::ops::query(dlq);
    let path = format!(
        "/api/replay?dlq={}{query}",
        q.trim_start_matches("?queue=")
    );
    common::ops::json(nackd.metrics, "POST", &path, Some(TOKEN)).await
}

/// Every message of `q` (acked), in queue order.
async fn take_all(conn: &lapin::Connection, q: &str) -> Vec<lapin::message::Delivery> {
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, q, Some(500)).await;
    let mut all = Vec::new();
    while let Some(d) = next(&mut c, Duration::from_secs(2)).await {
        d.ack(BasicAckOptions::default()).await.unwrap();
        all.push(d);
    }
    ch.close(200, "".into()).await.unwrap();
    all
}

/// Issue 33, finding 4: what a filtered replay does not take was handed
/// back with `nack(requeue)`, redelivered (and on RabbitMQ 4.0–4.2 one step
/// closer to a quorum queue's delivery limit). Now `--queue` and then
/// `--reason` leave the others as they were: each comes back with its body
/// and every property and header as published, never redelivered.
#[tokio::test]
async fn a_filtered_replay_leaves_the_others_exactly_as_they_were() {
    let (dlq, a, b) = (
        unique("replay-filter-dlq"),
        unique("replay-filter-a"),
        unique("replay-filter-b"),
    );
    let nackd = start(&format!(
        "[metrics]\nadmin_token = \"{TOKEN}\"\n[[policy]]\nqueues = [\"{}\"]\ndelays = [\"1s\"]\n",
        unique("replay-filter-policy")
    ))
    .await;
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    dead_letters(&ch, &dlq, &a, 10).await;
    declare_durable(&ch, &b).await;
    let kept: Vec<_> = (100..110u32)
        .map(|id| {
            let props = dead_lettered_properties(&b, "expired", id);
            (id.to_be_bytes().to_vec(), props)
        })
        .collect();
    for (body, props) in &kept {
        publish_with(&ch, &dlq, body, props.clone()).await;
    }

    let v = api_replay(&nackd, &dlq, &format!("&queue={a}")).await;
    assert_eq!((&v["moved"], &v["skipped"]), (&10.into(), &10.into()), "{v}");
    let v = api_replay(&nackd, &dlq, "&reason=rejected").await;
    assert_eq!((&v["moved"], &v["skipped"]), (&0.into(), &10.into()), "{v}");
    wait_for(
        Duration::from_secs(20),
        "a's messages back in a",
        || message_count(&ch, &a),
        |n| *n == 10,
    )
    .await;

    let left = take_all(&conn, &dlq).await;
    assert_eq!(left.len(), kept.len(), "b's messages, all of them");
    for (d, (body, props)) in left.iter().zip(&kept) {
        assert_eq!(&d.data, body, "in order, body intact");
        assert_eq!(&as_published(d), props, "every property and header intact");
        assert!(!d.redelivered, "put back, never requeued");
    }
    delete_queues(&ch, &[&dlq, &a, &b]).await;
    let _ = conn.close(200, "".into()).await;
    nackd.stop().await;
}

/// A pass reads at most as many messages as its queue held when it began,
/// and what it leaves goes to the tail, behind them: with messages
/// arriving throughout a dry run, each of the dead-lettered messages is
/// counted once (none twice, none missed), and afterwards every one of
/// them and every arrival is there once, the dead-lettered ones in their
/// order.
#[tokio::test]
async fn a_dry_run_with_messages_arriving_counts_each_once() {
    const N: u32 = 2000;
    let (dlq, orig) = (unique("replay-arrive-dlq"), unique("replay-arrive-orig"));
    let nackd = start(&format!(
        "[metrics]\nadmin_token = \"{TOKEN}\"\n[[policy]]\nqueues = [\"{}\"]\ndelays = [\"1s\"]\n",
        unique("replay-arrive-policy")
    ))
    .await;
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    dead_letters(&ch, &dlq, &orig, N).await;

    // Arrivals: no headers (no destination), ids from 1 000 000 on.
    let published = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let arriving = {
        let (pch, dlq) = (conn.create_channel().await.unwrap(), dlq.clone());
        let (published, stop) = (published.clone(), stop.clone());
        pch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let id = 1_000_000 + published.load(std::sync::atomic::Ordering::SeqCst);
                assert!(publish(&pch, &dlq, &id.to_be_bytes()).await.is_ack());
                published.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let before = published.load(std::sync::atomic::Ordering::SeqCst);
    let v = api_replay(&nackd, &dlq, "&dry_run=true").await;
    let during = published.load(std::sync::atomic::Ordering::SeqCst) - before;
    stop.cancel();
    arriving.await.unwrap();
    let arrivals = published.load(std::sync::atomic::Ordering::SeqCst);
    assert!(during > 0, "messages arrived during the dry run");
    assert_eq!(v["destinations"][&orig], N, "each counted once: {v}");
    assert_eq!(
        v["examined"].as_u64().unwrap(),
        u64::from(N) + v["no_destination"].as_u64().unwrap(),
        "{v}"
    );

    let all = take_all(&conn, &dlq).await;
    let id = |d: &lapin::message::Delivery| u32::from_be_bytes(d.data[..4].try_into().unwrap());
    let redelivered: Vec<u32> = all.iter().filter(|d| d.redelivered).map(id).collect();
    assert!(redelivered.is_empty(), "put back, never requeued: {redelivered:?}");
    let ids: Vec<u32> = all.iter().map(id).collect();
    let dead: Vec<u32> = ids.iter().copied().filter(|id| *id < N).collect();
    assert!(dead == (0..N).collect::<Vec<_>>(), "each once, in order: {} of {N}", dead.len());
    // Arrivals the pass counted at its start were read and put back too.
    let mut new: Vec<u32> = ids.iter().copied().filter(|id| *id >= N).collect();
    new.sort_unstable();
    let expected: Vec<u32> = (0..arrivals).map(|k| 1_000_000 + k).collect();
    assert!(new == expected, "every arrival once: {} of {arrivals}", new.len());
    delete_queues(&ch, &[&dlq, &orig]).await;
    let _ = conn.close(200, "".into()).await;
    nackd.stop().await;
}

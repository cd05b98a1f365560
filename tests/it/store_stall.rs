//! A store that stops answering (issue 33, items 5 and 6), for real: the
//! nackd binary's store lives on a loop-mounted ext4 file system, frozen
//! with `fsfreeze` while nackd runs, so its writes and fsyncs hang as on a
//! stuck disk. Claimed nacks go back to the broker within the settle
//! timeout (the consumer is not stuck), `/readyz` is 503 naming the store,
//! `nackd_store_stalls_total` counts it, a delayed publish given up
//! meanwhile never fires, and nothing is lost once the store answers again.
//!
//! Needs root (`mount`, `fsfreeze`); it fails, never skips, without it.

use crate::common;

use std::path::{Path, PathBuf};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::ops::{get, until};
use common::process::Process;
use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, ExchangeKind};
use nackd_core::session::SETTLE_TIMEOUT;

/// Runs `cmd args`; panics with its output if it fails.
fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd} {args:?}: {e} (needs root and util-linux)"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A small ext4 file system on a loop device, mounted in a temporary
/// directory; unfrozen and unmounted when dropped (a failing test never
/// leaves it frozen). A detached watchdog thaws it too, should this
/// process be killed before the drop runs.
struct Disk {
    dir: tempfile::TempDir,
    mnt: PathBuf,
    /// The watchdog, once frozen (ended at the drop).
    watchdog: Option<std::process::Child>,
}

impl Disk {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("disk.img");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        std::fs::File::create(&image)
            .unwrap()
            .set_len(128 << 20)
            .unwrap();
        run("mkfs.ext4", &["-q", "-F", image.to_str().unwrap()]);
        run(
            "mount",
            &["-o", "loop", image.to_str().unwrap(), mnt.to_str().unwrap()],
        );
        Self {
            dir,
            mnt,
            watchdog: None,
        }
    }

    fn freeze(&mut self) {
        let mnt = self.mnt.to_str().unwrap();
        // The safety net: thawed after 3 minutes whatever happens here.
        let watchdog = Command::new("sh")
            .args([
                "-c",
                &format!("sleep 180; fsfreeze --unfreeze '{mnt}' 2>/dev/null"),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("the thaw watchdog starts");
        self.watchdog = Some(watchdog);
        run("fsfreeze", &["--freeze", mnt]);
    }

    fn thaw(&self) {
        run("fsfreeze", &["--unfreeze", self.mnt.to_str().unwrap()]);
    }
}

/// Thaws the disk when dropped: declared after the nackd process, so
/// that a failing test thaws before it kills nackd (a process blocked on a
/// frozen file system cannot die).
struct Thaw<'a>(&'a Disk);

impl Drop for Thaw<'_> {
    fn drop(&mut self) {
        let mnt = self.0.mnt.to_str().unwrap();
        let _ = Command::new("fsfreeze").args(["--unfreeze", mnt]).output();
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        let mnt = self.mnt.to_str().unwrap();
        let _ = Command::new("fsfreeze").args(["--unfreeze", mnt]).output();
        let umount = Command::new("umount").arg(mnt).output();
        if !umount.is_ok_and(|o| o.status.success()) {
            let _ = Command::new("umount").args(["-l", mnt]).output();
        }
        if let Some(mut watchdog) = self.watchdog.take() {
            // Its group: the shell and its `sleep`.
            let group = format!("-{}", watchdog.id());
            let _ = Command::new("kill").args(["-KILL", "--", &group]).output();
            let _ = watchdog.wait();
        }
        let _ = &self.dir;
    }
}

/// `/readyz`: its status and its body.
async fn readyz(metrics: std::net::SocketAddr) -> (u16, serde_json::Value) {
    let r = get(metrics, "/readyz").await;
    (r.status, serde_json::from_str(&r.body).unwrap_or_default())
}

/// Whether `/readyz` is 503 with a reason naming the store.
fn unready_for_the_store((status, body): &(u16, serde_json::Value)) -> bool {
    *status == 503
        && body["reasons"]
            .as_array()
            .is_some_and(|r| r.iter().any(|r| r.as_str().is_some_and(|r| r.starts_with("store: not answering"))))
}

async fn publish(ch: &Channel, exchange: &str, key: &str, body: &[u8], delay_ms: Option<i64>) {
    let mut props = BasicProperties::default().with_delivery_mode(2);
    if let Some(ms) = delay_ms {
        let mut h = FieldTable::default();
        h.insert("x-delay".into(), AMQPValue::LongLongInt(ms));
        props = props.with_headers(h);
    }
    let confirm = ch
        .basic_publish(
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
    assert!(!confirm.is_nack(), "{body:?} confirmed with {confirm:?}");
}

fn text(d: &lapin::message::Delivery) -> String {
    String::from_utf8_lossy(&d.data).into_owned()
}

fn config(dir: &Path, store: &Path, queue: &str) -> PathBuf {
    let path = dir.join("nackd.toml");
    std::fs::write(
        &path,
        format!(
            "[upstream]\naddress = \"{BROKER}\"\n[store]\npath = \"{}\"\n{DELAYED}\
             [[policy]]\nqueues = [\"{queue}\"]\ndelays = [\"1s\"]\n",
            store.display()
        ),
    )
    .unwrap();
    path
}

#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_store_defers_nacks_and_loses_nothing() {
    let mut disk = Disk::new();
    let (q, x, d) = (unique("stall-q"), unique("stall-x"), unique("stall-d"));
    let nackd = Process::start(&config(disk.dir.path(), &disk.mnt.join("store"), &q));
    let uri = format!("amqp://guest:guest@{}/%2f", nackd.addr);

    // A queue nackd intercepts, a delayed exchange and the queue behind it
    // (declared before the freeze: the registry of delayed exchanges is
    // saved in the store's directory).
    let admin_conn = connect(&uri).await;
    let admin = admin_conn.create_channel().await.unwrap();
    declare_durable(&admin, &q).await;
    declare_durable(&admin, &d).await;
    let mut args = FieldTable::default();
    args.insert("x-delayed-type".into(), AMQPValue::LongString("direct".into()));
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    admin
        .exchange_declare(x.as_str().into(), ExchangeKind::Custom("x-delayed-message".into()), durable, args)
        .await
        .unwrap();
    admin
        .queue_bind(d.as_str().into(), x.as_str().into(), "k".into(), QueueBindOptions::default(), FieldTable::default())
        .await
        .unwrap();
    publish(&admin, "", &q, b"A", None).await;
    publish(&admin, "", &q, b"B", None).await;
    // What reaches `d`, read straight from the broker.
    let broker = direct().await;
    let watch = broker.create_channel().await.unwrap();
    let mut arrivals = consume(&watch, &d, None).await;

    // Prefetch 1: while nackd holds A's nack unanswered, B cannot come.
    let consumer_conn = connect(&uri).await;
    let consumer_ch = consumer_conn.create_channel().await.unwrap();
    let mut consumer = consume(&consumer_ch, &q, Some(1)).await;
    let first = next(&mut consumer, Duration::from_secs(30)).await.expect("A");
    assert_eq!(text(&first), "A");
    let ready = until(nackd.metrics, "ready before the freeze", |s| {
        s.get("nackd_store_stalled", &[]) == 0.0 && s.has("nackd_store_stalls_total")
    })
    .await;
    assert_eq!(ready.get("nackd_store_stalls_total", &[]), 0.0);

    disk.freeze();
    let _thaw = Thaw(&disk);
    let frozen_at = Instant::now();
    // The nack is claimed: its park waits for a store that hangs.
    first
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await
        .unwrap();
    // A delayed publish on a confirm channel, taken while the store hangs.
    let publisher_conn = connect(&uri).await;
    let publisher = publisher_conn.create_channel().await.unwrap();
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirm = publisher
        .basic_publish(
            x.as_str().into(),
            "k".into(),
            BasicPublishOptions::default(),
            b"D",
            {
                let mut h = FieldTable::default();
                h.insert("x-delay".into(), AMQPValue::LongLongInt(500));
                BasicProperties::default().with_delivery_mode(2).with_headers(h)
            },
        )
        .await
        .unwrap();

    // Given back to the broker within the settle timeout (plus the
    // policy's 1 s delay of the deferred nack): A comes again, and the
    // consumer is not stuck.
    let again = next(&mut consumer, SETTLE_TIMEOUT * 3)
        .await
        .expect("the nack was never given back: the consumer is stuck");
    let took = frozen_at.elapsed();
    assert_eq!(text(&again), "A");
    assert!(again.redelivered, "the broker's own redelivery");
    assert_eq!(retry_count(&again), 0, "not a retry nackd held");
    assert!(took >= SETTLE_TIMEOUT, "given up before the settle timeout: {took:?}");
    // The publisher was told nack, and gives up on this connection.
    let c = tokio::time::timeout(SETTLE_TIMEOUT * 3, confirm)
        .await
        .expect("no confirm for the delayed publish")
        .unwrap();
    assert!(c.is_nack(), "the delayed publish was confirmed with {c:?}");
    let _ = publisher_conn.close(200, "republishing".into()).await;

    // /readyz names the store; the stall is counted.
    wait_for(SETTLE_TIMEOUT * 3, "/readyz 503 naming the store", || readyz(nackd.metrics), unready_for_the_store).await;
    until(nackd.metrics, "the stall counted", |s| {
        s.get("nackd_store_stalls_total", &[]) == 1.0 && s.get("nackd_store_stalled", &[]) == 1.0
    })
    .await;
    // While it stalls, a nack is deferred at once (no settle timeout).
    again
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let third = next(&mut consumer, SETTLE_TIMEOUT)
        .await
        .expect("a nack while the store stalls was not given back");
    assert_eq!(text(&third), "A");
    assert_eq!(retry_count(&third), 0);

    disk.thaw();
    wait_for(Duration::from_secs(60), "/readyz 200 after the thaw", || readyz(nackd.metrics), |(status, _)| *status == 200).await;
    until(nackd.metrics, "the stall over", |s| {
        s.get("nackd_store_stalled", &[]) == 0.0 && s.get("nackd_store_stalls_total", &[]) == 1.0
    })
    .await;

    // The store answers again: the retry is held and comes back as one.
    third
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let m = next(&mut consumer, Duration::from_secs(30))
            .await
            .unwrap_or_else(|| panic!("lost after the thaw; got {seen:?}"));
        seen.push((text(&m), retry_count(&m)));
        m.ack(BasicAckOptions::default()).await.unwrap();
    }
    seen.sort();
    assert_eq!(seen, [("A".to_string(), 1), ("B".to_string(), 0)]);

    // The publisher republishes: exactly one copy arrives. The given-up
    // one was due long ago, so it would have come first.
    let publisher_conn = connect(&uri).await;
    let publisher = publisher_conn.create_channel().await.unwrap();
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    publish(&publisher, &x, "k", b"D again", Some(500)).await;
    let arrived = next(&mut arrivals, Duration::from_secs(30))
        .await
        .expect("the republished delayed message never arrived");
    arrived.ack(BasicAckOptions::default()).await.unwrap();
    assert_eq!(text(&arrived), "D again", "the given-up copy fired");
    // Both copies the store wrote after their give-up (A's retry, D) were
    // deleted, not kept: nothing is held.
    let log = nackd.log.clone();
    let withdrawn = || {
        let n = log.lock().unwrap().iter().filter(|l| l.contains("deleted, never fired")).count();
        async move { n }
    };
    wait_for(Duration::from_secs(30), "both given-up copies deleted", withdrawn, |n| *n == 2).await;
    until(nackd.metrics, "nothing held", |s| s.sum("nackd_held_messages") == 0.0).await;
    assert_eq!(message_count(&admin, &q).await, 0);
    assert_eq!(message_count(&admin, &d).await, 0);
    delete_queues(&admin, &[&q, &d]).await;
    let _ = admin.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default()).await;
    drop(nackd);
}

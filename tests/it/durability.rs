//! The hold store under crashes, damage and a full disk: real nackd
//! processes killed with SIGKILL, real RabbitMQ, real lapin consumers.

use crate::common;

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::process::{Process, NACKD};
use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;

fn config(dir: &std::path::Path, queue: &str, delays: &str, extra: &str) -> std::path::PathBuf {
    let path = dir.join("nackd.toml");
    std::fs::write(
        &path,
        format!(
            "[upstream]\naddress = \"{BROKER}\"\n[store]\npath = \"{}\"\n{extra}\n[[policy]]\nqueues = [\"{queue}\"]\ndelays = [{delays}]\n",
            dir.join("store").display()
        ),
    )
    .unwrap();
    path
}

async fn publish_all(queue: &str, n: u32) {
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_durable(&ch, queue).await;
    for i in 0..n {
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            &i.to_be_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    conn.close(200, "".into()).await.unwrap();
}

/// Consumes through whatever nackd `addr` points to, reconnecting when it
/// dies: nacks a message until it carries x-retry-count 2, then acks it.
async fn consumer(
    queue: String,
    addr: Arc<Mutex<std::net::SocketAddr>>,
    acked: Arc<Mutex<HashMap<u32, u32>>>,
    stop: Arc<Mutex<bool>>,
) {
    while !*stop.lock().unwrap() {
        let uri = format!("amqp://guest:guest@{}/%2f", addr.lock().unwrap());
        let Ok(Ok(conn)) = tokio::time::timeout(
            Duration::from_secs(3),
            lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
        )
        .await
        else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Some(Ok(ch)) = bounded(conn.create_channel()).await else {
            continue;
        };
        let _ = bounded(ch.basic_qos(50, BasicQosOptions::default())).await;
        let Some(Ok(mut deliveries)) = bounded(ch.basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ))
        .await
        else {
            continue;
        };
        while !*stop.lock().unwrap() {
            let Ok(next) =
                tokio::time::timeout(Duration::from_millis(500), deliveries.next()).await
            else {
                continue;
            };
            let Some(Ok(d)) = next else { break };
            let id = u32::from_be_bytes(d.data[..4].try_into().unwrap());
            let settled = if retry_count(&d) >= 2 {
                let r = bounded(d.ack(BasicAckOptions::default())).await;
                if matches!(r, Some(Ok(_))) {
                    *acked.lock().unwrap().entry(id).or_default() += 1;
                }
                r
            } else {
                bounded(d.nack(BasicNackOptions {
                    requeue: false,
                    multiple: false,
                }))
                .await
            };
            if !matches!(settled, Some(Ok(_))) {
                break;
            }
        }
    }
}

/// `f`, or `None` after 5 s: a lapin call on a connection whose nackd was
/// just killed can wait forever, and the consumer must reconnect instead.
async fn bounded<F: std::future::Future>(f: F) -> Option<F::Output> {
    tokio::time::timeout(Duration::from_secs(5), f).await.ok()
}

/// Publishes straight to the broker at about `rate`/s until `stop`, counting
/// confirmed publishes in `sent`; returns the count.
async fn publisher(queue: String, rate: u64, stop: Arc<Mutex<bool>>, sent: Arc<AtomicU32>) -> u32 {
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut n = 0u32;
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    while !*stop.lock().unwrap() {
        tick.tick().await;
        ch.basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            &n.to_be_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
        n += 1;
        sent.store(n, Ordering::Relaxed);
    }
    let _ = conn.close(200, "".into()).await;
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_nack_load_loses_nothing() {
    require_broker();
    let dir = tempfile::tempdir().unwrap();
    let q = unique("crash");
    let cfg = config(dir.path(), &q, "\"300ms\", \"600ms\"", "");
    publish_all(&q, 0).await; // declare
    let mut nackd = Process::start(&cfg);
    let addr = Arc::new(Mutex::new(nackd.addr));
    let acked = Arc::new(Mutex::new(HashMap::new()));
    let (stop_publishing, stop_consuming) =
        (Arc::new(Mutex::new(false)), Arc::new(Mutex::new(false)));
    let sent = Arc::new(AtomicU32::new(0));
    let producer = tokio::spawn(publisher(
        q.clone(),
        300,
        stop_publishing.clone(),
        sent.clone(),
    ));
    let mut consumer_task = tokio::spawn(consumer(
        q.clone(),
        addr.clone(),
        acked.clone(),
        stop_consuming.clone(),
    ));
    let mut rng = fastrand::Rng::with_seed(7);
    let rounds = 6;
    // More than 1000 messages published while the kills happen: each kill
    // waits for its share of them, not for a time in which a loaded machine
    // (a confirm per publish, fsynced by RabbitMQ) may publish far fewer.
    let load = 1001u32;
    for round in 0..rounds {
        tokio::time::sleep(Duration::from_millis(rng.u64(400..1500))).await;
        let share = load * (round + 1) / rounds;
        wait_for(
            Duration::from_secs(60),
            &format!("{share} published before SIGKILL {round}"),
            || async { sent.load(Ordering::Relaxed) },
            |n| *n >= share,
        )
        .await;
        let held = std::process::Command::new(NACKD)
            .arg("--config")
            .arg(&cfg)
            .args(["store", "stats"])
            .output()
            .unwrap();
        nackd.kill9();
        eprintln!(
            "round {round}: SIGKILL with {} ({} acked so far)",
            String::from_utf8_lossy(&held.stdout)
                .lines()
                .next()
                .unwrap_or(""),
            acked.lock().unwrap().len()
        );
        nackd = Process::start(&cfg);
        *addr.lock().unwrap() = nackd.addr;
    }
    *stop_publishing.lock().unwrap() = true;
    let n = producer.await.unwrap();
    let began = Instant::now();
    // Each message takes three deliveries (two nacks, then the ack), all on a
    // possibly loaded machine: ample time. Done as soon as everything is
    // acked; the limit only decides how long a real loss takes to report.
    while acked.lock().unwrap().len() < n as usize && began.elapsed() < Duration::from_secs(240) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    *stop_consuming.lock().unwrap() = true;
    // The consumer checks `stop` at least every 5 s; never wait on it forever.
    let _ = tokio::time::timeout(Duration::from_secs(15), &mut consumer_task).await;
    consumer_task.abort();
    let acked = acked.lock().unwrap().clone();
    let missing: Vec<u32> = (0..n).filter(|i| !acked.contains_key(i)).collect();
    let duplicates: u32 = acked.values().map(|c| c - 1).sum();
    eprintln!("{n} messages, {rounds} SIGKILLs under load: {} acked, {} missing, {duplicates} duplicate acks", acked.len(), missing.len());
    assert!(n > 1000, "the load ran during the kills");
    assert!(missing.is_empty(), "lost after SIGKILL: {missing:?}");
    drop(nackd);
    let conn = direct().await;
    let _ = conn
        .create_channel()
        .await
        .unwrap()
        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await;
}

#[tokio::test]
async fn a_full_store_falls_back_to_the_broker_and_loses_nothing() {
    let q = unique("full");
    // Room for two held messages of 1 KiB with their retry headers (each
    // record is about 1.6 KB: two fit from 3 500 bytes, three do not in 5 000).
    let nackd = start(&format!("[store]\npath = \"{}\"\nmax_bytes = 4000\n[[policy]]\nqueues = [\"{q}\"]\ndelays = [\"300ms\"]\n", tempfile::tempdir().unwrap().keep().display())).await;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    for i in 0..5u8 {
        ch.basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            &[i; 1024],
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let mut deliveries = consume(&ch, &q, None).await;
    let mut seen: HashMap<u8, Vec<(bool, i64)>> = HashMap::new();
    // Until each message came back once (held ones after their delay, however
    // slow the machine), then as long as more keep coming: a third copy would.
    loop {
        let back = seen.len() == 5 && seen.values().all(|v| v.len() >= 2);
        let within = Duration::from_secs(if back { 2 } else { 15 });
        let Ok(Some(d)) = tokio::time::timeout(within, deliveries.next()).await else {
            break;
        };
        let d = d.unwrap();
        let entry = seen.entry(d.data[0]).or_default();
        entry.push((d.redelivered, retry_count(&d)));
        if entry.len() == 1 {
            d.nack(BasicNackOptions {
                requeue: true,
                multiple: false,
            })
            .await
            .unwrap();
        } else {
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
    }
    assert_eq!(seen.len(), 5, "every message came back: {seen:?}");
    let delayed = seen
        .values()
        .filter(|v| v.len() == 2 && v[1] == (false, 1))
        .count();
    let passed = seen
        .values()
        .filter(|v| v.len() == 2 && v[1] == (true, 0))
        .count();
    assert_eq!(
        (delayed, passed),
        (2, 3),
        "2 held by nackd, 3 requeued by the broker: {seen:?}"
    );
    ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn damaged_tail_and_the_store_cli() {
    require_broker();
    let dir = tempfile::tempdir().unwrap();
    let q = unique("damaged");
    let cfg = config(dir.path(), &q, "\"1h\"", "");
    publish_all(&q, 5).await;
    let nackd = Process::start(&cfg);
    {
        let conn = connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr)).await;
        let ch = conn.create_channel().await.unwrap();
        for _ in 0..5 {
            let m = ch
                .basic_get(q.as_str().into(), BasicGetOptions::default())
                .await
                .unwrap()
                .unwrap();
            m.delivery
                .nack(BasicNackOptions {
                    requeue: false,
                    multiple: false,
                })
                .await
                .unwrap();
        }
        let began = Instant::now();
        while !nackd_stats(&cfg).contains("held 5 ") {
            assert!(
                began.elapsed() < Duration::from_secs(30),
                "{}",
                nackd_stats(&cfg)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    nackd.kill9();
    let list = run(&cfg, &["store", "list", "--queue", &q]);
    assert_eq!(list.lines().count(), 5, "{list}");
    assert!(list.contains("x-retry-count"), "{list}");
    // Damage the last bytes of the newest non-empty segment.
    let store = dir.path().join("store");
    let mut segs: Vec<_> = std::fs::read_dir(&store)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "log") && std::fs::metadata(p).unwrap().len() > 0
        })
        .collect();
    segs.sort();
    let last = segs.last().unwrap();
    let mut bytes = std::fs::read(last).unwrap();
    let len = bytes.len();
    bytes[len - 2] ^= 0xff;
    std::fs::write(last, bytes).unwrap();
    let nackd = Process::start(&cfg); // starts despite the damage
    let stats = nackd_stats(&cfg);
    assert!(
        stats.contains("held 4 "),
        "everything before the damage: {stats}"
    );
    nackd.kill9();
    let purged = run(&cfg, &["store", "purge", "--queue", &q]);
    assert!(purged.contains("purged 4"), "{purged}");
    assert!(nackd_stats(&cfg).contains("held 0 "));
    let conn = direct().await;
    let _ = conn
        .create_channel()
        .await
        .unwrap()
        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await;
}

fn run(cfg: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(NACKD)
        .arg("--config")
        .arg(cfg)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn nackd_stats(cfg: &std::path::Path) -> String {
    run(cfg, &["store", "stats"])
}

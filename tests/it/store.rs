//! The hold store through the real broker: after a SIGKILL exactly the held
//! messages come back (a delete never comes undone, whatever the mix of
//! delays), disk use shrinks back by compaction, and a really full disk
//! turns interception off without losing anything, then on again.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::ops::scrape;
use common::ops::until;
use common::process::Process;
use common::*;
use lapin::options::*;
use lapin::BasicProperties;

const SEGMENT: u64 = 64 * 1024;

fn write_config(dir: &Path, long: &str, short: &str) -> PathBuf {
    let path = dir.join("nackd.toml");
    std::fs::write(
        &path,
        format!(
            "[upstream]\naddress = \"{BROKER}\"\n[store]\npath = \"{}\"\nsegment_bytes = {SEGMENT}\n\
             [[policy]]\nqueues = [\"{long}\"]\ndelays = [\"10m\"]\n\
             [[policy]]\nqueues = [\"{short}\"]\ndelays = [\"100ms\"]\n",
            dir.join("store").display()
        ),
    )
    .unwrap();
    path
}

fn segments_bytes(store: &Path) -> u64 {
    nackd::store::segment_numbers(store)
        .unwrap()
        .iter()
        .filter_map(|n| std::fs::metadata(nackd::store::segment_path(store, *n)).ok())
        .map(|m| m.len())
        .sum()
}

async fn publish_n(queue: &str, n: u32, size: usize) {
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_durable(&ch, queue).await;
    for i in 0..n {
        let mut body = vec![0u8; size];
        body[..4].copy_from_slice(&i.to_be_bytes());
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            &body,
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    conn.close(200, "".into()).await.unwrap();
}

async fn delete(queues: &[&str]) {
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    delete_queues(&ch, queues).await;
}

/// Issue 11: one message held for 10 minutes pins the oldest segment while
/// 1 200 short retries go through several more; after a SIGKILL none of
/// those comes back, the long one is still held, and compaction has
/// brought the store back to about one segment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_sigkill_no_completed_retry_comes_back_and_the_store_shrinks() {
    require_broker();
    let dir = tempfile::tempdir().unwrap();
    let (long, short) = (unique("store-long"), unique("store-short"));
    let cfg = write_config(dir.path(), &long, &short);
    let store = dir.path().join("store");
    publish_n(&long, 1, 1024).await;
    let n = 1200u32;
    publish_n(&short, n, 1024).await;
    let nackd = Process::start(&cfg);
    let conn = connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr)).await;
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, &long, Some(10)).await;
    let d = next(&mut c, Duration::from_secs(10))
        .await
        .expect("the long one");
    d.nack(BasicNackOptions::default()).await.unwrap();

    // Every short message: nacked once, retried after 100 ms, acked.
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, &short, Some(200)).await;
    let mut retried: HashMap<u32, u32> = HashMap::new();
    let began = Instant::now();
    while retried.len() < n as usize {
        assert!(
            began.elapsed() < Duration::from_secs(120),
            "{} of {n} retried",
            retried.len()
        );
        let Some(d) = next(&mut c, Duration::from_secs(10)).await else {
            continue;
        };
        let id = u32::from_be_bytes(d.data[..4].try_into().unwrap());
        if retry_count(&d) == 0 {
            d.nack(BasicNackOptions::default()).await.unwrap();
        } else {
            *retried.entry(id).or_default() += 1;
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
    }
    // Every ack has reached the broker before the kill (a channel's
    // close-ok follows all its earlier frames); else the broker hands back
    // the last retries, redelivered, which is not what this test is about.
    ch.close(200, "".into()).await.unwrap();
    // 1 200 puts and deletes of 1 KiB: well over a segment's worth each.
    let newest = *nackd::store::segment_numbers(&store)
        .unwrap()
        .last()
        .unwrap();
    assert!(
        newest >= 10,
        "the retries went through many segments: {newest}"
    );
    // Wait for exactly the state asserted after the kill: on disk, only the
    // long one is held, and compaction brought the files back down.
    let began = Instant::now();
    loop {
        let held = nackd::store::inspect::held(&store).unwrap();
        let bytes = segments_bytes(&store);
        if held.len() == 1 && bytes <= 3 * SEGMENT {
            assert_eq!(&*held[0].queue, long.as_str());
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "{} held on disk, {bytes} bytes",
            held.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let s = scrape(nackd.metrics).await;
    assert!(
        s.get("nackd_store_compacted_bytes_total", &[]) > 0.0,
        "compaction moved the long one"
    );
    nackd.kill9();

    let nackd = Process::start(&cfg);
    let s = scrape(nackd.metrics).await;
    assert_eq!(
        s.get("nackd_held_messages", &[("vhost", "/"), ("queue", &long)]),
        1.0,
        "the long one is still held"
    );
    assert_eq!(s.sum("nackd_held_messages"), 1.0, "and nothing else");
    let conn = connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr)).await;
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, &short, None).await;
    let again = next(&mut c, Duration::from_secs(3)).await;
    assert!(
        again.is_none(),
        "a completed retry came back after the restart: {:?}",
        again.map(|d| d.data[..4].to_vec())
    );
    let s = scrape(nackd.metrics).await;
    assert_eq!(s.get("nackd_retries_published_total", &[]), 0.0);
    assert_eq!(s.get("nackd_store_damaged_bytes_total", &[]), 0.0);
    assert!(retried.values().all(|n| *n == 1), "each retried once");
    drop(nackd);
    delete(&[&long, &short]).await;
}

/// A small ext4 file system on a loop device, unmounted on drop.
struct SmallDisk {
    mount: tempfile::TempDir,
    _image: tempfile::TempDir,
}

impl SmallDisk {
    fn new(mib: u64) -> Self {
        let image_dir = tempfile::tempdir().unwrap();
        let image = image_dir.path().join("disk.img");
        let mount = tempfile::tempdir().unwrap();
        let run = |cmd: &mut Command| {
            let out = cmd.output().unwrap_or_else(|e| {
                panic!(
                    "cannot run {cmd:?} ({e}): this test needs mkfs.ext4 and mount -o loop (root)"
                )
            });
            assert!(
                out.status.success(),
                "{cmd:?} failed: {}; this test needs a loop-mounted ext4 (root, /dev/loop*)",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        std::fs::File::create(&image)
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image));
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(mount.path()));
        Self {
            mount,
            _image: image_dir,
        }
    }

    fn path(&self) -> &Path {
        self.mount.path()
    }

    /// Writes a file until the disk is full.
    fn fill(&self, name: &str) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.path().join(name)).unwrap();
        let chunk = vec![0xEEu8; 64 * 1024];
        while f.write_all(&chunk).and_then(|_| f.sync_data()).is_ok() {}
        // What is left is smaller than a chunk: fill that too.
        let mut small = vec![0xEEu8; 1024];
        while !small.is_empty() {
            if f.write_all(&small).and_then(|_| f.sync_data()).is_err() {
                small.truncate(small.len() / 2);
            }
        }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.mount.path()).status();
    }
}

/// Issue 11: ENOSPC on a real file system. Nacks are deferred (left
/// unacked, requeued by nackd after the delay: nothing lost), interception
/// resumes once space is back, and every message arrives in the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_defers_nacks_and_interception_resumes() {
    let disk = SmallDisk::new(8);
    let q = unique("disk-full");
    let store = disk.path().join("store");
    let nackd = start(&format!(
        "[store]\npath = \"{}\"\nsegment_bytes = {SEGMENT}\n[[policy]]\nqueues = [\"{q}\"]\ndelays = [\"200ms\"]\n",
        store.display()
    ))
    .await;
    publish_n(&q, 10, 4096).await;
    // Held before the disk fills: it must survive the full disk.
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, &q, Some(20)).await;
    let mut first = Vec::new();
    for _ in 0..10 {
        first.push(
            next(&mut c, Duration::from_secs(10))
                .await
                .expect("a delivery"),
        );
    }
    first
        .remove(0)
        .nack(BasicNackOptions::default())
        .await
        .unwrap();
    let unavailable = [("reason", "store_unavailable")];
    let s = until(nackd.metrics, "one held", |s| {
        s.sum("nackd_held_messages") == 1.0 && s.get("nackd_nacks_intercepted_total", &[]) == 1.0
    })
    .await;
    assert_eq!(s.get("nackd_nacks_deferred_total", &unavailable), 0.0);

    disk.fill("ballast");
    // The disk is full: every nack is deferred, requeued by nackd later.
    for d in first.drain(..) {
        d.nack(BasicNackOptions {
            requeue: true,
            multiple: false,
        })
        .await
        .unwrap();
    }
    let s = until(nackd.metrics, "9 deferred", |s| {
        s.get("nackd_nacks_deferred_total", &unavailable) >= 9.0
    })
    .await;
    assert!(s.get("nackd_store_errors_total", &[]) >= 1.0);
    assert_eq!(s.get("nackd_nacks_intercepted_total", &[]), 1.0);

    // Space comes back: the broker's redeliveries are nacked again and
    // this time held; then all ten come back as retries.
    std::fs::remove_file(disk.path().join("ballast")).unwrap();
    let mut acked: HashMap<u32, i64> = HashMap::new();
    let began = Instant::now();
    while acked.len() < 10 {
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "only {acked:?} came back"
        );
        let Some(d) = next(&mut c, Duration::from_secs(5)).await else {
            continue;
        };
        let id = u32::from_be_bytes(d.data[..4].try_into().unwrap());
        match retry_count(&d) {
            0 => {
                d.nack(BasicNackOptions::default()).await.unwrap();
            }
            n => {
                assert!(acked.insert(id, n).is_none(), "{id} twice");
                d.ack(BasicAckOptions::default()).await.unwrap();
            }
        }
    }
    assert!(acked.values().all(|n| *n == 1), "{acked:?}");
    // The consumer can see a retry before nackd has the broker's confirm
    // of it and has deleted it: wait until nothing is held, as the store
    // check below expects.
    let s = until(nackd.metrics, "every retry completed", |s| {
        s.sum("nackd_held_messages") == 0.0
    })
    .await;
    assert_eq!(
        s.get("nackd_nacks_intercepted_total", &[]),
        10.0,
        "interception resumed"
    );
    assert!(s.get("nackd_nacks_deferred_total", &unavailable) >= 9.0);
    assert_eq!(s.sum("nackd_nacks_passed_total"), 0.0);
    conn.close(200, "".into()).await.unwrap();
    nackd.stop().await;
    delete(&[&q]).await;
    // The store on the small disk is consistent: nothing held, nothing damaged.
    let (_, rec) = nackd::store::Log::open(&store, nackd::store::Options::default()).unwrap();
    assert!(rec.held.is_empty() && rec.damage.is_empty());
}

fn held_message(id: u64) -> nackd::store::Held {
    nackd::store::Held {
        id,
        vhost: "/".into(),
        queue: "q".into(),
        due_ms: id,
        retry: 1,
        route: nackd::store::Route::Queue,
        on_return: None,
        header: bytes::Bytes::from_static(&[0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0]),
        body: bytes::Bytes::from(vec![7u8; 4000]),
    }
}

/// A store that fills its own disk (no `store.max_bytes`) frees it again as
/// its messages complete. Once nackd took the last block, not even a
/// delete fitted: no completion reached the disk, nothing could be
/// reclaimed, interception never resumed, and a restart republished every
/// message completed meanwhile. Puts now leave room for the deletes.
#[test]
fn a_store_that_filled_its_own_disk_frees_it_as_its_messages_complete() {
    let disk = SmallDisk::new(8);
    let options = nackd::store::Options {
        max_bytes: None,
        segment_bytes: SEGMENT,
    };
    let (mut log, _) = nackd::store::Log::open(&disk.path().join("store"), options).unwrap();
    let mut held = Vec::new();
    for id in 1.. {
        let Ok(loc) = log.put(&held_message(id), None) else {
            break;
        };
        if log.commit().is_err() {
            break;
        }
        held.push((id, loc));
        log.reclaim();
    }
    assert!(log.bytes() > 4 << 20, "it filled the disk: {}", log.bytes());
    // Every message completes, while nacks keep coming.
    let mut next = held.len() as u64 + 10;
    for (id, loc) in held.drain(..) {
        log.del(id, loc);
    }
    for _ in 0..10 {
        next += 1;
        let _ = log.put(&held_message(next), None);
        let _ = log.commit();
        log.reclaim();
    }
    assert!(!log.has_unwritten(), "the deletes reached the disk");
    assert!(log.bytes() < 2 * SEGMENT, "{} bytes stay", log.bytes());
}

/// Sends `signal` (`STOP`, `CONT`) to nackd.
fn signal(nackd: &Process, signal: &str) {
    let sent = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(nackd.child.id().to_string())
        .status()
        .expect("kill(1)");
    assert!(sent.success(), "kill -{signal}");
}

/// `/readyz` and `/metrics`, read together.
async fn readyz_and_metrics(nackd: &Process) -> (common::ops::HttpResponse, common::ops::Scrape) {
    let readyz = common::ops::get(nackd.metrics, "/readyz").await;
    (readyz, scrape(nackd.metrics).await)
}

/// Ids of the messages held on disk: what a restart would bring back.
fn on_disk(store: &Path) -> usize {
    nackd::store::inspect::held(store).unwrap().len()
}

/// Issue 19: another process fills the store's disk while held messages
/// fire. Their completions (delete records) still reach the disk, written
/// into the space of the store's reserve; nothing more fires and `/readyz`
/// says why, so a SIGKILL then brings back exactly the messages not yet
/// delivered. Before, the broker confirmed each republish and nackd kept
/// firing while its deletes failed: after a restart nearly every delivered
/// message was delivered again. Once the disk has room again, firing
/// resumes by itself and every message arrives exactly once.
///
/// nackd is stopped (SIGSTOP) for the moment the ballast is written, so the
/// filler is done before nackd's first delete meets the full disk: a
/// filler that went on writing would take the reserve's space as nackd
/// frees it, which is the other reason to pause (completions unwritten,
/// covered by the writer's unit tests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_filled_by_another_process_pauses_firing_and_no_delivered_message_comes_back() {
    require_broker();
    let disk = SmallDisk::new(8);
    let store = disk.path().join("store");
    let (short, long) = (unique("filled-short"), unique("filled-long"));
    // Enough short retries that they are still firing when the disk fills
    // (one publish in flight at a time), and a few long ones that must
    // survive everything.
    let (n, k) = (1000u32, 5u32);
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("nackd.toml");
    std::fs::write(
        &cfg,
        format!(
            "[upstream]\naddress = \"{BROKER}\"\n[store]\npath = \"{}\"\nsegment_bytes = {SEGMENT}\n\
             [republish]\nconfirm_window = 1\n\
             [[policy]]\nqueues = [\"{short}\"]\ndelays = [\"2s\"]\n\
             [[policy]]\nqueues = [\"{long}\"]\ndelays = [\"10m\"]\n",
            store.display()
        ),
    )
    .unwrap();
    publish_n(&long, k, 64).await;
    publish_n(&short, n, 64).await;
    let nackd = Process::start(&cfg);

    // Every first delivery is nacked through nackd: all are held.
    let conn = connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr)).await;
    for (q, count) in [(&long, k), (&short, n)] {
        let ch = conn.create_channel().await.unwrap();
        let mut c = consume(&ch, q, Some(500)).await;
        for _ in 0..count {
            let d = next(&mut c, Duration::from_secs(10))
                .await
                .expect("a delivery");
            assert_eq!(retry_count(&d), 0, "a first delivery");
            d.nack(BasicNackOptions::default()).await.unwrap();
        }
        ch.close(200, "".into()).await.unwrap();
    }
    until(nackd.metrics, "all held", |s| {
        s.get("nackd_nacks_intercepted_total", &[]) == f64::from(n + k)
    })
    .await;
    conn.close(200, "".into()).await.unwrap();

    // The retries are consumed straight from the broker, so that killing
    // nackd never hands a delivery back: each id, how often it came.
    let delivered = std::sync::Arc::new(std::sync::Mutex::new(HashMap::<u32, u32>::new()));
    let consumer = {
        let delivered = delivered.clone();
        let short = short.clone();
        let conn = direct().await;
        tokio::spawn(async move {
            let ch = conn.create_channel().await.unwrap();
            let mut c = consume(&ch, &short, Some(100)).await;
            loop {
                let Some(d) = next(&mut c, Duration::from_secs(3600)).await else {
                    continue;
                };
                assert_eq!(retry_count(&d), 1, "a retry");
                let id = u32::from_be_bytes(d.data[..4].try_into().unwrap());
                *delivered.lock().unwrap().entry(id).or_default() += 1;
                d.ack(BasicAckOptions::default()).await.unwrap();
            }
        })
    };
    let count = || delivered.lock().unwrap().len();

    // While they fire, another process fills the disk.
    let held_short = [("vhost", "/"), ("queue", short.as_str())];
    let s = until(nackd.metrics, "firing", |s| {
        s.get("nackd_retries_confirmed_total", &[]) > 0.0
    })
    .await;
    signal(&nackd, "STOP");
    assert!(
        s.get("nackd_held_messages", &held_short) > 100.0,
        "still firing when the disk fills: raise n"
    );
    disk.fill("ballast");
    signal(&nackd, "CONT");

    // Firing pauses, says why, and what was handed out settles.
    let disk_full = [("reason", "disk_full")];
    let (readyz, s) = wait_for(
        Duration::from_secs(30),
        "firing paused, nothing pending",
        || readyz_and_metrics(&nackd),
        |(r, s)| {
            r.status == 503
                && s.get("nackd_firing_paused", &disk_full) == 1.0
                && s.sum("nackd_republish_pending_bytes") == 0.0
        },
    )
    .await;
    assert!(
        readyz.body.contains("firing paused: the disk is full"),
        "{}",
        readyz.body
    );
    let held = s.get("nackd_held_messages", &held_short);
    assert!(held > 0.0, "paused with messages held");
    let published = s.get("nackd_retries_published_total", &[]);
    // Nothing fires any more: every held message is overdue, so a pass
    // that fired would have within a few ms.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let s = scrape(nackd.metrics).await;
        assert_eq!(s.get("nackd_retries_published_total", &[]), published);
        assert_eq!(s.get("nackd_held_messages", &held_short), held);
    }
    // Every delivered message's completion is on disk (the reserve took
    // them): the store holds exactly what was not delivered.
    let held = held as usize;
    wait_for(
        Duration::from_secs(15),
        "completions on disk, deliveries in",
        || async { (on_disk(&store), count()) },
        |(disk, delivered)| *disk == held + k as usize && *delivered == n as usize - held,
    )
    .await;

    // Killed on the full disk: none of the delivered messages comes back,
    // and the new process does not fire either (no room for its reserve).
    nackd.kill9();
    let nackd = Process::start(&cfg);
    let (readyz, s) = readyz_and_metrics(&nackd).await;
    assert_eq!(readyz.status, 503, "{}", readyz.body);
    assert!(readyz.body.contains("firing paused"), "{}", readyz.body);
    assert_eq!(s.get("nackd_held_messages", &held_short), held as f64);
    assert_eq!(s.sum("nackd_held_messages"), (held + k as usize) as f64);
    assert_eq!(s.get("nackd_retries_published_total", &[]), 0.0);

    // Space comes back: firing resumes by itself, every message arrives,
    // each exactly once.
    std::fs::remove_file(disk.path().join("ballast")).unwrap();
    wait_for(
        Duration::from_secs(30),
        "ready, resumed, all delivered",
        || readyz_and_metrics(&nackd),
        |(r, s)| {
            r.status == 200
                && s.sum("nackd_firing_paused") == 0.0
                && s.get("nackd_held_messages", &held_short) == 0.0
        },
    )
    .await;
    wait_for(
        Duration::from_secs(15),
        "every retry delivered",
        || async { count() },
        |c| *c == n as usize,
    )
    .await;
    assert!(
        delivered.lock().unwrap().values().all(|c| *c == 1),
        "delivered twice: {:?}",
        delivered
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, c)| **c > 1)
            .collect::<Vec<_>>()
    );

    // Killed again once the last completions are on disk (so the window
    // between a confirm and its durable delete is closed): only the long
    // ones come back.
    wait_for(
        Duration::from_secs(15),
        "only the long ones on disk",
        || async { on_disk(&store) },
        |held| *held == k as usize,
    )
    .await;
    nackd.kill9();
    let nackd = Process::start(&cfg);
    let s = scrape(nackd.metrics).await;
    assert_eq!(s.sum("nackd_held_messages"), f64::from(k));
    assert_eq!(
        s.get("nackd_held_messages", &[("vhost", "/"), ("queue", &long)]),
        f64::from(k)
    );
    assert_eq!(s.get("nackd_store_damaged_bytes_total", &[]), 0.0);
    consumer.abort();
    drop(nackd);
    delete(&[&long, &short]).await;
}

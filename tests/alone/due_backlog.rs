//! Issue item 3: a due backlog (a restart after downtime, a broker outage)
//! used to read every due body into RAM at once. A nackd process restarted
//! on a store of N messages that fall due within seconds of each other
//! stays within `republish.max_pending_bytes` of the RAM it had before they
//! fell due, and delivers every one of them.
//!
//! `NACKD_BACKLOG_COUNT` sets N (default 100 000); the figure for 1 M in
//! the book (docs/src/guarantees.md, "A due backlog") was measured with
//! `NACKD_BACKLOG_COUNT=1000000 cargo test --release --test due_backlog -- --nocapture`.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use amq_protocol::protocol::basic::AMQPProperties;
use bytes::Bytes;
use common::ops::scrape;
use common::process::Process;
use common::*;
use lapin::options::*;
use nackd::store::{Held, Log, Options, Route};
use nackd_core::protocol::content::encode_header;

const BODY: usize = 1024;
/// The bound under test.
const MAX_PENDING: u64 = 4 * 1024 * 1024;
/// What else may grow while firing: the republisher's write buffer (1 MiB),
/// allocator slack, the ready ids.
const SLACK: u64 = 24 * 1024 * 1024;

/// Writes `n` held messages for `queue`, falling due from `from_ms` on at
/// 100 per millisecond (100 000/s, far faster than one republisher
/// drains them: the backlog builds up).
fn park(dir: &std::path::Path, queue: &str, n: u64, from_ms: u64) {
    let (mut log, _) = Log::open(dir, Options::default()).unwrap();
    let (vhost, queue): (Arc<str>, Arc<str>) = (Arc::from("/"), Arc::from(queue));
    for id in 1..=n {
        let body = Bytes::from(format!("{id:0>width$}", width = BODY));
        let held = Held {
            id,
            vhost: vhost.clone(),
            queue: queue.clone(),
            due_ms: from_ms + id / 100,
            retry: 1,
            route: Route::Queue,
            on_return: None,
            header: Bytes::from(encode_header(60, BODY as u64, &AMQPProperties::default())),
            body,
        };
        log.put(&held, None).unwrap();
        if id % 10_000 == 0 {
            log.commit().unwrap();
        }
    }
    log.commit().unwrap();
}

/// `VmRSS` and `VmHWM` (peak) of a process, in bytes.
fn rss(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or_else(|| panic!("{name} in /proc/{pid}/status"))
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1048576.0)
}

#[tokio::test]
async fn a_due_backlog_costs_ram_for_max_pending_bytes_not_for_the_backlog() {
    let _alone = common::alone();
    require_broker();
    let n: u64 = std::env::var("NACKD_BACKLOG_COUNT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let q = unique("backlog");
    let direct = direct().await;
    let ch = direct.create_channel().await.unwrap();
    declare_durable(&ch, &q).await;
    // Due once nackd has started: writing the store and recovering it
    // take about this long. The measurement needs nackd up before anything
    // falls due: on a machine loaded beside the test (builds, the cluster
    // tests) that can take longer, and then the store is written again
    // with twice the margin, up to twice.
    let mut margin_ms = 10_000 + n / 20;
    let mut attempt = 0;
    let (_dir, nackd, pid, before, s) = loop {
        attempt += 1;
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        // Off the runtime: lapin's heartbeats keep going meanwhile.
        let (dir_store, queue) = (store.clone(), q.clone());
        tokio::task::spawn_blocking(move || park(&dir_store, &queue, n, now_ms + margin_ms))
            .await
            .unwrap();
        let config = dir.path().join("nackd.toml");
        std::fs::write(
            &config,
            format!(
                "[upstream]\naddress = \"{BROKER}\"\n[store]\npath = \"{}\"\n[republish]\nmax_pending_bytes = {MAX_PENDING}\n[[policy]]\nqueues = [\"{q}\"]\ndelays = [\"1h\"]\n",
                store.display()
            ),
        )
        .unwrap();
        let nackd = Process::start(&config);
        let pid = nackd.child.id();
        let s = scrape(nackd.metrics).await;
        // Recovery read the log in segments; what firing costs is measured
        // from here: reset the peak (Linux: "5" to clear_refs).
        std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
        let (before, _) = rss(pid);
        if s.get("nackd_retries_published_total", &[]) == 0.0 {
            break (dir, nackd, pid, before, s);
        }
        assert!(
            attempt < 3,
            "measured before anything fell due, {attempt} times (the last with a margin of {margin_ms} ms)"
        );
        eprintln!("nackd fired before it was measured (margin {margin_ms} ms): again, with twice the margin");
        nackd.kill9();
        ch.queue_purge(q.as_str().into(), QueuePurgeOptions::default())
            .await
            .unwrap();
        margin_ms *= 2;
    };
    assert_eq!(s.sum("nackd_held_messages"), n as f64);
    let started = Instant::now();
    let mut peak_pending = 0.0f64;
    while message_count(&ch, &q).await < n as u32 {
        let s = scrape(nackd.metrics).await;
        peak_pending = peak_pending.max(s.sum("nackd_republish_pending_bytes"));
        if std::env::var_os("NACKD_BACKLOG_TRACE").is_some() {
            let (now, peak) = rss(pid);
            eprintln!(
                "{:>6.1}s rss {} peak {} held {} confirmed {} pending {} store {}",
                started.elapsed().as_secs_f64(),
                mib(now),
                mib(peak),
                s.sum("nackd_held_messages"),
                s.get("nackd_retries_confirmed_total", &[]),
                s.sum("nackd_republish_pending_bytes"),
                mib(s.get("nackd_store_bytes", &[]) as u64),
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(60 + n / 1000),
            "only {} of {n} delivered",
            message_count(&ch, &q).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let took = started.elapsed();
    let (after, peak) = rss(pid);
    eprintln!(
        "due backlog of {n} x {BODY} B: RSS before {} , peak {} (+{}), after {}; bodies pending at most {}; delivered in {took:?} (with waiting for the due time)",
        mib(before),
        mib(peak),
        mib(peak.saturating_sub(before)),
        mib(after),
        mib(peak_pending as u64),
    );
    assert!(
        peak_pending <= (MAX_PENDING + 64 * 1024) as f64,
        "{peak_pending}"
    );
    assert!(
        peak.saturating_sub(before) <= MAX_PENDING + SLACK,
        "RAM grew by {} for a due backlog (bound {} + {} slack)",
        mib(peak.saturating_sub(before)),
        mib(MAX_PENDING),
        mib(SLACK)
    );
    // The queue holds a message before its confirm reaches nackd: wait for
    // the last confirms (a loaded run scraped 99 667 of 100 000).
    let confirmed = wait_for(
        Duration::from_secs(30),
        "every retry confirmed",
        || async {
            scrape(nackd.metrics)
                .await
                .get("nackd_retries_confirmed_total", &[])
        },
        |c| *c >= n as f64,
    )
    .await;
    assert_eq!(confirmed, n as f64, "each once");
    nackd.kill9();
    assert_eq!(message_count(&ch, &q).await, n as u32, "none twice");
    ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
}

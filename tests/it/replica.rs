//! The replica against the local 3-node cluster, without the proxy around
//! it: the lease admits one holder per id, a standby takes over when the
//! holder's connection goes, and a store rebuilt from the stream holds
//! exactly what was appended and not completed.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::cluster::cluster;
use common::unique;
use nackd::metrics::Metrics;
use nackd::replica::{Config, Record, Replica, State, Target};
use nackd::retry::Clock;
use nackd::store::{Held, Log, Options, Route};

fn target() -> Target {
    Target {
        nodes: cluster().addrs().to_vec(),
        vhost: "/".into(),
        username: "guest".into(),
        password: "guest".into(),
        heartbeat: Duration::from_secs(2),
        cluster_size: Some(3),
        tls: None,
    }
}

fn config(instance: &str, dir: &std::path::Path) -> Config {
    config_with_slack(instance, dir, 64 << 20)
}

fn config_with_slack(instance: &str, dir: &std::path::Path, slack: u64) -> Config {
    Config {
        instance: instance.into(),
        group: instance.into(),
        target: target(),
        store_dir: dir.to_owned(),
        done_every: Duration::from_millis(50),
        adopt_after: Duration::from_secs(3600),
        adopt_part: 20_000,
        generation_slack: slack,
        previous_nodes: Vec::new(),
    }
}

fn held(id: u64) -> Held {
    Held {
        id,
        vhost: Arc::from("/"),
        queue: Arc::from("q"),
        due_ms: 1_000 + id,
        retry: 1,
        route: Route::Queue,
        on_return: None,
        header: Bytes::from_static(b"h"),
        body: Bytes::from(vec![id as u8; 100]),
    }
}

async fn state_is(replica: &Replica, want: State, within: Duration) {
    let mut state = replica.state();
    let waited = tokio::time::timeout(within, state.wait_for(|s| *s == want))
        .await
        .is_ok();
    assert!(
        waited,
        "replica state {:?}, wanted {want:?}",
        *state.borrow()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_store_is_rebuilt_from_the_stream_and_a_standby_takes_over() {
    let _all_up = cluster().steady().await;
    let id = unique("replica");
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (adopt, _adopted) = tokio::sync::mpsc::channel(16);
    let a = Replica::spawn(
        config(&id, dir_a.path()),
        Metrics::new(),
        adopt.clone(),
        Clock::start(),
    );
    let (log, _) = Log::open(dir_a.path(), Options::default()).unwrap();
    let synced = a.sync(log).await.unwrap();
    assert!(!synced.rebuilt, "a new id starts an empty stream");
    for n in 1..=50 {
        a.append(Record::put(&held(n), false)).await.unwrap();
    }
    for n in 1..=10 {
        a.done(n);
    }
    // A second process with the same id waits.
    let b = Replica::spawn(
        config(&id, dir_b.path()),
        Metrics::new(),
        adopt,
        Clock::start(),
    );
    let (log_b, _) = Log::open(dir_b.path(), Options::default()).unwrap();
    let b_sync = tokio::spawn({
        let b = b.clone();
        async move { b.sync(log_b).await }
    });
    state_is(&b, State::Standby, Duration::from_secs(20)).await;
    tokio::time::sleep(Duration::from_millis(300)).await; // the completions go out
    drop(a); // the holder goes: its connection closes, the lease is free
    drop(synced);
    let outcome = tokio::time::timeout(Duration::from_secs(30), b_sync)
        .await
        .expect("the standby takes over within seconds")
        .unwrap()
        .unwrap();
    assert!(outcome.rebuilt, "an empty store is rebuilt");
    let mut ids: Vec<u64> = outcome.recovered.held.iter().map(|h| h.0).collect();
    ids.sort_unstable();
    assert_eq!(ids, (11..=50).collect::<Vec<_>>());
    assert!(
        outcome.recovered.next_id > 50,
        "no id the stream names is handed out again: {}",
        outcome.recovered.next_id
    );
    assert_eq!(*b.state().borrow(), State::Active);
}

/// The stream stays bounded: once a generation holds much more than the
/// live set, the live puts move to a new one and the old one is deleted,
/// and a rebuild from the new one holds exactly the same messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_full_of_completed_messages_is_replaced_by_its_live_set() {
    let _all_up = cluster().steady().await;
    let id = unique("replica-gen");
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (adopt, _adopted) = tokio::sync::mpsc::channel(16);
    let metrics = Metrics::new();
    let a = Replica::spawn(
        config_with_slack(&id, dir_a.path(), 16 * 1024),
        metrics.clone(),
        adopt.clone(),
        Clock::start(),
    );
    let (log, _) = Log::open(dir_a.path(), Options::default()).unwrap();
    let synced = a.sync(log).await.unwrap();
    // 300 messages of about 250 bytes, all live in the store (as its writer
    // reports): no reason to compact yet.
    metrics.store_live_bytes.set(300 * 250);
    for n in 1..=300 {
        a.append(Record::put(&held(n), false)).await.unwrap();
    }
    // 280 of them completed: ~75 KB of stream for 5 KB live.
    metrics.store_live_bytes.set(20 * 250);
    for n in 1..=280 {
        a.done(n);
    }
    let began = std::time::Instant::now();
    while metrics.replica_generations.get() == 0 {
        assert!(began.elapsed() < Duration::from_secs(30), "no compaction");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(metrics.replica_generations.get(), 1);
    // Written after the switch: lands in the new generation only.
    for n in 301..=310 {
        a.append(Record::put(&held(n), false)).await.unwrap();
    }
    a.done(290);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let client = nackd::replica::client::Client::connect(&target(), 0, "test")
        .await
        .unwrap();
    assert!(
        !client.exists(&Config::generation(&id, 1)).await.unwrap(),
        "the old generation is deleted"
    );
    assert!(client.exists(&Config::generation(&id, 2)).await.unwrap());
    client.close().await;
    drop(a);
    drop(synced);
    let b = Replica::spawn(
        config(&id, dir_b.path()),
        Metrics::new(),
        adopt,
        Clock::start(),
    );
    let (log_b, _) = Log::open(dir_b.path(), Options::default()).unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(30), b.sync(log_b))
        .await
        .expect("the lease comes free")
        .unwrap();
    let mut ids: Vec<u64> = outcome.recovered.held.iter().map(|h| h.0).collect();
    ids.sort_unstable();
    let want: Vec<u64> = (281..=310).filter(|n| *n != 290).collect();
    assert_eq!(ids, want);
    assert!(outcome.recovered.next_id > 310);
}

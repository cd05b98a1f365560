//! Issue 21, item 5: an adoption in one step. An adopter killed half way
//! through an adoption leaves parks that never count; the next adopter
//! takes every message from the adopted stream again, and the killed
//! adopter's own messages with it. Real nackd processes on the 3-node
//! cluster, a real lapin consumer counting every message.

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::cluster::{config, consumer, delete, id_of, park_all, publish_range};
use common::cluster::cluster;
use common::ops::scrape;
use common::process::Process;
use common::*;
use lapin::options::*;

const ADOPTED: &str = "nackd_replica_adopted_messages_total";

/// Polls both adopters (each holding `own` messages of its own) until one
/// of them has parked at least `from` of the adoption (and not all `of`);
/// that one is killed. Returns the survivor and what the killed one had
/// parked.
async fn kill_the_adopter_half_way(
    b: Process,
    c: Process,
    own: f64,
    from: f64,
    of: f64,
) -> (Process, f64) {
    let began = Instant::now();
    loop {
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "nobody adopted the instance"
        );
        // Parked adopted messages are held (not scheduled yet).
        let (pb, pc) = (
            scrape(b.metrics).await.sum("nackd_held_messages") - own,
            scrape(c.metrics).await.sum("nackd_held_messages") - own,
        );
        let (adopter, survivor, parked) = match (pb >= from, pc >= from) {
            (true, _) => (b, c, pb),
            (_, true) => (c, b, pc),
            _ => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        adopter.kill9();
        assert!(
            parked < of,
            "the adoption ended before the kill ({parked} of {of} parked): nothing was cut off"
        );
        return (survivor, parked);
    }
}

/// Issue 21, item 5: A holds 3 000 messages and is killed; B or C adopts
/// it and is SIGKILLed half way through; the other one then adopts A and
/// the killed adopter. Every message comes back exactly once: none lost,
/// none twice (the killed adopter's parks are dropped, A's stream gives
/// them again), none early. The survivor parks A's 3 000 and the killed
/// adopter's own 100, and none of what the killed one had moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopter_killed_half_way_loses_nothing_and_fires_nothing_twice() {
    let _all_up = cluster().steady().await;
    let dir = tempfile::tempdir().unwrap();
    let q = unique("cluster-adopt-killed");
    let (gone, one, two) = (unique("gone"), unique("one"), unique("two"));
    let (n, own) = (3000u32, 100u32);
    let delay = Duration::from_secs(30);
    let a = Process::start(&config(dir.path(), &gone, &q, "30s", ""));
    publish_range(&q, 0..n).await;
    let mut nacked = park_all(&a, &q, n).await;
    let b = Process::start(&config(dir.path(), &one, &q, "30s", ""));
    publish_range(&q, n..n + own).await;
    nacked.extend(park_all(&b, &q, own).await);
    let c = Process::start(&config(dir.path(), &two, &q, "30s", ""));
    publish_range(&q, n + own..n + 2 * own).await;
    nacked.extend(park_all(&c, &q, own).await);
    a.kill9();
    let (survivor, parked) =
        kill_the_adopter_half_way(b, c, f64::from(own), f64::from(n / 4), f64::from(n)).await;
    eprintln!("adopter killed with {parked} of {n} parked");
    // Every message once: A's through the survivor's adoption, the killed
    // adopter's own too, the survivor's own from itself.
    let conn = connect(&format!("amqp://guest:guest@{}/%2f", survivor.addr)).await;
    let (_ch, mut deliveries) = consumer(&conn, &q, 500).await;
    let mut back: HashMap<u32, u32> = HashMap::new();
    let began = Instant::now();
    let mut last_new = Instant::now();
    while back.len() < nacked.len() || last_new.elapsed() < Duration::from_secs(5) {
        assert!(
            began.elapsed() < Duration::from_secs(120),
            "{} of {} came back",
            back.len(),
            nacked.len()
        );
        let Some(d) = next(&mut deliveries, Duration::from_secs(1)).await else {
            continue;
        };
        let id = id_of(&d.data);
        assert_eq!(retry_count(&d), 1, "message {id}");
        let since = Instant::now() - nacked[&id];
        assert!(
            since >= delay,
            "message {id} came back after {since:?}: early"
        );
        let seen = back.entry(id).or_default();
        *seen += 1;
        if *seen == 1 {
            last_new = Instant::now();
        }
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    let twice = back.values().filter(|n| **n > 1).count();
    eprintln!(
        "{} of {} came back, {twice} more than once",
        back.len(),
        nacked.len()
    );
    assert_eq!(back.len(), nacked.len(), "every message came back");
    assert_eq!(twice, 0, "no message came back twice");
    let s = scrape(survivor.metrics).await;
    assert_eq!(
        s.get(ADOPTED, &[]),
        f64::from(n + own),
        "the survivor parked A's messages and the killed adopter's own, none of its moved ones"
    );
    assert_eq!(s.sum("nackd_held_messages"), 0.0);
    // It saw the intent left open, and dropped the killed adopter's parks.
    survivor.wait_for_log(&["cut off half way (its adopter is gone)", &gone]);
    survivor.wait_for_log(&["never committed", &gone]);
    let _ = conn.close(200, "".into()).await;
    drop(survivor);
    delete(&q).await;
}

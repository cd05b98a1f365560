//! Issue 19: a real nackd process restarted on a large store, and stopped
//! gracefully under load.
//!
//! 1. Restarted (after a SIGKILL, and after a SIGTERM) on a store of
//!    1 000 000 held messages, nackd gets nacks at once, while it still
//!    recovers: none may pass through to the broker (with `requeue=false`
//!    and no dead-letter exchange the broker drops them), each comes back
//!    once after its delay, and the held million stays held.
//! 2. SIGTERM while a consumer nacks continuously: nackd exits within its
//!    grace period (plus the forced close), and after a restart every
//!    message comes back exactly once.
//!
//! `NACKD_RESTART_HELD` sets the size of item 1's store (default
//! 1 000 000). Measured in a debug build on 2 shared cores: a million
//! takes 5-9 s to write and 15-40 s for each nackd to read (as busy as the
//! machine is); each of the two tests took 38-108 s, the SIGTERM one also
//! reading the store back after its clean stop (12 s).

use crate::common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use amq_protocol::protocol::basic::AMQPProperties;
use bytes::Bytes;
use common::ops::{get, scrape, Scrape};
use common::process::Process;
use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::AMQPValue;
use lapin::BasicProperties;
use nackd::metrics::PassReason;
use nackd::store::{Held, Log, Options, Route};
use nackd_core::protocol::content::encode_header;
use nackd_core::session::ACK_GRACE;

/// Body size of every message here.
const BODY: usize = 100;
/// Fresh messages nacked at once after the restart.
const FRESH: u32 = 2_000;
/// Their delay.
const DELAY: Duration = Duration::from_millis(300);

/// Held messages in the store nackd restarts on.
fn held_count() -> u64 {
    std::env::var("NACKD_RESTART_HELD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A body of `BODY` bytes that starts with `id`.
fn body(id: u32) -> Vec<u8> {
    let mut body = vec![b'.'; BODY];
    body[..4].copy_from_slice(&id.to_be_bytes());
    body
}

fn id_of(body: &[u8]) -> u32 {
    u32::from_be_bytes(body[..4].try_into().unwrap())
}

/// Runs blocking `f` (a process start or stop, the store) off the runtime,
/// so lapin's connections keep being served meanwhile.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// Writes `n` held messages for `queue` (ids 1..=n, due at `due_ms + id`)
/// with the store's own API, committed in batches.
fn prefill(dir: &Path, queue: &str, n: u64, due_ms: u64) {
    let (mut log, _) = Log::open(dir, Options::default()).unwrap();
    let (vhost, queue): (Arc<str>, Arc<str>) = (Arc::from("/"), Arc::from(queue));
    let properties = AMQPProperties::default().with_delivery_mode(2);
    let header = Bytes::from(encode_header(60, BODY as u64, &properties));
    for id in 1..=n {
        let held = Held {
            id,
            vhost: vhost.clone(),
            queue: queue.clone(),
            due_ms: due_ms + id,
            retry: 1,
            route: Route::Queue,
            on_return: None,
            header: header.clone(),
            body: Bytes::from(body(id as u32)),
        };
        log.put(&held, None).unwrap();
        if id % 20_000 == 0 {
            log.commit().unwrap();
        }
    }
    log.commit().unwrap();
}

/// A config with a policy for each `(queue, delay)`, and `extra` TOML.
fn config(dir: &Path, policies: &[(&str, &str)], extra: &str) -> PathBuf {
    let mut text = format!(
        "[upstream]\naddress = \"{BROKER}\"\n[store]\npath = \"{}\"\n{extra}\n",
        dir.join("store").display()
    );
    for (queue, delay) in policies {
        text.push_str(&format!(
            "[[policy]]\nqueues = [\"{queue}\"]\ndelays = [\"{delay}\"]\nrequeue = \"delay\"\n"
        ));
    }
    let path = dir.join("nackd.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Publishes ids `0..n` to `q` straight to the broker, confirmed.
async fn publish_ids(q: &str, n: u32) {
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::new();
    for id in 0..n {
        let confirm = ch
            .basic_publish(
                "".into(),
                q.into(),
                BasicPublishOptions::default(),
                &body(id),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap();
        confirms.push(confirm);
    }
    for confirm in confirms {
        assert!(confirm.await.unwrap().is_ack());
    }
    conn.close(200, "".into()).await.unwrap();
}

async fn declare(queues: &[&str]) {
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    for q in queues {
        declare_durable(&ch, q).await;
    }
    conn.close(200, "".into()).await.unwrap();
}

async fn delete(queues: &[&str]) {
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    delete_queues(&ch, queues).await;
}

/// Passed nacks by reason, the nonzero ones.
fn passed(s: &Scrape) -> Vec<(&'static str, f64)> {
    PassReason::ALL
        .iter()
        .map(|r| {
            let label = r.label();
            (
                label,
                s.get("nackd_nacks_passed_total", &[("reason", label)]),
            )
        })
        .filter(|(_, n)| *n > 0.0)
        .collect()
}

fn held_in(s: &Scrape, q: &str) -> f64 {
    s.get("nackd_held_messages", &[("vhost", "/"), ("queue", q)])
}

fn header_i64(d: &lapin::message::Delivery, name: &str) -> Option<i64> {
    match d.properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        _ => None,
    }
}

/// How the nackd that held the store ended before the restart.
#[derive(Clone, Copy, Debug)]
enum End {
    Sigkill,
    Sigterm,
}

/// What the restarted nackd did with the fresh nacks.
struct Fresh {
    /// Per id: when the consumer sent its nack.
    nacked: HashMap<u32, Instant>,
    /// Per id, each time it came back: when, `x-retry-count`, `x-retry-delay-ms`.
    back: HashMap<u32, Vec<(Instant, i64, Option<i64>)>>,
    /// `/readyz` and the held count of the old queue right after the last nack.
    at_last_nack: (String, f64),
    /// When the last nack went, from the restart.
    last_nack: Duration,
}

/// Consumes `fresh` through the restarted nackd at once: nacks each first
/// delivery (`requeue=false`), acks each retry, until every one came back
/// or every one is accounted for (came back or passed through).
async fn nack_fresh_at_once(nackd: &Process, fresh: &str, restarted: Instant) -> Fresh {
    let conn = connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr)).await;
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, fresh, Some(500)).await;
    let mut nacked = HashMap::new();
    let mut back: HashMap<u32, Vec<_>> = HashMap::new();
    let mut at_last_nack = None;
    let mut last_nack = Duration::ZERO;
    let began = Instant::now();
    while back.len() < FRESH as usize {
        let Some(d) = next(&mut c, Duration::from_secs(1)).await else {
            let s = scrape(nackd.metrics).await;
            let passed = s.sum("nackd_nacks_passed_total") as usize;
            if nacked.len() == FRESH as usize && back.len() + passed >= FRESH as usize {
                break; // all accounted for: the rest will never come
            }
            assert!(
                began.elapsed() < Duration::from_secs(180),
                "{} nacked, {} back, {passed} passed after {:?}",
                nacked.len(),
                back.len(),
                began.elapsed()
            );
            continue;
        };
        let id = id_of(&d.data);
        match retry_count(&d) {
            0 => {
                assert!(
                    nacked.insert(id, Instant::now()).is_none(),
                    "{id} delivered again without a retry count"
                );
                d.nack(BasicNackOptions {
                    requeue: false,
                    multiple: false,
                })
                .await
                .unwrap();
                if nacked.len() == FRESH as usize {
                    last_nack = restarted.elapsed();
                    let ready = get(nackd.metrics, "/readyz").await.body;
                    let s = scrape(nackd.metrics).await;
                    at_last_nack = Some((ready, s.sum("nackd_held_messages")));
                }
            }
            n => {
                let delay = header_i64(&d, "x-retry-delay-ms");
                back.entry(id).or_default().push((Instant::now(), n, delay));
                d.ack(BasicAckOptions::default()).await.unwrap();
            }
        }
    }
    // The acks are applied before the close completes.
    conn.close(200, "".into()).await.unwrap();
    Fresh {
        nacked,
        back,
        at_last_nack: at_last_nack.expect("every fresh message was delivered"),
        last_nack,
    }
}

/// The stopped store holds ids 1..=n of `queue`, due at `due_ms + id`
/// as pre-filled, and nothing else; no damage, no torn tail.
fn assert_holds_exactly(store: &Path, queue: &str, n: u64, due_ms: u64) {
    let (_, rec) = Log::open(store, Options::default()).unwrap();
    assert_eq!(
        (rec.damage.len(), rec.torn_tail.is_some()),
        (0, false),
        "damage, torn tail after a clean stop"
    );
    let mut ids: Vec<(u64, u64)> = rec.held.iter().map(|(id, due, _)| (*id, *due)).collect();
    ids.sort_unstable();
    assert_eq!(ids.len() as u64, n, "held in the store after the stop");
    assert!(
        ids.iter()
            .zip(1..)
            .all(|(&(id, due), want)| id == want && due == due_ms + id),
        "the held ones are the pre-filled ids with their due times"
    );
    let queues: HashSet<&str> = rec
        .meta
        .iter()
        .map(|m| &*rec.queues[m.queue as usize].1)
        .collect();
    assert_eq!(queues, HashSet::from([queue]));
}

/// Item 1, for one way the previous nackd ended.
async fn restart_with_a_large_store_takes_nacks_at_once(end: End) {
    require_broker();
    let total = Instant::now();
    let held = held_count();
    let (old, fresh) = (unique("restart-held"), unique("restart-fresh"));
    declare(&[&old, &fresh]).await;
    publish_ids(&fresh, FRESH).await;
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let due = now_ms() + 3_600_000;
    let began = Instant::now();
    let (s, q) = (store.clone(), old.clone());
    blocking(move || prefill(&s, &q, held, due)).await;
    let filled = began.elapsed();
    let delay = format!("{}ms", DELAY.as_millis());
    let cfg = config(dir.path(), &[(&old, "1h"), (&fresh, &delay)], "");

    // The nackd that holds them, then ends as `end` says.
    let began = Instant::now();
    let c = cfg.clone();
    let first = blocking(move || Process::start(&c)).await;
    // It may intercept before it has read its older segments: wait for
    // what it holds, not for `/readyz`.
    wait_for(
        Duration::from_secs(180),
        "the first nackd holds them all",
        || scrape(first.metrics),
        |s| held_in(s, &old) == held as f64,
    )
    .await;
    let first_recovery = began.elapsed();
    let stopped = match end {
        End::Sigkill => {
            blocking(move || first.kill9()).await;
            None
        }
        End::Sigterm => {
            let (status, took) = blocking(move || first.terminate(Duration::from_secs(60))).await;
            assert!(status.success(), "{status:?}");
            Some(took)
        }
    };

    // The restart: nacks as soon as the AMQP port accepts.
    let restarted = Instant::now();
    let c = cfg.clone();
    let nackd = blocking(move || Process::start_listening(&c)).await;
    let listening = restarted.elapsed();
    let seen = nack_fresh_at_once(&nackd, &fresh, restarted).await;
    let all_back = restarted.elapsed();
    let s = scrape(nackd.metrics).await;
    let (ready_then, held_then) = &seen.at_last_nack;
    eprintln!(
        "{end:?}, {held} held: prefill {filled:?}, first recovery {first_recovery:?}, \
         stop {stopped:?}; restart: listening after {listening:?}, last of {FRESH} nacks \
         after {:?} (readyz then {ready_then}, held then {held_then}), {} back after {all_back:?}; \
         passed {:?}",
        seen.last_nack,
        seen.back.len(),
        passed(&s)
    );
    assert!(
        *held_then < held as f64,
        "the nacks came after the recovery ({ready_then}, {held_then} held): \
         this run did not test a restart"
    );
    assert_eq!(
        passed(&s),
        vec![],
        "nacks passed through to the broker (requeue=false, no dead-letter \
         exchange: dropped); {} of {FRESH} came back",
        seen.back.len()
    );
    let missing: Vec<u32> = (0..FRESH)
        .filter(|id| !seen.back.contains_key(id))
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {FRESH} never came back: {:?}…",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    let mut early = Vec::new();
    for (id, copies) in &seen.back {
        assert_eq!(copies.len(), 1, "{id} came back {} times", copies.len());
        let (at, retry, delay) = copies[0];
        assert_eq!((retry, delay), (1, Some(DELAY.as_millis() as i64)), "{id}");
        let waited = at.duration_since(seen.nacked[id]);
        if waited < DELAY {
            early.push((*id, waited));
        }
    }
    assert!(early.is_empty(), "back before their delay: {early:?}");
    let latest = (seen.back.iter())
        .map(|(id, copies)| copies[0].0.duration_since(seen.nacked[id]))
        .max()
        .unwrap_or_default();
    eprintln!("{end:?}: each back once, none early, the latest {latest:?} after its nack");

    // The held million: recovered, still held, none fired.
    let s = wait_for(
        Duration::from_secs(180),
        "the old ones held and the fresh ones completed",
        || scrape(nackd.metrics),
        |s| {
            held_in(s, &old) == held as f64
                && held_in(s, &fresh) == 0.0
                && s.get("nackd_retries_confirmed_total", &[]) == f64::from(FRESH)
        },
    )
    .await;
    assert_eq!(
        s.get("nackd_retries_published_total", &[]),
        f64::from(FRESH),
        "only the fresh ones, each once"
    );
    eprintln!(
        "{end:?}: all {held} held again {:?} after the restart",
        restarted.elapsed()
    );
    match end {
        // Like the first life: what it held is what the metrics said.
        End::Sigkill => blocking(move || nackd.kill9()).await,
        // A clean stop commits exactly the held million (read back below:
        // 12 s for a million in a debug build, so only on this path).
        End::Sigterm => {
            let (status, _) = blocking(move || nackd.terminate(Duration::from_secs(60))).await;
            assert!(status.success(), "{status:?}");
            let q = old.clone();
            blocking(move || assert_holds_exactly(&store, &q, held, due)).await;
        }
    }
    eprintln!("{end:?}: whole test {:?}", total.elapsed());
    delete(&[&old, &fresh]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_sigkill_with_a_million_held_nacks_are_held_at_once() {
    let _alone = common::alone();
    restart_with_a_large_store_takes_nacks_at_once(End::Sigkill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_sigterm_with_a_million_held_nacks_are_held_at_once() {
    let _alone = common::alone();
    restart_with_a_large_store_takes_nacks_at_once(End::Sigterm).await;
}

/// Publishes ids from `from` on, straight to the broker at about `rate`/s,
/// each confirmed, until `stop`; returns the first id not published.
async fn publisher(q: String, from: u32, rate: u64, stop: Arc<AtomicBool>) -> u32 {
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    let mut n = from;
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let confirm = ch
            .basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                &body(n),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack(), "publish {n}: {confirm:?}");
        n += 1;
    }
    conn.close(200, "".into()).await.unwrap();
    n
}

/// What the consumer of the first nackd saw until nackd closed it.
#[derive(Debug, Default)]
struct Load {
    /// Ids whose nack (`requeue=false`) lapin sent.
    nacked: HashSet<u32>,
    /// Ids that came back before the stop (left unsettled: the broker
    /// hands them to the next consumer).
    early: HashSet<u32>,
    /// How its connection ended.
    end: String,
}

/// Consumes `q` through nackd at `addr`, nacking every first delivery
/// with `requeue=false`, until nackd closes the connection.
async fn nack_continuously(addr: std::net::SocketAddr, q: String, load: Arc<Mutex<Load>>) {
    let conn = connect(&format!("amqp://guest:guest@{addr}/%2f")).await;
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, &q, Some(50)).await;
    let end = loop {
        let d = match c.next().await {
            None => break "consumer ended".to_string(),
            Some(Err(e)) => break e.to_string(),
            Some(Ok(d)) => d,
        };
        let id = id_of(&d.data);
        if retry_count(&d) > 0 {
            load.lock().unwrap().early.insert(id);
            continue;
        }
        let nack = BasicNackOptions {
            requeue: false,
            multiple: false,
        };
        match d.nack(nack).await {
            Ok(_) => load.lock().unwrap().nacked.insert(id),
            Err(e) => break e.to_string(),
        };
    };
    load.lock().unwrap().end = end;
}

/// Messages in the queue before the graceful stop test's consumer starts.
const BACKLOG: u32 = 8_000;
/// How long the graceful stop test gives open sessions.
const GRACE: Duration = Duration::from_secs(2);
/// What a forced close and the rest of the stop may add to it: the held
/// messages acked upstream, `ACK_GRACE` for the broker to apply them, the
/// close handshakes, the engine stopped (store committed, writer joined).
const STOP_AFTER_GRACE: Duration = ACK_GRACE.saturating_add(Duration::from_secs(1));

/// Item 2: SIGTERM while a consumer nacks continuously and a publisher
/// feeds it. nackd acks what it holds upstream, commits the store and exits
/// within its grace period plus the forced close; after a restart every
/// message arrives exactly once: the held ones as retries, the rest from
/// the broker. A graceful stop is in none of the windows for a
/// second delivery (docs/src/guarantees.md, "When a message can be delivered twice": 6 is a kill
/// or a lost broker connection, 7 a client's own close, which waits its
/// `ACK_GRACE` too, but a classic queue applies a channel's acks in order
/// before its close), so no duplicate at all is allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_under_nack_load_loses_nothing_and_duplicates_nothing() {
    let _alone = common::alone();
    require_broker();
    let q = unique("graceful");
    declare(&[&q]).await;
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    // Longer than the load and the stop: what is held at the stop is
    // still held when nackd exits, and comes back from the restarted one.
    let delay = Duration::from_secs(8);
    let grace = format!("[limits]\nshutdown_grace = \"{}s\"", GRACE.as_secs());
    let cfg = config(
        dir.path(),
        &[(&q, &format!("{}s", delay.as_secs()))],
        &grace,
    );
    let c = cfg.clone();
    let nackd = blocking(move || Process::start(&c)).await;
    // A backlog, so that the consumer nacks as fast as it can (nacks are
    // on the wire when nackd closes it), and a publisher feeding it more.
    publish_ids(&q, BACKLOG).await;
    let stop_publishing = Arc::new(AtomicBool::new(false));
    let producer = tokio::spawn(publisher(q.clone(), BACKLOG, 300, stop_publishing.clone()));
    let load = Arc::new(Mutex::new(Load::default()));
    let consumer = tokio::spawn(nack_continuously(nackd.addr, q.clone(), load.clone()));
    let before = wait_for(
        Duration::from_secs(60),
        "300 nacks held under load",
        || scrape(nackd.metrics),
        |s| s.get("nackd_nacks_intercepted_total", &[]) >= 300.0,
    )
    .await;
    assert_eq!(passed(&before), vec![], "nothing passed through under load");

    let (status, took) = blocking(move || nackd.terminate(Duration::from_secs(30))).await;
    assert!(status.success(), "{status:?}");
    // The consumer is still connected: nackd waits the whole grace, then
    // closes it.
    assert!(
        took >= GRACE && took <= GRACE + STOP_AFTER_GRACE,
        "exited {took:?} after SIGTERM, grace {GRACE:?}"
    );
    tokio::time::timeout(Duration::from_secs(10), consumer)
        .await
        .expect("the consumer's connection was closed by nackd")
        .unwrap();
    // The publisher went on during the stop; it stops now.
    stop_publishing.store(true, Ordering::Relaxed);
    let n = producer.await.unwrap();
    let load = std::mem::take(&mut *load.lock().unwrap());

    // What the stopped nackd holds: committed, no torn tail.
    let s = store.clone();
    let (held, rec) = blocking(move || {
        let held = nackd::store::inspect::held(&s).unwrap();
        let (_, rec) = Log::open(&s, Options::default()).unwrap();
        (
            held,
            (rec.held.len(), rec.damage.len(), rec.torn_tail.is_some()),
        )
    })
    .await;
    let held: HashSet<u32> = held.iter().map(|h| id_of(&h.body)).collect();
    assert_eq!(rec, (held.len(), 0, false), "held, damage, torn tail");
    assert!(!held.is_empty());
    assert!(
        held.is_subset(&load.nacked),
        "nackd holds only what was nacked: {:?}",
        held.difference(&load.nacked).take(10).collect::<Vec<_>>()
    );
    eprintln!(
        "graceful stop: {n} published, {} nacked, {} held at the exit, {} back before it, \
         {} claimed before SIGTERM; exit {took:?} after SIGTERM (grace {GRACE:?}); \
         consumer: {}",
        load.nacked.len(),
        held.len(),
        load.early.len(),
        before.get("nackd_nacks_intercepted_total", &[]),
        load.end
    );

    // The restart: every message once, the held ones as their retry.
    let nackd = blocking(move || Process::start(&cfg)).await;
    // It intercepts before it has read its older segments: wait for them.
    wait_for(
        Duration::from_secs(60),
        "what the stopped nackd held, held again",
        || scrape(nackd.metrics),
        |s| s.sum("nackd_held_messages") == held.len() as f64,
    )
    .await;
    let conn = connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr)).await;
    let ch = conn.create_channel().await.unwrap();
    let mut c = consume(&ch, &q, Some(200)).await;
    let mut seen: HashMap<u32, Vec<i64>> = HashMap::new();
    let direct = direct().await;
    let broker = direct.create_channel().await.unwrap();
    let began = Instant::now();
    // Until nothing more can come: every held one republished and
    // confirmed, nothing ready in the queue, and no delivery for two turns
    // in a row (one in flight when the first turn looked arrives first).
    let mut drained_once = false;
    loop {
        assert!(
            began.elapsed() < delay + Duration::from_secs(60),
            "{} of {n} delivered after the restart",
            seen.len()
        );
        let Some(d) = next(&mut c, Duration::from_millis(500)).await else {
            let s = scrape(nackd.metrics).await;
            let drained = s.sum("nackd_held_messages") == 0.0
                && s.get("nackd_retries_confirmed_total", &[]) == held.len() as f64
                && message_count(&broker, &q).await == 0;
            if drained && drained_once {
                break;
            }
            drained_once = drained;
            continue;
        };
        drained_once = false;
        seen.entry(id_of(&d.data))
            .or_default()
            .push(retry_count(&d));
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    // A copy the broker delivered but the test has not read yet would be
    // requeued by this close, and counted below.
    ch.close(200, "".into()).await.unwrap();
    let left = message_count(&broker, &q).await;
    let s = scrape(nackd.metrics).await;
    assert_eq!(
        passed(&s),
        vec![],
        "nothing passed through after the restart"
    );
    assert_eq!(
        s.get("nackd_retries_published_total", &[]),
        held.len() as f64,
        "each held one republished once"
    );
    let missing: Vec<u32> = (0..n).filter(|id| !seen.contains_key(id)).collect();
    let twice: Vec<(&u32, &Vec<i64>)> = seen.iter().filter(|(_, v)| v.len() > 1).collect();
    let stray: Vec<&u32> = seen.keys().filter(|id| **id >= n).collect();
    assert!(missing.is_empty(), "lost: {missing:?}");
    assert!(twice.is_empty(), "delivered twice: {twice:?}");
    assert!(stray.is_empty(), "never published: {stray:?}");
    assert_eq!(left, 0, "left in the queue");
    for id in &held {
        assert_eq!(seen[id], vec![1], "{id} was held: it comes back as retry 1");
    }
    drop(nackd);
    delete(&[&q]).await;
}

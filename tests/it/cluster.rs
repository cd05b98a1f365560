//! nackd on a 3-node RabbitMQ cluster (scripts/cluster), with its replica:
//! no nackd host and no broker node is a single point of failure. Real
//! nackd processes, real nodes stopped and killed, real lapin clients.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::cluster;
use common::ops::{get, scrape};
use common::process::Process;
use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};

/// A nackd config in front of the whole cluster, with a replica.
pub(super) fn config(dir: &Path, instance: &str, queue: &str, delay: &str, extra: &str) -> PathBuf {
    config_listing(dir, instance, queue, delay, extra, &nodes())
}

/// The cluster's nodes, as [`config`] lists them in `upstream.addresses`.
fn nodes() -> Vec<String> {
    cluster().addrs().iter().map(|a| a.to_string()).collect()
}

/// [`config`], with `nodes` as `upstream.addresses`.
fn config_listing(
    dir: &Path,
    instance: &str,
    queue: &str,
    delay: &str,
    extra: &str,
    nodes: &[String],
) -> PathBuf {
    let path = dir.join(format!("{instance}.toml"));
    std::fs::write(
        &path,
        format!(
            "[upstream]\naddresses = {}\n[store]\npath = \"{}\"\n\
             [replica]\ninstance = \"{instance}\"\ngroup = \"{queue}\"\nheartbeat = \"1s\"\nadopt_after = \"5s\"\ncluster_size = 3\n{extra}\n\
             [[policy]]\nqueues = [\"{queue}\"]\ndelays = [\"{delay}\"]\n",
            toml_list(nodes),
            dir.join(format!("{instance}.store")).display()
        ),
    )
    .unwrap();
    path
}

/// `list` as a TOML array of strings.
fn toml_list(list: &[String]) -> String {
    let quoted: Vec<String> = list.iter().map(|a| format!("\"{a}\"")).collect();
    format!("[{}]", quoted.join(", "))
}

/// A quorum queue led by the node it is declared through (so a test knows
/// where its leader is: on node 1, where [`publish`] declares it).
fn quorum() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args.insert(
        "x-queue-leader-locator".into(),
        AMQPValue::LongString("client-local".into()),
    );
    args
}

/// Declares quorum queue `q` and publishes `n` numbered messages, confirmed.
async fn publish(q: &str, n: u32) {
    publish_range(q, 0..n).await
}

/// Publishes messages numbered `ids` to quorum queue `q`, confirmed.
pub(super) async fn publish_range(q: &str, ids: std::ops::Range<u32>) {
    let conn = cluster().connect(1).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(q.into(), durable, quorum()).await.unwrap();
    // Every publish in flight before the first confirm is awaited: one at
    // a time, each waits for a Raft commit on the three nodes (1 000 took
    // 2.5 to 2.8 s on a loaded machine, 2026-11-30), time taken out of the
    // tests' fixed delays.
    let mut confirms = Vec::new();
    for i in ids {
        let confirm = ch
            .basic_publish(
                "".into(),
                q.into(),
                BasicPublishOptions::default(),
                &i.to_be_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap();
        confirms.push(confirm);
    }
    for confirm in confirms {
        assert!(confirm.await.unwrap().is_ack());
    }
    let _ = conn.close(200, "".into()).await;
}

pub(super) async fn delete(q: &str) {
    let conn = cluster().connect(2).await;
    let ch = conn.create_channel().await.unwrap();
    let _ = ch
        .queue_delete(q.into(), QueueDeleteOptions::default())
        .await;
}

/// Messages of `q` delivered and not yet acked, as the broker counts them
/// (`rabbitmqctl list_queues`, asked of node 1: a metric the queue's
/// leader refreshes every few seconds).
async fn unacked(q: &str) -> u32 {
    let out = cluster()
        .ctl(
            1,
            &[
                "list_queues",
                "-q",
                "--no-table-headers",
                "name",
                "messages_unacknowledged",
            ],
        )
        .await;
    out.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() == 2 && f[0] == q)
        .map(|f| f[1].parse().unwrap())
        .unwrap_or_else(|| panic!("no queue {q} in {out}"))
}

/// Waits until the broker applied nackd's acks on a channel that stays
/// open: `left` of `q`'s deliveries still unacked (those nackd did not
/// hold). Each probe starts a `rabbitmqctl` (an Erlang VM): one a second,
/// not back to back on a loaded machine.
pub(super) async fn acks_applied(q: &str, left: u32) {
    wait_for(
        Duration::from_secs(90),
        "the broker to apply nackd's acks",
        || async {
            let n = unacked(q).await;
            if n != left {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            n
        },
        |n| *n == left,
    )
    .await;
}

pub(super) fn id_of(data: &[u8]) -> u32 {
    u32::from_be_bytes(data[..4].try_into().unwrap())
}

pub(super) async fn consumer(
    conn: &Connection,
    q: &str,
    prefetch: u16,
) -> (Channel, lapin::Consumer) {
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(prefetch, BasicQosOptions::default())
        .await
        .unwrap();
    let c = ch
        .basic_consume(
            q.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    (ch, c)
}

/// Nacks every message of `q` once through `nackd`, recording when; waits
/// until nackd holds all `n`, then until the broker applied nackd's acks.
pub(super) async fn park_all(nackd: &Process, q: &str, n: u32) -> HashMap<u32, Instant> {
    let parking = nack_all(nackd, q, n).await;
    // Closed only once the broker applied nackd's acks: a quorum queue
    // applies settles behind other work, and a close right behind them can
    // overtake them and requeue messages nackd holds too (guarantees,
    // window 7; rabbitmq-server#10327): a CI run loaded by the rest of the
    // suite closed at once and found 45 of 3 000 back in the queue. The
    // count is the broker's metric (refreshed every few seconds); whether
    // any message came twice, the tests check after.
    acks_applied(q, 0).await;
    parking.close().await
}

/// A consumer through nackd that nacked every message it was given; its
/// channel stays open until the broker applied nackd's acks.
pub(super) struct Parking {
    conn: Connection,
    channel: Channel,
    pub(super) nacked: HashMap<u32, Instant>,
}

impl Parking {
    /// Closes the consumer: only once the broker applied nackd's acks
    /// (see [`park_all`]).
    pub(super) async fn close(self) -> HashMap<u32, Instant> {
        let _ = self.channel.close(200, "".into()).await;
        let _ = self.conn.close(200, "".into()).await;
        self.nacked
    }
}

/// Nacks every message of `q` once through `nackd`, recording when; waits
/// until nackd holds all `n` and counts them intercepted (each ack
/// upstream is written in the turn that counts it).
pub(super) async fn nack_all(nackd: &Process, q: &str, n: u32) -> Parking {
    let before = scrape(nackd.metrics)
        .await
        .get("nackd_nacks_intercepted_total", &[]);
    let conn = connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr)).await;
    let (channel, mut c) = consumer(&conn, q, 500).await;
    let mut nacked = HashMap::new();
    while nacked.len() < n as usize {
        let d = next(&mut c, Duration::from_secs(20))
            .await
            .unwrap_or_else(|| panic!("{} of {n} delivered", nacked.len()));
        assert_eq!(retry_count(&d), 0, "a retry came back while parking");
        nacked.insert(id_of(&d.data), Instant::now());
        d.nack(BasicNackOptions::default()).await.unwrap();
    }
    // No more deliveries on this channel (retries due while it waits below
    // go to the queue), but the channel stays open: its nacked deliveries
    // are unacked until the broker applies nackd's acks.
    channel
        .basic_cancel(c.tag(), BasicCancelOptions::default())
        .await
        .unwrap();
    let held = [("vhost", "/"), ("queue", q)];
    common::ops::until(nackd.metrics, "all held", |s| {
        s.get("nackd_held_messages", &held) == f64::from(n)
            && s.get("nackd_nacks_intercepted_total", &[]) == before + f64::from(n)
    })
    .await;
    Parking {
        conn,
        channel,
        nacked,
    }
}

/// How long the adoption and takeover tests hold their messages, in config
/// and as a `Duration`: long enough that nacking them all through the
/// holder ([`park_then_kill`]) ends well before the first is due.
const ADOPTED_DELAY: Duration = Duration::from_secs(20);
const ADOPTED_DELAY_CONFIG: &str = "20s";

/// Parks `n` messages of `q` in `holder` and SIGKILLs it while it still
/// holds every one: a test of adoption or takeover proves nothing once the
/// holder fired them itself. The holder is frozen (SIGSTOP) as soon as it
/// holds them all, before the first is due (asserted), so it fires none
/// while the broker applies its acks ([`park_all`] says why that wait):
/// with the kill only after that wait, a CI run loaded by the image's
/// build took more than the 20 s delay from the first nack to the kill.
/// Returns when each message was nacked, and when the holder died.
async fn park_then_kill(
    holder: Process,
    q: &str,
    n: u32,
    delay: Duration,
) -> (HashMap<u32, Instant>, Instant) {
    let parking = nack_all(&holder, q, n).await;
    signal(&holder, "STOP");
    before_due(&parking.nacked, delay, "the holder stopped");
    acks_applied(q, 0).await;
    holder.kill9();
    let died = Instant::now();
    // Its client connection ends with the holder; nothing to close.
    drop(parking.channel);
    drop(parking.conn);
    (parking.nacked, died)
}

/// Asserts that what `happened` (just now) came before the first message of
/// `nacked` was due, `delay` after its nack: else the process that held
/// them may have fired some, and the test would prove nothing.
pub(super) fn before_due(nacked: &HashMap<u32, Instant>, delay: Duration, happened: &str) {
    let first = *nacked.values().min().expect("messages parked");
    let after = first.elapsed();
    assert!(
        after < delay,
        "{happened} {after:?} after the first nack, past the {delay:?} delay: it may have fired before"
    );
}

/// Consumes the retries of `q` through `addr` until every id of `nacked`
/// came back once, acking each; none may come before `delay` after its nack.
async fn all_back(
    addr: std::net::SocketAddr,
    q: &str,
    nacked: &HashMap<u32, Instant>,
    delay: Duration,
    limit: Duration,
) {
    let conn = connect(&format!("amqp://guest:guest@{addr}/%2f")).await;
    let (_ch, mut c) = consumer(&conn, q, 500).await;
    let mut back: HashMap<u32, u32> = HashMap::new();
    let began = Instant::now();
    while back.len() < nacked.len() {
        assert!(
            began.elapsed() < limit,
            "{} of {} came back",
            back.len(),
            nacked.len()
        );
        let Some(d) = next(&mut c, Duration::from_secs(5)).await else {
            continue;
        };
        let id = id_of(&d.data);
        let at = Instant::now();
        assert_eq!(retry_count(&d), 1, "message {id}");
        let since = at - nacked[&id];
        assert!(
            since >= delay,
            "message {id} came back after {since:?}: early"
        );
        *back.entry(id).or_default() += 1;
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert!(
        next(&mut c, Duration::from_secs(2)).await.is_none(),
        "a message came back twice"
    );
    assert!(back.values().all(|n| *n == 1));
    let _ = conn.close(200, "".into()).await;
}

/// Issue 13: SIGKILL nackd and delete its store directory while it holds
/// thousands of messages; started again with the same id on an empty
/// directory, it rebuilds them from its stream: all come back, once, none
/// early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_lost_with_its_disk_loses_nothing() {
    let _all_up = cluster().steady().await;
    let dir = tempfile::tempdir().unwrap();
    let (q, id) = (unique("cluster-lost"), unique("host"));
    let delay = Duration::from_secs(20);
    let cfg = config(dir.path(), &id, &q, "20s", "");
    publish(&q, 2000).await;
    let nackd = Process::start(&cfg);
    let (nacked, _) = park_then_kill(nackd, &q, 2000, delay).await;
    std::fs::remove_dir_all(dir.path().join(format!("{id}.store"))).unwrap();
    let nackd = Process::start(&cfg);
    let s = scrape(nackd.metrics).await;
    assert_eq!(s.get("nackd_replica_rebuilt_messages_total", &[]), 2000.0);
    all_back(nackd.addr, &q, &nacked, delay, Duration::from_secs(60)).await;
    drop(nackd);
    delete(&q).await;
}

/// Issue 13: an instance killed for good has its messages adopted by a
/// live one after `adopt_after`, due times and retry counts kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_gone_for_good_is_adopted() {
    let _all_up = cluster().steady().await;
    let dir = tempfile::tempdir().unwrap();
    let (q, gone, live) = (unique("cluster-adopt"), unique("gone"), unique("live"));
    publish(&q, 300).await;
    let b = Process::start(&config(dir.path(), &live, &q, ADOPTED_DELAY_CONFIG, ""));
    let a = Process::start(&config(dir.path(), &gone, &q, ADOPTED_DELAY_CONFIG, ""));
    let (nacked, _) = park_then_kill(a, &q, 300, ADOPTED_DELAY).await;
    // B adopts them 5 s after A's lease is free, and they still fall due
    // at their own time.
    all_back(b.addr, &q, &nacked, ADOPTED_DELAY, Duration::from_secs(60)).await;
    let s = scrape(b.metrics).await;
    assert_eq!(s.get("nackd_retries_confirmed_total", &[]), 300.0);
    assert_eq!(s.sum("nackd_held_messages"), 0.0);
    drop(b);
    delete(&q).await;
}

/// An instance adopted once, back again and then gone again, is adopted
/// again: every message of both of its lives comes back, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_adopted_then_back_then_gone_is_adopted_again() {
    let _all_up = cluster().steady().await;
    let dir = tempfile::tempdir().unwrap();
    let (q, gone, live) = (unique("cluster-readopt"), unique("gone"), unique("live"));
    publish(&q, 50).await;
    let b = Process::start(&config(dir.path(), &live, &q, ADOPTED_DELAY_CONFIG, ""));
    let a_config = config(dir.path(), &gone, &q, ADOPTED_DELAY_CONFIG, "");
    let a = Process::start(&a_config);
    let (first, _) = park_then_kill(a, &q, 50, ADOPTED_DELAY).await;
    all_back(b.addr, &q, &first, ADOPTED_DELAY, Duration::from_secs(60)).await;
    // Back on its old store, which was adopted: it starts empty.
    let a = Process::start(&a_config);
    let s = scrape(a.metrics).await;
    assert_eq!(
        s.sum("nackd_held_messages"),
        0.0,
        "its adopted copy is discarded"
    );
    publish_range(&q, 50..100).await;
    let (second, _) = park_then_kill(a, &q, 50, ADOPTED_DELAY).await;
    all_back(b.addr, &q, &second, ADOPTED_DELAY, Duration::from_secs(60)).await;
    drop(b);
    delete(&q).await;
}

/// Issue 13: two processes with one id: only the lease holder intercepts
/// and fires; the standby takes over within seconds of the holder's death
/// (or before it: the holder is frozen first, see [`park_then_kill`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_with_the_same_id_takes_over_within_seconds() {
    let _all_up = cluster().steady().await;
    let dir = tempfile::tempdir().unwrap();
    let (q, id) = (unique("cluster-standby"), unique("pair"));
    publish(&q, 100).await;
    let a_dir = tempfile::tempdir().unwrap();
    let b_dir = tempfile::tempdir().unwrap();
    let a = Process::start(&config(a_dir.path(), &id, &q, ADOPTED_DELAY_CONFIG, ""));
    let b = Process::start_listening(&config(b_dir.path(), &id, &q, ADOPTED_DELAY_CONFIG, ""));
    // B recovers its (empty) store, then waits for the lease A holds.
    wait_for(
        Duration::from_secs(30),
        "the standby waiting for the lease",
        || async { get(b.metrics, "/readyz").await.body },
        |body| body.contains("\"store\":\"no lease\""),
    )
    .await;
    let first = park_all(&a, &q, 100).await;
    all_back(
        a.addr,
        &q,
        &first,
        ADOPTED_DELAY,
        Duration::from_secs(60),
    )
    .await;
    let s = scrape(b.metrics).await;
    assert_eq!(
        s.get("nackd_retries_published_total", &[]),
        0.0,
        "the standby fired"
    );
    assert_eq!(s.sum("nackd_held_messages"), 0.0);
    // A second batch is held when the holder dies.
    publish_range(&q, 100..200).await;
    let (second, died) = park_then_kill(a, &q, 100, ADOPTED_DELAY).await;
    common::ops::wait_intercepting(b.metrics).await;
    // Timed from the kill. When the wait for the broker's acks outlasts
    // A's heartbeats, the broker drops the frozen A's connections and B
    // takes over before the kill (took is then about 0): the bound holds
    // either way, but only a short freeze times the kill's release.
    let took = died.elapsed();
    assert!(took < Duration::from_secs(15), "took over after {took:?}");
    all_back(
        b.addr,
        &q,
        &second,
        ADOPTED_DELAY,
        Duration::from_secs(60),
    )
    .await;
    let s = scrape(b.metrics).await;
    assert_eq!(
        s.get("nackd_retries_confirmed_total", &[]),
        100.0,
        "the second batch fired by the standby that took over"
    );
    drop(b);
    delete(&q).await;
    let _ = dir;
}

/// Issue 13: one broker node stops while messages are held and traffic
/// flows: nothing is lost, clients reconnect through nackd to the live
/// nodes, nackd's own connections move, and the retries still come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_node_stopped_under_traffic_loses_nothing() {
    let cluster = cluster();
    let _only_me = cluster.exclusive().await;
    let dir = tempfile::tempdir().unwrap();
    let (q, id) = (unique("cluster-node"), unique("node"));
    let n = 400u32;
    publish(&q, n).await;
    let nackd = Process::start(&config(dir.path(), &id, &q, "2s", ""));
    let acked: Arc<Mutex<HashMap<u32, u32>>> = Arc::default();
    let stop = Arc::new(Mutex::new(false));
    let worker = tokio::spawn(consume_forever(
        nackd.addr,
        q.clone(),
        acked.clone(),
        stop.clone(),
    ));
    // Some held, some retried: then node 1 goes away.
    wait_for(
        Duration::from_secs(60),
        "a third acked",
        || async { acked.lock().unwrap().len() },
        |n| *n >= 130,
    )
    .await;
    cluster.stop_node(1).await;
    wait_for(
        Duration::from_secs(120),
        "all acked",
        || async { acked.lock().unwrap().len() },
        |k| *k as u32 >= n,
    )
    .await;
    *stop.lock().unwrap() = true;
    let _ = tokio::time::timeout(Duration::from_secs(15), worker).await;
    let s = scrape(nackd.metrics).await;
    assert_eq!(s.sum("nackd_held_messages"), 0.0);
    assert!(
        s.get("nackd_republisher_connected", &[("vhost", "/")]) == 1.0,
        "the republisher is connected to a live node"
    );
    cluster.start_node(1).await;
    drop(nackd);
    delete(&q).await;
}

/// Consumes through nackd, reconnecting whenever the connection goes:
/// nacks each first delivery (requeue: a nack that passes through while
/// nackd has no lease must not drop the message), acks each retry.
async fn consume_forever(
    addr: std::net::SocketAddr,
    q: String,
    acked: Arc<Mutex<HashMap<u32, u32>>>,
    stop: Arc<Mutex<bool>>,
) {
    let bounded = |d: u64| Duration::from_secs(d);
    while !*stop.lock().unwrap() {
        let uri = format!("amqp://guest:guest@{addr}/%2f");
        let Ok(Ok(conn)) = tokio::time::timeout(
            bounded(5),
            lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
        )
        .await
        else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let Ok(Ok((_ch, mut c))) = tokio::time::timeout(bounded(5), async {
            let ch = conn.create_channel().await?;
            ch.basic_qos(50, BasicQosOptions::default()).await?;
            let c = ch
                .basic_consume(
                    q.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            Ok::<_, lapin::Error>((ch, c))
        })
        .await
        else {
            continue;
        };
        while !*stop.lock().unwrap() {
            let Ok(next) = tokio::time::timeout(Duration::from_millis(500), c.next()).await else {
                continue;
            };
            let Some(Ok(d)) = next else { break };
            let id = id_of(&d.data);
            let settled = match retry_count(&d) {
                0 => {
                    let requeue = BasicNackOptions {
                        requeue: true,
                        multiple: false,
                    };
                    tokio::time::timeout(bounded(5), d.nack(requeue)).await
                }
                _ => {
                    let r =
                        tokio::time::timeout(bounded(5), d.ack(BasicAckOptions::default())).await;
                    if matches!(r, Ok(Ok(_))) {
                        *acked.lock().unwrap().entry(id).or_default() += 1;
                    }
                    r
                }
            };
            if !matches!(settled, Ok(Ok(_))) {
                break;
            }
        }
    }
}

/// Sends `signal` (e.g. "STOP", "CONT") to `p`.
pub(super) fn signal(p: &Process, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &p.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal}");
}

/// Issue 21, item 2: a holder frozen (SIGSTOP) past `adopt_after` while
/// it holds messages; a peer adopts and fires them; the holder runs again
/// with every message due and its republisher connection still open. On
/// main its engine fired on the state it last saw before its replica task
/// noticed the lost lease: up to 2 × `confirm_window` duplicates. Fenced
/// (the lease's fence is read on the monotonic clock, which ran on while
/// the process was stopped), it publishes nothing: every message arrives
/// exactly once, from the adopter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_frozen_past_adopt_after_publishes_nothing_when_it_runs_again() {
    let _all_up = cluster().steady().await;
    let dir = tempfile::tempdir().unwrap();
    let (q, warm) = (unique("cluster-frozen"), unique("cluster-frozen-warm"));
    let (frozen, live) = (unique("frozen"), unique("live"));
    let n = 2000;
    // The republisher connection outlives the freeze (no heartbeat), as it
    // does with the default heartbeat of 10 s and a shorter freeze.
    let extra = format!(
        "[republish]\nheartbeat = \"0s\"\n[[policy]]\nqueues = [\"{warm}\"]\ndelays = [\"100ms\"]\n"
    );
    // 20 s: parking 2 000 through A took over 8 s (the delay this had)
    // on a machine loaded by the rest of the suite, and they fired before
    // they were all held.
    let b = Process::start(&config(dir.path(), &live, &q, ADOPTED_DELAY_CONFIG, ""));
    let a = Process::start(&config(dir.path(), &frozen, &q, ADOPTED_DELAY_CONFIG, &extra));
    // One retry through A first, so that its republisher is connected.
    publish(&warm, 1).await;
    let through_a = connect(&format!("amqp://guest:guest@{}/%2f", a.addr)).await;
    let (_wch, mut w) = consumer(&through_a, &warm, 1).await;
    let d = next(&mut w, Duration::from_secs(10))
        .await
        .expect("warm-up");
    d.nack(BasicNackOptions::default()).await.unwrap();
    let d = next(&mut w, Duration::from_secs(10))
        .await
        .expect("its retry");
    assert_eq!(retry_count(&d), 1);
    d.ack(BasicAckOptions::default()).await.unwrap();
    let _ = through_a.close(200, "".into()).await;
    publish(&q, n).await;
    // Stopped as soon as it holds them all, before the first is due: a
    // fresh-clone run that also waited for the broker to apply A's acks
    // first (park_all) took past the 20 s, and A fired all 2 000. Its
    // consumer stays open until A runs again, so that no close can
    // overtake those acks (park_all says why that matters).
    let parking = nack_all(&a, &q, n).await;
    signal(&a, "STOP");
    before_due(&parking.nacked, ADOPTED_DELAY, "A stopped");
    // The broker has applied A's acks before anything is consumed: should
    // A's session connection end meanwhile, nothing of it is requeued and
    // taken for a second delivery. B adopts during the wait, if it is long.
    acks_applied(&q, 0).await;
    let nacked = parking.nacked.clone();
    // A's lease is free after about two heartbeats (1 s), B adopts 5 s
    // later and fires what is due (20 s after the nacks). Adoption fires
    // nothing before its commit: on a loaded machine, when it still parked
    // one message at a time, 2 000 took more than a minute.
    let conn = cluster().connect(2).await;
    let (_ch, mut c) = consumer(&conn, &q, 500).await;
    let mut seen: HashMap<u32, u32> = HashMap::new();
    let began = Instant::now();
    while seen.len() < n as usize && began.elapsed() < Duration::from_secs(150) {
        if let Some(d) = next(&mut c, Duration::from_secs(1)).await {
            *seen.entry(id_of(&d.data)).or_default() += 1;
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
    }
    assert_eq!(seen.len(), nacked.len(), "every message adopted and fired");
    // A runs again, every message due in its engine.
    signal(&a, "CONT");
    let resumed = Instant::now();
    while resumed.elapsed() < Duration::from_secs(10) {
        if let Some(d) = next(&mut c, Duration::from_millis(500)).await {
            *seen.entry(id_of(&d.data)).or_default() += 1;
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
    }
    let twice = seen.values().filter(|k| **k > 1).count();
    assert_eq!(
        twice, 0,
        "messages delivered twice after the holder ran again"
    );
    let s = scrape(a.metrics).await;
    assert_eq!(
        s.get("nackd_retries_published_total", &[]),
        1.0,
        "the frozen holder handed only its warm-up retry to a republisher"
    );
    let _ = conn.close(200, "".into()).await;
    drop(a);
    drop(b);
    delete(&q).await;
    delete(&warm).await;
}

/// Closes the replica connection of `instance` (`rabbitmqctl
/// close_connection`), as an operator or a broker restart would; `true` if
/// one was open.
async fn close_replica_connection(instance: &str) -> bool {
    let listed = cluster()
        .ctl(1, &["list_connections", "pid", "client_properties"])
        .await;
    let name = format!("\"nackd replica {instance}\"");
    let Some(pid) = listed
        .lines()
        .find(|l| l.contains(&name))
        .and_then(|l| l.split('\t').next())
    else {
        return false;
    };
    cluster()
        .ctl(
            1,
            &["close_connection", pid, "test: replica connection closed"],
        )
        .await;
    true
}

/// Issue 21, item 4: the replica connection closed five times under load.
/// Each time the lease is gone until nackd reconnects; on main the nacks
/// of those gaps went to the broker as sent (29 % of them), which drops
/// them on a queue without a dead-letter exchange. They are deferred now:
/// left unacked and nacked with requeue later, so every message still ends
/// as a retry, none passed through, none twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_connection_closes_under_load_pass_no_nack_through() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    let _all_up = cluster().steady().await;
    let dir = tempfile::tempdir().unwrap();
    let (q, id) = (unique("cluster-closes"), unique("closes"));
    let first = 3000u32;
    publish(&q, first).await;
    let nackd = Process::start(&config(dir.path(), &id, &q, "1s", ""));
    let conn = connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr)).await;
    let (_ch, mut c) = consumer(&conn, &q, 50).await;
    // Five closes, each once nackd has connected again, beside the load.
    let closes_done = Arc::new(AtomicBool::new(false));
    let closer = {
        let (id, done) = (id.clone(), closes_done.clone());
        tokio::spawn(async move {
            let mut closes = 0;
            while closes < 5 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                if close_replica_connection(&id).await {
                    closes += 1;
                }
            }
            done.store(true, Ordering::SeqCst);
        })
    };
    // The load lasts as long as the closes do, however slow rabbitmqctl
    // is on a busy machine: more messages are published until the fifth,
    // 200 a second (2 000 a second made 20 000 messages on a loaded
    // machine, more than the cluster then retried in the test's 240 s;
    // 200 is what batches of 100 every 250 ms gave while each publish
    // waited for its confirm). At most 30 000 in all, should rabbitmqctl
    // be slower still.
    let published = Arc::new(AtomicU32::new(first));
    let feeder = {
        let (q, done, published) = (q.clone(), closes_done.clone(), published.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::SeqCst) && published.load(Ordering::SeqCst) < 30_000 {
                let from = published.load(Ordering::SeqCst);
                publish_range(&q, from..from + 100).await;
                published.store(from + 100, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    let mut retried: HashMap<u32, u32> = HashMap::new();
    let mut nacked_during_closes = 0u32;
    // The bound is on silence, not on the whole: a lost message shows as
    // retries that stop coming while some are missing. How long the whole
    // takes depends on the machine (CI, with the image compiling beside,
    // took 240 s to retry 17 919 of 18 000, still going). The whole is
    // bounded too (15 min), and a closer that failed ends the test.
    let began = Instant::now();
    // When the last message came back for the first time.
    let mut last_retry = Instant::now();
    while !(closer.is_finished()
        && feeder.is_finished()
        && retried.len() == published.load(Ordering::SeqCst) as usize)
    {
        assert!(
            !closer.is_finished() || closes_done.load(Ordering::SeqCst),
            "the closer failed before its fifth close"
        );
        assert!(
            began.elapsed() < Duration::from_secs(900),
            "{} of {} retried after 15 min",
            retried.len(),
            published.load(Ordering::SeqCst)
        );
        assert!(
            last_retry.elapsed() < Duration::from_secs(60),
            "{} of {} retried, and no retry came in the last 60 s (the delay is 1 s)",
            retried.len(),
            published.load(Ordering::SeqCst)
        );
        let Some(d) = next(&mut c, Duration::from_millis(200)).await else {
            continue;
        };
        if retry_count(&d) == 0 {
            // The first delivery, or one a deferred nack gave back.
            if !closes_done.load(Ordering::SeqCst) {
                nacked_during_closes += 1;
            }
            d.nack(BasicNackOptions::default()).await.unwrap();
        } else {
            let times = retried.entry(id_of(&d.data)).or_default();
            if *times == 0 {
                last_retry = Instant::now();
            }
            *times += 1;
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
    }
    let n = published.load(Ordering::SeqCst);
    closer.await.unwrap();
    feeder.await.unwrap();
    assert!(
        nacked_during_closes > 0,
        "no nack came in while the replica connection was being closed"
    );
    eprintln!("{n} messages, {nacked_during_closes} nacks while the closes went on");
    assert!(
        next(&mut c, Duration::from_secs(3)).await.is_none(),
        "nothing more after every message came back as a retry"
    );
    assert!(retried.values().all(|k| *k == 1), "a retry came twice");
    let s = scrape(nackd.metrics).await;
    assert_eq!(
        s.sum("nackd_nacks_passed_total"),
        0.0,
        "nacks passed through to the broker"
    );
    eprintln!(
        "deferred for lack of a lease: {}",
        s.get("nackd_nacks_deferred_total", &[("reason", "no_lease")])
    );
    let _ = conn.close(200, "".into()).await;
    drop(nackd);
    delete(&q).await;
}

/// The cluster port (`127.0.0.1:568N`) of the connection named `name`,
/// from `rabbitmqctl list_connections` (every node must answer).
async fn node_of_connection(name: &str) -> Option<usize> {
    let listed = cluster()
        .ctl(1, &["list_connections", "port", "client_properties"])
        .await;
    let quoted = format!("\"{name}\"");
    let line = listed.lines().find(|l| l.contains(&quoted))?;
    let port: u16 = line.split('\t').next()?.trim().parse().ok()?;
    (1..=3).find(|n| cluster().addr(*n).ends_with(&format!(":{port}")))
}

/// A node fault for [`retries_go_on_through`].
#[derive(Clone, Copy, Debug)]
enum NodeFault {
    /// SIGSTOP for 8 s: a stalled host; the cluster notices only after
    /// its net_ticktime (about 60 s), so the node's exclusive queues stay.
    Freeze,
    /// SIGKILL: on RabbitMQ 4.2+ its exclusive queues stay until it is back.
    Kill,
}

/// Issue 21, item 3: the node that holds nackd's replica connection
/// freezes (or dies) while retries are being parked and fired. On main the
/// lease was one exclusive queue on that connection's node, so nackd could
/// not take it back through another node until the cluster gave up on the
/// frozen one (about 60 s; never for a dead node on 4.2+): retries stalled
/// for the whole freeze and nacks were deferred. The lease is a majority of
/// per-node registers now: the frozen node takes one, the other two keep
/// it, and firing goes on with no gap longer than two heartbeats; the
/// writes connection is made again on another node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_or_killed_node_stalls_neither_the_lease_nor_firing() {
    let _only = cluster().exclusive().await;
    for fault in [NodeFault::Freeze, NodeFault::Kill] {
        retries_go_on_through(fault).await;
    }
}

async fn retries_go_on_through(fault: NodeFault) {
    let dir = tempfile::tempdir().unwrap();
    let (q, id) = (unique("cluster-lease-node"), unique("leasenode"));
    // Every connection of nackd notices a silent node within 2 s: its
    // republisher may be on the node that fails.
    let extra = "[republish]\nheartbeat = \"1s\"\n";
    let nackd = Process::start(&config(dir.path(), &id, &q, "4s", extra));
    let n = 1200u32;
    publish(&q, n).await; // led by node 1
    let session = format!("lease test {id}");
    let props = lapin::ConnectionProperties::default().with_connection_name(session.clone().into());
    let conn = Connection::connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr), props)
        .await
        .unwrap();
    // The node that fails holds the replica's writes connection (and one
    // register of the lease, as every node does), neither the queue's
    // leader nor the test's session: the writes connection is moved until
    // it is there.
    let beside = node_of_connection(&session)
        .await
        .expect("the test's session is listed");
    let writes = format!("nackd replica {id}");
    let failing = loop {
        match node_of_connection(&writes).await {
            Some(w) if w != 1 && w != beside => break w,
            _ => {
                close_replica_connection(&id).await;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    };
    let (_ch, mut c) = consumer(&conn, &q, 10).await;
    let began = Instant::now();
    let mut nacked: HashMap<u32, Instant> = HashMap::new();
    let mut back: HashMap<u32, u32> = HashMap::new();
    let mut arrivals: Vec<Instant> = Vec::new();
    let mut fault_at: Option<(Instant, Option<common::cluster::Frozen>)> = None;
    let mut thawed_at: Option<Instant> = None;
    let delay = Duration::from_secs(4);
    while back.len() < n as usize {
        assert!(
            began.elapsed() < Duration::from_secs(180),
            "{fault:?}: {} of {n} came back",
            back.len()
        );
        // The fault once retries are firing, while nacks still come in.
        if fault_at.is_none() && began.elapsed() > Duration::from_secs(6) {
            let frozen = match fault {
                NodeFault::Freeze => Some(cluster().freeze_node(failing).await),
                NodeFault::Kill => {
                    cluster().kill_node(failing).await;
                    None
                }
            };
            eprintln!("{fault:?}: node {failing} at {:?}", began.elapsed());
            fault_at = Some((Instant::now(), frozen));
        }
        if let Some((at, frozen)) = &mut fault_at {
            if frozen.is_some() && at.elapsed() > Duration::from_secs(8) {
                drop(frozen.take());
                thawed_at = Some(Instant::now());
            }
        }
        let Some(d) = next(&mut c, Duration::from_millis(100)).await else {
            continue;
        };
        let key = id_of(&d.data);
        if retry_count(&d) == 0 {
            // Paced: about 100 nacks a second, so dues spread over 12 s.
            nacked.insert(key, Instant::now());
            tokio::time::sleep(Duration::from_millis(8)).await;
            d.nack(BasicNackOptions::default()).await.unwrap();
        } else {
            let since = nacked[&key].elapsed();
            assert!(
                since >= delay,
                "{fault:?}: message {key} back after {since:?}: early"
            );
            *back.entry(key).or_default() += 1;
            arrivals.push(Instant::now());
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
    }
    drop(fault_at.as_mut().and_then(|(_, f)| f.take()));
    let (fault_at, _) = fault_at.expect("the fault happened");
    while let Some(d) = next(&mut c, Duration::from_secs(3)).await {
        *back.entry(id_of(&d.data)).or_default() += 1;
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    // The longest wait between two retries from the fault on, while
    // retries were due (the last one bounds it).
    let gap = arrivals
        .windows(2)
        .filter(|w| w[1] > fault_at)
        .map(|w| w[1] - w[0].max(fault_at))
        .max()
        .unwrap_or_default();
    let s = scrape(nackd.metrics).await;
    eprintln!(
        "{fault:?} of node {failing}: longest wait between retries {gap:?}; deferred for lack of a lease {}, other deferrals {}; thawed at {:?}",
        s.get("nackd_nacks_deferred_total", &[("reason", "no_lease")]),
        s.sum("nackd_nacks_deferred_total"),
        thawed_at.map(|t| t - fault_at)
    );
    // Target: 2 heartbeats of 1 s. A republisher on the failing node is
    // replaced after its own two heartbeats, then connects again.
    assert!(
        gap <= Duration::from_secs(3),
        "{fault:?}: retries stopped for {gap:?}"
    );
    assert_eq!(
        s.get("nackd_nacks_deferred_total", &[("reason", "no_lease")]),
        0.0,
        "{fault:?}: the lease was lost"
    );
    let passed: Vec<(&str, f64)> = [
        "not_configured",
        "over_budget",
        "store_unavailable",
        "tx_channel",
        "requeue_pass",
        "bad_headers",
        "unknown_tag",
        "recovering",
        "no_lease",
        "no_replica",
        "closing",
        "returned",
    ]
    .into_iter()
    .map(|r| (r, s.get("nackd_nacks_passed_total", &[("reason", r)])))
    .filter(|(_, n)| *n > 0.0)
    .collect();
    assert!(
        passed.is_empty(),
        "{fault:?}: nacks passed through: {passed:?}"
    );
    // Twice: only what a republisher connection that went with the node
    // had sent unconfirmed (Guarantees, item 2; at most confirm_window).
    let twice = back.values().filter(|k| **k > 1).count();
    let republisher_lost = nackd
        .log
        .lock()
        .unwrap()
        .iter()
        .any(|l| l.contains("republisher connection lost"));
    eprintln!(
        "{fault:?}: {twice} retries came twice (republisher connection lost: {republisher_lost})"
    );
    assert!(
        twice == 0 || (republisher_lost && twice <= 1000),
        "{fault:?}: {twice} retries came twice"
    );
    let _ = conn.close(200, "".into()).await;
    drop(nackd);
    if let NodeFault::Kill = fault {
        cluster().start_node(failing).await;
    }
    delete(&q).await;
}

/// Watches `p`'s `/readyz` for `span` (every 100 ms): it never intercepts
/// (holds the lease); else fails with `what` and the body.
async fn never_intercepting(p: &Process, span: Duration, what: &str) {
    let began = Instant::now();
    while began.elapsed() < span {
        let r = get(p.metrics, "/readyz").await;
        assert!(!common::ops::intercepting(&r), "{what}: {}", r.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How many of `processes` intercept (hold the lease) now, by `/readyz`.
async fn holders(processes: &[Option<Process>]) -> Vec<usize> {
    let mut holding = Vec::new();
    for (i, p) in processes.iter().enumerate() {
        if let Some(p) = p {
            if common::ops::intercepting(&get(p.metrics, "/readyz").await) {
                holding.push(i);
            }
        }
    }
    holding
}

/// Watches `processes` for `span`: never two holders at once; the one
/// holder at the end.
async fn one_holder_at_most(processes: &[Option<Process>], span: Duration) -> usize {
    let began = Instant::now();
    let mut last = Vec::new();
    while began.elapsed() < span || last.len() != 1 {
        assert!(
            began.elapsed() < span + Duration::from_secs(30),
            "no single holder: {last:?}"
        );
        last = holders(processes).await;
        assert!(last.len() <= 1, "two holders of one id at once: {last:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    last[0]
}

/// Issue 21, item 3: the lease cannot have two holders. Three processes of
/// one id race for it from the same instant, each with a store of its own;
/// then the holder is killed, twice: at every sample at most one of them
/// intercepts, and one always does again within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_racing_for_one_lease_never_hold_it_together() {
    let _all_up = cluster().steady().await;
    let q = unique("cluster-race");
    let id = unique("race");
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let configs: Vec<_> = dirs
        .iter()
        .map(|d| config(d.path(), &id, &q, "10s", ""))
        .collect();
    let mut processes: Vec<Option<Process>> = configs
        .iter()
        .map(|c| Some(Process::start_listening(c)))
        .collect();
    for _ in 0..2 {
        let holder = one_holder_at_most(&processes, Duration::from_secs(8)).await;
        eprintln!("holder: process {holder}");
        processes[holder].take().unwrap().kill9();
    }
    let last = one_holder_at_most(&processes, Duration::from_secs(3)).await;
    eprintln!("last holder: process {last}");
    drop(processes);
    delete(&q).await;
}

/// Review of issue 21, item 3 (a rolling upgrade): the lease of earlier
/// releases was the one exclusive queue `nackd.lease.<id>`. A process of
/// this release must not act for an id while an old process holds that
/// queue, however many registers it gets; once the old one is gone it
/// takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_release_holding_the_id_keeps_a_new_process_standing_by() {
    let _all_up = cluster().steady().await;
    let dir = tempfile::tempdir().unwrap();
    let (q, id) = (unique("cluster-legacy"), unique("legacy"));
    // What an old nackd holds: the exclusive queue, on its connection.
    let old = cluster().connect(2).await;
    let ch = old.create_channel().await.unwrap();
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    ch.queue_declare(
        format!("nackd.lease.{id}").as_str().into(),
        exclusive,
        FieldTable::default(),
    )
    .await
    .unwrap();
    let new = Process::start_listening(&config(dir.path(), &id, &q, "1s", ""));
    let old_holds = "acting for an id an old release holds";
    never_intercepting(&new, Duration::from_secs(6), old_holds).await;
    let body = get(new.metrics, "/readyz").await.body;
    assert!(body.contains("\"store\":\"no lease\""), "{body}");
    let _ = old.close(200, "".into()).await;
    wait_for(
        Duration::from_secs(15),
        "the new process taking over",
        || async { common::ops::intercepting(&get(new.metrics, "/readyz").await) },
        |held| *held,
    )
    .await;
    drop(new);
}

/// Issue 36: the lease's registers are named by their place in
/// `upstream.addresses`, so every process of an id must list the same
/// nodes in the same order. One that lists them in another order refuses
/// the lease, naming both lists, while the holder runs and once it is
/// gone; one that names the holder's list as `replica.previous_addresses`
/// (a change of the list) takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_listing_other_addresses_refuses_the_lease_naming_both() {
    let _all_up = cluster().steady().await;
    let (q, id) = (unique("cluster-addresses"), unique("addresses"));
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let ours = nodes();
    let reversed: Vec<String> = ours.iter().rev().cloned().collect();
    let a = Process::start_listening(&config(dirs[0].path(), &id, &q, "10s", ""));
    common::ops::wait_intercepting(a.metrics).await;
    let b = Process::start_listening(&config_listing(
        dirs[1].path(),
        &id,
        &q,
        "10s",
        "",
        &reversed,
    ));
    let line = b.wait_for_log(&[
        "upstream.addresses differ",
        &format!("this process lists [{}]", reversed.join(", ")),
        &format!("listed [{}]", ours.join(", ")),
        "not taking the lease",
    ]);
    eprintln!("{line}");
    let r = get(b.metrics, "/readyz").await;
    assert!(r.body.contains("no lease: upstream.addresses differ"), "{}", r.body);
    assert_eq!(scrape(b.metrics).await.get("nackd_replica_refused", &[]), 1.0);
    a.kill9();
    // A's registers are free within two heartbeats (2 s): B still refuses.
    never_intercepting(&b, Duration::from_secs(8), "B took the lease").await;
    assert!(b.log.lock().unwrap().iter().all(|l| !l.contains("holding the lease")));
    drop(b);
    let previous = format!("previous_addresses = {}", toml_list(&ours));
    let c = Process::start_listening(&config_listing(
        dirs[2].path(),
        &id,
        &q,
        "10s",
        &previous,
        &reversed,
    ));
    common::ops::wait_intercepting(c.metrics).await;
    assert_eq!(scrape(c.metrics).await.get("nackd_replica_refused", &[]), 0.0);
    drop(c);
    delete(&q).await;
}

/// Issue 36, review: the check under a lease just taken, on the path of a
/// process that held the lease before. A (the first list) holds; frozen,
/// it loses the lease to C, which lists the nodes in another order and
/// names A's list as `replica.previous_addresses`, and so records its
/// own. Once C is gone, A takes the lease back, reads C's list, gives the
/// lease back, and then leaves it alone for 30 s: it says so once, not at
/// every try.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_former_holder_refuses_the_lease_a_new_list_took_over() {
    let _all_up = cluster().steady().await;
    let (q, id) = (unique("cluster-relist"), unique("relist"));
    let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let ours = nodes();
    let reversed: Vec<String> = ours.iter().rev().cloned().collect();
    let a = Process::start_listening(&config(dirs[0].path(), &id, &q, "10s", ""));
    common::ops::wait_intercepting(a.metrics).await;
    let previous = format!("previous_addresses = {}", toml_list(&ours));
    let c = Process::start_listening(&config_listing(
        dirs[1].path(),
        &id,
        &q,
        "10s",
        &previous,
        &reversed,
    ));
    signal(&a, "STOP");
    common::ops::wait_intercepting(c.metrics).await;
    signal(&a, "CONT");
    c.kill9();
    let line = a.wait_for_log(&[
        "upstream.addresses differ",
        &format!("this process lists [{}]", ours.join(", ")),
        &format!("listed [{}]", reversed.join(", ")),
    ]);
    eprintln!("{line}");
    never_intercepting(&a, Duration::from_secs(8), "A took the lease").await;
    let said = a
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("upstream.addresses differ"))
        .count();
    assert_eq!(said, 1, "A took the lease again before 30 s passed");
    assert_eq!(scrape(a.metrics).await.get("nackd_replica_refused", &[]), 1.0);
    drop(a);
    delete(&q).await;
}

/// Issue 36, review: an adoption takes the adopted instance's lease by
/// registers named by the adopter's own `upstream.addresses`. An adopter
/// that lists other nodes than the instance's last holder leaves it
/// alone, and says why (`nackd_replica_unadoptable`); the messages stay
/// in that instance's stream and come back, once, when it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopter_listing_other_nodes_leaves_the_instance_alone() {
    let _all_up = cluster().steady().await;
    let dir = tempfile::tempdir().unwrap();
    let (q, gone, live) = (unique("cluster-noadopt"), unique("gone"), unique("live"));
    let ours = nodes();
    let reversed: Vec<String> = ours.iter().rev().cloned().collect();
    publish(&q, 20).await;
    let b_config = config_listing(dir.path(), &live, &q, ADOPTED_DELAY_CONFIG, "", &reversed);
    let b = Process::start(&b_config);
    let a_config = config(dir.path(), &gone, &q, ADOPTED_DELAY_CONFIG, "");
    let a = Process::start(&a_config);
    let (nacked, _) = park_then_kill(a, &q, 20, ADOPTED_DELAY).await;
    common::ops::until(b.metrics, "B finding A unadoptable", |s| {
        s.get("nackd_replica_unadoptable", &[]) == 1.0
    })
    .await;
    b.wait_for_log(&[
        "cannot adopt",
        &format!("listed upstream.addresses [{}]", ours.join(", ")),
        &format!("this process lists [{}]", reversed.join(", ")),
    ]);
    let s = scrape(b.metrics).await;
    assert_eq!(s.sum("nackd_held_messages"), 0.0, "B adopted");
    let a = Process::start(&a_config);
    all_back(a.addr, &q, &nacked, ADOPTED_DELAY, Duration::from_secs(60)).await;
    let s = scrape(b.metrics).await;
    assert_eq!(s.get("nackd_retries_published_total", &[]), 0.0, "B fired");
    drop((a, b));
    delete(&q).await;
}

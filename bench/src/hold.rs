//! `nackd-bench hold`: park many messages through nackd (1 KiB bodies, a long
//! delay), then report the park rate, nackd's RSS, the store on disk, and the
//! time nackd takes to serve again after a SIGKILL with all of them held.
//! `nackd-bench restart` parks the same way, then SIGKILLs and restarts
//! nackd several times.
//!
//! With a baseline lane (`--baseline-nackd`, `--baseline-rev`,
//! `--baseline-config`), `hold` then does the same with the baseline nackd
//! (the same count, delay and backlog, on a queue of its own) and prints
//! nackd / baseline for the park rate, the RSS per held message, the store
//! size and the time to serving after the restart. The scenario has no
//! rounds: nackd goes first, the baseline second.
//!
//! Every message is published to RabbitMQ, delivered through nackd to a lapin
//! consumer that nacks it, stored by nackd and acked upstream; "parked" is
//! read back from the store with `nackd store stats`.

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

use super::baseline::{print_versus, Baseline, BaselineArgs, Better};
use super::launcher::NackdProcess;
use super::load::{close, connect, consume_queue, unique_queue};
use super::machine::{load_average, Machine};
use super::{print_header, BenchResult, Common, Targets};

/// Options of the hold scenario.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub common: Common,
    /// Messages to park.
    #[arg(long, default_value_t = 100_000)]
    pub count: u64,
    /// How long they are held (they do not fall due during the run, unless
    /// `--fire`).
    #[arg(long, default_value = "1h")]
    pub delay: String,
    /// After the restart, wait until they fall due and report the lateness
    /// of the redeliveries (pick a `--delay` longer than parking takes).
    #[arg(long)]
    pub fire: bool,
    /// Publish alongside parking, at most this many messages ahead of the
    /// nacks, so RabbitMQ never holds the whole run (for 10 M); by default
    /// all are published first.
    #[arg(long)]
    pub backlog: Option<u64>,
}

/// Options of the hold scenario: parking, and the baseline lane.
#[derive(Debug, Clone, clap::Args)]
pub struct HoldArgs {
    #[command(flatten)]
    pub park: Args,
    // The lane `nackd-baseline`: another nackd build or config, parked and
    // restarted the same way after nackd.
    #[command(flatten)]
    pub baseline: BaselineArgs,
}

/// Reads a process's resident set size in bytes.
pub fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .map(str::to_owned)
        })
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn dir_size(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// `held N` from `nackd store stats`.
fn held(binary: &std::path::Path, store: &std::path::Path) -> u64 {
    Command::new(binary)
        .args(["store", "--path"])
        .arg(store)
        .arg("stats")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Options of the restart scenario.
#[derive(Debug, Clone, clap::Args)]
pub struct RestartArgs {
    #[command(flatten)]
    pub park: Args,
    /// SIGKILL/restart cycles with everything held.
    #[arg(long, default_value_t = 3)]
    pub restarts: u32,
    /// Write the `--count` held messages (100-byte bodies, due in 1 h)
    /// straight into the stopped nackd's store with the store's own API,
    /// instead of parking them through the broker (10 M would take half an
    /// hour that way): only the restart is measured then.
    #[arg(long)]
    pub prefill: bool,
}

/// What parking left behind.
struct Parking {
    /// The headline figures of parking.
    figures: Figures,
    queue: String,
    /// When each message (by id) was nacked.
    nacked_at: Vec<Option<Instant>>,
    admin: lapin::Connection,
    admin_ch: lapin::Channel,
}

/// The figures `hold` compares with the baseline's.
#[derive(Clone, Copy, Debug, Default)]
struct Figures {
    /// Nacks made durable per second.
    park_rate: f64,
    /// RSS growth per held message, in bytes.
    rss_per_held: f64,
    /// The store on disk, in MiB.
    store_mib: f64,
}

impl Parking {
    async fn delete(self) {
        let _ = self
            .admin_ch
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        close(&self.admin).await;
    }
}

/// Runs the hold scenario: park, one SIGKILL restart, optionally fire;
/// then park and restart the baseline nackd, if there is one.
pub async fn run(args: HoldArgs) -> BenchResult<()> {
    let baseline = args.baseline.resolve(&args.park.common)?;
    let args = args.park;
    let mut targets = start("hold", &args, baseline.as_ref()).await?;
    let nackd = started(&mut targets)?;
    let parking = park(&args, nackd, "").await?;
    let (served, _) = restart_once(nackd, args.count, "").await?;
    if args.fire {
        let delay = humantime::parse_duration(&args.delay).map_err(|e| format!("--delay: {e}"))?;
        fire(
            &nackd.addr().to_string(),
            &parking.queue,
            &parking.nacked_at,
            delay,
        )
        .await?;
    }
    if let Some(b) = targets.baseline.as_mut() {
        const WHO: &str = "nackd-baseline: ";
        let theirs = park(&args, b, WHO).await?;
        let (their_served, _) = restart_once(b, args.count, WHO).await?;
        let (mine, others) = (parking.figures, theirs.figures);
        print_versus(
            "park rate",
            "nacks/s",
            Better::Higher,
            mine.park_rate,
            others.park_rate,
        );
        print_versus(
            "rss per held",
            "B",
            Better::Lower,
            mine.rss_per_held,
            others.rss_per_held,
        );
        print_versus(
            "store",
            "MiB",
            Better::Lower,
            mine.store_mib,
            others.store_mib,
        );
        print_versus(
            "restart, serving",
            "s",
            Better::Lower,
            served.as_secs_f64(),
            their_served.as_secs_f64(),
        );
        theirs.delete().await;
    }
    finish(targets, parking).await
}

/// Runs the restart scenario: park, then `--restarts` SIGKILL restarts.
pub async fn run_restart(args: RestartArgs) -> BenchResult<()> {
    let mut targets = start("restart", &args.park, None).await?;
    let nackd = started(&mut targets)?;
    if args.prefill {
        nackd.stop();
        let began = Instant::now();
        let (store, n) = (nackd.store_dir(), args.park.count);
        tokio::task::spawn_blocking(move || prefill(&store, n)).await??;
        crate::out!(
            "prefill     {n} held messages (100 B bodies) written to the store in {:.1} s",
            began.elapsed().as_secs_f64()
        );
    }
    let parking = match args.prefill {
        true => None,
        false => Some(park(&args.park, nackd, "").await?),
    };
    let (mut serving, mut intercepting) = (Vec::new(), Vec::new());
    for _ in 0..args.restarts {
        let (served, recovered) = restart_once(nackd, args.park.count, "").await?;
        serving.push(served);
        intercepting.push(recovered);
    }
    serving.sort();
    intercepting.sort();
    if let (Some(served), Some(recovered)) = (
        serving.get(serving.len() / 2),
        intercepting.get(intercepting.len() / 2),
    ) {
        crate::out!(
            "restart     median of {} SIGKILL restarts with {} held: clients served after {:.2} s, intercepting after {:.2} s",
            serving.len(),
            args.park.count,
            served.as_secs_f64(),
            recovered.as_secs_f64()
        );
    }
    match parking {
        Some(parking) => finish(targets, parking).await,
        None => Ok(()),
    }
}

/// Writes `n` held messages (ids 1..=n, due in an hour) into the store in
/// `dir` with the store's own API, committed in batches.
fn prefill(dir: &std::path::Path, n: u64) -> BenchResult<()> {
    use nackd::store::{Held, Log, Options, Route};
    let (mut log, _) = Log::open(dir, Options::default())?;
    let properties = amq_protocol::protocol::BasicProperties::default().with_delivery_mode(2);
    let header = bytes::Bytes::from(nackd_core::protocol::content::encode_header(
        60,
        100,
        &properties,
    ));
    let due_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as u64
        + 3_600_000;
    let (vhost, queue): (Arc<str>, Arc<str>) =
        (Arc::from("/"), Arc::from("nackd-bench-hold-prefill"));
    for id in 1..=n {
        let held = Held {
            id,
            vhost: vhost.clone(),
            queue: queue.clone(),
            due_ms: due_ms + id / 1000,
            retry: 1,
            route: Route::Queue,
            on_return: None,
            header: header.clone(),
            body: bytes::Bytes::from(vec![(id % 251) as u8; 100]),
        };
        log.put(&held, None).map_err(|e| e.to_string())?;
        if id % 50_000 == 0 {
            log.commit().map_err(|e| e.to_string())?;
        }
    }
    log.commit().map_err(|e| e.to_string())?;
    Ok(())
}

async fn start(scenario: &str, args: &Args, baseline: Option<&Baseline>) -> BenchResult<Targets> {
    let common = &args.common;
    let machine = Machine::probe(&common.broker).await;
    let policy = format!(
        "[[policy]]\nqueues = [\"nackd-bench-hold-*\"]\ndelays = [\"{}\"]\n",
        args.delay
    );
    let mut targets = Targets::start(common, &policy)?;
    if let Some(baseline) = baseline {
        targets.start_baseline(baseline, common, &policy)?;
    }
    print_header(scenario, common, &machine, &targets);
    Ok(targets)
}

fn started(targets: &mut Targets) -> BenchResult<&mut NackdProcess> {
    targets.nackd.as_mut().ok_or_else(|| {
        "this scenario needs to start nackd itself (no --proxy): it reads its RSS and restarts it"
            .into()
    })
}

async fn finish(mut targets: Targets, parking: Parking) -> BenchResult<()> {
    parking.delete().await;
    crate::out!("load        average {} at the end", load_average());
    if let Some(nackd) = targets.nackd.take() {
        nackd.kill();
    }
    if let Some(baseline) = targets.baseline.take() {
        baseline.kill();
    }
    Ok(())
}

/// Publishes `--count` messages to RabbitMQ with confirms, `backlog` ahead
/// of `nacked` at most (all at once without it).
pub(crate) async fn publish(
    ch: lapin::Channel,
    queue: String,
    n: u64,
    nacked: Arc<AtomicU64>,
    backlog: Option<u64>,
) -> BenchResult<Duration> {
    let published = Instant::now();
    let mut body = vec![7u8; 1024];
    let mut confirms = Vec::with_capacity(1000);
    for id in 0..n {
        if let Some(backlog) = backlog {
            while id.saturating_sub(nacked.load(Ordering::Relaxed)) >= backlog {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        body[..8].copy_from_slice(&id.to_be_bytes());
        confirms.push(
            ch.basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default(),
            )
            .await?,
        );
        if confirms.len() == 1000 {
            for c in confirms.drain(..) {
                c.await?;
            }
        }
    }
    for c in confirms.drain(..) {
        c.await?;
    }
    Ok(published.elapsed())
}

/// Declares `queue` (gone `expires_ms` after its last use) on `broker` and
/// returns a connection and a channel in confirm mode to publish to it.
pub(crate) async fn declare_hold_queue(
    broker: &str,
    queue: &str,
    expires_ms: i32,
) -> BenchResult<(lapin::Connection, lapin::Channel)> {
    let admin = connect(broker).await?;
    let admin_ch = admin.create_channel().await?;
    let mut qargs = FieldTable::default();
    qargs.insert("x-expires".into(), AMQPValue::LongInt(expires_ms));
    admin_ch
        .queue_declare(queue.into(), super::load::durable(), qargs)
        .await?;
    admin_ch
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok((admin, admin_ch))
}

/// The id [`publish`] wrote in the first 8 bytes of a body.
pub(crate) fn body_id(body: &[u8]) -> BenchResult<u64> {
    Ok(u64::from_be_bytes(
        body.get(..8)
            .and_then(|b| b.try_into().ok())
            .ok_or("short body")?,
    ))
}

/// Parks `--count` messages through nackd and prints the park rate, RSS
/// and store size, each line's figures after `who` (empty for the
/// measured nackd).
async fn park(args: &Args, nackd: &NackdProcess, who: &str) -> BenchResult<Parking> {
    let (binary, store, pid) = (nackd.binary().to_owned(), nackd.store_dir(), nackd.pid());
    let rss_before = rss(pid);
    let queue = unique_queue("hold");
    let n = args.count;

    let (admin, admin_ch) = declare_hold_queue(&args.common.broker, &queue, 3_600_000).await?;
    let nacked_count = Arc::new(AtomicU64::new(0));
    let publishing = tokio::spawn(publish(
        admin_ch.clone(),
        queue.clone(),
        n,
        nacked_count.clone(),
        args.backlog,
    ));
    let publishing = match args.backlog {
        None => {
            let took = publishing.await.map_err(|e| e.to_string())??;
            crate::out!(
                "publish     {who}{n} messages of 1 KiB to RabbitMQ in {:.1} s, before parking",
                took.as_secs_f64()
            );
            None
        }
        Some(_) => Some(publishing),
    };

    let consumer = connect(&nackd.addr().to_string()).await?;
    let (_cch, mut deliveries) = consume_queue(&consumer, &queue).await?;
    let mut nacked = 0u64;
    let mut first = None;
    let mut nacked_at = vec![None; n as usize];
    while nacked < n {
        let d = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
            .await
            .map_err(|_| "no delivery for 30 s")?
            .ok_or("consumer closed")??;
        first.get_or_insert_with(Instant::now);
        let id = body_id(&d.data)?;
        if let Some(slot) = nacked_at.get_mut(id as usize) {
            *slot = Some(Instant::now());
        }
        d.nack(BasicNackOptions {
            requeue: false,
            multiple: false,
        })
        .await?;
        nacked += 1;
        nacked_count.store(nacked, Ordering::Relaxed);
    }
    if let (Some(publishing), Some(backlog)) = (publishing, args.backlog) {
        let took = publishing.await.map_err(|e| e.to_string())??;
        crate::out!(
            "publish     {who}{n} messages of 1 KiB to RabbitMQ in {:.1} s, alongside parking, at most {backlog} ahead of it",
            took.as_secs_f64()
        );
    }
    let first = first.unwrap_or_else(Instant::now);
    let nacks_done = first.elapsed();
    let mut parked = held(&binary, &store);
    while parked < n {
        if first.elapsed() > nacks_done + Duration::from_secs(120) {
            return Err(format!("only {parked} of {n} parked").into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        parked = held(&binary, &store);
    }
    // `store stats` polls add a little to the end; the nacks bound it from below.
    let park = first.elapsed();
    let figures = Figures {
        park_rate: n as f64 / park.as_secs_f64(),
        ..Figures::default()
    };
    crate::out!(
        "park        {who}{n} nacks in {:.1} s through nackd; all durable after {:.1} s: {:.0} nacks/s made durable",
        nacks_done.as_secs_f64(),
        park.as_secs_f64(),
        figures.park_rate
    );
    close(&consumer).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_after = rss(pid);
    let figures = Figures {
        rss_per_held: rss_after.saturating_sub(rss_before) as f64 / n as f64,
        store_mib: mib(dir_size(&store)),
        ..figures
    };
    crate::out!(
        "rss         {who}nackd {:.1} MiB with {n} held ({:.1} MiB before; {:.0} bytes per held message)",
        mib(rss_after),
        mib(rss_before),
        figures.rss_per_held
    );
    crate::out!(
        "store       {who}{:.1} MiB on disk for {n} held (bodies on disk)",
        figures.store_mib
    );
    Ok(Parking {
        figures,
        queue,
        nacked_at,
        admin,
        admin_ch,
    })
}

/// SIGKILLs nackd with `n` held and starts it on the same store; prints
/// the time to listening, to a first AMQP connection through it, to
/// interception (nacks are held again) and to every held message being
/// scheduled again (the older store segments read), with what its
/// recovery log line says, after `who`. Returns the time to serving and to
/// interception.
async fn restart_once(
    nackd: &mut NackdProcess,
    n: u64,
    who: &str,
) -> BenchResult<(Duration, Duration)> {
    let to_listening = nackd.restart()?;
    let began = Instant::now();
    let conn = connect(&nackd.addr().to_string()).await?;
    let to_serving = to_listening + began.elapsed();
    close(&conn).await;
    let mut to_intercepting = None;
    let rescheduled = loop {
        if to_intercepting.is_none() && nackd.intercepting() {
            to_intercepting = Some(to_listening + began.elapsed());
        }
        if let Some(held) = nackd.recovered_held() {
            break held;
        }
        if began.elapsed() > Duration::from_secs(600) {
            return Err("no \"store recovered\" line within 600 s".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let to_recovered = to_listening + began.elapsed();
    let to_intercepting = to_intercepting.unwrap_or(to_recovered);
    crate::out!(
        "restart     {who}SIGKILL with {n} held: listening after {:.2} s, first AMQP connection through it after {:.2} s, intercepting after {:.2} s, every held message scheduled after {:.2} s",
        to_listening.as_secs_f64(),
        to_serving.as_secs_f64(),
        to_intercepting.as_secs_f64(),
        to_recovered.as_secs_f64()
    );
    crate::out!(
        "recovered   {who}{rescheduled} held re-scheduled (nackd's \"store recovered\" log line), {} in the store; nackd RSS {:.1} MiB",
        held(nackd.binary(), &nackd.store_dir()),
        mib(rss(nackd.pid()))
    );
    Ok((to_serving, to_intercepting))
}

/// Consumes the redeliveries of the parked messages through nackd and
/// reports how late each came against its nack time plus the delay.
async fn fire(
    addr: &str,
    queue: &str,
    nacked_at: &[Option<Instant>],
    delay: Duration,
) -> BenchResult<()> {
    let conn = connect(addr).await?;
    let (_ch, mut deliveries) = consume_queue(&conn, queue).await?;
    let expected = nacked_at.iter().filter(|t| t.is_some()).count();
    let last_due = nacked_at
        .iter()
        .flatten()
        .max()
        .map(|t| *t + delay)
        .unwrap_or_else(Instant::now);
    let mut lateness_us: Vec<i64> = Vec::with_capacity(expected);
    let mut first: Option<Instant> = None;
    while lateness_us.len() < expected {
        let wait = last_due.saturating_duration_since(Instant::now()) + Duration::from_secs(60);
        let d = tokio::time::timeout(wait, deliveries.next())
            .await
            .map_err(|_| "redeliveries stopped")?
            .ok_or("consumer closed")??;
        let now = Instant::now();
        first.get_or_insert(now);
        let id = body_id(&d.data)?;
        if let Some(Some(at)) = nacked_at.get(id as usize) {
            let due = *at + delay;
            lateness_us.push(if now >= due {
                now.duration_since(due).as_micros() as i64
            } else {
                -(due.duration_since(now).as_micros() as i64)
            });
        }
        d.ack(BasicAckOptions::default()).await?;
    }
    let early = lateness_us.iter().filter(|l| **l < 0).count();
    let mut sorted: Vec<u64> = lateness_us.iter().map(|l| (*l).max(0) as u64).collect();
    sorted.sort_unstable();
    let ms = |p: f64| super::stats::percentile(&sorted, p).unwrap_or(0) as f64 / 1000.0;
    let spread = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
    crate::out!(
        "fire        {} redelivered after the restart over {spread:.1} s: lateness p50 {:.1} ms p99 {:.1} ms max {:.1} ms, {early} early",
        lateness_us.len(),
        ms(50.0),
        ms(99.0),
        sorted.last().copied().unwrap_or(0) as f64 / 1000.0
    );
    close(&conn).await;
    Ok(())
}

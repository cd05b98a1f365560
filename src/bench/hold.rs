//! `nackd-bench hold`: park many messages through nackd (1 KiB bodies, a long
//! delay), then report the park rate, nackd's RSS, the store on disk, and the
//! time nackd takes to serve again after a SIGKILL with all of them held.
//!
//! Every message is published to RabbitMQ, delivered through nackd to a lapin
//! consumer that nacks it, stored by nackd and acked upstream; "parked" is
//! read back from the store with `nackd store stats`.

use std::process::Command;
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

use super::load::{close, connect, unique_queue};
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
}

/// Reads a process's resident set size in bytes.
fn rss(pid: u32) -> u64 {
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

/// Runs the scenario.
pub async fn run(args: Args) -> BenchResult<()> {
    let common = &args.common;
    let machine = Machine::probe(&common.broker).await;
    let policy = format!(
        "[[policy]]\nqueues = [\"nackd-bench-hold-*\"]\ndelays = [\"{}\"]\n",
        args.delay
    );
    let mut targets = Targets::start(common, &policy)?;
    print_header("hold", common, &machine, &targets);
    let Some(nackd) = targets.nackd.as_mut() else {
        return Err(
            "hold needs to start nackd itself (no --proxy): it reads its RSS and restarts it"
                .into(),
        );
    };
    let (binary, store, pid) = (nackd.binary().to_owned(), nackd.store_dir(), nackd.pid());
    let rss_before = rss(pid);
    let queue = unique_queue("hold");
    let n = args.count;

    let admin = connect(&common.broker).await?;
    let ch = admin.create_channel().await?;
    let mut qargs = FieldTable::default();
    qargs.insert("x-expires".into(), AMQPValue::LongInt(3_600_000));
    ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::default(), qargs)
        .await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let published = Instant::now();
    let mut body = vec![7u8; 1024];
    let mut confirms = Vec::with_capacity(1000);
    for id in 0..n {
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
    println!(
        "publish     {n} messages of 1 KiB to RabbitMQ in {:.1} s",
        published.elapsed().as_secs_f64()
    );

    let consumer = connect(&nackd.addr().to_string()).await?;
    let cch = consumer.create_channel().await?;
    cch.basic_qos(2000, BasicQosOptions::default()).await?;
    let mut deliveries = cch
        .basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut nacked = 0u64;
    let mut first = None;
    let mut nacked_at = vec![None; n as usize];
    while nacked < n {
        let d = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
            .await
            .map_err(|_| "no delivery for 30 s")?
            .ok_or("consumer closed")??;
        first.get_or_insert_with(Instant::now);
        let id = u64::from_be_bytes(d.data[..8].try_into().map_err(|_| "short body")?);
        if let Some(slot) = nacked_at.get_mut(id as usize) {
            *slot = Some(Instant::now());
        }
        d.nack(BasicNackOptions {
            requeue: false,
            multiple: false,
        })
        .await?;
        nacked += 1;
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
    println!(
        "park        {n} nacks in {:.1} s through nackd; all durable after {:.1} s: {:.0} nacks/s made durable",
        nacks_done.as_secs_f64(),
        park.as_secs_f64(),
        n as f64 / park.as_secs_f64()
    );
    close(&consumer).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_after = rss(pid);
    println!(
        "rss         nackd {:.1} MiB with {n} held ({:.1} MiB before; {:.0} bytes per held message)",
        mib(rss_after),
        mib(rss_before),
        rss_after.saturating_sub(rss_before) as f64 / n as f64
    );
    println!(
        "store       {:.1} MiB on disk for {n} held (bodies on disk)",
        mib(dir_size(&store))
    );

    let to_listening = nackd.restart()?;
    let began = Instant::now();
    let conn = connect(&nackd.addr().to_string()).await?;
    let to_serving = to_listening + began.elapsed();
    close(&conn).await;
    println!(
        "restart     SIGKILL with {n} held: listening (store recovered, wheel rebuilt) after {:.2} s, first AMQP connection through it after {:.2} s",
        to_listening.as_secs_f64(),
        to_serving.as_secs_f64()
    );
    println!(
        "recovered   {} held after the restart; nackd RSS {:.1} MiB",
        held(&binary, &store),
        mib(rss(nackd.pid()))
    );
    if args.fire {
        let delay = humantime::parse_duration(&args.delay).map_err(|e| format!("--delay: {e}"))?;
        fire(&nackd.addr().to_string(), &queue, &nacked_at, delay).await?;
    }
    let _ = ch
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    close(&admin).await;
    println!("load        average {} at the end", load_average());
    if let Some(nackd) = targets.nackd.take() {
        nackd.kill();
    }
    Ok(())
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
    let ch = conn.create_channel().await?;
    ch.basic_qos(2000, BasicQosOptions::default()).await?;
    let mut deliveries = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
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
        let id = u64::from_be_bytes(d.data[..8].try_into().map_err(|_| "short body")?);
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
    println!(
        "fire        {} redelivered after the restart over {spread:.1} s: lateness p50 {:.1} ms p99 {:.1} ms max {:.1} ms, {early} early",
        lateness_us.len(),
        ms(50.0),
        ms(99.0),
        sorted.last().copied().unwrap_or(0) as f64 / 1000.0
    );
    close(&conn).await;
    Ok(())
}

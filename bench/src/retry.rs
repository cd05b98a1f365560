//! `nackd-bench retry`: how late redeliveries come, through nackd and with
//! the two recipes users build today without it, in the same run:
//!
//! - `nackd`: the consumer nacks (`requeue=false`) through nackd;
//! - `ttl-queue-per-level`: the consumer republishes to one wait queue per
//!   delay (`x-message-ttl`, dead-lettered back to the work queue) and acks;
//! - `per-message-ttl`: the consumer republishes to a single wait queue with
//!   a per-message `expiration` (dead-lettered back) and acks;
//! - `broker-delayed-retry` (RabbitMQ 4.3+, quorum queues, asked for with
//!   `--mechanisms`): the work queue is declared with
//!   `x-delayed-retry-type = failed`, `x-delayed-retry-min` = the first delay
//!   and `x-delayed-retry-max` = the last, and the consumer calls
//!   `basic.reject(requeue=true)`; the broker holds the message back
//!   `min(min × delivery-count, max)`. Its schedule is linear, so this
//!   mechanism needs `--delays` of the form d, 2d, 3d, ...
//!
//! `--quorum` declares every work queue as a quorum queue, so all
//! mechanisms run on the same kind of queue.
//!
//! Messages are published at a fixed rate; each is retried once per delay of
//! the schedule, then acked. Lateness = actual delay − scheduled delay,
//! measured by the consumer from its own nack/republish to the redelivery.
//! The knee of a mechanism is the highest rate tried whose p99 lateness stays
//! within `--knee-ms`, by the median of `--rounds` rounds; within a round the
//! mechanisms take turns at each rate, so they share the machine's state.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};

use super::baseline::BaselineArgs;
use super::cpu::{us_per_message, CpuSample, Processes};
use super::load::{close, connect, consume_queue, durable, unique_queue};
use super::machine::Machine;
use super::stats::percentile;
use super::{print_footer, print_header, BenchResult, Common, Targets};

/// Options of the retry scenario.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub common: Common,
    /// Retry rates to try, in retries per second (messages/s × delays).
    #[arg(long, value_delimiter = ',', default_value = "300,750,1500,3000,4500")]
    pub rates: Vec<u64>,
    /// The schedule in ms: every message is retried once per delay.
    #[arg(long, value_delimiter = ',', default_value = "100,200,400")]
    pub delays: Vec<u64>,
    /// p99 lateness (ms) a rate must keep to count below the knee.
    #[arg(long, default_value_t = 20)]
    pub knee_ms: u64,
    /// The mechanisms to compare (nackd always comes first).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "nackd,ttl-queue-per-level,per-message-ttl"
    )]
    pub mechanisms: Vec<Mechanism>,
    /// Declare the work queues as quorum queues (durable).
    #[arg(long)]
    pub quorum: bool,
    /// Append what the consumer saw, one line per delivery (queue, id,
    /// attempt, wall-clock µs when the consumer read the delivery, before
    /// and after its nack/republish was handed to its client), to FILE:
    /// for bench/profile/retry_trace.py, which sets it beside a capture.
    #[arg(long, value_name = "FILE")]
    pub consumer_trace: Option<std::path::PathBuf>,
    // The lane `nackd-baseline`: another nackd build or config, measured
    // in the same rounds.
    #[command(flatten)]
    pub baseline: BaselineArgs,
}

/// The label of the lane `--baseline-nackd`/`--baseline-rev`/`--baseline-config` adds.
const BASELINE: &str = "nackd-baseline";

/// One column of the comparison: a mechanism, and for nackd which process.
struct Lane {
    label: &'static str,
    mechanism: Mechanism,
    addr: String,
    /// The nackd in the path, whose CPU is counted.
    pid: Option<u32>,
}

/// The ways of retrying later.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Mechanism {
    /// Nack through nackd.
    Nackd,
    /// One TTL wait queue per delay, dead-lettered back.
    TtlQueuePerLevel,
    /// One wait queue, per-message `expiration`, dead-lettered back.
    PerMessageTtl,
    /// RabbitMQ 4.3's own quorum-queue delayed retry.
    BrokerDelayedRetry,
}

impl Mechanism {
    fn label(self) -> &'static str {
        match self {
            Self::Nackd => "nackd",
            Self::TtlQueuePerLevel => "ttl-queue-per-level",
            Self::PerMessageTtl => "per-message-ttl",
            Self::BrokerDelayedRetry => "broker-delayed-retry",
        }
    }
}

/// Checks the options that only some mechanisms accept.
fn check(args: &mut Args) -> BenchResult<()> {
    args.mechanisms.sort_unstable();
    args.mechanisms.dedup();
    if args.mechanisms.first() != Some(&Mechanism::Nackd) {
        return Err("--mechanisms must include nackd (the others are compared with it)".into());
    }
    if args.delays.is_empty() || args.rates.is_empty() {
        return Err("--delays and --rates need at least one value each".into());
    }
    if args.mechanisms.contains(&Mechanism::BrokerDelayedRetry) {
        if !args.quorum {
            return Err("broker-delayed-retry works on quorum queues only: add --quorum".into());
        }
        let d = args.delays[0];
        if args
            .delays
            .iter()
            .enumerate()
            .any(|(i, x)| *x != d * (i as u64 + 1))
        {
            return Err(format!(
                "broker-delayed-retry delays linearly (min × delivery-count): --delays must be d, 2d, 3d, ..., not {:?}",
                args.delays
            )
            .into());
        }
    }
    Ok(())
}

/// One round of one mechanism at one rate, as printed.
struct Run {
    p50: f64,
    p99: f64,
    max: f64,
    early: usize,
    complete: bool,
    /// CPU µs per retry of the lane's nackd (0 for a recipe) and of the
    /// broker, over the whole round (NaN where unknown).
    nackd_us: f64,
    broker_us: f64,
}

/// What one mechanism did at one rate.
#[derive(Debug)]
struct Outcome {
    lateness_us: Vec<i64>,
    early: usize,
    deliveries: u64,
    seconds: f64,
    published: u64,
    finished: u64,
}

impl Outcome {
    fn p(&self, p: f64) -> f64 {
        let mut sorted: Vec<u64> = self
            .lateness_us
            .iter()
            .map(|l| (*l).max(0) as u64)
            .collect();
        sorted.sort_unstable();
        percentile(&sorted, p).unwrap_or(0) as f64 / 1000.0
    }
}

/// Runs the scenario and prints one line per mechanism and rate.
pub async fn run(mut args: Args) -> BenchResult<()> {
    args.rates.sort_unstable();
    check(&mut args)?;
    let common = &args.common;
    let machine = Machine::probe(&common.broker).await;
    let delays: Vec<String> = args.delays.iter().map(|d| format!("\"{d}ms\"")).collect();
    let policy = format!(
        "[[policy]]\nqueues = [\"nackd-bench-retry-*\"]\ndelays = [{}]\n",
        delays.join(", ")
    );
    let baseline = args.baseline.resolve(common)?;
    let mut targets = Targets::start(common, &policy)?;
    if let Some(baseline) = &baseline {
        targets.start_baseline(baseline, common, &policy)?;
    }
    print_header("retry", common, &machine, &targets);
    let mut lanes = Vec::new();
    for &mechanism in &args.mechanisms {
        let (label, addr, pid) = match mechanism {
            Mechanism::Nackd => ("nackd", targets.proxy.to_string(), targets.proxy_pid),
            _ => (mechanism.label(), targets.broker.clone(), None),
        };
        lanes.push(Lane {
            label,
            mechanism,
            addr,
            pid,
        });
        if let (Mechanism::Nackd, Some(b)) = (mechanism, &targets.baseline) {
            lanes.push(Lane {
                label: BASELINE,
                mechanism,
                addr: b.addr().to_string(),
                pid: Some(b.pid()),
            });
        }
    }
    crate::out!(
        "schedule    {:?} ms per message; {} s of publishing per rate; 1 KiB bodies; {} work queues; knee = highest rate with p99 <= {} ms",
        args.delays,
        common.seconds,
        if args.quorum { "quorum" } else { "classic" },
        args.knee_ms
    );
    let rounds = common.rounds.max(1);
    crate::out!(
        "method      {rounds} rounds; each round runs every rate with the mechanisms in turn (the first one alternates by round); per mechanism and rate the median of the rounds' p50/p99 counts"
    );
    crate::out!("retry       mechanism             round  retries/s  p50 ms   p99 ms   max ms  early  earliest ms  deliveries/s  finished  nackd µs/retry  broker µs/retry");
    let mut runs: HashMap<(usize, u64), Vec<Run>> = HashMap::new();
    for round in 1..=rounds {
        for &rate in &args.rates {
            // The lane going first alternates by round, so neither always
            // runs on the machine the other left behind.
            let mut order: Vec<(usize, &Lane)> = lanes.iter().enumerate().collect();
            if round % 2 == 0 {
                order.reverse();
            }
            for (m, lane) in order {
                let processes = Processes {
                    client: None,
                    broker: targets.broker_pid.map(|(pid, _)| pid),
                    proxy: lane.pid,
                };
                let before = CpuSample::now(&processes);
                let o = one_rate(lane.mechanism, rate, &args, &targets.broker, &lane.addr).await?;
                let cpu = before.until(&CpuSample::now(&processes));
                let retries_per_sec = o.lateness_us.len().max(1) as f64 / cpu.seconds;
                let per_retry = |cores: Option<f64>| {
                    cores.map_or(f64::NAN, |c| us_per_message(c, retries_per_sec))
                };
                let run = Run {
                    p50: o.p(50.0),
                    p99: o.p(99.0),
                    max: o.lateness_us.iter().max().copied().unwrap_or(0) as f64 / 1000.0,
                    early: o.early,
                    complete: o.finished == o.published,
                    nackd_us: match lane.mechanism {
                        Mechanism::Nackd => per_retry(cpu.proxy),
                        _ => 0.0,
                    },
                    broker_us: per_retry(cpu.broker),
                };
                // How early the earliest redelivery came (0: none early).
                let earliest = o.lateness_us.iter().min().copied().unwrap_or(0).min(0);
                crate::out!(
                    "retry       {:<21} {:>5}  {:>9}  {:>6.1}  {:>7.1}  {:>7.1}  {:>5}  {:>11.1}  {:>12.0}  {}/{}  {:>14.0}  {:>15.0}",
                    lane.label,
                    round,
                    rate,
                    run.p50,
                    run.p99,
                    run.max,
                    run.early,
                    earliest as f64 / 1000.0,
                    o.deliveries as f64 / o.seconds,
                    o.finished,
                    o.published,
                    run.nackd_us,
                    run.broker_us
                );
                runs.entry((m, rate)).or_default().push(run);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    crate::out!("median      mechanism             retries/s  p50 ms   p99 ms   max ms  early  all finished  nackd µs/retry  broker µs/retry");
    let mut knees = Vec::new();
    let mut medians: HashMap<(usize, u64), [f64; 4]> = HashMap::new();
    for (m, lane) in lanes.iter().enumerate() {
        let mut knee = None;
        for &rate in &args.rates {
            let runs = &runs[&(m, rate)];
            let median = |f: fn(&Run) -> f64| {
                let mut v: Vec<f64> = runs.iter().map(f).collect();
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (p50, p99) = (median(|r| r.p50), median(|r| r.p99));
            let (nackd_us, broker_us) = (median(|r| r.nackd_us), median(|r| r.broker_us));
            medians.insert((m, rate), [p50, p99, nackd_us, broker_us]);
            let max = runs.iter().map(|r| r.max).fold(0.0, f64::max);
            let early: usize = runs.iter().map(|r| r.early).sum();
            let complete = runs.iter().all(|r| r.complete);
            crate::out!(
                "median      {:<21} {:>9}  {:>6.1}  {:>7.1}  {:>7.1}  {:>5}  {:<12}  {:>14.0}  {:>15.0}",
                lane.label,
                rate,
                p50,
                p99,
                max,
                early,
                if complete { "yes" } else { "no" },
                nackd_us,
                broker_us
            );
            if !complete {
                crate::report::spoil(format!(
                    "{} did not get every message back at {rate}/s",
                    lane.label
                ));
            }
            if early > 0 && lane.mechanism == Mechanism::Nackd {
                crate::report::spoil(format!(
                    "{} delivered {early} early at {rate}/s",
                    lane.label
                ));
            }
            if p99 <= args.knee_ms as f64 && early == 0 && complete {
                knee = Some(rate);
            }
        }
        knees.push((lane.label, knee));
    }
    if let Some(b) = lanes.iter().position(|l| l.label == BASELINE) {
        for &rate in &args.rates {
            let ([p50, p99, n_us, k_us], [b50, b99, bn_us, bk_us]) =
                (medians[&(0, rate)], medians[&(b, rate)]);
            crate::out!(
                "versus      nackd / nackd-baseline at {rate:>5}/s: p50 {:.3} / {:.3} ms, p99 {:.3} / {:.3} ms, p99 ratio {:.2}; CPU per retry nackd {:.0} / {:.0} µs, ratio {}, broker {:.0} / {:.0} µs, ratio {}",
                p50,
                b50,
                p99,
                b99,
                p99 / b99.max(0.001),
                n_us,
                bn_us,
                super::baseline::ratio(n_us, bn_us),
                k_us,
                bk_us,
                super::baseline::ratio(k_us, bk_us)
            );
        }
    }
    let describe = |k: Option<u64>| match k {
        Some(r) if Some(&r) == args.rates.last() => format!(">= {r} retries/s (every rate tried)"),
        Some(r) => format!("{r} retries/s"),
        None => format!("< {} retries/s (no rate tried)", args.rates[0]),
    };
    for (m, k) in &knees {
        crate::out!("knee        {:<21} {}", m, describe(*k));
    }
    if let Some(nackd) = knees[0].1 {
        for (m, k) in &knees[1..] {
            match k {
                Some(k) => crate::out!(
                    "ratio       knee nackd / {:<21} {:.2}",
                    m,
                    nackd as f64 / *k as f64
                ),
                None => crate::out!(
                    "ratio       knee nackd / {:<21} above (the recipe has no knee in range)",
                    m
                ),
            }
        }
    }
    print_footer(targets);
    Ok(())
}

/// One rate of retries nacked through the nackd at `addr` (messages
/// published straight to `broker`), as the `nackd` mechanism of `run`
/// measures it: for `nackd-bench replica`.
pub(crate) async fn nackd_rate(
    retries: u64,
    args: &Args,
    broker: &str,
    addr: &str,
) -> BenchResult<RateFigures> {
    let o = one_rate(Mechanism::Nackd, retries, args, broker, addr).await?;
    Ok(RateFigures {
        p50_ms: o.p(50.0),
        p99_ms: o.p(99.0),
        max_ms: o.lateness_us.iter().max().copied().unwrap_or(0) as f64 / 1000.0,
        early: o.early,
        deliveries_per_s: o.deliveries as f64 / o.seconds,
        published: o.published,
        finished: o.finished,
    })
}

/// What one rate of retries through nackd came to.
#[derive(Clone, Debug)]
pub(crate) struct RateFigures {
    /// Lateness percentiles and maximum, in ms.
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Redeliveries that came before their delay.
    pub early: usize,
    /// Deliveries per second at the consumer, first and retried.
    pub deliveries_per_s: f64,
    /// Messages published, and those that went through every retry.
    pub published: u64,
    pub finished: u64,
}

impl RateFigures {
    /// Every message went through its whole schedule.
    pub fn complete(&self) -> bool {
        self.finished == self.published
    }
}

fn args_with(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert("x-expires".into(), AMQPValue::LongInt(600_000));
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

/// Declares the work queue and the mechanism's wait queues; returns wait queue names.
async fn declare(
    ch: &Channel,
    mechanism: Mechanism,
    queue: &str,
    args: &Args,
) -> BenchResult<Vec<String>> {
    let delays = &args.delays;
    let mut work = Vec::new();
    if args.quorum {
        work.push(("x-queue-type", AMQPValue::LongString("quorum".into())));
    }
    if mechanism == Mechanism::BrokerDelayedRetry {
        let (min, max) = (delays[0], delays[delays.len() - 1]);
        work.extend([
            (
                "x-delayed-retry-type",
                AMQPValue::LongString("failed".into()),
            ),
            ("x-delayed-retry-min", AMQPValue::LongLongInt(min as i64)),
            ("x-delayed-retry-max", AMQPValue::LongLongInt(max as i64)),
        ]);
    }
    ch.queue_declare(queue.into(), durable(), args_with(&work))
        .await?;
    let back = |extra: Option<(&str, AMQPValue)>| {
        let mut pairs = vec![
            ("x-dead-letter-exchange", AMQPValue::LongString("".into())),
            (
                "x-dead-letter-routing-key",
                AMQPValue::LongString(queue.into()),
            ),
        ];
        pairs.extend(extra);
        args_with(&pairs)
    };
    let mut waits = Vec::new();
    match mechanism {
        Mechanism::Nackd | Mechanism::BrokerDelayedRetry => {}
        Mechanism::TtlQueuePerLevel => {
            for (i, d) in delays.iter().enumerate() {
                let name = format!("{queue}-wait-{i}");
                let ttl = ("x-message-ttl", AMQPValue::LongInt(*d as i32));
                ch.queue_declare(name.as_str().into(), durable(), back(Some(ttl)))
                    .await?;
                waits.push(name);
            }
        }
        Mechanism::PerMessageTtl => {
            let name = format!("{queue}-wait");
            ch.queue_declare(name.as_str().into(), durable(), back(None))
                .await?;
            waits.push(name);
        }
    }
    Ok(waits)
}

fn attempt(d: &lapin::message::Delivery, mechanism: Mechanism) -> usize {
    let key = match mechanism {
        Mechanism::Nackd => "x-retry-count",
        _ => "x-attempt",
    };
    match d
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(key))
    {
        Some(AMQPValue::LongLongInt(n)) => *n as usize,
        Some(AMQPValue::LongInt(n)) => *n as usize,
        _ => 0,
    }
}

async fn one_rate(
    mechanism: Mechanism,
    retries: u64,
    args: &Args,
    broker: &str,
    addr: &str,
) -> BenchResult<Outcome> {
    let delays = &args.delays;
    let queue = unique_queue("retry");
    let admin = connect(broker).await?;
    let ach = admin.create_channel().await?;
    let waits = declare(&ach, mechanism, &queue, args).await?;
    let consumer_conn = connect(addr).await?;
    let (cch, mut deliveries) = consume_queue(&consumer_conn, &queue).await?;
    let rate = (retries as f64 / delays.len() as f64).max(1.0);
    let mut publisher = Some(tokio::spawn(publish(
        broker.to_string(),
        queue.clone(),
        rate,
        Duration::from_secs(args.common.seconds),
    )));
    let began = Instant::now();
    let mut waiting: HashMap<u64, (Instant, u64)> = HashMap::new();
    // The broker's own delayed retry writes no attempt header of ours: the
    // consumer counts its rejects of each message.
    let mut rejects: HashMap<u64, usize> = HashMap::new();
    let mut o = Outcome {
        lateness_us: Vec::new(),
        early: 0,
        deliveries: 0,
        seconds: 0.0,
        published: 0,
        finished: 0,
    };
    let total_delay: u64 = delays.iter().sum();
    let mut published: Option<u64> = None;
    let mut trace: Vec<String> = Vec::new();
    loop {
        if publisher.as_ref().is_some_and(|p| p.is_finished()) {
            let done = publisher
                .take()
                .expect("checked")
                .await
                .map_err(|e| e.to_string())??;
            published = Some(done);
        }
        if published.is_some_and(|p| o.finished >= p) {
            break;
        }
        let limit = Duration::from_secs(args.common.seconds)
            + Duration::from_millis(total_delay * 4)
            + Duration::from_secs(15);
        if began.elapsed() > limit {
            break;
        }
        let Ok(next) = tokio::time::timeout(Duration::from_millis(200), deliveries.next()).await
        else {
            continue;
        };
        let Some(delivery) = next else { break };
        let d = delivery?;
        let now = Instant::now();
        let seen_us = crate::wall_us();
        o.deliveries += 1;
        let id = u64::from_be_bytes(d.data[..8].try_into().map_err(|_| "short body")?);
        let n = match mechanism {
            Mechanism::BrokerDelayedRetry => rejects.get(&id).copied().unwrap_or(0),
            _ => attempt(&d, mechanism),
        };
        if n > 0 {
            if let Some((asked, delay_ms)) = waiting.remove(&id) {
                let late = now.duration_since(asked).as_micros() as i64 - (delay_ms as i64) * 1000;
                if late < 0 {
                    o.early += 1;
                }
                o.lateness_us.push(late);
            }
        }
        if n < delays.len() {
            waiting.insert(id, (Instant::now(), delays[n]));
            if mechanism == Mechanism::BrokerDelayedRetry {
                rejects.insert(id, n + 1);
            }
            let before_us = crate::wall_us();
            retry_later(&cch, &d, mechanism, &queue, &waits, n, delays[n]).await?;
            if args.consumer_trace.is_some() {
                trace.push(format!(
                    "{queue} {id} {n} {seen_us} {before_us} {}\n",
                    crate::wall_us()
                ));
            }
        } else {
            d.ack(BasicAckOptions::default()).await?;
            rejects.remove(&id);
            o.finished += 1;
        }
    }
    o.seconds = began.elapsed().as_secs_f64();
    o.published = published.unwrap_or(0);
    if let Some(file) = &args.consumer_trace {
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)?;
        f.write_all(trace.concat().as_bytes())?;
    }
    close(&consumer_conn).await;
    for q in waits.iter().chain(std::iter::once(&queue)) {
        let _ = ach
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    close(&admin).await;
    Ok(o)
}

async fn retry_later(
    ch: &Channel,
    d: &lapin::message::Delivery,
    mechanism: Mechanism,
    queue: &str,
    waits: &[String],
    n: usize,
    delay_ms: u64,
) -> BenchResult<()> {
    match mechanism {
        Mechanism::Nackd => {
            d.nack(BasicNackOptions {
                requeue: false,
                multiple: false,
            })
            .await?;
            return Ok(());
        }
        // A reject counts as a failed delivery (a nack would not raise the
        // delivery-count that the broker's delay grows with).
        Mechanism::BrokerDelayedRetry => {
            d.reject(BasicRejectOptions { requeue: true }).await?;
            return Ok(());
        }
        _ => {}
    }
    let mut headers = FieldTable::default();
    headers.insert("x-attempt".into(), AMQPValue::LongLongInt(n as i64 + 1));
    let mut props = BasicProperties::default().with_headers(headers);
    let wait = match mechanism {
        Mechanism::TtlQueuePerLevel => &waits[n],
        _ => {
            props = props.with_expiration(delay_ms.to_string().as_str().into());
            &waits[0]
        }
    };
    let _ = queue;
    ch.basic_publish(
        "".into(),
        wait.as_str().into(),
        BasicPublishOptions::default(),
        &d.data,
        props,
    )
    .await?;
    d.ack(BasicAckOptions::default()).await?;
    Ok(())
}

/// Publishes 1 KiB messages (id first) straight to the broker at `rate`/s.
async fn publish(
    broker: String,
    queue: String,
    rate: f64,
    for_how_long: Duration,
) -> BenchResult<u64> {
    let conn = connect(&broker).await?;
    let ch = conn.create_channel().await?;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let began = Instant::now();
    let mut id = 0u64;
    let mut body = vec![0u8; 1024];
    while began.elapsed() < for_how_long {
        tick.tick().await;
        body[..8].copy_from_slice(&id.to_be_bytes());
        ch.basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            &body,
            BasicProperties::default(),
        )
        .await?;
        id += 1;
    }
    close(&conn).await;
    Ok(id)
}

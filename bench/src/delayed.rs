//! `nackd-bench delayed`: delayed publishes (`x-delay` to an
//! `x-delayed-message` exchange, which nackd emulates) in three parts:
//!
//! 1. **Confirmed publish rate**, in alternating rounds: a publisher with
//!    a window of `--window` unconfirmed publishes sends 1 KiB messages
//!    straight to a plain `direct` exchange on the broker, and through
//!    nackd to a delayed exchange with `x-delay` = 1 h (each confirm then
//!    means "stored and fsynced by nackd"). The ratio nackd / direct is
//!    printed per round and as the median.
//! 2. **Lateness**: through nackd, `--rate` delayed publishes per second
//!    for `--seconds`, each with `x-delay` = `--delay-ms`, consumed
//!    straight from the broker; lateness = arrival − (publish + delay),
//!    p50 / p99 / max, and how many came early (must be 0).
//! 3. **RAM per held message**: `--held` delayed publishes (100 B
//!    bodies, `x-delay` = 1 h) through nackd; nackd's RSS before and after,
//!    divided by the count.
//!
//! With a baseline lane (`--baseline-nackd`, `--baseline-rev`,
//! `--baseline-config`), the baseline nackd is a third side of part 1's
//! rounds (the order rotating by round), and parts 2 and 3 run on it too,
//! after nackd, with the same load; `versus` lines give nackd / baseline
//! for the confirmed publish rate and the lateness p50 / p99.

use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, ExchangeKind};

use super::baseline::{print_versus, BaselineArgs, Better};
use super::hold::rss;
use super::load::{close, connect, consume_queue, declare_queue, unique_queue};
use super::machine::Machine;
use super::rounds::{round_order, Side};
use super::stats::{median, percentile};
use super::{print_footer, print_header, BenchResult, Common, Targets};

/// Options of the delayed scenario.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub common: Common,
    /// Unconfirmed publishes a publisher keeps in flight.
    #[arg(long, default_value_t = 200)]
    pub window: usize,
    /// Delayed publishes per second in the lateness part.
    #[arg(long, default_value_t = 1000)]
    pub rate: u64,
    /// Their `x-delay`, in ms.
    #[arg(long, default_value_t = 2000)]
    pub delay_ms: u64,
    /// Delayed messages held at once in the RAM part (0: skip it).
    #[arg(long, default_value_t = 1_000_000)]
    pub held: u64,
    // The lane `nackd-baseline`: another nackd build or config, a third
    // side of every part.
    #[command(flatten)]
    pub baseline: BaselineArgs,
}

/// The label of the baseline's lines.
const BASELINE: &str = "nackd-baseline";

/// What `[delayed]` nackd runs with here.
const NACKD_TOML: &str = "[delayed]\nenabled = true\n";

fn wall_ms() -> u64 {
    crate::wall_us() / 1000
}

/// Declares `name` through `ch`: delayed (`x-delayed-message` of real
/// type direct) or a plain direct exchange; binds `queue` with key `k`.
async fn topology(ch: &Channel, name: &str, delayed: bool, queue: &str) -> BenchResult<()> {
    let mut args = FieldTable::default();
    let kind = if delayed {
        args.insert(
            "x-delayed-type".into(),
            AMQPValue::LongString(LongString::from("direct")),
        );
        ExchangeKind::Custom("x-delayed-message".into())
    } else {
        ExchangeKind::Direct
    };
    let options = ExchangeDeclareOptions {
        auto_delete: true,
        ..Default::default()
    };
    ch.exchange_declare(name.into(), kind, options, args)
        .await?;
    declare_queue(ch, queue).await?;
    ch.queue_bind(
        queue.into(),
        name.into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

fn props(delay_ms: Option<u64>, stamp: Option<u64>) -> BasicProperties {
    let mut h = FieldTable::default();
    if let Some(d) = delay_ms {
        h.insert("x-delay".into(), AMQPValue::LongLongInt(d as i64));
    }
    if let Some(s) = stamp {
        h.insert("due-ms".into(), AMQPValue::LongLongInt(s as i64));
    }
    BasicProperties::default().with_headers(h)
}

/// Publishes confirmed messages to `exchange` for `period` with a window of
/// `window`; returns messages confirmed per second.
async fn confirmed_rate(
    ch: &Channel,
    exchange: &str,
    delay_ms: Option<u64>,
    body: &[u8],
    window: usize,
    period: Duration,
) -> BenchResult<f64> {
    let start = Instant::now();
    let mut inflight = std::collections::VecDeque::new();
    let mut confirmed = 0u64;
    while start.elapsed() < period {
        while inflight.len() < window {
            let c = ch
                .basic_publish(
                    exchange.into(),
                    "k".into(),
                    BasicPublishOptions::default(),
                    body,
                    props(delay_ms, None),
                )
                .await?;
            inflight.push_back(c);
        }
        let c = inflight.pop_front().expect("window is not empty");
        if !c.await?.is_ack() {
            return Err("a publish was nacked".into());
        }
        confirmed += 1;
    }
    for c in inflight {
        if c.await?.is_ack() {
            confirmed += 1;
        }
    }
    Ok(confirmed as f64 / start.elapsed().as_secs_f64())
}

/// One round of part 1 on `addr`: the rate, and the queue to delete.
async fn rate_round(addr: &str, delayed: bool, args: &Args) -> BenchResult<f64> {
    let conn = connect(addr).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let exchange = unique_queue("delayed-x");
    let queue = unique_queue("delayed-q");
    topology(&ch, &exchange, delayed, &queue).await?;
    let body = vec![b'x'; 1024];
    let delay = delayed.then_some(3_600_000);
    let _ = confirmed_rate(
        &ch,
        &exchange,
        delay,
        &body,
        args.window,
        args.common.warmup(),
    )
    .await?;
    let rate = confirmed_rate(
        &ch,
        &exchange,
        delay,
        &body,
        args.window,
        args.common.measure(),
    )
    .await;
    let _ = ch
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    let _ = ch
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    close(&conn).await;
    rate
}

/// Part 2: lateness of delayed publishes through the nackd at `addr`
/// (`who`: the lane, "" for the measured nackd); returns p50 and p99 in ms.
async fn lateness(
    targets: &Targets,
    addr: &str,
    who: &str,
    args: &Args,
) -> BenchResult<(u64, u64)> {
    let proxy = connect(addr).await?;
    let ch = proxy.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let exchange = unique_queue("delayed-late-x");
    let queue = unique_queue("delayed-late-q");
    topology(&ch, &exchange, true, &queue).await?;
    let direct = connect(&targets.broker).await?;
    let (cch, mut consumer) = consume_queue(&direct, &queue).await?;
    let total = args.rate * args.common.seconds;
    let reader = tokio::spawn(async move {
        let mut late = Vec::with_capacity(total as usize);
        let mut early = 0u64;
        while (late.len() as u64) + early < total {
            let Some(Ok(d)) = consumer.next().await else {
                break;
            };
            let now = wall_ms();
            let due = d
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get("due-ms").cloned());
            if let Some(AMQPValue::LongLongInt(due)) = due {
                match now.checked_sub(due as u64) {
                    Some(l) => late.push(l),
                    None => early += 1,
                }
            }
            let _ = d.ack(BasicAckOptions::default()).await;
        }
        (late, early)
    });
    let gap = Duration::from_secs_f64(1.0 / args.rate as f64);
    let start = Instant::now();
    let mut confirms = Vec::with_capacity(total as usize);
    for i in 0..total {
        let at = start + gap * i as u32;
        tokio::time::sleep_until(at.into()).await;
        let due = wall_ms() + args.delay_ms;
        confirms.push(
            ch.basic_publish(
                exchange.as_str().into(),
                "k".into(),
                BasicPublishOptions::default(),
                b"late",
                props(Some(args.delay_ms), Some(due)),
            )
            .await?,
        );
    }
    let achieved = total as f64 / start.elapsed().as_secs_f64();
    for c in confirms {
        if !c.await?.is_ack() {
            return Err("a delayed publish was nacked".into());
        }
    }
    let wait = Duration::from_millis(args.delay_ms) + Duration::from_secs(30);
    let (mut late, early) = tokio::time::timeout(wait, reader)
        .await
        .map_err(|_| "delayed messages did not all arrive within delay + 30 s")??;
    late.sort_unstable();
    let p = |q| percentile(&late, q).unwrap_or(0);
    crate::out!(
        "lateness    {who}{} delayed publishes at {:.0}/s (asked {}/s), x-delay {} ms: p50 {} ms, p99 {} ms, max {} ms, early {}",
        late.len() as u64 + early,
        achieved,
        args.rate,
        args.delay_ms,
        p(50.0),
        p(99.0),
        late.last().copied().unwrap_or(0),
        early
    );
    let _ = cch
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    close(&direct).await;
    close(&proxy).await;
    if early > 0 {
        return Err(format!("{who}{early} delayed messages came early").into());
    }
    Ok((p(50.0), p(99.0)))
}

/// Part 3: RSS per held delayed message of the nackd of `side`.
async fn ram(targets: &Targets, side: Side, who: &str, args: &Args) -> BenchResult<()> {
    let target = targets.target(side);
    let Some(pid) = target.processes.proxy else {
        crate::out!("ram         {who}skipped: nackd's pid is unknown");
        return Ok(());
    };
    let conn = connect(&target.addr).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let exchange = unique_queue("delayed-ram-x");
    let queue = unique_queue("delayed-ram-q");
    topology(&ch, &exchange, true, &queue).await?;
    let before = rss(pid);
    let start = Instant::now();
    let body = [b'r'; 100];
    let mut inflight: std::collections::VecDeque<_> = std::collections::VecDeque::new();
    for _ in 0..args.held {
        if inflight.len() >= args.window {
            let c = inflight.pop_front().expect("not empty");
            let confirm: lapin::Confirmation = c.await?;
            if !confirm.is_ack() {
                return Err("a delayed publish was nacked".into());
            }
        }
        inflight.push_back(
            ch.basic_publish(
                exchange.as_str().into(),
                "k".into(),
                BasicPublishOptions::default(),
                &body,
                props(Some(3_600_000), None),
            )
            .await?,
        );
    }
    for c in inflight {
        if !c.await?.is_ack() {
            return Err("a delayed publish was nacked".into());
        }
    }
    let took = start.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = rss(pid);
    crate::out!(
        "ram         {who}{} held delayed messages (100 B bodies), stored at {:.0}/s: nackd RSS {:.1} MiB → {:.1} MiB, {:.0} B per held message",
        args.held,
        args.held as f64 / took.as_secs_f64(),
        before as f64 / 1048576.0,
        after as f64 / 1048576.0,
        after.saturating_sub(before) as f64 / args.held as f64
    );
    let _ = ch
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    close(&conn).await;
    Ok(())
}

/// Runs the delayed scenario.
pub async fn run(args: Args) -> BenchResult<()> {
    let baseline = args.baseline.resolve(&args.common)?;
    let mut targets = Targets::start(&args.common, NACKD_TOML)?;
    if let Some(baseline) = &baseline {
        targets.start_baseline(baseline, &args.common, NACKD_TOML)?;
    }
    let machine = Machine::probe(&args.common.broker).await;
    print_header("delayed", &args.common, &machine, &targets);
    let rates = rate_rounds(&targets, &args).await?;
    let of = |side: Side| {
        let rounds = rates.iter().find(|(s, _)| *s == side);
        median(rounds.map_or(&[][..], |(_, r)| r.as_slice()))
    };
    let per_round = |side: Side| -> Vec<f64> {
        let get = |side: Side| rates.iter().find(|(s, _)| *s == side).map(|(_, r)| r);
        match (get(side), get(Side::Direct)) {
            (Some(n), Some(d)) => n.iter().zip(d).map(|(n, d)| n / d).collect(),
            _ => Vec::new(),
        }
    };
    let ratios = per_round(Side::Nackd);
    crate::out!(
        "rate        median direct {:.0}/s, nackd (delayed, stored) {:.0}/s, ratio {:.3} (rounds {})",
        of(Side::Direct).unwrap_or(0.0),
        of(Side::Nackd).unwrap_or(0.0),
        median(&ratios).unwrap_or(0.0),
        joined(&ratios)
    );
    let lanes: Vec<(Side, &str)> = [(Side::Nackd, ""), (Side::Baseline, "nackd-baseline: ")]
        .into_iter()
        .filter(|(side, _)| targets.sides().contains(side))
        .collect();
    if lanes.len() > 1 {
        let ratios = per_round(Side::Baseline);
        crate::out!(
            "rate        median {BASELINE} (delayed, stored) {:.0}/s, ratio to direct {:.3} (rounds {})",
            of(Side::Baseline).unwrap_or(0.0),
            median(&ratios).unwrap_or(0.0),
            joined(&ratios)
        );
    }
    let mut late = Vec::new();
    for &(side, who) in &lanes {
        late.push(lateness(&targets, &targets.target(side).addr, who, &args).await?);
    }
    if args.held > 0 {
        for &(side, who) in &lanes {
            ram(&targets, side, who, &args).await?;
        }
    }
    if let [(p50, p99), (b50, b99)] = late[..] {
        let (nackd, baseline) = (of(Side::Nackd), of(Side::Baseline));
        let (nackd, baseline) = (nackd.unwrap_or(0.0), baseline.unwrap_or(0.0));
        print_versus(
            "confirmed rate",
            "publishes/s",
            Better::Higher,
            nackd,
            baseline,
        );
        print_versus("lateness p50", "ms", Better::Lower, p50 as f64, b50 as f64);
        print_versus("lateness p99", "ms", Better::Lower, p99 as f64, b99 as f64);
    }
    print_footer(targets);
    Ok(())
}

/// Part 1: `--rounds` rounds of every side (direct to a plain exchange,
/// nackd and the baseline to a delayed one), the order rotating by round;
/// the rates per side in round order.
async fn rate_rounds(targets: &Targets, args: &Args) -> BenchResult<Vec<(Side, Vec<f64>)>> {
    let sides = targets.sides();
    let mut rates: Vec<(Side, Vec<f64>)> = sides.iter().map(|&s| (s, Vec::new())).collect();
    for round in 0..args.common.rounds {
        for side in round_order(&sides, round) {
            let target = targets.target(side);
            let delayed = side != Side::Direct;
            let rate = rate_round(&target.addr, delayed, args).await?;
            let lane = match side {
                Side::Direct => "direct, plain exchange",
                Side::Baseline => "nackd-baseline, delayed exchange",
                _ => "nackd, delayed exchange",
            };
            crate::out!(
                "round {}     {lane}: {rate:.0} confirmed publishes/s (window {}, 1 KiB)",
                round + 1,
                args.window
            );
            if let Some((_, r)) = rates.iter_mut().find(|(s, _)| *s == side) {
                r.push(rate);
            }
        }
    }
    Ok(rates)
}

fn joined(ratios: &[f64]) -> String {
    ratios
        .iter()
        .map(|r| format!("{r:.3}"))
        .collect::<Vec<_>>()
        .join(", ")
}

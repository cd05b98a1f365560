//! Scenario `passthrough`: what putting nackd between clients and RabbitMQ
//! costs when nothing is intercepted. Four figures, each measured directly
//! and through nackd in alternating rounds:
//!
//! - throughput of one producer and one consumer, 1 KiB messages;
//! - publish → deliver latency at a fixed, non-queueing rate;
//! - aggregate throughput of busy pairs beside many idle connections;
//! - throughput of a 1 KiB / 64 KiB mix.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::task::JoinSet;

use super::cpu::{CpuSample, CpuUse};
use super::load::{self, Mark, Pair, PairSpec, Sizes};
use super::machine::Machine;
use super::stats::{median, Summary};
use super::{alternate, print_footer, print_header, BenchResult, Common, Sides, Target, Targets};

/// Target of DESIGN.md: throughput through nackd / direct.
const THROUGHPUT_RATIO_MIN: f64 = 0.90;
/// Targets of DESIGN.md: latency nackd adds, p50 and p99.
const ADDED_P50_MAX: Duration = Duration::from_micros(300);
const ADDED_P99_MAX: Duration = Duration::from_millis(2);

const KIB: usize = 1024;
/// Connections opened at once while setting up the idle ones.
const CONNECT_BATCH: usize = 20;

/// The figures of this scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Figure {
    /// 1 producer / 1 consumer, 1 KiB, as fast as confirms allow.
    Throughput,
    /// Publish → deliver latency at `--rate`.
    Latency,
    /// Idle connections beside busy pairs.
    Many,
    /// 90% 1 KiB / 10% 64 KiB.
    Mix,
}

/// `nackd-bench passthrough`
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    common: Common,
    /// Only these figures (repeatable); all by default.
    #[arg(long, value_enum)]
    only: Vec<Figure>,
    /// Publishes per second of the latency figure.
    #[arg(long, default_value_t = 1000)]
    rate: u32,
    /// Idle connections of the many-connections figure.
    #[arg(long, default_value_t = 200)]
    idle: usize,
    /// Busy producer/consumer pairs of the many-connections figure.
    #[arg(long, default_value_t = 10)]
    pairs: usize,
}

impl Args {
    fn wants(&self, figure: Figure) -> bool {
        self.only.is_empty() || self.only.contains(&figure)
    }
}

/// The load of the throughput figures: confirms window 200, prefetch 1000,
/// ack (multiple) every 100.
fn flat_out(sizes: Sizes) -> PairSpec {
    PairSpec {
        sizes,
        rate: None,
        window: 200,
        prefetch: 1000,
        ack_every: 100,
        latency: false,
    }
}

/// Runs the scenario and prints its report.
pub async fn run(args: Args) -> BenchResult<()> {
    let common = &args.common;
    let machine = Machine::probe(&common.broker).await;
    let targets = Targets::start(common, "")?;
    print_header("passthrough", common, &machine, &targets);
    let result = tokio::select! {
        result = figures(&args, &targets) => result,
        signal = interrupted() => Err(format!("interrupted by {signal}").into()),
    };
    print_footer(targets);
    result
}

/// SIGINT or SIGTERM: stop measuring, but still kill the nackd we started.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

async fn figures(args: &Args, targets: &Targets) -> BenchResult<()> {
    let common = &args.common;
    if args.wants(Figure::Throughput) {
        let sides = alternate(common.rounds, targets, |target| {
            throughput(target, Sizes::Fixed(KIB), common)
        })
        .await?;
        print_rates(
            "throughput  1 KiB, 1 producer / 1 consumer",
            &sides,
            Some(THROUGHPUT_RATIO_MIN),
            false,
        );
    }
    if args.wants(Figure::Latency) {
        let sides = alternate(common.rounds, targets, |target| {
            latency(target, args.rate, common)
        })
        .await?;
        print_latency(&format!("latency     1 KiB at {}/s", args.rate), &sides);
    }
    if args.wants(Figure::Many) {
        let sides = alternate(common.rounds, targets, |target| {
            many(target, args.idle, args.pairs, common)
        })
        .await?;
        let what = format!(
            "many conns  {} idle + {} busy pairs, 1 KiB",
            args.idle, args.pairs
        );
        print_rates(&what, &sides, None, false);
    }
    if args.wants(Figure::Mix) {
        let mix = Sizes::Mix {
            small: KIB,
            large: 64 * KIB,
            every: 10,
        };
        let sides = alternate(common.rounds, targets, |target| {
            throughput(target, mix, common)
        })
        .await?;
        print_rates("mix         90% 1 KiB / 10% 64 KiB", &sides, None, true);
    }
    Ok(())
}

/// Messages and bytes per second delivered to the consumer(s), and the CPU
/// it took.
#[derive(Clone, Copy, Debug)]
struct Rate {
    msgs: f64,
    bytes: f64,
    cpu: CpuUse,
}

/// Measures the consumers of `pairs` between the warm-up and the end.
async fn measure(pairs: &[Pair], target: &Target, common: &Common) -> BenchResult<Rate> {
    tokio::time::sleep(common.warmup()).await;
    let marks = |pairs: &[Pair]| pairs.iter().map(|p| p.flow.mark()).collect::<Vec<Mark>>();
    let before = marks(pairs);
    let cpu_before = CpuSample::now(&target.processes);
    tokio::time::sleep(common.measure()).await;
    let after = marks(pairs);
    let cpu = cpu_before.until(
        &CpuSample::now(&target.processes),
        common.measure().as_secs_f64(),
    );
    let mut rate = Rate {
        msgs: 0.0,
        bytes: 0.0,
        cpu,
    };
    for (b, a) in before.iter().zip(&after) {
        let (msgs, bytes) = b.rate_until(a);
        if msgs == 0.0 {
            return Err("a consumer received nothing while measured".into());
        }
        rate.msgs += msgs;
        rate.bytes += bytes;
    }
    Ok(rate)
}

async fn throughput(target: Target, sizes: Sizes, common: &Common) -> BenchResult<Rate> {
    let pair = Pair::start(&target.addr, "throughput", flat_out(sizes)).await?;
    let rate = measure(std::slice::from_ref(&pair), &target, common).await;
    pair.stop().await?;
    rate
}

async fn latency(target: Target, rate: u32, common: &Common) -> BenchResult<Summary> {
    let spec = PairSpec {
        rate: Some(rate),
        latency: true,
        ..flat_out(Sizes::Fixed(KIB))
    };
    let pair = Pair::start(&target.addr, "latency", spec).await?;
    tokio::time::sleep(common.warmup()).await;
    pair.flow.recording.store(true, Ordering::Relaxed);
    tokio::time::sleep(common.measure()).await;
    pair.flow.recording.store(false, Ordering::Relaxed);
    let latencies = pair.stop().await?;
    latencies
        .summary()
        .ok_or_else(|| "no message arrived while measured".into())
}

async fn many(target: Target, idle: usize, pairs: usize, common: &Common) -> BenchResult<Rate> {
    let idle = open_idle(&target.addr, idle).await?;
    let mut busy = Vec::with_capacity(pairs);
    for _ in 0..pairs {
        busy.push(Pair::start(&target.addr, "many", flat_out(Sizes::Fixed(KIB))).await?);
    }
    let rate = measure(&busy, &target, common).await;
    for pair in busy {
        pair.stop().await?;
    }
    let opened = idle.len();
    let alive = idle
        .iter()
        .filter(|(conn, ch)| conn.status().connected() && ch.status().connected())
        .count();
    close_idle(idle).await;
    if alive < opened {
        return Err(format!("{} of {opened} idle connections were lost", opened - alive).into());
    }
    rate
}

/// Opens `n` connections with one channel each, a batch at a time.
async fn open_idle(addr: &str, n: usize) -> BenchResult<Vec<(lapin::Connection, lapin::Channel)>> {
    let mut idle = Vec::with_capacity(n);
    while idle.len() < n {
        let mut batch = JoinSet::new();
        for _ in 0..CONNECT_BATCH.min(n - idle.len()) {
            let addr = addr.to_owned();
            batch.spawn(async move {
                let conn = load::connect(&addr).await?;
                let ch = conn.create_channel().await?;
                BenchResult::Ok((conn, ch))
            });
        }
        while let Some(opened) = batch.join_next().await {
            idle.push(opened??);
        }
    }
    Ok(idle)
}

async fn close_idle(idle: Vec<(lapin::Connection, lapin::Channel)>) {
    let mut closing = JoinSet::new();
    for (conn, ch) in idle {
        closing.spawn(async move {
            load::close(&conn).await;
            drop(ch);
        });
        if closing.len() >= CONNECT_BATCH {
            closing.join_next().await;
        }
    }
    closing.join_all().await;
}

fn median_of<T>(rounds: &[T], f: impl Fn(&T) -> f64) -> f64 {
    median(&rounds.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "MISSED"
    }
}

fn print_rates(what: &str, sides: &Sides<Rate>, ratio_min: Option<f64>, bytes: bool) {
    let mut medians = [0.0; 2];
    for (i, (label, rounds)) in [("direct", &sides.direct), ("nackd", &sides.nackd)]
        .into_iter()
        .enumerate()
    {
        medians[i] = median_of(rounds, |r| r.msgs);
        let each: Vec<String> = rounds.iter().map(|r| format!("{:.0}", r.msgs)).collect();
        let volume = match bytes {
            true => format!(
                " ({:.1} MiB/s)",
                median_of(rounds, |r| r.bytes) / (KIB * KIB) as f64
            ),
            false => String::new(),
        };
        println!(
            "{what}  {label:<6}  {:.0} msg/s{volume}  rounds {}  ({})",
            medians[i],
            each.join(" "),
            cpu_budget(rounds)
        );
    }
    let ratio = medians[1] / medians[0];
    let target = match ratio_min {
        Some(min) => format!("target >= {min:.2}: {}", verdict(ratio >= min)),
        None => "no target".into(),
    };
    println!("{what}  ratio   {ratio:.3} nackd/direct  {target}");
}

/// "CPUs 99% busy; CPU µs/msg client 30.1 broker 40.2 nackd 11.5 (nackd 0.30 core)"
fn cpu_budget(rounds: &[Rate]) -> String {
    let busy = median_of(rounds, |r| r.cpu.machine_busy) * 100.0;
    let mut text = format!("CPUs {busy:.0}% busy; CPU µs/msg");
    type Share = fn(&CpuUse) -> Option<f64>;
    let parts: [(&str, Share); 3] = [
        ("client", |c| c.client),
        ("broker", |c| c.broker),
        ("nackd", |c| c.nackd),
    ];
    for (name, cores) in parts {
        if rounds.iter().all(|r| cores(&r.cpu).is_some()) {
            let per_msg = median_of(rounds, |r| cores(&r.cpu).unwrap_or(f64::NAN) / r.msgs * 1e6);
            text.push_str(&format!(" {name} {per_msg:.1}"));
        }
    }
    if rounds.iter().all(|r| r.cpu.nackd.is_some()) {
        let cores = median_of(rounds, |r| r.cpu.nackd.unwrap_or(f64::NAN));
        text.push_str(&format!(" (nackd {cores:.2} core)"));
    }
    text
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn print_latency(what: &str, sides: &Sides<Summary>) {
    let mut p50 = [0.0; 2];
    let mut p99 = [0.0; 2];
    for (i, (label, rounds)) in [("direct", &sides.direct), ("nackd", &sides.nackd)]
        .into_iter()
        .enumerate()
    {
        p50[i] = median_of(rounds, |s| s.p50.as_secs_f64());
        p99[i] = median_of(rounds, |s| s.p99.as_secs_f64());
        let each = |f: fn(&Summary) -> Duration| {
            rounds
                .iter()
                .map(|s| ms(f(s)))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let count: usize = rounds.iter().map(|s| s.count).sum();
        let max = rounds.iter().map(|s| s.max).max().unwrap_or_default();
        println!(
            "{what}  {label:<6}  p50 {}  p99 {}  ({count} samples, max {})  rounds p50 {}  p99 {}",
            ms(Duration::from_secs_f64(p50[i])),
            ms(Duration::from_secs_f64(p99[i])),
            ms(max),
            each(|s| s.p50),
            each(|s| s.p99),
        );
    }
    let added = |v: [f64; 2]| (v[1] - v[0]) * 1e3;
    let (a50, a99) = (added(p50), added(p99));
    println!(
        "{what}  added   p50 {a50:+.3} ms (target <= {}: {})  p99 {a99:+.3} ms (target <= {}: {})",
        ms(ADDED_P50_MAX),
        verdict(a50 / 1e3 <= ADDED_P50_MAX.as_secs_f64()),
        ms(ADDED_P99_MAX),
        verdict(a99 / 1e3 <= ADDED_P99_MAX.as_secs_f64()),
    );
}

//! Scenario `passthrough`: what putting nackd between clients and RabbitMQ
//! costs when nothing is intercepted. Its figures, each measured directly
//! and through nackd in alternating rounds (with `--haproxy`, through
//! HAProxy in TCP mode too: the toll of a proxy that parses nothing):
//!
//! - throughput of one producer and one consumer, 1 KiB messages;
//! - the same, one message in flight at a time on each side;
//! - publish → deliver latency at a fixed, non-queueing rate;
//! - aggregate throughput of busy pairs beside many idle connections;
//! - throughput of a 1 KiB / 64 KiB mix;
//! - the throughput figure again, written the way pika writes (a write per
//!   frame) and the way amqplib writes (a write per message), each
//!   delivery acked on its own ([`super::framewise`]).
//!
//! Each figure reports the CPU per message of every process in the path;
//! the report's lines are written in [`report`].

mod report;

use std::sync::atomic::Ordering;

use tokio::task::JoinSet;

use super::baseline::BaselineArgs;
use super::cpu::{CpuSample, CpuUse};
use super::framewise::{self, Writes};
use super::haproxy::Splice;
use super::load::{self, Flow, Mark, Pair, PairSpec, Sizes};
use super::machine::Machine;
use super::rounds::alternate;
use super::stats::Summary;
use super::{print_footer, print_header, BenchResult, Common, Target, Targets};
use report::{print_latency, print_rates, Goals};

const KIB: usize = 1024;
/// Connections opened at once while setting up the idle ones.
const CONNECT_BATCH: usize = 20;

/// The figures of this scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Figure {
    /// 1 producer / 1 consumer, 1 KiB, as fast as confirms allow.
    Throughput,
    /// Request and reply: a publisher that waits for each confirm, a
    /// consumer with prefetch 1 that acks each delivery.
    Sync,
    /// Publish → deliver latency at `--rate`.
    Latency,
    /// Idle connections beside busy pairs.
    Many,
    /// 90% 1 KiB / 10% 64 KiB.
    Mix,
    /// The throughput figure written the way pika writes: each frame in
    /// a write of its own, each delivery acked on its own.
    PikaWrites,
    /// The same, written the way amqplib writes: a message's frames in
    /// one write, each delivery acked on its own.
    AmqplibWrites,
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
    /// Also measure through HAProxy in TCP mode (one thread), started by
    /// the bench on a config it writes; installs Debian's `haproxy` with
    /// apt if it is missing.
    #[arg(long)]
    haproxy: bool,
    /// How HAProxy moves bytes (if its binary has splice; else off).
    #[arg(long, value_enum, default_value_t = Splice::Always, requires = "haproxy")]
    haproxy_splice: Splice,
    // The lane `nackd-baseline`: another nackd build or config, measured
    // in the same rounds.
    #[command(flatten)]
    pub(crate) baseline: BaselineArgs,
}

impl Args {
    fn wants(&self, figure: Figure) -> bool {
        self.only.is_empty() || self.only.contains(&figure)
    }
}

/// The figures of [`framewise`]'s clients: how each writes, and its line.
const CLIENTS: [(Figure, Writes, &str); 2] = [
    (
        Figure::PikaWrites,
        Writes::Frame,
        "as pika     1 KiB, a write per frame, an ack per message",
    ),
    (
        Figure::AmqplibWrites,
        Writes::Message,
        "as amqplib  1 KiB, a write per message, an ack per message",
    ),
];

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
    let baseline = args.baseline.resolve(common)?;
    let mut targets = Targets::start(common, "")?;
    if args.haproxy {
        targets.start_haproxy(args.haproxy_splice)?;
    }
    if let Some(baseline) = &baseline {
        targets.start_baseline(baseline, common, "")?;
    }
    print_header("passthrough", common, &machine, &targets);
    let result = tokio::select! {
        result = figures(&args, &targets) => result,
        signal = interrupted() => Err(format!("interrupted by {signal}").into()),
    };
    print_footer(targets);
    result
}

/// SIGINT or SIGTERM: stop measuring, but still kill the nackd and the
/// HAProxy this run started.
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
            Some(Goals::THROUGHPUT),
            false,
        );
    }
    if args.wants(Figure::Sync) {
        let sides = alternate(common.rounds, targets, |target| sync(target, common)).await?;
        print_rates(
            "sync        1 KiB, confirm and ack each message",
            &sides,
            None,
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
    for (figure, writes, what) in CLIENTS {
        if args.wants(figure) {
            let sides = alternate(common.rounds, targets, |target| {
                client_writes(target, writes, common)
            })
            .await?;
            print_rates(what, &sides, None, false);
        }
    }
    Ok(())
}

/// Messages and bytes per second delivered to the consumer(s), publishes
/// confirmed per second, and the CPU it took. CPU per message divides by
/// `msgs`, the delivered ones: each of them was also published through the
/// same path, and `published` shows that no backlog grew meanwhile (which
/// would leave publishes uncounted).
#[derive(Clone, Copy, Debug)]
struct Rate {
    msgs: f64,
    bytes: f64,
    published: f64,
    cpu: CpuUse,
}

/// A measurement under way: the consumers' counters and the CPU counters
/// read at its start.
struct Window {
    marks: Vec<Mark>,
    cpu: CpuSample,
}

impl Window {
    /// Reads the counters of `flows` and of the processes of `target`.
    fn open(flows: &[&Flow], target: &Target) -> Self {
        Self {
            marks: flows.iter().map(|f| f.mark()).collect(),
            cpu: CpuSample::now(&target.processes),
        }
    }

    /// Reads them again: what the consumers received and the CPU it cost.
    fn close(self, flows: &[&Flow], target: &Target) -> BenchResult<Rate> {
        let after: Vec<Mark> = flows.iter().map(|f| f.mark()).collect();
        let cpu = self.cpu.until(&CpuSample::now(&target.processes));
        let mut rate = Rate {
            msgs: 0.0,
            bytes: 0.0,
            published: 0.0,
            cpu,
        };
        for (b, a) in self.marks.iter().zip(&after) {
            let rates = b.rate_until(a);
            if rates.delivered == 0.0 {
                return Err("a consumer received nothing while measured".into());
            }
            if rates.confirmed == 0.0 {
                return Err("no publish was confirmed while measured".into());
            }
            rate.msgs += rates.delivered;
            rate.bytes += rates.bytes;
            rate.published += rates.confirmed;
        }
        Ok(rate)
    }
}

/// Measures the consumers of `flows` between the warm-up and the end.
async fn measure(flows: &[&Flow], target: &Target, common: &Common) -> BenchResult<Rate> {
    tokio::time::sleep(common.warmup()).await;
    let window = Window::open(flows, target);
    tokio::time::sleep(common.measure()).await;
    window.close(flows, target)
}

async fn throughput(target: Target, sizes: Sizes, common: &Common) -> BenchResult<Rate> {
    let pair = Pair::start(&target.addr, "throughput", flat_out(sizes)).await?;
    let rate = measure(&[&pair.flow], &target, common).await;
    pair.stop().await?;
    rate
}

/// The throughput figure's load written as `writes` says, each delivery
/// acked on its own: how pika and amqplib write ([`framewise`]).
async fn client_writes(target: Target, writes: Writes, common: &Common) -> BenchResult<Rate> {
    let spec = PairSpec {
        ack_every: 1,
        ..flat_out(Sizes::Fixed(KIB))
    };
    let pair = framewise::Pair::start(&target.addr, "writes", spec, writes).await?;
    let rate = measure(&[&pair.flow], &target, common).await;
    pair.stop().await?;
    rate
}

/// One message in flight at a time on each side: what a proxy that holds
/// frames back to batch them would slow down.
async fn sync(target: Target, common: &Common) -> BenchResult<Rate> {
    let spec = PairSpec {
        window: 1,
        prefetch: 1,
        ack_every: 1,
        ..flat_out(Sizes::Fixed(KIB))
    };
    let pair = Pair::start(&target.addr, "sync", spec).await?;
    let rate = measure(&[&pair.flow], &target, common).await;
    pair.stop().await?;
    rate
}

/// Latencies at a fixed rate, and the CPU that rate cost.
#[derive(Clone, Copy, Debug)]
struct Latency {
    summary: Summary,
    rate: Rate,
}

async fn latency(target: Target, rate: u32, common: &Common) -> BenchResult<Latency> {
    let spec = PairSpec {
        rate: Some(rate),
        latency: true,
        ..flat_out(Sizes::Fixed(KIB))
    };
    let pair = Pair::start(&target.addr, "latency", spec).await?;
    let flows = [&*pair.flow];
    tokio::time::sleep(common.warmup()).await;
    pair.flow.recording.store(true, Ordering::Relaxed);
    let window = Window::open(&flows, &target);
    tokio::time::sleep(common.measure()).await;
    let measured = window.close(&flows, &target);
    pair.flow.recording.store(false, Ordering::Relaxed);
    let latencies = pair.stop().await?;
    let summary = latencies
        .summary()
        .ok_or("no message arrived while measured")?;
    Ok(Latency {
        summary,
        rate: measured?,
    })
}

async fn many(target: Target, idle: usize, pairs: usize, common: &Common) -> BenchResult<Rate> {
    let idle = open_idle(&target.addr, idle).await?;
    let mut busy = Vec::with_capacity(pairs);
    for _ in 0..pairs {
        busy.push(Pair::start(&target.addr, "many", flat_out(Sizes::Fixed(KIB))).await?);
    }
    let flows: Vec<&Flow> = busy.iter().map(|p| &*p.flow).collect();
    let rate = measure(&flows, &target, common).await;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pika_figure_writes_per_frame_and_the_amqplib_figure_per_message() {
        let of = |figure| {
            CLIENTS
                .iter()
                .find(|(f, ..)| *f == figure)
                .map(|c| (c.1, c.2))
        };
        let (pika, line) = of(Figure::PikaWrites).unwrap();
        assert_eq!(pika, Writes::Frame);
        assert!(line.starts_with("as pika ") && line.contains("a write per frame"));
        let (amqplib, line) = of(Figure::AmqplibWrites).unwrap();
        assert_eq!(amqplib, Writes::Message);
        assert!(line.starts_with("as amqplib ") && line.contains("a write per message"));
        // The report's columns: every figure's name is 12 characters wide.
        for (_, _, line) in CLIENTS {
            assert_eq!(line.find("1 KiB"), Some(12), "{line}");
        }
    }
}

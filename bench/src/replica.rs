//! `nackd-bench replica`: what the `[replica]` costs, replica off and on
//! side by side in one run (issue 13).
//!
//! The run starts two nackd processes in front of the same broker nodes,
//! with the same policies; only the second has a `[replica]` section (an
//! instance id and a group no other run uses, so no run adopts another's
//! messages). It waits until both answer `/readyz` (for the replica: the
//! lease is held and the local store agrees with the stream), then, in
//! rounds, measures on each:
//!
//! - retry lateness at each rate, exactly as `nackd-bench retry` measures
//!   its `nackd` mechanism; the knee is the highest rate whose median p99
//!   lateness stays within `--knee-ms` (no early redelivery, every message
//!   through its schedule);
//! - the park rate: `--count` messages published to the broker first, then
//!   consumed through nackd and nacked under a 1 h policy; the rate counts
//!   from the first delivery until nackd's `nackd_nacks_intercepted_total`
//!   (held, then acked upstream: with the replica, after the stream
//!   confirmed the put) has grown by `--count`.
//!
//! Off and on take turns at every rate and for every park, the one going
//! first changing each round. Every nack nackd let pass to the broker
//! (`nackd_nacks_passed_total`) is reported: there should be none.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::launcher::NackdProcess;
use super::load::{close, connect, consume_queue, unique_queue};
use super::machine::{load_average, Machine};
use super::retry::{self, RateFigures};
use super::stats::median;
use super::{BenchResult, Common};

/// Options of the replica scenario.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub upstream: Nodes,
    /// Retry rates to try, in retries per second (messages/s × delays).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "250,500,1000,1500,2000,3000"
    )]
    pub rates: Vec<u64>,
    /// The schedule in ms: every message is retried once per delay.
    #[arg(long, value_delimiter = ',', default_value = "100,200,400")]
    pub delays: Vec<u64>,
    /// p99 lateness (ms) a rate must keep to count below the knee.
    #[arg(long, default_value_t = 20)]
    pub knee_ms: u64,
    /// Messages parked per round and side.
    #[arg(long, default_value_t = 20_000)]
    pub count: u64,
    /// The most the replica may cost, in percent of the knee without it.
    #[arg(long, default_value_t = 30)]
    pub max_cost_pct: u64,
}

/// The broker nodes a scenario's nackds with `[replica]` are put in
/// front of, and the size of their streams (`replica` and `adopt`).
#[derive(Debug, Clone, clap::Args)]
pub struct Nodes {
    /// Broker nodes both nackds are put in front of (`[upstream]
    /// addresses`); default: `--broker` alone. Messages are published to
    /// `--broker`.
    #[arg(long, value_delimiter = ',', value_name = "ADDRS")]
    pub nodes: Vec<String>,
    /// `replica.cluster_size` (replicas of each stream); the broker's
    /// default when absent.
    #[arg(long)]
    pub cluster_size: Option<u32>,
}

impl Nodes {
    /// `--nodes`, or `broker` alone.
    pub(crate) fn or_broker(&mut self, broker: &str) {
        if self.nodes.is_empty() {
            self.nodes = vec![broker.to_string()];
        }
    }

    /// The `[replica]` line of `--cluster-size`, if given.
    pub(crate) fn cluster_size_toml(&self) -> String {
        self.cluster_size.map_or(String::new(), |n| {
            format!(
                "cluster_size = {n}
"
            )
        })
    }
}

/// With or without `[replica]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Replica {
    Off,
    On,
}

impl Replica {
    fn label(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::On => "on",
        }
    }
}

/// One of the two nackds.
struct Instance {
    side: Replica,
    nackd: NackdProcess,
    metrics: SocketAddr,
}

impl Instance {
    async fn counter(&self, name: &str) -> BenchResult<u64> {
        counter(self.metrics, name).await
    }

    async fn passed(&self) -> BenchResult<u64> {
        self.counter("nackd_nacks_passed_total").await
    }
}

/// The sum of counter `name` on the metrics page at `metrics`.
pub(crate) async fn counter(metrics: SocketAddr, name: &str) -> BenchResult<u64> {
    let (_, text) = http_get(metrics, "/metrics").await?;
    Ok(metric_sum(&text, name))
}

/// What one park came to.
pub(crate) struct Park {
    pub(crate) nacks_s: f64,
    pub(crate) held_s: f64,
    pub(crate) rate: f64,
}

/// Runs the scenario.
pub async fn run(mut args: Args) -> BenchResult<()> {
    if args.common.proxy.is_some() {
        return Err("replica starts both nackds itself: --proxy is not used".into());
    }
    args.rates.sort_unstable();
    args.rates.dedup();
    if args.rates.is_empty() || args.delays.is_empty() {
        return Err("--rates and --delays need a value each".into());
    }
    args.upstream.or_broker(&args.common.broker);
    let common = &args.common;
    let machine = Machine::probe(&common.broker).await;
    let run_id = crate::run_id();
    let instance = format!("nackd-bench-{run_id}");
    let group = format!("nackd-bench-{run_id}");

    let delays: Vec<String> = args.delays.iter().map(|d| format!("\"{d}ms\"")).collect();
    let mut base = format!(
        "[[policy]]\nqueues = [\"nackd-bench-retry-*\"]\ndelays = [{}]\n\
         [[policy]]\nqueues = [\"nackd-bench-hold-*\"]\ndelays = [\"1h\"]\n",
        delays.join(", ")
    );
    let mut settings = None;
    if let Some(path) = &common.nackd_config {
        let (more, shown) = crate::read_nackd_config(path)?;
        settings = Some(shown);
        base = format!("{more}\n{base}");
    }
    let replica = format!(
        "[replica]\ninstance = \"{instance}\"\ngroup = \"{group}\"\n{}",
        args.upstream.cluster_size_toml()
    );

    let binary = NackdProcess::sibling_binary()?;
    let mut instances = Vec::new();
    for side in [Replica::Off, Replica::On] {
        let extra = match side {
            Replica::Off => base.clone(),
            Replica::On => format!("{base}{replica}"),
        };
        let nackd = NackdProcess::start_nodes(&binary, &args.upstream.nodes, &extra)?;
        let metrics = nackd
            .metrics_addr()
            .ok_or("no metrics address in nackd's \"listening\" log line")?;
        instances.push(Instance {
            side,
            nackd,
            metrics,
        });
    }
    let mut ready_after = Vec::new();
    for i in &instances {
        let what = format!("replica {}", i.side.label());
        ready_after.push(wait_ready(&i.nackd, i.metrics, &what).await?);
    }

    super::print_first_lines("replica", &machine);
    crate::out!(
        "broker      {} at {} (messages published there); both nackds upstream of {}",
        machine.broker,
        common.broker,
        args.upstream.nodes.join(",")
    );
    for (i, took) in instances.iter().zip(&ready_after) {
        crate::out!(
            "nackd       replica {:<3} {} (pid {}) at {}, ready after {:.1} s",
            i.side.label(),
            i.nackd.binary().display(),
            i.nackd.pid(),
            i.nackd.addr(),
            took.as_secs_f64()
        );
    }
    crate::out!(
        "replica     instance {instance}, group {group}, cluster_size {}",
        args.upstream
            .cluster_size
            .map_or("(broker default)".to_string(), |n| n.to_string())
    );
    if let Some(settings) = &settings {
        crate::out!("nackd conf  {settings} (both)");
    }
    let rounds = common.rounds.max(1);
    crate::out!(
        "schedule    {:?} ms per message; {} s of publishing per rate; 1 KiB bodies; knee = highest rate with median p99 <= {} ms",
        args.delays, common.seconds, args.knee_ms
    );
    crate::out!(
        "method      {rounds} rounds; each round: every rate on off and on in turn, then a park of {} on each; the side going first alternates by round",
        args.count
    );

    let retry_args = retry::Args {
        common: common.clone(),
        rates: args.rates.clone(),
        delays: args.delays.clone(),
        knee_ms: args.knee_ms,
        mechanisms: vec![retry::Mechanism::Nackd],
        quorum: false,
        consumer_trace: None,
        baseline: Default::default(),
    };
    let mut runs: HashMap<(Replica, u64), Vec<RateFigures>> = HashMap::new();
    let mut parks: HashMap<Replica, Vec<Park>> = HashMap::new();
    let mut passed: HashMap<Replica, u64> = HashMap::new();
    crate::out!("retry       replica  round  retries/s  p50 ms   p99 ms   max ms  early  deliveries/s  finished  passed");
    for round in 1..=rounds {
        let order: Vec<&Instance> = match round % 2 {
            1 => instances.iter().collect(),
            _ => instances.iter().rev().collect(),
        };
        for &rate in &args.rates {
            for i in &order {
                let before = i.passed().await?;
                let addr = i.nackd.addr().to_string();
                let f = retry::nackd_rate(rate, &retry_args, &common.broker, &addr)
                    .await
                    .map_err(|e| format!("replica {} at {rate}/s: {e}", i.side.label()))?;
                let p = i.passed().await?.saturating_sub(before);
                *passed.entry(i.side).or_default() += p;
                crate::out!(
                    "retry       {:<7}  {:>5}  {:>9}  {:>6.1}  {:>7.1}  {:>7.1}  {:>5}  {:>12.0}  {}/{}  {p}",
                    i.side.label(),
                    round,
                    rate,
                    f.p50_ms,
                    f.p99_ms,
                    f.max_ms,
                    f.early,
                    f.deliveries_per_s,
                    f.finished,
                    f.published,
                );
                runs.entry((i.side, rate)).or_default().push(f);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        for i in &order {
            let before = i.passed().await?;
            let park = park(&i.nackd, i.metrics, &common.broker, args.count)
                .await
                .map_err(|e| format!("park, replica {}: {e}", i.side.label()))?;
            let p = i.passed().await?.saturating_sub(before);
            *passed.entry(i.side).or_default() += p;
            crate::out!(
                "park        replica {:<3} round {round}: {} nacks in {:.1} s; all held and acked upstream after {:.1} s: {:.0} nacks/s; {p} passed",
                i.side.label(),
                args.count,
                park.nacks_s,
                park.held_s,
                park.rate
            );
            parks.entry(i.side).or_default().push(park);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    // Medians per side and rate.
    let within = |f: &[RateFigures], p99: f64| {
        p99 <= args.knee_ms as f64 && f.iter().all(|r| r.early == 0 && r.complete())
    };
    let med = |v: Vec<f64>| median(&v).unwrap_or(f64::NAN);
    crate::out!("median      retries/s  off p50  off p99  on p50   on p99   added p99 ms  within target (off, on)");
    let mut knee: HashMap<Replica, Option<u64>> = HashMap::new();
    let mut both_within = Vec::new();
    for &rate in &args.rates {
        let mut row = Vec::new();
        for side in [Replica::Off, Replica::On] {
            let f = &runs[&(side, rate)];
            let p50 = med(f.iter().map(|r| r.p50_ms).collect());
            let p99 = med(f.iter().map(|r| r.p99_ms).collect());
            let ok = within(f, p99);
            if ok {
                knee.insert(side, Some(rate));
            } else {
                knee.entry(side).or_insert(None);
            }
            row.push((p50, p99, ok));
        }
        let yes = |b: bool| if b { "yes" } else { "no" };
        crate::out!(
            "median      {:>9}  {:>7.1}  {:>7.1}  {:>6.1}  {:>7.1}  {:>+12.1}  {}, {}",
            rate,
            row[0].0,
            row[0].1,
            row[1].0,
            row[1].1,
            row[1].1 - row[0].1,
            yes(row[0].2),
            yes(row[1].2)
        );
        if row[0].2 && row[1].2 {
            both_within.push((rate, row[0].1, row[1].1));
        }
    }
    let top = *args.rates.last().expect("checked");
    let describe = |k: Option<u64>| match k {
        Some(r) if r == top => format!(">= {r} retries/s (every rate tried)"),
        Some(r) => format!("{r} retries/s"),
        None => format!("< {} retries/s (no rate tried)", args.rates[0]),
    };
    let (off, on) = (knee[&Replica::Off], knee[&Replica::On]);
    crate::out!("knee        replica off  {}", describe(off));
    crate::out!("knee        replica on   {}", describe(on));
    let floor = 1.0 - args.max_cost_pct as f64 / 100.0;
    match (off, on) {
        (Some(off), Some(on)) => {
            let ratio = on as f64 / off as f64;
            let caveat = match (off == top, on == top) {
                (true, true) => "; both knees at or above the rates tried: try higher rates",
                (true, false) => {
                    "; the knee without the replica is at or above the rates tried: an upper bound"
                }
                _ => "",
            };
            crate::out!(
                "ratio       knee on/off {ratio:.2} (target >= {floor:.2}, the replica costing at most {} %): {}{caveat}",
                args.max_cost_pct,
                if ratio >= floor { "met" } else { "missed" }
            );
        }
        (Some(off), None) => {
            let bound = args.rates[0] as f64 / off as f64;
            let verdict = match bound <= floor {
                true => "missed",
                false => "not decided: try lower rates",
            };
            crate::out!(
                "ratio       knee on/off < {bound:.2} (the knee with the replica is below the lowest rate tried; target >= {floor:.2}): {verdict}"
            );
        }
        (None, _) => crate::out!(
            "ratio       knee on/off not measurable: no knee without the replica among the rates tried"
        ),
    }
    let park_median = |side| med(parks[&side].iter().map(|p| p.rate).collect());
    let (park_off, park_on) = (park_median(Replica::Off), park_median(Replica::On));
    let rounds_of = |side| {
        parks[&side]
            .iter()
            .map(|p| format!("{:.0}", p.rate))
            .collect::<Vec<_>>()
            .join(", ")
    };
    crate::out!(
        "park        replica off {park_off:.0} nacks/s (rounds {}); replica on {park_on:.0} nacks/s (rounds {}); ratio on/off {:.2}",
        rounds_of(Replica::Off),
        rounds_of(Replica::On),
        park_on / park_off
    );
    match both_within.last() {
        Some((rate, p99_off, p99_on)) => {
            let added: Vec<f64> = both_within.iter().map(|(_, a, b)| b - a).collect();
            crate::out!(
                "lateness    added p99 at {rate} retries/s (highest rate within target on both sides): {:+.1} ms ({p99_off:.1} -> {p99_on:.1} ms); median over the {} rates within target on both: {:+.1} ms",
                p99_on - p99_off,
                added.len(),
                med(added.clone())
            );
        }
        None => {
            crate::out!("lateness    no rate within target on both sides: added p99 not measured")
        }
    }
    for side in [Replica::Off, Replica::On] {
        let p = passed.get(&side).copied().unwrap_or(0);
        if p > 0 {
            crate::out!(
                "WARNING     replica {}: {p} nacks passed to the broker instead of being held",
                side.label()
            );
        }
    }

    crate::out!("load        average {} at the end", load_average());
    let mut compactions = 0;
    for i in instances {
        if i.side == Replica::On {
            compactions = i
                .counter("nackd_replica_compactions_total")
                .await
                .unwrap_or(0);
        }
        let label = format!("nackd log   replica {}:", i.side.label());
        crate::print_warnings(&label, "warnings/errors", &i.nackd.warnings());
        i.nackd.kill();
    }
    remove_streams(&common.broker, &instance, &group, compactions).await;
    Ok(())
}

/// Polls `/readyz` of `nackd` (`what`, for the error) until it answers
/// 200; returns how long that took.
pub(crate) async fn wait_ready(
    nackd: &NackdProcess,
    metrics: SocketAddr,
    what: &str,
) -> BenchResult<Duration> {
    let began = Instant::now();
    loop {
        let answer = http_get(metrics, "/readyz").await;
        if let Ok((200, _)) = answer {
            return Ok(began.elapsed());
        }
        if began.elapsed() > Duration::from_secs(90) {
            let why = match answer {
                Ok((code, body)) => format!("{code} {}", body.trim()),
                Err(e) => e.to_string(),
            };
            return Err(format!(
                "{what}: nackd not ready after 90 s ({why}); log {}",
                nackd.log_path().display()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Parks `count` messages through `nackd` (metrics at `metrics`; all
/// published first, to a queue of the `nackd-bench-hold-*` policy) and
/// times them until nackd counts them held and acked upstream.
pub(crate) async fn park(
    nackd: &NackdProcess,
    metrics: SocketAddr,
    broker: &str,
    count: u64,
) -> BenchResult<Park> {
    let queue = unique_queue("hold");
    let (admin, admin_ch) = super::hold::declare_hold_queue(broker, &queue, 600_000).await?;
    super::hold::publish(
        admin_ch.clone(),
        queue.clone(),
        count,
        Arc::new(AtomicU64::new(0)),
        None,
    )
    .await?;
    let base = counter(metrics, "nackd_nacks_intercepted_total").await?;
    let consumer = connect(&nackd.addr().to_string()).await?;
    let (_cch, mut deliveries) = consume_queue(&consumer, &queue).await?;
    let mut first = None;
    for _ in 0..count {
        let d = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
            .await
            .map_err(|_| "no delivery for 30 s")?
            .ok_or("consumer closed")??;
        first.get_or_insert_with(Instant::now);
        d.nack(BasicNackOptions {
            requeue: false,
            multiple: false,
        })
        .await?;
    }
    let first = first.unwrap_or_else(Instant::now);
    let nacks = first.elapsed();
    let mut again = 0u64;
    loop {
        let held = counter(metrics, "nackd_nacks_intercepted_total")
            .await?
            .saturating_sub(base);
        if held >= count {
            break;
        }
        if first.elapsed() > nacks + Duration::from_secs(120) {
            return Err(format!(
                "only {held} of {count} held 120 s after the last nack ({again} delivered again and nacked again)"
            )
            .into());
        }
        // A nack nackd could not hold (its replica not writable for a
        // moment, on a loaded machine) went back to the queue: it comes
        // again, and is nacked again.
        if let Ok(Some(d)) =
            tokio::time::timeout(Duration::from_millis(20), deliveries.next()).await
        {
            d?.nack(BasicNackOptions {
                requeue: false,
                multiple: false,
            })
            .await?;
            again += 1;
        }
    }
    let held = first.elapsed();
    close(&consumer).await;
    let _ = admin_ch
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    close(&admin).await;
    Ok(Park {
        nacks_s: nacks.as_secs_f64(),
        held_s: held.as_secs_f64(),
        rate: count as f64 / held.as_secs_f64(),
    })
}

/// Deletes the streams the replica-on nackd left in the cluster (its
/// directory, its generations, the group's registry): the run's held
/// messages must not stay in the broker. Best effort, one channel each.
pub(crate) async fn remove_streams(broker: &str, instance: &str, group: &str, compactions: u64) {
    let Ok(conn) = connect(broker).await else {
        crate::out!("cleanup     cannot connect to {broker}: replica streams of {instance} left in the broker");
        return;
    };
    let mut names = vec![
        format!("nackd.{instance}"),
        format!("nackd.instances.{group}"),
    ];
    names.extend((0..=compactions + 2).map(|g| format!("nackd.{instance}.g{g}")));
    let mut deleted = Vec::new();
    for name in names {
        let Ok(ch) = conn.create_channel().await else {
            continue;
        };
        // Deleting a queue that is not there is no error in RabbitMQ: the
        // message count tells the two apart no better, so say "if present".
        if ch
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await
            .is_ok()
        {
            deleted.push(name);
        }
        let _ = ch.close(200, "done".into()).await;
    }
    crate::out!("cleanup     deleted (where present) {}", deleted.join(", "));
    close(&conn).await;
}

/// A plain HTTP/1.0 GET (nackd's operations listener); status and body.
pub(crate) async fn http_get(addr: SocketAddr, path: &str) -> BenchResult<(u16, String)> {
    let exchange = async {
        let mut tcp = TcpStream::connect(addr).await?;
        tcp.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        tcp.read_to_end(&mut buf).await?;
        Ok::<_, std::io::Error>(buf)
    };
    let buf = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .map_err(|_| format!("GET {path} from {addr}: no answer within 5 s"))??;
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("GET {path} from {addr}: no status line"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// The sum of every series of counter `name` in a Prometheus text page.
fn metric_sum(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            (key.split('{').next()? == name).then(|| value.parse::<f64>().ok())?
        })
        .map(|v| v as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sum_adds_the_labelled_series_of_one_name_only() {
        let page = "# HELP nackd_nacks_passed Nacks\n# TYPE nackd_nacks_passed counter\n\
                    nackd_nacks_passed_total{reason=\"no_lease\"} 3\n\
                    nackd_nacks_passed_total{reason=\"recovering\"} 2\n\
                    nackd_nacks_intercepted_total 40000\n# EOF\n";
        assert_eq!(metric_sum(page, "nackd_nacks_passed_total"), 5);
        assert_eq!(metric_sum(page, "nackd_nacks_intercepted_total"), 40000);
        assert_eq!(metric_sum(page, "nackd_nacks"), 0);
    }
}

//! The lines of the passthrough report: per side the median and every
//! round, then each proxy against direct and nackd against HAProxy, as
//! ratios of medians with the spread of the per-round ratios.

use std::time::Duration;

use super::{Latency, Rate, KIB};
use crate::cpu::{us_per_message, CpuUse};
use crate::rounds::{Side, Sides};
use crate::stats::{median, Summary};

/// What a throughput figure is held to.
#[derive(Clone, Copy, Debug)]
pub(super) struct Goals {
    /// DESIGN.md: throughput through nackd / direct, at least.
    nackd_vs_direct: f64,
    /// Issue 24: throughput through nackd / through HAProxy, at least.
    nackd_vs_haproxy: f64,
    /// Issue 24: nackd's CPU per message / HAProxy's, at most.
    cpu_vs_haproxy: f64,
}

impl Goals {
    /// The 1 KiB, 1 producer / 1 consumer figure.
    pub(super) const THROUGHPUT: Goals = Goals {
        nackd_vs_direct: 0.90,
        nackd_vs_haproxy: 1.0,
        cpu_vs_haproxy: 0.7,
    };
}

/// DESIGN.md: latency a proxy may add, p50 and p99.
const ADDED_P50_MAX: Duration = Duration::from_micros(300);
const ADDED_P99_MAX: Duration = Duration::from_millis(2);

fn median_of<T>(rounds: &[T], f: impl Fn(&T) -> f64) -> f64 {
    median(&rounds.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
}

/// The smallest and largest of `values` (NaN for none).
pub(super) fn spread(values: &[f64]) -> (f64, f64) {
    values.iter().fold((f64::NAN, f64::NAN), |(lo, hi), &v| {
        (lo.min(v), hi.max(v)) // f64::min/max skip a NaN operand
    })
}

/// Round-by-round ratios `a[i] / b[i]` of two sides measured in the same
/// rounds: the spread of a comparison, paired by round.
pub(super) fn paired_ratios(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x / y).collect()
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "MISSED"
    }
}

/// "0.906 (rounds 0.881–0.930)"
fn ratio_text(a: &[f64], b: &[f64]) -> (f64, String) {
    let ratio = median(a).unwrap_or(f64::NAN) / median(b).unwrap_or(f64::NAN);
    let (lo, hi) = spread(&paired_ratios(a, b));
    (ratio, format!("{ratio:.3} (rounds {lo:.3}–{hi:.3})"))
}

/// Publishes confirmed / messages delivered beyond which a round is said
/// to have built a backlog: its rate and CPU per message count deliveries.
const BACKLOG_RATIO: f64 = 1.05;

/// "; BACKLOG: published/delivered 1.12 in rounds 2, 4" when the producer
/// outran the consumer in some round (the queue grew), else nothing.
fn backlog(rounds: &[Rate]) -> String {
    let grew: Vec<String> = rounds
        .iter()
        .enumerate()
        .filter(|(_, r)| r.published > r.msgs * BACKLOG_RATIO)
        .map(|(i, r)| format!("{} ({:.2})", i + 1, r.published / r.msgs))
        .collect();
    match grew.is_empty() {
        true => String::new(),
        false => format!(
            "  BACKLOG: published/delivered above {BACKLOG_RATIO} in rounds {}",
            grew.join(", ")
        ),
    }
}

/// CPU µs per message of the proxy in each round; `None` if a round has
/// no reading of it (direct, or a proxy this run did not start).
fn proxy_cpu(rounds: &[Rate]) -> Option<Vec<f64>> {
    rounds
        .iter()
        .map(|r| r.cpu.proxy.map(|cores| us_per_message(cores, r.msgs)))
        .collect()
}

pub(super) fn print_rates(what: &str, sides: &Sides<Rate>, goals: Option<Goals>, bytes: bool) {
    for (side, rounds) in sides.iter() {
        let msgs: Vec<f64> = rounds.iter().map(|r| r.msgs).collect();
        let each: Vec<String> = msgs.iter().map(|m| format!("{m:.0}")).collect();
        let (lo, hi) = spread(&msgs);
        let volume = match bytes {
            true => format!(
                " ({:.1} MiB/s)",
                median_of(rounds, |r| r.bytes) / (KIB * KIB) as f64
            ),
            false => String::new(),
        };
        crate::out!(
            "{what}  {:<7}  {:.0} msg/s{volume}  min–max {lo:.0}–{hi:.0}  rounds {}  ({}){}",
            side.label(),
            median_of(rounds, |r| r.msgs),
            each.join(" "),
            cpu_budget(rounds, side),
            backlog(rounds)
        );
    }
    let msgs = |side| {
        sides
            .of(side)
            .map(|r| r.iter().map(|r| r.msgs).collect::<Vec<f64>>())
    };
    let (Some(direct), Some(nackd)) = (msgs(Side::Direct), msgs(Side::Nackd)) else {
        return;
    };
    let (ratio, text) = ratio_text(&nackd, &direct);
    let target = match goals {
        Some(g) => format!(
            "target >= {:.2}: {}",
            g.nackd_vs_direct,
            verdict(ratio >= g.nackd_vs_direct)
        ),
        None => "no target".into(),
    };
    crate::out!("{what}  ratio    nackd/direct {text}  {target}");
    if let Some(baseline) = msgs(Side::Baseline) {
        let (_, text) = ratio_text(&nackd, &baseline);
        crate::out!("{what}  ratio    nackd/baseline {text}");
        print_proxy_cpu(what, sides, Side::Baseline, None);
    }
    let Some(haproxy) = msgs(Side::Haproxy) else {
        return;
    };
    let (_, text) = ratio_text(&haproxy, &direct);
    crate::out!("{what}  ratio    haproxy/direct {text}");
    let (ratio, text) = ratio_text(&nackd, &haproxy);
    let target = goals.map_or(String::new(), |g| {
        format!(
            "  issue 24 target >= {:.2}: {}",
            g.nackd_vs_haproxy,
            verdict(ratio >= g.nackd_vs_haproxy)
        )
    });
    crate::out!("{what}  ratio    nackd/haproxy {text}{target}");
    let target = goals.map(|g| g.cpu_vs_haproxy);
    print_proxy_cpu(what, sides, Side::Haproxy, target);
}

/// "proxy CPU nackd 12.3 µs/msg (rounds 11.6–13.3)  haproxy 10.9 (10.5–11.5)  nackd/haproxy 1.13 (rounds ...)",
/// nackd against `other` (HAProxy, with issue 24's target, or a baseline build).
fn print_proxy_cpu(what: &str, sides: &Sides<Rate>, other: Side, target: Option<f64>) {
    let cpu = |side| sides.of(side).and_then(proxy_cpu);
    let (Some(nackd), Some(theirs)) = (cpu(Side::Nackd), cpu(other)) else {
        crate::out!(
            "{what}  proxy CPU not known for both proxies (a proxy this run did not start)"
        );
        return;
    };
    let us = |v: &[f64]| {
        let (lo, hi) = spread(v);
        format!(
            "{:.1} µs/msg (rounds {lo:.1}–{hi:.1})",
            median(v).unwrap_or(f64::NAN)
        )
    };
    let (ratio, text) = ratio_text(&nackd, &theirs);
    let target = target.map_or(String::new(), |t| {
        format!("  issue 24 target <= {t:.2}: {}", verdict(ratio <= t))
    });
    let name = other.label();
    crate::out!(
        "{what}  proxy CPU  nackd {}  {name} {}  nackd/{name} {text}{target}",
        us(&nackd),
        us(&theirs)
    );
}

/// "CPUs 99% busy; CPU µs/msg client 30.1 broker 40.2 nackd 11.5 (nackd 0.30 core)"
fn cpu_budget(rounds: &[Rate], side: Side) -> String {
    let busy = median_of(rounds, |r| r.cpu.machine_busy) * 100.0;
    let mut text = format!("CPUs {busy:.0}% busy; CPU µs/msg");
    type Share = fn(&CpuUse) -> Option<f64>;
    let parts: [(&str, Share); 3] = [
        ("client", |c| c.client),
        ("broker", |c| c.broker),
        (side.label(), |c| c.proxy),
    ];
    for (name, cores) in parts {
        if rounds.iter().all(|r| cores(&r.cpu).is_some()) {
            let per_msg = median_of(rounds, |r| {
                us_per_message(cores(&r.cpu).unwrap_or(f64::NAN), r.msgs)
            });
            text.push_str(&format!(" {name} {per_msg:.1}"));
        }
    }
    if rounds.iter().all(|r| r.cpu.proxy.is_some()) {
        let cores = median_of(rounds, |r| r.cpu.proxy.unwrap_or(f64::NAN));
        text.push_str(&format!(" ({} {cores:.2} core)", side.label()));
    }
    text
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

pub(super) fn print_latency(what: &str, sides: &Sides<Latency>) {
    let mut medians = Vec::new();
    for (side, rounds) in sides.iter() {
        let p50 = median_of(rounds, |l| l.summary.p50.as_secs_f64());
        let p99 = median_of(rounds, |l| l.summary.p99.as_secs_f64());
        let each = |f: fn(&Summary) -> Duration| {
            rounds
                .iter()
                .map(|l| ms(f(&l.summary)))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let count: usize = rounds.iter().map(|l| l.summary.count).sum();
        let max = rounds
            .iter()
            .map(|l| l.summary.max)
            .max()
            .unwrap_or_default();
        let rates: Vec<Rate> = rounds.iter().map(|l| l.rate).collect();
        crate::out!(
            "{what}  {:<7}  p50 {}  p99 {}  ({count} samples, max {})  rounds p50 {}  p99 {}  ({})",
            side.label(),
            ms(Duration::from_secs_f64(p50)),
            ms(Duration::from_secs_f64(p99)),
            ms(max),
            each(|s| s.p50),
            each(|s| s.p99),
            cpu_budget(&rates, side),
        );
        medians.push((side, p50, p99));
    }
    let Some(&(_, d50, d99)) = medians.iter().find(|(s, ..)| *s == Side::Direct) else {
        return;
    };
    for &(side, p50, p99) in medians.iter().filter(|(s, ..)| *s != Side::Direct) {
        print_added(what, side, (p50 - d50) * 1e3, (p99 - d99) * 1e3);
    }
}

fn print_added(what: &str, side: Side, a50: f64, a99: f64) {
    crate::out!(
        "{what}  added    {} p50 {a50:+.3} ms (target <= {}: {})  p99 {a99:+.3} ms (target <= {}: {})",
        side.label(),
        ms(ADDED_P50_MAX),
        verdict(a50 / 1e3 <= ADDED_P50_MAX.as_secs_f64()),
        ms(ADDED_P99_MAX),
        verdict(a99 / 1e3 <= ADDED_P99_MAX.as_secs_f64()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_is_min_and_max() {
        assert_eq!(spread(&[3.0, 1.0, 2.0]), (1.0, 3.0));
        assert_eq!(spread(&[5.0]), (5.0, 5.0));
        let (lo, hi) = spread(&[]);
        assert!(lo.is_nan() && hi.is_nan());
    }

    #[test]
    fn ratios_pair_the_rounds() {
        let nackd = [90.0, 80.0, 100.0];
        let direct = [100.0, 100.0, 80.0];
        assert_eq!(paired_ratios(&nackd, &direct), vec![0.9, 0.8, 1.25]);
        let (ratio, text) = ratio_text(&nackd, &direct);
        // Ratio of the medians (90 / 100), spread of the pairs.
        assert!((ratio - 0.9).abs() < 1e-12);
        assert_eq!(text, "0.900 (rounds 0.800–1.250)");
    }

    fn rate(msgs: f64, proxy: Option<f64>) -> Rate {
        Rate {
            msgs,
            bytes: msgs * 1024.0,
            published: msgs,
            cpu: CpuUse {
                seconds: 1.0,
                machine_busy: 0.9,
                client: Some(0.5),
                broker: Some(0.6),
                proxy,
            },
        }
    }

    #[test]
    fn proxy_cpu_per_message_per_round() {
        let rounds = [rate(20_000.0, Some(0.3)), rate(10_000.0, Some(0.2))];
        let us = proxy_cpu(&rounds).unwrap();
        assert!((us[0] - 15.0).abs() < 1e-9 && (us[1] - 20.0).abs() < 1e-9);
        // One round without a reading: no figure rather than a wrong one.
        assert_eq!(proxy_cpu(&[rate(1.0, Some(0.1)), rate(1.0, None)]), None);
    }

    #[test]
    fn a_round_whose_queue_grew_is_named() {
        let steady = rate(10_000.0, Some(0.1));
        let mut grew = steady;
        grew.published = 11_000.0;
        assert_eq!(backlog(&[steady, steady]), "");
        assert_eq!(
            backlog(&[steady, grew]),
            "  BACKLOG: published/delivered above 1.05 in rounds 2 (1.10)"
        );
    }

    #[test]
    fn cpu_budget_names_the_proxy_of_the_side() {
        let text = cpu_budget(&[rate(20_000.0, Some(0.3))], Side::Haproxy);
        assert_eq!(
            text,
            "CPUs 90% busy; CPU µs/msg client 25.0 broker 30.0 haproxy 15.0 (haproxy 0.30 core)"
        );
        let direct = cpu_budget(&[rate(20_000.0, None)], Side::Direct);
        assert_eq!(direct, "CPUs 90% busy; CPU µs/msg client 25.0 broker 30.0");
    }
}

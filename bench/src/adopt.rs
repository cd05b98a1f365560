//! `nackd-bench adopt`: how long a failover takes with many messages held
//! (issue 36). Two nackd processes with `[replica]` (two instance ids of
//! one group) in front of the same broker nodes:
//!
//! 1. A parks `--count` messages: all but `--due` under a 1 h delay, then
//!    the `--due` last ones under `--due-in-ms`, so that they fall due
//!    while B adopts them;
//! 2. A is SIGKILLed as soon as the last of them is held and acked
//!    upstream (with the replica, after the stream confirmed it);
//! 3. B, alive all along, finds A's lease free, waits `--adopt-after`,
//!    and adopts: this reports when it had parked every message, when it
//!    committed, and when each due message came back (consumed from the
//!    broker directly), each from the kill, and the lateness of the due
//!    messages: when each came back against its due time (the nack as
//!    sent plus `--due-in-ms`; nackd's due time is no earlier, so a
//!    message back before it is early).
//!
//! Every message of A must be adopted (B's `nackd_held_messages` holds
//! them all once committed), every due one back once and none early;
//! anything else ends the run with an error. There are no rounds: a
//! failover happens once per run. With a baseline lane (`--baseline-rev`,
//! `--baseline-nackd`, `--baseline-config`) the same failover is then run
//! with the baseline's nackd as A and B, and nackd / baseline is printed
//! for the time to commit, the adoption rate and the due ones' p99.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use futures_lite::StreamExt;
use lapin::options::*;

use super::baseline::{print_versus, BaselineArgs, Better};
use super::hold::body_id;
use super::launcher::NackdProcess;
use super::load::{close, connect, consume_queue, unique_queue};
use super::machine::{load_average, Machine};
use super::replica::{counter, park, remove_streams, wait_ready, Nodes};
use super::stats::percentile;
use super::{BenchResult, Common};

/// Options of the adopt scenario.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub upstream: Nodes,
    /// Messages A holds when it is killed (the due ones included).
    #[arg(long, default_value_t = 100_000)]
    pub count: u64,
    /// Of them, messages that fall due during the adoption.
    #[arg(long, default_value_t = 1_000)]
    pub due: u64,
    /// Their delay, in ms: longer than parking them and killing A takes
    /// (else the run fails, saying so), and by default shorter than
    /// `--adopt-after`: every one falls due while A is down.
    #[arg(long, default_value_t = 3_000)]
    pub due_in_ms: u64,
    /// `replica.adopt_after`, in seconds (the heartbeat is 2 s).
    #[arg(long, default_value_t = 6)]
    pub adopt_after: u64,
    /// The run fails if the adoption has not committed this many seconds
    /// after the kill.
    #[arg(long, default_value_t = 900)]
    pub timeout: u64,
    // The lane `nackd-baseline`: the same failover with another build or
    // config, after nackd's.
    #[command(flatten)]
    pub baseline: BaselineArgs,
}

/// The policies' queue names.
const LATER: &str = "nackd-bench-hold-*";
const DUE: &str = "nackd-bench-adopt-due-*";

/// One of the two nackds.
struct Instance {
    id: String,
    nackd: NackdProcess,
    metrics: SocketAddr,
}

/// What the watch of B saw, each from the kill.
#[derive(Debug, Default)]
struct Watched {
    /// B had parked every message of A.
    parked: Option<Duration>,
    /// How long its parks took, as B logged it (from its first read of
    /// A's stream to the last park's answer): the adoption's own time,
    /// without the wait for `adopt_after` and for B's next look.
    parks_took: Option<Duration>,
    /// B logged its commit ("adoption committed", before any of them is
    /// scheduled).
    committed: Option<Duration>,
    /// B logged the commit of its first part (the soonest due: issue 36);
    /// none from a build that commits in one step, or a part-less one.
    first_part: Option<Duration>,
}

/// The figures a lane's failover came to, compared with the baseline's.
#[derive(Debug, Clone, Copy)]
struct Figures {
    /// From `adopt_after` after the kill to B's commit, in seconds.
    committed: f64,
    /// Messages B parked per second, over the time its log gives.
    rate: f64,
    /// p99 lateness of the due messages, in ms.
    p99_ms: f64,
}

/// Runs the scenario: the failover with this build's nackd, then with the
/// baseline's if there is one.
pub async fn run(mut args: Args) -> BenchResult<()> {
    if args.common.proxy.is_some() {
        return Err("adopt starts both nackds itself: --proxy is not used".into());
    }
    if args.due > args.count {
        return Err("--due is part of --count: it cannot be larger".into());
    }
    if args.adopt_after < 6 {
        return Err("--adopt-after is at least 6 s (three heartbeats of 2 s)".into());
    }
    args.upstream.or_broker(&args.common.broker);
    let baseline = args.baseline.resolve(&args.common)?;
    let machine = Machine::probe(&args.common.broker).await;
    super::print_first_lines("adopt", &machine);
    crate::out!(
        "method      A parks {} (1 KiB bodies): {} held 1 h, then {} held {} ms; A is SIGKILLed once the last is held; B adopts after adopt_after = {} s (heartbeat 2 s); the due ones are consumed from {} directly{}",
        args.count,
        args.count - args.due,
        args.due,
        args.due_in_ms,
        args.adopt_after,
        args.common.broker,
        if baseline.is_some() { "; then the same with the baseline's nackd" } else { "" }
    );
    let mine = lane(&args, &NackdProcess::sibling_binary()?, "nackd", None).await?;
    let Some(baseline) = baseline else {
        return Ok(());
    };
    if let Some(origin) = &baseline.origin {
        crate::out!("baseline rv {origin}");
    }
    let theirs = lane(
        &args,
        &baseline.binary,
        "nackd-baseline",
        baseline.config.as_deref(),
    )
    .await?;
    let versus = |what, unit, better, f: fn(&Figures) -> f64| {
        print_versus(what, unit, better, f(&mine), f(&theirs));
    };
    versus("commit after", "s", Better::Lower, |f| f.committed);
    versus("adoption rate", "msg/s", Better::Higher, |f| f.rate);
    versus("due p99 late", "ms", Better::Lower, |f| f.p99_ms);
    Ok(())
}

/// One failover with `binary` (`label`, for the output) as A and B;
/// `config` instead of `--nackd-config`, if given.
async fn lane(
    args: &Args,
    binary: &Path,
    label: &str,
    config: Option<&Path>,
) -> BenchResult<Figures> {
    let run_id = crate::run_id();
    let group = format!("nackd-bench-adopt-{run_id}");
    let (a, b) = start_both(args, binary, config, &group, &run_id).await?;
    crate::out!(
        "{label:<11} A {} (pid {}) and B (pid {}), instances {} and {} of group {group}, upstream of {}",
        a.nackd.binary().display(),
        a.nackd.pid(),
        b.nackd.pid(),
        a.id,
        b.id,
        args.upstream.nodes.join(",")
    );
    let mut a = a;
    let result = failover(args, &mut a, b).await;
    crate::out!("load        average {} at the end", load_average());
    let (b, outcome) = match result {
        Ok((b, figures)) => (Some(b), Ok(figures)),
        Err(e) => (None, Err(e)),
    };
    for (name, i) in [("A:", Some(&a)), ("B:", b.as_ref())] {
        if let Some(i) = i {
            let label = format!("nackd log   {name}");
            crate::print_warnings(&label, "warnings/errors", &i.nackd.warnings());
        }
    }
    drop(b);
    drop(a);
    for id in [
        format!("nackd-bench-a-{run_id}"),
        format!("nackd-bench-b-{run_id}"),
    ] {
        remove_streams(&args.common.broker, &id, &group, 2).await;
    }
    outcome
}

/// Starts A and B, and waits until both are ready (their leases held).
async fn start_both(
    args: &Args,
    binary: &Path,
    config: Option<&Path>,
    group: &str,
    run_id: &str,
) -> BenchResult<(Instance, Instance)> {
    let mut base = format!(
        "[[policy]]\nqueues = [\"{LATER}\"]\ndelays = [\"1h\"]\n\
         [[policy]]\nqueues = [\"{DUE}\"]\ndelays = [\"{}ms\"]\n",
        args.due_in_ms
    );
    if let Some(path) = config.or(args.common.nackd_config.as_deref()) {
        let (more, shown) = crate::read_nackd_config(path)?;
        crate::out!("nackd conf  {shown} (A and B)");
        base = format!("{more}\n{base}");
    }
    let mut both = Vec::new();
    for side in ["a", "b"] {
        let id = format!("nackd-bench-{side}-{run_id}");
        let replica = format!(
            "[replica]\ninstance = \"{id}\"\ngroup = \"{group}\"\nheartbeat = \"2s\"\nadopt_after = \"{}s\"\n{}",
            args.adopt_after,
            args.upstream.cluster_size_toml()
        );
        let nackd =
            NackdProcess::start_nodes(binary, &args.upstream.nodes, &format!("{base}{replica}"))?;
        let metrics = nackd
            .metrics_addr()
            .ok_or("no metrics address in nackd's \"listening\" log line")?;
        wait_ready(&nackd, metrics, &format!("instance {id}")).await?;
        both.push(Instance { id, nackd, metrics });
    }
    let b = both.pop().expect("two");
    let a = both.pop().expect("two");
    Ok((a, b))
}

/// Parks through A, kills it, and watches B adopt; returns B and the
/// run's verdict.
async fn failover(args: &Args, a: &mut Instance, b: Instance) -> BenchResult<(Instance, Figures)> {
    let later = args.count - args.due;
    if later > 0 {
        let p = park(&a.nackd, a.metrics, &args.common.broker, later).await?;
        crate::out!(
            "park        A: {later} held 1 h: {later} nacks in {:.1} s, all held and acked upstream after {:.1} s: {:.0} nacks/s",
            p.nacks_s, p.held_s, p.rate
        );
    }
    let due_queue = unique_queue("adopt-due");
    let (admin, admin_ch) = declare_due_queue(&args.common.broker, &due_queue, args.due).await?;
    let nacked = park_due(a, &due_queue, args.due).await?;
    let a_held = counter(a.metrics, "nackd_held_messages").await?;
    // SIGKILL; its directory (its log) stays until A is dropped.
    a.nackd.stop();
    let (killed, killed_at) = (Instant::now(), SystemTime::now());
    let due_in = Duration::from_millis(args.due_in_ms);
    let first_due = nacked.values().min().map_or(killed, |t| *t + due_in);
    crate::out!(
        "kill        A SIGKILLed holding {a_held}; the first due message is due {:.1} s after the kill",
        first_due.saturating_duration_since(killed).as_secs_f64()
    );
    if a_held != args.count || first_due <= killed {
        return Err(format!(
            "A held {a_held} of {} at the kill, the first due {:.1} s before it: choose a longer --due-in-ms",
            args.count,
            killed.saturating_duration_since(first_due).as_secs_f64()
        )
        .into());
    }

    let consumer = connect(&args.common.broker).await?;
    let (_cch, deliveries) = consume_queue(&consumer, &due_queue).await?;
    let back = tokio::spawn(collect_due(deliveries, args.due));
    let timeout = Duration::from_secs(args.timeout);
    let watched = watch(&b, args.count, (killed, killed_at), timeout).await;
    let arrivals = match back.await {
        Ok(arrivals) => arrivals,
        Err(e) => return Err(format!("the due messages' consumer: {e}").into()),
    };
    close(&consumer).await;
    let _ = admin_ch
        .queue_delete(due_queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    close(&admin).await;
    let watched = watched?;
    let b_held = settled_held(&b, args.count - args.due).await?;
    let figures = report(args, &watched, &nacked, &arrivals?, killed, b_held)?;
    Ok((b, figures))
}

/// B's held messages once they are `expected` (a fired message is
/// completed when the broker confirms it, a moment after it may be
/// delivered), or what they are after 10 s.
async fn settled_held(b: &Instance, expected: u64) -> BenchResult<u64> {
    let began = Instant::now();
    loop {
        let held = counter(b.metrics, "nackd_held_messages").await?;
        if held == expected || began.elapsed() > Duration::from_secs(10) {
            return Ok(held);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A durable queue of the due policy holding `due` messages (their ids in
/// their first 8 bytes), and the confirming channel that published them.
async fn declare_due_queue(
    broker: &str,
    queue: &str,
    due: u64,
) -> BenchResult<(lapin::Connection, lapin::Channel)> {
    let (admin, ch) = super::hold::declare_hold_queue(broker, queue, 3_600_000).await?;
    let none_nacked = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    super::hold::publish(ch.clone(), queue.to_string(), due, none_nacked, None).await?;
    Ok((admin, ch))
}

/// Nacks every message of `queue` through A; returns when each was nacked
/// (by its id), once A counts them all held and acked upstream.
async fn park_due(a: &Instance, queue: &str, due: u64) -> BenchResult<HashMap<u64, Instant>> {
    let base = counter(a.metrics, "nackd_nacks_intercepted_total").await?;
    let conn = connect(&a.nackd.addr().to_string()).await?;
    let (_ch, mut deliveries) = consume_queue(&conn, queue).await?;
    let mut nacked = HashMap::new();
    for _ in 0..due {
        let d = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
            .await
            .map_err(|_| "no delivery through A for 30 s")?
            .ok_or("A's consumer closed")??;
        nacked.insert(body_id(&d.data)?, Instant::now());
        d.nack(BasicNackOptions::default()).await?;
    }
    let began = Instant::now();
    while counter(a.metrics, "nackd_nacks_intercepted_total")
        .await?
        .saturating_sub(base)
        < due
    {
        if began.elapsed() > Duration::from_secs(60) {
            return Err("the due messages not all held by A 60 s after their nacks".into());
        }
        // One A could not hold went back to the queue: nacked again, and
        // due from then.
        if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(5), deliveries.next()).await
        {
            let d = d?;
            nacked.insert(body_id(&d.data)?, Instant::now());
            d.nack(BasicNackOptions::default()).await?;
        }
    }
    // Every delivery was nacked and acked upstream: closing requeues none.
    close(&conn).await;
    Ok(nacked)
}

/// Consumes the due messages as they come back, and for 2 s after the
/// last: each arrival once, by id (a second arrival is an error).
async fn collect_due(
    mut deliveries: lapin::Consumer,
    due: u64,
) -> BenchResult<HashMap<u64, Instant>> {
    let mut back = HashMap::new();
    // Then 2 s more: a second copy of the last ones would come meanwhile.
    let mut all_back: Option<Instant> = None;
    while all_back.is_none_or(|t| t.elapsed() < Duration::from_secs(2)) {
        let wait = match all_back {
            Some(t) => Duration::from_secs(2).saturating_sub(t.elapsed()),
            None => Duration::from_secs(900),
        };
        let d = match tokio::time::timeout(wait, deliveries.next()).await {
            Ok(Some(d)) => d?,
            Ok(None) => return Err("the due messages' consumer closed".into()),
            Err(_) if all_back.is_some() => break,
            Err(_) => {
                return Err(format!(
                    "{} of {due} due messages back, then none for 900 s",
                    back.len()
                )
                .into())
            }
        };
        let id = body_id(&d.data)?;
        if back.insert(id, Instant::now()).is_some() {
            return Err(format!("due message {id} came back twice").into());
        }
        d.ack(BasicAckOptions::default()).await?;
        if back.len() as u64 == due {
            all_back.get_or_insert_with(Instant::now);
        }
    }
    Ok(back)
}

/// Polls B until it has committed its adoption of A, printing its
/// progress every 5 s.
async fn watch(
    b: &Instance,
    count: u64,
    (killed, killed_at): (Instant, SystemTime),
    timeout: Duration,
) -> BenchResult<Watched> {
    let mut seen = Watched::default();
    let mut shown = Instant::now();
    while seen.committed.is_none() {
        let adopted = counter(b.metrics, "nackd_replica_adopted_messages_total").await?;
        if seen.parked.is_none() && adopted >= count {
            seen.parked = Some(killed.elapsed());
        }
        if let Some(at) = b
            .nackd
            .logged_at("adoption committed: its messages are scheduled")
        {
            // Its time as logged (before any of them was scheduled).
            let since = at.duration_since(killed_at).unwrap_or_default();
            seen.committed = Some(since);
            seen.parks_took = b
                .nackd
                .logged_field("parked the held messages of an adoption", "took")
                .and_then(|took| debug_duration(&took));
            // Seen on the metric after the commit: it was parked by then.
            seen.parked = Some(seen.parked.map_or(since, |p| p.min(since)));
            seen.first_part = (b.nackd)
                .logged_at("committed a part of an adoption: its messages are scheduled")
                .map(|at| at.duration_since(killed_at).unwrap_or_default());
        }
        if shown.elapsed() >= Duration::from_secs(5) {
            crate::out!(
                "progress    {:>6.1} s after the kill: B parked {adopted} of {count}",
                killed.elapsed().as_secs_f64()
            );
            shown = Instant::now();
        }
        if killed.elapsed() > timeout {
            return Err(format!(
                "B had not committed {timeout:?} after the kill ({adopted} parked)"
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(seen)
}

/// A `Duration` as its `Debug` writes it (`153.328011ms`, `2.5s`).
fn debug_duration(text: &str) -> Option<Duration> {
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (number, unit) = text.split_at(split);
    let n: f64 = number.parse().ok()?;
    let secs = match unit {
        "s" => n,
        "ms" => n / 1e3,
        "µs" | "us" => n / 1e6,
        "ns" => n / 1e9,
        _ => return None,
    };
    Some(Duration::from_secs_f64(secs))
}

/// Prints the figures and returns them; an error if a message is missing
/// or early.
fn report(
    args: &Args,
    seen: &Watched,
    nacked: &HashMap<u64, Instant>,
    back: &HashMap<u64, Instant>,
    killed: Instant,
    b_held: u64,
) -> BenchResult<Figures> {
    let secs = |d: Option<Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64());
    let adopt_after = args.adopt_after as f64;
    let committed = secs(seen.committed);
    let took = secs(seen.parks_took);
    let rate = args.count as f64 / took;
    let first_part = match seen.first_part {
        Some(at) => format!(
            "its first part (the soonest due) after {:.2} s ({:.1} s after adopt_after)",
            at.as_secs_f64(),
            at.as_secs_f64() - adopt_after
        ),
        None => "no part committed before it".into(),
    };
    crate::out!(
        "adoption    from the kill: every message parked by B after {:.2} s, committed after {committed:.2} s ({:.1} s after adopt_after, B's next look included), {first_part}; B's parks took {took:.2} s: {rate:.0} messages/s",
        secs(seen.parked),
        committed - adopt_after,
    );
    let due_in = Duration::from_millis(args.due_in_ms);
    let mut late_us = Vec::new();
    let mut early = 0;
    for (id, at) in back {
        let due = nacked[id] + due_in;
        match at.checked_duration_since(due) {
            Some(late) => late_us.push(late.as_micros() as u64),
            None => early += 1,
        }
    }
    late_us.sort_unstable();
    let ms = |p: f64| percentile(&late_us, p).map_or(f64::NAN, |us| us as f64 / 1000.0);
    let since_kill = |t: Option<&Instant>| t.map(|t| t.saturating_duration_since(killed));
    let (first, last) = (
        since_kill(back.values().min()),
        since_kill(back.values().max()),
    );
    crate::out!(
        "due         {} of {} back, {early} early; lateness p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; the first back {:.2} s after the kill, the last {:.2} s ({:.1} s after adopt_after)",
        back.len(),
        args.due,
        ms(50.0),
        ms(99.0),
        ms(100.0),
        secs(first),
        secs(last),
        secs(last) - adopt_after
    );
    // B held A's messages; the due ones have fired since.
    let expected = args.count - args.due;
    crate::out!("held        B holds {b_held} after the commit and the due ones' return ({expected} expected)");
    if early > 0 {
        return Err(format!("{early} due messages came back early").into());
    }
    if b_held != expected {
        return Err(format!(
            "B holds {b_held}, not {expected}: messages lost or held twice (a count: as many of each would cancel out)"
        )
        .into());
    }
    Ok(Figures {
        committed: committed - adopt_after,
        rate,
        p99_ms: ms(99.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_logged_duration_is_read_in_its_unit() {
        let ms = |t: &str| debug_duration(t).map(|d| d.as_secs_f64() * 1e3);
        assert_eq!(ms("153.5ms"), Some(153.5));
        assert_eq!(ms("2.25s"), Some(2250.0));
        assert_eq!(ms("40µs"), Some(0.04));
        assert_eq!(ms("1h"), None);
        assert_eq!(ms("ms"), None);
    }
}

//! A local 3-node RabbitMQ cluster (`scripts/cluster`) for tests of
//! replication and upstream failover, beside the default broker on 5672.
//!
//! Its release follows `NACKD_TEST_BROKER` like the single broker's (see
//! [`super::broker`]): 3.10 by default (`ha1..ha3@localhost` on
//! 127.0.0.1:5681..5683, the machine's RabbitMQ), `4.3` for RabbitMQ 4.3
//! from `scripts/broker4`'s root (`ha43_1..ha43_3@localhost` on
//! 127.0.0.1:5691..5693). A 4.3 cluster must answer as 4.3.
//!
//! [`cluster`] starts it (or reuses it) once per test binary and leaves it
//! running, so the next binary finds it up in a second or two; run
//! `scripts/cluster stop` to free its ~400 MB. The script serialises itself
//! with a file lock, so binaries and threads never start it twice.
//!
//! Tests run in parallel (threads of one binary, or processes under
//! `cargo nextest`): a test that stops a node holds [`Cluster::exclusive`],
//! one that needs all three nodes up holds [`Cluster::steady`], and the two
//! never overlap. Both are file locks ([`super::lock_file`]), one per
//! release, so they hold across processes.
#![allow(dead_code)]

use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use lapin::Connection;

use super::{lock_file, Lock};

pub const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster");

/// The release `scripts/cluster` runs (`NACKD_CLUSTER_BROKER`), from
/// `NACKD_TEST_BROKER`; panics on one it has no cluster of (tests never
/// skip).
fn release() -> &'static str {
    match super::broker::chosen().trim() {
        "" | "3.10" => "3.10",
        "4.3" => "4.3",
        other => panic!(
            "NACKD_TEST_BROKER={other:?}: scripts/cluster runs 3.10 or 4.3 clusters, \
             and this test needs a cluster"
        ),
    }
}

/// The three nodes, numbered 1..=3 like ha1..ha3 (ha43_1..ha43_3) in
/// `scripts/cluster`.
pub struct Cluster {
    addrs: Vec<String>,
    /// What node 1 says in `connection.start`, e.g. "4.3.6".
    version: String,
}

/// A hold on the cluster's nodes ([`Cluster::steady`] or
/// [`Cluster::exclusive`]), released when dropped: the nodes' lock, and for
/// an exclusive hold the gate (see [`Cluster::hold`]).
pub struct Nodes(std::fs::File, Option<std::fs::File>);

/// The cluster, started on first use in this test binary; panics (with the
/// script's stderr) when it cannot be had: tests never skip.
pub fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();
    // A failure is kept too, so parallel tests do not each retry a start
    // that takes half a minute and fails again.
    let got = CLUSTER.get_or_init(|| {
        // Each test is a process of its own under nextest: a cluster whose
        // three nodes answer as the release asked for is taken as it is
        // (`scripts/cluster start` would check it again with rabbitmqctl,
        // seconds of CPU per test).
        let known = addrs_of(release());
        if let Some(version) = formed().then(|| check_release(&known).ok()).flatten() {
            return Ok(Cluster {
                addrs: known,
                version,
            });
        }
        let addrs = run(&["start"])?;
        let addrs: Vec<String> = addrs.lines().map(str::to_owned).collect();
        if addrs.len() != 3 {
            return Err(format!("scripts/cluster start printed {addrs:?}"));
        }
        let version = check_release(&addrs)?;
        Ok(Cluster { addrs, version })
    });
    let cluster = match got {
        Ok(c) => c,
        Err(e) => panic!("no RabbitMQ {} cluster for this test: {e}", release()),
    };
    // From then on, a failing test names the cluster it ran against.
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let label = cluster.label();
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            eprintln!("(this test ran against the {label})");
            default(info);
        }));
    });
    cluster
}

/// Whether `scripts/cluster` formed the cluster of this release once (its
/// marker in the state directory; `stop` removes the directory).
fn formed() -> bool {
    let dir = std::env::var("NACKD_CLUSTER_DIR").unwrap_or_else(|_| match release() {
        "4.3" => "/tmp/nackd-cluster-4.3".into(),
        _ => "/tmp/nackd-cluster".into(),
    });
    std::path::Path::new(&dir).join("formed").exists()
}

/// The three AMQP addresses `scripts/cluster` gives the nodes of `release`.
fn addrs_of(release: &str) -> Vec<String> {
    let base = if release == "4.3" { 5690 } else { 5680 };
    (1..=3).map(|n| format!("127.0.0.1:{}", base + n)).collect()
}

/// Every node's version, which must be one, and the release asked for
/// when it is not the default: a suite meant for 4.3 never passes on 3.10.
fn check_release(addrs: &[String]) -> Result<String, String> {
    let mut versions = Vec::new();
    for addr in addrs {
        versions.push(super::broker::probe_version(addr).map_err(|e| format!("{addr}: {e}"))?);
    }
    let version = versions[0].clone();
    if versions.iter().any(|v| *v != version) {
        return Err(format!(
            "the nodes {addrs:?} answer as RabbitMQ {versions:?}"
        ));
    }
    if release() != "3.10" && !version.starts_with(&format!("{}.", release())) {
        return Err(format!(
            "NACKD_TEST_BROKER={} but the cluster answers as RabbitMQ {version}",
            release()
        ));
    }
    Ok(version)
}

/// Runs `scripts/cluster ARGS`; its stdout, or an error with its stderr.
fn run(args: &[&str]) -> Result<String, String> {
    let start = Instant::now();
    let out = Command::new(SCRIPT)
        .env("NACKD_CLUSTER_BROKER", release())
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {SCRIPT}: {e}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprint!("{stderr}");
    if !out.status.success() {
        return Err(format!(
            "`NACKD_CLUSTER_BROKER={} scripts/cluster {}` failed ({}) after {:?}:\n{stderr}",
            release(),
            args.join(" "),
            out.status,
            start.elapsed()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `run` off the async runtime: a node takes seconds to stop or start, and
/// the nackd under test must keep running meanwhile.
async fn run_async(args: Vec<String>) {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run(&args).unwrap_or_else(|e| panic!("{e}"));
    })
    .await
    .unwrap();
}

fn port_open(addr: &str) -> bool {
    std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(1)).is_ok()
}

impl Cluster {
    /// "RabbitMQ 4.3.6 cluster at 127.0.0.1:5691, ...", for messages.
    pub fn label(&self) -> String {
        format!(
            "RabbitMQ {} cluster at {}",
            self.version,
            self.addrs.join(", ")
        )
    }

    /// Node `n`'s AMQP address, `127.0.0.1:568n` (`569n` on 4.3).
    pub fn addr(&self, n: usize) -> &str {
        assert!((1..=3).contains(&n), "nodes are 1, 2 and 3, not {n}");
        &self.addrs[n - 1]
    }

    /// All three addresses, node 1 first (e.g. nackd's upstream list).
    pub fn addrs(&self) -> &[String] {
        &self.addrs
    }

    /// AMQP URI of node `n` as guest, vhost "/".
    pub fn uri(&self, n: usize) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr(n))
    }

    /// A lapin connection straight to node `n`.
    pub async fn connect(&self, n: usize) -> Connection {
        super::connect(&self.uri(n)).await
    }

    /// Held by a test that needs all three nodes up (they are when it
    /// returns).
    pub async fn steady(&self) -> Nodes {
        self.hold(Lock::Shared).await
    }

    /// Held by a test that stops or kills nodes; no other cluster test
    /// runs meanwhile. All three nodes are up when it returns.
    /// (Do not also take [`Cluster::steady`]: that would wait for ever.)
    pub async fn exclusive(&self) -> Nodes {
        self.hold(Lock::Exclusive).await
    }

    /// `flock` gives a shared lock while an exclusive one waits, so tests
    /// that need all nodes, one after another, could keep a test that stops
    /// a node waiting for as long as any of them ran (270 s of a 3.10
    /// clusters' pass, 2026-11-30, its slot idle meanwhile). A gate gives
    /// the stopper its turn: it holds the gate from its wait to its end,
    /// and a test that needs all nodes passes through the gate before it
    /// takes its share, so it waits behind a stopper that came first.
    async fn hold(&self, how: Lock) -> Nodes {
        let name = format!("cluster-{}", release());
        let (nodes, gate) = tokio::task::spawn_blocking(move || {
            let gate = lock_file(&format!("{name}-gate"), Lock::Exclusive);
            let nodes = lock_file(&name, how);
            match how {
                Lock::Shared => (nodes, None),
                Lock::Exclusive => (nodes, Some(gate)),
            }
        })
        .await
        .unwrap();
        self.all_up().await;
        Nodes(nodes, gate)
    }

    /// Brings back a node an earlier (failed) test left down.
    async fn all_up(&self) {
        if !self.addrs.iter().all(|a| port_open(a)) {
            // Several readers may get here at once; the script's lock
            // serialises them and the later ones find the cluster healthy.
            run_async(vec!["start".into()]).await;
        }
    }

    /// Stops node `n` gracefully (its VM exits; clients see the
    /// connection closed, then refused). Hold [`Cluster::exclusive`].
    pub async fn stop_node(&self, n: usize) {
        run_async(vec!["stop-node".into(), self.number(n)]).await;
    }

    /// SIGKILLs node `n`'s VM: a crash, no goodbye to clients or peers.
    pub async fn kill_node(&self, n: usize) {
        run_async(vec!["kill-node".into(), self.number(n)]).await;
    }

    /// SIGSTOPs node `n`'s VM (a stalled host: its sockets stay open and
    /// nothing answers) until the guard is dropped. Hold
    /// [`Cluster::exclusive`].
    pub async fn freeze_node(&self, n: usize) -> Frozen {
        run_async(vec!["freeze-node".into(), self.number(n)]).await;
        Frozen(n)
    }

    /// Starts node `n` again and waits until it is back in the cluster.
    pub async fn start_node(&self, n: usize) {
        run_async(vec!["start-node".into(), self.number(n)]).await;
    }

    /// `rabbitmqctl ARGS` against node `n` (through its root on 4.3): its
    /// output.
    pub async fn ctl(&self, n: usize, args: &[&str]) -> String {
        let mut all = vec!["ctl".to_string(), self.number(n)];
        all.extend(args.iter().map(|a| a.to_string()));
        tokio::task::spawn_blocking(move || {
            let all: Vec<&str> = all.iter().map(String::as_str).collect();
            run(&all).unwrap_or_else(|e| panic!("{e}"))
        })
        .await
        .unwrap()
    }

    fn number(&self, n: usize) -> String {
        self.addr(n); // checks the range
        n.to_string()
    }
}

/// A frozen node, thawed when dropped (also when the test fails).
pub struct Frozen(usize);

impl Drop for Frozen {
    fn drop(&mut self) {
        let n = self.0.to_string();
        if let Err(e) = run(&["thaw-node", &n]) {
            eprintln!("{e}");
        }
    }
}

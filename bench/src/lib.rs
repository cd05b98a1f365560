//! `nackd-bench`: measurements of nackd against the real RabbitMQ with a
//! real client (lapin), each figure taken directly and through nackd (and,
//! for pass-through, through HAProxy) in alternating rounds of the same
//! run. A crate of its own in the workspace, so the product library
//! carries none of it.
//!
//! # Layout
//!
//! - this file: the command line and the targets (broker, nackd, HAProxy);
//! - [`rounds`]: the sides of a comparison and the alternating rounds;
//! - [`baseline`]: the baseline lane's nackd (`--baseline-nackd`,
//!   `--baseline-rev`: another commit's build, cached);
//! - [`launcher`]: runs the `nackd` binary as a separate process;
//! - [`haproxy`]: installs and runs HAProxy in TCP mode (issue 24's baseline);
//! - [`load`]: producer/consumer pairs that put messages through the broker;
//! - [`framewise`]: the same, written per frame as pika writes or per
//!   message as amqplib writes;
//! - [`stats`]: percentiles and medians;
//! - [`machine`]: what the run was measured on;
//! - [`cpu`]: CPU use of the machine, the client, the broker and nackd;
//! - [`report`]: the printed report and the results file (`--record`);
//! - one file per scenario: [`passthrough`], [`retry`], [`hold`],
//!   [`replica`], [`delayed`], [`adopt`].
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use clap::{Parser, Subcommand};

pub mod adopt;
pub mod baseline;
pub mod cpu;
pub mod delayed;
pub mod framewise;
pub mod haproxy;
pub mod hold;
pub mod launcher;
pub mod load;
pub mod machine;
pub mod passthrough;
pub mod replica;
pub mod report;
pub mod retry;
pub mod rounds;
pub mod stats;

use cpu::Processes;
use haproxy::HaproxyProcess;
use launcher::NackdProcess;
use machine::Machine;
use rounds::Side;

/// Errors end a benchmark; nothing branches on them.
pub type BenchResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Benchmarks nackd against RabbitMQ, direct vs through nackd.
#[derive(Debug, Parser)]
#[command(name = "nackd-bench", version, about)]
pub struct Cli {
    /// What to measure.
    #[command(subcommand)]
    pub scenario: Scenario,
    /// Write this run's report into the results file as the entry NAME
    /// (replacing an older one of that name), with the command line, the
    /// commit, the date and the kernel: the figures the docs quote
    /// (lowercase letters, digits and '-').
    #[arg(long, global = true, value_name = "NAME")]
    pub record: Option<String>,
    /// The results file `--record` writes to (default:
    /// docs/src/results.md of the repository).
    #[arg(long, global = true, value_name = "FILE", requires = "record")]
    pub results: Option<std::path::PathBuf>,
    /// Measure this nackd binary instead of the `nackd` beside
    /// nackd-bench (e.g. a cached `target/bench-baselines/<sha>/nackd`
    /// while bisecting, against `--baseline-rev` of the commit before).
    #[arg(long, global = true, value_name = "BIN")]
    pub nackd: Option<std::path::PathBuf>,
}

/// The scenarios.
#[derive(Debug, Subcommand)]
pub enum Scenario {
    /// Pass-through cost: throughput, latency, many connections, 64 KiB mix.
    Passthrough(passthrough::Args),
    /// Redelivery lateness of delayed retries: nackd vs the TTL recipes.
    Retry(retry::Args),
    /// Park many messages: park rate, RSS, store size, restart after SIGKILL.
    Hold(hold::HoldArgs),
    /// Park N, then SIGKILL and restart nackd several times: time to serving.
    Restart(hold::RestartArgs),
    /// Replica off vs on in one run: retry knee, park rate, p99 lateness.
    Replica(replica::Args),
    /// Failover: A holds N and is SIGKILLed, B adopts them: seconds to
    /// adopt and to fire, lateness of the messages due meanwhile.
    Adopt(adopt::Args),
    /// Delayed publishes (x-delayed-message emulation): confirmed publish
    /// rate vs a plain exchange direct, lateness, RAM per held message.
    Delayed(delayed::Args),
}

/// Options every scenario takes.
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    /// Measure this running nackd instead of starting the `nackd` binary
    /// next to this executable.
    #[arg(long, value_name = "ADDR")]
    pub proxy: Option<SocketAddr>,
    /// RabbitMQ (the direct side, and the upstream of a started nackd).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:5672")]
    pub broker: String,
    /// Measured seconds per round and side.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// Seconds of warm-up before each measurement, not counted.
    #[arg(long, default_value_t = 2)]
    pub warmup: u64,
    /// Rounds per side (direct, nackd, direct, nackd, ...).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// TOML appended to the config of the nackd this command starts, e.g.
    /// a file holding a `[runtime]` table (printed in the header).
    #[arg(long, value_name = "FILE")]
    pub nackd_config: Option<std::path::PathBuf>,
}

impl Common {
    /// The measured period.
    pub fn measure(&self) -> Duration {
        Duration::from_secs(self.seconds)
    }

    /// The warm-up period.
    pub fn warmup(&self) -> Duration {
        Duration::from_secs(self.warmup)
    }
}

/// The broker, nackd in front of it, and HAProxy beside nackd if asked for.
pub struct Targets {
    /// Broker address.
    pub broker: String,
    /// nackd's address.
    pub proxy: SocketAddr,
    /// nackd's pid: the one this run started, or the owner of the
    /// `--proxy` address's listening socket.
    pub proxy_pid: Option<u32>,
    /// The nackd this run started, if it started one.
    pub nackd: Option<NackdProcess>,
    /// The HAProxy this run started, if asked to.
    pub haproxy: Option<HaproxyProcess>,
    /// The other nackd build this run started, if asked to (`--baseline-nackd`).
    pub baseline: Option<NackdProcess>,
    /// The local RabbitMQ's pid and how it was found, if found.
    pub broker_pid: Option<(u32, &'static str)>,
    /// `--nackd-config` and its settings on one line, if the started nackd got one.
    pub nackd_settings: Option<String>,
    /// The same for the baseline nackd.
    pub baseline_settings: Option<String>,
    /// The rev and commit the baseline nackd was built from (`--baseline-rev`).
    pub baseline_origin: Option<String>,
}

impl Targets {
    /// Uses `--proxy`, or starts the sibling `nackd` with `extra` TOML.
    pub fn start(common: &Common, extra: &str) -> BenchResult<Self> {
        let mut nackd_settings = None;
        let nackd = match common.proxy {
            Some(_) => None,
            None => {
                let binary = NackdProcess::sibling_binary()?;
                if !launcher::measured_given() {
                    warn_if_stale(&binary);
                }
                let mut extra = extra.to_string();
                if let Some(path) = &common.nackd_config {
                    let (more, settings) = read_nackd_config(path)?;
                    nackd_settings = Some(settings);
                    extra = format!("{more}\n{extra}");
                }
                Some(NackdProcess::start(&binary, &common.broker, &extra)?)
            }
        };
        let proxy = common
            .proxy
            .or(nackd.as_ref().map(NackdProcess::addr))
            .expect("one of the two");
        Ok(Self {
            broker: common.broker.clone(),
            proxy,
            proxy_pid: nackd
                .as_ref()
                .map(NackdProcess::pid)
                .or_else(|| cpu::listener_pid(proxy)),
            nackd,
            haproxy: None,
            baseline: None,
            broker_pid: cpu::broker_pid(&common.broker),
            nackd_settings,
            baseline_settings: None,
            baseline_origin: None,
        })
    }

    /// Starts HAProxy in front of the broker (installing it if needed): a
    /// third side for [`rounds::alternate`].
    pub fn start_haproxy(&mut self, splice: haproxy::Splice) -> BenchResult<()> {
        self.haproxy = Some(HaproxyProcess::start(&self.broker, splice)?);
        Ok(())
    }

    /// Starts the baseline lane's nackd (another build, or the same one
    /// with other settings) in front of the broker: a side for
    /// [`rounds::alternate`] that compares two builds or two configs in one
    /// run. It gets `extra` (the scenario's own TOML) and its
    /// `--baseline-config`, or else `--nackd-config`.
    pub fn start_baseline(
        &mut self,
        baseline: &baseline::Baseline,
        common: &Common,
        extra: &str,
    ) -> BenchResult<()> {
        let mut toml = extra.to_string();
        if let Some(path) = baseline
            .config
            .as_deref()
            .or(common.nackd_config.as_deref())
        {
            let (more, shown) = read_nackd_config(path)?;
            toml = format!("{more}\n{toml}");
            self.baseline_settings = Some(shown);
        }
        self.baseline = Some(NackdProcess::start(&baseline.binary, &self.broker, &toml)?);
        self.baseline_origin = baseline.origin.clone();
        Ok(())
    }

    /// The binary of the baseline side: `binary` if given, else the nackd
    /// this command measures (another config of the same build), which a
    /// `--proxy` run does not know.
    pub fn baseline_binary(
        common: &Common,
        binary: Option<&std::path::Path>,
    ) -> BenchResult<std::path::PathBuf> {
        match (binary, common.proxy) {
            (Some(binary), _) => Ok(binary.to_owned()),
            (None, None) => Ok(NackdProcess::sibling_binary()?),
            (None, Some(_)) => Err("--baseline-config with --proxy: the running nackd's binary is unknown; add --baseline-nackd BIN or --baseline-rev REV".into()),
        }
    }

    /// The sides to measure: direct, nackd, and HAProxy and the baseline
    /// nackd if started.
    pub fn sides(&self) -> Vec<Side> {
        let mut sides = vec![Side::Direct, Side::Nackd];
        if self.haproxy.is_some() {
            sides.push(Side::Haproxy);
        }
        if self.baseline.is_some() {
            sides.push(Side::Baseline);
        }
        sides
    }

    /// Where clients of `side` connect, and the processes they load.
    pub fn target(&self, side: Side) -> Target {
        let (addr, proxy) = match side {
            Side::Direct => (self.broker.clone(), None),
            Side::Nackd => (self.proxy.to_string(), self.proxy_pid),
            Side::Haproxy => {
                let h = self.haproxy.as_ref().expect("a haproxy side needs haproxy");
                (h.addr().to_string(), Some(h.pid()))
            }
            Side::Baseline => {
                let b = self.baseline.as_ref().expect("a baseline side needs one");
                (b.addr().to_string(), Some(b.pid()))
            }
        };
        Target {
            side,
            addr,
            processes: Processes {
                client: Some(std::process::id()),
                broker: self.broker_pid.map(|(pid, _)| pid),
                proxy,
            },
        }
    }
}

/// One side of a round.
#[derive(Clone, Debug)]
pub struct Target {
    /// Direct, through nackd or through HAProxy.
    pub side: Side,
    /// Address the clients connect to.
    pub addr: String,
    /// Whose CPU time to count.
    pub processes: Processes,
}

/// `cargo run --bin nackd-bench` rebuilds only itself: say so when the
/// `nackd` beside it is older, it may not contain the code being measured.
/// The TOML of `--nackd-config FILE`, and the line the header prints for
/// it: the file's name and its settings, comments left out.
pub(crate) fn read_nackd_config(path: &std::path::Path) -> BenchResult<(String, String)> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--nackd-config {}: {e}", path.display()))?;
    let settings: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let shown = format!("{} ({})", path.display(), settings.join(" "));
    Ok((text, shown))
}

fn warn_if_stale(nackd: &std::path::Path) {
    let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let me = std::env::current_exe().ok();
    if let (Some(theirs), Some(mine)) = (modified(nackd), me.as_deref().and_then(modified)) {
        // Both come out of one cargo run within seconds of each other.
        if theirs + Duration::from_secs(60) < mine {
            tracing::warn!(
                nackd = %nackd.display(),
                "nackd is older than nackd-bench; rebuild both with `cargo build --release --bins`"
            );
        }
    }
}

/// Prints the scenario, the date and the machine: the first lines of
/// every report.
pub fn print_first_lines(scenario: &str, machine: &Machine) {
    crate::out!("nackd-bench {scenario}");
    crate::out!(
        "date        {}",
        humantime::format_rfc3339_seconds(SystemTime::now())
    );
    crate::out!(
        "machine     {} CPUs, {}, load average {}",
        machine.cpus,
        machine.cpu_model,
        machine.load
    );
}

/// Prints the lines every report starts with.
pub fn print_header(scenario: &str, common: &Common, machine: &Machine, targets: &Targets) {
    print_first_lines(scenario, machine);
    let pid = targets
        .broker_pid
        .map_or("pid unknown: its CPU is not counted".into(), |(p, how)| {
            format!("pid {p}, {how}")
        });
    crate::out!(
        "broker      {} at {} ({pid})",
        machine.broker,
        targets.broker
    );
    match &targets.nackd {
        Some(n) => crate::out!(
            "nackd       {} (pid {}) at {}",
            n.binary().display(),
            n.pid(),
            n.addr()
        ),
        None => crate::out!(
            "nackd       already running at {} ({})",
            targets.proxy,
            targets
                .proxy_pid
                .map_or("pid unknown: its CPU is not counted".into(), |p| {
                    format!("pid {p}, owns the listening socket")
                })
        ),
    }
    if let Some(settings) = &targets.nackd_settings {
        crate::out!("nackd conf  {settings}");
    }
    if let Some(b) = &targets.baseline {
        crate::out!(
            "baseline    {} (pid {}) at {}",
            b.binary().display(),
            b.pid(),
            b.addr()
        );
        if let Some(origin) = &targets.baseline_origin {
            crate::out!("baseline rv {origin}");
        }
        if let Some(settings) = &targets.baseline_settings {
            crate::out!("baseline cf {settings}");
        }
    }
    if let Some(haproxy) = &targets.haproxy {
        crate::out!("haproxy     {}", haproxy.describe());
    }
    if scenario == "passthrough" {
        let sides: Vec<&str> = targets.sides().iter().map(|s| s.label()).collect();
        crate::out!(
            "method      {} rounds per side, alternating {} (the first side rotates by round); {} s measured after {} s warm-up; median per side",
            common.rounds,
            sides.join("/"),
            common.seconds,
            common.warmup
        );
    }
}

/// Prints the lines every report ends with, and stops the nackd and the
/// HAProxy this run started.
pub fn print_footer(targets: Targets) {
    crate::out!("load        average {} at the end", machine::load_average());
    if let Some(haproxy) = targets.haproxy {
        print_warnings("haproxy out", "warnings/alerts", &haproxy.warnings());
        haproxy.kill();
    }
    if let Some(nackd) = targets.nackd {
        print_warnings("nackd log  ", "warnings/errors", &nackd.warnings());
        nackd.kill();
    }
    if let Some(baseline) = targets.baseline {
        print_warnings("baseline log", "warnings/errors", &baseline.warnings());
        baseline.kill();
    }
}

/// "nackd log   2 warnings/errors" and the first five of them.
pub(crate) fn print_warnings(label: &str, what: &str, warnings: &[String]) {
    crate::out!("{label} {} {what}", warnings.len());
    for line in warnings.iter().take(5) {
        crate::out!("            {line}");
    }
}

/// A name part no other run uses (this process and the time, in µs): for
/// the instance ids and groups of the scenarios that start nackds with
/// `[replica]`, so that no run adopts another's messages.
pub(crate) fn run_id() -> String {
    format!("{}-{}", std::process::id(), wall_us())
}

/// Microseconds since the epoch (0 before it): the clock packet captures
/// and other hosts stamp with.
pub(crate) fn wall_us() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Runs the scenario the command line names.
pub async fn run(cli: Cli) -> BenchResult<()> {
    if let Some(binary) = cli.nackd {
        launcher::measure(std::path::absolute(&binary).unwrap_or(binary));
    }
    // Before the run, so that a bad name or a missing repository ends it
    // before anything is measured.
    let record = match &cli.record {
        Some(name) => {
            report::check_name(name)?;
            Some((name, report::results_file(cli.results.as_deref())?))
        }
        None => None,
    };
    run_scenario(cli.scenario).await?;
    if let Some((name, (repo, file))) = record {
        report::record(name, &repo, &file)?;
        eprintln!("recorded as {name} in {}", file.display());
    }
    Ok(())
}

async fn run_scenario(scenario: Scenario) -> BenchResult<()> {
    match scenario {
        Scenario::Passthrough(args) => passthrough::run(args).await,
        Scenario::Retry(args) => retry::run(args).await,
        Scenario::Hold(args) => hold::run(args).await,
        Scenario::Restart(args) => hold::run_restart(args).await,
        Scenario::Replica(args) => replica::run(args).await,
        Scenario::Delayed(args) => delayed::run(args).await,
        Scenario::Adopt(args) => adopt::run(args).await,
    }
}

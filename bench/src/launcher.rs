//! Runs the `nackd` binary as a separate process for a benchmark: a temp
//! directory with its config, store and log, the address parsed from the
//! JSON "listening" log line, and a kill at the end.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long nackd gets to log "listening".
const START_TIMEOUT: Duration = Duration::from_secs(15);
/// Time a restarted nackd gets to recover its store before listening: a
/// 10 M-message store is 15 GB to read back.
const RESTART_TIMEOUT: Duration = Duration::from_secs(600);

/// Why a process the bench runs (nackd, HAProxy) could not be started.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// No `nackd` binary where it was looked for.
    #[error("no nackd binary at {0}: build it with `cargo build --release --bins`")]
    Missing(PathBuf),
    /// A program the bench installs was missing and could not be installed.
    #[error("{program} is not installed and could not be installed: {reason}")]
    NotInstalled {
        /// What was missing.
        program: &'static str,
        /// What the installer said.
        reason: String,
    },
    /// The program is there but is not what the bench can run.
    #[error("{program} cannot be used: {reason}")]
    NotUsable {
        /// Which program.
        program: &'static str,
        /// Why.
        reason: String,
    },
    /// Temp directory, config file, log file or spawn failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The process exited or never listened; its log says why.
    #[error("{program} did not start ({reason}); log {log}:\n{tail}")]
    NotListening {
        /// Which program.
        program: &'static str,
        /// Exit status or timeout.
        reason: String,
        /// Path of its log.
        log: PathBuf,
        /// Its last log lines.
        tail: String,
    },
}

/// Maps an I/O error to [`LaunchError::Io`] saying what was being done.
pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> LaunchError {
    let what = what.into();
    move |source| LaunchError::Io { what, source }
}

/// A running nackd process; killed when dropped.
pub struct NackdProcess {
    child: Child,
    addr: SocketAddr,
    binary: PathBuf,
    dir: tempfile::TempDir,
}

/// `--nackd BIN`, set once by [`measure`] before a scenario starts.
static MEASURED: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Measures `binary` instead of the `nackd` beside this executable (the
/// command line's `--nackd`; e.g. another commit's build in a bisect).
pub fn measure(binary: PathBuf) {
    let _ = MEASURED.set(binary);
}

/// Whether `--nackd` named the measured binary.
pub fn measured_given() -> bool {
    MEASURED.get().is_some()
}

impl NackdProcess {
    /// The measured nackd: `--nackd BIN` if given, else the `nackd`
    /// binary next to the running executable (`target/release/nackd`
    /// beside `target/release/nackd-bench`).
    pub fn sibling_binary() -> Result<PathBuf, LaunchError> {
        let binary = match MEASURED.get() {
            Some(binary) => binary.clone(),
            None => std::env::current_exe()
                .map_err(io("locating the running executable"))?
                .with_file_name("nackd"),
        };
        if !binary.is_file() {
            return Err(LaunchError::Missing(binary));
        }
        Ok(binary)
    }

    /// Starts `binary` in front of `upstream` with `extra` TOML appended to
    /// the generated config (e.g. `[[policy]]` tables). The generated part
    /// owns `[listen]`, `[upstream]`, `[store]` and `[metrics]`.
    pub fn start(binary: &Path, upstream: &str, extra: &str) -> Result<Self, LaunchError> {
        Self::start_nodes(binary, &[upstream.to_string()], extra)
    }

    /// [`start`](Self::start) in front of several broker nodes
    /// (`[upstream] addresses`, sessions take them in turn); one node is
    /// `[upstream] address`, as `start` writes it.
    pub fn start_nodes(binary: &Path, nodes: &[String], extra: &str) -> Result<Self, LaunchError> {
        let upstream = match nodes {
            [one] => format!("address = {one:?}"),
            _ => format!("addresses = {nodes:?}"),
        };
        let dir = tempfile::Builder::new()
            .prefix("nackd-bench-")
            .tempdir()
            .map_err(io("creating a temp directory"))?;
        let store = dir.path().join("store");
        let config = dir.path().join("nackd.toml");
        let text = format!(
            "[listen]\naddress = \"127.0.0.1:0\"\n[upstream]\n{upstream}\n\
             [store]\npath = {store:?}\n[metrics]\naddress = \"127.0.0.1:0\"\n{extra}\n"
        );
        std::fs::write(&config, text).map_err(io(format!("writing {}", config.display())))?;
        let log_path = dir.path().join("nackd.log");
        let log =
            File::create(&log_path).map_err(io(format!("creating {}", log_path.display())))?;
        // `--upstream` would replace `addresses` by one node: the config says it.
        let child = Command::new(binary)
            .arg("--config")
            .arg(&config)
            .args(["--listen", "127.0.0.1:0", "--log-format", "json"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(io(format!("starting {}", binary.display())))?;
        let mut process = Self {
            child,
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            binary: binary.to_owned(),
            dir,
        };
        process.addr = process.wait_listening(START_TIMEOUT)?;
        Ok(process)
    }

    /// Polls the log for the "listening" line; nackd logs to a file rather
    /// than a pipe so a long run can never block it on a full pipe.
    fn wait_listening(&mut self, timeout: Duration) -> Result<SocketAddr, LaunchError> {
        let began = Instant::now();
        loop {
            if let Some(addr) = listening_address(&self.log_path()) {
                return Ok(addr);
            }
            let reason = match self.child.try_wait() {
                Ok(Some(status)) => format!("exited with {status}"),
                _ if began.elapsed() > timeout => {
                    format!("no \"listening\" line within {timeout:?}")
                }
                _ => {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            };
            return Err(LaunchError::NotListening {
                program: "nackd",
                reason,
                log: self.log_path(),
                tail: self.log_tail(20),
            });
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Address of its `/metrics`, `/readyz` and admin API (from the
    /// "listening" log line).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        log_fields(&self.log_path(), "listening")?
            .get("metrics")?
            .as_str()?
            .parse()
            .ok()
    }

    /// The binary that runs.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// Process id (for profilers and RSS readings).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The store directory of this nackd (`[store] path`).
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// nackd's JSON log.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("nackd.log")
    }

    /// The last `n` lines of the log.
    pub fn log_tail(&self, n: usize) -> String {
        let lines: Vec<String> = File::open(self.log_path())
            .map(|f| BufReader::new(f).lines().map_while(Result::ok).collect())
            .unwrap_or_default();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Field `field` (as text) of the first log line whose message is
    /// `message`, if there is one.
    pub fn logged_field(&self, message: &str, field: &str) -> Option<String> {
        let fields = log_fields(&self.log_path(), message)?;
        Some(match fields.get(field)? {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    }

    /// When the first log line whose message is `message` was written
    /// (its timestamp), if there is one.
    pub fn logged_at(&self, message: &str) -> Option<std::time::SystemTime> {
        let line = log_line(&self.log_path(), message)?;
        humantime::parse_rfc3339(line.get("timestamp")?.as_str()?).ok()
    }

    /// Log lines at WARN or ERROR level so far.
    pub fn warnings(&self) -> Vec<String> {
        File::open(self.log_path())
            .map(|f| {
                BufReader::new(f)
                    .lines()
                    .map_while(Result::ok)
                    .filter(|l| {
                        l.contains("\"level\":\"WARN\"") || l.contains("\"level\":\"ERROR\"")
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Kills the process with SIGKILL and starts it again on the same
    /// config and store; returns how long until it listened again (nackd
    /// recovers the store before it listens).
    pub fn restart(&mut self) -> Result<Duration, LaunchError> {
        self.kill_now();
        let old = self
            .dir
            .path()
            .join(format!("nackd.log.{}", self.child.id()));
        std::fs::rename(self.log_path(), &old).map_err(io("keeping the old log"))?;
        let log = File::create(self.log_path()).map_err(io("creating the log"))?;
        let began = Instant::now();
        self.child = Command::new(&self.binary)
            .arg("--config")
            .arg(self.dir.path().join("nackd.toml"))
            .args(["--listen", "127.0.0.1:0", "--log-format", "json"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(io(format!("starting {}", self.binary.display())))?;
        self.addr = self.wait_listening(RESTART_TIMEOUT)?;
        Ok(began.elapsed())
    }

    /// Whether the current log says nackd intercepts: its store opened with
    /// a fresh head ("store open: intercepting", older segments read
    /// meanwhile) or, with a replica, recovered ("store ready: intercepting").
    pub fn intercepting(&self) -> bool {
        let log = self.log_path();
        log_fields(
            &log,
            "store open: intercepting (older segments are read meanwhile)",
        )
        .is_some()
            || log_fields(&log, "store ready: intercepting").is_some()
    }

    /// `held` of the line that says every held message is scheduled again
    /// ("store recovered: its messages are scheduled", or with a replica
    /// "store ready: intercepting") in the current log.
    pub fn recovered_held(&self) -> Option<u64> {
        let log = self.log_path();
        log_fields(&log, "store recovered: its messages are scheduled")
            .or_else(|| log_fields(&log, "store ready: intercepting"))?
            .get("held")?
            .as_u64()
    }

    /// Kills the process and waits for it; the temp directory goes with `self`.
    pub fn kill(mut self) {
        self.kill_now();
    }

    /// Kills the process and waits for it, keeping its directory (its store
    /// stays for the next [`NackdProcess::restart`]).
    pub fn stop(&mut self) {
        self.kill_now();
    }

    fn kill_now(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NackdProcess {
    fn drop(&mut self) {
        self.kill_now();
    }
}

/// The address of the first `"message":"listening"` JSON line in the log.
fn listening_address(log: &Path) -> Option<SocketAddr> {
    log_fields(log, "listening")?
        .get("address")?
        .as_str()?
        .parse()
        .ok()
}

/// The fields of the first JSON log line whose message is `message`.
fn log_fields(log: &Path, message: &str) -> Option<serde_json::Value> {
    log_line(log, message)?
        .get_mut("fields")
        .map(serde_json::Value::take)
}

/// The first JSON log line whose message is `message`.
fn log_line(log: &Path, message: &str) -> Option<serde_json::Value> {
    let file = File::open(log).ok()?;
    BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .find_map(|line| {
            let value: serde_json::Value = serde_json::from_str(&line).ok()?;
            (value.get("fields")?.get("message")?.as_str()? == message).then_some(value)
        })
}

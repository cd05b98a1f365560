//! nackd as a separate process (for kill -9 and CLI tests).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

pub const NACKD: &str = env!("CARGO_BIN_EXE_nackd");

/// Waits until process `pid` catches signal `signum` (SigCgt in
/// /proc/PID/status). nackd installs its SIGTERM/SIGINT/SIGHUP handlers in a
/// task that can run after it logged "listening"; a signal sent before
/// that gets the default action, which for these three ends the process.
pub fn wait_for_handler(pid: u32, signum: u32) {
    let began = std::time::Instant::now();
    loop {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let caught = status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok());
        if caught.is_some_and(|mask| mask & (1 << (signum - 1)) != 0) {
            return;
        }
        assert!(
            began.elapsed() < Duration::from_secs(15),
            "process {pid} has no handler for signal {signum} after 15 s: SigCgt {caught:x?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Writes `dir/nackd.toml` for [`Process::start`]: nackd in front of the
/// broker under test, its store in `dir/store`, the `x-delayed-message`
/// emulation on ([`super::DELAYED`]), then `extra` TOML.
pub fn delayed_config(dir: &Path, extra: &str) -> std::path::PathBuf {
    let path = dir.join("nackd.toml");
    std::fs::write(
        &path,
        format!(
            "[upstream]\naddress = \"{}\"\n[store]\npath = \"{}\"\n{}{extra}",
            super::BROKER,
            dir.join("store").display(),
            super::DELAYED
        ),
    )
    .unwrap();
    path
}

/// A running nackd binary, the address it listens on and its metrics address.
pub struct Process {
    pub child: Child,
    pub addr: SocketAddr,
    pub metrics: SocketAddr,
    /// Every line it logged so far.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Process {
    /// Starts `nackd --config FILE --listen 127.0.0.1:0 --metrics 127.0.0.1:0
    /// --log-format json`, waits for its "listening" line, then until it
    /// intercepts (its store recovered, its replica lease held). Its log
    /// keeps draining in a thread.
    pub fn start(config: &Path) -> Self {
        let process = Self::start_listening(config);
        super::ops::wait_intercepting_blocking(process.metrics, Duration::from_secs(120));
        process
    }

    /// Like [`Process::start`], but only until it listens: it may still be
    /// recovering its store (or waiting for its lease).
    pub fn start_listening(config: &Path) -> Self {
        let mut child = Command::new(NACKD)
            .arg("--config")
            .arg(config)
            .args([
                "--listen",
                "127.0.0.1:0",
                "--metrics",
                "127.0.0.1:0",
                "--log-format",
                "json",
            ])
            .env("NACKD_LOG", "info")
            .stderr(Stdio::piped())
            .spawn()
            .expect("nackd starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        let keep = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                    if v["fields"]["message"] == "listening" {
                        let fields = &v["fields"];
                        let _ = tx.send((
                            fields["address"].as_str().unwrap().to_string(),
                            fields["metrics"].as_str().unwrap().to_string(),
                        ));
                    }
                }
                if std::env::var_os("NACKD_TEST_ECHO").is_some() {
                    eprintln!("nackd: {line}");
                }
                keep.lock().unwrap().push(line);
            }
        });
        let (addr, metrics) = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|e| {
                // Its stderr may still be draining into the log.
                std::thread::sleep(Duration::from_millis(200));
                panic!("nackd listening: {e}; its log: {:#?}", log.lock().unwrap())
            });
        Self {
            child,
            addr: addr.parse().unwrap(),
            metrics: metrics.parse().unwrap(),
            log,
        }
    }

    /// Waits (15 s at most) for a log line containing every one of `parts`.
    pub fn wait_for_log(&self, parts: &[&str]) -> String {
        let started = std::time::Instant::now();
        loop {
            let log = self.log.lock().unwrap();
            if let Some(line) = log.iter().find(|l| parts.iter().all(|p| l.contains(p))) {
                return line.clone();
            }
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "no log line with {parts:?}: {log:#?}"
            );
            drop(log);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill9(mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }

    /// Sends SIGTERM (once nackd catches it) and waits at most `limit` for
    /// the exit; returns its status and the time from the signal to the
    /// exit. Panics if it is still running after `limit`.
    pub fn terminate(mut self, limit: Duration) -> (std::process::ExitStatus, Duration) {
        let pid = self.child.id();
        wait_for_handler(pid, 15);
        let sent = std::time::Instant::now();
        let status = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -TERM {pid}: {status:?}");
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for nackd") {
                return (status, sent.elapsed());
            }
            assert!(
                sent.elapsed() < limit,
                "nackd still running {limit:?} after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a command on the host; panics with its output unless it succeeds.
/// Returns its stdout. Says how long it took (`-- --nocapture` shows it).
pub fn host(command: &mut std::process::Command, what: &str) -> String {
    let started = std::time::Instant::now();
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {command:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{what}: {:.1} s", started.elapsed().as_secs_f64());
    stdout
}

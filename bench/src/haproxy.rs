//! HAProxy in TCP mode as a third side of the pass-through comparison
//! (issue 24): the dumb TCP hop users already run in front of RabbitMQ, so
//! nackd's toll can be read against it in the same run.
//!
//! The bench runs Debian's `haproxy` itself: installed with apt when it is
//! missing (a failure ends the run with apt's words), started in the
//! foreground (`-db`, so this process owns it and kills it at the end) on a
//! config written to a temp directory: TCP mode, one thread, kernel splice
//! where the binary has it, an ephemeral port on 127.0.0.1.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::cpu;
use super::launcher::{io, LaunchError};

/// How long HAProxy gets to listen on its port.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// Where Debian's package puts the binary.
const DEBIAN_BINARY: &str = "/usr/sbin/haproxy";

/// How HAProxy moves bytes between its two sockets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Splice {
    /// `option splice-request` + `option splice-response`: kernel splice
    /// for every transfer in both directions.
    Always,
    /// `option splice-auto`: HAProxy's heuristic picks splice or a copy
    /// through its buffers.
    Auto,
    /// `nosplice`: always through HAProxy's buffers.
    Off,
}

/// What goes into the config file.
#[derive(Clone, Debug)]
pub struct Config {
    /// The address HAProxy listens on.
    pub listen: SocketAddr,
    /// The broker, `host:port`.
    pub upstream: String,
    /// Splice mode (only if the binary has splice; else [`Splice::Off`]).
    pub splice: Splice,
}

impl Config {
    /// The text of the config file.
    pub fn text(&self) -> String {
        let (global, defaults) = match self.splice {
            Splice::Always => (
                "",
                "    option splice-request\n    option splice-response\n",
            ),
            Splice::Auto => ("", "    option splice-auto\n"),
            Splice::Off => ("    nosplice\n", ""),
        };
        format!(
            "# written by nackd-bench: HAProxy in TCP mode in front of the broker\n\
             global\n    nbthread 1\n    maxconn 4096\n{global}\
             defaults\n    mode tcp\n    timeout connect 5s\n    \
             timeout client 1h\n    timeout server 1h\n{defaults}\
             listen amqp\n    bind {}\n    server broker {}\n",
            self.listen, self.upstream
        )
    }
}

/// The `haproxy` binary: Debian's, or the first on `PATH`; `None` if none.
fn find_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::iter::once(PathBuf::from(DEBIAN_BINARY))
        .chain(std::env::split_paths(&path).map(|d| d.join("haproxy")))
        .find(|p| p.is_file())
}

/// The `haproxy` binary, installed from Debian's package first if missing.
pub fn ensure_installed() -> Result<PathBuf, LaunchError> {
    if let Some(binary) = find_binary() {
        return Ok(binary);
    }
    tracing::warn!("haproxy is not installed: running `apt-get install -y haproxy`");
    if let Err(first) = apt(&["install", "-y", "haproxy"]) {
        tracing::warn!(error = %first, "apt-get install failed; running `apt-get update` and trying again");
        apt(&["update"])?;
        apt(&["install", "-y", "haproxy"])?;
    }
    find_binary().ok_or_else(|| {
        not_installed(format!(
            "apt-get installed the package, but there is no {DEBIAN_BINARY} and no haproxy on PATH"
        ))
    })
}

fn not_installed(reason: String) -> LaunchError {
    LaunchError::NotInstalled {
        program: "haproxy",
        reason,
    }
}

/// Runs `apt-get args`; an error carries its exit status and last lines.
fn apt(args: &[&str]) -> Result<(), LaunchError> {
    let command = format!("apt-get {}", args.join(" "));
    let out = Command::new("apt-get")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| not_installed(format!("`{command}` could not run: {e}")))?;
    if out.status.success() {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&out.stderr);
    Err(not_installed(format!(
        "`{command}` failed ({}): {}",
        out.status,
        last_lines(&text, 5)
    )))
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// What `haproxy -vv` says: the version, and whether splice is built in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Build {
    /// E.g. `2.6.12-1+deb12u4`.
    pub version: String,
    /// `+LINUX_SPLICE` in its feature list.
    pub splice: bool,
}

impl Build {
    /// Reads the output of `haproxy -vv`.
    pub fn parse(vv: &str) -> Option<Self> {
        let version = vv
            .lines()
            .find_map(|l| l.trim().strip_prefix("HAProxy version "))?
            .split_whitespace()
            .next()?
            .to_string();
        let splice = vv
            .lines()
            .filter(|l| l.trim_start().starts_with("Feature list"))
            .any(|l| l.split_whitespace().any(|w| w == "+LINUX_SPLICE"));
        Some(Self { version, splice })
    }

    fn of(binary: &Path) -> Result<Self, LaunchError> {
        let out = Command::new(binary)
            .arg("-vv")
            .output()
            .map_err(io(format!("running {} -vv", binary.display())))?;
        let text = String::from_utf8_lossy(&out.stdout);
        Self::parse(&text).ok_or_else(|| LaunchError::NotUsable {
            program: "haproxy",
            reason: format!(
                "`{} -vv` names no HAProxy version; it printed: {:?}",
                binary.display(),
                last_lines(&text, 5)
            ),
        })
    }
}

/// A running HAProxy; killed when dropped.
pub struct HaproxyProcess {
    child: Child,
    addr: SocketAddr,
    binary: PathBuf,
    build: Build,
    splice: Splice,
    dir: tempfile::TempDir,
}

impl HaproxyProcess {
    /// Installs HAProxy if needed and starts it in front of `upstream`.
    pub fn start(upstream: &str, splice: Splice) -> Result<Self, LaunchError> {
        Self::start_binary(&ensure_installed()?, upstream, splice)
    }

    /// Starts `binary` in front of `upstream`, splice as asked if the
    /// binary has it (else off).
    pub fn start_binary(
        binary: &Path,
        upstream: &str,
        splice: Splice,
    ) -> Result<Self, LaunchError> {
        let build = Build::of(binary)?;
        let splice = if build.splice { splice } else { Splice::Off };
        let dir = tempfile::Builder::new()
            .prefix("nackd-bench-haproxy-")
            .tempdir()
            .map_err(io("creating a temp directory"))?;
        // A port the kernel just handed out and released: HAProxy binds it
        // a moment later (and exits, said below, if another took it).
        let listen = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(io("finding a free port"))?;
        let config = Config {
            listen,
            upstream: upstream.to_string(),
            splice,
        };
        let path = dir.path().join("haproxy.cfg");
        std::fs::write(&path, config.text()).map_err(io(format!("writing {}", path.display())))?;
        let log_path = dir.path().join("haproxy.log");
        let log = File::create(&log_path).map_err(io("creating the log"))?;
        let err_log = log.try_clone().map_err(io("sharing the log"))?;
        let child = Command::new(binary)
            .args(["-db", "-f"])
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            .spawn()
            .map_err(io(format!("starting {}", binary.display())))?;
        let mut process = Self {
            child,
            addr: listen,
            binary: binary.to_owned(),
            build,
            splice,
            dir,
        };
        process.wait_listening()?;
        Ok(process)
    }

    /// Waits until this very process owns a socket listening on its port
    /// (not merely: something answers there).
    fn wait_listening(&mut self) -> Result<(), LaunchError> {
        let began = Instant::now();
        loop {
            if cpu::listener_pid(self.addr) == Some(self.pid()) {
                return Ok(());
            }
            let reason = match self.child.try_wait() {
                Ok(Some(status)) => format!("exited with {status}"),
                _ if began.elapsed() > START_TIMEOUT => {
                    format!("not listening on {} within {START_TIMEOUT:?}", self.addr)
                }
                _ => {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            };
            return Err(LaunchError::NotListening {
                program: "haproxy",
                reason,
                log: self.log_path(),
                tail: last_lines(&self.output(), 20),
            });
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Process id: the one process (`nbthread 1`, no master) whose CPU is counted.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// One line for the report's header.
    pub fn describe(&self) -> String {
        let splice = match (self.splice, self.build.splice) {
            (Splice::Always, _) => "splice-request + splice-response",
            (Splice::Auto, _) => "splice-auto",
            (Splice::Off, true) => "splice off (nosplice)",
            (Splice::Off, false) => "splice off (not built in)",
        };
        format!(
            "HAProxy {} {} (pid {}) at {}: mode tcp, nbthread 1, {splice}",
            self.build.version,
            self.binary.display(),
            self.pid(),
            self.addr
        )
    }

    /// Where its stdout and stderr go (the temp dir also holds haproxy.cfg).
    fn log_path(&self) -> PathBuf {
        self.dir.path().join("haproxy.log")
    }

    /// What HAProxy wrote to stdout and stderr so far.
    fn output(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Its `[WARNING]` and `[ALERT]` lines so far.
    pub fn warnings(&self) -> Vec<String> {
        let Ok(file) = File::open(self.log_path()) else {
            return Vec::new();
        };
        BufReader::new(file)
            .lines()
            .map_while(Result::ok)
            .filter(|l| l.contains("[WARNING]") || l.contains("[ALERT]"))
            .collect()
    }

    /// Kills the process and waits for it; the temp directory goes with `self`.
    pub fn kill(mut self) {
        self.kill_now();
    }

    fn kill_now(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for HaproxyProcess {
    fn drop(&mut self) {
        self.kill_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(splice: Splice) -> String {
        Config {
            listen: "127.0.0.1:40123".parse().unwrap(),
            upstream: "127.0.0.1:5643".into(),
            splice,
        }
        .text()
    }

    fn lines(text: &str) -> Vec<&str> {
        text.lines().map(str::trim).collect()
    }

    #[test]
    fn config_is_tcp_mode_one_thread_on_the_given_ports() {
        let text = config(Splice::Always);
        let l = lines(&text);
        for wanted in [
            "global",
            "nbthread 1",
            "mode tcp",
            "listen amqp",
            "bind 127.0.0.1:40123",
            "server broker 127.0.0.1:5643",
            "option splice-request",
            "option splice-response",
        ] {
            assert!(l.contains(&wanted), "{wanted:?} missing from\n{text}");
        }
        for unwanted in ["daemon", "master-worker", "nosplice", "option splice-auto"] {
            assert!(
                !l.iter().any(|x| x.starts_with(unwanted)),
                "{unwanted}:\n{text}"
            );
        }
        // `mode tcp` in the defaults, so the listen section inherits it.
        let defaults = l.iter().position(|x| *x == "defaults").unwrap();
        let listen = l.iter().position(|x| *x == "listen amqp").unwrap();
        let mode = l.iter().position(|x| *x == "mode tcp").unwrap();
        assert!(defaults < mode && mode < listen, "{text}");
    }

    #[test]
    fn splice_modes_write_their_own_keywords() {
        let auto = config(Splice::Auto);
        assert!(lines(&auto).contains(&"option splice-auto"));
        assert!(!auto.contains("splice-request") && !auto.contains("nosplice"));
        let off = config(Splice::Off);
        let l = lines(&off);
        let nosplice = l.iter().position(|x| *x == "nosplice").unwrap();
        let defaults = l.iter().position(|x| *x == "defaults").unwrap();
        assert!(nosplice < defaults, "nosplice is a global keyword:\n{off}");
        assert!(!off.contains("option splice"));
    }

    #[test]
    fn reads_version_and_splice_from_haproxy_vv() {
        let vv = "HAProxy version 2.6.12-1+deb12u4 2025/04/10 - https://haproxy.org/\n\
                  Status: long-term supported branch\n\
                  Feature list : -51DEGREES +ACCEPT4 +EPOLL +LINUX_SPLICE -LINUX_TPROXY\n";
        assert_eq!(
            Build::parse(vv),
            Some(Build {
                version: "2.6.12-1+deb12u4".into(),
                splice: true
            })
        );
        let without = vv.replace("+LINUX_SPLICE", "-LINUX_SPLICE");
        assert!(!Build::parse(&without).unwrap().splice);
        assert_eq!(Build::parse("something else\n"), None);
    }

    #[test]
    fn a_binary_that_is_not_haproxy_fails_loudly() {
        // `true -vv` prints nothing: no version, so no start.
        let err =
            HaproxyProcess::start_binary(Path::new("/bin/true"), "127.0.0.1:5672", Splice::Always)
                .err()
                .expect("must fail");
        assert!(
            err.to_string().contains("names no HAProxy version"),
            "{err}"
        );
        let missing = HaproxyProcess::start_binary(
            Path::new("/nonexistent/haproxy"),
            "127.0.0.1:5672",
            Splice::Always,
        )
        .err()
        .expect("must fail");
        assert!(
            missing.to_string().contains("/nonexistent/haproxy"),
            "{missing}"
        );
    }

    #[test]
    fn a_failing_apt_get_is_an_error_that_quotes_it() {
        // An option apt-get does not know: it fails at once and changes
        // nothing (and where there is no apt-get, that is an error too).
        let err = apt(&["--no-such-option-nackd-bench"]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with("haproxy is not installed and could not be installed: `apt-get --no-such-option-nackd-bench`"),
            "{text}"
        );
    }

    #[test]
    fn a_haproxy_that_exits_at_start_fails_with_its_output() {
        // Answers -vv like HAProxy, then refuses its config like a HAProxy
        // that cannot bind would.
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("haproxy");
        std::fs::write(
            &fake,
            "#!/bin/sh
             if [ \"$1\" = -vv ]; then echo 'HAProxy version 9.9.9 2030/01/01'; exit 0; fi
             echo '[ALERT]    (1) : Starting proxy amqp: cannot bind socket' >&2
             exit 1
",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let err = HaproxyProcess::start_binary(&fake, "127.0.0.1:5672", Splice::Always)
            .err()
            .expect("must fail");
        let text = err.to_string();
        assert!(text.contains("exited with"), "{text}");
        assert!(text.contains("cannot bind socket"), "{text}");
    }
}

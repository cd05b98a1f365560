//! The baseline lane's nackd: another binary (`--baseline-nackd`), the
//! nackd of another commit of this repository (`--baseline-rev`), or the
//! measured binary with other settings (`--baseline-config` alone).
//!
//! `--baseline-rev REV` resolves REV with `git rev-parse --verify
//! REV^{commit}` in the repository of the current directory (else of this
//! executable) and runs `<cache>/<sha>/nackd`, where `<cache>` is
//! `$NACKD_BENCH_BASELINES`, else `target/bench-baselines` of that
//! repository. A commit not yet cached is built once: `cargo build
//! --release --locked -p nackd --bin nackd` in a detached worktree
//! `<cache>/<sha>/src-<pid>`, with `CARGO_TARGET_DIR=<cache>/target`
//! (shared by every baseline build, so dependencies compile once), output
//! in `<cache>/<sha>/build-<pid>.log`. The binary is copied to a temporary
//! name beside its place and renamed into it, so a concurrent run sees
//! either no binary or a whole one; the worktree is removed afterwards.

use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use super::{BenchResult, Common, Targets};

/// The environment variable that moves the cache of `--baseline-rev` builds.
pub const CACHE_ENV: &str = "NACKD_BENCH_BASELINES";

/// The options of a scenario with a baseline lane (`nackd-baseline`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct BaselineArgs {
    /// Also measure this other nackd binary (e.g. a build of an earlier
    /// commit), started like the measured one, as the lane `nackd-baseline`
    /// of the same run.
    #[arg(long, value_name = "BIN")]
    pub baseline_nackd: Option<PathBuf>,
    /// The same with the nackd of this git commit (HEAD~1, a tag, a sha):
    /// built in release once, in a worktree, and cached as
    /// target/bench-baselines/<sha>/nackd ($NACKD_BENCH_BASELINES moves
    /// the cache); later runs reuse it.
    #[arg(long, value_name = "REV", conflicts_with = "baseline_nackd")]
    pub baseline_rev: Option<String>,
    /// Start the baseline nackd with this TOML instead of `--nackd-config`
    /// (the measured binary unless `--baseline-nackd` or `--baseline-rev`):
    /// one setting on and off, side by side, e.g. `[runtime] coalesce = "0s"`.
    #[arg(long, value_name = "FILE")]
    pub baseline_config: Option<PathBuf>,
}

/// The baseline lane to start: its binary, where it came from, its config.
#[derive(Debug, Clone)]
pub struct Baseline {
    /// The nackd binary to run.
    pub binary: PathBuf,
    /// For `--baseline-rev`: the rev, its commit and whether it was built
    /// now, as the header prints it.
    pub origin: Option<String>,
    /// `--baseline-config`.
    pub config: Option<PathBuf>,
}

impl BaselineArgs {
    /// The baseline lane these options ask for, if any; builds the nackd of
    /// `--baseline-rev` if it is not cached. Called before anything is
    /// started or measured, so a bad rev or a failed build ends the run
    /// first.
    pub fn resolve(&self, common: &Common) -> BenchResult<Option<Baseline>> {
        let (binary, origin) = match (&self.baseline_rev, &self.baseline_nackd) {
            (Some(rev), _) => {
                let built = build_rev(rev)?;
                let origin = format!("{rev} = {}, {}", built.sha, built.how);
                (built.binary, Some(origin))
            }
            (None, Some(binary)) => (binary.clone(), None),
            (None, None) if self.baseline_config.is_some() => {
                (Targets::baseline_binary(common, None)?, None)
            }
            (None, None) => return Ok(None),
        };
        Ok(Some(Baseline {
            binary,
            origin,
            config: self.baseline_config.clone(),
        }))
    }
}

/// Prints one headline figure of nackd beside the baseline's and their
/// ratio nackd / baseline, e.g. `versus      park rate         nackd 950
/// / nackd-baseline 1000 nacks/s: ratio 0.950`.
pub fn print_versus(what: &str, unit: &str, better: Better, nackd: f64, baseline: f64) {
    crate::out!(
        "versus      {what:<17} nackd {} / nackd-baseline {} {unit}: ratio {} ({})",
        figure(nackd),
        figure(baseline),
        ratio(nackd, baseline),
        better.said()
    );
}

/// Which way a figure of [`print_versus`] is better, printed beside its
/// ratio: 0.8 is a loss for a rate and a gain for a latency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Better {
    /// A rate.
    Higher,
    /// A size, a duration, a lateness.
    Lower,
}

impl Better {
    fn said(self) -> &'static str {
        match self {
            Self::Higher => "higher is better",
            Self::Lower => "lower is better",
        }
    }
}

/// A figure with the decimals its size needs.
fn figure(x: f64) -> String {
    match x.abs() {
        a if a >= 100.0 => format!("{x:.0}"),
        a if a >= 1.0 => format!("{x:.2}"),
        _ => format!("{x:.3}"),
    }
}

/// nackd / baseline, or `n/a` when the baseline's figure is zero.
pub fn ratio(nackd: f64, baseline: f64) -> String {
    match baseline {
        b if b == 0.0 || !b.is_finite() => "n/a".into(),
        b => format!("{:.3}", nackd / b),
    }
}

/// Why `--baseline-rev` has no binary.
#[derive(Debug, thiserror::Error)]
pub enum BaselineError {
    /// Neither the current directory nor the executable is in a git repository.
    #[error("--baseline-rev {rev}: no git repository in the current directory or at this executable ({reason}); run nackd-bench from the nackd repository")]
    NoRepository {
        /// The rev asked for.
        rev: String,
        /// What git said.
        reason: String,
    },
    /// git does not know the rev, or it names no commit.
    #[error("--baseline-rev {rev}: not a commit of {}: {reason}", .repo.display())]
    UnknownRev {
        /// The rev asked for.
        rev: String,
        /// The repository it was looked up in.
        repo: PathBuf,
        /// What git said.
        reason: String,
    },
    /// The worktree, the build or the copy into the cache failed.
    #[error("--baseline-rev {rev} ({sha}): {step} failed: {reason}; build log {}", .log.display())]
    Build {
        /// The rev asked for.
        rev: String,
        /// Its commit.
        sha: String,
        /// What was being done.
        step: &'static str,
        /// The exit status or I/O error.
        reason: String,
        /// The build's output.
        log: PathBuf,
    },
}

/// Where `--baseline-rev` keeps its builds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cache {
    root: PathBuf,
}

impl Cache {
    /// `$NACKD_BENCH_BASELINES` (`env`) if set and not empty, else
    /// `target/bench-baselines` of `repo`.
    pub fn locate(repo: &Path, env: Option<OsString>) -> Self {
        let root = match env.filter(|e| !e.is_empty()) {
            Some(dir) => PathBuf::from(dir),
            None => repo.join("target").join("bench-baselines"),
        };
        // Absolute: git (from the repository), cargo (from the worktree)
        // and this process would each read a relative path from another
        // directory.
        let root = std::path::absolute(&root).unwrap_or(root);
        Self { root }
    }

    /// The cache's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The cached nackd of commit `sha`.
    pub fn binary(&self, sha: &str) -> PathBuf {
        self.root.join(sha).join("nackd")
    }

    /// The name the binary is copied to before it is renamed into place.
    fn staging(&self, sha: &str, pid: u32) -> PathBuf {
        self.root.join(sha).join(format!("nackd.tmp-{pid}"))
    }

    /// The worktree a build of `sha` by process `pid` checks out.
    pub fn worktree(&self, sha: &str, pid: u32) -> PathBuf {
        self.root.join(sha).join(format!("src-{pid}"))
    }

    /// The output of that build.
    pub fn log(&self, sha: &str, pid: u32) -> PathBuf {
        self.root.join(sha).join(format!("build-{pid}.log"))
    }

    /// `CARGO_TARGET_DIR` of every baseline build.
    pub fn target_dir(&self) -> PathBuf {
        self.root.join("target")
    }
}

/// A commit id as `git rev-parse` prints it (SHA-1 or SHA-256 hex), and
/// nothing that could climb out of the cache directory.
pub fn is_commit_id(sha: &str) -> bool {
    matches!(sha.len(), 40 | 64) && sha.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The nackd of one commit, from the cache.
struct Built {
    binary: PathBuf,
    sha: String,
    how: String,
}

/// Resolves `rev` and returns its cached nackd, building it first if needed.
fn build_rev(rev: &str) -> Result<Built, BaselineError> {
    let repo = repository().map_err(|reason| BaselineError::NoRepository {
        rev: rev.into(),
        reason,
    })?;
    let unknown = |reason: String| BaselineError::UnknownRev {
        rev: rev.into(),
        repo: repo.clone(),
        reason,
    };
    if rev.starts_with('-') {
        return Err(unknown("a rev cannot start with '-'".into()));
    }
    let sha = git(
        &repo,
        &["rev-parse", "--verify", &format!("{rev}^{{commit}}")],
    )
    .map_err(unknown)?;
    if !is_commit_id(&sha) {
        return Err(unknown(format!("git answered {sha:?}")));
    }
    let cache = Cache::locate(&repo, std::env::var_os(CACHE_ENV));
    let binary = cache.binary(&sha);
    if binary.is_file() {
        let how = format!("cached at {}", binary.display());
        return Ok(Built { binary, sha, how });
    }
    let began = Instant::now();
    build(&repo, &cache, rev, &sha)?;
    let how = format!(
        "built in {:.0} s into {}",
        began.elapsed().as_secs_f64(),
        binary.display()
    );
    Ok(Built { binary, sha, how })
}

/// Builds commit `sha`'s nackd in a worktree and renames it into the cache.
fn build(repo: &Path, cache: &Cache, rev: &str, sha: &str) -> Result<(), BaselineError> {
    let pid = std::process::id();
    let (src, log) = (cache.worktree(sha, pid), cache.log(sha, pid));
    let failed = |step: &'static str| {
        let log = log.clone();
        move |reason: String| BaselineError::Build {
            rev: rev.into(),
            sha: sha.into(),
            step,
            reason,
            log,
        }
    };
    std::fs::create_dir_all(cache.root().join(sha))
        .map_err(|e| failed("creating the cache directory")(e.to_string()))?;
    let output = File::create(&log).map_err(|e| failed("creating the build log")(e.to_string()))?;
    eprintln!(
        "nackd-bench: building nackd at {rev} ({sha}) in release for the baseline lane; log {}",
        log.display()
    );
    let mut worktree = Command::new("git");
    worktree
        .arg("-C")
        .arg(repo)
        .args(["worktree", "add", "--detach"])
        .arg(&src)
        .arg(sha);
    run(worktree, &output).map_err(failed("git worktree add"))?;
    // Every baseline build shares one target directory: from the build to
    // the rename, no other run may relink `release/nackd` under this one.
    let lock = File::create(cache.root().join("build.lock"))
        .and_then(|f| f.lock().map(|()| f))
        .map_err(|e| failed("locking the cache's builds")(e.to_string()))?;
    let built = run(cargo_build(&src, cache, sha), &output).map_err(failed("cargo build"));
    let placed = built.and_then(|()| {
        let staging = cache.staging(sha, pid);
        let from = cache.target_dir().join("release").join("nackd");
        std::fs::copy(&from, &staging)
            .and_then(|_| std::fs::rename(&staging, cache.binary(sha)))
            .map_err(|e| failed("copying the binary into the cache")(e.to_string()))
    });
    // The worktree goes whether the build worked or not; the log stays.
    let mut remove = Command::new("git");
    remove
        .arg("-C")
        .arg(repo)
        .args(["worktree", "remove", "--force"])
        .arg(&src);
    let removed = run(remove, &output);
    let _ = git(repo, &["worktree", "prune"]);
    drop(lock);
    placed?;
    removed.map_err(failed("git worktree remove"))
}

/// The release build of `sha`'s nackd in worktree `src`, as a user's
/// `cargo build --release` would make it: none of the settings a test run
/// or a shell may have exported (scripts/test's clippy-driver wrapper and
/// its `-D warnings`, extra rustc flags, profile overrides) reach it, since
/// the cache keeps one binary per commit, whoever built it.
fn cargo_build(src: &Path, cache: &Cache, sha: &str) -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .current_dir(src)
        .args([
            "build",
            "--release",
            "--locked",
            "-p",
            "nackd",
            "--bin",
            "nackd",
        ])
        .env("CARGO_TARGET_DIR", cache.target_dir())
        .env("NACKD_COMMIT", &sha[..12]);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(stripped) {
            build.env_remove(name);
        }
    }
    build
}

/// The environment variables a baseline build does without.
fn stripped(name: &str) -> bool {
    const EXACT: [&str; 7] = [
        "CARGO_BUILD_TARGET_DIR",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_BUILD_RUSTC_WORKSPACE_WRAPPER",
        "CLIPPY_ARGS",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
    ];
    EXACT.contains(&name) || name.starts_with("CARGO_PROFILE_")
}

/// Runs `command` with its output appended to `log`.
fn run(mut command: Command, log: &File) -> Result<(), String> {
    let out = log.try_clone().map_err(|e| e.to_string())?;
    let err = log.try_clone().map_err(|e| e.to_string())?;
    let status = command
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .status()
        .map_err(|e| e.to_string())?;
    match status.success() {
        true => Ok(()),
        false => Err(format!("exited with {status}")),
    }
}

/// The top of the git repository of the current directory, else of the
/// directory of this executable.
pub(crate) fn repository() -> Result<PathBuf, String> {
    let here = std::env::current_dir().map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut reason = String::new();
    for dir in [Some(here.as_path()), exe.parent()].into_iter().flatten() {
        match git(dir, &["rev-parse", "--show-toplevel"]) {
            Ok(top) => return Ok(PathBuf::from(top)),
            Err(e) => reason = e,
        }
    }
    Err(reason)
}

/// `git -C dir args`: its stdout trimmed, or its stderr as the error.
pub(crate) fn git(dir: &Path, args: &[&str]) -> Result<String, String> {
    let output = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running git: {e}"))?;
    match output.status.success() {
        true => Ok(String::from_utf8_lossy(&output.stdout).trim().to_string()),
        false => Err(String::from_utf8_lossy(&output.stderr).trim().to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Cli, Scenario};
    use clap::Parser;

    const SHA: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn the_cache_is_the_repos_target_unless_the_environment_moves_it() {
        let repo = Path::new("/src/nackd");
        let default = Cache::locate(repo, None);
        assert_eq!(
            default.root(),
            Path::new("/src/nackd/target/bench-baselines")
        );
        assert_eq!(Cache::locate(repo, Some("".into())), default);
        let moved = Cache::locate(repo, Some("/tmp/b".into()));
        assert_eq!(moved.root(), Path::new("/tmp/b"));
    }

    #[test]
    fn a_relative_cache_is_made_absolute_once() {
        let moved = Cache::locate(Path::new("/r"), Some("rel/cache".into()));
        assert!(moved.root().is_absolute(), "{:?}", moved.root());
        assert!(moved.root().ends_with("rel/cache"));
    }

    #[test]
    fn a_baseline_build_does_without_the_suites_wrappers_and_flags() {
        for name in [
            "RUSTC_WORKSPACE_WRAPPER",
            "CLIPPY_ARGS",
            "RUSTFLAGS",
            "CARGO_ENCODED_RUSTFLAGS",
            "CARGO_PROFILE_RELEASE_LTO",
            "CARGO_BUILD_TARGET_DIR",
        ] {
            assert!(stripped(name), "{name}");
        }
        for name in [
            "PATH",
            "HOME",
            "CARGO_HOME",
            "RUSTUP_TOOLCHAIN",
            "RUSTC_WRAPPER",
        ] {
            assert!(!stripped(name), "{name}");
        }
    }

    #[test]
    fn every_file_of_a_commit_is_in_its_own_directory() {
        let cache = Cache::locate(Path::new("/r"), Some("/c".into()));
        let dir = Path::new("/c").join(SHA);
        assert_eq!(cache.binary(SHA), dir.join("nackd"));
        // The staging copy is beside the binary (one rename, one file
        // system) and named by process, as are the worktree and the log,
        // so concurrent builds do not write each other's files.
        let staging = cache.staging(SHA, 7);
        assert_eq!(staging.parent(), cache.binary(SHA).parent());
        assert_ne!(staging, cache.staging(SHA, 8));
        assert_eq!(cache.worktree(SHA, 7), dir.join("src-7"));
        assert_eq!(cache.log(SHA, 7), dir.join("build-7.log"));
        assert_eq!(cache.target_dir(), Path::new("/c/target"));
    }

    #[test]
    fn a_ratio_is_nackd_over_the_baseline_and_none_over_zero() {
        assert_eq!(ratio(950.0, 1000.0), "0.950");
        assert_eq!(ratio(3.0, 0.0), "n/a");
        assert_eq!(figure(1234.4), "1234");
        assert_eq!(figure(2.5), "2.50");
        assert_eq!(figure(0.1234), "0.123");
    }

    #[test]
    fn only_a_full_hex_commit_id_names_a_cache_entry() {
        assert!(is_commit_id(SHA));
        assert!(is_commit_id(&"ab".repeat(32)));
        assert!(!is_commit_id("0204fdb"));
        assert!(!is_commit_id(&format!("../{}", &SHA[3..])));
        assert!(!is_commit_id(""));
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("nackd-bench").chain(args.iter().copied()))
    }

    fn baseline_of(cli: Cli) -> BaselineArgs {
        match cli.scenario {
            Scenario::Retry(a) => a.baseline,
            Scenario::Passthrough(a) => a.baseline,
            Scenario::Hold(a) => a.baseline,
            Scenario::Delayed(a) => a.baseline,
            Scenario::Adopt(a) => a.baseline,
            other => panic!("no baseline lane: {other:?}"),
        }
    }

    #[test]
    fn every_scenario_with_a_baseline_lane_takes_a_rev() {
        for scenario in ["retry", "passthrough", "hold", "delayed", "adopt"] {
            let cli = parse(&[scenario, "--baseline-rev", "HEAD~1"]).expect(scenario);
            let baseline = baseline_of(cli);
            assert_eq!(baseline.baseline_rev.as_deref(), Some("HEAD~1"));
            assert_eq!(baseline.baseline_nackd, None);
        }
    }

    #[test]
    fn a_rev_and_a_binary_exclude_each_other_a_rev_and_a_config_do_not() {
        for scenario in ["retry", "passthrough", "hold", "delayed", "adopt"] {
            let both = [scenario, "--baseline-rev", "v1", "--baseline-nackd", "/x"];
            let e = parse(&both).expect_err(scenario);
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
            let with_config = [scenario, "--baseline-rev", "v1", "--baseline-config", "c"];
            assert!(parse(&with_config).is_ok(), "{scenario}");
        }
    }

    #[test]
    fn no_baseline_option_no_baseline_lane() {
        let common = Common {
            proxy: None,
            broker: "127.0.0.1:5672".into(),
            seconds: 1,
            warmup: 0,
            rounds: 1,
            nackd_config: None,
        };
        assert!(BaselineArgs::default().resolve(&common).unwrap().is_none());
        let binary = BaselineArgs {
            baseline_nackd: Some("/opt/nackd".into()),
            ..Default::default()
        };
        let lane = binary.resolve(&common).unwrap().expect("a lane");
        assert_eq!(lane.binary, Path::new("/opt/nackd"));
        assert_eq!(lane.origin, None);
    }
}

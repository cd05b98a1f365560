//! `--baseline-rev` through the real `nackd-bench` binary, against the
//! RabbitMQ 3.10 on 127.0.0.1:5672: a commit whose cache entry is there is
//! measured as the lane `nackd-baseline` without a build (the entry is
//! pre-filled with the nackd of this build, so the test compiles no
//! nackd), and a rev git does not know ends the run, naming it, before
//! anything is started or measured.

use std::path::Path;
use std::process::{Command, Output};

mod common;

use common::{nackd, BENCH};

/// Where `--baseline-rev` caches builds (bench/src/baseline.rs).
const CACHE_ENV: &str = "NACKD_BENCH_BASELINES";

fn head() -> String {
    let out = Command::new("git")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["rev-parse", "--verify", "HEAD^{commit}"])
        .output()
        .expect("running git");
    assert!(out.status.success(), "git rev-parse HEAD failed");
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_string()
}

/// Runs `nackd-bench args` in this repository with the cache at `cache`.
fn bench(cache: &Path, args: &[&str]) -> Output {
    Command::new(BENCH)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env(CACHE_ENV, cache)
        .env_remove("NACKD_BENCH_LOG")
        .args(args)
        .output()
        .expect("running nackd-bench")
}

fn texts(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The number after `ratio ` on a line, if it is one.
fn ratio(line: &str) -> Option<f64> {
    line.rsplit_once("ratio ")?
        .1
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[test]
fn a_cached_rev_is_the_baseline_lane_of_hold_without_a_build() {
    let cache = tempfile::tempdir().expect("tempdir");
    let sha = head();
    let entry = cache.path().join(&sha);
    std::fs::create_dir(&entry).expect("cache entry");
    std::fs::copy(nackd(), entry.join("nackd")).expect("pre-filling the cache");

    let out = bench(
        cache.path(),
        &["hold", "--count", "300", "--baseline-rev", "HEAD"],
    );
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");

    let cached = format!(
        "baseline rv HEAD = {sha}, cached at {}",
        entry.join("nackd").display()
    );
    assert!(stdout.contains(&cached), "no {cached:?} in:\n{stdout}");
    // The lane ran the cached binary, not the measured one beside it.
    let started = format!("baseline    {} (pid ", entry.join("nackd").display());
    assert!(
        stdout.lines().any(|l| l.starts_with(&started)),
        "no {started:?} in:\n{stdout}"
    );
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("park        nackd-baseline: 300 nacks in")),
        "no park line of the baseline in:\n{stdout}"
    );
    for figure in ["park rate", "rss per held", "store", "restart, serving"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("versus      {figure} ")))
            .unwrap_or_else(|| panic!("no versus line for {figure} in:\n{stdout}"));
        assert!(line.contains("nackd-baseline "), "{line}");
        assert!(line.ends_with(" is better)"), "{line}");
        if figure != "rss per held" {
            // RSS may not grow for a few hundred messages: no ratio then.
            assert!(ratio(line).is_some_and(|r| r > 0.0), "{line}");
        }
    }
    // Nothing was built: the entry holds the binary and nothing else.
    let left: Vec<_> = std::fs::read_dir(&entry)
        .expect("entry")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(left, ["nackd"], "a build ran:\n{stderr}");
}

#[test]
fn an_unknown_rev_ends_the_run_naming_it_before_anything_is_measured() {
    let cache = tempfile::tempdir().expect("tempdir");
    let rev = "no-such-rev-for-nackd-bench";
    let out = bench(
        cache.path(),
        &["hold", "--count", "10", "--baseline-rev", rev],
    );
    let (stdout, stderr) = texts(&out);
    assert!(
        !out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stderr.contains(&format!("--baseline-rev {rev}: not a commit of")),
        "stderr:\n{stderr}"
    );
    assert!(!stdout.contains("park"), "it measured:\n{stdout}");
    let cached = std::fs::read_dir(cache.path()).expect("cache").count();
    assert_eq!(cached, 0, "the cache was written");
}

#[test]
fn a_rev_and_a_binary_are_refused_together() {
    let cache = tempfile::tempdir().expect("tempdir");
    let args = [
        "delayed",
        "--baseline-rev",
        "HEAD",
        "--baseline-nackd",
        "/bin/true",
    ];
    let out = bench(cache.path(), &args);
    let (_, stderr) = texts(&out);
    assert_eq!(out.status.code(), Some(2), "stderr:\n{stderr}");
    assert!(stderr.contains("cannot be used with"), "stderr:\n{stderr}");
}

/// `git -C dir args`, which must succeed.
fn git(dir: &Path, args: &[&str]) {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=bench", "-c", "user.email=bench@localhost"])
        .args(args)
        .output()
        .expect("running git");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_build_that_fails_names_the_rev_and_its_log_and_caches_nothing() {
    // A repository whose commit has no Cargo.toml: the build fails at once.
    let repo = tempfile::tempdir().expect("tempdir");
    std::fs::write(repo.path().join("README"), "not nackd\n").expect("a file");
    git(repo.path(), &["init", "-q"]);
    git(repo.path(), &["add", "README"]);
    git(repo.path(), &["commit", "-q", "-m", "no crate"]);
    let cache = tempfile::tempdir().expect("tempdir");
    let out = Command::new(BENCH)
        .current_dir(repo.path())
        .env(CACHE_ENV, cache.path())
        .env_remove("NACKD_BENCH_LOG")
        .args(["hold", "--count", "10", "--baseline-rev", "HEAD"])
        .output()
        .expect("running nackd-bench");
    let (stdout, stderr) = texts(&out);
    assert!(
        !out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stderr.contains("--baseline-rev HEAD ("),
        "stderr:\n{stderr}"
    );
    assert!(stderr.contains("cargo build failed"), "stderr:\n{stderr}");
    let log = stderr
        .split("build log ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no build log in:\n{stderr}"));
    assert!(Path::new(log).is_file(), "{log} is not a file");
    assert!(!stdout.contains("park"), "it measured:\n{stdout}");
    // No binary in the cache, and the worktree is gone from disk and git.
    let entry = Path::new(log).parent().expect("the commit's entry");
    let left: Vec<_> = std::fs::read_dir(entry)
        .expect("entry")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
        .collect();
    assert!(left.iter().all(|f| f.starts_with("build-")), "{left:?}");
    let worktrees = Command::new("git")
        .arg("-C")
        .arg(repo.path())
        .args(["worktree", "list"])
        .output()
        .expect("git worktree list");
    assert_eq!(
        String::from_utf8_lossy(&worktrees.stdout).lines().count(),
        1
    );
}

//! Names the commit a binary was built from, for `nackd --version` and the
//! `commit` label of `nackd_build_info`: `NACKD_COMMIT` when the build sets
//! it (the container build, where .git is absent), else what git says of
//! this checkout (`-dirty` when tracked files differ from it), else
//! "unknown". Sets `NACKD_COMMIT` and `NACKD_COMMIT_DATE` (the commit's
//! date, empty when unknown) for the crate.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=NACKD_COMMIT");
    println!("cargo:rerun-if-changed=build.rs");
    let given = std::env::var("NACKD_COMMIT").ok().filter(|c| !c.is_empty());
    let (commit, date) = match given {
        Some(commit) => (commit, String::new()),
        None => from_git().unwrap_or_else(|| ("unknown".into(), String::new())),
    };
    println!("cargo:rustc-env=NACKD_COMMIT={commit}");
    println!("cargo:rustc-env=NACKD_COMMIT_DATE={date}");
}

/// The commit of this checkout and its date, rerunning this script when
/// HEAD moves, a commit lands on its branch, or a tracked file changes.
fn from_git() -> Option<(String, String)> {
    let commit = git(&["rev-parse", "--short=12", "HEAD"])?;
    let date = git(&["log", "-1", "--format=%cs", "HEAD"]).unwrap_or_default();
    // In a worktree, HEAD and the index live in its own git dir, the
    // branches in the common one.
    let own = PathBuf::from(git(&["rev-parse", "--git-dir"])?);
    let common = PathBuf::from(git(&["rev-parse", "--git-common-dir"])?);
    let mut watched = vec![
        own.join("HEAD"),
        own.join("index"),
        common.join("packed-refs"),
    ];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(common.join(branch));
    }
    for path in watched.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    // An edit to a tracked file makes the tree dirty without touching the
    // index: watch what the binary is built from.
    for path in [
        "src",
        "core/src",
        "Cargo.toml",
        "core/Cargo.toml",
        "Cargo.lock",
    ] {
        println!("cargo:rerun-if-changed={path}");
    }
    // Tracked files only; GIT_OPTIONAL_LOCKS=0: git status does not write
    // the index it refreshes (a write would rerun this script).
    let dirty = Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .env("GIT_OPTIONAL_LOCKS", "0")
        .output()
        .is_ok_and(|out| out.status.success() && !out.stdout.is_empty());
    let commit = match dirty {
        true => format!("{commit}-dirty"),
        false => commit,
    };
    Some((commit, date))
}

/// One line of git's output, or `None` when git is missing or fails.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}

//! What the tests of `nackd-bench` share: the binaries they run.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The `nackd-bench` binary of this build.
pub const BENCH: &str = env!("CARGO_BIN_EXE_nackd-bench");

/// The `nackd` beside `nackd-bench`, built if this package's tests were
/// built alone (the workspace's build makes it for its own tests).
pub fn nackd() -> PathBuf {
    let bench = Path::new(BENCH);
    let nackd = bench.with_file_name("nackd");
    if nackd.is_file() {
        return nackd;
    }
    let profile_dir = bench.parent().expect("a directory");
    let target = profile_dir.parent().expect("the target directory");
    let mut build = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    build
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "-p", "nackd", "--bin", "nackd"])
        .env("CARGO_TARGET_DIR", target);
    if profile_dir.file_name() == Some("release".as_ref()) {
        build.arg("--release");
    }
    let status = build.status().expect("running cargo");
    assert!(
        status.success() && nackd.is_file(),
        "no nackd at {}: build it with `cargo build -p nackd --bin nackd`",
        nackd.display()
    );
    nackd
}

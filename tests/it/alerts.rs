//! The Prometheus alert rules shipped in `deploy/prometheus/`: they load
//! (`promtool check rules`) and each fires on the series that mean trouble
//! and stays silent on the normal ones (`promtool test rules`). `promtool`
//! comes with Debian's `prometheus` package, which `scripts/test` installs;
//! without it these tests fail, they do not skip. That every metric the
//! rules read is one nackd exports is checked in tests/ops.rs.

use std::process::Command;

fn promtool(args: &[&str]) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/prometheus");
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool (Debian package `prometheus`; scripts/test installs it)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    assert!(text.contains("SUCCESS"), "promtool {args:?}:\n{text}");
}

#[test]
fn the_alert_rules_load() {
    promtool(&["check", "rules", "nackd.rules.yml"]);
}

#[test]
fn each_alert_fires_on_trouble_and_only_then() {
    promtool(&["test", "rules", "nackd.rules.test.yml"]);
}

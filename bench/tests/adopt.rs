//! `nackd-bench adopt` in its suite-sized form (issue 36): 100 000 held
//! by A, 1 000 of them due while it is down, A SIGKILLed, B adopts, on
//! the RabbitMQ 3.10 on 127.0.0.1:5672 with the nackd of this build. The
//! run itself fails on a lost, doubled or early message; this checks
//! that it said so for every one, that the due ones fired once the first
//! part of the adoption was committed and before the whole, and prints
//! its figures.

mod common;

use std::process::Command;

use common::{nackd, BENCH};

/// The figure after `label` on the line starting with `prefix`.
fn figure(stdout: &str, prefix: &str, label: &str) -> f64 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line in:\n{stdout}"));
    line.split_once(label)
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.trim_end_matches([',', ';']).parse().ok())
        .unwrap_or_else(|| panic!("no number after {label:?} in {line:?}"))
}

#[test]
fn a_hundred_thousand_held_are_adopted_and_the_due_ones_fire_once_none_early() {
    nackd();
    let out = Command::new(BENCH)
        .env_remove("NACKD_BENCH_LOG")
        .args(["adopt", "--count", "100000", "--due", "1000"])
        .output()
        .expect("running nackd-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("kill        A SIGKILLed holding 100000;"),
        "A did not hold every message at the kill:\n{stdout}"
    );
    assert!(
        stdout.contains("due         1000 of 1000 back, 0 early;"),
        "{stdout}"
    );
    assert!(
        stdout.contains("held        B holds 99000 after the commit"),
        "{stdout}"
    );
    let parked = figure(&stdout, "adoption    ", "parked by B after");
    let committed = figure(&stdout, "adoption    ", "committed after");
    assert!(parked > 0.0 && parked <= committed, "{stdout}");
    let took = figure(&stdout, "adoption    ", "B's parks took");
    assert!(took > 0.0 && took < committed, "{stdout}");
    // Committed in parts, the soonest due first (issue 36): the due ones
    // fire once the first part is committed, while the rest is taken,
    // and not before.
    let part = figure(
        &stdout,
        "adoption    ",
        "its first part (the soonest due) after",
    );
    assert!(
        part < committed,
        "no part before the whole commit:\n{stdout}"
    );
    let first = figure(&stdout, "due         ", "the first back");
    assert!(
        first >= part,
        "a due message fired before its part was committed:\n{stdout}"
    );
}

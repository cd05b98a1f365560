//! The pass-through figures written the way pika and amqplib write: a
//! short run through a real nackd in front of the broker on
//! 127.0.0.1:5672 measures both lanes of both, and in every lane the
//! producer's window kept moving (the bench itself fails a side whose
//! consumer received nothing, or whose publishes went unconfirmed, while
//! measured).

use std::process::Command;

mod common;

use common::{nackd, BENCH};

/// The messages per second a report line of `what` and `lane` gives.
fn rate(report: &str, what: &str, lane: &str) -> f64 {
    let line = report
        .lines()
        .find(|l| l.starts_with(what) && l[what.len()..].trim_start().starts_with(lane))
        .unwrap_or_else(|| panic!("no {what} {lane} line in:\n{report}"));
    let after = line[what.len()..].trim_start()[lane.len()..].trim_start();
    after
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no rate in {line:?}"))
}

#[test]
fn the_pika_and_amqplib_figures_measure_both_lanes() {
    nackd();
    let out = Command::new(BENCH)
        .env("NACKD_BENCH_LOG", "warn,lapin=off")
        .args([
            "passthrough",
            "--seconds",
            "1",
            "--warmup",
            "1",
            "--rounds",
            "1",
        ])
        .args(["--only", "pika-writes", "--only", "amqplib-writes"])
        .output()
        .expect("running nackd-bench");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "nackd-bench failed:\n{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for what in [
        "as pika     1 KiB, a write per frame, an ack per message",
        "as amqplib  1 KiB, a write per message, an ack per message",
    ] {
        for lane in ["direct", "nackd"] {
            let r = rate(&report, what, lane);
            // A producer whose window stopped moving sends 200 in all.
            assert!(r > 1000.0, "{what} {lane}: {r} msg/s");
        }
        assert!(
            report
                .lines()
                .any(|l| l.starts_with(what) && l.contains("nackd/direct")),
            "no ratio for {what}:\n{report}"
        );
    }
}

//! The seeds' "Option C" (`../shared/seeds/000_*`, `003_*`: DLX, an
//! error consumer, an `x-delayed-message` wait exchange and a requeue
//! consumer), written with amqplib from the seed's text
//! (`tests/option_c/option_c.cjs`), runs through nackd on a broker without
//! the delayed-message plugin (issue 23): every failed message comes back
//! after its delay, none early, and ends as the recipe says.
//!
//! amqplib is the one `scripts/client-suites` installs from npm (once, in
//! its cache). On RabbitMQ 3.13 and later the broker no longer counts an
//! `x-death` a client republishes, so the recipe's rejected count stays 1
//! there: every retry waits the curve's first delay and a message that
//! always fails is retried for ever. The test expects exactly that, and
//! leaves the always-failing message out on those brokers.

use crate::common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use common::process::{delayed_config, Process};
use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;

const PROGRAM: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/option_c/option_c.cjs");
const SUITES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/client-suites");
/// The seed's curve (500, 30 000, 3 600, 18 000 ms), shortened; out of
/// order like the seed's.
const DELAYS: [u64; 4] = [500, 3000, 1200, 1800];
/// How late a retry may come back (nackd's lateness plus the recipe's hops).
const LATE_MS: u64 = 5000;

/// The directory of amqplib, installed by `scripts/client-suites` if it is
/// not yet.
fn amqplib() -> String {
    for args in [&["ensure"][..], &["amqplib"][..]] {
        let out = Command::new(SUITES)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{SUITES} does not run: {e}"));
        assert!(
            out.status.success(),
            "{SUITES} {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if args == ["amqplib"] {
            return String::from_utf8(out.stdout).unwrap().trim().to_string();
        }
    }
    unreachable!()
}

/// One line of the program's output.
#[derive(Debug)]
struct Event {
    ev: String,
    queue: String,
    id: String,
    count: i64,
    delay: u64,
    t: u64,
}

fn events(stdout: &str) -> Vec<Event> {
    stdout
        .lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("not a JSON event ({e}): {line}"));
            Event {
                ev: v["ev"].as_str().unwrap_or_default().to_string(),
                queue: v["queue"].as_str().unwrap_or_default().to_string(),
                id: v["id"].as_str().unwrap_or_default().to_string(),
                count: v["count"].as_i64().unwrap_or(0),
                delay: v["delay"].as_u64().unwrap_or(0),
                t: v["t"].as_u64().unwrap_or(0),
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn seed_option_c_retries_after_its_delays_through_nackd() {
    // The broker has no delayed-message plugin: without nackd the recipe
    // cannot even declare its wait exchange.
    let broker = direct().await;
    let ch = broker.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-delayed-type".into(),
        AMQPValue::LongString("fanout".into()),
    );
    let err = ch
        .exchange_declare(
            unique("no-plugin").as_str().into(),
            ExchangeKind::Custom("x-delayed-message".into()),
            ExchangeDeclareOptions::default(),
            args,
        )
        .await
        .expect_err("the broker itself knows no x-delayed-message exchange");
    // 503 COMMAND_INVALID on 3.10, 406 PRECONDITION_FAILED on 4.x.
    let text = err.to_string();
    assert!(
        ["503", "COMMAND_INVALID", "406", "PRECONDITION_FAILED"]
            .iter()
            .any(|code| text.contains(code))
            && text.contains("unknown exchange type 'x-delayed-message'"),
        "{text}"
    );
    drop(broker);

    let amqplib = tokio::task::spawn_blocking(amqplib).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let nackd = Process::start(&delayed_config(dir.path(), ""));
    // Before 3.13 the broker counts a republished x-death; from 3.13 on
    // the recipe's count stays 1 and an always-failing message never ends.
    let counts = !BROKER.at_least(3, 13);
    let mut messages = BTreeMap::from([("ok", 0), ("once", 1), ("twice", 2), ("thrice", 3)]);
    if counts {
        messages.insert("always", -1);
    }
    let prefix = format!("{}-", unique("option-c"));
    let mut cmd = Command::new("node");
    cmd.arg(PROGRAM)
        .env("AMQPLIB", &amqplib)
        .env("AMQP_URL", format!("amqp://guest:guest@{}/%2f", nackd.addr))
        .env("OPTION_C_PREFIX", &prefix)
        .env(
            "OPTION_C_MESSAGES",
            serde_json::to_string(&messages).unwrap(),
        )
        .env("OPTION_C_DELAYS", DELAYS.map(|d| d.to_string()).join(","))
        .env("OPTION_C_LIMIT_MS", "60000");
    let out = tokio::task::spawn_blocking(move || cmd.output().expect("node runs"))
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let accepted = ops::scrape(nackd.metrics)
        .await
        .sum("nackd_client_connections_accepted_total");
    let (status, _) = nackd.terminate(Duration::from_secs(30));
    cleanup(&prefix).await;

    let context = format!("stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        out.status.success(),
        "option_c.cjs: {}\n{context}",
        out.status
    );
    assert!(accepted >= 1.0, "the program did not go through nackd");
    assert!(status.success(), "nackd exited with {status}");
    let events = events(&stdout);
    assert_eq!(
        events.last().map(|e| e.ev.as_str()),
        Some("end"),
        "{context}"
    );
    assert!(
        !events.iter().any(|e| e.ev == "not-rejected"),
        "every dead-lettered message was a rejection: {context}"
    );

    let mut lateness = Vec::new();
    for (id, fails) in &messages {
        for queue in ["email-queue", "webhook-queue"] {
            let queue = format!("{prefix}{queue}");
            let of = |ev: &str| -> Vec<&Event> {
                events
                    .iter()
                    .filter(|e| e.ev == ev && e.id == *id && e.queue == queue)
                    .collect()
            };
            let (failed, waits, requeues) = (of("fail"), of("wait"), of("requeue"));
            let (done, exhausted) = (of("done"), of("exhausted"));
            let what = format!("{queue} {id}");
            // Retried as often as it failed, while the curve lasts.
            let rejections = if *fails < 0 {
                DELAYS.len() + 1
            } else {
                *fails as usize
            };
            let retries = rejections.min(DELAYS.len());
            assert_eq!(failed.len(), rejections, "{what}: failures\n{context}");
            assert_eq!(waits.len(), retries, "{what}: waits\n{context}");
            assert_eq!(requeues.len(), retries, "{what}: requeues\n{context}");
            if *fails < 0 {
                assert!(done.is_empty(), "{what}: always fails, yet done");
                assert_eq!(exhausted.len(), 1, "{what}: ends exhausted\n{context}");
                assert_eq!(exhausted[0].count, rejections as i64, "{what}");
            } else {
                assert_eq!(done.len(), 1, "{what}: processed once\n{context}");
                assert!(exhausted.is_empty(), "{what}: exhausted");
            }
            for (n, (wait, requeue)) in waits.iter().zip(&requeues).enumerate() {
                let count = if counts { n as i64 + 1 } else { 1 };
                assert_eq!(wait.count, count, "{what}: rejected count of retry {n}");
                assert_eq!(wait.delay, DELAYS[count as usize - 1], "{what}: retry {n}");
                let waited = requeue.t.saturating_sub(wait.t);
                assert!(
                    requeue.t >= wait.t + wait.delay,
                    "{what}: retry {n} of x-delay {} came back after {waited} ms (early)\n{context}",
                    wait.delay
                );
                assert!(
                    waited <= wait.delay + LATE_MS,
                    "{what}: retry {n} of x-delay {} came back after {waited} ms\n{context}",
                    wait.delay
                );
                lateness.push(waited - wait.delay);
            }
        }
    }
    lateness.sort_unstable();
    eprintln!(
        "option C on {}: {} retries came back, none early, {}-{} ms late",
        BROKER.label(),
        lateness.len(),
        lateness.first().unwrap_or(&0),
        lateness.last().unwrap_or(&0)
    );
}

/// Deletes the program's queues and exchanges, straight on the broker.
async fn cleanup(prefix: &str) {
    let broker = direct().await;
    let ch = broker.create_channel().await.unwrap();
    let queues = [
        "email-queue",
        "webhook-queue",
        "error-queue",
        "requeue-queue",
    ]
    .map(|q| format!("{prefix}{q}"));
    delete_queues(&ch, &queues.iter().map(String::as_str).collect::<Vec<_>>()).await;
    for x in ["notification-exchange", "error-exchange", "wait-exchange"] {
        let _ = ch
            .exchange_delete(
                format!("{prefix}{x}").as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
    }
}

//! The nackd binary under an operator: SIGHUP reloads `[[policy]]` (held
//! messages keep their schedule, an invalid file keeps the old policies),
//! and `nackd admin` drives the admin API of a running nackd.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::ops::{json, scrape, until};
use common::process::{Process, NACKD};
use common::*;
use lapin::options::*;
use lapin::Consumer;

const TOKEN: &str = "hot-reload-token-0123456789";

fn write_config(dir: &Path, queue: &str, delays: &str) -> PathBuf {
    let path = dir.join("nackd.toml");
    let text = format!(
        "[upstream]\naddress = \"{BROKER}\"\n[store]\npath = \"{}\"\n[metrics]\nadmin_token = \"{TOKEN}\"\n[[policy]]\nqueues = [\"{queue}\"]\ndelays = [{delays}]\n",
        dir.join("store").display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn hup(nackd: &Process) {
    common::process::wait_for_handler(nackd.child.id(), 1); // SIGHUP
    let pid = nackd.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());
}

async fn wait_reloads(nackd: &Process, result: &str, n: f64) {
    until(
        nackd.metrics,
        &format!("{n} reload(s) ({result}) counted"),
        |s| s.get("nackd_policy_reloads_total", &[("result", result)]) >= n,
    )
    .await;
}

/// Nacks the next delivery and returns when it was nacked.
async fn nack_next(c: &mut Consumer) -> Instant {
    let d = next(c, Duration::from_secs(5)).await.expect("a delivery");
    d.nack(BasicNackOptions {
        requeue: false,
        multiple: false,
    })
    .await
    .unwrap();
    Instant::now()
}

#[tokio::test]
async fn sighup_reloads_policies_and_keeps_held_schedules() {
    require_broker();
    let q = unique("reload");
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), &q, "\"1h\"");
    let nackd = Process::start(&cfg);
    let conn = common::connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr)).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_durable(&ch, &q).await;
    let mut c = consume(&ch, &q, Some(10)).await;

    // Held under the old policy: due in an hour.
    publish(&ch, &q, b"old").await;
    nack_next(&mut c).await;

    // Same session, new policy.
    write_config(dir.path(), &q, "\"150ms\"");
    hup(&nackd);
    wait_reloads(&nackd, "ok", 1.0).await;
    publish(&ch, &q, b"new").await;
    let nacked = nack_next(&mut c).await;
    let d = next(&mut c, Duration::from_secs(10))
        .await
        .expect("the new policy retries in 150 ms");
    let waited = nacked.elapsed();
    assert_eq!((&*d.data, retry_count(&d)), (&b"new"[..], 1));
    // 150 ms, not the old policy's hour: seconds of margin for a loaded machine.
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    d.ack(BasicAckOptions::default()).await.unwrap();

    // The old message keeps its one-hour schedule. The engine forgets the
    // new one when its confirm comes in, which may be after the consumer got
    // it: wait until only one is held.
    let held_path = format!("/api/held{}", common::ops::query(&q));
    let held = wait_for(
        Duration::from_secs(15),
        "only the old message held",
        || json(nackd.metrics, "GET", &held_path, Some(TOKEN)),
        |held| held["total"] == 1,
    )
    .await;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(
        held["held"][0]["due_ms"].as_u64().unwrap() > now_ms + 3_000_000,
        "{held}"
    );

    // An invalid file changes nothing.
    std::fs::write(
        &cfg,
        std::fs::read_to_string(&cfg)
            .unwrap()
            .replace("\"150ms\"", "\"soon\""),
    )
    .unwrap();
    hup(&nackd);
    wait_reloads(&nackd, "error", 1.0).await;
    publish(&ch, &q, b"after-bad-file").await;
    let nacked = nack_next(&mut c).await;
    let d = next(&mut c, Duration::from_secs(10))
        .await
        .expect("still the 150 ms policy");
    assert_eq!(&*d.data, b"after-bad-file");
    assert!(
        nacked.elapsed() < Duration::from_secs(10),
        "not the old hour: {:?}",
        nacked.elapsed()
    );
    d.ack(BasicAckOptions::default()).await.unwrap();
    // Held drops back to 1 when the engine has the retry's confirm.
    until(
        nackd.metrics,
        "one reload of each kind, only the old message held",
        |s| {
            s.get("nackd_policy_reloads_total", &[("result", "ok")]) == 1.0
                && s.get("nackd_policy_reloads_total", &[("result", "error")]) == 1.0
                && s.get(
                    "nackd_held_messages",
                    &[("vhost", "/"), ("queue", q.as_str())],
                ) == 1.0
        },
    )
    .await;
    conn.close(200, "".into()).await.unwrap();
}

fn admin(cfg: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(NACKD)
        .arg("--config")
        .arg(cfg)
        .arg("admin")
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test]
async fn admin_cli_lists_fires_and_purges() {
    require_broker();
    let q = unique("admin-cli");
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), &q, "\"1h\"");
    let nackd = Process::start(&cfg);
    // The CLI reads address and token from the file: point it at this process.
    let text = std::fs::read_to_string(&cfg).unwrap().replace(
        "[metrics]\n",
        &format!("[metrics]\naddress = \"{}\"\n", nackd.metrics),
    );
    let cli_cfg = dir.path().join("cli.toml");
    std::fs::write(&cli_cfg, text).unwrap();

    let conn = common::connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr)).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_durable(&ch, &q).await;
    let mut c = consume(&ch, &q, None).await;
    for body in [b"one", b"two"] {
        publish(&ch, &q, body).await;
        nack_next(&mut c).await;
    }
    until(nackd.metrics, "2 held", |s| {
        s.sum("nackd_held_messages") == 2.0
    })
    .await;

    let (ok, listed) = tokio::task::spawn_blocking({
        let (cfg, q) = (cli_cfg.clone(), q.clone());
        move || admin(&cfg, &["list", "--queue", &q])
    })
    .await
    .unwrap();
    assert!(ok, "{listed}");
    assert!(listed.ends_with("2 of 2 held\n"), "{listed}");
    assert!(listed.contains("\"x-retry-count\":1"), "{listed}");
    let first_id: String = listed.split_whitespace().nth(1).unwrap().to_string();

    let cfg2 = cli_cfg.clone();
    let fired = tokio::task::spawn_blocking(move || admin(&cfg2, &["fire", "--id", &first_id]))
        .await
        .unwrap();
    assert_eq!(fired, (true, "fired 1\n".to_string()));
    let d = next(&mut c, Duration::from_secs(10))
        .await
        .expect("fired now");
    assert_eq!(&*d.data, b"one");
    d.ack(BasicAckOptions::default()).await.unwrap();

    let (cfg3, q3) = (cli_cfg.clone(), q.clone());
    let purged = tokio::task::spawn_blocking(move || admin(&cfg3, &["purge", "--queue", &q3]))
        .await
        .unwrap();
    assert_eq!(purged, (true, "purged 1\n".to_string()));

    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        std::fs::read_to_string(&cli_cfg)
            .unwrap()
            .replace(TOKEN, "not-the-token-0123456789"),
    )
    .unwrap();
    let refused = tokio::task::spawn_blocking(move || admin(&bad, &["list"]))
        .await
        .unwrap();
    assert!(!refused.0 && refused.1.contains("HTTP 401"), "{refused:?}");
    conn.close(200, "".into()).await.unwrap();
}

#[tokio::test]
async fn a_proxy_started_without_policies_refuses_to_add_them_on_reload() {
    let nackd = start("").await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "q", "\"1s\"");
    let e = nackd.reloader.reload(&cfg).unwrap_err();
    assert!(
        matches!(e, nackd::reload::ReloadError::NotIntercepting),
        "{e}"
    );
    std::fs::write(&cfg, format!("[upstream]\naddress = \"{BROKER}\"\n")).unwrap();
    assert_eq!(
        nackd.reloader.reload(&cfg).unwrap(),
        0,
        "still no policies: fine"
    );
    let s = scrape(nackd.metrics).await;
    assert_eq!(
        s.get("nackd_policy_reloads_total", &[("result", "error")]),
        1.0
    );
    assert_eq!(
        s.get("nackd_policy_reloads_total", &[("result", "ok")]),
        1.0
    );
    nackd.stop().await;
}

/// `GET /api/policies` lists the policies in force, with the admin token
/// (and the read token, see ops.rs), and follows a SIGHUP reload; an
/// invalid file leaves the list as it was.
#[tokio::test]
async fn the_policies_in_force_are_listed_and_follow_a_reload() {
    require_broker();
    let dir = tempfile::tempdir().unwrap();
    let (q, other) = (unique("listed"), unique("listed-other"));
    let cfg = write_config(dir.path(), &q, "\"500ms\", \"1m\"");
    let nackd = Process::start(&cfg);
    let listed = || async {
        let r = json(nackd.metrics, "GET", "/api/policies", Some(TOKEN)).await;
        r["policies"].clone()
    };
    assert_eq!(
        listed().await,
        serde_json::json!([{
            "vhost": "/",
            "queues": [q],
            "schedule": { "delays": ["500ms", "1m"] },
            "requeue": "delay",
            "on_exhausted": "reject",
        }])
    );
    let anonymous = common::ops::get(nackd.metrics, "/api/policies").await;
    assert_eq!(anonymous.status, 401, "{}", anonymous.body);

    let text = std::fs::read_to_string(&cfg).unwrap();
    let first = text.find("[[policy]]").unwrap();
    let reloaded = format!(
        "{}[[policy]]\nvhost = \"v\"\nqueues = [\"{other}\", \"{other}-*\"]\nbackoff = {{ initial = \"1s\", max = \"5m\", jitter = \"full\" }}\nmax_retries = 4\nrequeue = \"pass\"\non_exhausted = {{ exchange = \"dlx\", routing_key = \"dead\" }}\n{}",
        &text[..first],
        &text[first..]
    );
    std::fs::write(&cfg, reloaded).unwrap();
    hup(&nackd);
    wait_reloads(&nackd, "ok", 1.0).await;
    let policies = listed().await;
    assert_eq!(
        policies[0],
        serde_json::json!({
            "vhost": "v",
            "queues": [other, format!("{other}-*")],
            "schedule": {
                "backoff": { "initial": "1s", "multiplier": 2.0, "max": "5m", "jitter": "full" },
                "max_retries": 4,
            },
            "requeue": "pass",
            "on_exhausted": { "exchange": "dlx", "routing_key": "dead" },
        })
    );
    assert_eq!(policies[1]["queues"], serde_json::json!([q]));
    assert_eq!(policies.as_array().unwrap().len(), 2);

    std::fs::write(&cfg, "[[policy]]\nqueues = []\n").unwrap();
    hup(&nackd);
    wait_reloads(&nackd, "error", 1.0).await;
    assert_eq!(listed().await, policies, "an invalid file changes nothing");
}

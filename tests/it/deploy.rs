//! The files in deploy/ stay true to the code: the Grafana dashboard only
//! queries metrics nackd exports, and the shipped configs are valid and
//! intercept nothing until edited.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use lapin::options::{BasicGetOptions, BasicPublishOptions};
use lapin::BasicProperties;

use nackd::config::Config;
use nackd::metrics::{Metrics, QueueLabels, VhostLabels};

const NACKD: &str = env!("CARGO_BIN_EXE_nackd");

fn deploy(name: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("deploy")
            .join(name),
    )
    .unwrap()
}

/// Every series name in the text format, with at least one series per family.
fn exported() -> BTreeSet<String> {
    let m = Metrics::new();
    let (queue, vhost) = (
        QueueLabels {
            vhost: "/".into(),
            queue: "q".into(),
        },
        VhostLabels { vhost: "/".into() },
    );
    m.held.get_or_create(&queue).set(1);
    m.held_bytes.get_or_create(&queue).set(1);
    m.republisher_connected.get_or_create(&vhost).set(1);
    m.republisher_blocked.get_or_create(&vhost).set(0);
    m.encode()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
        .collect()
}

#[test]
fn the_grafana_dashboard_queries_only_exported_metrics() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&deploy("grafana-dashboard.json")).expect("valid JSON");
    let exported = exported();
    let mut used = BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for (at, _) in expr.match_indices("nackd_") {
                let name: String = expr[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                assert!(
                    exported.contains(&name),
                    "panel {:?} queries {name}, which nackd does not export",
                    panel["title"]
                );
                used.insert(name);
            }
        }
    }
    for must in [
        "nackd_held_messages",
        "nackd_nacks_passed_total",
        "nackd_redelivery_lateness_seconds_bucket",
        "nackd_store_fsync_seconds_bucket",
    ] {
        assert!(used.contains(must), "the dashboard shows {must}");
    }
}

#[test]
fn the_container_config_is_valid() {
    let config = Config::parse(
        &deploy("nackd.container.toml"),
        Path::new("nackd.container.toml"),
    )
    .unwrap();
    assert_eq!(config.store.path, Path::new("/var/lib/nackd"));
    assert_eq!(
        config.republish.password_env.as_deref(),
        Some("NACKD_PASSWORD")
    );
    assert!(!config.intercepting(), "no policy until one is written");
    assert!(
        config.metrics.admin_token_env.is_none(),
        "a token left unset would stop nackd"
    );
    // The image itself is built and run by tests/alone/image.rs; what it
    // cannot see: the defaults a plain `docker build` uses.
    let dockerfile = deploy("Dockerfile");
    let lines: Vec<&str> = dockerfile.lines().collect();
    assert_eq!(lines.iter().filter(|l| l.starts_with("FROM ")).count(), 2);
    for line in [
        "ARG BUILDER_IMAGE=docker.io/library/rust:1-bookworm",
        "ARG RUNTIME_IMAGE=docker.io/library/debian:bookworm-slim",
        "USER 10001:10001",
        &format!("ARG NACKD_VERSION={}", env!("CARGO_PKG_VERSION")),
    ] {
        assert!(lines.contains(&line), "deploy/Dockerfile has {line}");
    }
    assert!(deploy("nackd.service").contains("ExecReload=/bin/kill -HUP $MAINPID"));
}

#[test]
fn the_systemd_unit_runs_as_the_nackd_user_and_checks_its_config_first() {
    let unit = deploy("nackd.service");
    for line in [
        "User=nackd",
        "Group=nackd",
        "StateDirectory=nackd",
        "ProtectSystem=strict",
        "ExecStartPre=/usr/bin/nackd --check-config /etc/nackd/nackd.toml",
        "ExecStart=/usr/bin/nackd --config /etc/nackd/nackd.toml --log-format json",
    ] {
        assert!(unit.lines().any(|l| l == line), "the unit has {line}");
    }
    assert!(
        !unit.lines().any(|l| l.starts_with("DynamicUser=")),
        "a dynamic user could not be in the config file's group"
    );
}

/// The settings of a TOML file: its lines without comments or blanks.
fn settings(toml: &str) -> Vec<&str> {
    toml.lines()
        .map(|l| l.split(" #").next().unwrap().trim())
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

/// The system config is config/nackd.toml but for what a package must
/// not ship: the store in the unit's state directory, nackd's own login
/// as user nackd with the password outside the file (no guest/guest), and
/// no `[[policy]]`: installed, it intercepts nothing until edited.
#[test]
fn the_system_config_is_the_example_config_without_policy_or_guest() {
    let system = deploy("nackd.system.toml");
    let config = Config::parse(&system, Path::new("nackd.system.toml")).unwrap();
    assert_eq!(config.store.path, Path::new("/var/lib/nackd"));
    assert!(!config.intercepting(), "no policy until one is written");
    assert!(!system.contains("guest"), "no guest login in the package");
    assert_eq!(config.republish.username(), "nackd");
    assert_eq!(
        config.republish.password_env.as_deref(),
        Some("NACKD_PASSWORD")
    );
    let example =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/nackd.toml"))
            .unwrap();
    let example = example.split("\n[[policy]]").next().unwrap();
    let expected: Vec<&str> = settings(example)
        .into_iter()
        .map(|l| match l {
            l if l.starts_with("path = ") => "path = \"/var/lib/nackd\"",
            "username = \"guest\"" => "username = \"nackd\"",
            "password = \"guest\"" => "password_env = \"NACKD_PASSWORD\"",
            l => l,
        })
        .collect();
    assert_eq!(
        settings(&system),
        expected,
        "config/nackd.toml changed: change deploy/nackd.system.toml too"
    );
}

/// `nackd --check-config` passes on both shipped files without any
/// secret set, and nackd starts on each as a plain proxy: a message goes
/// through it, and no store is opened.
#[test]
fn the_shipped_configs_check_and_start_as_a_plain_proxy() {
    crate::common::require_broker();
    for name in ["nackd.system.toml", "nackd.container.toml"] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy").join(name);
        let out = Command::new(NACKD)
            .arg("--check-config")
            .arg(&path)
            .env_remove("NACKD_PASSWORD")
            .env_remove("NACKD_ADMIN_TOKEN")
            .output()
            .unwrap();
        assert!(out.status.success(), "{name}: {out:?}");

        let mut child = Command::new(NACKD)
            .arg("--config")
            .arg(&path)
            .args(["--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
            .args(["--upstream", crate::common::BROKER.addr(), "--log-format", "json"])
            .env_remove("NACKD_PASSWORD")
            .env_remove("NACKD_ADMIN_TOKEN")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Its log keeps draining in a thread, into `lines`.
        let (tx, lines) = std::sync::mpsc::channel();
        let stderr = BufReader::new(child.stderr.take().unwrap());
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let listening = lines
            .iter()
            .find(|l| l.contains("\"listening\""))
            .unwrap_or_else(|| panic!("{name}: nackd exited before listening"));
        let line: serde_json::Value = serde_json::from_str(&listening).unwrap();
        let field = |f: &str| -> std::net::SocketAddr {
            line["fields"][f].as_str().unwrap().parse().unwrap()
        };
        let (addr, metrics) = (field("address"), field("metrics"));
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let conn = crate::common::connect(&format!("amqp://guest:guest@{addr}/%2f")).await;
            let ch = conn.create_channel().await.unwrap();
            let q = crate::common::unique("shipped");
            crate::common::declare_exclusive(&ch, &q).await;
            ch.basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                b"through",
                BasicProperties::default(),
            )
            .await
            .unwrap();
            let got = tokio::time::timeout(Duration::from_secs(10), async {
                loop {
                    let get = BasicGetOptions { no_ack: true };
                    if let Some(m) = ch.basic_get(q.as_str().into(), get).await.unwrap() {
                        return m;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
            .await
            .expect("the message went through");
            assert_eq!(got.delivery.data, b"through");
            let ready = crate::common::ops::get(metrics, "/readyz").await;
            let ready: serde_json::Value = serde_json::from_str(&ready.body).unwrap();
            assert_eq!(ready["store"], "not used", "{name}: {ready}");
            conn.close(200, "bye".into()).await.unwrap();
        });
        let _ = child.kill();
        let _ = child.wait();
    }
}

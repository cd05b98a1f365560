//! The files in deploy/ stay true to the code: the Grafana dashboard only
//! queries metrics nackd exports, and the container config is valid.

use std::collections::BTreeSet;
use std::path::Path;

use nackd::config::Config;
use nackd::metrics::{Metrics, QueueLabels, VhostLabels};

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
        config.metrics.admin_token_env.as_deref(),
        Some("NACKD_ADMIN_TOKEN")
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

#[test]
fn the_system_config_is_the_example_config_with_the_store_in_var_lib() {
    let system = deploy("nackd.system.toml");
    let config = Config::parse(&system, Path::new("nackd.system.toml")).unwrap();
    assert_eq!(config.store.path, Path::new("/var/lib/nackd"));
    let example =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/nackd.toml"))
            .unwrap();
    let expected: Vec<&str> = settings(&example)
        .into_iter()
        .map(|l| {
            if l.starts_with("path = ") {
                "path = \"/var/lib/nackd\""
            } else {
                l
            }
        })
        .collect();
    assert_eq!(
        settings(&system),
        expected,
        "config/nackd.toml changed: change deploy/nackd.system.toml too"
    );
}

//! The container image (deploy/Dockerfile) as an operator meets it: built
//! from this work tree by `scripts/image build` (buildah, with local base
//! images made from debootstrap roots: no image registry is reachable
//! here), its config checked (a numeric non-root user, SIGTERM to stop, the
//! store volume, the OCI labels), then run with podman (runc) in front of
//! the broker under test: a client through the container's port nacks a
//! message, the retry comes back after its delay with nackd's headers,
//! and `podman stop` (SIGTERM) ends it within `limits.shutdown_grace`, with
//! exit code 0. Needs root and buildah, podman, runc
//! (scripts/ensure-image-tools.sh installs them); without them it fails,
//! it does not skip. Run once, against 3.10 (.config/nextest.toml).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::AMQPValue;

use crate::common::process::host;
use crate::common::{self, BROKER};

const DIR: &str = env!("CARGO_MANIFEST_DIR");
/// The image the test builds; each build replaces it (scripts/image).
const IMAGE: &str = "localhost/nackd:suite";
/// The numeric user the image runs as.
const USER: &str = "10001:10001";
/// `limits.shutdown_grace` of the container's config.
const GRACE: Duration = Duration::from_secs(3);
/// The policy's only delay.
const DELAY: Duration = Duration::from_millis(500);

/// podman as it runs containers on this kind of machine: runc (crun fails
/// on its hybrid cgroups), cgroupfs, the host's network and ulimits it
/// accepts (its defaults are refused).
fn podman() -> Command {
    let mut command = Command::new("podman");
    command.args(["--cgroup-manager", "cgroupfs", "--runtime", "runc"]);
    command
}

fn podman_run(name: &str) -> Command {
    let mut command = podman();
    command.args([
        "run",
        "--name",
        name,
        "--network",
        "host",
        "--ulimit",
        "nofile=20000:20000",
        "--ulimit",
        "nproc=4096:4096",
        // As deploy/kubernetes runs it: nackd writes only its store (the
        // volume), needs no capability and gains no privilege.
        "--read-only",
        "--cap-drop=all",
        "--security-opt",
        "no-new-privileges",
    ]);
    command
}

/// A container by name, removed (killed if need be) when dropped, whether
/// the test passed or not.
struct Container {
    name: String,
}

impl Drop for Container {
    fn drop(&mut self) {
        let out = podman().args(["rm", "--force", &self.name]).output();
        if !out.as_ref().is_ok_and(|o| o.status.success()) {
            eprintln!("podman rm --force {}: {out:?}", self.name);
        }
    }
}

/// The image's config (`podman image inspect`).
fn image_config() -> serde_json::Value {
    let json = host(
        podman().args(["image", "inspect", IMAGE]),
        "podman image inspect",
    );
    let inspected: serde_json::Value = serde_json::from_str(&json).unwrap();
    inspected[0]["Config"].clone()
}

/// Checks the image's config; returns the commit it was built from (its
/// revision label).
fn assert_the_image_config(config: &serde_json::Value) -> String {
    assert_eq!(config["User"], USER, "a numeric user, not root: {config:#}");
    assert_eq!(config["StopSignal"], "SIGTERM", "{config:#}");
    assert!(
        config["Volumes"].get("/var/lib/nackd").is_some(),
        "the store is a volume: {config:#}"
    );
    let labels = &config["Labels"];
    assert_eq!(
        labels["org.opencontainers.image.version"],
        env!("CARGO_PKG_VERSION"),
        "{labels:#}"
    );
    assert_eq!(
        labels["org.opencontainers.image.licenses"],
        env!("CARGO_PKG_LICENSE")
    );
    let revision = labels["org.opencontainers.image.revision"]
        .as_str()
        .unwrap_or_default();
    assert!(
        revision.len() >= 40 && revision.chars().take(40).all(|c| c.is_ascii_hexdigit()),
        "the commit built is the revision label: {labels:#}"
    );
    assert!(
        labels.get("org.opencontainers.image.source").is_some(),
        "{labels:#}"
    );
    revision.to_string()
}

/// What runs in the image: the user's ids, the system's trust roots, and a
/// nackd whose `--version` names the commit the image was built from.
fn assert_the_user_trust_roots_and_version(name: &str, revision: &str) {
    let _container = Container {
        name: name.to_string(),
    };
    let out = host(
        podman_run(name).args([
            "--rm",
            "--entrypoint",
            "sh",
            IMAGE,
            "-c",
            "id -u; id -g; test -s /etc/ssl/certs/ca-certificates.crt && echo trust-roots; \
             /usr/local/bin/nackd --version",
        ]),
        "podman run (id, trust roots, version)",
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[..3], ["10001", "10001", "trust-roots"], "{out}");
    let version = lines.get(3).copied().unwrap_or_default();
    assert!(
        version.starts_with(&format!("nackd {} (", env!("CARGO_PKG_VERSION")))
            && version.contains(&revision[..12]),
        "nackd --version names the commit the image was built from ({revision}): {version:?}"
    );
}

/// The container's config: nackd on ephemeral ports of 127.0.0.1 (the
/// host's network), a policy for `queue` alone, a short grace.
fn config(queue: &str) -> String {
    format!(
        "[listen]\naddress = \"127.0.0.1:0\"\n\
         [upstream]\naddress = \"{BROKER}\"\n\
         [store]\npath = \"/var/lib/nackd\"\n\
         [metrics]\naddress = \"127.0.0.1:0\"\n\
         [limits]\nshutdown_grace = \"{}s\"\n\
         [[policy]]\nvhost = \"/\"\nqueues = [\"{queue}\"]\ndelays = [\"{}ms\"]\n",
        GRACE.as_secs(),
        DELAY.as_millis()
    )
}

/// Starts `podman run` in the foreground (its stderr is nackd's log), and
/// waits for nackd's "listening" line: its AMQP and operations addresses.
fn start(name: &str, config: &Path, store: &Path) -> (Child, SocketAddr, SocketAddr) {
    let mut child = podman_run(name)
        .arg("--volume")
        .arg(format!("{}:/etc/nackd/nackd.toml:ro", config.display()))
        .arg("--volume")
        .arg(format!("{}:/var/lib/nackd", store.display()))
        .arg(IMAGE)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run podman: {e}"));
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut log = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                if v["fields"]["message"] == "listening" {
                    let fields = &v["fields"];
                    let _ = tx.send(Ok((
                        fields["address"].as_str().unwrap().to_string(),
                        fields["metrics"].as_str().unwrap().to_string(),
                    )));
                }
            }
            eprintln!("container: {line}");
            log.push(line);
        }
        let _ = tx.send(Err(log));
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(Ok((addr, metrics))) => (child, addr.parse().unwrap(), metrics.parse().unwrap()),
        Ok(Err(log)) => panic!(
            "the container ended before nackd listened ({:?}): {log:#?}",
            child.wait()
        ),
        Err(e) => panic!("no \"listening\" line from the container in 60 s: {e}"),
    }
}

fn header<'a>(d: &'a lapin::message::Delivery, key: &str) -> Option<&'a AMQPValue> {
    d.properties.headers().as_ref()?.inner().get(key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_builds_from_the_work_tree_runs_as_10001_retries_and_stops_on_sigterm() {
    let _alone = common::alone();
    common::require_broker();
    assert!(
        unsafe { libc::geteuid() } == 0,
        "the image test needs root (buildah, podman, the image store); it does not skip"
    );
    host(
        // At the lowest CPU priority: minutes of compiling, beside tests
        // that time what they measure.
        Command::new("nice")
            .args(["-n", "19"])
            .arg(Path::new(DIR).join("scripts/image"))
            .args(["build", IMAGE])
            // build.rs's NACKD_COMMIT (cargo sets it for the tests too) is
            // the commit when the test was compiled: scripts/image asks git.
            .env_remove("NACKD_COMMIT")
            .stderr(Stdio::inherit()),
        "scripts/image build",
    );
    let revision = assert_the_image_config(&image_config());

    let name = common::unique("image");
    assert_the_user_trust_roots_and_version(&format!("{name}-id"), &revision);

    let queue = common::unique("image");
    let dir = tempfile::Builder::new()
        .prefix("nackd-image-test-")
        .tempdir()
        .unwrap();
    let config_path = dir.path().join("nackd.toml");
    std::fs::write(&config_path, config(&queue)).unwrap();
    let store = dir.path().join("store");
    std::fs::create_dir(&store).unwrap();
    std::os::unix::fs::chown(&store, Some(10001), Some(10001)).unwrap();

    let direct = common::direct().await;
    let setup = direct.create_channel().await.unwrap();
    common::declare_durable(&setup, &queue).await;

    let container = Container { name: name.clone() };
    let (mut child, addr, metrics) = start(&name, &config_path, &store);
    common::ops::wait_intercepting(metrics).await;

    let client = common::connect(&format!("amqp://guest:guest@{addr}/%2f")).await;
    let ch = client.create_channel().await.unwrap();
    common::publish(&ch, &queue, b"through the container").await;
    let mut consumer = common::consume(&ch, &queue, Some(10)).await;
    let first = common::next(&mut consumer, Duration::from_secs(10))
        .await
        .expect("the message through the container");
    assert_eq!(header(&first, "x-retry-count"), None);
    // Before the nack is sent: nackd cannot have it earlier. (Read after
    // lapin's answer, a loaded run measured the retry 0.6 ms "early".)
    let nacked = Instant::now();
    first
        .nack(BasicNackOptions {
            requeue: false,
            multiple: false,
        })
        .await
        .unwrap();
    let retry = common::next(&mut consumer, DELAY + Duration::from_secs(10))
        .await
        .expect("the retry");
    let waited = nacked.elapsed();
    assert!(
        waited >= DELAY,
        "the retry came after {waited:?}, before its {DELAY:?} delay"
    );
    assert_eq!(retry.data, b"through the container");
    assert_eq!(
        header(&retry, "x-retry-count"),
        Some(&AMQPValue::LongLongInt(1))
    );
    assert!(
        header(&retry, "x-retry-delay-ms").is_some(),
        "nackd's retry headers: {:?}",
        retry.properties.headers()
    );
    retry.ack(BasicAckOptions::default()).await.unwrap();
    let owners: Vec<u32> = std::fs::read_dir(&store)
        .unwrap()
        .map(|e| std::os::unix::fs::MetadataExt::uid(&e.unwrap().metadata().unwrap()))
        .collect();
    assert!(
        !owners.is_empty() && owners.iter().all(|&uid| uid == 10001),
        "nackd (uid 10001) wrote its store in the volume: owners {owners:?}"
    );

    // The client stays connected: the stop drains it within the grace.
    // podman stop waits grace + 30 s before SIGKILL, as the docs advise.
    let stopping = Instant::now();
    host(
        podman().args([
            "stop",
            "--time",
            &(GRACE.as_secs() + 30).to_string(),
            &name,
        ]),
        "podman stop",
    );
    let status = child.wait().unwrap();
    let took = stopping.elapsed();
    let exit = host(
        podman().args(["inspect", "--format", "{{.State.ExitCode}}", &name]),
        "podman inspect",
    );
    assert_eq!(exit.trim(), "0", "nackd exited by itself, not killed");
    assert!(status.success(), "podman run's status: {status}");
    assert!(
        took < GRACE + Duration::from_secs(5),
        "SIGTERM stopped it in {took:?}, more than the grace {GRACE:?} (+5 s)"
    );
    drop(container);

    let _ = client.close(0, "".into()).await;
    common::delete_queues(&setup, &[queue.as_str()]).await;
}

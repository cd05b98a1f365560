//! Shared test harness: a real nackd in-process in front of a real
//! RabbitMQ (3.10 on 127.0.0.1:5672 unless `NACKD_TEST_BROKER` names
//! another: see [`broker`]), and real lapin clients.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use lapin::{Connection, ConnectionProperties};
use nackd::config::Config;
use nackd::server::Proxy;
use tokio_util::sync::CancellationToken;

#[allow(unused_imports)]
pub use amqp::*;
pub use broker::{require_broker, BROKER};

pub mod amqp;
pub mod broker;
pub mod cluster;
pub mod ops;
pub mod process;
pub mod raw;
pub mod republish;

/// Held by a test that restarts the broker under test or loads the
/// machine (`tests/alone`): no other such test against the same broker
/// runs meanwhile, whatever runs them (threads of one `cargo test` binary,
/// or one process per test under `cargo nextest`, whose settings also keep
/// the rest of the pass away: `.config/nextest.toml`). The tests of
/// `tests/it` share the machine; those of `tests/alone` take turns per
/// broker.
pub fn alone() -> Alone {
    let broker = broker::chosen();
    let name = format!("alone-{}", broker.trim().replace([':', '/'], "_"));
    Alone(lock_file(&name, Lock::Exclusive))
}

/// The turn [`alone`] gave; the next test's when dropped (a failed test
/// drops it too, and a killed one's lock dies with its process).
pub struct Alone(std::fs::File);

/// How a test holds one of the machine-wide locks of [`lock_file`].
#[derive(Clone, Copy, Debug)]
pub enum Lock {
    /// Beside other holders of the shared lock.
    Shared,
    /// Alone.
    Exclusive,
}

/// Takes the machine-wide lock `name` (a file in the system's temporary
/// directory, locked with `flock`): tests in other processes, and other
/// threads of this one, wait for it as they would for an `RwLock`. The
/// lock goes with the returned file.
pub fn lock_file(name: &str, how: Lock) -> std::fs::File {
    let path = std::env::temp_dir().join(format!("nackd-tests-{name}.lock"));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("cannot open the test lock {}: {e}", path.display()));
    match how {
        Lock::Shared => file.lock_shared(),
        Lock::Exclusive => file.lock(),
    }
    .unwrap_or_else(|e| panic!("cannot lock {}: {e}", path.display()));
    file
}

/// A nackd running inside the test's runtime.
pub struct Nackd {
    pub addr: SocketAddr,
    /// Its operations listener (`/metrics`, `/readyz`, `/`, `/api/`).
    pub metrics: SocketAddr,
    /// Reloads its policies, as SIGHUP does.
    pub reloader: nackd::reload::Reloader,
    /// The store directory (removed when the test ends).
    pub store: Option<tempfile::TempDir>,
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<()>,
    /// The delayed exchanges it knows, when it intercepts.
    pub delayed: Option<std::sync::Arc<nackd_core::delayed::DelayedExchanges>>,
}

impl Nackd {
    /// AMQP URI of this nackd, with URI query options (e.g. `heartbeat=1`).
    pub fn uri(&self, query: &str) -> String {
        format!("amqp://guest:guest@{}/%2f?{query}", self.addr)
    }

    /// A lapin connection through this nackd.
    pub async fn connect(&self) -> Connection {
        connect(&self.uri("")).await
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(20), self.task).await;
    }
}

pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NACKD_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// Starts nackd with `extra` TOML appended to a config listening on an
/// ephemeral port in front of the broker under test.
pub async fn start(extra: &str) -> Nackd {
    start_upstream(BROKER.addr(), extra).await
}

/// Starts nackd whose store refuses every message (`store.max_bytes = 1`, in
/// a directory of its own, returned with it), with a policy for `queue` of
/// one `delay`: every nack it cannot hold.
pub async fn start_with_full_store(queue: &str, delay: &str) -> (Nackd, tempfile::TempDir) {
    let store = tempfile::tempdir().unwrap();
    let nackd = start(&format!(
        "[store]\npath = \"{}\"\nmax_bytes = 1\n[[policy]]\nqueues = [\"{queue}\"]\ndelays = [\"{delay}\"]\n",
        store.path().display()
    ))
    .await;
    (nackd, store)
}

/// The table that turns on nackd's emulation of the `x-delayed-message`
/// exchange type (issue 23): its delayed-publish store and engine run
/// without any `[[policy]]`.
pub const DELAYED: &str = "[delayed]\nenabled = true\n";

/// Starts nackd with the `x-delayed-message` emulation on ([`DELAYED`]),
/// its store in `store` (the caller's: a later nackd can start on it, as
/// after a restart), and `extra` TOML.
pub async fn start_delayed(store: &Path, extra: &str) -> Nackd {
    start(&format!(
        "[store]\npath = \"{}\"\n{DELAYED}{extra}",
        store.display()
    ))
    .await
}

/// Like [`start`], with nackd's upstream at `upstream` (e.g. a test relay).
pub async fn start_upstream(upstream: &str, extra: &str) -> Nackd {
    init_logs();
    require_broker();
    let mut text = format!(
        "[listen]\naddress = \"127.0.0.1:0\"\n[upstream]\naddress = \"{upstream}\"\n{extra}"
    );
    let store = tempfile::tempdir().unwrap();
    if !extra.contains("[store]") {
        text = format!("[store]\npath = \"{}\"\n{text}", store.path().display());
    }
    let mut nackd =
        start_with(Config::parse(&text, Path::new("test.toml")).expect("test config")).await;
    nackd.store = Some(store);
    nackd
}

/// Starts nackd with `config`; its metrics listener always takes an
/// ephemeral port (tests run side by side).
pub async fn start_with(mut config: Config) -> Nackd {
    config.metrics.address = "127.0.0.1:0".parse().unwrap();
    let proxy = Proxy::bind(&config).await.expect("bind");
    let (addr, metrics, reloader) = (proxy.local_addr(), proxy.metrics_addr(), proxy.reloader());
    let delayed = proxy.delayed_exchanges();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(proxy.run(shutdown.clone()));
    // nackd listens at once; its store is recovered meanwhile.
    ops::wait_intercepting(metrics).await;
    Nackd {
        addr,
        metrics,
        reloader,
        store: None,
        shutdown,
        task,
        delayed,
    }
}

pub async fn connect(uri: &str) -> Connection {
    Connection::connect(uri, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("connect {uri}: {e}"))
}

/// A connection straight to the broker, to check what nackd did.
pub async fn direct() -> Connection {
    require_broker();
    connect(&format!("amqp://guest:guest@{BROKER}/%2f")).await
}

/// A queue or exchange name no other test (or earlier run) uses.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "nackd-test-{prefix}-{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Waits for `f` to become true, polling; panics with `what` after `limit`.
pub async fn eventually<F: FnMut() -> bool>(limit: Duration, what: &str, mut f: F) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `probe` until `done` holds for what it saw, and returns that; after
/// `limit` panics with `what` and the last value seen. Every state a test
/// asserts that another task or thread updates (a metric, the store, the
/// broker's queue) is waited for this way, all of it in one `done`.
pub async fn wait_for<T, F>(
    limit: Duration,
    what: &str,
    mut probe: impl FnMut() -> F,
    done: impl Fn(&T) -> bool,
) -> T
where
    T: std::fmt::Debug,
    F: std::future::Future<Output = T>,
{
    let start = std::time::Instant::now();
    loop {
        let seen = probe().await;
        if done(&seen) {
            return seen;
        }
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}; last seen: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

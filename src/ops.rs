//! The operations listener (`[metrics] address`): `/metrics`, `/healthz`,
//! `/readyz`, the status page `/` with its data `/status.json`, and the
//! admin API under `/api/` (off unless an admin or a read token is configured).
//!
//! It starts before the store is recovered, so `/healthz` answers during a
//! long recovery while `/readyz` says "not yet".

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::metrics::{Login, Metrics, CONTENT_TYPE};
use crate::retry::RetryHandle;
use nackd_core::clock::Clock;
use nackd_core::policy::LivePolicies;
use nackd_core::session::Budget;

mod admin;
mod policies;
mod status;

pub use admin::{Access, AdminRoute};

/// How long `/readyz` waits for a TCP connect to the broker.
const UPSTREAM_CHECK_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a broker check of `/readyz` answers for: requests in between
/// share it, so probes (or anyone) cannot make nackd open a connection each.
const UPSTREAM_CHECK_TTL: Duration = Duration::from_secs(1);

/// The admin API's bearer tokens (`metrics.admin_token`,
/// `metrics.read_token`); the API is off without either.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tokens {
    /// Every admin route.
    pub admin: Option<String>,
    /// The admin routes that change nothing ([`Access::Read`]).
    pub read: Option<String>,
}

/// What the handlers share.
pub(crate) struct Ops {
    metrics: Arc<Metrics>,
    /// `host:port` of each broker node.
    nodes: Vec<String>,
    /// Takes every admin route.
    admin_token: Option<String>,
    /// Takes the admin routes that change nothing.
    read_token: Option<String>,
    intercepting: bool,
    /// The policies in force (`None`: nackd intercepts nothing).
    policies: Option<Arc<LivePolicies>>,
    clock: Clock,
    /// `republish.max_clock_offset`: above it, `/readyz` warns.
    max_clock_offset: Duration,
    engine: OnceLock<(RetryHandle, Arc<Budget>)>,
    /// Dead-letter replays (once the engine runs).
    replayer: OnceLock<crate::replay::Replayer>,
    draining: AtomicBool,
    /// The last broker check of `/readyz` and when it ran.
    upstream_check: tokio::sync::Mutex<Option<(Instant, Nodes)>>,
}

impl Ops {
    /// State for a proxy whose broker nodes are `nodes`. `policies`: those
    /// in force, which a reload replaces, when nackd intercepts (a store
    /// and an engine will be [`attach`](Ops::attach)ed once recovered).
    pub(crate) fn new(
        metrics: Arc<Metrics>,
        nodes: Vec<String>,
        tokens: Tokens,
        policies: Option<Arc<LivePolicies>>,
        clock: Clock,
        max_clock_offset: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            metrics,
            nodes,
            admin_token: tokens.admin,
            read_token: tokens.read,
            intercepting: policies.is_some(),
            policies,
            clock,
            max_clock_offset,
            engine: OnceLock::new(),
            replayer: OnceLock::new(),
            draining: AtomicBool::new(false),
            upstream_check: tokio::sync::Mutex::new(None),
        })
    }

    /// The store is recovered and the engine runs.
    pub(crate) fn attach(&self, retry: RetryHandle, budget: Arc<Budget>) {
        let _ = self.engine.set((retry, budget));
    }

    /// Dead-letter replays park through the engine attached.
    pub(crate) fn attach_replayer(&self, replayer: crate::replay::Replayer) {
        let _ = self.replayer.set(replayer);
    }

    /// nackd stopped accepting clients: no longer ready.
    pub(crate) fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    fn retry(&self) -> Option<&RetryHandle> {
        self.engine.get().map(|(retry, _)| retry)
    }
}

/// The routes.
pub(crate) fn router(ops: Arc<Ops>) -> Router {
    let api = admin::router(&ops);
    Router::new()
        .route("/", get(status::page))
        .route("/status.json", get(status::json))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .merge(api)
        .with_state(ops)
}

/// Binds the listener (nothing is served yet).
pub(crate) async fn bind(address: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(address).await
}

/// Serves until `stop`.
pub(crate) async fn serve(listener: TcpListener, ops: Arc<Ops>, stop: CancellationToken) {
    let served = axum::serve(listener, router(ops))
        .with_graceful_shutdown(stop.cancelled_owned())
        .await;
    if let Err(e) = served {
        warn!(error = %e, "the metrics listener failed");
    }
}

async fn metrics(State(ops): State<Arc<Ops>>) -> Response {
    if let Some((_, budget)) = ops.engine.get() {
        ops.metrics.capture_bytes.set(budget.used() as i64);
    }
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], ops.metrics.encode()).into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(ops): State<Arc<Ops>>) -> Response {
    let store = match (ops.intercepting, ops.engine.get()) {
        (false, _) => "not used".to_string(),
        (true, None) => "recovering".to_string(),
        (true, Some((retry, _))) if retry.ready.stalled() => {
            "not answering: a write has not returned within the settle timeout (a stuck disk?); nacks are deferred".to_string()
        }
        (true, Some((retry, _))) => match retry.ready.get() {
            crate::retry::Ready::Recovering => "recovering".to_string(),
            crate::retry::Ready::NoLease if ops.metrics.replica_refused.get() == 1 => {
                "no lease: upstream.addresses differ from those of this instance id's last holder (the log names both)".to_string()
            }
            crate::retry::Ready::NoLease => "no lease".to_string(),
            // The stream and what to do about it.
            crate::retry::Ready::NoReplica => ops
                .metrics
                .replica_missing
                .reason()
                .unwrap_or_else(|| "no replica: reseeding".to_string()),
            crate::retry::Ready::Failed => "closed".to_string(),
            crate::retry::Ready::Ready if ops.metrics.store_open.get() == 1 => {
                // Firing paused: held messages wait, new nacks are deferred.
                let paused = ops.metrics.firing_paused();
                paused.map_or("ok", |r| r.text()).to_string()
            }
            crate::retry::Ready::Ready => "closed".to_string(),
        },
    };
    let nodes = ops.upstream_check().await;
    let upstream = nodes.summary();
    let draining = ops.draining.load(Ordering::Relaxed);
    // Each vhost the policies intercept for: can nackd's own login get
    // in? If not, what it holds there can never be republished.
    let logins = ops.metrics.republish_logins.all();
    let reasons = unready_reasons(&upstream, &store, &logins, draining);
    let republish: serde_json::Map<String, serde_json::Value> = logins
        .into_iter()
        .map(|(vhost, l)| (vhost, l.text().into()))
        .collect();
    let ready = reasons.is_empty();
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    // Older segments still being read after a start: nacks are held as
    // usual, what those segments hold fires once they are read.
    let recovering = ops.metrics.store_recovering.get() == 1;
    let mut warnings = clock_warnings(ops.metrics.clock_offset.get(), ops.max_clock_offset);
    if ops.metrics.delayed.registry_synced.get() == 0 {
        warnings.push(REGISTRY_UNREAD.to_string());
    }
    let mut body = json!({ "ready": ready, "upstream": upstream, "store": store,
        "store_recovering": recovering, "republish": republish, "draining": draining,
        "reasons": reasons, "warnings": warnings });
    if nodes.0.len() > 1 {
        body["nodes"] = nodes.to_json();
    }
    (code, Json(body)).into_response()
}

/// Why nackd is not ready, one sentence per failed check (none: ready):
/// what the status page shows at its top, and `/readyz` under `"reasons"`.
fn unready_reasons(
    upstream: &str,
    store: &str,
    logins: &std::collections::BTreeMap<String, Login>,
    draining: bool,
) -> Vec<String> {
    let mut reasons = Vec::new();
    if upstream != "ok" {
        reasons.push(format!("broker {upstream}"));
    }
    if !matches!(store, "ok" | "not used") {
        reasons.push(format!("store: {store}"));
    }
    for (vhost, login) in logins.iter().filter(|(_, l)| **l != Login::Ok) {
        reasons.push(format!(
            "republish login into vhost {vhost:?}: {}",
            login.text()
        ));
    }
    if draining {
        reasons.push("draining: nackd is shutting down".into());
    }
    reasons
}

/// What `/readyz` warns about while `[delayed] registry` is on and the
/// shared registry is not read to its end, or this instance's changes
/// not written to it (`nackd_delayed_registry_synced` 0; ready all the
/// same: publishes without `x-delay`, and to exchanges this instance
/// knows, go on).
const REGISTRY_UNREAD: &str = "delayed registry: the registry of delayed exchanges shared by every instance is not read to its end, or changes made through this instance are not written to it yet; x-delay publishes to exchanges this instance does not know as delayed are refused meanwhile";

/// What `/readyz` warns about without being unready: nackd's clock off
/// the broker's by more than `max` (`offset`: NaN until measured).
fn clock_warnings(offset: f64, max: Duration) -> Vec<String> {
    if offset.is_nan() || offset.abs() <= max.as_secs_f64() {
        return Vec::new();
    }
    let side = if offset > 0.0 { "ahead of" } else { "behind" };
    vec![format!(
        "clock: nackd's clock is {:.1} s {side} the broker's (more than {max:?}): due times can be off by that much after a restart or an adoption",
        offset.abs()
    )]
}

/// What each broker node answered: `ok` or `unreachable: why`.
#[derive(Clone, Debug)]
struct Nodes(Vec<(String, String)>);

impl Nodes {
    /// `ok` when a node answers (nackd fails over to it), else the first error.
    fn summary(&self) -> String {
        match self.0.iter().find(|(_, r)| r == "ok") {
            Some(_) => "ok".into(),
            None => self.0.first().map_or_else(String::new, |(_, r)| r.clone()),
        }
    }

    fn to_json(&self) -> serde_json::Value {
        let map: serde_json::Map<String, serde_json::Value> = self
            .0
            .iter()
            .map(|(node, r)| (node.clone(), serde_json::Value::String(r.clone())))
            .collect();
        serde_json::Value::Object(map)
    }
}

impl Ops {
    /// Whether a TCP connect to each broker node succeeds, checked at most
    /// once per [`UPSTREAM_CHECK_TTL`]; concurrent requests wait for one check.
    async fn upstream_check(&self) -> Nodes {
        let mut last = self.upstream_check.lock().await;
        if let Some((at, result)) = last.as_ref() {
            if self.clock.now() - *at < UPSTREAM_CHECK_TTL {
                return result.clone();
            }
        }
        let mut checks = tokio::task::JoinSet::new();
        for (i, node) in self.nodes.iter().cloned().enumerate() {
            checks.spawn(async move {
                let connect = tokio::net::TcpStream::connect(node.clone());
                let answer = match tokio::time::timeout(UPSTREAM_CHECK_TIMEOUT, connect).await {
                    Ok(Ok(_)) => "ok".to_string(),
                    Ok(Err(e)) => format!("unreachable: {e}"),
                    Err(_) => "unreachable: connect timed out".to_string(),
                };
                (i, node, answer)
            });
        }
        let mut answers: Vec<(usize, String, String)> = checks.join_all().await;
        answers.sort();
        let result = Nodes(answers.into_iter().map(|(_, n, a)| (n, a)).collect());
        *last = Some((self.clock.now(), result.clone()));
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 33, item 7: `/readyz` warns about a clock off the broker's by
    /// more than the bound, either way, and not before it is measured.
    #[test]
    fn the_clock_warns_only_above_its_bound() {
        let max = Duration::from_secs(2);
        assert!(clock_warnings(f64::NAN, max).is_empty());
        assert!(clock_warnings(1.9, max).is_empty());
        assert!(clock_warnings(-2.0, max).is_empty());
        let ahead = clock_warnings(3.25, max);
        assert_eq!(ahead.len(), 1);
        assert!(ahead[0].contains("3.2 s ahead of"), "{ahead:?}");
        let behind = clock_warnings(-7.0, max);
        assert!(behind[0].contains("7.0 s behind"), "{behind:?}");
    }

    #[test]
    fn ready_has_no_reason_and_each_failed_check_names_one() {
        let ok = [("/".to_string(), Login::Ok)].into();
        assert!(unready_reasons("ok", "ok", &ok, false).is_empty());
        assert!(unready_reasons("ok", "not used", &ok, false).is_empty());
        let logins = [
            ("/".to_string(), Login::Ok),
            (
                "shop".to_string(),
                Login::Failed("403 ACCESS_REFUSED (user nackd)".into()),
            ),
            ("new".to_string(), Login::Checking),
        ]
        .into();
        assert_eq!(
            unready_reasons(
                "unreachable: connection refused",
                "recovering",
                &logins,
                true
            ),
            [
                "broker unreachable: connection refused",
                "store: recovering",
                "republish login into vhost \"new\": checking",
                "republish login into vhost \"shop\": 403 ACCESS_REFUSED (user nackd)",
                "draining: nackd is shutting down",
            ]
        );
    }
}

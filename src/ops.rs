//! The operations listener (`[metrics] address`): `/metrics`, `/healthz`,
//! `/readyz`, the status page `/` with its data `/status.json`, and the
//! admin API under `/api/` (off unless an admin token is configured).
//!
//! It starts before the store is recovered, so `/healthz` answers during a
//! long recovery while `/readyz` says "not yet".

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{middleware, Json, Router};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::intercept::Budget;
use crate::metrics::{Metrics, CONTENT_TYPE};
use crate::retry::RetryHandle;

mod admin;
pub mod cli;
pub mod client;
mod status;

/// How long `/readyz` waits for a TCP connect to the broker.
const UPSTREAM_CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// What the handlers share.
pub struct Ops {
    metrics: Arc<Metrics>,
    upstream: String,
    admin_token: Option<String>,
    intercepting: bool,
    engine: OnceLock<(RetryHandle, Arc<Budget>)>,
    draining: AtomicBool,
}

impl Ops {
    /// State for a proxy whose broker is `upstream`. `intercepting`: a store
    /// and an engine will be [`attach`](Ops::attach)ed once recovered.
    pub fn new(
        metrics: Arc<Metrics>,
        upstream: String,
        admin_token: Option<String>,
        intercepting: bool,
    ) -> Arc<Self> {
        Arc::new(Self {
            metrics,
            upstream,
            admin_token,
            intercepting,
            engine: OnceLock::new(),
            draining: AtomicBool::new(false),
        })
    }

    /// The store is recovered and the engine runs.
    pub fn attach(&self, retry: RetryHandle, budget: Arc<Budget>) {
        let _ = self.engine.set((retry, budget));
    }

    /// nackd stopped accepting clients: no longer ready.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    fn retry(&self) -> Option<&RetryHandle> {
        self.engine.get().map(|(retry, _)| retry)
    }
}

/// The routes.
pub fn router(ops: Arc<Ops>) -> Router {
    let api = Router::new()
        .route("/api/held", get(admin::list))
        .route("/api/fire", post(admin::fire))
        .route("/api/purge", post(admin::purge))
        .route_layer(middleware::from_fn_with_state(
            ops.clone(),
            admin::authorize,
        ));
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
pub async fn bind(address: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(address).await
}

/// Serves until `stop`.
pub async fn serve(listener: TcpListener, ops: Arc<Ops>, stop: CancellationToken) {
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
    let store = match (
        ops.intercepting,
        ops.engine.get().is_some(),
        ops.metrics.store_open.get(),
    ) {
        (false, _, _) => "not used",
        (true, false, _) => "recovering",
        (true, true, 1) => "ok",
        (true, true, _) => "closed",
    };
    let address = ops.upstream.clone();
    let upstream = match tokio::time::timeout(
        UPSTREAM_CHECK_TIMEOUT,
        tokio::net::TcpStream::connect(address),
    )
    .await
    {
        Ok(Ok(_)) => "ok".to_string(),
        Ok(Err(e)) => format!("unreachable: {e}"),
        Err(_) => "unreachable: connect timed out".to_string(),
    };
    let draining = ops.draining.load(Ordering::Relaxed);
    let ready = upstream == "ok" && matches!(store, "ok" | "not used") && !draining;
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body =
        json!({ "ready": ready, "upstream": upstream, "store": store, "draining": draining });
    (code, Json(body)).into_response()
}

//! The status page (`GET /`, plain HTML and a little JS) and the JSON it
//! polls (`GET /status.json`). Both are public like `/metrics`: they carry
//! counts and queue names, never message contents.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::Ops;
use crate::metrics::PassReason;

/// The page; its script renders `/status.json` every few seconds.
const PAGE: &str = include_str!("status.html");

pub(super) async fn page() -> Html<&'static str> {
    Html(PAGE)
}

pub(super) async fn json(State(ops): State<Arc<Ops>>) -> Response {
    let m = &ops.metrics;
    let engine = match ops.retry() {
        Some(retry) => retry.status().await.ok(),
        None => None,
    };
    let passed: serde_json::Map<String, serde_json::Value> = PassReason::ALL
        .iter()
        .map(|r| (r.label().to_string(), json!(m.session.passed(*r))))
        .collect();
    let deferred: serde_json::Map<String, serde_json::Value> = PassReason::ALL
        .iter()
        .filter(|r| r.defers())
        .map(|r| (r.label().to_string(), json!(m.session.deferred(*r))))
        .collect();
    let body = json!({
        "version": env!("CARGO_PKG_VERSION"),
        "commit": env!("NACKD_COMMIT"),
        "intercepting": ops.intercepting,
        "policies": super::policies::in_force(&ops),
        "connections": {
            "clients": m.clients.get(),
            "upstream": m.upstreams.get(),
            "republishers": m.republishers.get(),
        },
        "totals": {
            "intercepted": m.session.intercepted.get(),
            "passed": m.session.passed_total(),
            "published": m.published.get(),
            "confirmed": m.confirmed.get(),
            "returned": m.returned.get(),
            "exhausted_reject": m.session.exhausted_reject.get(),
            "exhausted_dead_letter": m.exhausted_dead_letter.get(),
            "gone_dropped": m.gone_dropped.get(),
            "gone_dead_lettered": m.gone_dead_lettered.get(),
        },
        "passed": passed,
        "deferred": deferred,
        "deferred_now": m.session.deferred_now.get(),
        "policy_exchanges_missing": m.exchanges_missing.get(),
        "engine": engine,
        "recent": m.session.recent.newest_first(),
        "store": {
            "damaged_bytes": m.store_damaged_bytes.get(),
            "damaged_ranges": m.store_damaged_ranges.get(),
            "torn_bytes": m.store_torn_bytes.get(),
            "damage": m.store_damage.all(),
        },
    });
    Json(body).into_response()
}

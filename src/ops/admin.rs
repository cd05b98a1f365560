//! The admin API: list held messages, fire them now, purge them. Every call
//! carries `Authorization: Bearer <metrics.admin_token>`; without a
//! configured token the API does not exist (404).
//!
//! ```text
//! GET  /api/held?queue=Q&vhost=V&limit=N   soonest due first (limit 100, at most 10000)
//!      /api/held?exchange=X&vhost=V         delayed publishes of an x-delayed-message exchange
//! POST /api/fire?id=N | ?queue=Q | ?exchange=X [&vhost=V]  publish now
//! POST /api/purge?id=N | ?queue=Q | ?exchange=X [&vhost=V] forget (no republish)
//! POST /api/replica/reseed                  a new replica stream from the local store
//! POST /api/replay?dlq=D[&vhost=V][&to=Q][&queue=Q][&reason=R][&limit=N]
//!      [&spread=10m][&reset_count=false][&dry_run=true]
//!                                           dead-letter replay (or the same as a JSON body)
//! ```

use std::sync::Arc;

use amq_protocol::types::AMQPValue;
use axum::extract::{Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::Ops;
use crate::retry::{Kind, Listed, Target};
use crate::store::Held;

/// Listed when no `limit` is given.
const DEFAULT_LIMIT: usize = 100;
/// Largest `limit`.
const MAX_LIMIT: usize = 10_000;

/// Query parameters of the admin calls.
#[derive(Debug, Default, Deserialize)]
pub(super) struct Params {
    id: Option<u64>,
    queue: Option<String>,
    exchange: Option<String>,
    vhost: Option<String>,
    limit: Option<usize>,
}

fn error(code: StatusCode, message: impl std::fmt::Display) -> Response {
    (code, Json(json!({ "error": message.to_string() }))).into_response()
}

/// Compares without stopping at the first difference.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Checks the bearer token on every admin call.
pub(super) async fn authorize(
    State(ops): State<Arc<Ops>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(token) = &ops.admin_token else {
        return error(
            StatusCode::NOT_FOUND,
            "the admin API is off: set metrics.admin_token or metrics.admin_token_env",
        );
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if !given.is_some_and(|g| same(g.trim().as_bytes(), token.as_bytes())) {
        let mut response = error(StatusCode::UNAUTHORIZED, "missing or wrong admin token");
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        return response;
    }
    next.run(request).await
}

fn target(p: &Params) -> Option<Target> {
    let vhost = || p.vhost.clone().unwrap_or_else(|| "/".into());
    match (p.id, &p.queue, &p.exchange) {
        (Some(id), None, None) => Some(Target::Id(id)),
        (None, Some(queue), None) => Some(Target::Queue {
            vhost: vhost(),
            queue: queue.clone(),
        }),
        (None, None, Some(exchange)) => Some(Target::Exchange {
            vhost: vhost(),
            exchange: exchange.clone(),
        }),
        _ => None,
    }
}

/// The name a listing is narrowed to: a queue's retries or an exchange's
/// delayed publishes (not both at once).
fn named(p: &Params) -> Result<Option<(String, Kind)>, &'static str> {
    match (&p.queue, &p.exchange) {
        (Some(q), None) => Ok(Some((q.clone(), Kind::Retry))),
        (None, Some(x)) => Ok(Some((x.clone(), Kind::Delayed))),
        (None, None) => Ok(None),
        _ => Err("give queue=NAME or exchange=NAME, not both"),
    }
}

pub(super) async fn list(State(ops): State<Arc<Ops>>, Query(p): Query<Params>) -> Response {
    let Some(retry) = ops.retry() else {
        return Json(json!({ "total": 0, "held": [] })).into_response();
    };
    let limit = p.limit.unwrap_or(DEFAULT_LIMIT).min(MAX_LIMIT);
    let named = match named(&p) {
        Ok(named) => named,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    match retry.list(p.vhost, named, limit).await {
        Ok((listed, total)) => {
            let held: Vec<Value> = listed
                .into_iter()
                .map(|(l, h)| listed_json(&l, h.as_ref()))
                .collect();
            Json(json!({ "total": total, "held": held })).into_response()
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e),
    }
}

pub(super) async fn fire(State(ops): State<Arc<Ops>>, Query(p): Query<Params>) -> Response {
    act(&ops, &p, "fired").await
}

pub(super) async fn purge(State(ops): State<Arc<Ops>>, Query(p): Query<Params>) -> Response {
    act(&ops, &p, "purged").await
}

async fn act(ops: &Ops, p: &Params, what: &str) -> Response {
    let Some(target) = target(p) else {
        return error(
            StatusCode::BAD_REQUEST,
            "give one of id=N, queue=NAME or exchange=NAME (with vhost=V, default \"/\")",
        );
    };
    let Some(retry) = ops.retry() else {
        return not_held(&target, what);
    };
    let done = match what {
        "fired" => retry.fire(target.clone()).await,
        _ => retry.purge(target.clone()).await,
    };
    match done {
        Ok(0) => not_held(&target, what),
        Ok(n) => count(what, n),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e),
    }
}

/// Replaces a missing replica stream by a new one written from what the
/// local store holds; answers once it is written and nackd intercepts
/// again: `{"reseeded": n, "stream": name}`. Refused (409) while the stream
/// exists or the lease is not held.
pub(super) async fn reseed(State(ops): State<Arc<Ops>>) -> Response {
    let Some(retry) = ops.retry() else {
        return error(StatusCode::CONFLICT, "nackd intercepts nothing: no replica");
    };
    match retry.reseed().await {
        Ok(done) => Json(json!({ "reseeded": done.seeded, "stream": done.stream })).into_response(),
        Err(e) => error(StatusCode::CONFLICT, e),
    }
}

/// Dead-letter replay (`crate::replay`): parameters in the query or as a
/// JSON body; answers the report (counts per destination, moved, skipped,
/// no destination), with `error` and status 503 when it stopped early.
pub(super) async fn replay(
    State(ops): State<Arc<Ops>>,
    uri: axum::http::Uri,
    body: axum::body::Bytes,
) -> Response {
    let request = if body.is_empty() {
        Query::<crate::replay::Request>::try_from_uri(&uri)
            .map(|q| q.0)
            .map_err(|e| e.body_text())
    } else {
        serde_json::from_slice(&body).map_err(|e| e.to_string())
    };
    let request = match request {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    if ops.replayer.get().is_none() {
        return error(
            StatusCode::CONFLICT,
            "nackd holds nothing (no policy, or its store is not recovered yet)",
        );
    }
    // A task of its own: a client that goes away must not drop the replay
    // half way (its connection closed with parks in flight puts stored
    // messages back on the dead-letter queue too).
    let run = tokio::spawn(async move {
        let replayer = ops.replayer.get().expect("checked above");
        replayer.run(request).await
    });
    let result = match run.await {
        Ok(result) => result,
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e),
    };
    use crate::replay::ReplayError as E;
    match result {
        Ok(report) if report.error.is_some() => {
            (StatusCode::SERVICE_UNAVAILABLE, Json(report)).into_response()
        }
        Ok(report) => Json(report).into_response(),
        Err(e) => {
            let code = match e {
                E::Invalid(_) => StatusCode::BAD_REQUEST,
                E::Busy => StatusCode::CONFLICT,
                E::NoQueue(..) => StatusCode::NOT_FOUND,
                E::NotReady(_) | E::Broker(_) => StatusCode::SERVICE_UNAVAILABLE,
            };
            error(code, e)
        }
    }
}

/// Nothing matched: an unknown id is a 404, an empty queue is `0`.
fn not_held(target: &Target, what: &str) -> Response {
    match target {
        Target::Id(id) => error(
            StatusCode::NOT_FOUND,
            format!("no held message with id {id} (or it is being published)"),
        ),
        Target::Queue { .. } | Target::Exchange { .. } => count(what, 0),
    }
}

/// `{"fired": n}` or `{"purged": n}`.
fn count(what: &str, n: usize) -> Response {
    let mut body = serde_json::Map::new();
    body.insert(what.to_string(), json!(n));
    Json(Value::Object(body)).into_response()
}

fn listed_json(l: &Listed, held: Option<&Held>) -> Value {
    let mut v = serde_json::to_value(l).unwrap_or(Value::Null);
    let due = crate::store::inspect::when(l.due_ms);
    v["due"] = Value::String(due);
    v["headers"] = held.map_or(Value::Null, headers_json);
    v
}

/// The message's AMQP headers as plain JSON values.
fn headers_json(held: &Held) -> Value {
    let Ok(header) = nackd_core::protocol::content::decode_header(&held.header) else {
        return Value::Null;
    };
    match header.properties.headers() {
        Some(table) => Value::Object(
            table
                .inner()
                .iter()
                .map(|(k, v)| (k.to_string(), amqp_json(v)))
                .collect(),
        ),
        None => Value::Object(Default::default()),
    }
}

fn amqp_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => json!(b),
        AMQPValue::ShortShortInt(n) => json!(n),
        AMQPValue::ShortShortUInt(n) => json!(n),
        AMQPValue::ShortInt(n) => json!(n),
        AMQPValue::ShortUInt(n) => json!(n),
        AMQPValue::LongInt(n) => json!(n),
        AMQPValue::LongUInt(n) => json!(n),
        AMQPValue::LongLongInt(n) => json!(n),
        AMQPValue::Timestamp(n) => json!(n),
        AMQPValue::Float(f) => json!(f),
        AMQPValue::Double(f) => json!(f),
        AMQPValue::DecimalValue(d) => json!(f64::from(d.value) / 10f64.powi(i32::from(d.scale))),
        AMQPValue::ShortString(s) => json!(s.as_str()),
        AMQPValue::LongString(s) => json!(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ByteArray(b) => json!(String::from_utf8_lossy(b.as_slice())),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(amqp_json).collect()),
        AMQPValue::FieldTable(t) => Value::Object(
            t.inner()
                .iter()
                .map(|(k, v)| (k.to_string(), amqp_json(v)))
                .collect(),
        ),
        AMQPValue::Void => Value::Null,
    }
}

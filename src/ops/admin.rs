//! The admin API: list held messages, fire them now, purge them. Every call
//! carries `Authorization: Bearer <token>`: the admin token
//! (`metrics.admin_token`) may call every route, the read token
//! (`metrics.read_token`) only those that change nothing ([`Access`]).
//! Without either configured the API does not exist (404).
//!
//! ```text
//! GET  /api/policies                       the policies in force (after the last reload)
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
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, MethodRouter};
use axum::{Json, Router};
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

/// Which token an admin route takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Changes nothing: the read token or the admin token.
    Read,
    /// Changes state (held messages, the replica stream, a dead-letter
    /// queue): the admin token only; the read token gets 403.
    Change,
}

/// The admin API's routes. The router is built from [`AdminRoute::ALL`],
/// so each route served has its [`Access`] decided here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdminRoute {
    /// `GET /api/policies`: the policies in force.
    Policies,
    /// `GET /api/held`: list held messages.
    Held,
    /// `POST /api/fire`: publish held messages now.
    Fire,
    /// `POST /api/purge`: forget held messages.
    Purge,
    /// `POST /api/replica/reseed`: write a new replica stream.
    Reseed,
    /// `POST /api/replay`: dead-letter replay. A dry run too: it moves
    /// nothing, but it takes each message off the dead-letter queue and
    /// puts it back, which the broker sees (a redelivery, counted toward a
    /// quorum queue's delivery limit, or a new place in the queue's order).
    Replay,
}

impl AdminRoute {
    /// Every route the admin API serves.
    pub const ALL: [AdminRoute; 6] = [
        AdminRoute::Policies,
        AdminRoute::Held,
        AdminRoute::Fire,
        AdminRoute::Purge,
        AdminRoute::Reseed,
        AdminRoute::Replay,
    ];

    /// Its path.
    pub fn path(self) -> &'static str {
        match self {
            AdminRoute::Policies => "/api/policies",
            AdminRoute::Held => "/api/held",
            AdminRoute::Fire => "/api/fire",
            AdminRoute::Purge => "/api/purge",
            AdminRoute::Reseed => "/api/replica/reseed",
            AdminRoute::Replay => "/api/replay",
        }
    }

    /// Its HTTP method.
    pub fn method(self) -> &'static str {
        match self {
            AdminRoute::Policies | AdminRoute::Held => "GET",
            AdminRoute::Fire | AdminRoute::Purge | AdminRoute::Reseed | AdminRoute::Replay => {
                "POST"
            }
        }
    }

    /// Which token it takes.
    pub fn access(self) -> Access {
        match self {
            AdminRoute::Policies | AdminRoute::Held => Access::Read,
            AdminRoute::Fire | AdminRoute::Purge | AdminRoute::Reseed | AdminRoute::Replay => {
                Access::Change
            }
        }
    }

    fn handler(self) -> MethodRouter<Arc<Ops>> {
        match self {
            AdminRoute::Policies => get(super::policies::list),
            AdminRoute::Held => get(list),
            AdminRoute::Fire => post(fire),
            AdminRoute::Purge => post(purge),
            AdminRoute::Reseed => post(reseed),
            AdminRoute::Replay => post(replay),
        }
    }
}

/// The admin routes, each behind the token check its [`Access`] asks for.
pub(super) fn router(ops: &Arc<Ops>) -> Router<Arc<Ops>> {
    AdminRoute::ALL
        .into_iter()
        .fold(Router::new(), |api, route| {
            let check = middleware::from_fn_with_state((ops.clone(), route.access()), authorize);
            api.route(route.path(), route.handler().route_layer(check))
        })
}

/// Whether `given` is `token`, in a time that depends on `given`'s length
/// only: no early stop at the first difference or at a length mismatch.
fn same(given: &[u8], token: &[u8]) -> bool {
    let diff = given
        .iter()
        .enumerate()
        .fold(given.len() ^ token.len(), |acc, (i, g)| {
            let t = token.get(i).copied().unwrap_or(!g);
            acc | usize::from(g ^ t)
        });
    diff == 0
}

/// Checks the bearer token of an admin call: 401 without a known token,
/// 403 for the read token on a route that changes state.
async fn authorize(
    State((ops, access)): State<(Arc<Ops>, Access)>,
    request: Request,
    next: Next,
) -> Response {
    if ops.admin_token.is_none() && ops.read_token.is_none() {
        return error(
            StatusCode::NOT_FOUND,
            "the admin API is off: set metrics.admin_token (or metrics.read_token)",
        );
    }
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|g| g.trim().as_bytes());
    // Both compared, whichever matches: the time taken says nothing of which.
    let matches = |token: &Option<String>| {
        given.is_some_and(|g| token.as_ref().is_some_and(|t| same(g, t.as_bytes())))
    };
    let (admin, read) = (matches(&ops.admin_token), matches(&ops.read_token));
    if admin || (read && access == Access::Read) {
        return next.run(request).await;
    }
    if read {
        return error(
            StatusCode::FORBIDDEN,
            "the read token cannot change state: this call needs the admin token",
        );
    }
    let mut response = error(StatusCode::UNAUTHORIZED, "missing or wrong token");
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    response
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

async fn list(State(ops): State<Arc<Ops>>, Query(p): Query<Params>) -> Response {
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

async fn fire(State(ops): State<Arc<Ops>>, Query(p): Query<Params>) -> Response {
    act(&ops, &p, "fired").await
}

async fn purge(State(ops): State<Arc<Ops>>, Query(p): Query<Params>) -> Response {
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
async fn reseed(State(ops): State<Arc<Ops>>) -> Response {
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
async fn replay(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_is_equality() {
        let token = b"0123456789abcdef";
        assert!(same(token, token));
        for given in [
            &b""[..],
            b"0123456789abcde",
            b"0123456789abcdeF",
            b"0123456789abcdef0",
            b"1123456789abcdef",
        ] {
            assert!(!same(given, token), "{given:?}");
        }
        assert!(!same(b"", b"x"));
        assert!(same(b"", b""));
    }
}

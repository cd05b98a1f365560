//! The policies in force, as the admin API (`GET /api/policies`) and the
//! status page show them: what a SIGHUP reload put in force, not what the
//! file says now.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::Ops;
use nackd_core::policy::{Jitter, OnExhausted, Policy, RequeueMode, Schedule};

/// `GET /api/policies`: `{"policies": [...]}`, first match first.
pub(super) async fn list(State(ops): State<Arc<Ops>>) -> Json<Value> {
    Json(json!({ "policies": in_force(&ops) }))
}

/// Each policy in force (none when nackd intercepts nothing).
pub(super) fn in_force(ops: &Ops) -> Vec<Value> {
    match &ops.policies {
        Some(live) => live.now().iter().map(policy).collect(),
        None => Vec::new(),
    }
}

fn duration(d: &std::time::Duration) -> String {
    humantime::format_duration(*d).to_string()
}

/// One policy, with the keys of its `[[policy]]` table.
fn policy(p: &Policy) -> Value {
    let schedule = match p.schedule() {
        Schedule::Explicit(delays) => {
            json!({ "delays": delays.iter().map(duration).collect::<Vec<_>>() })
        }
        Schedule::Backoff(b, max_retries) => json!({
            "backoff": {
                "initial": duration(&b.initial),
                "multiplier": b.multiplier,
                "max": duration(&b.max),
                "jitter": match b.jitter {
                    Jitter::None => "none",
                    Jitter::Full => "full",
                    Jitter::Equal => "equal",
                },
            },
            "max_retries": max_retries,
        }),
    };
    let on_exhausted = match &p.on_exhausted {
        OnExhausted::Reject => json!("reject"),
        OnExhausted::DeadLetter {
            exchange,
            routing_key,
        } => json!({ "exchange": exchange, "routing_key": routing_key }),
    };
    json!({
        "vhost": p.vhost,
        "queues": p.queues().collect::<Vec<_>>(),
        "schedule": schedule,
        "requeue": match p.requeue {
            RequeueMode::Delay => "delay",
            RequeueMode::Pass => "pass",
        },
        "on_exhausted": on_exhausted,
    })
}

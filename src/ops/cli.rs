//! `nackd admin list|fire|purge`: the admin API from the command line,
//! printed as lines an operator reads (or greps).

use std::fmt::Write as _;

use serde_json::Value;

use super::client::{self, ClientError};
use crate::retry::Target;

/// What to ask the running nackd.
#[derive(Clone, Debug)]
pub enum Action {
    /// List held messages (of a queue, of a vhost), soonest due first.
    List {
        /// Only this queue.
        queue: Option<String>,
        /// Only this vhost.
        vhost: Option<String>,
        /// At most this many.
        limit: usize,
    },
    /// Publish now.
    Fire(Target),
    /// Forget.
    Purge(Target),
}

/// Why an admin command failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// nackd cannot be reached.
    #[error("{0}")]
    Client(#[from] ClientError),
    /// nackd answered with an error.
    #[error("HTTP {status}: {message}")]
    Api {
        /// Status code.
        status: u16,
        /// The `error` field of the answer (or its body).
        message: String,
    },
}

fn target_query(target: &Target) -> String {
    match target {
        Target::Id(id) => client::query(&[("id", &id.to_string())]),
        Target::Queue { vhost, queue } => client::query(&[("queue", queue), ("vhost", vhost)]),
    }
}

/// Runs `action` against the operations listener at `address`.
pub async fn run(address: &str, token: &str, action: &Action) -> Result<String, AdminError> {
    let (method, target) = match action {
        Action::List {
            queue,
            vhost,
            limit,
        } => {
            let limit = limit.to_string();
            let mut pairs = vec![("limit", limit.as_str())];
            pairs.extend(queue.as_deref().map(|q| ("queue", q)));
            pairs.extend(vhost.as_deref().map(|v| ("vhost", v)));
            ("GET", format!("/api/held{}", client::query(&pairs)))
        }
        Action::Fire(t) => ("POST", format!("/api/fire{}", target_query(t))),
        Action::Purge(t) => ("POST", format!("/api/purge{}", target_query(t))),
    };
    let response = client::request(address, method, &target, Some(token)).await?;
    let body: Value = serde_json::from_str(&response.body).unwrap_or(Value::Null);
    if response.status != 200 {
        let message = body["error"]
            .as_str()
            .map_or(response.body.clone(), str::to_string);
        return Err(AdminError::Api {
            status: response.status,
            message,
        });
    }
    Ok(match action {
        Action::List { .. } => list_lines(&body),
        Action::Fire(_) => format!("fired {}\n", body["fired"]),
        Action::Purge(_) => format!("purged {}\n", body["purged"]),
    })
}

fn list_lines(body: &Value) -> String {
    let mut out = String::new();
    let held = body["held"].as_array().cloned().unwrap_or_default();
    for h in &held {
        let _ = writeln!(
            out,
            "id {} vhost {} queue {} due {} retry {} size {} attempts {}{} headers {}",
            h["id"],
            h["vhost"],
            h["queue"],
            h["due"].as_str().unwrap_or("?"),
            h["retry"],
            h["size"],
            h["attempts"],
            if h["publishing"] == Value::Bool(true) {
                " publishing"
            } else {
                ""
            },
            h["headers"]
        );
    }
    let _ = writeln!(out, "{} of {} held", held.len(), body["total"]);
    out
}

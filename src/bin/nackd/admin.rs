//! `nackd admin list|fire|purge|replay|replica reseed`: the admin API of a running
//! nackd from the command line, printed as lines an operator reads (or greps). Address and
//! token come from the config file unless `--address` / `--token-env` say.

use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use nackd::config::Config;
use nackd::retry::Target;
use serde_json::Value;
use ureq::{Agent, RequestBuilder};

// No doc comment here: clap would take it for the subcommand's help, which
// is the doc comment of `Command::Admin` in main.rs.
#[derive(Args, Debug)]
pub(crate) struct AdminArgs {
    /// host:port of its metrics listener (default: metrics.address of --config).
    #[arg(long)]
    address: Option<String>,
    /// Environment variable holding the token (default: from --config, the
    /// read token for `list` if there is one, else the admin token).
    #[arg(long)]
    token_env: Option<String>,
    #[command(subcommand)]
    action: AdminAction,
}

#[derive(Subcommand, Debug)]
enum AdminAction {
    /// Held messages, soonest due first.
    List {
        /// Only the retries of this queue.
        #[arg(long, conflicts_with = "exchange")]
        queue: Option<String>,
        /// Only the delayed publishes of this x-delayed-message exchange.
        #[arg(long)]
        exchange: Option<String>,
        /// Only this vhost.
        #[arg(long)]
        vhost: Option<String>,
        /// At most this many (the server caps it at 10000).
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Republish now: one message (--id), every retry of a queue, or every
    /// delayed publish of an exchange.
    Fire(Which),
    /// Forget held messages: one (--id), every retry of a queue, or every
    /// delayed publish of an exchange.
    Purge(Which),
    /// Move messages from a dead-letter queue back to the queue each came
    /// from (x-first-death-queue, else the first x-death entry, else nackd's
    /// own headers), or to --to. Run it with --dry-run first: it prints the
    /// counts per destination and moves nothing.
    ///
    /// Each message is parked in nackd's store (due at once, or spread over
    /// --spread) and acked on the dead-letter queue only once it is durable;
    /// messages left (filtered out, no destination) go back to their place.
    Replay(ReplayArgs),
    /// The replica stream of this instance.
    Replica {
        #[command(subcommand)]
        action: ReplicaAction,
    },
}

#[derive(Subcommand, Debug)]
enum ReplicaAction {
    /// Replace a missing replica stream (deleted by someone) by a new one
    /// written from what the local store holds; nackd intercepts again
    /// once it is written. Refused while the stream exists.
    Reseed,
}

#[derive(Args, Debug)]
struct ReplayArgs {
    /// The dead-letter queue to read.
    dlq: String,
    /// Virtual host of the dead-letter queue (and of the destinations).
    #[arg(long, default_value = "/")]
    vhost: String,
    /// Send every taken message to this queue instead of its origin.
    #[arg(long)]
    to: Option<String>,
    /// Only messages that came from this queue.
    #[arg(long)]
    queue: Option<String>,
    /// Only messages that died for this reason.
    #[arg(long, value_parser = ["rejected", "expired", "maxlen", "delivery_limit"])]
    reason: Option<String>,
    /// At most this many messages.
    #[arg(long)]
    limit: Option<u64>,
    /// Spread their due times evenly over this long (e.g. 10m) instead of
    /// all at once, so the consumer is not flooded.
    #[arg(long, value_parser = humantime::parse_duration)]
    spread: Option<Duration>,
    /// Whether x-retry-count starts again at 0 (true by default: a message
    /// on a dead-letter queue usually got there by exhausting its retries,
    /// and with its count kept, its first nack after the replay would find
    /// the schedule exhausted and dead-letter it again at once; false keeps
    /// the count, for messages that should get only the retries left).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    reset_count: bool,
    /// Count per destination only: nothing is moved (messages are requeued
    /// where they were).
    #[arg(long)]
    dry_run: bool,
}

impl ReplayArgs {
    fn query<B>(&self, mut request: RequestBuilder<B>) -> RequestBuilder<B> {
        request = request
            .query("dlq", &self.dlq)
            .query("vhost", &self.vhost)
            .query("reset_count", self.reset_count.to_string())
            .query("dry_run", self.dry_run.to_string());
        for (key, value) in [
            ("to", &self.to),
            ("queue", &self.queue),
            ("reason", &self.reason),
        ] {
            if let Some(value) = value {
                request = request.query(key, value);
            }
        }
        if let Some(limit) = self.limit {
            request = request.query("limit", limit.to_string());
        }
        if let Some(spread) = self.spread {
            request = request.query("spread", humantime::format_duration(spread).to_string());
        }
        request
    }
}

#[derive(Args, Debug)]
struct Which {
    /// Store id (from `list`).
    #[arg(long, conflicts_with_all = ["queue", "exchange"], required_unless_present_any = ["queue", "exchange"])]
    id: Option<u64>,
    /// Every retry held for this queue.
    #[arg(long, conflicts_with = "exchange")]
    queue: Option<String>,
    /// Every delayed publish held for this x-delayed-message exchange.
    #[arg(long)]
    exchange: Option<String>,
    /// Virtual host of --queue or --exchange.
    #[arg(long, default_value = "/")]
    vhost: String,
}

impl Which {
    fn target(&self) -> Target {
        match (self.id, &self.queue, &self.exchange) {
            (Some(id), _, _) => Target::Id(id),
            (None, None, Some(exchange)) => Target::Exchange {
                vhost: self.vhost.clone(),
                exchange: exchange.clone(),
            },
            (None, queue, _) => Target::Queue {
                vhost: self.vhost.clone(),
                queue: queue.clone().unwrap_or_default(),
            },
        }
    }
}

/// How long a whole call may take.
const TIMEOUT: Duration = Duration::from_secs(30);
/// How long a reseed may take: it writes every held message to the stream.
const RESEED_TIMEOUT: Duration = Duration::from_secs(3600);

/// Runs the command against the nackd that the file `config` describes.
pub(crate) fn run(config: &Path, args: &AdminArgs) -> ExitCode {
    let (address, token) = match address_and_token(config, args) {
        Ok(found) => found,
        Err((message, code)) => {
            eprintln!("{message}");
            return ExitCode::from(code);
        }
    };
    match call(&address, &token, &args.action) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(1)
        }
    }
}

/// `--address` and `--token-env`, else what the config file says; the
/// error comes with the exit code (2: a configuration problem).
fn address_and_token(config: &Path, args: &AdminArgs) -> Result<(String, String), (String, u8)> {
    let loaded = match (&args.address, &args.token_env) {
        (Some(_), Some(_)) => None,
        _ => match Config::load(config) {
            Ok(c) => Some(c),
            Err(e) => return Err((format!("invalid configuration: {e}"), 2)),
        },
    };
    let address = args.address.clone().unwrap_or_else(|| {
        loaded
            .as_ref()
            .map(|c| c.metrics.address.to_string())
            .unwrap_or_default()
    });
    let token = match (&args.token_env, &loaded) {
        (Some(var), _) => std::env::var(var).map_err(|_| format!("--token-env: {var} is not set")),
        // Listing changes nothing: the read token does (and is the
        // smaller one to hold), else the admin token.
        (None, Some(c)) if matches!(args.action, AdminAction::List { .. }) => c
            .metrics
            .read_token()
            .and_then(|read| match read {
                Some(t) => Ok(Some(t)),
                None => c.metrics.admin_token(),
            })
            .and_then(|t| {
                t.ok_or_else(|| {
                    "no token: set metrics.read_token or metrics.admin_token, or pass --token-env"
                        .into()
                })
            }),
        (None, Some(c)) => c.metrics.admin_token().and_then(|t| {
            t.ok_or_else(|| "no admin token: set metrics.admin_token or pass --token-env".into())
        }),
        (None, None) => Err("no admin token".into()),
    };
    token.map(|t| (address, t)).map_err(|e| (e, 2))
}

/// Why an admin command failed.
#[derive(Debug, thiserror::Error)]
enum AdminError {
    /// nackd cannot be reached, or did not answer in HTTP.
    #[error("{address}: {reason}")]
    Unreachable { address: String, reason: String },
    /// No answer in time.
    #[error("{0}: no answer in time")]
    Timeout(String),
    /// nackd answered with an error.
    #[error("HTTP {status}: {message}")]
    Api { status: u16, message: String },
}

impl AdminError {
    fn from_ureq(address: &str, e: ureq::Error) -> Self {
        let reason = match e {
            ureq::Error::Timeout(_) => return Self::Timeout(address.to_string()),
            // The OS's words alone ("Connection refused (os error 111)").
            ureq::Error::Io(e) => e.to_string(),
            e => e.to_string(),
        };
        Self::Unreachable {
            address: address.to_string(),
            reason,
        }
    }
}

/// Adds the query that names `target`.
fn with_target<B>(request: RequestBuilder<B>, target: &Target) -> RequestBuilder<B> {
    match target {
        Target::Id(id) => request.query("id", id.to_string()),
        Target::Queue { vhost, queue } => request.query("queue", queue).query("vhost", vhost),
        Target::Exchange { vhost, exchange } => {
            request.query("exchange", exchange).query("vhost", vhost)
        }
    }
}

/// Asks the operations listener at `address`; the answer as lines to print.
fn call(address: &str, token: &str, action: &AdminAction) -> Result<String, AdminError> {
    let (status, text) =
        send(address, token, action).map_err(|e| AdminError::from_ureq(address, e))?;
    let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    if let AdminAction::Replay(_) = action {
        if body.get("examined").is_some() {
            let lines = replay_lines(&body);
            return match body["error"].as_str() {
                None => Ok(lines),
                Some(e) => Err(AdminError::Api {
                    status,
                    message: format!("{e}\n{lines}"),
                }),
            };
        }
    }
    if status != 200 {
        let message = body["error"].as_str().map_or(text.clone(), str::to_string);
        return Err(AdminError::Api { status, message });
    }
    Ok(match action {
        AdminAction::List { .. } => list_lines(&body),
        AdminAction::Fire(_) => format!("fired {}\n", body["fired"]),
        AdminAction::Replay(_) => replay_lines(&body),
        AdminAction::Purge(_) => format!("purged {}\n", body["purged"]),
        AdminAction::Replica { .. } => format!(
            "reseeded {} held messages into {}\n",
            body["reseeded"],
            body["stream"].as_str().unwrap_or("?")
        ),
    })
}

/// One HTTP call: status and body.
fn send(address: &str, token: &str, action: &AdminAction) -> Result<(u16, String), ureq::Error> {
    // Straight to nackd: no proxy from the environment, and an error
    // status is an answer to read, not a transport error.
    let timeout = match action {
        AdminAction::Replica { .. } | AdminAction::Replay(_) => RESEED_TIMEOUT,
        _ => TIMEOUT,
    };
    let agent: Agent = Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into();
    let url = |path: &str| format!("http://{address}{path}");
    let bearer = format!("Bearer {token}");
    let mut response = match action {
        AdminAction::List {
            queue,
            exchange,
            vhost,
            limit,
        } => {
            let mut request = agent
                .get(url("/api/held"))
                .query("limit", limit.to_string());
            if let Some(queue) = queue {
                request = request.query("queue", queue);
            }
            if let Some(exchange) = exchange {
                request = request.query("exchange", exchange);
            }
            if let Some(vhost) = vhost {
                request = request.query("vhost", vhost);
            }
            request.header("Authorization", &bearer).call()?
        }
        AdminAction::Fire(which) => with_target(agent.post(url("/api/fire")), &which.target())
            .header("Authorization", &bearer)
            .send_empty()?,
        AdminAction::Purge(which) => with_target(agent.post(url("/api/purge")), &which.target())
            .header("Authorization", &bearer)
            .send_empty()?,
        AdminAction::Replay(replay) => replay
            .query(agent.post(url("/api/replay")))
            .header("Authorization", &bearer)
            .send_empty()?,
        AdminAction::Replica {
            action: ReplicaAction::Reseed,
        } => agent
            .post(url("/api/replica/reseed"))
            .header("Authorization", &bearer)
            .send_empty()?,
    };
    // Read to the end, as text: `list --limit 10000` may be large.
    let text = (response.body_mut().with_config())
        .limit(u64::MAX)
        .lossy_utf8(true)
        .read_to_string()?;
    Ok((response.status().as_u16(), text))
}

/// One line per destination, then the totals: `<queue> <n>` lines an
/// operator reads and a script greps.
fn replay_lines(body: &Value) -> String {
    let mut out = String::new();
    let dry = body["dry_run"] == Value::Bool(true);
    let verb = if dry { "would move" } else { "moved" };
    if let Some(destinations) = body["destinations"].as_object() {
        for (queue, n) in destinations {
            let _ = writeln!(out, "{verb} {n} to {queue}");
        }
    }
    if let Some(missing) = body["missing_destinations"].as_object() {
        for (queue, n) in missing {
            let _ = writeln!(out, "left {n}: queue {queue} does not exist");
        }
    }
    if let Some(n) = body["set_aside"].as_u64().filter(|n| *n > 0) {
        let _ = writeln!(
            out,
            "left {n}: properties fail nackd's limits (see nackd_screen_folded_total)"
        );
    }
    let _ = writeln!(
        out,
        "examined {}, {verb} {}, skipped {}, no destination {}{}",
        body["examined"],
        if dry {
            body["destinations"]
                .as_object()
                .map_or(0, |d| d.values().filter_map(Value::as_u64).sum())
        } else {
            body["moved"].as_u64().unwrap_or(0)
        },
        body["skipped"],
        body["no_destination"],
        if dry { " (dry run: nothing moved)" } else { "" }
    );
    out
}

/// One line per held message, then the count.
fn list_lines(body: &Value) -> String {
    let mut out = String::new();
    let held = body["held"].as_array().cloned().unwrap_or_default();
    for h in &held {
        let _ = writeln!(
            out,
            "id {} vhost {} {} {} due {} retry {} size {} attempts {}{}{} headers {}",
            h["id"],
            h["vhost"],
            if h["delayed"] == Value::Bool(true) {
                "delayed-exchange"
            } else {
                "queue"
            },
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
            h["blocked"]
                .as_str()
                .map_or(String::new(), |b| format!(" blocked: {b}")),
            h["headers"]
        );
    }
    let _ = writeln!(out, "{} of {} held", held.len(), body["total"]);
    out
}

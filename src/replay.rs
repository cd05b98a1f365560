//! Dead-letter replay: moves messages from a dead-letter queue back to the
//! queue each came from (or to one queue named by the operator), through
//! nackd's own scheduler.
//!
//! A replay reads the dead-letter queue with `basic.get` over a connection
//! of its own (lapin, as the replica's), at most as many messages as the
//! queue held when it began, so that messages it leaves there are not met
//! again. Each message it takes is *parked* like a claimed nack
//! ([`Park`] with [`Route::Queue`]: due at once, or spread over
//! `--spread`), and acked on the dead-letter queue only once the engine
//! answered that it is durable; a refused park ends the replay. Messages
//! it leaves (filtered out, no destination, a dry run, a refused park) are
//! put back at the tail of the dead-letter queue, published again exactly
//! as read and acked once the broker confirmed the copy: never
//! `nack(requeue)`, which RabbitMQ 4.0–4.2 count toward a quorum queue's
//! delivery-limit (`rotate`). A message whose destination queue does not
//! exist is left too (counted per queue): nackd would hold it until the
//! queue came back. So is a message whose properties fail nackd's limits
//! (`set_aside`): the screen in front of lapin folded them
//! (`crate::screen`), and puts them back byte for byte when the copy is
//! published.
//!
//! A crash between the park and the ack leaves the message both held and
//! back on the dead-letter queue: a second replay moves it again (one
//! duplicate, never a loss).
//!
//! - `pass`: one pass over the dead-letter queue (get, park, ack, put back).
//! - `rotate`: what a pass leaves, published again to the queue's tail.
//! - `select`: origin, filters, spread and parked header, without a network.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tracing::info;

use crate::replica::Target;
use crate::retry::{Ready, RetryHandle};
use pass::Pass;
use rotate::Rotation;

mod pass;
mod rotate;
pub mod select;

pub use select::{Filter, Origin, Verdict};

/// Parks a replay waits for at once (each holds one message in RAM).
const WINDOW: usize = 256;
/// How long the broker may take to answer the connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What an operator asks for (the admin API's parameters).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Request {
    /// The dead-letter queue to read.
    pub dlq: String,
    /// Its virtual host (default `/`).
    #[serde(default)]
    pub vhost: Option<String>,
    /// Every taken message goes to this queue instead of its origin.
    #[serde(default)]
    pub to: Option<String>,
    /// Only messages from this queue.
    #[serde(default)]
    pub queue: Option<String>,
    /// Only messages that died for this reason.
    #[serde(default)]
    pub reason: Option<String>,
    /// At most this many moved (or counted, in a dry run).
    #[serde(default)]
    pub limit: Option<u64>,
    /// Spread the moved messages' due times over this long (`10m`).
    #[serde(default, with = "humantime_serde")]
    pub spread: Option<Duration>,
    /// Whether nackd's retry count starts again at 0 (default: yes).
    #[serde(default)]
    pub reset_count: Option<bool>,
    /// Count only: nothing is moved.
    #[serde(default)]
    pub dry_run: bool,
}

/// What a replay did (or, in a dry run, would do).
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Report {
    /// Nothing was moved.
    pub dry_run: bool,
    /// Messages read from the dead-letter queue.
    pub examined: u64,
    /// Messages parked and acked on the dead-letter queue (0 in a dry run).
    pub moved: u64,
    /// Left there: the filters did not take them.
    pub skipped: u64,
    /// Left there: nothing says where they go.
    pub no_destination: u64,
    /// Left there: its properties fail nackd's limits (folded by the
    /// screen, `src/screen.rs`), so nothing in them can be read.
    pub set_aside: u64,
    /// Moved (or, in a dry run, to be moved) per destination queue.
    pub destinations: BTreeMap<String, u64>,
    /// Left there: the queue they go to does not exist (per queue). nackd
    /// would hold them until it does; the operator decides instead.
    pub missing_destinations: BTreeMap<String, u64>,
    /// Left unacked: it carries another user's `user_id`, which the
    /// republish user may not publish without the `impersonator` tag (the
    /// broker takes it back when the pass ends).
    pub foreign_user_id: u64,
    /// Why the replay stopped early, if it did (what is counted was done).
    pub error: Option<String>,
}

/// Why a replay cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// A parameter is wrong.
    #[error("{0}")]
    Invalid(String),
    /// Another replay is running.
    #[error("another replay is running")]
    Busy,
    /// The engine does not take parks now.
    #[error("nackd does not hold messages now (store: {0})")]
    NotReady(String),
    /// The dead-letter queue does not exist.
    #[error("queue {0:?} does not exist in vhost {1:?}")]
    NoQueue(String, String),
    /// The broker or the connection failed before anything was read.
    #[error("broker: {0}")]
    Broker(String),
}

/// Runs replays for the admin API: the broker login of nackd's own
/// connections and the engine the messages are parked with.
pub struct Replayer {
    target: Target,
    retry: RetryHandle,
    running: tokio::sync::Mutex<()>,
    runs: AtomicU64,
}

impl Replayer {
    /// A replayer logging in as `[republish]` to `[upstream]`'s nodes.
    pub fn new(config: &crate::config::Config, retry: RetryHandle) -> Result<Self, String> {
        // Worded as startup words it (`StartError::Tls`).
        let tls =
            crate::net::upstream_tls(&config.upstream).map_err(|e| format!("upstream.tls: {e}"))?;
        let target = Target {
            nodes: config.upstream.nodes(),
            vhost: "/".into(),
            username: config.republish.username(),
            password: config.republish.password()?,
            heartbeat: config.republish.heartbeat,
            cluster_size: None,
            tls,
        };
        Ok(Self {
            target,
            retry,
            running: tokio::sync::Mutex::new(()),
            runs: AtomicU64::new(1),
        })
    }

    /// Runs one replay to its end; one at a time.
    pub async fn run(&self, request: Request) -> Result<Report, ReplayError> {
        let check = check(&request)?;
        let _one = self.running.try_lock().map_err(|_| ReplayError::Busy)?;
        if !request.dry_run {
            match self.retry.ready.get() {
                // A store that does not answer would hold every park of
                // the pass (and the messages it read) until it does.
                Ready::Ready if self.retry.ready.stalled() => {
                    return Err(ReplayError::NotReady("the store is not answering".into()));
                }
                Ready::Ready => {}
                other => return Err(ReplayError::NotReady(format!("{other:?}"))),
            }
        }
        let vhost = request.vhost.clone().unwrap_or_else(|| "/".into());
        let conn = self.connect(&vhost).await?;
        let run = self.runs.fetch_add(1, Ordering::Relaxed);
        let result = async {
            let ch = conn.create_channel().await.map_err(broker)?;
            let count = queue_count(&ch, &request.dlq, &vhost).await?;
            let (reply, answers) = mpsc::unbounded_channel();
            let mut pass = Pass {
                request: &request,
                filter: check,
                vhost: vhost.as_str().into(),
                ch: &ch,
                conn: &conn,
                exists: HashMap::new(),
                retry: &self.retry,
                run,
                reply,
                answers,
                in_flight: HashMap::new(),
                rotation: Rotation::new(&self.target.username),
                planned: request.limit.map_or(count, |l| l.min(count)),
                parks: 0,
                report: Report {
                    dry_run: request.dry_run,
                    ..Report::default()
                },
            };
            pass.run(count).await;
            Ok(pass.report)
        }
        .await;
        let _ = conn.close(200, "nackd: replay done".into()).await;
        if let Ok(report) = &result {
            info!(
                dlq = request.dlq,
                vhost,
                dry_run = report.dry_run,
                examined = report.examined,
                moved = report.moved,
                skipped = report.skipped,
                no_destination = report.no_destination,
                set_aside = report.set_aside,
                error = report.error.as_deref(),
                "dead-letter replay"
            );
        }
        result
    }

    /// Connects to the first node that answers, into `vhost`.
    async fn connect(&self, vhost: &str) -> Result<Connection, ReplayError> {
        let target = Target {
            vhost: vhost.to_string(),
            ..self.target.clone()
        };
        let mut errors = Vec::new();
        for node in &target.nodes {
            let name = "nackd dead-letter replay";
            match target.connect(node, name, "replay", CONNECT_TIMEOUT).await {
                Ok(conn) => return Ok(conn),
                Err(e) => errors.push(e),
            }
        }
        Err(ReplayError::Broker(errors.join("; ")))
    }
}

/// The request's filter, once its parameters are checked.
fn check(request: &Request) -> Result<Filter, ReplayError> {
    let invalid = |s: String| Err(ReplayError::Invalid(s));
    if request.dlq.is_empty() {
        return invalid("name the dead-letter queue (dlq)".into());
    }
    if let Some(reason) = &request.reason {
        if !select::REASONS.contains(&reason.as_str()) {
            return invalid(format!(
                "reason {reason:?}: one of {}",
                select::REASONS.join(", ")
            ));
        }
    }
    if request.to.as_deref() == Some(request.dlq.as_str()) {
        return invalid("the destination is the dead-letter queue itself".into());
    }
    if request.to.as_deref() == Some("") || request.queue.as_deref() == Some("") {
        return invalid("an empty queue name".into());
    }
    Ok(Filter {
        to: request.to.clone(),
        queue: request.queue.clone(),
        reason: request.reason.clone(),
    })
}

/// The AMQP reply code of a channel or connection error, if it is one.
fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

fn broker(e: lapin::Error) -> ReplayError {
    ReplayError::Broker(e.to_string())
}

/// Messages in the dead-letter queue now (a passive declare).
async fn queue_count(ch: &Channel, dlq: &str, vhost: &str) -> Result<u64, ReplayError> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match ch
        .queue_declare(dlq.into(), passive, FieldTable::default())
        .await
    {
        Ok(q) => Ok(u64::from(q.message_count())),
        Err(e) if reply_code(&e) == Some(404) => {
            Err(ReplayError::NoQueue(dlq.into(), vhost.into()))
        }
        Err(e) => Err(broker(e)),
    }
}

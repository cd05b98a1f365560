//! What operators ask of the held messages (list, fire now, purge,
//! status), and the figures the engine answers with. Computed inside the
//! engine task from the ledger, so an answer sees exactly what is held;
//! [`crate::retry::RetryHandle`] asks (`admin.rs`).

use serde::Serialize;
use tokio::sync::oneshot;

use crate::retry::ledger::Ledger;
use crate::store::{Loc, Reader};

/// Which held messages a command is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// One message, by store id.
    Id(u64),
    /// Every message held for a queue (retries and dead letters, not
    /// delayed publishes).
    Queue {
        /// Virtual host.
        vhost: String,
        /// Queue.
        queue: String,
    },
    /// Every delayed publish held for an `x-delayed-message` exchange.
    Exchange {
        /// Virtual host.
        vhost: String,
        /// Exchange.
        exchange: String,
    },
}

/// Which kind of held message a listing shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Retries and dead letters (named by their queue).
    Retry,
    /// Delayed publishes (named by their exchange).
    Delayed,
}

/// A held message as the admin API lists it.
#[derive(Clone, Debug, Serialize)]
pub struct Listed {
    /// Store id (what `fire` and `purge` take).
    pub id: u64,
    /// Virtual host.
    pub vhost: String,
    /// Queue it goes back to.
    pub queue: String,
    /// When it is due, in ms since the Unix epoch.
    pub due_ms: u64,
    /// Retry number in its headers.
    pub retry: u32,
    /// Header + body bytes.
    pub size: u32,
    /// Failed publish attempts so far.
    pub attempts: u16,
    /// Handed to the republisher, waiting for the broker's confirm.
    pub publishing: bool,
    /// Goes to its `on_exhausted` exchange, not back to the queue.
    pub dead_letter: bool,
    /// A delayed publish: `queue` names the exchange it goes to.
    pub delayed: bool,
    /// Why its last republish was set aside (the broker's reply), if it was.
    pub blocked: Option<String>,
    #[serde(skip)]
    loc: Loc,
}

/// Held messages of one queue.
#[derive(Clone, Debug, Serialize)]
pub struct QueueStatus {
    /// Virtual host.
    pub vhost: String,
    /// Queue.
    pub queue: String,
    /// Messages held.
    pub held: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Of those, set aside (their last republish failed).
    pub blocked: u64,
    /// Of those, delayed publishes: `queue` is then also (or only) the
    /// name of an `x-delayed-message` exchange.
    pub delayed: u64,
    /// Since when the queue is gone (ms since the Unix epoch), if it is.
    pub gone_since_ms: Option<u64>,
}

/// Held messages set aside for one reason.
#[derive(Clone, Debug, Serialize)]
pub struct BlockedStatus {
    /// The kind (`no_exchange`, `queue_gone`, ...), as in the metrics.
    pub reason: &'static str,
    /// The broker's reply, or nackd's words.
    pub reply: String,
    /// Messages set aside for it now.
    pub count: u64,
}

/// An exchange that refuses every publish, probed one message at a time.
#[derive(Clone, Debug, Serialize)]
pub struct ExchangeStatus {
    /// Virtual host.
    pub vhost: String,
    /// Exchange.
    pub exchange: String,
    /// The broker's reply.
    pub reply: String,
    /// Refusing since (ms since the Unix epoch).
    pub since_ms: u64,
    /// Next probe (ms since the Unix epoch).
    pub next_try_ms: u64,
}

/// How many held messages fall due in one interval from now.
#[derive(Clone, Debug, Serialize)]
pub struct DueBucket {
    /// Short label (`now`, `10s`, `5m`, `later`).
    pub label: &'static str,
    /// Upper end of the interval in seconds from now (`None`: no end).
    pub within_s: Option<u64>,
    /// Messages due in it.
    pub count: u64,
}

/// What the status page shows of the engine.
#[derive(Clone, Debug, Serialize)]
pub struct Status {
    /// The engine's clock, ms since the Unix epoch.
    pub now_ms: u64,
    /// Messages held.
    pub held: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Per queue, largest first.
    pub queues: Vec<QueueStatus>,
    /// Due times, bucketed.
    pub due: Vec<DueBucket>,
    /// Always `false`: the chart is kept exactly (to the minute for
    /// messages parked more than an hour ahead). Kept for old pages.
    pub sampled: bool,
    /// Set-aside messages by reason, most first.
    pub blocked: Vec<BlockedStatus>,
    /// Exchanges refusing publishes.
    pub blocked_exchanges: Vec<ExchangeStatus>,
    /// Bytes of due messages read from the store and not yet settled.
    pub pending_bytes: u64,
}

/// Upper ends of the due buckets, in seconds from now.
const DUE_EDGES: [(&str, u64); 12] = [
    ("now", 0),
    ("10s", 10),
    ("30s", 30),
    ("1m", 60),
    ("2m", 120),
    ("5m", 300),
    ("10m", 600),
    ("30m", 1800),
    ("1h", 3600),
    ("2h", 7200),
    ("6h", 21600),
    ("24h", 86400),
];

pub(in crate::retry) enum Command {
    List {
        vhost: Option<String>,
        named: Option<(String, Kind)>,
        limit: usize,
        reply: oneshot::Sender<(Vec<Listed>, usize, Reader)>,
    },
    Fire {
        target: Target,
        reply: oneshot::Sender<usize>,
    },
    Purge {
        target: Target,
        reply: oneshot::Sender<usize>,
    },
    Status {
        reply: oneshot::Sender<Status>,
    },
}

impl Listed {
    /// Where its record is, to read it back.
    pub(in crate::retry) fn loc(&self) -> Loc {
        self.loc
    }
}

/// Ids of the target's messages, in due order.
pub(super) fn matching(ledger: &Ledger, target: &Target) -> Vec<u64> {
    // A queue and a delayed exchange of one name share their interned
    // name: the kind tells them apart.
    let (vhost, name, delayed) = match target {
        Target::Id(id) => return ledger.get(*id).map(|_| vec![*id]).unwrap_or_default(),
        Target::Queue { vhost, queue } => (vhost, queue, false),
        Target::Exchange { vhost, exchange } => (vhost, exchange, true),
    };
    let Some(queue) = ledger.find(vhost, name) else {
        return Vec::new();
    };
    let mut ids: Vec<(u64, u64)> = ledger
        .iter()
        .filter(|(_, e)| e.meta.queue == queue && e.meta.delayed == delayed)
        .map(|(id, e)| (e.due_ms, id))
        .collect();
    ids.sort_unstable();
    ids.into_iter().map(|(_, id)| id).collect()
}

/// Held messages (of `vhost`, of a name of a kind), soonest due first, at
/// most `limit`; and how many matched in all.
pub(super) fn list(
    ledger: &Ledger,
    vhost: Option<&str>,
    named: Option<(&str, Kind)>,
    limit: usize,
) -> (Vec<Listed>, usize) {
    let mut found: Vec<(u64, u64)> = ledger
        .iter()
        .filter(|(_, e)| {
            let (v, q) = ledger.name(e.meta.queue);
            vhost.is_none_or(|want| &**v == want)
                && named.is_none_or(|(want, kind)| {
                    &**q == want && e.meta.delayed == (kind == Kind::Delayed)
                })
        })
        .map(|(id, e)| (e.due_ms, id))
        .collect();
    let total = found.len();
    found.sort_unstable();
    found.truncate(limit);
    let listed = found
        .into_iter()
        .filter_map(|(_, id)| listed(ledger, id))
        .collect();
    (listed, total)
}

fn listed(ledger: &Ledger, id: u64) -> Option<Listed> {
    let e = ledger.get(id)?;
    let (vhost, queue) = ledger.name(e.meta.queue);
    Some(Listed {
        id,
        vhost: vhost.to_string(),
        queue: queue.to_string(),
        due_ms: e.due_ms,
        retry: e.meta.retry.into(),
        size: e.meta.size,
        attempts: e.attempts,
        publishing: e.inflight,
        dead_letter: e.meta.dead_letter && !e.meta.delayed,
        delayed: e.meta.delayed,
        blocked: ledger.reason(e.blocked()).map(|r| r.reply.clone()),
        loc: e.loc,
    })
}

/// The status page's figures, from aggregates the ledger and the blocks
/// keep up to date: the cost does not grow with what is held.
/// `gone_since`: since when a queue is gone; `exchanges`: those refusing
/// publishes; `pending_bytes`: read and not settled.
pub(super) fn status(
    ledger: &Ledger,
    now_ms: u64,
    gone_since: impl Fn(u32) -> Option<u64>,
    blocked_exchanges: Vec<ExchangeStatus>,
    pending_bytes: u64,
) -> Status {
    let queues = queue_statuses(ledger, gone_since);
    Status {
        now_ms,
        held: ledger.len() as u64,
        bytes: queues.iter().map(|q| q.bytes).sum(),
        queues,
        due: due_buckets(ledger, now_ms),
        sampled: false,
        blocked: blocked_statuses(ledger),
        blocked_exchanges,
        pending_bytes,
    }
}

/// Each queue's held messages and bytes, most held first.
fn queue_statuses(ledger: &Ledger, gone_since: impl Fn(u32) -> Option<u64>) -> Vec<QueueStatus> {
    let mut queues: Vec<QueueStatus> = ledger
        .totals()
        .map(|(q, vhost, queue, held, bytes)| QueueStatus {
            vhost: vhost.to_string(),
            queue: queue.to_string(),
            held,
            bytes,
            blocked: ledger.blocked_count(q),
            delayed: ledger.delayed_count(q),
            gone_since_ms: gone_since(q),
        })
        .collect();
    queues.sort_by(|a, b| b.held.cmp(&a.held).then_with(|| a.queue.cmp(&b.queue)));
    queues
}

/// How many held messages fall due within each of [`DUE_EDGES`], and
/// later.
fn due_buckets(ledger: &Ledger, now_ms: u64) -> Vec<DueBucket> {
    let edges: Vec<u64> = DUE_EDGES.iter().map(|(_, e)| *e).collect();
    let counts = ledger.due_chart(now_ms, &edges);
    let labels = DUE_EDGES
        .iter()
        .map(|(l, e)| (*l, Some(*e)))
        .chain([("later", None)]);
    labels
        .zip(counts)
        .map(|((label, within_s), count)| DueBucket {
            label,
            within_s,
            count,
        })
        .collect()
}

/// Held messages set aside, by reason and reply.
fn blocked_statuses(ledger: &Ledger) -> Vec<BlockedStatus> {
    ledger
        .blocked_reasons()
        .into_iter()
        .map(|(r, count)| BlockedStatus {
            reason: r.kind.label(),
            reply: r.reply.clone(),
            count,
        })
        .collect()
}

//! Operator commands on held messages: list, fire now, purge, and the
//! figures of the status page. They run inside the engine task, between two
//! parks, so they see exactly what the engine holds.

use serde::Serialize;
use tokio::sync::oneshot;

use super::engine::Engine;
use super::RetryHandle;
use crate::store::{Held, Loc, Reader};

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

/// The engine task is gone (nackd is stopping).
#[derive(Debug, thiserror::Error)]
#[error("the retry engine is not running")]
pub struct EngineGone;

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

pub(super) enum Command {
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

impl RetryHandle {
    async fn ask<T>(
        &self,
        command: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, EngineGone> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(super::Command::Admin(command(reply)))
            .map_err(|_| EngineGone)?;
        answer.await.map_err(|_| EngineGone)
    }

    /// Held messages (of `vhost`/`queue` when given), soonest due first, at
    /// most `limit`, each read back from the store (`None` if it left
    /// meanwhile); and how many matched in all.
    pub async fn list(
        &self,
        vhost: Option<String>,
        named: Option<(String, Kind)>,
        limit: usize,
    ) -> Result<(Vec<(Listed, Option<Held>)>, usize), EngineGone> {
        let (listed, total, reader) = self
            .ask(|reply| Command::List {
                vhost,
                named,
                limit,
                reply,
            })
            .await?;
        let read = move || {
            listed
                .into_iter()
                .map(|l| (reader.read(l.loc).ok(), l))
                .map(|(h, l)| (l, h))
                .collect()
        };
        let listed = tokio::task::spawn_blocking(read)
            .await
            .map_err(|_| EngineGone)?;
        Ok((listed, total))
    }

    /// Publishes the target's messages now; returns how many were due to go
    /// (a message already being published is not counted).
    pub async fn fire(&self, target: Target) -> Result<usize, EngineGone> {
        self.ask(|reply| Command::Fire { target, reply }).await
    }

    /// Forgets the target's messages (a delete record in the store).
    pub async fn purge(&self, target: Target) -> Result<usize, EngineGone> {
        self.ask(|reply| Command::Purge { target, reply }).await
    }

    /// Per-queue totals and the due chart.
    pub async fn status(&self) -> Result<Status, EngineGone> {
        self.ask(|reply| Command::Status { reply }).await
    }
}

impl Engine {
    pub(super) fn on_admin(&mut self, command: Command) {
        match command {
            Command::List {
                vhost,
                named,
                limit,
                reply,
            } => {
                let named = named.as_ref().map(|(n, k)| (n.as_str(), *k));
                let (listed, total) = self.list(vhost.as_deref(), named, limit);
                let _ = reply.send((listed, total, self.reader.clone()));
            }
            Command::Fire { target, reply } => {
                let _ = reply.send(self.fire_now(&target));
            }
            Command::Purge { target, reply } => {
                // A message being republished is not recalled: its confirm
                // completes it (docs/src/operations.md, "Admin API"), so a purge cannot race
                // with a delivery the consumer already has.
                let ids: Vec<u64> = self
                    .matching(&target)
                    .into_iter()
                    .filter(|id| self.ledger.get(*id).is_some_and(|e| !e.inflight))
                    .collect();
                ids.iter().for_each(|id| self.forget(*id));
                let _ = reply.send(ids.len());
            }
            Command::Status { reply } => {
                let _ = reply.send(self.status());
            }
        }
    }

    /// Ids of the target's messages, in due order.
    fn matching(&self, target: &Target) -> Vec<u64> {
        // A queue and a delayed exchange of one name share their interned
        // name: the kind tells them apart.
        let (vhost, name, delayed) = match target {
            Target::Id(id) => return self.ledger.get(*id).map(|_| vec![*id]).unwrap_or_default(),
            Target::Queue { vhost, queue } => (vhost, queue, false),
            Target::Exchange { vhost, exchange } => (vhost, exchange, true),
        };
        let Some(queue) = self.ledger.find(vhost, name) else {
            return Vec::new();
        };
        let mut ids: Vec<(u64, u64)> = self
            .ledger
            .iter()
            .filter(|(_, e)| e.meta.queue == queue && e.meta.delayed == delayed)
            .map(|(id, e)| (e.due_ms, id))
            .collect();
        ids.sort_unstable();
        ids.into_iter().map(|(_, id)| id).collect()
    }

    /// Moves the target's wheel entries to now; the old ones go stale.
    fn fire_now(&mut self, target: &Target) -> usize {
        let now = self.clock.now_ms();
        let mut fired = 0;
        for id in self.matching(target) {
            let Some(entry) = self.ledger.get_mut(id) else {
                continue;
            };
            if entry.inflight {
                continue;
            }
            entry.forced = true;
            self.schedule(id, now);
            fired += 1;
        }
        fired
    }

    fn list(
        &self,
        vhost: Option<&str>,
        named: Option<(&str, Kind)>,
        limit: usize,
    ) -> (Vec<Listed>, usize) {
        let mut found: Vec<(u64, u64)> = self
            .ledger
            .iter()
            .filter(|(_, e)| {
                let (v, q) = self.ledger.name(e.meta.queue);
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
            .filter_map(|(_, id)| {
                let e = self.ledger.get(id)?;
                let (vhost, queue) = self.ledger.name(e.meta.queue);
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
                    blocked: self.ledger.reason(e.blocked()).map(|r| r.reply.clone()),
                    loc: e.loc,
                })
            })
            .collect();
        (listed, total)
    }

    /// The status page's figures, from aggregates the ledger and the
    /// blocks keep up to date: the cost does not grow with what is held.
    fn status(&self) -> Status {
        let now_ms = self.clock.now_ms();
        let queues = self.queue_statuses();
        Status {
            now_ms,
            held: self.ledger.len() as u64,
            bytes: queues.iter().map(|q| q.bytes).sum(),
            queues,
            due: self.due_buckets(now_ms),
            sampled: false,
            blocked: self.blocked_statuses(),
            blocked_exchanges: self.blocked_exchanges(),
            pending_bytes: self.vhosts.iter().map(|v| v.pending_bytes).sum(),
        }
    }

    /// Each queue's held messages and bytes, most held first.
    fn queue_statuses(&self) -> Vec<QueueStatus> {
        let mut queues: Vec<QueueStatus> = self
            .ledger
            .totals()
            .map(|(q, vhost, queue, held, bytes)| QueueStatus {
                vhost: vhost.to_string(),
                queue: queue.to_string(),
                held,
                bytes,
                blocked: self.ledger.blocked_count(q),
                delayed: self.ledger.delayed_count(q),
                gone_since_ms: self.gone.get(&q).map(|b| b.since_ms),
            })
            .collect();
        queues.sort_by(|a, b| b.held.cmp(&a.held).then_with(|| a.queue.cmp(&b.queue)));
        queues
    }

    /// How many held messages fall due within each of [`DUE_EDGES`], and
    /// later.
    fn due_buckets(&self, now_ms: u64) -> Vec<DueBucket> {
        let edges: Vec<u64> = DUE_EDGES.iter().map(|(_, e)| *e).collect();
        let counts = self.ledger.due_chart(now_ms, &edges);
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
    fn blocked_statuses(&self) -> Vec<BlockedStatus> {
        self.ledger
            .blocked_reasons()
            .into_iter()
            .map(|(r, count)| BlockedStatus {
                reason: r.kind.label(),
                reply: r.reply.clone(),
                count,
            })
            .collect()
    }

    /// The exchanges a whole lane waits on (missing, refused).
    fn blocked_exchanges(&self) -> Vec<ExchangeStatus> {
        self.lanes
            .iter()
            .map(|((v, exchange), b)| ExchangeStatus {
                vhost: self.ledger.vhosts()[*v as usize].to_string(),
                exchange: exchange.to_string(),
                reply: self.reason_text(b.reason),
                since_ms: b.since_ms,
                next_try_ms: b.until_ms,
            })
            .collect()
    }
}

//! Where held messages are kept until they are republished and confirmed.
//!
//! The retry engine writes a message here before nackd acks it upstream and
//! removes it only after the broker confirmed the republish. Bodies live on
//! disk in the hold log; RAM keeps only each message's location and its
//! wheel entry.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use crate::metrics::{Metrics, Open};

/// Where a held message goes when it is due.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// Exchange `""`, routing key = the original queue: its tail.
    Queue,
    /// A dead-letter exchange (`on_exhausted = { exchange, routing_key }`).
    Exchange {
        /// Exchange name.
        exchange: String,
        /// Routing key.
        routing_key: String,
    },
}

/// A message nackd holds.
#[derive(Clone, Debug)]
pub struct Held {
    /// Store id.
    pub id: u64,
    /// Virtual host it came from and goes back to.
    pub vhost: Arc<str>,
    /// Queue it was nacked on.
    pub queue: Arc<str>,
    /// When it is due, in ms since the Unix epoch.
    pub due_ms: u64,
    /// The retry number written in its headers.
    pub retry: u32,
    /// Where it goes when due.
    pub route: Route,
    /// Where it goes if the broker returns it as unroutable.
    pub on_return: Option<Route>,
    /// Content header payload, headers already rewritten.
    pub header: Bytes,
    /// Body.
    pub body: Bytes,
}

impl Held {
    /// Bytes it takes (header + body).
    pub fn size(&self) -> usize {
        self.header.len() + self.body.len()
    }
}

/// Why the store cannot take or give a message.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store is over its configured size.
    #[error("store full: {0}")]
    Full(String),
    /// An I/O error.
    #[error("store I/O error: {0}")]
    Io(String),
}

pub mod inspect;
mod log;
pub mod record;

pub use log::{scan, segment_numbers, HeldMeta, Loc, Log, Reader, Recovered, SEGMENT_BYTES};

/// An operation for the writer thread.
pub enum WriteOp<C> {
    /// Store a message; the answer comes back with `ctx`.
    Put {
        /// The message.
        held: Held,
        /// The record it supersedes (a re-route).
        replaces: Option<Loc>,
        /// Handed back in [`Written`].
        ctx: C,
    },
    /// Forget a message.
    Del {
        /// Its id.
        id: u64,
        /// Its put record.
        loc: Loc,
    },
}

/// The writer's answer to a put, once fsynced (or failed).
pub struct Written<C> {
    /// The caller's context.
    pub ctx: C,
    /// The message id.
    pub id: u64,
    /// Its due time.
    pub due_ms: u64,
    /// Where it is, or why it is not stored.
    pub result: Result<Loc, StoreError>,
}

/// Runs `log` on its own thread. Every batch of operations that arrived
/// together shares one fsync (group commit); puts are answered after it.
/// The thread times each fsync and reports the store's size in `metrics`.
pub fn spawn_writer<C: Send + 'static>(
    mut log: Log,
    done: tokio::sync::mpsc::UnboundedSender<Written<C>>,
    metrics: Arc<Metrics>,
) -> std::sync::mpsc::Sender<WriteOp<C>> {
    let (tx, rx) = std::sync::mpsc::channel::<WriteOp<C>>();
    let open = Open::track(&metrics.store_open);
    metrics.store_bytes.set(log.bytes() as i64);
    std::thread::Builder::new()
        .name("nackd-store".into())
        .spawn(move || {
            let _open = open;
            while let Ok(first) = rx.recv() {
                let mut batch = vec![first];
                while batch.len() < 4096 {
                    match rx.try_recv() {
                        Ok(op) => batch.push(op),
                        Err(_) => break,
                    }
                }
                let mut answers = Vec::new();
                for op in batch {
                    match op {
                        WriteOp::Put {
                            held,
                            replaces,
                            ctx,
                        } => {
                            let result = log.put(&held, replaces);
                            answers.push(Written {
                                ctx,
                                id: held.id,
                                due_ms: held.due_ms,
                                result,
                            });
                        }
                        WriteOp::Del { id, loc } => log.del(id, loc),
                    }
                }
                let synced = if answers.is_empty() {
                    log.flush()
                } else {
                    let started = Instant::now();
                    let synced = log.sync();
                    Metrics::observe(&metrics.fsync, started.elapsed());
                    synced
                };
                metrics.store_bytes.set(log.bytes() as i64);
                let failed = answers
                    .iter()
                    .filter(|a| matches!(a.result, Err(StoreError::Io(_))))
                    .count()
                    + usize::from(synced.is_err());
                metrics.store_errors.inc_by(failed as u64);
                for mut answer in answers {
                    if let (Err(e), Ok(_)) = (&synced, &answer.result) {
                        answer.result = Err(e.clone());
                    }
                    if done.send(answer).is_err() {
                        return;
                    }
                }
            }
        })
        .expect("spawn the store thread");
    tx
}

//! The store's writer thread: group commit, answers, reclamation and
//! compaction, in that order, one batch at a time.
//!
//! Every operation that arrives while the previous commit runs joins the
//! next one, so one fsync covers a whole batch of puts. Puts are answered
//! only after that fsync, each with its own result.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;
use tracing::{info_span, warn};

use super::log::{Log, Relocation, Segments};
use super::{Held, Loc, Report, StoreError};
use crate::metrics::{Damaged, Metrics, Open};

/// Operations in one batch at most.
const BATCH_OPS: usize = 4096;
/// Staged bytes in one batch at most (a batch is one write).
const BATCH_BYTES: usize = 16 * 1024 * 1024;
/// Bytes compaction copies between two batches: a park waits for at most
/// this much extra writing.
const COMPACT_STEP: u64 = 4 * 1024 * 1024;
/// How often lost deletes are written again when nothing else comes.
const RETRY_EVERY: Duration = Duration::from_secs(1);

/// An operation for the writer thread.
#[allow(clippy::large_enum_variant)] // moved once per message or state change: boxing buys nothing
pub enum WriteOp<C> {
    /// Store a message; the answer comes back with `ctx`.
    Put {
        /// The message.
        held: Held,
        /// The record of the same message it supersedes (a re-route).
        replaces: Option<Loc>,
        /// Handed back in [`Written`].
        ctx: C,
    },
    /// Forget a message whose live put is at `loc`.
    Del {
        /// Its id.
        id: u64,
        /// Its put record.
        loc: Loc,
    },
    /// A put a durable record of the same message supersedes (a compaction
    /// copy adopted: the original; discarded: the copy).
    Release {
        /// The record.
        loc: Loc,
    },
    /// The older segments of a deferred open, read: merge them in.
    Merge(Segments),
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

/// What the writer tells its owner.
pub enum Event<C> {
    /// A put's answer.
    Written(Written<C>),
    /// Compaction copied live puts forward: adopt or discard each copy.
    Relocated(Vec<Relocation>),
}

/// The running writer: where operations go, and the thread to join.
pub struct Writer<C> {
    /// Operations; dropping every sender ends the thread after a last commit.
    pub tx: Sender<WriteOp<C>>,
    thread: JoinHandle<Log>,
}

impl<C> Writer<C> {
    /// Waits for the thread to end (once every sender is dropped) and gives
    /// the log back, committed; `None` if the thread panicked.
    pub fn join(self) -> Option<Log> {
        drop(self.tx);
        self.thread.join().ok()
    }
}

/// Runs `log` on its own thread, reporting to `events`.
pub fn spawn_writer<C: Send + 'static>(
    log: Log,
    events: UnboundedSender<Event<C>>,
    metrics: Arc<Metrics>,
) -> Writer<C> {
    let (tx, rx) = std::sync::mpsc::channel::<WriteOp<C>>();
    let open = Open::track(&metrics.store_open);
    metrics.store_bytes.set(log.bytes() as i64);
    let mut log = log;
    if let Some(report) = log.take_report() {
        count_report(&metrics, log.dir(), &report);
    }
    // A thread does not inherit the current span: made here, it is a child
    // of the spawner's (the engine's), and entered for the thread's life.
    let span = info_span!("store_writer", dir = %log.dir().display());
    let thread = std::thread::Builder::new()
        .name("nackd-store".into())
        .spawn(move || {
            let _open = open;
            let _span = span.entered();
            Thread::new(log, events, metrics).run(rx)
        })
        .expect("spawn the store thread");
    Writer { tx, thread }
}

/// Counts what recovery found in the metrics and lists it for the status
/// page, once the older segments are merged (at the start, or after a
/// deferred open); the damaged bytes themselves are counted by the engine.
fn count_report(metrics: &Metrics, dir: &std::path::Path, report: &Report) {
    metrics
        .store_damaged_ranges
        .inc_by(report.damage.len() as u64);
    metrics.store_torn_bytes.inc_by(report.torn_bytes());
    for d in report.damage.iter().chain(&report.torn_tail) {
        metrics.store_damage.push(Damaged {
            file: super::segment_path(dir, d.segment).display().to_string(),
            from: d.from,
            to: d.to,
            what: d.bad.name(),
            cost: d.bad.cost(),
        });
    }
}

struct Thread<C> {
    log: Log,
    events: UnboundedSender<Event<C>>,
    metrics: Arc<Metrics>,
    /// No compaction before this (it failed, or found nothing to copy).
    compact_after: Option<Instant>,
}

impl<C> Thread<C> {
    fn new(log: Log, events: UnboundedSender<Event<C>>, metrics: Arc<Metrics>) -> Self {
        Self {
            log,
            events,
            metrics,
            compact_after: None,
        }
    }

    /// Batch after batch until every sender is gone; gives the log back,
    /// committed.
    fn run(mut self, rx: Receiver<WriteOp<C>>) -> Log {
        while let Some(batch) = self.next_batch(&rx) {
            let answers = self.apply(batch);
            self.commit(answers);
            self.log.reclaim();
            self.compact();
            self.metrics.store_bytes.set(self.log.bytes() as i64);
            self.metrics
                .store_live_bytes
                .set(self.log.live_bytes() as i64);
        }
        let _ = self.log.commit();
        self.log
    }

    /// The next batch: waits for one operation (not long when deletes must
    /// be written again or compaction has work), then takes what is queued.
    fn next_batch(&self, rx: &Receiver<WriteOp<C>>) -> Option<Vec<WriteOp<C>>> {
        let wait = if self.may_compact() {
            Some(Duration::ZERO)
        } else if self.log.has_unwritten() {
            Some(RETRY_EVERY)
        } else {
            None
        };
        let first = match wait {
            None => Some(rx.recv().ok()?),
            Some(wait) => match rx.recv_timeout(wait) {
                Ok(op) => Some(op),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return None,
            },
        };
        let mut batch: Vec<WriteOp<C>> = first.into_iter().collect();
        let mut bytes = 0;
        while batch.len() < BATCH_OPS && bytes < BATCH_BYTES {
            match rx.try_recv() {
                Ok(op) => {
                    if let WriteOp::Put { held, .. } = &op {
                        bytes += held.size();
                    }
                    batch.push(op);
                }
                Err(_) => break,
            }
        }
        Some(batch)
    }

    /// Stages every operation; returns the puts' tentative answers.
    fn apply(&mut self, batch: Vec<WriteOp<C>>) -> Vec<Written<C>> {
        let mut answers = Vec::new();
        for op in batch {
            match op {
                WriteOp::Put {
                    held,
                    replaces,
                    ctx,
                } => answers.push(Written {
                    ctx,
                    id: held.id,
                    due_ms: held.due_ms,
                    result: self.log.put(&held, replaces),
                }),
                WriteOp::Del { id, loc } => self.log.del(id, loc),
                WriteOp::Release { loc } => self.log.release(loc),
                WriteOp::Merge(segments) => {
                    self.log.merge(segments);
                    if let Some(report) = self.log.take_report() {
                        count_report(&self.metrics, self.log.dir(), &report);
                    }
                }
            }
        }
        answers
    }

    /// Commits, then answers every put: `Ok` only if the commit covered it.
    fn commit(&mut self, mut answers: Vec<Written<C>>) {
        let started = Instant::now();
        let committed = self.log.commit();
        if !answers.is_empty() {
            Metrics::observe(&self.metrics.fsync, started.elapsed());
        }
        let refused = answers
            .iter()
            .filter(|a| matches!(a.result, Err(StoreError::Io(_))))
            .count();
        self.metrics.store_errors.inc_by(refused as u64);
        if let Err(e) = &committed {
            warn!(error = %e, puts = answers.len(), "store: commit failed; its puts are refused");
            self.metrics.store_errors.inc();
            for a in answers.iter_mut().filter(|a| a.result.is_ok()) {
                a.result = Err(e.clone());
            }
        }
        for answer in answers {
            let _ = self.events.send(Event::Written(answer));
        }
    }

    fn may_compact(&self) -> bool {
        self.compact_after.is_none_or(|t| Instant::now() >= t) && self.log.wants_compaction()
    }

    /// One step of compaction, if disk use calls for it.
    fn compact(&mut self) {
        if !self.may_compact() {
            return;
        }
        self.compact_after = None;
        match self.log.compact(COMPACT_STEP) {
            Ok(copies) if copies.is_empty() => {
                self.compact_after = Some(Instant::now() + RETRY_EVERY)
            }
            Ok(copies) => {
                let bytes: u64 = copies.iter().map(|c| u64::from(c.to.len)).sum();
                self.metrics.store_compacted_bytes.inc_by(bytes);
                let _ = self.events.send(Event::Relocated(copies));
            }
            Err(e) => {
                self.metrics.store_errors.inc();
                self.compact_after = Some(Instant::now() + RETRY_EVERY);
                warn!(error = %e, "store: compaction failed; trying again later");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use tracing::span::Id;
    use tracing::Subscriber;
    use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
    use tracing_subscriber::registry::LookupSpan;

    use super::*;
    use crate::store::log::Options;

    /// A span's name and the thread that entered it.
    type Entry = (&'static str, Option<String>);

    /// Records each span entered.
    #[derive(Clone, Default)]
    struct Entered(Arc<Mutex<Vec<Entry>>>);

    impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Entered {
        fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
            let name = ctx.span(id).map_or("?", |s| s.name());
            let thread = std::thread::current().name().map(String::from);
            self.0.lock().unwrap().push((name, thread));
        }
    }

    /// What recovery found reaches the metrics and the status page's list
    /// once, when the older segments are merged, even after a deferred open.
    #[test]
    fn what_recovery_found_is_counted_once_when_merged() {
        let disk = tempfile::tempdir().unwrap();
        let hold = |id| Held {
            id,
            vhost: Arc::from("/"),
            queue: Arc::from("q"),
            due_ms: id,
            retry: 1,
            route: crate::store::Route::Queue,
            on_return: None,
            header: bytes::Bytes::new(),
            body: bytes::Bytes::from(vec![7; 40]),
        };
        let bad = {
            let (mut log, _) = Log::open(disk.path(), Options::default()).unwrap();
            let bad = log.put(&hold(1), None).unwrap();
            log.put(&hold(2), None).unwrap();
            log.commit().unwrap();
            bad
        };
        let path = super::super::segment_path(disk.path(), bad.segment);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[bad.offset as usize + 60] ^= 1; // in 1's body
        let torn = bytes.len() as u64;
        let cut_short = bytes[bad.offset as usize..][..30].to_vec(); // a write torn by a crash
        bytes.extend(cut_short);
        std::fs::write(&path, bytes).unwrap();
        let (log, backlog) = Log::open_deferred(disk.path(), Options::default()).unwrap();
        let metrics = Metrics::new();
        let (events, _events) = tokio::sync::mpsc::unbounded_channel::<Event<()>>();
        let writer = spawn_writer(log, events, metrics.clone());
        assert_eq!(metrics.store_damaged_ranges.get(), 0, "nothing read yet");
        let (_, segments) = backlog.read().unwrap();
        writer.tx.send(WriteOp::Merge(segments)).unwrap();
        let log = writer.join().unwrap();
        assert_eq!(metrics.store_damaged_ranges.get(), 1);
        assert_eq!(metrics.store_torn_bytes.get(), 30);
        let listed = metrics.store_damage.all();
        let what: Vec<_> = listed.iter().map(|d| (d.from, d.to, d.what)).collect();
        let from = u64::from(bad.offset);
        assert_eq!(
            what,
            vec![
                (from, from + u64::from(bad.len), "put"),
                (torn, torn + 30, "torn")
            ]
        );
        assert!(listed[0]
            .file
            .ends_with(&format!("{:010}.log", bad.segment)));
        let (events, _events) = tokio::sync::mpsc::unbounded_channel::<Event<()>>();
        spawn_writer(log, events, metrics.clone()).join().unwrap();
        assert_eq!(metrics.store_damaged_ranges.get(), 1, "counted once");
    }

    #[test]
    fn the_writer_thread_runs_in_its_span() {
        let entered = Entered::default();
        let subscriber = tracing_subscriber::registry().with(entered.clone());
        let disk = tempfile::tempdir().unwrap();
        tracing::subscriber::with_default(subscriber, || {
            let (log, _) = Log::open(disk.path(), Options::default()).unwrap();
            let (events, _events) = tokio::sync::mpsc::unbounded_channel::<Event<()>>();
            spawn_writer(log, events, Metrics::new()).join().unwrap();
        });
        let entered = entered.0.lock().unwrap();
        assert!(
            entered.contains(&("store_writer", Some("nackd-store".into()))),
            "{entered:?}"
        );
    }
}

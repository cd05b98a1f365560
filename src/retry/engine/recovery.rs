//! Recovery beside the engine: after a start, the store's older segments
//! are read on a thread of their own while the engine parks and fires new
//! messages, and what recovery found is scheduled a step at a time
//! (10 M messages take seconds).
//!
//! [`Recovery`] owns the reading thread's answer and what is left to
//! schedule; the engine asks it for the answer ([`Recovery::read`]) and
//! for the next messages to schedule ([`Recovery::take`]).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::metrics::Metrics;
use crate::retry::ledger::Ledger;
use crate::store::{self, HeldMeta, Loc, Recovered};

/// How long after a failed read of the older segments it is tried again.
const BACKLOG_RETRY: Duration = if cfg!(test) {
    Duration::from_millis(100)
} else {
    Duration::from_secs(10)
};

/// What reading the older segments gives.
pub(super) type Read = io::Result<(Recovered, store::Segments)>;

/// The older segments being read, and the recovered messages not
/// scheduled yet.
#[derive(Default)]
pub(super) struct Recovery {
    backlog: Option<oneshot::Receiver<Read>>,
    loading: Option<Loading>,
}

/// Recovered messages not scheduled yet, oldest first.
pub(super) struct Loading {
    total: usize,
    held: std::vec::IntoIter<(u64, u64, Loc)>,
    meta: std::vec::IntoIter<HeldMeta>,
    /// Recovery's queue numbers, as the ledger interned them.
    queues: Vec<u32>,
}

impl Recovery {
    /// Reads `backlog` on a thread of its own; its answer comes from
    /// [`Recovery::read`]. A read that fails is tried again every
    /// [`BACKLOG_RETRY`] (counted in `metrics`), until the engine stops.
    /// `Err` if the thread cannot start.
    pub(super) fn read_backlog(
        &mut self,
        mut backlog: store::Backlog,
        metrics: Arc<Metrics>,
    ) -> io::Result<()> {
        let (tx, rx) = oneshot::channel();
        let span = tracing::info_span!("store_recovery");
        std::thread::Builder::new()
            .name("nackd-recover".into())
            .spawn(move || {
                let _span = span.entered();
                loop {
                    match backlog.read() {
                        Ok(read) => return drop(tx.send(Ok(read))),
                        Err(e) => {
                            metrics.store_errors.inc();
                            tracing::error!(error = %e, retry_in = ?BACKLOG_RETRY, "store: cannot read the older segments; their messages wait, the read is tried again");
                        }
                    }
                    std::thread::sleep(BACKLOG_RETRY);
                    if tx.is_closed() {
                        return; // the engine stopped
                    }
                }
            })?;
        self.backlog = Some(rx);
        Ok(())
    }

    /// The older segments' contents, once read (pending while none are
    /// being read).
    pub(super) async fn read(&mut self) -> Read {
        let Some(rx) = &mut self.backlog else {
            return std::future::pending().await;
        };
        let read = rx
            .await
            .unwrap_or_else(|_| Err(io::Error::other("the store's recovery thread died")));
        self.backlog = None;
        read
    }

    /// Takes what recovery found, to schedule it a step at a time; its
    /// queues are interned in `ledger`.
    pub(super) fn start(&mut self, recovered: Recovered, ledger: &mut Ledger) {
        let queues = recovered
            .queues
            .iter()
            .map(|(vhost, queue)| ledger.intern(vhost, queue))
            .collect();
        self.loading = Some(Loading {
            total: recovered.held.len(),
            held: recovered.held.into_iter(),
            meta: recovered.meta.into_iter(),
            queues,
        });
    }

    /// Whether recovered messages wait to be scheduled.
    pub(super) fn is_loading(&self) -> bool {
        self.loading.is_some()
    }

    /// The recovered messages left to schedule, to take from; what is left
    /// of them goes back with [`Recovery::resume`].
    pub(super) fn take(&mut self) -> Option<Loading> {
        self.loading.take()
    }

    /// Recovered messages are left to schedule, at the next step.
    pub(super) fn resume(&mut self, loading: Loading) {
        self.loading = Some(loading);
    }
}

impl Loading {
    /// Whether every recovered message was taken.
    pub(super) fn is_done(&self) -> bool {
        debug_assert!(self.held.len() > 0 || self.meta.len() == 0);
        self.held.len() == 0
    }

    /// How many messages recovery found.
    pub(super) fn total(&self) -> usize {
        self.total
    }
}

impl Iterator for Loading {
    /// Id, due time (ms), record and meta (its queue as the ledger has it).
    type Item = (u64, u64, Loc, HeldMeta);

    fn next(&mut self) -> Option<Self::Item> {
        let ((id, due, loc), mut meta) = self.held.next().zip(self.meta.next())?;
        meta.queue = self.queues[meta.queue as usize];
        Some((id, due, loc, meta))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::{Held, Log, Options, Route};

    /// A store in `dir` holding messages 1..=`n` of queue `q`.
    fn recovered(dir: &std::path::Path, n: u64) -> Recovered {
        let (mut log, _) = Log::open(dir, Options::default()).unwrap();
        for id in 1..=n {
            let held = Held {
                id,
                vhost: Arc::from("/"),
                queue: Arc::from("q"),
                due_ms: 1000 + id,
                retry: 1,
                route: Route::Queue,
                on_return: None,
                header: bytes::Bytes::from_static(b"h"),
                body: bytes::Bytes::from_static(b"b"),
            };
            log.put(&held, None).unwrap();
        }
        log.commit().unwrap();
        drop(log);
        Log::open(dir, Options::default()).unwrap().1
    }

    #[test]
    fn recovered_messages_are_taken_a_step_at_a_time_with_ledger_queues() {
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = Ledger::new(Metrics::new());
        // Another queue first: recovery's queue 0 is not the ledger's.
        ledger.intern(&Arc::from("/"), &Arc::from("other"));
        let mut recovery = Recovery::default();
        assert!(!recovery.is_loading());
        recovery.start(recovered(dir.path(), 3), &mut ledger);
        assert!(recovery.is_loading());
        let q = ledger.find("/", "q").unwrap();
        let mut loading = recovery.take().unwrap();
        let first: Vec<_> = loading.by_ref().take(2).collect();
        assert_eq!(first.len(), 2);
        assert!(first.iter().all(|(_, _, _, meta)| meta.queue == q));
        assert!(!loading.is_done());
        recovery.resume(loading);
        let mut loading = recovery.take().unwrap();
        let rest: Vec<u64> = loading.by_ref().map(|(id, ..)| id).collect();
        assert_eq!(rest.len(), 1);
        assert!(loading.is_done());
        assert_eq!(loading.total(), 3);
        assert!(!recovery.is_loading(), "taken, not resumed");
    }

    #[tokio::test]
    async fn the_read_answers_once_and_then_waits() {
        let dir = tempfile::tempdir().unwrap();
        recovered(dir.path(), 2);
        let (_log, backlog) = Log::open_deferred(dir.path(), Options::default()).unwrap();
        let mut recovery = Recovery::default();
        recovery.read_backlog(backlog, Metrics::new()).unwrap();
        let (found, _) = recovery.read().await.unwrap();
        assert_eq!(found.held.len(), 2);
        let again = tokio::time::timeout(Duration::from_millis(50), recovery.read()).await;
        assert!(again.is_err(), "nothing more to read");
    }
}

//! The store's writer thread: group commit, answers, reclamation and
//! compaction, in that order, one batch at a time.
//!
//! Every operation that arrives while the previous commit runs joins the
//! next one, so one fsync covers a whole batch of puts. Puts are answered
//! only after that fsync, each with its own result.
//!
//! It also says whether completions can be recorded ([`Event::Firing`]):
//! deletes that do not fit go into the space of the store's reserve
//! (`reserve`), and from then until the reserve is made again, or while
//! deletes cannot be written at all, firing must pause and puts are
//! refused.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, info, info_span, warn};

use super::log::{Log, Relocation, Segments, HEADROOM};
use super::reserve::{Reserve, RESERVE_BYTES};
use super::{Held, Loc, Report, StoreError};
use crate::metrics::{Damaged, Metrics, Open, PauseReason};
use nackd_core::clock::Clock;

/// Operations in one batch at most.
const BATCH_OPS: usize = 4096;
/// Staged bytes in one batch at most (a batch is one write).
const BATCH_BYTES: usize = 16 * 1024 * 1024;
/// Bytes compaction copies between two batches: a park waits for at most
/// this much extra writing.
const COMPACT_STEP: u64 = 4 * 1024 * 1024;
/// How often lost deletes are written again when nothing else comes.
const RETRY_EVERY: Duration = Duration::from_secs(1);
/// How often at most the clock's time is written to [`super::CLOCK`].
const MARK_EVERY: Duration = Duration::from_secs(1);

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
    /// Whether completions can be recorded changed: `Some(why)` while
    /// they cannot be, or only into the reserve (fire nothing more: what
    /// is already fired completes into the reserve, or waits as deletes
    /// written again every second); `None` once they can be again.
    Firing(Option<PauseReason>),
}

/// Since when the writer works on a batch (µs on nackd's clock), none
/// while it waits for work: a write or fsync that does not return (a stuck
/// disk) shows here, where the engine's watch sees it.
#[derive(Debug, Default)]
pub struct Busy(AtomicU64);

impl Busy {
    fn start(&self, now_us: u64) {
        self.0.store(now_us.max(1), Ordering::Release);
    }

    fn end(&self) {
        self.0.store(0, Ordering::Release);
    }

    /// Since when the writer works on its current batch, if it does.
    pub fn since_us(&self) -> Option<u64> {
        match self.0.load(Ordering::Acquire) {
            0 => None,
            us => Some(us),
        }
    }
}

/// The running writer: where operations go, and the thread to join.
pub struct Writer<C> {
    /// Operations; dropping every sender ends the thread after a last commit.
    pub tx: Sender<WriteOp<C>>,
    /// Since when it works on its current batch.
    pub busy: Arc<Busy>,
    /// Whether completions can be recorded as it starts (`Some(why)`: not,
    /// firing must wait); [`Event::Firing`] says when that changes.
    pub paused: Option<PauseReason>,
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

/// Runs `log` on its own thread, reporting to `events`. The reserve is
/// made (or found) first, so that [`Writer::paused`] is known before
/// anything fires.
pub fn spawn_writer<C: Send + 'static>(
    log: Log,
    events: UnboundedSender<Event<C>>,
    metrics: Arc<Metrics>,
    clock: Clock,
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
    let mut writer = Thread::new(log, events, metrics, clock);
    let busy = writer.busy.clone();
    let paused = span.in_scope(|| {
        writer.keep_reserve();
        writer.paused = writer.pause_reason();
        writer.paused
    });
    let thread = std::thread::Builder::new()
        .name("nackd-store".into())
        .spawn(move || {
            let _open = open;
            let _span = span.entered();
            writer.run(rx)
        })
        .expect("spawn the store thread");
    Writer {
        tx,
        busy,
        paused,
        thread,
    }
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
            file: match d.bad {
                super::scan::Harm::IdsBehind => dir.join(super::log::NEXT_ID),
                _ => super::segment_path(dir, d.segment),
            }
            .display()
            .to_string(),
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
    clock: Clock,
    /// No compaction before this (it failed, or found nothing to copy).
    compact_after: Option<Instant>,
    reserve: Reserve,
    /// What the owner was last told ([`Event::Firing`]).
    paused: Option<PauseReason>,
    /// When the clock was last written to [`super::CLOCK`].
    marked: Option<Instant>,
    busy: Arc<Busy>,
}

impl<C> Thread<C> {
    fn new(
        log: Log,
        events: UnboundedSender<Event<C>>,
        metrics: Arc<Metrics>,
        clock: Clock,
    ) -> Self {
        #[allow(unused_mut)] // a test shares its simulated disk with it
        let mut reserve = Reserve::adopt(log.dir());
        #[cfg(test)]
        {
            reserve.disk = log.faults.disk.clone();
        }
        Self {
            log,
            events,
            metrics,
            clock,
            compact_after: None,
            reserve,
            paused: None,
            marked: None,
            busy: Arc::default(),
        }
    }

    /// Batch after batch until every sender is gone; gives the log back,
    /// committed.
    fn run(mut self, rx: Receiver<WriteOp<C>>) -> Log {
        while let Some(batch) = self.next_batch(&rx) {
            self.busy.start(self.clock.now_us());
            let answers = self.apply(batch);
            self.commit(answers);
            self.mark_clock();
            self.use_reserve();
            self.log.reclaim();
            self.compact();
            self.keep_reserve();
            self.report();
            self.metrics.store_bytes.set(self.log.bytes() as i64);
            self.metrics
                .store_live_bytes
                .set(self.log.live_bytes() as i64);
            self.busy.end();
        }
        let _ = self.log.commit();
        self.log
    }

    /// The next batch: waits for one operation (not long when deletes must
    /// be written again, the reserve made again, or compaction has work),
    /// then takes what is queued.
    fn next_batch(&self, rx: &Receiver<WriteOp<C>>) -> Option<Vec<WriteOp<C>>> {
        let wait = if self.may_compact() {
            Some(Duration::ZERO)
        } else if self.log.has_unwritten() || !self.reserve.kept() {
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

    /// Stages every operation; returns the puts' tentative answers. Puts
    /// are refused while the reserve is missing: its space is for the
    /// completions of what was fired, and it must be made again first.
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
                    result: match self.reserve.kept() {
                        true => self.log.put(&held, replaces),
                        false => Err(StoreError::Io(
                            "the disk is full (the store's reserve is in use or cannot be made)"
                                .into(),
                        )),
                    },
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

    /// Writes the clock's time to [`super::CLOCK`], at most once a
    /// second: a restart raises its clock to it, so that a wall clock set
    /// back meanwhile makes no message wait longer than it had left.
    fn mark_clock(&mut self) {
        let now = self.clock.now();
        if self
            .marked
            .is_some_and(|t| now.saturating_duration_since(t) < MARK_EVERY)
        {
            return;
        }
        self.marked = Some(now);
        if let Err(e) = super::write_clock_mark(self.log.dir(), self.clock.now_ms()) {
            debug!(error = %e, "store: cannot write the clock's time");
        }
    }

    /// Commits, then answers every put: `Ok` only if the commit covered it.
    fn commit(&mut self, mut answers: Vec<Written<C>>) {
        let started = self.clock.now();
        let committed = self.log.commit();
        if !answers.is_empty() {
            Metrics::observe(&self.metrics.fsync, self.clock.now() - started);
        }
        let refused = answers
            .iter()
            .filter(|a| matches!(a.result, Err(StoreError::Io(_))))
            .count();
        self.metrics.store_errors.inc_by(refused as u64);
        if let Err(e) = &committed {
            match (answers.is_empty(), self.paused) {
                (false, _) => {
                    warn!(error = %e, puts = answers.len(), "store: commit failed; its puts are refused")
                }
                (true, Some(PauseReason::CompletionsUnwritten)) => {
                    debug!(error = %e, "store: completions still cannot be written")
                }
                (true, _) => warn!(error = %e, "store: completions could not be written"),
            }
            self.metrics.store_errors.inc();
            for a in answers.iter_mut().filter(|a| a.result.is_ok()) {
                a.result = Err(e.clone());
            }
        }
        for answer in answers {
            let _ = self.events.send(Event::Written(answer));
        }
    }

    /// Deletes that did not fit go into the reserve's space: the reserve
    /// goes and they are written again at once. Firing pauses from now
    /// ([`Thread::report`]) while the free space does not hold every held
    /// message's delete, so what still comes is bounded by what the
    /// republishers already have. Once it does (space came back, but not
    /// enough to make the reserve again), firing goes on without a reserve:
    /// if another process then takes that space, the deletes of what the
    /// republishers have (two confirm windows per vhost) may go unwritten,
    /// and those messages are republished once more only if nackd is also
    /// killed before they are written.
    fn use_reserve(&mut self) {
        if !self.log.has_unwritten() || !self.reserve.release() {
            return;
        }
        warn!(
            free = self.log.free_space(),
            "store: the disk is full: the reserve is released for the completions of what was already fired; firing pauses until the disk has room for it again"
        );
        if let Err(e) = self.log.commit() {
            self.metrics.store_errors.inc();
            warn!(error = %e, "store: completions cannot be written even into the reserve's space; tried again every second");
        }
    }

    /// Makes the reserve (again) once every delete is written and the disk
    /// has room for it and the log's headroom.
    fn keep_reserve(&mut self) {
        let room = self.log.free_space() >= RESERVE_BYTES + HEADROOM;
        if self.reserve.kept() || self.log.has_unwritten() || !room {
            return;
        }
        match self.reserve.make() {
            Ok(()) => info!(bytes = RESERVE_BYTES, "store: reserve for completions made"),
            Err(e) => debug!(error = %e, "store: cannot make the reserve yet"),
        }
        self.log.read_free();
    }

    /// Why completions cannot be recorded (or only into the reserve's
    /// space), if they cannot. Without a reserve, firing goes on while the
    /// free space still holds every held message's delete (nackd filled
    /// the disk itself, or the reserve could not be made since): firing is
    /// what frees the disk then.
    fn pause_reason(&self) -> Option<PauseReason> {
        if self.log.has_unwritten() {
            Some(PauseReason::CompletionsUnwritten)
        } else if !self.reserve.kept() && !self.log.deletes_fit() {
            Some(PauseReason::DiskFull)
        } else {
            None
        }
    }

    /// Tells the owner when whether completions can be recorded changed.
    fn report(&mut self) {
        let paused = self.pause_reason();
        if paused != self.paused {
            self.paused = paused;
            let _ = self.events.send(Event::Firing(paused));
        }
    }

    /// Whether a compaction step may run: not while the reserve is missing
    /// (its copies need room), nor before `compact_after`.
    fn may_compact(&self) -> bool {
        self.compact_after.is_none_or(|t| self.clock.now() >= t)
            && self.reserve.kept()
            && self.log.wants_compaction()
    }

    /// One step of compaction, if disk use calls for it.
    fn compact(&mut self) {
        if !self.may_compact() {
            return;
        }
        self.compact_after = None;
        match self.log.compact(COMPACT_STEP) {
            Ok(copies) if copies.is_empty() => {
                self.compact_after = Some(self.clock.now() + RETRY_EVERY)
            }
            Ok(copies) => {
                let bytes: u64 = copies.iter().map(|c| u64::from(c.to.len)).sum();
                self.metrics.store_compacted_bytes.inc_by(bytes);
                let _ = self.events.send(Event::Relocated(copies));
            }
            Err(e) => {
                self.metrics.store_errors.inc();
                self.compact_after = Some(self.clock.now() + RETRY_EVERY);
                warn!(error = %e, "store: compaction failed; trying again later");
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests time with the real clock
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
        let (log, mut backlog) = Log::open_deferred(disk.path(), Options::default()).unwrap();
        let metrics = Metrics::new();
        let (events, _events) = tokio::sync::mpsc::unbounded_channel::<Event<()>>();
        let writer = spawn_writer(log, events, metrics.clone(), Clock::start());
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
        spawn_writer(log, events, metrics.clone(), Clock::start())
            .join()
            .unwrap();
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
            spawn_writer(log, events, Metrics::new(), Clock::start())
                .join()
                .unwrap();
        });
        let entered = entered.0.lock().unwrap();
        assert!(
            entered.contains(&("store_writer", Some("nackd-store".into()))),
            "{entered:?}"
        );
    }

    /// A writer over a store whose disk the test fills and frees, as other
    /// processes on it would.
    struct Rig {
        dir: tempfile::TempDir,
        disk: Arc<std::sync::atomic::AtomicU64>,
        writer: Writer<u64>,
        events: tokio::sync::mpsc::UnboundedReceiver<Event<u64>>,
    }

    const ROOMY: u64 = 1 << 30;

    impl Rig {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
            let disk = Arc::new(std::sync::atomic::AtomicU64::new(ROOMY));
            log.faults.disk = Some(disk.clone());
            let (events_tx, events) = tokio::sync::mpsc::unbounded_channel();
            let writer = spawn_writer(log, events_tx, Metrics::new(), Clock::start());
            Self {
                dir,
                disk,
                writer,
                events,
            }
        }

        fn free(&self, bytes: u64) {
            self.disk.store(bytes, std::sync::atomic::Ordering::SeqCst);
        }

        fn next(&mut self) -> Event<u64> {
            let began = Instant::now();
            loop {
                if let Ok(event) = self.events.try_recv() {
                    return event;
                }
                assert!(began.elapsed() < Duration::from_secs(10), "no event");
                std::thread::sleep(Duration::from_millis(5));
            }
        }

        fn put(&mut self, id: u64) -> Result<Loc, StoreError> {
            let held = Held {
                id,
                vhost: "/".into(),
                queue: "q".into(),
                due_ms: id,
                retry: 1,
                route: crate::store::Route::Queue,
                on_return: None,
                header: bytes::Bytes::from_static(&[0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0]),
                body: bytes::Bytes::from(vec![7u8; 100]),
            };
            let replaces = None;
            let ctx = id;
            self.writer
                .tx
                .send(WriteOp::Put {
                    held,
                    replaces,
                    ctx,
                })
                .unwrap();
            match self.next() {
                Event::Written(w) => w.result,
                _ => panic!("a put's answer first"),
            }
        }

        fn del(&self, id: u64, loc: Loc) {
            self.writer.tx.send(WriteOp::Del { id, loc }).unwrap();
        }

        fn firing(&mut self) -> Option<PauseReason> {
            match self.next() {
                Event::Firing(paused) => paused,
                _ => panic!("a change of firing expected"),
            }
        }

        /// Ids held on disk now: what a restart would bring back.
        fn on_disk(&self) -> Vec<u64> {
            let held = crate::store::inspect::held(self.dir.path()).unwrap();
            held.iter().map(|h| h.id).collect()
        }

        fn reserve_kept(&self) -> bool {
            self.dir.path().join("RESERVE").exists()
        }
    }

    /// Issue 19: another process fills the disk. The completions of what
    /// was fired still reach the disk, written into the reserve's space;
    /// firing pauses and puts are refused until the disk has room for the
    /// reserve again, which the writer notices by itself.
    #[test]
    fn deletes_that_do_not_fit_go_into_the_reserve_and_firing_pauses_until_it_is_back() {
        let mut rig = Rig::new();
        let one = rig.put(1).unwrap();
        assert!(rig.reserve_kept(), "made at start");
        rig.put(2).unwrap();
        rig.free(0); // someone else took every free byte
        rig.del(1, one);
        assert_eq!(rig.firing(), Some(PauseReason::DiskFull));
        assert_eq!(rig.on_disk(), [2], "the delete is durable");
        assert!(!rig.reserve_kept());
        assert!(rig.put(3).is_err(), "the reserve's space is not for puts");
        rig.free(ROOMY);
        assert_eq!(rig.firing(), None, "resumed by itself");
        assert!(rig.reserve_kept(), "made again first");
        rig.put(4).unwrap();
        assert_eq!(rig.on_disk(), [2, 4]);
        rig.writer.join().unwrap();
    }

    /// Review 2, finding 7: with no reserve (used, and too little room to
    /// make it again) but room for every held message's delete, firing goes
    /// on; before, it paused until someone freed disk and nothing fired,
    /// though firing is what frees the disk. Puts still wait for the
    /// reserve. Once the deletes no longer fit, firing pauses again.
    #[test]
    fn without_a_reserve_firing_goes_on_while_the_deletes_fit() {
        let mut rig = Rig::new();
        let one = rig.put(1).unwrap();
        let two = rig.put(2).unwrap();
        let three = rig.put(3).unwrap();
        rig.free(0);
        rig.del(1, one);
        assert_eq!(rig.firing(), Some(PauseReason::DiskFull));
        rig.free(HEADROOM + 64 * 1024); // too little for the reserve
        assert_eq!(rig.firing(), None, "the deletes fit: firing goes on");
        assert!(!rig.reserve_kept());
        assert!(rig.put(4).is_err(), "puts wait for the reserve");
        rig.del(2, two);
        rig.free(100);
        rig.del(3, three);
        assert_eq!(rig.firing(), Some(PauseReason::DiskFull));
        assert!(rig.on_disk().is_empty(), "every delete went in");
        rig.writer.join().unwrap();
    }

    /// When even the reserve's space is taken, deletes cannot be written:
    /// firing stays paused (for that reason) while they are tried again
    /// every second, and resumes once they are written and the reserve is
    /// back.
    #[test]
    fn completions_that_cannot_be_written_pause_firing_until_they_are() {
        let mut rig = Rig::new();
        let one = rig.put(1).unwrap();
        let two = rig.put(2).unwrap();
        rig.free(0);
        rig.del(1, one);
        assert_eq!(rig.firing(), Some(PauseReason::DiskFull));
        rig.free(0); // the reserve's space is taken too
        rig.del(2, two);
        assert_eq!(rig.firing(), Some(PauseReason::CompletionsUnwritten));
        assert_eq!(rig.on_disk(), [2], "its delete is not on disk");
        rig.free(ROOMY);
        assert_eq!(rig.firing(), None);
        assert!(rig.on_disk().is_empty(), "written again by itself");
        assert!(rig.reserve_kept());
        rig.writer.join().unwrap();
    }
}

//! The store against a model: random sequences of parks, completions
//! (confirm, purge, cancel), re-routes, group commits that succeed or fail
//! part way, compaction steps and crashes, with the writer and the engine
//! running in any interleaving (their channels are queues the test drains
//! in random steps). The engine's side is the real [`Ledger`] protocol.
//!
//! After every crash and reopen, the recovered messages must be exactly the
//! model's: every put the store committed, minus every delete it committed,
//! plus what the torn write of the crash completed. Throughout, the store's
//! bookkeeping must match the engine's (no release that matches nothing,
//! one live record per held message once things settle) and disk use must
//! stay within its bound.

/// A staged put, its context and its answer so far.
type PutAnswer = (Held, Ctx, Result<Loc, ()>);

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use proptest::prelude::*;

use super::record::View;
use super::{scan, segment_numbers, segment_path, Backlog, Held, Log, Options, Relocation, Route};
use crate::metrics::Metrics;
use crate::retry::ledger::{Entry, Ledger, StoreOp};
use crate::store::{HeldMeta, Loc};

const SEGMENT: u64 = 2048;

#[derive(Clone, Debug)]
enum Op {
    /// The engine parks a new message of this body size.
    Park(u16),
    /// The engine completes a held message (confirm, purge or cancel).
    Complete(u16),
    /// The engine re-routes a held message (a put superseding its record).
    Reroute(u16),
    /// The writer takes up to n queued operations and commits them.
    Write(u8),
    /// Like `Write`, but the commit fails: a write stopping after this many
    /// bytes, or (with `None`) an fsync error.
    WriteFails(u8, Option<u16>),
    /// The writer runs a compaction step and reclaims.
    Compact,
    /// Like `Compact`, but its commit fails as `WriteFails` says.
    CompactFails(Option<u16>),
    /// The engine handles up to n answers of the writer.
    Answer(u8),
    /// The writer stages up to n operations and the process dies while
    /// writing them: this many of the staged bytes reach the file.
    Crash(u8, u16),
    /// The process dies before the directory fsync of the last segment
    /// removal: that file is back at the reopen.
    CrashLosingRemoval,
    /// Like `Crash`, then the store reopens as nackd starts it: a fresh
    /// head at once, the older segments read later (`FinishRecovery`),
    /// with parks, completions, commits and crashes in between.
    CrashDeferred(u8, u16),
    /// The older segments of a deferred reopen are read and merged.
    FinishRecovery,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (20u16..600).prop_map(Op::Park),
        3 => any::<u16>().prop_map(Op::Complete),
        1 => any::<u16>().prop_map(Op::Reroute),
        4 => (1u8..8).prop_map(Op::Write),
        1 => (1u8..8, proptest::option::of(any::<u16>())).prop_map(|(n, at)| Op::WriteFails(n, at)),
        2 => Just(Op::Compact),
        1 => proptest::option::of(any::<u16>()).prop_map(Op::CompactFails),
        4 => (1u8..8).prop_map(Op::Answer),
        1 => (0u8..8, any::<u16>()).prop_map(|(n, at)| Op::Crash(n, at)),
        1 => Just(Op::CrashLosingRemoval),
        1 => (0u8..8, any::<u16>()).prop_map(|(n, at)| Op::CrashDeferred(n, at)),
        2 => Just(Op::FinishRecovery),
    ]
}

/// Why a put was made, as the engine's `PutCtx`.
#[derive(Clone, Copy, Debug)]
enum Ctx {
    Park,
    Reroute,
}

#[allow(clippy::large_enum_variant)] // a test's channel message
enum ToWriter {
    Put(Held, Option<Loc>, Ctx),
    Del(u64, Loc),
    Release(Loc),
}

enum ToEngine {
    Written(u64, Ctx, HeldMeta, u64, Result<Loc, ()>),
    Relocated(Relocation),
}

struct World {
    dir: tempfile::TempDir,
    log: Option<Log>,
    ledger: Ledger,
    queue: u32,
    to_writer: VecDeque<ToWriter>,
    to_engine: VecDeque<ToEngine>,
    next_id: u64,
    /// The model: id → version (the `retry` field) of every committed put
    /// not cancelled by a committed delete.
    durable: BTreeMap<u64, u32>,
    /// Deletes a failed commit lost: the store writes them at its next commit.
    unwritten: Vec<u64>,
    /// Highest id a durable record ever had: no reopen hands it out again.
    used: u64,
    /// The segment the last removal took, and its bytes. Each removal is
    /// made durable before the next, so only this one may come back.
    last_removed: Option<(u32, Vec<u8>)>,
    /// A deferred reopen's older segments, not read yet, and what the model
    /// held when it reopened (what reading them must give back).
    backlog: Option<(Backlog, BTreeMap<u64, u32>)>,
}

fn held(id: u64, size: usize, version: u32, dead_letter: bool) -> Held {
    Held {
        id,
        vhost: Arc::from("/"),
        queue: Arc::from("q"),
        due_ms: 1_000 + id,
        retry: version,
        route: match dead_letter {
            false => Route::Queue,
            true => Route::Exchange {
                exchange: "dlx".into(),
                routing_key: "q".into(),
            },
        },
        on_return: None,
        header: Bytes::from_static(b"header"),
        body: Bytes::from(vec![id as u8; size]),
    }
}

impl World {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = Ledger::new(Metrics::new());
        let queue = ledger.intern(&Arc::from("/"), &Arc::from("q"));
        let mut world = Self {
            dir,
            log: None,
            ledger,
            queue,
            to_writer: VecDeque::new(),
            to_engine: VecDeque::new(),
            next_id: 1,
            durable: BTreeMap::new(),
            unwritten: Vec::new(),
            used: 0,
            last_removed: None,
            backlog: None,
        };
        world.reopen();
        world
    }

    fn log(&mut self) -> &mut Log {
        self.log.as_mut().expect("open")
    }

    fn options() -> Options {
        Options {
            max_bytes: None,
            segment_bytes: SEGMENT,
        }
    }

    /// Opens the store as nackd does at startup and loads the engine from
    /// what it recovered; checks that it is exactly the model.
    fn reopen(&mut self) {
        let mut before = self.segments();
        let (log, rec) = Log::open(self.dir.path(), Self::options()).unwrap();
        // Opening cuts a torn tail (durably), creates a segment (a
        // directory fsync) and reclaims.
        if let Some(torn) = &rec.torn_tail {
            before
                .entry(torn.segment)
                .and_modify(|b| b.truncate(torn.from as usize));
        }
        self.last_removed = self.removed_since(before);
        self.ledger = Ledger::new(Metrics::new());
        self.queue = self.ledger.intern(&Arc::from("/"), &Arc::from("q"));
        let got = self.load(&log.reader(), &rec);
        assert!(rec.damage.is_empty(), "damage: {:?}", rec.damage);
        assert_eq!(got, self.durable, "recovered exactly what is durable");
        assert!(
            rec.next_id > self.used,
            "id {} handed out again",
            rec.next_id
        );
        self.next_id = self.next_id.max(rec.next_id);
        self.to_writer.clear();
        self.to_engine.clear();
        self.unwritten.clear();
        self.log = Some(log);
    }

    /// Opens the store as nackd starts it without a replica: a fresh head
    /// at once (new ids from `next_id()` on), the older segments left for
    /// [`World::finish_recovery`].
    fn reopen_deferred(&mut self) {
        let mut before = self.segments();
        let (log, backlog) = Log::open_deferred(self.dir.path(), Self::options()).unwrap();
        if let Some(torn) = backlog.torn_tail() {
            before
                .entry(torn.segment)
                .and_modify(|b| b.truncate(torn.from as usize));
        }
        self.last_removed = self.removed_since(before);
        assert!(
            log.next_id() > self.used,
            "id {} handed out again",
            log.next_id()
        );
        self.next_id = self.next_id.max(log.next_id());
        self.ledger = Ledger::new(Metrics::new());
        self.queue = self.ledger.intern(&Arc::from("/"), &Arc::from("q"));
        self.to_writer.clear();
        self.to_engine.clear();
        self.unwritten.clear();
        self.log = Some(log);
        self.backlog = Some((backlog, self.durable.clone()));
    }

    /// Reads the older segments and merges them, as the engine does once
    /// its recovery thread is done: they hold exactly what the model held
    /// at the reopen (nothing since could touch them: the engine did not
    /// know their messages).
    fn finish_recovery(&mut self) {
        let Some((mut backlog, then)) = self.backlog.take() else {
            return;
        };
        let (rec, segments) = backlog.read().unwrap();
        let before = self.segments();
        self.log().merge(segments);
        if let Some(removed) = self.removed_since(before) {
            self.last_removed = Some(removed);
        }
        let reader = self.log().reader();
        let got = self.load(&reader, &rec);
        assert!(rec.damage.is_empty(), "damage: {:?}", rec.damage);
        assert_eq!(
            got, then,
            "the older segments hold what was durable at the reopen"
        );
    }

    /// Puts what recovery found in the engine's ledger, each read back from
    /// its record; returns it as the model holds it (id → version).
    fn load(&mut self, reader: &super::Reader, rec: &super::Recovered) -> BTreeMap<u64, u32> {
        let mut got = BTreeMap::new();
        for ((id, due, loc), meta) in rec.held.iter().zip(&rec.meta) {
            let back = reader.read(*loc).unwrap();
            assert_eq!(back.id, *id);
            assert_eq!(back.body.len() + 6, meta.size as usize);
            assert_eq!(u32::from(meta.retry), back.retry.min(u32::from(u16::MAX)));
            got.insert(*id, back.retry);
            let meta = HeldMeta {
                queue: self.queue,
                ..*meta
            };
            self.ledger.insert(*id, Entry::new(*loc, *due, meta));
        }
        got
    }

    fn pick(&self, n: u16) -> Option<u64> {
        let ids: Vec<u64> = self.ledger.iter().map(|(id, _)| id).collect();
        let mut ids = ids;
        ids.sort_unstable();
        (!ids.is_empty()).then(|| ids[n as usize % ids.len()])
    }

    fn tell_store(&mut self, op: StoreOp) {
        self.to_writer.push_back(match op {
            StoreOp::Del { id, loc } => ToWriter::Del(id, loc),
            StoreOp::Release { loc } => ToWriter::Release(loc),
        });
    }

    // Whole because: one short arm per operation of the model.
    #[allow(clippy::too_many_lines)]
    fn step(&mut self, op: Op) {
        match op {
            Op::Park(size) => {
                let id = self.next_id;
                self.next_id += 1;
                let h = held(id, size.into(), 1, false);
                self.to_writer.push_back(ToWriter::Put(h, None, Ctx::Park));
            }
            Op::Complete(n) => {
                if let Some(id) = self.pick(n) {
                    if let Some((_, Some(op))) = self.ledger.complete(id) {
                        self.tell_store(op);
                    }
                }
            }
            Op::Reroute(n) => {
                let Some(id) = self.pick(n) else { return };
                let loc = self.ledger.get(id).unwrap().loc;
                let Some(old) = self.ledger.start_rewrite(id) else {
                    return;
                };
                assert_eq!(old, loc);
                let now = self.log().reader().read(old).unwrap();
                let h = held(id, now.body.len(), now.retry + 1, true);
                self.to_writer
                    .push_back(ToWriter::Put(h, Some(old), Ctx::Reroute));
            }
            Op::Write(n) => self.write(n, None),
            Op::WriteFails(n, at) => self.write(n, Some(at)),
            Op::Compact | Op::CompactFails(_) => {
                match op {
                    Op::CompactFails(Some(at)) => {
                        self.log().faults.write_then_fail = Some(at.into())
                    }
                    Op::CompactFails(None) => self.log().faults.fail_sync = true,
                    _ => {}
                }
                let copies = self.log().compact(1024);
                // Not armed for a later commit if compaction wrote nothing.
                self.log().faults = Default::default();
                assert!(copies.is_ok() || matches!(op, Op::CompactFails(_)));
                let copies = copies.unwrap_or_default();
                if !self.log().has_unwritten() {
                    // Its commit wrote the deletes a failed one had lost.
                    for id in self.unwritten.drain(..) {
                        self.durable.remove(&id);
                    }
                }
                self.to_engine
                    .extend(copies.into_iter().map(ToEngine::Relocated));
                self.reclaim();
            }
            Op::Answer(n) => self.answer(n),
            Op::CrashLosingRemoval => {
                self.backlog = None;
                let _ = self.log.take().unwrap().crash(0);
                if let Some((n, bytes)) = self.last_removed.take() {
                    std::fs::write(segment_path(self.dir.path(), n), bytes).unwrap();
                }
                self.reopen();
            }
            Op::FinishRecovery => self.finish_recovery(),
            Op::Crash(n, torn) | Op::CrashDeferred(n, torn) => {
                let (puts, dels) = self.stage(n);
                drop((puts, dels));
                let written = self.log.take().unwrap().crash(torn.into());
                // Whole records of the torn write count as written.
                scan(&written, 0, |rec, _| match rec {
                    View::Put(p) => {
                        self.durable.insert(p.id, p.retry);
                        self.used = self.used.max(p.id);
                    }
                    View::Del(id) => {
                        self.durable.remove(&id);
                    }
                });
                self.backlog = None;
                match op {
                    Op::CrashDeferred(..) => self.reopen_deferred(),
                    _ => self.reopen(),
                }
            }
        }
        let log = self.log.as_ref().unwrap();
        assert_eq!(log.mismatched_releases(), 0, "a release matched nothing");
    }

    /// Stages up to `n` queued operations; returns the puts' answers so
    /// far and the ids of the deletes.
    fn stage(&mut self, n: u8) -> (Vec<PutAnswer>, Vec<u64>) {
        let mut puts = Vec::new();
        let mut dels = Vec::new();
        for _ in 0..n {
            let Some(op) = self.to_writer.pop_front() else {
                break;
            };
            let log = self.log.as_mut().unwrap();
            match op {
                ToWriter::Put(h, replaces, ctx) => {
                    let r = log.put(&h, replaces).map_err(|_| ());
                    puts.push((h, ctx, r));
                }
                ToWriter::Del(id, loc) => {
                    log.del(id, loc);
                    dels.push(id);
                }
                ToWriter::Release(loc) => log.release(loc),
            }
        }
        (puts, dels)
    }

    fn write(&mut self, n: u8, fail: Option<Option<u16>>) {
        let (puts, dels) = self.stage(n);
        let fail = fail.filter(|_| self.log().has_staged());
        match fail {
            Some(Some(at)) => self.log().faults.write_then_fail = Some(at.into()),
            Some(None) => self.log().faults.fail_sync = true,
            None => {}
        }
        let committed = self.log().commit().is_ok();
        assert_eq!(committed, fail.is_none());
        if committed {
            for (h, _, r) in &puts {
                if r.is_ok() {
                    self.durable.insert(h.id, h.retry);
                    self.used = self.used.max(h.id);
                }
            }
            for id in self.unwritten.drain(..).chain(dels) {
                self.durable.remove(&id);
            }
        } else if self.log().has_unwritten() {
            self.unwritten.extend(dels);
        } else {
            // The deletes were written again at once, on their own.
            for id in self.unwritten.drain(..).chain(dels) {
                self.durable.remove(&id);
            }
        }
        for (h, ctx, r) in puts {
            let r = if committed { r } else { Err(()) };
            let meta = h.meta(self.queue);
            self.to_engine
                .push_back(ToEngine::Written(h.id, ctx, meta, h.due_ms, r));
        }
        self.reclaim();
    }

    /// Reclaims, keeping the bytes of the last segment it removes.
    fn reclaim(&mut self) {
        let before = self.segments();
        if self.log().reclaim() > 0 {
            self.last_removed = self.removed_since(before);
        }
    }

    /// Every segment file and its bytes.
    fn segments(&self) -> BTreeMap<u32, Vec<u8>> {
        let dir = self.dir.path();
        let numbers = segment_numbers(dir).unwrap();
        numbers
            .into_iter()
            .map(|n| (n, std::fs::read(segment_path(dir, n)).unwrap()))
            .collect()
    }

    /// The newest of the segments in `before` that are gone now.
    fn removed_since(&self, before: BTreeMap<u32, Vec<u8>>) -> Option<(u32, Vec<u8>)> {
        let now = segment_numbers(self.dir.path()).unwrap();
        before.into_iter().rfind(|(n, _)| !now.contains(n))
    }

    fn answer(&mut self, n: u8) {
        for _ in 0..n {
            let Some(event) = self.to_engine.pop_front() else {
                return;
            };
            match event {
                ToEngine::Written(id, Ctx::Park, meta, due, Ok(loc)) => {
                    self.ledger.insert(id, Entry::new(loc, due, meta));
                }
                ToEngine::Written(_, Ctx::Park, _, _, Err(())) => {}
                ToEngine::Written(id, Ctx::Reroute, _, _, result) => {
                    let (op, _) = self.ledger.rewritten(id, result);
                    op.into_iter().for_each(|op| self.tell_store(op));
                }
                ToEngine::Relocated(copy) => {
                    let op = self.ledger.relocated(copy.id, copy.from, copy.to);
                    self.tell_store(op);
                }
            }
        }
    }

    /// Lets everything queued happen, then checks that the store holds one
    /// live record per held message, that record, and disk use in bounds.
    fn settle(&mut self) {
        self.finish_recovery();
        let mut rounds = 0;
        while !self.to_writer.is_empty()
            || !self.to_engine.is_empty()
            || self.log().has_unwritten()
            || self.log().relocations_pending()
            || self.log().wants_compaction()
        {
            rounds += 1;
            assert!(rounds <= 1000, "the store never settles");
            self.write(64, None);
            self.answer(255);
            self.step(Op::Compact);
            self.answer(255);
        }
        let mut engine: Vec<(u32, u32)> = self
            .ledger
            .iter()
            .map(|(_, e)| (e.loc.segment, e.loc.offset))
            .collect();
        engine.sort_unstable();
        let log = self.log.as_ref().unwrap();
        assert_eq!(
            log.live_positions(),
            engine,
            "one live record per held message"
        );
        let bound = 2 * log.live_bytes() + 2 * SEGMENT + 2048;
        assert!(
            log.bytes() <= bound,
            "{} bytes on disk for {} live",
            log.bytes(),
            log.live_bytes()
        );
        let held: BTreeMap<u64, u16> = self
            .ledger
            .iter()
            .map(|(id, e)| (id, e.meta.retry))
            .collect();
        let durable: Vec<u64> = self.durable.keys().copied().collect();
        assert_eq!(
            held.keys().copied().collect::<Vec<_>>(),
            durable,
            "once settled, the engine holds what is durable"
        );
    }
}

fn run(ops: Vec<Op>) {
    let mut world = World::new();
    for op in ops {
        world.step(op);
    }
    world.settle();
    world.step(Op::Crash(0, 0));
    world.settle();
}

/// Cases proptest found once, kept.
#[test]
// Whole because: a list of operations, one a line.
#[allow(clippy::too_many_lines)]
fn regressions() {
    run(vec![
        Op::Park(20),
        Op::Park(20),
        Op::Park(20),
        Op::Write(3),
        Op::Park(20),
        Op::Park(360),
        Op::Answer(2),
        Op::Write(2),
        Op::Park(20),
        Op::Park(20),
        Op::Answer(1),
        Op::Complete(0),
        Op::Complete(0),
        Op::Complete(0),
        Op::Park(20),
        Op::Park(20),
        Op::WriteFails(5, None),
        Op::Answer(2),
        Op::Park(20),
        Op::Park(20),
        Op::Park(326),
        Op::Park(20),
        Op::Park(524),
        Op::Complete(3866),
        Op::WriteFails(4, None),
        Op::Reroute(0),
        Op::Park(321),
        Op::Park(20),
        Op::Write(7),
        Op::Complete(0),
        Op::Park(20),
        Op::Park(337),
        Op::Park(567),
        Op::Park(20),
        Op::Compact,
        Op::Park(20),
        Op::Crash(3, 1077),
        Op::Park(20),
        Op::Complete(453),
        Op::Park(309),
        Op::Crash(3, 448),
        Op::Park(20),
        Op::Crash(1, 71),
        Op::Complete(13785),
        Op::Park(20),
        Op::Complete(2),
        Op::Park(20),
        Op::Complete(34537),
        Op::Park(195),
        Op::WriteFails(4, None),
        Op::Complete(24728),
        Op::Complete(5675),
        Op::Complete(52164),
        Op::Reroute(29528),
        Op::Park(123),
        Op::Crash(7, 41117),
        Op::Reroute(4648),
        Op::Park(211),
        Op::Reroute(43947),
        Op::Complete(29032),
        Op::Park(177),
        Op::Write(7),
        Op::Park(80),
        Op::Park(396),
        Op::Write(3),
        Op::Park(178),
        Op::Park(434),
        Op::Park(234),
        Op::Park(120),
        Op::Crash(4, 45131),
        Op::Complete(41585),
        Op::Complete(11553),
        Op::Complete(64479),
        Op::Write(4),
        Op::Complete(1824),
        Op::WriteFails(1, Some(17727)),
        Op::Compact,
        Op::Crash(7, 58054),
    ]);
}

proptest! {
    #![proptest_config(ProptestConfig {
        // PROPTEST_CASES=20000 for a longer hunt.
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(200),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_store_recovers_exactly_what_is_durable(ops in proptest::collection::vec(op(), 1..250)) {
        run(ops);
    }
}

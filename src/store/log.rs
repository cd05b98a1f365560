//! The hold log: numbered segment files of records, appended by one writer.
//!
//! Changes are staged and take effect in [`Log::commit`], which writes them
//! with one `write` and one `fdatasync` (group commit). See the store
//! module's documentation for the invariants this file keeps; the comments
//! below say which code keeps which.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use tracing::{error, warn};

use super::header::{self, Header};
use super::record::{self, Framing, View};
use super::recover::{self, Recovered, Report};
use super::scan::{Damage, Harm};
use super::segment::{segment_path, Loc, Segment};
use super::{Held, StoreError};

/// Default size at which the head segment is closed and a new one started.
pub const SEGMENT_BYTES: u64 = 64 * 1024 * 1024;
/// A head that holds nothing live is closed early once it is this big, so
/// light traffic does not keep a mostly dead file around.
const EMPTY_HEAD_BYTES: u64 = 1024 * 1024;
/// Free disk space kept beyond the deletes of every held message (block
/// rounding, a new segment's first blocks).
pub(super) const HEADROOM: u64 = 1024 * 1024;
/// The file that holds an id above every id any record has: written ahead
/// of the puts (a block of ids at a time) and before a segment goes. So no
/// id is handed out twice, even once its records are gone, and at a restart
/// new messages can be given ids before the older segments are read.
pub(super) const NEXT_ID: &str = "NEXT_ID";
/// What [`NEXT_ID`] starts with once it is kept ahead of every put. A file
/// without it (written by an older nackd, only when a segment went) bounds
/// nothing: that store is read whole before it takes puts.
const NEXT_ID_AHEAD: &str = "ahead";
/// Ids [`NEXT_ID`] is written ahead by, so that it is written rarely.
const ID_BLOCK: u64 = 1 << 16;

/// How a log is sized.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Above this many bytes on disk, puts are refused (`store.max_bytes`).
    pub max_bytes: Option<u64>,
    /// Size at which a segment is closed (`store.segment_bytes`).
    pub segment_bytes: u64,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            max_bytes: None,
            segment_bytes: SEGMENT_BYTES,
        }
    }
}

/// A live put that compaction copied forward, fsynced. Until the engine
/// adopts the copy (releasing `from`) or discards it (releasing `to`), both
/// stay live and the old segment stays on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Relocation {
    /// Message id.
    pub id: u64,
    /// The record copied.
    pub from: Loc,
    /// The copy.
    pub to: Loc,
}

/// What a staged record does once its commit succeeded.
#[derive(Debug)]
enum Effect {
    /// A put became durable: it is live.
    Live(Loc),
    /// A put superseding `Loc` became durable: the old record is dead.
    Supersede(Loc),
    /// A delete record for `(id, loc)` became durable: the put is dead.
    Delete(u64, Loc),
}

/// A segment file open for reading, with how its records are framed (its
/// salt never leaves the store: it is kept here, with the open file).
pub(super) struct SegmentFile {
    file: File,
    framing: Framing,
}

pub(super) type Files = Arc<RwLock<HashMap<u32, Arc<SegmentFile>>>>;

/// A record's position: segment and offset.
type Pos = (u32, u32);

fn pos(loc: Loc) -> Pos {
    (loc.segment, loc.offset)
}

/// The writer side of the log.
pub struct Log {
    dir: PathBuf,
    options: Options,
    segments: BTreeMap<u32, Segment>,
    files: Files,
    head: u32,
    head_file: File,
    /// Records staged since the last commit, and what they do once durable.
    pending: Vec<u8>,
    effects: Vec<Effect>,
    /// Deletes whose record a failed commit lost: staged again at the next
    /// commit (the engine already forgot the message; the store must not).
    unwritten: Vec<(u64, Loc)>,
    /// Compaction copies not yet adopted or discarded, by position: from →
    /// to, and to → from.
    relocating: HashMap<Pos, Loc>,
    relocated_to: HashMap<Pos, Loc>,
    /// A commit failed in a way that makes the head untrustworthy (its
    /// fsync failed, or it could not be cut back): never append to it again.
    stale_head: bool,
    /// Durable bytes on disk, over every segment.
    total: u64,
    /// Bytes of live puts, and how many.
    live_bytes: u64,
    live_puts: u64,
    /// Free space on the store's file system at the last commit.
    free: u64,
    /// Releases that matched no live put (a bookkeeping bug if non-zero).
    mismatched: u64,
    /// Highest id staged or recovered, and what [`NEXT_ID`] says: a segment
    /// goes only once the file is above every id it may hold.
    max_id: u64,
    next_id_kept: u64,
    /// The first id given after the open: older records must be below it.
    first_new_id: u64,
    /// What recovery found, until the writer counts it in the metrics.
    report: Option<Report>,
    /// Older segments are still being read ([`Log::open_deferred`]): they
    /// are not in `segments` yet, so nothing is reclaimed or compacted
    /// until [`Log::merge`] brings them in.
    recovering: bool,
    /// Bytes of those older segments: until they are read, the deletes of
    /// their live puts are counted as if every record were a put of the
    /// smallest size ([`Log::room_for`]).
    older_bytes: u64,
    #[cfg(test)]
    pub(crate) faults: faults::Faults,
    _lock: File,
}

fn io_err(e: io::Error) -> StoreError {
    StoreError::Io(e.to_string())
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Segment numbers present in `dir`, ascending.
pub fn segment_numbers(dir: &Path) -> io::Result<Vec<u32>> {
    let mut numbers: Vec<u32> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.strip_suffix(".log")?.parse().ok())
        .collect();
    numbers.sort_unstable();
    Ok(numbers)
}

fn lock(dir: &Path) -> io::Result<File> {
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("LOCK"))?;
    lock.try_lock().map_err(|_| {
        io::Error::new(
            io::ErrorKind::WouldBlock,
            format!("{} is in use by another nackd", dir.display()),
        )
    })?;
    Ok(lock)
}

impl Log {
    /// Opens (or creates) the log in `dir`, recovers what it holds, and
    /// starts a fresh head segment: nothing is ever appended to a segment
    /// written before, so a torn tail is never written over. Fails if
    /// another nackd has it open.
    pub fn open(dir: &Path, options: Options) -> io::Result<(Self, Recovered)> {
        let (mut log, mut backlog) = Self::open_deferred(dir, options)?;
        let (mut recovered, segments) = backlog.read()?;
        log.merge(segments);
        recovered.next_id = recovered.next_id.max(log.next_id());
        Ok((log, recovered))
    }

    /// Opens (or creates) the log in `dir` and starts a fresh head segment
    /// at once, leaving the older segments to [`Backlog::read`]: puts and
    /// deletes of new messages (ids from [`Log::next_id`] on) are taken
    /// meanwhile, and [`Log::merge`] brings the older segments in. Records
    /// in the head are newer than any in them, so a crash at any point
    /// recovers the same as if they had been read first.
    ///
    /// Only a torn tail of the newest older segment is dealt with now (cut,
    /// so that the head's predecessor ends where its last record does).
    /// A store whose `NEXT_ID` does not bound every id on disk (written by
    /// an older nackd) is read whole before this returns.
    pub fn open_deferred(dir: &Path, options: Options) -> io::Result<(Self, Backlog)> {
        std::fs::create_dir_all(dir)?;
        let lock = lock(dir)?;
        read_clock_mark(dir)?;
        let mut numbers = segment_numbers(dir)?;
        let torn_tail = match numbers.last() {
            Some(&newest) => recover::cut_torn_tail(dir, newest)?,
            None => None,
        };
        let head = head_number(dir, &mut numbers)?;
        let (kept, ahead) = read_next_id(dir);
        let mut backlog = Backlog {
            dir: dir.to_owned(),
            numbers: numbers.clone(),
            torn_tail,
            read: None,
        };
        let floor = backlog.first_free_id(kept, ahead)?;
        let Older {
            files,
            bytes,
            newest: prev,
        } = open_older(dir, &numbers)?;
        let total = header::LEN as u64 + bytes; // the head's, and theirs
                                                // The head's header says how long the newest older segment is,
                                                // its torn tail cut: it is sealed at that.
        let (head_file, head_framing) = create_segment(dir, head, prev, &files)?;
        let mut log = Self {
            dir: dir.to_owned(),
            options,
            total,
            live_bytes: 0,
            live_puts: 0,
            free: free_bytes(dir),
            segments: BTreeMap::new(),
            files,
            head,
            head_file,
            pending: Vec::new(),
            effects: Vec::new(),
            unwritten: Vec::new(),
            relocating: HashMap::new(),
            relocated_to: HashMap::new(),
            stale_head: false,
            mismatched: 0,
            max_id: floor - 1,
            first_new_id: floor,
            next_id_kept: if ahead { kept } else { 0 },
            report: None,
            recovering: !numbers.is_empty(),
            older_bytes: total,
            #[cfg(test)]
            faults: faults::Faults::default(),
            _lock: lock,
        };
        log.keep_ids_ahead(floor)?;
        log.segments
            .insert(head, Segment::new(header::LEN as u64, head_framing));
        if let Some((_, segments)) = &mut backlog.read {
            log.merge(std::mem::take(segments));
        }
        Ok((log, backlog))
    }

    /// Brings in the older segments a [`Backlog`] read: their records count
    /// from now on (puts live, deletes applied), and reclaiming and
    /// compaction, which need every segment known, start again.
    pub fn merge(&mut self, older: Segments) {
        for (n, segment) in older.0 {
            self.live_bytes += segment.live_bytes();
            self.live_puts += segment.live_count();
            self.segments.insert(n, segment);
        }
        if older.2.is_some() {
            self.report = older.2;
        }
        if older.1 > self.first_new_id && self.max_id >= self.first_new_id {
            // Only a NEXT_ID lowered by hand gets here: kept ahead of
            // every record, it bounds every older id.
            let (from, to) = (self.first_new_id, older.1.min(self.max_id + 1));
            error!(
                file = NEXT_ID, from, to, older_next = older.1,
                "store: NEXT_ID was behind the ids of the older segments; new messages were given ids older records may have (a message of each such pair is lost at the next restart). Ids continue above every record now"
            );
            let damage = Damage {
                segment: 0,
                from,
                to,
                bad: Harm::IdsBehind,
            };
            self.report
                .get_or_insert_with(Report::default)
                .damage
                .push(damage);
        }
        self.max_id = self.max_id.max(older.1.saturating_sub(1));
        self.recovering = false;
        self.older_bytes = 0;
        self.reclaim();
    }

    /// Whether older segments are still to be merged ([`Log::open_deferred`]).
    pub fn recovering(&self) -> bool {
        self.recovering
    }

    /// The first id no record on disk has: new messages may use it and up,
    /// even before the older segments are read.
    pub fn next_id(&self) -> u64 {
        self.max_id + 1
    }

    /// Makes [`NEXT_ID`] say more than `id` before a record with `id` is
    /// written, a block of ids ahead so that it is written rarely.
    fn keep_ids_ahead(&mut self, id: u64) -> io::Result<()> {
        if id < self.next_id_kept {
            return Ok(());
        }
        let next = id + 1 + ID_BLOCK;
        write_next_id(&self.dir, next)?;
        self.next_id_kept = next;
        Ok(())
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How it is sized.
    pub fn options(&self) -> Options {
        self.options
    }

    /// A reader for the records of this log.
    pub fn reader(&self) -> Reader {
        Reader {
            files: self.files.clone(),
        }
    }

    /// Durable bytes on disk.
    pub fn bytes(&self) -> u64 {
        self.total
    }

    /// Bytes of the live puts.
    pub fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    /// What recovery found (damage, a torn tail), once: for the metrics.
    pub fn take_report(&mut self) -> Option<Report> {
        self.report.take()
    }

    /// Segment files on disk.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Releases that matched no live put; 0 unless a caller released twice.
    pub fn mismatched_releases(&self) -> u64 {
        self.mismatched
    }

    /// Free space on the store's file system at the last commit.
    pub fn free_space(&self) -> u64 {
        self.free
    }

    /// Whether staged deletes wait for a commit (one failed before).
    pub fn has_unwritten(&self) -> bool {
        !self.unwritten.is_empty()
    }

    fn head_size(&self) -> u64 {
        self.segments[&self.head].size + self.pending.len() as u64
    }

    /// Stages a put; it is durable, and its location valid, only once
    /// [`Log::commit`] succeeds. `replaces` is the record of the same
    /// message this one supersedes (a re-route): it stays live until then.
    pub fn put(&mut self, held: &Held, replaces: Option<Loc>) -> Result<Loc, StoreError> {
        if record::put_len(held) > record::MAX_BODY {
            return Err(StoreError::Full(format!(
                "a message of {} bytes is larger than a record can be",
                held.size()
            )));
        }
        let body = record::put_body(held);
        let len = record::SALTED_PREFIX + body.len();
        if let Some(max) = self.options.max_bytes {
            if self.total + self.pending.len() as u64 + len as u64 > max {
                return Err(StoreError::Full(format!("store.max_bytes {max} reached")));
            }
        }
        if !self.room_for(len) {
            return Err(StoreError::Io(
                "the disk is full (room is kept for deletes)".into(),
            ));
        }
        self.keep_ids_ahead(held.id).map_err(io_err)?;
        let loc = self.stage(&body)?;
        self.max_id = self.max_id.max(held.id);
        self.effects.push(Effect::Live(loc));
        if let Some(old) = replaces {
            self.effects.push(Effect::Supersede(old));
        }
        Ok(loc)
    }

    /// Whether `bytes` more can be staged and still leave the disk room for
    /// the deletes of everything held: a disk this store fills must still
    /// take them, they are what frees it again. The free space is read at
    /// each commit, and again before saying no.
    /// While older segments wait to be read ([`Log::open_deferred`]) their
    /// live puts are not counted yet: as many as their bytes could hold
    /// are, so that new puts never take the room of their deletes.
    fn room_for(&mut self, bytes: usize) -> bool {
        let older = self.older_bytes / record::MIN_PUT_LEN as u64;
        let puts = self.live_puts + older + self.effects.len() as u64 + 1;
        let deletes = puts * record::DEL_LEN as u64;
        let needed = (self.pending.len() + bytes) as u64 + deletes + HEADROOM;
        if needed > self.free {
            self.read_free();
        }
        needed <= self.free
    }

    /// Whether the free space last read holds the deletes of every held
    /// message and the headroom: what [`Log::put`] keeps free while nackd
    /// is the one filling the disk, and what lets firing go on without the
    /// reserve.
    pub fn deletes_fit(&self) -> bool {
        let older = self.older_bytes / record::MIN_PUT_LEN as u64;
        let deletes = (self.live_puts + older) * record::DEL_LEN as u64;
        self.pending.len() as u64 + deletes + HEADROOM <= self.free
    }

    /// Stages a delete record for the message whose live put is at `loc`.
    /// The put stays live until the delete record is durable; if a commit
    /// loses it, it is staged again at the next one.
    pub fn del(&mut self, id: u64, loc: Loc) {
        if self.stage(&record::del_body(id)).is_ok() {
            self.effects.push(Effect::Delete(id, loc));
        } else {
            self.unwritten.push((id, loc));
        }
    }

    /// Marks a put dead that a durable record of the same message supersedes
    /// (a compaction copy adopted or discarded). Takes effect at once.
    pub fn release(&mut self, loc: Loc) {
        self.release_now(loc);
    }

    /// Appends the record of `body` to the staged bytes of the head,
    /// replacing the head first when it is full or cannot be trusted, and
    /// framed with the head's salt. Rotating only between commits keeps one
    /// commit = one file, one write, one fsync.
    fn stage(&mut self, body: &[u8]) -> Result<Loc, StoreError> {
        if self.pending.is_empty() {
            let full = self.segments[&self.head].size >= self.options.segment_bytes;
            if self.stale_head || full {
                self.rotate()?;
            }
        }
        let offset = self.head_size() as u32;
        let before = self.pending.len();
        let framing = self.segments[&self.head].framing;
        framing.frame_into(&mut self.pending, body);
        Ok(Loc {
            segment: self.head,
            offset,
            len: (self.pending.len() - before) as u32,
        })
    }

    /// Seals the head at its durable size and starts the next segment,
    /// whose header says that size.
    fn rotate(&mut self) -> Result<(), StoreError> {
        let next = self.head + 1;
        let sealed = (self.head, self.segments[&self.head].size);
        let (file, framing) =
            create_segment(&self.dir, next, Some(sealed), &self.files).map_err(io_err)?;
        self.head_file = file;
        self.head = next;
        self.segments
            .insert(next, Segment::new(header::LEN as u64, framing));
        self.total += header::LEN as u64;
        self.stale_head = false;
        Ok(())
    }

    /// Writes and fsyncs everything staged; only then do the staged puts
    /// count as live and the staged deletes take effect. On failure nothing
    /// staged takes effect: the head is cut back to its durable length (no
    /// later record lands behind a hole), puts fail, deletes are written
    /// again at once on their own, or else kept for the next commit.
    pub fn commit(&mut self) -> Result<(), StoreError> {
        let committed = self.write_staged();
        self.read_free();
        committed
    }

    /// Reads the free space on the store's file system again.
    pub(super) fn read_free(&mut self) {
        self.free = free_bytes(&self.dir);
        #[cfg(test)]
        if let Some(free) = self.faults.free_bytes {
            self.free = free;
        }
        #[cfg(test)]
        if let Some(disk) = &self.faults.disk {
            self.free = disk.load(std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn write_staged(&mut self) -> Result<(), StoreError> {
        for (id, loc) in std::mem::take(&mut self.unwritten) {
            self.del(id, loc);
        }
        if self.pending.is_empty() {
            return Ok(());
        }
        match self.write_and_sync() {
            Ok(()) => {
                let n = self.pending.len() as u64;
                self.segments.get_mut(&self.head).expect("head").size += n;
                self.total += n;
                self.pending.clear();
                for effect in std::mem::take(&mut self.effects) {
                    match effect {
                        Effect::Live(loc) => self.add_live(loc),
                        Effect::Supersede(loc) | Effect::Delete(_, loc) => self.release_now(loc),
                    }
                }
                self.rotate_empty_head();
                Ok(())
            }
            Err(e) => {
                let only_deletes = self.effects.iter().all(|e| matches!(e, Effect::Delete(..)));
                self.fail_commit();
                // Deletes free the disk, so they never wait on puts (a
                // full disk refuses every batch that brings puts): they
                // are tried again at once, alone; a few bytes often fit.
                if !only_deletes {
                    let _ = self.write_staged();
                }
                Err(io_err(e))
            }
        }
    }

    fn write_and_sync(&mut self) -> io::Result<()> {
        #[cfg(test)]
        if let Some(e) = self.faults.before_write(&self.head_file, &self.pending) {
            return Err(e);
        }
        self.head_file.write_all(&self.pending)?;
        #[cfg(test)]
        if let Some(e) = self.faults.before_sync() {
            self.stale_head = true; // as after a real fsync error
            return Err(e);
        }
        self.head_file
            .sync_data()
            .inspect_err(|_| self.stale_head = true)
    }

    fn fail_commit(&mut self) {
        let durable = self.segments[&self.head].size;
        let cut = self
            .head_file
            .set_len(durable)
            .and_then(|()| self.head_file.sync_data());
        if let Err(e) = cut {
            error!(segment = self.head, error = %e, "store: cannot cut a failed write back; the segment is closed");
            self.stale_head = true;
        }
        self.pending.clear();
        for effect in std::mem::take(&mut self.effects) {
            if let Effect::Delete(id, loc) = effect {
                self.unwritten.push((id, loc));
            }
        }
    }

    fn add_live(&mut self, loc: Loc) {
        let segment = self
            .segments
            .get_mut(&loc.segment)
            .expect("a put's segment");
        segment.add(loc.offset, loc.len);
        self.live_bytes += u64::from(loc.len);
        self.live_puts += 1;
    }

    fn release_now(&mut self, loc: Loc) {
        if let Some(to) = self.relocating.remove(&pos(loc)) {
            self.relocated_to.remove(&pos(to));
        }
        if let Some(from) = self.relocated_to.remove(&pos(loc)) {
            self.relocating.remove(&pos(from));
        }
        let released = self
            .segments
            .get_mut(&loc.segment)
            .is_some_and(|s| s.release(loc.offset, loc.len));
        if released {
            self.live_bytes -= u64::from(loc.len);
            self.live_puts -= 1;
        } else {
            self.mismatched += 1;
            warn!(?loc, "store: released a record that is not live");
        }
    }

    /// A head with nothing live in it is closed early, so that it can go.
    fn rotate_empty_head(&mut self) {
        let head = &self.segments[&self.head];
        if head.live_count() == 0 && head.size >= EMPTY_HEAD_BYTES.min(self.options.segment_bytes) {
            if let Err(e) = self.rotate() {
                warn!(error = %e, "store: cannot start a new segment");
            }
        }
    }

    /// Makes sure no id below `next` is ever handed out by this store, now
    /// or after a restart (ids another holder used, learnt from a replica).
    pub fn reserve_ids(&mut self, next: u64) -> io::Result<()> {
        self.max_id = self.max_id.max(next.saturating_sub(1));
        if next > self.next_id_kept {
            write_next_id(&self.dir, next)?;
            self.next_id_kept = next;
        }
        Ok(())
    }

    /// Deletes the oldest segments while nothing in them is live; returns
    /// how many went. Only ever the oldest: a segment's delete records can
    /// only cancel puts of the same or older segments, so they are needed
    /// exactly as long as an older segment exists. Each removal is made
    /// durable (directory fsync) before the next, so a crash never brings
    /// back an old segment whose deletes were in a newer one already gone.
    pub fn reclaim(&mut self) -> usize {
        let mut removed = 0;
        if self.recovering {
            return 0; // the older segments are not counted yet
        }
        while let Some((&n, s)) = self.segments.first_key_value() {
            if n == self.head || s.live_count() > 0 {
                break;
            }
            if self.next_id_kept <= self.max_id {
                let next = self.max_id + 1 + ID_BLOCK;
                if let Err(e) = write_next_id(&self.dir, next) {
                    warn!(error = %e, "store: cannot keep the next id; no segment goes");
                    break;
                }
                self.next_id_kept = next;
            }
            self.files.write().expect("lock").remove(&n);
            if let Err(e) = std::fs::remove_file(segment_path(&self.dir, n)) {
                if e.kind() != io::ErrorKind::NotFound {
                    warn!(segment = n, error = %e, "store: cannot delete a segment");
                    break;
                }
            }
            if let Err(e) = sync_dir(&self.dir) {
                warn!(error = %e, "store: cannot sync the store directory");
                break;
            }
            self.total -= s.size;
            self.segments.remove(&n);
            removed += 1;
        }
        removed
    }

    /// Whether disk use is above about twice the live bytes plus one
    /// segment: then the oldest segment's live puts should move forward.
    pub fn wants_compaction(&self) -> bool {
        if self.recovering {
            return false;
        }
        let oldest = self.segments.keys().next().copied();
        oldest.is_some_and(|n| n != self.head)
            && self.total > 2 * self.live_bytes + self.options.segment_bytes
            && self.next_to_copy(usize::MAX).next().is_some()
    }

    fn next_to_copy(&self, limit: usize) -> impl Iterator<Item = u32> + '_ {
        let (&n, oldest) = self.segments.first_key_value().expect("a segment");
        oldest
            .live_offsets()
            .filter(move |o| !self.relocating.contains_key(&(n, *o)))
            .take(limit)
    }

    /// Copies up to `budget` bytes of the oldest segment's live puts to the
    /// head, verbatim, and commits: each copy supersedes its original once
    /// the engine adopts it ([`Relocation`]). A record that no longer reads
    /// back is reported and left alone.
    pub fn compact(&mut self, budget: u64) -> Result<Vec<Relocation>, StoreError> {
        if !self.pending.is_empty() || !self.wants_compaction() {
            return Ok(Vec::new());
        }
        let n = *self.segments.keys().next().expect("a segment");
        let file = self.files.read().expect("lock").get(&n).cloned();
        let Some(file) = file else {
            return Ok(Vec::new());
        };
        let offsets: Vec<u32> = self.next_to_copy(usize::MAX).collect();
        let mut copies = Vec::new();
        let mut copied = 0u64;
        for offset in offsets {
            if copied >= budget {
                break;
            }
            let Some((body, len, id)) = read_record(&file, offset) else {
                error!(
                    segment = n,
                    offset, "store: a held message no longer reads back; compaction leaves it"
                );
                continue;
            };
            if !self.room_for(record::SALTED_PREFIX + body.len()) {
                break;
            }
            // The same body, framed anew with the head's salt.
            let to = self.stage(&body)?;
            let from = Loc {
                segment: n,
                offset,
                len,
            };
            self.effects.push(Effect::Live(to));
            copies.push(Relocation { id, from, to });
            copied += u64::from(to.len);
        }
        self.commit()?;
        for r in &copies {
            self.relocating.insert(pos(r.from), r.to);
            self.relocated_to.insert(pos(r.to), r.from);
        }
        Ok(copies)
    }
}

#[cfg(test)]
impl Log {
    /// A crash in the middle of a write: the first `torn` staged bytes reach
    /// the file, nothing is fsynced, the log is gone. Returns those bytes
    /// after the head's header: a segment [`super::scan`] reads.
    pub(crate) fn crash(mut self, torn: usize) -> Vec<u8> {
        let n = torn.min(self.pending.len());
        self.head_file
            .write_all(&self.pending[..n])
            .expect("test write");
        let head = std::fs::read(segment_path(&self.dir, self.head)).expect("test read");
        [&head[..header::LEN], &self.pending[..n]].concat()
    }

    /// `(segment, offset)` of every live put.
    pub(crate) fn live_positions(&self) -> Vec<(u32, u32)> {
        let mut all: Vec<(u32, u32)> = self
            .segments
            .iter()
            .flat_map(|(n, s)| s.live_offsets().map(move |o| (*n, o)))
            .collect();
        all.sort_unstable();
        all
    }

    /// Whether a commit would write something.
    pub(crate) fn has_staged(&self) -> bool {
        !self.pending.is_empty() || !self.unwritten.is_empty()
    }

    /// Whether compaction copies wait for the engine's answer.
    pub(crate) fn relocations_pending(&self) -> bool {
        !self.relocating.is_empty()
    }
}

/// The body of the whole, good put record at `offset`, the record's
/// length and its message id.
fn read_record(segment: &SegmentFile, offset: u32) -> Option<(Vec<u8>, u32, u64)> {
    let framing = segment.framing;
    let mut prefix = [0u8; record::SALTED_PREFIX];
    let prefix = &mut prefix[..framing.prefix_len()];
    segment.file.read_exact_at(prefix, offset.into()).ok()?;
    let len = framing.prefix_len() + framing.prefix(prefix).ok()?;
    let mut bytes = vec![0u8; len];
    segment.file.read_exact_at(&mut bytes, offset.into()).ok()?;
    match framing.at(&bytes).ok()? {
        (View::Put(p), _) => {
            let id = p.id;
            bytes.drain(..framing.prefix_len());
            Some((bytes, len as u32, id))
        }
        (View::Del(_), _) => None,
    }
}

/// Bytes free for this process on the file system of `dir` (as many as
/// can be if that cannot be known).
#[allow(unsafe_code)]
fn free_bytes(dir: &Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return u64::MAX;
    };
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is NUL-terminated; statvfs fills `stat` when it returns 0.
    if unsafe { libc::statvfs(path.as_ptr(), stat.as_mut_ptr()) } != 0 {
        return u64::MAX;
    }
    // SAFETY: initialised by the successful call above.
    let stat = unsafe { stat.assume_init() };
    stat.f_bavail.saturating_mul(stat.f_frsize)
}

/// What [`NEXT_ID`] says (0 if there is none, or it cannot be read), and
/// whether it is kept ahead of every put ([`NEXT_ID_AHEAD`]).
fn read_next_id(dir: &Path) -> (u64, bool) {
    let read = std::fs::read_to_string(dir.join(NEXT_ID));
    if read
        .as_ref()
        .is_err_and(|e| e.kind() == io::ErrorKind::NotFound)
    {
        return (0, false);
    }
    let text = read.unwrap_or_default();
    let (ahead, number) = match text.trim().strip_prefix(NEXT_ID_AHEAD) {
        Some(rest) => (true, rest.trim()),
        None => (false, text.trim()),
    };
    match number.parse() {
        Ok(n) => (n, ahead),
        Err(_) => {
            warn!(
                file = NEXT_ID,
                "store: unreadable; the whole store is read before new ids are given"
            );
            (0, false)
        }
    }
}

/// Replaces [`NEXT_ID`] with `n`, durably.
fn write_next_id(dir: &Path, n: u64) -> io::Result<()> {
    let tmp = dir.join(format!("{NEXT_ID}.tmp"));
    let mut file = File::create(&tmp)?;
    writeln!(file, "{NEXT_ID_AHEAD} {n}")?;
    file.sync_all()?;
    std::fs::rename(&tmp, dir.join(NEXT_ID))?;
    sync_dir(dir)
}

/// The file that holds the latest time (ms since the epoch, on nackd's
/// [`Clock`](nackd_core::clock::Clock)) at which the store wrote a batch.
/// A restart raises its clock to it: if the wall clock went back meanwhile,
/// every message is held for the time it had left then, never less.
/// Written at most once a second, not fsynced: a lost write leaves an
/// earlier time, which only holds messages longer.
pub const CLOCK: &str = "CLOCK";

/// How far [`CLOCK`] may be ahead of the host's wall clock at startup.
/// Further, it is damaged or was written while the clock was far wrong:
/// nackd would hold every new message that much longer (and fire what is
/// held at once, by its own clock), so it does not start.
pub(super) const CLOCK_AHEAD_MAX: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// What [`CLOCK`] says (none if there is no such file). Checked when the
/// log opens: a file that does not hold a time is an error naming it.
pub fn read_clock_mark(dir: &Path) -> io::Result<Option<u64>> {
    use std::io::Read;
    let file = match File::open(dir.join(CLOCK)) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        other => other?,
    };
    // A time is 20 digits at most: a longer file is not read whole.
    let mut text = Vec::new();
    file.take(64).read_to_end(&mut text)?;
    let ms = std::str::from_utf8(&text)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .ok_or_else(|| clock_error(dir, "does not hold a time (ms since the epoch)"))?;
    Ok(Some(ms))
}

/// Whether [`CLOCK`] is at most [`CLOCK_AHEAD_MAX`] ahead of `now_ms`
/// (nackd's clock at startup): else an error naming it, and the store
/// does not open.
pub fn check_clock_mark(dir: &Path, now_ms: u64) -> io::Result<()> {
    let Some(ms) = read_clock_mark(dir)? else {
        return Ok(());
    };
    let bound = CLOCK_AHEAD_MAX.as_millis() as u64;
    if ms > now_ms.saturating_add(bound) {
        let why = format!(
            "says {ms}, more than {} h ahead of this host's clock ({now_ms})",
            bound / 3_600_000
        );
        return Err(clock_error(dir, &why));
    }
    Ok(())
}

fn clock_error(dir: &Path, why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("store: {}: {why}; if the host's clock is right, delete the file while nackd is stopped (held messages then wait longer, never less)", dir.join(CLOCK).display()),
    )
}

/// Replaces [`CLOCK`] with `ms` (not durably: see there).
pub fn write_clock_mark(dir: &Path, ms: u64) -> io::Result<()> {
    let tmp = dir.join(format!("{CLOCK}.tmp"));
    std::fs::write(&tmp, format!("{ms}\n"))?;
    std::fs::rename(&tmp, dir.join(CLOCK))
}

/// Creates segment `n` after `prev` (its number and sealed length), with
/// its header written and fsynced, then the directory: a segment exists
/// only with its header, else it is a torn one. Returns the file to append
/// to and how its records are framed.
///
/// A file already there is what an attempt that failed part way left (no
/// segment above the head is ever written to): it is emptied first, or the
/// records would go behind its header, which the scan reads, framed with a
/// salt it does not know.
fn create_segment(
    dir: &Path,
    n: u32,
    prev: Option<(u32, u64)>,
    files: &Files,
) -> io::Result<(File, Framing)> {
    let path = segment_path(dir, n);
    let mut file = OpenOptions::new().create(true).append(true).open(&path)?;
    file.set_len(0)?;
    let header = Header::new(n, prev);
    file.write_all(&header.encode())?;
    file.sync_data()?;
    sync_dir(dir)?;
    let framing = header.framing();
    let read = SegmentFile {
        file: File::open(&path)?,
        framing,
    };
    files.write().expect("lock").insert(n, Arc::new(read));
    Ok((file, framing))
}

/// The number of the head at an open, after the older segments `numbers`.
/// A newest segment with nothing in it, not even its header (cut before
/// if torn), is a crash while it was created: the head takes its number
/// (and it leaves `numbers`), so that the head's header says how long the
/// segment before it was sealed, as the lost header did; else a later cut
/// of that segment on a record boundary would go unseen.
fn head_number(dir: &Path, numbers: &mut Vec<u32>) -> io::Result<u32> {
    Ok(match numbers.last() {
        Some(&newest) if std::fs::metadata(segment_path(dir, newest))?.len() == 0 => {
            numbers.pop();
            newest
        }
        Some(&newest) => newest + 1,
        None => 1,
    })
}

/// The older segments at an open, for reading.
struct Older {
    files: Files,
    /// Their bytes in all.
    bytes: u64,
    /// The newest one's number and length.
    newest: Option<(u32, u64)>,
}

/// Opens the older segments `numbers` for reading.
fn open_older(dir: &Path, numbers: &[u32]) -> io::Result<Older> {
    let files: Files = Arc::default();
    let mut total = 0;
    let mut newest = None;
    for &n in numbers {
        let file = File::open(segment_path(dir, n))?;
        let len = file.metadata()?.len();
        total += len;
        newest = Some((n, len));
        let framing = recover::framing(&file, n)?;
        let file = Arc::new(SegmentFile { file, framing });
        files.write().expect("lock").insert(n, file);
    }
    Ok(Older {
        files,
        bytes: total,
        newest,
    })
}

/// The older segments of a [`Log::open_deferred`], to read off the writer's
/// thread (it reads every record of every segment).
#[derive(Debug, Default)]
pub struct Backlog {
    dir: PathBuf,
    numbers: Vec<u32>,
    torn_tail: Option<super::Damage>,
    /// Already read (a store whose ids had no bound is read at the open).
    read: Option<(Recovered, Segments)>,
}

/// The bookkeeping of older segments read by [`Backlog::read`], for
/// [`Log::merge`]: each segment's size and live puts, the first id none
/// of their records has, and what recovery found wrong (for the metrics).
#[derive(Debug, Default)]
pub struct Segments(BTreeMap<u32, Segment>, u64, Option<Report>);

impl Backlog {
    /// Reads the older segments: the messages they hold, for the engine,
    /// and their bookkeeping, for [`Log::merge`]. After an error it can be
    /// called again (nothing is merged, nothing reclaimed meanwhile).
    pub fn read(&mut self) -> io::Result<(Recovered, Segments)> {
        if let Some((recovered, _)) = self.read.take() {
            // Merged at the open already.
            return Ok((recovered, Segments::default()));
        }
        self.read_now()
    }

    /// The first id new puts may take: past `kept` (the store's
    /// `NEXT_ID`), and, when that does not bound the ids on disk (`!ahead`,
    /// a store written by an older nackd), past every id of the older
    /// segments, which are then read now.
    fn first_free_id(&mut self, kept: u64, ahead: bool) -> io::Result<u64> {
        let mut floor = kept.max(1);
        if !ahead && !self.numbers.is_empty() {
            let (recovered, segments) = self.read_now()?;
            floor = floor.max(recovered.next_id);
            self.read = Some((recovered, segments));
        }
        Ok(floor)
    }

    fn read_now(&self) -> io::Result<(Recovered, Segments)> {
        let (mut recovered, segments) = recover::read(&self.dir, &self.numbers)?;
        recovered.torn_tail = self.torn_tail.clone();
        let next_id = recovered.next_id;
        let report = Some(recovered.report());
        Ok((recovered, Segments(segments, next_id, report)))
    }

    /// What a crash during a write left at the end of the newest older
    /// segment, cut off at the open.
    pub fn torn_tail(&self) -> Option<&super::Damage> {
        self.torn_tail.as_ref()
    }

    /// Whether there is anything to read.
    pub fn is_empty(&self) -> bool {
        self.numbers.is_empty() || self.read.is_some()
    }
}

/// Reads records by location; cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct Reader {
    files: Files,
}

impl Reader {
    /// The message whose put record is at `loc`.
    pub fn read(&self, loc: Loc) -> Result<Held, StoreError> {
        let file = self
            .files
            .read()
            .expect("lock")
            .get(&loc.segment)
            .cloned()
            .ok_or_else(|| StoreError::Io(format!("segment {} is gone", loc.segment)))?;
        let mut buf = vec![0u8; loc.len as usize];
        file.file
            .read_exact_at(&mut buf, loc.offset as u64)
            .map_err(io_err)?;
        match file.framing.at(&buf) {
            Ok((View::Put(p), len)) if len == buf.len() => Ok(p.to_held()),
            Ok(_) | Err(_) => Err(StoreError::Io(format!("no put record at {loc:?}"))),
        }
    }
}

#[cfg(test)]
pub(crate) mod faults;
#[cfg(test)]
mod tests;

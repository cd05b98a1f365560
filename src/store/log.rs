//! The hold log: numbered segment files of CRC'd records, appended by one
//! writer thread that shares one fsync among every put of a batch (group
//! commit). A segment is deleted as soon as none of its messages is held.
//!
//! Recovery reads the segments in order; a torn or corrupt record at the
//! tail is logged and cut off, never a reason not to start.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use tracing::{info, warn};

use super::record::{self, Bad, Record};
use super::{Held, StoreError};

/// A segment is closed once it holds this many bytes.
pub const SEGMENT_BYTES: u64 = 64 * 1024 * 1024;

/// Where a record sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loc {
    /// Segment number.
    pub segment: u32,
    /// Offset of the record (prefix included) in the segment.
    pub offset: u32,
    /// Length of the record, prefix included.
    pub len: u32,
}

/// What recovery keeps of a held message besides its id, due time and place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldMeta {
    /// Index into [`Recovered::queues`].
    pub queue: u32,
    /// Header + body bytes.
    pub size: u32,
    /// Retry number in its headers.
    pub retry: u32,
    /// It goes to an exchange (`on_exhausted`), not back to its queue.
    pub dead_letter: bool,
}

/// What recovery found.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Held messages: id, due time, location; in due order.
    pub held: Vec<(u64, u64, Loc)>,
    /// Per held message, in the same order: queue, size, retry, route.
    pub meta: Vec<HeldMeta>,
    /// `(vhost, queue)` of the held messages, each once.
    pub queues: Vec<(Arc<str>, Arc<str>)>,
    /// First id not used yet.
    pub next_id: u64,
    /// Records cut off as torn or corrupt.
    pub damaged: usize,
}

struct Segment {
    size: u64,
    live: u64,
}

type Files = Arc<RwLock<HashMap<u32, Arc<File>>>>;

/// The writer side of the log.
pub struct Log {
    dir: PathBuf,
    segments: BTreeMap<u32, Segment>,
    files: Files,
    head: u32,
    head_file: File,
    pending: Vec<u8>,
    max_bytes: Option<u64>,
    total: u64,
    _lock: File,
}

fn io_err(e: io::Error) -> StoreError {
    StoreError::Io(e.to_string())
}

fn segment_path(dir: &Path, n: u32) -> PathBuf {
    dir.join(format!("{n:010}.log"))
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

/// Reads every record of one segment; returns the offset where good data
/// ends and whether something bad was found there.
pub fn scan(bytes: &[u8], mut each: impl FnMut(Record, Loc), segment: u32) -> (usize, Option<Bad>) {
    let mut at = 0;
    while at < bytes.len() {
        let (len, crc) = match record::prefix(&bytes[at..]) {
            Ok(p) => p,
            Err(bad) => return (at, Some(bad)),
        };
        let end = at + record::PREFIX + len;
        if end > bytes.len() {
            return (at, Some(Bad::Torn));
        }
        match record::decode(&bytes[at + record::PREFIX..end], crc) {
            Ok(rec) => each(
                rec,
                Loc {
                    segment,
                    offset: at as u32,
                    len: (end - at) as u32,
                },
            ),
            Err(bad) => return (at, Some(bad)),
        }
        at = end;
    }
    (at, None)
}

impl Log {
    /// Opens (or creates) the log in `dir`, recovers what it holds, and
    /// starts a fresh head segment. Fails if another nackd has it open.
    pub fn open(dir: &Path, max_bytes: Option<u64>) -> io::Result<(Self, Recovered)> {
        std::fs::create_dir_all(dir)?;
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
        let mut index: HashMap<u64, (u64, Loc, HeldMeta)> = HashMap::new();
        let mut queues: HashMap<(Arc<str>, Arc<str>), u32> = HashMap::new();
        let mut segments = BTreeMap::new();
        let mut recovered = Recovered {
            next_id: 1,
            ..Recovered::default()
        };
        let numbers = segment_numbers(dir)?;
        for (i, &n) in numbers.iter().enumerate() {
            let path = segment_path(dir, n);
            let bytes = std::fs::read(&path)?;
            let (good, bad) = scan(
                &bytes,
                |rec, loc| match rec {
                    Record::Put(h) => {
                        recovered.next_id = recovered.next_id.max(h.id + 1);
                        let next = queues.len() as u32;
                        let queue = *queues
                            .entry((h.vhost.clone(), h.queue.clone()))
                            .or_insert(next);
                        let (size, retry, dead_letter) =
                            (h.size() as u32, h.retry, h.route != super::Route::Queue);
                        index.insert(
                            h.id,
                            (
                                h.due_ms,
                                loc,
                                HeldMeta {
                                    queue,
                                    size,
                                    retry,
                                    dead_letter,
                                },
                            ),
                        );
                    }
                    Record::Del(id) => {
                        index.remove(&id);
                    }
                },
                n,
            );
            if let Some(bad) = bad {
                recovered.damaged += 1;
                warn!(segment = %path.display(), offset = good, ?bad, last = i + 1 == numbers.len(), "store: damaged record; keeping everything before it");
                let file = OpenOptions::new().write(true).open(&path)?;
                file.set_len(good as u64)?;
                file.sync_all()?;
            }
            segments.insert(
                n,
                Segment {
                    size: good as u64,
                    live: 0,
                },
            );
        }
        for (_, loc, _) in index.values() {
            if let Some(s) = segments.get_mut(&loc.segment) {
                s.live += 1;
            }
        }
        let files: Files = Arc::default();
        for (&n, _) in segments.iter() {
            files
                .write()
                .expect("lock")
                .insert(n, Arc::new(File::open(segment_path(dir, n))?));
        }
        let head = numbers.last().map_or(1, |n| n + 1);
        let head_file = Self::create_segment(dir, head, &files)?;
        segments.insert(head, Segment { size: 0, live: 0 });
        let total = segments.values().map(|s| s.size).sum();
        let mut log = Self {
            dir: dir.to_owned(),
            segments,
            files,
            head,
            head_file,
            pending: Vec::new(),
            max_bytes,
            total,
            _lock: lock,
        };
        for n in log
            .segments
            .iter()
            .filter(|(n, s)| **n != head && s.live == 0)
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
        {
            log.drop_segment(n);
        }
        let mut held: Vec<_> = index.into_iter().collect();
        held.sort_unstable_by_key(|(id, (due, _, _))| (*due, *id));
        (recovered.held, recovered.meta) = held
            .into_iter()
            .map(|(id, (due, loc, meta))| ((id, due, loc), meta))
            .unzip();
        recovered.queues = vec![(Arc::from(""), Arc::from("")); queues.len()];
        for (key, i) in queues {
            recovered.queues[i as usize] = key;
        }
        info!(dir = %dir.display(), held = recovered.held.len(), segments = log.segments.len(), damaged = recovered.damaged, "store recovered");
        Ok((log, recovered))
    }

    fn create_segment(dir: &Path, n: u32, files: &Files) -> io::Result<File> {
        let path = segment_path(dir, n);
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        sync_dir(dir)?;
        files
            .write()
            .expect("lock")
            .insert(n, Arc::new(File::open(&path)?));
        Ok(file)
    }

    /// A reader for the records of this log.
    pub fn reader(&self) -> Reader {
        Reader {
            files: self.files.clone(),
        }
    }

    /// Bytes on disk.
    pub fn bytes(&self) -> u64 {
        self.total
    }

    fn head_size(&self) -> u64 {
        self.segments[&self.head].size + self.pending.len() as u64
    }

    /// Appends a put; durable only after [`Log::sync`]. `replaces` is the
    /// record of the same message this one supersedes.
    pub fn put(&mut self, held: &Held, replaces: Option<Loc>) -> Result<Loc, StoreError> {
        let rec = record::encode_put(held);
        if let Some(max) = self.max_bytes {
            if self.total + self.pending.len() as u64 + rec.len() as u64 > max {
                return Err(StoreError::Full(format!("store.max_bytes {max} reached")));
            }
        }
        if self.head_size() + rec.len() as u64 > SEGMENT_BYTES && self.head_size() > 0 {
            self.rotate()?;
        }
        let loc = Loc {
            segment: self.head,
            offset: self.head_size() as u32,
            len: rec.len() as u32,
        };
        self.pending.extend_from_slice(&rec);
        self.segments.get_mut(&self.head).expect("head exists").live += 1;
        if let Some(old) = replaces {
            self.release(old.segment);
        }
        Ok(loc)
    }

    /// Appends a delete for the message whose put is at `loc`.
    pub fn del(&mut self, id: u64, loc: Loc) {
        self.pending.extend_from_slice(&record::encode_del(id));
        self.release(loc.segment);
    }

    fn release(&mut self, segment: u32) {
        let Some(s) = self.segments.get_mut(&segment) else {
            return;
        };
        s.live = s.live.saturating_sub(1);
        if s.live == 0 && segment != self.head {
            self.drop_segment(segment);
        }
    }

    fn drop_segment(&mut self, n: u32) {
        if let Some(s) = self.segments.remove(&n) {
            self.total -= s.size;
        }
        self.files.write().expect("lock").remove(&n);
        if let Err(e) = std::fs::remove_file(segment_path(&self.dir, n)) {
            warn!(segment = n, error = %e, "store: cannot delete an empty segment");
        }
    }

    fn rotate(&mut self) -> Result<(), StoreError> {
        self.sync()?;
        let next = self.head + 1;
        self.head_file = Self::create_segment(&self.dir, next, &self.files).map_err(io_err)?;
        self.head = next;
        self.segments.insert(next, Segment { size: 0, live: 0 });
        Ok(())
    }

    /// Writes what is buffered (no fsync). On error the head is cut back to
    /// its last good length, so a half-written record never stays.
    pub fn flush(&mut self) -> Result<(), StoreError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let head = self.segments.get_mut(&self.head).expect("head exists");
        match self.head_file.write_all(&self.pending) {
            Ok(()) => {
                head.size += self.pending.len() as u64;
                self.total += self.pending.len() as u64;
                self.pending.clear();
                Ok(())
            }
            Err(e) => {
                self.pending.clear();
                let _ = self.head_file.set_len(head.size);
                Err(io_err(e))
            }
        }
    }

    /// Writes and fsyncs what is buffered.
    pub fn sync(&mut self) -> Result<(), StoreError> {
        self.flush()?;
        self.head_file.sync_data().map_err(io_err)
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
        file.read_exact_at(&mut buf, loc.offset as u64)
            .map_err(io_err)?;
        let (_, crc) = record::prefix(&buf)
            .map_err(|b| StoreError::Io(format!("record at {loc:?}: {b:?}")))?;
        match record::decode(&buf[record::PREFIX..], crc) {
            Ok(Record::Put(h)) => Ok(h),
            Ok(Record::Del(_)) | Err(_) => Err(StoreError::Io(format!("no put record at {loc:?}"))),
        }
    }
}

#[cfg(test)]
mod tests;

//! Recovery: reads every segment in order and rebuilds the set of held
//! messages, each with its latest put, minus those a delete record cancels.
//!
//! The one change made on disk: a torn tail at the end of the newest
//! segment, which is what a crash during a write leaves (a record that runs
//! past the end of the file: nothing in it was answered), is cut off and
//! logged. Anything else that does not read back is damage: skipped record
//! by record, every range logged with its file, offsets and what it costs,
//! and returned so that it is counted: acked messages may be in it, and an
//! operator must hear about it. That includes a bad last record that is no
//! torn write, a sealed segment shorter or longer than its successor's
//! header says, and a segment missing from the numbering.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use tracing::{error, info, warn};

use super::header::{self, Format};
use super::record::{Framing, View};
use super::scan::{self, Damage, Harm};
use super::segment::segment_path;
use super::segment::{Loc, Segment};
use super::{HeldMeta, Route};

/// What recovery found.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Held messages: id, due time, location; in due order.
    pub held: Vec<(u64, u64, Loc)>,
    /// Per held message, in the same order.
    pub meta: Vec<HeldMeta>,
    /// `(vhost, queue)` of the held messages, each once ([`HeldMeta::queue`] indexes it).
    pub queues: Vec<(Arc<str>, Arc<str>)>,
    /// First id not used yet.
    pub next_id: u64,
    /// Ranges skipped because they did not read back (the torn tail excluded).
    pub damage: Vec<Damage>,
    /// What a crash during a write left at the end of the newest segment.
    pub torn_tail: Option<Damage>,
}

impl Recovered {
    /// Bytes skipped as damaged (the torn tail excluded).
    pub fn damaged_bytes(&self) -> u64 {
        self.report().damaged_bytes()
    }

    /// What it found wrong, for the metrics and the status page.
    pub fn report(&self) -> Report {
        Report {
            damage: self.damage.clone(),
            torn_tail: self.torn_tail.clone(),
        }
    }
}

/// What recovery found wrong: damage, and the torn tail it cut.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Ranges that did not read back (the torn tail excluded).
    pub damage: Vec<Damage>,
    /// What a crash during a write left at the end of the newest segment.
    pub torn_tail: Option<Damage>,
}

impl Report {
    /// Bytes skipped as damaged.
    pub fn damaged_bytes(&self) -> u64 {
        self.damage
            .iter()
            .filter(|d| d.bad != Harm::IdsBehind)
            .map(|d| d.to.saturating_sub(d.from))
            .sum()
    }

    /// Bytes of the torn tail cut.
    pub fn torn_bytes(&self) -> u64 {
        self.torn_tail.as_ref().map_or(0, |t| t.to - t.from)
    }
}

/// Cuts segment `n` to `len` bytes, durably: once the log continues in a
/// newer segment, a torn tail left here would read as damage.
fn cut(dir: &Path, n: u32, len: u64) -> io::Result<()> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(segment_path(dir, n))?;
    file.set_len(len)?;
    file.sync_all()
}

/// Cuts the torn tail off segment `n` of `dir` (the newest, the one a
/// crash may have been writing), durably; returns what was cut. Only a
/// last record that runs past the end of the file is a torn tail: any
/// other bad last record, and damage before it, is left for [`read`] to
/// report.
pub(super) fn cut_torn_tail(dir: &Path, n: u32) -> io::Result<Option<Damage>> {
    let file = segment_path(dir, n);
    let bytes = std::fs::read(&file)?;
    let size = bytes.len() as u64;
    let damage = scan::scan(&bytes, n, |_, _| {});
    let torn = damage.into_iter().last();
    let Some(torn) = torn.filter(|d| d.bad == Harm::Torn && d.to == size) else {
        return Ok(None);
    };
    warn!(file = %file.display(), from = torn.from, to = torn.to, "store: torn write at the end of the newest segment (a crash during a write; nothing in it was answered): cut off");
    cut(dir, n, torn.from)?;
    Ok(Some(torn))
}

/// Builds the held set from segments `numbers` of `dir` (ascending, each
/// with its torn tail already cut), with each segment's bookkeeping
/// (size, live puts).
pub(super) fn read(dir: &Path, numbers: &[u32]) -> io::Result<(Recovered, BTreeMap<u32, Segment>)> {
    let mut replay = Replay {
        index: HashMap::new(),
        queues: HashMap::new(),
        next_id: 1,
    };
    let mut segments = BTreeMap::new();
    let mut recovered = Recovered::default();
    // The segment after the last (the head a deferred open created) says
    // how long the last was sealed at.
    let mut known = numbers.to_vec();
    if let Some(&last) = numbers.last() {
        if segment_path(dir, last + 1).exists() {
            known.push(last + 1);
        }
    }
    let formats = formats(dir, &known)?;
    let sealed = scan::sealed_lengths(&formats);
    let mut damage = Vec::new();
    for &n in numbers {
        let bytes = std::fs::read(segment_path(dir, n))?;
        let sealed = sealed.get(&n).copied();
        let scanned = scan::scan_sealed(&bytes, n, sealed, |rec, loc| replay.record(rec, loc));
        let framing = scanned.framing();
        log_damage(dir, &scanned.damage);
        damage.extend(scanned.damage);
        segments.insert(n, Segment::new(bytes.len() as u64, framing));
    }
    // After the scan: whether a gap is damage depends on whether the
    // segment after it reads from its start.
    let gaps = scan::gaps(numbers, &formats, &damage);
    log_damage(dir, &gaps);
    recovered.damage = gaps;
    recovered.damage.extend(damage);
    replay.warn_resurrected(&recovered.damage);
    replay.finish(&mut recovered, &mut segments);
    info!(dir = %dir.display(), held = recovered.held.len(), segments = segments.len(), damaged_bytes = recovered.damaged_bytes(), "store recovered");
    Ok((recovered, segments))
}

/// The format each segment's header announces, by number; none for a
/// segment whose header does not check (a gap before it is counted as
/// lost: [`scan::gaps`]). Fails on a segment a newer nackd wrote: reading
/// it as damage would lose it.
fn formats(dir: &Path, numbers: &[u32]) -> io::Result<BTreeMap<u32, Format>> {
    let mut formats = BTreeMap::new();
    for &n in numbers {
        let file = std::fs::File::open(segment_path(dir, n))?;
        if let Some(format) = format_of(&file, n)? {
            formats.insert(n, format);
        }
    }
    Ok(formats)
}

/// What segment `n`'s header (in `file`) announces; `None` if it does
/// not check (the scan reports that). Fails on a segment a newer nackd
/// wrote: reading it as damage would lose it.
fn format_of(file: &std::fs::File, n: u32) -> io::Result<Option<Format>> {
    let mut head = Vec::with_capacity(header::LEN);
    file.take(header::LEN as u64).read_to_end(&mut head)?;
    match header::format(&head) {
        Ok(Format::Newer(v)) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("segment {n} is in format {v}, newer than this nackd reads"),
        )),
        Ok(f) => Ok(Some(f)),
        Err(_) => Ok(None),
    }
}

/// How segment `n`'s records (in `file`) are framed: keyed by its salt,
/// or format 1 (also when its header does not check: none of its records
/// is read then).
pub(super) fn framing(file: &std::fs::File, n: u32) -> io::Result<Framing> {
    Ok(match format_of(file, n)? {
        Some(Format::Salted(h)) => h.framing(),
        _ => Framing::Plain,
    })
}

/// Logs each damaged range with its file, offsets and what it costs.
fn log_damage(dir: &Path, damage: &[Damage]) {
    for d in damage {
        let file = segment_path(dir, d.segment);
        error!(file = %file.display(), from = d.from, to = d.to, what = ?d.bad, "store: DAMAGE: {}", d.bad.cost());
    }
}

/// The records read so far, replayed in order.
struct Replay {
    /// Each held message's latest put: due time, location, metadata.
    index: HashMap<u64, (u64, Loc, HeldMeta)>,
    /// Each `(vhost, queue)` seen, numbered in order of appearance.
    queues: HashMap<(Arc<str>, Arc<str>), u32>,
    /// First id not used yet.
    next_id: u64,
}

impl Replay {
    /// One record: a put holds (or moves) its message, a delete drops it.
    fn record(&mut self, rec: View<'_>, loc: Loc) {
        match rec {
            View::Put(p) => {
                self.next_id = self.next_id.max(p.id + 1);
                let next = self.queues.len() as u32;
                let key = (Arc::from(p.vhost), Arc::from(p.queue));
                let queue = *self.queues.entry(key).or_insert(next);
                let meta = HeldMeta {
                    queue,
                    size: p.size() as u32,
                    retry: p.retry.try_into().unwrap_or(u16::MAX),
                    dead_letter: p.route != Route::Queue,
                    delayed: p.route.is_delayed(),
                };
                self.index.insert(p.id, (p.due_ms, loc, meta));
            }
            View::Del(id) => {
                self.next_id = self.next_id.max(id + 1);
                self.index.remove(&id);
            }
        }
    }

    /// Says which held messages are held again because their delete record
    /// is damaged: they may be republished once more.
    fn warn_resurrected(&self, damage: &[Damage]) {
        for d in damage {
            if let Harm::Delete(id) = d.bad {
                if self.index.contains_key(&id) {
                    warn!(id, segment = d.segment, from = d.from, "store: held again, its delete record is damaged: it may be republished once more");
                }
            }
        }
    }

    /// Counts the live puts in their segments and fills `recovered`: held
    /// messages in due order, their queues, the next id.
    fn finish(self, recovered: &mut Recovered, segments: &mut BTreeMap<u32, Segment>) {
        let mut held: Vec<_> = self.index.into_iter().collect();
        // Each segment's live puts go in ascending offset order.
        held.sort_unstable_by_key(|(_, (_, loc, _))| (loc.segment, loc.offset));
        for (_, (_, loc, _)) in &held {
            if let Some(s) = segments.get_mut(&loc.segment) {
                s.add(loc.offset, loc.len);
            }
        }
        held.sort_unstable_by_key(|(id, (due, _, _))| (*due, *id));
        (recovered.held, recovered.meta) = held
            .into_iter()
            .map(|(id, (due, loc, meta))| ((id, due, loc), meta))
            .unzip();
        recovered.queues = vec![(Arc::from(""), Arc::from("")); self.queues.len()];
        for (key, i) in self.queues {
            recovered.queues[i as usize] = key;
        }
        recovered.next_id = self.next_id;
    }
}

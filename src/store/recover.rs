//! Recovery: reads every segment in order and rebuilds the set of held
//! messages, each with its latest put, minus those a delete record cancels.
//!
//! The one change made on disk: a torn tail at the end of the newest
//! segment, which is what a crash during a write leaves (nothing in it was
//! answered), is cut off and logged. Damage anywhere else is skipped record by record, every range logged
//! with its offsets and returned so that it is counted: acked messages may
//! be in it, and an operator must hear about it.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::Path;
use std::sync::Arc;

use tracing::{error, info, warn};

use super::log::segment_path;
use super::record::View;
use super::scan::{scan, Damage};
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
        self.damage.iter().map(|d| d.to - d.from).sum()
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
/// crash may have been writing), durably; returns what was cut. Only an
/// unfinished last record is a torn tail: damage before it is left for
/// [`read`] to report.
pub(super) fn cut_torn_tail(dir: &Path, n: u32) -> io::Result<Option<Damage>> {
    let bytes = std::fs::read(segment_path(dir, n))?;
    let size = bytes.len() as u64;
    let damage = scan(&bytes, n, |_, _| {});
    let Some(torn) = damage.into_iter().last().filter(|d| d.to == size) else {
        return Ok(None);
    };
    warn!(segment = n, from = torn.from, to = torn.to, "store: torn write at the end of the newest segment (a crash during a write; nothing in it was answered): cut off");
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
    for &n in numbers {
        let bytes = std::fs::read(segment_path(dir, n))?;
        let damage = scan(&bytes, n, |rec, loc| replay.record(rec, loc));
        report_damage(n, &damage);
        recovered.damage.extend(damage);
        segments.insert(n, Segment::new(bytes.len() as u64));
    }
    replay.finish(&mut recovered, &mut segments);
    info!(dir = %dir.display(), held = recovered.held.len(), segments = segments.len(), damaged_bytes = recovered.damaged_bytes(), "store recovered");
    Ok((recovered, segments))
}

/// Logs the damage `scan` found in segment `n`.
fn report_damage(n: u32, damage: &[Damage]) {
    for d in damage {
        error!(segment = n, from = d.from, to = d.to, bad = ?d.bad, "store: DAMAGED bytes skipped; held messages in them are lost");
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
                    retry: p.retry,
                    dead_letter: p.route != Route::Queue,
                };
                self.index.insert(p.id, (p.due_ms, loc, meta));
            }
            View::Del(id) => {
                self.next_id = self.next_id.max(id + 1);
                self.index.remove(&id);
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

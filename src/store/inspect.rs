//! Operator commands on a store directory: `nackd store stats|list|purge`.
//! `stats` and `list` only read (they work next to a running nackd);
//! `purge` takes the store's lock, so it needs nackd stopped.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::io;
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use super::log::{segment_numbers, Log, Options};
use super::record::View;
use super::scan::scan;
use super::segment::segment_path;
use super::Held;

/// Every held message, read without taking the lock, in due order. A
/// running nackd may compact meanwhile: its copies land in newer segments,
/// which are read too (the latest put of an id wins, as in recovery).
pub fn held(dir: &Path) -> io::Result<Vec<Held>> {
    let mut live: HashMap<u64, Held> = HashMap::new();
    let mut next = 0;
    while let Some(n) = segment_numbers(dir)?.into_iter().find(|n| *n >= next) {
        next = n + 1;
        let bytes = match std::fs::read(segment_path(dir, n)) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue, // deleted meanwhile
            Err(e) => return Err(e),
        };
        scan(&bytes, n, |rec, _| match rec {
            View::Put(p) => {
                live.insert(p.id, p.to_held());
            }
            View::Del(id) => {
                live.remove(&id);
            }
        });
    }
    let mut held: Vec<Held> = live.into_values().collect();
    held.sort_by_key(|h| (h.due_ms, h.id));
    Ok(held)
}

/// A due time (ms since the epoch) as RFC 3339; one past the year 9999
/// (an `x-delay` is the publisher's number) as its milliseconds, since
/// humantime cannot write it (its `to_string` would panic).
pub fn when(ms: u64) -> String {
    let at = humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms));
    let mut text = String::new();
    match write!(text, "{at}") {
        Ok(()) => text,
        Err(_) => format!("{ms} ms after the epoch"),
    }
}

/// `nackd store stats`: totals and per-queue counts.
pub fn stats(dir: &Path) -> io::Result<String> {
    let held = held(dir)?;
    let mut per_queue: BTreeMap<(String, String), (usize, usize)> = BTreeMap::new();
    for h in &held {
        let e = per_queue
            .entry((h.vhost.to_string(), h.queue.to_string()))
            .or_default();
        e.0 += 1;
        e.1 += h.size();
    }
    let disk: u64 = segment_numbers(dir)?
        .iter()
        .filter_map(|n| std::fs::metadata(segment_path(dir, *n)).ok())
        .map(|m| m.len())
        .sum();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "held {}  bytes {}  on disk {}",
        held.len(),
        held.iter().map(Held::size).sum::<usize>(),
        disk
    );
    if let (Some(first), Some(last)) = (held.first(), held.last()) {
        let _ = writeln!(
            out,
            "next due {}  last due {}",
            when(first.due_ms),
            when(last.due_ms)
        );
    }
    for ((vhost, queue), (count, bytes)) in per_queue {
        let _ = writeln!(
            out,
            "vhost {vhost:?} queue {queue:?}: {count} held, {bytes} bytes"
        );
    }
    Ok(out)
}

/// `nackd store list [--queue Q]`: one line per held message.
pub fn list(dir: &Path, queue: Option<&str>) -> io::Result<String> {
    let mut out = String::new();
    for h in held(dir)?
        .iter()
        .filter(|h| queue.is_none_or(|q| &*h.queue == q))
    {
        let headers = nackd_core::protocol::content::decode_header(&h.header)
            .ok()
            .and_then(|c| c.properties.headers().clone())
            .map(|t| format!("{:?}", t.inner()))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "id {} vhost {:?} queue {:?} due {} retry {} size {} route {:?} headers {}",
            h.id,
            &*h.vhost,
            &*h.queue,
            when(h.due_ms),
            h.retry,
            h.size(),
            h.route,
            headers
        );
    }
    Ok(out)
}

/// `nackd store purge --queue Q`: forgets every held message of `queue`.
pub fn purge(dir: &Path, queue: &str) -> io::Result<usize> {
    let (mut log, recovered) = Log::open(dir, Options::default())?;
    let reader = log.reader();
    let mut purged = 0;
    for (id, _, loc) in recovered.held {
        if reader.read(loc).is_ok_and(|h| &*h.queue == queue) {
            log.del(id, loc);
            purged += 1;
        }
    }
    log.commit().map_err(|e| io::Error::other(e.to_string()))?;
    Ok(purged)
}

#[cfg(test)]
mod when_tests {
    #[test]
    fn a_due_time_past_the_year_9999_is_written_too() {
        assert_eq!(super::when(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            super::when(u64::MAX),
            format!("{} ms after the epoch", u64::MAX)
        );
    }
}

//! One segment file's bookkeeping: how many of its bytes are durable, how
//! its records are framed, and which of its put records are still live.
//!
//! Live puts are kept as a sorted list of record offsets plus a bit each,
//! about 4 bytes per put record in the file: a store of millions of held
//! messages keeps its whole liveness map in a few bytes per message.

use std::path::{Path, PathBuf};

use super::record::Framing;

/// Where a record sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Loc {
    /// Segment number.
    pub segment: u32,
    /// Offset of the record (prefix included) in the segment.
    pub offset: u32,
    /// Length of the record, prefix included.
    pub len: u32,
}

/// A segment's size, framing and live puts.
#[derive(Debug)]
pub(super) struct Segment {
    /// Bytes of the file (durable ones; a torn tail found at recovery counts too).
    pub size: u64,
    /// How its records are framed (format 2: keyed by its header's salt).
    pub framing: Framing,
    /// Offsets of put records that were live once, ascending.
    offsets: Vec<u32>,
    /// Bit `i` set: the put at `offsets[i]` is live.
    live: Vec<u64>,
    live_count: u64,
    live_bytes: u64,
}

impl Segment {
    /// A segment of `size` bytes with nothing live.
    pub(super) fn new(size: u64, framing: Framing) -> Self {
        Self {
            size,
            framing,
            offsets: Vec::new(),
            live: Vec::new(),
            live_count: 0,
            live_bytes: 0,
        }
    }

    /// Marks the put at `offset` (of `len` bytes) live. Offsets must come in
    /// ascending order (appends do; recovery sorts first).
    pub(super) fn add(&mut self, offset: u32, len: u32) {
        debug_assert!(self.offsets.last().is_none_or(|last| *last < offset));
        let i = self.offsets.len();
        self.offsets.push(offset);
        if i / 64 >= self.live.len() {
            self.live.push(0);
        }
        self.live[i / 64] |= 1 << (i % 64);
        self.live_count += 1;
        self.live_bytes += u64::from(len);
    }

    /// Marks the put at `offset` dead; `false` if it was not live (a
    /// release that does not match anything: the caller's bug, reported).
    pub(super) fn release(&mut self, offset: u32, len: u32) -> bool {
        let Ok(i) = self.offsets.binary_search(&offset) else {
            return false;
        };
        let (word, bit) = (i / 64, 1u64 << (i % 64));
        if self.live[word] & bit == 0 {
            return false;
        }
        self.live[word] &= !bit;
        self.live_count -= 1;
        self.live_bytes -= u64::from(len);
        true
    }

    /// Whether the put at `offset` is live.
    #[cfg(test)]
    pub(super) fn is_live(&self, offset: u32) -> bool {
        self.offsets
            .binary_search(&offset)
            .is_ok_and(|i| self.live[i / 64] & (1 << (i % 64)) != 0)
    }

    /// Live puts.
    pub(super) fn live_count(&self) -> u64 {
        self.live_count
    }

    /// Bytes of live puts.
    pub(super) fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    /// Offsets of the live puts, ascending.
    pub(super) fn live_offsets(&self) -> impl Iterator<Item = u32> + '_ {
        self.offsets
            .iter()
            .enumerate()
            .filter(|(i, _)| self.live[i / 64] & (1 << (i % 64)) != 0)
            .map(|(_, o)| *o)
    }
}

/// The file of segment `n` in `dir`.
pub fn segment_path(dir: &Path, n: u32) -> PathBuf {
    dir.join(format!("{n:010}.log"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_puts_are_counted_and_released_once() {
        let mut s = Segment::new(0, Framing::Plain);
        for i in 0..130u32 {
            s.add(i * 10, 10);
        }
        assert_eq!((s.live_count(), s.live_bytes()), (130, 1300));
        assert!(s.release(70, 10));
        assert!(!s.release(70, 10), "a second release matches nothing");
        assert!(!s.release(71, 10), "nor does an offset that is no put");
        assert!(!s.is_live(70) && s.is_live(80));
        assert_eq!((s.live_count(), s.live_bytes()), (129, 1290));
        let live: Vec<u32> = s.live_offsets().collect();
        assert_eq!(live.len(), 129);
        assert!(!live.contains(&70) && live.contains(&1290));
    }
}

//! Reading a segment back: every good record, and the ranges that are not.
//!
//! A segment file starts with its header (format 2: [`super::header`]),
//! whose salt keys every record check; a format 1 segment (an older
//! nackd's) has none. A bad record does not end the scan of a format 2
//! segment: a bad record whose own lengths still agree is skipped whole
//! (so damage in a body costs that record only), and after damage to the
//! framing the scan finds the next record that checks. That is safe because
//! no bytes but this segment's writer's check under its salt: a message body
//! shaped like records (even holding a record copied from another segment)
//! is never read as records. A format 1 segment's crc32 is unkeyed, so
//! after damage in one the scan never looks for records again: the rest of
//! it is reported as damaged ([`Harm::LegacyRest`]). Every skipped range is
//! reported with its byte offsets and what it held, as far as can be told.

use std::collections::BTreeMap;

use tracing::warn;

use super::header::{self, Format};
use super::record::{Bad, Framing, Kind, View};
use super::Loc;

/// A range of a segment that held no readable record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Damage {
    /// Segment number.
    pub segment: u32,
    /// First byte skipped.
    pub from: u64,
    /// First byte read again (the end of the file if nothing followed).
    pub to: u64,
    /// What was there, and so what it costs.
    pub bad: Harm,
}

/// What a damaged range held, as far as can be told, and so what it costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Harm {
    /// A record that runs past the end of the file, framing intact: a write
    /// a crash tore. At the end of the newest segment that is the torn tail
    /// (nothing in it was answered, it is cut); anywhere else, damage.
    Torn,
    /// A put record whose framing is intact but whose check fails: the
    /// message of this id (if the id itself is intact) is lost.
    Put(u64),
    /// A delete record whose check fails: the message of this id (if the id
    /// itself is intact) is held again and may be republished once more.
    Delete(u64),
    /// Bytes that are no record: framing damaged or garbage. Held messages
    /// whose put was in it are lost; one whose delete was may come back.
    Corrupt,
    /// The segment header does not check (or names another segment): its
    /// salt is unknown, so no record of the whole file can be trusted.
    Header,
    /// The rest of a format 1 segment from its first damage: its records
    /// are not keyed, so none after damage is trusted.
    LegacyRest,
    /// Bytes a sealed segment should have (its successor's header says how
    /// long it was sealed) and has not: the file was cut.
    Missing,
    /// Bytes past the length a sealed segment was sealed at: not part of
    /// the log (a write that failed and could not be cut back, or damage).
    Beyond,
    /// A whole segment missing from the numbering (`to` is its sealed length
    /// when its successor's header says it, else 0).
    Gone,
    /// `NEXT_ID` was behind the ids of the older segments (lowered or
    /// restored by hand): ids `from..to` were given to new messages while
    /// older records may have them. Not a byte range: `segment` is 0.
    IdsBehind,
}

impl Harm {
    /// What it costs, for logs and the status page.
    pub fn cost(self) -> &'static str {
        match self {
            Self::Torn => "a torn write: a record cut short by the end of the file",
            Self::Put(_) => "a damaged put: that message is lost",
            Self::Delete(_) => {
                "a damaged delete: that message is held again and may be republished once more"
            }
            Self::Corrupt => "unreadable bytes: held messages in them are lost, deleted ones may come back",
            Self::Header => "the segment header is damaged: every message in the segment is lost, deleted ones may come back, and the length of the segment before it cannot be checked",
            Self::LegacyRest => "damage in a format 1 segment: the rest of it is not read (messages in it lost, deleted ones may come back)",
            Self::Missing => "the segment is shorter than it was sealed at: messages in the missing bytes are lost, deleted ones may come back",
            Self::Beyond => "bytes past the length the segment was sealed at: ignored",
            Self::Gone => "a whole segment is missing: messages in it are lost, deleted ones may come back, and the length of the segment before it cannot be checked",
            Self::IdsBehind => "NEXT_ID was behind the ids in the store (edited or restored by hand): a message parked since the start may share its id with an older one: the older one of such a pair is dropped (released from the store, not republished)",
        }
    }

    /// A short name (metrics, JSON).
    pub fn name(self) -> &'static str {
        match self {
            Self::Torn => "torn",
            Self::Put(_) => "put",
            Self::Delete(_) => "delete",
            Self::Corrupt => "corrupt",
            Self::Header => "header",
            Self::LegacyRest => "legacy_rest",
            Self::Missing => "missing",
            Self::Beyond => "beyond",
            Self::Gone => "gone",
            Self::IdsBehind => "ids_behind",
        }
    }
}

/// What one segment file holds besides its records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Scanned {
    /// Its format: `Legacy` also when the header is damaged (then `damage`
    /// says so); `Newer` means nothing was read.
    pub format: Format,
    /// The ranges skipped, in order.
    pub damage: Vec<Damage>,
}

impl Scanned {
    /// A segment none of whose records can be read.
    pub(super) fn damaged(damage: Damage) -> Self {
        Self {
            format: Format::Legacy,
            damage: vec![damage],
        }
    }

    /// How its records are framed.
    pub(super) fn framing(&self) -> Framing {
        match self.format {
            Format::Salted(h) => h.framing(),
            Format::Legacy | Format::Newer(_) => Framing::Plain,
        }
    }
}

/// Calls `each` with every good record of the segment file `bytes`
/// (segment `segment`) and its location, in order; returns the ranges
/// skipped.
pub fn scan<'a>(bytes: &'a [u8], segment: u32, each: impl FnMut(View<'a>, Loc)) -> Vec<Damage> {
    scan_segment(bytes, segment, each).damage
}

/// [`scan`], with the segment's format.
pub(super) fn scan_segment<'a>(
    bytes: &'a [u8],
    segment: u32,
    mut each: impl FnMut(View<'a>, Loc),
) -> Scanned {
    let whole = |bad| Damage {
        segment,
        from: 0,
        to: bytes.len() as u64,
        bad,
    };
    let format = header::format(bytes);
    let (framing, start) = match format {
        Ok(Format::Legacy) => (Framing::Plain, 0),
        Ok(Format::Salted(h)) => (h.framing(), header::LEN),
        Ok(Format::Newer(v)) => {
            return Scanned {
                format: Format::Newer(v),
                damage: Vec::new(),
            }
        }
        // The file ends inside its header: a crash while creating it.
        Err(Bad::Torn) => return Scanned::damaged(whole(Harm::Torn)),
        Err(Bad::Corrupt) => return Scanned::damaged(whole(Harm::Header)),
    };
    let format = format.expect("matched above");
    let mut damage = Vec::new();
    let mut at = start;
    while at < bytes.len() {
        match framing.at(&bytes[at..]) {
            Ok((view, len)) => {
                let loc = Loc {
                    segment,
                    offset: at as u32,
                    len: len as u32,
                };
                each(view, loc);
                at += len;
            }
            Err(_) => {
                let (to, bad) = skip(bytes, at, framing);
                damage.push(Damage {
                    segment,
                    from: at as u64,
                    to: to as u64,
                    bad,
                });
                at = to;
            }
        }
    }
    Scanned { format, damage }
}

/// [`scan_segment`] for segment `segment` of a store, whose successor's
/// header says it was sealed at `sealed` bytes (`None`: it is the newest,
/// or no successor says): bytes past that are not read, bytes missing
/// before it are damage too. A header naming another segment makes the
/// whole file damage: its records belong somewhere else in the log.
pub(super) fn scan_sealed<'a>(
    bytes: &'a [u8],
    segment: u32,
    sealed: Option<u64>,
    each: impl FnMut(View<'a>, Loc),
) -> Scanned {
    let len = bytes.len() as u64;
    if let Ok(Format::Salted(h)) = header::format(bytes) {
        if h.segment != segment {
            return Scanned::damaged(Damage {
                segment,
                from: 0,
                to: len,
                bad: Harm::Header,
            });
        }
    }
    let upto = sealed.map_or(len, |s| s.min(len));
    let mut scanned = scan_segment(&bytes[..upto as usize], segment, each);
    match sealed {
        Some(s) if s > len => scanned.damage.push(Damage {
            segment,
            from: len,
            to: s,
            bad: Harm::Missing,
        }),
        Some(s) if s < len => scanned.damage.push(Damage {
            segment,
            from: s,
            to: len,
            bad: Harm::Beyond,
        }),
        _ => {}
    }
    scanned
}

/// The length each segment was sealed at, by number, as the headers of
/// the segments after them (`formats`, by number) say.
pub(super) fn sealed_lengths(formats: &BTreeMap<u32, Format>) -> BTreeMap<u32, u64> {
    formats
        .values()
        .filter_map(|f| match f {
            Format::Salted(h) => h.prev,
            _ => None,
        })
        .collect()
}

/// The segments missing between the first and the last of `numbers`
/// (ascending), as the segments' `formats` (by number; none for a segment
/// whose header does not check) and the `damage` their scan found tell.
/// Segments are numbered one after the other and nackd only ever removes
/// the oldest, so a gap is damage (each segment as long as its successor's
/// header says) unless the segment after it shows it is not: its own
/// format 2 header naming the segment before the gap as its predecessor
/// (the gap was gone when it was made), or a format 1 segment that reads
/// from its start, with no format 2 segment before it (nackd before format
/// 2 removed segments in the middle once nothing in them was live).
///
/// Anything else after a gap is counted as damage, also when it cannot be
/// told for sure. A header that does not check may have named the segment
/// before the gap, or one in it; if one in it, the segment before the gap
/// may have been cut unseen (its sealed length was in the lost successor's
/// header), and only the gap, reported, says so. A segment that reads as
/// format 1 after a format 2 one was written by a format 2 nackd, with a
/// header, since damaged; one whose start does not read (damage from byte
/// 0) may be such a header too. The segment after the gap is damaged in all
/// these cases and reported anyway, so an undamaged store never reports a
/// gap it did not lose; at worst a damaged one also reports as lost a
/// segment an older nackd removed.
pub(super) fn gaps(
    numbers: &[u32],
    formats: &BTreeMap<u32, Format>,
    damage: &[Damage],
) -> Vec<Damage> {
    let sealed = sealed_lengths(formats);
    let starts_damaged = |n: u32| damage.iter().any(|d| d.segment == n && d.from == 0);
    let mut gone = Vec::new();
    // A segment up to the one before the gap was written in format 2 (its
    // header checks, or it starts like one and does not).
    let mut salted_before = false;
    for w in numbers.windows(2) {
        let (before, after) = (w[0], w[1]);
        salted_before |= !matches!(formats.get(&before), Some(Format::Legacy));
        if after == before + 1 {
            continue;
        }
        match formats.get(&after) {
            Some(Format::Salted(h))
                if h.segment == after && h.prev.map(|(n, _)| n) == Some(before) =>
            {
                continue
            }
            Some(Format::Salted(_)) => {}
            Some(Format::Legacy) if !salted_before && !starts_damaged(after) => {
                warn!(
                    from = before + 1,
                    to = after - 1,
                    "store: format 1 segments missing in the middle (removed by an older nackd once nothing in them was live; not counted as damage)"
                );
                continue;
            }
            Some(Format::Legacy | Format::Newer(_)) | None => warn!(
                from = before + 1,
                to = after - 1,
                segment = after,
                "store: segments missing in the middle, and the start of the segment after them, which would say whether they were there, is damaged: counted as lost"
            ),
        }
        gone.extend((before + 1..after).map(|segment| Damage {
            segment,
            from: 0,
            to: sealed.get(&segment).copied().unwrap_or(0),
            bad: Harm::Gone,
        }));
    }
    gone
}

/// Where reading goes on after a bad record at `at`, and what was skipped.
fn skip(bytes: &[u8], at: usize, framing: Framing) -> (usize, Harm) {
    let rest = &bytes[at..];
    // The file ends inside a prefix, or inside a record whose lengths agree.
    let torn = rest.len() < framing.prefix_len()
        || framing.extent(rest).is_some_and(|len| len > rest.len());
    if torn {
        return (bytes.len(), Harm::Torn);
    }
    if framing == Framing::Plain {
        return (bytes.len(), Harm::LegacyRest);
    }
    match framing.extent(rest) {
        // A body holds any bytes: a bad record whose framing is intact is
        // skipped whole, never searched for records.
        Some(len) => {
            let bad = match framing.kind_of(rest) {
                Some((Kind::Put, id)) => Harm::Put(id),
                Some((Kind::Del, id)) => Harm::Delete(id),
                None => Harm::Corrupt,
            };
            (at + len, bad)
        }
        None => (resync(bytes, at + 1, framing), Harm::Corrupt),
    }
}

/// Most bytes the search for the next record after damage may check:
/// about a tenth of a second. A message body can nest record-shaped bytes so
/// that every offset in it claims a record running to its end, which would
/// make the search quadratic in the body's size (days for 16 MiB); past
/// this, the rest of the segment is reported as damaged instead.
const RESYNC_BUDGET: usize = 1 << 30;

/// The first offset at or after `from` where a whole record that checks
/// starts (only records this segment's writer framed check).
fn resync(bytes: &[u8], from: usize, framing: Framing) -> usize {
    resync_within(bytes, from, framing, RESYNC_BUDGET)
}

/// [`resync`], checking at most `budget` bytes.
fn resync_within(bytes: &[u8], from: usize, framing: Framing, mut budget: usize) -> usize {
    for y in from..bytes.len() {
        let Some(cost) = framing.check_cost(&bytes[y..]) else {
            continue;
        };
        if cost > budget {
            warn!(
                from,
                to = bytes.len(),
                "store: no record found within the search budget after damage: the rest of the segment is reported as damaged"
            );
            return bytes.len();
        }
        budget -= cost;
        if framing.at(&bytes[y..]).is_ok() {
            return y;
        }
    }
    bytes.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::header::Header;
    use crate::store::record::{del_body, encode_del, encode_put, put_body};
    use crate::store::{Held, Route};
    use bytes::Bytes;
    use std::sync::Arc;

    fn held(id: u64, body: Vec<u8>) -> Held {
        Held {
            id,
            vhost: Arc::from("/"),
            queue: Arc::from("q"),
            due_ms: 5,
            retry: 1,
            route: Route::Queue,
            on_return: None,
            header: Bytes::from_static(b"hh"),
            body: Bytes::from(body),
        }
    }

    /// A format 2 segment: its header, then records framed with its salt.
    struct Seg {
        header: Header,
        bytes: Vec<u8>,
    }

    impl Seg {
        fn new() -> Self {
            let header = Header::new(1, None);
            Self {
                header,
                bytes: header.encode().to_vec(),
            }
        }

        fn body(&mut self, body: &[u8]) -> (usize, usize) {
            let at = self.bytes.len();
            self.header.framing().frame_into(&mut self.bytes, body);
            (at, self.bytes.len())
        }

        fn put(&mut self, id: u64) -> (usize, usize) {
            self.body(&put_body(&held(id, vec![id as u8; 40])))
        }

        fn del(&mut self, id: u64) -> (usize, usize) {
            self.body(&del_body(id))
        }
    }

    fn ids(bytes: &[u8]) -> (Vec<u64>, Vec<Damage>) {
        let mut ids = Vec::new();
        let damage = scan(bytes, 1, |v, _| match v {
            View::Put(p) => ids.push(p.id),
            View::Del(id) => ids.push(1000 + id),
        });
        (ids, damage)
    }

    fn range(d: &Damage) -> (usize, usize, Harm) {
        (d.from as usize, d.to as usize, d.bad)
    }

    #[test]
    fn damage_in_the_middle_skips_only_that_record() {
        let mut seg = Seg::new();
        seg.put(1);
        let b = seg.put(2);
        let c = seg.del(1);
        seg.bytes[b.0 + 60] ^= 0x40; // inside record 2's body
        let (ids, damage) = ids(&seg.bytes);
        assert_eq!(ids, vec![1, 1001], "the records after the damage are read");
        assert_eq!(
            damage.iter().map(range).collect::<Vec<_>>(),
            vec![(b.0, b.1, Harm::Put(2))]
        );
        seg.bytes[c.0 + 3] ^= 0x01; // the delete's check
        let (ids, damage) = super::tests::ids(&seg.bytes);
        assert_eq!(ids, vec![1]);
        assert_eq!(
            range(&damage[1]),
            (c.0, c.1, Harm::Delete(1)),
            "named, not torn"
        );
    }

    /// A format 2 segment `n` whose header names `prev` (number, length).
    fn salted(n: u32, prev: Option<(u32, u64)>) -> Format {
        Format::Salted(Header::new(n, prev))
    }

    /// The segments [`gaps`] counts as lost (number, bytes), for segments
    /// `numbers` whose starts read as `formats`.
    fn gone(numbers: &[u32], formats: Vec<(u32, Format)>) -> Vec<(u32, u64)> {
        let formats = formats.into_iter().collect();
        gaps(numbers, &formats, &[])
            .iter()
            .map(|d| (d.segment, d.to))
            .collect()
    }

    /// Review 2, finding 3: a gap is damage when a format 2 header says a
    /// segment in it was there; gaps among format 1 segments (an older
    /// nackd removed segments in the middle) and gaps a format 2 header
    /// says were already gone are not.
    #[test]
    fn only_a_gap_a_header_names_is_damage() {
        let legacy = vec![
            (1, Format::Legacy),
            (3, Format::Legacy),
            (4, salted(4, Some((3, 90)))),
        ];
        assert_eq!(gone(&[1, 3, 4], legacy), vec![]);
        let already_gone = vec![(3, salted(3, None)), (7, salted(7, Some((3, 50))))];
        assert_eq!(gone(&[3, 7], already_gone), vec![]);
        let removed = vec![(3, salted(3, None)), (5, salted(5, Some((4, 80))))];
        assert_eq!(gone(&[3, 5], removed), vec![(4, 80)]);
        let two = vec![(2, Format::Legacy), (5, salted(5, Some((4, 80))))];
        assert_eq!(gone(&[2, 5], two), vec![(3, 0), (4, 80)]);
    }

    /// A gap before a segment whose header does not check is counted as
    /// lost: that header may have named a segment in the gap (and held the
    /// sealed length of the one before it). So is a gap before a segment
    /// that reads as format 1 (an empty one too) while an older one is in
    /// format 2 (a format 2 nackd wrote it, with a header, since damaged),
    /// or whose start does not read (it may be such a header).
    #[test]
    fn a_gap_no_intact_header_accounts_for_is_damage() {
        // Segment 3's header does not check (no entry); 4's says 3's length.
        let torn = vec![(1, salted(1, None)), (4, salted(4, Some((3, 44))))];
        assert_eq!(gone(&[1, 3, 4], torn), vec![(2, 0)]);
        let legacy_then_torn = vec![(1, Format::Legacy), (4, salted(4, Some((3, 44))))];
        assert_eq!(
            gone(&[1, 3, 4], legacy_then_torn),
            vec![(2, 0)],
            "it may have named 1; it cannot be told, so it is counted"
        );
        let looks_legacy = vec![
            (1, salted(1, None)),
            (3, Format::Legacy),
            (4, salted(4, Some((3, 44)))),
        ];
        assert_eq!(gone(&[1, 3, 4], looks_legacy), vec![(2, 0)]);
        // Its predecessor's header does not check: it was format 2 too.
        let after_torn = vec![(3, Format::Legacy), (4, salted(4, Some((3, 44))))];
        assert_eq!(gone(&[1, 3, 4], after_torn), vec![(2, 0)]);
        let older_salted = vec![
            (1, salted(1, None)),
            (2, salted(2, Some((1, 60)))),
            (4, Format::Legacy),
            (5, salted(5, Some((4, 0)))),
        ];
        assert_eq!(gone(&[1, 2, 4, 5], older_salted), vec![(3, 0)]);
        // All format 1 as far as can be read, but the start of the segment
        // after the gap does not read: it may be a damaged header.
        let legacy: BTreeMap<_, _> = [
            (1, Format::Legacy),
            (3, Format::Legacy),
            (4, salted(4, Some((3, 44)))),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            gaps(&[1, 3, 4], &legacy, &[]),
            vec![],
            "read from its start"
        );
        let start = Damage {
            segment: 3,
            from: 0,
            to: 44,
            bad: Harm::LegacyRest,
        };
        let found = gaps(&[1, 3, 4], &legacy, &[start]);
        let found: Vec<_> = found.iter().map(|d| (d.segment, d.to, d.bad)).collect();
        assert_eq!(found, vec![(2, 0, Harm::Gone)]);
    }

    /// Review 2, finding 5: the search for the next record after damage
    /// checks at most its budget of bytes, then reports the rest of the
    /// segment instead of running quadratic over a crafted body.
    #[test]
    fn the_search_after_damage_stops_at_its_budget() {
        let mut seg = Seg::new();
        let start = seg.bytes.len();
        let bad: Vec<(usize, usize)> = (1..=50).map(|id| seg.put(id)).collect();
        let good = seg.put(99);
        for (at, _) in &bad {
            seg.bytes[at + 60] ^= 0x40; // framing intact, check fails
        }
        let framing = seg.header.framing();
        let end = seg.bytes.len();
        assert_eq!(
            resync_within(&seg.bytes, start, framing, usize::MAX),
            good.0
        );
        assert_eq!(resync(&seg.bytes, start, framing), good.0);
        let one = bad[0].1 - bad[0].0;
        assert_eq!(resync_within(&seg.bytes, start, framing, 10 * one), end);
    }

    #[test]
    fn a_damaged_length_or_garbage_is_skipped_too() {
        let mut seg = Seg::new();
        let a = seg.put(1);
        seg.bytes.extend_from_slice(&[0xAB; 37]);
        seg.bytes.extend_from_slice(&[0; 4096]);
        let b = seg.put(2);
        let (got, damage) = ids(&seg.bytes);
        assert_eq!(got, vec![1, 2]);
        assert_eq!(
            damage.iter().map(range).collect::<Vec<_>>(),
            vec![(a.1, b.0, Harm::Corrupt)]
        );
        seg.bytes[a.0 + 8] = 0x7f; // a's length now claims far more than the file
        let (got, _) = ids(&seg.bytes);
        assert_eq!(got, vec![2]);
    }

    #[test]
    fn a_length_damaged_past_the_end_does_not_take_the_records_after_it() {
        let mut seg = Seg::new();
        seg.put(1);
        let b = seg.put(2);
        seg.put(3);
        seg.bytes[b.0 + 9] = 0x10; // b's length now runs far past the end
        let (got, damage) = ids(&seg.bytes);
        assert_eq!(got, vec![1, 3], "not taken for a torn tail");
        assert_eq!(range(&damage[0]), (b.0, b.1, Harm::Corrupt));
    }

    #[test]
    fn a_torn_tail_is_one_range_to_the_end() {
        let mut seg = Seg::new();
        seg.put(1);
        let b = seg.put(2);
        for cut in b.0 + 1..b.1 {
            let (got, damage) = ids(&seg.bytes[..cut]);
            assert_eq!(got, vec![1]);
            assert_eq!(
                damage.iter().map(range).collect::<Vec<_>>(),
                vec![(b.0, cut, Harm::Torn)],
                "cut at {cut}"
            );
        }
        let (got, damage) = ids(&seg.bytes[..10]);
        assert!(got.is_empty());
        assert_eq!(range(&damage[0]), (0, 10, Harm::Torn), "inside the header");
    }

    #[test]
    fn records_inside_a_body_never_pass_for_records() {
        // What a publisher can put in a body: records framed in format 1,
        // and byte-exact copies of records of another segment.
        let mut other = Seg::new();
        let copy = other.del(1);
        let copy = other.bytes[copy.0..copy.1].to_vec();
        let fake = [encode_del(1), encode_put(&held(99, vec![0; 8])), copy].concat();
        let mut seg = Seg::new();
        let a = seg.put(1);
        let b = seg.body(&put_body(&held(2, fake)));
        let c = seg.put(3);
        seg.bytes[b.0..b.0 + 12].fill(0); // its check and length
        let (got, damage) = ids(&seg.bytes);
        assert_eq!(got, vec![1, 3], "no fake delete of 1, no fake put of 99");
        assert_eq!(
            damage.iter().map(range).collect::<Vec<_>>(),
            vec![(a.1, c.0, Harm::Corrupt)]
        );
        assert_eq!(b.1, c.0);
    }

    #[test]
    fn a_header_that_does_not_check_loses_the_whole_segment_reported() {
        let mut seg = Seg::new();
        seg.put(1);
        seg.bytes[20] ^= 0x01; // the salt
        let (got, damage) = ids(&seg.bytes);
        assert!(got.is_empty());
        assert_eq!(
            damage.iter().map(range).collect::<Vec<_>>(),
            vec![(0, seg.bytes.len(), Harm::Header)]
        );
    }

    #[test]
    fn a_legacy_segment_reads_until_its_first_damage_then_reports_the_rest() {
        let a = encode_put(&held(1, vec![1; 40]));
        let b = encode_put(&held(2, vec![2; 40]));
        let c = encode_del(1);
        let clean = [a.clone(), b.clone(), c.clone()].concat();
        assert_eq!(ids(&clean), (vec![1, 2, 1001], vec![]));
        let mut bytes = clean.clone();
        bytes[a.len() + 20] ^= 0x40; // inside record 2
        let (got, damage) = ids(&bytes);
        assert_eq!(got, vec![1], "nothing after damage in an unkeyed segment");
        assert_eq!(
            damage.iter().map(range).collect::<Vec<_>>(),
            vec![(a.len(), bytes.len(), Harm::LegacyRest)]
        );
        let (got, damage) = ids(&clean[..clean.len() - 3]);
        assert_eq!(got, vec![1, 2]);
        assert_eq!(damage[0].bad, Harm::Torn, "its torn tail is still one");
    }
}

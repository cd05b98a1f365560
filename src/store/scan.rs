//! Reading a segment back: every good record, and the ranges that are not.
//!
//! A bad record does not end the scan. The framing (length, checksum, a
//! structure that must use exactly the length) lets the scan find the next
//! whole record, so damage costs only the records it touches, and every
//! skipped range is reported with its byte offsets. A bad record whose own
//! lengths still agree is skipped whole: a message body may contain bytes
//! that read as records of this log, and they must never count as records.

use super::record::{self, Bad, View};
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
    /// What was wrong at `from`.
    pub bad: Bad,
}

/// Calls `each` with every good record of `bytes` (segment `segment`) and
/// its location, in order; returns the ranges skipped.
pub fn scan<'a>(bytes: &'a [u8], segment: u32, mut each: impl FnMut(View<'a>, Loc)) -> Vec<Damage> {
    let mut damage = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        match record::at(&bytes[at..]) {
            Ok((view, len)) => {
                let loc = Loc {
                    segment,
                    offset: at as u32,
                    len: len as u32,
                };
                each(view, loc);
                at += len;
            }
            Err(bad) => {
                // A body holds any bytes, records of this log included: a
                // bad record whose framing is intact (a torn write, a bad
                // checksum) is skipped whole, never searched for records.
                let next = match record::extent(&bytes[at..]) {
                    Some(len) if len >= bytes.len() - at => bytes.len(),
                    Some(len) => resync(bytes, at + len),
                    None => resync(bytes, at + 1),
                };
                damage.push(Damage {
                    segment,
                    from: at as u64,
                    to: next as u64,
                    bad,
                });
                at = next;
            }
        }
    }
    damage
}

/// The first offset at or after `from` where a whole good record starts.
fn resync(bytes: &[u8], from: usize) -> usize {
    (from..bytes.len())
        .find(|&y| record::at(&bytes[y..]).is_ok())
        .unwrap_or(bytes.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::record::{encode_del, encode_put};
    use crate::store::{Held, Route};
    use bytes::Bytes;
    use std::sync::Arc;

    fn put(id: u64) -> Vec<u8> {
        encode_put(&Held {
            id,
            vhost: Arc::from("/"),
            queue: Arc::from("q"),
            due_ms: 5,
            retry: 1,
            route: Route::Queue,
            on_return: None,
            header: Bytes::from_static(b"hh"),
            body: Bytes::from(vec![id as u8; 40]),
        })
    }

    fn ids(bytes: &[u8]) -> (Vec<u64>, Vec<Damage>) {
        let mut ids = Vec::new();
        let damage = scan(bytes, 1, |v, _| match v {
            View::Put(p) => ids.push(p.id),
            View::Del(id) => ids.push(1000 + id),
        });
        (ids, damage)
    }

    #[test]
    fn damage_in_the_middle_skips_only_that_record() {
        let (a, b, c) = (put(1), put(2), encode_del(1));
        let mut bytes = [a.clone(), b.clone(), c.clone()].concat();
        bytes[a.len() + 20] ^= 0x40; // inside record 2
        let (ids, damage) = ids(&bytes);
        assert_eq!(ids, vec![1, 1001], "the records after the damage are read");
        assert_eq!(
            damage,
            vec![Damage {
                segment: 1,
                from: a.len() as u64,
                to: (a.len() + b.len()) as u64,
                bad: Bad::Corrupt
            }]
        );
    }

    #[test]
    fn a_damaged_length_or_garbage_is_skipped_too() {
        let (a, b) = (put(1), put(2));
        let mut bytes = [a.clone(), vec![0xAB; 37], vec![0; 4096], b.clone()].concat();
        let (got, damage) = ids(&bytes);
        assert_eq!(got, vec![1, 2]);
        assert_eq!(damage.len(), 1);
        assert_eq!(damage[0].to as usize, bytes.len() - b.len());
        bytes[a.len() - 40] = 0xff; // the length prefix of nothing: inside a's body
        bytes[0] = 0x7f; // a's length now claims far more than the file
        let (got, _) = ids(&bytes);
        assert_eq!(got, vec![2]);
    }

    #[test]
    fn a_length_damaged_past_the_end_does_not_take_the_records_after_it() {
        let (a, b, c) = (put(1), put(2), put(3));
        let mut bytes = [a.clone(), b.clone(), c.clone()].concat();
        bytes[a.len() + 1] = 0x10; // b's length now runs far past the end
        let (got, damage) = ids(&bytes);
        assert_eq!(got, vec![1, 3], "not taken for a torn tail");
        assert_eq!(
            (damage[0].from, damage[0].to),
            (a.len() as u64, (a.len() + b.len()) as u64)
        );
    }

    #[test]
    fn a_torn_tail_is_one_range_to_the_end() {
        let (a, b) = (put(1), put(2));
        let bytes = [a.clone(), b[..b.len() / 2].to_vec()].concat();
        let (got, damage) = ids(&bytes);
        assert_eq!(got, vec![1]);
        assert_eq!(
            (damage[0].from, damage[0].to, damage[0].bad),
            (a.len() as u64, bytes.len() as u64, Bad::Torn)
        );
    }
}

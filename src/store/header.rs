//! The header a segment file starts with (format 2), and telling formats apart.
//!
//! ```text
//! header = magic:"NACKDLOG" version:u32=2 segment:u32 salt:u64
//!          prev:u32 prev_len:u64 check:u64       (check = xxh3-64 of the 36 bytes before it)
//! ```
//!
//! The salt is drawn from the operating system's random source for each
//! segment and never leaves the file: every record check of the segment is
//! keyed by it, so bytes that did not come from this segment's writer (a
//! message body, a record copied from another segment) do not check.
//! `prev` and `prev_len` are the previous segment's number and the length it
//! was sealed at: a sealed segment's length is known from its successor.
//!
//! Format 1 segments (written before the header existed) start with a
//! record whose length prefix is below 512 MiB, so their first byte is
//! below `0x20`; the magic starts with `N` (`0x4E`): the two never meet.

use xxhash_rust::xxh3::xxh3_64;

use super::record::{Bad, Framing};

/// Bytes of a header.
pub(super) const LEN: usize = 8 + 4 + 4 + 8 + 4 + 8 + 8;
/// The format a header announces.
pub(super) const VERSION: u32 = 2;
const MAGIC: &[u8; 8] = b"NACKDLOG";

/// A segment's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    /// The segment's own number (a file renamed to another number is caught).
    pub segment: u32,
    /// Keys every record check of the segment.
    pub salt: u64,
    /// The previous segment: its number and the length it was sealed at;
    /// `None` for the first segment of a store.
    pub prev: Option<(u32, u64)>,
}

impl Header {
    /// A header for segment `segment` after `prev`, with a fresh salt.
    pub(super) fn new(segment: u32, prev: Option<(u32, u64)>) -> Self {
        Self {
            segment,
            salt: new_salt(),
            prev,
        }
    }

    /// The bytes a segment file starts with.
    pub(super) fn encode(&self) -> [u8; LEN] {
        let (prev, prev_len) = self.prev.unwrap_or((0, 0));
        let mut out = [0u8; LEN];
        out[..8].copy_from_slice(MAGIC);
        out[8..12].copy_from_slice(&VERSION.to_be_bytes());
        out[12..16].copy_from_slice(&self.segment.to_be_bytes());
        out[16..24].copy_from_slice(&self.salt.to_be_bytes());
        out[24..28].copy_from_slice(&prev.to_be_bytes());
        out[28..36].copy_from_slice(&prev_len.to_be_bytes());
        let check = xxh3_64(&out[..LEN - 8]);
        out[LEN - 8..].copy_from_slice(&check.to_be_bytes());
        out
    }

    /// How this segment's records are framed.
    pub(super) fn framing(&self) -> Framing {
        Framing::Salted(self.salt)
    }
}

/// What a segment file's first bytes say it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Format {
    /// Format 1: no header, records from byte 0, crc32 checks (an empty
    /// file too: nothing in it either way).
    Legacy,
    /// Format 2: this header, then records keyed by its salt.
    Salted(Header),
    /// A header that checks, of a format this nackd does not read (written
    /// by a newer one): the store must not be opened, not counted as damage.
    Newer(u32),
}

/// The format of the segment file whose bytes start `bytes`. `Err(Torn)`:
/// the file ends inside a header; `Err(Corrupt)`: the header does not check
/// (its salt is unknown: no record of the segment can be trusted).
pub(super) fn format(bytes: &[u8]) -> Result<Format, Bad> {
    let n = bytes.len().min(MAGIC.len());
    if n == 0 || bytes[..n] != MAGIC[..n] {
        return Ok(Format::Legacy);
    }
    if bytes.len() < LEN {
        return Err(Bad::Torn);
    }
    let h = &bytes[..LEN];
    let check = u64::from_be_bytes(h[LEN - 8..].try_into().expect("8 bytes"));
    if xxh3_64(&h[..LEN - 8]) != check {
        return Err(Bad::Corrupt);
    }
    let be32 = |at: usize| u32::from_be_bytes(h[at..at + 4].try_into().expect("4 bytes"));
    let be64 = |at: usize| u64::from_be_bytes(h[at..at + 8].try_into().expect("8 bytes"));
    let version = be32(8);
    if version != VERSION {
        return Ok(Format::Newer(version));
    }
    let prev = match be32(24) {
        0 => None,
        n => Some((n, be64(28))),
    };
    Ok(Format::Salted(Header {
        segment: be32(12),
        salt: be64(16),
        prev,
    }))
}

/// 64 bits from the operating system's random source (`getrandom(2)`);
/// if that fails, from std's randomly keyed SipHash of the time and pid,
/// which is unpredictable too.
#[allow(unsafe_code)]
fn new_salt() -> u64 {
    let mut salt = [0u8; 8];
    // SAFETY: the buffer is valid for writes of its length.
    let got = unsafe { libc::getrandom(salt.as_mut_ptr().cast(), salt.len(), 0) };
    if got == salt.len() as isize {
        return u64::from_ne_bytes(salt);
    }
    // RandomState's keys come from the OS too, once per thread, and differ
    // for each instance made; the process and a stack address vary them.
    use std::hash::BuildHasher;
    let here = &salt as *const _ as usize;
    std::collections::hash_map::RandomState::new().hash_one((here, std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_reads_back_and_any_flipped_bit_is_caught() {
        let h = Header::new(7, Some((6, 12345)));
        let bytes = h.encode();
        assert_eq!(format(&bytes), Ok(Format::Salted(h)));
        assert_ne!(Header::new(7, None).salt, h.salt, "a fresh salt each time");
        for i in 8..LEN {
            let mut bad = bytes;
            bad[i] ^= 0x01;
            assert_eq!(format(&bad), Err(Bad::Corrupt), "byte {i}");
        }
        assert_eq!(format(&bytes[..LEN - 1]), Err(Bad::Torn));
        assert_eq!(format(&bytes[..3]), Err(Bad::Torn));
        assert_eq!(format(&[]), Ok(Format::Legacy));
        let first = Header::new(1, None).encode();
        assert!(matches!(
            format(&first),
            Ok(Format::Salted(Header { prev: None, .. }))
        ));
    }

    #[test]
    fn a_legacy_segment_is_told_apart() {
        let h = crate::store::record::tests::held(1);
        let rec = crate::store::record::encode_put(&h);
        assert_eq!(format(&rec), Ok(Format::Legacy));
    }
}

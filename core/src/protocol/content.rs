//! Content headers (class, body size, basic properties) and field tables.
//!
//! Properties are decoded and encoded with amq-protocol. The `headers` table
//! is edited at the byte level instead: amq-protocol maps some field-table
//! tags to others when it re-encodes (`L` → `l`, `U` → `s`) and keeps one
//! value per key, so nackd copies every entry it does not own as the original
//! bytes and encodes only the entries it writes.

use std::ops::Range;

use amq_protocol::frame::parsing::parse_content_header;
use amq_protocol::frame::AMQPContentHeader;
use amq_protocol::protocol::basic::{gen_properties, AMQPProperties};
use amq_protocol::types::generation::{gen_short_string, gen_value};
use amq_protocol::types::parsing::{parse_short_string, parse_value};
use amq_protocol::types::AMQPValue;
use bytes::{BufMut, BytesMut};
use nom::combinator::all_consuming;
use nom::Parser;

use crate::protocol::frame::FrameError;

/// Flag bit of the `headers` property in the property flags.
const HEADERS_FLAG: u16 = 1 << 13;
const CONTENT_TYPE_FLAG: u16 = 1 << 15;
const CONTENT_ENCODING_FLAG: u16 = 1 << 14;
/// class-id(2) weight(2) body-size(8) property-flags(2)
const FIXED_LEN: usize = 14;

/// A decoded content header.
pub type ContentHeader = AMQPContentHeader;

/// Decodes a content header payload with amq-protocol.
pub fn decode_header(payload: &[u8]) -> Result<ContentHeader, FrameError> {
    if let Ok(Some(table)) = raw_headers(payload) {
        check_nesting(table, true)?;
    }
    all_consuming(parse_content_header)
        .parse(payload)
        .map(|(_, header)| header)
        .map_err(|_| FrameError::Syntax("content header"))
}

/// Encodes a content header payload (weight 0) with amq-protocol.
pub fn encode_header(class_id: u16, body_size: u64, properties: &AMQPProperties) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.put_u16(class_id);
    out.put_u16(0);
    out.put_u64(body_size);
    cookie_factory::gen_simple(gen_properties(properties), out)
        .expect("writing into a Vec cannot fail")
}

/// The body size a content header announces, read without decoding the rest.
pub fn body_size(payload: &[u8]) -> Result<u64, FrameError> {
    payload
        .get(4..12)
        .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")))
        .ok_or(FrameError::Syntax("content header shorter than 14 octets"))
}

/// Deepest nesting of field tables and arrays (the outer table counts) that
/// nackd hands to amq-protocol. Its parser recurses once per level, and a
/// few thousand levels (5 octets each, far below frame_max) overflow a 2 MiB
/// tokio worker stack, which aborts the process. Real headers nest 3 deep
/// (`x-death`: array of tables holding arrays).
pub const MAX_TABLE_DEPTH: usize = 32;

/// Refuses a field table or array body (after its 4-octet length) that nests
/// deeper than [`MAX_TABLE_DEPTH`], walking it without recursion.
///
/// The walk follows amq-protocol's grammar and stops quietly at the first
/// value that is malformed or overruns its container: amq-protocol fails
/// there too, without going deeper, and reports the syntax error itself.
pub(crate) fn check_nesting(body: &[u8], keyed: bool) -> Result<(), FrameError> {
    let u32_at = |at: usize| -> Option<usize> {
        let b = body.get(at..at.checked_add(4)?)?;
        Some(u32::from_be_bytes(b.try_into().expect("4 octets")) as usize)
    };
    // (end of an open container, whether its entries have keys)
    let mut open = vec![(body.len(), keyed)];
    let mut at = 0;
    while let Some(&(end, keyed)) = open.last() {
        if at >= end {
            open.pop();
            continue;
        }
        if keyed {
            at = at.saturating_add(1 + usize::from(body[at]));
        }
        let Some(&tag) = body.get(at).filter(|_| at < end) else {
            return Ok(());
        };
        at += 1;
        let size = match tag {
            b'V' => 0,
            b't' | b'b' | b'B' => 1,
            b's' | b'U' | b'u' => 2,
            b'I' | b'i' | b'f' => 4,
            b'D' => 5,
            b'l' | b'L' | b'd' | b'T' => 8,
            b'S' | b'x' => match u32_at(at) {
                Some(len) => len.saturating_add(4),
                None => return Ok(()),
            },
            b'A' | b'F' => {
                let Some(inner_end) = u32_at(at).map(|len| at + 4 + len).filter(|e| *e <= end)
                else {
                    return Ok(());
                };
                if open.len() >= MAX_TABLE_DEPTH {
                    return Err(FrameError::Syntax("field table nested too deeply"));
                }
                open.push((inner_end, tag == b'F'));
                at += 4;
                continue;
            }
            _ => return Ok(()),
        };
        at = at.saturating_add(size);
        if at > end {
            return Ok(());
        }
    }
    Ok(())
}

/// One entry of a field table as it is on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawEntry<'a> {
    /// The key, without its length octet.
    pub key: &'a [u8],
    /// The whole entry: key length, key, type tag and value.
    pub bytes: &'a [u8],
}

/// Splits the body of a field table (after its 4-octet length) into entries.
pub fn table_entries(mut table: &[u8]) -> Result<Vec<RawEntry<'_>>, FrameError> {
    check_nesting(table, true)?;
    let bad = |_| FrameError::Syntax("field table");
    let mut entries = Vec::new();
    while !table.is_empty() {
        let start = table;
        let (rest, key) = parse_short_string(table).map_err(bad)?;
        let (rest, _) = parse_value(rest).map_err(bad)?;
        let used = start.len() - rest.len();
        entries.push(RawEntry {
            key: &start[1..1 + key.as_str().len()],
            bytes: &start[..used],
        });
        table = rest;
    }
    Ok(entries)
}

/// Where the `headers` table sits in a content header payload.
struct Layout {
    flags: u16,
    /// Byte range of the table including its length prefix, or the offset
    /// where it would go when the message has no headers.
    table: Range<usize>,
}

fn short_string_end(payload: &[u8], at: usize) -> Result<usize, FrameError> {
    let len = *payload
        .get(at)
        .ok_or(FrameError::Syntax("content header"))? as usize;
    let end = at + 1 + len;
    (end <= payload.len())
        .then_some(end)
        .ok_or(FrameError::Syntax("content header"))
}

fn layout(payload: &[u8]) -> Result<Layout, FrameError> {
    if payload.len() < FIXED_LEN {
        return Err(FrameError::Syntax("content header shorter than 14 octets"));
    }
    let flags = u16::from_be_bytes([payload[12], payload[13]]);
    let mut at = FIXED_LEN;
    if flags & CONTENT_TYPE_FLAG != 0 {
        at = short_string_end(payload, at)?;
    }
    if flags & CONTENT_ENCODING_FLAG != 0 {
        at = short_string_end(payload, at)?;
    }
    if flags & HEADERS_FLAG == 0 {
        return Ok(Layout {
            flags,
            table: at..at,
        });
    }
    let len = payload
        .get(at..at + 4)
        .map(|b| u32::from_be_bytes(b.try_into().expect("4 bytes")) as usize)
        .ok_or(FrameError::Syntax("headers table length"))?;
    let end = at + 4 + len;
    if end > payload.len() {
        return Err(FrameError::Syntax("headers table length"));
    }
    Ok(Layout {
        flags,
        table: at..end,
    })
}

/// The raw `headers` table of a content header payload (after its length).
pub fn raw_headers(payload: &[u8]) -> Result<Option<&[u8]>, FrameError> {
    let layout = layout(payload)?;
    Ok((layout.flags & HEADERS_FLAG != 0)
        .then(|| &payload[layout.table.start + 4..layout.table.end]))
}

/// Returns a copy of the content header payload whose `headers` table has
/// every key of `set` replaced (or added) and every other entry, property and
/// flag kept byte for byte.
pub fn rewrite_headers(payload: &[u8], set: &[(&str, AMQPValue)]) -> Result<Vec<u8>, FrameError> {
    rewrite_headers_without(payload, set, &[])
}

/// [`rewrite_headers`], also leaving out the entries named in `drop`.
pub fn rewrite_headers_without(
    payload: &[u8],
    set: &[(&str, AMQPValue)],
    drop: &[&str],
) -> Result<Vec<u8>, FrameError> {
    let layout = layout(payload)?;
    let old = match layout.flags & HEADERS_FLAG {
        0 => &[][..],
        _ => &payload[layout.table.start + 4..layout.table.end],
    };
    let mut table = BytesMut::with_capacity(old.len() + 64 * set.len());
    for entry in table_entries(old)? {
        let replaced = set.iter().any(|(key, _)| key.as_bytes() == entry.key);
        if !replaced && !drop.iter().any(|key| key.as_bytes() == entry.key) {
            table.extend_from_slice(entry.bytes);
        }
    }
    for (key, value) in set {
        let entry = cookie_factory::gen_simple(
            cookie_factory::sequence::pair(gen_short_string(key), gen_value(value)),
            Vec::new(),
        )
        .map_err(|_| FrameError::Syntax("header key longer than 255 octets"))?;
        table.extend_from_slice(&entry);
    }
    let mut out = Vec::with_capacity(payload.len() + table.len());
    out.extend_from_slice(&payload[..12]);
    out.put_u16(layout.flags | HEADERS_FLAG);
    out.extend_from_slice(&payload[FIXED_LEN..layout.table.start]);
    out.put_u32(table.len() as u32);
    out.extend_from_slice(&table);
    out.extend_from_slice(&payload[layout.table.end..]);
    Ok(out)
}

/// Whether two content header payloads carry the same message properties:
/// byte for byte, except that the top-level entries of the `headers` table
/// may come in another order. RabbitMQ 4.3 sorts them by key when it
/// returns a message (nested tables and arrays keep their order), so a
/// `basic.return` is matched to its publish this way.
pub fn same_properties(a: &[u8], b: &[u8]) -> bool {
    if a == b {
        return true;
    }
    let (Ok(la), Ok(lb)) = (layout(a), layout(b)) else {
        return false;
    };
    if a[..la.table.start] != b[..lb.table.start] || a[la.table.end..] != b[lb.table.end..] {
        return false;
    }
    match (sorted_entries(a, &la.table), sorted_entries(b, &lb.table)) {
        (Some(ea), Some(eb)) => ea == eb,
        _ => false,
    }
}

/// The entries of the headers table at `table` in `payload`, sorted.
fn sorted_entries<'a>(payload: &'a [u8], table: &Range<usize>) -> Option<Vec<RawEntry<'a>>> {
    let body = payload.get(table.start + 4..table.end).unwrap_or_default();
    let mut entries = table_entries(body).ok()?;
    entries.sort_unstable_by(|x, y| (x.key, x.bytes).cmp(&(y.key, y.bytes)));
    Some(entries)
}

#[cfg(test)]
mod tests;

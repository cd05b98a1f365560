//! The on-disk record format of the hold log.
//!
//! ```text
//! record  = check:u64 len:u32 body   (format 2: check = xxh3-64 of len‖body,
//!                                     seeded with the segment's salt)
//!         | len:u32 crc:u32 body     (format 1, and replica records: crc32 of body)
//! body    = 1 put | 2 del            (len = body length)
//! put     = id:u64 due_ms:u64 retry:u32 vhost:str16 queue:str16
//!           route on_return header:bytes32 body:bytes32
//! del     = id:u64
//! route   = 0 (queue) | 1 exchange:str16 routing_key:str16 | 255 (none)
//! ```
//!
//! Segments are written in format 2 only ([`Framing::Salted`]). Its check
//! covers the length too and is keyed by a salt that never leaves the
//! segment file, so no bytes a publisher chose (a body shaped like records,
//! even a byte-exact copy of a record of another segment) check as a
//! record: a scan that resynchronises after damage cannot be led into a
//! message body. xxh3 is no cryptographic MAC, but nothing ever answers a
//! forger whether a guess checked, the salt is 64 secret bits, and 64 check
//! bits also make garbage that checks by chance negligible (a resync tries
//! every offset of a damaged range), at memory speed (recovery reads every
//! segment). Format 1 ([`Framing::Plain`]) is read for the segments of an
//! older nackd, and is what the replica's stream records carry (each is its
//! own AMQP message there: nothing is ever resynchronised in them).

use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{Held, Route};

/// Bytes before a record's body in format 1 (replica records).
pub const PREFIX: usize = 8;
/// Bytes before a record's body in format 2 (what segments are written in).
pub const SALTED_PREFIX: usize = 12;
/// Bytes a delete record takes in a segment, prefix included.
pub const DEL_LEN: usize = SALTED_PREFIX + 1 + 8;
/// Bytes of the smallest put record in either format, prefix included
/// (format 1's shorter prefix, empty names, header and body): no segment
/// holds more puts than its bytes over this.
pub const MIN_PUT_LEN: usize = PREFIX + 1 + 8 + 8 + 4 + 4 + 4 + 2 + 2 + 1 + 1;
/// Largest record body accepted when reading (corruption guard).
pub const MAX_BODY: usize = 512 * 1024 * 1024;

const PUT: u8 = 1;
const DEL: u8 = 2;

/// How the records of a segment (or a replica record) are framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// Format 1: `len:u32 crc32:u32 body`, unkeyed.
    Plain,
    /// Format 2: `check:u64 len:u32 body`, checked with this salt.
    Salted(u64),
}

impl Framing {
    /// Bytes before a record's body.
    pub fn prefix_len(self) -> usize {
        match self {
            Self::Plain => PREFIX,
            Self::Salted(_) => SALTED_PREFIX,
        }
    }

    /// Appends `body` framed as a record to `out`.
    pub fn frame_into(self, out: &mut Vec<u8>, body: &[u8]) {
        match self {
            Self::Plain => {
                out.put_u32(body.len() as u32);
                out.put_u32(crc32fast::hash(body));
                out.put_slice(body);
            }
            Self::Salted(salt) => {
                let at = out.len();
                out.put_u64(0);
                out.put_u32(body.len() as u32);
                out.put_slice(body);
                let check = xxh3_64_with_seed(&out[at + 8..], salt);
                out[at..at + 8].copy_from_slice(&check.to_be_bytes());
            }
        }
    }

    /// Where the length sits in a prefix.
    fn len_at(self) -> usize {
        match self {
            Self::Plain => 0,
            Self::Salted(_) => 8,
        }
    }

    /// `body` framed as a record.
    pub fn frame(self, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.prefix_len() + body.len());
        self.frame_into(&mut out, body);
        out
    }

    /// The body length the prefix at `bytes[0]` announces.
    pub fn prefix(self, bytes: &[u8]) -> Result<usize, Bad> {
        let at = self.len_at();
        let Some(len) = bytes.get(at..at + 4) else {
            return Err(Bad::Torn);
        };
        let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
        if len == 0 || len > MAX_BODY {
            return Err(Bad::Corrupt);
        }
        Ok(len)
    }

    /// Whether the record `rec` (prefix included, exactly its length) checks.
    fn checks(self, rec: &[u8]) -> bool {
        match self {
            Self::Plain => {
                let crc = u32::from_be_bytes(rec[4..8].try_into().expect("4 bytes"));
                crc32fast::hash(&rec[PREFIX..]) == crc
            }
            Self::Salted(salt) => {
                let check = u64::from_be_bytes(rec[..8].try_into().expect("8 bytes"));
                xxh3_64_with_seed(&rec[8..], salt) == check
            }
        }
    }

    /// The record that starts at `bytes[0]` (prefix included) and its whole
    /// length, if a complete, well-formed record that checks is there.
    pub fn at(self, bytes: &[u8]) -> Result<(View<'_>, usize), Bad> {
        let end = self.prefix_len() + self.prefix(bytes)?;
        if end > bytes.len() {
            return Err(Bad::Torn);
        }
        // Structure first: it costs nothing compared with a check over a
        // large body, and random bytes almost never have it.
        let view = view(&bytes[self.prefix_len()..end])?;
        if !self.checks(&bytes[..end]) {
            return Err(Bad::Corrupt);
        }
        Ok((view, end))
    }

    /// How many bytes [`Framing::at`] would check for a record at `bytes[0]`:
    /// `None` when it would refuse it before any check (no room, no record
    /// structure), which costs next to nothing.
    pub fn check_cost(self, bytes: &[u8]) -> Option<usize> {
        let end = self.prefix_len() + self.prefix(bytes).ok()?;
        let body = bytes.get(self.prefix_len()..end)?;
        view(body).ok().map(|_| end)
    }

    /// How many bytes the record at `bytes[0]` (prefix included) takes when
    /// its length prefix and the lengths inside its body agree (after a torn
    /// write both run past the end of `bytes`): a bad record whose framing
    /// is intact, only its contents are not. `None` when they disagree or it
    /// is no put or delete: then the framing itself is damaged.
    pub fn extent(self, bytes: &[u8]) -> Option<usize> {
        let p = self.prefix_len();
        let len_at = self.len_at();
        let len = bytes.get(len_at..len_at + 4)?;
        let said = p + u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
        match inner_len(bytes.get(p..).unwrap_or_default()) {
            Ok(Some(len)) if p + len == said => Some(said),
            Ok(None) if said > bytes.len() => Some(said),
            _ => None,
        }
    }

    /// What the record at `bytes[0]` (prefix included) says it is, read
    /// without any check: a put or a delete, and its id. For reporting a
    /// bad record whose framing is intact; the id may be damaged too.
    pub fn kind_of(self, bytes: &[u8]) -> Option<(Kind, u64)> {
        let body = bytes.get(self.prefix_len()..)?;
        let id = u64_of(body.get(1..9)?);
        match body[0] {
            PUT => Some((Kind::Put, id)),
            DEL => Some((Kind::Del, id)),
            _ => None,
        }
    }
}

/// What a record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A put.
    Put,
    /// A delete.
    Del,
}

fn put_str16(out: &mut Vec<u8>, s: &str) {
    let bytes = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
    out.put_u16(bytes.len() as u16);
    out.put_slice(bytes);
}

fn put_route(out: &mut Vec<u8>, route: Option<&Route>) {
    match route {
        None => out.put_u8(255),
        Some(Route::Queue) => out.put_u8(0),
        Some(Route::Exchange {
            exchange,
            routing_key,
        }) => {
            out.put_u8(1);
            put_str16(out, exchange);
            put_str16(out, routing_key);
        }
        Some(Route::Delayed {
            exchange,
            routing_key,
        }) => {
            out.put_u8(2);
            put_str16(out, exchange);
            put_str16(out, routing_key);
        }
    }
}

/// The body length of `h`'s put record (what its prefix will say).
pub fn put_len(h: &Held) -> usize {
    let str16 = |s: &str| 2 + s.len().min(u16::MAX as usize);
    let route = |r: Option<&Route>| match r {
        Some(
            Route::Exchange {
                exchange,
                routing_key,
            }
            | Route::Delayed {
                exchange,
                routing_key,
            },
        ) => 1 + str16(exchange) + str16(routing_key),
        _ => 1,
    };
    let fixed = 1 + 8 + 8 + 4 + 4 + 4; // kind, id, due_ms, retry, two lengths
    let names = str16(&h.vhost) + str16(&h.queue);
    let routes = route(Some(&h.route)) + route(h.on_return.as_ref());
    fixed + names + routes + h.header.len() + h.body.len()
}

/// The body of `h`'s put record (what a [`Framing`] frames).
pub fn put_body(h: &Held) -> Vec<u8> {
    let mut b = Vec::with_capacity(put_len(h));
    b.put_u8(PUT);
    b.put_u64(h.id);
    b.put_u64(h.due_ms);
    b.put_u32(h.retry);
    put_str16(&mut b, &h.vhost);
    put_str16(&mut b, &h.queue);
    put_route(&mut b, Some(&h.route));
    put_route(&mut b, h.on_return.as_ref());
    b.put_u32(h.header.len() as u32);
    b.put_slice(&h.header);
    b.put_u32(h.body.len() as u32);
    b.put_slice(&h.body);
    b
}

/// The body of a delete record of `id`.
pub fn del_body(id: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(9);
    b.put_u8(DEL);
    b.put_u64(id);
    b
}

/// Encodes a put record in format 1, prefix included (a replica record).
pub fn encode_put(h: &Held) -> Vec<u8> {
    Framing::Plain.frame(&put_body(h))
}

/// Encodes a delete record in format 1, prefix included.
pub fn encode_del(id: u64) -> Vec<u8> {
    Framing::Plain.frame(&del_body(id))
}

/// Why a record cannot be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bad {
    /// Fewer bytes than the record announces (a torn write at the tail).
    Torn,
    /// The checksum or the structure is wrong.
    Corrupt,
}

/// A record read in place: nothing is copied (recovery reads millions).
#[derive(Debug)]
pub enum View<'a> {
    /// A message is held.
    Put(PutView<'a>),
    /// A message left.
    Del(u64),
}

/// A put record read in place.
#[derive(Debug)]
pub struct PutView<'a> {
    /// Store id.
    pub id: u64,
    /// Due time, ms since the Unix epoch.
    pub due_ms: u64,
    /// Retry number in its headers.
    pub retry: u32,
    /// Virtual host.
    pub vhost: &'a str,
    /// Queue.
    pub queue: &'a str,
    /// Where it goes when due.
    pub route: Route,
    /// Where it goes if returned.
    pub on_return: Option<Route>,
    /// Content header payload.
    pub header: &'a [u8],
    /// Body.
    pub body: &'a [u8],
}

impl PutView<'_> {
    /// Header + body bytes.
    pub fn size(&self) -> usize {
        self.header.len() + self.body.len()
    }

    /// The message, copied out.
    pub fn to_held(&self) -> Held {
        Held {
            id: self.id,
            vhost: Arc::from(self.vhost),
            queue: Arc::from(self.queue),
            due_ms: self.due_ms,
            retry: self.retry,
            route: self.route.clone(),
            on_return: self.on_return.clone(),
            header: Bytes::copy_from_slice(self.header),
            body: Bytes::copy_from_slice(self.body),
        }
    }
}

/// Reads a record body whose structure must use exactly its length (the
/// check is [`Framing::at`]'s job; this alone is a strong filter when looking
/// for the next record after damage).
pub fn view(body: &[u8]) -> Result<View<'_>, Bad> {
    let mut b = body;
    let view = match take(&mut b, 1)?[0] {
        DEL => View::Del(u64_of(take(&mut b, 8)?)),
        PUT => {
            let id = u64_of(take(&mut b, 8)?);
            let due_ms = u64_of(take(&mut b, 8)?);
            let retry = u32::from_be_bytes(take(&mut b, 4)?.try_into().expect("4 bytes"));
            let vhost = str16(&mut b)?;
            let queue = str16(&mut b)?;
            let target = route(&mut b)?.ok_or(Bad::Corrupt)?;
            let on_return = route(&mut b)?;
            let header = bytes32(&mut b)?;
            let body = bytes32(&mut b)?;
            View::Put(PutView {
                id,
                due_ms,
                retry,
                vhost,
                queue,
                route: target,
                on_return,
                header,
                body,
            })
        }
        _ => return Err(Bad::Corrupt),
    };
    if !b.is_empty() {
        return Err(Bad::Corrupt);
    }
    Ok(view)
}

/// A format 1 record (a replica record) at `bytes[0]`: see [`Framing::at`].
pub fn at(bytes: &[u8]) -> Result<(View<'_>, usize), Bad> {
    Framing::Plain.at(bytes)
}

/// A record body's length by its own length fields; `Ok(None)` if `body`
/// ends before one of them, `Err` if it is no put or delete.
fn inner_len(body: &[u8]) -> Result<Option<usize>, ()> {
    let n = |at: usize, width: usize| -> Option<usize> {
        let b = body.get(at..at + width)?;
        Some(b.iter().fold(0, |n, x| n << 8 | usize::from(*x)))
    };
    match body.first() {
        None => return Ok(None),
        Some(&DEL) => return Ok(Some(9)),
        Some(&PUT) => {}
        Some(_) => return Err(()),
    }
    let str16s = |at: &mut usize| {
        for _ in 0..2 {
            *at += 2 + n(*at, 2)?;
        }
        Some(())
    };
    // id, due_ms, retry; vhost, queue; route, on_return; header, body.
    let mut at = 1 + 8 + 8 + 4;
    if str16s(&mut at).is_none() {
        return Ok(None);
    }
    for _ in 0..2 {
        match n(at, 1) {
            None => return Ok(None),
            Some(0 | 255) => at += 1,
            Some(1) => {
                at += 1;
                if str16s(&mut at).is_none() {
                    return Ok(None);
                }
            }
            Some(_) => return Err(()),
        }
    }
    for _ in 0..2 {
        let Some(len) = n(at, 4) else {
            return Ok(None);
        };
        at += 4 + len;
    }
    Ok(Some(at))
}

/// The id of the format 1 put or delete record `bytes` (prefix included) holds.
pub fn id_of(bytes: &[u8]) -> Option<u64> {
    Framing::Plain.kind_of(bytes).map(|(_, id)| id)
}

fn u64_of(b: &[u8]) -> u64 {
    u64::from_be_bytes(b.try_into().expect("8 bytes"))
}

fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], Bad> {
    if b.remaining() < n {
        return Err(Bad::Corrupt);
    }
    let (head, rest) = b.split_at(n);
    *b = rest;
    Ok(head)
}

fn str16<'a>(b: &mut &'a [u8]) -> Result<&'a str, Bad> {
    let len = u16::from_be_bytes(take(b, 2)?.try_into().expect("2 bytes")) as usize;
    std::str::from_utf8(take(b, len)?).map_err(|_| Bad::Corrupt)
}

fn bytes32<'a>(b: &mut &'a [u8]) -> Result<&'a [u8], Bad> {
    let len = u32::from_be_bytes(take(b, 4)?.try_into().expect("4 bytes")) as usize;
    take(b, len)
}

fn route(b: &mut &[u8]) -> Result<Option<Route>, Bad> {
    match take(b, 1)?[0] {
        255 => Ok(None),
        0 => Ok(Some(Route::Queue)),
        1 => Ok(Some(Route::Exchange {
            exchange: str16(b)?.to_string(),
            routing_key: str16(b)?.to_string(),
        })),
        2 => Ok(Some(Route::Delayed {
            exchange: str16(b)?.to_string(),
            routing_key: str16(b)?.to_string(),
        })),
        _ => Err(Bad::Corrupt),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn held(id: u64) -> Held {
        Held {
            id,
            vhost: Arc::from("/"),
            queue: Arc::from("email-queue"),
            due_ms: 1_700_000_000_000 + id,
            retry: 2,
            route: Route::Queue,
            on_return: Some(Route::Exchange {
                exchange: "dlx".into(),
                routing_key: "k".into(),
            }),
            header: Bytes::from_static(&[0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0]),
            body: Bytes::from_static(b"abc"),
        }
    }

    const FRAMINGS: [Framing; 2] = [Framing::Plain, Framing::Salted(0x5eed)];

    #[test]
    fn put_and_del_round_trip() {
        let h = held(7);
        for framing in FRAMINGS {
            let wire = framing.frame(&put_body(&h));
            assert_eq!(wire.len(), framing.prefix_len() + put_len(&h));
            assert_eq!(framing.prefix(&wire).unwrap(), put_len(&h));
            match framing.at(&wire).unwrap() {
                (View::Put(back), len) => {
                    assert_eq!(len, wire.len());
                    let back = back.to_held();
                    assert_eq!((back.id, back.due_ms, back.retry), (7, h.due_ms, 2));
                    assert_eq!((&*back.vhost, &*back.queue), ("/", "email-queue"));
                    assert_eq!(back.route, Route::Queue);
                    assert_eq!(back.on_return, h.on_return);
                    assert_eq!((back.header, back.body), (h.header.clone(), h.body.clone()));
                }
                other => panic!("{other:?}"),
            }
            let del = framing.frame(&del_body(9));
            assert!(matches!(framing.at(&del), Ok((View::Del(9), _))));
            assert_eq!(framing.kind_of(&wire), Some((Kind::Put, 7)));
            assert_eq!(framing.kind_of(&del), Some((Kind::Del, 9)));
            assert_eq!(framing.at(&wire[..wire.len() - 1]).unwrap_err(), Bad::Torn);
            assert_eq!(framing.at(&wire[..5]).unwrap_err(), Bad::Torn);
        }
        assert_eq!(encode_put(&h), Framing::Plain.frame(&put_body(&h)));
        assert_eq!(DEL_LEN, Framing::Salted(1).frame(&del_body(1)).len());
    }

    /// A delayed publish (issue 23): route tag 2, its exchange and routing
    /// key, and recovery's metadata says it is delayed.
    #[test]
    fn a_delayed_put_round_trips() {
        let h = Held {
            queue: Arc::from("later"),
            retry: 0,
            route: Route::Delayed {
                exchange: "later".into(),
                routing_key: "a.b".into(),
            },
            on_return: None,
            ..held(8)
        };
        for framing in FRAMINGS {
            let wire = framing.frame(&put_body(&h));
            assert_eq!(wire.len(), framing.prefix_len() + put_len(&h));
            match framing.at(&wire).unwrap() {
                (View::Put(back), len) => {
                    assert_eq!(len, wire.len());
                    assert!(back.route.is_delayed());
                    let back = back.to_held();
                    assert_eq!((back.id, back.due_ms, back.retry), (h.id, h.due_ms, 0));
                    assert_eq!((&*back.vhost, &*back.queue), ("/", "later"));
                    assert_eq!((&back.route, &back.on_return), (&h.route, &None));
                    assert_eq!((back.header, back.body), (h.header.clone(), h.body.clone()));
                }
                other => panic!("{other:?}"),
            }
        }
        let exchange = Held {
            route: Route::Exchange {
                exchange: "later".into(),
                routing_key: "a.b".into(),
            },
            ..h.clone()
        };
        assert_ne!(
            put_body(&exchange),
            put_body(&h),
            "a delayed route is not read back as an exchange route"
        );
    }

    #[test]
    fn any_flipped_bit_is_caught() {
        for framing in FRAMINGS {
            let wire = framing.frame(&put_body(&held(1)));
            for i in 0..wire.len() {
                let mut bad = wire.clone();
                bad[i] ^= 0x10;
                assert!(framing.at(&bad).is_err(), "byte {i}");
            }
        }
    }

    #[test]
    fn a_salted_record_checks_only_under_its_own_salt() {
        let body = put_body(&held(1));
        let a = Framing::Salted(1).frame(&body);
        assert!(Framing::Salted(1).at(&a).is_ok());
        assert_eq!(Framing::Salted(2).at(&a).unwrap_err(), Bad::Corrupt);
        let plain = Framing::Plain.frame(&body);
        assert!(Framing::Salted(1).at(&plain).is_err());
        assert!(Framing::Plain.at(&a).is_err());
    }

    #[test]
    fn a_records_extent_is_known_wherever_a_write_tore_it() {
        let mut h = held(1);
        h.route = Route::Exchange {
            exchange: "x".into(),
            routing_key: "k".into(),
        };
        for framing in FRAMINGS {
            let p = framing.prefix_len();
            for wire in [
                framing.frame(&put_body(&h)),
                framing.frame(&put_body(&held(2))),
                framing.frame(&del_body(3)),
            ] {
                for cut in p..=wire.len() {
                    assert_eq!(
                        framing.extent(&wire[..cut]),
                        Some(wire.len()),
                        "cut at {cut}"
                    );
                }
                let mut bad = wire.clone();
                bad[framing.len_at() + 2] ^= 0x10; // the length disagrees with the body
                assert_eq!(framing.extent(&bad), None);
                bad = wire.clone();
                bad[p] = 9; // no put or delete
                assert_eq!(framing.extent(&bad), None);
            }
        }
    }
}

#[cfg(test)]
mod min_put {
    use super::*;

    /// [`MIN_PUT_LEN`] is the smallest put there is: recovery's room for
    /// deletes relies on no put being shorter.
    #[test]
    fn the_smallest_put_is_min_put_len_long() {
        let empty = Held {
            id: 0,
            vhost: Arc::from(""),
            queue: Arc::from(""),
            due_ms: 0,
            retry: 0,
            route: Route::Queue,
            on_return: None,
            header: Bytes::new(),
            body: Bytes::new(),
        };
        assert_eq!(encode_put(&empty).len(), MIN_PUT_LEN);
    }
}

//! The on-disk record format of the hold log.
//!
//! ```text
//! record  = len:u32 crc:u32 body            (crc32 of body, len = body length)
//! body    = 1 put | 2 del
//! put     = id:u64 due_ms:u64 retry:u32 vhost:str16 queue:str16
//!           route on_return header:bytes32 body:bytes32
//! del     = id:u64
//! route   = 0 (queue) | 1 exchange:str16 routing_key:str16 | 255 (none)
//! ```

use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes};

use super::{Held, Route};

/// Bytes before a record's body.
pub const PREFIX: usize = 8;
/// Largest record body accepted when reading (corruption guard).
pub const MAX_BODY: usize = 512 * 1024 * 1024;

const PUT: u8 = 1;
const DEL: u8 = 2;

/// A decoded record.
#[derive(Debug)]
pub enum Record {
    /// A message is held.
    Put(Held),
    /// A message left.
    Del(u64),
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
    }
}

fn frame(body: Vec<u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + PREFIX);
    out.put_u32(body.len() as u32);
    out.put_u32(crc32fast::hash(&body));
    out.extend_from_slice(&body);
    out
}

/// Encodes a put record, prefix included.
pub fn encode_put(h: &Held) -> Vec<u8> {
    let mut b =
        Vec::with_capacity(64 + h.vhost.len() + h.queue.len() + h.header.len() + h.body.len());
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
    frame(b)
}

/// Encodes a delete record, prefix included.
pub fn encode_del(id: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(9);
    b.put_u8(DEL);
    b.put_u64(id);
    frame(b)
}

/// Why a record cannot be read.
#[derive(Debug, PartialEq, Eq)]
pub enum Bad {
    /// Fewer bytes than the record announces (a torn write at the tail).
    Torn,
    /// The checksum or the structure is wrong.
    Corrupt,
}

/// Reads the prefix: `(body length, crc)`.
pub fn prefix(bytes: &[u8]) -> Result<(usize, u32), Bad> {
    if bytes.len() < PREFIX {
        return Err(Bad::Torn);
    }
    let len = u32::from_be_bytes(bytes[..4].try_into().expect("4 bytes")) as usize;
    let crc = u32::from_be_bytes(bytes[4..8].try_into().expect("4 bytes"));
    if len == 0 || len > MAX_BODY {
        return Err(Bad::Corrupt);
    }
    Ok((len, crc))
}

/// Decodes a record body after checking it against `crc`.
pub fn decode(body: &[u8], crc: u32) -> Result<Record, Bad> {
    if crc32fast::hash(body) != crc {
        return Err(Bad::Corrupt);
    }
    let mut b = body;
    let need = |b: &[u8], n: usize| {
        if b.remaining() < n {
            Err(Bad::Corrupt)
        } else {
            Ok(())
        }
    };
    need(b, 1)?;
    match b.get_u8() {
        DEL => {
            need(b, 8)?;
            Ok(Record::Del(b.get_u64()))
        }
        PUT => {
            need(b, 20)?;
            let id = b.get_u64();
            let due_ms = b.get_u64();
            let retry = b.get_u32();
            let vhost = str16(&mut b)?;
            let queue = str16(&mut b)?;
            let target = route(&mut b)?.ok_or(Bad::Corrupt)?;
            let on_return = route(&mut b)?;
            let header = bytes32(&mut b)?;
            let payload = bytes32(&mut b)?;
            Ok(Record::Put(Held {
                id,
                vhost: Arc::from(vhost.as_str()),
                queue: Arc::from(queue.as_str()),
                due_ms,
                retry,
                route: target,
                on_return,
                header,
                body: payload,
            }))
        }
        _ => Err(Bad::Corrupt),
    }
}

fn str16(b: &mut &[u8]) -> Result<String, Bad> {
    if b.remaining() < 2 {
        return Err(Bad::Corrupt);
    }
    let len = b.get_u16() as usize;
    if b.remaining() < len {
        return Err(Bad::Corrupt);
    }
    let s = String::from_utf8(b[..len].to_vec()).map_err(|_| Bad::Corrupt)?;
    b.advance(len);
    Ok(s)
}

fn bytes32(b: &mut &[u8]) -> Result<Bytes, Bad> {
    if b.remaining() < 4 {
        return Err(Bad::Corrupt);
    }
    let len = b.get_u32() as usize;
    if b.remaining() < len {
        return Err(Bad::Corrupt);
    }
    let out = Bytes::copy_from_slice(&b[..len]);
    b.advance(len);
    Ok(out)
}

fn route(b: &mut &[u8]) -> Result<Option<Route>, Bad> {
    if b.remaining() < 1 {
        return Err(Bad::Corrupt);
    }
    match b.get_u8() {
        255 => Ok(None),
        0 => Ok(Some(Route::Queue)),
        1 => Ok(Some(Route::Exchange {
            exchange: str16(b)?,
            routing_key: str16(b)?,
        })),
        _ => Err(Bad::Corrupt),
    }
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn put_and_del_round_trip() {
        let h = held(7);
        let wire = encode_put(&h);
        let (len, crc) = prefix(&wire).unwrap();
        assert_eq!(len, wire.len() - PREFIX);
        match decode(&wire[PREFIX..], crc).unwrap() {
            Record::Put(back) => {
                assert_eq!((back.id, back.due_ms, back.retry), (7, h.due_ms, 2));
                assert_eq!((&*back.vhost, &*back.queue), ("/", "email-queue"));
                assert_eq!(back.route, Route::Queue);
                assert_eq!(back.on_return, h.on_return);
                assert_eq!((back.header, back.body), (h.header, h.body));
            }
            other => panic!("{other:?}"),
        }
        let del = encode_del(9);
        let (_, crc) = prefix(&del).unwrap();
        assert!(matches!(decode(&del[PREFIX..], crc), Ok(Record::Del(9))));
    }

    #[test]
    fn any_flipped_bit_is_caught() {
        let wire = encode_put(&held(1));
        for i in PREFIX..wire.len() {
            let mut bad = wire.clone();
            bad[i] ^= 0x10;
            let (_, crc) = prefix(&bad).unwrap();
            assert_eq!(
                decode(&bad[PREFIX..], crc).unwrap_err(),
                Bad::Corrupt,
                "byte {i}"
            );
        }
        assert_eq!(prefix(&wire[..5]).unwrap_err(), Bad::Torn);
    }
}

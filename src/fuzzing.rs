//! Fuzz targets for the decoders of bytes nackd reads back from disk and
//! from streams (`fuzz/fuzz_targets/store_record.rs`,
//! `stream_record.rs`). Compiled with the `fuzzing` feature, and for the
//! library's own tests (which run the targets over mutated records).
//!
//! Each panics only when an invariant breaks: nothing these bytes hold
//! reaches amq-protocol's parser without nackd's limits (the content header
//! of a held message is decoded as the admin list and `nackd store
//! inspect` decode it), and a stream record re-encodes to the same value.

use nackd_core::protocol::content;

use crate::replica::Record;
use crate::store::record::{self, View};

/// A hold-log record (format 1, as the store and the replica carry it):
/// read in place, copied out, its content header decoded.
pub fn store_record(data: &[u8]) {
    let _ = record::view(data);
    if let Ok((View::Put(put), used)) = record::at(data) {
        assert!(used <= data.len());
        let held = put.to_held();
        assert_eq!(&held.header[..], put.header);
        let _ = content::decode_header(&held.header);
    }
}

/// A replica stream message body: decoded, re-encoded to the same value,
/// and every held message it carries read as [`store_record`] reads one.
pub fn stream_record(data: &[u8]) {
    let Ok(decoded) = Record::decode(data) else {
        return;
    };
    assert_eq!(Record::decode(&decoded.encode()), Ok(decoded.clone()));
    for r in decoded.flatten() {
        if let Record::Put { record, .. } | Record::Moved { record, .. } = r {
            store_record(&record);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Held;
    use bytes::Bytes;

    /// Every single-octet change of valid records (one holding a header
    /// nested far past nackd's limit) keeps the targets' invariants.
    #[test]
    fn mutated_records_keep_the_invariants() {
        let mut deep = vec![b'A', 0, 0, 0, 0];
        for _ in 0..2000 {
            let inner = deep;
            deep = vec![b'A'];
            deep.extend_from_slice(&(inner.len() as u32).to_be_bytes());
            deep.extend_from_slice(&inner);
        }
        let mut header = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0x20, 0];
        header.extend_from_slice(&(deep.len() as u32 + 5).to_be_bytes());
        header.extend_from_slice(b"\x04deep");
        header.extend_from_slice(&deep);
        let held = Held {
            id: 7,
            vhost: "/".into(),
            queue: "q".into(),
            due_ms: 1,
            retry: 2,
            route: crate::store::Route::Queue,
            on_return: None,
            header: Bytes::from(header),
            body: Bytes::from_static(b"ok"),
        };
        let put = record::encode_put(&held);
        let stream = Record::Puts(vec![Bytes::from(put.clone())]).encode();
        let moved = Record::MovedPuts {
            from: crate::replica::Intent {
                from: "gone".into(),
                epoch: 3,
            },
            records: vec![Bytes::from(put.clone()), Bytes::from(put.clone())],
        }
        .encode();
        let part = Record::AdoptedPart {
            by: "b".into(),
            epoch: 3,
            moved: vec![(7, 1), (8, 2)],
        }
        .encode();
        store_record(&put);
        stream_record(&stream);
        stream_record(&moved);
        stream_record(&part);
        for data in [put, stream, moved, part] {
            for at in 0..data.len().min(4096) {
                let mut bad = data.clone();
                bad[at] ^= 0x5a;
                store_record(&bad);
                stream_record(&bad);
            }
        }
    }
}

//! Fuzz targets for the decoders of bytes nackd reads back from disk and
//! from streams (`fuzz/fuzz_targets/store_record.rs`,
//! `stream_record.rs`). Compiled only with the `fuzzing` feature.
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

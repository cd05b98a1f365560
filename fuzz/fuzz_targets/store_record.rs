//! Raw bytes as a hold-log record (the store's files, the replica's
//! records): read in place, its content header within nackd's limits.
//! See `nackd::fuzzing::store_record`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| nackd::fuzzing::store_record(data));

//! Raw bytes as a replica stream message body. See
//! `nackd::fuzzing::stream_record`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| nackd::fuzzing::stream_record(data));

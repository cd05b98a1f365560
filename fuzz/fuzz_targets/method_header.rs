//! Raw bytes straight into method and content-header decoding, field tables
//! and the header rewrite. See `nackd_core::fuzzing::method_and_header`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| nackd_core::fuzzing::method_and_header(data));

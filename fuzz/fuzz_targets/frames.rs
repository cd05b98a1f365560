//! Raw bytes from a peer into the frame decoder, then into the method and
//! content-header decoders. See `nackd_core::fuzzing::frames`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| nackd_core::fuzzing::frames(data));

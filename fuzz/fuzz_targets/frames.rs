//! Raw bytes from a peer into the frame decoder, then into the method and
//! content-header decoders. See `nackd::fuzzing::frames`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| nackd::fuzzing::frames(data));

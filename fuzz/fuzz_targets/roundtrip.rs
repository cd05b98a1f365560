//! A random valid frame: decode(encode(x)) == x. See `nackd_core::fuzzing::roundtrip`.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nackd_core::fuzzing::FrameSpec;

fuzz_target!(|spec: FrameSpec| nackd_core::fuzzing::roundtrip(&spec));

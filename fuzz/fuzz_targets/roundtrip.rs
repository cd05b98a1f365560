//! A random valid frame: decode(encode(x)) == x. See `nackd::fuzzing::roundtrip`.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nackd::fuzzing::FrameSpec;

fuzz_target!(|spec: FrameSpec| nackd::fuzzing::roundtrip(&spec));

//! Raw bytes from the broker through the screen in front of lapin: what
//! comes out passes nackd's limits, folds restore byte for byte. See
//! `nackd_core::fuzzing::screen`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| nackd_core::fuzzing::screen(data));

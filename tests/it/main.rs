//! nackd's integration tests that share the machine (run in parallel):
//! every module runs the real `nackd` (in-process or as the binary) in
//! front of a real RabbitMQ with real clients. `tests/common` is the
//! harness both test binaries share; each module is one area, named after
//! it. Tests that restart the default broker or load the whole machine
//! are in `tests/alone`, where they take turns.
//!
//! Run one area with a filter, e.g. `cargo test --test it -- retry::`;
//! the broker is `NACKD_TEST_BROKER` (3.10 by default, see `common::broker`).

// Tests time what nackd does with the real clock (clippy.toml asks the
// product to read it only through nackd_core::clock).
#![allow(clippy::disallowed_methods)]

include!("modules.rs");

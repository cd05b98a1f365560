//! nackd's integration tests that must not share their broker with other
//! tests: one restarts its broker (`broker_restart`), the others
//! measure or load the machine (a million held messages, RAM of a
//! due backlog, third-party client suites, the container image's build).
//! Each holds `common::alone()`, its broker's turn, so those of one broker
//! take turns (those of 3.10 and 4.3 run two at a time, once every other
//! test of the pass has ended: `.config/nextest.toml`); the package test
//! (`deb`, apt in a Debian root of its own) is here for its time and
//! needs no turn. The shared harness is `tests/common`; the other tests
//! are in `tests/it`.
//!
//! Run one with a filter, e.g. `cargo test --test alone -- restart::`.

// Tests time what nackd does with the real clock (clippy.toml asks the
// product to read it only through nackd_core::clock).
#![allow(clippy::disallowed_methods)]

include!("modules.rs");

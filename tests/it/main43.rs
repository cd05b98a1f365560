//! The `it` tests (main.rs) built to run against RabbitMQ 4.3
//! (`scripts/broker4`'s rabbit43@localhost, and the 4.3 cluster of
//! `scripts/cluster`): `common::broker::chosen` knows this binary by its
//! name. `cargo nextest run` schedules both builds together.

// Tests time what nackd does with the real clock (clippy.toml asks the
// product to read it only through nackd_core::clock).
#![allow(clippy::disallowed_methods)]

include!("modules.rs");

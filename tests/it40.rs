//! The fallback tests against RabbitMQ 4.0 (`scripts/broker4`'s
//! rabbit40@localhost): there every requeue counts toward a quorum queue's
//! delivery limit, so what nackd does when it cannot hold a nack is tried
//! where a wrong requeue costs the message. The modules are tests/it's
//! own; this binary is built for 4.0 (see `common::broker::chosen`).

// Tests time what nackd does with the real clock (clippy.toml asks the
// product to read it only through nackd_core::clock).
#![allow(clippy::disallowed_methods)]

#[path = "common/mod.rs"]
mod common;

#[path = "it/brokers.rs"]
mod brokers;
#[path = "it/clock.rs"]
mod clock;
#[path = "it/deferral.rs"]
mod deferral;

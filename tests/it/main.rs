//! nackd's integration tests that share the machine (run in parallel):
//! every module runs the real `nackd` (in-process or as the binary) in
//! front of a real RabbitMQ with real clients. `tests/common` is the
//! harness both test binaries share; each module is one area, named after
//! it. Tests that restart the default broker or load the whole machine
//! are in `tests/alone`, where they take turns.
//!
//! Run one area with a filter, e.g. `cargo test --test it -- retry::`;
//! the broker is `NACKD_TEST_BROKER` (3.10 by default, see `common::broker`).

#[path = "../common/mod.rs"]
mod common;

mod alerts;
mod brokers;
mod cli;
mod cluster;
mod cluster_adopt;
mod cluster_replica;
mod cluster_smoke;
mod coalesce;
mod deferral;
mod delayed;
mod deploy;
mod durability;
mod hot_reload;
mod isolation;
mod ops;
mod option_c;
mod proxy;
mod replay;
mod replica;
mod republisher_health;
mod resilience;
mod retry;
mod status_page;
mod store;
mod tls;

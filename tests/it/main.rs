//! nackd's integration tests, in one binary (one link of the crate, one
//! harness): every module runs the real `nackd` (in-process or as the
//! binary) in front of a real RabbitMQ with real clients. `common` is the
//! shared harness; each other module is one area, named after it.
//!
//! Run one area with a filter, e.g. `cargo test --test it -- retry::`;
//! the broker is `NACKD_TEST_BROKER` (3.10 by default, see `common::broker`).

mod common;

mod alerts;
mod broker_restart;
mod brokers;
mod cli;
mod client_suites;
mod cluster;
mod cluster_replica;
mod cluster_smoke;
mod deb;
mod deferral;
mod deploy;
mod due_backlog;
mod durability;
mod hot_reload;
mod isolation;
mod ops;
mod proxy;
mod replica;
mod republisher_health;
mod resilience;
mod restart;
mod retry;
mod status_page;
mod store;
mod tls;

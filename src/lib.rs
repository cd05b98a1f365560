//! # nackd
//!
//! An AMQP 0-9-1 proxy in front of RabbitMQ that turns a consumer's
//! `basic.nack` / `basic.reject` on configured queues into a delayed retry.
//!
//! # Layout
//!
//! - [`frame`]: cuts the byte stream into frames (nom), checks sizes on the header.
//! - [`method`]: decodes the few methods nackd must understand (amq-protocol)
//!   and encodes the frames nackd emits itself.
//! - [`content`]: content headers (basic properties) and field tables.
//! - [`reply`]: AMQP reply codes.
//! - [`fuzzing`]: fuzz targets over the frame layer, shared by `fuzz/` and the
//!   property tests.
//! - [`metrics`]: the Prometheus metrics every part updates.
//! - `bench` (feature `bench`): the scenarios of the `nackd-bench` command.
//! - [`ops`]: the operations listener: `/metrics`, health, status page, admin API.
//! - [`reload`]: `[[policy]]` hot reload on SIGHUP.
// One audited exception: `sched` (a syscall libc has no safe form of).
#![deny(unsafe_code)]

#[cfg(feature = "bench")]
pub mod bench;
pub mod channel;
pub mod config;
pub mod content;
pub mod frame;
pub mod fuzzing;
pub mod headers;
pub mod intercept;
pub mod method;
pub mod metrics;
pub mod net;
pub mod ops;
pub mod policy;
pub mod reload;
pub mod reply;
pub mod republish;
pub mod retry;
pub mod sched;
pub mod server;
pub mod session;
pub mod store;
pub mod wheel;

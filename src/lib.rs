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
//! - `fuzzing` (feature `fuzzing`): fuzz targets over the frame layer,
//!   shared by `fuzz/` and the property tests; not in the product.
//! - [`metrics`]: the Prometheus metrics every part updates.
//! - [`ops`]: the operations listener: `/metrics`, health, status page, admin API.
//! - [`reload`]: `[[policy]]` hot reload on SIGHUP.
// One audited exception: `sched` (a syscall libc has no safe form of).
#![deny(unsafe_code)]

pub mod config;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod metrics;
pub mod net;
pub mod ops;
pub mod protocol;
pub mod reload;
pub mod replica;
pub mod retry;
pub mod sched;
pub mod server;
pub mod session;
pub mod store;

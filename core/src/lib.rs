//! # nackd-core
//!
//! What nackd decides, without sockets, threads or a runtime: every part
//! here takes events with the time they happened and is asked what to do
//! next. The `nackd` crate around it reads and writes the sockets, runs
//! the timers and the store, and carries what these parts ask for.
//!
//! # Layout
//!
//! - [`protocol`]: the wire, pure and fuzzed: `frame` (cutting the byte
//!   stream, nom), `method` (the few methods nackd decodes, the frames it
//!   emits), `content` (properties, byte-exact header splicing), `headers`
//!   (the retry headers nackd writes), `reply` (reply codes).
//! - `fuzzing` (feature `fuzzing`): the fuzz targets' code, shared by
//!   `fuzz/` and the property tests; not in the product.
#![forbid(unsafe_code)]

#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod protocol;

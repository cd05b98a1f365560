//! Who a delivery went to: a leaf that the channel book and the deferred
//! tags both name, without either importing the other.

use std::sync::Arc;

/// The consumer a delivery went to: its tag, and which `basic.consume` of
/// the channel it is (a tag is free again once its consumer is cancelled).
pub(super) type ConsumerRef = (Arc<str>, u64);

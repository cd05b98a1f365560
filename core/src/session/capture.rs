//! Capture: deliveries of intercepted queues kept in memory in case the
//! client nacks them, under one global byte budget.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use crate::policy::Policy;

/// A global bound on the bytes of captured deliveries.
#[derive(Debug)]
pub struct Budget {
    limit: usize,
    used: AtomicUsize,
    refused: AtomicU64,
}

impl Budget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
        })
    }

    /// Takes `bytes` from the budget, or counts a refusal.
    pub fn reserve(self: &Arc<Self>, bytes: usize) -> Option<Reservation> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            if used
                .checked_add(bytes)
                .is_none_or(|total| total > self.limit)
            {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return None;
            }
            match self.used.compare_exchange_weak(
                used,
                used + bytes,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Some(Reservation {
                        budget: self.clone(),
                        bytes,
                    })
                }
                Err(now) => used = now,
            }
        }
    }

    /// Bytes currently captured.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Deliveries not captured because the budget was spent.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// Bytes taken from a [`Budget`], given back on drop.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Budget>,
    bytes: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A delivery kept in case the client nacks it.
#[derive(Debug)]
pub struct Captured {
    /// Exchange it was published to.
    pub exchange: String,
    /// Routing key it was published with.
    pub routing_key: String,
    /// Content header payload, as the broker sent it.
    pub header: Bytes,
    /// Body.
    pub body: Bytes,
    /// The policy of its queue.
    pub policy: Arc<Policy>,
    _reserved: Reservation,
}

/// A delivery whose content is still arriving.
#[derive(Debug)]
pub struct Capturing {
    /// Its delivery tag.
    pub tag: u64,
    exchange: String,
    routing_key: String,
    policy: Arc<Policy>,
    header: Option<(Bytes, Reservation)>,
    body: BytesMut,
}

impl Capturing {
    /// Starts capturing the delivery `tag`.
    pub fn new(tag: u64, exchange: &str, routing_key: &str, policy: Arc<Policy>) -> Self {
        Self {
            tag,
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
            policy,
            header: None,
            body: BytesMut::new(),
        }
    }

    /// Takes the content header; `false` (give up) when the budget is spent.
    /// Bytes are copied so a held delivery does not pin a whole read buffer.
    pub fn header(&mut self, payload: &[u8], body_size: u64, budget: &Arc<Budget>) -> bool {
        let Some(reserved) = budget.reserve(payload.len() + body_size as usize) else {
            return false;
        };
        self.header = Some((Bytes::copy_from_slice(payload), reserved));
        self.body.reserve(body_size as usize);
        true
    }

    /// Appends a body frame's payload.
    pub fn body(&mut self, payload: &[u8]) {
        self.body.extend_from_slice(payload);
    }

    /// The captured message, once its content is complete.
    pub fn finish(self) -> Option<Captured> {
        let (header, reserved) = self.header?;
        Some(Captured {
            exchange: self.exchange,
            routing_key: self.routing_key,
            header,
            body: self.body.freeze(),
            policy: self.policy,
            _reserved: reserved,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_is_given_back_on_drop() {
        let budget = Budget::new(100);
        let a = budget.reserve(60).unwrap();
        assert!(budget.reserve(60).is_none());
        assert_eq!(budget.refused(), 1);
        drop(a);
        assert_eq!(budget.used(), 0);
        assert!(budget.reserve(100).is_some());
    }
}

//! The pieces of interception that do not need sockets: the capture budget,
//! captured messages, and how a settle that spans held tags is rewritten.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use crate::method;
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
            if used + bytes > self.limit {
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

/// How the client settled deliveries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settle {
    /// `basic.ack`
    Ack,
    /// `basic.nack` with this `requeue`.
    Nack(bool),
    /// `basic.reject` with this `requeue`.
    Reject(bool),
}

impl Settle {
    /// The frame settling one tag (or all up to it with `multiple`).
    pub fn frame(self, channel: u16, tag: u64, multiple: bool) -> Bytes {
        match self {
            Self::Ack => method::ack(channel, tag, multiple),
            Self::Nack(requeue) => method::nack(channel, tag, multiple, requeue),
            Self::Reject(requeue) if !multiple => method::reject(channel, tag, requeue),
            // reject has no `multiple`; a range is a nack with the same meaning.
            Self::Reject(requeue) => method::nack(channel, tag, true, requeue),
        }
    }

    /// Whether this settle asks the broker to requeue.
    pub fn requeue(self) -> bool {
        matches!(self, Self::Nack(true) | Self::Reject(true))
    }
}

/// Frames that settle `tags` (ascending) the way the client meant, without
/// settling a held tag: everything below the lowest held tag in one
/// `multiple` frame when the client used `multiple`, the rest one by one.
pub fn settle_frames(
    channel: u16,
    settle: Settle,
    tags: &[u64],
    lowest_held: Option<u64>,
    multiple: bool,
) -> Vec<Bytes> {
    let split = lowest_held.map_or(tags.len(), |held| tags.partition_point(|t| *t < held));
    let (below, above) = tags.split_at(split);
    let mut frames = Vec::new();
    match below {
        [] => {}
        [.., last] if multiple && below.len() > 1 => {
            frames.push(settle.frame(channel, *last, true))
        }
        _ => frames.extend(below.iter().map(|t| settle.frame(channel, *t, false))),
    }
    frames.extend(above.iter().map(|t| settle.frame(channel, *t, false)));
    frames
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Frame, FrameType};
    use amq_protocol::protocol::{basic, AMQPClass};

    fn decode(bytes: &Bytes) -> AMQPClass {
        let payload = Frame {
            kind: FrameType::Method,
            channel: 1,
            raw: bytes.clone(),
        }
        .payload();
        method::decode_any(&payload).unwrap()
    }

    fn ack(tag: u64, multiple: bool) -> AMQPClass {
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: tag,
            multiple,
        }))
    }

    #[test]
    fn ack_up_to_6_with_5_held_becomes_ack_up_to_4_and_ack_6() {
        let frames = settle_frames(1, Settle::Ack, &[1, 2, 3, 4, 6], Some(5), true);
        let got: Vec<AMQPClass> = frames.iter().map(decode).collect();
        assert_eq!(got, vec![ack(4, true), ack(6, false)]);
    }

    #[test]
    fn nothing_held_keeps_one_multiple_frame() {
        let frames = settle_frames(1, Settle::Nack(true), &[3, 4, 9], None, true);
        assert_eq!(frames.len(), 1);
        assert_eq!(
            decode(&frames[0]),
            AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                delivery_tag: 9,
                multiple: true,
                requeue: true
            }))
        );
    }

    #[test]
    fn held_first_tag_means_one_by_one() {
        let frames = settle_frames(1, Settle::Nack(false), &[2, 3], Some(1), true);
        let got: Vec<AMQPClass> = frames.iter().map(decode).collect();
        let nack = |t| {
            AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                delivery_tag: t,
                multiple: false,
                requeue: false,
            }))
        };
        assert_eq!(got, vec![nack(2), nack(3)]);
    }

    #[test]
    fn single_settles_stay_single() {
        let frames = settle_frames(1, Settle::Reject(true), &[7], None, false);
        assert_eq!(
            decode(&frames[0]),
            AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
                delivery_tag: 7,
                requeue: true
            }))
        );
        assert!(settle_frames(1, Settle::Ack, &[], Some(3), true).is_empty());
    }

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

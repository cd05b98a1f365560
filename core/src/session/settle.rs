//! Settles: how the client settled deliveries, and how a settle that spans
//! claimed tags is rewritten so that it never touches one.

use bytes::Bytes;

use crate::protocol::method;

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
    use crate::protocol::frame::{Frame, FrameType};
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
}

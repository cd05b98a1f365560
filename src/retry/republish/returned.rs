//! Matching a `basic.return` to the publish it belongs to.
//!
//! RabbitMQ sends the return of a mandatory publish before its confirm, on
//! the same channel, with the message's exchange, routing key and content
//! (header and body frames). Several publishes in flight can share an
//! exchange and a routing key; the content tells them apart. Two in-flight
//! publishes with the same exchange, key, header and body are the same
//! message as far as any consumer can tell, so taking the first of them is
//! exact too. RabbitMQ 4.3 returns the `headers` table with its entries
//! sorted by key, so their order is not part of the match.

use bytes::{Bytes, BytesMut};

use nackd_core::protocol::content;

use super::Publish;

/// A return whose content is arriving.
#[derive(Debug)]
pub(super) struct Returning {
    /// `312 NO_ROUTE` and the like.
    pub reply: String,
    exchange: String,
    routing_key: String,
    header: Option<Bytes>,
    body: BytesMut,
    body_size: u64,
    received: u64,
    /// Larger than anything in flight: it cannot match, so it is not kept.
    oversized: bool,
    limit: u64,
}

impl Returning {
    /// A return announced by its method frame; its content is kept up to
    /// `limit` bytes of body (the largest body in flight).
    pub(super) fn new(
        code: u16,
        text: &str,
        exchange: &str,
        routing_key: &str,
        limit: u64,
    ) -> Self {
        Self {
            reply: format!("{code} {text}"),
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
            header: None,
            body: BytesMut::new(),
            body_size: 0,
            received: 0,
            oversized: false,
            limit,
        }
    }

    /// Takes the content header; `true` when the return is complete.
    pub(super) fn on_header(&mut self, payload: Bytes) -> bool {
        self.body_size = nackd_core::protocol::content::body_size(&payload).unwrap_or(0);
        self.oversized = self.body_size > self.limit;
        self.header = Some(payload);
        self.body_size == 0
    }

    /// Takes a body frame; `true` when the return is complete.
    pub(super) fn on_body(&mut self, payload: &[u8]) -> bool {
        if !self.oversized {
            self.body.extend_from_slice(payload);
        }
        self.received += payload.len() as u64;
        self.received >= self.body_size
    }

    /// Whether its header frame arrived.
    pub(super) fn has_header(&self) -> bool {
        self.header.is_some()
    }

    /// Whether `p` is the publish this return carries (RabbitMQ 4.3
    /// returns the headers table sorted by key: the order does not count).
    fn carries(&self, p: &Publish) -> bool {
        !self.oversized
            && self
                .header
                .as_deref()
                .is_some_and(|h| content::same_properties(h, &p.header))
            && self.body[..] == p.body[..]
    }

    /// Whether `p` went to the same exchange with the same routing key.
    fn addressed_like(&self, p: &Publish) -> bool {
        p.exchange() == self.exchange && p.routing_key() == self.routing_key
    }
}

/// Which in-flight publish a complete return belongs to.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Match {
    /// This one (an index into the candidates given).
    Exact(usize),
    /// The content matches none of them (the broker changed it?): any of
    /// these may be the one, so each counts as returned, to be kept.
    Unsure(Vec<usize>),
}

/// Finds the publish `ret` is for among `inflight` (publish order; `true`
/// marks one already returned).
pub(super) fn find<'a>(
    ret: &Returning,
    inflight: impl Iterator<Item = (&'a Publish, bool)>,
) -> Match {
    let mut alike = Vec::new();
    for (i, (p, returned)) in inflight.enumerate() {
        if returned || !ret.addressed_like(p) {
            continue;
        }
        if ret.carries(p) {
            return Match::Exact(i);
        }
        alike.push(i);
    }
    Match::Unsure(alike)
}

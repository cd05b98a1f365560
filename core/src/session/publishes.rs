//! Delayed publishes inside a session: nackd emulates the archived
//! delayed-message plugin's `x-delayed-message` exchanges.
//!
//! - `exchange.declare` of that type with `x-delayed-type = T` goes to the
//!   broker as type `T` (its arguments kept), in its waiting form even when
//!   the client sent `nowait` (whose `declare-ok` then stays with nackd):
//!   the exchange becomes delayed ([`crate::delayed::DelayedExchanges`])
//!   only once the broker said yes to the client's own declare. A delete
//!   of a delayed exchange likewise: it is forgotten at the broker's
//!   `delete-ok`, a refused one leaves it delayed.
//! - A `basic.publish` to a delayed exchange (or to one whose delayed
//!   declare waits for the broker) is held until its content header says
//!   whether it carries `x-delay` > 0. If not, it goes to the broker as
//!   sent. If so, the whole message is taken, and the broker is asked
//!   whether it would take that publish from this client (`check`: the
//!   reserved channel); a publish it would refuse goes to the broker as
//!   sent, so that the client gets the broker's own refusal. One it would
//!   take is parked with [`Route::Delayed`] (the engine publishes it to the
//!   exchange when due), and on a confirm channel the publisher's
//!   `basic.ack` goes once it is stored (`basic.nack` if it cannot be);
//!   [`Renumber`] keeps the publisher's delivery tags its own while some
//!   publishes go to the broker and some to nackd.
//! - On a `tx.select` channel a delayed publish closes the connection
//!   with 540 NOT_IMPLEMENTED: nackd cannot make it part of a transaction.

//!
//! This file holds the state of delayed publishes: a publish being read
//! ([`Taking`], one per channel), the publishes taken until the store
//! answers ([`Taken`], by claim number), and the delayed declares the
//! broker has not answered ([`DelayedPublishes`], which owns the last
//! two). The session (`machine`) decides what the broker's answers mean.
//! A leaf: it names no session type, so the channel book can hold a
//! [`Taking`] and the declares and deletes it waits for.
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::capture::Reservation;
use crate::held::{ClaimKey, Park, Route, Ticket};
use crate::protocol::headers;

/// A publish to a delayed exchange whose content is being read.
#[derive(Debug)]
pub struct Taking {
    exchange: Arc<str>,
    /// Its routing key; `None` when not UTF-8 (or the method does not
    /// decode): nackd cannot keep it, so it does not take it with a delay.
    routing_key: Option<String>,
    /// Its method frame, as the client sent it.
    method: Bytes,
    /// Its frames after the method, as sent (kept while it may still go
    /// to the broker at once).
    content: BytesMut,
    /// The content header payload, once come.
    header: Option<Bytes>,
    body: BytesMut,
    /// Its share of the capture budget, taken at the header for the size
    /// it announces (memory is bounded by configuration, not by clients).
    _reserved: Option<Reservation>,
    /// It did not fit in the budget: its content is read and dropped, its
    /// publisher gets a nack.
    over_budget: bool,
}

impl Taking {
    /// A publish of `method` (the frame as sent) to `exchange` begins.
    pub(super) fn new(exchange: &str, routing_key: Option<&str>, method: Bytes) -> Self {
        Self {
            exchange: Arc::from(exchange),
            routing_key: routing_key.map(str::to_string),
            method,
            content: BytesMut::new(),
            header: None,
            body: BytesMut::new(),
            _reserved: None,
            over_budget: false,
        }
    }

    /// The exchange it is published to.
    pub(super) fn exchange(&self) -> &Arc<str> {
        &self.exchange
    }

    /// Whether its routing key is one nackd can keep.
    pub(super) fn has_routing_key(&self) -> bool {
        self.routing_key.is_some()
    }

    /// Whether it did not fit in the capture budget.
    pub(super) fn over_budget(&self) -> bool {
        self.over_budget
    }

    /// A content frame came (`raw`, as sent): kept unless over budget.
    pub(super) fn on_frame(&mut self, raw: &[u8]) {
        if !self.over_budget {
            self.content.extend_from_slice(raw);
        }
    }

    /// Its header came with a delay; `reserved` is its share of the
    /// budget, `None` when it did not fit (its content is dropped).
    pub(super) fn on_header(&mut self, payload: Bytes, reserved: Option<Reservation>) {
        match reserved {
            Some(r) => self._reserved = Some(r),
            None => {
                self.over_budget = true;
                self.content = BytesMut::new();
            }
        }
        self.header = Some(payload);
    }

    /// A body frame's payload came.
    pub(super) fn on_body(&mut self, payload: &[u8]) {
        if !self.over_budget {
            self.body.extend_from_slice(payload);
        }
    }

    /// Its method frame, as sent.
    pub(super) fn method(&self) -> &[u8] {
        &self.method
    }

    /// Its frames after the method, as sent.
    pub(super) fn content(&self) -> &[u8] {
        &self.content
    }

    /// The whole publish as sent: method and content frames.
    pub(super) fn raw(&self) -> Bytes {
        let mut raw = BytesMut::from(&self.method[..]);
        raw.extend_from_slice(&self.content);
        raw.freeze()
    }

    /// The park of it as claim `key` in `vhost`: held for its `x-delay`
    /// (at most [`crate::delayed::MAX_DELAY_MS`]), then published to its
    /// exchange with its routing key.
    pub(super) fn into_park(self, key: ClaimKey, vhost: Arc<str>) -> Park {
        let header = self.header.expect("a complete content has a header");
        let delay_ms = headers::delay_ms(&header)
            .expect("checked at the header")
            .min(crate::delayed::MAX_DELAY_MS);
        let header = headers::delivered_with_delay_spent(&header).map_or(header, Bytes::from);
        Park {
            key,
            vhost,
            queue: self.exchange.clone(),
            delay: std::time::Duration::from_millis(delay_ms),
            retry: 0,
            route: Route::Delayed {
                exchange: self.exchange.to_string(),
                routing_key: self.routing_key.expect("checked at the header"),
            },
            on_return: None,
            header,
            body: self.body.freeze(),
            ticket: Ticket::default(),
        }
    }
}

/// A publish nackd took, until the store answers.
pub(super) struct Taken {
    channel: u16,
    epoch: u64,
    /// The exchange it was published to.
    exchange: Arc<str>,
    /// The publisher's tag, on a confirm channel.
    tag: Option<u64>,
    /// The whole publish as sent: it goes to the broker if the broker
    /// would refuse it from this client (the refusal is then the broker's
    /// own), and on a channel without confirms if it cannot be stored
    /// (routed at once rather than nowhere).
    raw: Option<Bytes>,
    /// What is parked once the broker said it would take the publish.
    park: Option<Park>,
    /// The settle timeout gave it up (the publisher got a nack): a late
    /// stored copy is dropped.
    given_up: bool,
}

impl Taken {
    /// Publish `raw` to `exchange`, taken on channel `channel` (opening
    /// `epoch`) with the publisher's `tag`; `park` waits for the check.
    pub(super) fn new(
        (channel, epoch): (u16, u64),
        exchange: Arc<str>,
        tag: Option<u64>,
        raw: Bytes,
        park: Park,
    ) -> Self {
        Self {
            channel,
            epoch,
            exchange,
            tag,
            raw: Some(raw),
            park: Some(park),
            given_up: false,
        }
    }

    /// Its channel and that channel's opening.
    pub(super) fn channel(&self) -> (u16, u64) {
        (self.channel, self.epoch)
    }

    /// The exchange it was published to.
    pub(super) fn exchange(&self) -> &Arc<str> {
        &self.exchange
    }

    /// The publisher's tag, on a confirm channel.
    pub(super) fn tag(&self) -> Option<u64> {
        self.tag
    }

    /// The settle timeout gave it up: its publisher got a nack.
    pub(super) fn given_up(&self) -> bool {
        self.given_up
    }

    /// Taken on a channel without confirms: its publisher hears nothing.
    pub(super) fn unconfirmed(&self) -> bool {
        self.tag.is_none()
    }

    /// The broker would take it: the park to send. Only a publish without
    /// confirms still goes at once if it cannot be stored.
    pub(super) fn granted(&mut self) -> Park {
        if self.tag.is_some() {
            self.raw = None;
        }
        self.park.take().expect("a check is answered once")
    }

    /// The whole publish as sent, if it may still go to the broker.
    pub(super) fn into_raw(self) -> Option<Bytes> {
        self.raw
    }
}

/// A delayed `exchange.declare` the broker has not answered yet.
#[derive(Debug)]
pub struct Declared {
    name: Arc<str>,
    /// The real type it set.
    kind: String,
    /// The client sent `nowait`: the broker's `declare-ok` is nackd's.
    swallow: bool,
}

impl Declared {
    pub(super) fn new(name: Arc<str>, kind: String, swallow: bool) -> Self {
        Self {
            name,
            kind,
            swallow,
        }
    }

    /// The exchange, the real type it set, and whether the broker's
    /// answer is nackd's.
    pub(super) fn parts(&self) -> (&Arc<str>, &str, bool) {
        (&self.name, &self.kind, self.swallow)
    }
}

/// An `exchange.delete` of a delayed exchange the broker has not answered.
#[derive(Debug)]
pub struct Deleted {
    name: Arc<str>,
    /// The client sent `nowait`: the broker's `delete-ok` is nackd's.
    swallow: bool,
}

impl Deleted {
    pub(super) fn new(name: Arc<str>, swallow: bool) -> Self {
        Self { name, swallow }
    }

    /// The exchange, and whether the broker's answer is nackd's.
    pub(super) fn parts(&self) -> (&Arc<str>, bool) {
        (&self.name, self.swallow)
    }
}

/// The delayed publishes a session took and the delayed declares it
/// waits for (see the module).
#[derive(Default)]
pub(super) struct DelayedPublishes {
    /// Delayed publishes taken, until the store answers: claim number → it.
    taken: BTreeMap<u64, Taken>,
    /// Delayed declares of this session the broker has not answered, by
    /// exchange: publishes to them are taken meanwhile (a publish sent
    /// right after a declare must not go out at once).
    declaring: HashMap<Arc<str>, usize>,
}

impl DelayedPublishes {
    /// A delayed declare of `name` went to the broker.
    pub(super) fn declare_sent(&mut self, name: Arc<str>) {
        *self.declaring.entry(name).or_default() += 1;
    }

    /// A delayed declare of `name` is answered (yes or no).
    pub(super) fn declare_answered(&mut self, name: &Arc<str>) {
        if let Some(n) = self.declaring.get_mut(name) {
            *n -= 1;
            if *n == 0 {
                self.declaring.remove(name);
            }
        }
    }

    /// Whether a delayed declare of `name` waits for the broker.
    pub(super) fn declaring(&self, name: &str) -> bool {
        self.declaring.contains_key(name)
    }

    /// Whether no delayed declare waits for the broker.
    pub(super) fn none_declaring(&self) -> bool {
        self.declaring.is_empty()
    }

    /// The session ends: the declares never answered, with how many of each.
    pub(super) fn take_declaring(&mut self) -> HashMap<Arc<str>, usize> {
        std::mem::take(&mut self.declaring)
    }

    /// Claim `seq` is publish `taken`.
    pub(super) fn insert(&mut self, seq: u64, taken: Taken) {
        self.taken.insert(seq, taken);
    }

    /// Whether claim `seq` is a publish nackd took.
    pub(super) fn is_taken(&self, seq: u64) -> bool {
        self.taken.contains_key(&seq)
    }

    /// Publish `seq`, if claim `seq` is one.
    pub(super) fn get(&self, seq: u64) -> Option<&Taken> {
        self.taken.get(&seq)
    }

    /// Publish `seq`, to answer its check.
    pub(super) fn get_mut(&mut self, seq: u64) -> Option<&mut Taken> {
        self.taken.get_mut(&seq)
    }

    /// Claim `seq` is answered: its publish, if it was one.
    pub(super) fn remove(&mut self, seq: u64) -> Option<Taken> {
        self.taken.remove(&seq)
    }

    /// The settle timeout gives publish `seq` up (its publisher gets a
    /// nack): its channel and tag.
    pub(super) fn give_up(&mut self, seq: u64) -> Option<(u16, u64, Option<u64>)> {
        let taken = self.taken.get_mut(&seq)?;
        taken.given_up = true;
        Some((taken.channel, taken.epoch, taken.tag))
    }

    /// Publishes without confirms still waiting for the broker's check:
    /// the store never saw them (lost if the session ends now).
    pub(super) fn unchecked_unconfirmed(&self) -> usize {
        self.taken
            .values()
            .filter(|t| t.park.is_some() && t.unconfirmed() && !t.given_up)
            .count()
    }

    /// The session ends: every publish still taken.
    pub(super) fn take_all(&mut self) -> BTreeMap<u64, Taken> {
        std::mem::take(&mut self.taken)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::session::capture::Budget;

    fn park(seq: u64) -> Park {
        Park {
            key: ClaimKey {
                channel: 1,
                epoch: 1,
                tag: 0,
                seq,
            },
            vhost: Arc::from("/"),
            queue: Arc::from("x"),
            delay: Duration::from_secs(1),
            retry: 0,
            route: Route::Queue,
            on_return: None,
            header: Bytes::new(),
            body: Bytes::new(),
            ticket: Ticket::default(),
        }
    }

    /// A content header with `x-delay = 5000`.
    fn delayed_header() -> Bytes {
        use amq_protocol::protocol::BasicProperties;
        use amq_protocol::types::{AMQPValue, FieldTable};
        let mut h = FieldTable::default();
        h.insert("x-delay".into(), AMQPValue::LongLongInt(5000));
        let props = BasicProperties::default().with_headers(h);
        Bytes::from(crate::protocol::content::encode_header(60, 4, &props))
    }

    #[test]
    fn a_publish_being_taken_keeps_its_frames_and_its_message() {
        let mut t = Taking::new("x", Some("key"), Bytes::from_static(b"M"));
        assert!(t.has_routing_key() && !t.over_budget());
        t.on_frame(b"H");
        let budget = Budget::new(100);
        t.on_header(delayed_header(), budget.reserve(10));
        t.on_frame(b"B");
        t.on_body(b"body");
        assert_eq!((t.method(), t.content()), (&b"M"[..], &b"HB"[..]));
        assert_eq!(t.raw(), Bytes::from_static(b"MHB"));
        assert_eq!(budget.used(), 10, "its share of the budget is held");
        let key = ClaimKey {
            channel: 1,
            epoch: 1,
            tag: 0,
            seq: 1,
        };
        let park = t.into_park(key, Arc::from("/"));
        assert_eq!(park.delay, Duration::from_secs(5));
        let route = Route::Delayed {
            exchange: "x".into(),
            routing_key: "key".into(),
        };
        assert_eq!((park.route, &park.body[..]), (route, &b"body"[..]));
        assert_eq!(
            crate::protocol::headers::delay_ms(&park.header),
            None,
            "delivered with its delay spent"
        );
        assert_eq!(budget.used(), 0, "the budget is given back once parked");
    }

    #[test]
    fn a_publish_over_the_budget_drops_its_content() {
        let mut t = Taking::new("x", None, Bytes::from_static(b"M"));
        assert!(!t.has_routing_key());
        t.on_frame(b"H");
        t.on_header(Bytes::from_static(b"h"), None);
        assert!(t.over_budget());
        t.on_frame(b"B");
        t.on_body(b"body");
        assert_eq!(t.raw(), Bytes::from_static(b"M"), "only the method is kept");
    }

    #[test]
    fn a_granted_publish_of_a_confirm_channel_no_longer_goes_as_sent() {
        let raw = Bytes::from_static(b"raw");
        let mut confirmed = Taken::new((1, 2), Arc::from("x"), Some(5), raw.clone(), park(1));
        assert_eq!((confirmed.channel(), confirmed.tag()), ((1, 2), Some(5)));
        assert!(!confirmed.unconfirmed() && !confirmed.given_up());
        assert_eq!(confirmed.granted().key.seq, 1);
        assert_eq!(
            confirmed.into_raw(),
            None,
            "its publisher hears a nack instead"
        );
        let mut unconfirmed = Taken::new((1, 2), Arc::from("x"), None, raw.clone(), park(2));
        assert!(unconfirmed.unconfirmed());
        unconfirmed.granted();
        assert_eq!(
            unconfirmed.into_raw(),
            Some(raw),
            "routed at once if not stored"
        );
    }

    #[test]
    fn taken_publishes_are_found_by_claim_number_and_given_up_once() {
        let mut p = DelayedPublishes::default();
        let raw = Bytes::from_static(b"raw");
        p.insert(
            3,
            Taken::new((1, 2), Arc::from("x"), Some(7), raw.clone(), park(3)),
        );
        p.insert(4, Taken::new((1, 2), Arc::from("x"), None, raw, park(4)));
        assert!(p.is_taken(3) && p.is_taken(4) && !p.is_taken(5));
        assert_eq!(p.unchecked_unconfirmed(), 1, "claim 4 has no confirms");
        assert_eq!(p.give_up(3), Some((1, 2, Some(7))));
        assert!(p.get_mut(3).is_some_and(|t| t.given_up()));
        assert_eq!(p.give_up(5), None);
        p.get_mut(4).expect("taken").granted();
        assert_eq!(p.unchecked_unconfirmed(), 0, "parked: the store has it");
        assert!(p.remove(3).is_some_and(|t| t.given_up()));
        assert_eq!(p.take_all().keys().copied().collect::<Vec<_>>(), vec![4]);
        assert!(!p.is_taken(4));
    }

    #[test]
    fn declares_are_counted_per_exchange_until_answered() {
        let mut p = DelayedPublishes::default();
        let x: Arc<str> = Arc::from("x");
        assert!(p.none_declaring());
        p.declare_sent(x.clone());
        p.declare_sent(x.clone());
        assert!(p.declaring("x") && !p.declaring("y"));
        p.declare_answered(&x);
        assert!(p.declaring("x"), "one is still unanswered");
        p.declare_answered(&x);
        assert!(p.none_declaring());
        p.declare_answered(&x);
        assert!(p.none_declaring(), "an answer too many changes nothing");
        p.declare_sent(x.clone());
        assert_eq!(p.take_declaring().get(&x), Some(&1));
        assert!(p.none_declaring());
    }

    #[test]
    fn declares_and_deletes_say_what_the_broker_answer_means() {
        let d = Declared::new(Arc::from("x"), "direct".into(), true);
        assert_eq!(d.parts(), (&Arc::from("x"), "direct", true));
        let d = Deleted::new(Arc::from("x"), false);
        assert_eq!(d.parts(), (&Arc::from("x"), false));
    }
}

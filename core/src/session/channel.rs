//! What nackd tracks per AMQP channel: consumers and their queues, pending
//! `basic.get`s, tx mode, content in flight, and outstanding deliveries.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use amq_protocol::protocol::{basic, channel, confirm, queue, tx, AMQPClass};
use bytes::Bytes;

use crate::session::capture::{Budget, Captured, Capturing};
use crate::session::settle::Settle;

use super::confirms::Renumber;
use super::consumer::ConsumerRef;
use super::peer::Peer;
use super::publishes::{Declared, Deleted, Taking};

use crate::protocol::content;
use crate::protocol::frame::{Frame, FrameError, FrameType};
use crate::protocol::method::MethodId;

/// A consumer registered on the channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Consumer {
    /// Queue it consumes from (resolved if the client gave an empty name).
    pub queue: Arc<str>,
    /// Deliveries are acked by the broker on send.
    pub no_ack: bool,
    /// Which `basic.consume` of the channel it is (0: a `basic.get`): a
    /// tag is free again once its consumer is cancelled.
    started: u64,
    /// The empty name means the queue of this declare (counted on the
    /// channel), whose `declare-ok` has not named it yet.
    after_declare: Option<u64>,
}

/// A delivery the client still has to ack, nack or reject.
#[derive(Debug)]
pub struct Delivery {
    /// Queue the message came from.
    pub queue: Arc<str>,
    /// The consumer it was delivered to, by tag and which consume of the
    /// channel it was (`None`: a `basic.get`).
    pub consumer: Option<(Arc<str>, u64)>,
    /// The broker cancelled that consumer since: RabbitMQ 4.3 returns a
    /// timed-out consumer's deliveries to the queue and sends
    /// `basic.cancel`, so the message is in the queue again and holding a
    /// copy too would deliver it twice.
    pub returned: bool,
    /// The message, when its queue is intercepted and the budget allowed.
    pub capture: Option<Captured>,
    /// Its queue is intercepted but the capture budget was spent.
    pub over_budget: bool,
}

/// Where a content (header + bodies) is in one direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ContentState {
    /// No content expected: a method may come.
    #[default]
    Idle,
    /// A content-bearing method came; its header must follow.
    Header,
    /// Body frames must follow, this many bytes still.
    Body(u64),
}

impl ContentState {
    /// Checks `frame` against the state and moves on. Methods inside a
    /// content, or content frames without a method, are 505 unexpected-frame.
    pub fn advance(&mut self, frame: &Frame, method: Option<MethodId>) -> Result<(), FrameError> {
        *self = match (*self, frame.kind) {
            (Self::Idle, FrameType::Method) => match method {
                Some(id) if id.carries_content() => Self::Header,
                _ => Self::Idle,
            },
            (Self::Header, FrameType::Header) => match content::body_size(&frame.raw[7..])? {
                0 => Self::Idle,
                n => Self::Body(n),
            },
            (Self::Body(left), FrameType::Body) => {
                let len = (frame.raw.len() - crate::protocol::frame::FRAME_OVERHEAD) as u64;
                match left.checked_sub(len) {
                    Some(0) => Self::Idle,
                    Some(rest) => Self::Body(rest),
                    None => {
                        return Err(FrameError::Unexpected(
                            "body frames longer than the announced size",
                        ))
                    }
                }
            }
            (Self::Idle, FrameType::Header) => {
                return Err(FrameError::Unexpected("content header without a method"))
            }
            (Self::Idle, FrameType::Body) => {
                return Err(FrameError::Unexpected("content body without a header"))
            }
            (_, FrameType::Method) => {
                return Err(FrameError::Unexpected("method frame inside a content"))
            }
            (Self::Header, FrameType::Body) => {
                return Err(FrameError::Unexpected("content body before its header"))
            }
            (Self::Body(_), FrameType::Header) => {
                return Err(FrameError::Unexpected("second content header"))
            }
            (state, FrameType::Heartbeat) => state,
        };
        Ok(())
    }

    /// Whether a content is being sent (an injected frame must wait).
    pub fn in_flight(self) -> bool {
        self != Self::Idle
    }
}

/// Consumers a channel remembers after their `nowait` cancel.
const LINGERING: usize = 16;

/// The `exchange.declare`s and `exchange.delete`s of a channel the broker
/// has not answered, in order (`Some`: a delayed one).
pub type ExchangeChanges = (VecDeque<Option<Declared>>, VecDeque<Option<Deleted>>);

/// Where a publish nackd gives back to the broker goes (see
/// [`Channel::hand_back`]).
#[derive(Debug, PartialEq, Eq)]
pub enum HandBack {
    /// Kept until the client content going upstream on the channel ends.
    Kept,
    /// Behind the barrier at this offset, before the channel's close or
    /// `tx.select` waiting there: the client sent the publish first.
    Before(usize, Bytes),
    /// Upstream now, in the client's order (behind a barrier if one is up).
    Send(Bytes),
}

/// A claimed tag waiting for the store.
#[derive(Clone, Debug)]
pub struct Claimed {
    /// How the client settled it (what goes to the broker if nackd cannot
    /// hold it).
    pub settle: Settle,
    /// The claim's number in its session.
    pub seq: u64,
    /// How long a deferral waits if the store refuses it (the delay it is
    /// parked for; `None`, the fallback, once its schedule is exhausted).
    pub delay: Option<std::time::Duration>,
    /// The consumer its delivery went to (`None`: a `basic.get`).
    pub from: Option<ConsumerRef>,
}

/// One channel of one client connection.
#[derive(Debug, Default)]
pub struct Channel {
    consumers: HashMap<Arc<str>, Consumer>,
    /// Tags of the client's `basic.cancel`s waiting for `cancel-ok`.
    cancels: Vec<Arc<str>>,
    /// Nowait consumers whose tag was sent while cancels of it wait for
    /// their `cancel-ok` (oldest first), with how many: until those come,
    /// the broker delivers under that tag to the consumer it cancels.
    reusing: Vec<(Arc<str>, usize, Consumer)>,
    /// Consumers the client cancelled with `nowait` (newest last, at most
    /// [`LINGERING`]): no `cancel-ok` says when the broker stopped, so
    /// deliveries it sent before the cancel are still theirs when they
    /// come (a settle nackd rewrites must cover them).
    lingering: Vec<(Arc<str>, Consumer)>,
    /// `basic.consume` sent without nowait, waiting for `consume-ok`.
    pending_consumes: VecDeque<Consumer>,
    /// `basic.get` sent, waiting for `get-ok` / `get-empty`.
    pending_gets: VecDeque<Consumer>,
    /// Last queue declared on the channel (an empty queue name means it).
    last_queue: Option<Arc<str>>,
    /// `queue.declare`s sent that the broker answers (not nowait).
    declares_sent: u64,
    /// `declare-ok`s received.
    declares_answered: u64,
    /// `declares_sent` when the last nowait declare named its queue.
    named_nowait_at: Option<u64>,
    /// `tx.select` was sent: nothing on this channel is intercepted.
    tx: bool,
    /// `confirm.select` was sent.
    confirm: bool,
    /// Client to broker content (a publish).
    publishing: ContentState,
    /// Broker to client content (a delivery, get-ok or return).
    delivering: ContentState,
    outstanding: BTreeMap<u64, Delivery>,
    /// `basic.consume`s the client sent on the channel.
    consumes: u64,
    /// Which opening of this channel number this is.
    epoch: u64,
    /// The delivery whose content is being captured.
    capturing: Option<Capturing>,
    /// Claimed tags waiting for the store, with how the client settled them.
    pending: BTreeMap<u64, Claimed>,
    /// Number of the last claim made on this channel.
    last_claim: u64,
    /// A close, recover or `tx.select` of the client on this channel waits
    /// behind the barrier: no new claim is made here.
    barrier_raised: bool,
    /// Claimed tags the client settled a second time: that settle went to
    /// the broker, so nackd neither acks them nor keeps their copy.
    settled_again: BTreeSet<u64>,
    /// Frames of nackd's own (acks, nacks) to send once the client's publish
    /// in flight on this channel ends, with the held id an ack stands for.
    after_publish: Vec<(Bytes, Option<u64>)>,
    /// The publish in flight began while client frames waited behind a
    /// barrier: all of its frames wait there, none has gone upstream yet.
    publish_behind_barrier: bool,
    /// The broker closed the channel: it takes unacked deliveries back.
    closing: bool,
    /// Publishes since `confirm.select`: the publisher's number of the last.
    published: u64,
    /// The publisher's and the broker's numbering of confirms, once nackd
    /// took a publish of this confirm channel.
    renumber: Option<Box<Renumber>>,
    /// A publish to a delayed exchange whose content is being read.
    taking: Option<Box<Taking>>,
    /// Frames of nackd's own to the client (confirms) waiting for the
    /// broker's content in flight on this channel to end.
    to_client_after: Vec<Bytes>,
    /// `exchange.declare`s sent that the broker answers, in order: for a
    /// delayed one, the registry's entry before it (to restore if the
    /// broker refuses it).
    exchange_declares: VecDeque<Option<Declared>>,
    /// `exchange.delete`s sent that the broker answers: the exchanges,
    /// forgotten as delayed at their `delete-ok`.
    exchange_deletes: VecDeque<Option<Deleted>>,
    /// Publishes nackd took and gives back to the broker as sent, waiting
    /// for the client content going upstream on this channel to end (they
    /// follow it, in the client's order).
    handed_over: Vec<Bytes>,
    /// The client's `channel.close` or `tx.select` on this channel waits
    /// behind the barrier at this offset: a publish nackd gives back goes
    /// before it, where the client sent it.
    end_behind: Option<usize>,
    /// The client sent `channel.close` on this channel.
    client_closed: bool,
    /// A publish nackd gave back here is one the broker refuses: it closes
    /// the channel, and discards the client's later publishes, so nackd
    /// takes none of them either.
    refused: bool,
    /// Log span of this channel (a child of the connection's span).
    span: Option<tracing::Span>,
}

impl Channel {
    /// The consumer of `queue` as the broker will resolve it: an empty
    /// name is the channel's last declared queue, which may be one whose
    /// `declare-ok` is still on its way (pipelined frames).
    fn consumer_of(&self, queue: &str, no_ack: bool) -> Consumer {
        let awaited = self.declares_answered < self.declares_sent
            && self
                .named_nowait_at
                .is_none_or(|at| at < self.declares_sent);
        let (queue, after_declare) = match (queue.is_empty(), &self.last_queue) {
            (true, _) if awaited => (Arc::from(""), Some(self.declares_sent)),
            (true, Some(last)) => (last.clone(), None),
            _ => (Arc::from(queue), None),
        };
        Consumer {
            queue,
            no_ack,
            started: 0,
            after_declare,
        }
    }

    /// A `declare-ok` names the queue of declare number `n`.
    fn on_declare_ok(&mut self, name: &str) {
        self.declares_answered += 1;
        let n = self.declares_answered;
        let name: Arc<str> = Arc::from(name);
        if self.named_nowait_at.is_none_or(|at| at < n) {
            self.last_queue = Some(name.clone());
        }
        let waiting = self
            .pending_consumes
            .iter_mut()
            .chain(self.pending_gets.iter_mut())
            .chain(self.consumers.values_mut())
            .chain(self.reusing.iter_mut().map(|(_, _, c)| c));
        for consumer in waiting.filter(|c| c.after_declare == Some(n)) {
            consumer.queue = name.clone();
            consumer.after_declare = None;
        }
    }

    /// A content frame from the broker: feeds the capture in progress; a
    /// delivery over the capture `budget` is marked so (its nack is
    /// deferred), a whole one keeps its capture.
    pub fn capture_content(&mut self, frame: &Frame, budget: &Arc<Budget>) {
        let Some(capturing) = self.capturing.as_mut() else {
            return;
        };
        let payload = frame.payload_slice();
        match frame.kind {
            FrameType::Header => {
                let size = content::body_size(payload).unwrap_or(0);
                if !capturing.header(payload, size, budget) {
                    let tag = capturing.tag;
                    self.capturing = None;
                    if let Some(delivery) = self.delivery_mut(tag) {
                        delivery.over_budget = true;
                    }
                    let refused = budget.refused();
                    if refused.is_power_of_two() {
                        tracing::warn!(
                            refused,
                            used = budget.used(),
                            "capture budget spent: nacks of such deliveries are deferred"
                        );
                    }
                    return;
                }
            }
            FrameType::Body => capturing.body(payload),
            _ => return,
        }
        if !self.delivering.in_flight() {
            let capturing = self.capturing.take().expect("checked above");
            let tag = capturing.tag;
            if let (Some(captured), Some(delivery)) = (capturing.finish(), self.delivery_mut(tag)) {
                delivery.capture = Some(captured);
            }
        }
    }

    /// Whether a publish nackd gives back may still go on this channel:
    /// not once the broker closes it, or the client's close went upstream
    /// (`barrier_up`: a close behind the barrier has not).
    pub fn takes_hand_back(&self, barrier_up: bool) -> bool {
        !self.closing && (!self.client_closed || (barrier_up && self.end_behind.is_some()))
    }

    /// Publish `raw` nackd took (`tag`: the publisher's, on a confirm
    /// channel) goes back to the broker as sent: numbered by the broker
    /// from now on, and placed where the client sent it.
    pub fn hand_back(&mut self, tag: Option<u64>, raw: Bytes, barrier_up: bool) -> HandBack {
        match tag {
            // The broker numbers it now: its confirm is the publisher's.
            Some(tag) => {
                if let Some(r) = self.renumber.as_mut() {
                    r.hand_over(tag);
                }
            }
            None if self.confirm => {
                // `confirm.select` came since: the broker numbers this
                // publish, its publisher does not. The next publish the
                // publisher numbers is one not yet accounted for.
                let next = self.published + 1 - u64::from(self.is_taking());
                self.renumber_from(next).extra();
            }
            None => {}
        }
        if self.publishing.in_flight() && !self.is_taking() {
            // After the client content going upstream on this channel
            // (a publish nackd is reading sent nothing upstream yet, and
            // its number comes after this one's).
            self.handed_over.push(raw);
            return HandBack::Kept;
        }
        match (barrier_up, self.end_behind) {
            (true, Some(at)) => HandBack::Before(at, raw),
            _ => HandBack::Send(raw),
        }
    }

    /// The delivery of `capturing` is captured as its content comes.
    pub fn start_capture(&mut self, capturing: Capturing) {
        self.capturing = Some(capturing);
    }

    /// A publish to a delayed exchange begins: its content is read here.
    pub fn start_taking(&mut self, taking: Box<Taking>) {
        self.taking = Some(taking);
    }

    /// Whether a publish to a delayed exchange is being read.
    pub fn is_taking(&self) -> bool {
        self.taking.is_some()
    }

    /// The publish being read, if any.
    pub fn taking_mut(&mut self) -> Option<&mut Taking> {
        self.taking.as_deref_mut()
    }

    /// Ends reading the publish (it is whole, or goes on as sent).
    pub fn take_taking(&mut self) -> Option<Box<Taking>> {
        self.taking.take()
    }

    /// A publish goes to the broker: the broker numbers it (once nackd
    /// renumbers this channel's confirms).
    pub fn forward_publish(&mut self) {
        if let Some(r) = self.renumber.as_mut() {
            r.forward();
        }
    }

    /// The channel's two numberings of confirms, once nackd took a publish.
    pub fn renumber_mut(&mut self) -> Option<&mut Renumber> {
        self.renumber.as_deref_mut()
    }

    /// The channel's two numberings, begun at the publisher's `next`
    /// number if nackd renumbers nothing yet.
    pub fn renumber_from(&mut self, next: u64) -> &mut Renumber {
        self.renumber
            .get_or_insert_with(|| Box::new(Renumber::new(next)))
    }

    /// Whether `tx.select` was sent: nothing on this channel is intercepted.
    pub fn tx(&self) -> bool {
        self.tx
    }

    /// Whether `confirm.select` was sent.
    pub fn confirm(&self) -> bool {
        self.confirm
    }

    /// Which opening of this channel number this is.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The log span of this channel.
    pub fn span(&self) -> tracing::Span {
        self.span.clone().unwrap_or_else(tracing::Span::none)
    }

    /// Client to broker content (a publish).
    pub fn publishing(&self) -> ContentState {
        self.publishing
    }

    /// Broker to client content (a delivery, get-ok or return).
    pub fn delivering(&self) -> ContentState {
        self.delivering
    }

    /// Checks `frame` from `peer` against the content state of the
    /// direction it goes, and moves it on (see [`ContentState::advance`]).
    pub fn advance(
        &mut self,
        peer: Peer,
        frame: &Frame,
        method: Option<MethodId>,
    ) -> Result<(), FrameError> {
        match peer {
            Peer::Client => self.publishing.advance(frame, method),
            Peer::Upstream => self.delivering.advance(frame, method),
        }
    }

    /// The broker closed the channel (`channel.close`).
    pub fn on_broker_close(&mut self) {
        self.closing = true;
    }

    /// Whether the broker closed the channel: it takes unacked deliveries back.
    pub fn closing(&self) -> bool {
        self.closing
    }

    /// The client sent `channel.close`.
    pub fn on_client_close(&mut self) {
        self.client_closed = true;
    }

    /// Whether the client sent `channel.close`.
    pub fn client_closed(&self) -> bool {
        self.client_closed
    }

    /// A publish nackd gave back here is one the broker refuses.
    pub fn on_refused_publish(&mut self) {
        self.refused = true;
    }

    /// Whether the broker refuses a publish nackd gave back here (it
    /// discards the client's later publishes).
    pub fn refused(&self) -> bool {
        self.refused
    }

    /// A client `basic.publish`: counted on a confirm channel.
    pub fn count_publish(&mut self) {
        if self.confirm {
            self.published += 1;
        }
    }

    /// Publishes since `confirm.select`: the publisher's number of the last.
    pub fn published(&self) -> u64 {
        self.published
    }

    /// Whether publishes nackd gave back wait for the client's content.
    pub fn has_handed_over(&self) -> bool {
        !self.handed_over.is_empty()
    }

    /// Takes the publishes nackd gave back, in the client's order.
    pub fn take_handed_over(&mut self) -> Vec<Bytes> {
        std::mem::take(&mut self.handed_over)
    }

    /// A frame of nackd's own to the client waits for the broker's content
    /// in flight here to end.
    pub fn wait_for_delivery(&mut self, frame: Bytes) {
        self.to_client_after.push(frame);
    }

    /// Whether frames of nackd's own wait for the broker's content.
    pub fn waits_for_delivery(&self) -> bool {
        !self.to_client_after.is_empty()
    }

    /// Takes the frames of nackd's own that waited for the broker's content.
    pub fn take_to_client_after(&mut self) -> Vec<Bytes> {
        std::mem::take(&mut self.to_client_after)
    }

    /// An `exchange.declare` the broker answers went (`Some`: a delayed one).
    pub fn expect_declare_ok(&mut self, declared: Option<Declared>) {
        self.exchange_declares.push_back(declared);
    }

    /// An `exchange.delete` the broker answers went (`Some`: of a delayed
    /// exchange).
    pub fn expect_delete_ok(&mut self, deleted: Option<Deleted>) {
        self.exchange_deletes.push_back(deleted);
    }

    /// The broker's `declare-ok`: the declare it answers, if one was expected.
    pub fn declare_ok(&mut self) -> Option<Option<Declared>> {
        self.exchange_declares.pop_front()
    }

    /// The broker's `delete-ok`: the delete it answers, if one was expected.
    pub fn delete_ok(&mut self) -> Option<Option<Deleted>> {
        self.exchange_deletes.pop_front()
    }

    /// The broker closes the channel: the declares and deletes it never
    /// answered.
    pub fn take_exchange_changes(&mut self) -> ExchangeChanges {
        (
            std::mem::take(&mut self.exchange_declares),
            std::mem::take(&mut self.exchange_deletes),
        )
    }

    /// Claim `claimed` of tag `tag` waits for the store.
    pub fn claim(&mut self, tag: u64, claimed: Claimed) {
        self.last_claim = claimed.seq;
        self.pending.insert(tag, claimed);
    }

    /// A delayed publish of this channel was taken as claim `seq`.
    pub fn took_publish(&mut self, seq: u64) {
        self.last_claim = seq;
    }

    /// Whether tag `tag` is claimed and waits for the store.
    pub fn is_claimed(&self, tag: u64) -> bool {
        self.pending.contains_key(&tag)
    }

    /// The lowest claimed tag waiting for the store.
    pub fn lowest_claimed(&self) -> Option<u64> {
        self.pending.keys().next().copied()
    }

    /// The client settled claimed tag `tag` a second time: that settle
    /// went to the broker, so nackd neither acks it nor keeps its copy.
    pub fn settle_again(&mut self, tag: u64) {
        self.settled_again.insert(tag);
    }

    /// The store answered for claimed tag `tag`: its claim, unless the
    /// client settled it again meanwhile (then nackd steps back).
    pub fn take_claim(&mut self, tag: u64) -> Option<Claimed> {
        let claimed = self.pending.remove(&tag)?;
        (!self.settled_again.remove(&tag)).then_some(claimed)
    }

    /// Forgets claimed tag `tag` (the broker took it back).
    pub fn drop_claim(&mut self, tag: u64) {
        self.pending.remove(&tag);
        self.settled_again.remove(&tag);
    }

    /// A close, recover or `tx.select` of the client on this channel waits
    /// behind the barrier: no new claim is made here. Returns the number
    /// of the last claim made on it, which the barrier waits for.
    pub fn raise_barrier(&mut self) -> u64 {
        self.barrier_raised = true;
        self.last_claim
    }

    /// Whether a close, recover or `tx.select` of this channel waits
    /// behind the barrier.
    pub fn barrier_raised(&self) -> bool {
        self.barrier_raised
    }

    /// A client publish begins (its method goes upstream, or behind the
    /// barrier when `behind_barrier`): its content follows it there.
    pub fn publish_begins(&mut self, behind_barrier: bool) {
        self.publish_behind_barrier = behind_barrier;
    }

    /// Whether the publish in flight waits behind the barrier.
    pub fn publish_behind_barrier(&self) -> bool {
        self.publish_behind_barrier
    }

    /// A frame of nackd's own (`held`: the stored copy an ack stands for)
    /// waits for the client's publish in flight to end.
    pub fn wait_for_publish(&mut self, frame: Bytes, held: Option<u64>) {
        self.after_publish.push((frame, held));
    }

    /// Whether frames of nackd's own wait for the client's publish.
    pub fn waits_for_publish(&self) -> bool {
        !self.after_publish.is_empty()
    }

    /// Takes the frames of nackd's own that waited for the client's publish.
    pub fn take_after_publish(&mut self) -> Vec<(Bytes, Option<u64>)> {
        std::mem::take(&mut self.after_publish)
    }

    /// The client's `channel.close` or `tx.select` goes behind the barrier
    /// at offset `at` (the first one's place is kept).
    pub fn end_behind_at(&mut self, at: usize) {
        self.end_behind.get_or_insert(at);
    }

    /// Where the client's close or `tx.select` of this channel waits
    /// behind the barrier.
    pub fn end_behind(&self) -> Option<usize> {
        self.end_behind
    }

    /// Observes a method the client sends on this channel.
    pub fn on_client_method(&mut self, class: &AMQPClass) {
        match class {
            AMQPClass::Queue(queue::AMQPMethod::Declare(d)) if !d.nowait => {
                self.declares_sent += 1;
            }
            AMQPClass::Queue(queue::AMQPMethod::Declare(d)) if !d.queue.as_str().is_empty() => {
                self.last_queue = Some(Arc::from(d.queue.as_str()));
                self.named_nowait_at = Some(self.declares_sent);
            }
            AMQPClass::Basic(basic::AMQPMethod::Consume(c)) => self.on_consume(c),
            AMQPClass::Basic(basic::AMQPMethod::Cancel(c)) if c.nowait => {
                self.on_nowait_cancel(c.consumer_tag.as_str());
            }
            AMQPClass::Basic(basic::AMQPMethod::Cancel(c)) => {
                self.cancels.push(Arc::from(c.consumer_tag.as_str()));
            }
            AMQPClass::Basic(basic::AMQPMethod::Get(g)) => {
                let get = self.consumer_of(g.queue.as_str(), g.no_ack);
                self.pending_gets.push_back(get);
            }
            AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => {
                self.take_covered(a.delivery_tag, a.multiple);
            }
            AMQPClass::Basic(basic::AMQPMethod::Nack(n)) => {
                self.take_covered(n.delivery_tag, n.multiple);
            }
            AMQPClass::Basic(basic::AMQPMethod::Reject(r)) => {
                self.take_covered(r.delivery_tag, false);
            }
            AMQPClass::Basic(
                basic::AMQPMethod::Recover(_) | basic::AMQPMethod::RecoverAsync(_),
            ) => {
                self.outstanding.clear();
            }
            AMQPClass::Tx(tx::AMQPMethod::Select(_)) => self.tx = true,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(_)) => self.confirm = true,
            _ => {}
        }
    }

    /// The client's `basic.consume`.
    fn on_consume(&mut self, c: &basic::Consume) {
        self.consumes += 1;
        let consumer = Consumer {
            started: self.consumes,
            ..self.consumer_of(c.queue.as_str(), c.no_ack)
        };
        let tag = c.consumer_tag.as_str();
        let cancels = self.cancels.iter().filter(|t| &***t == tag).count();
        if !c.nowait {
            self.pending_consumes.push_back(consumer);
        } else if cancels > 0 {
            // The broker applies those cancels first.
            self.reusing.push((Arc::from(tag), cancels, consumer));
        } else {
            self.lingering.retain(|(t, _)| &**t != tag);
            self.consumers.insert(Arc::from(tag), consumer);
        }
    }

    /// The client's `basic.cancel` of `tag` with `nowait`: it cancels the
    /// newest consumer of the tag.
    fn on_nowait_cancel(&mut self, tag: &str) {
        if let Some(at) = self.reusing.iter().rposition(|(t, ..)| &**t == tag) {
            self.reusing.remove(at);
        } else if let Some((tag, consumer)) = self.consumers.remove_entry(tag) {
            if self.lingering.len() == LINGERING {
                self.lingering.remove(0);
            }
            self.lingering.push((tag, consumer));
        }
    }

    /// Observes a method the broker sends on this channel.
    /// A `basic.deliver` to `consumer_tag`: tracked as outstanding unless
    /// its consumer does not ack (the consumer's tag is shared, not copied).
    pub fn on_deliver(&mut self, consumer_tag: &str, delivery_tag: u64) {
        let lingering = || {
            let found = self
                .lingering
                .iter()
                .rev()
                .find(|(t, _)| &**t == consumer_tag);
            found.map(|(t, c)| (t, c))
        };
        let Some((tag, consumer)) = self
            .consumers
            .get_key_value(consumer_tag)
            .or_else(lingering)
        else {
            return;
        };
        if consumer.no_ack {
            return;
        }
        let delivery = Delivery {
            queue: consumer.queue.clone(),
            consumer: Some((tag.clone(), consumer.started)),
            returned: false,
            capture: None,
            over_budget: false,
        };
        self.outstanding.insert(delivery_tag, delivery);
    }

    pub fn on_broker_method(&mut self, class: &AMQPClass) {
        match class {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(d)) => {
                self.on_declare_ok(d.queue.as_str())
            }
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(ok)) => {
                if let Some(consumer) = self.pending_consumes.pop_front() {
                    let tag = ok.consumer_tag.as_str();
                    self.lingering.retain(|(t, _)| &**t != tag);
                    self.consumers.insert(Arc::from(tag), consumer);
                }
            }
            AMQPClass::Basic(basic::AMQPMethod::CancelOk(ok)) => {
                self.on_cancel_ok(ok.consumer_tag.as_str());
            }
            // The broker cancels a consumer (queue deleted, failover, a
            // consumer timeout on 4.3, which returns its deliveries).
            AMQPClass::Basic(basic::AMQPMethod::Cancel(c)) => {
                self.broker_cancelled(c.consumer_tag.as_str());
            }
            AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) => {
                self.on_deliver(d.consumer_tag.as_str(), d.delivery_tag)
            }
            AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) => {
                if let Some(get) = self.pending_gets.pop_front() {
                    if !get.no_ack {
                        self.outstanding.insert(
                            ok.delivery_tag,
                            Delivery {
                                queue: get.queue,
                                consumer: None,
                                returned: false,
                                capture: None,
                                over_budget: false,
                            },
                        );
                    }
                }
            }
            AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_)) => {
                self.pending_gets.pop_front();
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(_)) => {}
            _ => {}
        }
    }

    /// The broker answered a cancel of `tag`: that consumer is gone, and a
    /// nowait consumer sent after the cancels of `tag` is the broker's once
    /// the last of them is answered.
    fn on_cancel_ok(&mut self, tag: &str) {
        if let Some(at) = self.cancels.iter().position(|t| &**t == tag) {
            self.cancels.remove(at);
        }
        self.consumers.remove(tag);
        let mut next = None;
        for (at, (t, waits, _)) in self.reusing.iter_mut().enumerate() {
            if &**t == tag {
                *waits = waits.saturating_sub(1);
                if *waits == 0 && next.is_none() {
                    next = Some(at);
                }
            }
        }
        if let Some(at) = next {
            let (tag, _, consumer) = self.reusing.remove(at);
            self.consumers.insert(tag, consumer);
        }
    }

    /// The broker cancelled consumer `tag` and may have taken its
    /// deliveries back: they are marked `returned`. Only that consumer's:
    /// an earlier consumer with the same tag (cancelled by the client, the
    /// tag reused) keeps its deliveries. If the client's own nowait cancel
    /// crossed this one, the consumer is the latest with that tag.
    /// The broker cancelled consumer `tag`: its deliveries may be back in
    /// their queue. Those still outstanding are marked returned, and claims
    /// of them waiting for the store are left to the broker (no ack, the
    /// held copy cancelled: see `on_parked`). Returns the consumer.
    pub fn broker_cancelled(&mut self, tag: &str) -> Option<ConsumerRef> {
        let of_tag = |from: &Option<ConsumerRef>| match from {
            Some((t, started)) if &**t == tag => Some(*started),
            _ => None,
        };
        let started = match self.consumers.remove(tag) {
            Some(consumer) => Some(consumer.started),
            None => self
                .outstanding
                .values()
                .filter_map(|d| of_tag(&d.consumer))
                .chain(self.pending.values().filter_map(|c| of_tag(&c.from)))
                .max(),
        };
        for d in self.outstanding.values_mut() {
            if started.is_some() && of_tag(&d.consumer) == started {
                d.returned = true;
                d.capture = None;
            }
        }
        for (t, claimed) in &self.pending {
            if started.is_some() && of_tag(&claimed.from) == started {
                self.settled_again.insert(*t);
            }
        }
        started.map(|s| (Arc::from(tag), s))
    }

    /// Removes and returns the deliveries a settle covers, in tag order
    /// (`multiple` with tag 0 means all of them, as in the spec).
    pub fn take_covered(&mut self, tag: u64, multiple: bool) -> Vec<(u64, Delivery)> {
        match (multiple, tag) {
            (true, 0) => std::mem::take(&mut self.outstanding).into_iter().collect(),
            (true, tag) => {
                let rest = self.outstanding.split_off(&(tag + 1));
                std::mem::replace(&mut self.outstanding, rest)
                    .into_iter()
                    .collect()
            }
            (false, tag) => self
                .outstanding
                .remove(&tag)
                .map(|d| vec![(tag, d)])
                .unwrap_or_default(),
        }
    }

    /// The outstanding delivery `tag`.
    pub fn delivery_mut(&mut self, tag: u64) -> Option<&mut Delivery> {
        self.outstanding.get_mut(&tag)
    }

    /// Whether a held tag at or below `tag` (any, with `multiple` and 0) waits for the store.
    pub fn claims_within(&self, tag: u64, multiple: bool) -> bool {
        match (multiple, tag) {
            (true, 0) => !self.pending.is_empty(),
            (true, tag) => self.pending.range(..=tag).next().is_some(),
            (false, tag) => self.pending.contains_key(&tag),
        }
    }

    /// The consumer registered under `tag`.
    #[cfg(test)]
    pub fn consumer(&self, tag: &str) -> Option<&Consumer> {
        self.consumers.get(tag)
    }

    /// Outstanding deliveries, in tag order.
    #[cfg(test)]
    pub fn outstanding(&self) -> impl Iterator<Item = (u64, &Delivery)> {
        self.outstanding.iter().map(|(tag, d)| (*tag, d))
    }

    /// Number of consumers.
    #[cfg(test)]
    pub fn consumer_count(&self) -> usize {
        self.consumers.len()
    }
}

/// All channels of a connection, by number: a `BTreeMap` (no hashing on
/// every frame; a lookup among the few channels most connections use is
/// one scan of one node). Not a sorted `Vec`: a client names any channel
/// number it likes, and each new lowest one would move every tracked
/// channel (65 535 of them, highest first: 53 s of one worker thread).
#[derive(Debug, Default)]
pub struct Channels {
    open: BTreeMap<u16, Channel>,
    epochs: u64,
}

impl Channels {
    /// The channel's state, created on first use.
    pub fn get(&mut self, id: u16) -> &mut Channel {
        let epochs = &mut self.epochs;
        self.open.entry(id).or_insert_with(|| {
            *epochs += 1;
            Channel {
                epoch: *epochs,
                span: Some(tracing::debug_span!("channel", channel = id)),
                ..Channel::default()
            }
        })
    }

    /// The channel, if it is tracked and still the same opening.
    pub fn get_epoch(&mut self, id: u16, epoch: u64) -> Option<&mut Channel> {
        self.open.get_mut(&id).filter(|c| c.epoch == epoch)
    }

    /// Claimed tags waiting for the store, over all channels.
    pub fn pending(&self) -> usize {
        self.open.values().map(|c| c.pending.len()).sum()
    }

    /// Takes the claims numbered in `seqs`: (channel, tag, claim, settled
    /// again by the client).
    pub fn take_claims(&mut self, seqs: &BTreeSet<u64>) -> Vec<(u16, u64, Claimed, bool)> {
        let mut taken = Vec::new();
        for (id, c) in &mut self.open {
            let tags: Vec<u64> = c
                .pending
                .iter()
                .filter(|(_, claimed)| seqs.contains(&claimed.seq))
                .map(|(tag, _)| *tag)
                .collect();
            for tag in tags {
                let claimed = c.pending.remove(&tag).expect("listed above");
                let again = c.settled_again.contains(&tag);
                taken.push((*id, tag, claimed, again));
            }
        }
        taken
    }

    /// Takes every frame waiting for a publish to end; returns the held ids their acks stood for.
    pub fn take_all_after_publish(&mut self) -> Vec<u64> {
        self.open
            .values_mut()
            .flat_map(|c| std::mem::take(&mut c.after_publish))
            .filter_map(|(_, id)| id)
            .collect()
    }

    /// The frames behind the barrier went upstream: nothing waits any more.
    pub fn lower_barriers(&mut self) {
        for c in self.open.values_mut() {
            c.publish_behind_barrier = false;
            c.barrier_raised = false;
            c.end_behind = None;
        }
    }

    /// `len` bytes went in behind the barrier at `at`: the closes waiting
    /// there from `at` on moved by as much.
    pub fn shift_end_behind(&mut self, at: usize, len: usize) {
        for c in self.open.values_mut() {
            if let Some(end) = c.end_behind.as_mut().filter(|end| **end >= at) {
                *end += len;
            }
        }
    }

    /// Looks at a channel without creating it.
    pub fn peek(&self, id: u16) -> Option<&Channel> {
        self.open.get(&id)
    }

    /// Forgets a channel once `channel.close-ok` has passed either way.
    pub fn remove(&mut self, id: u16) -> Option<Channel> {
        self.open.remove(&id)
    }
}

#[cfg(test)]
mod tests;

//! A lane: the channel that publishes to one exchange, as a state machine
//! that owns no socket. The task feeds it the frames of its channel and
//! writes what it appends to `out`; it answers with reports.
//!
//! Rules:
//!
//! - A fresh channel is put in confirm mode, then (for a named exchange)
//!   checks the exchange with a passive declare, then publishes one message
//!   at a time until one is confirmed; after that up to `confirm_window`.
//! - A channel error while opening, or a 404 / 403 on a publish, concerns
//!   the exchange: every message of the lane is set aside, `exchange_wide`.
//! - Any other channel error concerns one message. If one publish was
//!   unconfirmed, it is the one: set aside. If several were, the broker does
//!   not say which: they go back to the front of the lane, to be sent again
//!   one at a time, and the culprit is found alone.
//! - A publish returned by the broker (matched exactly, see `returned`)
//!   is reported returned when its confirm arrives.
//! - A message whose `user_id` is not the republisher's user is refused by
//!   the broker unless that user has the `impersonator` tag. The first one
//!   on a connection goes alone (the lane drained first, nothing after it
//!   until its answer), which tells which it is; later ones are then sent,
//!   or set aside unsent.

use std::collections::VecDeque;
use std::sync::Arc;

use amq_protocol::protocol::{basic, channel, confirm, exchange, AMQPClass};
use bytes::BytesMut;

use super::precheck::{foreign_user_id, precheck};
use super::returned::{self, Match, Returning};
use super::{Outcome, Publish, Report, SetAside};
use crate::metrics::BlockReason;
use nackd_core::protocol::frame::{Frame, FrameType};
use nackd_core::protocol::method;

/// Where a lane's channel is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    /// No channel.
    Closed,
    /// `channel.open`, then `confirm.select`, then `exchange.declare` sent.
    Opening(u16, Step),
    /// Publishing.
    Open(u16),
}

/// What a channel being opened waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// `channel.open-ok`.
    Open,
    /// `confirm.select-ok`.
    Select,
    /// `exchange.declare-ok` of the passive declare.
    Declare,
}

/// What the lane needs from the connection to publish.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits<'a> {
    /// Publishes awaiting a confirm once the channel is proven.
    pub window: usize,
    /// Negotiated `frame_max`.
    pub frame_max: u32,
    /// The republisher's user.
    pub username: &'a str,
    /// Whether the broker takes another user's `user_id` from it.
    pub impersonation: Impersonation,
}

/// Whether the broker lets the republisher's user publish a `user_id`
/// other than its own (RabbitMQ: the `impersonator` tag).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Impersonation {
    /// Not learnt yet on this connection.
    #[default]
    Unknown,
    /// A publish with another `user_id` was confirmed.
    Allowed,
    /// One was refused (406).
    Refused,
}

/// The broker closed the lane's channel.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Closed {
    /// The channel, now free once `channel.close-ok` is written.
    pub channel: u16,
    /// `404 NOT_FOUND - ...`.
    pub reply: String,
    /// Messages set aside.
    pub set_aside: usize,
    /// Messages to be sent again, one at a time.
    pub again: usize,
}

#[derive(Debug)]
struct Inflight {
    seq: u64,
    publish: Publish,
    returned: Option<Returned>,
}

#[derive(Debug)]
enum Returned {
    Exactly(String),
    Maybe(String),
}

/// One exchange's channel.
#[derive(Debug)]
pub(super) struct Lane {
    exchange: Arc<str>,
    state: State,
    /// Delivery tag of the last publish on this channel.
    seq: u64,
    /// A publish on this channel was confirmed: the full window applies.
    proven: bool,
    pending: VecDeque<Publish>,
    inflight: VecDeque<Inflight>,
    returning: Option<Returning>,
    /// A publish sent alone to learn [`Impersonation`]: nothing goes
    /// after it until its answer.
    alone: Option<u64>,
    /// What that answer taught, for the connection to take.
    learned: Option<Impersonation>,
    /// The passive declare is not made: the broker refused it (403) while
    /// it may take publishes (RabbitMQ 4.3 wants `configure` permission for
    /// a passive declare, publishing only `write`).
    no_declare: bool,
}

impl Lane {
    /// A lane with no channel yet.
    pub(super) fn new(exchange: Arc<str>) -> Self {
        Self {
            exchange,
            state: State::Closed,
            seq: 0,
            proven: false,
            pending: VecDeque::new(),
            inflight: VecDeque::new(),
            returning: None,
            alone: None,
            learned: None,
            no_declare: false,
        }
    }

    /// What the lane learnt about [`Impersonation`], once.
    pub(super) fn take_learned(&mut self) -> Option<Impersonation> {
        self.learned.take()
    }

    /// Queues a message.
    pub(super) fn push(&mut self, p: Publish) {
        self.pending.push_back(p);
    }

    /// Where its channel is.
    pub(super) fn state(&self) -> State {
        self.state
    }

    /// Publishes waiting and in flight.
    pub(super) fn len(&self) -> (usize, usize) {
        (self.pending.len(), self.inflight.len())
    }

    /// It has messages to send and no channel.
    pub(super) fn wants_channel(&self) -> bool {
        self.state == State::Closed && !self.pending.is_empty()
    }

    /// Opens `channel` for this lane.
    pub(super) fn open(&mut self, channel: u16, out: &mut BytesMut) {
        debug_assert_eq!(self.state, State::Closed);
        let open = AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}));
        out.extend_from_slice(&method::encode(channel, &open));
        self.state = State::Opening(channel, Step::Open);
        self.seq = 0;
        self.proven = false;
    }

    /// Writes the next publish if the window allows; `false` when nothing
    /// more can go now. A message that cannot be published at all is set
    /// aside instead (and counts as progress).
    pub(super) fn publish_next(
        &mut self,
        limits: Limits<'_>,
        out: &mut BytesMut,
        reports: &mut Vec<Report>,
    ) -> bool {
        let State::Open(channel) = self.state else {
            return false;
        };
        let window = if self.proven { limits.window } else { 1 };
        if self.alone.is_some() || self.inflight.len() >= window.max(1) {
            return false;
        }
        let Some(p) = self.pending.pop_front() else {
            return false;
        };
        let alone = match self.admit(&p, limits) {
            Err(set_aside) => {
                reports.push(Report {
                    id: p.id,
                    outcome: Outcome::SetAside(set_aside),
                });
                return true;
            }
            Ok(Admit::AfterDrain) => {
                self.pending.push_front(p);
                return false;
            }
            Ok(Admit::Alone) => true,
            Ok(Admit::WithOthers) => false,
        };
        self.send(channel, p, alone, limits.frame_max, out);
        true
    }

    /// Whether `p` can be published now, and how; `Err` when it cannot be
    /// published at all.
    fn admit(&self, p: &Publish, limits: Limits<'_>) -> Result<Admit, SetAside> {
        precheck(p, limits.frame_max)?;
        Ok(
            match (foreign_user_id(p, limits.username), limits.impersonation) {
                (None, _) | (Some(_), Impersonation::Allowed) => Admit::WithOthers,
                (Some(user), Impersonation::Refused) => {
                    return Err(user_id_refused(&user, limits.username))
                }
                // It goes alone: wait until the lane is drained.
                (Some(_), Impersonation::Unknown) if !self.inflight.is_empty() => Admit::AfterDrain,
                (Some(_), Impersonation::Unknown) => Admit::Alone,
            },
        )
    }

    /// Writes `p` on `channel` and keeps it in flight until its confirm.
    fn send(&mut self, channel: u16, p: Publish, alone: bool, frame_max: u32, out: &mut BytesMut) {
        out.extend_from_slice(&method::publish(
            channel,
            p.exchange(),
            p.routing_key(),
            true,
            &p.header,
            &p.body,
            frame_max,
        ));
        self.seq += 1;
        if alone {
            self.alone = Some(self.seq);
        }
        self.inflight.push_back(Inflight {
            seq: self.seq,
            publish: p,
            returned: None,
        });
    }

    /// A method frame on the lane's channel. `Some` when the broker closed
    /// the channel (`channel.close-ok` is already in `out`).
    pub(super) fn on_method(
        &mut self,
        class: AMQPClass,
        out: &mut BytesMut,
        reports: &mut Vec<Report>,
    ) -> Option<Closed> {
        let ch = match self.state {
            State::Closed => return None,
            State::Opening(ch, _) | State::Open(ch) => ch,
        };
        if let AMQPClass::Channel(channel::AMQPMethod::Close(c)) = class {
            let close_ok = AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}));
            out.extend_from_slice(&method::encode(ch, &close_ok));
            return Some(self.closed(ch, c.reply_code, c.reply_text.as_str(), reports));
        }
        match self.state {
            State::Opening(_, step) => self.on_opening(ch, step, class, out),
            State::Open(_) => self.on_answer(class, reports),
            State::Closed => {}
        }
        None
    }

    /// The opening handshake: `channel.open-ok`, then `confirm.select-ok`,
    /// then (for a named exchange) the passive declare's `declare-ok`.
    fn on_opening(&mut self, ch: u16, step: Step, class: AMQPClass, out: &mut BytesMut) {
        match (step, class) {
            (Step::Open, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))) => {
                let select = AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                    nowait: false,
                }));
                out.extend_from_slice(&method::encode(ch, &select));
                self.state = State::Opening(ch, Step::Select);
            }
            (Step::Select, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))) => {
                if self.exchange.is_empty() || self.no_declare {
                    self.state = State::Open(ch);
                } else {
                    let declare =
                        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                            exchange: self.exchange.as_ref().into(),
                            passive: true,
                            ..Default::default()
                        }));
                    out.extend_from_slice(&method::encode(ch, &declare));
                    self.state = State::Opening(ch, Step::Declare);
                }
            }
            (Step::Declare, AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_))) => {
                self.state = State::Open(ch)
            }
            _ => {}
        }
    }

    /// The broker's answers to publishes on an open channel: confirms,
    /// nacks, and the start of a return.
    fn on_answer(&mut self, class: AMQPClass, reports: &mut Vec<Report>) {
        match class {
            AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => {
                self.settle(a.delivery_tag, a.multiple, true, reports)
            }
            AMQPClass::Basic(basic::AMQPMethod::Nack(n)) => {
                self.settle(n.delivery_tag, n.multiple, false, reports)
            }
            AMQPClass::Basic(basic::AMQPMethod::Return(r)) => {
                let limit = self
                    .inflight
                    .iter()
                    .map(|f| f.publish.body.len() as u64)
                    .max()
                    .unwrap_or(0);
                self.returning = Some(Returning::new(
                    r.reply_code,
                    r.reply_text.as_str(),
                    r.exchange.as_str(),
                    r.routing_key.as_str(),
                    limit,
                ));
            }
            _ => {}
        }
    }

    /// A content frame on the lane's channel: the message of a return.
    pub(super) fn on_content(&mut self, frame: &Frame) {
        let Some(ret) = self.returning.as_mut() else {
            return;
        };
        let done = match frame.kind {
            FrameType::Header if !ret.has_header() => ret.on_header(frame.payload()),
            FrameType::Body if ret.has_header() => ret.on_body(frame.payload_slice()),
            _ => false,
        };
        if done {
            let ret = self.returning.take().expect("a return is arriving");
            self.returned(ret);
        }
    }

    fn returned(&mut self, ret: Returning) {
        let candidates = self
            .inflight
            .iter()
            .map(|f| (&f.publish, f.returned.is_some()));
        match returned::find(&ret, candidates) {
            Match::Exact(i) => self.inflight[i].returned = Some(Returned::Exactly(ret.reply)),
            Match::Unsure(alike) => {
                tracing::warn!(
                    exchange = %self.exchange,
                    candidates = alike.len(),
                    "a returned message matches no publish in flight exactly: each alike is kept to be safe"
                );
                for i in alike {
                    self.inflight[i].returned = Some(Returned::Maybe(ret.reply.clone()));
                }
            }
        }
    }

    fn settle(&mut self, tag: u64, multiple: bool, ack: bool, reports: &mut Vec<Report>) {
        let mut settled = Vec::new();
        if multiple {
            while self.inflight.front().is_some_and(|f| f.seq <= tag) {
                settled.extend(self.inflight.pop_front());
            }
        } else if let Some(pos) = self.inflight.iter().position(|f| f.seq == tag) {
            settled.extend(self.inflight.remove(pos));
        }
        for f in settled {
            if self.alone == Some(f.seq) {
                self.alone = None;
                if ack {
                    self.learned = Some(Impersonation::Allowed);
                }
            }
            let outcome = match (ack, f.returned) {
                (false, _) => Outcome::Nacked,
                (true, None) => {
                    self.proven = true;
                    Outcome::Confirmed
                }
                (true, Some(r)) => {
                    self.proven = true;
                    returned_outcome(r)
                }
            };
            reports.push(Report {
                id: f.publish.id,
                outcome,
            });
        }
    }

    /// The broker closed the channel: decides what becomes of each message.
    fn closed(&mut self, channel: u16, code: u16, text: &str, reports: &mut Vec<Report>) -> Closed {
        let reply = format!("{code} {text}");
        if code == 403 && self.state == State::Opening(channel, Step::Declare) {
            // Only the check is refused: the next channel publishes without
            // it, the first message alone, and a refused publish (403, or a
            // 404 for a missing exchange) still sets the lane aside.
            self.state = State::Closed;
            self.no_declare = true;
            return Closed {
                channel,
                reply,
                set_aside: 0,
                again: 0,
            };
        }
        let was_open = matches!(self.state, State::Open(_));
        let alone = self.alone.take();
        self.state = State::Closed;
        self.returning = None;
        self.proven = false;
        let unanswered = self
            .inflight
            .iter()
            .filter(|f| f.returned.is_none())
            .count();
        let reason = self.close_reason(code, text, alone.is_some() && unanswered == 1);
        // Refused while opening, for a missing exchange or access, or with
        // nothing of ours to blame: it concerns the exchange, and a new
        // channel comes only after its backoff.
        let exchange_wide = !was_open
            || unanswered == 0
            || matches!(reason, BlockReason::NoExchange | BlockReason::AccessRefused);
        let suspects = self.report_returned(reports);
        let set_aside = SetAside {
            reason,
            reply: reply.clone(),
            exchange_wide,
        };
        let (aside, again) = self.blame(suspects, &set_aside, reports);
        Closed {
            channel,
            reply,
            set_aside: aside,
            again,
        }
    }

    /// Why the broker closed the channel with `code` and `text`. When the
    /// one publish unanswered is the one sent alone with another user's
    /// `user_id`, a 406 about it teaches that impersonation is refused.
    fn close_reason(&mut self, code: u16, text: &str, alone_unanswered: bool) -> BlockReason {
        if alone_unanswered && code == 406 && text.contains("user_id") {
            // The publish sent alone with another user's user_id was refused.
            self.learned = Some(Impersonation::Refused);
            return BlockReason::UserId;
        }
        match code {
            404 => BlockReason::NoExchange,
            403 => BlockReason::AccessRefused,
            406 => BlockReason::PreconditionFailed,
            _ => BlockReason::ChannelError,
        }
    }

    /// Empties the window: reports the publishes the broker returned (no
    /// doubt about them) and gives back the others, the suspects.
    fn report_returned(&mut self, reports: &mut Vec<Report>) -> Vec<Publish> {
        let mut suspects = Vec::new();
        for f in self.inflight.drain(..) {
            match f.returned {
                // Handled by the broker and not routed: no doubt about it.
                Some(r) => reports.push(Report {
                    id: f.publish.id,
                    outcome: returned_outcome(r),
                }),
                None => suspects.push(f.publish),
            }
        }
        suspects
    }

    /// Sets aside what a channel error is blamed on: every message of the
    /// lane when it concerns the exchange, the one suspect when there is
    /// one; several suspects go back to the front, to be sent again one at
    /// a time. Returns how many were set aside and how many go again.
    fn blame(
        &mut self,
        suspects: Vec<Publish>,
        set_aside: &SetAside,
        reports: &mut Vec<Report>,
    ) -> (usize, usize) {
        let mut report = |p: Publish| {
            reports.push(Report {
                id: p.id,
                outcome: Outcome::SetAside(set_aside.clone()),
            })
        };
        if set_aside.exchange_wide {
            let aside = suspects.len() + self.pending.len();
            suspects.into_iter().for_each(&mut report);
            self.pending.drain(..).for_each(&mut report);
            (aside, 0)
        } else if suspects.len() == 1 {
            suspects.into_iter().for_each(&mut report);
            (1, 0)
        } else {
            let again = suspects.len();
            for p in suspects.into_iter().rev() {
                self.pending.push_front(p);
            }
            (0, again)
        }
    }

    /// Sets every pending message aside without sending it.
    pub(super) fn set_aside_pending(&mut self, aside: &SetAside, reports: &mut Vec<Report>) {
        for p in self.pending.drain(..) {
            reports.push(Report {
                id: p.id,
                outcome: Outcome::SetAside(aside.clone()),
            });
        }
    }

    /// The connection is gone: unconfirmed publishes go back to the front,
    /// to be sent again on the next connection (a returned one is settled:
    /// the broker did not route it).
    pub(super) fn disconnected(&mut self, reports: &mut Vec<Report>) {
        self.alone = None;
        self.state = State::Closed;
        self.returning = None;
        self.proven = false;
        self.seq = 0;
        let mut again = Vec::new();
        for f in self.inflight.drain(..) {
            match f.returned {
                Some(r) => reports.push(Report {
                    id: f.publish.id,
                    outcome: returned_outcome(r),
                }),
                None => again.push(f.publish),
            }
        }
        for p in again.into_iter().rev() {
            self.pending.push_front(p);
        }
    }
}

/// How a publish may go out.
enum Admit {
    /// In the window with the others.
    WithOthers,
    /// Alone, to learn [`Impersonation`]: nothing after it until its answer.
    Alone,
    /// Alone, once the publishes in flight are answered.
    AfterDrain,
}

/// Set aside: its `user_id` is another user's and the broker refuses that.
fn user_id_refused(user: &str, username: &str) -> SetAside {
    let reply = format!(
        "its user_id property {user:?} is not the republisher's user {username:?}, and the broker refuses that from it (406 PRECONDITION_FAILED)"
    );
    SetAside {
        reason: BlockReason::UserId,
        reply,
        exchange_wide: false,
    }
}

fn returned_outcome(r: Returned) -> Outcome {
    match r {
        Returned::Exactly(reply) => Outcome::Returned { reply },
        Returned::Maybe(reply) => Outcome::SetAside(SetAside {
            reason: BlockReason::NoRoute,
            reply: format!("{reply} (possibly: the return matched no publish exactly)"),
            exchange_wide: false,
        }),
    }
}

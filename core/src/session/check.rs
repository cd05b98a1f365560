//! The broker's own word on a delayed publish, asked before nackd holds it.
//!
//! nackd publishes a held message later with its own credentials, so it
//! may hold only what the broker would take from the publisher now. It
//! asks the broker itself, in the publisher's name, on a channel it
//! reserves on the client's own upstream connection: the highest channel
//! number the connection allows (the client is offered one fewer). The
//! channel is put in a transaction once (`tx.select`); each check is the
//! publish as the client sent it (method, header, body) and a
//! `tx.rollback`. RabbitMQ checks a publish when it arrives, transaction
//! or not: write permission on the exchange, topic permission on the
//! routing key, that the exchange exists and is not internal, `user-id`,
//! `expiration`, the size; the rollback then discards it. A
//! `tx.rollback-ok` is a yes for the oldest check waiting; a
//! `channel.close` is a no for it (the broker discards what was sent after
//! it on the channel): nackd answers `close-ok`, opens the channel again
//! and sends the checks that were still waiting.
//!
//! Nothing the broker sends on the reserved channel reaches the client,
//! and the client cannot use it (its frames above its `channel_max` close
//! its connection). [`Checks`] is the channel's state; the session decides
//! what a yes or a no means (`machine.rs`).

use std::collections::VecDeque;

use amq_protocol::protocol::{channel as amqp_channel, tx, AMQPClass};
use bytes::{BufMut, Bytes, BytesMut};

use crate::protocol::frame::HEADER_LEN;
use crate::protocol::method;

/// The broker's answer to one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// The broker took the publish (and the rollback discarded it): claim `0`.
    Granted(u64),
    /// The broker refused it, closing the reserved channel: claim `0`.
    Refused(u64),
}

/// The reserved channel of one session (see the module).
#[derive(Debug, Default)]
pub(super) struct Checks {
    /// What the client was offered, when a channel is reserved.
    offered: Option<u16>,
    /// The reserved channel; 0 while there is none (not tuned yet, no
    /// emulation, or no channel to spare).
    channel: u16,
    /// `channel.open` and `tx.select` went since it was last closed.
    open: bool,
    /// Checks sent and not answered, oldest first: the claim and the frames
    /// sent (sent again after a refusal reopens the channel).
    waiting: VecDeque<(u64, Bytes)>,
    /// Checks that wait to be sent (see [`Checks::hold`]).
    held: VecDeque<(u64, Bytes)>,
    /// While above 0, checks are kept back: a change to the delayed
    /// exchanges of this session waits for the broker's answer on another
    /// channel, and a check must not overtake it.
    holds: usize,
    /// Of `holds`, those whose change waits behind the barrier.
    behind: usize,
}

impl Checks {
    /// The broker offers `broker_max` channels (`0`: no limit): what the
    /// client is offered instead, one fewer (the last is nackd's). A
    /// broker that allows one channel leaves none to reserve: the client
    /// gets it, and no delayed publish can be checked.
    pub(super) fn offer(&mut self, broker_max: u16) -> u16 {
        self.offered = match broker_max {
            0 => Some(u16::MAX - 1),
            1 => None,
            n => Some(n - 1),
        };
        self.offered.unwrap_or(broker_max)
    }

    /// The client tuned with `client_max`: the channel above its highest
    /// is reserved. Returns the client's highest channel (its `0`, "no
    /// limit", is the offer) and the `channel_max` nackd tells the broker.
    pub(super) fn tuned(&mut self, client_max: u16) -> (u16, u16) {
        let Some(offered) = self.offered else {
            self.channel = 0;
            return (client_max, client_max);
        };
        let client = match client_max {
            0 => offered,
            n => n.min(offered),
        };
        self.channel = client + 1;
        (client, self.channel)
    }

    /// The reserved channel, once tuned.
    pub(super) fn channel(&self) -> Option<u16> {
        (self.channel != 0).then_some(self.channel)
    }

    /// Checks sent, not answered yet.
    #[cfg(test)]
    pub(super) fn sent(&self) -> usize {
        self.waiting.len()
    }

    /// Checks sent or kept back, not answered yet.
    #[cfg(test)]
    pub(super) fn pending(&self) -> usize {
        self.waiting.len() + self.held.len()
    }

    /// Asks the broker about claim `seq`: `publish` is the publish's method
    /// frame and content frames as the client sent them (on any channel).
    /// What to send goes into `out`. `false`: no reserved channel, nothing
    /// was asked.
    pub(super) fn ask(&mut self, seq: u64, publish: &[u8], out: &mut BytesMut) -> bool {
        if self.channel == 0 {
            return false;
        }
        let frames = on_channel(publish, self.channel);
        if self.holds > 0 {
            self.held.push_back((seq, frames));
            return true;
        }
        self.send(seq, frames, out);
        true
    }

    /// Whether the check of claim `seq` is kept back for a change to the
    /// delayed exchanges that itself waits behind the session's barrier:
    /// the barrier must not wait for that check.
    pub(super) fn stuck_behind_barrier(&self, seq: u64) -> bool {
        self.behind > 0 && self.held.iter().any(|(s, _)| *s == seq)
    }

    /// Checks wait until [`Checks::release`] (as often as this was called).
    /// `behind`: the change that holds them waits behind the barrier.
    pub(super) fn hold(&mut self, behind: bool) {
        self.holds += 1;
        self.behind += usize::from(behind);
    }

    /// The frames behind the barrier went upstream.
    pub(super) fn barrier_lowered(&mut self) {
        self.behind = 0;
    }

    /// One hold ends; at the last, the checks kept back go.
    pub(super) fn release(&mut self, out: &mut BytesMut) {
        self.holds = self.holds.saturating_sub(1);
        if self.holds > 0 {
            return;
        }
        while let Some((seq, frames)) = self.held.pop_front() {
            self.send(seq, frames, out);
        }
    }

    fn send(&mut self, seq: u64, frames: Bytes, out: &mut BytesMut) {
        self.open_in(out);
        out.extend_from_slice(&frames);
        out.extend_from_slice(&rollback(self.channel));
        self.waiting.push_back((seq, frames));
    }

    fn open_in(&mut self, out: &mut BytesMut) {
        if self.open {
            return;
        }
        let open = AMQPClass::Channel(amqp_channel::AMQPMethod::Open(amqp_channel::Open {}));
        out.extend_from_slice(&method::encode(self.channel, &open));
        let select = AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {}));
        out.extend_from_slice(&method::encode(self.channel, &select));
        self.open = true;
    }

    /// A method the broker sent on the reserved channel: the verdict it
    /// brings, if any; what nackd answers goes into `out`.
    pub(super) fn on_broker_method(
        &mut self,
        class: &AMQPClass,
        out: &mut BytesMut,
    ) -> Option<Verdict> {
        match class {
            AMQPClass::Tx(tx::AMQPMethod::RollbackOk(_)) => self
                .waiting
                .pop_front()
                .map(|(seq, _)| Verdict::Granted(seq)),
            AMQPClass::Channel(amqp_channel::AMQPMethod::Close(_)) => {
                let close_ok =
                    AMQPClass::Channel(amqp_channel::AMQPMethod::CloseOk(amqp_channel::CloseOk {}));
                out.extend_from_slice(&method::encode(self.channel, &close_ok));
                self.open = false;
                let refused = self
                    .waiting
                    .pop_front()
                    .map(|(seq, _)| Verdict::Refused(seq));
                // The broker discarded the rest: asked again.
                for (seq, frames) in std::mem::take(&mut self.waiting) {
                    self.send(seq, frames, out);
                }
                refused
            }
            // open-ok, select-ok; nothing else comes on a channel that
            // only publishes in a transaction it rolls back.
            _ => None,
        }
    }
}

/// `tx.rollback` on `channel`.
fn rollback(channel: u16) -> Bytes {
    method::encode(
        channel,
        &AMQPClass::Tx(tx::AMQPMethod::Rollback(tx::Rollback {})),
    )
}

/// The frames of `publish` (whole frames, as the client sent them), moved
/// to `channel`: only each frame header's channel number changes.
fn on_channel(publish: &[u8], channel: u16) -> Bytes {
    let mut out = BytesMut::with_capacity(publish.len());
    let mut rest = publish;
    while rest.len() >= HEADER_LEN {
        let size = u32::from_be_bytes([rest[3], rest[4], rest[5], rest[6]]) as usize;
        let whole = (HEADER_LEN + size + 1).min(rest.len());
        out.put_u8(rest[0]);
        out.put_u16(channel);
        out.extend_from_slice(&rest[3..whole]);
        rest = &rest[whole..];
    }
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::frame::{FrameDecoder, FrameType};

    fn decode_all(mut bytes: BytesMut) -> Vec<(u16, FrameType, Option<AMQPClass>)> {
        let decoder = FrameDecoder::new(1 << 20);
        let mut out = Vec::new();
        while let Some(f) = decoder.decode(&mut bytes).unwrap() {
            let class = match f.kind {
                FrameType::Method => Some(method::decode_any(&f.payload()).unwrap()),
                _ => None,
            };
            out.push((f.channel, f.kind, class));
        }
        assert!(bytes.is_empty());
        out
    }

    fn publish_on(channel: u16) -> BytesMut {
        let props = amq_protocol::protocol::basic::AMQPProperties::default();
        let header = crate::protocol::content::encode_header(60, 4, &props);
        method::publish(channel, "delayed", "key", false, &header, b"body", 1 << 17)
    }

    fn is(class: &Option<AMQPClass>, want: &str) -> bool {
        format!("{class:?}").contains(want)
    }

    /// A session's checks, tuned with the broker's 2047 and a client that
    /// takes what it is offered.
    fn tuned() -> Checks {
        let mut c = Checks::default();
        c.offer(2047);
        c.tuned(100);
        c
    }

    #[test]
    fn the_reserved_channel_is_the_one_above_the_client() {
        let mut c = Checks::default();
        assert_eq!(c.offer(2047), 2046);
        assert_eq!(c.tuned(2046), (2046, 2047));
        assert_eq!(c.channel(), Some(2047));
        assert_eq!(c.tuned(10), (10, 11), "a client that asks for fewer");
        assert_eq!(c.tuned(0), (2046, 2047), "a client's 0 is the offer");
        assert_eq!(c.tuned(3000), (2046, 2047), "a client that asks for more");
        assert_eq!(c.offer(0), u16::MAX - 1, "a broker without a limit");
        assert_eq!(c.tuned(0), (u16::MAX - 1, u16::MAX));
        assert_eq!(c.offer(1), 1, "nothing to spare");
        assert_eq!(c.tuned(1), (1, 1));
        assert_eq!(c.channel(), None);
        let mut out = BytesMut::new();
        assert!(!c.ask(1, &publish_on(1), &mut out));
        assert!(out.is_empty());
    }

    #[test]
    fn a_check_opens_the_channel_once_and_rolls_each_publish_back() {
        let mut c = tuned();
        let mut out = BytesMut::new();
        assert!(c.ask(1, &publish_on(7), &mut out));
        assert!(c.ask(2, &publish_on(3), &mut out));
        let frames = decode_all(out);
        assert!(
            frames.iter().all(|(ch, _, _)| *ch == 101),
            "all on the reserved channel"
        );
        let kinds: Vec<String> = frames
            .iter()
            .map(|(_, k, c)| match c {
                Some(c) => format!("{c:?}")
                    .split('(')
                    .take(2)
                    .collect::<Vec<_>>()
                    .join("("),
                None => format!("{k:?}"),
            })
            .collect();
        assert!(
            is(&frames[0].2, "Open") && is(&frames[1].2, "Select"),
            "{kinds:?}"
        );
        assert!(is(&frames[2].2, "Publish"));
        assert_eq!(
            (frames[3].1, frames[4].1),
            (FrameType::Header, FrameType::Body)
        );
        assert!(is(&frames[5].2, "Rollback"));
        assert!(is(&frames[6].2, "Publish"), "no second open: {kinds:?}");
        assert!(is(&frames[9].2, "Rollback"));
        assert_eq!(frames.len(), 10);
        assert_eq!(c.pending(), 2);
    }

    #[test]
    fn answers_come_in_order_and_a_refusal_reopens_and_asks_again() {
        let mut c = tuned();
        let mut out = BytesMut::new();
        for seq in 1..=3 {
            c.ask(seq, &publish_on(1), &mut out);
        }
        let rollback_ok = AMQPClass::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {}));
        let close = AMQPClass::Channel(amqp_channel::AMQPMethod::Close(amqp_channel::Close {
            reply_code: 403,
            reply_text: "ACCESS_REFUSED".into(),
            class_id: 60,
            method_id: 40,
        }));
        let mut answer = BytesMut::new();
        assert_eq!(
            c.on_broker_method(&rollback_ok, &mut answer),
            Some(Verdict::Granted(1))
        );
        assert!(answer.is_empty());
        assert_eq!(
            c.on_broker_method(&close, &mut answer),
            Some(Verdict::Refused(2))
        );
        let frames = decode_all(answer);
        assert!(is(&frames[0].2, "CloseOk"), "{:?}", frames[0]);
        assert!(is(&frames[1].2, "Open") && is(&frames[2].2, "Select"));
        assert!(is(&frames[3].2, "Publish"), "claim 3 asked again");
        assert_eq!(frames.len(), 7);
        let mut none = BytesMut::new();
        assert_eq!(
            c.on_broker_method(&rollback_ok, &mut none),
            Some(Verdict::Granted(3))
        );
        assert_eq!(c.pending(), 0);
        assert_eq!(
            c.on_broker_method(&rollback_ok, &mut none),
            None,
            "nothing waits"
        );
    }

    #[test]
    fn held_checks_go_when_the_last_hold_ends() {
        let mut c = tuned();
        c.hold(false);
        c.hold(false);
        let mut out = BytesMut::new();
        assert!(c.ask(1, &publish_on(1), &mut out));
        assert!(out.is_empty(), "kept back");
        assert_eq!(c.pending(), 1);
        c.release(&mut out);
        assert!(out.is_empty(), "one hold is left");
        c.release(&mut out);
        assert_eq!(
            decode_all(out).len(),
            6,
            "open, select, publish, header, body, rollback"
        );
        c.release(&mut BytesMut::new());
        let mut out = BytesMut::new();
        c.ask(2, &publish_on(1), &mut out);
        assert!(!out.is_empty(), "a release too many holds nothing back");
    }
}

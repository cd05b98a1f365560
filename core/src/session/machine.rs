//! The session's state machine: no socket, no clock, no channel to the
//! engine. Events go in with the time they happened; what to write to
//! each side, what to ask the engine and when to wake come out.
//!
//! The handlers live beside this file, one concern each: `frames` (cutting
//! and checking frames), `client` and `upstream` (what each side's methods
//! mean), `claim` (claim, park, ack, barriers), `defer` (nacks nackd
//! cannot hold, given back to the broker later), `lifecycle` (faults,
//! sides gone, shutdown, timers). `channel` tracks each channel, `close`
//! the closing handshake.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;

use super::barrier::Barrier;
use super::channel::Channels;
use super::claims::Claims;
use super::close::Close;
use super::deferrals::Deferrals;
use super::peer::Peer;
use super::publishes::DelayedPublishes;
use super::scope::{Interception, Scope};
use super::{Limits, HIGH_WATER, TICK};
use crate::held::{Park, Parked};
use crate::protocol::frame::{FrameDecoder, HANDSHAKE_FRAME_MAX};
use crate::stats::SessionStats;

/// What the session asks of the retry engine.
// Each effect is moved once, from the queue to the engine's channel.
#[allow(clippy::large_enum_variant)]
pub enum Effect {
    /// Store and hold a claimed message; answer with [`Session::handle_parked`].
    Park(Park),
    /// Drop a held message: the broker has the delivery back.
    Cancel(u64),
}

/// One client/broker pair, as a state machine.
pub struct Session {
    pub(super) limits: Limits,
    pub(super) handshake_deadline: Instant,
    /// The time of the event being handled.
    pub(super) now: Instant,
    /// When the core next checks heartbeats and deadlines.
    next_tick: Instant,
    pub(super) to_client: BytesMut,
    pub(super) to_upstream: BytesMut,
    pub(super) effects: VecDeque<Effect>,
    /// Both [`FrameDecoder::relaying`]: they take the frames RabbitMQ takes.
    pub(super) client_decoder: FrameDecoder,
    pub(super) upstream_decoder: FrameDecoder,
    pub(super) channels: Channels,
    pub(super) channel_max: u16,
    pub(super) heartbeat: Duration,
    pub(super) open: bool,
    pub(super) client_rx: Instant,
    pub(super) upstream_rx: Instant,
    /// When client frames (or nackd's heartbeat) last went toward the
    /// broker: a client whose frames nackd takes (delayed publishes) still
    /// owes the broker a heartbeat.
    pub(super) upstream_tx: Instant,
    pub(super) close: Close,
    /// What this session intercepts (none when no policy is configured).
    pub(super) scope: Option<Scope>,
    /// Client frames held back until the claims are acked (see `claim`).
    pub(super) barrier: Barrier,
    /// The claims made, and those the store has not answered.
    pub(super) claims: Claims,
    /// Deliveries nackd could not hold, unacked until their nack (see `defer`).
    pub(super) deferrals: Deferrals,
    /// Delayed publishes taken and delayed declares waiting (see `delayed`).
    pub(super) publishes: DelayedPublishes,
    /// The broker's word on delayed publishes (the reserved channel).
    pub(super) checks: super::check::Checks,
    pub(super) stats: Arc<SessionStats>,
}

impl Session {
    /// A pair whose client sent its protocol header at `now` (and that has
    /// until `handshake_deadline` to open); it intercepts with `interception`.
    pub fn new(
        limits: Limits,
        handshake_deadline: Instant,
        now: Instant,
        stats: Arc<SessionStats>,
        interception: Option<&Arc<Interception>>,
    ) -> Self {
        Self {
            limits,
            handshake_deadline,
            now,
            next_tick: now + TICK,
            to_client: BytesMut::new(),
            to_upstream: BytesMut::new(),
            effects: VecDeque::new(),
            client_decoder: FrameDecoder::relaying(HANDSHAKE_FRAME_MAX),
            upstream_decoder: FrameDecoder::relaying(HANDSHAKE_FRAME_MAX),
            channels: Channels::default(),
            channel_max: 0,
            heartbeat: Duration::ZERO,
            open: false,
            client_rx: now,
            upstream_rx: now,
            upstream_tx: now,
            close: Close::default(),
            scope: interception.map(|shared| Scope::new(shared.clone())),
            barrier: Barrier::default(),
            claims: Claims::default(),
            deferrals: Deferrals::new(stats.deferred_now.clone()),
            publishes: DelayedPublishes::default(),
            checks: super::check::Checks::default(),
            stats,
        }
    }

    /// `peer` sent the bytes in `input`: every whole frame is handled and
    /// cut out of it (a partial frame stays for the next read).
    pub fn handle_bytes(&mut self, peer: Peer, input: &mut BytesMut, now: Instant) {
        self.now = now;
        match peer {
            Peer::Client => self.client_rx = now,
            Peer::Upstream => self.upstream_rx = now,
        }
        self.on_bytes(peer, input);
    }

    /// The engine answered a park.
    pub fn handle_parked(&mut self, parked: Parked, now: Instant) {
        self.now = now;
        self.on_parked(parked);
    }

    /// `peer`'s socket ended (`None`: at its end of stream, or it went
    /// silent).
    pub fn handle_gone(&mut self, peer: Peer, error: Option<std::io::Error>, now: Instant) {
        self.now = now;
        match peer {
            Peer::Client => self.on_client_gone(error),
            Peer::Upstream => self.on_upstream_gone(error),
        }
    }

    /// nackd shuts down: close both sides (after the acks nackd owes).
    pub fn handle_force(&mut self, now: Instant) {
        self.now = now;
        self.on_force();
    }

    /// The time [`Session::poll_timeout`] gave has come.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.now = now;
        self.barrier.on_timeout(now);
        if now >= self.next_tick {
            self.next_tick = now + TICK;
        }
        self.on_tick();
    }

    /// When the core wants [`Session::handle_timeout`] called.
    pub fn poll_timeout(&self) -> Instant {
        [self.barrier.wake(), self.deferrals.next_wake()]
            .into_iter()
            .flatten()
            .fold(self.next_tick, Instant::min)
    }

    /// The next thing to ask of the retry engine.
    pub fn poll_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    /// What to write to the client and to the broker. The caller takes
    /// bytes from the front as it writes them.
    pub fn transmit(&mut self) -> (&mut BytesMut, &mut BytesMut) {
        (&mut self.to_client, &mut self.to_upstream)
    }

    /// Whether `peer`'s socket is to be read now: it is open, and the
    /// other side's write buffer is below [`HIGH_WATER`].
    pub fn may_read(&self, peer: Peer) -> bool {
        match peer {
            Peer::Client => {
                !self.close.client_gone()
                    && self.to_upstream.len() + self.barrier.len() < HIGH_WATER
            }
            Peer::Upstream => {
                // Once the client is gone nothing queued for it is written.
                !self.close.upstream_gone()
                    && (self.close.client_gone() || self.to_client.len() < HIGH_WATER)
            }
        }
    }

    /// Whether `peer`'s socket is still open to writes.
    pub fn may_write(&self, peer: Peer) -> bool {
        match peer {
            Peer::Client => !self.close.client_gone(),
            Peer::Upstream => !self.close.upstream_gone(),
        }
    }

    /// Whether shutdown already asked this session to close.
    pub fn forced(&self) -> bool {
        self.close.forced()
    }

    /// Whether the pair is done (both sides closed, or out of time).
    pub fn is_finished(&self, now: Instant) -> bool {
        self.close.finished(now)
    }

    /// The session is over; `late` are the engine's answers that came
    /// after it. Stored copies nackd never acked are the broker's again
    /// (it requeues their deliveries): they are cancelled.
    pub fn end(&mut self, late: impl IntoIterator<Item = Parked>) {
        self.count_unparked_lost();
        self.end_all_declaring();
        // A delayed publish stays held: its publisher sent it (unless the
        // publisher was told "nack").
        let taken = self.publishes.take_all();
        let kept = |p: &Parked| taken.get(&p.key.seq).is_some_and(|t| !t.given_up());
        let late: Vec<Parked> = late.into_iter().collect();
        for p in &late {
            if let (Some(t), Err(e)) = (taken.get(&p.key.seq), &p.result) {
                if t.unconfirmed() {
                    // Its publisher used no confirms and its connection is
                    // gone: nothing can route it now.
                    tracing::error!(error = %e, "cannot store a delayed publish, and its session has ended: the message is lost (its publisher used no confirms)");
                    self.stats.delayed_lost.inc();
                }
            }
        }
        let mut cancel: Vec<u64> = late
            .into_iter()
            .filter(|p| !kept(p))
            .filter_map(|p| p.result.ok())
            .collect();
        // Acks that waited for a client publish that never ended.
        cancel.extend(self.channels.take_all_after_publish());
        for id in cancel {
            tracing::debug!(id, "session ended before the ack: cancelling the hold");
            self.effects.push_back(Effect::Cancel(id));
        }
    }

    /// A short word for the log line at the end.
    pub fn close_reason(&self) -> &'static str {
        self.close.reason()
    }
}

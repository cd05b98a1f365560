//! One client connection and its upstream connection: the frame pump.
//!
//! A single task owns both sockets and all state of the pair, so nothing is
//! locked on the hot path. Each side is read only while the other side's
//! write buffer is below [`HIGH_WATER`]: a peer that does not read stops the
//! one that writes (backpressure end to end). Frames read in one go are
//! written in one go: the write branch runs once no read is ready.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{basic, channel as amqp_channel, connection, AMQPClass};
use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Span};

use crate::metrics::{Metrics, Open};
use crate::net::{Connector, Io};
use crate::protocol::frame::{self, Frame, FrameDecoder, FrameError, FrameType, ProtocolHeader};
use crate::protocol::method::{self, ids, MethodId};
use crate::protocol::reply::ReplyCode;
use crate::session::channel::Channels;

pub mod capture;
pub mod channel;
mod client;
mod close;
mod frames;
mod intercepting;
mod lifecycle;
pub mod settle;
mod upstream;
use close::{Close, Origin};
use intercepting::Intercepting;
pub use intercepting::Interception;

use crate::retry::Parked;
use settle::Settle;
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::mpsc;

/// A side's write buffer above which nackd stops reading the other side.
pub const HIGH_WATER: usize = 256 * 1024;
/// Read buffer growth step.
const READ_CHUNK: usize = 64 * 1024;
/// Time the peers get to complete a close handshake.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(3);
/// Time held messages get to be stored and acked before a close goes on.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest a forced session takes to end: its claims answered or given
/// up, the close handshake, the last writes.
pub const FORCED_END: Duration =
    Duration::from_secs(SETTLE_TIMEOUT.as_secs() + CLOSE_TIMEOUT.as_secs() + 3);
/// Time the broker gets to apply nackd's acks before a close, recover or
/// disconnect that it held back goes on. RabbitMQ applies a quorum queue's
/// settles at low priority: a channel that closes right after its acks can
/// have them overtaken by its own death, and the messages requeued.
const ACK_GRACE: Duration = Duration::from_millis(100);

/// Limits a session applies.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest frame accepted from either side, whatever is negotiated.
    pub max_frame: u32,
    /// From accept to `connection.open-ok`.
    pub handshake_timeout: Duration,
}

/// Serves one accepted client until both sides are closed.
/// `force` asks the session to close both sides now (end of shutdown grace).
pub async fn serve(
    mut client: Io,
    connector: Connector,
    limits: Limits,
    interception: Option<Arc<Interception>>,
    metrics: Arc<Metrics>,
    force: CancellationToken,
) {
    let deadline = Instant::now() + limits.handshake_timeout;
    let mut first = BytesMut::with_capacity(8);
    let header = tokio::time::timeout_at(deadline.into(), async {
        loop {
            if let Some(header) = frame::decode_protocol_header(&mut first) {
                return Some(header);
            }
            match client.read_buf(&mut first).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => {
                    metrics.bytes.to_upstream.inc_by(n as u64);
                }
            }
        }
    })
    .await;
    match header {
        Ok(Some(ProtocolHeader::Amqp091)) => {}
        Ok(Some(ProtocolHeader::Unsupported)) => {
            info!("refused: client does not speak AMQP 0-9-1");
            let _ = client.write_all(frame::PROTOCOL_HEADER).await;
            let _ = client.shutdown().await;
            return;
        }
        Ok(None) => return debug!("client left before sending a protocol header"),
        Err(_) => {
            return warn!(timeout = ?limits.handshake_timeout, "handshake timed out before the protocol header")
        }
    }
    let (mut upstream, upstream_addr) = match connector.connect().await {
        Ok(pair) => pair,
        Err(e) => {
            metrics.upstream_failures.inc();
            warn!(upstream = connector.address(), error = %e, "cannot reach the broker; closing the client");
            let _ = client.shutdown().await;
            return;
        }
    };
    Span::current().record("upstream.addr", tracing::field::display(upstream_addr));
    if let Err(e) = upstream.write_all(frame::PROTOCOL_HEADER).await {
        return warn!(error = %e, "broker closed during the protocol header");
    }
    let _open = Open::track(&metrics.upstreams);
    let mut session = Session::new(limits, deadline, metrics);
    session.client_in = first;
    if let Some(shared) = interception {
        let (tx, rx) = mpsc::unbounded_channel();
        session.intercepting = Some(Intercepting::new(shared, tx));
        session.parked_rx = Some(rx);
    }
    session.run(client, upstream, force).await;
}

struct Session {
    limits: Limits,
    handshake_deadline: Instant,
    client_in: BytesMut,
    upstream_in: BytesMut,
    to_client: BytesMut,
    to_upstream: BytesMut,
    client_decoder: FrameDecoder,
    upstream_decoder: FrameDecoder,
    channels: Channels,
    channel_max: u16,
    heartbeat: Duration,
    open: bool,
    client_rx: Instant,
    upstream_rx: Instant,
    close: Close,
    intercepting: Option<Intercepting>,
    parked_rx: Option<mpsc::UnboundedReceiver<Parked>>,
    holding: bool,
    held: BytesMut,
    deferred_close: Option<&'static str>,
    /// When nackd last acked a held message upstream.
    acked_at: Option<Instant>,
    /// Claims made (the number of the last one).
    claims: u64,
    /// The claims the store has not answered yet: number → when made.
    unanswered: BTreeMap<u64, Instant>,
    /// Held-back frames wait for the claims up to this number.
    barrier: Option<u64>,
    /// When the last claim of the barrier was acked.
    barrier_acked_at: Option<Instant>,
    /// When the frames held back may go on (see [`ACK_GRACE`]).
    release_at: Option<Instant>,
    metrics: Arc<Metrics>,
}

type Fault = FrameError;

impl Session {
    fn new(limits: Limits, handshake_deadline: Instant, metrics: Arc<Metrics>) -> Self {
        let now = Instant::now();
        Self {
            limits,
            handshake_deadline,
            client_in: BytesMut::new(),
            upstream_in: BytesMut::new(),
            to_client: BytesMut::new(),
            to_upstream: BytesMut::new(),
            client_decoder: FrameDecoder::default(),
            upstream_decoder: FrameDecoder::default(),
            channels: Channels::default(),
            channel_max: 0,
            heartbeat: Duration::ZERO,
            open: false,
            client_rx: now,
            upstream_rx: now,
            close: Close::default(),
            intercepting: None,
            parked_rx: None,
            holding: false,
            held: BytesMut::new(),
            deferred_close: None,
            acked_at: None,
            claims: 0,
            unanswered: BTreeMap::new(),
            barrier: None,
            barrier_acked_at: None,
            release_at: None,
            metrics,
        }
    }

    async fn run(&mut self, client: Io, upstream: Io, force: CancellationToken) {
        let (mut client_rd, mut client_wr) = tokio::io::split(client);
        let (mut upstream_rd, mut upstream_wr) = tokio::io::split(upstream);
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let (mut client_flush, mut upstream_flush) = (false, false);
        // Frames the client sent along with its protocol header.
        self.on_bytes(frames::Peer::Client);
        while !self.close.finished(Instant::now()) {
            reserve(&mut self.client_in);
            reserve(&mut self.upstream_in);
            tokio::select! {
                biased;
                _ = force.cancelled(), if !self.close.forced => self.on_force(),
                r = client_rd.read_buf(&mut self.client_in), if self.may_read_client() => match r {
                    Ok(n) if n > 0 => {
                        self.client_rx = Instant::now();
                        self.metrics.bytes.to_upstream.inc_by(n as u64);
                        self.on_bytes(frames::Peer::Client)
                    }
                    r => self.on_client_gone(r.err()),
                },
                r = upstream_rd.read_buf(&mut self.upstream_in), if self.may_read_upstream() => match r {
                    Ok(n) if n > 0 => {
                        self.upstream_rx = Instant::now();
                        self.metrics.bytes.to_client.inc_by(n as u64);
                        self.on_bytes(frames::Peer::Upstream)
                    }
                    r => self.on_upstream_gone(r.err()),
                },
                r = write_or_flush(&mut client_wr, &mut self.to_client), if (client_flush || !self.to_client.is_empty()) && !self.close.client_gone => match r {
                    Ok(flushed) => client_flush = !flushed,
                    Err(e) => self.on_client_gone(Some(e)),
                },
                r = write_or_flush(&mut upstream_wr, &mut self.to_upstream), if (upstream_flush || !self.to_upstream.is_empty()) && !self.close.upstream_gone => match r {
                    Ok(flushed) => upstream_flush = !flushed,
                    Err(e) => self.on_upstream_gone(Some(e)),
                },
                Some(parked) = recv(&mut self.parked_rx) => self.on_parked(parked),
                _ = sleep_until(self.release_at), if self.release_at.is_some() => {
                    self.release_at = None;
                    self.release_if_settled();
                }
                _ = tick.tick() => self.on_tick(Instant::now()),
            }
        }
        self.cancel_unanswered();
        self.drain(&mut client_rd, &mut client_wr, &mut upstream_wr)
            .await;
        info!(reason = self.close.reason(), "connection closed");
    }

    /// Writes what is still buffered for the sides that are alive, then closes them.
    /// Writes what is still buffered for the sides that are alive, then
    /// closes them. Like RabbitMQ, nackd lets the client close its socket
    /// first after a close handshake: closing at once makes clients see the
    /// end of the stream before they have handled `close-ok`.
    async fn drain(
        &mut self,
        client_rd: &mut ReadHalf<Io>,
        client_wr: &mut WriteHalf<Io>,
        upstream_wr: &mut WriteHalf<Io>,
    ) {
        let flush = async {
            if !self.close.client_gone {
                let _ = client_wr.write_all_buf(&mut self.to_client).await;
                let _ = client_wr.flush().await;
            }
            if !self.close.upstream_gone {
                let _ = upstream_wr.write_all_buf(&mut self.to_upstream).await;
                let _ = upstream_wr.shutdown().await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), flush).await;
        if !self.close.client_gone {
            let mut sink = [0u8; 4096];
            let client_closes =
                async { while matches!(client_rd.read(&mut sink).await, Ok(n) if n > 0) {} };
            let _ = tokio::time::timeout(Duration::from_secs(1), client_closes).await;
            let _ = client_wr.shutdown().await;
        }
    }

    fn may_read_client(&self) -> bool {
        !self.close.client_gone && self.to_upstream.len() + self.held.len() < HIGH_WATER
    }

    fn may_read_upstream(&self) -> bool {
        !self.close.upstream_gone && self.to_client.len() < HIGH_WATER
    }
}

/// Writes some of `buf`, or flushes once it is empty; `Ok(true)` once flushed.
async fn write_or_flush(wr: &mut WriteHalf<Io>, buf: &mut BytesMut) -> std::io::Result<bool> {
    if buf.is_empty() {
        wr.flush().await?;
        return Ok(true);
    }
    wr.write_buf(buf).await?;
    Ok(false)
}

async fn sleep_until(at: Option<Instant>) {
    if let Some(at) = at {
        tokio::time::sleep_until(at.into()).await;
    }
}

async fn recv(rx: &mut Option<mpsc::UnboundedReceiver<Parked>>) -> Option<Parked> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

fn reserve(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < READ_CHUNK / 4 {
        buf.reserve(READ_CHUNK);
    }
}

/// Client address and span fields for [`serve`].
pub fn span(client: SocketAddr) -> Span {
    tracing::info_span!(
        "conn",
        client.addr = %client,
        upstream.addr = tracing::field::Empty,
        vhost = tracing::field::Empty,
        user = tracing::field::Empty,
    )
}

#[cfg(test)]
mod tests;

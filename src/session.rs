//! One client connection and its upstream connection: the pump around the
//! session's state machine (`nackd_core::session`): the sockets, `select!`,
//! backpressure, the clock, and the link to the retry engine.
//!
//! A single task owns both sockets and the core, so nothing is locked on
//! the hot path. Each side is read only while the core says so (the other
//! side's write buffer is below [`super::HIGH_WATER`]): a peer that does
//! not read stops the one that writes. Frames read in one go are written
//! in one go: the write branch runs once no read is ready.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Span};

use nackd_core::clock::Clock;
use nackd_core::held::{Parked, StoreError};
use nackd_core::protocol::frame::{self, ProtocolHeader};
use nackd_core::session::{Effect, Interception, Limits, Peer, Session};

use crate::metrics::{Metrics, Open};
use crate::net::{Connector, Io};
use crate::retry::{ParkReply, RetryHandle};

/// Read buffer growth step.
const READ_CHUNK: usize = 64 * 1024;

/// What a session needs to intercept: what the state machine shares with
/// every session, and the retry engine its parks go to.
#[derive(Clone)]
pub struct Intercept {
    /// Policies, capture budget, readiness, clock.
    pub shared: Arc<Interception>,
    /// The retry engine.
    pub retry: RetryHandle,
}

/// Where a session is: the limits it applies, nackd's clock, what it
/// intercepts (none without a policy), the metrics it adds to.
#[derive(Clone)]
pub struct Context {
    /// Frame size and handshake limits.
    pub limits: Limits,
    /// nackd's one clock.
    pub clock: Clock,
    /// What it intercepts.
    pub intercept: Option<Intercept>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
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

/// Serves one accepted client until both sides are closed.
/// `force` asks the session to close both sides now (end of shutdown grace).
pub async fn serve(mut client: Io, connector: Connector, cx: Context, force: CancellationToken) {
    let Context {
        limits,
        clock,
        intercept,
        metrics,
    } = cx;
    let deadline = clock.now() + limits.handshake_timeout;
    let Some(first) = protocol_header(&mut client, deadline, &limits, &metrics).await else {
        return;
    };
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
    let core = Session::new(
        limits,
        deadline,
        clock.now(),
        metrics.session.clone(),
        intercept.as_ref().map(|i| &i.shared),
    );
    let engine = intercept.map(|i| {
        let (reply, answers) = mpsc::unbounded_channel();
        EngineLink {
            retry: i.retry,
            reply,
            answers,
        }
    });
    let mut pump = Pump {
        core,
        clock,
        client_in: first,
        upstream_in: BytesMut::new(),
        engine,
        metrics,
    };
    pump.run(client, upstream, force).await;
}

/// Reads the client's protocol header; `None` if the session ends there.
/// Returns what was read (the header and any frames sent along with it).
async fn protocol_header(
    client: &mut Io,
    deadline: Instant,
    limits: &Limits,
    metrics: &Metrics,
) -> Option<BytesMut> {
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
        Ok(Some(ProtocolHeader::Amqp091)) => Some(first),
        Ok(Some(ProtocolHeader::Unsupported)) => {
            info!("refused: client does not speak AMQP 0-9-1");
            let _ = client.write_all(frame::PROTOCOL_HEADER).await;
            let _ = client.shutdown().await;
            None
        }
        Ok(None) => {
            debug!("client left before sending a protocol header");
            None
        }
        Err(_) => {
            warn!(timeout = ?limits.handshake_timeout, "handshake timed out before the protocol header");
            None
        }
    }
}

/// Where the core's parks and cancels go, and where answers come back.
struct EngineLink {
    retry: RetryHandle,
    reply: ParkReply,
    answers: mpsc::UnboundedReceiver<Parked>,
}

struct Pump {
    core: Session,
    clock: Clock,
    client_in: BytesMut,
    upstream_in: BytesMut,
    engine: Option<EngineLink>,
    metrics: Arc<Metrics>,
}

impl Pump {
    async fn run(&mut self, client: Io, upstream: Io, force: CancellationToken) {
        let (mut client_rd, mut client_wr) = tokio::io::split(client);
        let (mut upstream_rd, mut upstream_wr) = tokio::io::split(upstream);
        let (mut client_flush, mut upstream_flush) = (false, false);
        // Frames the client sent along with its protocol header.
        self.core
            .handle_bytes(Peer::Client, &mut self.client_in, self.clock.now());
        // One timer, moved when the core's deadline moves (registering a new
        // one on every turn of the loop costs on the hot path).
        let timer = tokio::time::sleep_until(self.core.poll_timeout().into());
        tokio::pin!(timer);
        while !self.core.is_finished(self.clock.now()) {
            self.apply_effects();
            reserve(&mut self.client_in);
            reserve(&mut self.upstream_in);
            let forced = self.core.forced();
            let read_client = self.core.may_read(Peer::Client);
            let read_upstream = self.core.may_read(Peer::Upstream);
            let (write_client, write_upstream) = (
                self.core.may_write(Peer::Client),
                self.core.may_write(Peer::Upstream),
            );
            let wake = tokio::time::Instant::from(self.core.poll_timeout());
            if timer.deadline() != wake {
                timer.as_mut().reset(wake);
            }
            let (to_client, to_upstream) = self.core.transmit();
            let write_client = write_client && (client_flush || !to_client.is_empty());
            let write_upstream = write_upstream && (upstream_flush || !to_upstream.is_empty());
            tokio::select! {
                biased;
                _ = force.cancelled(), if !forced => self.core.handle_force(self.clock.now()),
                r = client_rd.read_buf(&mut self.client_in), if read_client => {
                    self.on_read(Peer::Client, r)
                }
                r = upstream_rd.read_buf(&mut self.upstream_in), if read_upstream => {
                    self.on_read(Peer::Upstream, r)
                }
                r = write_or_flush(&mut client_wr, to_client), if write_client => match r {
                    Ok(flushed) => client_flush = !flushed,
                    Err(e) => self.core.handle_gone(Peer::Client, Some(e), self.clock.now()),
                },
                r = write_or_flush(&mut upstream_wr, to_upstream), if write_upstream => match r {
                    Ok(flushed) => upstream_flush = !flushed,
                    Err(e) => self.core.handle_gone(Peer::Upstream, Some(e), self.clock.now()),
                },
                Some(parked) = answer(&mut self.engine) => {
                    self.core.handle_parked(parked, self.clock.now())
                }
                _ = &mut timer => self.core.handle_timeout(self.clock.now()),
            }
        }
        self.end();
        self.drain(&mut client_rd, &mut client_wr, &mut upstream_wr)
            .await;
        info!(reason = self.core.close_reason(), "connection closed");
    }

    /// A read from `peer` ended: bytes for the core, or the side is gone.
    fn on_read(&mut self, peer: Peer, read: std::io::Result<usize>) {
        let now = self.clock.now();
        match read {
            Ok(n) if n > 0 => {
                let (bytes, input) = match peer {
                    Peer::Client => (&self.metrics.bytes.to_upstream, &mut self.client_in),
                    Peer::Upstream => (&self.metrics.bytes.to_client, &mut self.upstream_in),
                };
                bytes.inc_by(n as u64);
                self.core.handle_bytes(peer, input, now);
            }
            r => self.core.handle_gone(peer, r.err(), now),
        }
    }

    /// Carries what the core asked of the engine; a park the engine can no
    /// longer take is answered at once (its nack goes to the broker).
    fn apply_effects(&mut self) {
        while let Some(effect) = self.core.poll_effect() {
            let Some(link) = &self.engine else { continue };
            match effect {
                Effect::Park(park) => {
                    let key = park.key;
                    if !link.retry.park(park, &link.reply) {
                        warn!("retry engine is gone: the nack is deferred");
                        let result = Err(StoreError::Io("the retry engine is gone".into()));
                        self.core
                            .handle_parked(Parked { key, result }, self.clock.now());
                    }
                }
                Effect::Cancel(id) => link.retry.cancel(id),
            }
        }
    }

    /// The session is over: answers still on their way are collected and
    /// what nackd holds without having acked it is cancelled.
    fn end(&mut self) {
        let mut late = Vec::new();
        if let Some(link) = &mut self.engine {
            link.answers.close();
            while let Ok(parked) = link.answers.try_recv() {
                late.push(parked);
            }
        }
        self.core.end(late);
        self.apply_effects();
    }

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
        let (client_open, upstream_open) = (
            self.core.may_write(Peer::Client),
            self.core.may_write(Peer::Upstream),
        );
        let (to_client, to_upstream) = self.core.transmit();
        let flush = async {
            if client_open {
                let _ = client_wr.write_all_buf(to_client).await;
                let _ = client_wr.flush().await;
            }
            if upstream_open {
                let _ = upstream_wr.write_all_buf(to_upstream).await;
                let _ = upstream_wr.shutdown().await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), flush).await;
        if client_open {
            let mut sink = [0u8; 4096];
            let client_closes =
                async { while matches!(client_rd.read(&mut sink).await, Ok(n) if n > 0) {} };
            let _ = tokio::time::timeout(Duration::from_secs(1), client_closes).await;
            let _ = client_wr.shutdown().await;
        }
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

async fn answer(engine: &mut Option<EngineLink>) -> Option<Parked> {
    match engine {
        Some(link) => link.answers.recv().await,
        None => std::future::pending().await,
    }
}

fn reserve(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < READ_CHUNK / 4 {
        buf.reserve(READ_CHUNK);
    }
}

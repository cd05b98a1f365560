//! One client connection and its upstream connection: the pump around the
//! session's state machine (`nackd_core::session`): the sockets, `select!`,
//! backpressure, the clock, and the link to the retry engine.
//!
//! A single task owns both sockets and the core, so nothing is locked on
//! the hot path, and it is one hand-written poll loop (no `select!`, no
//! split halves): each wake-up reads every side that has bytes, hands them
//! to the core, and writes what the core says, in as many passes as make
//! progress, before the task sleeps again. Each side is read only while
//! the core says so (the other side's write buffer is below
//! `nackd_core::session::HIGH_WATER`): a peer that does not read stops the
//! one that writes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::future::Future;
use std::pin::Pin;
use std::task::{Context as Cx, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::time::Sleep;
use tokio_util::io::poll_read_buf;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tracing::{debug, info, warn, Span};

use nackd_core::clock::Clock;
use nackd_core::held::{Parked, StoreError};
use nackd_core::protocol::frame::{self, ProtocolHeader};
use nackd_core::session::{Effect, Interception, Limits, Peer, Session};

use crate::coalesce::{self, Coalesce};
use crate::metrics::{Metrics, Open};
use crate::net::{Connector, Io};
use crate::retry::{ParkReply, RetryHandle};

/// Read buffer growth step.
const READ_CHUNK: usize = 64 * 1024;

/// What a session needs to intercept: what the state machine shares with
/// every session, and the retry engine its parks go to.
#[derive(Clone)]
pub(crate) struct Intercept {
    /// Policies, capture budget, readiness, clock.
    pub shared: Arc<Interception>,
    /// The retry engine.
    pub retry: RetryHandle,
}

/// Where a session is: the limits it applies, nackd's clock, what it
/// intercepts (none without a policy), the metrics it adds to.
#[derive(Clone)]
pub(crate) struct Context {
    /// Frame size and handshake limits.
    pub limits: Limits,
    /// nackd's one clock.
    pub clock: Clock,
    /// What it intercepts.
    pub intercept: Option<Intercept>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// `runtime.coalesce`: the wait of an idle thread while a peer streams.
    pub coalesce: Duration,
}

/// Client address and span fields for [`serve`].
pub(crate) fn span(client: SocketAddr) -> Span {
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
pub(crate) async fn serve(
    mut client: Io,
    connector: Connector,
    cx: Context,
    force: CancellationToken,
) {
    let Context {
        limits,
        clock,
        intercept,
        metrics,
        coalesce,
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
        coalesce: Coalesce::new(coalesce, clock.now()),
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
    coalesce: Coalesce,
}

impl Pump {
    async fn run(&mut self, mut client: Io, mut upstream: Io, force: CancellationToken) {
        // Frames the client sent along with its protocol header.
        self.core
            .handle_bytes(Peer::Client, &mut self.client_in, self.clock.now());
        // One timer, moved when the core's deadline moves (registering a new
        // one on every turn costs on the hot path).
        let timer = tokio::time::sleep_until(self.core.poll_timeout().into());
        let forced = force.cancelled_owned();
        tokio::pin!(timer, forced);
        let mut unflushed = [false; 2];
        // Off (`coalesce = "0s"`), a wake-up reads no clock for it.
        let coalescing = self.coalesce.on();
        std::future::poll_fn(|cx| {
            if coalescing {
                self.coalesce.on_wake(self.clock.now());
            }
            let mut sides = Sides {
                client: &mut client,
                upstream: &mut upstream,
                unflushed: &mut unflushed,
            };
            let turned = self.turn(cx, &mut sides, forced.as_mut(), timer.as_mut());
            if coalescing {
                self.coalesce.on_sleep(self.clock.now());
            }
            turned
        })
        .await;
        self.end();
        self.drain(&mut client, &mut upstream).await;
        info!(reason = self.core.close_reason(), "connection closed");
    }

    /// One wake-up: everything that is ready is done before the task sleeps
    /// again, each side read until it has nothing more (or the other side's
    /// buffer is full), then both written, in one pass, as many passes as
    /// make progress. A lone frame goes out in the pass that read it. Ends
    /// (`Ready`) once the core says the pair is finished.
    fn turn(
        &mut self,
        cx: &mut Cx<'_>,
        sides: &mut Sides<'_>,
        mut forced: Pin<&mut WaitForCancellationFutureOwned>,
        mut timer: Pin<&mut Sleep>,
    ) -> Poll<()> {
        loop {
            let now = self.clock.now();
            if self.core.is_finished(now) {
                return Poll::Ready(());
            }
            let mut progress = false;
            if !self.core.forced() && forced.as_mut().poll(cx).is_ready() {
                self.core.handle_force(now);
                progress = true;
            }
            if let Some(link) = &mut self.engine {
                while let Poll::Ready(Some(parked)) = link.answers.poll_recv(cx) {
                    self.core.handle_parked(parked, now);
                    progress = true;
                }
            }
            progress |= self.read(cx, Peer::Client, sides.client, now);
            progress |= self.read(cx, Peer::Upstream, sides.upstream, now);
            self.apply_effects();
            progress |= self.write(cx, Peer::Client, sides.client, &mut sides.unflushed[0]);
            progress |= self.write(cx, Peer::Upstream, sides.upstream, &mut sides.unflushed[1]);
            let wake = tokio::time::Instant::from(self.core.poll_timeout());
            if timer.deadline() != wake {
                timer.as_mut().reset(wake);
            }
            if timer.as_mut().poll(cx).is_ready() {
                self.core.handle_timeout(self.clock.now());
                progress = true;
            }
            if !progress {
                return Poll::Pending;
            }
        }
    }

    /// Reads `peer` while it has bytes and the core may take them, each
    /// read handed to the core at once; `true` if anything happened.
    fn read(&mut self, cx: &mut Cx<'_>, peer: Peer, io: &mut Io, now: Instant) -> bool {
        let mut progress = false;
        while self.core.may_read(peer) {
            let (bytes, input) = match peer {
                Peer::Client => (&self.metrics.bytes.to_upstream, &mut self.client_in),
                Peer::Upstream => (&self.metrics.bytes.to_client, &mut self.upstream_in),
            };
            reserve(input);
            match poll_read_buf(Pin::new(&mut *io), cx, input) {
                Poll::Pending => break,
                Poll::Ready(Ok(n)) if n > 0 => {
                    bytes.inc_by(n as u64);
                    self.coalesce.read(side(peer));
                    self.core.handle_bytes(peer, input, now);
                    progress = true;
                }
                Poll::Ready(read) => {
                    self.core.handle_gone(peer, read.err(), now);
                    return true;
                }
            }
        }
        progress
    }

    /// Writes what the core has for `peer`, then flushes it (a TLS stream
    /// holds bytes until flushed); `true` if anything happened.
    fn write(&mut self, cx: &mut Cx<'_>, peer: Peer, io: &mut Io, unflushed: &mut bool) -> bool {
        if !self.core.may_write(peer) {
            return false;
        }
        let (to_client, to_upstream) = self.core.transmit();
        let out = match peer {
            Peer::Client => to_client,
            Peer::Upstream => to_upstream,
        };
        let mut progress = false;
        let failed = loop {
            if out.is_empty() {
                if !*unflushed {
                    return progress;
                }
                match Pin::new(&mut *io).poll_flush(cx) {
                    Poll::Ready(Ok(())) => *unflushed = false,
                    Poll::Ready(Err(e)) => break e,
                    Poll::Pending => {}
                }
                return progress;
            }
            match Pin::new(&mut *io).poll_write(cx, out) {
                Poll::Ready(Ok(0)) => break std::io::ErrorKind::WriteZero.into(),
                Poll::Ready(Ok(n)) => {
                    out.advance(n);
                    self.coalesce.wrote(side(peer));
                    (*unflushed, progress) = (true, true);
                }
                Poll::Ready(Err(e)) => break e,
                Poll::Pending => return progress,
            }
        };
        self.core.handle_gone(peer, Some(failed), self.clock.now());
        true
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
    async fn drain(&mut self, client: &mut Io, upstream: &mut Io) {
        let (client_open, upstream_open) = (
            self.core.may_write(Peer::Client),
            self.core.may_write(Peer::Upstream),
        );
        let (to_client, to_upstream) = self.core.transmit();
        let flush = async {
            if client_open {
                let _ = client.write_all_buf(to_client).await;
                let _ = client.flush().await;
            }
            if upstream_open {
                let _ = upstream.write_all_buf(to_upstream).await;
                let _ = upstream.shutdown().await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), flush).await;
        if client_open {
            let mut sink = [0u8; 4096];
            let client_closes =
                async { while matches!(client.read(&mut sink).await, Ok(n) if n > 0) {} };
            let _ = tokio::time::timeout(Duration::from_secs(1), client_closes).await;
            let _ = client.shutdown().await;
        }
    }
}

/// Both sockets of the pair and whether each has unflushed writes.
struct Sides<'a> {
    client: &'a mut Io,
    upstream: &'a mut Io,
    unflushed: &'a mut [bool; 2],
}

/// `peer` as a side of [`Coalesce`].
fn side(peer: Peer) -> usize {
    match peer {
        Peer::Client => coalesce::CLIENT,
        Peer::Upstream => coalesce::UPSTREAM,
    }
}

fn reserve(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < READ_CHUNK / 4 {
        buf.reserve(READ_CHUNK);
    }
}

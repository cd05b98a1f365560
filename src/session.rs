//! One client connection and its upstream connection: the frame pump.
//!
//! A single task owns both sockets and all state of the pair, so nothing is
//! locked on the hot path. Each side is read only while the other side's
//! write buffer is below [`HIGH_WATER`]: a peer that does not read stops the
//! one that writes (backpressure end to end). Frames read in one go are
//! written in one go: the write branch runs once no read is ready.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt, WriteHalf};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Span};

use crate::channel::Channels;
use crate::frame::{self, Frame, FrameDecoder, FrameError, FrameType, ProtocolHeader};
use crate::method::{self, ids, MethodId};
use crate::metrics::{Metrics, Open};
use crate::net::{Connector, Io};
use crate::reply::ReplyCode;

mod close;
mod intercepting;
use close::{Close, Origin};
use intercepting::Intercepting;
pub use intercepting::Interception;

use crate::intercept::Settle;
use crate::retry::Parked;
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
        Err(_) => return warn!(timeout = ?limits.handshake_timeout, "handshake timed out before the protocol header"),
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
        self.on_client_bytes();
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
                        self.on_client_bytes()
                    }
                    r => self.on_client_gone(r.err()),
                },
                r = upstream_rd.read_buf(&mut self.upstream_in), if self.may_read_upstream() => match r {
                    Ok(n) if n > 0 => {
                        self.upstream_rx = Instant::now();
                        self.metrics.bytes.to_client.inc_by(n as u64);
                        self.on_upstream_bytes()
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
                _ = tick.tick() => self.on_tick(Instant::now()),
            }
        }
        self.drain(&mut client_wr, &mut upstream_wr).await;
        info!(reason = self.close.reason(), "connection closed");
    }

    /// Writes what is still buffered for the sides that are alive, then closes them.
    async fn drain(&mut self, client_wr: &mut WriteHalf<Io>, upstream_wr: &mut WriteHalf<Io>) {
        let flush = async {
            if !self.close.client_gone {
                let _ = client_wr.write_all_buf(&mut self.to_client).await;
                let _ = client_wr.shutdown().await;
            }
            if !self.close.upstream_gone {
                let _ = upstream_wr.write_all_buf(&mut self.to_upstream).await;
                let _ = upstream_wr.shutdown().await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), flush).await;
    }

    fn may_read_client(&self) -> bool {
        !self.close.client_gone && self.to_upstream.len() + self.held.len() < HIGH_WATER
    }

    fn may_read_upstream(&self) -> bool {
        !self.close.upstream_gone && self.to_client.len() < HIGH_WATER
    }

    /// Handles every whole frame the client sent; counts them once per read.
    fn on_client_bytes(&mut self) {
        let mut frames = 0;
        loop {
            match self.client_decoder.decode(&mut self.client_in) {
                Ok(Some(frame)) => {
                    frames += 1;
                    if let Err(fault) = self.on_client_frame(frame) {
                        self.on_client_fault(fault);
                        break;
                    }
                }
                Ok(None) => break,
                Err(fault) => {
                    self.on_client_fault(fault);
                    break;
                }
            }
        }
        self.metrics.frames.to_upstream.inc_by(frames);
    }

    /// Handles every whole frame the broker sent; counts them once per read.
    fn on_upstream_bytes(&mut self) {
        let mut frames = 0;
        loop {
            match self.upstream_decoder.decode(&mut self.upstream_in) {
                Ok(Some(frame)) => {
                    frames += 1;
                    if let Err(fault) = self.on_upstream_frame(frame) {
                        self.on_upstream_fault(fault);
                        break;
                    }
                }
                Ok(None) => break,
                Err(fault) => {
                    self.on_upstream_fault(fault);
                    break;
                }
            }
        }
        self.metrics.frames.to_client.inc_by(frames);
    }

    fn on_client_frame(&mut self, frame: Frame) -> Result<(), Fault> {
        if self.close.client_failed {
            return self.on_failed_client_frame(&frame);
        }
        if self.channel_max != 0 && frame.channel > self.channel_max {
            return Err(FrameError::ChannelOutOfRange {
                channel: frame.channel,
                max: self.channel_max,
            });
        }
        match frame.kind {
            FrameType::Heartbeat => {}
            FrameType::Method => {
                let payload = &frame.raw[frame::HEADER_LEN..frame.raw.len() - 1];
                let id = MethodId::peek(payload)?;
                if frame.channel != 0 {
                    self.channels.get(frame.channel).publishing.advance(&frame, Some(id))?;
                }
                if let Some(class) = method::decode(payload)? {
                    if !self.on_client_method(frame.channel, &class) {
                        return Ok(());
                    }
                }
            }
            FrameType::Header | FrameType::Body if frame.channel == 0 => {
                return Err(FrameError::Unexpected("content frame on channel 0"));
            }
            FrameType::Header | FrameType::Body => {
                let channel = self.channels.get(frame.channel);
                channel.publishing.advance(&frame, None)?;
                if !channel.publishing.in_flight() && !channel.deferred.is_empty() {
                    let deferred = std::mem::take(&mut channel.deferred);
                    self.emit_upstream(&frame.raw);
                    for ack in deferred {
                        self.to_upstream.extend_from_slice(&ack);
                    }
                    return Ok(());
                }
            }
        }
        self.emit_upstream(&frame.raw);
        Ok(())
    }

    /// Observes a decoded client method; `false` means "do not forward it".
    fn on_client_method(&mut self, channel_id: u16, class: &AMQPClass) -> bool {
        match class {
            AMQPClass::Connection(connection::AMQPMethod::StartOk(ok)) => {
                Span::current().record("user", tracing::field::display(sasl_user(ok)));
            }
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune)) => self.on_tune_ok(tune),
            AMQPClass::Connection(connection::AMQPMethod::Open(open)) => {
                Span::current().record("vhost", open.virtual_host.as_str());
                if let Some(state) = self.intercepting.as_mut() {
                    state.vhost = Arc::from(open.virtual_host.as_str());
                }
            }
            AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
                debug!(code = c.reply_code, text = c.reply_text.as_str(), "client closes the connection");
                if self.channels.pending() > 0 {
                    self.hold();
                }
                self.close.expect_upstream_close_ok(Origin::Client);
            }
            AMQPClass::Basic(basic::AMQPMethod::Ack(a)) if channel_id != 0 => {
                return self.on_settle(channel_id, Settle::Ack, a.delivery_tag, a.multiple);
            }
            AMQPClass::Basic(basic::AMQPMethod::Nack(n)) if channel_id != 0 => {
                return self.on_settle(channel_id, Settle::Nack(n.requeue), n.delivery_tag, n.multiple);
            }
            AMQPClass::Basic(basic::AMQPMethod::Reject(r)) if channel_id != 0 => {
                return self.on_settle(channel_id, Settle::Reject(r.requeue), r.delivery_tag, false);
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(_))
            | AMQPClass::Basic(basic::AMQPMethod::Recover(_) | basic::AMQPMethod::RecoverAsync(_))
                if channel_id != 0 && !self.channels.get(channel_id).pending.is_empty() =>
            {
                // The broker would requeue what nackd holds: ack it first.
                self.hold();
                self.channels.get(channel_id).on_client_method(class);
            }
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => {
                return self.close.client_close_ok() == Some(Origin::Broker);
            }
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                self.channels.remove(channel_id);
            }
            _ if channel_id != 0 => self.channels.get(channel_id).on_client_method(class),
            _ => {}
        }
        true
    }

    fn on_tune_ok(&mut self, tune: &connection::TuneOk) {
        let frame_max = match tune.frame_max {
            0 => self.limits.max_frame,
            n => n.min(self.limits.max_frame),
        };
        self.client_decoder.set_frame_max(frame_max);
        self.upstream_decoder.set_frame_max(frame_max);
        self.channel_max = tune.channel_max;
        self.heartbeat = Duration::from_secs(tune.heartbeat.into());
        debug!(frame_max, channel_max = tune.channel_max, heartbeat = tune.heartbeat, "tuned");
    }

    /// After a client fault only the close handshake matters.
    fn on_failed_client_frame(&mut self, frame: &Frame) -> Result<(), Fault> {
        if frame.kind != FrameType::Method || frame.channel != 0 {
            return Ok(());
        }
        match MethodId::peek(&frame.raw[frame::HEADER_LEN..])? {
            ids::CONNECTION_CLOSE_OK => {
                self.close.client_close_ok();
            }
            ids::CONNECTION_CLOSE => {
                self.to_client.extend_from_slice(&method::connection_close_ok());
                self.close.client_close_ok();
            }
            _ => {}
        }
        Ok(())
    }

    fn on_upstream_frame(&mut self, frame: Frame) -> Result<(), Fault> {
        match frame.kind {
            FrameType::Heartbeat => {}
            FrameType::Method => {
                let payload = &frame.raw[frame::HEADER_LEN..frame.raw.len() - 1];
                let id = MethodId::peek(payload)?;
                if frame.channel != 0 {
                    self.channels.get(frame.channel).delivering.advance(&frame, Some(id))?;
                }
                if let Some(class) = method::decode(payload)? {
                    if !self.on_upstream_method(frame.channel, &class) {
                        return Ok(());
                    }
                }
            }
            FrameType::Header | FrameType::Body if frame.channel == 0 => {
                return Err(FrameError::Unexpected("content frame on channel 0"));
            }
            FrameType::Header | FrameType::Body => {
                self.channels.get(frame.channel).delivering.advance(&frame, None)?;
                self.capture_content(&frame);
            }
        }
        if !self.close.client_failed {
            self.to_client.extend_from_slice(&frame.raw);
        }
        Ok(())
    }

    /// Observes a decoded broker method; `false` means "do not forward it".
    fn on_upstream_method(&mut self, channel_id: u16, class: &AMQPClass) -> bool {
        match class {
            AMQPClass::Connection(connection::AMQPMethod::Tune(tune)) => {
                if tune.frame_max == 0 || tune.frame_max > self.limits.max_frame {
                    // Offer the client no more than nackd accepts.
                    let mut capped = tune.clone();
                    capped.frame_max = self.limits.max_frame;
                    let tune = AMQPClass::Connection(connection::AMQPMethod::Tune(capped));
                    self.to_client.extend_from_slice(&method::encode(0, &tune));
                    return false;
                }
            }
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)) => {
                self.open = true;
                info!("connection open");
            }
            AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
                info!(code = c.reply_code, text = c.reply_text.as_str(), "broker closes the connection");
                self.close.expect_client_close_ok(Origin::Broker);
            }
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => {
                return self.close.upstream_close_ok() == Some(Origin::Client);
            }
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                self.channels.remove(channel_id);
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(_)) if channel_id != 0 => {
                self.channels.get(channel_id).closing = true;
            }
            AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) if channel_id != 0 => {
                self.channels.get(channel_id).on_broker_method(class);
                self.start_capture(channel_id, d.delivery_tag, d.exchange.as_str(), d.routing_key.as_str());
            }
            AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) if channel_id != 0 => {
                self.channels.get(channel_id).on_broker_method(class);
                self.start_capture(channel_id, ok.delivery_tag, ok.exchange.as_str(), ok.routing_key.as_str());
            }
            _ if channel_id != 0 => self.channels.get(channel_id).on_broker_method(class),
            _ => {}
        }
        true
    }

    fn on_client_fault(&mut self, fault: Fault) {
        let code = fault.reply_code();
        warn!(code = code.code(), error = %fault, "closing the client connection: protocol error");
        self.close.client_failed = true;
        self.client_in.clear();
        let text = format!("{} - {fault}", code.name());
        self.to_client.extend_from_slice(&method::connection_close(code, &text, None));
        self.close.expect_client_close_ok(Origin::Nackd);
        self.close_upstream("client connection failed");
    }

    fn on_upstream_fault(&mut self, fault: Fault) {
        warn!(error = %fault, "the broker sent a malformed frame; closing both sides");
        self.close.upstream_gone = true;
        self.close_client(ReplyCode::InternalError, &format!("nackd: broker sent a malformed frame: {fault}"));
    }

    fn on_client_gone(&mut self, error: Option<std::io::Error>) {
        if self.close.client_gone {
            return;
        }
        match (&error, self.close.started()) {
            (_, true) => debug!(?error, "client socket closed"),
            (Some(e), false) => info!(error = %e, "client socket failed"),
            (None, false) => info!("client closed the socket without connection.close"),
        }
        self.close.client_gone = true;
        self.close.begin();
        if self.close.awaiting_client() == Some(Origin::Broker) {
            // The broker waits for a close-ok the client will never send.
            self.to_upstream.extend_from_slice(&method::connection_close_ok());
            self.close.client_close_ok();
        } else if self.channels.pending() > 0 {
            // Ack what nackd holds before the broker sees the client go.
            self.close.settling = true;
            self.deferred_close = Some("client socket closed");
        } else {
            self.close_upstream("client socket closed");
        }
    }

    fn on_upstream_gone(&mut self, error: Option<std::io::Error>) {
        if self.close.upstream_gone {
            return;
        }
        if !self.close.started() {
            warn!(error = ?error.map(|e| e.to_string()), "upstream connection lost");
        }
        self.close.upstream_gone = true;
        self.close.begin();
        if self.close.upstream_close_ok() == Some(Origin::Client) {
            // The client asked to close: it gets its close-ok.
            self.to_client.extend_from_slice(&method::connection_close_ok());
        } else if self.close.awaiting_client().is_none() {
            self.close_client(ReplyCode::ConnectionForced, "CONNECTION_FORCED - nackd: upstream connection lost");
        }
    }

    /// Sends `connection.close` to the client (or drops it mid-handshake).
    fn close_client(&mut self, code: ReplyCode, text: &str) {
        self.close.begin();
        if self.close.client_gone || self.close.awaiting_client().is_some() {
            return;
        }
        if !self.open {
            self.close.client_gone = true;
            return;
        }
        self.to_client.extend_from_slice(&method::connection_close(code, text, None));
        self.close.expect_client_close_ok(Origin::Nackd);
    }

    /// Sends `connection.close` to the broker (or drops it mid-handshake).
    fn close_upstream(&mut self, why: &'static str) {
        self.close.begin();
        if self.close.upstream_gone || self.close.awaiting_upstream().is_some() {
            return;
        }
        if !self.open {
            self.close.upstream_gone = true;
            return;
        }
        let text = format!("nackd: {why}");
        self.to_upstream.extend_from_slice(&method::connection_close(ReplyCode::Success, &text, None));
        self.close.expect_upstream_close_ok(Origin::Nackd);
    }

    fn on_force(&mut self) {
        self.close.forced = true;
        info!("closing: nackd is shutting down");
        self.close_client(ReplyCode::ConnectionForced, "CONNECTION_FORCED - nackd is shutting down");
        self.close_upstream("shutting down");
    }

    fn on_tick(&mut self, now: Instant) {
        if !self.open && now >= self.handshake_deadline && !self.close.started() {
            warn!(timeout = ?self.limits.handshake_timeout, "handshake timed out");
            self.close.begin();
            self.close.client_gone = true;
            self.close.upstream_gone = true;
            return;
        }
        if self.heartbeat.is_zero() || self.close.started() {
            return;
        }
        let limit = self.heartbeat * 2;
        if !self.may_read_client() {
            self.client_rx = now;
        }
        if !self.may_read_upstream() {
            self.upstream_rx = now;
        }
        if now.duration_since(self.client_rx) > limit {
            warn!(heartbeat = ?self.heartbeat, "client missed two heartbeats; closing");
            self.on_client_gone(None);
        } else if now.duration_since(self.upstream_rx) > limit {
            warn!(heartbeat = ?self.heartbeat, "broker missed two heartbeats; closing");
            self.on_upstream_gone(None);
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

/// The user name of a PLAIN or AMQPLAIN login, for logs (never the password).
fn sasl_user(ok: &connection::StartOk) -> String {
    match ok.mechanism.as_str() {
        "PLAIN" => ok
            .response
            .as_bytes()
            .split(|b| *b == 0)
            .nth(1)
            .map(|u| String::from_utf8_lossy(u).into_owned())
            .unwrap_or_default(),
        other => format!("({other})"),
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

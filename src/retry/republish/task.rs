//! The republisher task: one connection per vhost, one lane (channel) per
//! destination exchange, reconnecting with backoff. Reads, writes and
//! heartbeats run in one `select!`, so a connection that goes silent is
//! noticed even while a write is stuck.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{connection, AMQPClass};
use bytes::BytesMut;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncReadExt, AsyncWriteExt, WriteHalf};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::conn::{Conn, ConnError};
use super::lane::{Impersonation, Lane, Limits, State};
use super::login;
use super::{Publish, Report, SetAside, Settings};
use crate::metrics::{BlockReason, Login, Metrics, Open, VhostLabels};
use crate::net::{Connector, Io};
use crate::replica::fence::Fence;
use nackd_core::clock::Clock;
use nackd_core::protocol::frame::FrameType;
use nackd_core::protocol::method;

/// Bytes queued for the socket beyond which nothing new is added.
const OUT_HIGH: usize = 1024 * 1024;
/// First and longest wait between two connection attempts.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A connection that lasted this long resets the backoff.
const STABLE: Duration = Duration::from_secs(10);

pub(super) struct Task {
    vhost: Arc<str>,
    connector: Connector,
    settings: Settings,
    reports_tx: mpsc::UnboundedSender<Report>,
    rx: mpsc::UnboundedReceiver<Publish>,
    metrics: Arc<Metrics>,
    clock: Clock,
    connected: Gauge,
    blocked: Gauge,
    connects: Counter,
    channel_errors: Counter,
    lanes: HashMap<Arc<str>, Lane>,
    reports: Vec<Report>,
}

/// State of one connection's serve loop.
struct Wire {
    out: BytesMut,
    /// Channel number → exchange of its lane.
    channels: HashMap<u16, Arc<str>>,
    cursor: u16,
    blocked: bool,
    /// Learnt from the first publish with another user's `user_id`.
    impersonation: Impersonation,
}

impl Task {
    pub(super) fn new(
        vhost: Arc<str>,
        connector: Connector,
        settings: Settings,
        reports_tx: mpsc::UnboundedSender<Report>,
        rx: mpsc::UnboundedReceiver<Publish>,
        metrics: Arc<Metrics>,
        clock: Clock,
    ) -> Self {
        let labels = VhostLabels {
            vhost: vhost.to_string(),
        };
        Self {
            connected: metrics.republisher_connected.get_or_create_owned(&labels),
            blocked: metrics.republisher_blocked.get_or_create_owned(&labels),
            connects: metrics.republisher_connects.get_or_create_owned(&labels),
            channel_errors: metrics
                .republisher_channel_errors
                .get_or_create_owned(&labels),
            metrics,
            clock,
            vhost,
            connector,
            settings,
            reports_tx,
            rx,
            lanes: HashMap::new(),
            reports: Vec::new(),
        }
    }

    pub(super) async fn run(mut self) {
        let mut backoff = BACKOFF_MIN;
        loop {
            let opened = Conn::open(
                &self.connector,
                &self.settings.login,
                &self.vhost,
                self.settings.heartbeat,
            )
            .await;
            match opened {
                Ok(conn) => {
                    let since = self.clock.now();
                    info!(vhost = %self.vhost, heartbeat = ?conn.heartbeat, "republisher connected");
                    let user = &self.settings.login.username;
                    login::record(&self.metrics, &self.vhost, user, Login::Ok);
                    self.connects.inc();
                    let _up = Open::track(&self.metrics.republishers);
                    self.connected.set(1);
                    let served = self.serve(conn).await;
                    self.connected.set(0);
                    self.blocked.set(0);
                    self.disconnected();
                    match served {
                        Ok(()) => return,
                        Err(e) => {
                            warn!(vhost = %self.vhost, error = %e, "republisher connection lost; unconfirmed publishes go again after the reconnect")
                        }
                    }
                    if self.clock.now() - since >= STABLE {
                        backoff = BACKOFF_MIN;
                    }
                }
                Err(e) => {
                    let user = &self.settings.login.username;
                    warn!(vhost = %self.vhost, user, error = %e, retry_in = ?backoff, "republisher cannot connect");
                    // A refused login or vhost makes nackd not ready; a
                    // broker that cannot be reached is `/readyz`'s
                    // "upstream" already.
                    if e.refusal().is_some() {
                        let failed = Login::Failed(login::failure(&e, user));
                        login::record(&self.metrics, &self.vhost, user, failed);
                    }
                }
            }
            if !self.wait(backoff).await {
                return;
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// Sleeps `backoff` while taking in publishes; `false` if the engine is gone.
    async fn wait(&mut self, backoff: Duration) -> bool {
        let sleep = tokio::time::sleep(backoff);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => return true,
                p = self.rx.recv() => match p {
                    Some(p) => self.route(p),
                    None => return false,
                },
            }
        }
    }

    fn route(&mut self, p: Publish) {
        let exchange: Arc<str> = Arc::from(p.exchange());
        self.lanes
            .entry(exchange.clone())
            .or_insert_with(|| Lane::new(exchange))
            .push(p);
    }

    fn disconnected(&mut self) {
        for lane in self.lanes.values_mut() {
            lane.disconnected(&mut self.reports);
        }
        self.send_reports();
    }

    fn send_reports(&mut self) {
        for report in self.reports.drain(..) {
            let _ = self.reports_tx.send(report);
        }
    }

    /// Publishes until the connection fails (`Err`) or the engine is gone (`Ok`).
    async fn serve(&mut self, mut conn: Conn) -> Result<(), ConnError> {
        let mut wire = Wire {
            out: BytesMut::new(),
            channels: HashMap::new(),
            cursor: 0,
            blocked: false,
            impersonation: Impersonation::Unknown,
        };
        let heartbeat = conn.heartbeat;
        let (mut last_read, mut last_write) = (self.clock.now(), self.clock.now());
        let mut unflushed = false;
        let fence = self.settings.fence.clone();
        loop {
            // Nothing is written while the fence does not hold (the lease
            // is lost, or this process was stopped past it): a publish
            // already encoded waits in `wire.out`, new ones in their lanes.
            let extended = fence.extended();
            tokio::pin!(extended);
            let fenced = !fence.holds();
            if !fenced {
                self.drive(&mut wire, conn.frame_max, conn.channel_max);
            }
            self.send_reports();
            // Send a heartbeat after half an interval without writing (none
            // is needed while bytes wait to go); give up after two silent ones.
            let beat = heartbeat.map(|h| match wire.out.is_empty() {
                true => (last_write + h / 2).min(last_read + 2 * h),
                false => last_read + 2 * h,
            });
            tokio::select! {
                read = conn.reader.read_buf(&mut conn.buf) => {
                    if read? == 0 {
                        return Err(ConnError::Protocol("broker closed the socket".into()));
                    }
                    last_read = self.clock.now();
                    while let Some(frame) = conn.frame()? {
                        self.on_frame(frame, &mut wire, &mut conn).await?;
                    }
                }
                _ = &mut extended, if fenced => {}
                wrote = push_fenced(&fence, &mut conn.writer, &mut wire.out), if !fenced && (unflushed || !wire.out.is_empty()) => {
                    unflushed = wrote?;
                    last_write = self.clock.now();
                }
                p = self.rx.recv(), if wire.out.len() < OUT_HIGH => match p {
                    Some(p) => self.route(p),
                    None => return Ok(()),
                },
                _ = sleep_until(beat), if beat.is_some() => {
                    let h = heartbeat.expect("beat is set only with a heartbeat");
                    if self.clock.now() - last_read >= 2 * h {
                        return Err(ConnError::Silent(2 * h));
                    }
                    if self.clock.now() - last_write >= h / 2 && wire.out.is_empty() {
                        wire.out.extend_from_slice(&method::heartbeat());
                    }
                }
            }
        }
    }

    /// Opens channels for lanes that need one and writes what their windows allow.
    fn drive(&mut self, wire: &mut Wire, frame_max: u32, channel_max: u16) {
        if wire.blocked {
            return;
        }
        let limits = Limits {
            window: self.settings.confirm_window as usize,
            frame_max,
            username: &self.settings.login.username,
            impersonation: wire.impersonation,
        };
        // A lane with nothing to do and no channel is dropped: exchanges
        // used once do not pile up.
        self.lanes
            .retain(|_, lane| lane.state() != State::Closed || lane.len() != (0, 0));
        for (exchange, lane) in self.lanes.iter_mut() {
            if lane.wants_channel() {
                match free_channel(wire, channel_max) {
                    Some(ch) => {
                        wire.channels.insert(ch, exchange.clone());
                        lane.open(ch, &mut wire.out);
                    }
                    None => {
                        let aside = SetAside {
                            reason: BlockReason::ChannelError,
                            reply: format!(
                                "no free channel: more than {channel_max} exchanges in use on this connection"
                            ),
                            exchange_wide: false,
                        };
                        lane.set_aside_pending(&aside, &mut self.reports);
                        continue;
                    }
                }
            }
            while wire.out.len() < OUT_HIGH
                && lane.publish_next(limits, &mut wire.out, &mut self.reports)
            {}
        }
    }

    async fn on_frame(
        &mut self,
        frame: nackd_core::protocol::frame::Frame,
        wire: &mut Wire,
        conn: &mut Conn,
    ) -> Result<(), ConnError> {
        match (frame.channel, frame.kind) {
            (_, FrameType::Heartbeat) => Ok(()),
            (0, FrameType::Method) => {
                let class = decode(&frame)?;
                self.on_connection_method(class, wire, conn).await
            }
            (0, _) => Err(ConnError::Protocol("content frame on channel 0".into())),
            (ch, kind) => {
                let Some(exchange) = wire.channels.get(&ch).cloned() else {
                    return Ok(()); // a channel we closed: its last frames
                };
                let Some(lane) = self.lanes.get_mut(&exchange) else {
                    return Ok(());
                };
                if kind != FrameType::Method {
                    lane.on_content(&frame);
                    return Ok(());
                }
                let class = decode(&frame)?;
                let closed = lane.on_method(class, &mut wire.out, &mut self.reports);
                if let Some(learned) = lane.take_learned() {
                    info!(vhost = %self.vhost, user = %self.settings.login.username, ?learned, "learnt whether the broker takes another user's user_id from the republisher");
                    wire.impersonation = learned;
                }
                if let Some(closed) = closed {
                    wire.channels.remove(&closed.channel);
                    self.channel_errors.inc();
                    warn!(
                        vhost = %self.vhost,
                        exchange = %exchange,
                        reply = %closed.reply,
                        set_aside = closed.set_aside,
                        sent_again_one_by_one = closed.again,
                        "the broker closed a republisher channel; the connection and other exchanges carry on"
                    );
                }
                Ok(())
            }
        }
    }

    async fn on_connection_method(
        &mut self,
        class: AMQPClass,
        wire: &mut Wire,
        conn: &mut Conn,
    ) -> Result<(), ConnError> {
        match class {
            AMQPClass::Connection(connection::AMQPMethod::Blocked(b)) => {
                warn!(vhost = %self.vhost, reason = b.reason.as_str(), "broker blocked publishing");
                wire.blocked = true;
                self.blocked.set(1);
            }
            AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)) => {
                info!(vhost = %self.vhost, "broker unblocked publishing");
                wire.blocked = false;
                self.blocked.set(0);
            }
            AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
                let close_ok = method::connection_close_ok();
                let _ =
                    tokio::time::timeout(Duration::from_secs(1), conn.writer.write_all(&close_ok))
                        .await;
                return Err(ConnError::Closed(format!(
                    "{} {}",
                    c.reply_code, c.reply_text
                )));
            }
            other => debug!(?other, "ignored on the republisher's channel 0"),
        }
        Ok(())
    }
}

/// Writes some of `out`, or flushes once it is empty (TLS keeps bytes
/// until flushed). Cancel-safe: nothing is lost if another branch wins.
/// `true` while a flush is still owed.
/// [`push`], if the fence still holds when the write starts (the task may
/// have been stopped since the loop looked).
async fn push_fenced(
    fence: &Fence,
    writer: &mut WriteHalf<Io>,
    out: &mut BytesMut,
) -> std::io::Result<bool> {
    match fence.holds() {
        true => push(writer, out).await,
        false => Ok(true), // still to flush, once it holds again
    }
}

async fn push(writer: &mut WriteHalf<Io>, out: &mut BytesMut) -> std::io::Result<bool> {
    if out.is_empty() {
        writer.flush().await?;
        return Ok(false);
    }
    writer.write_buf(out).await?;
    Ok(true)
}

fn decode(frame: &nackd_core::protocol::frame::Frame) -> Result<AMQPClass, ConnError> {
    method::decode_any(&frame.payload()).map_err(|e| ConnError::Protocol(e.to_string()))
}

/// A channel number no lane uses, rotating so that a number closed a
/// moment ago is not reused at once.
fn free_channel(wire: &mut Wire, channel_max: u16) -> Option<u16> {
    let max = channel_max.max(1);
    for _ in 0..max {
        wire.cursor = wire.cursor % max + 1;
        if !wire.channels.contains_key(&wire.cursor) {
            return Some(wire.cursor);
        }
    }
    None
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

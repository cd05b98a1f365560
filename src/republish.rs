//! The republisher: nackd's own connection to one virtual host, publishing
//! due messages with publisher confirms and `mandatory=true`.
//!
//! nackd writes these frames itself (instead of using an AMQP client crate)
//! so that the content header goes out byte for byte as it was rewritten:
//! client crates re-encode field tables and change some type tags.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use amq_protocol::protocol::{basic, channel, confirm, connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::frame::{self, Frame, FrameDecoder, FrameType};
use crate::method;
use crate::metrics::{Metrics, Open, VhostLabels};
use crate::net::{Connector, Io};
use crate::store::Route;

/// Publishes in flight before waiting for confirms.
const WINDOW: usize = 1000;
/// Frame size nackd asks for on its own connections.
const FRAME_MAX: u32 = 128 * 1024;

/// One message to publish.
#[derive(Clone, Debug)]
pub struct Publish {
    /// Store id, reported back with the outcome.
    pub id: u64,
    /// Queue (for [`Route::Queue`]).
    pub queue: Arc<str>,
    /// Where to.
    pub route: Route,
    /// Content header payload.
    pub header: Bytes,
    /// Body.
    pub body: Bytes,
}

/// What became of a publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The broker confirmed it: it is in a queue.
    Confirmed,
    /// The broker nacked it (internal error): try again later.
    Nacked,
    /// The broker returned it: no queue bound for its routing key.
    Returned,
}

/// An outcome for a store id.
#[derive(Clone, Copy, Debug)]
pub struct Report {
    /// Store id.
    pub id: u64,
    /// What happened.
    pub outcome: Outcome,
}

/// Login of nackd's own connections.
#[derive(Clone, Debug)]
pub struct Credentials {
    /// User name.
    pub username: String,
    /// Password.
    pub password: String,
}

/// Handle to a running republisher.
#[derive(Clone)]
pub struct Republisher {
    tx: mpsc::UnboundedSender<Publish>,
}

impl Republisher {
    /// Starts the republisher task for `vhost`.
    pub fn spawn(
        vhost: Arc<str>,
        connector: Connector,
        login: Credentials,
        reports: mpsc::UnboundedSender<Report>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let labels = VhostLabels {
            vhost: vhost.to_string(),
        };
        let task = Task {
            connected: metrics.republisher_connected.get_or_create_owned(&labels),
            blocked: metrics.republisher_blocked.get_or_create_owned(&labels),
            metrics,
            vhost,
            connector,
            login,
            reports,
            rx,
            pending: VecDeque::new(),
        };
        tokio::spawn(task.run());
        Self { tx }
    }

    /// Queues a publish; `false` if the task is gone.
    pub fn publish(&self, publish: Publish) -> bool {
        self.tx.send(publish).is_ok()
    }
}

#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("broker closed the connection: {0}")]
    Closed(String),
}

struct Task {
    metrics: Arc<Metrics>,
    /// `nackd_republisher_connected{vhost}` and `nackd_republisher_blocked{vhost}`.
    connected: prometheus_client::metrics::gauge::Gauge,
    blocked: prometheus_client::metrics::gauge::Gauge,
    vhost: Arc<str>,
    connector: Connector,
    login: Credentials,
    reports: mpsc::UnboundedSender<Report>,
    rx: mpsc::UnboundedReceiver<Publish>,
    pending: VecDeque<Publish>,
}

impl Task {
    async fn run(mut self) {
        let mut backoff = Duration::from_millis(100);
        loop {
            match Conn::open(&self.connector, &self.login, &self.vhost).await {
                Ok(conn) => {
                    info!(vhost = %self.vhost, "republisher connected");
                    backoff = Duration::from_millis(100);
                    let _up = Open::track(&self.metrics.republishers);
                    self.connected.set(1);
                    let served = self.serve(conn).await;
                    self.connected.set(0);
                    self.blocked.set(0);
                    match served {
                        Ok(()) => return,
                        Err(e) => {
                            warn!(vhost = %self.vhost, error = %e, "republisher connection lost; reconnecting")
                        }
                    }
                }
                Err(e) => {
                    warn!(vhost = %self.vhost, error = %e, retry_in = ?backoff, "republisher cannot connect")
                }
            }
            // Take in what arrived meanwhile so the queue order holds.
            while let Ok(p) = self.rx.try_recv() {
                self.pending.push_back(p);
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// Publishes until the connection fails (`Err`) or the engine is gone (`Ok`).
    async fn serve(&mut self, mut conn: Conn) -> Result<(), ConnError> {
        let mut inflight: VecDeque<(u64, Publish, bool)> = VecDeque::new();
        let mut seq = 0u64;
        let mut blocked = false;
        let mut out = BytesMut::new();
        let result = loop {
            while !blocked && inflight.len() < WINDOW {
                let Some(p) = self.pending.pop_front() else {
                    break;
                };
                seq += 1;
                let (exchange, routing_key) = match &p.route {
                    Route::Queue => ("", &*p.queue),
                    Route::Exchange {
                        exchange,
                        routing_key,
                    } => (exchange.as_str(), routing_key.as_str()),
                };
                out.extend_from_slice(&method::publish(
                    1,
                    exchange,
                    routing_key,
                    true,
                    &p.header,
                    &p.body,
                    conn.frame_max,
                ));
                inflight.push_back((seq, p, false));
            }
            if !out.is_empty() {
                if let Err(e) = conn.io.write_all_buf(&mut out).await {
                    break Err(e.into());
                }
            }
            tokio::select! {
                p = self.rx.recv() => match p {
                    Some(p) => self.pending.push_back(p),
                    None => break Ok(()),
                },
                frame = conn.next_frame() => match frame {
                    Err(e) => break Err(e),
                    Ok(frame) => match self.on_frame(&mut conn, frame, &mut inflight, &mut blocked).await {
                        Ok(()) => {}
                        Err(e) => break Err(e),
                    },
                },
            }
        };
        // Unconfirmed publishes may or may not have arrived: publish them again
        // (at-least-once) after the reconnect.
        for (_, p, _) in inflight.into_iter().rev() {
            self.pending.push_front(p);
        }
        if !self.pending.is_empty() {
            debug!(count = self.pending.len(), "republishing after reconnect");
        }
        result
    }

    async fn on_frame(
        &mut self,
        conn: &mut Conn,
        frame: Frame,
        inflight: &mut VecDeque<(u64, Publish, bool)>,
        blocked: &mut bool,
    ) -> Result<(), ConnError> {
        if frame.kind != FrameType::Method {
            return Ok(()); // heartbeats; the content of a return
        }
        let class =
            method::decode_any(&frame.payload()).map_err(|e| ConnError::Protocol(e.to_string()))?;
        match class {
            AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => {
                self.settle(inflight, a.delivery_tag, a.multiple, true)
            }
            AMQPClass::Basic(basic::AMQPMethod::Nack(n)) => {
                self.settle(inflight, n.delivery_tag, n.multiple, false)
            }
            AMQPClass::Basic(basic::AMQPMethod::Return(r)) => {
                // Returns come before the confirm of the same publish, in
                // publish order: the first unreturned publish to that key.
                let key = r.routing_key.as_str();
                if let Some(entry) = inflight
                    .iter_mut()
                    .find(|(_, p, returned)| !*returned && routing_key(p) == key)
                {
                    entry.2 = true;
                }
                debug!(
                    code = r.reply_code,
                    text = r.reply_text.as_str(),
                    key,
                    "publish returned"
                );
            }
            AMQPClass::Connection(connection::AMQPMethod::Blocked(b)) => {
                warn!(vhost = %self.vhost, reason = b.reason.as_str(), "broker blocked publishing");
                *blocked = true;
                self.blocked.set(1);
            }
            AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)) => {
                info!(vhost = %self.vhost, "broker unblocked publishing");
                *blocked = false;
                self.blocked.set(0);
            }
            AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
                let _ = conn.io.write_all(&method::connection_close_ok()).await;
                return Err(ConnError::Closed(format!(
                    "{} {}",
                    c.reply_code, c.reply_text
                )));
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(c)) => {
                return Err(ConnError::Closed(format!(
                    "channel: {} {}",
                    c.reply_code, c.reply_text
                )));
            }
            _ => {}
        }
        Ok(())
    }

    fn settle(
        &mut self,
        inflight: &mut VecDeque<(u64, Publish, bool)>,
        tag: u64,
        multiple: bool,
        ack: bool,
    ) {
        if multiple {
            while inflight.front().is_some_and(|(seq, _, _)| *seq <= tag) {
                let (_, p, returned) = inflight.pop_front().expect("front exists");
                self.report(p.id, ack, returned);
            }
        } else if let Some(pos) = inflight.iter().position(|(seq, _, _)| *seq == tag) {
            let (_, p, returned) = inflight.remove(pos).expect("position is valid");
            self.report(p.id, ack, returned);
        }
    }

    fn report(&self, id: u64, ack: bool, returned: bool) {
        let outcome = match (ack, returned) {
            (true, false) => Outcome::Confirmed,
            (true, true) => Outcome::Returned,
            (false, _) => Outcome::Nacked,
        };
        let _ = self.reports.send(Report { id, outcome });
    }
}

fn routing_key(p: &Publish) -> &str {
    match &p.route {
        Route::Queue => &p.queue,
        Route::Exchange { routing_key, .. } => routing_key,
    }
}

/// A minimal AMQP client connection: handshake, one confirm channel.
struct Conn {
    io: Io,
    buf: BytesMut,
    decoder: FrameDecoder,
    frame_max: u32,
}

impl Conn {
    async fn open(
        connector: &Connector,
        login: &Credentials,
        vhost: &str,
    ) -> Result<Self, ConnError> {
        let (io, _) = connector.connect().await?;
        let mut conn = Self {
            io,
            buf: BytesMut::with_capacity(16 * 1024),
            decoder: FrameDecoder::default(),
            frame_max: FRAME_MAX,
        };
        conn.io.write_all(frame::PROTOCOL_HEADER).await?;
        conn.expect(|c| matches!(c, AMQPClass::Connection(connection::AMQPMethod::Start(_))))
            .await?;
        let mut props = FieldTable::default();
        props.insert("product".into(), AMQPValue::LongString("nackd".into()));
        props.insert(
            "connection_name".into(),
            AMQPValue::LongString(format!("nackd republisher {vhost}").into()),
        );
        let mut capabilities = FieldTable::default();
        capabilities.insert("publisher_confirms".into(), AMQPValue::Boolean(true));
        capabilities.insert("connection.blocked".into(), AMQPValue::Boolean(true));
        props.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
        let response = format!("\0{}\0{}", login.username, login.password);
        conn.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: props,
                mechanism: "PLAIN".into(),
                response: LongString::from(response.as_str()),
                locale: "en_US".into(),
            })),
        )
        .await?;
        let tune = match conn
            .expect(|c| matches!(c, AMQPClass::Connection(connection::AMQPMethod::Tune(_))))
            .await?
        {
            AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => t,
            _ => unreachable!("expect checked the method"),
        };
        conn.frame_max = match tune.frame_max {
            0 => FRAME_MAX,
            n => n.min(FRAME_MAX),
        };
        conn.decoder.set_frame_max(conn.frame_max);
        conn.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: 1,
                frame_max: conn.frame_max,
                heartbeat: 0,
            })),
        )
        .await?;
        conn.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: vhost.into(),
            })),
        )
        .await?;
        conn.expect(|c| matches!(c, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))))
            .await?;
        conn.send(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await?;
        conn.expect(|c| matches!(c, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))))
            .await?;
        conn.send(
            1,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
        )
        .await?;
        conn.expect(|c| matches!(c, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))))
            .await?;
        Ok(conn)
    }

    async fn send(&mut self, channel: u16, class: AMQPClass) -> Result<(), ConnError> {
        self.io.write_all(&method::encode(channel, &class)).await?;
        Ok(())
    }

    async fn next_frame(&mut self) -> Result<Frame, ConnError> {
        loop {
            match self.decoder.decode(&mut self.buf) {
                Ok(Some(frame)) => return Ok(frame),
                Ok(None) => {}
                Err(e) => return Err(ConnError::Protocol(e.to_string())),
            }
            if self.io.read_buf(&mut self.buf).await? == 0 {
                return Err(ConnError::Protocol("broker closed the socket".into()));
            }
        }
    }

    /// Waits for a method matching `want` during the handshake.
    async fn expect(&mut self, want: impl Fn(&AMQPClass) -> bool) -> Result<AMQPClass, ConnError> {
        let read = async {
            loop {
                let frame = self.next_frame().await?;
                if frame.kind != FrameType::Method {
                    continue;
                }
                let class = method::decode_any(&frame.payload())
                    .map_err(|e| ConnError::Protocol(e.to_string()))?;
                if let AMQPClass::Connection(connection::AMQPMethod::Close(c)) = &class {
                    return Err(ConnError::Closed(format!(
                        "{} {}",
                        c.reply_code, c.reply_text
                    )));
                }
                if want(&class) {
                    return Ok(class);
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .map_err(|_| ConnError::Protocol("handshake timed out".into()))?
    }
}

//! A minimal AMQP client connection: the handshake (with heartbeats), then
//! the socket split in halves so that the task reads, writes and keeps time
//! in one `select!` and never blocks reading behind a write or the reverse.

use std::time::Duration;

use amq_protocol::protocol::{connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};

use super::Credentials;
use crate::net::{Connector, Io};
use nackd_core::protocol::frame::{self, Frame, FrameDecoder, FrameType};
use nackd_core::protocol::method;

/// Frame size nackd asks for on its own connections.
const FRAME_MAX: u32 = 128 * 1024;
/// Most channels (lanes) a republisher opens.
const CHANNEL_MAX: u16 = 2047;
/// Time the broker has for each step of the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a republisher connection failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum ConnError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("broker closed the connection: {0}")]
    Closed(String),
    #[error(
        "no frame from the broker for {0:?} (two heartbeat intervals): connection presumed dead"
    )]
    Silent(Duration),
}

impl ConnError {
    /// The broker's reply when it closed the connection during the
    /// handshake: a refused login (`403 ACCESS_REFUSED - ...`), a vhost the
    /// user may not open (`530 NOT_ALLOWED - ...`).
    pub(super) fn refusal(&self) -> Option<&str> {
        match self {
            Self::Closed(reply) => Some(reply),
            _ => None,
        }
    }
}

/// An open connection.
pub(super) struct Conn {
    pub reader: ReadHalf<Io>,
    pub writer: WriteHalf<Io>,
    pub buf: BytesMut,
    pub decoder: FrameDecoder,
    pub frame_max: u32,
    pub channel_max: u16,
    /// Negotiated heartbeat interval (`None`: off).
    pub heartbeat: Option<Duration>,
}

/// What the handshake reads and writes before the socket is split.
struct Handshake {
    io: Io,
    buf: BytesMut,
    decoder: FrameDecoder,
}

impl Conn {
    /// Connects, logs in to `vhost` and negotiates `heartbeat`.
    pub(super) async fn open(
        connector: &Connector,
        login: &Credentials,
        vhost: &str,
        heartbeat: Option<Duration>,
    ) -> Result<Self, ConnError> {
        let (io, _) = connector.connect().await?;
        let mut hs = Handshake {
            io,
            buf: BytesMut::with_capacity(16 * 1024),
            decoder: FrameDecoder::default(),
        };
        hs.io.write_all(frame::PROTOCOL_HEADER).await?;
        hs.expect(|c| matches!(c, AMQPClass::Connection(connection::AMQPMethod::Start(_))))
            .await?;
        hs.send(start_ok(login, vhost)).await?;
        let tune = match hs
            .expect(|c| matches!(c, AMQPClass::Connection(connection::AMQPMethod::Tune(_))))
            .await?
        {
            AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => t,
            _ => unreachable!("expect checked the method"),
        };
        let frame_max = match tune.frame_max {
            0 => FRAME_MAX,
            n => n.min(FRAME_MAX),
        };
        let channel_max = match tune.channel_max {
            0 => CHANNEL_MAX,
            n => n.min(CHANNEL_MAX),
        };
        let heartbeat = negotiate_heartbeat(heartbeat, tune.heartbeat);
        hs.decoder.set_frame_max(frame_max);
        hs.send(AMQPClass::Connection(connection::AMQPMethod::TuneOk(
            connection::TuneOk {
                channel_max,
                frame_max,
                heartbeat,
            },
        )))
        .await?;
        hs.send(AMQPClass::Connection(connection::AMQPMethod::Open(
            connection::Open {
                virtual_host: vhost.into(),
            },
        )))
        .await?;
        hs.expect(|c| matches!(c, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))))
            .await?;
        let (reader, writer) = tokio::io::split(hs.io);
        Ok(Self {
            reader,
            writer,
            buf: hs.buf,
            decoder: hs.decoder,
            frame_max,
            channel_max,
            heartbeat: (heartbeat > 0).then(|| Duration::from_secs(heartbeat.into())),
        })
    }

    /// Takes the next complete frame out of the read buffer, if any.
    pub(super) fn frame(&mut self) -> Result<Option<Frame>, ConnError> {
        self.decoder
            .decode(&mut self.buf)
            .map_err(|e| ConnError::Protocol(e.to_string()))
    }
}

/// Our heartbeat (`None`: off) against the broker's proposal, in seconds:
/// the smaller of the two, or ours when the broker proposes none.
pub(super) fn negotiate_heartbeat(ours: Option<Duration>, broker: u16) -> u16 {
    let Some(ours) = ours else { return 0 };
    let ours = ours.as_secs().clamp(1, u16::MAX.into()) as u16;
    match broker {
        0 => ours,
        b => ours.min(b),
    }
}

fn start_ok(login: &Credentials, vhost: &str) -> AMQPClass {
    let mut props = FieldTable::default();
    props.insert("product".into(), AMQPValue::LongString("nackd".into()));
    props.insert(
        "connection_name".into(),
        AMQPValue::LongString(format!("nackd republisher {vhost}").into()),
    );
    let mut capabilities = FieldTable::default();
    capabilities.insert("publisher_confirms".into(), AMQPValue::Boolean(true));
    capabilities.insert("connection.blocked".into(), AMQPValue::Boolean(true));
    // Without it, RabbitMQ answers a refused login by dropping the socket
    // ("connection reset"); with it, by `connection.close 403
    // ACCESS_REFUSED`, which nackd can log and report in `/readyz`.
    capabilities.insert(
        "authentication_failure_close".into(),
        AMQPValue::Boolean(true),
    );
    props.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
    let response = format!("\0{}\0{}", login.username, login.password);
    AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
        client_properties: props,
        mechanism: "PLAIN".into(),
        response: LongString::from(response.as_str()),
        locale: "en_US".into(),
    }))
}

impl Handshake {
    async fn send(&mut self, class: AMQPClass) -> Result<(), ConnError> {
        self.io.write_all(&method::encode(0, &class)).await?;
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

    /// Waits for a method matching `want`.
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
        tokio::time::timeout(HANDSHAKE_TIMEOUT, read)
            .await
            .map_err(|_| ConnError::Protocol("handshake timed out".into()))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RabbitMQ answers a refused login with `connection.close 403` only to
    /// a client that announces this capability; else it drops the socket.
    #[test]
    fn start_ok_asks_for_a_close_on_a_refused_login() {
        let login = Credentials {
            username: "nackd".into(),
            password: "x".into(),
        };
        let AMQPClass::Connection(connection::AMQPMethod::StartOk(ok)) = start_ok(&login, "/")
        else {
            panic!("not a start-ok");
        };
        let Some(AMQPValue::FieldTable(caps)) = ok.client_properties.inner().get("capabilities")
        else {
            panic!("no capabilities");
        };
        assert_eq!(
            caps.inner().get("authentication_failure_close"),
            Some(&AMQPValue::Boolean(true))
        );
    }
}

//! How far nackd's clock is from the broker's, measured without plugins:
//! a message is published into a queue of its own whose messages expire at
//! once (`x-message-ttl` 0) and are dead-lettered to a second queue; the
//! broker stamps the dead-lettering time in `x-death` (whole seconds, on
//! its clock). Both queues are exclusive: they go with the connection.
//! Works alike on RabbitMQ 3.x and 4.x. What it gives is good to about a
//! second: enough to tell a host whose clock is off by more.

use std::sync::Arc;
use std::time::Duration;

use amq_protocol::protocol::{basic, channel, queue, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::check::close_connection;
use super::conn::{Conn, ConnError};
use super::Credentials;
use crate::metrics::Metrics;
use crate::net::Connector;
use nackd_core::clock::Clock;
use nackd_core::protocol::content::encode_header;
use nackd_core::protocol::frame::FrameType;
use nackd_core::protocol::headers::death_time;
use nackd_core::protocol::method;

/// Time one measurement may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the offset is measured.
const EVERY: Duration = Duration::from_secs(60);
/// Pause between `basic.get`s while the dead-lettered copy is on its way.
const GET_PAUSE: Duration = Duration::from_millis(20);

/// Measures the offset every minute on `vhost` as the republish user
/// until `stop`; sets `nackd_clock_offset_seconds` and warns above `max`.
pub fn spawn(
    connector: Connector,
    login: Credentials,
    vhost: String,
    clock: Clock,
    metrics: Arc<Metrics>,
    max: Duration,
    stop: CancellationToken,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        loop {
            let measured = tokio::select! {
                _ = stop.cancelled() => return,
                m = tokio::time::timeout(PROBE_TIMEOUT, measure(&connector, &login, &vhost, &clock)) => m,
            };
            match measured {
                Ok(Ok(offset)) => {
                    metrics.clock_offset.set(offset);
                    if offset.abs() > max.as_secs_f64() {
                        tracing::warn!(offset_seconds = offset, max = ?max, "nackd's clock is {:.1} s {} the broker's: due times can be off by that much after a restart or an adoption on another host", offset.abs(), if offset > 0.0 { "ahead of" } else { "behind" });
                    }
                }
                // Unmeasured is unknown, not the last value: NaN again.
                Ok(Err(e)) => {
                    metrics.clock_offset.set(f64::NAN);
                    tracing::debug!(error = %e, "cannot measure the clock's offset from the broker's");
                }
                Err(_) => {
                    metrics.clock_offset.set(f64::NAN);
                    tracing::debug!("measuring the clock's offset from the broker's timed out");
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(EVERY) => {}
            }
        }
    });
}

/// nackd's clock minus the broker's, in seconds (positive: nackd is ahead).
async fn measure(
    connector: &Connector,
    login: &Credentials,
    vhost: &str,
    clock: &Clock,
) -> Result<f64, ConnError> {
    let mut conn = Conn::open(connector, login, vhost, None).await?;
    let ch = 1;
    send(
        &mut conn,
        ch,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
    .await?;
    let reply_to = declare(&mut conn, ch, FieldTable::default()).await?;
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongInt(0));
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(reply_to.as_str().into()),
    );
    let expiring = declare(&mut conn, ch, args).await?;
    let header = encode_header(60, 0, &Default::default());
    let sent = clock.now_ms();
    let publish = method::publish(ch, "", &expiring, false, &header, &[], conn.frame_max);
    conn.writer.write_all(&publish).await?;
    let get = AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
        queue: reply_to.as_str().into(),
        no_ack: true,
    }));
    let broker_secs = loop {
        send(&mut conn, ch, get.clone()).await?;
        match next(&mut conn, ch).await? {
            Next::Method(AMQPClass::Basic(basic::AMQPMethod::GetOk(_))) => {
                let Next::Header(payload) = next(&mut conn, ch).await? else {
                    return Err(ConnError::Protocol(
                        "get-ok without a content header".into(),
                    ));
                };
                break death_time(&payload)
                    .ok_or_else(|| ConnError::Protocol("no x-death time".into()))?;
            }
            Next::Method(AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_))) => {
                tokio::time::sleep(GET_PAUSE).await;
            }
            Next::Method(AMQPClass::Channel(channel::AMQPMethod::Close(c))) => {
                return Err(ConnError::Closed(format!(
                    "{} {}",
                    c.reply_code, c.reply_text
                )));
            }
            _ => {}
        }
    };
    let got = clock.now_ms();
    let _ = close_connection(&mut conn).await;
    // The broker stamped a time between `sent` and `got`; its whole
    // second is on average half a second behind it.
    let ours = (sent + got) as f64 / 2000.0;
    Ok(ours - (broker_secs as f64 + 0.5))
}

async fn send(conn: &mut Conn, ch: u16, class: AMQPClass) -> Result<(), ConnError> {
    conn.writer.write_all(&method::encode(ch, &class)).await?;
    Ok(())
}

/// Declares a server-named exclusive queue with `arguments`; its name.
async fn declare(conn: &mut Conn, ch: u16, arguments: FieldTable) -> Result<String, ConnError> {
    let declare = AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
        queue: "".into(),
        exclusive: true,
        auto_delete: true,
        arguments,
        ..Default::default()
    }));
    send(conn, ch, declare).await?;
    loop {
        match next(conn, ch).await? {
            Next::Method(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok))) => {
                return Ok(ok.queue.as_str().to_owned())
            }
            Next::Method(AMQPClass::Channel(channel::AMQPMethod::Close(c))) => {
                return Err(ConnError::Closed(format!(
                    "{} {}",
                    c.reply_code, c.reply_text
                )));
            }
            _ => {}
        }
    }
}

enum Next {
    Method(AMQPClass),
    Header(bytes::Bytes),
}

/// The next method or content header on channel `ch` (a connection.close
/// is an error; bodies and heartbeats are skipped).
async fn next(conn: &mut Conn, ch: u16) -> Result<Next, ConnError> {
    loop {
        while let Some(frame) = conn.frame()? {
            if frame.channel != ch && frame.channel != 0 {
                continue;
            }
            match frame.kind {
                FrameType::Header if frame.channel == ch => {
                    return Ok(Next::Header(frame.payload()))
                }
                FrameType::Method => {
                    let class = method::decode_any(&frame.payload())
                        .map_err(|e| ConnError::Protocol(e.to_string()))?;
                    if let AMQPClass::Connection(
                        amq_protocol::protocol::connection::AMQPMethod::Close(c),
                    ) = &class
                    {
                        return Err(ConnError::Closed(format!(
                            "{} {}",
                            c.reply_code, c.reply_text
                        )));
                    }
                    if frame.channel == ch {
                        return Ok(Next::Method(class));
                    }
                }
                _ => {}
            }
        }
        if conn.reader.read_buf(&mut conn.buf).await? == 0 {
            return Err(ConnError::Protocol("broker closed the socket".into()));
        }
    }
}

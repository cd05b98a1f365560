//! Checks, with a passive `exchange.declare`, that the exchanges policies
//! send exhausted messages to exist: run at startup and on reload, so that
//! a typo is a warning naming the policy, not a surprise at the first
//! exhausted message.

use std::collections::BTreeMap;
use std::time::Duration;

use amq_protocol::protocol::{channel, connection, exchange, AMQPClass};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::conn::{Conn, ConnError};
use super::Credentials;
use crate::net::Connector;
use nackd_core::protocol::frame::FrameType;
use nackd_core::protocol::method;

/// Time one vhost's checks may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// An exchange a setting names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExchangeToCheck {
    /// The setting, as an operator finds it in the file (`policy[0].on_exhausted`).
    pub key: String,
    /// Virtual host.
    pub vhost: String,
    /// Exchange.
    pub exchange: String,
}

/// An exchange the broker does not have (or refuses to show).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Missing {
    /// What was checked.
    pub checked: ExchangeToCheck,
    /// The broker's reply (`404 NOT_FOUND - no exchange 'x' in vhost '/'`)
    /// or why the check could not run.
    pub reply: String,
}

/// Declares every exchange of `targets` passively; returns those that
/// failed. Exchange `""` always exists and is skipped.
pub async fn check_exchanges(
    connector: &Connector,
    login: &Credentials,
    targets: &[ExchangeToCheck],
) -> Vec<Missing> {
    let mut by_vhost: BTreeMap<&str, Vec<&ExchangeToCheck>> = BTreeMap::new();
    for t in targets.iter().filter(|t| !t.exchange.is_empty()) {
        by_vhost.entry(&t.vhost).or_default().push(t);
    }
    let mut missing = Vec::new();
    for (vhost, targets) in by_vhost {
        let checked = tokio::time::timeout(
            CHECK_TIMEOUT,
            check_vhost(connector, login, vhost, &targets),
        )
        .await;
        match checked {
            Ok(Ok(found)) => missing.extend(found),
            Ok(Err(e)) => missing.extend(targets.iter().map(|t| Missing {
                checked: (*t).clone(),
                reply: format!("cannot check: {e}"),
            })),
            Err(_) => missing.extend(targets.iter().map(|t| Missing {
                checked: (*t).clone(),
                reply: "cannot check: timed out".into(),
            })),
        }
    }
    missing
}

async fn check_vhost(
    connector: &Connector,
    login: &Credentials,
    vhost: &str,
    targets: &[&ExchangeToCheck],
) -> Result<Vec<Missing>, ConnError> {
    let mut conn = Conn::open(connector, login, vhost, None).await?;
    let mut missing = Vec::new();
    // One channel per exchange: a 404 closes the channel it happens on.
    for (i, target) in targets.iter().enumerate() {
        let ch = (i % usize::from(conn.channel_max.max(1)) + 1) as u16;
        if let Some(reply) = declare_passive(&mut conn, ch, &target.exchange).await? {
            missing.push(Missing {
                checked: (*target).clone(),
                reply,
            });
        }
    }
    close_connection(&mut conn).await?;
    Ok(missing)
}

/// Opens channel `ch` and declares exchange `name` passively on it; the
/// broker's reply if it refused (its channel close answered), else `None`
/// once the channel is closed again.
async fn declare_passive(
    conn: &mut Conn,
    ch: u16,
    name: &str,
) -> Result<Option<String>, ConnError> {
    let open = AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}));
    let declare = AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
        exchange: name.into(),
        passive: true,
        ..Default::default()
    }));
    conn.writer.write_all(&method::encode(ch, &open)).await?;
    conn.writer.write_all(&method::encode(ch, &declare)).await?;
    loop {
        match next_method(conn, ch).await? {
            AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_)) => {
                close_channel(conn, ch).await?;
                return Ok(None);
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(c)) => {
                let close_ok =
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}));
                conn.writer
                    .write_all(&method::encode(ch, &close_ok))
                    .await?;
                return Ok(Some(format!("{} {}", c.reply_code, c.reply_text)));
            }
            _ => {}
        }
    }
}

/// Closes channel `ch` and waits for its `close-ok`.
async fn close_channel(conn: &mut Conn, ch: u16) -> Result<(), ConnError> {
    let close = AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
        reply_code: 200,
        reply_text: "checked".into(),
        class_id: 0,
        method_id: 0,
    }));
    conn.writer.write_all(&method::encode(ch, &close)).await?;
    wait_for(conn, ch, |c| {
        matches!(c, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))
    })
    .await
}

/// Closes the connection; its `close-ok` is waited for but not required.
pub(super) async fn close_connection(conn: &mut Conn) -> Result<(), ConnError> {
    let close = AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
        reply_code: 200,
        reply_text: "checked".into(),
        class_id: 0,
        method_id: 0,
    }));
    conn.writer.write_all(&method::encode(0, &close)).await?;
    let _ = wait_for(conn, 0, |c| {
        matches!(c, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)))
    })
    .await;
    Ok(())
}

async fn wait_for(
    conn: &mut Conn,
    ch: u16,
    want: impl Fn(&AMQPClass) -> bool,
) -> Result<(), ConnError> {
    while !want(&next_method(conn, ch).await?) {}
    Ok(())
}

/// The next method frame on channel `ch` (a connection.close is an error).
async fn next_method(conn: &mut Conn, ch: u16) -> Result<AMQPClass, ConnError> {
    loop {
        while let Some(frame) = conn.frame()? {
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
            if frame.channel == ch {
                return Ok(class);
            }
        }
        if conn.reader.read_buf(&mut conn.buf).await? == 0 {
            return Err(ConnError::Protocol("broker closed the socket".into()));
        }
    }
}

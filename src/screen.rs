//! The screen in front of lapin: nackd's lapin connections (dead-letter
//! replay, the replica's streams and lease) reach the broker through a
//! relay of their own, so that lapin's parser sees only what nackd's
//! limits passed ([`nackd_core::protocol::screen`]).
//!
//! [`open`] connects to the broker (TLS included) and listens on a
//! loopback port for exactly one connection: lapin's, speaking plain AMQP.
//! The relay passes lapin's bytes to the broker (restoring what it folded)
//! and the broker's bytes to lapin frame by frame, folding a content header
//! that fails nackd's limits (logged, counted in
//! `nackd_screen_folded_total`). A frame that cannot be folded ends that one
//! connection with a `connection.close` naming the reason (counted in
//! `nackd_screen_refused_total`); lapin reports it as the broker's close.

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use nackd_core::protocol::frame::FrameError;
use nackd_core::protocol::method;
use nackd_core::protocol::reply::ReplyCode;
use nackd_core::protocol::screen::{Screen, ScreenError};
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

use crate::net::Io;

/// Content headers folded because they fail nackd's limits (all screens).
pub static FOLDED: LazyLock<Counter> = LazyLock::new(Counter::default);
/// Screened connections ended because the broker sent a frame nackd refuses.
pub static REFUSED: LazyLock<Counter> = LazyLock::new(Counter::default);

/// Octets of folded properties one connection may hold before it ends
/// (each is kept until lapin publishes the message again or the
/// connection closes).
pub const FOLD_BUDGET: usize = 64 << 20;

/// How long lapin may take to connect to the screen's port.
const ACCEPT_WITHIN: Duration = Duration::from_secs(30);

/// Connects to `node` (`host:port`; TLS with the settings `tls`,
/// checked against the host, when given) within `within`, and returns
/// the loopback address lapin connects to instead, plain AMQP.
pub async fn open(
    node: &str,
    tls: Option<&Arc<rustls::ClientConfig>>,
    within: Duration,
    what: &'static str,
) -> io::Result<SocketAddr> {
    let broker = tokio::time::timeout(within, connect(node, tls))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
    let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
    let local = listener.local_addr()?;
    let node = node.to_string();
    tokio::spawn(async move {
        match tokio::time::timeout(ACCEPT_WITHIN, listener.accept()).await {
            Ok(Ok((lapin, _))) => {
                drop(listener);
                let _ = lapin.set_nodelay(true);
                relay(lapin, broker, &node, what).await;
            }
            Ok(Err(e)) => warn!(node, what, error = %e, "screen: accept failed"),
            Err(_) => debug!(node, what, "screen: nobody connected"),
        }
    });
    Ok(local)
}

async fn connect(node: &str, tls: Option<&Arc<rustls::ClientConfig>>) -> io::Result<Io> {
    let tcp = TcpStream::connect(node).await?;
    tcp.set_nodelay(true)?;
    match tls {
        None => Ok(Box::new(tcp)),
        Some(config) => {
            let (connector, name) = crate::net::tls_for(node, config).map_err(io::Error::other)?;
            Ok(Box::new(connector.connect(name, tcp).await?))
        }
    }
}

/// A random key per screen: fold names cannot be guessed.
fn key() -> [u8; 8] {
    let mut key = [0; 8];
    if rustls::crypto::ring::default_provider()
        .secure_random
        .fill(&mut key)
        .is_err()
    {
        key = fastrand::u64(..).to_ne_bytes();
    }
    key
}

/// Moves bytes both ways until either side ends.
async fn relay(lapin: TcpStream, broker: Io, node: &str, what: &'static str) {
    let screen = Mutex::new(Screen::new(key(), FOLD_BUDGET));
    let (lapin_rx, lapin_tx) = lapin.into_split();
    let (broker_rx, broker_tx) = tokio::io::split(broker);
    let up = upward(&screen, lapin_rx, broker_tx, node, what);
    let down = downward(&screen, broker_rx, lapin_tx, node, what);
    let ended = tokio::select! {
        r = up => r,
        r = down => r,
    };
    if let Err(e) = ended {
        debug!(node, what, error = %e, "screen: connection ended");
    }
}

/// lapin's bytes to the broker, what the screen folded restored.
async fn upward(
    screen: &Mutex<Screen>,
    mut lapin_rx: OwnedReadHalf,
    mut broker_tx: WriteHalf<Io>,
    node: &str,
    what: &'static str,
) -> io::Result<()> {
    let (mut buf, mut out) = (BytesMut::with_capacity(8192), BytesMut::new());
    loop {
        if lapin_rx.read_buf(&mut buf).await? == 0 {
            return Ok(());
        }
        let restored = screen
            .lock()
            .expect("screen lock")
            .from_client(&mut buf, &mut out);
        match restored {
            Ok(0) => {}
            Ok(n) => debug!(node, what, restored = n, "screen: folded headers restored"),
            Err(e) => return Err(io::Error::other(e.to_string())),
        }
        broker_tx.write_all(&out).await?;
        out.clear();
    }
}

/// The broker's bytes to lapin, frame by frame, through the screen; a
/// frame it refuses ends lapin's connection with a `connection.close`.
async fn downward(
    screen: &Mutex<Screen>,
    mut broker_rx: ReadHalf<Io>,
    mut lapin_tx: OwnedWriteHalf,
    node: &str,
    what: &'static str,
) -> io::Result<()> {
    let (mut buf, mut out) = (BytesMut::with_capacity(8192), BytesMut::new());
    let mut folds = Vec::new();
    loop {
        if broker_rx.read_buf(&mut buf).await? == 0 {
            return Ok(());
        }
        let refused = screen
            .lock()
            .expect("screen lock")
            .from_broker(&mut buf, &mut out, &mut folds)
            .err();
        for fold in folds.drain(..) {
            FOLDED.inc();
            warn!(
                node, what, channel = fold.channel, reason = %fold.reason,
                "screen: a message's properties fail nackd's limits; folded into {}",
                nackd_core::protocol::screen::FOLDED
            );
        }
        lapin_tx.write_all(&out).await?;
        out.clear();
        if let Some(e) = refused {
            REFUSED.inc();
            warn!(node, what, error = %e, "screen: connection ended");
            let code = match &e {
                ScreenError::Frame(f) | ScreenError::Method(f) | ScreenError::Client(f) => reply(f),
                ScreenError::Budget(_) => ReplyCode::ResourceError,
            };
            let text = format!("nackd screen: {e}");
            lapin_tx
                .write_all(&method::connection_close(code, &text, None))
                .await?;
            lapin_tx.shutdown().await?;
            return Ok(());
        }
    }
}

fn reply(e: &FrameError) -> ReplyCode {
    e.reply_code()
}

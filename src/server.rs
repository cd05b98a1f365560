//! The listener: accepts clients, applies the connection limit, terminates
//! TLS, spawns one session per client, and shuts down gracefully.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn, Instrument};

use crate::config::Config;
use crate::net::{self, Connector, Io, TlsError};
use crate::intercept::Budget;
use crate::policy::Policies;
use crate::republish::Credentials;
use crate::retry;
use crate::session::{self, Interception};
use crate::store::Log;

/// Starts the retry engine for the configured policies.
fn interception(config: &Config, connector: &Connector) -> Result<Interception, StartError> {
    let login = Credentials {
        username: config.republish.username.clone(),
        password: config.republish.password().map_err(StartError::Credentials)?,
    };
    let (log, recovered) = Log::open(&config.store.path, config.store.max_bytes.map(|b| b as u64))
        .map_err(|e| StartError::Store(format!("store.path {}: {e}", config.store.path.display())))?;
    Ok(Interception {
        policies: Arc::new(Policies::new(&config.policies)),
        budget: Budget::new(config.limits.capture_budget),
        retry: retry::spawn(log, recovered, connector.clone(), login),
    })
}

/// Why nackd cannot start serving.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The listen address cannot be bound.
    #[error("listen.address {address}: {source}")]
    Bind {
        /// Address asked for.
        address: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// TLS material of `listen.tls` or `upstream.tls` is unusable.
    #[error("{0}")]
    Tls(#[from] TlsError),
    /// The republisher has no password.
    #[error("{0}")]
    Credentials(String),
    /// The store cannot be opened.
    #[error("{0}")]
    Store(String),
}

/// A bound proxy, ready to [`run`](Proxy::run).
pub struct Proxy {
    listener: TcpListener,
    acceptor: Option<TlsAcceptor>,
    connector: Connector,
    limits: session::Limits,
    max_connections: usize,
    grace: Duration,
    interception: Option<Arc<Interception>>,
}

impl Proxy {
    /// Binds the listener and loads TLS material; nothing is accepted yet.
    pub async fn bind(config: &Config) -> Result<Self, StartError> {
        let address = config.listen.address;
        let listener = TcpListener::bind(address)
            .await
            .map_err(|source| StartError::Bind { address, source })?;
        let acceptor = config.listen.tls.as_ref().map(net::acceptor).transpose()?;
        let connector = Connector::new(&config.upstream)?;
        let interception = match config.policies.is_empty() {
            true => None,
            false => Some(Arc::new(interception(config, &connector)?)),
        };
        Ok(Self {
            listener,
            acceptor,
            interception,
            connector,
            limits: session::Limits {
                max_frame: config.limits.max_frame,
                handshake_timeout: config.limits.handshake_timeout,
            },
            max_connections: config.limits.max_connections,
            grace: config.limits.shutdown_grace,
        })
    }

    /// The address clients connect to (useful when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    /// Accepts clients until `shutdown`, then gives sessions the grace period
    /// and closes those still open.
    pub async fn run(self, shutdown: CancellationToken) {
        let force = CancellationToken::new();
        let sessions = TaskTracker::new();
        let permits = Arc::new(Semaphore::new(self.max_connections));
        info!(
            address = %self.local_addr(),
            tls = self.acceptor.is_some(),
            upstream = self.connector.address(),
            "listening"
        );
        loop {
            let (tcp, client) = tokio::select! {
                _ = shutdown.cancelled() => break,
                accepted = self.listener.accept() => match accepted {
                    Ok(pair) => pair,
                    Err(e) => {
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Ok(permit) = permits.clone().try_acquire_owned() else {
                warn!(client.addr = %client, max_connections = self.max_connections, "refusing connection: max_connections reached");
                continue;
            };
            let task = accept(
                tcp,
                self.acceptor.clone(),
                self.connector.clone(),
                self.limits,
                self.interception.clone(),
                force.clone(),
            );
            sessions.spawn(
                async move {
                    task.await;
                    drop(permit);
                }
                .instrument(session::span(client)),
            );
        }
        drop(self.listener);
        sessions.close();
        info!(open = sessions.len(), grace = ?self.grace, "stopped accepting; waiting for sessions");
        if tokio::time::timeout(self.grace, sessions.wait()).await.is_err() {
            info!(open = sessions.len(), "grace period over; closing the remaining sessions");
            force.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(5), sessions.wait()).await;
        }
        info!("stopped");
    }
}

async fn accept(
    tcp: TcpStream,
    acceptor: Option<TlsAcceptor>,
    connector: Connector,
    limits: session::Limits,
    interception: Option<Arc<Interception>>,
    force: CancellationToken,
) {
    let _ = tcp.set_nodelay(true);
    let io: Io = match acceptor {
        None => Box::new(tcp),
        Some(acceptor) => match tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp)).await {
            Ok(Ok(tls)) => Box::new(tls),
            Ok(Err(e)) => return warn!(error = %e, "TLS handshake failed"),
            Err(_) => return warn!("TLS handshake timed out"),
        },
    };
    session::serve(io, connector, limits, interception, force).await;
}

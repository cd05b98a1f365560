//! Sockets: the stream type sessions use, TLS on both sides (rustls), and
//! the connector to the broker.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use tracing::debug;

use crate::config;

/// A byte stream of either side, plain TCP or TLS.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// A boxed [`Stream`].
pub(crate) type Io = Box<dyn Stream>;

/// Why TLS material cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file is missing or unreadable.
    #[error("{path}: {reason}")]
    Pem {
        /// File path.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// rustls refused the material.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// The name to verify the broker against is not a valid DNS name or IP.
    #[error("invalid server name {0:?}")]
    ServerName(String),
}

fn pem_err(path: &Path, e: impl std::fmt::Display) -> TlsError {
    TlsError::Pem {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem_err(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(path, e))?;
    if certs.is_empty() {
        return Err(pem_err(path, "no certificate in file"));
    }
    Ok(certs)
}

/// The amqps acceptor for `listen.tls`.
pub(crate) fn acceptor(tls: &config::ServerTls) -> Result<TlsAcceptor, TlsError> {
    let chain = certs(&tls.cert)?;
    let key = PrivateKeyDer::from_pem_file(&tls.key).map_err(|e| pem_err(&tls.key, e))?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// How nackd reaches the broker: one node, or the nodes of a cluster.
///
/// Each connection starts at the next node in turn (round-robin, shared by
/// every clone) and tries the others when one refuses or times out, so
/// sessions spread over the cluster and a node that is down costs one
/// failed connect, not a failed session.
#[derive(Clone)]
pub struct Connector {
    nodes: Arc<[Node]>,
    next: Arc<AtomicUsize>,
    timeout: Duration,
    tls: Option<TlsConnector>,
}

/// One broker node.
struct Node {
    address: String,
    server_name: Option<ServerName<'static>>,
}

impl Connector {
    /// Builds the connector for `[upstream]`.
    pub fn new(upstream: &config::Upstream) -> Result<Self, TlsError> {
        let tls = upstream.tls.as_ref().map(client_config).transpose()?;
        let tls = tls.map(TlsConnector::from);
        let nodes = upstream
            .nodes()
            .into_iter()
            .map(|address| {
                let server_name = match &upstream.tls {
                    None => None,
                    Some(tls) => Some(server_name(&address, tls)?),
                };
                Ok(Node {
                    address,
                    server_name,
                })
            })
            .collect::<Result<Vec<_>, TlsError>>()?;
        Ok(Self {
            nodes: nodes.into(),
            next: Arc::default(),
            timeout: upstream.connect_timeout,
            tls,
        })
    }

    /// The configured nodes, comma-separated (for logs).
    pub fn address(&self) -> String {
        self.addresses().collect::<Vec<_>>().join(",")
    }

    /// The configured `host:port` of every node.
    pub fn addresses(&self) -> impl Iterator<Item = &str> {
        self.nodes.iter().map(|n| n.address.as_str())
    }

    /// Opens one connection to the broker: the next node in turn, else the
    /// others; the error of the last node tried if none answers.
    pub async fn connect(&self) -> io::Result<(Io, SocketAddr)> {
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        let mut last = None;
        for i in 0..self.nodes.len() {
            let node = &self.nodes[(first + i) % self.nodes.len()];
            match self.connect_node(node).await {
                Ok(pair) => return Ok(pair),
                Err(e) => {
                    if self.nodes.len() > 1 {
                        debug!(node = node.address, error = %e, "broker node does not answer; trying the next");
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no upstream node configured")))
    }

    /// Connects to each node in turn: whether it answers (TCP and TLS).
    pub async fn probe(&self) -> Vec<(String, io::Result<()>)> {
        let mut out = Vec::new();
        for node in self.nodes.iter() {
            let answer = self.connect_node(node).await.map(|_| ());
            out.push((node.address.clone(), answer));
        }
        out
    }

    async fn connect_node(&self, node: &Node) -> io::Result<(Io, SocketAddr)> {
        let connect = async {
            let tcp = TcpStream::connect(&node.address).await?;
            tcp.set_nodelay(true)?;
            let peer = tcp.peer_addr()?;
            let io: Io = match (&self.tls, &node.server_name) {
                (Some(connector), Some(name)) => {
                    Box::new(connector.connect(name.clone(), tcp).await?)
                }
                _ => Box::new(tcp),
            };
            Ok((io, peer))
        };
        tokio::time::timeout(self.timeout, connect)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))?
    }
}

/// The TLS client settings of `upstream.tls`, if set (see
/// [`client_config`]).
pub(crate) fn upstream_tls(
    upstream: &config::Upstream,
) -> Result<Option<Arc<rustls::ClientConfig>>, TlsError> {
    upstream.tls.as_ref().map(client_config).transpose()
}

/// The TLS client settings of `upstream.tls`, loaded once: trusting the
/// CA certificates of `ca`, else the system's store.
pub(crate) fn client_config(
    tls: &config::ClientTls,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let roots = match &tls.ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in certs(ca)? {
                roots.add(cert)?;
            }
            roots
        }
        None => system_roots()?,
    };
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// The CA certificates of the OS store (Debian's ca-certificates, a
/// container's included), or of `SSL_CERT_FILE` / `SSL_CERT_DIR` when set:
/// what `curl` and `openssl` on the same host trust.
fn system_roots() -> Result<rustls::RootCertStore, TlsError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = rustls::RootCertStore::empty();
    let (added, _unparsable) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let errors: Vec<String> = found.errors.iter().map(|e| e.to_string()).collect();
        return Err(TlsError::Pem {
            path: "the system CA store".into(),
            reason: format!(
                "no CA certificate found (install ca-certificates, set SSL_CERT_FILE, or set upstream.tls.ca){}",
                match errors.is_empty() {
                    true => String::new(),
                    false => format!(": {}", errors.join("; ")),
                }
            ),
        });
    }
    Ok(roots)
}

/// The TLS connector and server name for `node` (`host:port`) with the
/// settings of [`client_config`] (as [`crate::replica::Target::tls`]).
pub(crate) fn tls_for(
    node: &str,
    config: &Arc<rustls::ClientConfig>,
) -> Result<(TlsConnector, ServerName<'static>), TlsError> {
    let host = node.rsplit_once(':').map_or(node, |(h, _)| h);
    let host = host.trim_matches(['[', ']']).to_string();
    let name = ServerName::try_from(host.clone()).map_err(|_| TlsError::ServerName(host))?;
    Ok((TlsConnector::from(config.clone()), name))
}

/// `upstream.tls.server_name`, or the host of `address`.
fn server_name(address: &str, tls: &config::ClientTls) -> Result<ServerName<'static>, TlsError> {
    let host = address.rsplit_once(':').map_or("", |(h, _)| h);
    let name = tls
        .server_name
        .clone()
        .unwrap_or_else(|| host.trim_matches(['[', ']']).to_string());
    ServerName::try_from(name.clone()).map_err(|_| TlsError::ServerName(name))
}

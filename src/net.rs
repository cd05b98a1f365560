//! Sockets: the stream type sessions use, TLS on both sides (rustls), and
//! the connector to the broker.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::config;

/// A byte stream of either side, plain TCP or TLS.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// A boxed [`Stream`].
pub type Io = Box<dyn Stream>;

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
pub fn acceptor(tls: &config::ServerTls) -> Result<TlsAcceptor, TlsError> {
    let chain = certs(&tls.cert)?;
    let key = PrivateKeyDer::from_pem_file(&tls.key).map_err(|e| pem_err(&tls.key, e))?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// How nackd reaches the broker.
#[derive(Clone)]
pub struct Connector {
    address: String,
    timeout: Duration,
    tls: Option<(TlsConnector, ServerName<'static>)>,
}

impl Connector {
    /// Builds the connector for `[upstream]`.
    pub fn new(upstream: &config::Upstream) -> Result<Self, TlsError> {
        let tls = match &upstream.tls {
            None => None,
            Some(tls) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in certs(&tls.ca)? {
                    roots.add(cert)?;
                }
                let config = rustls::ClientConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()?
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                let host = upstream.address.rsplit_once(':').map_or("", |(h, _)| h);
                let name = tls
                    .server_name
                    .clone()
                    .unwrap_or_else(|| host.trim_matches(['[', ']']).to_string());
                let server_name =
                    ServerName::try_from(name.clone()).map_err(|_| TlsError::ServerName(name))?;
                Some((TlsConnector::from(Arc::new(config)), server_name))
            }
        };
        Ok(Self {
            address: upstream.address.clone(),
            timeout: upstream.connect_timeout,
            tls,
        })
    }

    /// The configured `host:port`.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Opens one connection to the broker (TCP, then TLS when configured).
    pub async fn connect(&self) -> io::Result<(Io, SocketAddr)> {
        let connect = async {
            let tcp = TcpStream::connect(&self.address).await?;
            tcp.set_nodelay(true)?;
            let peer = tcp.peer_addr()?;
            let io: Io = match &self.tls {
                None => Box::new(tcp),
                Some((connector, name)) => Box::new(connector.connect(name.clone(), tcp).await?),
            };
            Ok((io, peer))
        };
        tokio::time::timeout(self.timeout, connect)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))?
    }
}

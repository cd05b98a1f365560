//! `upstream.uri`: the broker as an AMQP URI
//! (`amqps://user:pass@host:5671`), the form brokers-as-a-service and
//! Kubernetes operators hand out, instead of `upstream.address` (+ `tls`).
//!
//! What it means to a proxy:
//! - host and port: the one broker node (a cluster's nodes stay in
//!   `upstream.addresses`: an AMQP URI names one host);
//! - `amqps`: TLS to the broker, trusting `upstream.tls.ca` if set, else
//!   the system's CA store;
//! - user and password, percent-decoded: the login of nackd's own
//!   connections (`[republish]`), so not also set there. Clients keep
//!   logging in as themselves;
//! - no vhost: each client opens the vhost it asks for, and nackd's own
//!   connections the vhost of each policy. `/` and `/%2f` are accepted
//!   (they name the default vhost), any other is refused, as are query
//!   parameters (their settings have keys of their own).

use amq_protocol::uri::{AMQPScheme, AMQPUri};

/// A parsed `upstream.uri`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BrokerUri {
    /// `host:port` of the node.
    pub node: String,
    /// `amqps`.
    pub tls: bool,
    /// The login, when the URI has one.
    pub username: Option<String>,
    /// Its password, when the URI has one.
    pub password: Option<String>,
}

impl std::str::FromStr for BrokerUri {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        // amq-protocol-uri decodes the parts, but takes an IP address for
        // "localhost" (it reads domain names only): the host comes from url.
        // No error repeats the text: it may hold a password.
        let url = url::Url::parse(text).map_err(|e| format!("not a URI: {e}"))?;
        if url.cannot_be_a_base() || !matches!(url.scheme(), "amqp" | "amqps") {
            return Err("expected amqp://host[:port] or amqps://... (scheme)".into());
        }
        let host = match url.host() {
            Some(url::Host::Domain(name)) if !name.is_empty() => name.to_string(),
            Some(url::Host::Ipv4(ip)) => ip.to_string(),
            Some(url::Host::Ipv6(ip)) => format!("[{ip}]"),
            _ => return Err("no host".into()),
        };
        let uri: AMQPUri = text.parse()?;
        if !matches!(url.path(), "" | "/" | "/%2f" | "/%2F") {
            return Err(format!(
                "vhost {:?}: nackd connects each client to the vhost it opens, and its own connections to each policy's vhost; leave the URI's path empty",
                uri.vhost
            ));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(
                "query parameters are not read: use upstream.connect_timeout and republish.heartbeat"
                    .into(),
            );
        }
        let username = (!url.username().is_empty()).then_some(uri.authority.userinfo.username);
        let password = url.password().map(|_| uri.authority.userinfo.password);
        if password.is_some() && username.is_none() {
            return Err("a password without a user".into());
        }
        if uri.authority.port == 0 {
            return Err("port 0".into());
        }
        Ok(Self {
            node: format!("{host}:{}", uri.authority.port),
            tls: uri.scheme == AMQPScheme::AMQPS,
            username,
            password,
        })
    }
}

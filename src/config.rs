//! The TOML configuration (`config/nackd.toml`), read once at startup.
//!
//! Every error names the key it is about (`listen.address: ...`), so a bad
//! file stops startup with something an operator can act on.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nackd_core::schema::Duration as DurationText;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

mod delayed;
mod replica;
mod schema;
mod secret;
mod uri;
pub use delayed::{Delayed, DelayedExchange, Unroutable};
pub use nackd_core::policy::{BackoffConfig, Jitter, OnExhausted, PolicyConfig, RequeueMode};
pub use replica::Replica;
pub use schema::json_schema;
pub use secret::Secret;
pub use uri::BrokerUri;

use nackd_core::policy::{Policy, MAX_DELAY};

/// Why the configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// File path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A key has a wrong type, an unknown name or a bad value.
    #[error("{path}: {key}: {reason}")]
    Invalid {
        /// File path.
        path: PathBuf,
        /// Dotted key (`listen.address`, `policy[0].delays`).
        key: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// The whole configuration file.
#[derive(Clone, Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(
    title = "nackd configuration",
    description = "The TOML file `nackd --config` reads (`nackd --check-config FILE` checks one)."
)]
#[schemars(extend("allOf" = [{
    "if": { "required": ["replica"] },
    "then": { "properties": { "upstream": { "properties": { "tls": { "not": { "required": ["server_name"] } } } } } }
}]))]
pub struct Config {
    /// Where clients connect.
    #[serde(default)]
    pub listen: Listen,
    /// The broker nackd forwards to.
    #[serde(default)]
    pub upstream: Upstream,
    /// Credentials of nackd's own connections (republishing).
    #[serde(default)]
    pub republish: Republish,
    /// The durable store of held messages.
    #[serde(default)]
    pub store: Store,
    /// The metrics and health listener.
    #[serde(default)]
    pub metrics: Metrics,
    /// Resource limits.
    #[serde(default)]
    pub limits: Limits,
    /// Threads.
    #[serde(default)]
    pub runtime: Runtime,
    /// Held messages mirrored in the broker cluster (off when absent).
    pub replica: Option<Replica>,
    /// The `x-delayed-message` emulation (`[delayed]`; its defaults when
    /// absent).
    pub delayed: Option<Delayed>,
    /// Exchanges known to be delayed without a declare through this nackd.
    #[serde(default, rename = "delayed_exchange")]
    pub delayed_exchanges: Vec<DelayedExchange>,
    /// Retry policies, first match wins: the `[[policy]]` tables, checked
    /// and compiled once, by [`Config::parse`].
    #[serde(skip)]
    #[schemars(skip)]
    pub policies: Vec<Policy>,
    /// The `[[policy]]` tables as written, until [`Config::parse`] compiles
    /// them into `policies`.
    #[serde(default, rename = "policy")]
    #[schemars(description = "Retry policies, one `[[policy]]` table each; \
        the first that matches a queue applies. Without any (and without \
        delayed exchanges) nackd intercepts nothing.")]
    policy_tables: Vec<PolicyConfig>,
}

/// `[listen]`
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Listen {
    /// Address to accept AMQP clients on (`ip:port`).
    #[serde(default = "default_listen")]
    pub address: SocketAddr,
    /// Serve amqps with this certificate and key (plain AMQP when absent).
    pub tls: Option<ServerTls>,
}

fn default_listen() -> SocketAddr {
    "127.0.0.1:5673".parse().expect("valid literal")
}

impl Default for Listen {
    fn default() -> Self {
        Self {
            address: default_listen(),
            tls: None,
        }
    }
}

/// `listen.tls`
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServerTls {
    /// PEM certificate chain.
    #[schemars(example = "certs/server.pem")]
    pub cert: PathBuf,
    /// PEM private key.
    #[schemars(example = "certs/server.key")]
    pub key: PathBuf,
}

/// `[upstream]`
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(extend("allOf" = [
    { "not": { "required": ["address", "addresses"] } },
    { "not": { "required": ["uri", "address"] } },
    { "not": { "required": ["uri", "addresses"] } },
    { "not": { "required": ["uri_env", "address"] } },
    { "not": { "required": ["uri_env", "addresses"] } },
    { "not": { "required": ["uri_file", "address"] } },
    { "not": { "required": ["uri_file", "addresses"] } },
    { "not": { "required": ["uri", "uri_env"] } },
    { "not": { "required": ["uri", "uri_file"] } },
    { "not": { "required": ["uri_env", "uri_file"] } }
]))]
pub struct Upstream {
    /// The broker as an AMQP URI (`amqps://user:pass@host:5671`), instead
    /// of `address` (+ `tls`) and `[republish]`'s login (see [`BrokerUri`]).
    #[schemars(example = &"amqps://rabbit.internal")]
    pub uri: Option<String>,
    /// Or the name of an environment variable holding it.
    #[schemars(example = &"NACKD_UPSTREAM_URI")]
    pub uri_env: Option<String>,
    /// Or a file holding it (a URI may carry a password).
    #[schemars(example = &"/run/secrets/nackd-upstream-uri")]
    pub uri_file: Option<PathBuf>,
    /// `host:port` of the broker (a name is resolved at each connect);
    /// `127.0.0.1:5672` when neither `address`, `addresses` nor `uri` is
    /// set. Set one of them only.
    #[schemars(pattern("^.+:[0-9]+$"), example = "127.0.0.1:5672")]
    pub address: Option<String>,
    /// Or the `host:port` of each node of a cluster: connections go to the
    /// next one in turn and fail over to the others.
    #[serde(default)]
    #[schemars(example = ["10.0.0.1:5672", "10.0.0.2:5672", "10.0.0.3:5672"])]
    pub addresses: Vec<String>,
    /// Connect to the broker over TLS (plain AMQP when absent).
    pub tls: Option<ClientTls>,
    /// Give up connecting to the broker after this long.
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    #[schemars(with = "DurationText")]
    pub connect_timeout: Duration,
}

fn default_upstream() -> String {
    "127.0.0.1:5672".into()
}

fn default_connect_timeout() -> Duration {
    Duration::from_secs(5)
}

impl Default for Upstream {
    fn default() -> Self {
        Self {
            uri: None,
            uri_env: None,
            uri_file: None,
            address: None,
            addresses: Vec::new(),
            tls: None,
            connect_timeout: default_connect_timeout(),
        }
    }
}

impl Upstream {
    /// The broker nodes, in the order connections try them.
    pub fn nodes(&self) -> Vec<String> {
        match (&self.address, self.addresses.is_empty()) {
            (_, false) => self.addresses.clone(),
            (Some(one), true) => vec![one.clone()],
            (None, true) => vec![default_upstream()],
        }
    }

    /// The URI's settings.
    pub fn uri_secret(&self) -> Secret<'_> {
        Secret {
            key: "upstream.uri",
            inline: &self.uri,
            env: &self.uri_env,
            file: &self.uri_file,
        }
    }

    /// One node only (the `--upstream` override).
    pub fn set_single(&mut self, address: String) {
        self.address = Some(address);
        self.addresses.clear();
    }

    fn check(&self) -> Result<(), (String, String)> {
        if self.address.is_some() && !self.addresses.is_empty() {
            return Err((
                "upstream.addresses".into(),
                "set address or addresses, not both".into(),
            ));
        }
        let key = |i| match self.addresses.is_empty() {
            true => "upstream.address".to_string(),
            false => format!("upstream.addresses[{i}]"),
        };
        host_ports(&self.nodes(), key)
    }
}

/// Each of `nodes` is a `host:port`, or the key (`key(i)`) of the first
/// that is not.
fn host_ports(nodes: &[String], key: impl Fn(usize) -> String) -> Result<(), (String, String)> {
    match nodes.iter().position(|node| !node.contains(':')) {
        Some(i) => Err((key(i), "expected host:port".into())),
        None => Ok(()),
    }
}

/// `upstream.tls`
#[derive(Clone, Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClientTls {
    /// PEM CA certificates to trust; without it, the system's CA store
    /// (`SSL_CERT_FILE` / `SSL_CERT_DIR` when set, else the OS's).
    #[schemars(example = "certs/ca.pem")]
    pub ca: Option<PathBuf>,
    /// Name to verify the broker's certificate against (default: the host
    /// of `address`). Refused with `[replica]`, whose connection verifies
    /// each node's host name.
    #[schemars(example = "rabbit.internal")]
    pub server_name: Option<String>,
}

/// `[republish]`: nackd's own connections, one per vhost, that republish
/// due messages.
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(extend("allOf" = [
    { "not": { "required": ["password", "password_env"] } },
    { "not": { "required": ["password", "password_file"] } },
    { "not": { "required": ["password_env", "password_file"] } }
]))]
pub struct Republish {
    /// User of nackd's own connections ("guest" when unset).
    #[schemars(example = &"nackd")]
    pub username: Option<String>,
    /// Its password, inline (`guest` when no `password*` key is set). Set
    /// one of `password`, `password_env` and `password_file` only.
    #[schemars(example = &"guest")]
    pub password: Option<String>,
    /// Or the name of an environment variable holding it (checked at
    /// startup and by `--check-config`: it must be set).
    #[schemars(example = &"NACKD_PASSWORD")]
    pub password_env: Option<String>,
    /// Or a file holding it (a trailing newline is not part of it).
    #[schemars(example = &"/etc/nackd/password")]
    pub password_file: Option<PathBuf>,
    /// Heartbeat interval asked for on nackd's own connections: whole
    /// seconds, at most 65535s (`0s`: none).
    #[serde(default = "default_heartbeat", with = "humantime_serde")]
    #[schemars(with = "DurationText")]
    pub heartbeat: Duration,
    /// Publishes awaiting the broker's confirm, per destination exchange.
    #[serde(default = "default_confirm_window")]
    #[schemars(range(min = 1, max = 65535))]
    pub confirm_window: u32,
    /// Bytes of due messages read from the store and not yet confirmed, per
    /// vhost: what a due backlog of any size costs in RAM.
    #[serde(default = "default_max_pending_bytes")]
    #[schemars(range(min = MIN_PENDING_BYTES))]
    pub max_pending_bytes: u64,
    /// What becomes of held messages whose queue is gone.
    #[serde(default)]
    pub queue_gone: QueueGone,
    /// Above this offset of nackd's clock from the broker's, `/readyz`
    /// warns (nackd stays ready) and a warning is logged.
    #[serde(default = "default_max_clock_offset", with = "humantime_serde")]
    #[schemars(with = "DurationText")]
    pub max_clock_offset: Duration,
}

fn default_max_clock_offset() -> Duration {
    Duration::from_secs(2)
}

fn default_heartbeat() -> Duration {
    Duration::from_secs(10)
}

fn default_confirm_window() -> u32 {
    1000
}

fn default_max_pending_bytes() -> u64 {
    16 * 1024 * 1024
}

/// Longest `republish.heartbeat` (the protocol carries whole seconds in 16 bits).
pub const MAX_HEARTBEAT: Duration = Duration::from_secs(u16::MAX as u64);
/// Smallest `republish.max_pending_bytes`.
pub const MIN_PENDING_BYTES: u64 = 64 * 1024;

impl Default for Republish {
    fn default() -> Self {
        Self {
            username: None,
            password: None,
            password_env: None,
            password_file: None,
            heartbeat: default_heartbeat(),
            confirm_window: default_confirm_window(),
            max_pending_bytes: default_max_pending_bytes(),
            queue_gone: QueueGone::default(),
            max_clock_offset: default_max_clock_offset(),
        }
    }
}

/// `[republish.queue_gone]`: held messages of a queue that no longer exists
/// (deleted, auto-deleted, exclusive to a connection that closed) whose
/// policy has no `on_exhausted` exchange to send them to.
#[derive(Clone, Debug, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
#[schemars(extend(
    "if" = { "properties": { "action": { "const": "dead-letter" } }, "required": ["action"] },
    "then" = { "required": ["exchange"] },
    "else" = { "not": { "required": ["exchange"] } }
))]
pub struct QueueGone {
    /// What to do once the queue has been gone for `after`; `exchange` is
    /// required with `"dead-letter"` and refused otherwise.
    #[serde(default)]
    pub action: GoneAction,
    /// How long a queue must have been gone before `action` applies (1s ..
    /// 365 days).
    #[serde(default = "default_gone_after", with = "humantime_serde")]
    #[schemars(with = "DurationText")]
    pub after: Duration,
    /// One held message of a gone queue is tried this often, to notice it
    /// is back (1s .. 1h).
    #[serde(default = "default_probe_interval", with = "humantime_serde")]
    #[schemars(with = "DurationText")]
    pub probe_interval: Duration,
    /// Exchange of `action = "dead-letter"`.
    #[schemars(example = "lost-and-found")]
    pub exchange: Option<String>,
    /// Its routing key (default: the queue's name).
    #[schemars(example = &"orders")]
    pub routing_key: Option<String>,
}

fn default_gone_after() -> Duration {
    Duration::from_secs(3600)
}

fn default_probe_interval() -> Duration {
    Duration::from_secs(30)
}

impl Default for QueueGone {
    fn default() -> Self {
        Self {
            action: GoneAction::default(),
            after: default_gone_after(),
            probe_interval: default_probe_interval(),
            exchange: None,
            routing_key: None,
        }
    }
}

/// `republish.queue_gone.action`
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum GoneAction {
    /// Keep the messages (held, listed as blocked) until the queue is back.
    #[default]
    Keep,
    /// Forget them (a delete record in the store): they are lost on purpose.
    Drop,
    /// Send them to `exchange` (with `routing_key`).
    DeadLetter,
}

impl Republish {
    fn check(&self) -> Result<(), (String, String)> {
        let err = |key: &str, reason: &str| Err((format!("republish.{key}"), reason.to_string()));
        self.password_secret().check()?;
        if self.heartbeat > MAX_HEARTBEAT || self.heartbeat.subsec_nanos() != 0 {
            return err(
                "heartbeat",
                "must be whole seconds, at most 65535s (\"0s\" turns heartbeats off)",
            );
        }
        if !(1..=65535).contains(&self.confirm_window) {
            return err("confirm_window", "must be between 1 and 65535");
        }
        if self.max_pending_bytes < MIN_PENDING_BYTES {
            return err("max_pending_bytes", "must be at least 65536");
        }
        let gone = &self.queue_gone;
        if gone.after < Duration::from_secs(1) || gone.after > MAX_DELAY {
            return err("queue_gone.after", "must be between 1s and 365 days");
        }
        if gone.probe_interval < Duration::from_secs(1)
            || gone.probe_interval > Duration::from_secs(3600)
        {
            return err("queue_gone.probe_interval", "must be between 1s and 1h");
        }
        match (gone.action, &gone.exchange) {
            (GoneAction::DeadLetter, None) => err(
                "queue_gone.exchange",
                "required with action = \"dead-letter\"",
            ),
            (GoneAction::Keep | GoneAction::Drop, Some(_)) => err(
                "queue_gone.exchange",
                "only used with action = \"dead-letter\"",
            ),
            _ => Ok(()),
        }
    }
}

/// `[store]`
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Store {
    /// Directory of the embedded store (created if missing; relative to
    /// nackd's working directory).
    #[serde(default = "default_store")]
    pub path: PathBuf,
    /// Bytes of held messages beyond which nackd stops intercepting: nacks
    /// are deferred (requeued later). No limit when absent.
    #[schemars(example = 1073741824)]
    pub max_bytes: Option<usize>,
    /// Size in bytes at which a segment file is closed and the next one
    /// started (64 KiB .. 1 GiB).
    #[serde(default = "default_segment_bytes")]
    #[schemars(range(min = *SEGMENT_BYTES_RANGE.start(), max = *SEGMENT_BYTES_RANGE.end()))]
    pub segment_bytes: u64,
}

fn default_segment_bytes() -> u64 {
    crate::store::SEGMENT_BYTES
}

/// Smallest and largest `store.segment_bytes` (locations are 32-bit offsets).
pub const SEGMENT_BYTES_RANGE: std::ops::RangeInclusive<u64> = 64 * 1024..=1024 * 1024 * 1024;

fn default_store() -> PathBuf {
    "data".into()
}

impl Default for Store {
    fn default() -> Self {
        Self {
            path: default_store(),
            max_bytes: None,
            segment_bytes: default_segment_bytes(),
        }
    }
}

/// `[metrics]`: the operations listener (metrics, health, status page, admin API).
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(extend("allOf" = [
    { "not": { "required": ["admin_token", "admin_token_env"] } },
    { "not": { "required": ["admin_token", "admin_token_file"] } },
    { "not": { "required": ["admin_token_env", "admin_token_file"] } },
    { "not": { "required": ["read_token", "read_token_env"] } },
    { "not": { "required": ["read_token", "read_token_file"] } },
    { "not": { "required": ["read_token_env", "read_token_file"] } }
]))]
pub struct Metrics {
    /// Address of `/metrics`, `/healthz`, `/readyz`, `/` and `/api/`.
    #[serde(default = "default_metrics")]
    pub address: SocketAddr,
    /// Bearer token of the admin API, inline (the API is off without
    /// either token): at least 16 printable ASCII characters, no spaces. Set
    /// one of `admin_token`, `admin_token_env` and `admin_token_file`.
    #[schemars(length(min = ADMIN_TOKEN_MIN), pattern(TOKEN_PATTERN))]
    #[schemars(example = "change-me-admin-0123456789")]
    pub admin_token: Option<String>,
    /// Or the name of an environment variable holding it (checked at
    /// startup and by `--check-config`: it must be set).
    #[schemars(example = &"NACKD_ADMIN_TOKEN")]
    pub admin_token_env: Option<String>,
    /// Or a file holding it (a trailing newline is not part of it).
    #[schemars(example = &"/etc/nackd/admin-token")]
    pub admin_token_file: Option<PathBuf>,
    /// Bearer token of the admin API's calls that change nothing (list
    /// held messages, the policies in force), inline; fire, purge, replay
    /// and reseed answer 403 to it. Must differ from the admin token. Set
    /// one of `read_token`, `read_token_env` and `read_token_file`.
    #[schemars(length(min = ADMIN_TOKEN_MIN), pattern(TOKEN_PATTERN))]
    #[schemars(example = "change-me-reader-0123456789")]
    pub read_token: Option<String>,
    /// Or the name of an environment variable holding it.
    #[schemars(example = &"NACKD_READ_TOKEN")]
    pub read_token_env: Option<String>,
    /// Or a file holding it.
    #[schemars(example = &"/etc/nackd/read-token")]
    pub read_token_file: Option<PathBuf>,
}

/// Shortest admin token accepted.
pub const ADMIN_TOKEN_MIN: usize = 16;

/// What a token may hold ([`check_token`]), for the JSON Schema.
const TOKEN_PATTERN: &str = "^[!-~]+$";

fn default_metrics() -> SocketAddr {
    "127.0.0.1:9645".parse().expect("valid literal")
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            address: default_metrics(),
            admin_token: None,
            admin_token_env: None,
            admin_token_file: None,
            read_token: None,
            read_token_env: None,
            read_token_file: None,
        }
    }
}

impl Metrics {
    /// The admin token's settings.
    pub fn admin_secret(&self) -> Secret<'_> {
        Secret {
            key: "metrics.admin_token",
            inline: &self.admin_token,
            env: &self.admin_token_env,
            file: &self.admin_token_file,
        }
    }

    /// The read token's settings.
    pub fn read_secret(&self) -> Secret<'_> {
        Secret {
            key: "metrics.read_token",
            inline: &self.read_token,
            env: &self.read_token_env,
            file: &self.read_token_file,
        }
    }

    /// What needs no environment: each token set one way at most; inline
    /// ones valid, and not the same twice.
    fn check(&self) -> Result<(), (String, String)> {
        for secret in [self.admin_secret(), self.read_secret()] {
            secret.check()?;
            if let Some(token) = secret.inline {
                check_token(token).map_err(|reason| (secret.key.to_string(), reason))?;
            }
        }
        if self.read_token.is_some() && self.read_token == self.admin_token {
            return Err((
                "metrics.read_token".into(),
                "must differ from the admin token".into(),
            ));
        }
        Ok(())
    }

    /// The admin token: inline, from `admin_token_env` or
    /// `admin_token_file`, or `None`. Errors name the key.
    pub fn admin_token(&self) -> Result<Option<String>, String> {
        token(self.admin_secret())
    }

    /// The read token: inline, from `read_token_env` or `read_token_file`,
    /// or `None`. Errors name the key.
    pub fn read_token(&self) -> Result<Option<String>, String> {
        token(self.read_secret())
    }

    /// Both tokens (the admin API is off without either). Errors name the
    /// key: a token unset or invalid, or the read token equal to the admin
    /// token (it would change state).
    pub fn tokens(&self) -> Result<(Option<String>, Option<String>), String> {
        let (admin, read) = (self.admin_token()?, self.read_token()?);
        if admin.is_some() && admin == read {
            let key = match (&self.read_token, &self.read_token_env) {
                (Some(_), _) => "metrics.read_token",
                (None, Some(_)) => "metrics.read_token_env",
                (None, None) => "metrics.read_token_file",
            };
            return Err(format!("{key}: must differ from the admin token"));
        }
        Ok((admin, read))
    }
}

/// A token read from where `secret` says, checked; `None` when unset.
fn token(secret: Secret<'_>) -> Result<Option<String>, String> {
    let Some((token, key)) = secret.read()? else {
        return Ok(None);
    };
    check_token(&token).map_err(|reason| format!("{key}: {reason}"))?;
    Ok(Some(token))
}

fn check_token(token: &str) -> Result<(), String> {
    if token.chars().count() < ADMIN_TOKEN_MIN {
        return Err(format!(
            "a token must be at least {ADMIN_TOKEN_MIN} characters"
        ));
    }
    if !token.chars().all(|c| c.is_ascii_graphic()) {
        return Err("a token must be printable ASCII without spaces".into());
    }
    Ok(())
}

/// `[runtime]`
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Runtime {
    /// Threads that run client sessions (the frame pump). The retry engine
    /// and the store writer have a thread each besides these.
    #[serde(default = "default_worker_threads")]
    #[schemars(range(min = 1, max = MAX_WORKER_THREADS))]
    pub worker_threads: usize,
    /// How Linux schedules the session threads.
    #[serde(default)]
    pub scheduling: Scheduling,
    /// How long an idle session thread waits, while a peer streams, before
    /// it reads again, so that one read and one
    /// write carry several messages; at most 1ms, `0s` turns it off.
    #[serde(default = "default_coalesce", with = "humantime_serde")]
    #[schemars(with = "DurationText")]
    pub coalesce: Duration,
}

/// `runtime.scheduling`
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Scheduling {
    /// The kernel's default: a frame's arrival wakes nackd at once.
    #[default]
    Normal,
    /// `SCHED_BATCH` (Linux): on a busy CPU nackd waits its turn instead of
    /// preempting, and handles more frames per wakeup.
    Batch,
}

/// One session thread: on a host shared with the broker, one thread finds
/// more frames per wakeup than two (see bench/RESULTS.md).
fn default_worker_threads() -> usize {
    1
}

/// 100 µs: on this project's bench it halves nackd's CPU per message of
/// a streaming pair (see the README's benchmark results).
fn default_coalesce() -> Duration {
    Duration::from_micros(100)
}

impl Default for Runtime {
    fn default() -> Self {
        Self {
            worker_threads: default_worker_threads(),
            scheduling: Scheduling::default(),
            coalesce: default_coalesce(),
        }
    }
}

/// Most session threads `runtime.worker_threads` accepts.
pub const MAX_WORKER_THREADS: usize = 1024;

/// `[limits]`
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Client connections served at once; more are refused with a log line.
    #[serde(default = "default_max_connections")]
    #[schemars(range(min = 1))]
    pub max_connections: usize,
    /// Time a client has from TCP accept to `connection.open-ok`.
    #[serde(default = "default_handshake_timeout", with = "humantime_serde")]
    #[schemars(with = "DurationText")]
    pub handshake_timeout: Duration,
    /// Largest frame in bytes nackd accepts from either side, whatever is
    /// negotiated (at least 8192: RabbitMQ 4.1+ refuses a smaller
    /// `frame_max`).
    #[serde(default = "default_max_frame")]
    #[schemars(range(min = MIN_MAX_FRAME))]
    pub max_frame: u32,
    /// Time sessions get to finish after SIGINT/SIGTERM.
    #[serde(default = "default_grace", with = "humantime_serde")]
    #[schemars(with = "DurationText")]
    pub shutdown_grace: Duration,
    /// Bytes of deliveries kept in memory in case they are nacked, and of
    /// delayed publishes being read (one that does not fit: its nack passes
    /// to the broker, or it is routed at once without confirms).
    #[serde(default = "default_capture_budget")]
    pub capture_budget: usize,
}

fn default_capture_budget() -> usize {
    256 * 1024 * 1024
}

fn default_max_connections() -> usize {
    10_000
}
fn default_handshake_timeout() -> Duration {
    Duration::from_secs(10)
}
/// The smallest `limits.max_frame`: nackd offers it to clients as the
/// negotiated `frame_max` when the broker proposes more, and RabbitMQ 4.1+
/// resets a connection whose `tune-ok` asks for less than this.
const MIN_MAX_FRAME: u32 = 8192;

fn default_max_frame() -> u32 {
    16 * 1024 * 1024
}
fn default_grace() -> Duration {
    Duration::from_secs(10)
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: default_max_connections(),
            handshake_timeout: default_handshake_timeout(),
            max_frame: default_max_frame(),
            shutdown_grace: default_grace(),
            capture_budget: default_capture_budget(),
        }
    }
}

impl Republish {
    /// The password's settings.
    pub fn password_secret(&self) -> Secret<'_> {
        Secret {
            key: "republish.password",
            inline: &self.password,
            env: &self.password_env,
            file: &self.password_file,
        }
    }

    /// The user of nackd's own connections.
    pub fn username(&self) -> String {
        self.username.clone().unwrap_or_else(|| "guest".into())
    }

    /// The password: inline, from `password_env` or `password_file`, or
    /// "guest" when none is set. Errors name the key.
    pub fn password(&self) -> Result<String, String> {
        let read = self.password_secret().read()?;
        Ok(read.map_or_else(|| "guest".into(), |(password, _)| password))
    }
}

impl Config {
    /// Reads and checks a configuration file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses and checks configuration text; `path` is only used in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let invalid = |key: String, reason: String| ConfigError::Invalid {
            path: path.to_owned(),
            key,
            reason,
        };
        let de = toml::Deserializer::parse(text)
            .map_err(|e| invalid("(syntax)".into(), one_line(&e.to_string())))?;
        let mut config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            invalid(key, one_line(&e.into_inner().to_string()))
        })?;
        config
            .check()
            .map_err(|(key, reason)| invalid(key, reason))?;
        config.policies = config
            .compile_policies()
            .map_err(|(key, reason)| invalid(key, reason))?;
        Ok(config)
    }

    /// Checks and compiles the `[[policy]]` tables, in file order; an
    /// error names its table (`policy[1].delays`).
    fn compile_policies(&mut self) -> Result<Vec<Policy>, (String, String)> {
        std::mem::take(&mut self.policy_tables)
            .iter()
            .enumerate()
            .map(|(i, table)| {
                Policy::new(table).map_err(|(key, reason)| (format!("policy[{i}].{key}"), reason))
            })
            .collect()
    }

    fn check(&self) -> Result<(), (String, String)> {
        if self.limits.max_connections == 0 {
            return Err(("limits.max_connections".into(), "must be at least 1".into()));
        }
        if self.limits.max_frame < MIN_MAX_FRAME {
            return Err((
                "limits.max_frame".into(),
                format!(
                    "must be at least {MIN_MAX_FRAME} (RabbitMQ 4.1+ refuses a smaller frame_max)"
                ),
            ));
        }
        if !(1..=MAX_WORKER_THREADS).contains(&self.runtime.worker_threads) {
            return Err((
                "runtime.worker_threads".into(),
                format!("must be between 1 and {MAX_WORKER_THREADS}"),
            ));
        }
        if self.runtime.coalesce > crate::coalesce::MAX_PAUSE {
            return Err((
                "runtime.coalesce".into(),
                format!(
                    "must be at most {:?} (0 turns it off)",
                    crate::coalesce::MAX_PAUSE
                ),
            ));
        }
        if !SEGMENT_BYTES_RANGE.contains(&self.store.segment_bytes) {
            return Err((
                "store.segment_bytes".into(),
                format!(
                    "must be between {} and {}",
                    SEGMENT_BYTES_RANGE.start(),
                    SEGMENT_BYTES_RANGE.end()
                ),
            ));
        }
        self.upstream.check()?;
        self.check_uri()?;
        if let Some(replica) = &self.replica {
            replica.check()?;
            if self
                .upstream
                .tls
                .as_ref()
                .is_some_and(|t| t.server_name.is_some())
            {
                return Err((
                    "replica".into(),
                    "needs upstream.tls without server_name: the replica connection verifies each node's host name".into(),
                ));
            }
        }
        self.metrics.check()?;
        if let Some(delayed) = &self.delayed {
            delayed.check()?;
        }
        delayed::check_exchanges(&self.delayed_exchanges)?;
        self.republish.check()
    }

    /// `upstream.uri`: set one way at most, not with `address` or
    /// `addresses`; inline, it parses and agrees with the rest.
    fn check_uri(&self) -> Result<(), (String, String)> {
        let secret = self.upstream.uri_secret();
        secret.check()?;
        let Some(key) = secret.key_set() else {
            return Ok(());
        };
        if self.upstream.address.is_some() {
            let reason = format!("set {key} or upstream.address, not both");
            return Err(("upstream.address".into(), reason));
        }
        if !self.upstream.addresses.is_empty() {
            let reason = format!(
                "set {key} or upstream.addresses, not both (a URI names one node: list a cluster's in addresses)"
            );
            return Err(("upstream.addresses".into(), reason));
        }
        match &self.upstream.uri {
            Some(text) => {
                let uri: BrokerUri = text.parse().map_err(|reason| (key.clone(), reason))?;
                self.uri_agrees(&uri, &key)
            }
            None => Ok(()),
        }
    }

    /// What the URI (set under `key`) sets is not set elsewhere too.
    fn uri_agrees(&self, uri: &BrokerUri, key: &str) -> Result<(), (String, String)> {
        if uri.username.is_some() && self.republish.username.is_some() {
            let reason = format!("the user is in {key}: set it there or here, not both");
            return Err(("republish.username".into(), reason));
        }
        if let (Some(_), Some(other)) = (&uri.password, self.republish.password_secret().key_set())
        {
            let reason = format!("the password is in {key}: set it there or in {other}, not both");
            return Err((other, reason));
        }
        if uri.username.is_some()
            && uri.password.is_none()
            && self.republish.password_secret().key_set().is_none()
        {
            // Otherwise the default password ("guest") would go with the
            // URI's user, unseen.
            let reason = format!(
                "{key} names a user without a password: add it to the URI, or set republish.password_env or republish.password_file"
            );
            return Err((key.to_string(), reason));
        }
        if !uri.tls && self.upstream.tls.is_some() {
            let reason = format!("{key} is amqp:// (plain): write amqps:// for TLS");
            return Err(("upstream.tls".into(), reason));
        }
        Ok(())
    }

    /// This configuration with `upstream.uri` (read from its variable or
    /// file) in force: its node in `upstream.address`, `upstream.tls` on
    /// for amqps, its login in `[republish]`. Errors start with the key.
    pub fn with_uri(&self) -> Result<Config, String> {
        let mut config = self.clone();
        let Some((text, key)) = self.upstream.uri_secret().read()? else {
            return Ok(config);
        };
        let uri: BrokerUri = text.parse().map_err(|reason| format!("{key}: {reason}"))?;
        self.uri_agrees(&uri, &key)
            .map_err(|(key, reason)| format!("{key}: {reason}"))?;
        let upstream = &mut config.upstream;
        (upstream.uri, upstream.uri_env, upstream.uri_file) = (None, None, None);
        upstream.address = Some(uri.node);
        if uri.tls && upstream.tls.is_none() {
            upstream.tls = Some(ClientTls::default());
        }
        config.republish.username = uri.username.or(config.republish.username);
        config.republish.password = uri.password.or(config.republish.password);
        Ok(config)
    }

    /// Whether delayed exchanges are emulated: a `[delayed]` table or a
    /// `[[delayed_exchange]]` is there, and `delayed.enabled` is not false.
    pub fn delayed_enabled(&self) -> bool {
        match &self.delayed {
            Some(d) => d.enabled,
            None => !self.delayed_exchanges.is_empty(),
        }
    }

    /// The `[delayed]` settings in force (the defaults when absent).
    pub fn delayed_settings(&self) -> Delayed {
        self.delayed.clone().unwrap_or_default()
    }

    /// Whether the retry engine, its store and interception start: for
    /// `[[policy]]` tables or for delayed exchanges.
    pub fn intercepting(&self) -> bool {
        !self.policies.is_empty() || self.delayed_enabled()
    }
}

/// toml errors span several lines with a source excerpt; logs want one.
fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty()
                && !l.starts_with('|')
                && !l.chars().next().is_some_and(|c| c.is_ascii_digit())
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests;

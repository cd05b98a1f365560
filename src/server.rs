//! The listener: accepts clients, applies the connection limit, terminates
//! TLS, spawns one session per client, and shuts down gracefully.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn, Instrument};

use crate::config::Config;
use crate::metrics::{Metrics, Open};
use crate::net::{self, Connector, Io, TlsError};
use crate::ops::{self, Ops};
use crate::reload::{BrokerCheck, Reloader};
use crate::retry;
use crate::session::{self, Context, Intercept};
use crate::shutdown::Stopper;
use nackd_core::clock::Clock;
use nackd_core::policy::{LivePolicies, Policies};
use nackd_core::session::{Budget, Interception, Limits, FORCED_END};

/// Starts the retry engine for the configured policies and delayed exchanges. The store is
/// recovered (and the replica synced) on the engine's thread while clients
/// are already served: their claims wait in the engine's queue meanwhile.
async fn interception(
    config: &Config,
    connector: &Connector,
    live: &Arc<LivePolicies>,
    metrics: &Arc<Metrics>,
    clock: &Clock,
    root: &CancellationToken,
) -> Result<(Intercept, BrokerCheck, Stopper), StartError> {
    let password = config
        .republish
        .password()
        .map_err(StartError::Credentials)?;
    let delayed = crate::delayed::open(config).map_err(StartError::Store)?;
    if let Some(target) = registry_target(config, &password)? {
        let pinned = config.delayed_exchanges.iter();
        let pinned = pinned.map(|t| (t.vhost.clone(), t.name.clone())).collect();
        let (set, stop) = (delayed.clone(), root.child_token());
        crate::delayed::registry::spawn(target, set, pinned, clock, metrics.clone(), stop);
    }
    let retry_options =
        retry::Options::new(&config.republish, password.clone()).with_delayed(config);
    let check = BrokerCheck::new(
        connector.clone(),
        retry_options.republish.login.clone(),
        metrics.clone(),
        root.child_token(),
    );
    let start = retry::Start {
        dir: config.store.path.clone(),
        store: crate::store::Options {
            max_bytes: config.store.max_bytes.map(|b| b as u64),
            segment_bytes: config.store.segment_bytes,
        },
        replica: replica_config(config, password)?,
        connector: connector.clone(),
        options: retry_options,
        metrics: metrics.clone(),
        clock: clock.clone(),
    };
    // The vhost the offset is measured on: one the republish user works in.
    let vhost = config
        .policies
        .first()
        .map_or_else(|| "/".to_string(), |p| p.vhost.clone());
    retry::republish::offset::spawn(
        connector.clone(),
        start.options.republish.login.clone(),
        vhost,
        clock.clone(),
        metrics.clone(),
        config.republish.max_clock_offset,
        root.child_token(),
    );
    let (retry, engine) = retry::start(start, root.child_token());
    let shared = Arc::new(Interception {
        policies: live.clone(),
        budget: Budget::new(config.limits.capture_budget),
        ready: retry.ready.clone(),
        clock: clock.clone(),
        delayed,
    });
    Ok((Intercept { shared, retry }, check, engine))
}

/// Starts the operations listener (`/metrics`, `/readyz`, the status page,
/// the admin API): it serves while the store is still being recovered.
async fn start_ops(
    config: &Config,
    connector: &Connector,
    metrics: &Arc<Metrics>,
    live: Option<Arc<LivePolicies>>,
    clock: &Clock,
    root: &CancellationToken,
) -> Result<(Arc<Ops>, SocketAddr, Stopper), StartError> {
    let (admin, read) = config.metrics.tokens().map_err(StartError::Credentials)?;
    let nodes = connector.addresses().map(str::to_string).collect();
    let ops = Ops::new(
        metrics.clone(),
        nodes,
        ops::Tokens { admin, read },
        live,
        clock.clone(),
        config.republish.max_clock_offset,
    );
    let address = config.metrics.address;
    let listener = ops::bind(address)
        .await
        .map_err(|source| StartError::MetricsBind { address, source })?;
    let address = listener.local_addr().unwrap_or(address);
    let stop = root.child_token();
    let served = tokio::spawn(ops::serve(listener, ops.clone(), stop.clone()));
    let task = Stopper::task("operations listener", stop, served);
    Ok((ops, address, task))
}

/// Everything startup checks that needs no network and changes nothing:
/// the TLS files load, the secrets named by `*_env` are set, `[replica]`
/// resolves, an existing `store.path` is a directory. `nackd
/// --check-config` runs exactly this after parsing the file, and
/// [`Proxy::bind`] runs it first: the check fails when startup would, short
/// of a port that is taken or a broker that cannot be reached.
pub fn preflight(config: &Config) -> Result<(), StartError> {
    let config = &config.with_uri().map_err(StartError::Credentials)?;
    if let Some(tls) = &config.listen.tls {
        listen_tls(tls)?;
    }
    upstream(config)?;
    config.metrics.tokens().map_err(StartError::Credentials)?;
    if !config.intercepting() {
        // Nothing is intercepted: no republisher, no store, no replica.
        return Ok(());
    }
    let password = config
        .republish
        .password()
        .map_err(StartError::Credentials)?;
    replica_config(config, password)?;
    let store = &config.store.path;
    if store.exists() && !store.is_dir() {
        let e = format!("store.path: {} is not a directory", store.display());
        return Err(StartError::Store(e));
    }
    crate::delayed::check(config).map_err(StartError::Store)?;
    Ok(())
}

fn listen_tls(tls: &crate::config::ServerTls) -> Result<tokio_rustls::TlsAcceptor, StartError> {
    net::acceptor(tls).map_err(|source| StartError::Tls {
        key: "listen.tls",
        source,
    })
}

/// The TLS settings of `upstream.tls`, if set.
pub fn upstream_tls(config: &Config) -> Result<Option<Arc<rustls::ClientConfig>>, StartError> {
    net::upstream_tls(&config.upstream).map_err(|source| StartError::Tls {
        key: "upstream.tls",
        source,
    })
}

fn upstream(config: &Config) -> Result<Connector, StartError> {
    Connector::new(&config.upstream).map_err(|source| StartError::Tls {
        key: "upstream.tls",
        source,
    })
}

/// Where `[delayed] registry` is kept, if it is on: `[upstream]`'s nodes,
/// as `[republish]`'s user.
fn registry_target(
    config: &Config,
    password: &str,
) -> Result<Option<crate::replica::Target>, StartError> {
    let settings = config.delayed_settings();
    if !config.delayed_enabled() || !settings.registry {
        return Ok(None);
    }
    Ok(Some(crate::replica::Target {
        nodes: config.upstream.nodes(),
        vhost: settings.registry_vhost,
        username: config.republish.username(),
        password: password.to_string(),
        heartbeat: config.republish.heartbeat,
        cluster_size: config.replica.as_ref().and_then(|r| r.cluster_size),
        tls: upstream_tls(config)?,
    }))
}

/// `[replica]`, resolved against `[upstream]` and `[republish]`.
fn replica_config(
    config: &Config,
    password: String,
) -> Result<Option<crate::replica::Config>, StartError> {
    let Some(r) = &config.replica else {
        return Ok(None);
    };
    let tls = upstream_tls(config)?;
    Ok(Some(crate::replica::Config {
        instance: r.instance(),
        group: r.group.clone(),
        target: crate::replica::Target {
            nodes: config.upstream.nodes(),
            vhost: r.vhost.clone(),
            username: config.republish.username(),
            password,
            heartbeat: r.heartbeat,
            cluster_size: r.cluster_size,
            tls,
        },
        store_dir: config.store.path.clone(),
        done_every: r.completions_every,
        adopt_after: r.adopt_after,
        adopt_part: r.adopt_part,
        generation_slack: r.generation_slack,
        previous_nodes: r.previous_addresses.clone(),
    }))
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
    /// The metrics address cannot be bound.
    #[error("metrics.address {address}: {source}")]
    MetricsBind {
        /// Address asked for.
        address: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// TLS material of `listen.tls` or `upstream.tls` is unusable.
    #[error("{key}: {source}")]
    Tls {
        /// The config table it comes from.
        key: &'static str,
        /// What is wrong with it.
        source: TlsError,
    },
    /// The republisher has no password.
    #[error("{0}")]
    Credentials(String),
    /// The store cannot be opened.
    #[error("{0}")]
    Store(String),
}

impl StartError {
    /// Whether it is an error of the configuration, which [`preflight`]
    /// (and so `nackd --check-config`) finds without the network; binding
    /// a port or opening the store can fail on a valid configuration.
    pub fn is_config(&self) -> bool {
        matches!(self, Self::Tls { .. } | Self::Credentials(_))
            || matches!(self, Self::Store(e) if e.starts_with("store.path:"))
    }
}

/// A bound proxy, ready to [`run`](Proxy::run).
pub struct Proxy {
    listener: TcpListener,
    acceptor: Option<TlsAcceptor>,
    connector: Connector,
    /// What every session gets: limits, the clock, what to intercept.
    context: Context,
    max_connections: usize,
    grace: Duration,
    metrics: Arc<Metrics>,
    ops: Arc<Ops>,
    ops_addr: SocketAddr,
    reloader: Reloader,
    /// The retry engine's thread, when intercepting.
    engine: Option<Stopper>,
    /// The operations listener, stopped last.
    ops_task: Stopper,
    /// Every part's token is a child of this one: cancelled once the parts
    /// are stopped in order, it ends whatever is left (a broker check).
    root: CancellationToken,
}

impl Proxy {
    /// Binds the listeners, loads TLS material and recovers the store;
    /// no client is accepted yet. The operations listener already serves
    /// (`/readyz` answers "recovering" until the store is recovered).
    pub async fn bind(config: &Config) -> Result<Self, StartError> {
        Self::bind_on(config, Clock::start()).await
    }

    /// [`Proxy::bind`] on `clock`: the process's one clock, which the
    /// session threads' waits read too (`coalesce::on_park`).
    pub async fn bind_on(config: &Config, clock: Clock) -> Result<Self, StartError> {
        preflight(config)?;
        let config = &config.with_uri().map_err(StartError::Credentials)?;
        let address = config.listen.address;
        let listener = TcpListener::bind(address)
            .await
            .map_err(|source| StartError::Bind { address, source })?;
        let acceptor = config.listen.tls.as_ref().map(listen_tls).transpose()?;
        let connector = upstream(config)?;
        let metrics = Metrics::new();
        // One clock for the engine, the sessions and the operations listener.
        // One stop: every part's token is a child of this one (see shutdown.rs).
        let root = CancellationToken::new();
        let intercepting = config.intercepting();
        let live = intercepting.then(|| LivePolicies::new(Policies::new(&config.policies)));
        let (ops, ops_addr, ops_task) =
            start_ops(config, &connector, &metrics, live.clone(), &clock, &root).await?;
        let mut reloader = Reloader::new(live.clone(), metrics.clone());
        let (intercept, engine) = match &live {
            None => (None, None),
            Some(live) => {
                let (i, check, engine) =
                    interception(config, &connector, live, &metrics, &clock, &root).await?;
                check.spawn(config);
                reloader = reloader.with_check(check);
                (Some(i), Some(engine))
            }
        };
        if let Some(i) = &intercept {
            ops.attach(i.retry.clone(), i.shared.budget.clone());
            let replayer = crate::replay::Replayer::new(config, i.retry.clone())
                .map_err(StartError::Credentials)?;
            ops.attach_replayer(replayer);
        }
        Ok(Self {
            root,
            listener,
            acceptor,
            reloader,
            metrics: metrics.clone(),
            ops,
            ops_addr,
            engine,
            ops_task,
            connector,
            context: Context {
                limits: Limits {
                    max_frame: config.limits.max_frame,
                    handshake_timeout: config.limits.handshake_timeout,
                },
                clock,
                intercept,
                metrics,
                coalesce: config.runtime.coalesce,
            },
            max_connections: config.limits.max_connections,
            grace: config.limits.shutdown_grace,
        })
    }

    /// The address clients connect to (useful when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// The address of `/metrics`, `/readyz`, the status page and the admin API.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.ops_addr
    }

    /// The proxy's metrics.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// Reloads `[[policy]]` tables into the running proxy (SIGHUP).
    pub fn reloader(&self) -> Reloader {
        self.reloader.clone()
    }

    /// The delayed exchanges this nackd knows (none without interception).
    pub fn delayed_exchanges(&self) -> Option<Arc<nackd_core::delayed::DelayedExchanges>> {
        let intercept = self.context.intercept.as_ref()?;
        Some(intercept.shared.delayed.clone())
    }

    /// Accepts clients until `shutdown`, then stops in order: stop
    /// accepting, drain the sessions (the grace period, then forced),
    /// stop the retry engine (no more firing; the store writer flushes
    /// and is joined), stop the operations listener.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let sessions = Sessions {
            tracker: TaskTracker::new(),
            force: self.root.child_token(),
        };
        info!(
            address = %self.local_addr(),
            tls = self.acceptor.is_some(),
            upstream = self.connector.address(),
            metrics = %self.ops_addr,
            "listening"
        );
        let permits = Arc::new(Semaphore::new(self.max_connections));
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
                self.metrics.clients_refused.inc();
                warn!(client.addr = %client, max_connections = self.max_connections, "refusing connection: max_connections reached");
                continue;
            };
            self.spawn_session(&sessions, tcp, client, permit);
        }
        self.ops.drain();
        drop(self.listener);
        sessions.drain(self.grace).await;
        if let Some(engine) = self.engine.take() {
            engine.stop(ENGINE_STOP).await;
        }
        self.ops_task.stop(Duration::from_secs(1)).await;
        self.root.cancel();
        info!("stopped");
    }

    fn spawn_session(
        &self,
        sessions: &Sessions,
        tcp: TcpStream,
        client: SocketAddr,
        permit: OwnedSemaphorePermit,
    ) {
        self.metrics.clients_accepted.inc();
        let open = Open::track(&self.metrics.clients);
        let task = accept(
            tcp,
            self.acceptor.clone(),
            self.connector.clone(),
            self.context.clone(),
            sessions.force.clone(),
        );
        sessions.tracker.spawn(
            async move {
                task.await;
                drop(open);
                drop(permit);
            }
            .instrument(session::span(client)),
        );
    }
}

/// The longest the retry engine gets to stop: its last commit, the store
/// writer's thread joined.
const ENGINE_STOP: Duration = Duration::from_secs(10);

/// The sessions, stopped like every other task: a token (`force`) they
/// watch, and a tracker to wait for them.
struct Sessions {
    tracker: TaskTracker,
    force: CancellationToken,
}

impl Sessions {
    /// Gives the sessions `grace` to end, then forces the rest to close.
    async fn drain(&self, grace: Duration) {
        self.tracker.close();
        info!(
            open = self.tracker.len(),
            ?grace,
            "stopped accepting; waiting for sessions"
        );
        if tokio::time::timeout(grace, self.tracker.wait())
            .await
            .is_ok()
        {
            return;
        }
        info!(
            open = self.tracker.len(),
            "grace period over; closing the remaining sessions"
        );
        self.force.cancel();
        let _ = tokio::time::timeout(FORCED_END, self.tracker.wait()).await;
    }
}

async fn accept(
    tcp: TcpStream,
    acceptor: Option<TlsAcceptor>,
    connector: Connector,
    cx: Context,
    force: CancellationToken,
) {
    let _ = tcp.set_nodelay(true);
    let io: Io = match acceptor {
        None => Box::new(tcp),
        Some(acceptor) => {
            match tokio::time::timeout(cx.limits.handshake_timeout, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => Box::new(tls),
                Ok(Err(e)) => return warn!(error = %e, "TLS handshake failed"),
                Err(_) => return warn!("TLS handshake timed out"),
            }
        }
    };
    session::serve(io, connector, cx, force).await;
}

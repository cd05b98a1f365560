//! `nackd`: parse arguments, load the config, start logging and signal
//! handling, and run the proxy.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args as ClapArgs, Parser, Subcommand, ValueEnum};
use nackd::config::{Config, Scheduling};
use nackd::ops::cli::Action;
use nackd::reload::Reloader;
use nackd::retry::Target;
use nackd::server::Proxy;
use tokio_util::sync::CancellationToken;

/// AMQP 0-9-1 proxy that turns nack/reject into delayed retries.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Configuration file.
    #[arg(long, default_value = "config/nackd.toml")]
    config: PathBuf,
    /// Check this configuration file and exit (0 if valid).
    #[arg(long, value_name = "FILE")]
    check_config: Option<PathBuf>,
    /// Override `listen.address`.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Override `upstream.address` (host:port).
    #[arg(long)]
    upstream: Option<String>,
    /// Override `metrics.address`.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Inspect or edit the store of held messages (`store.path` of --config).
    Store {
        /// Store directory (default: store.path from --config).
        #[arg(long)]
        path: Option<PathBuf>,
        #[command(subcommand)]
        action: StoreAction,
    },
    /// Ask a running nackd (its admin API) about held messages.
    Admin {
        /// host:port of its metrics listener (default: metrics.address of --config).
        #[arg(long)]
        address: Option<String>,
        /// Environment variable holding the admin token (default: the token of --config).
        #[arg(long)]
        token_env: Option<String>,
        #[command(subcommand)]
        action: AdminAction,
    },
}

#[derive(Subcommand, Debug)]
enum AdminAction {
    /// Held messages, soonest due first.
    List {
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Only this vhost.
        #[arg(long)]
        vhost: Option<String>,
        /// At most this many (the server caps it at 10000).
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Republish now: one message (--id) or every message of a queue.
    Fire(Which),
    /// Forget held messages: one (--id) or every message of a queue.
    Purge(Which),
}

#[derive(ClapArgs, Debug)]
struct Which {
    /// Store id (from `list`).
    #[arg(long, conflicts_with = "queue", required_unless_present = "queue")]
    id: Option<u64>,
    /// Every held message of this queue.
    #[arg(long)]
    queue: Option<String>,
    /// Virtual host of --queue.
    #[arg(long, default_value = "/", requires = "queue")]
    vhost: String,
}

impl Which {
    fn target(&self) -> Target {
        match (self.id, &self.queue) {
            (Some(id), _) => Target::Id(id),
            (None, queue) => Target::Queue {
                vhost: self.vhost.clone(),
                queue: queue.clone().unwrap_or_default(),
            },
        }
    }
}

#[derive(Subcommand, Debug)]
enum StoreAction {
    /// Totals and per-queue counts (read-only; works while nackd runs).
    Stats,
    /// One line per held message (read-only).
    List {
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
    },
    /// Forget every held message of a queue (nackd must be stopped).
    Purge {
        /// The queue.
        #[arg(long)]
        queue: String,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(path) = &args.check_config {
        return match Config::load(path) {
            Ok(_) => {
                println!("{}: ok", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("invalid configuration: {e}");
                ExitCode::from(2)
            }
        };
    }
    if let Some(Command::Store { path, action }) = &args.command {
        return store_command(&args.config, path.as_deref(), action);
    }
    if let Some(Command::Admin {
        address,
        token_env,
        action,
    }) = &args.command
    {
        return admin_command(
            &args.config,
            address.as_deref(),
            token_env.as_deref(),
            action,
        );
    }
    init_logging(args.log_format);
    let mut config = match Config::load(&args.config) {
        Ok(config) => config,
        Err(e) => {
            tracing::error!("invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(listen) = args.listen {
        config.listen.address = listen;
    }
    if let Some(upstream) = args.upstream {
        config.upstream.address = upstream;
    }
    if let Some(metrics) = args.metrics {
        config.metrics.address = metrics;
    }
    let batch = config.runtime.scheduling == Scheduling::Batch;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.runtime.worker_threads)
        .thread_name("nackd-worker")
        .on_thread_start(move || {
            if batch {
                if let Err(e) = nackd::sched::batch_current_thread() {
                    tracing::warn!(error = %e, "runtime.scheduling = \"batch\" not applied");
                }
            }
        })
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(run(config, args.config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("cannot start: {e}");
            ExitCode::from(1)
        }
    }
}

fn store_command(
    config: &std::path::Path,
    path: Option<&std::path::Path>,
    action: &StoreAction,
) -> ExitCode {
    use nackd::store::inspect;
    let dir = match path {
        Some(p) => p.to_owned(),
        None => match Config::load(config) {
            Ok(c) => c.store.path,
            Err(e) => {
                eprintln!("invalid configuration: {e}");
                return ExitCode::from(2);
            }
        },
    };
    let result = match action {
        StoreAction::Stats => inspect::stats(&dir),
        StoreAction::List { queue } => inspect::list(&dir, queue.as_deref()),
        StoreAction::Purge { queue } => {
            inspect::purge(&dir, queue).map(|n| format!("purged {n} held messages of {queue:?}\n"))
        }
    };
    match result {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}: {e}", dir.display());
            ExitCode::from(1)
        }
    }
}

fn admin_command(
    config: &std::path::Path,
    address: Option<&str>,
    token_env: Option<&str>,
    action: &AdminAction,
) -> ExitCode {
    let loaded = match (address, token_env) {
        (Some(_), Some(_)) => None,
        _ => match Config::load(config) {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("invalid configuration: {e}");
                return ExitCode::from(2);
            }
        },
    };
    let address = address.map_or_else(
        || {
            loaded
                .as_ref()
                .map(|c| c.metrics.address.to_string())
                .unwrap_or_default()
        },
        str::to_string,
    );
    let token = match (token_env, &loaded) {
        (Some(var), _) => std::env::var(var).map_err(|_| format!("--token-env: {var} is not set")),
        (None, Some(c)) => c.metrics.admin_token().and_then(|t| {
            t.ok_or_else(|| "no admin token: set metrics.admin_token or pass --token-env".into())
        }),
        (None, None) => Err("no admin token".into()),
    };
    let token = match token {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let action = match action {
        AdminAction::List {
            queue,
            vhost,
            limit,
        } => Action::List {
            queue: queue.clone(),
            vhost: vhost.clone(),
            limit: *limit,
        },
        AdminAction::Fire(which) => Action::Fire(which.target()),
        AdminAction::Purge(which) => Action::Purge(which.target()),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(nackd::ops::cli::run(&address, &token, &action)) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(1)
        }
    }
}

async fn run(config: Config, path: PathBuf) -> Result<(), Box<dyn std::error::Error>> {
    let proxy = Proxy::bind(&config).await?;
    let shutdown = CancellationToken::new();
    tokio::spawn(signals(shutdown.clone(), proxy.reloader(), path));
    proxy.run(shutdown).await;
    Ok(())
}

/// SIGINT/SIGTERM stop nackd; SIGHUP reloads the `[[policy]]` tables.
async fn signals(shutdown: CancellationToken, reloader: Reloader, path: PathBuf) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let mut hup = signal(SignalKind::hangup()).expect("SIGHUP handler");
    loop {
        tokio::select! {
            _ = term.recv() => break tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => break tracing::info!("SIGINT: shutting down"),
            _ = hup.recv() => match reloader.reload(&path) {
                Ok(policies) => tracing::info!(policies, file = %path.display(), "SIGHUP: policies reloaded (other sections need a restart)"),
                Err(e) => tracing::error!(file = %path.display(), "SIGHUP: reload refused, the old policies stay: {e}"),
            },
        }
    }
    shutdown.cancel();
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("NACKD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

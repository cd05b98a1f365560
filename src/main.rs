//! `nackd`: parse arguments, load the config, start logging and signal
//! handling, and run the proxy.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use nackd::config::Config;
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
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("cannot start: {e}");
            ExitCode::from(1)
        }
    }
}

fn store_command(config: &std::path::Path, path: Option<&std::path::Path>, action: &StoreAction) -> ExitCode {
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
        StoreAction::Purge { queue } => inspect::purge(&dir, queue).map(|n| format!("purged {n} held messages of {queue:?}\n")),
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

async fn run(config: Config) -> Result<(), Box<dyn std::error::Error>> {
    let proxy = Proxy::bind(&config).await?;
    let shutdown = CancellationToken::new();
    tokio::spawn(signals(shutdown.clone()));
    proxy.run(shutdown).await;
    Ok(())
}

async fn signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
    shutdown.cancel();
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("NACKD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

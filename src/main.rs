//! `nackd`: parse arguments, load the config, start logging and signal
//! handling, and run the proxy.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
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

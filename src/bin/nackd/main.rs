//! `nackd`: parse arguments, load the config, start logging and signal
//! handling, and run the proxy. The operator subcommands live beside this
//! file: [`admin`] (the admin API of a running nackd) and [`store`] (the
//! hold store on disk).

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use nackd::config::{Config, Scheduling};
use nackd::reload::Reloader;
use nackd::server::Proxy;
use nackd_core::clock::Clock;
use tokio_util::sync::CancellationToken;

mod admin;
mod store;

/// Where the configuration is when neither `--config` nor `NACKD_CONFIG`
/// says: where the Debian package and the container image put it.
const DEFAULT_CONFIG: &str = "/etc/nackd/nackd.toml";

/// `nackd --version`: the package version and the commit it was built
/// from (build.rs), with the commit's date when known.
const VERSION: &str = match NACKD_COMMIT_DATE.is_empty() {
    true => concat!(env!("CARGO_PKG_VERSION"), " (", env!("NACKD_COMMIT"), ")"),
    false => concat!(
        env!("CARGO_PKG_VERSION"),
        " (",
        env!("NACKD_COMMIT"),
        " ",
        env!("NACKD_COMMIT_DATE"),
        ")"
    ),
};
const NACKD_COMMIT_DATE: &str = env!("NACKD_COMMIT_DATE");

/// AMQP 0-9-1 proxy that turns nack/reject into delayed retries.
#[derive(Parser, Debug)]
#[command(version = VERSION, about)]
struct Args {
    /// Configuration file, before or after a subcommand.
    #[arg(long, global = true, env = "NACKD_CONFIG", default_value = DEFAULT_CONFIG)]
    config: PathBuf,
    /// Check this configuration file as startup does, without the network,
    /// and exit (0 if nackd would start with it; 2, naming the key, if not).
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
    Store(store::StoreArgs),
    /// Ask a running nackd (its admin API) about held messages, replay a
    /// dead-letter queue, or reseed its replica.
    Admin(admin::AdminArgs),
    /// Print the configuration file's JSON Schema (for an editor, such as
    /// VS Code with Even Better TOML; deploy/nackd.schema.json holds it).
    ConfigSchema,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(path) = &args.check_config {
        return check_config(path);
    }
    match &args.command {
        Some(Command::Store(store)) => return store::run(&args.config, store),
        Some(Command::Admin(admin)) => return admin::run(&args.config, admin),
        Some(Command::ConfigSchema) => {
            let schema = nackd::config::json_schema();
            println!("{schema:#}");
            return ExitCode::SUCCESS;
        }
        None => {}
    }
    init_logging(args.log_format);
    let config = match load(&args) {
        Ok(config) => config,
        Err(e) => {
            tracing::error!("invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    // The process's one clock: the sessions' threads, the engine, the store.
    let clock = Clock::start();
    match runtime(&config, &clock).block_on(run(config, args.config, clock)) {
        Ok(()) => ExitCode::SUCCESS,
        // What --check-config finds too: a configuration error.
        Err(e)
            if e.downcast_ref::<nackd::server::StartError>()
                .is_some_and(|e| e.is_config()) =>
        {
            tracing::error!("invalid configuration: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            tracing::error!("cannot start: {e}");
            ExitCode::from(1)
        }
    }
}

/// `--check-config`: the file at `path` as startup would take it.
fn check_config(path: &Path) -> ExitCode {
    let checked = Config::load(path)
        .map_err(|e| e.to_string())
        .and_then(|config| nackd::server::preflight(&config).map_err(|e| e.to_string()));
    match checked {
        Ok(()) => {
            println!("{}: ok", path.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("invalid configuration: {e}");
            ExitCode::from(2)
        }
    }
}

/// The configuration `--config` names, with the command line's overrides.
fn load(args: &Args) -> Result<Config, String> {
    // `upstream.uri` first: `--upstream` overrides the address it names.
    let loaded = Config::load(&args.config).map_err(|e| e.to_string());
    let mut config = loaded.and_then(|c| {
        c.with_uri()
            .map_err(|e| format!("{}: {e}", args.config.display()))
    })?;
    if let Some(listen) = args.listen {
        config.listen.address = listen;
    }
    if let Some(upstream) = &args.upstream {
        config.upstream.set_single(upstream.clone());
    }
    if let Some(metrics) = args.metrics {
        config.metrics.address = metrics;
    }
    Ok(config)
}

/// The session threads `[runtime]` asks for.
fn runtime(config: &Config, clock: &Clock) -> tokio::runtime::Runtime {
    let batch = config.runtime.scheduling == Scheduling::Batch;
    let coalesce = !config.runtime.coalesce.is_zero();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.runtime.worker_threads)
        .thread_name("nackd-worker")
        .on_thread_start(move || {
            if batch {
                if let Err(e) = nackd::sched::batch_current_thread() {
                    tracing::warn!(error = %e, "runtime.scheduling = \"batch\" not applied");
                }
            }
            if coalesce {
                if let Err(e) = nackd::coalesce::precise_sleeps() {
                    tracing::warn!(error = %e, "runtime.coalesce: timer slack not lowered");
                }
            }
        })
        // An idle thread waits `runtime.coalesce` while a peer streams.
        .on_thread_park({
            let clock = clock.clone();
            move || nackd::coalesce::on_park(&clock)
        })
        .enable_all()
        .build()
        .expect("tokio runtime")
}

async fn run(
    config: Config,
    path: PathBuf,
    clock: Clock,
) -> Result<(), Box<dyn std::error::Error>> {
    // Handlers first: a signal that arrives once "listening" is logged must
    // find them, not the default action (which would end the process).
    let handlers = Signals::install()?;
    let proxy = Proxy::bind_on(&config, clock).await?;
    let shutdown = CancellationToken::new();
    tokio::spawn(handlers.serve(shutdown.clone(), proxy.reloader(), path));
    proxy.run(shutdown).await;
    Ok(())
}

/// SIGINT/SIGTERM stop nackd; SIGHUP reloads the `[[policy]]` tables.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    async fn serve(self, shutdown: CancellationToken, reloader: Reloader, path: PathBuf) {
        let Self {
            mut term,
            mut int,
            mut hup,
        } = self;
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
}

/// What is logged when `NACKD_LOG` does not say. lapin (the replica's
/// client) logs every channel a broker closes as an error, and nackd probes
/// queues that may not exist on purpose (leases); it logs each returned
/// message, body and all, as a warning, and a deleted replica stream
/// returns every write: nackd logs what matters.
const DEFAULT_LOG: &str = "info,lapin=warn,lapin::channel=off,lapin::returned_messages=off";

/// Logs on stderr; text is coloured only on a terminal, so that
/// `scripts/run > nackd.log 2>&1` writes plain lines.
fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("NACKD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().init(),
    }
}

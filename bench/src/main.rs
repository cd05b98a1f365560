//! `nackd-bench`: parse arguments, start logging, run the scenario
//! (see the `nackd_bench` library of this crate).

use std::process::ExitCode;

use clap::Parser;
use nackd_bench::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("NACKD_BENCH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    match runtime.block_on(nackd_bench::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("benchmark failed: {e}");
            ExitCode::FAILURE
        }
    }
}

//! `nackd store stats|list|purge`: the hold store on disk, read (or, with
//! nackd stopped, edited) by `nackd::store::inspect`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Subcommand};
use nackd::config::Config;
use nackd::store::inspect;

// No doc comment here: clap would take it for the subcommand's help, which
// is the doc comment of `Command::Store` in main.rs.
#[derive(Args, Debug)]
pub(crate) struct StoreArgs {
    /// Store directory (default: store.path from --config).
    #[arg(long)]
    path: Option<PathBuf>,
    #[command(subcommand)]
    action: StoreAction,
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

/// Runs the command on `--path`, else on `store.path` of the file `config`.
pub(crate) fn run(config: &Path, args: &StoreArgs) -> ExitCode {
    let dir = match &args.path {
        Some(p) => p.clone(),
        None => match Config::load(config) {
            Ok(c) => c.store.path,
            Err(e) => {
                eprintln!("invalid configuration: {e}");
                return ExitCode::from(2);
            }
        },
    };
    let result = match &args.action {
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

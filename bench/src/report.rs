//! What a run prints, and the results file it can be recorded in.
//!
//! Every line of a report goes through [`out!`](crate::out): printed to
//! stdout as it comes, and kept. With `--record NAME` a run that succeeds
//! writes the whole report into the results file (`docs/src/results.md`
//! of the repository, a page of the book; `--results FILE` moves it) as
//! the entry `## NAME`, with the command line, the commit, the date and
//! the machine above it. An entry of that name is replaced, the others are
//! kept in their order, a new one goes at the end. The docs quote figures
//! from these entries and link to them (`results.md#NAME`), so a figure
//! that changes is a diff of this file, and a quoted entry that is gone
//! is a broken link, which the book's test finds.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use super::BenchResult;

static KEPT: Mutex<String> = Mutex::new(String::new());
/// Why this run's figures must not be recorded, if they must not.
static SPOILED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The run failed one of its own checks (a message lost or early through
/// nackd): it still prints its report, but `--record` refuses it rather
/// than replace a good entry.
pub fn spoil(why: String) {
    SPOILED.lock().unwrap_or_else(|e| e.into_inner()).push(why);
}

/// Why the run must not be recorded (empty: it may).
pub fn spoiled() -> Vec<String> {
    SPOILED.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Prints one line of the report (`println!`'s arguments) and keeps it
/// for `--record`.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::report::line(&format!($($arg)*))
    };
}

/// Prints `text` and a newline, and keeps them.
pub fn line(text: &str) {
    println!("{text}");
    let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
    kept.push_str(text);
    kept.push('\n');
}

/// The lines printed so far.
pub fn printed() -> String {
    KEPT.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The page a new results file starts with.
const PREAMBLE: &str = "# Recorded runs\n\n\
Written by `nackd-bench … --record NAME`, one entry per name: the whole \
report of the run, with the command, the commit, the date and the \
machine. Do not edit by hand: run the command again. Figures quoted in \
the README and this book link to their entry here (Benchmarks explains \
each scenario).\n";

/// Where a run was recorded from: the command line, the commit of the
/// repository (and whether its tree had changes), the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provenance {
    /// The arguments after the program's name.
    pub args: Vec<String>,
    /// `git rev-parse HEAD`, or why there is none.
    pub commit: String,
    /// `git status --porcelain` of the product and bench sources was empty.
    pub clean: bool,
    /// `uname -r`-like: /proc/sys/kernel/osrelease.
    pub kernel: String,
}

impl Provenance {
    /// Read from this process and the repository at `repo`.
    pub fn here(repo: &Path) -> Self {
        let git = |args: &[&str]| super::baseline::git(repo, args);
        let commit = git(&["rev-parse", "HEAD"]).unwrap_or_else(|e| format!("unknown ({e})"));
        let changes = git(&[
            "status",
            "--porcelain",
            "--",
            "src",
            "core",
            "bench",
            "Cargo.toml",
            "Cargo.lock",
        ]);
        Self {
            args: std::env::args().skip(1).collect(),
            commit,
            clean: changes.is_ok_and(|c| c.is_empty()),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map_or_else(|_| "unknown".into(), |k| k.trim().to_owned()),
        }
    }
}

/// The entry `## name` for a report.
pub fn entry(name: &str, provenance: &Provenance, report: &str) -> String {
    let mut e = String::new();
    let _ = writeln!(e, "## {name}\n");
    let _ = writeln!(e, "- command: `nackd-bench {}`", provenance.args.join(" "));
    let tree = match provenance.clean {
        true => "",
        false => " with uncommitted changes to the sources",
    };
    let _ = writeln!(e, "- commit: `{}`{tree}", provenance.commit);
    let _ = writeln!(
        e,
        "- recorded: {}",
        humantime::format_rfc3339_seconds(SystemTime::now())
    );
    let _ = writeln!(e, "- kernel: Linux {}\n", provenance.kernel);
    let _ = writeln!(e, "```text\n{}```", report);
    e
}

/// `file`'s text with the entry `## name` set to `entry`: replaced where
/// it was, else added at the end.
pub fn with_entry(file: &str, name: &str, entry: &str) -> String {
    let file = match file.trim().is_empty() {
        true => PREAMBLE,
        false => file,
    };
    let heading = format!("## {name}");
    let lines: Vec<&str> = file.lines().collect();
    let start = lines.iter().position(|l| *l == heading);
    let mut out = String::new();
    match start {
        Some(s) => {
            let end = lines[s + 1..]
                .iter()
                .position(|l| l.starts_with("## "))
                .map_or(lines.len(), |i| s + 1 + i);
            push_lines(&mut out, &lines[..s]);
            out.push_str(entry);
            if end < lines.len() {
                out.push('\n');
                push_lines(&mut out, &lines[end..]);
            }
        }
        None => {
            push_lines(&mut out, &lines);
            out.push('\n');
            out.push_str(entry);
        }
    }
    out
}

fn push_lines(out: &mut String, lines: &[&str]) {
    for l in lines {
        out.push_str(l);
        out.push('\n');
    }
}

/// A name that is its own `#anchor` in the book: lowercase ASCII letters,
/// digits and `-`, starting with a letter.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    match ok {
        true => Ok(()),
        false => Err(format!(
            "--record {name:?}: a name is lowercase letters, digits and '-', starting with a letter (it is the entry's #anchor)"
        )),
    }
}

/// The results file: `results`, else `docs/src/results.md` of the
/// repository of the current directory (or of this executable).
pub fn results_file(results: Option<&Path>) -> BenchResult<(PathBuf, PathBuf)> {
    let repo = super::baseline::repository()
        .map_err(|e| format!("--record: no git repository to record the commit of ({e})"))?;
    let file = results.map_or_else(|| repo.join("docs/src/results.md"), Path::to_path_buf);
    Ok((repo, file))
}

/// Writes the report printed so far as the entry `name` of `file`,
/// recording the commit of `repo` ([`results_file`] finds both).
pub fn record(name: &str, repo: &Path, file: &Path) -> BenchResult<()> {
    let spoiled = spoiled();
    if !spoiled.is_empty() {
        return Err(format!(
            "--record {name}: not recorded, the run failed its own checks: {}",
            spoiled.join("; ")
        )
        .into());
    }
    let old = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(format!("reading {}: {e}", file.display()).into()),
    };
    let new = with_entry(
        &old,
        name,
        &entry(name, &Provenance::here(repo), &printed()),
    );
    let tmp = file.with_extension("md.tmp");
    std::fs::write(&tmp, new).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, file).map_err(|e| format!("renaming to {}: {e}", file.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provenance() -> Provenance {
        Provenance {
            args: vec!["retry".into(), "--rates".into(), "3000".into()],
            commit: "0123abcd".into(),
            clean: false,
            kernel: "6.1.0".into(),
        }
    }

    #[test]
    fn an_entry_names_the_command_the_commit_the_date_and_the_machine() {
        let e = entry(
            "retry-tail",
            &provenance(),
            "nackd-bench retry\nmachine     2 CPUs\n",
        );
        assert!(e.starts_with("## retry-tail\n\n"), "{e}");
        assert!(
            e.contains("- command: `nackd-bench retry --rates 3000`\n"),
            "{e}"
        );
        assert!(
            e.contains("- commit: `0123abcd` with uncommitted changes"),
            "{e}"
        );
        assert!(e.contains("- recorded: 20"), "{e}");
        assert!(e.contains("- kernel: Linux 6.1.0\n"), "{e}");
        assert!(
            e.ends_with("```text\nnackd-bench retry\nmachine     2 CPUs\n```\n"),
            "{e}"
        );
    }

    #[test]
    fn a_new_file_gets_the_preamble_then_the_entry() {
        let file = with_entry("", "a", "## a\n\nA\n");
        assert!(file.starts_with("# Recorded runs\n"), "{file}");
        assert!(file.ends_with("\n\n## a\n\nA\n"), "{file}");
    }

    #[test]
    fn an_entry_of_the_same_name_is_replaced_in_place_and_the_others_kept() {
        let file = "# R\n\n## a\n\nA1\n\n## b\n\nB\n\n## c\n\nC\n";
        let b2 = with_entry(file, "b", "## b\n\nB2\n");
        assert_eq!(b2, "# R\n\n## a\n\nA1\n\n## b\n\nB2\n\n## c\n\nC\n");
        let c2 = with_entry(file, "c", "## c\n\nC2\n");
        assert_eq!(c2, "# R\n\n## a\n\nA1\n\n## b\n\nB\n\n## c\n\nC2\n");
        let d = with_entry(file, "d", "## d\n\nD\n");
        assert_eq!(d, format!("{file}\n## d\n\nD\n"));
        // A heading that only starts like the name is another entry.
        let ab = with_entry(file, "a-b", "## a-b\n\nX\n");
        assert!(
            ab.contains("## a\n\nA1\n") && ab.ends_with("## a-b\n\nX\n"),
            "{ab}"
        );
    }

    #[test]
    fn a_name_must_be_an_anchor() {
        assert!(check_name("retry-3000-tail").is_ok());
        for bad in ["", "Retry", "3000", "retry 3000", "retry_3000", "ré"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    /// Every report line goes through `out!`, or `--record` would leave
    /// it out of the entry (passthrough's figures once were).
    #[test]
    fn no_scenario_prints_around_the_report() {
        fn walk(dir: &Path, found: &mut Vec<String>) {
            for e in std::fs::read_dir(dir).unwrap() {
                let path = e.unwrap().path();
                if path.is_dir() {
                    walk(&path, found);
                } else if path.extension().is_some_and(|x| x == "rs")
                    && !path.ends_with("src/report.rs")
                {
                    let text = std::fs::read_to_string(&path).unwrap();
                    for (n, line) in text.lines().enumerate() {
                        if line.contains(concat!("print", "ln!("))
                            && !line.contains(concat!("e", "print", "ln!("))
                        {
                            found.push(format!("{}:{}: {line}", path.display(), n + 1));
                        }
                    }
                }
            }
        }
        let mut found = Vec::new();
        walk(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
            &mut found,
        );
        assert!(
            found.is_empty(),
            "use crate::out! instead:\n{}",
            found.join("\n")
        );
    }

    #[test]
    fn a_run_that_failed_its_checks_is_not_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("results.md");
        spoil("nackd delivered 2 early at 3000/s".into());
        let e = record("retry-tail", dir.path(), &file)
            .unwrap_err()
            .to_string();
        assert!(e.contains("nackd delivered 2 early at 3000/s"), "{e}");
        assert!(!file.exists());
    }

    #[test]
    fn printed_lines_are_kept_in_order() {
        line("first line of a test");
        out!("second {}", "line of a test");
        let kept = printed();
        let first = kept.find("first line of a test\n").expect("kept");
        let second = kept.find("second line of a test\n").expect("kept");
        assert!(first < second, "{kept}");
    }
}

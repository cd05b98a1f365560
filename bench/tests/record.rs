//! `--record NAME`: a run that succeeds writes its whole report into the
//! results file as the entry NAME, with the command, the commit, the date
//! and the kernel; a second run of the same name replaces it (that one
//! measures another nackd binary, named with `--nackd`); a name that
//! cannot be an anchor ends the run before anything is measured. A short
//! `retry` run through a real nackd in front of the broker on
//! 127.0.0.1:5672.

use std::path::Path;
use std::process::{Command, Output};

mod common;

use common::{nackd, BENCH};

fn record(results: &Path, name: &str, nackd: Option<&Path>) -> Output {
    let mut bench = Command::new(BENCH);
    bench
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NACKD_BENCH_LOG", "warn,lapin=off")
        .args([
            "retry",
            "--seconds",
            "1",
            "--warmup",
            "0",
            "--rounds",
            "1",
            "--rates",
            "200",
            "--delays",
            "50",
            "--mechanisms",
            "nackd",
            "--record",
            name,
            "--results",
        ])
        .arg(results);
    if let Some(nackd) = nackd {
        bench.arg("--nackd").arg(nackd);
    }
    bench.output().expect("running nackd-bench")
}

#[test]
fn a_recorded_run_is_one_entry_with_its_command_commit_date_and_report() {
    let dir = tempfile::tempdir().unwrap();
    // The second run measures a copy of nackd named with --nackd.
    let copy = dir.path().join("nackd-copy");
    std::fs::copy(nackd(), &copy).unwrap();
    let results = dir.path().join("results.md");
    std::fs::write(
        &results,
        "# Recorded runs\n\nkept\n\n## other\n\nkept too\n",
    )
    .unwrap();
    for run in 1..=2 {
        let out = record(
            &results,
            "retry-short",
            (run == 2).then_some(copy.as_path()),
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let measured = format!("nackd       {} (pid", copy.display());
        assert_eq!(stdout.contains(&measured), run == 2, "run {run}: {stdout}");
        assert!(
            out.status.success(),
            "run {run}:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = std::fs::read_to_string(&results).unwrap();
        assert!(
            text.starts_with("# Recorded runs\n\nkept\n\n## other\n\nkept too\n"),
            "{text}"
        );
        assert_eq!(
            text.matches("\n## retry-short\n").count(),
            1,
            "run {run}: {text}"
        );
        let entry = &text[text.find("## retry-short").unwrap()..];
        assert!(
            entry.contains("- command: `nackd-bench retry --seconds 1 --warmup 0 --rounds 1"),
            "{entry}"
        );
        let commit = entry
            .lines()
            .find_map(|l| l.strip_prefix("- commit: `"))
            .expect("a commit line");
        assert!(
            commit.len() > 40 && commit[..40].chars().all(|c| c.is_ascii_hexdigit()),
            "{commit}"
        );
        assert!(entry.contains("\n- recorded: 20"), "{entry}");
        assert!(entry.contains("\n- kernel: Linux "), "{entry}");
        // The report as printed, machine line included, inside the entry.
        assert!(entry.contains("```text\nnackd-bench retry\n"), "{entry}");
        let median = stdout
            .lines()
            .find(|l| l.starts_with("median      nackd "))
            .expect("a median line");
        assert!(entry.contains(median), "{median} not in {entry}");
        assert!(entry.contains("\nmachine     "), "{entry}");
    }
}

#[test]
fn a_name_that_is_not_an_anchor_ends_the_run_before_it_starts() {
    let dir = tempfile::tempdir().unwrap();
    let results = dir.path().join("results.md");
    let out = record(&results, "Retry Short", None);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--record \"Retry Short\""), "{stderr}");
    assert!(
        String::from_utf8_lossy(&out.stdout).is_empty(),
        "nothing measured"
    );
    assert!(!results.exists());
}

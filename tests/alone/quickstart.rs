//! The README's quickstart, run as a newcomer runs it: its fenced blocks
//! marked `quickstart` are taken from README.md as written
//! (`toml quickstart file=nackd.toml` and `python quickstart
//! file=consumer.py` become those files, the `sh quickstart` blocks one
//! bash script) and run in a temporary directory against RabbitMQ 3.10 on
//! 127.0.0.1:5672, the broker the README names. The consumer's output must
//! show the retry after the delay the README's config gives, with the
//! message's own header and nackd's retry headers.
//!
//! Two things differ from a newcomer's run, and only these: the
//! `quickstart-build` block (a release build, minutes on every CI run) is
//! not run: the `nackd` the suite built from the same tree is put on
//! `PATH` instead; and the README's `pip install pika` installs the wheel
//! scripts/ensure-docs-tools.sh cached (PIP_NO_INDEX, PIP_FIND_LINKS), into
//! the quickstart's own venv in the temporary directory: nothing touches
//! the system's Python. The README's ports (5673, and nackd's default
//! 9645 for metrics) are fixed, so runs take turns on a file lock. No
//! other broker: scripts/test runs it once (.config/nextest.toml leaves it
//! out of alone43).

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{lock_file, Lock};

const DIR: &str = env!("CARGO_MANIFEST_DIR");

/// A fenced block of the README: its info string's words after the
/// language, and its text.
struct Block {
    lang: String,
    words: Vec<String>,
    text: String,
}

impl Block {
    fn file(&self) -> Option<&str> {
        self.words.iter().find_map(|w| w.strip_prefix("file="))
    }
}

/// The fenced blocks of `markdown` whose info string's second word is
/// `marker`, in order.
fn blocks(markdown: &str, marker: &str) -> Vec<Block> {
    let mut found = Vec::new();
    let mut lines = markdown.lines();
    while let Some(line) = lines.next() {
        let Some(info) = line.strip_prefix("```") else {
            continue;
        };
        let mut text = String::new();
        for body in lines.by_ref() {
            if body.starts_with("```") {
                break;
            }
            text.push_str(body);
            text.push('\n');
        }
        let mut words = info.split_whitespace().map(str::to_string);
        let lang = words.next().unwrap_or_default();
        let words: Vec<String> = words.collect();
        if words.first().map(String::as_str) == Some(marker) {
            found.push(Block { lang, words, text });
        }
    }
    found
}

/// One line the README's consumer prints:
/// `2.02 s: hello order-id=42 x-retry-count=1 x-retry-delay-ms=2000`.
#[derive(Debug)]
struct Delivery {
    at: f64,
    fields: std::collections::HashMap<String, String>,
}

fn deliveries(output: &str) -> Vec<Delivery> {
    output
        .lines()
        .filter_map(|line| {
            let (at, rest) = line.split_once(" s: ")?;
            let at: f64 = at.trim().parse().ok()?;
            let fields = rest
                .split_whitespace()
                .filter_map(|w| w.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            Some(Delivery { at, fields })
        })
        .collect()
}

/// The first delay of the README config's first policy.
fn first_delay(config: &str) -> Duration {
    let table: toml::Table = toml::from_str(config).expect("the README's nackd.toml parses");
    let delay = table["policy"][0]["delays"][0]
        .as_str()
        .expect("the README's policy has a delays list");
    humantime::parse_duration(delay).unwrap()
}

#[test]
fn the_readme_quickstart_shows_the_retry_after_its_delay_with_its_headers() {
    // The README's fixed ports: one quickstart at a time on this machine.
    let _ports = lock_file("quickstart-ports", Lock::Exclusive);
    let readme = std::fs::read_to_string(Path::new(DIR).join("README.md")).unwrap();

    let build = blocks(&readme, "quickstart-build");
    assert_eq!(build.len(), 1, "the README has one quickstart-build block");
    assert!(
        build[0].text.contains("cargo build") && build[0].text.contains("PATH="),
        "the quickstart-build block builds nackd and puts it on PATH, which this test stands in for:\n{}",
        build[0].text
    );
    let steps = blocks(&readme, "quickstart");
    let dir = tempfile::Builder::new()
        .prefix("nackd-quickstart-")
        .tempdir()
        .unwrap();
    let mut script = String::from("set -euo pipefail\n");
    let mut config = None;
    for block in &steps {
        match (block.lang.as_str(), block.file()) {
            ("sh", None) => script.push_str(&block.text),
            (_, Some(file)) => {
                std::fs::write(dir.path().join(file), &block.text).unwrap();
                if file == "nackd.toml" {
                    config = Some(block.text.clone());
                }
            }
            (lang, None) => panic!("a {lang} quickstart block names no file="),
        }
    }
    let config = config.expect("the README's quickstart writes nackd.toml");
    assert!(
        steps.iter().any(|b| b.file() == Some("consumer.py")),
        "the README's quickstart writes consumer.py"
    );
    let delay = first_delay(&config);

    let tools = crate::book::ensure("ensure-docs-tools.sh");
    let nackd = Path::new(env!("CARGO_BIN_EXE_nackd"));
    let path = format!(
        "{}:{}",
        nackd.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let started = Instant::now();
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(dir.path())
        .env("PATH", path)
        .env("PIP_NO_INDEX", "1")
        .env("PIP_FIND_LINKS", tools.join("wheels"))
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group: whatever it left running (nackd, when a
        // step fails before `kill %1`) is ended with it below.
        .process_group(0)
        .spawn()
        .unwrap();
    let group = child.id();
    let limit = Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > limit {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{group}")])
        .stderr(Stdio::null())
        .status();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report = format!("script:\n{script}\nstdout:\n{stdout}\nstderr:\n{stderr}");
    let status = status.unwrap_or_else(|| panic!("the quickstart ran past {limit:?}:\n{report}"));
    assert!(status.success(), "the quickstart failed ({status}):\n{report}");
    eprintln!(
        "the quickstart's blocks ran in {:.1} s:\n{stdout}",
        started.elapsed().as_secs_f64()
    );

    let seen = deliveries(&stdout);
    assert_eq!(seen.len(), 2, "a delivery and its retry:\n{report}");
    let (first, retry) = (&seen[0], &seen[1]);
    let field = |d: &Delivery, k: &str| d.fields.get(k).cloned().unwrap_or_default();
    assert_eq!(field(first, "x-retry-count"), "None", "{report}");
    assert_eq!(field(retry, "x-retry-count"), "1", "{report}");
    assert_eq!(
        field(retry, "x-retry-delay-ms"),
        delay.as_millis().to_string(),
        "{report}"
    );
    assert_eq!(field(first, "order-id"), "42", "{report}");
    assert_eq!(field(retry, "order-id"), "42", "the message's own header is kept: {report}");
    let waited = retry.at - first.at;
    assert!(
        waited >= delay.as_secs_f64() && waited < delay.as_secs_f64() + 3.0,
        "the retry came {waited:.2} s after the first delivery, the delay is {delay:?}:\n{report}"
    );
}

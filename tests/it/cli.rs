//! The `nackd` binary: configuration errors, `--check-config`, overrides,
//! a clean exit on SIGTERM, and the threads `[runtime]` asks for.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const NACKD: &str = env!("CARGO_BIN_EXE_nackd");

/// `nackd --check-config path`, run to its end.
fn check_config(path: &std::path::Path) -> std::process::Output {
    Command::new(NACKD)
        .arg("--check-config")
        .arg(path)
        .output()
        .unwrap()
}

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn check_config_accepts_the_shipped_file_and_names_the_bad_key() {
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/config/nackd.toml");
    let ok = check_config(std::path::Path::new(shipped));
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );

    let dir = tempfile::tempdir().unwrap();
    let bad = write(
        &dir,
        "bad.toml",
        "[[policy]]\nqueues = [\"q\"]\ndelays = [\"soon\"]\n",
    );
    let out = check_config(&bad);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("policy[0].delays"), "{stderr}");
}

/// Issue 25: `--check-config` fails exactly when startup does, naming the
/// key, for every rejection that needs no network: each case below stops
/// `nackd --config` with exit 2 and the key in its log, and `nackd
/// --check-config` with exit 2 and the key; the base config passes both.
#[test]
fn check_config_rejects_what_startup_rejects() {
    let dir = tempfile::tempdir().unwrap();
    let a_file = write(&dir, "not-a-dir", "x");
    let uri_with_vhost = write(&dir, "uri", "amqp://u:secret@h/shop\n");
    let base = format!(
        "[listen]\naddress = \"127.0.0.1:0\"\n[metrics]\naddress = \"127.0.0.1:0\"\n[upstream]\naddress = \"{}\"\n",
        common::BROKER
    );
    let policy = "[[policy]]\nqueues = [\"q\"]\ndelays = [\"1s\"]\n";
    let cases: Vec<(&str, String)> = vec![
        (
            "policy[0].delays",
            "[[policy]]\nqueues = [\"q\"]\ndelays = [\"soon\"]\n".into(),
        ),
        (
            "listen.tls",
            "[listen.tls]\ncert = \"/nonexistent/cert.pem\"\nkey = \"/nonexistent/key.pem\"\n"
                .into(),
        ),
        (
            "upstream.tls",
            "[upstream.tls]\nca = \"/nonexistent/ca.pem\"\n".into(),
        ),
        (
            "republish.password_env",
            format!("[republish]\npassword_env = \"NACKD_TEST_UNSET_PASSWORD_1\"\n{policy}"),
        ),
        (
            "metrics.admin_token_env",
            "admin_token_env = \"NACKD_TEST_UNSET_TOKEN_1\"\n".into(),
        ),
        (
            "metrics.read_token_env",
            "read_token_env = \"NACKD_TEST_UNSET_TOKEN_2\"\n".into(),
        ),
        (
            "metrics.read_token",
            "admin_token = \"same-token-0123456789\"\nread_token = \"same-token-0123456789\"\n"
                .into(),
        ),
        (
            "store.path",
            format!("[store]\npath = \"{}\"\n{policy}", a_file.display()),
        ),
        (
            "republish.password_file: cannot read /nonexistent/nackd-password",
            format!("[republish]\npassword_file = \"/nonexistent/nackd-password\"\n{policy}"),
        ),
        (
            "metrics.admin_token_file: cannot read /nonexistent/nackd-token",
            "admin_token_file = \"/nonexistent/nackd-token\"\n".into(),
        ),
        (
            "metrics.read_token_file: a token must be at least 16",
            format!("read_token_file = {:?}\n", a_file.display().to_string()),
        ),
        (
            "upstream.uri_file: cannot read /nonexistent/nackd-uri",
            "uri_file = \"/nonexistent/nackd-uri\"\n".into(),
        ),
        (
            "upstream.uri_env: NACKD_TEST_UNSET_URI_1 is not set",
            "uri_env = \"NACKD_TEST_UNSET_URI_1\"\n".into(),
        ),
        (
            "upstream.uri_file: vhost \"shop\"",
            format!("uri_file = {:?}\n", uri_with_vhost.display().to_string()),
        ),
    ];
    let ok = write(&dir, "ok.toml", &format!("{base}{policy}"));
    let out = check_config(&ok);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Without a policy nothing is republished: its secret need not be set.
    let proxy_only = write(
        &dir,
        "proxy-only.toml",
        &format!("{base}[republish]\npassword_env = \"NACKD_TEST_UNSET_PASSWORD_1\"\n"),
    );
    let out = check_config(&proxy_only);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (i, (key, extra)) in cases.iter().enumerate() {
        // `[metrics]` is in the base: its cases add their keys there; a
        // URI takes the place of the address.
        let address = format!("address = \"{}\"\n", common::BROKER);
        let text = match key {
            k if k.starts_with("metrics.") => {
                base.replacen("[metrics]\n", &format!("[metrics]\n{extra}"), 1)
            }
            k if k.starts_with("upstream.uri") => base.replacen(&address, extra, 1),
            _ => format!("{base}{extra}"),
        };
        let path = write(&dir, &format!("case{i}.toml"), &text);
        let check = check_config(&path);
        let said = String::from_utf8_lossy(&check.stderr);
        assert_eq!(
            check.status.code(),
            Some(2),
            "--check-config, {key}: {said}"
        );
        assert!(said.contains(key), "--check-config names {key}: {said}");
        assert!(!said.contains("secret"), "no password repeated: {said}");
        let start = Command::new(NACKD)
            .arg("--config")
            .arg(&path)
            .current_dir(dir.path())
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&start.stderr);
        assert_eq!(start.status.code(), Some(2), "startup, {key}: {said}");
        assert!(said.contains(key), "startup names {key}: {said}");
    }
}

#[test]
fn a_bad_config_stops_startup_with_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(
        &dir,
        "bad.toml",
        &format!(
            "[upstream]\naddress = \"{}\"\nconect_timeout = \"1s\"\n",
            common::BROKER
        ),
    );
    let out = Command::new(NACKD)
        .arg("--config")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("upstream") && stderr.contains("conect_timeout"),
        "{stderr}"
    );
}

#[test]
fn text_logs_into_a_pipe_or_file_carry_no_colour_escapes() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(&dir, "bad.toml", "[upstream]\nconect_timeout = \"1s\"\n");
    let out = Command::new(NACKD)
        .arg("--config")
        .arg(&bad)
        .args(["--log-format", "text"])
        // NO_COLOR would hide the colour this test looks for.
        .env_remove("NO_COLOR")
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("ERROR") && stderr.contains("conect_timeout"),
        "{stderr}"
    );
    assert!(!stderr.contains("\x1b["), "ANSI escapes: {stderr:?}");
}

#[test]
fn runs_with_overrides_logs_json_and_exits_cleanly_on_sigterm() {
    common::require_broker();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "n.toml", "[upstream]\naddress = \"127.0.0.1:1\"\n");
    let mut child = Command::new(NACKD)
        .arg("--config")
        .arg(&cfg)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            common::BROKER.addr(),
            "--metrics",
            "127.0.0.1:0",
            "--log-format",
            "json",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let listening = lines.next().expect("a log line").unwrap();
    let line: serde_json::Value = serde_json::from_str(&listening).expect("json log line");
    assert_eq!(line["fields"]["message"], "listening");
    assert_eq!(
        line["fields"]["upstream"],
        common::BROKER.addr(),
        "--upstream overrides the file"
    );
    let addr: std::net::SocketAddr = line["fields"]["address"].as_str().unwrap().parse().unwrap();
    assert_ne!(addr.port(), 0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let conn = common::connect(&format!("amqp://guest:guest@{addr}/%2f")).await;
        assert!(conn.status().connected());
        conn.close(200, "bye".into()).await.unwrap();
    });
    common::process::wait_for_handler(child.id(), 15); // SIGTERM
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let began = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{status:?}");
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(15),
            "nackd did not exit on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Linux scheduling policy (field 41 of /proc/PID/task/TID/stat) of each
/// of `pid`'s threads, by thread name.
fn thread_policies(pid: u32) -> Vec<(String, u32)> {
    let mut threads = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = task.unwrap().path();
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
        // Fields after the parenthesised name start at field 3.
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        let policy = rest
            .split_whitespace()
            .nth(41 - 3)
            .unwrap()
            .parse()
            .unwrap();
        threads.push((name.trim().to_string(), policy));
    }
    threads
}

#[test]
fn runtime_section_sets_session_threads_and_their_scheduling() {
    common::require_broker();
    const SCHED_OTHER: u32 = 0;
    const SCHED_BATCH: u32 = 3;
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let base = format!(
        "[upstream]\naddress = \"{}\"\n[store]\npath = {:?}\n[[policy]]\nqueues = [\"cli-sched\"]\ndelays = [\"1s\"]\n",
        common::BROKER.addr(),
        store.display().to_string()
    );
    for (runtime, workers, policy) in [
        ("", 1, SCHED_OTHER),
        (
            "[runtime]\nworker_threads = 3\nscheduling = \"batch\"\n",
            3,
            SCHED_BATCH,
        ),
    ] {
        let cfg = write(&dir, "n.toml", &format!("{base}{runtime}"));
        let nackd = common::process::Process::start(&cfg);
        // A new thread names itself and runs its start hook once it runs:
        // give them a moment.
        let began = Instant::now();
        let wanted = |threads: &[(String, u32)]| {
            let sessions: Vec<u32> = threads
                .iter()
                .filter(|(name, _)| name == "nackd-worker")
                .map(|(_, p)| *p)
                .collect();
            // Tokio's blocking threads carry the same name and settings.
            sessions.len() >= workers
                && sessions.iter().all(|p| *p == policy)
                // The retry engine keeps the default policy either way.
                && threads.contains(&("nackd-retry".to_string(), SCHED_OTHER))
        };
        let mut threads = thread_policies(nackd.child.id());
        while !wanted(&threads) && began.elapsed() < Duration::from_secs(15) {
            std::thread::sleep(Duration::from_millis(20));
            threads = thread_policies(nackd.child.id());
        }
        assert!(wanted(&threads), "{runtime:?}: {threads:?}");
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let conn = common::connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr)).await;
            assert!(conn.status().connected());
            conn.close(200, "bye".into()).await.unwrap();
        });
    }
}

/// `nackd [ARGS]` with `NACKD_CONFIG` set or not, run to its end.
fn nackd(args: &[&str], env_config: Option<&std::path::Path>) -> std::process::Output {
    let mut command = Command::new(NACKD);
    command.args(args).env_remove("NACKD_CONFIG");
    if let Some(path) = env_config {
        command.env("NACKD_CONFIG", path);
    }
    command.output().unwrap()
}

/// The file a run of nackd read, from its error: each file below has a
/// syntax error, and the error names the file.
fn file_read(out: &std::process::Output) -> String {
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    let name = ["flag.toml", "env.toml"]
        .into_iter()
        .find(|name| said.contains(name));
    name.unwrap_or_else(|| panic!("no file named: {said}"))
        .to_string()
}

/// `--config` is global (before or after a subcommand), `NACKD_CONFIG`
/// stands in for it, and the flag wins over the variable.
#[test]
fn config_comes_from_the_flag_anywhere_then_nackd_config() {
    let dir = tempfile::tempdir().unwrap();
    let flag = write(&dir, "flag.toml", "[upstream\n");
    let env = write(&dir, "env.toml", "[upstream\n");
    let f = flag.to_str().unwrap();
    let cases: [(&[&str], Option<&std::path::Path>, &str); 8] = [
        (&["--config", f], None, "flag.toml"),
        (&["--config", f], Some(&env), "flag.toml"),
        (&[], Some(&env), "env.toml"),
        (&["--config", f, "admin", "list"], Some(&env), "flag.toml"),
        (&["admin", "list", "--config", f], Some(&env), "flag.toml"),
        (&["admin", "list"], Some(&env), "env.toml"),
        (&["store", "stats", "--config", f], Some(&env), "flag.toml"),
        (&["store", "stats"], Some(&env), "env.toml"),
    ];
    for (args, env_config, expected) in cases {
        let out = nackd(args, env_config);
        assert_eq!(file_read(&out), expected, "{args:?}, NACKD_CONFIG {env_config:?}");
    }
    // The error names the key and the file it is in.
    let out = nackd(&["admin", "list", "--config", f], None);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains(&format!("{f}: (syntax)")), "{said}");
    // A file that cannot be read is named too.
    let missing = dir.path().join("missing.toml");
    let out = nackd(&[], Some(&missing));
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains(&format!("cannot read {}", missing.display())),
        "{said}"
    );
}

/// Without the flag or the variable, nackd reads where the package and
/// the image put the file, whatever its working directory.
#[test]
fn the_default_config_is_the_one_in_etc() {
    let out = nackd(&["--help"], None);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("[env: NACKD_CONFIG=]") || help.contains("[env: NACKD_CONFIG]"),
        "{help}"
    );
    assert!(
        help.contains("[default: /etc/nackd/nackd.toml]"),
        "{help}"
    );
    let out = nackd(&["admin", "list", "--help"], None);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--config <CONFIG>"), "a subcommand takes it: {help}");
}

/// The commit `git` names for this checkout (12 hex digits).
fn checkout_commit() -> String {
    let out = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("git runs (the suite runs in a git checkout)");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// `nackd --version` and `nackd_build_info` name the commit the binary
/// was built from: the one this checkout is at.
#[test]
fn version_and_build_info_name_the_commit() {
    let commit = checkout_commit();
    let out = nackd(&["--version"], None);
    let version = String::from_utf8_lossy(&out.stdout);
    let expected = format!("nackd {} ({commit}", env!("CARGO_PKG_VERSION"));
    assert!(version.starts_with(&expected), "{version:?}, not {expected:?}");

    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        &dir,
        "n.toml",
        &format!("[upstream]\naddress = \"{}\"\n", common::BROKER.addr()),
    );
    let nackd = common::process::Process::start_listening(&cfg);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let scrape = rt.block_on(common::ops::get(nackd.metrics, "/metrics"));
    let info = scrape
        .body
        .lines()
        .find(|l| l.starts_with("nackd_build_info{"))
        .unwrap_or_else(|| panic!("no nackd_build_info: {}", scrape.body));
    assert!(info.contains(&format!("commit=\"{commit}")), "{info}");
}

/// `/readyz`'s word on the republish login into vhost `/`, once checked.
fn republish_login(metrics: std::net::SocketAddr) -> String {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let began = Instant::now();
    loop {
        let ready = rt.block_on(common::ops::get(metrics, "/readyz"));
        let v: serde_json::Value = serde_json::from_str(&ready.body).unwrap();
        let login = v["republish"]["/"].as_str().unwrap_or("checking").to_string();
        if login != "checking" || began.elapsed() > Duration::from_secs(15) {
            return login;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `upstream.uri` (here from a file, with a trailing newline) names the
/// broker and the login of nackd's own connections: with the broker's
/// password the republisher logs in, with another it is refused; either
/// way clients log in as themselves.
#[test]
fn a_broker_uri_from_a_file_gives_the_node_and_the_republish_login() {
    common::require_broker();
    let dir = tempfile::tempdir().unwrap();
    let q = common::unique("uri");
    for (password, login) in [("guest", "ok"), ("not-the-password", "ACCESS_REFUSED")] {
        let uri = write(
            &dir,
            "uri",
            &format!("amqp://guest:{password}@{}\n", common::BROKER.addr()),
        );
        let store = dir.path().join(format!("store-{password}"));
        let cfg = write(
            &dir,
            "n.toml",
            &format!(
                "[upstream]\nuri_file = {:?}\n[store]\npath = {:?}\n[[policy]]\nqueues = [\"{q}\"]\ndelays = [\"1s\"]\n",
                uri.display().to_string(),
                store.display().to_string()
            ),
        );
        let nackd = common::process::Process::start(&cfg);
        let said = republish_login(nackd.metrics);
        assert!(said.contains(login), "password {password}: {said}");
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let conn = common::connect(&format!("amqp://guest:guest@{}/%2f", nackd.addr)).await;
            assert!(conn.status().connected());
            conn.close(200, "bye".into()).await.unwrap();
        });
    }
}

/// `nackd config-schema` prints the JSON Schema shipped for editors
/// (deploy/nackd.schema.json), and a key the schema does not document
/// stops `--check-config` naming it.
#[test]
fn config_schema_prints_the_shipped_schema_and_an_unknown_key_is_named() {
    let out = Command::new(NACKD).arg("config-schema").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/nackd.schema.json");
    let shipped = std::fs::read_to_string(shipped).unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout) == shipped,
        "deploy/nackd.schema.json differs from `nackd config-schema`; regenerate it with\n  \
         NACKD_REGENERATE=1 cargo test -p nackd --lib config::schema"
    );

    let dir = tempfile::tempdir().unwrap();
    let typo = write(&dir, "typo.toml", "[republish]\nconfirm_windw = 10\n");
    let out = check_config(&typo);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("republish") && stderr.contains("confirm_windw"),
        "{stderr}"
    );
}

use super::*;

fn err(text: &str) -> String {
    Config::parse(text, Path::new("nackd.toml"))
        .unwrap_err()
        .to_string()
}

#[test]
fn shipped_example_parses() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/nackd.toml");
    let config = Config::load(&path).unwrap();
    assert_eq!(config.listen.address, "127.0.0.1:5673".parse().unwrap());
    assert_eq!(config.upstream.nodes(), vec!["127.0.0.1:5672".to_string()]);
    assert!(!config.policies.is_empty());
}

#[test]
fn empty_file_means_defaults() {
    let config = Config::parse("", Path::new("x")).unwrap();
    assert_eq!(config.listen.address.port(), 5673);
    assert_eq!(config.limits.handshake_timeout, Duration::from_secs(10));
    assert!(config.policies.is_empty());
    assert_eq!(config.runtime.worker_threads, 1);
}

#[test]
fn worker_threads_are_bounded() {
    let config = Config::parse("[runtime]\nworker_threads = 4\n", Path::new("x")).unwrap();
    assert_eq!(config.runtime.worker_threads, 4);
    let e = err("[runtime]\nworker_threads = 0\n");
    assert!(
        e.contains("runtime.worker_threads: must be between 1 and 1024"),
        "{e}"
    );
    let e = err("[runtime]\nworker_threads = -2\n");
    assert!(e.contains("runtime.worker_threads"), "{e}");
}

#[test]
fn scheduling_is_normal_or_batch() {
    let default = Config::parse("", Path::new("x")).unwrap();
    assert_eq!(default.runtime.scheduling, Scheduling::Normal);
    let batch = Config::parse("[runtime]\nscheduling = \"batch\"\n", Path::new("x")).unwrap();
    assert_eq!(batch.runtime.scheduling, Scheduling::Batch);
    let e = err("[runtime]\nscheduling = \"fifo\"\n");
    assert!(e.contains("runtime.scheduling"), "{e}");
}

#[test]
fn coalesce_is_a_short_pause_or_off() {
    let default = Config::parse("", Path::new("x")).unwrap();
    assert_eq!(default.runtime.coalesce, Duration::from_micros(100));
    let off = Config::parse("[runtime]\ncoalesce = \"0s\"\n", Path::new("x")).unwrap();
    assert_eq!(off.runtime.coalesce, Duration::ZERO);
    let set = Config::parse("[runtime]\ncoalesce = \"250us\"\n", Path::new("x")).unwrap();
    assert_eq!(set.runtime.coalesce, Duration::from_micros(250));
    let e = err("[runtime]\ncoalesce = \"5ms\"\n");
    assert!(e.contains("runtime.coalesce: must be at most 1ms"), "{e}");
    let e = err("[runtime]\ncoalesce = \"now\"\n");
    assert!(e.contains("runtime.coalesce"), "{e}");
}

#[test]
fn errors_name_the_key() {
    let e = err("[listen]\naddress = \"nowhere\"\n");
    assert!(e.starts_with("nackd.toml: listen.address: "), "{e}");
    let e = err("[listen]\nadress = \"127.0.0.1:1\"\n");
    assert!(e.contains("listen") && e.contains("adress"), "{e}");
    let e = err("[limits]\nhandshake_timeout = \"soon\"\n");
    assert!(e.contains("limits.handshake_timeout"), "{e}");
    let e = err("[upstream]\naddress = \"rabbit\"\n");
    assert!(e.contains("upstream.address: expected host:port"), "{e}");
    let e = err("[upstream]\naddresses = [\"a:1\", \"b\"]\n");
    assert!(
        e.contains("upstream.addresses[1]: expected host:port"),
        "{e}"
    );
    let e = err("[replica]\ninstance = \"i\"\nprevious_addresses = [\"a:1\", \"b\"]\n");
    assert!(
        e.contains("replica.previous_addresses[1]: expected host:port"),
        "{e}"
    );
    let e = err("[listen\n");
    assert!(e.contains("(syntax)"), "{e}");
}

#[test]
fn policy_errors_name_the_policy_and_key() {
    let e = err("[[policy]]\nqueues = [\"q\"]\n");
    assert!(e.contains("policy[0].delays"), "{e}");
    let e = err("[[policy]]\nqueues=[\"a\"]\ndelays=[\"1s\"]\n[[policy]]\nqueues=[\"b\"]\ndelays=[\"1s\"]\nbackoff={initial=\"1s\",max=\"2s\"}\nmax_retries=2\n");
    assert!(
        e.contains("policy[1].backoff: set delays or backoff"),
        "{e}"
    );
    let e = err("[[policy]]\nqueues=[\"a\"]\ndelays=[\"1s\"]\non_exhausted=\"drop\"\n");
    assert!(e.contains("policy[0].on_exhausted"), "{e}");
    let e = err("[[policy]]\nqueues=[\"[\"]\ndelays=[\"1s\"]\n");
    assert!(e.contains("policy[0].queues: bad pattern"), "{e}");
    let e = err("[[policy]]\nqueues=[\"a\"]\ndelays=[\"0ms\"]\n");
    assert!(e.contains("policy[0].delays"), "{e}");
}

#[test]
fn on_exhausted_forms() {
    let c = Config::parse(
        "[[policy]]\nqueues=[\"a\"]\ndelays=[\"1s\"]\non_exhausted={exchange=\"dlx\",routing_key=\"k\"}\n[[policy]]\nqueues=[\"b\"]\ndelays=[\"1s\"]\non_exhausted=\"reject\"\n",
        Path::new("x"),
    )
    .unwrap();
    assert_eq!(
        c.policies[0].on_exhausted,
        OnExhausted::DeadLetter {
            exchange: "dlx".into(),
            routing_key: Some("k".into())
        }
    );
    assert_eq!(c.policies[1].on_exhausted, OnExhausted::Reject);
}

#[test]
fn admin_token_keys_are_checked_and_named() {
    let e = err("[metrics]\nadmin_token = \"short\"\n");
    assert!(
        e.starts_with("nackd.toml: metrics.admin_token: ") && e.contains("at least 16"),
        "{e}"
    );
    let e = err("[metrics]\nadmin_token = \"0123456789abcdef\"\nadmin_token_env = \"T\"\n");
    assert!(
        e.contains("metrics.admin_token_env") && e.contains("not both"),
        "{e}"
    );
    let e = err("[metrics]\nadmin_tokn = \"0123456789abcdef\"\n");
    assert!(e.contains("metrics") && e.contains("admin_tokn"), "{e}");
    let ok = Config::parse(
        "[metrics]\nadmin_token = \"0123456789abcdef\"\n",
        Path::new("x"),
    )
    .unwrap();
    assert_eq!(
        ok.metrics.admin_token().unwrap().as_deref(),
        Some("0123456789abcdef")
    );
    let env = Config::parse(
        "[metrics]\nadmin_token_env = \"NACKD_TEST_TOKEN_UNSET_1\"\n",
        Path::new("x"),
    )
    .unwrap();
    assert_eq!(
        env.metrics.admin_token().unwrap_err(),
        "metrics.admin_token_env: NACKD_TEST_TOKEN_UNSET_1 is not set"
    );
    assert_eq!(Config::default().metrics.admin_token().unwrap(), None);
}

#[test]
fn read_token_keys_are_checked_named_and_differ_from_the_admin_token() {
    let e = err("[metrics]\nread_token = \"short\"\n");
    assert!(
        e.starts_with("nackd.toml: metrics.read_token: ") && e.contains("at least 16"),
        "{e}"
    );
    let e = err("[metrics]\nread_token = \"0123456789abcdef\"\nread_token_env = \"T\"\n");
    assert!(
        e.contains("metrics.read_token_env") && e.contains("not both"),
        "{e}"
    );
    let e =
        err("[metrics]\nadmin_token = \"0123456789abcdef\"\nread_token = \"0123456789abcdef\"\n");
    assert!(
        e.starts_with("nackd.toml: metrics.read_token: ") && e.contains("differ"),
        "{e}"
    );
    let ok = Config::parse(
        "[metrics]\nadmin_token = \"0123456789abcdef\"\nread_token = \"fedcba9876543210\"\n",
        Path::new("x"),
    )
    .unwrap();
    assert_eq!(
        ok.metrics.tokens().unwrap(),
        (
            Some("0123456789abcdef".to_string()),
            Some("fedcba9876543210".to_string())
        )
    );
}

/// A read token alone is allowed, and one from a variable is checked
/// when it is read.
#[test]
fn a_read_token_alone_or_from_a_variable() {
    // Read-only alone is allowed: the admin API lists, nothing changes.
    let read_only = Config::parse(
        "[metrics]\nread_token = \"fedcba9876543210\"\n",
        Path::new("x"),
    )
    .unwrap();
    assert_eq!(
        read_only.metrics.tokens().unwrap(),
        (None, Some("fedcba9876543210".to_string()))
    );
    // The same token through a variable is caught when it is read: any
    // variable of the test's environment whose value is a valid token.
    let (name, value) = std::env::vars()
        .find(|(n, v)| {
            n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && v.len() >= 16
                && v.chars().all(|c| c.is_ascii_graphic())
                && !v.contains(['"', '\\'])
        })
        .expect("a variable with a value of 16+ printable characters");
    let same = Config::parse(
        &format!("[metrics]\nadmin_token = {value:?}\nread_token_env = {name:?}\n"),
        Path::new("x"),
    )
    .unwrap();
    assert_eq!(
        same.metrics.tokens().unwrap_err(),
        "metrics.read_token_env: must differ from the admin token"
    );
    let env = Config::parse(
        "[metrics]\nread_token_env = \"NACKD_TEST_TOKEN_UNSET_2\"\n",
        Path::new("x"),
    )
    .unwrap();
    assert_eq!(
        env.metrics.tokens().unwrap_err(),
        "metrics.read_token_env: NACKD_TEST_TOKEN_UNSET_2 is not set"
    );
}

#[test]
fn republish_keys_have_defaults_and_are_checked_by_name() {
    let c = Config::parse("", Path::new("x")).unwrap();
    assert_eq!(c.republish.heartbeat, Duration::from_secs(10));
    assert_eq!(c.republish.confirm_window, 1000);
    assert_eq!(c.republish.max_pending_bytes, 16 * 1024 * 1024);
    assert_eq!(c.republish.queue_gone.action, GoneAction::Keep);
    assert_eq!(
        c.republish.queue_gone.probe_interval,
        Duration::from_secs(30)
    );
    let c = Config::parse(
        "[republish]\nheartbeat = \"0s\"\n[republish.queue_gone]\naction = \"dead-letter\"\nafter = \"1d\"\nexchange = \"lost\"\n",
        Path::new("x"),
    )
    .unwrap();
    assert_eq!(c.republish.heartbeat, Duration::ZERO);
    assert_eq!(c.republish.queue_gone.action, GoneAction::DeadLetter);
    for (text, key) in [
        (
            "[republish]\nheartbeat = \"1500ms\"\n",
            "republish.heartbeat",
        ),
        ("[republish]\nheartbeat = \"1d\"\n", "republish.heartbeat"),
        (
            "[republish]\nconfirm_window = 0\n",
            "republish.confirm_window",
        ),
        (
            "[republish]\nmax_pending_bytes = 1000\n",
            "republish.max_pending_bytes",
        ),
        (
            "[republish.queue_gone]\nafter = \"0s\"\n",
            "republish.queue_gone.after",
        ),
        (
            "[republish.queue_gone]\nprobe_interval = \"2h\"\n",
            "republish.queue_gone.probe_interval",
        ),
        (
            "[republish.queue_gone]\naction = \"dead-letter\"\n",
            "republish.queue_gone.exchange",
        ),
        (
            "[republish.queue_gone]\nexchange = \"x\"\n",
            "republish.queue_gone.exchange",
        ),
        (
            "[republish.queue_gone]\naction = \"forget\"\n",
            "republish.queue_gone.action",
        ),
        (
            "[republish]\npassword = \"a\"\npassword_env = \"B\"\n",
            "republish.password_env",
        ),
    ] {
        let e = err(text);
        assert!(e.contains(key), "{text:?}: {e}");
    }
}

#[test]
fn replica_keys_have_defaults_and_are_checked_by_name() {
    let config = Config::parse("[replica]\ninstance = \"a\"\n", Path::new("x")).unwrap();
    let replica = config.replica.unwrap();
    assert_eq!(replica.group, "default");
    assert_eq!(replica.adopt_after, Duration::from_secs(60));
    let e = err("[replica]\ninstance = \"a\"\ngroup = \"prod eu\"\n");
    assert!(e.contains("replica.group"), "{e}");
    let e = err("[replica]\ninstance = \"a b\"\n");
    assert!(e.contains("replica.instance"), "{e}");
    let e = err("[replica]\ninstance = \"a\"\nheartbeat = \"5s\"\nadopt_after = \"10s\"\n");
    assert!(e.contains("replica.adopt_after"), "{e}");
    assert_eq!(replica.adopt_part, 20_000);
    let e = err("[replica]\ninstance = \"a\"\nadopt_part = 32769\n");
    assert!(e.contains("replica.adopt_part"), "{e}");
    let one_step = Config::parse(
        "[replica]\ninstance = \"a\"\nadopt_part = 0\n",
        Path::new("x"),
    );
    assert_eq!(one_step.unwrap().replica.unwrap().adopt_part, 0);
}

/// Issue 20, item 5: RabbitMQ 4.1+ resets a connection that tunes a
/// `frame_max` below 8192, and nackd hands `limits.max_frame` to clients
/// when the broker proposes more: a smaller one stops startup, naming it.
#[test]
fn a_max_frame_below_what_rabbitmq_4_1_accepts_is_refused() {
    let e = err("[limits]\nmax_frame = 4096\n");
    assert!(e.contains("limits.max_frame") && e.contains("8192"), "{e}");
    assert!(Config::parse("[limits]\nmax_frame = 8192\n", Path::new("x")).is_ok());
}

#[test]
fn delayed_keys_have_defaults() {
    let config = Config::parse("", Path::new("x")).unwrap();
    assert!(!config.delayed_enabled(), "off without a table");
    assert!(!config.intercepting());
    let config = Config::parse("[delayed]\n", Path::new("x")).unwrap();
    assert!(config.delayed_enabled() && config.intercepting());
    assert_eq!(config.delayed_settings(), Delayed::default());
    assert_eq!(config.delayed_settings().unroutable, Unroutable::Keep);
    let text = "[delayed]\nunroutable = \"alternate\"\nalternate_exchange = \"lost\"\n";
    let d = Config::parse(text, Path::new("x"))
        .unwrap()
        .delayed_settings();
    assert_eq!(d.unroutable, Unroutable::Alternate);
    assert_eq!(d.alternate_exchange.as_deref(), Some("lost"));
    let d = Config::parse("[delayed]\nunroutable = \"drop\"\n", Path::new("x")).unwrap();
    assert_eq!(d.delayed_settings().unroutable, Unroutable::Drop);
}

#[test]
fn delayed_exchange_tables_start_interception_unless_disabled() {
    let text = "[[delayed_exchange]]\nname = \"d\"\n\n[[delayed_exchange]]\nvhost = \"v\"\nname = \"d\"\ntype = \"topic\"\n";
    let config = Config::parse(text, Path::new("x")).unwrap();
    assert!(config.delayed_enabled() && config.intercepting());
    assert_eq!(
        config.delayed_exchanges,
        vec![
            DelayedExchange {
                vhost: "/".into(),
                name: "d".into(),
                kind: "direct".into()
            },
            DelayedExchange {
                vhost: "v".into(),
                name: "d".into(),
                kind: "topic".into()
            },
        ]
    );
    let off = format!("[delayed]\nenabled = false\n\n{text}");
    let config = Config::parse(&off, Path::new("x")).unwrap();
    assert!(!config.delayed_enabled() && !config.intercepting());
}

#[test]
fn delayed_errors_name_the_key() {
    assert!(err("[delayed]\nunroutable = \"alternate\"\n")
        .contains("delayed.alternate_exchange: required with unroutable = \"alternate\""));
    assert!(err("[delayed]\nalternate_exchange = \"x\"\n")
        .contains("delayed.alternate_exchange: only used with"));
    assert!(
        err("[delayed]\nunroutable = \"alternate\"\nalternate_exchange = \"\"\n")
            .contains("delayed.alternate_exchange: must name an exchange")
    );
    assert!(err("[delayed]\nunroutable = \"bounce\"\n").contains("delayed.unroutable"));
    assert!(err("[delayed]\nenabled = 1\n").contains("delayed.enabled"));
    assert!(err("[delayed]\nwhat = 1\n").contains("delayed"));
    assert!(err("[[delayed_exchange]]\nvhost = \"/\"\n").contains("delayed_exchange[0]"));
    assert!(err("[[delayed_exchange]]\nname = \"\"\n").contains("delayed_exchange[0].name"));
    assert!(err("[[delayed_exchange]]\nname = \"d\"\ntype = \"\"\n")
        .contains("delayed_exchange[0].type: must not be empty"));
    assert!(
        err("[[delayed_exchange]]\nname = \"d\"\ntype = \"x-delayed-message\"\n")
            .contains("delayed_exchange[0].type")
    );
    let twice = "[[delayed_exchange]]\nname = \"d\"\n[[delayed_exchange]]\nname = \"d\"\n";
    assert!(err(twice)
        .contains("delayed_exchange[1].name: exchange \"d\" of vhost \"/\" is listed twice"));
}

/// `*_file` secrets: one source per secret (a second one is refused,
/// naming both keys), the file read when the secret is, its trailing
/// newline dropped, an unreadable or empty file named with its key.
#[test]
// Whole because: the later cases reuse the files (and their changes) of
// the earlier ones.
#[allow(clippy::too_many_lines)]
fn secrets_come_from_one_of_inline_env_and_file() {
    for (text, keys) in [
        (
            "[republish]\npassword = \"a\"\npassword_file = \"/p\"\n",
            ["republish.password", "republish.password_file"],
        ),
        (
            "[republish]\npassword_env = \"A\"\npassword_file = \"/p\"\n",
            ["republish.password_env", "republish.password_file"],
        ),
        (
            "[metrics]\nadmin_token_file = \"/t\"\nadmin_token = \"0123456789abcdef\"\n",
            ["metrics.admin_token", "metrics.admin_token_file"],
        ),
        (
            "[metrics]\nread_token_env = \"R\"\nread_token_file = \"/t\"\n",
            ["metrics.read_token_env", "metrics.read_token_file"],
        ),
    ] {
        let e = err(text);
        assert!(
            e.contains(&format!(
                "{}: set {} or {}, not both",
                keys[1], keys[0], keys[1]
            )),
            "{text:?}: {e}"
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let password = file("password", "s3cret\n");
    let admin = file("admin", "0123456789abcdef\r\n");
    let read = file("read", "fedcba9876543210");
    let text = format!(
        "[republish]\npassword_file = {password:?}\n[metrics]\nadmin_token_file = {admin:?}\nread_token_file = {read:?}\n"
    );
    let config = Config::parse(&text, Path::new("x")).unwrap();
    assert_eq!(config.republish.password().unwrap(), "s3cret");
    assert_eq!(
        config.metrics.tokens().unwrap(),
        (
            Some("0123456789abcdef".to_string()),
            Some("fedcba9876543210".to_string())
        )
    );
    // Read when used: a file changed since is read anew.
    std::fs::write(&password, "n3w\n\n").unwrap();
    assert_eq!(config.republish.password().unwrap(), "n3w");

    let missing = dir.path().join("missing");
    let text = format!("[republish]\npassword_file = {missing:?}\n");
    let config = Config::parse(&text, Path::new("x")).unwrap();
    let e = config.republish.password().unwrap_err();
    assert!(
        e.starts_with(&format!(
            "republish.password_file: cannot read {}: ",
            missing.display()
        )),
        "{e}"
    );
    let empty = file("empty", "\n");
    let text = format!("[republish]\npassword_file = {empty:?}\n");
    let config = Config::parse(&text, Path::new("x")).unwrap();
    assert_eq!(
        config.republish.password().unwrap_err(),
        format!("republish.password_file: {} is empty", empty.display())
    );
    // A token from a file is checked like an inline one, and named.
    let short = file("short", "short\n");
    let text = format!("[metrics]\nadmin_token_file = {short:?}\n");
    let config = Config::parse(&text, Path::new("x")).unwrap();
    let e = config.metrics.admin_token().unwrap_err();
    assert!(
        e.starts_with("metrics.admin_token_file: a token must be at least 16"),
        "{e}"
    );
    // Not a regular file, or far too large for a secret: refused, not
    // read (a FIFO would hang startup, /dev/zero fill the memory).
    let fifo = dir.path().join("fifo");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let huge = file("huge", &"x".repeat(64 * 1024 + 1));
    for (path, why) in [
        (fifo.as_path(), "is not a regular file".to_string()),
        (Path::new("/dev/zero"), "is not a regular file".to_string()),
        (huge.as_path(), "is larger than 65536 bytes".to_string()),
    ] {
        let text = format!("[republish]\npassword_file = {path:?}\n");
        let config = Config::parse(&text, Path::new("x")).unwrap();
        let e = config.republish.password().unwrap_err();
        assert_eq!(
            e,
            format!("republish.password_file: {} {why}", path.display())
                + if why.starts_with("is larger") {
                    ": not a secret"
                } else {
                    ""
                },
        );
    }
    // A symbolic link to a file is followed (Kubernetes mounts secrets so).
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&password, &link).unwrap();
    let text = format!("[republish]\npassword_file = {link:?}\n");
    let config = Config::parse(&text, Path::new("x")).unwrap();
    assert_eq!(config.republish.password().unwrap(), "n3w");

    let same = format!("[metrics]\nadmin_token_file = {admin:?}\nread_token_file = {admin:?}\n");
    let config = Config::parse(&same, Path::new("x")).unwrap();
    assert_eq!(
        config.metrics.tokens().unwrap_err(),
        "metrics.read_token_file: must differ from the admin token"
    );
}

fn uri(text: &str) -> Result<BrokerUri, String> {
    text.parse()
}

/// `upstream.uri`: host, port and scheme; the login percent-decoded; an
/// IP address kept as written; no vhost, no query.
#[test]
fn a_broker_uri_names_one_node_its_tls_and_a_login() {
    assert_eq!(
        uri("amqps://nackd:p%40ss%2Fw%3Ard@rabbit.internal:5671").unwrap(),
        BrokerUri {
            node: "rabbit.internal:5671".into(),
            tls: true,
            username: Some("nackd".into()),
            password: Some("p@ss/w:rd".into()),
        }
    );
    assert_eq!(
        uri("amqp://10.1.2.3/").unwrap(),
        BrokerUri {
            node: "10.1.2.3:5672".into(),
            tls: false,
            username: None,
            password: None,
        }
    );
    assert_eq!(uri("amqps://[::1]/%2f").unwrap().node, "[::1]:5671");
    assert_eq!(
        uri("amqp://u%20x@h:1").unwrap().username.as_deref(),
        Some("u x")
    );
    for (text, why) in [
        ("http://h", "scheme"),
        ("amqp://h/shop", "vhost \"shop\""),
        ("amqp://h?heartbeat=5", "query parameters"),
        ("amqp://:secret@h", "a password without a user"),
        ("rabbit:5672", "scheme"),
        ("amqp:///", "host"),
        ("amqp://h:0", "port 0"),
    ] {
        let e = uri(text).unwrap_err();
        assert!(e.contains(why), "{text}: {e}");
    }
}

/// The URI takes the place of `address`/`addresses` and of the login it
/// carries; setting both is refused naming the key, and nothing in an
/// error repeats the password.
#[test]
// Whole because: the later cases reuse the temporary directory and the
// file of the earlier ones.
#[allow(clippy::too_many_lines)]
fn a_broker_uri_replaces_the_address_and_the_login_it_carries() {
    let config = Config::parse(
        "[upstream]\nuri = \"amqps://nackd:s3cret@rabbit:5671\"\n",
        Path::new("x"),
    )
    .unwrap()
    .with_uri()
    .unwrap();
    assert_eq!(config.upstream.nodes(), ["rabbit:5671"]);
    assert!(config.upstream.tls.as_ref().is_some_and(|t| t.ca.is_none()));
    assert_eq!(config.republish.username(), "nackd");
    assert_eq!(config.republish.password().unwrap(), "s3cret");

    // The user in the URI, its password from a file.
    let dir = tempfile::tempdir().unwrap();
    let password = dir.path().join("password");
    std::fs::write(&password, "fr0m-file\n").unwrap();
    let text = format!(
        "[upstream]\nuri = \"amqp://nackd@rabbit\"\n[republish]\npassword_file = {password:?}\n"
    );
    let config = Config::parse(&text, Path::new("x"))
        .unwrap()
        .with_uri()
        .unwrap();
    assert_eq!(config.upstream.nodes(), ["rabbit:5672"]);
    assert!(config.upstream.tls.is_none());
    assert_eq!(config.republish.username(), "nackd");
    assert_eq!(config.republish.password().unwrap(), "fr0m-file");

    for (text, key, why) in [
        (
            "uri = \"amqp://h\"\naddress = \"h:5672\"\n",
            "upstream.address",
            "set upstream.uri or upstream.address, not both",
        ),
        (
            "uri = \"amqp://h\"\naddresses = [\"h:5672\"]\n",
            "upstream.addresses",
            "not both",
        ),
        (
            "uri = \"amqp://h\"\nuri_file = \"/u\"\n",
            "upstream.uri_file",
            "set upstream.uri or upstream.uri_file, not both",
        ),
        (
            "uri = \"amqp://h\"\ntls = { ca = \"ca.pem\" }\n",
            "upstream.tls",
            "amqps://",
        ),
        (
            "uri = \"amqp://u:secret@h\"\n[republish]\nusername = \"v\"\n",
            "republish.username",
            "in upstream.uri",
        ),
        (
            "uri = \"amqp://u:secret@h\"\n[republish]\npassword_env = \"P\"\n",
            "republish.password_env",
            "in upstream.uri",
        ),
        ("uri = \"amqp://u:secret@h/vh\"\n", "upstream.uri", "vhost"),
        // A user with no password anywhere would log in with the default
        // ("guest") password, unseen.
        (
            "uri = \"amqp://u@h\"\n",
            "upstream.uri",
            "a user without a password",
        ),
        (
            "uri = \"amqp://u:@h\"\n",
            "upstream.uri",
            "a user without a password",
        ),
    ] {
        let e = err(&format!("[upstream]\n{text}"));
        assert!(
            e.contains(&format!("{key}: ")) && e.contains(why),
            "{text:?}: {e}"
        );
        assert!(!e.contains("secret"), "{e}");
    }
    // A URI that is not one is refused without being repeated.
    let e = err("[upstream]\nuri = \"amqp:secret\"\n");
    assert!(e.contains("upstream.uri: ") && !e.contains("secret"), "{e}");

    // From a variable or a file: checked when read, naming that key.
    let file = dir.path().join("uri");
    std::fs::write(&file, "amqps://u:secret@rabbit/shop\n").unwrap();
    let text = format!("[upstream]\nuri_file = {file:?}\n");
    let e = Config::parse(&text, Path::new("x"))
        .unwrap()
        .with_uri()
        .unwrap_err();
    assert!(e.starts_with("upstream.uri_file: vhost \"shop\""), "{e}");
    std::fs::write(&file, "amqps://u:secret@rabbit\n").unwrap();
    let text = format!("[upstream]\nuri_file = {file:?}\n[republish]\npassword = \"x\"\n");
    let e = Config::parse(&text, Path::new("x"))
        .unwrap()
        .with_uri()
        .unwrap_err();
    assert!(
        e.starts_with("republish.password: the password is in upstream.uri_file"),
        "{e}"
    );
    std::fs::remove_file(&file).unwrap();
    let text = format!("[upstream]\nuri_file = {file:?}\n");
    let e = Config::parse(&text, Path::new("x"))
        .unwrap()
        .with_uri()
        .unwrap_err();
    assert!(
        e.starts_with(&format!(
            "upstream.uri_file: cannot read {}",
            file.display()
        )),
        "{e}"
    );
}

#[test]
fn an_on_exhausted_table_refuses_an_unknown_key_by_name() {
    let e = err(
        "[[policy]]\nqueues = [\"q\"]\ndelays = [\"1s\"]\non_exhausted = { exchange = \"x\", routng_key = \"y\" }\n",
    );
    assert!(
        e.contains("policy[0].on_exhausted") && e.contains("unknown field `routng_key`"),
        "{e}"
    );
    let e = err("[[policy]]\nqueues = [\"q\"]\ndelays = [\"1s\"]\non_exhausted = \"drop\"\n");
    assert!(
        e.contains("policy[0].on_exhausted") && e.contains("expected \"reject\""),
        "{e}"
    );
}

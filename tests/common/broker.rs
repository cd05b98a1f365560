//! Which RabbitMQ the integration tests run against: the machine's 3.10 on
//! 127.0.0.1:5672 by default, another one with `NACKD_TEST_BROKER`:
//!
//! - `NACKD_TEST_BROKER=4.3` (or `4.0`): the node `scripts/broker4` runs
//!   (127.0.0.1:5643 / :5640), its `rabbitmqctl` called through
//!   `scripts/broker4 ctl V`, inside the node's root;
//! - `NACKD_TEST_BROKER=HOST:PORT`: any broker; tests that call
//!   `rabbitmqctl` then need `NACKD_TEST_BROKER_CTL`, the command (split on
//!   spaces) that runs it against that broker.
//!
//! The version in failure messages is what the broker itself says in
//! `connection.start`, so a run can never be mistaken for another broker's.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

use amq_protocol::protocol::{connection, AMQPClass};
use amq_protocol::types::AMQPValue;
use bytes::BytesMut;
use nackd_core::protocol::frame::{FrameDecoder, FrameType, PROTOCOL_HEADER};
use nackd_core::protocol::method;

/// The broker under test. Formats as its address (`"{BROKER}"` in a
/// config); [`Broker::label`] says which broker it is.
pub struct Broker;

pub static BROKER: Broker = Broker;

struct Target {
    addr: String,
    /// The release asked for by name (`4.3`), checked against the broker.
    release: Option<&'static str>,
    /// How `NACKD_TEST_BROKER` chose it, for messages.
    chosen: String,
    /// The command that runs rabbitmqctl against it, when known.
    ctl: Option<Vec<String>>,
}

/// What names the broker under test: the test binary itself when it was
/// built for one (`it43` and `alone43` run against 4.3, `it40` against
/// 4.0: `Cargo.toml`'s `[[test]]` targets, so that one `cargo nextest run`
/// schedules the suite on every broker), else `NACKD_TEST_BROKER`.
pub fn chosen() -> String {
    let binary = env!("CARGO_CRATE_NAME");
    for (suffix, release) in [("43", "4.3"), ("40", "4.0")] {
        if binary.ends_with(suffix) {
            return release.into();
        }
    }
    std::env::var("NACKD_TEST_BROKER").unwrap_or_default()
}

fn target() -> &'static Target {
    static TARGET: OnceLock<Target> = OnceLock::new();
    TARGET.get_or_init(|| {
        let var = chosen();
        let custom_ctl = std::env::var("NACKD_TEST_BROKER_CTL")
            .ok()
            .filter(|c| !c.trim().is_empty())
            .map(|c| c.split_whitespace().map(String::from).collect());
        let broker4 = |v: &'static str, port: u16| Target {
            addr: format!("127.0.0.1:{port}"),
            release: Some(v),
            chosen: format!("NACKD_TEST_BROKER={v}"),
            ctl: Some(vec![
                format!("{}/scripts/broker4", env!("CARGO_MANIFEST_DIR")),
                "ctl".into(),
                v.into(),
            ]),
        };
        match var.trim() {
            "" | "3.10" => Target {
                addr: "127.0.0.1:5672".into(),
                release: None,
                chosen: "the default broker".into(),
                ctl: custom_ctl.or_else(|| Some(vec!["rabbitmqctl".into()])),
            },
            "4.3" => broker4("4.3", 5643),
            "4.0" => broker4("4.0", 5640),
            addr if addr.contains(':') => Target {
                addr: addr.into(),
                release: None,
                chosen: format!("NACKD_TEST_BROKER={addr}"),
                ctl: custom_ctl,
            },
            other => panic!("NACKD_TEST_BROKER={other:?}: expected 3.10, 4.3, 4.0 or HOST:PORT"),
        }
    })
}

impl std::fmt::Display for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.addr())
    }
}

impl Broker {
    /// `HOST:PORT` of its AMQP listener.
    pub fn addr(&self) -> &'static str {
        &target().addr
    }

    /// The broker's own version (`connection.start`'s `version`), asked
    /// once per test binary. A broker asked for by release must be that
    /// release: a suite meant for 4.3 never passes on another broker.
    pub fn version(&self) -> &'static str {
        static VERSION: OnceLock<String> = OnceLock::new();
        VERSION.get_or_init(|| {
            let version = probe_version(self.addr()).unwrap_or_else(|e| {
                panic!("no RabbitMQ version from {}: {e}; {HINT}", self.addr())
            });
            if let Some(release) = target().release {
                assert!(
                    version.starts_with(&format!("{release}.")),
                    "{} answers as RabbitMQ {version}, not {release}",
                    target().chosen
                );
            }
            version
        })
    }

    /// `(major, minor)` of [`Broker::version`].
    pub fn release(&self) -> (u32, u32) {
        let mut parts = self.version().split('.').map(|p| p.parse().unwrap_or(0));
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
    }

    /// True from RabbitMQ `major.minor` on.
    pub fn at_least(&self, major: u32, minor: u32) -> bool {
        self.release() >= (major, minor)
    }

    /// "RabbitMQ 4.3.6 at 127.0.0.1:5643 (NACKD_TEST_BROKER=4.3)".
    pub fn label(&self) -> String {
        format!(
            "RabbitMQ {} at {} ({})",
            self.version(),
            self.addr(),
            target().chosen
        )
    }

    /// Runs `rabbitmqctl ARGS` against this broker (inside its root for a
    /// `scripts/broker4` node) and returns what it did.
    pub fn ctl(&self, args: &[&str]) -> Output {
        let cmd = target().ctl.as_ref().unwrap_or_else(|| {
            panic!(
                "this test calls rabbitmqctl, and {} has no NACKD_TEST_BROKER_CTL",
                target().chosen
            )
        });
        Command::new(&cmd[0])
            .args(&cmd[1..])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{cmd:?} {args:?} does not run: {e}"))
    }

    /// [`Broker::ctl`], panicking with its stderr unless it succeeds.
    pub fn ctl_ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert!(
            out.status.success(),
            "rabbitmqctl {args:?} on {}: {}{}",
            self.label(),
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

const HINT: &str =
    "run the test command from CONTRIBUTING.md (scripts/test), which starts the brokers";

/// Reads `connection.start` from `addr` and returns its `version`.
pub fn probe_version(addr: &str) -> Result<String, String> {
    let sock = addr
        .parse()
        .map_err(|e| format!("bad address {addr:?}: {e}"))?;
    let mut s =
        TcpStream::connect_timeout(&sock, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    s.write_all(PROTOCOL_HEADER).map_err(|e| e.to_string())?;
    let decoder = FrameDecoder::new(u32::MAX);
    let mut buf = BytesMut::new();
    let mut chunk = [0u8; 4096];
    let frame = loop {
        if let Some(frame) = decoder.decode(&mut buf).map_err(|e| format!("{e:?}"))? {
            break frame;
        }
        let n = s.read(&mut chunk).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("closed before connection.start".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    if frame.kind != FrameType::Method {
        return Err(format!("first frame is {:?}, not a method", frame.kind));
    }
    match method::decode_any(&frame.payload()).map_err(|e| format!("{e:?}"))? {
        AMQPClass::Connection(connection::AMQPMethod::Start(start)) => {
            match start.server_properties.inner().get("version") {
                Some(AMQPValue::LongString(v)) => {
                    Ok(String::from_utf8_lossy(v.as_bytes()).into_owned())
                }
                other => Err(format!("connection.start has version {other:?}")),
            }
        }
        other => Err(format!("expected connection.start, got {other:?}")),
    }
}

/// Fails loudly when the broker is not there (tests never skip) or is not
/// the release asked for. From then on, a failing test names the broker it
/// ran against.
pub fn require_broker() {
    let addr = BROKER.addr();
    if TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(2)).is_err() {
        panic!(
            "RabbitMQ is not reachable on {addr} ({}): {HINT}",
            target().chosen
        );
    }
    BROKER.version();
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let label = BROKER.label();
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            eprintln!("(this test ran against {label})");
            default(info);
        }));
    });
}

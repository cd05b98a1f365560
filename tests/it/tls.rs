//! TLS on both sides. Chain under test, all real:
//! lapin --amqps--> nackd A --amqps--> nackd B --tcp--> RabbitMQ.
//! nackd A's upstream TLS client is checked against nackd B's TLS listener
//! (RabbitMQ on this machine has no TLS listener configured).

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::*;
use lapin::options::*;
use lapin::tcp::OwnedTLSConfig;
use lapin::BasicProperties;
use nackd::config::Config;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};

struct Pki {
    dir: tempfile::TempDir,
    ca_pem: String,
}

/// A throwaway CA and a server certificate for localhost / 127.0.0.1.
fn pki() -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &issuer)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.path().join("server.pem"), leaf.pem()).unwrap();
    std::fs::write(dir.path().join("server.key"), leaf_key.serialize_pem()).unwrap();
    Pki {
        dir,
        ca_pem: ca.pem(),
    }
}

fn config(text: &str) -> Config {
    Config::parse(text, Path::new("tls.toml")).unwrap()
}

#[tokio::test]
async fn amqps_client_to_nackd_and_nackd_to_a_tls_upstream() {
    init_logs();
    require_broker();
    let pki = pki();
    let d = pki.dir.path().display();
    // B: TLS listener, plain upstream to RabbitMQ.
    let b = start_with(config(&format!(
        "[listen]\naddress=\"127.0.0.1:0\"\ntls={{cert=\"{d}/server.pem\",key=\"{d}/server.key\"}}\n[upstream]\naddress=\"{BROKER}\"\n"
    )))
    .await;
    // A: TLS listener, TLS upstream to B, verified against the test CA.
    let a = start_with(config(&format!(
        "[listen]\naddress=\"127.0.0.1:0\"\ntls={{cert=\"{d}/server.pem\",key=\"{d}/server.key\"}}\n[upstream]\naddress=\"{}\"\ntls={{ca=\"{d}/ca.pem\",server_name=\"localhost\"}}\n",
        b.addr
    )))
    .await;
    let conn = lapin::DefaultConnectionBuilder::new()
        .unwrap()
        .with_uri_str(format!(
            "amqps://guest:guest@localhost:{}/%2f",
            a.addr.port()
        ))
        .with_tls_config(OwnedTLSConfig {
            identity: None,
            cert_chain: Some(pki.ca_pem.clone()),
        })
        .connect()
        .await
        .expect("amqps through two nackds");
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let q = unique("tls");
    crate::common::declare_exclusive(&ch, &q).await;
    let body = vec![42u8; 300_000]; // several TLS records and AMQP frames
    let confirm = ch
        .basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            &body,
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack());
    let got = ch
        .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .unwrap();
    assert!(got.delivery.data == body);
    ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn upstream_tls_refuses_a_certificate_it_cannot_verify() {
    init_logs();
    require_broker();
    let trusted = pki();
    let other = pki(); // B presents a certificate from a CA A does not trust
    let (t, o) = (trusted.dir.path().display(), other.dir.path().display());
    let b = start_with(config(&format!(
        "[listen]\naddress=\"127.0.0.1:0\"\ntls={{cert=\"{o}/server.pem\",key=\"{o}/server.key\"}}\n[upstream]\naddress=\"{BROKER}\"\n"
    )))
    .await;
    let a = start_with(config(&format!(
        "[listen]\naddress=\"127.0.0.1:0\"\n[upstream]\naddress=\"{}\"\ntls={{ca=\"{t}/ca.pem\",server_name=\"localhost\"}}\n",
        b.addr
    )))
    .await;
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        lapin::Connection::connect(&a.uri(""), lapin::ConnectionProperties::default()),
    )
    .await
    .expect("fails fast");
    assert!(
        result.is_err(),
        "a client must not get through an unverified upstream"
    );
}

#[tokio::test]
async fn plain_amqp_to_a_tls_listener_does_not_get_through() {
    init_logs();
    let pki = pki();
    let d = pki.dir.path().display();
    let n = start_with(config(&format!(
        "[listen]\naddress=\"127.0.0.1:0\"\ntls={{cert=\"{d}/server.pem\",key=\"{d}/server.key\"}}\n[upstream]\naddress=\"{BROKER}\"\n"
    )))
    .await;
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        lapin::Connection::connect(&n.uri(""), lapin::ConnectionProperties::default()),
    )
    .await
    .expect("fails fast");
    assert!(result.is_err());
}

/// nackd's lapin connections (the replica's, replay's) reach a TLS broker
/// through the screen (`src/screen.rs`), which speaks TLS to the node
/// verified against `tls_ca` and plain AMQP to lapin on loopback: a
/// stream declared, written and read back over amqps (here nackd's TLS
/// listener in front of RabbitMQ stands for the TLS broker); a CA that did
/// not sign the node's certificate gets nothing through.
#[tokio::test]
async fn the_screen_speaks_tls_to_the_broker() {
    use nackd::replica::client::Client;
    use nackd::replica::{Record, Target};
    init_logs();
    require_broker();
    let keys = pki();
    let d = keys.dir.path().display();
    let b = start_with(config(&format!(
        "[listen]\naddress=\"127.0.0.1:0\"\ntls={{cert=\"{d}/server.pem\",key=\"{d}/server.key\"}}\n[upstream]\naddress=\"{BROKER}\"\n"
    )))
    .await;
    let trusting = |pki: &Pki| {
        let ca = pki.dir.path().join("ca.pem").display().to_string();
        let upstream = config(&format!("[upstream.tls]\nca = {ca:?}\n"));
        nackd::server::upstream_tls(&upstream).unwrap().unwrap()
    };
    let target = |tls| Target {
        nodes: vec![format!("localhost:{}", b.addr.port())],
        vhost: "/".into(),
        username: "guest".into(),
        password: "guest".into(),
        heartbeat: Duration::from_secs(5),
        cluster_size: None,
        tls: Some(tls),
    };
    let client = Client::connect(&target(trusting(&keys)), 0, "tls screen test")
        .await
        .unwrap();
    let stream = unique("tls-screen");
    client.declare_stream(&stream).await.unwrap();
    let record = Record::Done(vec![1, 2, 3]);
    client.append_confirmed(&stream, &record).await.unwrap();
    assert_eq!(client.read_all(&stream).await.unwrap(), vec![record]);
    client.delete(&stream).await.unwrap();
    client.close().await;

    let stranger = pki();
    let refused = Client::connect(&target(trusting(&stranger)), 0, "tls screen test").await;
    assert!(refused.is_err(), "a certificate the CA did not sign");
    b.stop().await;
}

/// nackd (the binary) with `[upstream] tls` without `ca`, in front of
/// `upstream`, with `SSL_CERT_FILE` set or not; its log lines go to `log`.
fn nackd_trusting_the_system(
    dir: &Path,
    upstream: std::net::SocketAddr,
    cert_file: Option<&Path>,
) -> (std::process::Child, std::net::SocketAddr, std::sync::mpsc::Receiver<String>) {
    use std::io::{BufRead, BufReader};
    let cfg = dir.join("system-roots.toml");
    std::fs::write(
        &cfg,
        format!("[upstream]\naddress = \"{upstream}\"\ntls = {{ server_name = \"localhost\" }}\n"),
    )
    .unwrap();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_nackd"));
    command
        .arg("--config")
        .arg(&cfg)
        .args(["--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
        .args(["--log-format", "json"])
        .env_remove("SSL_CERT_FILE")
        .env_remove("SSL_CERT_DIR")
        .stderr(std::process::Stdio::piped());
    if let Some(file) = cert_file {
        command.env("SSL_CERT_FILE", file);
    }
    let mut child = command.spawn().unwrap();
    let (tx, log) = std::sync::mpsc::channel();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let listening = line_with(&log, "\"listening\"")
        .expect("nackd listens (it found CA certificates to trust)");
    let line: serde_json::Value = serde_json::from_str(&listening).unwrap();
    let addr = line["fields"]["address"].as_str().unwrap().parse().unwrap();
    (child, addr, log)
}

/// The first line of `log` containing `needle` within 15 s.
fn line_with(log: &std::sync::mpsc::Receiver<String>, needle: &str) -> Option<String> {
    let until = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let left = until.checked_duration_since(std::time::Instant::now())?;
        let line = log.recv_timeout(left).ok()?;
        if line.contains(needle) {
            return Some(line);
        }
    }
}

/// `upstream.tls` without `ca` trusts the system's CA store: a broker
/// whose certificate a private CA signed is refused, the handshake error
/// naming why; with `SSL_CERT_FILE` (read by rustls-native-certs in place
/// of the OS store) naming that CA, nackd gets through.
#[tokio::test]
async fn upstream_tls_without_a_ca_trusts_the_system_store() {
    init_logs();
    require_broker();
    let pki = pki();
    let d = pki.dir.path().display();
    let b = start_with(config(&format!(
        "[listen]\naddress=\"127.0.0.1:0\"\ntls={{cert=\"{d}/server.pem\",key=\"{d}/server.key\"}}\n[upstream]\naddress=\"{BROKER}\"\n"
    )))
    .await;
    let connect = |addr: std::net::SocketAddr| async move {
        tokio::time::timeout(
            Duration::from_secs(10),
            lapin::Connection::connect(
                &format!("amqp://guest:guest@{addr}/%2f"),
                lapin::ConnectionProperties::default(),
            ),
        )
        .await
        .expect("an answer within 10 s")
    };

    let (mut child, addr, log) = nackd_trusting_the_system(pki.dir.path(), b.addr, None);
    assert!(connect(addr).await.is_err(), "the test CA is not in the OS store");
    let refused = line_with(&log, "cannot reach the broker")
        .expect("a log line for the refused connection");
    assert!(
        refused.contains("invalid peer certificate") && refused.contains("UnknownIssuer"),
        "{refused}"
    );
    let _ = child.kill();
    let _ = child.wait();

    let ca = pki.dir.path().join("ca.pem");
    let (mut child, addr, _log) = nackd_trusting_the_system(pki.dir.path(), b.addr, Some(&ca));
    let conn = connect(addr).await.expect("SSL_CERT_FILE trusts the test CA");
    let ch = conn.create_channel().await.unwrap();
    let q = unique("tls-system");
    crate::common::declare_exclusive(&ch, &q).await;
    conn.close(200, "bye".into()).await.unwrap();
    let _ = child.kill();
    let _ = child.wait();
    b.stop().await;
}

//! `runtime.coalesce` in the real binary: the wait lives in the park hook
//! of the session runtime, which only `nackd` itself installs. A stream
//! makes the idle session thread wait and still arrives whole and in
//! order; request and reply never makes it wait.

use crate::common;

use std::time::Duration;

use common::ops::scrape;
use common::process::Process;
use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;

const PAUSES: &str = "nackd_coalesce_pauses_total";

/// nackd with `coalesce` = `pause`; the tests use the longest (1 ms):
/// every gap of a busy test machine is short, so only the rule "an answer
/// is never waited for" keeps the request-and-reply half at zero.
fn nackd(dir: &std::path::Path, pause: &str) -> Process {
    let path = dir.join("nackd.toml");
    std::fs::write(
        &path,
        format!(
            "[upstream]\naddress = \"{BROKER}\"\n[store]\npath = \"{}\"\n[runtime]\ncoalesce = \"{pause}\"\n",
            dir.join("store").display()
        ),
    )
    .unwrap();
    Process::start(&path)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_is_coalesced_and_request_and_reply_never_waits() {
    let dir = tempfile::tempdir().unwrap();
    let nackd = nackd(dir.path(), "1ms");
    let url = format!("amqp://guest:guest@{}/%2f", nackd.addr);

    // Request and reply on two connections: each publish waits for its
    // confirm, the consumer (prefetch 1) acks each delivery before the
    // next is published.
    let q = unique("coalesce-sync");
    let (pub_conn, sub_conn) = (connect(&url).await, connect(&url).await);
    let publisher = pub_conn.create_channel().await.unwrap();
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_durable(&publisher, &q).await;
    let mut consumer = consume(&sub_conn.create_channel().await.unwrap(), &q, Some(1)).await;
    for i in 0..500u32 {
        assert!(publish(&publisher, &q, &i.to_be_bytes()).await.is_ack());
        let d = next(&mut consumer, Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("delivery {i} did not arrive"));
        assert_eq!(d.data, i.to_be_bytes());
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    let after_sync = scrape(nackd.metrics).await.get(PAUSES, &[]);
    assert_eq!(after_sync, 0.0, "request and reply made nackd wait");

    stream(&pub_conn, &sub_conn, 20_000).await;
    let after_stream = scrape(nackd.metrics).await.get(PAUSES, &[]);
    assert!(
        after_stream > 0.0,
        "20 000 messages streamed through nackd without one wait"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn zero_never_waits_even_for_a_stream() {
    let dir = tempfile::tempdir().unwrap();
    let nackd = nackd(dir.path(), "0s");
    let url = format!("amqp://guest:guest@{}/%2f", nackd.addr);
    let (pub_conn, sub_conn) = (connect(&url).await, connect(&url).await);
    stream(&pub_conn, &sub_conn, 20_000).await;
    let pauses = scrape(nackd.metrics).await.get(PAUSES, &[]);
    assert_eq!(pauses, 0.0, "coalesce = \"0s\" waited");
}

/// `n` messages of 1 KiB published without confirms on `pub_conn` to a
/// new queue, consumed (auto-ack) on `sub_conn`: all arrive, in order.
async fn stream(pub_conn: &lapin::Connection, sub_conn: &lapin::Connection, n: u32) {
    // A stream: publishes without confirms, an auto-ack consumer.
    let s = unique("coalesce-stream");
    let streamer = pub_conn.create_channel().await.unwrap();
    declare_durable(&streamer, &s).await;
    let reader = sub_conn.create_channel().await.unwrap();
    let mut stream = reader
        .basic_consume(
            s.as_str().into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let body = vec![7u8; 1024];
    let send = tokio::spawn(async move {
        for i in 0..n {
            let mut msg = i.to_be_bytes().to_vec();
            msg.extend_from_slice(&body);
            streamer
                .basic_publish(
                    "".into(),
                    s.as_str().into(),
                    BasicPublishOptions::default(),
                    &msg,
                    BasicProperties::default(),
                )
                .await
                .unwrap();
        }
    });
    for i in 0..n {
        let d = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .unwrap_or_else(|_| panic!("message {i} of the stream did not arrive"))
            .unwrap()
            .unwrap();
        assert_eq!(d.data[..4], i.to_be_bytes(), "in order, none lost");
        assert_eq!(d.data.len(), 4 + 1024);
    }
    send.await.unwrap();
}

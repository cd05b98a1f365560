//! The local 3-node cluster (scripts/cluster) does what nackd will need of
//! it: a stream replicated on all three nodes, written through one node and
//! read through another, also while a node is down, and a quorum queue.

use crate::common;

use std::time::{Duration, Instant};

use common::cluster::cluster;
use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, Consumer};

const MESSAGES: usize = 20;

fn queue_type(kind: &str) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString(kind.into()));
    args
}

async fn declare(ch: &Channel, q: &str, args: FieldTable) {
    ch.queue_declare(
        q.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap_or_else(|e| panic!("declare {q}: {e}"));
}

/// A stream with a replica on each node, its leader on the node declaring it.
fn stream_args() -> FieldTable {
    let mut args = queue_type("stream");
    args.insert("x-initial-cluster-size".into(), AMQPValue::LongInt(3));
    args.insert(
        "x-queue-leader-locator".into(),
        AMQPValue::LongString("client-local".into()),
    );
    args
}

fn from_first() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-stream-offset".into(),
        AMQPValue::LongString("first".into()),
    );
    args
}

/// Publishes MESSAGES bodies "0", "1", ... to `q` and waits for each confirm.
async fn publish_all(ch: &Channel, q: &str) {
    publish_range(ch, q, 0..MESSAGES).await;
}

async fn publish_range(ch: &Channel, q: &str, range: std::ops::Range<usize>) {
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for i in range {
        let confirm = publish(ch, q, i.to_string().as_bytes()).await;
        assert!(confirm.is_ack(), "message {i} to {q} was not confirmed");
    }
}

/// Reads MESSAGES deliveries of `q` through `conn` with consumer `args`
/// and checks they are "0", "1", ... in order, acking each.
async fn read_all(conn: &Connection, q: &str, args: FieldTable) {
    let (_ch, mut consumer) = consume_when_ready(conn, q, args).await;
    for i in 0..MESSAGES {
        let d = next(&mut consumer, Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("message {i} of {q} did not arrive"));
        assert_eq!(d.data, i.to_string().as_bytes());
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
}

/// A manual-ack consumer of `q`, retried on a new channel while the broker
/// refuses it: for some seconds after a node rejoins, a stream consumer on
/// that node fails until the coordinator has restarted its local replica.
async fn consume_when_ready(conn: &Connection, q: &str, args: FieldTable) -> (Channel, Consumer) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ch = conn.create_channel().await.unwrap();
        // Streams refuse a consumer without a prefetch.
        ch.basic_qos(MESSAGES as u16, BasicQosOptions::default())
            .await
            .unwrap();
        match ch
            .basic_consume(
                q.into(),
                "".into(),
                BasicConsumeOptions::default(),
                args.clone(),
            )
            .await
        {
            Ok(consumer) => return (ch, consumer),
            Err(e) if Instant::now() < deadline => {
                eprintln!("consume {q}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("consume {q}: {e}"),
        }
    }
}

#[tokio::test]
async fn a_stream_written_on_node_1_is_read_on_nodes_2_and_3() {
    let cluster = cluster();
    let _all_up = cluster.steady().await;
    let q = unique("stream");
    let (n1, n2, n3) = (
        cluster.connect(1).await,
        cluster.connect(2).await,
        cluster.connect(3).await,
    );
    let ch1 = n1.create_channel().await.unwrap();
    declare(&ch1, &q, stream_args()).await;
    publish_all(&ch1, &q).await;

    read_all(&n3, &q, from_first()).await;
    read_all(&n2, &q, from_first()).await;

    ch1.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_quorum_queue_written_on_node_1_is_read_on_node_3() {
    let cluster = cluster();
    let _all_up = cluster.steady().await;
    let q = unique("quorum");
    let (n1, n3) = (cluster.connect(1).await, cluster.connect(3).await);
    let ch1 = n1.create_channel().await.unwrap();
    declare(&ch1, &q, queue_type("quorum")).await;
    publish_all(&ch1, &q).await;

    read_all(&n3, &q, FieldTable::default()).await;

    ch1.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
}

/// A follower that was down while the leader took more messages catches up
/// when it comes back; meanwhile the others serve the whole stream.
#[tokio::test]
async fn a_stream_outlives_a_stopped_node_and_the_node_catches_up() {
    let cluster = cluster();
    let _alone = cluster.exclusive().await;
    let q = unique("stream-failover");
    let n1 = cluster.connect(1).await;
    let ch1 = n1.create_channel().await.unwrap();
    declare(&ch1, &q, stream_args()).await;
    publish_range(&ch1, &q, 0..MESSAGES / 2).await;

    cluster.stop_node(3).await;
    publish_range(&ch1, &q, MESSAGES / 2..MESSAGES).await;
    let n2 = cluster.connect(2).await;
    read_all(&n2, &q, from_first()).await;

    cluster.start_node(3).await;
    let n3 = cluster.connect(3).await;
    read_all(&n3, &q, from_first()).await;

    ch1.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
}

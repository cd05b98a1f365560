//! nackd's connection to the cluster for its replica: streams (declare,
//! append with confirms, read to the end), the lease (an exclusive queue),
//! and probes of other instances' leases. Built on lapin: the records are
//! opaque bodies, so nothing here needs nackd's byte-exact frame writer.
//!
//! One connection carries both the lease and the stream writes: if the
//! broker drops it, the lease goes with it and no write can follow, so a
//! process that lost its lease can never append to the stream again.

use std::time::Duration;

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties, DefaultConnectionBuilder,
    PublisherConfirm,
};
use tracing::debug;

use super::record::Record;

/// Prefetch of a stream reader.
const READ_PREFETCH: u16 = 1000;
/// A stream read that gets nothing for this long has failed.
const READ_STALL: Duration = Duration::from_secs(30);

/// Why the replica cannot do something now.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The broker or the connection failed.
    #[error("{0}")]
    Amqp(#[from] lapin::Error),
    /// No node answered.
    #[error("no broker node answered: {0}")]
    Unreachable(String),
    /// The broker did not confirm a write.
    #[error("the broker nacked a replica write")]
    Nacked,
    /// A stream holds something nackd did not write.
    #[error("stream {0}: a record nackd cannot read")]
    Malformed(String),
    /// Reading a stream did not reach its end in time.
    #[error("stream {0}: read timed out")]
    Timeout(String),
}

/// How to reach the cluster.
#[derive(Clone, Debug)]
pub struct Target {
    /// `host:port` of each node, tried in turn.
    pub nodes: Vec<String>,
    /// Virtual host of the streams and the lease.
    pub vhost: String,
    /// Login.
    pub username: String,
    /// Password.
    pub password: String,
    /// Heartbeat of the connection: a dead peer is noticed after about two.
    pub heartbeat: Duration,
    /// Replicas of each stream (`x-initial-cluster-size`), or the broker's default.
    pub cluster_size: Option<u32>,
    /// PEM CA certificates of the nodes, when they speak amqps.
    pub tls_ca: Option<String>,
}

impl Target {
    fn uri(&self, node: &str) -> String {
        format!(
            "{}://{}:{}@{node}/{}?heartbeat={}&connection_timeout=5000",
            if self.tls_ca.is_some() {
                "amqps"
            } else {
                "amqp"
            },
            encode(&self.username),
            encode(&self.password),
            encode(&self.vhost),
            self.heartbeat.as_secs().max(1),
        )
    }
}

/// Percent-encodes a URI component.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            b => format!("%{b:02X}"),
        })
        .collect()
}

/// A live connection with one confirm channel for writes.
pub struct Client {
    conn: Connection,
    writes: Channel,
    /// The node it is connected to.
    pub node: String,
    cluster_size: Option<u32>,
}

impl Client {
    /// Connects to the first node that answers, starting at `start`.
    pub async fn connect(target: &Target, start: usize, name: &str) -> Result<Self, ClientError> {
        let mut errors = Vec::new();
        for i in 0..target.nodes.len() {
            let node = &target.nodes[(start + i) % target.nodes.len()];
            let props =
                ConnectionProperties::default().with_connection_name(name.to_string().into());
            let tls = OwnedTLSConfig {
                identity: None,
                cert_chain: target.tls_ca.clone(),
            };
            let connected = DefaultConnectionBuilder::new()?
                .with_uri_str(target.uri(node))
                .with_properties(props)
                .with_tls_config(tls)
                .connect()
                .await;
            match connected {
                Ok(conn) => {
                    let writes = conn.create_channel().await?;
                    writes
                        .confirm_select(ConfirmSelectOptions::default())
                        .await?;
                    return Ok(Self {
                        conn,
                        writes,
                        node: node.clone(),
                        cluster_size: target.cluster_size,
                    });
                }
                Err(e) => errors.push(format!("{node}: {e}")),
            }
        }
        Err(ClientError::Unreachable(errors.join("; ")))
    }

    /// Whether the connection is still up.
    pub fn alive(&self) -> bool {
        self.conn.status().connected() && self.writes.status().connected()
    }

    /// Declares a stream (idempotent).
    pub async fn declare_stream(&self, name: &str) -> Result<(), ClientError> {
        self.declare_stream_with(name, FieldTable::default()).await
    }

    /// Declares the registry stream: it holds instance names only, so the
    /// broker's retention may age it (7 days in small segments); live
    /// instances register again every day.
    pub async fn declare_registry(&self, name: &str) -> Result<(), ClientError> {
        let mut args = FieldTable::default();
        args.insert("x-max-age".into(), AMQPValue::LongString("7D".into()));
        args.insert(
            "x-stream-max-segment-size-bytes".into(),
            AMQPValue::LongInt(256 * 1024),
        );
        self.declare_stream_with(name, args).await
    }

    async fn declare_stream_with(
        &self,
        name: &str,
        mut args: FieldTable,
    ) -> Result<(), ClientError> {
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("stream".into()),
        );
        if let Some(n) = self.cluster_size {
            args.insert(
                "x-initial-cluster-size".into(),
                AMQPValue::LongInt(n as i32),
            );
        }
        let ch = self.conn.create_channel().await?;
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.queue_declare(name.into(), durable, args).await?;
        let _ = ch.close(200, "".into()).await;
        Ok(())
    }

    /// Whether a queue (stream) of that name exists.
    pub async fn exists(&self, name: &str) -> Result<bool, ClientError> {
        let ch = self.conn.create_channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        match ch
            .queue_declare(name.into(), passive, FieldTable::default())
            .await
        {
            Ok(_) => {
                let _ = ch.close(200, "".into()).await;
                Ok(true)
            }
            Err(e) if reply_code(&e) == Some(404) => Ok(false),
            // Someone else's exclusive queue: it exists.
            Err(e) if reply_code(&e) == Some(405) => Ok(true),
            Err(e) => Err(e.into()),
        }
    }

    /// Deletes a queue or stream (no error if it is gone).
    pub async fn delete(&self, name: &str) -> Result<(), ClientError> {
        let ch = self.conn.create_channel().await?;
        ch.queue_delete(name.into(), QueueDeleteOptions::default())
            .await?;
        let _ = ch.close(200, "".into()).await;
        Ok(())
    }

    /// Appends a record; the returned confirm resolves once the broker has
    /// it (replicated, for a stream).
    pub async fn append(
        &self,
        stream: &str,
        record: &Record,
    ) -> Result<PublisherConfirm, ClientError> {
        let properties = BasicProperties::default().with_delivery_mode(2);
        Ok(self
            .writes
            .basic_publish(
                "".into(),
                stream.into(),
                BasicPublishOptions::default(),
                &record.encode(),
                properties,
            )
            .await?)
    }

    /// Appends a record and waits for the broker's confirm.
    pub async fn append_confirmed(&self, stream: &str, record: &Record) -> Result<(), ClientError> {
        let confirm = self.append(stream, record).await?.await?;
        match confirm.is_ack() {
            true => Ok(()),
            false => Err(ClientError::Nacked),
        }
    }

    /// Reads `stream` from its first record to its current end: appends a
    /// marker, then consumes until that marker comes back.
    pub async fn read(&self, stream: &str) -> Result<StreamReader, ClientError> {
        let nonce = fastrand::u128(..);
        self.append_confirmed(stream, &Record::Marker(nonce))
            .await?;
        let ch = self.conn.create_channel().await?;
        ch.basic_qos(READ_PREFETCH, BasicQosOptions::default())
            .await?;
        let mut args = FieldTable::default();
        args.insert(
            "x-stream-offset".into(),
            AMQPValue::LongString("first".into()),
        );
        let consumer = ch
            .basic_consume(
                stream.into(),
                "".into(),
                BasicConsumeOptions::default(),
                args,
            )
            .await?;
        Ok(StreamReader {
            stream: stream.to_string(),
            nonce,
            consumer,
            ch,
            count: 0,
            queued: Default::default(),
        })
    }

    /// Every record of `stream` up to its current end.
    pub async fn read_all(&self, stream: &str) -> Result<Vec<Record>, ClientError> {
        let mut reader = self.read(stream).await?;
        let mut all = Vec::new();
        while let Some(record) = reader.next().await? {
            all.push(record);
        }
        Ok(all)
    }

    /// Tries to take a lease: declares the exclusive queue `name` on this
    /// connection. `false` if another connection holds it.
    pub async fn try_lease(&self, name: &str) -> Result<bool, ClientError> {
        let ch = self.conn.create_channel().await?;
        let exclusive = QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        };
        match ch
            .queue_declare(name.into(), exclusive, FieldTable::default())
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if reply_code(&e) == Some(405) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// One round trip to the broker on this connection: the lease is
    /// still held if it answers (a passive declare of the lease queue).
    pub async fn probe(&self, lease: &str, within: Duration) -> bool {
        let ask = async {
            let ch = self.conn.create_channel().await?;
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            ch.queue_declare(lease.into(), passive, FieldTable::default())
                .await?;
            let _ = ch.close(200, "".into()).await;
            Ok::<_, lapin::Error>(())
        };
        matches!(tokio::time::timeout(within, ask).await, Ok(Ok(())))
    }

    /// Closes the connection (the lease goes with it).
    pub async fn close(&self) {
        let _ = self.conn.close(200, "nackd: replica closing".into()).await;
    }
}

/// Reads a stream up to the marker its [`Client::read`] appended.
pub struct StreamReader {
    stream: String,
    nonce: u128,
    consumer: lapin::Consumer,
    ch: Channel,
    count: u64,
    /// Records of a batch message not returned yet.
    queued: std::collections::VecDeque<Record>,
}

impl StreamReader {
    /// The next record, `None` at the marker (the end as of the read's start).
    pub async fn next(&mut self) -> Result<Option<Record>, ClientError> {
        loop {
            if let Some(record) = self.queued.pop_front() {
                return Ok(Some(record));
            }
            let next = tokio::time::timeout(READ_STALL, self.consumer.next()).await;
            let delivery = match next {
                Err(_) | Ok(None) => return Err(ClientError::Timeout(self.stream.clone())),
                Ok(Some(delivery)) => delivery?,
            };
            self.count += 1;
            if self.count.is_multiple_of(u64::from(READ_PREFETCH / 2)) {
                delivery.ack(BasicAckOptions { multiple: true }).await?;
            }
            match Record::decode(&delivery.data) {
                Ok(Record::Marker(n)) if n == self.nonce => {
                    let _ = self.ch.close(200, "".into()).await;
                    debug!(
                        stream = self.stream,
                        records = self.count,
                        "stream read to its end"
                    );
                    return Ok(None);
                }
                Ok(Record::Marker(_)) => {}
                Ok(record) => self.queued.extend(record.flatten()),
                Err(_) => return Err(ClientError::Malformed(self.stream.clone())),
            }
        }
    }
}

/// The AMQP reply code of a channel or connection error, if it is one.
fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_encode_their_parts() {
        let target = Target {
            nodes: vec!["127.0.0.1:5681".into()],
            vhost: "/".into(),
            username: "gu est".into(),
            password: "p@ss:w/rd".into(),
            heartbeat: Duration::from_secs(5),
            cluster_size: None,
            tls_ca: None,
        };
        assert_eq!(
            target.uri("127.0.0.1:5681"),
            "amqp://gu%20est:p%40ss%3Aw%2Frd@127.0.0.1:5681/%2F?heartbeat=5&connection_timeout=5000"
        );
    }
}

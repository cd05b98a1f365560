//! nackd's connection to the cluster for its replica: streams (declare,
//! append with confirms, read to the end), the exclusive queues the lease
//! is made of ([`super::lease`]), and probes of other instances' leases.
//! Built on lapin: the records are opaque bodies, so nothing here needs
//! nackd's byte-exact frame writer.
//!
//! The stream writes go over a connection of their own, not over the
//! lease's: a node that freezes or dies costs the writes a reconnection to
//! another node, and the lease nothing. A process that lost its lease
//! writes nothing more: every append waits for the fence
//! ([`super::fence`]), as every republish does.
//!
//! Every write is `mandatory`: a stream that was deleted routes nothing, and
//! the broker would confirm a write that went nowhere. A returned write is
//! [`ClientError::Returned`], never a success. The broker sends the return
//! just before the confirm of its message, but lapin hands it to whichever
//! confirm of that ack frame it completes first; so each write carries its
//! number as `message_id`, confirms are settled in publish order, and a
//! write is returned when its own number came back.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties, DefaultConnectionBuilder,
    PublisherConfirm,
};
use tokio::sync::{mpsc, oneshot};
use tracing::debug;

use super::record::Record;

/// Prefetch of a stream reader.
const READ_PREFETCH: u16 = 1000;
/// Prefetch of a stream follower ([`Client::follow`]): its records are
/// small, and a message someone else wrote may be large.
const FOLLOW_PREFETCH: u16 = 64;
/// The largest message a follower decodes (three names of at most 255
/// bytes make a record of under 800): a larger one is [`Followed::Unreadable`].
const FOLLOW_MAX_BODY: usize = 4096;
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
    /// The broker returned a write: the stream it names does not exist
    /// (deleted by someone).
    #[error("stream {0} does not exist: the broker returned the write")]
    Returned(String),
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
    /// TLS settings ([`crate::net::client_config`]), when the nodes speak amqps.
    pub tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

impl Target {
    /// How long a node may take to answer a connection or a probe before
    /// it counts as gone for now: a heartbeat, at least a second.
    pub fn answer_within(&self) -> Duration {
        self.heartbeat.max(Duration::from_secs(1))
    }

    /// The AMQP URI lapin connects to: the loopback port of a screen
    /// ([`crate::screen::open`]) in front of one node, with this target's
    /// login and vhost. Plain AMQP: the screen speaks TLS to the node.
    pub(crate) fn uri(&self, screen: &str) -> String {
        format!(
            "amqp://{}:{}@{screen}/{}?heartbeat={}&connection_timeout=5000",
            encode(&self.username),
            encode(&self.password),
            encode(&self.vhost),
            self.heartbeat.as_secs().max(1),
        )
    }

    /// A connection to `node` through a screen of its own, named `name`,
    /// within [`Target::answer_within`] or `within`.
    pub(crate) async fn connect(
        &self,
        node: &str,
        name: &str,
        what: &'static str,
        within: Duration,
    ) -> Result<Connection, String> {
        let connecting = async {
            let screen = crate::screen::open(node, self.tls.as_ref(), within, what)
                .await
                .map_err(|e| e.to_string())?;
            let props =
                ConnectionProperties::default().with_connection_name(name.to_string().into());
            DefaultConnectionBuilder::new()
                .map_err(|e| e.to_string())?
                .with_uri_str(self.uri(&screen.to_string()))
                .with_properties(props)
                .connect()
                .await
                .map_err(|e| e.to_string())
        };
        match tokio::time::timeout(within, connecting).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => Err(format!("{node}: {e}")),
            Err(_) => Err(format!("{node}: no answer within {within:?}")),
        }
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

/// What a [`Client::probe`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The broker answered; the stream asked about exists.
    Alive,
    /// The broker answered; the stream asked about does not exist.
    Missing,
    /// No answer in time.
    Silent,
}

/// What [`Client::holds`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    Yes,
    Gone,
    Unanswered,
}

/// A live connection with one confirm channel for writes.
pub struct Client {
    conn: Connection,
    writes: Channel,
    /// The node it is connected to.
    pub node: String,
    cluster_size: Option<u32>,
    /// How long a write may wait to be sent (a frozen node takes it and
    /// never reads it).
    answer_within: Duration,
    /// Number of the next write (its `message_id`).
    next: AtomicU64,
    /// Publishes and hands over the confirm as one step, so that the
    /// settler sees confirms in delivery-tag order.
    publishing: tokio::sync::Mutex<mpsc::UnboundedSender<Sent>>,
}

/// A write waiting for the broker, in publish order.
struct Sent {
    number: u64,
    stream: String,
    confirm: PublisherConfirm,
    reply: oneshot::Sender<Result<(), ClientError>>,
}

/// The broker's answer to one write, once it came.
pub struct Confirm(oneshot::Receiver<Result<(), ClientError>>);

impl Confirm {
    /// Waits for the answer: `Ok` once the stream has the record
    /// (replicated), else why not.
    pub async fn wait(self) -> Result<(), ClientError> {
        self.0.await.unwrap_or_else(|_| {
            Err(ClientError::Unreachable(
                "the replica connection is gone".into(),
            ))
        })
    }
}

impl Client {
    /// Connects to the first node that answers, starting at `start`.
    pub async fn connect(target: &Target, start: usize, name: &str) -> Result<Self, ClientError> {
        let mut errors = Vec::new();
        for i in 0..target.nodes.len() {
            let node = (start + i) % target.nodes.len();
            match Self::connect_node(target, node, name).await {
                Ok(client) => return Ok(client),
                Err(ClientError::Unreachable(why)) => errors.push(why),
                Err(e) => errors.push(e.to_string()),
            }
        }
        Err(ClientError::Unreachable(errors.join("; ")))
    }

    /// Connects to node `index` of the target only, within
    /// [`Target::answer_within`]: a frozen node accepts the TCP connection
    /// and then says nothing.
    pub async fn connect_node(
        target: &Target,
        index: usize,
        name: &str,
    ) -> Result<Self, ClientError> {
        let node = &target.nodes[index];
        let within = target.answer_within();
        let connecting = async {
            let conn = target
                .connect(node, name, "replica", within)
                .await
                .map_err(ClientError::Unreachable)?;
            let writes = conn.create_channel().await?;
            writes
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, ClientError>((conn, writes))
        };
        let (conn, writes) = match tokio::time::timeout(within, connecting).await {
            Ok(Ok(connected)) => connected,
            Ok(Err(ClientError::Unreachable(why))) => return Err(ClientError::Unreachable(why)),
            Ok(Err(e)) => return Err(ClientError::Unreachable(format!("{node}: {e}"))),
            Err(_) => {
                return Err(ClientError::Unreachable(format!(
                    "{node}: no answer within {within:?}"
                )))
            }
        };
        let (sent, settling) = mpsc::unbounded_channel();
        tokio::spawn(settle(settling));
        Ok(Self {
            conn,
            writes,
            node: node.clone(),
            cluster_size: target.cluster_size,
            answer_within: target.answer_within(),
            next: AtomicU64::new(1),
            publishing: tokio::sync::Mutex::new(sent),
        })
    }

    /// The heartbeat negotiated with the node (`None`: none).
    pub fn heartbeat(&self) -> Option<Duration> {
        match self.conn.configuration().heartbeat() {
            0 => None,
            s => Some(Duration::from_secs(s.into())),
        }
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

    /// Appends a record (`mandatory`); the returned confirm resolves once
    /// the broker has it (replicated, for a stream), or returned it.
    pub async fn append(&self, stream: &str, record: &Record) -> Result<Confirm, ClientError> {
        let publishing = self.publishing.lock().await;
        let number = self.next.fetch_add(1, Ordering::Relaxed);
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(number.to_string().into());
        let mandatory = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        let body = record.encode();
        let publish =
            self.writes
                .basic_publish("".into(), stream.into(), mandatory, &body, properties);
        let confirm = match tokio::time::timeout(self.answer_within, publish).await {
            Ok(sent) => sent?,
            Err(_) => {
                return Err(ClientError::Unreachable(format!(
                    "{}: a write was not taken within {:?}",
                    self.node, self.answer_within
                )))
            }
        };
        let (reply, answer) = oneshot::channel();
        let sent = Sent {
            number,
            stream: stream.to_string(),
            confirm,
            reply,
        };
        // The settler ends only with this client: it is there.
        let _ = publishing.send(sent);
        Ok(Confirm(answer))
    }

    /// Appends a record and waits for the broker's confirm.
    pub async fn append_confirmed(&self, stream: &str, record: &Record) -> Result<(), ClientError> {
        self.append(stream, record).await?.wait().await
    }

    /// Reads `stream` from its first record to its current end: appends a
    /// marker, then consumes until that marker comes back.
    pub async fn read(&self, stream: &str) -> Result<StreamReader, ClientError> {
        let nonce = fastrand::u128(..);
        self.append_confirmed(stream, &Record::Marker(nonce))
            .await?;
        let (ch, consumer) = self.consume_from_first(stream, READ_PREFETCH).await?;
        Ok(StreamReader {
            stream: stream.to_string(),
            nonce,
            consumer,
            ch,
            count: 0,
            queued: Default::default(),
        })
    }

    /// Follows `stream` from its first record on: what [`Client::read`]
    /// reads, then [`Followed::CaughtUp`], then each record as it comes,
    /// for as long as the connection lives.
    pub async fn follow(&self, stream: &str) -> Result<StreamFollower, ClientError> {
        let nonce = fastrand::u128(..);
        self.append_confirmed(stream, &Record::Marker(nonce))
            .await?;
        let (ch, consumer) = self.consume_from_first(stream, FOLLOW_PREFETCH).await?;
        Ok(StreamFollower {
            stream: stream.to_string(),
            nonce,
            consumer,
            count: 0,
            caught_up: false,
            _ch: ch,
        })
    }

    async fn consume_from_first(
        &self,
        stream: &str,
        prefetch: u16,
    ) -> Result<(Channel, lapin::Consumer), ClientError> {
        let ch = self.conn.create_channel().await?;
        ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
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
        Ok((ch, consumer))
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

    /// One round trip to the broker on this connection, within `within`:
    /// whether it answers, and whether `stream`, if given, still exists
    /// (a passive declare).
    pub async fn probe(&self, stream: Option<&str>, within: Duration) -> Probe {
        let ask = async {
            let ch = self.conn.create_channel().await?;
            if let Some(stream) = stream {
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                };
                let declared = ch
                    .queue_declare(stream.into(), passive, FieldTable::default())
                    .await;
                match declared {
                    Err(e) if reply_code(&e) == Some(404) => return Ok(Probe::Missing),
                    declared => drop(declared?),
                }
            }
            let _ = ch.close(200, "".into()).await;
            Ok::<_, lapin::Error>(Probe::Alive)
        };
        match tokio::time::timeout(within, ask).await {
            Ok(Ok(probe)) => probe,
            _ => Probe::Silent,
        }
    }

    /// Whether this connection still holds the exclusive queue `name`:
    /// the broker answered a passive declare of it within `within`.
    pub async fn holds(&self, name: &str, within: Duration) -> Held {
        let ask = async {
            let ch = self.conn.create_channel().await?;
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            ch.queue_declare(name.into(), passive, FieldTable::default())
                .await?;
            let _ = ch.close(200, "".into()).await;
            Ok::<_, lapin::Error>(())
        };
        match tokio::time::timeout(within, ask).await {
            Ok(Ok(())) => Held::Yes,
            // Deleted by someone: it must be declared again.
            Ok(Err(e)) if reply_code(&e) == Some(404) => Held::Gone,
            _ => Held::Unanswered,
        }
    }

    /// Closes the connection (the lease goes with it).
    pub async fn close(&self) {
        let _ = self.conn.close(200, "nackd: replica closing".into()).await;
    }
}

/// Settles writes in publish order: a write is returned when its own
/// number came back, on its confirm or on an earlier one of the same ack
/// (which lapin completes first), else acked or nacked by its own confirm.
async fn settle(mut sent: mpsc::UnboundedReceiver<Sent>) {
    // Numbers the broker returned whose write is not settled yet.
    let mut returned: HashSet<u64> = HashSet::new();
    while let Some(s) = sent.recv().await {
        let outcome = match s.confirm.await {
            Ok(confirmation) => {
                let acked = confirmation.is_ack();
                if let Some(message) = confirmation.take_message() {
                    let number = message.delivery.properties.message_id().as_ref();
                    match number.and_then(|n| n.as_str().parse().ok()) {
                        Some(n) => {
                            returned.insert(n);
                        }
                        // Not one of ours: assume the worst for this write.
                        None => {
                            returned.insert(s.number);
                        }
                    }
                }
                match (returned.remove(&s.number), acked) {
                    (true, _) => Err(ClientError::Returned(s.stream)),
                    (false, true) => Ok(()),
                    (false, false) => Err(ClientError::Nacked),
                }
            }
            Err(e) => Err(ClientError::Amqp(e)),
        };
        // A return comes with the ack of its own write or before it: those
        // settled so far cannot be met again.
        returned.retain(|n| *n > s.number);
        let _ = s.reply.send(outcome);
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

/// What a [`StreamFollower`] read next.
#[derive(Debug)]
pub enum Followed {
    /// A record.
    Record(Record),
    /// A message that is no record nackd writes (someone else's).
    Unreadable,
    /// Every record written before the follow began was read.
    CaughtUp,
}

/// Follows a stream past its end ([`Client::follow`]).
pub struct StreamFollower {
    stream: String,
    nonce: u128,
    consumer: lapin::Consumer,
    count: u64,
    caught_up: bool,
    /// Kept open for as long as the follow lasts.
    _ch: Channel,
}

impl StreamFollower {
    /// The next record, or the end of what was there when the follow
    /// began (once). Until then a read that stalls fails as
    /// [`StreamReader::next`]'s does; after, it waits for as long as the
    /// connection lives (its heartbeat says when it is gone).
    pub async fn next(&mut self) -> Result<Followed, ClientError> {
        loop {
            let next = match self.caught_up {
                true => Ok(self.consumer.next().await),
                false => tokio::time::timeout(READ_STALL, self.consumer.next()).await,
            };
            let delivery = match next {
                Err(_) | Ok(None) => return Err(ClientError::Timeout(self.stream.clone())),
                Ok(Some(delivery)) => delivery?,
            };
            self.count += 1;
            if self.caught_up || self.count.is_multiple_of(u64::from(FOLLOW_PREFETCH / 2)) {
                delivery.ack(BasicAckOptions { multiple: true }).await?;
            }
            if delivery.data.len() > FOLLOW_MAX_BODY {
                return Ok(Followed::Unreadable);
            }
            match Record::decode(&delivery.data) {
                Ok(Record::Marker(n)) if n == self.nonce => {
                    self.caught_up = true;
                    delivery.ack(BasicAckOptions { multiple: true }).await?;
                    return Ok(Followed::CaughtUp);
                }
                Ok(Record::Marker(_)) => {}
                Ok(record) => return Ok(Followed::Record(record)),
                Err(_) => return Ok(Followed::Unreadable),
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
            tls: None,
        };
        assert_eq!(
            target.uri("127.0.0.1:5681"),
            "amqp://gu%20est:p%40ss%3Aw%2Frd@127.0.0.1:5681/%2F?heartbeat=5&connection_timeout=5000"
        );
    }
}

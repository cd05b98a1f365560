//! Load generators shared by the scenarios: a producer with a window of
//! unconfirmed publishes, a consumer acking in batches, and the pair of them
//! on two connections to one target.
//!
//! Every message carries its send time in its first 8 bytes (nanoseconds
//! since [`clock`]'s origin in this process), so the consumer can measure
//! publish → deliver latency without clock skew.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties, Consumer, PublisherConfirm,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::stats::Latencies;
use super::BenchResult;

/// Bytes of the send timestamp at the start of every body.
const STAMP: usize = 8;

/// Nanoseconds since a fixed instant of this process.
pub fn clock() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Body sizes a producer sends.
#[derive(Clone, Copy, Debug)]
pub enum Sizes {
    /// Every message this large.
    Fixed(usize),
    /// `large` bytes for one message in `every`, `small` for the others.
    Mix {
        /// Usual size.
        small: usize,
        /// Occasional size.
        large: usize,
        /// One large message per this many.
        every: u64,
    },
}

impl Sizes {
    /// The size of message `i` (at least the stamp's 8 bytes).
    pub fn of(self, i: u64) -> usize {
        match self {
            Sizes::Fixed(n) => n,
            Sizes::Mix { large, every, .. } if i % every == every - 1 => large,
            Sizes::Mix { small, .. } => small,
        }
        .max(STAMP)
    }

    /// The largest size.
    pub fn max(self) -> usize {
        match self {
            Sizes::Fixed(n) => n,
            Sizes::Mix { small, large, .. } => small.max(large),
        }
        .max(STAMP)
    }
}

/// How a producer/consumer pair behaves.
#[derive(Clone, Copy, Debug)]
pub struct PairSpec {
    /// Body sizes.
    pub sizes: Sizes,
    /// Publishes per second; `None` = as fast as confirms allow.
    pub rate: Option<u32>,
    /// Unconfirmed publishes allowed at once.
    pub window: usize,
    /// Consumer prefetch (`basic.qos`).
    pub prefetch: u16,
    /// The consumer acks (multiple) once per this many deliveries.
    pub ack_every: u64,
    /// Record publish → deliver latency while [`Flow::recording`] is on.
    pub latency: bool,
}

/// Counters of a pair, read while it runs.
#[derive(Debug, Default)]
pub struct Flow {
    /// Messages the broker confirmed.
    pub confirmed: AtomicU64,
    /// Messages delivered to the consumer.
    pub delivered: AtomicU64,
    /// Body bytes delivered to the consumer.
    pub delivered_bytes: AtomicU64,
    /// While true, the consumer records latencies.
    pub recording: AtomicBool,
}

/// A snapshot of the pair's counters.
#[derive(Clone, Copy, Debug)]
pub struct Mark {
    at: Instant,
    delivered: u64,
    bytes: u64,
    confirmed: u64,
}

/// Per second between two marks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    /// Messages delivered to the consumer.
    pub delivered: f64,
    /// Body bytes delivered to the consumer.
    pub bytes: f64,
    /// Publishes the broker confirmed (counted as the producer collects
    /// them, so up to one window behind).
    pub confirmed: f64,
}

impl Mark {
    /// What went through per second between `self` and a later mark.
    pub fn rate_until(&self, later: &Mark) -> Rates {
        let secs = later.at.duration_since(self.at).as_secs_f64();
        let per_sec = |a: u64, b: u64| b.saturating_sub(a) as f64 / secs;
        Rates {
            delivered: per_sec(self.delivered, later.delivered),
            bytes: per_sec(self.bytes, later.bytes),
            confirmed: per_sec(self.confirmed, later.confirmed),
        }
    }
}

impl Flow {
    /// The pair's counters now.
    pub fn mark(&self) -> Mark {
        Mark {
            at: Instant::now(),
            delivered: self.delivered.load(Ordering::Relaxed),
            bytes: self.delivered_bytes.load(Ordering::Relaxed),
            confirmed: self.confirmed.load(Ordering::Relaxed),
        }
    }
}

/// Connects to `addr` as guest.
pub async fn connect(addr: &str) -> BenchResult<Connection> {
    let uri = format!("amqp://guest:guest@{addr}/%2f");
    Connection::connect(&uri, ConnectionProperties::default())
        .await
        .map_err(|e| format!("connect {addr}: {e}").into())
}

/// Declares a plain queue that the broker drops by itself 10 minutes after
/// its last use, should the benchmark die before deleting it.
pub async fn declare_queue(ch: &Channel, name: &str) -> BenchResult<()> {
    let mut args = FieldTable::default();
    args.insert("x-expires".into(), AMQPValue::LongInt(600_000));
    ch.queue_declare(name.into(), durable(), args).await?;
    Ok(())
}

/// Options of every queue the benchmarks declare: durable, because
/// RabbitMQ 4.3 refuses transient non-exclusive queues (the messages stay
/// transient, so nothing is written to disk on 3.x either).
pub fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

/// Consumes `queue` on a new channel of `conn`, 2 000 unacked deliveries
/// at most (the channel is returned for the acks and nacks).
pub async fn consume_queue(conn: &Connection, queue: &str) -> BenchResult<(Channel, Consumer)> {
    let ch = conn.create_channel().await?;
    ch.basic_qos(2000, BasicQosOptions::default()).await?;
    let consumer = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((ch, consumer))
}

/// A queue name no other run uses.
pub fn unique_queue(what: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "nackd-bench-{what}-{}-{}-{}",
        std::process::id(),
        clock(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A producer and a consumer on their own connections, one queue.
pub struct Pair {
    /// Counters.
    pub flow: Arc<Flow>,
    queue: String,
    stop: CancellationToken,
    producer: JoinHandle<BenchResult<()>>,
    consumer: JoinHandle<BenchResult<Latencies>>,
    producer_conn: Connection,
    consumer_conn: Connection,
    admin: Channel,
    /// Held until the connections are closed: dropping a lapin channel's
    /// last handle sends `channel.close`, which races `connection.close`.
    channels: [Channel; 2],
}

impl Pair {
    /// Declares a fresh queue through `addr` and starts both sides.
    pub async fn start(addr: &str, what: &str, spec: PairSpec) -> BenchResult<Self> {
        let queue = unique_queue(what);
        let consumer_conn = connect(addr).await?;
        let admin = consumer_conn.create_channel().await?;
        declare_queue(&admin, &queue).await?;
        let consume_ch = consumer_conn.create_channel().await?;
        consume_ch
            .basic_qos(spec.prefetch, BasicQosOptions::default())
            .await?;
        let producer_conn = connect(addr).await?;
        let publish_ch = producer_conn.create_channel().await?;
        publish_ch
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let flow = Arc::new(Flow::default());
        let stop = CancellationToken::new();
        let channels = [consume_ch.clone(), publish_ch.clone()];
        let consumer = tokio::spawn(consume(
            consume_ch,
            queue.clone(),
            spec,
            flow.clone(),
            stop.clone(),
        ));
        let producer = tokio::spawn(produce(
            publish_ch,
            queue.clone(),
            spec,
            flow.clone(),
            stop.clone(),
        ));
        Ok(Self {
            flow,
            queue,
            stop,
            producer,
            consumer,
            producer_conn,
            consumer_conn,
            admin,
            channels,
        })
    }

    /// Stops both sides, deletes the queue, closes the connections, and
    /// returns the recorded latencies.
    pub async fn stop(self) -> BenchResult<Latencies> {
        self.stop.cancel();
        let produced = join(self.producer, "producer").await;
        let consumed = join(self.consumer, "consumer").await;
        let deleted = delete_queue(&self.admin, &self.queue).await;
        close(&self.producer_conn).await;
        close(&self.consumer_conn).await;
        drop(self.channels);
        produced?;
        deleted?;
        consumed
    }
}

/// Deletes `queue` on `ch`, within [`CLOSE_TIMEOUT`].
pub async fn delete_queue(ch: &Channel, queue: &str) -> BenchResult<()> {
    let delete = ch.queue_delete(queue.into(), QueueDeleteOptions::default());
    match tokio::time::timeout(CLOSE_TIMEOUT, delete).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("deleting {queue}: {e}").into()),
        Err(_) => Err(format!("deleting {queue}: no answer within {CLOSE_TIMEOUT:?}").into()),
    }
}

/// Time a `connection.close` or `queue.delete` gets: a lapin connection
/// that failed may never resolve it, and a benchmark must not hang.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Closes `conn`, logging (not failing) when it does not close cleanly.
pub async fn close(conn: &Connection) {
    match tokio::time::timeout(CLOSE_TIMEOUT, conn.close(200, "bench done".into())).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "connection did not close cleanly"),
        Err(_) => tracing::warn!(timeout = ?CLOSE_TIMEOUT, "connection.close got no answer"),
    }
}

/// The task's outcome; one that does not end within 10 s is aborted, so
/// it cannot go on writing into the next round.
pub async fn join<T>(mut task: JoinHandle<BenchResult<T>>, what: &str) -> BenchResult<T> {
    match tokio::time::timeout(Duration::from_secs(10), &mut task).await {
        Ok(Ok(result)) => result.map_err(|e| format!("{what}: {e}").into()),
        Ok(Err(e)) => Err(format!("{what} task: {e}").into()),
        Err(_) => {
            task.abort();
            Err(format!("{what} did not stop within 10 s").into())
        }
    }
}

/// Publishes until `stop`, at most `spec.window` unconfirmed at a time.
async fn produce(
    ch: Channel,
    queue: String,
    spec: PairSpec,
    flow: Arc<Flow>,
    stop: CancellationToken,
) -> BenchResult<()> {
    let mut body = vec![0xA5u8; spec.sizes.max()];
    let mut unconfirmed: VecDeque<PublisherConfirm> = VecDeque::with_capacity(spec.window);
    let mut pace = spec.rate.map(|r| {
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(r)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        tick
    });
    for i in 0u64.. {
        if let Some(tick) = &mut pace {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
        }
        if unconfirmed.len() >= spec.window {
            let oldest = unconfirmed.pop_front().expect("window is full");
            tokio::select! {
                _ = stop.cancelled() => break,
                confirmation = oldest => confirmed(confirmation?, &flow)?,
            }
        }
        if stop.is_cancelled() {
            break;
        }
        let n = spec.sizes.of(i);
        body[..STAMP].copy_from_slice(&clock().to_le_bytes());
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                &body[..n],
                BasicProperties::default(),
            )
            .await?;
        unconfirmed.push_back(confirm);
    }
    Ok(())
}

fn confirmed(confirmation: lapin::Confirmation, flow: &Flow) -> BenchResult<()> {
    if !confirmation.is_ack() {
        return Err(format!("the broker did not confirm a publish: {confirmation:?}").into());
    }
    flow.confirmed.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Consumes until `stop`, acking (multiple) every `spec.ack_every` deliveries.
async fn consume(
    ch: Channel,
    queue: String,
    spec: PairSpec,
    flow: Arc<Flow>,
    stop: CancellationToken,
) -> BenchResult<Latencies> {
    let mut consumer = ch
        .basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut latencies = Latencies::default();
    let mut unacked = 0;
    loop {
        let delivery = tokio::select! {
            _ = stop.cancelled() => break,
            next = consumer.next() => match next {
                Some(delivery) => delivery?,
                None => return Err("the consumer was cancelled by the broker".into()),
            },
        };
        let now = clock();
        if spec.latency && flow.recording.load(Ordering::Relaxed) {
            let stamp = delivery
                .data
                .get(..STAMP)
                .ok_or("a body shorter than its timestamp")?;
            let sent = u64::from_le_bytes(stamp.try_into().expect("8 bytes"));
            latencies.record(Duration::from_nanos(now.saturating_sub(sent)));
        }
        flow.delivered.fetch_add(1, Ordering::Relaxed);
        flow.delivered_bytes
            .fetch_add(delivery.data.len() as u64, Ordering::Relaxed);
        unacked += 1;
        if unacked >= spec.ack_every {
            ch.basic_ack(delivery.delivery_tag, BasicAckOptions { multiple: true })
                .await?;
            unacked = 0;
        }
    }
    Ok(latencies)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_per_second_of_the_time_between_marks() {
        let at = Instant::now();
        let before = Mark {
            at,
            delivered: 1_000,
            bytes: 1_024_000,
            confirmed: 1_200,
        };
        let after = Mark {
            at: at + Duration::from_secs(2),
            delivered: 21_000,
            bytes: 21_504_000,
            confirmed: 21_000,
        };
        assert_eq!(
            before.rate_until(&after),
            Rates {
                delivered: 10_000.0,
                bytes: 10_240_000.0,
                confirmed: 9_900.0,
            }
        );
    }
}

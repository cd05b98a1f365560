//! A producer and a consumer that write the way pika and amqplib do, not
//! the way lapin does: a write per frame or per message, and every
//! delivery acked on its own.
//!
//! lapin queues frames and writes whatever has piled up in one `write`, so
//! at full speed a proxy reads many messages per wake-up. `strace` of the
//! two most used clients of other languages, publishing 1 000 messages of
//! 1 KiB and consuming 1 000 with an ack each (2026-12-01):
//!
//! - pika 1.4.4 (`BlockingConnection`) sends each frame with its own
//!   `sendto` on a `TCP_NODELAY` socket: 3 000 `sendto` for the publishes
//!   (method, header, body), 1 002 for the acks;
//! - amqplib 2.3.1 (a confirm channel) writes each message's three frames
//!   in one `write` of 1 084 bytes: 1 000 writes; its acks, 926 writes.
//!
//! A proxy in front of such a client is woken for each small segment, so
//! the cost per message of two proxies compares differently than under
//! lapin ([`Writes`]).
//!
//! The producer keeps `window` publishes unconfirmed (as a confirm channel
//! of amqplib does; a pika `BlockingConnection` waits for each confirm,
//! which is the `sync` figure's shape). The AMQP written here is the least a
//! client needs: the handshake as guest, one channel, `confirm.select`,
//! `basic.qos`, `basic.consume`, publishes and acks.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use amq_protocol::protocol::basic::{self, AMQPProperties};
use amq_protocol::protocol::{channel, confirm, connection, AMQPClass};
use amq_protocol::types::{FieldTable, LongString};
use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use nackd_core::protocol::content::{body_size, encode_header};
use nackd_core::protocol::frame::{
    Frame, FrameDecoder, FrameType, FRAME_OVERHEAD, PROTOCOL_HEADER,
};
use nackd_core::protocol::method;

use super::load::{self, Flow, PairSpec};
use super::BenchResult;

/// The largest frame this client asks for (what lapin and pika ask for).
const FRAME_MAX: u32 = 128 * 1024;
/// The channel every method goes on.
const CHANNEL: u16 = 1;
/// How long the handshake and each setup method may take.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// The reading side of a connection: frames as they come.
struct Reader {
    read: OwnedReadHalf,
    buf: BytesMut,
    decoder: FrameDecoder,
}

impl Reader {
    /// The next frame that is not a heartbeat.
    async fn frame(&mut self) -> BenchResult<Frame> {
        loop {
            if let Some(frame) = self.decoder.decode(&mut self.buf)? {
                if frame.kind != FrameType::Heartbeat {
                    return Ok(frame);
                }
                continue;
            }
            if self.read.read_buf(&mut self.buf).await? == 0 {
                return Err("the connection was closed".into());
            }
        }
    }

    /// The next method; an error for any other frame or a `close`.
    async fn method(&mut self) -> BenchResult<AMQPClass> {
        let frame = self.frame().await?;
        if frame.kind != FrameType::Method {
            return Err(format!("expected a method, got a {:?} frame", frame.kind).into());
        }
        match method::decode_any(frame.payload_slice())? {
            AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
                Err(format!("connection closed: {} {}", c.reply_code, c.reply_text).into())
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(c)) => {
                Err(format!("channel closed: {} {}", c.reply_code, c.reply_text).into())
            }
            class => Ok(class),
        }
    }

    /// Reads methods until `want` accepts one (within [`ANSWER_WITHIN`]).
    async fn expect<T>(
        &mut self,
        what: &str,
        want: impl Fn(AMQPClass) -> Option<T>,
    ) -> BenchResult<T> {
        let wait = async {
            loop {
                if let Some(t) = want(self.method().await?) {
                    return BenchResult::Ok(t);
                }
            }
        };
        tokio::time::timeout(ANSWER_WITHIN, wait)
            .await
            .map_err(|_| format!("no {what} within {ANSWER_WITHIN:?}"))?
    }
}

/// How a client puts a publish on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writes {
    /// Each frame in a write of its own (pika).
    Frame,
    /// A message's frames together in one write (amqplib).
    Message,
}

/// The writing side: one write per method, and per frame or per message
/// of a publish.
struct Writer<W = OwnedWriteHalf> {
    write: W,
    frame_max: u32,
    writes: Writes,
    /// A message's frames, gathered for [`Writes::Message`].
    out: Vec<u8>,
}

impl<W: AsyncWrite + Unpin> Writer<W> {
    async fn method(&mut self, channel: u16, class: AMQPClass) -> BenchResult<()> {
        self.write
            .write_all(&method::encode(channel, &class))
            .await?;
        Ok(())
    }

    /// `basic.publish` to the default exchange: method, header and body
    /// frames, written as [`Writes`] says.
    async fn publish(&mut self, queue: &str, body: &[u8]) -> BenchResult<()> {
        let publish = basic::Publish {
            exchange: "".into(),
            routing_key: queue.into(),
            mandatory: false,
            immediate: false,
        };
        let class = AMQPClass::Basic(basic::AMQPMethod::Publish(publish));
        let header = encode_header(60, body.len() as u64, &AMQPProperties::default());
        let mut frames = vec![
            method::encode(CHANNEL, &class),
            Frame::new(FrameType::Header, CHANNEL, &header).raw,
        ];
        for chunk in body.chunks(self.frame_max as usize - FRAME_OVERHEAD) {
            frames.push(Frame::new(FrameType::Body, CHANNEL, chunk).raw);
        }
        match self.writes {
            Writes::Frame => {
                for frame in frames {
                    self.write.write_all(&frame).await?;
                }
            }
            Writes::Message => {
                self.out.clear();
                for frame in frames {
                    self.out.extend_from_slice(&frame);
                }
                self.write.write_all(&self.out).await?;
            }
        }
        Ok(())
    }

    /// `connection.close`, without waiting for its answer.
    async fn close(&mut self) {
        let close = connection::Close {
            reply_code: 200,
            reply_text: "bench done".into(),
            class_id: 0,
            method_id: 0,
        };
        let class = AMQPClass::Connection(connection::AMQPMethod::Close(close));
        let _ = self.method(0, class).await;
    }
}

/// Opens a connection to `addr` as guest, and channel 1 on it.
async fn open(addr: &str, writes: Writes) -> BenchResult<(Reader, Writer)> {
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    tcp.set_nodelay(true)?;
    let (read, write) = tcp.into_split();
    let mut reader = Reader {
        read,
        buf: BytesMut::with_capacity(64 * 1024),
        decoder: FrameDecoder::new(FRAME_MAX),
    };
    let mut writer = Writer {
        write,
        frame_max: FRAME_MAX,
        writes,
        out: Vec::new(),
    };
    writer.write.write_all(PROTOCOL_HEADER).await?;
    reader
        .expect("connection.start", |m| {
            matches!(m, AMQPClass::Connection(connection::AMQPMethod::Start(_))).then_some(())
        })
        .await?;
    let start_ok = connection::StartOk {
        client_properties: FieldTable::default(),
        mechanism: "PLAIN".into(),
        response: LongString::from("\0guest\0guest"),
        locale: "en_US".into(),
    };
    writer
        .method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
        )
        .await?;
    let tune = reader
        .expect("connection.tune", |m| match m {
            AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => Some(t),
            _ => None,
        })
        .await?;
    let frame_max = match tune.frame_max {
        0 => FRAME_MAX,
        n => n.min(FRAME_MAX),
    };
    let tune_ok = connection::TuneOk {
        channel_max: tune.channel_max,
        frame_max,
        heartbeat: 0,
    };
    writer
        .method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune_ok)),
        )
        .await?;
    writer.frame_max = frame_max;
    reader.decoder.set_frame_max(frame_max);
    let open = connection::Open {
        virtual_host: "/".into(),
    };
    writer
        .method(0, AMQPClass::Connection(connection::AMQPMethod::Open(open)))
        .await?;
    reader
        .expect("connection.open-ok", |m| {
            matches!(m, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))).then_some(())
        })
        .await?;
    writer
        .method(
            CHANNEL,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await?;
    reader
        .expect("channel.open-ok", |m| {
            matches!(m, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))).then_some(())
        })
        .await?;
    Ok((reader, writer))
}

/// A producer and a consumer, each on a connection of its own, writing
/// as [`Writes`] says, on a queue declared (and deleted) through lapin.
pub struct Pair {
    /// Counters.
    pub flow: Arc<Flow>,
    queue: String,
    stop: CancellationToken,
    producer: JoinHandle<BenchResult<()>>,
    consumer: JoinHandle<BenchResult<()>>,
    admin: lapin::Connection,
    /// Kept until its connection is closed: dropping a lapin channel's
    /// last handle sends `channel.close`, which races `connection.close`.
    admin_ch: lapin::Channel,
}

impl Pair {
    /// Declares a fresh queue through `addr` and starts both sides. Of
    /// `spec`, this uses the body size, `window`, `prefetch` and
    /// `ack_every` (1: an ack per delivery, as pika's users write; more: a
    /// multiple ack every so many).
    pub async fn start(
        addr: &str,
        what: &str,
        spec: PairSpec,
        writes: Writes,
    ) -> BenchResult<Self> {
        let queue = load::unique_queue(what);
        let admin = load::connect(addr).await?;
        let admin_ch = admin.create_channel().await?;
        load::declare_queue(&admin_ch, &queue).await?;
        let flow = Arc::new(Flow::default());
        let stop = CancellationToken::new();
        let consumer = open(addr, writes).await?;
        let consumer = tokio::spawn(consume(
            consumer,
            queue.clone(),
            spec,
            flow.clone(),
            stop.clone(),
        ));
        let producer = open(addr, writes).await?;
        let producer = tokio::spawn(produce(
            producer,
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
            admin,
            admin_ch,
        })
    }

    /// Stops both sides, deletes the queue and closes the connections.
    pub async fn stop(self) -> BenchResult<()> {
        self.stop.cancel();
        let produced = join(self.producer, "producer").await;
        let consumed = join(self.consumer, "consumer").await;
        let options = lapin::options::QueueDeleteOptions::default();
        let deleted = self
            .admin_ch
            .queue_delete(self.queue.as_str().into(), options);
        let deleted = tokio::time::timeout(ANSWER_WITHIN, deleted).await;
        load::close(&self.admin).await;
        drop(self.admin_ch);
        produced?;
        consumed?;
        match deleted {
            Ok(result) => result
                .map(drop)
                .map_err(|e| format!("deleting {}: {e}", self.queue).into()),
            Err(_) => Err(format!(
                "deleting {}: no answer within {ANSWER_WITHIN:?}",
                self.queue
            )
            .into()),
        }
    }
}

async fn join(task: JoinHandle<BenchResult<()>>, what: &str) -> BenchResult<()> {
    match tokio::time::timeout(ANSWER_WITHIN, task).await {
        Ok(Ok(result)) => result.map_err(|e| format!("{what}: {e}").into()),
        Ok(Err(e)) => Err(format!("{what} task: {e}").into()),
        Err(_) => Err(format!("{what} did not stop within {ANSWER_WITHIN:?}").into()),
    }
}

/// Publish confirms as they come: the highest tag below which every
/// publish is confirmed.
#[derive(Debug, Default)]
struct Confirms {
    upto: u64,
    /// Single acks above `upto`, not yet contiguous with it.
    ahead: BTreeSet<u64>,
}

impl Confirms {
    /// Takes `basic.ack` (tag, multiple); returns how many publishes it
    /// newly confirmed.
    fn ack(&mut self, tag: u64, multiple: bool) -> u64 {
        let before = self.upto;
        if multiple {
            self.upto = self.upto.max(tag);
            self.ahead = self.ahead.split_off(&(self.upto + 1));
        } else if tag > self.upto {
            self.ahead.insert(tag);
        }
        while self.ahead.first() == Some(&(self.upto + 1)) {
            self.ahead.pop_first();
            self.upto += 1;
        }
        self.upto - before
    }
}

/// Publishes until `stop`, at most `spec.window` unconfirmed at a time.
async fn produce(
    (mut reader, mut writer): (Reader, Writer),
    queue: String,
    spec: PairSpec,
    flow: Arc<Flow>,
    stop: CancellationToken,
) -> BenchResult<()> {
    let select = confirm::Select { nowait: false };
    writer
        .method(
            CHANNEL,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(select)),
        )
        .await?;
    reader
        .expect("confirm.select-ok", |m| {
            matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))).then_some(())
        })
        .await?;
    // The confirms, read on a task of their own as the broker sends them.
    let (confirmed_tx, mut confirmed) = watch::channel(0u64);
    let confirms = {
        let flow = flow.clone();
        tokio::spawn(async move {
            let mut seen = Confirms::default();
            loop {
                match reader.method().await? {
                    AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => {
                        let n = seen.ack(a.delivery_tag, a.multiple);
                        flow.confirmed.fetch_add(n, Ordering::Relaxed);
                        let _ = confirmed_tx.send(seen.upto);
                    }
                    AMQPClass::Basic(basic::AMQPMethod::Nack(_)) => {
                        return BenchResult::<()>::Err("the broker nacked a publish".into())
                    }
                    other => return Err(format!("unexpected {other:?}").into()),
                }
            }
        })
    };
    let body = vec![0xA5u8; spec.sizes.max()];
    let window = spec.window.max(1) as u64;
    let mut published = 0u64;
    let result = async {
        for i in 0u64.. {
            let room = confirmed.wait_for(|upto| published - upto < window);
            tokio::select! {
                _ = stop.cancelled() => break,
                room = room => drop(room.map_err(|_| "the confirms stopped")?),
            }
            writer.publish(&queue, &body[..spec.sizes.of(i)]).await?;
            published += 1;
        }
        BenchResult::Ok(())
    }
    .await;
    writer.close().await;
    confirms.abort();
    match confirms.await {
        Ok(Err(e)) => Err(e),
        _ => result,
    }
}

/// Consumes until `stop`, acking as `spec.ack_every` says.
async fn consume(
    (mut reader, mut writer): (Reader, Writer),
    queue: String,
    spec: PairSpec,
    flow: Arc<Flow>,
    stop: CancellationToken,
) -> BenchResult<()> {
    let qos = basic::Qos {
        prefetch_count: spec.prefetch,
        global: false,
    };
    writer
        .method(CHANNEL, AMQPClass::Basic(basic::AMQPMethod::Qos(qos)))
        .await?;
    reader
        .expect("basic.qos-ok", |m| {
            matches!(m, AMQPClass::Basic(basic::AMQPMethod::QosOk(_))).then_some(())
        })
        .await?;
    let consume = basic::Consume {
        queue: queue.as_str().into(),
        consumer_tag: "".into(),
        no_local: false,
        no_ack: false,
        exclusive: false,
        nowait: false,
        arguments: FieldTable::default(),
    };
    writer
        .method(
            CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Consume(consume)),
        )
        .await?;
    reader
        .expect("basic.consume-ok", |m| {
            matches!(m, AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_))).then_some(())
        })
        .await?;
    let ack_every = spec.ack_every.max(1);
    let result = async {
        let mut unacked = 0u64;
        loop {
            let frame = tokio::select! {
                _ = stop.cancelled() => return BenchResult::Ok(()),
                frame = reader.frame() => frame?,
            };
            let tag = match frame.kind {
                FrameType::Method => match method::decode_any(frame.payload_slice())? {
                    AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) => d.delivery_tag,
                    other => return Err(format!("unexpected {other:?}").into()),
                },
                other => return Err(format!("a {other:?} frame where a delivery starts").into()),
            };
            let header = reader.frame().await?;
            if header.kind != FrameType::Header {
                return Err("a delivery without its header".into());
            }
            let size = body_size(header.payload_slice())?;
            let mut got = 0u64;
            while got < size {
                let body = reader.frame().await?;
                if body.kind != FrameType::Body {
                    return Err("a delivery short of its body".into());
                }
                got += body.payload_slice().len() as u64;
            }
            flow.delivered.fetch_add(1, Ordering::Relaxed);
            flow.delivered_bytes.fetch_add(size, Ordering::Relaxed);
            unacked += 1;
            if unacked >= ack_every {
                let ack = basic::Ack {
                    delivery_tag: tag,
                    multiple: ack_every > 1,
                };
                writer
                    .method(CHANNEL, AMQPClass::Basic(basic::AMQPMethod::Ack(ack)))
                    .await?;
                unacked = 0;
            }
        }
    }
    .await;
    writer.close().await;
    result
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use super::*;

    /// Counts the writes it is given, and takes each whole.
    #[derive(Default)]
    struct Counted(Vec<usize>);

    impl AsyncWrite for Counted {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            self.0.push(buf.len());
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    async fn written(writes: Writes, body: usize) -> Vec<usize> {
        let mut writer = Writer {
            write: Counted::default(),
            frame_max: 4096,
            writes,
            out: Vec::new(),
        };
        writer.publish("q", &vec![0; body]).await.unwrap();
        writer.write.0
    }

    #[tokio::test]
    async fn pika_writes_each_frame_and_amqplib_each_message() {
        // basic.publish to "q": 7 + 10 + 1 bytes; the header 7 + 14 + 1.
        let (method, header) = (18, 22);
        let frame = |n: usize| n + FRAME_OVERHEAD;
        assert_eq!(
            written(Writes::Frame, 1024).await,
            [method, header, frame(1024)]
        );
        assert_eq!(
            written(Writes::Message, 1024).await,
            [method + header + frame(1024)]
        );
        // A body larger than a frame goes in frames of at most frame_max.
        let most = 4096 - FRAME_OVERHEAD;
        assert_eq!(
            written(Writes::Frame, 5000).await,
            [method, header, frame(most), frame(5000 - most)]
        );
        assert_eq!(
            written(Writes::Message, 5000).await,
            [method + header + frame(most) + frame(5000 - most)]
        );
    }

    #[test]
    fn confirms_count_each_publish_once_in_any_order() {
        let mut c = Confirms::default();
        assert_eq!(c.ack(2, false), 0);
        assert_eq!(c.ack(1, false), 2);
        assert_eq!(c.ack(5, true), 3);
        assert_eq!(c.ack(4, false), 0, "already within a multiple ack");
        assert_eq!(c.ack(7, false), 0);
        assert_eq!(c.ack(6, false), 2);
        assert_eq!(c.upto, 7);
        assert!(c.ahead.is_empty());
    }

    #[test]
    fn a_multiple_ack_swallows_the_single_ones_below_it() {
        let mut c = Confirms::default();
        c.ack(3, false);
        c.ack(9, false);
        assert_eq!(c.ack(4, true), 4);
        assert_eq!(c.ahead.iter().copied().collect::<Vec<_>>(), vec![9]);
        assert_eq!(c.ack(9, true), 5);
        assert!(c.ahead.is_empty());
    }
}

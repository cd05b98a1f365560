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
//!   in one `write` of 1 084 bytes: 1 000 writes; its acks, 926 to 993
//!   writes (three runs: a few are written together).
//!
//! With `TCP_NODELAY`, each write leaves as a segment of its own; how many
//! of them a proxy then reads per wake-up depends on how far behind it
//! falls. The producer here keeps `window` publishes unconfirmed, as an
//! amqplib confirm channel does (a pika `BlockingConnection` waits for each
//! confirm, which is the `sync` figure's shape), so it writes like pika
//! and pipelines like amqplib. `bench/profile/client-writes.sh` repeats
//! the `strace` counts above.
//!
//! The AMQP written here is the least a client needs: the handshake as
//! guest with pika's capabilities and the broker's heartbeat, one channel,
//! `confirm.select`, `basic.qos`, `basic.consume`, publishes and acks.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use amq_protocol::protocol::basic::{self, AMQPProperties};
use amq_protocol::protocol::{channel, confirm, connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use bytes::{Bytes, BytesMut};
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
/// How long each answer of the handshake and the setup may take.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);
/// How long a side that failed waits for the broker's reason to arrive.
const REASON_WITHIN: Duration = Duration::from_secs(1);

/// The reading side of a connection: frames as they come.
struct Reader {
    read: OwnedReadHalf,
    buf: BytesMut,
    decoder: FrameDecoder,
}

impl Reader {
    /// The next frame that is not a heartbeat, on channel 0 or ours.
    async fn frame(&mut self) -> BenchResult<Frame> {
        loop {
            if let Some(frame) = self.decoder.decode(&mut self.buf)? {
                if frame.channel != 0 && frame.channel != CHANNEL {
                    return Err(format!("a frame on channel {}", frame.channel).into());
                }
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

    /// The next method; an error for any other frame.
    async fn method(&mut self) -> BenchResult<AMQPClass> {
        class_of(&self.frame().await?)
    }

    /// The next method, which must be the one `want` accepts (within
    /// [`ANSWER_WITHIN`]); any other is an error.
    async fn expect<T>(
        &mut self,
        what: &str,
        want: impl Fn(&AMQPClass) -> Option<T>,
    ) -> BenchResult<T> {
        let class = tokio::time::timeout(ANSWER_WITHIN, self.method())
            .await
            .map_err(|_| format!("no {what} within {ANSWER_WITHIN:?}"))??;
        want(&class).ok_or_else(|| format!("expected {what}, got {class:?}").into())
    }
}

/// The method a frame carries; the broker closing the connection or the
/// channel, or cancelling the consumer, is an error naming its reason.
fn class_of(frame: &Frame) -> BenchResult<AMQPClass> {
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
        AMQPClass::Basic(basic::AMQPMethod::Cancel(_)) => {
            Err("the broker cancelled the consumer".into())
        }
        class => Ok(class),
    }
}

/// Sends `class` on `channel` and reads the answer `want` accepts (see
/// [`Reader::expect`]).
async fn call<T>(
    (reader, writer): (&mut Reader, &mut Writer),
    channel: u16,
    class: AMQPClass,
    what: &str,
    want: impl Fn(&AMQPClass) -> Option<T>,
) -> BenchResult<T> {
    writer.method(channel, class).await?;
    reader.expect(what, want).await
}

/// `want` for an answer that carries nothing the caller needs.
fn is(answer: impl Fn(&AMQPClass) -> bool) -> impl Fn(&AMQPClass) -> Option<()> {
    move |m| answer(m).then_some(())
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
    /// A publish's frames for the last body size, encoded once: the
    /// frames of a pika-like write, or the one buffer of an amqplib-like.
    publish: Option<(usize, Vec<Bytes>)>,
}

impl<W: AsyncWrite + Unpin> Writer<W> {
    async fn method(&mut self, channel: u16, class: AMQPClass) -> BenchResult<()> {
        self.write
            .write_all(&method::encode(channel, &class))
            .await?;
        Ok(())
    }

    /// A heartbeat frame.
    async fn heartbeat(&mut self) -> BenchResult<()> {
        self.write
            .write_all(&Frame::new(FrameType::Heartbeat, 0, &[]).raw)
            .await?;
        Ok(())
    }

    /// `basic.publish` of `size` bytes to `queue` on the default exchange:
    /// method, header and body frames, written as [`Writes`] says.
    async fn publish(&mut self, queue: &str, size: usize) -> BenchResult<()> {
        if self.publish.as_ref().is_none_or(|(n, _)| *n != size) {
            let frames = publish_frames(queue, size, self.frame_max);
            let frames = match self.writes {
                Writes::Frame => frames,
                Writes::Message => vec![frames.concat().into()],
            };
            self.publish = Some((size, frames));
        }
        let (_, frames) = self.publish.as_ref().expect("encoded above");
        for frame in frames {
            self.write.write_all(frame).await?;
        }
        Ok(())
    }

    /// `connection.close`, without waiting for its answer (the socket is
    /// dropped after it).
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

/// The frames of one publish of `size` bytes (0xA5 each) to `queue`.
fn publish_frames(queue: &str, size: usize, frame_max: u32) -> Vec<Bytes> {
    let publish = basic::Publish {
        exchange: "".into(),
        routing_key: queue.into(),
        mandatory: false,
        immediate: false,
    };
    let class = AMQPClass::Basic(basic::AMQPMethod::Publish(publish));
    let header = encode_header(60, size as u64, &AMQPProperties::default());
    let mut frames = vec![
        method::encode(CHANNEL, &class),
        Frame::new(FrameType::Header, CHANNEL, &header).raw,
    ];
    let body = vec![0xA5u8; size];
    for chunk in body.chunks(frame_max as usize - FRAME_OVERHEAD) {
        frames.push(Frame::new(FrameType::Body, CHANNEL, chunk).raw);
    }
    frames
}

/// The capabilities pika 1.4 announces: with them the broker sends
/// `basic.cancel` and `connection.blocked` as it would to pika.
fn client_properties() -> FieldTable {
    let mut capabilities = FieldTable::default();
    for name in [
        "authentication_failure_close",
        "basic.nack",
        "connection.blocked",
        "consumer_cancel_notify",
        "publisher_confirms",
    ] {
        capabilities.insert(name.into(), AMQPValue::Boolean(true));
    }
    let mut properties = FieldTable::default();
    properties.insert(
        "product".into(),
        AMQPValue::LongString("nackd-bench".into()),
    );
    properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
    properties
}

/// An open connection: its two sides, and how often to send a heartbeat
/// (half the negotiated interval; none when the broker asks for none).
struct Conn {
    reader: Reader,
    writer: Writer,
    beat: Option<Duration>,
}

/// Ticks every `beat`, or never.
async fn beat_due(beat: &mut Option<tokio::time::Interval>) {
    match beat {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}

fn beats(beat: Option<Duration>) -> Option<tokio::time::Interval> {
    beat.map(|every| tokio::time::interval_at(tokio::time::Instant::now() + every, every))
}

/// Opens a connection to `addr` as guest, and channel 1 on it.
async fn open(addr: &str, writes: Writes) -> BenchResult<Conn> {
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
        publish: None,
    };
    writer.write.write_all(PROTOCOL_HEADER).await?;
    reader
        .expect(
            "connection.start",
            is(|m| matches!(m, AMQPClass::Connection(connection::AMQPMethod::Start(_)))),
        )
        .await?;
    let start_ok = connection::StartOk {
        client_properties: client_properties(),
        mechanism: "PLAIN".into(),
        response: LongString::from("\0guest\0guest"),
        locale: "en_US".into(),
    };
    let tune = call(
        (&mut reader, &mut writer),
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
        "connection.tune",
        |m| match m {
            AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => Some(t.clone()),
            _ => None,
        },
    )
    .await?;
    let frame_max = match tune.frame_max {
        0 => FRAME_MAX,
        n => n.min(FRAME_MAX),
    };
    // The broker's heartbeat, as pika and lapin take it.
    let tune_ok = connection::TuneOk {
        channel_max: tune.channel_max,
        frame_max,
        heartbeat: tune.heartbeat,
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
    call(
        (&mut reader, &mut writer),
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(open)),
        "connection.open-ok",
        is(|m| matches!(m, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)))),
    )
    .await?;
    call(
        (&mut reader, &mut writer),
        CHANNEL,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        "channel.open-ok",
        is(|m| matches!(m, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))),
    )
    .await?;
    let beat = (tune.heartbeat > 0).then(|| Duration::from_secs(tune.heartbeat.into()) / 2);
    Ok(Conn {
        reader,
        writer,
        beat,
    })
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
    /// `spec`, this uses the body sizes, `window`, `prefetch` and
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
        // Both connections before either side starts, so a failure leaves
        // no task behind.
        let opened =
            async { Ok::<_, Box<_>>((open(addr, writes).await?, open(addr, writes).await?)) };
        let (consumer, producer) = match opened.await {
            Ok(both) => both,
            Err(e) => {
                let _ = load::delete_queue(&admin_ch, &queue).await;
                load::close(&admin).await;
                return Err(e);
            }
        };
        let flow = Arc::new(Flow::default());
        let stop = CancellationToken::new();
        let consumer = tokio::spawn(consume(
            consumer,
            queue.clone(),
            spec,
            flow.clone(),
            stop.clone(),
        ));
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
        let produced = load::join(self.producer, "producer").await;
        let consumed = load::join(self.consumer, "consumer").await;
        let deleted = load::delete_queue(&self.admin_ch, &self.queue).await;
        load::close(&self.admin).await;
        drop(self.admin_ch);
        produced?;
        consumed?;
        deleted
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

/// Reads the producer's confirms until the connection fails, telling
/// `confirmed` how far they reached.
async fn read_confirms(
    mut reader: Reader,
    confirmed: watch::Sender<u64>,
    flow: Arc<Flow>,
) -> BenchResult<()> {
    let mut seen = Confirms::default();
    loop {
        match reader.method().await? {
            AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => {
                let n = seen.ack(a.delivery_tag, a.multiple);
                flow.confirmed.fetch_add(n, Ordering::Relaxed);
                let _ = confirmed.send(seen.upto);
            }
            AMQPClass::Basic(basic::AMQPMethod::Nack(_)) => {
                return Err("the broker nacked a publish".into())
            }
            // A memory or disk alarm: the broker stops reading; so do we.
            AMQPClass::Connection(connection::AMQPMethod::Blocked(_))
            | AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)) => {}
            other => return Err(format!("unexpected {other:?}").into()),
        }
    }
}

/// What ended a side: its own error, unless the task reading its
/// connection ended with one (the broker's reason comes first); a panic
/// is an error too.
async fn outcome(result: BenchResult<()>, reader: JoinHandle<BenchResult<()>>) -> BenchResult<()> {
    let reader = match result {
        // Stopped: the reader has nothing more to say.
        Ok(()) => {
            reader.abort();
            reader.await
        }
        Err(_) => match tokio::time::timeout(REASON_WITHIN, reader).await {
            Ok(ended) => ended,
            Err(_) => return result,
        },
    };
    match reader {
        Ok(Err(e)) => Err(e),
        Err(e) if e.is_panic() => Err(format!("the confirms reader panicked: {e}").into()),
        _ => result,
    }
}

/// Waits until fewer than `window` of `published` are unconfirmed;
/// `false` if the confirms stopped.
async fn room(confirmed: &mut watch::Receiver<u64>, published: u64, window: u64) -> bool {
    confirmed
        .wait_for(|upto| published - upto < window)
        .await
        .is_ok()
}

/// Publishes until `stop`, at most `spec.window` unconfirmed at a time.
async fn produce(
    conn: Conn,
    queue: String,
    spec: PairSpec,
    flow: Arc<Flow>,
    stop: CancellationToken,
) -> BenchResult<()> {
    let Conn {
        mut reader,
        mut writer,
        beat,
    } = conn;
    let select = confirm::Select { nowait: false };
    call(
        (&mut reader, &mut writer),
        CHANNEL,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(select)),
        "confirm.select-ok",
        is(|m| matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_)))),
    )
    .await?;
    let (confirmed_tx, mut confirmed) = watch::channel(0u64);
    let confirms = tokio::spawn(read_confirms(reader, confirmed_tx, flow));
    let window = spec.window.max(1) as u64;
    let mut beat = beats(beat);
    let mut published = 0u64;
    let result = async {
        for i in 0u64.. {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return Ok(()),
                    _ = beat_due(&mut beat) => writer.heartbeat().await?,
                    room = room(&mut confirmed, published, window) => match room {
                        true => break,
                        false => return Err("the confirms stopped".into()),
                    },
                }
            }
            writer.publish(&queue, spec.sizes.of(i)).await?;
            published += 1;
        }
        BenchResult::Ok(())
    }
    .await;
    let ended = outcome(result, confirms).await;
    writer.close().await;
    ended
}

/// Reads one delivery's header and body after its `basic.deliver`; its
/// size.
async fn delivery_body(reader: &mut Reader) -> BenchResult<u64> {
    let header = reader.frame().await?;
    if header.kind != FrameType::Header {
        class_of(&header)?;
        return Err("a delivery without its header".into());
    }
    let size = body_size(header.payload_slice())?;
    let mut got = 0u64;
    while got < size {
        let body = reader.frame().await?;
        if body.kind != FrameType::Body {
            class_of(&body)?;
            return Err("a delivery short of its body".into());
        }
        got += body.payload_slice().len() as u64;
    }
    if got != size {
        return Err(format!("a body of {got} bytes where the header said {size}").into());
    }
    Ok(size)
}

/// Consumes until `stop`, acking as `spec.ack_every` says.
async fn consume(
    conn: Conn,
    queue: String,
    spec: PairSpec,
    flow: Arc<Flow>,
    stop: CancellationToken,
) -> BenchResult<()> {
    let Conn {
        mut reader,
        mut writer,
        beat,
    } = conn;
    let qos = basic::Qos {
        prefetch_count: spec.prefetch,
        global: false,
    };
    call(
        (&mut reader, &mut writer),
        CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Qos(qos)),
        "basic.qos-ok",
        is(|m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::QosOk(_)))),
    )
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
    call(
        (&mut reader, &mut writer),
        CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Consume(consume)),
        "basic.consume-ok",
        is(|m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_)))),
    )
    .await?;
    let ack_every = spec.ack_every.max(1);
    let mut beat = beats(beat);
    let result = async {
        let mut unacked = 0u64;
        loop {
            let frame = tokio::select! {
                _ = stop.cancelled() => return BenchResult::Ok(()),
                _ = beat_due(&mut beat) => {
                    writer.heartbeat().await?;
                    continue;
                }
                frame = reader.frame() => frame?,
            };
            let tag = match class_of(&frame)? {
                AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) => d.delivery_tag,
                other => return Err(format!("unexpected {other:?}").into()),
            };
            let size = delivery_body(&mut reader).await?;
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
            publish: None,
        };
        writer.publish("q", body).await.unwrap();
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
        // Encoded once per size: the same bytes again, then the new size's.
        let mut writer = Writer {
            write: Counted::default(),
            frame_max: 4096,
            writes: Writes::Frame,
            publish: None,
        };
        for size in [1024, 1024, 100] {
            writer.publish("q", size).await.unwrap();
        }
        assert_eq!(
            writer.write.0,
            [
                method,
                header,
                frame(1024),
                method,
                header,
                frame(1024),
                method,
                header,
                frame(100)
            ]
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

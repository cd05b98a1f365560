//! A raw AMQP client for tests that must send what lapin never would, and a
//! TCP relay in front of the broker that a test can cut or freeze.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
use amq_protocol::types::{FieldTable, LongString};
use bytes::BytesMut;
use nackd_core::protocol::frame::{Frame, FrameDecoder, FrameType, PROTOCOL_HEADER};
use nackd_core::protocol::method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct RawClient {
    pub stream: TcpStream,
    buf: BytesMut,
}

/// What the server did last.
#[derive(Debug, PartialEq, Eq)]
pub enum Ending {
    /// A `connection.close` with this reply code.
    Close(u16, String),
    /// The socket closed without one.
    Eof,
}

impl RawClient {
    pub async fn connect(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.unwrap();
        Self {
            stream,
            buf: BytesMut::new(),
        }
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    /// Next frame, or `None` at EOF. Panics after 90 s without one: RabbitMQ
    /// 4.3 took over 10 s, and once (load average 24) over 30 s, to deliver
    /// screen.rs's message with a 20 000-deep header in a loaded suite run
    /// (the whole test takes about 4 s on an idle machine).
    pub async fn frame(&mut self) -> Option<Frame> {
        let decoder = FrameDecoder::new(u32::MAX);
        loop {
            if let Some(frame) = decoder
                .decode(&mut self.buf)
                .expect("server sent a valid frame")
            {
                return Some(frame);
            }
            match tokio::time::timeout(Duration::from_secs(90), self.stream.read_buf(&mut self.buf))
                .await
            {
                Ok(Ok(0)) | Ok(Err(_)) => return None,
                Ok(Ok(_)) => {}
                Err(_) => panic!("no frame from the server in 90 s"),
            }
        }
    }

    /// Next method, skipping heartbeats.
    pub async fn method(&mut self) -> Option<AMQPClass> {
        loop {
            let frame = self.frame().await?;
            if frame.kind == FrameType::Method {
                return Some(method::decode_any(&frame.payload()).unwrap());
            }
        }
    }

    /// Opens channel `ch` and waits for its open-ok.
    pub async fn open_channel(&mut self, ch: u16) {
        let open = AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}));
        self.send(&method::encode(ch, &open)).await;
        match self.method().await {
            Some(AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))) => {}
            other => panic!("expected channel.open-ok, got {other:?}"),
        }
    }

    /// A `basic.consume` of `queue` on `ch` with manual acks, tag "c".
    pub fn consume_frame(ch: u16, queue: &str) -> bytes::Bytes {
        method::encode(
            ch,
            &AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: queue.into(),
                consumer_tag: "c".into(),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        )
    }

    /// Consumes `queue` on `ch` (see [`RawClient::consume_frame`]) and
    /// waits for the consume-ok.
    pub async fn consume(&mut self, ch: u16, queue: &str) {
        self.send(&Self::consume_frame(ch, queue)).await;
        match self.method().await {
            Some(AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_))) => {}
            other => panic!("expected consume-ok, got {other:?}"),
        }
    }

    /// The next delivery's tag, once its (non-empty) content has been read.
    pub async fn delivery(&mut self) -> u64 {
        let tag = match self.method().await {
            Some(AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) => d.delivery_tag,
            other => panic!("expected a delivery, got {other:?}"),
        };
        while self.frame().await.expect("content").kind != FrameType::Body {}
        tag
    }

    /// Reads until the server closes, answering a `connection.close`.
    pub async fn ending(&mut self) -> Ending {
        while let Some(class) = self.method().await {
            if let AMQPClass::Connection(connection::AMQPMethod::Close(c)) = class {
                let _ = self.stream.write_all(&method::connection_close_ok()).await;
                return Ending::Close(c.reply_code, c.reply_text.to_string());
            }
        }
        Ending::Eof
    }

    /// Protocol header, then waits for `connection.start`.
    pub async fn start(addr: SocketAddr) -> Self {
        let mut client = Self::connect(addr).await;
        client.send(PROTOCOL_HEADER).await;
        match client.method().await {
            Some(AMQPClass::Connection(connection::AMQPMethod::Start(_))) => client,
            other => panic!("expected connection.start, got {other:?}"),
        }
    }

    /// A full handshake as guest on `/` with the given tune values.
    pub async fn open(addr: SocketAddr, frame_max: u32, heartbeat: u16) -> Self {
        let mut client = Self::start(addr).await;
        let start_ok =
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: FieldTable::default(),
                mechanism: "PLAIN".into(),
                response: LongString::from("\0guest\0guest"),
                locale: "en_US".into(),
            }));
        client.send(&method::encode(0, &start_ok)).await;
        match client.method().await {
            Some(AMQPClass::Connection(connection::AMQPMethod::Tune(_))) => {}
            other => panic!("expected connection.tune, got {other:?}"),
        }
        let tune_ok = AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 16,
            frame_max,
            heartbeat,
        }));
        client.send(&method::encode(0, &tune_ok)).await;
        let open = AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        }));
        client.send(&method::encode(0, &open)).await;
        match client.method().await {
            Some(AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))) => client,
            other => panic!("expected connection.open-ok, got {other:?}"),
        }
    }
}

/// What the relay does with bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelayMode {
    Forward,
    /// Keep the sockets open but move nothing (a hung broker).
    Freeze,
    /// Drop every socket at once (a killed broker socket).
    Kill,
}

/// A TCP relay between nackd and the real broker.
pub struct Relay {
    pub addr: SocketAddr,
    mode: Arc<watch::Sender<RelayMode>>,
}

impl Relay {
    pub async fn start(target: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, _) = watch::channel(RelayMode::Forward);
        let mode = Arc::new(mode);
        let target = target.to_string();
        let m = mode.clone();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let outbound = TcpStream::connect(&target).await.unwrap();
                tokio::spawn(pipe(inbound, outbound, m.subscribe()));
            }
        });
        Self { addr, mode }
    }

    pub fn set(&self, mode: RelayMode) {
        self.mode.send_replace(mode);
    }
}

async fn pipe(a: TcpStream, b: TcpStream, mut mode: watch::Receiver<RelayMode>) {
    let (mut ar, mut aw) = a.into_split();
    let (mut br, mut bw) = b.into_split();
    let mut abuf = vec![0u8; 65536];
    let mut bbuf = vec![0u8; 65536];
    loop {
        let current = *mode.borrow_and_update();
        match current {
            RelayMode::Kill => return,
            RelayMode::Freeze => {
                if mode.changed().await.is_err() {
                    return;
                }
                continue;
            }
            RelayMode::Forward => {}
        }
        tokio::select! {
            _ = mode.changed() => {}
            r = ar.read(&mut abuf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => if bw.write_all(&abuf[..n]).await.is_err() { return },
            },
            r = br.read(&mut bbuf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => if aw.write_all(&bbuf[..n]).await.is_err() { return },
            },
        }
    }
}

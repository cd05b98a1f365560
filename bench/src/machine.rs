//! What a result was measured on: CPUs, load, and the broker's product and
//! version as it announces them in `connection.start`.

use std::time::Duration;

use amq_protocol::protocol::{connection, AMQPClass};
use amq_protocol::types::AMQPValue;
use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use nackd_core::protocol::frame::{FrameDecoder, FrameType, PROTOCOL_HEADER};
use nackd_core::protocol::method;

/// The machine and broker a run measured.
#[derive(Clone, Debug)]
pub struct Machine {
    /// CPUs this process may use.
    pub cpus: usize,
    /// `model name` from /proc/cpuinfo.
    pub cpu_model: String,
    /// /proc/loadavg (1, 5, 15 min).
    pub load: String,
    /// `product version` from the broker's server properties.
    pub broker: String,
}

impl Machine {
    /// Reads /proc and asks the broker at `broker_addr` for its version.
    pub async fn probe(broker_addr: &str) -> Self {
        let broker =
            match tokio::time::timeout(Duration::from_secs(5), broker_version(broker_addr)).await {
                Ok(Ok(version)) => version,
                Ok(Err(e)) => format!("unknown ({e})"),
                Err(_) => "unknown (no connection.start within 5 s)".into(),
            };
        Self {
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            cpu_model: cpu_model().unwrap_or_else(|| "unknown".into()),
            load: load_average(),
            broker,
        }
    }
}

/// `model name` of the first CPU.
fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_owned())
}

/// The three load averages of /proc/loadavg.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|t| t.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Sends the protocol header, reads `connection.start`, and hangs up: lapin
/// does not keep the server properties, the frame layer can read them.
async fn broker_version(addr: &str) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
    let mut tcp = TcpStream::connect(addr).await?;
    tcp.write_all(PROTOCOL_HEADER).await?;
    let decoder = FrameDecoder::default();
    let mut buf = BytesMut::with_capacity(4096);
    let frame = loop {
        if let Some(frame) = decoder.decode(&mut buf)? {
            break frame;
        }
        if tcp.read_buf(&mut buf).await? == 0 {
            return Err("broker closed before connection.start".into());
        }
    };
    if frame.kind != FrameType::Method {
        return Err("first frame is not a method".into());
    }
    let AMQPClass::Connection(connection::AMQPMethod::Start(start)) =
        method::decode_any(&frame.payload())?
    else {
        return Err("first method is not connection.start".into());
    };
    let props = start.server_properties.inner();
    let text = |key: &str| match props.get(key) {
        Some(AMQPValue::LongString(s)) => s.to_string(),
        Some(AMQPValue::ShortString(s)) => s.to_string(),
        _ => "?".into(),
    };
    Ok(format!("{} {}", text("product"), text("version")))
}

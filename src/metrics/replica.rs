//! Whether this instance's replica stream exists: what `/readyz` reports
//! under `"store"` while it does not, and `nackd_replica_missing`.

use std::sync::Mutex;

use prometheus_client::metrics::gauge::Gauge;

/// The generation stream found missing, if it is.
#[derive(Debug, Default)]
pub struct ReplicaMissing {
    stream: Mutex<Option<String>>,
    pub(super) gauge: Gauge,
}

impl ReplicaMissing {
    /// `Some(stream)`: that stream is gone; `None`: a stream exists again.
    pub fn set(&self, stream: Option<&str>) {
        self.gauge.set(i64::from(stream.is_some()));
        *self.stream.lock().unwrap_or_else(|e| e.into_inner()) = stream.map(str::to_owned);
    }

    /// What `/readyz` says while the stream is missing (the operator action
    /// included), else `None`.
    pub fn reason(&self) -> Option<String> {
        let stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        stream
            .as_ref()
            .map(|s| format!("no replica: stream {s} is missing; run `nackd admin replica reseed`"))
    }
}

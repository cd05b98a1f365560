//! `[delayed] registry`: the delayed exchanges every nackd in front of one
//! broker shares, kept in the broker itself, in the stream
//! [`STREAM`] of `[delayed] registry_vhost`.
//!
//! Each instance follows the stream from its first record on. A `delayed`
//! record says an exchange was declared `x-delayed-message` through some
//! instance, an `undelayed` one that it was deleted; of one exchange's
//! records the later wins. What this instance's sessions change (a declare
//! or delete the broker accepted in the client's name) is appended, and
//! comes back to it as anyone's does. A change not appended yet is newer
//! than anything read for its exchange: records of that exchange are not
//! applied meanwhile.
//!
//! The set is synced ([`DelayedExchanges::synced`]) once the stream is read
//! to the marker this instance appended when it began to read. Before, and
//! from a lost connection until the next read reaches its marker, an
//! x-delay publish to an exchange this instance does not know as delayed
//! is refused, never routed at once (the session core does that). At the
//! first read, what the local file lists and the stream has never named
//! (exchanges declared before the registry was turned on) is appended;
//! `[[delayed_exchange]]` tables stay this instance's own.
//!
//! Written here, not taken from a crate: the records, the stream and the
//! replica client ([`crate::replica::client`]) are nackd's own.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::replica::client::{Client, ClientError, Followed, StreamFollower};
use crate::replica::{Record, Target};
use nackd_core::delayed::{Change, DelayedExchange, DelayedExchanges, TYPE};

/// The stream every instance reads and writes.
pub const STREAM: &str = "nackd.delayed-exchanges";

/// The first wait after a failure, doubled up to [`BACKOFF_MAX`].
const BACKOFF: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(15);

type Key = (String, String);

/// Changes this instance made and did not append yet: the last of each
/// exchange (`None`: deleted).
#[derive(Default)]
struct Pending {
    changes: Mutex<BTreeMap<Key, Option<String>>>,
    wake: Notify,
}

impl Pending {
    fn push(&self, change: Change) {
        let (key, kind) = match change {
            Change::Declared(e) => ((e.vhost, e.name), Some(e.kind)),
            Change::Deleted { vhost, name } => ((vhost, name), None),
        };
        self.lock().insert(key, kind);
        self.wake.notify_one();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<Key, Option<String>>> {
        self.changes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn holds(&self, key: &Key) -> bool {
        self.lock().contains_key(key)
    }
}

/// Shares `set` through the registry of `target`: from now on it is not
/// synced until the stream is read, and the task follows the stream until
/// `stop`. `pinned`: the `[[delayed_exchange]]` tables, never appended.
pub fn spawn(
    target: Target,
    set: Arc<DelayedExchanges>,
    pinned: BTreeSet<Key>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    set.set_synced(false);
    metrics.delayed.registry_synced.set(0);
    let pending = Arc::new(Pending::default());
    let sink = pending.clone();
    set.share_with(Box::new(move |change| sink.push(change)));
    let registry = Registry {
        target,
        set,
        pinned,
        metrics,
        pending,
        first: true,
    };
    tokio::spawn(registry.run(stop));
}

struct Registry {
    target: Target,
    set: Arc<DelayedExchanges>,
    pinned: BTreeSet<Key>,
    metrics: Arc<Metrics>,
    pending: Arc<Pending>,
    /// No read reached its marker yet (the local file is uploaded then).
    first: bool,
}

impl Registry {
    async fn run(mut self, stop: CancellationToken) {
        let mut backoff = BACKOFF;
        loop {
            let outcome = tokio::select! {
                () = stop.cancelled() => return,
                outcome = self.follow(&mut backoff) => outcome,
            };
            self.set.set_synced(false);
            self.metrics.delayed.registry_synced.set(0);
            if let Err(e) = outcome {
                warn!(error = %e, stream = STREAM, vhost = %self.target.vhost, retry_in = ?backoff, "delayed exchanges: the shared registry cannot be read; until it is, x-delay publishes to exchanges not known here as delayed are refused");
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// One connection's life: read to the end, then follow and append.
    async fn follow(&mut self, backoff: &mut Duration) -> Result<(), ClientError> {
        let client = Client::connect(&self.target, 0, "nackd delayed-exchange registry").await?;
        let outcome = self.follow_on(&client, backoff).await;
        client.close().await;
        outcome
    }

    async fn follow_on(
        &mut self,
        client: &Client,
        backoff: &mut Duration,
    ) -> Result<(), ClientError> {
        client.declare_stream(STREAM).await?;
        let mut follower = client.follow(STREAM).await?;
        let records = self.catch_up(client, &mut follower).await?;
        *backoff = BACKOFF;
        info!(
            stream = STREAM,
            vhost = %self.target.vhost,
            records,
            delayed = self.set.list().len(),
            "delayed exchanges: the shared registry is read; following it"
        );
        self.follow_live(client, follower).await
    }

    /// Reads to the marker, applies the last record of each exchange,
    /// appends what waits, and says the set is synced. Returns how many
    /// records it read.
    async fn catch_up(
        &mut self,
        client: &Client,
        follower: &mut StreamFollower,
    ) -> Result<u64, ClientError> {
        // The last record of each exchange, as of the marker.
        let mut last: BTreeMap<Key, Option<String>> = BTreeMap::new();
        let mut records = 0u64;
        loop {
            match follower.next().await? {
                Followed::Record(record) => {
                    if let Some((key, kind)) = self.change_of(record) {
                        records += 1;
                        last.insert(key, kind);
                    }
                }
                Followed::Unreadable => self.skipped("a message that is no registry record"),
                Followed::CaughtUp => break,
            }
        }
        for (key, kind) in &last {
            self.apply(key.clone(), kind.clone());
        }
        if self.first {
            // Exchanges declared before the registry was turned on.
            for e in self.set.list() {
                let key = (e.vhost.clone(), e.name.clone());
                if !last.contains_key(&key) && !self.pinned.contains(&key) {
                    self.pending.push(Change::Declared(e));
                }
            }
        }
        self.flush(client).await?;
        self.first = false;
        self.set.set_synced(true);
        self.metrics.delayed.registry_synced.set(1);
        Ok(records)
    }

    /// Applies what others change and appends what this instance changes,
    /// until the connection fails.
    async fn follow_live(
        &self,
        client: &Client,
        mut follower: StreamFollower,
    ) -> Result<(), ClientError> {
        // A read is not cancelled half way (it acks what it took): the
        // reads go on in a task of their own, which ends with the
        // connection or with this follow.
        let (read, mut reads) = tokio::sync::mpsc::channel(64);
        let reader = tokio::spawn(async move {
            loop {
                let next = follower.next().await;
                let failed = next.is_err();
                if read.send(next).await.is_err() || failed {
                    return;
                }
            }
        });
        let outcome = loop {
            tokio::select! {
                next = reads.recv() => match next {
                    Some(Ok(Followed::Record(record))) => {
                        if let Some((key, kind)) = self.change_of(record) {
                            self.apply(key, kind);
                        }
                    }
                    Some(Ok(Followed::Unreadable)) => {
                        self.skipped("a message that is no registry record");
                    }
                    Some(Ok(Followed::CaughtUp)) => {}
                    Some(Err(e)) => break Err(e),
                    None => break Err(ClientError::Timeout(STREAM.into())),
                },
                () = self.pending.wake.notified() => {
                    if let Err(e) = self.flush(client).await {
                        break Err(e);
                    }
                }
            }
        };
        reader.abort();
        outcome
    }

    /// Appends what this instance changed, each once the broker confirmed
    /// it; what could not be appended waits for the next connection.
    async fn flush(&self, client: &Client) -> Result<(), ClientError> {
        let changes = std::mem::take(&mut *self.pending.lock());
        let mut left = changes.iter();
        while let Some((key, kind)) = left.next() {
            let record = match kind {
                Some(kind) => Record::Delayed {
                    vhost: key.0.clone(),
                    name: key.1.clone(),
                    kind: kind.clone(),
                },
                None => Record::Undelayed {
                    vhost: key.0.clone(),
                    name: key.1.clone(),
                },
            };
            if let Err(e) = client.append_confirmed(STREAM, &record).await {
                // Put back what did not go, unless changed again since.
                let mut pending = self.pending.lock();
                for (key, kind) in std::iter::once((key, kind)).chain(left) {
                    pending.entry(key.clone()).or_insert_with(|| kind.clone());
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// A change read from the stream, unless one of this instance's own
    /// for the same exchange waits to be appended (it is newer).
    fn apply(&self, key: Key, kind: Option<String>) {
        if self.pending.holds(&key) {
            return;
        }
        let (vhost, name) = key;
        let change = match kind {
            Some(kind) => Change::Declared(DelayedExchange { vhost, name, kind }),
            None => Change::Deleted { vhost, name },
        };
        if self.set.apply(&change) {
            self.metrics.delayed.registry_applied.inc();
        } else {
            warn!(?change, "delayed exchanges: a declare read from the shared registry is not applied: its vhost has [delayed] max_exchanges already");
            self.metrics.delayed.registry_skipped.inc();
        }
    }

    /// What a record says of which exchange, if it is a valid registry
    /// record (others are skipped, counted and logged).
    fn change_of(&self, record: Record) -> Option<(Key, Option<String>)> {
        let (vhost, name, kind) = match record {
            Record::Delayed { vhost, name, kind } => (vhost, name, Some(kind)),
            Record::Undelayed { vhost, name } => (vhost, name, None),
            _ => {
                self.skipped("a record of another stream");
                return None;
            }
        };
        let name_ok = |s: &str| !s.is_empty() && s.len() <= 255;
        let valid = name_ok(&vhost)
            && name_ok(&name)
            && kind.as_deref().is_none_or(|k| name_ok(k) && k != TYPE);
        if !valid {
            self.skipped("a record naming no valid exchange");
            return None;
        }
        Some(((vhost, name), kind))
    }

    fn skipped(&self, what: &str) {
        warn!(
            stream = STREAM,
            what, "delayed exchanges: skipped in the shared registry"
        );
        self.metrics.delayed.registry_skipped.inc();
    }
}

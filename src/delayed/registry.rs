//! `[delayed] registry`: the delayed exchanges every nackd in front of one
//! broker shares, kept in the broker itself, in the stream [`STREAM`] of
//! `[delayed] registry_vhost`.
//!
//! Each instance follows the stream from its first record on. A `delayed`
//! record says an exchange was declared `x-delayed-message` through some
//! instance, an `undelayed` one that it was deleted; of one exchange's
//! records the later wins. What this instance's sessions change (a
//! declare or delete the broker accepted in the client's name) is kept as
//! *unshared* in the set, and saved with it, until the broker confirmed
//! its record here ([`DelayedExchanges::shared_done`]): a restart or a
//! lost connection meanwhile writes it then. Records of an exchange are
//! not applied while a change of it is unshared, nor while a record this
//! process wrote of it has not come back (each process signs its records
//! with a random `origin`): what it wrote is newer than what it reads
//! before its own.
//!
//! The set is synced ([`DelayedExchanges::synced`]) once the stream is
//! read to the marker this instance appended when it began to read.
//! Before, and from a lost connection until the next read reaches its
//! marker, an x-delay publish to an exchange this instance does not know
//! as delayed is refused, never routed at once (the session core does
//! that). At each read, what the set lists and the stream never named
//! (exchanges declared before the registry was on, or a deleted stream)
//! is written; `[[delayed_exchange]]` tables stay this instance's own:
//! never written, never changed by a record.
//!
//! Written here, not taken from a crate: the records, the stream and the
//! replica client ([`crate::replica::client`]) are nackd's own.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::replica::client::{Client, ClientError, Followed, StreamFollower};
use crate::replica::{Record, Target};
use nackd_core::delayed::{Change, DelayedExchanges, Key, TYPE};

/// The stream every instance reads and writes.
pub const STREAM: &str = "nackd.delayed-exchanges";

/// The first wait after a failure, doubled up to [`BACKOFF_MAX`].
const BACKOFF: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(15);
/// A record the broker has not confirmed within this is written again
/// on a new connection.
const APPEND_WITHIN: Duration = Duration::from_secs(10);

/// Shares `set` through the registry of `target`: from now on it is not
/// synced until the stream is read, its changes (and `unshared`, those an
/// earlier run did not write) go to the stream, and the task follows the
/// stream until `stop`. `pinned`: the `[[delayed_exchange]]` tables.
pub fn spawn(
    target: Target,
    set: Arc<DelayedExchanges>,
    unshared: Vec<Change>,
    pinned: BTreeSet<Key>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    set.set_synced(false);
    metrics.delayed.registry_synced.set(0);
    let wake = Arc::new(Notify::new());
    let waker = wake.clone();
    set.share_with(unshared, Box::new(move || waker.notify_one()));
    let registry = Registry {
        target,
        set,
        pinned,
        metrics,
        wake,
        origin: fastrand::u64(..),
        echoes: HashMap::new(),
    };
    tokio::spawn(registry.run(stop));
}

struct Registry {
    target: Target,
    set: Arc<DelayedExchanges>,
    pinned: BTreeSet<Key>,
    metrics: Arc<Metrics>,
    /// Told when a change waits to be written.
    wake: Arc<Notify>,
    /// Signs this process's records.
    origin: u64,
    /// Records this process wrote on this connection and has not read
    /// back, by exchange.
    echoes: HashMap<Key, usize>,
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

    /// One connection's life: write what waits, read to the end, then
    /// follow and write.
    async fn follow(&mut self, backoff: &mut Duration) -> Result<(), ClientError> {
        self.echoes.clear();
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
        // Written before the marker: read back before it.
        self.flush(client).await?;
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

    /// Reads to the marker, applies what it says of each exchange, writes
    /// what the stream never named, and says the set is synced. Returns
    /// how many records it read.
    async fn catch_up(
        &mut self,
        client: &Client,
        follower: &mut StreamFollower,
    ) -> Result<u64, ClientError> {
        let mut named: BTreeSet<Key> = BTreeSet::new();
        let mut last: BTreeMap<Key, Option<String>> = BTreeMap::new();
        let mut records = 0u64;
        loop {
            match follower.next().await? {
                Followed::Record(record) => {
                    let Some((key, kind, origin)) = self.change_of(record) else {
                        continue;
                    };
                    records += 1;
                    named.insert(key.clone());
                    if self.takes(&key, origin) {
                        last.insert(key, kind);
                    }
                }
                Followed::Unreadable => self.skipped("a message that is no registry record"),
                Followed::CaughtUp => break,
            }
        }
        for (key, kind) in last {
            self.apply(key, kind);
        }
        for e in self.set.list() {
            let key = (e.vhost.clone(), e.name.clone());
            if !named.contains(&key) && !self.pinned.contains(&key) {
                self.set.reshare(Change::Declared(e));
            }
        }
        self.flush(client).await?;
        self.set.set_synced(true);
        self.metrics.delayed.registry_synced.set(1);
        Ok(records)
    }

    /// Applies what others change and writes what this instance changes,
    /// until the connection fails.
    async fn follow_live(
        &mut self,
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
        let wake = self.wake.clone();
        let outcome = loop {
            tokio::select! {
                next = reads.recv() => match next {
                    Some(Ok(Followed::Record(record))) => {
                        if let Some((key, kind, origin)) = self.change_of(record) {
                            if self.takes(&key, origin) {
                                self.apply(key, kind);
                            }
                        }
                    }
                    Some(Ok(Followed::Unreadable)) => {
                        self.skipped("a message that is no registry record");
                    }
                    Some(Ok(Followed::CaughtUp)) => {}
                    Some(Err(e)) => break Err(e),
                    None => break Err(ClientError::Timeout(STREAM.into())),
                },
                () = wake.notified() => {
                    if let Err(e) = self.flush(client).await {
                        break Err(e);
                    }
                }
            }
        };
        reader.abort();
        outcome
    }

    /// Writes every unshared change, each confirmed by the broker before
    /// it stops being kept.
    async fn flush(&mut self, client: &Client) -> Result<(), ClientError> {
        for change in self.set.unshared() {
            let (key, kind) = change.clone().into_parts();
            let (vhost, name) = key.clone();
            let origin = self.origin;
            let record = match kind {
                Some(kind) => Record::Delayed {
                    origin,
                    vhost,
                    name,
                    kind,
                },
                None => Record::Undelayed {
                    origin,
                    vhost,
                    name,
                },
            };
            match tokio::time::timeout(APPEND_WITHIN, client.append_confirmed(STREAM, &record))
                .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    return Err(ClientError::Unreachable(format!(
                        "a write to {STREAM} was not confirmed within {APPEND_WITHIN:?}"
                    )))
                }
            }
            *self.echoes.entry(key).or_default() += 1;
            self.set.shared_done(&change);
        }
        Ok(())
    }

    /// Whether a record of `key` written by `origin` counts: not while
    /// this process has a newer change of it (unshared, or written and
    /// not read back yet), nor for a `[[delayed_exchange]]` table.
    fn takes(&mut self, key: &Key, origin: u64) -> bool {
        if origin == self.origin {
            if let Some(n) = self.echoes.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    self.echoes.remove(key);
                }
            }
        }
        !self.echoes.contains_key(key) && !self.set.is_unshared(key) && !self.pinned.contains(key)
    }

    fn apply(&self, key: Key, kind: Option<String>) {
        let change = Change::of(key, kind);
        if self.set.apply(&change) {
            self.metrics.delayed.registry_applied.inc();
        } else {
            warn!(?change, "delayed exchanges: a declare read from the shared registry is not applied: its vhost has [delayed] max_exchanges already");
            self.metrics.delayed.registry_skipped.inc();
        }
    }

    /// What a record says of which exchange, and who wrote it, if it is a
    /// valid registry record (others are skipped, counted and logged).
    fn change_of(&self, record: Record) -> Option<(Key, Option<String>, u64)> {
        let (origin, vhost, name, kind) = match record {
            Record::Delayed {
                origin,
                vhost,
                name,
                kind,
            } => (origin, vhost, name, Some(kind)),
            Record::Undelayed {
                origin,
                vhost,
                name,
            } => (origin, vhost, name, None),
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
        Some(((vhost, name), kind, origin))
    }

    fn skipped(&self, what: &str) {
        warn!(
            stream = STREAM,
            what, "delayed exchanges: skipped in the shared registry"
        );
        self.metrics.delayed.registry_skipped.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nackd_core::delayed::DelayedExchange;

    fn registry(pinned: &[&str]) -> Registry {
        let target = Target {
            nodes: vec!["127.0.0.1:1".into()],
            vhost: "/".into(),
            username: "u".into(),
            password: "p".into(),
            heartbeat: Duration::from_secs(1),
            cluster_size: None,
            tls: None,
        };
        let set = DelayedExchanges::new([], 10, None);
        set.share_with([], Box::new(|| {}));
        Registry {
            target,
            set,
            pinned: pinned.iter().map(|n| ("/".into(), (*n).into())).collect(),
            metrics: Metrics::new(),
            wake: Arc::default(),
            origin: 7,
            echoes: HashMap::new(),
        }
    }

    fn key(name: &str) -> Key {
        ("/".into(), name.into())
    }

    #[test]
    fn records_of_an_exchange_wait_for_this_processs_own_to_come_back() {
        let mut r = registry(&[]);
        assert!(r.takes(&key("x"), 1), "nothing of ours: another's counts");
        // Two of ours written, not read back: what comes before them is older.
        r.echoes.insert(key("x"), 2);
        assert!(!r.takes(&key("x"), 1));
        assert!(!r.takes(&key("x"), 7), "our first: the second is newer");
        assert!(!r.takes(&key("x"), 1));
        assert!(r.takes(&key("x"), 7), "our last counts");
        assert!(r.takes(&key("x"), 1), "what comes after it counts");
        assert!(r.takes(&key("y"), 1), "other exchanges are not held up");
    }

    #[test]
    fn an_unshared_change_or_a_table_is_never_overridden_by_a_record() {
        let mut r = registry(&["pinned"]);
        assert!(!r.takes(&key("pinned"), 1));
        r.set.declare("/", "mine", "direct");
        assert!(!r.takes(&key("mine"), 1), "ours is newer, not written yet");
        r.set.shared_done(&Change::Declared(DelayedExchange {
            vhost: "/".into(),
            name: "mine".into(),
            kind: "direct".into(),
        }));
        assert!(r.takes(&key("mine"), 1));
    }

    #[test]
    fn only_valid_registry_records_are_changes() {
        let r = registry(&[]);
        let delayed = |vhost: &str, name: &str, kind: &str| Record::Delayed {
            origin: 1,
            vhost: vhost.into(),
            name: name.into(),
            kind: kind.into(),
        };
        assert_eq!(
            r.change_of(delayed("/", "x", "topic")),
            Some((key("x"), Some("topic".into()), 1))
        );
        assert_eq!(r.change_of(delayed("/", "", "topic")), None);
        assert_eq!(r.change_of(delayed("", "x", "topic")), None);
        assert_eq!(r.change_of(delayed("/", "x", TYPE)), None);
        assert_eq!(r.change_of(delayed("/", &"n".repeat(256), "topic")), None);
        assert_eq!(r.change_of(Record::Generation(3)), None);
        assert_eq!(r.metrics.delayed.registry_skipped.get(), 5);
    }
}

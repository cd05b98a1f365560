//! `[delayed] registry`: the delayed exchanges every nackd in front of one
//! broker shares, kept in the broker itself, in the stream [`STREAM`] of
//! `[delayed] registry_vhost`.
//!
//! Each instance follows the stream from its first record on. A `delayed`
//! record says an exchange was declared `x-delayed-message` through some
//! instance, an `undelayed` one that it was deleted. Each carries its
//! [`Version`]: when it was made (on its maker's clock) and by which
//! process; of one exchange's changes the newest wins, wherever it was
//! made and whenever it is read, so a change written late (after an
//! outage, a restart) does not undo a newer one made elsewhere. What this
//! instance's sessions change (a declare or delete the broker accepted in
//! the client's name) is kept as *unshared* in the set, and saved with
//! it, until the broker confirmed its record here
//! ([`DelayedExchanges::shared_done`]): a restart or a lost connection
//! meanwhile writes it then.
//!
//! The set is synced ([`DelayedExchanges::synced`]) once the stream is
//! read to the marker this instance appended when it began to read.
//! Before, and from a lost connection until the next read reaches its
//! marker, an x-delay publish to an exchange this instance does not know
//! as delayed is refused, never routed at once, and every declare and
//! delete is written, news or not (the session core and the set do
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
use nackd_core::clock::Clock;
use nackd_core::delayed::{Change, DelayedExchanges, Key, Sharing, Version, TYPE};

/// The stream every instance reads and writes.
pub const STREAM: &str = "nackd.delayed-exchanges";

/// The first wait after a failure, doubled up to [`BACKOFF_MAX`].
const BACKOFF: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(15);
/// A record the broker has not confirmed within this is written again
/// on a new connection.
const APPEND_WITHIN: Duration = Duration::from_secs(10);

/// Shares `set` through the registry of `target`: from now on it is not
/// synced until the stream is read, its changes (dated by `clock`) and
/// those an earlier run kept go to the stream, and the task follows the
/// stream until `stop`. `pinned`: the `[[delayed_exchange]]` tables.
pub fn spawn(
    target: Target,
    set: Arc<DelayedExchanges>,
    pinned: BTreeSet<Key>,
    clock: &Clock,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    set.set_synced(false);
    metrics.delayed.registry_synced.set(0);
    let wake = Arc::new(Notify::new());
    let waker = wake.clone();
    set.share_with(Sharing {
        clock: clock.clone(),
        origin: fastrand::u64(..),
        wake: Box::new(move || waker.notify_one()),
    });
    let registry = Registry {
        target,
        set,
        pinned,
        metrics,
        wake,
        newest: HashMap::new(),
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
    /// The newest version of each exchange read or written on this
    /// connection.
    newest: HashMap<Key, Version>,
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
        self.newest.clear();
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

    /// Reads to the marker, applies what it says of each exchange, writes
    /// what the stream never named, and says the set is synced. Returns
    /// how many records it read.
    async fn catch_up(
        &mut self,
        client: &Client,
        follower: &mut StreamFollower,
    ) -> Result<u64, ClientError> {
        let mut named: BTreeSet<Key> = BTreeSet::new();
        let mut newest: BTreeMap<Key, (Option<String>, Version)> = BTreeMap::new();
        let mut records = 0u64;
        loop {
            match follower.next().await? {
                Followed::Record(record) => {
                    let Some((key, kind, version)) = self.change_of(record) else {
                        continue;
                    };
                    records += 1;
                    named.insert(key.clone());
                    if newest.get(&key).is_none_or(|(_, v)| *v <= version) {
                        newest.insert(key, (kind, version));
                    }
                }
                Followed::Unreadable => self.skipped("a message that is no registry record"),
                Followed::CaughtUp => break,
            }
        }
        for (key, (kind, version)) in newest {
            self.take(key, kind, version);
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
                        if let Some((key, kind, version)) = self.change_of(record) {
                            self.take(key, kind, version);
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
    /// it stops being kept; one older than what the stream has of its
    /// exchange is dropped unwritten.
    async fn flush(&mut self, client: &Client) -> Result<(), ClientError> {
        for (change, version) in self.set.unshared() {
            let (key, kind) = change.clone().into_parts();
            if self.newest.get(&key).is_some_and(|v| *v > version) {
                self.set.shared_done(&change, version);
                continue;
            }
            let ((vhost, name), (at, origin)) = (key.clone(), version);
            let record = match kind {
                Some(kind) => Record::Delayed {
                    at,
                    origin,
                    vhost,
                    name,
                    kind,
                },
                None => Record::Undelayed {
                    at,
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
            self.newer(&key, version);
            self.set.shared_done(&change, version);
        }
        Ok(())
    }

    /// Whether `version` is the newest of `key` seen on this connection
    /// (it then is).
    fn newer(&mut self, key: &Key, version: Version) -> bool {
        match self.newest.get(key) {
            Some(v) if *v > version => false,
            _ => {
                self.newest.insert(key.clone(), version);
                true
            }
        }
    }

    /// A record read: applied if it is the newest change of its exchange
    /// here (an unshared change made here may be newer: the set says), and
    /// the exchange is not a `[[delayed_exchange]]` table.
    fn take(&mut self, key: Key, kind: Option<String>, version: Version) {
        if !self.newer(&key, version) || self.pinned.contains(&key) {
            return;
        }
        let change = Change::of(key, kind);
        if self.set.apply_record(&change, version) {
            self.metrics.delayed.registry_applied.inc();
        }
    }

    /// What a record says of which exchange, and its version, if it is a
    /// valid registry record (others are skipped, counted and logged).
    fn change_of(&self, record: Record) -> Option<(Key, Option<String>, Version)> {
        let (version, vhost, name, kind) = match record {
            Record::Delayed {
                at,
                origin,
                vhost,
                name,
                kind,
            } => ((at, origin), vhost, name, Some(kind)),
            Record::Undelayed {
                at,
                origin,
                vhost,
                name,
            } => ((at, origin), vhost, name, None),
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
        Some(((vhost, name), kind, version))
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
        set.share_with(Sharing {
            clock: Clock::manual(10_000),
            origin: 7,
            wake: Box::new(|| {}),
        });
        Registry {
            target,
            set,
            pinned: pinned.iter().map(|n| ("/".into(), (*n).into())).collect(),
            metrics: Metrics::new(),
            wake: Arc::default(),
            newest: HashMap::new(),
        }
    }

    fn key(name: &str) -> Key {
        ("/".into(), name.into())
    }

    fn delayed(r: &Registry, name: &str) -> bool {
        r.set.is_delayed("/", name)
    }

    #[test]
    fn of_an_exchanges_records_the_newest_wins_in_any_order() {
        let mut r = registry(&[]);
        r.take(key("x"), Some("direct".into()), (100, 1));
        assert!(delayed(&r, "x"));
        r.take(key("x"), None, (50, 2)); // older, written late
        assert!(
            delayed(&r, "x"),
            "a late write does not undo a newer change"
        );
        r.take(key("x"), None, (100, 3)); // same ms, higher process
        assert!(!delayed(&r, "x"));
        r.take(key("x"), Some("topic".into()), (100, 2));
        assert!(!delayed(&r, "x"));
    }

    #[test]
    fn a_change_made_here_and_not_written_beats_older_records() {
        let mut r = registry(&[]);
        r.set.declare("/", "mine", "direct"); // at 10 000, process 7
        r.take(key("mine"), None, (9_000, 1));
        assert!(delayed(&r, "mine"), "ours is newer");
        assert_eq!(r.set.unshared().len(), 1, "and still to be written");
        r.take(key("mine"), None, (11_000, 1));
        assert!(!delayed(&r, "mine"), "a newer one elsewhere wins");
        assert!(r.set.unshared().is_empty(), "ours is not written then");
    }

    #[test]
    fn a_table_is_never_changed_by_a_record() {
        let mut r = registry(&["pinned"]);
        r.set
            .apply_record(&Change::of(key("pinned"), Some("direct".into())), (0, 0));
        r.take(key("pinned"), None, (99_999, 1));
        assert!(delayed(&r, "pinned"));
    }

    #[test]
    fn only_valid_registry_records_are_changes() {
        let r = registry(&[]);
        let delayed = |vhost: &str, name: &str, kind: &str| Record::Delayed {
            at: 5,
            origin: 1,
            vhost: vhost.into(),
            name: name.into(),
            kind: kind.into(),
        };
        assert_eq!(
            r.change_of(delayed("/", "x", "topic")),
            Some((key("x"), Some("topic".into()), (5, 1)))
        );
        assert_eq!(r.change_of(delayed("/", "", "topic")), None);
        assert_eq!(r.change_of(delayed("", "x", "topic")), None);
        assert_eq!(r.change_of(delayed("/", "x", TYPE)), None);
        assert_eq!(r.change_of(delayed("/", &"n".repeat(256), "topic")), None);
        assert_eq!(r.change_of(Record::Generation(3)), None);
        assert_eq!(r.metrics.delayed.registry_skipped.get(), 5);
    }
}

//! The exchanges nackd emulates as `x-delayed-message` (the archived
//! plugin's type): which `(vhost, exchange)` are delayed, and of which
//! real type the broker has them.
//!
//! Sessions learn them from the declares the broker accepted and forget
//! them on the deletes it accepted (never before its answer: a refused
//! declare or delete changes nothing); the `nackd` crate loads the set at
//! startup (its file in the store directory, the `[[delayed_exchange]]`
//! tables) and keeps it durable off the session threads: every change
//! wakes the [`Persist`] hook, which only signals a writer. Each vhost
//! holds at most [`DelayedExchanges::limit`] of them. Every publish asks
//! [`DelayedExchanges::is_delayed`]: one atomic load while no exchange is
//! delayed.
//!
//! Instances that share a broker may share the set too (`[delayed]
//! registry`): every change a session makes is then also kept as
//! *unshared* ([`DelayedExchanges::unshared`]), saved with the set, until
//! the `nackd` crate has written it to the stream every instance reads
//! ([`DelayedExchanges::shared_done`]); the changes read there come back
//! through [`DelayedExchanges::apply`]. Until it has read that stream to
//! its end the set is not [`synced`](DelayedExchanges::synced): an
//! exchange it does not list may be delayed all the same, and a delete
//! the broker accepted is kept as unshared even for an exchange the set
//! does not list.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// The type name the plugin registered, which nackd emulates.
pub const TYPE: &str = "x-delayed-message";
/// The declare argument naming the real type.
pub const TYPE_ARG: &str = "x-delayed-type";
/// The publish header carrying the delay in milliseconds.
pub const DELAY_HEADER: &str = "x-delay";
/// The longest hold: an `x-delay` above it (up to 2^63 ms) is held this
/// long, 100 years, within what the wheel and the clock's microseconds
/// count exactly.
pub const MAX_DELAY_MS: u64 = 100 * 365 * 24 * 3600 * 1000;

/// One delayed exchange.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DelayedExchange {
    /// Virtual host.
    pub vhost: String,
    /// Exchange name.
    pub name: String,
    /// The real type on the broker (`x-delayed-type`: direct, topic, …).
    pub kind: String,
}

/// Told that the set changed (after the change): it must not block, the
/// caller is a session's thread. The `nackd` crate's hook wakes a writer
/// that saves [`DelayedExchanges::list`] as it is then.
pub type Persist = Box<dyn Fn() + Send + Sync>;

/// A change a session made (the broker accepted the declare or delete),
/// or one another instance made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Declared delayed (or declared again with another real type).
    Declared(DelayedExchange),
    /// Deleted.
    Deleted {
        /// Virtual host.
        vhost: String,
        /// Exchange name.
        name: String,
    },
}

impl Change {
    /// The change of `key`: declared of real type `kind`, or deleted.
    pub fn of(key: Key, kind: Option<String>) -> Self {
        let (vhost, name) = key;
        match kind {
            Some(kind) => Self::Declared(DelayedExchange { vhost, name, kind }),
            None => Self::Deleted { vhost, name },
        }
    }

    /// Its exchange, and its real type (`None`: deleted).
    pub fn into_parts(self) -> (Key, Option<String>) {
        match self {
            Self::Declared(e) => ((e.vhost, e.name), Some(e.kind)),
            Self::Deleted { vhost, name } => ((vhost, name), None),
        }
    }
}

/// Told that an unshared change is waiting: like [`Persist`], it must not
/// block.
pub type Wake = Box<dyn Fn() + Send + Sync>;

/// `(vhost, exchange)`.
pub type Key = (String, String);

/// How many delayed exchanges one vhost may have, unless configured.
pub const DEFAULT_LIMIT: usize = 10_000;

/// The delayed exchanges every session of this nackd knows.
pub struct DelayedExchanges {
    enabled: bool,
    set: RwLock<BTreeMap<(String, String), String>>,
    any: AtomicBool,
    /// Most exchanges a vhost may have delayed (a declare beyond is refused).
    limit: usize,
    /// Declares sent and not answered, each holding a place under `limit`.
    reserved: Mutex<BTreeMap<(String, String), usize>>,
    persist: Option<Persist>,
    /// Whether the set is all there is to know (see the module).
    synced: AtomicBool,
    /// Set once the set is shared: wakes the writer of the registry.
    wake: std::sync::OnceLock<Wake>,
    /// The changes made here and not written to the registry yet: the
    /// last of each exchange (`None`: deleted).
    unshared: Mutex<BTreeMap<Key, Option<String>>>,
}

impl DelayedExchanges {
    /// The set `initial`, kept durable by `persist` (none: memory only).
    /// Each vhost may have `limit` of them (the set may start with more:
    /// no new one is admitted there then).
    pub fn new(
        initial: impl IntoIterator<Item = DelayedExchange>,
        limit: usize,
        persist: Option<Persist>,
    ) -> Arc<Self> {
        let set: BTreeMap<_, _> = initial
            .into_iter()
            .map(|e| ((e.vhost, e.name), e.kind))
            .collect();
        let any = AtomicBool::new(!set.is_empty());
        Arc::new(Self {
            enabled: true,
            set: RwLock::new(set),
            any,
            limit,
            reserved: Mutex::default(),
            persist,
            synced: AtomicBool::new(true),
            wake: std::sync::OnceLock::new(),
            unshared: Mutex::default(),
        })
    }

    /// No emulation (`[delayed] enabled = false`): declares of the type go
    /// to the broker as sent, publishes are never taken.
    pub fn disabled() -> Arc<Self> {
        Arc::new(Self {
            enabled: false,
            set: RwLock::default(),
            any: AtomicBool::new(false),
            limit: 0,
            reserved: Mutex::default(),
            persist: None,
            synced: AtomicBool::new(true),
            wake: std::sync::OnceLock::new(),
            unshared: Mutex::default(),
        })
    }

    /// Most delayed exchanges one vhost may have.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// A declare of `name` of `vhost` goes to the broker: whether it may
    /// make the exchange delayed (it is already, or is being declared, or
    /// its vhost has fewer than [`DelayedExchanges::limit`] counting the
    /// declares not answered yet). `true` keeps a place for it until
    /// [`DelayedExchanges::unreserve`], so that declares sent together
    /// cannot pass the limit together.
    pub fn reserve(&self, vhost: &str, name: &str) -> bool {
        let set = self.set.read().unwrap_or_else(|e| e.into_inner());
        let mut reserved = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        let key = (vhost.to_string(), name.to_string());
        if !set.contains_key(&key) && !reserved.contains_key(&key) {
            let from = (vhost.to_string(), String::new());
            let known = set
                .range(from.clone()..)
                .take_while(|((v, _), _)| v == vhost)
                .take(self.limit)
                .count();
            let waiting = reserved
                .range(from..)
                .take_while(|((v, _), _)| v == vhost)
                .filter(|(k, _)| !set.contains_key(*k))
                .take(self.limit)
                .count();
            if known + waiting >= self.limit {
                return false;
            }
        }
        *reserved.entry(key).or_default() += 1;
        true
    }

    /// The declare [`DelayedExchanges::reserve`] kept a place for is
    /// answered (or will never be).
    pub fn unreserve(&self, vhost: &str, name: &str) {
        let mut reserved = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        let key = (vhost.to_string(), name.to_string());
        if let Some(n) = reserved.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                reserved.remove(&key);
            }
        }
    }

    /// No exchange is delayed, as far as anyone knows (two atomic loads:
    /// every publish asks). While the set is not synced, any might be.
    pub fn none(&self) -> bool {
        !self.any.load(Ordering::Acquire) && self.synced()
    }

    /// Whether the set is known to be whole: always, unless it is shared
    /// and its registry was not read to its end since it was last lost.
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// The registry was read to its end (`true`) or lost (`false`).
    pub fn set_synced(&self, synced: bool) {
        self.synced.store(synced, Ordering::Release);
    }

    /// Shares the set: every change a session makes from now on is kept
    /// as unshared (with `unshared`, those an earlier run saved), and
    /// `wake` is told (once: a second hook is ignored).
    pub fn share_with(&self, unshared: impl IntoIterator<Item = Change>, wake: Wake) {
        {
            let mut waiting = self.lock_unshared();
            for change in unshared {
                let (key, kind) = change.into_parts();
                waiting.entry(key).or_insert(kind);
            }
        }
        let _ = self.wake.set(wake);
        self.tell();
    }

    /// Whether the set is shared.
    pub fn is_shared(&self) -> bool {
        self.wake.get().is_some()
    }

    /// The changes not written to the registry yet, in order of exchange.
    pub fn unshared(&self) -> Vec<Change> {
        let waiting = self.lock_unshared();
        waiting
            .iter()
            .map(|(key, kind)| Change::of(key.clone(), kind.clone()))
            .collect()
    }

    /// Whether a change of `key` waits to be written to the registry.
    pub fn is_unshared(&self, key: &Key) -> bool {
        self.lock_unshared().contains_key(key)
    }

    /// `change` is in the registry: it is no longer kept (unless the
    /// exchange changed again since) and the file is saved without it.
    pub fn shared_done(&self, change: &Change) {
        let (key, kind) = change.clone().into_parts();
        let removed = {
            let mut waiting = self.lock_unshared();
            let same = waiting.get(&key) == Some(&kind);
            same && waiting.remove(&key).is_some()
        };
        if removed {
            self.save();
        }
    }

    /// Keeps `change` as unshared again (the registry does not name its
    /// exchange at all: it was declared before the registry was on, or
    /// the stream was deleted), saves and wakes the writer.
    pub fn reshare(&self, change: Change) {
        let (key, kind) = change.into_parts();
        self.keep_unshared(key, kind);
        self.save();
        self.tell();
    }

    fn lock_unshared(&self) -> std::sync::MutexGuard<'_, BTreeMap<Key, Option<String>>> {
        self.unshared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A change made here, kept until the registry has it (when shared).
    fn keep_unshared(&self, key: Key, kind: Option<String>) {
        if self.is_shared() {
            self.lock_unshared().insert(key, kind);
        }
    }

    /// A change read from the registry (another instance's, or this one's
    /// own coming back): applied and saved, not shared again. A declare
    /// that would take its vhost past the limit is not applied (`false`).
    pub fn apply(&self, change: &Change) -> bool {
        let changed = {
            let mut set = self.set.write().unwrap_or_else(|e| e.into_inner());
            let changed = match change {
                Change::Declared(e) => {
                    let key = (e.vhost.clone(), e.name.clone());
                    let from = (e.vhost.clone(), String::new());
                    let full = || {
                        set.range(from..)
                            .take_while(|((v, _), _)| *v == e.vhost)
                            .take(self.limit)
                            .count()
                            >= self.limit
                    };
                    if !set.contains_key(&key) && full() {
                        return false;
                    }
                    set.insert(key, e.kind.clone()).as_deref() != Some(e.kind.as_str())
                }
                Change::Deleted { vhost, name } => {
                    set.remove(&(vhost.clone(), name.clone())).is_some()
                }
            };
            self.any.store(!set.is_empty(), Ordering::Release);
            changed
        };
        if changed {
            self.save();
        }
        true
    }

    /// Whether nackd emulates the type at all.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Whether `exchange` of `vhost` is delayed.
    pub fn is_delayed(&self, vhost: &str, exchange: &str) -> bool {
        if !self.any.load(Ordering::Acquire) || exchange.is_empty() {
            return false;
        }
        let set = self.set.read().unwrap_or_else(|e| e.into_inner());
        set.contains_key(&(vhost.to_string(), exchange.to_string()))
    }

    /// The real type of `exchange` of `vhost`, if it is delayed.
    pub fn kind(&self, vhost: &str, exchange: &str) -> Option<String> {
        let set = self.set.read().unwrap_or_else(|e| e.into_inner());
        set.get(&(vhost.to_string(), exchange.to_string())).cloned()
    }

    /// Every delayed exchange, in order.
    pub fn list(&self) -> Vec<DelayedExchange> {
        let set = self.set.read().unwrap_or_else(|e| e.into_inner());
        set.iter()
            .map(|((vhost, name), kind)| DelayedExchange {
                vhost: vhost.clone(),
                name: name.clone(),
                kind: kind.clone(),
            })
            .collect()
    }

    /// `name` of `vhost` is declared delayed, of real type `kind`.
    pub fn declare(&self, vhost: &str, name: &str, kind: &str) {
        let key = (vhost.to_string(), name.to_string());
        let changed = {
            let mut set = self.set.write().unwrap_or_else(|e| e.into_inner());
            set.insert(key, kind.to_string()).as_deref() != Some(kind)
        };
        self.any.store(true, Ordering::Release);
        if changed {
            let key = (vhost.to_string(), name.to_string());
            self.keep_unshared(key, Some(kind.to_string()));
            self.save();
            self.tell();
        }
    }

    /// `name` of `vhost` is deleted.
    pub fn delete(&self, vhost: &str, name: &str) {
        let removed = {
            let mut set = self.set.write().unwrap_or_else(|e| e.into_inner());
            let removed = set.remove(&(vhost.to_string(), name.to_string())).is_some();
            self.any.store(!set.is_empty(), Ordering::Release);
            removed
        };
        // Unsynced, the broker's delete-ok may be for an exchange another
        // instance declared delayed: the registry is told all the same.
        if removed || (self.is_shared() && !self.synced()) {
            let key = (vhost.to_string(), name.to_string());
            self.keep_unshared(key, None);
            self.save();
            self.tell();
        }
    }

    fn tell(&self) {
        if let Some(wake) = self.wake.get() {
            wake();
        }
    }

    fn save(&self) {
        if let Some(persist) = &self.persist {
            persist();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn declares_and_deletes_are_seen_and_saved() {
        let saved: Arc<Mutex<Vec<Vec<DelayedExchange>>>> = Arc::default();
        let sink = saved.clone();
        let me: Arc<std::sync::OnceLock<std::sync::Weak<DelayedExchanges>>> = Arc::default();
        let seen = me.clone();
        let set = DelayedExchanges::new(
            [],
            DEFAULT_LIMIT,
            Some(Box::new(move || {
                let set = seen.get().and_then(std::sync::Weak::upgrade).unwrap();
                sink.lock().unwrap().push(set.list());
            })),
        );
        me.set(Arc::downgrade(&set)).unwrap();
        assert!(!set.is_delayed("/", "d"));
        set.declare("/", "d", "direct");
        assert!(set.is_delayed("/", "d"));
        assert!(!set.is_delayed("other", "d"));
        set.declare("/", "d", "direct"); // no change: not saved again
        set.delete("/", "d");
        assert!(!set.is_delayed("/", "d"));
        let saved = saved.lock().unwrap();
        assert_eq!(saved.len(), 2);
        assert_eq!(saved[0][0].kind, "direct");
        assert!(saved[1].is_empty());
    }

    #[test]
    fn a_shared_set_keeps_its_own_changes_until_shared_and_applies_the_others() {
        let woken: Arc<Mutex<usize>> = Arc::default();
        let count = woken.clone();
        let set = DelayedExchanges::new([], 3, None);
        set.declare("/", "early", "direct"); // before sharing: not kept
        let saved = Change::Deleted {
            vhost: "/".into(),
            name: "gone".into(),
        };
        set.share_with(
            [saved.clone()],
            Box::new(move || *count.lock().unwrap() += 1),
        );
        assert_eq!(
            set.unshared(),
            std::slice::from_ref(&saved),
            "an earlier run's"
        );
        set.declare("/", "a", "direct");
        set.declare("/", "a", "direct"); // no change: not kept again
        let theirs = |name: &str| {
            Change::Declared(DelayedExchange {
                vhost: "/".into(),
                name: name.into(),
                kind: "topic".into(),
            })
        };
        assert!(set.apply(&theirs("b")), "applied, not kept");
        assert_eq!(set.kind("/", "b").as_deref(), Some("topic"));
        assert!(!set.apply(&theirs("c")), "the vhost is full");
        assert!(!set.is_delayed("/", "c"));
        let mine = Change::Declared(DelayedExchange {
            vhost: "/".into(),
            name: "a".into(),
            kind: "direct".into(),
        });
        assert_eq!(set.unshared(), [mine.clone(), saved.clone()]);
        assert!(set.is_unshared(&("/".into(), "a".into())));
        // Written, then changed again before the answer: kept.
        set.delete("/", "a");
        set.shared_done(&mine);
        assert!(set.is_unshared(&("/".into(), "a".into())));
        set.shared_done(&Change::Deleted {
            vhost: "/".into(),
            name: "a".into(),
        });
        set.shared_done(&saved);
        assert!(set.unshared().is_empty());
        assert!(*woken.lock().unwrap() >= 3);
    }

    #[test]
    fn an_unsynced_shared_set_keeps_deletes_of_exchanges_it_does_not_know() {
        let set = DelayedExchanges::new([], 2, None);
        set.delete("/", "x"); // not shared: nothing to tell
        set.share_with([], Box::new(|| {}));
        set.delete("/", "x"); // synced: the delete of an unknown exchange is no news
        assert!(set.unshared().is_empty());
        set.set_synced(false);
        set.delete("/", "x");
        let deleted = Change::Deleted {
            vhost: "/".into(),
            name: "x".into(),
        };
        assert_eq!(set.unshared(), [deleted]);
    }

    #[test]
    fn an_unsynced_set_cannot_say_that_none_is_delayed() {
        let set = DelayedExchanges::new([], 2, None);
        assert!(set.none() && set.synced());
        set.set_synced(false);
        assert!(!set.none(), "another instance may have declared one");
        assert!(!set.is_delayed("/", "x"), "but it knows of none");
        set.set_synced(true);
        assert!(set.none());
    }

    #[test]
    fn a_vhost_admits_no_more_than_the_limit() {
        let set = DelayedExchanges::new([], 2, None);
        let admits = |v: &str, n: &str| {
            let yes = set.reserve(v, n);
            if yes {
                set.unreserve(v, n);
            }
            yes
        };
        assert!(admits("/", "a"));
        set.declare("/", "a", "direct");
        set.declare("/", "b", "direct");
        assert!(!admits("/", "c"), "the vhost is full");
        assert!(admits("/", "a"), "a known one may be declared again");
        assert!(admits("other", "c"), "another vhost has room");
        assert!(admits("/x", "c"), "a vhost named after it too");
        set.delete("/", "b");
        assert!(admits("/", "c"));
    }

    #[test]
    fn declares_not_answered_yet_count_toward_the_limit() {
        let set = DelayedExchanges::new([], 3, None);
        set.declare("/", "a", "direct");
        assert!(set.reserve("/", "b"));
        assert!(set.reserve("/", "c"));
        assert!(!set.reserve("/", "d"), "b and c are on their way");
        assert!(
            set.reserve("/", "b"),
            "a second declare of b takes no new place"
        );
        set.unreserve("/", "b");
        set.unreserve("/", "b");
        assert!(set.reserve("/", "d"), "b was refused: its place is free");
        set.declare("/", "c", "direct");
        set.unreserve("/", "c");
        assert!(!set.reserve("/", "e"), "a, c and d");
    }
}

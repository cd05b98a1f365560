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
//! registry`): every change a session makes is also handed to the
//! [`Share`] hook, which the `nackd` crate writes to a stream every
//! instance reads, and the changes read there come back through
//! [`DelayedExchanges::apply`]. Until it has read that stream to its end
//! the set is not [`synced`](DelayedExchanges::synced): an exchange it
//! does not list may be delayed all the same.

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

/// Told each change a session made, after it is made: like [`Persist`],
/// it must not block.
pub type Share = Box<dyn Fn(Change) + Send + Sync>;

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
    share: std::sync::OnceLock<Share>,
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
            share: std::sync::OnceLock::new(),
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
            share: std::sync::OnceLock::new(),
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

    /// Shares the set: every change a session makes from now on goes to
    /// `share` too (once: a second hook is ignored).
    pub fn share_with(&self, share: Share) {
        let _ = self.share.set(share);
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
            self.save();
            self.tell(Change::Declared(DelayedExchange {
                vhost: vhost.to_string(),
                name: name.to_string(),
                kind: kind.to_string(),
            }));
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
        if removed {
            self.save();
            self.tell(Change::Deleted {
                vhost: vhost.to_string(),
                name: name.to_string(),
            });
        }
    }

    fn tell(&self, change: Change) {
        if let Some(share) = self.share.get() {
            share(change);
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
    fn a_shared_set_tells_its_own_changes_and_applies_the_others() {
        let told: Arc<Mutex<Vec<Change>>> = Arc::default();
        let sink = told.clone();
        let set = DelayedExchanges::new([], 2, None);
        set.share_with(Box::new(move |c| sink.lock().unwrap().push(c)));
        set.declare("/", "a", "direct");
        set.declare("/", "a", "direct"); // no change: not told again
        let theirs = |name: &str| {
            Change::Declared(DelayedExchange {
                vhost: "/".into(),
                name: name.into(),
                kind: "topic".into(),
            })
        };
        assert!(set.apply(&theirs("b")));
        assert_eq!(set.kind("/", "b").as_deref(), Some("topic"));
        assert!(!set.apply(&theirs("c")), "the vhost is full");
        assert!(!set.is_delayed("/", "c"));
        assert!(set.apply(&Change::Deleted {
            vhost: "/".into(),
            name: "a".into()
        }));
        assert!(!set.is_delayed("/", "a"));
        set.delete("/", "b");
        let told = told.lock().unwrap();
        assert_eq!(told.len(), 2, "only this set's own changes: {told:?}");
        assert!(matches!(&told[0], Change::Declared(e) if e.name == "a"));
        assert!(matches!(&told[1], Change::Deleted { name, .. } if name == "b"));
        assert!(set.none());
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

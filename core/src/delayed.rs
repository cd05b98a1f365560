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
//! through [`DelayedExchanges::apply_record`]. Each change carries a
//! [`Version`], the time it was made and the process that made it: of an
//! exchange's changes the newest wins, wherever and whenever it is read.
//! Until it has read that stream to its end the set is not
//! [`synced`](DelayedExchanges::synced): an exchange it does not list may
//! be delayed all the same, so then every declare and every delete the
//! broker accepts is kept as unshared, news or not.

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

/// When a change was made (ms since the epoch, on its maker's clock), and
/// by which process (a random number each draws): the later wins, and of
/// two made in one millisecond the higher process.
pub type Version = (u64, u64);

/// What the set needs to share: the clock its changes are dated by, this
/// process's number, and the hook that wakes the writer.
pub struct Sharing {
    /// nackd's clock.
    pub clock: crate::clock::Clock,
    /// This process's number ([`Version`]).
    pub origin: u64,
    /// Told when a change waits.
    pub wake: Wake,
}

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
    /// Set once the set is shared.
    sharing: std::sync::OnceLock<Sharing>,
    /// The changes made here and not written to the registry yet: the
    /// last of each exchange (`None`: deleted). Taken before `set` when
    /// both are.
    unshared: Mutex<BTreeMap<Key, (Option<String>, Version)>>,
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
            sharing: std::sync::OnceLock::new(),
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
            sharing: std::sync::OnceLock::new(),
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

    /// Keeps `unshared` (what an earlier run saved and did not write) as
    /// unshared, whether or not the set is shared now: saved with it.
    pub fn carry(&self, unshared: impl IntoIterator<Item = (Change, Version)>) {
        let mut waiting = self.lock_unshared();
        for (change, version) in unshared {
            let (key, kind) = change.into_parts();
            let newer = waiting.get(&key).is_none_or(|(_, v)| *v < version);
            if newer {
                waiting.insert(key, (kind, version));
            }
        }
    }

    /// Shares the set: every change a session makes from now on is kept
    /// as unshared, dated by `sharing`'s clock, and its hook is told
    /// (once: a second call is ignored).
    pub fn share_with(&self, sharing: Sharing) {
        let _ = self.sharing.set(sharing);
        self.tell();
    }

    /// Whether the set is shared.
    pub fn is_shared(&self) -> bool {
        self.sharing.get().is_some()
    }

    /// The changes not written to the registry yet, in order of exchange.
    pub fn unshared(&self) -> Vec<(Change, Version)> {
        let waiting = self.lock_unshared();
        waiting
            .iter()
            .map(|(key, (kind, v))| (Change::of(key.clone(), kind.clone()), *v))
            .collect()
    }

    /// `change` (of `version`) is in the registry: it is no longer kept,
    /// unless the exchange changed again since, and the file is saved
    /// without it.
    pub fn shared_done(&self, change: &Change, version: Version) {
        let (key, kind) = change.clone().into_parts();
        let removed = {
            let mut waiting = self.lock_unshared();
            let same = waiting.get(&key) == Some(&(kind, version));
            same && waiting.remove(&key).is_some()
        };
        if removed {
            self.save();
        }
    }

    /// Keeps `change` as unshared, dated now (the registry does not name
    /// its exchange at all: declared before the registry was on, or the
    /// stream was deleted), saves and wakes the writer.
    pub fn reshare(&self, change: Change) {
        let (key, kind) = change.into_parts();
        if let Some(version) = self.version_now() {
            self.lock_unshared().insert(key, (kind, version));
            self.save();
            self.tell();
        }
    }

    fn version_now(&self) -> Option<Version> {
        let sharing = self.sharing.get()?;
        Some((sharing.clock.now_ms(), sharing.origin))
    }

    fn lock_unshared(&self) -> std::sync::MutexGuard<'_, BTreeMap<Key, (Option<String>, Version)>> {
        self.unshared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A change read from the registry, of `version`: applied and saved
    /// (not shared again), unless a change of its exchange made here is
    /// newer and not written yet (an older one is dropped: this one
    /// supersedes it). `false`: not applied. The vhost limit does not
    /// apply: each instance holds its own declares to it, and a change
    /// left out would make this one route what the others delay.
    pub fn apply_record(&self, change: &Change, version: Version) -> bool {
        let (key, kind) = change.clone().into_parts();
        let mut waiting = self.lock_unshared();
        if let Some((_, mine)) = waiting.get(&key) {
            if *mine >= version {
                return false;
            }
            waiting.remove(&key);
        }
        let changed = {
            let mut set = self.set.write().unwrap_or_else(|e| e.into_inner());
            let changed = match kind {
                Some(kind) => set.insert(key, kind.clone()).as_deref() != Some(kind.as_str()),
                None => set.remove(&key).is_some(),
            };
            self.any.store(!set.is_empty(), Ordering::Release);
            changed
        };
        drop(waiting);
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
        self.change(vhost, name, Some(kind));
    }

    /// `name` of `vhost` is deleted.
    pub fn delete(&self, vhost: &str, name: &str) {
        self.change(vhost, name, None);
    }

    /// A declare (`kind`) or delete the broker accepted through this
    /// nackd. Shared, it is kept as unshared when it changes the set, and
    /// while unsynced even when it does not: the set may not know what
    /// the registry says of the exchange, and this change is newer.
    fn change(&self, vhost: &str, name: &str, kind: Option<&str>) {
        let key = (vhost.to_string(), name.to_string());
        // Taken first, so that a record applied meanwhile cannot come
        // between the set's change and its being kept.
        let mut waiting = self.is_shared().then(|| self.lock_unshared());
        let changed = {
            let mut set = self.set.write().unwrap_or_else(|e| e.into_inner());
            let changed = match kind {
                Some(kind) => set.insert(key.clone(), kind.to_string()).as_deref() != Some(kind),
                None => set.remove(&key).is_some(),
            };
            self.any.store(!set.is_empty(), Ordering::Release);
            changed
        };
        let kept = match (waiting.as_mut(), self.version_now()) {
            (Some(waiting), Some(version)) if changed || !self.synced() => {
                waiting.insert(key, (kind.map(str::to_string), version));
                true
            }
            _ => false,
        };
        drop(waiting);
        if changed || kept {
            self.save();
        }
        if kept {
            self.tell();
        }
    }

    fn tell(&self) {
        if let Some(sharing) = self.sharing.get() {
            (sharing.wake)();
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

    /// A set shared by process 7, on a manual clock at 1 000 ms.
    fn shared(
        limit: usize,
    ) -> (
        Arc<DelayedExchanges>,
        crate::clock::Clock,
        Arc<Mutex<usize>>,
    ) {
        let woken: Arc<Mutex<usize>> = Arc::default();
        let count = woken.clone();
        let clock = crate::clock::Clock::manual(1_000);
        let set = DelayedExchanges::new([], limit, None);
        set.share_with(Sharing {
            clock: clock.clone(),
            origin: 7,
            wake: Box::new(move || *count.lock().unwrap() += 1),
        });
        (set, clock, woken)
    }

    fn declared(name: &str, kind: &str) -> Change {
        Change::Declared(DelayedExchange {
            vhost: "/".into(),
            name: name.into(),
            kind: kind.into(),
        })
    }

    fn deleted(name: &str) -> Change {
        Change::Deleted {
            vhost: "/".into(),
            name: name.into(),
        }
    }

    #[test]
    fn a_shared_set_keeps_its_own_changes_until_shared_and_applies_newer_ones() {
        let (set, clock, woken) = shared(2);
        set.carry([(deleted("gone"), (500, 3))]);
        assert_eq!(
            set.unshared(),
            [(deleted("gone"), (500, 3))],
            "an earlier run's"
        );
        set.declare("/", "a", "direct");
        set.declare("/", "a", "direct"); // synced, no change: not kept again
        assert_eq!(set.unshared()[0], (declared("a", "direct"), (1_000, 7)));
        // Another's older change of `a` does not override this newer one.
        assert!(!set.apply_record(&deleted("a"), (999, 9)));
        assert!(set.is_delayed("/", "a"));
        // Applied, not kept; past the vhost limit too.
        for name in ["b", "c"] {
            assert!(set.apply_record(&declared(name, "topic"), (1_500, 9)));
        }
        assert!(set.is_delayed("/", "c"));
        assert!(!set
            .unshared()
            .iter()
            .any(|(c, _)| *c == declared("c", "topic")));
        // Written, then changed again before the broker's answer: kept.
        clock.advance(std::time::Duration::from_millis(10));
        set.delete("/", "a");
        set.shared_done(&declared("a", "direct"), (1_000, 7));
        assert_eq!(set.unshared()[0], (deleted("a"), (1_010, 7)));
        set.shared_done(&deleted("a"), (1_010, 7));
        // A newer change elsewhere supersedes an unshared one.
        assert!(set.apply_record(&declared("gone", "fanout"), (600, 1)));
        assert!(set.unshared().is_empty());
        assert!(set.is_delayed("/", "gone"));
        assert!(*woken.lock().unwrap() >= 3);
    }

    #[test]
    fn an_unsynced_shared_set_keeps_every_declare_and_delete() {
        let plain = DelayedExchanges::new([], 2, None);
        plain.delete("/", "x"); // not shared: nothing kept
        assert!(plain.unshared().is_empty());
        let (set, _, _) = shared(2);
        set.declare("/", "x", "direct");
        set.shared_done(&declared("x", "direct"), (1_000, 7));
        set.declare("/", "x", "direct"); // synced: no news
        set.delete("/", "y"); // synced: no news either
        assert!(set.unshared().is_empty());
        set.set_synced(false);
        // The registry may say otherwise of both: these are newer.
        set.declare("/", "x", "direct");
        set.delete("/", "y");
        assert_eq!(
            set.unshared(),
            [
                (declared("x", "direct"), (1_000, 7)),
                (deleted("y"), (1_000, 7))
            ]
        );
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

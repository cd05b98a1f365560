//! What a session intercepts: the policies in force, the capture budget,
//! the engine's readiness and the clock every session shares
//! ([`Interception`]), and one session's view of them ([`Scope`]).

use std::collections::HashMap;
use std::sync::Arc;

use super::capture::Budget;
use crate::clock::Clock;
use crate::policy::{LivePolicies, Policy, PolicyView};
use crate::ready::Readiness;

/// What sessions share to intercept nacks.
pub struct Interception {
    /// Retry policies; a reload puts a new set in force.
    pub policies: Arc<LivePolicies>,
    /// Bound on captured bytes.
    pub budget: Arc<Budget>,
    /// Whether the retry engine takes claims now.
    pub ready: Arc<Readiness>,
    /// nackd's clock, for the times written into headers and events.
    pub clock: Clock,
    /// The exchanges emulated as `x-delayed-message`.
    pub delayed: Arc<crate::delayed::DelayedExchanges>,
}

/// Queues whose policy one session remembers at most.
pub(super) const CACHED: usize = 1024;

/// What one session intercepts: its vhost, and the policies that apply
/// to its queues (cached until a reload).
pub(super) struct Scope {
    /// What every session shares (read-only here).
    pub shared: Arc<Interception>,
    /// The vhost the client opened (`/` until it does).
    vhost: Arc<str>,
    policies: PolicyView,
    cache: HashMap<Arc<str>, Option<Arc<Policy>>>,
}

impl Scope {
    pub(super) fn new(shared: Arc<Interception>) -> Self {
        let policies = shared.policies.subscribe();
        Self {
            shared,
            vhost: Arc::from("/"),
            policies,
            cache: HashMap::new(),
        }
    }

    /// The vhost the client opened (`/` until it does).
    pub(super) fn vhost(&self) -> &Arc<str> {
        &self.vhost
    }

    /// The client opened `vhost` (`connection.open`).
    pub(super) fn open(&mut self, vhost: &str) {
        self.vhost = Arc::from(vhost);
    }

    /// How many queues' policies are cached.
    #[cfg(test)]
    pub(super) fn cached(&self) -> usize {
        self.cache.len()
    }

    /// The policy of `queue`, cached per session until a reload (or until
    /// [`CACHED`] queues are: a client that consumes a new server-named
    /// queue again and again must not grow it for ever).
    pub(super) fn policy(&mut self, queue: &Arc<str>) -> Option<Arc<Policy>> {
        let (policies, changed) = self.policies.current();
        if changed || (self.cache.len() >= CACHED && !self.cache.contains_key(queue)) {
            self.cache.clear();
        }
        let vhost = &self.vhost;
        self.cache
            .entry(queue.clone())
            .or_insert_with(|| policies.find(vhost, queue).cloned())
            .clone()
    }
}

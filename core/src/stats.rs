//! What a session counts, as Prometheus handles (`prometheus-client`: plain
//! atomics, no runtime) that the `nackd` crate registers and exports: frames
//! proxied, nacks held, passed through or deferred (and why), rejects of
//! exhausted messages, and the recent events of the status page.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

/// One fixed `name="value"` label.
pub type Label = [(&'static str, &'static str); 1];

/// Why nackd did not hold a nack or reject: it went to the broker as the
/// client sent it, or (for the reasons that [`PassReason::defers`]) it was
/// deferred: left unacked and nacked upstream with `requeue=true` later.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PassReason {
    /// No policy covers the delivery's queue (or no policy at all).
    NotConfigured,
    /// The capture budget was spent when the message was delivered.
    OverBudget,
    /// The store refused the message (full, I/O error) or the engine is gone.
    StoreUnavailable,
    /// The channel is in `tx` mode.
    TxChannel,
    /// A `requeue=true` nack with `requeue = "pass"` in the policy.
    RequeuePass,
    /// The message's headers cannot be rewritten.
    BadHeaders,
    /// nackd does not know the delivery tag (double settle, no-ack delivery).
    UnknownTag,
    /// The store (and replica) are still being recovered after a start.
    Recovering,
    /// The replica's lease is not held (a standby, or the broker was lost).
    NoLease,
    /// The replica stream is missing (deleted): nothing is held until an
    /// operator reseeds it.
    NoReplica,
    /// The channel or connection is closing (a close, recover or
    /// `tx.select` of the client waits to go upstream, or a close went).
    Closing,
    /// The broker cancelled the delivery's consumer and took its
    /// deliveries back (a consumer timeout on RabbitMQ 4.3 quorum queues).
    Returned,
}

impl PassReason {
    /// Every reason, in label order.
    pub const ALL: [PassReason; 12] = [
        Self::NotConfigured,
        Self::OverBudget,
        Self::StoreUnavailable,
        Self::TxChannel,
        Self::RequeuePass,
        Self::BadHeaders,
        Self::UnknownTag,
        Self::Recovering,
        Self::NoLease,
        Self::NoReplica,
        Self::Closing,
        Self::Returned,
    ];

    /// Whether nackd would hold the nack but cannot right now (store,
    /// engine, budget, headers): then the delivery stays unacked and is
    /// nacked with `requeue=true` later, instead of being settled as sent
    /// (which, with `requeue=false` and no dead-letter exchange, drops it).
    /// The other reasons are what the user configured or the only thing
    /// nackd can do: the settle goes as sent.
    pub fn defers(self) -> bool {
        matches!(
            self,
            Self::OverBudget
                | Self::StoreUnavailable
                | Self::BadHeaders
                | Self::Recovering
                | Self::NoLease
                | Self::NoReplica
        )
    }

    /// The `reason` label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::NotConfigured => "not_configured",
            Self::OverBudget => "over_budget",
            Self::StoreUnavailable => "store_unavailable",
            Self::TxChannel => "tx_channel",
            Self::RequeuePass => "requeue_pass",
            Self::BadHeaders => "bad_headers",
            Self::UnknownTag => "unknown_tag",
            Self::Recovering => "recovering",
            Self::NoLease => "no_lease",
            Self::NoReplica => "no_replica",
            Self::Closing => "closing",
            Self::Returned => "returned",
        }
    }
}

/// A pair of counters for the two directions of the proxy.
#[derive(Clone, Debug, Default)]
pub struct Directions {
    /// Client to broker.
    pub to_upstream: Counter,
    /// Broker to client.
    pub to_client: Counter,
}

impl Directions {
    /// The handles of both directions in `f` (label `direction`).
    pub fn of(f: &Family<Label, Counter>) -> Self {
        Self {
            to_upstream: f.get_or_create_owned(&[("direction", "to_upstream")]),
            to_client: f.get_or_create_owned(&[("direction", "to_client")]),
        }
    }
}

/// The labelled families of a session's counters; the `nackd` crate
/// registers them.
#[derive(Clone, Debug, Default)]
pub struct SessionFamilies {
    /// `nackd_frames`, by direction.
    pub frames: Family<Label, Counter>,
    /// `nackd_nacks_passed`, by reason.
    pub passed: Family<Label, Counter>,
    /// `nackd_nacks_deferred`, by reason.
    pub deferred: Family<Label, Counter>,
    /// `nackd_exhausted`, by route.
    pub exhausted: Family<Label, Counter>,
}

/// What sessions count. Every labelled series a session touches is
/// resolved once here and kept as a handle: an update is one atomic add.
/// Sessions add per read batch, not per frame.
#[derive(Debug)]
pub struct SessionStats {
    /// Frames proxied, by direction.
    pub frames: Directions,
    /// Nacks/rejects nackd took over (stored, acked upstream).
    pub intercepted: Counter,
    passed: Vec<Counter>,
    deferred: Vec<Counter>,
    /// Deliveries whose nack nackd could not hold and gives back to the
    /// broker later (`basic.nack`, requeue): unacked at the broker now.
    pub deferred_now: Gauge,
    /// Schedules used up, handed back with `basic.reject`.
    pub exhausted_reject: Counter,
    /// Delayed publishes (`x-delay` to an `x-delayed-message` exchange)
    /// stored, to be published when due.
    pub delayed_taken: Counter,
    /// Delayed publishes nackd could not store: nacked to the publisher
    /// (or, without confirms, routed at once).
    pub delayed_refused: Counter,
    /// Delayed publishes without confirms that could neither be stored
    /// nor routed (their channel was gone).
    pub delayed_lost: Counter,
    /// Delayed publishes the broker would refuse from their publisher
    /// (permissions, a missing exchange, ...): sent to it as they were,
    /// for it to refuse them in the publisher's name.
    pub delayed_denied: Counter,
    /// Recent retries and exhaustions, for the status page (the retry
    /// engine adds its own).
    pub recent: Arc<Recent>,
}

impl SessionStats {
    /// Counters at zero, with handles on the series of `f`.
    pub fn new(f: &SessionFamilies) -> Self {
        let by_reason = |family: &Family<Label, Counter>| {
            PassReason::ALL
                .iter()
                .map(|r| family.get_or_create_owned(&[("reason", r.label())]))
                .collect()
        };
        Self {
            frames: Directions::of(&f.frames),
            intercepted: Counter::default(),
            passed: by_reason(&f.passed),
            deferred: by_reason(&f.deferred),
            deferred_now: Gauge::default(),
            exhausted_reject: f.exhausted.get_or_create_owned(&[("route", "reject")]),
            delayed_taken: Counter::default(),
            delayed_refused: Counter::default(),
            delayed_lost: Counter::default(),
            delayed_denied: Counter::default(),
            recent: Arc::default(),
        }
    }

    /// Counters nobody exports: for tests.
    pub fn detached() -> Arc<Self> {
        Arc::new(Self::new(&SessionFamilies::default()))
    }

    /// Counts `n` nacks passed through for `reason`.
    pub fn pass(&self, reason: PassReason, n: u64) {
        if n > 0 {
            self.passed[reason as usize].inc_by(n);
        }
    }

    /// Nacks passed through for `reason` so far.
    pub fn passed(&self, reason: PassReason) -> u64 {
        self.passed[reason as usize].get()
    }

    /// Counts a nack nackd could not hold for `reason` and gives back later.
    pub fn defer(&self, reason: PassReason) {
        self.deferred[reason as usize].inc();
    }

    /// Nacks deferred for `reason` so far.
    pub fn deferred(&self, reason: PassReason) -> u64 {
        self.deferred[reason as usize].get()
    }

    /// Nacks passed through, all reasons.
    pub fn passed_total(&self) -> u64 {
        self.passed.iter().map(Counter::get).sum()
    }
}

/// Events kept.
pub const KEPT: usize = 50;

/// What happened to a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// Republished to the tail of its queue and confirmed.
    Retried,
    /// Schedule used up: handed back with `basic.reject` (the queue's DLX applies).
    ExhaustedReject,
    /// Published to its `on_exhausted` exchange and confirmed.
    ExhaustedDeadLetter,
}

/// One retry or exhaustion.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Event {
    /// When, in ms since the Unix epoch.
    pub at_ms: u64,
    /// What happened.
    pub kind: EventKind,
    /// Virtual host.
    pub vhost: String,
    /// Queue.
    pub queue: String,
    /// Retry number the message carried.
    pub retry: u32,
}

/// A bounded list of recent events, newest last.
#[derive(Debug, Default)]
pub struct Recent(Mutex<VecDeque<Event>>);

impl Recent {
    /// Adds an event, dropping the oldest beyond `KEPT`.
    pub fn push(&self, event: Event) {
        let mut events = self.0.lock().expect("recent events lock");
        if events.len() == KEPT {
            events.pop_front();
        }
        events.push_back(event);
    }

    /// The events, newest first.
    pub fn newest_first(&self) -> Vec<Event> {
        self.0
            .lock()
            .expect("recent events lock")
            .iter()
            .rev()
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_keeps_the_newest() {
        let recent = Recent::default();
        for i in 0..(KEPT as u64 + 5) {
            let (vhost, queue) = ("/".to_string(), "q".to_string());
            recent.push(Event {
                at_ms: i,
                kind: EventKind::Retried,
                vhost,
                queue,
                retry: 1,
            });
        }
        let events = recent.newest_first();
        assert_eq!(events.len(), KEPT);
        assert_eq!(
            (events[0].at_ms, events.last().unwrap().at_ms),
            (KEPT as u64 + 4, 5)
        );
    }
}

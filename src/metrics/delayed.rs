//! The delayed exchanges (`x-delayed-message` emulation), per exchange:
//! what is held, what was routed at its due time, what nothing was bound
//! for. Owned by the retry engine, like the per-queue series.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Labels of a per-exchange series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ExchangeLabels {
    /// Virtual host.
    pub vhost: String,
    /// Exchange.
    pub exchange: String,
}

/// Labels of `nackd_delayed_unroutable_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UnroutableLabels {
    /// Virtual host.
    pub vhost: String,
    /// Exchange.
    pub exchange: String,
    /// `delayed.unroutable`: keep, drop or alternate.
    pub action: String,
}

/// The per-exchange series of delayed messages.
#[derive(Debug, Default)]
pub struct DelayedMetrics {
    /// Delayed messages held, by exchange (a series while it holds any).
    pub held: Family<ExchangeLabels, Gauge>,
    /// Delayed messages the broker confirmed at their due time.
    pub routed: Family<ExchangeLabels, Counter>,
    /// Delayed messages returned at their due time (nothing bound for
    /// their routing key), by the action taken.
    pub unroutable: Family<UnroutableLabels, Counter>,
    /// 0 while `[delayed] registry` is on and the shared registry is not
    /// read to its end (x-delay to unknown exchanges is refused), else 1.
    pub registry_synced: Gauge,
    /// Changes read from the shared registry and applied (this instance's
    /// own included).
    pub registry_applied: Counter,
    /// Records of the shared registry skipped: unreadable or invalid.
    pub registry_skipped: Counter,
}

impl DelayedMetrics {
    /// The series, `registry_synced` at 1: an instance without a shared
    /// registry knows every exchange it treats as delayed.
    pub fn new() -> Self {
        let metrics = Self::default();
        metrics.registry_synced.set(1);
        metrics
    }

    pub(super) fn register(&self, r: &mut Registry) {
        r.register(
            "nackd_delayed_held_messages",
            "Delayed messages (x-delayed-message, x-delay) held until their due time, by exchange",
            self.held.clone(),
        );
        r.register(
            "nackd_delayed_routed",
            "Delayed messages published to their exchange at their due time and confirmed",
            self.routed.clone(),
        );
        r.register(
            "nackd_delayed_unroutable",
            "Delayed messages nothing was bound for at their due time, by delayed.unroutable action",
            self.unroutable.clone(),
        );
        r.register(
            "nackd_delayed_registry_synced",
            "0 while [delayed] registry is on and the registry of delayed exchanges shared by every instance is not read to its end (x-delay publishes to exchanges this instance does not know as delayed are refused meanwhile); 1 otherwise",
            self.registry_synced.clone(),
        );
        r.register(
            "nackd_delayed_registry_changes",
            "Declares and deletes of delayed exchanges read from the shared registry and applied (this instance's own included)",
            self.registry_applied.clone(),
        );
        r.register(
            "nackd_delayed_registry_skipped",
            "Records of the shared registry of delayed exchanges skipped because they could not be read or named no valid exchange",
            self.registry_skipped.clone(),
        );
    }

    /// One more delayed message of `vhost`/`exchange` confirmed.
    pub fn routed(&self, vhost: &str, exchange: &str) {
        self.routed
            .get_or_create(&ExchangeLabels {
                vhost: vhost.into(),
                exchange: exchange.into(),
            })
            .inc();
    }

    /// One more delayed message of `vhost`/`exchange` returned, met by `action`.
    pub fn unroutable(&self, vhost: &str, exchange: &str, action: &str) {
        self.unroutable
            .get_or_create(&UnroutableLabels {
                vhost: vhost.into(),
                exchange: exchange.into(),
                action: action.into(),
            })
            .inc();
    }
}

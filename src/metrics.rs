//! Prometheus metrics: one [`Metrics`] shared by the listener, the sessions,
//! the retry engine, the republishers and the store writer.
//!
//! Hot paths never look a series up by its labels: every labelled series a
//! session touches (a direction, a pass reason) is resolved once here and
//! kept as a handle, so an update is one atomic add. Sessions add per read
//! batch, not per frame. Per-queue series are owned by the retry engine,
//! which caches their handles too.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};

mod damage;
mod delayed;
mod logins;
mod replica;
pub use damage::{DamageList, Damaged};
pub use delayed::{DelayedMetrics, ExchangeLabels, UnroutableLabels};
pub use logins::{Login, Logins};
pub use nackd_core::stats::{Directions, Event, EventKind, PassReason, Recent, SessionStats};
use nackd_core::stats::{Label, SessionFamilies};
pub use replica::ReplicaMissing;

/// Content type of [`Metrics::encode`]'s output (OpenMetrics text, which
/// Prometheus scrapes natively).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels of a per-queue series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    /// Virtual host.
    pub vhost: String,
    /// Queue.
    pub queue: String,
}

/// Labels of a per-vhost series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VhostLabels {
    /// Virtual host.
    pub vhost: String,
}

/// Why a held message was set aside instead of republished (it stays held
/// and is tried again with a backoff of its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockReason {
    /// The destination exchange does not exist (404 on publish or passive declare).
    NoExchange,
    /// The broker refused access (403: permissions, an internal exchange).
    AccessRefused,
    /// The broker refused this message (406, e.g. larger than its `max_message_size`).
    PreconditionFailed,
    /// The rewritten content header does not fit in one frame of the negotiated `frame_max`.
    FrameMax,
    /// Its `user_id` property is not the republisher's user, which the broker refuses.
    UserId,
    /// Returned: nothing is bound to its `on_exhausted` exchange (or its
    /// delayed exchange, `delayed.unroutable = "keep"`) for its routing key.
    NoRoute,
    /// Its queue no longer exists (`republish.queue_gone`).
    QueueGone,
    /// The broker nacked the republish (an internal error on its side).
    Nacked,
    /// Another channel error on the republish.
    ChannelError,
    /// The held copy cannot be read or re-routed in the store.
    Store,
}

impl BlockReason {
    /// Every reason, in label order.
    pub const ALL: [BlockReason; 10] = [
        Self::NoExchange,
        Self::AccessRefused,
        Self::PreconditionFailed,
        Self::FrameMax,
        Self::UserId,
        Self::NoRoute,
        Self::QueueGone,
        Self::Nacked,
        Self::ChannelError,
        Self::Store,
    ];

    /// The `reason` label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::NoExchange => "no_exchange",
            Self::AccessRefused => "access_refused",
            Self::PreconditionFailed => "precondition_failed",
            Self::FrameMax => "frame_max",
            Self::UserId => "user_id",
            Self::NoRoute => "no_route",
            Self::QueueGone => "queue_gone",
            Self::Nacked => "nacked",
            Self::ChannelError => "channel_error",
            Self::Store => "store",
        }
    }
}

/// Why due messages are not fired: what they would need to be completed
/// cannot be recorded. Held messages wait; new nacks the store refuses are
/// deferred (requeued at the broker later) until it takes them again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PauseReason {
    /// The disk is full: the store's reserve took the completions of what
    /// was already fired (or could not be made), and nothing more is fired
    /// until it is made again.
    DiskFull,
    /// Completions (delete records) cannot be written to the store: they
    /// are tried again every second.
    CompletionsUnwritten,
}

impl PauseReason {
    /// Every reason, in label order.
    pub const ALL: [PauseReason; 2] = [Self::DiskFull, Self::CompletionsUnwritten];

    /// The `reason` label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::DiskFull => "disk_full",
            Self::CompletionsUnwritten => "completions_unwritten",
        }
    }

    /// What `/readyz` and the log say.
    pub fn text(self) -> &'static str {
        match self {
            Self::DiskFull => "firing paused: the disk is full (the store's reserve for completions is in use or cannot be made)",
            Self::CompletionsUnwritten => "firing paused: completions cannot be written to the store (tried again every second)",
        }
    }
}

/// Every metric nackd exports, with handles the hot paths update directly.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Client connections open now.
    pub clients: Gauge,
    /// Client connections accepted since start.
    pub clients_accepted: Counter,
    /// Client connections refused at `max_connections`.
    pub clients_refused: Counter,
    /// Upstream (broker) connections open for clients now.
    pub upstreams: Gauge,
    /// Upstream connects that failed.
    pub upstream_failures: Counter,
    /// What the sessions count (frames, nacks held, passed, deferred).
    pub session: Arc<SessionStats>,
    /// Bytes proxied, by direction.
    pub bytes: Directions,
    /// Held messages by vhost and queue (owned by the retry engine).
    pub held: Family<QueueLabels, Gauge>,
    /// Held bytes by vhost and queue (owned by the retry engine).
    pub held_bytes: Family<QueueLabels, Gauge>,
    /// Delayed messages by exchange (owned by the retry engine).
    pub delayed: DelayedMetrics,
    /// Held messages handed to a republisher when due.
    pub published: Counter,
    /// Republishes the broker confirmed.
    pub confirmed: Counter,
    /// Republishes the broker returned as unroutable.
    pub returned: Counter,
    /// Republishes the broker nacked.
    pub nacked: Counter,
    /// Returned messages re-routed to their `on_exhausted` exchange.
    pub rerouted: Counter,
    /// Messages confirmed on an `on_exhausted` exchange.
    pub exhausted_dead_letter: Counter,
    /// Time from due to handed to the republisher (first attempt).
    pub lateness: Histogram,
    /// Duration of the store's fsync (one per group commit).
    pub fsync: Histogram,
    /// Bytes of the store's segment files.
    pub store_bytes: Gauge,
    /// 1 while the store is open and its writer runs.
    pub store_open: Gauge,
    /// 1 while older store segments are still being read after a start
    /// (new nacks are held meanwhile; what they held fires once read).
    pub store_recovering: Gauge,
    /// nackd's clock minus the broker's, in seconds (NaN until measured).
    pub clock_offset: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Store writes or fsyncs that failed.
    pub store_errors: Counter,
    /// Times a store write went unanswered past the settle timeout.
    pub store_stalls: Counter,
    /// 1 while a store write goes unanswered past the settle timeout.
    pub store_stalled: Gauge,
    /// Bytes of the store's live puts (what disk use is bounded by).
    pub store_live_bytes: Gauge,
    /// Bytes compaction copied forward.
    pub store_compacted_bytes: Counter,
    /// Bytes recovery skipped because they did not read back.
    pub store_damaged_bytes: Counter,
    /// Damaged ranges recovery found (whole missing segments included).
    pub store_damaged_ranges: Counter,
    /// Bytes of torn writes recovery cut off the newest segment (not damage).
    pub store_torn_bytes: Counter,
    /// The damaged ranges and torn tail of the last recovery, for the status page.
    pub store_damage: DamageList,
    /// Held messages written back into the local store from the replica stream.
    pub replica_rebuilt: Counter,
    /// Messages parked for adoptions of other instances (an adoption cut
    /// off half way and tried again counts its parks again).
    pub replica_adopted: Counter,
    /// Replica generations replaced by a compacted one.
    pub replica_generations: Counter,
    /// Replica records the broker returned (their stream does not exist).
    pub replica_returns: Counter,
    /// Whether this instance's replica stream is missing.
    pub replica_missing: ReplicaMissing,
    /// Other instances whose lease is free but whose messages cannot be
    /// adopted: their replica stream is missing, or their last holder
    /// listed other `upstream.addresses`.
    pub replica_unadoptable: Gauge,
    /// 1 while this process refuses its id's lease: its
    /// `upstream.addresses` differ from those its id's last holder listed.
    pub replica_refused: Gauge,
    /// Republisher connections up now (all vhosts).
    pub republishers: Gauge,
    /// 1 while the republisher of a vhost is connected.
    pub republisher_connected: Family<VhostLabels, Gauge>,
    /// 1 while the broker blocks the republisher of a vhost.
    pub republisher_blocked: Family<VhostLabels, Gauge>,
    /// Republisher connections opened, by vhost.
    pub republisher_connects: Family<VhostLabels, Counter>,
    /// Channels of a republisher the broker closed with an error, by vhost.
    pub republisher_channel_errors: Family<VhostLabels, Counter>,
    /// Bytes of due messages read from the store and not yet settled, by vhost.
    pub republish_pending_bytes: Family<VhostLabels, Gauge>,
    /// Whether the republish login gets into each intercepted vhost (`/readyz`).
    pub republish_logins: Logins,
    blocked_total: Vec<Counter>,
    blocked_now: Vec<Gauge>,
    firing_paused: Vec<Gauge>,
    /// 1 while a queue that holds messages is gone (returned as unroutable).
    pub queue_gone: Family<QueueLabels, Gauge>,
    /// Held messages of a gone queue dropped by `republish.queue_gone`.
    pub gone_dropped: Counter,
    /// Held messages of a gone queue sent to `republish.queue_gone.exchange`.
    pub gone_dead_lettered: Counter,
    /// `on_exhausted` (and `queue_gone`, `[[delayed_exchange]]`,
    /// `delayed.alternate_exchange`) exchanges the last check found missing.
    pub exchanges_missing: Gauge,
    /// Bytes of deliveries captured in case they are nacked.
    pub capture_bytes: Gauge,
    /// Policy reloads that took effect.
    pub reloads_ok: Counter,
    /// Policy reloads refused (the old policies stay).
    pub reloads_failed: Counter,
}

/// Buckets of the lateness histogram, in seconds.
const LATENESS_BUCKETS: [f64; 14] = [
    0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];
/// Buckets of the fsync histogram, in seconds.
const FSYNC_BUCKETS: [f64; 13] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// The labelled families whose series [`Metrics`] keeps as handles: the
/// registry holds the families, the hot paths the handles.
#[derive(Default)]
struct Families {
    session: SessionFamilies,
    bytes: Family<Label, Counter>,
    reloads: Family<Label, Counter>,
    blocked_total: Family<Label, Counter>,
    blocked_now: Family<Label, Gauge>,
    firing_paused: Family<Label, Gauge>,
    gone: Family<Label, Counter>,
}

/// The handle of the series of `f` labelled `name="value"`.
fn one(f: &Family<Label, Counter>, name: &'static str, value: &'static str) -> Counter {
    f.get_or_create_owned(&[(name, value)])
}

impl Metrics {
    /// Every metric at zero, registered.
    pub fn new() -> Arc<Self> {
        let f = Families::default();
        let m = Self::unregistered(&f);
        let mut r = Registry::default();
        m.register_proxy(&mut r, &f);
        m.register_nacks(&mut r, &f);
        m.register_retries(&mut r, &f);
        m.delayed.register(&mut r);
        m.register_store(&mut r);
        m.register_recovery(&mut r);
        m.register_replica(&mut r);
        m.register_republishers(&mut r, &f);
        m.register_set_aside(&mut r, &f);
        m.register_capture_and_reloads(&mut r, &f);
        Arc::new(Self { registry: r, ..m })
    }

    /// Every metric at zero, with handles on the series of `f`; the
    /// registry is still empty.
    // Whole because: one line per field of `Metrics`, a struct literal.
    #[allow(clippy::too_many_lines)]
    fn unregistered(f: &Families) -> Self {
        Self {
            registry: Registry::default(),
            clients: Gauge::default(),
            clients_accepted: Counter::default(),
            clients_refused: Counter::default(),
            upstreams: Gauge::default(),
            upstream_failures: Counter::default(),
            session: Arc::new(SessionStats::new(&f.session)),
            bytes: Directions::of(&f.bytes),
            held: Family::default(),
            held_bytes: Family::default(),
            delayed: DelayedMetrics::new(),
            published: Counter::default(),
            confirmed: Counter::default(),
            returned: Counter::default(),
            nacked: Counter::default(),
            rerouted: Counter::default(),
            exhausted_dead_letter: one(&f.session.exhausted, "route", "dead_letter"),
            lateness: Histogram::new(LATENESS_BUCKETS),
            fsync: Histogram::new(FSYNC_BUCKETS),
            store_bytes: Gauge::default(),
            store_open: Gauge::default(),
            store_recovering: Gauge::default(),
            clock_offset: {
                let g = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
                g.set(f64::NAN);
                g
            },
            store_errors: Counter::default(),
            store_stalls: Counter::default(),
            store_stalled: Gauge::default(),
            store_live_bytes: Gauge::default(),
            store_compacted_bytes: Counter::default(),
            store_damaged_bytes: Counter::default(),
            store_damaged_ranges: Counter::default(),
            store_torn_bytes: Counter::default(),
            store_damage: DamageList::default(),
            replica_rebuilt: Counter::default(),
            replica_adopted: Counter::default(),
            replica_generations: Counter::default(),
            replica_returns: Counter::default(),
            replica_missing: ReplicaMissing::default(),
            replica_unadoptable: Gauge::default(),
            replica_refused: Gauge::default(),
            republishers: Gauge::default(),
            republisher_connected: Family::default(),
            republisher_blocked: Family::default(),
            republisher_connects: Family::default(),
            republisher_channel_errors: Family::default(),
            republish_pending_bytes: Family::default(),
            republish_logins: Logins::default(),
            blocked_total: BlockReason::ALL
                .iter()
                .map(|r| one(&f.blocked_total, "reason", r.label()))
                .collect(),
            blocked_now: BlockReason::ALL
                .iter()
                .map(|r| f.blocked_now.get_or_create_owned(&[("reason", r.label())]))
                .collect(),
            firing_paused: PauseReason::ALL
                .iter()
                .map(|r| {
                    f.firing_paused
                        .get_or_create_owned(&[("reason", r.label())])
                })
                .collect(),
            queue_gone: Family::default(),
            gone_dropped: one(&f.gone, "action", "drop"),
            gone_dead_lettered: one(&f.gone, "action", "dead_letter"),
            exchanges_missing: Gauge::default(),
            capture_bytes: Gauge::default(),
            reloads_ok: one(&f.reloads, "result", "ok"),
            reloads_failed: one(&f.reloads, "result", "error"),
        }
    }

    /// The proxy: connections, frames and bytes.
    fn register_proxy(&self, r: &mut Registry, f: &Families) {
        r.register(
            "nackd_build",
            "nackd version and the commit it was built from",
            Info::new(vec![
                ("version", env!("CARGO_PKG_VERSION")),
                ("commit", env!("NACKD_COMMIT")),
            ]),
        );
        r.register(
            "nackd_client_connections",
            "Client connections open",
            self.clients.clone(),
        );
        r.register(
            "nackd_client_connections_accepted",
            "Client connections accepted",
            self.clients_accepted.clone(),
        );
        r.register(
            "nackd_client_connections_refused",
            "Client connections refused at limits.max_connections",
            self.clients_refused.clone(),
        );
        r.register(
            "nackd_upstream_connections",
            "Broker connections open on behalf of clients",
            self.upstreams.clone(),
        );
        r.register(
            "nackd_upstream_connect_failures",
            "Broker connects that failed",
            self.upstream_failures.clone(),
        );
        r.register(
            "nackd_coalesce_pauses",
            "Waits of an idle session thread while a peer streams (runtime.coalesce)",
            crate::coalesce::PAUSES.clone(),
        );
        r.register(
            "nackd_frames",
            "Frames proxied, by direction",
            f.session.frames.clone(),
        );
        r.register_with_unit(
            "nackd_proxied",
            "Bytes proxied, by direction",
            Unit::Bytes,
            f.bytes.clone(),
        );
    }

    /// The nacks taken over, passed or deferred, and the delayed publishes.
    fn register_nacks(&self, r: &mut Registry, f: &Families) {
        r.register(
            "nackd_nacks_intercepted",
            "Nacks and rejects nackd took over (stored, then acked upstream)",
            self.session.intercepted.clone(),
        );
        r.register(
            "nackd_delayed_publishes_stored",
            "Delayed publishes (x-delay to an x-delayed-message exchange) stored, to be published when due",
            self.session.delayed_taken.clone(),
        );
        r.register(
            "nackd_delayed_publishes_refused",
            "Delayed publishes nackd could not store: nacked to the publisher, or routed at once on a channel without confirms",
            self.session.delayed_refused.clone(),
        );
        r.register(
            "nackd_delayed_publishes_lost",
            "Delayed publishes without confirms that could neither be stored nor routed (their channel was gone)",
            self.session.delayed_lost.clone(),
        );
        r.register(
            "nackd_delayed_publishes_denied",
            "Delayed publishes the broker would refuse from their publisher (permissions, a missing exchange): sent to it as they were, for it to refuse them",
            self.session.delayed_denied.clone(),
        );
        r.register(
            "nackd_nacks_passed",
            "Nacks and rejects forwarded to the broker as sent, by reason",
            f.session.passed.clone(),
        );
        r.register(
            "nackd_nacks_deferred",
            "Nacks and rejects nackd could not hold: left unacked and nacked upstream (requeue) later, by reason",
            f.session.deferred.clone(),
        );
        r.register(
            "nackd_deferred_nacks",
            "Deliveries unacked at the broker now, waiting for nackd's deferred nack",
            self.session.deferred_now.clone(),
        );
    }

    /// The retries: what is held, republished, exhausted, and how late.
    fn register_retries(&self, r: &mut Registry, f: &Families) {
        r.register(
            "nackd_held_messages",
            "Messages held for a delayed retry",
            self.held.clone(),
        );
        r.register_with_unit(
            "nackd_held",
            "Bytes of messages held for a delayed retry",
            Unit::Bytes,
            self.held_bytes.clone(),
        );
        r.register(
            "nackd_retries_published",
            "Held messages handed to the republisher when due",
            self.published.clone(),
        );
        r.register(
            "nackd_retries_confirmed",
            "Republishes confirmed by the broker",
            self.confirmed.clone(),
        );
        r.register(
            "nackd_retries_returned",
            "Republishes returned as unroutable",
            self.returned.clone(),
        );
        r.register(
            "nackd_retries_nacked",
            "Republishes nacked by the broker",
            self.nacked.clone(),
        );
        r.register(
            "nackd_retries_rerouted",
            "Returned messages re-routed to their on_exhausted exchange",
            self.rerouted.clone(),
        );
        r.register(
            "nackd_exhausted",
            "Messages whose retry schedule is used up, by route",
            f.session.exhausted.clone(),
        );
        r.register_with_unit(
            "nackd_redelivery_lateness",
            "Time from due to republish (first attempt)",
            Unit::Seconds,
            self.lateness.clone(),
        );
    }

    /// The store: size, fsyncs, errors, compaction (and nackd's clock, which
    /// the store keeps from going back).
    fn register_store(&self, r: &mut Registry) {
        r.register_with_unit(
            "nackd_store_fsync",
            "Duration of the store's group-commit fsync",
            Unit::Seconds,
            self.fsync.clone(),
        );
        r.register_with_unit(
            "nackd_store",
            "Size of the store's segment files",
            Unit::Bytes,
            self.store_bytes.clone(),
        );
        r.register(
            "nackd_store_open",
            "1 while the store is open and its writer runs",
            self.store_open.clone(),
        );
        r.register(
            "nackd_store_errors",
            "Store writes or fsyncs that failed",
            self.store_errors.clone(),
        );
        r.register(
            "nackd_store_stalls",
            "Times a store write (an fsync) went unanswered past the settle timeout: nacks were deferred meanwhile",
            self.store_stalls.clone(),
        );
        r.register(
            "nackd_store_stalled",
            "1 while a store write (an fsync) goes unanswered past the settle timeout",
            self.store_stalled.clone(),
        );
        r.register_with_unit(
            "nackd_store_live",
            "Bytes of the store's live records (disk use stays within about twice this plus a segment)",
            Unit::Bytes,
            self.store_live_bytes.clone(),
        );
        r.register_with_unit(
            "nackd_store_compacted",
            "Bytes the store's compaction copied forward",
            Unit::Bytes,
            self.store_compacted_bytes.clone(),
        );
        r.register_with_unit(
            "nackd_clock_offset",
            "nackd's clock minus the broker's (measured each minute from the broker's x-death time, good to about a second; NaN until measured)",
            Unit::Seconds,
            self.clock_offset.clone(),
        );
    }

    /// The store's recovery: how far it is, the damage it found.
    fn register_recovery(&self, r: &mut Registry) {
        r.register(
            "nackd_store_recovering",
            "1 while the store's older segments are still being read after a start (new nacks are held meanwhile)",
            self.store_recovering.clone(),
        );
        r.register_with_unit(
            "nackd_store_damaged",
            "Bytes recovery skipped because they did not read back (held messages in them are lost; deleted ones may be republished once more)",
            Unit::Bytes,
            self.store_damaged_bytes.clone(),
        );
        r.register(
            "nackd_store_damaged_ranges",
            "Damaged ranges of store files recovery found, missing segments included (each logged with its file and offsets)",
            self.store_damaged_ranges.clone(),
        );
        r.register_with_unit(
            "nackd_store_torn",
            "Bytes of a torn write (a crash during a write; nothing in it was answered) recovery cut off the newest segment",
            Unit::Bytes,
            self.store_torn_bytes.clone(),
        );
    }

    /// The replica: compactions, rebuilds, a missing stream.
    fn register_replica(&self, r: &mut Registry) {
        r.register(
            "nackd_replica_returns",
            "Replica records the broker returned as unroutable: their stream does not exist (deleted?)",
            self.replica_returns.clone(),
        );
        r.register(
            "nackd_replica_missing",
            "1 while this instance's replica stream is missing: nacks are deferred until `nackd admin replica reseed`",
            self.replica_missing.gauge.clone(),
        );
        r.register(
            "nackd_replica_unadoptable",
            "Instances of the group whose lease is free but whose messages cannot be adopted: their replica stream is missing, or their last holder listed other upstream.addresses",
            self.replica_unadoptable.clone(),
        );
        r.register(
            "nackd_replica_refused",
            "1 while this process refuses its instance id's lease: its upstream.addresses differ from those the id's last holder listed (the log names both)",
            self.replica_refused.clone(),
        );
        r.register(
            "nackd_replica_compactions",
            "Replica generation streams replaced by a compacted one",
            self.replica_generations.clone(),
        );
        r.register(
            "nackd_replica_rebuilt_messages",
            "Held messages the local store got back from the replica stream",
            self.replica_rebuilt.clone(),
        );
        r.register(
            "nackd_replica_adopted_messages",
            "Messages parked for adoptions of other instances' held messages (held from the adoption's commit on)",
            self.replica_adopted.clone(),
        );
    }

    /// The republishers: connections, blocks, pending bytes, pauses.
    fn register_republishers(&self, r: &mut Registry, f: &Families) {
        r.register(
            "nackd_republisher_connections",
            "Republisher connections up (all vhosts)",
            self.republishers.clone(),
        );
        r.register(
            "nackd_republisher_connected",
            "1 while the republisher of the vhost is connected",
            self.republisher_connected.clone(),
        );
        r.register(
            "nackd_republisher_blocked",
            "1 while the broker blocks the republisher of the vhost",
            self.republisher_blocked.clone(),
        );
        r.register(
            "nackd_republisher_connects",
            "Republisher connections opened, by vhost",
            self.republisher_connects.clone(),
        );
        r.register(
            "nackd_republish_login_failed",
            "1 while nackd's republish login into the vhost is refused or cannot be made (see /readyz)",
            self.republish_logins.failed.clone(),
        );
        r.register(
            "nackd_republisher_channel_errors",
            "Republisher channels the broker closed with an error (the connection stays)",
            self.republisher_channel_errors.clone(),
        );
        r.register_with_unit(
            "nackd_republish_pending",
            "Bytes of due messages read from the store and not yet settled (bounded by republish.max_pending_bytes)",
            Unit::Bytes,
            self.republish_pending_bytes.clone(),
        );
        r.register(
            "nackd_firing_paused",
            "1 while due messages are not fired because their completion cannot be recorded, by reason",
            f.firing_paused.clone(),
        );
    }

    /// Messages set aside, gone queues, missing exchanges.
    fn register_set_aside(&self, r: &mut Registry, f: &Families) {
        r.register(
            "nackd_retries_blocked",
            "Republishes set aside (kept, tried again with backoff), by reason",
            f.blocked_total.clone(),
        );
        r.register(
            "nackd_blocked_messages",
            "Held messages whose last republish was set aside, by reason",
            f.blocked_now.clone(),
        );
        r.register(
            "nackd_queue_gone",
            "1 while a queue nackd holds messages for does not exist",
            self.queue_gone.clone(),
        );
        r.register(
            "nackd_gone_queue_messages",
            "Held messages of a gone queue handled by republish.queue_gone, by action",
            f.gone.clone(),
        );
        r.register(
            "nackd_policy_exchanges_missing",
            "on_exhausted, queue_gone and delayed exchanges the last check (startup, reload) did not find",
            self.exchanges_missing.clone(),
        );
        r.register(
            "nackd_screen_folded",
            "Messages from the broker whose properties fail nackd's limits, folded before lapin (replay, replica)",
            crate::screen::FOLDED.clone(),
        );
        r.register(
            "nackd_screen_refused",
            "lapin connections (replay, replica) ended because the broker sent a frame nackd refuses",
            crate::screen::REFUSED.clone(),
        );
    }

    /// The capture budget in use, and policy reloads.
    fn register_capture_and_reloads(&self, r: &mut Registry, f: &Families) {
        r.register_with_unit(
            "nackd_capture",
            "Bytes of deliveries captured in case they are nacked",
            Unit::Bytes,
            self.capture_bytes.clone(),
        );
        r.register(
            "nackd_policy_reloads",
            "Policy reloads (SIGHUP), by result",
            f.reloads.clone(),
        );
    }

    /// Counts one republish set aside for `reason`.
    pub fn blocked(&self, reason: BlockReason) {
        self.blocked_total[reason as usize].inc();
    }

    /// Republishes set aside for `reason` so far.
    pub fn blocked_total(&self, reason: BlockReason) -> u64 {
        self.blocked_total[reason as usize].get()
    }

    /// The gauge of held messages currently set aside for `reason`.
    pub fn blocked_now(&self, reason: BlockReason) -> &Gauge {
        &self.blocked_now[reason as usize]
    }

    /// Sets why firing is paused (`None`: it is not).
    pub fn set_firing_paused(&self, paused: Option<PauseReason>) {
        for (r, gauge) in PauseReason::ALL.iter().zip(&self.firing_paused) {
            gauge.set(i64::from(paused == Some(*r)));
        }
    }

    /// Why firing is paused, if it is.
    pub fn firing_paused(&self) -> Option<PauseReason> {
        PauseReason::ALL
            .into_iter()
            .zip(&self.firing_paused)
            .find_map(|(r, gauge)| (gauge.get() != 0).then_some(r))
    }

    /// Observes a duration, in seconds.
    pub fn observe(histogram: &Histogram, d: Duration) {
        histogram.observe(d.as_secs_f64());
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Decrements a gauge when dropped: an open connection's lifetime.
#[derive(Debug)]
pub struct Open(Gauge);

impl Open {
    /// Increments `gauge` now, decrements it on drop.
    pub fn track(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests;

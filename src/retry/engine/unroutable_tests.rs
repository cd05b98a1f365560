//! `delayed.unroutable`: what becomes of a delayed message the broker
//! returns at its due time, on an engine whose broker is unreachable (the
//! return is handed to it as the republisher would report it).

use std::sync::Arc;

use bytes::Bytes;

use super::Engine;
use crate::config::{Delayed, Unroutable};
use crate::metrics::{BlockReason, Metrics};
use crate::net::Connector;
use crate::retry::republish::{Outcome, Report};
use crate::store::{Held, Log, Options, Route};

const EXCHANGE: &str = "later";

/// An engine over `dir` holding delayed message 1 (due now) of exchange
/// [`EXCHANGE`], routing key `k`, which it has fired (handed to its
/// republisher) and the broker returned; with `later`, message 2 of the
/// same exchange due much later. `fired_with`: the broker said `outcome`.
fn fired(dir: &std::path::Path, unroutable: Unroutable, alternate: Option<&str>) -> Engine {
    fired_with(
        dir,
        unroutable,
        alternate,
        false,
        Outcome::Returned {
            reply: "312 NO_ROUTE".into(),
        },
    )
}

fn fired_with(
    dir: &std::path::Path,
    unroutable: Unroutable,
    alternate: Option<&str>,
    later: bool,
    outcome: Outcome,
) -> Engine {
    let (mut log, _) = Log::open(dir, Options::default()).unwrap();
    let held = Held {
        id: 1,
        vhost: Arc::from("/"),
        queue: Arc::from(EXCHANGE),
        due_ms: 0,
        retry: 0,
        route: Route::Delayed {
            exchange: EXCHANGE.into(),
            routing_key: "k".into(),
        },
        on_return: None,
        header: Bytes::from_static(b"h"),
        body: Bytes::from_static(b"body"),
    };
    log.put(&held, None).unwrap();
    if later {
        let later = Held {
            id: 2,
            due_ms: u64::MAX / 2,
            ..held
        };
        log.put(&later, None).unwrap();
    }
    log.commit().unwrap();
    drop(log);
    let (log, recovered) = Log::open(dir, Options::default()).unwrap();
    let upstream = crate::config::Upstream {
        address: Some("127.0.0.1:9".into()),
        ..Default::default()
    };
    let mut options = crate::retry::Options::new(&Default::default(), "guest".into());
    options.delayed = Delayed {
        enabled: true,
        unroutable,
        alternate_exchange: alternate.map(str::to_string),
        ..Delayed::default()
    };
    let start = crate::retry::Start {
        dir: dir.to_owned(),
        store: Options::default(),
        replica: None,
        connector: Connector::new(&upstream).unwrap(),
        options,
        metrics: Metrics::new(),
        clock: nackd_core::clock::Clock::start(),
    };
    let mut engine = Engine::new(log, recovered, &start, None, crate::retry::Readiness::new());
    assert!(engine.ledger.get(1).unwrap().meta.delayed);
    engine.fire();
    assert!(engine.firing.is_handed(1), "fired");
    engine.on_report(Report { id: 1, outcome });
    engine
}

fn unroutable(m: &Metrics, action: &str) -> bool {
    m.encode().lines().any(|l| {
        l == format!(
            "nackd_delayed_unroutable_total{{vhost=\"/\",exchange=\"{EXCHANGE}\",action=\"{action}\"}} 1"
        )
    })
}

#[tokio::test]
async fn keep_sets_it_aside_to_try_again() {
    let dir = tempfile::tempdir().unwrap();
    let engine = fired(dir.path(), Unroutable::Keep, None);
    let entry = engine.ledger.get(1).expect("still held");
    assert!(entry.meta.delayed && !entry.inflight);
    assert_eq!(entry.attempts, 1);
    let reason = engine.ledger.reason(entry.blocked()).unwrap();
    assert_eq!(reason.kind, BlockReason::NoRoute);
    assert!(
        reason.reply.contains("delayed exchange"),
        "{}",
        reason.reply
    );
    let now = engine.clock.now_us();
    let wake = engine.next_wake().expect("scheduled again");
    assert!(
        wake > now && wake <= now + 200_000,
        "tried again after the first backoff (100 ms): in {} µs",
        wake.saturating_sub(now)
    );
    assert!(unroutable(&engine.metrics, "keep"));
    assert_eq!(engine.metrics.blocked_total(BlockReason::NoRoute), 1);
}

#[tokio::test]
async fn drop_forgets_it_and_counts_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = fired(dir.path(), Unroutable::Drop, None);
    assert!(engine.ledger.get(1).is_none(), "dropped");
    assert!(unroutable(&engine.metrics, "drop"));
    // Its delete reaches the store: a restart does not bring it back.
    let log = engine.stop_store();
    drop(log);
    let (_log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
    assert!(recovered.held.is_empty());
}

#[tokio::test]
async fn alternate_reroutes_it_with_its_routing_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = fired(dir.path(), Unroutable::Alternate, Some("lost"));
    let entry = engine.ledger.get(1).expect("still held");
    assert!(entry.rewriting, "a put of the new route is being written");
    assert!(unroutable(&engine.metrics, "alternate"));
    assert_eq!(engine.metrics.rerouted.get(), 1);
    let log = engine.stop_store();
    drop(log);
    let (log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
    assert_eq!(recovered.held.len(), 1);
    let held = log.reader().read(recovered.held[0].2).unwrap();
    assert_eq!(
        held.route,
        Route::Exchange {
            exchange: "lost".into(),
            routing_key: "k".into()
        }
    );
    assert_eq!(&held.body[..], b"body");
    assert!(!recovered.meta[0].delayed, "no longer a delayed message");
}

#[tokio::test]
async fn a_confirmed_delayed_message_counts_as_routed_not_dead_lettered() {
    let dir = tempfile::tempdir().unwrap();
    let engine = fired_with(
        dir.path(),
        Unroutable::Keep,
        None,
        false,
        Outcome::Confirmed,
    );
    assert!(engine.ledger.get(1).is_none(), "completed");
    let text = engine.metrics.encode();
    assert!(
        text.contains("nackd_delayed_routed_total{vhost=\"/\",exchange=\"later\"} 1"),
        "{text}"
    );
    assert_eq!(engine.metrics.exhausted_dead_letter.get(), 0);
    assert!(!text.contains("nackd_delayed_held_messages{"), "none held");
}

/// A delayed exchange deleted before the due time (404 on publish): its
/// message is kept, the exchange probed after a backoff, counted by reason.
#[tokio::test]
async fn a_missing_delayed_exchange_keeps_its_message() {
    let dir = tempfile::tempdir().unwrap();
    let aside = crate::retry::republish::SetAside {
        reason: BlockReason::NoExchange,
        reply: "404 NOT_FOUND - no exchange 'later' in vhost '/'".into(),
        exchange_wide: true,
    };
    let mut engine = fired_with(
        dir.path(),
        Unroutable::Drop,
        None,
        true,
        Outcome::SetAside(aside),
    );
    let entry = engine
        .ledger
        .get(1)
        .expect("kept, whatever delayed.unroutable says");
    assert!(entry.meta.delayed && !entry.inflight);
    assert_eq!(engine.metrics.blocked_total(BlockReason::NoExchange), 1);
    assert!(engine.next_wake().is_some(), "tried again");
    assert!(!unroutable(&engine.metrics, "drop"));
    // Another message of the exchange falls due: it waits for the probe,
    // without being read or sent.
    engine.schedule(2, 0);
    engine.fire();
    assert!(!engine.firing.is_handed(2), "held back");
    let entry = engine.ledger.get(2).expect("kept");
    let reason = engine.ledger.reason(entry.blocked()).unwrap();
    assert_eq!(reason.kind, BlockReason::NoExchange);
}

//! [`Outcomes`]: each event (a report, a due message to admit, a lost
//! republisher) and the action it answers with.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::*;
use crate::store::{Log, Options};

const T: u64 = 1_800_000_000_000;

/// An outcomes part, a ledger and a store holding `n` messages of queue
/// `q` in vhost `/` (ids 1..=n, due at `T`), on a manual clock at `T`.
struct Setup {
    outcomes: Outcomes,
    ledger: Ledger,
    reader: Reader,
    metrics: Arc<Metrics>,
    clock: Clock,
    _dir: tempfile::TempDir,
}

fn gone_rule(action: GoneAction) -> QueueGone {
    QueueGone {
        action,
        after: Duration::from_secs(60),
        probe_interval: Duration::from_secs(5),
        exchange: None,
        routing_key: None,
    }
}

fn setup(n: u64, route: Route, rule: QueueGone) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
    let metrics = Metrics::new();
    let clock = Clock::manual(T);
    let mut ledger = Ledger::new(metrics.clone());
    for id in 1..=n {
        let held = Held {
            id,
            vhost: Arc::from("/"),
            queue: Arc::from("q"),
            due_ms: T,
            retry: 1,
            route: route.clone(),
            on_return: None,
            header: Bytes::from_static(b"h"),
            body: Bytes::from_static(b"body"),
        };
        let loc = log.put(&held, None).unwrap();
        let meta = held.meta(ledger.intern(&held.vhost, &held.queue));
        ledger.insert(id, Entry::new(loc, T, meta));
    }
    log.commit().unwrap();
    let outcomes = Outcomes::new(rule, Delayed::default(), metrics.clone(), clock.clone());
    Setup {
        outcomes,
        ledger,
        reader: log.reader(),
        metrics,
        clock,
        _dir: dir,
    }
}

fn to_queue() -> Dest {
    Dest {
        vhost: 0,
        queue: 0,
        queue_route: true,
        exchange: Arc::from(""),
    }
}

fn to_exchange(name: &str) -> Dest {
    Dest {
        vhost: 0,
        queue: 0,
        queue_route: false,
        exchange: Arc::from(name),
    }
}

impl Setup {
    fn report(&mut self, id: u64, dest: &Dest, outcome: Outcome) -> Option<Action> {
        self.outcomes
            .on_report(&mut self.ledger, &self.reader, id, dest, outcome)
    }

    fn admit(&mut self, id: u64) -> Admit {
        let entry = *self.ledger.get(id).unwrap();
        self.outcomes
            .admit(&self.ledger, 0, id, &entry, self.clock.now_ms())
    }
}

fn exchange_refused() -> Outcome {
    Outcome::SetAside(SetAside {
        reason: BlockReason::NoExchange,
        reply: "404 NOT_FOUND - no exchange 'x'".into(),
        exchange_wide: true,
    })
}

#[test]
fn a_confirm_completes_the_message() {
    let mut s = setup(1, Route::Queue, gone_rule(GoneAction::Keep));
    let action = s.report(1, &to_queue(), Outcome::Confirmed);
    assert!(matches!(action, Some(Action::Complete(1))), "{action:?}");
    assert_eq!(s.metrics.confirmed.get(), 1);
}

#[test]
fn a_nack_sets_the_message_aside_with_a_backoff_of_its_own() {
    let mut s = setup(1, Route::Queue, gone_rule(GoneAction::Keep));
    let action = s.report(1, &to_queue(), Outcome::Nacked);
    let Some(Action::Hold { id: 1, at, reason }) = action else {
        panic!("{action:?}");
    };
    assert_eq!(at, T + 200, "the first backoff step after one attempt");
    assert_eq!(s.ledger.reason(reason).unwrap().kind, BlockReason::Nacked);
    assert_eq!(s.ledger.get(1).unwrap().attempts, 1);
    let again = s.report(1, &to_queue(), Outcome::Nacked);
    assert!(
        matches!(again, Some(Action::Hold { at, .. }) if at == T + 400),
        "the backoff doubles: {again:?}"
    );
}

#[test]
fn an_outcome_for_a_message_no_longer_held_calls_for_nothing() {
    let mut s = setup(1, Route::Queue, gone_rule(GoneAction::Keep));
    s.ledger.complete(1);
    assert!(s.report(1, &to_queue(), Outcome::Nacked).is_none());
}

#[test]
fn an_exchange_refused_holds_back_its_other_messages_until_the_probe() {
    let route = Route::Exchange {
        exchange: "x".into(),
        routing_key: "k".into(),
    };
    let mut s = setup(2, route.clone(), gone_rule(GoneAction::Keep));
    let action = s.report(1, &to_exchange("x"), exchange_refused());
    let Some(Action::Hold { id: 1, at, reason }) = action else {
        panic!("{action:?}");
    };
    assert!(at > T, "probed again later");
    assert_eq!(
        s.ledger.reason(reason).unwrap().kind,
        BlockReason::NoExchange
    );
    let now = s.clock.now_ms();
    let held_back = s.outcomes.admit_route(&s.ledger, 0, 2, &route, now);
    assert_eq!(held_back, Admit::Hold { at, reason }, "not read, not sent");
    assert_eq!(s.outcomes.blocked_exchanges(&s.ledger).len(), 1);
    // The exchange works again: nothing is held back any more.
    let works = s.report(1, &to_exchange("x"), Outcome::Confirmed);
    assert!(matches!(works, Some(Action::Complete(1))));
    assert!(s.outcomes.blocked_exchanges(&s.ledger).is_empty());
    let now = s.clock.now_ms();
    assert_eq!(
        s.outcomes.admit_route(&s.ledger, 0, 2, &route, now),
        Admit::Go
    );
}

#[test]
fn a_message_refused_for_itself_says_nothing_about_its_exchange() {
    let mut s = setup(2, Route::Queue, gone_rule(GoneAction::Keep));
    let aside = Outcome::SetAside(SetAside {
        reason: BlockReason::ChannelError,
        reply: "406 PRECONDITION_FAILED".into(),
        exchange_wide: false,
    });
    assert!(matches!(
        s.report(1, &to_queue(), aside),
        Some(Action::Hold { id: 1, .. })
    ));
    assert_eq!(s.admit(2), Admit::Go);
}

#[test]
fn a_return_from_a_gone_queue_holds_its_messages_then_its_rule_applies() {
    let mut s = setup(2, Route::Queue, gone_rule(GoneAction::Drop));
    let returned = Outcome::Returned {
        reply: "312 NO_ROUTE".into(),
    };
    let action = s.report(1, &to_queue(), returned);
    let Some(Action::Hold { id: 1, at, reason }) = action else {
        panic!("{action:?}");
    };
    assert_eq!(at, T + 5000, "probed again after probe_interval");
    assert_eq!(s.outcomes.gone_since(0), Some(T));
    assert_eq!(s.admit(2), Admit::Hold { at, reason }, "held back");
    // Gone longer than `after`: the rule (drop) applies at firing.
    s.clock.advance(Duration::from_secs(61));
    assert_eq!(s.admit(2), Admit::GoneRule);
    let held = s.reader.read(s.ledger.get(2).unwrap().loc).unwrap();
    let action = s.outcomes.gone_action(2, held);
    assert!(matches!(action, Action::Complete(2)), "{action:?}");
    assert_eq!(s.metrics.gone_dropped.get(), 1);
}

#[test]
fn a_gone_queue_that_holds_nothing_is_not_watched() {
    let mut s = setup(1, Route::Queue, gone_rule(GoneAction::Keep));
    let returned = Outcome::Returned {
        reply: "312 NO_ROUTE".into(),
    };
    assert!(s.report(1, &to_queue(), returned).is_some());
    assert!(s.outcomes.gone_since(0).is_some());
    s.ledger.complete(1);
    s.outcomes.queue_emptied(&s.ledger, 0);
    assert_eq!(s.outcomes.gone_since(0), None);
}

#[test]
fn a_return_with_a_dead_letter_route_reroutes_it() {
    let mut s = setup(1, Route::Queue, gone_rule(GoneAction::Keep));
    // Message 2 carries its dead-letter route.
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
    let dlx = Route::Exchange {
        exchange: "dlx".into(),
        routing_key: "q".into(),
    };
    let held = Held {
        id: 2,
        vhost: Arc::from("/"),
        queue: Arc::from("q"),
        due_ms: T,
        retry: 1,
        route: Route::Queue,
        on_return: Some(dlx.clone()),
        header: Bytes::from_static(b"h"),
        body: Bytes::from_static(b"body"),
    };
    let loc = log.put(&held, None).unwrap();
    log.commit().unwrap();
    let meta = held.meta(0);
    s.ledger.insert(2, Entry::new(loc, T, meta));
    s.reader = log.reader();
    let returned = Outcome::Returned {
        reply: "312 NO_ROUTE".into(),
    };
    let action = s.report(2, &to_queue(), returned);
    let Some(Action::Reroute { id: 2, route, .. }) = action else {
        panic!("{action:?}");
    };
    assert_eq!(route, dlx);
    assert_eq!(s.metrics.rerouted.get(), 1);
}

#[test]
fn a_lost_republisher_sets_its_message_aside() {
    let mut s = setup(1, Route::Queue, gone_rule(GoneAction::Keep));
    let action = s.outcomes.lost(&mut s.ledger, 1, &to_queue());
    let Some(Action::Hold { id: 1, reason, .. }) = action else {
        panic!("{action:?}");
    };
    assert_eq!(
        s.ledger.reason(reason).unwrap().kind,
        BlockReason::ChannelError
    );
}

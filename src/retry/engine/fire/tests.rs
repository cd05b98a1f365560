//! [`Firing`]: each event (a slot armed, a pass, a hand-over, a report, a
//! pause) and what it gives back.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::*;
use crate::store::Loc;
use nackd_core::held::HeldMeta;

const T: u64 = 1_800_000_000_000;
const T_US: u64 = T * 1000;

/// A firing part on a manual clock at `T`, its broker unreachable (a
/// republisher it starts never reports), `max_pending_bytes` as given.
fn firing(max_pending_bytes: u64) -> (Firing, Clock, Arc<Metrics>) {
    let upstream = crate::config::Upstream {
        address: Some("127.0.0.1:9".into()),
        ..Default::default()
    };
    let connector = Connector::new(&upstream).unwrap();
    let options = crate::retry::Options::new(&Default::default(), "guest".into());
    let metrics = Metrics::new();
    let clock = Clock::manual(T);
    let (reports, _) = mpsc::unbounded_channel();
    let firing = Firing::new(
        connector,
        options.republish,
        max_pending_bytes,
        reports,
        metrics.clone(),
        clock.clone(),
    );
    (firing, clock, metrics)
}

fn names() -> Vec<Arc<str>> {
    vec![Arc::from("/")]
}

/// Every slot of vhost 0 due by `now_us`, with budget to spare.
fn due(firing: &mut Firing, now_us: u64) -> Vec<Slot> {
    let mut budget = PASS;
    std::iter::from_fn(|| firing.next_due(0, now_us, &mut budget)).collect()
}

fn entry() -> Entry {
    let loc = Loc {
        segment: 1,
        offset: 0,
        len: 10,
    };
    let meta = HeldMeta {
        queue: 0,
        size: 5,
        retry: 1,
        dead_letter: false,
        delayed: false,
    };
    Entry::new(loc, T, meta)
}

fn held(id: u64, size: usize) -> Held {
    Held {
        id,
        vhost: Arc::from("/"),
        queue: Arc::from("q"),
        due_ms: T,
        retry: 1,
        route: Route::Queue,
        on_return: None,
        header: Bytes::from_static(b"h"),
        body: Bytes::from(vec![0; size]),
    }
}

#[test]
fn slots_come_out_in_due_order_once_due() {
    let (mut f, _, _) = firing(u64::MAX);
    let late = f.arm(&names(), 0, T_US + 2_000, 2);
    let soon = f.arm(&names(), 0, T_US + 1_000, 1);
    assert!(due(&mut f, T_US).is_empty(), "nothing due yet");
    assert_eq!(due(&mut f, T_US + 5_000), [(soon, 1), (late, 2)]);
    assert!(due(&mut f, T_US + 5_000).is_empty(), "each slot once");
}

#[test]
fn what_falls_due_between_two_grid_points_goes_together_at_the_second() {
    // A pass runs whenever the engine wakes (a park, a store write, a
    // confirm): one between two grid points fires nothing new, so the
    // messages due within one grid period leave in one batch.
    let (mut f, _, _) = firing(u64::MAX);
    assert_eq!(T_US % WAKE_GRID_US, 0, "T is a grid point");
    let a = f.arm(&names(), 0, T_US + 1, 1);
    let b = f.arm(&names(), 0, T_US + WAKE_GRID_US / 2, 2);
    let c = f.arm(&names(), 0, T_US + WAKE_GRID_US, 3);
    let d = f.arm(&names(), 0, T_US + WAKE_GRID_US + 1, 4);
    for now in [T_US + 1, T_US + WAKE_GRID_US / 2, T_US + WAKE_GRID_US - 1] {
        assert!(due(&mut f, now).is_empty(), "a pass at {now} fired early");
    }
    assert_eq!(due(&mut f, T_US + WAKE_GRID_US), [(a, 1), (b, 2), (c, 3)]);
    assert!(due(&mut f, 2 * WAKE_GRID_US + T_US - 1).is_empty());
    assert_eq!(due(&mut f, T_US + 2 * WAKE_GRID_US), [(d, 4)]);
    assert_eq!(f.next_wake(T_US + 2 * WAKE_GRID_US), None);
}

#[test]
fn a_message_armed_for_a_time_the_wheel_passed_fires_at_the_next_pass() {
    // Overdue (a recovered message, a "fire now"): armed at the wheel's
    // time, which is on the grid, so the very next pass takes it.
    let (mut f, clock, _) = firing(u64::MAX);
    clock.advance(Duration::from_micros(WAKE_GRID_US / 3));
    let armed = f.arm(&names(), 0, 0, 1);
    assert_eq!(armed, T_US, "the wheel started on the grid point before");
    assert_eq!(due(&mut f, T_US + WAKE_GRID_US / 3), [(armed, 1)]);
    // One due after the last grid point waits for the next, never early.
    let soon = f.arm(&names(), 0, T_US + WAKE_GRID_US / 4, 2);
    assert!(due(&mut f, T_US + WAKE_GRID_US / 3).is_empty());
    assert_eq!(due(&mut f, T_US + WAKE_GRID_US), [(soon, 2)]);
}

#[test]
fn the_next_wake_is_the_next_deadline_on_the_grid() {
    let (mut f, _, _) = firing(u64::MAX);
    assert_eq!(f.next_wake(T_US), None, "nothing armed");
    let armed = f.arm(&names(), 0, T_US + 1_001, 1);
    let wake = f.next_wake(T_US).unwrap();
    assert_eq!(wake % WAKE_GRID_US, 0, "on the grid: {wake}");
    assert!(
        wake > T_US && wake <= armed.next_multiple_of(WAKE_GRID_US),
        "{wake}"
    );
}

#[test]
fn a_pass_that_runs_out_of_budget_asks_to_run_again_at_once() {
    let (mut f, _, _) = firing(u64::MAX);
    f.arm(&names(), 0, T_US, 1);
    f.arm(&names(), 0, T_US, 2);
    f.begin_pass();
    let mut budget = 1;
    assert!(f.next_due(0, T_US, &mut budget).is_some());
    assert!(f.next_due(0, T_US, &mut budget).is_none(), "budget spent");
    assert_eq!(f.next_wake(T_US), Some(T_US), "more to do now");
    f.begin_pass();
    assert_eq!(due(&mut f, T_US).len(), 1, "the rest on the next pass");
}

#[tokio::test]
async fn a_hand_over_takes_room_and_its_report_gives_it_back() {
    // Room for one message of 5 bytes: the second waits for the report.
    let (mut f, _, metrics) = firing(5);
    f.arm(&names(), 0, T_US, 1);
    f.arm(&names(), 0, T_US, 2);
    let mut budget = PASS;
    let (_, id) = f.next_due(0, T_US, &mut budget).unwrap();
    f.hand(0, id, &entry(), held(id, 4), T);
    assert!(f.is_handed(id));
    assert_eq!(f.pending_bytes(), 5);
    assert_eq!(metrics.published.get(), 1);
    assert!(f.next_due(0, T_US, &mut budget).is_none(), "no room");
    assert_eq!(f.next_wake(T_US), None, "no wake while there is no room");
    let dest = f.on_report(id).expect("it was handed");
    assert_eq!((dest.vhost, dest.queue, dest.queue_route), (0, 0, true));
    assert_eq!(f.pending_bytes(), 0);
    assert!(f.on_report(id).is_none(), "one report per hand-over");
    assert_eq!(f.next_due(0, T_US, &mut budget).map(|s| s.1), Some(2));
    f.stop().await;
}

#[test]
fn a_pause_is_kept_with_its_start_until_it_ends() {
    let (mut f, clock, metrics) = firing(u64::MAX);
    assert!(!f.is_paused());
    f.on_pause(Some(PauseReason::DiskFull), 0);
    assert!(f.is_paused());
    assert_eq!(metrics.firing_paused(), Some(PauseReason::DiskFull));
    let since = f.paused.unwrap().1;
    clock.advance(Duration::from_secs(1));
    f.on_pause(Some(PauseReason::DiskFull), 0);
    assert_eq!(f.paused.unwrap().1, since, "the same pause goes on");
    f.on_pause(None, 0);
    assert!(!f.is_paused());
    assert_eq!(metrics.firing_paused(), None);
}

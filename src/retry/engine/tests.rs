//! The engine's own tests: parks, restarts, shutdown, pauses.

use super::*;
use crate::net::Connector;
use crate::retry::{ClaimKey, Command, RetryHandle};
use crate::store::{Options, Route};
use bytes::Bytes;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What an engine on `dir` needs, its broker unreachable.
fn start(dir: &std::path::Path) -> crate::retry::Start {
    let upstream = crate::config::Upstream {
        address: Some("127.0.0.1:9".into()),
        ..Default::default()
    };
    crate::retry::Start {
        dir: dir.to_owned(),
        store: Options::default(),
        replica: None,
        connector: Connector::new(&upstream).unwrap(),
        options: crate::retry::Options::new(&Default::default(), "guest".into()),
        metrics: Metrics::new(),
        clock: nackd_core::clock::Clock::start(),
    }
}

fn park(tag: u64) -> Park {
    Park {
        key: ClaimKey {
            channel: 1,
            epoch: 1,
            tag,
            seq: tag,
        },
        vhost: Arc::from("/"),
        queue: Arc::from("q"),
        delay: Duration::from_secs(3600),
        retry: 1,
        route: Route::Queue,
        on_return: None,
        header: Bytes::from_static(b"h"),
        body: Bytes::from_static(b"body"),
        ticket: Default::default(),
    }
}

/// Issue 33, item 5: a delayed publish whose session gave it up (the
/// store answered after the settle timeout; the publisher got a nack,
/// and its connection ended) is not held when the store answers at
/// last: deleted, on disk too, so that neither this process nor a
/// restart fires it (its publisher republished it).
#[tokio::test]
async fn a_park_given_up_by_its_session_is_deleted_not_fired() {
    let dir = tempfile::tempdir().unwrap();
    let (handle, _engine): (RetryHandle, _) =
        crate::retry::start(start(dir.path()), CancellationToken::new());
    let mut withdrawn = park(1);
    withdrawn.route = Route::Delayed {
        exchange: "x".into(),
        routing_key: "k".into(),
    };
    assert!(withdrawn.ticket.give_up(), "the session gives it up first");
    let (gone, dropped) = mpsc::unbounded_channel();
    drop(dropped); // and its session ended
    assert!(handle.park(withdrawn, &gone));
    let (alive, mut answers) = mpsc::unbounded_channel();
    assert!(handle.park(park(2), &alive));
    let answer = answers.recv().await.unwrap();
    let kept = answer.result.expect("the other park is held");
    let (listed, total) = handle.list(None, None, 10).await.unwrap();
    assert_eq!(total, 1, "only the park still standing is held");
    assert_eq!(listed[0].0.id, kept);
    one_left_on_disk(dir.path(), "the given-up copy is still on disk").await;
}

/// Issue 12, item 6: a session that ended before its message was
/// stored never acked it, so the broker redelivers it: nackd must not
/// hold it too.
#[tokio::test]
async fn a_park_for_a_session_that_is_gone_is_completed() {
    let dir = tempfile::tempdir().unwrap();
    let (handle, _engine): (RetryHandle, _) =
        crate::retry::start(start(dir.path()), CancellationToken::new());
    let (gone, dropped) = mpsc::unbounded_channel();
    drop(dropped);
    assert!(handle.park(park(1), &gone));
    let (alive, mut answers) = mpsc::unbounded_channel();
    assert!(handle.park(park(2), &alive));
    let answer = answers.recv().await.unwrap();
    assert!(answer.result.is_ok());
    let (listed, total) = handle.list(None, None, 10).await.unwrap();
    assert_eq!(
        total, 1,
        "only the session that is still there has one held"
    );
    assert_eq!(listed[0].0.id, answer.result.unwrap());
    // And its delete reaches the disk: a restart does not bring it back.
    one_left_on_disk(dir.path(), "the orphan is still on disk").await;
}

/// Shutdown: stopping the engine ends its thread only once the store
/// writer committed and was joined (the store's lock is free again).
#[tokio::test]
async fn a_stopped_engine_has_released_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let (handle, engine): (RetryHandle, _) =
        crate::retry::start(start(dir.path()), CancellationToken::new());
    let (reply, mut answers) = mpsc::unbounded_channel();
    assert!(handle.park(park(1), &reply));
    let id = answers.recv().await.unwrap().result.unwrap();
    engine.stop(Duration::from_secs(10)).await;
    let (_log, recovered) =
        Log::open(dir.path(), Options::default()).expect("the lock was released");
    let held: Vec<u64> = recovered.held.iter().map(|h| h.0).collect();
    assert_eq!(held, [id]);
    assert!(!handle.park(park(2), &reply), "the engine is gone");
}

/// Shutdown: the sessions end first, and the last thing a session does
/// is cancel the copies it could not ack (the broker requeued their
/// deliveries). Those cancels are queued when the engine is told to
/// stop: they must be applied (and committed) before it stops, or the
/// copies come back after a restart and are delivered twice.
#[tokio::test]
async fn cancels_queued_before_the_stop_are_applied() {
    let dir = tempfile::tempdir().unwrap();
    const N: u64 = 16;
    // Hold N messages, then stop cleanly.
    let (handle, engine): (RetryHandle, _) =
        crate::retry::start(start(dir.path()), CancellationToken::new());
    let (reply, mut answers) = mpsc::unbounded_channel();
    for tag in 1..=N {
        assert!(handle.park(park(tag), &reply));
    }
    let mut ids = Vec::new();
    for _ in 0..N {
        ids.push(answers.recv().await.unwrap().result.unwrap());
    }
    engine.stop(Duration::from_secs(10)).await;
    // A new engine on that store: every held copy is cancelled, and
    // shutdown comes right behind the cancels.
    let (log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
    assert_eq!(recovered.held.len() as u64, N);
    let start = start(dir.path());
    let ready = crate::retry::Readiness::new();
    let engine = Engine::new(log, recovered, &start, None, ready);
    let (tx, mut commands) = mpsc::unbounded_channel();
    for id in &ids {
        tx.send(Command::Cancel(*id)).unwrap();
    }
    let stop = CancellationToken::new();
    stop.cancel();
    let (_adopt_tx, mut adopts) = mpsc::channel(1);
    let exit = engine.run(&mut commands, &mut adopts, &stop).await;
    assert!(matches!(exit, Exit::Stopped));
    let (_log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
    assert!(
        recovered.held.is_empty(),
        "cancelled before the stop, still held: {:?}",
        recovered.held
    );
}

/// Issue 21, item 6: a message stored here whose replica append
/// failed is not held (its nack is deferred): its local copy goes, and
/// a completion goes to the stream, which may have it all the same (a
/// confirm lost with its connection), so that no rebuild or adoption
/// brings it back while the broker redelivers it too.
#[tokio::test]
async fn a_failed_replica_append_deletes_the_copy_and_completes_it_in_the_stream() {
    use crate::replica::{Command as ToReplica, Record, ReplicaError, State};
    let dir = tempfile::tempdir().unwrap();
    let (log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
    let start = start(dir.path());
    let (replica, mut to_replica, state) = crate::replica::Replica::detached("test");
    state.send(State::Active).unwrap();
    let ready = crate::retry::Readiness::new();
    let engine = Engine::new(log, recovered, &start, Some(replica), ready);
    let (tx, mut commands) = mpsc::unbounded_channel();
    let (reply, mut answers) = mpsc::unbounded_channel();
    tx.send(Command::Park(park(1), reply)).unwrap();
    let stop = CancellationToken::new();
    let (_adopt_tx, mut adopts) = mpsc::channel(1);
    let replica_side = async {
        let appended = match to_replica.recv().await {
            Some(ToReplica::Append { record, reply }) => {
                let _ = reply.send(Err(ReplicaError("connection lost".into())));
                record
            }
            _ => panic!("the park is appended to the replica first"),
        };
        let Record::Put { record, .. } = appended else {
            panic!("a put: {appended:?}");
        };
        let id = crate::store::record::id_of(&record).unwrap();
        let answer = answers.recv().await.unwrap();
        assert!(answer.result.is_err(), "not held: {:?}", answer.result);
        let completed = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match to_replica.recv().await {
                    Some(ToReplica::Done(done)) => return done,
                    Some(_) => {}
                    None => panic!("the engine dropped the replica"),
                }
            }
        })
        .await
        .expect("a completion for the message the replica may hold");
        assert_eq!(completed, id);
        stop.cancel();
    };
    let (exit, ()) = tokio::join!(engine.run(&mut commands, &mut adopts, &stop), replica_side);
    assert!(matches!(exit, Exit::Stopped));
    let (_log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
    assert!(recovered.held.is_empty(), "the local copy is deleted");
}

/// Issue 33, item 7: the host slept (its monotonic clock stood still,
/// its wall clock went on) before a nack. The stored due time is the
/// wall clock at the nack plus the delay: a restart does not fire it
/// early by the time slept.
#[tokio::test]
async fn a_due_time_after_a_suspend_is_the_wall_clock_at_the_nack_plus_the_delay() {
    use nackd_core::clock::Clock;
    const T: u64 = 1_800_000_000_000;
    const SLEPT_MS: u64 = 600_000;
    let dir = tempfile::tempdir().unwrap();
    let clock = Clock::manual(T);
    let mut started = start(dir.path());
    started.clock = clock.clone();
    let (handle, engine): (RetryHandle, _) = crate::retry::start(started, CancellationToken::new());
    clock.step_wall(SLEPT_MS as i64);
    let (reply, mut answers) = mpsc::unbounded_channel();
    let parked = park(1);
    let delay_ms = parked.delay.as_millis() as u64;
    assert!(handle.park(parked, &reply));
    answers.recv().await.unwrap().result.unwrap();
    engine.stop(Duration::from_secs(10)).await;
    let (_log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
    let due = recovered.held[0].1;
    assert!(
        due >= T + SLEPT_MS + delay_ms,
        "stored due {due} is {} ms before the wall clock at the nack plus the delay",
        (T + SLEPT_MS + delay_ms).saturating_sub(due)
    );
}

/// Issue 33, item 7: a restart after the wall clock was set back. The
/// message waits for the time it had left when the store last wrote:
/// not less (never early), and not the step longer.
#[tokio::test]
async fn a_restart_on_a_wall_clock_set_back_holds_for_the_time_that_was_left() {
    use nackd_core::clock::Clock;
    const T: u64 = 1_800_000_000_000;
    const BACK_MS: u64 = 600_000;
    let dir = tempfile::tempdir().unwrap();
    let mut before = start(dir.path());
    before.clock = Clock::manual(T);
    let (handle, engine): (RetryHandle, _) = crate::retry::start(before, CancellationToken::new());
    let (reply, mut answers) = mpsc::unbounded_channel();
    let parked = park(1);
    let delay_ms = parked.delay.as_millis() as u64;
    assert!(handle.park(parked, &reply));
    let id = answers.recv().await.unwrap().result.unwrap();
    engine.stop(Duration::from_secs(10)).await;
    // The restart: its wall clock was set back meanwhile.
    let (log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
    let mut after = start(dir.path());
    after.clock = Clock::manual(T - BACK_MS);
    let ready = crate::retry::Readiness::new();
    let engine = Engine::new(log, recovered, &after, None, ready);
    let due = engine.ledger.get(id).expect("held again").due_ms;
    let left = due.saturating_sub(engine.clock.now_ms());
    assert!(left >= delay_ms, "early: {left} ms left of {delay_ms}");
    assert!(
        left < delay_ms + BACK_MS,
        "{left} ms left of {delay_ms}: late by the wall clock's step back"
    );
}

/// Writes messages 1..=`n` (due far ahead) to the store in `dir`, as a
/// nackd that held them before a restart left it.
fn hold_before_a_restart(dir: &std::path::Path, n: u64) {
    let (mut log, _) = Log::open(dir, Options::default()).unwrap();
    for id in 1..=n {
        let held = Held {
            id,
            vhost: Arc::from("/"),
            queue: Arc::from("q"),
            due_ms: u64::MAX / 2,
            retry: 1,
            route: Route::Queue,
            on_return: None,
            header: Bytes::from_static(b"h"),
            body: Bytes::from_static(b"old"),
        };
        log.put(&held, None).unwrap();
    }
    log.commit().unwrap();
}

/// Issue 19: a restart holds nacks at once. With a store full of
/// messages held before it, a park is answered while the older
/// segments are still being read, and they are all scheduled after
/// (in steps: more than one [`LOAD_STEP`] here).
#[tokio::test]
async fn a_restart_parks_at_once_and_schedules_what_it_held_after() {
    let dir = tempfile::tempdir().unwrap();
    let before = LOAD_STEP as u64 + 4_000;
    hold_before_a_restart(dir.path(), before);
    let start = start(dir.path());
    let metrics = start.metrics.clone();
    let (handle, engine): (RetryHandle, _) = crate::retry::start(start, CancellationToken::new());
    let (reply, mut answers) = mpsc::unbounded_channel();
    assert!(handle.park(park(1), &reply));
    let answer = answers.recv().await.unwrap();
    let id = answer.result.expect("parked while the store recovers");
    assert!(id > before, "a new id, above every old one: {id}");
    let mut total = 0;
    for _ in 0..1000 {
        total = handle.list(None, None, 1).await.unwrap().1;
        if total as u64 == before + 1 && metrics.store_recovering.get() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        total as u64,
        before + 1,
        "every old message scheduled, and the new one"
    );
    assert_eq!(metrics.store_recovering.get(), 0);
    engine.stop(Duration::from_secs(10)).await;
    let (_log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
    assert_eq!(recovered.held.len() as u64, before + 1);
}

/// Issue 19: while the store cannot record completions (another
/// process filled its disk), the engine fires nothing, not even what
/// an operator fires now; it resumes by itself once the disk has room.
#[tokio::test]
async fn nothing_fires_while_the_store_cannot_record_completions() {
    use crate::metrics::PauseReason;
    use crate::retry::Target;
    use std::sync::atomic::{AtomicU64, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let (mut log, recovered) = Log::open(dir.path(), Options::default()).unwrap();
    let disk = Arc::new(AtomicU64::new(1 << 30));
    log.faults.disk = Some(disk.clone());
    let start = start(dir.path());
    let metrics = start.metrics.clone();
    let ready = crate::retry::Readiness::new();
    let engine = Engine::new(log, recovered, &start, None, ready.clone());
    let (tx, mut commands) = mpsc::unbounded_channel();
    let handle = RetryHandle {
        tx,
        ready,
        reseeds: mpsc::unbounded_channel().0,
    };
    let (_adopt_tx, mut adopts) = mpsc::channel(1);
    let stop = CancellationToken::new();
    // Waited for on the engine's clock (a real one here).
    let clock = start.clock.clone();
    let wait = |what: &'static str, f: Box<dyn Fn() -> bool>| {
        let clock = clock.clone();
        async move {
            let began = clock.now();
            while !f() {
                assert!(clock.now() - began < Duration::from_secs(10), "{what}");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    let test = async {
        let (reply, mut answers) = mpsc::unbounded_channel();
        assert!(handle.park(park(1), &reply) && handle.park(park(2), &reply));
        let one = answers.recv().await.unwrap().result.unwrap();
        let two = answers.recv().await.unwrap().result.unwrap();
        disk.store(0, Ordering::SeqCst); // someone else took every byte
        handle.cancel(one); // a completion: its delete does not fit
        let m = metrics.clone();
        let paused = move || m.firing_paused() == Some(PauseReason::DiskFull);
        wait("paused", Box::new(paused)).await;
        // Fire now: the pass that follows the command fires nothing
        // (the list below is answered after it).
        assert_eq!(handle.fire(Target::Id(two)).await.unwrap(), 1);
        handle.list(None, None, 10).await.unwrap();
        assert_eq!(metrics.published.get(), 0, "fired while paused");
        disk.store(1 << 30, Ordering::SeqCst);
        let m = metrics.clone();
        let resumed = move || m.firing_paused().is_none() && m.published.get() == 1;
        wait("resumed and fired", Box::new(resumed)).await;
        stop.cancel();
    };
    let (exit, ()) = tokio::join!(engine.run(&mut commands, &mut adopts, &stop), test);
    assert!(matches!(exit, Exit::Stopped));
}

/// Review 3: with a NEXT_ID lowered by hand, a message parked at the
/// start takes an id an older record has. The merge reports it; the
/// engine must not then let the older record replace the parked
/// message in the ledger: the parked one (acked to the broker) would
/// never fire, and a cancel of its id would complete the older one.
/// The newer record is the one a restart keeps: the engine keeps it too.
#[tokio::test]
async fn an_older_message_with_a_parked_id_does_not_replace_it() {
    let dir = tempfile::tempdir().unwrap();
    hold_before_a_restart(dir.path(), 3);
    std::fs::write(dir.path().join("NEXT_ID"), "ahead 1\n").unwrap();
    let (log, mut backlog) = Log::open_deferred(dir.path(), Options::default()).unwrap();
    let start = start(dir.path());
    let recovered = Recovered {
        next_id: log.next_id(),
        ..Default::default()
    };
    let ready = crate::retry::Readiness::new();
    let mut engine = Engine::new(log, recovered, &start, None, ready);
    let (reply, mut answers) = mpsc::unbounded_channel();
    engine.park(park(1), reply);
    match engine.events.recv().await.unwrap() {
        store::Event::Written(w) => engine.on_written(w),
        _ => panic!("not the park's answer"),
    }
    let id = answers.recv().await.unwrap().result.unwrap();
    assert_eq!(id, 1, "the id an older record has");
    let parked_due = engine.ledger.get(id).unwrap().due_ms;
    engine.on_backlog(backlog.read());
    engine.load_step(usize::MAX);
    let entry = engine.ledger.get(id).expect("held");
    assert_eq!(
        entry.due_ms, parked_due,
        "the older record replaced the parked one"
    );
    assert_eq!(
        entry.armed_us.div_ceil(1000),
        parked_due,
        "armed for the parked one"
    );
    assert_eq!(
        engine.ledger.len(),
        3,
        "the parked one and the older 2 and 3"
    );
    let log = engine.stop_store();
    assert_eq!(log.mismatched_releases(), 0, "the older record was live");
}

/// Review of issue 19: when the older segments cannot be read (an I/O
/// error), their messages must not wait silently for a restart that
/// nobody is told to make: the store stays "recovering" (the gauge,
/// `/readyz`) and the read is tried again, so they fire once it works.
#[tokio::test]
async fn a_failed_read_of_the_older_segments_is_tried_again() {
    use crate::store::segment_path;
    let dir = tempfile::tempdir().unwrap();
    hold_before_a_restart(dir.path(), 3);
    let (log, backlog) = Log::open_deferred(dir.path(), Options::default()).unwrap();
    // The first read fails: the segment cannot be read for now.
    let first = segment_path(dir.path(), 1);
    let aside = dir.path().join("aside");
    std::fs::rename(&first, &aside).unwrap();
    let start = start(dir.path());
    let metrics = start.metrics.clone();
    let ready = crate::retry::Readiness::new();
    let recovered = Recovered {
        next_id: log.next_id(),
        ..Default::default()
    };
    let mut engine = Engine::new(log, recovered, &start, None, ready.clone());
    engine.read_backlog(backlog);
    let (tx, mut commands) = mpsc::unbounded_channel();
    let handle = RetryHandle {
        tx,
        ready,
        reseeds: mpsc::unbounded_channel().0,
    };
    let (_adopt_tx, mut adopts) = mpsc::channel(1);
    let stop = CancellationToken::new();
    // Waited for on the engine's clock (a real one here).
    let clock = start.clock.clone();
    let test = async {
        let began = clock.now();
        while metrics.store_errors.get() == 0 {
            assert!(
                clock.now() - began < Duration::from_secs(10),
                "no read error"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            metrics.store_recovering.get(),
            1,
            "the older segments are not read: still recovering"
        );
        std::fs::rename(&aside, &first).unwrap();
        let began = clock.now();
        loop {
            let total = handle.list(None, None, 1).await.unwrap().1;
            if total == 3 && metrics.store_recovering.get() == 0 {
                break;
            }
            assert!(
                clock.now() - began < Duration::from_secs(30),
                "the older messages never came: {total} held"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.cancel();
    };
    let (exit, ()) = tokio::join!(engine.run(&mut commands, &mut adopts, &stop), test);
    assert!(matches!(exit, Exit::Stopped));
}

/// Waits (5 s at most) until the store in `dir` holds exactly one message
/// on disk; panics with `what` if it does not.
async fn one_left_on_disk(dir: &std::path::Path, what: &str) {
    for _ in 0..500 {
        if crate::store::inspect::held(dir).unwrap().len() == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}");
}

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::{Coalesce, CLIENT, STREAK, UPSTREAM};

const PAUSE: Duration = Duration::from_micros(100);
const SHORT: Duration = Duration::from_micros(10);

/// One wake-up of `c`, `gap` after it slept: `read` sends, nackd writes
/// to the other side; returns its pause.
fn wake(c: &mut Coalesce, t: &mut Instant, gap: Duration, read: usize) -> Option<Duration> {
    *t += gap;
    let pause = c.on_wake(*t);
    *t += pause.unwrap_or_default();
    c.read(read);
    c.wrote(1 - read);
    *t += SHORT;
    c.on_sleep(*t);
    pause
}

#[test]
fn a_streaming_peer_is_paused_for_after_a_streak_of_short_gaps() {
    let mut t = Instant::now();
    let mut c = Coalesce::new(PAUSE, t);
    for _ in 0..STREAK {
        assert_eq!(wake(&mut c, &mut t, SHORT, UPSTREAM), None);
    }
    assert_eq!(wake(&mut c, &mut t, SHORT, UPSTREAM), Some(PAUSE));
}

#[test]
fn a_frame_after_a_quiet_spell_is_never_held() {
    let mut t = Instant::now();
    let mut c = Coalesce::new(PAUSE, t);
    for _ in 0..10 * STREAK {
        wake(&mut c, &mut t, SHORT, UPSTREAM);
    }
    // However long the streak, a wake-up after a gap of `pause` goes at once.
    assert_eq!(wake(&mut c, &mut t, PAUSE, UPSTREAM), None);
    // And the streak starts again.
    for _ in 0..STREAK {
        assert_eq!(wake(&mut c, &mut t, SHORT, UPSTREAM), None);
    }
}

#[test]
fn request_and_reply_is_never_held() {
    // A publisher waiting for each confirm: the client sends, nackd writes
    // upstream, the broker answers, nackd writes to the client, and so on,
    // each wake-up soon after the last.
    let mut t = Instant::now();
    let mut c = Coalesce::new(PAUSE, t);
    c.wrote(CLIENT);
    for i in 0..100 {
        let side = [CLIENT, UPSTREAM][i % 2];
        assert_eq!(wake(&mut c, &mut t, SHORT, side), None, "wake-up {i}");
    }
}

#[test]
fn one_pause_serves_every_session_of_the_thread() {
    let mut t = Instant::now();
    let mut a = Coalesce::new(PAUSE, t);
    let mut b = Coalesce::new(PAUSE, t);
    for _ in 0..STREAK {
        wake(&mut a, &mut t, SHORT, UPSTREAM);
        wake(&mut b, &mut t, SHORT, UPSTREAM);
    }
    assert_eq!(a.on_wake(t + SHORT), Some(PAUSE));
    // b wakes during a's pause or right after it: the pause was its too.
    assert_eq!(b.on_wake(t + SHORT), None);
    assert_eq!(b.on_wake(t + SHORT + PAUSE + SHORT), None);
}

#[test]
fn zero_turns_it_off() {
    let mut t = Instant::now();
    let mut c = Coalesce::new(Duration::ZERO, t);
    for _ in 0..10 * STREAK {
        assert_eq!(wake(&mut c, &mut t, Duration::ZERO, UPSTREAM), None);
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// Session `s` wakes after `gap_us`, sends from `side`, nackd writes
    /// to the sides in `writes` (bit 0 client, bit 1 upstream), then it
    /// sleeps after `work_us`.
    Wake {
        s: usize,
        gap_us: u64,
        side: Option<usize>,
        writes: u8,
        work_us: u64,
    },
}

fn step() -> impl Strategy<Value = Step> {
    (
        0..2usize,
        // Mostly streaming, now and then a quiet spell or a gap near the pause.
        prop_oneof![8 => 0..20u64, 1 => 80..130u64, 1 => 0..400u64],
        prop::option::weighted(0.9, 0..2usize),
        // Mostly nothing written back (streaming), sometimes an answer.
        prop_oneof![6 => Just(0u8), 1 => 0..4u8],
        0..15u64,
    )
        .prop_map(|(s, gap_us, side, writes, work_us)| Step::Wake {
            s,
            gap_us,
            side,
            writes,
            work_us,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    /// Against random wake-up patterns of two sessions on one thread, a
    /// pause exactly when the model says: a short gap now, after `STREAK`
    /// short, unprompted wake-ups of that session, and the thread's last
    /// pause over for at least a pause; and never longer than configured.
    #[test]
    fn pauses_keep_their_promises(steps in prop::collection::vec(step(), 1..200)) {
        // Each case on a thread of its own: the thread's pause is its own.
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut t = start;
            let mut sessions = [Coalesce::new(PAUSE, t), Coalesce::new(PAUSE, t)];
            // The model: per session, its history of wake-ups.
            let mut asleep = [t, t];
            let mut prompted = [[false; 2]; 2];
            let mut streak = [0u32; 2];
            let mut last_pause_end: Option<Instant> = None;
            for Step::Wake { s, gap_us, side, writes, work_us } in steps {
                t += Duration::from_micros(gap_us);
                let short = t.saturating_duration_since(asleep[s]) < PAUSE;
                let pause = sessions[s].on_wake(t);
                if let Some(p) = pause {
                    assert_eq!(p, PAUSE);
                    assert!(short, "paused after a quiet spell");
                    assert!(streak[s] >= STREAK, "paused before a streak");
                    if let Some(end) = last_pause_end {
                        assert!(t >= end + PAUSE, "two pauses of the thread too close");
                    }
                    t += p;
                    last_pause_end = Some(t);
                } else {
                    let thread_free = last_pause_end.is_none_or(|end| t >= end + PAUSE);
                    assert!(!(short && streak[s] >= STREAK && thread_free), "no pause where one was due");
                }
                let mut unprompted = false;
                if let Some(side) = side {
                    sessions[s].read(side);
                    unprompted = !std::mem::take(&mut prompted[s][side]);
                }
                for w in [0, 1] {
                    if writes & (1 << w) != 0 {
                        sessions[s].wrote(w);
                        prompted[s][w] = true;
                    }
                }
                t += Duration::from_micros(work_us);
                sessions[s].on_sleep(t);
                streak[s] = if short && unprompted { streak[s] + 1 } else { 0 };
                asleep[s] = t;
            }
        })
        .join()
        .map_err(|_| TestCaseError::fail("a promise was broken"))?;
    }
}

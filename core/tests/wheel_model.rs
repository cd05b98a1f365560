//! The timing wheel against a naive model, with random inserts and polls:
//! the same entries fire, none early, none missed, none twice, and a poll
//! always returns. Property tests: they take seconds, so they run here
//! rather than among the crate's unit tests.

// Tests time what nackd does with the real clock (clippy.toml asks the
// product to read it only through nackd_core::clock).
#![allow(clippy::disallowed_methods)]

use nackd_core::wheel::{Ticks, Wheel};

fn drain(w: &mut Wheel<u64>, now: Ticks) -> Vec<u64> {
    let mut out = Vec::new();
    w.poll(now, &mut out);
    out.into_iter().map(|(_, id)| id).collect()
}

/// A wheel given back by [`poll_or_hang`], with what fired.
type Polled = (Wheel<u64>, Vec<(Ticks, u64)>);

/// Polls `w` to `now` on a thread of its own: `None` if it has not
/// returned after a few seconds (it loops).
fn poll_or_hang(mut w: Wheel<u64>, now: Ticks) -> Option<Polled> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut out = Vec::new();
        w.poll(now, &mut out);
        let _ = tx.send((w, out));
    });
    rx.recv_timeout(std::time::Duration::from_secs(5)).ok()
}

proptest::proptest! {
    /// Against a sorted list: same entries, none early, none missed.
    #[test]
    fn matches_a_naive_model(
        start in 0u64..1u64 << 40,
        delays in proptest::collection::vec(0u64..200_000_000, 1..200),
        steps in proptest::collection::vec(1u64..50_000_000, 1..60),
    ) {
        let mut w = Wheel::new(start);
        for (id, d) in delays.iter().enumerate() {
            w.insert(start + d, id as u64);
        }
        let mut now = start;
        let mut fired = vec![false; delays.len()];
        for step in steps.iter().chain(std::iter::once(&300_000_000)) {
            now += step;
            for id in drain(&mut w, now) {
                let due = start + delays[id as usize];
                proptest::prop_assert!(due <= now, "early");
                proptest::prop_assert!(!fired[id as usize], "twice");
                fired[id as usize] = true;
            }
            for (id, d) in delays.iter().enumerate() {
                if start + d <= now {
                    proptest::prop_assert!(fired[id], "missed {} at {}", start + d, now);
                }
            }
        }
        proptest::prop_assert!(w.is_empty());
    }
}

proptest::proptest! {
    /// Inserts between polls, at any time from the past to beyond the
    /// span: same entries as a naive model, none early, none missed.
    #[test]
    fn interleaved_inserts_and_polls_match_a_naive_model(
        start in 0u64..1u64 << 52,
        ops in proptest::collection::vec(
            (0u64..4, 0u64..1u64 << 40, proptest::bool::ANY), 1..300),
    ) {
        let mut w = Wheel::new(start);
        let mut model: Vec<(Ticks, u64)> = Vec::new();
        let mut now = start;
        for (id, (scale, x, poll)) in ops.into_iter().enumerate() {
            let id = id as u64;
            let delta = x >> (scale * 12);
            match poll {
                true => {
                    now += delta;
                    let (back, fired) = poll_or_hang(w, now).expect("poll returned");
                    w = back;
                    let mut want: Vec<u64> = Vec::new();
                    model.retain(|(due, id)| match *due <= now {
                        true => { want.push(*id); false }
                        false => true,
                    });
                    let mut got: Vec<u64> = fired.iter().map(|(_, id)| *id).collect();
                    for (due, _) in &fired {
                        proptest::prop_assert!(*due <= now, "early");
                    }
                    got.sort_unstable();
                    want.sort_unstable();
                    proptest::prop_assert_eq!(got, want);
                }
                false => {
                    // Half in the past, half ahead.
                    let due = match id % 2 {
                        0 => now.saturating_sub(delta),
                        _ => now.saturating_add(delta),
                    };
                    let given = w.insert(due, id);
                    proptest::prop_assert_eq!(given, due.max(w.now()));
                    model.push((given, id));
                }
            }
            proptest::prop_assert_eq!(w.len(), model.len());
        }
    }
}

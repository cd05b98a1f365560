use super::*;

fn drain(w: &mut Wheel<u64>, now: Ticks) -> Vec<u64> {
    let mut out = Vec::new();
    w.poll(now, &mut out);
    out.into_iter().map(|(_, id)| id).collect()
}

#[test]
fn poll_hands_back_the_due_time_insert_gave() {
    let mut w = Wheel::new(1_000);
    assert_eq!(w.insert(5_000, 1), 5_000);
    assert_eq!(
        w.insert(10, 2),
        1_000,
        "a past due time is the wheel's clock"
    );
    let mut out = Vec::new();
    w.poll(5_000, &mut out);
    assert_eq!(out, vec![(1_000, 2), (5_000, 1)]);
}

#[test]
fn a_crowded_slot_cascades_chunk_by_chunk_in_insert_order() {
    let mut w = Wheel::new(0);
    // Tens of thousands in one level-2 slot, two due times interleaved.
    let n = 20 * CHUNK as u64 + 7;
    for id in 0..n {
        w.insert(10_000 + id % 2, id);
    }
    let (even, odd): (Vec<u64>, Vec<u64>) = (0..n).partition(|id| id % 2 == 0);
    assert!(drain(&mut w, 9_999).is_empty());
    assert_eq!(drain(&mut w, 10_000), even);
    assert_eq!(w.len(), odd.len());
    assert_eq!(drain(&mut w, 10_001), odd);
    assert!(w.is_empty());
}

#[test]
fn fires_exactly_at_due_never_before() {
    let mut w = Wheel::new(1_000);
    w.insert(1_050, 1);
    assert_eq!(w.next_deadline().map(|d| d <= 1_050), Some(true));
    assert!(drain(&mut w, 1_049).is_empty());
    assert_eq!(drain(&mut w, 1_050), vec![1]);
    assert!(w.is_empty());
    assert_eq!(w.next_deadline(), None);
}

#[test]
fn same_tick_entries_fire_together_in_insert_order() {
    let mut w = Wheel::new(0);
    for id in 0..100 {
        w.insert(500, id);
    }
    w.insert(501, 1000);
    assert_eq!(drain(&mut w, 500), (0..100).collect::<Vec<_>>());
    assert_eq!(drain(&mut w, 501), vec![1000]);
}

#[test]
fn order_follows_due_time_across_levels() {
    let mut w = Wheel::new(0);
    let dues = [
        5_000_000u64,
        3,
        70,
        4_100,
        262_144,
        64,
        63,
        1,
        300_000,
        4_096,
    ];
    for (i, due) in dues.iter().enumerate() {
        w.insert(*due, i as u64);
    }
    let mut fired = Vec::new();
    let mut now = 0;
    while let Some(deadline) = w.next_deadline() {
        now = deadline.max(now);
        for id in drain(&mut w, now) {
            assert!(now >= dues[id as usize], "fired early");
            fired.push((now, id));
        }
    }
    let mut by_due: Vec<(u64, u64)> = dues
        .iter()
        .enumerate()
        .map(|(i, d)| (*d, i as u64))
        .collect();
    by_due.sort();
    assert_eq!(fired, by_due, "each fired at its due time, in due order");
}

#[test]
fn cascades_from_the_top_level_down() {
    let mut w = Wheel::new(0);
    let far = 64u64.pow(5) + 64u64.pow(3) * 7 + 64 * 3 + 5;
    w.insert(far, 9);
    assert_eq!(level_for(0, far), 5);
    let mut steps = 0;
    while let Some(deadline) = w.next_deadline() {
        steps += 1;
        if !drain(&mut w, deadline).is_empty() {
            assert_eq!(deadline, far);
            break;
        }
    }
    assert!(steps >= 4, "moved down level by level ({steps} steps)");
    assert!(w.is_empty());
}

#[test]
fn very_long_delays() {
    let day = 24 * 3600 * 1000u64;
    let start = 1_700_000_000_000; // a wall-clock-like origin
    let mut w = Wheel::new(start);
    w.insert(start + 30 * day, 30);
    w.insert(start + 365 * day, 365);
    w.insert(start + 1, 0);
    assert_eq!(drain(&mut w, start + 1), vec![0]);
    assert!(drain(&mut w, start + 30 * day - 1).is_empty());
    assert_eq!(drain(&mut w, start + 30 * day), vec![30]);
    assert!(drain(&mut w, start + 365 * day - 1).is_empty());
    assert_eq!(drain(&mut w, start + 365 * day), vec![365]);
}

#[test]
fn a_late_poll_fires_everything_overdue_at_once() {
    let mut w = Wheel::new(0);
    for id in 0..1000u64 {
        w.insert(id * 997 % 100_000, id);
    }
    let fired = drain(&mut w, 1_000_000);
    assert_eq!(fired.len(), 1000);
    assert!(w.is_empty());
}

#[test]
fn past_due_inserts_fire_on_the_next_poll() {
    let mut w = Wheel::new(10_000);
    w.insert(5, 1);
    assert_eq!(drain(&mut w, 10_000), vec![1]);
}

#[test]
fn retain_removes_entries() {
    let mut w = Wheel::new(0);
    for id in 0..10u64 {
        w.insert(100 + id * 1000, id);
    }
    w.retain(|id| id % 2 == 0);
    assert_eq!(w.len(), 5);
    assert_eq!(drain(&mut w, 1_000_000), vec![0, 2, 4, 6, 8]);
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

/// An entry further ahead than the top level reaches (64^9 µs, about 570
/// years: a damaged or hand-made due time) must wait, not come back into
/// the top-level slot being polled: that slot then never empties and
/// `poll` loops for ever, taking the engine with it.
#[test]
fn an_entry_beyond_the_wheel_span_waits_instead_of_looping() {
    let span = level_width(LEVELS - 1);
    let now: Ticks = 1_764_000_000_000_000; // a wall-clock-like origin, in µs
    for due in [now + span, now + 3 * span + 12_345, u64::MAX] {
        let mut w = Wheel::new(now);
        w.insert(due, 7);
        let deadline = w.next_deadline().unwrap();
        assert!(deadline > now, "due {due}: a deadline of now ({deadline})");
        let (w, fired) = poll_or_hang(w, now + 1).expect("poll returned");
        assert!(fired.is_empty());
        assert_eq!(w.len(), 1);
    }
    // The wheel's own top slot reached (u64::MAX sits in slot 63).
    let now = 63 << (BITS as usize * (LEVELS - 1));
    let mut w = Wheel::new(now);
    w.insert(u64::MAX, 1);
    let (w, fired) = poll_or_hang(w, now + 1).expect("poll returned");
    assert!(fired.is_empty() && w.len() == 1);
}

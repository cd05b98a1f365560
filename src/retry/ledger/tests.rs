use super::*;

fn entry(due: u64, queue: u32, size: u32, retry: u16, dead_letter: bool) -> Entry {
    let meta = HeldMeta {
        queue,
        size,
        retry,
        dead_letter,
        delayed: false,
    };
    Entry::new(loc(), due, meta)
}

fn loc() -> Loc {
    Loc {
        segment: 1,
        offset: 0,
        len: 10,
    }
}

#[test]
fn per_queue_series_follow_the_held_messages_and_leave_at_zero() {
    let metrics = Metrics::new();
    let mut ledger = Ledger::new(metrics.clone());
    let (vhost, a, b) = (Arc::from("/"), Arc::from("a"), Arc::from("b"));
    let (qa, qb) = (ledger.intern(&vhost, &a), ledger.intern(&vhost, &b));
    assert_eq!(ledger.intern(&vhost, &a), qa, "interned once");
    ledger.insert(1, entry(10, qa, 100, 1, false));
    ledger.insert(2, entry(20, qa, 50, 1, false));
    ledger.insert(3, entry(30, qb, 7, 2, false));
    let labels = |q: &str| QueueLabels {
        vhost: "/".into(),
        queue: q.into(),
    };
    assert_eq!(metrics.held.get_or_create(&labels("a")).get(), 2);
    assert_eq!(metrics.held_bytes.get_or_create(&labels("a")).get(), 150);
    ledger.insert(2, entry(25, qa, 50, 1, true)); // a re-route replaces
    assert_eq!(metrics.held.get_or_create(&labels("a")).get(), 2);
    ledger.remove(3);
    assert!(
        metrics.held.get(&labels("b")).is_none(),
        "an empty queue drops its series"
    );
    assert!(!metrics.encode().contains("queue=\"b\""));
    ledger.insert(4, entry(40, qb, 9, 1, false));
    assert_eq!(
        metrics.held_bytes.get_or_create(&labels("b")).get(),
        9,
        "and gets it back"
    );
    let totals: Vec<_> = ledger
        .totals()
        .map(|(_, _, q, n, bytes)| (q.to_string(), n, bytes))
        .collect();
    assert_eq!(
        totals,
        vec![("a".to_string(), 2, 150), ("b".to_string(), 1, 9)]
    );
    assert_eq!(ledger.find("/", "b"), Some(qb));
    assert_eq!(ledger.len(), 3);
}

/// What the status page reads (due chart, set-aside counts) equals a
/// walk over every entry, whatever the sequence of inserts, removals,
/// set-asides and clock moves.
mod aggregates {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Insert { id: u64, due_s: u64, queue: u32 },
        Remove { id: u64 },
        Block { id: u64, reason: u8 },
        Tick { to_s: u64 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..40, 0u64..20_000, 0u32..3)
                .prop_map(|(id, due_s, queue)| Op::Insert { id, due_s, queue }),
            2 => (0u64..40).prop_map(|id| Op::Remove { id }),
            2 => (0u64..40, 0u8..4).prop_map(|(id, reason)| Op::Block { id, reason }),
            1 => (0u64..20_000).prop_map(|to_s| Op::Tick { to_s }),
        ]
    }

    const EDGES: [u64; 6] = [0, 10, 60, 600, 3600, 86400];

    /// The chart by walking every entry, with the ledger's precision.
    fn walk_chart(ledger: &Ledger, now_ms: u64) -> Vec<u64> {
        let mut counts = vec![0u64; EDGES.len() + 1];
        let now_s = now_ms / 1000;
        for (_, e) in ledger.iter() {
            let in_s = match e.coarse {
                false => (e.due_ms / 1000).saturating_sub(now_s),
                true if e.due_ms / 60_000 <= now_ms / 60_000 => 0,
                true => ((e.due_ms / 60_000) * 60).saturating_sub(now_s).max(1),
            };
            counts[EDGES.partition_point(|edge| *edge < in_s)] += 1;
        }
        counts
    }

    proptest! {
        #[test]
        fn aggregates_match_a_walk(ops in proptest::collection::vec(op(), 1..200), now_s in 0u64..20_000) {
            let metrics = Metrics::new();
            let mut ledger = Ledger::new(metrics.clone());
            let vhost: Arc<str> = Arc::from("/");
            let queues: Vec<u32> = (0..3)
                .map(|i| ledger.intern(&vhost, &Arc::from(format!("q{i}"))))
                .collect();
            let reasons: Vec<u16> = (0..4)
                .map(|i| ledger.intern_reason(Reason {
                    kind: BlockReason::ALL[i],
                    reply: format!("reply {i}"),
                    exchange: None,
                }))
                .collect();
            for op in ops {
                match op {
                    Op::Insert { id, due_s, queue } => {
                        let meta = HeldMeta { queue: queues[queue as usize], size: 10, retry: 1, dead_letter: false, delayed: false };
                        ledger.insert(id, Entry::new(loc(), due_s * 1000 + 7, meta));
                    }
                    Op::Remove { id } => { ledger.remove(id); }
                    Op::Block { id, reason } => ledger.set_blocked(id, reasons[reason as usize]),
                    Op::Tick { to_s } => ledger.tick(to_s * 1000),
                }
            }
            // Any time (a clock behind the last tick takes the slow path),
            // and the engine's case: at or after the last tick.
            let now_ms = now_s * 1000 + 500;
            prop_assert_eq!(ledger.due_chart(now_ms, &EDGES), walk_chart(&ledger, now_ms));
            let later = ledger.now_ms.max(now_ms) + 1500;
            prop_assert_eq!(ledger.due_chart(later, &EDGES), walk_chart(&ledger, later));
            for (i, q) in queues.iter().enumerate() {
                let walked = ledger.iter().filter(|(_, e)| e.meta.queue == *q && e.blocked != 0).count() as u64;
                prop_assert_eq!(ledger.blocked_count(*q), walked, "queue {}", i);
            }
            for (r, count) in ledger.blocked_reasons() {
                let id = reasons[BlockReason::ALL.iter().position(|k| *k == r.kind).unwrap()];
                let walked = ledger.iter().filter(|(_, e)| e.blocked == id).count() as u64;
                prop_assert_eq!(count, walked);
                prop_assert_eq!(metrics.blocked_now(r.kind).get() as u64, walked);
            }
        }
    }
}

#[test]
fn delayed_messages_are_counted_per_exchange_until_rerouted() {
    let metrics = Metrics::new();
    let mut ledger = Ledger::new(metrics.clone());
    let (vhost, exchange) = (Arc::from("/"), Arc::from("later"));
    let x = ledger.intern(&vhost, &exchange);
    let delayed = |due| {
        let mut e = entry(due, x, 10, 0, true);
        e.meta.delayed = true;
        e
    };
    let gauge = |m: &Metrics| {
        let text = m.encode();
        text.lines()
            .find(|l| l.starts_with("nackd_delayed_held_messages{"))
            .map(|l| l.rsplit(' ').next().unwrap().to_string())
    };
    ledger.insert(1, delayed(1000));
    ledger.insert(2, delayed(2000));
    ledger.insert(3, entry(3000, x, 10, 1, true)); // a dead letter, not delayed
    assert_eq!(gauge(&metrics).as_deref(), Some("2"));
    assert!(metrics
        .encode()
        .contains("nackd_delayed_held_messages{vhost=\"/\",exchange=\"later\"} 2"));
    ledger.remove(1);
    assert_eq!(gauge(&metrics).as_deref(), Some("1"));
    ledger.rerouted(2);
    assert!(!ledger.get(2).unwrap().meta.delayed);
    assert_eq!(gauge(&metrics), None, "the series goes with the last one");
    assert_eq!(ledger.count(x), 2, "still held");
    ledger.remove(2);
    ledger.remove(3);
    assert_eq!(gauge(&metrics), None);
}

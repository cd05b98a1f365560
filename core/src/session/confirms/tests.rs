//! [`Renumber`] against a model of both ends: whatever the order of the
//! broker's confirms (single or `multiple`) and nackd's answers, the
//! publisher gets exactly one confirm per publish, of the right kind.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::{Confirm, Renumber};

/// What the publisher's client library makes of the confirms it gets.
#[derive(Default)]
struct Publisher {
    unconfirmed: BTreeSet<u64>,
    /// The kind each publish must be confirmed with, once it is decided.
    decided: BTreeMap<u64, bool>,
    got: BTreeMap<u64, bool>,
}

impl Publisher {
    fn get(&mut self, c: Confirm) {
        let tags: Vec<u64> = if c.multiple {
            self.unconfirmed.range(..=c.tag).copied().collect()
        } else {
            assert!(
                self.unconfirmed.contains(&c.tag),
                "confirm of {} which is not unconfirmed",
                c.tag
            );
            vec![c.tag]
        };
        for t in tags {
            let want = self.decided.get(&t).copied();
            assert_eq!(
                want,
                Some(c.ack),
                "publish {t} confirmed before or unlike its fate"
            );
            self.unconfirmed.remove(&t);
            self.got.insert(t, c.ack);
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// A publish, taken by nackd or forwarded.
    Publish(bool),
    /// The broker confirms the `n`-th (modulo) of its unconfirmed tags.
    Broker {
        pick: usize,
        ack: bool,
        multiple: bool,
    },
    /// nackd answers the `n`-th of the publishes it took.
    Answer { pick: usize, ack: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => any::<bool>().prop_map(Op::Publish),
        2 => (any::<usize>(), prop::bool::weighted(0.9), any::<bool>())
            .prop_map(|(pick, ack, multiple)| Op::Broker { pick, ack, multiple }),
        1 => (any::<usize>(), prop::bool::weighted(0.8))
            .prop_map(|(pick, ack)| Op::Answer { pick, ack }),
    ]
}

/// Runs `before` publishes numbered alike (some confirmed before nackd
/// took anything), then `ops`, then settles everything.
fn run(before: u64, confirmed_before: u64, ops: Vec<Op>) {
    let mut p = Publisher::default();
    // The broker's unconfirmed tags → the publisher's tag.
    let mut broker: BTreeMap<u64, u64> = BTreeMap::new();
    let mut broker_next = 1;
    for t in 1..=before {
        p.unconfirmed.insert(t);
        broker.insert(t, t);
        broker_next += 1;
    }
    for t in 1..=confirmed_before.min(before) {
        broker.remove(&t);
        p.decided.insert(t, true);
        p.get(Confirm {
            ack: true,
            tag: t,
            multiple: false,
        });
    }
    let mut r = Renumber::new(before + 1);
    let mut taken: Vec<u64> = Vec::new();
    let mut next = before + 1;
    let broker_confirm = |r: &mut Renumber,
                          p: &mut Publisher,
                          broker: &mut BTreeMap<u64, u64>,
                          pick: usize,
                          ack: bool,
                          multiple: bool| {
        if broker.is_empty() {
            return;
        }
        let tag = *broker.keys().nth(pick % broker.len()).unwrap();
        let covered: Vec<u64> = if multiple {
            broker.range(..=tag).map(|(b, _)| *b).collect()
        } else {
            vec![tag]
        };
        for b in covered {
            let t = broker.remove(&b).unwrap();
            p.decided.insert(t, ack);
        }
        for c in r.broker(ack, tag, multiple) {
            p.get(c);
        }
    };
    for op in ops {
        match op {
            Op::Publish(true) => {
                let t = r.take();
                assert_eq!(t, next);
                p.unconfirmed.insert(t);
                taken.push(t);
                next += 1;
            }
            Op::Publish(false) => {
                r.forward();
                p.unconfirmed.insert(next);
                broker.insert(broker_next, next);
                broker_next += 1;
                next += 1;
            }
            Op::Broker {
                pick,
                ack,
                multiple,
            } => broker_confirm(&mut r, &mut p, &mut broker, pick, ack, multiple),
            Op::Answer { pick, ack } => {
                if taken.is_empty() {
                    continue;
                }
                let t = taken.remove(pick % taken.len());
                p.decided.insert(t, ack);
                p.get(r.answer(t, ack).expect("taken"));
            }
        }
    }
    for t in std::mem::take(&mut taken) {
        p.decided.insert(t, true);
        p.get(r.answer(t, true).expect("taken"));
    }
    while !broker.is_empty() {
        broker_confirm(&mut r, &mut p, &mut broker, 0, true, true);
    }
    assert!(
        p.unconfirmed.is_empty(),
        "never confirmed: {:?}",
        p.unconfirmed
    );
    assert_eq!(p.got.len() as u64, next - 1);
    assert_eq!(r.unanswered(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn every_publish_is_confirmed_once_and_as_decided(
        before in 0u64..6,
        confirmed_before in 0u64..6,
        ops in prop::collection::vec(op(), 0..60),
    ) {
        run(before, confirmed_before, ops);
    }
}

#[test]
fn a_multiple_ack_over_a_pending_take_is_split() {
    let mut r = Renumber::new(1);
    r.forward(); // 1 → broker 1
    let taken = r.take(); // 2
    r.forward(); // 3 → broker 2
    let out = r.broker(true, 2, true);
    let tags: Vec<(u64, bool)> = out.iter().map(|c| (c.tag, c.multiple)).collect();
    assert_eq!(tags, vec![(1, false), (3, false)]);
    assert_eq!(
        r.answer(taken, true),
        Some(Confirm {
            ack: true,
            tag: 2,
            multiple: false
        })
    );
}

#[test]
fn a_multiple_ack_with_nothing_pending_below_stays_one_frame() {
    let mut r = Renumber::new(4); // 1..=3 went before, unconfirmed
    let taken = r.take(); // 4
    r.answer(taken, true);
    r.forward(); // 5 → broker 4
    r.forward(); // 6 → broker 5
    let out = r.broker(true, 5, true);
    assert_eq!(
        out,
        vec![Confirm {
            ack: true,
            tag: 6,
            multiple: true
        }]
    );
}

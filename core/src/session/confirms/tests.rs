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

/// Both ends around one [`Renumber`]: the publisher, the broker's
/// unconfirmed tags, and the publishes nackd took.
struct Model {
    p: Publisher,
    r: Renumber,
    /// The broker's unconfirmed tags → the publisher's tag.
    broker: BTreeMap<u64, u64>,
    broker_next: u64,
    taken: Vec<u64>,
    /// The publisher's number of its next publish.
    next: u64,
}

impl Model {
    /// `before` publishes numbered alike, the first `confirmed_before` of
    /// them confirmed before nackd took anything.
    fn new(before: u64, confirmed_before: u64) -> Self {
        let mut p = Publisher::default();
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
        Self {
            p,
            r: Renumber::new(before + 1),
            broker,
            broker_next,
            taken: Vec::new(),
            next: before + 1,
        }
    }

    fn broker_confirm(&mut self, pick: usize, ack: bool, multiple: bool) {
        if self.broker.is_empty() {
            return;
        }
        let tag = *self.broker.keys().nth(pick % self.broker.len()).unwrap();
        let covered: Vec<u64> = if multiple {
            self.broker.range(..=tag).map(|(b, _)| *b).collect()
        } else {
            vec![tag]
        };
        for b in covered {
            let t = self.broker.remove(&b).unwrap();
            self.p.decided.insert(t, ack);
        }
        for c in self.r.broker(ack, tag, multiple) {
            self.p.get(c);
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Publish(true) => {
                let t = self.r.take();
                assert_eq!(t, self.next);
                self.p.unconfirmed.insert(t);
                self.taken.push(t);
                self.next += 1;
            }
            Op::Publish(false) => {
                self.r.forward();
                self.p.unconfirmed.insert(self.next);
                self.broker.insert(self.broker_next, self.next);
                self.broker_next += 1;
                self.next += 1;
            }
            Op::Broker {
                pick,
                ack,
                multiple,
            } => self.broker_confirm(pick, ack, multiple),
            Op::Answer { pick, ack } => {
                if self.taken.is_empty() {
                    return;
                }
                let t = self.taken.remove(pick % self.taken.len());
                self.p.decided.insert(t, ack);
                self.p.get(self.r.answer(t, ack).expect("taken"));
            }
        }
    }

    /// Settles everything still open.
    fn settle_all(&mut self) {
        for t in std::mem::take(&mut self.taken) {
            self.p.decided.insert(t, true);
            self.p.get(self.r.answer(t, true).expect("taken"));
        }
        while !self.broker.is_empty() {
            self.broker_confirm(0, true, true);
        }
    }
}

/// Runs `before` publishes numbered alike (some confirmed before nackd
/// took anything), then `ops`, then settles everything.
fn run(before: u64, confirmed_before: u64, ops: Vec<Op>) {
    let mut m = Model::new(before, confirmed_before);
    for op in ops {
        m.apply(op);
    }
    m.settle_all();
    assert!(
        m.p.unconfirmed.is_empty(),
        "never confirmed: {:?}",
        m.p.unconfirmed
    );
    assert_eq!(m.p.got.len() as u64, m.next - 1);
    assert_eq!(m.r.unanswered(), 0);
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

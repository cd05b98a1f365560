//! Publisher confirms of a channel whose publishes go two ways: most to
//! the broker, delayed ones to nackd's store. The publisher numbers all of
//! them (its own sequence, from 1 at `confirm.select`); the broker numbers
//! only those it gets. [`Renumber`] maps the broker's confirms onto the
//! publisher's numbers and merges nackd's own, so that the publisher gets
//! exactly one `basic.ack` or `basic.nack` per publish, and a `multiple`
//! one only where it covers nothing still unanswered.
//!
//! A channel gets one at its first delayed publish: until then both
//! sequences are the same, and confirms pass as they are.

use std::collections::{BTreeSet, VecDeque};

/// One confirm to the publisher, in its numbering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Confirm {
    /// `basic.ack` (else `basic.nack`).
    pub ack: bool,
    /// The publisher's delivery tag.
    pub tag: u64,
    /// Covers every tag up to `tag` not confirmed yet.
    pub multiple: bool,
}

/// The two numberings of one channel (see the module).
#[derive(Debug)]
pub struct Renumber {
    /// The publisher's number of its next publish.
    next: u64,
    /// Publishes numbered below this are numbered alike by both.
    alike: u64,
    /// The broker's number of `forwarded[0]`.
    base: u64,
    /// The publisher's number of each publish forwarded from `base` on,
    /// 0 once the broker confirmed it.
    forwarded: VecDeque<u64>,
    /// Publishes nackd took and has not answered yet (publisher numbers).
    taken: BTreeSet<u64>,
    /// Publishes below `alike` may still be unconfirmed: a `multiple`
    /// confirm of the broker beyond them covers them too.
    before_open: bool,
}

impl Renumber {
    /// A channel whose next publish is number `next` on both sides.
    pub fn new(next: u64) -> Self {
        Self {
            next,
            alike: next,
            base: next,
            forwarded: VecDeque::new(),
            taken: BTreeSet::new(),
            before_open: next > 1,
        }
    }

    /// The next publish goes to the broker.
    pub fn forward(&mut self) {
        self.forwarded.push_back(self.next);
        self.next += 1;
    }

    /// The broker gets a publish the publisher did not number (one nackd
    /// took before `confirm.select` and routes now): its confirm is
    /// nobody's.
    pub fn extra(&mut self) {
        self.forwarded.push_back(0);
    }

    /// A publish nackd took goes to the broker after all (the broker would
    /// refuse it: it does so itself): the broker's confirm of its next
    /// publish is the publisher's for `tag`.
    pub fn hand_over(&mut self, tag: u64) {
        if self.taken.remove(&tag) {
            self.forwarded.push_back(tag);
        }
    }

    /// nackd takes the next publish: its number, for [`Renumber::answer`].
    pub fn take(&mut self) -> u64 {
        let tag = self.next;
        self.taken.insert(tag);
        self.next += 1;
        tag
    }

    /// nackd's answer to publish `tag` it took (stored, or not).
    pub fn answer(&mut self, tag: u64, ack: bool) -> Option<Confirm> {
        self.taken.remove(&tag).then_some(Confirm {
            ack,
            tag,
            multiple: false,
        })
    }

    /// Publishes nackd took and has not answered.
    pub fn unanswered(&self) -> usize {
        self.taken.len()
    }

    /// The broker's confirm (`ack` or nack) of its `tag`, maybe `multiple`,
    /// as the confirms the publisher gets.
    pub fn broker(&mut self, ack: bool, tag: u64, multiple: bool) -> Vec<Confirm> {
        if tag < self.alike {
            // Numbered alike, and no publish below `alike` was taken.
            if multiple && tag + 1 >= self.alike {
                self.before_open = false;
            }
            return vec![Confirm { ack, tag, multiple }];
        }
        let mut covered = Vec::new();
        if tag >= self.base {
            let at = (tag - self.base) as usize;
            if at >= self.forwarded.len() {
                // Not a tag the broker was given: passed on as it is, for
                // the publisher to judge.
                return vec![Confirm { ack, tag, multiple }];
            }
            if multiple {
                for slot in self.forwarded.range_mut(..=at) {
                    if *slot != 0 {
                        covered.push(std::mem::take(slot));
                    }
                }
            } else if self.forwarded[at] != 0 {
                covered.push(std::mem::take(&mut self.forwarded[at]));
            }
            while self.forwarded.front() == Some(&0) {
                self.forwarded.pop_front();
                self.base += 1;
            }
        }
        // A publish handed over goes to the broker after later ones: the
        // highest covered is not always the last.
        if let Some(&top) = covered.iter().max() {
            let older_open = self.forwarded.iter().any(|t| *t != 0 && *t < top);
            if multiple && !older_open && self.taken.range(..top).next().is_none() {
                // Nothing below `top` waits for nackd: one frame says it all.
                self.before_open = false;
                return vec![Confirm {
                    ack,
                    tag: top,
                    multiple: true,
                }];
            }
        }
        let mut out = Vec::with_capacity(covered.len() + 1);
        if multiple && self.before_open {
            // The publishes numbered alike, which this confirm covers too.
            self.before_open = false;
            out.push(Confirm {
                ack,
                tag: self.alike - 1,
                multiple: true,
            });
        }
        out.extend(covered.into_iter().map(|tag| Confirm {
            ack,
            tag,
            multiple: false,
        }));
        out
    }
}

#[cfg(test)]
mod tests;

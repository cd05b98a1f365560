//! One sync attempt as named states, without I/O: directory → (stream
//! check → kept or rebuilt | a new generation, reseeded, seeded or
//! wiped) → a new lease epoch → the store reopened. [`Sync::on`] takes
//! what the last step found and names the next; the driver
//! (`Task::try_sync` in `super`) does the I/O each [`Phase`] names.
//!
//! ```text
//! Reading ─┬─ reseed asked, not adopted ─→ Reseeding ────────────┐
//!          ├─ a generation, not adopted ─→ Checking ─ current ─→ Sealing → Reopening → Synced
//!          │                                  ├─ stale → Rebuilding ─┘
//!          │                                  └─ gone → Failed (Missing)
//!          └─ none, or adopted elsewhere ─→ Starting (wiped if adopted) ─→ Sealing
//! any phase: broker → Failed (Broker, retried); store → Failed (Store, given up)
//! ```

use crate::replica::client::ClientError;
use crate::replica::local::Synced;
use crate::replica::task::{same_holder, Directory};
use crate::replica::Config;

/// Where a sync attempt stands: each names the I/O to do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Phase {
    /// Reading this instance's directory and the local store's marks.
    Reading,
    /// Generation `g` is the one to keep: does its stream exist?
    /// `current`: the local store is the last holder's of it.
    Checking { g: u64, current: bool },
    /// An operator asked: a new generation `next` seeded from the
    /// local store.
    Reseeding { next: u64 },
    /// A new generation `next`: seeded from the local store, or empty
    /// when `wipe` (the held messages were adopted elsewhere).
    Starting { next: u64, wipe: bool },
    /// The local store is not the last holder's: rebuilt from `g`.
    Rebuilding { g: u64 },
    /// The store agrees with `generation`: a new lease epoch after `last`.
    Sealing {
        last: u64,
        generation: u64,
        rebuilt: bool,
    },
    /// Reopening the store (what it holds, as recovery reads it).
    Reopening { epoch: u64, rebuilt: bool },
    /// Done.
    Synced { epoch: u64, rebuilt: bool },
    /// Failed: [`Sync::failure`] says how.
    Failed,
}

/// What the I/O of a phase found.
#[derive(Debug)]
pub(super) enum Outcome {
    /// [`Phase::Reading`]: the directory, the local store's sync state,
    /// and whether an adoption was under way in it.
    Read {
        dir: Directory,
        local: Option<Synced>,
        adopting: bool,
    },
    /// [`Phase::Checking`].
    Exists(bool),
    /// [`Phase::Reseeding`], [`Phase::Starting`]: seeded with this many.
    Started { seeded: u64 },
    /// [`Phase::Rebuilding`].
    Rebuilt,
    /// [`Phase::Sealing`]: the epoch written.
    Sealed(u64),
    /// [`Phase::Reopening`].
    Reopened,
    /// The broker failed: tried again.
    Broker(ClientError),
    /// This stream is gone: waits for an operator's reseed.
    Missing(String),
    /// The local store failed: given up.
    Store(String),
}

/// What the driver does, in order, before the next phase's I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Effect {
    /// The reseed asked for is refused: `by` adopted this id's messages.
    RefuseReseed { by: String },
    /// The reseed is done: answered once the sync is.
    Reseeded { seeded: u64, generation: u64 },
    /// The first sync of this process: no adoption of its own is under
    /// way (the rebuild the markers asked for dropped the uncommitted
    /// parks).
    EndAdoptionsAtStart,
}

/// How a sync attempt failed.
#[derive(Debug)]
pub(super) enum Failure {
    Broker(ClientError),
    Missing(String),
    Store(String),
}

/// One sync attempt of `instance`.
#[derive(Debug)]
pub(super) struct Sync {
    instance: String,
    /// An operator's reseed waits for this sync.
    reseed: bool,
    /// No sync succeeded in this process yet.
    first: bool,
    /// The highest lease epoch in the directory.
    last: u64,
    phase: Phase,
    failure: Option<Failure>,
}

impl Sync {
    pub(super) fn new(instance: &str, reseed: bool, first: bool) -> Self {
        Self {
            instance: instance.to_owned(),
            reseed,
            first,
            last: 0,
            phase: Phase::Reading,
            failure: None,
        }
    }

    pub(super) fn phase(&self) -> &Phase {
        &self.phase
    }

    /// How it failed, once [`Phase::Failed`].
    pub(super) fn failure(&mut self) -> Option<Failure> {
        self.failure.take()
    }

    /// The transition: what `outcome` of the current phase leads to.
    pub(super) fn on(&mut self, outcome: Outcome) -> Vec<Effect> {
        let phase = std::mem::replace(&mut self.phase, Phase::Failed);
        let last = self.last;
        let sealing = |generation, rebuilt| Phase::Sealing {
            last,
            generation,
            rebuilt,
        };
        let mut effects = vec![];
        self.phase = match (phase, outcome) {
            (
                Phase::Reading,
                Outcome::Read {
                    dir,
                    local,
                    adopting,
                },
            ) => {
                return self.on_read(&dir, local.as_ref(), adopting);
            }
            (Phase::Checking { g, .. }, Outcome::Exists(false)) => {
                let stream = Config::generation(&self.instance, g);
                return self.fail(Failure::Missing(stream));
            }
            (Phase::Checking { g, current: true }, Outcome::Exists(true)) => sealing(g, false),
            (Phase::Checking { g, current: false }, Outcome::Exists(true)) => {
                Phase::Rebuilding { g }
            }
            (Phase::Reseeding { next }, Outcome::Started { seeded }) => {
                let generation = next;
                effects.push(Effect::Reseeded { seeded, generation });
                sealing(next, false)
            }
            (Phase::Starting { next, wipe }, Outcome::Started { .. }) => sealing(next, wipe),
            (Phase::Rebuilding { g }, Outcome::Rebuilt) => sealing(g, true),
            (Phase::Sealing { rebuilt, .. }, Outcome::Sealed(epoch)) => {
                Phase::Reopening { epoch, rebuilt }
            }
            (Phase::Reopening { epoch, rebuilt }, Outcome::Reopened) => {
                if std::mem::take(&mut self.first) {
                    effects.push(Effect::EndAdoptionsAtStart);
                }
                Phase::Synced { epoch, rebuilt }
            }
            (_, Outcome::Broker(e)) => return self.fail(Failure::Broker(e)),
            (_, Outcome::Missing(stream)) => return self.fail(Failure::Missing(stream)),
            (_, Outcome::Store(e)) => return self.fail(Failure::Store(e)),
            (phase, outcome) => {
                let why = format!("sync: {outcome:?} does not follow {phase:?}");
                return self.fail(Failure::Broker(ClientError::Unreachable(why)));
            }
        };
        effects
    }

    /// The directory read: what the sync is to do.
    fn on_read(&mut self, dir: &Directory, local: Option<&Synced>, adopting: bool) -> Vec<Effect> {
        self.last = dir.epoch;
        let mut effects = vec![];
        if let (true, Some(by)) = (self.reseed, &dir.adopted_by) {
            effects.push(Effect::RefuseReseed { by: by.clone() });
            self.reseed = false;
        }
        // A store left by an adoption under way holds parks that may never
        // count: rebuilt from the stream, where they count once committed.
        // One that a part of an adoption of this id took from since its
        // epoch holds messages given away: rebuilt without them.
        let current = |g: u64| {
            !adopting
                && !dir.given_since_epoch
                && local.is_some_and(|l| {
                    l.instance == self.instance
                        && l.generation == g
                        && l.epoch == dir.epoch
                        && same_holder(l, dir)
                })
        };
        let after = |g: Option<u64>| g.map_or(1, |g| g + 1);
        let next = match (dir.generation, &dir.adopted_by, self.reseed) {
            (g, None, true) => Phase::Reseeding { next: after(g) },
            (Some(g), None, false) => Phase::Checking {
                g,
                current: current(g),
            },
            (g, adopted, _) => Phase::Starting {
                next: after(g),
                wipe: adopted.is_some(),
            },
        };
        self.phase = next;
        effects
    }

    fn fail(&mut self, failure: Failure) -> Vec<Effect> {
        self.phase = Phase::Failed;
        self.failure = Some(failure);
        vec![]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(generation: Option<u64>, epoch: u64, adopted_by: Option<&str>) -> Directory {
        Directory {
            generation,
            epoch,
            holder: Some("pid 1 on h".into()),
            nodes: None,
            adopted_by: adopted_by.map(str::to_owned),
            ..Directory::default()
        }
    }

    fn synced(generation: u64, epoch: u64) -> Synced {
        Synced {
            instance: "a".into(),
            generation,
            epoch,
            holder: Some("pid 1 on h".into()),
        }
    }

    /// A sync of `a` after reading `dir` and a local store at `local`.
    fn read(
        reseed: bool,
        dir: Directory,
        local: Option<Synced>,
        adopting: bool,
    ) -> (Sync, Vec<Effect>) {
        let mut sync = Sync::new("a", reseed, false);
        assert_eq!(sync.phase(), &Phase::Reading);
        let effects = sync.on(Outcome::Read {
            dir,
            local,
            adopting,
        });
        (sync, effects)
    }

    fn sealing(last: u64, generation: u64, rebuilt: bool) -> Phase {
        Phase::Sealing {
            last,
            generation,
            rebuilt,
        }
    }

    #[test]
    fn a_current_store_is_kept_once_its_stream_is_there() {
        let (mut s, effects) = read(false, dir(Some(2), 5, None), Some(synced(2, 5)), false);
        assert!(effects.is_empty());
        assert_eq!(
            s.phase(),
            &Phase::Checking {
                g: 2,
                current: true
            }
        );
        assert!(s.on(Outcome::Exists(true)).is_empty());
        assert_eq!(s.phase(), &sealing(5, 2, false));
        assert!(s.on(Outcome::Sealed(6)).is_empty());
        let reopening = Phase::Reopening {
            epoch: 6,
            rebuilt: false,
        };
        assert_eq!(s.phase(), &reopening);
        assert!(s.on(Outcome::Reopened).is_empty(), "not the first sync");
        let synced = Phase::Synced {
            epoch: 6,
            rebuilt: false,
        };
        assert_eq!(s.phase(), &synced);
    }

    #[test]
    fn a_stale_store_is_rebuilt() {
        for local in [
            None,
            Some(synced(1, 5)),
            Some(synced(2, 4)),
            Some(Synced {
                instance: "b".into(),
                ..synced(2, 5)
            }),
            Some(Synced {
                holder: Some("pid 2 on h".into()),
                ..synced(2, 5)
            }),
        ] {
            let (mut s, _) = read(false, dir(Some(2), 5, None), local.clone(), false);
            assert_eq!(
                s.phase(),
                &Phase::Checking {
                    g: 2,
                    current: false
                },
                "{local:?}"
            );
            assert!(s.on(Outcome::Exists(true)).is_empty());
            assert_eq!(s.phase(), &Phase::Rebuilding { g: 2 });
            assert!(s.on(Outcome::Rebuilt).is_empty());
            assert_eq!(s.phase(), &sealing(5, 2, true));
        }
    }

    /// Issue 36: a part of an adoption of this id committed since its
    /// epoch took messages the local store still holds: it is rebuilt
    /// (without them), not kept.
    #[test]
    fn a_store_a_part_of_an_adoption_took_from_is_rebuilt() {
        let given = Directory {
            given_since_epoch: true,
            ..dir(Some(2), 5, None)
        };
        let (mut s, _) = read(false, given, Some(synced(2, 5)), false);
        let stale = Phase::Checking {
            g: 2,
            current: false,
        };
        assert_eq!(s.phase(), &stale);
        assert!(s.on(Outcome::Exists(true)).is_empty());
        assert_eq!(s.phase(), &Phase::Rebuilding { g: 2 });
    }

    #[test]
    fn a_store_left_mid_adoption_is_rebuilt() {
        let (s, _) = read(false, dir(Some(2), 5, None), Some(synced(2, 5)), true);
        assert_eq!(
            s.phase(),
            &Phase::Checking {
                g: 2,
                current: false
            }
        );
    }

    #[test]
    fn a_missing_stream_fails_to_wait_for_a_reseed() {
        let (mut s, _) = read(false, dir(Some(2), 5, None), Some(synced(2, 5)), false);
        assert!(s.on(Outcome::Exists(false)).is_empty());
        assert_eq!(s.phase(), &Phase::Failed);
        let Some(Failure::Missing(stream)) = s.failure() else {
            panic!("missing")
        };
        assert_eq!(stream, Config::generation("a", 2));
    }

    #[test]
    fn a_stream_returned_while_rebuilding_fails_as_missing() {
        let (mut s, _) = read(false, dir(Some(2), 5, None), None, false);
        s.on(Outcome::Exists(true));
        assert!(s.on(Outcome::Missing("s".into())).is_empty());
        assert!(matches!(s.failure(), Some(Failure::Missing(x)) if x == "s"));
    }

    #[test]
    fn no_generation_starts_the_first_seeded_from_the_store() {
        let (mut s, effects) = read(false, dir(None, 0, None), None, false);
        assert!(effects.is_empty());
        assert_eq!(
            s.phase(),
            &Phase::Starting {
                next: 1,
                wipe: false
            }
        );
        assert!(s.on(Outcome::Started { seeded: 4 }).is_empty());
        assert_eq!(s.phase(), &sealing(0, 1, false));
    }

    #[test]
    fn adopted_elsewhere_starts_a_new_generation_wiped() {
        let (mut s, effects) = read(false, dir(Some(3), 7, Some("b")), Some(synced(3, 7)), false);
        assert!(effects.is_empty());
        assert_eq!(
            s.phase(),
            &Phase::Starting {
                next: 4,
                wipe: true
            }
        );
        s.on(Outcome::Started { seeded: 0 });
        assert_eq!(s.phase(), &sealing(7, 4, true), "wiped counts as rebuilt");
    }

    #[test]
    fn a_reseed_starts_the_next_generation_and_is_answered() {
        let (mut s, effects) = read(true, dir(Some(3), 7, None), Some(synced(3, 7)), false);
        assert!(effects.is_empty());
        assert_eq!(s.phase(), &Phase::Reseeding { next: 4 });
        let effects = s.on(Outcome::Started { seeded: 9 });
        let reseeded = Effect::Reseeded {
            seeded: 9,
            generation: 4,
        };
        assert_eq!(effects, vec![reseeded]);
        assert_eq!(s.phase(), &sealing(7, 4, false));
    }

    #[test]
    fn a_reseed_of_an_adopted_id_is_refused() {
        let (s, effects) = read(true, dir(Some(3), 7, Some("b")), None, false);
        assert_eq!(effects, vec![Effect::RefuseReseed { by: "b".into() }]);
        assert_eq!(
            s.phase(),
            &Phase::Starting {
                next: 4,
                wipe: true
            }
        );
    }

    #[test]
    fn a_failed_reseed_answers_nothing() {
        let (mut s, _) = read(true, dir(Some(3), 7, None), None, false);
        assert!(s.on(Outcome::Broker(ClientError::Nacked)).is_empty());
        assert!(matches!(
            s.failure(),
            Some(Failure::Broker(ClientError::Nacked))
        ));
    }

    #[test]
    fn the_first_sync_ends_the_adoptions_left_by_the_last_process() {
        let mut s = Sync::new("a", false, true);
        s.on(Outcome::Read {
            dir: dir(Some(1), 1, None),
            local: Some(synced(1, 1)),
            adopting: false,
        });
        s.on(Outcome::Exists(true));
        s.on(Outcome::Sealed(2));
        assert_eq!(s.on(Outcome::Reopened), vec![Effect::EndAdoptionsAtStart]);
    }

    #[test]
    fn failures_end_the_sync_in_any_phase() {
        let mut s = Sync::new("a", false, false);
        assert!(s.on(Outcome::Broker(ClientError::Nacked)).is_empty());
        assert!(matches!(s.failure(), Some(Failure::Broker(_))));
        let (mut s, _) = read(false, dir(Some(2), 5, None), None, false);
        s.on(Outcome::Exists(true));
        assert!(s.on(Outcome::Store("disk".into())).is_empty());
        assert!(matches!(s.failure(), Some(Failure::Store(e)) if e == "disk"));
        let (mut s, _) = read(false, dir(None, 0, None), None, false);
        s.on(Outcome::Started { seeded: 0 });
        assert!(
            s.on(Outcome::Broker(ClientError::Nacked)).is_empty(),
            "sealing"
        );
        assert_eq!(s.phase(), &Phase::Failed);
    }

    #[test]
    fn an_outcome_out_of_order_fails_the_sync() {
        let mut s = Sync::new("a", false, false);
        assert!(s.on(Outcome::Rebuilt).is_empty());
        assert!(matches!(s.failure(), Some(Failure::Broker(_))));
    }
}

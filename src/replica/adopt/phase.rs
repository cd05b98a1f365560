//! One adoption attempt as named states, without I/O: lease → directory
//! → (the open intent's adopter) → stream → intent → parks → checks →
//! commit → finish. [`Attempt::on`] takes what the last step found and
//! names the next step, with the effects to apply first; the driver
//! (`Adopter::adopt` in `super`) does the I/O each [`Phase`] names.
//!
//! The guarantees live in the transitions: one intent per adoption (a
//! resumed attempt keeps its epoch, a new one takes the next), parks
//! that are never scheduled before a commit naming them is written
//! ([`Effect::Schedule`] after `Adopted` of their epoch, which the
//! directory shows; or a part of the intent, which the driver commits
//! while [`Phase::Parking`], under the same two checks as `Adopted`),
//! and no commit unless this instance is still active and the adopted
//! id's lease still has a majority.
//!
//! ```text
//! Leasing ─taken→ Reading ─┬─ adopted, or no generation ─→ Finishing ─→ Ended (Done)
//!    └─ not taken → Ended  ├─ another's intent open ─→ AskingAdopter ─ alive → Ended (Left)
//!       (Busy)             │                                └─ gone or overdue ─┐
//!                          └──────────────────────────→ CheckingStream ←───────┘
//! CheckingStream ─ gone → Ended (Missing)
//!    └─ there → Intending → Parking → Confirming → Probing → Committing → Finishing → Ended (Done)
//! Parking: stream returned → Ended (Missing); Confirming: not active, Probing: no
//! majority, any phase: an I/O error → Ended (the error; parks kept, not fired
//! but those of the parts committed while Parking)
//! ```

use tracing::{info, warn};

use super::{Adoption, Directory};
use crate::replica::client::ClientError;
use crate::replica::Config;

/// Why a commit (the intent's, or a part's) is not written: this
/// instance's own lease was lost meanwhile.
pub(super) const LOST_OWN: &str =
    "this instance's lease was lost during the adoption: not committing";
/// Why a commit is not written: the adopted id's lease lost its majority.
pub(super) const LOST_ADOPTED: &str =
    "the adopted instance's lease was lost during the adoption: not committing";

/// Where an adoption attempt stands: each names the I/O to do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Phase {
    /// Taking the adopted instance's lease.
    Leasing,
    /// Its lease is ours: reading its directory.
    Reading,
    /// Another adopter's intent `epoch` is open: is that adopter alive?
    AskingAdopter {
        g: u64,
        last_intent: u64,
        by: String,
        epoch: u64,
    },
    /// Does the generation stream `g` still exist?
    CheckingStream { g: u64, last_intent: u64 },
    /// Marking the adoption in the local store, and writing the intent
    /// `epoch` to the directory when `new` (a resumed one is written).
    Intending { g: u64, epoch: u64, new: bool },
    /// Parking every message of generation `g` under the intent, and
    /// committing them in parts (`replica.adopt_part`) as they are parked:
    /// what is left is committed by `Adopted`.
    Parking { g: u64, epoch: u64 },
    /// Parked `count`: is this instance still active (its own lease)?
    Confirming { g: u64, epoch: u64, count: usize },
    /// Does the adopted id's lease still have a majority?
    Probing { g: u64, epoch: u64, count: usize },
    /// Writing `Adopted` with the intent's epoch.
    Committing { g: u64, epoch: u64, count: usize },
    /// Deleting the adopted generation (if any), then giving the lease
    /// back; `adopted`: the epoch and count this attempt committed.
    Finishing {
        generation: Option<u64>,
        adopted: Option<(u64, usize)>,
    },
    /// Over: [`Attempt::exit`] says how.
    Ended,
}

/// What the I/O of a phase found.
#[derive(Debug)]
pub(super) enum Outcome {
    /// [`Phase::Leasing`]: the lease was taken, or not (someone has it).
    Lease(bool),
    /// [`Phase::Reading`]: the directory (empty if it has none).
    Directory(Directory),
    /// [`Phase::AskingAdopter`]: its lease is held.
    AdopterAlive(bool),
    /// [`Phase::CheckingStream`].
    StreamExists(bool),
    /// [`Phase::Intending`]: marked, and written if new.
    IntentWritten,
    /// [`Phase::Parking`]: this many are parked under the intent (those
    /// committed in parts included).
    Parked(usize),
    /// [`Phase::Parking`]: the broker returned a read: the stream is gone.
    StreamReturned(String),
    /// [`Phase::Confirming`]: this instance is still active.
    Active(bool),
    /// [`Phase::Probing`]: a majority of the lease's registers answered.
    Majority(bool),
    /// [`Phase::Committing`]: `Adopted` is confirmed.
    Committed,
    /// [`Phase::Finishing`]: done.
    Finished,
    /// Any phase: the broker or the local store failed.
    Failed(ClientError),
}

/// What the driver does before the next phase's I/O, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Effect {
    /// Intent `epoch` is committed: the parks so far are scheduled.
    Schedule(u64),
    /// The parks so far can no longer be committed: completed.
    Abandon,
    /// Our intent `epoch` is written: parks from now on count under it.
    Intend(u64),
    /// The adopted instance's lease goes back.
    GiveBackLease,
}

/// One attempt at adopting `name`.
#[derive(Debug)]
pub(super) struct Attempt {
    name: String,
    me: String,
    /// The epoch of a live adopter's intent left open too long.
    overdue: Option<u64>,
    /// The intent our parks so far were made under, if any.
    ours: Option<u64>,
    phase: Phase,
    exit: Option<Result<Adoption, ClientError>>,
}

impl Attempt {
    /// An attempt by `me` at `name`, whose earlier parks (if any) were
    /// made under intent `ours`.
    pub(super) fn new(name: &str, me: &str, ours: Option<u64>, overdue: Option<u64>) -> Self {
        Self {
            name: name.to_owned(),
            me: me.to_owned(),
            overdue,
            ours,
            phase: Phase::Leasing,
            exit: None,
        }
    }

    pub(super) fn phase(&self) -> &Phase {
        &self.phase
    }

    /// How it ended, once [`Phase::Ended`].
    pub(super) fn exit(&mut self) -> Option<Result<Adoption, ClientError>> {
        self.exit.take()
    }

    /// The transition: what `outcome` of the current phase leads to.
    pub(super) fn on(&mut self, outcome: Outcome) -> Vec<Effect> {
        let phase = std::mem::replace(&mut self.phase, Phase::Ended);
        let (next, effects) = match (phase, outcome) {
            // Parks are kept (not fired): the next try resumes under the
            // same intent, or drops them if it can no longer commit.
            (_, Outcome::Failed(e)) => return self.end(Err(e), vec![]),
            (Phase::Leasing, Outcome::Lease(false)) => {
                return self.end(Ok(Adoption::Busy), vec![]);
            }
            (Phase::Leasing, Outcome::Lease(true)) => (Phase::Reading, vec![]),
            (Phase::Reading, Outcome::Directory(dir)) => self.on_directory(&dir),
            (Phase::AskingAdopter { epoch, .. }, Outcome::AdopterAlive(true)) => {
                // It resumes (or gives up) itself.
                return self.end(Ok(Adoption::Left(epoch)), vec![Effect::GiveBackLease]);
            }
            (
                Phase::AskingAdopter {
                    g,
                    last_intent,
                    by,
                    epoch,
                },
                Outcome::AdopterAlive(false),
            ) => {
                self.taking_over(&by, epoch);
                (Phase::CheckingStream { g, last_intent }, vec![])
            }
            (Phase::CheckingStream { g, last_intent }, Outcome::StreamExists(exists)) => {
                return self.on_stream(g, last_intent, exists);
            }
            (Phase::Intending { g, epoch, new }, Outcome::IntentWritten) => {
                self.ours = Some(epoch);
                let effects = if new {
                    vec![Effect::Intend(epoch)]
                } else {
                    vec![]
                };
                (Phase::Parking { g, epoch }, effects)
            }
            (phase, outcome) => return self.on_parked(phase, outcome),
        };
        self.phase = next;
        effects
    }

    /// From parks to the end: the checks before the commit, and after.
    fn on_parked(&mut self, phase: Phase, outcome: Outcome) -> Vec<Effect> {
        let next = match (phase, outcome) {
            (Phase::Parking { g, epoch }, Outcome::Parked(count)) => {
                Phase::Confirming { g, epoch, count }
            }
            (Phase::Parking { .. }, Outcome::StreamReturned(stream)) => {
                self.ours = None;
                let effects = vec![Effect::Abandon, Effect::GiveBackLease];
                return self.end(Ok(Adoption::Missing(stream)), effects);
            }
            // The store may have been rebuilt without these parks: the
            // next round drops them.
            (Phase::Confirming { .. }, Outcome::Active(false)) => return self.fail(LOST_OWN),
            (Phase::Confirming { g, epoch, count }, Outcome::Active(true)) => {
                Phase::Probing { g, epoch, count }
            }
            // Another adopter (or the instance itself) may act on its
            // directory now.
            (Phase::Probing { .. }, Outcome::Majority(false)) => return self.fail(LOST_ADOPTED),
            (Phase::Probing { g, epoch, count }, Outcome::Majority(true)) => {
                Phase::Committing { g, epoch, count }
            }
            (Phase::Committing { g, epoch, count }, Outcome::Committed) => {
                self.ours = None;
                self.phase = Phase::Finishing {
                    generation: Some(g),
                    adopted: Some((epoch, count)),
                };
                return vec![Effect::Schedule(epoch)];
            }
            (Phase::Finishing { adopted, .. }, Outcome::Finished) => {
                if let Some((epoch, messages)) = adopted {
                    info!(
                        from = self.name,
                        epoch,
                        messages,
                        "adopted the held messages of an instance whose lease was free"
                    );
                }
                return self.end(Ok(Adoption::Done), vec![]);
            }
            (phase, outcome) => {
                let why = format!("adoption: {outcome:?} does not follow {phase:?}");
                return self.end(Err(ClientError::Unreachable(why)), vec![]);
            }
        };
        self.phase = next;
        vec![]
    }

    /// The directory read under the lease: what the last try left is
    /// settled, then what is left to adopt decides.
    fn on_directory(&mut self, dir: &Directory) -> (Phase, Vec<Effect>) {
        let mut effects = vec![];
        let mut released = false;
        if let Some(epoch) = self.ours {
            if dir.committed.contains(&epoch) {
                // Committed by the last try, whose answer was lost.
                effects.push(Effect::Schedule(epoch));
                (self.ours, released) = (None, true);
            } else if dir.open.as_ref() != Some(&(self.me.clone(), epoch)) {
                // Its intent is closed (the instance came back, or
                // another adopter took over): never committed now.
                effects.push(Effect::Abandon);
                self.ours = None;
            }
        }
        let Some(g) = dir.generation.filter(|_| !dir.adopted) else {
            let generation = dir.generation.filter(|_| released);
            let adopted = None;
            return (
                Phase::Finishing {
                    generation,
                    adopted,
                },
                effects,
            );
        };
        if let Some(recorded) = &dir.other_nodes {
            // Its lease is named by other nodes than the one just taken:
            // nothing is adopted (an intent of ours still open is
            // abandoned with the attempt: it is never committed now).
            effects.push(Effect::GiveBackLease);
            self.exit = Some(Ok(Adoption::OtherNodes(recorded.clone())));
            return (Phase::Ended, effects);
        }
        let last_intent = dir.last_intent;
        let next = match dir.open.as_ref().filter(|(by, _)| *by != self.me) {
            Some((by, epoch)) if self.overdue != Some(*epoch) => Phase::AskingAdopter {
                g,
                last_intent,
                by: by.clone(),
                epoch: *epoch,
            },
            Some((by, epoch)) => {
                self.taking_over(by, *epoch);
                Phase::CheckingStream { g, last_intent }
            }
            None => Phase::CheckingStream { g, last_intent },
        };
        (next, effects)
    }

    /// The stream checked: gone, or the intent to write (or resume).
    fn on_stream(&mut self, g: u64, last_intent: u64, exists: bool) -> Vec<Effect> {
        if !exists {
            // It may come back and reseed.
            let stream = Config::generation(&self.name, g);
            return self.end(Ok(Adoption::Missing(stream)), vec![Effect::GiveBackLease]);
        }
        self.phase = match self.ours {
            Some(epoch) => Phase::Intending {
                g,
                epoch,
                new: false,
            },
            None => Phase::Intending {
                g,
                epoch: last_intent + 1,
                new: true,
            },
        };
        vec![]
    }

    fn taking_over(&self, by: &str, epoch: u64) {
        warn!(
            from = self.name,
            adopter = by,
            epoch,
            "an adoption was cut off half way (its adopter is gone, or has not finished within adopt_after): adopting again; its parks never count"
        );
    }

    fn fail(&mut self, why: &str) -> Vec<Effect> {
        self.end(Err(ClientError::Unreachable(why.into())), vec![])
    }

    fn end(&mut self, exit: Result<Adoption, ClientError>, effects: Vec<Effect>) -> Vec<Effect> {
        self.phase = Phase::Ended;
        self.exit = Some(exit);
        effects
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn attempt(ours: Option<u64>, overdue: Option<u64>) -> Attempt {
        Attempt::new("a", "me", ours, overdue)
    }

    /// An attempt whose lease is taken and directory read.
    fn read(ours: Option<u64>, overdue: Option<u64>, dir: Directory) -> (Attempt, Vec<Effect>) {
        let mut a = attempt(ours, overdue);
        assert!(a.on(Outcome::Lease(true)).is_empty());
        assert_eq!(a.phase(), &Phase::Reading);
        let effects = a.on(Outcome::Directory(dir));
        (a, effects)
    }

    fn dir(generation: Option<u64>, open: Option<(&str, u64)>, last_intent: u64) -> Directory {
        Directory {
            generation,
            adopted: false,
            open: open.map(|(by, e)| (by.to_owned(), e)),
            last_intent,
            committed: HashSet::new(),
            holder_epoch: 0,
            nodes: None,
            other_nodes: None,
            ..Directory::default()
        }
    }

    /// Drives a parking attempt through both checks to its commit.
    fn to_commit(a: &mut Attempt) {
        assert!(a.on(Outcome::Parked(3)).is_empty());
        assert!(a.on(Outcome::Active(true)).is_empty());
        assert!(a.on(Outcome::Majority(true)).is_empty());
    }

    #[test]
    fn a_lease_held_by_another_is_busy() {
        let mut a = attempt(None, None);
        assert!(a.on(Outcome::Lease(false)).is_empty());
        assert_eq!(a.phase(), &Phase::Ended);
        assert!(matches!(a.exit(), Some(Ok(Adoption::Busy))));
    }

    /// Issue 36: an instance whose last holder listed other nodes is not
    /// adopted: its lease is given back, and nothing is written.
    #[test]
    fn an_instance_of_other_nodes_is_not_adopted() {
        let other = vec!["n9:5672".to_string()];
        let with_other = |mut dir: Directory| {
            dir.other_nodes = Some(other.clone());
            dir
        };
        let (mut a, effects) = read(None, None, with_other(dir(Some(1), None, 0)));
        assert_eq!(effects, vec![Effect::GiveBackLease]);
        assert_eq!(a.phase(), &Phase::Ended);
        assert!(matches!(a.exit(), Some(Ok(Adoption::OtherNodes(n))) if n == other));
        // Review: a commit of ours whose answer was lost is scheduled
        // first (its parks count), and an intent of ours still open is
        // abandoned with the attempt.
        let mut committed = with_other(dir(Some(1), None, 3));
        committed.committed.insert(3);
        let (mut a, effects) = read(Some(3), None, committed);
        assert_eq!(effects, vec![Effect::Schedule(3), Effect::GiveBackLease]);
        assert!(matches!(a.exit(), Some(Ok(Adoption::OtherNodes(_)))));
        // An intent of ours still open: dropped with the attempt (the
        // driver abandons its parks), no other effect.
        let (mut a, effects) = read(Some(3), None, with_other(dir(Some(1), Some(("me", 3)), 3)));
        assert_eq!(effects, vec![Effect::GiveBackLease]);
        assert!(matches!(a.exit(), Some(Ok(Adoption::OtherNodes(_)))));
        // Ours closed (the instance came back since): abandoned first.
        let (mut a, effects) = read(Some(3), None, with_other(dir(Some(1), None, 3)));
        assert_eq!(effects, vec![Effect::Abandon, Effect::GiveBackLease]);
        assert!(matches!(a.exit(), Some(Ok(Adoption::OtherNodes(_)))));
        // Another adopter's intent open: not asked about, ended all the same.
        let (mut a, effects) = read(None, None, with_other(dir(Some(1), Some(("b", 2)), 2)));
        assert_eq!(effects, vec![Effect::GiveBackLease]);
        assert_eq!(a.phase(), &Phase::Ended);
        assert!(matches!(a.exit(), Some(Ok(Adoption::OtherNodes(_)))));
        // Nothing left to adopt (no generation, or adopted): not reported.
        let finishing = Phase::Finishing {
            generation: None,
            adopted: None,
        };
        let (mut a, effects) = read(None, None, with_other(dir(None, None, 0)));
        assert!(effects.is_empty());
        assert_eq!(a.phase(), &finishing);
        assert!(a.exit().is_none());
        let mut adopted = with_other(dir(Some(1), None, 0));
        adopted.adopted = true;
        let (mut a, effects) = read(None, None, adopted);
        assert!(effects.is_empty());
        assert_eq!(a.phase(), &finishing);
        assert!(a.exit().is_none());
    }

    #[test]
    fn nothing_to_adopt_finishes_without_deleting() {
        let (mut a, effects) = read(None, None, dir(None, None, 0));
        assert!(effects.is_empty());
        let finishing = Phase::Finishing {
            generation: None,
            adopted: None,
        };
        assert_eq!(a.phase(), &finishing);
        assert!(a.on(Outcome::Finished).is_empty());
        assert!(matches!(a.exit(), Some(Ok(Adoption::Done))));
    }

    #[test]
    fn an_adopted_directory_is_done() {
        let mut d = dir(Some(2), None, 1);
        d.adopted = true;
        let (a, effects) = read(None, None, d);
        assert!(effects.is_empty());
        let finishing = Phase::Finishing {
            generation: None,
            adopted: None,
        };
        assert_eq!(
            a.phase(),
            &finishing,
            "the generation is not ours to delete"
        );
    }

    #[test]
    fn a_commit_whose_answer_was_lost_is_scheduled_and_finished() {
        let mut d = dir(Some(2), None, 4);
        (d.adopted, d.committed) = (true, HashSet::from([4]));
        let (a, effects) = read(Some(4), None, d);
        assert_eq!(effects, vec![Effect::Schedule(4)]);
        let finishing = Phase::Finishing {
            generation: Some(2),
            adopted: None,
        };
        assert_eq!(a.phase(), &finishing);
    }

    #[test]
    fn parks_of_a_closed_intent_are_abandoned_and_a_new_intent_taken() {
        // The instance came back in between (its epoch closed the intent).
        let (mut a, effects) = read(Some(4), None, dir(Some(2), None, 4));
        assert_eq!(effects, vec![Effect::Abandon]);
        assert_eq!(
            a.phase(),
            &Phase::CheckingStream {
                g: 2,
                last_intent: 4
            }
        );
        assert!(a.on(Outcome::StreamExists(true)).is_empty());
        let intending = Phase::Intending {
            g: 2,
            epoch: 5,
            new: true,
        };
        assert_eq!(a.phase(), &intending, "one intent: the next epoch");
    }

    #[test]
    fn our_open_intent_is_resumed_under_its_epoch() {
        let (mut a, effects) = read(Some(4), None, dir(Some(2), Some(("me", 4)), 4));
        assert!(effects.is_empty(), "its parks are kept");
        assert!(a.on(Outcome::StreamExists(true)).is_empty());
        let intending = Phase::Intending {
            g: 2,
            epoch: 4,
            new: false,
        };
        assert_eq!(a.phase(), &intending);
        assert!(a.on(Outcome::IntentWritten).is_empty(), "not written again");
        assert_eq!(a.phase(), &Phase::Parking { g: 2, epoch: 4 });
    }

    #[test]
    fn a_new_intent_is_written_before_any_park() {
        let (mut a, _) = read(None, None, dir(Some(1), None, 0));
        assert!(a.on(Outcome::StreamExists(true)).is_empty());
        assert_eq!(a.on(Outcome::IntentWritten), vec![Effect::Intend(1)]);
        assert_eq!(a.phase(), &Phase::Parking { g: 1, epoch: 1 });
    }

    #[test]
    fn an_open_intent_of_a_live_adopter_is_left_to_it() {
        let (mut a, effects) = read(None, None, dir(Some(1), Some(("b", 3)), 3));
        assert!(effects.is_empty());
        let asking = Phase::AskingAdopter {
            g: 1,
            last_intent: 3,
            by: "b".into(),
            epoch: 3,
        };
        assert_eq!(a.phase(), &asking);
        assert_eq!(
            a.on(Outcome::AdopterAlive(true)),
            vec![Effect::GiveBackLease]
        );
        assert!(matches!(a.exit(), Some(Ok(Adoption::Left(3)))));
    }

    #[test]
    fn an_intent_whose_adopter_died_halfway_is_taken_over_under_a_new_one() {
        let (mut a, _) = read(None, None, dir(Some(1), Some(("b", 3)), 3));
        assert!(a.on(Outcome::AdopterAlive(false)).is_empty());
        assert!(a.on(Outcome::StreamExists(true)).is_empty());
        let intending = Phase::Intending {
            g: 1,
            epoch: 4,
            new: true,
        };
        assert_eq!(a.phase(), &intending, "b's parks never count: a new epoch");
    }

    #[test]
    fn an_overdue_intent_is_taken_over_without_asking() {
        let (a, _) = read(None, Some(3), dir(Some(1), Some(("b", 3)), 3));
        let checking = Phase::CheckingStream {
            g: 1,
            last_intent: 3,
        };
        assert_eq!(a.phase(), &checking);
        // Overdue names another epoch: that adopter is asked again.
        let (a, _) = read(None, Some(2), dir(Some(1), Some(("b", 3)), 3));
        assert!(matches!(a.phase(), Phase::AskingAdopter { .. }));
    }

    #[test]
    fn a_missing_stream_gives_the_lease_back() {
        let (mut a, _) = read(None, None, dir(Some(7), None, 0));
        assert_eq!(
            a.on(Outcome::StreamExists(false)),
            vec![Effect::GiveBackLease]
        );
        let Some(Ok(Adoption::Missing(stream))) = a.exit() else {
            panic!("missing")
        };
        assert_eq!(stream, Config::generation("a", 7));
    }

    #[test]
    fn a_stream_returned_while_parking_abandons_the_parks() {
        let (mut a, _) = read(None, None, dir(Some(1), None, 0));
        a.on(Outcome::StreamExists(true));
        a.on(Outcome::IntentWritten);
        let effects = a.on(Outcome::StreamReturned("s".into()));
        assert_eq!(effects, vec![Effect::Abandon, Effect::GiveBackLease]);
        assert!(matches!(a.exit(), Some(Ok(Adoption::Missing(s))) if s == "s"));
    }

    /// An attempt that has written intent 1 and is parking.
    fn parking() -> Attempt {
        let (mut a, _) = read(None, None, dir(Some(1), None, 0));
        a.on(Outcome::StreamExists(true));
        a.on(Outcome::IntentWritten);
        a
    }

    #[test]
    fn parks_go_through_both_checks_to_the_commit() {
        let mut a = parking();
        assert!(a.on(Outcome::Parked(3)).is_empty());
        let confirming = Phase::Confirming {
            g: 1,
            epoch: 1,
            count: 3,
        };
        assert_eq!(a.phase(), &confirming);
        assert!(a.on(Outcome::Active(true)).is_empty());
        assert!(matches!(a.phase(), Phase::Probing { .. }));
        assert!(a.on(Outcome::Majority(true)).is_empty());
        let committing = Phase::Committing {
            g: 1,
            epoch: 1,
            count: 3,
        };
        assert_eq!(a.phase(), &committing);
    }

    #[test]
    fn nothing_is_scheduled_before_the_commit_and_all_after_it() {
        let mut a = parking();
        to_commit(&mut a);
        assert_eq!(a.on(Outcome::Committed), vec![Effect::Schedule(1)]);
        let finishing = Phase::Finishing {
            generation: Some(1),
            adopted: Some((1, 3)),
        };
        assert_eq!(a.phase(), &finishing, "the old generation goes");
        assert!(a.on(Outcome::Finished).is_empty());
        assert!(matches!(a.exit(), Some(Ok(Adoption::Done))));
    }

    #[test]
    fn our_own_lease_lost_while_parking_does_not_commit() {
        let mut a = parking();
        a.on(Outcome::Parked(3));
        assert!(a.on(Outcome::Active(false)).is_empty(), "parks kept");
        assert_eq!(a.phase(), &Phase::Ended);
        assert!(matches!(a.exit(), Some(Err(ClientError::Unreachable(_)))));
    }

    #[test]
    fn the_adopted_lease_lost_while_parking_does_not_commit() {
        let mut a = parking();
        a.on(Outcome::Parked(3));
        a.on(Outcome::Active(true));
        assert!(a.on(Outcome::Majority(false)).is_empty(), "parks kept");
        assert!(matches!(a.exit(), Some(Err(ClientError::Unreachable(_)))));
    }

    #[test]
    fn a_commit_refused_keeps_the_parks_unscheduled() {
        let mut a = parking();
        to_commit(&mut a);
        assert!(a.on(Outcome::Failed(ClientError::Nacked)).is_empty());
        assert!(matches!(a.exit(), Some(Err(ClientError::Nacked))));
        // The next try, under the same intent, finds it committed or not.
        let mut d = dir(Some(1), None, 1);
        (d.adopted, d.committed) = (true, HashSet::from([1]));
        let (_, effects) = read(Some(1), None, d);
        assert_eq!(effects, vec![Effect::Schedule(1)]);
        let (_, effects) = read(Some(1), None, dir(Some(1), None, 1));
        assert_eq!(effects, vec![Effect::Abandon]);
    }

    #[test]
    fn a_failure_in_any_phase_ends_without_effects() {
        let mut a = attempt(None, None);
        assert!(a.on(Outcome::Failed(ClientError::Nacked)).is_empty());
        assert!(matches!(a.exit(), Some(Err(ClientError::Nacked))));
        let mut a = parking();
        let e = ClientError::Unreachable("gone".into());
        assert!(
            a.on(Outcome::Failed(e)).is_empty(),
            "parks kept for the next try"
        );
        assert_eq!(a.phase(), &Phase::Ended);
    }

    #[test]
    fn an_outcome_out_of_order_ends_the_attempt() {
        let mut a = attempt(None, None);
        assert!(a.on(Outcome::Committed).is_empty());
        assert!(matches!(a.exit(), Some(Err(_))));
    }
}

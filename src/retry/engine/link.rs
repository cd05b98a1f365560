//! The engine's side of the replica: a new message is held once both the
//! store and the replica stream have it (the session acks upstream only
//! then); completions go to the stream in batches; and the lease says
//! whether the engine may fire at all. A stream that is gone stops new
//! holds (nacks are deferred) but not firing: what the local store holds is
//! still this instance's to republish.

use std::collections::HashMap;

use tokio::sync::{mpsc, watch};

use super::PutCtx;
use crate::replica::{Record, Replica, State};
use crate::store::{Held, Written};

pub(super) type Answer = (u64, Result<(), String>);

/// A new message's two answers, whichever comes first.
#[derive(Default)]
struct Pending {
    written: Option<Written<PutCtx>>,
    replicated: Option<Result<(), String>>,
}

/// The replica, and the new messages waiting for its answer.
pub(super) struct Link {
    replica: Replica,
    state: watch::Receiver<State>,
    tx: mpsc::UnboundedSender<Answer>,
    rx: mpsc::UnboundedReceiver<Answer>,
    pending: HashMap<u64, Pending>,
}

impl Link {
    pub(super) fn new(replica: Replica) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut state = replica.state();
        state.mark_unchanged();
        Self {
            replica,
            state,
            tx,
            rx,
            pending: HashMap::new(),
        }
    }

    /// Whether this instance acts for its id: held messages may fire.
    pub(super) fn holds_lease(&self) -> bool {
        matches!(*self.state.borrow(), State::Active | State::Missing)
    }

    /// Where interception stands, as the replica sees it: new messages
    /// are held only while the lease is held and the stream exists.
    pub(super) fn ready(&self) -> crate::retry::Ready {
        match *self.state.borrow() {
            State::Active => crate::retry::Ready::Ready,
            State::Missing | State::Reseeding => crate::retry::Ready::NoReplica,
            _ => crate::retry::Ready::NoLease,
        }
    }

    /// Appends a new message `id` to the stream (its put, or its moved
    /// put); its answer comes to the engine.
    pub(super) fn append(&mut self, id: u64, record: Record) {
        self.pending.insert(id, Pending::default());
        let appended = self.replica.append(record);
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let result = appended.await.map_err(|e| e.to_string());
            let _ = tx.send((id, result));
        });
    }

    /// `id` is completed (or was never held): the stream forgets it too.
    pub(super) fn done(&self, id: u64) {
        self.replica.done(id);
    }

    /// Appends a new version of a held message (a re-route). Not waited
    /// for: should it be lost, a rebuild has the previous version, which
    /// is returned and re-routed again.
    pub(super) fn append_version(&self, held: &Held) {
        tokio::spawn(self.replica.append(Record::put(held, false)));
    }

    /// The store's answer; both answers once the replica's came too.
    pub(super) fn written(
        &mut self,
        w: Written<PutCtx>,
    ) -> Option<(Written<PutCtx>, Result<(), String>)> {
        let Some(pending) = self.pending.get_mut(&w.id) else {
            return Some((w, Err("not sent to the replica".into())));
        };
        match pending.replicated.take() {
            Some(replicated) => {
                self.pending.remove(&w.id);
                Some((w, replicated))
            }
            None => {
                pending.written = Some(w);
                None
            }
        }
    }

    /// The replica's answer; both answers once the store's came too.
    pub(super) fn replicated(
        &mut self,
        (id, result): Answer,
    ) -> Option<(Written<PutCtx>, Result<(), String>)> {
        let pending = self.pending.get_mut(&id)?;
        match pending.written.take() {
            Some(w) => {
                self.pending.remove(&id);
                Some((w, result))
            }
            None => {
                pending.replicated = Some(result);
                None
            }
        }
    }
}

/// What the replica has for the engine.
pub(super) enum Event {
    /// A replica answer to a new message.
    Answer(Answer),
    /// The lease came or went.
    Lease,
    /// The local store went stale: the engine must stop, the store be rebuilt.
    Stale,
    /// A reseed was asked for: the engine stops (cleanly: the lease is
    /// held) and hands the store back, for a new generation from it.
    Resync,
}

/// The next replica event (never, without a replica).
pub(super) async fn event(link: &mut Option<Link>) -> Event {
    let Some(link) = link else {
        return std::future::pending().await;
    };
    tokio::select! {
        Some(answer) = link.rx.recv() => Event::Answer(answer),
        Ok(()) = link.state.changed() => match *link.state.borrow() {
            State::Stale => Event::Stale,
            State::Reseeding => Event::Resync,
            _ => Event::Lease,
        },
    }
}

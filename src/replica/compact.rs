//! Generations: a stream only grows, so when the current generation holds
//! much more than the live set, its live puts are copied to a new one and
//! the old one is deleted. Broker retention would drop the oldest records
//! whatever they hold; a generation switch drops only what is dead.
//!
//! While the copy runs, every new record goes to both generations, so the
//! old one stays complete until the directory names the new one, and the
//! new one misses nothing written meanwhile. Folding is order-independent
//! for completions and parks beat copies (see [`super::record`]), so the
//! interleaving of copies and new records does not matter.
//!
//! The copier reads on a connection of its own but sends every copy back
//! to the task, which appends it on the connection that holds the lease: a
//! process that lost the lease cannot write a copy either.

use std::collections::{HashMap, HashSet, VecDeque};

use tokio::sync::{mpsc, oneshot};

use super::client::{Client, ClientError, Target};
use super::record::Record;

/// A copy for the task to append to the new generation (answer when confirmed).
pub(super) type Copy = (Record, oneshot::Sender<Result<(), String>>);

/// Copies the live puts of `from` through `copies`; returns how many.
pub(super) async fn copy_live(
    target: Target,
    from: String,
    copies: mpsc::Sender<Copy>,
) -> Result<u64, ClientError> {
    let client = Client::connect(&target, fastrand::usize(..), "nackd replica compaction").await?;
    // First pass: which record of each id wins (ids only, never bodies).
    let mut winner: HashMap<u64, (u64, bool)> = HashMap::new();
    let mut done: HashSet<u64> = HashSet::new();
    let mut reader = client.read(&from).await?;
    let mut index = 0u64;
    while let Some(record) = reader.next().await? {
        match (record.as_put(), &record) {
            (Some((copy, record)), _) => {
                if let Some(id) = crate::store::record::id_of(record) {
                    let beaten = copy && winner.get(&id).is_some_and(|(_, c)| !c);
                    if !beaten {
                        winner.insert(id, (index, copy));
                    }
                }
            }
            (None, Record::Done(ids)) => done.extend(ids),
            _ => {}
        }
        index += 1;
    }
    let end = index;
    let live: HashSet<u64> = winner
        .iter()
        .filter(|(id, _)| !done.contains(id))
        .map(|(_, (i, _))| *i)
        .collect();
    drop(winner);
    // Second pass: the same records in the same order; copy the winners,
    // a window of them unconfirmed at a time.
    let mut reader = client.read(&from).await?;
    let (mut index, mut copied) = (0u64, 0u64);
    let mut window = VecDeque::new();
    while let Some(record) = reader.next().await? {
        if index >= end {
            break; // written after the first pass: both generations have it
        }
        if live.contains(&index) && record.as_put().is_some() {
            // A moved put keeps its intent: it counts once that is committed.
            let (reply, confirmed) = oneshot::channel();
            let copy = record.into_copy();
            copies.send((copy, reply)).await.map_err(|_| gone())?;
            window.push_back(confirmed);
            if window.len() >= WINDOW {
                confirm(window.pop_front()).await?;
            }
            copied += 1;
        }
        index += 1;
    }
    while let Some(next) = window.pop_front() {
        confirm(Some(next)).await?;
    }
    client.close().await;
    Ok(copied)
}

/// Copies in flight at most.
const WINDOW: usize = 512;

fn gone() -> ClientError {
    ClientError::Unreachable("the replica task is gone".into())
}

async fn confirm(next: Option<oneshot::Receiver<Result<(), String>>>) -> Result<(), ClientError> {
    let Some(next) = next else { return Ok(()) };
    next.await
        .map_err(|_| gone())?
        .map_err(ClientError::Unreachable)
}

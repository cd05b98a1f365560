//! Operator commands on held messages: list, fire now, purge, and the
//! figures of the status page. They are sent to the engine task and run
//! there between two parks (`engine/query.rs`), so they see exactly what
//! the engine holds.

use tokio::sync::oneshot;

use super::engine::query::{Command, Kind, Listed, Status, Target};
use super::RetryHandle;
use crate::store::Held;

/// The engine task is gone (nackd is stopping).
#[derive(Debug, thiserror::Error)]
#[error("the retry engine is not running")]
pub struct EngineGone;

impl RetryHandle {
    async fn ask<T>(
        &self,
        command: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, EngineGone> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(super::Command::Admin(command(reply)))
            .map_err(|_| EngineGone)?;
        answer.await.map_err(|_| EngineGone)
    }

    /// Held messages (of `vhost`/`queue` when given), soonest due first, at
    /// most `limit`, each read back from the store (`None` if it left
    /// meanwhile); and how many matched in all.
    pub async fn list(
        &self,
        vhost: Option<String>,
        named: Option<(String, Kind)>,
        limit: usize,
    ) -> Result<(Vec<(Listed, Option<Held>)>, usize), EngineGone> {
        let (listed, total, reader) = self
            .ask(|reply| Command::List {
                vhost,
                named,
                limit,
                reply,
            })
            .await?;
        let read = move || {
            listed
                .into_iter()
                .map(|l| (reader.read(l.loc()).ok(), l))
                .map(|(h, l)| (l, h))
                .collect()
        };
        let listed = tokio::task::spawn_blocking(read)
            .await
            .map_err(|_| EngineGone)?;
        Ok((listed, total))
    }

    /// Publishes the target's messages now; returns how many were due to go
    /// (a message already being published is not counted).
    pub async fn fire(&self, target: Target) -> Result<usize, EngineGone> {
        self.ask(|reply| Command::Fire { target, reply }).await
    }

    /// Forgets the target's messages (a delete record in the store).
    pub async fn purge(&self, target: Target) -> Result<usize, EngineGone> {
        self.ask(|reply| Command::Purge { target, reply }).await
    }

    /// Per-queue totals and the due chart.
    pub async fn status(&self) -> Result<Status, EngineGone> {
        self.ask(|reply| Command::Status { reply }).await
    }
}

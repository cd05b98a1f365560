//! One way to stop: every task and thread gets a [`CancellationToken`]
//! that is a child of its owner's, up to one root per nackd (made in
//! `Proxy::bind`), and whoever started it keeps a [`Stopper`] that cancels
//! the token and waits for the end. The sessions follow the same pattern
//! with a token (`force`) and a `TaskTracker`. Cancelling a parent reaches
//! every child, so nothing outlives the root; the order is kept by the
//! owners, which stop their parts one after the other before the root goes.
//!
//! The order, written once, in [`crate::server::Proxy::run`]: stop
//! accepting, drain the sessions (grace, then `force`), stop the retry
//! engine (it stops firing, stops its republishers, then closes the store
//! writer's queue and joins it: a worker fed by a queue ends once what was
//! queued before is written), stop the operations listener, cancel the
//! root (what is left: a broker check of a reload).

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// A task or thread that ends once its token is cancelled.
pub struct Stopper {
    name: &'static str,
    token: CancellationToken,
    join: Join,
}

enum Join {
    Task(tokio::task::JoinHandle<()>),
    Thread(std::thread::JoinHandle<()>),
    Done,
}

impl Stopper {
    /// A tokio task watching `token`.
    pub fn task(
        name: &'static str,
        token: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    ) -> Self {
        let join = Join::Task(task);
        Self { name, token, join }
    }

    /// A thread watching `token`.
    pub fn thread(
        name: &'static str,
        token: CancellationToken,
        thread: std::thread::JoinHandle<()>,
    ) -> Self {
        let join = Join::Thread(thread);
        Self { name, token, join }
    }

    /// Cancels the token and waits at most `limit` for the end.
    pub async fn stop(mut self, limit: Duration) {
        self.token.cancel();
        let ended = match std::mem::replace(&mut self.join, Join::Done) {
            Join::Task(task) => tokio::time::timeout(limit, async {
                let _ = task.await;
            })
            .await
            .is_ok(),
            Join::Thread(thread) => {
                // Joined on a thread of its own, not with spawn_blocking: a
                // runtime waits for its blocking tasks when dropped, so a
                // thread that never ends would keep nackd from exiting
                // whatever `limit` says.
                let (joined, done) = tokio::sync::oneshot::channel();
                std::thread::spawn(move || {
                    let _ = thread.join();
                    let _ = joined.send(());
                });
                tokio::time::timeout(limit, done).await.is_ok()
            }
            Join::Done => true,
        };
        match ended {
            true => debug!(name = self.name, "stopped"),
            false => warn!(name = self.name, ?limit, "did not stop in time"),
        }
    }
}

impl Drop for Stopper {
    /// Never stopped (a start that failed half way): it still ends.
    fn drop(&mut self) {
        self.token.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn stop_waits_for_the_thread_to_end() {
        let token = CancellationToken::new();
        let ended = Arc::new(AtomicBool::new(false));
        let (t, e) = (token.clone(), ended.clone());
        let thread = std::thread::spawn(move || {
            while !t.is_cancelled() {
                std::thread::sleep(Duration::from_millis(5));
            }
            std::thread::sleep(Duration::from_millis(50));
            e.store(true, Ordering::SeqCst);
        });
        Stopper::thread("t", token, thread)
            .stop(Duration::from_secs(5))
            .await;
        assert!(ended.load(Ordering::SeqCst), "joined, not just cancelled");
    }

    /// A thread that does not end in time is given up: nackd still exits.
    /// (main drops its runtime after `Proxy::run`; a runtime waits for
    /// every `spawn_blocking` task when dropped.)
    #[test]
    fn a_thread_that_does_not_stop_does_not_hold_the_runtime() {
        let (release, released) = std::sync::mpsc::channel::<()>();
        let stuck = std::thread::spawn(move || {
            let _ = released.recv();
        });
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let stopper = Stopper::thread("stuck", CancellationToken::new(), stuck);
        runtime.block_on(stopper.stop(Duration::from_millis(50)));
        let (dropped, done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(runtime);
            let _ = dropped.send(());
        });
        let exited = done.recv_timeout(Duration::from_secs(2)).is_ok();
        drop(release);
        assert!(exited, "the runtime waited for the stuck thread's join");
    }

    #[tokio::test]
    async fn a_dropped_stopper_still_cancels() {
        let token = CancellationToken::new();
        let task = tokio::spawn(token.clone().cancelled_owned());
        drop(Stopper::task("t", token.clone(), tokio::spawn(async {})));
        assert!(token.is_cancelled());
        task.await.unwrap();
    }
}

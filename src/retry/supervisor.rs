//! The retry engine's life, on its own thread. Without a replica: open the
//! store with a fresh head at once and run the engine, which parks new
//! nacks while the older segments are read beside it. With one: recover
//! the store, line it up with the replica, run the engine, and start again
//! from the store when the replica says the local copy went stale. Either
//! way clients are served from the start, and nacks claimed before the
//! engine runs wait in its queue (the broker keeps their deliveries).

use std::sync::Arc;

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, info_span, Instrument};

use super::engine::{Engine, Exit};
use super::{Command, Start};
use crate::replica::{self, Adopt, Replica};
use crate::store::{self, Log};
use nackd_core::ready::{Readiness, Ready};

/// Starts the engine's thread; returns where interception stands and the
/// thread, which ends once `stop` is cancelled (the store writer joined).
pub(super) fn spawn(
    start: Start,
    commands: mpsc::UnboundedReceiver<Command>,
    reseeds: mpsc::UnboundedReceiver<replica::ReseedReply>,
    stop: CancellationToken,
) -> (Arc<Readiness>, std::thread::JoinHandle<()>) {
    let ready = Readiness::new();
    let shared = ready.clone();
    // The engine and its republishers get a thread of their own, so that
    // timers fire and republishes go out on time however busy the session
    // workers are, and sessions never queue behind republishing.
    let thread = std::thread::Builder::new()
        .name("nackd-retry".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("the retry engine's runtime");
            let life = supervise(start, commands, reseeds, shared, stop);
            runtime.block_on(life.instrument(info_span!("engine")));
            // The republishers and the replica run on this runtime: they
            // end with it.
            runtime.shutdown_timeout(Duration::from_secs(1));
        })
        .expect("spawn the retry engine's thread");
    (ready, thread)
}

async fn supervise(
    start: Start,
    mut commands: mpsc::UnboundedReceiver<Command>,
    reseeds: mpsc::UnboundedReceiver<replica::ReseedReply>,
    ready: Arc<Readiness>,
    stop: CancellationToken,
) {
    if start.replica.is_none() {
        // Nobody reads reseeds: a reseed is refused at once ("no
        // [replica]") instead of waiting for an answer that never comes.
        drop(reseeds);
        return run_alone(start, commands, ready, stop).await;
    }
    let opened = tokio::select! {
        _ = stop.cancelled() => return,
        opened = open(&start) => opened,
    };
    let Some((mut log, mut recovered)) = opened else {
        ready.set(Ready::Failed);
        drop(reseeds);
        return drain(commands, stop).await;
    };
    let (adopt_tx, mut adopts) = mpsc::channel::<Adopt>(256);
    let replica = start
        .replica
        .clone()
        .map(|config| Replica::spawn(config, start.metrics.clone(), adopt_tx, start.clock.clone()));
    if let Some(replica) = &replica {
        tokio::spawn(forward_reseeds(reseeds, replica.clone()));
    }
    // What an adoption asked while no engine ran (see `between_engines`).
    let mut carried = Vec::new();
    loop {
        if let Some(replica) = &replica {
            let syncing = sync(replica, log, &ready);
            tokio::pin!(syncing);
            let synced = loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    synced = &mut syncing => break synced,
                    Some(adopt) = adopts.recv() => carried.extend(between_engines(adopt)),
                }
            };
            match synced {
                Ok(synced) => (log, recovered) = (synced.log, synced.recovered),
                Err(e) => {
                    error!(error = %e, "replica sync failed: not intercepting");
                    ready.set(Ready::Failed);
                    return drain(commands, stop).await;
                }
            }
        }
        info!(held = recovered.held.len(), "store ready: intercepting");
        let mut engine = Engine::new(log, recovered, &start, replica.clone(), ready.clone());
        engine.adopt_all(std::mem::take(&mut carried));
        match engine.run(&mut commands, &mut adopts, &stop).await {
            Exit::Stopped => return,
            Exit::Stale(back) => {
                ready.set(Ready::Recovering);
                log = back;
                recovered = Default::default();
            }
        }
    }
}

/// What an adoption asks while no engine runs (the store is being lined
/// up with the replica, which may wait for this instance's lease a long
/// time): a park is refused at once, so that the adoption, which waits
/// for every park's answer, ends (and is tried again) rather than waits
/// for a lease a standby may keep, holding the adopted instance's lease
/// meanwhile; a completion or release is kept for the next engine.
fn between_engines(adopt: Adopt) -> Option<Adopt> {
    match adopt {
        Adopt::Park { reply, .. } => {
            let _ = reply.send(Err(
                "the retry engine is restarting (its lease was lost)".into()
            ));
            None
        }
        kept => Some(kept),
    }
}

/// Lines the store up with the replica; meanwhile `/readyz` says why
/// nothing is intercepted: no lease yet, or a missing stream.
async fn sync(
    replica: &Replica,
    log: Log,
    ready: &Readiness,
) -> Result<replica::SyncOutcome, replica::ReplicaError> {
    let mut state = replica.state();
    let synced = replica.sync(log);
    tokio::pin!(synced);
    loop {
        ready.set(match *state.borrow_and_update() {
            replica::State::Missing | replica::State::Reseeding => Ready::NoReplica,
            _ => Ready::NoLease,
        });
        tokio::select! {
            synced = &mut synced => return synced,
            changed = state.changed() => if changed.is_err() {
                return synced.await;
            },
        }
    }
}

/// An operator's reseeds (from the admin API) go to the replica task.
async fn forward_reseeds(
    mut reseeds: mpsc::UnboundedReceiver<replica::ReseedReply>,
    replica: Replica,
) {
    while let Some(reply) = reseeds.recv().await {
        replica.reseed(reply);
    }
}

/// Without a replica: the store opens with a fresh head at once and the
/// engine parks new nacks while the older segments are read beside it.
async fn run_alone(
    start: Start,
    mut commands: mpsc::UnboundedReceiver<Command>,
    ready: Arc<Readiness>,
    stop: CancellationToken,
) {
    let (dir, options) = (start.dir.clone(), start.store);
    let now_ms = start.clock.now_ms();
    let open = move || {
        store::check_clock_mark(&dir, now_ms)?;
        Log::open_deferred(&dir, options)
    };
    let opened = tokio::select! {
        _ = stop.cancelled() => return,
        opened = tokio::task::spawn_blocking(open) => opened,
    };
    let (log, backlog) = match opened {
        Ok(Ok(opened)) => opened,
        Ok(Err(e)) => {
            error!(path = %start.dir.display(), error = %e, "cannot open the store: not intercepting");
            ready.set(Ready::Failed);
            return drain(commands, stop).await;
        }
        Err(e) => {
            error!(error = %e, "store open failed: not intercepting");
            ready.set(Ready::Failed);
            return drain(commands, stop).await;
        }
    };
    let recovered = store::Recovered {
        next_id: log.next_id(),
        ..Default::default()
    };
    info!("store open: intercepting (older segments are read meanwhile)");
    let mut engine = Engine::new(log, recovered, &start, None, ready);
    engine.read_backlog(backlog);
    let (_adopt_tx, mut adopts) = mpsc::channel::<Adopt>(1);
    engine.run(&mut commands, &mut adopts, &stop).await;
}

/// Opens and recovers the store, off the runtime (it reads every segment).
async fn open(start: &Start) -> Option<(Log, store::Recovered)> {
    let (dir, options) = (start.dir.clone(), start.store);
    let now_ms = start.clock.now_ms();
    let opened = tokio::task::spawn_blocking(move || {
        store::check_clock_mark(&dir, now_ms)?;
        Log::open(&dir, options)
    })
    .await;
    match opened {
        Ok(Ok((log, recovered))) => {
            start
                .metrics
                .store_damaged_bytes
                .inc_by(recovered.damaged_bytes());
            Some((log, recovered))
        }
        Ok(Err(e)) => {
            error!(path = %start.dir.display(), error = %e, "cannot open the store: not intercepting");
            None
        }
        Err(e) => {
            error!(error = %e, "store recovery failed: not intercepting");
            None
        }
    }
}

/// Without a store, answers what comes until nackd stops: parks are
/// refused (their nacks are deferred), admin calls get nothing.
async fn drain(mut commands: mpsc::UnboundedReceiver<Command>, stop: CancellationToken) {
    loop {
        let command = tokio::select! {
            _ = stop.cancelled() => return,
            command = commands.recv() => match command {
                Some(command) => command,
                None => return,
            },
        };
        if let Command::Park(park, reply) = command {
            let result = Err(store::StoreError::Io("the store is not open".into()));
            let _ = reply.send(super::Parked {
                key: park.key,
                result,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;
    use tokio::sync::oneshot;

    use super::between_engines;
    use crate::replica::{Adopt, Intent};
    use crate::store::{Held, Route};

    fn held() -> Held {
        Held {
            id: 7,
            vhost: Arc::from("/"),
            queue: Arc::from("q"),
            due_ms: 1_000,
            retry: 1,
            route: Route::Queue,
            on_return: None,
            header: Bytes::from_static(b"h"),
            body: Bytes::from_static(b"b"),
        }
    }

    /// While no engine runs, an adoption's park is refused at once (the
    /// adoption ends and is tried again, rather than holding the adopted
    /// instance's lease until this one's comes back); a completion and a
    /// release are kept for the next engine.
    #[test]
    fn between_engines_a_park_is_refused_and_the_rest_kept() {
        let (reply, mut answer) = oneshot::channel();
        let from = Intent {
            from: "gone".into(),
            epoch: 3,
        };
        let park = Adopt::Park {
            held: held(),
            from,
            reply,
        };
        assert!(between_engines(park).is_none(), "a park is not kept");
        let refused = answer.try_recv().expect("answered at once");
        assert_eq!(
            refused,
            Err("the retry engine is restarting (its lease was lost)".to_owned())
        );
        assert!(matches!(
            between_engines(Adopt::Complete(4)),
            Some(Adopt::Complete(4))
        ));
        assert!(matches!(
            between_engines(Adopt::Release(vec![5, 6])),
            Some(Adopt::Release(ids)) if ids == [5, 6]
        ));
    }
}

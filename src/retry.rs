//! The retry engine: one task that parks claimed messages (store, then
//! wheel), fires them when due to the republisher of their vhost, and
//! forgets them once the broker confirmed the republish.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::metrics::{Event, EventKind, Metrics};
use crate::net::Connector;
use crate::republish::{Credentials, Outcome, Publish, Report, Republisher};
use crate::store::{self, Held, Log, Reader, Recovered, Route, StoreError, WriteOp, Written};
use crate::wheel::Wheel;

mod admin;
mod ledger;
pub use admin::{DueBucket, Listed, QueueStatus, Status, Target};
use ledger::{Entry, Ledger};

/// Identifies a claimed delivery inside its session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClaimKey {
    /// Channel of the delivery.
    pub channel: u16,
    /// Which opening of that channel (channel numbers are reused).
    pub epoch: u64,
    /// Delivery tag.
    pub tag: u64,
}

/// A claimed message to park.
pub struct Park {
    /// Answer goes back with this key.
    pub key: ClaimKey,
    /// Where the answer goes (the session).
    pub reply: mpsc::UnboundedSender<Parked>,
    /// Virtual host.
    pub vhost: Arc<str>,
    /// Queue it was nacked on.
    pub queue: Arc<str>,
    /// How long to hold it.
    pub delay: Duration,
    /// Retry number in its headers.
    pub retry: u32,
    /// Where it goes when due.
    pub route: Route,
    /// Where it goes if returned as unroutable.
    pub on_return: Option<Route>,
    /// Rewritten content header payload.
    pub header: Bytes,
    /// Body.
    pub body: Bytes,
}

/// The engine's answer to a [`Park`].
#[derive(Debug)]
pub struct Parked {
    /// The claim.
    pub key: ClaimKey,
    /// The store id once durable, or why it could not be stored.
    pub result: Result<u64, StoreError>,
}

enum Command {
    Park(Park),
    Cancel(u64),
    Admin(admin::Command),
}

/// Handle sessions use to park messages (and operators to inspect them).
#[derive(Clone)]
pub struct RetryHandle {
    tx: mpsc::UnboundedSender<Command>,
    reader: Reader,
}

impl RetryHandle {
    /// Asks the engine to park a message; `false` if the engine is gone.
    pub fn park(&self, park: Park) -> bool {
        self.tx.send(Command::Park(park)).is_ok()
    }

    /// Drops a parked message (its delivery went back to the broker anyway).
    pub fn cancel(&self, id: u64) {
        let _ = self.tx.send(Command::Cancel(id));
    }
}

/// Milliseconds since the Unix epoch, read from a monotonic clock.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    origin: Instant,
    origin_ms: u64,
}

impl Clock {
    /// A clock starting now.
    pub fn start() -> Self {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Self {
            origin: Instant::now(),
            origin_ms: since_epoch.as_millis() as u64,
        }
    }

    /// Now, in ms since the epoch.
    pub fn now_ms(&self) -> u64 {
        self.origin_ms + self.origin.elapsed().as_millis() as u64
    }

    /// The instant at which `now_ms()` reaches `ms` (rounded up: never early).
    pub fn instant_at(&self, ms: u64) -> Instant {
        self.origin + Duration::from_millis(ms.saturating_sub(self.origin_ms))
    }
}

/// What the engine keeps of a message while its put is being written.
#[derive(Clone, Copy)]
struct Meta {
    queue: u32,
    size: u32,
    retry: u32,
    dead_letter: bool,
}

/// Why a put was made: to answer a session, or to re-route a message.
enum PutCtx {
    Park {
        key: ClaimKey,
        reply: mpsc::UnboundedSender<Parked>,
        meta: Meta,
    },
    Reroute,
}

/// A wheel entry: store id and the schedule token it was inserted with.
type Slot = (u64, u32);

/// Starts the engine over an opened log and what its recovery found.
pub fn spawn(
    log: Log,
    recovered: Recovered,
    connector: Connector,
    login: Credentials,
    metrics: Arc<Metrics>,
) -> RetryHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let (reports_tx, reports) = mpsc::unbounded_channel();
    let (written_tx, written) = mpsc::unbounded_channel();
    let clock = Clock::start();
    let reader = log.reader();
    let mut engine = Engine {
        writer: store::spawn_writer(log, written_tx, metrics.clone()),
        reader: reader.clone(),
        ledger: Ledger::new(metrics.clone(), recovered.held.len()),
        wheel: Wheel::new(clock.now_ms()),
        clock,
        republishers: HashMap::new(),
        connector,
        login,
        reports_tx,
        next_id: recovered.next_id,
        metrics,
    };
    let queues: Vec<u32> = recovered
        .queues
        .iter()
        .map(|(vhost, queue)| engine.ledger.intern(vhost, queue))
        .collect();
    // Oldest first: overdue messages fire in due order.
    for ((id, due, loc), m) in recovered.held.into_iter().zip(recovered.meta) {
        engine.ledger.insert(
            id,
            Entry::new(
                loc,
                due,
                queues[m.queue as usize],
                m.size,
                m.retry,
                m.dead_letter,
            ),
        );
        engine.wheel.insert(due, (id, 0));
    }
    // The engine and its republishers get a thread of their own, so that
    // timers fire and republishes go out on time however busy the session
    // workers are, and sessions never queue behind republishing.
    std::thread::Builder::new()
        .name("nackd-retry".into())
        .spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("the retry engine's runtime")
                .block_on(engine.run(rx, reports, written));
        })
        .expect("spawn the retry engine's thread");
    RetryHandle { tx, reader }
}

struct Engine {
    writer: std::sync::mpsc::Sender<WriteOp<PutCtx>>,
    reader: Reader,
    ledger: Ledger,
    wheel: Wheel<Slot>,
    clock: Clock,
    republishers: HashMap<Arc<str>, Republisher>,
    connector: Connector,
    login: Credentials,
    reports_tx: mpsc::UnboundedSender<Report>,
    next_id: u64,
    metrics: Arc<Metrics>,
}

impl Engine {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut reports: mpsc::UnboundedReceiver<Report>,
        mut written: mpsc::UnboundedReceiver<Written<PutCtx>>,
    ) {
        loop {
            let wake = self
                .wheel
                .next_deadline()
                .map(|ms| self.clock.instant_at(ms));
            tokio::select! {
                command = commands.recv() => match command {
                    Some(Command::Park(park)) => self.park(park),
                    Some(Command::Cancel(id)) => self.forget(id),
                    Some(Command::Admin(command)) => self.on_admin(command),
                    None => return,
                },
                Some(w) = written.recv() => self.on_written(w),
                Some(report) = reports.recv() => self.on_report(report),
                _ = sleep_until(wake), if wake.is_some() => {}
            }
            self.fire();
        }
    }

    fn park(&mut self, park: Park) {
        let id = self.next_id;
        self.next_id += 1;
        let meta = Meta {
            queue: self.ledger.intern(&park.vhost, &park.queue),
            size: (park.header.len() + park.body.len()) as u32,
            retry: park.retry,
            dead_letter: park.route != Route::Queue,
        };
        let held = Held {
            id,
            vhost: park.vhost,
            queue: park.queue,
            // Rounded up: the clock reads whole ms, so the part of the current
            // ms already gone would otherwise make the delay up to 1 ms short.
            due_ms: self.clock.now_ms() + 1 + park.delay.as_millis() as u64,
            retry: park.retry,
            route: park.route,
            on_return: park.on_return,
            header: park.header,
            body: park.body,
        };
        let ctx = PutCtx::Park {
            key: park.key,
            reply: park.reply,
            meta,
        };
        if let Err(std::sync::mpsc::SendError(WriteOp::Put {
            ctx: PutCtx::Park { key, reply, .. },
            ..
        })) = self.writer.send(WriteOp::Put {
            held,
            replaces: None,
            ctx,
        }) {
            let _ = reply.send(Parked {
                key,
                result: Err(StoreError::Io("store thread is gone".into())),
            });
        }
    }

    fn on_written(&mut self, w: Written<PutCtx>) {
        match (w.ctx, w.result) {
            (PutCtx::Park { key, reply, meta }, Ok(loc)) => {
                let entry = Entry::new(
                    loc,
                    w.due_ms,
                    meta.queue,
                    meta.size,
                    meta.retry,
                    meta.dead_letter,
                );
                self.ledger.insert(w.id, entry);
                self.schedule(w.id, w.due_ms);
                let _ = reply.send(Parked {
                    key,
                    result: Ok(w.id),
                });
            }
            (PutCtx::Park { key, reply, .. }, Err(e)) => {
                let _ = reply.send(Parked {
                    key,
                    result: Err(e),
                });
            }
            (PutCtx::Reroute, Ok(loc)) => {
                let Some(entry) = self.ledger.get_mut(w.id) else {
                    return;
                }; // purged meanwhile
                entry.loc = loc;
                entry.dead_letter = true;
                entry.inflight = false;
                // The return was a failed attempt: its lateness was observed already.
                entry.attempts = entry.attempts.saturating_add(1);
                self.schedule(w.id, self.clock.now_ms());
            }
            (PutCtx::Reroute, Err(e)) => {
                self.again(w.id, &format!("cannot store the re-route ({e})"))
            }
        }
    }

    /// (Re)arms the wheel for `id`; wheel entries armed before are stale.
    fn schedule(&mut self, id: u64, at_ms: u64) {
        let Some(entry) = self.ledger.get_mut(id) else {
            return;
        };
        entry.token = entry.token.wrapping_add(1);
        self.wheel.insert(at_ms, (id, entry.token));
    }

    fn forget(&mut self, id: u64) {
        if let Some(entry) = self.ledger.remove(id) {
            let _ = self.writer.send(WriteOp::Del { id, loc: entry.loc });
        }
    }

    fn fire(&mut self) {
        let now = self.clock.now_ms();
        let mut due = Vec::new();
        self.wheel.poll(now, &mut due);
        for (id, token) in due {
            let Some(entry) = self.ledger.get(id).copied() else {
                continue;
            }; // forgotten meanwhile
            if entry.token != token || entry.inflight {
                continue; // rescheduled (fired now, backed off) or already publishing
            }
            let held = match self.reader.read(entry.loc) {
                Ok(held) => held,
                Err(e) => {
                    self.again(id, &format!("cannot read the held message ({e})"));
                    continue;
                }
            };
            let late_ms = now.saturating_sub(entry.due_ms);
            if entry.attempts == 0 && !entry.forced {
                Metrics::observe(&self.metrics.lateness, Duration::from_millis(late_ms));
            }
            if let Some(e) = self.ledger.get_mut(id) {
                e.inflight = true;
            }
            self.metrics.published.inc();
            debug!(id, queue = %held.queue, late_ms, "due");
            let vhost = held.vhost.clone();
            let publish = Publish {
                id,
                queue: held.queue,
                route: held.route,
                header: held.header,
                body: held.body,
            };
            let metrics = &self.metrics;
            let republisher = self.republishers.entry(vhost.clone()).or_insert_with(|| {
                Republisher::spawn(
                    vhost,
                    self.connector.clone(),
                    self.login.clone(),
                    self.reports_tx.clone(),
                    metrics.clone(),
                )
            });
            republisher.publish(publish);
        }
    }

    fn on_report(&mut self, report: Report) {
        let id = report.id;
        match report.outcome {
            Outcome::Confirmed => self.on_confirmed(id),
            Outcome::Nacked => {
                self.metrics.nacked.inc();
                self.again(id, "broker nacked the republish")
            }
            Outcome::Returned => {
                self.metrics.returned.inc();
                self.on_returned(id)
            }
        }
    }

    fn on_confirmed(&mut self, id: u64) {
        self.metrics.confirmed.inc();
        if let Some(entry) = self.ledger.get(id).copied() {
            let kind = match entry.dead_letter {
                true => {
                    self.metrics.exhausted_dead_letter.inc();
                    EventKind::ExhaustedDeadLetter
                }
                false => EventKind::Retried,
            };
            let (vhost, queue) = self.ledger.name(entry.queue);
            let at_ms = self.clock.now_ms();
            let (vhost, queue, retry) = (vhost.to_string(), queue.to_string(), entry.retry);
            self.metrics.recent.push(Event {
                at_ms,
                kind,
                vhost,
                queue,
                retry,
            });
        }
        self.forget(id);
    }

    fn on_returned(&mut self, id: u64) {
        let Some(entry) = self.ledger.get(id).copied() else {
            return;
        };
        let Ok(mut held) = self.reader.read(entry.loc) else {
            return self.again(id, "returned; cannot read it back");
        };
        match (&held.route, held.on_return.clone()) {
            (Route::Queue, Some(dead_letter)) => {
                warn!(id, queue = %held.queue, "queue is gone: sending to the dead-letter exchange");
                self.metrics.rerouted.inc();
                held.route = dead_letter;
                let _ = self.writer.send(WriteOp::Put {
                    held,
                    replaces: Some(entry.loc),
                    ctx: PutCtx::Reroute,
                });
            }
            _ => self.again(id, "returned as unroutable (queue or exchange missing)"),
        }
    }

    /// Keeps the message and tries again later, backing off.
    fn again(&mut self, id: u64, why: &str) {
        let Some(entry) = self.ledger.get_mut(id) else {
            return;
        }; // purged meanwhile
        entry.inflight = false;
        entry.attempts = entry.attempts.saturating_add(1);
        let attempt = entry.attempts;
        let backoff =
            Duration::from_millis(100 * (1u64 << attempt.min(9))).min(Duration::from_secs(30));
        warn!(id, attempt, retry_in = ?backoff, "{why}; keeping the message");
        self.schedule(id, self.clock.now_ms() + backoff.as_millis() as u64);
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

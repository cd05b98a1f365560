//! The retry engine: one task that parks claimed messages (store, then
//! wheel), fires them when due to the republisher of their vhost, and
//! forgets them once the broker confirmed the republish.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::net::Connector;
use crate::republish::{Credentials, Outcome, Publish, Report, Republisher};
use crate::store::{self, Held, Loc, Log, Reader, Recovered, Route, StoreError, WriteOp, Written};
use crate::wheel::Wheel;

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
}

/// Handle sessions use to park messages.
#[derive(Clone)]
pub struct RetryHandle {
    tx: mpsc::UnboundedSender<Command>,
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
        let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
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

/// Why a put was made: to answer a session, or to re-route a message.
enum PutCtx {
    Park {
        key: ClaimKey,
        reply: mpsc::UnboundedSender<Parked>,
    },
    Reroute,
}

/// Starts the engine over an opened log and what its recovery found.
pub fn spawn(log: Log, recovered: Recovered, connector: Connector, login: Credentials) -> RetryHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let (reports_tx, reports) = mpsc::unbounded_channel();
    let (written_tx, written) = mpsc::unbounded_channel();
    let clock = Clock::start();
    let reader = log.reader();
    let mut engine = Engine {
        writer: store::spawn_writer(log, written_tx),
        reader,
        index: HashMap::with_capacity(recovered.held.len()),
        wheel: Wheel::new(clock.now_ms()),
        clock,
        republishers: HashMap::new(),
        connector,
        login,
        reports_tx,
        attempts: HashMap::new(),
        next_id: recovered.next_id,
    };
    // Oldest first: overdue messages fire in due order.
    for (id, due, loc) in recovered.held {
        engine.index.insert(id, loc);
        engine.wheel.insert(due, id);
    }
    tokio::spawn(engine.run(rx, reports, written));
    RetryHandle { tx }
}

struct Engine {
    writer: std::sync::mpsc::Sender<WriteOp<PutCtx>>,
    reader: Reader,
    index: HashMap<u64, Loc>,
    wheel: Wheel<u64>,
    clock: Clock,
    republishers: HashMap<Arc<str>, Republisher>,
    connector: Connector,
    login: Credentials,
    reports_tx: mpsc::UnboundedSender<Report>,
    attempts: HashMap<u64, u32>,
    next_id: u64,
}

impl Engine {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut reports: mpsc::UnboundedReceiver<Report>,
        mut written: mpsc::UnboundedReceiver<Written<PutCtx>>,
    ) {
        loop {
            let wake = self.wheel.next_deadline().map(|ms| self.clock.instant_at(ms));
            tokio::select! {
                command = commands.recv() => match command {
                    Some(Command::Park(park)) => self.park(park),
                    Some(Command::Cancel(id)) => self.forget(id),
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
        let held = Held {
            id,
            vhost: park.vhost,
            queue: park.queue,
            due_ms: self.clock.now_ms() + park.delay.as_millis() as u64,
            retry: park.retry,
            route: park.route,
            on_return: park.on_return,
            header: park.header,
            body: park.body,
        };
        let ctx = PutCtx::Park { key: park.key, reply: park.reply };
        if let Err(std::sync::mpsc::SendError(WriteOp::Put { ctx: PutCtx::Park { key, reply }, .. })) =
            self.writer.send(WriteOp::Put { held, replaces: None, ctx })
        {
            let _ = reply.send(Parked { key, result: Err(StoreError::Io("store thread is gone".into())) });
        }
    }

    fn on_written(&mut self, w: Written<PutCtx>) {
        match (w.ctx, w.result) {
            (PutCtx::Park { key, reply }, Ok(loc)) => {
                self.index.insert(w.id, loc);
                self.wheel.insert(w.due_ms, w.id);
                let _ = reply.send(Parked { key, result: Ok(w.id) });
            }
            (PutCtx::Park { key, reply }, Err(e)) => {
                let _ = reply.send(Parked { key, result: Err(e) });
            }
            (PutCtx::Reroute, Ok(loc)) => {
                self.index.insert(w.id, loc);
                self.wheel.insert(self.clock.now_ms(), w.id);
            }
            (PutCtx::Reroute, Err(e)) => self.again(w.id, &format!("cannot store the re-route ({e})")),
        }
    }

    fn forget(&mut self, id: u64) {
        self.attempts.remove(&id);
        if let Some(loc) = self.index.remove(&id) {
            let _ = self.writer.send(WriteOp::Del { id, loc });
        }
    }

    fn read(&self, id: u64) -> Option<Result<Held, StoreError>> {
        self.index.get(&id).map(|loc| self.reader.read(*loc))
    }

    fn fire(&mut self) {
        let now = self.clock.now_ms();
        let mut due = Vec::new();
        self.wheel.poll(now, &mut due);
        for id in due {
            let held = match self.read(id) {
                None => continue, // forgotten meanwhile
                Some(Ok(held)) => held,
                Some(Err(e)) => {
                    self.again(id, &format!("cannot read the held message ({e})"));
                    continue;
                }
            };
            debug!(id, queue = %held.queue, late_ms = now.saturating_sub(held.due_ms), "due");
            let vhost = held.vhost.clone();
            let publish = Publish { id, queue: held.queue, route: held.route, header: held.header, body: held.body };
            let republisher = self.republishers.entry(vhost.clone()).or_insert_with(|| {
                Republisher::spawn(vhost, self.connector.clone(), self.login.clone(), self.reports_tx.clone())
            });
            republisher.publish(publish);
        }
    }

    fn on_report(&mut self, report: Report) {
        let id = report.id;
        match report.outcome {
            Outcome::Confirmed => self.forget(id),
            Outcome::Nacked => self.again(id, "broker nacked the republish"),
            Outcome::Returned => self.on_returned(id),
        }
    }

    fn on_returned(&mut self, id: u64) {
        let (Some(Ok(mut held)), Some(loc)) = (self.read(id), self.index.get(&id).copied()) else { return };
        match (&held.route, held.on_return.clone()) {
            (Route::Queue, Some(dead_letter)) => {
                warn!(id, queue = %held.queue, "queue is gone: sending to the dead-letter exchange");
                held.route = dead_letter;
                let _ = self.writer.send(WriteOp::Put { held, replaces: Some(loc), ctx: PutCtx::Reroute });
            }
            _ => self.again(id, "returned as unroutable (queue or exchange missing)"),
        }
    }

    /// Keeps the message and tries again later, backing off.
    fn again(&mut self, id: u64, why: &str) {
        let attempt = self.attempts.entry(id).or_insert(0);
        *attempt += 1;
        let backoff = Duration::from_millis(100 * (1u64 << (*attempt).min(9))).min(Duration::from_secs(30));
        warn!(id, attempt = *attempt, retry_in = ?backoff, "{why}; keeping the message");
        self.wheel.insert(self.clock.now_ms() + backoff.as_millis() as u64, id);
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

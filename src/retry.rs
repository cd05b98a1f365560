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
use crate::store::{Held, Route, Store, StoreError};
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

/// Starts the engine task over `store`.
pub fn spawn(store: Box<dyn Store>, connector: Connector, login: Credentials) -> RetryHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let (reports_tx, reports) = mpsc::unbounded_channel();
    let clock = Clock::start();
    let engine = Engine {
        store,
        wheel: Wheel::new(clock.now_ms()),
        clock,
        republishers: HashMap::new(),
        connector,
        login,
        reports_tx,
        attempts: HashMap::new(),
        next_id: 1,
    };
    tokio::spawn(engine.run(rx, reports));
    RetryHandle { tx }
}

struct Engine {
    store: Box<dyn Store>,
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
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>, mut reports: mpsc::UnboundedReceiver<Report>) {
        loop {
            let wake = self.wheel.next_deadline().map(|ms| self.clock.instant_at(ms));
            tokio::select! {
                command = commands.recv() => match command {
                    Some(Command::Park(park)) => self.park(park),
                    Some(Command::Cancel(id)) => self.forget(id),
                    None => return,
                },
                Some(report) = reports.recv() => self.on_report(report),
                _ = sleep_until(wake), if wake.is_some() => {}
            }
            self.fire();
        }
    }

    fn park(&mut self, park: Park) {
        let id = self.next_id;
        self.next_id += 1;
        let due_ms = self.clock.now_ms() + park.delay.as_millis() as u64;
        let held = Held {
            id,
            vhost: park.vhost,
            queue: park.queue,
            due_ms,
            retry: park.retry,
            route: park.route,
            on_return: park.on_return,
            header: park.header,
            body: park.body,
        };
        let result = self.store.put(held).map(|()| {
            self.wheel.insert(due_ms, id);
            id
        });
        let _ = park.reply.send(Parked { key: park.key, result });
    }

    fn forget(&mut self, id: u64) {
        self.attempts.remove(&id);
        if let Err(e) = self.store.remove(id) {
            warn!(id, error = %e, "cannot remove a held message");
        }
    }

    fn fire(&mut self) {
        let now = self.clock.now_ms();
        let mut due = Vec::new();
        self.wheel.poll(now, &mut due);
        for id in due {
            let Some(held) = self.store.get(id) else { continue };
            debug!(id, queue = %held.queue, late_ms = now.saturating_sub(held.due_ms), "due");
            let publish = Publish {
                id,
                queue: held.queue.clone(),
                route: held.route.clone(),
                header: held.header.clone(),
                body: held.body.clone(),
            };
            let vhost = held.vhost.clone();
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
        let Some(held) = self.store.get(id) else { return };
        match (&held.route, &held.on_return) {
            (Route::Queue, Some(dead_letter)) => {
                warn!(id, queue = %held.queue, "queue is gone: sending to the dead-letter exchange");
                let mut held = held.clone();
                held.route = dead_letter.clone();
                if let Err(e) = self.store.put(held) {
                    warn!(id, error = %e, "cannot re-route a held message");
                }
                self.wheel.insert(self.clock.now_ms(), id);
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

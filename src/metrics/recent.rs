//! The last retries and exhaustions, kept for the status page.

use std::collections::VecDeque;
use std::sync::Mutex;

/// Events kept.
pub const KEPT: usize = 50;

/// What happened to a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// Republished to the tail of its queue and confirmed.
    Retried,
    /// Schedule used up: handed back with `basic.reject` (the queue's DLX applies).
    ExhaustedReject,
    /// Published to its `on_exhausted` exchange and confirmed.
    ExhaustedDeadLetter,
}

/// One retry or exhaustion.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Event {
    /// When, in ms since the Unix epoch.
    pub at_ms: u64,
    /// What happened.
    pub kind: EventKind,
    /// Virtual host.
    pub vhost: String,
    /// Queue.
    pub queue: String,
    /// Retry number the message carried.
    pub retry: u32,
}

/// A bounded list of recent events, newest last.
#[derive(Debug, Default)]
pub struct Recent(Mutex<VecDeque<Event>>);

impl Recent {
    /// Adds an event, dropping the oldest beyond `KEPT`.
    pub fn push(&self, event: Event) {
        let mut events = self.0.lock().expect("recent events lock");
        if events.len() == KEPT {
            events.pop_front();
        }
        events.push_back(event);
    }

    /// The events, newest first.
    pub fn newest_first(&self) -> Vec<Event> {
        self.0
            .lock()
            .expect("recent events lock")
            .iter()
            .rev()
            .cloned()
            .collect()
    }
}

//! Where held messages are kept until they are republished and confirmed.
//!
//! The retry engine writes a message here before nackd acks it upstream and
//! removes it only after the broker confirmed the republish. This first
//! store keeps messages in memory: a restart of nackd loses what it holds.
//! The durable store replaces it behind the same [`Store`] trait.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

/// Where a held message goes when it is due.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// Exchange `""`, routing key = the original queue: its tail.
    Queue,
    /// A dead-letter exchange (`on_exhausted = { exchange, routing_key }`).
    Exchange {
        /// Exchange name.
        exchange: String,
        /// Routing key.
        routing_key: String,
    },
}

/// A message nackd holds.
#[derive(Clone, Debug)]
pub struct Held {
    /// Store id.
    pub id: u64,
    /// Virtual host it came from and goes back to.
    pub vhost: Arc<str>,
    /// Queue it was nacked on.
    pub queue: Arc<str>,
    /// When it is due, in ms since the Unix epoch.
    pub due_ms: u64,
    /// The retry number written in its headers.
    pub retry: u32,
    /// Where it goes when due.
    pub route: Route,
    /// Where it goes if the broker returns it as unroutable.
    pub on_return: Option<Route>,
    /// Content header payload, headers already rewritten.
    pub header: Bytes,
    /// Body.
    pub body: Bytes,
}

impl Held {
    /// Bytes it takes (header + body).
    pub fn size(&self) -> usize {
        self.header.len() + self.body.len()
    }
}

/// Why the store cannot take or give a message.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store is over its configured size.
    #[error("store full: {0}")]
    Full(String),
    /// An I/O error.
    #[error("store I/O error: {0}")]
    Io(String),
}

/// A store of held messages.
pub trait Store: Send + 'static {
    /// Keeps `held`; returns once it is as durable as the store can make it.
    fn put(&mut self, held: Held) -> Result<(), StoreError>;
    /// Forgets a message (after its republish was confirmed).
    fn remove(&mut self, id: u64) -> Result<Option<Held>, StoreError>;
    /// Looks a message up.
    fn get(&self, id: u64) -> Option<&Held>;
    /// Every held message (recovery, listings).
    fn all(&self) -> Box<dyn Iterator<Item = &Held> + '_>;
}

/// The in-memory store.
#[derive(Debug, Default)]
pub struct MemoryStore {
    held: HashMap<u64, Held>,
    max_bytes: Option<usize>,
    bytes: usize,
}

impl MemoryStore {
    /// A store refusing new messages beyond `max_bytes` (if set).
    pub fn new(max_bytes: Option<usize>) -> Self {
        Self {
            max_bytes,
            ..Self::default()
        }
    }
}

impl Store for MemoryStore {
    fn put(&mut self, held: Held) -> Result<(), StoreError> {
        let size = held.size();
        if let Some(max) = self.max_bytes {
            if self.bytes + size > max {
                return Err(StoreError::Full(format!("{} + {size} bytes > {max}", self.bytes)));
            }
        }
        self.bytes += size;
        if let Some(old) = self.held.insert(held.id, held) {
            self.bytes -= old.size();
        }
        Ok(())
    }

    fn remove(&mut self, id: u64) -> Result<Option<Held>, StoreError> {
        let old = self.held.remove(&id);
        if let Some(old) = &old {
            self.bytes -= old.size();
        }
        Ok(old)
    }

    fn get(&self, id: u64) -> Option<&Held> {
        self.held.get(&id)
    }

    fn all(&self) -> Box<dyn Iterator<Item = &Held> + '_> {
        Box::new(self.held.values())
    }
}

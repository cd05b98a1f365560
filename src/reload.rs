//! Hot reload of the `[[policy]]` tables on SIGHUP.
//!
//! The policies live in a `watch` channel: every session holds a receiver
//! and, on its next delivery, sees that the version moved, takes the new
//! set and drops its per-queue cache. A message already captured or held
//! keeps the policy (and the due time) it was taken with. An invalid file
//! changes nothing: the error names the key, the old policies stay.

use std::path::Path;
use std::sync::Arc;

use tokio::sync::watch;

use crate::config::{Config, ConfigError};
use crate::metrics::Metrics;
use crate::policy::Policies;

/// The policies in force, shared by every session.
#[derive(Debug)]
pub struct LivePolicies {
    tx: watch::Sender<Arc<Policies>>,
}

impl LivePolicies {
    /// Starts with `policies`.
    pub fn new(policies: Policies) -> Arc<Self> {
        Arc::new(Self {
            tx: watch::Sender::new(Arc::new(policies)),
        })
    }

    /// A receiver for one session.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Policies>> {
        self.tx.subscribe()
    }

    /// Puts `policies` in force for every session.
    pub fn replace(&self, policies: Policies) {
        self.tx.send_replace(Arc::new(policies));
    }
}

/// Why a reload was refused (the old policies stay in force).
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The file cannot be read or is invalid.
    #[error("{0}")]
    Config(#[from] ConfigError),
    /// nackd runs without a store or engine: adding policies needs a restart.
    #[error("nackd started without [[policy]] tables, so it runs no store and no retry engine: restart it to intercept")]
    NotIntercepting,
}

/// Reloads the policies of a running proxy from its configuration file.
#[derive(Clone, Debug)]
pub struct Reloader {
    live: Option<Arc<LivePolicies>>,
    metrics: Arc<Metrics>,
}

impl Reloader {
    /// A reloader for `live` (`None`: the proxy intercepts nothing).
    pub fn new(live: Option<Arc<LivePolicies>>, metrics: Arc<Metrics>) -> Self {
        Self { live, metrics }
    }

    /// Reads `path` and puts its `[[policy]]` tables in force; returns how
    /// many there are. Other sections are not reloaded (they need a restart).
    pub fn reload(&self, path: &Path) -> Result<usize, ReloadError> {
        let result = self.apply(path);
        match &result {
            Ok(_) => self.metrics.reloads_ok.inc(),
            Err(_) => self.metrics.reloads_failed.inc(),
        };
        result
    }

    fn apply(&self, path: &Path) -> Result<usize, ReloadError> {
        let config = Config::load(path)?;
        match &self.live {
            Some(live) => live.replace(Policies::new(&config.policies)),
            None if config.policies.is_empty() => {}
            None => return Err(ReloadError::NotIntercepting),
        }
        Ok(config.policies.len())
    }
}

//! Hot reload of the `[[policy]]` tables on SIGHUP.
//!
//! The policies live in a [`LivePolicies`] cell: every session holds a view
//! and, on its next delivery, sees that the version moved, takes the new
//! set and drops its per-queue cache. A message already captured or held
//! keeps the policy (and the due time) it was taken with. An invalid file
//! changes nothing: the error names the key, the old policies stay.
//!
//! At startup and after each reload, [`BrokerCheck`] logs in to every
//! vhost the policies intercept for (what `/readyz` reports under
//! `"republish"`), declares every exchange the policies send exhausted
//! messages to (passively, on a connection of its own) and warns, naming
//! the policy, about each one the broker does not have.

use std::path::Path;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{Config, ConfigError, GoneAction, OnExhausted};
use crate::metrics::Metrics;
use crate::net::Connector;
use crate::retry::republish::{check_exchanges, Credentials, ExchangeToCheck, LoginCheck};
use nackd_core::policy::Policies;

pub use nackd_core::policy::LivePolicies;

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
    check: Option<BrokerCheck>,
}

impl Reloader {
    /// A reloader for `live` (`None`: the proxy intercepts nothing).
    pub fn new(live: Option<Arc<LivePolicies>>, metrics: Arc<Metrics>) -> Self {
        Self {
            live,
            metrics,
            check: None,
        }
    }

    /// Checks the logins and exchanges of each reloaded file with `check`.
    pub fn with_check(mut self, check: BrokerCheck) -> Self {
        self.check = Some(check);
        self
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
        if let Some(check) = &self.check {
            check.spawn(&config);
        }
        Ok(config.policies.len())
    }
}

/// Checks, in the background, what a configuration needs from the broker:
/// that the republish login gets into each policy vhost (see
/// [`LoginCheck`]), and that the exchanges it sends messages to exist
/// (`on_exhausted` of each policy, and `republish.queue_gone.exchange`).
/// Each missing exchange is a warning naming the setting, and counts in
/// `nackd_policy_exchanges_missing`.
#[derive(Clone)]
pub struct BrokerCheck {
    connector: Connector,
    login: Credentials,
    metrics: Arc<Metrics>,
    logins: LoginCheck,
    /// nackd's stop: ends the checks.
    stop: CancellationToken,
}

impl std::fmt::Debug for BrokerCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerCheck")
            .field("upstream", &self.connector.address())
            .field("user", &self.login.username)
            .finish()
    }
}

impl BrokerCheck {
    /// A check through `connector`, logged in as the republisher, until
    /// `stop` (nackd's shutdown) is cancelled.
    pub fn new(
        connector: Connector,
        login: Credentials,
        metrics: Arc<Metrics>,
        stop: CancellationToken,
    ) -> Self {
        Self {
            logins: LoginCheck::new(
                connector.clone(),
                login.clone(),
                metrics.clone(),
                stop.clone(),
            ),
            connector,
            login,
            metrics,
            stop,
        }
    }

    /// Starts checking the logins and exchanges `config` needs (needs a
    /// tokio runtime; outside one, only marks its vhosts `checking`).
    pub fn spawn(&self, config: &Config) {
        let mut vhosts: Vec<String> = config.policies.iter().map(|p| p.vhost.clone()).collect();
        if config.delayed_enabled() {
            vhosts.extend(config.delayed_exchanges.iter().map(|d| d.vhost.clone()));
        }
        vhosts.sort_unstable();
        vhosts.dedup();
        self.logins.spawn(vhosts);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let targets = exchanges_named(config);
        let queues: Vec<String> = config
            .policies
            .iter()
            .map(|p| format!("{:?}", p.queues().collect::<Vec<_>>()))
            .collect();
        let this = self.clone();
        runtime.spawn(async move {
            let checked = check_exchanges(&this.connector, &this.login, &targets);
            let missing = tokio::select! {
                _ = this.stop.cancelled() => return,
                missing = checked => missing,
            };
            let unchecked = missing.iter().filter(|m| m.reply.starts_with("cannot check")).count();
            this.metrics
                .exchanges_missing
                .set((missing.len() - unchecked) as i64);
            for m in &missing {
                let c = &m.checked;
                let of = policy_index(&c.key)
                    .and_then(|i| queues.get(i))
                    .map_or(String::new(), |q| format!(" (queues {q})"));
                if m.reply.starts_with("cannot check") {
                    warn!(setting = %c.key, vhost = %c.vhost, exchange = %c.exchange, reply = %m.reply, "{}{of}: could not check that exchange {:?} exists: {}", c.key, c.exchange, m.reply);
                    continue;
                }
                warn!(
                    setting = %c.key, vhost = %c.vhost, exchange = %c.exchange, reply = %m.reply,
                    "{}{of}: exchange {:?} does not exist in vhost {:?} ({}): the messages it should take are set aside (kept) until it does",
                    c.key, c.exchange, c.vhost, m.reply
                );
            }
            if missing.is_empty() && !targets.is_empty() {
                info!(exchanges = targets.len(), "every exchange the configuration names exists");
            }
        });
    }
}

/// `policy[3].on_exhausted` → 3.
fn policy_index(key: &str) -> Option<usize> {
    key.strip_prefix("policy[")?.split(']').next()?.parse().ok()
}

/// Every exchange a configuration sends messages to, with the setting that names it.
pub fn exchanges_named(config: &Config) -> Vec<ExchangeToCheck> {
    let mut out: Vec<ExchangeToCheck> = config
        .policies
        .iter()
        .enumerate()
        .filter_map(|(i, p)| match &p.on_exhausted {
            OnExhausted::DeadLetter { exchange, .. } => Some(ExchangeToCheck {
                key: format!("policy[{i}].on_exhausted"),
                vhost: p.vhost.clone(),
                exchange: exchange.clone(),
            }),
            OnExhausted::Reject => None,
        })
        .collect();
    let gone = &config.republish.queue_gone;
    if let (GoneAction::DeadLetter, Some(exchange)) = (gone.action, &gone.exchange) {
        let mut vhosts: Vec<&str> = config.policies.iter().map(|p| p.vhost.as_str()).collect();
        vhosts.sort_unstable();
        vhosts.dedup();
        out.extend(vhosts.into_iter().map(|vhost| ExchangeToCheck {
            key: "republish.queue_gone.exchange".into(),
            vhost: vhost.to_string(),
            exchange: exchange.clone(),
        }));
    }
    out.extend(delayed_exchanges_named(config));
    out
}

/// The `[[delayed_exchange]]` exchanges, and `delayed.alternate_exchange`
/// in each of their vhosts (others are known only once declared).
fn delayed_exchanges_named(config: &Config) -> Vec<ExchangeToCheck> {
    if !config.delayed_enabled() {
        return Vec::new();
    }
    let tables = &config.delayed_exchanges;
    let mut out: Vec<ExchangeToCheck> = tables
        .iter()
        .enumerate()
        .map(|(i, d)| ExchangeToCheck {
            key: format!("delayed_exchange[{i}]"),
            vhost: d.vhost.clone(),
            exchange: d.name.clone(),
        })
        .collect();
    if let Some(alternate) = config.delayed_settings().alternate_exchange {
        let mut vhosts: Vec<&str> = tables.iter().map(|d| d.vhost.as_str()).collect();
        vhosts.sort_unstable();
        vhosts.dedup();
        out.extend(vhosts.into_iter().map(|vhost| ExchangeToCheck {
            key: "delayed.alternate_exchange".into(),
            vhost: vhost.to_string(),
            exchange: alternate.clone(),
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delayed_exchanges_and_their_alternate_are_checked() {
        let text = "[delayed]\nunroutable = \"alternate\"\nalternate_exchange = \"lost\"\n\n[[delayed_exchange]]\nname = \"a\"\n\n[[delayed_exchange]]\nvhost = \"v\"\nname = \"b\"\n";
        let config = Config::parse(text, std::path::Path::new("x")).unwrap();
        let named: Vec<(String, String, String)> = exchanges_named(&config)
            .into_iter()
            .map(|c| (c.key, c.vhost, c.exchange))
            .collect();
        let row = |k: &str, v: &str, x: &str| (k.to_string(), v.to_string(), x.to_string());
        assert_eq!(
            named,
            vec![
                row("delayed_exchange[0]", "/", "a"),
                row("delayed_exchange[1]", "v", "b"),
                row("delayed.alternate_exchange", "/", "lost"),
                row("delayed.alternate_exchange", "v", "lost"),
            ]
        );
        let off = format!("{text}\n[delayed]\nenabled = false\n");
        assert!(
            Config::parse(&off, std::path::Path::new("x")).is_err(),
            "one [delayed] table"
        );
        let off = text.replace("[delayed]\n", "[delayed]\nenabled = false\n");
        let config = Config::parse(&off, std::path::Path::new("x")).unwrap();
        assert!(exchanges_named(&config).is_empty());
    }
}

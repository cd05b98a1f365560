//! `[delayed]` and `[[delayed_exchange]]`: the emulation of the
//! `x-delayed-message` exchange type (issue 23).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `[delayed]`: how delayed publishes are held and routed.
#[derive(Clone, Debug, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
#[schemars(extend(
    "if" = { "properties": { "unroutable": { "const": "alternate" } }, "required": ["unroutable"] },
    "then" = { "required": ["alternate_exchange"] },
    "else" = { "not": { "required": ["alternate_exchange"] } }
))]
pub struct Delayed {
    /// Emulate `x-delayed-message` (with `false`, a `[delayed]` table or
    /// `[[delayed_exchange]]` tables start nothing).
    #[serde(default = "default_enabled")]
    pub enabled: bool,
    /// What becomes of a delayed message nothing is bound for at its due time.
    #[serde(default)]
    pub unroutable: Unroutable,
    /// Exchange of `unroutable = "alternate"` (same routing key): required
    /// then, refused otherwise; not `""` (the default exchange routes by
    /// queue name).
    #[schemars(length(min = 1, max = 255), example = "unrouted-later")]
    pub alternate_exchange: Option<String>,
    /// Most exchanges one vhost may have delayed: a declare of one more
    /// closes its connection with 530 NOT_ALLOWED (the list is kept in the
    /// store directory and read at every start).
    #[serde(default = "default_max_exchanges")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub max_exchanges: usize,
    /// Share the delayed exchanges with every nackd in front of the same
    /// broker, through the stream `nackd.delayed-exchanges` of
    /// `registry_vhost` (written and read as `[republish]`'s user): a
    /// declare or delete through any instance is known to all. Until an
    /// instance has read it, an x-delay publish to an exchange it does
    /// not know as delayed is refused (a nack, or a 506 close without
    /// confirms), never routed at once. Needs streams (RabbitMQ 3.9+).
    #[serde(default)]
    pub registry: bool,
    /// Virtual host of the registry stream.
    #[serde(default = "default_vhost")]
    #[schemars(length(min = 1, max = 255))]
    pub registry_vhost: String,
}

fn default_max_exchanges() -> usize {
    nackd_core::delayed::DEFAULT_LIMIT
}

fn default_enabled() -> bool {
    true
}

impl Default for Delayed {
    fn default() -> Self {
        Self {
            enabled: default_enabled(),
            unroutable: Unroutable::default(),
            alternate_exchange: None,
            max_exchanges: default_max_exchanges(),
            registry: false,
            registry_vhost: default_vhost(),
        }
    }
}

/// `delayed.unroutable`
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Unroutable {
    /// Keep it held and try again with a backoff (up to 30 s), until
    /// something is bound for its routing key.
    #[default]
    Keep,
    /// Forget it (counted, logged): lost on purpose, as the plugin does.
    Drop,
    /// Send it to `alternate_exchange` with its routing key.
    Alternate,
}

impl Unroutable {
    /// The `action` label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Keep => "keep",
            Self::Drop => "drop",
            Self::Alternate => "alternate",
        }
    }
}

/// `[[delayed_exchange]]`: an exchange every nackd with this file treats
/// as delayed, whether or not it saw its declare.
#[derive(Clone, Debug, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DelayedExchange {
    /// Virtual host.
    #[serde(default = "default_vhost")]
    pub vhost: String,
    /// Exchange name (1 to 255 bytes); an exchange is listed once.
    #[schemars(length(min = 1, max = 255), example = "orders-later")]
    pub name: String,
    /// The real type on the broker (`x-delayed-type`): `direct`, `topic`,
    /// `fanout`, `headers`, not `x-delayed-message`.
    #[serde(default = "default_type", rename = "type")]
    pub kind: String,
}

fn default_vhost() -> String {
    "/".into()
}

fn default_type() -> String {
    "direct".into()
}

/// An exchange name or type: an AMQP short string, not empty.
fn check_name(value: &str) -> Result<(), &'static str> {
    if value.is_empty() {
        return Err("must not be empty");
    }
    if value.len() > 255 {
        return Err("must be at most 255 bytes (an AMQP short string)");
    }
    Ok(())
}

impl Delayed {
    pub(super) fn check(&self) -> Result<(), (String, String)> {
        let err = |key: &str, reason: String| Err((format!("delayed.{key}"), reason));
        if !(1..=1_000_000).contains(&self.max_exchanges) {
            return err("max_exchanges", "must be 1 .. 1000000".into());
        }
        match (self.unroutable, &self.alternate_exchange) {
            (Unroutable::Alternate, None) => err(
                "alternate_exchange",
                "required with unroutable = \"alternate\"".into(),
            ),
            (Unroutable::Alternate, Some(x)) if x.is_empty() => err(
                "alternate_exchange",
                "must name an exchange (the default exchange \"\" routes by queue name)".into(),
            ),
            (Unroutable::Alternate, Some(x)) => {
                check_name(x).or_else(|r| err("alternate_exchange", r.into()))
            }
            (Unroutable::Keep | Unroutable::Drop, Some(_)) => err(
                "alternate_exchange",
                "only used with unroutable = \"alternate\"".into(),
            ),
            _ => Ok(()),
        }
    }
}

/// Checks the `[[delayed_exchange]]` tables: names set, no exchange twice.
pub(super) fn check_exchanges(tables: &[DelayedExchange]) -> Result<(), (String, String)> {
    let mut seen = std::collections::HashSet::new();
    for (i, t) in tables.iter().enumerate() {
        let key = |k: &str| format!("delayed_exchange[{i}].{k}");
        check_name(&t.name).map_err(|r| (key("name"), r.to_string()))?;
        check_name(&t.kind).map_err(|r| (key("type"), r.to_string()))?;
        if t.kind == nackd_core::delayed::TYPE {
            return Err((
                key("type"),
                "the real type on the broker (direct, topic, fanout, headers), not x-delayed-message".into(),
            ));
        }
        if !seen.insert((&t.vhost, &t.name)) {
            return Err((
                key("name"),
                format!(
                    "exchange {:?} of vhost {:?} is listed twice",
                    t.name, t.vhost
                ),
            ));
        }
    }
    Ok(())
}

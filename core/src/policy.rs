//! Retry policies: which queues nackd intercepts and with which schedule
//! (the `[[policy]]` tables of the configuration, checked and compiled),
//! and [`LivePolicies`], the set in force, which a reload replaces.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Longest delay a schedule may hold (the wheel goes much further).
pub const MAX_DELAY: Duration = Duration::from_secs(365 * 24 * 3600);

/// A checked `[[policy]]`.
#[derive(Clone, Debug)]
pub struct Policy {
    /// Virtual host it applies to.
    pub vhost: String,
    patterns: Vec<glob::Pattern>,
    schedule: Schedule,
    /// What to do with `requeue=true`.
    pub requeue: RequeueMode,
    /// Where an exhausted message goes.
    pub on_exhausted: OnExhausted,
}

/// A policy's schedule of delays.
#[derive(Clone, Debug)]
pub enum Schedule {
    /// `delays`: one per retry.
    Explicit(Vec<Duration>),
    /// `backoff`, for `max_retries` retries.
    Backoff(BackoffConfig, u32),
}

/// What the schedule says for one retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Hold for this long, then republish.
    Delay(Duration),
    /// The schedule is used up.
    Exhausted,
}

impl Policy {
    /// Checks a policy table and compiles it; `Err((key, reason))` with the
    /// key inside the table.
    pub fn new(p: &PolicyConfig) -> Result<Self, (String, String)> {
        if p.queues.is_empty() {
            return invalid("queues", "needs at least one queue name or pattern".into());
        }
        let patterns = p
            .queues
            .iter()
            .map(|q| {
                glob::Pattern::new(q)
                    .map_err(|e| ("queues".to_string(), format!("bad pattern {q:?}: {e}")))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            vhost: p.vhost.clone(),
            patterns,
            schedule: schedule(p)?,
            requeue: p.requeue,
            on_exhausted: p.on_exhausted.clone(),
        })
    }

    /// The queue names and patterns it covers, as written.
    pub fn queues(&self) -> impl Iterator<Item = &str> {
        self.patterns.iter().map(glob::Pattern::as_str)
    }

    /// Its schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Whether a settle with this `requeue` flag is delayed (else it passes).
    pub fn wants(&self, requeue: bool) -> bool {
        !requeue || self.requeue == RequeueMode::Delay
    }

    /// Whether this policy covers `queue` in `vhost`.
    pub fn matches(&self, vhost: &str, queue: &str) -> bool {
        self.vhost == vhost && self.patterns.iter().any(|p| p.matches(queue))
    }

    /// The step for retry number `retry` (1 for the first redelivery).
    pub fn step(&self, retry: u32) -> Step {
        let index = retry.saturating_sub(1);
        match &self.schedule {
            Schedule::Explicit(delays) => delays
                .get(index as usize)
                .map_or(Step::Exhausted, |d| Step::Delay(*d)),
            Schedule::Backoff(_, max) if retry > *max => Step::Exhausted,
            Schedule::Backoff(b, _) => Step::Delay(backoff_delay(b, index)),
        }
    }
}

/// An error about `key` of a policy table.
fn invalid<T>(key: &str, reason: String) -> Result<T, (String, String)> {
    Err((key.to_string(), reason))
}

/// The schedule of a table: `delays`, or `backoff` with `max_retries`.
fn schedule(p: &PolicyConfig) -> Result<Schedule, (String, String)> {
    let in_range = |d: &Duration| *d >= Duration::from_millis(1) && *d <= MAX_DELAY;
    match (&p.delays, &p.backoff, p.max_retries) {
        (Some(_), Some(_), _) => invalid("backoff", "set delays or backoff, not both".into()),
        (None, None, _) => invalid("delays", "set delays (a list) or backoff (a table)".into()),
        (Some(d), None, _) if d.is_empty() => invalid("delays", "must not be empty".into()),
        (Some(d), None, _) if !d.iter().all(in_range) => invalid(
            "delays",
            "each delay must be between 1ms and 365 days".into(),
        ),
        (Some(_), None, Some(_)) => invalid(
            "max_retries",
            "applies to backoff; delays has its own length".into(),
        ),
        (Some(d), None, None) => Ok(Schedule::Explicit(d.clone())),
        (None, Some(_), None) => invalid("max_retries", "required with backoff".into()),
        (None, Some(b), Some(_)) if !in_range(&b.initial) => {
            invalid("backoff.initial", "must be between 1ms and 365 days".into())
        }
        (None, Some(b), Some(_)) if b.max < b.initial || b.max > MAX_DELAY => invalid(
            "backoff.max",
            "must be at least initial and at most 365 days".into(),
        ),
        (None, Some(b), Some(_)) if !(b.multiplier >= 1.0 && b.multiplier.is_finite()) => invalid(
            "backoff.multiplier",
            "must be a finite number >= 1.0".into(),
        ),
        (None, Some(b), Some(max)) => Ok(Schedule::Backoff(b.clone(), max)),
    }
}

fn backoff_delay(b: &BackoffConfig, index: u32) -> Duration {
    let base = b.initial.as_secs_f64() * b.multiplier.powi(index.min(1024) as i32);
    let capped = base.min(b.max.as_secs_f64());
    let ms = capped * 1000.0;
    let jittered = match b.jitter {
        Jitter::None => ms,
        Jitter::Full => fastrand::f64() * ms,
        Jitter::Equal => ms / 2.0 + fastrand::f64() * ms / 2.0,
    };
    Duration::from_millis(jittered.round().max(1.0) as u64)
}

/// All policies, in file order.
#[derive(Clone, Debug, Default)]
pub struct Policies(Vec<Arc<Policy>>);

impl Policies {
    /// The list of `policies`, compiled by [`Policy::new`].
    pub fn new(policies: &[Policy]) -> Self {
        Self(policies.iter().cloned().map(Arc::new).collect())
    }

    /// The first policy covering `queue` in `vhost`.
    pub fn find(&self, vhost: &str, queue: &str) -> Option<&Arc<Policy>> {
        self.0.iter().find(|p| p.matches(vhost, queue))
    }

    /// Whether no queue is intercepted at all.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Each policy, in file order.
    pub fn iter(&self) -> impl Iterator<Item = &Policy> {
        self.0.iter().map(|p| &**p)
    }
}

/// The policies in force, shared by every session; a reload replaces them.
/// Readers hold a [`PolicyView`], which sees a replacement at its next
/// look (one atomic load when nothing changed).
#[derive(Debug)]
pub struct LivePolicies {
    current: RwLock<Arc<Policies>>,
    version: AtomicU64,
}

impl LivePolicies {
    /// Starts with `policies`.
    pub fn new(policies: Policies) -> Arc<Self> {
        Arc::new(Self {
            current: RwLock::new(Arc::new(policies)),
            version: AtomicU64::new(0),
        })
    }

    /// A view for one session.
    pub fn subscribe(self: &Arc<Self>) -> PolicyView {
        let (version, current) = self.read();
        PolicyView {
            live: self.clone(),
            version,
            current,
        }
    }

    /// The policies in force now.
    pub fn now(&self) -> Arc<Policies> {
        self.read().1
    }

    /// Puts `policies` in force for every session.
    pub fn replace(&self, policies: Policies) {
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        *current = Arc::new(policies);
        self.version.fetch_add(1, Ordering::Release);
    }

    fn read(&self) -> (u64, Arc<Policies>) {
        let current = self.current.read().unwrap_or_else(|e| e.into_inner());
        (self.version.load(Ordering::Acquire), current.clone())
    }
}

/// One reader's view of [`LivePolicies`].
#[derive(Debug, Clone)]
pub struct PolicyView {
    live: Arc<LivePolicies>,
    version: u64,
    current: Arc<Policies>,
}

impl PolicyView {
    /// The policies in force; `true` with them when they changed since the
    /// last look.
    pub fn current(&mut self) -> (&Arc<Policies>, bool) {
        let changed = self.live.version.load(Ordering::Acquire) != self.version;
        if changed {
            (self.version, self.current) = self.live.read();
        }
        (&self.current, changed)
    }
}

/// One `[[policy]]` table, as written; [`Policy::new`] checks and compiles
/// it. (The schema's description is for users, without the link.)
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[schemars(description = "Which queues nackd intercepts and their retry \
    schedule: `delays`, or `backoff` with `max_retries`.")]
#[serde(deny_unknown_fields)]
#[schemars(extend("allOf" = [
    { "not": { "required": ["delays", "backoff"] } },
    { "not": { "required": ["delays", "max_retries"] } },
    { "anyOf": [{ "required": ["delays"] }, { "required": ["backoff"] }] }
], "dependencies" = { "backoff": ["max_retries"], "max_retries": ["backoff"] }))]
pub struct PolicyConfig {
    /// Virtual host the policy applies to.
    #[serde(default = "default_vhost")]
    pub vhost: String,
    /// Queue names or glob patterns (`*`, `?`, `[a-z]`) of the queues it
    /// covers; at least one.
    #[schemars(length(min = 1), example = ["email-queue", "webhook-*"])]
    pub queues: Vec<String>,
    /// Explicit schedule: the delay before each retry, in order; its length
    /// is the number of retries. Each between 1ms and 365 days. Set `delays`
    /// or `backoff`, not both.
    #[serde(default, deserialize_with = "duration_list")]
    #[schemars(with = "Option<Vec<crate::schema::Duration>>", length(min = 1))]
    #[schemars(example = ["500ms", "5s", "1m", "5m"])]
    pub delays: Option<Vec<Duration>>,
    /// Or a computed schedule (requires `max_retries`).
    pub backoff: Option<BackoffConfig>,
    /// Retries before `on_exhausted`: required with `backoff`, refused with
    /// `delays` (its length says).
    #[schemars(example = 10)]
    pub max_retries: Option<u32>,
    /// What to do with `requeue=true` nacks.
    #[serde(default)]
    pub requeue: RequeueMode,
    /// Where a message goes when the schedule is exhausted: `"reject"`
    /// (`basic.reject(requeue=false)`: the queue's own dead-letter exchange
    /// applies), or `{ exchange, routing_key }` to publish it there, then ack.
    #[serde(default)]
    pub on_exhausted: OnExhausted,
}

fn duration_list<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<Duration>>, D::Error> {
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|s| {
            humantime::parse_duration(s)
                .map_err(|e| serde::de::Error::custom(format!("{s:?}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn default_vhost() -> String {
    "/".into()
}

/// `backoff = { initial, multiplier, max, jitter }`: retry n waits
/// `initial * multiplier^(n-1)`, at most `max`, randomised by `jitter`.
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BackoffConfig {
    /// First delay (1ms .. 365 days).
    #[serde(with = "humantime_serde")]
    #[schemars(with = "crate::schema::Duration", example = "1s")]
    pub initial: Duration,
    /// Factor between two delays (a finite number, at least 1.0).
    #[serde(default = "default_multiplier")]
    #[schemars(range(min = 1.0))]
    pub multiplier: f64,
    /// Cap: no delay is longer (at least `initial`, at most 365 days).
    #[serde(with = "humantime_serde")]
    #[schemars(with = "crate::schema::Duration", example = "5m")]
    pub max: Duration,
    /// Randomisation of each delay.
    #[serde(default)]
    pub jitter: Jitter,
}

fn default_multiplier() -> f64 {
    2.0
}

/// Jitter applied to a computed delay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Jitter {
    /// The computed delay.
    #[default]
    None,
    /// Uniform in `[0, delay]`.
    Full,
    /// Uniform in `[delay/2, delay]`.
    Equal,
}

/// `requeue = "delay" | "pass"`
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RequeueMode {
    /// `requeue=true` nacks are delayed too.
    #[default]
    Delay,
    /// `requeue=true` nacks go to the broker as sent.
    Pass,
}

/// `on_exhausted = "reject" | { exchange, routing_key }`
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum OnExhausted {
    /// `"reject"`: hand back with `basic.reject(requeue=false)`; the queue's DLX applies.
    #[default]
    Reject,
    /// Publish to this exchange with this routing key, then ack.
    DeadLetter {
        /// Exchange name.
        exchange: String,
        /// Routing key (default: the original queue).
        routing_key: Option<String>,
    },
}

/// `on_exhausted = { exchange, routing_key }`, as written: a key other
/// than these two is refused by name (serde's untagged enums would only say
/// that nothing matched).
#[derive(Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeadLetterTable {
    /// Exchange to publish the exhausted message to.
    #[schemars(example = "dead-letters")]
    pub exchange: String,
    /// Its routing key (default: the queue the message came from).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(example = &"email")]
    pub routing_key: Option<String>,
}

impl<'de> Deserialize<'de> for OnExhausted {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(OnExhaustedVisitor)
    }
}

struct OnExhaustedVisitor;

impl<'de> serde::de::Visitor<'de> for OnExhaustedVisitor {
    type Value = OnExhausted;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("\"reject\" or { exchange, routing_key }")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<OnExhausted, E> {
        match v {
            "reject" => Ok(OnExhausted::Reject),
            other => Err(E::custom(format!(
                "expected \"reject\" or {{ exchange, routing_key }}, found {other:?}"
            ))),
        }
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<OnExhausted, A::Error> {
        let table =
            DeadLetterTable::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
        Ok(OnExhausted::DeadLetter {
            exchange: table.exchange,
            routing_key: table.routing_key,
        })
    }
}

/// As written: `"reject"` or the table (the schema's default shows it).
impl Serialize for OnExhausted {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Reject => s.serialize_str("reject"),
            Self::DeadLetter {
                exchange,
                routing_key,
            } => DeadLetterTable {
                exchange: exchange.clone(),
                routing_key: routing_key.clone(),
            }
            .serialize(s),
        }
    }
}

impl JsonSchema for OnExhausted {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "OnExhausted".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "anyOf": [
                {
                    "const": "reject",
                    "description": "basic.reject(requeue=false): the queue's own dead-letter exchange applies."
                },
                generator.subschema_for::<DeadLetterTable>()
            ]
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `[[policy]]` tables of `text`, compiled.
    fn policies(text: &str) -> Policies {
        #[derive(Deserialize)]
        struct File {
            policy: Vec<PolicyConfig>,
        }
        let file: File = toml::from_str(text).unwrap();
        let compiled: Vec<Policy> = file
            .policy
            .iter()
            .map(|p| Policy::new(p).unwrap())
            .collect();
        Policies::new(&compiled)
    }

    #[test]
    fn a_view_sees_a_replacement_once() {
        let live = LivePolicies::new(policies("[[policy]]\nqueues=[\"a\"]\ndelays=[\"1s\"]\n"));
        let mut view = live.subscribe();
        let (p, changed) = view.current();
        assert!(p.find("/", "a").is_some() && !changed);
        live.replace(policies("[[policy]]\nqueues=[\"b\"]\ndelays=[\"1s\"]\n"));
        let (p, changed) = view.current();
        assert!(p.find("/", "b").is_some() && p.find("/", "a").is_none() && changed);
        assert!(!view.current().1, "seen once");
    }

    #[test]
    fn first_match_wins_and_vhost_matters() {
        let p = policies(
            r#"
            [[policy]]
            queues = ["email-queue", "webhook-*"]
            delays = ["50ms", "100ms"]
            [[policy]]
            queues = ["*"]
            delays = ["1s"]
            [[policy]]
            vhost = "billing"
            queues = ["pay"]
            delays = ["2s"]
            "#,
        );
        assert_eq!(
            p.find("/", "webhook-eu").unwrap().step(1),
            Step::Delay(Duration::from_millis(50))
        );
        assert_eq!(
            p.find("/", "other").unwrap().step(1),
            Step::Delay(Duration::from_secs(1))
        );
        assert_eq!(
            p.find("billing", "pay").unwrap().step(1),
            Step::Delay(Duration::from_secs(2))
        );
        assert!(p.find("billing", "email-queue").is_none());
    }

    #[test]
    fn explicit_schedule_exhausts_after_its_length() {
        let p = policies("[[policy]]\nqueues=[\"q\"]\ndelays=[\"500ms\",\"5s\",\"1m\"]\n");
        let p = p.find("/", "q").unwrap();
        assert_eq!(p.step(3), Step::Delay(Duration::from_secs(60)));
        assert_eq!(p.step(4), Step::Exhausted);
    }

    #[test]
    fn backoff_grows_caps_and_exhausts() {
        let p = policies(
            "[[policy]]\nqueues=[\"q\"]\nmax_retries=6\nbackoff={initial=\"1s\",multiplier=3.0,max=\"20s\"}\n",
        );
        let p = p.find("/", "q").unwrap();
        let got: Vec<Step> = (1..=7).map(|n| p.step(n)).collect();
        let s = |n| Step::Delay(Duration::from_secs(n));
        assert_eq!(
            got,
            vec![s(1), s(3), s(9), s(20), s(20), s(20), Step::Exhausted]
        );
    }

    #[test]
    fn jitter_stays_in_its_band() {
        let p = policies(
            "[[policy]]\nqueues=[\"q\"]\nmax_retries=9\nbackoff={initial=\"1s\",max=\"1s\",jitter=\"equal\"}\n",
        );
        let p = p.find("/", "q").unwrap();
        for _ in 0..1000 {
            match p.step(1) {
                Step::Delay(d) => assert!(
                    d >= Duration::from_millis(500) && d <= Duration::from_secs(1),
                    "{d:?}"
                ),
                Step::Exhausted => panic!("exhausted"),
            }
        }
    }
}

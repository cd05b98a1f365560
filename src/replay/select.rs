//! What a replay decides for one dead-lettered message, without a network:
//! where it came from (its origin queue and why it died), whether the
//! filters take it, when it is due (`--spread`), and the content header it
//! is parked with.

use std::time::Duration;

use amq_protocol::types::{AMQPValue, FieldTable};
use nackd_core::protocol::content;
use nackd_core::protocol::frame::FrameError;
use nackd_core::protocol::headers::{self, BROKER_COUNTS, RETRY_COUNT, RETRY_DELAY, X_DEATH};

/// The dead-letter reasons RabbitMQ writes in `x-death`.
pub const REASONS: [&str; 4] = ["rejected", "expired", "maxlen", "delivery_limit"];

/// Where a dead-lettered message came from, as its headers say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    /// The queue it died in first.
    pub queue: String,
    /// Why it died there, when the headers say.
    pub reason: Option<String>,
}

fn text(value: Option<&AMQPValue>) -> Option<String> {
    match value? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
    .filter(|s| !s.is_empty())
}

/// The origin of a message from its headers: `x-first-death-queue` (with
/// `x-first-death-reason`), else the first entry of `x-death`, else what
/// nackd wrote on its own retries (`x-last-death-queue`, then
/// `x-original-routing-key` when it was published to exchange `""`, which
/// routes to the queue of that name); `None`: nothing names a queue.
pub fn origin(headers: Option<&FieldTable>) -> Option<Origin> {
    let h = headers?.inner();
    if let Some(queue) = text(h.get("x-first-death-queue")) {
        let reason = text(h.get("x-first-death-reason"));
        return Some(Origin { queue, reason });
    }
    if let Some(AMQPValue::FieldArray(deaths)) = h.get(X_DEATH) {
        if let Some(AMQPValue::FieldTable(first)) = deaths.as_slice().first() {
            if let Some(queue) = text(first.inner().get("queue")) {
                let reason = text(first.inner().get("reason"));
                return Some(Origin { queue, reason });
            }
        }
    }
    if let Some(queue) = text(h.get("x-last-death-queue")) {
        let reason = text(h.get("x-last-death-reason"));
        return Some(Origin { queue, reason });
    }
    let default_exchange = matches!(h.get(headers::ORIGINAL_EXCHANGE),
        Some(AMQPValue::LongString(s)) if s.as_bytes().is_empty());
    if default_exchange {
        let queue = text(h.get(headers::ORIGINAL_ROUTING_KEY))?;
        return Some(Origin {
            queue,
            reason: None,
        });
    }
    None
}

/// Whether the screen folded this message's properties (they fail
/// nackd's limits, see [`nackd_core::protocol::screen`]): nothing in them
/// can be read, so a replay leaves it where it is.
pub fn folded(headers: Option<&FieldTable>) -> bool {
    headers.is_some_and(|h| h.inner().contains_key(nackd_core::protocol::screen::FOLDED))
}

/// Which messages a replay takes and where they go.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// Every message goes here instead of its origin (`--to`).
    pub to: Option<String>,
    /// Only messages from this queue (`--queue`).
    pub queue: Option<String>,
    /// Only messages that died for this reason (`--reason`).
    pub reason: Option<String>,
}

/// What becomes of one message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Moved to this queue.
    Move(String),
    /// Left on the dead-letter queue: the filters do not take it.
    Skip,
    /// Left on the dead-letter queue: nothing says where it goes.
    NoDestination,
}

impl Filter {
    /// The verdict for a message whose headers give `origin`. The filters
    /// look at the origin, `--to` only says where taken messages go; with
    /// `--to` and no filter, a message with no origin goes there too.
    pub fn verdict(&self, origin: Option<&Origin>) -> Verdict {
        let filtered = self.queue.is_some() || self.reason.is_some();
        let Some(origin) = origin else {
            return match (&self.to, filtered) {
                (Some(to), false) => Verdict::Move(to.clone()),
                (_, true) => Verdict::Skip,
                (None, false) => Verdict::NoDestination,
            };
        };
        if self.queue.as_ref().is_some_and(|q| *q != origin.queue)
            || self
                .reason
                .as_ref()
                .is_some_and(|r| Some(r) != origin.reason.as_ref())
        {
            return Verdict::Skip;
        }
        Verdict::Move(self.to.clone().unwrap_or_else(|| origin.queue.clone()))
    }
}

/// The delay of the `index`th moved message (from 0) of `planned`, spread
/// evenly over `spread`: `spread * index / planned`, so the first is due at
/// once and the last one step before the end; never more than `spread`
/// (a pass that moves more than it planned puts the rest at the end).
pub fn spread_delay(spread: Duration, index: u64, planned: u64) -> Duration {
    if planned == 0 || spread.is_zero() {
        return Duration::ZERO;
    }
    let index = index.min(planned);
    let us = spread.as_micros() * u128::from(index) / u128::from(planned);
    Duration::from_micros(us.min(u64::MAX as u128) as u64)
}

/// The content header payload a replayed message is parked with: the
/// broker's delivery counts dropped (it is a new message, as on a retry),
/// and with `reset` nackd's retry count and delay too, so its next nack
/// starts the schedule again. Returns the payload and the retry number it
/// carries.
pub fn park_header(payload: &[u8], reset: bool) -> Result<(Vec<u8>, u32), FrameError> {
    let mut drop: Vec<&str> = BROKER_COUNTS.to_vec();
    let retry = if reset {
        drop.extend([RETRY_COUNT, RETRY_DELAY]);
        0
    } else {
        headers::retry_count(payload)
    };
    let header = content::rewrite_headers_without(payload, &[], &drop)?;
    Ok((header, retry))
}

#[cfg(test)]
mod tests;

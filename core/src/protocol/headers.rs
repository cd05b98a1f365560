//! The headers nackd writes on every retry (the table in docs/src/headers.md).
//!
//! `x-retry-count` is nackd's source of truth; `x-death` is kept
//! RabbitMQ-compatible so consumers that read its `count` keep working.
//! Every other header keeps its original bytes ([`content::rewrite_headers`]).

use amq_protocol::types::parsing::parse_value;
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString};

use crate::protocol::content;
use crate::protocol::frame::FrameError;

/// Header with the retry number (1 on the first redelivery).
pub const RETRY_COUNT: &str = "x-retry-count";
/// Header with the delay applied this time, in ms.
pub const RETRY_DELAY: &str = "x-retry-delay-ms";
/// RabbitMQ's dead-lettering history.
pub const X_DEATH: &str = "x-death";
/// Why a message went to the dead-letter exchange (nackd's `on_exhausted`).
pub const EXHAUSTED_REASON: &str = "x-exhausted-reason";
/// The exchange and routing key the message was first published with, set
/// on the first retry (unless the application set them) and never changed: RabbitMQ 4.x replaces `x-death`
/// and `x-first-death-*` when it dead-letters a message itself, and the
/// retry went out on exchange `""`, so without these a dead-letter consumer
/// could not tell where the message came from.
pub const ORIGINAL_EXCHANGE: &str = "x-original-exchange";
/// See [`ORIGINAL_EXCHANGE`].
pub const ORIGINAL_ROUTING_KEY: &str = "x-original-routing-key";
/// What a quorum queue counted for the delivery nackd holds (RabbitMQ 4.x
/// adds them): the retry is a new message, so a copy would be stale, and a
/// consumer using them as a poison counter would count nackd's retries as
/// deliveries. Left out of every retry.
pub const BROKER_COUNTS: [&str; 2] = ["x-delivery-count", "x-acquired-count"];

/// What happened to the message, for the headers.
#[derive(Clone, Debug)]
pub struct Retry<'a> {
    /// Queue the message was nacked on.
    pub queue: &'a str,
    /// Exchange it was originally published to.
    pub exchange: &'a str,
    /// Routing key it was originally published with.
    pub routing_key: &'a str,
    /// Retry number, 1 for the first.
    pub count: u32,
    /// Delay applied, in ms (0 when going to the dead-letter exchange).
    pub delay_ms: u64,
    /// Wall-clock seconds since the epoch.
    pub now_secs: u64,
    /// Set when the message is exhausted and published to a dead-letter exchange.
    pub exhausted: Option<&'a str>,
}

fn header_value(payload: &[u8], key: &str) -> Result<Option<AMQPValue>, FrameError> {
    let Some(table) = content::raw_headers(payload)? else {
        return Ok(None);
    };
    for entry in content::table_entries(table)? {
        if entry.key == key.as_bytes() {
            let value_bytes = &entry.bytes[1 + entry.key.len()..];
            let (_, value) =
                parse_value(value_bytes).map_err(|_| FrameError::Syntax("header value"))?;
            return Ok(Some(value));
        }
    }
    Ok(None)
}

fn as_u64(value: &AMQPValue) -> Option<u64> {
    match value {
        AMQPValue::ShortShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::ShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::LongUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongLongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::Timestamp(v) => Some(*v),
        _ => None,
    }
}

fn as_str(value: Option<&AMQPValue>) -> Option<&[u8]> {
    match value? {
        AMQPValue::LongString(s) => Some(s.as_bytes()),
        AMQPValue::ShortString(s) => Some(s.as_str().as_bytes()),
        _ => None,
    }
}

/// The delay an `x-delay` header asks for, in ms, as the delayed-message
/// plugin reads it: an integer above 0; anything else (absent, 0,
/// negative, a string, a float) means "route at once" (`None`).
pub fn delay_ms(payload: &[u8]) -> Option<u64> {
    match header_value(payload, crate::delayed::DELAY_HEADER) {
        Ok(Some(AMQPValue::Timestamp(_))) => None,
        Ok(Some(v)) => as_u64(&v).filter(|ms| *ms > 0),
        _ => None,
    }
}

/// The content header a delayed message is delivered with: its `x-delay`
/// negated (`5000` becomes `-5000`, of the same integer type where it is
/// signed), as the delayed-message plugin delivers it, so that a consumer
/// that republishes it as it came gets it routed at once, not delayed
/// again. Every other byte is kept.
pub fn delivered_with_delay_spent(payload: &[u8]) -> Result<Vec<u8>, FrameError> {
    let key = crate::delayed::DELAY_HEADER;
    let spent = match header_value(payload, key)? {
        Some(AMQPValue::ShortShortInt(v)) => AMQPValue::ShortShortInt(v.saturating_neg()),
        Some(AMQPValue::ShortInt(v)) => AMQPValue::ShortInt(v.saturating_neg()),
        Some(AMQPValue::LongInt(v)) => AMQPValue::LongInt(v.saturating_neg()),
        Some(AMQPValue::LongLongInt(v)) => AMQPValue::LongLongInt(v.saturating_neg()),
        Some(v) => match as_u64(&v) {
            Some(n) => AMQPValue::LongLongInt(-(n.min(i64::MAX as u64) as i64)),
            None => return Ok(payload.to_vec()),
        },
        None => return Ok(payload.to_vec()),
    };
    content::rewrite_headers(payload, &[(key, spent)])
}

/// The retry count the message carries (0 when nackd never retried it).
pub fn retry_count(payload: &[u8]) -> u32 {
    match header_value(payload, RETRY_COUNT) {
        Ok(Some(v)) => as_u64(&v).map_or(0, |n| n.min(u32::MAX as u64) as u32),
        _ => 0,
    }
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// The time of the first `x-death` entry, in seconds since the epoch: when
/// the broker last dead-lettered the message, on the broker's clock.
/// Decoded only within nackd's nesting limit.
pub fn death_time(payload: &[u8]) -> Option<u64> {
    let header = content::decode_header(payload).ok()?;
    let headers = header.properties.headers().as_ref()?;
    let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get(X_DEATH) else {
        return None;
    };
    match deaths.as_slice().first()? {
        AMQPValue::FieldTable(t) => match t.inner().get("time")? {
            AMQPValue::Timestamp(secs) => Some(*secs),
            _ => None,
        },
        _ => None,
    }
}

/// `x-death` with this queue's `rejected` entry counted up (or created) and
/// moved first, as RabbitMQ does when it dead-letters.
fn x_death(existing: Option<AMQPValue>, r: &Retry<'_>) -> AMQPValue {
    let mut entries: Vec<AMQPValue> = match existing {
        Some(AMQPValue::FieldArray(a)) => a.as_slice().to_vec(),
        _ => Vec::new(),
    };
    let ours = entries.iter().position(|e| match e {
        AMQPValue::FieldTable(t) => {
            as_str(t.inner().get("queue")) == Some(r.queue.as_bytes())
                && as_str(t.inner().get("reason")) == Some(b"rejected")
        }
        _ => false,
    });
    let entry = match ours.map(|i| entries.remove(i)) {
        Some(AMQPValue::FieldTable(mut t)) => {
            let count = t.inner().get("count").and_then(as_u64).unwrap_or(0) + 1;
            t.insert("count".into(), AMQPValue::LongLongInt(count as i64));
            t
        }
        _ => {
            let mut t = FieldTable::default();
            t.insert("count".into(), AMQPValue::LongLongInt(1));
            t.insert("reason".into(), long_string("rejected"));
            t.insert("queue".into(), long_string(r.queue));
            t.insert("time".into(), AMQPValue::Timestamp(r.now_secs));
            t.insert("exchange".into(), long_string(r.exchange));
            let keys = FieldArray::from(vec![long_string(r.routing_key)]);
            t.insert("routing-keys".into(), AMQPValue::FieldArray(keys));
            t
        }
    };
    entries.insert(0, AMQPValue::FieldTable(entry));
    AMQPValue::FieldArray(FieldArray::from(entries))
}

/// Rewrites a content header payload for a retry (or a dead-letter publish).
pub fn rewrite(payload: &[u8], r: &Retry<'_>) -> Result<Vec<u8>, FrameError> {
    let death = x_death(header_value(payload, X_DEATH)?, r);
    let mut set: Vec<(&str, AMQPValue)> = vec![
        (RETRY_COUNT, AMQPValue::LongLongInt(r.count.into())),
        (
            RETRY_DELAY,
            AMQPValue::LongLongInt(r.delay_ms.min(i64::MAX as u64) as i64),
        ),
        (X_DEATH, death),
        ("x-last-death-queue", long_string(r.queue)),
        ("x-last-death-reason", long_string("rejected")),
        ("x-last-death-exchange", long_string(r.exchange)),
    ];
    if header_value(payload, "x-first-death-queue")?.is_none() {
        set.push(("x-first-death-queue", long_string(r.queue)));
        set.push(("x-first-death-reason", long_string("rejected")));
        set.push(("x-first-death-exchange", long_string(r.exchange)));
    }
    // Only the first retry sees the message as it was published; a message
    // retried by an older nackd that did not write them gets none.
    if r.count == 1 && header_value(payload, ORIGINAL_EXCHANGE)?.is_none() {
        set.push((ORIGINAL_EXCHANGE, long_string(r.exchange)));
        set.push((ORIGINAL_ROUTING_KEY, long_string(r.routing_key)));
    }
    if let Some(reason) = r.exhausted {
        set.push((EXHAUSTED_REASON, long_string(reason)));
    }
    content::rewrite_headers_without(payload, &set, &BROKER_COUNTS)
}

#[cfg(test)]
mod tests;

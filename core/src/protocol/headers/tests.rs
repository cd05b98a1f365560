use super::*;
use amq_protocol::protocol::basic::AMQPProperties;

fn retry(count: u32) -> Retry<'static> {
    Retry {
        queue: "email-queue",
        exchange: "notifications",
        routing_key: "user.7",
        count,
        delay_ms: 50 * count as u64,
        now_secs: 1_700_000_000 + count as u64,
        exhausted: None,
    }
}

fn headers(payload: &[u8]) -> FieldTable {
    content::decode_header(payload)
        .unwrap()
        .properties
        .headers()
        .clone()
        .unwrap()
}

fn get<'a>(t: &'a FieldTable, k: &str) -> &'a AMQPValue {
    t.inner().get(k).unwrap_or_else(|| panic!("no {k}"))
}

#[test]
fn three_retries_count_up_and_keep_the_first_death() {
    let mut original = FieldTable::default();
    original.insert("tenant".into(), AMQPValue::LongString("acme".into()));
    let mut payload =
        content::encode_header(60, 3, &AMQPProperties::default().with_headers(original));
    assert_eq!(retry_count(&payload), 0);
    for n in 1..=3 {
        let mut r = retry(retry_count(&payload) + 1);
        if n == 3 {
            r.exchange = "other"; // last-death follows, first-death does not
        }
        payload = rewrite(&payload, &r).unwrap();
        assert_eq!(retry_count(&payload), n);
    }
    let h = headers(&payload);
    assert_eq!(get(&h, "tenant"), &AMQPValue::LongString("acme".into()));
    assert_eq!(get(&h, RETRY_COUNT), &AMQPValue::LongLongInt(3));
    assert_eq!(get(&h, RETRY_DELAY), &AMQPValue::LongLongInt(150));
    assert_eq!(
        get(&h, "x-first-death-exchange"),
        &AMQPValue::LongString("notifications".into())
    );
    assert_eq!(
        get(&h, "x-last-death-exchange"),
        &AMQPValue::LongString("other".into())
    );
    assert_eq!(
        get(&h, "x-first-death-queue"),
        &AMQPValue::LongString("email-queue".into())
    );
    let AMQPValue::FieldArray(deaths) = get(&h, X_DEATH) else {
        panic!("x-death not an array")
    };
    assert_eq!(deaths.as_slice().len(), 1, "one entry per (queue, reason)");
    let AMQPValue::FieldTable(entry) = &deaths.as_slice()[0] else {
        panic!()
    };
    assert_eq!(get(entry, "count"), &AMQPValue::LongLongInt(3));
    assert_eq!(
        get(entry, "time"),
        &AMQPValue::Timestamp(1_700_000_001),
        "time of the first death"
    );
    assert_eq!(
        get(entry, "reason"),
        &AMQPValue::LongString("rejected".into())
    );
    assert_eq!(
        get(entry, "routing-keys"),
        &AMQPValue::FieldArray(vec![AMQPValue::LongString("user.7".into())].into())
    );
}

#[test]
fn an_existing_x_death_from_rabbitmq_is_extended_and_ours_moves_first() {
    let mut expired = FieldTable::default();
    expired.insert("count".into(), AMQPValue::LongLongInt(4));
    expired.insert("reason".into(), AMQPValue::LongString("expired".into()));
    expired.insert("queue".into(), AMQPValue::LongString("wait-queue".into()));
    let mut rejected = FieldTable::default();
    rejected.insert("count".into(), AMQPValue::LongLongInt(2));
    rejected.insert("reason".into(), AMQPValue::LongString("rejected".into()));
    rejected.insert("queue".into(), AMQPValue::LongString("email-queue".into()));
    rejected.insert("time".into(), AMQPValue::Timestamp(5));
    let mut h = FieldTable::default();
    h.insert(
        X_DEATH.into(),
        AMQPValue::FieldArray(
            vec![
                AMQPValue::FieldTable(expired.clone()),
                AMQPValue::FieldTable(rejected),
            ]
            .into(),
        ),
    );
    let payload = content::encode_header(60, 0, &AMQPProperties::default().with_headers(h));
    let out = headers(&rewrite(&payload, &retry(1)).unwrap());
    let AMQPValue::FieldArray(deaths) = get(&out, X_DEATH) else {
        panic!()
    };
    let AMQPValue::FieldTable(first) = &deaths.as_slice()[0] else {
        panic!()
    };
    assert_eq!(get(first, "count"), &AMQPValue::LongLongInt(3));
    assert_eq!(get(first, "time"), &AMQPValue::Timestamp(5));
    assert_eq!(&deaths.as_slice()[1], &AMQPValue::FieldTable(expired));
}

#[test]
fn exhausted_reason_is_added_on_dead_letter() {
    let payload = content::encode_header(60, 0, &AMQPProperties::default());
    let mut r = retry(4);
    r.exhausted = Some("retries exhausted after 3 delays");
    let h = headers(&rewrite(&payload, &r).unwrap());
    assert_eq!(
        get(&h, EXHAUSTED_REASON),
        &AMQPValue::LongString("retries exhausted after 3 delays".into())
    );
}

#[test]
fn retry_count_of_other_integer_types_and_junk() {
    for (v, n) in [
        (AMQPValue::LongInt(7), 7),
        (AMQPValue::ShortShortUInt(2), 2),
        (AMQPValue::LongLongInt(-1), 0),
        (AMQPValue::LongString("9".into()), 0),
    ] {
        let mut h = FieldTable::default();
        h.insert(RETRY_COUNT.into(), v);
        let payload = content::encode_header(60, 0, &AMQPProperties::default().with_headers(h));
        assert_eq!(retry_count(&payload), n);
    }
}

/// Issue 20, item 5: a quorum queue's delivery count of the nacked delivery
/// is not copied into the retry (a consumer counting deliveries with it
/// would see a stale number); the consumer's own headers are kept.
#[test]
fn the_brokers_delivery_counts_are_not_copied_into_the_retry() {
    let mut original = FieldTable::default();
    original.insert("x-delivery-count".into(), AMQPValue::LongLongInt(4));
    original.insert("x-acquired-count".into(), AMQPValue::LongLongInt(5));
    original.insert("tenant".into(), AMQPValue::LongString("acme".into()));
    let payload = content::encode_header(60, 3, &AMQPProperties::default().with_headers(original));
    let out = headers(&rewrite(&payload, &retry(1)).unwrap());
    assert!(out.inner().get("x-delivery-count").is_none());
    assert!(out.inner().get("x-acquired-count").is_none());
    assert_eq!(get(&out, "tenant"), &AMQPValue::LongString("acme".into()));
    assert_eq!(get(&out, RETRY_COUNT), &AMQPValue::LongLongInt(1));
}

#[test]
fn the_first_retry_records_where_the_message_was_published_and_later_ones_keep_it() {
    let mut payload = content::encode_header(60, 3, &AMQPProperties::default());
    payload = rewrite(&payload, &retry(1)).unwrap();
    let mut later = retry(2);
    later.exchange = "";
    later.routing_key = "email-queue";
    payload = rewrite(&payload, &later).unwrap();
    let h = headers(&payload);
    assert_eq!(
        get(&h, ORIGINAL_EXCHANGE),
        &AMQPValue::LongString("notifications".into())
    );
    assert_eq!(
        get(&h, ORIGINAL_ROUTING_KEY),
        &AMQPValue::LongString("user.7".into())
    );
}

#[test]
fn original_exchange_is_neither_invented_for_a_later_retry_nor_overwritten() {
    // A message an older nackd retried once already: its delivery now comes
    // from exchange "", which is not where it was published.
    let mut older = FieldTable::default();
    older.insert(RETRY_COUNT.into(), AMQPValue::LongLongInt(1));
    let payload = content::encode_header(60, 3, &AMQPProperties::default().with_headers(older));
    let h = headers(&rewrite(&payload, &retry(2)).unwrap());
    assert!(h.inner().get(ORIGINAL_EXCHANGE).is_none());
    assert!(h.inner().get(ORIGINAL_ROUTING_KEY).is_none());
    // The application's own value stays.
    let mut own = FieldTable::default();
    own.insert(
        ORIGINAL_EXCHANGE.into(),
        AMQPValue::LongString("app".into()),
    );
    let payload = content::encode_header(60, 3, &AMQPProperties::default().with_headers(own));
    let h = headers(&rewrite(&payload, &retry(1)).unwrap());
    assert_eq!(
        get(&h, ORIGINAL_EXCHANGE),
        &AMQPValue::LongString("app".into())
    );
}

/// Issue 33, item 7: the broker's dead-lettering time is read from the
/// first `x-death` entry (the newest), and a message without one has none.
#[test]
fn the_death_time_is_the_first_x_death_entrys() {
    let plain = content::encode_header(60, 0, &AMQPProperties::default());
    assert_eq!(death_time(&plain), None);
    let once = rewrite(&plain, &retry(1)).unwrap();
    assert_eq!(death_time(&once), Some(retry(1).now_secs));
    let mut other = retry(2);
    other.queue = "another-queue";
    let twice = rewrite(&once, &other).unwrap();
    assert_eq!(death_time(&twice), Some(other.now_secs));
}

use super::*;
use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::types::FieldArray;

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert((*k).into(), v.clone());
    }
    t
}

/// An `x-death` entry as RabbitMQ writes it.
fn death(queue: &str, reason: &str) -> AMQPValue {
    AMQPValue::FieldTable(table(&[
        ("count", AMQPValue::LongLongInt(1)),
        ("queue", long(queue)),
        ("reason", long(reason)),
        ("exchange", long("")),
        ("time", AMQPValue::Timestamp(1_700_000_000)),
    ]))
}

fn deaths(entries: Vec<AMQPValue>) -> AMQPValue {
    AMQPValue::FieldArray(FieldArray::from(entries))
}

fn origin_of(entries: &[(&str, AMQPValue)]) -> Option<Origin> {
    origin(Some(&table(entries)))
}

fn from(queue: &str, reason: Option<&str>) -> Option<Origin> {
    Some(Origin {
        queue: queue.into(),
        reason: reason.map(str::to_string),
    })
}

#[test]
fn the_first_death_queue_comes_first() {
    let o = origin_of(&[
        ("x-first-death-queue", long("orders")),
        ("x-first-death-reason", long("expired")),
        (X_DEATH, deaths(vec![death("later", "rejected")])),
        ("x-last-death-queue", long("later")),
    ]);
    assert_eq!(o, from("orders", Some("expired")));
}

#[test]
fn without_it_the_first_x_death_entry_names_the_queue() {
    let o = origin_of(&[(
        X_DEATH,
        deaths(vec![death("orders", "maxlen"), death("older", "rejected")]),
    )]);
    assert_eq!(o, from("orders", Some("maxlen")));
}

#[test]
fn without_either_nackds_own_headers_name_it() {
    // What an older nackd or a RabbitMQ 4.x republish may leave: no
    // x-first-death-*, no x-death, but nackd's last-death header.
    let o = origin_of(&[
        ("x-last-death-queue", long("orders")),
        ("x-last-death-reason", long("rejected")),
        (RETRY_COUNT, AMQPValue::LongLongInt(3)),
    ]);
    assert_eq!(o, from("orders", Some("rejected")));
    // Only the original publish to exchange "": its routing key is the queue.
    let o = origin_of(&[
        (headers::ORIGINAL_EXCHANGE, long("")),
        (headers::ORIGINAL_ROUTING_KEY, long("orders")),
    ]);
    assert_eq!(o, from("orders", None));
    // Published to another exchange: its routing key names no queue.
    let o = origin_of(&[
        (headers::ORIGINAL_EXCHANGE, long("events")),
        (headers::ORIGINAL_ROUTING_KEY, long("user.7")),
    ]);
    assert_eq!(o, None);
}

#[test]
fn nothing_naming_a_queue_is_no_origin() {
    assert_eq!(origin(None), None);
    assert_eq!(origin_of(&[("tenant", long("acme"))]), None);
    assert_eq!(origin_of(&[("x-first-death-queue", long(""))]), None);
    assert_eq!(origin_of(&[(X_DEATH, deaths(vec![]))]), None);
    assert_eq!(
        origin_of(&[("x-first-death-queue", AMQPValue::LongLongInt(7))]),
        None
    );
}

#[test]
fn headers_nackd_writes_on_a_retry_name_the_queue() {
    let r = headers::Retry {
        queue: "orders",
        exchange: "shop",
        routing_key: "order.created",
        count: 1,
        delay_ms: 500,
        now_secs: 1_700_000_000,
        exhausted: Some("max_retries"),
    };
    let plain = content::encode_header(60, 3, &AMQPProperties::default());
    let retried = headers::rewrite(&plain, &r).unwrap();
    let decoded = content::decode_header(&retried).unwrap();
    let o = origin(decoded.properties.headers().as_ref());
    assert_eq!(o, from("orders", Some("rejected")));
}

#[test]
fn filters_look_at_the_origin_and_to_says_where_taken_ones_go() {
    let orders = from("orders", Some("rejected"));
    let all = Filter::default();
    assert_eq!(all.verdict(orders.as_ref()), Verdict::Move("orders".into()));
    assert_eq!(all.verdict(None), Verdict::NoDestination);

    let to = Filter {
        to: Some("parking".into()),
        ..Filter::default()
    };
    assert_eq!(to.verdict(orders.as_ref()), Verdict::Move("parking".into()));
    assert_eq!(to.verdict(None), Verdict::Move("parking".into()));

    let only = |queue: Option<&str>, reason: Option<&str>| Filter {
        to: None,
        queue: queue.map(str::to_string),
        reason: reason.map(str::to_string),
    };
    let o = orders.as_ref();
    assert_eq!(
        only(Some("orders"), None).verdict(o),
        Verdict::Move("orders".into())
    );
    assert_eq!(only(Some("other"), None).verdict(o), Verdict::Skip);
    assert_eq!(
        only(None, Some("rejected")).verdict(o),
        Verdict::Move("orders".into())
    );
    assert_eq!(only(None, Some("expired")).verdict(o), Verdict::Skip);
    assert_eq!(
        only(None, Some("rejected")).verdict(from("q", None).as_ref()),
        Verdict::Skip
    );
    // A filter never takes a message whose origin nothing names.
    assert_eq!(only(Some("orders"), None).verdict(None), Verdict::Skip);
    let filtered_to = Filter {
        to: Some("parking".into()),
        queue: Some("orders".into()),
        reason: None,
    };
    assert_eq!(filtered_to.verdict(None), Verdict::Skip);
    assert_eq!(filtered_to.verdict(o), Verdict::Move("parking".into()));
}

#[test]
fn spread_is_even_starts_at_once_and_never_reaches_past_the_end() {
    let ten_min = Duration::from_secs(600);
    let delays: Vec<Duration> = (0..4).map(|i| spread_delay(ten_min, i, 4)).collect();
    assert_eq!(
        delays,
        [0, 150, 300, 450].map(Duration::from_secs).to_vec(),
        "evenly: one step of spread/planned each"
    );
    // 3 000 over 5 s: steps of 1 666 µs, in order, the last before 5 s.
    let five = Duration::from_secs(5);
    let all: Vec<Duration> = (0..3000).map(|i| spread_delay(five, i, 3000)).collect();
    assert!(all.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(all[1], Duration::from_micros(1666));
    assert!(*all.last().unwrap() < five);
    // More than planned: held at the end, never later.
    assert_eq!(spread_delay(five, 5000, 3000), five);
    // Nothing planned or no spread: at once.
    assert_eq!(spread_delay(five, 0, 0), Duration::ZERO);
    assert_eq!(spread_delay(Duration::ZERO, 7, 10), Duration::ZERO);
}

#[test]
fn the_parked_header_drops_broker_counts_and_resets_only_when_asked() {
    let h = table(&[
        ("tenant", long("acme")),
        (RETRY_COUNT, AMQPValue::LongLongInt(4)),
        (RETRY_DELAY, AMQPValue::LongLongInt(60_000)),
        ("x-delivery-count", AMQPValue::LongLongInt(2)),
        ("x-first-death-queue", long("orders")),
    ]);
    let props = AMQPProperties::default()
        .with_headers(h)
        .with_message_id("m-1".into());
    let payload = content::encode_header(60, 5, &props);

    let keys = |p: &[u8]| -> Vec<String> {
        let decoded = content::decode_header(p).unwrap();
        assert_eq!(decoded.body_size, 5);
        assert_eq!(
            decoded.properties.message_id().as_ref().unwrap().as_str(),
            "m-1"
        );
        let h = decoded.properties.headers().clone().unwrap();
        h.inner().keys().map(|k| k.to_string()).collect()
    };
    let (kept, retry) = park_header(&payload, false).unwrap();
    assert_eq!(retry, 4);
    assert_eq!(
        keys(&kept),
        ["tenant", "x-first-death-queue", RETRY_COUNT, RETRY_DELAY]
    );
    let (reset, retry) = park_header(&payload, true).unwrap();
    assert_eq!(retry, 0);
    assert_eq!(headers::retry_count(&reset), 0);
    assert_eq!(keys(&reset), ["tenant", "x-first-death-queue"]);
}

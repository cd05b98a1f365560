//! nackd's clock against the broker's (issue 33, item 7): due times come
//! from nackd's clock, and an adoption or a restart on a host whose clock
//! is off moves them; nackd measures the offset from the broker's clock
//! (`nackd_clock_offset_seconds`) and `/readyz` warns above
//! `republish.max_clock_offset`. Real nackd, real RabbitMQ.

use crate::common;

use common::ops::{get, until};
use common::*;

/// On one host (the broker under test runs here), the offset is measured
/// soon after the start, is a number, and is within a second and a half
/// (x-death times are whole seconds); `/readyz` warns about nothing.
#[tokio::test]
async fn the_offset_from_the_brokers_clock_is_measured_and_small_on_one_host() {
    let queue = unique("clock");
    let nackd = start(&format!(
        "[[policy]]\nqueues = [\"{queue}\"]\ndelays = [\"1s\"]\n"
    ))
    .await;
    const NAME: &str = "nackd_clock_offset_seconds";
    let s = until(nackd.metrics, "the clock's offset measured", |s| {
        s.has(NAME) && !s.get(NAME, &[]).is_nan()
    })
    .await;
    let offset = s.get(NAME, &[]);
    eprintln!("offset from the broker: {offset} s");
    assert!(
        offset.abs() < 1.5,
        "nackd and the broker share this host's clock, yet the offset is {offset} s"
    );
    let r = get(nackd.metrics, "/readyz").await;
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(body["warnings"], serde_json::json!([]), "{body}");
    nackd.stop().await;
}

use super::*;

fn line<'a>(text: &'a str, series: &str) -> Option<&'a str> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
}

#[test]
fn every_series_follows_the_naming_conventions_and_starts_at_zero() {
    let m = Metrics::new();
    let text = m.encode();
    for series in [
        "nackd_client_connections",
        "nackd_client_connections_accepted_total",
        "nackd_upstream_connections",
        "nackd_frames_total{direction=\"to_upstream\"}",
        "nackd_proxied_bytes_total{direction=\"to_client\"}",
        "nackd_nacks_intercepted_total",
        "nackd_nacks_passed_total{reason=\"over_budget\"}",
        "nackd_nacks_deferred_total{reason=\"store_unavailable\"}",
        "nackd_deferred_nacks",
        "nackd_retries_published_total",
        "nackd_retries_confirmed_total",
        "nackd_retries_returned_total",
        "nackd_exhausted_total{route=\"dead_letter\"}",
        "nackd_redelivery_lateness_seconds_count",
        "nackd_store_fsync_seconds_count",
        "nackd_store_bytes",
        "nackd_republisher_connections",
        "nackd_policy_reloads_total{result=\"error\"}",
    ] {
        assert_eq!(
            line(&text, series).map(|l| l.rsplit(' ').next().unwrap()),
            Some("0"),
            "{series} in\n{text}"
        );
    }
    assert!(text.contains("nackd_build_info{version=\""), "{text}");
    assert!(text.ends_with("# EOF\n"));
}

#[test]
fn handles_update_the_exported_series() {
    let m = Metrics::new();
    m.session.pass(PassReason::TxChannel, 3);
    m.session.pass(PassReason::NotConfigured, 0);
    m.session.frames.to_client.inc_by(7);
    m.session.exhausted_reject.inc();
    Metrics::observe(&m.lateness, Duration::from_millis(3));
    let text = m.encode();
    assert_eq!(
        line(&text, "nackd_nacks_passed_total{reason=\"tx_channel\"}"),
        Some("nackd_nacks_passed_total{reason=\"tx_channel\"} 3")
    );
    assert_eq!(
        line(&text, "nackd_frames_total{direction=\"to_client\"}"),
        Some("nackd_frames_total{direction=\"to_client\"} 7")
    );
    assert_eq!(
        line(&text, "nackd_exhausted_total{route=\"reject\"}"),
        Some("nackd_exhausted_total{route=\"reject\"} 1")
    );
    assert_eq!(
        line(
            &text,
            "nackd_redelivery_lateness_seconds_bucket{le=\"0.002\"}"
        )
        .unwrap()
        .rsplit(' ')
        .next(),
        Some("0")
    );
    assert_eq!(
        line(
            &text,
            "nackd_redelivery_lateness_seconds_bucket{le=\"0.005\"}"
        )
        .unwrap()
        .rsplit(' ')
        .next(),
        Some("1")
    );
    assert_eq!(
        (
            m.session.passed(PassReason::TxChannel),
            m.session.passed_total()
        ),
        (3, 3)
    );
}

#[test]
fn open_counts_a_lifetime() {
    let m = Metrics::new();
    let a = Open::track(&m.clients);
    let b = Open::track(&m.clients);
    assert_eq!(m.clients.get(), 2);
    drop(a);
    drop(b);
    assert_eq!(m.clients.get(), 0);
}

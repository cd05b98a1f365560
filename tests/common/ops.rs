//! Talking to nackd's operations listener: HTTP calls and `/metrics` scrapes.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;

use nackd::ops::client::{self, HttpResponse};

/// `GET path` (no token).
pub async fn get(addr: SocketAddr, path: &str) -> HttpResponse {
    call(addr, "GET", path, None).await
}

/// Any call, with an optional bearer token.
pub async fn call(addr: SocketAddr, method: &str, path: &str, token: Option<&str>) -> HttpResponse {
    client::request(&addr.to_string(), method, path, token)
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// The JSON body of a call that must answer 200.
pub async fn json(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> serde_json::Value {
    let r = call(addr, method, path, token).await;
    assert_eq!(r.status, 200, "{method} {path}: {}", r.body);
    serde_json::from_str(&r.body)
        .unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {}", r.body))
}

/// `?queue=Q` (encoded) for the admin API.
pub fn query(queue: &str) -> String {
    client::query(&[("queue", queue)])
}

type Labels = BTreeMap<String, String>;

/// One scrape of `/metrics`: series name → label set → value.
#[derive(Debug, Default)]
pub struct Scrape(BTreeMap<String, Vec<(Labels, f64)>>);

impl Scrape {
    /// The value of `name` with exactly these labels (0 when absent).
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let want: Labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.0
            .get(name)
            .and_then(|series| series.iter().find(|(l, _)| *l == want))
            .map_or(0.0, |(_, v)| *v)
    }

    /// The sum of `name` over every label set (0 when absent).
    pub fn sum(&self, name: &str) -> f64 {
        self.0
            .get(name)
            .map_or(0.0, |series| series.iter().map(|(_, v)| v).sum())
    }

    /// Whether a series `name` exists at all.
    pub fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

/// Scrapes `/metrics` and parses the text format.
pub async fn scrape(addr: SocketAddr) -> Scrape {
    let r = get(addr, "/metrics").await;
    assert_eq!(r.status, 200, "{}", r.body);
    parse(&r.body)
}

/// Parses Prometheus / OpenMetrics text (enough for nackd's own output).
pub fn parse(text: &str) -> Scrape {
    let mut scrape = Scrape::default();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad line {line:?}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((name, rest)) => (name.to_string(), labels(rest.trim_end_matches('}'))),
        };
        scrape.0.entry(name).or_default().push((labels, value));
    }
    scrape
}

fn labels(mut text: &str) -> Labels {
    let mut out = BTreeMap::new();
    while let Some((key, rest)) = text.split_once("=\"") {
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let mut end = rest.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => value.extend(chars.next().map(|(_, c)| if c == 'n' { '\n' } else { c })),
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.insert(key.trim_start_matches(',').to_string(), value);
        text = &rest[end..];
    }
    out
}

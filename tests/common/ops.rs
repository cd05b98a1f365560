//! Talking to nackd's operations listener: HTTP calls and `/metrics` scrapes.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

/// A response of the operations listener.
#[derive(Clone, Debug)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Body, as text.
    pub body: String,
}

/// `GET path` (no token).
pub async fn get(addr: SocketAddr, path: &str) -> HttpResponse {
    call(addr, "GET", path, None).await
}

/// Whether `/readyz` says interception is past its start: the store is
/// open and every message it held is scheduled again (its older segments
/// read), and the replica lease held (and its stream there); or there is
/// no store at all.
pub fn intercepting(r: &HttpResponse) -> bool {
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
    let store = v["store"].as_str();
    !matches!(store, Some("recovering") | None)
        && !store.is_some_and(|s| s.starts_with("no replica") || s.starts_with("no lease"))
        && v["store_recovering"] != true
}

/// Waits (60 s at most) until nackd at `addr` intercepts: it listens before
/// its store is recovered, and passes nacks through until then.
pub async fn wait_intercepting(addr: SocketAddr) {
    let start = std::time::Instant::now();
    loop {
        let r = get(addr, "/readyz").await;
        if intercepting(&r) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "nackd never started intercepting: {}",
            r.body
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// [`wait_intercepting`], for code outside a runtime.
pub fn wait_intercepting_blocking(addr: SocketAddr, limit: Duration) {
    let start = std::time::Instant::now();
    loop {
        let r = blocking_call(addr, "GET", "/readyz", None);
        if intercepting(&r) {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "nackd never started intercepting: {}",
            r.body
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Any call, with an optional bearer token. nackd runs in the test's own
/// runtime, so the (blocking) call goes to a blocking thread.
pub async fn call(addr: SocketAddr, method: &str, path: &str, token: Option<&str>) -> HttpResponse {
    let (method, path, token) = (
        method.to_string(),
        path.to_string(),
        token.map(str::to_string),
    );
    tokio::task::spawn_blocking(move || blocking_call(addr, &method, &path, token.as_deref()))
        .await
        .expect("HTTP call")
}

fn blocking_call(addr: SocketAddr, method: &str, path: &str, token: Option<&str>) -> HttpResponse {
    // A replay answers when its pass is done: 2 000 messages took over
    // 30 s on a machine loaded by the rest of the suite (2026-11-29).
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(120)))
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into();
    let mut request = ureq::http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    if let Some(token) = token {
        request = request.header("Authorization", format!("Bearer {token}"));
    }
    let request = request.body(()).expect("a valid request");
    let mut response = agent
        .run(request)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let body = (response.body_mut().with_config())
        .limit(u64::MAX)
        .lossy_utf8(true)
        .read_to_string()
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    HttpResponse {
        status: response.status().as_u16(),
        body,
    }
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

/// Query values keep letters, digits and `-_.~`; all else is %-encoded
/// (vhost `/` included).
const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// `?queue=Q` (encoded) for the admin API.
pub fn query(queue: &str) -> String {
    format!("?queue={}", utf8_percent_encode(queue, QUERY_VALUE))
}

type Labels = BTreeMap<String, String>;

/// One scrape of `/metrics`: series name → label set → value.
#[derive(Clone, Debug, Default)]
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

/// Scrapes `/metrics` until `f` holds for one scrape and returns it; panics
/// with `what` and that last scrape after 60 s. Metrics are updated by
/// different threads (sessions, the retry engine, the store writer): wait
/// for every value a test asserts in the same `f`.
pub async fn until(addr: SocketAddr, what: &str, f: impl Fn(&Scrape) -> bool) -> Scrape {
    // A bound on "eventually", not a performance claim: generous, since
    // the suite's passes share a loaded machine.
    super::wait_for(std::time::Duration::from_secs(60), what, || scrape(addr), f).await
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

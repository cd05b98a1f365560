//! The status page in a real headless Chromium: after real traffic, the
//! numbers the page renders (its script ran, `--dump-dom`) are the numbers
//! `/metrics` gives, and a screenshot is kept in `target/tmp/` to look at;
//! on a phone 420 px wide nothing overflows or is cut off (measured in the
//! page over the DevTools protocol, see [`browser`]); what `/readyz` says,
//! and why, is at the top.
//!
//! Chromium is provisioned by `scripts/test` (scripts/ensure-chromium.sh);
//! this test fails, never skips, when it is missing.

mod browser;
use crate::common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::ops::{scrape, until, Scrape};
use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::{BasicProperties, Consumer};

const CHROMIUM: &str = "chromium";
const CHROMIUM_FLAGS: [&str; 9] = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
];

async fn chromium(url: &str, profile: &Path, output: &[&str]) -> std::process::Output {
    let run = tokio::process::Command::new(CHROMIUM)
        .args(CHROMIUM_FLAGS)
        .args(["--virtual-time-budget=3000", "--window-size=1200,900"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(output)
        .arg(url)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(90), run)
        .await
        .expect("chromium finished in 90 s")
        .unwrap_or_else(|e| panic!("cannot run {CHROMIUM} ({e}): scripts/test installs it (scripts/ensure-chromium.sh)"));
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The opening tag of the element with `id` and the text right after it.
fn element<'a>(dom: &'a str, id: &str) -> (&'a str, &'a str) {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in the page"));
    let open = dom[..at].rfind('<').unwrap();
    let close = at + dom[at..].find('>').unwrap();
    let text_end = close + dom[close..].find('<').unwrap();
    (&dom[open..=close], &dom[close + 1..text_end])
}

/// The text of the first element whose opening tag contains `marker`.
fn text_after<'a>(dom: &'a str, marker: &str) -> &'a str {
    let at = dom
        .find(marker)
        .unwrap_or_else(|| panic!("no {marker} in the page"));
    let close = at + dom[at..].find('>').unwrap();
    &dom[close + 1..close + dom[close..].find('<').unwrap()]
}

fn attr(tag: &str, name: &str) -> Option<String> {
    let at = tag.find(&format!(" {name}=\""))? + name.len() + 3;
    Some(tag[at..at + tag[at..].find('"')?].to_string())
}

/// The number the page shows in `#id` (its text) and the raw value behind it.
fn shown(dom: &str, id: &str) -> (f64, f64) {
    let (tag, text) = element(dom, id);
    let raw: f64 = attr(tag, "data-value")
        .unwrap_or_else(|| panic!("#{id} was not rendered: {tag}"))
        .parse()
        .unwrap();
    let text = text
        .split_whitespace()
        .next()
        .unwrap_or("")
        .replace(',', "");
    (text.parse().unwrap_or(f64::NAN), raw)
}

/// Every `<tag ... key="...">` opening tag containing `key`.
fn tags_with<'a>(dom: &'a str, key: &str) -> Vec<&'a str> {
    dom.match_indices(&format!(" {key}=\""))
        .map(|(at, _)| &dom[dom[..at].rfind('<').unwrap()..at + dom[at..].find('>').unwrap() + 1])
        .collect()
}

async fn nack_next(c: &mut Consumer) {
    let d = tokio::time::timeout(Duration::from_secs(10), c.next())
        .await
        .expect("a delivery")
        .unwrap()
        .unwrap();
    d.nack(BasicNackOptions {
        requeue: false,
        multiple: false,
    })
    .await
    .unwrap();
}

/// Traffic: 3 held for an hour, 2 held for 115 s, one retried then
/// exhausted (rejected), one nack on a queue without a policy.
async fn traffic(nackd: &Nackd, queues: &[String; 4]) -> lapin::Connection {
    let [hour, minute, short, plain] = queues;
    let conn = nackd.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for (q, n) in [(hour, 3), (minute, 2), (short, 1), (plain, 1)] {
        declare_durable(&ch, q).await;
        for i in 0..n {
            let body = format!("{q} #{i}").into_bytes();
            ch.basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
    }
    for (q, nacks) in [(hour, 3), (minute, 2), (short, 2), (plain, 1)] {
        let mut c = consume(&conn.create_channel().await.unwrap(), q, None).await;
        for i in 0..nacks {
            if q == short && i == 1 {
                // The consumer can have the retry before the engine has its
                // confirm (two connections): the page's "newest first" list
                // needs the retry recorded before the exhaustion.
                until(nackd.metrics, "the short retry confirmed", |s| {
                    s.get("nackd_retries_confirmed_total", &[]) == 1.0
                })
                .await;
            }
            nack_next(&mut c).await;
        }
    }
    conn
}

/// Waits for every figure the test compares: held (engine), intercepted
/// (sessions, counted after the engine stored the message), passed and
/// exhausted (sessions), confirmed (engine).
async fn settled(nackd: &Nackd) -> Scrape {
    until(nackd.metrics, "the traffic settled", |s| {
        s.sum("nackd_held_messages") == 5.0
            && s.get("nackd_nacks_intercepted_total", &[]) == 6.0
            && s.sum("nackd_nacks_passed_total") == 1.0
            && s.get("nackd_exhausted_total", &[("route", "reject")]) == 1.0
            && s.get("nackd_retries_confirmed_total", &[]) == 1.0
    })
    .await
}

fn artifact(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

#[tokio::test]
async fn status_page_in_headless_chromium_shows_what_metrics_say() {
    let queues = [
        unique("page-hour"),
        unique("page-minute"),
        unique("page-short"),
        unique("page-plain"),
    ];
    let policies = format!(
        "[[policy]]\nqueues = [\"{}\"]\ndelays = [\"1h\"]\n[[policy]]\nqueues = [\"{}\"]\ndelays = [\"115s\"]\n[[policy]]\nqueues = [\"{}\"]\ndelays = [\"50ms\"]\n",
        queues[0], queues[1], queues[2]
    );
    // The 115 s ones must be in the page's "2m" bucket (due in 60 to 120 s)
    // when Chromium fetches /status.json: that leaves Chromium 55 s to start
    // on a loaded machine (this whole test took 13 s with the CPUs saturated).
    let nackd = start(&policies).await;
    let conn = traffic(&nackd, &queues).await;
    let before = settled(&nackd).await;

    let profile = tempfile::tempdir().unwrap();
    let url = format!("http://{}/", nackd.metrics);
    let dom =
        String::from_utf8(chromium(&url, profile.path(), &["--dump-dom"]).await.stdout).unwrap();
    std::fs::write(artifact("status-page.html"), &dom).unwrap();
    let png = artifact("status-page.png");
    let _ = std::fs::remove_file(&png);
    chromium(
        &url,
        profile.path(),
        &[&format!("--screenshot={}", png.display())],
    )
    .await;
    let s = scrape(nackd.metrics).await;
    assert_eq!(
        s.sum("nackd_held_messages"),
        before.sum("nackd_held_messages"),
        "traffic was quiet while the page rendered"
    );

    let body = &dom[dom.find("<body").unwrap()..];
    let rendered: u32 = attr(&body[..body.find('>').unwrap()], "data-rendered")
        .unwrap()
        .parse()
        .unwrap();
    assert!(rendered >= 1, "the page script rendered /status.json");
    for (id, metric, labels) in [
        ("clients", "nackd_client_connections", vec![]),
        ("upstream", "nackd_upstream_connections", vec![]),
        ("republishers", "nackd_republisher_connections", vec![]),
        ("intercepted", "nackd_nacks_intercepted_total", vec![]),
        ("published", "nackd_retries_published_total", vec![]),
        ("confirmed", "nackd_retries_confirmed_total", vec![]),
        ("returned", "nackd_retries_returned_total", vec![]),
        (
            "exhausted-reject",
            "nackd_exhausted_total",
            vec![("route", "reject")],
        ),
        (
            "exhausted-dead-letter",
            "nackd_exhausted_total",
            vec![("route", "dead_letter")],
        ),
    ] {
        let (text, raw) = shown(&dom, id);
        let want = s.get(metric, &labels);
        assert_eq!(
            (text, raw),
            (want, want),
            "#{id} shows {text} (raw {raw}), {metric} says {want}"
        );
    }
    assert_eq!(shown(&dom, "held"), (5.0, s.sum("nackd_held_messages")));
    assert_eq!(
        shown(&dom, "passed"),
        (1.0, s.sum("nackd_nacks_passed_total"))
    );
    assert_eq!(shown(&dom, "held-bytes").1, s.sum("nackd_held_bytes"));
    assert_eq!(
        s.get("nackd_nacks_intercepted_total", &[]),
        6.0,
        "5 held + the short one once (its second nack was exhausted)"
    );

    let rows = tags_with(&dom, "data-queue");
    assert_eq!(
        rows.len(),
        2,
        "one row per queue holding something: {rows:?}"
    );
    for row in rows {
        let queue = attr(row, "data-queue").unwrap();
        let at = dom.find(row).unwrap();
        let held = text_after(&dom[at..], "class=\"n held\"");
        let want = s.get("nackd_held_messages", &[("vhost", "/"), ("queue", &queue)]);
        assert_eq!(held.parse::<f64>().unwrap(), want, "row of {queue}");
    }
    let buckets: Vec<(String, u64)> = tags_with(&dom, "data-bucket")
        .iter()
        .map(|t| {
            (
                attr(t, "data-bucket").unwrap(),
                attr(t, "data-count").unwrap().parse().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        buckets.iter().map(|(_, n)| n).sum::<u64>(),
        5,
        "{buckets:?}"
    );
    assert!(
        buckets.contains(&("2m".to_string(), 2)) && buckets.contains(&("1h".to_string(), 3)),
        "{buckets:?}"
    );
    // The policies in force, in file order, each with its schedule.
    let policies = tags_with(&dom, "data-policy");
    assert_eq!(policies.len(), 3, "{policies:?}");
    for (i, (queue, delays)) in queues.iter().zip(["1h", "1m 55s", "50ms"]).enumerate() {
        let at = dom.find(policies[i]).unwrap();
        let row = &dom[at..at + dom[at..].find("</tr>").unwrap()];
        assert_eq!(attr(policies[i], "data-policy").unwrap(), i.to_string());
        assert!(
            row.contains(&format!(">{queue}<")) && row.contains(&format!(">delays {delays}<")),
            "policy {i}: {row}"
        );
        assert!(row.contains("rejected (the queue's DLX)"), "{row}");
    }
    let kinds: Vec<String> = tags_with(&dom, "data-kind")
        .iter()
        .map(|t| attr(t, "data-kind").unwrap())
        .collect();
    assert_eq!(kinds, ["exhausted_reject", "retried"], "newest first");

    let size = std::fs::metadata(&png)
        .expect("chromium wrote the screenshot")
        .len();
    assert!(
        size > 20_000,
        "a screenshot of a rendered page, not a blank one: {size} bytes"
    );
    conn.close(200, "".into()).await.unwrap();
    nackd.stop().await;
}

/// A phone's viewport, CSS pixels.
const PHONE: (u32, u32) = (420, 900);

/// Measures the page's layout where it is shown: the viewport and document
/// widths, every element reaching past the viewport's sides or whose
/// content overflows its own box, the links and buttons, the due chart's
/// labels, and where the readiness box is.
const MEASURE: &str = r##"(() => {
  const root = document.documentElement, vw = root.clientWidth;
  const name = (el) => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "")
    + (typeof el.className === "string" && el.className ? "." + el.className.trim().split(/\s+/).join(".") : "");
  const box = (el) => { const r = el.getBoundingClientRect(); return { name: name(el), left: r.left, right: r.right, top: r.top, bottom: r.bottom }; };
  const outside = [], overflowing = [];
  for (const el of document.body.querySelectorAll("*")) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) continue;
    if (r.left < -0.5 || r.right > vw + 0.5) outside.push(name(el) + ": " + Math.round(r.left) + ".." + Math.round(r.right));
    if (el.clientWidth > 0 && el.scrollWidth > el.clientWidth + 1) overflowing.push(name(el) + ": " + el.scrollWidth + " > " + el.clientWidth);
  }
  return {
    innerWidth, innerHeight, clientWidth: vw, scrollWidth: root.scrollWidth, scrollHeight: root.scrollHeight,
    outside, overflowing,
    controls: [...document.querySelectorAll("a, button, input, select, textarea")].map(box),
    buckets: document.querySelectorAll("#due [data-bucket]").length,
    labels: [...document.querySelectorAll("#due text:not(.count)")].map(box),
    readiness: box(document.getElementById("readiness")),
  };
})()"##;

/// The page has rendered `/status.json` and `/readyz`.
const RENDERED: &str = "Number(document.body.dataset.rendered) >= 1 \
    && document.getElementById('readiness').dataset.ready !== ''";

/// Asserts the page measured by [`MEASURE`] fits a viewport `width` wide:
/// not zoomed out, no horizontal scrolling, nothing past the sides or cut
/// off, every control on screen, the chart's labels apart, and the
/// readiness box on the first screen.
fn assert_fits(m: &serde_json::Value, width: u32) {
    let width = f64::from(width);
    assert_eq!(
        (m["innerWidth"].as_f64(), m["clientWidth"].as_f64()),
        (Some(width), Some(width)),
        "the page is shown at {width} px, not zoomed out to fit its {} px",
        m["scrollWidth"]
    );
    assert!(
        m["scrollWidth"].as_f64().unwrap() <= width,
        "the document scrolls sideways: {} px",
        m["scrollWidth"]
    );
    assert_eq!(
        m["outside"],
        serde_json::json!([]),
        "past the viewport's sides"
    );
    assert_eq!(
        m["overflowing"],
        serde_json::json!([]),
        "content wider than its box"
    );
    let controls = m["controls"].as_array().unwrap();
    assert!(!controls.is_empty(), "the page has links: {m}");
    for c in controls {
        let (l, r, t) = (
            c["left"].as_f64().unwrap(),
            c["right"].as_f64().unwrap(),
            c["top"].as_f64().unwrap(),
        );
        assert!(
            l >= 0.0 && r <= width && t >= 0.0,
            "control off screen: {c}"
        );
    }
    let labels = m["labels"].as_array().unwrap();
    assert!(
        labels.len() == m["buckets"].as_u64().unwrap() as usize && labels.len() > 1,
        "one label per bucket of the due chart: {m}"
    );
    for pair in labels.windows(2) {
        assert!(
            pair[0]["right"].as_f64() <= pair[1]["left"].as_f64(),
            "the due chart's labels overlap: {pair:?}"
        );
    }
    let readiness = &m["readiness"];
    assert!(
        readiness["top"].as_f64().unwrap() >= 0.0
            && readiness["bottom"].as_f64().unwrap() <= m["innerHeight"].as_f64().unwrap(),
        "readiness is on the first screen: {readiness}"
    );
}

/// Issue 25 item 6: at 420 px wide, with real traffic in every table (and
/// the tests' long queue names), the page fits the phone; a screenshot of
/// the whole page is 420 px wide. At 1200 px it still fits.
#[tokio::test]
async fn status_page_fits_a_phone_420_px_wide() {
    let queues = [
        unique("phone-hour"),
        unique("phone-minute"),
        unique("phone-short"),
        unique("phone-plain"),
    ];
    let policies = format!(
        "[[policy]]\nqueues = [\"{}\"]\ndelays = [\"1h\"]\n[[policy]]\nqueues = [\"{}\"]\ndelays = [\"115s\"]\n[[policy]]\nqueues = [\"{}\"]\ndelays = [\"50ms\"]\n",
        queues[0], queues[1], queues[2]
    );
    let nackd = start(&policies).await;
    let conn = traffic(&nackd, &queues).await;
    settled(&nackd).await;
    let readyz = common::ops::get(nackd.metrics, "/readyz").await;
    assert_eq!(readyz.status, 200, "{}", readyz.body);

    let profile = tempfile::tempdir().unwrap();
    let mut page = browser::Browser::start(profile.path(), PHONE.0, PHONE.1).await;
    page.open(&format!("http://{}/", nackd.metrics)).await;
    page.until("rendered", RENDERED).await;
    let shown = page
        .eval("[...document.querySelectorAll('#queues [data-queue], #recent [data-kind]')].length")
        .await;
    assert_eq!(shown, 2 + 2, "the queue and recent tables have rows");
    assert_eq!(
        page.eval("[document.getElementById('readiness').dataset.ready, document.getElementById('ready').textContent, document.getElementById('ready-reasons').children.length]").await,
        serde_json::json!(["true", "ready", 0]),
        "/readyz said 200"
    );
    let m = page.eval(MEASURE).await;
    std::fs::write(artifact("status-page-420.json"), m.to_string()).unwrap();
    let png = page.screenshot().await;
    std::fs::write(artifact("status-page-420.png"), &png).unwrap();
    assert_fits(&m, PHONE.0);
    assert_eq!(
        browser::png_size(&png),
        (PHONE.0, m["scrollHeight"].as_u64().unwrap() as u32),
        "the whole page is as wide as the phone"
    );

    page.resize(1200, 900).await;
    page.until("redrawn at 1200 px", "innerWidth === 1200")
        .await;
    assert_fits(&page.eval(MEASURE).await, 1200);
    page.close().await;
    conn.close(200, "".into()).await.unwrap();
    nackd.stop().await;
}

/// Issue 25 item 6: with a `[republish]` password the broker refuses, the
/// top of the page says "not ready", the code `/readyz` answers and its
/// reasons (the broker's reply and the user), and the long reason wraps on
/// a phone.
#[tokio::test]
async fn status_page_shows_not_ready_and_why() {
    let q = unique("phone-refused");
    let nackd = start(&format!(
        "[republish]\nusername = \"guest\"\npassword = \"not-the-password\"\n\
         [[policy]]\nqueues = [\"{q}\"]\ndelays = [\"1s\"]\n"
    ))
    .await;
    let readyz = wait_for(
        Duration::from_secs(20),
        "/readyz: the republish login refused",
        || common::ops::get(nackd.metrics, "/readyz"),
        |r| r.status == 503 && r.body.contains("ACCESS_REFUSED"),
    )
    .await;
    let body: serde_json::Value = serde_json::from_str(&readyz.body).unwrap();
    let reasons = body["reasons"].as_array().unwrap();
    assert!(
        reasons.len() == 1
            && reasons[0]
                .as_str()
                .unwrap()
                .starts_with("republish login into vhost \"/\": 403 ACCESS_REFUSED")
            && reasons[0].as_str().unwrap().contains("(user guest)"),
        "{body}"
    );

    let profile = tempfile::tempdir().unwrap();
    let mut page = browser::Browser::start(profile.path(), PHONE.0, PHONE.1).await;
    page.open(&format!("http://{}/", nackd.metrics)).await;
    page.until("rendered", RENDERED).await;
    let shown = page
        .eval(
            "[document.getElementById('readiness').dataset.ready, \
              document.getElementById('ready').textContent, \
              document.getElementById('ready-code').textContent, \
              [...document.querySelectorAll('#ready-reasons li')].map((li) => li.textContent)]",
        )
        .await;
    assert_eq!(
        shown,
        serde_json::json!(["false", "not ready", "/readyz: 503", reasons]),
        "the page says what /readyz says"
    );
    let m = page.eval(MEASURE).await;
    let png = page.screenshot().await;
    std::fs::write(artifact("status-page-not-ready-420.png"), &png).unwrap();
    assert_fits(&m, PHONE.0);
    page.close().await;
    nackd.stop().await;
}

/// The dead-letter replay form: the Replay button is off until a dry run
/// counted the messages per destination (nothing moved by it), then moves
/// exactly those back to the queue they came from.
#[tokio::test]
async fn status_page_replays_a_dead_letter_queue_after_a_dry_run() {
    const TOKEN: &str = "status-page-replay-token-0123";
    let (dlq, orig) = (unique("page-dlq"), unique("page-orig"));
    let nackd = start(&format!(
        "[metrics]\nadmin_token = \"{TOKEN}\"\n[[policy]]\nqueues = [\"{}\"]\ndelays = [\"1s\"]\n",
        unique("page-policy")
    ))
    .await;
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    declare_durable(&ch, &dlq).await;
    let mut args = lapin::types::FieldTable::default();
    let dlx = |s: &str| lapin::types::AMQPValue::LongString(s.into());
    args.insert("x-dead-letter-exchange".into(), dlx(""));
    args.insert("x-dead-letter-routing-key".into(), dlx(&dlq));
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(orig.as_str().into(), durable, args)
        .await
        .unwrap();
    for body in [b"one", b"two", b"six"] {
        ch.basic_publish(
            "".into(),
            orig.as_str().into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default(),
        )
        .await
        .unwrap();
    }
    let mut c = consume(&ch, &orig, None).await;
    for _ in 0..3 {
        let d = next(&mut c, Duration::from_secs(10)).await.unwrap();
        d.reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    ch.basic_cancel(c.tag(), BasicCancelOptions::default())
        .await
        .unwrap();
    let counts = || async {
        (
            message_count(&ch, &dlq).await,
            message_count(&ch, &orig).await,
        )
    };
    wait_for(Duration::from_secs(10), "3 dead-lettered", counts, |c| {
        *c == (3, 0)
    })
    .await;

    let profile = tempfile::tempdir().unwrap();
    let mut page = browser::Browser::start(profile.path(), 1200, 900).await;
    page.open(&format!("http://{}/", nackd.metrics)).await;
    page.until("rendered", RENDERED).await;
    assert_eq!(
        page.eval("document.getElementById('replay-go').disabled")
            .await,
        true
    );
    page.eval(&format!(
        "document.getElementById('replay-dlq').value = {dlq:?};\
         document.getElementById('replay-token').value = {TOKEN:?};\
         document.getElementById('replay-dry').click(); true"
    ))
    .await;
    page.until(
        "dry run counted",
        "!document.getElementById('replay-go').disabled",
    )
    .await;
    assert_eq!(
        page.eval("[...document.querySelectorAll('#replay-counts [data-queue]')].map(r => [r.dataset.queue, r.cells[1].dataset.value])").await,
        serde_json::json!([[orig, "3"]]),
    );
    wait_for(
        Duration::from_secs(10),
        "the dry run moved nothing",
        counts,
        |c| *c == (3, 0),
    )
    .await;
    page.eval("document.getElementById('replay-go').click(); true")
        .await;
    page.until(
        "replayed",
        "document.getElementById('replay-state').dataset.moved === '3'",
    )
    .await;
    wait_for(
        Duration::from_secs(10),
        "3 back in their queue",
        counts,
        |c| *c == (0, 3),
    )
    .await;
    page.close().await;
    delete_queues(&ch, &[&dlq, &orig]).await;
    conn.close(200, "".into()).await.unwrap();
    nackd.stop().await;
}

//! A headless Chromium driven over the DevTools protocol on a pipe
//! (`--remote-debugging-pipe`: JSON messages ending in a NUL byte, read by
//! Chromium on its fd 3 and written on its fd 4), to measure the status
//! page's layout in a viewport of a given size and to screenshot all of it.
//!
//! The viewport is set with `Emulation.setDeviceMetricsOverride`, as a
//! phone: headless Chromium keeps a window at least 500 px wide whatever
//! `--window-size` says (a 420 px `--screenshot` is the left 420 px of a
//! 500 px layout).

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use super::{CHROMIUM, CHROMIUM_FLAGS};

/// How long one DevTools call may take.
const CALL_LIMIT: Duration = Duration::from_secs(60);

/// One Chromium with one page attached.
pub struct Browser {
    child: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
    next_id: u64,
    session: String,
}

impl Browser {
    /// Starts Chromium (profile in `profile`) with a blank page of
    /// `width` x `height` CSS pixels, emulated as a phone (`mobile`: the
    /// page's `<meta name="viewport">` applies, and a page wider than the
    /// screen is zoomed out, as a phone does).
    pub async fn start(profile: &Path, width: u32, height: u32) -> Self {
        // The shell puts the pipes where Chromium looks for them.
        let mut child = Command::new("sh")
            .args(["-c", "exec \"$@\" 3<&0 4>&1 </dev/null >/dev/null", "sh"])
            .arg(CHROMIUM)
            .args(CHROMIUM_FLAGS)
            .arg("--remote-debugging-pipe")
            .arg(format!("--window-size={width},{height}"))
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {CHROMIUM} ({e}): scripts/test installs it (scripts/ensure-chromium.sh)"));
        let mut browser = Self {
            to: child.stdin.take().unwrap(),
            from: BufReader::new(child.stdout.take().unwrap()),
            child,
            next_id: 0,
            session: String::new(),
        };
        let targets = browser.call("Target.getTargets", json!({})).await;
        let page = targets["targetInfos"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["type"] == "page")
            .unwrap_or_else(|| panic!("no page in {targets}"))["targetId"]
            .clone();
        let attached = browser
            .call(
                "Target.attachToTarget",
                json!({ "targetId": page, "flatten": true }),
            )
            .await;
        browser.session = attached["sessionId"].as_str().unwrap().to_string();
        browser.resize(width, height).await;
        browser
    }

    /// Sets the viewport to `width` x `height` CSS pixels (a phone's).
    pub async fn resize(&mut self, width: u32, height: u32) {
        self.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": width, "height": height, "deviceScaleFactor": 1, "mobile": true }),
        )
        .await;
    }

    /// Loads `url`.
    pub async fn open(&mut self, url: &str) {
        let r = self.call("Page.navigate", json!({ "url": url })).await;
        assert!(r.get("errorText").is_none(), "cannot load {url}: {r}");
    }

    /// The value of the JavaScript expression `js` in the page (a promise
    /// is awaited); panics if it throws.
    pub async fn eval(&mut self, js: &str) -> Value {
        let r = self.try_eval(js).await;
        r.unwrap_or_else(|e| panic!("{js} threw: {e}"))
    }

    async fn try_eval(&mut self, js: &str) -> Result<Value, Value> {
        let r = self
            .request(
                "Runtime.evaluate",
                json!({ "expression": js, "awaitPromise": true, "returnByValue": true }),
            )
            .await?;
        match r.get("exceptionDetails") {
            Some(e) => Err(e.clone()),
            None => Ok(r["result"]["value"].clone()),
        }
    }

    /// Waits (30 s at most) until `js` is true in the page; a page still
    /// loading (the expression throws or its context goes) is waited for.
    pub async fn until(&mut self, what: &str, js: &str) {
        let start = Instant::now();
        loop {
            if self.try_eval(js).await == Ok(Value::Bool(true)) {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "never {what}: {js}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A PNG of the whole page (beyond the viewport) at one device pixel
    /// per CSS pixel.
    pub async fn screenshot(&mut self) -> Vec<u8> {
        let metrics = self.call("Page.getLayoutMetrics", json!({})).await;
        let size = &metrics["cssContentSize"];
        let shot = self
            .call(
                "Page.captureScreenshot",
                json!({ "format": "png", "captureBeyondViewport": true,
                    "clip": { "x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1 } }),
            )
            .await;
        base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap()
    }

    /// Sends `method` to the page (to the browser before one is attached)
    /// and returns its result; panics on an error.
    async fn call(&mut self, method: &str, params: Value) -> Value {
        let r = self.request(method, params).await;
        r.unwrap_or_else(|e| panic!("{method}: {e}"))
    }

    /// Sends `method` and returns its result or error, skipping the events
    /// in between.
    async fn request(&mut self, method: &str, params: Value) -> Result<Value, Value> {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({ "id": id, "method": method, "params": params });
        if !self.session.is_empty() {
            message["sessionId"] = self.session.clone().into();
        }
        self.send(&message).await;
        let answer = async {
            loop {
                let mut reply = Vec::new();
                let n = self.from.read_until(0, &mut reply).await.unwrap();
                assert!(n > 0, "{CHROMIUM} closed its DevTools pipe");
                reply.pop();
                let reply: Value = serde_json::from_slice(&reply).unwrap();
                if reply["id"] == id {
                    return reply;
                }
            }
        };
        let reply = tokio::time::timeout(CALL_LIMIT, answer)
            .await
            .unwrap_or_else(|_| panic!("{CHROMIUM} did not answer {method} in {CALL_LIMIT:?}"));
        match reply.get("error") {
            Some(e) => Err(e.clone()),
            None => Ok(reply["result"].clone()),
        }
    }

    async fn send(&mut self, message: &Value) {
        let mut bytes = serde_json::to_vec(message).unwrap();
        bytes.push(0);
        self.to.write_all(&bytes).await.unwrap();
    }

    /// Closes Chromium and waits for it (killed if it does not stop).
    pub async fn close(mut self) {
        self.send(&json!({ "id": 0, "method": "Browser.close" }))
            .await;
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
    }
}

/// Width and height of a PNG (its IHDR chunk).
pub fn png_size(png: &[u8]) -> (u32, u32) {
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    assert_eq!(&png[12..16], b"IHDR");
    let be = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
    (be(16), be(20))
}

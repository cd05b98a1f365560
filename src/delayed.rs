//! The delayed exchanges of this nackd, kept durable in the store
//! directory (`delayed-exchanges.json`) and merged with the
//! `[[delayed_exchange]]` tables at startup.
//!
//! The file is the whole list, rewritten atomically after a change (a
//! temporary file, fsynced, renamed over it, the directory fsynced), so it
//! is either the old list or the new one. A thread of its own writes it
//! (`nackd-registry`): a session only wakes it, and changes that come
//! while it writes are saved together in the next write. The list is
//! bounded per vhost (`[delayed] max_exchanges`), so is the file. A file
//! that does not parse stops startup: forgetting that an exchange is
//! delayed would publish its delayed messages at once.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock, Weak};

use serde::{Deserialize, Serialize};
use tracing::warn;

pub mod registry;

use crate::config::Config;
use nackd_core::delayed::{Change, DelayedExchange, DelayedExchanges, Persist, Version};

/// The file's name in `store.path`.
pub const FILE: &str = "delayed-exchanges.json";
const VERSION: u32 = 1;

/// The file's content.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    version: u32,
    exchanges: Vec<Entry>,
    /// With `[delayed] registry`: the changes made through this nackd and
    /// not written to the registry yet (see [`registry`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    unshared: Vec<Unshared>,
}

/// A change not in the registry yet: declared of `type`, or deleted, at
/// `at_ms` by process `origin` (its [`Version`]).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Unshared {
    vhost: String,
    name: String,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    kind: Option<String>,
    at_ms: u64,
    origin: u64,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    vhost: String,
    name: String,
    #[serde(rename = "type")]
    kind: String,
}

/// The registry file of a store directory.
pub fn path(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// The list in `dir`'s file (empty when there is none). An error names the
/// file and says what is wrong with it.
pub fn load(dir: &Path) -> Result<Vec<DelayedExchange>, String> {
    load_all(dir).map(|(list, _)| list)
}

type Loaded = (Vec<DelayedExchange>, Vec<(Change, Version)>);

fn load_all(dir: &Path) -> Result<Loaded, String> {
    let path = path(dir);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), Vec::new())),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let damaged = |why: String| {
        format!(
            "{} is damaged ({why}): it lists the exchanges nackd treats as x-delayed-message; restore it or fix it by hand",
            path.display()
        )
    };
    let file: File = serde_json::from_str(&text).map_err(|e| damaged(e.to_string()))?;
    if file.version != VERSION {
        return Err(damaged(format!(
            "version {} (this nackd reads {VERSION})",
            file.version
        )));
    }
    let list = file
        .exchanges
        .into_iter()
        .map(|e| match e.name.is_empty() || e.kind.is_empty() {
            true => Err(damaged("an exchange without a name or type".into())),
            false => Ok(DelayedExchange {
                vhost: e.vhost,
                name: e.name,
                kind: e.kind,
            }),
        })
        .collect::<Result<_, _>>()?;
    let unshared = file
        .unshared
        .into_iter()
        .map(
            |u| match u.name.is_empty() || u.kind.as_deref() == Some("") {
                true => Err(damaged("an unshared change without a name or type".into())),
                false => Ok((Change::of((u.vhost, u.name), u.kind), (u.at_ms, u.origin))),
            },
        )
        .collect::<Result<_, _>>()?;
    Ok((list, unshared))
}

/// Writes `list` and the `unshared` changes as `dir`'s file, atomically
/// and durably.
fn save_all(
    dir: &Path,
    list: &[DelayedExchange],
    unshared: &[(Change, Version)],
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let file = File {
        version: VERSION,
        exchanges: list
            .iter()
            .map(|e| Entry {
                vhost: e.vhost.clone(),
                name: e.name.clone(),
                kind: e.kind.clone(),
            })
            .collect(),
        unshared: unshared
            .iter()
            .map(|(c, (at_ms, origin))| {
                let ((vhost, name), kind) = c.clone().into_parts();
                Unshared {
                    vhost,
                    name,
                    kind,
                    at_ms: *at_ms,
                    origin: *origin,
                }
            })
            .collect(),
    };
    let mut text = serde_json::to_vec_pretty(&file).map_err(std::io::Error::other)?;
    text.push(b'\n');
    let tmp = dir.join(format!("{FILE}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&text)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path(dir))?;
    std::fs::File::open(dir)?.sync_all()
}

/// The file's list merged with the config's tables (a table wins over the
/// file on the real type).
fn merged(config: &Config, saved: Vec<DelayedExchange>) -> Vec<DelayedExchange> {
    let mut all: std::collections::BTreeMap<(String, String), String> = saved
        .into_iter()
        .map(|e| ((e.vhost, e.name), e.kind))
        .collect();
    for t in &config.delayed_exchanges {
        let key = (t.vhost.clone(), t.name.clone());
        if let Some(kind) = all.insert(key, t.kind.clone()) {
            if kind != t.kind {
                warn!(vhost = %t.vhost, exchange = %t.name, file = %kind, config = %t.kind, "delayed exchange: [[delayed_exchange]] names another type than the one declared through nackd; the table's is used");
            }
        }
    }
    all.into_iter()
        .map(|((vhost, name), kind)| DelayedExchange { vhost, name, kind })
        .collect()
}

/// What [`crate::server::preflight`] checks: the file in `store.path`
/// reads (when delayed exchanges are emulated).
pub fn check(config: &Config) -> Result<(), String> {
    match config.delayed_enabled() {
        true => load(&config.store.path).map(drop),
        false => Ok(()),
    }
}

/// The registry sessions share: the file merged with the config, kept
/// durable in `store.path`. When delayed exchanges are not emulated (no
/// `[delayed]` or `[[delayed_exchange]]`, or `enabled = false`): an empty
/// set in memory only, and the file is neither read nor written.
pub fn open(config: &Config) -> Result<Arc<DelayedExchanges>, String> {
    if !config.delayed_enabled() {
        return Ok(DelayedExchanges::disabled());
    }
    let dir = config.store.path.clone();
    let (saved, unshared) = load_all(&dir)?;
    let (from_file, from_config) = (saved.len(), config.delayed_exchanges.len());
    let initial = merged(config, saved);
    tracing::info!(
        known = initial.len(),
        from_file,
        from_config,
        file = %path(&dir).display(),
        "delayed exchanges (x-delayed-message) emulated"
    );
    let registry: Arc<OnceLock<Weak<DelayedExchanges>>> = Arc::default();
    let limit = config.delayed_settings().max_exchanges;
    let set = DelayedExchanges::new(initial, limit, Some(persist(dir, registry.clone())?));
    let _ = registry.set(Arc::downgrade(&set));
    // Kept through saves even with the registry off: written once it is on.
    set.carry(unshared);
    Ok(set)
}

/// How often a failed write of the list is tried again.
const RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// What the file holds: the list and the changes not shared yet.
type Snapshot = (Vec<DelayedExchange>, Vec<(Change, Version)>);

/// The hook sessions call after a change: it takes the registry's list as
/// it is then and hands it to the writer thread, which saves the latest it
/// got (lists that came meanwhile are skipped). The list is taken in the
/// hook, not in the thread: a change made just before the registry is
/// dropped (a stop) is saved all the same, and the drop waits for it.
fn persist(
    dir: PathBuf,
    registry: Arc<OnceLock<Weak<DelayedExchanges>>>,
) -> Result<Persist, String> {
    let (send, received) = mpsc::channel::<Snapshot>();
    let thread = std::thread::Builder::new()
        .name("nackd-registry".into())
        .spawn(move || write_latest(&dir, received))
        .map_err(|e| format!("cannot start the thread that saves delayed exchanges: {e}"))?;
    let saver = Saver {
        send: std::sync::Mutex::new(Some(send)),
        thread: Some(thread),
    };
    Ok(Box::new(move || {
        let Some(set) = registry.get().and_then(Weak::upgrade) else {
            return;
        };
        saver.send(|| (set.list(), set.unshared()));
    }))
}

/// The writer thread's end of the hook; dropped with the registry, it
/// waits for the thread's last write.
struct Saver {
    send: std::sync::Mutex<Option<mpsc::Sender<Snapshot>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Saver {
    /// Takes a snapshot and sends it, under one lock: of two changes made
    /// at once, the later snapshot is sent later.
    fn send(&self, take: impl FnOnce() -> Snapshot) {
        let send = self.send.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(send) = send.as_ref() {
            let _ = send.send(take());
        }
    }
}

impl Drop for Saver {
    fn drop(&mut self) {
        self.send.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Saves the latest snapshot received; a failed write is tried again
/// every [`RETRY`] until one succeeds or a newer snapshot comes. Once the
/// hook is gone, the last one is tried once more, then the thread ends.
fn write_latest(dir: &Path, received: mpsc::Receiver<Snapshot>) {
    let mut unsaved: Option<Snapshot> = None;
    loop {
        let next = match unsaved {
            Some(_) => received.recv_timeout(RETRY),
            None => received
                .recv()
                .map_err(|_| mpsc::RecvTimeoutError::Disconnected),
        };
        let gone = match next {
            Ok(snapshot) => {
                unsaved = Some(snapshot);
                false
            }
            Err(mpsc::RecvTimeoutError::Timeout) => false,
            Err(mpsc::RecvTimeoutError::Disconnected) => true,
        };
        while let Ok(snapshot) = received.try_recv() {
            unsaved = Some(snapshot);
        }
        if let Some((list, unshared)) = &unsaved {
            match save_all(dir, list, unshared) {
                Ok(()) => unsaved = None,
                Err(e) => {
                    tracing::error!(error = %e, file = %path(dir).display(), "cannot store the list of delayed exchanges: tried again every second, kept in memory meanwhile");
                }
            }
        }
        if gone {
            return;
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests time with the real clock
mod tests {
    use super::*;

    fn exchange(vhost: &str, name: &str, kind: &str) -> DelayedExchange {
        DelayedExchange {
            vhost: vhost.into(),
            name: name.into(),
            kind: kind.into(),
        }
    }

    fn config(dir: &Path, tables: &str) -> Config {
        let text = format!(
            "[store]\npath = {:?}\n\n[delayed]\n\n{tables}",
            dir.display().to_string()
        );
        Config::parse(&text, Path::new("x")).unwrap()
    }

    #[test]
    fn saved_lists_load_back() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load(dir.path()).unwrap(), vec![], "no file: none");
        let list = vec![exchange("/", "d", "direct"), exchange("v", "t", "topic")];
        save_all(dir.path(), &list, &[]).unwrap();
        assert_eq!(load(dir.path()).unwrap(), list);
        save_all(dir.path(), &[], &[]).unwrap();
        assert_eq!(load(dir.path()).unwrap(), vec![]);
        assert!(!dir.path().join(format!("{FILE}.tmp")).exists());
    }

    #[test]
    fn a_damaged_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        for text in [
            "{\"version\":1,\"exchanges\":[{\"vhost\":\"/\"",
            "not json",
            "{\"version\":2,\"exchanges\":[]}",
            "{\"version\":1,\"exchanges\":[{\"vhost\":\"/\",\"name\":\"\",\"type\":\"direct\"}]}",
        ] {
            std::fs::write(path(dir.path()), text).unwrap();
            let e = load(dir.path()).unwrap_err();
            assert!(e.contains(FILE) && e.contains("damaged"), "{e}");
            let e = open(&config(dir.path(), "")).err().unwrap();
            assert!(e.contains(FILE), "startup stops: {e}");
            assert!(check(&config(dir.path(), "")).is_err());
        }
    }

    #[test]
    fn a_failed_write_is_tried_again_without_a_new_change() {
        let dir = tempfile::tempdir().unwrap();
        let set = open(&config(dir.path(), "")).unwrap();
        // The file's place is taken: the rename over it fails.
        let blocker = path(dir.path());
        std::fs::create_dir_all(blocker.join("x")).unwrap();
        set.declare("/", "d", "direct");
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(blocker.is_dir(), "the write failed");
        std::fs::remove_dir_all(&blocker).unwrap();
        let began = std::time::Instant::now();
        while load(dir.path()).unwrap() != set.list() {
            assert!(
                began.elapsed() < std::time::Duration::from_secs(10),
                "never saved again"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    #[test]
    fn the_registry_merges_the_tables_and_saves_every_change() {
        let dir = tempfile::tempdir().unwrap();
        save_all(
            dir.path(),
            &[
                exchange("/", "saved", "direct"),
                exchange("/", "both", "direct"),
            ],
            &[],
        )
        .unwrap();
        let tables = "[[delayed_exchange]]\nname = \"both\"\ntype = \"topic\"\n\n[[delayed_exchange]]\nvhost = \"v\"\nname = \"table\"\n";
        let set = open(&config(dir.path(), tables)).unwrap();
        assert!(set.is_delayed("/", "saved"));
        assert!(set.is_delayed("v", "table"));
        assert_eq!(
            set.list(),
            vec![
                exchange("/", "both", "topic"),
                exchange("/", "saved", "direct"),
                exchange("v", "table", "direct"),
            ]
        );
        set.declare("/", "new", "fanout");
        set.delete("/", "saved");
        // The writer thread saves it soon after.
        let began = std::time::Instant::now();
        let on_disk = loop {
            let on_disk = load(dir.path()).unwrap();
            if on_disk == set.list() {
                break on_disk;
            }
            assert!(
                began.elapsed() < std::time::Duration::from_secs(10),
                "not saved: {on_disk:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert!(on_disk.contains(&exchange("/", "new", "fanout")));
        // A restart sees what the last one declared.
        let again = open(&config(dir.path(), "")).unwrap();
        assert!(again.is_delayed("/", "new") && !again.is_delayed("/", "saved"));
    }

    #[test]
    fn disabled_means_memory_only_and_no_file_read() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(path(dir.path()), "damaged").unwrap();
        let text = format!(
            "[store]\npath = {:?}\n[delayed]\nenabled = false\n",
            dir.path().display().to_string()
        );
        let config = Config::parse(&text, Path::new("x")).unwrap();
        assert!(check(&config).is_ok());
        let set = open(&config).unwrap();
        set.declare("/", "d", "direct");
        assert_eq!(
            std::fs::read_to_string(path(dir.path())).unwrap(),
            "damaged"
        );
    }

    /// The CI run of 2026-12-01 (a loaded machine): a declare followed at
    /// once by a stop was never saved, since the writer thread read the
    /// list only once woken, and by then the registry was gone. The list
    /// is taken when the change is made, and the registry's drop waits for
    /// the write.
    #[test]
    fn a_change_made_just_before_a_stop_is_saved_by_the_stop() {
        for round in 0..20 {
            let dir = tempfile::tempdir().unwrap();
            let set = open(&config(dir.path(), "")).unwrap();
            set.declare("/", "last", "direct");
            drop(set);
            let on_disk = load(dir.path()).unwrap();
            assert_eq!(
                on_disk,
                vec![exchange("/", "last", "direct")],
                "round {round}"
            );
        }
    }
}

//! Which embedded store should hold nackd's messages? The purpose-built hold
//! log (`nackd::store::Log`) against redb, a well-kept embedded B-tree, and
//! fjall, a well-kept embedded LSM tree, on what nackd does: park batches of
//! 1 KiB messages durably (one fsync or durable commit per batch, as group
//! commit does), delete them after their republish, and recover the index
//! at startup.
//!
//! Every engine stores the same thing: the hold log its own put record,
//! redb and fjall that same encoded record as the value under the id (u64,
//! big-endian for fjall). Header and body are random bytes, so that no
//! engine gains by compressing them (fjall compresses its deeper levels with
//! LZ4 by default; message bodies often are compressed or encrypted).
//!
//! Durable commit per batch: the hold log `commit()` (one write, one
//! fdatasync), redb a write transaction's `commit()` (its default
//! durability), fjall a write batch committed with
//! `PersistMode::SyncData` (the journal written and fdatasynced before the
//! batch applies).
//!
//! `cargo bench --bench store_engines` prints one line per figure, the
//! engines side by side, measured in the same run on the same disk, one
//! engine after the other (`sync` between them), never at the same time.
//! Sizes are allocated bytes (what `du` counts): fjall's journal files are
//! sparse files of 64 MiB, so their apparent size would overstate it.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fjall::{KeyspaceCreateOptions, PersistMode};
use nackd::store::{Held, Loc, Log, Options, Route};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

const TABLE: TableDefinition<u64, &[u8]> = TableDefinition::new("held");
/// Distinct random bodies (a prime, so neighbours in a block differ).
const POOL: usize = 1021;

/// Random header and body pairs, made once so that making them is not
/// counted in any engine's time.
fn pool() -> &'static [(Bytes, Bytes)] {
    static POOL_: OnceLock<Vec<(Bytes, Bytes)>> = OnceLock::new();
    POOL_.get_or_init(|| {
        let mut rng = fastrand::Rng::with_seed(11);
        let mut bytes = |n: usize| Bytes::from((0..n).map(|_| rng.u8(..)).collect::<Vec<u8>>());
        (0..POOL).map(|_| (bytes(300), bytes(1024))).collect()
    })
}

fn held(id: u64) -> Held {
    let (header, body) = pool()[id as usize % POOL].clone();
    Held {
        id,
        vhost: Arc::from("/"),
        queue: Arc::from("email-queue"),
        due_ms: 1_700_000_000_000 + id * 7 % 100_000,
        retry: 1,
        route: Route::Queue,
        on_return: None,
        header,
        body,
    }
}

/// due_ms sits after the 8-byte prefix, the kind and the id.
fn due_of(record: &[u8]) -> u64 {
    u64::from_be_bytes(record[17..25].try_into().unwrap())
}

// ---- the hold log ----

fn log_park(dir: &Path, total: u64, batch: u64) -> Duration {
    let (mut log, _) = Log::open(dir, Options::default()).unwrap();
    let began = Instant::now();
    let mut id = 0;
    while id < total {
        for _ in 0..batch {
            id += 1;
            log.put(&held(id), None).unwrap();
        }
        log.commit().unwrap();
    }
    began.elapsed()
}

/// Deletes everything in one commit, then reclaims as the writer thread
/// does after every commit (whole segment files go).
fn log_delete_all(dir: &Path) -> Duration {
    let (mut log, rec) = Log::open(dir, Options::default()).unwrap();
    let began = Instant::now();
    for (id, _, loc) in rec.held {
        log.del(id, loc);
    }
    log.commit().unwrap();
    log.reclaim();
    began.elapsed()
}

fn log_recover(dir: &Path) -> (Duration, usize) {
    let began = Instant::now();
    let (_, rec) = Log::open(dir, Options::default()).unwrap();
    (began.elapsed(), rec.held.len())
}

// ---- redb ----

fn redb_park(path: &Path, total: u64, batch: u64) -> Duration {
    let db = Database::create(path).unwrap();
    let began = Instant::now();
    let mut id = 0;
    while id < total {
        let tx = db.begin_write().unwrap();
        {
            let mut table = tx.open_table(TABLE).unwrap();
            for _ in 0..batch {
                id += 1;
                let rec = nackd::store::record::encode_put(&held(id));
                table.insert(id, rec.as_slice()).unwrap();
            }
        }
        tx.commit().unwrap();
    }
    began.elapsed()
}

fn redb_delete_all(path: &Path, total: u64) -> Duration {
    let db = Database::create(path).unwrap();
    let began = Instant::now();
    let tx = db.begin_write().unwrap();
    {
        let mut table = tx.open_table(TABLE).unwrap();
        for id in 1..=total {
            table.remove(id).unwrap();
        }
    }
    tx.commit().unwrap();
    began.elapsed()
}

/// Opens the database and builds the (due, id) index in due order, as
/// recovery hands it to the timing wheel.
fn redb_index(path: &Path) -> (Database, Vec<(u64, u64)>) {
    let db = Database::create(path).unwrap();
    let mut index = Vec::new();
    {
        let tx = db.begin_read().unwrap();
        let table = tx.open_table(TABLE).unwrap();
        for entry in table.iter().unwrap() {
            let (k, v) = entry.unwrap();
            index.push((due_of(v.value()), k.value()));
        }
    }
    index.sort_unstable();
    (db, index)
}

fn redb_recover(path: &Path) -> (Duration, usize) {
    let began = Instant::now();
    let (_db, index) = redb_index(path);
    (began.elapsed(), index.len())
}

// ---- fjall ----

struct Fjall {
    // The keyspace first: it holds the database open, and both must go
    // before the directory can be opened again.
    held: fjall::Keyspace,
    db: fjall::Database,
}

/// fjall with its defaults (64 MiB memtable, 32 MiB block cache, one
/// worker thread per core up to 4), one keyspace.
fn fjall_open(dir: &Path) -> Fjall {
    fjall_open_with(dir, None)
}

/// The same with another memtable size (only when the keyspace is made).
fn fjall_open_with(dir: &Path, memtable: Option<u64>) -> Fjall {
    let db = fjall::Database::builder(dir).open().unwrap();
    let held = db
        .keyspace("held", || match memtable {
            Some(bytes) => KeyspaceCreateOptions::default().max_memtable_size(bytes),
            None => KeyspaceCreateOptions::default(),
        })
        .unwrap();
    Fjall { held, db }
}

impl Fjall {
    /// A write batch that is durable (journal fdatasynced) when `commit`
    /// returns, like the hold log's commit.
    fn batch(&self) -> fjall::OwnedWriteBatch {
        self.db.batch().durability(Some(PersistMode::SyncData))
    }

    /// Memtables sealed and not yet flushed, and compactions running.
    fn busy(&self) -> usize {
        self.held.sealed_memtable_count()
            + self.db.outstanding_flushes()
            + self.db.active_compactions()
    }

    /// Waits until no flush or compaction has run for 30 ms.
    fn quiesce(&self) {
        let mut idle = 0;
        while idle < 3 {
            idle = if self.busy() == 0 { idle + 1 } else { 0 };
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Returns the time until the last batch was durable, and the time until
/// fjall had also finished the flushes and compactions the park started
/// (work an LSM tree defers; the other engines defer none).
fn fjall_park(dir: &Path, total: u64, batch: u64) -> (Duration, Duration) {
    let f = fjall_open(dir);
    let began = Instant::now();
    let mut id = 0;
    while id < total {
        let mut b = f.batch();
        for _ in 0..batch {
            id += 1;
            let rec = nackd::store::record::encode_put(&held(id));
            b.insert(&f.held, id.to_be_bytes(), rec);
        }
        b.commit().unwrap();
    }
    let durable = began.elapsed();
    f.quiesce();
    (durable, began.elapsed())
}

/// Opens the database (replaying its journal) and builds the (due, id)
/// index in due order.
fn fjall_index(dir: &Path) -> (Fjall, Vec<(u64, u64)>) {
    let f = fjall_open(dir);
    let mut index = Vec::new();
    for kv in f.held.iter() {
        let (k, v) = kv.into_inner().unwrap();
        index.push((due_of(&v), u64::from_be_bytes((*k).try_into().unwrap())));
    }
    index.sort_unstable();
    (f, index)
}

fn fjall_recover(dir: &Path) -> (Duration, usize) {
    let began = Instant::now();
    let (_f, index) = fjall_index(dir);
    (began.elapsed(), index.len())
}

/// Deletes every key in one durable batch; hands the database back open,
/// so that what it does on its own afterwards can be watched.
fn fjall_delete_all(dir: &Path, total: u64) -> (Duration, Fjall) {
    let f = fjall_open(dir);
    let began = Instant::now();
    let mut b = f.batch();
    for id in 1..=total {
        b.remove(&f.held, id.to_be_bytes());
    }
    b.commit().unwrap();
    (began.elapsed(), f)
}

/// Waits `secs` seconds with the database open and idle (no writes), and
/// says whether fjall flushed or compacted anything meanwhile.
fn fjall_idle(f: &Fjall, secs: u64) -> String {
    let before = f.db.compactions_completed();
    let mut busy_seen = 0;
    for _ in 0..secs * 10 {
        busy_seen = busy_seen.max(f.busy());
        std::thread::sleep(Duration::from_millis(100));
    }
    format!(
        "{} compactions finished, {} tables, {} journals, max {} flush/compaction jobs seen",
        f.db.compactions_completed() - before,
        f.held.table_count(),
        f.db.journal_count(),
        busy_seen
    )
}

// ---- mixed delays: 1 in 100 held long, the rest deleted a batch later ----

/// Every 100th message is held for the whole phase; the others are
/// republished (deleted) right after the next batch parks.
fn long_held(id: u64) -> bool {
    id.is_multiple_of(100)
}

/// What a mixed-delay run measured.
struct Mixed {
    /// Time in the engine (size measurements between batches excluded).
    busy: Duration,
    /// Largest size on disk seen after a batch.
    peak: u64,
    /// Size on disk at the end (only the long-held messages live).
    end: u64,
}

/// Runs the mixed-delay phase: batches of `batch` puts, each batch's
/// commit also deleting the short-held messages of the batch before; a
/// last commit deletes those of the last batch. `engine` does one commit
/// (puts, deletes) and whatever the engine does after it.
fn mixed(total: u64, batch: u64, dir: &Path, mut engine: impl FnMut(&[u64], &[u64])) -> Mixed {
    let mut busy = Duration::ZERO;
    let mut peak = 0;
    let mut previous: Vec<u64> = Vec::new();
    let mut id = 0;
    loop {
        let puts: Vec<u64> = (id + 1..=(id + batch).min(total)).collect();
        id += puts.len() as u64;
        if puts.is_empty() && previous.is_empty() {
            break;
        }
        let began = Instant::now();
        engine(&puts, &previous);
        busy += began.elapsed();
        peak = peak.max(size(dir));
        previous = puts.into_iter().filter(|id| !long_held(*id)).collect();
    }
    Mixed {
        busy,
        peak,
        end: size(dir),
    }
}

/// The hold log as nackd's writer thread runs it: commit, reclaim, then
/// compaction steps of 4 MiB while disk use calls for them, each copy
/// adopted at once as the engine does (the original released).
fn log_mixed(dir: &Path, total: u64, batch: u64, options: Options) -> Mixed {
    let (mut log, _) = Log::open(dir, options).unwrap();
    let mut locs: HashMap<u64, Loc> = HashMap::new();
    mixed(total, batch, dir, |puts, dels| {
        for &id in puts {
            locs.insert(id, log.put(&held(id), None).unwrap());
        }
        for id in dels {
            log.del(*id, locs.remove(id).unwrap());
        }
        log.commit().unwrap();
        log.reclaim();
        loop {
            let copies = log.compact(4 << 20).unwrap();
            if copies.is_empty() {
                break;
            }
            for c in copies {
                *locs.get_mut(&c.id).unwrap() = c.to;
                log.release(c.from);
            }
            log.reclaim();
        }
    })
}

fn redb_mixed(path: &Path, total: u64, batch: u64) -> Mixed {
    let db = Database::create(path).unwrap();
    mixed(total, batch, path, |puts, dels| {
        let tx = db.begin_write().unwrap();
        {
            let mut table = tx.open_table(TABLE).unwrap();
            for &id in puts {
                let rec = nackd::store::record::encode_put(&held(id));
                table.insert(id, rec.as_slice()).unwrap();
            }
            for &id in dels {
                table.remove(id).unwrap();
            }
        }
        tx.commit().unwrap();
    })
}

/// Hands the database back open, so that what it does on its own
/// afterwards can be watched.
fn fjall_mixed(f: &Fjall, dir: &Path, total: u64, batch: u64) -> Mixed {
    mixed(total, batch, dir, |puts, dels| {
        let mut b = f.batch();
        for &id in puts {
            let rec = nackd::store::record::encode_put(&held(id));
            b.insert(&f.held, id.to_be_bytes(), rec);
        }
        for &id in dels {
            b.remove(&f.held, id.to_be_bytes());
        }
        b.commit().unwrap();
    })
}

// ---- RAM: each engine alone in a child process ----

/// `VmRSS` and `VmHWM` (peak) of this process, in bytes.
fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// In a child process: `phase` (`park` or `recover`) with `engine` on
/// `path`, keeping the engine open (and the index built) while it reads
/// its RSS; prints RSS and peak RSS above what the process had before.
fn child(spec: &str) {
    let mut words = spec.split(' ');
    let (engine, phase, path, total) = (
        words.next().unwrap(),
        words.next().unwrap(),
        Path::new(words.next().unwrap()),
        words.next().unwrap().parse::<u64>().unwrap(),
    );
    if phase == "park" {
        pool();
    }
    let (base, _) = rss();
    let keep: Box<dyn std::any::Any> = match (engine, phase) {
        // Parking: only the peak counts; each park closes its engine.
        ("log", "park") => Box::new(log_park(path, total, 256)),
        ("redb", "park") => Box::new(redb_park(path, total, 256)),
        ("fjall", "park") => Box::new(fjall_park(path, total, 256).0),
        ("log", "recover") => Box::new(Log::open(path, Options::default()).unwrap()),
        ("redb", "recover") => Box::new(redb_index(path)),
        ("fjall", "recover") => Box::new(fjall_index(path)),
        _ => panic!("unknown child {spec}"),
    };
    let (now, peak) = rss();
    println!("{} {}", now.saturating_sub(base), peak.saturating_sub(base));
    drop(keep);
}

/// Runs [`child`] in a process of its own: (RSS, peak RSS) it added.
fn ram(engine: &str, phase: &str, path: &Path, total: u64) -> (u64, u64) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .env(
            "STORE_BENCH_CHILD",
            format!("{engine} {phase} {} {total}", path.display()),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut words = text.split_whitespace().map(|w| w.parse::<u64>().unwrap());
    (words.next().unwrap(), words.next().unwrap())
}

// ---- measuring ----

/// The fjall version built, from the lock file.
fn fjall_version() -> &'static str {
    let lock = include_str!("../../Cargo.lock");
    let at = lock
        .find("name = \"fjall\"\nversion = \"")
        .expect("fjall in Cargo.lock");
    let rest = &lock[at + "name = \"fjall\"\nversion = \"".len()..];
    &rest[..rest.find('"').unwrap()]
}

/// Allocated bytes under `path` (files, recursively), as `du` counts them.
/// A file the engine removes while this walks counts as gone (fjall
/// deletes tables and journals from its own threads).
fn size(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if !meta.is_dir() {
        return meta.blocks() * 512;
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| size(&e.path()))
        .sum()
}

/// With STORE_BENCH_LS set: every file under `path`, allocated and
/// apparent size (to see where an engine's bytes are).
fn ls(what: &str, path: &Path) {
    use std::os::unix::fs::MetadataExt;
    if std::env::var_os("STORE_BENCH_LS").is_none() {
        return;
    }
    fn walk(path: &Path, out: &mut Vec<(String, u64, u64)>) {
        let Ok(entries) = std::fs::read_dir(path) else {
            return;
        };
        for e in entries.filter_map(|e| e.ok()) {
            let Ok(m) = e.metadata() else {
                continue;
            };
            if m.is_dir() {
                walk(&e.path(), out);
            } else {
                out.push((e.path().display().to_string(), m.blocks() * 512, m.len()));
            }
        }
    }
    let mut files = Vec::new();
    walk(path, &mut files);
    println!("  ls {what}:");
    for (p, alloc, len) in files {
        println!("    {alloc:>12} {len:>12} {p}");
    }
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// Runs `run(engine)` for engines 0 (hold log), 1 (redb) and 2 (fjall),
/// `rounds` times, the order rotating each round, each run after a sync;
/// each engine's times in the order measured.
fn rounds_of(rounds: usize, mut run: impl FnMut(usize) -> Duration) -> [Vec<Duration>; 3] {
    let mut times: [Vec<Duration>; 3] = Default::default();
    for round in 0..rounds {
        for k in 0..3 {
            let engine = (round + k) % 3;
            settle();
            times[engine].push(run(engine));
        }
    }
    times
}

fn median(d: &[Duration]) -> Duration {
    let mut d = d.to_vec();
    d.sort_unstable();
    d[d.len() / 2]
}

fn rate(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// Load average and I/O pressure now: other work on the machine moves
/// every fsync-bound figure here.
fn load() -> String {
    let loadavg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let io = std::fs::read_to_string("/proc/pressure/io").unwrap_or_default();
    let some = io.lines().next().unwrap_or("").replace("some ", "");
    format!(
        "load average {}; I/O pressure (some) {some}",
        loadavg
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    )
}

/// Writes dirty pages out, so an engine does not pay for the one before.
fn settle() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

fn main() {
    if let Ok(spec) = std::env::var("STORE_BENCH_CHILD") {
        return child(&spec);
    }
    let total: u64 = std::env::var("STORE_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(102_400)
        / 256
        * 256;
    pool();
    println!(
        "store engines: {total} held messages of 1 KiB body + 300 B header (random bytes), on {}",
        std::env::temp_dir().display()
    );
    println!(
        "fjall {} with default options, PersistMode::SyncData per batch",
        fjall_version()
    );
    println!(
        "machine: {} CPUs; at start {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load()
    );
    let rounds: usize = std::env::var("STORE_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    println!(
        "method: {rounds} rounds of each park and each recovery, the engines' order rotating each round; median, then every round"
    );
    for batch in [1u64, 16, 256] {
        let n = if batch == 1 { total.min(2_000) } else { total };
        let mut fjall_quiet = Vec::new();
        let [l, r, f] = rounds_of(rounds, |engine| {
            let dir = tempfile::tempdir().unwrap();
            match engine {
                0 => log_park(dir.path(), n, batch),
                1 => redb_park(&dir.path().join("held.redb"), n, batch),
                _ => {
                    let (durable, quiet) = fjall_park(dir.path(), n, batch);
                    fjall_quiet.push(quiet);
                    durable
                }
            }
        });
        let per_s = |d: &[Duration]| -> String {
            let all: Vec<String> = d.iter().map(|d| format!("{:.0}", rate(n, *d))).collect();
            format!("{:>9.0} msg/s ({})", rate(n, median(d)), all.join(" "))
        };
        println!(
            "park batch={batch:<4}    hold-log {}   redb {}   fjall {}   log/redb {:.2}   log/fjall {:.2}",
            per_s(&l),
            per_s(&r),
            per_s(&f),
            median(&r).as_secs_f64() / median(&l).as_secs_f64(),
            median(&f).as_secs_f64() / median(&l).as_secs_f64()
        );
        println!(
            "  fjall batch={batch:<4} until its flushes and compactions were done too: {}",
            per_s(&fjall_quiet)
        );
    }

    let log_dir = tempfile::tempdir().unwrap();
    let redb_dir = tempfile::tempdir().unwrap();
    let fjall_dir = tempfile::tempdir().unwrap();
    let redb_path = redb_dir.path().join("held.redb");
    settle();
    log_park(log_dir.path(), total, 256);
    settle();
    redb_park(&redb_path, total, 256);
    settle();
    fjall_park(fjall_dir.path(), total, 256);
    println!(
        "size on disk        hold-log {:>9.1} MB      redb {:>9.1} MB      fjall {:>9.1} MB",
        mb(size(log_dir.path())),
        mb(size(&redb_path)),
        mb(size(fjall_dir.path()))
    );

    let [lt, rt, ft] = rounds_of(rounds, |engine| {
        let (took, n) = match engine {
            0 => log_recover(log_dir.path()),
            1 => redb_recover(&redb_path),
            _ => fjall_recover(fjall_dir.path()),
        };
        assert_eq!(n, total as usize);
        took
    });
    let secs = |d: &[Duration]| -> String {
        let all: Vec<String> = d
            .iter()
            .map(|d| format!("{:.3}", d.as_secs_f64()))
            .collect();
        format!("{:>6.3} s ({})", median(d).as_secs_f64(), all.join(" "))
    };
    println!(
        "recover index       hold-log {}   redb {}   fjall {}   log/redb {:.2}   log/fjall {:.2}",
        secs(&lt),
        secs(&rt),
        secs(&ft),
        median(&lt).as_secs_f64() / median(&rt).as_secs_f64(),
        median(&lt).as_secs_f64() / median(&ft).as_secs_f64()
    );
    settle();
    let lr = ram("log", "recover", log_dir.path(), total);
    settle();
    let rr = ram("redb", "recover", &redb_path, total);
    settle();
    let fr = ram("fjall", "recover", fjall_dir.path(), total);
    println!(
        "RAM after recover   hold-log {:>9.1} MB      redb {:>9.1} MB      fjall {:>9.1} MB   (RSS added, engine open + index of {total})",
        mb(lr.0),
        mb(rr.0),
        mb(fr.0)
    );
    println!(
        "RAM peak recovering hold-log {:>9.1} MB      redb {:>9.1} MB      fjall {:>9.1} MB",
        mb(lr.1),
        mb(rr.1),
        mb(fr.1)
    );
    {
        let log_dir = tempfile::tempdir().unwrap();
        let redb_dir = tempfile::tempdir().unwrap();
        let fjall_dir = tempfile::tempdir().unwrap();
        settle();
        let lp = ram("log", "park", log_dir.path(), total);
        settle();
        let rp = ram("redb", "park", &redb_dir.path().join("held.redb"), total);
        settle();
        let fp = ram("fjall", "park", fjall_dir.path(), total);
        println!(
            "RAM peak parking    hold-log {:>9.1} MB      redb {:>9.1} MB      fjall {:>9.1} MB   ({total} in batches of 256)",
            mb(lp.1),
            mb(rp.1),
            mb(fp.1)
        );
    }
    ls("fjall after recover", fjall_dir.path());
    println!(
        "size after recover  hold-log {:>9.1} MB      redb {:>9.1} MB      fjall {:>9.1} MB",
        mb(size(log_dir.path())),
        mb(size(&redb_path)),
        mb(size(fjall_dir.path()))
    );

    settle();
    let ld = log_delete_all(log_dir.path());
    settle();
    let rd = redb_delete_all(&redb_path, total);
    settle();
    let (fd, f) = fjall_delete_all(fjall_dir.path(), total);
    println!(
        "delete all          hold-log {:>9.0} msg/s   redb {:>9.0} msg/s   fjall {:>9.0} msg/s",
        rate(total, ld),
        rate(total, rd),
        rate(total, fd)
    );
    println!(
        "size after delete   hold-log {:>9.1} MB      redb {:>9.1} MB      fjall {:>9.1} MB",
        mb(size(log_dir.path())),
        mb(size(&redb_path)),
        mb(size(fjall_dir.path()))
    );
    ls("fjall after delete", fjall_dir.path());
    let idle = fjall_idle(&f, 5);
    println!(
        "fjall after 5 s idle (open, no writes): {:.1} MB ({idle})",
        mb(size(fjall_dir.path()))
    );
    // Not what fjall does on its own: its doc-hidden test hooks, to show
    // what it could give back.
    f.held.rotate_memtable_and_wait().unwrap();
    f.held.major_compact().unwrap();
    let idle = fjall_idle(&f, 2);
    println!(
        "fjall after a forced memtable flush + major compaction (hidden API), 2 s: {:.1} MB ({idle})",
        mb(size(fjall_dir.path()))
    );
    ls("fjall after forced compaction", fjall_dir.path());
    drop(f);
    let f = fjall_open(fjall_dir.path());
    let idle = fjall_idle(&f, 2);
    println!(
        "fjall after that, closed and opened again, 2 s: {:.1} MB ({idle})",
        mb(size(fjall_dir.path()))
    );
    ls("fjall reopened", fjall_dir.path());
    drop(f);
    mixed_phase(total);
    println!("at the end {}", load());
}

/// The case the store must handle (issue 11): most messages go within
/// moments, a few stay long, and disk use must follow what is held.
fn mixed_phase(total: u64) {
    let batch = 256;
    let long = (1..=total).filter(|id| long_held(*id)).count() as u64;
    let live = long * nackd::store::record::encode_put(&held(1)).len() as u64;
    println!(
        "mixed delays: {total} parked in batches of {batch}, 1 in 100 held to the end ({long} = {:.2} MB of records live at the end), each batch's commit deleting the other 99 of the batch before",
        mb(live)
    );
    let log_dir = tempfile::tempdir().unwrap();
    let redb_dir = tempfile::tempdir().unwrap();
    let fjall_dir = tempfile::tempdir().unwrap();
    let redb_path = redb_dir.path().join("held.redb");
    settle();
    let l = log_mixed(log_dir.path(), total, batch, Options::default());
    settle();
    let r = redb_mixed(&redb_path, total, batch);
    settle();
    let f = fjall_open(fjall_dir.path());
    let fm = fjall_mixed(&f, fjall_dir.path(), total, batch);
    println!(
        "mixed park          hold-log {:>9.0} msg/s   redb {:>9.0} msg/s   fjall {:>9.0} msg/s   log/redb {:.2}   log/fjall {:.2}",
        rate(total, l.busy),
        rate(total, r.busy),
        rate(total, fm.busy),
        r.busy.as_secs_f64() / l.busy.as_secs_f64(),
        fm.busy.as_secs_f64() / l.busy.as_secs_f64()
    );
    println!(
        "mixed disk peak     hold-log {:>9.1} MB      redb {:>9.1} MB      fjall {:>9.1} MB",
        mb(l.peak),
        mb(r.peak),
        mb(fm.peak)
    );
    println!(
        "mixed disk at end   hold-log {:>9.1} MB      redb {:>9.1} MB      fjall {:>9.1} MB   ({:.2} MB live: x{:.0} / x{:.0} / x{:.0})",
        mb(l.end),
        mb(r.end),
        mb(fm.end),
        mb(live),
        l.end as f64 / live as f64,
        r.end as f64 / live as f64,
        fm.end as f64 / live as f64
    );
    ls("fjall mixed at end", fjall_dir.path());
    let idle = fjall_idle(&f, 5);
    println!(
        "mixed fjall after 5 s idle (open, no writes): {:.1} MB ({idle})",
        mb(size(fjall_dir.path()))
    );
    drop(f);

    // The knob each engine has for this: a smaller unit of reclaiming.
    let log_dir = tempfile::tempdir().unwrap();
    let fjall_dir = tempfile::tempdir().unwrap();
    let small = Options {
        segment_bytes: 8 << 20,
        ..Options::default()
    };
    settle();
    let l = log_mixed(log_dir.path(), total, batch, small);
    settle();
    let f = fjall_open_with(fjall_dir.path(), Some(8 << 20));
    let fm = fjall_mixed(&f, fjall_dir.path(), total, batch);
    drop(f);
    println!(
        "mixed, tuned: hold-log store.segment_bytes = 8 MiB {:.0} msg/s, peak {:.1} MB, end {:.1} MB; fjall max_memtable_size = 8 MiB {:.0} msg/s, peak {:.1} MB, end {:.1} MB",
        rate(total, l.busy),
        mb(l.peak),
        mb(l.end),
        rate(total, fm.busy),
        mb(fm.peak),
        mb(fm.end)
    );
}

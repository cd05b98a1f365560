//! Which embedded store should hold nackd's messages? The purpose-built hold
//! log (`nackd::store::Log`) against redb, a well-kept embedded B-tree, on
//! what nackd does: park batches of 1 KiB messages durably (one fsync or
//! durable commit per batch, as group commit does), delete them after
//! their republish, and recover the index at startup.
//!
//! `cargo bench --bench store_engines` prints one line per figure, both
//! engines side by side, measured in the same run on the same disk.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nackd::store::{Held, Log, Route};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

const TABLE: TableDefinition<u64, &[u8]> = TableDefinition::new("held");

fn held(id: u64) -> Held {
    Held {
        id,
        vhost: Arc::from("/"),
        queue: Arc::from("email-queue"),
        due_ms: 1_700_000_000_000 + id * 7 % 100_000,
        retry: 1,
        route: Route::Queue,
        on_return: None,
        header: Bytes::from(vec![7u8; 300]),
        body: Bytes::from(vec![42u8; 1024]),
    }
}

fn log_park(dir: &std::path::Path, total: u64, batch: u64) -> Duration {
    let (mut log, _) = Log::open(dir, None).unwrap();
    let began = Instant::now();
    let mut id = 0;
    while id < total {
        for _ in 0..batch {
            id += 1;
            log.put(&held(id), None).unwrap();
        }
        log.sync().unwrap();
    }
    began.elapsed()
}

fn redb_park(path: &std::path::Path, total: u64, batch: u64) -> Duration {
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

fn log_delete_all(dir: &std::path::Path) -> Duration {
    let (mut log, rec) = Log::open(dir, None).unwrap();
    let began = Instant::now();
    for (id, _, loc) in rec.held {
        log.del(id, loc);
    }
    log.sync().unwrap();
    began.elapsed()
}

fn redb_delete_all(path: &std::path::Path, total: u64) -> Duration {
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

fn log_recover(dir: &std::path::Path) -> (Duration, usize) {
    let began = Instant::now();
    let (_, rec) = Log::open(dir, None).unwrap();
    (began.elapsed(), rec.held.len())
}

fn redb_recover(path: &std::path::Path) -> (Duration, usize) {
    let began = Instant::now();
    let db = Database::create(path).unwrap();
    let tx = db.begin_read().unwrap();
    let table = tx.open_table(TABLE).unwrap();
    let mut index = Vec::new();
    for entry in table.iter().unwrap() {
        let (k, v) = entry.unwrap();
        // due_ms sits after the 8-byte prefix, the kind and the id.
        let v = v.value();
        let due = u64::from_be_bytes(v[17..25].try_into().unwrap());
        index.push((k.value(), due));
    }
    (began.elapsed(), index.len())
}

fn size(path: &std::path::Path) -> u64 {
    if path.is_file() {
        return std::fs::metadata(path).unwrap().len();
    }
    std::fs::read_dir(path)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

fn rate(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

fn main() {
    let total: u64 = std::env::var("STORE_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(102_400)
        / 256
        * 256;
    println!(
        "store engines: {total} held messages of 1 KiB body + 300 B header, on {}",
        std::env::temp_dir().display()
    );
    for batch in [1u64, 16, 256] {
        let n = if batch == 1 { total.min(2_000) } else { total };
        let log_dir = tempfile::tempdir().unwrap();
        let redb_dir = tempfile::tempdir().unwrap();
        let l = log_park(log_dir.path(), n, batch);
        let r = redb_park(&redb_dir.path().join("held.redb"), n, batch);
        println!(
            "park batch={batch:<4} hold-log {:>9.0} msg/s   redb {:>9.0} msg/s   log/redb {:.2}",
            rate(n, l),
            rate(n, r),
            r.as_secs_f64() / l.as_secs_f64()
        );
    }
    let log_dir = tempfile::tempdir().unwrap();
    let redb_dir = tempfile::tempdir().unwrap();
    let redb_path = redb_dir.path().join("held.redb");
    log_park(log_dir.path(), total, 256);
    redb_park(&redb_path, total, 256);
    println!(
        "size on disk       hold-log {:>9} B       redb {:>9} B",
        size(log_dir.path()),
        size(&redb_path)
    );
    let (lt, ln) = log_recover(log_dir.path());
    let (rt, rn) = redb_recover(&redb_path);
    assert_eq!((ln, rn), (total as usize, total as usize));
    println!(
        "recover index      hold-log {:>9.3} s       redb {:>9.3} s   log/redb {:.2}",
        lt.as_secs_f64(),
        rt.as_secs_f64(),
        lt.as_secs_f64() / rt.as_secs_f64()
    );
    let ld = log_delete_all(log_dir.path());
    let rd = redb_delete_all(&redb_path, total);
    println!(
        "delete all         hold-log {:>9.0} msg/s   redb {:>9.0} msg/s",
        rate(total, ld),
        rate(total, rd)
    );
    println!(
        "size after delete  hold-log {:>9} B       redb {:>9} B",
        size(log_dir.path()),
        size(&redb_path)
    );
}

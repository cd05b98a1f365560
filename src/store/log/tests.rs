use super::*;
use crate::store::Route;
use bytes::Bytes;

fn held(id: u64, due: u64, body: usize) -> Held {
    Held {
        id,
        vhost: Arc::from("/"),
        queue: Arc::from("q"),
        due_ms: due,
        retry: 1,
        route: Route::Queue,
        on_return: None,
        header: Bytes::from_static(&[0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0]),
        body: Bytes::from(vec![id as u8; body]),
    }
}

#[test]
fn puts_survive_reopen_and_deletes_stick() {
    let dir = tempfile::tempdir().unwrap();
    let mut locs = Vec::new();
    {
        let (mut log, rec) = Log::open(dir.path(), None).unwrap();
        assert!(rec.held.is_empty());
        for id in 1..=10 {
            locs.push(log.put(&held(id, 1000 - id, 100), None).unwrap());
        }
        log.sync().unwrap();
        let reader = log.reader();
        assert_eq!(
            reader.read(locs[2]).unwrap().body,
            Bytes::from(vec![3u8; 100])
        );
        for id in [2u64, 4, 6] {
            log.del(id, locs[id as usize - 1]);
        }
        log.sync().unwrap();
    }
    let (log, rec) = Log::open(dir.path(), None).unwrap();
    let ids: Vec<u64> = rec.held.iter().map(|(id, _, _)| *id).collect();
    assert_eq!(ids, vec![10, 9, 8, 7, 5, 3, 1], "live ones, in due order");
    assert_eq!(rec.next_id, 11);
    let (id, due, loc) = rec.held[0];
    let back = log.reader().read(loc).unwrap();
    assert_eq!((back.id, back.due_ms), (id, due));
    let meta = rec.meta[0];
    assert_eq!(
        (meta.retry, meta.size as usize, meta.dead_letter),
        (back.retry, back.size(), false)
    );
    assert_eq!(
        rec.queues[meta.queue as usize],
        (back.vhost.clone(), back.queue.clone())
    );
    assert_eq!(rec.meta.len(), rec.held.len());
}

#[test]
fn a_segment_is_deleted_when_nothing_in_it_is_held() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), None).unwrap();
    let big = (SEGMENT_BYTES / 3) as usize;
    let a = log.put(&held(1, 1, big), None).unwrap();
    let b = log.put(&held(2, 2, big), None).unwrap();
    let c = log.put(&held(3, 3, big), None).unwrap(); // rotates
    log.sync().unwrap();
    assert_ne!(a.segment, c.segment);
    assert_eq!(segment_numbers(dir.path()).unwrap().len(), 2);
    log.del(1, a);
    log.del(2, b);
    log.sync().unwrap();
    assert_eq!(
        segment_numbers(dir.path()).unwrap(),
        vec![c.segment],
        "space reclaimed"
    );
    assert!(log.bytes() < SEGMENT_BYTES);
}

#[test]
fn corrupt_or_torn_tail_keeps_everything_before_it() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut log, _) = Log::open(dir.path(), None).unwrap();
        for id in 1..=5 {
            log.put(&held(id, id, 50), None).unwrap();
        }
        log.sync().unwrap();
    }
    let seg = segment_path(dir.path(), segment_numbers(dir.path()).unwrap()[0]);
    let mut bytes = std::fs::read(&seg).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0xff; // damage the last record
    std::fs::write(&seg, &bytes).unwrap();
    let (_, rec) = Log::open(dir.path(), None).unwrap();
    assert_eq!(
        rec.held.iter().map(|h| h.0).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    assert_eq!(rec.damaged, 1);
    // A torn write: half a record at the end of the newest segment.
    let newest = segment_path(
        dir.path(),
        *segment_numbers(dir.path()).unwrap().last().unwrap(),
    );
    let half = record::encode_put(&held(9, 9, 50));
    std::fs::write(&newest, &half[..half.len() / 2]).unwrap();
    let (_, rec) = Log::open(dir.path(), None).unwrap();
    assert_eq!(rec.held.len(), 4);
    assert_eq!(rec.damaged, 1);
}

#[test]
fn max_bytes_refuses_puts_and_a_second_opener_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), Some(1000)).unwrap();
    log.put(&held(1, 1, 500), None).unwrap();
    assert!(matches!(
        log.put(&held(2, 2, 500), None),
        Err(StoreError::Full(_))
    ));
    assert!(Log::open(dir.path(), None).is_err(), "locked by the first");
}

#[test]
fn a_reroute_supersedes_the_old_record() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut log, _) = Log::open(dir.path(), None).unwrap();
        let first = log.put(&held(1, 1, 10), None).unwrap();
        let mut moved = held(1, 1, 10);
        moved.route = Route::Exchange {
            exchange: "dlx".into(),
            routing_key: "k".into(),
        };
        log.put(&moved, Some(first)).unwrap();
        log.sync().unwrap();
    }
    let (log, rec) = Log::open(dir.path(), None).unwrap();
    assert_eq!(rec.held.len(), 1);
    let back = log.reader().read(rec.held[0].2).unwrap();
    assert!(matches!(back.route, Route::Exchange { .. }));
    assert!(rec.meta[0].dead_letter, "recovery sees the latest route");
}

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

fn small(segment_bytes: u64) -> Options {
    Options {
        max_bytes: None,
        segment_bytes,
    }
}

fn ids(rec: &Recovered) -> Vec<u64> {
    let mut ids: Vec<u64> = rec.held.iter().map(|h| h.0).collect();
    ids.sort_unstable();
    ids
}

/// How the records of segment `n` are framed (its header's salt).
pub(crate) fn framing(dir: &Path, n: u32) -> Framing {
    let bytes = std::fs::read(segment_path(dir, n)).unwrap();
    match header::format(&bytes).unwrap() {
        header::Format::Salted(h) => h.framing(),
        other => panic!("segment {n}: {other:?}"),
    }
}

fn put(log: &mut Log, id: u64, body: usize) -> Loc {
    let loc = log.put(&held(id, id, body), None).unwrap();
    log.commit().unwrap();
    loc
}

#[test]
fn puts_survive_reopen_and_deletes_stick() {
    let dir = tempfile::tempdir().unwrap();
    let mut locs = Vec::new();
    {
        let (mut log, rec) = Log::open(dir.path(), Options::default()).unwrap();
        assert!(rec.held.is_empty());
        for id in 1..=10 {
            locs.push(log.put(&held(id, 1000 - id, 100), None).unwrap());
        }
        log.commit().unwrap();
        let reader = log.reader();
        assert_eq!(
            reader.read(locs[2]).unwrap().body,
            Bytes::from(vec![3u8; 100])
        );
        for id in [2u64, 4, 6] {
            log.del(id, locs[id as usize - 1]);
        }
        log.commit().unwrap();
    }
    let (log, rec) = Log::open(dir.path(), Options::default()).unwrap();
    let ids: Vec<u64> = rec.held.iter().map(|(id, _, _)| *id).collect();
    assert_eq!(ids, vec![10, 9, 8, 7, 5, 3, 1], "live ones, in due order");
    // NEXT_ID is kept a block of ids ahead of every put, so a restart
    // goes on from there, not from the last id used.
    assert!(rec.next_id > 10, "{}", rec.next_id);
    assert_eq!(log.next_id(), rec.next_id);
    let (id, due, loc) = rec.held[0];
    let back = log.reader().read(loc).unwrap();
    assert_eq!((back.id, back.due_ms), (id, due));
    let meta = rec.meta[0];
    assert_eq!(
        (u32::from(meta.retry), meta.size as usize, meta.dead_letter),
        (back.retry, back.size(), false)
    );
    assert_eq!(
        rec.queues[meta.queue as usize],
        (back.vhost.clone(), back.queue.clone())
    );
    assert_eq!(rec.meta.len(), rec.held.len());
}

#[test]
fn the_oldest_segment_goes_once_nothing_in_it_is_live() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), small(2048)).unwrap();
    let a = put(&mut log, 1, 3000);
    let b = put(&mut log, 2, 3000); // the head was full: a new segment
    let c = put(&mut log, 3, 3000);
    assert_eq!(segment_numbers(dir.path()).unwrap().len(), 3);
    log.del(2, b);
    log.commit().unwrap();
    assert_eq!(log.reclaim(), 0, "b's segment is not the oldest");
    log.del(1, a);
    log.commit().unwrap();
    assert_eq!(log.reclaim(), 2, "a's segment, then b's");
    assert_eq!(
        segment_numbers(dir.path()).unwrap(),
        vec![c.segment, c.segment + 1],
        "c's, and the head the deletes went to"
    );
    assert_eq!(
        log.bytes(),
        u64::from(c.len) + 2 * record::DEL_LEN as u64 + 2 * header::LEN as u64,
        "c, the two deletes and the two segments' headers"
    );
}

/// Issue 11, item 1: a delete must not go before the put it cancels.
#[test]
fn deletes_of_a_pinned_segment_are_not_lost_with_their_own_segment() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut log, _) = Log::open(dir.path(), small(4096)).unwrap();
        let long = put(&mut log, 1, 100); // held for a long time
        let short: Vec<Loc> = (2..=60).map(|id| put(&mut log, id, 500)).collect();
        put(&mut log, 61, 100); // the head moved on
        for (i, loc) in short.iter().enumerate() {
            log.del(i as u64 + 2, *loc);
            log.commit().unwrap();
            log.reclaim();
        }
        assert_eq!(log.mismatched_releases(), 0);
        assert!(
            log.reader().read(long).is_ok(),
            "the long one's segment is still there"
        );
    }
    let (_, rec) = Log::open(dir.path(), small(4096)).unwrap();
    assert_eq!(ids(&rec), vec![1, 61], "no delete came undone");
}

/// Issue 11, item 2: a head that empties is closed, so it can go.
#[test]
fn light_steady_traffic_keeps_the_store_small() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), small(1 << 20)).unwrap();
    // Batches of 20 parks, each deleted by the next batch's commit.
    let mut previous = Vec::new();
    for batch in 0..150u64 {
        for (id, loc) in previous.drain(..) {
            log.del(id, loc);
        }
        for id in batch * 20..batch * 20 + 20 {
            previous.push((id, log.put(&held(id, id, 1000), None).unwrap()));
        }
        log.commit().unwrap();
        log.reclaim();
    }
    assert!(
        log.bytes() < 2 << 20,
        "3 MB went through, {} bytes stay",
        log.bytes()
    );
    assert!(segment_numbers(dir.path()).unwrap().len() <= 2);
}

/// Issue 11, item 4: a superseded record stays until the put superseding
/// it is durable.
#[test]
fn a_superseded_record_stays_until_its_successor_is_durable() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut log, _) = Log::open(dir.path(), small(4096)).unwrap();
        let first = put(&mut log, 1, 3000);
        put(&mut log, 2, 3000); // first's segment is no longer the head
        let mut moved = held(1, 1, 3000);
        moved.route = Route::Exchange {
            exchange: "dlx".into(),
            routing_key: "k".into(),
        };
        log.put(&moved, Some(first)).unwrap();
        assert_eq!(log.reclaim(), 0, "staged, not durable: the original stays");
        // A crash here: the staged put never reaches the disk.
    }
    let (log, rec) = Log::open(dir.path(), small(4096)).unwrap();
    assert_eq!(ids(&rec), vec![1, 2]);
    let back = log.reader().read(rec.held[0].2).unwrap();
    assert_eq!(back.route, Route::Queue, "the original, intact");
}

#[test]
fn a_reroute_supersedes_the_old_record() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut log, _) = Log::open(dir.path(), small(2048)).unwrap();
        let first = put(&mut log, 1, 3000);
        let mut moved = held(1, 1, 3000);
        moved.route = Route::Exchange {
            exchange: "dlx".into(),
            routing_key: "k".into(),
        };
        log.put(&moved, Some(first)).unwrap();
        log.commit().unwrap();
        assert_eq!(log.reclaim(), 1, "the original's segment went");
        assert_eq!(log.mismatched_releases(), 0);
    }
    let (log, rec) = Log::open(dir.path(), Options::default()).unwrap();
    assert_eq!(rec.held.len(), 1);
    let back = log.reader().read(rec.held[0].2).unwrap();
    assert!(matches!(back.route, Route::Exchange { .. }));
    assert!(rec.meta[0].dead_letter, "recovery sees the latest route");
}

/// Issue 11, item 5: a failed write fails every put staged with it, leaves
/// no hole, and loses no delete.
#[test]
fn a_failed_write_fails_its_whole_batch_and_leaves_no_hole() {
    let dir = tempfile::tempdir().unwrap();
    let kept;
    {
        let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
        kept = put(&mut log, 1, 100);
        let gone = put(&mut log, 2, 100);
        log.put(&held(3, 3, 100), None).unwrap();
        log.put(&held(4, 4, 100), None).unwrap();
        log.del(2, gone);
        log.faults.write_then_fail = Some(150); // record 3 whole, 4 torn
        assert!(log.commit().is_err());
        let next = log.put(&held(5, 5, 100), None).unwrap();
        let del = record::DEL_LEN as u32; // went on its own
        assert_eq!(
            (next.segment, next.offset),
            (kept.segment, kept.offset + 2 * kept.len + del),
            "the next record goes right after the durable ones"
        );
        log.commit().unwrap();
        assert!(!log.has_unwritten(), "the lost delete was written again");
        assert_eq!(log.mismatched_releases(), 0);
    }
    let (_, rec) = Log::open(dir.path(), Options::default()).unwrap();
    assert_eq!(ids(&rec), vec![1, 5], "3 and 4 were refused, 2 deleted");
    assert!(rec.damage.is_empty() && rec.torn_tail.is_none());
}

#[test]
fn a_failed_fsync_closes_the_head_and_refuses_its_puts() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
        let one = put(&mut log, 1, 100);
        log.put(&held(2, 2, 100), None).unwrap();
        log.faults.fail_sync = true;
        assert!(log.commit().is_err());
        let three = put(&mut log, 3, 100);
        assert_ne!(
            three.segment, one.segment,
            "nothing more in a head whose fsync failed"
        );
    }
    let (_, rec) = Log::open(dir.path(), Options::default()).unwrap();
    assert_eq!(ids(&rec), vec![1, 3]);
}

/// Issue 11, item 6: damage in an older segment costs that record only.
#[test]
fn damage_in_an_older_segment_skips_only_the_bad_record() {
    let dir = tempfile::tempdir().unwrap();
    let locs: Vec<Loc>;
    {
        let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
        locs = (1..=5).map(|id| put(&mut log, id, 50)).collect();
    }
    {
        let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
        put(&mut log, 6, 50); // a newer segment: the first is now an older one
    }
    let seg = segment_path(dir.path(), locs[0].segment);
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[locs[2].offset as usize + 30] ^= 0xff; // inside record 3
    std::fs::write(&seg, &bytes).unwrap();
    let (_, rec) = Log::open(dir.path(), Options::default()).unwrap();
    assert_eq!(ids(&rec), vec![1, 2, 4, 5, 6]);
    assert_eq!(rec.damage.len(), 1);
    let d = &rec.damage[0];
    assert_eq!(
        (d.segment, d.from, d.to),
        (
            locs[0].segment,
            locs[2].offset as u64,
            (locs[3].offset) as u64
        )
    );
    assert_eq!(
        std::fs::read(&seg).unwrap(),
        bytes,
        "recovery changes nothing on disk"
    );
}

#[test]
fn a_torn_tail_is_reported_as_such_and_never_written_over() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
        for id in 1..=4 {
            put(&mut log, id, 50);
        }
    }
    let newest = segment_path(
        dir.path(),
        *segment_numbers(dir.path()).unwrap().last().unwrap(),
    );
    let n = *segment_numbers(dir.path()).unwrap().last().unwrap();
    let half = framing(dir.path(), n).frame(&record::put_body(&held(9, 9, 50)));
    let mut f = OpenOptions::new().append(true).open(&newest).unwrap();
    f.write_all(&half[..half.len() / 2]).unwrap();
    let (mut log, rec) = Log::open(dir.path(), Options::default()).unwrap();
    assert_eq!(ids(&rec), vec![1, 2, 3, 4]);
    assert!(rec.damage.is_empty(), "a torn tail is not damage");
    assert!(rec.torn_tail.is_some());
    let next = put(&mut log, 10, 50);
    assert_ne!(
        segment_path(dir.path(), next.segment),
        newest,
        "a new segment"
    );
}

#[test]
fn max_bytes_refuses_puts_and_a_second_opener_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let options = Options {
        max_bytes: Some(1000),
        ..Options::default()
    };
    let (mut log, _) = Log::open(dir.path(), options).unwrap();
    log.put(&held(1, 1, 500), None).unwrap();
    assert!(matches!(
        log.put(&held(2, 2, 500), None),
        Err(StoreError::Full(_))
    ));
    assert!(
        Log::open(dir.path(), Options::default()).is_err(),
        "locked by the first"
    );
}

/// Issue 11, item 7: a long-held message does not pin a day of traffic.
#[test]
fn compaction_moves_a_long_held_message_and_frees_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let segment = 8192;
    let mut long;
    {
        let (mut log, _) = Log::open(dir.path(), small(segment)).unwrap();
        long = put(&mut log, 1, 200);
        for id in 2..=200 {
            let loc = put(&mut log, id, 1000);
            log.del(id, loc);
            log.commit().unwrap();
            log.reclaim();
            for copy in log.compact(1 << 20).unwrap() {
                assert_eq!((copy.id, copy.from), (1, long));
                log.release(copy.from); // the engine adopts the copy
                long = copy.to;
            }
            log.reclaim();
            assert!(
                log.bytes() <= 2 * log.live_bytes() + 2 * segment + 1100,
                "{} bytes on disk for {} live",
                log.bytes(),
                log.live_bytes()
            );
        }
        assert_eq!(log.mismatched_releases(), 0);
        assert_ne!(long.segment, 1, "it moved");
    }
    let (log, rec) = Log::open(dir.path(), small(segment)).unwrap();
    assert_eq!(ids(&rec), vec![1]);
    assert_eq!(log.reader().read(rec.held[0].2).unwrap().body.len(), 200);
}

/// A message body may hold any bytes, records of this log included. A crash
/// that tears the write of such a message must not make recovery read the
/// record inside its body: here a delete of a held message.
#[test]
fn a_record_inside_a_torn_body_is_not_read() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
        let one = put(&mut log, 1, 50); // held: acked upstream
        let mut body = framing(dir.path(), one.segment).frame(&record::del_body(1));
        body.extend_from_slice(&[0u8; 100]);
        let mut crafted = held(2, 2, 0);
        crafted.body = Bytes::from(body);
        let loc = log.put(&crafted, None).unwrap();
        // The process dies while writing it: the embedded delete reached
        // the file, the end of the body did not.
        log.crash(loc.len as usize - 50);
    }
    let (_, rec) = Log::open(dir.path(), Options::default()).unwrap();
    assert_eq!(ids(&rec), vec![1], "the held message is still held");
    assert!(rec.damage.is_empty(), "{:?}", rec.damage);
    assert!(rec.torn_tail.is_some());
}

/// The same inside a damaged record of an older segment: the damage costs
/// that record, not what its body happens to look like.
#[test]
fn a_record_inside_a_damaged_body_is_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let crafted_at;
    {
        let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
        let one = put(&mut log, 1, 50);
        let mut body = vec![7u8; 100];
        body.extend_from_slice(&framing(dir.path(), one.segment).frame(&record::del_body(1)));
        let mut crafted = held(2, 2, 0);
        crafted.body = Bytes::from(body);
        crafted_at = log.put(&crafted, None).unwrap();
        log.commit().unwrap();
        put(&mut log, 3, 50);
    }
    let seg = segment_path(dir.path(), crafted_at.segment);
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[crafted_at.offset as usize + 70] ^= 0x01; // bit rot in its body
    std::fs::write(&seg, &bytes).unwrap();
    {
        let (_, rec) = Log::open(dir.path(), Options::default()).unwrap(); // no longer the newest
        assert_eq!(ids(&rec), vec![1, 3]);
    }
    let (_, rec) = Log::open(dir.path(), Options::default()).unwrap();
    assert_eq!(ids(&rec), vec![1, 3], "only the damaged record is lost");
    assert_eq!(rec.damage.len(), 1);
    let d = &rec.damage[0];
    assert_eq!(
        (d.from, d.to),
        (
            u64::from(crafted_at.offset),
            u64::from(crafted_at.offset + crafted_at.len)
        ),
        "the damaged record, exactly"
    );
}

/// An id is never handed out twice, even once every record of it is gone:
/// the replica's streams keep completed ids, and a message under a reused
/// id would be taken for the completed one.
#[test]
fn ids_never_go_back_once_their_records_are_gone() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut log, rec) = Log::open(dir.path(), Options::default()).unwrap();
        assert_eq!(rec.next_id, 1);
        for id in 1..=3 {
            let loc = put(&mut log, id, 10);
            log.del(id, loc);
            log.commit().unwrap();
        }
    }
    let mut last = 4;
    for _ in 0..3 {
        // The first reopen finds the records and drops their segment.
        let (_, rec) = Log::open(dir.path(), Options::default()).unwrap();
        assert!(rec.held.is_empty());
        assert!(rec.next_id >= last, "{} after {last}", rec.next_id);
        last = rec.next_id;
    }
}

/// A put whose record would be too large to read back is refused (its nack
/// goes to the broker), never acked and then lost as damage.
#[test]
fn a_message_too_large_to_read_back_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
    let mut big = held(1, 1, 0);
    big.body = Bytes::from(vec![0u8; record::MAX_BODY - 30]); // + header etc.
    assert!(matches!(log.put(&big, None), Err(StoreError::Full(_))));
    assert!(!log.has_staged());
}

/// Deletes are what frees a full disk, so they never wait on puts: when a
/// batch does not fit, its deletes are written again on their own at once
/// (a few bytes fit where the puts did not), not only with the next batch,
/// which under steady nacks brings puts that do not fit either.
#[test]
fn deletes_do_not_wait_on_puts_that_do_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
        let a = put(&mut log, 1, 100);
        log.del(1, a);
        log.put(&held(2, 2, 3000), None).unwrap();
        log.faults.write_then_fail = Some(50); // the disk is full
        assert!(log.commit().is_err(), "the put is refused");
        assert!(!log.has_unwritten(), "the delete went on its own");
        assert_eq!(log.live_bytes(), 0);
        assert_eq!(log.mismatched_releases(), 0);
    }
    let (_, rec) = Log::open(dir.path(), Options::default()).unwrap();
    assert!(rec.held.is_empty());
}

/// A disk the store fills itself must still take the deletes of what it
/// holds, or it never frees again: puts stop while the free space is down
/// to those deletes (plus a little), deletes go on.
#[test]
fn puts_leave_room_on_the_disk_for_the_deletes_of_what_is_held() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
    let a = put(&mut log, 1, 100);
    let b = log.put(&held(2, 2, 100), None).unwrap();
    let deletes = 3 * record::DEL_LEN as u64; // of 1, 2, and the next
    log.faults.free_bytes = Some(HEADROOM + deletes + u64::from(b.len) - 1);
    log.commit().unwrap();
    assert!(matches!(
        log.put(&held(3, 3, 100), None),
        Err(StoreError::Io(_))
    ));
    log.del(1, a);
    log.del(2, b);
    log.commit().unwrap();
    assert_eq!(log.live_bytes(), 0, "the deletes went in");
    log.faults.free_bytes = None; // space is back: the next put sees it
    assert!(log.put(&held(3, 3, 100), None).is_ok(), "room again");
}

/// Compaction keeps the same room: copies that would eat it would leave the
/// deletes of what is held without a place, and the disk full for good.
#[test]
fn compaction_leaves_room_on_the_disk_for_the_deletes_too() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), small(8192)).unwrap();
    let long = put(&mut log, 1, 2000);
    for id in 2..=30 {
        let loc = put(&mut log, id, 1000);
        log.del(id, loc);
        log.commit().unwrap();
    }
    assert!(log.wants_compaction());
    let deletes = 2 * record::DEL_LEN as u64; // of 1, and one more
    log.faults.free_bytes = Some(HEADROOM + deletes + u64::from(long.len) - 1);
    log.commit().unwrap();
    assert!(log.compact(1 << 20).unwrap().is_empty(), "no room to copy");
    log.faults.free_bytes = None;
    let copies = log.compact(1 << 20).unwrap();
    assert_eq!(copies.len(), 1, "room again");
}

/// Issue 19: a restart takes puts before the older segments are read. New
/// ids never collide with old ones (NEXT_ID is kept ahead of every put),
/// the older segments come back whole once read, and a crash before they
/// are merged loses nothing on either side.
#[test]
fn puts_are_taken_while_older_segments_wait_to_be_read() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut log, _) = Log::open(dir.path(), small(4096)).unwrap();
        for id in 1..=40 {
            log.put(&held(id, id, 200), None).unwrap();
        }
        log.commit().unwrap();
    }
    let new_ids = {
        let (mut log, backlog) = Log::open_deferred(dir.path(), small(4096)).unwrap();
        assert!(log.recovering() && !backlog.is_empty());
        let first = log.next_id();
        assert!(first > 40);
        let a = log.put(&held(first, 1, 10), None).unwrap();
        log.put(&held(first + 1, 2, 10), None).unwrap();
        log.commit().unwrap();
        log.del(first, a);
        log.commit().unwrap();
        assert_eq!(
            log.reclaim(),
            0,
            "nothing goes before the older segments are known"
        );
        assert!(!log.wants_compaction());
        // The process dies here, before the older segments were merged.
        vec![first + 1]
    };
    let (mut log, mut backlog) = Log::open_deferred(dir.path(), small(4096)).unwrap();
    let (rec, segments) = backlog.read().unwrap();
    log.merge(segments);
    assert!(!log.recovering());
    let mut ids: Vec<u64> = rec.held.iter().map(|h| h.0).collect();
    ids.sort_unstable();
    let want: Vec<u64> = (1..=40).chain(new_ids).collect();
    assert_eq!(ids, want, "old and new, the new delete applied");
    assert!(log.next_id() > *want.last().unwrap());
}

/// A store written by an older nackd (its NEXT_ID, if any, bounds nothing)
/// is read whole at the open: its ids are known before any is given.
#[test]
fn a_store_without_an_id_bound_is_read_before_it_takes_puts() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
        for id in 1..=5 {
            log.put(&held(id, id, 10), None).unwrap();
        }
        log.commit().unwrap();
    }
    // As an older nackd left it: ids 1..=5 on disk, NEXT_ID saying 2.
    std::fs::write(dir.path().join("NEXT_ID"), "2\n").unwrap();
    let (log, mut backlog) = Log::open_deferred(dir.path(), Options::default()).unwrap();
    assert!(log.next_id() > 5, "{}", log.next_id());
    assert!(!log.recovering() && backlog.is_empty());
    let (rec, _) = backlog.read().unwrap();
    assert_eq!(rec.held.len(), 5);
}

/// Review of issue 19: puts taken while the older segments wait to be read
/// must still leave the disk room for the deletes of everything held, the
/// older messages included (a disk nackd fills itself must take the
/// deletes, they are what frees it). Before the older segments are read
/// their live puts are not counted, so a restart on a tight disk let new
/// puts take the room of the old messages' deletes: once merged and fired,
/// those deletes did not fit and nothing could free the disk again.
#[test]
fn puts_during_recovery_leave_room_for_the_deletes_of_the_older_messages() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let old = 100_000u64; // their deletes: 1.7 MB, more than the headroom
    let mut locs = Vec::new();
    {
        let (mut log, _) = Log::open(dir.path(), Options::default()).unwrap();
        for id in 1..=old {
            locs.push((id, log.put(&held(id, id, 1), None).unwrap()));
        }
        log.commit().unwrap();
    }
    let (mut log, mut backlog) = Log::open_deferred(dir.path(), Options::default()).unwrap();
    let disk = Arc::new(AtomicU64::new(8 << 20)); // what is left of it
    log.faults.disk = Some(disk.clone());
    log.read_free();
    let first = log.next_id();
    let mut id = first;
    while let Ok(loc) = log.put(&held(id, id, 1000), None) {
        log.commit().unwrap();
        locs.push((id, loc));
        id += 1;
    }
    assert!(id > first, "some new puts are taken");
    let (_, segments) = backlog.read().unwrap();
    log.merge(segments);
    // Every held message completes: each delete must find room.
    for chunk in locs.chunks(4096) {
        for (id, loc) in chunk {
            log.del(*id, *loc);
        }
        let free = disk.load(Ordering::SeqCst);
        assert!(
            log.commit().is_ok(),
            "deletes do not fit: {free} bytes free, {} held",
            log.live_puts
        );
    }
    assert_eq!(log.live_bytes(), 0);
}

/// Review 2: a segment whose creation failed after its header was written
/// (its fsync, or the directory's, failed: a disk error, a full disk) is
/// created again at the next rotation. Opened for appending, the file got a
/// second header behind the first: records went after both, framed with the
/// second salt, at offsets the log counted from the first. Nothing in the
/// segment read back, at once or after a restart (all reported damaged).
#[test]
fn a_segment_created_again_after_a_failed_attempt_starts_afresh() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), small(4096)).unwrap();
    let head = log.head;
    let mut locs = Vec::new();
    let mut id = 0;
    while log.segments[&head].size < 4096 {
        id += 1;
        locs.push((id, put(&mut log, id, 200)));
    }
    // The head is full: the next put rotates. What a failed attempt to
    // create the next segment left: its header, and nothing after it.
    let sealed = Some((head, log.segments[&head].size));
    let next = segment_path(dir.path(), head + 1);
    std::fs::write(&next, Header::new(head + 1, sealed).encode()).unwrap();
    for _ in 0..10 {
        id += 1;
        locs.push((id, put(&mut log, id, 200)));
    }
    assert_eq!(locs.last().unwrap().1.segment, head + 1);
    let reader = log.reader();
    for (id, loc) in &locs {
        assert_eq!(reader.read(*loc).map(|h| h.id).ok(), Some(*id), "{loc:?}");
    }
    drop(log);
    let (_, rec) = Log::open(dir.path(), small(4096)).unwrap();
    assert!(rec.damage.is_empty(), "{:?}", rec.damage);
    assert_eq!(ids(&rec), (1..=id).collect::<Vec<_>>());
}

/// A store of ids 1..=40 whose NEXT_ID was lowered by hand to 30, opened
/// deferred.
fn open_with_next_id_lowered(dir: &std::path::Path) -> (Log, Backlog) {
    {
        let (mut log, _) = Log::open(dir, Options::default()).unwrap();
        for id in 1..=40 {
            log.put(&held(id, id, 10), None).unwrap();
        }
        log.commit().unwrap();
    }
    std::fs::write(dir.join("NEXT_ID"), "ahead 30\n").unwrap();
    Log::open_deferred(dir, Options::default()).unwrap()
}

/// Review 2, finding 6: a NEXT_ID lowered by hand lets new messages take
/// ids older records have. Nothing can tell before the older segments are
/// read; once they are, it is reported (not silently passed), and ids
/// continue above every record.
#[test]
fn a_next_id_lowered_by_hand_is_reported_at_the_merge() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, mut backlog) = open_with_next_id_lowered(dir.path());
    assert_eq!(
        log.next_id(),
        30,
        "the file is believed until the older ids are known"
    );
    log.put(&held(30, 1, 10), None).unwrap();
    log.put(&held(31, 1, 10), None).unwrap();
    log.commit().unwrap();
    let (_, segments) = backlog.read().unwrap();
    log.merge(segments);
    let report = log.take_report().expect("a report");
    assert_eq!(
        report
            .damage
            .iter()
            .map(|d| (d.from, d.to, d.bad))
            .collect::<Vec<_>>(),
        vec![(30, 32, Harm::IdsBehind)]
    );
    assert_eq!(report.damaged_bytes(), 0, "ids, not bytes");
    assert!(log.next_id() > 40);
}

/// The same NEXT_ID with no new message parked before the merge: no id
/// was shared, nothing to report.
#[test]
fn a_low_next_id_costs_nothing_when_no_id_was_given_before_the_merge() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, mut backlog) = open_with_next_id_lowered(dir.path());
    let (_, segments) = backlog.read().unwrap();
    log.merge(segments);
    let report = log.take_report().unwrap_or_default();
    assert_eq!(report, Default::default(), "nothing to report");
    assert!(log.next_id() > 40);
}

#[test]
fn a_clock_mark_that_is_no_time_or_far_ahead_stops_the_store_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let huge = "9".repeat(1 << 20);
    for text in ["garbage", "", huge.as_str()] {
        std::fs::write(dir.path().join(CLOCK), text).unwrap();
        let e = Log::open(dir.path(), Options::default()).err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{text:.20}: {e}");
        assert!(e.to_string().contains(CLOCK), "{e}");
    }
    let now_ms = 1_800_000_000_000;
    let day = CLOCK_AHEAD_MAX.as_millis() as u64;
    std::fs::write(dir.path().join(CLOCK), (now_ms + day + 1).to_string()).unwrap();
    let e = check_clock_mark(dir.path(), now_ms).unwrap_err();
    assert!(
        e.to_string().contains(CLOCK) && e.to_string().contains("ahead"),
        "{e}"
    );
    // Ahead within the bound (a clock set back): taken.
    std::fs::write(dir.path().join(CLOCK), (now_ms + 3_600_000).to_string()).unwrap();
    check_clock_mark(dir.path(), now_ms).unwrap();
    assert_eq!(
        read_clock_mark(dir.path()).unwrap(),
        Some(now_ms + 3_600_000)
    );
    drop(Log::open(dir.path(), Options::default()).unwrap());
}

//! Where held messages are kept until they are republished and confirmed:
//! the hold log, numbered segment files of checksummed records, appended
//! by one writer thread.
//!
//! # Invariants
//!
//! 1. **A put is durable only after the fsync that covers its bytes.** The
//!    writer answers a put after that fsync and not before; the session
//!    acks upstream only on that answer. A failed write or fsync fails
//!    every put staged with it, and the head is cut back to its durable
//!    length (or closed for good if it cannot be), so no later record is
//!    ever written behind a hole and no location is reused.
//! 2. **A delete is durable once its record's fsync succeeded.** Until
//!    then its put counts as live; a delete record lost to a failed commit
//!    is written again at once on its own (it never waits on puts that do
//!    not fit), else at the next commit. Deletes that do not fit because
//!    another process filled the disk are written into the space of the
//!    store's reserve file (`reserve`), and the engine fires nothing more
//!    until the reserve is back and every delete is written
//!    ([`Event::Firing`]): what needs that space is bounded by what was
//!    already fired.
//! 3. **A delete stays on disk as long as the put it cancels can be read at
//!    recovery.** A delete record is always newer than its put, and segment
//!    files are removed oldest first only, each removal made durable before
//!    the next: a delete goes no earlier than every put it could cancel.
//! 4. **Disk use is bounded by the held bytes**: when the files on disk
//!    exceed twice the live bytes plus one segment, compaction copies the
//!    oldest segment's live puts to the head (each body framed anew with
//!    the head's salt), and fsyncs
//!    them; the old segment goes only once every copy has superseded its
//!    original (the engine adopts it) and nothing in it is live.
//! 5. **Recovery never drops an answered record silently, and never takes
//!    bytes it did not write for a record.** It reads every segment in order
//!    (the latest put of an id wins, a delete removes it), skips damaged
//!    records one by one, keeps reading after them, and reports every
//!    skipped range with its file and offsets (`nackd_store_damaged_bytes`,
//!    `nackd_store_damaged_ranges`, the status page). Only a torn tail at the
//!    end of the newest segment, a record that runs past the end of the
//!    file (a write the crash interrupted and nobody was answered for), is
//!    cut off (`nackd_store_torn_bytes`); the log then continues in a fresh
//!    segment, never behind it.
//! 6. **New messages never wait for recovery.** `NEXT_ID` is kept a block
//!    of ids ahead of every record written (durably, before the record),
//!    so a restart opens a fresh head at once ([`Log::open_deferred`]) and
//!    gives new messages ids no older record has; their puts and deletes
//!    go to the head while a thread reads the older segments, which
//!    [`Log::merge`] brings in after. Reclaiming and compaction wait for
//!    the merge (they need every segment counted). Records in the head are
//!    newer than every older one, so a crash at any point recovers as if
//!    the older segments had been read first. A `NEXT_ID` lowered by hand
//!    is found at the merge and reported (`Harm::IdsBehind`).
//!
//! # Format and damage
//!
//! Each segment starts with a checksummed header (format 2: magic, version,
//! its number, a random salt, the previous segment's number and the length
//! it was sealed at) and each record's check is xxh3-64 over its length and
//! body keyed by that salt ([`header`], [`record`]). The salt never leaves
//! the file, so a message body cannot pass as records, not even with a
//! byte-exact copy of a record of another segment: after damage, recovery
//! may look for the next record anywhere. What damage costs:
//!
//! - a damaged put: that message is lost, reported with its id;
//! - a damaged delete: its message is held again and may be republished
//!   once more (at-least-once holds), reported with its id;
//! - damaged framing or garbage: the range up to the next record that
//!   checks; the puts in it are lost, the deletes in it may re-deliver;
//! - a damaged header: the whole segment, and the length of the segment
//!   before it can no longer be checked;
//! - a sealed segment shorter than its successor's header says: the
//!   missing bytes are reported as above; longer: the bytes past the seal
//!   are ignored and reported (also what a failed write nackd could not cut
//!   back leaves);
//! - a segment missing from the numbering (segments are numbered one after
//!   the other and only the oldest go): reported with its sealed length.
//!
//! Not told from normal operation: the oldest segment removed (as if
//! reclaimed), the newest cut mid-record (a torn write) or on a record
//! boundary (as if the writer had not written further), a file system
//! that leaves zeros after a crash (reported as damage, though nothing in
//! it was answered). Segments of an older nackd (format 1: no header,
//! unkeyed crc32) are read, but after damage in one nothing more of it is
//! read (a body could pass for records there): the rest of it is reported.
//! New segments are always format 2, and compaction re-frames the records
//! it copies, so format 1 segments go as their messages do.
//!
//! RAM keeps, per held message, its location and a few bytes of liveness
//! bookkeeping; bodies are read back when due.

#[cfg(test)]
mod damage_tests;
mod header;
pub mod inspect;
mod log;
#[cfg(test)]
mod model_tests;
pub mod record;
mod recover;
mod reserve;
mod scan;
mod segment;
mod writer;

pub use log::{
    check_clock_mark, read_clock_mark, segment_numbers, write_clock_mark, Backlog, Log, Options,
    Reader, Relocation, Segments, CLOCK, SEGMENT_BYTES,
};
pub use recover::{Recovered, Report};
pub use reserve::RESERVE_BYTES;
pub use scan::{scan, Damage, Harm};
pub use segment::{segment_path, Loc};
pub use writer::{spawn_writer, Busy, Event, WriteOp, Writer, Written};

pub use nackd_core::held::{Held, HeldMeta, Route, StoreError};

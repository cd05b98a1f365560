//! What nackd writes to its streams, one record per AMQP message body.
//!
//! ```text
//! generation stream  nackd.<instance>.g<N>
//!   put    = 1 copy:u8 record            (a hold-log put record, checksummed)
//!   done   = 2 n:u32 id:u64 * n          (completed ids)
//!   puts   = 3 n:u32 (len:u32 record) * n
//!                                        (new puts that came together)
//!   marker = 4 nonce:u128                (read-to-end marker)
//!   moved  = 5 copy:u8 from:str16 epoch:u64 record
//!                                        (a put parked by an adoption of `from`)
//!   moved puts = 6 from:str16 epoch:u64 n:u32 (len:u32 record) * n
//!                                        (moved puts of one intent that
//!                                         came together)
//! directory stream   nackd.<instance>
//!   generation = 16 n:u64                (the generation to read)
//!   epoch      = 17 n:u64 holder:str16 [count:u16 node:str16 * count]
//!                                        (a lease acquisition, with the
//!                                         holder's upstream.addresses)
//!   adopted    = 18 by:str16 [epoch:u64] (another instance took everything;
//!                                         with the epoch of its intent)
//!   adopting   = 19 by:str16 epoch:u64   (another instance's intent to adopt)
//!   adopted part = 20 by:str16 epoch:u64 n:u32 (theirs:u64 ours:u64) * n
//!                                        (part of an intent committed: these
//!                                         messages of the instance are the
//!                                         adopter's, under its ids)
//!   marker     = 4 nonce:u128
//! registry stream    nackd.instances
//!   instance   = 32 name:str16           (an instance id that may hold messages)
//!   marker     = 4 nonce:u128
//! delayed exchanges  nackd.delayed-exchanges ([delayed] registry)
//!   delayed    = 33 at:u64 origin:u64 vhost:str16 name:str16 type:str16
//!                                        (declared x-delayed-message)
//!   undelayed  = 34 at:u64 origin:u64 vhost:str16 name:str16 (deleted)
//!   (at: ms since the epoch on the maker's clock; origin: a number each
//!   process draws at random; of one exchange's records the highest
//!   (at, origin) wins)
//!   marker     = 4 nonce:u128
//! ```
//!
//! Folding a generation is order-independent for completions: ids are
//! never reused, so an id completed anywhere in the stream is dead, even
//! if a copy of its put comes later (compaction copies are written while
//! new records keep coming). Among puts of one id, a put that is not a
//! copy beats a copy, else the later one wins.
//!
//! An adoption is one intent: the adopter writes it (`adopting`, a
//! new epoch) to the adopted directory before it parks anything, parks
//! each message as a `moved` put naming that intent, and commits with an
//! `adopted` record carrying the same epoch. A `moved` put counts only
//! once its intent is committed: the fold says which intent each put
//! came with ([`Fold::intent`]), and the reader asks the adopted
//! instance's directory. An adopter killed half way leaves puts that
//! never count, and the adopted instance's stream still holds them all.
//!
//! An adoption commits in parts: an `adopted part` record of the intent
//! names messages of the adopted instance (their id there, and the
//! adopter's id for its moved put) that are the adopter's from then on,
//! whatever happens to the intent. A moved put counts once its intent is
//! committed, or once a part of it names its id; every reader of the
//! adopted instance's stream (an adopter after it, the instance itself
//! come back) leaves out the messages a part names.

use bytes::{Buf, BufMut, Bytes};

use crate::store::record::{self as store_record, View};
use crate::store::Held;

const PUT: u8 = 1;
const DONE: u8 = 2;
const PUTS: u8 = 3;
const MARKER: u8 = 4;
const MOVED: u8 = 5;
const MOVED_PUTS: u8 = 6;
const GENERATION: u8 = 16;
const EPOCH: u8 = 17;
const ADOPTED: u8 = 18;
const ADOPTING: u8 = 19;
const ADOPTED_PART: u8 = 20;
const INSTANCE: u8 = 32;
const DELAYED: u8 = 33;
const UNDELAYED: u8 = 34;

/// Most ids in one done record.
pub const DONE_MAX: usize = 8192;

/// Most messages in one adopted part record (16 bytes each: 512 KiB).
pub const PART_MAX: usize = 32_768;

/// A record of a generation stream or of the directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// A held message (`copy`: written by compaction, not by a park).
    Put {
        /// A compaction copy.
        copy: bool,
        /// The hold-log put record, prefix included.
        record: Bytes,
    },
    /// Several held messages in one stream message (parks that came
    /// together): readers see them as one `Put` each, in order.
    Puts(Vec<Bytes>),
    /// A held message parked by an adoption (`copy`: written by compaction).
    Moved {
        /// A compaction copy.
        copy: bool,
        /// The adoption it came with: it counts once that one is committed.
        from: Intent,
        /// The hold-log put record, prefix included.
        record: Bytes,
    },
    /// Several held messages parked by one adoption, in one stream
    /// message: readers see them as one `Moved` each, in order.
    MovedPuts {
        /// The adoption they came with.
        from: Intent,
        /// Their hold-log put records, prefix included.
        records: Vec<Bytes>,
    },
    /// Completed messages.
    Done(Vec<u64>),
    /// The end of what a reader must read.
    Marker(u128),
    /// The generation stream that holds the held set.
    Generation(u64),
    /// A lease acquisition.
    Epoch {
        /// Its number.
        n: u64,
        /// Who took it (process and host, for logs).
        holder: String,
        /// The holder's `upstream.addresses`, in order: every process of
        /// an id must list the same (none from older versions).
        nodes: Option<Vec<String>>,
    },
    /// Every held message was adopted by another instance (the commit
    /// of its intent, when `epoch` names one).
    Adopted {
        /// The adopting instance.
        by: String,
        /// The epoch of its [`Record::Adopting`] (none from older versions).
        epoch: Option<u64>,
    },
    /// Another instance is about to adopt every held message: its parks
    /// name this epoch, and count once an `Adopted` with it follows.
    Adopting {
        /// The adopting instance.
        by: String,
        /// Unique among the directory's intents.
        epoch: u64,
    },
    /// Part of an intent committed: these messages of the adopted
    /// instance are the adopter's from now on (see the module's text).
    AdoptedPart {
        /// The adopting instance.
        by: String,
        /// The epoch of its [`Record::Adopting`].
        epoch: u64,
        /// Each message: its id in the adopted instance, and the id of
        /// the adopter's moved put of it. At most [`PART_MAX`].
        moved: Vec<(u64, u64)>,
    },
    /// An instance id that may hold messages (registry).
    Instance {
        /// Its id.
        name: String,
    },
    /// An exchange declared `x-delayed-message` through some instance.
    Delayed {
        /// When it was made (ms since the epoch).
        at: u64,
        /// The writing process's number.
        origin: u64,
        /// Virtual host.
        vhost: String,
        /// Exchange.
        name: String,
        /// Its real type (`x-delayed-type`).
        kind: String,
    },
    /// A delayed exchange deleted through some instance.
    Undelayed {
        /// When it was made (ms since the epoch).
        at: u64,
        /// The writing process's number.
        origin: u64,
        /// Virtual host.
        vhost: String,
        /// Exchange.
        name: String,
    },
}

/// An adoption's intent: the instance adopted, and the epoch its
/// adopter wrote to that instance's directory before parking anything.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Intent {
    /// The adopted instance.
    pub from: String,
    /// The epoch of the adopter's [`Record::Adopting`].
    pub epoch: u64,
}

/// Why a stream message is not a record nackd wrote.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("not a nackd replica record")]
pub struct Malformed;

impl Record {
    /// A put of `held`.
    pub fn put(held: &Held, copy: bool) -> Self {
        Self::Put {
            copy,
            record: Bytes::from(store_record::encode_put(held)),
        }
    }

    /// A put of `held`, parked by the adoption `from`.
    pub fn moved(held: &Held, from: Intent) -> Self {
        Self::Moved {
            copy: false,
            from,
            record: Bytes::from(store_record::encode_put(held)),
        }
    }

    /// A put's copy flag and hold-log record (a moved put's too).
    pub fn as_put(&self) -> Option<(bool, &Bytes)> {
        match self {
            Self::Put { copy, record } | Self::Moved { copy, record, .. } => Some((*copy, record)),
            _ => None,
        }
    }

    /// This put as a compaction copy (a moved put keeps its intent).
    pub fn into_copy(self) -> Self {
        match self {
            Self::Put { record, .. } => Self::Put { copy: true, record },
            Self::Moved { from, record, .. } => Self::Moved {
                copy: true,
                from,
                record,
            },
            other => other,
        }
    }

    /// The message body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Self::Put { copy, record } => {
                out.put_u8(PUT);
                out.put_u8(u8::from(*copy));
                out.put_slice(record);
            }
            Self::Moved { copy, from, record } => {
                out.put_u8(MOVED);
                out.put_u8(u8::from(*copy));
                put_str16(&mut out, &from.from);
                out.put_u64(from.epoch);
                out.put_slice(record);
            }
            Self::Puts(records) => {
                out.put_u8(PUTS);
                put_records(&mut out, records);
            }
            Self::MovedPuts { from, records } => {
                out.put_u8(MOVED_PUTS);
                put_str16(&mut out, &from.from);
                out.put_u64(from.epoch);
                put_records(&mut out, records);
            }
            Self::Done(ids) => {
                out.put_u8(DONE);
                out.put_u32(ids.len() as u32);
                ids.iter().for_each(|id| out.put_u64(*id));
            }
            Self::Marker(nonce) => {
                out.put_u8(MARKER);
                out.put_u128(*nonce);
            }
            Self::Generation(_)
            | Self::Epoch { .. }
            | Self::Adopted { .. }
            | Self::Adopting { .. }
            | Self::AdoptedPart { .. } => self.encode_directory(&mut out),
            Self::Instance { .. } | Self::Delayed { .. } | Self::Undelayed { .. } => {
                self.encode_registry(&mut out);
            }
        }
        out
    }

    /// The records of a directory.
    fn encode_directory(&self, out: &mut Vec<u8>) {
        match self {
            Self::Generation(n) => {
                out.put_u8(GENERATION);
                out.put_u64(*n);
            }
            Self::Epoch { n, holder, nodes } => {
                out.put_u8(EPOCH);
                out.put_u64(*n);
                put_str16(out, holder);
                nodes.iter().for_each(|nodes| put_list16(out, nodes));
            }
            Self::Adopted { by, epoch } => {
                out.put_u8(ADOPTED);
                put_str16(out, by);
                if let Some(epoch) = epoch {
                    out.put_u64(*epoch);
                }
            }
            Self::Adopting { by, epoch } => {
                out.put_u8(ADOPTING);
                put_str16(out, by);
                out.put_u64(*epoch);
            }
            Self::AdoptedPart { by, epoch, moved } => {
                out.put_u8(ADOPTED_PART);
                put_str16(out, by);
                out.put_u64(*epoch);
                out.put_u32(moved.len() as u32);
                for (theirs, ours) in moved {
                    out.put_u64(*theirs);
                    out.put_u64(*ours);
                }
            }
            _ => unreachable!("encode writes the others"),
        }
    }

    /// The records of the registries (instances, delayed exchanges).
    fn encode_registry(&self, out: &mut Vec<u8>) {
        match self {
            Self::Instance { name } => {
                out.put_u8(INSTANCE);
                put_str16(out, name);
            }
            Self::Delayed {
                at,
                origin,
                vhost,
                name,
                kind,
            } => {
                out.put_u8(DELAYED);
                out.put_u64(*at);
                out.put_u64(*origin);
                [vhost, name, kind].iter().for_each(|s| put_str16(out, s));
            }
            Self::Undelayed {
                at,
                origin,
                vhost,
                name,
            } => {
                out.put_u8(UNDELAYED);
                out.put_u64(*at);
                out.put_u64(*origin);
                [vhost, name].iter().for_each(|s| put_str16(out, s));
            }
            _ => unreachable!("encode writes the others"),
        }
    }

    /// Reads a message body.
    pub fn decode(body: &[u8]) -> Result<Self, Malformed> {
        let mut b = body;
        let kind = take_u8(&mut b)?;
        let record = match kind {
            PUT => take_put(&mut b)?,
            PUTS => Self::Puts(take_records(&mut b)?),
            MOVED_PUTS => take_moved_puts(&mut b)?,
            DONE => take_done(&mut b)?,
            MARKER if b.remaining() == 16 => Self::Marker(b.get_u128()),
            GENERATION if b.remaining() == 8 => Self::Generation(b.get_u64()),
            EPOCH => {
                let n = take_u64(&mut b)?;
                let holder = take_str16(&mut b)?;
                let nodes = match b.remaining() {
                    0 => None,
                    _ => {
                        let count = take_u16(&mut b)?;
                        let nodes = (0..count).map(|_| take_str16(&mut b));
                        Some(nodes.collect::<Result<Vec<_>, _>>()?)
                    }
                };
                Self::Epoch { n, holder, nodes }
            }
            MOVED => take_moved(&mut b)?,
            ADOPTED => Self::Adopted {
                by: take_str16(&mut b)?,
                epoch: match b.remaining() {
                    0 => None,
                    _ => Some(take_u64(&mut b)?),
                },
            },
            ADOPTING => Self::Adopting {
                by: take_str16(&mut b)?,
                epoch: take_u64(&mut b)?,
            },
            ADOPTED_PART => take_adopted_part(&mut b)?,
            INSTANCE => Self::Instance {
                name: take_str16(&mut b)?,
            },
            DELAYED => Self::Delayed {
                at: take_u64(&mut b)?,
                origin: take_u64(&mut b)?,
                vhost: take_str16(&mut b)?,
                name: take_str16(&mut b)?,
                kind: take_str16(&mut b)?,
            },
            UNDELAYED => Self::Undelayed {
                at: take_u64(&mut b)?,
                origin: take_u64(&mut b)?,
                vhost: take_str16(&mut b)?,
                name: take_str16(&mut b)?,
            },
            _ => return Err(Malformed),
        };
        if !b.is_empty() {
            return Err(Malformed);
        }
        Ok(record)
    }

    /// The records a stream message stands for, one by one (a batch of
    /// puts is several `Put`s, a batch of moved puts several `Moved`s).
    pub fn flatten(self) -> Vec<Record> {
        match self {
            Self::Puts(records) => records
                .into_iter()
                .map(|record| Self::Put {
                    copy: false,
                    record,
                })
                .collect(),
            Self::MovedPuts { from, records } => records
                .into_iter()
                .map(|record| Self::Moved {
                    copy: false,
                    from: from.clone(),
                    record,
                })
                .collect(),
            one => vec![one],
        }
    }

    /// The message a put record holds.
    pub fn held(record: &[u8]) -> Option<Held> {
        match store_record::at(record) {
            Ok((View::Put(p), _)) => Some(p.to_held()),
            _ => None,
        }
    }
}

/// What reading a generation asks of the store, record by record.
#[allow(clippy::large_enum_variant)] // moved once per message or state change: boxing buys nothing
#[derive(Debug)]
pub enum Step {
    /// Hold this message (a later put of the same id supersedes an earlier one).
    Put(Held),
    /// Forget this message (held by an earlier step).
    Drop(u64),
}

/// Reads a generation stream record by record, keeping only ids (never
/// bodies): the store the steps are applied to holds the messages.
#[derive(Debug, Default)]
pub struct Fold {
    done: std::collections::HashSet<u64>,
    /// Ids held so far, and whether their put was a compaction copy.
    live: std::collections::HashMap<u64, bool>,
    /// Highest id seen in a put or a completion.
    max_id: u64,
    /// The adoption each held id parked by one came with.
    intents: std::collections::HashMap<u64, Intent>,
}

impl Fold {
    /// The steps `record` calls for.
    pub fn apply(&mut self, record: Record) -> Vec<Step> {
        match record {
            Record::Puts(_) | Record::MovedPuts { .. } => record
                .flatten()
                .into_iter()
                .flat_map(|one| self.apply(one))
                .collect(),
            Record::Put { copy, record } => self.put(copy, &record, None),
            Record::Moved { copy, from, record } => self.put(copy, &record, Some(from)),
            Record::Done(ids) => ids
                .into_iter()
                .filter_map(|id| {
                    self.max_id = self.max_id.max(id);
                    self.done.insert(id);
                    self.intents.remove(&id);
                    self.live.remove(&id).map(|_| Step::Drop(id))
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// A put (moved by the adoption `from`, if any). An id keeps the
    /// intent it was first moved with: a later version of it (a re-route)
    /// is written once it fired, which it does only once committed.
    fn put(&mut self, copy: bool, record: &[u8], from: Option<Intent>) -> Vec<Step> {
        let Some(held) = Record::held(record) else {
            return Vec::new();
        };
        let id = held.id;
        self.max_id = self.max_id.max(id);
        let beaten = copy && self.live.get(&id) == Some(&false);
        if self.done.contains(&id) || beaten {
            return Vec::new();
        }
        self.live.insert(id, copy);
        if let Some(from) = from {
            self.intents.entry(id).or_insert(from);
        }
        vec![Step::Put(held)]
    }

    /// The adoption a held id was parked by: it counts only once that
    /// adoption is committed in the adopted instance's directory.
    pub fn intent(&self, id: u64) -> Option<&Intent> {
        self.intents.get(&id)
    }

    /// Ids held after every record so far.
    pub fn held(&self) -> usize {
        self.live.len()
    }

    /// The first id no record so far used: a store rebuilt from the stream
    /// must not hand out an id a completion in it already names.
    pub fn next_id(&self) -> u64 {
        self.max_id + 1
    }
}

fn put_str16(out: &mut Vec<u8>, s: &str) {
    let bytes = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
    out.put_u16(bytes.len() as u16);
    out.put_slice(bytes);
}

/// A count, then each string (at most `u16::MAX` of them).
fn put_list16(out: &mut Vec<u8>, list: &[String]) {
    let list = &list[..list.len().min(u16::MAX as usize)];
    out.put_u16(list.len() as u16);
    list.iter().for_each(|s| put_str16(out, s));
}

/// The rest of a put: its copy flag, then one whole hold-log put record
/// (the rest of the body).
fn take_put(b: &mut &[u8]) -> Result<Record, Malformed> {
    let copy = take_u8(b)? != 0;
    let record = take_record(b)?;
    Ok(Record::Put { copy, record })
}

/// The rest of a moved put: its copy flag, its intent, then one whole
/// hold-log put record (the rest of the body).
fn take_moved(b: &mut &[u8]) -> Result<Record, Malformed> {
    let copy = take_u8(b)? != 0;
    let from = take_str16(b)?;
    let epoch = take_u64(b)?;
    let record = take_record(b)?;
    Ok(Record::Moved {
        copy,
        from: Intent { from, epoch },
        record,
    })
}

/// The rest of a batch of moved puts: their intent, then the puts as in
/// a batch of puts.
fn take_moved_puts(b: &mut &[u8]) -> Result<Record, Malformed> {
    let from = take_str16(b)?;
    let epoch = take_u64(b)?;
    Ok(Record::MovedPuts {
        from: Intent { from, epoch },
        records: take_records(b)?,
    })
}

/// One whole hold-log put record: the rest of the body.
fn take_record(b: &mut &[u8]) -> Result<Bytes, Malformed> {
    let (view, len) = store_record::at(b).map_err(|_| Malformed)?;
    if !matches!(view, View::Put(_)) || len != b.len() {
        return Err(Malformed);
    }
    let record = Bytes::copy_from_slice(b);
    *b = &[];
    Ok(record)
}

/// A count, then each hold-log put record after its length.
fn put_records(out: &mut Vec<u8>, records: &[Bytes]) {
    out.put_u32(records.len() as u32);
    for record in records {
        out.put_u32(record.len() as u32);
        out.put_slice(record);
    }
}

/// The rest of a batch of puts: a count, then each hold-log put record
/// after its length.
fn take_records(b: &mut &[u8]) -> Result<Vec<Bytes>, Malformed> {
    let n = take_u32(b)? as usize;
    let mut records = Vec::with_capacity(n.min(4096));
    for _ in 0..n {
        let len = take_u32(b)? as usize;
        if b.remaining() < len {
            return Err(Malformed);
        }
        let (one, rest) = b.split_at(len);
        match store_record::at(one) {
            Ok((View::Put(_), l)) if l == len => {}
            _ => return Err(Malformed),
        }
        records.push(Bytes::copy_from_slice(one));
        *b = rest;
    }
    Ok(records)
}

/// The rest of an adopted part: its adopter, its epoch, then the pairs
/// (no more than [`PART_MAX`], and exactly as many as it says).
fn take_adopted_part(b: &mut &[u8]) -> Result<Record, Malformed> {
    let by = take_str16(b)?;
    let epoch = take_u64(b)?;
    let n = take_u32(b)? as usize;
    if n > PART_MAX || b.remaining() != n * 16 {
        return Err(Malformed);
    }
    let moved = (0..n).map(|_| (b.get_u64(), b.get_u64())).collect();
    Ok(Record::AdoptedPart { by, epoch, moved })
}

/// The rest of a done record: a count, then exactly that many ids.
fn take_done(b: &mut &[u8]) -> Result<Record, Malformed> {
    let n = take_u32(b)? as usize;
    if b.remaining() != n * 8 {
        return Err(Malformed);
    }
    Ok(Record::Done((0..n).map(|_| b.get_u64()).collect()))
}

fn take_u8(b: &mut &[u8]) -> Result<u8, Malformed> {
    (b.remaining() >= 1).then(|| b.get_u8()).ok_or(Malformed)
}

fn take_u16(b: &mut &[u8]) -> Result<u16, Malformed> {
    (b.remaining() >= 2).then(|| b.get_u16()).ok_or(Malformed)
}

fn take_u32(b: &mut &[u8]) -> Result<u32, Malformed> {
    (b.remaining() >= 4).then(|| b.get_u32()).ok_or(Malformed)
}

fn take_u64(b: &mut &[u8]) -> Result<u64, Malformed> {
    (b.remaining() >= 8).then(|| b.get_u64()).ok_or(Malformed)
}

fn take_str16(b: &mut &[u8]) -> Result<String, Malformed> {
    let len = b
        .remaining()
        .ge(&2)
        .then(|| b.get_u16() as usize)
        .ok_or(Malformed)?;
    if b.remaining() < len {
        return Err(Malformed);
    }
    let s = std::str::from_utf8(&b[..len]).map_err(|_| Malformed)?;
    let s = s.to_string();
    b.advance(len);
    Ok(s)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::store::Route;
    use std::sync::Arc;

    /// A held message for the tests (of the task too).
    pub(in crate::replica) fn held(id: u64) -> Held {
        Held {
            id,
            vhost: Arc::from("/"),
            queue: Arc::from("q"),
            due_ms: 77,
            retry: 2,
            route: Route::Queue,
            on_return: None,
            header: Bytes::from_static(b"hdr"),
            body: Bytes::from_static(b"body"),
        }
    }

    /// A delayed publish (issue 23) travels to the replica and back (to
    /// an adopter or a rebuilt store) with its route.
    #[test]
    fn a_delayed_held_message_round_trips() {
        let h = Held {
            queue: Arc::from("later"),
            retry: 0,
            route: Route::Delayed {
                exchange: "later".into(),
                routing_key: "k".into(),
            },
            ..held(5)
        };
        for r in [Record::put(&h, false), Record::put(&h, true)] {
            let back = Record::decode(&r.encode()).unwrap();
            assert_eq!(back, r);
            let Some((_, record)) = back.as_put() else {
                panic!("{back:?}")
            };
            let held = Record::held(record).unwrap();
            assert_eq!((held.id, held.due_ms, held.retry), (5, h.due_ms, 0));
            assert_eq!(
                (&*held.queue, &held.route, &held.on_return),
                ("later", &h.route, &None)
            );
            assert_eq!((held.header, held.body), (h.header.clone(), h.body.clone()));
        }
        let intent = intent("a", 2);
        let moved = Record::moved(&h, intent);
        let back = Record::decode(&moved.encode()).unwrap();
        let Some((_, record)) = back.as_put() else {
            panic!("{back:?}")
        };
        assert_eq!(Record::held(record).unwrap().route, h.route);
    }

    #[test]
    fn every_record_round_trips_and_garbage_is_refused() {
        let records = [
            Record::put(&held(9), true),
            Record::Done(vec![1, 2, u64::MAX]),
            Record::Marker(u128::MAX - 3),
            Record::Generation(4),
            Record::Epoch {
                n: 7,
                holder: "pid 1 on host".into(),
                nodes: None,
            },
            Record::Epoch {
                n: 8,
                holder: "pid 2 on host".into(),
                nodes: Some(vec!["a:5672".into(), "b:5672".into()]),
            },
            Record::Epoch {
                n: 9,
                holder: "pid 3 on host".into(),
                nodes: Some(Vec::new()),
            },
            Record::Adopted {
                by: "b".into(),
                epoch: None,
            },
            Record::Adopted {
                by: "b".into(),
                epoch: Some(3),
            },
            Record::Adopting {
                by: "b".into(),
                epoch: 3,
            },
            Record::moved(&held(4), intent("a", 2)),
            Record::Instance {
                name: "host-a".into(),
            },
            Record::AdoptedPart {
                by: "b".into(),
                epoch: 3,
                moved: vec![(7, 70), (u64::MAX, 1)],
            },
            Record::AdoptedPart {
                by: "b".into(),
                epoch: 4,
                moved: vec![],
            },
        ];
        for r in records {
            let wire = r.encode();
            assert_eq!(Record::decode(&wire), Ok(r.clone()));
            assert_eq!(Record::decode(&wire[..wire.len() - 1]), Err(Malformed));
        }
        let Record::Put { record, .. } = Record::put(&held(9), false) else {
            unreachable!()
        };
        assert_eq!(Record::held(&record).unwrap().id, 9);
        assert_eq!(Record::decode(b""), Err(Malformed));
        assert_eq!(Record::decode(b"\x04short"), Err(Malformed));
        assert_eq!(Record::decode(b"\x63junk"), Err(Malformed));
    }

    #[test]
    fn delayed_exchange_records_round_trip() {
        let records = [
            Record::Delayed {
                at: 1_700_000_000_000,
                origin: u64::MAX - 1,
                vhost: "/".into(),
                name: "orders-later".into(),
                kind: "topic".into(),
            },
            Record::Undelayed {
                at: 3,
                origin: 7,
                vhost: "v".into(),
                name: "orders-later".into(),
            },
        ];
        for r in records {
            let wire = r.encode();
            assert_eq!(Record::decode(&wire), Ok(r.clone()));
            assert_eq!(Record::decode(&wire[..wire.len() - 1]), Err(Malformed));
        }
    }

    /// An intent for the tests (of the task too).
    pub(in crate::replica) fn intent(from: &str, epoch: u64) -> Intent {
        Intent {
            from: from.into(),
            epoch,
        }
    }

    #[test]
    fn an_adopted_record_of_an_older_version_reads_as_one_without_an_epoch() {
        let mut old = vec![ADOPTED];
        put_str16(&mut old, "b");
        assert_eq!(
            Record::decode(&old),
            Ok(Record::Adopted {
                by: "b".into(),
                epoch: None
            })
        );
        old.push(0);
        assert_eq!(Record::decode(&old), Err(Malformed), "a torn epoch");
    }

    /// Issue 36: a part names at most PART_MAX messages, exactly as many
    /// as it says: a longer one, or one with a pair torn or too many, is
    /// refused before anything is allocated for it.
    #[test]
    fn an_adopted_part_says_how_many_and_stays_within_its_bound() {
        let part = |n: u32, pairs: usize| {
            let mut wire = vec![ADOPTED_PART];
            put_str16(&mut wire, "b");
            wire.put_u64(1);
            wire.put_u32(n);
            (0..pairs).for_each(|k| {
                wire.put_u64(k as u64);
                wire.put_u64(k as u64 + 100);
            });
            wire
        };
        let full = Record::decode(&part(PART_MAX as u32, PART_MAX)).unwrap();
        assert!(matches!(full, Record::AdoptedPart { moved, .. } if moved.len() == PART_MAX));
        let over = PART_MAX as u32 + 1;
        assert_eq!(Record::decode(&part(over, over as usize)), Err(Malformed));
        assert_eq!(Record::decode(&part(u32::MAX, 1)), Err(Malformed));
        assert_eq!(Record::decode(&part(2, 1)), Err(Malformed));
        assert_eq!(Record::decode(&part(1, 2)), Err(Malformed));
        let mut torn = part(1, 1);
        torn.pop();
        assert_eq!(Record::decode(&torn), Err(Malformed));
    }

    #[test]
    fn moved_puts_are_puts_that_name_their_intent_until_completed() {
        let mut fold = Fold::default();
        let mut moved = held(5);
        moved.retry = 3;
        let steps: Vec<Step> = [
            put(1, 1, false),
            Record::moved(&moved, intent("a", 2)),
            Record::moved(&held(6), intent("a", 2)).into_copy(),
            put(6, 1, false), // a re-route of 6 after it fired
            Record::Done(vec![5]),
        ]
        .into_iter()
        .flat_map(|r| fold.apply(r))
        .collect();
        assert_eq!(steps.len(), 5);
        assert!(matches!(&steps[1], Step::Put(h) if h.id == 5 && h.retry == 3));
        assert_eq!(fold.intent(1), None);
        assert_eq!(
            fold.intent(5),
            None,
            "completed: its intent no longer matters"
        );
        assert_eq!(
            fold.intent(6),
            Some(&intent("a", 2)),
            "kept by its re-route"
        );
        assert_eq!(fold.held(), 2);
        let copy = Record::moved(&held(7), intent("a", 2)).into_copy();
        assert_eq!(copy.as_put().map(|(c, _)| c), Some(true));
        assert!(matches!(copy, Record::Moved { ref from, .. } if *from == intent("a", 2)));
    }

    fn put(id: u64, retry: u32, copy: bool) -> Record {
        let mut h = held(id);
        h.retry = retry;
        Record::put(&h, copy)
    }

    #[test]
    fn a_completion_anywhere_kills_the_id_and_copies_never_beat_parks() {
        let mut fold = Fold::default();
        let steps: Vec<Step> = [
            put(1, 1, false),
            Record::Done(vec![2]), // completed before its copy arrives
            put(2, 1, true),
            put(3, 1, false),
            put(3, 2, false), // a re-route: the later put
            put(3, 1, true),  // an older compaction copy comes after it
            put(1, 1, true),
            Record::Done(vec![1]),
        ]
        .into_iter()
        .flat_map(|r| fold.apply(r))
        .collect();
        let kinds: Vec<(char, u64, u32)> = steps
            .iter()
            .map(|s| match s {
                Step::Put(h) => ('p', h.id, h.retry),
                Step::Drop(id) => ('d', *id, 0),
            })
            .collect();
        assert_eq!(
            kinds,
            vec![('p', 1, 1), ('p', 3, 1), ('p', 3, 2), ('d', 1, 0)]
        );
        assert_eq!(fold.held(), 1);
        assert_eq!(fold.next_id(), 4, "completed ids count too");
    }

    #[test]
    fn a_batch_of_puts_is_its_puts_in_order() {
        let bytes = |r: Record| match r {
            Record::Put { record, .. } => record,
            _ => unreachable!(),
        };
        let batch = Record::Puts(vec![
            bytes(put(1, 1, false)),
            bytes(put(2, 1, false)),
            bytes(put(1, 2, false)),
        ]);
        let wire = batch.encode();
        assert_eq!(Record::decode(&wire), Ok(batch.clone()));
        assert_eq!(Record::decode(&wire[..wire.len() - 1]), Err(Malformed));
        let mut bad = wire.clone();
        bad[9] ^= 0xff; // inside the first put: its checksum fails
        assert_eq!(Record::decode(&bad), Err(Malformed));
        assert_eq!(
            batch.clone().flatten(),
            vec![put(1, 1, false), put(2, 1, false), put(1, 2, false)]
        );
        let mut fold = Fold::default();
        let steps = fold.apply(batch);
        assert_eq!(steps.len(), 3);
        assert_eq!(fold.held(), 2);
        assert_eq!(fold.next_id(), 3);
    }

    #[test]
    fn a_batch_of_moved_puts_is_its_moved_puts_in_order_each_with_the_intent() {
        let bytes = |r: Record| match r {
            Record::Put { record, .. } => record,
            _ => unreachable!(),
        };
        let from = intent("a", 7);
        let batch = Record::MovedPuts {
            from: from.clone(),
            records: vec![bytes(put(4, 1, false)), bytes(put(5, 3, false))],
        };
        let wire = batch.encode();
        assert_eq!(Record::decode(&wire), Ok(batch.clone()));
        for cut in 1..wire.len() {
            assert_eq!(Record::decode(&wire[..cut]), Err(Malformed), "cut at {cut}");
        }
        let moved = |id, retry| {
            Record::moved(
                &{
                    let mut h = held(id);
                    h.retry = retry;
                    h
                },
                from.clone(),
            )
        };
        assert_eq!(batch.clone().flatten(), vec![moved(4, 1), moved(5, 3)]);
        let mut fold = Fold::default();
        assert_eq!(fold.apply(batch).len(), 2);
        assert_eq!(fold.intent(4), Some(&from));
        assert_eq!(fold.intent(5), Some(&from));
        assert_eq!(fold.held(), 2);
    }
}

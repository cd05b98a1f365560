//! A hierarchical timing wheel with one-tick resolution (the engine's tick
//! is a microsecond; the engine itself fires on a 1 ms grid, see
//! `WAKE_GRID_US` in the retry engine, so that messages due within one
//! millisecond leave together).
//!
//! Nine levels of 64 slots; level `n` slots are `64^n` ticks wide, so the
//! wheel spans 64^9 µs (about 570 years); an entry due later waits in the
//! top level and is placed again as it turns. Insert is O(1): the level is
//! picked from the highest bit in which the due time differs from the wheel's time. An
//! entry of a higher level is moved down ("cascaded") when its slot comes up,
//! until it sits in a level-0 slot of exactly its tick. An entry fires
//! only once `now >= due`: never early.
//!
//! Memory per entry: its `(due, item)` pair in a slot's chunks. A slot
//! keeps its entries in chunks of at most [`CHUNK`], not one growing
//! vector: a slot holding millions (a million messages parked for the same
//! hour sit in one or two slots) never leaves more than one chunk unused,
//! where a doubling vector can leave half of its memory unused.

const BITS: u32 = 6;
const SLOTS: usize = 1 << BITS;
const LEVELS: usize = 9;

/// Time on the wheel's own clock, in ticks.
pub type Ticks = u64;

/// Most entries in one chunk of a slot (16 KiB of `(u64, u64)` entries).
const CHUNK: usize = 1024;

/// One slot's entries in insert order.
struct Bucket<T> {
    chunks: Vec<Vec<(Ticks, T)>>,
}

impl<T> Bucket<T> {
    fn new() -> Self {
        Self { chunks: Vec::new() }
    }

    fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    fn len(&self) -> usize {
        self.chunks.iter().map(Vec::len).sum()
    }

    fn push(&mut self, entry: (Ticks, T)) {
        if let Some(last) = self.chunks.last_mut() {
            if last.len() < last.capacity() {
                return last.push(entry);
            }
        }
        // Chunks grow with the slot up to CHUNK: a slot of a few entries
        // takes a few entries' room.
        let room = match self.chunks.len() {
            n if n >= 8 => CHUNK,
            _ => self
                .chunks
                .iter()
                .map(Vec::len)
                .sum::<usize>()
                .clamp(8, CHUNK),
        };
        let mut chunk = Vec::with_capacity(room);
        chunk.push(entry);
        self.chunks.push(chunk);
    }

    fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        for chunk in &mut self.chunks {
            chunk.retain(|(_, item)| keep(item));
        }
        self.chunks.retain(|c| !c.is_empty());
    }
}

struct Level<T> {
    occupied: u64,
    slots: Vec<Bucket<T>>,
}

impl<T> Level<T> {
    fn new() -> Self {
        Self {
            occupied: 0,
            slots: (0..SLOTS).map(|_| Bucket::new()).collect(),
        }
    }
}

fn slot_width(level: usize) -> u64 {
    1u64 << (BITS as usize * level)
}

fn level_width(level: usize) -> u64 {
    1u64.checked_shl(BITS * (level as u32 + 1))
        .unwrap_or(u64::MAX)
}

fn slot_of(due: Ticks, level: usize) -> usize {
    ((due >> (BITS as usize * level)) as usize) & (SLOTS - 1)
}

/// Level an entry due at `due` belongs to when the wheel is at `now`.
fn level_for(now: Ticks, due: Ticks) -> usize {
    let significant = 63 - ((now ^ due) | (SLOTS as u64 - 1)).leading_zeros() as usize;
    (significant / BITS as usize).min(LEVELS - 1)
}

/// Whether `due` is further from `now` than the top level's slots reach:
/// past the slot before `now`'s one in the next turn of the top level.
fn beyond_reach(now: Ticks, due: Ticks) -> bool {
    let top = LEVELS - 1;
    let turn = now & !(level_width(top) - 1);
    let reach = slot_of(now, top) as u64 * slot_width(top);
    turn.checked_add(level_width(top))
        .and_then(|next| next.checked_add(reach))
        .is_some_and(|reach| due >= reach)
}

/// The wheel. `T` is what an entry carries (an id).
pub struct Wheel<T> {
    now: Ticks,
    levels: Vec<Level<T>>,
    len: usize,
    /// Entries of the slot being polled that are due, sorted before firing.
    due: Vec<(Ticks, T)>,
}

impl<T> Default for Wheel<T> {
    fn default() -> Self {
        Self::new(0)
    }
}

impl<T> Wheel<T> {
    /// An empty wheel whose clock reads `now`.
    pub fn new(now: Ticks) -> Self {
        Self {
            now,
            levels: (0..LEVELS).map(|_| Level::new()).collect(),
            len: 0,
            due: Vec::new(),
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The wheel's clock: the last `now` given to [`Wheel::poll`].
    pub fn now(&self) -> Ticks {
        self.now
    }

    /// Adds an entry; one due in the past fires at the next poll. Returns
    /// the due time it was given (not before the wheel's clock), which
    /// [`Wheel::poll`] hands back with it.
    pub fn insert(&mut self, due: Ticks, item: T) -> Ticks {
        let due = due.max(self.now);
        self.place(due, item);
        self.len += 1;
        due
    }

    fn place(&mut self, due: Ticks, item: T) {
        let level = level_for(self.now, due);
        let slot = match beyond_reach(self.now, due) {
            // It waits in the top slot that comes up last, and is placed
            // again from there: in its own slot it would come back into
            // the one being polled (or one polled before its time).
            true => (slot_of(self.now, level) + SLOTS - 1) % SLOTS,
            false => slot_of(due, level),
        };
        let l = &mut self.levels[level];
        l.slots[slot].push((due, item));
        l.occupied |= 1 << slot;
    }

    /// The earliest time at which [`Wheel::poll`] has something to do: the
    /// start of the next occupied slot (an entry there may be due later and
    /// only cascade). `None` when empty.
    pub fn next_deadline(&self) -> Option<Ticks> {
        self.next_slot().map(|(_, _, deadline)| deadline)
    }

    fn next_slot(&self) -> Option<(usize, usize, Ticks)> {
        for (level, l) in self.levels.iter().enumerate() {
            if l.occupied == 0 {
                continue;
            }
            let current = slot_of(self.now, level);
            let rotated = l.occupied.rotate_right(current as u32);
            let distance = rotated.trailing_zeros() as usize;
            let slot = (current + distance) % SLOTS;
            let level_start = self.now & !(level_width(level).wrapping_sub(1));
            let mut deadline = level_start + slot as u64 * slot_width(level);
            if deadline < level_start + current as u64 * slot_width(level) {
                deadline += level_width(level);
            }
            return Some((level, slot, deadline.max(self.now)));
        }
        None
    }

    /// Moves the clock to `now` and pushes every entry due by then into
    /// `fired` with its due time, in due order within a slot's batch and
    /// across slots.
    pub fn poll(&mut self, now: Ticks, fired: &mut Vec<(Ticks, T)>) {
        while let Some((level, slot, deadline)) = self.next_slot() {
            if deadline > now {
                break;
            }
            self.now = deadline;
            let l = &mut self.levels[level];
            l.occupied &= !(1 << slot);
            let bucket = std::mem::replace(&mut l.slots[slot], Bucket::new());
            // Chunk by chunk, each freed once moved on: cascading a slot of
            // millions never holds two copies of it.
            for mut chunk in bucket.chunks {
                for (due, item) in chunk.drain(..) {
                    match due <= now {
                        true => self.due.push((due, item)),
                        false => self.place(due, item),
                    }
                }
            }
            self.len -= self.due.len();
            // Stable: entries due in the same ms fire in insert order.
            self.due.sort_by_key(|(due, _)| *due);
            fired.append(&mut self.due);
            if self.due.capacity() > CHUNK * 64 {
                self.due = Vec::new();
            }
        }
        self.now = self.now.max(now);
    }

    /// Removes every entry for which `keep` is false; O(entries).
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        let mut len = 0;
        for l in &mut self.levels {
            for (i, slot) in l.slots.iter_mut().enumerate() {
                slot.retain(&mut keep);
                if slot.is_empty() {
                    l.occupied &= !(1 << i);
                }
                len += slot.len();
            }
        }
        self.len = len;
    }
}

#[cfg(test)]
mod tests;

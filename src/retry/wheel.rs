//! A hierarchical timing wheel with millisecond resolution.
//!
//! Seven levels of 64 slots; level `n` slots are `64^n` ms wide, so the wheel
//! spans 64^7 ms (about 139 years). Insert is O(1): the level is picked from
//! the highest bit in which the due time differs from the wheel's time. An
//! entry of a higher level is moved down ("cascaded") when its slot comes up,
//! until it sits in a level-0 slot of exactly its millisecond. An entry fires
//! only once `now >= due`: never early.
//!
//! Memory per entry: its `(due, item)` pair in a slot vector.

const BITS: u32 = 6;
const SLOTS: usize = 1 << BITS;
const LEVELS: usize = 7;

/// Milliseconds on the wheel's own clock.
pub type Millis = u64;

struct Level<T> {
    occupied: u64,
    slots: Vec<Vec<(Millis, T)>>,
}

impl<T> Level<T> {
    fn new() -> Self {
        Self {
            occupied: 0,
            slots: (0..SLOTS).map(|_| Vec::new()).collect(),
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

fn slot_of(due: Millis, level: usize) -> usize {
    ((due >> (BITS as usize * level)) as usize) & (SLOTS - 1)
}

/// Level an entry due at `due` belongs to when the wheel is at `now`.
fn level_for(now: Millis, due: Millis) -> usize {
    let significant = 63 - ((now ^ due) | (SLOTS as u64 - 1)).leading_zeros() as usize;
    (significant / BITS as usize).min(LEVELS - 1)
}

/// The wheel. `T` is what an entry carries (an id).
pub struct Wheel<T> {
    now: Millis,
    levels: Vec<Level<T>>,
    len: usize,
}

impl<T> Default for Wheel<T> {
    fn default() -> Self {
        Self::new(0)
    }
}

impl<T> Wheel<T> {
    /// An empty wheel whose clock reads `now`.
    pub fn new(now: Millis) -> Self {
        Self {
            now,
            levels: (0..LEVELS).map(|_| Level::new()).collect(),
            len: 0,
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
    pub fn now(&self) -> Millis {
        self.now
    }

    /// Adds an entry; one due in the past fires at the next poll.
    pub fn insert(&mut self, due: Millis, item: T) {
        let due = due.max(self.now);
        self.place(due, item);
        self.len += 1;
    }

    fn place(&mut self, due: Millis, item: T) {
        let level = level_for(self.now, due);
        let slot = slot_of(due, level);
        let l = &mut self.levels[level];
        l.slots[slot].push((due, item));
        l.occupied |= 1 << slot;
    }

    /// The earliest time at which [`Wheel::poll`] has something to do: the
    /// start of the next occupied slot (an entry there may be due later and
    /// only cascade). `None` when empty.
    pub fn next_deadline(&self) -> Option<Millis> {
        self.next_slot().map(|(_, _, deadline)| deadline)
    }

    fn next_slot(&self) -> Option<(usize, usize, Millis)> {
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
    /// `fired`, in due order within a slot's batch and across slots.
    pub fn poll(&mut self, now: Millis, fired: &mut Vec<T>) {
        while let Some((level, slot, deadline)) = self.next_slot() {
            if deadline > now {
                break;
            }
            self.now = deadline;
            let l = &mut self.levels[level];
            l.occupied &= !(1 << slot);
            let mut entries = std::mem::take(&mut l.slots[slot]);
            entries.sort_by_key(|(due, _)| *due);
            for (due, item) in entries.drain(..) {
                if due <= now {
                    fired.push(item);
                    self.len -= 1;
                } else {
                    self.place(due, item);
                }
            }
            // Hand the allocation back to the slot: it is likely to fill again.
            let l = &mut self.levels[level];
            if l.slots[slot].is_empty() {
                l.slots[slot] = entries;
            }
        }
        self.now = self.now.max(now);
    }

    /// Removes every entry for which `keep` is false; O(entries).
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        let mut len = 0;
        for l in &mut self.levels {
            for (i, slot) in l.slots.iter_mut().enumerate() {
                slot.retain(|(_, item)| keep(item));
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

//! Held messages by store id, in a few bytes more than the entries.
//!
//! A `HashMap<u64, Entry>` costs a key, the entry and a control byte per
//! bucket, and its buckets double: at 1 M entries it has 2 M of them, more
//! than twice the entries' own bytes. Store ids are handed out in order, so
//! messages parked together have neighbouring ids. This map keeps ids in
//! pages of 64 consecutive ids: a hash map of pages, each with a bit mask
//! of the ids present and a vector of their entries, in id order, sized to
//! what they hold. A full page costs its entries plus about 1 byte each; a
//! page with one entry left costs that entry plus about 60 bytes.

use std::collections::HashMap;

const PAGE_BITS: u32 = 6;
const PAGE: u64 = 1 << PAGE_BITS;

/// The room a page's vector is given, growing and shrinking: four
/// allocations fill a page (not 64 one-entry reallocations), in a few
/// sizes the allocator reuses, and a page with one message left keeps
/// room for one.
const ROOM: [usize; 4] = [1, 4, 16, 64];

/// The smallest room that holds `n`.
fn room_for(n: usize) -> usize {
    ROOM.into_iter().find(|r| *r >= n).unwrap_or(n)
}

/// The entries of 64 consecutive ids.
struct Page<V> {
    /// Bit `i`: id `page * 64 + i` is present.
    mask: u64,
    /// The present ones' values, in id order.
    values: Vec<V>,
}

impl<V> Page<V> {
    /// Where `bit`'s value is (or would go) in `values`.
    fn rank(&self, bit: u32) -> usize {
        (self.mask & ((1u64 << bit) - 1)).count_ones() as usize
    }
}

/// A map from store id to `V`.
pub(super) struct IdMap<V> {
    pages: HashMap<u64, Page<V>>,
    len: usize,
}

impl<V> Default for IdMap<V> {
    fn default() -> Self {
        Self {
            pages: HashMap::new(),
            len: 0,
        }
    }
}

fn split(id: u64) -> (u64, u32) {
    (id >> PAGE_BITS, (id & (PAGE - 1)) as u32)
}

impl<V> IdMap<V> {
    /// Entries held.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Adds or replaces; returns the value replaced.
    pub(super) fn insert(&mut self, id: u64, value: V) -> Option<V> {
        let (page, bit) = split(id);
        let page = self.pages.entry(page).or_insert_with(|| Page {
            mask: 0,
            values: Vec::new(),
        });
        let at = page.rank(bit);
        if page.mask & (1 << bit) != 0 {
            return Some(std::mem::replace(&mut page.values[at], value));
        }
        if page.values.len() == page.values.capacity() {
            let len = page.values.len();
            page.values.reserve_exact(room_for(len + 1) - len);
        }
        page.values.insert(at, value);
        page.mask |= 1 << bit;
        self.len += 1;
        None
    }

    /// Removes and returns `id`'s value.
    pub(super) fn remove(&mut self, id: u64) -> Option<V> {
        let (key, bit) = split(id);
        let page = self.pages.get_mut(&key)?;
        if page.mask & (1 << bit) == 0 {
            return None;
        }
        let value = page.values.remove(page.rank(bit));
        page.mask &= !(1 << bit);
        self.len -= 1;
        if page.mask == 0 {
            self.pages.remove(&key);
        } else if page.values.len() * 4 <= page.values.capacity() {
            page.values.shrink_to(room_for(page.values.len()));
        }
        Some(value)
    }

    /// `id`'s value.
    pub(super) fn get(&self, id: u64) -> Option<&V> {
        let (page, bit) = split(id);
        let page = self.pages.get(&page)?;
        (page.mask & (1 << bit) != 0).then(|| &page.values[page.rank(bit)])
    }

    /// `id`'s value, to change.
    pub(super) fn get_mut(&mut self, id: u64) -> Option<&mut V> {
        let (page, bit) = split(id);
        let page = self.pages.get_mut(&page)?;
        match page.mask & (1 << bit) != 0 {
            true => {
                let at = page.rank(bit);
                Some(&mut page.values[at])
            }
            false => None,
        }
    }

    /// Every entry, in no particular order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, &V)> {
        self.pages.iter().flat_map(|(key, page)| {
            let base = key << PAGE_BITS;
            let mut mask = page.mask;
            page.values.iter().map(move |v| {
                let bit = mask.trailing_zeros();
                mask &= mask - 1;
                (base + u64::from(bit), v)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::IdMap;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
        Set(u64, u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Ids cluster on a few pages (including 0 and the top of the
        // range) so that pages fill, empty and refill.
        let id = prop_oneof![0u64..300, (u64::MAX - 200)..=u64::MAX, any::<u64>()];
        prop_oneof![
            (id.clone(), any::<u32>()).prop_map(|(i, v)| Op::Insert(i, v)),
            id.clone().prop_map(Op::Remove),
            (id, any::<u32>()).prop_map(|(i, v)| Op::Set(i, v)),
        ]
    }

    proptest! {
        /// Every operation answers as a `HashMap` does, and the map holds
        /// exactly the model's entries afterwards.
        #[test]
        fn behaves_as_a_hash_map(ops in proptest::collection::vec(op(), 0..600)) {
            let mut map = IdMap::default();
            let mut model = HashMap::new();
            for op in ops {
                match op {
                    Op::Insert(id, v) => prop_assert_eq!(map.insert(id, v), model.insert(id, v)),
                    Op::Remove(id) => prop_assert_eq!(map.remove(id), model.remove(&id)),
                    Op::Set(id, v) => {
                        if let (Some(a), Some(b)) = (map.get_mut(id), model.get_mut(&id)) {
                            *a = v;
                            *b = v;
                        }
                        prop_assert_eq!(map.get(id), model.get(&id));
                    }
                }
                prop_assert_eq!(map.len(), model.len());
            }
            let mut all: Vec<(u64, u32)> = map.iter().map(|(i, v)| (i, *v)).collect();
            let mut want: Vec<(u64, u32)> = model.into_iter().collect();
            all.sort_unstable();
            want.sort_unstable();
            prop_assert_eq!(all, want);
        }
    }

    #[test]
    fn a_page_grows_and_shrinks_by_steps() {
        let mut map = IdMap::default();
        let rooms: Vec<usize> = (0..64)
            .map(|id| {
                map.insert(id, id);
                map.pages[&0].values.capacity()
            })
            .collect();
        assert_eq!(&rooms[..5], [1, 4, 4, 4, 16]);
        assert_eq!(rooms[63], 64);
        for id in 0..60 {
            map.remove(id);
        }
        assert_eq!(
            map.pages[&0].values.capacity(),
            4,
            "shrunk whenever a quarter is left"
        );
        for id in 60..63 {
            map.remove(id);
        }
        assert_eq!(map.pages[&0].values.capacity(), 1);
        assert_eq!(map.get(63), Some(&63));
    }

    #[test]
    fn an_emptied_page_is_dropped() {
        let mut map = IdMap::default();
        for id in 0..64 {
            map.insert(id, id);
        }
        assert_eq!(map.pages.len(), 1);
        for id in 0..64 {
            assert_eq!(map.remove(id), Some(id));
        }
        assert!(map.pages.is_empty());
        assert_eq!(map.len(), 0);
    }
}

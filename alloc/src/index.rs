//! The ordered index of free blocks: best fit by (stream, size, address).
//!
//! A sorted vector. The hot path of a caching allocator replaces one key by a neighbouring
//! one (a split shrinks a free block, a free grows it back), which almost never changes the
//! key's position: [`FreeIndex::replace`] then overwrites in place after two comparisons,
//! where a tree would do a removal and an insertion. Pools hold tens to hundreds of free
//! blocks in practice; when a key moves, only the entries between the two positions shift.

use crate::block::BlockId;
use crate::memory::{DevicePtr, Stream};

/// A free block's place in best-fit order.
pub(crate) type FreeKey = (Stream, usize, DevicePtr);

#[derive(Debug, Default)]
pub(crate) struct FreeIndex {
    entries: Vec<(FreeKey, BlockId)>,
}

impl FreeIndex {
    #[inline]
    fn position(&self, key: &FreeKey) -> Result<usize, usize> {
        self.entries.binary_search_by(|(k, _)| k.cmp(key))
    }

    /// The first entry at or after `key`, with its position.
    #[inline]
    pub fn first_at_or_after(&self, key: &FreeKey) -> Option<(FreeKey, BlockId, usize)> {
        let i = match self.position(key) {
            Ok(i) | Err(i) => i,
        };
        self.entries.get(i).map(|&(k, id)| (k, id, i))
    }

    /// The position of the first entry at or after `key` (the length if none).
    #[inline]
    pub fn position_at_or_after(&self, key: &FreeKey) -> usize {
        match self.position(key) {
            Ok(i) | Err(i) => i,
        }
    }

    /// The entry at position `i`.
    #[inline]
    pub fn get(&self, i: usize) -> Option<&(FreeKey, BlockId)> {
        self.entries.get(i)
    }

    /// Removes the entry at position `i` (from [`Self::first_at_or_after`]). The last entry
    /// (the largest block, as an unsplit segment's often is) goes without a `memmove` call.
    #[inline]
    pub fn remove_at(&mut self, i: usize) {
        if i + 1 == self.entries.len() {
            self.entries.pop();
        } else {
            self.entries.remove(i);
        }
    }

    /// Inserts `key`; at the end (the largest block) without a `memmove` call.
    #[inline]
    pub fn insert(&mut self, key: FreeKey, id: BlockId) {
        match self.position(&key) {
            Ok(_) => debug_assert!(false, "free key inserted twice: {key:?}"),
            Err(i) if i == self.entries.len() => self.entries.push((key, id)),
            Err(i) => self.entries.insert(i, (key, id)),
        }
    }

    #[inline]
    pub fn remove(&mut self, key: &FreeKey) {
        match self.position(key) {
            Ok(i) => {
                self.entries.remove(i);
            }
            Err(_) => debug_assert!(false, "free key missing: {key:?}"),
        }
    }

    /// Replaces `old` by `new` (for block `id`), in place when the order allows.
    #[inline]
    pub fn replace(&mut self, old: &FreeKey, new: FreeKey, id: BlockId) {
        match self.position(old) {
            Ok(i) => self.replace_at(i, new, id),
            Err(_) => debug_assert!(false, "free key missing: {old:?}"),
        }
    }

    /// Replaces the entry at position `i` by `new` (for block `id`), in place when the order
    /// allows (the hot path: two comparisons, inlined); else [`Self::move_to`].
    #[inline(always)]
    pub fn replace_at(&mut self, i: usize, new: FreeKey, id: BlockId) {
        let after_prev = i == 0 || self.entries[i - 1].0 < new;
        let before_next = i + 1 == self.entries.len() || new < self.entries[i + 1].0;
        if after_prev && before_next {
            self.entries[i] = (new, id);
        } else {
            self.move_to(i, new, id);
        }
    }

    /// Moves the entry at position `i` to the place of `new` (for block `id`), shifting only
    /// what lies between.
    #[cold]
    #[inline(never)]
    fn move_to(&mut self, i: usize, new: FreeKey, id: BlockId) {
        let j = match self.entries.binary_search_by(|(k, _)| k.cmp(&new)) {
            Ok(j) | Err(j) => j,
        };
        if j > i {
            self.entries[i..j].rotate_left(1);
            self.entries[j - 1] = (new, id);
        } else {
            self.entries[j..=i].rotate_right(1);
            self.entries[j] = (new, id);
        }
    }

    /// The largest free block's size on any stream (0 when empty): a scan, for rare callers.
    pub fn largest(&self) -> usize {
        self.entries.iter().map(|&((_, size, _), _)| size).max().unwrap_or(0)
    }

    /// Block ids in order.
    pub fn values(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.entries.iter().map(|&(_, id)| id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(size: usize, ptr: u64) -> FreeKey {
        (Stream(0), size, ptr)
    }

    #[test]
    fn replace_keeps_the_index_sorted_whether_in_place_or_moved() {
        let mut ix = FreeIndex::default();
        for (i, s) in [10, 20, 30, 40, 50].into_iter().enumerate() {
            ix.insert(key(s, i as u64), i as BlockId);
        }
        ix.replace(&key(30, 2), key(31, 2), 2); // in place
        ix.replace(&key(20, 1), key(45, 1), 1); // moves right
        ix.replace(&key(50, 4), key(5, 4), 4); // moves left
        let sizes: Vec<usize> = (0..5).filter_map(|i| ix.get(i)).map(|(k, _)| k.1).collect();
        assert_eq!(sizes, [5, 10, 31, 40, 45]);
        let ids: Vec<BlockId> = ix.values().collect();
        assert_eq!(ids, [4, 0, 2, 3, 1]);
        assert_eq!(ix.first_at_or_after(&key(32, 0)), Some((key(40, 3), 3, 3)));
        ix.remove(&key(40, 3));
        assert_eq!(ix.first_at_or_after(&key(32, 0)), Some((key(45, 1), 1, 3)));
        assert_eq!(ix.first_at_or_after(&key(46, 0)), None);
    }
}

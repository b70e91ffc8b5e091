//! PyTorch's size rules: rounding, pools and segment sizes.

use crate::config::AllocatorConfig;

/// Smallest block; every size is rounded to a multiple of it.
pub const MIN_BLOCK_SIZE: usize = 512;
/// Requests up to this size go to the small pool.
pub const SMALL_SIZE: usize = 1 << 20;
/// Segment size of the small pool.
pub const SMALL_BUFFER: usize = 2 << 20;
/// Segment size for large requests under [`MIN_LARGE_ALLOC`]; also how far an oversize
/// block may exceed a request and still serve it.
pub const LARGE_BUFFER: usize = 20 << 20;
/// Large requests at least this big get a segment of their own size.
pub const MIN_LARGE_ALLOC: usize = 10 << 20;
/// Large segments are rounded to multiples of this.
pub const ROUND_LARGE: usize = 2 << 20;

/// Which pool a block belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    /// Blocks of requests up to 1 MiB, in 2 MiB segments.
    Small,
    /// Everything else.
    Large,
}

impl PoolKind {
    /// The pool for a rounded size.
    #[inline]
    pub fn for_size(size: usize) -> PoolKind {
        if size <= SMALL_SIZE { PoolKind::Small } else { PoolKind::Large }
    }

    /// "small" or "large", as in PyTorch's snapshots.
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        }
    }
}

/// One pool of free blocks: the default small or large pool, or the small or large pool of
/// a private pool (PyTorch's `BlockPool`, owned by the allocator or by a `PrivatePool`).
/// Index 0 and 1 are the default small and large pools; private pool slot `k` has `2 + 2k`
/// and `3 + 2k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct PoolRef(u32);

impl PoolRef {
    /// The default small pool.
    pub const SMALL: PoolRef = PoolRef(0);
    /// The default large pool.
    pub const LARGE: PoolRef = PoolRef(1);

    /// The `kind` pool of the private pool in `slot` (`None` for the default pools).
    #[inline]
    pub fn new(slot: Option<usize>, kind: PoolKind) -> PoolRef {
        let base = slot.map_or(0, |k| 2 + 2 * k as u32);
        PoolRef(base + (kind == PoolKind::Large) as u32)
    }

    /// Small or large.
    #[inline]
    pub fn kind(self) -> PoolKind {
        if self.0 & 1 == 0 { PoolKind::Small } else { PoolKind::Large }
    }

    /// Where the pool is in the allocator's list of pools.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The private pool's slot, `None` for the default pools.
    #[inline]
    pub fn private_slot(self) -> Option<usize> {
        (self.0 >= 2).then(|| (self.0 as usize - 2) / 2)
    }
}

impl From<PoolRef> for PoolKind {
    #[inline]
    fn from(p: PoolRef) -> PoolKind {
        p.kind()
    }
}

/// Rounds a request: at least 512 B, a multiple of 512 B, or to a power-of-two division when
/// `roundup_power2_divisions` applies. `None` when the result would overflow. `power2` is
/// `config.rounds_to_power2_divisions()`, which the cache computes once.
#[inline]
pub(crate) fn round_size_with(
    size: usize,
    config: &AllocatorConfig,
    power2: bool,
) -> Option<usize> {
    if size < MIN_BLOCK_SIZE {
        return Some(MIN_BLOCK_SIZE);
    }
    if power2 {
        let divisions = config.roundup_power2_divisions(size);
        if divisions > 1 && size > MIN_BLOCK_SIZE * divisions {
            return roundup_power2_next_division(size, divisions);
        }
    }
    size.checked_next_multiple_of(MIN_BLOCK_SIZE)
}

/// Rounds up to the next of `divisions` equal steps between two powers of two.
fn roundup_power2_next_division(size: usize, divisions: usize) -> Option<usize> {
    if size.is_power_of_two() {
        return Some(size);
    }
    let floor = 1usize << (usize::BITS - 1 - size.leading_zeros());
    let step = floor / divisions;
    if step == 0 {
        return floor.checked_mul(2);
    }
    let rounded = size & !(step - 1);
    if rounded == size { Some(size) } else { rounded.checked_add(step) }
}

/// Size of a new segment for a rounded request. `None` on overflow.
#[inline]
pub fn segment_size(size: usize) -> Option<usize> {
    if size <= SMALL_SIZE {
        Some(SMALL_BUFFER)
    } else if size < MIN_LARGE_ALLOC {
        Some(LARGE_BUFFER)
    } else {
        size.checked_next_multiple_of(ROUND_LARGE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_size(size: usize, config: &AllocatorConfig) -> Option<usize> {
        round_size_with(size, config, config.rounds_to_power2_divisions())
    }

    #[test]
    fn sizes_round_to_512_bytes() {
        let c = AllocatorConfig::default();
        assert_eq!(round_size(0, &c), Some(512));
        assert_eq!(round_size(1, &c), Some(512));
        assert_eq!(round_size(512, &c), Some(512));
        assert_eq!(round_size(513, &c), Some(1024));
        assert_eq!(round_size(usize::MAX, &c), None);
    }

    #[test]
    fn power2_divisions_round_to_quarter_steps() {
        let c = AllocatorConfig::default().with_roundup_power2_divisions(4).unwrap();
        // 1200 MiB lies between 1024 and 2048 MiB: steps of 256 MiB, so 1280 MiB.
        assert_eq!(round_size(1200 << 20, &c), Some(1280 << 20));
        assert_eq!(round_size(1024 << 20, &c), Some(1024 << 20));
        // Small sizes (not above 512 * divisions) keep 512-byte rounding.
        assert_eq!(round_size(1000, &c), Some(1024));
    }

    #[test]
    fn segment_sizes_follow_pytorch() {
        assert_eq!(segment_size(512), Some(2 << 20));
        assert_eq!(segment_size(1 << 20), Some(2 << 20));
        assert_eq!(segment_size((1 << 20) + 512), Some(20 << 20));
        assert_eq!(segment_size((10 << 20) - 512), Some(20 << 20));
        assert_eq!(segment_size(10 << 20), Some(10 << 20));
        assert_eq!(segment_size((10 << 20) + 512), Some(12 << 20));
    }
}

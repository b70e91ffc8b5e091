//! Blocks, the arena that holds them, and the pools of free blocks.

use crate::index::FreeIndex;
use crate::memory::{DevicePtr, Stream};
use crate::policy::PoolRef;
use std::collections::BTreeMap;

/// Index of a block in the arena.
pub(crate) type BlockId = u32;

/// What a block is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// Cached: free for reuse (it is in its pool unless being handed out).
    Free,
    /// Held by an allocation handle.
    Allocated,
    /// Freed by its owner, but other streams may still use it: waits for their events.
    PendingFree,
    /// Address space of an expandable segment with no memory behind it.
    Unmapped,
}

/// A contiguous range of a segment. Blocks of a segment form a doubly linked list in address
/// order that tiles the segment exactly.
#[derive(Debug)]
pub(crate) struct Block {
    pub ptr: DevicePtr,
    pub size: usize,
    /// Bytes the caller asked for (allocated blocks only).
    pub requested: usize,
    pub stream: Stream,
    pub pool: PoolRef,
    pub prev: Option<BlockId>,
    pub next: Option<BlockId>,
    pub state: BlockState,
    /// Base address of the segment this block belongs to.
    pub segment: DevicePtr,
    pub expandable: bool,
    /// Events still to complete before a pending free finishes.
    pub pending_events: u32,
    /// The pool's `get_free_block` count when the block was last cached: its age for
    /// garbage collection is the count now minus this (PyTorch's `gc_count_base`).
    pub gc_base: u64,
}

impl Block {
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// Slab of blocks with id reuse: no allocation on the hot path once warm.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    blocks: Vec<Block>,
    vacant: Vec<BlockId>,
}

impl Arena {
    #[inline]
    pub fn insert(&mut self, block: Block) -> BlockId {
        match self.vacant.pop() {
            Some(id) => {
                self[id] = block;
                id
            }
            None => {
                self.blocks.push(block);
                (self.blocks.len() - 1) as BlockId
            }
        }
    }

    /// Marks `id` vacant; the slot is overwritten by a later insert.
    #[inline]
    pub fn remove(&mut self, id: BlockId) {
        self.vacant.push(id);
    }
}

// Indexing needs no bounds check: a `BlockId` is only made by [`Arena::insert`], as the index
// of a slot that exists, and `blocks` never shrinks (a removed block's slot stays, vacant), so
// every id ever handed out, even a stale one, is in bounds. The hot path indexes the arena
// a dozen times per allocate + free pair.

impl std::ops::Index<BlockId> for Arena {
    type Output = Block;
    #[inline]
    fn index(&self, id: BlockId) -> &Block {
        debug_assert!((id as usize) < self.blocks.len(), "block {id} was never made");
        // SAFETY: ids come from `insert` and `blocks` never shrinks (see above).
        unsafe { self.blocks.get_unchecked(id as usize) }
    }
}

impl std::ops::IndexMut<BlockId> for Arena {
    #[inline]
    fn index_mut(&mut self, id: BlockId) -> &mut Block {
        debug_assert!((id as usize) < self.blocks.len(), "block {id} was never made");
        // SAFETY: as for `index`.
        unsafe { self.blocks.get_unchecked_mut(id as usize) }
    }
}

/// Free blocks of one pool, ordered for best fit: by stream, then size, then address.
/// Unmapped ranges of expandable segments are kept apart, by stream then address.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    pub free: FreeIndex,
    pub unmapped: BTreeMap<(Stream, DevicePtr), BlockId>,
    /// `get_free_block` calls while garbage collection is on (PyTorch's
    /// `get_free_blocks_call_count`).
    pub gc_calls: u64,
}

/// A range obtained from the device in one piece (or reserved, for expandable segments).
#[derive(Debug)]
pub(crate) struct Segment {
    /// Bytes with memory behind them (equal to `size` unless expandable).
    pub mapped: usize,
    pub stream: Stream,
    pub pool: PoolRef,
    pub expandable: bool,
    /// The lowest block; merging always keeps the lower block, so this never changes.
    pub head: BlockId,
}

/// A private memory pool's id: PyTorch's `MempoolId_t`, a pair of integers. A CUDA graph's
/// own pool is `(capture id, 0)`; `torch.cuda.MemPool` and `graph_pool_handle()` make
/// `(0, n)`; `(0, 0)` stands for the default pools in snapshots (`segment_pool_id`).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct MempoolId(pub u64, pub u64);

impl MempoolId {
    /// The default pools' id, (0, 0).
    pub const DEFAULT: MempoolId = MempoolId(0, 0);

    /// Whether this is a private pool's id (not (0, 0)).
    pub fn is_private(self) -> bool {
        self != MempoolId::DEFAULT
    }
}

impl std::fmt::Display for MempoolId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({}, {})", self.0, self.1)
    }
}

/// A private pool (PyTorch's `PrivatePool`): its blocks are in two pools of their own
/// (`State::pools`), never mixed with the default pools'.
#[derive(Debug)]
pub(crate) struct PrivatePool {
    pub id: MempoolId,
    /// Captures and pools that use it (`use_count`); at 0 it is freeable.
    pub use_count: u32,
    /// Its segments not given back (`cudaMalloc_count`).
    pub malloc_count: u32,
}

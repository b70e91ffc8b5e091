//! The public face of the cache: [`CachingAllocator`] and its RAII [`Allocation`] handles.

use crate::block::{BlockId, MempoolId};
use crate::config::{AllocatorConfig, ConfigError};
use crate::error::AllocError;
use crate::memory::{DeviceMemory, DevicePtr, MemInfo, Stream};
use crate::snapshot::Snapshot;
use crate::state::State;
use crate::stats::MemoryStats;
use crate::trace::TraceEntry;
use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};

/// A caching allocator over raw device memory `M`, with PyTorch's policy.
///
/// Cheap to clone (a shared handle); `Send + Sync`. Allocations return their blocks to the
/// cache when dropped; [`empty_cache`](Self::empty_cache) gives cached memory back to the
/// device.
///
/// The handles and the live allocations share the cache; they are counted under its lock
/// (`State::holders`), not with an atomic reference count: an allocation and its free each
/// take the lock anyway, so the count costs them no atomic operation of its own. Whoever
/// brings the count to 0 frees the cache, after releasing the lock (no one else can reach
/// it then).
pub struct CachingAllocator<M: DeviceMemory> {
    inner: NonNull<Inner<M>>,
    _owns: PhantomData<Inner<M>>,
}

// SAFETY: a handle gives shared access to `Inner` from any thread (as `Arc<Inner>` would,
// which is `Send + Sync` exactly when `Inner` is); the holder count that decides when
// `Inner` is freed is only changed under `Inner`'s lock.
unsafe impl<M: DeviceMemory> Send for CachingAllocator<M> where Inner<M>: Send + Sync {}
// SAFETY: as for `Send`.
unsafe impl<M: DeviceMemory> Sync for CachingAllocator<M> where Inner<M>: Send + Sync {}

struct Inner<M: DeviceMemory> {
    mem: M,
    state: Mutex<State<M>>,
}

impl<M: DeviceMemory> Drop for Inner<M> {
    /// The last handle is gone, and with it every allocation (each holds the cache, counted
    /// with the handles): every block is free, so `empty_cache` gives every segment back to
    /// the device (after waiting for the frees still pending on other streams). Without it,
    /// dropping a CUDA cache would leave its `cuMemAlloc` segments allocated until the process
    /// exits.
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        state.release_everything(&self.mem);
    }
}

impl<M: DeviceMemory> Clone for CachingAllocator<M> {
    fn clone(&self) -> Self {
        self.state().holders += 1;
        CachingAllocator { inner: self.inner, _owns: PhantomData }
    }
}

impl<M: DeviceMemory> Drop for CachingAllocator<M> {
    fn drop(&mut self) {
        let last = {
            let mut state = self.state();
            state.holders -= 1;
            state.holders == 0
        };
        if last {
            // SAFETY: no holder is left (and none can appear: making one needs a holder), so
            // nothing else refers to `inner`, which came from `Box::leak`.
            unsafe { self.destroy() };
        }
    }
}

impl<M: DeviceMemory> fmt::Debug for CachingAllocator<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("device", &self.inner().mem.name())
            .field("allocated", &self.memory_allocated())
            .field("reserved", &self.memory_reserved())
            .finish()
    }
}

impl<M: DeviceMemory> CachingAllocator<M> {
    /// A cache with PyTorch's default settings.
    pub fn new(mem: M) -> Self {
        Self::with_config(mem, AllocatorConfig::default())
            .expect("the default configuration needs no backend support")
    }

    /// A cache with the given settings; fails if the backend cannot honour them (expandable
    /// segments on a backend without address reservation).
    pub fn with_config(mem: M, config: AllocatorConfig) -> Result<Self, AllocError> {
        if config.expandable_segments() && !mem.supports_expandable() {
            return Err(AllocError::Unsupported(format!(
                "expandable segments on {}; drop `expandable_segments:True`",
                mem.name()
            )));
        }
        let total = mem.mem_info().total;
        let mut state = State::new(config, total);
        state.holders = 1;
        let inner = Box::new(Inner { mem, state: Mutex::new(state) });
        Ok(CachingAllocator { inner: NonNull::from(Box::leak(inner)), _owns: PhantomData })
    }

    #[inline(always)]
    fn inner(&self) -> &Inner<M> {
        // SAFETY: `inner` lives while any holder does, and `self` is one.
        unsafe { self.inner.as_ref() }
    }

    /// Frees the cache (its `Drop` gives every segment back).
    ///
    /// # Safety
    /// The holder count reached 0 and the lock is released: no one else refers to `inner`.
    #[cold]
    #[inline(never)]
    unsafe fn destroy(&self) {
        // SAFETY: `inner` came from `Box::leak` and, as the caller guarantees, is unused.
        drop(unsafe { Box::from_raw(self.inner.as_ptr()) });
    }

    /// A cache configured from the `VRAM_ALLOC_CONF` environment variable.
    pub fn from_env(mem: M) -> Result<Self, AllocError> {
        Self::with_config(mem, AllocatorConfig::from_env()?)
    }

    #[inline]
    fn state(&self) -> MutexGuard<'_, State<M>> {
        // A panic while holding the lock cannot leave the state half-updated in a way later
        // calls would trust less than a poisoned error, so keep serving.
        self.inner().state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Allocates `size` bytes for use on the default stream.
    #[inline]
    pub fn allocate(&self, size: usize) -> Result<Allocation<M>, AllocError> {
        self.allocate_on(size, Stream::DEFAULT)
    }

    /// Allocates `size` bytes for use on `stream`. The block is 512-byte aligned. On
    /// out-of-memory, cached blocks are released and the request retried before failing; a
    /// failure leaves every live allocation untouched.
    ///
    /// A request of 0 bytes gets an empty handle at address 0 without touching the cache (no
    /// block, no segment, no statistic), as PyTorch hands out a null pointer. Requests of
    /// 1 EiB or more fail at once, before the cache is touched, as in PyTorch.
    #[inline]
    pub fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation<M>, AllocError> {
        let owner = ManuallyDrop::new(CachingAllocator { inner: self.inner, _owns: PhantomData });
        let mut state = self.state();
        if size == 0 {
            state.holders += 1;
            return Ok(Allocation { owner, block: NO_BLOCK, ptr: 0, len: 0, stream });
        }
        let block = state.malloc(&self.inner().mem, size, stream)?;
        let ptr = state.arena[block].ptr;
        // The allocation holds the cache until it is dropped.
        state.holders += 1;
        drop(state);
        Ok(Allocation { owner, block, ptr, len: size, stream })
    }

    /// Returns every cached block that spans a whole segment (and every free page of
    /// expandable segments) to the device, after waiting for pending cross-stream frees.
    /// Live allocations are untouched, and so are the cached blocks of private pools still
    /// in use (see [`release_pool`](Self::release_pool)). While allocations go to a private
    /// pool ([`begin_allocate_to_pool`](Self::begin_allocate_to_pool)) it releases nothing:
    /// PyTorch refuses to synchronize during a capture.
    pub fn empty_cache(&self) {
        let mut state = self.state();
        if state.captures.is_empty() {
            state.release_cached_blocks(&self.inner().mem);
        }
    }

    /// Sends allocations on `stream` (`None`: on every stream) to the private pool `pool`
    /// until [`end_allocate_to_pool`](Self::end_allocate_to_pool), as a CUDA graph capture
    /// (`torch.cuda.graph`) or `torch.cuda.use_mem_pool` does (PyTorch's
    /// `beginAllocateToPool`). The pool is created with one user, or gains one if it exists.
    ///
    /// A private pool's blocks serve only its own allocations, and its cached segments stay
    /// out of [`empty_cache`](Self::empty_cache) until every user has called
    /// [`release_pool`](Self::release_pool). While allocations go to a pool, an allocation
    /// that finds no room fails without releasing the cache, and frees used on other streams
    /// wait until no pool is being allocated to.
    ///
    /// ```
    /// use vram_alloc::{CachingAllocator, MempoolId, VirtualMemory};
    ///
    /// let cache = CachingAllocator::new(VirtualMemory::new(1 << 30));
    /// let pool = MempoolId(0, 1);
    /// cache.begin_allocate_to_pool(pool, None)?;
    /// let a = cache.allocate(4 << 20)?;        // a 20 MiB segment of the pool
    /// cache.end_allocate_to_pool(pool)?;
    /// drop(a);
    /// let b = cache.allocate(4 << 20)?;        // not from the pool's cached block
    /// assert_eq!(cache.memory_reserved(), 40 << 20);
    /// drop(b);
    /// cache.empty_cache();                     // the pool is in use: its segment stays
    /// assert_eq!(cache.memory_reserved(), 20 << 20);
    /// cache.release_pool(pool)?;
    /// cache.empty_cache();
    /// assert_eq!(cache.memory_reserved(), 0);
    /// # Ok::<(), vram_alloc::AllocError>(())
    /// ```
    pub fn begin_allocate_to_pool(
        &self,
        pool: MempoolId,
        stream: Option<Stream>,
    ) -> Result<(), AllocError> {
        self.state().begin_allocate_to_pool(pool, stream)
    }

    /// Stops sending allocations to `pool` (PyTorch's `endAllocateToPool`).
    pub fn end_allocate_to_pool(&self, pool: MempoolId) -> Result<(), AllocError> {
        self.state().end_allocate_to_pool(pool)
    }

    /// One user of `pool` is done with it (a graph was reset, a `MemPool` deleted: PyTorch's
    /// `releasePool`); when none is left, [`empty_cache`](Self::empty_cache) gives its
    /// cached segments back, and deletes it once it has none.
    pub fn release_pool(&self, pool: MempoolId) -> Result<(), AllocError> {
        self.state().release_pool(pool)
    }

    /// Caps reserved memory at `fraction` of the device's total (`[0, 1]`); allocations that
    /// would pass the cap fail with out-of-memory although the device may have room.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), ConfigError> {
        AllocatorConfig::default().with_memory_fraction(Some(fraction))?;
        let total = self.inner().mem.mem_info().total;
        self.state().set_memory_fraction(fraction, total);
        Ok(())
    }

    /// The reserved-memory cap in bytes, if a memory fraction is set.
    pub fn memory_cap(&self) -> Option<u64> {
        self.state().cap
    }

    /// The settings in force.
    pub fn config(&self) -> AllocatorConfig {
        self.state().config.clone()
    }

    /// A copy of every statistic.
    pub fn memory_stats(&self) -> MemoryStats {
        self.state().stats.stats()
    }

    /// Bytes in live allocations (`torch.cuda.memory_allocated`).
    pub fn memory_allocated(&self) -> u64 {
        self.state().stats.allocated_bytes.current() as u64
    }

    /// Bytes held in segments (`torch.cuda.memory_reserved`).
    pub fn memory_reserved(&self) -> u64 {
        self.state().stats.reserved_bytes.current() as u64
    }

    /// Peak of allocated bytes since the last reset (`torch.cuda.max_memory_allocated`).
    pub fn max_memory_allocated(&self) -> u64 {
        self.state().stats.allocated_bytes.peak() as u64
    }

    /// Peak of reserved bytes since the last reset (`torch.cuda.max_memory_reserved`).
    pub fn max_memory_reserved(&self) -> u64 {
        self.state().stats.reserved_bytes.peak() as u64
    }

    /// Sets peaks to current values (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peak_stats(&self) {
        self.state().stats.reset_peak();
    }

    /// Opens a statistics scope, as RMM's statistics adaptor pushes counters: inside it, peaks
    /// start from the current values and totals from zero, so a profiler measures its own
    /// peak; when the scope ends, the enclosing peaks are as if it had never been opened.
    /// Scopes nest; ending one also ends any scope opened inside it that is still open.
    ///
    /// ```
    /// use vram_alloc::{CachingAllocator, VirtualMemory};
    ///
    /// let cache = CachingAllocator::new(VirtualMemory::new(1 << 30));
    /// let big = cache.allocate(64 << 20)?;
    /// drop(big);                                   // the caller's peak: 64 MiB
    /// let scope = cache.stats_scope();
    /// let small = cache.allocate(4 << 20)?;
    /// drop(small);
    /// let inner = scope.finish();
    /// assert_eq!(inner.allocated_bytes.all.peak, 4 << 20);
    /// assert_eq!(cache.max_memory_allocated(), 64 << 20);
    /// # Ok::<(), vram_alloc::AllocError>(())
    /// ```
    pub fn stats_scope(&self) -> StatsScope {
        let depth = self.state().begin_scope();
        StatsScope { host: Some(Box::new(self.clone())), depth }
    }

    /// Zeroes accumulated totals and counters (`torch.cuda.reset_accumulated_memory_stats`).
    pub fn reset_accumulated_stats(&self) {
        self.state().stats.reset_accumulated();
    }

    /// Free and total memory as the device reports it.
    pub fn mem_info(&self) -> MemInfo {
        self.inner().mem.mem_info()
    }

    /// PyTorch's `cacheInfo`: the device's free memory, or the largest free block the cache
    /// holds in any pool (private pools included) when that is larger. cuDNN's timed
    /// algorithm search (`cudnn.benchmark`) sizes its workspace by it: the largest
    /// algorithm workspace no larger than this.
    pub fn cache_info(&self) -> u64 {
        let free = self.mem_info().free;
        let st = self.state();
        let largest = [&st.small, &st.large]
            .into_iter()
            .chain(&st.private_pools)
            .map(|p| p.free.largest())
            .max()
            .unwrap_or(0);
        free.max(largest as u64)
    }

    /// The raw memory under the cache.
    pub fn memory(&self) -> &M {
        &self.inner().mem
    }

    /// The segments and blocks of the cache, and the trace if recording.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot::capture(&self.state(), &self.inner().mem.name())
    }

    /// Starts recording the last `max_entries` actions (`Some(n)`), or stops (`None`),
    /// like `torch.cuda.memory._record_memory_history`.
    pub fn record_history(&self, max_entries: Option<usize>) {
        self.state().trace.set_max_entries(max_entries.unwrap_or(0));
    }

    /// The recorded actions, oldest first.
    pub fn trace(&self) -> Vec<TraceEntry> {
        self.state().trace.entries()
    }

    /// How many actions [`trace`](Self::trace) would return, without copying them: the index
    /// the next recorded action will have (until the ring buffer is full), to mark where a
    /// phase of a program starts in the trace.
    pub fn trace_len(&self) -> usize {
        self.state().trace.len()
    }

    /// A human-readable table of the statistics, in the layout of
    /// `torch.cuda.memory_summary()`.
    pub fn memory_summary(&self) -> String {
        crate::summary::render(&self.memory_stats(), &self.inner().mem.name())
    }

    /// Frees `block` (none for `NO_BLOCK`) for an allocation that is going away, and with it
    /// the allocation's hold on the cache, in one visit under the lock.
    #[inline]
    fn free_held(&self, block: BlockId) {
        let last = {
            let mut state = self.state();
            if block != NO_BLOCK {
                state.free(&self.inner().mem, block);
            }
            state.holders -= 1;
            state.holders == 0
        };
        if last {
            // SAFETY: as in `CachingAllocator::drop`.
            unsafe { self.destroy() };
        }
    }

    fn record_stream(&self, block: BlockId, stream: Stream) {
        self.state().record_stream(block, stream);
    }
}

/// What a [`StatsScope`] needs from its allocator, whatever the memory type.
trait ScopeHost: Send + Sync {
    fn scope_stats(&self, depth: usize) -> MemoryStats;
    fn end_scope(&self, depth: usize) -> MemoryStats;
}

impl<M: DeviceMemory> ScopeHost for CachingAllocator<M> {
    fn scope_stats(&self, depth: usize) -> MemoryStats {
        self.state().scope_stats(depth)
    }

    fn end_scope(&self, depth: usize) -> MemoryStats {
        self.state().end_scope(depth)
    }
}

/// A statistics scope opened by [`CachingAllocator::stats_scope`]; ends when finished or
/// dropped.
#[must_use = "a scope ends when dropped"]
pub struct StatsScope {
    host: Option<Box<dyn ScopeHost>>,
    depth: usize,
}

impl StatsScope {
    /// The scope's statistics so far: current values, peaks since it began, totals and
    /// counters added since it began.
    pub fn stats(&self) -> MemoryStats {
        self.host.as_ref().map(|h| h.scope_stats(self.depth)).unwrap_or_default()
    }

    /// Ends the scope and returns its statistics.
    pub fn finish(mut self) -> MemoryStats {
        self.host.take().map(|h| h.end_scope(self.depth)).unwrap_or_default()
    }
}

impl Drop for StatsScope {
    fn drop(&mut self) {
        if let Some(h) = self.host.take() {
            h.end_scope(self.depth);
        }
    }
}

impl fmt::Debug for StatsScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StatsScope(depth {})", self.depth)
    }
}

/// The block id of an empty allocation (0 bytes requested), which has no block.
const NO_BLOCK: BlockId = BlockId::MAX;

/// Memory handed out by a [`CachingAllocator`]; returns to the cache when dropped.
///
/// The block stays reserved for this handle until it is dropped. If other streams used the
/// memory, call [`record_stream`](Self::record_stream) for each so the cache waits for their
/// work before reusing the block.
pub struct Allocation<M: DeviceMemory> {
    /// The cache, held through the holder count (released by [`Allocation`]'s drop, not by
    /// the handle's own).
    owner: ManuallyDrop<CachingAllocator<M>>,
    block: BlockId,
    ptr: DevicePtr,
    len: usize,
    stream: Stream,
}

impl<M: DeviceMemory> Allocation<M> {
    /// The device address of the first byte (512-byte aligned; 0 for an empty allocation).
    ///
    /// On CUDA this is a `CUdeviceptr`, valid for [`len`](Self::len) bytes in the allocator's
    /// context while this handle lives; work using it must be ordered on
    /// [`stream`](Self::stream) or declared with [`record_stream`](Self::record_stream).
    #[inline]
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The size requested, in bytes (the block may be larger).
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether zero bytes were requested.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The stream the memory was allocated for.
    #[inline]
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// The allocator this memory came from.
    pub fn allocator(&self) -> &CachingAllocator<M> {
        &self.owner
    }

    /// Declares that `stream` uses this memory: after drop, the block is reused only once the
    /// work queued on `stream` by then has completed (`Tensor.record_stream` in PyTorch).
    pub fn record_stream(&self, stream: Stream) {
        if self.block != NO_BLOCK {
            self.owner.record_stream(self.block, stream);
        }
    }
}

impl<M: DeviceMemory> Drop for Allocation<M> {
    #[inline]
    fn drop(&mut self) {
        self.owner.free_held(self.block);
    }
}

impl<M: DeviceMemory> fmt::Debug for Allocation<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Allocation({:#x}, {} bytes, stream {})", self.ptr, self.len, self.stream)
    }
}

#[cfg(unix)]
impl Allocation<crate::memory::HostMemory> {
    /// The bytes of a host allocation (zeroed when the segment was new; cached blocks keep
    /// the bytes their previous user left).
    pub fn as_bytes(&self) -> &[u8] {
        if self.len == 0 {
            // SAFETY: an empty slice may start at any non-null address; this one is aligned
            // as allocator blocks are, so callers may view it as any element type.
            return unsafe { std::slice::from_raw_parts(std::ptr::without_provenance(512), 0) };
        }
        // SAFETY: host segments are readable and writable mappings; this block covers
        // `[ptr, ptr + len)` exclusively while the handle lives, and `&self` rules out a
        // concurrent `&mut` through this handle.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// The bytes of a host allocation, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            // SAFETY: as in `as_bytes`; an empty slice aliases nothing.
            return unsafe {
                std::slice::from_raw_parts_mut(std::ptr::without_provenance_mut(512), 0)
            };
        }
        // SAFETY: as in `as_bytes`; `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }
}

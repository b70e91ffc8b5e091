//! Launch configurations and kernel arguments.

use cudarc::driver::{DeviceRepr, LaunchConfig};

/// Threads per block of every kernel (a multiple of the warp size, which the block
/// reductions in `common.cuh` rely on).
pub(crate) const BLOCK: u32 = 256;

/// Most blocks a grid-stride kernel is given; each thread then handles several elements.
const MAX_GRID: usize = 1 << 16;

/// Row chunks of a column-sum kernel are at most this many (grid.y is capped at 65535).
const MAX_ROW_CHUNKS: usize = 1024;

/// One thread per element, grid-stride: `ceil(n / BLOCK)` blocks, at most [`MAX_GRID`].
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).min(MAX_GRID) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// One block per row (softmax, layer norm, row sums). `rows` must fit a grid dimension;
/// callers check with [`fits_grid`].
pub(crate) fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// Whether `blocks` blocks fit grid.x (2^31 - 1).
pub(crate) fn fits_grid(blocks: usize) -> bool {
    blocks <= i32::MAX as usize
}

/// Column sums over `[rows, d]`: one thread per column, one block row per chunk of rows.
/// Returns the configuration and the rows per chunk.
pub(crate) fn columns(rows: usize, d: usize) -> (LaunchConfig, usize) {
    let chunk = rows.div_ceil(MAX_ROW_CHUNKS).max(32);
    let chunks = rows.div_ceil(chunk) as u32;
    let cfg = LaunchConfig {
        grid_dim: (d.div_ceil(BLOCK as usize) as u32, chunks, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    (cfg, chunk)
}

/// The geometry of a convolution as the kernels read it (`ConvGeom` in `conv.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ConvGeom {
    pub batch: i64,
    pub c_in: i64,
    pub h: i64,
    pub w: i64,
    pub c_out: i64,
    pub kh: i64,
    pub kw: i64,
    pub sh: i64,
    pub sw: i64,
    pub ph: i64,
    pub pw: i64,
    pub dh: i64,
    pub dw: i64,
    pub groups: i64,
    pub oh: i64,
    pub ow: i64,
}

// SAFETY: `repr(C)`, sixteen i64 and nothing else: the same layout as `ConvGeom` in conv.cu,
// with no padding and no pointers.
unsafe impl DeviceRepr for ConvGeom {}

/// The geometry of a pooling window as the kernels read it (`PoolGeom` in `pool.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PoolGeom {
    pub batch: i64,
    pub channels: i64,
    pub h: i64,
    pub w: i64,
    pub kh: i64,
    pub kw: i64,
    pub sh: i64,
    pub sw: i64,
    pub ph: i64,
    pub pw: i64,
    pub oh: i64,
    pub ow: i64,
}

// SAFETY: `repr(C)`, twelve i64: the layout of `PoolGeom` in pool.cu.
unsafe impl DeviceRepr for PoolGeom {}

/// One kernel argument. Arguments are collected in a slice that outlives the launch, so the
/// driver reads every value from memory that is still alive.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    /// A device pointer (`T*` in the kernel).
    Ptr(u64),
    /// `u64` (element counts, seeds, offsets).
    U64(u64),
    /// `i64`.
    I64(i64),
    /// `u32` (flags, ignore index).
    U32(u32),
    /// `float`.
    F32(f32),
    /// `ConvGeom`, by value.
    Conv(ConvGeom),
    /// `PoolGeom`, by value.
    Pool(PoolGeom),
}

impl Arg {
    /// An element count or size.
    pub(crate) fn count(n: usize) -> Arg {
        Arg::U64(n as u64)
    }
}

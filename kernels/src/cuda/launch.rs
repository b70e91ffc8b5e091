//! Launch configurations and kernel arguments.

use super::registry::{Instance, Param};
use crate::cpu::elementwise::COLUMN_SUM_ROWS;
use crate::error::{Error, Result};
use cudarc::driver::{DeviceRepr, LaunchConfig};

/// Threads per block of every kernel (a multiple of the warp size, which the block
/// reductions in `common.cuh` rely on).
pub(crate) const BLOCK: u32 = 256;

/// Most blocks a grid-stride kernel is given; each thread then handles several elements.
const MAX_GRID: usize = 1 << 16;

/// The largest grid.y.
const MAX_GRID_Y: usize = 65535;

/// Threads an embedding backward aims for ([`embedding_rows`]).
const EMBEDDING_THREADS: usize = 1 << 16;

/// One thread per element, grid-stride: `ceil(n / BLOCK)` blocks, at most [`MAX_GRID`].
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).min(MAX_GRID) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// The maps of `common.cuh` (`map0`, `map1`, `map2`): one thread per pack of 16 bytes of the
/// widest operand (`widest` bytes per element), grid-stride, at most [`MAX_GRID`] blocks. The
/// kernels take any `n` and any alignment (scalar loops for the rest); this only sizes the
/// grid so that no thread is left without a pack.
pub(crate) fn map(n: usize, widest: usize) -> LaunchConfig {
    let per_thread = (16 / widest.clamp(1, 16)).max(1);
    elementwise(n.div_ceil(per_thread))
}

/// One block per row (softmax, layer norm, row sums). `rows` must fit a grid dimension;
/// callers check with [`fits_grid`].
pub(crate) fn per_row(rows: usize) -> LaunchConfig {
    per_row_parts(rows, 1)
}

/// `parts` blocks per row (grid `(rows, parts)`): a per-channel reduction spread over
/// several blocks. `rows` must fit grid.x ([`fits_grid`]); `parts` at most 65535.
pub(crate) fn per_row_parts(rows: usize, parts: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, parts as u32, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per plane of `plane` values (`planes` blocks): as many threads as the plane
/// needs, rounded up to whole warps, at most [`BLOCK`], so that a 7x7 plane does not leave
/// most of a block idle. `planes` must fit grid.x ([`fits_grid`]).
pub(crate) fn per_plane(planes: usize, plane: usize) -> LaunchConfig {
    let threads = plane.div_ceil(32).clamp(1, BLOCK as usize / 32) as u32 * 32;
    LaunchConfig {
        grid_dim: (planes as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Blocks [`per_plane_split`] aims at: enough to fill a large GPU (132 SMs of an H100, 8
/// blocks of 256 threads each resident) with whole waves to spare.
const SPLIT_TARGET_BLOCKS: usize = 2048;

/// As [`per_plane`], with each plane split over `grid.y` blocks where `planes` alone would
/// leave the device idle (a convolution's 3 input channels over a chunk of 3 images): the
/// blocks of a plane take turns over its positions. At most one block per `block_dim.x`
/// positions, and at most 65535 (grid.y's limit).
pub(crate) fn per_plane_split(planes: usize, plane: usize) -> LaunchConfig {
    let mut cfg = per_plane(planes, plane);
    let most = plane.div_ceil(cfg.block_dim.0 as usize).clamp(1, MAX_GRID_Y);
    let parts = SPLIT_TARGET_BLOCKS.div_ceil(planes.max(1)).clamp(1, most);
    cfg.grid_dim.1 = parts as u32;
    cfg
}

/// Whether `blocks` blocks fit grid.x (2^31 - 1).
pub(crate) fn fits_grid(blocks: usize) -> bool {
    blocks <= i32::MAX as usize
}

/// Column sums over `[rows, d]` (`col_sum`, `layer_norm_params_bwd`): one thread per column,
/// one block row per chunk of [`COLUMN_SUM_ROWS`] rows (at most 65535 block rows, which then
/// stride over the chunks). Returns the configuration and the rows per chunk.
pub(crate) fn columns(rows: usize, d: usize) -> (LaunchConfig, usize) {
    let chunks = rows.div_ceil(COLUMN_SUM_ROWS).clamp(1, MAX_GRID_Y);
    let cfg = LaunchConfig {
        grid_dim: (d.div_ceil(BLOCK as usize) as u32, chunks as u32, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    (cfg, COLUMN_SUM_ROWS)
}

/// Embedding backward over a table of `vocab` rows of `d` (`embedding_bwd`): one thread per
/// column and range of vocabulary rows, each scanning every id, with about
/// [`EMBEDDING_THREADS`] threads in all (fewer ranges for wider rows: every range reads all
/// ids again). Returns the configuration and the rows per range.
pub(crate) fn embedding_rows(vocab: usize, d: usize) -> (LaunchConfig, usize) {
    let threads = d.div_ceil(32).clamp(1, BLOCK as usize / 32) * 32;
    let col_blocks = d.div_ceil(threads).max(1);
    let wanted = (EMBEDDING_THREADS / (col_blocks * threads)).clamp(1, MAX_GRID_Y);
    let per_range = vocab.div_ceil(wanted).max(1);
    let ranges = vocab.div_ceil(per_range).max(1);
    let cfg = LaunchConfig {
        grid_dim: (col_blocks as u32, ranges as u32, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    (cfg, per_range)
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

impl ConvGeom {
    /// The geometry of `p`.
    pub(crate) fn of(p: &crate::params::Conv2dParams) -> ConvGeom {
        let Plane { h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow } = Plane::of(&p.window());
        let i = |v: usize| v as i64;
        let (batch, c_in, c_out, groups) = (i(p.batch()), i(p.c_in()), i(p.c_out()), i(p.groups()));
        ConvGeom { batch, c_in, h, w, c_out, kh, kw, sh, sw, ph, pw, dh, dw, groups, oh, ow }
    }
}

/// The plane geometry of a window ([`Window2d`](crate::params::Window2d)) in the kernels'
/// i64s: what [`ConvGeom`] and [`PoolGeom`] both hold.
struct Plane {
    h: i64,
    w: i64,
    kh: i64,
    kw: i64,
    sh: i64,
    sw: i64,
    ph: i64,
    pw: i64,
    dh: i64,
    dw: i64,
    oh: i64,
    ow: i64,
}

impl Plane {
    fn of(win: &crate::params::Window2d) -> Plane {
        let pair = |(a, b): (usize, usize)| (a as i64, b as i64);
        let ((h, w), (kh, kw)) = (pair(win.input), pair(win.kernel));
        let ((sh, sw), (ph, pw)) = (pair(win.stride), pair(win.padding));
        let ((dh, dw), (oh, ow)) = (pair(win.dilation), pair(win.output));
        Plane { h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow }
    }
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

impl PoolGeom {
    /// The geometry of `p` (a dense window: the kernels read no dilation).
    pub(crate) fn of(p: &crate::params::Pool2dParams) -> PoolGeom {
        let Plane { h, w, kh, kw, sh, sw, ph, pw, oh, ow, .. } = Plane::of(&p.window());
        let (batch, channels) = (p.batch() as i64, p.channels() as i64);
        PoolGeom { batch, channels, h, w, kh, kw, sh, sw, ph, pw, oh, ow }
    }
}

// SAFETY: `repr(C)`, twelve i64: the layout of `PoolGeom` in pool.cu.
unsafe impl DeviceRepr for PoolGeom {}

/// A divisor fixed for a launch, with its magic number: the kernels divide an element index
/// by it with one 64x64-bit high multiply, two shifts and an add (`Div` in `common.cuh`)
/// instead of a 64-bit division, which a GPU does in software (dozens of instructions: more
/// than an elementwise kernel's memory time per element on an H100). Granlund and
/// Montgomery, "Division by Invariant Integers using Multiplication" (1994), figure 4.1, for
/// N = 64: exact for every dividend and divisor below 2^64. PyTorch's `IntDivider` does the
/// same in 32 bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Div {
    /// The divisor d.
    pub d: u64,
    /// m' = floor(2^64 * (2^l - d) / d) + 1 with l = ceil(log2 d).
    m: u64,
    /// min(l, 1).
    s1: u32,
    /// max(l, 1) - 1.
    s2: u32,
}

// SAFETY: `repr(C)`, two u64 then two u32 (24 bytes, no padding, no pointers): the layout of
// `Div` in common.cuh.
unsafe impl DeviceRepr for Div {}

impl Div {
    /// The divider for `d`. A zero divisor stands for one: launches pass it only for empty
    /// tensors, whose kernels divide nothing.
    pub(crate) fn new(d: usize) -> Div {
        let d = (d as u64).max(1);
        let l = if d == 1 { 0 } else { 64 - (d - 1).leading_zeros() };
        // 2^l - d < d, so m' < 2^64 (the paper's bound); the product fits in 128 bits.
        let m = (((1u128 << 64) * ((1u128 << l) - d as u128)) / d as u128 + 1) as u64;
        Div { d, m, s1: l.min(1), s2: l.max(1) - 1 }
    }

    /// n / d exactly as the kernels compute it (`Div::div` in common.cuh).
    #[cfg(test)]
    fn div(&self, n: u64) -> u64 {
        let t = ((self.m as u128 * n as u128) >> 64) as u64;
        (t + ((n - t) >> self.s1)) >> self.s2
    }
}

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
    /// `Div`, by value.
    Div(Div),
}

impl Arg {
    /// The registry parameter type this argument passes.
    pub(crate) fn param(&self) -> Param {
        match self {
            Arg::Ptr(_) => Param::Ptr,
            Arg::U64(_) => Param::U64,
            Arg::I64(_) => Param::I64,
            Arg::U32(_) => Param::U32,
            Arg::F32(_) => Param::F32,
            Arg::Conv(_) => Param::Conv,
            Arg::Pool(_) => Param::Pool,
            Arg::Div(_) => Param::Div,
        }
    }

    /// An element count or size.
    pub(crate) fn count(n: usize) -> Arg {
        Arg::U64(n as u64)
    }

    /// A divisor of element indices ([`Div`]).
    pub(crate) fn div(d: usize) -> Arg {
        Arg::Div(Div::new(d))
    }
}

/// A custom op's argument ([`crate::custom`]) as the launch code passes it.
impl From<crate::custom::KernelArg> for Arg {
    fn from(a: crate::custom::KernelArg) -> Arg {
        use crate::custom::KernelArg as K;
        match a {
            K::Ptr(v) => Arg::Ptr(v),
            K::U64(v) => Arg::U64(v),
            K::I64(v) => Arg::I64(v),
            K::U32(v) => Arg::U32(v),
            K::F32(v) => Arg::F32(v),
        }
    }
}

/// Checks that `args` match `kernel`'s registered parameters in number and type.
pub(crate) fn check_args(kernel: Instance, args: &[Arg]) -> Result<()> {
    let params = kernel.kernel.params;
    if args.len() == params.len() && args.iter().zip(params).all(|(a, &p)| a.param() == p) {
        return Ok(());
    }
    Err(Error::Device {
        op: "kernel launch",
        reason: format!(
            "{}: arguments {args:?} do not match the parameters {params:?}",
            kernel.name
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::registry::{AXPY, FILL};
    use crate::dtype::DType;

    #[test]
    fn arguments_that_do_not_match_the_registry_are_refused() {
        let fill = FILL.of(DType::BF16);
        assert_eq!(fill.name, "fill_bf16");
        check_args(fill, &[Arg::Ptr(0), Arg::F32(1.0), Arg::count(4)]).unwrap();
        let swapped = check_args(fill, &[Arg::F32(1.0), Arg::Ptr(0), Arg::count(4)]);
        assert!(swapped.unwrap_err().to_string().contains("fill_bf16"));
        assert!(check_args(fill, &[Arg::Ptr(0), Arg::F32(1.0)]).is_err(), "one too few");
        assert_eq!(AXPY.of_pair(DType::F32, DType::F16).name, "axpy_f32_f16");
    }

    /// Checks the divider of `d` on the dividends most likely to break it: around 0, around
    /// multiples of d (where the quotient steps), and at the top of the range.
    fn check_divisor(d: u64) {
        let div = Div::new(d as usize);
        let mut dividends =
            vec![0, 1, 2, d - 1, d, d.saturating_add(1), u64::MAX, u64::MAX - 1, u64::MAX / 2];
        for q in
            [1u64, 2, 3, 1 << 20, u64::MAX / d, u64::MAX / d / 2, (u64::MAX / d).saturating_sub(1)]
        {
            if let Some(n) = q.checked_mul(d) {
                dividends.extend([n.saturating_sub(1), n, n.saturating_add(1)]);
            }
        }
        for n in dividends {
            assert_eq!(div.div(n), n / d, "{n} / {d}");
        }
    }

    #[test]
    fn the_divider_is_exact_at_the_edges_of_the_range() {
        let mut divisors = vec![1u64, 2, 3, 5, 6, 7, 49, 196, 3136, 50257, 12544];
        for k in 1..64 {
            divisors.extend([(1u64 << k) - 1, 1 << k, (1u64 << k) + 1]);
        }
        divisors.extend([u64::MAX, u64::MAX - 1, u64::MAX / 3, (1 << 63) + 12345]);
        for d in divisors {
            check_divisor(d);
        }
        assert_eq!(Div::new(0), Div::new(1), "a zero divisor stands for one");
        let one = Div::new(1);
        assert_eq!((one.s1, one.s2, one.div(u64::MAX)), (0, 0, u64::MAX));
    }

    proptest::proptest! {
        #[test]
        fn the_divider_matches_integer_division(
            d in 1u64..,
            n: u64,
            q: u64,
            small in 1u64..100_000,
            m in 0u64..(1 << 40),
        ) {
            let div = Div::new(d as usize);
            proptest::prop_assert_eq!(div.div(n), n / d);
            // A multiple of d and the dividend before it: where the quotient steps.
            let k = (q % (u64::MAX / d + 1)) * d;
            proptest::prop_assert_eq!(div.div(k), k / d);
            proptest::prop_assert_eq!(div.div(k.saturating_sub(1)), k.saturating_sub(1) / d);
            let small_div = Div::new(small as usize);
            proptest::prop_assert_eq!(small_div.div(m), m / small);
            proptest::prop_assert_eq!(small_div.div(n), n / small);
        }
    }
}

//! Axis permutation (PyTorch's `x.permute(perm).contiguous()`): a copy into a new tensor
//! whose axes are reordered, and its backward, the inverse permutation. Attention uses it to
//! turn `[b, s, heads, dh]` into `[b, heads, s, dh]` and back.

use super::dispatch::{Buffers, Op, Plan, run};
use crate::cpu::permute as cpu;
use crate::device::Device;
use crate::dtype::with_dtype;
use crate::error::Result;
use crate::tensor::Tensor;

pub use crate::cpu::permute::MAX_RANK as MAX_PERMUTE_RANK;

/// `x` with its axes reordered: output axis `i` is input axis `perm[i]`, so the result has
/// shape `[x.shape[perm[0]], x.shape[perm[1]], ..]`. Always a copy into a new contiguous
/// tensor (rank 0 to [`MAX_PERMUTE_RANK`]).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if `perm` is not a
/// permutation of `0..x.rank()` (a repeated or out-of-range axis, a wrong length) or has
/// more than [`MAX_PERMUTE_RANK`] axes; out of memory.
pub fn permute(x: &Tensor, perm: &[usize]) -> Result<Tensor> {
    run(Permute { x, perm })
}

/// Gradient of [`permute`]`(x, perm)` with respect to `x`: `dy` permuted back by the inverse
/// of `perm`, in `x`'s shape.
///
/// # Errors
///
/// As [`permute`] (`perm` is checked against `dy`'s rank).
pub fn permute_backward(dy: &Tensor, perm: &[usize]) -> Result<Tensor> {
    cpu::check_perm("permute_backward", dy.shape(), perm)?;
    permute(dy, &inverse_permutation(perm))
}

/// The inverse of a permutation: `inv[perm[i]] = i`. `perm` must be a permutation.
fn inverse_permutation(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    inv
}

struct Permute<'a> {
    x: &'a Tensor,
    perm: &'a [usize],
}

impl Op for Permute<'_> {
    const NAME: &'static str = "permute";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        cpu::check_perm(Self::NAME, self.x.shape(), self.perm)?;
        let shape: Vec<usize> = self.perm.iter().map(|&p| self.x.shape()[p]).collect();
        Ok(Plan::one(&shape, self.x.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.x.dtype(), T => cpu::permute(
            self.x.as_slice::<T>()?,
            self.x.shape(),
            self.perm,
            bufs.out().out_slice::<T>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, helpers::ptr, launch::elementwise as grid, registry::PERMUTE};
        let y = bufs.out();
        let n = y.numel();
        if n == 0 {
            return Ok(());
        }
        let (d, s) = cpu::geometry(self.x.shape(), self.perm);
        // SAFETY: permute_T(const T* x, T* y, u64 n, Div d1, Div d2, Div d3, u64 s0, u64 s1,
        // u64 s2, u64 s3); x and y hold n = d0 * d1 * d2 * d3 elements and every source index
        // sum(i_k * s_k) is below n (`s` are the input strides of a permutation of its axes).
        unsafe {
            gpu.launch(
                PERMUTE.of(self.x.dtype()),
                grid(n),
                &[
                    ptr(self.x)?,
                    ptr(y)?,
                    Arg::count(n),
                    Arg::div(d[1]),
                    Arg::div(d[2]),
                    Arg::div(d[3]),
                    Arg::count(s[0]),
                    Arg::count(s[1]),
                    Arg::count(s[2]),
                    Arg::count(s[3]),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

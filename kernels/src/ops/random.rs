//! Dropout with a counter-based RNG: the mask is a function of `(seed, offset + index)`, so
//! the backward (and a checkpointed recomputation) regenerates it instead of storing it.

use super::dispatch::{Buffers, Op, Plan, run};
use crate::cpu::random as cpu;
use crate::device::Device;
use crate::dtype::with_dtype;
use crate::error::Result;
use crate::tensor::Tensor;

/// Dropout: element `i` is zeroed with probability `p`, and kept elements are scaled by
/// `1 / (1 - p)`. The mask depends only on `(seed, offset + i)`: give each call a disjoint
/// range (advance `offset` by the element count) and the backward the same arguments.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) unless `0 <= p < 1`; out of
/// memory.
pub fn dropout(x: &Tensor, p: f32, seed: u64, offset: u64) -> Result<Tensor> {
    run(Dropout { x, p, seed, offset, backward: false })
}

/// Gradient of [`dropout`] with the forward's `(p, seed, offset)`: `dy` masked and scaled as
/// the forward masked and scaled `x`.
///
/// # Errors
///
/// As [`dropout`].
pub fn dropout_backward(dy: &Tensor, p: f32, seed: u64, offset: u64) -> Result<Tensor> {
    run(Dropout { x: dy, p, seed, offset, backward: true })
}

/// The mask applied to `x` (the input, or the upstream gradient for the backward).
struct Dropout<'a> {
    x: &'a Tensor,
    p: f32,
    seed: u64,
    offset: u64,
    backward: bool,
}

impl Op for Dropout<'_> {
    const NAME: &'static str = "dropout";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let op = if self.backward { "dropout_backward" } else { Self::NAME };
        cpu::check_probability(op, self.p)?;
        Ok(Plan::one(self.x.shape(), self.x.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let (p, seed, offset) = (self.p, self.seed, self.offset);
        with_dtype!(self.x.dtype(), T => {
            let (x, y) = (self.x.as_slice::<T>()?, bufs.out().out_slice::<T>(Self::NAME)?);
            if self.backward {
                cpu::dropout_backward(x, y, p, seed, offset)
            } else {
                cpu::dropout(x, y, p, seed, offset)
            }
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, helpers::ptr, launch::elementwise as grid, registry::DROPOUT};
        let y = bufs.out();
        let n = y.numel();
        let scale = 1.0 / (1.0 - self.p);
        // SAFETY: dropout_T(const T* x, T* y, u64 n, float p, float scale, u64 seed, u64
        // offset); x and y hold n elements.
        unsafe {
            gpu.launch(
                DROPOUT.of(self.x.dtype()),
                grid(n),
                &[
                    ptr(self.x)?,
                    ptr(y)?,
                    Arg::count(n),
                    Arg::F32(self.p),
                    Arg::F32(scale),
                    Arg::U64(self.seed),
                    Arg::U64(self.offset),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

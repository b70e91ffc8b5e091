//! Softmax over the last dimension, plain and causal, forward and backward.

use super::dispatch::{Buffers, Op, Plan, run};
use super::{invalid, rows_cols, same_layout};
use crate::cpu::softmax as cpu;
use crate::device::Device;
use crate::dtype::with_dtype;
use crate::error::Result;
use crate::tensor::Tensor;

/// The row length softmax normalizes over: the last dimension, or (causal) the sequence
/// length of scores `[.., seq, seq]`.
fn row_len(op: &'static str, x: &Tensor, causal: bool) -> Result<usize> {
    if !causal {
        return Ok(rows_cols(op, x.shape())?.1);
    }
    match x.shape() {
        [.., a, b] if a == b => Ok(*a),
        shape => Err(invalid(op, format!("expected scores [.., seq, seq], got {shape:?}"))),
    }
}

/// Softmax over the last dimension of `x`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a rank-0 `x`; out of memory.
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    run(Softmax { x, dy: None, causal: false, cols: 0 })
}

/// Gradient of [`softmax`] from its output `y` and the upstream `dy`.
///
/// # Errors
///
/// Shape, dtype and device mismatches between `y` and `dy`; out of memory.
pub fn softmax_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    run(Softmax { x: y, dy: Some(dy), causal: false, cols: 0 })
}

/// Causally masked softmax of attention scores `x: [.., seq, seq]`: row `i` is a softmax over
/// columns `j <= i`, and the output is 0 for `j > i` (those inputs are never read).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) unless the last two dimensions
/// are equal; out of memory.
pub fn causal_softmax(x: &Tensor) -> Result<Tensor> {
    run(Softmax { x, dy: None, causal: true, cols: 0 })
}

/// Gradient of [`causal_softmax`] from its output `y` and the upstream `dy`.
///
/// # Errors
///
/// As [`causal_softmax`], and mismatches between `y` and `dy`.
pub fn causal_softmax_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    run(Softmax { x: y, dy: Some(dy), causal: true, cols: 0 })
}

/// A softmax (`dy: None`, `x` the input) or its gradient (`x` the forward's output).
struct Softmax<'a> {
    x: &'a Tensor,
    dy: Option<&'a Tensor>,
    causal: bool,
    cols: usize,
}

impl Softmax<'_> {
    fn name(&self) -> &'static str {
        match (self.causal, self.dy.is_some()) {
            (false, false) => "softmax",
            (false, true) => "softmax_backward",
            (true, false) => "causal_softmax",
            (true, true) => "causal_softmax_backward",
        }
    }
}

impl Op for Softmax<'_> {
    const NAME: &'static str = "softmax";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let op = self.name();
        if let Some(dy) = self.dy {
            same_layout(op, self.x, dy)?;
        }
        self.cols = row_len(op, self.x, self.causal)?;
        Ok(Plan::one(self.x.shape(), self.x.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let (cols, causal) = (self.cols, self.causal);
        with_dtype!(self.x.dtype(), T => {
            let (x, out) = (self.x.as_slice::<T>()?, bufs.out().out_slice::<T>(Self::NAME)?);
            match (self.dy, causal) {
                (None, false) => cpu::softmax(x, out, cols),
                (None, true) => cpu::causal_softmax(x, out, cols),
                (Some(dy), false) => cpu::softmax_backward(x, dy.as_slice::<T>()?, out, cols),
                (Some(dy), true) => cpu::causal_softmax_backward(x, dy.as_slice::<T>()?, out, cols),
            }
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{check_rows, ptr};
        use crate::cuda::registry::{SOFTMAX_BWD, SOFTMAX_FWD};
        use crate::cuda::{Arg, launch};
        let out = bufs.out();
        if out.numel() == 0 {
            return Ok(());
        }
        let cols = self.cols;
        let rows = out.numel() / cols;
        check_rows(self.name(), rows)?;
        // seq > 0 makes the kernels causal (cols == seq).
        let seq = if self.causal { cols } else { 0 };
        match self.dy {
            // SAFETY: softmax_T(const T* x, T* y, u64 cols, u64 seq), one block per row; x
            // and y hold rows * cols elements.
            None => unsafe {
                gpu.launch(
                    SOFTMAX_FWD.of(self.x.dtype()),
                    launch::per_row(rows),
                    &[ptr(self.x)?, ptr(out)?, Arg::count(cols), Arg::count(seq)],
                )
            },
            // SAFETY: softmax_bwd_T(const T* y, const T* dy, T* dx, u64 cols, u64 seq), one
            // block per row; all three hold rows * cols elements (same layout, checked).
            Some(dy) => unsafe {
                gpu.launch(
                    SOFTMAX_BWD.of(self.x.dtype()),
                    launch::per_row(rows),
                    &[ptr(self.x)?, ptr(dy)?, ptr(out)?, Arg::count(cols), Arg::count(seq)],
                )
            },
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

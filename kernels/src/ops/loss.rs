//! Fused softmax cross-entropy over class logits, forward and backward. Targets live on the
//! host; they are checked before anything is allocated and, on a GPU, uploaded into a
//! workspace.

use super::dispatch::{Buffers, Op, Plan, run};
use super::reduce::sum_workspaces;
use super::{expect_dtype, expect_rank, expect_shape, same_device};
use crate::cpu::loss as cpu;
use crate::device::Device;
use crate::dtype::{DType, with_dtype};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The result of [`cross_entropy`].
#[derive(Debug)]
pub struct CrossEntropy {
    /// The mean loss over the rows not ignored (NaN if every row is ignored, and on a
    /// virtual device, which computes nothing).
    pub loss: f32,
    /// Per-row log-sum-exp, `[n]` f32, saved for [`cross_entropy_backward`].
    pub lse: Tensor,
}

/// Checks logits `[n, c]` against `n` targets and the targets against `c`.
fn check(op: &'static str, logits: &Tensor, targets: &[u32], ignore: Option<u32>) -> Result<()> {
    expect_rank(op, logits, 2, "of logits [n, classes]")?;
    if logits.shape()[0] != targets.len() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: logits.shape().to_vec(),
            rhs: vec![targets.len()],
        });
    }
    cpu::validate(op, targets, logits.shape()[1], ignore)
}

/// Mean softmax cross-entropy of `logits: [n, c]` (any dtype, computed in f32) against class
/// indices `targets: [n]`; rows whose target is `ignore_index` do not count.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] if `targets.len() != n`; [`Error::IndexOutOfRange`] for a target
/// not below `c`; out of memory.
pub fn cross_entropy(
    logits: &Tensor,
    targets: &[u32],
    ignore_index: Option<u32>,
) -> Result<CrossEntropy> {
    run(CrossEntropyOp { logits, targets, ignore_index, loss: f32::NAN, ws: [None; 4] })
}

struct CrossEntropyOp<'a> {
    logits: &'a Tensor,
    targets: &'a [u32],
    ignore_index: Option<u32>,
    loss: f32,
    /// The targets, the per-row losses, the partial sums and the total on the device.
    ws: [Option<usize>; 4],
}

impl Op for CrossEntropyOp<'_> {
    const NAME: &'static str = "cross_entropy";
    type Outs = Tensor;
    type Output = CrossEntropy;

    fn device(&self) -> &Device {
        self.logits.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        check(Self::NAME, self.logits, self.targets, self.ignore_index)?;
        let n = self.targets.len();
        let mut plan = Plan::one(&[n], DType::F32);
        if self.logits.numel() > 0 {
            self.ws[0] = plan.workspace(n * 4);
            self.ws[1] = plan.workspace(n * 4);
            let (partial, total) = sum_workspaces(n);
            self.ws[2] = plan.workspace(partial);
            self.ws[3] = plan.workspace(total);
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        self.loss = with_dtype!(self.logits.dtype(), T => cpu::cross_entropy(
            self.logits.as_slice::<T>()?,
            self.targets,
            self.ignore_index,
            bufs.out().out_slice::<f32>(Self::NAME)?,
        ))?;
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{check_rows, ptr, sum, upload_u32};
        use crate::cuda::{Arg, launch, registry::CE_FWD};
        let (n, c) = (self.targets.len(), self.logits.shape()[1]);
        if n == 0 || c == 0 {
            // Every row is ignored (checked in `plan`): the mean of nothing.
            return Ok(());
        }
        check_rows(Self::NAME, n)?;
        let [t, losses, partial, total] = [0, 1, 2, 3].map(|i| bufs.ws(self.ws[i]));
        let (t, losses, partial, total) = (t?, losses?, partial?, total?);
        upload_u32(gpu, self.targets, t)?;
        let ignore = self.ignore_index;
        // SAFETY: ce_fwd_T(const T* x, const u32* t, u64 c, u32 ignore, u32 has_ignore,
        // float* lse, float* loss), one block per row; logits hold n * c elements, targets n
        // (each below c unless ignored, checked in `plan`), lse and losses n floats.
        unsafe {
            gpu.launch(
                CE_FWD.of(self.logits.dtype()),
                launch::per_row(n),
                &[
                    ptr(self.logits)?,
                    Arg::Ptr(t),
                    Arg::count(c),
                    Arg::U32(ignore.unwrap_or(0)),
                    Arg::U32(ignore.is_some() as u32),
                    ptr(bufs.out())?,
                    Arg::Ptr(losses),
                ],
            )?;
        }
        let count = self.targets.iter().filter(|&&t| Some(t) != ignore).count();
        let blocks = sum_workspaces(n).0 / 4;
        self.loss = sum(gpu, losses, DType::F32, n, (partial, blocks), total)? / count as f32;
        Ok(())
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<CrossEntropy> {
        Ok(CrossEntropy { loss: self.loss, lse: bufs.into_output() })
    }
}

/// Gradient of [`cross_entropy`] with respect to the logits, for the upstream gradient
/// `dloss` of the scalar loss (1 for a plain loss, the loss scale under mixed precision).
///
/// # Errors
///
/// As [`cross_entropy`], and mismatches of `lse` (`[n]` f32 on the logits' device).
pub fn cross_entropy_backward(
    logits: &Tensor,
    targets: &[u32],
    ignore_index: Option<u32>,
    lse: &Tensor,
    dloss: f32,
) -> Result<Tensor> {
    run(CrossEntropyBackward { logits, targets, ignore_index, lse, dloss, upload: None })
}

struct CrossEntropyBackward<'a> {
    logits: &'a Tensor,
    targets: &'a [u32],
    ignore_index: Option<u32>,
    lse: &'a Tensor,
    dloss: f32,
    /// The targets on the device.
    upload: Option<usize>,
}

impl Op for CrossEntropyBackward<'_> {
    const NAME: &'static str = "cross_entropy_backward";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.logits.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        check(Self::NAME, self.logits, self.targets, self.ignore_index)?;
        same_device(Self::NAME, self.logits, self.lse)?;
        expect_dtype(Self::NAME, DType::F32, self.lse)?;
        expect_shape(Self::NAME, &[self.targets.len()], self.lse)?;
        let mut plan = Plan::one(self.logits.shape(), self.logits.dtype());
        if self.logits.numel() > 0 {
            self.upload = plan.workspace(self.targets.len() * 4);
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.logits.dtype(), T => cpu::cross_entropy_backward(
            self.logits.as_slice::<T>()?,
            self.targets,
            self.ignore_index,
            self.lse.as_slice::<f32>()?,
            self.dloss,
            bufs.out().out_slice::<T>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{ptr, upload_u32};
        use crate::cuda::{Arg, launch::elementwise as grid, registry::CE_BWD};
        let total = self.logits.numel();
        if total == 0 {
            return Ok(());
        }
        let c = self.logits.shape()[1];
        let ignore = self.ignore_index;
        let count = self.targets.iter().filter(|&&t| Some(t) != ignore).count();
        let g = self.dloss / count as f32;
        let t = bufs.ws(self.upload)?;
        upload_u32(gpu, self.targets, t)?;
        // SAFETY: ce_bwd_T(const T* x, const u32* t, const float* lse, float g, Div c, u32
        // ignore, u32 has_ignore, T* dx, u64 n); logits and dlogits hold n = rows * c
        // elements, targets and lse one per row, targets checked in `plan`.
        unsafe {
            gpu.launch(
                CE_BWD.of(self.logits.dtype()),
                grid(total),
                &[
                    ptr(self.logits)?,
                    Arg::Ptr(t),
                    ptr(self.lse)?,
                    Arg::F32(g),
                    Arg::div(c),
                    Arg::U32(ignore.unwrap_or(0)),
                    Arg::U32(ignore.is_some() as u32),
                    ptr(bufs.out())?,
                    Arg::count(total),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

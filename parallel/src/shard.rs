//! ZeRO's partition of one parameter: rank `r` owns elements `[r*s, (r+1)*s)` of the
//! flattened parameter (`s = ceil(numel / N)`, the last shard zero-padded), with its f32
//! master copy and AdamW moments, and (ZeRO-2, ZeRO-3) its part of the gradient.
//!
//! Accounting (DeepSpeed's, ZeRO paper section 3.1): working weights and gradients in the
//! model's dtype (2 + 2 bytes per parameter in 16-bit training), optimizer state of
//! K = 12 bytes (f32 master, first and second moment). In f32 the working copy of a
//! ZeRO-3 shard is its master (shared memory), so 4 + 4 + 8 = 16 bytes too; ZeRO-1 and
//! ZeRO-2 in f32 keep a master shard beside the full f32 weights (4 + 4 + 12/N).

use crate::collective::Collective;
use crate::comm::ReduceOp;
use crate::error::DistError;
use vram_kernels::{AdamWConfig, DType, Device, Tensor, ops};

/// One rank's partition of one parameter.
#[derive(Debug)]
pub(crate) struct Shard {
    shape: Vec<usize>,
    numel: usize,
    /// Elements per shard (`ceil(numel / N)`).
    len: usize,
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: u32,
    /// This rank's part of the averaged gradient (model dtype).
    pub(crate) grad: Option<Tensor>,
    /// ZeRO-3: the working copy of the shard (model dtype), gathered before use.
    pub(crate) work: Option<Tensor>,
}

impl Shard {
    /// Cuts this rank's shard out of the full `value`.
    pub(crate) fn new(comm: &dyn Collective, value: &Tensor) -> Result<Shard, DistError> {
        let (n, r) = (comm.world_size(), comm.rank());
        let numel = value.numel();
        let len = numel.div_ceil(n);
        let dev = value.device();
        let mut master = Tensor::zeros(dev, &[len], DType::F32)?;
        let start = (r * len).min(numel);
        let take = len.min(numel - start);
        if take > 0 {
            let full = if value.dtype() == DType::F32 {
                value.clone()
            } else {
                value.to_dtype(DType::F32)?
            };
            comm.copy_elements(&full, start, &mut master, 0, take)?;
        }
        Ok(Shard {
            shape: value.shape().to_vec(),
            numel,
            len,
            master,
            exp_avg: Tensor::zeros(dev, &[len], DType::F32)?,
            exp_avg_sq: Tensor::zeros(dev, &[len], DType::F32)?,
            step: 0,
            grad: None,
            work: None,
        })
    }

    fn padded(&self, n: usize) -> usize {
        self.len * n
    }

    /// The working copy of the updated shard in `dtype` (shares the master's memory in f32).
    pub(crate) fn working(&self, dtype: DType) -> Result<Tensor, DistError> {
        Ok(if dtype == DType::F32 { self.master.clone() } else { self.master.to_dtype(dtype)? })
    }

    /// Gathers the full parameter from every rank's `shard` into `out` (`numel` elements).
    pub(crate) fn gather_into(
        &self,
        comm: &dyn Collective,
        shard: &Tensor,
        out: &mut Tensor,
    ) -> Result<(), DistError> {
        let n = comm.world_size();
        if self.padded(n) == self.numel {
            return comm.all_gather(shard, out);
        }
        let mut padded = Tensor::zeros(shard.device(), &[self.padded(n)], shard.dtype())?;
        comm.all_gather(shard, &mut padded)?;
        comm.copy_elements(&padded, 0, out, 0, self.numel)
    }

    /// A freshly allocated full parameter gathered from the ranks' working shards (ZeRO-3).
    pub(crate) fn gather(&self, comm: &dyn Collective) -> Result<Tensor, DistError> {
        let work = self.work.as_ref().ok_or_else(|| {
            DistError::Invalid("ZeRO-3: a parameter's working shard is missing".into())
        })?;
        let mut out = Tensor::zeros(work.device(), &self.shape, work.dtype())?;
        self.gather_into(comm, work, &mut out)?;
        Ok(out)
    }

    /// Reduce-scatters (averages) the full gradient `grad` and adds this rank's part into
    /// [`Shard::grad`].
    pub(crate) fn reduce_grad(
        &mut self,
        comm: &dyn Collective,
        grad: &Tensor,
    ) -> Result<(), DistError> {
        let n = comm.world_size();
        let mut part = Tensor::zeros(grad.device(), &[self.len], grad.dtype())?;
        if self.padded(n) == self.numel {
            comm.reduce_scatter(grad, &mut part, ReduceOp::Average)?;
        } else {
            let mut padded = Tensor::zeros(grad.device(), &[self.padded(n)], grad.dtype())?;
            comm.copy_elements(grad, 0, &mut padded, 0, self.numel)?;
            comm.reduce_scatter(&padded, &mut part, ReduceOp::Average)?;
        }
        match &mut self.grad {
            Some(acc) => ops::add_assign(acc, &part)?,
            None => self.grad = Some(part),
        }
        Ok(())
    }

    /// AdamW on every shard's master from its [`Shard::grad`], in one multi-tensor launch
    /// (PyTorch's `fused=True`; [`ops::adamw_step_multi`]); `keep_grad: false` drops the
    /// gradient parts afterwards (ZeRO-1 keeps full gradients instead). Nothing is updated
    /// when a shard has no gradient or its step count would overflow.
    pub(crate) fn step_all(
        shards: &mut [Shard],
        cfg: &AdamWConfig,
        keep_grad: bool,
    ) -> Result<(), DistError> {
        let mut list = Vec::with_capacity(shards.len());
        for s in shards.iter_mut() {
            let Some(grad) = &s.grad else {
                return Err(DistError::Invalid("a parameter got no gradient this step".into()));
            };
            let step = s
                .step
                .checked_add(1)
                .ok_or_else(|| DistError::Invalid("a parameter has taken u32::MAX steps".into()))?;
            list.push(ops::AdamWTensors {
                param: &mut s.master,
                grad,
                exp_avg: &mut s.exp_avg,
                exp_avg_sq: &mut s.exp_avg_sq,
                master: None,
                step,
            });
        }
        ops::adamw_step_multi(&mut list, cfg)?;
        drop(list);
        for s in shards.iter_mut() {
            s.step += 1;
            if !keep_grad {
                s.grad = None;
            }
        }
        Ok(())
    }
}

/// An empty tensor standing for a released parameter (ZeRO-3 between uses, `DataParallel`
/// replicas between steps): holds no memory.
pub(crate) fn released(device: &Device, dtype: DType) -> Result<Tensor, DistError> {
    Ok(Tensor::zeros(device, &[0], dtype)?)
}

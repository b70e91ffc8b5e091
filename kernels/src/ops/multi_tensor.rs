//! Multi-tensor optimizer steps: AdamW and SGD over a whole parameter list in one CUDA
//! launch, PyTorch's `torch.optim.AdamW(fused=True)` and `SGD(fused=True)`.
//!
//! The per-tensor steps ([`adamw_step`](super::adamw_step), [`sgd_step`](super::sgd_step))
//! launch one kernel per parameter, and a 16-bit parameter with an f32 master a second one
//! (the cast of the master into the parameter): a GPT with 148 parameter tensors pays 148 to
//! 296 launches per step, each a few microseconds of launch overhead over a few kilobytes.
//! Here one launch updates every tensor, in the layout of PyTorch's `multi_tensor_apply`
//! (`aten/src/ATen/native/cuda/MultiTensorApply.cuh`): each block updates one chunk of
//! [`CHUNK`] elements of one tensor, told which by a table of tensor addresses, sizes and
//! element types. PyTorch passes that table as a kernel argument, limited to 4 KiB, and so
//! splits long lists over several launches; here the host writes it into a workspace of the
//! op (one copy to the device per step, from the caching allocator like every buffer, so a
//! virtual device counts it) and one launch covers any number of tensors.
//!
//! The math per element is the per-tensor ops', in f32: PyTorch's fused AdamW
//! (`fused_adam_utils.cuh`: decoupled weight decay first, `param -= lr * wd * param`, then
//! the moments, then `param -= step_size * exp_avg / (sqrt(exp_avg_sq) / bias2_sqrt + eps)`
//! with bias corrections of each tensor's own step count), and `torch.optim.SGD`. Each tensor
//! has its own element types: an f32 parameter is updated in place; a 16-bit parameter with
//! an f32 master has the master updated and the result rounded once into the parameter
//! (apex O2's master weights, in the same pass); a 16-bit parameter without one is read,
//! updated in f32 and rounded back (PyTorch's fused AdamW on bf16 parameters). Gradients may
//! be of any dtype; moments and momentum buffers are f32.
//!
//! The host reference runs the per-tensor CPU updates in turn, so its results are the
//! per-tensor ops' bit for bit; the kernel (emulated on the host in the tests below) matches
//! them bit for bit without fused multiply-adds, within f32 rounding with them (NVRTC
//! contracts `a * b + c`).

use super::dispatch::{Buffers, Op, Plan, run};
use super::{expect_dtype, invalid, same_device};
use crate::cpu::optim as cpu;
use crate::device::Device;
use crate::dtype::{DType, Element, with_dtype};
use crate::error::{Error, Result};
use crate::params::{AdamWConfig, SgdConfig};
use crate::tensor::Tensor;

/// Elements one block updates (PyTorch's `kChunkSize`).
pub(crate) const CHUNK: usize = 65536;

/// Bytes of one tensor's entry of the table (`MultiEntry` in `multi_tensor.cu`).
const ENTRY_BYTES: usize = 64;

/// Bytes of one block's task (`MultiTask`).
const TASK_BYTES: usize = 8;

/// Bytes of the table for tensors of `sizes` elements, in chunks of `chunk`: an entry per
/// non-empty tensor and a task per chunk.
fn table_bytes(sizes: impl Iterator<Item = usize>, chunk: usize) -> usize {
    sizes.filter(|&n| n > 0).map(|n| ENTRY_BYTES + TASK_BYTES * n.div_ceil(chunk)).sum()
}

/// A multi-tensor op's plan: no outputs, one workspace (its index stored in `table`) for the
/// table of tensors of `sizes` elements.
fn table_plan(table: &mut Option<usize>, sizes: impl Iterator<Item = usize>) -> Plan<()> {
    let mut plan = Plan::none();
    *table = plan.workspace(table_bytes(sizes, CHUNK));
    plan
}

/// One parameter of [`adamw_step_multi`] and its state.
#[derive(Debug)]
pub struct AdamWTensors<'a> {
    /// The parameter: f32, f16 or bf16.
    pub param: &'a mut Tensor,
    /// Its gradient: the parameter's shape, any dtype.
    pub grad: &'a Tensor,
    /// The first moment (f32), zeros before the first step.
    pub exp_avg: &'a mut Tensor,
    /// The second moment (f32), zeros before the first step.
    pub exp_avg_sq: &'a mut Tensor,
    /// An f32 copy of the parameter that is updated instead, then rounded into `param`.
    pub master: Option<&'a mut Tensor>,
    /// This parameter's 1-based step count (its bias correction).
    pub step: u32,
}

/// One parameter of [`sgd_step_multi`] and its state.
#[derive(Debug)]
pub struct SgdTensors<'a> {
    /// The parameter: f32, f16 or bf16.
    pub param: &'a mut Tensor,
    /// Its gradient: the parameter's shape, any dtype.
    pub grad: &'a Tensor,
    /// The momentum buffer (f32); needed when the momentum is not 0, ignored when it is.
    pub momentum_buf: Option<&'a mut Tensor>,
    /// Whether the buffer is not initialized yet (it then becomes the gradient).
    pub first_step: bool,
    /// An f32 copy of the parameter that is updated instead, then rounded into `param`.
    pub master: Option<&'a mut Tensor>,
}

/// One AdamW step ([`adamw_step`](super::adamw_step)'s math) on every tensor of `tensors`,
/// in one CUDA launch. Each tensor counts its own steps; see the module doc for the dtypes.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an invalid `cfg` or a step of 0; [`Error::DeviceMismatch`]
/// for tensors on several devices; [`Error::DTypeMismatch`] for non-f32 moments or master;
/// [`Error::ShapeMismatch`] for a gradient, moment or master not of its parameter's shape.
/// Nothing is updated on error.
pub fn adamw_step_multi(tensors: &mut [AdamWTensors<'_>], cfg: &AdamWConfig) -> Result<()> {
    let Some(device) = tensors.first().map(|t| t.param.device().clone()) else {
        return cfg.validate();
    };
    run(MultiAdamW { device, list: tensors, cfg, table: None })
}

/// One SGD step ([`sgd_step`](super::sgd_step)'s math) on every tensor of `tensors`, in one
/// CUDA launch; see the module doc for the dtypes.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an invalid `cfg` or a missing momentum buffer;
/// [`Error::DeviceMismatch`]; [`Error::DTypeMismatch`] for a non-f32 buffer or master;
/// [`Error::ShapeMismatch`]. Nothing is updated on error.
pub fn sgd_step_multi(tensors: &mut [SgdTensors<'_>], cfg: &SgdConfig) -> Result<()> {
    let Some(device) = tensors.first().map(|t| t.param.device().clone()) else {
        return cfg.validate();
    };
    run(MultiSgd { device, list: tensors, cfg, table: None })
}

/// Checks `t` against its parameter: same device, same shape, and f32 when `f32_only`.
fn check_like(op: &'static str, t: &Tensor, param: &Tensor, f32_only: bool) -> Result<()> {
    same_device(op, t, param)?;
    if f32_only {
        expect_dtype(op, DType::F32, t)?;
    }
    if t.shape() != param.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: t.shape().to_vec(),
            rhs: param.shape().to_vec(),
        });
    }
    Ok(())
}

/// Checks a parameter, its gradient and master on `device`.
fn check_param(
    op: &'static str,
    device: &Device,
    param: &Tensor,
    grad: &Tensor,
    master: Option<&Tensor>,
) -> Result<()> {
    if param.device() != device {
        return Err(Error::DeviceMismatch { op });
    }
    check_like(op, grad, param, false)?;
    if let Some(m) = master {
        check_like(op, m, param, true)?;
    }
    Ok(())
}

/// Rounds `src` into `dst` (as a cast does: round to nearest even).
fn round_into(dst: &mut Tensor, src: &[f32]) -> Result<()> {
    with_dtype!(dst.dtype(), T => {
        for (d, s) in dst.as_mut_slice::<T>()?.iter_mut().zip(src) {
            *d = T::from_f32(*s);
        }
    });
    Ok(())
}

/// Runs `update` on the f32 values of a parameter: its master (then rounded into it), the
/// parameter itself when f32, else a widened copy rounded back.
fn update_in_f32(
    param: &mut Tensor,
    master: Option<&mut Tensor>,
    update: impl FnOnce(&mut [f32]) -> Result<()>,
) -> Result<()> {
    match master {
        Some(m) => {
            let values = m.as_mut_slice::<f32>()?;
            update(values)?;
            round_into(param, values)
        }
        None if param.dtype() == DType::F32 => update(param.as_mut_slice::<f32>()?),
        None => {
            let mut values: Vec<f32> = with_dtype!(param.dtype(), T => {
                param.as_slice::<T>()?.iter().map(|v| v.to_f32()).collect()
            });
            update(&mut values)?;
            round_into(param, &values)
        }
    }
}

struct MultiAdamW<'a, 'b> {
    device: Device,
    list: &'a mut [AdamWTensors<'b>],
    cfg: &'a AdamWConfig,
    table: Option<usize>,
}

impl Op for MultiAdamW<'_, '_> {
    const NAME: &'static str = "adamw_step_multi";
    type Outs = ();
    type Output = ();

    fn device(&self) -> &Device {
        &self.device
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        self.cfg.validate()?;
        for t in self.list.iter() {
            check_param(Self::NAME, &self.device, t.param, t.grad, t.master.as_deref())?;
            check_like(Self::NAME, t.exp_avg, t.param, true)?;
            check_like(Self::NAME, t.exp_avg_sq, t.param, true)?;
            if t.step == 0 {
                return Err(invalid(Self::NAME, "the step count is 1-based; the first step is 1"));
            }
        }
        for t in self.list.iter_mut() {
            t.param.make_unique()?;
            t.exp_avg.make_unique()?;
            t.exp_avg_sq.make_unique()?;
            if let Some(m) = t.master.as_deref_mut() {
                m.make_unique()?;
            }
        }
        Ok(table_plan(&mut self.table, self.list.iter().map(|t| t.param.numel())))
    }

    fn host(&mut self, _: &mut Buffers<Self::Outs>) -> Result<()> {
        let cfg = self.cfg;
        for t in self.list.iter_mut() {
            let (grad, step) = (t.grad, t.step);
            let m = t.exp_avg.as_mut_slice::<f32>()?;
            let v = t.exp_avg_sq.as_mut_slice::<f32>()?;
            update_in_f32(
                t.param,
                t.master.as_deref_mut(),
                |p| with_dtype!(grad.dtype(), G => cpu::adamw_step(p, grad.as_slice::<G>()?, m, v, step, cfg)),
            )?;
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, registry::ADAMW_MULTI};
        let mut entries = Vec::with_capacity(self.list.len());
        for t in self.list.iter() {
            let (step_size, bias2_sqrt, _) = self.cfg.step_scalars(t.step);
            let mut e = Entry::new(t.param, t.master.as_deref(), t.grad)?;
            (e.s1, e.s2) = (t.exp_avg.cuda_ptr()?, t.exp_avg_sq.cuda_ptr()?);
            (e.a, e.b) = (step_size, bias2_sqrt);
            entries.push(e);
        }
        let (_, _, decay) = self.cfg.step_scalars(1);
        let AdamWConfig { beta1, beta2, eps, .. } = *self.cfg;
        let scalars = [beta1, beta2, eps, decay].map(Arg::F32);
        // SAFETY: adamw_multi(const MultiEntry* table, const MultiTask* tasks, float b1,
        // float b2, float eps, float decay, u64 chunk); `self.table` is the workspace `plan`
        // reserved for these entries; every entry's pointers are tensors of its n elements,
        // checked in `plan`.
        unsafe {
            launch_table(gpu, bufs, self.table, &entries, ADAMW_MULTI.of(DType::F32), &scalars)
        }
    }

    fn finish(self, _: Buffers<Self::Outs>) -> Result<()> {
        Ok(())
    }
}

struct MultiSgd<'a, 'b> {
    device: Device,
    list: &'a mut [SgdTensors<'b>],
    cfg: &'a SgdConfig,
    table: Option<usize>,
}

impl Op for MultiSgd<'_, '_> {
    const NAME: &'static str = "sgd_step_multi";
    type Outs = ();
    type Output = ();

    fn device(&self) -> &Device {
        &self.device
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        self.cfg.validate()?;
        let momentum = self.cfg.momentum != 0.0;
        for t in self.list.iter() {
            check_param(Self::NAME, &self.device, t.param, t.grad, t.master.as_deref())?;
            if momentum {
                let buf = t.momentum_buf.as_deref().ok_or_else(|| {
                    invalid(Self::NAME, "momentum != 0 needs a momentum buffer per tensor")
                })?;
                check_like(Self::NAME, buf, t.param, true)?;
            }
        }
        for t in self.list.iter_mut() {
            if !momentum {
                t.momentum_buf = None;
            }
            t.param.make_unique()?;
            if let Some(b) = t.momentum_buf.as_deref_mut() {
                b.make_unique()?;
            }
            if let Some(m) = t.master.as_deref_mut() {
                m.make_unique()?;
            }
        }
        Ok(table_plan(&mut self.table, self.list.iter().map(|t| t.param.numel())))
    }

    fn host(&mut self, _: &mut Buffers<Self::Outs>) -> Result<()> {
        let cfg = self.cfg;
        let mut empty: [f32; 0] = [];
        for t in self.list.iter_mut() {
            let (grad, first) = (t.grad, t.first_step);
            let buf = match t.momentum_buf.as_deref_mut() {
                Some(b) => b.as_mut_slice::<f32>()?,
                None => &mut empty,
            };
            update_in_f32(
                t.param,
                t.master.as_deref_mut(),
                |p| with_dtype!(grad.dtype(), G => cpu::sgd_step(p, grad.as_slice::<G>()?, buf, first, cfg)),
            )?;
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, registry::SGD_MULTI};
        let mut entries = Vec::with_capacity(self.list.len());
        for t in self.list.iter() {
            let mut e = Entry::new(t.param, t.master.as_deref(), t.grad)?;
            if let Some(b) = t.momentum_buf.as_deref() {
                e.s1 = b.cuda_ptr()?;
            }
            e.flags = u32::from(t.first_step);
            entries.push(e);
        }
        let c = self.cfg;
        let scalars = [
            Arg::F32(c.lr),
            Arg::F32(c.momentum),
            Arg::F32(c.dampening),
            Arg::F32(c.weight_decay),
            Arg::U32(u32::from(c.nesterov)),
        ];
        // SAFETY: sgd_multi(const MultiEntry* table, const MultiTask* tasks, float lr, float
        // momentum, float dampening, float wd, u32 nesterov, u64 chunk); the table as in
        // adamw_multi; with momentum every entry has a buffer of its n elements (checked in
        // `plan`), without it no buffer is read.
        unsafe { launch_table(gpu, bufs, self.table, &entries, SGD_MULTI.of(DType::F32), &scalars) }
    }

    fn finish(self, _: Buffers<Self::Outs>) -> Result<()> {
        Ok(())
    }
}

/// Copies the table of `entries` into the workspace `table` (reserved by `plan` with
/// [`table_bytes`]) and launches `kernel` on it, one block per task, with the arguments
/// `(const MultiEntry* table, const MultiTask* tasks, scalars.., u64 chunk)`. The copy is
/// queued before the launch on the same stream.
///
/// # Safety
///
/// `kernel` takes those arguments, and every entry's pointers are tensors of its n elements.
#[cfg(feature = "cuda")]
unsafe fn launch_table(
    gpu: &crate::cuda::Gpu<'_>,
    bufs: &Buffers<()>,
    table: Option<usize>,
    entries: &[Entry],
    kernel: crate::cuda::registry::Instance,
    scalars: &[crate::cuda::Arg],
) -> Result<()> {
    use crate::cuda::Arg;
    let t = Table::new(entries, CHUNK)?;
    let ws = bufs.ws(table)?;
    gpu.copy_to_device(ws, crate::storage::as_bytes(&t.words))?;
    let mut args = vec![Arg::Ptr(ws), Arg::Ptr(ws + t.tasks_offset)];
    args.extend_from_slice(scalars);
    args.push(Arg::count(CHUNK));
    // SAFETY: the caller's contract; the workspace holds the table just copied.
    unsafe { gpu.launch(kernel, t.grid(), &args) }
}

/// One tensor's entry of the device table: `MultiEntry` of `multi_tensor.cu`, field for
/// field (device addresses; `s1`, `s2`, `copy` 0 where absent).
#[cfg(feature = "cuda")]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Entry {
    /// The tensor updated in f32 math (the master, or the parameter).
    pub(crate) p: u64,
    pub(crate) g: u64,
    /// Moments (AdamW) or the momentum buffer (SGD, `s1`).
    pub(crate) s1: u64,
    pub(crate) s2: u64,
    /// The 16-bit parameter a master is rounded into.
    pub(crate) copy: u64,
    pub(crate) n: usize,
    /// Element types of `p`, `g` and `copy` ([`DType::index`]) in bytes 0, 1 and 2.
    pub(crate) types: u32,
    /// Bit 0: SGD's first step.
    pub(crate) flags: u32,
    /// AdamW's step size and bias2_sqrt for this tensor's step.
    pub(crate) a: f32,
    pub(crate) b: f32,
}

#[cfg(feature = "cuda")]
impl Entry {
    /// The entry of `param` (updated through `master` when given) and `grad`; states 0.
    fn new(param: &Tensor, master: Option<&Tensor>, grad: &Tensor) -> Result<Entry> {
        let (p, copy) = match master {
            Some(m) => (m, Some(param)),
            None => (param, None),
        };
        Ok(Entry {
            p: p.cuda_ptr()?,
            g: grad.cuda_ptr()?,
            copy: copy.map(Tensor::cuda_ptr).transpose()?.unwrap_or(0),
            n: param.numel(),
            types: Entry::types(p.dtype(), grad.dtype(), copy.map(Tensor::dtype)),
            ..Entry::default()
        })
    }

    /// The `types` field.
    pub(crate) fn types(p: DType, g: DType, copy: Option<DType>) -> u32 {
        let copy = copy.map_or(0, DType::index) as u32;
        p.index() as u32 | (g.index() as u32) << 8 | copy << 16
    }
}

/// The table the kernels read, as u64 words: the entries of the non-empty tensors, then one
/// task (tensor, chunk: two u32) per block.
#[cfg(feature = "cuda")]
pub(crate) struct Table {
    pub(crate) words: Vec<u64>,
    /// Where the tasks start, in bytes.
    pub(crate) tasks_offset: u64,
    /// The blocks of the launch.
    pub(crate) tasks: usize,
}

#[cfg(feature = "cuda")]
impl Table {
    /// The table of `entries` in chunks of `chunk` elements; its size is
    /// [`table_bytes`]'s, which the plan allocated.
    pub(crate) fn new(entries: &[Entry], chunk: usize) -> Result<Table> {
        let kept: Vec<&Entry> = entries.iter().filter(|e| e.n > 0).collect();
        let mut words = Vec::with_capacity(kept.len() * ENTRY_BYTES / 8);
        for e in &kept {
            words.extend([e.p, e.g, e.s1, e.s2, e.copy, e.n as u64]);
            words.push(u64::from(e.types) | u64::from(e.flags) << 32);
            words.push(u64::from(e.a.to_bits()) | u64::from(e.b.to_bits()) << 32);
        }
        let tasks_offset = (words.len() * 8) as u64;
        let mut tasks = 0usize;
        for (i, e) in kept.iter().enumerate() {
            for c in 0..e.n.div_ceil(chunk) {
                words.push(i as u64 | (c as u64) << 32);
                tasks += 1;
            }
        }
        // grid.x is at most 2^31 - 1 blocks; chunk indices are u32.
        if tasks > i32::MAX as usize {
            return Err(invalid("multi-tensor step", format!("{tasks} chunks exceed one grid")));
        }
        debug_assert_eq!(words.len() * 8, table_bytes(entries.iter().map(|e| e.n), chunk));
        Ok(Table { words, tasks_offset, tasks })
    }

    /// One block of [`BLOCK`](crate::cuda::launch::BLOCK) threads per task.
    pub(crate) fn grid(&self) -> cudarc::driver::LaunchConfig {
        cudarc::driver::LaunchConfig {
            grid_dim: (self.tasks as u32, 1, 1),
            block_dim: (crate::cuda::launch::BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

#[cfg(test)]
#[path = "multi_tensor_tests.rs"]
mod tests;

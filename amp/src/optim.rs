//! Optimizers over any [`Params`]: the [`Optimizer`] trait the [`LossScaler`] drives, SGD and
//! AdamW on the kernels' fused updates, and global-norm gradient clipping.
//!
//! Optimizers keep their state per parameter, keyed by [`ParamId`], and
//! create it at the parameter's first step (PyTorch's lazy state): a parameter without a
//! gradient is skipped and its state, including AdamW's step count, stays as it was. A
//! parameter whose value is f16 or bf16 also gets an f32 master copy in that state (apex
//! O2's master weights): the update runs on the master, which is then rounded into the value,
//! so small updates are not lost to 16-bit rounding.
//!
//! By default a step is one multi-tensor update over every parameter with a gradient
//! ([`ops::adamw_step_multi`], [`ops::sgd_step_multi`]: one CUDA launch, masters updated and
//! rounded into the 16-bit values in the same pass, as PyTorch's `fused=True`);
//! `with_multi_tensor(false)` selects the per-tensor updates (one launch per parameter, and a
//! cast per 16-bit one). Both give the same values, bit for bit on the host. A multi-tensor
//! step creates the missing state of every parameter first and updates all or none.
//!
//! The scaler keeps one state (ready, unscaled, stepped) per optimizer, keyed by
//! [`Optimizer::id`], as PyTorch keys it by `id(optimizer)`.
//!
//! [`LossScaler`]: crate::LossScaler

use crate::convert::{cast_into, sum_of_squares};
use crate::error::{Error, Result};
use crate::param::{Param, ParamId, Params};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use vram_kernels::{AdamWConfig, DType, SgdConfig, Tensor, ops};

/// The identity of an optimizer for the scaler's per-optimizer state. Each call to
/// [`OptimizerId::fresh`] gives an id no other call in the process gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OptimizerId(u64);

impl OptimizerId {
    /// A new, process-unique id.
    pub fn fresh() -> OptimizerId {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        OptimizerId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for OptimizerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// An update rule the loss scaler can drive.
pub trait Optimizer {
    /// A stable identity (keep one [`OptimizerId::fresh`] for the optimizer's lifetime).
    fn id(&self) -> OptimizerId;

    /// Updates every parameter of `params` that has a gradient from that gradient, then calls
    /// [`Params::after_step`].
    ///
    /// # Errors
    ///
    /// Whatever the update fails with; parameters before the failing one are updated.
    fn step(&mut self, params: &mut dyn Params) -> Result<()>;
}

/// Scales the gradients of `params` in place so that their global L2 norm is at most
/// `max_norm` (`torch.nn.utils.clip_grad_norm_`: coefficient `max_norm / (norm + 1e-6)`,
/// clamped to 1) and returns the norm before clipping. `max_norm = inf` only measures. Call
/// it after [`LossScaler::unscale`] so that it sees true gradients.
///
/// [`LossScaler::unscale`]: crate::LossScaler::unscale
///
/// # Errors
///
/// [`Error::InvalidMaxNorm`] for a negative or NaN `max_norm` (nothing is changed then);
/// tensor errors.
pub fn clip_grad_norm(params: &mut dyn Params, max_norm: f32) -> Result<f32> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(Error::InvalidMaxNorm { max_norm });
    }
    let mut grads = params.grads_mut();
    let mut sq = 0.0f64;
    for g in &grads {
        sq += sum_of_squares(g)?;
    }
    let norm = sq.sqrt() as f32;
    let coef = (f64::from(max_norm) / (f64::from(norm) + 1e-6)).min(1.0) as f32;
    if coef < 1.0 {
        // The fused unscale is an in-place multiply; its finiteness flag is not needed here.
        ops::unscale_and_check_finite(&mut grads, coef)?;
    }
    Ok(norm)
}

/// Runs `update` on the f32 tensor that represents `value`: `value` itself when it is f32,
/// else its master copy (created from it on first use), which is then rounded into `value`.
fn update_in_f32(
    value: &mut Tensor,
    master: &mut Option<Tensor>,
    update: impl FnOnce(&mut Tensor) -> Result<()>,
) -> Result<()> {
    if value.dtype() == DType::F32 {
        return update(value);
    }
    let m = match master {
        Some(m) => m,
        slot @ None => slot.insert(value.to_dtype(DType::F32)?),
    };
    update(m)?;
    cast_into(m, value)
}

fn bytes<'a>(ts: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    ts.into_iter().map(|t| t.size_in_bytes() as u64).sum()
}

/// One parameter's SGD state.
#[derive(Debug, Default)]
struct SgdState {
    momentum: Option<Tensor>,
    master: Option<Tensor>,
}

/// SGD with momentum (`torch.optim.SGD`). A parameter's momentum buffer is created at its
/// first step.
#[derive(Debug)]
pub struct Sgd {
    id: OptimizerId,
    config: SgdConfig,
    state: HashMap<ParamId, SgdState>,
    multi_tensor: bool,
}

impl Sgd {
    /// SGD with `config`.
    pub fn new(config: SgdConfig) -> Sgd {
        Sgd { id: OptimizerId::fresh(), config, state: HashMap::new(), multi_tensor: true }
    }

    /// Steps with one multi-tensor update (`true`, the default) or one update per parameter.
    pub fn with_multi_tensor(mut self, multi_tensor: bool) -> Sgd {
        self.multi_tensor = multi_tensor;
        self
    }

    /// Whether a step is one multi-tensor update.
    pub fn multi_tensor(&self) -> bool {
        self.multi_tensor
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// The momentum buffer of parameter `id`, once it exists.
    pub fn momentum_buffer(&self, id: ParamId) -> Option<&Tensor> {
        self.state.get(&id)?.momentum.as_ref()
    }

    /// The f32 master copy of 16-bit parameter `id`, once it exists.
    pub fn master(&self, id: ParamId) -> Option<&Tensor> {
        self.state.get(&id)?.master.as_ref()
    }

    /// Bytes of momentum buffers.
    pub fn state_bytes(&self) -> u64 {
        bytes(self.state.values().filter_map(|s| s.momentum.as_ref()))
    }

    /// Bytes of f32 master copies.
    pub fn master_bytes(&self) -> u64 {
        bytes(self.state.values().filter_map(|s| s.master.as_ref()))
    }
}

impl Optimizer for Sgd {
    fn id(&self) -> OptimizerId {
        self.id
    }

    fn step(&mut self, params: &mut dyn Params) -> Result<()> {
        if self.multi_tensor {
            self.step_multi(params)?;
            return params.after_step();
        }
        let cfg = self.config;
        for p in params.params_mut() {
            let Some(g) = &p.grad else { continue };
            let s = self.state.entry(p.id()).or_default();
            let momentum = &mut s.momentum;
            update_in_f32(&mut p.value, &mut s.master, |w| {
                if cfg.momentum == 0.0 {
                    return Ok(ops::sgd_step(w, g, None, true, &cfg)?);
                }
                let first = momentum.is_none();
                let buf = match momentum {
                    Some(b) => b,
                    slot @ None => slot.insert(Tensor::zeros(w.device(), w.shape(), DType::F32)?),
                };
                Ok(ops::sgd_step(w, g, Some(buf), first, &cfg)?)
            })?;
        }
        params.after_step()
    }
}

/// One parameter's AdamW state.
#[derive(Debug)]
struct AdamState {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: u32,
    master: Option<Tensor>,
}

/// AdamW (`torch.optim.AdamW`). A parameter's moments are created at its first step, and
/// each parameter counts its own steps (the bias correction of a parameter that missed
/// steps is that of its own count), as in PyTorch.
#[derive(Debug)]
pub struct AdamW {
    id: OptimizerId,
    config: AdamWConfig,
    state: HashMap<ParamId, AdamState>,
    multi_tensor: bool,
}

impl AdamW {
    /// AdamW with `config`.
    pub fn new(config: AdamWConfig) -> AdamW {
        AdamW { id: OptimizerId::fresh(), config, state: HashMap::new(), multi_tensor: true }
    }

    /// Steps with one multi-tensor update (`true`, the default) or one update per parameter.
    pub fn with_multi_tensor(mut self, multi_tensor: bool) -> AdamW {
        self.multi_tensor = multi_tensor;
        self
    }

    /// Whether a step is one multi-tensor update.
    pub fn multi_tensor(&self) -> bool {
        self.multi_tensor
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// The steps parameter `id` has taken (0 before its first).
    pub fn step_count(&self, id: ParamId) -> u32 {
        self.state.get(&id).map_or(0, |s| s.step)
    }

    /// Parameter `id`'s first and second moments, once they exist.
    pub fn moments(&self, id: ParamId) -> Option<(&Tensor, &Tensor)> {
        let s = self.state.get(&id)?;
        Some((&s.exp_avg, &s.exp_avg_sq))
    }

    /// The f32 master copy of 16-bit parameter `id`, once it exists.
    pub fn master(&self, id: ParamId) -> Option<&Tensor> {
        self.state.get(&id)?.master.as_ref()
    }

    /// Bytes of moments.
    pub fn state_bytes(&self) -> u64 {
        bytes(self.state.values().flat_map(|s| [&s.exp_avg, &s.exp_avg_sq]))
    }

    /// Bytes of f32 master copies.
    pub fn master_bytes(&self) -> u64 {
        bytes(self.state.values().filter_map(|s| s.master.as_ref()))
    }
}

impl Optimizer for AdamW {
    fn id(&self) -> OptimizerId {
        self.id
    }

    fn step(&mut self, params: &mut dyn Params) -> Result<()> {
        if self.multi_tensor {
            self.step_multi(params)?;
            return params.after_step();
        }
        let cfg = self.config;
        for p in params.params_mut() {
            let Some(g) = &p.grad else { continue };
            let s = match self.state.entry(p.id()) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let zeros = || Tensor::zeros(p.value.device(), p.value.shape(), DType::F32);
                    e.insert(AdamState {
                        exp_avg: zeros()?,
                        exp_avg_sq: zeros()?,
                        step: 0,
                        master: None,
                    })
                }
            };
            let step = s.step.checked_add(1).ok_or_else(|| Error::InvalidArgument {
                op: "AdamW::step",
                reason: format!("parameter {} has taken u32::MAX steps", p.name),
            })?;
            let (m, v) = (&mut s.exp_avg, &mut s.exp_avg_sq);
            update_in_f32(&mut p.value, &mut s.master, |w| {
                Ok(ops::adamw_step(w, g, m, v, step, &cfg)?)
            })?;
            s.step = step;
        }
        params.after_step()
    }
}

/// The f32 master a 16-bit `value` is updated through (`None` for an f32 value).
fn master_of(value: &Tensor) -> Result<Option<Tensor>> {
    Ok(if value.dtype() == DType::F32 { None } else { Some(value.to_dtype(DType::F32)?) })
}

/// The parameters of `params` that have a gradient.
fn with_grads(params: &mut dyn Params) -> Vec<&mut Param> {
    params.params_mut().into_iter().filter(|p| p.grad.is_some()).collect()
}

impl Sgd {
    /// One multi-tensor step over the parameters with a gradient (their state created first).
    fn step_multi(&mut self, params: &mut dyn Params) -> Result<()> {
        let cfg = self.config;
        let mut ps = with_grads(params);
        let mut first = Vec::with_capacity(ps.len());
        for p in &ps {
            let s = self.state.entry(p.id()).or_default();
            if s.master.is_none() {
                s.master = master_of(&p.value)?;
            }
            first.push(s.momentum.is_none());
            if cfg.momentum != 0.0 && s.momentum.is_none() {
                s.momentum = Some(Tensor::zeros(p.value.device(), p.value.shape(), DType::F32)?);
            }
        }
        let mut taken: Vec<SgdState> =
            ps.iter().map(|p| self.state.remove(&p.id()).unwrap_or_default()).collect();
        let mut list: Vec<ops::SgdTensors<'_>> = ps
            .iter_mut()
            .zip(taken.iter_mut())
            .zip(&first)
            .filter_map(|((p, s), &first_step)| {
                let Param { value, grad, .. } = &mut **p;
                Some(ops::SgdTensors {
                    param: value,
                    grad: grad.as_ref()?,
                    momentum_buf: s.momentum.as_mut(),
                    first_step,
                    master: s.master.as_mut(),
                })
            })
            .collect();
        let result = ops::sgd_step_multi(&mut list, &cfg);
        drop(list);
        for ((p, mut s), first) in ps.iter().zip(taken).zip(first) {
            // A buffer that took no step is still uninitialized: the next step starts it.
            if first && result.is_err() {
                s.momentum = None;
            }
            self.state.insert(p.id(), s);
        }
        Ok(result?)
    }
}

impl AdamW {
    /// One multi-tensor step over the parameters with a gradient (their state created first).
    fn step_multi(&mut self, params: &mut dyn Params) -> Result<()> {
        let cfg = self.config;
        let mut ps = with_grads(params);
        let mut steps = Vec::with_capacity(ps.len());
        for p in &ps {
            let s = match self.state.entry(p.id()) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let zeros = || Tensor::zeros(p.value.device(), p.value.shape(), DType::F32);
                    e.insert(AdamState {
                        exp_avg: zeros()?,
                        exp_avg_sq: zeros()?,
                        step: 0,
                        master: master_of(&p.value)?,
                    })
                }
            };
            let step = s.step.checked_add(1).ok_or_else(|| Error::InvalidArgument {
                op: "AdamW::step",
                reason: format!("parameter {} has taken u32::MAX steps", p.name),
            })?;
            steps.push(step);
        }
        let mut taken: Vec<AdamState> =
            ps.iter().filter_map(|p| self.state.remove(&p.id())).collect();
        let mut list: Vec<ops::AdamWTensors<'_>> = ps
            .iter_mut()
            .zip(taken.iter_mut())
            .zip(&steps)
            .filter_map(|((p, s), &step)| {
                let Param { value, grad, .. } = &mut **p;
                Some(ops::AdamWTensors {
                    param: value,
                    grad: grad.as_ref()?,
                    exp_avg: &mut s.exp_avg,
                    exp_avg_sq: &mut s.exp_avg_sq,
                    master: s.master.as_mut(),
                    step,
                })
            })
            .collect();
        let result = ops::adamw_step_multi(&mut list, &cfg);
        drop(list);
        let ok = result.is_ok();
        for ((p, mut s), step) in ps.iter().zip(taken).zip(steps) {
            if ok {
                s.step = step;
            }
            self.state.insert(p.id(), s);
        }
        Ok(result?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::param::Param;
    use vram_kernels::Device;

    fn param(dev: &Device, values: &[f32], dtype: DType) -> Param {
        Param::new("p", Tensor::from_f32_slice(dev, &[values.len()], values, dtype).unwrap())
    }

    fn set_grad(p: &mut Param, values: &[f32]) {
        let dev = p.value.device().clone();
        p.grad = Some(Tensor::from_f32_slice(&dev, &[values.len()], values, DType::F32).unwrap());
    }

    #[test]
    fn clipping_bounds_the_global_norm_and_reports_the_norm_before() {
        let dev = Device::host(16 << 20);
        let mut ps = vec![param(&dev, &[0.0, 0.0], DType::F32), param(&dev, &[0.0], DType::F16)];
        set_grad(&mut ps[0], &[3.0, 0.0]);
        ps[1].grad = Some(Tensor::from_f32_slice(&dev, &[1], &[4.0], DType::F16).unwrap());
        let norm = clip_grad_norm(&mut ps, 1.0).unwrap();
        assert_eq!(norm, 5.0);
        let after: f64 = ps.grads_mut().iter().map(|g| sum_of_squares(g).unwrap()).sum();
        assert!((after.sqrt() - 1.0).abs() < 1e-3, "{after}");
        // Below the bound nothing changes; an infinite bound only measures.
        let before: Vec<_> = ps.grads_mut().iter().map(|g| g.to_f32_vec().unwrap()).collect();
        clip_grad_norm(&mut ps, 10.0).unwrap();
        clip_grad_norm(&mut ps, f32::INFINITY).unwrap();
        let now: Vec<_> = ps.grads_mut().iter().map(|g| g.to_f32_vec().unwrap()).collect();
        assert_eq!(now, before);
    }

    #[test]
    fn a_negative_or_nan_max_norm_is_an_error_and_changes_nothing() {
        let dev = Device::host(16 << 20);
        let mut ps = vec![param(&dev, &[0.0, 0.0], DType::F32)];
        set_grad(&mut ps[0], &[3.0, 4.0]);
        for bad in [-1.0, f32::NAN, f32::NEG_INFINITY] {
            let e = clip_grad_norm(&mut ps, bad).unwrap_err();
            assert!(matches!(e, Error::InvalidMaxNorm { .. }), "{bad}: {e}");
        }
        assert_eq!(ps[0].grad.as_ref().unwrap().to_f32_vec().unwrap(), [3.0, 4.0]);
        // Zero is a valid bound: it zeroes the gradients, as PyTorch does.
        clip_grad_norm(&mut ps, 0.0).unwrap();
        assert_eq!(ps[0].grad.as_ref().unwrap().to_f32_vec().unwrap(), [0.0, 0.0]);
    }

    #[test]
    fn optimizer_state_is_allocated_at_a_parameters_first_step_and_counted() {
        let dev = Device::host(16 << 20);
        let mut ps = vec![param(&dev, &[1.0; 100], DType::F32)];
        let cfg = AdamWConfig { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
        let mut opt = AdamW::new(cfg);
        opt.step(&mut ps).unwrap(); // no gradient: nothing to do
        assert_eq!((opt.state_bytes(), opt.step_count(ps[0].id())), (0, 0));
        set_grad(&mut ps[0], &[1.0; 100]);
        opt.step(&mut ps).unwrap();
        assert_eq!(opt.state_bytes(), 2 * 100 * 4);
        assert_eq!((opt.step_count(ps[0].id()), opt.master_bytes()), (1, 0));
        assert!(ps[0].value.to_f32_vec().unwrap().iter().all(|&v| v < 1.0));
    }

    /// PyTorch semantics: a parameter that had no gradient at a step does not count it, so
    /// its first real step is bit-identical to a fresh optimizer's first step.
    #[test]
    fn adamw_counts_steps_per_parameter() {
        let dev = Device::host(16 << 20);
        let cfg = AdamWConfig { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
        let mut ps = vec![param(&dev, &[1.0, -2.0], DType::F32), param(&dev, &[0.5], DType::F32)];
        let mut opt = AdamW::new(cfg);
        for _ in 0..3 {
            set_grad(&mut ps[0], &[0.3, -0.1]);
            opt.step(&mut ps).unwrap();
        }
        set_grad(&mut ps[1], &[0.7]);
        opt.step(&mut ps).unwrap();
        assert_eq!((opt.step_count(ps[0].id()), opt.step_count(ps[1].id())), (4, 1));

        let mut alone = vec![param(&dev, &[0.5], DType::F32)];
        set_grad(&mut alone[0], &[0.7]);
        AdamW::new(cfg).step(&mut alone).unwrap();
        assert_eq!(
            ps[1].value.to_f32_vec().unwrap()[0].to_bits(),
            alone[0].value.to_f32_vec().unwrap()[0].to_bits()
        );
    }

    /// An update smaller than half an f16 ulp of the value is kept in the f32 master and
    /// shows in the value once the updates add up, which updating f16 directly would lose.
    #[test]
    fn sixteen_bit_parameters_are_updated_through_an_f32_master() {
        let dev = Device::host(16 << 20);
        let cfg = SgdConfig {
            lr: 1e-4,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        };
        let mut ps = vec![param(&dev, &[1.0], DType::F16)];
        let mut opt = Sgd::new(cfg);
        for _ in 0..100 {
            set_grad(&mut ps[0], &[1.0]);
            opt.step(&mut ps).unwrap();
        }
        let master = opt.master(ps[0].id()).unwrap().to_f32_vec().unwrap()[0];
        assert!((master - 0.99).abs() < 1e-5, "{master}");
        assert_eq!(ps[0].value.dtype(), DType::F16);
        assert_eq!(ps[0].value.to_f32_vec().unwrap()[0], half::f16::from_f32(master).to_f32());
        assert_eq!(opt.master_bytes(), 4);
    }

    /// Parameters of every dtype, one without a gradient at the first step, and gradients
    /// that change per step.
    fn mixed_params(dev: &Device) -> Vec<Param> {
        let specs = [(DType::F32, 37), (DType::BF16, 300), (DType::F16, 5), (DType::F32, 1)];
        specs
            .iter()
            .enumerate()
            .map(|(i, &(dtype, n))| {
                let v: Vec<f32> =
                    (0..n).map(|j| ((i * 31 + j * 7) % 19) as f32 / 9.0 - 1.0).collect();
                param(dev, &v, dtype)
            })
            .collect()
    }

    fn set_grads(ps: &mut [Param], step: usize) {
        for (i, p) in ps.iter_mut().enumerate() {
            if step == 0 && i == 2 {
                p.grad = None;
                continue;
            }
            let n = p.value.numel();
            let g: Vec<f32> =
                (0..n).map(|j| ((i + j * 3 + step * 5) % 11) as f32 / 11.0 - 0.4).collect();
            let dev = p.value.device().clone();
            let dtype = if i == 1 { DType::BF16 } else { DType::F32 };
            p.grad = Some(Tensor::from_f32_slice(&dev, &[n], &g, dtype).unwrap());
        }
    }

    fn value_bits(ps: &[Param]) -> Vec<Vec<u32>> {
        ps.iter()
            .map(|p| p.value.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect())
            .collect()
    }

    /// The multi-tensor step (the default) and the per-tensor one give the same values and
    /// masters, bit for bit, over steps where a parameter joins late (its own step count).
    #[test]
    fn multi_tensor_and_per_tensor_steps_agree_bit_for_bit() {
        let dev = Device::host(16 << 20);
        let adamw = AdamWConfig { lr: 0.05, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        let sgd = SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.01,
            nesterov: true,
        };
        let (mut a, mut b) = (mixed_params(&dev), mixed_params(&dev));
        let (mut multi, mut single) =
            (AdamW::new(adamw), AdamW::new(adamw).with_multi_tensor(false));
        assert!(multi.multi_tensor() && !single.multi_tensor());
        let (mut sa, mut sb) = (mixed_params(&dev), mixed_params(&dev));
        let (mut sgd_multi, mut sgd_single) =
            (Sgd::new(sgd), Sgd::new(sgd).with_multi_tensor(false));
        for step in 0..3 {
            for ps in [&mut a, &mut b, &mut sa, &mut sb] {
                set_grads(ps, step);
            }
            multi.step(&mut a).unwrap();
            single.step(&mut b).unwrap();
            sgd_multi.step(&mut sa).unwrap();
            sgd_single.step(&mut sb).unwrap();
            assert_eq!(value_bits(&a), value_bits(&b), "adamw step {step}");
            assert_eq!(value_bits(&sa), value_bits(&sb), "sgd step {step}");
        }
        for (p, q) in a.iter().zip(&b) {
            assert_eq!(multi.step_count(p.id()), single.step_count(q.id()));
            let bits = |t: Option<&Tensor>| t.map(|t| t.to_f32_vec().unwrap());
            assert_eq!(bits(multi.master(p.id())), bits(single.master(q.id())));
        }
        assert_eq!(multi.step_count(a[2].id()), 2);
        assert_eq!(
            (multi.state_bytes(), multi.master_bytes()),
            (single.state_bytes(), single.master_bytes())
        );
        assert_eq!(sgd_multi.state_bytes(), sgd_single.state_bytes());
    }

    /// A multi-tensor step that fails (a gradient of the wrong shape) updates nothing and
    /// counts no step.
    #[test]
    fn a_failed_multi_tensor_step_changes_no_value_or_count() {
        let dev = Device::host(16 << 20);
        let mut ps = mixed_params(&dev);
        set_grads(&mut ps, 1);
        ps[3].grad = Some(Tensor::zeros(&dev, &[2], DType::F32).unwrap());
        let before = value_bits(&ps);
        let mut opt = AdamW::new(AdamWConfig::default());
        assert!(opt.step(&mut ps).is_err());
        assert_eq!(value_bits(&ps), before);
        assert!(ps.iter().all(|p| opt.step_count(p.id()) == 0));
    }

    #[test]
    fn fresh_ids_are_distinct() {
        assert_ne!(OptimizerId::fresh(), OptimizerId::fresh());
    }
}

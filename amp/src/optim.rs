//! What a [`LossScaler`](crate::LossScaler) drives: the [`Optimizer`] trait, and SGD and
//! AdamW over [`MasterWeights`] using the kernels' fused updates.
//!
//! The scaler keeps one state (ready, unscaled, stepped) per optimizer, keyed by
//! [`Optimizer::id`], as PyTorch keys it by `id(optimizer)`. An optimizer exposes its
//! gradients (for the fused unscale and for clipping) and its update; where the parameters
//! live is its own business.

use crate::convert::sum_of_squares;
use crate::error::Result;
use crate::master::{MasterWeights, MemoryBreakdown};
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

/// An optimizer the loss scaler can unscale and step.
pub trait Optimizer {
    /// A stable identity (keep one [`OptimizerId::fresh`] for the optimizer's lifetime).
    fn id(&self) -> OptimizerId;
    /// The gradients the next [`step`](Self::step) will use, to unscale or clip in place.
    fn grads_mut(&mut self) -> Vec<&mut Tensor>;
    /// Updates the parameters from their gradients.
    ///
    /// # Errors
    ///
    /// Whatever the update fails with; the optimizer decides what is left changed.
    fn step(&mut self) -> Result<()>;
}

/// Scales `grads` in place so that their global L2 norm is at most `max_norm`
/// (`torch.nn.utils.clip_grad_norm_`: coefficient `max_norm / (norm + 1e-6)`, clamped to 1)
/// and returns the norm before clipping. Call it after [`LossScaler::unscale`] so that it
/// sees true gradients.
///
/// [`LossScaler::unscale`]: crate::LossScaler::unscale
///
/// # Errors
///
/// Tensor errors (none for tensors on one device).
pub fn clip_grad_norm(grads: &mut [&mut Tensor], max_norm: f32) -> Result<f32> {
    let mut sq = 0.0f64;
    for g in grads.iter() {
        sq += sum_of_squares(g)?;
    }
    let norm = sq.sqrt() as f32;
    let coef = (f64::from(max_norm) / (f64::from(norm) + 1e-6)).min(1.0) as f32;
    if coef < 1.0 {
        // The fused unscale is an in-place multiply; its finiteness flag is not needed here.
        ops::unscale_and_check_finite(grads, coef)?;
    }
    Ok(norm)
}

fn state_bytes<'a>(ts: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    ts.into_iter().map(|t| t.size_in_bytes() as u64).sum()
}

/// SGD with momentum (`torch.optim.SGD`) over f32 master weights. Momentum buffers are
/// allocated at a parameter's first step; parameters without a gradient are not updated.
#[derive(Debug)]
pub struct Sgd {
    id: OptimizerId,
    weights: MasterWeights,
    config: SgdConfig,
    momentum: Vec<Option<Tensor>>,
}

impl Sgd {
    /// SGD over `weights` with `config`.
    pub fn new(weights: MasterWeights, config: SgdConfig) -> Sgd {
        let momentum = (0..weights.len()).map(|_| None).collect();
        Sgd { id: OptimizerId::fresh(), weights, config, momentum }
    }

    /// The parameters.
    pub fn weights(&self) -> &MasterWeights {
        &self.weights
    }

    /// The parameters, to run forward and set gradients.
    pub fn weights_mut(&mut self) -> &mut MasterWeights {
        &mut self.weights
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// The momentum buffer of parameter `i`, once it exists.
    pub fn momentum_buffer(&self, i: usize) -> Option<&Tensor> {
        self.momentum.get(i).and_then(Option::as_ref)
    }

    /// Bytes held by weights, gradients and momentum.
    pub fn memory(&self) -> MemoryBreakdown {
        MemoryBreakdown {
            optimizer_state: state_bytes(self.momentum.iter().flatten()),
            ..self.weights.memory()
        }
    }
}

impl Optimizer for Sgd {
    fn id(&self) -> OptimizerId {
        self.id
    }

    fn grads_mut(&mut self) -> Vec<&mut Tensor> {
        self.weights.grads_mut()
    }

    fn step(&mut self) -> Result<()> {
        let cfg = self.config;
        let momentum = &mut self.momentum;
        self.weights.update_masters(|i, p, g| {
            if cfg.momentum == 0.0 {
                return Ok(ops::sgd_step(p, g, None, true, &cfg)?);
            }
            let first = momentum[i].is_none();
            if first {
                momentum[i] = Some(Tensor::zeros(p.device(), p.shape(), DType::F32)?);
            }
            Ok(ops::sgd_step(p, g, momentum[i].as_mut(), first, &cfg)?)
        })
    }
}

/// One parameter's AdamW state.
#[derive(Debug)]
struct AdamState {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: u32,
}

/// AdamW (`torch.optim.AdamW`) over f32 master weights. Moments are allocated at a
/// parameter's first step; each parameter counts its own steps, as in PyTorch.
#[derive(Debug)]
pub struct AdamW {
    id: OptimizerId,
    weights: MasterWeights,
    config: AdamWConfig,
    state: Vec<Option<AdamState>>,
}

impl AdamW {
    /// AdamW over `weights` with `config`.
    pub fn new(weights: MasterWeights, config: AdamWConfig) -> AdamW {
        let state = (0..weights.len()).map(|_| None).collect();
        AdamW { id: OptimizerId::fresh(), weights, config, state }
    }

    /// The parameters.
    pub fn weights(&self) -> &MasterWeights {
        &self.weights
    }

    /// The parameters, to run forward and set gradients.
    pub fn weights_mut(&mut self) -> &mut MasterWeights {
        &mut self.weights
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Parameter `i`'s first and second moments and step count, once they exist.
    pub fn moments(&self, i: usize) -> Option<(&Tensor, &Tensor, u32)> {
        let s = self.state.get(i)?.as_ref()?;
        Some((&s.exp_avg, &s.exp_avg_sq, s.step))
    }

    /// Bytes held by weights, gradients and moments.
    pub fn memory(&self) -> MemoryBreakdown {
        let moments = self.state.iter().flatten().flat_map(|s| [&s.exp_avg, &s.exp_avg_sq]);
        MemoryBreakdown { optimizer_state: state_bytes(moments), ..self.weights.memory() }
    }
}

impl Optimizer for AdamW {
    fn id(&self) -> OptimizerId {
        self.id
    }

    fn grads_mut(&mut self) -> Vec<&mut Tensor> {
        self.weights.grads_mut()
    }

    fn step(&mut self) -> Result<()> {
        let cfg = self.config;
        let state = &mut self.state;
        self.weights.update_masters(|i, p, g| {
            let s = match &mut state[i] {
                Some(s) => s,
                slot @ None => slot.insert(AdamState {
                    exp_avg: Tensor::zeros(p.device(), p.shape(), DType::F32)?,
                    exp_avg_sq: Tensor::zeros(p.device(), p.shape(), DType::F32)?,
                    step: 0,
                }),
            };
            let step = s.step + 1;
            ops::adamw_step(p, g, &mut s.exp_avg, &mut s.exp_avg_sq, step, &cfg)?;
            s.step = step;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::master::WeightLayout;
    use vram_kernels::Device;

    #[test]
    fn clipping_bounds_the_global_norm_and_reports_the_norm_before() {
        let dev = Device::host(16 << 20);
        let mut a = Tensor::from_f32_slice(&dev, &[2], &[3.0, 0.0], DType::F32).unwrap();
        let mut b = Tensor::from_f32_slice(&dev, &[1], &[4.0], DType::F16).unwrap();
        let norm = clip_grad_norm(&mut [&mut a, &mut b], 1.0).unwrap();
        assert_eq!(norm, 5.0);
        let after = sum_of_squares(&a).unwrap() + sum_of_squares(&b).unwrap();
        assert!((after.sqrt() - 1.0).abs() < 1e-3, "{after}");
        // Below the bound nothing changes.
        let before = a.to_f32_vec().unwrap();
        clip_grad_norm(&mut [&mut a], 10.0).unwrap();
        assert_eq!(a.to_f32_vec().unwrap(), before);
    }

    #[test]
    fn optimizer_state_is_allocated_at_the_first_step_and_counted() {
        let dev = Device::host(16 << 20);
        let p = Tensor::full(&dev, &[100], DType::F32, 1.0).unwrap();
        let w = MasterWeights::new(WeightLayout::F32, vec![p]).unwrap();
        let cfg = AdamWConfig { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
        let mut opt = AdamW::new(w, cfg);
        assert_eq!(opt.memory().optimizer_state, 0);
        opt.weights_mut()
            .set_grad(0, Tensor::full(&dev, &[100], DType::F32, 1.0).unwrap())
            .unwrap();
        opt.step().unwrap();
        assert_eq!(opt.memory().optimizer_state, 2 * 100 * 4);
        assert_eq!(opt.moments(0).unwrap().2, 1);
        assert!(opt.weights().master()[0].to_f32_vec().unwrap().iter().all(|&v| v < 1.0));
    }

    #[test]
    fn fresh_ids_are_distinct() {
        assert_ne!(OptimizerId::fresh(), OptimizerId::fresh());
    }
}

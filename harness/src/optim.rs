//! Optimizers over a model's f32 parameters, with their state allocated from the device (so
//! it shows in the memory figures, as in PyTorch: created lazily at the first step).

use vram_accum::Param;
use vram_kernels::{AdamWConfig, DType, Result, SgdConfig, Tensor, ops};

/// Which update rule.
#[derive(Clone, Copy, Debug)]
pub enum OptimizerKind {
    /// SGD with momentum: one state tensor per parameter.
    Sgd(SgdConfig),
    /// AdamW: two state tensors per parameter.
    AdamW(AdamWConfig),
}

/// An optimizer and its state.
pub struct Optimizer {
    kind: OptimizerKind,
    state: Vec<Vec<Tensor>>,
    step: u32,
}

impl Optimizer {
    /// SGD with momentum 0.9 at learning rate `lr`.
    pub fn sgd(lr: f32) -> Self {
        Self::new(OptimizerKind::Sgd(SgdConfig {
            lr,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }))
    }

    /// AdamW with PyTorch's defaults at learning rate `lr`.
    pub fn adamw(lr: f32) -> Self {
        Self::new(OptimizerKind::AdamW(AdamWConfig {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }))
    }

    /// An optimizer of the given kind.
    pub fn new(kind: OptimizerKind) -> Self {
        Optimizer { kind, state: Vec::new(), step: 0 }
    }

    /// Applies one update to every parameter that has a gradient.
    pub fn step(&mut self, params: Vec<&mut Param>) -> Result<()> {
        self.step += 1;
        if self.state.len() < params.len() {
            self.state.resize_with(params.len(), Vec::new);
        }
        for (p, state) in params.into_iter().zip(&mut self.state) {
            let Some(grad) = &p.grad else { continue };
            let first = state.is_empty();
            let n = match self.kind {
                OptimizerKind::Sgd(_) => 1,
                OptimizerKind::AdamW(_) => 2,
            };
            if first {
                for _ in 0..n {
                    state.push(Tensor::zeros(p.value.device(), p.value.shape(), DType::F32)?);
                }
            }
            match &self.kind {
                OptimizerKind::Sgd(cfg) => {
                    ops::sgd_step(&mut p.value, grad, state.first_mut(), first, cfg)?
                }
                OptimizerKind::AdamW(cfg) => {
                    let (m, v) = state.split_at_mut(1);
                    ops::adamw_step(&mut p.value, grad, &mut m[0], &mut v[0], self.step, cfg)?
                }
            }
        }
        Ok(())
    }

    /// Bytes of optimizer state.
    pub fn state_bytes(&self) -> u64 {
        self.state.iter().flatten().map(|t| t.size_in_bytes() as u64).sum()
    }
}

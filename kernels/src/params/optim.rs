//! Optimizer hyper-parameters, with PyTorch's defaults and its validity rules, tightened so
//! that no accepted value turns parameters into NaN by itself.

use crate::error::{Error, Result};

/// Hyper-parameters of SGD with momentum (`torch.optim.SGD`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor; 0 disables the momentum buffer.
    pub momentum: f32,
    /// Dampening of the gradient in the momentum update.
    pub dampening: f32,
    /// L2 penalty, added to the gradient as `weight_decay * param`.
    pub weight_decay: f32,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`, as in PyTorch).
    pub nesterov: bool,
}

impl Default for SgdConfig {
    /// PyTorch's defaults: `lr=1e-3`, no momentum, dampening or weight decay.
    fn default() -> Self {
        SgdConfig { lr: 1e-3, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

fn invalid(op: &'static str, reason: String) -> Error {
    Error::InvalidArgument { op, reason }
}

/// Checks that `value` is finite and at least 0.
fn non_negative(op: &'static str, name: &str, value: f32) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(invalid(op, format!("{name} = {value} must be a finite number >= 0")))
    }
}

impl SgdConfig {
    /// Checks the settings: `lr`, `momentum`, `weight_decay` finite and `>= 0`, `dampening`
    /// finite, Nesterov only with `momentum > 0` and `dampening == 0` (PyTorch's rules, with
    /// NaN and infinities refused too).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the first setting out of range.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "SgdConfig";
        non_negative(OP, "lr", self.lr)?;
        non_negative(OP, "momentum", self.momentum)?;
        non_negative(OP, "weight_decay", self.weight_decay)?;
        if !self.dampening.is_finite() {
            return Err(invalid(OP, format!("dampening = {} must be finite", self.dampening)));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(invalid(OP, "Nesterov momentum needs momentum > 0 and dampening 0".into()));
        }
        Ok(())
    }
}

/// Hyper-parameters of AdamW (`torch.optim.AdamW`, `amsgrad=False`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f32,
    /// Decay rate of the first-moment estimate.
    pub beta1: f32,
    /// Decay rate of the second-moment estimate.
    pub beta2: f32,
    /// Added to the bias-corrected `sqrt(v)` for numerical stability.
    pub eps: f32,
    /// Decoupled weight decay: `param -= lr * weight_decay * param` before the Adam step.
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    /// PyTorch's defaults: `lr=1e-3`, `betas=(0.9, 0.999)`, `eps=1e-8`,
    /// `weight_decay=1e-2`.
    fn default() -> Self {
        AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 1e-2 }
    }
}

impl AdamWConfig {
    /// Checks the settings: `lr`, `eps`, `weight_decay` finite and `>= 0`; `beta1` and
    /// `beta2` in `[0, 1)` (a beta of 1 divides by a zero bias correction).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the first setting out of range.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "AdamWConfig";
        non_negative(OP, "lr", self.lr)?;
        non_negative(OP, "eps", self.eps)?;
        non_negative(OP, "weight_decay", self.weight_decay)?;
        for (name, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(invalid(OP, format!("{name} = {beta} must be in [0, 1)")));
            }
        }
        Ok(())
    }

    /// The scalars of step `step` (1-based), computed once per step on the host:
    /// `(step_size, bias2_sqrt, decay)` = `(lr / (1 - beta1^t), sqrt(1 - beta2^t),
    /// 1 - lr * weight_decay)`. Both backends' update is, per element,
    /// `p = p * decay - step_size * m / (sqrt(v) / bias2_sqrt + eps)`.
    pub(crate) fn step_scalars(&self, step: u32) -> (f32, f32, f32) {
        let t = step as i32;
        let bias1 = 1.0 - self.beta1.powi(t);
        let bias2_sqrt = (1.0 - self.beta2.powi(t)).sqrt();
        (self.lr / bias1, bias2_sqrt, 1.0 - self.lr * self.weight_decay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_pytorchs_and_valid() {
        let sgd = SgdConfig::default();
        assert_eq!((sgd.lr, sgd.momentum, sgd.nesterov), (1e-3, 0.0, false));
        sgd.validate().unwrap();
        let adam = AdamWConfig::default();
        assert_eq!((adam.beta1, adam.beta2, adam.eps, adam.weight_decay), (0.9, 0.999, 1e-8, 1e-2));
        adam.validate().unwrap();
    }

    #[test]
    fn settings_that_would_make_nan_are_refused() {
        let sgd = SgdConfig::default();
        for bad in [
            SgdConfig { lr: f32::NAN, ..sgd },
            SgdConfig { lr: -0.1, ..sgd },
            SgdConfig { lr: f32::INFINITY, ..sgd },
            SgdConfig { momentum: -0.9, ..sgd },
            SgdConfig { weight_decay: f32::NAN, ..sgd },
            SgdConfig { dampening: f32::NAN, ..sgd },
            SgdConfig { nesterov: true, ..sgd },
        ] {
            assert!(matches!(bad.validate(), Err(Error::InvalidArgument { .. })), "{bad:?}");
        }
        let adam = AdamWConfig::default();
        for bad in [
            AdamWConfig { beta1: 1.0, ..adam },
            AdamWConfig { beta2: 1.0, ..adam },
            AdamWConfig { beta1: -0.1, ..adam },
            AdamWConfig { beta2: f32::NAN, ..adam },
            AdamWConfig { eps: -1e-8, ..adam },
            AdamWConfig { lr: f32::NAN, ..adam },
            AdamWConfig { weight_decay: -1.0, ..adam },
        ] {
            let e = bad.validate().unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { op: "AdamWConfig", .. }), "{bad:?}: {e}");
        }
    }
}

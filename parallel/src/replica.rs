//! What the data-parallel trainer needs of a model: forward to logits and backward from
//! their gradient on one device, in parameter groups (layers) around which the trainer
//! runs its hooks (ZeRO-3 gathers a group's parameters before it runs and releases them
//! after; ZeRO-2 reduce-scatters a group's gradients as soon as backward produced them).

use crate::error::DistError;
use vram_amp::Param;
use vram_kernels::{Device, Tensor, ops};

/// Which pass a hook runs around.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// The forward pass.
    Forward,
    /// The backward pass.
    Backward,
}

/// Called by a [`Replica`] around each parameter group, in each pass.
pub trait GroupHooks {
    /// Before group `group` runs in `pass`; `params` are the group's parameters.
    ///
    /// # Errors
    ///
    /// A collective or an allocation failed; the replica stops and returns the error.
    fn before(
        &mut self,
        pass: Pass,
        group: usize,
        params: &mut [&mut Param],
    ) -> Result<(), DistError>;
    /// After group `group` ran in `pass` (in backward: its gradients are complete).
    ///
    /// # Errors
    ///
    /// As [`before`](Self::before).
    fn after(
        &mut self,
        pass: Pass,
        group: usize,
        params: &mut [&mut Param],
    ) -> Result<(), DistError>;
}

/// Hooks that do nothing (single-device training, DDP).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoHooks;

impl GroupHooks for NoHooks {
    fn before(&mut self, _: Pass, _: usize, _: &mut [&mut Param]) -> Result<(), DistError> {
        Ok(())
    }

    fn after(&mut self, _: Pass, _: usize, _: &mut [&mut Param]) -> Result<(), DistError> {
        Ok(())
    }
}

/// A model replica on one device, trained with a mean cross-entropy loss on its logits.
///
/// Contract: [`params_mut`](Self::params_mut) lists every parameter, group by group in
/// forward order, and [`group_sizes`](Self::group_sizes) says how many each group has.
/// `forward` calls `hooks.before(Pass::Forward, g, ..)` before group `g` reads its
/// parameters and `hooks.after` once it no longer does; `backward` does the same in
/// reverse group order, and adds each parameter's gradient into [`Param::grad`] before
/// `hooks.after(Pass::Backward, g, ..)`.
pub trait Replica: Send {
    /// A batch of inputs with their targets.
    type Batch: Sync;
    /// What forward keeps for backward.
    type Tape;

    /// The device the replica lives on.
    fn device(&self) -> &Device;
    /// Parameters per group, in forward order.
    fn group_sizes(&self) -> Vec<usize>;
    /// Every parameter, group by group.
    fn params_mut(&mut self) -> Vec<&mut Param>;
    /// `parts` equal parts of `batch`, in order.
    ///
    /// # Errors
    ///
    /// [`DistError::Invalid`] if the batch does not split into `parts` equal parts.
    fn split(batch: &Self::Batch, parts: usize) -> Result<Vec<Self::Batch>, DistError>;
    /// The batch's targets, one per logits row.
    fn targets(batch: &Self::Batch) -> &[u32];
    /// Forward to logits `[rows, classes]`, keeping what backward needs.
    ///
    /// # Errors
    ///
    /// A tensor op's error (out of memory) or a hook's.
    fn forward(
        &mut self,
        batch: &Self::Batch,
        hooks: &mut dyn GroupHooks,
    ) -> Result<(Tensor, Self::Tape), DistError>;
    /// Backward from the logits' gradient.
    ///
    /// # Errors
    ///
    /// As [`forward`](Self::forward).
    fn backward(
        &mut self,
        tape: Self::Tape,
        dlogits: &Tensor,
        hooks: &mut dyn GroupHooks,
    ) -> Result<(), DistError>;
    /// One training pass on `batch`: forward, the mean cross-entropy of the logits against
    /// [`targets`](Self::targets), backward; returns the loss. DDP and ZeRO call this;
    /// `nn.DataParallel`, which computes the loss on device 0, calls `forward` and
    /// `backward`. The default does just that; a replica that computes its last layer with
    /// the loss fused (a tied LM head through `ops::linear_cross_entropy`, whose logits are
    /// never whole) or in another precision (autocast) overrides it, keeping the hooks'
    /// contract: a group used twice in a pass (a tied embedding) runs `before` and `after`
    /// around each use, and its gradients are complete at its last `after` in backward.
    ///
    /// # Errors
    ///
    /// As [`forward`](Self::forward).
    fn forward_backward(
        &mut self,
        batch: &Self::Batch,
        hooks: &mut dyn GroupHooks,
    ) -> Result<f32, DistError> {
        let (logits, tape) = self.forward(batch, hooks)?;
        let targets = Self::targets(batch);
        let ce = ops::cross_entropy(&logits, targets, None)?;
        let dlogits = ops::cross_entropy_backward(&logits, targets, None, &ce.lse, 1.0)?;
        let loss = ce.loss;
        drop((logits, ce));
        self.backward(tape, &dlogits, hooks)?;
        Ok(loss)
    }
}

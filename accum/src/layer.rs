//! The unit of work: a layer with forward, backward and parameters.

use std::any::Any;
use vram_kernels::{Device, Result, Tensor};

/// Whether a forward pass records what backward needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Save what backward needs.
    Train,
    /// Save nothing (PyTorch's `no_grad` / `inference_mode`).
    Inference,
}

/// What a layer's forward keeps for its backward: any tensors (allocated from the device, so
/// they count in its memory statistics) and whatever else the layer needs.
pub type Saved = Box<dyn Any + Send>;

/// State a forward pass threads through the layers: the mode and a counter-based random
/// stream. A layer that draws random numbers (dropout) reserves a range of counters with
/// [`ForwardCtx::take_offsets`]; recomputing the layer from the same offset reproduces the
/// same numbers, which is what makes checkpointed backward bit-identical.
#[derive(Clone, Debug)]
pub struct ForwardCtx {
    /// Train or inference.
    pub mode: Mode,
    /// Seed of the random stream.
    pub seed: u64,
    /// Next unused counter of the random stream.
    pub offset: u64,
}

impl ForwardCtx {
    /// A context for `mode` with a random stream seeded by `seed`.
    pub fn new(mode: Mode, seed: u64) -> Self {
        ForwardCtx { mode, seed, offset: 0 }
    }

    /// Reserves `n` counters and returns the first.
    pub fn take_offsets(&mut self, n: u64) -> u64 {
        let first = self.offset;
        self.offset += n;
        first
    }

    /// Whether backward will run (so forward must save).
    pub fn training(&self) -> bool {
        self.mode == Mode::Train
    }
}

/// A trainable tensor and its accumulated gradient.
#[derive(Debug)]
pub struct Param {
    /// Name for reports, e.g. `"fc1.weight"`.
    pub name: String,
    /// The value.
    pub value: Tensor,
    /// The gradient accumulated since the last [`Param::zero_grad`]; `None` until a backward
    /// pass writes one (allocated lazily, as PyTorch does).
    pub grad: Option<Tensor>,
}

impl Param {
    /// A parameter with no gradient yet.
    pub fn new(name: impl Into<String>, value: Tensor) -> Self {
        Param { name: name.into(), value, grad: None }
    }

    /// Adds `g` into the gradient, allocating it (as a copy of `g`) on first use.
    pub fn accumulate_grad(&mut self, g: Tensor) -> Result<()> {
        match &mut self.grad {
            Some(acc) => vram_kernels::ops::add_assign(acc, &g),
            None => {
                self.grad = Some(g);
                Ok(())
            }
        }
    }

    /// Drops the gradient (`set_to_none=True`, PyTorch's default), freeing its memory.
    pub fn zero_grad(&mut self) {
        self.grad = None;
    }
}

/// A layer of a chain: residual and attention blocks are single layers.
///
/// Contract: `forward` in [`Mode::Train`] returns `Some(saved)`, in [`Mode::Inference`]
/// returns `None` and keeps nothing alive beyond its output. `backward` consumes the saved
/// state, adds parameter gradients into [`Param::grad`], and returns the input gradient when
/// `want_input_grad` is true. Given the same input and the same [`ForwardCtx::offset`], forward
/// must be deterministic.
pub trait Layer: Send {
    /// Name for reports.
    fn name(&self) -> String;

    /// Computes the output.
    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<Saved>)>;

    /// Computes gradients from what forward saved and the output gradient.
    fn backward(
        &mut self,
        saved: Saved,
        dy: &Tensor,
        want_input_grad: bool,
    ) -> Result<Option<Tensor>>;

    /// The layer's parameters.
    fn params(&self) -> Vec<&Param>;

    /// The layer's parameters, mutably (optimizers, zeroing gradients).
    fn params_mut(&mut self) -> Vec<&mut Param>;

    /// The device the layer lives on.
    fn device(&self) -> &Device;
}

//! The unit of work: a layer with forward, backward and parameters, and [`BoxedLayer`], the
//! type-erased form a [`Chain`](crate::Chain) holds.

use crate::autocast::{Autocast, AutocastPolicy, OpKind};
use crate::error::{Error, Result};
use std::any::Any;
use vram_kernels::{DType, Device, Tensor};

pub use vram_amp::{Param, ParamId};

/// Whether a forward pass records what backward needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Save what backward needs.
    Train,
    /// Save nothing (PyTorch's `no_grad` / `inference_mode`).
    Inference,
}

/// State a forward pass threads through the layers: the mode and a counter-based random
/// stream. A layer that draws random numbers (dropout) reserves a range of counters with
/// [`ForwardCtx::take_offsets`]; recomputing the layer from the same offset reproduces the
/// same numbers, which is what makes checkpointed backward bit-identical.
///
/// With [`ForwardCtx::with_autocast`] the layers run PyTorch's autocast recipe (see
/// [`crate::autocast`]) and the context holds the step's cache of 16-bit parameter casts,
/// which [`ForwardCtx::clear_autocast_cache`] empties when the step's forward and loss are
/// done.
#[derive(Clone, Debug)]
pub struct ForwardCtx {
    /// Train or inference.
    pub mode: Mode,
    /// Seed of the random stream.
    pub seed: u64,
    /// Next unused counter of the random stream.
    pub offset: u64,
    /// Autocast's policy and cache, `None` without autocast.
    pub autocast: Option<Autocast>,
    /// Whether a training forward moves batch norm's running statistics (default true).
    /// A checkpointed segment's recomputation and [`crate::Chain::profile`] run with it
    /// false, so a step updates them once whatever the schedule (PyTorch's checkpoint
    /// updates them twice: pytorch/pytorch#96136).
    pub update_running_stats: bool,
}

impl ForwardCtx {
    /// A context for `mode` with a random stream seeded by `seed`, without autocast.
    pub fn new(mode: Mode, seed: u64) -> Self {
        ForwardCtx { mode, seed, offset: 0, autocast: None, update_running_stats: true }
    }

    /// The same with autocast to `low` (f16 or bf16) under PyTorch's default policy.
    ///
    /// # Errors
    ///
    /// [`Error::Amp`] if `low` is f32.
    pub fn with_autocast(self, low: DType) -> Result<Self> {
        Ok(self.with_autocast_policy(AutocastPolicy::new(low)?))
    }

    /// The same with autocast under `policy`, its cache empty.
    pub fn with_autocast_policy(self, policy: AutocastPolicy) -> Self {
        ForwardCtx { autocast: Some(Autocast::new(policy)), ..self }
    }

    /// The autocast state, `None` without autocast.
    pub fn autocast(&self) -> Option<&Autocast> {
        self.autocast.as_ref()
    }

    /// Empties the cache of parameter casts (PyTorch's `clear_cache` when the autocast
    /// region exits); a no-op without autocast.
    pub fn clear_autocast_cache(&mut self) {
        if let Some(a) = &mut self.autocast {
            a.clear_cache();
        }
    }

    /// The dtype `op` computes in under autocast for inputs of `inputs`' dtypes; `None`
    /// without autocast (the op runs in its inputs' dtype).
    pub fn op_dtype(&self, op: OpKind, inputs: &[DType]) -> Option<DType> {
        self.autocast.as_ref().map(|a| a.policy().dtype_for(op, inputs))
    }

    /// `p`'s value in `dtype`, through the autocast cache when there is one.
    ///
    /// # Errors
    ///
    /// Out of memory for the copy.
    pub fn cast_param(&mut self, p: &Param, dtype: DType) -> Result<Tensor> {
        match &mut self.autocast {
            Some(a) => a.cast_param(p, dtype),
            None => crate::autocast::cast(&p.value, dtype),
        }
    }

    /// [`Error::AutocastUnsupported`] for `layer` under autocast; `Ok` without it. Layers
    /// without autocast rules call it first, so they never compute in a dtype PyTorch's
    /// recipe would not.
    ///
    /// # Errors
    ///
    /// As said.
    pub fn refuse_autocast(&self, layer: impl FnOnce() -> String) -> Result<()> {
        match self.autocast {
            Some(_) => Err(crate::autocast::unsupported(layer())),
            None => Ok(()),
        }
    }

    /// Reserves `n` counters and returns the first.
    ///
    /// # Errors
    ///
    /// [`Error::RandomStreamExhausted`] if the range would run past `u64::MAX` (the
    /// counters would wrap and repeat earlier random numbers); the offset is unchanged then.
    pub fn take_offsets(&mut self, n: u64) -> Result<u64> {
        let first = self.offset;
        self.offset = first
            .checked_add(n)
            .ok_or(Error::RandomStreamExhausted { offset: first, requested: n })?;
        Ok(first)
    }

    /// Whether backward will run (so forward must save).
    pub fn training(&self) -> bool {
        self.mode == Mode::Train
    }
}

/// A layer of a chain: residual and attention blocks are single layers.
///
/// Contract: `forward` in [`Mode::Train`] returns `Some(saved)`, in [`Mode::Inference`]
/// returns `None` and keeps nothing alive beyond its output. `backward` consumes the saved
/// state, adds parameter gradients into [`Param::grad`], and returns the input gradient when
/// `want_input_grad` is true. Given the same input and the same [`ForwardCtx::offset`],
/// forward must be deterministic.
///
/// ```
/// use vram_accum::{ForwardCtx, Layer, Mode, Param, Result};
/// use vram_kernels::{DType, Device, Tensor, ops};
///
/// /// `y = relu(x + b)` with a learned bias `b: [d]`.
/// struct BiasRelu {
///     b: Param,
/// }
///
/// impl Layer for BiasRelu {
///     type Saved = Tensor; // the pre-activation `x + b`
///
///     fn name(&self) -> String {
///         "BiasRelu".into()
///     }
///     fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<Tensor>)> {
///         let z = ops::bias_add(x, &self.b.value)?;
///         Ok((ops::relu(&z)?, ctx.training().then_some(z)))
///     }
///     fn backward(&mut self, z: Tensor, dy: Tensor, want_dx: bool) -> Result<Option<Tensor>> {
///         let dz = ops::relu_backward(&z, &dy)?;
///         drop(dy); // freed as soon as it is used, as in PyTorch
///         self.b.accumulate_grad(ops::bias_add_backward(&dz)?)?;
///         Ok(want_dx.then_some(dz))
///     }
///     fn params(&self) -> Vec<&Param> {
///         vec![&self.b]
///     }
///     fn params_mut(&mut self) -> Vec<&mut Param> {
///         vec![&mut self.b]
///     }
///     fn device(&self) -> &Device {
///         self.b.value.device()
///     }
/// }
///
/// let dev = Device::host(16 << 20);
/// let mut layer = BiasRelu { b: Param::new("b", Tensor::full(&dev, &[2], DType::F32, -1.0)?) };
/// let x = Tensor::from_f32_slice(&dev, &[2, 2], &[0.5, 2.0, 3.0, 1.5], DType::F32)?;
/// let (y, saved) = layer.forward(&x, &mut ForwardCtx::new(Mode::Train, 0))?;
/// assert_eq!(y.to_f32_vec().unwrap(), [0.0, 1.0, 2.0, 0.5]);
/// let ones = Tensor::full(&dev, &[2, 2], DType::F32, 1.0)?;
/// layer.backward(saved.expect("saved in training"), ones, false)?;
/// assert_eq!(layer.b.grad.as_ref().map(|g| g.to_f32_vec().unwrap()), Some(vec![1.0, 2.0]));
/// # Ok::<(), vram_accum::Error>(())
/// ```
pub trait Layer: Send {
    /// What forward keeps for backward: tensors (allocated from the device, so they count in
    /// its memory statistics) and whatever else the layer needs.
    type Saved: Send + 'static;

    /// Name for reports.
    fn name(&self) -> String;

    /// Computes the output, and in [`Mode::Train`] what backward needs.
    ///
    /// # Errors
    ///
    /// An op's error (shape, dtype, out of memory).
    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<Self::Saved>)>;

    /// Computes gradients from what forward saved and the output gradient. `dy` is the
    /// layer's to drop as soon as it has no more use for it, as PyTorch frees a node's
    /// incoming gradient once that node's backward has consumed it; a caller that needs it
    /// afterwards passes a clone (which shares its memory).
    ///
    /// # Errors
    ///
    /// An op's error (shape, dtype, out of memory).
    fn backward(
        &mut self,
        saved: Self::Saved,
        dy: Tensor,
        want_input_grad: bool,
    ) -> Result<Option<Tensor>>;

    /// The layer's parameters.
    fn params(&self) -> Vec<&Param>;

    /// The layer's parameters, mutably (optimizers, zeroing gradients).
    fn params_mut(&mut self) -> Vec<&mut Param>;

    /// The device the layer lives on.
    fn device(&self) -> &Device;
}

/// What a [`BoxedLayer`]'s forward kept for its backward, its type erased.
pub struct SavedBox {
    layer: String,
    state: Box<dyn Any + Send>,
}

impl std::fmt::Debug for SavedBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SavedBox(from {})", self.layer)
    }
}

/// The object-safe face of [`Layer`], implemented for every layer.
trait Erased: Send {
    fn name(&self) -> String;
    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<SavedBox>)>;
    fn backward(&mut self, saved: SavedBox, dy: Tensor, want: bool) -> Result<Option<Tensor>>;
    fn params(&self) -> Vec<&Param>;
    fn params_mut(&mut self) -> Vec<&mut Param>;
    fn device(&self) -> &Device;
}

impl<L: Layer> Erased for L {
    fn name(&self) -> String {
        Layer::name(self)
    }

    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<SavedBox>)> {
        let (y, saved) = Layer::forward(self, x, ctx)?;
        let saved = saved.map(|s| SavedBox { layer: Layer::name(self), state: Box::new(s) });
        Ok((y, saved))
    }

    fn backward(&mut self, saved: SavedBox, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        let SavedBox { layer, state } = saved;
        let state = state
            .downcast::<L::Saved>()
            .map_err(|_| Error::ForeignSavedState { layer: Layer::name(self), saved_by: layer })?;
        Layer::backward(self, *state, dy, want)
    }

    fn params(&self) -> Vec<&Param> {
        Layer::params(self)
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        Layer::params_mut(self)
    }

    fn device(&self) -> &Device {
        Layer::device(self)
    }
}

/// A layer of any type, as a [`Chain`](crate::Chain) holds it: its saved state is a
/// [`SavedBox`], checked to be its own when it comes back to backward.
pub struct BoxedLayer(Box<dyn Erased>);

impl std::fmt::Debug for BoxedLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BoxedLayer({})", self.0.name())
    }
}

impl<L: Layer + 'static> From<L> for BoxedLayer {
    fn from(layer: L) -> Self {
        BoxedLayer(Box::new(layer))
    }
}

impl BoxedLayer {
    /// Boxes `layer`.
    pub fn new(layer: impl Layer + 'static) -> Self {
        BoxedLayer(Box::new(layer))
    }

    /// The layer's name.
    pub fn name(&self) -> String {
        self.0.name()
    }

    /// The layer's forward, its saved state boxed.
    ///
    /// # Errors
    ///
    /// The layer's error.
    pub fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<SavedBox>)> {
        self.0.forward(x, ctx)
    }

    /// The layer's backward on what its forward saved.
    ///
    /// # Errors
    ///
    /// [`Error::ForeignSavedState`] if `saved` came from a layer of another type; the
    /// layer's error.
    pub fn backward(
        &mut self,
        saved: SavedBox,
        dy: Tensor,
        want_input_grad: bool,
    ) -> Result<Option<Tensor>> {
        self.0.backward(saved, dy, want_input_grad)
    }

    /// The layer's parameters.
    pub fn params(&self) -> Vec<&Param> {
        self.0.params()
    }

    /// The layer's parameters, mutably.
    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        self.0.params_mut()
    }

    /// The device the layer lives on.
    pub fn device(&self) -> &Device {
        self.0.device()
    }
}

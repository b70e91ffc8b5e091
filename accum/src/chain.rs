//! [`Chain`]: a sequence of layers run forward and backward under a checkpoint
//! [`Schedule`], and the [`Tape`] that carries what forward kept to backward.

use crate::autocast::{Autocast, AutocastPolicy};
use crate::error::{Error, Result};
use crate::layer::{BoxedLayer, ForwardCtx, Layer, Mode, Param, SavedBox};
use crate::plan::{ChainProfile, LayerProfile, Schedule, Segment};
use std::borrow::Cow;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use vram_amp::Params;
use vram_kernels::Tensor;

/// The identity of a [`Chain`], which its tapes carry. Each chain gets an id no other chain
/// in the process has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChainId(u64);

impl ChainId {
    fn fresh() -> ChainId {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        ChainId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for ChainId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Which pass a [`LayerHooks`] call is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookPass {
    /// The training forward.
    Forward,
    /// Backward, a checkpointed segment's recomputed forward included.
    Backward,
}

/// Called around each layer of a chain ([`Chain::forward_hooked`],
/// [`Chain::backward_hooked`]), e.g. to gather a sharded layer's weights before it runs and
/// release them after (ZeRO-3, FSDP) or to reduce its gradients as soon as backward made
/// them (ZeRO-2).
///
/// In forward, `before` and `after` wrap each layer's forward. In backward, `before(i)`
/// comes before layer `i` runs at all (a checkpointed segment calls it for each of its layers
/// before recomputing their forward) and `after(i)` once its backward has added its
/// gradients.
pub trait LayerHooks {
    /// Before layer `index` runs in `pass`.
    ///
    /// # Errors
    ///
    /// Any: the chain stops and returns it.
    fn before(&mut self, pass: HookPass, index: usize, layer: &mut BoxedLayer) -> Result<()>;
    /// After layer `index` ran in `pass`.
    ///
    /// # Errors
    ///
    /// As [`before`](Self::before).
    fn after(&mut self, pass: HookPass, index: usize, layer: &mut BoxedLayer) -> Result<()>;
}

/// Hooks that do nothing.
struct NoHooks;

impl LayerHooks for NoHooks {
    fn before(&mut self, _: HookPass, _: usize, _: &mut BoxedLayer) -> Result<()> {
        Ok(())
    }

    fn after(&mut self, _: HookPass, _: usize, _: &mut BoxedLayer) -> Result<()> {
        Ok(())
    }
}

/// A sequence of layers, each consuming the previous one's output.
pub struct Chain {
    id: ChainId,
    /// Bumped whenever the layers may have changed, so that older tapes are refused.
    generation: u64,
    layers: Vec<BoxedLayer>,
}

impl Default for Chain {
    fn default() -> Self {
        Chain::new(Vec::new())
    }
}

impl fmt::Debug for Chain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chain").field("id", &self.id).field("layers", &self.layers).finish()
    }
}

/// What one segment kept for backward.
enum Kept {
    /// Every layer's saved state, in order.
    Plain(Vec<SavedBox>),
    /// The segment's input (`None`: the chain input, borrowed by the tape) and the random
    /// stream position its forward started from.
    Checkpoint { input: Option<Tensor>, offset: u64 },
}

/// What a training forward kept for backward: per segment of its schedule, saved state or a
/// checkpoint. Tagged with the chain that recorded it, whose backward alone accepts it.
/// Borrows (or, from [`Chain::forward_hooked`], may own) the chain input, which a
/// checkpointed first segment recomputes from.
pub struct Tape<'x> {
    chain: ChainId,
    generation: u64,
    input: Cow<'x, Tensor>,
    seed: u64,
    /// The autocast policy the forward ran under, which checkpointed segments recompute
    /// under (PyTorch's checkpoint restores the autocast state, too).
    autocast: Option<AutocastPolicy>,
    /// `None` for a tape recorded in inference mode.
    schedule: Option<Schedule>,
    kept: Vec<(Segment, Kept)>,
}

impl fmt::Debug for Tape<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tape")
            .field("chain", &self.chain)
            .field("schedule", &self.schedule)
            .finish_non_exhaustive()
    }
}

impl Tape<'_> {
    /// The chain that recorded the tape.
    pub fn chain(&self) -> ChainId {
        self.chain
    }

    /// The schedule the forward ran under (`None` in inference mode).
    pub fn schedule(&self) -> Option<&Schedule> {
        self.schedule.as_ref()
    }
}

impl Chain {
    /// A chain of `layers`, run first to last.
    pub fn new(layers: Vec<BoxedLayer>) -> Self {
        Chain { id: ChainId::fresh(), generation: 0, layers }
    }

    /// Appends a layer. Tapes recorded before are refused by [`backward`](Self::backward).
    pub fn push(&mut self, layer: impl Layer + 'static) {
        self.generation += 1;
        self.layers.push(BoxedLayer::new(layer));
    }

    /// The chain's identity.
    pub fn id(&self) -> ChainId {
        self.id
    }

    /// The number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether the chain has no layer.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// The layers.
    pub fn layers(&self) -> &[BoxedLayer] {
        &self.layers
    }

    /// The layers, mutably. Tapes recorded before are refused by
    /// [`backward`](Self::backward), since a layer may have been replaced.
    pub fn layers_mut(&mut self) -> &mut [BoxedLayer] {
        self.generation += 1;
        &mut self.layers
    }

    /// The layers, by value.
    pub fn into_layers(self) -> Vec<BoxedLayer> {
        self.layers
    }

    /// Every parameter, layer by layer.
    pub fn params(&self) -> Vec<&Param> {
        self.layers.iter().flat_map(|l| l.params()).collect()
    }

    /// Every parameter, mutably.
    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        self.layers.iter_mut().flat_map(|l| l.params_mut()).collect()
    }

    /// Drops every gradient (`set_to_none`).
    pub fn zero_grad(&mut self) {
        self.params_mut().into_iter().for_each(Param::zero_grad);
    }

    fn check_nonempty(&self) -> Result<()> {
        if self.layers.is_empty() {
            return Err(Error::InvalidArgument {
                what: "Chain",
                reason: "the chain has no layers; push some first".into(),
            });
        }
        Ok(())
    }

    /// Runs forward in inference mode: nothing is saved, each intermediate output is freed as
    /// soon as the next layer has consumed it.
    ///
    /// # Errors
    ///
    /// A layer's error; [`Error::InvalidArgument`] for an empty chain.
    pub fn infer(&mut self, x: &Tensor) -> Result<Tensor> {
        self.run_inference(x, &mut ForwardCtx::new(Mode::Inference, 0))
    }

    /// Inference forward with `ctx` (its autocast state, if any).
    fn run_inference(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<Tensor> {
        self.check_nonempty()?;
        let mut ctx = ForwardCtx { mode: Mode::Inference, ..ctx.clone() };
        let mut cur: Option<Tensor> = None;
        for layer in &mut self.layers {
            let (y, _) = layer.forward(cur.as_ref().unwrap_or(x), &mut ctx)?;
            cur = Some(y);
        }
        cur.ok_or(Error::InvalidArgument { what: "Chain::infer", reason: "empty chain".into() })
    }

    /// Runs forward under `schedule`. In [`Mode::Train`] a plain segment keeps every
    /// layer's saved state; a checkpointed one keeps only its input and `ctx.offset`, and
    /// drops its layers' saved state as soon as each returns. In [`Mode::Inference`] this is
    /// [`infer`](Self::infer) (under `ctx`'s autocast state) and the tape refuses backward.
    ///
    /// # Errors
    ///
    /// A layer's error; [`Error::LengthMismatch`] if the schedule is for another chain
    /// length; [`Error::LayerContract`] if a layer saves nothing in training mode.
    pub fn forward<'x>(
        &mut self,
        x: &'x Tensor,
        ctx: &mut ForwardCtx,
        schedule: &Schedule,
    ) -> Result<(Tensor, Tape<'x>)> {
        self.forward_hooked(Cow::Borrowed(x), ctx, schedule, &mut NoHooks)
    }

    /// [`Chain::forward`] with `hooks` around each layer (see [`LayerHooks`]; a forward in
    /// inference mode, which keeps nothing for backward, runs without them), on an input
    /// the tape borrows or owns (`Cow::Owned`: a tape that outlives the caller's frame).
    ///
    /// # Errors
    ///
    /// As [`Chain::forward`], and a hook's.
    pub fn forward_hooked<'x>(
        &mut self,
        x: Cow<'x, Tensor>,
        ctx: &mut ForwardCtx,
        schedule: &Schedule,
        hooks: &mut dyn LayerHooks,
    ) -> Result<(Tensor, Tape<'x>)> {
        self.check_nonempty()?;
        let mut tape = Tape {
            chain: self.id,
            generation: self.generation,
            input: x,
            seed: ctx.seed,
            autocast: ctx.autocast().map(|a| a.policy().clone()),
            schedule: None,
            kept: Vec::new(),
        };
        if !ctx.training() {
            return Ok((self.run_inference(&tape.input, ctx)?, tape));
        }
        if schedule.layer_count() != self.len() {
            return Err(Error::LengthMismatch {
                what: "schedule",
                expected: self.len(),
                got: schedule.layer_count(),
            });
        }
        let x: &Tensor = &tape.input;
        let mut kept = Vec::with_capacity(schedule.segments().len());
        let mut cur: Option<Tensor> = None;
        for &seg in schedule.segments() {
            if seg.checkpointed {
                let offset = ctx.offset;
                let input = cur.take();
                let mut inner: Option<Tensor> = None;
                for i in seg.start..seg.end {
                    let arg = inner.as_ref().or(input.as_ref()).unwrap_or(x);
                    let (y, saved) = self.layer_forward(i, arg, ctx, hooks)?;
                    drop(saved);
                    inner = Some(y);
                }
                kept.push((seg, Kept::Checkpoint { input, offset }));
                cur = inner;
            } else {
                let mut saved = Vec::with_capacity(seg.end - seg.start);
                for i in seg.start..seg.end {
                    let (y, s) = self.layer_forward(i, cur.as_ref().unwrap_or(x), ctx, hooks)?;
                    saved.push(self.expect_saved(i, s)?);
                    cur = Some(y);
                }
                kept.push((seg, Kept::Plain(saved)));
            }
        }
        tape.kept = kept;
        tape.schedule = Some(schedule.clone());
        let y =
            cur.ok_or(Error::InvalidArgument { what: "Chain::forward", reason: "empty".into() })?;
        Ok((y, tape))
    }

    /// Layer `i`'s training forward between its hooks.
    fn layer_forward(
        &mut self,
        i: usize,
        x: &Tensor,
        ctx: &mut ForwardCtx,
        hooks: &mut dyn LayerHooks,
    ) -> Result<(Tensor, Option<SavedBox>)> {
        let layer = &mut self.layers[i];
        hooks.before(HookPass::Forward, i, layer)?;
        let out = layer.forward(x, ctx)?;
        hooks.after(HookPass::Forward, i, layer)?;
        Ok(out)
    }

    fn expect_saved(&self, i: usize, s: Option<SavedBox>) -> Result<SavedBox> {
        s.ok_or_else(|| Error::LayerContract {
            index: i,
            name: self.layers[i].name(),
            reason: "forward in Mode::Train returned no saved state".into(),
        })
    }

    /// Backpropagates `dy`, the gradient of the chain output, through the tape: parameter
    /// gradients are added into [`Param::grad`]; returns the gradient of the chain input when
    /// `want_input_grad`. A checkpointed segment first recomputes its forward from its input
    /// with the random stream rewound to where its forward started, so every layer sees the
    /// same input and draws the same dropout mask, and the gradients are bit-identical to a
    /// plain run.
    ///
    /// # Errors
    ///
    /// [`Error::ForeignTape`] for a tape another chain recorded, [`Error::StaleTape`] for
    /// one recorded before this chain's layers changed, [`Error::InferenceTape`] for one
    /// recorded in inference mode (no gradient is touched then); a layer's error.
    pub fn backward(
        &mut self,
        tape: Tape<'_>,
        dy: Tensor,
        want_input_grad: bool,
    ) -> Result<Option<Tensor>> {
        self.backward_hooked(tape, dy, want_input_grad, &mut NoHooks)
    }

    /// [`Chain::backward`] with `hooks` around each layer (see [`LayerHooks`]).
    ///
    /// # Errors
    ///
    /// As [`Chain::backward`], and a hook's.
    pub fn backward_hooked(
        &mut self,
        tape: Tape<'_>,
        dy: Tensor,
        want_input_grad: bool,
        hooks: &mut dyn LayerHooks,
    ) -> Result<Option<Tensor>> {
        if tape.chain != self.id {
            return Err(Error::ForeignTape { chain: self.id, tape: tape.chain });
        }
        if tape.generation != self.generation {
            return Err(Error::StaleTape { chain: self.id });
        }
        if tape.schedule.is_none() {
            return Err(Error::InferenceTape);
        }
        let Tape { input, seed, autocast, mut kept, .. } = tape;
        let input: &Tensor = &input;
        let mut grad = Some(dy);
        while let Some((seg, k)) = kept.pop() {
            let saved = match k {
                Kept::Plain(saved) => saved,
                Kept::Checkpoint { input: ckpt, offset } => {
                    // Recomputation is an autocast region of its own, as in PyTorch: the
                    // same policy, a fresh cache dropped with the context.
                    let mut ctx = ForwardCtx {
                        mode: Mode::Train,
                        seed,
                        offset,
                        autocast: autocast.clone().map(Autocast::new),
                        update_running_stats: false,
                    };
                    let mut saved = Vec::with_capacity(seg.end - seg.start);
                    let mut ckpt = ckpt;
                    let mut cur: Option<Tensor> = None;
                    for i in seg.start..seg.end {
                        hooks.before(HookPass::Backward, i, &mut self.layers[i])?;
                        let arg = cur.as_ref().or(ckpt.as_ref()).unwrap_or(input);
                        let (y, s) = self.layers[i].forward(arg, &mut ctx)?;
                        saved.push(self.expect_saved(i, s)?);
                        ckpt = None;
                        cur = Some(y);
                    }
                    saved
                }
            };
            let recomputed = seg.checkpointed;
            for (i, s) in (seg.start..seg.end).zip(saved).rev() {
                let dy = grad.take().ok_or_else(|| Error::LayerContract {
                    index: i + 1,
                    name: self.layers.get(i + 1).map(|l| l.name()).unwrap_or_default(),
                    reason: "backward returned no input gradient although one was asked for".into(),
                })?;
                let want = i > 0 || want_input_grad;
                let layer = &mut self.layers[i];
                if !recomputed {
                    hooks.before(HookPass::Backward, i, layer)?;
                }
                grad = layer.backward(s, dy, want)?;
                hooks.after(HookPass::Backward, i, layer)?;
            }
        }
        Ok(if want_input_grad { grad } else { None })
    }

    /// Runs every layer once forward (training mode) and backward on `x`, measuring from the
    /// device's allocator statistics and a clock what [`LayerProfile`] holds. Each layer call
    /// is measured in its own statistics scope (`Device::stats_scope`), so the caller's
    /// peak statistics are not reset: afterwards they are as if the pass had run unmeasured.
    /// Parameter gradients are left as they were: during the pass each layer's gradients
    /// are replaced by zero tensors, so the figures are those of the steady state in which
    /// gradients exist; what creating them costs is [`LayerProfile::grad_bytes`]. `ctx` is
    /// cloned; the caller's stream does not advance, and batch norm's running statistics do
    /// not move.
    ///
    /// # Errors
    ///
    /// A layer's error; [`Error::InvalidArgument`] for an empty chain.
    pub fn profile(
        &mut self,
        x: &Tensor,
        ctx: &ForwardCtx,
        want_input_grad: bool,
    ) -> Result<ChainProfile> {
        self.check_nonempty()?;
        let dev = x.device().clone();
        // A steady step finds the cuBLAS workspace allocated (the first matrix product of the
        // first step allocates it and it stays): allocate it now, so that no layer's figures
        // count it.
        dev.prepare_blas_workspace()?;
        let mut ctx = ForwardCtx { mode: Mode::Train, update_running_stats: false, ..ctx.clone() };
        let mut profiles = Vec::with_capacity(self.len());
        let mut outputs: Vec<(Vec<usize>, vram_kernels::DType)> = Vec::new();
        let mut saved_all = Vec::with_capacity(self.len());
        let mut cur: Option<Tensor> = None;
        for i in 0..self.len() {
            let before = dev.memory_allocated();
            let scope = dev.stats_scope();
            let t = Instant::now();
            let (y, s) = self.layers[i].forward(cur.as_ref().unwrap_or(x), &mut ctx)?;
            let fwd_time = t.elapsed();
            let fwd_peak = peak_above(scope.finish().allocated_bytes.all.peak, before);
            let after = dev.memory_allocated();
            let out_bytes = {
                let probe = y.try_clone()?;
                let b = dev.memory_allocated() - after;
                drop(probe);
                b
            };
            // Drop the executor's reference to the input, as forward does: what stays beyond
            // the output is what the layer keeps, including its input if it holds a clone.
            let input_bytes =
                if i == 0 { 0 } else { profiles.last().map_or(0, |p: &LayerProfile| p.out_bytes) };
            drop(cur.take());
            let kept = (dev.memory_allocated() + input_bytes).saturating_sub(before + out_bytes);
            saved_all.push(self.expect_saved(i, s)?);
            outputs.push((y.shape().to_vec(), y.dtype()));
            profiles.push(LayerProfile {
                name: self.layers[i].name(),
                out_bytes,
                saved_bytes: kept,
                fwd_peak_bytes: fwd_peak,
                fwd_time,
                ..LayerProfile::default()
            });
            cur = Some(y);
        }
        drop(cur);
        // The forward is over: under autocast its region ends and the cache of parameter
        // casts empties (casts the layers saved stay), as in a training step.
        ctx.clear_autocast_cache();
        for i in (0..self.len()).rev() {
            let s = saved_all.pop().ok_or(Error::InvalidArgument {
                what: "Chain::profile",
                reason: "saved state missing".into(),
            })?;
            let (shape, dtype) = &outputs[i];
            let dy = Tensor::full(&dev, shape, *dtype, 1.0)?;
            let before_grads = dev.memory_allocated();
            let stash: Vec<Option<Tensor>> = self.layers[i]
                .params_mut()
                .into_iter()
                .map(|p| {
                    let zeros = Tensor::zeros(p.value.device(), p.value.shape(), p.value.dtype())?;
                    Ok(p.grad.replace(zeros))
                })
                .collect::<Result<_>>()?;
            let before = dev.memory_allocated();
            profiles[i].grad_bytes = before - before_grads;
            let scope = dev.stats_scope();
            let t = Instant::now();
            // The layer owns `dy` and may drop it before it returns, as in a training step.
            let dx = self.layers[i].backward(s, dy, i > 0 || want_input_grad)?;
            profiles[i].bwd_time = t.elapsed();
            profiles[i].bwd_peak_bytes =
                peak_above(scope.finish().allocated_bytes.all.peak, before);
            // What dropping the input gradient frees (it may share `dy`'s memory).
            let with_dx = dev.memory_allocated();
            drop(dx);
            profiles[i].dx_bytes = with_dx.saturating_sub(dev.memory_allocated());
            for (p, old) in self.layers[i].params_mut().into_iter().zip(stash) {
                p.grad = old;
            }
        }
        Ok(ChainProfile { layers: profiles })
    }
}

/// A statistics scope's allocated-bytes peak above `base` (both absolute).
fn peak_above(peak: i64, base: u64) -> u64 {
    u64::try_from(peak).unwrap_or(0).saturating_sub(base)
}

impl Params for Chain {
    fn params(&self) -> Vec<&Param> {
        Chain::params(self)
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        Chain::params_mut(self)
    }
}

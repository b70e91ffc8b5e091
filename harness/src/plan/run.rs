//! One candidate's training steps on a device: the measurement every figure of the plan
//! comes from.

use super::model::PlanModel;
use super::{OptimizerKind, PlanError, PlanKind, Precision};
use crate::models::Model;
use crate::rng::Rng;
use vram_accum::{ChainProfile, ForwardCtx, Mode, Schedule};
use vram_alloc::AllocatorConfig;
use vram_amp::{AdamW, LossScaler, Optimizer, ScalerConfig, Sgd};
use vram_kernels::{AdamWConfig, Device, SgdConfig};

/// The capacity of the virtual device that measures what a candidate needs: large enough
/// never to run out (1 PiB), so the allocator never frees its cache under pressure.
pub(crate) const UNLIMITED: u64 = 1 << 50;

/// Where a run happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Where {
    /// A virtual device of this capacity.
    Virtual(u64),
    /// The host, computing, with this capacity and the virtual device's cuBLAS workspace.
    Host(u64),
    /// CUDA device 0, its allocator capped at this capacity.
    Cuda(u64),
}

/// What a run measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Every step ran: peaks of allocated and reserved bytes over the run.
    Ran {
        /// `max_memory_allocated`.
        allocated: u64,
        /// `max_memory_reserved`.
        reserved: u64,
    },
    /// The allocator ran out of memory.
    Oom,
}

/// The optimizer steps each run takes: the first creates the optimizer state lazily, so the
/// second is the steady state.
pub(crate) const STEPS: u64 = 2;

/// Builds `model` on a fresh device and runs [`STEPS`] optimizer steps of `accum`
/// micro-batches of `micro` samples with `schedule`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    model: &PlanModel,
    precision: Precision,
    optimizer: OptimizerKind,
    alloc: &AllocatorConfig,
    schedule: &Schedule,
    micro: usize,
    accum: usize,
    place: Where,
) -> Result<Outcome, PlanError> {
    let args = RunArgs { model, precision, optimizer, alloc, schedule, micro, accum };
    Ok(match run_timed(&args, place, STEPS)? {
        Some(t) => Outcome::Ran { allocated: t.allocated, reserved: t.reserved },
        None => Outcome::Oom,
    })
}

/// What [`run_timed`] runs: a model, its precision and optimizer, the allocator's settings,
/// the checkpoint schedule, the micro-batch and the accumulation.
pub(crate) struct RunArgs<'a> {
    pub(crate) model: &'a PlanModel,
    pub(crate) precision: Precision,
    pub(crate) optimizer: OptimizerKind,
    pub(crate) alloc: &'a AllocatorConfig,
    pub(crate) schedule: &'a Schedule,
    pub(crate) micro: usize,
    pub(crate) accum: usize,
}

/// A run's peaks and the wall time of each optimizer step after the first.
#[derive(Clone, Debug, PartialEq)]
pub struct TimedRun {
    /// `max_memory_allocated` over the run.
    pub allocated: u64,
    /// `max_memory_reserved` over the run.
    pub reserved: u64,
    /// Milliseconds per optimizer step (its `accum` micro-batches and the update), between
    /// two synchronizations, every step but the first (kernels loaded, segments reserved,
    /// optimizer state created); empty on a virtual device, which computes nothing.
    pub step_ms: Vec<f64>,
    /// The loss of each micro-batch; empty on a virtual device.
    pub losses: Vec<f32>,
    /// cuDNN calls a virtual device replaying a record ([`PlanModel::cudnn`]) found no
    /// recorded choice for (each took no workspace); 0 elsewhere.
    pub cudnn_misses: usize,
    /// A CUDA device's record of what cuDNN chose in the run
    /// ([`Device::cudnn_choices`]), for a virtual device to replay; `None` elsewhere or
    /// where cuDNN ran nothing.
    pub cudnn: Option<vram_kernels::cudnn_choices::CudnnChoices>,
}

/// [`run`] with `n_steps` optimizer steps (at least 1), every step after the first timed;
/// `None` if the allocator ran out of memory.
pub(crate) fn run_timed(
    args: &RunArgs<'_>,
    place: Where,
    n_steps: u64,
) -> Result<Option<TimedRun>, PlanError> {
    let device = device(place, args.alloc, args.model)?;
    let fail = |source: vram_accum::Error| PlanError::Run {
        context: format!("{} on {}", args.model.name, device.name()),
        source: Box::new(source),
    };
    let (mut step_ms, mut losses) = (Vec::new(), Vec::new());
    match steps(&device, args, n_steps.max(1), &mut step_ms, &mut losses) {
        Ok(()) => Ok(Some(TimedRun {
            allocated: device.max_memory_allocated(),
            reserved: device.max_memory_reserved(),
            step_ms: if device.is_virtual() { Vec::new() } else { step_ms },
            losses,
            cudnn_misses: device.cudnn_choice_misses(),
            cudnn: device
                .cudnn_choices()
                .filter(|r| !device.is_virtual() && !r.convolutions.is_empty()),
        })),
        Err(e) if e.is_out_of_memory() => Ok(None),
        Err(e) => Err(fail(e)),
    }
}

/// The device `place` names, with `alloc`'s settings; a virtual one replays `model`'s cuDNN
/// record when it has one.
fn device(place: Where, alloc: &AllocatorConfig, model: &PlanModel) -> Result<Device, PlanError> {
    let bad = PlanError::Device;
    Ok(match place {
        Where::Virtual(cap) => {
            let d = Device::virtual_with_config(cap, alloc.clone()).map_err(bad)?;
            d.set_cudnn_choices(model.cudnn.as_deref().cloned()).map_err(bad)?;
            d.set_cudnn_benchmark(model.cudnn_benchmark());
            d
        }
        Where::Host(cap) => {
            let d = Device::host_with_config(cap, alloc.clone()).map_err(bad)?;
            d.set_blas_workspace_size(Device::virtual_device(1).blas_workspace_size());
            d
        }
        Where::Cuda(cap) => {
            let d = Device::cuda_with_config(0, alloc.clone()).map_err(bad)?;
            d.set_cudnn_benchmark(model.cudnn_benchmark());
            let total = d.mem_info().total.max(1);
            d.set_memory_fraction((cap as f64 / total as f64).min(1.0)).map_err(bad)?;
            d
        }
    })
}

fn steps(
    device: &Device,
    args: &RunArgs<'_>,
    n_steps: u64,
    step_ms: &mut Vec<f64>,
    losses: &mut Vec<f32>,
) -> vram_accum::Result<()> {
    let RunArgs { model: pm, precision, optimizer, schedule, micro, accum, .. } = *args;
    let mut rng = Rng::new(0x5EED);
    let mut model =
        Model::with_options(device, pm.arch.clone(), 1, precision.dtype(), pm.options())?;
    model.set_autocast(precision.autocast())?;
    let mut opt: Box<dyn Optimizer> = match optimizer {
        OptimizerKind::AdamW => Box::new(AdamW::new(AdamWConfig::default())),
        OptimizerKind::Sgd => {
            Box::new(Sgd::new(SgdConfig { momentum: 0.9, ..SgdConfig::default() }))
        }
    };
    // The scale's value changes no allocation; a moderate one keeps the host's real f16
    // gradients finite, so the update (and its state) happens as on a virtual device.
    let mut scaler = if precision.scales_loss() {
        LossScaler::new(ScalerConfig { init_scale: 256.0, ..Default::default() })?
    } else {
        LossScaler::disabled()
    };
    let batch = pm.batch(micro, (!device.is_virtual()).then_some(&mut rng));
    for step in 0..n_steps {
        device.synchronize()?;
        let start = std::time::Instant::now();
        for _ in 0..accum {
            let mut ctx = ForwardCtx::new(Mode::Train, step);
            let scale = scaler.scale() / accum as f32;
            let out = model.train_step_with(&batch, &mut ctx, scale, schedule)?;
            if !device.is_virtual() {
                losses.push(out.loss);
            }
        }
        let outcome = scaler.step(opt.as_mut(), &mut model)?;
        if outcome == vram_amp::StepOutcome::Skipped {
            return Err(vram_accum::Error::InvalidArgument {
                what: "plan run",
                reason: "the loss scaler skipped an update (non-finite f16 gradients), so the \
                         optimizer state was not created as on a GPU"
                    .into(),
            });
        }
        scaler.update()?;
        model.zero_grad();
        device.synchronize()?;
        if step > 0 {
            step_ms.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(())
}

/// The chain's profile at `micro` samples (on its own virtual device) with each layer's
/// times replaced by its FLOPs (1 ns per MFLOP; backward = 2x forward), so that the budget
/// planner minimises recomputed FLOPs.
pub(crate) fn flop_profile(
    pm: &PlanModel,
    precision: Precision,
    alloc: &AllocatorConfig,
    micro: usize,
) -> Result<ChainProfile, PlanError> {
    let device = device(Where::Virtual(UNLIMITED), alloc, pm)?;
    let fail = |source: vram_accum::Error| PlanError::Run {
        context: format!("profiling {}", pm.name),
        source: Box::new(source),
    };
    let mut model =
        Model::with_options(&device, pm.arch.clone(), 1, precision.dtype(), pm.options())
            .map_err(fail)?;
    model.set_autocast(precision.autocast()).map_err(fail)?;
    let mut profile = model.profile(&pm.batch(micro, None), 0).map_err(fail)?;
    let flops = pm.chain_flops();
    for (l, f) in profile.layers.iter_mut().zip(flops.iter().chain(std::iter::repeat(&0.0))) {
        let ns = (f * micro as f64 / 1e6).round().max(1.0) as u64;
        l.fwd_time = std::time::Duration::from_nanos(ns);
        l.bwd_time = std::time::Duration::from_nanos(2 * ns);
    }
    Ok(profile)
}

/// The schedule of a non-budget plan kind for a chain of `n` layers.
pub(crate) fn fixed_schedule(kind: PlanKind, n: usize) -> Result<Schedule, PlanError> {
    let s = match kind {
        PlanKind::None | PlanKind::Budget => Schedule::none(n),
        PlanKind::EveryK(k) => Schedule::every(n, k),
        PlanKind::Sqrt => Schedule::sqrt(n),
    };
    s.map_err(|source| PlanError::Run {
        context: "checkpoint schedule".into(),
        source: Box::new(source),
    })
}

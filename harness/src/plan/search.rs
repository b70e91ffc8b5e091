//! The search: every configuration's largest micro-batch, the best split of the global batch,
//! costs, ranking, and what would fit when nothing does.

use super::model::{PlanModel, SampleInput};
use super::run::{
    Outcome, RunArgs, STEPS, TimedRun, UNLIMITED, Where, fixed_schedule, flop_profile, run,
    run_timed,
};
use super::{
    ALLOCATOR_SETTINGS, ASSUMED_FLOP_PER_BYTE, ASSUMED_FP32_FACTOR, Decomposition,
    HOST_BATCH_LIMIT, MAX_BATCH, MAX_DEVICE_MEMORY, OptimizerKind, PLAN_KINDS, PlanError, PlanKind,
    PlanProgress, PlanReport, PlanRequest, Precision, Row, SIMULATED_ACCUM, Verification,
};
use crate::models::{Arch, Model};
use std::collections::HashMap;
use std::time::Instant;
use vram_accum::Schedule;
use vram_alloc::{AllocatorConfig, human_bytes};
use vram_kernels::{DType, Device};

/// One configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Config {
    precision: Precision,
    plan: PlanKind,
    alloc: usize,
}

/// The largest micro-batch a search run simulates; larger ones are extrapolated.
const RUN_CAP: usize = 1024;

/// A probe of the micro-batch search.
#[derive(Clone, Copy, Debug)]
struct Point {
    micro: usize,
    fits: bool,
    allocated: u64,
    reserved: u64,
}

/// A candidate's measurement.
#[derive(Clone, Debug)]
struct Eval {
    fits: bool,
    allocated: u64,
    reserved: u64,
    schedule: Schedule,
}

struct Search<'a> {
    req: &'a PlanRequest,
    model: PlanModel,
    optimizer: OptimizerKind,
    usable: u64,
    n: usize,
    allocs: Vec<AllocatorConfig>,
    memo: HashMap<(Config, usize, usize), Eval>,
    params: u64,
    runs: usize,
    /// The fewest samples a micro-batch may hold ([`Search::smallest_micro`]).
    min_micro: usize,
    /// The chain's layer names.
    names: Vec<String>,
    /// Configurations whose largest micro-batch lies beyond [`RUN_CAP`]: the line it was
    /// extrapolated along (two sizes that fit).
    lines: HashMap<Config, (Point, Point)>,
    /// Splits whose peaks were extrapolated rather than run.
    extrapolated: usize,
    /// The largest micro-batch whose host-side batch fits [`HOST_BATCH_LIMIT`].
    host_cap: usize,
}

impl Search<'_> {
    fn run(
        &mut self,
        c: Config,
        s: &Schedule,
        micro: usize,
        accum: usize,
        place: Where,
    ) -> Result<Outcome, PlanError> {
        self.runs += 1;
        run(&self.model, c.precision, self.optimizer, &self.allocs[c.alloc], s, micro, accum, place)
    }

    /// Runs `schedule` unlimited, then on the usable capacity if it needed more.
    fn check(
        &mut self,
        c: Config,
        schedule: Schedule,
        micro: usize,
        accum: usize,
    ) -> Result<Eval, PlanError> {
        let Outcome::Ran { allocated, reserved } =
            self.run(c, &schedule, micro, accum, Where::Virtual(UNLIMITED))?
        else {
            // More than the 1 PiB of the unlimited device: no usable memory holds it.
            return Ok(Eval { fits: false, allocated: UNLIMITED, reserved: UNLIMITED, schedule });
        };
        // Over the usable memory, the capped run may still fit: the allocator frees its cache
        // and retries, and a convolution settles for a smaller im2col buffer.
        if reserved <= self.usable {
            return Ok(Eval { fits: true, allocated, reserved, schedule });
        }
        Ok(match self.run(c, &schedule, micro, accum, Where::Virtual(self.usable))? {
            Outcome::Ran { allocated, reserved } => {
                Eval { fits: true, allocated, reserved, schedule }
            }
            Outcome::Oom => Eval { fits: false, allocated, reserved, schedule },
        })
    }

    /// `micro` samples `accum` times per step; more than [`SIMULATED_ACCUM`] micro-batches
    /// are run as that many (they peak the same).
    fn evaluate(&mut self, c: Config, micro: usize, accum: usize) -> Result<Eval, PlanError> {
        let accum = accum.min(SIMULATED_ACCUM);
        if let Some(e) = self.memo.get(&(c, micro, accum)) {
            return Ok(e.clone());
        }
        let e = if c.plan == PlanKind::Budget {
            self.budget(c, micro, accum)?
        } else {
            let s = fixed_schedule(c.plan, self.n)?;
            self.check(c, s, micro, accum)?
        };
        self.memo.insert((c, micro, accum), e.clone());
        Ok(e)
    }

    /// The budget plan: the least recomputation whose activations fit what the fixed memory
    /// leaves, tightened by what a run shows over until it fits (or no plan does).
    fn budget(&mut self, c: Config, micro: usize, accum: usize) -> Result<Eval, PlanError> {
        let none = Config { plan: PlanKind::None, ..c };
        let plain = self.evaluate(none, micro, accum)?;
        if plain.fits {
            return Ok(plain);
        }
        self.runs += 1;
        let profile = flop_profile(&self.model, c.precision, &self.allocs[c.alloc], micro)?;
        let predicted = profile.predict(&plain.schedule).map_err(|source| PlanError::Run {
            context: "budget plan".into(),
            source: Box::new(source),
        })?;
        let fixed = plain.allocated.saturating_sub(predicted.peak_bytes);
        let mut budget = self.usable.saturating_sub(fixed);
        let mut last = plain;
        for _ in 0..4 {
            let schedule = match profile.fastest_within(budget) {
                Ok(s) => s,
                Err(_) => {
                    // No plan fits the budget: measure the lowest-peak plan to say by how much.
                    let s = profile.fastest_within(profile.min_peak_bytes()).map_err(|source| {
                        PlanError::Run { context: "budget plan".into(), source: Box::new(source) }
                    })?;
                    let e = self.check(c, s, micro, accum)?;
                    return Ok(e);
                }
            };
            let e = self.check(c, schedule, micro, accum)?;
            if e.fits {
                return Ok(e);
            }
            let over = e.reserved.max(e.allocated).saturating_sub(self.usable).max(1 << 20);
            budget = budget.saturating_sub(over);
            last = e;
        }
        Ok(last)
    }

    /// The fewest samples per micro-batch the model trains on, with why one sample fails
    /// when it does: 1, or 2 when a step of one sample fails for another reason than memory
    /// (a batch norm over 1 x 1 planes, as ResNet-50's last stage at 32 px, sees one value
    /// per channel, which PyTorch refuses too). Run in `precision`.
    fn smallest_micro(
        &mut self,
        precision: Precision,
    ) -> Result<(usize, Option<String>), PlanError> {
        // Evaluated as the search would (memoized): the first configuration's first probe.
        let c = Config { precision, plan: PlanKind::None, alloc: 0 };
        match self.evaluate(c, 1, 1) {
            Err(PlanError::Run { context, source }) => {
                let s = fixed_schedule(PlanKind::None, self.n)?;
                match self.run(c, &s, 2, 1, Where::Virtual(UNLIMITED)) {
                    Ok(_) => Ok((2, Some(source.to_string()))),
                    Err(_) => Err(PlanError::Run { context, source }),
                }
            }
            Err(e) => Err(e),
            Ok(_) => Ok((1, None)),
        }
    }

    /// The smallest micro-batch the search may use for a global batch of `g` (a divisor of
    /// `g`, at least [`Search::min_micro`]; `g` itself at worst).
    fn smallest_split(&self, g: usize) -> usize {
        smallest_divisor_from(g, self.min_micro)
    }

    /// Whether `micro` samples per micro-batch fit in a step of the global batch (the whole
    /// batch at once, or micro-batches of `micro` with accumulation over the rest), with the
    /// run's (peak allocated, peak reserved).
    fn probe(&mut self, c: Config, micro: usize) -> Result<Point, PlanError> {
        let g = self.req.batch;
        let e = self.evaluate(c, micro, g.div_ceil(micro))?;
        Ok(Point { micro, fits: e.fits, allocated: e.allocated, reserved: e.reserved })
    }

    /// The largest micro-batch that fits (0 if none), at most the global batch (and the
    /// request's and the host's caps). The peak allocated of a step is about linear in the
    /// micro-batch, so the search draws the line through two sizes (the smallest and the
    /// largest known to fit, or the largest known to fit and the smallest known not to),
    /// solves it for the usable memory, runs the guess and its neighbour, and halves the
    /// bracket when guesses stop narrowing it: a handful of runs whatever the batch.
    fn max_micro(&mut self, c: Config) -> Result<usize, PlanError> {
        let first = self.min_micro;
        let full = self.req.batch.min(self.req.max_micro).min(self.host_cap).max(first);
        let cap = full.min(RUN_CAP).max(first);
        // A small batch: try it whole first (one run when it fits, the common case).
        if cap <= 256 && self.probe(c, cap)?.fits {
            return Ok(cap);
        }
        let anchor = self.probe(c, first)?;
        if !anchor.fits {
            return Ok(0);
        }
        let mut lo = anchor;
        // The line's other point once one past the optimizer step's peak (16 samples) fits.
        let mut base = anchor;
        let mut hi: Option<Point> = None;
        if cap <= 256 {
            hi = Some(self.probe(c, cap)?);
        }
        let mut rounds = 0;
        loop {
            let top = hi.as_ref().map_or(cap, |h| h.micro - 1);
            if lo.micro >= top {
                if hi.is_none() && lo.micro == cap && full > cap && lo.micro > base.micro {
                    // Fits at the largest size run: extrapolate along the allocated's line.
                    let slope = lo.allocated.saturating_sub(base.allocated) as f64
                        / (lo.micro - base.micro) as f64;
                    let gap = lo.reserved.saturating_sub(lo.allocated) as f64;
                    let room = self.usable as f64 - gap - lo.allocated as f64;
                    let m = if slope > 0.0 { lo.micro as f64 + room / slope } else { full as f64 };
                    let m = m.floor().clamp(lo.micro as f64, full as f64) as usize;
                    self.lines.insert(c, (base, lo));
                    return Ok(m);
                }
                return Ok(lo.micro);
            }
            rounds += 1;
            let usable = self.usable as f64;
            let need = |p: &Point| p.reserved.max(p.allocated) as f64;
            let guess = match &hi {
                // Bracketed: the line through lo's and hi's peak reserved, which the cached
                // segments make grow faster than the allocated.
                Some(h) if need(h) > need(&lo) => {
                    let slope = (need(h) - need(&lo)) / (h.micro - lo.micro) as f64;
                    lo.micro as f64 + (usable - need(&lo)) / slope
                }
                // Above every size run so far: the allocated's slope from the base (past the
                // optimizer step's peak), less what the allocator keeps cached at lo, at most
                // four times lo (a slope measured over a few samples may be off).
                None if lo.micro > base.micro && lo.allocated > base.allocated => {
                    let slope =
                        (lo.allocated - base.allocated) as f64 / (lo.micro - base.micro) as f64;
                    let gap = lo.reserved.saturating_sub(lo.allocated) as f64;
                    let m = lo.micro as f64 + (usable - gap - lo.allocated as f64) / slope;
                    m.min(4.0 * lo.micro as f64)
                }
                // One point, or no slope: 16 samples (past the optimizer step's peak), or
                // twice lo.
                _ => (2 * lo.micro).max(16) as f64,
            };
            let guess =
                if guess.is_finite() { guess.floor().clamp(0.0, cap as f64) as usize } else { top };
            let m = if rounds > 3 {
                match hi {
                    Some(_) => lo.micro + (top - lo.micro).div_ceil(2),
                    None => (2 * lo.micro).min(top),
                }
            } else {
                guess.clamp(lo.micro + 1, top)
            };
            let p = self.probe(c, m)?;
            if !p.fits {
                hi = Some(p);
                continue;
            }
            lo = p;
            if base.micro < 16 && p.micro >= 16 {
                base = p;
            }
            // The neighbour settles a good guess at once.
            if m < top {
                let next = self.probe(c, m + 1)?;
                if next.fits {
                    lo = next;
                } else {
                    hi = Some(next);
                }
            }
        }
    }

    fn row(&mut self, c: Config) -> Result<Row, PlanError> {
        let g = self.req.batch;
        let max_micro = self.max_micro(c)?;
        let mut best = None;
        let fewest = self.min_micro;
        for micro in (fewest..=g.min(max_micro)).rev().filter(|d| g.is_multiple_of(*d)).take(8) {
            let e = match self.lines.get(&c).copied() {
                Some((base, lo)) if micro > lo.micro => {
                    let Some(at_lo) =
                        self.memo.get(&(c, lo.micro, g.div_ceil(lo.micro).min(SIMULATED_ACCUM)))
                    else {
                        continue;
                    };
                    let per = lo.allocated.saturating_sub(base.allocated) as f64
                        / (lo.micro - base.micro) as f64;
                    let more = (per * (micro - lo.micro) as f64).round() as u64;
                    self.extrapolated += 1;
                    Eval {
                        fits: true,
                        allocated: lo.allocated + more,
                        reserved: lo.reserved + more,
                        schedule: at_lo.schedule.clone(),
                    }
                }
                _ => self.evaluate(c, micro, g / micro)?,
            };
            if e.fits {
                best = Some((micro, e));
                break;
            }
        }
        let (micro, e) = match best {
            Some(b) => b,
            None => {
                let micro = self.smallest_split(g).min(self.host_cap.max(self.min_micro));
                (micro, self.evaluate(c, micro, g / micro)?)
            }
        };
        let accum = g / micro;
        let (recompute, relative_cost) = self.cost(c.precision, &e.schedule, accum);
        let segments = e.schedule.segments();
        let recomputed = segments.iter().filter(|s| s.checkpointed).count();
        let schedule = if recomputed == 0 {
            "no recompute".to_string()
        } else {
            format!("{recomputed} of {} segments recomputed", segments.len())
        };
        let checkpoint = segments
            .iter()
            .filter(|s| s.checkpointed && s.start < s.end)
            .map(|s| {
                let name = |i: usize| self.names.get(i).cloned().unwrap_or_else(|| i.to_string());
                if s.end - s.start == 1 {
                    name(s.start)
                } else {
                    format!("{}..{}", name(s.start), name(s.end - 1))
                }
            })
            .collect();
        let (label, conf) = ALLOCATOR_SETTINGS[c.alloc];
        Ok(Row {
            precision: c.precision,
            plan: c.plan,
            schedule,
            allocator: label.into(),
            alloc_conf: conf.into(),
            fits: e.fits,
            micro,
            accum,
            peak_allocated: e.allocated,
            peak_reserved: e.reserved,
            headroom: self.usable as i64 - e.reserved.max(e.allocated) as i64,
            recompute,
            relative_cost,
            max_micro,
            checkpoint,
            same_as: Vec::new(),
        })
    }

    /// (recomputed fraction, relative step cost) of a step of the request's batch.
    fn cost(&self, precision: Precision, schedule: &Schedule, accum: usize) -> (f64, f64) {
        cost_model(&self.model, self.params, self.req.batch, precision, schedule, accum)
    }
}

/// (recomputed fraction, relative step cost) of a step of `batch` samples: compute at 2x
/// for fp32, plus one read of the weights in forward and backward and one gradient update
/// per micro-batch at the assumed machine balance; 1.0 is an fp32 step without
/// recomputation or accumulation.
fn cost_model(
    model: &PlanModel,
    params: u64,
    batch: usize,
    precision: Precision,
    schedule: &Schedule,
    accum: usize,
) -> (f64, f64) {
    let flops = model.chain_flops();
    let g = batch as f64;
    let forward: f64 = (flops.iter().sum::<f64>() + model.outside_chain_flops()) * g;
    let recomputed: f64 = schedule
        .segments()
        .iter()
        .filter(|s| s.checkpointed)
        .map(|s| flops[s.start..s.end.min(flops.len())].iter().sum::<f64>())
        .sum::<f64>()
        * g;
    let params = params as f64;
    let bytes = |p: Precision| params * p.dtype().size_in_bytes() as f64;
    let factor =
        |p: Precision| if p.compute_dtype() == DType::F32 { ASSUMED_FP32_FACTOR } else { 1.0 };
    let cost = factor(precision) * (3.0 * forward + recomputed)
        + accum as f64 * ASSUMED_FLOP_PER_BYTE * 3.0 * bytes(precision);
    let base =
        ASSUMED_FP32_FACTOR * 3.0 * forward + ASSUMED_FLOP_PER_BYTE * 3.0 * bytes(Precision::Fp32);
    let frac = if recomputed > 0.0 { recomputed / (3.0 * forward) } else { 0.0 };
    (frac, if base > 0.0 { cost / base } else { 1.0 })
}

/// The estimated (recomputed fraction, relative step cost) of `candidate` for one optimizer
/// step of `micro x accum` samples, by the planner's cost model (FLOPs and weight traffic
/// with the assumptions printed by `cargo xtask plan`; 1.0 = fp32, no recomputation, no
/// accumulation). A budget plan is costed as the sqrt plan (its schedule depends on a
/// memory budget the candidate does not carry).
///
/// # Errors
///
/// [`PlanError::Run`] if the model cannot be built.
pub fn estimate_cost(model: &PlanModel, candidate: &Candidate) -> Result<(f64, f64), PlanError> {
    let (params, n) = param_count(model)?;
    let kind = match candidate.plan {
        PlanKind::Budget => PlanKind::Sqrt,
        k => k,
    };
    let schedule = fixed_schedule(kind, n)?;
    let batch = candidate.micro * candidate.accum;
    Ok(cost_model(model, params, batch, candidate.precision, &schedule, candidate.accum))
}

fn human(bytes: u64) -> String {
    human_bytes(bytes)
}

fn parse_allocs() -> Result<Vec<AllocatorConfig>, PlanError> {
    ALLOCATOR_SETTINGS
        .iter()
        .map(|(_, conf)| AllocatorConfig::parse(conf).map_err(PlanError::from))
        .collect()
}

/// Parameters of `model` (built on a virtual device: nothing is drawn) and its chain length.
pub(crate) fn param_count(model: &PlanModel) -> Result<(u64, usize), PlanError> {
    let shape = model_shape(model)?;
    Ok((shape.params, shape.names.len()))
}

/// What the planner needs of a model's layout.
pub(crate) struct ModelShape {
    /// Parameters.
    pub params: u64,
    /// The chain's layer names (the prefix of their parameters' names: `h0`, `layer1.0`).
    pub names: Vec<String>,
    /// Parameters of the largest chain layer or embedding table.
    pub largest_layer: u64,
}

/// The longest common dotted prefix of `names` (a single name less its last part).
fn common_prefix(names: &[String]) -> Option<String> {
    let first: Vec<&str> = names.first()?.split('.').collect();
    let mut len = first.len().saturating_sub(1);
    for n in &names[1..] {
        let parts: Vec<&str> = n.split('.').collect();
        len = len.min(first.iter().zip(&parts).take_while(|(a, b)| a == b).count());
    }
    (len > 0).then(|| first[..len].join("."))
}

/// Parameters, chain layer names and the largest layer of `model`, built on a virtual
/// device.
pub(crate) fn model_shape(model: &PlanModel) -> Result<ModelShape, PlanError> {
    let device = Device::virtual_device(UNLIMITED);
    let m = Model::with_attention(
        &device,
        model.arch.clone(),
        1,
        vram_kernels::DType::BF16,
        model.attention,
    )
    .map_err(|source| PlanError::Run {
        context: format!("building {}", model.name),
        source: Box::new(source),
    })?;
    let params = m.param_count();
    let parts = m.into_parts();
    let mut largest = 0u64;
    if let Some(e) = &parts.embed {
        for t in std::iter::once(&e.tok).chain(&e.pos) {
            largest = largest.max(t.value.numel() as u64);
        }
    }
    let names = parts
        .layers
        .iter()
        .enumerate()
        .map(|(i, layer)| {
            let ps = layer.params();
            largest = largest.max(ps.iter().map(|p| p.value.numel() as u64).sum());
            let names: Vec<String> = ps.iter().map(|p| p.name.clone()).collect();
            common_prefix(&names).unwrap_or_else(|| format!("{} (layer {i})", layer.name()))
        })
        .collect();
    Ok(ModelShape { params, names, largest_layer: largest })
}

/// The smallest divisor of `g` that is at least `from` (`g` itself at worst), in O(sqrt g).
fn smallest_divisor_from(g: usize, from: usize) -> usize {
    if from <= 1 {
        return 1;
    }
    let mut d = from;
    while d.saturating_mul(d) <= g {
        if g.is_multiple_of(d) {
            return d;
        }
        d += 1;
    }
    // No divisor in [from, sqrt g]: the smallest above is g / (largest co-divisor < from).
    (1..from.min(g + 1))
        .rev()
        .map(|q| g / q)
        .find(|&d| g.is_multiple_of(d) && d >= from)
        .unwrap_or(g)
}

/// Host bytes of one sample of the batch a virtual run builds (ids or pixels, targets).
fn host_bytes_per_sample(model: &PlanModel) -> u64 {
    let rows = model.targets_per_sample() as u64;
    match &model.input {
        SampleInput::Tokens { .. } => 8 * rows,
        SampleInput::Dense { shape } => 4 * shape.iter().product::<usize>() as u64 + 4 * rows,
    }
}

fn check_request(req: &PlanRequest) -> Result<(), PlanError> {
    if req.batch == 0 {
        return Err(PlanError::InvalidArgument {
            what: "batch",
            reason: "the global batch must be at least 1 sample".into(),
        });
    }
    if req.batch > MAX_BATCH {
        return Err(PlanError::InvalidArgument {
            what: "batch",
            reason: format!(
                "a global batch of {} samples is more than the {MAX_BATCH} the planner takes",
                req.batch
            ),
        });
    }
    if req.device_memory == 0 {
        return Err(PlanError::InvalidArgument {
            what: "device memory",
            reason: "must be at least 1 byte".into(),
        });
    }
    if req.device_memory >= MAX_DEVICE_MEMORY {
        return Err(PlanError::InvalidArgument {
            what: "device memory",
            reason: format!(
                "{} is not a GPU: the planner takes less than {} (the largest GPUs hold under \
                 200 GiB)",
                human(req.device_memory),
                human(MAX_DEVICE_MEMORY)
            ),
        });
    }
    if req.usable() == 0 {
        return Err(PlanError::InvalidArgument {
            what: "reserve",
            reason: format!(
                "the reserve ({}) leaves nothing of the device's {}",
                human(req.reserve),
                human(req.device_memory)
            ),
        });
    }
    Ok(())
}

/// Searches every configuration for `req` and ranks those that fit.
///
/// # Errors
///
/// Bad input ([`PlanError::is_bad_input`]): a zero batch or device, a reserve that leaves
/// nothing, a device too small for the parameters alone; [`PlanError::Run`] if a training
/// step fails for another reason than memory.
pub fn plan(req: &PlanRequest, progress: &mut dyn PlanProgress) -> Result<PlanReport, PlanError> {
    let started = Instant::now();
    check_request(req)?;
    let usable = req.usable();
    let shape = model_shape(&req.model)?;
    let (params, n, largest_layer) = (shape.params, shape.names.len(), shape.largest_layer);
    let flops = req.model.chain_flops();
    if flops.len() != n {
        return Err(PlanError::InvalidArgument {
            what: "model",
            reason: format!("the cost model has {} layers for a chain of {n}", flops.len()),
        });
    }
    let precisions = req.precision.precisions();
    let smallest = precisions.iter().map(|p| p.dtype()).min_by_key(|d| d.size_in_bytes());
    let smallest = smallest.unwrap_or(vram_kernels::DType::F32);
    let param_bytes = params * smallest.size_in_bytes() as u64;
    if param_bytes > usable {
        // ZeRO-3 shards the 16-bit weights, gradients and the 12 bytes of optimizer state.
        let gpus = (16 * params).div_ceil(usable.max(1)).max(2);
        return Err(PlanError::DeviceTooSmall {
            params,
            param_bytes,
            dtype: if smallest == vram_kernels::DType::F32 { "fp32" } else { "16 bits" },
            usable,
            device_memory: req.device_memory,
            reserve: req.reserve,
            gpus,
        });
    }
    let mut s = Search {
        req,
        model: req.model.clone(),
        optimizer: req.optimizer,
        usable,
        n,
        allocs: parse_allocs()?,
        memo: HashMap::new(),
        params,
        runs: 0,
        min_micro: 1,
        names: shape.names,
        lines: HashMap::new(),
        extrapolated: 0,
        host_cap: (HOST_BATCH_LIMIT / host_bytes_per_sample(&req.model).max(1)).max(1) as usize,
    };
    let (min_micro, one_fails) = s.smallest_micro(precisions[0])?;
    if req.batch < min_micro {
        return Err(PlanError::InvalidArgument {
            what: "batch",
            reason: format!(
                "{} cannot train on one sample per step ({}); ask for a global batch of at \
                 least {min_micro}",
                req.model.name,
                one_fails.unwrap_or_default()
            ),
        });
    }
    s.min_micro = min_micro;
    let configs: Vec<Config> = precisions
        .iter()
        .flat_map(|&precision| {
            PLAN_KINDS.iter().flat_map(move |&plan| {
                (0..ALLOCATOR_SETTINGS.len()).map(move |alloc| Config { precision, plan, alloc })
            })
        })
        .collect();
    progress.begin(configs.len() + 2);
    let mut rows = Vec::new();
    for &c in &configs {
        let row = s.row(c)?;
        progress.advance(&row.label());
        rows.push((c, row));
    }
    // Best first: cost, then headroom, then the configuration's order (a stable ranking).
    let (mut fitting, mut not): (Vec<_>, Vec<_>) = rows.into_iter().partition(|(_, r)| r.fits);
    fitting.sort_by(|a, b| {
        a.1.relative_cost.total_cmp(&b.1.relative_cost).then(b.1.headroom.cmp(&a.1.headroom))
    });
    not.sort_by_key(|r| std::cmp::Reverse(r.1.headroom));
    let fitting = fold(fitting);
    let not = fold(not);
    let basis = fitting.first().or(not.first()).map(|(c, _)| *c);
    let decomposition = match basis {
        Some(c) => Some(s.decompose(c)?),
        None => None,
    };
    progress.advance("fixed vs per-sample memory");
    let suggestions = if fitting.is_empty() {
        match not.first() {
            Some((c, row)) => s.suggestions(*c, row, decomposition.as_ref())?,
            None => Vec::new(),
        }
    } else {
        Vec::new()
    };
    progress.advance("suggestions");
    // Several GPUs keep the activations of one, so they start from the checkpoint plan
    // with the fewest bytes per sample (every-2) when it keeps fewer than the closest.
    let sharded = match (&decomposition, basis, fitting.is_empty()) {
        (Some(d), Some(c), true) => {
            let every = s.decompose(Config { plan: PlanKind::EveryK(2), ..c })?;
            Some(if every.per_sample < d.per_sample { every } else { d.clone() })
        }
        _ => None,
    };
    let multi_gpu = match (&sharded, fitting.is_empty()) {
        (Some(d), true) => Some(super::dp::multi_gpu_answer(
            &super::dp::ShardBasis {
                params,
                largest_layer,
                precision: d.precision,
                fixed: d.fixed,
                per_sample: d.per_sample,
                usable,
                batch: req.batch,
                min_micro,
                config: d.config.clone(),
            },
            1,
            &d.config,
        )),
        _ => None,
    };
    let why = why(&fitting.iter().map(|(_, r)| r.clone()).collect::<Vec<_>>(), usable);
    let mut notes = req.model.notes.clone();
    if s.extrapolated > 0 {
        notes.push(format!(
            "micro-batches above {RUN_CAP} samples are not run: their peaks ({} splits) are \
             extrapolated along the line through two sizes that fit (the memory of a step is \
             linear in the micro-batch); --verify runs the recommendation",
            s.extrapolated
        ));
    }
    if let Some(why) = &one_fails {
        notes.push(format!(
            "micro-batches start at {min_micro} samples: a step of one sample fails ({why}), \
             as it does in PyTorch"
        ));
    }
    // How much of the recommended configuration's cuDNN work the record covers.
    if req.model.cudnn.is_some()
        && let Some((_, best)) = fitting.first()
    {
        let c = Candidate {
            precision: best.precision,
            plan: best.plan,
            alloc_conf: best.alloc_conf.clone(),
            optimizer: req.optimizer,
            micro: best.micro,
            accum: best.accum,
        };
        if let Some(run) = measure_timed(&req.model, &c, Target::Virtual(UNLIMITED), 1)? {
            notes.push(match run.cudnn_misses {
                0 => "cuDNN record: every cuDNN call of the recommended configuration is in it"
                    .to_string(),
                n => format!(
                    "cuDNN record: {n} cuDNN calls of the recommended configuration's step are \
                     not in it and took no workspace (record a run of this model and batch on \
                     the GPU: `cargo xtask twin`)"
                ),
            });
        }
    }
    notes.extend([
        format!(
            "usable memory = device memory {} - reserve {} = {}: the reserve stands for what \
             vram does not model (CUDA context ~500 MiB, cuDNN/NCCL workspaces, other \
             processes); the cuBLAS workspace (32 MiB, an H100's) is counted",
            human(req.device_memory),
            human(req.reserve),
            human(usable)
        ),
        "fits = peak reserved <= usable, from two optimizer steps on a virtual device (the \
         second with the optimizer state in place); data loading, evaluation and \
         fragmentation over many steps are not in it"
            .into(),
    ]);
    Ok(PlanReport {
        model: req.model.name.clone(),
        params,
        batch: req.batch,
        device_memory: req.device_memory,
        reserve: req.reserve,
        usable,
        optimizer: req.optimizer,
        fitting: fitting.into_iter().map(|(_, r)| r).collect(),
        not_fitting: not.into_iter().map(|(_, r)| r).collect(),
        why,
        decomposition,
        suggestions,
        multi_gpu,
        assumptions: vec![
            format!(
                "relative cost 1.00 = an fp32 step of the whole batch at once without \
                 recomputation; compute = matmul/conv FLOPs (backward = 2x forward) plus the \
                 recomputed forward FLOPs, fp32 FLOPs at {ASSUMED_FP32_FACTOR}x the cost of \
                 16-bit ones (assumption: TF32 vs bf16 tensor-core rates)"
            ),
            format!(
                "each micro-batch also reads the weights twice and updates the gradients \
                 (3 x weight bytes) at {ASSUMED_FLOP_PER_BYTE} FLOP per byte (assumption: an \
                 H100's bf16 rate over its bandwidth); elementwise ops, the optimizer step and \
                 kernel-launch latency are not counted"
            ),
        ],
        notes,
        min_micro,
        runs: s.runs,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Rows with the same split, peaks and recomputed layers as an earlier one folded into it
/// (a budget plan that recomputes nothing is the plan without checkpointing).
fn fold(rows: Vec<(Config, Row)>) -> Vec<(Config, Row)> {
    let mut out: Vec<(Config, Row)> = Vec::with_capacity(rows.len());
    for (c, r) in rows {
        let same = out.iter_mut().find(|(_, o)| {
            o.precision == r.precision
                && o.allocator == r.allocator
                && o.micro == r.micro
                && o.accum == r.accum
                && o.peak_allocated == r.peak_allocated
                && o.peak_reserved == r.peak_reserved
                && o.checkpoint == r.checkpoint
        });
        match same {
            Some((_, o)) => o.same_as.push(r.label()),
            None => out.push((c, r)),
        }
    }
    out
}

fn why(fitting: &[Row], usable: u64) -> String {
    let Some(best) = fitting.first() else {
        return "nothing fits".into();
    };
    let mut why = format!(
        "lowest estimated step cost ({:.2}) of the {} configurations that fit",
        best.relative_cost,
        fitting.len() + fitting.iter().map(|r| r.same_as.len()).sum::<usize>()
    );
    if let Some(next) = fitting.get(1) {
        why += &format!(" (next: {} at {:.2})", next.label(), next.relative_cost);
    }
    why += &format!(
        "; {} x {} samples, {} recomputed, {} headroom ({:.0}% of usable)",
        best.accum,
        best.micro,
        if best.recompute > 0.0 {
            format!("{:.0}% of FLOPs", best.recompute * 100.0)
        } else {
            "nothing".into()
        },
        human(best.headroom.max(0) as u64),
        100.0 * best.headroom.max(0) as f64 / usable.max(1) as f64
    );
    why
}

impl Search<'_> {
    /// Fixed and per-sample peak allocated bytes of `c` (runs at micro-batches 8 and 16).
    fn decompose(&mut self, c: Config) -> Result<Decomposition, PlanError> {
        let plan = if c.plan == PlanKind::Budget { PlanKind::None } else { c.plan };
        let c = Config { plan, ..c };
        let s = fixed_schedule(plan, self.n)?;
        let mut peak = |m| -> Result<u64, PlanError> {
            Ok(match self.run(c, &s, m, 1, Where::Virtual(UNLIMITED))? {
                Outcome::Ran { allocated, .. } => allocated,
                Outcome::Oom => u64::MAX,
            })
        };
        // At 8 and 16 samples the activations, not the optimizer step, make the peak.
        let (lo, hi) = (peak(8)?, peak(16)?);
        let per_sample = hi.saturating_sub(lo) / 8;
        Ok(Decomposition {
            precision: c.precision,
            checkpoint: plan,
            config: format!(
                "{} / {} / {}",
                c.precision.label(),
                plan.label(),
                ALLOCATOR_SETTINGS[c.alloc].0
            ),
            fixed: lo.saturating_sub(8 * per_sample),
            per_sample,
        })
    }

    /// What would fit when nothing does, starting from the closest configuration.
    fn suggestions(
        &mut self,
        c: Config,
        closest: &Row,
        d: Option<&Decomposition>,
    ) -> Result<Vec<String>, PlanError> {
        let g = self.req.batch;
        let need = closest.peak_reserved.max(closest.peak_allocated);
        let m = self.smallest_split(g).min(self.host_cap.max(self.min_micro));
        let split = format!("{} x {m} sample{}", g / m, if m == 1 { "" } else { "s" });
        let mut out = vec![format!(
            "closest: {} needs {} with {split}, {} more than usable",
            closest.label(),
            human(need),
            human(need.saturating_sub(self.usable))
        )];
        if self.optimizer == OptimizerKind::AdamW {
            let saved = self.optimizer;
            self.optimizer = OptimizerKind::Sgd;
            self.memo.clear();
            let e = self.evaluate(c, m, g / m)?;
            let most = if e.fits { self.max_micro(c)? } else { 0 };
            self.optimizer = saved;
            self.memo.clear();
            out.push(if e.fits {
                format!(
                    "SGD with momentum (4 B/parameter of state instead of AdamW's 8) fits (run on \
                     the virtual device): {split} peaks at {} reserved; up to {most} samples \
                     per micro-batch",
                    human(e.reserved)
                )
            } else {
                format!(
                    "SGD with momentum does not fit either: needs {}",
                    human(e.reserved.max(e.allocated))
                )
            });
            // 8-bit moments: 2 B/parameter instead of 8 (estimate: vram has no such optimizer).
            let saving = 6 * self.params;
            if let Some(d) = d {
                let fixed = d.fixed.saturating_sub(saving);
                let room = self.usable.saturating_sub(fixed);
                let fits = d.per_sample > 0 && room >= d.per_sample;
                out.push(if fits {
                    format!(
                        "an 8-bit AdamW (2 B/parameter of state instead of 8) would leave fixed \
                         memory at about {}: about {} samples per micro-batch (estimate from \
                         fixed {} + {} per sample; not run, vram has no 8-bit optimizer)",
                        human(fixed),
                        room / d.per_sample.max(1),
                        human(d.fixed),
                        human(d.per_sample)
                    )
                } else {
                    format!(
                        "an 8-bit AdamW (saves about {}) would not be enough by itself (estimate)",
                        human(saving)
                    )
                });
            }
        }
        if let SampleInput::Tokens { seq, .. } = self.model.input {
            let original = self.model.clone();
            let mut shorter = seq / 2;
            let mut found = None;
            while shorter >= 16 && found.is_none() {
                if let Arch::Gpt { vocab, d, layers, heads, dropout, tied, .. } = original.arch {
                    self.model.arch =
                        Arch::Gpt { vocab, d, layers, heads, seq: shorter, dropout, tied };
                    self.model.input = SampleInput::Tokens { seq: shorter, vocab };
                } else {
                    break;
                }
                self.memo.clear();
                let e = self.evaluate(c, m, g / m)?;
                if e.fits {
                    found = Some((shorter, e.reserved));
                }
                shorter /= 2;
            }
            self.model = original;
            self.memo.clear();
            out.push(match found {
                Some((seq, reserved)) => format!(
                    "sequence length {seq} fits with {} (run on the virtual device): {split} \
                     peaks at {} reserved",
                    closest.label(),
                    human(reserved)
                ),
                None => format!("no shorter sequence (halving {seq} down to 16) fits either"),
            });
        }
        out.push(format!(
            "a device with at least {} (need + the {} reserve) fits {} as asked",
            human(need + self.req.reserve),
            human(self.req.reserve),
            closest.label()
        ));
        Ok(out)
    }
}

/// Runs the recommended configuration of `report` on a real device and compares its peaks
/// with the virtual device's prediction for the same run. On a machine with a CUDA device
/// it runs the full-size configuration there; otherwise it runs on the host at reduced
/// scale (a smaller model of the same kind, at most 2 x 2 samples), predicting that reduced
/// run on a virtual device.
///
/// # Errors
///
/// [`PlanError::InvalidArgument`] if nothing fits; [`PlanError::Run`] if a run fails.
pub fn verify(req: &PlanRequest, report: &PlanReport) -> Result<Verification, PlanError> {
    let best = report.recommended().ok_or_else(|| PlanError::InvalidArgument {
        what: "--verify",
        reason: "no configuration fits, there is nothing to verify".into(),
    })?;

    let cuda = Device::cuda(0).is_ok();
    let (model, micro, accum, capacity) = if cuda {
        (req.model.clone(), best.micro, best.accum, req.usable())
    } else {
        (req.model.reduced(), best.micro.min(2), best.accum.min(2), 4 << 30)
    };
    let candidate = Candidate {
        precision: best.precision,
        plan: best.plan,
        alloc_conf: best.alloc_conf.clone(),
        optimizer: req.optimizer,
        micro,
        accum,
    };
    let ran = |o: Option<(u64, u64)>| {
        o.ok_or_else(|| PlanError::InvalidArgument {
            what: "--verify",
            reason: "the run ran out of memory".into(),
        })
    };
    let predicted = ran(measure(
        &model,
        &candidate,
        Target::Virtual(if cuda { UNLIMITED } else { capacity }),
    )?)?;
    let started = Instant::now();
    let (measured, device) = if cuda {
        (ran(measure(&model, &candidate, Target::Cuda(capacity))?)?, "CUDA device 0".to_string())
    } else {
        (
            ran(measure(&model, &candidate, Target::Host(capacity))?)?,
            format!("host ({} cap)", human(capacity)),
        )
    };
    Ok(Verification {
        device,
        model: model.name.clone(),
        config: best.label(),
        micro,
        accum,
        predicted,
        measured,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// One configuration of a training run, for [`measure`].
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// Precision.
    pub precision: Precision,
    /// Checkpoint plan kind. [`PlanKind::Budget`] gets the budget halfway between the
    /// lowest peak any plan reaches and the peak without checkpointing (from the chain's
    /// profile at `micro` samples), so that it recomputes something.
    pub plan: PlanKind,
    /// Allocator settings (`PYTORCH_CUDA_ALLOC_CONF` syntax; empty: the default).
    pub alloc_conf: String,
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// Samples per micro-batch.
    pub micro: usize,
    /// Micro-batches per optimizer step.
    pub accum: usize,
}

/// Where [`measure`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// A virtual device of this capacity (the prediction).
    Virtual(u64),
    /// The host, computing, with this capacity (and an H100's cuBLAS workspace counted).
    Host(u64),
    /// CUDA device 0, capped at this capacity.
    Cuda(u64),
}

/// Peak allocated and reserved bytes of two optimizer steps of `candidate` on a fresh
/// device, or `None` if it ran out of memory there.
///
/// # Errors
///
/// [`PlanError::InvalidArgument`] for bad allocator settings, a zero micro-batch or
/// accumulation; [`PlanError::Run`] if a step fails for another reason than memory.
pub fn measure(
    model: &PlanModel,
    candidate: &Candidate,
    target: Target,
) -> Result<Option<(u64, u64)>, PlanError> {
    Ok(measure_timed(model, candidate, target, STEPS)?.map(|t| (t.allocated, t.reserved)))
}

/// [`measure`] with `steps` optimizer steps (at least 1), each after the first timed
/// between two synchronizations: how the bench executes a real-size case on a GPU.
///
/// # Errors
///
/// As [`measure`].
pub fn measure_timed(
    model: &PlanModel,
    candidate: &Candidate,
    target: Target,
    steps: u64,
) -> Result<Option<TimedRun>, PlanError> {
    let c = candidate;
    if c.micro == 0 || c.accum == 0 {
        return Err(PlanError::InvalidArgument {
            what: "candidate",
            reason: "micro-batch and accumulation must be at least 1".into(),
        });
    }
    let alloc = AllocatorConfig::parse(&c.alloc_conf)?;
    let (_, n) = param_count(model)?;
    let schedule = match c.plan {
        PlanKind::Budget => {
            let profile = flop_profile(model, c.precision, &alloc, c.micro)?;
            let none = fixed_schedule(PlanKind::None, n)?;
            let fail = |source: vram_accum::Error| PlanError::Run {
                context: "budget plan".into(),
                source: Box::new(source),
            };
            let top = profile.predict(&none).map_err(fail)?.peak_bytes;
            let low = profile.min_peak_bytes().min(top);
            profile.fastest_within(low + (top - low) / 2).map_err(fail)?
        }
        kind => fixed_schedule(kind, n)?,
    };
    let place = match target {
        Target::Virtual(cap) => Where::Virtual(cap),
        Target::Host(cap) => Where::Host(cap),
        Target::Cuda(cap) => Where::Cuda(cap),
    };
    let args = RunArgs {
        model,
        precision: c.precision,
        optimizer: c.optimizer,
        alloc: &alloc,
        schedule: &schedule,
        micro: c.micro,
        accum: c.accum,
    };
    run_timed(&args, place, steps)
}

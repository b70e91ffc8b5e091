//! One experiment per technique id.

mod batch_size;
mod checkpointing;
mod common;
pub(crate) use common::fit_line;
mod data_parallel;
mod empty_cache;
mod fragmentation;
mod grad_accumulation;
mod input_size;
mod lighter_model;
mod max_batch;
mod memory_fraction;
mod mixed_precision;
mod monitoring;
mod multi_task;
mod no_grad;
mod not_here;
mod oom_recovery;
mod release_references;

use crate::results::Check;
use crate::techniques::Technique;
use crate::{Backend, Claim, Context, ExperimentError, ExperimentResult, Timing, Variant};
use serde::Serialize;
use serde_json::Value;

/// Draws an experiment's plot (SVG) from its typed results, if it has data to plot.
pub(crate) type PlotFn<X> = fn(&Sweep<X>) -> Option<String>;

/// One experiment: its technique (the id, written once, lives here), how to run it, how to
/// plot its typed results, and what it costs.
pub(crate) struct Experiment<X: 'static> {
    /// The technique it measures.
    pub technique: Technique,
    /// Runs the experiment; `X` is the experiment's own per-variant measurements.
    pub run: fn(&Context) -> Result<Sweep<X>, ExperimentError>,
    /// Draws its plot from the typed results, when it has one.
    pub plot: Option<PlotFn<X>>,
    /// The largest simulated device capacity the host backend can run it with (its workload
    /// grows with the capacity), and why; `None` when its workload does not depend on it.
    pub host_capacity_limit: Option<(u64, &'static str)>,
    /// Typical wall time in seconds of a release build on a shared 2-core host, quick and
    /// full (measured; for the time-left estimate only).
    pub expected_secs: [f64; 2],
}

/// What a finished experiment hands to the bench: the results file and the plot.
pub(crate) struct Finished {
    pub result: ExperimentResult,
    pub plot: Option<String>,
}

/// An [`Experiment`] whatever its measurement type.
pub(crate) trait Descriptor: Sync {
    fn technique(&self) -> &Technique;
    fn run(&self, ctx: &Context) -> Result<Finished, ExperimentError>;
    fn host_capacity_limit(&self) -> Option<(u64, &'static str)>;
    fn expected_secs(&self, quick: bool) -> f64;
}

impl<X: Serialize + 'static> Descriptor for Experiment<X> {
    fn technique(&self) -> &Technique {
        &self.technique
    }

    fn run(&self, ctx: &Context) -> Result<Finished, ExperimentError> {
        let sweep = (self.run)(ctx)?;
        let plot = self.plot.and_then(|p| p(&sweep));
        Ok(Finished { result: sweep.finish(self.technique.id)?, plot })
    }

    fn host_capacity_limit(&self) -> Option<(u64, &'static str)> {
        self.host_capacity_limit
    }

    fn expected_secs(&self, quick: bool) -> f64 {
        self.expected_secs[usize::from(!quick)]
    }
}

/// Every experiment, in the order of the report.
pub(crate) static EXPERIMENTS: &[&dyn Descriptor] = &[
    &batch_size::EXPERIMENT,
    &max_batch::EXPERIMENT,
    &grad_accumulation::EXPERIMENT,
    &mixed_precision::EXPERIMENT,
    &no_grad::EXPERIMENT,
    &empty_cache::EXPERIMENT,
    &release_references::EXPERIMENT,
    &not_here::PINNED_MEMORY,
    &lighter_model::EXPERIMENT,
    &input_size::EXPERIMENT,
    &memory_fraction::EXPERIMENT,
    &checkpointing::EXPERIMENT,
    &fragmentation::EXPERIMENT,
    &monitoring::EXPERIMENT,
    &multi_task::EXPERIMENT,
    &oom_recovery::EXPERIMENT,
    &data_parallel::EXPERIMENT,
    &not_here::CPU_FALLBACK,
];

/// The experiment for a technique id.
pub(crate) fn find(id: &str) -> Option<&'static dyn Descriptor> {
    EXPERIMENTS.iter().copied().find(|e| e.technique().id == id)
}

/// An experiment's results while it runs: variants with their typed measurements `X`
/// (written flattened into each variant of the results file), then claims.
pub(crate) struct Sweep<X> {
    backend: &'static str,
    device: String,
    config: Value,
    variants: Vec<(Variant, X)>,
    claims: Vec<Claim>,
    checks: Vec<Check>,
    reading: Option<String>,
}

impl<X: Serialize> Sweep<X> {
    pub fn new(ctx: &Context, config: Value) -> Sweep<X> {
        let device = match &ctx.backend {
            Backend::Cpu => format!(
                "virtual device memory of {} (allocator-level experiment: the same policy runs on every backend, so the figures are exact)",
                crate::human_bytes(ctx.device_memory)
            ),
            Backend::Cuda { name, .. } => name.clone(),
        };
        Sweep {
            backend: ctx.backend.tag(),
            device,
            config,
            variants: Vec::new(),
            claims: Vec::new(),
            checks: Vec::new(),
            reading: None,
        }
    }

    /// Adds a measured variant.
    pub fn push(
        &mut self,
        name: &str,
        peak_allocated: u64,
        peak_reserved: u64,
        step: Option<Timing>,
        extra: X,
    ) {
        let v = Variant {
            name: name.to_string(),
            peak_allocated_bytes: peak_allocated,
            peak_reserved_bytes: peak_reserved,
            step_ms: step.map(|t| t.mean_ms),
            step_ms_ci95: step.and_then(|t| t.ci95_ms),
            step_ms_samples: step.map(|t| t.samples),
            extra: serde_json::Map::new(),
        };
        self.variants.push((v, extra));
    }

    /// The variants so far, with their measurements.
    pub fn variants(&self) -> &[(Variant, X)] {
        &self.variants
    }

    pub fn claim(&mut self, c: Claim) {
        self.claims.push(c);
    }

    /// A consistency check (see [`Check`]): an agreement the design makes hold, reported
    /// apart from the verdicts.
    pub fn check(&mut self, check: impl Into<String>, measured: impl Into<String>, passed: bool) {
        self.checks.push(Check { check: check.into(), measured: measured.into(), passed });
    }

    /// One line for the report: what the measurements mean for a user.
    pub fn reading(&mut self, text: impl Into<String>) {
        self.reading = Some(text.into());
    }

    fn finish(self, id: &str) -> Result<ExperimentResult, ExperimentError> {
        let texts = self
            .variants
            .iter()
            .map(|(v, _)| &v.name)
            .chain(self.claims.iter().map(|c| &c.measured))
            .chain(self.checks.iter().map(|c| &c.measured))
            .chain(&self.reading);
        for text in texts {
            if let Some(missing) = unlabelled_gpt(text) {
                return Err(ExperimentError::Setup(format!(
                    "{id}: a figure names a GPT without its {missing}: {text}"
                )));
            }
        }
        let variants = self
            .variants
            .into_iter()
            .map(|(mut v, x)| {
                v.extra = match serde_json::to_value(x) {
                    Ok(Value::Object(map)) => map,
                    Ok(Value::Null) => serde_json::Map::new(),
                    other => {
                        return Err(ExperimentError::Setup(format!(
                            "{id}: a variant's measurements must serialise to a JSON object, got {other:?}"
                        )));
                    }
                };
                Ok(v)
            })
            .collect::<Result<_, _>>()?;
        Ok(ExperimentResult {
            experiment: id.to_string(),
            backend: self.backend.to_string(),
            device: self.device,
            config: self.config,
            variants,
            claims: self.claims,
            checks: self.checks,
            reading: self.reading,
        })
    }
}

/// What a text that names a GPT (a variant, a claim's or a check's measured figures, a
/// reading) leaves out of what every GPT figure must say: its attention form, its dropout
/// and its precision (`None` when it names no GPT or says all three). GPT-2 at batch 8 takes
/// 18 GiB with explicit attention and dropout 0.1 and far less fused without dropout, so a
/// figure without them cannot be compared.
pub(crate) fn unlabelled_gpt(text: &str) -> Option<&'static str> {
    if !text.to_ascii_lowercase().contains("gpt") {
        return None;
    }
    let precision = ["fp32", "fp16", "bf16", "f32"].iter().any(|p| text.contains(p));
    if !["fused attention", "explicit attention"].iter().any(|a| text.contains(a)) {
        Some("attention form")
    } else if !text.contains("dropout") {
        Some("dropout")
    } else if !precision {
        Some("precision")
    } else {
        None
    }
}

/// Runs `$body` with `$cache` bound to a fresh caching allocator (settings `$conf`, in
/// `VRAM_ALLOC_CONF` syntax) on the context's device memory: virtual memory of the simulated
/// capacity on the host backend, the real device on CUDA. Evaluates to `$body`'s value; the
/// enclosing function must return `Result<_, ExperimentError>`.
macro_rules! allocator_variant {
    ($ctx:expr, $conf:expr, |$cache:ident| $body:expr) => {{
        let config = vram_alloc::AllocatorConfig::parse($conf)?;
        match &$ctx.backend {
            $crate::Backend::Cpu => {
                let mem = vram_alloc::VirtualMemory::new($ctx.device_memory);
                let $cache = vram_alloc::CachingAllocator::with_config(mem, config)?;
                $body
            }
            #[cfg(feature = "cuda")]
            $crate::Backend::Cuda { .. } => {
                let mem = vram_alloc::cuda::CudaMemory::new(0)?;
                let $cache = vram_alloc::CachingAllocator::with_config(mem, config)?;
                $body
            }
            #[cfg(not(feature = "cuda"))]
            $crate::Backend::Cuda { .. } => {
                return Err($crate::ExperimentError::Setup(
                    "this build has no CUDA support".into(),
                ));
            }
        }
    }};
}
pub(crate) use allocator_variant;

#[cfg(test)]
mod tests {
    use super::unlabelled_gpt;

    #[test]
    fn a_gpt_figure_must_say_attention_dropout_and_precision() {
        assert_eq!(unlabelled_gpt("ResNet-50 at batch 32: 10 GiB"), None);
        assert_eq!(unlabelled_gpt("GPT-2 small batch 8: 18 GiB"), Some("attention form"));
        assert_eq!(unlabelled_gpt("gpt2-small, batch 8"), Some("attention form"));
        assert_eq!(
            unlabelled_gpt("GPT-2 small (fused attention) batch 8: 18 GiB"),
            Some("dropout")
        );
        assert_eq!(
            unlabelled_gpt("GPT-2 small (dropout 0.1, fused attention) batch 8"),
            Some("precision")
        );
        assert_eq!(
            unlabelled_gpt("GPT-2 small (dropout 0.1, explicit attention, fp32 + AdamW): 18 GiB"),
            None
        );
    }
}

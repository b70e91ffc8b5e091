//! One experiment per technique id.

mod batch_size;
mod checkpointing;
mod common;
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

use crate::{Backend, Claim, Context, ExperimentResult, Variant};
use serde_json::Value;

/// Runs one experiment on the given context.
pub type ExperimentFn = fn(&Context) -> Result<ExperimentResult, String>;

/// The experiments implemented so far, by technique id.
const EXPERIMENTS: &[(&str, ExperimentFn)] = &[
    ("batch-size", batch_size::run),
    ("max-batch-search", max_batch::run),
    ("grad-accumulation", grad_accumulation::run),
    ("mixed-precision", mixed_precision::run),
    ("no-grad-inference", no_grad::run),
    ("empty-cache", empty_cache::run),
    ("release-references", release_references::run),
    ("pinned-memory", not_here::pinned_memory),
    ("lighter-model", lighter_model::run),
    ("input-size", input_size::run),
    ("memory-fraction", memory_fraction::run),
    ("checkpointing", checkpointing::run),
    ("fragmentation", fragmentation::run),
    ("monitoring", monitoring::run),
    ("multi-task", multi_task::run),
    ("oom-recovery", oom_recovery::run),
    ("data-parallel", data_parallel::run),
    ("cpu-fallback", not_here::cpu_fallback),
];

/// The experiment for a technique id, if it is implemented.
pub fn find(id: &str) -> Option<ExperimentFn> {
    EXPERIMENTS.iter().find(|(i, _)| *i == id).map(|(_, f)| *f)
}

/// Builds an experiment's results: variants in order, then claims.
pub(crate) struct Sweep {
    result: ExperimentResult,
}

impl Sweep {
    pub fn new(ctx: &Context, id: &str, config: Value) -> Sweep {
        let device = match &ctx.backend {
            Backend::Cpu => format!(
                "virtual device memory of {} (allocator-level experiment: the same policy runs on every backend, so the figures are exact)",
                crate::human_bytes(ctx.device_memory)
            ),
            Backend::Cuda { name, .. } => name.clone(),
        };
        Sweep {
            result: ExperimentResult {
                experiment: id.to_string(),
                backend: ctx.backend.tag().to_string(),
                device,
                config,
                variants: Vec::new(),
                claims: Vec::new(),
            },
        }
    }

    pub fn variant(
        &self,
        name: &str,
        peak_allocated: u64,
        peak_reserved: u64,
        step_ms: Option<f64>,
    ) -> Variant {
        Variant {
            name: name.to_string(),
            peak_allocated_bytes: peak_allocated,
            peak_reserved_bytes: peak_reserved,
            step_ms,
            extra: serde_json::Map::new(),
        }
    }

    pub fn push(&mut self, v: Variant) {
        self.result.variants.push(v);
    }

    pub fn claim(&mut self, c: Claim) {
        self.result.claims.push(c);
    }

    pub fn finish(self) -> ExperimentResult {
        self.result
    }
}

/// Runs `$body` with `$cache` bound to a fresh caching allocator (settings `$conf`, in
/// `VRAM_ALLOC_CONF` syntax) on the context's device memory: virtual memory of the simulated
/// capacity on the host backend, the real device on CUDA. Evaluates to `$body`'s value; the
/// enclosing function must return `Result<_, String>`.
macro_rules! allocator_variant {
    ($ctx:expr, $conf:expr, |$cache:ident| $body:expr) => {{
        let config = vram_alloc::AllocatorConfig::parse($conf).map_err(|e| e.to_string())?;
        match &$ctx.backend {
            $crate::Backend::Cpu => {
                let mem = vram_alloc::VirtualMemory::new($ctx.device_memory);
                let $cache = vram_alloc::CachingAllocator::with_config(mem, config)
                    .map_err(|e| e.to_string())?;
                $body
            }
            #[cfg(feature = "cuda")]
            $crate::Backend::Cuda { .. } => {
                let mem = vram_alloc::cuda::CudaMemory::new(0).map_err(|e| e.to_string())?;
                let $cache = vram_alloc::CachingAllocator::with_config(mem, config)
                    .map_err(|e| e.to_string())?;
                $body
            }
            #[cfg(not(feature = "cuda"))]
            $crate::Backend::Cuda { .. } => return Err("this build has no CUDA support".into()),
        }
    }};
}
pub(crate) use allocator_variant;

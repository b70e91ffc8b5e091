//! The PyTorch twin behind `cargo xtask twin`: a reference model trained by vram and by
//! PyTorch from the same initial weights on the same batch, so that peak memory, step time
//! and every step's loss can be put side by side.
//!
//! [`run_vram`] builds a model on a device, writes an export into a folder (`twin.json`:
//! the architecture, the parameters in vram's order with their shapes, the optimizer, the
//! step count; `weights.f32`, `input.*`, `targets.u32`: little-endian binaries), then trains
//! it for a few AdamW steps and adds what it measured to `twin.json` under `"vram"`.
//! `xtask/twin/torch_twin.py` reads the folder, builds the same model in PyTorch (explicit
//! attention, the same layers), loads the weights, runs the same steps and writes
//! `torch.json`. [`compare`] reads both and [`report`] writes the table.
//!
//! Both sides measure the same way: peaks are reset once the model, the batch and the
//! optimizer are on the device (PyTorch's AdamW, like vram's, creates its state at the first
//! step), then each step is forward, loss, backward, optimizer step and gradients set to
//! none, timed between two device synchronizations.
//!
//! ```
//! use vram_harness::twin::{self, TwinSettings};
//! use vram_kernels::Device;
//!
//! let dir = std::env::temp_dir().join(format!("twin-doc-{}", std::process::id()));
//! let settings = TwinSettings { batch: 4, steps: 2, ..TwinSettings::default() };
//! let run = twin::run_vram(&Device::host(64 << 20), "mlp", &settings, &dir)?;
//! assert_eq!(run.losses.len(), 2);
//! assert!(std::fs::metadata(dir.join("weights.f32"))?.len() == 4 * run.param_count);
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::data::{Batch, Input};
use crate::models::{Arch, Model, ModelOptions};
use crate::trainer::adamw;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;
use vram_accum::{ForwardCtx, Mode};
use vram_alloc::human_bytes;
use vram_amp::Optimizer;
use vram_kernels::{DType, Device};

/// The version of the export's layout (`twin.json["format"]`).
pub const FORMAT: u32 = 1;

/// Steps after the timed ones over which both sides track their peak at the tensor level
/// (`xtask/twin/torch_twin.py` has the same constant).
pub const TRACKED_STEPS: usize = 2;

/// Entries of a profile table in TWIN.md.
const PROFILE_ROWS: usize = 12;

/// TWIN.md's "where the time goes" section: per model with a profiled step, vram's longest
/// ops and PyTorch's longest kernels (or CPU ops), each with its share of its side's total.
fn profiles(s: &mut String, rows: &[Comparison]) {
    let with: Vec<&Comparison> = rows.iter().filter(|r| r.vram.profile.is_some()).collect();
    if with.is_empty() {
        return;
    }
    s.push_str(
        "\n## Where the time goes: one profiled step (`--profile`)\n\n\
         One more step after the measured ones. vram times each op between two \
         synchronizations (so the ops run one at a time, launch overhead included, and the \
         step is slower than a plain one); PyTorch's side is `torch.profiler`: on a GPU its \
         kernels by device time, on the host its aten ops by self CPU time. Compare shares \
         within a side, and which ops lead on each.\n",
    );
    for r in with {
        let side = |p: &StepProfile| -> Vec<String> {
            let mut lines = vec![format!(
                "{}: step {:.2} ms profiled, {:.2} ms in the entries",
                p.time, p.step_ms, p.total_ms
            )];
            for o in p.ops.iter().take(PROFILE_ROWS) {
                let share = if p.total_ms > 0.0 { 100.0 * o.ms / p.total_ms } else { 0.0 };
                lines.push(format!(
                    "| {} | {} | {:.3} | {share:.1}% |",
                    o.name.replace('|', "/"),
                    o.calls,
                    o.ms
                ));
            }
            lines
        };
        let _ = writeln!(s, "\n### {} (batch {})\n", r.model, r.batch);
        let vram = r.vram.profile.as_ref().map(side).unwrap_or_default();
        let torch = r.torch.as_ref().ok().and_then(|t| t.profile.as_ref()).map(side);
        for (who, lines) in [("vram", Some(vram)), ("PyTorch", torch)] {
            match lines {
                Some(lines) if !lines.is_empty() => {
                    let _ = writeln!(s, "{who}, {}\n", lines[0]);
                    s.push_str("| op | calls | ms | share |\n|---|---:|---:|---:|\n");
                    for l in &lines[1..] {
                        let _ = writeln!(s, "{l}");
                    }
                    s.push('\n');
                }
                _ => {
                    let _ = writeln!(s, "{who}: no profile\n");
                }
            }
        }
    }
}

/// What went wrong exporting, training or comparing.
#[derive(Debug, thiserror::Error)]
pub enum TwinError {
    /// A model the twin cannot export.
    #[error("{0}")]
    Model(String),
    /// A model name the zoo does not know, or a size it cannot take.
    #[error(transparent)]
    Zoo(#[from] crate::models::ZooError),
    /// A setting out of range.
    #[error("invalid {what}: {reason}")]
    InvalidArgument {
        /// The setting.
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// Building or training the model failed.
    #[error("{model} on {device}: {source}")]
    Run {
        /// The model.
        model: String,
        /// The device.
        device: String,
        /// What failed.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {reason}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// How to run a twin.
#[derive(Clone, Debug)]
pub struct TwinSettings {
    /// Samples per batch (sequences for GPT).
    pub batch: usize,
    /// Optimizer steps (at least 2: the first creates AdamW's state, the next are steady).
    pub steps: usize,
    /// Dropout of GPT and ViT (0 by default, so that both sides' losses can be compared
    /// step for step; PyTorch's dropout draws other numbers than vram's).
    pub dropout: f32,
    /// Seed of the weights and the batch.
    pub seed: u64,
    /// AdamW's learning rate (the other settings are PyTorch's defaults).
    pub lr: f32,
    /// One more step on each side after the measured ones, profiled: vram's time per op
    /// ([`Device::start_op_profile`]), PyTorch's under `torch.profiler`. Off by default.
    pub profile: bool,
    /// vram's bf16 autocast recipe too (f32 weights, 16-bit matmuls, as `torch.autocast`):
    /// the same steps on a fresh model, measured for memory and time only
    /// ([`VramRun::autocast_bf16`]); what PyTorch's `bf16-autocast` and `compile` recipes are
    /// compared with. Off by default.
    pub autocast_bf16: bool,
}

impl Default for TwinSettings {
    fn default() -> Self {
        TwinSettings {
            batch: 8,
            steps: 5,
            dropout: 0.0,
            seed: 1,
            lr: 1e-3,
            profile: false,
            autocast_bf16: false,
        }
    }
}

/// The file a twin run on a GPU writes its cuDNN choices to (`Device::cudnn_choices`), for
/// `cargo xtask plan --cudnn-choices`.
pub const CUDNN_CHOICES: &str = "cudnn-choices.json";

/// PyTorch's recipes beside the matching run, as `torch_twin.py --recipe` names them, in the
/// order TWIN.md lists them: f32 with PyTorch's defaults (TF32 as shipped, SDPA), bf16
/// autocast with SDPA, fused AdamW and channels_last, and the same under `torch.compile`.
pub const TORCH_RECIPES: &[&str] = &["defaults", "bf16-autocast", "compile"];

/// Which of vram's runs a PyTorch recipe is compared with: f32 for `defaults`, bf16
/// autocast for the others.
fn recipe_is_autocast(recipe: &str) -> bool {
    recipe != "defaults"
}

/// A run measured for memory and time only (a recipe beside the twin's matching run).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RecipeRun {
    /// Loss before each step's update.
    pub losses: Vec<f32>,
    /// Each step's time in milliseconds.
    pub step_ms: Vec<f64>,
    /// `max_memory_allocated` over the steps.
    pub peak_allocated: u64,
    /// `max_memory_reserved` over the steps.
    pub peak_reserved: u64,
    /// Whether the model ran channels_last (absent in files of older runs: it did not).
    #[serde(default)]
    pub channels_last: bool,
}

impl RecipeRun {
    /// The run's name in TWIN.md: `bf16 autocast`, with `, channels_last` where it was.
    fn label(&self) -> &'static str {
        if self.channels_last { "bf16 autocast, channels_last" } else { "bf16 autocast" }
    }
}

/// Whether vram's bf16 autocast recipe runs `arch` channels_last on `device`: a preset CNN
/// where cuDNN runs the convolutions (it reads NHWC as it is, the layout of its tensor-core
/// kernels, as PyTorch's channels_last recipe relies on). On the own kernels, which permute
/// around each NHWC convolution, the recipe stays NCHW.
pub fn autocast_channels_last(device: &Device, arch: &Arch) -> bool {
    arch.is_preset_cnn() && matches!(device.conv_path(), vram_kernels::ConvPath::Cudnn { .. })
}

/// One profiled step (`"profile"` in `twin.json["vram"]` and in `torch.json`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StepProfile {
    /// The profiled step's wall time in milliseconds (profiling included: vram synchronizes
    /// around every op).
    pub step_ms: f64,
    /// The total over every entry (the listed ones are the longest).
    pub total_ms: f64,
    /// What the entries time: vram's ops; PyTorch's CUDA kernels or CPU aten ops.
    pub time: String,
    /// The entries, longest first.
    pub ops: Vec<ProfiledOp>,
}

/// One entry of a [`StepProfile`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProfiledOp {
    /// The op's (or kernel's) name.
    pub name: String,
    /// Calls in the step.
    pub calls: u64,
    /// Their total time in milliseconds.
    pub ms: f64,
}

impl TwinSettings {
    /// Checks the settings: `batch` at least 1, at least 2 steps, dropout in [0, 1), a
    /// learning rate finite and > 0.
    ///
    /// # Errors
    ///
    /// [`TwinError::InvalidArgument`] naming the setting and why.
    pub fn validate(&self) -> Result<(), TwinError> {
        let s = self;
        let bad = |what, reason: String| Err(TwinError::InvalidArgument { what, reason });
        if s.batch == 0 {
            return bad("batch", "must be at least 1".into());
        }
        if s.steps < 2 {
            return bad(
                "steps",
                format!("must be at least 2 (the first creates AdamW's state), got {}", s.steps),
            );
        }
        if !(0.0..1.0).contains(&s.dropout) {
            return bad("dropout", format!("must be in [0, 1), got {}", s.dropout));
        }
        if !(s.lr.is_finite() && s.lr > 0.0) {
            return bad("learning rate", format!("must be finite and > 0, got {}", s.lr));
        }
        Ok(())
    }
}

/// What vram measured (`twin.json["vram"]`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VramRun {
    /// `"cpu"`, `"cuda"` or `"virtual"`.
    pub backend: String,
    /// The device's name.
    pub device: String,
    /// Parameters (a tied head counted once).
    pub param_count: u64,
    /// Loss before each step's update.
    pub losses: Vec<f32>,
    /// Each step's time in milliseconds.
    pub step_ms: Vec<f64>,
    /// Bytes allocated once model, batch and optimizer were on the device.
    pub weights_bytes: u64,
    /// `max_memory_allocated` over the steps.
    pub peak_allocated: u64,
    /// `max_memory_reserved` over the steps.
    pub peak_reserved: u64,
    /// The device's used memory (total - free, `cuMemGetInfo`) after the steps, with the
    /// allocator's cache still held: what `nvidia-smi` shows for the process and others.
    pub device_used: Option<u64>,
    /// The same steps on a virtual device of the same capacity and cuBLAS workspace: its
    /// `max_memory_allocated`, the prediction `cargo xtask plan` makes.
    #[serde(default)]
    pub predicted_peak_allocated: Option<u64>,
    /// The virtual device's `max_memory_reserved`.
    #[serde(default)]
    pub predicted_peak_reserved: Option<u64>,
    /// Bytes a training forward and its loss leave for backward (the layers' saved state and
    /// the logits), as requested from the allocator (before its rounding), measured on one
    /// more forward after the steps: what PyTorch's autograd graph holds at the same point.
    #[serde(default)]
    pub kept_for_backward: Option<u64>,
    /// The peak of bytes requested from the allocator (before its rounding) over
    /// [`TRACKED_STEPS`] more steps after the timed ones, weights and optimizer state
    /// included: the figure PyTorch's `MemTracker` gives on the host.
    #[serde(default)]
    pub tracked_peak: Option<u64>,
    /// One more step, profiled per op (with [`TwinSettings::profile`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<StepProfile>,
    /// vram's bf16 autocast recipe (with [`TwinSettings::autocast_bf16`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autocast_bf16: Option<RecipeRun>,
}

/// What PyTorch measured (`torch.json`, written by `xtask/twin/torch_twin.py`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TorchRun {
    /// `torch.__version__`.
    pub torch: String,
    /// The device's name.
    pub device: String,
    /// `"cuda"` or `"cpu"`.
    pub backend: String,
    /// Parameters.
    pub param_count: u64,
    /// Loss before each step's update.
    pub losses: Vec<f32>,
    /// Each step's time in milliseconds.
    pub step_ms: Vec<f64>,
    /// `torch.cuda.max_memory_allocated` over the steps (none on the CPU).
    pub peak_allocated: Option<u64>,
    /// `torch.cuda.max_memory_reserved` over the steps (none on the CPU).
    pub peak_reserved: Option<u64>,
    /// The bytes of the distinct storages autograd saved in one forward and loss, without
    /// parameters, buffers and targets (on every device).
    #[serde(default)]
    pub saved_for_backward: Option<u64>,
    /// `MemTracker`'s peak over [`TRACKED_STEPS`] more steps: every storage at the dispatcher,
    /// parameters, gradients, optimizer state and batch included (host runs only).
    #[serde(default)]
    pub tracked_peak: Option<u64>,
    /// Anything the script wants said (TF32 off, attention kind, ...).
    #[serde(default)]
    pub notes: Vec<String>,
    /// One more step under `torch.profiler` (with [`TwinSettings::profile`]).
    #[serde(default)]
    pub profile: Option<StepProfile>,
    /// The recipe (`torch_twin.py --recipe`): `match` (vram's math, `torch.json`) or one of
    /// [`TORCH_RECIPES`] (`torch-<recipe>.json`). Absent in files of older scripts: `match`.
    #[serde(default)]
    pub recipe: Option<String>,
}

/// The architecture as the twin script reads it; GPT and ViT with `dropout`; transformers
/// with the attention form vram's blocks use (`"fused"`: the script runs PyTorch's
/// `scaled_dot_product_attention` beside it).
///
/// # Errors
///
/// [`TwinError::Model`] for a user-described model (`Arch::Custom`), which the script does
/// not build.
pub fn arch_json(arch: &Arch, dropout: f32) -> Result<Value, TwinError> {
    Ok(match arch {
        Arch::Mlp { dims, classes } => json!({"kind": "mlp", "dims": dims, "classes": classes}),
        Arch::ResNet { width, blocks, classes } => {
            json!({"kind": "resnet", "width": width, "blocks": blocks, "classes": classes})
        }
        Arch::MobileNet { width, blocks, classes } => {
            json!({"kind": "mobilenet", "width": width, "blocks": blocks, "classes": classes})
        }
        Arch::Gpt { vocab, d, layers, heads, seq, tied, .. } => json!({
            "kind": "gpt", "vocab": vocab, "d": d, "layers": layers, "heads": heads,
            "seq": seq, "dropout": dropout, "tied": tied, "attention": "fused",
        }),
        Arch::BottleneckResNet { side, width, blocks, classes } => json!({
            "kind": "bottleneck_resnet", "side": side, "width": width, "blocks": blocks,
            "classes": classes, "batch_norm": true,
        }),
        Arch::MobileNetV3 { side, width_mult, classes } => json!({
            "kind": "mobilenetv3", "side": side, "width_mult": width_mult, "classes": classes,
            "batch_norm": true,
        }),
        Arch::Vit { side, patch, d, layers, heads, classes, .. } => json!({
            "kind": "vit", "side": side, "patch": patch, "d": d, "layers": layers,
            "heads": heads, "classes": classes, "dropout": dropout, "attention": "fused",
        }),
        Arch::Llama(l) => {
            // The f32 settings as the config wrote them (1e-6, not 9.99999997e-7).
            let dec = |x: f32| x.to_string().parse::<f64>().unwrap_or(f64::from(x));
            let scaling = match l.rope_scaling {
                vram_kernels::ops::RopeScaling::Default => json!(null),
                vram_kernels::ops::RopeScaling::Linear { factor } => {
                    json!({"rope_type": "linear", "factor": factor})
                }
                vram_kernels::ops::RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                } => json!({
                    "rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings,
                }),
            };
            json!({
                "kind": "llama", "vocab": l.vocab, "d": l.d, "layers": l.layers,
                "heads": l.heads, "kv_heads": l.kv_heads, "head_dim": l.head_dim,
                "hidden": l.hidden, "seq": l.seq, "eps": dec(l.eps),
                "rope_theta": dec(l.rope_theta),
                "rope_scaling": scaling, "qkv_bias": l.qkv_bias, "tied": l.tied,
                "attention": "fused",
            })
        }
        Arch::Custom(spec) => {
            return Err(TwinError::Model(format!(
                "model `{}` is user-described; the twin builds the zoo's presets only",
                spec.name
            )));
        }
    })
}

/// `arch` with its dropout (GPT, ViT) set to `p`.
fn with_dropout(arch: Arch, p: f32) -> Arch {
    match arch {
        Arch::Gpt { vocab, d, layers, heads, seq, tied, .. } => {
            Arch::Gpt { vocab, d, layers, heads, seq, dropout: p, tied }
        }
        Arch::Vit { side, patch, d, layers, heads, classes, .. } => {
            Arch::Vit { side, patch, d, layers, heads, classes, dropout: p }
        }
        other => other,
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> TwinError + '_ {
    move |e| TwinError::Io { path: path.to_path_buf(), reason: e.to_string() }
}

fn write_le<T: Copy>(
    path: &Path,
    values: &[T],
    to_le: impl Fn(T) -> [u8; 4],
) -> Result<(), TwinError> {
    let mut bytes = Vec::with_capacity(4 * values.len());
    for &v in values {
        bytes.extend_from_slice(&to_le(v));
    }
    std::fs::write(path, bytes).map_err(io(path))
}

/// Builds preset `name` on `device`, writes its export into `dir` (created if missing) and
/// trains it for `settings.steps` steps, adding what it measured to `dir/twin.json`.
///
/// # Errors
///
/// An unknown preset or a user-described model, settings out of range (`batch` 0, fewer
/// than 2 steps, dropout outside [0, 1), a learning rate that is not finite and > 0), a
/// virtual device (it keeps no values to export), a failed step (out of memory above all),
/// an unwritable `dir`.
pub fn run_vram(
    device: &Device,
    name: &str,
    settings: &TwinSettings,
    dir: &Path,
) -> Result<VramRun, TwinError> {
    settings.validate()?;
    let arch = Arch::preset(name)?;
    run_vram_arch(device, name, arch, settings, dir)
}

/// [`run_vram`] for an architecture given whole (a Hugging Face config's,
/// [`crate::models::HfModel`]), named `name` in the export.
///
/// # Errors
///
/// As [`run_vram`].
pub fn run_vram_arch(
    device: &Device,
    name: &str,
    arch: Arch,
    settings: &TwinSettings,
    dir: &Path,
) -> Result<VramRun, TwinError> {
    settings.validate()?;
    if device.is_virtual() {
        return Err(TwinError::InvalidArgument {
            what: "device",
            reason: "a virtual device keeps no values to export; use the host or CUDA".into(),
        });
    }
    let arch = with_dropout(arch, settings.dropout);
    let arch_value = arch_json(&arch, settings.dropout)?;
    let seq = match &arch {
        Arch::Gpt { seq, .. } => Some(*seq),
        Arch::Llama(l) => Some(l.seq),
        _ => None,
    };
    let fail = |source: Box<dyn std::error::Error + Send + Sync>| TwinError::Run {
        model: name.to_string(),
        device: device.name(),
        source,
    };
    let batch = arch.dataset().batch(settings.seed, 0, settings.batch);
    let mut model = Model::new(device, arch.clone(), settings.seed, DType::F32)
        .map_err(|e| fail(Box::new(e)))?;
    // The PyTorch twin computes a tied head's whole logits (`F.cross_entropy(h @ wte.T, y)`):
    // so does vram here, so that the two sides run the same computation.
    model.set_fused_loss(false);
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    // A PyTorch side from an earlier run would be compared with this one's.
    for file in std::iter::once("torch.json".to_string())
        .chain(TORCH_RECIPES.iter().map(|r| format!("torch-{r}.json")))
    {
        let stale = dir.join(file);
        if stale.exists() {
            std::fs::remove_file(&stale).map_err(io(&stale))?;
        }
    }
    let (params, input) = export(&model, &batch, seq, dir).map_err(|e| match e {
        Exported::Io(e) => e,
        Exported::Kernel(e) => fail(Box::new(e)),
    })?;

    let measured = train(device, &mut model, &batch, settings).map_err(fail)?;
    drop(model);
    let autocast_bf16 = if settings.autocast_bf16 {
        let quiet = TwinSettings { profile: false, ..settings.clone() };
        let channels_last = autocast_channels_last(device, &arch);
        let opts = ModelOptions::default().with_channels_last(channels_last);
        let run = Model::with_options(device, arch.clone(), settings.seed, DType::F32, opts)
            .and_then(|mut m| m.set_autocast(Some(DType::BF16)).map(|()| m))
            .map_err(|e| fail(Box::new(e)))
            .and_then(|mut m| train(device, &mut m, &batch, &quiet).map_err(fail))?;
        Some(RecipeRun {
            losses: run.losses,
            step_ms: run.step_ms,
            peak_allocated: run.peak_allocated,
            peak_reserved: run.peak_reserved,
            channels_last,
        })
    } else {
        None
    };
    // The same run on a virtual device of the same capacity and cuBLAS workspace: the
    // prediction `cargo xtask plan` would make, which must equal the measurement to the byte.
    let virt = Device::virtual_device(device.mem_info().total);
    virt.set_blas_workspace_size(device.blas_workspace_size());
    // On a GPU with cuDNN the prediction replays the choices cuDNN made in the runs above
    // (their workspaces only cuDNN can size), and the record is kept beside the export for
    // `cargo xtask plan --cudnn-choices`.
    if let Some(record) = device.cudnn_choices() {
        let path = dir.join(CUDNN_CHOICES);
        let text = serde_json::to_string_pretty(&record).map_err(|e| fail(Box::new(e)))?;
        std::fs::write(&path, text).map_err(io(&path))?;
        virt.set_cudnn_choices(Some(record)).map_err(|e| fail(Box::new(e)))?;
    }
    let predicted = Model::new(&virt, arch, settings.seed, DType::F32)
        .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
        .and_then(|mut m| {
            m.set_fused_loss(false);
            train(&virt, &mut m, &batch, &TwinSettings { profile: false, ..settings.clone() })
        })
        .map_err(|source| TwinError::Run {
            model: name.to_string(),
            device: virt.name(),
            source,
        })?;
    let info = device.mem_info();
    let run = VramRun {
        backend: if device.is_cuda() { "cuda" } else { "cpu" }.into(),
        // Which path the convolutions and linear layers took (cuDNN and its version or the
        // own kernels; cuBLASLt or cuBLAS), and how many products cuBLASLt did not run.
        device: format!(
            "{}, {}{}",
            device.name(),
            crate::backend::kernel_paths(device),
            lt_fallbacks(device.cublaslt_fallbacks())
        ),
        param_count: measured.param_count,
        losses: measured.losses,
        step_ms: measured.step_ms,
        weights_bytes: measured.weights_bytes,
        peak_allocated: measured.peak_allocated,
        peak_reserved: measured.peak_reserved,
        device_used: device.is_cuda().then(|| info.total.saturating_sub(info.free)),
        predicted_peak_allocated: Some(predicted.peak_allocated),
        predicted_peak_reserved: Some(predicted.peak_reserved),
        kept_for_backward: Some(measured.kept_for_backward),
        tracked_peak: Some(measured.tracked_peak),
        profile: measured.profile,
        autocast_bf16,
    };
    let targets = json!({"shape": [batch.targets.len()], "file": "targets.u32"});
    let twin = json!({
        "format": FORMAT,
        "model": name,
        "arch": arch_value,
        "params": params,
        "weights": "weights.f32",
        "input": input,
        "targets": targets,
        "optimizer": {
            "kind": "adamw", "lr": settings.lr, "betas": [0.9, 0.999], "eps": 1e-8,
            "weight_decay": 0.01,
        },
        "steps": settings.steps,
        "profile": settings.profile,
        "vram": run,
    });
    let path = dir.join("twin.json");
    let text = serde_json::to_string_pretty(&twin).expect("a JSON value serializes");
    std::fs::write(&path, text + "\n").map_err(io(&path))?;
    Ok(run)
}

/// The device line's note of the products cuBLASLt did not run (each ran the unfused
/// cuBLAS path instead): nothing when there were none.
fn lt_fallbacks(n: u64) -> String {
    match n {
        0 => String::new(),
        1 => "; 1 product ran unfused (no cuBLASLt algorithm, or its call failed)".into(),
        n => format!("; {n} products ran unfused (no cuBLASLt algorithm, or its call failed)"),
    }
}

/// What [`train`] measured.
struct Trained {
    param_count: u64,
    losses: Vec<f32>,
    step_ms: Vec<f64>,
    weights_bytes: u64,
    peak_allocated: u64,
    peak_reserved: u64,
    kept_for_backward: u64,
    tracked_peak: u64,
    profile: Option<StepProfile>,
}

/// The twin's steps on `device`: peaks reset once the model and the batch are there, then
/// per step forward, loss, backward, AdamW step and gradients set to none, timed between
/// two synchronizations. After the steps (and their peaks), one more forward measures what
/// it keeps for backward.
fn train(
    device: &Device,
    model: &mut Model,
    batch: &Batch,
    settings: &TwinSettings,
) -> Result<Trained, Box<dyn std::error::Error + Send + Sync>> {
    let mut opt = adamw(settings.lr);
    device.synchronize()?;
    device.reset_peak_stats();
    let weights_bytes = device.memory_allocated();
    let (mut losses, mut step_ms) = (Vec::new(), Vec::new());
    let mut step = |step: usize| -> Result<f32, Box<dyn std::error::Error + Send + Sync>> {
        let mut ctx = ForwardCtx::new(Mode::Train, step as u64);
        let out = model.train_step(batch, &mut ctx, 1.0)?;
        opt.step(model)?;
        model.zero_grad();
        device.synchronize()?;
        Ok(out.loss)
    };
    for i in 0..settings.steps {
        let start = Instant::now();
        losses.push(step(i)?);
        step_ms.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let (peak_allocated, peak_reserved) =
        (device.max_memory_allocated(), device.max_memory_reserved());
    // Requested bytes, not the allocator's blocks: a block handed out whole (its remainder
    // too small to split) carries slack that depends on what was cached, not on what the
    // model holds.
    let requested = || device.memory_stats().requested_bytes;
    device.reset_peak_stats();
    for i in 0..TRACKED_STEPS {
        step(settings.steps + i)?;
    }
    let tracked_peak = u64::try_from(requested().all.peak).unwrap_or(0);
    // After the peaks are read: a profiled step synchronizes around every op.
    let profile = if settings.profile {
        device.start_op_profile();
        let start = Instant::now();
        let stepped = step(settings.steps + TRACKED_STEPS);
        let step_ms = start.elapsed().as_secs_f64() * 1e3;
        let ops = device.stop_op_profile();
        stepped?;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        Some(StepProfile {
            step_ms,
            total_ms: ops.iter().map(|o| ms(o.total)).sum(),
            time: "ops, each between two synchronizations".into(),
            ops: ops
                .iter()
                .map(|o| ProfiledOp { name: o.name.into(), calls: o.calls, ms: ms(o.total) })
                .collect(),
        })
    } else {
        None
    };
    let before = requested().all.current;
    let (_, graph) = model.forward_graph(batch, settings.seed)?;
    let kept_for_backward = u64::try_from(requested().all.current - before).unwrap_or(0);
    drop(graph);
    Ok(Trained {
        param_count: model.param_count(),
        losses,
        step_ms,
        weights_bytes,
        peak_allocated,
        peak_reserved,
        kept_for_backward,
        tracked_peak,
        profile,
    })
}

enum Exported {
    Io(TwinError),
    Kernel(vram_kernels::Error),
}

/// Writes `weights.f32`, `input.*` and `targets.u32`; returns the parameter list and the
/// input's entry of `twin.json`.
fn export(
    model: &Model,
    batch: &Batch,
    seq: Option<usize>,
    dir: &Path,
) -> Result<(Vec<Value>, Value), Exported> {
    let mut params = Vec::new();
    let mut weights: Vec<f32> = Vec::with_capacity(model.param_count() as usize);
    for p in model.params() {
        params.push(json!({"name": p.name, "shape": p.value.shape(), "offset": weights.len()}));
        weights.extend(p.value.to_f32_vec().map_err(Exported::Kernel)?);
    }
    let le32 = |v: f32| v.to_le_bytes();
    write_le(&dir.join("weights.f32"), &weights, le32).map_err(Exported::Io)?;
    let input = match &batch.input {
        Input::Dense { values, shape } => {
            write_le(&dir.join("input.f32"), values, le32).map_err(Exported::Io)?;
            json!({"kind": "dense", "shape": shape, "file": "input.f32"})
        }
        Input::Tokens(ids) => {
            write_le(&dir.join("input.u32"), ids, u32::to_le_bytes).map_err(Exported::Io)?;
            let s = seq.unwrap_or(ids.len()).max(1);
            json!({"kind": "tokens", "shape": [ids.len() / s, s], "file": "input.u32"})
        }
        Input::Shape(_) => {
            return Err(Exported::Io(TwinError::Model(
                "the batch has no values (drawn for a virtual device)".into(),
            )));
        }
    };
    write_le(&dir.join("targets.u32"), &batch.targets, u32::to_le_bytes).map_err(Exported::Io)?;
    Ok((params, input))
}

/// One model's two runs, read back from its folder.
#[derive(Clone, Debug)]
pub struct Comparison {
    /// The preset's name.
    pub model: String,
    /// Samples per batch.
    pub batch: usize,
    /// vram's run.
    pub vram: VramRun,
    /// PyTorch's run, or why there is none.
    pub torch: Result<TorchRun, String>,
    /// PyTorch's recipes that ran (`torch-<recipe>.json`), in [`TORCH_RECIPES`]' order.
    pub recipes: Vec<TorchRun>,
}

impl Comparison {
    /// The largest difference between the two sides' losses over the steps, relative to
    /// the larger of 1 and PyTorch's loss; `None` without a PyTorch run or with different
    /// step counts.
    pub fn loss_difference(&self) -> Option<f64> {
        let torch = self.torch.as_ref().ok()?;
        if torch.losses.len() != self.vram.losses.len() {
            return None;
        }
        let diff =
            |(a, b): (&f32, &f32)| (*a as f64 - *b as f64).abs() / (*b as f64).abs().max(1.0);
        Some(self.vram.losses.iter().zip(&torch.losses).map(diff).fold(0.0, f64::max))
    }

    /// vram's peak allocated over PyTorch's (both on CUDA).
    pub fn allocated_ratio(&self) -> Option<f64> {
        let t = self.torch.as_ref().ok()?.peak_allocated?;
        (self.vram.backend == "cuda" && t > 0).then(|| self.vram.peak_allocated as f64 / t as f64)
    }

    /// vram's median steady step time (every step after the first) over PyTorch's, on the
    /// same kind of device.
    pub fn time_ratio(&self) -> Option<f64> {
        let t = self.torch.as_ref().ok()?;
        if t.backend != self.vram.backend {
            return None;
        }
        Some(steady_median(&self.vram.step_ms)? / steady_median(&t.step_ms)?)
    }
}

/// The median of every step's time after the first (which creates the optimizer state and
/// warms caches).
pub fn steady_median(step_ms: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = step_ms.iter().skip(1).copied().filter(|t| t.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// Reads `dir/twin.json` and, if PyTorch ran, `dir/torch.json`.
///
/// # Errors
///
/// A missing or malformed `twin.json` (a malformed `torch.json` is reported as the
/// PyTorch side's absence, with the reason).
pub fn compare(dir: &Path) -> Result<Comparison, TwinError> {
    let path = dir.join("twin.json");
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    let malformed = |reason: String| TwinError::Io { path: path.clone(), reason };
    let twin: Value = serde_json::from_str(&text).map_err(|e| malformed(e.to_string()))?;
    let model = twin["model"].as_str().ok_or_else(|| malformed("no `model`".into()))?.to_string();
    let batch =
        twin["input"]["shape"][0].as_u64().ok_or_else(|| malformed("no `input.shape`".into()))?;
    let vram: VramRun = serde_json::from_value(twin["vram"].clone())
        .map_err(|e| malformed(format!("`vram`: {e}")))?;
    let torch_path = dir.join("torch.json");
    let torch = match std::fs::read_to_string(&torch_path) {
        Ok(text) => serde_json::from_str::<TorchRun>(&text)
            .map_err(|e| format!("{} is malformed: {e}", torch_path.display())),
        Err(e) => Err(format!("no PyTorch run ({}: {e})", torch_path.display())),
    };
    let mut recipes = Vec::new();
    for recipe in TORCH_RECIPES {
        let path = dir.join(format!("torch-{recipe}.json"));
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        let mut run: TorchRun = serde_json::from_str(&text)
            .map_err(|e| TwinError::Io { path: path.clone(), reason: format!("malformed: {e}") })?;
        run.recipe.get_or_insert_with(|| recipe.to_string());
        recipes.push(run);
    }
    Ok(Comparison { model, batch: batch as usize, vram, torch, recipes })
}

fn ratio(r: Option<f64>) -> String {
    r.map_or("-".into(), |r| format!("{r:.2}x"))
}

fn bytes(b: Option<u64>) -> String {
    b.map_or("-".into(), human_bytes)
}

fn ms(t: Option<f64>) -> String {
    match t {
        None => "-".into(),
        Some(t) if t < 1.0 => format!("{t:.3}"),
        Some(t) => format!("{t:.1}"),
    }
}

/// vram's bytes over PyTorch's, when both are there.
fn bytes_ratio((vram, torch): (Option<u64>, Option<u64>)) -> Option<f64> {
    let (v, t) = (vram?, torch?);
    (t > 0).then(|| v as f64 / t as f64)
}

/// A section of the report comparing one byte figure per model, `(vram, PyTorch)` from
/// `pick`: the heading and table head, a row per model where both sides have the figure, and
/// how many models have vram's at most PyTorch's. Nothing when no model has both.
fn bytes_table(
    s: &mut String,
    rows: &[Comparison],
    head: &str,
    pick: impl Fn(&Comparison) -> (Option<u64>, Option<u64>),
    verdict: &str,
) {
    let both: Vec<(&Comparison, f64)> =
        rows.iter().filter_map(|r| Some((r, bytes_ratio(pick(r))?))).collect();
    if both.is_empty() {
        return;
    }
    s.push_str(head);
    for (r, x) in &both {
        let (v, t) = pick(r);
        let _ = writeln!(s, "| {} | {} | {} | {} |", r.model, bytes(v), bytes(t), ratio(Some(*x)));
    }
    let held = both.iter().filter(|(_, x)| *x <= 1.0).count();
    let _ = writeln!(s, "\n{verdict} for {held} of {} models.", both.len());
}

/// TWIN.md's "against PyTorch as its users run it": per model and PyTorch recipe that ran,
/// PyTorch's peaks and step beside vram's run of the same precision (f32 for `defaults`,
/// bf16 autocast for the others), and the ratios. Nothing when no recipe ran.
fn recipes(s: &mut String, rows: &[Comparison]) {
    if rows.iter().all(|r| r.recipes.is_empty()) {
        return;
    }
    s.push_str(
        "\n## Against PyTorch as its users run it\n\n\
         PyTorch's recipes (`torch_twin.py --recipe`): `defaults` is f32 with the TF32 switches \
         as PyTorch ships them and `F.scaled_dot_product_attention`; `bf16-autocast` adds \
         `torch.autocast(bfloat16)`, `AdamW(fused=True)` and channels_last for CNNs; `compile` \
         adds `torch.compile` (its compiling steps are warm-ups, outside the timed steps and \
         the peaks), a reference row. vram's side: its f32 run for `defaults`, its bf16 \
         autocast run (f32 weights, 16-bit matmuls; channels_last for CNNs where cuDNN runs \
         the convolutions) for the others. Ratios are vram over \
         PyTorch: below 1 is vram using less.\n\n\
         | model | PyTorch recipe | PyTorch peak allocated | PyTorch peak reserved | PyTorch \
         step | vram run | vram peak allocated | vram step | allocated ratio | time ratio |\n\
         |---|---|---:|---:|---:|---|---:|---:|---:|---:|\n",
    );
    for r in rows {
        for t in &r.recipes {
            let recipe = t.recipe.as_deref().unwrap_or("?");
            let (label, alloc, steps) = if recipe_is_autocast(recipe) {
                match &r.vram.autocast_bf16 {
                    Some(a) => (a.label(), Some(a.peak_allocated), Some(&a.step_ms)),
                    None => ("bf16 autocast (not run)", None, None),
                }
            } else {
                ("f32", Some(r.vram.peak_allocated), Some(&r.vram.step_ms))
            };
            let vram_step = steps.and_then(|v| steady_median(v));
            let torch_step = steady_median(&t.step_ms);
            let same_device = t.backend == r.vram.backend;
            let alloc_ratio = (same_device && r.vram.backend == "cuda")
                .then(|| bytes_ratio((alloc, t.peak_allocated)))
                .flatten();
            let time_ratio = match (vram_step, torch_step) {
                (Some(v), Some(t)) if same_device && t > 0.0 => Some(v / t),
                _ => None,
            };
            let _ = writeln!(
                s,
                "| {} | {recipe} | {} | {} | {} | {label} | {} | {} | {} | {} |",
                r.model,
                bytes(t.peak_allocated),
                bytes(t.peak_reserved),
                ms(torch_step),
                bytes(alloc),
                ms(vram_step),
                ratio(alloc_ratio),
                ratio(time_ratio),
            );
        }
    }
}

/// A run's name, steady step (ms) and peak allocated, for "best against best".
type Best<'a> = (&'a str, f64, Option<u64>);

/// vram's fastest run of a model (its steady median step): f32 or bf16 autocast.
fn vram_best(r: &Comparison) -> Option<Best<'_>> {
    let f32_run = steady_median(&r.vram.step_ms).map(|t| ("f32", t, Some(r.vram.peak_allocated)));
    let auto =
        r.vram.autocast_bf16.as_ref().and_then(|a| {
            steady_median(&a.step_ms).map(|t| (a.label(), t, Some(a.peak_allocated)))
        });
    [f32_run, auto].into_iter().flatten().min_by(|a, b| a.1.total_cmp(&b.1))
}

/// PyTorch's fastest eager recipe (`defaults` or `bf16-autocast`; never `match`, which turns
/// TF32 off to follow vram's math, nor `compile`, the reference row).
fn torch_best_eager(r: &Comparison) -> Option<Best<'_>> {
    r.recipes
        .iter()
        .filter(|t| t.backend == r.vram.backend)
        .filter_map(|t| {
            let recipe = t.recipe.as_deref()?;
            (recipe != "compile").then_some(())?;
            Some((recipe, steady_median(&t.step_ms)?, t.peak_allocated))
        })
        .min_by(|a, b| a.1.total_cmp(&b.1))
}

/// TWIN.md's "best against best": per model, vram's fastest run against PyTorch's fastest
/// eager recipe on the same kind of device, with `torch.compile`'s step as a reference
/// column, and how many models vram's best step is at most PyTorch's best eager one. On
/// the host the section says its times are host figures and decides nothing.
fn best_against_best(s: &mut String, rows: &[Comparison]) {
    let pairs: Vec<(&Comparison, Best<'_>, Best<'_>)> =
        rows.iter().filter_map(|r| Some((r, vram_best(r)?, torch_best_eager(r)?))).collect();
    if pairs.is_empty() {
        return;
    }
    s.push_str(
        "\n## Best against best: vram's fastest recipe against PyTorch's fastest eager one\n\n\
         Per model, the faster of vram's f32 and bf16 autocast runs against the faster of \
         PyTorch's `defaults` and `bf16-autocast` recipes (`torch.compile` as a reference \
         column, not a goal). Ratios are vram over PyTorch.\n\n\
         | model | vram's best | step | peak allocated | PyTorch's best eager | step | peak \
         allocated | time ratio | allocated ratio | `torch.compile` step | ratio to compile |\n\
         |---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut held = 0;
    let cuda = pairs.iter().all(|(r, ..)| r.vram.backend == "cuda");
    for (r, (vname, vt, va), (tname, tt, ta)) in &pairs {
        let compile = r
            .recipes
            .iter()
            .filter(|t| t.backend == r.vram.backend && t.recipe.as_deref() == Some("compile"))
            .find_map(|t| steady_median(&t.step_ms));
        let alloc_ratio = (r.vram.backend == "cuda").then(|| bytes_ratio((*va, *ta))).flatten();
        let time_ratio = (*tt > 0.0).then(|| vt / tt);
        held += usize::from(time_ratio.is_some_and(|x| x <= 1.0));
        let _ = writeln!(
            s,
            "| {} | {vname} | {} | {} | {tname} | {} | {} | {} | {} | {} | {} |",
            r.model,
            ms(Some(*vt)),
            bytes(*va),
            ms(Some(*tt)),
            bytes(*ta),
            ratio(time_ratio),
            ratio(alloc_ratio),
            ms(compile),
            ratio(compile.filter(|c| *c > 0.0).map(|c| vt / c)),
        );
    }
    if cuda {
        let _ = writeln!(
            s,
            "\nvram's best step is at most PyTorch's best eager step for {held} of {} models.",
            pairs.len()
        );
    } else {
        s.push_str(
            "\nHost figures (vram's CPU backend against PyTorch's CPU build): no verdict on GPU \
             speed is drawn from them.\n",
        );
    }
}

/// The twin's report (Markdown): one row per model with both sides' peaks, step times and
/// the largest loss difference, then the goal (vram's peak allocated at most PyTorch's) and
/// the notes.
pub fn report(rows: &[Comparison], settings: &TwinSettings) -> String {
    let mut s = String::from("# vram vs PyTorch: the same models, weights and batch\n\n");
    let vram_dev = rows.first().map(|r| r.vram.device.clone());
    let host = rows.iter().any(|r| r.vram.backend != "cuda");
    let torch = rows.iter().find_map(|r| r.torch.as_ref().ok());
    let _ = writeln!(s, "- vram: {}", vram_dev.unwrap_or_else(|| "-".into()));
    match torch {
        Some(t) => {
            let _ = writeln!(s, "- PyTorch {}: {} ({})", t.torch, t.device, t.backend);
        }
        None => s.push_str("- PyTorch: did not run (see the rows)\n"),
    }
    let _ = writeln!(
        s,
        "- {} AdamW steps (lr {}, PyTorch's other defaults), f32, dropout {}, fused attention \
         in every transformer (vram's; PyTorch's F.scaled_dot_product_attention in the match \
         recipe); peaks over the steps, reset once model, batch and optimizer were on the \
         device; step time the median of the steps after the first, in ms\n",
        settings.steps, settings.lr, settings.dropout
    );
    if host {
        s.pop();
        s.push_str(
            "- step times on the host are host figures (vram's CPU backend against PyTorch's \
             CPU build): they say nothing about GPU speed\n\n",
        );
    }
    s.push_str(
        "- losses: f32 on both sides, summed in different orders, so they agree to a few \
         ulps at first; a value at rounding level on either side of a ReLU can then flip, \
         and AdamW's first steps (each weight moves by about lr, whatever its gradient's \
         size) amplify that: at batch 4 on the host, ResNet-50's first losses agree to 2e-6 \
         and its third differ by 5e-2, the order by which PyTorch's own f32 and f64 runs \
         differ there (2.7e-2)\n\n",
    );
    s.push_str(
        "| model | batch | params | vram peak allocated | PyTorch peak allocated | ratio | vram peak \
         reserved | PyTorch peak reserved | vram device used | vram step | PyTorch step | \
         time ratio | largest loss difference |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let t = r.torch.as_ref().ok();
        let params = match t {
            Some(t) if t.param_count != r.vram.param_count => {
                format!("{} (PyTorch {})", r.vram.param_count, t.param_count)
            }
            _ => r.vram.param_count.to_string(),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {params} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.model,
            r.batch,
            human_bytes(r.vram.peak_allocated),
            bytes(t.and_then(|t| t.peak_allocated)),
            ratio(r.allocated_ratio()),
            human_bytes(r.vram.peak_reserved),
            bytes(t.and_then(|t| t.peak_reserved)),
            bytes(r.vram.device_used),
            ms(steady_median(&r.vram.step_ms)),
            ms(t.and_then(|t| steady_median(&t.step_ms))),
            ratio(r.time_ratio()),
            r.loss_difference().map_or("-".into(), |d| format!("{d:.1e}")),
        );
    }
    let compared: Vec<&Comparison> =
        rows.iter().filter(|r| r.allocated_ratio().is_some()).collect();
    s.push_str("\n## Goal: vram's peak allocated <= 1.0x PyTorch's\n\n");
    if compared.is_empty() {
        s.push_str(
            "Not measured: both sides must run on CUDA (PyTorch's peaks come from its CUDA \
             caching allocator).\n",
        );
    } else {
        let held: Vec<&str> = compared
            .iter()
            .filter(|r| r.allocated_ratio().is_some_and(|x| x <= 1.0))
            .map(|r| r.model.as_str())
            .collect();
        let _ = writeln!(
            s,
            "Holds for {} of {} models: {}.",
            held.len(),
            compared.len(),
            held.join(", ")
        );
    }
    recipes(&mut s, rows);
    best_against_best(&mut s, rows);
    bytes_table(
        &mut s,
        rows,
        "\n## Kept for backward: what the forward and the loss leave for backward\n\n\
         vram: bytes requested from its allocator while it holds the layers' saved state and \
         the logits; PyTorch: the bytes of the distinct storages autograd saved \
         (`saved_tensors_hooks`); both before the allocator's rounding, neither counts \
         parameters or buffers. One forward after the steps. The part of the peak that what \
         each op saves decides, measurable on any device: a ratio above 1 is a model where \
         vram keeps more than PyTorch.\n\n\
         | model | vram kept | PyTorch saved | ratio |\n|---|---:|---:|---:|\n",
        |r| (r.vram.kept_for_backward, r.torch.as_ref().ok().and_then(|t| t.saved_for_backward)),
        "vram keeps at most PyTorch's bytes",
    );
    bytes_table(
        &mut s,
        rows,
        &format!(
            "\n## Peak at the tensor level: vram's requested bytes against PyTorch's MemTracker\n\n\
             Over {TRACKED_STEPS} more steps after the timed ones, the peak of what each side \
             asked its allocator for (parameters, gradients, AdamW state, activations, \
             temporaries, the batch), before rounding; PyTorch's side from \
             `torch.distributed._tools.mem_tracker.MemTracker`, which does not see workspaces \
             a kernel allocates inside itself (oneDNN's on the host), while vram's figure \
             includes its kernels' workspaces (a large convolution's im2col buffers: up to 9x \
             a 3x3 convolution's input; small ones run direct, without), allocated on every \
             backend as on the GPU. The host's \
             stand-in for the goal above; on CUDA both peaks add the allocator's rounding and \
             slack, and PyTorch's adds cuDNN's and cuBLAS's workspaces.\n\n\
             | model | vram peak requested | PyTorch tracked peak | ratio |\n|---|---:|---:|---:|\n"
        ),
        |r| (r.vram.tracked_peak, r.torch.as_ref().ok().and_then(|t| t.tracked_peak)),
        "vram's peak is at most PyTorch's",
    );
    s.push_str(
        "\n## The virtual device's prediction (`cargo xtask plan`) against vram's measurement\n\n\
         The same steps on a virtual device of the same capacity and cuBLAS workspace, which \
         allocates without computing. It models vram's own convolution kernels: where the \
         convolutions ran through cuDNN (see the device line), a convolutional model's peak \
         differs by cuDNN's workspaces against the own kernels' buffers.\n\n\
         | model | predicted peak allocated | measured | predicted peak reserved | measured | \
         to the byte |\n|---|---:|---:|---:|---:|---|\n",
    );
    for r in rows {
        let v = &r.vram;
        let exact = match (v.predicted_peak_allocated, v.predicted_peak_reserved) {
            (Some(a), Some(b)) if a == v.peak_allocated && b == v.peak_reserved => "yes".into(),
            (Some(a), Some(b)) => format!(
                "no: allocated {:+} B, reserved {:+} B",
                v.peak_allocated as i128 - a as i128,
                v.peak_reserved as i128 - b as i128
            ),
            _ => "-".into(),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {exact} |",
            r.model,
            bytes(v.predicted_peak_allocated),
            human_bytes(v.peak_allocated),
            bytes(v.predicted_peak_reserved),
            human_bytes(v.peak_reserved),
        );
    }
    profiles(&mut s, rows);
    let skipped: Vec<String> = rows
        .iter()
        .filter_map(|r| r.torch.as_ref().err().map(|e| format!("- {}: {e}", r.model)))
        .collect();
    if !skipped.is_empty() {
        s.push_str("\n## Without a PyTorch run\n\n");
        s.push_str(&skipped.join("\n"));
        s.push('\n');
    }
    if let Some(t) = torch.filter(|t| !t.notes.is_empty()) {
        s.push_str("\n## Notes (PyTorch side)\n\n");
        for n in &t.notes {
            let _ = writeln!(s, "- {n}");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::lt_fallbacks;

    #[test]
    fn the_device_line_counts_cublaslt_fallbacks_only_when_there_are_some() {
        assert_eq!(lt_fallbacks(0), "");
        assert!(lt_fallbacks(1).starts_with("; 1 product ran unfused"));
        assert!(lt_fallbacks(12).starts_with("; 12 products ran unfused"));
    }
}

//! `cargo xtask twin`: the reference models trained by vram and by PyTorch
//! (`xtask/twin/torch_twin.py`) from the same weights on the same batch, side by side.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use vram_harness::models::{Arch, HfModel};
use vram_harness::twin::{self, TwinSettings};
use vram_kernels::Device;

use crate::BackendArg;

/// The batch of a model not in [`GPU_BATCH`] (the small ones, GPT-2 small).
const DEFAULT_BATCH: usize = 8;
/// The presets that run at another batch than [`DEFAULT_BATCH`] by default.
const GPU_BATCH: &[(&str, usize)] =
    &[("gpt2-medium", 4), ("resnet50", 64), ("mobilenetv3-like", 64), ("vit-b-like", 64)];

/// The batch `name` runs at unless `--batch` says otherwise.
fn default_batch(name: &str) -> usize {
    GPU_BATCH.iter().find(|(n, _)| *n == name).map_or(DEFAULT_BATCH, |(_, b)| *b)
}

/// The presets run by default: the small ones, and with CUDA the real-size ones too, in the
/// zoo's order.
fn default_models(cuda: bool) -> Vec<&'static str> {
    Arch::presets().iter().filter(|p| cuda || !p.real_size).map(|p| p.name).collect()
}

/// `--models`' help: the zoo's presets, small and real-size.
fn models_help() -> String {
    let real: Vec<&str> = Arch::presets().iter().filter(|p| p.real_size).map(|p| p.name).collect();
    format!(
        "Models, comma-separated (presets of `cargo xtask plan --help`). Default: the small \
         ones ({}), and on CUDA also {}",
        default_models(false).join(", "),
        real.join(", ")
    )
}

/// `--batch`'s help: the default batches.
fn batch_help() -> String {
    let mut by_batch: Vec<(usize, Vec<&str>)> = Vec::new();
    for p in Arch::presets().iter().filter(|p| p.real_size) {
        let b = default_batch(p.name);
        match by_batch.iter_mut().find(|(batch, _)| *batch == b) {
            Some((_, names)) => names.push(p.name),
            None => by_batch.push((b, vec![p.name])),
        }
    }
    let real: Vec<String> =
        by_batch.iter().map(|(b, names)| format!("{b} for {}", names.join(", "))).collect();
    format!(
        "Samples per batch for every model. Default: {DEFAULT_BATCH} for the small models; on \
         CUDA {}",
        real.join("; ")
    )
}

/// Arguments of `cargo xtask twin`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Each model's folder under --out gets vram's export (twin.json, weights.f32, input.*, \
targets.u32) and, when PyTorch is installed, torch.json; <out>/TWIN.md puts both sides side \
by side. On a GPU machine, in one command:
    cargo xtask twin --backend cuda --out results/twin

Exit status: 0 when every model ran on both sides (or PyTorch is absent), 1 when a model \
failed on either side, 2 for bad arguments.")]
pub struct TwinArgs {
    #[arg(long, value_name = "NAME,...", help = models_help())]
    models: Option<String>,
    /// A Hugging Face config.json (model_type gpt2, llama, mistral or qwen2; see models/hf/),
    /// run instead of the default models (besides --models when given); batch 1 unless
    /// --batch.
    #[arg(long, value_name = "FILE")]
    hf_config: Option<PathBuf>,
    /// Sequence length of the --hf-config model (default: the config's, at most 4096).
    #[arg(long, value_name = "N", requires = "hf_config")]
    seq: Option<usize>,
    #[arg(long, value_name = "N", help = batch_help())]
    batch: Option<usize>,
    /// AdamW steps per model (at least 2).
    #[arg(long, default_value_t = 5, value_name = "N")]
    steps: usize,
    /// Dropout of GPT and ViT; 0 (the default) lets the losses be compared step for step.
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    dropout: f32,
    /// Seed of the weights and the batch.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where vram runs; PyTorch runs on the same kind of device.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Capacity of the host backend's simulated device, e.g. 16GiB.
    #[arg(long, default_value = "16GiB", value_name = "SIZE")]
    device_memory: String,
    /// Output folder: one folder per model and TWIN.md.
    #[arg(long, default_value = "results/twin", value_name = "DIR")]
    out: PathBuf,
    /// The Python interpreter that has PyTorch.
    #[arg(long, default_value = "python3", value_name = "PATH")]
    python: PathBuf,
    /// The twin script. Default: xtask/twin/torch_twin.py under the current folder, else
    /// in the source tree this binary was built from.
    #[arg(long, value_name = "PATH")]
    script: Option<PathBuf>,
    /// Run vram's side only (export and measure).
    #[arg(long)]
    no_torch: bool,
    /// Profile one more step on each side (vram per op, PyTorch with torch.profiler) and
    /// add "where the time goes" to TWIN.md.
    #[arg(long)]
    profile: bool,
    /// PyTorch's recipes as users run them, beside the matching run, comma-separated:
    /// `defaults` (f32, TF32 as shipped, SDPA), `bf16-autocast` (with fused AdamW and
    /// channels_last), `compile` (bf16-autocast under torch.compile), or `none`; vram runs
    /// its bf16 autocast recipe too when one of the last two is asked (channels_last for
    /// CNNs where cuDNN runs the convolutions). Default: all three
    /// on CUDA, none on the host (PyTorch's CPU build has no peaks to compare).
    #[arg(long, value_name = "LIST")]
    recipes: Option<String>,
}

/// The PyTorch recipes to run besides the matching one.
fn recipes(args: &TwinArgs, cuda: bool) -> Result<Vec<&'static str>, String> {
    let Some(text) = &args.recipes else {
        return Ok(if cuda { twin::TORCH_RECIPES.to_vec() } else { Vec::new() });
    };
    if text.trim() == "none" {
        return Ok(Vec::new());
    }
    let mut list = Vec::new();
    for name in text.split(',').map(str::trim) {
        let Some(r) = twin::TORCH_RECIPES.iter().find(|r| **r == name) else {
            return Err(format!(
                "--recipes: unknown recipe `{name}` (known: {}, or none)",
                twin::TORCH_RECIPES.join(", ")
            ));
        };
        if list.contains(r) {
            return Err(format!("--recipes: `{name}` is given twice"));
        }
        list.push(*r);
    }
    Ok(list)
}

fn script(args: &TwinArgs) -> PathBuf {
    if let Some(s) = &args.script {
        return s.clone();
    }
    let here = Path::new("xtask/twin/torch_twin.py");
    if here.exists() {
        return here.to_path_buf();
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("twin/torch_twin.py")
}

/// The models and their batches.
/// The models to run: name, batch, and the architecture of a `--hf-config` model (the
/// presets are looked up by name).
type ModelList = Vec<(String, usize, Option<Arch>)>;

fn models(args: &TwinArgs, cuda: bool) -> Result<ModelList, String> {
    let hf = match &args.hf_config {
        Some(path) => {
            let m = HfModel::from_path(path).map_err(|e| format!("--hf-config: {e}"))?;
            eprintln!(
                "{}: model_type {}, {} parameters (Hugging Face's count); {}",
                path.display(),
                m.model_type,
                m.param_count(),
                m.ignored_line()
            );
            for note in &m.notes {
                eprintln!("  note: {note}");
            }
            let arch = match args.seq {
                Some(seq) => m.arch.with_seq(seq).map_err(|e| format!("--seq: {e}"))?,
                None => m.arch,
            };
            Some((m.name, 1, Some(arch)))
        }
        None => None,
    };
    let named: Vec<(String, usize)> = match (&args.models, &hf) {
        (None, Some(_)) => Vec::new(),
        _ => preset_models(args, cuda)?,
    };
    let mut list: ModelList = named.into_iter().map(|(n, b)| (n, b, None)).collect();
    list.extend(hf);
    if let Some(b) = args.batch {
        list.iter_mut().for_each(|(_, batch, _)| *batch = b);
    }
    Ok(list)
}

fn preset_models(args: &TwinArgs, cuda: bool) -> Result<Vec<(String, usize)>, String> {
    let list: Vec<(String, usize)> = match &args.models {
        Some(text) => {
            let mut list = Vec::new();
            for name in text.split(',').map(str::trim) {
                if name.is_empty() {
                    return Err(format!("--models `{text}`: an empty name"));
                }
                Arch::preset(name).map_err(|e| format!("--models: {e}"))?;
                if list.iter().any(|(n, _)| n == name) {
                    return Err(format!("--models: `{name}` is given twice"));
                }
                list.push((name.to_string(), default_batch(name)));
            }
            list
        }
        None => {
            default_models(cuda).into_iter().map(|n| (n.to_string(), default_batch(n))).collect()
        }
    };
    Ok(list)
}

/// Runs the command; `Err` is a message for a usage error (exit status 2).
pub fn run(args: TwinArgs) -> Result<ExitCode, String> {
    let common = TwinSettings {
        batch: args.batch.unwrap_or(1),
        steps: args.steps,
        dropout: args.dropout,
        seed: args.seed,
        profile: args.profile,
        ..TwinSettings::default()
    };
    common.validate().map_err(|e| format!("--{}", e.to_string().trim_start_matches("invalid ")))?;
    let capacity = vram_harness::parse_size(&args.device_memory)
        .map_err(|e| format!("--device-memory: {e}"))?;
    let cuda = match args.backend {
        BackendArg::Cpu => false,
        BackendArg::Cuda => {
            Device::cuda(0).map_err(|e| format!("--backend cuda: no usable CUDA device: {e}"))?;
            true
        }
        BackendArg::Auto => match Device::cuda(0) {
            Ok(_) => true,
            Err(e) => {
                eprintln!("note: no usable CUDA device ({e}); using the host backend");
                false
            }
        },
    };
    let models = models(&args, cuda)?;
    let recipes = recipes(&args, cuda)?;
    let common = TwinSettings { autocast_bf16: recipes.iter().any(|r| *r != "defaults"), ..common };
    let script = script(&args);
    if !args.no_torch && !script.exists() {
        return Err(format!("the twin script {} does not exist (--script)", script.display()));
    }
    std::fs::create_dir_all(&args.out).map_err(|e| format!("--out {}: {e}", args.out.display()))?;

    let mut failed = false;
    let mut rows = Vec::new();
    let path = args.out.join("TWIN.md");
    for (i, (name, batch, arch)) in models.iter().enumerate() {
        let model = (name.as_str(), *batch, arch);
        let (row, ok) = twin_model(&args, &script, model, &common, (cuda, capacity), &recipes);
        rows.extend(row);
        failed |= !ok;
        // After each model, what has run: a run stopped by a time limit keeps its table.
        let left: Vec<&str> = models[i + 1..].iter().map(|(n, _, _)| n.as_str()).collect();
        if !left.is_empty() {
            let text = format!(
                "{}\n**Partial**: still to run: {} (TWIN.md is rewritten after each model).\n",
                twin::report(&rows, &common),
                left.join(", ")
            );
            std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    let text = twin::report(&rows, &common);
    std::fs::write(&path, &text).map_err(|e| format!("{}: {e}", path.display()))?;
    println!("{text}\nwritten: {}", path.display());
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

/// One model of the twin: vram's run, PyTorch's recipes, the comparison: its row when there
/// is one, and whether every part succeeded (what failed is said on stderr).
fn twin_model(
    args: &TwinArgs,
    script: &Path,
    (name, batch, arch): (&str, usize, &Option<Arch>),
    common: &TwinSettings,
    (cuda, capacity): (bool, u64),
    recipes: &[&str],
) -> (Option<twin::Comparison>, bool) {
    let mut failed = false;
    let dir = args.out.join(name);
    let settings = TwinSettings { batch, ..common.clone() };
    let vram = {
        let device = if cuda { Device::cuda(0) } else { Ok(Device::host(capacity)) };
        device.map_err(|e| e.to_string()).and_then(|device| {
            match arch {
                Some(arch) => twin::run_vram_arch(&device, name, arch.clone(), &settings, &dir),
                None => twin::run_vram(&device, name, &settings, &dir),
            }
            .map_err(|e| e.to_string())
        })
    };
    let vram = match vram {
        Ok(v) => v,
        Err(e) => {
            eprintln!("{name}: vram failed: {e}");
            return (None, false);
        }
    };
    eprintln!(
        "{name} (batch {batch}): vram peak allocated {}, losses {:?}",
        vram_harness::human_bytes(vram.peak_allocated),
        vram.losses
    );
    if !args.no_torch {
        let device = if cuda { "cuda" } else { "cpu" };
        for recipe in std::iter::once("match").chain(recipes.iter().copied()) {
            let status = Command::new(&args.python)
                .arg(script)
                .arg(&dir)
                .args(["--device", device, "--recipe", recipe])
                .status();
            match status {
                Ok(s) if s.success() => {}
                Ok(s) if s.code() == Some(3) => break, // PyTorch absent: said on stderr
                Ok(s) => {
                    eprintln!("{name}: the PyTorch twin failed ({s}, recipe {recipe})");
                    failed = true;
                }
                Err(e) => {
                    eprintln!("{name}: cannot start {}: {e}", args.python.display());
                    failed = true;
                    break;
                }
            }
        }
    }
    match twin::compare(&dir) {
        Ok(row) => (Some(row), !failed),
        Err(e) => {
            eprintln!("{name}: {e}");
            (None, false)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_models_and_batches_come_from_the_zoo() {
        for (name, _) in GPU_BATCH {
            let p = Arch::presets().iter().find(|p| p.name == *name);
            assert!(p.is_some_and(|p| p.real_size), "`{name}` is no real-size preset");
        }
        let small = default_models(false);
        assert!(!small.is_empty());
        for p in Arch::presets() {
            assert_eq!(small.contains(&p.name), !p.real_size, "{}", p.name);
            assert!(default_models(true).contains(&p.name), "{}", p.name);
            assert!(models_help().contains(p.name), "{}", p.name);
            if p.real_size {
                let batch = format!("{} for ", default_batch(p.name));
                let help = batch_help();
                let at = help.find(&batch).unwrap_or_else(|| panic!("{help}"));
                assert!(help[at..].contains(p.name), "{}: {help}", p.name);
            }
        }
        assert_eq!((default_batch("gpt2-medium"), default_batch("mlp")), (4, DEFAULT_BATCH));
    }

    #[test]
    fn recipes_default_by_device_and_refuse_unknown_names() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            twin: TwinArgs,
        }
        let args = |extra: &[&str]| {
            Cli::try_parse_from(std::iter::once("twin").chain(extra.iter().copied()))
                .expect("parses")
                .twin
        };
        assert_eq!(recipes(&args(&[]), true).unwrap(), twin::TORCH_RECIPES);
        assert!(recipes(&args(&[]), false).unwrap().is_empty());
        assert!(recipes(&args(&["--recipes", "none"]), true).unwrap().is_empty());
        assert_eq!(recipes(&args(&["--recipes", "compile"]), false).unwrap(), ["compile"]);
        let err = recipes(&args(&["--recipes", "defaults,jit"]), true).unwrap_err();
        assert!(err.contains("unknown recipe `jit`") && err.contains("bf16-autocast"), "{err}");
        let err = recipes(&args(&["--recipes", "compile,compile"]), true).unwrap_err();
        assert!(err.contains("twice"), "{err}");
    }
}

//! The PyTorch twin's export, comparison and report (`cargo xtask twin`). The comparison
//! with PyTorch itself runs when `VRAM_TWIN_PYTHON` names a Python with PyTorch (or
//! `python3` has it); otherwise that test says `skipped: PyTorch is not installed`.

use std::path::{Path, PathBuf};
use vram_harness::models::{Arch, ZooError};
use vram_harness::twin::{self, Comparison, TwinError, TwinSettings};
use vram_kernels::Device;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vram-twin-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[test]
fn export_holds_the_model_the_batch_and_vrams_measurements() {
    let dir = scratch("export");
    let settings = TwinSettings { batch: 3, steps: 3, ..TwinSettings::default() };
    let run = twin::run_vram(&Device::host(256 << 20), "gpt", &settings, &dir).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("twin.json")).unwrap()).unwrap();
    assert_eq!(json["format"], twin::FORMAT);
    assert_eq!(json["arch"]["kind"], "gpt");
    assert_eq!(json["arch"]["dropout"], 0.0, "the default lets the losses be compared");
    assert_eq!(json["input"]["shape"], serde_json::json!([3, 64]));
    // The parameters tile the weights file in order, and their sizes add up to the count.
    let weights = read_f32(&dir.join("weights.f32"));
    assert_eq!(weights.len() as u64, run.param_count);
    let mut next = 0;
    for p in json["params"].as_array().unwrap() {
        assert_eq!(p["offset"].as_u64().unwrap(), next, "{}", p["name"]);
        next += p["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).product::<u64>();
    }
    assert_eq!(next, run.param_count);
    assert_eq!(json["params"][0]["name"], "wte");
    // The weights are the model's initial ones: the same preset and seed rebuild them.
    let again = vram_harness::models::Model::new(
        &Device::host(256 << 20),
        vram_harness::models::Arch::preset("gpt").unwrap(),
        settings.seed,
        vram_kernels::DType::F32,
    )
    .unwrap();
    assert_eq!(again.params()[0].value.to_f32_vec().unwrap(), weights[..256 * 128].to_vec());
    let tokens = std::fs::read(dir.join("input.u32")).unwrap();
    assert_eq!(tokens.len(), 4 * 3 * 64);
    assert_eq!(run.losses.len(), 3);
    assert!(run.losses[2] < run.losses[0], "training lowers the loss: {:?}", run.losses);
    assert!(run.peak_allocated > run.weights_bytes && run.peak_reserved >= run.peak_allocated);
    assert_eq!(run.device_used, None, "cuMemGetInfo is a CUDA figure");
    // The virtual device, allocating without computing, predicts both peaks to the byte.
    assert_eq!(run.predicted_peak_allocated, Some(run.peak_allocated));
    assert_eq!(run.predicted_peak_reserved, Some(run.peak_reserved));
    assert!(run.profile.is_none() && json["profile"] == false, "profiling is asked for");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_settings_and_models_are_refused_with_the_reason() {
    let dir = scratch("bad");
    let host = Device::host(64 << 20);
    let cases = [
        ("mlp", TwinSettings { batch: 0, ..TwinSettings::default() }, "batch"),
        ("mlp", TwinSettings { steps: 1, ..TwinSettings::default() }, "at least 2"),
        ("mlp", TwinSettings { dropout: 1.0, ..TwinSettings::default() }, "dropout"),
        ("mlp", TwinSettings { lr: f32::NAN, ..TwinSettings::default() }, "learning rate"),
        ("gpt5", TwinSettings::default(), "gpt2-small"),
    ];
    for (model, settings, expected) in cases {
        let err = twin::run_vram(&host, model, &settings, &dir).unwrap_err().to_string();
        assert!(err.contains(expected), "{model}: {err}");
    }
    let err =
        twin::run_vram(&Device::virtual_device(1 << 30), "mlp", &TwinSettings::default(), &dir)
            .unwrap_err();
    assert!(matches!(err, TwinError::InvalidArgument { what: "device", .. }), "{err}");
    // An unknown name is the zoo's own error, kept typed.
    let err = twin::run_vram(&host, "gpt5", &TwinSettings::default(), &dir).unwrap_err();
    assert!(
        matches!(&err, TwinError::Zoo(ZooError::UnknownPreset { name, .. }) if name == "gpt5"),
        "{err}"
    );
    // Out of memory is an error naming the model, not a panic.
    let tiny = Device::host(64 << 10);
    let err = twin::run_vram(&tiny, "gpt", &TwinSettings::default(), &dir).unwrap_err();
    assert!(err.to_string().starts_with("gpt on "), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn comparison_reads_both_sides_and_the_report_states_the_goal() {
    let dir = scratch("compare");
    let settings = TwinSettings { batch: 2, steps: 2, ..TwinSettings::default() };
    let run = twin::run_vram(&Device::host(64 << 20), "mlp", &settings, &dir).unwrap();
    let alone = twin::compare(&dir).unwrap();
    assert!(alone.torch.as_ref().unwrap_err().contains("no PyTorch run"));
    assert_eq!(alone.loss_difference(), None);
    // A PyTorch side as the script writes it, on the same kind of device (the host): the
    // losses compare, the memory does not (PyTorch's peaks are CUDA figures).
    let losses: Vec<f32> = run.losses.iter().map(|l| l * (1.0 + 1e-6)).collect();
    let torch = serde_json::json!({
        "torch": "2.11.0", "device": "cpu", "backend": "cpu", "param_count": run.param_count,
        "losses": losses, "step_ms": [5.0, 2.0], "peak_allocated": null, "peak_reserved": null,
        "weights_bytes": null, "tf32": false, "notes": ["explicit attention"],
    });
    std::fs::write(dir.join("torch.json"), torch.to_string()).unwrap();
    let row = twin::compare(&dir).unwrap();
    let diff = row.loss_difference().unwrap();
    assert!(diff > 0.0 && diff < 1e-5, "{diff}");
    assert_eq!(row.allocated_ratio(), None);
    assert!(row.time_ratio().is_some());
    let text = twin::report(std::slice::from_ref(&row), &settings);
    assert!(text.contains("| mlp | 2 |"), "{text}");
    assert!(text.contains("Not measured: both sides must run on CUDA"), "{text}");
    assert!(text.contains("explicit attention"), "{text}");
    // The settings line says vram's attention form beside the dropout and precision.
    assert!(text.contains("f32, dropout 0, fused attention in every transformer"), "{text}");
    assert!(
        text.trim_end().lines().any(|l| l.starts_with("| mlp |") && l.ends_with("| yes |")),
        "{text}"
    );
    // No saved-bytes figure from PyTorch: no kept-for-backward table.
    assert!(!text.contains("## Kept for backward"), "{text}");
    assert!(run.kept_for_backward.is_some_and(|k| k > 0), "{run:?}");
    let mut saved = row.clone();
    saved.torch.as_mut().unwrap().saved_for_backward = run.kept_for_backward.map(|k| k + 4);
    let text = twin::report(std::slice::from_ref(&saved), &settings);
    assert!(text.contains("## Kept for backward"), "{text}");
    assert!(text.contains("vram keeps at most PyTorch's bytes for 1 of 1 models."), "{text}");
    assert!(!text.contains("## Peak at the tensor level"), "{text}");
    assert!(run.tracked_peak.is_some_and(|p| p > run.weights_bytes), "{run:?}");
    saved.torch.as_mut().unwrap().tracked_peak = run.tracked_peak.map(|p| p / 2);
    let text = twin::report(std::slice::from_ref(&saved), &settings);
    assert!(text.contains("## Peak at the tensor level"), "{text}");
    assert!(text.contains("| 2.00x |"), "{text}");
    assert!(text.contains("vram's peak is at most PyTorch's for 0 of 1 models."), "{text}");

    // On CUDA the goal is judged from both peaks.
    let mut cuda = row.clone();
    cuda.vram.backend = "cuda".into();
    cuda.vram.peak_allocated = 900;
    let mut t = cuda.torch.clone().unwrap();
    (t.backend, t.peak_allocated, t.peak_reserved) = ("cuda".into(), Some(1000), Some(2048));
    cuda.torch = Ok(t);
    assert_eq!(cuda.allocated_ratio(), Some(0.9));
    let mut worse = cuda.clone();
    worse.model = "gpt".into();
    worse.vram.peak_allocated = 1100;
    let text = twin::report(&[cuda, worse], &settings);
    assert!(text.contains("Holds for 1 of 2 models: mlp."), "{text}");
    assert!(text.contains("| 0.90x |") && text.contains("| 1.10x |"), "{text}");
    // The virtual prediction was of the real run, not of the edited peaks.
    assert!(text.contains("| no: allocated "), "{text}");

    std::fs::write(dir.join("torch.json"), "{").unwrap();
    let broken: Comparison = twin::compare(&dir).unwrap();
    assert!(broken.torch.unwrap_err().contains("malformed"));
    // A new vram run in the same folder drops the PyTorch side of the last one.
    twin::run_vram(&Device::host(64 << 20), "mlp", &settings, &dir).unwrap();
    assert!(twin::compare(&dir).unwrap().torch.unwrap_err().contains("no PyTorch run"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn steady_median_skips_the_first_step() {
    assert_eq!(twin::steady_median(&[100.0, 3.0, 1.0, 2.0]), Some(2.0));
    assert_eq!(twin::steady_median(&[100.0, 3.0, 1.0]), Some(2.0));
    assert_eq!(twin::steady_median(&[100.0]), None);
}

/// The Python with PyTorch: `VRAM_TWIN_PYTHON`, else `python3` if it imports torch.
fn python_with_torch() -> Option<String> {
    let python = std::env::var("VRAM_TWIN_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = std::process::Command::new(&python)
        .args(["-c", "import torch"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(python)
}

#[test]
fn pytorch_trains_the_same_models_to_the_same_losses() {
    let Some(python) = python_with_torch() else {
        println!(
            "skipped: PyTorch is not installed (set VRAM_TWIN_PYTHON to a Python that has it)"
        );
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../xtask/twin/torch_twin.py");
    let settings = TwinSettings { batch: 4, steps: 4, ..TwinSettings::default() };
    for model in ["mlp", "resnet-like", "mobilenet-like", "gpt"] {
        let dir = scratch(&format!("torch-{model}"));
        twin::run_vram(&Device::host(256 << 20), model, &settings, &dir).unwrap();
        let status = std::process::Command::new(&python)
            .arg(&script)
            .arg(&dir)
            .args(["--device", "cpu"])
            .status()
            .unwrap();
        assert!(status.success(), "{model}: the twin script failed ({status})");
        let row = twin::compare(&dir).unwrap();
        let torch = row.torch.as_ref().unwrap();
        assert_eq!(torch.param_count, row.vram.param_count, "{model}");
        let diff = row.loss_difference().unwrap();
        // f32 on both sides, summed in different orders: a few ulps per op.
        assert!(
            diff < 1e-4,
            "{model}: losses differ by {diff:e}: {:?} vs {:?}",
            row.vram.losses,
            torch.losses
        );
        // What the forward leaves for backward: vram keeps what autograd saves, no more, and
        // no less but what vram holds on the host: nll_loss's 4-byte total_weight and, for
        // GPT, the token and position indices (int64) the embeddings save.
        let kept = row.vram.kept_for_backward.unwrap();
        let saved = torch.saved_for_backward.unwrap();
        println!(
            "{model}: vram keeps {kept} B for backward, PyTorch saves {saved} B; tracked peaks \
             {:?} vs {:?}",
            row.vram.tracked_peak, torch.tracked_peak
        );
        assert!(kept <= saved, "{model}: vram keeps {kept} B for backward, PyTorch {saved} B");
        let indices = match Arch::preset(model).unwrap() {
            Arch::Gpt { seq, .. } => 8 * (settings.batch * seq + seq) as u64,
            _ => 0,
        };
        assert_eq!(saved - kept, 4 + indices, "{model}: vram keeps {kept} B, PyTorch {saved} B");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// `--profile`: one more step, timed per op, after the peaks were read (which it leaves
/// as they are); the report lists vram's ops beside PyTorch's entries, or says there are none.
#[test]
fn a_profiled_step_says_where_the_time_goes() {
    let dir = scratch("profile");
    let plain = TwinSettings { batch: 2, steps: 2, ..TwinSettings::default() };
    let base = twin::run_vram(&Device::host(256 << 20), "gpt", &plain, &dir).unwrap();
    let settings = TwinSettings { profile: true, ..plain };
    let run = twin::run_vram(&Device::host(256 << 20), "gpt", &settings, &dir).unwrap();
    assert_eq!((run.peak_allocated, run.peak_reserved), (base.peak_allocated, base.peak_reserved));
    let p = run.profile.as_ref().expect("a profile");
    let names: Vec<&str> = p.ops.iter().map(|o| o.name.as_str()).collect();
    for op in ["linear", "linear_backward", "layer_norm_backward", "adamw_step_multi"] {
        assert!(names.contains(&op), "{op} in {names:?}");
    }
    assert!(p.ops.windows(2).all(|w| w[0].ms >= w[1].ms), "longest first");
    let sum: f64 = p.ops.iter().map(|o| o.ms).sum();
    assert!((sum - p.total_ms).abs() < 1e-9 && p.total_ms <= p.step_ms + 1e-9, "{p:?}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("twin.json")).unwrap()).unwrap();
    assert_eq!(json["profile"], true, "the PyTorch side is asked to profile too");
    let row = Comparison {
        model: "gpt".into(),
        batch: 2,
        vram: run,
        torch: Err("not run".into()),
        recipes: Vec::new(),
    };
    let report = twin::report(&[row], &settings);
    assert!(report.contains("## Where the time goes"), "{report}");
    assert!(report.contains("| linear_backward |") && report.contains("PyTorch: no profile"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pytorch_recipes_sit_beside_vrams_run_of_the_same_precision() {
    let dir = scratch("recipes");
    let settings =
        TwinSettings { batch: 2, steps: 3, autocast_bf16: true, ..TwinSettings::default() };
    let run = twin::run_vram(&Device::host(256 << 20), "gpt", &settings, &dir).unwrap();
    let auto = run.autocast_bf16.clone().expect("the autocast recipe ran");
    assert_eq!(auto.losses.len(), 3);
    assert!(auto.losses.iter().all(|l| l.is_finite()), "{:?}", auto.losses);
    // Same weights and batch: the first loss agrees with f32's to bf16's rounding.
    assert!((auto.losses[0] - run.losses[0]).abs() < 0.05, "{:?} {:?}", auto.losses, run.losses);
    assert_ne!(auto.losses, run.losses, "the 16-bit matmuls change the numbers");
    // PyTorch's recipe files, as the script writes them (figures made up for the test).
    let torch = |recipe: &str, peak: u64, ms: f64| {
        serde_json::json!({
            "torch": "2.11", "device": "cpu", "backend": "cpu", "recipe": recipe,
            "param_count": run.param_count, "losses": [1.0, 1.0, 1.0],
            "step_ms": [9.0, ms, ms], "peak_allocated": peak, "peak_reserved": peak,
        })
        .to_string()
    };
    std::fs::write(dir.join("torch-bf16-autocast.json"), torch("bf16-autocast", 1000, 4.0))
        .unwrap();
    std::fs::write(dir.join("torch-defaults.json"), torch("defaults", 2000, 8.0)).unwrap();
    let row = twin::compare(&dir).unwrap();
    let names: Vec<_> = row.recipes.iter().map(|r| r.recipe.clone().unwrap()).collect();
    assert_eq!(names, ["defaults", "bf16-autocast"], "in TORCH_RECIPES' order");
    let report = twin::report(&[row], &settings);
    assert!(report.contains("## Against PyTorch as its users run it"), "{report}");
    let line = |recipe: &str| {
        report
            .lines()
            .find(|l| l.starts_with(&format!("| gpt | {recipe} |")))
            .unwrap_or_else(|| panic!("no {recipe} row: {report}"))
            .to_string()
    };
    assert!(line("defaults").contains("| f32 |"), "{}", line("defaults"));
    assert!(line("bf16-autocast").contains("| bf16 autocast |"), "{}", line("bf16-autocast"));
    // Host runs: no allocated ratio (PyTorch's CPU figures are not its caching allocator's).
    assert!(line("defaults").contains("| - |"), "{}", line("defaults"));
    // A rerun removes stale recipe files, so an old PyTorch run is never compared.
    twin::run_vram(&Device::host(256 << 20), "gpt", &settings, &dir).unwrap();
    assert!(twin::compare(&dir).unwrap().recipes.is_empty());
    // A malformed recipe file is an error naming it.
    std::fs::write(dir.join("torch-compile.json"), "{").unwrap();
    let err = twin::compare(&dir).unwrap_err().to_string();
    assert!(err.contains("torch-compile.json"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// "Best against best": vram's faster run against PyTorch's faster eager recipe (never the
/// `match` run, which turns TF32 off, nor `compile`, a reference column), with a verdict on
/// CUDA only; on the host the section says its times decide nothing. Figures made up.
#[test]
fn best_against_best_pits_vrams_fastest_run_against_pytorchs_fastest_eager_recipe() {
    let torch = |recipe: &str, backend: &str, peak: u64, ms: f64| -> twin::TorchRun {
        serde_json::from_value(serde_json::json!({
            "torch": "2.11", "device": "H100", "backend": backend, "recipe": recipe,
            "param_count": 10, "losses": [1.0, 1.0, 1.0],
            "step_ms": [90.0, ms, ms], "peak_allocated": peak, "peak_reserved": peak,
        }))
        .unwrap()
    };
    let vram = |backend: &str, f32_ms: f64, auto_ms: f64| -> twin::VramRun {
        serde_json::from_value(serde_json::json!({
            "backend": backend, "device": "H100", "param_count": 10, "losses": [1.0, 1.0, 1.0],
            "step_ms": [99.0, f32_ms, f32_ms], "weights_bytes": 1, "peak_allocated": 3000,
            "peak_reserved": 4000, "device_used": null,
            "autocast_bf16": { "losses": [1.0, 1.0, 1.0], "step_ms": [99.0, auto_ms, auto_ms],
                               "peak_allocated": 1500, "peak_reserved": 2000 },
        }))
        .unwrap()
    };
    let row = |model: &str, backend: &str, v: twin::VramRun, recipes: Vec<twin::TorchRun>| {
        Comparison {
            model: model.into(),
            batch: 8,
            vram: v,
            // The `match` run is the fastest of all here: it must not be PyTorch's best.
            torch: Ok(torch("match", backend, 100, 1.0)),
            recipes,
        }
    };
    let cuda = |m: &str, auto_ms: f64| {
        row(
            m,
            "cuda",
            vram("cuda", 40.0, auto_ms),
            vec![
                torch("defaults", "cuda", 4000, 30.0),
                torch("bf16-autocast", "cuda", 2000, 20.0),
                torch("compile", "cuda", 1000, 5.0),
            ],
        )
    };
    let settings = TwinSettings::default();
    let report = twin::report(&[cuda("fast", 10.0), cuda("slow", 25.0)], &settings);
    let line = |report: &str, model: &str| {
        report
            .lines()
            .find(|l| l.starts_with(&format!("| {model} | bf16 autocast |")))
            .unwrap_or_else(|| panic!("no best row for {model}: {report}"))
            .to_string()
    };
    let fast = line(&report, "fast");
    assert!(fast.contains("| bf16-autocast | 20.0 |"), "{fast}");
    assert!(fast.contains("| 0.50x | 0.75x | 5.0 | 2.00x |"), "{fast}");
    assert!(line(&report, "slow").contains("| 1.25x |"), "{report}");
    assert!(report.contains("at most PyTorch's best eager step for 1 of 2 models"), "{report}");
    // On the host: the same table, no verdict.
    let host = row(
        "host",
        "cpu",
        vram("cpu", 40.0, 50.0),
        vec![torch("defaults", "cpu", 0, 30.0), torch("bf16-autocast", "cpu", 0, 60.0)],
    );
    let report = twin::report(&[host], &settings);
    let best = report
        .lines()
        .find(|l| l.starts_with("| host | f32 |"))
        .unwrap_or_else(|| panic!("{report}"));
    assert!(best.contains("| defaults | 30.0 |") && best.contains("| 1.33x | - |"), "{best}");
    assert!(report.contains("no verdict on GPU speed") && !report.contains("at most PyTorch's"));
    // A CNN's autocast run channels_last is named so in both tables.
    let mut cnn = cuda("cnn", 10.0);
    cnn.vram.autocast_bf16.as_mut().unwrap().channels_last = true;
    let report = twin::report(&[cnn], &settings);
    assert!(report.contains("| cnn | bf16 autocast, channels_last | 10.0 |"), "{report}");
    assert!(report.contains("| 20.0 | bf16 autocast, channels_last | 1.46 KiB |"), "{report}");
}

/// vram's autocast recipe runs a CNN channels_last only where cuDNN runs the convolutions:
/// never on the host (its own convolutions would permute around each one), never for a
/// transformer.
#[test]
fn the_autocast_recipe_is_channels_last_for_cnns_on_cudnn_only() {
    let host = Device::host(1 << 20);
    let resnet = Arch::preset("resnet50").unwrap();
    assert!(resnet.is_preset_cnn());
    assert!(!twin::autocast_channels_last(&host, &resnet));
    assert!(!Arch::preset("gpt2-small").unwrap().is_preset_cnn());
    if let Ok(gpu) = Device::cuda(0) {
        let cudnn = matches!(gpu.conv_path(), vram_kernels::ConvPath::Cudnn { .. });
        assert_eq!(twin::autocast_channels_last(&gpu, &resnet), cudnn);
        gpu.set_conv_backend(vram_kernels::ConvBackend::Own).unwrap();
        assert!(!twin::autocast_channels_last(&gpu, &resnet));
    } else {
        eprintln!("skipped: no CUDA device (the cuDNN half of the check)");
    }
}

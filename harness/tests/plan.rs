//! The planner's figures are measurements: the virtual device's prediction equals the host's
//! measured peak under every plan kind and precision, the recommended micro-batch fits and
//! the next one does not, the ranking is stable, and bad input is a clear error.

use vram_harness::models::spec::ModelSpec;
use vram_harness::plan::{
    self, Candidate, ModelOverrides, NoProgress, OptimizerKind, PlanError, PlanKind, PlanRequest,
    Precision, PrecisionChoice, Target, model_from_args, model_from_spec,
};

fn small(name: &str) -> plan::PlanModel {
    let o = match name {
        "gpt" => ModelOverrides {
            width: Some(32),
            depth: Some(3),
            seq: Some(16),
            vocab: Some(64),
            ..Default::default()
        },
        "resnet" | "mobilenet" => ModelOverrides {
            width: Some(4),
            depth: Some(1),
            side: Some(8),
            classes: Some(4),
            ..Default::default()
        },
        _ => ModelOverrides {
            width: Some(32),
            depth: Some(3),
            classes: Some(4),
            ..Default::default()
        },
    };
    model_from_args(name, &o).unwrap()
}

const KINDS: [PlanKind; 4] =
    [PlanKind::None, PlanKind::EveryK(2), PlanKind::Sqrt, PlanKind::Budget];

#[test]
fn predicted_peak_equals_the_host_measured_peak_for_every_plan_kind_and_precision() {
    let custom = ModelSpec::from_toml_str(
        r#"
        input = { kind = "image", channels = 3, side = 8 }
        layers = [
          { kind = "conv", out = 4, kernel = 3, act = "relu", repeat = 2 },
          { kind = "conv", out = 8, kernel = 3, stride = 2, act = "gelu" },
          { kind = "pool" },
          { kind = "linear", out = 16, act = "relu" },
          { kind = "norm" },
          { kind = "linear", out = 4 },
        ]"#,
        "custom",
    )
    .unwrap();
    let models = [
        small("gpt"),
        small("resnet"),
        small("mobilenet"),
        small("mlp"),
        model_from_spec(custom).unwrap(),
    ];
    // The real-size presets, reduced to run on the host (the same layer kinds).
    let presets = ["gpt2-small", "resnet50", "mobilenetv3-like", "vit-b-like"]
        .map(|n| model_from_args(n, &ModelOverrides::default()).unwrap().reduced());
    // The reduced presets are slower on the host: one 16-bit precision for them.
    let all = [Precision::Fp32, Precision::Bf16, Precision::Fp16];
    let runs = models.iter().map(|m| (m, &all[..])).chain(presets.iter().map(|m| (m, &all[1..2])));
    for (model, precisions) in runs {
        for &precision in precisions {
            for plan in KINDS {
                for (alloc_conf, optimizer) in
                    [("", OptimizerKind::AdamW), ("expandable_segments:True", OptimizerKind::Sgd)]
                {
                    let c = Candidate {
                        precision,
                        plan,
                        alloc_conf: alloc_conf.into(),
                        optimizer,
                        micro: 3,
                        accum: 2,
                    };
                    let virt = plan::measure(model, &c, Target::Virtual(1 << 30)).unwrap();
                    let host = plan::measure(model, &c, Target::Host(1 << 30)).unwrap();
                    assert!(virt.is_some(), "{} {c:?}", model.name);
                    assert_eq!(virt, host, "{} {c:?}", model.name);
                }
            }
        }
    }
}

/// Autocast (f32 parameters, 16-bit casts cached per step, f32 norms and loss) allocates on
/// the virtual device exactly what it allocates on the host, under every plan kind: the
/// models whose layers support autocast (GPT, the MLP, reduced GPT-2 small).
#[test]
fn autocast_peaks_on_the_virtual_device_equal_the_host_measured_peaks() {
    let gpt2 = model_from_args("gpt2-small", &ModelOverrides::default()).unwrap().reduced();
    for model in [small("gpt"), small("mlp"), gpt2] {
        for precision in [Precision::AutocastBf16, Precision::AutocastFp16] {
            for plan in KINDS {
                let c = Candidate {
                    precision,
                    plan,
                    alloc_conf: String::new(),
                    optimizer: OptimizerKind::AdamW,
                    micro: 3,
                    accum: 2,
                };
                let virt = plan::measure(&model, &c, Target::Virtual(1 << 30)).unwrap();
                let host = plan::measure(&model, &c, Target::Host(1 << 30)).unwrap();
                assert!(virt.is_some(), "{} {c:?}", model.name);
                assert_eq!(virt, host, "{} {c:?}", model.name);
            }
        }
    }
}

fn request(budget: u64) -> PlanRequest {
    let mut r = PlanRequest::new(small("gpt"), 256, budget);
    r.reserve = 0;
    r.precision = PrecisionChoice::Only(Precision::Bf16);
    r
}

#[test]
fn the_recommended_split_fits_and_the_next_larger_micro_batch_does_not() {
    let req = request(40 << 20);
    let report = plan::plan(&req, &mut NoProgress).unwrap();
    let best = report.recommended().expect("something fits in 40 MiB");
    let usable = req.usable();
    let at = |row: &plan::Row, micro, accum| {
        let c = Candidate {
            precision: row.precision,
            plan: row.plan,
            alloc_conf: row.alloc_conf.clone(),
            optimizer: req.optimizer,
            micro,
            accum,
        };
        plan::measure(&req.model, &c, Target::Virtual(usable)).unwrap()
    };
    assert_eq!(report.min_micro, 1);
    let (_, reserved) = at(best, best.micro, best.accum).expect("the recommendation runs");
    assert!(reserved <= usable);
    // 256 samples do not fit at once: the split accumulates.
    assert!(best.accum > 1 && best.micro * best.accum == 256, "{best:?}");
    let mut checked = 0;
    for row in report.fitting.iter().chain(&report.not_fitting) {
        // The budget plan's schedule depends on the micro-batch; its boundary is the
        // search's own (tested through the fixed plans).
        if row.plan == PlanKind::Budget || row.max_micro == 0 {
            continue;
        }
        // max mb is the largest micro-batch that fits with accumulation over the rest.
        let m = row.max_micro;
        assert!(at(row, m, 256usize.div_ceil(m)).is_some(), "{}: {m} fits", row.label());
        assert!(
            at(row, m + 1, 256usize.div_ceil(m + 1)).is_none(),
            "{}: {} + 1 does not",
            row.label(),
            row.max_micro
        );
        // steps x mb: the largest divisor of the batch up to max mb.
        if row.fits {
            let next = (row.micro + 1..=256).find(|d| 256 % d == 0).unwrap_or(usize::MAX);
            assert!(row.micro <= m && next > m, "{row:?}");
        }
        checked += 1;
    }
    assert!(checked >= 3, "{checked} rows checked");
    // The search found a real boundary: micro-batches above 1 and below the cap.
    assert!(best.max_micro > 1 && best.max_micro < req.max_micro, "{}", best.max_micro);
}

#[test]
fn the_ranking_is_the_same_on_every_run() {
    let req = request(40 << 20);
    let strip = |r: plan::PlanReport| (r.fitting, r.not_fitting, r.why, r.decomposition, r.runs);
    let a = strip(plan::plan(&req, &mut NoProgress).unwrap());
    let b = strip(plan::plan(&req, &mut NoProgress).unwrap());
    assert_eq!(a, b);
}

#[test]
fn nothing_fits_says_what_would() {
    let mut req = PlanRequest::new(small("gpt"), 8, 2 << 20);
    req.reserve = 0;
    req.precision = PrecisionChoice::Only(Precision::Fp32);
    let report = plan::plan(&req, &mut NoProgress).unwrap();
    assert!(report.fitting.is_empty());
    assert!(report.not_fitting.iter().all(|r| r.headroom < 0));
    let text = report.suggestions.join("\n");
    for needle in ["SGD", "8-bit", "sequence", "a device with at least"] {
        assert!(text.contains(needle), "{needle} in {text}");
    }
}

/// A batch norm over 1 x 1 planes (ResNet-50's last stage at 32 px) cannot train on one
/// sample, in PyTorch as in vram: the search starts at two samples per micro-batch and says
/// why, whether the model fits or not, and a global batch of one is refused.
#[test]
fn a_model_that_cannot_train_on_one_sample_is_planned_from_two() {
    let spec = ModelSpec::from_toml_str(
        r#"
        input = { kind = "image", channels = 3, side = 2 }
        layers = [
          { kind = "conv", out = 8, kernel = 3, stride = 2, bn = true, act = "relu" },
          { kind = "pool" },
          { kind = "linear", out = 4 },
        ]"#,
        "one-by-one",
    )
    .unwrap();
    let model = model_from_spec(spec).unwrap();
    for (memory, fits) in [(64 << 20, true), (48 << 10, false)] {
        let mut req = PlanRequest::new(model.clone(), 6, memory);
        req.reserve = 0;
        req.precision = PrecisionChoice::Only(Precision::Fp32);
        let report = plan::plan(&req, &mut NoProgress).unwrap();
        assert_eq!(report.min_micro, 2);
        assert_eq!(report.recommended().is_some(), fits, "{memory} bytes");
        for row in report.fitting.iter().chain(&report.not_fitting) {
            assert!(row.micro >= 2 && row.micro * row.accum == 6, "{row:?}");
        }
        let notes = report.notes.join("\n");
        assert!(notes.contains("start at 2 samples") && notes.contains("1 value per channel"));
        if !fits {
            assert!(report.suggestions[0].contains("3 x 2 samples"), "{:?}", report.suggestions);
        }
    }
    let mut req = PlanRequest::new(model, 1, 64 << 20);
    req.reserve = 0;
    let e = plan::plan(&req, &mut NoProgress).unwrap_err();
    assert!(e.is_bad_input() && e.to_string().contains("at least 2"), "{e}");
}

#[test]
fn bad_input_is_a_clear_error() {
    let e = model_from_args("gpt3", &ModelOverrides::default()).unwrap_err();
    assert!(
        matches!(e, PlanError::UnknownModel { .. }) && e.to_string().contains("gpt2-medium"),
        "{e}"
    );
    let e = model_from_args("resnet50", &ModelOverrides { seq: Some(8), ..Default::default() })
        .unwrap_err();
    assert!(e.to_string().contains("no --seq"), "{e}");
    let e = model_from_args("gpt", &ModelOverrides { width: Some(0), ..Default::default() })
        .unwrap_err();
    assert!(e.to_string().contains("--width"), "{e}");

    let mut req = PlanRequest::new(small("gpt"), 4, 1 << 10);
    req.reserve = 0;
    let e = plan::plan(&req, &mut NoProgress).unwrap_err();
    assert!(matches!(e, PlanError::DeviceTooSmall { .. }) && e.is_bad_input(), "{e}");
    assert!(e.to_string().contains("the model's parameters alone ("), "{e}");
    assert!(e.to_string().contains("--gpus"), "{e}");
    req.batch = 0;
    assert!(plan::plan(&req, &mut NoProgress).unwrap_err().is_bad_input());

    let e = ModelSpec::from_toml_str(
        "input = { kind = \"features\", dim = 4 }\n[[layers]]\nkind = \"linear\"\nout = 4\n[[layers]]\nkind = \"lstm\"\n",
        "m",
    )
    .unwrap_err();
    assert!(e.reason.contains("layer 1") && e.reason.contains("lstm"), "{e}");
    let e = ModelSpec::from_json_str(r#"{"input": {"kind": "features", "dim": 4}, "layers": [{"kind": "linear", "out": 4, "width": 3}]}"#, "m").unwrap_err();
    assert!(e.reason.contains("layer 0") && e.reason.contains("width"), "{e}");
    let e = ModelSpec::from_json_str(r#"{"input": {"kind": "image", "channels": 3, "side": 8}, "layers": [{"kind": "linear", "out": 4}]}"#, "m").unwrap_err();
    assert!(e.reason.contains("pool"), "{e}");
    let e = ModelSpec::from_toml_str("input = [", "m").unwrap_err();
    assert!(e.reason.contains("TOML") && e.reason.contains("line"), "{e}");
    // A Hugging Face config.json given where a vram model file goes names the right flag.
    let hf = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/hf/gpt2.json");
    let e = ModelSpec::from_path(&hf).unwrap_err();
    assert!(e.reason.contains("Hugging Face") && e.reason.contains("--hf-config"), "{e}");
}

#[test]
fn the_example_model_files_parse() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("models");
    for f in ["example.toml", "example-cnn.json"] {
        let m = plan::model_from_file(&root.join(f)).unwrap();
        assert!(m.classes > 1, "{f}");
    }
    // The CNN's two batch-normed convolutions add a scale and a shift per channel: convs
    // 3*32*9 + 32*64*9, three depthwise 64*9, the linear 64*10 + 10, and 2 * (32 + 64).
    let m = plan::model_from_file(&root.join("example-cnn.json")).unwrap();
    let want = 3 * 32 * 9 + 32 * 64 * 9 + 3 * 64 * 9 + 64 * 10 + 10 + 2 * (32 + 64);
    let dev = vram_kernels::Device::virtual_device(1 << 30);
    let model = vram_harness::models::Model::new(&dev, m.arch, 0, vram_kernels::DType::F32);
    assert_eq!(model.unwrap().param_count(), want);
}

/// A step of more than three micro-batches peaks as three do (the gradients are in place
/// from the second on): what lets the search run at most three whatever the batch.
#[test]
fn accumulation_peaks_settle_at_three_micro_batches() {
    let model = small("gpt");
    for precision in [Precision::Fp32, Precision::Bf16, Precision::AutocastBf16] {
        for plan in [PlanKind::None, PlanKind::EveryK(2)] {
            let at = |accum| {
                let c = Candidate {
                    precision,
                    plan,
                    alloc_conf: String::new(),
                    optimizer: OptimizerKind::AdamW,
                    micro: 3,
                    accum,
                };
                plan::measure(&model, &c, Target::Virtual(1 << 40)).unwrap().unwrap()
            };
            assert_eq!(at(plan::SIMULATED_ACCUM), at(7), "{precision:?} {plan:?}");
        }
    }
}

/// `--batch 1000000000` and a 64 TiB device finish after a bounded number of runs, with
/// micro-batches no larger than the global batch.
#[test]
fn huge_batches_and_devices_take_a_bounded_number_of_runs() {
    for (batch, memory) in [(1_000_000_000, 64u64 << 40), (1_000_000_000, 64 << 20), (8, 64 << 40)]
    {
        let mut req = PlanRequest::new(small("gpt"), batch, memory);
        req.reserve = 0;
        req.precision = PrecisionChoice::Only(Precision::Fp32);
        let report = plan::plan(&req, &mut NoProgress).unwrap();
        // 12 configurations (4 checkpoint plans x 3 allocator settings), about ten probes
        // each (a budget plan's probe is a few runs): a bound that does not depend on the
        // batch or the device (today 631 runs at 1e9 samples on 64 MiB).
        assert!(report.runs < 12 * 60, "{batch} on {memory}: {} runs", report.runs);
        let best = report.recommended().expect("fits");
        assert_eq!(best.micro * best.accum, batch);
        for row in report.fitting.iter().chain(&report.not_fitting) {
            assert!(row.max_micro <= batch && row.micro <= batch, "{row:?}");
        }
        if batch == 8 {
            assert_eq!((best.micro, best.accum, best.max_micro), (8, 1, 8));
        }
    }
}

#[test]
fn absurd_inputs_are_refused_as_bad_input() {
    for (batch, memory, needle) in [
        (8, plan::MAX_DEVICE_MEMORY, "is not a GPU"),
        (8, u64::MAX, "is not a GPU"),
        (plan::MAX_BATCH + 1, 8 << 30, "more than"),
        (8, 0, "at least 1 byte"),
    ] {
        let req = PlanRequest::new(small("gpt"), batch, memory);
        let e = plan::plan(&req, &mut NoProgress).unwrap_err();
        assert!(e.is_bad_input() && e.to_string().contains(needle), "{e}");
    }
}

/// The JSON's values are plain strings, `auto` includes bf16 autocast, rows that repeat
/// another are folded, and checkpoint plans name the layers to wrap.
#[test]
fn the_report_reads_as_pytorch_settings() {
    let json = |v| serde_json::to_value(v).unwrap();
    assert_eq!(json(Precision::AutocastBf16), "bf16-autocast");
    assert_eq!(json(Precision::Fp32), "fp32");
    assert_eq!(serde_json::to_value(PlanKind::None).unwrap(), "none");
    assert_eq!(serde_json::to_value(PlanKind::EveryK(2)).unwrap(), "every-2");
    assert_eq!(serde_json::to_value(OptimizerKind::AdamW).unwrap(), "adamw");
    assert!(PrecisionChoice::Auto.precisions().contains(&Precision::AutocastBf16));

    let mut req = PlanRequest::new(small("gpt"), 64, 64 << 20);
    req.reserve = 0;
    let report = plan::plan(&req, &mut NoProgress).unwrap();
    let rows: Vec<_> = report.fitting.iter().chain(&report.not_fitting).collect();
    assert!(rows.iter().any(|r| r.precision == Precision::AutocastBf16));
    let every2 = rows.iter().find(|r| r.plan == PlanKind::EveryK(2)).unwrap();
    // Three blocks h0, h1, h2 and the final norm: segments of two layers, the last kept.
    assert_eq!(every2.checkpoint, ["h0..h1", "h2..ln_f"], "{every2:?}");
    assert!(every2.checkpoint_advice().contains("torch.utils.checkpoint"));
    // A budget plan that recomputes nothing is the plan without checkpointing: folded.
    let folded = rows.iter().filter(|r| !r.same_as.is_empty()).count();
    assert!(folded > 0, "{rows:?}");
    for r in &rows {
        let twins = rows.iter().filter(|o| {
            o.precision == r.precision
                && o.allocator == r.allocator
                && (o.micro, o.accum, o.peak_allocated, o.peak_reserved)
                    == (r.micro, r.accum, r.peak_allocated, r.peak_reserved)
                && o.checkpoint == r.checkpoint
        });
        assert_eq!(twins.count(), 1, "{r:?} repeated");
    }
    let value = serde_json::to_value(&report).unwrap();
    assert_eq!(value["optimizer"], "adamw");
    assert!(value["fitting"][0]["precision"].is_string());
}

/// A model whose model states no single device holds gets the fewest GPUs and lowest ZeRO
/// stage that do, with the global batch split as micro-batch x accumulation x GPUs.
#[test]
fn a_model_too_big_for_one_device_gets_a_multi_gpu_answer() {
    let model = model_from_args(
        "gpt",
        &ModelOverrides {
            width: Some(512),
            depth: Some(8),
            seq: Some(16),
            vocab: Some(64),
            ..Default::default()
        },
    )
    .unwrap();
    // About 25M parameters: 50 MiB of bf16 weights, 400 MiB of model states with AdamW.
    let mut req = PlanRequest::new(model, 32, 256 << 20);
    req.reserve = 0;
    req.precision = PrecisionChoice::Only(Precision::Bf16);
    let report = plan::plan(&req, &mut NoProgress).unwrap();
    assert!(report.fitting.is_empty());
    let answer = report.multi_gpu.as_ref().expect("a multi-GPU answer");
    let gpus = answer.gpus.expect("some count of GPUs holds it");
    assert!(gpus > 1 && gpus <= 32, "{answer:?}");
    assert!(answer.answer.contains(&format!("needs {gpus} GPUs with zero-")), "{}", answer.answer);
    let table = answer.table.as_ref().unwrap();
    let row = table.first_fit().unwrap();
    assert!(row.zero_stage >= 1 && row.micro * row.accum * gpus == 32, "{row:?}");

    // --gpus 4: the sharded states shrink stage by stage.
    let t = plan::shard_table(&req, &report, 4, 1).unwrap();
    let states: Vec<u64> = t.rows.iter().take(4).map(|r| r.model_states).collect();
    assert!(states.windows(2).all(|w| w[0] > w[1]), "{states:?}");
    for r in t.rows.iter().filter(|r| r.fits) {
        assert_eq!(r.micro * r.accum * 4, 32, "{r:?}");
    }
    assert!(t.rows.iter().filter(|r| r.offload).all(|r| r.host_ram_per_node > 0));
    assert!(plan::shard_table(&req, &report, 5, 1).unwrap_err().is_bad_input());
}

/// Channels_last CNNs are planned as the host runs them; a GPU's cuDNN record read from a
/// file changes the prediction by its workspaces (and only where the record has the shape).
#[test]
fn channels_last_and_a_cudnn_record_are_planned_as_they_run() {
    use vram_kernels::cudnn_choices::{ConvChoice, ConvKey, ConvPass, CudnnChoices};
    use vram_kernels::{ConvLayout, DType};
    let mut model = small("resnet");
    model.set_channels_last(true).unwrap();
    assert!(model.name.contains("channels_last"), "{}", model.name);
    let c = Candidate {
        precision: Precision::Fp32,
        plan: PlanKind::None,
        alloc_conf: String::new(),
        optimizer: OptimizerKind::AdamW,
        micro: 3,
        accum: 1,
    };
    let virt = plan::measure(&model, &c, Target::Virtual(1 << 30)).unwrap().unwrap();
    let host = plan::measure(&model, &c, Target::Host(1 << 30)).unwrap().unwrap();
    assert_eq!(virt, host, "channels_last: virtual vs host");
    let mut gpt = small("gpt");
    let err = gpt.set_channels_last(true).unwrap_err().to_string();
    assert!(err.contains("not a preset CNN"), "{err}");

    // The stem's forward (3 images of 8 x 8, 3 -> 4 channels, 3 x 3) recorded with 256 MiB.
    let stem = ConvChoice {
        pass: ConvPass::Forward,
        key: ConvKey {
            x: [3, 3, 8, 8],
            w: [4, 3, 3, 3],
            padding: (1, 1),
            stride: (1, 1),
            dilation: (1, 1),
            groups: 1,
            dtype: DType::F32,
            layout: ConvLayout::Nhwc,
            allow_tf32: true,
        },
        algo: "TEST".into(),
        workspace: 256 << 20,
        search_workspace: None,
    };
    let record = CudnnChoices {
        device: "a test GPU".into(),
        version: 91400,
        convolutions: vec![stem],
        batch_norms: Vec::new(),
    };
    let dir = std::env::temp_dir().join(format!("vram-plan-cudnn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cudnn-choices.json");
    std::fs::write(&path, serde_json::to_string(&record).unwrap()).unwrap();
    let read = plan::cudnn_choices_from_path(&path).unwrap();
    assert_eq!(read, record);
    model.set_cudnn_choices(Some(read));
    assert!(model.notes.iter().any(|n| n.contains("a test GPU")), "{:?}", model.notes);
    let (replayed, _) = plan::measure(&model, &c, Target::Virtual(1 << 30)).unwrap().unwrap();
    assert!(replayed >= 256 << 20 && virt.0 < 256 << 20, "{replayed} vs {}", virt.0);
    assert!(!model.cudnn_benchmark());
    // Recorded with cudnn.benchmark: the first call also takes its search's workspace.
    let mut searched = record.clone();
    searched.convolutions[0].search_workspace = Some(512 << 20);
    model.set_cudnn_choices(Some(searched));
    assert!(model.cudnn_benchmark());
    assert!(model.notes.iter().any(|n| n.contains("cudnn.benchmark")), "{:?}", model.notes);
    let (with_search, _) = plan::measure(&model, &c, Target::Virtual(1 << 30)).unwrap().unwrap();
    assert!(with_search >= 512 << 20 && replayed < 512 << 20, "{with_search} vs {replayed}");
    model.set_cudnn_choices(Some(record.clone()));
    // NCHW has no such record: the stem takes no workspace there.
    model.set_channels_last(false).unwrap();
    let (nchw, _) = plan::measure(&model, &c, Target::Virtual(1 << 30)).unwrap().unwrap();
    assert!(nchw < 256 << 20, "{nchw}");
    // The plan's notes say how much of the recommended step the record left out.
    let mut req = PlanRequest::new(model.clone(), 3, 4 << 30);
    req.precision = PrecisionChoice::Only(Precision::Fp32);
    let report = plan::plan(&req, &mut NoProgress).unwrap();
    let note = report.notes.iter().find(|n| n.starts_with("cuDNN record:")).expect("a note");
    assert!(note.contains("are not in it"), "{note}");
    // A file that is not a record is an error naming it.
    std::fs::write(&path, "{").unwrap();
    let err = plan::cudnn_choices_from_path(&path).unwrap_err().to_string();
    assert!(err.contains("cudnn-choices.json"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

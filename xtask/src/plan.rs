//! `cargo xtask plan`: which batch split, checkpoint plan, precision and allocator settings
//! fit a model on a GPU of a given memory, found on the virtual device.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use vram_harness::human_bytes;
use vram_harness::models::{Arch, Attention};
use vram_harness::plan::{
    self, ALLOCATOR_SETTINGS, DpPlan, MAX_DEVICE_MEMORY, MAX_GPUS, ModelOverrides, OptimizerKind,
    PLAN_KINDS, PlanError, PlanProgress, PlanReport, PlanRequest, Precision, PrecisionChoice, Row,
    ShardTable,
};

/// `--model`'s help: the zoo's presets, real-size then small, and their aliases.
fn model_help() -> String {
    let names = |real: bool| -> String {
        let names = Arch::presets().iter().filter(|p| p.real_size == real).map(|p| p.name);
        names.collect::<Vec<_>>().join(", ")
    };
    let aliases: Vec<String> =
        Arch::presets().iter().flat_map(|p| p.aliases.iter().map(|a| format!("`{a}`"))).collect();
    let also = if aliases.is_empty() {
        String::new()
    } else {
        format!("; {} also work", aliases.join(", "))
    };
    format!("A model by name: {} (real sizes), {} (small{also})", names(true), names(false))
}

/// `--model`'s long help: [`model_help`], then each preset with its description.
fn model_long_help() -> String {
    let mut text = model_help() + "\n";
    for p in Arch::presets() {
        let aliases: Vec<String> = p.aliases.iter().map(|a| format!("`{a}`")).collect();
        let also = if aliases.is_empty() {
            String::new()
        } else {
            format!(" (or {})", aliases.join(", "))
        };
        text += &format!("\n  {}{also}: {}", p.name, p.description);
    }
    text
}

/// `--precision`'s help, with what `auto` searches.
fn precision_help() -> String {
    let auto: Vec<&str> = PrecisionChoice::Auto.precisions().iter().map(|p| p.label()).collect();
    format!(
        "Precision (auto tries {}, 16-bit ones in full with f32 master weights; the autocast \
         ones are torch.autocast's recipe: f32 weights, 16-bit matmuls and convolutions)",
        auto.join(" and ")
    )
}

/// What the search tries besides the precisions: the checkpoint plans and allocator settings.
fn search_help() -> String {
    let plans: Vec<String> = PLAN_KINDS.iter().map(|k| k.label()).collect();
    let allocs: Vec<String> = ALLOCATOR_SETTINGS
        .iter()
        .map(
            |(label, conf)| {
                if conf.is_empty() { label.to_string() } else { format!("{label} ({conf})") }
            },
        )
        .collect();
    format!(
        "Searched for each precision: the checkpoint plans {} and the allocator settings {}.",
        plans.join(", "),
        allocs.join(", ")
    )
}

#[derive(clap::Args)]
#[command(after_help = search_help())]
pub struct PlanArgs {
    #[arg(
        long,
        required_unless_present_any = ["model_file", "hf_config", "list_models"],
        conflicts_with_all = ["model_file", "hf_config"],
        help = model_help(),
        long_help = model_long_help()
    )]
    model: Option<String>,
    /// A model described in a TOML or JSON file of layer specs (see models/example.toml).
    #[arg(long, value_name = "FILE")]
    model_file: Option<PathBuf>,
    /// A Hugging Face config.json (model_type gpt2, llama, mistral or qwen2; see models/hf/).
    #[arg(long, value_name = "FILE", conflicts_with = "model_file")]
    hf_config: Option<PathBuf>,
    /// List the models --model takes, with their descriptions, and exit.
    #[arg(long)]
    list_models: bool,
    /// Global batch: samples per optimizer step (over all GPUs). Micro-batches are searched
    /// up to it.
    #[arg(long, required_unless_present = "list_models")]
    batch: Option<usize>,
    #[arg(long, value_name = "SIZE", required_unless_present = "list_models",
          help = device_memory_help())]
    device_memory: Option<String>,
    /// Memory kept back for the CUDA context, library workspaces and other processes (a
    /// size as --device-memory's, or 0).
    #[arg(long, value_name = "SIZE", default_value = "1GiB")]
    reserve: String,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptArg::Adamw)]
    optimizer: OptArg,
    #[arg(long, value_enum, default_value_t = PrecArg::Auto, help = precision_help())]
    precision: PrecArg,
    /// How transformer blocks (GPT, ViT, Llama) attend: fused (as PyTorch's
    /// scaled_dot_product_attention) or explicit (the seq x seq probabilities kept, as
    /// eager attention), to compare.
    #[arg(long, value_enum, default_value_t = AttnArg::Fused)]
    attention: AttnArg,
    /// Run a preset CNN channels_last (images, activations and convolution weights NHWC, as
    /// PyTorch's torch.channels_last).
    #[arg(long)]
    channels_last: bool,
    /// A GPU's record of cuDNN's choices (the `cudnn-choices.json` that `cargo xtask twin`
    /// writes on a GPU) for the virtual devices to replay: convolutions and batch norms
    /// allocate what that GPU's cuDNN path allocated (shapes it lacks take no workspace); a
    /// record made with cudnn.benchmark also replays each shape's timed-search workspace.
    #[arg(long, value_name = "FILE")]
    cudnn_choices: Option<PathBuf>,
    /// Sequence length (token models).
    #[arg(long)]
    seq: Option<usize>,
    /// Image side (image models).
    #[arg(long)]
    side: Option<usize>,
    /// Width (GPT d, CNN first-stage channels, MLP hidden width).
    #[arg(long)]
    width: Option<usize>,
    /// Depth (transformer blocks, blocks per CNN stage, MLP hidden layers).
    #[arg(long)]
    depth: Option<usize>,
    /// Vocabulary (token models).
    #[arg(long)]
    vocab: Option<usize>,
    /// Output classes (classifiers).
    #[arg(long)]
    classes: Option<usize>,
    /// Also plan data parallel training over N GPUs (one process each; `--nproc` is an
    /// alias): per-GPU memory of DDP, ZeRO-1/2/3 (the data-parallel crate's sharding) and
    /// ZeRO-2/3 with the optimizer state (and parameters) offloaded to the CPU with the host
    /// RAM DeepSpeed's estimators ask for, the global batch split as micro-batch x
    /// accumulation x N; with N up to 8, also measured on N virtual devices (peaks and the
    /// bytes the collectives move), each process in the precision and activation
    /// checkpointing of the single-GPU configuration the estimate starts from. Without
    /// --gpus, a model no single GPU holds gets the fewest GPUs and lowest ZeRO stage that
    /// do.
    #[arg(long, visible_alias = "nproc", value_name = "N")]
    gpus: Option<usize>,
    /// Nodes the GPUs are spread over (GPUs per node = N / M), for the host RAM per node.
    #[arg(long, value_name = "M", default_value_t = 1, requires = "gpus")]
    nodes: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Run the recommended configuration on the device at hand and compare its peak with
    /// the prediction (CUDA at full size; the host at reduced scale).
    #[arg(long)]
    verify: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum OptArg {
    Adamw,
    Sgd,
}

/// How transformer blocks attend (`--attention`).
#[derive(Clone, Copy, clap::ValueEnum)]
enum AttnArg {
    /// Fused scaled dot-product attention (PyTorch's `scaled_dot_product_attention`): the
    /// output and each row's logsumexp kept, nothing of size seq x seq.
    Fused,
    /// The explicit form (PyTorch's eager attention): the `[b, heads, seq, seq]`
    /// probabilities kept for backward, for comparison.
    Explicit,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum PrecArg {
    Fp32,
    Fp16,
    Bf16,
    /// bf16 autocast (`torch.autocast`): f32 weights, 16-bit matmuls.
    AutocastBf16,
    /// fp16 autocast with loss scaling (`torch.cuda.amp`).
    AutocastFp16,
    Auto,
}

/// A progress bar on a terminal, nothing otherwise.
struct Bar(Option<indicatif::ProgressBar>);

impl PlanProgress for Bar {
    fn begin(&mut self, total: usize) {
        if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            return;
        }
        let bar = indicatif::ProgressBar::new(total as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{bar:30}] {pos}/{len} {msg} ({elapsed})",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        bar.enable_steady_tick(Duration::from_millis(120));
        self.0 = Some(bar);
    }
    fn advance(&mut self, label: &str) {
        if let Some(bar) = &self.0 {
            bar.set_message(label.to_string());
            bar.inc(1);
        }
    }
}

fn size(what: &'static str, s: &str) -> Result<u64, PlanError> {
    vram_harness::parse_size(s).map_err(|e| PlanError::MalformedSize {
        what,
        input: s.into(),
        message: e.to_string(),
    })
}

/// `--device-memory`'s help: the size grammar and the largest device taken.
fn device_memory_help() -> String {
    format!(
        "The GPU's memory, e.g. 24GiB: bytes, or a number with a unit, {}. At most {}",
        vram_harness::SIZE_UNITS,
        human_bytes(MAX_DEVICE_MEMORY - 1)
    )
}

/// The `--list-models` text: each preset, its aliases and description.
pub fn list_models() -> String {
    let mut out = String::new();
    let width = Arch::presets().iter().map(|p| p.name.len()).max().unwrap_or(0);
    for p in Arch::presets() {
        let aliases: Vec<String> = p.aliases.iter().map(|a| format!("`{a}`")).collect();
        let also = if aliases.is_empty() {
            String::new()
        } else {
            format!(" (or {})", aliases.join(", "))
        };
        out += &format!(
            "{:<width$}  {}{also}{}\n",
            p.name,
            p.description,
            if p.real_size { "" } else { " [small]" }
        );
    }
    out
}

/// The request the arguments describe.
fn request(args: &PlanArgs) -> Result<PlanRequest, PlanError> {
    let overrides = ModelOverrides {
        seq: args.seq,
        side: args.side,
        width: args.width,
        depth: args.depth,
        vocab: args.vocab,
        classes: args.classes,
    };
    let mut model = match (&args.model, &args.model_file, &args.hf_config) {
        (_, _, Some(path)) => plan::model_from_hf(path, &overrides)?,
        (_, Some(path), None) => {
            if overrides != ModelOverrides::default() {
                return Err(PlanError::InvalidArgument {
                    what: "size override",
                    reason: "a model file sets its own sizes; edit the file".into(),
                });
            }
            plan::model_from_file(path)?
        }
        (Some(name), None, None) => plan::model_from_args(name, &overrides)?,
        (None, None, None) => {
            return Err(PlanError::InvalidArgument {
                what: "model",
                reason: "give --model NAME, --model-file FILE or --hf-config FILE".into(),
            });
        }
    };
    model.set_attention(match args.attention {
        AttnArg::Fused => Attention::Fused,
        AttnArg::Explicit => Attention::Explicit,
    });
    model.set_channels_last(args.channels_last)?;
    if let Some(path) = &args.cudnn_choices {
        model.set_cudnn_choices(Some(plan::cudnn_choices_from_path(path)?));
    }
    let batch = args.batch.unwrap_or_default();
    let device_memory = size("--device-memory", args.device_memory.as_deref().unwrap_or(""))?;
    let mut req = PlanRequest::new(model, batch, device_memory);
    req.reserve = size("--reserve", &args.reserve).or_else(|e| {
        // `0` is a valid reserve, which parse_size (sizes >= 1 byte) refuses.
        if args.reserve.trim() == "0" { Ok(0) } else { Err(e) }
    })?;
    req.optimizer = match args.optimizer {
        OptArg::Adamw => OptimizerKind::AdamW,
        OptArg::Sgd => OptimizerKind::Sgd,
    };
    req.precision = match args.precision {
        PrecArg::Fp32 => PrecisionChoice::Only(Precision::Fp32),
        PrecArg::Fp16 => PrecisionChoice::Only(Precision::Fp16),
        PrecArg::Bf16 => PrecisionChoice::Only(Precision::Bf16),
        PrecArg::AutocastBf16 => PrecisionChoice::Only(Precision::AutocastBf16),
        PrecArg::AutocastFp16 => PrecisionChoice::Only(Precision::AutocastFp16),
        PrecArg::Auto => PrecisionChoice::Auto,
    };
    Ok(req)
}

/// Checks `--gpus` and `--nodes` before the search.
fn check_gpus(args: &PlanArgs, batch: usize) -> Result<(), String> {
    let Some(n) = args.gpus else { return Ok(()) };
    if n == 0 || n > MAX_GPUS {
        return Err(format!("invalid --gpus {n}: give 1 to {MAX_GPUS}"));
    }
    if args.nodes == 0 || !n.is_multiple_of(args.nodes) {
        return Err(format!(
            "invalid --nodes {}: the {n} GPUs must spread evenly over the nodes",
            args.nodes
        ));
    }
    if batch == 0 || !batch.is_multiple_of(n) {
        return Err(format!(
            "invalid --gpus {n}: the global batch of {batch} must split evenly over --gpus {n} \
             GPUs"
        ));
    }
    Ok(())
}

/// The measured data-parallel runs (N virtual devices in this process) are for small N.
const MEASURED_GPUS: usize = 8;

pub fn run(args: PlanArgs) -> Result<ExitCode, String> {
    if args.list_models {
        print!("{}", list_models());
        return Ok(ExitCode::SUCCESS);
    }
    let started = Instant::now();
    let req = request(&args).map_err(|e| e.to_string())?;
    check_gpus(&args, req.batch)?;
    let outcome = {
        let mut bar = Bar(None);
        let report = plan::plan(&req, &mut bar);
        if let Some(b) = bar.0 {
            b.finish_and_clear();
        }
        report
    };
    let report = match outcome {
        Ok(r) => r,
        Err(e) if e.is_bad_input() => return Err(e.to_string()),
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    let shards = match args.gpus {
        None => None,
        Some(n) => {
            Some(plan::shard_table(&req, &report, n, args.nodes).map_err(|e| e.to_string())?)
        }
    };
    let data_parallel = match args.gpus {
        // The processes checkpoint as the configuration the estimate starts from.
        Some(n) if n > 1 && n <= MEASURED_GPUS => match plan::data_parallel(
            &req,
            n,
            report.decomposition.as_ref().map_or(plan::PlanKind::None, |d| d.checkpoint),
        ) {
            Ok(d) => Some(d),
            Err(e) if e.is_bad_input() => return Err(e.to_string()),
            Err(e) => {
                eprintln!("error: --gpus: {e}");
                return Ok(ExitCode::FAILURE);
            }
        },
        _ => None,
    };
    let verification = if args.verify {
        match plan::verify(&req, &report) {
            Ok(v) => Some(v),
            Err(e) => {
                eprintln!("error: --verify: {e}");
                return Ok(ExitCode::FAILURE);
            }
        }
    } else {
        None
    };
    if args.json {
        let json = serde_json::json!({
            "recommended": recommended(&report, shards.as_ref()),
            "plan": report,
            "gpus": shards,
            "verify": verification,
            "data_parallel": data_parallel
        });
        println!("{}", serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?);
    } else {
        print!("{}", render(&report));
        if let Some(t) = &shards {
            print!("{}", render_shards(t, report.usable));
        }
        if let Some(d) = &data_parallel {
            print!("{}", render_dp(d, report.usable));
        }
        if let Some(v) = &verification {
            let (pa, pr) = v.predicted;
            let (ma, mr) = v.measured;
            print!(
                "\nverify on {}: {} ({}), {} x {} samples\n{}",
                v.device,
                v.model,
                v.config,
                v.accum,
                v.micro,
                table(
                    &["", "peak alloc", "reserved"],
                    &[false, true, true],
                    vec![
                        vec!["predicted".into(), human_bytes(pa), human_bytes(pr)],
                        vec!["measured".into(), human_bytes(ma), human_bytes(mr)],
                    ],
                    "  ",
                )
            );
            println!(
                "  {} ({:.1} s)",
                if v.matches() {
                    "equal, to the byte".to_string()
                } else {
                    format!(
                        "DIFFERENT: allocated {}, reserved {}",
                        signed(ma as i64 - pa as i64),
                        signed(mr as i64 - pr as i64)
                    )
                },
                v.seconds
            );
        }
        println!(
            "\n(search {:.1} s, {} runs on the virtual device; total {:.1} s)",
            report.seconds,
            report.runs,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(match &verification {
        Some(v) if !v.matches() => ExitCode::FAILURE,
        _ => ExitCode::SUCCESS,
    })
}

/// The `recommended` entry of the JSON: what to set in PyTorch, in plain strings.
fn recommended(report: &PlanReport, shards: Option<&ShardTable>) -> serde_json::Value {
    if let Some(best) = report.recommended() {
        let sharded = shards.and_then(|t| t.first_fit().map(|r| (t, r)));
        return serde_json::json!({
            "gpus": 1,
            "strategy": "single-gpu",
            "precision": best.precision.name(),
            "checkpoint": best.plan.label(),
            "checkpoint_blocks": best.checkpoint,
            "allocator": best.allocator,
            "PYTORCH_CUDA_ALLOC_CONF": best.alloc_conf,
            "micro_batch": best.micro,
            "accumulation_steps": best.accum,
            "peak_reserved_bytes": best.peak_reserved,
            "pytorch": {
                "precision": best.precision.pytorch(),
                "checkpoint": best.checkpoint_advice(),
            },
            "with_gpus": sharded.map(|(t, r)| serde_json::json!({
                "gpus": t.gpus,
                "strategy": r.strategy,
                "micro_batch": r.micro,
                "accumulation_steps": r.accum,
            })),
        });
    }
    let answer = report.multi_gpu.as_ref();
    match answer.and_then(|a| a.table.as_ref().and_then(|t| t.first_fit().map(|r| (a, t, r)))) {
        Some((a, t, r)) => serde_json::json!({
            "gpus": t.gpus,
            "strategy": r.strategy,
            "precision": t.precision.name(),
            "micro_batch": r.micro,
            "accumulation_steps": r.accum,
            "peak_bytes_per_gpu": r.peak,
            "host_ram_per_node_bytes": r.host_ram_per_node,
            "answer": a.answer,
        }),
        None => serde_json::json!({
            "gpus": serde_json::Value::Null,
            "strategy": "does-not-fit",
            "answer": answer.map_or("nothing fits".to_string(), |a| a.answer.clone()),
        }),
    }
}

fn signed(bytes: i64) -> String {
    if bytes < 0 {
        format!("-{}", human_bytes(bytes.unsigned_abs()))
    } else {
        human_bytes(bytes as u64)
    }
}

/// Rows under a header, each column as wide as its widest cell; `right` aligns a column
/// right (numbers). Every line starts with `indent`.
fn table(header: &[&str], right: &[bool], rows: Vec<Vec<String>>, indent: &str) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in &rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let last = header.len().saturating_sub(1);
    let fmt = |cells: Vec<&str>| -> String {
        let mut line = indent.to_string();
        for (i, cell) in cells.iter().enumerate() {
            let w = widths[i];
            let pad = w.saturating_sub(cell.chars().count());
            if i > 0 {
                line.push_str("  ");
            }
            if right.get(i).copied().unwrap_or(false) {
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            } else {
                line.push_str(cell);
                if i < last {
                    line.push_str(&" ".repeat(pad));
                }
            }
        }
        line.trim_end().to_string() + "\n"
    };
    let mut out = fmt(header.to_vec());
    for r in &rows {
        out += &fmt(r.iter().map(String::as_str).collect());
    }
    out
}

/// The configuration table's columns (right-aligned: the numbers).
const HEADER: [&str; 12] = [
    "prec",
    "ckpt",
    "allocator",
    "steps x mb",
    "max mb",
    "peak alloc",
    "reserved",
    "headroom",
    "recomp",
    "cost",
    "schedule",
    "same as",
];
const RIGHT: [bool; 12] =
    [false, false, false, true, true, true, true, true, true, true, false, false];

fn cells(r: &Row) -> Vec<String> {
    vec![
        r.precision.label().into(),
        r.plan.label(),
        r.allocator.clone(),
        format!("{} x {}", r.accum, r.micro),
        r.max_micro.to_string(),
        human_bytes(r.peak_allocated),
        human_bytes(r.peak_reserved),
        signed(r.headroom),
        format!("{:.0}%", r.recompute * 100.0),
        format!("{:.2}", r.relative_cost),
        r.schedule.clone(),
        r.same_as.join("; "),
    ]
}

/// The `--gpus` estimate as text.
fn render_shards(t: &ShardTable, usable: u64) -> String {
    let mut out = format!(
        "\n{} GPU{} on {} node{} ({} per node), {}, global batch split as micro-batch x \
         accumulation x {} ({} samples per GPU per step); per-GPU estimate from {}'s \
         fixed and per-sample memory on one device:\n",
        t.gpus,
        if t.gpus == 1 { "" } else { "s" },
        t.nodes,
        if t.nodes == 1 { "" } else { "s" },
        t.gpus / t.nodes,
        t.precision.label(),
        t.gpus,
        t.per_gpu_batch,
        t.basis
    );
    let rows = t
        .rows
        .iter()
        .map(|r| {
            vec![
                r.strategy.to_string(),
                if r.fits { format!("{} x {}", r.accum, r.micro) } else { "-".into() },
                human_bytes(r.model_states),
                human_bytes(r.peak),
                human_bytes(r.host_ram_per_node),
                if r.fits { "fits".into() } else { "does not fit".into() },
            ]
        })
        .collect();
    out += &table(
        &["strategy", "steps x mb", "model states", "peak", "host RAM/node", ""],
        &[false, true, true, true, true, false],
        rows,
        "",
    );
    out += &format!(
        "  (peak = model states + the single-GPU plan's other fixed memory + activations per \
         sample x micro-batch; fits: within the usable {}; model states as the data-parallel \
         crate shards them, with offload as DeepSpeed's estimate_zero2/zero3_model_states_mem_needs \
         give them, host RAM with its 1.5 buffer factor)\n",
        human_bytes(usable)
    );
    out
}

/// The measured `--gpus` section as text.
fn render_dp(d: &DpPlan, usable: u64) -> String {
    let mut out = format!(
        "\nmeasured on {} virtual devices, {}, checkpointing {}, {} parameters, {} samples per \
         process at once:\n",
        d.nproc,
        d.precision.label(),
        d.checkpoint.label(),
        d.params,
        d.per_process_batch,
    );
    let rows = d
        .rows
        .iter()
        .map(|r| {
            vec![
                r.strategy.to_string(),
                human_bytes(r.peak_allocated),
                human_bytes(r.peak_reserved),
                human_bytes(r.model_states),
                r.analytic_model_states.map_or("-".into(), human_bytes),
                human_bytes(r.bytes_per_step),
                format!("{:.3}", r.bytes_per_param_per_step),
                r.analytic_bytes_per_param_per_step.map_or("-".into(), |a| format!("{a:.3}")),
                if r.fits { "".into() } else { "does not fit".into() },
            ]
        })
        .collect();
    out += &table(
        &[
            "strategy",
            "peak alloc",
            "reserved",
            "model states",
            "(analytic)",
            "sent/step",
            "B/param",
            "(analytic)",
            "",
        ],
        &[false, true, true, true, true, true, true, true, false],
        rows,
        "",
    );
    out += &format!("  (fits: peak reserved within the usable {})\n", human_bytes(usable));
    for n in &d.notes {
        out += &format!("  - {n}\n");
    }
    out
}

/// The report as text.
pub fn render(r: &PlanReport) -> String {
    let mut out = format!(
        "plan: {}\n  {} parameters, global batch {}, {}, device {} - reserve {} = {} usable\n\n",
        r.model,
        r.params,
        r.batch,
        r.optimizer.label(),
        human_bytes(r.device_memory),
        human_bytes(r.reserve),
        human_bytes(r.usable)
    );
    if r.fitting.is_empty() {
        out += "NOTHING FITS one device.\n";
    } else {
        out += &format!(
            "fits ({} configurations, recommended first; max mb: the largest micro-batch that \
             fits, steps x mb: the split of the global batch into the largest that divides it):\n",
            r.fitting.len() + r.fitting.iter().map(|f| f.same_as.len()).sum::<usize>()
        );
        let rows = r.fitting.iter().map(cells).collect();
        out += &table(&HEADER, &RIGHT, rows, "");
        let best = &r.fitting[0];
        out += &format!(
            "\nrecommended: {} with {} (PYTORCH_CUDA_ALLOC_CONF={})\n  precision: {}\n  \
             checkpointing: {}\n  why: {}\n",
            best.label(),
            if best.accum == 1 {
                format!("the whole batch of {} at once", best.micro)
            } else {
                format!("{} micro-batches of {} (gradient accumulation)", best.accum, best.micro)
            },
            if best.alloc_conf.is_empty() { "<unset>" } else { &best.alloc_conf },
            best.precision.pytorch(),
            best.checkpoint_advice(),
            r.why
        );
    }
    if !r.not_fitting.is_empty() {
        out += &format!(
            "\ndoes not fit ({} configurations; headroom < 0 is the shortfall):\n",
            r.not_fitting.len() + r.not_fitting.iter().map(|f| f.same_as.len()).sum::<usize>()
        );
        let rows = r.not_fitting.iter().map(cells).collect();
        out += &table(&HEADER, &RIGHT, rows, "");
    }
    if let Some(m) = &r.multi_gpu {
        out += &format!("\nseveral GPUs: {}\n", m.answer);
        if let Some(t) = &m.table {
            out += &render_shards(t, r.usable);
        }
    }
    if let Some(d) = &r.decomposition {
        out += &format!(
            "\nmemory = fixed {} + {} per sample ({}, slope of the peak allocated from 8 to 16 samples)\n",
            human_bytes(d.fixed),
            human_bytes(d.per_sample),
            d.config
        );
    }
    if !r.suggestions.is_empty() {
        out += "\nwhat would fit:\n";
        for s in &r.suggestions {
            out += &format!("  - {s}\n");
        }
    }
    out += "\nassumptions:\n";
    for s in &r.assumptions {
        out += &format!("  - {s}\n");
    }
    out += "notes:\n";
    for s in &r.notes {
        out += &format!("  - {s}\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: PlanArgs,
    }

    fn outcome(argv: &[&str]) -> Result<ExitCode, String> {
        let mut full = vec!["plan"];
        full.extend(argv);
        run(Cli::try_parse_from(full).expect("parses").args)
    }

    #[test]
    fn bad_input_is_an_error_naming_the_problem() {
        // main() prints these and exits with status 2.
        let dir = std::env::temp_dir().join(format!("vram-plan-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("bad.toml");
        std::fs::write(
            &file,
            "input = { kind = \"features\", dim = 4 }\n[[layers]]\nkind = \"lstm\"\n",
        )
        .unwrap();
        let file = file.to_str().unwrap();
        for (argv, needle) in [
            (
                vec!["--model", "gpt5", "--batch", "8", "--device-memory", "8GiB"],
                "unknown model `gpt5`",
            ),
            (
                vec!["--model", "gpt", "--batch", "8", "--device-memory", "eight"],
                "malformed size `eight`",
            ),
            (
                vec![
                    "--model",
                    "gpt2-medium",
                    "--batch",
                    "8",
                    "--device-memory",
                    "1GiB",
                    "--reserve",
                    "512MiB",
                ],
                "the model's parameters alone (",
            ),
            (
                vec!["--model-file", file, "--batch", "8", "--device-memory", "1GiB"],
                "layer 0 (kind `lstm`)",
            ),
        ] {
            let e = outcome(&argv).expect_err("bad input");
            assert!(e.contains(needle), "{argv:?}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hf_configs_plan_and_bad_ones_name_the_key() {
        let dir = std::env::temp_dir().join(format!("vram-plan-hf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path.to_str().unwrap().to_string()
        };
        let missing = write("missing.json", r#"{"model_type": "llama", "hidden_size": 64}"#);
        let unknown = write("unknown.json", r#"{"model_type": "bert"}"#);
        for (file, needle) in
            [(&missing, "missing key `intermediate_size`"), (&unknown, "unknown model_type `bert`")]
        {
            let argv = ["--hf-config", file, "--batch", "8", "--device-memory", "8GiB"];
            let e = outcome(&argv).expect_err("bad config");
            assert!(e.contains(needle) && e.contains(file.as_str()), "{e}");
        }
        // A tiny Qwen2-like model (grouped queries, q/k/v biases, tied head) plans on the
        // virtual device and its reduced twin verifies on the host.
        let tiny = write(
            "tiny.json",
            r#"{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 128, "max_position_embeddings": 64, "tie_word_embeddings": true}"#,
        );
        let argv = [
            "--hf-config",
            &tiny,
            "--seq",
            "16",
            "--batch",
            "4",
            "--device-memory",
            "64MiB",
            "--reserve",
            "0",
            "--verify",
            "--json",
        ];
        assert_eq!(outcome(&argv).unwrap(), ExitCode::SUCCESS);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_small_plan_runs_and_verifies_on_the_host() {
        let code = outcome(&[
            "--model",
            "gpt",
            "--batch",
            "4",
            "--device-memory",
            "64MiB",
            "--reserve",
            "0",
            "--verify",
            "--json",
        ])
        .unwrap();
        assert_eq!(code, ExitCode::SUCCESS);
    }

    #[test]
    fn sizes_have_one_grammar_and_list_models_names_every_preset() {
        assert_eq!(vram_harness::parse_size("8G").unwrap(), 8 << 30);
        assert_eq!(vram_harness::parse_size("8GiB").unwrap(), 8 << 30);
        assert_eq!(vram_harness::parse_size("8GB").unwrap(), 8_000_000_000);
        assert_eq!(vram_harness::parse_size("64TiB").unwrap(), 64 << 40);
        let help = device_memory_help();
        assert!(help.contains(vram_harness::SIZE_UNITS) && help.contains("8GB is 7.45 GiB"));
        let list = list_models();
        for p in Arch::presets() {
            assert!(list.contains(p.name) && list.contains(p.description), "{}", p.name);
        }
        assert_eq!(outcome(&["--list-models"]).unwrap(), ExitCode::SUCCESS);
        let e = outcome(&["--model", "gpt", "--batch", "4", "--device-memory", "0"]).unwrap_err();
        assert!(e.contains("--device-memory: malformed size `0`: a size must be at least 1 byte"));
        let e = outcome(&["--model", "gpt", "--batch", "4", "--device-memory", "2PB"]).unwrap_err();
        assert!(e.contains("unknown unit"), "{e}");
        let e = outcome(&["--model", "gpt", "--batch", "4", "--device-memory", "1000000TiB"])
            .unwrap_err();
        assert!(e.contains("is not a GPU"), "{e}");
        let e =
            outcome(&["--model", "gpt", "--batch", "4", "--device-memory", "8GiB", "--gpus", "0"])
                .unwrap_err();
        assert!(e.contains("--gpus"), "{e}");
    }

    /// The recommendation a PyTorch user pastes, in plain strings; the table's columns line
    /// up whatever the cells' widths.
    #[test]
    fn the_recommendation_is_plain_and_the_table_lines_up() {
        let model = plan::model_from_args("gpt", &ModelOverrides::default()).unwrap();
        let mut req = PlanRequest::new(model, 8, 64 << 20);
        req.reserve = 0;
        let report = plan::plan(&req, &mut plan::NoProgress).unwrap();
        let r = recommended(&report, None);
        assert_eq!(r["gpus"], 1);
        for key in ["precision", "checkpoint", "allocator", "strategy"] {
            let v = r[key].as_str().unwrap_or_else(|| panic!("{key}: {r}"));
            assert!(!v.contains("::") && !v.starts_with(char::is_uppercase), "{key}: {v}");
        }
        assert_eq!(
            r["micro_batch"].as_u64().unwrap() * r["accumulation_steps"].as_u64().unwrap(),
            8
        );
        let text = render(&report);
        assert!(text.contains("recommended:") && text.contains("checkpointing:"), "{text}");
        let t = table(
            &["a", "bb", "c"],
            &[false, true, false],
            vec![
                vec!["long cell".into(), "1".into(), "x".into()],
                vec!["s".into(), "12345".into(), "y".into()],
            ],
            "",
        );
        let lines: Vec<&str> = t.lines().collect();
        let col = |l: &str, c: char| l.rfind(c).unwrap();
        assert_eq!(col(lines[1], '1'), col(lines[2], '5'), "{t}");
        assert_eq!(col(lines[0], 'c'), col(lines[1], 'x'), "{t}");
    }

    #[test]
    fn nproc_reports_data_parallel_and_refuses_a_batch_that_does_not_split() {
        let base =
            ["--model", "gpt", "--device-memory", "64MiB", "--reserve", "0", "--precision", "fp32"];
        let with = |extra: &[&str]| {
            let mut v = base.to_vec();
            v.extend(extra);
            outcome(&v)
        };
        assert_eq!(with(&["--batch", "4", "--nproc", "2"]).unwrap(), ExitCode::SUCCESS);
        let e = with(&["--batch", "5", "--nproc", "2"]).unwrap_err();
        assert!(e.contains("split evenly over --gpus 2"), "{e}");
    }
}

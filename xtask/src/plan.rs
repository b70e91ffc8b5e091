//! `cargo xtask plan`: which batch split, checkpoint plan, precision and allocator settings
//! fit a model on a GPU of a given memory, found on the virtual device.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use vram_harness::human_bytes;
use vram_harness::models::Arch;
use vram_harness::plan::{
    self, ALLOCATOR_SETTINGS, DpPlan, ModelOverrides, OptimizerKind, PLAN_KINDS, PlanError,
    PlanProgress, PlanReport, PlanRequest, Precision, PrecisionChoice, Row,
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
        required_unless_present_any = ["model_file", "hf_config"],
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
    /// Global batch: samples per optimizer step.
    #[arg(long)]
    batch: usize,
    /// The GPU's memory, e.g. 24GiB.
    #[arg(long, value_name = "SIZE")]
    device_memory: String,
    /// Memory kept back for the CUDA context, library workspaces and other processes.
    #[arg(long, value_name = "SIZE", default_value = "1GiB")]
    reserve: String,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptArg::Adamw)]
    optimizer: OptArg,
    #[arg(long, value_enum, default_value_t = PrecArg::Auto, help = precision_help())]
    precision: PrecArg,
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
    /// Also report data parallel training over N processes (one GPU each): per-process
    /// memory of DDP and ZeRO-1/2/3 and the bytes their collectives move per step, measured
    /// on N virtual devices.
    #[arg(long, value_name = "N")]
    nproc: Option<usize>,
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
    vram_harness::parse_size(s).map_err(|_| PlanError::MalformedSize { what, input: s.into() })
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
    let model = match (&args.model, &args.model_file, &args.hf_config) {
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
    let mut req =
        PlanRequest::new(model, args.batch, size("--device-memory", &args.device_memory)?);
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

pub fn run(args: PlanArgs) -> Result<ExitCode, String> {
    let started = Instant::now();
    let outcome = request(&args).and_then(|req| {
        let mut bar = Bar(None);
        let report = plan::plan(&req, &mut bar);
        if let Some(b) = bar.0 {
            b.finish_and_clear();
        }
        Ok((req, report?))
    });
    let (req, report) = match outcome {
        Ok(r) => r,
        Err(e) if e.is_bad_input() => return Err(e.to_string()),
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    let data_parallel = match args.nproc {
        None => None,
        Some(n) => match plan::data_parallel(&req, n) {
            Ok(d) => Some(d),
            Err(e) if e.is_bad_input() => return Err(e.to_string()),
            Err(e) => {
                eprintln!("error: --nproc: {e}");
                return Ok(ExitCode::FAILURE);
            }
        },
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
            "plan": report, "verify": verification, "data_parallel": data_parallel
        });
        println!("{}", serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?);
    } else {
        print!("{}", render(&report));
        if let Some(d) = &data_parallel {
            print!("{}", render_dp(d, report.usable));
        }
        if let Some(v) = &verification {
            println!(
                "\nverify on {}: {} ({}), {} x {} samples\n  predicted peak allocated {} reserved {}\n  measured  peak allocated {} reserved {}\n  {} ({:.1} s)",
                v.device,
                v.model,
                v.config,
                v.accum,
                v.micro,
                v.predicted.0,
                v.predicted.1,
                v.measured.0,
                v.measured.1,
                if v.matches() { "equal" } else { "DIFFERENT" },
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

fn signed(bytes: i64) -> String {
    if bytes < 0 {
        format!("-{}", human_bytes(bytes.unsigned_abs()))
    } else {
        human_bytes(bytes as u64)
    }
}

fn line(r: &Row) -> String {
    format!(
        "{:<5} {:<8} {:<15} {:>4} x {:<5} {:>10} {:>10} {:>10} {:>8} {:>6.2} {:>6}   {}",
        r.precision.label(),
        r.plan.label(),
        r.allocator,
        r.accum,
        r.micro,
        human_bytes(r.peak_allocated),
        human_bytes(r.peak_reserved),
        signed(r.headroom),
        format!("{:.0}%", r.recompute * 100.0),
        r.relative_cost,
        r.max_micro,
        r.schedule
    )
}

/// The `--nproc` section as text.
fn render_dp(d: &DpPlan, usable: u64) -> String {
    let mut out = format!(
        "\ndata parallel over {} processes (one GPU each), {}, {} parameters, {} samples per \
         process:\n{:<8} {:>12} {:>12} {:>16} {:>10} {:>22} {:>12}\n",
        d.nproc,
        d.precision.label(),
        d.params,
        d.per_process_batch,
        "strategy",
        "peak alloc",
        "reserved",
        "model states",
        "(analytic)",
        "sent/step (B/param)",
        "(analytic)"
    );
    for r in &d.rows {
        out += &format!(
            "{:<8} {:>12} {:>12} {:>16} {:>10} {:>12} ({:>7.3}) {:>12}{}\n",
            r.strategy,
            human_bytes(r.peak_allocated),
            human_bytes(r.peak_reserved),
            human_bytes(r.model_states),
            r.analytic_model_states.map_or("-".into(), human_bytes),
            human_bytes(r.bytes_per_step),
            r.bytes_per_param_per_step,
            r.analytic_bytes_per_param_per_step.map_or("-".into(), |a| format!("{a:.3}")),
            if r.fits { "" } else { "   does not fit" }
        );
    }
    out += &format!("  (fits: peak reserved within the usable {})\n", human_bytes(usable));
    for n in &d.notes {
        out += &format!("  - {n}\n");
    }
    out
}

/// The report as text.
pub fn render(r: &PlanReport) -> String {
    let mut out = format!(
        "plan: {}\n  {} parameters, global batch {}, {:?}, device {} - reserve {} = {} usable\n\n",
        r.model,
        r.params,
        r.batch,
        r.optimizer,
        human_bytes(r.device_memory),
        human_bytes(r.reserve),
        human_bytes(r.usable)
    );
    let header = format!(
        "{:<5} {:<8} {:<15} {:>12} {:>10} {:>10} {:>10} {:>8} {:>6} {:>6}   {}\n",
        "prec",
        "ckpt",
        "allocator",
        "steps x mb",
        "peak alloc",
        "reserved",
        "headroom",
        "recomp",
        "cost",
        "max mb",
        "schedule"
    );
    if r.fitting.is_empty() {
        out += "NOTHING FITS.\n";
    } else {
        out += &format!("fits ({} configurations, recommended first):\n", r.fitting.len());
        out += &header;
        for (i, row) in r.fitting.iter().enumerate() {
            out += &line(row);
            out += if i == 0 { "   <- recommended\n" } else { "\n" };
        }
        let best = &r.fitting[0];
        out += &format!(
            "\nrecommended: {} with {} (PYTORCH_CUDA_ALLOC_CONF={})\n  why: {}\n",
            best.label(),
            if best.accum == 1 {
                format!("the whole batch of {} at once", best.micro)
            } else {
                format!("{} micro-batches of {} (gradient accumulation)", best.accum, best.micro)
            },
            if best.alloc_conf.is_empty() { "<unset>" } else { &best.alloc_conf },
            r.why
        );
    }
    if !r.not_fitting.is_empty() {
        out += &format!(
            "\ndoes not fit ({} configurations; headroom < 0 is the shortfall):\n",
            r.not_fitting.len()
        );
        out += &header;
        for row in &r.not_fitting {
            out += &line(row);
            out += "\n";
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
                "too small for the parameters alone",
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
        assert!(e.contains("split evenly over --nproc 2"), "{e}");
    }
}

//! `cargo xtask`: the project's tasks. `cargo xtask bench` runs every experiment and writes
//! the report of claims against measurements; `cargo xtask replay` replays a PyTorch memory
//! snapshot through vram's allocator under the recorded settings and others; `cargo xtask
//! launch` starts N local processes of a command with torchrun's variables.

mod launch;
mod plan;
mod replay;
mod twin;

use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use vram_harness::{BackendChoice, BenchOptions, Outcome, Progress};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "vram project tasks",
    bin_name = "cargo xtask",
    version,
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the experiments (one per technique) and write <out>/REPORT.md.
    Bench(BenchArgs),
    /// Replay a PyTorch memory snapshot under the recorded and other allocator settings.
    ///
    /// Reads a pickle written by torch.cuda.memory._dump_snapshot(), replays its allocation
    /// trace through vram's allocator, checks that the recorded settings reproduce its
    /// segments, compares other settings (peak reserved, fragmentation, device calls, OOMs)
    /// and draws the memory timeline.
    Replay(replay::ReplayArgs),
    /// Find the batch split, checkpoint plan, precision and allocator settings that fit a
    /// model on a GPU of a given memory, by running each candidate on the virtual device.
    Plan(Box<plan::PlanArgs>),
    /// Train the reference models in vram and in PyTorch (xtask/twin/torch_twin.py) from the
    /// same weights on the same batch: peaks, step times and every step's loss side by side.
    Twin(twin::TwinArgs),
    /// Start N local processes of a command as the ranks of one job, as `torchrun
    /// --standalone --nproc-per-node N` does.
    ///
    /// Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    /// MASTER_PORT (a free port unless given); vram_parallel's ProcessGroupConfig::from_env
    /// reads them. When one process fails, the others are killed and the launcher exits
    /// with status 1 naming the rank.
    Launch(launch::LaunchArgs),
}

/// `--quick`'s help, with the number of experiments the registry holds.
fn quick_help() -> String {
    format!(
        "Reduced sizes (CI): about 30 seconds for all {} experiments on a shared 2-core host, \
         against about 2.5 minutes for the full run (plus about 3 minutes for the first release \
         build)",
        vram_harness::techniques().count()
    )
}

/// `--device-memory`'s help, with the default and the units `parse_size` takes.
fn device_memory_help() -> String {
    format!(
        "Simulated device capacity on the host backend (default {}): bytes, or a number with \
         a unit, {}; e.g. 24GiB. Experiments whose workload grows with it refuse capacities \
         beyond what the host can simulate, naming the limit",
        vram_harness::human_bytes(vram_harness::DEFAULT_HOST_DEVICE_MEMORY),
        vram_harness::SIZE_UNITS
    )
}

#[derive(clap::Args)]
struct BenchArgs {
    #[arg(long, help = quick_help())]
    quick: bool,
    /// Run only these experiment ids, comma-separated (spaces around ids are ignored; each id
    /// once).
    #[arg(long, value_name = "ID,...")]
    only: Option<String>,
    /// List the experiment ids and exit.
    #[arg(long)]
    list: bool,
    /// Output folder for <id>.json files and REPORT.md.
    #[arg(long, default_value = "results", value_name = "DIR")]
    out: PathBuf,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Seed for synthetic data and initialisation.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_name = "SIZE", help = device_memory_help())]
    device_memory: Option<String>,
    /// Keep what an earlier run into the same --out finished (its bench-run.json says what,
    /// and with which backend, device, mode and seed: they must be this run's) and run the
    /// rest. The report and bench-run.json are rewritten after each experiment, so a run
    /// stopped part-way (a time limit, Ctrl-C) leaves a report of what finished.
    #[arg(long)]
    resume: bool,
    /// Run nothing: write <out>/REPORT.md again from the results a run left in --out (its
    /// bench-run.json names the backend, device, mode and seed the report states), e.g. a
    /// GPU's results on a machine without one after the report's code changed.
    #[arg(long, conflicts_with_all = ["resume", "quick", "backend", "seed", "device_memory"])]
    report_only: bool,
}

/// Where to run, for `bench` and `twin`: the harness's [`BackendChoice`], one value each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    /// CUDA if usable, else the host
    Auto,
    /// the host
    Cpu,
    /// CUDA, or fail
    Cuda,
}

impl From<BackendArg> for BackendChoice {
    fn from(b: BackendArg) -> Self {
        match b {
            BackendArg::Auto => BackendChoice::Auto,
            BackendArg::Cpu => BackendChoice::Cpu,
            BackendArg::Cuda => BackendChoice::Cuda,
        }
    }
}

/// Plain lines: for logs and CI.
struct Lines;

/// A progress bar over the experiments, when stderr is a terminal.
struct Bar(indicatif::ProgressBar);

impl Bar {
    fn new() -> Self {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{bar:30}] {pos}/{len} {msg} ({elapsed} elapsed)",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        bar.enable_steady_tick(Duration::from_millis(120));
        Bar(bar)
    }
}

impl Progress for Bar {
    fn note(&mut self, message: &str) {
        self.0.println(format!("note: {message}"));
    }
    fn start(&mut self, id: &str, index: usize, total: usize, left: Duration) {
        self.0.set_length(total as u64);
        self.0.set_position(index as u64);
        self.0.set_message(format!("{id} (about {} left)", minutes(left)));
    }
    fn finish(&mut self, id: &str, outcome: &Outcome, elapsed: Duration) {
        self.0.println(describe(id, outcome, elapsed));
        self.0.inc(1);
    }
}

/// `1 min 20 s`, `45 s`.
fn minutes(d: Duration) -> String {
    let s = d.as_secs_f64().round() as u64;
    if s >= 60 { format!("{} min {:02} s", s / 60, s % 60) } else { format!("{s} s") }
}

/// An experiment's end: its status line, then one line per claim with the verdict.
fn describe(id: &str, outcome: &Outcome, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64();
    match outcome {
        Outcome::Done { result, .. } => {
            let mut text = format!("[done] {id} in {secs:.1} s");
            for c in &result.claims {
                text.push_str(&format!("\n    {:<14} {}", c.verdict.as_str(), c.claim));
            }
            text
        }
        Outcome::Failed(e) => format!("[FAILED] {id} after {secs:.1} s: {e}"),
    }
}

impl Progress for Lines {
    fn note(&mut self, message: &str) {
        eprintln!("note: {message}");
    }
    fn start(&mut self, id: &str, index: usize, total: usize, left: Duration) {
        eprintln!("[{}/{}] {id} ... (about {} left)", index + 1, total, minutes(left));
    }
    fn finish(&mut self, id: &str, outcome: &Outcome, elapsed: Duration) {
        eprintln!("{}", describe(id, outcome, elapsed));
    }
}

fn bench(args: BenchArgs) -> Result<ExitCode, String> {
    if args.list {
        for t in vram_harness::list() {
            println!("{:<20} {}", t.id, t.name);
        }
        return Ok(ExitCode::SUCCESS);
    }
    let device_memory = match args.device_memory.as_deref() {
        None => None,
        Some(s) => Some(vram_harness::parse_size(s).map_err(|e| e.to_string())?),
    };
    let only = match args.only.as_deref() {
        None => None,
        Some(list) => Some(vram_harness::parse_only(list).map_err(|e| e.to_string())?),
    };
    let opts = BenchOptions {
        quick: args.quick,
        only,
        out: args.out,
        backend: args.backend.into(),
        seed: args.seed,
        device_memory,
        resume: args.resume,
    };
    if args.report_only {
        let summary = vram_harness::render_report(&opts, &mut Lines).map_err(|e| e.to_string())?;
        let (with_results, failed) = (summary.outcomes.len() - summary.failed(), summary.failed());
        println!(
            "bench: nothing run; report of {with_results} experiments' results ({failed} failed \
             in that run): {}",
            summary.report.display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let summary = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        let mut bar = Bar::new();
        let summary = vram_harness::run(&opts, &mut bar);
        bar.0.finish_and_clear();
        summary
    } else {
        vram_harness::run(&opts, &mut Lines)
    }
    .map_err(|e| e.to_string())?;
    let done = |resumed: bool| {
        summary
            .outcomes
            .iter()
            .filter(|(_, o, _)| matches!(o, Outcome::Done { resumed: r, .. } if *r == resumed))
            .count()
    };
    let kept = match done(true) {
        0 => String::new(),
        n => format!(" ({n} more kept from an earlier run)"),
    };
    println!(
        "bench: {} ran{kept}, {} failed; report: {}",
        done(false),
        summary.failed(),
        summary.report.display()
    );
    Ok(if summary.failed() > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => bench(args),
        Command::Replay(args) => replay::run(args),
        Command::Plan(args) => plan::run(*args),
        Command::Twin(args) => twin::run(args),
        Command::Launch(args) => launch::run(args),
    };
    result.unwrap_or_else(|message| {
        eprintln!("error: {message}");
        ExitCode::from(2)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn usage_errors_exit_with_status_2() {
        for argv in [
            vec!["cargo xtask", "replay"],
            vec!["cargo xtask", "replay", "a.pickle", "--device", "one"],
            vec!["cargo xtask", "replay", "a.pickle", "--colour"],
        ] {
            let err = Cli::try_parse_from(&argv).err().expect("a usage error");
            assert_eq!(err.exit_code(), 2, "{argv:?}");
        }
        let cli = Cli::try_parse_from([
            "cargo xtask",
            "replay",
            "a.pickle",
            "--conf",
            "expandable_segments:True",
            "--conf",
            "max_split_size_mb:256",
            "--capacity",
            "24GiB",
        ])
        .unwrap();
        let Command::Replay(args) = cli.command else { panic!("not replay") };
        assert_eq!(args.confs.len(), 2);
        assert_eq!(args.capacity.as_deref(), Some("24GiB"));
    }

    #[test]
    fn only_is_trimmed_and_checked_and_sizes_take_tib() {
        let cli = Cli::try_parse_from([
            "cargo xtask",
            "bench",
            "--only",
            "fragmentation, batch-size",
            "--device-memory",
            "1TiB",
        ])
        .unwrap();
        let Command::Bench(args) = cli.command else { panic!("not bench") };
        let only = vram_harness::parse_only(args.only.as_deref().unwrap()).unwrap();
        assert_eq!(only, ["fragmentation", "batch-size"]);
        assert_eq!(
            vram_harness::parse_size(args.device_memory.as_deref().unwrap()).unwrap(),
            1 << 40
        );
        assert!(vram_harness::parse_only("fragmentation,fragmentation").is_err());
    }

    /// What `cargo xtask <argv> --help` prints.
    fn help(argv: &[&str]) -> String {
        let mut full = vec!["cargo xtask"];
        full.extend(argv);
        full.push("--help");
        match Cli::try_parse_from(&full) {
            Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => e.to_string(),
            _ => panic!("{full:?} shows no help"),
        }
    }

    #[test]
    fn help_texts_come_from_the_registries() {
        let bench = help(&["bench"]);
        let n = vram_harness::techniques().count();
        assert!(bench.contains(&format!("all {n} experiments")), "{bench}");
        assert!(bench.contains(vram_harness::SIZE_UNITS), "{bench}");
        for value in BackendArg::value_variants() {
            let name = value.to_possible_value().expect("not hidden").get_name().to_string();
            assert!(bench.contains(&format!("{name}:")), "{name}: {bench}");
        }
        let plan = help(&["plan"]);
        let twin = help(&["twin"]);
        for p in vram_harness::models::Arch::presets() {
            assert!(plan.contains(p.name), "{}: {plan}", p.name);
            assert!(plan.contains(p.description), "{}: {plan}", p.name);
            for alias in p.aliases {
                assert!(plan.contains(&format!("`{alias}`")), "{alias}: {plan}");
            }
            assert!(twin.contains(p.name), "{}: {twin}", p.name);
        }
        for (label, conf) in vram_harness::plan::ALLOCATOR_SETTINGS {
            assert!(plan.contains(label) && plan.contains(conf), "{label}: {plan}");
        }
        assert!(help(&["twin"]).contains("cpu:"), "the backends' help is bench's");
    }

    #[test]
    fn time_left_reads_in_minutes_and_seconds() {
        assert_eq!(minutes(Duration::from_secs(45)), "45 s");
        assert_eq!(minutes(Duration::from_secs_f64(80.4)), "1 min 20 s");
    }
}

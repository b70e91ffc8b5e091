//! Running a selection of experiments and writing their results.

use crate::backend::{self, Backend, BackendChoice};
use crate::experiments::{self, Descriptor, EXPERIMENTS};
use crate::report;
use crate::techniques::{Technique, techniques};
use crate::{ExperimentResult, HarnessError};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use vram_alloc::human_bytes;

/// Simulated device capacity on the host backend when none is given: 4 GiB.
pub const DEFAULT_HOST_DEVICE_MEMORY: u64 = 4 << 30;

/// What `cargo xtask bench` was asked to do.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Reduced sizes (CI).
    pub quick: bool,
    /// Run only these ids (all when `None`).
    pub only: Option<Vec<String>>,
    /// Output folder.
    pub out: PathBuf,
    /// Backend choice.
    pub backend: BackendChoice,
    /// Seed for data and initialisation.
    pub seed: u64,
    /// Simulated device capacity on the host backend.
    pub device_memory: Option<u64>,
    /// Keep the experiments that an earlier run with the same settings finished in `out`
    /// (its `bench-run.json` says which) and run the rest.
    pub resume: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            quick: false,
            only: None,
            out: PathBuf::from("results"),
            backend: BackendChoice::Auto,
            seed: 0,
            device_memory: None,
            resume: false,
        }
    }
}

/// What an experiment gets to run with.
#[derive(Clone, Debug)]
pub struct Context {
    /// Where it runs.
    pub backend: Backend,
    /// Reduced sizes.
    pub quick: bool,
    /// Seed for data and initialisation.
    pub seed: u64,
    /// Device capacity in bytes (simulated on the host backend).
    pub device_memory: u64,
}

/// How one experiment ended.
#[derive(Debug)]
pub enum Outcome {
    /// It ran; its results (and its plot, when it has one) were written.
    Done {
        /// The results.
        result: Box<ExperimentResult>,
        /// Whether `<out>/<id>.svg` was written.
        plot: bool,
        /// Whether it ran in an earlier run that `--resume` kept.
        resumed: bool,
    },
    /// It failed, or its results could not be written.
    Failed(HarnessError),
}

/// The outcome of a bench run.
#[derive(Debug)]
pub struct BenchSummary {
    /// Where the experiments ran.
    pub backend: Backend,
    /// Each selected technique with its outcome and wall time.
    pub outcomes: Vec<(&'static Technique, Outcome, Duration)>,
    /// The report written.
    pub report: PathBuf,
}

impl BenchSummary {
    /// Number of experiments that failed.
    pub fn failed(&self) -> usize {
        self.outcomes.iter().filter(|(_, o, _)| matches!(o, Outcome::Failed(_))).count()
    }
}

/// Progress events, so the command line can draw bars or print lines.
pub trait Progress {
    /// A note for the user (e.g. a backend fallback).
    fn note(&mut self, message: &str);
    /// An experiment starts; `left` estimates the time until the whole run ends, this
    /// experiment included (expected durations, scaled by how the finished ones compared).
    fn start(&mut self, id: &str, index: usize, total: usize, left: Duration);
    /// An experiment ended.
    fn finish(&mut self, id: &str, outcome: &Outcome, elapsed: Duration);
}

/// Every technique, in the order of the report (each has its experiment).
pub fn list() -> Vec<&'static Technique> {
    techniques().collect()
}

/// Splits a comma-separated list of experiment ids (`--only`), trimming spaces around each.
///
/// # Errors
///
/// [`HarnessError::UnknownExperiment`] for an id that does not exist (or an empty one),
/// [`HarnessError::DuplicateExperiment`] for an id given twice.
pub fn parse_only(list: &str) -> Result<Vec<String>, HarnessError> {
    let ids: Vec<String> = list.split(',').map(|s| s.trim().to_string()).collect();
    select(&ids)?;
    Ok(ids)
}

fn known_ids() -> String {
    techniques().map(|t| t.id).collect::<Vec<_>>().join(", ")
}

/// The experiments for `ids`, in the order given.
fn select(ids: &[String]) -> Result<Vec<&'static dyn Descriptor>, HarnessError> {
    let mut seen = Vec::new();
    for id in ids {
        let id = id.trim();
        let Some(e) = experiments::find(id) else {
            return Err(HarnessError::UnknownExperiment { id: id.to_string(), known: known_ids() });
        };
        if seen.iter().any(|s: &&dyn Descriptor| s.technique().id == id) {
            return Err(HarnessError::DuplicateExperiment { id: id.to_string() });
        }
        seen.push(e);
    }
    Ok(seen)
}

/// Validates the selection, runs the experiments, writes `<out>/<id>.json` and
/// `<out>/REPORT.md`. A failing experiment does not stop the others.
///
/// # Errors
///
/// An unknown or repeated id, a simulated capacity an experiment cannot run with on the host,
/// an unusable backend, or a report that cannot be written; nothing runs then (except for
/// the report).
pub fn run(opts: &BenchOptions, progress: &mut dyn Progress) -> Result<BenchSummary, HarnessError> {
    let selected = selection(opts)?;
    let backend = backend::resolve(opts.backend, &mut |m| progress.note(m))?;
    let device_memory = match &backend {
        Backend::Cuda { total_bytes, .. } => *total_bytes,
        Backend::Cpu => opts.device_memory.unwrap_or(DEFAULT_HOST_DEVICE_MEMORY),
    };
    if matches!(backend, Backend::Cpu) {
        check_capacity(&selected, device_memory)?;
    }
    let ctx =
        Context { backend: backend.clone(), quick: opts.quick, seed: opts.seed, device_memory };
    std::fs::create_dir_all(&opts.out)
        .map_err(|source| HarnessError::Io { path: opts.out.clone(), source })?;

    let mut manifest = RunManifest::new(&backend, &ctx);
    let earlier =
        if opts.resume { RunManifest::load(&opts.out, &manifest, progress)? } else { None };
    // What an earlier run finished, for each selected experiment (None: run it).
    let mut kept: Vec<Option<(Outcome, Duration)>> = selected
        .iter()
        .map(|e| {
            let id = e.technique().id;
            earlier.as_ref().and_then(|m| m.kept(id, &opts.out, progress, true))
        })
        .collect();
    if let Some(m) = earlier {
        // Entries of experiments this run leaves alone stay, so that a later `--resume`
        // still finds them.
        manifest.finished =
            m.finished.into_iter().filter(|f| f.status == RunStatus::Done).collect();
    }

    let expected: Vec<f64> = selected
        .iter()
        .zip(&kept)
        .map(|(e, k)| if k.is_some() { 0.0 } else { e.expected_secs(opts.quick) })
        .collect();
    let (mut spent, mut expected_done) = (0.0, 0.0);
    let mut outcomes = Vec::with_capacity(selected.len());
    for (i, e) in selected.iter().enumerate() {
        let t = e.technique();
        if let Some((outcome, elapsed)) = kept[i].take() {
            progress.note(&format!(
                "resumed `{}`: kept {} from an earlier run ({:.1} s)",
                t.id,
                opts.out.join(format!("{}.json", t.id)).display(),
                elapsed.as_secs_f64()
            ));
            outcomes.push((t, outcome, elapsed));
            continue;
        }
        // The expected durations of what is left, scaled by how the finished ones compared.
        let scale = if expected_done > 0.0 { spent / expected_done } else { 1.0 };
        let left = Duration::from_secs_f64(expected[i..].iter().sum::<f64>() * scale);
        progress.start(t.id, i, selected.len(), left);
        let started = Instant::now();
        let outcome = match e.run(&ctx) {
            Ok(finished) => {
                let path = opts.out.join(format!("{}.json", t.id));
                let written =
                    write_json(&path, &finished.result).and_then(|()| match &finished.plot {
                        Some(svg) => write_atomically(
                            &opts.out.join(format!("{}.svg", t.id)),
                            svg.as_bytes(),
                        ),
                        None => Ok(()),
                    });
                match written {
                    Ok(()) => Outcome::Done {
                        result: Box::new(finished.result),
                        plot: finished.plot.is_some(),
                        resumed: false,
                    },
                    Err(e) => Outcome::Failed(e),
                }
            }
            Err(source) => {
                Outcome::Failed(HarnessError::Experiment { id: t.id.to_string(), source })
            }
        };
        let elapsed = started.elapsed();
        spent += elapsed.as_secs_f64();
        expected_done += expected[i];
        progress.finish(t.id, &outcome, elapsed);
        manifest.record(t.id, &outcome, elapsed);
        outcomes.push((t, outcome, elapsed));
        // After each experiment, what has run so far: a run stopped part-way (a time limit,
        // Ctrl-C) leaves a report of what finished and a manifest `--resume` continues from.
        write_json(&opts.out.join(RunManifest::FILE), &manifest)?;
        // After the last one too: a run stopped while the advice below is computed keeps a
        // report of every experiment (`--report-only` adds the advice later).
        let pending: Vec<&str> = selected[i + 1..].iter().map(|e| e.technique().id).collect();
        write_report(&ctx, opts, &outcomes, &pending, false)?;
    }
    let report = write_report(&ctx, opts, &outcomes, &[], true)?;
    Ok(BenchSummary { backend, outcomes, report })
}

/// Writes `<out>/REPORT.md` again from the results an earlier run left in `out` (its
/// `bench-run.json` and `<id>.json` files) and runs nothing: a GPU's results rendered on any
/// machine, e.g. after the report's code changed. The report names the run's backend,
/// device, mode and seed; experiments the run did not reach are listed as still to run, and
/// those that failed as failed. `opts.only` picks experiments as in [`run`]; the other
/// settings come from the run.
///
/// # Errors
///
/// [`HarnessError::EarlierRun`] when `out` holds no run (or a file that is not one), an unknown
/// id in `only`, or a report that cannot be written.
pub fn render_report(
    opts: &BenchOptions,
    progress: &mut dyn Progress,
) -> Result<BenchSummary, HarnessError> {
    let selected = selection(opts)?;
    let run = RunManifest::read(&opts.out)?.ok_or_else(|| HarnessError::EarlierRun {
        path: opts.out.join(RunManifest::FILE),
        reason: "none was written there (`cargo xtask bench --out DIR` writes one)".into(),
    })?;
    let backend = run.backend();
    let ctx = Context {
        backend: backend.clone(),
        quick: run.quick,
        seed: run.seed,
        device_memory: run.device_memory,
    };
    let shown = BenchOptions { quick: run.quick, seed: run.seed, ..opts.clone() };
    let (mut outcomes, mut pending) = (Vec::new(), Vec::new());
    for e in selected {
        let t = e.technique();
        let failed = run.finished.iter().find(|f| f.id == t.id && f.status == RunStatus::Failed);
        if let Some((outcome, elapsed)) = run.kept(t.id, &opts.out, progress, false) {
            outcomes.push((t, outcome, elapsed));
        } else if let Some(f) = failed {
            let error = f.error.clone().unwrap_or_default();
            let outcome = Outcome::Failed(HarnessError::EarlierFailure { id: t.id.into(), error });
            outcomes.push((t, outcome, Duration::from_secs_f64(f.seconds)));
        } else {
            pending.push(t.id);
        }
    }
    let report = write_report(&ctx, &shown, &outcomes, &pending, true)?;
    Ok(BenchSummary { backend, outcomes, report })
}

/// `<out>/bench-run.json`: the settings a bench run used and the experiments it finished,
/// rewritten after each one, so that `--resume` keeps what a stopped run finished (a GPU
/// loan that ran out, Ctrl-C) and runs the rest with the same settings.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct RunManifest {
    /// `"cpu"` or `"cuda"`.
    backend: String,
    /// The device in words (on CUDA its name and libraries; `host` on the host, whose
    /// simulated capacity is `device_memory`).
    device: String,
    /// Reduced sizes.
    quick: bool,
    /// Seed for data and initialisation.
    seed: u64,
    /// Device capacity in bytes.
    device_memory: u64,
    /// Each experiment that ended, in the order they ended.
    finished: Vec<RunEntry>,
}

/// One experiment's end in a [`RunManifest`].
#[derive(Clone, Debug, Serialize, Deserialize)]
struct RunEntry {
    id: String,
    status: RunStatus,
    seconds: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum RunStatus {
    Done,
    Failed,
}

impl RunManifest {
    const FILE: &'static str = "bench-run.json";

    fn new(backend: &Backend, ctx: &Context) -> Self {
        let device = match backend {
            Backend::Cpu => "host".to_string(),
            Backend::Cuda { name, .. } => name.clone(),
        };
        RunManifest {
            backend: backend.tag().to_string(),
            device,
            quick: ctx.quick,
            seed: ctx.seed,
            device_memory: ctx.device_memory,
            finished: Vec::new(),
        }
    }

    /// The earlier run in `out`, when its settings are `now`'s; `None` (with a note) when
    /// `out` holds none.
    ///
    /// # Errors
    ///
    /// [`HarnessError::EarlierRun`] when the file cannot be read or parsed, or names other
    /// settings.
    fn load(
        out: &Path,
        now: &RunManifest,
        progress: &mut dyn Progress,
    ) -> Result<Option<RunManifest>, HarnessError> {
        let Some(was) = Self::read(out)? else {
            progress.note(&format!(
                "--resume: {} does not exist, so every selected experiment runs",
                out.join(Self::FILE).display()
            ));
            return Ok(None);
        };
        let bad = |reason: String| HarnessError::EarlierRun { path: out.join(Self::FILE), reason };
        let differs = |what: &str, then: String, now: String| {
            bad(format!(
                "it ran with {what} {then}, this run has {now}; resume with the same settings \
                 or write to another --out"
            ))
        };
        let mode = |quick: bool| if quick { "--quick" } else { "full sizes" }.to_string();
        if was.backend != now.backend {
            return Err(differs("backend", was.backend, now.backend.clone()));
        }
        if was.device != now.device {
            return Err(differs(
                "device",
                format!("`{}`", was.device),
                format!("`{}`", now.device),
            ));
        }
        if was.quick != now.quick {
            return Err(differs("mode", mode(was.quick), mode(now.quick)));
        }
        if was.seed != now.seed {
            return Err(differs("seed", was.seed.to_string(), now.seed.to_string()));
        }
        if was.device_memory != now.device_memory {
            return Err(differs(
                "device memory",
                human_bytes(was.device_memory),
                human_bytes(now.device_memory),
            ));
        }
        Ok(Some(was))
    }

    /// The run recorded in `out`, or `None` when there is no `bench-run.json`.
    ///
    /// # Errors
    ///
    /// [`HarnessError::EarlierRun`] when the file cannot be read or is not a run.
    fn read(out: &Path) -> Result<Option<RunManifest>, HarnessError> {
        let path = out.join(Self::FILE);
        let bad = |reason: String| HarnessError::EarlierRun { path: path.clone(), reason };
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| bad(format!("not a bench run: {e}"))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(bad(e.to_string())),
        }
    }

    /// The backend the run used, as the report names it.
    fn backend(&self) -> Backend {
        match self.backend.as_str() {
            "cuda" => Backend::Cuda { name: self.device.clone(), total_bytes: self.device_memory },
            _ => Backend::Cpu,
        }
    }

    /// The outcome experiment `id` finished with in this earlier run, and how long it took;
    /// `None` when it did not finish or its results file is gone or unreadable (with a note
    /// saying what happens to it instead: for `--resume` it runs again, for a report it is
    /// left out).
    fn kept(
        &self,
        id: &str,
        out: &Path,
        progress: &mut dyn Progress,
        resume: bool,
    ) -> Option<(Outcome, Duration)> {
        let entry =
            self.finished.iter().rev().find(|f| f.id == id && f.status == RunStatus::Done)?;
        let path = out.join(format!("{id}.json"));
        let parsed = std::fs::read_to_string(&path)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str::<ExperimentResult>(&t).map_err(|e| e.to_string()))
            .and_then(|r| {
                if r.experiment == id && r.backend == self.backend {
                    Ok(r)
                } else {
                    Err(format!("it holds `{}` on {}", r.experiment, r.backend))
                }
            });
        match parsed {
            Ok(r) => {
                let plot = out.join(format!("{id}.svg")).exists();
                let outcome = Outcome::Done { result: Box::new(r), plot, resumed: resume };
                Some((outcome, Duration::from_secs_f64(entry.seconds)))
            }
            Err(why) => {
                let then = if resume { "it runs again" } else { "left out" };
                progress.note(&format!("cannot keep `{id}` ({}: {why}); {then}", path.display()));
                None
            }
        }
    }

    /// Records how an experiment ended, replacing an earlier entry for it.
    fn record(&mut self, id: &str, outcome: &Outcome, elapsed: Duration) {
        self.finished.retain(|f| f.id != id);
        let (status, error) = match outcome {
            Outcome::Done { .. } => (RunStatus::Done, None),
            Outcome::Failed(e) => (RunStatus::Failed, Some(e.to_string())),
        };
        self.finished.push(RunEntry {
            id: id.to_string(),
            status,
            seconds: elapsed.as_secs_f64(),
            error,
        });
    }
}

/// The experiments `opts.only` names, in its order, or all of them.
fn selection(opts: &BenchOptions) -> Result<Vec<&'static dyn Descriptor>, HarnessError> {
    match &opts.only {
        None => Ok(EXPERIMENTS.to_vec()),
        Some(ids) => select(ids),
    }
}

/// Writes `<out>/REPORT.md` of `outcomes` (`pending`: the selected experiments not run yet).
/// With `advice`, it first computes "What should I do?" (only for the whole selection: a
/// `--only` run reports its experiments alone) and writes `advice.json`.
fn write_report(
    ctx: &Context,
    opts: &BenchOptions,
    outcomes: &[(&'static Technique, Outcome, Duration)],
    pending: &[&str],
    advice: bool,
) -> Result<PathBuf, HarnessError> {
    // Real-size models on the virtual device, whatever the backend.
    let advice = match (advice, &opts.only) {
        (true, None) => {
            let advice = crate::advice::compute(ctx.quick);
            if let Ok(a) = &advice {
                write_json(&opts.out.join("advice.json"), a)?;
            }
            Some(advice)
        }
        _ => None,
    };
    let report = opts.out.join("REPORT.md");
    let text = report::render(ctx, opts, advice.as_ref(), outcomes, pending);
    write_atomically(&report, text.as_bytes())?;
    Ok(report)
}

/// Refuses a simulated capacity that a selected experiment cannot run with on the host.
fn check_capacity(selected: &[&'static dyn Descriptor], capacity: u64) -> Result<(), HarnessError> {
    for e in selected {
        if let Some((limit, why)) = e.host_capacity_limit()
            && capacity > limit
        {
            return Err(HarnessError::CapacityTooLarge {
                id: e.technique().id.to_string(),
                capacity,
                limit,
                why: why.to_string(),
            });
        }
    }
    Ok(())
}

fn write_json(path: &Path, result: &impl serde::Serialize) -> Result<(), HarnessError> {
    let mut text = serde_json::to_string_pretty(result).expect("results serialize");
    text.push('\n');
    write_atomically(path, text.as_bytes())
}

/// Writes to a temporary file beside `path`, then renames it over `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), HarnessError> {
    let tmp = path.with_extension("tmp");
    let io = |source| HarnessError::Io { path: path.to_path_buf(), source };
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// The units [`parse_size`] takes, for messages and help texts.
pub const SIZE_UNITS: &str = "B, KiB, MiB, GiB, TiB (powers of 1024; K, M, G, T alone mean \
     the same, as in nvidia-smi and PyTorch's messages) or KB, MB, GB, TB (powers of 1000: \
     8GB is 7.45 GiB)";

/// Parses a size such as `4GiB`, `512 MiB`, `1.5TiB`, `2GB` or `1048576` (bytes) into bytes:
/// the one size grammar of every command (`plan`, `replay`, `twin`, `bench`). Units are
/// case-insensitive; `K`, `M`, `G`, `T` alone mean KiB, MiB, GiB, TiB.
///
/// # Errors
///
/// [`HarnessError::MalformedSize`], saying what is wrong: no number, an unknown unit, zero,
/// or more than `u64::MAX` bytes.
pub fn parse_size(input: &str) -> Result<u64, HarnessError> {
    let bad = |reason: String| HarnessError::MalformedSize { input: input.to_string(), reason };
    let s = input.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(bad(format!("expected a number first, then a unit: {SIZE_UNITS}")));
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => return Err(bad(format!("unknown unit `{other}`; expected {SIZE_UNITS}"))),
    };
    let too_large = || bad(format!("more than {} bytes", u64::MAX));
    let bytes = match num.parse::<u64>() {
        Ok(n) => n.checked_mul(mult).ok_or_else(too_large)?,
        Err(_) => {
            let v: f64 = num.parse().map_err(|_| bad(format!("`{num}` is not a number")))?;
            let b = (v * mult as f64).floor();
            // u64::MAX as f64 rounds up to 2^64, which no u64 holds.
            if b >= u64::MAX as f64 {
                return Err(too_large());
            }
            b as u64
        }
    };
    if bytes == 0 {
        return Err(bad("a size must be at least 1 byte".into()));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_size_accepts_binary_and_decimal_units() {
        assert_eq!(parse_size("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_size("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_size("1048576").unwrap(), 1 << 20);
        assert_eq!(parse_size("2TiB").unwrap(), 2 << 40);
        assert_eq!(parse_size(" 1.5 tib ").unwrap(), 3 << 39);
        assert_eq!(parse_size("3TB").unwrap(), 3_000_000_000_000);
        assert_eq!(parse_size("18446744073709551615").unwrap(), u64::MAX);
        assert_eq!(parse_size("16777215TiB").unwrap(), 16_777_215 << 40);
    }

    #[test]
    fn parse_size_rejects_malformed_input_and_says_why() {
        for (bad, why) in [
            ("", "expected a number"),
            ("GiB", "expected a number"),
            ("4XB", "unknown unit `xb`"),
            ("-1GiB", "expected a number"),
            ("0", "at least 1 byte"),
            ("0.1B", "at least 1 byte"),
            ("1.2.3MiB", "is not a number"),
            ("16777216TiB", "more than"),
            ("18446744073709551616", "more than"),
            ("1e3MiB", "unknown unit `e3mib`"),
            ("4 PiB", "unknown unit `pib`"),
        ] {
            let err = parse_size(bad).expect_err(bad).to_string();
            assert!(err.contains(why), "{bad:?}: {err}");
            assert!(err.contains(bad.trim()), "{bad:?}: {err}");
        }
    }

    #[test]
    fn only_trims_spaces_and_refuses_duplicates_and_unknown_ids() {
        assert_eq!(
            parse_only(" fragmentation , batch-size").unwrap(),
            ["fragmentation", "batch-size"]
        );
        let dup = parse_only("fragmentation, fragmentation").unwrap_err();
        assert!(
            matches!(dup, HarnessError::DuplicateExperiment { ref id } if id == "fragmentation")
        );
        let unknown = parse_only("fragmentation,nope").unwrap_err();
        assert!(matches!(unknown, HarnessError::UnknownExperiment { ref id, .. } if id == "nope"));
        let text = unknown.to_string();
        assert!(text.contains("batch-size") && text.contains("oom-recovery"), "{text}");
        assert!(parse_only("batch-size,,input-size").is_err(), "an empty id is refused");
    }

    struct Silent;
    impl Progress for Silent {
        fn note(&mut self, _: &str) {}
        fn start(&mut self, _: &str, _: usize, _: usize, _: Duration) {}
        fn finish(&mut self, _: &str, _: &Outcome, _: Duration) {}
    }

    #[test]
    fn unknown_id_is_an_error_before_anything_runs() {
        let out = std::env::temp_dir().join("vram-harness-unknown-id-test");
        let opts = BenchOptions {
            only: Some(vec!["no-such-technique".into()]),
            out: out.clone(),
            backend: BackendChoice::Cpu,
            ..BenchOptions::default()
        };
        let err = run(&opts, &mut Silent).unwrap_err();
        assert!(
            matches!(err, HarnessError::UnknownExperiment { ref id, .. } if id == "no-such-technique")
        );
        assert!(!out.join("REPORT.md").exists());
    }

    /// The capacity that got the process killed at 24 GB of resident memory is refused up
    /// front, naming the limit.
    #[test]
    fn a_capacity_an_experiment_cannot_simulate_is_refused_before_anything_runs() {
        let out = std::env::temp_dir().join("vram-harness-capacity-test");
        let opts = BenchOptions {
            only: Some(vec!["fragmentation".into()]),
            out: out.clone(),
            backend: BackendChoice::Cpu,
            quick: true,
            device_memory: Some(u64::MAX),
            ..BenchOptions::default()
        };
        let err = run(&opts, &mut Silent).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, HarnessError::CapacityTooLarge { .. }), "{text}");
        assert!(
            text.contains("fragmentation") && text.contains("--device-memory 256GiB"),
            "{text}"
        );
        assert_eq!(parse_size("256GiB").unwrap(), 256 << 30, "the suggested size parses");
        assert!(!out.join("REPORT.md").exists());
    }

    /// Records what the bench tells its user, and the report as each experiment starts.
    #[derive(Default)]
    struct Recorder {
        notes: Vec<String>,
        started: Vec<String>,
        report_at_start: Vec<Option<String>>,
        out: PathBuf,
    }
    impl Progress for Recorder {
        fn note(&mut self, m: &str) {
            self.notes.push(m.to_string());
        }
        fn start(&mut self, id: &str, _: usize, _: usize, _: Duration) {
            self.started.push(id.to_string());
            self.report_at_start.push(std::fs::read_to_string(self.out.join("REPORT.md")).ok());
        }
        fn finish(&mut self, _: &str, _: &Outcome, _: Duration) {}
    }

    fn resumed(s: &BenchSummary) -> Vec<(&str, bool)> {
        s.outcomes
            .iter()
            .map(|(t, o, _)| (t.id, matches!(o, Outcome::Done { resumed: true, .. })))
            .collect()
    }

    /// A run writes its report after each experiment; `--resume` keeps what finished with
    /// the same settings, runs what did not (or whose results are gone), and refuses a
    /// folder written with other settings.
    #[test]
    fn a_stopped_run_leaves_a_report_and_resume_runs_only_the_rest() {
        let out = std::env::temp_dir().join(format!("vram-harness-resume-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let ids = ["fragmentation", "memory-fraction"];
        let opts = BenchOptions {
            only: Some(ids.iter().map(|s| s.to_string()).collect()),
            out: out.clone(),
            backend: BackendChoice::Cpu,
            quick: true,
            ..BenchOptions::default()
        };
        let mut rec = Recorder { out: out.clone(), ..Recorder::default() };
        let first = run(&opts, &mut rec).unwrap();
        assert_eq!(first.failed(), 0);
        assert_eq!(rec.started, ids);
        // Before the second experiment, the report held the first one and said what was left.
        assert!(rec.report_at_start[0].is_none(), "no report before anything ran");
        let partial = rec.report_at_start[1].as_deref().expect("a report after the first");
        assert!(partial.contains("**partial**: 1 of 2 experiments have ended"), "{partial}");
        assert!(partial.contains("still to run: `memory-fraction`"), "{partial}");
        assert!(partial.contains("## `fragmentation`"), "{partial}");
        let full = std::fs::read_to_string(out.join("REPORT.md")).unwrap();
        assert!(!full.contains("partial") && full.contains("## `memory-fraction`"), "{full}");

        // Everything finished: a resumed run runs nothing and reports both, marked.
        let again = BenchOptions { resume: true, ..opts.clone() };
        let mut rec = Recorder { out: out.clone(), ..Recorder::default() };
        let second = run(&again, &mut rec).unwrap();
        assert!(rec.started.is_empty(), "{:?}", rec.started);
        assert_eq!(resumed(&second), [("fragmentation", true), ("memory-fraction", true)]);
        let report = std::fs::read_to_string(out.join("REPORT.md")).unwrap();
        assert!(report.contains("resumed (`--resume`): `fragmentation`, `memory-fraction`"));
        assert!(report.contains("kept by `--resume`"), "{report}");
        let Outcome::Done { result, .. } = &first.outcomes[0].1 else { panic!("failed") };
        assert_eq!(
            report.lines().filter(|l| l.starts_with("| `fragmentation` |")).count(),
            result.claims.len(),
            "the kept claims are in the table once each"
        );

        // A results file that is gone runs again; the other is kept.
        std::fs::remove_file(out.join("memory-fraction.json")).unwrap();
        let mut rec = Recorder { out: out.clone(), ..Recorder::default() };
        let third = run(&again, &mut rec).unwrap();
        assert_eq!(rec.started, ["memory-fraction"]);
        assert_eq!(resumed(&third), [("fragmentation", true), ("memory-fraction", false)]);
        assert!(
            rec.notes.iter().any(|n| n.contains("cannot keep `memory-fraction`")),
            "{:?}",
            rec.notes
        );

        // Other settings are refused before anything runs, naming the difference.
        for (other, what) in [
            (BenchOptions { seed: 7, ..again.clone() }, "seed 0, this run has 7"),
            (
                BenchOptions { quick: false, ..again.clone() },
                "mode --quick, this run has full sizes",
            ),
            (BenchOptions { device_memory: Some(1 << 30), ..again.clone() }, "device memory"),
        ] {
            let mut rec = Recorder { out: out.clone(), ..Recorder::default() };
            let err = run(&other, &mut rec).unwrap_err();
            assert!(matches!(err, HarnessError::EarlierRun { .. }), "{err}");
            assert!(err.to_string().contains(what), "{err}");
            assert!(rec.started.is_empty());
        }
        // A folder without a run resumes nothing and says so.
        let empty = out.join("fresh");
        let mut rec = Recorder { out: empty.clone(), ..Recorder::default() };
        run(
            &BenchOptions { out: empty, only: Some(vec![ids[0].into()]), ..again.clone() },
            &mut rec,
        )
        .unwrap();
        assert_eq!(rec.started, [ids[0]]);
        assert!(rec.notes.iter().any(|n| n.contains("does not exist")), "{:?}", rec.notes);
        // A file that is not a run is an error, not a silent fresh start.
        std::fs::write(out.join(RunManifest::FILE), "{}").unwrap();
        let err = run(&again, &mut Silent).unwrap_err();
        assert!(err.to_string().contains("not a bench run"), "{err}");
        let _ = std::fs::remove_dir_all(&out);
    }

    /// `render_report` writes the report of a run's results without running anything: a
    /// GPU's results on a host, with the run's device, mode and seed; a failed experiment as
    /// failed, one the run did not reach as still to run.
    #[test]
    fn a_report_renders_from_a_runs_results_without_running_anything() {
        let out = std::env::temp_dir().join(format!("vram-harness-render-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let opts = BenchOptions {
            only: Some(vec!["fragmentation".into()]),
            out: out.clone(),
            backend: BackendChoice::Cpu,
            quick: true,
            ..BenchOptions::default()
        };
        run(&opts, &mut Silent).unwrap();
        // Make it a GPU's run of three experiments: one done, one failed, one not reached.
        let gpu = "NVIDIA H100 80GB HBM3; convolutions: cuDNN 9.14.0";
        let mut manifest = RunManifest::read(&out).unwrap().unwrap();
        (manifest.backend, manifest.device, manifest.device_memory) =
            ("cuda".into(), gpu.into(), 80 << 30);
        manifest.finished.push(RunEntry {
            id: "memory-fraction".into(),
            status: RunStatus::Failed,
            seconds: 1.0,
            error: Some("boom".into()),
        });
        write_json(&out.join(RunManifest::FILE), &manifest).unwrap();
        let path = out.join("fragmentation.json");
        let mut result: ExperimentResult =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        result.backend = "cuda".into();
        write_json(&path, &result).unwrap();

        let ids = ["fragmentation", "memory-fraction", "checkpointing"];
        let render = BenchOptions {
            only: Some(ids.iter().map(|s| s.to_string()).collect()),
            out: out.clone(),
            ..BenchOptions::default()
        };
        let mut rec = Recorder { out: out.clone(), ..Recorder::default() };
        let summary = render_report(&render, &mut rec).unwrap();
        assert!(rec.started.is_empty(), "nothing runs: {:?}", rec.started);
        assert_eq!(summary.failed(), 1);
        let report = std::fs::read_to_string(out.join("REPORT.md")).unwrap();
        assert!(report.contains(&format!("- device: CUDA: {gpu}, 80.00 GiB")), "{report}");
        assert!(report.contains("- mode: quick"), "the run's mode: {report}");
        assert!(report.contains("## `fragmentation`"), "{report}");
        assert!(report.contains("failed in the run that wrote these results: boom"), "{report}");
        assert!(report.contains("still to run: `checkpointing`"), "{report}");
        // A results file gone: left out, and said.
        std::fs::remove_file(&path).unwrap();
        let mut rec = Recorder { out: out.clone(), ..Recorder::default() };
        render_report(&render, &mut rec).unwrap();
        assert!(rec.notes.iter().any(|n| n.contains("cannot keep `fragmentation`")));
        // No run in the folder: an error, not an empty report.
        let empty = out.join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        let err = render_report(&BenchOptions { out: empty, ..render }, &mut Silent).unwrap_err();
        assert!(err.to_string().contains("none was written there"), "{err}");
        let _ = std::fs::remove_dir_all(&out);
    }

    /// Every experiment's host limit lets the default capacity run.
    #[test]
    fn the_default_capacity_is_within_every_limit() {
        assert!(check_capacity(EXPERIMENTS, DEFAULT_HOST_DEVICE_MEMORY).is_ok());
    }
}

//! Running a selection of experiments and writing their results.

use crate::backend::{self, Backend, BackendChoice};
use crate::experiments::{self, Descriptor, EXPERIMENTS};
use crate::report;
use crate::techniques::{Technique, techniques};
use crate::{ExperimentResult, HarnessError};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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
    let selected: Vec<&'static dyn Descriptor> = match &opts.only {
        None => EXPERIMENTS.to_vec(),
        Some(ids) => select(ids)?,
    };
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

    let expected: Vec<f64> = selected.iter().map(|e| e.expected_secs(opts.quick)).collect();
    let (mut spent, mut expected_done) = (0.0, 0.0);
    let mut outcomes = Vec::with_capacity(selected.len());
    for (i, e) in selected.iter().enumerate() {
        let t = e.technique();
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
        outcomes.push((t, outcome, elapsed));
    }
    // "What should I do?": real-size models on the virtual device, whatever the backend
    // (only with the whole selection: a `--only` run reports its experiments alone).
    let advice = match opts.only {
        None => {
            let advice = crate::advice::compute(opts.quick);
            if let Ok(a) = &advice {
                write_json(&opts.out.join("advice.json"), a)?;
            }
            Some(advice)
        }
        Some(_) => None,
    };
    let report = opts.out.join("REPORT.md");
    let text = report::render(&ctx, opts, advice.as_ref(), &outcomes);
    write_atomically(&report, text.as_bytes())?;
    Ok(BenchSummary { backend, outcomes, report })
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

    /// Every experiment's host limit lets the default capacity run.
    #[test]
    fn the_default_capacity_is_within_every_limit() {
        assert!(check_capacity(EXPERIMENTS, DEFAULT_HOST_DEVICE_MEMORY).is_ok());
    }
}

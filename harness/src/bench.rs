//! Running a selection of experiments and writing their results.

use crate::backend::{self, Backend, BackendChoice};
use crate::experiments;
use crate::report;
use crate::techniques::{TECHNIQUES, Technique, technique};
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
    /// It ran; its results were written.
    Done(Box<ExperimentResult>),
    /// It failed; the message says why.
    Failed(String),
    /// No experiment exists for this technique yet.
    NotImplemented,
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
    /// An experiment starts.
    fn start(&mut self, id: &str, index: usize, total: usize);
    /// An experiment ended.
    fn finish(&mut self, id: &str, outcome: &Outcome, elapsed: Duration);
}

/// Every technique id with whether its experiment is implemented.
pub fn list() -> Vec<(&'static Technique, bool)> {
    TECHNIQUES.iter().map(|t| (t, experiments::find(t.id).is_some())).collect()
}

/// Validates the selection, runs the experiments, writes `<out>/<id>.json` and
/// `<out>/REPORT.md`. A failing experiment does not stop the others.
pub fn run(opts: &BenchOptions, progress: &mut dyn Progress) -> Result<BenchSummary, HarnessError> {
    let selected: Vec<&'static Technique> = match &opts.only {
        None => TECHNIQUES.iter().collect(),
        Some(ids) => ids
            .iter()
            .map(|id| {
                technique(id).ok_or_else(|| HarnessError::UnknownExperiment { id: id.clone() })
            })
            .collect::<Result<_, _>>()?,
    };
    let backend = backend::resolve(opts.backend, &mut |m| progress.note(m))?;
    let device_memory = match &backend {
        Backend::Cuda { total_bytes, .. } => *total_bytes,
        Backend::Cpu => opts.device_memory.unwrap_or(DEFAULT_HOST_DEVICE_MEMORY),
    };
    let ctx =
        Context { backend: backend.clone(), quick: opts.quick, seed: opts.seed, device_memory };
    std::fs::create_dir_all(&opts.out)
        .map_err(|source| HarnessError::Io { path: opts.out.clone(), source })?;

    let mut outcomes = Vec::with_capacity(selected.len());
    for (i, t) in selected.iter().enumerate() {
        progress.start(t.id, i, selected.len());
        let started = Instant::now();
        let outcome = match experiments::find(t.id) {
            None => Outcome::NotImplemented,
            Some(f) => match f(&ctx) {
                Ok(result) => {
                    let path = opts.out.join(format!("{}.json", t.id));
                    let plot = crate::plots::render(&result);
                    let written = write_json(&path, &result).and_then(|()| match &plot {
                        Some(svg) => write_atomically(
                            &opts.out.join(format!("{}.svg", t.id)),
                            svg.as_bytes(),
                        ),
                        None => Ok(()),
                    });
                    match written {
                        Ok(()) => Outcome::Done(Box::new(result)),
                        Err(e) => Outcome::Failed(e.to_string()),
                    }
                }
                Err(message) => Outcome::Failed(message),
            },
        };
        let elapsed = started.elapsed();
        progress.finish(t.id, &outcome, elapsed);
        outcomes.push((*t, outcome, elapsed));
    }
    let report = opts.out.join("REPORT.md");
    let text = report::render(&ctx, opts, &outcomes);
    write_atomically(&report, text.as_bytes())?;
    Ok(BenchSummary { backend, outcomes, report })
}

fn write_json(path: &Path, result: &ExperimentResult) -> Result<(), HarnessError> {
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

/// Parses a size such as `4GiB`, `512MiB`, `1.5GB` or `1048576` into bytes.
pub fn parse_size(input: &str) -> Result<u64, HarnessError> {
    let bad = || HarnessError::MalformedSize { input: input.to_string() };
    let s = input.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num.parse().map_err(|_| bad())?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        _ => return Err(bad()),
    };
    let bytes = value * mult;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes as u64)
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
    }

    #[test]
    fn parse_size_rejects_malformed_input() {
        for bad in ["", "GiB", "4XB", "-1GiB", "0", "1.2.3MiB"] {
            assert!(parse_size(bad).is_err(), "{bad:?} should be rejected");
        }
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
        struct Silent;
        impl Progress for Silent {
            fn note(&mut self, _: &str) {}
            fn start(&mut self, _: &str, _: usize, _: usize) {}
            fn finish(&mut self, _: &str, _: &Outcome, _: Duration) {}
        }
        let err = run(&opts, &mut Silent).unwrap_err();
        assert!(
            matches!(err, HarnessError::UnknownExperiment { ref id } if id == "no-such-technique")
        );
        assert!(!out.join("REPORT.md").exists());
    }
}

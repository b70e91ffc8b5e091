//! vram-harness: reference models, experiments and the report behind `cargo xtask bench`.
//!
//! Each technique of the project's catalogue ([`techniques`]) gets an experiment that
//! measures what it does to peak memory and speed; [`run`] runs a selection, writes
//! `<out>/<id>.json` per experiment and `<out>/REPORT.md`.

pub mod advice;
mod backend;
mod bench;
pub mod data;
pub mod dp;
mod error;
mod experiments;
pub mod models;
pub mod plan;
mod plots;
mod report;
mod results;
pub mod rng;
mod techniques;
pub mod timing;
pub mod trainer;
pub mod twin;

pub use backend::{Backend, BackendChoice};
pub use bench::{
    BenchOptions, BenchSummary, Context, DEFAULT_HOST_DEVICE_MEMORY, Outcome, Progress, SIZE_UNITS,
    list, parse_only, parse_size, render_report, run,
};
pub use error::{ExperimentError, HarnessError};
pub use results::{Claim, ExperimentResult, Variant, Verdict};
pub use techniques::{Technique, technique, techniques};
pub use timing::Timing;
pub use vram_alloc::human_bytes;

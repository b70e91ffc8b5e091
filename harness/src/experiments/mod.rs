//! One experiment per technique id.

use crate::{Context, ExperimentResult};

/// Runs one experiment on the given context.
pub type ExperimentFn = fn(&Context) -> Result<ExperimentResult, String>;

/// The experiments implemented so far, by technique id.
const EXPERIMENTS: &[(&str, ExperimentFn)] = &[];

/// The experiment for a technique id, if it is implemented.
pub fn find(id: &str) -> Option<ExperimentFn> {
    EXPERIMENTS.iter().find(|(i, _)| *i == id).map(|(_, f)| *f)
}

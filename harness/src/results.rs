//! The results format every experiment writes (`<out>/<id>.json`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One experiment's results, in the shape the project's checks read.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExperimentResult {
    /// The technique id.
    pub experiment: String,
    /// `"cpu"` or `"cuda"`.
    pub backend: String,
    /// The device, in words.
    pub device: String,
    /// The settings the experiment ran with.
    pub config: Value,
    /// Measured variants; the first is the baseline, sweeps in ascending order.
    pub variants: Vec<Variant>,
    /// Every claim with the verdict computed from the measurements.
    pub claims: Vec<Claim>,
    /// Consistency checks: agreements that vram's design makes hold (a prediction against
    /// the same computation, a counter against the trace that feeds it); they find bugs, they
    /// test no claim, and the report keeps them out of the verdicts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checks: Vec<Check>,
    /// One line: what the measurements mean for a user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reading: Option<String>,
}

/// One measured configuration of an experiment.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Variant {
    /// Variant name.
    pub name: String,
    /// Peak of `allocated_bytes.all` during the variant (peak reset before it).
    pub peak_allocated_bytes: u64,
    /// Peak of `reserved_bytes.all` during the variant.
    pub peak_reserved_bytes: u64,
    /// Mean step time in milliseconds, when the variant is timed (steps interleaved with
    /// the other variants'; see `step_ms_ci95`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_ms: Option<f64>,
    /// 95% confidence interval of the mean step time (Student t), in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_ms_ci95: Option<[f64; 2]>,
    /// Number of timed steps behind `step_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_ms_samples: Option<usize>,
    /// Further measurements specific to the experiment.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

impl Variant {
    /// The step time with its interval, when the variant is timed.
    pub fn timing(&self) -> Option<crate::Timing> {
        Some(crate::Timing {
            mean_ms: self.step_ms?,
            ci95_ms: self.step_ms_ci95,
            samples: self.step_ms_samples.unwrap_or(1),
        })
    }
}

/// A verdict on a claim, computed from a measurement at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// The measurement supports the claim.
    #[serde(rename = "holds")]
    Holds,
    /// The measurement supports part of the claim.
    #[serde(rename = "partly")]
    Partly,
    /// The measurement contradicts the claim.
    #[serde(rename = "does not hold")]
    DoesNotHold,
    /// The claim cannot be tested here; `measured` says why.
    #[serde(rename = "not applicable")]
    NotApplicable,
}

impl Verdict {
    /// The verdict as written in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Holds => "holds",
            Verdict::Partly => "partly",
            Verdict::DoesNotHold => "does not hold",
            Verdict::NotApplicable => "not applicable",
        }
    }
}

/// A consistency check: what must agree by vram's design, what was measured, and whether it
/// agreed (a failure is a bug in vram, not a finding about a technique).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Check {
    /// What must agree, and why it does by design.
    pub check: String,
    /// The measured figure(s), in words.
    pub measured: String,
    /// Whether it agreed.
    pub passed: bool,
}

/// A claim, what was measured, and the verdict.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Claim {
    /// The claim being tested.
    pub claim: String,
    /// The measured figure(s), in words.
    pub measured: String,
    /// The verdict.
    pub verdict: Verdict,
}

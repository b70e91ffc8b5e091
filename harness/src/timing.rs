//! Honest step timing: variants run interleaved (A B C A B C ...) so that drift of the
//! machine (other processes, clocks, caches) falls on every variant alike, each step is a
//! sample, and a time is reported as the mean with its 95% confidence interval (Student t).

use serde::{Deserialize, Serialize};

/// A timed quantity: the mean of its samples and the 95% confidence interval of the mean.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Mean of the samples, in milliseconds.
    pub mean_ms: f64,
    /// 95% confidence interval of the mean (Student t), in milliseconds, its lower bound
    /// never below 0 (a time is not negative); `None` with fewer than two samples.
    pub ci95_ms: Option<[f64; 2]>,
    /// Number of samples.
    pub samples: usize,
}

impl Timing {
    /// The mean and 95% interval of `samples` (milliseconds); `None` when there are none.
    pub fn from_samples(samples: &[f64]) -> Option<Timing> {
        let n = samples.len();
        if n == 0 {
            return None;
        }
        let mean = samples.iter().sum::<f64>() / n as f64;
        let ci95_ms = (n >= 2).then(|| {
            let var = samples.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            let half = t975(n - 1) * (var / n as f64).sqrt();
            [(mean - half).max(0.0), mean + half]
        });
        Some(Timing { mean_ms: mean, ci95_ms, samples: n })
    }

    /// How far the interval reaches above the mean (infinite without one); below the mean
    /// it reaches as far, or to 0 ([`lower`](Self::lower)).
    pub fn half_width(&self) -> f64 {
        self.ci95_ms.map_or(f64::INFINITY, |[_, hi]| hi - self.mean_ms)
    }

    /// The interval's lower bound (0 without an interval).
    pub fn lower(&self) -> f64 {
        self.ci95_ms.map_or(0.0, |[lo, _]| lo)
    }

    /// The interval's upper bound (infinite without one).
    pub fn upper(&self) -> f64 {
        self.ci95_ms.map_or(f64::INFINITY, |[_, hi]| hi)
    }

    /// The mean and its interval with `digits` decimals, without the unit: `12.30 +- 0.40`,
    /// or `34.00 (0.00 to 175.80)` where the interval was cut at 0.
    pub fn interval(&self, digits: usize) -> String {
        match self.ci95_ms {
            Some([lo, hi]) if lo <= 0.0 && self.mean_ms - (hi - self.mean_ms) < 0.0 => {
                format!("{:.digits$} ({lo:.digits$} to {hi:.digits$})", self.mean_ms)
            }
            Some(_) => format!("{:.digits$} +- {:.digits$}", self.mean_ms, self.half_width()),
            None => format!("{:.digits$}", self.mean_ms),
        }
    }

    /// Whether this time is above `other` with both intervals apart (a difference the
    /// samples support, not noise).
    pub fn clearly_above(&self, other: &Timing) -> bool {
        match (self.ci95_ms, other.ci95_ms) {
            (Some([lo, _]), Some([_, hi])) => lo > hi,
            _ => false,
        }
    }

    /// `12.30 +- 0.40 ms (n = 10)` (see [`interval`](Self::interval)).
    pub fn describe(&self) -> String {
        format!("{} ms (n = {})", self.interval(2), self.samples)
    }
}

/// The 0.975 quantile of Student's t distribution with `df` degrees of freedom.
pub fn t975(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::INFINITY,
        1..=30 => TABLE[df - 1],
        _ => {
            // Cornish-Fisher expansion around the normal quantile (error < 1e-4 past 30).
            let (z, v) = (1.959_963_984_540_054_f64, df as f64);
            z + (z.powi(3) + z) / (4.0 * v)
                + (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / (96.0 * v * v)
        }
    }
}

/// Runs `warmup` then `repeats` rounds over `states`, one step of each state per round in
/// order (A B C A B C ...), and returns each state's samples: the milliseconds `step`
/// reported for its steps after the warm-up rounds.
///
/// # Errors
///
/// The first error `step` returns.
pub fn interleaved<S, E>(
    states: &mut [S],
    warmup: usize,
    repeats: usize,
    mut step: impl FnMut(&mut S) -> Result<f64, E>,
) -> Result<Vec<Vec<f64>>, E> {
    let mut samples = vec![Vec::with_capacity(repeats); states.len()];
    for round in 0..warmup + repeats {
        for (s, out) in states.iter_mut().zip(&mut samples) {
            let ms = step(s)?;
            if round >= warmup {
                out.push(ms);
            }
        }
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A known sample: 2, 4, 4, 4, 5, 5, 7, 9 has mean 5 and sample standard deviation
    /// sqrt(32/7); the half-width is t(7) * sd / sqrt(8) = 2.365 * 0.7559 = 1.7877.
    #[test]
    fn interval_of_a_known_sample() {
        let t = Timing::from_samples(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]).unwrap();
        assert_eq!(t.mean_ms, 5.0);
        assert_eq!(t.samples, 8);
        let [lo, hi] = t.ci95_ms.unwrap();
        let half = 2.365 * (32.0f64 / 7.0).sqrt() / 8f64.sqrt();
        assert!((hi - 5.0 - half).abs() < 1e-12 && (5.0 - lo - half).abs() < 1e-12);
        assert!((half - 1.7877).abs() < 1e-3, "{half}");
        assert_eq!(t.describe(), "5.00 +- 1.79 ms (n = 8)");
    }

    /// A time's interval stops at 0: one slow first sample among fast ones (a kernel
    /// compiled on first use) gives a wide interval whose lower end would be negative.
    #[test]
    fn the_interval_of_a_time_is_never_below_zero() {
        let t = Timing::from_samples(&[100.0, 1.0, 1.0]).unwrap();
        assert_eq!(t.mean_ms, 34.0);
        let [lo, hi] = t.ci95_ms.unwrap();
        assert_eq!(lo, 0.0);
        assert!(hi > 150.0, "{hi}");
        assert_eq!(t.lower(), 0.0);
        assert_eq!(t.half_width(), hi - 34.0);
        assert_eq!(t.describe(), format!("34.00 (0.00 to {hi:.2}) ms (n = 3)"));
    }

    #[test]
    fn one_sample_has_no_interval_and_none_has_no_timing() {
        let t = Timing::from_samples(&[3.0]).unwrap();
        assert_eq!((t.mean_ms, t.ci95_ms), (3.0, None));
        assert!(Timing::from_samples(&[]).is_none());
        assert!(!t.clearly_above(&t));
    }

    #[test]
    fn t_quantiles_join_the_table_smoothly_and_tend_to_the_normal() {
        assert_eq!(t975(1), 12.706);
        assert!((t975(31) - 2.040).abs() < 1e-3, "{}", t975(31));
        assert!((t975(120) - 1.980).abs() < 1e-3, "{}", t975(120));
        assert!((t975(100_000) - 1.960).abs() < 1e-3);
    }

    #[test]
    fn separated_intervals_are_clearly_apart_and_overlapping_ones_are_not() {
        let slow = Timing::from_samples(&[10.0, 10.1, 9.9, 10.0]).unwrap();
        let fast = Timing::from_samples(&[5.0, 5.1, 4.9, 5.0]).unwrap();
        let noisy = Timing::from_samples(&[4.0, 16.0, 6.0, 12.0]).unwrap();
        assert!(slow.clearly_above(&fast) && !fast.clearly_above(&slow));
        assert!(!slow.clearly_above(&noisy) && !noisy.clearly_above(&fast));
    }

    #[test]
    fn rounds_interleave_the_states_and_drop_the_warm_up() {
        let mut order = Vec::new();
        let mut states = [0usize, 1, 2];
        let samples = interleaved(&mut states, 1, 2, |s| {
            order.push(*s);
            Ok::<f64, ()>(order.len() as f64)
        })
        .unwrap();
        assert_eq!(order, [0, 1, 2, 0, 1, 2, 0, 1, 2]);
        assert_eq!(samples, [vec![4.0, 7.0], vec![5.0, 8.0], vec![6.0, 9.0]]);
    }
}

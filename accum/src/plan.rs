//! Checkpoint plans: how a chain is cut into segments, what each plan costs in activation
//! memory and recomputation, and the planner that finds the fastest plan within a budget.
//!
//! # What "activation memory" is
//!
//! Everything a training step allocates on the device between the start of the chain's
//! forward and the end of its backward, above what was allocated before forward (parameters,
//! their gradients, optimizer state, the caller's input batch): the tensors layers save for
//! backward, the checkpointed segment inputs, the live outputs flowing between layers, the
//! gradients flowing back, and the transient buffers each layer allocates while it runs. It
//! is measured as the step's peak of `memory_allocated()` minus its value before the step
//! (e.g. in a statistics scope, `Device::stats_scope`). Parameter gradients are assumed
//! already allocated (the steady state from the second micro-batch of a window on); the first
//! backward after `zero_grad` additionally allocates them, which is parameter memory, not
//! activation memory, and is reported apart ([`Prediction::grad_bytes`]).
//! The output gradient handed to backward is counted as one output-sized tensor (the caller
//! drops the output or reuses its buffer for the gradient).
//!
//! # How a plan's peak is predicted
//!
//! A profiling pass ([`Chain::profile`](crate::Chain::profile)) runs every layer once and
//! reads, from the allocator's statistics, its output bytes `a`, the bytes it saves `s`, the
//! peak it adds above the live memory while its forward runs (`fwd_peak`, including its
//! output, its saved state and its transients) and while its backward runs (`bwd_peak`), the
//! bytes of its input gradient, and its forward and backward times. The executor's order of
//! allocations and frees is fixed, so the live memory before each layer call is a sum of
//! those figures; a segment `j` adds its own phase peak `P_j` above the memory `M_j` kept by
//! the segments before it (their saved tensors, or only their input if checkpointed), and the
//! plan's peak is `max_j (M_j + P_j)`. Allocation sizes in the small pool (tensors up to
//! 1 MiB) do not depend on history, so the prediction is exact there; larger tensors may be
//! served by a cached block up to 1 MiB larger than asked for.

use crate::error::{Error, Result};
use std::time::Duration;

/// A run of consecutive layers `start..end`. A checkpointed segment keeps only its input
/// during forward and recomputes its forward during backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// First layer.
    pub start: usize,
    /// One past the last layer.
    pub end: usize,
    /// Whether the segment is recomputed in backward instead of saving its activations.
    pub checkpointed: bool,
}

/// A segmentation of a chain of `n` layers into [`Segment`]s that tile `0..n` in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    segments: Vec<Segment>,
}

impl Schedule {
    /// A schedule from explicit segments.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidSegments`] unless the segments are non-empty ranges that tile `0..n`
    /// in order for some `n >= 1`.
    pub fn from_segments(segments: Vec<Segment>) -> Result<Self> {
        let mut next = 0;
        for s in &segments {
            if s.start != next || s.end <= s.start {
                return Err(Error::InvalidSegments {
                    reason: format!(
                        "segment {}..{} does not start at layer {next} or is empty",
                        s.start, s.end
                    ),
                });
            }
            next = s.end;
        }
        if segments.is_empty() {
            return Err(Error::InvalidSegments { reason: "no segments".into() });
        }
        Ok(Schedule { segments })
    }

    /// No checkpointing: one plain segment of `n` layers.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `n == 0`.
    pub fn none(n: usize) -> Result<Self> {
        check_len(n)?;
        Ok(Schedule { segments: vec![Segment { start: 0, end: n, checkpointed: false }] })
    }

    /// Segments of `k` layers, every one checkpointed except the last (recomputing the last
    /// segment right after its forward would cost time and save nothing), as PyTorch's
    /// `checkpoint_sequential`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `n == 0` or `k == 0`.
    pub fn every(n: usize, k: usize) -> Result<Self> {
        check_len(n)?;
        if k == 0 {
            return Err(Error::InvalidArgument {
                what: "Schedule::every",
                reason: "k = 0 layers per segment; use k >= 1".into(),
            });
        }
        let segments = (0..n)
            .step_by(k)
            .map(|start| {
                let end = (start + k).min(n);
                Segment { start, end, checkpointed: end < n }
            })
            .collect();
        Ok(Schedule { segments })
    }

    /// Chen et al.'s sqrt(n) plan: segments of `round(sqrt(n))` layers, see [`every`](Self::every).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `n == 0`.
    pub fn sqrt(n: usize) -> Result<Self> {
        Schedule::every(n, sqrt_segment_len(n))
    }

    /// The segments, in chain order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The number of layers the segments cover (the length of the chain the schedule is
    /// for); `segments().len()` is the number of segments.
    pub fn layer_count(&self) -> usize {
        self.segments.last().map_or(0, |s| s.end)
    }
}

/// The layers per segment of the sqrt(n) plan.
pub fn sqrt_segment_len(n: usize) -> usize {
    ((n as f64).sqrt().round() as usize).max(1)
}

fn check_len(n: usize) -> Result<()> {
    if n == 0 {
        return Err(Error::InvalidArgument {
            what: "Schedule",
            reason: "the chain has no layers".into(),
        });
    }
    Ok(())
}

/// What a user asks for; [`CheckpointPlan::schedule`] turns it into a [`Schedule`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CheckpointPlan {
    /// Save every activation.
    None,
    /// Checkpoint segments of `k` layers (the last segment is never recomputed).
    EveryK(usize),
    /// Segments of `round(sqrt(n))` layers (Chen et al., 2016).
    Sqrt,
    /// The plan with the least recomputation whose predicted peak activation memory stays
    /// within `bytes`, found by dynamic programming over the chain.
    Budget {
        /// The activation-memory budget in bytes.
        bytes: u64,
    },
}

impl CheckpointPlan {
    /// The segmentation this plan gives for the profiled chain.
    ///
    /// # Errors
    ///
    /// [`Error::BudgetTooSmall`] if no plan fits a budget; [`Error::InvalidArgument`] for
    /// `EveryK(0)` or an empty profile.
    pub fn schedule(&self, profile: &ChainProfile) -> Result<Schedule> {
        let n = profile.layers.len();
        match *self {
            CheckpointPlan::None => Schedule::none(n),
            CheckpointPlan::EveryK(k) => Schedule::every(n, k),
            CheckpointPlan::Sqrt => Schedule::sqrt(n),
            CheckpointPlan::Budget { bytes } => profile.fastest_within(bytes),
        }
    }
}

/// What a profiling pass measured for one layer (or what an estimate says). Bytes are
/// allocator block bytes (rounded as the allocator rounds).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerProfile {
    /// The layer's name.
    pub name: String,
    /// Bytes of its output.
    pub out_bytes: u64,
    /// Bytes it keeps for backward in training mode.
    pub saved_bytes: u64,
    /// Peak bytes its forward adds above the memory live before the call.
    pub fwd_peak_bytes: u64,
    /// Peak bytes its backward adds above the memory live before the call (which holds its
    /// saved state and the output gradient).
    pub bwd_peak_bytes: u64,
    /// Bytes of the input gradient its backward returns (0 when not asked for).
    pub dx_bytes: u64,
    /// Bytes of its parameters' gradients, which the first backward after `zero_grad`
    /// allocates and later ones reuse (parameter memory, not part of the peaks above).
    pub grad_bytes: u64,
    /// Time of its forward.
    pub fwd_time: Duration,
    /// Time of its backward.
    pub bwd_time: Duration,
}

/// Per-layer figures of a whole chain, input to prediction and planning.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChainProfile {
    /// One entry per layer, in chain order.
    pub layers: Vec<LayerProfile>,
}

/// What a schedule is predicted to cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    /// Peak activation memory of one forward + backward, in bytes, including the moment the
    /// caller computes the loss gradient (the output and its gradient both alive).
    pub peak_bytes: u64,
    /// Activation memory kept between forward and backward (saved tensors, checkpoints and
    /// the output), in bytes.
    pub kept_bytes: u64,
    /// Forward time recomputed in backward.
    pub recompute: Duration,
    /// `recompute` as a fraction of the plain forward + backward time.
    pub overhead: f64,
    /// Bytes of parameter gradients the first step after `zero_grad` allocates on top of
    /// activation memory: that step leaves this much more allocated, and its peak is at most
    /// `peak_bytes + grad_bytes` (the steady-state peak is `peak_bytes`).
    pub grad_bytes: u64,
}

/// The cost of one segment given the memory `M` kept by the segments before it: its phase
/// peak above `M`, the bytes it keeps for later segments, and its recompute time.
#[derive(Clone, Copy, Debug)]
struct SegmentCost {
    peak: u64,
    kept: u64,
    recompute: f64,
}

impl ChainProfile {
    fn out(&self, i: usize) -> u64 {
        self.layers[i].out_bytes
    }

    /// Bytes of the input tensor of layer `i` that the executor owns (the chain input is the
    /// caller's and not counted).
    fn input(&self, i: usize) -> u64 {
        if i == 0 { 0 } else { self.out(i - 1) }
    }

    /// Bytes of the output gradient layer `i` receives.
    fn dy(&self, i: usize) -> u64 {
        if i + 1 == self.layers.len() { self.out(i) } else { self.layers[i + 1].dx_bytes }
    }

    /// Bytes above what the segments keep between the forward and the backward when the
    /// caller computes the loss gradient: the chain's output and its gradient, both alive
    /// (the output is freed once the loss gradient exists, before backward starts).
    fn loss_moment(&self) -> u64 {
        let n = self.layers.len();
        if n == 0 { 0 } else { self.out(n - 1) + self.dy(n - 1) }
    }

    /// Costs of every segment starting at `s`, for each end `s+1..=n`, plain and
    /// checkpointed: `[(plain, checkpointed)]`, indexed by `end - s - 1`.
    fn segment_costs_from(&self, s: usize) -> Vec<(SegmentCost, SegmentCost)> {
        let n = self.layers.len();
        let ckpt = self.input(s);
        let (mut saved, mut fwd_plain, mut fwd_ckpt, mut recompute_inner, mut bwd) =
            (0u64, 0u64, 0u64, 0u64, 0u64);
        let mut time = 0.0;
        let mut out = Vec::with_capacity(n - s);
        for i in s..n {
            let l = &self.layers[i];
            // Forward, plain: earlier saved tensors and the input are live.
            fwd_plain = fwd_plain.max(saved + self.input(i) + l.fwd_peak_bytes);
            // Forward, checkpointed: the checkpoint and (past the first layer) the input.
            let own = if i == s { 0 } else { self.input(i) };
            fwd_ckpt = fwd_ckpt.max(ckpt + own + l.fwd_peak_bytes);
            // Recomputation in backward, above the incoming gradient: the checkpoint is the
            // first layer's input and is dropped after it.
            let input = if i == s { ckpt } else { self.input(i) };
            recompute_inner = recompute_inner.max(saved + input + l.fwd_peak_bytes);
            saved += l.saved_bytes;
            // Backward: saved tensors up to this layer and its output gradient.
            bwd = bwd.max(saved + self.dy(i) + l.bwd_peak_bytes);
            time += l.fwd_time.as_secs_f64();
            let plain = SegmentCost { peak: fwd_plain.max(bwd), kept: saved, recompute: 0.0 };
            let recompute_peak = self.dy(i) + recompute_inner;
            let checkpointed = SegmentCost {
                peak: fwd_ckpt.max(recompute_peak).max(bwd),
                kept: ckpt,
                recompute: time,
            };
            out.push((plain, checkpointed));
        }
        out
    }

    /// Predicts a schedule's peak activation memory and recomputation.
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`] if the schedule does not cover this chain.
    pub fn predict(&self, schedule: &Schedule) -> Result<Prediction> {
        let n = self.layers.len();
        if schedule.layer_count() != n {
            return Err(Error::LengthMismatch {
                what: "schedule",
                expected: n,
                got: schedule.layer_count(),
            });
        }
        let (mut kept, mut peak, mut recompute) = (0u64, 0u64, 0.0f64);
        for seg in schedule.segments() {
            let costs = self.segment_costs_from(seg.start);
            let (plain, ckpt) = costs[seg.end - seg.start - 1];
            let c = if seg.checkpointed { ckpt } else { plain };
            peak = peak.max(kept + c.peak);
            kept += c.kept;
            recompute += c.recompute;
        }
        peak = peak.max(kept + self.loss_moment());
        let total: f64 = self.layers.iter().map(|l| (l.fwd_time + l.bwd_time).as_secs_f64()).sum();
        Ok(Prediction {
            peak_bytes: peak,
            kept_bytes: kept + self.out(n - 1),
            recompute: Duration::from_secs_f64(recompute),
            overhead: if total > 0.0 { recompute / total } else { 0.0 },
            grad_bytes: self.layers.iter().map(|l| l.grad_bytes).sum(),
        })
    }

    /// All segment costs, `table[s][end - s - 1]`.
    fn table(&self) -> Vec<Vec<(SegmentCost, SegmentCost)>> {
        (0..self.layers.len()).map(|s| self.segment_costs_from(s)).collect()
    }

    /// The smallest predicted peak any segmentation reaches.
    pub fn min_peak_bytes(&self) -> u64 {
        let n = self.layers.len();
        if n == 0 {
            return 0;
        }
        let table = self.table();
        // Pareto fronts of (kept bytes, peak so far) per prefix length: a prefix is worth
        // extending only if no other keeps less memory with a lower peak.
        let mut fronts: Vec<Vec<(u64, u64)>> = vec![Vec::new(); n + 1];
        fronts[0].push((0, 0));
        for s in 0..n {
            let front = std::mem::take(&mut fronts[s]);
            for &(kept, peak) in &front {
                for (len, (plain, ckpt)) in table[s].iter().enumerate() {
                    for c in [plain, ckpt] {
                        insert_pareto(
                            &mut fronts[s + len + 1],
                            (kept + c.kept, peak.max(kept + c.peak)),
                        );
                    }
                }
            }
        }
        let loss = self.loss_moment();
        fronts[n].iter().map(|&(kept, p)| p.max(kept + loss)).min().unwrap_or(0)
    }

    /// The schedule with the least recomputation whose predicted peak is at most `budget`
    /// bytes (ties go to the one keeping less memory).
    ///
    /// Dynamic programming over prefixes of the chain: for each prefix it keeps the
    /// Pareto-optimal partial plans in (memory kept for later segments, recompute time), all
    /// of whose segments fit the budget; a plan's peak is `max_j (M_j + P_j)`, so a prefix's
    /// kept memory is all a later segment needs to know. Exact for the profile's figures;
    /// `O(n^2 * F)` for fronts of size `F`.
    ///
    /// # Errors
    ///
    /// [`Error::BudgetTooSmall`] if no segmentation fits; [`Error::InvalidArgument`] for an
    /// empty profile.
    pub fn fastest_within(&self, budget: u64) -> Result<Schedule> {
        let n = self.layers.len();
        check_len(n)?;
        let table = self.table();
        // Per prefix length: (kept, recompute, previous prefix length, index there, segment).
        type Entry = (u64, f64, usize, usize, Segment);
        let mut fronts: Vec<Vec<Entry>> = vec![Vec::new(); n + 1];
        fronts[0].push((0, 0.0, 0, 0, Segment { start: 0, end: 0, checkpointed: false }));
        for s in 0..n {
            for idx in 0..fronts[s].len() {
                let (kept, time, ..) = fronts[s][idx];
                for (len, (plain, ckpt)) in table[s].iter().enumerate() {
                    for (c, checkpointed) in [(plain, false), (ckpt, true)] {
                        if kept + c.peak > budget {
                            continue;
                        }
                        let end = s + len + 1;
                        let seg = Segment { start: s, end, checkpointed };
                        let entry = (kept + c.kept, time + c.recompute, s, idx, seg);
                        let front = &mut fronts[end];
                        if front.iter().any(|e| e.0 <= entry.0 && e.1 <= entry.1) {
                            continue;
                        }
                        // Dominated entries stay (indices must stay valid for back-pointers);
                        // they are never better, so the extra work is all they cost.
                        front.push(entry);
                    }
                }
            }
        }
        let loss = self.loss_moment();
        let best = fronts[n]
            .iter()
            .enumerate()
            .filter(|(_, e)| e.0 + loss <= budget)
            .min_by(|a, b| a.1.1.total_cmp(&b.1.1).then(a.1.0.cmp(&b.1.0)))
            .map(|(i, _)| i);
        let Some(mut idx) = best else {
            return Err(Error::BudgetTooSmall { budget, minimum: self.min_peak_bytes() });
        };
        let mut segments = Vec::new();
        let mut at = n;
        while at > 0 {
            let (_, _, prev, prev_idx, seg) = fronts[at][idx];
            segments.push(seg);
            at = prev;
            idx = prev_idx;
        }
        segments.reverse();
        Schedule::from_segments(segments)
    }
}

/// Adds `(kept, peak)` to a Pareto front of points minimizing both, dropping what it
/// dominates.
fn insert_pareto(front: &mut Vec<(u64, u64)>, p: (u64, u64)) {
    if front.iter().any(|q| q.0 <= p.0 && q.1 <= p.1) {
        return;
    }
    front.retain(|q| !(p.0 <= q.0 && p.1 <= q.1));
    front.push(p);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uniform(n: usize) -> ChainProfile {
        let l = LayerProfile {
            name: "l".into(),
            out_bytes: 100,
            saved_bytes: 300,
            fwd_peak_bytes: 400,
            bwd_peak_bytes: 300,
            dx_bytes: 100,
            grad_bytes: 50,
            fwd_time: Duration::from_millis(1),
            bwd_time: Duration::from_millis(2),
        };
        ChainProfile { layers: vec![l; n] }
    }

    #[test]
    fn layer_count_counts_layers_and_segments_are_counted_apart() {
        let s = Schedule::every(10, 4).unwrap();
        assert_eq!((s.layer_count(), s.segments().len()), (10, 3));
        assert_eq!(uniform(9).predict(&Schedule::sqrt(9).unwrap()).unwrap().grad_bytes, 450);
    }

    #[test]
    fn every_k_checkpoints_all_segments_but_the_last() {
        let s = Schedule::every(10, 4).unwrap();
        let flags: Vec<_> = s.segments().iter().map(|s| (s.start, s.end, s.checkpointed)).collect();
        assert_eq!(flags, [(0, 4, true), (4, 8, true), (8, 10, false)]);
        assert_eq!(Schedule::sqrt(16).unwrap().segments().len(), 4);
    }

    #[test]
    fn segments_that_do_not_tile_the_chain_are_rejected() {
        let seg = |start, end| Segment { start, end, checkpointed: true };
        assert!(Schedule::from_segments(vec![seg(0, 2), seg(3, 4)]).is_err());
        assert!(Schedule::from_segments(vec![seg(0, 0)]).is_err());
        assert!(Schedule::from_segments(vec![]).is_err());
        assert!(Schedule::every(3, 0).is_err());
        assert!(Schedule::none(0).is_err());
    }

    #[test]
    fn budget_at_the_plain_peak_needs_no_recomputation() {
        let p = uniform(9);
        let plain = p.predict(&Schedule::none(9).unwrap()).unwrap();
        let s = p.fastest_within(plain.peak_bytes).unwrap();
        assert_eq!(p.predict(&s).unwrap().recompute, Duration::ZERO);
        let tighter = p.fastest_within(plain.peak_bytes - 1).unwrap();
        let pred = p.predict(&tighter).unwrap();
        assert!(pred.peak_bytes < plain.peak_bytes && pred.recompute > Duration::ZERO);
    }

    #[test]
    fn budget_below_the_minimum_peak_is_an_error_naming_the_minimum() {
        let p = uniform(9);
        let min = p.min_peak_bytes();
        assert!(p.fastest_within(min).is_ok());
        match p.fastest_within(min - 1) {
            Err(Error::BudgetTooSmall { minimum, .. }) => assert_eq!(minimum, min),
            other => panic!("expected BudgetTooSmall, got {other:?}"),
        }
    }

    /// The DP's answer is no slower than any every-k plan that fits the same budget.
    #[test]
    fn budget_plan_is_no_slower_than_any_fitting_every_k_plan() {
        let p = uniform(25);
        for k in 1..=25 {
            let s = Schedule::every(25, k).unwrap();
            let pred = p.predict(&s).unwrap();
            let best = p.predict(&p.fastest_within(pred.peak_bytes).unwrap()).unwrap();
            assert!(best.peak_bytes <= pred.peak_bytes);
            assert!(best.recompute <= pred.recompute, "k = {k}");
        }
    }
}

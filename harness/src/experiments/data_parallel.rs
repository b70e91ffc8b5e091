//! `data-parallel`: per-device (= per-process, one process per GPU) memory, step time and
//! bytes moved per step of DDP, ZeRO-1/2/3 and `nn.DataParallel` on N = 1, 2, 4, 8
//! devices: executed on host devices with a small GPT, and on virtual devices at GPT-2
//! medium's size (memory only). The runs are `vram_harness::dp::measure` (collectives
//! metered as a ring moves them); this file turns them into variants and verdicts.

use super::{Experiment, Sweep};
use crate::data::Dataset;
use crate::dp::{DeviceKind, DpRun, analytic_state_bytes, measure};
use crate::models::Arch;
use crate::techniques::Technique;
use crate::{Claim, Context, ExperimentError, Timing, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use vram_kernels::DType;
use vram_parallel::{DpConfig, Strategy, ring_bytes_per_param};

const DEVICES: [usize; 4] = [1, 2, 4, 8];

/// The two models as rows and figures name them (where they ran, dropout, attention form,
/// precision).
const SMALL_GPT: &str = "small GPT (d 64, 2 layers, 4 heads, 32 tokens, dropout 0, fused attention), fp32, executed on host devices";
const MEDIUM: &str = "GPT-2 medium (untied head, 1024 tokens, dropout 0, fused attention), bf16 + f32 AdamW, virtual devices";

/// GPT-2 medium (16-head attention) with an untied LM head (+vocab x d = 51.5 M
/// parameters), no dropout: ZeRO's formulas (16/N bytes of states, 3 (N-1)/N bytes moved
/// per parameter) count each parameter used once per pass, and a tied head reads the token
/// table twice (ZeRO-3 gathers it twice: `cargo xtask plan --gpus` runs tied heads and says
/// so), so the claims are tested on the formulas' own terms.
fn gpt2_medium() -> (Arch, Dataset) {
    let (vocab, seq) = (50257, 1024);
    (
        Arch::Gpt { vocab, d: 1024, layers: 24, heads: 16, seq, dropout: 0.0, tied: false },
        Dataset::Sequences { vocab, seq },
    )
}

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "data-parallel",
        name: "data parallel over several GPUs",
        claim: "spreads memory and work",
        source: "002_07a140921eef9482.txt, 003_9fc4b5f809544d8d.txt",
    },
    run,
    plot: None,
    host_capacity_limit: None,
    expected_secs: [3.9, 5.0],
};

/// One run: a strategy on N devices, per-device figures.
#[derive(Serialize)]
pub(super) struct Measured {
    model: &'static str,
    strategy: &'static str,
    devices: usize,
    params: u64,
    per_device_peak_allocated_bytes: Vec<u64>,
    per_device_peak_reserved_bytes: Vec<u64>,
    /// Bytes of model states (weights, gradients, optimizer state, buckets) after a step,
    /// cuBLAS workspace left out.
    per_device_model_state_bytes: Vec<u64>,
    /// The same as the tensors requested them (before the allocator's rounding).
    per_device_model_state_requested_bytes: Vec<u64>,
    blas_workspace_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    analytic_state_bytes: Option<u64>,
    /// Bytes each rank's collectives send per step per parameter, as a ring moves them
    /// (counted on the calls; the setup's broadcast left out), the largest over the ranks.
    bytes_per_param_per_step: f64,
    /// The ring's formula for the strategy (`None`: DataParallel).
    #[serde(skip_serializing_if = "Option::is_none")]
    analytic_bytes_per_param_per_step: Option<f64>,
}

fn push(sweep: &mut Sweep<Measured>, label: &'static str, run: &DpRun, dtype: DType, timed: bool) {
    let per =
        |f: fn(&vram_parallel::RankReport) -> u64| run.ranks.iter().map(f).collect::<Vec<_>>();
    let ws = run.workspace_bytes;
    let m = Measured {
        model: label,
        strategy: run.config.strategy.name(),
        devices: run.devices,
        params: run.params,
        per_device_peak_allocated_bytes: per(|r| r.peak_allocated),
        per_device_peak_reserved_bytes: per(|r| r.peak_reserved),
        per_device_model_state_bytes: run
            .ranks
            .iter()
            .map(|r| r.state_bytes.saturating_sub(ws))
            .collect(),
        per_device_model_state_requested_bytes: run
            .ranks
            .iter()
            .map(|r| r.state_requested_bytes.saturating_sub(ws))
            .collect(),
        blas_workspace_bytes: ws,
        analytic_state_bytes: analytic_state_bytes(&run.config, dtype, run.params, run.devices)
            .map(|a| a.round() as u64),
        bytes_per_param_per_step: run.bytes_per_param_per_step(),
        analytic_bytes_per_param_per_step: ring_bytes_per_param(
            run.config.strategy,
            run.devices,
            dtype.size_in_bytes(),
        ),
    };
    let step = if timed { Timing::from_samples(&run.step_samples_ms()) } else { None };
    let name = format!("{label}: {} x{}", run.config.strategy.name(), run.devices);
    sweep.push(&name, run.max_peak_allocated(), run.max_peak_reserved(), step, m);
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let host_arch =
        Arch::Gpt { vocab: 64, d: 64, layers: 2, heads: 4, seq: 32, dropout: 0.0, tied: false };
    let host_data = Dataset::Sequences { vocab: 64, seq: 32 };
    let (big, big_data) = gpt2_medium();
    let (samples, host_steps, virt_steps) = (8, if ctx.quick { 3 } else { 6 }, 2);
    let capacity = 80 << 30;
    let mut sweep = Sweep::new(
        ctx,
        json!({
            "devices": DEVICES,
            "strategies": Strategy::ALL.iter().map(|s| s.name()).collect::<Vec<_>>(),
            "host_model": format!("{host_arch:?}"), "host_dtype": "f32",
            "virtual_model": format!("GPT-2 medium, untied LM head: {big:?}"),
            "virtual_dtype": "bf16 weights and gradients, f32 master and AdamW moments",
            "virtual_capacity_bytes": capacity,
            "global_batch_sequences": samples, "bucket_cap_bytes": vram_parallel::DEFAULT_BUCKET_CAP_BYTES,
            "collectives": "in-process (threads) on host devices, memory-only on virtual devices; metered as a ring moves them",
            "processes": "one process per GPU holds one rank's figures (the TCP backend's multi-process runs hold what the in-process ranks hold: harness/tests/multi_process.rs)",
        }),
    );
    let mut host = Vec::new();
    let mut virt = Vec::new();
    for strategy in Strategy::ALL {
        for n in DEVICES {
            let config = DpConfig::new(strategy);
            let kind = DeviceKind::Host(ctx.device_memory);
            let r = measure(
                &host_arch,
                &host_data,
                DType::F32,
                config,
                n,
                kind,
                samples,
                host_steps,
                ctx.seed,
            )?;
            push(&mut sweep, SMALL_GPT, &r, DType::F32, true);
            host.push(r);
            let kind = DeviceKind::Virtual(capacity);
            let r = measure(
                &big,
                &big_data,
                DType::BF16,
                config,
                n,
                kind,
                samples,
                virt_steps,
                ctx.seed,
            )?;
            push(&mut sweep, MEDIUM, &r, DType::BF16, false);
            virt.push(r);
        }
    }
    let find = |runs: &[DpRun], s: Strategy, n: usize| {
        runs.iter().find(|r| r.config.strategy == s && r.devices == n).cloned()
    };
    let series = |runs: &[DpRun], s: Strategy, f: fn(&DpRun) -> u64| -> Vec<u64> {
        DEVICES.iter().filter_map(|&n| find(runs, s, n).map(|r| f(&r))).collect()
    };

    // Memory: per-device peak over N for every strategy, at GPT-2 medium size.
    let falls = |v: &[u64]| v.windows(2).all(|w| w[1] < w[0]);
    let mut spread = Vec::new();
    let mut lines = Vec::new();
    for s in Strategy::ALL {
        let peaks = series(&virt, s, DpRun::max_peak_allocated);
        if falls(&peaks) {
            spread.push(s.name());
        }
        lines.push(format!(
            "{}: {}",
            s.name(),
            peaks.iter().map(|&p| human_bytes(p)).collect::<Vec<_>>().join(" / ")
        ));
    }
    let ddp_states = series(&virt, Strategy::Ddp, DpRun::max_state_bytes);
    sweep.claim(Claim {
        claim: "data parallel training spreads memory over the devices (largest per-device peak falls with N)".into(),
        measured: format!(
            "{MEDIUM}, global batch {samples} x 1024 tokens, largest per-device peak allocated at N = 1 / 2 / 4 / 8: {}; falls with N for: {}. DDP and DataParallel spread only the activations (DDP's model states per device: {})",
            lines.join("; "),
            if spread.is_empty() { "none".into() } else { spread.join(", ") },
            ddp_states.iter().map(|&p| human_bytes(p)).collect::<Vec<_>>().join(" / ")
        ),
        verdict: match spread.len() {
            n if n == Strategy::ALL.len() => Verdict::Holds,
            0 => Verdict::DoesNotHold,
            _ => Verdict::Partly,
        },
    });

    // ZeRO's model states against the analytic partition.
    let mut worst: f64 = 0.0;
    let mut table = Vec::new();
    for s in [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
        for r in virt.iter().filter(|r| r.config.strategy == s) {
            let a = analytic_state_bytes(&r.config, DType::BF16, r.params, r.devices)
                .unwrap_or(f64::NAN);
            let got = r.max_state_bytes();
            worst = worst.max((got as f64 - a).abs() / a);
            if r.devices == 8 {
                table.push(format!(
                    "{} x8 {} (analytic {})",
                    s.name(),
                    human_bytes(got),
                    human_bytes(a as u64)
                ));
            }
        }
    }
    // vram's ZeRO shards exactly as the formula says: the agreement is by design.
    sweep.check(
        "vram's sharding holds the model states ZeRO's formulas give per device (ZeRO-1: 4 + 12/N, ZeRO-2: 2 + 14/N, ZeRO-3: 16/N bytes per parameter)",
        format!(
            "{MEDIUM}: model states per device after a step (bytes the tensors requested), measured vs analytic: {}; largest deviation over N = 1..8 and DDP/ZeRO-1/2/3: {:.3}%",
            table.join(", "),
            100.0 * worst
        ),
        worst <= 0.01,
    );

    // nn.DataParallel's device 0.
    let imbalance = |runs: &[DpRun]| {
        find(runs, Strategy::DataParallel, 8).map(|r| {
            let p: Vec<u64> = r.ranks.iter().map(|x| x.peak_allocated).collect();
            let others = p[1..].iter().copied().max().unwrap_or(0).max(1);
            (p[0], others, p[0] as f64 / others as f64)
        })
    };
    let (vi, hi) = (imbalance(&virt), imbalance(&host));
    if let (Some((v0, vo, vr)), Some((h0, ho, hr))) = (vi, hi) {
        sweep.claim(Claim {
            claim: "nn.DataParallel loads device 0 more than the others (outputs, loss, gradients and optimizer there)".into(),
            measured: format!(
                "8 devices, peak allocated on device 0 vs the largest other: {MEDIUM}: {} vs {} ({vr:.2}x); {SMALL_GPT}: {} vs {} ({hr:.2}x)",
                human_bytes(v0), human_bytes(vo), human_bytes(h0), human_bytes(ho)
            ),
            verdict: if vr >= 1.10 && hr >= 1.10 { Verdict::Holds } else if vr >= 1.10 || hr >= 1.10 { Verdict::Partly } else { Verdict::DoesNotHold },
        });
    }

    let peak_at = |s: Strategy, n: usize| find(&virt, s, n).map_or(0, |r| r.max_peak_allocated());
    // DDP's states per parameter as measured: bf16 weights and gradients (2 + 2), f32 master
    // weights and AdamW moments (12), and the gradient buckets DDP keeps between steps (2).
    let ddp_per_param = find(&virt, Strategy::Ddp, 1)
        .map_or(f64::NAN, |r| r.max_state_bytes() as f64 / r.params.max(1) as f64);
    let peaks_reading = format!(
        "{MEDIUM}: largest per-device peak on 1 -> 8 devices: DDP {} -> {} (its {ddp_per_param:.1} B/param of states (bf16 weights and gradients, f32 master weights and AdamW moments, the gradient buckets it keeps) stay on every device; only activations spread), ZeRO-3 {} -> {} (states sharded too); nn.DataParallel keeps device 0 the fullest",
        human_bytes(peak_at(Strategy::Ddp, 1)),
        human_bytes(peak_at(Strategy::Ddp, 8)),
        human_bytes(peak_at(Strategy::Zero3, 1)),
        human_bytes(peak_at(Strategy::Zero3, 8)),
    );

    // Per process (one per GPU) and what the collectives move per step.
    let mut memory = Vec::new();
    let mut traffic = Vec::new();
    let mut worst_traffic: f64 = 0.0;
    for s in [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
        let runs: Vec<DpRun> = DEVICES.iter().filter_map(|&n| find(&virt, s, n)).collect();
        memory.push(format!(
            "{}: {}",
            s.name(),
            runs.iter()
                .map(|r| format!(
                    "{} / {}",
                    human_bytes(r.max_state_bytes()),
                    human_bytes(r.max_peak_allocated())
                ))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        let mut per = Vec::new();
        for r in &runs {
            let got = r.bytes_per_param_per_step();
            let want = ring_bytes_per_param(s, r.devices, 2).unwrap_or(f64::NAN);
            if want > 0.0 {
                worst_traffic = worst_traffic.max((got - want).abs() / want);
            }
            per.push(format!("{got:.3}"));
        }
        traffic.push(format!("{} {}", s.name(), per.join(" / ")));
    }
    sweep.reading(format!(
        "{peaks_reading}. One process per GPU: per-process model states / peak allocated, {MEDIUM}, N = 1, 2, 4, 8 processes: {}. The head is untied (+51.5 M parameters) because ZeRO's formulas count each parameter used once per pass and a tied table is read twice (ZeRO-3 gathers it twice); `cargo xtask plan --gpus N` runs GPT-2's tied head",
        memory.join("; ")
    ));
    sweep.claim(Claim {
        claim: "ZeRO-1 and ZeRO-2 move what DDP moves per step (2 (N-1)/N bytes per 16-bit gradient byte: a reduce-scatter and an all-gather equal an all-reduce); ZeRO-3 moves 1.5 times as much (weights gathered for forward and again for backward)".into(),
        measured: format!(
            "bytes each process sends per parameter per step (bf16, counted on the collectives the trainer calls, as a ring moves them), {MEDIUM}, at N = 1 / 2 / 4 / 8: {}; analytic 2 x 2 (N-1)/N = 0 / 2 / 3 / 3.5 for DDP, ZeRO-1/2 and 3 x 2 (N-1)/N = 0 / 3 / 4.5 / 5.25 for ZeRO-3; largest deviation {:.3}% (ZeRO's shards padded to N)",
            traffic.join("; "),
            100.0 * worst_traffic
        ),
        verdict: if worst_traffic <= 0.01 { Verdict::Holds } else if worst_traffic <= 0.10 { Verdict::Partly } else { Verdict::DoesNotHold },
    });

    // Work: step time over N, on the host.
    let times: Vec<String> = Strategy::ALL
        .iter()
        .map(|&s| {
            let t: Vec<String> = DEVICES
                .iter()
                .filter_map(|&n| find(&host, s, n))
                .filter_map(|r| Timing::from_samples(&r.step_samples_ms()))
                .map(|t| t.describe())
                .collect();
            format!("{}: {}", s.name(), t.join(" / "))
        })
        .collect();
    sweep.claim(Claim {
        claim: "data parallel training spreads the work (step time falls with N)".into(),
        measured: format!(
            "host timings, not GPU timings: the ranks are threads sharing this machine's CPU cores, so they say nothing of N GPUs; {SMALL_GPT}: step time of the slowest rank (mean +- 95% interval) at N = 1 / 2 / 4 / 8: {}",
            times.join("; ")
        ),
        verdict: Verdict::NotApplicable,
    });
    Ok(sweep)
}

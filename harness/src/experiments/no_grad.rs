//! `no-grad-inference`: evaluation with and without recording what backward needs.

use super::common::{
    EXECUTED, REAL_CAPACITY, REAL_SIZE_CAVEAT, cnn, cnn_side, device, gpt_tag, gpu_usable, stripes,
    sync,
};
use super::{Experiment, Sweep};
use crate::models::{Arch, Attention, Model};
use crate::plots::grouped_bars;
use crate::techniques::Technique;
use crate::timing::{Timing, interleaved};
use crate::{Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use std::time::Instant;
use vram_accum::Mode;
use vram_kernels::{DType, Device};

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "no-grad-inference",
        name: "evaluation without saved activations",
        claim: "saves memory in evaluation",
        source: "000_cc24938f7d0f0079.txt, 002_07a140921eef9482.txt, 003_9fc4b5f809544d8d.txt",
    },
    run,
    plot: Some(plot),
    host_capacity_limit: None,
    expected_secs: [1.0, 8.7],
};

/// One evaluation's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    part: &'static str,
    model: String,
    batch_size: usize,
    saving_activations: bool,
    weights_bytes: u64,
}

const SMALL: &str = "small (executed)";
const REAL: &str = super::common::REAL_VIRTUAL;

/// Real-size models (fp32) and the evaluation batches swept.
fn real_sweeps(quick: bool) -> Vec<(&'static str, Vec<usize>)> {
    if quick {
        vec![("resnet50", vec![32, 64, 128]), ("gpt2-small", vec![1, 4, 8])]
    } else {
        vec![("resnet50", vec![32, 64, 128, 256]), ("gpt2-small", vec![1, 4, 8, 16])]
    }
}

/// Peak allocated and reserved bytes and weight bytes of one real-size evaluation forward in
/// `mode` on `dev` (fresh): the virtual device's prediction, or on a GPU the run there (with
/// values, timed after a warm-up evaluation: then the times of [`REPEATS`] more).
fn real_eval(
    dev: &Device,
    arch: &Arch,
    batch: usize,
    mode: Mode,
    seed: u64,
) -> Result<(u64, u64, u64, Option<Timing>), ExperimentError> {
    let mut model = Model::new(dev, arch.clone(), seed, DType::F32)?;
    if dev.is_virtual() {
        let b = arch.dataset().batch_without_values(seed, 0, batch);
        model.eval_loss(&b, mode)?;
        return Ok((
            dev.max_memory_allocated(),
            dev.max_memory_reserved(),
            model.param_bytes(),
            None,
        ));
    }
    let b = arch.dataset().batch(seed, 0, batch);
    let mut times = Vec::new();
    for i in 0..=REPEATS {
        sync(dev)?;
        let started = Instant::now();
        model.eval_loss(&b, mode)?;
        sync(dev)?;
        if i > 0 {
            times.push(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    let step = Timing::from_samples(&times);
    Ok((dev.max_memory_allocated(), dev.max_memory_reserved(), model.param_bytes(), step))
}

/// Timed evaluations after the first.
const REPEATS: usize = 4;

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let batches: &[usize] = if ctx.quick { &[8, 16, 32] } else { &[16, 32, 64] };
    let side = cnn_side(ctx);
    let arch = cnn(ctx, false);
    let data = stripes(side);
    let mut sweep = Sweep::new(
        ctx,
        json!({ "model": format!("{arch:?}"), "image_side": side, "batch_sizes": batches, "timed_evaluations": REPEATS }),
    );
    let modes = [(Mode::Train, "saving activations"), (Mode::Inference, "inference mode")];
    // One model per batch size and mode; every evaluation of a batch size interleaves its two
    // modes. The first evaluation is a warm-up; the peak is that of the timed ones.
    let mut states: Vec<(Device, Model, Mode, crate::data::Batch)> = Vec::new();
    for &b in batches {
        for (mode, _) in modes {
            let dev = device(ctx, "")?;
            let model = Model::new(&dev, arch.clone(), ctx.seed, DType::F32)?;
            states.push((dev, model, mode, data.batch(ctx.seed, 0, b)));
        }
    }
    for (dev, model, mode, batch) in &mut states {
        model.eval_loss(batch, *mode)?;
        dev.reset_peak_stats();
    }
    let samples = interleaved(&mut states, 0, REPEATS, |(dev, model, mode, batch)| {
        let started = Instant::now();
        model.eval_loss(batch, *mode)?;
        sync(dev)?;
        Ok::<_, ExperimentError>(started.elapsed().as_secs_f64() * 1e3)
    })?;
    let mut ratios = Vec::new();
    let mut i = 0;
    for &b in batches {
        let mut peaks = [0u64; 2];
        for (k, (mode, label)) in modes.iter().enumerate() {
            let (dev, model, _, _) = &states[i];
            let measured = Measured {
                part: SMALL,
                model: format!("{arch:?}"),
                batch_size: b,
                saving_activations: *mode == Mode::Train,
                weights_bytes: model.param_bytes(),
            };
            sweep.push(
                &format!("{SMALL}: batch {b}, {label}"),
                dev.max_memory_allocated(),
                dev.max_memory_reserved(),
                Timing::from_samples(&samples[i]),
                measured,
            );
            peaks[k] = dev.max_memory_allocated() - model.param_bytes();
            i += 1;
        }
        ratios.push((b, peaks[0], peaks[1]));
    }
    let all_less = ratios.iter().all(|&(_, train, inf)| inf < train);
    // Real size: the same two evaluations of real models on the virtual device and, on a GPU,
    // executed there.
    let mut real = Vec::new();
    let (mut not_run, mut gpu) = (Vec::new(), Vec::new());
    let mut tags: Vec<(&str, String)> = Vec::new();
    for (name, batches) in real_sweeps(ctx.quick) {
        let arch = Arch::preset(name)?;
        let tag = gpt_tag(name, &arch, Attention::Fused, "fp32");
        tags.push((name, tag.clone()));
        for b in batches {
            let mut peaks = [0u64; 2];
            let mut executed = [None::<u64>; 2];
            let mut weights = 0;
            for (k, (mode, label)) in modes.iter().enumerate() {
                let virt = Device::virtual_device(REAL_CAPACITY);
                let (alloc, reserved, w, _) = real_eval(&virt, &arch, b, *mode, ctx.seed)?;
                let row = |part| Measured {
                    part,
                    model: tag.clone(),
                    batch_size: b,
                    saving_activations: *mode == Mode::Train,
                    weights_bytes: w,
                };
                let what = format!("{tag}, batch {b}, {label}");
                sweep.push(&format!("{REAL}: {what}"), alloc, reserved, None, row(REAL));
                (peaks[k], weights) = (alloc, w);
                // On a GPU, the same evaluation executed there where the card holds it.
                if let Some(usable) = gpu_usable(ctx) {
                    if reserved > usable {
                        not_run.push(format!("{what}: needs {} reserved", human_bytes(reserved)));
                        continue;
                    }
                    let dev = device(ctx, "")?;
                    match real_eval(&dev, &arch, b, *mode, ctx.seed) {
                        Ok((alloc, reserved, _, step)) => {
                            let name = format!("{EXECUTED}: {what}");
                            sweep.push(&name, alloc, reserved, step, row(EXECUTED));
                            executed[k] = Some(alloc);
                        }
                        Err(e) if e.is_out_of_memory() => {
                            not_run.push(format!("{what}: ran out of the card's memory"));
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            gpu.push(executed);
            real.push((name, b, peaks[0], peaks[1], weights));
        }
    }
    // The GPU's peaks where every evaluation ran there, else the virtual device's (one figure,
    // one source).
    let part = if !gpu.is_empty() && gpu.iter().all(|g| g.iter().all(Option::is_some)) {
        for (r, g) in real.iter_mut().zip(&gpu) {
            (r.2, r.3) = (g[0].unwrap_or(r.2), g[1].unwrap_or(r.3));
        }
        EXECUTED
    } else {
        REAL
    };
    let real_less = real.iter().all(|r| r.3 < r.2);
    if !not_run.is_empty() {
        sweep.reading(format!(
            "Real-size evaluations not executed on the GPU (their figures are the virtual device's): {}",
            not_run.join("; ")
        ));
    }
    let real_text = real
        .iter()
        .map(|&(n, b, t, i, w)| {
            let n = tags.iter().find(|x| x.0 == n).map_or(n, |x| x.1.as_str());
            format!(
                "{n} batch {b}: {} -> {} ({:.1}x less above the weights {})",
                human_bytes(t),
                human_bytes(i),
                (t - w) as f64 / (i.saturating_sub(w)).max(1) as f64,
                human_bytes(w)
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    sweep.claim(Claim {
        claim: "evaluating without saving activations (no_grad) saves memory".into(),
        measured: format!("{SMALL}: {}. {part}, fp32, peak with -> without saved activations: {real_text} ({REAL_SIZE_CAVEAT})", ratios
            .iter()
            .map(|&(b, t, i)| {
                format!(
                    "batch {b}: {} -> {} above the weights ({:.1}x less)",
                    human_bytes(t),
                    human_bytes(i),
                    t as f64 / i.max(1) as f64
                )
            })
            .collect::<Vec<_>>()
            .join("; ")),
        verdict: if all_less && real_less {
            Verdict::Holds
        } else if all_less || real_less {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    let biggest = |n: &str| real.iter().filter(|r| r.0 == n).max_by_key(|r| r.1).copied();
    if let (Some(r), Some(g)) = (biggest("resnet50"), biggest("gpt2-small")) {
        sweep.reading(format!(
            "Wrap evaluation in no_grad / inference mode: at real size it frees {} at ResNet-50 batch {} ({} -> {}) and {} at {} batch {} ({} -> {}), because only the live layer's activations are kept instead of every layer's.",
            human_bytes(r.2 - r.3.min(r.2)), r.1, human_bytes(r.2), human_bytes(r.3),
            human_bytes(g.2 - g.3.min(g.2)), tags.iter().find(|x| x.0 == g.0).map_or(g.0, |x| x.1.as_str()), g.1, human_bytes(g.2), human_bytes(g.3),
        ));
    }
    Ok(sweep)
}

/// Real-size evaluation peaks with and without saved activations, per model and batch.
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let mut groups: Vec<(String, Vec<f64>)> = Vec::new();
    let mut forms: Vec<&str> = Vec::new();
    for (v, m) in sweep.variants().iter().filter(|(_, m)| m.part == REAL) {
        let short = m.model.split(" (").next().unwrap_or(&m.model);
        let label = format!("{short} b{}", m.batch_size);
        if short != m.model {
            forms.push(m.model.as_str());
        }
        let gib = v.peak_allocated_bytes as f64 / (1024.0 * 1024.0 * 1024.0);
        let slot = usize::from(!m.saving_activations);
        match groups.iter_mut().find(|g| g.0 == label) {
            Some(g) => g.1[slot] = gib,
            None => {
                let mut vals = vec![0.0, 0.0];
                vals[slot] = gib;
                groups.push((label, vals));
            }
        }
    }
    forms.dedup();
    let forms = if forms.is_empty() { String::new() } else { format!("; {}", forms.join(", ")) };
    grouped_bars(
        &format!("Real size (virtual device): evaluation peak, fp32{forms}"),
        "peak allocated (GiB)",
        "",
        &["saving activations (grad enabled)", "inference mode (no_grad)"],
        &groups,
    )
}

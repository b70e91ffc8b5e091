//! `no-grad-inference`: evaluation with and without recording what backward needs.

use super::common::{cnn, cnn_side, device, stripes, sync};
use super::{Experiment, Sweep};
use crate::models::Model;
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
    plot: None,
    host_capacity_limit: None,
    expected_secs: [2.0, 20.0],
};

/// One evaluation's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    batch_size: usize,
    weights_bytes: u64,
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
        for (k, (_, label)) in modes.iter().enumerate() {
            let (dev, model, _, _) = &states[i];
            let measured = Measured { batch_size: b, weights_bytes: model.param_bytes() };
            sweep.push(
                &format!("batch {b}, {label}"),
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
    sweep.claim(Claim {
        claim: "evaluating without saving activations (no_grad) saves memory".into(),
        measured: ratios
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
            .join("; "),
        verdict: if all_less { Verdict::Holds } else { Verdict::DoesNotHold },
    });
    Ok(sweep)
}

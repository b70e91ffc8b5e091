//! `max-batch-search`: find the largest batch that fits a fixed device, in one process: the
//! source's linear search (start at 2, add 2 until an OOM is caught) against an exponential
//! then binary search. Every trial is a real training step; every OOM is caught, the cache
//! emptied, and the search goes on. The size found then trains.

use super::common::{cnn, cnn_side, sized_device, stripes, sync, train_fresh};
use super::{Experiment, Sweep};
use crate::models::Model;
use crate::techniques::Technique;
use crate::trainer::adamw;
use crate::{Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use std::time::Instant;
use vram_accum::{ForwardCtx, Mode};
use vram_amp::{AdamW, Optimizer};
use vram_kernels::{DType, Device};

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "max-batch-search",
        name: "largest batch that fits",
        claim: "the search (start at 2, add 2 until OOM) works without restarting the process",
        source: "001_eb115694b312c654.txt",
    },
    run,
    plot: None,
    host_capacity_limit: None,
    expected_secs: [2.5, 40.0],
};

/// One search strategy's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    batch_found: usize,
    trials: usize,
    ooms_caught: usize,
    seconds: f64,
    found_size_trains: bool,
}

struct Search {
    found: usize,
    trials: usize,
    ooms: usize,
    seconds: f64,
    trains: bool,
    peak_reserved: u64,
    peak_allocated: u64,
}

/// One trial: a training step at `batch`; `Ok(false)` on a caught OOM.
fn trial(
    model: &mut Model,
    opt: &mut AdamW,
    dev: &Device,
    data: &crate::data::Dataset,
    seed: u64,
    batch: usize,
) -> Result<bool, ExperimentError> {
    let b = data.batch(seed, batch as u64, batch);
    let mut fctx = ForwardCtx::new(Mode::Train, seed);
    let fits = match model.train_step(&b, &mut fctx, 1.0) {
        Ok(_) => match opt.step(model) {
            Ok(()) => true,
            Err(e) if e.is_out_of_memory() => false,
            Err(e) => return Err(e.into()),
        },
        Err(e) if e.is_out_of_memory() => false,
        Err(e) => return Err(e.into()),
    };
    model.zero_grad();
    if !fits {
        dev.empty_cache();
    }
    Ok(fits)
}

fn search(ctx: &Context, capacity: u64, exponential: bool) -> Result<Search, ExperimentError> {
    let (arch, data) = (cnn(ctx, false), stripes(cnn_side(ctx)));
    let dev = sized_device(ctx, capacity)?;
    let mut model = Model::new(&dev, arch, ctx.seed, DType::F32)?;
    let mut opt = adamw(1e-3);
    let (mut trials, mut ooms) = (0, 0);
    let started = Instant::now();
    let mut attempt =
        |b: usize, trials: &mut usize, ooms: &mut usize| -> Result<bool, ExperimentError> {
            *trials += 1;
            let ok = trial(&mut model, &mut opt, &dev, &data, ctx.seed, b)?;
            *ooms += usize::from(!ok);
            Ok(ok)
        };
    let found = if exponential {
        let (mut good, mut bad) = (0, 1);
        while attempt(bad, &mut trials, &mut ooms)? {
            good = bad;
            bad *= 2;
        }
        while bad - good > 1 {
            let mid = (good + bad) / 2;
            if attempt(mid, &mut trials, &mut ooms)? { good = mid } else { bad = mid }
        }
        good
    } else {
        let mut b = 2;
        while attempt(b, &mut trials, &mut ooms)? {
            b += 2;
        }
        b - 2
    };
    sync(&dev)?;
    let seconds = started.elapsed().as_secs_f64();
    let trains = found > 0
        && (0..2)
            .all(|_| trial(&mut model, &mut opt, &dev, &data, ctx.seed, found).unwrap_or(false));
    Ok(Search {
        found,
        trials,
        ooms,
        seconds,
        trains,
        peak_reserved: dev.max_memory_reserved(),
        peak_allocated: dev.max_memory_allocated(),
    })
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    // Size the device for a target batch from two measured peaks (fixed + per sample).
    let target = if ctx.quick { 24 } else { 60 };
    let (arch, data) = (cnn(ctx, false), stripes(cnn_side(ctx)));
    let p4 = train_fresh(ctx, arch.clone(), &data, 4, "")?.peak_reserved as f64;
    let p8 = train_fresh(ctx, arch, &data, 8, "")?.peak_reserved as f64;
    let per_sample = (p8 - p4) / 4.0;
    let capacity = ((p4 + per_sample * (target - 4) as f64) as u64).next_multiple_of(2 << 20);
    let mut sweep = Sweep::new(
        ctx,
        json!({ "device_capacity": capacity, "model": "ResNet-like CNN", "target_batch_for_sizing": target }),
    );
    let mut results = Vec::new();
    for (name, exponential) in
        [("linear: 2, 4, 6, ... until OOM", false), ("exponential then binary", true)]
    {
        let s = search(ctx, capacity, exponential)?;
        let measured = Measured {
            batch_found: s.found,
            trials: s.trials,
            ooms_caught: s.ooms,
            seconds: s.seconds,
            found_size_trains: s.trains,
        };
        sweep.push(name, s.peak_allocated, s.peak_reserved, None, measured);
        results.push(s);
    }
    let (lin, exp) = (&results[0], &results[1]);
    sweep.claim(Claim {
        claim: "the search (start at 2, add 2 until an OOM is caught, empty_cache) works without restarting the process".into(),
        measured: format!(
            "device {}: linear found {} in {} trials ({:.1} s, {} OOM caught); exponential + binary found {} in {} trials ({:.1} s, {} OOMs caught); found sizes train: {} / {}",
            human_bytes(capacity), lin.found, lin.trials, lin.seconds, lin.ooms, exp.found, exp.trials, exp.seconds, exp.ooms, lin.trains, exp.trains
        ),
        verdict: if lin.trains && exp.trains { Verdict::Holds } else if lin.trains || exp.trains { Verdict::Partly } else { Verdict::DoesNotHold },
    });
    sweep.reading(format!(
        "a caught OOM costs nothing but the trial: the linear search needed {} trials to find batch {}, exponential then binary {} trials to find {}; both sizes then trained in the same process",
        lin.trials, lin.found, exp.trials, exp.found
    ));
    Ok(sweep)
}

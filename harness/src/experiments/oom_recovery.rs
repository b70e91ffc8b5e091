//! `oom-recovery`: catch an out-of-memory error, empty the cache, and retry the step as two
//! half-batches (gradient accumulation), on a device sized so that the full batch does not
//! fit but half of it does.

use super::common::{cnn, cnn_side, fingerprint, sized_device, stripes, train_fresh};
use super::{Experiment, Sweep};
use crate::models::Model;
use crate::techniques::Technique;
use crate::trainer::adamw;
use crate::{Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use vram_accum::{ForwardCtx, Mode};
use vram_amp::Optimizer;
use vram_kernels::DType;

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "oom-recovery",
        name: "OOM recovery",
        claim: "catch OOM, empty the cache, retry with half the batch: recovery success +50%",
        source: "004_4a0e2eb70881fd56.txt (recovery success +50%)",
    },
    run,
    plot: None,
    host_capacity_limit: None,
    expected_secs: [1.5, 21.0],
};

/// One policy's outcome.
#[derive(Serialize)]
pub(super) struct Measured {
    ooms: usize,
    recovered: usize,
    steps_completed: usize,
    params_intact_after_oom: bool,
    eval_loss_before: f32,
    eval_loss_after: f32,
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let steps = if ctx.quick { 4 } else { 10 };
    let (side, batch) = (cnn_side(ctx), if ctx.quick { 16 } else { 32 });
    let data = stripes(side);
    let arch = cnn(ctx, false);
    let half = train_fresh(ctx, arch.clone(), &data, batch / 2, "")?.peak_reserved;
    let full = train_fresh(ctx, arch.clone(), &data, batch, "")?.peak_reserved;
    let capacity = ((half + full) / 2).next_multiple_of(2 << 20).min(full - 1);
    let mut sweep = Sweep::new(
        ctx,
        json!({ "model": format!("{arch:?}"), "batch_size": batch, "device_capacity": capacity, "steps": steps }),
    );

    let mut outcomes = Vec::new();
    for recover in [false, true] {
        let dev = sized_device(ctx, capacity)?;
        let mut model = Model::new(&dev, arch.clone(), ctx.seed, DType::F32)?;
        let mut opt = adamw(1e-3);
        let eval = data.batch(ctx.seed, 1 << 30, batch / 2);
        let loss_before = model.eval_loss(&eval, Mode::Inference)?;
        let (mut ooms, mut recovered, mut intact, mut completed) = (0, 0, true, 0);
        for step in 0..steps {
            let b = data.batch(ctx.seed, step as u64, batch);
            let before = fingerprint(&model);
            let mut fctx = ForwardCtx::new(Mode::Train, step as u64);
            match model.train_step(&b, &mut fctx, 1.0) {
                Ok(_) => {}
                Err(e) if e.is_out_of_memory() => {
                    ooms += 1;
                    model.zero_grad();
                    intact &= fingerprint(&model) == before;
                    if !recover {
                        break;
                    }
                    dev.empty_cache();
                    let mut ok = true;
                    for part in b.split(2) {
                        let mut fctx = ForwardCtx::new(Mode::Train, step as u64);
                        ok &= model.train_step(&part, &mut fctx, 0.5).is_ok();
                    }
                    if !ok {
                        break;
                    }
                    recovered += 1;
                }
                Err(e) => return Err(e.into()),
            }
            opt.step(&mut model)?;
            model.zero_grad();
            completed += 1;
        }
        let loss_after = model.eval_loss(&eval, Mode::Inference)?;
        let name =
            if recover { "catch OOM, empty_cache, retry as 2 half-batches" } else { "no recovery" };
        let measured = Measured {
            ooms,
            recovered,
            steps_completed: completed,
            params_intact_after_oom: intact,
            eval_loss_before: loss_before,
            eval_loss_after: loss_after,
        };
        let (peak, reserved) = (dev.max_memory_allocated(), dev.max_memory_reserved());
        sweep.push(name, peak, reserved, None, measured);
        outcomes.push((ooms, recovered, completed, intact, loss_before, loss_after));
    }
    let (none, rec) = (outcomes[0], outcomes[1]);
    let holds = rec.0 > 0 && rec.1 == rec.0 && rec.3 && rec.2 == steps;
    sweep.claim(Claim {
        claim: "catching OOM, emptying the cache and retrying with half the batch recovers (\"recovery success +50%\")".into(),
        measured: format!(
            "device {} (batch {batch} needs {}, batch {} needs {}): without recovery the run stops after {}/{steps} steps; with it {}/{} OOMs recovered, {}/{steps} steps done, weights bit-identical after every OOM: {}, eval loss {:.3} -> {:.3}",
            human_bytes(capacity), human_bytes(full), batch / 2, human_bytes(half), none.2, rec.1, rec.0, rec.2, rec.3, rec.4, rec.5
        ),
        verdict: if holds { Verdict::Holds } else if rec.1 > 0 { Verdict::Partly } else { Verdict::DoesNotHold },
    });
    Ok(sweep)
}

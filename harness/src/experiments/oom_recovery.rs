//! `oom-recovery`: catch an out-of-memory error, empty the cache, and retry the step as two
//! half-batches (gradient accumulation), on a device sized so that the full batch does not
//! fit but half of it does.

use super::Sweep;
use super::common::{cnn, cnn_side, fingerprint, sized_device, stripes, train_fresh};
use crate::models::Model;
use crate::optim::Optimizer;
use crate::{Claim, Context, ExperimentResult, Verdict, human_bytes};
use serde_json::json;
use vram_accum::{ForwardCtx, Mode};
use vram_kernels::DType;

pub fn run(ctx: &Context) -> Result<ExperimentResult, String> {
    let steps = if ctx.quick { 4 } else { 10 };
    let (side, batch) = (cnn_side(ctx), if ctx.quick { 16 } else { 32 });
    let data = stripes(side);
    let arch = cnn(ctx, false);
    let half = train_fresh(ctx, arch.clone(), &data, batch / 2, "")?.peak_reserved;
    let full = train_fresh(ctx, arch.clone(), &data, batch, "")?.peak_reserved;
    let capacity = ((half + full) / 2).next_multiple_of(2 << 20).min(full - 1);
    let mut sweep = Sweep::new(
        ctx,
        "oom-recovery",
        json!({ "model": format!("{arch:?}"), "batch_size": batch, "device_capacity": capacity, "steps": steps }),
    );

    let mut outcomes = Vec::new();
    for recover in [false, true] {
        let dev = sized_device(ctx, capacity)?;
        let mut model =
            Model::new(&dev, arch.clone(), ctx.seed, DType::F32).map_err(|e| e.to_string())?;
        let mut opt = Optimizer::adamw(1e-3);
        let eval = data.batch(ctx.seed, 1 << 30, batch / 2);
        let loss_before = model.eval_loss(&eval, Mode::Inference).map_err(|e| e.to_string())?;
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
                Err(e) => return Err(e.to_string()),
            }
            opt.step(model.params_mut()).map_err(|e| e.to_string())?;
            model.zero_grad();
            completed += 1;
        }
        let loss_after = model.eval_loss(&eval, Mode::Inference).map_err(|e| e.to_string())?;
        let name =
            if recover { "catch OOM, empty_cache, retry as 2 half-batches" } else { "no recovery" };
        let mut v =
            sweep.variant(name, dev.max_memory_allocated(), dev.max_memory_reserved(), None);
        for (k, val) in [
            ("ooms", json!(ooms)),
            ("recovered", json!(recovered)),
            ("steps_completed", json!(completed)),
            ("params_intact_after_oom", json!(intact)),
            ("eval_loss_before", json!(loss_before)),
            ("eval_loss_after", json!(loss_after)),
        ] {
            v.extra.insert(k.into(), val);
        }
        sweep.push(v);
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
    Ok(sweep.finish())
}

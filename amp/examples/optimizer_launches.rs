//! Ops and CUDA kernel launches of one optimizer step over GPT-2 small's 148 parameter
//! tensors, per-tensor against multi-tensor, counted by the op profile on a virtual device
//! (which allocates what a GPU does and computes nothing, so the real sizes cost nothing).
//! Run with `cargo run -p vram-amp --example optimizer_launches`.

use vram_amp::{AdamW, AdamWConfig, Optimizer, Param, Result, Sgd, SgdConfig};
use vram_kernels::{DType, Device, Tensor};

/// GPT-2 small (124M): token and position embeddings, 12 blocks of 12 tensors, the final
/// layer norm.
fn gpt2_small_shapes() -> Vec<Vec<usize>> {
    let (d, vocab, ctx, layers) = (768, 50257, 1024, 12);
    let mut shapes = vec![vec![vocab, d], vec![ctx, d]];
    for _ in 0..layers {
        shapes.extend([
            vec![d],
            vec![d],
            vec![d, 3 * d],
            vec![3 * d],
            vec![d, d],
            vec![d],
            vec![d],
            vec![d],
            vec![d, 4 * d],
            vec![4 * d],
            vec![4 * d, d],
            vec![d],
        ]);
    }
    shapes.extend([vec![d], vec![d]]);
    shapes
}

/// Kernel launches of one call of `op` on a GPU (the table copy of a multi-tensor step is a
/// host-to-device copy, not a launch, counted apart).
fn launches(op: &str) -> u64 {
    match op {
        "adamw_step" | "sgd_step" | "copy_from" | "adamw_step_multi" | "sgd_step_multi" => 1,
        other => panic!("unexpected op {other} in a steady optimizer step"),
    }
}

/// The ops of the second step (the first also creates the state) of `opt` over GPT-2
/// small's parameters in `dtype`: (op, calls) and the total launches.
fn profile(opt: &mut dyn Optimizer, dtype: DType) -> Result<(Vec<(&'static str, u64)>, u64)> {
    let dev = Device::virtual_device(64 << 30);
    let mut params: Vec<Param> = gpt2_small_shapes()
        .iter()
        .map(|s| -> Result<Param> {
            let mut p = Param::new("p", Tensor::zeros(&dev, s, dtype)?);
            p.grad = Some(Tensor::zeros(&dev, s, dtype)?);
            Ok(p)
        })
        .collect::<Result<_>>()?;
    opt.step(&mut params)?;
    dev.start_op_profile();
    opt.step(&mut params)?;
    let ops = dev.stop_op_profile();
    let total = ops.iter().map(|o| o.calls * launches(o.name)).sum();
    Ok((ops.iter().map(|o| (o.name, o.calls)).collect(), total))
}

fn main() -> Result<()> {
    let adamw = AdamWConfig::default();
    let sgd = SgdConfig { momentum: 0.9, ..SgdConfig::default() };
    println!("GPT-2 small, {} parameter tensors, one steady step:", gpt2_small_shapes().len());
    println!("| optimizer | parameters | path | ops (calls) | kernel launches |");
    println!("|---|---|---|---|---|");
    for dtype in [DType::F32, DType::BF16] {
        let what = if dtype == DType::F32 { "f32" } else { "bf16 + f32 masters" };
        for multi in [false, true] {
            let path = if multi { "multi-tensor" } else { "per-tensor" };
            let runs: [(&str, Box<dyn Optimizer>); 2] = [
                ("AdamW", Box::new(AdamW::new(adamw).with_multi_tensor(multi))),
                ("SGD momentum", Box::new(Sgd::new(sgd).with_multi_tensor(multi))),
            ];
            for (name, mut opt) in runs {
                let (ops, total) = profile(opt.as_mut(), dtype)?;
                let ops: Vec<String> = ops.iter().map(|(n, c)| format!("{n} x{c}")).collect();
                let copies = if multi { " + 1 table copy" } else { "" };
                println!("| {name} | {what} | {path} | {} | {total}{copies} |", ops.join(", "));
            }
        }
    }
    Ok(())
}

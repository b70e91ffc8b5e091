//! Every composite layer's backward against central finite differences of its forward, in
//! f32 on the host: the input gradient and each parameter's gradient at a sample of
//! coordinates, for a loss `L = sum(y * r)` with fixed random `r` (so `dL/dy = r`).

use vram_accum::layers::{
    Act, Attention, BottleneckConfig, ClassifierHeadConfig, Conv2dConfig, InvertedResidualConfig,
    LinearConfig, LlamaBlockConfig, PatchEmbedConfig, ResidualBlockConfig, ResidualMlpConfig,
    TokenMeanPool, TransformerBlockConfig,
};
use vram_accum::{BoxedLayer, ForwardCtx, Mode};
use vram_kernels::cpu::random::uniform_at;
use vram_kernels::{DType, Device, Tensor, ops};

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    (0..n as u64).map(|i| scale * (2.0 * uniform_at(seed, i) - 1.0)).collect()
}

/// `sum(layer(x) * r)` by a training forward (batch norm normalizes with the batch's
/// statistics, as in the forward being differentiated) that leaves the running statistics
/// alone.
fn loss(layer: &mut BoxedLayer, x: &Tensor, r: &Tensor) -> f64 {
    let mut ctx = ForwardCtx { update_running_stats: false, ..ForwardCtx::new(Mode::Train, 0) };
    let (y, _) = layer.forward(x, &mut ctx).unwrap();
    let (y, r) = (y.to_f32_vec().unwrap(), r.to_f32_vec().unwrap());
    y.iter().zip(&r).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// Up to `k` coordinates spread over `0..n`.
fn sample(n: usize, k: usize, seed: u64) -> Vec<usize> {
    let mut out: Vec<usize> =
        (0..k as u64).map(|i| (uniform_at(seed, i) * n as f32) as usize % n).collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Finite-difference steps, largest first. A ReLU kink inside `±eps` of a coordinate makes
/// that step's difference wrong; a smaller step avoids it (down to f32 noise), while a
/// wrong backward matches at no step.
const EPS: [f32; 3] = [3e-3, 1e-3, 3e-4];

/// Checks `analytic` against the central difference `diff(eps)` at some step of [`EPS`].
fn close(what: &str, analytic: f64, mut diff: impl FnMut(f32) -> f64) {
    let mut seen = Vec::new();
    for eps in EPS {
        let numeric = diff(eps);
        let tol = 2e-2 * numeric.abs().max(analytic.abs()).max(0.05);
        if (analytic - numeric).abs() <= tol {
            return;
        }
        seen.push(format!("{numeric:.5} at eps {eps}"));
    }
    panic!("{what}: backward {analytic:.5} vs finite differences {}", seen.join(", "));
}

/// Checks `layer`'s gradients at an input of `shape`.
fn check(name: &str, mut layer: BoxedLayer, dev: &Device, shape: &[usize]) {
    let n: usize = shape.iter().product();
    let x = Tensor::from_f32_slice(dev, shape, &values(n, 1, 1.0), DType::F32).unwrap();
    let (y, saved) = layer.forward(&x, &mut ForwardCtx::new(Mode::Train, 0)).unwrap();
    let r = Tensor::from_f32_slice(dev, y.shape(), &values(y.numel(), 2, 1.0), DType::F32).unwrap();
    let dx = layer.backward(saved.expect("training saves"), r.clone(), true).unwrap().expect("dx");
    assert_eq!(dx.shape(), x.shape(), "{name}: dx shape");
    let dx = dx.to_f32_vec().unwrap();
    let xs = x.to_f32_vec().unwrap();
    for i in sample(n, 12, 3) {
        let mut at = |delta: f32| {
            let mut v = xs.clone();
            v[i] += delta;
            loss(&mut layer, &Tensor::from_f32_slice(dev, shape, &v, DType::F32).unwrap(), &r)
        };
        let diff = |eps: f32| (at(eps) - at(-eps)) / (2.0 * eps as f64);
        close(&format!("{name}: dL/dx[{i}]"), dx[i] as f64, diff);
    }
    let count = layer.params().len();
    assert!(count > 0 || name.to_lowercase().contains("pool"), "{name} has parameters");
    for p in 0..count {
        let (pname, grad, value) = {
            let param = &layer.params()[p];
            let grad =
                param.grad.as_ref().unwrap_or_else(|| panic!("{name}: {} has no grad", param.name));
            (param.name.clone(), grad.to_f32_vec().unwrap(), param.value.to_f32_vec().unwrap())
        };
        for i in sample(value.len(), 4, 10 + p as u64) {
            let mut at = |delta: f32| {
                let mut v = value.clone();
                v[i] += delta;
                let shape = layer.params()[p].value.shape().to_vec();
                layer.params_mut()[p].value =
                    Tensor::from_f32_slice(dev, &shape, &v, DType::F32).unwrap();
                loss(&mut layer, &x, &r)
            };
            close(&format!("{name}: dL/d{pname}[{i}]"), grad[i] as f64, |eps| {
                (at(eps) - at(-eps)) / (2.0 * eps as f64)
            });
            at(0.0);
        }
    }
}

#[test]
fn multi_head_attention_blocks_match_finite_differences() {
    let dev = Device::host(64 << 20);
    for attention in [Attention::Fused, Attention::Explicit] {
        for causal in [true, false] {
            // 2 sequences of 5 tokens, width 8, 2 heads of 4; a larger init so that
            // attention is not uniform and the MLP is not linear.
            let block = TransformerBlockConfig::new(8, 2, 5)
                .with_causal(causal)
                .with_attention(attention)
                .with_init(0.3, 1)
                .with_seed(4)
                .init(&dev)
                .unwrap();
            check(
                &format!("TransformerBlock(causal={causal}, {attention:?})"),
                BoxedLayer::new(block),
                &dev,
                &[10, 8],
            );
        }
    }
}

#[test]
fn multi_head_attention_differs_from_single_head_attention() {
    // The heads really split the width: 1 head and 2 heads with the same weights give
    // different outputs (a regression guard against a permute that does nothing).
    let dev = Device::host(64 << 20);
    let x = Tensor::from_f32_slice(&dev, &[10, 8], &values(80, 1, 1.0), DType::F32).unwrap();
    let out = |heads| {
        let mut b = TransformerBlockConfig::new(8, heads, 5)
            .with_init(0.3, 1)
            .with_seed(4)
            .init(&dev)
            .unwrap();
        let (y, _) =
            vram_accum::Layer::forward(&mut b, &x, &mut ForwardCtx::new(Mode::Inference, 0))
                .unwrap();
        y.to_f32_vec().unwrap()
    };
    let (one, two) = (out(1), out(2));
    assert!(one.iter().zip(&two).any(|(a, b)| (a - b).abs() > 1e-4));
    assert!(TransformerBlockConfig::new(8, 3, 5).init(&dev).is_err(), "8 is not a multiple of 3");
    let mut b = TransformerBlockConfig::new(8, 2, 5).init(&dev).unwrap();
    let bad = Tensor::zeros(&dev, &[7, 8], DType::F32).unwrap();
    let e =
        vram_accum::Layer::forward(&mut b, &bad, &mut ForwardCtx::new(Mode::Train, 0)).unwrap_err();
    assert!(e.to_string().contains("[b * 5, d]"), "{e}");
}

#[test]
fn convolutional_blocks_match_finite_differences() {
    let dev = Device::host(64 << 20);
    let b = BottleneckConfig::new(4, 2, 8).with_stride(2).with_seed(1).init(&dev).unwrap();
    check("Bottleneck(projection)", BoxedLayer::new(b), &dev, &[2, 4, 6, 6]);
    let b = BottleneckConfig::new(8, 2, 8).with_seed(2).init(&dev).unwrap();
    check("Bottleneck(identity)", BoxedLayer::new(b), &dev, &[2, 8, 4, 4]);
    let b = InvertedResidualConfig::new(4, 12, 4).with_kernel(5).with_seed(3).init(&dev).unwrap();
    check("InvertedResidual(residual)", BoxedLayer::new(b), &dev, &[2, 4, 6, 6]);
    let b = InvertedResidualConfig::new(4, 4, 6).with_stride(2).with_seed(4).init(&dev).unwrap();
    check("InvertedResidual(no expansion)", BoxedLayer::new(b), &dev, &[2, 4, 6, 6]);
    let b = ResidualBlockConfig::new(3).with_seed(5).init(&dev).unwrap();
    check("ResidualBlock", BoxedLayer::new(b), &dev, &[2, 3, 5, 5]);
    let h = ClassifierHeadConfig::new(4, 3).with_hidden(6).with_seed(6).init(&dev).unwrap();
    check("ClassifierHead", BoxedLayer::new(h), &dev, &[2, 4, 3, 3]);
    let l = LinearConfig::new(5, 4).with_activation(Act::Gelu).with_seed(7).init(&dev).unwrap();
    check("Linear(gelu)", BoxedLayer::new(l), &dev, &[3, 5]);
    let l = LinearConfig::new(5, 4).with_seed(8).init(&dev).unwrap();
    check("Linear(identity)", BoxedLayer::new(l), &dev, &[3, 5]);
    // fc2's backward through the GELU (linear_backward_gelu) gives fc1's bias gradient.
    let m = ResidualMlpConfig::new(6, 12).with_seed(9).init(&dev).unwrap();
    check("ResidualMlp", BoxedLayer::new(m), &dev, &[2, 3, 6]);
}

/// The same blocks with a batch norm after every convolution: the norm's gradients (and
/// `bn.weight`/`bn.bias`) against finite differences of the training forward.
#[test]
fn batch_normed_blocks_match_finite_differences() {
    let dev = Device::host(64 << 20);
    let c = Conv2dConfig::new(3, 4, 3)
        .with_batch_norm(true)
        .with_activation(Act::Relu)
        .with_seed(1)
        .init(&dev)
        .unwrap();
    check("Conv2d+BN+ReLU", BoxedLayer::new(c), &dev, &[3, 3, 5, 5]);
    let b = BottleneckConfig::new(4, 2, 8)
        .with_stride(2)
        .with_batch_norm(true)
        .with_seed(1)
        .init(&dev)
        .unwrap();
    check("Bottleneck+BN(projection)", BoxedLayer::new(b), &dev, &[2, 4, 6, 6]);
    let b = InvertedResidualConfig::new(4, 12, 4).with_batch_norm(true).with_seed(3).init(&dev);
    check("InvertedResidual+BN", BoxedLayer::new(b.unwrap()), &dev, &[2, 4, 6, 6]);
    let b = ResidualBlockConfig::new(3).with_batch_norm(true).with_seed(5).init(&dev).unwrap();
    check("ResidualBlock+BN", BoxedLayer::new(b), &dev, &[2, 3, 5, 5]);
    // MobileNetV3's later blocks: hard swish and squeeze-excitation (hard-sigmoid gate).
    let b = InvertedResidualConfig::new(4, 12, 4)
        .with_batch_norm(true)
        .with_activation(Act::Hardswish)
        .with_squeeze_excitation(Some(8))
        .with_seed(6)
        .init(&dev)
        .unwrap();
    check("InvertedResidual+BN+HS+SE", BoxedLayer::new(b), &dev, &[2, 4, 5, 5]);
    let h = ClassifierHeadConfig::new(4, 3)
        .with_hidden(6)
        .with_hidden_activation(Act::Hardswish)
        .with_seed(7)
        .init(&dev)
        .unwrap();
    check("ClassifierHead(hardswish)", BoxedLayer::new(h), &dev, &[2, 4, 3, 3]);
}

#[test]
fn vit_patch_embedding_and_token_pool_match_finite_differences() {
    let dev = Device::host(64 << 20);
    let p = PatchEmbedConfig::new(3, 6, 4, 8).with_seed(1).init(&dev).unwrap();
    check("PatchEmbed", BoxedLayer::new(p), &dev, &[2, 3, 8, 8]);
    check("TokenMeanPool", BoxedLayer::new(TokenMeanPool::new(&dev, 4).unwrap()), &dev, &[8, 5]);
    let p = PatchEmbedConfig::new(3, 6, 4, 8).init(&dev);
    assert!(
        PatchEmbedConfig::new(3, 6, 5, 8).init(&dev).is_err(),
        "8 px is not whole 5 px patches"
    );
    let wrong = Tensor::zeros(&dev, &[1, 3, 12, 12], DType::F32).unwrap();
    let e =
        vram_accum::Layer::forward(&mut p.unwrap(), &wrong, &mut ForwardCtx::new(Mode::Train, 0));
    assert!(e.unwrap_err().to_string().contains("9 patches"));
    let _ = ops::relu; // the ops crate is the layers' only dependency
}

/// A training forward and backward of a block with `attention`: the output, the input's
/// gradient and every parameter's gradient, and the bytes its saved state holds.
fn block_run(attention: Attention, causal: bool, seq: usize) -> (Vec<Vec<f32>>, u64) {
    let dev = Device::host(1 << 30);
    let mut block = TransformerBlockConfig::new(16, 2, seq)
        .with_causal(causal)
        .with_dropout(0.2)
        .with_attention(attention)
        .with_init(0.3, 1)
        .with_seed(5)
        .init(&dev)
        .unwrap();
    let x = Tensor::from_f32_slice(&dev, &[2 * seq, 16], &values(32 * seq, 1, 1.0), DType::F32)
        .unwrap();
    let r = Tensor::from_f32_slice(&dev, &[2 * seq, 16], &values(32 * seq, 2, 1.0), DType::F32)
        .unwrap();
    let before = dev.memory_allocated();
    let mut ctx = ForwardCtx::new(Mode::Train, 9);
    let (y, saved) = vram_accum::Layer::forward(&mut block, &x, &mut ctx).unwrap();
    let saved_bytes = dev.memory_allocated() - before - y.size_in_bytes() as u64;
    let dx = vram_accum::Layer::backward(&mut block, saved.unwrap(), r, true).unwrap().unwrap();
    let mut out = vec![y.to_f32_vec().unwrap(), dx.to_f32_vec().unwrap()];
    for p in vram_accum::Layer::params(&block) {
        out.push(p.grad.as_ref().unwrap().to_f32_vec().unwrap());
    }
    (out, saved_bytes)
}

// Fused attention is a drop-in for the explicit form: with dropout on the probabilities and
// both residual branches (the same seed gives the same masks, and the fused op takes the
// same offsets, so the branches' masks agree too), the block's output, input gradient and
// every parameter gradient agree to f32 rounding, causal or not, and the fused block saves
// less (no [b * heads, seq, seq] probabilities).
#[test]
fn fused_attention_blocks_equal_explicit_ones_and_save_less() {
    for causal in [true, false] {
        let (fused, fused_bytes) = block_run(Attention::Fused, causal, 19);
        let (explicit, explicit_bytes) = block_run(Attention::Explicit, causal, 19);
        for (i, (f, e)) in fused.iter().zip(&explicit).enumerate() {
            // A floor of 0.1: the key bias's gradient is 0 up to rounding (softmax ignores
            // a constant added to a row's scores), so both sides are noise there.
            let scale = e.iter().fold(0.1f32, |m, v| m.max(v.abs()));
            for (a, b) in f.iter().zip(e) {
                assert!((a - b).abs() <= 1e-4 * scale, "tensor {i}: fused {a}, explicit {b}");
            }
        }
        // Probabilities and their dropped copy: 2 [4, 19, 19] f32 tensors, in 512-byte blocks;
        // fused keeps the [4, 19, 8] output and the [4, 19] logsumexp instead.
        assert!(explicit_bytes >= fused_bytes + 2 * 4 * 19 * 19 * 4 - 2 * 4 * 19 * 9 * 4);
        assert!(fused_bytes < explicit_bytes, "{fused_bytes} vs {explicit_bytes}");
    }
}

/// A training forward and backward of a block, residual adds fused or not, with parameters
/// in `dtype` and autocast to `autocast`: the bits of the output, the input's gradient and
/// every parameter's gradient; the allocator's actions and the peak of the bytes requested.
fn residual_run(
    fused: bool,
    dtype: DType,
    autocast: Option<DType>,
    p: f32,
    attention: Attention,
) -> (Vec<Vec<u32>>, usize, i64) {
    let dev = Device::host(1 << 30);
    let (seq, d) = (7, 16);
    let mut block = TransformerBlockConfig::new(d, 2, seq)
        .with_dropout(p)
        .with_attention(attention)
        .with_fused_residual(fused)
        .with_dtype(dtype)
        .with_init(0.3, 1)
        .with_seed(5)
        .init(&dev)
        .unwrap();
    let t =
        |seed| Tensor::from_f32_slice(&dev, &[3 * seq, d], &values(3 * seq * d, seed, 1.0), dtype);
    let (x, r) = (t(1).unwrap(), t(2).unwrap());
    let mut ctx = ForwardCtx::new(Mode::Train, 9);
    if let Some(low) = autocast {
        ctx = ctx.with_autocast(low).unwrap();
    }
    dev.record_history(Some(1 << 20));
    let (y, saved) = vram_accum::Layer::forward(&mut block, &x, &mut ctx).unwrap();
    let r = r.to_dtype(y.dtype()).unwrap();
    let dx = vram_accum::Layer::backward(&mut block, saved.unwrap(), r, true).unwrap().unwrap();
    let bits = |t: &Tensor| t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect();
    let mut out = vec![bits(&y), bits(&dx)];
    for p in vram_accum::Layer::params(&block) {
        out.push(bits(p.grad.as_ref().unwrap()));
    }
    let actions = dev.trace_len();
    (out, actions, dev.memory_stats().requested_bytes.all.peak)
}

// The fused residual ops (dropout + add + ln_2, dropout + add, and their backward: ln_2's
// and ln_1's with the shortcut's gradient and the branch's, fc1's GELU in fc2's product) are a
// drop-in for the unfused composition: the block's output, input gradient and every
// parameter gradient are equal bit for bit, in f32, in bf16, and under bf16 and f16
// autocast (an f32 residual stream with 16-bit branches; a bf16 stream), with dropout 0,
// 0.1 and 0.5 and
// either attention; the fused block makes fewer allocations (no dropped copy of a branch,
// no f32 copy of a 16-bit one, no separate GELU gradient, ln_2's and ln_1's input gradients
// and the shortcut's added in the norm's backward) and requests at its peak at most fc1's
// bias gradient more, made with fc2's gradients.
#[test]
fn fused_residual_blocks_equal_unfused_ones_bit_for_bit() {
    let cases = [
        (DType::F32, None),
        (DType::BF16, None),
        (DType::F32, Some(DType::BF16)),
        (DType::F32, Some(DType::F16)),
        // A bf16 stream under autocast: ln_2 runs on an f32 copy, so the first residual add
        // falls back to the unfused ops; the second runs fused in bf16.
        (DType::BF16, Some(DType::BF16)),
    ];
    for (dtype, autocast) in cases {
        for p in [0.0, 0.1, 0.5] {
            for attention in [Attention::Fused, Attention::Explicit] {
                let what = format!("{dtype:?} autocast {autocast:?} p {p} {attention:?}");
                let (fused, fused_actions, fused_peak) =
                    residual_run(true, dtype, autocast, p, attention);
                let (plain, plain_actions, plain_peak) =
                    residual_run(false, dtype, autocast, p, attention);
                assert_eq!(fused.len(), plain.len());
                for (i, (f, u)) in fused.iter().zip(&plain).enumerate() {
                    assert!(f == u, "{what}: tensor {i} differs");
                }
                // Always: the GELU's gradient and ln_2's own input gradient are never
                // stored apart; p > 0: the two dropped branch copies are never made, nor the
                // cast copies of the branches' gradients backward; an f32 stream under
                // autocast: nor the f32 copies of the 16-bit branches.
                assert!(fused_actions < plain_actions, "{what}: {fused_actions} actions");
                // The fused backward's one earlier request: fc2's input-gradient product
                // also gives fc1's bias gradient ([64] in the product's dtype) and its f32
                // partial sums ([1, 64]), which the unfused fc1 backward makes after fc2's
                // input gradient is freed.
                let product = autocast.unwrap_or(dtype).size_in_bytes();
                let fc1_bias = 64 * product + 64 * 4;
                let at_most = plain_peak + fc1_bias as i64;
                assert!(fused_peak <= at_most, "{what}: peak {fused_peak} > {plain_peak}");
            }
        }
    }
}

/// The ops a block's backward runs, by name, fused or not (f32 parameters, dropout 0.1,
/// autocast to `autocast`).
fn backward_ops(fused: bool, dtype: DType, autocast: Option<DType>) -> Vec<(&'static str, u64)> {
    let dev = Device::host(1 << 30);
    let (seq, d) = (7, 16);
    let mut block = TransformerBlockConfig::new(d, 2, seq)
        .with_dropout(0.1)
        .with_fused_residual(fused)
        .with_dtype(dtype)
        .init(&dev)
        .unwrap();
    let x = Tensor::from_f32_slice(&dev, &[3 * seq, d], &values(3 * seq * d, 1, 1.0), dtype);
    let mut ctx = ForwardCtx::new(Mode::Train, 9);
    if let Some(low) = autocast {
        ctx = ctx.with_autocast(low).unwrap();
    }
    let (y, saved) = vram_accum::Layer::forward(&mut block, &x.unwrap(), &mut ctx).unwrap();
    let dy = Tensor::full(&dev, y.shape(), y.dtype(), 0.5).unwrap();
    dev.start_op_profile();
    vram_accum::Layer::backward(&mut block, saved.unwrap(), dy, true).unwrap();
    dev.stop_op_profile().iter().map(|o| (o.name, o.calls)).collect()
}

// The fused block's backward runs the fused ops where the dtypes allow and the unfused block's
// never: ln_2's and ln_1's backward each with the shortcut's gradient added (no separate
// add), fc1's GELU in fc2's input-gradient product. A bf16 stream under autocast normalizes
// f32 copies, so its norms fall back to the unfused backward.
#[test]
fn the_fused_block_backward_runs_the_fused_ops() {
    let calls = |ops: &[(&str, u64)], name: &str| {
        ops.iter().find(|(n, _)| *n == name).map_or(0, |(_, c)| *c)
    };
    for (dtype, autocast, norms) in [
        (DType::F32, None, 2),
        (DType::F32, Some(DType::BF16), 2),
        (DType::BF16, Some(DType::BF16), 0),
    ] {
        let what = format!("{dtype:?} autocast {autocast:?}");
        let (fused, plain) =
            (backward_ops(true, dtype, autocast), backward_ops(false, dtype, autocast));
        assert_eq!(calls(&fused, "layer_norm_backward_residual"), norms, "{what}: {fused:?}");
        assert_eq!(calls(&fused, "layer_norm_backward"), 2 - norms, "{what}: {fused:?}");
        assert_eq!(calls(&fused, "linear_backward_gelu"), 1, "{what}: {fused:?}");
        assert_eq!(calls(&plain, "layer_norm_backward_residual"), 0, "{what}: {plain:?}");
        assert_eq!(calls(&plain, "layer_norm_backward"), 2, "{what}: {plain:?}");
        assert_eq!(calls(&plain, "linear_backward_gelu"), 0, "{what}: {plain:?}");
        // The k and v projections' gradients are added either way; the shortcut's only
        // unfused (or where a norm falls back).
        assert_eq!(calls(&fused, "add_assign"), 4 - norms, "{what}: {fused:?}");
        assert_eq!(calls(&plain, "add_assign"), 4, "{what}: {plain:?}");
    }
}

/// A training forward and backward of `block` on `x` under `autocast`: the bits of the
/// output, the input's gradient and every parameter's gradient, and the bytes the forward
/// left allocated besides its output (what it keeps for backward).
fn kept_and_grads<L: vram_accum::Layer>(
    dev: &Device,
    block: &mut L,
    x: &Tensor,
    autocast: Option<DType>,
) -> (Vec<Vec<u32>>, u64) {
    let mut ctx = ForwardCtx::new(Mode::Train, 9);
    if let Some(low) = autocast {
        ctx = ctx.with_autocast(low).unwrap();
    }
    let requested = || dev.memory_stats().requested_bytes.all.current;
    let before = requested();
    let (y, saved) = block.forward(x, &mut ctx).unwrap();
    let kept = (requested() - before) as u64 - y.size_in_bytes() as u64;
    let r = Tensor::from_f32_slice(dev, y.shape(), &values(y.numel(), 2, 1.0), y.dtype()).unwrap();
    let dx = block.backward(saved.unwrap(), r, true).unwrap().unwrap();
    let bits = |t: &Tensor| t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect();
    let mut out = vec![bits(&y), bits(&dx)];
    for p in block.params() {
        out.push(bits(p.grad.as_ref().unwrap()));
    }
    (out, kept)
}

// The MLP's activation recomputed in backward (the default) instead of kept: a GPT block's
// GELU output from fc1's pre-activation, a Llama block's SiLU output and gated product from
// the gate and up outputs. The output, the input gradient and every parameter gradient are
// the kept activation's bit for bit, in f32, bf16 and under bf16 autocast, with dropout and
// either residual form; the forward keeps exactly the activation less: `[rows, 4 d]` (GPT),
// `2 [rows, hidden]` (Llama), in the MLP's dtype.
/// The block `build` makes (recomputing its MLP's activation or not) on a fresh host device,
/// on `[rows, d]` inputs: recomputing gives the kept activation's bits and keeps `released`
/// bytes less.
fn recompute_matches<L: vram_accum::Layer>(
    what: &str,
    released: u64,
    [rows, d]: [usize; 2],
    (dtype, autocast): (DType, Option<DType>),
    build: impl Fn(&Device, bool) -> L,
) {
    let run = |recompute: bool| {
        let dev = Device::host(1 << 30);
        let mut block = build(&dev, recompute);
        let x = Tensor::from_f32_slice(&dev, &[rows, d], &values(rows * d, 1, 1.0), dtype);
        kept_and_grads(&dev, &mut block, &x.unwrap(), autocast)
    };
    let ((recomputed, lean), (kept, full)) = (run(true), run(false));
    assert!(recomputed == kept, "{what}: the gradients differ");
    assert_eq!(full - lean, released, "{what}");
}

#[test]
fn recomputed_mlp_activations_give_the_kept_ones_gradients_bit_for_bit() {
    let (seq, d, hidden) = (7, 16, 24);
    let rows = 3 * seq;
    for (dtype, autocast) in
        [(DType::F32, None), (DType::BF16, None), (DType::F32, Some(DType::BF16))]
    {
        let mlp = autocast.unwrap_or(dtype).size_in_bytes() as u64;
        for fused in [true, false] {
            let what = format!("GPT {dtype:?} autocast {autocast:?} fused residual {fused}");
            let released = (rows * 4 * d) as u64 * mlp;
            recompute_matches(&what, released, [rows, d], (dtype, autocast), |dev, recompute| {
                TransformerBlockConfig::new(d, 2, seq)
                    .with_dropout(0.1)
                    .with_fused_residual(fused)
                    .with_recompute_activation(recompute)
                    .with_dtype(dtype)
                    .with_init(0.3, 1)
                    .with_seed(5)
                    .init(dev)
                    .unwrap()
            });
        }
        let what = format!("Llama {dtype:?} autocast {autocast:?}");
        let released = 2 * (rows * hidden) as u64 * mlp;
        recompute_matches(&what, released, [rows, d], (dtype, autocast), |dev, recompute| {
            LlamaBlockConfig::new(d, 4, 2, hidden, seq)
                .with_recompute_activation(recompute)
                .with_dtype(dtype)
                .with_init(0.3)
                .with_seed(5)
                .init(dev)
                .unwrap()
        });
    }
}

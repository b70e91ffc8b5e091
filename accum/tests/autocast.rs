//! Autocast in the layers (PyTorch's `torch.autocast` recipe): each supported layer's
//! forward and gradients against the same layer in f32, the dtypes PyTorch's policy gives
//! its outputs and saved tensors, the cache of weight casts, checkpointed against plain
//! backward, and the refusal of layers without autocast rules.

use vram_accum::layers::{
    Act, Activation, Attention, BottleneckConfig, ClassifierHeadConfig, Conv2dConfig, Dropout,
    InvertedResidualConfig, LayerNormConfig, LinearConfig, ResidualBlockConfig, ResidualMlpConfig,
    TransformerBlockConfig,
};
use vram_accum::{BoxedLayer, Chain, Error, ForwardCtx, Layer, Mode, Param, Schedule};
use vram_kernels::cpu::random::uniform_at;
use vram_kernels::{DType, Device, Tensor};

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    (0..n as u64).map(|i| scale * (2.0 * uniform_at(seed, i) - 1.0)).collect()
}

fn tensor(dev: &Device, shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f32_slice(dev, shape, &values(n, seed, 1.0), dtype).unwrap()
}

fn norm(t: &Tensor) -> f64 {
    t.to_f32_vec().unwrap().iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt()
}

/// `|a - b| / max(|b|, floor)` over all elements (Euclidean norms). The floor is for a
/// reference that is zero up to rounding (the key bias's gradient: softmax ignores a shift
/// shared by all keys).
fn rel_err(a: &Tensor, b: &Tensor, floor: f64) -> f64 {
    assert_eq!(a.shape(), b.shape());
    let (a, b) = (a.to_f32_vec().unwrap(), b.to_f32_vec().unwrap());
    let num: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    num.sqrt() / den.sqrt().max(floor).max(1e-30)
}

/// The unit roundoff of `dtype`: 2^-(mantissa bits + 1). bf16 keeps 8 bits of significand
/// (7 stored), f16 11 (10 stored).
fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        _ => f64::EPSILON,
    }
}

/// Runs `layer` forward and backward (upstream gradient `r`), returning (y, dx, grads).
fn run<L: Layer>(
    layer: &mut L,
    x: &Tensor,
    ctx: &mut ForwardCtx,
    check: impl FnOnce(&Tensor, &L::Saved),
) -> (Tensor, Tensor, Vec<Tensor>) {
    let (y, saved) = layer.forward(x, ctx).unwrap();
    let saved = saved.expect("training saves");
    check(&y, &saved);
    ctx.clear_autocast_cache();
    let r = tensor(x.device(), y.shape(), 99, y.dtype());
    let dx = layer.backward(saved, r, true).unwrap().expect("dx");
    let grads = layer.params().iter().map(|p| p.grad.clone().expect("grad")).collect();
    (y, dx, grads)
}

/// `make()` twice (identical layers): one in f32, one under autocast to `low`; the output,
/// the input gradient and every parameter gradient agree within `k` unit roundoffs of `low`
/// (relative, in norm), and the parameter gradients are f32 (the parameters are).
fn compare<L: Layer>(
    name: &str,
    make: impl Fn() -> L,
    x: &Tensor,
    low: DType,
    k: f64,
    check: impl FnOnce(&Tensor, &L::Saved),
) -> f64 {
    let (mut a, mut b) = (make(), make());
    let x32 = x.to_dtype(DType::F32).unwrap(); // the same values, for the f32 layer
    let (y32, dx32, g32) = run(&mut a, &x32, &mut ForwardCtx::new(Mode::Train, 5), |_, _| {});
    let mut ctx = ForwardCtx::new(Mode::Train, 5).with_autocast(low).unwrap();
    let (y, dx, g) = run(&mut b, x, &mut ctx, check);
    assert_eq!(dx.dtype(), x.dtype(), "{name}: dx goes back in the input's dtype");
    let tol = k * unit_roundoff(low);
    let mut worst = 0f64;
    for (what, got, want) in [("y", &y, &y32), ("dx", &dx, &dx32)] {
        let e = rel_err(got, want, 0.0);
        assert!(e <= tol, "{name} {low}: {what} relative error {e:.2e} > {tol:.2e}");
        worst = worst.max(e);
    }
    assert_eq!(g.len(), g32.len());
    // A gradient is compared relative to its own norm, or to 1% of the largest gradient's
    // when it is smaller (a gradient that is zero in exact arithmetic).
    let floor = 0.01 * g32.iter().map(norm).fold(0.0, f64::max);
    for (i, (got, want)) in g.iter().zip(&g32).enumerate() {
        assert_eq!(got.dtype(), DType::F32, "{name}: gradient {i} accumulates in f32");
        let e = rel_err(got, want, floor);
        assert!(e <= tol, "{name} {low}: gradient {i} relative error {e:.2e} > {tol:.2e}");
        worst = worst.max(e);
    }
    eprintln!("{name} {low}: worst relative error {worst:.2e} (tolerance {tol:.2e})");
    worst
}

// Tolerances: an input and a weight rounded to the low dtype carry a relative error of at
// most one unit roundoff u each; a product of two rounded operands, accumulated in f32 and
// rounded once more to the output, is off by about 3u per element, and in norm (the errors
// of random sign partly cancel) by less. One layer is checked against 4u; the transformer
// block chains seven 16-bit products and two f32 softmax/norm stages, each adding its own
// rounding, and is checked against 8u. (Observed: about 1u for every layer in both dtypes.) A layer computing in the wrong dtype, dropping a
// gradient or scaling it wrongly is off by O(1), far above either.

#[test]
fn each_layer_under_autocast_matches_f32_and_has_pytorchs_dtypes() {
    let dev = Device::host(256 << 20);
    for low in [DType::BF16, DType::F16] {
        let x = tensor(&dev, &[6, 16], 1, DType::F32);
        // Linear with a fused GELU: input and weight cast, output in the low dtype, the
        // saved input its low copy.
        let make = || LinearConfig::new(16, 24).with_activation(Act::Gelu).with_seed(3).init(&dev);
        let e = compare(
            "Linear+GELU",
            || make().unwrap(),
            &x,
            low,
            4.0,
            |y, s| {
                assert_eq!(y.dtype(), low, "linear output");
                assert_eq!((s.saved_input().dtype(), s.input_dtype()), (low, DType::F32));
            },
        );
        assert!(e > 0.0, "autocast changed nothing: the layer did not compute in {low}");
        // LayerNorm on a 16-bit input: computed in f32, output f32, saves the f32 copy; the
        // input gradient goes back in 16 bits.
        let x16 = tensor(&dev, &[6, 16], 2, low);
        let make = || LayerNormConfig::new(16).init(&dev).unwrap();
        compare("LayerNorm", make, &x16, low, 4.0, |y, s| {
            assert_eq!(y.dtype(), DType::F32, "layer norm output");
            assert_eq!(s.saved_input().dtype(), DType::F32);
        });
        // Activations and dropout fall through: 16 bits in, 16 bits out.
        for act in [Activation::gelu(&dev), Activation::relu(&dev)] {
            let mut ctx = ForwardCtx::new(Mode::Train, 0).with_autocast(low).unwrap();
            let mut act = act;
            let (y, _) = act.forward(&x16, &mut ctx).unwrap();
            assert_eq!(y.dtype(), low);
        }
        let mut ctx = ForwardCtx::new(Mode::Train, 0).with_autocast(low).unwrap();
        let (y, _) = Dropout::new(&dev, 0.5).unwrap().forward(&x16, &mut ctx).unwrap();
        assert_eq!(y.dtype(), low);
        // The transformer block (dropout on: both runs draw the same masks): f32 residual
        // stream, f32 layer norms, 16-bit projections and products, f32 probabilities and
        // their 16-bit copy for `p @ v`.
        let (seq, d) = (8, 16);
        let xb = tensor(&dev, &[2 * seq, d], 4, DType::F32);
        let make = || {
            TransformerBlockConfig::new(d, 2, seq)
                .with_dropout(0.1)
                .with_seed(7)
                .init(&dev)
                .unwrap()
        };
        compare("TransformerBlock", make, &xb, low, 8.0, |y, s| {
            assert_eq!(y.dtype(), DType::F32, "residual stream");
            // Fused attention (the default) runs in 16 bits, as autocast runs SDPA; its
            // logsumexp is f32.
            assert!(s.attention_probs().is_none(), "fused attention saves no probabilities");
            let (out, lse) = s.attention_output_and_lse().unwrap();
            assert_eq!((out.dtype(), lse.dtype()), (low, DType::F32), "attention output");
            assert_eq!(s.queries().dtype(), low);
            let (ln_in, q_in) = s.ln1_and_q_inputs();
            assert_eq!((ln_in.dtype(), q_in.dtype()), (DType::F32, low));
        });
        let make_explicit = || {
            TransformerBlockConfig::new(d, 2, seq)
                .with_dropout(0.1)
                .with_seed(7)
                .with_attention(Attention::Explicit)
                .init(&dev)
                .unwrap()
        };
        compare("TransformerBlock (explicit)", make_explicit, &xb, low, 8.0, |y, s| {
            assert_eq!(y.dtype(), DType::F32, "residual stream");
            let (probs, pv) = s.attention_probs().unwrap();
            assert_eq!((probs.dtype(), pv.dtype()), (DType::F32, low), "probabilities");
            assert!(s.attention_output_and_lse().is_none());
            assert_eq!(s.queries().dtype(), low);
        });
    }
}

#[test]
fn a_weight_used_twice_in_one_forward_is_cast_once_and_the_cache_empties() {
    let dev = Device::host(64 << 20);
    // Sizes in whole 512-byte blocks (the allocator's rounding), so bytes compare exactly.
    let mut lin = LinearConfig::new(32, 256).init(&dev).unwrap();
    let x = tensor(&dev, &[4, 32], 1, DType::F32);
    let mut ctx = ForwardCtx::new(Mode::Train, 0).with_autocast(DType::BF16).unwrap();
    let cast_bytes = (32 * 256 + 256) * 2; // weight and bias in bf16
    let base = dev.memory_allocated();
    let (y1, s1) = lin.forward(&x, &mut ctx).unwrap();
    let first = dev.memory_allocated() - base;
    let (y2, s2) = lin.forward(&x, &mut ctx).unwrap(); // the same weight again
    let second = dev.memory_allocated() - base - first;
    let ac = ctx.autocast().unwrap();
    assert_eq!((ac.param_casts(), ac.cached()), (2, 2), "one cast per parameter");
    assert_eq!(ac.cached_bytes(), cast_bytes as u64);
    assert_eq!(first - second, cast_bytes as u64, "the second use allocates no cast");
    // Leaving the region empties the cache: the bias cast (saved by nobody) is freed, the
    // weight cast lives on in the two saved states until their backward.
    ctx.clear_autocast_cache();
    assert_eq!(ctx.autocast().unwrap().cached(), 0);
    assert_eq!(dev.memory_allocated() - base, first + second - 256 * 2);
    let dy = Tensor::full(&dev, y1.shape(), DType::BF16, 1.0).unwrap();
    lin.backward(s1.unwrap(), dy.clone(), false).unwrap();
    lin.backward(s2.unwrap(), dy.clone(), false).unwrap();
    let grad = lin.params().iter().map(|p| p.grad.as_ref().unwrap().size_in_bytes()).sum::<usize>();
    drop((y1, y2, dy));
    assert_eq!(dev.memory_allocated() - base, grad as u64, "only the f32 gradients remain");
}

fn chain(dev: &Device) -> Chain {
    let mut c = Chain::default();
    for i in 0..3 {
        c.push(
            TransformerBlockConfig::new(16, 2, 8).with_dropout(0.1).with_seed(i).init(dev).unwrap(),
        );
    }
    c.push(LayerNormConfig::new(16).init(dev).unwrap());
    c.push(LinearConfig::new(16, 16).with_seed(9).init(dev).unwrap());
    c
}

fn grads(c: &Chain) -> Vec<Vec<f32>> {
    c.params().iter().map(|p: &&Param| p.grad.as_ref().unwrap().to_f32_vec().unwrap()).collect()
}

#[test]
fn checkpointed_backward_under_autocast_equals_plain_backward() {
    let dev = Device::host(256 << 20);
    let x = tensor(&dev, &[16, 16], 3, DType::F32);
    let mut results = Vec::new();
    for schedule in [Schedule::none(5).unwrap(), Schedule::every(5, 2).unwrap()] {
        let mut c = chain(&dev);
        let mut ctx = ForwardCtx::new(Mode::Train, 11).with_autocast(DType::BF16).unwrap();
        let (y, tape) = c.forward(&x, &mut ctx, &schedule).unwrap();
        assert_eq!(y.dtype(), DType::BF16, "the last linear's output");
        ctx.clear_autocast_cache();
        let dy = tensor(&dev, y.shape(), 4, DType::BF16);
        let dx = c.backward(tape, dy, true).unwrap().unwrap();
        results.push((grads(&c), dx.to_f32_vec().unwrap()));
    }
    assert_eq!(results[0], results[1], "recomputation under the same autocast state");
    // And autocast did change the gradients against f32 (so the comparison means something).
    let mut c = chain(&dev);
    let (y, tape) =
        c.forward(&x, &mut ForwardCtx::new(Mode::Train, 11), &Schedule::none(5).unwrap()).unwrap();
    let dy = tensor(&dev, y.shape(), 4, DType::F32);
    c.backward(tape, dy, false).unwrap();
    assert_ne!(grads(&c), results[0].0);
}

/// The convolutional layers under autocast, as PyTorch's recipe runs a torchvision CNN:
/// convolutions in 16 bits (input and weight cast, output 16-bit), batch norm on the 16-bit
/// input with its f32 parameters and running statistics (output 16-bit), ReLU, pooling and
/// the residual sums in 16 bits, the head's linear in 16 bits; f32 gradients for every
/// parameter, the input gradient back in the input's dtype.
#[test]
fn convolutional_layers_under_autocast_match_f32_with_pytorchs_dtypes() {
    let dev = Device::host(256 << 20);
    for low in [DType::BF16, DType::F16] {
        // The stem: an f32 image in, 16 bits out, its saved input the 16-bit copy.
        let img = tensor(&dev, &[4, 3, 8, 8], 1, DType::F32);
        let make = || {
            Conv2dConfig::new(3, 6, 3)
                .with_batch_norm(true)
                .with_activation(Act::Relu)
                .with_seed(2)
                .init(&dev)
                .unwrap()
        };
        let e = compare("Conv2d+BN+ReLU", make, &img, low, 8.0, |y, s| {
            assert_eq!(y.dtype(), low, "conv + batch norm output");
            assert_eq!((s.saved_input().dtype(), s.input_dtype()), (low, DType::F32));
        });
        assert!(e > 0.0, "autocast changed nothing: the conv did not compute in {low}");
        // Blocks after the stem take 16-bit activations. They chain two or three 16-bit
        // convolutions, each batch-normed and then (but for the last) ReLU'd: a batch norm
        // centres its output on 0, so rounding flips some ReLU masks, each flip an O(1) error
        // at its element, and on these few hundred elements that dominates (observed: bf16
        // up to 0.13 in norm, f16 up to 0.02; without the flips, as for the single conv
        // above, about 2u). A wrong dtype, a dropped or mis-scaled gradient is off by O(1):
        // checked against 0.2.
        let loose = 0.2 / unit_roundoff(low);
        let x16 = tensor(&dev, &[4, 8, 6, 6], 3, low);
        let make = || {
            BottleneckConfig::new(8, 4, 16)
                .with_stride(2)
                .with_batch_norm(true)
                .with_seed(4)
                .init(&dev)
                .unwrap()
        };
        compare("Bottleneck+BN", make, &x16, low, loose, |y, _| assert_eq!(y.dtype(), low));
        let make = || ResidualBlockConfig::new(8).with_batch_norm(true).with_seed(5).init(&dev);
        compare(
            "ResidualBlock+BN",
            || make().unwrap(),
            &x16,
            low,
            loose,
            |y, _| assert_eq!(y.dtype(), low),
        );
        let make = || {
            InvertedResidualConfig::new(8, 24, 8)
                .with_batch_norm(true)
                .with_activation(Act::Hardswish)
                .with_squeeze_excitation(Some(8))
                .with_seed(6)
                .init(&dev)
        };
        compare(
            "InvertedResidual+BN+HS+SE",
            || make().unwrap(),
            &x16,
            low,
            loose,
            |y, _| assert_eq!(y.dtype(), low),
        );
        let make = || ClassifierHeadConfig::new(8, 5).with_hidden(12).with_seed(7).init(&dev);
        compare(
            "ClassifierHead",
            || make().unwrap(),
            &x16,
            low,
            8.0,
            |y, _| assert_eq!(y.dtype(), low, "the head's linear output"),
        );
    }
}

#[test]
fn layers_without_autocast_rules_refuse_it() {
    let dev = Device::host(64 << 20);
    let mut ctx = ForwardCtx::new(Mode::Train, 0).with_autocast(DType::BF16).unwrap();
    let mut mlp = BoxedLayer::new(ResidualMlpConfig::new(8, 16).init(&dev).unwrap());
    let x = tensor(&dev, &[2, 8], 1, DType::F32);
    let e = mlp.forward(&x, &mut ctx).unwrap_err();
    assert!(matches!(e, Error::AutocastUnsupported { .. }), "{e}");
    assert!(e.to_string().contains("does not support autocast"), "{e}");
    // Without autocast it runs.
    mlp.forward(&x, &mut ForwardCtx::new(Mode::Train, 0)).unwrap();
    // f32 is no low dtype.
    assert!(ForwardCtx::new(Mode::Train, 0).with_autocast(DType::F32).is_err());
}

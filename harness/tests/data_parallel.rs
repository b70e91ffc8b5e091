//! The data-parallel replica is the reference model: DDP and ZeRO-3 on N host devices with
//! `DpModel` give the parameters that single-device training of `Model` gives on the global
//! batch; and the `data-parallel` experiment's runs measure what they claim.

use std::time::Duration;

use vram_accum::Schedule;
use vram_accum::{ForwardCtx, Mode};
use vram_amp::{AdamW, Optimizer};
use vram_harness::data::Dataset;
use vram_harness::dp::{DeviceKind, DpBatch, DpModel, analytic_state_bytes, measure, measure_with};
use vram_harness::models::{Arch, HfModel, Model, ModelOptions};
use vram_harness::plan;
use vram_kernels::{AdamWConfig, DType, Device};
use vram_parallel::{
    Collective, DpConfig, HostCollective, InProcessGroup, Strategy, ring_bytes_per_param, train,
};

/// AdamW with eps 1e-3: the attention's key bias has a gradient that is zero in exact
/// arithmetic (softmax ignores a constant per row), so it is rounding noise whose sign
/// depends on the summation order; with PyTorch's eps 1e-8 Adam would turn that noise into
/// full-size steps of either sign. With 1e-3 the noise moves nothing, and the real
/// gradients (well above 1e-3) still get Adam's normalised steps.
fn adamw() -> AdamWConfig {
    AdamWConfig { lr: 0.01, eps: 1e-3, ..AdamWConfig::default() }
}

fn reference(arch: &Arch, data: &Dataset, samples: usize, steps: u64) -> Vec<Vec<f32>> {
    reference_of(&|| model(arch, None), data, samples, steps)
}

/// `arch` with seed 7 in f32 on a host device, under autocast to `low` if given.
fn model(arch: &Arch, low: Option<DType>) -> Model {
    let mut m = Model::new(&Device::host(64 << 20), arch.clone(), 7, DType::F32).unwrap();
    m.set_autocast(low).unwrap();
    m
}

/// The parameters after `steps` AdamW steps of the model `build` makes on one device.
fn reference_of(
    build: &dyn Fn() -> Model,
    data: &Dataset,
    samples: usize,
    steps: u64,
) -> Vec<Vec<f32>> {
    let mut model = build();
    let mut opt = AdamW::new(adamw());
    for i in 0..steps {
        model.zero_grad();
        let batch = data.batch(3, i, samples);
        model.train_step(&batch, &mut ForwardCtx::new(Mode::Train, 0), 1.0).unwrap();
        opt.step(&mut model).unwrap();
    }
    model.params().iter().map(|p| p.value.to_f32_vec().unwrap()).collect()
}

fn data_parallel(
    arch: &Arch,
    data: &Dataset,
    samples: usize,
    steps: u64,
    n: usize,
    strategy: Strategy,
) -> Vec<Vec<Vec<f32>>> {
    data_parallel_of(&|| model(arch, None), data, samples, steps, n, strategy, None)
}

/// Every rank's parameters after `steps` global batches of `strategy` over `n` host
/// devices, each replica the model `build` makes, checkpointing as `schedule` says if given.
fn data_parallel_of(
    build: &dyn Fn() -> Model,
    data: &Dataset,
    samples: usize,
    steps: u64,
    n: usize,
    strategy: Strategy,
    schedule: Option<&Schedule>,
) -> Vec<Vec<Vec<f32>>> {
    let comms: Vec<Box<dyn Collective>> = InProcessGroup::connect(n, Duration::from_secs(30))
        .unwrap()
        .into_iter()
        .map(|c| Box::new(HostCollective::new(c)) as Box<dyn Collective>)
        .collect();
    let replica = || {
        let m = DpModel::from_model(build());
        match schedule {
            Some(s) => m.with_checkpoint(s.clone()).unwrap(),
            None => m,
        }
    };
    let replicas: Vec<DpModel> = (0..n).map(|_| replica()).collect();
    let batches: Vec<DpBatch> = (0..steps).map(|i| DpBatch::new(data, 3, i, samples)).collect();
    let config = DpConfig { adamw: adamw(), ..DpConfig::new(strategy) };
    train(replicas, comms, config, &batches, |t| t.full_params())
        .into_iter()
        .map(|r| r.unwrap().1)
        .collect()
}

fn close(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: parameter count");
    for (i, (u, v)) in a.iter().zip(b).enumerate() {
        for (j, (x, y)) in u.iter().zip(v).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                "{what}: parameter {i}[{j}]: {x} vs {y}"
            );
        }
    }
}

#[test]
fn data_parallel_gpt_and_mlp_equal_the_reference_models_on_one_device() {
    let gpt =
        Arch::Gpt { vocab: 32, d: 16, layers: 2, heads: 2, seq: 8, dropout: 0.0, tied: false };
    let tokens = Dataset::Sequences { vocab: 32, seq: 8 };
    let mlp = Arch::Mlp { dims: vec![12, 20], classes: 5 };
    let clusters = Dataset::Clusters { dim: 12, classes: 5 };
    for (arch, data, samples) in [(gpt, tokens, 4), (mlp, clusters, 8)] {
        let want = reference(&arch, &data, samples, 3);
        for (n, s) in [
            (1, Strategy::Ddp),
            (2, Strategy::Ddp),
            (4, Strategy::Zero3),
            (2, Strategy::DataParallel),
        ] {
            for got in data_parallel(&arch, &data, samples, 3, n, s) {
                close(&got, &want, &format!("{arch:?} {} x{n}", s.name()));
            }
        }
    }
}

fn tiny_llama(tied: bool) -> Arch {
    let text = format!(
        r#"{{"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 40, "max_position_embeddings": 16, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": {tied}}}"#
    );
    HfModel::from_json_str("tiny-qwen2", &text).unwrap().arch.with_seq(8).unwrap()
}

/// A GPT whose LM head is its token embedding (GPT-2), and the Llama family (token
/// embedding only, rotary positions; tied and untied heads): every strategy on N devices
/// trains them as the model trains on one, the tied head's gradient (the head's and the
/// embedding's summed) reduced once.
#[test]
fn data_parallel_tied_gpt_and_llama_equal_the_reference_models() {
    let gpt = Arch::Gpt { vocab: 32, d: 16, layers: 2, heads: 2, seq: 8, dropout: 0.0, tied: true };
    let tokens = |vocab| Dataset::Sequences { vocab, seq: 8 };
    for (arch, data) in
        [(gpt, tokens(32)), (tiny_llama(true), tokens(40)), (tiny_llama(false), tokens(40))]
    {
        let want = reference(&arch, &data, 4, 3);
        for (n, s) in [
            (1, Strategy::Ddp),
            (2, Strategy::Ddp),
            (2, Strategy::Zero1),
            (2, Strategy::Zero2),
            (4, Strategy::Zero3),
            (2, Strategy::DataParallel),
        ] {
            for got in data_parallel(&arch, &data, 4, 3, n, s) {
                close(&got, &want, &format!("{} {} x{n}", arch.name(), s.name()));
            }
        }
    }
}

/// Under bf16 autocast (f32 weights, gradients and collectives) one device's DDP step is
/// the model's own, bit for bit; on two devices the halves' bf16 matmuls round as the
/// whole batch's do not, so the weights agree to bf16's rounding only, and ZeRO-3's agree
/// with DDP's bit for bit (the same sums of two halves).
#[test]
fn data_parallel_under_autocast_trains_as_the_autocast_model() {
    let bf16 = Some(DType::BF16);
    let gpt = Arch::Gpt { vocab: 32, d: 16, layers: 2, heads: 2, seq: 8, dropout: 0.0, tied: true };
    let data = Dataset::Sequences { vocab: 32, seq: 8 };
    let autocast = || model(&gpt, bf16);
    let want = reference_of(&autocast, &data, 4, 2);
    let one = data_parallel_of(&autocast, &data, 4, 2, 1, Strategy::Ddp, None);
    assert_eq!(one[0], want, "one device under autocast");
    let f32_run = reference(&gpt, &data, 4, 2);
    assert_ne!(want, f32_run, "autocast changes the weights");
    let ddp = data_parallel_of(&autocast, &data, 4, 2, 2, Strategy::Ddp, None);
    let zero3 = data_parallel_of(&autocast, &data, 4, 2, 2, Strategy::Zero3, None);
    assert_eq!(ddp[0], ddp[1], "DDP's ranks hold the same weights");
    assert_eq!(zero3[0], ddp[0], "ZeRO-3 under autocast = DDP");
    // nn.DataParallel: the tied head's logits whole (16-bit), the loss in f32 on device 0.
    let dp = data_parallel_of(&autocast, &data, 4, 2, 2, Strategy::DataParallel, None);
    for got in [&ddp[0], &dp[0]] {
        for (u, v) in got.iter().zip(&want) {
            for (x, y) in u.iter().zip(v) {
                assert!((x - y).abs() <= 2e-2 * y.abs().max(1.0), "{x} vs {y}");
            }
        }
    }
}

/// A channels_last CNN (the images converted on each device, the convolutions' weights
/// stored NHWC) trains under DDP and ZeRO-3 as the channels_last model trains on one device.
#[test]
fn data_parallel_trains_a_channels_last_cnn_as_the_model() {
    let arch = Arch::ResNet { width: 8, blocks: vec![1, 1], classes: 4 };
    let data = Dataset::Stripes { side: 8, classes: 4 };
    let opts = ModelOptions::default().with_channels_last(true);
    let build = || {
        let m = Model::with_options(&Device::host(64 << 20), arch.clone(), 7, DType::F32, opts);
        m.unwrap()
    };
    assert!(build().channels_last());
    let want = reference_of(&build, &data, 8, 3);
    for (n, strategy) in [(2, Strategy::Ddp), (2, Strategy::Zero3)] {
        for got in data_parallel_of(&build, &data, 8, 3, n, strategy, None) {
            close(&got, &want, &format!("channels_last {} x{n}", strategy.name()));
        }
    }
}

/// Activation checkpointing in every process (`torch.utils.checkpoint` under DDP or FSDP):
/// the checkpointed segments recompute in backward, the gradients are the plain run's, so
/// every strategy trains as the model without checkpointing.
#[test]
fn data_parallel_with_checkpointing_trains_as_the_plain_model() {
    let gpt = Arch::Gpt { vocab: 32, d: 16, layers: 3, heads: 2, seq: 8, dropout: 0.0, tied: true };
    let data = Dataset::Sequences { vocab: 32, seq: 8 };
    let want = reference(&gpt, &data, 4, 3);
    let n_layers = DpModel::from_model(model(&gpt, None)).chain_len();
    for schedule in [Schedule::every(n_layers, 1).unwrap(), Schedule::sqrt(n_layers).unwrap()] {
        assert!(schedule.segments().iter().any(|s| s.checkpointed), "{schedule:?}");
        for (n, strategy) in [(2, Strategy::Ddp), (2, Strategy::Zero2), (4, Strategy::Zero3)] {
            let build = || model(&gpt, None);
            let ranks = data_parallel_of(&build, &data, 4, 3, n, strategy, Some(&schedule));
            for got in ranks {
                close(&got, &want, &format!("{:?} {} x{n}", schedule, strategy.name()));
            }
        }
    }
}

/// At GPT-2 small's width on virtual devices: checkpointing every block lowers ZeRO-3's
/// per-device peak, and moves the same bytes per step (each layer gathered once in
/// backward, before its recomputation, as without checkpointing).
#[test]
fn zero3_with_checkpointing_holds_less_and_moves_the_same_bytes() {
    let arch = Arch::Gpt {
        vocab: 50257,
        d: 768,
        layers: 8,
        heads: 12,
        seq: 1024,
        dropout: 0.0,
        tied: true,
    };
    let batch = DpBatch::new(&Dataset::Sequences { vocab: 50257, seq: 1024 }, 0, 0, 4);
    let batches = [batch.clone(), batch];
    let run = |checkpoint: bool| {
        let build = |device: &Device| {
            let m = DpModel::new(device, &arch, 0, DType::BF16)?;
            if !checkpoint {
                return Ok(m);
            }
            let every = Schedule::every(m.chain_len(), 1).unwrap();
            m.with_checkpoint(every)
        };
        let config = DpConfig::new(Strategy::Zero3);
        measure_with(&build, config, 2, DeviceKind::Virtual(80 << 30), &batches).unwrap()
    };
    let (plain, ckpt) = (run(false), run(true));
    eprintln!(
        "zero-3 x2, 8 blocks at GPT-2 small width, 2 x 1024 tokens per device, bf16: peak \
         {} B plain, {} B checkpointing every block; {} B/param/step moved",
        plain.max_peak_allocated(),
        ckpt.max_peak_allocated(),
        ckpt.bytes_per_param_per_step()
    );
    // 1.18 GB against 1.36 GB (0.87x): the plain blocks keep only the MLP's pre-activation
    // (its GELU output is recomputed), so checkpointing has a little less to take away.
    assert!(
        (ckpt.max_peak_allocated() as f64) < 0.9 * plain.max_peak_allocated() as f64,
        "checkpointed {} vs plain {}",
        ckpt.max_peak_allocated(),
        plain.max_peak_allocated()
    );
    assert_eq!(ckpt.bytes_per_param_per_step(), plain.bytes_per_param_per_step());
    assert_eq!(ckpt.max_state_bytes(), plain.max_state_bytes());
}

#[test]
fn a_gpt_batch_splits_only_into_whole_sequences() {
    let gpt =
        Arch::Gpt { vocab: 32, d: 16, layers: 1, heads: 2, seq: 8, dropout: 0.0, tied: false };
    let data = Dataset::Sequences { vocab: 32, seq: 8 };
    let e = measure(
        &gpt,
        &data,
        DType::F32,
        DpConfig::new(Strategy::Ddp),
        4,
        DeviceKind::Host(64 << 20),
        6,
        1,
        0,
    )
    .unwrap_err();
    assert!(e.to_string().contains("does not split"), "{e}");
}

#[test]
fn zero3_on_virtual_devices_holds_the_analytic_share_of_a_real_size_gpt() {
    // GPT-2 small's shape in bf16 on 4 virtual devices: memory only, in well under a second.
    let arch = Arch::Gpt {
        vocab: 50257,
        d: 768,
        layers: 12,
        heads: 12,
        seq: 1024,
        dropout: 0.0,
        tied: false,
    };
    let data = Dataset::Sequences { vocab: 50257, seq: 1024 };
    let config = DpConfig::new(Strategy::Zero3);
    let run = measure(&arch, &data, DType::BF16, config, 4, DeviceKind::Virtual(80 << 30), 4, 2, 0)
        .unwrap();
    let want = analytic_state_bytes(&config, DType::BF16, run.params, 4).unwrap();
    let got = run.max_state_bytes() as f64;
    assert!((got - want).abs() / want < 0.001, "{got} vs {want}");
    // And its collectives move 3 (N-1)/N bytes per 2-byte parameter per step, counted on
    // the calls (a few shards padded to N).
    let moved = run.bytes_per_param_per_step();
    let ring = ring_bytes_per_param(Strategy::Zero3, 4, 2).unwrap();
    assert!((moved - ring).abs() / ring < 0.001, "{moved} vs {ring}");
}

/// DDP in bf16 with its kept gradient buckets holds 18 bytes per parameter on every device
/// (2 + 2 bf16 weights and gradients, 12 of f32 master and AdamW moments, 2 of buckets), as
/// measured on virtual devices and as the analytic layout says; without buckets, 16.
#[test]
fn ddp_in_bf16_holds_18_bytes_per_parameter_with_its_buckets() {
    let arch =
        Arch::Gpt { vocab: 1000, d: 256, layers: 2, heads: 4, seq: 64, dropout: 0.0, tied: false };
    let data = Dataset::Sequences { vocab: 1000, seq: 64 };
    let config = DpConfig::new(Strategy::Ddp);
    assert!(config.keep_buckets, "the default keeps DDP's buckets");
    let run = measure(&arch, &data, DType::BF16, config, 2, DeviceKind::Virtual(8 << 30), 4, 2, 0)
        .unwrap();
    let per_param = run.max_state_bytes() as f64 / run.params as f64;
    assert!((per_param - 18.0).abs() < 0.01, "{per_param} B/param");
    let analytic = analytic_state_bytes(&config, DType::BF16, run.params, 2).unwrap();
    assert_eq!(analytic / run.params as f64, 18.0);
    let no_buckets = DpConfig { keep_buckets: false, ..config };
    let without = analytic_state_bytes(&no_buckets, DType::BF16, run.params, 2).unwrap();
    assert_eq!(without / run.params as f64, 16.0);
}

#[test]
fn plan_nproc_reports_per_process_memory_and_bytes_per_step_for_ddp_and_zero() {
    let model = plan::model_from_args("gpt", &plan::ModelOverrides::default()).unwrap();
    let mut req = plan::PlanRequest::new(model, 8, 1 << 30);
    req.reserve = 0;
    req.precision = plan::PrecisionChoice::Only(plan::Precision::Bf16);
    let d = plan::data_parallel(&req, 4, plan::PlanKind::None).unwrap();
    assert_eq!((d.nproc, d.per_process_batch), (4, 2));
    let row = |s: &str| d.rows.iter().find(|r| r.strategy == s).unwrap();
    for r in &d.rows {
        let a = r.analytic_bytes_per_param_per_step.unwrap();
        assert!((r.bytes_per_param_per_step - a).abs() / a < 0.01, "{}: {r:?}", r.strategy);
        let m = r.analytic_model_states.unwrap() as f64;
        assert!((r.model_states as f64 - m).abs() / m < 0.01, "{}: {r:?}", r.strategy);
        assert!(r.fits);
    }
    assert!(row("zero-3").model_states < row("zero-2").model_states);
    assert!(row("zero-2").model_states < row("zero-1").model_states);
    assert!(row("zero-1").model_states < row("ddp").model_states);
    assert!(row("zero-3").bytes_per_param_per_step > 1.4 * row("ddp").bytes_per_param_per_step);
    assert!(
        plan::data_parallel(&req, 3, plan::PlanKind::None).is_err(),
        "8 samples do not split over 3"
    );
}

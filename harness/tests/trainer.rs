//! The trainer composes precision, accumulation and checkpointing, and calls its hooks.

use vram_accum::ForwardCtx;
use vram_accum::{CheckpointPlan, Mode};
use vram_amp::ScalerConfig;
use vram_harness::data::Dataset;
use vram_harness::models::{Arch, Model};
use vram_harness::trainer::{BatchEnd, Hooks, Precision, TrainConfig, Trainer};
use vram_kernels::{DType, Device};

#[derive(Default)]
struct Count {
    backward: usize,
    batches: Vec<usize>,
    epochs: Vec<usize>,
}

impl Hooks for Count {
    fn on_backward_end(&mut self, _step: usize, _model: &Model) {
        self.backward += 1;
    }
    fn on_batch_end(&mut self, end: &BatchEnd) {
        self.batches.push(end.step);
    }
    fn on_epoch_end(&mut self, epoch: usize) {
        self.epochs.push(epoch);
    }
}

fn gpt() -> (Arch, Dataset) {
    (
        Arch::Gpt { vocab: 16, d: 32, layers: 2, heads: 2, seq: 8, dropout: 0.1, tied: false },
        Dataset::Sequences { vocab: 16, seq: 8 },
    )
}

#[test]
fn hooks_run_after_backward_each_batch_and_each_epoch() {
    let (arch, data) = gpt();
    let dev = Device::host(1 << 30);
    let model = Model::new(&dev, arch, 1, vram_kernels::DType::F32).unwrap();
    let cfg = TrainConfig { batch: 8, steps_per_epoch: 3, ..TrainConfig::default() };
    let mut trainer = Trainer::new(model, data, 1, cfg).unwrap();
    let mut count = Count::default();
    trainer.run(7, &mut count).unwrap();
    assert_eq!(count.backward, 7);
    assert_eq!(count.batches, (0..7).collect::<Vec<_>>());
    assert_eq!(count.epochs, [0, 1]);
}

/// Every precision, with accumulation and a checkpoint plan, learns: the loss falls.
#[test]
fn every_precision_with_accumulation_and_checkpointing_learns() {
    for precision in [
        Precision::F32,
        Precision::F16(ScalerConfig::default()),
        Precision::Bf16,
        Precision::Autocast { low: DType::BF16, scaler: None },
        Precision::Autocast { low: DType::F16, scaler: Some(ScalerConfig::default()) },
    ] {
        let (arch, data) = gpt();
        let dev = Device::host(1 << 30);
        let model = Model::new(&dev, arch, 1, precision.dtype()).unwrap();
        let cfg = TrainConfig {
            batch: 8,
            accumulation: 2,
            checkpoint: CheckpointPlan::Sqrt,
            precision: precision.clone(),
            lr: 3e-3,
            ..TrainConfig::default()
        };
        let mut trainer = Trainer::new(model, data.clone(), 1, cfg).unwrap();
        let eval = data.batch(1, 1 << 40, 32);
        let before = trainer.model_mut().eval_loss(&eval, Mode::Inference).unwrap();
        trainer.run(60, &mut vram_harness::trainer::NoHooks).unwrap();
        let after = trainer.model_mut().eval_loss(&eval, Mode::Inference).unwrap();
        assert!(after < 0.7 * before, "{precision:?}: loss {before} -> {after}");
        assert!(trainer.schedule().segments().iter().any(|s| s.checkpointed));
        let state = trainer.state_bytes();
        match precision {
            Precision::F32 => assert_eq!(state.master, 0),
            Precision::Autocast { .. } => {
                // f32 parameters, gradients and moments; no master copy; 2 bytes per cast
                // parameter (every linear's weight and bias: not the embeddings or norms).
                assert_eq!((state.master, state.grads), (0, state.weights), "{precision:?}");
                assert_eq!(state.optimizer, 2 * state.weights);
                let cast: u64 = trainer
                    .model()
                    .params()
                    .iter()
                    .filter(|p| {
                        !(p.name.contains("ln")
                            || p.name.starts_with("wte")
                            || p.name.starts_with("wpe"))
                    })
                    .map(|p| 2 * p.value.numel() as u64)
                    .sum();
                assert_eq!(state.weight_copies, cast, "{precision:?}");
            }
            _ => {
                assert_eq!(state.master, 2 * state.weights, "f32 masters are twice 16-bit weights")
            }
        }
    }
}

#[test]
fn a_batch_that_micro_batches_do_not_divide_is_an_error() {
    let (arch, data) = gpt();
    let dev = Device::host(1 << 30);
    let model = Model::new(&dev, arch, 1, vram_kernels::DType::F32).unwrap();
    let cfg = TrainConfig { batch: 10, accumulation: 4, ..TrainConfig::default() };
    let err = Trainer::new(model, data, 1, cfg).err().expect("10 is not a multiple of 4");
    assert!(err.to_string().contains("multiple"), "{err}");
}

/// An out-of-memory error raised anywhere in an f16 step (a layer, the loss scaler, the
/// optimizer creating its f32 masters and moments) reaches the caller as one: on a host
/// device too small for the run, every failure reports as OOM, and at some capacity the
/// failure comes from vram-amp (the scaler and optimizer step).
#[test]
fn an_f16_run_on_a_tiny_device_fails_with_an_error_that_reports_as_oom() {
    use vram_harness::ExperimentError;
    let arch =
        Arch::Gpt { vocab: 16, d: 128, layers: 4, heads: 4, seq: 8, dropout: 0.0, tied: false };
    let data = Dataset::Sequences { vocab: 16, seq: 8 };
    let (mut ooms, mut from_amp, mut fitted) = (0, 0, false);
    for mib in 1..=64 {
        let dev = Device::host(mib << 20);
        let Ok(model) = Model::new(&dev, arch.clone(), 1, vram_kernels::DType::F16) else {
            continue;
        };
        let cfg = TrainConfig {
            batch: 2,
            // A scale that does not overflow, so that the first step updates (and allocates
            // the optimizer's masters and moments).
            precision: Precision::F16(ScalerConfig { init_scale: 1.0, ..ScalerConfig::default() }),
            ..TrainConfig::default()
        };
        let mut trainer = Trainer::new(model, data.clone(), 1, cfg).unwrap();
        match trainer.run(2, &mut vram_harness::trainer::NoHooks) {
            Ok(_) => {
                fitted = true;
                break;
            }
            Err(e) => {
                assert!(e.is_out_of_memory(), "{mib} MiB: {e}");
                ooms += 1;
                from_amp += usize::from(matches!(e, ExperimentError::Amp(_)));
            }
        }
    }
    assert!(ooms > 0 && fitted, "{ooms} OOMs, fitted at last: {fitted}");
    assert!(from_amp > 0, "no OOM came from the scaler or the optimizer ({ooms} OOMs)");
}

/// bf16 autocast tracks f32 training step by step: the same model (tied LM head, dropout:
/// both runs draw the same masks), data and optimizer, the losses within a tolerance taken
/// from observed behaviour: over 30 steps the largest difference was 0.002 (losses falling
/// from 2.82 to 1.29), so 0.02 (ten times that, under 1% of the first loss) leaves a margin
/// while a run that computed wrongly (a lost gradient, a wrong scale) drifts apart by more.
#[test]
fn bf16_autocast_training_tracks_f32_training() {
    let arch =
        Arch::Gpt { vocab: 16, d: 32, layers: 2, heads: 2, seq: 8, dropout: 0.1, tied: true };
    let data = Dataset::Sequences { vocab: 16, seq: 8 };
    let mut losses = Vec::new();
    for precision in [Precision::F32, Precision::Autocast { low: DType::BF16, scaler: None }] {
        let dev = Device::host(1 << 30);
        let model = Model::new(&dev, arch.clone(), 1, precision.dtype()).unwrap();
        let cfg = TrainConfig { batch: 8, precision, lr: 3e-3, ..TrainConfig::default() };
        let mut trainer = Trainer::new(model, data.clone(), 1, cfg).unwrap();
        let ends = trainer.run(30, &mut vram_harness::trainer::NoHooks).unwrap();
        losses.push(ends.iter().map(|e| e.loss).collect::<Vec<_>>());
    }
    let diff = losses[0].iter().zip(&losses[1]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!(
        "largest loss difference {diff:.4}; f32 {:?}; bf16 autocast {:?}",
        losses[0], losses[1]
    );
    assert!(diff > 0.0, "autocast computed exactly as f32: it did not run in bf16");
    assert!(diff < 0.02, "largest loss difference {diff}");
    assert!(losses[1][29] < 0.9 * losses[1][0], "autocast learns: {:?}", losses[1]);
}

/// The model under autocast: the cache holds one cast per weight during the forward and is
/// empty after the step; bad settings are errors, unsupported layers too (no panic).
#[test]
fn autocast_models_empty_their_cast_cache_and_refuse_bad_settings() {
    let (arch, data) = gpt();
    let dev = Device::host(1 << 30);
    let mut model = Model::new(&dev, arch.clone(), 1, DType::F32).unwrap();
    assert!(model.set_autocast(Some(DType::F32)).is_err());
    model.set_autocast(Some(DType::BF16)).unwrap();
    let batch = data.batch(1, 0, 4);
    let mut ctx = ForwardCtx::new(Mode::Train, 1);
    model.train_step(&batch, &mut ctx, 1.0).unwrap();
    assert_eq!(ctx.autocast().map(|a| a.cached()), Some(0), "the cache is cleared");
    assert!(model.cast_cache_bytes() > 0);
    assert!(model.params().iter().all(|p| p.grad.as_ref().unwrap().dtype() == DType::F32));
    // A 16-bit model cannot autocast (its parameters must be f32).
    let mut half = Model::new(&dev, arch, 1, DType::BF16).unwrap();
    let e = half.set_autocast(Some(DType::BF16)).unwrap_err();
    assert!(e.to_string().contains("f32"), "{e}");
    // A CNN (batch norms included) trains under autocast too: its first loss is the f32
    // model's to within 16-bit rounding, and every gradient is f32.
    let cnn = Arch::preset("resnet50").unwrap().with_side(32).unwrap().with_classes(4).unwrap();
    let cnn = cnn.with_width(0.125).unwrap().with_depth(0.34).unwrap();
    let images = cnn.dataset().batch(1, 0, 4);
    let mut losses = Vec::new();
    for low in [None, Some(DType::F16), Some(DType::BF16)] {
        let mut model = Model::new(&dev, cnn.clone(), 1, DType::F32).unwrap();
        model.set_autocast(low).unwrap();
        let out = model.train_step(&images, &mut ForwardCtx::new(Mode::Train, 1), 1.0).unwrap();
        assert!(model.params().iter().all(|p| p.grad.as_ref().unwrap().dtype() == DType::F32));
        losses.push(out.loss);
    }
    assert!(losses[1] != losses[0] && losses[2] != losses[0], "16-bit ran: {losses:?}");
    for l in &losses[1..] {
        assert!((l - losses[0]).abs() < 0.02 * losses[0], "{losses:?}");
    }
}

//! Checkpointed backward reproduces the plain backward bit for bit.

mod common;

use common::{bits, device, layer, step_bits, tensor};
use proptest::prelude::*;
use vram_accum::{Chain, CheckpointPlan, Error, ForwardCtx, Mode, Schedule, Segment};

const D: usize = 8;

fn random_chain(kinds: &[u8], seed: u64) -> (vram_kernels::Device, Chain) {
    let dev = device();
    let layers = kinds.iter().enumerate().map(|(i, &k)| layer(&dev, k, D, seed + i as u64));
    (dev.clone(), Chain::new(layers.collect()))
}

/// Segments cut before every layer `i > 0` with `cuts[i]`, checkpointed per `flags`.
fn segmentation(n: usize, cuts: &[bool], flags: &[bool]) -> Schedule {
    let mut segments: Vec<Segment> = Vec::new();
    let mut start = 0;
    for i in 1..=n {
        if i == n || cuts[i % cuts.len()] {
            let checkpointed = flags[segments.len() % flags.len()];
            segments.push(Segment { start, end: i, checkpointed });
            start = i;
        }
    }
    Schedule::from_segments(segments).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Property: for any chain of Linear/ReLU/GELU/Dropout/LayerNorm/residual-MLP layers and
    /// any segmentation with any segments checkpointed, the forward output, the input
    /// gradient and every parameter gradient are bit-identical to the plain (no
    /// checkpointing) run with the same seed.
    #[test]
    fn any_segmentation_gives_plain_outputs_and_gradients_bit_for_bit(
        kinds in prop::collection::vec(0u8..6, 1..10),
        cuts in prop::collection::vec(any::<bool>(), 1..10),
        flags in prop::collection::vec(any::<bool>(), 1..10),
        seed in 0u64..1000,
    ) {
        let (dev, mut chain) = random_chain(&kinds, seed);
        let x = tensor(&dev, &[4, D], seed ^ 0xABCD);
        let n = kinds.len();
        let plain = step_bits(&mut chain, &x, seed, &Schedule::none(n).unwrap());
        let ckpt = step_bits(&mut chain, &x, seed, &segmentation(n, &cuts, &flags));
        prop_assert!(plain.0 == ckpt.0, "forward outputs differ");
        prop_assert!(plain.1 == ckpt.1, "input gradients differ");
        prop_assert!(plain.2 == ckpt.2, "parameter gradients differ");
    }
}

#[test]
fn every_named_plan_gives_plain_gradients_bit_for_bit_with_dropout() {
    let kinds: Vec<u8> = (0..12).map(|i| [5, 3, 0, 2, 4, 1][i % 6]).collect();
    let (dev, mut chain) = random_chain(&kinds, 11);
    let x = tensor(&dev, &[4, D], 5);
    let n = kinds.len();
    let plain = step_bits(&mut chain, &x, 9, &Schedule::none(n).unwrap());
    let ctx = ForwardCtx::new(Mode::Train, 9);
    let profile = chain.profile(&x, &ctx, true).unwrap();
    let full = profile.predict(&Schedule::none(n).unwrap()).unwrap().peak_bytes;
    let min = profile.min_peak_bytes();
    let mut plans = vec![CheckpointPlan::None, CheckpointPlan::Sqrt];
    plans.extend((1..=n).map(CheckpointPlan::EveryK));
    plans.extend([min, (min + full) / 2, full].map(|bytes| CheckpointPlan::Budget { bytes }));
    for plan in plans {
        let schedule = plan.schedule(&profile).unwrap();
        assert_eq!(step_bits(&mut chain, &x, 9, &schedule), plain, "{plan:?}");
    }
}

#[test]
fn inference_saves_nothing_and_matches_the_training_output_without_dropout() {
    let kinds = [0u8, 4, 2, 0, 1];
    let (dev, mut chain) = random_chain(&kinds, 3);
    let x = tensor(&dev, &[4, D], 1);
    let base = dev.memory_allocated();
    dev.reset_peak_stats();
    let y = chain.infer(&x).unwrap();
    // Nothing but the output outlives the pass.
    assert_eq!(dev.memory_allocated() - base, 512);
    let mut ctx = ForwardCtx::new(Mode::Train, 0);
    let (y_train, tape) = chain.forward(&x, &mut ctx, &Schedule::none(5).unwrap()).unwrap();
    assert_eq!(common::bits(&y), common::bits(&y_train));
    drop(tape);

    let mut ctx = ForwardCtx::new(Mode::Inference, 0);
    let (y, tape) = chain.forward(&x, &mut ctx, &Schedule::none(5).unwrap()).unwrap();
    assert!(matches!(chain.backward(tape, y, false), Err(Error::InferenceTape)));
}

#[test]
fn a_schedule_for_another_chain_length_is_an_error() {
    let (dev, mut chain) = random_chain(&[0, 1], 0);
    let x = tensor(&dev, &[4, D], 1);
    let mut ctx = ForwardCtx::new(Mode::Train, 0);
    let err = chain.forward(&x, &mut ctx, &Schedule::none(3).unwrap()).unwrap_err();
    assert!(matches!(err, Error::LengthMismatch { expected: 2, got: 3, .. }));
}

/// Regression: a tape from one chain given to another chain's backward used to panic on an
/// index when the chains' lengths differed, and to compute wrong gradients silently when
/// they matched. The tape names its chain; any other chain refuses it before touching a
/// gradient.
#[test]
fn a_tape_from_another_chain_is_refused_and_touches_no_gradient() {
    let (dev, mut a) = random_chain(&[0, 1, 0], 1);
    let x = tensor(&dev, &[4, D], 1);
    let mut shorter = Chain::new(vec![common::layer(&dev, 0, D, 2), common::layer(&dev, 1, D, 2)]);
    let mut same_shape =
        Chain::new((0..3).map(|i| common::layer(&dev, [0, 1, 0][i], D, 3)).collect());
    let schedule = Schedule::sqrt(3).unwrap();
    for other in [&mut shorter, &mut same_shape] {
        let (y, tape) = a.forward(&x, &mut ForwardCtx::new(Mode::Train, 0), &schedule).unwrap();
        assert_eq!((tape.chain(), tape.schedule()), (a.id(), Some(&schedule)));
        let err = other.backward(tape, y, true).unwrap_err();
        assert!(
            matches!(err, Error::ForeignTape { chain, tape } if chain == other.id() && tape == a.id()),
            "{err}"
        );
        assert!(common::grad_bits(other).iter().all(Option::is_none));
    }
    assert!(common::grad_bits(&a).iter().all(Option::is_none));
}

#[test]
fn a_tape_recorded_before_the_chain_changed_is_refused() {
    let (dev, mut chain) = random_chain(&[0, 1], 1);
    let x = tensor(&dev, &[4, D], 1);
    let mut ctx = ForwardCtx::new(Mode::Train, 0);
    let (y, tape) = chain.forward(&x, &mut ctx, &Schedule::none(2).unwrap()).unwrap();
    chain.push(vram_accum::layers::Activation::relu(&dev));
    assert!(matches!(chain.backward(tape, y, false), Err(Error::StaleTape { .. })));
    let (y, tape) = chain.forward(&x, &mut ctx, &Schedule::none(3).unwrap()).unwrap();
    chain.layers_mut()[2] = common::layer(&dev, 0, D, 9);
    assert!(matches!(chain.backward(tape, y, false), Err(Error::StaleTape { .. })));
    assert!(common::grad_bits(&chain).iter().all(Option::is_none));
    let (y, tape) = chain.forward(&x, &mut ctx, &Schedule::none(3).unwrap()).unwrap();
    chain.backward(tape, y, false).unwrap();
    assert!(common::grad_bits(&chain).iter().all(Option::is_some));
}

/// A boxed layer's backward refuses state saved by a layer of another type.
#[test]
fn saved_state_of_another_layer_type_is_an_error() {
    let dev = common::device();
    let x = tensor(&dev, &[4, D], 1);
    let mut ctx = ForwardCtx::new(Mode::Train, 0);
    let mut linear = common::layer(&dev, 0, D, 1);
    let mut norm = common::layer(&dev, 4, D, 1);
    let (y, saved) = norm.forward(&x, &mut ctx).unwrap();
    let err = linear.backward(saved.unwrap(), y, true).unwrap_err();
    assert!(matches!(err, Error::ForeignSavedState { .. }), "{err}");
}

/// A chain of batch-normed convolutions: checkpointing recomputes the norms' forward, which
/// must not move the running statistics a second time (PyTorch's checkpoint does:
/// pytorch/pytorch#96136). After two steps under any schedule, gradients are bit-identical
/// and evaluation (which normalizes with the running statistics) gives the same output as
/// after plain steps; it differs from the output before training, so the statistics moved.
#[test]
fn checkpointing_moves_batch_norm_running_statistics_once() {
    use vram_accum::BoxedLayer;
    use vram_accum::layers::{Act, Conv2dConfig, ResidualBlockConfig};
    let build = || {
        let dev = device();
        let conv = Conv2dConfig::new(2, 4, 3)
            .with_batch_norm(true)
            .with_activation(Act::Relu)
            .with_seed(1)
            .init(&dev)
            .unwrap();
        let block = ResidualBlockConfig::new(4).with_batch_norm(true).with_seed(2).init(&dev);
        let chain = Chain::new(vec![BoxedLayer::new(conv), BoxedLayer::new(block.unwrap())]);
        (dev, chain)
    };
    let eval = |chain: &mut Chain, x: &vram_kernels::Tensor| bits(&chain.infer(x).unwrap());
    let (dev, mut plain) = build();
    let x = tensor(&dev, &[3, 2, 5, 5], 7);
    let before = eval(&mut plain, &x);
    let none = Schedule::none(2).unwrap();
    let plain_steps: Vec<_> = (0..2).map(|s| step_bits(&mut plain, &x, s, &none)).collect();
    let after = eval(&mut plain, &x);
    assert_ne!(before, after, "training moved the running statistics");
    for schedule in [Schedule::every(2, 1).unwrap(), Schedule::every(2, 2).unwrap()] {
        let (dev, mut chain) = build();
        let x = tensor(&dev, &[3, 2, 5, 5], 7);
        let steps: Vec<_> = (0..2).map(|s| step_bits(&mut chain, &x, s, &schedule)).collect();
        assert_eq!(steps, plain_steps, "{schedule:?}: outputs and gradients");
        assert_eq!(eval(&mut chain, &x), after, "{schedule:?}: running statistics");
    }
}
